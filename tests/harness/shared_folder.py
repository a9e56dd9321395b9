"""A folder built once per test run and read by every pytest-xdist worker."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable

import pytest


def shared_by_workers(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], Path]) -> Path:
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
