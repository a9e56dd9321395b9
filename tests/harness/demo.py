"""The demo data a test session makes with the real generator, and the trainer flags and config variables
for a short run on it."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path
from typing import Mapping

from tests.harness.commands import run_cli
from tests.harness.paths import REPO


def make_demo_data(out: Path, *extra: str) -> Path:
    result = run_cli([sys.executable, "data_prep/make_demo_data.py", "--output_dir", str(out), "--num_train", "2000",
                      "--num_eval", "200", "--num_shards", "3", "--max_seq_length", "64",
                      "--max_predictions_per_seq", "10", "--hidden_size", "32", "--intermediate_size", "64",
                      "--vocab_size", "128", "--seed", "7", *extra])
    assert result.returncode == 0, result.stderr
    return out


def verify_folder(folder: Path, *flags: str) -> None:
    """data_prep's full verification of `folder`, which writes its verification record (VERIFIED.json)."""
    done = run_cli([sys.executable, "data_prep/verify_dataset.py", str(folder), "--workers", "1", *flags])
    assert done.returncode == 0, done.stdout + done.stderr


def copy_verified(folder: Path, to: Path) -> Path:
    """A copy that keeps modification times, so the copied record still matches its files."""
    shutil.copytree(folder, to, copy_function=shutil.copy2)
    return to


def trainer_args(data: Path, out: Path, *extra: str) -> list[str]:
    """Flags for a short run on the session's demo data. No curves.png (a second of matplotlib per
    run): the tests that look at the picture ask for it with `--curves png`."""
    return [
        "--input_dir", str(data / "train"), "--eval_dir", str(data / "eval"),
        "--bert_config_path", str(data / "bert_config.json"), "--output_dir", str(out),
        "--max_seq_length", "64", "--max_predictions_per_seq", "10", "--num_eval_examples", "200",
        "--train_batch_size", "8", "--learning_rate", "1e-2", "--max_steps", "6", "--eval_iter_samples", "32",
        "--submission_division", "open", "--log_freq", "2", "--curves", "none", *extra,
    ]


# config_CPU_1x2.sh's sizes shrunk to the session's demo data (64 tokens, 200 eval samples), without
# curves.png (as in trainer_args).
DEMO_CONFIG_TEST_SIZES = {"BATCHSIZE": "8", "MAX_SEQ_LENGTH": "64", "MAX_PREDICTIONS_PER_SEQ": "10",
                          "NUM_EVAL_EXAMPLES": "200", "EVAL_BATCH_SIZE": "100", "SEED": "1", "INIT_CHECKPOINT": "none",
                          "CURVES": "none"}


def config_exports(path: Path) -> dict[str, str]:
    """The `export NAME=VALUE` lines of a config_<SYSTEM>.sh file."""
    return dict(re.findall(r"^export (\w+)=(\S*)", path.read_text(), re.M))


def demo_config_env(data: Path, base: Mapping[str, str] = os.environ, **overrides: str) -> dict[str, str]:
    """`base` and the variables run_and_time.sh gets from config_CPU_1x2.sh, at the test data's sizes,
    on `data`."""
    return {**base, **config_exports(REPO / "config_CPU_1x2.sh"), **DEMO_CONFIG_TEST_SIZES,
            "PYTHON": sys.executable, "DATADIR_PHASE2": str(data / "train"), "EVALDIR": str(data / "eval"),
            "BERT_CONFIG": str(data / "bert_config.json"), "OMP_NUM_THREADS": "1", **overrides}
