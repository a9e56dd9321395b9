"""A lost rank: the survivors stop within the collective timeout, name the lost rank, exit non-zero."""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from mlperf_bert.runtime.exits import EXIT_LOST_RANK
from mlperf_bert.liveness import FINISHED, LostRank, RankWatch
from tests.harness.demo import trainer_args
from tests.harness.launches import pid_of, start_ranks, start_torchrun, wait_all, wait_for_steps, worker_command
from tests.harness.ports import free_port

TIMEOUT_S = 10  # --collective_timeout_s of these runs
BOUND_S = TIMEOUT_S + 20  # what a survivor may take after the kill, with room for a loaded machine


def _command(demo_data: Path, out: Path) -> list[str]:
    flags = trainer_args(demo_data, out, "--do_train", "--train_batch_size", "4", "--max_steps", "400",
                         "--collective_timeout_s", str(TIMEOUT_S))
    return worker_command(flags, out / "rec", "--step_sleep", "0.1")


def _signal_rank_1_after_two_steps(demo_data, tmp_path, sig: signal.Signals):
    """Starts 2 ranks directly, waits until rank 0 has trained 2 steps, signals rank 1."""
    procs = start_ranks(_command(demo_data, tmp_path), 2, tmp_path / "logs")
    wait_for_steps(tmp_path / "rec", 0, 2, procs)
    os.kill(pid_of(tmp_path / "rec", 1), sig)
    return procs, time.monotonic()


@pytest.mark.slow
def test_killing_rank_1_of_a_direct_launch_ends_rank_0_naming_it(demo_data, tmp_path):
    """Two processes started with RANK / WORLD_SIZE (no torchrun): only our liveness check helps."""
    procs, killed_at = _signal_rank_1_after_two_steps(demo_data, tmp_path, signal.SIGKILL)
    codes = wait_all(procs, timeout=BOUND_S)
    assert time.monotonic() - killed_at < BOUND_S
    assert codes == [EXIT_LOST_RANK, -signal.SIGKILL]
    error = (tmp_path / "logs" / "rank0.err").read_text()
    assert "error: rank 1 was lost" in error and "Traceback" not in error, error[-2000:]


@pytest.mark.slow
def test_a_frozen_rank_ends_rank_0_within_the_timeout(demo_data, tmp_path):
    """SIGSTOP: the peer's sockets stay open, so no collective fails at once (as in an NCCL hang)."""
    procs, frozen_at = _signal_rank_1_after_two_steps(demo_data, tmp_path, signal.SIGSTOP)
    assert procs[0].wait(timeout=BOUND_S) == EXIT_LOST_RANK
    assert time.monotonic() - frozen_at < BOUND_S
    procs[1].kill()
    procs[1].wait()
    error = (tmp_path / "logs" / "rank0.err").read_text()
    assert "error: rank 1 was lost" in error, error[-2000:]


@pytest.mark.slow
def test_killing_rank_1_under_torchrun_ends_the_job_naming_it(demo_data, tmp_path):
    launcher = start_torchrun(_command(demo_data, tmp_path), 2, tmp_path / "torchrun.log")
    wait_for_steps(tmp_path / "rec", 0, 2, [launcher])
    os.kill(pid_of(tmp_path / "rec", 1), signal.SIGKILL)
    killed_at = time.monotonic()
    assert wait_all([launcher], timeout=BOUND_S) != [0]
    assert time.monotonic() - killed_at < BOUND_S
    report = (tmp_path / "torchrun.log").read_text()
    assert "rank 1 was lost" in report, report[-3000:]


class _Ranks:
    """A store server and one RankWatch per simulated rank, all in this process."""

    def __init__(self, world: int, timeout_s: float = 1.0) -> None:
        port = free_port()
        self.server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        self.lost: list[str] = []
        self.reported = threading.Event()
        self.watches = [RankWatch(self._client(port), r, world, timeout_s, on_lost=self._on_lost) for r in range(world)]

    @staticmethod
    def _client(port: int) -> dist.Store:
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))

    def _on_lost(self, message: str) -> None:
        self.lost.append(message)
        self.reported.set()


def test_a_rank_that_stops_beating_is_named_by_its_neighbour_and_by_diagnose():
    ranks = _Ranks(3)
    survivors = [ranks.watches[0].start(), ranks.watches[2].start()]
    ranks.watches[1].counters()  # rank 1 joined the store, then died before its first beat
    assert survivors[1].diagnose() == "rank 1 was lost (no heartbeat for 0.15 s)"
    assert ranks.reported.wait(timeout=10)  # rank 0 watches rank 1, its ring neighbour
    assert ranks.lost == [ranks.lost[0]] and ranks.lost[0].startswith("rank 1 was lost: no heartbeat for")
    for watch in survivors:
        watch.stop(FINISHED)


def test_diagnose_reports_why_a_rank_left_and_ignores_finished_ones():
    ranks = _Ranks(3)
    watches = [w.start() for w in ranks.watches]
    watches[1].stop("failed: DataError: part_00001.hdf5: truncated")
    watches[2].stop(FINISHED)
    assert watches[0].diagnose() == "rank 1 stopped: failed: DataError: part_00001.hdf5: truncated"
    watches[0].stop(FINISHED)
    time.sleep(0.6)  # longer than the 0.5 s staleness: finished ranks are never reported
    assert ranks.lost == []


def test_a_collective_error_becomes_lost_rank_only_when_a_rank_is_lost():
    ranks = _Ranks(2)
    watch = ranks.watches[0]
    with pytest.raises(LostRank, match=r"rank 1 was lost .*This rank \(0\) stops too.*connection reset"):
        with watch:
            raise RuntimeError("connection reset by peer")
    alive = _Ranks(2)
    other = alive.watches[1].start()
    with pytest.raises(RuntimeError, match="a bug"):  # every rank alive: the error stays what it was
        with alive.watches[0]:
            raise RuntimeError("a bug")
    other.stop(FINISHED)
