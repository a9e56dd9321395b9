"""Shared fixtures: a small demo dataset made once per test session with the real generator."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Callable, Iterator, Mapping

import pytest

from _served import Served

REPO = Path(__file__).resolve().parents[1]
TRAINER = REPO / "pytorch" / "run_pretraining.py"


def require_tool(available: bool, reason: str) -> None:
    """Fails a test whose tool is missing, naming how to get it: `make test` installs every
    such tool (the Python ones into .venv, the system ones as root), so a check never passes
    by not running."""
    if not available:
        pytest.fail(f"{reason}; `make test` installs it (system tools when run as root)")


def run_cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs a command the way a user would, from the repository root."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(args, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def load_script(path: Path, name: str) -> types.ModuleType:
    """A script of the repository (benchmarks/, tools/) imported as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


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


def _shared_by_workers(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], Path]) -> Path:
    """`make(folder)` once per test run: under pytest-xdist every worker has its own session, so the
    first one to take the lock builds the folder in the run's common temporary folder and the others
    wait for it and use it (read-only)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return make(tmp_path_factory.mktemp(name))
    common = tmp_path_factory.getbasetemp().parent  # this run's folder, above each worker's own
    folder, done = common / name, common / f"{name}.done"
    with open(common / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker that failed half-way left it
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


@pytest.fixture(scope="module")
def served_trainer() -> Iterator[Served]:
    """One process serving the module's trainer runs (tests/_served.py: `run_pretraining.py ARGV` without a
    Python start-up each), for tests of what a run computes and says; start-up, signals and launchers are
    tested on processes of their own."""
    served = Served("trainer")
    yield served
    served.close()


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    return _shared_by_workers(tmp_path_factory, "demo_data", make_demo_data)


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


# The heaviest test files (seconds of one idle 2-core run, `pytest --durations=0`), started first: `make
# test` hands whole files to its xdist workers in collection order, so a heavy file collected last
# would run alone at the end while the other worker sits idle. Files not listed keep their order.
HEAVIEST_FIRST = ("test_dryrun.py", "test_package_results.py", "test_two_nodes.py", "test_clock.py", "test_launchers.py",
                  "test_kill_soak.py", "test_fp8.py", "test_run_pretraining.py", "test_clip_modes_training.py",
                  "test_launch.py", "test_output_faults.py", "test_gpu_perf.py", "test_sharded_optimizer.py",
                  "test_fast_training.py", "test_preemption.py", "test_lost_rank.py", "test_bring_up.py",
                  "test_balance_dist.py", "test_unverified_data.py", "test_resume.py", "test_step_calibration.py",
                  "test_resume_world_size.py", "test_throughput_bench.py", "test_plan.py", "test_types.py",
                  "test_closed_division.py", "test_pipeline_to_trainer.py", "test_numerics_bands.py",
                  "test_numerics_check.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order
