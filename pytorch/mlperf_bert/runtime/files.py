"""Atomic writes: one implementation, its guarantees chosen by the caller.

Every output (shards, checkpoints, logs' side files, the summary, data_prep's manifests) is
written under a hidden temporary name beside its final name, `.<name>.tmp-<pid>`, and
renamed into place only when complete: a reader never sees half a file, and an interrupted
writer leaves at most a temporary that no shard glob (`*.hdf5`) or checkpoint pattern
matches (`TEMP_MARK` finds them).

The guarantees are parameters, because they cost time:
- `fsync_file`: the data reaches the disk before the rename, so a power cut leaves the old
  file or the new one, never a renamed but empty one (checkpoints, small run files).
- `fsync_dir`: the rename itself is made durable by syncing the folder (checkpoints: the
  run resumes from the newest name it finds).

`json_object` reads the small JSON records the commands keep beside their outputs (a record edited by
hand into a list fails there, in one line, not deep in the code that reads its fields).

Torch-free: `data_prep` imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator

TEMP_MARK = ".tmp-"  # hidden temporary outputs are named .<name>.tmp-<pid>


def temp_name(path: Path) -> Path:
    """Hidden sibling of `path` that no shard glob (*.hdf5) or checkpoint pattern matches."""
    return path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}")


def remove_path(path: Path) -> None:
    """Deletes a file, a link or a whole folder; nothing if there is nothing."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync(path: Path) -> None:
    """Flushes a file's data, or every file of a folder and the folder itself, to disk."""
    if path.is_dir():
        for child in path.rglob("*"):
            if child.is_file() and not child.is_symlink():
                _fsync(child)
        fsync_dir(path)
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Makes the entries of `directory` (a rename into it) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: Path | str, *, fsync_file: bool = False, fsync_dir_after: bool = False) -> Iterator[Path]:
    """A temporary path (file or folder, for writers that open it themselves) that becomes
    `path` only when the block succeeds; on any failure nothing is left under either name
    except the old `path`. A folder replaces an existing `path` whole.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_name(path)
    remove_path(temp)
    try:
        yield temp
        if fsync_file:
            _fsync(temp)
        if temp.is_dir() and path.exists():
            remove_path(path)  # os.replace cannot replace a non-empty folder
        os.replace(temp, path)
        if fsync_dir_after:
            fsync_dir(path.parent)
    finally:
        remove_path(temp)


@contextmanager
def atomic_file(path: Path | str, mode: str = "w", *, fsync_file: bool = True,
                fsync_dir_after: bool = False) -> Iterator[IO[Any]]:
    """An open file ("w" or "wb") that becomes `path` on success (see `atomic_path`).

    The temporary is created exclusively ("x"), so a symlink planted under its name is never
    followed. A failed write raises OSError naming `path` (Python's close error names no file).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_file writes whole files: mode 'w' or 'wb', got {mode!r}")
    path = Path(path)
    try:
        with atomic_path(path, fsync_dir_after=fsync_dir_after) as temp:
            with open(temp, mode.replace("w", "x")) as f:
                yield f
                if fsync_file:
                    f.flush()
                    os.fsync(f.fileno())
    except OSError as err:
        raise OSError(err.errno, err.strerror or str(err), str(path)) from err


def json_object(path: Path | str) -> dict[str, Any]:
    """The JSON object in `path`; ValueError (one line, naming the file) for a file that cannot be read, is not
    JSON or holds another JSON value; OSError passes, for a caller to whom a missing file is no error."""
    path = Path(path)
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not JSON ({err})") from err
    if not isinstance(value, dict):
        raise ValueError(f"{path}: a JSON {type(value).__name__}, not an object")
    return value


def write_text_atomic(path: Path | str, text: str, *, fsync_file: bool = True) -> None:
    """`text` into `path` through `atomic_file`; a failed write names `path`."""
    with atomic_file(path, "w", fsync_file=fsync_file) as f:
        f.write(text)


def output_file_problem(path: Path | str) -> str | None:
    """Why a command cannot write its file `path` at the end of its work, asked before the work (None: it can).
    The missing folders above it are made now, as a command's output folder is: a check that runs for minutes
    must not end in FileNotFoundError, its result lost."""
    path = Path(path)
    if path.is_dir():
        return f"{path} is a folder; give the path of a file"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"cannot make its folder {path.parent} ({err.strerror or err}); give another path"
    if not os.access(path.parent, os.W_OK | os.X_OK):
        return f"cannot write in {path.parent}; give another path"
    return None


def output_file(value: str) -> Path:
    """An argparse `type` for a file the command writes at its end (`output_file_problem`): a path it cannot
    write is refused with the other bad flags, before any work."""
    problem = output_file_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return Path(value)
