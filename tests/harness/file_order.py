"""The order `make test` hands test files to its xdist workers in: the heaviest first."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.paths import REPO

# The heaviest test files (seconds of one idle 2-core run, `pytest --durations=0`), started first: `make test`
# hands whole files to its xdist workers in collection order, so a heavy file collected last would run alone at
# the end while the other worker sits idle. Files not listed keep their order. Paths as in the tests' node ids.
HEAVIEST_FIRST = ("tests/trainer/dryrun/test_dryrun.py", "tests/tools/results/test_package_results.py",
                  "tests/system/test_two_nodes.py", "tests/system/test_clock.py", "tests/system/test_launchers.py",
                  "tests/tools/testing/test_kill_soak.py", "tests/trainer/model/test_fp8.py",
                  "tests/trainer/test_run_pretraining.py", "tests/system/test_clip_modes_training.py",
                  "tests/trainer/runtime/test_launch.py", "tests/system/test_output_faults.py",
                  "tests/tools/bring_up/test_gpu_perf.py", "tests/trainer/optim/test_sharded_optimizer.py",
                  "tests/trainer/train/test_fast_training.py", "tests/system/test_preemption.py",
                  "tests/system/test_lost_rank.py", "tests/tools/bring_up/test_bring_up.py",
                  "tests/trainer/input/test_balance_dist.py", "tests/trainer/input/test_unverified_data.py",
                  "tests/trainer/train/test_resume.py", "tests/tools/planning/test_step_calibration.py",
                  "tests/trainer/input/test_resume_world_size.py", "tests/benchmarks/test_throughput_bench.py",
                  "tests/tools/planning/test_plan.py", "tests/tools/testing/test_types.py",
                  "tests/trainer/config/test_closed_division.py", "tests/data_prep/test_pipeline_to_trainer.py",
                  "tests/tools/bring_up/test_numerics_bands.py", "tests/tools/bring_up/test_numerics_check.py")


def heaviest_first(items: list[pytest.Item]) -> None:
    """Sorts the collected tests so that HEAVIEST_FIRST's files come first, in its order. A file it names that is
    not there (moved, renamed) stops the run: it would quietly keep its collection order and end the run alone."""
    gone = [path for path in HEAVIEST_FIRST if not (REPO / path).is_file()]
    if gone:
        raise pytest.UsageError(f"HEAVIEST_FIRST in {Path(__file__).relative_to(REPO)} names {', '.join(gone)}, "
                                "which is not there: give its path now")
    rank = {path: i for i, path in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: each file keeps its order
