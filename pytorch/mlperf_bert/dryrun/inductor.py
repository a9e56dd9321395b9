"""Inductor's CUDA code generation on the fake device: the compiled step as a GPU gets it, nothing launched.

`codegen_only(gpu, mode)` lets `torch.compile(backend="inductor")` run its whole pipeline for
'cuda' on a machine without one: Dynamo's graphs, AOTAutograd's forward and backward split,
Inductor's decompositions, pattern passes, fusion and scheduling, and the wrapper module with its
Triton kernels' source, for the compute capability and SM count of `gpu`. Where Inductor would
then compile the module (and with it, Triton's kernels for a real device), the module's source
is kept in a `CompileLog` instead, and the graph is run on the fake tensors as its FX graph, so
that the step goes on. No kernel is compiled or launched.

What a GPU-less torch lacks beyond the dry run's stand-ins (`cuda_standins`: streams, graphs, the RNG
state Dynamo saves around each frame, the properties of the GPU the device presents, which the
caller makes `gpu`), and is given here for the length of the block:
- a Triton driver for `gpu`'s target (Triton's own asks the CUDA driver for the device);
- Inductor's attention patterns, built once per device from example tensors, are built on fake
  ones (a fake mode of their own: the device cannot hold a real tensor).

`CompileLog` keeps, per compiled module, its kind (forward, backward, inference), its kernels
(`kernels.launches`) and how often it ran in each phase the caller names; and every graph break
Dynamo took, with its place and reason. Dynamo compiles frames only while no user dispatch mode
is active: the dry run's `Recorder` and `CostTracer` declare themselves infrastructure modes so
that it does (`record.py`).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Iterator
from unittest import mock

import torch

from .gpus import Gpu
from ..model.fp8_cast import SINGLE_PASS_OPS, single_pass_bytes
from .kernels import Launch, launches, with_op_bytes


@dataclass
class CompiledModule:
    """One module Inductor generated: a Dynamo graph's forward, backward or inference code."""

    index: int
    kind: str  # "forward", "backward" or "inference"
    launches: list[Launch]
    source: str
    calls: Counter[str] = field(default_factory=Counter)  # phase -> times it ran


@dataclass(frozen=True)
class GraphBreak:
    where: str  # file:line of the user code Dynamo stopped at
    reason: str  # the first line of Dynamo's reason


@dataclass
class CompileLog:
    modules: list[CompiledModule] = field(default_factory=list)
    breaks: list[GraphBreak] = field(default_factory=list)
    phase: Callable[[], str] = lambda: "build"  # the phase now: the caller's (the dry run's Recorder's)

    def clear_calls(self) -> None:
        """Forget the runs counted so far (the modules stay compiled): before another build's run."""
        for module in self.modules:
            module.calls.clear()

    def ran(self, phase: str) -> list[tuple[CompiledModule, int]]:
        """The modules that ran in `phase`, with their number of runs."""
        return [(m, m.calls[phase]) for m in self.modules if m.calls[phase]]


_GENERIC = "Encountered graph break when attempting to trace"


def break_reason(lines: list[str]) -> str:
    """Dynamo's reason in one line: its first specific line (not the generic "Encountered graph break when
    attempting to trace ...") and its explanation."""
    start = next((i for i, line in enumerate(lines) if line.startswith("Graph Break Reason:")), None)
    if start is None:
        return "?"
    text = [lines[start].split(":", 1)[1].strip()] + [line.strip() for line in lines[start + 1:]]
    text = [line for line in text if line and not line.startswith(_GENERIC)]
    first = text[0] if text else "?"
    explanation = next((line.removeprefix("Explanation:").strip() for line in text if line.startswith("Explanation:")),
                       None)
    return f"{first}: {explanation}" if explanation else first


class _GraphBreaks(logging.Handler):
    """Dynamo's graph-break log records, each one break: "Graph break in user code at FILE:LINE\\nGraph Break
    Reason: ..." (a break it has seen before comes as "Graph break (user stack suppressed ...) ...")."""

    def __init__(self, log: CompileLog) -> None:
        super().__init__(logging.DEBUG)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        lines = record.getMessage().splitlines()
        where = lines[0].rsplit(" at ", 1)[-1] if lines else "?"
        self.log.breaks.append(GraphBreak(where, break_reason(lines)))


@contextlib.contextmanager
def _graph_breaks(log: CompileLog) -> Iterator[None]:
    from torch._dynamo.symbolic_convert import graph_break_log

    handler = _GraphBreaks(log)
    level, propagate = graph_break_log.level, graph_break_log.propagate
    graph_break_log.addHandler(handler)
    graph_break_log.setLevel(logging.DEBUG)
    graph_break_log.propagate = False
    try:
        yield
    finally:
        graph_break_log.removeHandler(handler)
        graph_break_log.setLevel(level)
        graph_break_log.propagate = propagate


class _Driver:
    """A Triton driver for a device that is not there: its target is all Inductor asks of it here."""

    def __init__(self, gpu: Gpu) -> None:
        from triton.backends.compiler import GPUTarget

        major, minor = gpu.capability
        self.target = GPUTarget("cuda", major * 10 + minor, 32)

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def is_active(self) -> bool:
        return True

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cuda", 0)


def _run_as_fx(graph: Any, log: CompileLog, module: CompiledModule) -> Any:
    """What `GraphLowering.compile_to_module` returns in place of the compiled module: its `call` counts the
    run under the log's phase and runs the graph Inductor lowered, op by op, on the fake tensors."""
    from torch._guards import detect_fake_mode

    fx = graph.orig_gm

    def call(args: list) -> Any:
        module.calls[log.phase()] += 1
        mode = detect_fake_mode(args)
        if mode is None:
            raise RuntimeError("a compiled module ran on real tensors: the fake device runs fake ones only")
        with mode:  # factory ops (the RNG seeds Inductor adds) must make fake tensors too
            out = fx(*args)
        args.clear()
        return out

    return SimpleNamespace(call=call, __file__=f"<fake device: compiled module {module.index}>", runner=None)


def single_pass_calls(fx: Any) -> dict[str, list[int]]:
    """The bytes of each call of the single-pass ops (`fp8_cast.SINGLE_PASS_OPS`) in the graph, in its order:
    their operands' and results' sizes, from the fake values the graph's nodes carry."""
    calls: dict[str, list[int]] = {}
    for node in fx.graph.nodes:
        name = f"{getattr(node.target, 'namespace', '')}.{getattr(node.target, '_opname', '')}"
        if node.op != "call_function" or name not in SINGLE_PASS_OPS:
            continue
        args = [a for arg in node.args for a in (arg if isinstance(arg, (list, tuple)) else [arg])]  # lists flat
        inputs = [arg.meta.get("val") for arg in args if hasattr(arg, "meta")]
        value = node.meta["val"]
        outputs = list(value) if isinstance(value, (tuple, list)) else [value]
        calls.setdefault(name, []).append(single_pass_bytes(inputs + outputs))
    return calls


def _keep_source(log: CompileLog) -> Any:
    def compile_to_module(graph: Any) -> Any:
        wrapper, _ = graph.codegen()
        kind = "backward" if graph.is_backward else "inference" if graph.is_inference else "forward"
        found = with_op_bytes(launches(wrapper.value), single_pass_calls(graph.orig_gm))
        module = CompiledModule(len(log.modules), kind, found, wrapper.value)
        log.modules.append(module)
        return _run_as_fx(graph, log, module)

    return compile_to_module


def _fake_patterns() -> Any:
    from torch._inductor.fx_passes import fuse_attention

    from .run import _FakeCudaMode

    original = fuse_attention._sfdp_init

    def init(device: Any) -> Any:
        with _FakeCudaMode.make():
            return original(device)

    return init


def triton_problem() -> str | None:
    """Why Inductor cannot write CUDA code here: it writes Triton, so Triton must import."""
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return (f"generating the CUDA step needs Triton ({err}): pip install triton "
                "(tools/install_test_tools.sh installs the release this torch was built with)")
    return None


@contextlib.contextmanager
def codegen_only(gpu: Gpu) -> Iterator[CompileLog]:
    """Inductor generates CUDA code for `gpu` and runs each graph as FX on its fake inputs (module docstring);
    set the log's `phase` to name what runs. Dynamo's caches are reset on entry and exit: nothing compiled
    here is reused after."""
    import torch._inductor.config as inductor_config
    import triton
    from torch._inductor.graph import GraphLowering

    problem = triton_problem()
    if problem is not None:
        raise RuntimeError(problem)
    log = CompileLog()
    torch._dynamo.reset()
    with contextlib.ExitStack() as stack:
        # the driver slot itself, not `.active`: reading that makes Triton look for a GPU
        stack.enter_context(mock.patch.object(triton.runtime.driver, "_active", _Driver(gpu)))
        stack.enter_context(_graph_breaks(log))
        # kernel_num_gb in each kernel's metadata; no cache (a cached module would skip code generation). The
        # joint graph's constant folding computes factory constants on the device, which holds no tensor here:
        # off (what it folds here are one-value fills, such as a scale's ones_like, a few bytes each).
        stack.enter_context(inductor_config.patch(benchmark_kernel=True, fx_graph_cache=False,
                                                  fx_graph_remote_cache=False, autotune_local_cache=False,
                                                  joint_graph_constant_folding=False))
        stack.enter_context(mock.patch.object(GraphLowering, "compile_to_module", _keep_source(log)))
        stack.enter_context(mock.patch("torch._inductor.fx_passes.fuse_attention._sfdp_init", _fake_patterns()))
        stack.callback(torch._dynamo.reset)
        yield log
