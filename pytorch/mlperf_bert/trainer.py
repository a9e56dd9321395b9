"""The training loop: [block of steps up to the next eval point] -> eval -> stop or continue.

`build.prepare_run` builds every part that reads no data before the clock, `build.open_run`
the input after `run_start`; this module only runs them. One step's path: the input
(`device_input.DeviceInput`, from the shards through `sources`) hands the step
(`step.Step`) its micro-batches on the device; the step updates the weights; the guard
(`faults.Guard`) says what every rank does next; the hooks (`train_hooks`) print, log,
checkpoint and stop. Every number that changes during a run lives in `TrainState`.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from .config.closed_division import INIT_SECONDS_KEY, init_overrun
from .data.batch import FlatBatch
from .build import Evaluation, Prepared, Run, build_evaluation, eval_schedule, open_run, prepare_run
from .config.settings import TrainConfig
from .runtime.distributed import DistEnv, all_reduce_sum, barrier
from .train.evaluation_interval import EvalSchedule
from .train.faults import Position, StepFacts, StopRequest, TrainingStopped, nonfinite_loss_error, rolled_back_error
from .hooks.events import BlockEnd, EvalEnd, Hook, RunEnd, RunStart, StepEnd
from .train.state import TrainState


@dataclass(frozen=True)
class RunResult:
    status: str  # "success" or "aborted"
    samples: int
    accuracy: float
    seconds: float


def stop_samples(cfg: TrainConfig) -> int:
    """Samples after which the run stops with `aborted`: max_steps or max_samples_termination."""
    limit = cfg.schedule.max_steps * cfg.global_batch_size
    if cfg.run.max_samples_termination is not None:
        limit = min(limit, cfg.run.max_samples_termination)
    return limit


def limit_reached(cfg: TrainConfig, state: TrainState) -> bool:
    """The run's stop condition besides the target accuracy (the only place it is written)."""
    return state.samples >= stop_samples(cfg) or state.step >= cfg.schedule.max_steps


def ended(cfg: TrainConfig, state: TrainState) -> str | None:
    """The status of a run that was over when its state was saved, else None.

    The checkpoint a run writes at its end holds its last eval; a job killed after that (while it
    writes its summary, say) and resumed must not train past the finish.
    """
    if not state.evals or state.evals[-1][0] != state.samples:
        return None
    if state.evals[-1][1] >= cfg.eval.target_mlm_accuracy:
        return "success"
    return "aborted" if limit_reached(cfg, state) else None


def train_loop(run: Run) -> str:
    """Blocks of steps, each followed by an eval, until the target or a limit: the status."""
    cfg, state = run.cfg, run.state
    evals = eval_schedule(cfg)
    status = ended(cfg, state)
    if status is not None:
        return status
    while True:
        if not eval_pending(cfg, evals, state):
            point = min(evals.next_point(state.samples) or stop_samples(cfg), stop_samples(cfg))
            train_block(run, point)
        if run_eval(run.eval, state, run.hooks) >= cfg.eval.target_mlm_accuracy:
            return "success"
        if limit_reached(cfg, state):
            return "aborted"


def train_block(run: Run, until: int) -> None:
    """Steps until `until` samples have been consumed (or a limit), between MLPerf block marks."""
    first, log = run.state.samples, run.eval.logger
    log.block_start(first_epoch_num=first, epoch_count=max(until - first, 1))
    while run.state.samples < until and not limit_reached(run.cfg, run.state):
        train_step(run, until)
    run.hooks.block_end(BlockEnd(run.state.step, run.state.samples))
    log.block_stop(first_epoch_num=first)


def micro_batches(run: Run) -> Iterator[FlatBatch]:
    for _ in range(run.cfg.gradient_accumulation_steps):
        yield run.data.next()


def train_step(run: Run, until: int) -> torch.Tensor:
    """One step, the guard's verdict on it, then the hooks (which may checkpoint or stop); the step's loss."""
    state, cfg = run.state, run.cfg
    lr, tokens = run.schedule.lr_at(state.step), run.data.tokens
    result = run.step(micro_batches(run), lr)
    state.advance(result.applied, cfg.global_batch_size)
    if result.verdict.nonfinite_loss:
        raise nonfinite_loss_error(state.step, state.samples)
    read_now = state.samples >= until or limit_reached(cfg, state) or \
        run.checkpoints.samples_due(state.samples - cfg.global_batch_size, state.samples)
    verdict = run.guard.after_step(StepFacts(result.verdict, result.applied, state.step, state.samples, read_now,
                                             lambda: Position(state.state_dict(), run.data.state_dict()),
                                             state.uncount))
    if verdict.rolled_back_to is not None:
        roll_back(state, verdict.rolled_back_to)
    run.hooks.step_end(StepEnd(state.step, state.samples, result.loss, lr, run.data.tokens - tokens,
                               state.skipped_steps, until, verdict))
    return result.loss


def roll_back(state: TrainState, good: Position) -> None:
    """Progress back to the window's last good read (weights are back already); stops the run."""
    last_step = state.step
    # Evals done since that read stay done: they scored the good weights, and they are logged.
    evals = [e for e in state.evals if e[0] <= good.train_state["samples"]]
    state.load_state_dict({**good.train_state, "evals": evals})
    raise rolled_back_error(last_step, good)


def eval_pending(cfg: TrainConfig, evals: EvalSchedule, state: TrainState) -> bool:
    """True after resuming from a checkpoint written at the end of a block, before that block's eval."""
    if state.samples == 0 or (state.evals and state.evals[-1][0] == state.samples):
        return False
    return evals.due(state.samples - cfg.global_batch_size, state.samples) or limit_reached(cfg, state)


@torch.no_grad()
def evaluate(ev: Evaluation) -> tuple[float, float]:
    """Masked-LM accuracy and loss over every masked position of the eval set, all ranks."""
    totals = ev.step.totals(ev.data.batches())  # correct, count, loss sum, on the device (eval_step.py)
    all_reduce_sum(totals)
    correct, count, loss = totals.tolist()  # the eval's one host read
    if count == 0:
        raise RuntimeError("the eval set has no masked positions; check --eval_dir")
    return correct / count, loss / count


def run_eval(ev: Evaluation, state: TrainState, hooks: Hook) -> float:
    ev.logger.eval_start(epoch_num=state.samples)
    start = time.time()
    accuracy, loss = evaluate(ev)
    ev.logger.eval_stop(epoch_num=state.samples)
    state.evals.append((state.samples, accuracy))
    hooks.eval_end(EvalEnd(state.step, state.samples, accuracy, loss, time.time() - start, state.skipped_steps))
    return accuracy


def run(cfg: TrainConfig, denv: DistEnv, device: torch.device, stop: StopRequest | None = None,
        hooks: Sequence[Hook] = ()) -> RunResult:
    """Builds the run, trains (or only evaluates without --do_train) and logs it.

    stop: the caller's installed SIGTERM/SIGUSR1 handlers (run_pretraining.py installs them
    before the process group starts); None installs them for the duration of this call.
    hooks: more hooks, called before the trainer's own at every event.
    Raises `faults.TrainingStopped` after writing its checkpoint when the run stops early.
    """
    if stop is None:
        with StopRequest() as own:
            return run(cfg, denv, device, own, hooks)
    if not cfg.run.do_train:
        ev = build_evaluation(cfg, denv, device)
        try:
            return evaluate_only(ev)
        finally:
            ev.data.close()
    prepared = prepare_run(cfg, denv, device, stop, hooks)
    prepared.eval.logger.init_stop()
    if prepared.resumed:
        # No clock runs for a resumed run (it logs no run_start): its data opens first, so a data
        # position that does not fit is refused before any line goes to the log it continues.
        training = open_run(prepared)
        record = log_run_start(prepared)
        started = None  # no clock started here: the seconds count from the first step
    else:
        record = log_run_start(prepared)  # the clock starts: from here on the dataset is read
        started = time.time()  # opening the input (and --unverified_data's check) counts in the time
        # Rank 0 logs run_start; no rank may read before it, so every rank waits for rank 0 here.
        barrier()
        with aborted_on_error(prepared.eval, prepared.state):
            training = open_run(prepared)
    try:
        return train(training, record, started)
    finally:
        training.close()
        training.hooks.close()


@contextmanager
def aborted_on_error(ev: Evaluation, state: TrainState) -> Iterator[None]:
    """An error after run_start but before the run's hooks exist (its input opening, an eval-only
    run's eval) ends the MLPerf log with run_stop aborted; once they exist, `MLPerfLog.close` does.

    Only this rank's logger is written (no collective: the other ranks may be gone); the error
    goes on to `main`, which prints its one line and exits with its code.
    """
    try:
        yield
    except Exception:
        with contextlib.suppress(OSError):  # a log that cannot be written now must not hide why
            ev.logger.run_stop("aborted", epoch_num=state.samples)
        raise


def train(run: Run, record: dict, started: float | None = None) -> RunResult:
    """Trains until the target, a limit or a stop; checkpoints as configured.

    record: the run facts `log_run_start` gave when the clock started.
    started: time.time() at run_start, where the run's seconds count from (None: from now).
    """
    run.checkpoints.record = record
    state = run.state
    run.hooks.run_start(run_start_event(run))
    start = time.time() if started is None else started
    try:
        status = train_loop(run)
    except TrainingStopped as stopped:
        # Every rank stops at the same step (faults.Guard); the state is the last good one.
        path = run.writer.save(stopped.reason, stopped.data_state)
        run.eval.logger.event(stopped.reason, str(stopped), {"epoch_num": state.samples, "step": state.step})
        run.hooks.run_end(RunEnd("aborted", state.step, state.samples, time.time() - start, tuple(state.evals),
                                 stopped.reason))
        raise stopped.with_checkpoint(str(path)) from stopped
    if run.cfg.checkpoint.periodic:
        run.writer.save("final")
    seconds = time.time() - start
    run.hooks.run_end(RunEnd(status, state.step, state.samples, seconds, tuple(state.evals)))
    return RunResult(status, state.samples, state.evals[-1][1] if state.evals else math.nan, seconds)


def run_start_event(run: Run) -> RunStart:
    state = run.state
    return RunStart(state.samples, state.step, stop_samples(run.cfg), run.cfg.global_batch_size,
                    Path(run.cfg.run.output_dir), bool(run.resumed), run.eval.model,
                    run.cfg.schedule.max_steps * run.cfg.global_batch_size, run.data_check)


def log_run_start(run: Prepared | Run) -> dict:
    """run_start for a fresh run; the run facts a checkpoint keeps (run_start_ms, attempt).

    A resumed run logs `resumed_from_checkpoint` and no run_start: its clock did not start
    here, so its log can never pass the compliance checker as a timing result.
    """
    log, state = run.eval.logger, run.state
    if not run.resumed:
        init_seconds = log.init_seconds()
        log.run_start()
        log.event(INIT_SECONDS_KEY, round(init_seconds, 3))
        overrun = init_overrun(init_seconds, run.eval.cfg.run.submission_division)
        if overrun and run.eval.denv.is_main:
            print(f"warning: {overrun}", file=sys.stderr, flush=True)
        return {"run_start_ms": int(time.time() * 1000), "attempt": 1}
    resumed = run.resumed[0]
    log.release()
    record = {"run_start_ms": resumed.record.get("run_start_ms"), "attempt": int(resumed.record.get("attempt", 1)) + 1}
    log.event("resumed_from_checkpoint", str(resumed.path), {"epoch_num": state.samples, "step": state.step, **record})
    if run.eval.denv.is_main:
        print(f"resumed from {resumed.path} at step {state.step} ({state.samples} samples), attempt "
              f"{record['attempt']}: not an MLPerf timing result", file=sys.stderr, flush=True)
    return record


def evaluate_only(ev: Evaluation) -> RunResult:
    """Scores the init checkpoint once: how a user checks a converted checkpoint."""
    ev.logger.init_stop()
    ev.logger.run_start()
    start = time.time()
    with aborted_on_error(ev, TrainState()):
        accuracy = run_eval(ev, TrainState(), ev.hooks)
    status = "success" if accuracy >= ev.cfg.eval.target_mlm_accuracy else "aborted"
    ev.hooks.run_end(RunEnd(status, 0, 0, time.time() - start, ((0, accuracy),)))
    return RunResult(status, 0, accuracy, time.time() - start)
