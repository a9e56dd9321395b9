"""One device's memory and one step's work, read off a traced dry run (`cost.CostTracer`).

Training peak: the highest device bytes of the build (weights, optimizer state, the warm-up
steps, the CUDA-graph capture and its pool) and of the steps. Eval peak: the eval's highest
device bytes, with the cached eval set grown from the traced items to this rank's share of
`--num_eval_examples` (the dry run supplies a micro-batch of synthetic items; the traced bytes
per item times the share is what the real set holds on the device, to the items' lengths).

The step's work is its capture's (a graphed step, `--cuda_graphs`: the replays run nothing new)
or the last eager step's (the first one also builds the optimizer state). An eval's is the eval
phase's ops for its traced batches, plus, under `--eval_cuda_graph`, the eval forward's capture
once per batch (each batch is one replay; the build captures the step first, the eval forward
last), scaled by the share in the same way. `--compile_mode` is noted, and the ops of compiled
layers are marked (`OpCost.compiled`): the fake device runs them one by one ("aot_eager"), where a
GPU runs Inductor's fused kernels, which the planner counts from Inductor's own code
(`mlperf_bert.dryrun.compiled`, `tools/mlperf_tools/planning/step_model.py`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from .cost import CAPTURE_PHASE, CostTracer, OpCost, PhaseCost, capture_phase

GIB = 1 << 30
EVAL_PHASE = "eval"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one device. `train_peak` and `eval_peak` are the totals; the rest break them down."""

    weights: int  # the model's parameters
    optimizer_state: int  # the optimizer's state tensors (its shard under a sharded optimizer)
    persistent: int  # held between steps (at the eval's start): weights, optimizer state, graph pool, next batch
    graph_pool: int  # the CUDA graph's private pool (0 without graphs)
    train_peak: int
    eval_set: int  # this rank's share of the eval set, cached on the device
    eval_peak: int

    @property
    def step_transient(self) -> int:
        """Activations, gradients and temporaries of a step above what is held between steps."""
        return max(self.train_peak - self.persistent, 0)

    @property
    def peak(self) -> int:
        return max(self.train_peak, self.eval_peak)

    def lines(self) -> list[str]:
        g = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
        return [f"memory per device: training peak {g(self.train_peak)}, eval peak {g(self.eval_peak)}",
                f"  weights {g(self.weights)}, optimizer state {g(self.optimizer_state)}, held between steps "
                f"{g(self.persistent)} (CUDA-graph pool {g(self.graph_pool)}), step activations and gradients "
                f"{g(self.step_transient)}, cached eval set {g(self.eval_set)}"]


@dataclass(frozen=True)
class StepWork:
    """What the device runs: one training step's phase and one eval's (ops, collectives)."""

    step: PhaseCost
    eval: PhaseCost
    eval_scale: float  # eval ops traced for `eval_items` items; the whole share is this many times that
    captured: bool  # the step is a CUDA graph replay (no per-op launch from the host)
    eval_captured: bool = False  # the eval forward is a CUDA graph replayed per batch
    compiled: bool = False  # the encoder layers run as Inductor's kernels (--compile_mode other than none)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step.to_dict(), "eval": self.eval.to_dict(), "eval_scale": self.eval_scale,
                "captured": self.captured, "eval_captured": self.eval_captured, "compiled": self.compiled}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StepWork":
        return cls(PhaseCost.from_dict(data["step"]), PhaseCost.from_dict(data["eval"]), float(data["eval_scale"]),
                   bool(data["captured"]), bool(data.get("eval_captured")), bool(data.get("compiled")))


def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


def _reachable(value: Any, depth: int, seen: set[int]) -> list[torch.Tensor]:
    """Tensors held by `value`: in containers and in plain objects' attributes, `depth` levels down."""
    if id(value) in seen or depth < 0 or isinstance(value, torch.nn.Module):
        return []
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        children: Iterable[Any] = list(value.values())
    elif isinstance(value, (list, tuple)):
        children = value
    else:
        children = list(getattr(value, "__dict__", {}).values())
    return [t for child in children for t in _reachable(child, depth - 1, seen)]


def optimizer_tensors(optimizer: torch.optim.Optimizer, weights: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The optimizer's own device tensors: its state, and the flat buffers a sharded or capturable one keeps as
    attributes; the parameters it steps (and views of them) are the model's."""
    params = {id(t.untyped_storage()) for t in weights}
    found = _reachable(optimizer, 4, set())
    return [t for t in found if t.device.type == "cuda" and id(t.untyped_storage()) not in params]


def batch_tensors(batches: Iterable[Any]) -> list[torch.Tensor]:
    return [value for batch in batches for value in vars(batch).values() if isinstance(value, torch.Tensor)]


def steady_phase(steps: int, graphed_step: bool) -> str:
    """The phase whose ops are one training step (see the module docstring)."""
    return CAPTURE_PHASE if graphed_step else f"step {steps}"


def eval_work(tracer: CostTracer, batches: int, graphed_eval: bool) -> PhaseCost:
    """The traced eval's ops: the eval phase's, and the eval graph's (the last capture) once per replayed batch."""
    eval_phase = tracer.phases.get(EVAL_PHASE, PhaseCost())
    if not graphed_eval:
        return eval_phase
    graph = tracer.phases[capture_phase(tracer.captures)]
    work = PhaseCost(eval_phase.peak_bytes, eval_phase.start_bytes, Counter(eval_phase.ops),
                     Counter(eval_phase.collectives))
    for op, n in graph.ops.items():
        work.ops[op] += n * batches
    for collective, n in graph.collectives.items():
        work.collectives[collective] += n * batches
    return work


def estimate(tracer: CostTracer, steps: int, weights: list[torch.Tensor], optimizer: torch.optim.Optimizer,
             eval_batches: list[Any], eval_items: int, eval_share: int, graphed_step: bool = False,
             graphed_eval: bool = False, compiled: bool = False) -> tuple[MemoryEstimate, StepWork]:
    """The estimate of a finished dry run: `eval_items` sequences traced of a rank's `eval_share`;
    graphed_step / graphed_eval: --cuda_graphs / --eval_cuda_graph, compiled: --compile_mode not none."""
    phases = tracer.phases
    eval_phase = phases.get(EVAL_PHASE, PhaseCost())
    scale = eval_share / max(eval_items, 1)
    traced_set = _unique_bytes(batch_tensors(eval_batches))
    eval_set = math.ceil(traced_set * scale)
    train_peak = max(cost.peak_bytes for name, cost in phases.items() if name != EVAL_PHASE)
    step_phase = steady_phase(steps, graphed_step)
    persistent = eval_phase.start_bytes  # what a step leaves behind, as the eval after it begins
    memory = MemoryEstimate(weights=_unique_bytes(weights), optimizer_state=_unique_bytes(optimizer_tensors(optimizer, weights)),
                            persistent=persistent, graph_pool=tracer.pool_reserved, train_peak=train_peak,
                            eval_set=eval_set, eval_peak=eval_phase.peak_bytes + eval_set - traced_set)
    work = StepWork(phases.get(step_phase, PhaseCost()), eval_work(tracer, len(eval_batches), graphed_eval), scale,
                    graphed_step, graphed_eval, compiled)
    return memory, work


def memory_from_dict(data: dict[str, Any]) -> MemoryEstimate:
    return MemoryEstimate(**{f.name: int(data[f.name]) for f in dataclasses.fields(MemoryEstimate)})


def _linear(one: float, two: float, layers: int) -> float:
    """A quantity of a model of `layers` identical layers from its values at one and two layers."""
    return one + (layers - 1) * (two - one)


def _extrapolate_phase(one: PhaseCost, two: PhaseCost, layers: int) -> PhaseCost:
    """Ops and collectives of `layers` layers: per op name, kind and region (compiled or not; per collective kind),
    the count, FLOPs and bytes grow linearly; each op of a group gets the group's mean FLOPs and bytes."""
    out = PhaseCost(round(_linear(one.peak_bytes, two.peak_bytes, layers)),
                    round(_linear(one.start_bytes, two.start_bytes, layers)))

    def totals(cost: PhaseCost) -> dict[tuple[str, str, bool], tuple[int, int, int]]:
        found: dict[tuple[str, str, bool], tuple[int, int, int]] = {}
        for op, n in cost.ops.items():
            count, flops, moved = found.get((op.name, op.kind, op.compiled), (0, 0, 0))
            found[(op.name, op.kind, op.compiled)] = (count + n, flops + n * op.flops, moved + n * op.bytes)
        return found

    a, b = totals(one), totals(two)
    for key in a.keys() | b.keys():
        count, flops, moved = (_linear(x, y, layers) for x, y in zip(a.get(key, (0, 0, 0)), b.get(key, (0, 0, 0))))
        if round(count) > 0:
            n = round(count)
            out.ops[OpCost(key[0], key[1], round(max(flops, 0) / n), round(max(moved, 0) / n), key[2])] += n
    for kind in {k for k, _ in one.collectives} | {k for k, _ in two.collectives}:
        calls = [sum(n for (k, _), n in c.collectives.items() if k == kind) for c in (one, two)]
        sizes = [sum(n * size for (k, size), n in c.collectives.items() if k == kind) for c in (one, two)]
        count, total = round(_linear(calls[0], calls[1], layers)), _linear(sizes[0], sizes[1], layers)
        if count > 0:
            out.collectives[(kind, round(max(total, 0) / count))] += count
    return out


def extrapolate(one: tuple[MemoryEstimate, StepWork], two: tuple[MemoryEstimate, StepWork], layers: int
                ) -> tuple[MemoryEstimate, StepWork]:
    """The estimate of a model of `layers` encoder layers from traces of the same model with one and two.

    Every encoder layer has the same shapes, so each byte count, op count, FLOP count and collective
    size is a + b x layers; two traces fix a and b.
    """
    (m1, w1), (m2, w2) = one, two
    memory = MemoryEstimate(**{f.name: round(_linear(getattr(m1, f.name), getattr(m2, f.name), layers))
                               for f in dataclasses.fields(MemoryEstimate)})
    work = StepWork(_extrapolate_phase(w1.step, w2.step, layers), _extrapolate_phase(w1.eval, w2.eval, layers),
                    w1.eval_scale, w1.captured, w1.eval_captured, w1.compiled)
    return memory, work
