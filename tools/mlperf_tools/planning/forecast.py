"""When will this run reach 0.720, and will its samples to converge pass the RCP check?

    python tools/forecast.py MLPERF_LOG [--evals K] [--ruleset 5.0.0]

Reads a BERT run's MLPerf log, finished or still being written, and prints the forecast from
its evals (the model and its fit: `mlperf_bert.hooks.forecast`): the samples and the wall time
after run_start at which it reaches the target, with an 80% interval, and where those samples
fall against the RCP window of its global batch size (training_rules.adoc §13, the window the
official RCP checker applies: `scoring.rcp_window`). --evals K forecasts from the first K evals
only, as the run would have been forecast then (a finished log then shows the real end too).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from mlperf_tools.results.compare import RunLog, is_run_log, read_run
from mlperf_tools.results.scoring import RcpWindow, ScoringError, rcp_window

from mlperf_bert.hooks.forecast import TARGET_ACCURACY, Forecast, predict, samples_text

INSIDE, BELOW, UNCERTAIN, NO_WINDOW = "inside", "below", "uncertain", "no window"


class ForecastError(Exception):
    """Input the forecast cannot use; the message names it and the fix."""


@dataclass(frozen=True)
class RcpOutlook:
    """Where the forecast samples fall against the smallest olympic mean the RCP checker accepts."""

    status: str  # INSIDE (even the interval's low end passes), BELOW (even its high end fails), UNCERTAIN, NO_WINDOW
    window: RcpWindow

    def line(self, forecast: Forecast) -> str:
        where = self.window.describe()
        if self.status == NO_WINDOW:
            return f"RCP: {where}"
        bound = samples_text(self.window.min_mean or 0.0)
        verdict = {
            INSIDE: f"inside the window: the interval's low end {samples_text(forecast.low)} is at or above the "
                    f"minimum acceptable olympic mean {bound}",
            BELOW: f"below the window: the interval's high end {samples_text(forecast.high)} is under the minimum "
                   f"acceptable olympic mean {bound}; a result of such runs fails the RCP check",
            UNCERTAIN: f"uncertain: the interval {samples_text(forecast.low)}-{samples_text(forecast.high)} holds the "
                       f"minimum acceptable olympic mean {bound}",
        }[self.status]
        # §13 judges the olympic mean of a result's runs; one run only hints at it.
        return f"RCP: {verdict} (the check is on the olympic mean of all runs). {where}"


def rcp_outlook(forecast: Forecast, window: RcpWindow) -> RcpOutlook:
    bound = window.min_mean
    if bound is None or forecast.outside:
        return RcpOutlook(NO_WINDOW, window)
    if forecast.low >= bound:
        return RcpOutlook(INSIDE, window)
    if forecast.high < bound:
        return RcpOutlook(BELOW, window)
    return RcpOutlook(UNCERTAIN, window)


def _positive(run: RunLog, key: str) -> float:
    value = run.values.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ForecastError(f"{run.path}: no positive {key} in the log (found {value!r}); the forecast needs the "
                            "global batch size and the LR schedule's length (opt_learning_rate_training_steps)")
    return float(value)


def schedule_samples(run: RunLog) -> float:
    """Samples until the LR schedule ends: opt_learning_rate_training_steps x global batch size."""
    return _positive(run, "opt_learning_rate_training_steps") * _positive(run, "global_batch_size")


def eval_seconds(run: RunLog) -> list[float] | None:
    """Seconds after run_start of each eval; None when the log cannot say."""
    if run.run_start_ms is None or len(run.eval_ms) != len(run.evals):
        return None
    return [(ms - run.run_start_ms) / 1000.0 for ms in run.eval_ms]


def truncated(evals: Sequence[tuple[float, float]], seconds: Sequence[float] | None,
              count: int | None) -> tuple[list[tuple[float, float]], list[float] | None]:
    if count is None:
        return list(evals), None if seconds is None else list(seconds)
    return list(evals[:count]), None if seconds is None else list(seconds[:count])


def forecast_run(run: RunLog, count: int | None = None, target: float = TARGET_ACCURACY) -> Forecast:
    """The forecast from the run's first `count` evals (all when None)."""
    if not run.evals:
        raise ForecastError(f"{run.path}: no eval_accuracy line yet; forecast after the first eval")
    if count is not None and count > len(run.evals):
        raise ForecastError(f"--evals {count}: {run.path} has only {len(run.evals)} evals")
    evals, seconds = truncated(run.evals, eval_seconds(run), count)
    return predict(evals, schedule_samples(run), seconds, target)


def read_log(path: Path) -> RunLog:
    if not path.is_file():
        raise ForecastError(f"{path}: no such file (pass the run's MLPerf log, e.g. results/.../result_0.txt)")
    if not is_run_log(path):
        raise ForecastError(f"{path}: not an MLPerf run log (no `:::MLLOG` submission_benchmark line)")
    return read_run(path)


def real_end(run: RunLog) -> str:
    """What the log says happened, for a forecast replayed from its first evals."""
    if run.converged and run.samples_to_converge is not None and run.minutes is not None:
        return f"real end: {samples_text(run.samples_to_converge)} samples, {run.minutes:.1f} min after run_start"
    return f"real end: status {run.status or 'still running'} after {samples_text(run.evals[-1][0])} samples"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=Path, help="the run's MLPerf log")
    parser.add_argument("--evals", type=int, default=None, help="forecast from the first K evals only")
    parser.add_argument("--ruleset", default="5.0.0", help="training ruleset whose RCPs to use (default 5.0.0)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.evals is not None and args.evals < 1:
            raise ForecastError(f"--evals {args.evals}: give 1 or more evals to forecast from")
        run = read_log(args.log)
        forecast = forecast_run(run, args.evals)
        window = rcp_window(int(_positive(run, "global_batch_size")), args.ruleset)
    except (ForecastError, ScoringError) as err:
        print(f"forecast.py: {err}", file=sys.stderr)
        return 2
    print(f"{args.log}: forecast: {forecast.line()}")
    print(rcp_outlook(forecast, window).line(forecast))
    if args.evals is not None and args.evals < len(run.evals):
        print(real_end(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
