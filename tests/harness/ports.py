"""Rendezvous ports: a free one now, or one the ranks of a run agree on just before it starts (for the workers).

A port taken long before its run starts may be taken by someone else's socket meanwhile; a
process that runs several worlds one after the other picks each world's port when it gets there.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agreed_port(path: Path, rank: int, timeout_s: float = 600) -> str:
    """Rank 0 takes a free port and leaves it in `path` (whole, by rename); the other ranks read it there."""
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        written = path.with_name(f"{path.name}.tmp")
        written.write_text(port)
        written.rename(path)
        return port
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 left no port in {path} in {timeout_s:.0f} s")
        time.sleep(0.05)
    return path.read_text()
