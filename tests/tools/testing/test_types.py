"""The type check of the three packages (the trainer, data_prep and mlperf_tools: pyproject's [tool.mypy]
files) is one of `make test`'s tests, so it runs beside the others instead of before them; a type error
fails `make test` all the same.

mypy's cache lives beside the project's other build caches (~/.cache/mlperf_bert/mypy), not in the
checkout: a fresh clone checks in seconds what takes a minute of CPU from nothing (most of it torch's
own modules). The cache is keyed by each file's hash, so a changed file is checked again wherever
the cache was made."""

from __future__ import annotations

import sys

from mlperf_bert.dryrun.native import build_dir
from tests.harness.commands import run_cli


def test_the_packages_pass_mypy():
    done = run_cli([sys.executable, "-m", "mypy", "--cache-dir", str(build_dir().parent / "mypy")])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "Success: no issues found" in done.stdout, done.stdout
