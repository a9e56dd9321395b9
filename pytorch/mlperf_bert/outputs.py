"""A run owns its output folder: one run at a time, and never a second run's lines in a log.

Rank 0 takes `--output_dir/.run.lock` before anything is written: a file holding the owner's
pid and host, held with `fcntl.flock` while the run lives. The kernel drops the flock when the
owner dies however it dies, so on one host a lock nobody holds is stale and is taken over
(with a note). A lock written by another host is refused: that host's run may be alive, and a
flock on a network file system is not proof either way.

A fresh run also refuses a folder that already holds a run: a non-empty MLPerf log (the
checker rejects a log with two run_starts) or run checkpoints (keep-last-K would delete them).
Only a resume (`--resume_from_checkpoint` naming a file, or `auto` finding one) continues
such a folder, and its log.

Every rank learns rank 0's verdict (one broadcast), so all refuse together with exit 2.

Write failures (ENOSPC, EROFS, EACCES, EFBIG) of anything the run writes end it with
`describe_write_error`'s one line and EXIT_IO_ERROR; `runtime.files` writes every file so that
such a line can name it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch.distributed as dist

from .config.settings import RESUME_AUTO, TrainConfig
from .runtime.distributed import DistEnv
from .train.checkpoint import list_checkpoints

LOCK_NAME = ".run.lock"

_WRITE_HINTS = {
    errno.ENOSPC: "the file system is full: free space or pick another --output_dir",
    errno.EDQUOT: "the disk quota is used up: free space or pick another --output_dir",
    errno.EFBIG: "the file size limit (ulimit -f) was reached: raise it",
    errno.EROFS: "the file system is read-only: pick a writable --output_dir",
    errno.EACCES: "no permission to write there: pick a writable --output_dir",
    errno.EPERM: "no permission to write there: pick a writable --output_dir",
}


class OutputFolderInUse(ValueError):
    """The output folder belongs to another run; the message names the file and the fix."""


def describe_write_error(err: OSError) -> str:
    """One line naming the path, the error and what to do; the last good checkpoint is kept."""
    where = err.filename if err.filename is not None else "a file of the run"
    code = errno.errorcode.get(err.errno, str(err.errno)) if err.errno else "I/O error"
    hint = _WRITE_HINTS.get(err.errno, "check that file system") if err.errno else "check that file system"
    return f"cannot write {where}: {err.strerror or err} ({code}); {hint}. Earlier checkpoints are intact"


def _is_resume(cfg: TrainConfig) -> bool:
    spec = cfg.checkpoint.resume_from
    if spec is None:
        return False
    return spec != RESUME_AUTO or bool(list_checkpoints(cfg.checkpoint_dir))


def _previous_run(cfg: TrainConfig) -> str | None:
    """Why a fresh run may not start in this folder, or None."""
    log = cfg.run.mlperf_log_path
    if log.is_file() and log.stat().st_size > 0:
        return f"{log} already holds the MLPerf log of another run"
    found = list_checkpoints(cfg.checkpoint_dir)
    if found:
        return f"{cfg.checkpoint_dir} already holds run checkpoints ({found[-1].name})"
    return None


def _owner(lock: Path) -> dict:
    try:
        owner = json.loads(lock.read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _refuse_owner(lock: Path, owner: dict, live: bool) -> str:
    pid, host = owner.get("pid", "?"), owner.get("host", "?")
    state = "running" if live else "may still be running"
    return (f"{lock}: the run of pid {pid} on host {host} {state} in this --output_dir; pick another "
            f"--output_dir, or delete {lock} once that run has ended")


def _take(lock: Path) -> tuple[int | None, str | None]:
    """(fd holding the flock, None), or (None, why not). Notes a stale lock it takes over."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    owner = _owner(lock)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None, _refuse_owner(lock, owner, live=True)
    if not lock.exists() or os.fstat(fd).st_ino != lock.stat().st_ino:
        os.close(fd)  # the owner removed this file as we opened it: take the current one
        return _take(lock)
    host = socket.gethostname()
    if owner and owner.get("host") != host:
        os.close(fd)
        return None, _refuse_owner(lock, owner, live=False)
    if owner:
        print(f"note: {lock}: taking over the lock of pid {owner.get('pid')}, which has ended", file=sys.stderr)
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": host}).encode())
    os.fsync(fd)
    return fd, None


def _claim(cfg: TrainConfig) -> tuple[int | None, str | None]:
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    fd, refusal = _take(out / LOCK_NAME)
    if fd is not None and not _is_resume(cfg):
        refusal = _previous_run(cfg)
        if refusal is not None:
            refusal += ("; pick a new --output_dir (and --mlperf_log_file), or continue that run with "
                        "--resume_from_checkpoint auto")
    if refusal is not None and fd is not None:
        _release(out / LOCK_NAME, fd)
        fd = None
    return fd, refusal


def _release(lock: Path, fd: int) -> None:
    lock.unlink(missing_ok=True)  # before the flock goes: nobody takes a lock file that is being removed
    os.close(fd)


def _agree(refusal: str | None) -> str | None:
    """Rank 0's verdict on every rank (collective when the process group is up)."""
    if not dist.is_initialized():
        return refusal
    box = [refusal]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextmanager
def own_output_dir(cfg: TrainConfig, denv: DistEnv) -> Iterator[None]:
    """Holds the output folder for the run (rank 0 locks; every rank refuses together)."""
    fd, refusal = None, None
    if denv.is_main:
        try:
            fd, refusal = _claim(cfg)
        except OSError as err:  # the other ranks wait for the verdict: give them this one
            refusal = describe_write_error(err)
    refusal = _agree(refusal)
    if refusal is not None:
        raise OutputFolderInUse(refusal)
    try:
        yield
    finally:
        if fd is not None:
            _release(Path(cfg.run.output_dir) / LOCK_NAME, fd)
