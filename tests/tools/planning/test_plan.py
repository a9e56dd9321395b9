"""tools/plan.py and tools/mlperf_tools/planning/step_model.py: every shipped GPU config's traced memory fits its device, the
memory and step-time model behave as the trainer does, and the command line plans a config or refuses it
in one line."""

from __future__ import annotations

import math
import re
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mlperf_bert.dryrun.cost import FP8, MATMUL, OTHER, CostTracer, OpCost, PhaseCost
from mlperf_bert.dryrun.estimate import MemoryEstimate, StepWork, estimate, extrapolate, memory_from_dict
from mlperf_bert.config.batch_size import config_batch
from mlperf_bert.config.cli import parse_config
from mlperf_bert.dryrun.shipped import BERT_LARGE, exports, trainer_argv
from mlperf_bert.model.bert import BertConfig, BertForPreTraining
from mlperf_bert.optim.clipping import ClipMode, all_reduce_overlaps_backward
from mlperf_bert.train.evaluation_interval import EvalSchedule

from mlperf_tools.planning import plan
from mlperf_tools.planning import recipe
from mlperf_tools.planning import step_calibration
from mlperf_tools.planning import step_model
from tests.harness.paths import REPO

CONFIGS = plan.shipped_gpu_configs()


@pytest.fixture(scope="module")
def traced() -> dict[str, dict[str, Any]]:
    """Each shipped GPU config's BERT-Large dry run, with Inductor's count of its compiled step, traced once (cached
    across sessions by plan.traces)."""
    envs = {c.name: exports(c) for c in CONFIGS}
    return plan.traces(envs, compiled=True)


@pytest.fixture(scope="module")
def predictions() -> dict[str, plan.Prediction]:
    """Each config's plan: our step, and NVIDIA's code on its step traced in NVIDIA's precision."""
    return {p.name: p for p in plan.plans(CONFIGS, None, None, True)}


def test_every_shipped_gpu_config_fits_its_device(predictions: dict[str, plan.Prediction]) -> None:
    """`make test` fails a shipped config whose traced peak (with the allocator's margin) exceeds its device."""
    assert {p.name for p in predictions.values()} == {c.name for c in CONFIGS}
    too_big = {name: f"{p.fit.needed_bytes / 1e9:.1f} GB > {p.device.memory_bytes / 1e9:.0f} GB"
               for name, p in predictions.items() if not p.fit.fits}
    assert not too_big, too_big


def test_traced_dry_runs_raise_no_findings(traced: dict[str, dict[str, Any]]) -> None:
    assert {name: t["failures"] for name, t in traced.items() if t["failures"]} == {}


def test_fp8_traces_after_bf16_ones_in_one_process_raise_no_findings() -> None:
    """The configs in NVIDIA's precision (FP8 on the Hopper and Blackwell devices), as `plans` traces them: in the
    dry-run process of the bf16 configs, one after another. Dynamo's code of an earlier build once ran in the next
    one: an FP8 model's backward failed ("self must be row_major"), a second FP8 build counted no FP8 GEMM."""
    envs = {c.name: exports(c) for c in CONFIGS}
    fp8 = {f"{name} in NVIDIA's precision": other for name, env in envs.items() if (other := plan.nvidia_env(
        env, step_model.DEVICES[plan.device_of(env, REPO / name)])) is not None}
    assert len(fp8) == 4
    traced = plan.traces({"config_DGXH200_1x8.sh": envs["config_DGXH200_1x8.sh"], **fp8})
    assert {name: t["failures"] for name, t in traced.items() if t["failures"]} == {}


def test_weights_are_the_bert_large_parameters_on_every_config(traced: dict[str, dict[str, Any]]) -> None:
    with torch.device("meta"):
        numel = sum(p.numel() for p in BertForPreTraining(BertConfig(**BERT_LARGE)).parameters())
    for name, t in traced.items():
        weights = memory_from_dict(t["memory"]).weights
        # fp32 master weights; a sharded optimizer's are views of one flat buffer padded to whole shards.
        assert 4 * numel <= weights < 4 * (numel + t["world_size"]), (name, weights)


def test_sharding_divides_the_optimizer_state_and_graphs_hold_a_pool(traced: dict[str, dict[str, Any]]) -> None:
    memory = {name: memory_from_dict(t["memory"]) for name, t in traced.items()}
    whole = memory["config_DGXA100_1x8.sh"].optimizer_state  # unsharded LAMB: two fp32 moments per weight
    assert whole >= 2 * memory["config_DGXA100_1x8.sh"].weights
    sharded = {c.name: int(exports(c).get("DIST_OPTIMIZER_GROUP_SIZE") or traced[c.name]["world_size"])
               for c in CONFIGS if exports(c).get("DIST_OPTIMIZER") == "1"}
    # Sharded: the flat gradient (as large as the weights), this rank's 1/group of the two moments and the reduced
    # gradient's shard (optim/sharded.py: one copy of the state per shard group).
    assert sharded and all(memory[name].optimizer_state - memory[name].weights ==
                           pytest.approx(3 * memory[name].weights / group, rel=0.02)
                           for name, group in sharded.items()), {n: memory[n].optimizer_state for n in sharded}
    for c in CONFIGS:
        graphed = "1" in (exports(c).get("CUDA_GRAPHS"), exports(c).get("EVAL_CUDA_GRAPH"))  # the eval graph too
        assert (memory[c.name].graph_pool > 0) == graphed, c.name
        assert memory[c.name].train_peak > memory[c.name].persistent > memory[c.name].weights, c.name


def test_memory_fit_counts_the_margins() -> None:
    device = step_model.DEVICES["H100"]
    reserved = step_model.constant("memory_reserved_gib") * (1 << 30)
    limit = (device.memory_bytes - reserved) / (1 + step_model.constant("memory_margin"))
    just = MemoryEstimate(1, 1, 1, 0, int(limit) - 1, 0, 1)
    over = MemoryEstimate(1, 1, 1, 0, int(limit) + (1 << 20), 0, 1)
    assert step_model.memory_fit(just, device).fits and not step_model.memory_fit(over, device).fits


def test_extrapolation_from_one_and_two_layers_is_linear() -> None:
    """a + b x layers for every count: one layer's ops and collectives, plus 23 more of the second trace's growth."""
    def traced(layers: int) -> tuple[MemoryEstimate, StepWork]:
        ops = Counter({OpCost("mm", MATMUL, 6, 10): 4 * layers + 1, OpCost("_foreach_add", OTHER, 0, 8 * layers): 1})
        comms = Counter({("allreduce_", 100): layers + 1})
        memory = MemoryEstimate(*(10 * layers + i for i in range(7)))
        return memory, StepWork(PhaseCost(5 * layers, layers, ops, comms), PhaseCost(), 2.0, True)

    memory, work = extrapolate(traced(1), traced(2), 24)
    assert memory == traced(24)[0]
    assert work.step.ops == traced(24)[1].step.ops and work.step.collectives == traced(24)[1].step.collectives
    assert (work.step.peak_bytes, work.eval_scale, work.captured) == (120, 2.0, True)


def _fake_cuda_run() -> tuple[list[torch.Tensor], torch.optim.Optimizer, list[SimpleNamespace]]:
    """Weights of 300 x 200 + 200 fp32 (240,800 bytes), AdamW's two moments (481,600 bytes; its step counts are
    on the host), and two eval batches of 1,000 int64 and 1,000 int32 values (24,000 bytes)."""
    weight, bias = (torch.nn.Parameter(torch.zeros(shape, device="cuda")) for shape in ((300, 200), (200,)))
    optimizer = torch.optim.AdamW([weight, bias], lr=1e-3)
    for p in (weight, bias):  # the state a first step makes
        optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                              "exp_avg_sq": torch.zeros_like(p)}
    batches = [SimpleNamespace(ids=torch.zeros(1000, dtype=torch.int64, device="cuda"),
                               lengths=torch.zeros(1000, dtype=torch.int32, device="cuda"), rows=3) for _ in range(2)]
    return [weight, bias, weight], optimizer, batches  # a weight listed twice holds its bytes once


@pytest.mark.parametrize("graphed", [False, True])
def test_estimate_counts_bytes_and_work_as_a_hand_count(graphed: bool) -> None:
    """A dry run's tracer written out by hand; every number of the estimate worked out from it. 16 sequences traced
    of a rank's ceil(10,000 / 3) = 3,334: 24,000 / 16 = 1,500 bytes a sequence, 5,001,000 for the share."""
    mm, add, cat = OpCost("mm", MATMUL, 100, 10), OpCost("add", OTHER, 0, 8), OpCost("cat", OTHER, 0, 4)
    tracer = CostTracer()
    tracer.pool_reserved, tracer.captures = 777, 2  # the step's capture, then the eval forward's
    tracer.phases = {"build": PhaseCost(1000, 0), "capture": PhaseCost(7500, 1000, Counter({mm: 3})),
                     "capture 2": PhaseCost(7600, 7500, Counter({mm: 2, add: 1})),
                     "step 1": PhaseCost(5000, 900, Counter({mm: 4})),
                     "step 3": PhaseCost(6000, 1100, Counter({mm: 5})),
                     "eval": PhaseCost(9000, 1200, Counter({cat: 1}), Counter({("allreduce_", 24): 1}))}
    with FakeTensorMode():
        weights, optimizer, batches = _fake_cuda_run()
        memory, work = estimate(tracer, 3, weights, optimizer, batches, 16, math.ceil(10_000 / 3), graphed, graphed)
    assert (memory.weights, memory.optimizer_state) == (240_800, 2 * 240_800)
    assert (memory.persistent, memory.graph_pool, memory.train_peak) == (1200, 777, 7600)  # the eval's peak is apart
    assert memory.eval_set == 1500 * 3334 and memory.eval_peak == 9000 - 24_000 + 1500 * 3334
    assert (memory.step_transient, memory.peak) == (7600 - 1200, memory.eval_peak)
    assert work.eval_scale == pytest.approx(3334 / 16) and (work.captured, work.eval_captured) == (graphed, graphed)
    assert work.step.ops == (Counter({mm: 3}) if graphed else Counter({mm: 5}))  # the capture, or the last step
    # Graphed, each eval batch is one replay of the eval forward's capture.
    assert work.eval.ops == (Counter({cat: 1, mm: 2 * 2, add: 2}) if graphed else Counter({cat: 1}))
    assert work.eval.collectives == Counter({("allreduce_", 24): 1})
    assert StepWork.from_dict(work.to_dict()) == work


def test_estimate_counts_weights_in_one_flat_buffer_once() -> None:
    """The sharded optimizer's layout: every weight a view of one flat buffer, padded to whole shards (240,800 values
    over 3 ranks: 240,801): the buffer's 963,204 bytes, not a buffer per weight."""
    flat = torch.zeros(240_801)
    weights = [flat[:60_000].view(300, 200), flat[60_000:60_200]]
    tracer = CostTracer()
    tracer.phases = {"build": PhaseCost(10, 0), "eval": PhaseCost(10, 10)}
    memory, _ = estimate(tracer, 1, weights, torch.optim.SGD(weights, lr=0.1), [], 0, 0)
    assert (memory.weights, memory.optimizer_state, memory.eval_set) == (4 * 240_801, 0, 0)


def _work(collective_bytes: int = 0, ops: int = 1000) -> StepWork:
    step = PhaseCost(ops=Counter({OpCost("mm", MATMUL, 10**12, 10**9): 1, OpCost("add", OTHER, 0, 10**6): ops}),
                     collectives=Counter({("allreduce_", collective_bytes): 1}))
    return StepWork(step, PhaseCost(), 1.0, captured=False)


def test_step_time_follows_the_device_the_link_and_the_overlap() -> None:
    work = _work(collective_bytes=1 << 30)
    a100, h100 = step_model.DEVICES["A100"], step_model.DEVICES["H100"]
    assert step_model.step_time(work, h100, 8, True).compute_s < step_model.step_time(work, a100, 8, True).compute_s
    nvlink, ib = step_model.step_time(work, h100, 8, False), step_model.step_time(work, h100, 16, False, per_node=2)
    assert nvlink.link.name == "NVLink" and ib.link.name == "InfiniBand" and ib.comm_s > 4 * nvlink.comm_s
    assert step_model.link_of(h100, 16, per_node=2).bytes_per_s == 2 * h100.network_bytes_per_s  # a node's NICs
    hidden = step_model.step_time(work, h100, 8, True)
    assert hidden.exposed_comm_s == max(hidden.comm_s - 2 / 3 * hidden.compute_s, 0) < nvlink.exposed_comm_s
    # A ring all-reduce moves 2(n-1)/n of the buffer over each link.
    expected = 2 * 7 / 8 * (1 << 30) / (h100.nvlink_bytes_per_s * step_model.constant("network_efficiency"))
    assert math.isclose(nvlink.comm_s, expected + step_model.constant("collective_latency_us") * 1e-6)
    assert step_model.step_time(_work(ops=10**6), h100, 1, False).bound.startswith("host-bound")


@pytest.mark.parametrize("sharded", ["0", "1"])
@pytest.mark.parametrize("mode", list(ClipMode))
def test_overlap_follows_the_clip_mode_and_the_sharded_optimizer(mode: ClipMode, sharded: str) -> None:
    """The trainer's rule (clipping.all_reduce_overlaps_backward, which the sharded optimizer's hook follows too):
    the exchange of a mode that overlaps is hidden behind the backward, sharded or not; before_allreduce's is not."""
    exchange = plan.overlaps({"CLIP_MODE": mode.value, "DIST_OPTIMIZER": sharded, "DIST_OPTIMIZER_GROUP_SIZE": "8"})
    assert exchange.overlaps_backward == all_reduce_overlaps_backward(mode) and exchange.sharded == (sharded == "1")
    kind = "_reduce_scatter_base_" if sharded == "1" else "allreduce_"
    step = PhaseCost(ops=Counter({OpCost("mm", MATMUL, 10**13, 10**9): 1}), collectives=Counter({(kind, 1 << 24): 1}))
    timed = step_model.step_time(StepWork(step, PhaseCost(), 1.0, captured=True), step_model.DEVICES["A100"], 8,
                                 exchange)
    assert timed.comm_s > 0 and (timed.exposed_comm_s == 0) == all_reduce_overlaps_backward(mode), timed


def test_shard_groups_keep_reduce_scatter_and_all_gather_on_nvlink() -> None:
    """Groups of 8 on 1,024 A100s: reduce-scatter and all-gather among 8 over NVLink, the shard's all-reduce among
    128 groups over one NIC per rank; the all-gather hides behind the update (optim/sharded.py)."""
    a100 = step_model.DEVICES["A100"]
    links = step_model.links(a100, 1024, 8, step_model.Exchange(True, True, 8))
    assert (links["reduce_scatter"].name, links["reduce_scatter"].ranks) == ("NVLink", 8)
    assert links["all_gather"] == links["reduce_scatter"]
    assert links["all_reduce"] == step_model.Link(128, a100.network_bytes_per_s, "InfiniBand")
    whole = step_model.links(a100, 1024, 8, step_model.Exchange(True, True, 0))["reduce_scatter"]
    assert (whole.name, whole.ranks) == ("InfiniBand", 1024)
    update = OpCost("_foreach_mul_", OTHER, 0, 10**10)
    step = PhaseCost(ops=Counter({update: 1}), collectives=Counter({("_allgather_base_", 1 << 20): 1}))
    gathered = step_model.step_time(StepWork(step, PhaseCost(), 1.0, captured=True), a100, 1024,
                                    step_model.Exchange(False, True, 8))
    assert gathered.comm_s > 0 and gathered.exposed_comm_s == 0


# Shard groups smaller than a node (DIST_OPTIMIZER_GROUP_SIZE below DGXNGPU): ranks, ranks per node, group size,
# then the ranks of each collective's ring and whether the across-groups all-reduce leaves the node's NVLink.
GROUPS_IN_A_NODE = [(16, 8, 4, 4, 4, True),  # 2 nodes of 8, 2 groups a node: 4 groups, 2 in each node
                    (16, 8, 2, 2, 8, True),  # 4 groups a node
                    (8, 8, 2, 2, 4, False),  # one node of 4 groups: every ring on NVLink
                    (24, 8, 4, 4, 6, True)]  # 3 nodes, a group count that is not a power of two


@pytest.mark.parametrize("ranks, per_node, group, inside, across, over_ib", GROUPS_IN_A_NODE)
def test_shard_groups_smaller_than_a_node_take_the_documented_communication_time(
        ranks: int, per_node: int, group: int, inside: int, across: int, over_ib: bool) -> None:
    """Several shard groups per node, by hand from step_model's docstring: each collective takes latency + ring
    factor x bytes / (link bandwidth x network efficiency); reduce-scatter and all-gather run among a group's g ranks
    on NVLink (all in one node), the shard's all-reduce among the ranks / g groups (one rank of each, several of them
    in one node), on each rank's own NIC once the job spans nodes, else on NVLink. The all-gathers hide behind the
    update and the rest behind the backward, so a step without compute exposes all of it."""
    a100 = step_model.DEVICES["A100"]
    exchange = plan.overlaps({"CLIP_MODE": "after_allreduce", "DIST_OPTIMIZER": "1",
                              "DIST_OPTIMIZER_GROUP_SIZE": str(group)})
    assert exchange == step_model.Exchange(True, True, group)
    sizes = {"_reduce_scatter_base_": 64 << 20, "allreduce_": (64 << 20) // group, "_allgather_base_": 16 << 20}
    step = PhaseCost(collectives=Counter({(op, size): 1 for op, size in sizes.items()}))
    timed = step_model.step_time(StepWork(step, PhaseCost(), 1.0, captured=True), a100, ranks, exchange,
                                 per_node=per_node)
    latency, efficiency = 20e-6, 0.80  # CALIBRATION's collective_latency_us and network_efficiency
    assert (step_model.constant("collective_latency_us"), step_model.constant("network_efficiency")) == (20.0, 0.80)
    nvlink, nic = 300e9, 25e9  # A100: NVLink 600 GB/s both ways, one HDR 200 Gb/s NIC per GPU
    reduce_scatter = latency + (inside - 1) / inside * sizes["_reduce_scatter_base_"] / (nvlink * efficiency)
    all_gather = latency + (inside - 1) / inside * sizes["_allgather_base_"] / (nvlink * efficiency)
    all_reduce = latency + 2 * (across - 1) / across * sizes["allreduce_"] / ((nic if over_ib else nvlink) * efficiency)
    assert timed.comm_s == pytest.approx(reduce_scatter + all_reduce + all_gather, rel=1e-12)
    assert timed.exposed_comm_s == pytest.approx(timed.comm_s, rel=1e-12)  # no backward, no update to hide behind
    links = step_model.links(a100, ranks, per_node, exchange)
    assert links["all_reduce"] == step_model.Link(across, nic if over_ib else nvlink, "InfiniBand" if over_ib else
                                                  "NVLink")
    assert links["reduce_scatter"] == links["all_gather"] == step_model.Link(inside, nvlink, "NVLink")
    assert timed.link.name == "NVLink"  # the most bytes: the reduce-scatter's and the all-gather's


def test_every_shipped_config_is_timed_on_inductors_kernels(traced: dict[str, dict[str, Any]],
                                                            predictions: dict[str, plan.Prediction]) -> None:
    """Every shipped GPU config compiles its layers: our step times their element-wise work as the bytes Inductor's
    code for the config's GPU moves (one graph per region, every kernel's bytes counted) at inductor_bandwidth, a
    fraction of what the same ops move eagerly; the ops outside the compiled regions at their traced bytes at
    eager_bandwidth. Neither is counted twice."""
    k = step_model.ours()
    for config in CONFIGS:
        report, p = traced[config.name]["inductor"], predictions[config.name]
        assert (report["gpu"], report["graph_breaks"], report["step"]["unknown_bytes_launches"]) == (
            p.device.name, [], 0), config.name
        elementwise = [(op, n) for op, n in p.work.step.ops.items() if op.kind == OTHER and not step_model.is_optimizer_op(op.name)]
        inside = sum(n * op.bytes for op, n in elementwise if op.compiled)
        outside = sum(n * op.bytes for op, n in elementwise if not op.compiled)
        assert 0 < report["step"]["elementwise_bytes"] < inside, config.name
        terms = {t.name: t.seconds for t in p.step.terms}
        hbm = p.device.hbm_bytes_per_s
        assert terms["compiled element-wise"] == pytest.approx(
            report["step"]["elementwise_bytes"] / (k["inductor_bandwidth"] * hbm)), config.name
        assert terms["element-wise"] == pytest.approx(outside / (k["eager_bandwidth"] * hbm)), config.name


def test_compiled_layers_launch_one_elementwise_kernel_per_matrix_product() -> None:
    """Compile changes the kernels launched (and issued by the host), not the bytes or FLOPs."""
    work = _work(ops=1000)
    compiled = StepWork(work.step, work.eval, 1.0, captured=False, compiled=True)
    assert step_model.launched_kernels(work.step, False) == 1001 and step_model.launched_kernels(work.step, True) == 2
    h100 = step_model.DEVICES["H100"]
    eager, fused = step_model.step_time(work, h100, 1, False), step_model.step_time(compiled, h100, 1, False)
    assert fused.host_s == pytest.approx(eager.host_s * 2 / 1001)
    gaps = 999 * step_model.constant("kernel_gap_us") * 1e-6
    assert eager.compute_s - fused.compute_s == pytest.approx(gaps)


def test_eval_graph_is_not_the_training_step(traced: dict[str, dict[str, Any]]) -> None:
    """config_DGXA100_1x8.sh: an eager step (forward, backward, all-reduce) and an eval graph replayed per batch;
    the graphed H200 config: the step's capture, with its backward and all-reduce, and the eval graph's."""
    for name, graphed in (("config_DGXA100_1x8.sh", False), ("config_DGXH200_1x8.sh", True)):
        work = StepWork.from_dict(traced[name]["work"])
        assert (work.captured, work.eval_captured, work.compiled) == (graphed, True, True), name
        assert max(size for _, size in work.step.collectives) > 1 << 20 > max(size for _, size in work.eval.collectives)
        backward = {op.name for op in work.step.ops if op.name.endswith("_backward")}
        assert {"native_layer_norm_backward", "gelu_backward"} <= backward, name
        assert not any(op.name.endswith("_backward") for op in work.eval.ops), name
        assert any(op.kind in (MATMUL, FP8) for op in work.eval.ops), name  # the graph's forward, per batch


def test_calibrated_step_time_is_near_the_published_rates(predictions: dict[str, plan.Prediction]) -> None:
    """NVIDIA's code on this system, the calibration's promise: every published rate within its fit's spread."""
    calibrated = {name: pub for name, pub in plan.published().items() if pub.rate is not None}
    assert len(calibrated) == 5, calibrated
    for name, pub in calibrated.items():
        rate = predictions[name].nvidia_rate(pub.includes_eval)
        assert abs(math.log(rate / pub.rate)) <= plan.residual_spread() + 1e-9, (name, rate, pub.rate)


def test_published_h200_rate_is_the_reference_range() -> None:
    """The log parser's rate for NVIDIA's v4.0 H200 runs: REFERENCE.md's 1,064-1,095 per GPU between evals."""
    assert 1000 < (plan.published()["config_DGXH200_1x8.sh"].rate or 0) < 1150


def test_time_to_train_counts_steps_and_evals(predictions: dict[str, plan.Prediction]) -> None:
    p = predictions["config_DGXH200_1x8.sh"]
    ttt, low, high = p.ttt
    assert low < ttt < high
    assert p.samples == pytest.approx(p.window.rcp_mean) and p.samples_range[0] == pytest.approx(p.window.min_mean)
    # 2,443,934 samples at GBS 768 with evals every 150,000 from 150,000: the run stops at the 17th eval.
    assert p.evals(p.samples) == 17 and p.stop_samples(p.samples) == math.ceil(17 * 150_000 / 768) * 768
    by_hand = (step_model.constant("run_fixed_s") + p.stop_samples(p.samples) / 768 * p.step.seconds
               + 17 * p.eval_s) / 60
    assert ttt == pytest.approx(by_hand)


def test_plan_prints_memory_step_and_time_to_train(traced: dict[str, dict[str, Any]], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert plan.main([str(REPO / "config_DGXH200_1x8.sh"), "--plot", str(tmp_path / "ttt.png")]) == 0
    out = capsys.readouterr().out
    for piece in ("memory per device: training", "GB of 141 GB: headroom", "samples/s", "RCP mean 2,443,934",
                  "evals: 17", "time to train:"):
        assert piece in out, out
    assert (tmp_path / "ttt.png").stat().st_size > 10_000


def test_plan_takes_another_device(traced: dict[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    """The H200 recipe on B200s: the same trace (cached), another device's rates and memory."""
    assert plan.main([str(REPO / "config_DGXH200_1x8.sh"), "--device", "B200"]) == 0
    out = capsys.readouterr().out
    assert "8 x B200, global batch 768" in out and "GB of 180 GB" in out, out


def test_hypothetical_system_spreads_the_gpus_over_nodes() -> None:
    def gbs(env: dict[str, str]) -> int:
        return plan.config_batch_shape(env, "config").global_batch_size

    env = plan.config_env(REPO / "config_DGXH200_1x8.sh", 16, "H200")
    assert (env["DGXNGPU"], env["DGXNNODES"], gbs(env)) == ("8", "2", 1536)
    env = plan.config_env(REPO / "config_GB200_2x4.sh", 8, "GB200")
    assert (env["DGXNGPU"], env["DGXNNODES"], gbs(env)) == ("4", "2", 768)
    assert gbs(plan.config_env(REPO / "config_DGXA100_1x8.sh", 1, "A100")) == 56


# The global batch by hand, from each config's "Batch arithmetic" comment: BATCHSIZE (per GPU and optimizer step,
# the accumulation inside it) x GPUs per node x nodes, x 2 sequences a pack. GRADIENT_STEPS splits BATCHSIZE into
# micro-batches and multiplies nothing.
HAND_GBS = {"config_DGXA100_1x8.sh": 56 * 8, "config_DGXA100_128x8.sh": 2 * 2 * 8 * 128,
            "config_DGXB200_1x8.sh": 48 * 2 * 8, "config_DGXH100_1x8.sh": 48 * 2 * 8,
            "config_DGXH200_1x8.sh": 48 * 2 * 8, "config_GB200_2x4.sh": 48 * 2 * 4 * 2,
            "config_SamsungA100_128x8.sh": 16 * 8 * 128}
# Shipped configs with accumulation: (config, GRADIENT_STEPS) -> the same global batch, smaller micro-batches.
ACCUMULATED = [("config_DGXA100_1x8.sh", 2), ("config_DGXA100_1x8.sh", 4), ("config_GB200_2x4.sh", 2),
               ("config_DGXA100_128x8.sh", 2)]


def _trainer_gbs(env: dict[str, str], folder: Path) -> int:
    """The global batch the trainer logs: its config built from the flags run_and_time.sh passes for `env`."""
    folder.mkdir()
    return parse_config(trainer_argv(env, folder), int(env["DGXNGPU"]) * int(env["DGXNNODES"])).global_batch_size


def _planned(name: str, env: dict[str, str], device: str, traced: dict[str, Any]) -> plan.Prediction:
    """The plan of `env`, on the memory and work of a shipped config's trace (the batch count does not read it)."""
    p = plan.predict(name, env, step_model.DEVICES[device], traced)
    assert f"global batch {p.gbs}\n" in plan.report(p) and f"GBS {p.gbs} " in p.window.where()
    return p


def test_plan_and_trainer_count_one_global_batch_on_every_shipped_config(predictions: dict[str, plan.Prediction],
                                                                         tmp_path: Path) -> None:
    assert set(HAND_GBS) == {c.name for c in CONFIGS}
    for config in CONFIGS:
        env = exports(config)
        assert predictions[config.name].gbs == _trainer_gbs(env, tmp_path / config.name) == HAND_GBS[config.name]


@pytest.mark.parametrize("name, steps", ACCUMULATED)
def test_accumulation_does_not_multiply_the_planned_global_batch(traced: dict[str, dict[str, Any]], tmp_path: Path,
                                                                  name: str, steps: int) -> None:
    """GRADIENT_STEPS > 1 (one node and several): the plan's batch, RCP window and throughput are the trainer's."""
    env = {**exports(REPO / name), "GRADIENT_STEPS": str(steps)}
    p = _planned(name, env, plan.device_of(env, REPO / name), traced[name])
    assert p.gbs == _trainer_gbs(env, tmp_path / "trainer") == HAND_GBS[name]
    assert p.throughput == pytest.approx(HAND_GBS[name] / p.step.seconds)


def test_the_recipe_finders_config_plans_at_its_own_global_batch(traced: dict[str, dict[str, Any]],
                                                                 tmp_path: Path) -> None:
    """8 A100s of 16 GB: BATCHSIZE 56 in 4 micro-batches of 14, the published 448 (14 x 4 x 8), not 1,792."""
    path = tmp_path / "config_A16_1x8.sh"
    assert recipe.main(["--gpus", "8", "--memory_gb", "16", "--device", "A100", "--write", str(path)]) == 0
    env = exports(path)
    assert (env["BATCHSIZE"], env["GRADIENT_STEPS"]) == ("56", "4")
    p = _planned(path.name, env, "A100", traced["config_DGXA100_1x8.sh"])
    assert p.gbs == _trainer_gbs(env, tmp_path / "trainer") == 14 * 4 * 8


def test_a_batch_the_accumulation_does_not_divide_is_one_line_and_exit_2(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config_DGXA100_1x8.sh"
    config.write_text((REPO / config.name).read_text().replace("GRADIENT_STEPS=1", "GRADIENT_STEPS=3"))
    assert plan.main([str(config)]) == 2
    err = capsys.readouterr().err
    assert "BATCHSIZE=56 is not divisible by GRADIENT_STEPS=3" in err and len(err.strip().splitlines()) == 1, err


# Layouts the shipped configs do not have, each global batch worked out by hand (BATCHSIZE x GPUs per node x nodes
# x 2 sequences a pack; GRADIENT_STEPS only splits BATCHSIZE): 3 nodes of 4 (a world no power of two), micro-batches
# of one sequence (GRADIENT_STEPS = BATCHSIZE), 128 nodes without the sharded optimizer, layouts other than packed.
HAND_BATCHES = [
    # BATCHSIZE, GRADIENT_STEPS, DGXNGPU, DGXNNODES, INPUT_LAYOUT -> world, micro-batch, global batch
    (("48", "4", "4", "3", "packed"), (12, 12, 48 * 4 * 3 * 2)),
    (("12", "12", "4", "3", "packed"), (12, 1, 12 * 4 * 3 * 2)),
    (("16", "1", "8", "128", "unpadded"), (1024, 16, 16 * 8 * 128)),
    (("56", "", "8", "1", "padded"), (8, 56, 56 * 8)),  # GRADIENT_STEPS empty: the trainer's default of 1
    (("7", "7", "1", "1", "packed"), (1, 1, 14)),
]


@pytest.mark.parametrize("exported, expected", HAND_BATCHES)
def test_config_batch_counts_every_layout_by_hand(exported: tuple[str, ...], expected: tuple[int, int, int]) -> None:
    names = ("BATCHSIZE", "GRADIENT_STEPS", "DGXNGPU", "DGXNNODES", "INPUT_LAYOUT")
    batch = config_batch(dict(zip(names, exported)), "config_X.sh")
    assert (batch.world_size, batch.micro_batch_size, batch.global_batch_size) == expected


def test_trainer_and_plan_count_three_nodes_with_accumulation_alike(tmp_path: Path) -> None:
    """GB200's config (packed, no sharded optimizer) on 3 nodes of 4 with 4 micro-batches of 12 packs: 1,152."""
    env = {**exports(REPO / "config_GB200_2x4.sh"), "DGXNNODES": "3", "GRADIENT_STEPS": "4"}
    assert plan.config_batch_shape(env, "config").global_batch_size == _trainer_gbs(env, tmp_path / "t") == 1152


@pytest.mark.parametrize("changes, says", [
    ({"GRADIENT_STEPS": "112"}, "BATCHSIZE=56 is not divisible by GRADIENT_STEPS=112"),  # more steps than items
    ({"GRADIENT_STEPS": "0"}, "GRADIENT_STEPS=0 is not a positive whole number"),
    ({"BATCHSIZE": "-8"}, "BATCHSIZE=-8 is not a positive whole number"),
    ({"DGXNNODES": "1.5"}, "DGXNNODES=1.5 is not a positive whole number"),
    ({"DGXNNODES": None}, "config_X.sh: no export of DGXNNODES"),
    ({"BATCHSIZE": ""}, "config_X.sh: no export of BATCHSIZE"),
])
def test_config_batch_refuses_counts_the_trainer_refuses(changes: dict[str, str | None], says: str) -> None:
    env = {"BATCHSIZE": "56", "GRADIENT_STEPS": "1", "DGXNGPU": "8", "DGXNNODES": "2"}
    env = {k: v for k, v in {**env, **changes}.items() if v is not None}
    with pytest.raises(ValueError, match=re.escape(says)):
        config_batch(env, "config_X.sh")


@pytest.mark.parametrize("args, says", [
    (["config_nothing.sh"], "no such config file"),
    (["config_DGXH200_1x8.sh", "--gpus", "12"], "--gpus 12: give at most 8 or a multiple of 8"),
    (["config_CPU_1x2.sh"], "DGXSYSTEM='CPU_1x2' names no known device"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert plan.main([str(REPO / args[0]), *args[1:]]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args", [[], ["config_DGXH200_1x8.sh", "--device", "TPU"], ["config_DGXH200_1x8.sh", "--gpus", "x"]])
def test_bad_flags_are_one_line_and_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        plan.main(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("plan.py: ") and len(err.strip().splitlines()) == 1, err


def test_a_run_that_stops_before_it_converges_claims_no_time_to_train(capsys: pytest.CaptureFixture[str]) -> None:
    """MAX_STEPS=1000 at GBS 448 stops the run at 448,000 samples, far short of the 2,414,421 of the RCP mean: the plan
    said "time to train: 29.86 min" with 17 evals up to 2.55M samples, and exit 0."""
    assert plan.main([str(REPO / "config_DGXA100_1x8.sh"), "--config_var", "MAX_STEPS=1000"]) == 2
    captured = capsys.readouterr()
    assert "  run stops: at 448,000 samples at the latest (MAX_STEPS=1000 x global batch 448)" in captured.out
    assert "  evals: 3 (every 150,000 samples from 150,000)" in captured.out  # 150,000, 300,000 and at the stop
    [line] = [line for line in captured.out.splitlines() if "time to train" in line]
    assert line.startswith("  time to train: none: the run stops at 448,000 samples, before the 2,414,421 of the "
                           "RCP mean: it ends aborted"), line
    # The fix reaches the RCP mean plus one standard deviation: ceil(high / 448) steps.
    steps = math.ceil(plan.scoring.rcp_window(448, plan.RULESET).record["RCP Stdev"] / 448 + 2_414_421 / 448)
    assert captured.err.splitlines() == [
        "plan.py: config_DGXA100_1x8.sh [MAX_STEPS=1000]: the run stops at 448,000 samples (MAX_STEPS=1000 x global "
        "batch 448), before the 2,414,421 samples it needs to converge (RCP mean): no time to train; give "
        f"MAX_STEPS={steps} or more"]


def test_a_plot_matplotlib_cannot_draw_is_refused_before_the_traces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """--plot was drawn after every config was traced (minutes on a fresh cache), then an ImportError traceback."""
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    monkeypatch.setattr(plan, "traces", lambda *args: pytest.fail("traced first"))
    assert plan.main(["--all", "--plot", str(tmp_path / "ttt.png")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("plan.py: --plot needs matplotlib, which is installed but fails to import "
                           "(ModuleNotFoundError: ") and line.endswith("or leave out --plot"), line


def _limited(p: plan.Prediction, variable: str, value: int) -> plan.Prediction:
    return replace(p, limit=plan.RunLimit(variable, value, p.gbs))


def test_the_run_limit_at_exactly_the_samples_to_converge_and_one_step_short(
        predictions: dict[str, plan.Prediction]) -> None:
    """The trainer evaluates at its limit: a limit exactly at the samples converges there, one sample (one step)
    less does not. MAX_SAMPLES_TERMINATION ends at the step that reaches it (a whole step of 768 past it)."""
    p = predictions["config_DGXH200_1x8.sh"]
    steps = math.ceil(p.samples / 768)
    at = _limited(p, "MAX_STEPS", steps)
    assert at.converges(p.samples) and at.stop_samples(p.samples) == steps * 768 <= p.stop_samples(p.samples)
    assert at.converges(steps * 768) and not at.converges(steps * 768 + 1)  # the last step's samples exactly
    assert not _limited(p, "MAX_STEPS", steps - 1).converges(p.samples)
    reached = _limited(p, "MAX_SAMPLES_TERMINATION", steps * 768 - 767)  # the step that reaches it: steps x 768
    assert reached.limit.samples == steps * 768 and reached.converges(p.samples)
    short = _limited(p, "MAX_SAMPLES_TERMINATION", (steps - 1) * 768)
    assert not short.converges(p.samples) and short.evals(p.samples) == math.ceil((steps - 1) * 768 / 150_000)
    assert plan.short_of_convergence(short).endswith(
        f"give MAX_SAMPLES_TERMINATION={math.ceil(p.samples_range[1])} or more")
    assert "time to train: none" in plan.report(short)


def test_a_limit_inside_the_range_cuts_its_high_end(predictions: dict[str, plan.Prediction]) -> None:
    p = _limited(predictions["config_DGXH200_1x8.sh"], "MAX_STEPS", 3300)  # 2,534,400: over the mean, under the high end
    assert p.converges(p.samples) and not p.converges(p.samples_range[1]) and plan.short_of_convergence(p) is None
    [line] = [line for line in plan.report(p).splitlines() if "time to train" in line]
    assert re.fullmatch(r"  time to train: [\d.]+ min \(range [\d.]+ - over [\d.]+: a run that needs more than "
                        r"2,534,400 samples stops there, short of the target\)", line), line
    assert p.ttt[2] == p.minutes(p.samples_range[1], p.step_range[1]) and p.stop_samples(p.samples_range[1]) == 2_534_400


def test_every_shipped_closed_config_runs_past_the_rcp_mean_plus_one_standard_deviation(
        predictions: dict[str, plan.Prediction]) -> None:
    """Samsung's open-division recipe stops at 4,898,816 samples, below the closed division's RCP mean: no time to
    train is claimed for it, and it is no error."""
    for name, p in predictions.items():
        assert p.limit is not None, name
        if name == "config_SamsungA100_128x8.sh":
            assert not p.converges(p.samples) and plan.short_of_convergence(p) is None
            assert "this open-division recipe's own samples to converge are not modelled" in plan.report(p)
        else:
            assert p.converges(p.samples_range[1]) and plan.short_of_convergence(p) is None, name


# ---------------------------------------------------------------------------------------------
# Boundaries and hand computations: memory at the device's capacity, the eval's peak, the time to train's range,
# world size and links across nodes

GIB = 1 << 30
# BERT-Large with the vocabulary padded to 30,528, counted by hand: embeddings (word 30,528 x 1,024, position
# 512 x 1,024, token type 2 x 1,024, LayerNorm 2 x 1,024), 24 layers of QKV 3 x (1,024^2 + 1,024), output projection
# 1,024^2 + 1,024, FFN 1,024 x 4,096 + 4,096 and 4,096 x 1,024 + 1,024, two LayerNorms 2 x 2 x 1,024; the pooler
# 1,024^2 + 1,024, the MLM transform 1,024^2 + 1,024 with its LayerNorm 2 x 1,024 and decoder bias 30,528 (its
# weight tied to the word table), NSP 2 x 1,024 + 2.
BERT_LARGE_PARAMETERS = (31_260_672 + 524_288 + 2_048 + 2_048
                         + 24 * (3_148_800 + 1_049_600 + 4_198_400 + 4_195_328 + 2 * 2_048)
                         + 1_049_600 + 1_049_600 + 2_048 + 30_528 + 2_050)
# World size and ranks per node of each shipped config, by hand from its DGXNNODES x DGXNGPU.
HAND_WORLD = {"config_DGXA100_1x8.sh": (8, 8), "config_DGXA100_128x8.sh": (1024, 8), "config_DGXB200_1x8.sh": (8, 8),
              "config_DGXH100_1x8.sh": (8, 8), "config_DGXH200_1x8.sh": (8, 8), "config_GB200_2x4.sh": (8, 4),
              "config_SamsungA100_128x8.sh": (1024, 8)}


def test_memory_fit_at_exactly_the_devices_capacity_by_hand() -> None:
    """A peak of 10 GiB needs 10 x 1.10 + 3 GiB = 14 GiB (the allocator's 10 % and the CUDA context's 3 GiB): a device
    of exactly 14 GiB holds it with no headroom, one byte less does not; the peak is the eval's when it is larger."""
    assert BERT_LARGE_PARAMETERS == 336_232_258
    device = step_model.DEVICES["H100"]
    for train, evaluation in ((10 * GIB, 9 * GIB), (1 * GIB, 10 * GIB)):
        memory = MemoryEstimate(1, 1, 1, 0, train, 0, evaluation)
        at_capacity = step_model.memory_fit(memory, replace(device, memory_bytes=14 * GIB))
        assert at_capacity.needed_bytes == 14 * GIB and at_capacity.headroom_bytes == 0 and at_capacity.fits
        assert not step_model.memory_fit(memory, replace(device, memory_bytes=14 * GIB - 1)).fits


def test_an_out_of_memory_at_eval_time_is_not_hidden(traced: dict[str, dict[str, Any]]) -> None:
    """The H200 config with an eval peak of 130 GB (its training peak 35 GB): 130 x 1.1 GB + 3 GiB = 146.2 GB of 141:
    the plan says it does not fit, whatever the training step needs."""
    name = "config_DGXH200_1x8.sh"
    big_eval = {**traced[name], "memory": {**traced[name]["memory"], "eval_peak": 130 * 10**9}}
    p = plan.predict(name, exports(REPO / name), step_model.DEVICES["H200"], big_eval)
    assert p.memory.train_peak < 40 * 10**9
    assert p.fit.needed_bytes == pytest.approx(130e9 * 1.1 + 3 * GIB, rel=1e-9) and not p.fit.fits
    assert "DOES NOT FIT (5.2 GB short)" in plan.report(p)


def test_shipped_memory_is_bert_large_state_and_the_margins_by_hand(predictions: dict[str, plan.Prediction],
                                                                   traced: dict[str, dict[str, Any]]) -> None:
    """fp32 weights: 4 bytes a parameter; unsharded LAMB: two fp32 moments, 8 bytes a parameter; sharded in groups of
    8: the flat gradient (4 bytes) and 1/8 of the moments and the reduced gradient's shard (12 / 8 bytes), up to the
    padding to whole shards. Each config's need is its larger peak x 1.10 + 3 GiB."""
    n = BERT_LARGE_PARAMETERS
    for name, p in predictions.items():
        world = traced[name]["world_size"]
        m = p.memory
        assert 4 * n <= m.weights <= 4 * (n + world), name
        if p.overlap.sharded:
            assert m.optimizer_state == pytest.approx(4 * n + 12 * n / 8, abs=16 * world), name
        else:
            assert m.optimizer_state == pytest.approx(8 * n, abs=1024), name
        assert p.fit.needed_bytes == pytest.approx(max(m.train_peak, m.eval_peak) * 1.10 + 3 * GIB, rel=1e-12), name


def test_evals_and_the_stop_at_exact_eval_points(predictions: dict[str, plan.Prediction]) -> None:
    """Samples exactly at an eval point converge at that eval, one sample more at the next; a stop on a whole step
    stays where it is. Evals every 153,600 samples (200 steps of 768) from 153,600."""
    p = replace(predictions["config_DGXH200_1x8.sh"], schedule=EvalSchedule(153_600, 153_600))
    assert (p.evals(0), p.evals(153_599), p.evals(153_600), p.evals(153_601)) == (1, 1, 1, 2)
    assert (p.evals(17 * 153_600), p.evals(17 * 153_600 + 1)) == (17, 18)
    assert p.stop_samples(3 * 153_600) == 460_800 and p.stop_samples(3 * 153_600 + 1) == 614_400
    off_step = replace(p, schedule=EvalSchedule(150_000, 150_000))  # 150,000 = 195.3 steps: up to 196 steps
    assert off_step.stop_samples(150_000) == 196 * 768


def test_time_to_train_range_by_hand(predictions: dict[str, plan.Prediction]) -> None:
    """Low: the fewest samples the RCP bound accepts (RCP mean / maximum speed-up) and the step shorter by the
    leave-one-out spread, e^0.444; high: the RCP mean plus one standard deviation and the step longer by it. Evals
    every 150,000 samples, steps of 768 rounded up to the eval that sees the samples, 5 s fixed."""
    p = predictions["config_DGXH200_1x8.sh"]
    record = p.window.record
    assert record is not None
    low_samples = float(record["RCP Mean"]) / float(record["Max Speedup"])
    high_samples = float(record["RCP Mean"]) + float(record["RCP Stdev"])
    assert p.samples_range == pytest.approx((low_samples, high_samples), rel=1e-12)
    spread = math.exp(0.444)
    assert p.step_range == pytest.approx((p.step.seconds / spread, p.step.seconds * spread), rel=1e-9)

    def by_hand(samples: float, step_s: float) -> float:
        evals = math.ceil(samples / 150_000)
        return (5.0 + math.ceil(evals * 150_000 / 768) * step_s + evals * p.eval_s) / 60

    ttt, low, high = p.ttt
    assert ttt == pytest.approx(by_hand(p.samples, p.step.seconds), rel=1e-9)
    assert low == pytest.approx(by_hand(low_samples, p.step.seconds / spread), rel=1e-9)
    assert high == pytest.approx(by_hand(high_samples, p.step.seconds * spread), rel=1e-9)


def test_world_size_and_ranks_per_node_are_the_configs(predictions: dict[str, plan.Prediction]) -> None:
    assert {name: (p.gpus, p.per_node) for name, p in predictions.items()} == HAND_WORLD
    assert {name: p.throughput for name, p in predictions.items()} == pytest.approx(
        {name: HAND_GBS[name] / p.step.seconds for name, p in predictions.items()}, rel=1e-12)


def test_two_nodes_without_the_sharded_optimizer_cross_infiniband_by_hand(traced: dict[str, dict[str, Any]]) -> None:
    """The H200 recipe on 2 nodes of 8 (no DIST_OPTIMIZER, clip mode before_allreduce): each traced all-reduce rings
    16 ranks over the node's 8 NICs (8 x 50 GB/s, under NVLink's 450), 20 us + 2 x 15/16 x bytes / (400 GB/s x 0.8),
    all of it exposed after the backward."""
    name = "config_DGXH200_1x8.sh"
    env = plan.config_env(REPO / name, 16, "H200")
    p = plan.predict(name, env, step_model.DEVICES["H200"], traced[name])
    assert (p.gpus, p.per_node, p.gbs, p.overlap) == (16, 8, 1536, step_model.Exchange(False, False, 0))
    assert p.step.link == step_model.Link(16, 400e9, "InfiniBand")
    work = StepWork.from_dict(traced[name]["work"])
    assert {op for op, _ in work.step.collectives} == {"allreduce_"}
    comm = sum(n * (20e-6 + 2 * 15 / 16 * size / (400e9 * 0.8)) for (_, size), n in work.step.collectives.items())
    assert p.step.comm_s == pytest.approx(comm, rel=1e-9) and p.step.exposed_comm_s == pytest.approx(comm, rel=1e-9)
    assert p.step.seconds == pytest.approx(p.step.compute_s + comm, rel=1e-9)


@pytest.mark.parametrize("gpus, link", [(72, step_model.Link(72, 900e9, "NVLink")),
                                        (76, step_model.Link(76, 200e9, "InfiniBand"))])
def test_gb200_trays_share_nvlink_up_to_the_racks_72(traced: dict[str, dict[str, Any]], gpus: int,
                                                       link: step_model.Link) -> None:
    """72 GB200s (18 trays of 4) are one NVLink domain; 76 (19 trays) ring over InfiniBand, 4 NICs a tray:
    4 x 50 GB/s."""
    name = "config_GB200_2x4.sh"
    p = plan.predict(name, plan.config_env(REPO / name, gpus, "GB200"), step_model.DEVICES["GB200"], traced[name])
    assert (p.gpus, p.per_node, p.gbs, p.step.link) == (gpus, 4, 96 * gpus, link)


def test_a_measured_setup_naming_a_config_that_is_not_there_is_refused() -> None:
    """The measurement's link to its config, present but wrong: one line naming it and the fix."""
    with pytest.raises(plan.PlanError, match=r"tools/measurements: no config_DGXH200_1x9\.sh in the repository"):
        plan.setup_env(step_calibration.SetUp("H200", "config_DGXH200_1x9.sh", ()))


def test_the_recipes_device_memory_is_the_planners() -> None:
    """The recipe's device memory (GB) and the planner's datasheet bytes name the same devices the same."""
    shared = set(recipe.DEVICE_MEMORY_GB) & set(step_model.DEVICES)
    assert shared == {"A100", "H100", "H200", "B200", "GB200"}
    assert {name: recipe.DEVICE_MEMORY_GB[name] * 1e9 for name in shared} == {
        name: step_model.DEVICES[name].memory_bytes for name in shared}


def test_our_eval_time_follows_the_evals_own_capture(traced: dict[str, dict[str, Any]]) -> None:
    """The eval is graphed or not by --eval_cuda_graph, apart from the training step: flipping the step's
    capture leaves the eval's time alone, and an eager eval of the same work pays its launches."""
    work = StepWork.from_dict(traced["config_DGXH200_1x8.sh"]["work"])
    fused = plan.inductor_bytes(traced["config_DGXH200_1x8.sh"])
    h200 = step_model.DEVICES["H200"]
    assert work.captured and work.eval_captured  # the shipped H200 config graphs both
    graphed = step_model.our_eval_seconds(work, h200, 8, inductor_bytes=fused)
    assert step_model.our_eval_seconds(replace(work, captured=False), h200, 8, inductor_bytes=fused) == graphed
    eager = step_model.our_eval_seconds(replace(work, eval_captured=False), h200, 8, inductor_bytes=fused)
    assert eager > graphed
    assert step_model.our_eval_seconds(replace(work, captured=False, eval_captured=False), h200, 8,
                                       inductor_bytes=fused) == eager
