"""Which rank was lost: heartbeats through the rendezvous store.

When a process dies, its peers learn it only as a failed or hanging collective: gloo reports
"connection reset by peer" at once (or a timeout after `--collective_timeout_s` when the node
vanished without closing its sockets), NCCL waits for its watchdog. Neither says which rank
went. `RankWatch` adds that fact.

Each rank opens its own client connection to the TCP store every launcher already runs (rank 0
hosts it under a direct or MPI launch, node 0's torchrun agent under torchrun; MASTER_ADDR:MASTER_PORT
in both cases, under torchrun's c10d rendezvous a store of that agent's on a free port) and runs
a daemon thread that, every `interval_s`:
- adds 1 to its counter `beat/<rank>` (a counter, not a time stamp, so node clocks never matter);
- reads the counter of its ring neighbour (rank + 1) mod W. One write and one read per rank and
  interval keep the store's load linear in W (every rank reading every counter would be W^2).
  If the neighbour's counter has not moved for `stale_after_s` (half the collective timeout) and
  it did not say it finished, the thread prints which rank was lost and ends this process with
  exit code 76. That catches the hang NCCL would otherwise sit in until its own timeout.
A rank that leaves writes `exit/<rank>` first: "finished", or "failed: <error>" so its peers can
say why it went.

On a collective error in the main thread, `RankWatch.__exit__` calls `diagnose`: it reads every
rank's counter, waits `diagnose_window_s` (3 heartbeats), reads them again, and names the ranks
whose counter did not move (or that wrote a failure). That error then leaves `run_pretraining.py`
as `LostRank`, exit code 76, a few seconds after gloo noticed the dead peer.

A live rank's thread keeps beating while its main thread computes, waits in a collective or
writes a checkpoint (those release the GIL), so only a dead, frozen or cut-off process goes stale.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from contextlib import nullcontext
from typing import Callable, ContextManager

import torch.distributed as dist

from .runtime.distributed import DistEnv
from .runtime.exits import EXIT_LOST_RANK
from .train.faults import TrainingStopped

FINISHED = "finished"
LEFT_AFTER_LOSS = "left after a lost peer"  # a survivor's exit status: not a root cause


class LostRank(RuntimeError):
    """Another rank died or stopped answering; the message names it."""

    exit_code = EXIT_LOST_RANK


def _connect(denv: DistEnv, timeout_s: float) -> dist.Store:
    """A client of the launcher's store, with keys of this attempt (torchrun restarts) apart."""
    store = dist.TCPStore(denv.master_addr, denv.master_port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=max(5.0, timeout_s / 4)))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"mlperf_bert/liveness/{attempt}/", store)


class RankWatch:
    """Heartbeats and lost-rank diagnosis for one distributed run (module docstring).

    timeout_s: the collective timeout; a neighbour silent for half of it is declared lost.
    on_lost: what the thread does with its message (default: print it and exit 76).
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float,
                 on_lost: Callable[[str], None] | None = None) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval_s = min(1.0, timeout_s / 20)
        self.stale_after_s = timeout_s / 2
        self.diagnose_window_s = 3 * self.interval_s
        self.on_lost = on_lost or _exit_lost
        self._lock = threading.Lock()  # one client connection, two threads
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-heartbeat", daemon=True)

    @classmethod
    def for_run(cls, denv: DistEnv, timeout_s: float) -> "RankWatch":
        return cls(_connect(denv, timeout_s), denv.rank, denv.world_size, timeout_s)

    def _add(self, key: str, amount: int) -> int:
        with self._lock:
            return int(self.store.add(key, amount))

    def _exit_status(self, rank: int) -> str | None:
        key = f"exit/{rank}"
        with self._lock:
            return self.store.get(key).decode(errors="replace") if self.store.check([key]) else None

    def counters(self) -> list[int]:
        return [self._add(f"beat/{r}", 0) for r in range(self.world_size)]

    def start(self) -> "RankWatch":
        self._add(f"beat/{self.rank}", 1)
        self._thread.start()
        return self

    def stop(self, status: str) -> None:
        """Says why this rank leaves (best effort: the store may be gone) and ends the thread."""
        self._done.set()
        try:
            with self._lock:
                self.store.set(f"exit/{self.rank}", status[:1000])
        except (RuntimeError, OSError):
            pass
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval_s + 1)

    def _run(self) -> None:
        message = self._watch_neighbour()
        if message is not None:
            self.on_lost(message)

    def _watch_neighbour(self) -> str | None:
        """Beats until stopped; returns why the run is lost, or None (stopped, or the neighbour finished)."""
        neighbour = (self.rank + 1) % self.world_size
        seen, moved_at, failing_since = -1, time.monotonic(), None
        while not self._done.wait(self.interval_s):
            now = time.monotonic()
            try:
                self._add(f"beat/{self.rank}", 1)
                count = self._add(f"beat/{neighbour}", 0)
                failing_since = None
            except (RuntimeError, OSError) as err:
                failing_since = failing_since or now
                if now - failing_since > self.stale_after_s:
                    return self._store_lost_message(err)
                continue
            if count != seen:
                seen, moved_at = count, now
            elif now - moved_at > self.stale_after_s:
                return self._silent_message(neighbour, now - moved_at)
        return None

    def _silent_message(self, rank: int, silent_s: float) -> str | None:
        status = self._exit_status(rank)
        if status == FINISHED:
            return None
        if status is not None:
            return f"rank {rank} stopped: {status}"
        return (f"rank {rank} was lost: no heartbeat for {silent_s:.0f} s (the process died, froze, or its "
                "node is unreachable)")

    def _store_lost_message(self, err: BaseException) -> str:
        return (f"rank 0 was lost (or the launcher): the rendezvous store it hosts stopped answering ({err}); "
                "its process died or its node is unreachable")

    def diagnose(self) -> str | None:
        """Names the ranks that stopped beating within `diagnose_window_s` (or said they failed)."""
        try:
            before = self.counters()
            time.sleep(self.diagnose_window_s)
            after = self.counters()
            status = {r: self._exit_status(r) for r in range(self.world_size) if r != self.rank}
        except (RuntimeError, OSError) as err:
            return self._store_lost_message(err)
        failed = [f"rank {r} stopped: {s}" for r, s in status.items()
                  if s is not None and s != FINISHED and not s.startswith(LEFT_AFTER_LOSS)]
        silent = [f"rank {r} was lost (no heartbeat for {self.diagnose_window_s:g} s)"
                  for r, s in status.items() if s is None and before[r] == after[r]]
        return "; ".join(failed + silent) or None

    def __enter__(self) -> "RankWatch":
        return self.start()

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        """Turns a collective failure into LostRank when a lost rank explains it."""
        if exc is None or isinstance(exc, TrainingStopped):
            self.stop(FINISHED)
            return
        message = self.diagnose() if isinstance(exc, RuntimeError) and not isinstance(exc, LostRank) else None
        self.stop(f"{LEFT_AFTER_LOSS} ({message})" if message else f"failed: {type(exc).__name__}: {exc}")
        if message is not None:
            raise LostRank(f"{message}. This rank ({self.rank}) stops too; the collective failed with: "
                           f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc


def watch_ranks(denv: DistEnv, timeout_s: float) -> ContextManager:
    """A started `RankWatch` for a distributed run; nothing to watch in a single process."""
    return RankWatch.for_run(denv, timeout_s) if denv.is_distributed else nullcontext()


def _exit_lost(message: str) -> None:
    """The heartbeat thread's verdict: the main thread may be stuck in a collective, so exit hard."""
    print(f"error: {message}; this process exits with code {EXIT_LOST_RANK}", file=sys.stderr, flush=True)
    os._exit(EXIT_LOST_RANK)
