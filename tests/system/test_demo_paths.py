"""`make demo` from a checkout whose path has a space, writing outside the committed results/."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.harness.paths import REPO

# The demo config at toy size: a few seconds of data and training, the target reached at the first eval.
TINY = {"DEMO_NUM_TRAIN": "600", "DEMO_NUM_SHARDS": "2", "DEMO_HIDDEN_SIZE": "32", "DEMO_INTERMEDIATE_SIZE": "64",
        "NUM_EVAL_EXAMPLES": "100", "EVAL_BATCH_SIZE": "50", "BATCHSIZE": "8", "EVAL_ITER_START_SAMPLES": "32",
        "EVAL_ITER_SAMPLES": "32", "MAX_STEPS": "4", "WARMUP_STEPS": "1", "TARGET_MLM_ACCURACY": "0.01",
        "MAX_SAMPLES_TERMINATION": "64", "MAX_SEQ_LENGTH": "64", "MAX_PREDICTIONS_PER_SEQ": "10"}


def _spaced_checkout(tmp_path: Path) -> Path:
    """The working tree's files (as git lists them) under a path with spaces; .venv is linked, not rebuilt."""
    root = tmp_path / "my checkouts" / "bert repo"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.splitlines()
    for name in listed:
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    (root / ".venv").symlink_to(REPO / ".venv")
    (root / ".venv" / ".installed").touch()  # installed already: make must not reinstall
    config = (REPO / "config_CPU_1x2.sh").read_text()
    config += "".join(f"export {key}={value}\n" for key, value in TINY.items())
    (root / "tiny config.sh").write_text(config)
    return root


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_make_demo_works_from_a_path_with_spaces_and_leaves_results_alone(tmp_path):
    root = _spaced_checkout(tmp_path)
    committed = _tree(root / "results")
    env = {k: v for k, v in os.environ.items() if k not in ("LOGDIR", "DEMO_DATA", "PYTHON")}
    env.update(OMP_NUM_THREADS="1", SEED="5", DEMO_CONFIG=str(root / "tiny config.sh"))
    result = subprocess.run(["make", "demo"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "compliance checker, ruleset 5.0.0: SUCCESS" in result.stdout
    assert _tree(root / "results") == committed
    logs = list((root / "demo_runs" / "CPU_1x2").glob("*_5.log"))
    assert len(logs) == 1 and ":::MLLOG" in logs[0].read_text()
    # The README's packaging of the committed runs still works after a demo run.
    packed = subprocess.run([str(root / ".venv" / "bin" / "python"), "tools/package_results.py", "pack",
                             "results/CPU_1x2", "--config", "config_CPU_1x2.sh", "--out", str(tmp_path / "package")],
                            cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert packed.returncode == 0 and packed.stdout.rstrip().endswith("PASS"), packed.stdout[-2000:] + packed.stderr
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", "demo_runs/CPU_1x2/x.log"], cwd=REPO)
    assert ignored.returncode == 0, "demo_runs/ must be ignored by git"


def test_demo_data_made_before_the_verification_records_is_verified(tmp_path):
    """`make demo` on a demo_data/ folder made before VERIFIED.json existed: the run refuses unverified
    data, so run_demo.sh verifies it first."""
    from mlperf_bert.data.record import read_record, stale_problems

    config, data = tmp_path / "tiny.sh", tmp_path / "demo_data"
    config.write_text((REPO / "config_CPU_1x2.sh").read_text()
                      + "".join(f"export {key}={value}\n" for key, value in TINY.items()))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DEMO_CONFIG": str(config), "DEMO_DATA": str(data),
           "PYTHON": sys.executable}
    made = subprocess.run(["bash", "tools/run_demo.sh", "--data-only"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    for part in ("train", "eval"):
        (data / part / "VERIFIED.json").unlink()
    again = subprocess.run(["bash", "tools/run_demo.sh", "--data-only"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0 and "verifying the demo dataset" in again.stdout, again.stderr[-3000:]
    train, evals = read_record(data / "train"), read_record(data / "eval")
    assert train.ok and evals.ok and stale_problems(train) == stale_problems(evals) == []
    assert train.eval_digests == (evals.samples_digest,)
