"""tools/bring_up.sh as a user starts it: the CPU smoke mode runs every step it has, in seconds."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from conftest import run_cli


def test_smoke_mode_runs_every_step(tmp_path):
    out = tmp_path / "bring_up"
    done = run_cli(["bash", "tools/bring_up.sh", str(out)], env={"SMOKE": "1", "PYTHON": sys.executable},
                   timeout=300)
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 0, summary + done.stderr
    lines = summary.splitlines()
    assert lines[0].startswith("bring-up ") and "CPU smoke mode" in lines[0]
    assert any(line.startswith("env: precisions supported: fp32") for line in lines), summary
    for name in ("numerics fp32", "throughput tiny"):
        row = next(line for line in lines if line.startswith(name))
        assert " passed " in row, row
    assert "gpu-check: skipped" in summary and lines[-1].startswith("bring-up: passed")
    assert "pytest gpu: skipped (CPU smoke mode; would run tests/test_" in summary
    reports = json.loads((out / "numerics.json").read_text())
    assert [r["passed"] for r in reports] == [True] and reports[0]["label"].startswith("fp32 on cpu")
    assert {r["layout"] for r in json.loads((out / "throughput.json").read_text())["results"]} == {"packed"}
    assert "=== numerics fp32" in (out / "bring_up.log").read_text()


def test_without_gpu_or_smoke_mode_is_one_line(tmp_path):
    done = run_cli(["bash", "tools/bring_up.sh", str(tmp_path)], env={"SMOKE": "0", "PYTHON": sys.executable})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"bring_up.sh: no CUDA device visible to {sys.executable}; SMOKE=1 runs the CPU smoke mode"]


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
    assert done.returncode == 0, summary + done.stderr
    planned = (out / "bring_up.log").read_text().split("=== plan config_DGXH200_1x8.sh\n")[1]
    training = re.search(r"memory per device: (training \d+\.\d GiB),", planned)
    assert training, planned
    estimates = re.findall(r"^    no dry run verdict; no peak memory line; estimate: (.*)$", summary, re.M)
    assert len(estimates) == 2 and estimates[0] == f"tools/plan.py {training.group(1)}", summary
    assert estimates[1].startswith("tools/plan.py failed (exit 2): plan.py: config_UNKNOWN_1x8.sh: "
                                   "DGXSYSTEM='UNKNOWN_1x8' names no known device; pass --device"), summary
