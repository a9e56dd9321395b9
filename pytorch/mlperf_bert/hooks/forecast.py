"""When will a BERT run reach the target? A forecast from its first evals.

Published BERT phase-2 curves are not a line in any simple axis: accuracy creeps from the
phase-1 checkpoint's 0.34 to about 0.40, rises fast to about 0.70, then takes more than half
of the run to creep from 0.70 to 0.720. Extrapolating a run's own first evals therefore says
little about its end. What does say much is where the learning rate reaches its end: the
schedule's length in samples (opt_learning_rate_training_steps x global batch size) explains
most of the spread between systems, and the latest eval's progress says whether this run is
early or late against its schedule. So, for a run with k evals and no eval at the target yet:

    log(samples to converge) = a_k + b_k * log(schedule samples) + c_k * logit(progress_k)
    progress_k = (accuracy_k - 0.34) / (target - 0.34), clipped to [0.005, 0.995]

with one row (a_k, b_k, c_k) per k, fitted by least squares on the published runs that had
not converged by their k-th eval (the prior: pooled over every system, so a run of a new
system borrows the others' shape). The interval is the 10th..90th percentile of the fit's
residuals, so it aims to hold 80% of runs; `benchmarks/forecast_backtest.py` refits the rows
with one system left out at a time and measures how often its runs land inside
(docs/PERFORMANCE.md). The end can only be at an eval, so no bound is before the next one.
Wall time follows from the seconds per sample between the first and the latest eval (evals
included): the run's own pace, not a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

TARGET_ACCURACY = 0.720
START_ACCURACY = 0.34  # the phase-1 checkpoint's masked-LM accuracy before any phase-2 step
PROGRESS_CLIP = 0.995  # logit(progress) stays finite at and beyond the ends
INTERVAL = (0.10, 0.90)  # residual quantiles: an 80% interval

# Fitted on 405 converged runs of 41 systems, MLPerf Training v2.0, v3.1, v4.0, v4.1 and v5.0
# (benchmarks/data/forecast_logs.tar.gz). The rows below are what `python benchmarks/forecast_backtest.py
# --rows` prints for these runs; tests/trainer/hooks/test_forecast.py refits them from the same logs.
SCHEDULE_RANGE = (2_358_400.0, 8_704_000.0)  # schedule samples of the runs fitted on
SCHEDULE_MARGIN = 1.25  # how far past that range the fit is still used


@dataclass(frozen=True)
class Row:
    """The fit for runs with `evals` evals so far; residuals are in log samples."""

    evals: int
    intercept: float
    schedule: float  # per log(schedule samples)
    progress: float  # per logit(progress of the latest eval)
    low: float  # 10th percentile of the residuals
    high: float  # 90th percentile
    runs: int  # runs fitted on


ROWS: tuple[Row, ...] = (  # Row(evals, intercept, schedule, progress, low, high, runs)
    Row(1, 8.342933, 0.3931198, -0.2377062, -0.1289806, 0.1125339, 405),
    Row(2, 8.793835, 0.392252, -0.06426459, -0.1206993, 0.09447066, 405),
    Row(3, 9.52513, 0.3483064, -0.06064265, -0.1172018, 0.0976427, 405),
    Row(4, 10.22323, 0.307397, -0.0566136, -0.1106632, 0.09326098, 405),
    Row(5, 10.72354, 0.2801823, -0.06207301, -0.1296121, 0.09631825, 405),
    Row(6, 10.66222, 0.2901489, -0.07456992, -0.1391587, 0.10129, 405),
    Row(7, 10.45387, 0.3091483, -0.08732032, -0.1218355, 0.09866045, 405),
    Row(8, 10.44105, 0.3157085, -0.1025435, -0.1080877, 0.1009516, 405),
    Row(9, 11.77049, 0.2507143, -0.1832639, -0.08037138, 0.09314568, 395),
    Row(10, 12.84973, 0.2039948, -0.2598944, -0.0669606, 0.08582177, 393),
    Row(11, 13.0276, 0.1995998, -0.2702179, -0.07190389, 0.07609536, 386),
    Row(12, 13.24558, 0.1879954, -0.2655788, -0.0784555, 0.0690745, 385),
)


@dataclass(frozen=True)
class Observed:
    """One finished run, as the fit sees it."""

    schedule_samples: float
    evals: tuple[tuple[float, float], ...]  # (samples, accuracy)
    samples_to_converge: float


@dataclass(frozen=True)
class Forecast:
    """Samples (and seconds after run_start) at which the run reaches the target, with an 80%
    interval. `reached`: an eval is at the target already (then all three are the first such eval's samples,
    and `evals` counts the evals up to it).
    `outside`: why the published runs cannot speak for this one (then there are no numbers)."""

    evals: int
    samples: float
    low: float
    high: float
    reached: bool
    seconds: tuple[float, float, float] | None = None  # (forecast, low, high) after run_start
    outside: str = ""

    def line(self, target: float = TARGET_ACCURACY) -> str:
        """One line, e.g. `0.720 at 2.51M samples (80%: 2.21M-2.86M), 1:02:03 after run_start
        (0:55:00-1:10:00), from 3 evals`; `none (why)` without numbers."""
        if self.outside:
            return f"none ({self.outside})"
        if self.reached:
            return f"{target:.3f} reached at {samples_text(self.samples)} samples"
        text = (f"{target:.3f} at {samples_text(self.samples)} samples "
                f"(80%: {samples_text(self.low)}-{samples_text(self.high)})")
        if self.seconds is not None:
            mid, low, high = self.seconds
            text += f", {duration(mid)} after run_start ({duration(low)}-{duration(high)})"
        return text + f", from {self.evals} eval{'s' if self.evals > 1 else ''}"


def samples_text(samples: float) -> str:
    return f"{samples / 1e6:.2f}M" if samples >= 1e6 else f"{samples:,.0f}"


def duration(seconds: float) -> str:
    """h:mm:ss, or "?" for a time that is not a finite number >= 0 (no rate to extrapolate from yet)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def progress_logit(accuracy: float, target: float = TARGET_ACCURACY) -> float:
    """logit of the way from the checkpoint's accuracy to the target, clipped."""
    progress = (accuracy - START_ACCURACY) / (target - START_ACCURACY)
    progress = min(max(progress, 1.0 - PROGRESS_CLIP), PROGRESS_CLIP)
    return math.log(progress / (1.0 - progress))


def features(evals: Sequence[tuple[float, float]], schedule_samples: float,
             target: float = TARGET_ACCURACY) -> list[float]:
    return [1.0, math.log(schedule_samples), progress_logit(evals[-1][1], target)]


def row_for(evals: int, rows: Sequence[Row]) -> Row:
    """The row of this many evals; past the last row, the last row (the latest eval still counts)."""
    return rows[min(evals, len(rows)) - 1]


def fit(runs: Sequence[Observed], max_evals: int = 12, target: float = TARGET_ACCURACY) -> tuple[Row, ...]:
    """One row per eval count 1..max_evals, each fitted on the runs still short of the target then."""
    rows = []
    for k in range(1, max_evals + 1):
        pending = [run for run in runs if len(run.evals) > k and run.evals[k - 1][1] < target]
        if len(pending) < 4:
            raise ValueError(f"only {len(pending)} runs had not converged by eval {k}: too few to fit")
        x = np.array([features(run.evals[:k], run.schedule_samples, target) for run in pending])
        y = np.log([run.samples_to_converge for run in pending])
        intercept, schedule, progress = (float(c) for c in np.linalg.lstsq(x, y, rcond=None)[0])
        low, high = np.quantile(y - x @ np.array([intercept, schedule, progress]), INTERVAL)
        rows.append(Row(k, intercept, schedule, progress, float(low), float(high), len(pending)))
    return tuple(rows)


def _pace(evals: Sequence[tuple[float, float]], eval_seconds: Sequence[float]) -> float:
    """Seconds per sample: between the first and the latest eval, or from run_start with one."""
    if len(evals) >= 2 and evals[-1][0] > evals[0][0]:
        return (eval_seconds[-1] - eval_seconds[0]) / (evals[-1][0] - evals[0][0])
    return eval_seconds[-1] / evals[-1][0]


def outside_reason(schedule_samples: float) -> str:
    """Why the fit does not apply to this schedule length ("" when it does: within the fitted
    range, give or take a quarter)."""
    low, high = SCHEDULE_RANGE
    if low / SCHEDULE_MARGIN <= schedule_samples <= high * SCHEDULE_MARGIN:
        return ""
    return (f"the LR schedule spans {samples_text(schedule_samples)} samples, outside the "
            f"{samples_text(low)}-{samples_text(high)} of the published runs the model is fitted on")


def predict(evals: Sequence[tuple[float, float]], schedule_samples: float,
            eval_seconds: Sequence[float] | None = None, target: float = TARGET_ACCURACY,
            rows: Sequence[Row] | None = None) -> Forecast:
    """The forecast after these evals ((samples, accuracy), in order; seconds after run_start
    of each when known). schedule_samples: LR schedule steps x global batch size."""
    if not evals:
        raise ValueError("a forecast needs at least one eval")
    if schedule_samples <= 0:
        raise ValueError(f"schedule samples must be > 0, got {schedule_samples}")
    if eval_seconds is not None and len(eval_seconds) != len(evals):
        raise ValueError(f"{len(eval_seconds)} eval times for {len(evals)} evals")
    # An eval before the first step (0 samples) tells neither the progress nor the pace.
    trained = [i for i, (samples, _) in enumerate(evals) if samples > 0]
    if not trained:
        return Forecast(0, math.nan, math.nan, math.nan, False, None, "no eval after the first training step yet")
    evals = [evals[i] for i in trained]
    eval_seconds = None if eval_seconds is None else [eval_seconds[i] for i in trained]
    # The run converged at its first eval at or past the target; a log that goes on past it (no run_stop yet, or
    # a run told to continue) does not move that point, whatever its later evals read.
    reached = next((i for i, (_, accuracy) in enumerate(evals) if accuracy >= target), None)
    if reached is not None:
        at = evals[reached][0]
        now = None if eval_seconds is None else (eval_seconds[reached],) * 3
        return Forecast(reached + 1, at, at, at, True, now)
    last_samples = evals[-1][0]
    outside = outside_reason(schedule_samples)
    if outside:
        return Forecast(len(evals), math.nan, math.nan, math.nan, False, None, outside)
    row = row_for(len(evals), rows or ROWS)
    x = features(evals, schedule_samples, target)
    centre = row.intercept + row.schedule * x[1] + row.progress * x[2]
    # the target is met at an eval, and the next one is one interval on
    next_eval = last_samples + (last_samples - evals[-2][0] if len(evals) >= 2 else last_samples)
    samples, low, high = (max(next_eval, math.exp(centre + shift)) for shift in (0.0, row.low, row.high))
    seconds = None
    if eval_seconds is not None:
        pace = _pace(evals, eval_seconds)
        mid, first, last = (eval_seconds[-1] + (s - last_samples) * pace for s in (samples, low, high))
        seconds = (mid, first, last)
    return Forecast(len(evals), samples, low, high, False, seconds)

