"""Before the cluster hour: a config's device memory, step time and time to train, without a GPU.

    python tools/plan.py config_DGXH200_1x8.sh
    python tools/plan.py config_DGXH200_1x8.sh --gpus 16 --device B200   # the recipe on another system
    python tools/plan.py --all [--plot ttt.png]                           # every shipped GPU config
    python tools/plan.py config_DGXH200_1x8.sh --config_var PRECISION=fp8   # the config with a variable changed
    python tools/plan.py --calibrate              # refit our step's constants and NVIDIA's two efficiencies

Memory and work come from the config's own training step, traced at BERT-Large shapes under the
fake CUDA device (`mlperf_bert.dryrun.shipped`; about 5-15 s per config), and for a compiled config
from Inductor's code for its compiled regions, generated for the config's GPU on the fake device
(`mlperf_bert.dryrun.compiled`; about 20-40 s more); both cached by the config's variables, the
trainer's source and the torch and Triton releases. Step and eval times come from `step_model`'s model of our step,
calibrated on measurements of this repository's step (tools/measurements, `step_calibration`); the
terms of a prediction no measurement reaches yet are named as such. NVIDIA's code on this system (the
model calibrated on NVIDIA's published rates) is a separate line. Samples to converge from the RCP
checker's window for the config's global batch size (tools/mlperf_tools/results/scoring.py); evals at the config's
schedule (`--eval_iter_*`, else the MLPerf interval).

Time to train (run_start to run_stop) = run_fixed_s + samples / throughput + evals x eval time,
where samples are rounded up to the eval that sees them. Its range: low at the fewest samples the
RCP bound accepts (training_rules.adoc §RCP: the olympic mean may be faster than the RCP mean by
up to its maximum speed-up) and our step shorter by the calibration's largest leave-one-out miss,
high at the RCP mean plus one standard deviation and the step longer by it. A forecast from a
running job's log can replace `samples` (see `Prediction.with_samples`).

The run stops at MAX_STEPS x the global batch or MAX_SAMPLES_TERMINATION, whichever comes first (the
trainer's limit, `RunLimit`), with an eval there. A closed-division run that stops before the RCP mean
gets no time to train: the plan says where it stops and exits 2 with the value that reaches the RCP
mean plus one standard deviation. An open-division recipe may converge sooner (Samsung's): its plan
says the same and is no error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, NoReturn, Sequence

from mlperf_tools.results import scoring
from mlperf_tools.planning import step_calibration
from mlperf_tools.planning import step_model
from mlperf_tools.planning.step_model import DEVICES, Device, StepTime

from mlperf_bert.config.batch_size import BatchShape, config_batch
from mlperf_bert.dryrun.estimate import MemoryEstimate, StepWork, memory_from_dict
from mlperf_bert.dryrun.native import build_dir
from mlperf_bert.dryrun.shipped import exports
from mlperf_bert.optim.clipping import ClipMode, all_reduce_overlaps_backward
from mlperf_bert.train.cuda_graphs import DDP_WARMUP_STEPS, WARMUP_STEPS
from mlperf_bert.train.evaluation_interval import EvalSchedule
from mlperf_bert.runtime.files import output_file
from mlperf_bert.runtime.optional import matplotlib_problem

REPO = Path(__file__).resolve().parents[3]  # tools/mlperf_tools/<kind>/<module>.py: the tools work on a checkout
RULESET = "5.0.0"
LOGS = REPO / "tests" / "harness" / "data" / "mlperf_logs"
# DGXSYSTEM prefixes -> device (the configs' systems).
SYSTEM_DEVICES = {"DGXA100": "A100", "SamsungA100": "A100", "DGXH100": "H100", "DGXH200": "H200",
                  "DGXB200": "B200", "GB200": "GB200"}
GPUS_PER_NODE = {"GB200": 4}  # a GB200 compute tray; every other system: 8 per node


class PlanError(Exception):
    """A bad config, flag or device: one line for the user."""


# ---------------------------------------------------------------------------------------------
# The configs


def shipped_gpu_configs() -> list[Path]:
    return sorted(p for p in REPO.glob("config_*.sh") if not p.name.startswith("config_CPU_"))


def device_of(env: Mapping[str, str], config: Path) -> str:
    system = env.get("DGXSYSTEM", "")
    for prefix, device in SYSTEM_DEVICES.items():
        if system.startswith(prefix):
            return device
    raise PlanError(f"{config.name}: DGXSYSTEM={system!r} names no known device; pass --device "
                    f"({', '.join(DEVICES)})")


def config_env(config: Path, gpus: int | None, device: str) -> dict[str, str]:
    """The config's variables, on `gpus` devices of `device` when given (8 per node, 4 for GB200)."""
    env = exports(config)
    missing = [name for name in ("DGXNGPU", "DGXNNODES", "BATCHSIZE", "GRADIENT_STEPS") if name not in env]
    if missing:
        raise PlanError(f"{config.name}: no export of {', '.join(missing)} (a config_*.sh sets them)")
    if gpus is None:
        return env
    per_node = GPUS_PER_NODE.get(device, 8)
    if gpus < 1 or (gpus > per_node and gpus % per_node):
        raise PlanError(f"--gpus {gpus}: give at most {per_node} or a multiple of {per_node} ({device} nodes hold "
                        f"{per_node})")
    return {**env, "DGXNGPU": str(min(gpus, per_node)), "DGXNNODES": str(max(gpus // per_node, 1))}


def config_batch_shape(env: Mapping[str, str], name: str) -> BatchShape:
    """The config's batch as the trainer counts it (`mlperf_bert.config.batch_size`: BATCHSIZE is per GPU and
    optimizer step, the accumulation inside it; a pack counts as 2 sequences)."""
    try:
        return config_batch(env, name)
    except ValueError as err:
        raise PlanError(str(err)) from err


# ---------------------------------------------------------------------------------------------
# Traces, cached


def _source_digest() -> str:
    """The trainer's source and the releases its traces depend on (torch's ops, Inductor's and Triton's code)."""
    digest = hashlib.sha256()
    files = sorted((REPO / "pytorch" / "mlperf_bert").rglob("*.py")) + \
        [REPO / "run_and_time.sh", REPO / "tools" / "launch_checks.sh", REPO / "pytorch/mlperf_bert/dryrun/fake_cuda.cpp"]
    for path in files:
        digest.update(path.read_bytes())
    for package in ("torch", "triton"):
        try:
            digest.update(f"{package} {metadata.version(package)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{package} none".encode())
    return digest.hexdigest()


def _key(env: Mapping[str, str], source: str) -> str:
    return hashlib.sha256((json.dumps(sorted(env.items())) + source).encode()).hexdigest()[:20]


# What the dry-run process returns per config: its trace (`shipped.trace`) and Inductor's count of its compiled
# step (`planned.compiled_step`), each kept in the cache as a file of its own.
KINDS = {"trace": "{key}.json", "inductor": "{key}.inductor.json"}


def dry_runs(envs: Mapping[str, Mapping[str, str]], inductor: Iterable[str] = (), cache: bool = True
             ) -> dict[str, dict[str, Any]]:
    """Each config's traced memory and work, with Inductor's count of its compiled step under "inductor" for the
    names in `inductor` that compile; what no cache holds is run in one process (`mlperf_bert.dryrun.planned`)."""
    folder = build_dir().parent / "plan"
    folder.mkdir(parents=True, exist_ok=True)
    source = _source_digest()
    keys = {name: _key(env, source) for name, env in envs.items()}
    wanted = {"trace": set(envs), "inductor": {name for name in inductor if step_calibration.compiles(envs[name])}}
    files = {(kind, name): folder / KINDS[kind].format(key=keys[name]) for kind, names in wanted.items()
             for name in names}
    found = {job: json.loads(path.read_text()) for job, path in files.items() if cache and path.exists()}
    todo = {kind: {name: dict(envs[name]) for name in names if (kind, name) not in found}
            for kind, names in wanted.items()}
    if any(todo.values()):
        for kind, done in _dry_run_process(todo).items():
            for name, result in done.items():
                # Whole or not at all: test files in other workers read the cache while it is written.
                partial = files[(kind, name)].with_name(f"{files[(kind, name)].name}.{os.getpid()}")
                partial.write_text(json.dumps(result))
                partial.replace(files[(kind, name)])
                found[(kind, name)] = result
    return {name: {**found[("trace", name)], **({"inductor": found[("inductor", name)]}
                                                if ("inductor", name) in found else {})} for name in envs}


def _dry_run_process(todo: Mapping[str, Mapping[str, Mapping[str, str]]]) -> dict[str, dict[str, Any]]:
    """{"trace": {name: env}, "inductor": {name: env}} run in one process of `mlperf_bert.dryrun.planned`."""
    names = sorted({name for jobs in todo.values() for name in jobs})
    with tempfile.TemporaryDirectory(prefix="plan_") as scratch:
        request, result = Path(scratch) / "request.json", Path(scratch) / "result.json"
        request.write_text(json.dumps(todo))
        done = subprocess.run([sys.executable, "-m", "mlperf_bert.dryrun.planned", str(request), str(result)],
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([
                                  str(REPO / "pytorch"), os.environ.get("PYTHONPATH", "")])},
                              capture_output=True, text=True)
        if done.returncode != 0 or not result.exists():
            lines = (done.stderr or done.stdout).strip().splitlines()
            raise PlanError(f"the dry run of {', '.join(names)} failed: {lines[-1] if lines else done.returncode}")
        return json.loads(result.read_text())


def traces(envs: Mapping[str, Mapping[str, str]], cache: bool = True, compiled: bool = False
           ) -> dict[str, dict[str, Any]]:
    """Each config's traced memory and work (`mlperf_bert.dryrun.shipped`); compiled: with Inductor's count of each
    compiled config's step ("inductor"), which our step's time needs (`dry_runs`)."""
    return dry_runs(envs, envs if compiled else (), cache)


# ---------------------------------------------------------------------------------------------
# Published numbers: per-GPU training rate and time to train of the systems the configs mirror


@dataclass(frozen=True)
class Published:
    rate: float | None  # samples/s per GPU while training (between evals), or over whole eval intervals
    minutes: float | None  # olympic mean time to train
    source: str
    includes_eval: bool = False  # the rate is over eval intervals, the eval's time included


def _mllog(lines: Iterable[str]) -> list[dict[str, Any]]:
    return [json.loads(line.split(":::MLLOG ", 1)[1]) for line in lines if ":::MLLOG " in line]


def _per_gpu_rate(spans: Iterable[tuple[float, float]], gpus: int, missing: str) -> float:
    """Samples per second per GPU over (samples, milliseconds) spans; PlanError(missing) when they hold no time."""
    samples = seconds = 0.0
    for span_samples, span_ms in spans:
        samples += span_samples
        seconds += span_ms / 1000
    if seconds <= 0:
        raise PlanError(missing)
    return samples / seconds / gpus


def training_rate(log_texts: Sequence[str], gpus: int) -> float:
    """Samples per second per GPU from eval_stop to the next eval_start (the logs' timestamps), over all runs."""
    def spans(text: str) -> Iterator[tuple[float, float]]:
        records = _mllog(text.splitlines())
        stops = [(r["time_ms"], r["metadata"]["epoch_num"]) for r in records if r["key"] == "eval_stop"]
        starts = [(r["time_ms"], r["metadata"]["epoch_num"]) for r in records if r["key"] == "eval_start"]
        for (stop_ms, at), (start_ms, next_at) in zip(stops, starts[1:]):
            yield next_at - at, start_ms - stop_ms

    return _per_gpu_rate((span for text in log_texts for span in spans(text)), gpus,
                         "the published logs have no eval_start/eval_stop pairs to time training between evals")


def interval_rate(log_texts: Sequence[str], gpus: int) -> float:
    """Samples per second per GPU from one eval_accuracy line to the next (evals included), over all runs:
    for logs without eval_start/eval_stop lines (NVIDIA v2.0)."""
    def spans(text: str) -> Iterator[tuple[float, float]]:
        evals = [(r["time_ms"], r["metadata"]["epoch_num"]) for r in _mllog(text.splitlines())
                 if r["key"] == "eval_accuracy"]
        for (t0, s0), (t1, s1) in zip(evals, evals[1:]):
            yield s1 - s0, t1 - t0

    return _per_gpu_rate((span for text in log_texts for span in spans(text)), gpus,
                         "the published logs have fewer than two evals per run")


def _log_texts(folder: Path) -> list[str]:
    return [p.read_text() for p in sorted(folder.glob("result_*.txt"))]


def _tar_texts(archive: Path, inner: str) -> list[str]:
    with tarfile.open(archive) as tar:
        return [tar.extractfile(m).read().decode() for m in sorted(tar.getmembers(), key=lambda m: m.name)  # type: ignore[union-attr]
                if m.name.startswith(inner) and re.search(r"result_\d+\.txt$", m.name)]


def published() -> dict[str, Published]:
    """The published figure each shipped GPU config is compared with (REFERENCE.md; logs in tests/harness/data)."""
    a100 = interval_rate(_log_texts(LOGS / "v2.0/NVIDIA/results/dgxa100_ngc22.04_pytorch/bert"), 8)
    h200 = training_rate(_log_texts(LOGS / "v4.0/NVIDIA/results/h200_ngc23.09_pytorch/bert"), 8)
    gb200 = training_rate(_tar_texts(LOGS / "v5.0/Dell.tar.gz", "Dell/results/2xXE9712x4GB200/bert/"), 8)
    return {
        "config_DGXA100_1x8.sh": Published(a100, 18.442, "NVIDIA v2.0 logs (tests/harness/data), eval to eval, evals "
                                                         "included (no eval_start lines); 18.442 min", True),
        "config_DGXH100_1x8.sh": Published(1031.0, 5.47, "REFERENCE.md: NVIDIA v4.0 H100, between evals; 5.47 min"),
        "config_DGXH200_1x8.sh": Published(h200, 5.21, "NVIDIA v4.0 H200 logs (tests/harness/data), eval_stop to "
                                                       "eval_start; 5.21 min"),
        "config_DGXB200_1x8.sh": Published(1528.0, 3.50, "REFERENCE.md: NVIDIA v5.0 B200, 1,517-1,540 between evals; "
                                                         "3.50 min"),
        "config_GB200_2x4.sh": Published(gb200, 3.42, "Dell v5.0 2x4 GB200 logs (tests/harness/data), eval_stop to "
                                                      "eval_start; NVIDIA's 3.42 min"),
        # Open division, its own kernels: compared for time to train only, not calibrated on.
        "config_SamsungA100_128x8.sh": Published(None, 0.372, "Samsung v2.0 logs (tests/harness/data/mlperf_logs/v2.0/"
                                                              "Samsung.tar.gz): olympic mean, tools/compare.py"),
    }


# ---------------------------------------------------------------------------------------------
# The prediction


@dataclass(frozen=True)
class RunLimit:
    """Where the trainer stops a run that has not reached the target (`mlperf_bert.trainer.stop_samples`): at the
    first step whose samples reach MAX_STEPS x the global batch, or MAX_SAMPLES_TERMINATION."""

    variable: str  # MAX_STEPS or MAX_SAMPLES_TERMINATION, whichever stops the run first
    value: int
    gbs: int

    @property
    def samples(self) -> int:
        """Samples when the run's last step ends."""
        steps = self.value if self.variable == "MAX_STEPS" else math.ceil(self.value / self.gbs)
        return steps * self.gbs

    def words(self) -> str:
        return f"{self.variable}={self.value}" + (f" x global batch {self.gbs}" if self.variable == "MAX_STEPS" else "")

    def reaching(self, samples: float) -> int:
        """The value of the variable whose run reaches `samples`."""
        return math.ceil(samples / self.gbs) if self.variable == "MAX_STEPS" else math.ceil(samples)


def run_limit(env: Mapping[str, str], gbs: int, name: str) -> RunLimit | None:
    """The config's limit (None: it sets neither variable); PlanError for a value the launcher refuses."""
    limits = []
    for variable in ("MAX_STEPS", "MAX_SAMPLES_TERMINATION"):
        value = env.get(variable)
        if not value:
            continue
        if not value.isdigit() or int(value) < 1:
            raise PlanError(f"{name}: {variable}={value} is not a whole number of "
                            f"{'steps' if variable == 'MAX_STEPS' else 'samples'} (1 or more)")
        limits.append(RunLimit(variable, int(value), gbs))
    return min(limits, key=lambda limit: limit.samples, default=None)


@dataclass(frozen=True)
class Prediction:
    name: str
    device: Device
    gpus: int
    gbs: int
    memory: MemoryEstimate
    fit: step_model.Fit
    step: StepTime  # our step: this repository's code, as measured
    step_range: tuple[float, float]  # seconds: fastest and slowest the calibration's leave-one-out misses allow
    eval_s: float
    window: scoring.RcpWindow
    schedule: EvalSchedule
    samples: float  # expected samples to converge (the RCP mean)
    samples_range: tuple[float, float]
    init_s: float
    work: StepWork
    overlap: step_model.Exchange  # how the gradient exchange overlaps the backward pass
    per_node: int  # ranks per node
    nvidia_step: StepTime  # NVIDIA's code on this system: the model calibrated on NVIDIA's published rates
    nvidia_work: StepWork  # the step in NVIDIA's precision (`nvidia_env`), which that model reads
    env: Mapping[str, str]  # the config's variables (with any --config_var)
    config_vars: Mapping[str, str]  # the --config_var ones
    limit: RunLimit | None = None  # where the run stops short of the target

    @property
    def throughput(self) -> float:
        return self.gbs / self.step.seconds

    def nvidia_rate(self, includes_eval: bool = False, k: Mapping[str, float] | None = None) -> float:
        """NVIDIA's code on this system: samples/s per device while training, or over a whole eval interval with
        its eval (`includes_eval`); `k`: other calibration constants."""
        work = self.nvidia_work
        step = step_model.step_time(work, self.device, self.gpus, self.overlap, k, self.per_node).seconds
        if not includes_eval:
            return self.gbs / step / self.gpus
        interval = self.schedule.interval_samples
        evaluation = step_model.eval_seconds(work, self.device, self.gpus, k, self.per_node)
        return interval / (interval / self.gbs * step + evaluation) / self.gpus

    def with_samples(self, samples: float, low: float, high: float) -> "Prediction":
        """The same run, converging after `samples` (a forecast's) within [low, high]."""
        return replace(self, samples=samples, samples_range=(low, high))

    def converges(self, samples: float) -> bool:
        """Whether a run that needs `samples` reaches them before the trainer's limit stops it (its last eval is
        at the limit)."""
        return self.limit is None or samples <= self.limit.samples

    def evals(self, samples: float) -> int:
        """Evals up to the first at or after `samples` (the eval at 0 skipped), or up to the limit's, the last."""
        start, every = self.schedule.start_samples, self.schedule.interval_samples
        if self.limit is not None:
            samples = min(samples, self.limit.samples)
        return 1 + max(math.ceil((samples - start) / every), 0)

    def stop_samples(self, samples: float) -> float:
        """Samples trained when the run stops: at the eval that first sees `samples`, a whole step's worth, or at
        the limit."""
        at = self.schedule.start_samples + (self.evals(samples) - 1) * self.schedule.interval_samples
        stop = math.ceil(at / self.gbs) * self.gbs
        return stop if self.limit is None else min(stop, self.limit.samples)

    def minutes(self, samples: float, step_s: float) -> float:
        steps = self.stop_samples(samples) / self.gbs
        return (step_model.constant("run_fixed_s") + steps * step_s + self.evals(samples) * self.eval_s) / 60

    @property
    def ttt(self) -> tuple[float, float, float]:
        """Time to train in minutes: expected, low, high."""
        return (self.minutes(self.samples, self.step.seconds), self.minutes(self.samples_range[0], self.step_range[0]),
                self.minutes(self.samples_range[1], self.step_range[1]))


def overlaps(env: Mapping[str, str]) -> step_model.Exchange:
    """How this config's gradient exchange runs (step_model's docstring): DDP's all-reduce, or the sharded
    optimizer's reduce-scatters (optim/sharded.py), overlap the backward in the clip modes the trainer's table
    says; DIST_OPTIMIZER_GROUP_SIZE (0 or unset: every rank) bounds the sharded collectives' groups."""
    overlap = all_reduce_overlaps_backward(ClipMode(env.get("CLIP_MODE", "after_allreduce")))
    if env.get("DIST_OPTIMIZER") != "1":
        return step_model.Exchange(overlap)
    return step_model.Exchange(overlap, True, int(env.get("DIST_OPTIMIZER_GROUP_SIZE") or 0))


def residual_spread() -> float:
    """The largest |log(predicted / published)| of NVIDIA's calibration: its step time's range."""
    return step_model.constant("step_time_spread")


def nvidia_env(env: Mapping[str, str], device: Device) -> dict[str, str] | None:
    """The config in NVIDIA's precision where it differs: FP8 on a device with FP8 tensor cores (NVIDIA's Hopper and
    Blackwell runs train in FP8; NVIDIA's model was calibrated on this trainer's FP8 step there)."""
    if device.fp8_flops is None or env.get("PRECISION") == "fp8":
        return None
    return {k: v for k, v in env.items() if k not in step_calibration.FP8_VARIABLES} | {"PRECISION": "fp8"}


def inductor_bytes(traced: Mapping[str, Any]) -> float | None:
    """The bytes Inductor's kernels for a traced config's compiled step move (`dry_runs`' "inductor"), if counted."""
    report = traced.get("inductor")
    return float(report["step"]["elementwise_bytes"]) if report else None


def predict(name: str, env: Mapping[str, str], device: Device, traced: Mapping[str, Any],
            config_vars: Mapping[str, str] | None = None, nvidia_traced: Mapping[str, Any] | None = None
            ) -> Prediction:
    """traced: the config's dry run, with Inductor's count of a compiled config's step (`dry_runs`); nvidia_traced:
    its trace in NVIDIA's precision (`nvidia_env`) where that differs."""
    memory = memory_from_dict(traced["memory"])
    work = StepWork.from_dict(traced["work"])
    compiled = inductor_bytes(traced)
    nvidia = StepWork.from_dict(nvidia_traced["work"]) if nvidia_traced else work
    batch = config_batch_shape(env, name)
    gpus, per_node, gbs = batch.world_size, int(env["DGXNGPU"]), batch.global_batch_size
    step = step_model.our_step_time(work, device, gpus, overlaps(env), per_node, compiled)
    spread = math.exp(step_model.OURS["step_time_spread"].value)
    window = scoring.rcp_window(gbs, RULESET)
    if window.record is None:
        raise PlanError(f"{name}: {window.where()}: no RCP window to predict samples to converge")
    mean, low = float(window.rcp_mean or 0), float(window.min_mean or 0)
    high = mean + float(window.record.get("RCP Stdev", 0.0))
    schedule = EvalSchedule.for_batch_size(gbs, _int(env.get("EVAL_ITER_START_SAMPLES")),
                                           _int(env.get("EVAL_ITER_SAMPLES")))
    warmups = DDP_WARMUP_STEPS if gpus > 1 else WARMUP_STEPS
    init = step_model.constant("init_fixed_s") + ((warmups + 1) * step.seconds if env.get("CUDA_GRAPHS") == "1" else 0.0)
    return Prediction(name, device, gpus, gbs, memory, step_model.memory_fit(memory, device), step,
                      (step.seconds / spread, step.seconds * spread),
                      step_model.our_eval_seconds(work, device, gpus, per_node, compiled), window, schedule, mean,
                      (low, high), init, work, overlaps(env), per_node,
                      step_model.step_time(nvidia, device, gpus, overlaps(env), per_node=per_node), nvidia, env,
                      dict(config_vars or {}), run_limit(env, gbs, name))


def _int(value: str | None) -> int | None:
    return int(value) if value else None


# ---------------------------------------------------------------------------------------------
# Printing


def fp8_recipe(env: Mapping[str, str]) -> tuple[str, str] | None:
    """An FP8 set-up's recipe and layers (the trainer's defaults where the config sets none)."""
    if env.get("PRECISION") != "fp8":
        return None
    return env.get("FP8_RECIPE") or "tensorwise", env.get("FP8_LAYERS") or "encoder"


def unmeasured(p: Prediction, measured: Iterable[Mapping[str, str]]) -> list[str]:
    """What in our step's prediction no measurement of this code reaches yet (`measured`: the variables of the
    measured set-ups), each with what stands in for it."""
    notes = [f"{t.name}: {t.estimate}" for t in p.step.terms if t.estimate]
    recipes = {r for env in measured if (r := fp8_recipe(env)) is not None}
    recipe = fp8_recipe(p.env)
    if recipe is not None and recipe not in recipes:
        notes.append(f"FP8 recipe {'/'.join(recipe)}: its casts' Inductor bytes at the bandwidth measured for "
                     f"bf16 and {', '.join('/'.join(r) for r in sorted(recipes)) or 'no recipe'}")
    if p.device.name != step_model.REFERENCE_DEVICE:
        notes.append(f"every term: measured on the {step_model.REFERENCE_DEVICE}, scaled to the {p.device.name} "
                     "by the datasheets' peak and bandwidth ratios")
    if p.step.comm_s > 0:
        notes.append(f"{p.step.link.name} collectives: every measured step ran on one GPU (datasheet link rates, "
                     "NCCL constants from nccl-tests)")
    if not p.work.captured:
        notes.append("host launches without a CUDA graph: host_us_per_op, a prior")
    return notes


def _nvidia_rates(p: Prediction, published: Published | None) -> str:
    with_evals = published is not None and published.includes_eval
    rate = f"{p.nvidia_rate(with_evals):,.0f} samples/s per device{' with evals' if with_evals else ''}"
    if published is not None and published.rate:
        return f"{rate}, NVIDIA published {published.rate:,.0f} (the model calibrated on NVIDIA's published rates)"
    return f"{rate} (the model calibrated on NVIDIA's published rates)"


def _terms(st: StepTime) -> str:
    return ", ".join(f"{t.name} {t.seconds * 1e3:.1f}{'*' if t.estimate else ''}" for t in st.terms)


def report(p: Prediction, published: Published | None = None, measured: Iterable[Mapping[str, str]] = ()) -> str:
    """The plan in lines; `published`: NVIDIA's figures for this config, beside its model's line; `measured`: the
    variables of the measured set-ups (`unmeasured`)."""
    gib = 1 << 30
    m, fit, st, nv = p.memory, p.fit, p.step, p.nvidia_step
    ttt, low, high = p.ttt
    evals = p.evals(p.samples)
    given = ", ".join(f"{k}={v}" for k, v in p.config_vars.items())
    notes = unmeasured(p, measured)
    lines = [
        f"{p.name}{f' [{given}]' if given else ''}: {p.gpus} x {p.device.name}, global batch {p.gbs}",
        f"  memory per device: training {m.train_peak / gib:.1f} GiB, eval {m.eval_peak / gib:.1f} GiB traced "
        f"(weights {m.weights / gib:.2f}, optimizer state {m.optimizer_state / gib:.2f}, graph pool "
        f"{m.graph_pool / gib:.1f}, step activations {m.step_transient / gib:.1f}, eval set {m.eval_set / gib:.2f}); "
        f"with margins {fit.needed_bytes / 1e9:.1f} GB of {p.device.memory_bytes / 1e9:.0f} GB: "
        + (f"headroom {fit.headroom_bytes / 1e9:.1f} GB" if fit.fits else
           f"DOES NOT FIT ({-fit.headroom_bytes / 1e9:.1f} GB short)"),
        f"  step (this code, calibrated on its measured steps): {st.seconds * 1e3:.1f} ms ({st.bound}; compute "
        f"{st.compute_s * 1e3:.1f} ms: {_terms(st)}; host {st.host_s * 1e3:.1f} ms, {st.link.name} collectives "
        f"{st.comm_s * 1e3:.1f} ms of which {st.exposed_comm_s * 1e3:.1f} ms exposed); {p.throughput:,.0f} "
        f"samples/s, {p.throughput / p.gpus:,.0f} per device",
        "  not yet measured on this code: " + ("; ".join(f"* {n}" for n in notes) if notes else "nothing"),
        f"  NVIDIA's code on this system: {nv.seconds * 1e3:.1f} ms per step (compute {nv.compute_s * 1e3:.1f} ms), "
        + _nvidia_rates(p, published),
        f"  samples to converge: RCP mean {p.samples:,.0f}, fewest the RCP bound accepts {p.samples_range[0]:,.0f} "
        f"({p.window.where()})",
        f"  evals: {evals} (every {p.schedule.interval_samples:,} samples from {p.schedule.start_samples:,}), "
        f"{p.eval_s:.1f} s each, {evals * p.eval_s / 60:.2f} min in all",
        f"  init (before run_start, untimed): about {p.init_s:.0f} s",
        "  run stops: " + (f"at {p.limit.samples:,} samples at the latest ({p.limit.words()})" if p.limit else
                           "at the target only (neither MAX_STEPS nor MAX_SAMPLES_TERMINATION set)"),
        _time_to_train(p),
    ]
    return "\n".join(lines)


def _time_to_train(p: Prediction) -> str:
    """The time to train and its range, where the run gets that far before its limit stops it."""
    ttt, low, high = p.ttt
    if p.limit is not None and not p.converges(p.samples):
        why = (" (the closed division's; this open-division recipe's own samples to converge are not modelled)"
               if _open_division(p) else ": it ends aborted, short of the target")
        return (f"  time to train: none: the run stops at {p.limit.samples:,} samples, before the {p.samples:,.0f} of "
                f"the RCP mean{why}")
    if p.limit is not None and not p.converges(p.samples_range[1]):
        return (f"  time to train: {ttt:.2f} min (range {low:.2f} - over {high:.2f}: a run that needs more than "
                f"{p.limit.samples:,} samples stops there, short of the target)")
    return f"  time to train: {ttt:.2f} min (range {low:.2f} - {high:.2f})"


def _open_division(p: Prediction) -> bool:
    return p.env.get("DIVISION", "closed") == "open"


def short_of_convergence(p: Prediction) -> str | None:
    """One line for a closed-division plan whose run stops before the samples it needs to converge (the RCP mean),
    naming the variable and the value that reaches the RCP mean plus one standard deviation; None for the others
    (an open-division recipe may converge in fewer samples than the RCP mean: Samsung's)."""
    if p.limit is None or p.converges(p.samples) or _open_division(p):
        return None
    given = ", ".join(f"{k}={v}" for k, v in p.config_vars.items())
    return (f"{p.name}{f' [{given}]' if given else ''}: the run stops at {p.limit.samples:,} samples "
            f"({p.limit.words()}), before the {p.samples:,.0f} samples it needs to converge (RCP mean): no time to "
            f"train; give {p.limit.variable}={p.limit.reaching(p.samples_range[1])} or more")


# ---------------------------------------------------------------------------------------------
# Calibration and the plot


def calibrate(preds: Sequence[Prediction], targets: Mapping[str, Published]) -> tuple[dict[str, float], float]:
    """The matmul efficiency (0.20-1.00) and fused traffic share (0.05-1.00) that minimise the squared log error
    of the per-device rates; returns them and the largest |log(predicted / published)| left."""
    best: tuple[float, dict[str, float], float] = (math.inf, {}, 0.0)
    chosen = [(p, targets[p.name]) for p in preds if p.name in targets and targets[p.name].rate]
    for mm in range(20, 101, 2):
        for share in range(5, 101, 5):
            k = {"matmul_efficiency": mm / 100, "fused_traffic_share": share / 100}
            errors = [math.log(p.nvidia_rate(pub.includes_eval, k) / (pub.rate or 1)) for p, pub in chosen]
            loss = sum(e * e for e in errors)
            if loss < best[0]:
                best = (loss, k, max(abs(e) for e in errors))
    return best[1], best[2]


def setup_env(setup: step_calibration.SetUp) -> dict[str, str]:
    """A measured set-up's variables: its config's, the measured ones on top."""
    _layout(setup.config)  # the config is there
    return {**exports(REPO / setup.config), **dict(setup.variables)}


def _layout(config: str) -> str:
    if not (REPO / config).is_file():
        raise PlanError(f"tools/measurements: no {config or 'config'} in the repository (name a config_*.sh in the "
                        "session's index.json)")
    return exports(REPO / config).get("INPUT_LAYOUT", "")


def measurements() -> step_calibration.Measurements:
    """tools/measurements, each benchmark's results of its config's layout (our step)."""
    try:
        return step_calibration.load(layout_of=_layout)
    except step_calibration.MeasurementError as err:
        raise PlanError(str(err)) from err


def trace_setups(setups: Iterable[step_calibration.SetUp], cache: bool = True,
                 as_measured: Mapping[step_calibration.SetUp, float] | None = None
                 ) -> dict[step_calibration.SetUp, tuple[step_calibration.Traced, MemoryEstimate]]:
    """Each measured set-up's work (today's code; Inductor's count of a compiled one's step, or `as_measured`'s
    count of the code as measured where it gives one) and memory."""
    envs = {setup.label: setup_env(setup) for setup in setups}
    traced = dry_runs(envs, envs, cache)
    found = {}
    for setup in setups:
        done = traced[setup.label]
        work = StepWork.from_dict(done["work"])
        counted = inductor_bytes(done)
        if as_measured and setup in as_measured:
            if counted is None:
                raise PlanError(f"tools/measurements: inductor_as_measured counts {setup.label}, whose layers run "
                                "eager: give it for compiled set-ups only")
            counted = as_measured[setup]
        features = step_model.features(work.step, work.compiled, counted)
        found[setup] = (step_calibration.Traced(features, work.captured), memory_from_dict(done["memory"]))
    return found


@dataclass(frozen=True)
class OurCalibration:
    measured: step_calibration.Measurements
    traced: Mapping[step_calibration.SetUp, tuple[step_calibration.Traced, MemoryEstimate]]
    fit: step_calibration.Fit
    checks: list[step_calibration.Check]
    ranges: list[step_calibration.ElementwiseRange]  # each profile's element-wise time against the fit's


def calibrate_ours(cache: bool = True) -> OurCalibration:
    """Our step's constants fitted to tools/measurements (step_calibration), each set-up fitted and left out, and
    each profile's element-wise range against the fit."""
    m = measurements()
    traced = trace_setups({t.setup for t in m.timed} | {p.setup for p in m.profiles} | {x.setup for x in m.memory},
                          cache, m.inductor_as_measured)
    profiles = [(p, traced[p.setup][0]) for p in m.profiles]
    profiled = step_calibration.profile_constants(profiles)
    observations = [step_calibration.Observation(t, traced[t.setup][0]) for t in m.timed]
    fitted = step_calibration.fit(observations, profiled)
    return OurCalibration(m, traced, fitted, step_calibration.checks(observations, profiled),
                          step_calibration.elementwise_ranges(profiles, fitted.constants))


def plot(preds: Sequence[Prediction], pubs: Mapping[str, Published], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, ax = plt.subplots(figsize=(6, 5))
    shown = [(p, pubs[p.name]) for p in preds if p.name in pubs and pubs[p.name].minutes and p.converges(p.samples)]
    for p, pub in shown:
        ttt, low, high = p.ttt
        published_minutes = pub.minutes or 0.0  # `shown` holds only those with minutes
        ax.errorbar([published_minutes], [ttt], yerr=[[ttt - low], [high - ttt]], fmt="o", capsize=3)
        ax.annotate(p.name.removeprefix("config_").removesuffix(".sh"), (published_minutes, ttt), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")
    values = [v for p, pub in shown for v in (p.ttt[1], p.ttt[2], pub.minutes or 1)] or [1.0]
    ends = [min(values) / 1.5, max(values) * 1.5]
    ax.plot(ends, ends, "k--", linewidth=0.8, label="predicted = published")
    ax.set_xscale("log")
    ax.set_yscale("log")  # 0.4 to 60 minutes on one picture
    for axis in (ax.xaxis, ax.yaxis):  # minutes as plain numbers, at 1, 2 and 5 of each power of ten
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("published time to train (min, olympic mean)")
    ax.set_ylabel("predicted time to train of this code (min)")
    ax.set_title("tools/plan.py: this code predicted against the published runs")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (argparse adds the usage)
        print(f"plan.py: {message}", file=sys.stderr)
        sys.exit(2)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", type=Path, help="a config_*.sh file")
    p.add_argument("--gpus", type=int, help="plan the config's recipe on this many devices (a hypothetical system)")
    p.add_argument("--device", choices=sorted(DEVICES), help="the device (default: the config's DGXSYSTEM's)")
    p.add_argument("--all", action="store_true", help="every shipped GPU config")
    p.add_argument("--plot", type=output_file, metavar="FILE", help="draw predicted against published time to train")
    p.add_argument("--config_var", action="append", default=[], metavar="NAME=VALUE",
                   help="set a config variable on top of the config (repeatable), e.g. PRECISION=fp8")
    p.add_argument("--calibrate", action="store_true", help="refit our step's constants to tools/measurements and "
                                                            "NVIDIA's efficiencies to the published rates")
    p.add_argument("--no_cache", action="store_true", help="trace again even when a cached trace matches")
    args = p.parse_args(argv)
    if args.config is None and not (args.all or args.plot or args.calibrate):
        p.error("give a config_*.sh file, or --all")
    return args


def config_vars(given: Sequence[str]) -> dict[str, str]:
    """`--config_var NAME=VALUE` flags as {NAME: VALUE} (a later one wins), each a variable run_and_time.sh reads."""
    launcher = (REPO / "run_and_time.sh").read_text()
    found = {}
    for item in given:
        name, equals, value = item.partition("=")
        if not equals or not re.fullmatch(r"[A-Z][A-Z0-9_]*", name):
            raise PlanError(f"--config_var {item}: give NAME=VALUE with an upper-case config variable name, e.g. "
                            "--config_var PRECISION=fp8")
        if not re.search(rf"\b{name}\b", launcher):
            raise PlanError(f"--config_var {item}: run_and_time.sh reads no variable {name}")
        found[name] = value
    return found


def plans(configs: Sequence[Path], gpus: int | None, device: str | None, cache: bool,
          variables: Mapping[str, str] | None = None) -> list[Prediction]:
    envs, devices = {}, {}
    for config in configs:
        if not config.is_file():
            raise PlanError(f"{config}: no such config file (give a config_*.sh)")
        devices[config.name] = device or device_of(exports(config), config)
        envs[config.name] = {**config_env(config, gpus, devices[config.name]), **(variables or {})}
        batch = config_batch_shape(envs[config.name], config.name)  # a batch the trainer refuses, before tracing it
        run_limit(envs[config.name], batch.global_batch_size, config.name)
    extra = {}  # the step in NVIDIA's precision, which NVIDIA's model reads
    for name, env in envs.items():
        other = nvidia_env(env, DEVICES[devices[name]])
        if other is not None:
            extra[f"{name} in NVIDIA's precision"] = other
    traced = dry_runs({**envs, **extra}, envs, cache)
    return [predict(name, envs[name], DEVICES[devices[name]], traced[name], variables,
                    traced.get(f"{name} in NVIDIA's precision")) for name in envs]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    problem = args.plot and matplotlib_problem("--plot", "leave out --plot", "matplotlib.pyplot")
    if problem:  # before the traces, which take minutes
        print(f"plan.py: {problem}", file=sys.stderr)
        return 2
    try:
        many = args.all or args.plot or args.calibrate
        configs = shipped_gpu_configs() if many and args.config is None else [args.config]
        variables = config_vars(args.config_var)
        preds = plans(configs, args.gpus, args.device, not args.no_cache, variables)
        pubs, measured = published(), [setup_env(t.setup) for t in measurements().timed]
        as_published = not (variables or args.gpus or args.device)  # the system the published figures are of
        for p in preds:
            print(report(p, pubs.get(p.name) if as_published else None, measured))
        if args.calibrate:
            ours = calibrate_ours(not args.no_cache)
            print("our step, calibrated on tools/measurements (step_model.OURS):")
            print("\n".join(step_calibration.table(ours.fit, ours.checks, ours.ranges)))
            fitted, spread = calibrate(preds, pubs)
            print(f"NVIDIA's code, calibrated on the published rates (step_model.CALIBRATION): {fitted}; largest "
                  f"|log(predicted / published)| {spread:.3f}")
        if args.plot:
            plot(preds, pubs, args.plot)
            print(f"plot: {args.plot}")
    except (PlanError, scoring.ScoringError) as err:
        print(f"plan.py: {err}", file=sys.stderr)
        return 2
    short = [line for p in preds if (line := short_of_convergence(p))]
    for line in short:
        print(f"plan.py: {line}", file=sys.stderr)
    return 2 if short else 0


if __name__ == "__main__":
    sys.exit(main())
