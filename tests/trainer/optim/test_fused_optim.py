"""The LAMB / AdamW update in at most three passes (optim/fused.py, optim/fused_kernels.py).

- The passes of one step, counted as torch dispatches them (each op weighted by the share of the
  parameters' elements it sweeps): at most 3 for LAMB, unsharded, capturable or sharded; 17 before.
- The Triton kernels themselves, run on the CPU through Triton's interpreter in a process of its own
  (`harness/workers/fused_kernels.py`, whose docstring lists the cases): each pass against the multi-tensor
  ops, and LAMB / AdamW / the capturable twin / the sharded LAMB stepped by them against
  `ReferenceLamb` / `ReferenceAdamW` and the unsharded optimizer.
- The kernels compiled for an H100/H200 (sm_90) here, with Triton's own ptxas: that they compile, that
  their divisions and square roots are IEEE-rounded, and that aligned tensors get 128-bit accesses.
- The host-built tables' guard against a CUDA-graph capture, and the alignment check.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mlperf_bert.optim.capturable import capturable
from mlperf_bert.optim.optimizers import build_optimizer, parameter_groups
from tests.harness import optimizer_runs
from tests.harness import thread_ranks as ranks
from tests.harness.triton_interpreter import SM90, needs_triton, run_interpreted

WORKER = "tests.harness.workers.fused_kernels"
# Relative to the largest value compared: the kernels round every product, quotient and root as the
# multi-tensor ops do; sums (the norms) are added in another order.
TOLERANCE = 1e-6


# ---------------------------------------------------------------- passes over the parameters


class Sweeps(TorchDispatchMode):
    """Each dispatched op's sweep: the elements of its largest tensor argument or result (a list of
    tensors counts as one), as a share of `numel`. A multi-tensor op over a group, or a fused pass,
    sweeps the group's share; an op on per-tensor norms sweeps next to nothing; a view, nothing. Ops
    dispatched while `COLLECTIVE.on` is set (a simulated collective's own arithmetic) are not the update's."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel = numel
        self.ops: list[tuple[str, float]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(COLLECTIVE, "on", False) or func.is_view:  # a view moves no data
            return out
        sizes = [sum(t.numel() for t in tree_flatten(a)[0] if isinstance(t, torch.Tensor))
                 for a in (*args, *kwargs.values(), out)]
        self.ops.append((func.__name__, max(sizes, default=0) / self.numel))
        return out

    @property
    def passes(self) -> float:
        return sum(share for _, share in self.ops)


COLLECTIVE = threading.local()


def layers() -> torch.nn.Module:
    """Decayed matrices and undecayed vectors, their elements many more than their tensors."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 64))


def step_sweeps(model: torch.nn.Module, optimizer: Any, numel: int) -> Sweeps:
    """The second step's sweeps (the first creates the state)."""
    for step in range(2):
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(4, 128, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
        if step == 1:
            with Sweeps(numel) as sweeps:
                optimizer.step()
        else:
            optimizer.step()
    return sweeps


@pytest.mark.parametrize("name,twin,passes", [("lamb", False, 3), ("lamb", True, 3), ("adam", False, 2)],
                         ids=["lamb", "lamb-capturable", "adamw"])
def test_one_step_sweeps_the_parameters_at_most_three_times(name, twin, passes):
    """Clipped: the gradient norm, then LAMB's moments-and-norms and apply passes (AdamW's one). Before
    the fused passes the same step swept them 17 times (docs/PERFORMANCE.md)."""
    model = layers()
    optimizer = build_optimizer(parameter_groups(model, 0.01), name, 1e-3, (0.9, 0.999), 1e-6, 0.01, 1.0, "foreach")
    if twin:
        optimizer = capturable(optimizer)
    sweeps = step_sweeps(model, optimizer, sum(p.numel() for p in model.parameters()))
    assert sweeps.passes <= passes + 0.05, sweeps.ops  # the rest: ops on per-tensor sums
    assert sweeps.passes > passes - 0.1, sweeps.ops  # the count is not blind: every pass is there


def test_one_sharded_step_sweeps_the_shard_at_most_three_times(monkeypatch):
    """At 2 ranks (threads, the gradients handed over as the comm hooks do): each rank sweeps its
    shard three times, the gradient's partial norms, the moments with the trust ratio's sums, the
    apply. The collectives' own copies are not counted (they move the data of the reduce-scatter
    and the all-gathers, which replace the unsharded all-reduce)."""
    world = 2
    for name in ("all_reduce", "reduce_scatter_single", "all_gather_single"):
        monkeypatch.setattr(ranks.Collectives, name, _uncounted(getattr(ranks.Collectives, name)))

    def work(rank: int) -> float:
        net = layers()
        opt = ranks.optimizer(net, "lamb", 0.5, True)
        shard = sum(p.numel() for slices in opt._slices for p in slices.params)
        for step in range(2):
            generator = torch.Generator().manual_seed(10 * step + rank)
            ranks.hand_over(net, opt, [torch.randn(p.shape, generator=generator) / world for p in net.parameters()])
            with Sweeps(shard) as sweeps:
                opt.step()
        assert sweeps.passes <= 3.05, sweeps.ops  # the rest: ops on per-tensor sums
        return sweeps.passes

    assert min(ranks.on_ranks(world, work, monkeypatch)) > 2.9  # each rank's shard: mostly decayed weights


def _uncounted(collective: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        COLLECTIVE.on = True
        try:
            return collective(*args, **kwargs)
        finally:
            COLLECTIVE.on = False
    return call


# ---------------------------------------------------------------- the kernels, interpreted


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, Any]:
    return run_interpreted(WORKER, tmp_path_factory.mktemp("fused") / "results.json")


def test_each_kernel_pass_equals_the_multi_tensor_ops(interpreted):
    assert len(interpreted["kernels"]) == 8
    for case, difference in interpreted["kernels"].items():
        assert difference <= TOLERANCE, case


def test_optimizers_stepped_by_the_kernels_equal_the_reference(interpreted):
    """LAMB unclipped, clipped, clipped hard and capturable (device step count and lr), AdamW, and the
    sharded LAMB at 3 ranks, each stepped by the kernels, against the reference optimizers."""
    assert len(interpreted["optimizers"]) == 6
    for case, difference in interpreted["optimizers"].items():
        assert difference <= TOLERANCE, case


def test_a_step_is_one_or_two_kernel_passes_plus_the_clip_norm(interpreted):
    """LAMB: one pass advances every group's moments (the decayed group with its norms, the other
    applying too), one more applies the decayed group; AdamW: one pass. The gradient norm of the
    clip is torch's `_foreach_norm` (pass 1). Each group's addresses are described in launches of
    CHUNK (3) tensors, and LAMB's per-tensor sums take one more small launch."""
    lamb, adam = interpreted["launches"]["lamb"], interpreted["launches"]["adam"]
    assert lamb["passes"]["advance"] == pytest.approx(1.0) and 0.5 < lamb["passes"]["apply"] < 1.0
    assert lamb["launches"] == {"describe": 6, "step": 3, "sums": 1}  # 5 and 4 tensors: 2 launches each, + 2 more
    assert adam["passes"] == {"advance": pytest.approx(1.0)} and adam["launches"] == {"describe": 4, "step": 2}


# ---------------------------------------------------------------- the kernels, compiled


def compiled_ptx(kernel: Any, signature: dict[str, str], constants: dict[str, Any], **options: Any) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **{name: "constexpr" for name in constants}}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget(*SM90), options=options).asm["ptx"]


PASS_SIGNATURE = {"addresses": "*i64", "layout": "*i64", "owner": "*i32", "partials": "*fp32", "scales": "*fp32",
                  "divisor": "*fp32", "corrections": "*fp32",
                  **{name: "fp32" for name in ("beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "eps",
                                               "weight_decay", "bias_correction1", "bias_correction2")}}


def test_the_kernels_compile_for_the_gpu_with_rounded_arithmetic_and_wide_accesses():
    """Compiled for sm_90 (no GPU needed: Triton brings ptxas): every kernel; the passes divide and take
    roots IEEE-rounded, fuse no multiply-add, and read and write 128 bits at a time when ALIGNED."""
    needs_triton()
    from mlperf_bert.optim import fused_kernels

    k = fused_kernels.kernels()
    accesses = {}
    for aligned in (False, True):
        constants = dict(ADVANCE=True, NORMS=True, APPLY=False, HAS_DIVISOR=True, DEVICE_CORRECTIONS=False,
                         ALIGNED=aligned, BLOCK=fused_kernels.BLOCK)
        ptx = compiled_ptx(k.step, PASS_SIGNATURE, constants, num_warps=8, **k.options)
        assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx and "fma" not in ptx
        accesses[aligned] = set(re.findall(r"(?:ld|st)\.global\.(?:v4\.)?b32", ptx))
    # The scalars (a tensor's scale, its partial sums) are 32-bit either way.
    assert not any(".v4." in access for access in accesses[False])
    assert {"ld.global.v4.b32", "st.global.v4.b32"} <= accesses[True]
    apply = compiled_ptx(k.step, PASS_SIGNATURE, dict(ADVANCE=True, NORMS=False, APPLY=True, HAS_DIVISOR=False,
                                                      DEVICE_CORRECTIONS=True, ALIGNED=True, BLOCK=fused_kernels.BLOCK),
                         num_warps=8, **k.options)
    assert "st.global.v4.b32" in apply
    chunk = ("*fp32",) * 4
    compiled_ptx(k.describe, {"addresses": "*i64", "first": "i32", "count": "i32", "params": chunk, "grads": chunk,
                              "exp_avg": chunk, "exp_avg_sq": chunk}, {"CHUNK": 4}, num_warps=1, **k.options)
    compiled_ptx(k.sums, {"layout": "*i64", "partials": "*fp32", "sums": "*fp32"},
                 {"BLOCK": fused_kernels.BLOCK, "REDUCE_BLOCK": fused_kernels.REDUCE_BLOCK}, num_warps=4, **k.options)


def test_aligned_needs_every_address_and_length_aligned():
    needs_triton()
    from mlperf_bert.optim.fused_kernels import aligned

    assert aligned([0, 16, 4096], [4, 8, 1024])
    assert not aligned([0, 20], [4, 8])  # a view 5 floats into its buffer
    assert not aligned([0, 16], [4, 6])  # a length that leaves a partial 128-bit access at the end


def test_host_tables_are_never_built_inside_a_capture(monkeypatch):
    """A table missing inside a CUDA-graph capture raises instead of copying from the host there."""
    needs_triton()
    from mlperf_bert.optim import fused_kernels

    built = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="before the CUDA-graph capture"):
        fused_kernels._host_table(lambda: built.append(1) or torch.zeros(1), torch.device("cuda"))
    assert not built
    assert fused_kernels._host_table(lambda: torch.ones(1), torch.device("cpu")).item() == 1.0


# ---------------------------------------------------------------- on a GPU (make bring-up: pytest -m gpu)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _no_multi_tensor(*_: Any) -> None:
    raise AssertionError("the multi-tensor code ran on the GPU: the Triton kernels were not taken")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name,max_grad_norm", [("lamb", 1.0), ("lamb", None), ("adam", 1.0)])
def test_on_the_gpu_the_kernels_step_like_the_reference(name, max_grad_norm, monkeypatch):
    from mlperf_bert.optim import fused
    monkeypatch.setattr(fused, "multi_tensor_moments", _no_multi_tensor)
    monkeypatch.setattr(fused, "multi_tensor_apply", _no_multi_tensor)
    optimizer_runs.assert_same_parameters(optimizer_runs.run(name, "reference", max_grad_norm),
                                          optimizer_runs.run(name, "foreach", max_grad_norm, device="cuda"),
                                          rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@needs_cuda
def test_on_the_gpu_a_captured_step_replays_the_eager_one():
    """The capturable LAMB's step (clipped, device step count and lr) captured in a CUDA graph: its replays
    equal as many eager steps of a twin (the kernels' address tables are written inside the graph)."""
    def build() -> tuple[torch.nn.Module, Any]:
        model = layers().cuda()
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).cuda()
        return model, capturable(build_optimizer(parameter_groups(model, 0.01), "lamb", 1e-2, (0.9, 0.999), 1e-6,
                                                 0.01, 1.0, "foreach"))

    (graphed, graphed_opt), (eager, eager_opt) = build(), build()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: compiles the kernels, builds the host tables
            graphed_opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed_opt.step()
    for _ in range(3):
        graph.replay()
    for _ in range(6):
        eager_opt.step()
    for a, b in zip(graphed.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
