"""The Triton kernels of the fused optimizer passes (`fused.py`), and their launches.

Imported only where they run: by `fused.py` for CUDA tensors, and by the tests, which run these
kernels on CPU tensors through Triton's interpreter (`kernels(interpret=True)`, in a process started
with TRITON_INTERPRET=1: Triton decides at import whether its own library functions are compiled or
interpreted). Triton comes with torch's CUDA wheels, not with its CPU ones.

One launch covers a list of T float32 tensors: a parameter group, or a group's pieces of this rank's
shard. Each program of the pass kernel covers BLOCK consecutive elements of one tensor, and reads
where they are from two small tables:

- `addresses` [T, 4] int64: the data pointers of each tensor's parameter, gradient, exp_avg and
  exp_avg_sq. Tensors that may move between steps (the unsharded optimizer's: autograd allocates the
  gradients, and a captured backward allocates them from the graph's pool) are described on the
  device by `_describe` at every call, which takes them as kernel arguments, CHUNK tensors of each
  kind per launch: a CUDA graph keeps a kernel's arguments by value, so the capture's addresses reach
  every replay with no host-to-device copy. Tensors that never move (the sharded optimizer's views of
  its flat buffers, `static=True`) are described once on the host: the views sit at arbitrary
  offsets, and Triton compiles a kernel once per pattern of 16-byte-aligned arguments.
- `layout` [T, 2] int64 (elements, first program) and `owner` [P] int32 (each program's tensor): a
  function of the shapes alone, built on the host at the first call with these shapes and kept.

The host-built tables are made in an eager call: the warm-up steps before a CUDA-graph capture make
them, and one missing inside a capture raises (`_host_table`) rather than copy from the host there.

Per-tensor norms are reduced without atomics: each program writes its block's two partial sums and
`_sums` adds each tensor's partials in program order, so a step's result does not depend on the
order in which programs ran.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements per program of a pass (8 warps: 16 per thread and tensor)
CHUNK = 64  # tensors of each kind per `_describe` launch: 256 pointer arguments, 2 KiB of a kernel's 4 KiB
REDUCE_BLOCK = 1024  # partial sums per iteration of `_sums`
_ROW = 4  # addresses per tensor: parameter, gradient, exp_avg, exp_avg_sq


def _describe(addresses, first, count, params, grads, exp_avg, exp_avg_sq, CHUNK: tl.constexpr):
    """Rows first .. first + count - 1 of `addresses`: the data pointers of the given tensors (tuples
    of CHUNK, padded past `count`)."""
    for i in tl.static_range(CHUNK):
        if i < count:
            row = addresses + (first + i) * 4
            tl.store(row, params[i].to(tl.int64, bitcast=True))
            tl.store(row + 1, grads[i].to(tl.int64, bitcast=True))
            tl.store(row + 2, exp_avg[i].to(tl.int64, bitcast=True))
            tl.store(row + 3, exp_avg_sq[i].to(tl.int64, bitcast=True))


def _pass(addresses, layout, owner, partials, scales, divisor, corrections,
          beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, bias_correction1, bias_correction2,
          ADVANCE: tl.constexpr, NORMS: tl.constexpr, APPLY: tl.constexpr, HAS_DIVISOR: tl.constexpr,
          DEVICE_CORRECTIONS: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """One pass over BLOCK elements of one tensor, the arithmetic of `fused.advance_moments`,
    `fused.adam_direction` and `fused.apply_updates`:
    ADVANCE: g = grad / divisor; m = beta1 * m + (1 - beta1) * g; v = beta2 * v + (1 - beta2) * g * g (stored);
    then update = (m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * p, and
    NORMS: this block's sums of p * p and update * update into partials[program];
    APPLY: p -= scales[tensor] * update (p before the step in every product).
    Divisions and square roots are IEEE-rounded (`div_rn`, `sqrt_rn`), as torch's are.
    ALIGNED: every address 16-byte aligned and every length a multiple of 4 (`run_pass` checks), so
    the accesses are 128 bits wide; without it, 32."""
    program = tl.program_id(0)
    tensor = tl.load(owner + program)
    row = addresses + tensor * 4
    p_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    numel = tl.load(layout + tensor * 2)
    if ALIGNED:
        p_ptr = tl.multiple_of(p_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        numel = tl.multiple_of(numel, 4)
    offsets = (program - tl.load(layout + tensor * 2 + 1)) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    p = tl.load(p_ptr + offsets, mask=inside, other=0.0)
    m = tl.load(m_ptr + offsets, mask=inside, other=0.0)
    v = tl.load(v_ptr + offsets, mask=inside, other=0.0)
    if ADVANCE:
        g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            g_ptr = tl.multiple_of(g_ptr, 16)
        g = tl.load(g_ptr + offsets, mask=inside, other=0.0)
        if HAS_DIVISOR:
            g = tl.div_rn(g, tl.load(divisor))
        m = m * beta1 + g * one_minus_beta1
        v = v * beta2 + (g * g) * one_minus_beta2
        tl.store(m_ptr + offsets, m, mask=inside)
        tl.store(v_ptr + offsets, v, mask=inside)
    if DEVICE_CORRECTIONS:
        bc1 = tl.load(corrections)
        bc2 = tl.load(corrections + 1)
    else:
        bc1 = bias_correction1
        bc2 = bias_correction2
    update = tl.div_rn(tl.div_rn(m, bc1), tl.sqrt_rn(tl.div_rn(v, bc2)) + eps) + weight_decay * p
    if NORMS:
        tl.store(partials + program * 2, tl.sum(tl.where(inside, p * p, 0.0), axis=0))
        tl.store(partials + program * 2 + 1, tl.sum(tl.where(inside, update * update, 0.0), axis=0))
    if APPLY:
        tl.store(p_ptr + offsets, p - update * tl.load(scales + tensor), mask=inside)


def _sums(layout, partials, sums, BLOCK: tl.constexpr, REDUCE_BLOCK: tl.constexpr):
    """sums[tensor] = the sums of its programs' partials (p * p, update * update), in program order."""
    tensor = tl.program_id(0)
    first = tl.load(layout + tensor * 2 + 1)
    programs = tl.cdiv(tl.load(layout + tensor * 2), BLOCK)
    weights = tl.zeros([REDUCE_BLOCK], dtype=tl.float32)
    updates = tl.zeros([REDUCE_BLOCK], dtype=tl.float32)
    for start in range(0, programs, REDUCE_BLOCK):
        index = start + tl.arange(0, REDUCE_BLOCK)
        mine = index < programs
        weights += tl.load(partials + (first + index) * 2, mask=mine, other=0.0)
        updates += tl.load(partials + (first + index) * 2 + 1, mask=mine, other=0.0)
    tl.store(sums + tensor * 2, tl.sum(weights, axis=0))
    tl.store(sums + tensor * 2 + 1, tl.sum(updates, axis=0))


@dataclass(frozen=True)
class Kernels:
    """The three kernels, compiled for the GPU or interpreted, and the sizes they run with."""

    describe: Any
    step: Any
    sums: Any
    block: int = BLOCK
    chunk: int = CHUNK
    options: dict[str, Any] = field(default_factory=dict)  # launch options (compiled kernels only)


@functools.cache
def kernels(interpret: bool = False, block: int = BLOCK, chunk: int = CHUNK) -> Kernels:
    """The kernels for the GPU (`triton.jit`), or for Triton's interpreter on CPU tensors (tests;
    small `block` and `chunk` make tensors span several programs and describe launches)."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        wrap: Callable[..., Any] = InterpretedFunction
        options: dict[str, Any] = {}
    else:
        wrap = triton.jit
        # Every product and sum rounded as written, as the multi-tensor kernels' arithmetic on the CPU.
        options = {"enable_fp_fusion": False}
    unspecialized = ["first", "count"]
    return Kernels(wrap(_describe, do_not_specialize=unspecialized), wrap(_pass), wrap(_sums), block, chunk, options)


def _host_table(build: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the fused optimizer's tables for these tensors were not built before the CUDA-graph "
                           "capture: run an eager step with the same tensors first (the capture's warm-up does)")
    return build()


@functools.lru_cache(maxsize=512)
def _layout(numels: tuple[int, ...], block: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(layout [T, 2]: elements and first program per tensor, owner [P]: each program's tensor)."""
    programs = [math.ceil(n / block) for n in numels]
    starts = [0] * len(numels)
    for i in range(1, len(numels)):
        starts[i] = starts[i - 1] + programs[i - 1]
    rows = [[n, s] for n, s in zip(numels, starts)]
    owner = [t for t, count in enumerate(programs) for _ in range(count)]

    def build() -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int64).to(device)

    return _host_table(build, device), _host_table(lambda: torch.tensor(owner, dtype=torch.int32).to(device), device)


@functools.lru_cache(maxsize=1024)
def _static_addresses(pointers: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The addresses table of tensors that never move, from their data pointers (4 per tensor)."""
    return _host_table(lambda: torch.tensor(pointers, dtype=torch.int64).view(-1, _ROW).to(device), device)


def _described(k: Kernels, lists: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """The addresses table written on the device by `_describe` (see the module docstring)."""
    count = len(lists[0])
    addresses = torch.empty((count, _ROW), dtype=torch.int64, device=lists[0][0].device)
    for first in range(0, count, k.chunk):
        stop = min(first + k.chunk, count)
        padded = [tuple(ts[first:stop]) + (ts[stop - 1],) * (k.chunk - (stop - first)) for ts in lists]
        k.describe[(1,)](addresses, first, stop - first, *padded, CHUNK=k.chunk, num_warps=1, **k.options)
    return addresses


def aligned(pointers: Sequence[int], numels: Sequence[int]) -> bool:
    """Whether every address is a multiple of 16 bytes and every length of 4 elements: `_pass`'s ALIGNED."""
    return all(p % 16 == 0 for p in pointers) and all(n % 4 == 0 for n in numels)


@dataclass(frozen=True)
class Scalars:
    """A group's hyperparameters and bias corrections (host numbers, or [2] on the device)."""

    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    bias_correction1: float
    bias_correction2: float
    corrections: torch.Tensor | None = None  # float32 [bc1, bc2] on the device: then the two floats are unused


def run_pass(k: Kernels, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None,
             exp_avg: Sequence[torch.Tensor], exp_avg_sq: Sequence[torch.Tensor], scalars: Scalars,
             divisor: torch.Tensor | None = None, scales: torch.Tensor | None = None, norms: bool = False,
             static: bool = False) -> torch.Tensor | None:
    """One pass over the tensors (`_pass`): advances the moments when `grads` are given, applies
    `scales` [T] when given, and returns the per-tensor sums [T, 2] of p * p and update * update
    when `norms`. Every tensor float32 and contiguous (`fused.triton_kernels`)."""
    device = params[0].device
    # Triton launches on the current device: the tensors' (a rank's GPU), whichever is current.
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        return _run_pass(k, params, grads, exp_avg, exp_avg_sq, scalars, divisor, scales, norms, static)


def _run_pass(k: Kernels, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None,
              exp_avg: Sequence[torch.Tensor], exp_avg_sq: Sequence[torch.Tensor], scalars: Scalars,
              divisor: torch.Tensor | None, scales: torch.Tensor | None, norms: bool,
              static: bool) -> torch.Tensor | None:
    device = params[0].device
    lists = [params, params if grads is None else grads, exp_avg, exp_avg_sq]
    numels = tuple(p.numel() for p in params)
    layout, owner = _layout(numels, k.block, device)
    pointers = tuple(t.data_ptr() for row in zip(*lists) for t in row)
    addresses = _static_addresses(pointers, device) if static else _described(k, lists)
    programs = owner.numel()
    partials = torch.empty((programs, 2), dtype=torch.float32, device=device) if norms else layout
    if scales is not None:
        scales = scales.to(torch.float32).contiguous()
    if programs:
        k.step[(programs,)](
            addresses, layout, owner, partials, layout if scales is None else scales,
            layout if divisor is None else divisor, layout if scalars.corrections is None else scalars.corrections,
            scalars.beta1, 1.0 - scalars.beta1, scalars.beta2, 1.0 - scalars.beta2, scalars.eps,
            scalars.weight_decay, scalars.bias_correction1, scalars.bias_correction2,
            ADVANCE=grads is not None, NORMS=norms, APPLY=scales is not None, HAS_DIVISOR=divisor is not None,
            DEVICE_CORRECTIONS=scalars.corrections is not None, ALIGNED=aligned(pointers, numels), BLOCK=k.block,
            num_warps=8, **k.options)
    if not norms:
        return None
    sums = torch.empty((len(params), 2), dtype=torch.float32, device=device)
    k.sums[(len(params),)](layout, partials, sums, BLOCK=k.block, REDUCE_BLOCK=REDUCE_BLOCK, num_warps=4, **k.options)
    return sums
