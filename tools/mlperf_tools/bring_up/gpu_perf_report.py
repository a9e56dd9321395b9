"""The figures of tools/gpu_perf.sh's steps in one line each, and the trainer's rate beside the benchmark's.

    python tools/gpu_perf_report.py bench RESULTS.json [--against SHIPPED.json]
    python tools/gpu_perf_report.py kernels PROFILE_TABLE.txt [--top 5]
    python tools/gpu_perf_report.py trainer TRAIN_LOG SHIPPED.json --warmup 10 --min_steps 30 --json OUT.json
    python tools/gpu_perf_report.py merge OUT.json LABEL=RESULTS.json ...

`bench` reads benchmarks/throughput.py's --json, `kernels` the table its --profile_dir writes. `trainer`
reads the trainer's progress lines (OUTPUT_DIR/train.log): each gives the samples/s since run_start, so
two of them give the rate between them, here from the first line at or after the warm-up steps to the
last line before any eval. Beside it goes the benchmark's figure for the same step (`SHIPPED.json`,
`--from_config`), as milliseconds per step, which both count alike: the trainer counts a pack as two
samples, the benchmark counts the real sequences.
Exit status: 0, or 1 when a file lacks what is asked of it (the one line says which and why).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from mlperf_bert.runtime.files import json_object, output_file

# A trainer progress line (mlperf_bert/hooks/live.py), e.g.
# `step 10 samples 960/4800 samples/s 612.4 tokens/s ...`; train.log puts a time stamp first.
PROGRESS = re.compile(r"\bstep (\d+) samples (\d+)/\d+ samples/s (\S+)")
RUN_START = re.compile(r"\brun (?:started|resumed) at step \d+ samples (\d+)")
EVAL = re.compile(r"\beval \d+ step ")


class ReportError(Exception):
    """A file lacks what the report needs; the message says which file and why."""


@dataclass(frozen=True)
class Progress:
    step: int
    samples: int
    samples_per_s: float  # since the rate window's start (run_start)


@dataclass(frozen=True)
class TrainerRate:
    first_step: int  # the interval's ends: progress lines after the warm-up
    last_step: int
    samples_per_s: float  # as the trainer counts samples (a pack counts as 2)
    ms_per_step: float
    samples_per_step: float


def progress_lines(text: str) -> tuple[int, list[Progress]]:
    """The samples at run_start and the progress lines before the first eval (an eval restarts the rate)."""
    start, lines = 0, list[Progress]()
    for line in text.splitlines():
        if EVAL.search(line):
            break
        started = RUN_START.search(line)
        if started:
            start, lines = int(started.group(1)), []
            continue
        match = PROGRESS.search(line)
        if match and math.isfinite(float(match.group(3))) and float(match.group(3)) > 0:
            lines.append(Progress(int(match.group(1)), int(match.group(2)), float(match.group(3))))
    return start, lines


def trainer_rate(text: str, warmup: int, min_steps: int) -> TrainerRate:
    """The trainer's rate from the first progress line at or after step `warmup` to the last one."""
    start, lines = progress_lines(text)
    after = [p for p in lines if p.step >= warmup]
    if len(after) < 2 or after[-1].step - after[0].step < min_steps:
        steps = after[-1].step - after[0].step if len(after) >= 2 else 0
        raise ReportError(f"{len(lines)} progress line(s), {steps} step(s) timed after the {warmup} warm-up "
                          f"step(s); needs {min_steps}: did the trainer stop early?")
    a, b = after[0], after[-1]
    # Each line's seconds since the window's start: its samples since then over its rate.
    seconds = (b.samples - start) / b.samples_per_s - (a.samples - start) / a.samples_per_s
    if seconds <= 0:
        raise ReportError(f"progress lines at steps {a.step} and {b.step} give no time between them")
    steps, samples = b.step - a.step, b.samples - a.samples
    return TrainerRate(a.step, b.step, samples / seconds, 1e3 * seconds / steps, samples / steps)


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json_object(path)
    except FileNotFoundError as err:
        raise ReportError(f"{path}: no such file (the step that writes it did not finish)") from err
    except (OSError, ValueError) as err:  # not JSON, or not an object
        raise ReportError(str(err)) from err


def ms_per_step(result: dict[str, Any]) -> float:
    return 1e3 * result["seconds"] / result["steps"]


def results_of(data: dict[str, Any], path: Path) -> list[dict[str, Any]]:
    if not isinstance(data.get("results"), list):
        raise ReportError(f"{path}: not a benchmarks/throughput.py --json file (no 'results' list)")
    return data["results"]


def first_ok(data: dict[str, Any], path: Path) -> dict[str, Any]:
    results = results_of(data, path)
    ok = [r for r in results if r["status"] == "ok"]
    if not ok:
        raise ReportError(f"{path}: no set-up ran ({'; '.join(r['status'] for r in results)})")
    return ok[0]


def label(result: dict[str, Any]) -> str:
    given = ", ".join(f"{k}={v}" for k, v in result.get("config_vars", {}).items())
    return f"{result['layout']}/{result['precision']}" + (f" [{given}]" if given else "")


def bench_line(result: dict[str, Any], head: dict[str, Any], shipped: dict[str, Any] | None) -> str:
    """One set-up's figures: step time, real sequences/s, useful TFLOP/s and their share of the measured peak."""
    if result["status"] != "ok":
        return f"{label(result)}: {result['status']}"
    line = (f"{label(result)}: {ms_per_step(result):.1f} ms/step, {result['sequences_per_s']:.0f} real seq/s, "
            f"{result['useful_tflops']:.3g} useful TFLOP/s ({result['utilisation']:.1%} of the "
            f"{head['peak_tflops']:.3g} TFLOP/s {head['peak_dtype']} peak measured)")
    if shipped is not None:
        line += f"; {ms_per_step(result) / ms_per_step(shipped):.2f}x the shipped step's time"
    if result.get("speedup_vs_hf"):
        line += f"; {result['speedup_vs_hf']:.2f}x HF padded ({result['speedup_min']:.2f}-{result['speedup_max']:.2f})"
    return line


def bench_lines(path: Path, against: Path | None) -> list[str]:
    data = read_json(path)
    shipped = None if against is None else first_ok(read_json(against), against)
    return [bench_line(r, data, shipped) for r in results_of(data, path)]


def top_kernels(table: str, top: int) -> str:
    """`name share, ...` of the first `top` rows of a torch.profiler table (sorted by self device time)."""
    rows = [line for line in table.splitlines() if line.strip() and not line.startswith("-")]
    if len(rows) < 2:
        raise ReportError("no profiler table rows")
    columns = re.split(r"\s{2,}", rows[0].strip())
    # The device's own share (`Self CUDA %`) where the table has one, else the CPU's.
    shares = [c for c in columns if re.fullmatch(r"Self \w+ %", c)]
    share = next((c for c in shares if c != "Self CPU %"), shares[0] if shares else None)
    if share is None:
        raise ReportError(f"no 'Self <device> %' column in {columns}")
    cells = [re.split(r"\s{2,}", row.strip()) for row in rows[1:] if not row.startswith("Self ")]
    picked = [c for c in cells if len(c) == len(columns)][:top]
    return ", ".join(f"{c[0]} {c[columns.index(share)]}" for c in picked)


def merge(out: Path, items: list[str]) -> None:
    """One JSON object of several results files, {label: contents}; a missing file is null."""
    merged: dict[str, Any] = {}
    for item in items:
        name, _, path = item.partition("=")
        merged[name] = json.loads(Path(path).read_text()) if Path(path).is_file() else None
    out.write_text(json.dumps(merged, indent=1) + "\n")


def trainer_report(log: Path, shipped_path: Path, warmup: int, min_steps: int, out: Path | None) -> str:
    try:
        text = log.read_text()
    except FileNotFoundError as err:
        raise ReportError(f"{log}: no such file (the trainer did not start)") from err
    try:
        rate = trainer_rate(text, warmup, min_steps)
    except ReportError as err:
        raise ReportError(f"{log}: {err}") from err
    line = (f"trainer {rate.samples_per_s:.1f} samples/s, {rate.ms_per_step:.1f} ms/step over steps "
            f"{rate.first_step}-{rate.last_step} ({rate.samples_per_step:.0f} samples a step as it counts them)")
    report: dict[str, Any] = {"trainer": asdict(rate), "benchmark": None, "trainer_over_benchmark_step_time": None}
    try:
        shipped = first_ok(read_json(shipped_path), shipped_path)
    except ReportError as err:
        line += f"; benchmark: no figure ({err})"
    else:
        ratio = rate.ms_per_step / ms_per_step(shipped)
        report.update(benchmark={"label": label(shipped), "ms_per_step": ms_per_step(shipped),
                                 "sequences_per_s": shipped["sequences_per_s"]},
                      trainer_over_benchmark_step_time=ratio)
        line += (f"; benchmark {label(shipped)} {ms_per_step(shipped):.1f} ms/step "
                 f"({shipped['sequences_per_s']:.0f} real seq/s); trainer/benchmark step time {ratio:.2f}")
    if out is not None:
        out.write_text(json.dumps(report, indent=1) + "\n")
    return line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="one line per set-up of a throughput.py --json")
    bench.add_argument("results", type=Path)
    bench.add_argument("--against", type=Path, help="the shipped step's --json: each step time as a multiple of it")
    kernels = sub.add_parser("kernels", help="the top rows of a profiler table")
    kernels.add_argument("table", type=Path)
    kernels.add_argument("--top", type=int, default=5)
    trainer = sub.add_parser("trainer", help="the trainer's rate after warm-up beside the benchmark's")
    trainer.add_argument("log", type=Path, help="the trainer's OUTPUT_DIR/train.log (or its console output)")
    trainer.add_argument("shipped", type=Path, help="throughput.py --from_config's --json of the same step")
    trainer.add_argument("--warmup", type=int, default=10, help="steps left out first (compile, graph capture)")
    trainer.add_argument("--min_steps", type=int, default=30, help="fewer timed steps after warm-up is a failure")
    trainer.add_argument("--json", type=output_file)
    merged = sub.add_parser("merge", help="several results files as one JSON object")
    merged.add_argument("out", type=Path)
    merged.add_argument("items", nargs="*", metavar="LABEL=FILE")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "bench":
            print("\n".join(bench_lines(args.results, args.against)))
        elif args.command == "kernels":
            print(f"top kernels (self time): {top_kernels(args.table.read_text(), args.top)}")
        elif args.command == "trainer":
            print(trainer_report(args.log, args.shipped, args.warmup, args.min_steps, args.json))
        else:
            merge(args.out, args.items)
    except (ReportError, FileNotFoundError) as err:
        print(f"gpu_perf_report.py {args.command}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
