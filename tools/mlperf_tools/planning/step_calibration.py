"""Our step's calibration: the GPU measurements kept in tools/measurements, and the fit of
`step_model.OURS` to them (`tools/plan.py --calibrate` runs it and prints the table to paste).

Each GPU session is a folder `tools/measurements/<device>-<date>/` holding the files it measured and
an `index.json`: date, device (a `step_model.DEVICES` key), commit, software, how the code then
differed from today's, and per file the command and the set-up, a config and the variables set on
top of it (those `benchmarks/throughput.py --config_var` takes). Three kinds of file:
- benchmarks: `benchmarks/throughput.py --json` files, or `tools/gpu_perf.sh`'s `throughput.json`
  ({step label: such a file}). Each result of the config's own layout is a step of our code; its
  set-up is the entry's, then the file's and the result's `config_vars`, then its precision.
- profiles: the kernel table of `--profile_dir` (`steps` profiled steps). Its GEMM, attention and
  optimizer kernels give those kinds' rates directly. The table lists the largest kernels only:
  its element-wise kernels and its device time left unlisted bound the step's element-wise time
  (`ElementwiseRange`), which the fit's must fall within.
- memory: a measured peak (torch.cuda.max_memory_allocated of a real dry run) of a set-up.
- inductor_as_measured: for a compiled set-up, Inductor's element-wise bytes per step of the code as it was
  measured (`python -m mlperf_bert.dryrun.compiled` over that commit's model files, its `command`), where
  today's code moves other bytes than the steps timed: the fit lays the timed steps against those.

The fit: the work of each measured set-up comes from the dry run's trace of that set-up with
today's code and, for a compiled set-up, from Inductor's count of its compiled regions' kernels
(`step_model.features`), the code as measured where the index gives that count; the profile gives
`gemm_efficiency`, `attention_efficiency` and
`optimizer_bandwidth`, and the step times give the constants in `step_model.FITTED`. The model
is linear in the inverse of each of those, so they are one least-squares solve of the relative
errors, with a weak pull (`PULL`) towards each constant's prior: a constant that no measured set-up
exercises stays at its prior and is reported as not measured. Leave-one-out: each set-up's step
predicted from a fit without it (the profile stays: it times kernels, not the step).
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from mlperf_tools.planning import step_model
from mlperf_tools.planning.step_model import DEVICES, Device, StepFeatures

MEASUREMENTS = Path(__file__).resolve().parents[2] / "measurements"  # tools/measurements
PULL = 1e-8  # weight of each fitted constant's relative distance from its prior, against a step's relative error
FP8_VARIABLES = ("FP8_RECIPE", "FP8_LAYERS")
# Profiler kernel names -> the kind of work our step's model times (the rest is element-wise).
KERNEL_KINDS = {"attention": ("sdpa", "flash", "fmha", "attention", "dot_do_o"),
                "GEMMs": ("nvjet", "gemm", "cutlass", "xmma"),
                "optimizer": ("multi_tensor",)}


class MeasurementError(Exception):
    """A measurement file or index that cannot be read; the message names the file and the fix."""


# ---------------------------------------------------------------------------------------------
# The measurements


@dataclass(frozen=True)
class SetUp:
    """What was measured: a config with variables set on top of it, on a device."""

    device: str  # a step_model.DEVICES key
    config: str  # config_*.sh
    variables: tuple[tuple[str, str], ...]  # sorted

    @classmethod
    def of(cls, device: str, config: str, variables: Mapping[str, str]) -> "SetUp":
        given = dict(variables)
        if given.get("PRECISION", "fp8") != "fp8":
            for name in FP8_VARIABLES:  # a recipe means nothing to a bf16 step: the same set-up without it
                given.pop(name, None)
        return cls(device, config, tuple(sorted(given.items())))

    @property
    def label(self) -> str:
        given = ", ".join(f"{k}={v}" for k, v in self.variables)
        return f"{self.device} {self.config}" + (f" [{given}]" if given else "")


@dataclass(frozen=True)
class Session:
    folder: Path
    date: str
    device: str
    commit: str


@dataclass(frozen=True)
class Timed:
    """One benchmark result of our step."""

    setup: SetUp
    ms_per_step: float
    session: Session
    file: str
    command: str


@dataclass(frozen=True)
class Profiled:
    """A profile's per-step device time by kind of kernel."""

    setup: SetUp
    ms_per_step: Mapping[str, float]  # KERNEL_KINDS' kinds and "element-wise", of the kernels the table lists
    session: Session
    file: str
    device_ms_per_step: float | None = None  # every kernel's (the table's "Self CUDA time total"), listed or not

    @property
    def unlisted_ms(self) -> float:
        """Device time per step of the kernels the table leaves out (0 without its total)."""
        return max((self.device_ms_per_step or 0.0) - sum(self.ms_per_step.values()), 0.0)


@dataclass(frozen=True)
class MemoryPeak:
    setup: SetUp
    peak_gib: float
    session: Session
    command: str


@dataclass
class Measurements:
    timed: list[Timed] = field(default_factory=list)
    profiles: list[Profiled] = field(default_factory=list)
    memory: list[MemoryPeak] = field(default_factory=list)
    # Inductor's element-wise bytes per step of a compiled set-up's code as measured (the index's
    # `inductor_as_measured`): what the fit lays its timed steps against, in place of today's count
    inductor_as_measured: dict[SetUp, float] = field(default_factory=dict)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise MeasurementError(f"{path}: {err} (an index.json names files kept beside it)") from err


def _session(folder: Path, index: Mapping[str, Any]) -> Session:
    missing = [k for k in ("date", "device", "commit") if k not in index]
    if missing or index.get("device") not in DEVICES:
        raise MeasurementError(f"{folder / 'index.json'}: give date, commit and a device of {', '.join(DEVICES)} "
                               f"(missing or unknown: {', '.join(missing) or index.get('device')})")
    return Session(folder, index["date"], index["device"], index["commit"])


def _benchmark_files(data: Any, path: Path) -> list[dict[str, Any]]:
    """A throughput.py --json file, or gpu_perf.sh's {label: such a file or null}."""
    if isinstance(data, dict) and isinstance(data.get("results"), list):
        return [data]
    if isinstance(data, dict) and all(v is None or isinstance(v, dict) for v in data.values()):
        return [v for v in data.values() if v and isinstance(v.get("results"), list)]
    raise MeasurementError(f"{path}: neither a benchmarks/throughput.py --json file nor tools/gpu_perf.sh's "
                           "throughput.json")


def _timed(entry: Mapping[str, Any], session: Session, layout: str) -> list[Timed]:
    """The results of one benchmark entry that time our step (the config's layout), each with its set-up."""
    path = session.folder / entry["file"]
    found = []
    for bench in _benchmark_files(_read_json(path), path):
        config = entry.get("config") or Path(bench.get("from_config") or "").name
        for result in bench["results"]:
            if result.get("status") != "ok" or result.get("layout") != layout:
                continue
            variables = {**entry.get("setup", {}), **bench.get("config_vars", {}), **result.get("config_vars", {}),
                         "PRECISION": result["precision"]}
            found.append(Timed(SetUp.of(session.device, config, variables), 1e3 * result["seconds"] / result["steps"],
                               session, entry["file"], entry.get("command", "")))
    return found


def kernel_times(table: str) -> list[tuple[str, float]]:
    """(name, seconds of device time) per row of a torch.profiler table (`Self CUDA` column)."""
    rows = [line for line in table.splitlines() if line.strip() and not line.startswith("-")]
    columns = re.split(r"\s{2,}", rows[0].strip()) if rows else []
    if "Self CUDA" not in columns:
        raise ValueError(f"no 'Self CUDA' column in the profiler table's header {columns}")
    unit = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    times = []
    for row in rows[1:]:
        cells = re.split(r"\s{2,}", row.strip())
        if len(cells) == len(columns):
            value = re.fullmatch(r"([\d.]+)(s|ms|us|ns)", cells[columns.index("Self CUDA")])
            if value:
                times.append((cells[0], float(value.group(1)) * unit[value.group(2)]))
    return times


def total_device_seconds(table: str) -> float | None:
    """The profiler table's "Self CUDA time total" (every kernel, listed or not), in seconds; None without it."""
    found = re.search(r"Self CUDA time total:\s*([\d.]+)(s|ms|us|ns)\b", table)
    unit = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    return float(found.group(1)) * unit[found.group(2)] if found else None


def kernel_kind(name: str) -> str:
    return next((kind for kind, marks in KERNEL_KINDS.items() if any(m in name for m in marks)), "element-wise")


def _profiled(entry: Mapping[str, Any], session: Session) -> Profiled:
    path = session.folder / entry["file"]
    try:
        table = path.read_text()
        times = kernel_times(table)
    except (OSError, ValueError) as err:
        raise MeasurementError(f"{path}: {err}") from err
    by_kind: defaultdict[str, float] = defaultdict(float)
    for name, seconds in times:
        by_kind[kernel_kind(name)] += 1e3 * seconds / entry["steps"]
    total = total_device_seconds(table)
    return Profiled(SetUp.of(session.device, entry["config"], entry.get("setup", {})), dict(by_kind), session,
                    entry["file"], None if total is None else 1e3 * total / entry["steps"])


def load(root: Path = MEASUREMENTS, layout_of: Callable[[str], str] = lambda config: "packed") -> Measurements:
    """Every session under `root` (folders with an index.json). layout_of: a config's INPUT_LAYOUT, the layout
    whose results time our step."""
    found = Measurements()
    for index_path in sorted(root.glob("*/index.json")):
        index = _read_json(index_path)
        session = _session(index_path.parent, index)
        for entry in index.get("benchmarks", []):
            found.timed += _timed(entry, session, layout_of(entry.get("config", "")))
        found.profiles += [_profiled(entry, session) for entry in index.get("profiles", [])]
        found.memory += [MemoryPeak(SetUp.of(session.device, m["config"], m.get("setup", {})), m["peak_gib"], session,
                                    m.get("command", "")) for m in index.get("memory", [])]
        found.inductor_as_measured.update(_as_measured(index, index_path))
    known = {t.setup for t in found.timed} | {p.setup for p in found.profiles}
    for setup in found.inductor_as_measured:
        if setup not in known:
            raise MeasurementError(f"{root}: inductor_as_measured names {setup.label}, which no benchmark or profile "
                                   "times: give the set-up of a timed compiled step")
    return found


def _as_measured(index: Mapping[str, Any], path: Path) -> dict[SetUp, float]:
    found = {}
    for entry in index.get("inductor_as_measured", []):
        gb = entry.get("elementwise_gb")
        if not isinstance(gb, (int, float)) or gb <= 0 or "config" not in entry or not entry.get("command"):
            raise MeasurementError(f"{path}: each inductor_as_measured entry gives config, setup, elementwise_gb (> 0) "
                                   f"and the command that counted it; got {entry}")
        found[SetUp.of(index["device"], entry["config"], entry.get("setup", {}))] = 1e9 * float(gb)
    return found


def compiles(env: Mapping[str, str]) -> bool:
    """Whether a set-up's layers run compiled (the trainer's default, without COMPILE_MODE, is eager)."""
    return env.get("COMPILE_MODE", "none") != "none"


# ---------------------------------------------------------------------------------------------
# The fit


@dataclass(frozen=True)
class Traced:
    """A set-up's work as the dry run traces it with today's code, and the bytes of its compiled kernels: Inductor's
    count of today's code, or of the code as measured where the index gives one (`inductor_as_measured`)."""

    features: StepFeatures
    captured: bool


@dataclass(frozen=True)
class Observation:
    timed: Timed
    traced: Traced

    @property
    def device(self) -> Device:
        return DEVICES[self.timed.setup.device]

    def predict(self, c: Mapping[str, float]) -> float:
        """Milliseconds of compute for the step, one device (every measured set-up ran on one)."""
        t = self.traced
        return 1e3 * sum(term.seconds for term in step_model.our_terms(t.features, self.device, t.captured, c))


def profile_constants(profiles: Sequence[tuple[Profiled, Traced]]) -> dict[str, float]:
    """Each kind's rate from the profiles' kernel times and the traced work of the profiled set-up (the mean over
    profiles that time it). A profile of a per-sequence attention step times varlen_efficiency."""
    found: defaultdict[str, list[float]] = defaultdict(list)
    for profiled, traced in profiles:
        f, device, ms = traced.features, DEVICES[profiled.setup.device], profiled.ms_per_step
        fp8 = device.fp8_flops or device.bf16_flops
        if ms.get("GEMMs"):
            found["gemm_efficiency"].append((f.gemm_flops / device.bf16_flops + f.fp8_flops / fp8) / (ms["GEMMs"] / 1e3))
        if ms.get("attention"):
            varlen = f.varlen_flops > f.attention_flops
            flops = f.varlen_flops if varlen else f.attention_flops
            found["varlen_efficiency" if varlen else "attention_efficiency"].append(
                flops / (device.bf16_flops * ms["attention"] / 1e3))
        if ms.get("optimizer"):
            found["optimizer_bandwidth"].append(f.optimizer_bytes / (device.hbm_bytes_per_s * ms["optimizer"] / 1e3))
    return {name: sum(values) / len(values) for name, values in found.items()}


ELEMENTWISE_TERMS = ("compiled element-wise", "element-wise")  # step_model.our_terms' element-wise work


@dataclass(frozen=True)
class ElementwiseRange:
    """A profiled step's element-wise time: at least the element-wise kernels its table lists, at most those and
    every kernel it leaves out; against the model's for that step (`fitted_ms`)."""

    setup: SetUp
    listed_ms: float
    unlisted_ms: float
    fitted_ms: float

    @property
    def holds(self) -> bool:
        return self.listed_ms <= self.fitted_ms <= self.listed_ms + self.unlisted_ms


def elementwise_ranges(profiles: Sequence[tuple[Profiled, Traced]], c: Mapping[str, float]) -> list[ElementwiseRange]:
    """Each profile's element-wise range, against the element-wise terms of its set-up with the constants `c`."""
    found = []
    for profiled, traced in profiles:
        terms = step_model.our_terms(traced.features, DEVICES[profiled.setup.device], traced.captured, c)
        fitted = 1e3 * sum(t.seconds for t in terms if t.name in ELEMENTWISE_TERMS)
        found.append(ElementwiseRange(profiled.setup, profiled.ms_per_step.get("element-wise", 0.0),
                                      profiled.unlisted_ms, fitted))
    return found


@dataclass(frozen=True)
class Fit:
    constants: dict[str, float]  # step_model.OURS's names
    measured: frozenset[str]  # the constants a measurement reached (the rest are priors)


def _solve(observations: Sequence[Observation], base: dict[str, float], names: Sequence[str]) -> dict[str, float]:
    """The constants `names` the steps reach, by least squares of their relative errors, each pulled weakly towards
    its value in `base` (the prior); the rest of `base` held. The model is linear in u = 1 / constant (a constant
    at infinity takes its term away)."""
    if not observations or not names:
        return {}
    fixed = [o.predict(base | {n: math.inf for n in names}) for o in observations]
    design = np.array([[o.predict(base | {m: (1.0 if m == n else math.inf) for m in names}) - f0 for n in names]
                       for o, f0 in zip(observations, fixed)]).reshape(len(observations), len(names))
    measured_ms = np.array([o.timed.ms_per_step for o in observations])
    prior = np.array([1 / base[n] for n in names])
    rows = np.vstack([design / measured_ms[:, None], math.sqrt(PULL) * np.diag(1 / prior)])
    target = np.concatenate([(measured_ms - np.array(fixed)) / measured_ms, math.sqrt(PULL) * np.ones(len(names))])
    inverse = np.linalg.lstsq(rows, target, rcond=None)[0]
    reached = {n for j, n in enumerate(names) if np.any(design[:, j] > 0)}
    if any(u <= 0 for n, u in zip(names, inverse) if n in reached):
        raise MeasurementError(f"the measured steps leave no time for {', '.join(sorted(reached))}: each is shorter "
                               "than its measured kernels alone (a profile or a step of another set-up?)")
    return {n: 1 / float(u) for n, u in zip(names, inverse) if n in reached}


def fit(observations: Sequence[Observation], profiled: Mapping[str, float]) -> Fit:
    """The fitted constants (`step_model.FITTED`), each pulled weakly towards its prior; the profile's constants as
    given. The eager steps first, on the constants they reach; then the compiled steps, on the rest but
    `step_model.EAGER_STEPS_ONLY`, which they take from the eager steps (or the prior)."""
    known = step_model.ours(profiled)
    base = known | step_model.priors(known) | dict(profiled)
    names = [n for n in step_model.FITTED if n not in profiled]
    eager = [o for o in observations if not o.traced.features.inductor_bytes]
    first = _solve(eager, base, names)
    rest = [n for n in names if n not in first and n not in step_model.EAGER_STEPS_ONLY]
    second = _solve([o for o in observations if o not in eager], base | first, rest)
    return Fit(base | first | second, frozenset(first.keys() | second.keys() | set(profiled)))


@dataclass(frozen=True)
class Check:
    """A measured set-up against the model: fitted on everything, and fitted without it (leave-one-out)."""

    setup: SetUp
    measured_ms: float  # the mean of its measurements
    fitted_ms: float
    left_out_ms: float

    @staticmethod
    def miss(predicted: float, measured: float) -> float:
        return math.log(predicted / measured)


def checks(observations: Sequence[Observation], profiled: Mapping[str, float]) -> list[Check]:
    everything = fit(observations, profiled).constants
    by_setup: defaultdict[SetUp, list[Observation]] = defaultdict(list)
    for o in observations:
        by_setup[o.timed.setup].append(o)
    found = []
    for setup, own in by_setup.items():
        others = fit([o for o in observations if o.timed.setup != setup], profiled).constants
        measured = sum(o.timed.ms_per_step for o in own) / len(own)
        found.append(Check(setup, measured, own[0].predict(everything), own[0].predict(others)))
    return found


def spread(found: Iterable[Check]) -> float:
    """The largest leave-one-out |log(predicted / measured)|: the range a prediction of an unmeasured set-up gets."""
    return max((abs(Check.miss(c.left_out_ms, c.measured_ms)) for c in found), default=0.0)


def table(result: Fit, found: Sequence[Check], ranges: Sequence[ElementwiseRange] = ()) -> list[str]:
    """`--calibrate`'s report: the constants, each set-up fitted and left out, and each profile's element-wise
    range."""
    shown = [n for n in step_model.OURS if n in result.measured or n in step_model.FITTED]
    status = {True: "measured", False: "its prior: no measurement reaches it"}
    lines = [f"  {name} = {result.constants[name]:.4g} ({status[name in result.measured]})" for name in shown]
    for c in found:
        lines.append(f"  {c.setup.label}: measured {c.measured_ms:.1f} ms, fitted {c.fitted_ms:.1f} "
                     f"({c.fitted_ms / c.measured_ms - 1:+.1%}), left out {c.left_out_ms:.1f} "
                     f"({c.left_out_ms / c.measured_ms - 1:+.1%})")
    for r in ranges:
        lines.append(f"  {r.setup.label}: element-wise {r.fitted_ms:.1f} ms fitted, the profile's "
                     f"{r.listed_ms:.1f} ms listed to {r.listed_ms + r.unlisted_ms:.1f} with every unlisted kernel "
                     f"({'within' if r.holds else 'OUTSIDE'})")
    lines.append(f"  step_time_spread = {spread(found):.3f} (the largest leave-one-out |log miss|)")
    return lines
