"""The training run: build everything from a `TrainConfig`, train to the target, log it.

The loop is: [block of steps up to the next eval point] -> eval -> stop or continue. Every
number that changes during a run (steps, samples, skipped steps) lives in `TrainState`.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from . import fast_path
from .batch import FlatBatch, flatten_items, pad_items, unpad
from .checkpoint import load_init_checkpoint
from .clipping import ClipConfig, ClipHandle, ClipMode, apply_clip_mode, optimizer_clip_norm
from .config import TrainConfig
from .data import DataLimits, load_eval_set
from .distributed import DistEnv, all_reduce_sum
from .evaluation_interval import EvalSchedule
from .device_input import DeviceInput, HostBuilder
from .faults import NumericBlowUp, Preempted, StepGuard, StopRequest, TrainingStopped, Verdict, nonfinite_loss_error
from .graphed_training import StaticPackedStep, packed_shape
from .mllog import MLPerfLogger, bert_tf_tensor_names, optimizer_hyperparameters
from .model import BertConfig, BertForPreTraining, pretraining_loss
from .optim import build_optimizer, parameter_groups
from .schedule import LRSchedule, set_lr
from .train_checkpoint import (
    Checkpointer,
    ResumeError,
    TrainingParts,
    checkpoint_path,
    choose_resume,
    read_checkpoint,
    restore,
)
from .sources import BatchSource, TokenImbalance, open_batch_source
from .sync_window import InPlaceSnapshot, StateDictSnapshot, SyncWindow


@dataclass
class TrainState:
    """Everything about the run's progress that a resume would need."""

    step: int = 0  # optimizer steps applied (fp16 steps skipped for overflow do not count)
    samples: int = 0  # training sequences consumed over all ranks (the MLPerf epoch_num)
    skipped_steps: int = 0
    evals: list[tuple[int, float]] = field(default_factory=list)  # (samples, accuracy)

    def state_dict(self) -> dict:
        return {"step": self.step, "samples": self.samples, "skipped_steps": self.skipped_steps,
                "evals": list(self.evals)}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.samples = int(state["step"]), int(state["samples"])
        self.skipped_steps, self.evals = int(state["skipped_steps"]), [tuple(e) for e in state["evals"]]


@dataclass(frozen=True)
class RunResult:
    status: str  # "success" or "aborted"
    samples: int
    accuracy: float
    seconds: float


@dataclass
class Runtime:
    """The built objects of a run (not configuration, not progress)."""

    cfg: TrainConfig
    denv: DistEnv
    device: torch.device
    model: BertForPreTraining
    logger: MLPerfLogger
    ddp: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    schedule: LRSchedule | None = None
    scaler: torch.amp.GradScaler | None = None
    clip: ClipHandle | None = None
    eval_batches: list[FlatBatch] = field(default_factory=list)
    guard: StepGuard | None = None
    stop: StopRequest = field(default_factory=StopRequest)  # not installed: never requested
    checkpoints: Checkpointer | None = None
    graphed: StaticPackedStep | None = None  # --cuda_graphs: the static packed step
    window: SyncWindow | None = None  # --sync_every > 1 or --cuda_graphs: checks after the update

    @property
    def train_module(self) -> torch.nn.Module:
        return self.ddp if self.ddp is not None else self.model

    @property
    def parts(self) -> TrainingParts:
        return TrainingParts(self.model, self.optimizer, self.scaler)


def resolve_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was given, but no CUDA device is visible")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def seed_everything(seed: int, rank: int) -> None:
    """Same weights on every rank (seed), different dropout per rank (seed + rank later)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def data_limits(cfg: TrainConfig, bert: BertConfig) -> DataLimits:
    return DataLimits(cfg.data.max_seq_length, cfg.data.max_predictions_per_seq, bert.vocab_size)


def host_builder(cfg: TrainConfig, graphed: StaticPackedStep | None = None) -> HostBuilder:
    """How a micro-batch is built on the host, by the configured input layout.

    Padded batches are unpadded on the device (`device_input`); unpadded and packed ones
    are flat on the host (prebuilt on a host thread by `cpu_exchange`); --cuda_graphs packs
    them into static shapes.
    """
    if graphed is not None:
        return lambda source: graphed.shape.batch(source.next_batch())
    if cfg.data.input_layout == "padded":
        return lambda source: pad_items(source.next_batch(), cfg.data.max_seq_length,
                                        cfg.data.max_predictions_per_seq)
    return lambda source: source.next_flat_batch()


def device_input(rt: "Runtime", source: BatchSource) -> DeviceInput:
    """The source's micro-batches on the device; read ahead (pinned, async copies) on CUDA.

    On the CPU the batches are read when needed, unless DALI is asked for (its CPU pipeline).
    """
    cfg = rt.cfg
    finish = unpad if cfg.data.input_layout == "padded" and rt.graphed is None else (lambda batch: batch)
    ahead = rt.device.type == "cuda" or cfg.run.input_pipeline == "dali"
    return DeviceInput(source, host_builder(cfg, rt.graphed), rt.device, finish, ahead=ahead,
                       pipeline=cfg.run.input_pipeline)


def build_model(cfg: TrainConfig, device: torch.device) -> BertForPreTraining:
    from .attention import resolve_backend

    bert = BertConfig.from_json(cfg.model.bert_config_path)
    if cfg.data.max_seq_length > bert.max_position_embeddings:
        raise ValueError(
            f"--max_seq_length {cfg.data.max_seq_length} exceeds max_position_embeddings "
            f"{bert.max_position_embeddings} of {cfg.model.bert_config_path}"
        )
    backend = resolve_backend(cfg.model.attention_backend, device, bert.attention_probs_dropout_prob)
    model = BertForPreTraining(bert, attention_backend=backend)
    if cfg.model.init_checkpoint:
        load_init_checkpoint(model, cfg.model.init_checkpoint)
    # dynamic=None: the first shape compiles static (all of training under --cuda_graphs); the
    # first other shape (the next flat batch, or eval's) recompiles once with dynamic sizes.
    return fast_path.compile_model(model.to(device), cfg.run.compile_mode, dynamic=None)


def build_training(rt: Runtime) -> None:
    """Optimizer, schedule, loss scaler and DDP wrapper."""
    cfg = rt.cfg
    clip_config = ClipConfig(cfg.optim.clip_mode, cfg.optim.max_grad_norm)
    if rt.denv.is_distributed:
        ids = [rt.device.index] if rt.device.type == "cuda" else None
        rt.ddp = DistributedDataParallel(rt.model, device_ids=ids)
        rt.clip = apply_clip_mode(rt.ddp, clip_config)
        optimizer_clip = optimizer_clip_norm(clip_config)
    else:
        # One rank: its local gradient is the averaged one, so every clipping mode is the
        # optimizer's global-norm clip.
        optimizer_clip = None if clip_config.mode == ClipMode.NONE else clip_config.max_grad_norm
    rt.optimizer = build_optimizer(
        parameter_groups(rt.model, cfg.optim.weight_decay_rate), cfg.optim.optimizer, cfg.optim.learning_rate,
        (cfg.optim.beta1, cfg.optim.beta2), cfg.optim.epsilon, cfg.optim.weight_decay_rate, optimizer_clip,
        cfg.optim.implementation,
    )
    rt.schedule = lr_schedule(cfg)
    if cfg.run.precision == "fp16":
        rt.scaler = torch.amp.GradScaler(rt.device.type, init_scale=cfg.run.init_loss_scale)
    rt.guard = StepGuard(rt.device, check_loss=rt.scaler is None,
                         max_consecutive_skips=cfg.faults.max_consecutive_skipped_steps)


def load_eval_batches(rt: Runtime) -> None:
    """Reads this rank's share of the eval set once and keeps it on the device."""
    cfg = rt.cfg
    items = load_eval_set(cfg.data.eval_dir, cfg.eval.num_eval_examples, rt.denv.rank, rt.denv.world_size,
                          data_limits(cfg, rt.model.config))
    size = cfg.eval.eval_batch_size
    rt.eval_batches = [flatten_items(items[i : i + size]).to(rt.device) for i in range(0, len(items), size)]


@torch.no_grad()
def evaluate(rt: Runtime) -> tuple[float, float]:
    """Masked-LM accuracy and loss over every masked position of the eval set, all ranks."""
    rt.model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=rt.device)  # correct, count, loss sum
    for batch in rt.eval_batches:
        with fast_path.autocast(rt.device, rt.cfg.run.precision):
            logits = rt.model(batch).mlm_logits.float()
        totals[0] += (logits.argmax(dim=-1) == batch.masked_lm_ids).sum()
        totals[1] += batch.masked_lm_ids.numel()
        totals[2] += torch.nn.functional.cross_entropy(logits, batch.masked_lm_ids, reduction="sum")
    all_reduce_sum(totals)
    rt.model.train()
    correct, count, loss = totals.tolist()
    if count == 0:
        raise RuntimeError("the eval set has no masked positions; check --eval_dir")
    return correct / count, loss / count


def _micro_batches(data: DeviceInput, rt: Runtime) -> Iterator[FlatBatch]:
    for _ in range(rt.cfg.gradient_accumulation_steps):
        yield data.next()


def train_step(rt: Runtime, data: DeviceInput, state: TrainState) -> torch.Tensor:
    """One optimizer step over `gradient_accumulation_steps` micro-batches; returns the mean loss."""
    if rt.graphed is not None:
        return _graphed_step(rt, data, state)
    accum = rt.cfg.gradient_accumulation_steps
    loss_sum = torch.zeros((), device=rt.device)
    if rt.clip is not None and rt.scaler is not None:
        rt.clip.set_loss_scale(rt.scaler.get_scale())
    for i, batch in enumerate(_micro_batches(data, rt)):
        # DDP all-reduces on the last micro-batch only; earlier ones accumulate locally.
        sync = rt.ddp is None or i == accum - 1
        with (nullcontext() if sync else rt.ddp.no_sync()), fast_path.autocast(rt.device, rt.cfg.run.precision):
            loss = pretraining_loss(rt.train_module(batch), batch).total / accum
        (rt.scaler.scale(loss) if rt.scaler else loss).backward()
        loss_sum += loss.detach()
    # Before the update, so a non-finite loss never reaches the weights (faults.StepGuard);
    # with a sync window the check comes every N steps and rolls back instead.
    if rt.window is None:
        verdict = rt.guard.check(loss_sum, rt.stop.signal_number, _time_checkpoint_due(rt))
    else:
        verdict = Verdict()
        rt.window.observe(loss_sum)
    set_lr(rt.optimizer, rt.schedule.lr_at(state.step))
    applied = not verdict.nonfinite_loss and _optimizer_step(rt)
    rt.optimizer.zero_grad(set_to_none=True)
    state.samples += rt.cfg.global_batch_size
    if applied:
        state.step += 1
    else:
        state.skipped_steps += 1
    if verdict.nonfinite_loss:
        raise nonfinite_loss_error(state.step, state.samples)
    rt.guard.count(applied, state.step, state.samples)
    return loss_sum


def _time_checkpoint_due(rt: Runtime) -> bool:
    return rt.checkpoints is not None and rt.checkpoints.time_due()


def _graphed_step(rt: Runtime, data: DeviceInput, state: TrainState) -> torch.Tensor:
    """--cuda_graphs: learning rate written on the device, one replay; checked by the window later."""
    set_lr(rt.optimizer, rt.schedule.lr_at(state.step))
    loss = rt.graphed(data.next())
    rt.window.observe(loss)
    state.samples += rt.cfg.global_batch_size
    state.step += 1
    return loss


def _optimizer_step(rt: Runtime) -> bool:
    """Applies the update; False when a non-finite gradient (fp16 overflow) skips it on every rank."""
    if rt.clip is not None and rt.clip.found_nonfinite():
        if rt.scaler is not None:
            rt.scaler.update(rt.scaler.get_scale() * rt.scaler.get_backoff_factor())
        return False
    if rt.scaler is None:
        rt.optimizer.step()
        return True
    scale_before = rt.scaler.get_scale()
    rt.scaler.step(rt.optimizer)
    rt.scaler.update()
    return rt.scaler.get_scale() >= scale_before


class Progress:
    """A readable progress line on stderr every `log_freq` steps (rank 0), and the load per rank.

    The load is the real tokens of the most and the least loaded rank in each micro-batch
    (`BatchSource.token_imbalance`: a collective, so every rank gathers at the same steps),
    averaged over the progress line's window and, for the MLPerf log, over each eval interval
    (`tracked_stats` {max_rank_tokens, min_rank_tokens} at the interval's last step).
    """

    def __init__(self, rt: Runtime, source: BatchSource) -> None:
        self.rt = rt
        self.source = source
        self.t0, self.samples0 = time.perf_counter(), 0
        self.loss_sum = torch.zeros((), device=rt.device)
        self.steps = 0
        self.window = TokenImbalance.empty()  # micro-batches since the last progress line
        self.interval = TokenImbalance.empty()  # micro-batches since the last eval

    def _gather_loads(self) -> None:
        loads = self.source.token_imbalance()
        self.window, self.interval = self.window + loads, self.interval + loads

    def update(self, loss: torch.Tensor, state: TrainState) -> None:
        self.loss_sum += loss
        self.steps += 1
        if state.step % self.rt.cfg.run.log_freq == 0:
            self._gather_loads()
            self._print(state)

    def end_interval(self, state: TrainState) -> None:
        """Collective, called by every rank after the last step before an eval: logs the interval's load."""
        self._gather_loads()
        if self.interval.micro_batches:
            self.rt.logger.tracked_stats({"max_rank_tokens": self.interval.mean_max(),
                                          "min_rank_tokens": self.interval.mean_min()}, step=state.step)
        self.interval = TokenImbalance.empty()

    def _print(self, state: TrainState) -> None:
        now = time.perf_counter()
        if self.rt.denv.is_main:
            rate = (state.samples - self.samples0) / max(now - self.t0, 1e-9)
            lr = self.rt.schedule.lr_at(max(state.step - 1, 0))
            print(f"step {state.step} samples {state.samples} samples/s {rate:.1f} "
                  f"loss {self.loss_sum.item() / self.steps:.4f} lr {lr:.3e} skipped {state.skipped_steps} "
                  f"rank_tokens max {self.window.mean_max():.0f} min {self.window.mean_min():.0f}",
                  file=sys.stderr, flush=True)
        self.t0, self.samples0, self.steps = now, state.samples, 0
        self.loss_sum.zero_()
        self.window = TokenImbalance.empty()


def _stop_samples(cfg: TrainConfig) -> int:
    """Samples after which the run stops with `aborted`: max_steps or max_samples_termination."""
    limit = cfg.schedule.max_steps * cfg.global_batch_size
    if cfg.run.max_samples_termination is not None:
        limit = min(limit, cfg.run.max_samples_termination)
    return limit


def train_block(rt: Runtime, data: DeviceInput, state: TrainState, until: int, progress: Progress) -> None:
    """Steps until `until` samples have been consumed (or max_steps)."""
    while state.samples < until and state.step < rt.cfg.schedule.max_steps:
        before = state.samples
        progress.update(train_step(rt, data, state), state)
        if rt.window is not None:
            last = state.samples >= until or state.step >= rt.cfg.schedule.max_steps
            _read_window(rt, data, state, last or _samples_checkpoint_due(rt, before, state))
        _after_step(rt, data, state, before)


def _samples_checkpoint_due(rt: Runtime, samples_before: int, state: TrainState) -> bool:
    return rt.checkpoints is not None and rt.checkpoints.samples_due(samples_before, state.samples)


def _read_window(rt: Runtime, data: DeviceInput, state: TrainState, force: bool) -> None:
    """The window's agreement every N steps (and before an eval or a checkpoint).

    A non-finite loss since the last read rolls weights, optimizer, progress and data
    position back to that read and stops the run with its checkpoint.
    """
    if not (force or rt.window.due(state.step)):
        rt.guard.last = Verdict()
        return
    verdict = rt.window.agree(rt.stop.signal_number, _time_checkpoint_due(rt))
    if not verdict.nonfinite_loss:
        rt.window.mark_good(state.state_dict(), data.state_dict())
        return
    last_step = state.step
    good = rt.window.roll_back()
    # Evals done since that read stay done: they scored the good weights, and they are logged.
    evals = [e for e in state.evals if e[0] <= good.train_state["samples"]]
    state.load_state_dict({**good.train_state, "evals": evals})
    blowup = NumericBlowUp(
        f"the training loss was not finite (NaN or inf) on at least one rank between steps {state.step + 1} "
        f"and {last_step}; weights, optimizer and data position are rolled back to step {state.step} "
        f"({state.samples} samples). Lower the learning rate or check the data, then resume from the "
        "checkpoint, or rerun with --sync_every 1 to stop at the first such step"
    )
    blowup.data_state = good.data_state
    raise blowup


def _after_step(rt: Runtime, data: DeviceInput, state: TrainState, samples_before: int) -> None:
    """A periodic checkpoint when one is due; the stop for a signal (both agreed by every rank)."""
    verdict, checkpoints = rt.guard.last, rt.checkpoints
    if checkpoints is not None and (verdict.checkpoint_due or _samples_checkpoint_due(rt, samples_before, state)):
        save_checkpoint(rt, data, state, "periodic")
    if verdict.stop:
        raise Preempted(f"{signal.Signals(verdict.stop_signal).name} arrived; every rank stopped after step "
                        f"{state.step} ({state.samples} samples)")


def save_checkpoint(rt: Runtime, data: DeviceInput, state: TrainState, reason: str,
                    data_state: dict | None = None) -> Path:
    """Collective: every rank calls it at the same step; rank 0 writes the file and logs it.

    data_state: the data position to record instead of the input's (after a roll-back).
    """
    if rt.checkpoints.is_saved(state.state_dict()):
        return checkpoint_path(rt.checkpoints.directory, state.samples)
    position = data.state_dict() if data_state is None else data_state
    path = rt.checkpoints.save(rt.parts, state.state_dict(), position, reason, rt.cfg.to_dict())
    rt.logger.event("checkpoint_saved", str(path), {"epoch_num": state.samples, "step": state.step, "reason": reason})
    return path


def train_loop(rt: Runtime, data: DeviceInput, state: TrainState) -> str:
    cfg, log = rt.cfg, rt.logger
    stop_at = _stop_samples(cfg)
    evals = EvalSchedule.for_batch_size(cfg.global_batch_size, cfg.eval.eval_iter_start_samples,
                                        cfg.eval.eval_iter_samples)
    progress = Progress(rt, data)
    while True:
        if not _eval_pending(cfg, evals, state):
            point = min(evals.next_point(state.samples) or stop_at, stop_at)
            first = state.samples
            log.block_start(first_epoch_num=first, epoch_count=max(point - first, 1))
            train_block(rt, data, state, point, progress)
            progress.end_interval(state)
            log.block_stop(first_epoch_num=first)
        accuracy = run_eval(rt, state)
        if accuracy >= cfg.eval.target_mlm_accuracy:
            return "success"
        if state.samples >= stop_at or state.step >= cfg.schedule.max_steps:
            return "aborted"


def _eval_pending(cfg: TrainConfig, evals: EvalSchedule, state: TrainState) -> bool:
    """True after resuming from a checkpoint written at the end of a block, before that block's eval."""
    if state.samples == 0 or (state.evals and state.evals[-1][0] == state.samples):
        return False
    block_ended = evals.due(state.samples - cfg.global_batch_size, state.samples)
    return block_ended or state.samples >= _stop_samples(cfg) or state.step >= cfg.schedule.max_steps


def run_eval(rt: Runtime, state: TrainState) -> float:
    rt.logger.eval_start(epoch_num=state.samples)
    accuracy, loss = evaluate(rt)
    rt.logger.eval_stop(epoch_num=state.samples)
    rt.logger.eval_accuracy(accuracy, epoch_num=state.samples)
    rt.logger.event("eval_loss", loss, {"epoch_num": state.samples})
    rt.logger.event("skipped_steps", state.skipped_steps, {"epoch_num": state.samples})
    state.evals.append((state.samples, accuracy))
    if rt.denv.is_main:
        print(f"eval samples {state.samples} mlm_accuracy {accuracy:.4f} mlm_loss {loss:.4f}",
              file=sys.stderr, flush=True)
    return accuracy


def lr_schedule(cfg: TrainConfig) -> LRSchedule:
    sched = cfg.schedule
    warmup = sched.resolved_warmup_steps
    return LRSchedule(cfg.optim.learning_rate, sched.max_steps, warmup, sched.start_warmup_step,
                      decay_steps=sched.decay_steps, end_lr=sched.end_learning_rate,
                      decay_start_step=warmup if sched.decay_from_warmup_end else 0)


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
    values.update(optimizer_hyperparameters(cfg.optim.optimizer, lr_schedule(cfg), (cfg.optim.beta1, cfg.optim.beta2),
                                            cfg.optim.epsilon, cfg.optim.weight_decay_rate))
    return values


def write_resolved_config(cfg: TrainConfig, denv: DistEnv) -> None:
    if not denv.is_main:
        return
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "resolved_config.json.tmp"
    tmp.write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n")
    tmp.replace(out / "resolved_config.json")


def open_logger(cfg: TrainConfig, denv: DistEnv) -> MLPerfLogger:
    path = cfg.run.mlperf_log_path if denv.is_main else None
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    return MLPerfLogger(str(path) if path else None, denv.rank, echo_stdout=True)


def log_preamble(logger: MLPerfLogger, cfg: TrainConfig, model: BertForPreTraining) -> None:
    # Launchers that drop the page cache before the run say so (run_with_docker.sh, run.sub).
    logger.cache_clear(os.environ.get("MLPERF_CACHE_CLEARED", "0") == "1")
    logger.init_start()
    logger.submission_info(cfg.run.submission_org, cfg.run.submission_division, cfg.run.submission_platform,
                           cfg.run.submission_status)
    logger.hyperparameters(hyperparameters(cfg))
    logger.weights_initialization(bert_tf_tensor_names(model.config.num_hidden_layers))


def run(cfg: TrainConfig, denv: DistEnv, device: torch.device, stop: StopRequest | None = None) -> RunResult:
    """Builds the run, trains (or only evaluates without --do_train) and logs it.

    stop: the caller's installed SIGTERM/SIGUSR1 handlers (run_pretraining.py installs them
    before the process group starts); None installs them for the duration of this call.
    Raises `faults.TrainingStopped` after writing its checkpoint when the run stops early.
    """
    if stop is None:
        with StopRequest() as own:
            return run(cfg, denv, device, own)
    write_resolved_config(cfg, denv)
    logger = open_logger(cfg, denv)
    seed_everything(cfg.run.seed, denv.rank)
    model = build_model(cfg, device)
    log_preamble(logger, cfg, model)
    rt = Runtime(cfg, denv, device, model, logger, stop=stop)
    load_eval_batches(rt)
    if not cfg.run.do_train:
        return evaluate_only(rt)
    build_training(rt)
    state = TrainState()
    torch.manual_seed(cfg.run.seed + denv.rank)  # dropout differs per rank
    data = open_batch_source(cfg, denv, data_limits(cfg, model.config))
    try:
        status, seconds = train(rt, data, state)
    finally:
        data.close()
    log_run_end(rt, state, status)
    accuracy = state.evals[-1][1] if state.evals else math.nan
    return RunResult(status, state.samples, accuracy, seconds)


def train(rt: Runtime, data: BatchSource, state: TrainState) -> tuple[str, float]:
    """Resumes when asked, trains until a stop, checkpoints as configured; (status, seconds)."""
    resumed = resume_from_checkpoint(rt, data, state)
    build_fast_path(rt, state, data)
    rt.logger.init_stop()
    record = log_run_start(rt, resumed, state)
    ckpt = rt.cfg.checkpoint
    rt.checkpoints = Checkpointer(rt.cfg.checkpoint_dir, ckpt.keep, rt.denv, rt.device,
                                  every_samples=ckpt.every_samples, every_minutes=ckpt.every_minutes, record=record)
    feed = device_input(rt, data)
    start = time.time()
    try:
        status = train_loop(rt, feed, state)
    except TrainingStopped as stopped:
        # Every rank stops at the same step (faults.StepGuard); the state is the last good one.
        stopped.checkpoint = str(save_checkpoint(rt, feed, state, stopped.reason, stopped.data_state))
        rt.logger.event(stopped.reason, str(stopped), {"epoch_num": state.samples, "step": state.step})
        log_run_end(rt, state, "aborted")
        raise
    finally:
        feed.close()
    if ckpt.periodic:
        save_checkpoint(rt, feed, state, "final")
    return status, time.time() - start


def build_fast_path(rt: Runtime, state: TrainState, data: BatchSource) -> None:
    """--cuda_graphs (static packed step) and the sync window; after any resume, before run_start.

    Both hold on to the optimizer's current state tensors, so they come after the checkpoint
    is loaded. The graph is captured here, inside the untimed init phase.
    """
    cfg = rt.cfg
    if cfg.run.cuda_graphs:
        if rt.device.type != "cuda":
            raise RuntimeError(f"--cuda_graphs needs a CUDA device; this run trains on {rt.device}")
        shape = packed_shape(cfg.data.input_dir, cfg.micro_batch_size, cfg.data.max_seq_length)
        rt.graphed = StaticPackedStep(rt.model, rt.optimizer, shape, cfg.run.precision, graph=True)
        rt.optimizer = rt.graphed.optimizer
    if cfg.run.cuda_graphs or cfg.run.sync_every > 1:
        snapshot = (InPlaceSnapshot if rt.graphed is not None else StateDictSnapshot)(rt.model, rt.optimizer)
        rt.window = SyncWindow(cfg.run.sync_every, rt.guard, snapshot, state.state_dict(), data.state_dict())


@dataclass(frozen=True)
class Resumed:
    path: Path
    record: dict  # the checkpoint's run facts: run_start_ms and attempt of the run that wrote it


def resume_from_checkpoint(rt: Runtime, data: BatchSource, state: TrainState) -> Resumed | None:
    """Loads --resume_from_checkpoint into every part of the run; None for a fresh start."""
    cfg = rt.cfg
    path = choose_resume(cfg.checkpoint.resume_from, cfg.checkpoint_dir, rt.denv)
    if path is None:
        if cfg.checkpoint.resume_from is not None and rt.denv.is_main:
            print(f"no checkpoint in {cfg.checkpoint_dir}: starting a fresh run", file=sys.stderr, flush=True)
        return None
    ckpt = read_checkpoint(path)
    restore(rt.parts, ckpt, path, rt.denv, rt.device)
    state.load_state_dict(ckpt["train_state"])
    try:
        data.load_state_dict(ckpt["data"])
    except ValueError as err:
        raise ResumeError(f"{path}: {err}") from err
    return Resumed(path, dict(ckpt["run"]))


def log_run_start(rt: Runtime, resumed: Resumed | None, state: TrainState) -> dict:
    """run_start for a fresh run; the run facts a checkpoint keeps (run_start_ms, attempt).

    A resumed run logs `resumed_from_checkpoint` and no run_start: its clock did not start
    here, so its log can never pass the compliance checker as a timing result.
    """
    if resumed is None:
        rt.logger.run_start()
        return {"run_start_ms": int(time.time() * 1000), "attempt": 1}
    record = {"run_start_ms": resumed.record.get("run_start_ms"), "attempt": int(resumed.record.get("attempt", 1)) + 1}
    rt.logger.event("resumed_from_checkpoint", str(resumed.path),
                    {"epoch_num": state.samples, "step": state.step, **record})
    if rt.denv.is_main:
        print(f"resumed from {resumed.path} at step {state.step} ({state.samples} samples), attempt "
              f"{record['attempt']}: not an MLPerf timing result", file=sys.stderr, flush=True)
    return record


def log_run_end(rt: Runtime, state: TrainState, status: str) -> None:
    rt.logger.run_stop(status, epoch_num=state.samples)
    rt.logger.train_samples(state.samples)
    rt.logger.eval_samples(rt.cfg.eval.num_eval_examples)


def evaluate_only(rt: Runtime) -> RunResult:
    """Scores the init checkpoint once: how a user checks a converted checkpoint."""
    rt.logger.init_stop()
    rt.logger.run_start()
    start = time.time()
    accuracy = run_eval(rt, TrainState())
    status = "success" if accuracy >= rt.cfg.eval.target_mlm_accuracy else "aborted"
    rt.logger.run_stop(status, epoch_num=0)
    rt.logger.train_samples(0)
    rt.logger.eval_samples(rt.cfg.eval.num_eval_examples)
    return RunResult(status, 0, accuracy, time.time() - start)
