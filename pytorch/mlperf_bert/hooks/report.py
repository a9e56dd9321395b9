"""The end of a run in words and pictures: summary.txt / summary.json and curves.png.

`RunReport` (a hook, rank 0) keeps the training loss every `loss_every` steps and every eval,
and at run_end prints the summary and writes it, with the loss and accuracy curves, next to
the MLPerf log. Every file is written to a temporary name and renamed, so a reader never sees
half a summary or half a PNG.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence, TextIO

from .events import EvalEnd, Hook, RunEnd, RunStart, StepEnd
from .forecast import predict
from ..runtime.files import atomic_file, write_text_atomic
from ..runtime.optional import describe_error, matplotlib_problem
from .live import TARGET_ACCURACY, TRAIN_LOG

SUMMARY_TXT = "summary.txt"
SUMMARY_JSON = "summary.json"
CURVES_PNG = "curves.png"


@dataclass(frozen=True)
class Summary:
    """What one run did. Samples are training sequences over all ranks."""

    status: str
    reason: str
    seconds: float
    steps: int
    samples: int
    start_samples: int  # > 0 for a resumed run
    evals: tuple[tuple[int, float], ...]  # (samples, accuracy)
    samples_per_second: float  # (samples - start_samples) / seconds, evals included
    target: float = TARGET_ACCURACY
    files: dict[str, str] = field(default_factory=dict)  # what -> path
    forecast: str = ""  # what the forecast said after the first evals (and, short of the target, after the last)
    data_check: str = ""  # what --unverified_data checked after run_start, inside `seconds` ("" when nothing)
    no_curves: str = ""  # why --curves png drew no picture ("" when it drew one, or was not asked to)

    def text(self) -> str:
        reason = f" ({self.reason})" if self.reason else ""
        lines = [f"status: {self.status}{reason}",
                 f"time to train: {self.seconds:.1f} s ({self.seconds / 60:.2f} min, run_start to run_stop)",
                 *([f"data check: {self.data_check}"] if self.data_check else []),
                 f"steps: {self.steps}, samples: {self.samples}"
                 + (f" (resumed at {self.start_samples})" if self.start_samples else ""),
                 f"throughput: {self.samples_per_second:.1f} samples/s (evals included)",
                 f"evals ({len(self.evals)}, target {self.target:.3f}):"]
        lines += [f"  {i}: samples {s} mlm_accuracy {a:.4f}" for i, (s, a) in enumerate(self.evals, 1)]
        lines += [f"forecast: {self.forecast}"] if self.forecast else []
        lines += [f"{what}: {path}" for what, path in self.files.items()]
        lines += [f"curves: none: {self.no_curves}"] if self.no_curves else []
        return "\n".join(lines) + "\n"


def write_summary(summary: Summary, output_dir: Path) -> None:
    """summary.txt and summary.json in `output_dir`."""
    write_text_atomic(output_dir / SUMMARY_TXT, summary.text(), fsync_file=False)
    write_text_atomic(output_dir / SUMMARY_JSON, json.dumps(asdict(summary), indent=2) + "\n", fsync_file=False)


EARLY_EVALS = 3  # the summary sets the forecast made after this many evals beside the real end


def forecast_text(evals: Sequence[tuple[int, float]], schedule_samples: int, target: float) -> str:
    """The forecast after the first evals and, for a run that stopped short of the target with
    more evals than that, the latest one; "" when there is nothing to forecast from."""
    if schedule_samples <= 0 or not evals:
        return ""
    early = predict(evals[:EARLY_EVALS], schedule_samples, target=target)
    if early.outside or len(evals) <= EARLY_EVALS or evals[-1][1] >= target:
        return early.line(target)
    return f"{early.line(target)}; now {predict(evals, schedule_samples, target=target).line(target)}"


CURVES_FIX = "use --curves none (CURVES=none): the run then draws no curves.png"


def curves_problem() -> str | None:
    """None when matplotlib imports; else the line that refuses --curves png at start-up, before the run it would
    otherwise end."""
    return matplotlib_problem("--curves png (the default)", CURVES_FIX)


class CurvesUnavailable(Exception):
    """matplotlib failed at the end of the run: the summary says so instead of a picture."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on training nodes
        import matplotlib.pyplot as plt
    except Exception as err:  # a broken install fails however its import code happens to
        raise CurvesUnavailable(f"matplotlib fails to import ({describe_error(err)}); {CURVES_FIX}") from err
    return plt


def _samples_scale(largest: float) -> tuple[float, str]:
    """Divide samples by this for the x axis, and the unit to name."""
    for scale, unit in ((1e6, "millions"), (1e3, "thousands")):
        if largest >= scale * (1 if scale == 1e6 else 10):
            return scale, unit
    return 1.0, ""


def plot_curves(losses: Sequence[tuple[int, float]], evals: Sequence[tuple[int, float]],
                path: Path, target: float = TARGET_ACCURACY, title: str = "") -> None:
    """Training loss (left axis) and eval accuracy with the target (right axis) against samples."""
    plt = _pyplot()
    largest = max([s for s, _ in losses] + [s for s, _ in evals] + [1])
    scale, unit = _samples_scale(largest)
    fig, loss_ax = plt.subplots(figsize=(9, 5))
    acc_ax = loss_ax.twinx()
    if losses:
        loss_ax.plot([s / scale for s, _ in losses], [v for _, v in losses], color="C0",
                     linewidth=1.2, label="training loss")
    if evals:
        acc_ax.plot([s / scale for s, _ in evals], [a for _, a in evals], color="C1", marker="o",
                    markersize=4, linewidth=1.5, label="eval masked-LM accuracy")
    acc_ax.axhline(target, color="C3", linestyle="--", linewidth=1.0, label=f"target {target:.3f}")
    acc_ax.set_ylim(0.0, 1.0)
    loss_ax.set_xlim(0, largest / scale * 1.02)
    loss_ax.set_xlabel(f"training samples ({unit})" if unit else "training samples")
    loss_ax.set_ylabel("training loss", color="C0")
    acc_ax.set_ylabel("eval masked-LM accuracy", color="C1")
    loss_ax.grid(True, alpha=0.3)
    handles = [h for ax in (loss_ax, acc_ax) for h in ax.get_legend_handles_labels()[0]]
    fig.legend(handles, [h.get_label() for h in handles], loc="lower center", ncol=3, fontsize=9,
               frameon=False)
    loss_ax.set_title(title or "training loss and eval accuracy")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    with atomic_file(path, "wb", fsync_file=False) as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


class RunReport(Hook):
    """Summary and curves of a run (rank 0).

    loss_every: steps between loss reads (each waits for the device; match the live view's
    interval so both read the same steps). log_dir: where the MLPerf log is, and so where
    curves.png goes (default: the run's output dir). stream: where the summary is printed.
    curves: draw curves.png (the trainer's --curves png); off, the summary names no picture.
    """

    def __init__(self, loss_every: int = 10, log_dir: Path | None = None, mlperf_log: Path | None = None,
                 stream: TextIO | None = None, target: float = TARGET_ACCURACY, curves: bool = True) -> None:
        self.loss_every = loss_every
        self.curves = curves
        self.log_dir = log_dir
        self.mlperf_log = mlperf_log
        self.stream = stream if stream is not None else sys.stderr
        self.target = target
        self.losses: list[tuple[int, float]] = []
        self.latest: tuple[int, float] | None = None  # (samples, loss) of the guard's latest read
        self.evals: list[tuple[int, float]] = []
        self.output_dir = Path(".")
        self.start_samples = 0
        self.schedule_samples = 0
        self.data_check = ""
        self.summary: Summary | None = None

    def run_start(self, event: RunStart) -> None:
        self.output_dir = event.output_dir
        self.start_samples = event.samples
        self.schedule_samples = event.schedule_samples
        self.data_check = event.data_check
        self.log_dir = self.log_dir or (self.mlperf_log.parent if self.mlperf_log else event.output_dir)

    def step_end(self, event: StepEnd) -> None:
        # Losses the guard read with its agreement, kept at the progress lines' steps: no read here.
        if event.verdict.loss is not None:
            self.latest = (event.samples, event.verdict.loss)
        due = event.step % self.loss_every == 0 or event.samples >= event.next_eval_samples
        if due and self.latest is not None and (not self.losses or self.losses[-1] != self.latest):
            self.losses.append(self.latest)

    def eval_end(self, event: EvalEnd) -> None:
        self.evals.append((event.samples, event.accuracy))

    def run_end(self, event: RunEnd) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        curves = (self.log_dir or self.output_dir) / CURVES_PNG if self.curves else None
        no_curves = ""
        if curves is not None:
            try:
                plot_curves(self.losses, self.evals, curves, self.target,
                            f"{event.status}: {event.samples} samples in {event.seconds:.0f} s")
            except CurvesUnavailable as err:  # the run is over: its summary is still written
                curves, no_curves = None, str(err)
        self.summary = replace(self._summary(event, curves), no_curves=no_curves)
        write_summary(self.summary, self.output_dir)
        print(self.summary.text(), end="", file=self.stream, flush=True)

    def _summary(self, event: RunEnd, curves: Path | None) -> Summary:
        trained = event.samples - self.start_samples
        files = {"summary": str(self.output_dir / SUMMARY_TXT), **({"curves": str(curves)} if curves else {})}
        for what, path in (("progress log", self.output_dir / TRAIN_LOG), ("MLPerf log", self.mlperf_log)):
            if path is not None and path.is_file():
                files[what] = str(path)
        evals = tuple(self.evals) or tuple(event.evals)
        every_eval = event.evals if len(event.evals) > len(self.evals) else evals  # a resumed run's too
        return Summary(event.status, event.reason, event.seconds, event.step, event.samples,
                       self.start_samples, evals, trained / event.seconds if event.seconds > 0 else 0.0,
                       self.target, files, forecast_text(every_eval, self.schedule_samples, self.target),
                       self.data_check)
