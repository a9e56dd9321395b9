"""Commands run as a user runs them, scripts of the repository loaded as modules, and tools a test needs."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Mapping

import pytest

from tests.harness.paths import REPO


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


def harness_importable(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the checkout first on PYTHONPATH: a `python -m tests.harness.workers...` that a launcher starts
    in another folder (torchrun's workers in a test's tmp_path) finds the harness."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))}
