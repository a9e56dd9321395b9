"""The type check of the three packages (the trainer, data_prep and mlperf_tools: pyproject's [tool.mypy]
files) is one of `make test`'s tests, so it runs beside the others instead of before them; a type error
fails `make test` all the same."""

from __future__ import annotations

import sys

from conftest import run_cli


def test_the_packages_pass_mypy():
    done = run_cli([sys.executable, "-m", "mypy"])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "Success: no issues found" in done.stdout, done.stdout
