"""The dry run: the trainer's own build, steps and eval on 'cuda', fake or real.

On a machine without a GPU (`fake=True`) every CUDA tensor is a FakeTensor: shapes, dtypes and
devices are checked op by op and no arithmetic runs. On a GPU (`fake=False`, `make gpu-check`)
the same calls run for real. Either way the `Recorder` lists the host reads per step with their
source lines, and the report's `failures` name every host read or host<->device copy inside a
CUDA-graph capture, more host reads per sync window than the config promises (one: the
window's agreement, `--sync_every` steps apart), and a `--precision fp8` run whose layers never
reached an FP8 GEMM (`torch._scaled_mm`; the fake device reports compute capability 9.0). Any exception propagates.

What is the trainer's own: config parsing and validation (`cli.parse_config`), the whole
build (`build.build_run`: model, optimizer, schedule, scaler, clipping hooks, the `Step`, the
guard or sync window, device input, hooks), each step (`trainer.train_step`: the step, the
guard's verdict, the hooks) and the eval (`trainer.run_eval`). What the dry run supplies
(`build.Supplied`): synthetic batches of the configured layout and sizes for training and
eval, the static packed shape from the flags (no shards are read), and on more than one rank
`BucketedDataParallel` in place of DDP over torch's fake process group.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterator
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist

from .. import trainer
from ..data.batch import Item, Sample, flatten_items
from ..build import Run, Supplied, build_run, cpu_model
from ..model.compiling import CompileBackend
from ..config.cli import parse_config
from ..config.settings import ConfigError, TrainConfig
from ..model.fp8 import fp8_unavailable
from ..runtime.distributed import DistEnv, dist_env_from
from ..train import cuda_graphs
from ..train.faults import StopRequest
from ..input.sources import TokenImbalance
from ..data.static_batch import StaticShape
from . import cuda_standins
from .bucketed import BucketedDataParallel
from .cost import CostTracer, regions_marked
from .estimate import MemoryEstimate, StepWork, estimate
from .gpus import DRY_RUN_GPU, Gpu
from .record import Event, Recorder, counting_fp8_gemms

MAX_SEQS_PER_PACK = 3  # K of the packed shards (data_prep pack)
# Warm-up steps before a capture on the fake device. The GPU takes 11 under DDP for the work DDP's C++
# reducer does in its first iterations (train/cuda_graphs.py); the fake run's DDP is
# `BucketedDataParallel`, which has no reducer, and every other warm-up step is the same as the first:
# one builds the optimizer state the capture reads. `--real` keeps the trainer's counts.
FAKE_WARMUP_STEPS = 1


@dataclass
class DryRunReport:
    cfg: TrainConfig
    world_size: int
    events: list[Event]
    steps: int
    sync_every: int
    attention: str = ""  # the resolved attention back-end
    captures: int = 0
    replays: int = 0
    fp8_gemms: dict[str, int] = field(default_factory=dict)  # phase (and record.CAPTURE) -> torch._scaled_mm calls
    optimizer_class: str = ""  # the optimizer the step ran (sharded or not, capturable or not)
    phase_replays: dict[str, int] = field(default_factory=dict)  # phase -> CUDA-graph replays in it
    streams: int = 0  # side streams made, events recorded, stream waits on events (cuda_standins.CudaLog)
    event_records: int = 0
    stream_waits: int = 0
    failures: list[str] = field(default_factory=list)
    peak_step_bytes: int | None = None  # real GPU only: the allocator's peak over the build and the steps
    memory: MemoryEstimate | None = None  # one device's peaks (estimate.py)
    compiled_graphs: int = 0  # graphs Dynamo compiled (--compile_mode other than none: at least the layers')
    work: StepWork | None = None  # one step's and one eval's ops and collectives


class SyntheticSource:
    """A BatchSource of random sequences of the configured layout, lengths and masks."""

    def __init__(self, cfg: TrainConfig, vocab_size: int, seed: int = 0) -> None:
        self.cfg, self.vocab = cfg, vocab_size
        self.rng = np.random.default_rng(seed)
        self.taken = 0

    def sample(self, length: int, predictions: int) -> Sample:
        ids = self.rng.integers(1, self.vocab, length)
        positions = np.sort(self.rng.choice(np.arange(1, length), size=predictions, replace=False))
        return Sample(ids, (np.arange(length) > length // 2).astype(np.int64), positions,
                      self.rng.integers(1, self.vocab, predictions), int(self.rng.integers(0, 2)))

    def item(self) -> Item:
        seq, preds = self.cfg.data.max_seq_length, self.cfg.data.max_predictions_per_seq
        if self.cfg.data.input_layout != "packed":
            length = int(self.rng.integers(seq // 4, seq + 1))
            return (self.sample(length, min(preds, length - 1)),)
        lengths = [seq // MAX_SEQS_PER_PACK] * MAX_SEQS_PER_PACK
        return tuple(self.sample(n, min(preds // MAX_SEQS_PER_PACK, n - 1)) for n in lengths)

    def next_batch(self) -> list[Item]:
        self.taken += 1
        return [self.item() for _ in range(self.cfg.micro_batch_size)]

    def next_flat_batch(self) -> Any:
        return flatten_items(self.next_batch())

    def token_imbalance(self) -> TokenImbalance:
        return TokenImbalance.empty()

    def state_dict(self) -> dict:
        return {"batches": self.taken}

    def load_state_dict(self, state: dict) -> None:
        self.taken = state["batches"]

    def close(self) -> None:
        pass


class _FakeCudaMode:
    """FakeTensorMode that never constant-folds a copy onto the (missing) real CUDA device."""

    @staticmethod
    def make() -> Any:
        from torch._subclasses.fake_tensor import FakeTensorMode

        class Mode(FakeTensorMode):
            avoid_device_init = property(lambda self: True)

        return Mode(allow_non_fake_inputs=True)


def static_shape(cfg: TrainConfig) -> StaticShape:
    """The packed step's static shape from the flags (the trainer reads K and Q from a shard)."""
    return StaticShape(cfg.micro_batch_size, cfg.data.max_seq_length, MAX_SEQS_PER_PACK,
                       cfg.data.max_predictions_per_seq)


def bucketed_ddp(model: torch.nn.Module, device: torch.device) -> BucketedDataParallel:
    """DDP's place in `build_run` on the fake process group (see `bucketed`)."""
    return BucketedDataParallel(model)


def supplied(cfg: TrainConfig, device: torch.device, fake: bool = True,
             compile_backend: CompileBackend | None = None) -> Supplied:
    """What the dry run hands `build_run` (see the module docstring); built before the fake mode starts.

    --compile_mode on the fake device traces with "aot_eager" by default (`cost.regions_marked`, which marks the
    cost tracer's ops inside the compiled graphs): Dynamo captures each compiled layer's graph and AOTAutograd
    derives its backward on fake tensors, but Inductor writes no kernel; the real device (`--real`) compiles
    with Inductor, and so does `compiled.py` on the fake one (`inductor.codegen_only`: its code generated,
    nothing launched).
    """
    model = cpu_model(cfg, device)
    vocab = model.config.vocab_size
    return Supplied(model=model, source=SyntheticSource(cfg, vocab),
                    eval_items=SyntheticSource(cfg, vocab, seed=1).next_batch(), shape=static_shape(cfg),
                    ddp=bucketed_ddp,
                    compile_backend=compile_backend or (regions_marked if fake else "inductor"))


class _DoneWork:
    """An async collective's handle whose future holds [tensor], as NCCL's and gloo's do."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.future: torch.futures.Future = torch.futures.Future()
        self.future.set_result([tensor])

    def wait(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future


def _all_reduce_with_result(original: Any) -> Any:
    """The fake backend completes all_reduce's future with None: comm hooks chain on [tensor]."""

    def all_reduce(tensor: torch.Tensor, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        work = original(tensor, *args, async_op=async_op, **kwargs)
        return _DoneWork(tensor) if async_op else work

    return all_reduce


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """torch's fake process group: collectives accepted and checked, nothing exchanged."""
    if world_size == 1:
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with mock.patch.object(dist, "all_reduce", _all_reduce_with_result(dist.all_reduce)):
            yield
    finally:
        dist.destroy_process_group()


def run_steps(run: Run, recorder: Recorder, steps: int) -> int:
    """The hooks' run start, `steps` of the trainer's steps (the last one reads the window, as a block's last
    step does), then an eval. Returns the allocator's peak bytes after the steps, before the eval (0 on
    the fake device)."""
    until = steps * run.cfg.global_batch_size
    run.hooks.run_start(trainer.run_start_event(run))
    for i in range(steps):
        recorder.phase = f"step {i + 1}"
        trainer.train_step(run, until)
    peak = int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else 0
    recorder.phase = "eval"
    trainer.run_eval(run.eval, run.state, run.hooks)
    return peak


def cost_tracer(recorder: Recorder) -> CostTracer:
    """Memory and work per phase, in the recorder's phases and captures."""
    return CostTracer(phase=lambda: recorder.phase, capturing=recorder.in_capture_now)


def cuda_calls(recorder: Recorder, fake: bool = True, gpu: Gpu = DRY_RUN_GPU) -> ContextManager[cuda_standins.CudaLog]:
    """The log of CUDA calls: the fake device's stand-ins (presenting `gpu`) record them all; on a real GPU its graphs
    are counted."""
    return cuda_standins.install(recorder, gpu) if fake else cuda_standins.count_graphs(recorder)


@contextlib.contextmanager
def fake_warmup() -> Iterator[None]:
    """FAKE_WARMUP_STEPS before each capture, whatever the module."""
    with mock.patch.object(cuda_graphs, "DDP_WARMUP_STEPS", FAKE_WARMUP_STEPS), \
            mock.patch.object(cuda_graphs, "WARMUP_STEPS", FAKE_WARMUP_STEPS):
        yield


@contextlib.contextmanager
def built_run(cfg: TrainConfig, denv: DistEnv, recorder: Recorder, fake: bool = True,
              tracer: CostTracer | None = None,
              compile_backend: CompileBackend | None = None, gpu: Gpu = DRY_RUN_GPU) -> Iterator[tuple[Run, cuda_standins.CudaLog]]:
    """The trainer's run of `cfg` on 'cuda' (fake or real), `recorder` (and `tracer`) watching, and the log of
    CUDA calls. compile_backend: the compiled layers' back-end (`supplied`); "inductor" on the fake device
    needs `inductor.codegen_only` around the run. gpu: what the fake device presents itself as."""
    device = torch.device("cuda", 0)
    mode = _FakeCudaMode.make() if fake else contextlib.nullcontext()
    warmup = fake_warmup() if fake else contextlib.nullcontext()
    with cuda_calls(recorder, fake, gpu):  # the attention back-end's choice asks the (fake) GPU its compute capability
        parts = supplied(cfg, device, fake, compile_backend)
    traced = tracer if tracer is not None else contextlib.nullcontext()
    with fake_process_group(denv.world_size), cuda_calls(recorder, fake, gpu) as log, counting_fp8_gemms(recorder), mode, \
            warmup, recorder, traced:
        run = build_run(cfg, denv, device, StopRequest(), supplied=parts)
        try:
            yield run, log
        finally:
            run.close()
            run.hooks.close()


def dry_run(trainer_argv: list[str], steps: int = 3, fake: bool = True,
            env: dict[str, str] | None = None) -> DryRunReport:
    """Builds the configured run on 'cuda', runs `steps` steps and an eval; the report lists the findings."""
    denv = dist_env_from(os.environ if env is None else env)
    cfg = parse_config(trainer_argv, denv.world_size)
    # A run of its own, as a trainer process is: nothing compiled for an earlier run in this process (the planner
    # traces every config in one) is reused, or recompiled with shapes marked dynamic because they changed.
    torch._dynamo.reset()
    compiled_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    if cfg.run.precision == "fp8" and not fake:  # the trainer's start-up check (the fake device is 9.0)
        problem = fp8_unavailable(torch.device("cuda", 0))
        if problem is not None:
            raise ConfigError(problem)
    recorder = Recorder(fake=fake)
    if not fake and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    tracer = cost_tracer(recorder)
    with built_run(cfg, denv, recorder, fake, tracer) as (run, log):
        peak = run_steps(run, recorder, steps)
        stepped = type(run.step.optimizer).__name__
        attention = run.eval.model.bert.backend
        share = math.ceil(cfg.eval.num_eval_examples / denv.world_size)  # this rank's eval sequences
        batches = run.eval.data.batches()
        memory, work = estimate(tracer, steps, list(run.eval.model.parameters()), run.step.optimizer, batches,
                                sum(batch.num_sequences for batch in batches), share, cfg.run.cuda_graphs,
                                cfg.run.eval_cuda_graph, cfg.run.compile_mode != "none")
    report = DryRunReport(cfg, denv.world_size, list(recorder.events), steps, cfg.run.sync_every, attention,
                          log.captures, log.replays, dict(recorder.fp8_gemms), stepped, dict(log.phase_replays),
                          log.streams, log.event_records, log.stream_waits, peak_step_bytes=peak or None,
                          memory=memory, work=work)
    report.compiled_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - compiled_before
    report.failures = findings(report)
    return report


def findings(report: DryRunReport) -> list[str]:
    """Host reads or copies inside a capture; more host reads per window than promised; fp8 without FP8 GEMMs."""
    found = [f"{e.kind} inside a CUDA-graph capture at {e.where} ({e.detail or 'host read'})"
             for e in report.events if e.in_capture]
    if report.cfg.run.precision == "fp8" and not report.fp8_gemms:
        found.append("--precision fp8 ran no FP8 GEMM (torch._scaled_mm): its layers ran emulated, or not at all")
    train_reads = [e for e in report.events if e.kind == "read" and e.phase.startswith("step ")]
    windows = math.ceil(report.steps / report.sync_every)
    if len(train_reads) > windows:
        lines = sorted({e.where for e in train_reads})
        found.append(f"{len(train_reads)} host reads in {report.steps} steps, more than the {windows} promised "
                     f"(one per --sync_every {report.sync_every} window): " + "; ".join(lines))
    return found
