"""Triton in the tests: kernels run on CPU tensors through Triton's interpreter in a worker of their own, and
compiled for sm_90 without a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness.commands import require_tool
from tests.harness.paths import REPO

SM90 = ("cuda", 90, 32)  # Triton's GPUTarget of an H100 / H200: backend, compute capability, warp size


def needs_triton() -> None:
    """Triton is a test dependency on x86-64 Linux (pyproject.toml), where `make test` installs it."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip("Triton's wheels are for x86-64 Linux")
    require_tool(importlib.util.find_spec("triton") is not None, "Triton is not installed")


def run_interpreted(worker: str, out: Path) -> dict[str, Any]:
    """A worker (`python -m worker OUT`) that runs Triton kernels on CPU tensors through Triton's interpreter, in a
    process started with TRITON_INTERPRET=1 (Triton reads it at import); its JSON results."""
    needs_triton()
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", worker, str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())
