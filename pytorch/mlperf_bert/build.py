"""`build_run`: every object of a training run, built once and in one fixed order.

Before the clock (`prepare_run`, the untimed init phase): model -> training parts (optimizer,
schedule, scaler, DDP, clipping) -> resume of the weights and optimizer -> fast path (the step,
the guard, CUDA graphs or sync window). No byte of the dataset is read here: the CUDA graphs'
static shape comes from the folder's verification record (`data.record`). After `run_start`
(`open_run`): --unverified_data's check of data no record vouches for, the training input (with
the resumed data position), the eval set read in the background, the checkpoint writer and the
hooks. MLPerf's clock "must start before any part of the system touches the dataset"
(training_rules.adoc §11); docs/CLOSED_DIVISION.md lists what is read on each side of it.

The order matters where one part holds on to another's tensors: a resume replaces optimizer
state, so the fast path (which captures and snapshots those tensors) comes after it. The
result, `Run`, has no optional parts; a run without training is an `Evaluation` alone.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from .model.attention import resolve_backend
from .data.batch import Item, pad_items, unpad
from .model.init_checkpoint import load_init_checkpoint
from .optim.clipping import ClipConfig, ClipHandle, ClipMode, apply_clip_mode, optimizer_clip_norm
from .model.compiling import CompileBackend, compile_model
from .model.fp8 import Fp8Recipe, convert_to_fp8
from .config.closed_division import EVAL_ITER_KEY, EVAL_ITER_START_KEY, INIT_CHECKPOINT_KEY, TARGET_KEY
from .config.settings import TrainConfig
from .optim.capturable import capturable
from .optim.loss_scale import DeviceLossScaler, LossScaler
from .data.dataset import DataError, DataLimits, load_eval_set
from .input.device_input import DeviceInput, HostBuilder
from .input.eval_input import EvalInput
from .runtime.distributed import DistEnv
from .train.faults import Guard, Position, StepGuard, StopRequest
from .hooks.events import Hook, Hooks
from .runtime.files import write_text_atomic
from .hooks.mllog import MLPerfLogger, bert_tf_tensor_names, optimizer_hyperparameters
from .model.bert import BertConfig, BertForPreTraining
from .optim.optimizers import build_optimizer, parameter_groups
from .optim.sharded import ShardedKernels, build_sharded_optimizer, shard_groups
from .optim.schedule import LRSchedule
from .input.source_factory import open_batch_source
from .input.sources import BatchSource
from .data.static_batch import StaticShape
from .input.data_check import UNVERIFIED_CHECK_KEY, AfterClock, check_after_clock, recorded_shape
from .train.step import EagerStep, GraphedStep, Step
from .train.eval_step import EagerEval, EvalStep, GraphedEval, eval_shape
from .train.sync_window import InPlaceSnapshot, StateDictSnapshot, SyncWindow
from .train.checkpoint import (Checkpointer, ResumeError, TrainingParts, choose_resume, read_checkpoint, restore,
                               seed_generators)
from .hooks.live import LiveView
from .hooks.report import RunReport, Summary, write_summary
from .hooks.train_hooks import CheckpointWriter, EvalLine, MLPerfLog, PeriodicCheckpoints, Preemption, RankLoad
from .train.state import TrainState
from .train.evaluation_interval import EvalSchedule


@dataclass
class Evaluation:
    """What scoring the model needs: also the whole of a run without --do_train."""

    cfg: TrainConfig
    denv: DistEnv
    device: torch.device
    model: BertForPreTraining
    logger: MLPerfLogger
    data: EvalInput  # this rank's share of the eval set: read once the clock runs, then on the device
    hooks: Hooks  # a run without --do_train's: its MLPerf log and eval line (a training run has its own)
    step: EvalStep  # the eval forward, eager or captured (--eval_cuda_graph)


DDPFactory = Callable[[torch.nn.Module, torch.device], DistributedDataParallel]


def distributed_data_parallel(model: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


@dataclass(frozen=True)
class Supplied:
    """What a caller may hand `build_run` in place of what it reads from disk or wraps itself.

    A training run supplies nothing. The dry run (`mlperf_bert.dryrun`) builds the trainer's
    run without shards and over a process group that exchanges nothing: synthetic batches,
    the static shape from the flags, a DDP stand-in whose buckets it can see, and the model
    built on the CPU before its fake CUDA mode starts (inside it, only the move to the device
    and what follows run).
    """

    model: BertForPreTraining | None = None  # built by `cpu_model`, placed by build_run; None: built there
    source: BatchSource | None = None  # the training batches; None: opened over --input_dir
    eval_items: Sequence[Item] | None = None  # this rank's eval share; None: read from --eval_dir
    shape: StaticShape | None = None  # --cuda_graphs' static shape; None: K and Q read from the shards
    ddp: DDPFactory = distributed_data_parallel  # wraps the model on more than one rank
    # torch.compile's back-end under --compile_mode: Inductor writes kernels; the dry run's fake device
    # has none to run, so it traces with "aot_eager" (Dynamo and AOTAutograd, no code generation).
    compile_backend: CompileBackend = "inductor"


@dataclass
class Resumed:
    path: Path
    record: dict  # the checkpoint's run facts: run_start_ms and attempt of the run that wrote it
    data_state: dict  # the data position, loaded into the training input once it opens (after the clock)


@dataclass
class Run:
    """A training run, built by `build_run`."""

    eval: Evaluation
    schedule: LRSchedule
    step: Step
    guard: Guard
    state: TrainState
    source: BatchSource
    data: DeviceInput
    checkpoints: Checkpointer
    writer: CheckpointWriter
    hooks: Hooks
    resumed: list[Resumed]  # the checkpoint this run continues, or none
    data_check: str = ""  # what --unverified_data checked after run_start, in words ("" when nothing)

    @property
    def cfg(self) -> TrainConfig:
        return self.eval.cfg

    def close(self) -> None:
        self.data.close()
        self.source.close()
        self.eval.data.close()


@dataclass
class Training:
    """The training parts before the fast path: what a checkpoint restores."""

    module: torch.nn.Module  # the model, or its DDP wrapper
    parts: TrainingParts
    clip: ClipHandle | None  # clipping hooks, multi-rank only
    schedule: LRSchedule


def resolve_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was given, but no CUDA device is visible")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def data_limits(cfg: TrainConfig, bert: BertConfig) -> DataLimits:
    return DataLimits(cfg.data.max_seq_length, cfg.data.max_predictions_per_seq, bert.vocab_size)


def lr_schedule(cfg: TrainConfig) -> LRSchedule:
    sched = cfg.schedule
    warmup = sched.resolved_warmup_steps
    return LRSchedule(cfg.optim.learning_rate, sched.max_steps, warmup, sched.start_warmup_step,
                      decay_steps=sched.decay_steps, end_lr=sched.end_learning_rate,
                      decay_start_step=warmup if sched.decay_from_warmup_end else 0)


def eval_schedule(cfg: TrainConfig) -> EvalSchedule:
    """When the run evaluates: the flags, else the MLPerf interval of the global batch size."""
    return EvalSchedule.for_batch_size(cfg.global_batch_size, cfg.eval.eval_iter_start_samples,
                                       cfg.eval.eval_iter_samples)


def hyperparameters(cfg: TrainConfig) -> dict:
    """The MLPerf hyperparameter keys, from the config tree."""
    values = {
        "seed": cfg.run.seed,
        "global_batch_size": cfg.global_batch_size,
        "d_batch_size": cfg.train_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "max_sequence_length": cfg.data.max_seq_length,
        "max_predictions_per_seq": cfg.data.max_predictions_per_seq,
        "opt_gradient_clip_norm": cfg.optim.max_grad_norm,
        "opt_gradient_clip_mode": cfg.optim.clip_mode,
    }
    # Beside the MLPerf keys: the settings the closed-division rules govern that no MLPerf key
    # shows, so that tools/package_results.py checks them on the log (config/closed_division.py).
    evals = eval_schedule(cfg)
    values.update({
        EVAL_ITER_START_KEY: evals.start_samples, EVAL_ITER_KEY: evals.interval_samples,
        TARGET_KEY: cfg.eval.target_mlm_accuracy, INIT_CHECKPOINT_KEY: cfg.model.init_checkpoint,
    })
    values.update(optimizer_hyperparameters(cfg.optim.optimizer, lr_schedule(cfg), (cfg.optim.beta1, cfg.optim.beta2),
                                            cfg.optim.epsilon, cfg.optim.weight_decay_rate))
    return values


def write_resolved_config(cfg: TrainConfig, denv: DistEnv) -> None:
    if not denv.is_main:
        return
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "resolved_config.json", json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n")


def open_logger(cfg: TrainConfig, denv: DistEnv) -> MLPerfLogger:
    path = cfg.run.mlperf_log_path if denv.is_main else None
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    return MLPerfLogger(str(path) if path else None, denv.rank, echo_stdout=cfg.run.echo_mllog, hold_until_start=True)


def log_preamble(logger: MLPerfLogger, cfg: TrainConfig, model: BertForPreTraining) -> None:
    # Launchers that drop the page cache before the run say so (run_with_docker.sh, run.sub).
    logger.cache_clear(os.environ.get("MLPERF_CACHE_CLEARED", "0") == "1")
    logger.init_start()
    logger.submission_info(cfg.run.submission_org, cfg.run.submission_division, cfg.run.submission_platform,
                           cfg.run.submission_status)
    logger.hyperparameters(hyperparameters(cfg))
    logger.weights_initialization(bert_tf_tensor_names(model.config.num_hidden_layers))


def cpu_model(cfg: TrainConfig, device: torch.device) -> BertForPreTraining:
    """The model on the CPU, --init_checkpoint loaded; `device` is where it will run (its attention back-end,
    and under --precision fp8 whether its FP8 layers run on FP8 tensor cores or emulated)."""
    bert = BertConfig.from_json(cfg.model.bert_config_path)
    if cfg.data.max_seq_length > bert.max_position_embeddings:
        raise ValueError(
            f"--max_seq_length {cfg.data.max_seq_length} exceeds max_position_embeddings "
            f"{bert.max_position_embeddings} of {cfg.model.bert_config_path}"
        )
    backend = resolve_backend(cfg.model.attention_backend, device, cfg.data.max_seq_length, cfg.model.group_bounds,
                              cfg.run.precision, bert.head_dim)
    model = BertForPreTraining(bert, attention_backend=backend, group_bounds=cfg.model.group_bounds)
    if cfg.model.init_checkpoint:
        load_init_checkpoint(model, cfg.model.init_checkpoint)
    if cfg.run.precision == "fp8":
        # same parameters and state-dict keys: checkpoints load either way
        convert_to_fp8(model, device, Fp8Recipe.of(cfg.run.fp8_recipe, cfg.run.fp8_layers))
    return model


def build_model(cfg: TrainConfig, device: torch.device, model: BertForPreTraining | None = None,
                compile_backend: CompileBackend = "inductor") -> BertForPreTraining:
    """The model (`cpu_model`'s, or the one given) on `device`, compiled as --compile_mode asks."""
    model = model if model is not None else cpu_model(cfg, device)
    # dynamic=None: the first shape compiles static (all of training under --cuda_graphs); the
    # first other shape (the next flat batch, or eval's) recompiles once with dynamic sizes.
    return compile_model(model.to(device), cfg.run.compile_mode, dynamic=None, backend=compile_backend)


def eval_shortfall_advice(cfg: TrainConfig) -> str:
    """What to do when --eval_dir holds fewer samples than --num_eval_examples (closed: never fewer)."""
    if cfg.run.submission_division == "closed":
        return ("point --eval_dir at the 10,000-sample eval set (data_prep/prepare.py eval), "
                "or run in the open division (--submission_division open)")
    return "point --eval_dir at the full eval set, or lower --num_eval_examples"


def static_eval_shape(cfg: TrainConfig) -> StaticShape | None:
    """--eval_cuda_graph's batch shape, from the flags; None for the eager eval."""
    if not cfg.run.eval_cuda_graph:
        return None
    return eval_shape(cfg.eval.eval_batch_size, cfg.data.max_seq_length, cfg.data.max_predictions_per_seq)


def eval_step(cfg: TrainConfig, model: BertForPreTraining, device: torch.device) -> EvalStep:
    shape = static_eval_shape(cfg)
    if shape is None:
        return EagerEval(model, cfg.run.precision, device)
    return GraphedEval(model, cfg.run.precision, device, shape)


def eval_input(cfg: TrainConfig, denv: DistEnv, device: torch.device, bert: BertConfig,
               supplied: Sequence[Item] | None) -> EvalInput:
    """This rank's eval set, not read yet: `EvalInput.start` reads it once the clock runs."""
    size, shape = cfg.eval.eval_batch_size, static_eval_shape(cfg)
    if supplied is not None:
        return EvalInput.of(supplied, size, device, shape)
    limits = data_limits(cfg, bert)

    def load() -> Sequence[Item]:
        return load_eval_set(cfg.data.eval_dir, cfg.eval.num_eval_examples, denv.rank, denv.world_size, limits,
                             shortfall_advice=eval_shortfall_advice(cfg))

    return EvalInput(load, size, device, shape)


def build_evaluation(cfg: TrainConfig, denv: DistEnv, device: torch.device,
                     supplied: Supplied | None = None) -> Evaluation:
    """Resolved config, MLPerf log up to the weights, the model, and this rank's eval set (read later).

    supplied: its model and eval items replace the ones read from disk (see `Supplied`).
    """
    supplied = supplied or Supplied()
    write_resolved_config(cfg, denv)
    logger = open_logger(cfg, denv)
    seed_generators(cfg.run.seed)  # the same on every rank, so every rank initialises the same weights
    model = build_model(cfg, device, supplied.model, supplied.compile_backend)
    log_preamble(logger, cfg, model)
    data = eval_input(cfg, denv, device, model.config, supplied.eval_items)
    hooks = Hooks([MLPerfLog(logger, cfg.eval.num_eval_examples), EvalLine(denv.is_main)])
    return Evaluation(cfg, denv, device, model, logger, data, hooks, eval_step(cfg, model, device))


def build_training(cfg: TrainConfig, denv: DistEnv, device: torch.device, model: BertForPreTraining,
                   ddp: DDPFactory = distributed_data_parallel) -> Training:
    """Optimizer, schedule, loss scaler, DDP wrapper (made by `ddp`) and clipping hooks."""
    clip_config = ClipConfig(ClipMode(cfg.optim.clip_mode), cfg.optim.max_grad_norm)
    module: torch.nn.Module = model
    wrapped = ddp(model, device) if denv.is_distributed else None
    if wrapped is not None:
        module = wrapped
        optimizer_clip = optimizer_clip_norm(clip_config)
    else:
        # One rank: its local gradient is the averaged one, so every clipping mode is the
        # optimizer's global-norm clip.
        optimizer_clip = None if clip_config.mode == ClipMode.NONE else clip_config.max_grad_norm
    opt = cfg.optim
    args = (parameter_groups(model, opt.weight_decay_rate), opt.optimizer, opt.learning_rate, (opt.beta1, opt.beta2),
            opt.epsilon, opt.weight_decay_rate, optimizer_clip, opt.implementation)
    # After DDP: its broadcast of rank 0's weights comes before the sharded optimizer flattens them.
    optimizer = build_sharded_optimizer(*args, *shard_groups(opt.distributed_group_size)) if cfg.sharded_optimizer \
        else build_optimizer(*args, cuda_graphs=cfg.device_steps)
    clip = None
    if wrapped is not None:
        # Sharded: the hooks hand each bucket, unreduced, to the optimizer's reduce-scatter as the
        # backward produces it.
        sink = optimizer.shards if isinstance(optimizer, ShardedKernels) else None
        clip = apply_clip_mode(wrapped, clip_config, reduces=sink is None, sink=sink)
    return Training(module, TrainingParts(model, optimizer, loss_scaler(cfg, device)), clip, lr_schedule(cfg))


def loss_scaler(cfg: TrainConfig, device: torch.device) -> LossScaler | None:
    """fp16's scaler: on the device under a graph or a sync window (no host read), else GradScaler."""
    if cfg.run.precision != "fp16":
        return None
    if cfg.device_loss_scaling:
        return DeviceLossScaler(device, init_scale=cfg.run.init_loss_scale)
    return torch.amp.GradScaler(device.type, init_scale=cfg.run.init_loss_scale)


def resume(cfg: TrainConfig, denv: DistEnv, device: torch.device, parts: TrainingParts,
           state: TrainState) -> list[Resumed]:
    """Loads --resume_from_checkpoint into the model, optimizer and progress; [] for a fresh start.

    The data position waits in `Resumed.data_state` until the training input opens (`resume_input`).
    """
    path = choose_resume(cfg.checkpoint.resume_from, cfg.checkpoint_dir, denv)
    if path is None:
        if cfg.checkpoint.resume_from is not None and denv.is_main:
            print(f"no checkpoint in {cfg.checkpoint_dir}: starting a fresh run", file=sys.stderr, flush=True)
        return []
    ckpt = read_checkpoint(path)
    restore(parts, ckpt, path, denv, device, cfg.run.seed)
    state.load_state_dict(ckpt["train_state"])
    note = other_world_note(cfg, int(ckpt["run"]["world_size"]), path)
    if note and denv.is_main:
        print(note, file=sys.stderr, flush=True)
    return [Resumed(path, dict(ckpt["run"]), ckpt["data"])]


def resume_input(source: BatchSource, resumed: list[Resumed]) -> None:
    """The resumed data position into the freshly opened training input."""
    for done in resumed:
        try:
            source.load_state_dict(done.data_state)
        except ValueError as err:
            raise ResumeError(f"{done.path}: {err}") from err


def other_world_note(cfg: TrainConfig, saved_world: int, path: Path) -> str | None:
    """The line a resume at another number of ranks prints: what stays equal and what does not."""
    world = cfg.world_size
    if saved_world == world:
        return None
    note = (f"{path.name}: written at {saved_world} ranks, resumed at {world} x {cfg.gradient_accumulation_steps} "
            "micro-batches: every step trains on the same samples (with dropout the steps are equivalent, not equal)")
    if world > 1 and cfg.data.balance != "none":
        note += f"; --balance {cfg.data.balance} groups them into other micro-batches over {world} ranks"
    if world > 1 and cfg.optim.clip_mode in ("before_allreduce", "bucketwise"):
        note += (f"; --clip_mode {cfg.optim.clip_mode} clips each rank's gradient, now the sum of "
                 f"{cfg.gradient_accumulation_steps} micro-batches")
    return note


def static_shape(cfg: TrainConfig, supplied: StaticShape | None) -> StaticShape | None:
    """--cuda_graphs' static shape: the supplied one, else K and Q from the verification record (the
    graph is captured before the clock, when no shard may be read); None without graphs."""
    if not cfg.run.cuda_graphs:
        return None
    if supplied is not None:
        return supplied
    assert cfg.data.input_dir is not None, "TrainConfig requires --input_dir with --do_train"
    return recorded_shape(cfg.data.input_dir, cfg.micro_batch_size, cfg.data.max_seq_length)


def build_step(cfg: TrainConfig, training: Training, guard: StepGuard, shape: StaticShape | None) -> tuple[Step, Guard]:
    """The fast path, after any resume: the step and the guard it reports to.

    --cuda_graphs (`shape` given): the static packed step captured as a CUDA graph, inside
    the untimed init phase. With a graph or a device loss scaler the optimizer is the
    capturable twin of the trainer's, its lr following its device step count. With a graph
    or --sync_every > 1 the guard is a sync window, which snapshots the optimizer's current
    state tensors (hence after the resume). A sharded optimizer under a window is snapshotted in
    place too (its state dict is a collective gathering whole moments), so it also counts its
    steps on the device, where the snapshot sees the count. The window's first good position
    is set when the input opens (`open_run`).
    """
    parts = training.parts
    windowed = shape is not None or cfg.run.sync_every > 1
    in_place = cfg.device_steps or cfg.sharded_optimizer
    if cfg.device_steps or (windowed and in_place):
        parts.optimizer = capturable(parts.optimizer, training.schedule)
    if not windowed:
        return EagerStep(training.module, parts.optimizer, cfg.run.precision, cfg.gradient_accumulation_steps,
                         guard, parts.scaler, training.clip), guard
    device_scaler = parts.scaler if isinstance(parts.scaler, DeviceLossScaler) else None
    window = SyncWindow(cfg.run.sync_every, guard, window_snapshot(parts, in_place), None, device_scaler)
    if shape is None:
        return EagerStep(training.module, parts.optimizer, cfg.run.precision, cfg.gradient_accumulation_steps,
                         window, parts.scaler, training.clip), window
    examples = [shape.example() for _ in range(cfg.gradient_accumulation_steps)]
    return GraphedStep(training.module, parts.optimizer, examples, cfg.run.precision, window, device_scaler,
                       training.clip), window


def window_snapshot(parts: TrainingParts, in_place: bool) -> InPlaceSnapshot | StateDictSnapshot:
    """What a sync window rolls back: in place for a device-stepped optimizer (a graph keeps the addresses)."""
    if not in_place:
        return StateDictSnapshot(parts.model, parts.optimizer)
    scaler = parts.scaler.tensors() if isinstance(parts.scaler, DeviceLossScaler) else ()
    return InPlaceSnapshot(parts.model, parts.optimizer, scaler)


def host_builder(cfg: TrainConfig, shape: StaticShape | None) -> HostBuilder:
    """How a micro-batch is built on the host, by the configured input layout.

    Padded batches are unpadded on the device; unpadded and packed ones are flat on the host
    (prebuilt on a host thread by `cpu_exchange`); --cuda_graphs packs them into static shapes.
    """
    if shape is not None:
        return lambda source: shape.batch(source.next_batch())
    if cfg.data.input_layout == "padded":
        return lambda source: pad_items(source.next_batch(), cfg.data.max_seq_length,
                                        cfg.data.max_predictions_per_seq)
    return lambda source: source.next_flat_batch()


def device_input(cfg: TrainConfig, device: torch.device, source: BatchSource, shape: StaticShape | None) -> DeviceInput:
    """The source's micro-batches on the device; read ahead (pinned, async copies) on CUDA.

    On the CPU the batches are read when needed, unless DALI is asked for (its CPU pipeline).
    """
    finish = unpad if cfg.data.input_layout == "padded" and shape is None else (lambda batch: batch)
    ahead = device.type == "cuda" or cfg.run.input_pipeline == "dali"
    return DeviceInput(source, host_builder(cfg, shape), device, finish, ahead=ahead, pipeline=cfg.run.input_pipeline)


def build_hooks(ev: Evaluation, writer: CheckpointWriter, data: DeviceInput, extra: Sequence[Hook]) -> Hooks:
    """The caller's hooks first (they see a step before a checkpoint or a stop), then the trainer's.

    The MLPerf log ends the run before rank 0's view and report, so a failing plot still
    leaves a complete log.
    """
    cfg = ev.cfg
    load = RankLoad(data, ev.logger, cfg.run.log_freq)
    return Hooks([*extra, load, MLPerfLog(ev.logger, cfg.eval.num_eval_examples), *rank0_views(cfg, ev.denv, load),
                  PeriodicCheckpoints(writer, cfg.global_batch_size), Preemption()])


def rank0_views(cfg: TrainConfig, denv: DistEnv, load: RankLoad) -> list[Hook]:
    """The live view (console and OUTPUT_DIR/train.log) and the end-of-run report, on rank 0."""
    if not denv.is_main:
        return []
    # curves.png beside the summary in the run's own folder: --mlperf_log_file may name a folder
    # that many runs share (the demo's), where one run's picture would replace another's.
    return [LiveView(log_every=cfg.run.log_freq, world_size=denv.world_size, fields=load.progress_fields),
            RunReport(loss_every=cfg.run.log_freq, log_dir=Path(cfg.run.output_dir),
                      mlperf_log=cfg.run.mlperf_log_path, curves=cfg.run.curves == "png")]


@dataclass
class Prepared:
    """A training run before the clock (`prepare_run`): everything but what reads the dataset."""

    eval: Evaluation
    training: Training
    state: TrainState
    resumed: list[Resumed]
    checkpoints: Checkpointer
    step: Step
    guard: Guard
    shape: StaticShape | None
    supplied: Supplied
    extra_hooks: Sequence[Hook]


def prepare_run(cfg: TrainConfig, denv: DistEnv, device: torch.device, stop: StopRequest,
                extra_hooks: Sequence[Hook] = (), supplied: Supplied = Supplied()) -> Prepared:
    """The untimed init phase, in the order of the module docstring; reads no byte of the dataset."""
    ev = build_evaluation(cfg, denv, device, supplied)
    training = build_training(cfg, denv, device, ev.model, supplied.ddp)
    torch.manual_seed(cfg.run.seed + denv.rank)  # from here on, dropout draws differ per rank
    state = TrainState()
    resumed = resume(cfg, denv, device, training.parts, state)
    ckpt = cfg.checkpoint
    checkpoints = Checkpointer(cfg.checkpoint_dir, ckpt.keep, denv, device, every_samples=ckpt.every_samples,
                               every_minutes=ckpt.every_minutes)
    guard = StepGuard(device, loss_checked=training.parts.scaler is None,
                      max_consecutive_skips=cfg.faults.max_consecutive_skipped_steps, stop=stop,
                      checkpoint_due=checkpoints.time_due)
    shape = static_shape(cfg, supplied.shape)
    step, guard_used = build_step(cfg, training, guard, shape)
    # Last: the training parts may re-point the weights (the sharded optimizer's flat buffer), which
    # a captured eval forward reads where they were at its capture.
    ev.step.prepare()
    return Prepared(ev, training, state, resumed, checkpoints, step, guard_used, shape, supplied, extra_hooks)


def data_check_after_clock(ev: Evaluation) -> AfterClock | None:
    """--unverified_data's check of data no record vouches for (`data_check.check_after_clock`), after
    run_start: the MLPerf log says what ran and how long it took; a problem it finds stops the run, whose
    summary (rank 0) says so too."""
    checked = check_after_clock(ev.cfg, ev.denv)
    if checked is None:
        return None
    ev.logger.event(UNVERIFIED_CHECK_KEY, round(checked.seconds, 3),
                    {"why": checked.why, "status": "refused" if checked.problem else "passed"})
    if checked.problem is not None:
        if ev.denv.is_main:
            write_summary(refused_summary(ev.cfg, checked), Path(ev.cfg.run.output_dir))
        raise DataError(checked.refusal())
    if ev.denv.is_main:
        print(f"note: {checked.line()}", file=sys.stderr, flush=True)
    return checked


def refused_summary(cfg: TrainConfig, checked: AfterClock) -> Summary:
    """The summary of a run that --unverified_data's check ended before its first step."""
    return Summary("aborted", "the data check after run_start refused the data", checked.seconds, 0, 0, 0, (), 0.0,
                   cfg.eval.target_mlm_accuracy, {"MLPerf log": str(cfg.run.mlperf_log_path)},
                   data_check=checked.line())


def open_run(prepared: Prepared) -> Run:
    """After `run_start`: the data no record vouches for is checked (--unverified_data), the eval set
    starts loading, the training input opens at the resumed position."""
    p, cfg, ev = prepared, prepared.eval.cfg, prepared.eval
    checked = data_check_after_clock(ev) if p.supplied.source is None else None
    ev.data.start()
    source = p.supplied.source if p.supplied.source is not None else \
        open_batch_source(cfg, ev.denv, data_limits(cfg, ev.model.config))
    try:
        resume_input(source, p.resumed)
        data = device_input(cfg, ev.device, source, p.shape)
    except BaseException:
        source.close()  # its reader threads would keep the process alive
        raise
    if isinstance(p.guard, SyncWindow):
        p.guard.begin(Position(p.state.state_dict(), data.state_dict()))
    writer = CheckpointWriter(p.checkpoints, p.training.parts, p.state, data, ev.logger, cfg.to_dict())
    hooks = build_hooks(ev, writer, data, p.extra_hooks)
    return Run(ev, p.training.schedule, p.step, p.guard, p.state, source, data, p.checkpoints, writer, hooks,
               p.resumed, checked.line() if checked is not None else "")


def build_run(cfg: TrainConfig, denv: DistEnv, device: torch.device, stop: StopRequest,
              extra_hooks: Sequence[Hook] = (), supplied: Supplied = Supplied()) -> Run:
    """`prepare_run` then `open_run` at once, for callers without an MLPerf clock (tests, the dry run),
    whose MLPerf log writes from here on."""
    run = open_run(prepare_run(cfg, denv, device, stop, extra_hooks, supplied))
    run.eval.logger.release()
    return run
