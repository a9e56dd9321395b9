"""What a traced run costs one device: live memory, and each op's FLOPs, bytes and collectives.

`CostTracer` is a TorchDispatchMode beside the `Recorder` (it takes the Recorder's phase and
capture flag). It works on fake tensors and on real ones alike, which is how its accounting
is checked against the CPU allocator (tests/trainer/dryrun/test_cost.py):

- Memory: every op output on the traced device type adds its storage's bytes once (views share
  a storage); the bytes leave when the storage dies (a weak reference's callback). Storages made
  while a CUDA graph is captured live in the graph's private pool, which never gives memory back:
  the device holds max(pool bytes live at once) from the capture on, whatever Python frees. So
  `device_bytes` = live bytes outside the pool + the pool's high-water mark. Not counted: the
  caching allocator's rounding and fragmentation, kernel workspaces (cuBLAS, attention), the CUDA
  context and NCCL's buffers; `mlperf_bert.plan.memory` adds them as stated margins.
- Work: every op on the device is counted under its phase with its FLOPs
  (`torch.utils.flop_counter`'s formulas; matrix products and attention are "matmul", and
  "fp8" when an operand is an FP8 tensor subclass, torchao's) and the bytes of its tensor operands
  and results (what it reads and writes once; a view moves nothing). Identical ops are merged
  with a count, so a 24-layer model keeps one entry per distinct op.
- Collectives (`c10d` ops on the process group): kind and bytes of the largest buffer.
- Compiled regions: an op that runs inside a graph `torch.compile` built with `regions_marked` (the
  dry run's back-end: "aot_eager", whose forward, backward and inference graphs mark the tracer
  watching them while they run) is counted as `compiled`. On a GPU Inductor fuses those ops into
  kernels of its own, which the planner counts from Inductor's generated code instead
  (`mlperf_bert.dryrun.compiled`); the ops outside (embeddings, loss, optimizer) run as traced.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from ..model.varlen_flash import NAMESPACE, VARLEN_OPS
from .record import WatchingMode

MATMUL, FP8, OTHER = "matmul", "fp8", "other"
OWN_NAMESPACE = NAMESPACE  # the package's custom ops (model/varlen_flash.py)
CAPTURE_PHASE = "capture"
# Ops that compute no values: their outputs alias or merely allocate (no kernel reads or writes them).
_NO_TRAFFIC = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
               "_unsafe_view", "lift_fresh", "set_", "record_stream", "_local_scalar_dense")


def capture_phase(n: int) -> str:
    """The phase of the n-th CUDA-graph capture (1: CAPTURE_PHASE)."""
    return CAPTURE_PHASE if n == 1 else f"{CAPTURE_PHASE} {n}"


class OpCost(NamedTuple):
    name: str  # the aten op
    kind: str  # MATMUL, FP8 or OTHER
    flops: int
    bytes: int  # bytes read and written once
    compiled: bool = False  # it ran inside a compiled region (`regions_marked`)


@dataclass
class PhaseCost:
    """One phase (build, capture, step N, eval): its memory high-water mark and its work."""

    peak_bytes: int = 0  # device bytes at the phase's highest point (pool included)
    start_bytes: int = 0  # device bytes when it began
    ops: Counter[OpCost] = field(default_factory=Counter)
    collectives: Counter[tuple[str, int]] = field(default_factory=Counter)  # (kind, bytes) -> calls

    def flops(self, kind: str | None = None) -> int:
        return sum(op.flops * n for op, n in self.ops.items() if kind is None or op.kind == kind)

    @property
    def kernels(self) -> int:
        return sum(self.ops.values())

    def to_dict(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "start_bytes": self.start_bytes,
                "ops": [[*op, n] for op, n in self.ops.items()],  # [name, kind, flops, bytes, compiled, count]
                "collectives": [[kind, size, n] for (kind, size), n in self.collectives.items()]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PhaseCost":
        ops: Counter[OpCost] = Counter({OpCost(*op[:-1]): op[-1] for op in data["ops"]})
        comms: Counter[tuple[str, int]] = Counter({(k, s): n for k, s, n in data["collectives"]})
        return cls(data["peak_bytes"], data["start_bytes"], ops, comms)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that own storage: a wrapper subclass (FP8) stands for its inner tensors."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [inner for name in names for inner in _plain(getattr(t, name))]
    return [t]


def _nbytes(t: torch.Tensor) -> int:
    return sum(p.numel() * p.element_size() for p in _plain(t))


def _is_fp8(t: torch.Tensor) -> bool:
    return any(p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for p in _plain(t))


def varlen_grid_flops(name: str, args: tuple) -> int:
    """FLOPs of the varlen attention ops of either kernel (`varlen_flash_forward(q, k, v, cu_seqlens, max_seqlen,
    ...)`, `varlen_cudnn_backward(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, ...)`, q [T, heads, dim]) over
    the grid of every token against max_seqlen keys: the per-sequence work is at most this, and fake tensors
    hold no lengths to count it exactly (tools/mlperf_tools/planning/step_model.py scales the grid by the data's share)."""
    backward = name.endswith("_backward")
    q, max_seqlen = (args[1], args[7]) if backward else (args[0], args[4])
    tokens, heads, dim = q.shape
    query, key = (1, heads, tokens, dim), (1, heads, max_seqlen, dim)
    if backward:
        return int(sdpa_backward_flop_count(query, query, key, key))
    return int(sdpa_flop_count(query, key, key))


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    if func.namespace == OWN_NAMESPACE and func._overloadpacket.__name__ in VARLEN_OPS:
        return varlen_grid_flops(func._overloadpacket.__name__, args)
    formula = flop_registry.get(func._overloadpacket)
    if formula is None:
        return 0
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except Exception:  # a formula that cannot read this call's shapes (a wrapper subclass): no count
        return 0


@dataclass
class CostTracer(WatchingMode):
    """Counts live device memory and each op's work per phase (see the module docstring).

    phase / capturing: callables giving the current phase label and whether a CUDA graph is
    being captured (the Recorder's, in a dry run). device_type: the memory counted ("cuda"; "cpu"
    when the accounting is checked on real CPU tensors).
    """

    phase: Callable[[], str] = lambda: "build"
    capturing: Callable[[], bool] = lambda: False
    device_type: str = "cuda"
    phases: dict[str, PhaseCost] = field(default_factory=dict)
    outside: int = 0  # live bytes outside a graph pool
    pool_live: int = 0  # live bytes inside the graph pool
    pool_reserved: int = 0  # the pool's high-water mark: held from the capture on
    _live: dict[int, tuple[weakref.ref, int, bool]] = field(default_factory=dict)
    captures: int = 0  # captures begun: the first's ops go under CAPTURE_PHASE, the n-th's under capture_phase(n)
    compiled_depth: int = 0  # compiled graphs running now (`regions_marked`); above 0, ops are `compiled`
    _in_capture: bool = False

    def __post_init__(self) -> None:
        super().__init__()

    @property
    def device_bytes(self) -> int:
        return self.outside + self.pool_reserved

    def current(self) -> PhaseCost:
        capturing = self.capturing()
        if capturing and not self._in_capture:
            self.captures += 1  # the training step's and the eval's graphs are captured in one build phase
        self._in_capture = capturing
        name = capture_phase(self.captures) if capturing else self.phase()
        cost = self.phases.get(name)
        if cost is None:
            cost = self.phases[name] = PhaseCost(self.device_bytes, self.device_bytes)
        return cost

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        cost = self.current()
        for t in _tensors(out):
            for plain in _plain(t):
                self._allocated(plain)
        cost.peak_bytes = max(cost.peak_bytes, self.device_bytes)
        if func.namespace == "c10d":
            self._collective(cost, func, args)
        elif func.namespace in ("aten", OWN_NAMESPACE) and not func.is_view and \
                func._overloadpacket.__name__ not in _NO_TRAFFIC:
            self._work(cost, func, args, kwargs, out)  # prim ops (a fake tensor's .device) run no kernel
        return out

    def _allocated(self, t: torch.Tensor) -> None:
        if t.device.type != self.device_type:
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._live:
            return
        size, in_pool = storage.nbytes(), self.capturing()
        self._live[key] = (weakref.ref(storage, lambda _, key=key: self._freed(key)), size, in_pool)  # type: ignore[misc]
        if in_pool:
            self.pool_live += size
            self.pool_reserved = max(self.pool_reserved, self.pool_live)
        else:
            self.outside += size

    def _freed(self, key: int) -> None:
        _, size, in_pool = self._live.pop(key)
        if in_pool:
            self.pool_live -= size
        else:
            self.outside -= size

    def _work(self, cost: PhaseCost, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        operands = _tensors((args, kwargs))
        results = _tensors(out)
        if not any(t.device.type == self.device_type for t in operands + results):
            return
        flops = _flops(func, args, kwargs, out)
        kind = OTHER if flops == 0 else FP8 if any(_is_fp8(t) for t in operands) else MATMUL
        moved = sum(_nbytes(t) for t in operands + results)
        cost.ops[OpCost(func._overloadpacket.__name__, kind, flops, moved, self.compiled_depth > 0)] += 1

    @staticmethod
    def _collective(cost: PhaseCost, func: Any, args: tuple) -> None:
        buffers = _tensors(args)
        if buffers:
            cost.collectives[(func._overloadpacket.__name__, max(_nbytes(t) for t in buffers))] += 1

    def to_dict(self) -> dict[str, Any]:
        return {"pool_reserved": self.pool_reserved, "phases": {k: v.to_dict() for k, v in self.phases.items()}}


def _marking(compiler: Callable[..., Any]) -> Callable[..., Any]:
    """AOTAutograd's compiler `compiler` (a boxed one), whose graphs mark every CostTracer watching them while
    they run: its dispatch mode stack is the running thread's (autograd's device threads inherit it)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    def compile_graph(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        run = compiler(graph, example_inputs)

        def marked(args: list[Any]) -> Any:
            tracers = [mode for mode in _get_current_dispatch_mode_stack() if isinstance(mode, CostTracer)]
            for tracer in tracers:
                tracer.compiled_depth += 1
            try:
                return run(args)
            finally:
                for tracer in tracers:
                    tracer.compiled_depth -= 1

        marked._boxed_call = True  # type: ignore[attr-defined]
        return marked

    return compile_graph


def regions_marked(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor], **kwargs: Any) -> Any:
    """A `torch.compile` back-end: "aot_eager" (Dynamo's graph, AOTAutograd's forward and backward, each run op by
    op), whose graphs mark the CostTracer watching them as inside a compiled region while they run. One function
    for every run, so Dynamo's compiled code serves the next build as it does under "aot_eager"."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    return aot_eager(graph, example_inputs, fw_compiler=_marking(boxed_nop), bw_compiler=_marking(boxed_nop),
                     **kwargs)
