"""tools/package_results.py: packaging, the official checkers and the score."""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

import fake_trainer
import package_results

REPO = Path(__file__).resolve().parents[1]
NVIDIA_V20 = REPO / "tests" / "data" / "mlperf_logs" / "v2.0" / "NVIDIA"
TOOL = REPO / "tools" / "package_results.py"
DEMO_RUNS = REPO / "results" / "CPU_1x2"

CACHE_CLEAR = (':::MLLOG {"namespace": "", "time_ms": 1, "event_type": "POINT_IN_TIME", '
               '"key": "cache_clear", "value": true, "metadata": {"file": "<string>", "lineno": 1}}\n')


def _tool(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          env=env, check=False, cwd=REPO)


def _olympic_minutes(files: list[Path]) -> float:
    """Independent score: run_start -> run_stop of each file, drop fastest and slowest."""
    minutes = []
    for path in files:
        times = {}
        for line in path.read_text(encoding="latin-1").splitlines():
            if line.startswith(":::MLLOG "):
                record = json.loads(line[len(":::MLLOG "):])
                if record["key"] in ("run_start", "run_stop"):
                    times[record["key"]] = record["time_ms"]
        minutes.append((times["run_stop"] - times["run_start"]) / 60_000)
    return statistics.fmean(sorted(minutes)[1:-1])


def _write_config(path: Path) -> dict[str, str]:
    path.write_text(fake_trainer.sample_config("TEST_1x8", gpus=8))
    return package_results.read_config(path)


def _write_runs(run_dir: Path, config: dict[str, str], sysjson: str | None) -> list[Path]:
    """Ten synthetic runs as run_with_docker.sh writes them (cache_clear, SYSJSON, trainer output)."""
    run_dir.mkdir()
    paths = []
    for seed in range(1, 11):
        path = run_dir / f"261121_{seed}.log"
        header = CACHE_CLEAR + (sysjson + "\n" if sysjson else "")
        path.write_text(header + fake_trainer.synthetic_log(config, seed, 1.7e12 + seed * 1e7))
        paths.append(path)
    return paths


@pytest.mark.slow
def test_check_published_package_gives_the_official_score(tmp_path):
    before = sorted(p.name for p in NVIDIA_V20.rglob("*"))
    done = _tool("check", str(NVIDIA_V20), "--ruleset", "2.0.0", "--logs", str(tmp_path / "logs"))
    assert done.returncode == 0, done.stdout + done.stderr
    files = sorted(NVIDIA_V20.glob("results/*/bert/result_*.txt"))
    expected = _olympic_minutes(files)
    assert round(expected, 3) == 18.442  # the published score of these logs
    assert f"{expected:.3f} minutes" in done.stdout
    assert "PACKAGE CHECKER FOUND NO ERRORS" in done.stdout and done.stdout.rstrip().endswith("PASS")
    assert sorted(p.name for p in NVIDIA_V20.rglob("*")) == before  # checked on a copy


@pytest.mark.slow
def test_broken_log_is_a_clear_failure(tmp_path):
    package = tmp_path / "NVIDIA"
    shutil.copytree(NVIDIA_V20, package)
    broken = next(package.glob("results/*/bert/result_3.txt"))
    lines = broken.read_text().splitlines(keepends=True)
    broken.write_text("".join(line for line in lines if '"run_stop"' not in line))
    done = _tool("check", str(package), "--ruleset", "2.0.0", "--logs", str(tmp_path / "logs"))
    assert done.returncode == 1
    failures = [line for line in done.stdout.splitlines() if "FAIL:" in line]
    assert failures and "result_3.txt" in failures[0] and "run_stop" in failures[0]
    assert done.stdout.rstrip().endswith("FAIL (1 problem(s))")


@pytest.mark.slow
def test_pack_synthetic_runs_into_a_compliant_5_0_package(tmp_path):
    from mlperf_logging.system_desc_checker.system_desc_checker import check_system_desc

    config = _write_config(tmp_path / "config_TEST_1x8.sh")
    sysjson = package_results.sysjson_line(config)
    logs = _write_runs(tmp_path / "runs", config, sysjson)
    done = _tool("pack", str(tmp_path / "runs"), "--config", str(tmp_path / "config_TEST_1x8.sh"),
                 "--out", str(tmp_path / "out"), "--logs", str(tmp_path / "logs"))
    assert done.returncode == 0, done.stdout + done.stderr
    org = tmp_path / "out" / "TestOrg"
    results = sorted((org / "results" / "TEST_1x8" / "bert").glob("result_*.txt"))
    assert [p.name for p in results] == [f"result_{i}.txt" for i in range(10)]
    assert results[9].read_text() == logs[9].read_text()  # natural order: run 10 is last
    description = org / "systems" / "TEST_1x8.json"
    valid, name, _, _ = check_system_desc(str(description), "training", "5.0.0")
    assert valid and name == "1xTEST_8GPU"
    assert json.loads(description.read_text()) == json.loads(sysjson[len(":::SYSJSON "):])
    assert f"{_olympic_minutes(logs):.3f} minutes" in done.stdout


H100 = {"accelerator_model_name": "NVIDIA H100 80GB HBM3", "accelerator_memory_capacity": "81559 MiB",
        "cuda_driver_version": "550.54.15"}


@pytest.mark.parametrize("gpus,accelerators,notes", [(H100, "8", ""), ({}, "0", "CPU only, 8 training processes per node")])
def test_description_of_this_machine_when_logs_carry_none(tmp_path, monkeypatch, gpus, accelerators, notes):
    monkeypatch.setattr(package_results, "_gpu_facts", lambda: dict(gpus))
    config = _write_config(tmp_path / "config_TEST_1x8.sh")
    logs = _write_runs(tmp_path / "runs", config, sysjson=None)
    description = package_results.system_description(logs, config, "5.0.0")
    assert set(package_results.SYSTEM_FIELDS) <= set(description)
    assert description["host_processor_vcpu_count"] == str(os.cpu_count())
    assert (description["submitter"], description["number_of_nodes"],
            description["accelerators_per_node"]) == ("TestOrg", "1", accelerators)
    assert description["hw_notes"] == notes
    assert description["status"] == "Available on-premise"


def test_cpu_system_from_older_logs_is_described_with_0_accelerators(tmp_path):
    """The shipped demo logs say accelerators_per_node "2" for 2 CPU processes; packing fixes that,
    and the official system-description checker and result summarizer accept the result."""
    from mlperf_logging.system_desc_checker.system_desc_checker import check_system_desc

    logs = sorted(DEMO_RUNS.glob("*_10*.log"))
    config = package_results.read_config(REPO / "config_CPU_1x2.sh")
    description = package_results.system_description(logs, config, "5.0.0")
    assert description["accelerators_per_node"] == "0" and description["accelerator_model_name"] == ""
    assert description["hw_notes"] == "CPU only, 2 training processes per node"
    (tmp_path / "CPU_1x2.json").write_text(json.dumps(description))
    valid, _, _, _ = check_system_desc(str(tmp_path / "CPU_1x2.json"), "training", "5.0.0")
    assert valid


def test_sources_say_which_log_became_which_result(tmp_path, capsys):
    config = package_results.read_config(REPO / "config_CPU_1x2.sh")
    runs = tmp_path / "runs"
    runs.mkdir()
    for log in sorted(DEMO_RUNS.glob("*_10*.log")):
        shutil.copy(log, runs / log.name.replace("261121", "run_"))
    org = package_results.build_package(runs, REPO / "config_CPU_1x2.sh", tmp_path / "out", "5.0.0")
    sources = (org / "results" / "CPU_1x2" / "sources.txt").read_text().splitlines()
    assert sources == capsys.readouterr().out.splitlines()[-10:]
    for line in sources:
        result, source = re.match(r"(result_\d+\.txt) <- (\S+) \(seed (\d+), success, [\d.]+ min\)$", line).group(1, 2)
        assert (org / "results" / "CPU_1x2" / "bert" / result).read_bytes() == Path(source).read_bytes()
    assert "result_9.txt <- " in sources[9] and "seed 1010" in sources[9]
    assert config["DGXSYSTEM"] == "CPU_1x2"


def test_check_leaves_no_temporary_folders_also_on_failure(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    package = tmp_path / "NVIDIA"
    shutil.copytree(NVIDIA_V20, package)
    broken = next(package.glob("results/*/bert/result_3.txt"))
    broken.write_text("".join(line for line in broken.read_text().splitlines(keepends=True)
                              if '"run_stop"' not in line))
    done = _tool("check", str(package), "--ruleset", "2.0.0", env={**os.environ, "TMPDIR": str(scratch)})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "checker logs: removed (pass --logs DIR to keep them)" in done.stdout
    assert list(scratch.iterdir()) == []


def test_sysjson_command_reads_the_config_from_the_environment(tmp_path):
    config = _write_config(tmp_path / "config_TEST_1x8.sh")
    done = _tool("sysjson", env={**os.environ, **config, "SUBMISSION_STATUS": "cloud"})
    assert done.returncode == 0, done.stderr
    line, = done.stdout.splitlines()
    assert line.startswith(":::SYSJSON ")
    description = json.loads(line[len(":::SYSJSON "):])
    assert set(description) == set(package_results.SYSTEM_FIELDS)
    assert description["status"] == "Available cloud"
    assert description["system_name"] == "1xTEST_8GPU"


def test_config_is_evaluated_by_bash(tmp_path):
    path = tmp_path / "config_X.sh"
    path.write_text("export BATCHSIZE=56\nexport DGXNGPU=8\nexport GBS=$((BATCHSIZE * DGXNGPU))\n")
    assert package_results.read_config(path) == {"BATCHSIZE": "56", "DGXNGPU": "8", "GBS": "448"}


def test_missing_config_variable_names_the_fix(tmp_path):
    config_path = tmp_path / "config_TEST_1x8.sh"
    config = _write_config(config_path)
    _write_runs(tmp_path / "runs", config, sysjson=None)
    text = config_path.read_text().replace("export SUBMISSION_ORG=TestOrg\n", "")
    config_path.write_text(text)
    done = _tool("pack", str(tmp_path / "runs"), "--config", str(config_path), "--out", str(tmp_path))
    assert done.returncode == 2
    assert "SUBMISSION_ORG is not set" in done.stderr and "export SUBMISSION_ORG=" in done.stderr


def test_not_a_package_is_a_clear_error(tmp_path):
    done = _tool("check", str(tmp_path))
    assert done.returncode == 2 and "is not an MLPerf package" in done.stderr


@pytest.mark.parametrize("logged,expected", [("onprem", "Available on-premise"),
                                             ("cloud", "Available cloud"),
                                             ("research", "Research, Development, or Internal (RDI)"),
                                             ("Preview", "Preview")])
def test_availability_values_of_rulesets_from_4_0(logged, expected):
    assert package_results.availability(logged) == expected


def test_unknown_status_names_the_allowed_values():
    with pytest.raises(package_results.PackageError, match="SUBMISSION_STATUS to one of"):
        package_results.availability("on-prem")


@pytest.mark.parametrize("gpus,message", [(H100, "accelerators_per_node=4 but"),
                                          ({}, "4 training processes per node but")])
def test_logs_of_another_config_are_rejected(tmp_path, monkeypatch, gpus, message):
    monkeypatch.setattr(package_results, "_gpu_facts", lambda: dict(gpus))
    config = _write_config(tmp_path / "config_TEST_1x8.sh")
    logs = _write_runs(tmp_path / "runs", config, package_results.sysjson_line({**config, "DGXNGPU": "4"}))
    with pytest.raises(package_results.PackageError, match=f"{message} the config says DGXNGPU=8"):
        package_results.system_description(logs, config, "5.0.0")
