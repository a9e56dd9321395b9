"""What every folder's tests share: the demo dataset made once per test run with the real generator, a
trainer served to a module, and the order the test files start in. Each folder's own fixtures are in its
conftest.py; the machinery the tests use is the package tests/harness."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import pytest

from tests.harness.demo import make_demo_data
from tests.harness.file_order import heaviest_first
from tests.harness.served import Served
from tests.harness.shared_folder import shared_by_workers

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


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    return shared_by_workers(tmp_path_factory, "demo_data", make_demo_data)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    heaviest_first(items)
