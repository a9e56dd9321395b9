"""The trainer's hooks (`hooks.Hook`): the per-rank load, the MLPerf log, periodic checkpoints, preemption.

Each is a small class with its own state, called by the loop at fixed events; the loop itself
neither prints, nor logs results, nor decides on checkpoints. `CheckpointWriter` is what the
checkpoint hook and the loop's stop path share: one collective that writes the run's state.
Rank 0's progress view and end-of-run report are `live.LiveView` and `report.RunReport`.
"""

from __future__ import annotations

import contextlib

import signal
import sys
from pathlib import Path

from ..input.device_input import DeviceInput
from ..train.faults import Preempted
from .events import BlockEnd, EvalEnd, Hook, RunEnd, RunStart, StepEnd
from .live import progress_line_due
from .mllog import MLPerfLogger
from ..input.sources import TokenImbalance
from ..train.checkpoint import Checkpointer, TrainingParts, checkpoint_path
from ..train.state import TrainState


class CheckpointWriter:
    """Writes the run's checkpoint: weights, optimizer, scaler, progress, data position, config."""

    def __init__(self, checkpointer: Checkpointer, parts: TrainingParts, state: TrainState, data: DeviceInput,
                 logger: MLPerfLogger, config: dict) -> None:
        self.checkpointer, self.parts, self.state, self.data = checkpointer, parts, state, data
        self.logger, self.config = logger, config

    def save(self, reason: str, data_state: dict | None = None) -> Path:
        """Collective: every rank calls it at the same step; rank 0 writes the file and logs it.

        data_state: the data position to record instead of the input's (after a roll-back).
        """
        state = self.state
        if self.checkpointer.is_saved(state.state_dict()):
            return checkpoint_path(self.checkpointer.directory, state.samples)
        position = self.data.state_dict() if data_state is None else data_state
        path = self.checkpointer.save(self.parts, state.state_dict(), position, reason, self.config)
        self.logger.event("checkpoint_saved", str(path), {"epoch_num": state.samples, "step": state.step,
                                                          "reason": reason})
        return path


class PeriodicCheckpoints(Hook):
    """--checkpoint_every_samples / --checkpoint_every_minutes (the latter as agreed by every rank)."""

    def __init__(self, writer: CheckpointWriter, global_batch_size: int) -> None:
        self.writer, self.global_batch_size = writer, global_batch_size

    def step_end(self, event: StepEnd) -> None:
        by_samples = self.writer.checkpointer.samples_due(event.samples - self.global_batch_size, event.samples)
        if event.verdict.checkpoint_due or by_samples:
            self.writer.save("periodic")


class Preemption(Hook):
    """Stops every rank after the step at which they agreed a SIGTERM / SIGUSR1 arrived."""

    def step_end(self, event: StepEnd) -> None:
        if event.verdict.stop:
            raise Preempted(f"{signal.Signals(event.verdict.stop_signal).name} arrived; every rank stopped after "
                            f"step {event.step} ({event.samples} samples)")


class MLPerfLog(Hook):
    """Eval results and the end of the run in the MLPerf log (the loop logs block and eval boundaries).

    A run that started and then fails without a run_end (a problem only the run itself can find,
    such as a bad value in a shard it reads, or a crash) still ends its log: `close`, which the
    trainer calls on every way out, logs run_stop with status aborted at the samples trained.
    """

    def __init__(self, logger: MLPerfLogger, eval_samples: int) -> None:
        self.logger, self.eval_samples = logger, eval_samples
        self.samples: int | None = None  # samples trained once the run started; None before run_start
        self.ended = False

    def run_start(self, event: RunStart) -> None:
        self.samples = event.samples

    def step_end(self, event: StepEnd) -> None:
        self.samples = event.samples

    def eval_end(self, event: EvalEnd) -> None:
        self.logger.eval_accuracy(event.accuracy, epoch_num=event.samples)
        self.logger.event("eval_loss", event.loss, {"epoch_num": event.samples})
        self.logger.event("skipped_steps", event.skipped_steps, {"epoch_num": event.samples})

    def run_end(self, event: RunEnd) -> None:
        self.ended = True
        self.logger.run_stop(event.status, epoch_num=event.samples)
        self.logger.train_samples(event.samples)
        self.logger.eval_samples(self.eval_samples)

    def close(self) -> None:
        if self.samples is not None and not self.ended:
            self.ended = True
            # The run is already failing: a log that cannot be written now must not hide why.
            with contextlib.suppress(OSError):
                self.logger.run_stop("aborted", epoch_num=self.samples)


class RankLoad(Hook):
    """The real tokens of the most and the least loaded rank in each micro-batch (every rank).

    `DeviceInput.token_imbalance` is a collective, so every rank gathers at the same steps:
    where rank 0's live view writes a progress line (`live.progress_line_due`) and at each
    block's end. The means since the previous progress line are `progress_fields`, for that
    line; the means over each eval interval go to the MLPerf log (`tracked_stats`
    {max_rank_tokens, min_rank_tokens} at the interval's last step).
    """

    def __init__(self, data: DeviceInput, logger: MLPerfLogger, log_freq: int) -> None:
        self.data, self.logger, self.log_freq = data, logger, log_freq
        self.window = TokenImbalance.empty()  # micro-batches since the last progress line
        self.interval = TokenImbalance.empty()  # micro-batches since the last eval
        self.last_window = TokenImbalance.empty()  # the window that ended at the last progress line

    def _gather_loads(self) -> None:
        loads = self.data.token_imbalance()
        self.window, self.interval = self.window + loads, self.interval + loads

    def step_end(self, event: StepEnd) -> None:
        if progress_line_due(event, self.log_freq):
            self._gather_loads()
            self.last_window, self.window = self.window, TokenImbalance.empty()

    def block_end(self, event: BlockEnd) -> None:
        """Collective, every rank after the last step before an eval: logs the interval's load."""
        self._gather_loads()
        if self.interval.micro_batches:
            self.logger.tracked_stats({"max_rank_tokens": self.interval.mean_max(),
                                       "min_rank_tokens": self.interval.mean_min()}, step=event.step)
        self.interval = TokenImbalance.empty()

    def progress_fields(self) -> str:
        """The load for the progress line written at this step."""
        return f"rank_tokens max {self.last_window.mean_max():.0f} min {self.last_window.mean_min():.0f}"


class EvalLine(Hook):
    """The eval result as one line on stderr (rank 0): the output of a run without --do_train."""

    def __init__(self, is_main: bool) -> None:
        self.is_main = is_main

    def eval_end(self, event: EvalEnd) -> None:
        if self.is_main:
            print(f"eval samples {event.samples} mlm_accuracy {event.accuracy:.4f} mlm_loss {event.loss:.4f}",
                  file=sys.stderr, flush=True)
