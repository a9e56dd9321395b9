#!/usr/bin/env python3
"""Build, check and score an MLPerf Training submission package for BERT.

  pack RUN_DIR --config config_X.sh --out OUT [--ruleset 5.0.0]
      RUN_DIR holds one MLPerf log per run (e.g. run_with_docker.sh's LOGDIR). Writes
      OUT/<ORG>/results/<DGXSYSTEM>/bert/result_<i>.txt and OUT/<ORG>/systems/<DGXSYSTEM>.json,
      and OUT/<ORG>/results/<DGXSYSTEM>/sources.txt, which says which log became which
      result_<i>.txt (printed too); then checks and scores the package in place, with the
      checkers' logs in OUT/checker_logs/ unless --logs says otherwise.
  check PACKAGE_DIR [--ruleset 5.0.0]
      Checks and scores an existing package (ORG/ with results/ and systems/) on a temporary copy,
      so the input is never modified (the package checker writes scaling.json files). The copy
      and, without --logs, the checkers' logs are removed at the end, also on failure.
  sysjson
      Prints one `:::SYSJSON {...}` line describing this machine and the config in the environment.
      The launchers run it inside the container before each run, so the description of the machine
      that trained travels with the log and `pack` can use it on any other machine.

Checks: every result file through the compliance checker (this tool requires every run to comply,
although the official package checker accepts one failed file under olympic scoring), every
closed-division result file against the closed-division rules the trainer enforces
(`mlperf_bert/config/closed_division.py`: eval set size, eval interval, target, optimizer, ...,
which the official checkers do not read; a rule whose key a log lacks is noted, not failed), then
`python -m mlperf_logging.package_checker ORG training RULESET` (which exits 0 even on errors: its
verdict is the line `PACKAGE CHECKER FOUND NO ERRORS`), `python -m mlperf_logging.rcp_checker` for
closed-division systems, and `python -m mlperf_logging.result_summarizer ORG training RULESET --csv`
for the score. Exit status 0 only when everything passes and every system has a score.

The ruleset must match the logs: 5.0.0 for this project; published vendor logs use the ruleset
of their round (v2.0 -> 2.0.0, v4.0 -> 4.0.0).
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from compare import SYSJSON_TOKEN, is_run_log, natural_key, read_run
from mlperf_bert.config.closed_division import broken_rules, unchecked_keys

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


def build_package(run_dir: Path, config_path: Path, out: Path, ruleset: str) -> Path:
    """Write OUT/<ORG>/results/<system>/bert/result_<i>.txt and systems/<system>.json."""
    config = read_config(config_path)
    system = _require(config, "DGXSYSTEM")
    logs = find_run_logs(run_dir)
    if len(logs) != RUNS_PER_SUBMISSION:
        print(f"warning: {len(logs)} run logs in {run_dir}; a BERT submission needs "
              f"{RUNS_PER_SUBMISSION} (the package checker will report it)")
    description = system_description(logs, config, ruleset)
    org = out / str(description["submitter"])
    results = org / "results" / system / BENCHMARK
    if results.exists():
        raise PackageError(f"{results} already exists: remove it or choose another --out")
    try:
        _write_system(org, system, logs, description)
    except BaseException:
        shutil.rmtree(results.parent, ignore_errors=True)  # no half-written package
        (org / "systems" / f"{system}.json").unlink(missing_ok=True)
        raise
    print(f"packaged {len(logs)} runs of {system} from {run_dir} into {org}")
    print((results.parent / SOURCES).read_text(), end="")
    return org


SOURCES = "sources.txt"


def source_lines(logs: Sequence[Path]) -> list[str]:
    """`result_<i>.txt <- LOG (seed, status, minutes)`, one line per run, in package order."""
    lines = []
    for index, log in enumerate(logs):
        run = read_run(log)
        minutes = f"{run.minutes:.2f} min" if run.minutes is not None else "no run_stop"
        lines.append(f"result_{index}.txt <- {log} (seed {run.values.get('seed', '?')}, "
                     f"{run.status or 'no status'}, {minutes})")
    return lines


def _write_system(org: Path, system: str, logs: Sequence[Path], description: Mapping[str, Any]) -> None:
    results = org / "results" / system / BENCHMARK
    results.mkdir(parents=True)
    for index, log in enumerate(logs):
        shutil.copyfile(log, results / f"result_{index}.txt")
    (results.parent / SOURCES).write_text("\n".join(source_lines(logs)) + "\n")
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
    scores: dict[str, float | None] = field(default_factory=dict)  # system_name -> minutes

    @property
    def passed(self) -> bool:
        return not self.problems and bool(self.scores) and all(
            score is not None for score in self.scores.values())


@contextmanager
def _quiet_logging() -> Iterator[None]:
    """Silence the checkers' root-logger chatter while they run in this process."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(previous)


def compliance_problems(result_file: Path, ruleset: str) -> list[str]:
    """The compliance checker's messages for one log (empty when it complies)."""
    from mlperf_logging.compliance_checker import mlp_compliance

    checker = mlp_compliance.make_checker("training", ruleset, False, False)
    with _quiet_logging():
        valid = checker.check_file(str(result_file), f"training_{ruleset}/common.yaml")
    if valid:
        return []
    messages = [*checker.overwritable.values(), *checker.not_overwritable]
    return [" ".join(str(m).split()) for m in messages] or ["compliance check failed"]


def _result_dirs(package: Path) -> list[Path]:
    results = package / "results"
    if not results.is_dir() or not (package / "systems").is_dir():
        raise PackageError(f"{package} is not an MLPerf package: expected {package}/results/"
                           f"<system>/{BENCHMARK}/result_*.txt and {package}/systems/<system>.json")
    dirs = sorted(d / BENCHMARK for d in results.iterdir() if (d / BENCHMARK).is_dir())
    if not dirs:
        raise PackageError(f"no {BENCHMARK} results under {results}")
    return dirs


def check_compliance(package: Path, ruleset: str, verdict: Verdict) -> None:
    for bert_dir in _result_dirs(package):
        files = sorted(bert_dir.glob("result_*.txt"), key=natural_key)
        failed = 0
        for result_file in files:
            for message in compliance_problems(result_file, ruleset):
                verdict.problems.append(f"{result_file.relative_to(package)}: {message}")
                failed += 1
        verdict.notes.append(f"compliance ({bert_dir.parent.name}): "
                             f"{len(files) - failed}/{len(files)} result files comply")


def closed_rule_problems(result_file: Path) -> tuple[list[str], list[str]]:
    """(broken closed-division rules, keys not in the log) of one closed-division log.

    The trainer refuses a closed config that breaks one (`mlperf_bert.config.closed_division`);
    this applies the same table to what a log says, which the official checkers do not read.
    """
    values = read_run(result_file).values
    if values.get("submission_division") != "closed":
        return [], []
    return [b.for_log() for b in broken_rules(values)], unchecked_keys(values)


def check_closed_rules(package: Path, verdict: Verdict) -> None:
    for bert_dir in _result_dirs(package):
        unchecked: set[str] = set()
        for result_file in sorted(bert_dir.glob("result_*.txt"), key=natural_key):
            broken, missing = closed_rule_problems(result_file)
            verdict.problems += [f"{result_file.relative_to(package)}: {line}" for line in broken]
            unchecked.update(missing)
        if unchecked:
            verdict.notes.append(f"closed-division rules ({bert_dir.parent.name}): not checked, the logs do not "
                                 f"say: {', '.join(sorted(unchecked))}")


def _run_tool(args: Sequence[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run `python -m mlperf_logging.<tool> ...` with its log files kept in cwd."""
    command = [sys.executable, "-m", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)


def run_package_checker(package: Path, ruleset: str, logs: Path, verdict: Verdict) -> None:
    done = _run_tool(["mlperf_logging.package_checker", str(package), "training", ruleset,
                      "--log_output", str(logs / "package_checker.log")], logs)
    output = done.stdout + done.stderr
    errors = [line for line in output.splitlines() if line.startswith("ERROR")]
    if "PACKAGE CHECKER FOUND NO ERRORS" not in output:
        verdict.problems += [f"package checker: {line}" for line in errors] or [
            f"package checker did not report success (see {logs / 'package_checker.log'})"]
        return
    verdict.notes.append("package checker: PACKAGE CHECKER FOUND NO ERRORS")
    if "accepting this under olympic scoring" in output:
        verdict.notes.append("package checker: accepted a non-compliant file under olympic scoring")


def _division(package: Path, system: str) -> str:
    with (package / "systems" / f"{system}.json").open() as f:
        return str(json.load(f).get("division", ""))


def run_rcp_checker(package: Path, ruleset: str, logs: Path, verdict: Verdict) -> None:
    """Reference convergence points: closed division only (open division has no RCP rule)."""
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


def _score(cell: str) -> float | None:
    try:
        return float(cell)
    except ValueError:
        return None


def run_summarizer(package: Path, ruleset: str, logs: Path, verdict: Verdict) -> None:
    csv_path = logs / "summary.csv"
    done = _run_tool(["mlperf_logging.result_summarizer", str(package), "training", ruleset,
                      "--csv", str(csv_path)], logs)
    for line in (done.stdout + done.stderr).splitlines():
        if line.startswith(("ERROR", "NOTICE", "Compliance check failed")):
            verdict.notes.append(f"result summarizer: {line.strip()}")
    rows = list(csv.DictReader(csv_path.open())) if csv_path.is_file() else []
    for row in rows:
        verdict.scores[row["system"]] = _score(row.get(BENCHMARK, ""))
    if not rows:
        verdict.problems.append(f"result summarizer produced no scores (exit {done.returncode})")
    for system, score in verdict.scores.items():
        if score is None:
            verdict.problems.append(f"result summarizer: no {BENCHMARK} score for {system}")


def check_package(package: Path, ruleset: str, logs: Path) -> Verdict:
    """All checks and the score; `logs` receives the official tools' log files."""
    verdict = Verdict()
    package = package.resolve()  # the official tools run with the log folder as cwd
    check_compliance(package, ruleset, verdict)
    check_closed_rules(package, verdict)
    run_package_checker(package, ruleset, logs, verdict)
    run_rcp_checker(package, ruleset, logs, verdict)
    run_summarizer(package, ruleset, logs, verdict)
    return verdict


def report(checked: Path, shown: Path, ruleset: str, verdict: Verdict, logs: Path, kept: bool = True) -> int:
    """Print the verdict plainly (naming `shown` where the checks ran on a copy); the exit status."""
    def say(line: str) -> None:
        print("  " + line.replace(str(checked.resolve()), str(shown)))

    print(f"package {shown} (training {ruleset})")
    for note in verdict.notes:
        say(note)
    for system, score in verdict.scores.items():
        minutes = "none" if score is None else f"{score:.3f} minutes"
        say(f"score {system}: {minutes} (official result summarizer, olympic mean)")
    for problem in verdict.problems:
        say(f"FAIL: {problem}")
    print(f"  checker logs: {logs}" if kept else "  checker logs: removed (pass --logs DIR to keep them)")
    print("PASS" if verdict.passed else f"FAIL ({len(verdict.problems)} problem(s))")
    return 0 if verdict.passed else 1


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
    check = commands.add_parser("check", help="check and score an existing package ORG/")
    check.add_argument("package", type=Path)
    for sub in (pack, check):
        sub.add_argument("--ruleset", default=DEFAULT_RULESET,
                         help="MLPerf training ruleset of the logs (default %(default)s)")
        sub.add_argument("--logs", type=Path, help="where the checkers' logs go (default: OUT/checker_logs "
                         "for pack; none kept for check)")
    commands.add_parser("sysjson", help="print a :::SYSJSON line (config variables from the environment)")
    return parser.parse_args(argv)


def _checked(package: Path, args: argparse.Namespace, shown: Path, logs: Path | None) -> int:
    """Check and report; `logs` None: the checkers' logs go to a temporary folder, removed after."""
    with tempfile.TemporaryDirectory(prefix="mlperf_checks_") as scratch:
        where = logs or Path(scratch)
        where.mkdir(parents=True, exist_ok=True)
        verdict = check_package(package, args.ruleset, where)
        return report(package, shown, args.ruleset, verdict, where, kept=logs is not None)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "sysjson":
            print(sysjson_line(os.environ))
            return 0
        if args.command == "pack":
            package = build_package(args.run_dir, args.config, args.out, args.ruleset)
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
