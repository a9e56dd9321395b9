"""Samples to the demo target per clip mode over several seeds (the CPU demo's Table 3).

    python benchmarks/clip_study.py --seeds 1 2 3 4 5 --out docs/CLIPPING_STUDY.md

Every run is the CPU demo as `make demo` trains it: `config_CPU_1x2.sh` sourced, then
run_and_time.sh with 2 processes, with only CLIP_MODE, MAX_GRAD_NORM and SEED (and, if asked,
the eval interval) overridden on top of the config, on the demo dataset (`make demo` makes it).
Runs go seed by seed, every mode of a seed back to back, so that the load of a shared machine
falls on all modes alike. Each finished run is appended to RUNS_DIR/runs.jsonl and reused by
later invocations: interrupting and restarting the study loses at most the run in progress,
and the tables can be rewritten from finished runs without training again.

The tables (per mode: runs reaching the target, samples to target mean / std / min / max,
final accuracy, train time per step; and samples to target per seed) replace the part of
`--out` between the `clip_study` markers; the rest of that file is left as it is.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

from mlperf_bert.config.settings import CLIP_MODES

REPO = Path(__file__).resolve().parents[1]
RUN_AND_TIME = REPO / "run_and_time.sh"
BASELINE_MODE = "after_allreduce"  # the reference semantics: clip the averaged gradient
MLLOG_TOKEN = ":::MLLOG "
# Sources the config ($0), then runs `env NAME=value ... run_and_time.sh` ("$@"): the
# overrides win over the config's exports, and no value is ever parsed by a shell.
_SOURCE_THEN_RUN = 'source "$0" && exec env "$@"'
# Variables a launch inherits from the caller; anything else (a stray CLIP_MODE or RANK in the
# caller's shell) could silently change the run.
_INHERITED = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "TMPDIR")
_PRINT_ARGV = 'import json, sys\nprint("TRAINER_ARGV " + json.dumps(sys.argv[1:]))\n'


def launch_command(config: Path, overrides: Mapping[str, str]) -> list[str]:
    """argv of `source CONFIG; NAME=value ... ./run_and_time.sh` for the given overrides."""
    for name in overrides:
        if not name.replace("_", "").isalnum() or not name[0].isalpha() or name != name.upper():
            raise ValueError(f"override {name!r} is not a config variable name (UPPER_CASE)")
    return ["bash", "-c", _SOURCE_THEN_RUN, str(config), *(f"{k}={v}" for k, v in overrides.items()),
            str(RUN_AND_TIME)]


def launch_env(threads: int = 1) -> dict[str, str]:
    """A clean environment for a launch: the caller's basics plus one compute thread per process."""
    env = {name: os.environ[name] for name in _INHERITED if name in os.environ}
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def trainer_flags(config: Path, overrides: Mapping[str, str]) -> list[str]:
    """The run_pretraining.py flags run_and_time.sh builds from CONFIG plus `overrides`.

    run_and_time.sh runs with PYTHON pointing at a stand-in interpreter that prints its
    arguments and exits, so nothing trains; the flags are those after run_pretraining.py.
    """
    with tempfile.TemporaryDirectory() as tmp:
        fake = Path(tmp) / "python"
        fake.write_text(f"#!{sys.executable}\n{_PRINT_ARGV}")
        fake.chmod(0o755)
        command = launch_command(config, {**overrides, "PYTHON": str(fake)})
        done = subprocess.run(command, cwd=REPO, env=launch_env(), capture_output=True, text=True,
                              timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"run_and_time.sh with {config.name} failed:\n{done.stdout}{done.stderr}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("TRAINER_ARGV ")]
    argv = json.loads(lines[0].split(" ", 1)[1])
    names = [Path(arg).name for arg in argv]
    return argv[names.index("run_pretraining.py") + 1 :]


def read_mllog(path: Path) -> list[dict]:
    """The `:::MLLOG` events of a log file, in order."""
    with path.open() as lines:
        return [json.loads(line.split(MLLOG_TOKEN, 1)[1]) for line in lines if MLLOG_TOKEN in line]


@dataclass(frozen=True)
class RunSpec:
    mode: str
    seed: int
    max_grad_norm: float

    @property
    def name(self) -> str:
        return f"c{self.max_grad_norm:g}_{self.mode}_seed{self.seed}"


@dataclass(frozen=True)
class RunOutcome:
    mode: str
    seed: int
    max_grad_norm: float
    status: str  # run_stop status: success (target reached) or aborted
    samples: int  # training samples at run_stop: samples to target when status is success
    final_accuracy: float  # the last eval's masked-LM accuracy
    train_ms_per_step: float  # (run_stop - run_start - time in evals) / optimizer steps

    @property
    def reached(self) -> bool:
        return self.status == "success"

    @property
    def spec(self) -> RunSpec:
        return RunSpec(self.mode, self.seed, self.max_grad_norm)


def outcome_from_log(spec: RunSpec, events: Sequence[dict]) -> RunOutcome:
    """Status, samples, final accuracy and training time per step of one MLPerf log."""
    def times(key: str) -> list[int]:
        return [e["time_ms"] for e in events if e["key"] == key]

    stop = next(e for e in events if e["key"] == "run_stop")
    batch = next(e["value"] for e in events if e["key"] == "global_batch_size")
    accuracy = [e["value"] for e in events if e["key"] == "eval_accuracy"][-1]
    eval_ms = sum(end - start for start, end in zip(times("eval_start"), times("eval_stop")))
    train_ms = stop["time_ms"] - times("run_start")[0] - eval_ms
    samples = stop["metadata"]["epoch_num"]
    return RunOutcome(spec.mode, spec.seed, spec.max_grad_norm, stop["metadata"]["status"], samples,
                      accuracy, train_ms / max(samples // batch, 1))


@dataclass(frozen=True)
class StudySetup:
    config: Path  # the config_<SYSTEM>.sh every run sources
    demo_data: Path  # made by `make demo` (data_prep/make_demo_data.py)
    runs_dir: Path  # one folder per run, plus runs.jsonl
    eval_iter_samples: int | None  # None: the config's eval interval

    def overrides(self, spec: RunSpec) -> dict[str, str]:
        values = {
            "CLIP_MODE": spec.mode, "MAX_GRAD_NORM": f"{spec.max_grad_norm:g}", "SEED": str(spec.seed),
            "PYTHON": sys.executable, "DATADIR_PHASE2": str(self.demo_data / "train"),
            "EVALDIR": str(self.demo_data / "eval"), "BERT_CONFIG": str(self.demo_data / "bert_config.json"),
            "INIT_CHECKPOINT": "none", "OUTPUT_DIR": str(self.runs_dir / spec.name),
        }
        if self.eval_iter_samples is not None:
            values["EVAL_ITER_START_SAMPLES"] = values["EVAL_ITER_SAMPLES"] = str(self.eval_iter_samples)
        return values


def run_once(spec: RunSpec, setup: StudySetup, attempts: int = 2) -> RunOutcome:
    """Trains one demo run through run_and_time.sh and reads its MLPerf log.

    A failed launch is retried once (from scratch, same seed): bash reads run_and_time.sh while
    it runs, so an edit of the script during a long study can break a run that was fine.
    """
    out = setup.runs_dir / spec.name
    out.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, attempts + 1):
        (out / "mlperf.log").unlink(missing_ok=True)  # the logger appends
        with (out / "stdout.txt").open("w") as stdout, (out / "stderr.txt").open("w") as stderr:
            done = subprocess.run(launch_command(setup.config, setup.overrides(spec)), cwd=REPO,
                                  env=launch_env(), stdout=stdout, stderr=stderr, timeout=3600, check=False)
        if done.returncode == 0:
            return outcome_from_log(spec, read_mllog(out / "mlperf.log"))
        kept = (out / "stderr.txt").replace(out / f"stderr.attempt{attempt}.txt")
        print(f"{spec.name}: attempt {attempt} exited with {done.returncode}; see {kept}", file=sys.stderr, flush=True)
    raise RuntimeError(f"run {spec.name} failed {attempts} times; see {out}/stderr.attempt*.txt")


def load_outcomes(path: Path) -> dict[RunSpec, RunOutcome]:
    if not path.exists():
        return {}
    outcomes = (RunOutcome(**json.loads(line)) for line in path.read_text().splitlines() if line.strip())
    return {o.spec: o for o in outcomes}


def run_study(specs: Sequence[RunSpec], setup: StudySetup) -> list[RunOutcome]:
    """Every spec's outcome, training only those runs.jsonl does not hold yet."""
    record = setup.runs_dir / "runs.jsonl"
    done = load_outcomes(record)
    for number, spec in enumerate(specs, 1):
        if spec in done:
            continue
        outcome = done[spec] = run_once(spec, setup)
        with record.open("a") as f:
            f.write(json.dumps(asdict(outcome)) + "\n")
        print(f"[{number}/{len(specs)}] {spec.name}: {outcome.status} at {outcome.samples} samples, "
              f"accuracy {outcome.final_accuracy:.4f}, {outcome.train_ms_per_step:.0f} ms/step",
              file=sys.stderr, flush=True)
    return [done[spec] for spec in specs]


def _stats(values: Sequence[float]) -> tuple[str, str, str]:
    """mean, sample std, 'min / max' as table cells ('-' where undefined)."""
    if not values:
        return "-", "-", "-"
    std = f"{statistics.stdev(values):,.0f}" if len(values) > 1 else "-"
    return f"{statistics.mean(values):,.0f}", std, f"{min(values):,} / {max(values):,}"


def summary_table(outcomes: Sequence[RunOutcome], modes: Sequence[str]) -> list[str]:
    """One row per mode: the paper's Table 3 columns plus the demo's train time per step."""
    rows = ["| clip mode | runs reaching target | samples to target: mean | std | min / max | "
            "mean final accuracy | train ms/step (median) |", "|---|---|---|---|---|---|---|"]
    for mode in modes:
        runs = [o for o in outcomes if o.mode == mode]
        mean, std, span = _stats([o.samples for o in runs if o.reached])
        accuracy = statistics.mean(o.final_accuracy for o in runs)
        step_ms = statistics.median(o.train_ms_per_step for o in runs)
        rows.append(f"| {mode} | {sum(o.reached for o in runs)} / {len(runs)} | {mean} | {std} | {span} | "
                    f"{accuracy:.4f} | {step_ms:.0f} |")
    return rows


def per_seed_table(outcomes: Sequence[RunOutcome], modes: Sequence[str]) -> list[str]:
    """Samples to target per seed (rows) and mode (columns); runs that did not reach it are marked."""
    by_key = {(o.seed, o.mode): o for o in outcomes}
    rows = ["| seed | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for seed in sorted({o.seed for o in outcomes}):
        cells = []
        for mode in modes:
            run = by_key[(seed, mode)]
            cells.append(f"{run.samples:,}" if run.reached else f"not reached ({run.final_accuracy:.4f})")
        rows.append(f"| {seed} | " + " | ".join(cells) + " |")
    return rows


def paired_table(outcomes: Sequence[RunOutcome], modes: Sequence[str], baseline: str) -> list[str]:
    """Each mode against `baseline` on the same seeds (same weights and batches): the seed noise.

    Delta = mode's samples to target - baseline's, over the seeds where both reached the target.
    """
    by_key = {(o.seed, o.mode): o for o in outcomes if o.reached}
    rows = [f"| clip mode | seeds | mean delta vs {baseline} | std of delta | standard error | "
            "fewer / same / more samples |", "|---|---|---|---|---|---|"]
    for mode in (m for m in modes if m != baseline):
        seeds = sorted(seed for seed, m in by_key if m == mode and (seed, baseline) in by_key)
        deltas = [by_key[(seed, mode)].samples - by_key[(seed, baseline)].samples for seed in seeds]
        if len(deltas) < 2:
            rows.append(f"| {mode} | {len(deltas)} | - | - | - | - |")
            continue
        std = statistics.stdev(deltas)
        counts = (sum(d < 0 for d in deltas), sum(d == 0 for d in deltas), sum(d > 0 for d in deltas))
        rows.append(f"| {mode} | {len(deltas)} | {statistics.mean(deltas):+,.0f} | {std:,.0f} | "
                    f"{std / math.sqrt(len(deltas)):,.0f} | {' / '.join(map(str, counts))} |")
    return rows


def render(outcomes: Sequence[RunOutcome], modes: Sequence[str], setup: StudySetup) -> str:
    """The generated part of the study document: how it was run, then one section per max_grad_norm."""
    evals = f"an eval every {setup.eval_iter_samples} samples" if setup.eval_iter_samples else "the config's evals"
    lines = [
        "Command:", "", "    " + shlex.join(["python", "benchmarks/clip_study.py", *sys.argv[1:]]), "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}; torch {torch.__version__}, "
        f"Python {platform.python_version()}. Date: {datetime.date.today().isoformat()}.",
        f"Config: `{setup.config.name}` (2 processes, gloo), {evals}; "
        "samples to target are those of the first eval at or above the target.",
    ]
    for norm in sorted({o.max_grad_norm for o in outcomes}):
        runs = [o for o in outcomes if o.max_grad_norm == norm]
        lines += ["", f"### max_grad_norm {norm:g}", "", *summary_table(runs, modes), "",
                  *per_seed_table(runs, modes)]
        if BASELINE_MODE in modes:
            lines += ["", *paired_table(runs, modes, BASELINE_MODE)]
    return "\n".join(lines)


def write_section(path: Path, name: str, body: str) -> None:
    """Replaces the text between `<!-- NAME:begin -->` and `<!-- NAME:end -->` (appends them if absent)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else ""
    block = f"{begin}\n{body}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text + ("\n" if text and not text.endswith("\n") else "") + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def study_specs(modes: Iterable[str], seeds: Iterable[int], norms: Iterable[float]) -> list[RunSpec]:
    """Seed-major order: all modes of one seed run back to back."""
    return [RunSpec(mode, seed, norm) for norm in norms for seed in seeds for mode in modes]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--modes", nargs="+", choices=CLIP_MODES, default=list(CLIP_MODES))
    parser.add_argument("--max_grad_norm", type=float, nargs="+", default=[1.0],
                        help="clip norm(s) c; one table per value")
    parser.add_argument("--eval_iter_samples", type=int,
                        help="samples between evals (and before the first); default: the config's")
    parser.add_argument("--config", type=Path, default=REPO / "config_CPU_1x2.sh")
    parser.add_argument("--demo_data", type=Path, default=REPO / "demo_data")
    parser.add_argument("--runs_dir", type=Path, default=REPO / "results" / "clip_study",
                        help="run folders and runs.jsonl (finished runs are reused)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "CLIPPING_STUDY.md")
    args = parser.parse_args(argv)
    if not (args.demo_data / "bert_config.json").is_file():
        parser.error(f"--demo_data {args.demo_data} holds no demo dataset; `make demo` makes it")
    if any(not (0 < c < math.inf) for c in args.max_grad_norm):
        parser.error("--max_grad_norm values must be positive and finite")
    return args


def main() -> None:
    args = parse_args()
    setup = StudySetup(args.config.resolve(), args.demo_data.resolve(), args.runs_dir.resolve(), args.eval_iter_samples)
    outcomes = run_study(study_specs(args.modes, args.seeds, args.max_grad_norm), setup)
    body = render(outcomes, args.modes, setup)
    write_section(args.out, "clip_study", body)
    print(body)


if __name__ == "__main__":
    main()
