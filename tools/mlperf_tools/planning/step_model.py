"""A model of one device's memory fit, step time and eval time, from a traced dry run's work.

Inputs: the traced step's ops (each with its FLOPs and the bytes it reads and writes) and
collectives (kind, bytes), from `mlperf_bert.dryrun.estimate.StepWork`, and a device below.

Two models of a step's compute share the communication model below:
- Our step (`our_step_time`, constants `OURS`): the step of this repository's code, calibrated on
  measurements of that step (tools/measurements, fitted by tools/mlperf_tools/planning/step_calibration.py). Each kind
  of work has its own measured rate: matrix products at `gemm_efficiency` of the device's peak for
  their dtype; attention at `attention_efficiency` of the bf16 peak over its traced FLOPs (a
  kernel over masked rows computes its whole grid), per-sequence (varlen) attention at
  `varlen_efficiency` over the grid it bounds (`cost.varlen_grid_flops`); element-wise work by
  how it runs: inside the compiled regions (the encoder layers, the MLM transform) as Inductor's
  generated kernels, the bytes Inductor counts for them (`mlperf_bert.dryrun.compiled`, FP8 casts
  included) at `inductor_bandwidth` of HBM; every element-wise op outside them (embeddings, loss,
  clipping; all of them in an eager step) at its traced bytes (reads and writes as eager PyTorch
  runs it) at `eager_bandwidth`; the optimizer's ops (`is_optimizer_op`) at `optimizer_bandwidth`; a
  launch gap per kernel. On other devices than the measured one (`REFERENCE_DEVICE`) every term
  scales by the datasheet ratios.
- NVIDIA's code on this system (`step_time`, constants `CALIBRATION`): a roofline per traced op,
  calibrated on NVIDIA's published per-GPU rates, that is, on NVIDIA's kernels; kept as the
  separate line it is, not as the time this code takes (its 88.0 ms for the H200 FP8 step
  measured 158 ms, docs/PERFORMANCE.md).

NVIDIA's code on this system, on the config's step traced in NVIDIA's precision (FP8 where the
device has FP8 tensor cores, as NVIDIA's Hopper and Blackwell runs train; `plan.nvidia_env`).
Compute: each matrix product takes max(FLOPs / (peak x matmul efficiency), bytes / (HBM bandwidth x
memory efficiency)), the roofline of that op; FP8 ones run at the FP8 peak. Every other op is
bandwidth-bound: its traced bytes x `fused_traffic_share` / (HBM bandwidth x memory efficiency).
The share is what separates this trainer's eager ops (1.0: each cast, scale, bias, dropout and
residual add reads and writes its tensors) from the fused kernels of the published runs (casts inside
the GEMMs, bias+GELU, dropout+residual+LayerNorm), which the calibration measures. Each kernel
adds a launch gap (small inside a CUDA graph). An eager step is also bounded by the host issuing its
kernels one by one (`host_us_per_op`): it takes the longer of the two.

Compiled layers (--compile_mode other than none): the dry run traces them op by op ("aot_eager"),
but a GPU runs Inductor's kernels, which fuse the element-wise ops between two matrix products
into one: the model launches (and the host issues) at most one element-wise kernel per matrix
product (`launched_kernels`). Compile leaves the matrix products (cuBLAS / attention kernels), the
collectives and their overlap, and the bytes model (`fused_traffic_share` already stands for fused
element-wise kernels) as they are. A graphed eval (--eval_cuda_graph) is a replay per batch: no
host launches, the graph's launch gaps.

Communication: each collective takes latency + factor x bytes / (link bandwidth x network
efficiency), with NCCL's ring factors (all-reduce 2(n-1)/n, reduce-scatter and all-gather
(n-1)/n). The link is NVLink when all ranks share one NVLink domain (a DGX's 8 GPUs, a GB200
NVL72 rack's 72), else the InfiniBand NIC of each GPU, which the inter-node ring crosses.
Overlap as the trainer has it (optim/clipping.py's table, `all_reduce_overlaps_backward`): in
--clip_mode none, after_allreduce and bucketwise DDP's all-reduce, or the sharded optimizer's
block-wise reduce-scatter and its shard's all-reduce across groups, overlap the backward pass (2/3
of the step's compute); before_allreduce holds every bucket until the backward ends: exposed. The
sharded optimizer's all-gathers run block by block during its update (optim/sharded.py, step 6,
in every mode): hidden up to the update's time (its ops, `is_optimizer_op`).
Shard groups (--dist_optimizer_group_size g < ranks): the reduce-scatter and all-gather stay
within a group (the node's NVLink for g = 8), the all-reduce runs across the ranks/g groups, each
rank's on its own NIC (InfiniBand); without groups every collective spans all ranks.

Left out: the input pipeline (assumed hidden behind the step), stragglers and load imbalance
between ranks, clocks below the rated peak under power limits, and the differences between
this trainer's kernels and the vendor's (the calibration folds them into two efficiencies).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Mapping

from mlperf_bert.dryrun.cost import FP8, MATMUL, OTHER, PhaseCost
from mlperf_bert.model.varlen_flash import VARLEN_OPS
from mlperf_bert.dryrun.estimate import MemoryEstimate, StepWork
from mlperf_bert.optim.fused import OP_PREFIX as FUSED_OPTIMIZER_OPS

GB = 1e9


@dataclass(frozen=True)
class Device:
    """One accelerator's rated numbers (dense, no sparsity) and its links."""

    name: str
    bf16_flops: float  # FLOP/s, dense bf16 tensor-core peak
    fp8_flops: float | None  # FLOP/s, dense FP8 peak; None: no FP8 tensor cores
    hbm_bytes_per_s: float
    memory_bytes: float  # as rated (GB = 1e9 bytes)
    nvlink_bytes_per_s: float  # per GPU, one direction
    nvlink_domain: int  # GPUs one NVLink fabric connects
    network_bytes_per_s: float  # per GPU, one direction (its InfiniBand NIC)
    source: str


# Datasheet numbers. A100: NVIDIA A100 datasheet (SXM4 80GB: 312 TF bf16, 2,039 GB/s, NVLink3
# 600 GB/s both directions) and DGX A100 (8x HDR 200 Gb/s). H100/H200: H100 and H200 datasheets
# (SXM: 989 TF bf16, 1,979 TF FP8; 3.35 and 4.8 TB/s; NVLink4 900 GB/s both directions), DGX H100
# (8x NDR 400 Gb/s). B200: DGX B200 datasheet (72 PF FP8 / 36 PF FP16 dense... per 8 GPUs with
# sparsity halved: 4.5 PF FP8, 2.25 PF bf16 dense per GPU; 8 TB/s; NVLink5 1.8 TB/s both ways;
# 8x 400 Gb/s). GB200: GB200 NVL72 datasheet (per GPU 5 PF FP8 and 2.5 PF bf16 dense, 8 TB/s,
# 186 GB HBM3e; 72 GPUs in one NVLink5 domain).
DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("A100", 312e12, None, 2.039e12, 80 * GB, 300 * GB, 8, 25 * GB, "A100 SXM4 80GB / DGX A100 datasheets"),
    Device("H100", 989e12, 1979e12, 3.35e12, 80 * GB, 450 * GB, 8, 50 * GB, "H100 SXM / DGX H100 datasheets"),
    Device("H200", 989e12, 1979e12, 4.8e12, 141 * GB, 450 * GB, 8, 50 * GB, "H200 SXM datasheet"),
    Device("B200", 2250e12, 4500e12, 8.0e12, 180 * GB, 900 * GB, 8, 50 * GB, "DGX B200 datasheet"),
    Device("GB200", 2500e12, 5000e12, 8.0e12, 186 * GB, 900 * GB, 72, 50 * GB, "GB200 NVL72 datasheet"),
)}


@dataclass(frozen=True)
class Constant:
    value: float
    origin: str
    measured: bool = False  # taken from a measurement of this repository's step (OURS)


# Every number the models do not read off a datasheet or a trace, but our step's measured rates (OURS below):
# NVIDIA's code's two fitted efficiencies, and the priors both models share (launches, collectives, memory, run).
CALIBRATION: dict[str, Constant] = {
    "matmul_efficiency": Constant(0.82, "fitted by `tools/plan.py --calibrate` to the published rates (plan.published), "
                                        "on each config's step traced in NVIDIA's precision (plan.nvidia_env)"),
    "fused_traffic_share": Constant(0.30, "fitted by `tools/plan.py --calibrate`: the share of the traced element-wise "
                                          "bytes a fused implementation still moves (1.0: this trainer, eager); the "
                                          "same for compiled layers, whose trace is op by op (compile changes the "
                                          "kernel count, `launched_kernels`, not this share nor the matmuls)"),
    "memory_efficiency": Constant(0.80, "achievable share of HBM bandwidth in streaming kernels (about 80-90 % in "
                                        "copy benchmarks on A100/H100)"),
    "kernel_gap_us": Constant(2.0, "per kernel on the GPU outside a graph (launch latency, about 2-4 us; CUDA "
                                   "graph notes)"),
    "graph_kernel_gap_us": Constant(0.5, "per kernel inside a CUDA graph replay (graph launch removes the host)"),
    "host_us_per_op": Constant(10.0, "eager PyTorch: Python dispatch and launch per kernel (about 5-20 us); "
                                     "compile changes how many kernels (`launched_kernels`), not this cost"),
    "collective_latency_us": Constant(20.0, "one NCCL collective's start-up on 8-1,024 GPUs (nccl-tests, small sizes)"),
    "network_efficiency": Constant(0.80, "NCCL bus bandwidth over the link's rate (nccl-tests all_reduce_perf)"),
    "eval_fixed_s": Constant(0.5, "per eval: the accuracy all-reduce, its host read and the MLPerf log lines"),
    "run_fixed_s": Constant(5.0, "after run_start, outside steps and evals: first batches, the eval set's read"),
    "step_time_spread": Constant(0.278, "`tools/plan.py --calibrate`: the largest |log(predicted / published)| "
                                        "left by the fit of NVIDIA's code to the published rates"),
    "init_fixed_s": Constant(30.0, "before run_start, besides graph warm-up and capture: processes, model and "
                                   "optimizer on the device (NVIDIA v2.0 A100 logs: init_start to run_start 17 s)"),
    "memory_margin": Constant(0.10, "the caching allocator's rounding and fragmentation, over the traced bytes"),
    "memory_reserved_gib": Constant(3.0, "CUDA context, cuBLAS/attention workspaces and NCCL buffers per GPU"),
}


def constant(name: str, overrides: Mapping[str, float] | None = None) -> float:
    return (overrides or {}).get(name, CALIBRATION[name].value)


# ---------------------------------------------------------------------------------------------
# Memory


@dataclass(frozen=True)
class Fit:
    needed_bytes: float  # the traced peak with the margins
    device: Device

    @property
    def headroom_bytes(self) -> float:
        return self.device.memory_bytes - self.needed_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0


def memory_fit(memory: MemoryEstimate, device: Device) -> Fit:
    """The traced peak plus the allocator's margin and the reserved bytes, against the rated memory."""
    needed = memory.peak * (1 + constant("memory_margin")) + constant("memory_reserved_gib") * (1 << 30)
    return Fit(needed, device)


# ---------------------------------------------------------------------------------------------
# Time


@dataclass(frozen=True)
class Link:
    ranks: int
    bytes_per_s: float
    name: str


def link_of(device: Device, ranks: int, per_node: int = 8) -> Link:
    """The bandwidth one rank's ring traffic gets. Across nodes NCCL runs one ring per NIC, each crossing
    between nodes once, so a node's `per_node` NICs together carry every rank's share (up to NVLink's rate)."""
    if ranks <= device.nvlink_domain:
        return Link(ranks, device.nvlink_bytes_per_s, "NVLink")
    return Link(ranks, min(device.nvlink_bytes_per_s, per_node * device.network_bytes_per_s), "InfiniBand")


def launched_kernels(phase: PhaseCost, compiled: bool) -> int:
    """Kernels the GPU runs for the phase: one per traced op, or compiled, one per matrix product and at most one
    fused element-wise kernel per matrix product (Inductor fuses the element-wise ops between two products)."""
    products = sum(n for op, n in phase.ops.items() if op.kind in (MATMUL, FP8))
    others = phase.kernels - products
    return products + (min(others, products) if compiled else others)


def is_attention(op_name: str) -> bool:
    """Whether a traced op is attention (SDPA's kernels, the package's varlen ops), not a GEMM."""
    return "attention" in op_name or op_name in VARLEN_OPS


def compute_seconds(phase: PhaseCost, device: Device, captured: bool, k: Mapping[str, float] | None = None,
                    compiled: bool = False) -> float:
    """The GPU's time for the phase's ops (roofline per op, plus a launch gap per launched kernel)."""
    mm, mem = constant("matmul_efficiency", k), constant("memory_efficiency", k)
    fused = constant("fused_traffic_share", k)
    gap = constant("graph_kernel_gap_us" if captured else "kernel_gap_us", k) * 1e-6
    total = launched_kernels(phase, compiled) * gap
    for op, count in phase.ops.items():
        if op.kind in (MATMUL, FP8):
            peak = device.fp8_flops if op.kind == FP8 and device.fp8_flops else device.bf16_flops
            seconds = max(op.flops / (peak * mm), op.bytes / (device.hbm_bytes_per_s * mem))
        else:
            seconds = fused * op.bytes / (device.hbm_bytes_per_s * mem)
        total += count * seconds
    return total


def host_seconds(phase: PhaseCost, captured: bool, k: Mapping[str, float] | None = None,
                 compiled: bool = False) -> float:
    """The host's time to issue the phase's kernels one by one (0 for a graph replay)."""
    return 0.0 if captured else launched_kernels(phase, compiled) * constant("host_us_per_op", k) * 1e-6


RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
               "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


def collective_kind(op_name: str) -> str:
    """c10d's op name (allreduce_, _reduce_scatter_base_, _allgather_base_, ...) as a RING_FACTOR key."""
    name = op_name.replace("_", "")
    for kind in ("reducescatter", "allgather", "broadcast"):
        if kind in name:
            return {"reducescatter": "reduce_scatter", "allgather": "all_gather"}.get(kind, kind)
    return "all_reduce"


def collective_seconds(kind: str, size: int, link: Link, k: Mapping[str, float] | None = None) -> float:
    """One collective of `size` bytes per rank over `link`'s ring."""
    if link.ranks <= 1:
        return 0.0
    latency, eff = constant("collective_latency_us", k) * 1e-6, constant("network_efficiency", k)
    return latency + RING_FACTOR[kind](link.ranks) * size / (link.bytes_per_s * eff)


def comm_seconds(phase: PhaseCost, link: Link, k: Mapping[str, float] | None = None) -> float:
    return sum(n * collective_seconds(collective_kind(op), size, link, k) for (op, size), n in phase.collectives.items())


@dataclass(frozen=True)
class Exchange:
    """How the step's gradient exchange runs (the module docstring's overlap rules)."""

    overlaps_backward: bool  # the clip mode hands buckets over during the backward
    sharded: bool = False  # the sharded optimizer: reduce-scatter, (all-reduce across groups,) all-gather
    shard_group: int = 0  # ranks sharing one copy of its state (0: all)


def links(device: Device, ranks: int, per_node: int, exchange: Exchange) -> dict[str, Link]:
    """The link each collective kind crosses: shard groups keep reduce-scatter and all-gather inside a group and
    all-reduce the shard across groups, one NIC per rank."""
    whole = link_of(device, ranks, per_node)
    group = exchange.shard_group
    if not group or group >= ranks:
        return {kind: whole for kind in RING_FACTOR}
    inside = link_of(device, group, per_node)
    across = Link(ranks // group, device.nvlink_bytes_per_s, "NVLink") if ranks <= device.nvlink_domain else \
        Link(ranks // group, device.network_bytes_per_s, "InfiniBand")
    return {"all_reduce": across, "broadcast": whole, "reduce_scatter": inside, "all_gather": inside}


BACKWARD_SHARE = 2 / 3  # the backward pass's share of a step's compute (two products per forward one)


@dataclass(frozen=True)
class Term:
    """One kind of work's time in a step (our step's model)."""

    name: str
    seconds: float
    estimate: str = ""  # why its constant is not a measurement of this code ("" when it is)


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    host_s: float
    comm_s: float
    exposed_comm_s: float
    link: Link  # the link of the largest share of the traffic
    terms: tuple[Term, ...] = ()  # the compute by kind of work (our step's model; empty for NVIDIA's)

    @property
    def seconds(self) -> float:
        return max(self.compute_s + self.exposed_comm_s, self.host_s)

    @property
    def bound(self) -> str:
        if self.host_s > self.compute_s + self.exposed_comm_s:
            return "host-bound (eager op launches)"
        return "communication-bound" if self.exposed_comm_s > self.compute_s else "compute-bound"


def is_optimizer_op(name: str) -> bool:
    """The optimizer update's ops: its multi-tensor arithmetic (`_foreach_*`) and its fused passes
    (`optim/fused.py`, whose traced bytes are their operands': the moments and weights they write
    back in place are not counted, as for an in-place `_foreach_` op)."""
    return name.startswith(("_foreach", FUSED_OPTIMIZER_OPS))


def update_phase(phase: PhaseCost) -> PhaseCost:
    """The optimizer update's ops (`is_optimizer_op`)."""
    return PhaseCost(ops=Counter({op: n for op, n in phase.ops.items() if is_optimizer_op(op.name)}))


def step_time(work: StepWork, device: Device, ranks: int, exchange: Exchange | bool,
              k: Mapping[str, float] | None = None, per_node: int = 8) -> StepTime:
    """One training step of NVIDIA's code on this system (the roofline calibrated on NVIDIA's published rates).
    exchange: how the gradient exchange runs (a bool: an unsharded one that overlaps the backward pass or not);
    see the module docstring."""
    compute = compute_seconds(work.step, device, work.captured, k, work.compiled)
    update = compute_seconds(update_phase(work.step), device, work.captured, k)
    host = host_seconds(work.step, work.captured, k, work.compiled)
    return exchanged(work, compute, host, update, device, ranks, exchange, k, per_node)


def exchanged(work: StepWork, compute: float, host: float, update: float, device: Device, ranks: int,
              exchange: Exchange | bool, k: Mapping[str, float] | None = None, per_node: int = 8,
              terms: tuple[Term, ...] = ()) -> StepTime:
    """A step of `compute` seconds (`update` of them the optimizer's update) with its gradient exchange, the
    collectives overlapped as the module docstring says."""
    if isinstance(exchange, bool):
        exchange = Exchange(exchange)
    by_kind = links(device, ranks, per_node, exchange)
    during_backward = after_backward = during_update = 0.0
    traffic: Counter[str] = Counter()
    for (op, size), n in work.step.collectives.items():
        kind = collective_kind(op)
        seconds = n * collective_seconds(kind, size, by_kind[kind], k)
        traffic[by_kind[kind].name] += n * size
        if exchange.sharded and kind == "all_gather":
            during_update += seconds  # issued block by block while the update runs (sharded.py, step 6)
        elif exchange.overlaps_backward and kind in ("all_reduce", "reduce_scatter"):
            during_backward += seconds
        else:
            after_backward += seconds
    exposed = max(during_backward - BACKWARD_SHARE * compute, 0.0) + after_backward + \
        max(during_update - update, 0.0)
    busiest = max(traffic, key=lambda name: traffic[name], default="")
    link = next((link for link in by_kind.values() if link.name == busiest), by_kind["all_reduce"])
    return StepTime(compute, host, during_backward + after_backward + during_update, exposed, link, terms)


def _eval(compute: float, host: float, work: StepWork, device: Device, ranks: int, k: Mapping[str, float] | None,
          per_node: int) -> float:
    """One eval of this rank's share from one replay's (or pass's) compute and host time: the passes, then the
    accuracy's all-reduce."""
    return max(compute, host) * work.eval_scale + comm_seconds(work.eval, link_of(device, ranks, per_node), k) \
        + constant("eval_fixed_s", k)


def eval_seconds(work: StepWork, device: Device, ranks: int, k: Mapping[str, float] | None = None,
                 per_node: int = 8) -> float:
    """One eval of NVIDIA's code on this system: forward passes (eager, or graph replays), then the accuracy's
    all-reduce."""
    compute = compute_seconds(work.eval, device, work.eval_captured, k, work.compiled)
    host = host_seconds(work.eval, work.eval_captured, k, work.compiled)
    return _eval(compute, host, work, device, ranks, k, per_node)


# ---------------------------------------------------------------------------------------------
# Our step: each kind of work at the rate measured for this repository's code (module docstring)

REFERENCE_DEVICE = "H200"  # the device of the measurements; on others each term scales by the datasheet ratios

# Fitted by `tools/plan.py --calibrate` (tools/mlperf_tools/planning/step_calibration.py) to tools/measurements: the profile gives the
# first three, the step times of the measured set-ups the two bandwidths, by least squares with a pull towards
# the prior that leaves a constant no measurement reaches at its prior (varlen_efficiency, for now).
OURS: dict[str, Constant] = {
    "gemm_efficiency": Constant(0.6808, "profile of the H200 FP8 step (2026-11-27): its GEMM kernels (nvjet) over "
                                       "the traced matrix products at their dtype's peak; bf16 products are taken at "
                                       "the same share of the bf16 peak (no bf16 step was profiled)", True),
    "attention_efficiency": Constant(0.1566, "the same profile: the cuDNN flash forward, backward and dO.O kernels "
                                             "(one call per packed row under a block-diagonal mask) over the traced "
                                             "attention FLOPs, at the bf16 peak", True),
    "optimizer_bandwidth": Constant(0.3059, "the same profile: the multi-tensor kernels' 6.41 ms over the traced bytes "
                                            "of the optimizer's ops as today's code runs them (the fused passes, "
                                            "9.4 GB; 33.6 GB of `_foreach_` ops then), as a share of HBM bandwidth: "
                                            "the step keeps the measured optimizer time until a GPU times the fused "
                                            "passes", True),
    "inductor_bandwidth": Constant(0.4545, "fitted: the compiled steps (bf16 and FP8 tensorwise, CUDA graph): the "
                                            "bytes Inductor counts for the compiled regions' kernels (the set-ups' "
                                            "code as measured, generated for the H200 on the fake device: the "
                                            "index's inductor_as_measured) per second over HBM bandwidth", True),
    "eager_bandwidth": Constant(0.4612, "fitted: the FP8 step with COMPILE_MODE=none (CUDA graph): element-wise "
                                        "bytes per second over HBM bandwidth; a compiled step's ops outside its "
                                        "compiled regions run at it", True),
    "varlen_score_share": Constant(0.7545, "E[L^2] / (512 E[L]) over the Wikipedia phase-2 length histogram: the "
                                           "share of the grid (every token against 512 keys) that per-sequence "
                                           "attention computes; 1.33x less score work than masked rows"),
    "varlen_efficiency": Constant(0.2076, "not measured (no varlen step timed yet): attention_efficiency / "
                                          "varlen_score_share, the masked rows' measured rate over the score work "
                                          "per-sequence kernels skip; PyTorch's flash kernel, not cuDNN's"),
    "step_time_spread": Constant(0.444, "the largest leave-one-out |log(predicted / measured)| of the fit (a "
                                        "set-up predicted from the others): the step time's range is this factor "
                                        "each way", True),
}

# The constants fitted to step times, and each one's prior: a streaming kernel's share of HBM (`memory_efficiency`) for
# Inductor's kernels, whose bytes are what they move, and for eager ops; the varlen estimate.
FITTED = ("inductor_bandwidth", "eager_bandwidth", "varlen_efficiency")
# Fitted on eager steps alone: a compiled step runs few element-wise ops outside its compiled regions (a sixteenth
# of its time on the H200), too few to fix their rate against its compiled kernels'; it takes the eager steps'.
EAGER_STEPS_ONLY = ("eager_bandwidth",)


def priors(c: Mapping[str, float]) -> dict[str, float]:
    """Each fitted constant's value before any measurement reaches it, from the constants `c`."""
    memory = constant("memory_efficiency")
    return {"inductor_bandwidth": memory, "eager_bandwidth": memory,
            "varlen_efficiency": c["attention_efficiency"] / c["varlen_score_share"]}


def ours(overrides: Mapping[str, float] | None = None) -> dict[str, float]:
    return {name: c.value for name, c in OURS.items()} | dict(overrides or {})


@dataclass(frozen=True)
class StepFeatures:
    """A phase's work as our step's model times it (from the dry run's trace and Inductor's count)."""

    gemm_flops: float = 0.0  # matrix products in bf16 / fp16 (the bf16 peak)
    fp8_flops: float = 0.0  # FP8 matrix products (the FP8 peak)
    attention_flops: float = 0.0  # attention kernels that compute their whole grid (masked rows, padding)
    varlen_flops: float = 0.0  # per-sequence attention kernels: the grid that bounds them
    elementwise_bytes: float = 0.0  # traced: every other op outside the compiled regions but the optimizer's
    compiled_bytes: float = 0.0  # traced: the element-wise ops inside the compiled regions, as eager would run them
    inductor_bytes: float = 0.0  # what Inductor's generated kernels for the compiled regions move (its count)
    optimizer_bytes: float = 0.0  # the optimizer's multi-tensor ops (`_foreach_*`) and fused passes
    kernels: int = 0  # launched (`launched_kernels`)


def features(phase: PhaseCost, compiled: bool, inductor_bytes: float | None = None) -> StepFeatures:
    """The phase's work by kind. inductor_bytes: the bytes Inductor counts for the phase's compiled regions
    (`mlperf_bert.dryrun.compiled`'s `elementwise_bytes`), which replace their traced element-wise bytes; a phase
    with compiled element-wise ops needs it."""
    work: defaultdict[str, float] = defaultdict(float)
    for op, n in phase.ops.items():
        if op.name in VARLEN_OPS:
            work["varlen_flops"] += n * op.flops
        elif is_attention(op.name) and op.kind != OTHER:
            work["attention_flops"] += n * op.flops
        elif op.kind in (MATMUL, FP8):
            work["fp8_flops" if op.kind == FP8 else "gemm_flops"] += n * op.flops
        elif is_optimizer_op(op.name):
            work["optimizer_bytes"] += n * op.bytes
        else:
            work["compiled_bytes" if op.compiled else "elementwise_bytes"] += n * op.bytes
    if work["compiled_bytes"] and inductor_bytes is None:
        raise ValueError("compiled element-wise ops without Inductor's count of their kernels: give the bytes "
                         "`python -m mlperf_bert.dryrun.compiled` counts for this step")
    return StepFeatures(**work, inductor_bytes=inductor_bytes or 0.0, kernels=launched_kernels(phase, compiled))


def our_terms(f: StepFeatures, device: Device, captured: bool, c: Mapping[str, float] | None = None
              ) -> tuple[Term, ...]:
    """The phase's compute by kind of work, each at its measured rate (`OURS`, or `c`'s values)."""
    k = ours(c)
    bf16, hbm = device.bf16_flops, device.hbm_bytes_per_s
    fp8 = device.fp8_flops or bf16
    gap = constant("graph_kernel_gap_us" if captured else "kernel_gap_us") * 1e-6
    varlen = "" if OURS["varlen_efficiency"].measured else (
        f"no varlen step timed yet: the masked rows' measured rate over the {k['varlen_score_share']:.4g} of their "
        "score work a per-sequence kernel computes (PyTorch's flash kernel, not cuDNN's)")
    terms = (
        Term("GEMMs", (f.gemm_flops / bf16 + f.fp8_flops / fp8) / k["gemm_efficiency"]),
        Term("attention", f.attention_flops / (bf16 * k["attention_efficiency"])),
        Term("attention per sequence", f.varlen_flops / (bf16 * k["varlen_efficiency"]), varlen),
        Term("compiled element-wise", f.inductor_bytes / (k["inductor_bandwidth"] * hbm)),
        Term("element-wise", f.elementwise_bytes / (k["eager_bandwidth"] * hbm)),
        Term("optimizer", f.optimizer_bytes / (k["optimizer_bandwidth"] * hbm)),
        Term("launches", f.kernels * gap),  # a prior; the fitted bandwidths take up what it misses
    )
    return tuple(t for t in terms if t.seconds > 0)


def our_step_time(work: StepWork, device: Device, ranks: int, exchange: Exchange | bool, per_node: int = 8,
                  inductor_bytes: float | None = None, c: Mapping[str, float] | None = None) -> StepTime:
    """One training step of this repository's code (module docstring); `inductor_bytes`: what Inductor's kernels
    for the step's compiled regions move (`features`)."""
    terms = our_terms(features(work.step, work.compiled, inductor_bytes), device, work.captured, c)
    update = our_terms(features(update_phase(work.step), False), device, work.captured, c)
    host = host_seconds(work.step, work.captured, None, work.compiled)
    return exchanged(work, sum(t.seconds for t in terms), host, sum(t.seconds for t in update), device, ranks,
                     exchange, None, per_node, terms)


def eval_inductor_bytes(work: StepWork, inductor_bytes: float | None) -> float | None:
    """Inductor's bytes for the eval's compiled regions from the training step's count (Inductor's count is of the
    training step; the eval runs the same layers' forward): the eval's traced bytes inside them, fused as much as
    the step's are."""
    if inductor_bytes is None:
        return None
    step = features(work.step, work.compiled, inductor_bytes).compiled_bytes
    evaluation = features(work.eval, work.compiled, inductor_bytes).compiled_bytes
    return inductor_bytes * evaluation / step if step else 0.0


def our_eval_seconds(work: StepWork, device: Device, ranks: int, per_node: int = 8,
                     inductor_bytes: float | None = None) -> float:
    """One eval of this repository's code: forward passes (eager, or graph replays), then the accuracy's
    all-reduce; `inductor_bytes`: the training step's, as `our_step_time` takes them."""
    f = features(work.eval, work.compiled, eval_inductor_bytes(work, inductor_bytes))
    compute = sum(t.seconds for t in our_terms(f, device, work.eval_captured))
    return _eval(compute, host_seconds(work.eval, work.eval_captured, None, work.compiled), work, device, ranks,
                 None, per_node)
