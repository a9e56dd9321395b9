"""Stopping a run on purpose: preemption signals, numeric blow-ups, and the exit codes.

Exit codes of `run_pretraining.py` (docs/FAULTS.md has the user's view):
   0  the run ended: target reached (`success`) or its sample / step limit (`aborted`)
   1  an unexpected error (a traceback)
   2  bad input (flag, shard, checkpoint); the message names it
   3  numeric blow-up: a non-finite loss (fp32/bf16) or too many fp16 overflow skips in a row;
      a checkpoint of the last good state was written
  74  a write failed (full disk, read-only folder): one line names the file (`outputs.py`)
  75  preempted (EX_TEMPFAIL, "try again"): SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) arrived, a
      checkpoint was written; rerun with `--resume_from_checkpoint auto`
 130  a second SIGINT (Ctrl-C) before the first one's checkpoint: stopped at once, no checkpoint
  76  a rank was lost (EX_PROTOCOL): another process died or stopped answering (`liveness.py`),
      or this rank's launcher died (`runtime/orphan.py`)

Agreement. A decision that changes what the ranks do next (stop for a signal, stop for a
non-finite loss, write a time-based checkpoint) must be taken at the same step by every rank,
or the next collective waits forever: a signal may reach the ranks at different moments, a NaN
may appear in one rank's micro-batch only, and only rank 0's clock decides when a checkpoint is
due. A `Guard` takes that agreement and returns it as a `Verdict`; there are two:

- `StepGuard` (the default, `--sync_every 1`): once per step, after the backward and before
  the optimizer step, every rank contributes its local flags (non-finite loss, stop signal,
  checkpoint due, a clipping hook's non-finite gradient norm) and one all-reduce (max) of a
  small tensor gives all of them the same verdict, so a NaN update never happens.
- `sync_window.SyncWindow` (`--sync_every N > 1`, and every CUDA-graphed step, whose update is
  inside the graph): the update comes first, the loss only sets a device flag, and every N
  steps the ranks agree once; a non-finite loss rolls the run back to the last good read.
  Under fp16 the device loss scaler skips overflowing steps itself, and the window's read
  brings its counts (`Verdict.loss_scale`) so the trainer can uncount the skipped steps.

Cost of the per-step check. On the CPU (gloo) the all-reduce is a few microseconds. On GPUs it
is one tiny NCCL all-reduce plus one device-to-host read per step: the host waits for the
step's backward before it queues the optimizer kernels, so the GPU idles for about one
optimizer launch (tens of microseconds against steps of hundreds of milliseconds for
BERT-large; fp16 pays this read already, since the loss scaler reads its overflow flag every
step). Where that idle time matters (CUDA graphs, small steps), the sync window removes it at
the price of a copy of the training state every N steps.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable, Protocol, Union

import torch
import torch.distributed as dist

from ..optim.loss_scale import LossScaleReading
from ..runtime.exits import EXIT_DIVERGED, EXIT_PREEMPTED


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
SignalHandler = Union[Callable[[int, Union[FrameType, None]], Any], int, signal.Handlers, None]


class TrainingStopped(Exception):
    """The loop stopped on purpose at a step every rank agreed on; a checkpoint is due."""

    exit_code = 1
    reason = "stopped"  # the checkpoint's reason and the MLPerf log event's key suffix

    def __init__(self, message: str, data_state: dict | None = None, checkpoint: str | None = None) -> None:
        super().__init__(message)
        self.data_state = data_state  # the data position to checkpoint, when not the current one
        self.checkpoint = checkpoint  # the checkpoint written for this stop

    def with_checkpoint(self, path: str) -> "TrainingStopped":
        """The same stop, once its checkpoint is written at `path`."""
        return type(self)(str(self), self.data_state, path)


class Preempted(TrainingStopped):
    exit_code = EXIT_PREEMPTED
    reason = "preempted"


class NumericBlowUp(TrainingStopped):
    exit_code = EXIT_DIVERGED
    reason = "numeric_blowup"


class StopRequest:
    """Remembers SIGTERM / SIGUSR1 (SLURM's warning before the time limit, or preemption) and SIGINT.

    The handler only records the signal; the loop finishes its step and stops (`StepGuard`).
    Ctrl-C is such a stop too; a second Ctrl-C raises KeyboardInterrupt at once (a user who
    presses it twice does not want to wait for the step, e.g. while the data is still loading).
    Use as a context manager: the previous handlers come back on exit. Outside the main
    thread nothing is installed (Python allows handlers only there) and `requested` stays False.
    """

    def __init__(self) -> None:
        self.signal_number = 0  # 0: no stop signal (yet)
        self._previous: dict[int, SignalHandler] = {}

    @property
    def requested(self) -> bool:
        return self.signal_number != 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.signal_number == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_number = signum

    def install(self) -> "StopRequest":
        """Installs the handlers (main thread only); `__exit__` or nothing restores the old ones."""
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __enter__(self) -> "StopRequest":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


@dataclass(frozen=True)
class Position:
    """The run's progress (`TrainState.state_dict`) and data position at one step."""

    train_state: dict
    data_state: dict


@dataclass(frozen=True)
class Verdict:
    """What every rank does after this step (the same on all of them)."""

    nonfinite_loss: bool = False  # some rank's loss is NaN/inf: do not apply the update
    nonfinite_gradient: bool = False  # some rank's clipping hook saw an inf/nan norm: skip the update
    stop_signal: int = 0  # a stop signal some rank got (the highest number): finish the step, checkpoint, exit 75
    checkpoint_due: bool = False  # rank 0's clock says a time-based checkpoint is due
    rolled_back_to: Position | None = None  # a sync window undid its steps back to this point
    loss: float | None = None  # this rank's loss at the agreed step, read with the agreement (no read of its own)
    loss_scale: LossScaleReading | None = None  # the device loss scaler's counts since the last read (a window's)

    @property
    def stop(self) -> bool:
        return self.stop_signal != 0


@dataclass(frozen=True)
class StepFacts:
    """What a guard hears after each step."""

    verdict: Verdict  # its own verdict from before the update (`check_loss`)
    applied: bool  # whether the update was applied (False: fp16 overflow skip)
    step: int  # optimizer steps applied so far
    samples: int
    read_now: bool  # an eval or a checkpoint follows: a sync window must agree now
    position: Callable[[], Position]  # where the run is (taken only when a window keeps it)
    uncount: Callable[[int], None] = lambda skipped: None  # turns n applied steps into skipped ones
    # (a window, when its read finds steps the device loss scaler skipped)


class Guard(Protocol):
    """The agreement of every rank on what follows a step (module docstring).

    `check_loss` comes inside the step, right after the backward, with the loss and the rank's
    non-finite-gradient flag from the clipping hooks (`clipping.ClipHandle.local_nonfinite`,
    None without hooks): it returns the verdict that decides whether the update is applied (a
    `StepGuard`), or folds both into a device flag and returns an empty verdict (a window; the
    update is not held back). `after_step` comes
    after the step: the verdict the run acts on (stop, checkpoint, roll-back). Both are
    collectives: every rank calls them at every step.
    """

    def check_loss(self, loss: torch.Tensor, nonfinite_gradient: torch.Tensor | None = None) -> Verdict: ...

    def after_step(self, facts: StepFacts) -> Verdict: ...


def never() -> bool:
    return False


class StepGuard:
    """The per-step agreement (module docstring) and the count of fp16 skips in a row.

    loss_checked: test the loss for NaN/inf (fp32/bf16; under fp16 the loss scaler skips such
    steps itself). max_consecutive_skips: overflow-skipped steps in a row that end the run.
    stop: this rank's stop signals; checkpoint_due: rank 0's clock for time-based checkpoints.
    """

    def __init__(self, device: torch.device, loss_checked: bool, max_consecutive_skips: int,
                 stop: StopRequest | None = None, checkpoint_due: Callable[[], bool] = never) -> None:
        self.device = device
        self.loss_checked = loss_checked
        self.max_consecutive_skips = max_consecutive_skips
        self.stop = stop if stop is not None else StopRequest()
        self.checkpoint_due = checkpoint_due
        self.consecutive_skips = 0
        # The latest step's loss (a device scalar): read together with the next agreement, so
        # progress lines cost no device read of their own.
        self.last_loss: torch.Tensor | None = None

    def check_loss(self, loss: torch.Tensor, nonfinite_gradient: torch.Tensor | None = None) -> Verdict:
        """Collective (every rank, every step, before the update): the agreed verdict."""
        self.last_loss = loss.detach()
        nonfinite = ~torch.isfinite(self.last_loss.float()) if self.loss_checked else None
        return self.agree(nonfinite, nonfinite_gradient)

    def agree(self, nonfinite: torch.Tensor | None, nonfinite_gradient: torch.Tensor | None = None,
              counters: torch.Tensor | None = None) -> Verdict:
        """Collective: the verdict from this rank's device flags, in one host read.

        nonfinite: "a loss was not finite" (None: unchecked); nonfinite_gradient: a clipping
        hook's flag (None: no hook); counters: `DeviceLossScaler.counters()`, read in the same
        transfer (None: no device scaler).
        """
        # Filled in place (no host-to-device copy, which would wait for the backward a second time).
        flags = torch.zeros(4, device=self.device)  # nonfinite loss, nonfinite gradient, stop signal, checkpoint due
        for index, flag in ((0, nonfinite), (1, nonfinite_gradient)):
            if flag is not None:
                flags[index] = flag.float()
        if self.stop.signal_number:
            flags[2] = float(self.stop.signal_number)
        if self.checkpoint_due():
            flags[3] = 1.0
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        loss = [] if self.last_loss is None else [self.last_loss.float().reshape(1)]
        scaler = [] if counters is None else [counters.float()]
        values = torch.cat([flags, *loss, *scaler]).tolist()  # one read; signal numbers are exact
        bad, bad_gradient, signum, due = values[:4]
        read_loss = values[4] if loss else None
        reading = LossScaleReading.from_values(values[-4:]) if scaler else None
        return Verdict(bad > 0, bad_gradient > 0, int(signum), due > 0, loss=read_loss, loss_scale=reading)

    def after_step(self, facts: StepFacts) -> Verdict:
        """The verdict taken before the update; raises NumericBlowUp after too many fp16 skips in a row."""
        self.consecutive_skips = 0 if facts.applied else self.consecutive_skips + 1
        if self.consecutive_skips >= self.max_consecutive_skips:
            raise too_many_skips(self.consecutive_skips, facts.step, facts.samples)
        return facts.verdict


def too_many_skips(skips: int, step: int, samples: int) -> NumericBlowUp:
    return NumericBlowUp(
        f"{skips} optimizer steps in a row were skipped for fp16 overflow (after step {step}, {samples} "
        "samples): the loss scale cannot recover. Lower the learning rate, check the data, or train in bf16"
    )


def nonfinite_loss_error(step: int, samples: int) -> NumericBlowUp:
    return NumericBlowUp(
        f"the training loss is not finite (NaN or inf) on at least one rank in step {step + 1} "
        f"(samples up to {samples}); its update was not applied. Lower the learning rate or check the "
        "data, then resume from the checkpoint (its data position is past the offending batch)"
    )


def rolled_back_error(last_step: int, position: Position) -> NumericBlowUp:
    """A sync window found a non-finite loss after `last_step` and rolled back to `position`."""
    state = position.train_state
    return NumericBlowUp(
        f"the training loss was not finite (NaN or inf) on at least one rank between steps {state['step'] + 1} "
        f"and {last_step}; weights, optimizer and data position are rolled back to step {state['step']} "
        f"({state['samples']} samples). Lower the learning rate or check the data, then resume from the "
        "checkpoint, or rerun with --sync_every 1 to stop at the first such step",
        data_state=position.data_state,
    )
