"""The kernels of one Inductor-generated CUDA module, read from its wrapper code.

Inductor writes each compiled graph as a Python module: every Triton kernel it generated is
defined once (`name = async_compile.triton('name', '''source''', ...)`, its category in the
heuristics decorator, the bytes it moves in `inductor_meta['kernel_num_gb']` when
`benchmark_kernel` is on), and the module's `call(args)` launches them in order
(`name.run(...)`) between the extern kernels it calls (`extern_kernels.mm(...)` for cuBLAS GEMMs,
`torch.ops.NS.OP.default(...)` or `aten.OP.overload(...)` for attention, custom ops and aten fallbacks).

`launches(source)` lists what `call` runs, one `Launch` per kernel call, in order. Pure text work:
testable on any wrapper module without torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Inductor's kernel categories (its heuristics decorators); "extern" for everything it calls instead, and
# "fused op" for the project's own single-pass element-wise kernels that it calls (`with_op_bytes`).
POINTWISE, REDUCTION, PERSISTENT_REDUCTION, FOREACH, TEMPLATE, EXTERN, FUSED_OP = (
    "pointwise", "reduction", "persistent_reduction", "foreach", "template", "extern", "fused op")
# Kernels of element-wise work: what the element-wise bytes of a step sum.
ELEMENTWISE = (POINTWISE, REDUCTION, PERSISTENT_REDUCTION, FOREACH, FUSED_OP)
# What an extern call is, by the op's name.
GEMM, ATTENTION, CUSTOM, FALLBACK = "gemm", "attention", "custom op", "aten fallback"
# mm_dtype: `mm(out_dtype=)`, an fp32 product of bf16 operands
_GEMMS = ("mm", "mm_dtype", "addmm", "bmm", "baddbmm", "_scaled_mm", "_int_mm", "_scaled_grouped_mm")
_ATTENTION_WORDS = ("attention", "flash", "cudnn_attention", "efficient_attention")

_DEFINITION = re.compile(r"^(\w+) = async_compile\.triton\('\w+', '''(.*?)'''", re.S | re.M)
_CATEGORY = re.compile(r"@triton_heuristics\.(\w+)\(")
_NUM_GB = re.compile(r"'kernel_num_gb': ([0-9.eE+-]+)")
_CALL = re.compile(r"^( *)def call\((?:self, )?args\)", re.M)
_RUN = re.compile(r"^\s*(\w+)\.run\(")
_EXTERN = re.compile(r"^\s*(?:\w+ = )?extern_kernels\.(\w+)\(")
_OP = re.compile(r"^\s*(?:[\w, ]+ = )?(?:torch\.ops\.(\w+)|(aten))\.(\w+)\.\w+\(")
_QUOTED = re.compile(r"'''.*?'''", re.S)


@dataclass(frozen=True)
class Kernel:
    """A Triton kernel the module defines."""

    name: str
    kind: str  # POINTWISE, REDUCTION, PERSISTENT_REDUCTION, FOREACH, TEMPLATE
    bytes: int | None  # what Inductor counts it reads and writes; None where it gives no count


@dataclass(frozen=True)
class Launch:
    """One kernel call of the module's `call`."""

    name: str  # the Triton kernel's name, or the extern op's ("mm", "mlperf_bert.varlen_flash_forward")
    kind: str  # a Kernel kind, or EXTERN
    bytes: int | None  # generated kernels: Inductor's count; extern kernels: None (GEMMs are timed by FLOPs)
    extern: str | None = None  # GEMM, ATTENTION, CUSTOM or FALLBACK for an extern call

    @property
    def elementwise(self) -> bool:
        return self.kind in ELEMENTWISE


def kernel_kind(source: str) -> str:
    """The heuristics decorator of a kernel's source: pointwise, reduction, persistent_reduction, foreach,
    template (Inductor's own categories; `user_autotune` and unknown ones kept as written)."""
    found = _CATEGORY.search(source)
    if found is None:
        return TEMPLATE if "@triton.jit" in source and "template" in source else "unknown"
    return found.group(1)


def kernels(source: str) -> dict[str, Kernel]:
    """Every Triton kernel the module defines, by its variable name."""
    found = {}
    for match in _DEFINITION.finditer(source):
        name, body = match.group(1), match.group(2)
        num_gb = _NUM_GB.search(body)
        found[name] = Kernel(name, kernel_kind(body), None if num_gb is None else round(float(num_gb.group(1)) * 1e9))
    return found


def extern_kind(namespace: str, op: str) -> str:
    if op in _GEMMS:
        return GEMM
    if any(word in op for word in _ATTENTION_WORDS):
        return ATTENTION
    return FALLBACK if namespace == "aten" else CUSTOM


def _call_body(source: str) -> list[str]:
    """The lines of the module's `call` function (kernel sources blanked out: their benchmark harnesses
    have `.run(` lines and a `call` of their own)."""
    outside = _QUOTED.sub("''''''", source)
    start = _CALL.search(outside)
    if start is None:
        raise ValueError("no `def call(` in this module: not an Inductor wrapper module")
    indent = len(start.group(1))
    body = []
    for line in outside[start.end():].splitlines()[1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        body.append(line)
    return body


def launches(source: str) -> list[Launch]:
    """The kernels `call` launches, in order."""
    defined = kernels(source)
    found = []
    for line in _call_body(source):
        run, extern, op = _RUN.match(line), _EXTERN.match(line), _OP.match(line)
        if run is not None and run.group(1) in defined:
            kernel = defined[run.group(1)]
            found.append(Launch(kernel.name, kernel.kind, kernel.bytes))
        elif extern is not None:
            found.append(Launch(extern.group(1), EXTERN, None, extern_kind("aten", extern.group(1))))
        elif op is not None:
            namespace, name = op.group(1) or op.group(2), op.group(3)
            found.append(Launch(f"{namespace}.{name}", EXTERN, None, extern_kind(namespace, name)))
    return found


def with_op_bytes(found: list[Launch], op_bytes: dict[str, list[int]]) -> list[Launch]:
    """`found` with each call of a single-pass op (`op_bytes`: the op's name -> the bytes of its calls, in the
    order the graph makes them) as a FUSED_OP launch with its bytes. Inductor keeps the calls of one extern
    op in their graph order; a count that differs is an error, never a guess."""
    left = {name: list(sizes) for name, sizes in op_bytes.items()}
    out = []
    for launch in found:
        sizes = left.get(launch.name)
        if launch.kind != EXTERN or sizes is None:
            out.append(launch)
            continue
        if not sizes:
            raise ValueError(f"{launch.name}: the module calls it more often than its graph does")
        out.append(Launch(launch.name, FUSED_OP, sizes.pop(0), launch.extern))
    missing = {name: len(sizes) for name, sizes in left.items() if sizes}
    if missing:
        raise ValueError(f"calls of the graph the module does not make: {missing}")
    return out
