"""Build, check and score an MLPerf Training submission package for BERT.

  pack RUN_DIR --config config_X.sh --out OUT [--ruleset 5.0.0] [--select N] [--strict]
      RUN_DIR holds one MLPerf log per run (e.g. run_with_docker.sh's LOGDIR). Writes
      OUT/<ORG>/results/<DGXSYSTEM>/bert/result_<i>.txt and OUT/<ORG>/systems/<DGXSYSTEM>.json,
      and OUT/<ORG>/results/<DGXSYSTEM>/sources.txt, which says which log became which
      result_<i>.txt (printed too); then checks and scores the package in place, with the
      checkers' logs in OUT/checker_logs/ unless --logs says otherwise. Runs that differ in a
      hyperparameter one result fixes (global batch size, learning rate, ...) are refused.
      --select N: from more than N runs, the N consecutive ones (by run_start) whose olympic score
      is the median of all windows (training_rules.adoc §12.1); the others are named as dropped.
  check PACKAGE_DIR [--ruleset 5.0.0] [--strict]
      Checks and scores an existing package (ORG/ with results/ and systems/) on a temporary copy,
      so the input is never modified (the package checker writes scaling.json files). The copy
      and, without --logs, the checkers' logs are removed at the end, also on failure.
  rcp [config_X.sh ...] [--gbs N] [--ruleset 5.0.0] [--write]
      The RCP window of each config's global batch size (or of N): covered by an RCP, interpolated
      between two (named), or below / above every RCP; the RCP mean of samples to converge, the
      minimum acceptable olympic mean and the maximum speed-up, from mlperf_logging's RCP checker.
      One `# RCP (...)` comment line each; --write puts it into the config.
  sysjson
      Prints one `:::SYSJSON {...}` line describing this machine and the config in the environment.
      The launchers run it inside the container before each run, so the description of the machine
      that trained travels with the log and `pack` can use it on any other machine.

Checks: first that every result file holds MLPerf log lines (a file with none, such as a note, is
named in one line and the checks stop there). Then every result file through the compliance checker, and whether it converged: one run that
did not (or one file that does not comply) counts as the slowest and is dropped by the olympic mean,
as training_rules.adoc §12 and the official package checker allow; two fail the package, and
--strict accepts none. Every closed-division result file against the closed-division rules the
trainer enforces (`mlperf_bert/config/closed_division.py`: eval set size, eval interval, target,
optimizer, ..., which the official checkers do not read; a rule whose key a log lacks is noted, not
failed), each run's initialization (init_start to run_start) against its division's maximum (§11:
30 minutes closed, 4 hours open), and all result files of a system against each other (one set of
hyperparameters). Then
`python -m mlperf_logging.package_checker ORG training RULESET` (which exits 0 even on errors: its
verdict is the line `PACKAGE CHECKER FOUND NO ERRORS`), `python -m mlperf_logging.rcp_checker` for
closed-division systems (with the window, the olympic mean of samples to converge and its margin
to the bound), and `python -m mlperf_logging.result_summarizer ORG training RULESET --csv` for the
score, printed with the olympic mean and the normalization factor it applied. Exit status 0 only
when everything passes and every system has a score.

The ruleset must match the logs: 5.0.0 for this project; published vendor logs use the ruleset
of their round (v2.0 -> 2.0.0, v4.1 -> 4.1.0).
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from mlperf_tools.results.compare import MLLOG_TOKEN, SYSJSON_TOKEN, RunLog, is_run_log, natural_key, olympic_mean, read_run
from mlperf_bert.config.batch_size import SEQUENCES_PER_PACK, config_batch
from mlperf_bert.config.closed_division import broken_rules, init_overrun, unchecked_keys
from mlperf_bert.runtime.files import json_object
from mlperf_tools.results.scoring import (RcpVerdict, ScoringError, Selection, hyperparameter_mismatches, quiet_logging,
                     rcp_verdict, rcp_window, run_minutes, select_consecutive)

BENCHMARK = "bert"
RUNS_PER_SUBMISSION = 10  # MLPerf Training needs 10 BERT runs for an olympic score
DEFAULT_RULESET = "5.0.0"

# Every field the training system-description checker (mlperf_logging 4.1.68) requires.
SYSTEM_FIELDS = (
    "submitter", "division", "status", "system_name", "number_of_nodes",
    "host_processors_per_node", "host_processor_model_name", "host_processor_core_count",
    "host_processor_vcpu_count", "host_processor_frequency", "host_processor_caches",
    "host_processor_interconnect", "host_memory_capacity", "host_storage_type",
    "host_storage_capacity", "host_networking", "host_networking_topology",
    "host_memory_configuration", "accelerators_per_node", "accelerator_model_name",
    "accelerator_host_interconnect", "accelerator_frequency", "accelerator_on-chip_memories",
    "accelerator_memory_configuration", "accelerator_memory_capacity", "accelerator_interconnect",
    "accelerator_interconnect_topology", "cooling", "hw_notes", "framework",
    "other_software_stack", "operating_system", "sw_notes",
)

# Rulesets >= 4.0.0 only accept the availability texts below in `status`; submission_status
# values ("onprem", ...) map to them.
AVAILABILITY = {
    "onprem": "Available on-premise",
    "available": "Available on-premise",
    "cloud": "Available cloud",
    "research": "Research, Development, or Internal (RDI)",
    "rdi": "Research, Development, or Internal (RDI)",
    "preview": "Preview",
}


class PackageError(Exception):
    """Bad input: the message says which file or variable and how to fix it."""


# ---------------------------------------------------------------------------------------------
# Config and machine description


def read_config(path: Path) -> dict[str, str]:
    """The variables a config_<SYSTEM>.sh exports, evaluated by bash exactly as the launchers do."""
    if not path.is_file():
        raise PackageError(f"config file {path} not found (pass --config config_<SYSTEM>.sh)")
    script = 'set -e; source "$1"; env -0'
    done = subprocess.run(["env", "-i", "bash", "-c", script, "_", str(path)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise PackageError(f"sourcing {path} failed: {done.stderr.strip()}")
    pairs = (item.split("=", 1) for item in done.stdout.split("\0") if "=" in item)
    return {k: v for k, v in pairs if k not in ("PWD", "SHLVL", "_")}


def _require(config: Mapping[str, str], name: str) -> str:
    value = config.get(name, "")
    if not value:
        raise PackageError(f"{name} is not set: add `export {name}=...` to the config file")
    return value


def _cpu_facts() -> dict[str, str]:
    """Model, sockets, cores per socket and logical CPUs from /proc/cpuinfo (Linux)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return {}
    text = cpuinfo.read_text()
    models = re.findall(r"^model name\s*:\s*(.+)$", text, re.M)
    sockets = set(re.findall(r"^physical id\s*:\s*(\d+)$", text, re.M))
    cores = re.findall(r"^cpu cores\s*:\s*(\d+)$", text, re.M)
    facts = {"host_processor_vcpu_count": str(len(models) or os.cpu_count() or "")}
    if models:
        facts["host_processor_model_name"] = models[0].strip()
    facts["host_processors_per_node"] = str(len(sockets) or 1)
    if cores:
        facts["host_processor_core_count"] = cores[0]
    return facts


def _memory_facts() -> dict[str, str]:
    """Host memory from /proc/meminfo, in GB (decimal) as MLPerf descriptions write it."""
    meminfo = Path("/proc/meminfo")
    found = re.search(r"^MemTotal:\s*(\d+) kB", meminfo.read_text(), re.M) if meminfo.is_file() else None
    if not found:
        return {}
    gigabytes = int(found.group(1)) * 1024 / 1e9
    text = f"{gigabytes / 1000:.1f} TB" if gigabytes >= 1000 else f"{gigabytes:.0f} GB"
    return {"host_memory_capacity": text}


def _gpu_facts() -> dict[str, Any]:
    """Accelerator model, memory and driver from nvidia-smi (empty without NVIDIA GPUs)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    done = subprocess.run(query, capture_output=True, text=True, check=False)
    rows = [line.split(", ") for line in done.stdout.strip().splitlines() if line.count(", ") == 2]
    if done.returncode != 0 or not rows:
        return {}
    name, memory, driver = rows[0]
    return {"accelerator_model_name": name, "accelerator_memory_capacity": memory,
            "cuda_driver_version": driver}


def _software_facts() -> dict[str, Any]:
    """Framework and library versions from package metadata and the NGC image's variables
    (CUDA_VERSION, NCCL_VERSION, ...); torch is not imported, so no CUDA context is created."""
    stack: dict[str, str] = {"kernel_version": platform.release()}
    try:
        framework = f"PyTorch {importlib.metadata.version('torch')}"
    except importlib.metadata.PackageNotFoundError:
        framework = ""
    if os.environ.get("NVIDIA_PYTORCH_VERSION"):
        framework = f"PyTorch NVIDIA Release {os.environ['NVIDIA_PYTORCH_VERSION']}"
    for variable, name in (("CUDA_VERSION", "cuda_version"), ("NCCL_VERSION", "nccl_version"),
                           ("CUDNN_VERSION", "cudnn_version"), ("CUBLAS_VERSION", "cublas_version"),
                           ("DALI_VERSION", "dali_version"), ("OPENMPI_VERSION", "openmpi_version")):
        if os.environ.get(variable):
            stack[name] = os.environ[variable]
    return {"framework": framework, "other_software_stack": stack}


def _os_facts() -> dict[str, str]:
    release = Path("/etc/os-release")
    found = re.search(r'^PRETTY_NAME="?([^"\n]+)"?$', release.read_text(), re.M) if release.is_file() else None
    return {"operating_system": found.group(1) if found else platform.platform()}


def gather_machine() -> dict[str, Any]:
    """What can be read from the machine this runs on (meant to run on the training machine)."""
    facts: dict[str, Any] = {}
    for part in (_cpu_facts(), _memory_facts(), _os_facts(), _software_facts()):
        facts.update(part)
    gpu = _gpu_facts()
    driver = gpu.pop("cuda_driver_version", None)
    facts.update(gpu)
    if driver:
        facts["other_software_stack"]["cuda_driver_version"] = driver
    return facts


def availability(status: str) -> str:
    """Map a logged submission_status ("onprem", "cloud", ...) to the checker's availability text."""
    if status in AVAILABILITY.values():
        return status
    if status.strip().lower() not in AVAILABILITY:
        raise PackageError(f"unknown submission status {status!r}: set SUBMISSION_STATUS to one of "
                           f"{sorted(AVAILABILITY)} or {sorted(set(AVAILABILITY.values()))}")
    return AVAILABILITY[status.strip().lower()]


def describe_system(config: Mapping[str, str], machine: Mapping[str, Any]) -> dict[str, Any]:
    """An MLPerf system description: the config says what was run, the machine what it ran on.

    A machine without accelerators (no accelerator_model_name) is a CPU system: 0 accelerators
    per node, whatever number of training processes DGXNGPU starts (that goes in hw_notes)."""
    description: dict[str, Any] = {name: "" for name in SYSTEM_FIELDS}
    description["other_software_stack"] = {}
    description.update({k: v for k, v in machine.items() if k in description})
    description.update({
        "submitter": _require(config, "SUBMISSION_ORG"),
        "division": _require(config, "DIVISION"),
        "status": availability(config.get("SUBMISSION_STATUS", "onprem")),
        "system_name": config.get("SUBMISSION_PLATFORM") or _require(config, "DGXSYSTEM"),
        "number_of_nodes": _require(config, "DGXNNODES"),
        "accelerators_per_node": _require(config, "DGXNGPU"),
    })
    return as_cpu_system(description) if not description["accelerator_model_name"] else description


def as_cpu_system(description: Mapping[str, Any]) -> dict[str, Any]:
    """The description of a system that trained on CPUs only: 0 accelerators per node (the
    checkers read the count as a number; the result summarizer counts such a node as one chip)
    and the processes per node in hw_notes."""
    processes = description["accelerators_per_node"]
    cpu = dict(description, accelerators_per_node="0")
    if str(processes) != "0":
        note = CPU_NOTE.format(processes)
        cpu["hw_notes"] = "; ".join(n for n in (note, str(description.get("hw_notes") or "")) if n)
    return cpu


CPU_NOTE = "CPU only, {} training processes per node"


def cpu_processes(description: Mapping[str, Any]) -> str | None:
    """The training processes per node that as_cpu_system noted, if it did."""
    found = re.search(CPU_NOTE.format(r"(\d+)"), str(description.get("hw_notes", "")))
    return found.group(1) if found else None


def is_cpu_system(description: Mapping[str, Any]) -> bool:
    return not description.get("accelerator_model_name") or str(description["accelerators_per_node"]) == "0"


def sysjson_line(config: Mapping[str, str]) -> str:
    return SYSJSON_TOKEN + json.dumps(describe_system(config, gather_machine()), sort_keys=True)


# ---------------------------------------------------------------------------------------------
# Packing


def find_run_logs(run_dir: Path) -> list[Path]:
    """The run logs in a folder, in run order (natural sort: run_2 before run_10)."""
    if not run_dir.is_dir():
        raise PackageError(f"run folder {run_dir} does not exist")
    logs = sorted((p for p in run_dir.iterdir() if is_run_log(p)), key=natural_key)
    if not logs:
        raise PackageError(f"no MLPerf run logs in {run_dir}: expected files with a "
                           "`:::MLLOG` submission_benchmark line (one file per run)")
    return logs


def logged_description(logs: Sequence[Path]) -> dict[str, Any] | None:
    """The :::SYSJSON description of the first log that has one (printed by the launchers)."""
    for log in logs:
        found = read_run(log).sysjson
        if found:
            return dict(found)
    return None


def system_description(logs: Sequence[Path], config: Mapping[str, str], ruleset: str) -> dict[str, Any]:
    """The description written at run time when the logs carry one, else this machine's."""
    description = logged_description(logs)
    if description is None:
        print("note: the logs carry no :::SYSJSON line; describing the machine packing them")
        description = describe_system(config, gather_machine())
    missing = [name for name in SYSTEM_FIELDS if name not in description]
    if missing:
        raise PackageError(f"the :::SYSJSON line in the logs lacks {missing}")
    checked = [("number_of_nodes", "DGXNNODES"), ("submitter", "SUBMISSION_ORG")]
    if is_cpu_system(description):
        # Logs written before CPU systems were told apart carry DGXNGPU as accelerators_per_node.
        description = as_cpu_system(description)
        processes = cpu_processes(description)
        if processes is not None and processes != _require(config, "DGXNGPU"):
            raise PackageError(f"the logs were run with {processes} training processes per node but the "
                               f"config says DGXNGPU={config['DGXNGPU']}: pass the runs' config")
    else:
        checked.append(("accelerators_per_node", "DGXNGPU"))
    for field_name, variable in checked:
        if str(description[field_name]) != _require(config, variable):
            raise PackageError(f"the logs were run with {field_name}={description[field_name]} but the "
                               f"config says {variable}={config[variable]}: pass the runs' config")
    if int(ruleset.split(".")[0]) >= 4:
        description["status"] = availability(str(description["status"]))
    return description


def refuse_mixed_hyperparameters(runs: Sequence[RunLog]) -> None:
    """One result is one set of hyperparameters: name the first run that differs, and its key."""
    mismatches = hyperparameter_mismatches(runs)
    if mismatches:
        more = f" (and {len(mismatches) - 1} more difference(s))" if len(mismatches) > 1 else ""
        raise PackageError(f"{mismatches[0].path}: {mismatches[0].line()}{more}")


def choose_runs(run_dir: Path, select: int | None) -> tuple[list[RunLog], list[RunLog]]:
    """(runs to package, runs left out): every run in the folder, or with `select` N the N
    consecutive runs whose olympic score is the median of all windows (training_rules.adoc §12.1)."""
    runs = [read_run(log) for log in find_run_logs(run_dir)]
    refuse_mixed_hyperparameters(runs)
    if select is None:
        if len(runs) != RUNS_PER_SUBMISSION:
            print(f"warning: {len(runs)} run logs in {run_dir}; a BERT submission needs {RUNS_PER_SUBMISSION} "
                  f"(the package checker will report it; from more, --select {RUNS_PER_SUBMISSION} picks them)")
        return runs, []
    if len(runs) <= select:
        raise PackageError(f"--select {select} picks from more than {select} runs; {run_dir} holds {len(runs)}: "
                           "package them without --select")
    try:
        selection = select_consecutive(runs, select)
    except ScoringError as err:
        raise PackageError(str(err)) from err
    print(selection_report(selection))
    return list(selection.kept), list(selection.dropped)


def selection_report(selection: Selection) -> str:
    scores = ", ".join("invalid" if math.isinf(s) else f"{s:.3f}" for s in selection.scores)
    first, size = selection.chosen, selection.size
    lines = [f"--select {size}: {len(selection.runs)} runs in run_start order; olympic minutes of the "
             f"{len(selection.scores)} windows of {size} consecutive runs: {scores}; the median window is "
             f"runs {first + 1}..{first + size}"]
    lines += [f"dropped: {line}" for line in source_lines(selection.dropped)]
    return "\n".join(lines)


def build_package(run_dir: Path, config_path: Path, out: Path, ruleset: str, select: int | None = None) -> Path:
    """Write OUT/<ORG>/results/<system>/bert/result_<i>.txt and systems/<system>.json."""
    config = read_config(config_path)
    system = _require(config, "DGXSYSTEM")
    runs, dropped = choose_runs(run_dir, select)
    logs = [run.path for run in runs]
    description = system_description(logs, config, ruleset)
    org = out / str(description["submitter"])
    results = org / "results" / system / BENCHMARK
    if results.exists():
        raise PackageError(f"{results} already exists: remove it or choose another --out")
    try:
        _write_system(org, system, runs, dropped, description)
    except BaseException:
        shutil.rmtree(results.parent, ignore_errors=True)  # no half-written package
        (org / "systems" / f"{system}.json").unlink(missing_ok=True)
        raise
    print(f"packaged {len(logs)} runs of {system} from {run_dir} into {org}")
    print("\n".join(source_lines(runs, with_results=True)))
    return org


SOURCES = "sources.txt"


def source_lines(runs: Sequence[RunLog], with_results: bool = False) -> list[str]:
    """`[result_<i>.txt <- ]LOG (seed, status, minutes)`, one line per run, in package order."""
    lines = []
    for index, run in enumerate(runs):
        minutes = f"{run.minutes:.2f} min" if run.minutes is not None else "no run_stop"
        line = f"{run.path} (seed {run.values.get('seed', '?')}, {run.status or 'no status'}, {minutes})"
        lines.append(f"result_{index}.txt <- {line}" if with_results else line)
    return lines


def _write_system(org: Path, system: str, runs: Sequence[RunLog], dropped: Sequence[RunLog],
                  description: Mapping[str, Any]) -> None:
    results = org / "results" / system / BENCHMARK
    results.mkdir(parents=True)
    for index, run in enumerate(runs):
        shutil.copyfile(run.path, results / f"result_{index}.txt")
    lines = source_lines(runs, with_results=True)
    lines += [f"not packaged <- {line}: outside the median window (--select {len(runs)})"
              for line in source_lines(dropped)]
    (results.parent / SOURCES).write_text("\n".join(lines) + "\n")
    (org / "systems").mkdir(exist_ok=True)
    with (org / "systems" / f"{system}.json").open("w") as f:
        json.dump(description, f, indent=4)
        f.write("\n")


# ---------------------------------------------------------------------------------------------
# Checking and scoring


@dataclass
class Verdict:
    """Everything the checks found. Problems make the package fail; notes are for information."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    scores: dict[str, float | None] = field(default_factory=dict)  # system folder -> official minutes
    failed_runs: dict[str, set[str]] = field(default_factory=dict)  # system folder -> result files not counted
    rcp: dict[str, RcpVerdict] = field(default_factory=dict)  # system folder -> the RCP decision (closed)
    factors: dict[str, float] = field(default_factory=dict)  # system folder -> scaling.json the summarizer applied

    @property
    def passed(self) -> bool:
        return not self.problems and bool(self.scores) and all(
            score is not None for score in self.scores.values())


def compliance_problems(result_file: Path, ruleset: str) -> list[str]:
    """The compliance checker's messages for one log (empty when it complies)."""
    from mlperf_logging.compliance_checker import mlp_compliance

    checker = mlp_compliance.make_checker("training", ruleset, False, False)
    with quiet_logging():
        valid = checker.check_file(str(result_file), f"training_{ruleset}/common.yaml")
    if valid:
        return []
    messages = [*checker.overwritable.values(), *checker.not_overwritable]
    return [" ".join(str(m).split()) for m in messages] or ["compliance check failed"]


def how_it_ended(run: RunLog) -> str:
    """`did not converge (...)` with the run's end and its last eval."""
    end = f"run_stop {run.status or 'without status'}" if run.run_stop_ms is not None else "no run_stop"
    if run.evals:
        samples, accuracy = run.evals[-1]
        end += f", last eval {accuracy:.5f} masked-LM accuracy at {samples:,.0f} samples"
    return f"did not converge ({end})"


def run_failures(result_file: Path, ruleset: str) -> list[str]:
    """Why one result file cannot count as a converged, compliant run (empty when it can)."""
    run = read_run(result_file)
    messages = compliance_problems(result_file, ruleset)
    return messages if run.converged else [how_it_ended(run), *messages]


def _result_dirs(package: Path) -> list[Path]:
    results = package / "results"
    if not results.is_dir() or not (package / "systems").is_dir():
        raise PackageError(f"{package} is not an MLPerf package: expected {package}/results/"
                           f"<system>/{BENCHMARK}/result_*.txt and {package}/systems/<system>.json")
    dirs = sorted(d / BENCHMARK for d in results.iterdir() if (d / BENCHMARK).is_dir())
    if not dirs:
        raise PackageError(f"no {BENCHMARK} results under {results}")
    return dirs


def _result_files(bert_dir: Path) -> list[Path]:
    return sorted(bert_dir.glob("result_*.txt"), key=natural_key)


def check_compliance(package: Path, ruleset: str, verdict: Verdict, strict: bool = False) -> None:
    """Every run must comply and converge, except one: training_rules.adoc §12 lets a single
    non-converging run count as the slowest (the official package checker accepts one
    non-compliant file "under olympic scoring"). `strict` accepts none."""
    for bert_dir in _result_dirs(package):
        system, files = bert_dir.parent.name, _result_files(bert_dir)
        failed = {f: m for f, m in ((f, run_failures(f, ruleset)) for f in files) if m}
        verdict.failed_runs[system] = {f.name for f in failed}
        verdict.notes.append(f"compliance ({system}): {len(files) - len(failed)}/{len(files)} result files "
                             "comply and converged")
        if len(failed) == 1 and not strict:
            (result_file, messages), = failed.items()
            verdict.notes.append(f"{result_file.relative_to(package)}: {'; '.join(messages)}: counted as the "
                                 "slowest run and dropped by the olympic mean, as training_rules.adoc §12 and the "
                                 "official package checker allow for one run (--strict refuses it)")
            continue
        for result_file, messages in failed.items():
            verdict.problems += [f"{result_file.relative_to(package)}: {m}" for m in messages]
        if failed and strict:
            verdict.problems.append(f"{system}: --strict: every run must comply and converge")
        elif len(failed) > 1:
            verdict.problems.append(f"{system}: {len(failed)} runs did not comply or converge; an olympic score "
                                    "accepts one at most (training_rules.adoc §12)")


def check_hyperparameters(package: Path, verdict: Verdict) -> None:
    """All runs of one result share their hyperparameters (the official checkers do not compare them)."""
    for bert_dir in _result_dirs(package):
        runs = [read_run(f) for f in _result_files(bert_dir)]
        verdict.problems += [f"{(bert_dir / m.path.name).relative_to(package)}: {m.line()}"
                             for m in hyperparameter_mismatches(runs)]


def closed_rule_problems(result_file: Path) -> tuple[list[str], list[str]]:
    """(broken closed-division rules, keys not in the log) of one closed-division log.

    The trainer refuses a closed config that breaks one (`mlperf_bert.config.closed_division`);
    this applies the same table to what a log says, which the official checkers do not read.
    """
    values = read_run(result_file).values
    if values.get("submission_division") != "closed":
        return [], []
    return [b.for_log() for b in broken_rules(values)], unchecked_keys(values)


def check_init_time(package: Path, verdict: Verdict) -> None:
    """Each run's initialization (init_start to run_start) within its division's maximum (§11)."""
    for bert_dir in _result_dirs(package):
        for result_file in _result_files(bert_dir):
            run = read_run(result_file)
            division = str(run.values.get("submission_division", "closed"))
            overrun = init_overrun(run.init_seconds, division) if run.init_seconds is not None else None
            if overrun:
                verdict.problems.append(f"{result_file.relative_to(package)}: {overrun}")


def check_closed_rules(package: Path, verdict: Verdict) -> None:
    for bert_dir in _result_dirs(package):
        unchecked: set[str] = set()
        for result_file in _result_files(bert_dir):
            broken, missing = closed_rule_problems(result_file)
            verdict.problems += [f"{result_file.relative_to(package)}: {line}" for line in broken]
            unchecked.update(missing)
        if unchecked:
            verdict.notes.append(f"closed-division rules ({bert_dir.parent.name}): not checked, the logs do not "
                                 f"say: {', '.join(sorted(unchecked))}")


def _run_tool(args: Sequence[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run `python -m mlperf_logging.<tool> ...` with its log files kept in cwd (an absolute path)."""
    command = [sys.executable, "-m", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)


def run_package_checker(package: Path, ruleset: str, logs: Path, verdict: Verdict) -> None:
    done = _run_tool(["mlperf_logging.package_checker", str(package), "training", ruleset,
                      "--log_output", str(logs / "package_checker.log")], logs)
    output = done.stdout + done.stderr
    errors = [line for line in output.splitlines() if line.startswith("ERROR")]
    if "PACKAGE CHECKER FOUND NO ERRORS" not in output:
        verdict.problems += [f"package checker: {line}" for line in errors] or [
            f"package checker did not report success (exit {done.returncode}; see {logs / 'package_checker.log'})"]
        return
    verdict.notes.append("package checker: PACKAGE CHECKER FOUND NO ERRORS")
    if "accepting this under olympic scoring" in output:
        verdict.notes.append("package checker: accepted a non-compliant file under olympic scoring")


def _division(package: Path, system: str) -> str:
    path = package / "systems" / f"{system}.json"
    try:
        return str(json_object(path).get("division", ""))
    except (OSError, ValueError) as err:
        raise PackageError(f"{err}: systems/{system}.json is the system's description, a JSON object with its "
                           "\"division\" (package_results.py pack writes one)") from err


def run_rcp_checker(package: Path, ruleset: str, logs: Path, verdict: Verdict) -> None:
    """Reference convergence points (closed division only; open division has no RCP rule): the
    official checker's verdict, and the window and margin behind it (training_rules.adoc §13)."""
    for bert_dir in _result_dirs(package):
        system = bert_dir.parent.name
        if _division(package, system) != "closed":
            verdict.notes.append(f"RCP checker ({system}): skipped, not closed division")
            continue
        done = _run_tool(["mlperf_logging.rcp_checker", str(bert_dir), "--rcp_usage", "training",
                          "--rcp_version", ruleset, "--log_output", str(logs / f"rcp_{system}.log")],
                         logs)
        summary = [line for line in (done.stdout + done.stderr).splitlines() if "RCP test" in line]
        message = summary[-1].split(" - ", 1)[-1] if summary else f"exit status {done.returncode}"
        if done.returncode == 0:
            verdict.notes.append(f"RCP checker ({system}): {message}")
        else:
            verdict.problems.append(f"RCP checker ({system}): {message}")
        explain_rcp(bert_dir, ruleset, done.returncode == 0, verdict)


def explain_rcp(bert_dir: Path, ruleset: str, official: bool, verdict: Verdict) -> None:
    """The window (RCP mean, minimum acceptable mean, maximum speed-up) and the margin to it."""
    system = bert_dir.parent.name
    try:
        decision = rcp_verdict(_result_files(bert_dir), ruleset)
    except ScoringError as err:
        verdict.notes.append(f"RCP window ({system}): {err}")
        return
    verdict.rcp[system] = decision
    if decision.window is not None:
        verdict.notes.append(f"RCP window ({system}): {decision.window.describe()}")
    verdict.notes.append(f"RCP margin ({system}): {decision.margin()}")
    if decision.passed != official:
        verdict.problems.append(f"RCP window ({system}): computed here as {decision.message} "
                                f"({'pass' if decision.passed else 'fail'}), which the official RCP checker "
                                "does not confirm; trust the official checker and report this")


def _score(cell: str) -> float | None:
    try:
        return float(cell)
    except ValueError:
        return None


def _scaling_factor(bert_dir: Path) -> float:
    """The factor the result summarizer multiplies the olympic mean by (scaling.json, else 1)."""
    scaling = bert_dir / "scaling.json"
    if not scaling.is_file():
        return 1.0
    try:
        return float(json_object(scaling)["scaling_factor"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise PackageError(f"{scaling}: no number under \"scaling_factor\" ({err}); give "
                           "{\"scaling_factor\": F} or remove the file") from err


def run_summarizer(package: Path, ruleset: str, logs: Path, verdict: Verdict) -> None:
    csv_path = logs / "summary.csv"
    done = _run_tool(["mlperf_logging.result_summarizer", str(package), "training", ruleset,
                      "--csv", str(csv_path)], logs)
    for line in (done.stdout + done.stderr).splitlines():
        if line.startswith(("ERROR", "NOTICE", "Compliance check failed")):
            verdict.notes.append(f"result summarizer: {line.strip()}")
    rows = list(csv.DictReader(csv_path.open())) if csv_path.is_file() else []
    for row in rows:
        # details_url ends in systems/<system folder>.json; system is the description's system_name
        folder = Path(row.get("details_url", "")).stem or row["system"]
        verdict.scores[folder] = _score(row.get(BENCHMARK, ""))
        if (package / "results" / folder / BENCHMARK).is_dir():
            verdict.factors[folder] = _scaling_factor(package / "results" / folder / BENCHMARK)
    if not rows:
        verdict.problems.append(f"result summarizer produced no scores (exit {done.returncode})")
    for system, score in verdict.scores.items():
        if score is None:
            verdict.problems.append(f"result summarizer: no {BENCHMARK} score for {system}")


def files_without_log_lines(package: Path) -> list[Path]:
    """Result files with no `:::MLLOG` line: a note or a stray file, not a run's log."""
    def holds_log_lines(path: Path) -> bool:
        with path.open(encoding="latin-1") as lines:
            return any(MLLOG_TOKEN in line for line in lines)

    return [f for bert_dir in _result_dirs(package) for f in _result_files(bert_dir) if not holds_log_lines(f)]


def check_package(package: Path, ruleset: str, logs: Path, strict: bool = False) -> Verdict:
    """All checks and the score; `logs` receives the official tools' log files. A result file without MLPerf
    lines stops the checks at its one line: every other check would name each key it lacks (20 lines a file)."""
    verdict = Verdict()
    package, logs = package.resolve(), logs.resolve()  # the official tools run with `logs` as cwd
    strays = files_without_log_lines(package)
    if strays:
        verdict.problems += [f"{f.relative_to(package)}: holds no MLPerf log lines (`{MLLOG_TOKEN.strip()}`), so it "
                             "is no run's log; put the run's log there or take the file out of the package, "
                             "then check again" for f in strays]
        return verdict
    check_compliance(package, ruleset, verdict, strict)
    check_hyperparameters(package, verdict)
    check_closed_rules(package, verdict)
    check_init_time(package, verdict)
    run_package_checker(package, ruleset, logs, verdict)
    run_rcp_checker(package, ruleset, logs, verdict)
    run_summarizer(package, ruleset, logs, verdict)
    return verdict


def olympic_of_counted_runs(bert_dir: Path, failed: set[str]) -> float:
    """Olympic mean of the run times, the runs the checks did not count taken as infinitely slow."""
    runs = [read_run(f) for f in _result_files(bert_dir)]
    minutes = [math.inf if run.path.name in failed else run_minutes(run) for run in runs]
    score = olympic_mean(minutes)
    return math.inf if score is None else score


def score_line(package: Path, system: str, score: float | None, verdict: Verdict) -> str:
    """`score SYSTEM: M minutes (S s) = olympic mean x factor (why)`."""
    if score is None:
        return f"score {system}: none"
    line = f"score {system}: {score:.3f} minutes ({score * 60:.0f} s)"
    bert_dir = package / "results" / system / BENCHMARK
    if not bert_dir.is_dir():
        return line + " (official result summarizer)"
    raw = olympic_of_counted_runs(bert_dir, verdict.failed_runs.get(system, set()))
    factor = verdict.factors.get(system, 1.0)
    rcp = verdict.rcp.get(system)
    if factor != 1.0:
        why = ("RCP normalization factor: RCP mean / olympic mean of samples to converge, training_rules.adoc §13"
               if rcp is not None and rcp.norm_factor == factor else "scaling.json of the package")
    elif rcp is None:
        why = "no normalization"
    elif rcp.passed:
        why = "no normalization: olympic mean of samples at or above the RCP mean"
    else:
        why = "no normalization: the RCP check failed"
    return (f"{line} = olympic mean {raw:.3f} minutes x {factor:.4f} ({why}; official result summarizer: "
            f"{score:.6f})")


def report(checked: Path, shown: Path, ruleset: str, verdict: Verdict, logs: Path, kept: bool = True) -> int:
    """Print the verdict plainly (naming `shown` where the checks ran on a copy); the exit status."""
    def say(line: str) -> None:
        print("  " + line.replace(str(checked.resolve()), str(shown)))

    print(f"package {shown} (training {ruleset})")
    for note in verdict.notes:
        say(note)
    for system, score in verdict.scores.items():
        say(score_line(checked.resolve(), system, score, verdict))
    for problem in verdict.problems:
        say(f"FAIL: {problem}")
    print(f"  checker logs: {logs}" if kept else "  checker logs: removed (pass --logs DIR to keep them)")
    print("PASS" if verdict.passed else f"FAIL ({len(verdict.problems)} problem(s))")
    return 0 if verdict.passed else 1


# ---------------------------------------------------------------------------------------------
# The RCP window of a config or a global batch size


RCP_COMMENT = "# RCP (training {ruleset}, bert): "


def config_global_batch_size(config: Mapping[str, str], path: Path) -> tuple[int, str]:
    """(global batch size, how it follows from the config). GLOBAL_BATCH_SIZE when set; else as the
    trainer counts it: BATCHSIZE (per rank and optimizer step, accumulation inside) x DGXNGPU x
    DGXNNODES, a pack counting as 2 sequences (`TrainConfig.global_batch_size`)."""
    def number(name: str) -> int:
        value = _require(config, name)
        if not value.isdigit() or int(value) <= 0:
            raise PackageError(f"{path}: {name}={value} is not a positive whole number")
        return int(value)

    if config.get("GLOBAL_BATCH_SIZE"):
        return number("GLOBAL_BATCH_SIZE"), "GLOBAL_BATCH_SIZE"
    try:
        batch = config_batch(config, str(path))
    except ValueError as err:
        raise PackageError(str(err)) from err
    how = f"BATCHSIZE {config['BATCHSIZE']} x DGXNGPU {config['DGXNGPU']} x DGXNNODES {config['DGXNNODES']}"
    return batch.global_batch_size, how + (f" x {SEQUENCES_PER_PACK} sequences per pack" if batch.packed else "")


def rcp_comment(gbs: int, ruleset: str, division: str | None = None) -> str:
    """The one-line `# RCP (...)` comment for a global batch size."""
    try:
        line = RCP_COMMENT.format(ruleset=ruleset) + rcp_window(gbs, ruleset).describe()
    except ScoringError as err:
        raise PackageError(str(err)) from err
    return line + ("; open division: no RCP check" if division == "open" else "")


def write_rcp_comment(path: Path, comment: str) -> bool:
    """Put `comment` in the config's leading comment block (replacing an older one); True if changed."""
    lines = path.read_text().splitlines(keepends=True)
    old = [i for i, line in enumerate(lines) if line.startswith(RCP_COMMENT.split("(")[0] + "(")]
    if old:
        if lines[old[0]] == comment + "\n":
            return False
        lines[old[0]] = comment + "\n"
    else:
        header = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
        lines.insert(header, comment + "\n")
    path.write_text("".join(lines))
    return True


def rcp_command(args: argparse.Namespace) -> int:
    if args.gbs is None and not args.configs:
        raise PackageError("rcp needs config_<SYSTEM>.sh files or --gbs N")
    if args.gbs is not None:
        if args.gbs <= 0:
            raise PackageError(f"--gbs {args.gbs}: a global batch size is a positive whole number")
        print(rcp_comment(args.gbs, args.ruleset))
    for path in args.configs:
        config = read_config(path)
        gbs, how = config_global_batch_size(config, path)
        comment = rcp_comment(gbs, args.ruleset, config.get("DIVISION"))
        print(f"{path}: global batch size {gbs} ({how})")
        print(comment)
        if args.write and write_rcp_comment(path, comment):
            print(f"{path}: RCP comment written")
    return 0


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    pack = commands.add_parser("pack", help="run folder -> package, then check and score it")
    pack.add_argument("run_dir", type=Path, help="folder with one MLPerf log per run")
    pack.add_argument("--config", type=Path, required=True, help="config_<SYSTEM>.sh of the runs")
    pack.add_argument("--out", type=Path, required=True, help="the package goes to OUT/<ORG>/")
    pack.add_argument("--select", type=int, metavar="N",
                      help="from more than N runs, package the N consecutive ones (by run_start) closest to "
                           "the median (training_rules.adoc §12.1)")
    check = commands.add_parser("check", help="check and score an existing package ORG/")
    check.add_argument("package", type=Path)
    for sub in (pack, check):
        sub.add_argument("--ruleset", default=DEFAULT_RULESET,
                         help="MLPerf training ruleset of the logs (default %(default)s)")
        sub.add_argument("--logs", type=Path, help="where the checkers' logs go (default: OUT/checker_logs "
                         "for pack; none kept for check)")
        sub.add_argument("--strict", action="store_true",
                         help="every run must comply and converge (the rules accept one that does not)")
    rcp = commands.add_parser("rcp", help="the RCP window of configs or of a global batch size")
    rcp.add_argument("configs", type=Path, nargs="*", metavar="config_X.sh")
    rcp.add_argument("--gbs", type=int, help="a global batch size instead of (or besides) configs")
    rcp.add_argument("--ruleset", default=DEFAULT_RULESET, help="RCP table of this ruleset (default %(default)s)")
    rcp.add_argument("--write", action="store_true", help="put the RCP comment line into each config")
    commands.add_parser("sysjson", help="print a :::SYSJSON line (config variables from the environment)")
    return parser.parse_args(argv)


def _checked(package: Path, args: argparse.Namespace, shown: Path, logs: Path | None) -> int:
    """Check and report; `logs` None: the checkers' logs go to a temporary folder, removed after."""
    with tempfile.TemporaryDirectory(prefix="mlperf_checks_") as scratch:
        where = logs or Path(scratch)
        where.mkdir(parents=True, exist_ok=True)
        verdict = check_package(package, args.ruleset, where, args.strict)
        return report(package, shown, args.ruleset, verdict, where, kept=logs is not None)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "sysjson":
            print(sysjson_line(os.environ))
            return 0
        if args.command == "rcp":
            return rcp_command(args)
        if args.command == "pack":
            package = build_package(args.run_dir, args.config, args.out, args.ruleset, args.select)
            return _checked(package, args, package, args.logs or args.out / "checker_logs")
        _result_dirs(args.package)
        with tempfile.TemporaryDirectory(prefix="mlperf_package_") as scratch:
            copy = Path(scratch) / args.package.resolve().name
            shutil.copytree(args.package, copy)
            return _checked(copy, args, args.package, args.logs)
    except PackageError as err:
        print(f"package_results.py: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
