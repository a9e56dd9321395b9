"""Records every open of a file under the watched folders, with its time, in every Python process.

Put this folder first on PYTHONPATH (Python imports `sitecustomize` at start-up, so torchrun's
workers, which inherit the environment, record too) and set
  OPEN_AUDIT_LOG   the file that gets one line per open: "<time.time()> <pid> <path>"
  OPEN_AUDIT_DIRS  the folders to watch, separated by os.pathsep;
  OPEN_AUDIT_PAUSE optional "PATH:SECONDS": the process that opens PATH first waits SECONDS there
                   (a slow rank 0 at the MLPerf log's first write, just before its run_start line).
Python-level opens (`open`, `Path.read_text`, `os.open`) come from the audit hook; h5py opens its
files in C, so `h5py.File` is wrapped when h5py is first imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import threading
import time

_LOG = os.environ.get("OPEN_AUDIT_LOG")
_DIRS = tuple(os.path.realpath(d) + os.sep for d in os.environ.get("OPEN_AUDIT_DIRS", "").split(os.pathsep) if d)
# Per thread: the eval set loads on a background thread while the main thread opens shards, and a
# process-wide flag would drop whichever open came second.
_state = threading.local()
_PAUSE_PATH, _, _PAUSE_S = os.environ.get("OPEN_AUDIT_PAUSE", "").rpartition(":")
_paused = False


def _record(path: object) -> None:
    if getattr(_state, "busy", False) or not isinstance(path, (str, bytes, os.PathLike)):
        return
    name = os.fsdecode(os.fspath(path))
    full = os.path.realpath(name)
    if not full.startswith(_DIRS):
        return
    _state.busy = True
    try:
        fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{time.time():.6f} {os.getpid()} {full}\n".encode())
        finally:
            os.close(fd)
    finally:
        _state.busy = False
_PAUSE_PATH, _, _PAUSE_S = os.environ.get("OPEN_AUDIT_PAUSE", "").rpartition(":")
_paused = False


def _pause(path: object) -> None:
    global _paused
    if _paused or not _PAUSE_PATH or not isinstance(path, (str, os.PathLike)) or os.fspath(path) != _PAUSE_PATH:
        return
    _paused = True
    time.sleep(float(_PAUSE_S))


def _audit(event: str, args: tuple) -> None:
    if event == "open" and args:
        _record(args[0])
        _pause(args[0])


def _wrap_h5py(module: object) -> None:
    file_class = module.File  # type: ignore[attr-defined]
    opened = file_class.__init__

    def init(self, name, *args, **kwargs):  # noqa: ANN001 - h5py's own signature
        _record(name)
        opened(self, name, *args, **kwargs)

    file_class.__init__ = init


class _H5pyWatcher(importlib.abc.MetaPathFinder):
    """Finds h5py the usual way and wraps its File once the module has run."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001 - the finder protocol
        if name != "h5py":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):  # noqa: ANN001
            run(module)
            _wrap_h5py(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _LOG and _DIRS:
    sys.addaudithook(_audit)
    sys.meta_path.insert(0, _H5pyWatcher())
