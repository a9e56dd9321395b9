"""What every entry point in `tools/` shares: the one line a user sees when the project is not installed.

An entry point runs as `python tools/<name>.py`, so `tools/` is first on the path and this package
imports; the trainer and the data preparation it reaches are importable only once the project is
installed (`make venv`, or the container's `pip install -e .`). Without that, the import fails deep
in a module with a traceback; this names the fix instead.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

# The project's own packages and its pinned dependencies: missing, they mean "not installed here".
_PROJECT = ("mlperf_bert", "data_prep", "mlperf_logging", "numpy", "torch", "h5py")


@contextmanager
def installed() -> Iterator[None]:
    """Turns a missing project package into one line and exit status 2. Only the package itself not found is
    "not installed": a module missing inside one that is there (`mlperf_bert.model.gone`, a dependency of
    numpy's own) is a broken checkout or install, whose traceback names the import that failed."""
    try:
        yield
    except ModuleNotFoundError as err:
        top = err.name or ""
        if top not in _PROJECT:
            raise
        tool = Path(sys.argv[0]).name or "this tool"
        print(f"{tool}: {top} does not import with {sys.executable}: install the project first "
              "(`make venv`, then run it with .venv/bin/python; in the container it is installed)", file=sys.stderr)
        raise SystemExit(2) from None
