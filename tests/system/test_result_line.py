"""run_and_time.sh's RESULT line says whether the run reached its target."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.harness.paths import REPO


def _fake_python(path: Path, status: str | None) -> Path:
    """Stands in for `python run_pretraining.py ...`: writes a run_stop with `status`, exits 0."""
    record = {"namespace": "", "time_ms": 1, "event_type": "INTERVAL_END", "key": "run_stop",
              "value": None, "metadata": {"status": status, "epoch_num": 64}}
    line = f":::MLLOG {json.dumps(record)}" if status else ":::MLLOG {}"
    path.write_text(f"#!/bin/sh\necho '{line}' >> \"$MLPERF_LOG_FILE\"\n")
    path.chmod(0o755)
    return path


def _result(tmp_path: Path, status: str | None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "data").mkdir()
    (tmp_path / "bert_config.json").write_text("{}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DGX", "RANK"))}
    env.update(DGXNGPU="1", DGXNNODES="1", BATCHSIZE="8", GRADIENT_STEPS="1", LR="1e-3", MAX_STEPS="8",
               OPT_LAMB_BETA_1="0.9", OPT_LAMB_BETA_2="0.999", WEIGHT_DECAY_RATE="0.01",
               MAX_SAMPLES_TERMINATION="64", TARGET_MLM_ACCURACY="0.72", INPUT_LAYOUT="padded",
               PRECISION="fp32", DATADIR_PHASE2=str(tmp_path / "data"), EVALDIR=str(tmp_path / "data"),
               BERT_CONFIG=str(tmp_path / "bert_config.json"), INIT_CHECKPOINT="none", SEED="5",
               OUTPUT_DIR=str(tmp_path / "out"), MLPERF_LOG_FILE=str(tmp_path / "mlperf.log"),
               PYTHON=str(_fake_python(tmp_path / "python", status)))
    return subprocess.run(["bash", str(REPO / "run_and_time.sh")], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.parametrize("status,field", [("success", "success"), ("aborted", "aborted"), (None, "unknown")])
def test_result_line_ends_with_the_run_stop_status(tmp_path, status, field):
    done = _result(tmp_path, status)
    assert done.returncode == 0, done.stderr
    result = [line for line in done.stdout.splitlines() if line.startswith("RESULT,")]
    assert len(result) == 1
    fields = result[0].split(",")
    # The fields MLPerf result scripts read keep their places: benchmark, seed, seconds.
    assert fields[:3] == ["RESULT", "bert", "5"] and fields[3].isdigit()
    assert fields[-1] == field and len(fields) == 7
    assert ("did not reach the target" in done.stderr) == (status != "success")
