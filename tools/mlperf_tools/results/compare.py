"""Side-by-side report of MLPerf BERT result folders (ours or any vendor's published logs).

Each DIR is one of
  * an MLPerf package: ORG/results/<system>/bert/result_*.txt (+ ORG/systems/<system>.json),
  * one system folder of such a package: <system>/bert/result_*.txt,
  * a plain folder of run logs (any file with `:::MLLOG` lines, e.g. run_with_docker.sh's LOGDIR),
  * a .tar.gz / .tgz / .tar archive of any of these (unpacked into a temporary folder, removed
    when the report is written).

Per system the report gives the global batch size, the number of runs (and how many converged),
the olympic time to train (mean of the run times without the fastest and the slowest; a run that
did not converge counts as infinitely slow, as in the official scoring), the samples to converge
(mean, spread), the mean eval-accuracy curve and the training throughput per accelerator
(samples between run_start and run_stop / seconds / accelerators) where the accelerator count is
known (system description, a `:::SYSJSON` line, or logged number_of_nodes / accelerators_per_node).

  python tools/compare.py ../shared/data/mlperf_logs/v2.0/NVIDIA results/ --out compare_out

writes compare_out/report.md, compare_out/accuracy.png and compare_out/time_to_train.png and
prints the Markdown to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import tarfile
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from mlperf_bert.runtime.files import json_object
from mlperf_bert.runtime.optional import matplotlib_problem

MLLOG_TOKEN = ":::MLLOG "
SYSJSON_TOKEN = ":::SYSJSON "
TARGET_ACCURACY = 0.720  # masked-LM accuracy that ends a BERT run


@dataclass(frozen=True)
class RunLog:
    """What one MLPerf run log says. Times are epoch milliseconds, samples are sequences."""

    path: Path
    values: Mapping[str, Any]  # first value of every POINT_IN_TIME key (global_batch_size, seed, ...)
    run_start_ms: int | None
    run_stop_ms: int | None
    status: str | None  # run_stop metadata status: "success" or "aborted"
    evals: tuple[tuple[float, float], ...]  # (samples seen, eval accuracy), in log order
    samples_reconstructed: bool  # True when the log's epoch_num is not a sample count (see below)
    sysjson: Mapping[str, Any] | None  # system description printed by the launcher, if any
    init_start_ms: int | None = None
    eval_ms: tuple[int, ...] = ()  # when each eval's accuracy was logged, epoch milliseconds

    @property
    def init_seconds(self) -> float | None:
        """init_start -> run_start: the untimed initialization (training_rules.adoc §11 bounds it)."""
        if self.init_start_ms is None or self.run_start_ms is None:
            return None
        return (self.run_start_ms - self.init_start_ms) / 1000.0

    @property
    def converged(self) -> bool:
        return self.status == "success" and self.run_start_ms is not None and self.run_stop_ms is not None

    @property
    def minutes(self) -> float | None:
        """run_start -> run_stop in minutes (the MLPerf score of one run)."""
        if self.run_start_ms is None or self.run_stop_ms is None:
            return None
        return (self.run_stop_ms - self.run_start_ms) / 60_000.0

    @property
    def samples_to_converge(self) -> float | None:
        """Samples at the last eval before a successful run_stop (the RCP checker's definition:
        its epoch_num, or train_samples for logs whose epoch_num is not a sample count)."""
        if not self.converged or not self.evals:
            return None
        return self.trained_samples if self.samples_reconstructed else self.evals[-1][0]

    @property
    def trained_samples(self) -> float | None:
        """Samples trained between run_start and run_stop: train_samples, else the last eval's epoch_num."""
        logged = self.values.get("train_samples")
        if isinstance(logged, (int, float)) and logged > 0:
            return float(logged)
        return self.evals[-1][0] if self.evals else None


@dataclass(frozen=True)
class SystemResults:
    """The runs of one system, with its MLPerf system description when the folder has one."""

    label: str
    runs: tuple[RunLog, ...]
    description: Mapping[str, Any] | None


@dataclass(frozen=True)
class SystemSummary:
    """The numbers of one report row. Samples in sequences, times in minutes."""

    label: str
    division: str
    accelerators: int | None
    global_batch_size: str
    runs: int
    converged: int
    olympic_minutes: float | None
    samples_mean: float | None
    samples_std: float | None
    samples_min: float | None
    samples_max: float | None
    samples_per_s_per_accelerator: float | None
    curve: tuple[tuple[float, float], ...]  # mean (samples, accuracy) per eval index over runs


def _json_after(line: str, token: str) -> dict[str, Any] | None:
    """The JSON object after `token` on a line (launchers may prefix lines), or None."""
    at = line.find(token)
    if at < 0:
        return None
    try:
        record = json.loads(line[at + len(token):])
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def _eval_samples(metadata: Mapping[str, Any]) -> float | None:
    samples = metadata.get("epoch_num", metadata.get("samples_count"))
    return float(samples) if isinstance(samples, (int, float)) else None


def eval_interval(global_batch_size: int) -> int:
    """Samples between BERT evals: floor_to_multiple(0.05 * (230.23 * GBS + 3,000,000), 25,000)."""
    return int(0.05 * (230.23 * global_batch_size + 3_000_000) // 25_000) * 25_000


def samples_axis(epoch_nums: Sequence[float], global_batch_size: Any) -> tuple[list[float], bool]:
    """Samples seen at each eval, and whether they had to be reconstructed.

    Most BERT logs put the sample count in eval_accuracy's epoch_num. Some (Samsung and Baidu
    v2.0) log epoch_num = 1 at every eval; their evals then sit where the benchmark's eval
    interval puts them: eval k after the first step with k * interval samples or more, i.e. at
    ceil(k * interval / GBS) * GBS samples (this reproduces their logged train_samples exactly).
    """
    increasing = all(b > a for a, b in zip(epoch_nums, epoch_nums[1:]))
    if not epoch_nums or (increasing and epoch_nums[-1] > 1):
        return list(epoch_nums), False
    if not isinstance(global_batch_size, int) or global_batch_size <= 0:
        return list(epoch_nums), False
    interval = eval_interval(global_batch_size)
    steps = [math.ceil(k * interval / global_batch_size) for k in range(1, len(epoch_nums) + 1)]
    return [float(step * global_batch_size) for step in steps], True


@dataclass
class _LogReader:
    """Accumulates the MLPerf records of one log, line by line."""

    values: dict[str, Any] = field(default_factory=dict)
    times: dict[str, int] = field(default_factory=dict)  # init_start / run_start / run_stop, epoch ms
    evals: list[tuple[float, float]] = field(default_factory=list)  # (epoch_num, accuracy)
    eval_ms: list[int] = field(default_factory=list)  # time_ms of each of `evals`
    status: str | None = None
    sysjson: dict[str, Any] | None = None

    def add(self, record: Mapping[str, Any]) -> None:
        key, metadata = str(record.get("key")), record.get("metadata") or {}
        if key == "eval_accuracy":
            samples = _eval_samples(metadata)
            if samples is not None and isinstance(record.get("value"), (int, float)):
                self.evals.append((samples, float(record["value"])))
                self.eval_ms.append(int(record.get("time_ms", 0)))
        elif key in ("init_start", "run_start", "run_stop"):
            self.times.setdefault(key, int(record["time_ms"]))
            if key == "run_stop":
                self.status = metadata.get("status", self.status)
        elif record.get("event_type") == "POINT_IN_TIME":
            self.values.setdefault(key, record.get("value"))

    def result(self, path: Path) -> RunLog:
        epoch_nums = [s for s, _ in self.evals]
        samples, reconstructed = samples_axis(epoch_nums, self.values.get("global_batch_size"))
        points = tuple(zip(samples, (acc for _, acc in self.evals)))
        return RunLog(path, self.values, self.times.get("run_start"), self.times.get("run_stop"),
                      self.status, points, reconstructed, self.sysjson, self.times.get("init_start"),
                      tuple(self.eval_ms))


def read_run(path: Path) -> RunLog:
    """Parse one log file; lines without `:::MLLOG` / `:::SYSJSON` are ignored."""
    reader = _LogReader()
    with path.open(encoding="latin-1") as lines:
        for line in lines:
            if reader.sysjson is None and SYSJSON_TOKEN in line:
                reader.sysjson = _json_after(line, SYSJSON_TOKEN)
            record = _json_after(line, MLLOG_TOKEN) if MLLOG_TOKEN in line else None
            if record is not None:
                reader.add(record)
    return reader.result(path)


def is_run_log(path: Path) -> bool:
    """A run log names its benchmark (`submission_benchmark`); checker outputs and notes do not."""
    if not path.is_file():
        return False
    with path.open(encoding="latin-1") as lines:
        return any(MLLOG_TOKEN in line and '"submission_benchmark"' in line for line in lines)


def natural_key(path: Path) -> list[Any]:
    """Sort key that puts run_2 before run_10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def _load_json(path: Path) -> dict[str, Any] | None:
    """A system's description, None where there is none; one line for one that is not a JSON object."""
    if not path.is_file():
        return None
    try:
        return json_object(path)
    except (OSError, ValueError) as err:
        raise SystemExit(f"compare.py: {err}: a system description is a JSON object (MLPerf's systems/*.json)") from err


def _package_systems(package: Path) -> list[SystemResults]:
    systems = []
    for system_dir in sorted(p for p in (package / "results").iterdir() if p.is_dir()):
        files = sorted((system_dir / "bert").glob("result_*.txt"), key=natural_key)
        if files:
            description = _load_json(package / "systems" / f"{system_dir.name}.json")
            runs = tuple(read_run(f) for f in files)
            systems.append(SystemResults(f"{package.name}/{system_dir.name}", runs, description))
    return systems


ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")


def unpack(archive: Path, stack: ExitStack) -> Path:
    """Unpack an archive into a temporary folder that `stack` removes; the folder it holds
    (Samsung.tar.gz holds Samsung/), or the temporary folder when it holds several."""
    scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="compare_")))
    try:
        with tarfile.open(archive) as opened:
            opened.extractall(scratch, filter="data")
    except (tarfile.TarError, OSError) as err:
        raise SystemExit(f"compare.py: cannot unpack {archive}: {err}") from err
    entries = list(scratch.iterdir())
    return entries[0] if len(entries) == 1 and entries[0].is_dir() else scratch


def resolve_input(path: Path, stack: ExitStack) -> Path:
    """The folder to read for one DIR argument (an archive is unpacked first)."""
    if path.is_file() and path.name.endswith(ARCHIVE_SUFFIXES):
        return unpack(path, stack)
    return path


def discover(folder: Path) -> list[SystemResults]:
    """All systems under one DIR argument (see the module docstring for the accepted layouts)."""
    if not folder.is_dir():
        raise SystemExit(f"compare.py: {folder} is not a directory")
    if (folder / "results").is_dir():
        systems = _package_systems(folder)
    elif (folder / "bert").is_dir():
        files = sorted((folder / "bert").glob("result_*.txt"), key=natural_key)
        description = _load_json(folder.parent.parent / "systems" / f"{folder.name}.json")
        systems = [SystemResults(folder.name, tuple(read_run(f) for f in files), description)]
    else:
        files = sorted((f for f in folder.iterdir() if is_run_log(f)), key=natural_key)
        systems = [SystemResults(folder.name, tuple(read_run(f) for f in files), None)]
    systems = [s for s in systems if s.runs]
    if not systems:
        raise SystemExit(
            f"compare.py: no MLPerf BERT logs in {folder}: expected ORG/results/<system>/bert/"
            "result_*.txt or a folder of log files with :::MLLOG lines")
    return systems


def _count_from(description: Mapping[str, Any] | None) -> int | None:
    """number_of_nodes x accelerators_per_node of a system description (strings in MLPerf files)."""
    if not description:
        return None
    try:
        return int(description["number_of_nodes"]) * int(description["accelerators_per_node"])
    except (KeyError, TypeError, ValueError):
        return None


def accelerator_count(system: SystemResults) -> int | None:
    """Accelerators of a system: system description, else :::SYSJSON, else logged node/GPU counts."""
    first = system.runs[0]
    logged = {k: first.values.get(k) for k in ("number_of_nodes", "accelerators_per_node")}
    for source in (system.description, first.sysjson, logged):
        count = _count_from(source)
        if count:
            return count
    return None


def olympic_mean(minutes: Sequence[float]) -> float | None:
    """Mean without the fastest and the slowest run (all runs when fewer than 3).

    A run that did not converge is passed as +inf: it is dropped as the slowest, and a second one
    makes the score undefined (None), as in the official result summarizer.
    """
    ordered = sorted(minutes)
    kept = ordered[1:-1] if len(ordered) >= 3 else ordered
    if not kept or any(math.isinf(m) for m in kept):
        return None
    return sum(kept) / len(kept)


def mean_curve(runs: Iterable[RunLog]) -> tuple[tuple[float, float], ...]:
    """Mean (samples, accuracy) of the k-th eval over the runs that reached it."""
    by_index: dict[int, list[tuple[float, float]]] = {}
    for run in runs:
        for k, point in enumerate(run.evals):
            by_index.setdefault(k, []).append(point)
    return tuple((statistics.fmean(s for s, _ in points), statistics.fmean(a for _, a in points))
                 for _, points in sorted(by_index.items()))


def _throughput(system: SystemResults, accelerators: int | None) -> float | None:
    """Mean over converged runs of trained samples / seconds / accelerators."""
    if not accelerators:
        return None
    rates = [run.trained_samples / (run.minutes * 60.0) / accelerators for run in system.runs
             if run.converged and run.trained_samples and run.minutes]
    return statistics.fmean(rates) if rates else None


def _division(system: SystemResults) -> str:
    if system.description and system.description.get("division"):
        return str(system.description["division"])
    return str(system.runs[0].values.get("submission_division", "?"))


def _batch_sizes(system: SystemResults) -> str:
    sizes = sorted({str(run.values.get("global_batch_size", "?")) for run in system.runs})
    return "/".join(sizes)


def summarize(system: SystemResults) -> SystemSummary:
    """The report row of one system."""
    accelerators = accelerator_count(system)
    minutes = [run.minutes if run.converged and run.minutes is not None else math.inf for run in system.runs]
    samples = [run.samples_to_converge for run in system.runs if run.samples_to_converge is not None]
    spread = statistics.stdev(samples) if len(samples) > 1 else None
    return SystemSummary(
        label=system.label,
        division=_division(system),
        accelerators=accelerators,
        global_batch_size=_batch_sizes(system),
        runs=len(system.runs),
        converged=sum(run.converged for run in system.runs),
        olympic_minutes=olympic_mean(minutes),
        samples_mean=statistics.fmean(samples) if samples else None,
        samples_std=spread,
        samples_min=min(samples) if samples else None,
        samples_max=max(samples) if samples else None,
        samples_per_s_per_accelerator=_throughput(system, accelerators),
        curve=mean_curve(system.runs),
    )


def _fmt(value: float | None, pattern: str) -> str:
    return "n/a" if value is None else pattern.format(value)


def count_text(samples: float) -> str:
    """3.123M for full runs, 12.3k or 960 for small ones (so a CPU run is not 0.000M)."""
    if samples >= 1e6:
        return f"{samples / 1e6:.3f}M"
    return f"{samples / 1e3:.1f}k" if samples >= 1e4 else f"{samples:.0f}"


def _samples_cell(row: SystemSummary) -> str:
    if row.samples_mean is None:
        return "n/a"
    spread = f" ± {count_text(row.samples_std)}" if row.samples_std is not None else ""
    low, high = row.samples_min, row.samples_max  # set with the mean, from the same samples
    assert low is not None and high is not None
    return f"{count_text(row.samples_mean)}{spread} ({count_text(low)}–{count_text(high)})"


def markdown_table(rows: Sequence[SystemSummary]) -> str:
    """The comparison table, one row per system."""
    header = ("| system | division | accelerators | global batch | runs (converged) "
              "| time to train, olympic (min) | samples to converge: mean ± std (min–max) "
              "| samples/s per accelerator |")
    lines = [header, "|" + "---|" * 8]
    for row in rows:
        lines.append(
            f"| {row.label} | {row.division} | {_fmt(row.accelerators, '{:d}')} "
            f"| {row.global_batch_size} | {row.runs} ({row.converged}) "
            f"| {_fmt(row.olympic_minutes, '{:.3f}')} | {_samples_cell(row)} "
            f"| {_fmt(row.samples_per_s_per_accelerator, '{:.1f}')} |")
    return "\n".join(lines)


def markdown_curves(rows: Sequence[SystemSummary]) -> str:
    """Mean eval-accuracy curve per system as `accuracy @ samples` points."""
    lines = ["Mean eval accuracy (over the runs that reached each eval), `accuracy @ samples`:", ""]
    for row in rows:
        points = ", ".join(f"{acc:.4f} @ {count_text(samples)}" for samples, acc in row.curve)
        lines.append(f"- **{row.label}**: {points}")
    return "\n".join(lines)


def markdown_report(rows: Sequence[SystemSummary], images: Sequence[str]) -> str:
    parts = ["# MLPerf BERT results", "", markdown_table(rows), "", markdown_curves(rows)]
    parts += ["", *[f"![{Path(name).stem}]({name})" for name in images]]
    return "\n".join(parts) + "\n"


def plots_problem() -> str | None:
    """None when matplotlib draws; else the line that refuses --out's plots before the logs are read: not
    installed, or installed but failing to import, each said as such."""
    return matplotlib_problem("compare.py --out (its PNG plots)", "pass --no-plots", "matplotlib.pyplot")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def samples_scale(largest: float) -> tuple[float, str]:
    """Divisor and unit for a samples axis: millions for full runs, plain counts for CPU runs."""
    for scale, unit in ((1e6, "millions"), (1e3, "thousands")):
        if largest >= scale * (1 if scale == 1e6 else 10):
            return scale, f" ({unit})"
    return 1.0, ""


def _largest_samples(systems: Sequence[SystemResults]) -> float:
    return max((s for system in systems for run in system.runs for s, _ in run.evals), default=1.0)


def _draw_curves(ax: Any, systems: Sequence[SystemResults], rows: Sequence[SystemSummary]) -> None:
    largest = _largest_samples(systems)
    scale, unit = samples_scale(largest)
    for index, (system, row) in enumerate(zip(systems, rows)):
        color = f"C{index % 10}"
        for run in system.runs:
            xs = [s / scale for s, _ in run.evals]
            ax.plot(xs, [a for _, a in run.evals], color=color, alpha=0.25, linewidth=0.8)
        ax.plot([s / scale for s, _ in row.curve], [a for _, a in row.curve], color=color,
                linewidth=2.0, marker="o", markersize=3, label=f"{row.label} ({row.runs} runs)")
    ax.axhline(TARGET_ACCURACY, color="black", linestyle="--", linewidth=1.0, label="target 0.720")
    ax.set_xlim(0, largest / scale * 1.03)
    ax.set_xlabel(f"training samples{unit}")
    ax.set_ylabel("masked-LM eval accuracy")
    ax.grid(True, alpha=0.3)


def _zoom_limits(rows: Sequence[SystemSummary]) -> tuple[float, float]:
    """0.69-0.73 around the target, widened down to the last evals of runs that end below it."""
    last = [row.curve[-1][1] for row in rows if row.curve]
    low = min([0.69, *(a - 0.01 for a in last)])
    return max(low, 0.0), 0.73


def plot_accuracy(systems: Sequence[SystemResults], rows: Sequence[SystemSummary], path: Path) -> None:
    """Eval accuracy vs samples: thin lines per run, thick line = mean; right panel zooms on the target."""
    plt = _pyplot()
    legend_rows = math.ceil((len(rows) + 1) / 2)
    fig, (full, zoom) = plt.subplots(1, 2, figsize=(14, 5.5 + 0.3 * legend_rows))
    _draw_curves(full, systems, rows)
    _draw_curves(zoom, systems, rows)
    full.set_title("eval accuracy vs training samples (thin: runs, thick: mean)")
    zoom.set_title("near the target")
    zoom.set_ylim(*_zoom_limits(rows))
    handles, labels = full.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.015 + 0.035 * legend_rows, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_time_to_train(systems: Sequence[SystemResults], rows: Sequence[SystemSummary],
                       path: Path) -> None:
    """Minutes per run per system (log scale), olympic mean marked; runs that did not converge as x."""
    plt = _pyplot()
    from matplotlib import ticker
    fig, ax = plt.subplots(figsize=(10, 1.8 + 0.9 * len(rows)))
    for y, (system, row) in enumerate(zip(systems, rows)):
        color = f"C{y % 10}"
        done = [run.minutes for run in system.runs if run.converged]
        failed = [run.minutes for run in system.runs if not run.converged and run.minutes]
        ax.scatter(done, [y] * len(done), color=color, alpha=0.6, s=25)
        ax.scatter(failed, [y] * len(failed), color="red", marker="x", s=50,
                   label="did not converge" if failed else None)
        if row.olympic_minutes is not None:
            ax.scatter([row.olympic_minutes], [y], facecolors="none", edgecolors="black",
                       marker="D", s=70, linewidths=1.5, zorder=3)
            ax.annotate(f"{row.olympic_minutes:.2f} min", (row.olympic_minutes, y),
                        textcoords="offset points", xytext=(0, 9), ha="center", fontsize=8)
    ax.scatter([], [], facecolors="none", edgecolors="black", marker="D", s=70, linewidths=1.5,
               label="olympic mean (without fastest and slowest run)")
    ax.set_yticks(range(len(rows)), [row.label for row in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.3, -0.7)  # first system on top
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel("time to train, run_start to run_stop (minutes, log scale)")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, metavar="DIR",
                        help="MLPerf package (ORG/), system folder, folder of run logs, or a .tar.gz of one")
    parser.add_argument("--out", type=Path, help="write report.md and the PNG plots here")
    parser.add_argument("--no-plots", action="store_true", help="Markdown only (no matplotlib needed)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.out is not None and not args.no_plots and (problem := plots_problem()) is not None:
        raise SystemExit(f"compare.py: {problem}")
    with ExitStack() as stack:
        systems = [system for path in args.dirs for system in discover(resolve_input(path, stack))]
    rows = [summarize(system) for system in systems]
    images: list[str] = []
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        if not args.no_plots:
            plot_accuracy(systems, rows, args.out / "accuracy.png")
            plot_time_to_train(systems, rows, args.out / "time_to_train.png")
            images = ["accuracy.png", "time_to_train.png"]
    report = markdown_report(rows, images)
    if args.out is not None:
        (args.out / "report.md").write_text(report)
    sys.stdout.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
