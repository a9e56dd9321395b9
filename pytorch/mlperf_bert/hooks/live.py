"""The live view of a run on rank 0: a progress bar on a terminal, plain lines elsewhere.

Towards the next eval the view shows samples/s and tokens/s over training steps only: the rate
window restarts at run_start (so a resumed run does not divide its restored samples by the new
process's seconds) and after every eval (so the eval's seconds never count as training time).
Every `log_every` steps and at every eval one plain line goes to `OUTPUT_DIR/train.log`
(flushed at once, so `tail -f` follows the run); on a terminal the bar redraws in place, and
where stderr is a file (SLURM, docker logs) the same plain lines go there instead of redraws.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, TextIO

from tqdm import tqdm

from .events import BlockEnd, EvalEnd, Hook, RunEnd, RunStart, StepEnd
from .forecast import TARGET_ACCURACY, duration, predict

TRAIN_LOG = "train.log"
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} seq [{elapsed}{postfix}]"


def progress_line_due(event: StepEnd, log_every: int) -> bool:
    """A progress line after this step: every `log_every` steps and at the last step before an
    eval. The same on every rank (the trainer's per-rank load gather follows it)."""
    return event.step % log_every == 0 or event.samples >= event.next_eval_samples


class RateWindow:
    """Samples and tokens per second since the window's start (restarted at run start and evals)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.restart(0)

    def restart(self, samples: int) -> None:
        self.start_time = self.clock()
        self.start_samples = samples
        self.tokens = 0

    def rates(self, samples: int) -> tuple[float, float]:
        """(samples/s, tokens/s); (nan, nan) until time and samples have passed."""
        seconds = self.clock() - self.start_time
        trained = samples - self.start_samples
        if seconds <= 0 or trained <= 0:
            return float("nan"), float("nan")
        return trained / seconds, self.tokens / seconds


class LiveView(Hook):
    """Progress bar / progress lines of rank 0, mirrored to OUTPUT_DIR/train.log.

    log_every: steps between progress lines. The loss shown is the one the guard read with its
        latest agreement (every step, or once per --sync_every window): the view never reads the device.
    world_size: ranks training; tokens/s counts rank 0's real tokens times this (ranks get
    equal shares of the batch). stream: where the bar or the plain lines go. interactive: bar
    redraws (True) or plain lines (False); None decides by whether `stream` is a terminal.
    fields: more `name value` text for each progress line, asked for when the line is written
    (the trainer's per-rank token load).
    """

    def __init__(self, log_every: int = 10, world_size: int = 1, stream: TextIO | None = None,
                 interactive: bool | None = None, target: float = TARGET_ACCURACY,
                 clock: Callable[[], float] = time.perf_counter,
                 fields: Callable[[], str] | None = None) -> None:
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        self.log_every = log_every
        self.world_size = world_size
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self.target = target
        self.fields = fields
        self.window = RateWindow(clock)
        self.evals: list[tuple[int, float]] = []
        self.eval_seconds: list[float] = []  # after run_start, for the forecast's pace
        self.loss: float | None = None  # the latest loss the guard read with its agreement
        self.stop_samples = 0
        self.schedule_samples = 0
        self.started = 0.0
        self.resumed = False
        self.log_path: Path | None = None
        self._log: TextIO | None = None
        self._bar: tqdm | None = None

    def run_start(self, event: RunStart) -> None:
        self.stop_samples = event.stop_samples
        self.schedule_samples = event.schedule_samples
        self.resumed = event.resumed
        self.window.restart(event.samples)
        self.started = self.window.start_time
        event.output_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = event.output_dir / TRAIN_LOG
        self._log = self.log_path.open("a", buffering=1)
        verb = "resumed at" if event.resumed else "started at"
        self._line(f"run {verb} step {event.step} samples {event.samples}; sample limit "
                   f"{event.stop_samples}, global batch {event.global_batch_size}")
        if self.interactive:
            # tqdm's own rate and ETA would count evals and restored samples: the postfix has ours.
            self._bar = tqdm(total=event.stop_samples, initial=event.samples, unit="seq", file=self.stream,
                             dynamic_ncols=True, bar_format=BAR_FORMAT)

    def step_end(self, event: StepEnd) -> None:
        self.window.tokens += event.tokens * self.world_size
        if event.verdict.loss is not None:
            self.loss = event.verdict.loss
        if not progress_line_due(event, self.log_every):
            return
        line = self.progress_line(event)
        self._write_log(line)
        if self._bar is None:
            self._echo(line)
            return
        self._bar.n = event.samples
        self._bar.set_postfix_str(self._postfix(event), refresh=False)
        self._bar.refresh()

    def block_end(self, event: BlockEnd) -> None:
        # The eval starts now: its seconds must not enter the next rate window.
        self.window.restart(event.samples)

    def eval_end(self, event: EvalEnd) -> None:
        self.evals.append((event.samples, event.accuracy))
        self.eval_seconds.append(self.window.clock() - self.started)
        self._line(self.eval_line(event))
        forecast = self.forecast_line()
        if forecast:
            self._line(forecast)
        self.window.restart(event.samples)

    def run_end(self, event: RunEnd) -> None:
        self._close_bar()
        reason = f" ({event.reason})" if event.reason else ""
        self._line(f"run_stop status {event.status}{reason} step {event.step} samples "
                   f"{event.samples} seconds {event.seconds:.1f}")

    def close(self) -> None:
        self._close_bar()
        if self._log is not None:
            self._log.close()
            self._log = None

    def progress_line(self, event: StepEnd) -> str:
        """One plain progress line (what train.log and non-terminal streams get)."""
        samples_s, tokens_s = self.window.rates(event.samples)
        eta = (event.next_eval_samples - event.samples) / samples_s
        extra = f" {self.fields()}" if self.fields else ""
        return (f"step {event.step} samples {event.samples}/{self.stop_samples} "
                f"samples/s {samples_s:.1f} tokens/s {tokens_s:.0f} loss {self._loss(4)} "
                f"lr {event.learning_rate:.3e} skipped {event.skipped_steps} next_eval {event.next_eval_samples} "
                f"eta_eval {duration(eta)}{extra} {self.history()}")

    def eval_line(self, event: EvalEnd) -> str:
        return (f"eval {len(self.evals)} step {event.step} samples {event.samples} mlm_accuracy "
                f"{event.accuracy:.4f} ({self.percent_of_target(event.accuracy):.1f}% of target "
                f"{self.target:.3f}) mlm_loss {event.loss:.4f} eval_seconds {event.seconds:.1f}")

    def forecast_line(self) -> str:
        """When the run reaches the target, from the evals so far (`hooks.forecast`). None for a
        resumed run, whose earlier evals this view never saw, without the schedule's length, or
        for a schedule the published runs do not cover (the summary says why)."""
        if self.resumed or self.schedule_samples <= 0 or not self.evals:
            return ""
        forecast = predict(self.evals, self.schedule_samples, self.eval_seconds, self.target)
        return "" if forecast.outside else f"forecast: {forecast.line(self.target)}"

    def percent_of_target(self, accuracy: float) -> float:
        return 100.0 * accuracy / self.target

    def history(self) -> str:
        """The eval accuracies so far, e.g. `evals 0.412,0.655 (91.0% of target)`."""
        if not self.evals:
            return "evals none"
        accuracies = ",".join(f"{acc:.3f}" for _, acc in self.evals)
        return f"evals {accuracies} ({self.percent_of_target(self.evals[-1][1]):.1f}% of target)"

    def _postfix(self, event: StepEnd) -> str:
        samples_s, tokens_s = self.window.rates(event.samples)
        eta = (event.next_eval_samples - event.samples) / samples_s
        skipped = f" skipped {event.skipped_steps}" if event.skipped_steps else ""  # fp16 overflows, when any
        return (f"{samples_s:.1f} seq/s {tokens_s:.0f} tok/s loss {self._loss(3)} "
                f"lr {event.learning_rate:.2e}{skipped} eval in {duration(eta)} {self.history()}")

    def _loss(self, digits: int) -> str:
        """The latest loss read with the guard's agreement (none yet: `-`); never a read of its own."""
        return "-" if self.loss is None else f"{self.loss:.{digits}f}"

    def _line(self, line: str) -> None:
        """A line for the console and train.log (bar-safe on a terminal)."""
        self._write_log(line)
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            self._echo(line)

    def _echo(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def _write_log(self, line: str) -> None:
        if self._log is not None:
            self._log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
