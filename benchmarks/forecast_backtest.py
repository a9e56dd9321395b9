"""Backtest of the run forecast (`mlperf_bert.hooks.forecast`) on published MLPerf BERT logs.

    PYTHONPATH=pytorch:tools python benchmarks/forecast_backtest.py [--logs DIR_OR_ARCHIVE] [--evals 2 3]
    PYTHONPATH=pytorch:tools python benchmarks/forecast_backtest.py --rows

Each system is left out in turn: the rows are fitted on the other systems' runs only, then
each of its runs is cut to its first K evals and forecast, and the forecast is set against the
run's real end (the samples of the eval that reached 0.720, and run_start -> run_stop). For each
K it prints the share of runs whose real end falls inside the 80% interval and the absolute
error (median and 90th percentile), for samples and for wall time, next to a plain
extrapolation of accuracy against log(samples) through the same K evals. Runs that reached the
target within K evals or never reached it are left out (nothing to forecast / no real end).
--rows prints the rows fitted on every run, as the module's ROWS holds them.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from mlperf_tools.results.compare import RunLog, read_run, resolve_input
from mlperf_tools.planning.forecast import eval_seconds, schedule_samples

from mlperf_bert.hooks.forecast import TARGET_ACCURACY, Observed, Row, fit, predict

LOGS = Path(__file__).resolve().parent / "data" / "forecast_logs.tar.gz"


@dataclass(frozen=True)
class Published:
    system: str  # round/org/system, e.g. v3.1/Dell/XE9680x8H100-SXM-80GB
    run: RunLog
    observed: Observed


@dataclass(frozen=True)
class Outcome:
    """One run forecast from its first K evals, against its real end."""

    system: str
    real_samples: float
    real_seconds: float
    samples: tuple[float, float, float]  # forecast, low, high
    seconds: tuple[float, float, float]
    naive: float | None  # log-linear extrapolation; None where it never reaches the target

    @property
    def covered(self) -> bool:
        return self.samples[1] <= self.real_samples <= self.samples[2]

    @property
    def time_covered(self) -> bool:
        return self.seconds[1] <= self.real_seconds <= self.seconds[2]


def load(folder: Path) -> tuple[list[Published], int]:
    """The converged runs under folder (ORG/results/<system>/bert/result_*.txt at any depth),
    and how many runs did not converge."""
    published, skipped = [], 0
    for path in sorted(folder.rglob("result_*.txt")):
        run = read_run(path)
        if not run.converged or run.samples_to_converge is None:
            skipped += 1
            continue
        system = "/".join(part for part in path.parent.parent.relative_to(folder).parts if part != "results")
        observed = Observed(schedule_samples(run), run.evals, run.samples_to_converge)
        published.append(Published(system, run, observed))
    return published, skipped


def naive_samples(evals: Sequence[tuple[float, float]], target: float = TARGET_ACCURACY) -> float | None:
    """Where the least-squares line of accuracy against log(samples) through the evals meets the target."""
    if len(evals) < 2:
        return None
    slope, intercept = np.polyfit(np.log([s for s, _ in evals]), [a for _, a in evals], 1)
    return math.exp((target - intercept) / slope) if slope > 0 else None


def backtest(published: Sequence[Published], k: int) -> list[Outcome]:
    """Leave one system out, fit on the rest, forecast its runs from their first k evals."""
    outcomes = []
    by_system: dict[str, list[Published]] = defaultdict(list)
    for item in published:
        by_system[item.system].append(item)
    for system, held_out in sorted(by_system.items()):
        rows = fit([p.observed for p in published if p.system != system], max_evals=k)
        for item in held_out:
            run = item.run
            if len(run.evals) <= k or run.evals[k - 1][1] >= TARGET_ACCURACY:
                continue
            seconds = eval_seconds(run)
            assert seconds is not None and run.minutes is not None, run.path
            forecast = predict(run.evals[:k], item.observed.schedule_samples, seconds[:k], rows=rows)
            assert forecast.seconds is not None
            outcomes.append(Outcome(system, item.observed.samples_to_converge, run.minutes * 60.0,
                                    (forecast.samples, forecast.low, forecast.high), forecast.seconds,
                                    naive_samples(run.evals[:k])))
    return outcomes


def _percent(error: float) -> str:
    """An error as a percentage, or as a factor once it is 10x or more."""
    return f"{error + 1:.0f}x" if error >= 9 else f"{100 * error:.1f}%"


def _errors(predicted: Sequence[float], real: Sequence[float]) -> str:
    errors = np.abs(np.array(predicted) / np.array(real) - 1.0)
    return f"{_percent(float(np.median(errors)))} / {_percent(float(np.quantile(errors, 0.9)))}"


def table(results: dict[int, list[Outcome]]) -> str:
    lines = ["| evals | runs (systems) | samples inside 80% interval | samples error, median / p90 | "
             "time inside 80% interval | time error, median / p90 | log-linear extrapolation: reaches "
             "0.720 / error median / p90 |",
             "|---|---|---|---|---|---|---|"]
    for k, outcomes in results.items():
        systems = len({o.system for o in outcomes})
        naive = [o for o in outcomes if o.naive is not None]
        naive_cell = (f"{len(naive)}/{len(outcomes)} / "
                      + _errors([o.naive for o in naive if o.naive is not None], [o.real_samples for o in naive])
                      if naive else "n/a (one eval)")
        lines.append(
            f"| {k} | {len(outcomes)} ({systems}) | {np.mean([o.covered for o in outcomes]):.1%} | "
            f"{_errors([o.samples[0] for o in outcomes], [o.real_samples for o in outcomes])} | "
            f"{np.mean([o.time_covered for o in outcomes]):.1%} | "
            f"{_errors([o.seconds[0] for o in outcomes], [o.real_seconds for o in outcomes])} | {naive_cell} |")
    return "\n".join(lines)


def worst_systems(outcomes: Sequence[Outcome], count: int = 3) -> str:
    """The systems whose runs the interval missed most often."""
    missed: dict[str, list[bool]] = defaultdict(list)
    for o in outcomes:
        missed[o.system].append(not o.covered)
    ranked = sorted(missed.items(), key=lambda item: -float(np.mean(item[1])))[:count]
    return ", ".join(f"{system} {sum(m)}/{len(m)}" for system, m in ranked)


def rows_source(rows: Sequence[Row]) -> str:
    """The rows as Python source, 7 significant digits (the test refits them to that precision)."""
    body = "\n".join(f"    Row({r.evals}, {r.intercept:.7g}, {r.schedule:.7g}, {r.progress:.7g}, {r.low:.7g}, "
                     f"{r.high:.7g}, {r.runs})," for r in rows)
    return "ROWS: tuple[Row, ...] = (  # Row(evals, intercept, schedule, progress, low, high, runs)\n" + body + "\n)"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logs", type=Path, default=LOGS, help=f"folder or archive of logs (default {LOGS})")
    parser.add_argument("--evals", type=int, nargs="+", default=[1, 2, 3, 4, 6], help="K: evals to forecast from")
    parser.add_argument("--rows", action="store_true", help="print the rows fitted on every run and stop")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with ExitStack() as stack:
        published, skipped = load(resolve_input(args.logs, stack))
    systems = len({p.system for p in published})
    if args.rows:
        print(f"# fitted on {len(published)} converged runs of {systems} systems")
        print(rows_source(fit([p.observed for p in published])))
        return 0
    print(f"{len(published)} converged runs of {systems} systems ({skipped} runs that did not converge left out)\n")
    results = {k: backtest(published, k) for k in args.evals}
    print(table(results))
    for k, outcomes in results.items():
        print(f"\nK={k}: intervals missed most often: {worst_systems(outcomes)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
