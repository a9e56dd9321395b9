"""tools/bring_up.sh as a user starts it: the CPU smoke mode runs every step it has, in seconds."""

from __future__ import annotations

import json
import sys

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
