"""The dry run's memory and work accounting (mlperf_bert.dryrun.cost), checked where it can be on the CPU:
its live-bytes peak of a real training step against the CPU allocator's own count (the profiler's
allocation events), the same step on fake tensors against the real one, and the ops of a compiled
region told from those around it."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mlperf_bert.data.batch import FlatBatch, Sample, flatten_items
from mlperf_bert.dryrun.cost import FP8, MATMUL, OTHER, CostTracer, OpCost, PhaseCost, regions_marked
from mlperf_bert.dryrun.estimate import StepWork, extrapolate, memory_from_dict
from mlperf_bert.model.bert import BertConfig, BertForPreTraining
from mlperf_bert.optim.optimizers import build_optimizer, parameter_groups
from mlperf_bert.train.step import forward_backward

SMALL = BertConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=1024)
SEQS, LENGTH = 16, 128
# The live-bytes count sees op outputs only: scratch a kernel allocates and frees inside itself is not
# counted, and a storage a kernel made without returning it is counted when an op first returns it.
# Measured here (torch 2.13, CPU): the optimizer step's peak equals the allocator's to 12 bytes,
# forward + backward's is 6.7 % above it (125.1 MB against 117.2 MB).
ALLOCATOR_MARGIN = 0.10


def _batch(seed: int = 0) -> FlatBatch:
    rng = np.random.default_rng(seed)
    items = [(Sample(rng.integers(1, SMALL.vocab_size, LENGTH), (np.arange(LENGTH) >= LENGTH // 2).astype(np.int64),
                     np.sort(rng.choice(np.arange(1, LENGTH), 19, replace=False)),
                     rng.integers(1, SMALL.vocab_size, 19), int(rng.integers(0, 2))),) for _ in range(SEQS)]
    return flatten_items(items)


def _parts() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = BertForPreTraining(SMALL, attention_backend="sdpa")
    return model, build_optimizer(parameter_groups(model, 0.01), "lamb", 1e-3, (0.9, 0.999), 1e-6, 0.01, 1.0, "foreach")


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: FlatBatch) -> None:
    forward_backward(model, batch, "fp32")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _traced_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: FlatBatch) -> tuple[int, CostTracer]:
    """The step's peak above what was live when it began, as the tracer counts it (the step after a first one
    that made the optimizer state)."""
    _step(model, optimizer, batch)
    phase = ["before"]
    tracer = CostTracer(phase=lambda: phase[0], device_type="cpu")
    with tracer:
        torch.ones(1)  # opens the "before" phase at the bytes the tracer has seen so far (none)
        phase[0] = "step"
        _step(model, optimizer, batch)
    step = tracer.phases["step"]
    return step.peak_bytes - step.start_bytes, tracer


def _allocation_peak(events: Any) -> int:
    """Peak of the running sum of the CPU allocator's allocations and frees (the profiler's records)."""
    from torch._C._profiler import _EventType

    found: list[tuple[int, int]] = []
    stack = list(events)
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.typed[0] == _EventType.Allocation and event.typed[1].device.type == "cpu":
            found.append((event.start_time_ns, event.typed[1].alloc_size))
    running = peak = 0
    for _, size in sorted(found):
        running += size
        peak = max(peak, running)
    return peak


@pytest.fixture(scope="module")
def real_step() -> tuple[int, int, CostTracer]:
    model, optimizer = _parts()
    batch = _batch()
    _step(model, optimizer, batch)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(model, optimizer, batch)
    allocator = _allocation_peak(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    traced, tracer = _traced_step(model, optimizer, batch)
    return traced, allocator, tracer


def test_live_bytes_peak_of_a_real_step_agrees_with_the_cpu_allocator(real_step: tuple[int, int, CostTracer]) -> None:
    traced, allocator, _ = real_step
    assert allocator > 0 and traced > 0
    assert abs(traced - allocator) <= ALLOCATOR_MARGIN * allocator, (traced, allocator)


def test_fake_tensors_count_the_same_bytes_and_work_as_real_ones(real_step: tuple[int, int, CostTracer]) -> None:
    traced, _, real = real_step
    with FakeTensorMode(allow_non_fake_inputs=True):
        model, optimizer = _parts()
        fake, tracer = _traced_step(model, optimizer, _batch())
    assert fake == traced
    assert tracer.phases["step"].ops == real.phases["step"].ops


def test_matmul_flops_of_a_step_are_three_times_the_forward_ones(real_step: tuple[int, int, CostTracer]) -> None:
    """Forward GEMMs of the encoder (4h^2 + 2hi per token and layer, times 2 FLOP) appear three times in a step
    (forward, input and weight gradients): the tracer's matmul count holds at least that."""
    _, _, tracer = real_step
    h, i, layers = SMALL.hidden_size, SMALL.intermediate_size, SMALL.num_hidden_layers
    encoder = 3 * 2 * SEQS * LENGTH * layers * (4 * h * h + 2 * h * i)
    counted = tracer.phases["step"].flops(MATMUL)
    assert encoder <= counted <= 1.3 * encoder, (counted, encoder)
    assert tracer.phases["step"].flops(OTHER) == 0  # element-wise ops are counted by bytes, not FLOPs


def test_varlen_attention_ops_are_counted_over_their_grid() -> None:
    """The package's varlen attention (a custom op, not aten) is a kernel of the step: counted as a matrix product
    with the FLOPs of every token against max_seqlen keys, forward 4 T S h d and backward 2.5 times that (the
    backward recomputes the scores), and its bytes; before, the tracer skipped it and a varlen step had no
    attention work at all."""
    from mlperf_bert.model.varlen_flash import varlen_flash

    tokens, heads, dim, max_seqlen = 10, 2, 8, 6
    q, k, v = (torch.randn(tokens, heads, dim, requires_grad=True) for _ in range(3))
    tracer = CostTracer(device_type="cpu")
    with tracer:
        varlen_flash(q, k, v, torch.tensor([0, 4, 10], dtype=torch.int32), max_seqlen, 0.1).sum().backward()
    counted = {op.name: op for op in tracer.phases["build"].ops}
    forward = 4 * tokens * max_seqlen * heads * dim
    assert (counted["varlen_flash_forward"].kind, counted["varlen_flash_forward"].flops) == (MATMUL, forward)
    assert (counted["varlen_flash_backward"].kind, counted["varlen_flash_backward"].flops) == (MATMUL, forward * 5 // 2)
    assert counted["varlen_flash_forward"].bytes >= 4 * tokens * heads * dim * 4  # q, k, v and the output, fp32


def test_live_bytes_views_frees_and_the_graph_pool_as_a_hand_count() -> None:
    """Each storage once (a view adds nothing), freed bytes leave, bytes made while capturing stay in the pool at its
    high-water mark; every number worked out by hand from the tensors' sizes, in three dtypes."""
    capturing = [False]
    tracer = CostTracer(phase=lambda: "step", capturing=lambda: capturing[0], device_type="cpu")
    with tracer:
        a = torch.ones(1000, dtype=torch.bfloat16)  # 2,000 bytes
        b = (a * 2).view(10, 100)  # 2,000 more; the view none
        c = torch.ones(250, dtype=torch.int64)  # 2,000 more
        del a
        assert (tracer.outside, tracer.device_bytes) == (4000, 4000)
        capturing[0] = True
        d = b.float() + 1  # two fp32 [10, 100] in the pool: 8,000 live at once, 4,000 left after the temporary goes
        f = torch.ones(100)  # 400 more in the pool after that free: 4,400 live, the pool still holds its 8,000
        assert (tracer.pool_live, tracer.pool_reserved) == (4400, 8000)
        capturing[0] = False
        del d, f
        e = c + 1  # 2,000 outside the pool
    assert tracer.pool_reserved == 8000 and tracer.phases["capture"].peak_bytes == 4000 + 8000
    assert tracer.phases["step"].peak_bytes == 6000 + 8000  # b, c and e outside, and the pool held since
    assert (tracer.outside, tracer.pool_live, tracer.device_bytes) == (6000, 0, 6000 + 8000)
    del b, c, e
    assert tracer.outside == 0


def test_op_work_counts_flops_and_operand_bytes_in_each_dtype() -> None:
    """mm of [8, 16] x [16, 4]: 2 x 8 x 16 x 4 FLOPs, and its operands and result read or written once; an add
    moves its two operands and its result; a view moves nothing. bf16 and int64 tensors count 2 and 8 bytes, FP8
    ones 1 (a _scaled_mm of [16, 32] x [32, 16] with two fp32 scales and a bf16 result is FP8 work)."""
    x, w = torch.ones(8, 16, dtype=torch.bfloat16), torch.ones(16, 4, dtype=torch.bfloat16)
    ids = torch.ones(100, dtype=torch.int64)
    a, b = torch.ones(16, 32).to(torch.float8_e4m3fn), torch.ones(16, 32).to(torch.float8_e4m3fn).t()
    one = torch.ones(())
    tracer = CostTracer(device_type="cpu")
    with tracer:
        x @ w
        ids + ids
        ids.view(10, 10)
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    ops = tracer.phases["build"].ops
    assert ops == {OpCost("mm", MATMUL, 2 * 8 * 16 * 4, 2 * (8 * 16 + 16 * 4 + 8 * 4)): 1,
                   OpCost("add", OTHER, 0, 8 * 3 * 100): 1,
                   OpCost("_scaled_mm", FP8, 2 * 16 * 32 * 16, 16 * 32 + 32 * 16 + 4 + 4 + 2 * 16 * 16): 1}


class _Region(torch.nn.Module):
    """A compiled region of the model's kind: a user module (Dynamo leaves torch.nn's own modules to run eagerly)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.linear(x))


def _region_step(compiled: bool) -> PhaseCost:
    """A scale, the region, the loss and its backward, traced after a first step (which compiles the region)."""
    torch.manual_seed(0)
    region = _Region()
    if compiled:
        region.compile(backend=regions_marked)
    x = torch.randn(4, 8)
    phase = "warm-up"
    tracer = CostTracer(phase=lambda: phase, device_type="cpu")
    with tracer:
        for phase in ("warm-up", "step"):
            (region(x * 2.0) ** 2).sum().backward()
    return tracer.phases["step"]


def test_ops_inside_a_compiled_region_are_marked_forward_and_backward_and_counted_once() -> None:
    """The dry run's back-end (`regions_marked`: "aot_eager"): the region's forward (addmm, gelu) and backward
    (gelu_backward, the weight's mm, the bias's sum) count as compiled; the scale before it, the loss after it,
    the loss's backward and autograd's gradient accumulation do not. Each op is counted once: flags aside, the
    compiled step's ops are the eager step's."""
    eager, compiled = _region_step(False), _region_step(True)
    assert not any(op.compiled for op in eager.ops)
    assert Counter({op._replace(compiled=False): n for op, n in compiled.ops.items()}) == eager.ops
    inside = sorted(op.name for op, n in compiled.ops.items() for _ in range(n) if op.compiled)
    assert inside == ["addmm", "gelu", "gelu_backward", "mm", "sum"]
    outside = {op.name for op in compiled.ops if not op.compiled}
    assert {"mul", "pow", "sum", "ones_like", "add_"} == outside


def test_the_compiled_flag_survives_the_cache_and_the_extrapolation_to_24_layers() -> None:
    """A trace's ops keep their region through `to_dict` / `from_dict` (the planner's cache) and through
    `estimate.extrapolate`, which keeps an op inside and the same op outside apart."""
    inside, outside = OpCost("add", OTHER, 0, 100, True), OpCost("add", OTHER, 0, 10)

    def traced(layers: int) -> tuple[Any, StepWork]:
        phase = PhaseCost(ops=Counter({inside: 2 * layers, outside: 1}))
        memory = memory_from_dict({name: 0 for name in ("weights", "optimizer_state", "persistent", "graph_pool",
                                                        "train_peak", "eval_set", "eval_peak")})
        return memory, StepWork(phase, PhaseCost(), 1.0, True, compiled=True)

    assert PhaseCost.from_dict(traced(1)[1].step.to_dict()).ops == traced(1)[1].step.ops
    assert PhaseCost.from_dict({"peak_bytes": 0, "start_bytes": 0, "ops": [["add", OTHER, 0, 10, 3]],
                                "collectives": []}).ops == Counter({outside: 3})  # a cache written before the flag
    _, work = extrapolate(traced(1), traced(2), 24)
    assert work.step.ops == Counter({inside: 48, outside: 1})
