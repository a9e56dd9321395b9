"""tools/package_results.py: packaging, the official checkers and the score."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from mlperf_tools.results import package_results
from mlperf_tools.results import scoring
from tests.harness.fakes import trainer as fake_trainer
from tests.harness.paths import MLPERF_LOGS, REPO

NVIDIA_V20 = MLPERF_LOGS / "v2.0" / "NVIDIA"
TOOL = REPO / "tools" / "package_results.py"
DEMO_RUNS = REPO / "results" / "CPU_1x2"

CACHE_CLEAR = (':::MLLOG {"namespace": "", "time_ms": 1, "event_type": "POINT_IN_TIME", '
               '"key": "cache_clear", "value": true, "metadata": {"file": "<string>", "lineno": 1}}\n')


def _tool(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          env=env, check=False, cwd=REPO)


def _run_minutes(path: Path) -> float:
    """run_start -> run_stop of one log, in minutes; +inf when it did not end with success."""
    times, status = {}, None
    for line in path.read_text(encoding="latin-1").splitlines():
        if ":::MLLOG " in line:
            record = json.loads(line.split(":::MLLOG ", 1)[1])
            if record["key"] in ("run_start", "run_stop"):
                times[record["key"]] = record["time_ms"]
                status = record["metadata"].get("status", status)
    return (times["run_stop"] - times["run_start"]) / 60_000 if status == "success" else math.inf


def _olympic_minutes(files: list[Path]) -> float:
    """Independent score: run_start -> run_stop of each file, drop fastest and slowest."""
    return statistics.fmean(sorted(_run_minutes(path) for path in files)[1:-1])


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


def _drop_run_stop(package: Path, *indices: int) -> list[Path]:
    """Cut the run_stop line out of these result files: runs that never finished."""
    broken = []
    for index in indices:
        path = next(package.glob(f"results/*/bert/result_{index}.txt"))
        path.write_text("".join(line for line in path.read_text().splitlines(keepends=True)
                                if '"run_stop"' not in line))
        broken.append(path)
    return broken


@pytest.mark.slow
def test_one_run_that_did_not_finish_is_counted_as_the_slowest(tmp_path):
    """training_rules.adoc §12: one non-converging run counts as the slowest and is dropped."""
    package = tmp_path / "NVIDIA"
    shutil.copytree(NVIDIA_V20, package)
    broken, = _drop_run_stop(package, 3)
    done = _tool("check", str(package), "--ruleset", "2.0.0")
    assert done.returncode == 0, done.stdout + done.stderr
    note, = [line for line in done.stdout.splitlines() if "result_3.txt: did not converge" in line]
    assert "(no run_stop" in note and "counted as the slowest run" in note
    others = [f for f in sorted(package.glob("results/*/bert/result_*.txt")) if f != broken]
    expected = statistics.fmean(sorted(_run_minutes(f) for f in others)[1:])  # the fastest dropped too
    assert f"{expected:.3f} minutes" in done.stdout and done.stdout.rstrip().endswith("PASS")


def test_strict_counts_every_run_that_did_not_finish_as_a_problem(tmp_path):
    package = tmp_path / "NVIDIA"
    shutil.copytree(NVIDIA_V20, package)
    _drop_run_stop(package, 3)
    verdict = package_results.Verdict()
    package_results.check_compliance(package, "2.0.0", verdict, strict=True)
    assert verdict.problems[0].endswith("result_3.txt: did not converge (no run_stop, last eval 0.72058 masked-LM "
                                        "accuracy at 2,403,520 samples)")
    assert verdict.problems[-1] == "dgxa100_ngc22.04_pytorch: --strict: every run must comply and converge"


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


def _start_init_earlier(path: Path, minutes: float) -> None:
    """Move the init_start of this result file `minutes` earlier: a longer initialization."""
    lines = path.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if '"key": "init_start"' in line)
    record = json.loads(lines[at].split(":::MLLOG ", 1)[1])
    record["time_ms"] -= int(minutes * 60_000)
    lines[at] = f":::MLLOG {json.dumps(record)}\n"
    path.write_text("".join(lines))


@pytest.mark.slow
def test_two_runs_that_did_not_finish_or_initialized_too_long_fail_and_leave_no_temporary_folders(tmp_path):
    """Two runs without run_stop: more than the one an olympic score accepts. One of them also initialized
    31 minutes (closed: 30 at most, training_rules.adoc §11), a problem of its own (one check of the
    package for both: the official checkers take seconds on it)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    package = tmp_path / "NVIDIA"
    shutil.copytree(NVIDIA_V20, package)
    _, slow_start = _drop_run_stop(package, 3, 5)
    _start_init_earlier(slow_start, 31)
    done = _tool("check", str(package), "--ruleset", "2.0.0", env={**os.environ, "TMPDIR": str(scratch)})
    assert done.returncode == 1 and done.stdout.splitlines()[-1].startswith("FAIL"), done.stdout + done.stderr
    failures = [line for line in done.stdout.splitlines() if "FAIL:" in line]
    assert any("result_3.txt: did not converge" in line for line in failures)
    assert any("result_5.txt: did not converge" in line for line in failures)
    assert any("2 runs did not comply or converge; an olympic score accepts one at most" in line
               for line in failures)
    assert any(re.search(r"FAIL: results/\S+/result_5\.txt: initialization took 3\d\.\d minutes, more than the 30 "
                         "minutes", line) for line in failures), failures
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


# ---------------------------------------------------------------------------------------------
# Published packages of later rounds (tests/harness/data/mlperf_logs/README.md says where they come from)

# Dell's 2xXE9712x4GB200 BERT result of training v5.0 (result_9.txt stopped aborted at 0.71987).
# Its published score is what the official result summarizer makes of the package as published:
# the olympic mean of the ten run times, result_9 counted as the slowest, times the RCP scaling
# factor published with it (scaling.json, 1.0347862833364607): 3.434 minutes, 206 seconds.
DELL_V50_SECONDS = 206


def _unpack(archive: Path, into: Path) -> Path:
    with tarfile.open(archive) as opened:
        opened.extractall(into, filter="data")
    org, = into.iterdir()
    return org


def _printed_score(stdout: str) -> tuple[float, float, float]:
    """(official minutes, raw olympic minutes, factor) of the one `score` line."""
    line, = [line for line in stdout.splitlines() if line.strip().startswith("score ")]
    found = re.search(r"= olympic mean ([\d.]+) minutes x ([\d.]+) .*official result summarizer: ([\d.]+)\)$", line)
    assert found, line
    return float(found.group(3)), float(found.group(1)), float(found.group(2))


@pytest.fixture(scope="module")
def dell_v50(tmp_path_factory) -> Path:
    return _unpack(MLPERF_LOGS / "v5.0" / "Dell.tar.gz", tmp_path_factory.mktemp("dell_v50"))


@pytest.mark.slow
def test_dell_v50_gb200_scores_as_published_with_one_aborted_run(dell_v50):
    files = sorted(dell_v50.glob("results/2xXE9712x4GB200/bert/result_*.txt"), key=package_results.natural_key)
    published_factor = json.loads((files[0].parent / "scaling.json").read_text())["scaling_factor"]
    assert math.isinf(_run_minutes(files[9]))  # aborted: counted as the slowest
    expected = _olympic_minutes(files) * published_factor
    assert round(expected * 60) == DELL_V50_SECONDS

    done = _tool("check", str(dell_v50))
    assert done.returncode == 0, done.stdout + done.stderr
    official, raw, factor = _printed_score(done.stdout)
    assert round(official * 60) == DELL_V50_SECONDS and official == pytest.approx(expected, abs=1e-6)
    assert raw == pytest.approx(_olympic_minutes(files), abs=5e-4) and factor == round(published_factor, 4)
    assert "RCP normalization factor" in done.stdout
    assert "RCP window (2xXE9712x4GB200): GBS 768 interpolated between the RCPs at GBS 448 and 4608" in done.stdout
    assert re.search(r"RCP margin \(2xXE9712x4GB200\): olympic mean [\d,]+ samples to converge, [\d,]+ "
                     r"\(2\.\d\d%\) above the minimum acceptable 2,306,738", done.stdout)
    assert "result_9.txt: did not converge (run_stop aborted, last eval 0.71987" in done.stdout


@pytest.mark.slow
def test_dell_v50_gb200_fails_under_strict(dell_v50):
    done = _tool("check", str(dell_v50), "--strict")
    assert done.returncode == 1
    failures = [line for line in done.stdout.splitlines() if "FAIL:" in line]
    assert "result_9.txt: did not converge (run_stop aborted" in failures[0]


def test_the_dell_v50_normalization_factor_is_the_published_one(dell_v50):
    """The RCP factor computed with mlperf_logging's tables equals the scaling.json MLCommons published."""
    files = sorted(dell_v50.glob("results/2xXE9712x4GB200/bert/result_*.txt"))
    published = json.loads((files[0].parent / "scaling.json").read_text())["scaling_factor"]
    verdict = scoring.rcp_verdict(files, "5.0.0")
    assert verdict.passed and verdict.message == "RCP Interpolation"
    assert verdict.norm_factor == pytest.approx(published, rel=1e-12)


@pytest.mark.slow
def test_dell_v41_h200_package_passes_without_normalization(tmp_path):
    package = _unpack(MLPERF_LOGS / "v4.1" / "Dell.tar.gz", tmp_path)
    done = _tool("check", str(package), "--ruleset", "4.1.0")
    assert done.returncode == 0, done.stdout + done.stderr
    official, raw, factor = _printed_score(done.stdout)
    files = sorted(package.glob("results/*/bert/result_*.txt"))
    assert official == pytest.approx(_olympic_minutes(files), abs=1e-6) and factor == 1.0
    assert round(official * 60) == round(_olympic_minutes(files) * 60)
    assert "no normalization: olympic mean of samples at or above the RCP mean" in done.stdout
    assert "compliance (XE9680x8H200-SXM-141GB): 10/10 result files comply and converged" in done.stdout


# ---------------------------------------------------------------------------------------------
# One set of hyperparameters per result


def test_pack_refuses_a_run_of_another_global_batch_size_naming_it(tmp_path):
    config = _write_config(tmp_path / "config_TEST_1x8.sh")
    logs = _write_runs(tmp_path / "runs", config, package_results.sysjson_line(config))
    logs[6].write_text(logs[6].read_text().replace('"key": "global_batch_size", "value": 448',
                                                   '"key": "global_batch_size", "value": 896'))
    done = _tool("pack", str(tmp_path / "runs"), "--config", str(tmp_path / "config_TEST_1x8.sh"),
                 "--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{logs[6]}: global_batch_size is 896 but 448 in" in done.stderr
    assert len(done.stderr.splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("text", ["note: run 9 was lost when the node rebooted; rerun tomorrow\n", ""])
def test_a_result_file_without_mlperf_lines_is_named_once_and_nothing_else_is_checked(tmp_path, capsys, text):
    """A plain note (or an empty file) as result_9.txt: one line naming it, exit 1; without the stop, each of
    the 14 fixed hyperparameters it does not log and the checkers' findings came as 17 FAIL lines."""
    package = tmp_path / "NVIDIA"
    shutil.copytree(NVIDIA_V20, package)
    note = next(package.glob("results/*/bert/result_9.txt"))
    note.write_text(text)
    assert package_results.main(["check", str(package), "--ruleset", "2.0.0"]) == 1
    out = capsys.readouterr().out
    assert len(re.findall(r"result_\d+\.txt", out)) == 1 and out.count("FAIL: ") == 1, out
    assert f"FAIL: {note.relative_to(package)}: holds no MLPerf log lines" in out
    assert out.rstrip().endswith("FAIL (1 problem(s))")


def test_check_names_the_result_file_with_another_learning_rate(tmp_path):
    package = tmp_path / "NVIDIA"
    shutil.copytree(NVIDIA_V20, package)
    odd = next(package.glob("results/*/bert/result_4.txt"))
    text = odd.read_text()
    assert '"key": "opt_base_learning_rate", "value": 0.000425' in text
    odd.write_text(text.replace('"key": "opt_base_learning_rate", "value": 0.000425',
                                '"key": "opt_base_learning_rate", "value": 0.0005'))
    verdict = package_results.Verdict()
    package_results.check_hyperparameters(package, verdict)
    problem, = verdict.problems
    assert problem.startswith(f"{odd.relative_to(package)}: opt_base_learning_rate is 0.0005 but 0.000425 in ")


# ---------------------------------------------------------------------------------------------
# The documented commands, as written


def _documented_pack(text: str) -> tuple[list[str], list[str]]:
    """(the pack command, the lines SCORE.md says it prints)."""
    command = re.search(r"^    (python tools/package_results\.py pack .+)$", text, re.M).group(1)
    printed = re.search(r"What the package check printed:\n\n```\n(.*?)```", text, re.S).group(1)
    return command.split(), printed.splitlines()


@pytest.mark.slow
def test_score_md_packaging_command_works_as_written_from_another_folder(tmp_path):
    """SCORE.md's command, relative --out included, run in a folder laid out like the repository."""
    command, printed = _documented_pack((DEMO_RUNS / "SCORE.md").read_text())
    (tmp_path / "tools").symlink_to(REPO / "tools")
    shutil.copy(REPO / "config_CPU_1x2.sh", tmp_path)
    shutil.copytree(DEMO_RUNS, tmp_path / "results" / "CPU_1x2", ignore=shutil.ignore_patterns("*.md"))
    done = subprocess.run([sys.executable, *command[1:]], cwd=tmp_path, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == printed
    assert (tmp_path / "results" / "package" / "checker_logs" / "package_checker.log").is_file()
    shipped = REPO / "results" / "package" / "reference" / "results" / "CPU_1x2" / "bert"
    made = tmp_path / "results" / "package" / "reference" / "results" / "CPU_1x2" / "bert"
    assert all((made / p.name).read_bytes() == p.read_bytes() for p in shipped.glob("result_*.txt"))


# ---------------------------------------------------------------------------------------------
# M > N runs


@pytest.mark.slow
def test_pack_select_packages_the_median_window_and_names_the_dropped_runs(tmp_path):
    config = _write_config(tmp_path / "config_TEST_1x8.sh")
    runs = tmp_path / "runs"
    runs.mkdir()
    header = CACHE_CLEAR + package_results.sysjson_line(config) + "\n"
    # twelve runs launched an hour apart; file names run against launch order
    logs = []
    for i, seed in enumerate(range(101, 113)):
        path = runs / f"run_{12 - i:02d}.log"
        path.write_text(header + fake_trainer.synthetic_log(config, seed, 1.7e12 + i * 3.6e6))
        logs.append(path)
    scores = [_olympic_minutes(logs[i:i + 10]) for i in range(3)]
    median = sorted(range(3), key=lambda i: (scores[i], i))[1]
    done = _tool("pack", str(runs), "--config", str(tmp_path / "config_TEST_1x8.sh"), "--out",
                 str(tmp_path / "out"), "--select", "10", "--logs", str(tmp_path / "logs"))
    assert done.returncode == 0, done.stdout + done.stderr
    kept, dropped = logs[median:median + 10], logs[:median] + logs[median + 10:]
    assert f"the median window is runs {median + 1}..{median + 10}" in done.stdout
    assert [line.split(" ")[1] for line in done.stdout.splitlines() if line.startswith("dropped: ")] == \
        [str(p) for p in dropped]
    results = sorted((tmp_path / "out" / "TestOrg" / "results" / "TEST_1x8" / "bert").glob("result_*.txt"),
                     key=package_results.natural_key)
    assert [p.read_text() for p in results] == [p.read_text() for p in kept]
    sources = (tmp_path / "out" / "TestOrg" / "results" / "TEST_1x8" / "sources.txt").read_text()
    assert all(f"not packaged <- {p} " in sources for p in dropped)


def test_select_needs_more_runs_than_it_keeps(tmp_path):
    config = _write_config(tmp_path / "config_TEST_1x8.sh")
    _write_runs(tmp_path / "runs", config, package_results.sysjson_line(config))
    done = _tool("pack", str(tmp_path / "runs"), "--config", str(tmp_path / "config_TEST_1x8.sh"),
                 "--out", str(tmp_path / "out"), "--select", "10")
    assert done.returncode == 2 and "--select 10 picks from more than 10 runs" in done.stderr


@pytest.mark.parametrize("division, minutes, flagged", [("closed", 29.9, False), ("closed", 30.1, True),
                                                        ("open", 239.9, False), ("open", 240.1, True)])
def test_an_initialization_past_the_division_maximum_is_flagged(tmp_path, division, minutes, flagged):
    """training_rules.adoc §11: 30 minutes of untimed init in the closed division, 4 hours in the open one."""
    bert = tmp_path / "Org" / "results" / "sys" / "bert"
    bert.mkdir(parents=True)
    (tmp_path / "Org" / "systems").mkdir()
    lines = [{"key": "init_start", "time_ms": 1_000, "event_type": "INTERVAL_START", "value": None},
             {"key": "submission_division", "time_ms": 1_000, "event_type": "POINT_IN_TIME", "value": division},
             {"key": "run_start", "time_ms": 1_000 + int(minutes * 60_000), "event_type": "INTERVAL_START",
              "value": None}]
    (bert / "result_0.txt").write_text("".join(f":::MLLOG {json.dumps(line)}\n" for line in lines))
    verdict = package_results.Verdict()
    package_results.check_init_time(tmp_path / "Org", verdict)
    assert len(verdict.problems) == int(flagged)
    if flagged:
        assert verdict.problems[0].startswith("results/sys/bert/result_0.txt: initialization took")
        assert f"{minutes:.1f} minutes" in verdict.problems[0]


@pytest.mark.parametrize("value", ["0", "-8", "1.5", "448 "])
def test_a_global_batch_size_that_is_not_a_positive_whole_number_is_refused(value):
    """GLOBAL_BATCH_SIZE, read as it is (the trainer's own count is config_batch's): 0 included, at the bound."""
    with pytest.raises(package_results.PackageError,
                       match=re.escape(f"config_X.sh: GLOBAL_BATCH_SIZE={value} is not a positive whole number")):
        package_results.config_global_batch_size({"GLOBAL_BATCH_SIZE": value}, Path("config_X.sh"))
    assert package_results.config_global_batch_size({"GLOBAL_BATCH_SIZE": "1"}, Path("config_X.sh"))[0] == 1


def test_only_an_open_config_gets_the_open_division_note():
    """A closed config, and a batch size with no config (`rcp --gbs`) or no DIVISION, are checked against the RCPs."""
    closed = package_results.rcp_comment(768, "5.0.0", "closed")
    assert "open division" not in closed and closed.startswith("# RCP (training 5.0.0, bert): GBS 768 ")
    assert package_results.rcp_comment(768, "5.0.0") == closed
    assert package_results.rcp_comment(768, "5.0.0", "open") == closed + "; open division: no RCP check"
