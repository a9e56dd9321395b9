"""Optional packages: working, not installed, or installed but broken, each said in one line.

The trainer runs without torchao, flash-attn, apex, NVIDIA DALI and mpi4py; a flag that needs
one asks `dependency_problem` at start-up. A package that is not installed and one that is
installed but fails to import are different problems with different fixes: the second is a
wheel built for another torch or CUDA, or one whose shared library is missing, and it fails in
whatever way its import code happens to (an ImportError for an undefined symbol, an
AttributeError when a torchao release looks up a dtype this torch lacks, an OSError from a
missing libmpi, a RuntimeError from a CUDA check). Either becomes one line naming the flag, the
package, the error and the fix, instead of a traceback with that line buried in it.

Free of torch: the data preparation may import this module too.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

# Longest part of an import error kept in the line: enough for the message, not a page of it.
MAX_ERROR_CHARS = 240


class DependencyError(ImportError):
    """An optional package a flag needs is missing or broken; the message is the line to print."""


def describe_error(err: BaseException) -> str:
    """`Type: first line of the message`, shortened: an error as one line."""
    lines = str(err).strip().splitlines()
    text = lines[0].strip() if lines else ""
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS - 3] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _is_absent(err: Exception, root: str) -> bool:
    """Whether `err` says the package at import path `root` (or a parent of it) is not there at all,
    rather than something inside or below the package failing."""
    name = err.name if isinstance(err, ModuleNotFoundError) else None
    return name is not None and (name == root or root.startswith(name + "."))


class ImportFailure(NamedTuple):
    absent: bool  # the package is not installed; False: installed, but importing it failed
    error: str  # what the import raised, as one line


def import_failure(module: str, root: str | None = None) -> ImportFailure | None:
    """None when `module` imports; else how it failed. root: the import path the package installs
    (default: `module`'s first part; `nvidia.dali` for DALI, whose `nvidia` folder other NVIDIA
    wheels share)."""
    root = root or module.split(".")[0]
    try:
        importlib.import_module(root)  # first: a missing package says so under its own name
        importlib.import_module(module)
    except Exception as err:  # any type: a broken install fails the way its import code happens to
        return ImportFailure(_is_absent(err, root), describe_error(err))
    return None


def dependency_problem(module: str, package: str, needed_by: str, install: str, alternative: str,
                       root: str | None = None) -> str | None:
    """None when `module` imports; else one line for the user.

    module: what the run imports (`torchao.float8`); package: what the user knows it as
    (`torchao`); root: as for `import_failure`; needed_by: the flag that needs it
    (`--precision fp8`); install: how to install a working copy; alternative: the choice that
    runs without it (`use --precision bf16`).
    """
    failure = import_failure(module, root)
    if failure is None:
        return None
    if failure.absent:
        return f"{needed_by} needs {package}, which is not installed: {install}, or {alternative}"
    return (f"{needed_by} needs {package}, which is installed but fails to import ({failure.error}): that copy "
            f"does not fit this environment; reinstall it ({install}), or {alternative}")


def optional_import(module: str, package: str, needed_by: str, install: str, alternative: str,
                    root: str | None = None) -> bool:
    """For a package a choice uses when it is there: True when `module` imports, False when the package
    is not installed, and a `DependencyError` (`dependency_problem`'s line) when it is installed but
    broken, which must not pass for "not installed" and quietly change what the run does."""
    failure = import_failure(module, root)
    if failure is not None and not failure.absent:
        raise DependencyError(dependency_problem(module, package, needed_by, install, alternative, root))
    return failure is None


def require(module: str, package: str, needed_by: str, install: str, alternative: str,
            root: str | None = None) -> None:
    """`dependency_problem` as a `DependencyError`, for the code that imports `module` next."""
    problem = dependency_problem(module, package, needed_by, install, alternative, root)
    if problem is not None:
        raise DependencyError(problem)


MATPLOTLIB_INSTALL = "pip install 'matplotlib>=3.7' (a dependency of this package)"


def matplotlib_problem(needed_by: str, alternative: str, module: str = "matplotlib") -> str | None:
    """`dependency_problem` for the pictures the commands draw at their end (curves.png, plan.py --plot,
    compare.py's plots), asked at their start; module: `matplotlib.pyplot` where its import is no extra cost."""
    return dependency_problem(module, "matplotlib", needed_by, MATPLOTLIB_INSTALL, alternative, root="matplotlib")
