"""What every folder's tests share: the demo dataset made once per test run with the real generator, a
trainer served to a module, and the order the test files start in. Each folder's own fixtures are in its
conftest.py; the machinery the tests use is the package tests/harness."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import pytest

from data_prep.stratify import StratifyParams, stratify
from mlperf_bert.data.shards import list_shards
from tests.harness.demo import make_demo_data
from tests.harness.served import Served
from tests.harness.shared_folder import shared_by_workers
from tests.harness.workers.balance import BOUNDS, MAX_LEN, MAX_PRED

# TensorFlow and Triton each bring their own LLVM: Triton imported after TensorFlow aborts the process ("LLVM
# ERROR: inconsistency in registered CommandLine options"), before it both load. A pytest process imports both
# (data_prep's TFRecord tests; torch.utils.flop_counter, which the dry run imports, loads Triton), in whatever
# order the test folders are collected, so Triton first, where it is installed.
with contextlib.suppress(ImportError):
    import triton  # noqa: F401


@pytest.fixture(scope="module")
def served_trainer() -> Iterator[Served]:
    """One process serving the module's trainer runs (tests/harness/served.py: `run_pretraining.py ARGV` without a
    Python start-up each), for tests of what a run computes and says; start-up, signals and launchers are
    tested on processes of their own."""
    served = Served("trainer")
    yield served
    served.close()


@pytest.fixture(scope="module")
def stratified(plain, tmp_path_factory) -> Path:
    """The strata of the requesting module's `plain` shards (workers/balance.py's data)."""
    out = tmp_path_factory.mktemp("stratified") / "data"
    stratify(list_shards(plain), out, StratifyParams(bounds=BOUNDS, shards_per_stratum=2, max_seq_length=MAX_LEN,
                                                      max_predictions=MAX_PRED))
    return out


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    return shared_by_workers(tmp_path_factory, "demo_data", make_demo_data)


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
