"""A trainer run refused before the MLPerf clock starts: one `error:` line, exit 2, nothing logged."""

from __future__ import annotations

import subprocess
from pathlib import Path


def refused_before_the_clock(done: subprocess.CompletedProcess, tmp_path: Path, *says: str) -> str:
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert all(part in errors[0] for part in says), errors[0]
    assert not (tmp_path / "out" / "mlperf.log").exists()  # nothing logged: the run never started
    return errors[0]
