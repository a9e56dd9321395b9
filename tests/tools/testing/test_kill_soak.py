"""tools/kill_soak.py: a run killed 4 times at random moments and resumed ends bitwise like the
uninterrupted one (the 50-kill figures are in docs/FAULTS.md); its comparison and its reading of
the moment a kill hit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mlperf_tools.testing import kill_soak
from tests.harness.demo import DEMO_CONFIG_TEST_SIZES
from tests.harness.paths import REPO

MOMENTS = {"launch", "init", "step", "checkpoint write", "eval"}


@pytest.mark.slow
def test_four_kills_and_resumes_end_bitwise_like_the_uninterrupted_run(demo_data, tmp_path):
    """One round of the plan: each target (start-up, step, checkpoint, eval) once, SIGTERM once."""
    sizes = [f"--set={name}={value}" for name, value in DEMO_CONFIG_TEST_SIZES.items()]
    run = ["--set=TARGET_MLM_ACCURACY=0.999", "--set=MAX_STEPS=40", "--set=WARMUP_STEPS=5",
           "--set=EVAL_ITER_START_SAMPLES=160", "--set=EVAL_ITER_SAMPLES=160"]
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(REPO / "tools" / "kill_soak.py"), "--kills", "4", "--seed", "3",
                           "--data", str(demo_data), "--work", str(tmp_path / "soak"), "--report", str(report),
                           *sizes, *run], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(report.read_text())
    assert figures["equal"] and figures["kills"] == 4 and figures["eval_points"] == 4, figures
    assert sum(figures["signals"].values()) == 4 and figures["signals"]["SIGTERM"] == 1
    assert set(figures["moments"]) <= MOMENTS and sum(figures["moments"].values()) == 4
    assert figures["planned"] == {"startup": 1, "step": 1, "checkpoint": 1, "eval": 1}
    assert set(figures["targets"]) <= {"startup", "step", "checkpoint", "eval"}
    assert figures["attempts"] == 5 and "bitwise equal" in done.stdout


def _checkpoint(folder: Path, samples: int, weight: float) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"model": {"w": torch.tensor([weight])}, "optimizer": {"step": 1}, "scaler": None,
                "train_state": {"samples": samples}, "data": {"step": 1}}, folder / f"ckpt-{samples:012d}.pt")


def _log(path: Path, *events: tuple[str, object, dict]) -> None:
    path.write_text("".join(f':::MLLOG {json.dumps({"key": k, "value": v, "metadata": m})}\n' for k, v, m in events))


def test_compare_runs_names_every_difference(tmp_path):
    base, soak = tmp_path / "base", tmp_path / "soak"
    for folder, weight, accuracy in ((base, 1.0, 0.5), (soak, 1.0 + 2**-20, 0.25)):
        _checkpoint(folder / "checkpoints", 64, weight)
        _log(folder / "mlperf.log", ("eval_accuracy", accuracy, {"epoch_num": 64}),
             ("run_stop", None, {"status": "aborted"}))
    assert kill_soak.compare_runs(base, base) == []
    assert kill_soak.compare_runs(base, soak) == ["model/w: tensors differ", "eval at 64 samples: [0.25] vs 0.5"]


def test_moment_is_read_from_what_the_job_left(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    assert kill_soak.moment(run, 0, set()) == "launch"
    _log(run / "mlperf.log", ("init_start", None, {}))
    assert kill_soak.moment(run, 0, set()) == "init"
    _log(run / "mlperf.log", ("init_start", None, {}), ("block_start", None, {}), ("eval_start", None, {"epoch_num": 64}))
    assert kill_soak.moment(run, 0, set()) == "eval"
    offset = (run / "mlperf.log").stat().st_size  # a later attempt reads only its own lines
    assert kill_soak.moment(run, offset, set()) == "launch"
    with open(run / "mlperf.log", "a") as log:
        log.write(':::MLLOG {"key": "eval_stop", "value": null, "metadata": {"epoch_num": 64}}\n')
    assert kill_soak.moment(run, 0, set()) == "step"
    (run / "checkpoints" / ".ckpt-000000000064.pt.tmp-123").write_bytes(b"")
    assert kill_soak.moment(run, 0, set()) == "checkpoint write"
    assert kill_soak.moment(run, 0, {".ckpt-000000000064.pt.tmp-123"}) == "step"  # left by an earlier attempt
