"""The training run: build everything from a `TrainConfig`, train to the target, log it.

The loop is: [block of steps up to the next eval point] -> eval -> stop or continue. Every
number that changes during a run (steps, samples, skipped steps) lives in `TrainState`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import ContextManager, Iterator

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from .batch import FlatBatch, Item, flatten_items, pad_items, unpad
from .checkpoint import load_init_checkpoint
from .clipping import ClipConfig, ClipHandle, ClipMode, apply_clip_mode, optimizer_clip_norm
from .config import TrainConfig
from .data import DataLimits, load_eval_set
from .distributed import DistEnv, all_reduce_sum
from .evaluation_interval import EvalSchedule
from .mllog import MLPerfLogger, bert_tf_tensor_names, optimizer_hyperparameters
from .model import BertConfig, BertForPreTraining, pretraining_loss
from .optim import build_optimizer, parameter_groups
from .schedule import LRSchedule, set_lr
from .sources import BatchSource, TokenImbalance, open_batch_source


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

    @property
    def train_module(self) -> torch.nn.Module:
        return self.ddp if self.ddp is not None else self.model


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


def autocast(cfg: TrainConfig, device: torch.device) -> ContextManager:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.run.precision)
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def data_limits(cfg: TrainConfig, bert: BertConfig) -> DataLimits:
    return DataLimits(cfg.data.max_seq_length, cfg.data.max_predictions_per_seq, bert.vocab_size)


def to_device_batch(items: list[Item], cfg: TrainConfig, device: torch.device) -> FlatBatch:
    """Host items -> the flat batch on `device`, by the configured input layout."""
    if cfg.data.input_layout == "padded":
        padded = pad_items(items, cfg.data.max_seq_length, cfg.data.max_predictions_per_seq)
        return unpad(padded.to(device, non_blocking=True))
    return flatten_items(items).to(device, non_blocking=True)


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
    return model.to(device)


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
        with autocast(rt.cfg, rt.device):
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


def _micro_batches(data: BatchSource, rt: Runtime) -> Iterator[FlatBatch]:
    for _ in range(rt.cfg.gradient_accumulation_steps):
        yield to_device_batch(data.next_batch(), rt.cfg, rt.device)


def train_step(rt: Runtime, data: BatchSource, state: TrainState) -> torch.Tensor:
    """One optimizer step over `gradient_accumulation_steps` micro-batches; returns the mean loss."""
    accum = rt.cfg.gradient_accumulation_steps
    loss_sum = torch.zeros((), device=rt.device)
    if rt.clip is not None and rt.scaler is not None:
        rt.clip.set_loss_scale(rt.scaler.get_scale())
    for i, batch in enumerate(_micro_batches(data, rt)):
        # DDP all-reduces on the last micro-batch only; earlier ones accumulate locally.
        sync = rt.ddp is None or i == accum - 1
        with (nullcontext() if sync else rt.ddp.no_sync()), autocast(rt.cfg, rt.device):
            loss = pretraining_loss(rt.train_module(batch), batch).total / accum
        (rt.scaler.scale(loss) if rt.scaler else loss).backward()
        loss_sum += loss.detach()
    set_lr(rt.optimizer, rt.schedule.lr_at(state.step))
    applied = _optimizer_step(rt)
    rt.optimizer.zero_grad(set_to_none=True)
    state.samples += rt.cfg.global_batch_size
    if applied:
        state.step += 1
    else:
        state.skipped_steps += 1
    return loss_sum


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
        cfg = rt.cfg
        self.evals = EvalSchedule.for_batch_size(cfg.global_batch_size, cfg.eval.eval_iter_start_samples,
                                                 cfg.eval.eval_iter_samples)

    def _ends_interval(self, state: TrainState) -> bool:
        """Whether train_loop evaluates after this step: an eval point, the sample limit or max_steps."""
        cfg = self.rt.cfg
        return (self.evals.due(state.samples - cfg.global_batch_size, state.samples)
                or state.samples >= _stop_samples(cfg) or state.step >= cfg.schedule.max_steps)

    def update(self, loss: torch.Tensor, state: TrainState) -> None:
        self.loss_sum += loss
        self.steps += 1
        print_now, interval_done = state.step % self.rt.cfg.run.log_freq == 0, self._ends_interval(state)
        if print_now or interval_done:
            loads = self.source.token_imbalance()
            self.window, self.interval = self.window + loads, self.interval + loads
        if print_now:
            self._print(state)
        if interval_done:
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


def train_block(rt: Runtime, data: BatchSource, state: TrainState, until: int, progress: Progress) -> None:
    """Steps until `until` samples have been consumed (or max_steps)."""
    while state.samples < until and state.step < rt.cfg.schedule.max_steps:
        progress.update(train_step(rt, data, state), state)


def train_loop(rt: Runtime, data: BatchSource, state: TrainState) -> str:
    cfg, log = rt.cfg, rt.logger
    stop_at = _stop_samples(cfg)
    evals = EvalSchedule.for_batch_size(cfg.global_batch_size, cfg.eval.eval_iter_start_samples,
                                        cfg.eval.eval_iter_samples)
    progress = Progress(rt, data)
    while True:
        point = min(evals.next_point(state.samples) or stop_at, stop_at)
        first = state.samples
        log.block_start(first_epoch_num=first, epoch_count=max(point - first, 1))
        train_block(rt, data, state, point, progress)
        log.block_stop(first_epoch_num=first)
        accuracy = run_eval(rt, state)
        if accuracy >= cfg.eval.target_mlm_accuracy:
            return "success"
        if state.samples >= stop_at or state.step >= cfg.schedule.max_steps:
            return "aborted"


def run_eval(rt: Runtime, state: TrainState) -> float:
    rt.logger.eval_start(epoch_num=state.samples)
    accuracy, loss = evaluate(rt)
    rt.logger.eval_stop(epoch_num=state.samples)
    rt.logger.eval_accuracy(accuracy, epoch_num=state.samples)
    rt.logger.event("eval_loss", loss, {"epoch_num": state.samples})
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


def run(cfg: TrainConfig, denv: DistEnv, device: torch.device) -> RunResult:
    """Builds the run, trains (or only evaluates without --do_train) and logs it."""
    write_resolved_config(cfg, denv)
    logger = open_logger(cfg, denv)
    seed_everything(cfg.run.seed, denv.rank)
    model = build_model(cfg, device)
    log_preamble(logger, cfg, model)
    rt = Runtime(cfg, denv, device, model, logger)
    load_eval_batches(rt)
    if not cfg.run.do_train:
        return evaluate_only(rt)
    build_training(rt)
    state = TrainState()
    torch.manual_seed(cfg.run.seed + denv.rank)  # dropout differs per rank
    data = open_batch_source(cfg, denv, data_limits(cfg, model.config))
    try:
        logger.init_stop()
        logger.run_start()
        start = time.time()
        status = train_loop(rt, data, state)
        seconds = time.time() - start
    finally:
        data.close()
    logger.run_stop(status, epoch_num=state.samples)
    logger.train_samples(state.samples)
    logger.eval_samples(cfg.eval.num_eval_examples)
    accuracy = state.evals[-1][1] if state.evals else math.nan
    return RunResult(status, state.samples, accuracy, seconds)


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
