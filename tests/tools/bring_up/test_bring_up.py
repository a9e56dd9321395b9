"""tools/bring_up.sh as a user starts it: the CPU smoke mode runs every step it has, in seconds."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.harness.commands import run_cli


def test_smoke_mode_runs_every_step(tmp_path):
    out = tmp_path / "bring_up"
    # 999 s written with a leading zero: decimal seconds (the shell would read 0999 as octal, a bad one)
    done = run_cli(["bash", "tools/bring_up.sh", str(out)], env={"SMOKE": "1", "PYTHON": sys.executable,
                                                                  "BUDGET_S": "0999"}, timeout=300)
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 0, summary + done.stderr
    lines = summary.splitlines()
    assert lines[0].startswith("bring-up ") and "CPU smoke mode" in lines[0]
    assert any(line.startswith("env: precisions supported: fp32") for line in lines), summary
    for name in ("numerics fp32", "throughput tiny"):
        row = next(line for line in lines if line.startswith(name))
        assert " passed " in row, row
    assert "gpu-check: skipped" in summary and lines[-1].startswith("bring-up: passed")
    assert "pytest gpu: skipped (CPU smoke mode; would run tests/trainer/" in summary  # the GPU tests, found in folders
    reports = json.loads((out / "numerics.json").read_text())
    assert [r["passed"] for r in reports] == [True] and reports[0]["label"].startswith("fp32 on cpu")
    assert {r["layout"] for r in json.loads((out / "throughput.json").read_text())["results"]} == {"packed"}
    assert "=== numerics fp32" in (out / "bring_up.log").read_text()


EARLIER = {"summary.txt": "bring-up: passed in 480 s\n", "bring_up.log": "last week's log\n", "numerics.json": "[]\n"}


@pytest.mark.parametrize(("env", "line"), [
    ({"SMOKE": "0"}, f"bring_up.sh: no CUDA device visible to {sys.executable}; SMOKE=1 runs the CPU smoke mode"),
    ({"SMOKE": "1"}, "bring_up.sh: {out} holds an earlier run (summary.txt bring_up.log numerics.json); give a new "
                     "folder (bash tools/bring_up.sh DIR), or move that one away"),
    ({"BRING_UP_DEVICE": "cpu", "CONFIGS": "config_DGXH300_1x8.sh"},
     "bring_up.sh: CONFIGS: no file config_DGXH300_1x8.sh; name config_<SYSTEM>.sh files of the repository"),
])
def test_without_gpu_or_on_an_earlier_run_is_one_line_and_the_folder_is_left_as_it_was(tmp_path, env, line):
    out = tmp_path / "last_week"
    out.mkdir()
    for name, text in EARLIER.items():
        (out / name).write_text(text)
    done = run_cli(["bash", "tools/bring_up.sh", str(out)], env={"PYTHON": sys.executable, **env})
    assert done.returncode == 2 and not done.stdout, done.stdout + done.stderr
    assert done.stderr.splitlines() == [line.format(out=out)]
    assert {p.name: p.read_text() for p in out.iterdir()} == EARLIER


def test_a_bring_up_where_no_check_ran_is_not_a_pass(tmp_path):
    """BUDGET_S=0: every step is skipped (the machine's facts are no check): exit 1 with a line that says so."""
    done = run_cli(["bash", "tools/bring_up.sh", str(tmp_path)], env={"SMOKE": "1", "PYTHON": sys.executable,
                                                                      "BUDGET_S": "0"}, timeout=300)
    lines = (tmp_path / "summary.txt").read_text().splitlines()
    assert done.returncode == 1, lines
    assert [line.split()[0] for line in lines if "skipped: budget spent" in line] == ["numerics", "throughput"]
    assert lines[-1].startswith("bring-up: FAILED: no check ran (every step was skipped: the budget of 0 s")
    assert not any(line.startswith("bring-up: passed") for line in lines)


@pytest.mark.parametrize("budget", ["9m", "abc", "1.5", "-5"])
def test_a_budget_that_is_not_whole_seconds_is_one_line_and_exit_2(tmp_path, budget):
    done = run_cli(["bash", "tools/bring_up.sh", str(tmp_path)], env={"SMOKE": "1", "PYTHON": sys.executable,
                                                                      "BUDGET_S": budget})
    assert done.returncode == 2 and not done.stdout, done.stdout + done.stderr
    assert done.stderr.splitlines() == [f"bring_up.sh: BUDGET_S={budget} is not a whole number of seconds "
                                        "(e.g. BUDGET_S=470)"]


def test_a_folder_it_cannot_write_is_named_with_exit_2():
    """/proc exists and takes no new file, even for root (a folder chmod'ed read-only does not stop root)."""
    done = run_cli(["bash", "tools/bring_up.sh", "/proc"], env={"SMOKE": "1", "PYTHON": sys.executable})
    assert done.returncode == 2 and not done.stdout, done.stdout + done.stderr
    assert done.stderr.splitlines() == ["bring_up.sh: cannot write to the output folder /proc; give one you can "
                                        "write (bash tools/bring_up.sh DIR)"]


def test_gpu_check_line_reads_the_planners_memory_estimate(tmp_path: Path) -> None:
    """Each gpu-check line ends with tools/plan.py's traced training peak, read off plan.py's memory line (the
    first GPU run's said "estimate: tools/plan.py: no memory line"), or with the line plan.py stopped with.
    Every step's budget is spent (BUDGET_S=0): the estimates are what is left to run."""
    unknown = tmp_path / "config_UNKNOWN_1x8.sh"
    unknown.write_text("".join(f"export {name}\n" for name in
                               ("DGXSYSTEM=UNKNOWN_1x8", "DGXNGPU=8", "DGXNNODES=1", "BATCHSIZE=8", "GRADIENT_STEPS=1")))
    out = tmp_path / "bring_up"
    done = run_cli(["bash", "tools/bring_up.sh", str(out)], timeout=300,
                   env={"BRING_UP_DEVICE": "cpu", "BUDGET_S": "0", "PYTHON": sys.executable,
                        "CONFIGS": f"config_DGXH200_1x8.sh {unknown}"})
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 1 and "bring-up: FAILED: no check ran" in summary, summary + done.stderr
    planned = (out / "bring_up.log").read_text().split("=== plan config_DGXH200_1x8.sh\n")[1]
    training = re.search(r"memory per device: (training \d+\.\d GiB),", planned)
    assert training, planned
    estimates = re.findall(r"^    no dry run verdict; no peak memory line; estimate: (.*)$", summary, re.M)
    assert len(estimates) == 2 and estimates[0] == f"tools/plan.py {training.group(1)}", summary
    assert estimates[1].startswith("tools/plan.py failed (exit 2): plan.py: config_UNKNOWN_1x8.sh: "
                                   "DGXSYSTEM='UNKNOWN_1x8' names no known device; pass --device"), summary
