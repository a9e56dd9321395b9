"""NCCL_TEST's pre-flight (`mlperf_bert.runtime.preflight`): two gloo ranks, one slowed; the verdict; a missing rank."""

from __future__ import annotations

import datetime
import re
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from mlperf_bert.runtime import preflight
from mlperf_bert.runtime.distributed import DistEnv
from mlperf_bert.runtime.preflight import RankTimes, Settings, bus_bandwidth_gbps, verdict, wait_for_ranks
from tests.harness.paths import REPO
from tests.harness.ports import free_port

MIB = 2**20


def test_a_slowed_rank_stops_the_job_with_one_line_naming_it() -> None:
    """Rank 1 sleeps 40 ms before each all-reduce of 1 MiB: rank 0 waits for it inside every all-reduce,
    so the bus bandwidth (0.5 x 1 MiB per 40 ms, about 0.013 GB/s) falls below the threshold."""
    port = str(free_port())
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO / 'pytorch'}:{REPO}",
           "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "DEVICE": "cpu",
           "NCCL_TEST_BYTES": str(MIB), "NCCL_TEST_ITERS": "4", "NCCL_TEST_WARMUP": "1",
           "NCCL_TEST_MIN_BUSBW_GBPS": "0.05", "NCCL_TEST_JOIN_S": "60"}
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.harness.workers.preflight", "1", "0.04"], cwd=REPO,
                              env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for rank in (0, 1)]
    (out0, err0), (out1, err1) = (rank.communicate(timeout=120) for rank in ranks)
    assert [rank.returncode for rank in ranks] == [1, 1], err0 + err1
    lines = err0.strip().splitlines()
    assert len(lines) == 1 and not out0 and not (out1 + err1), (out0, err0, out1, err1)
    assert lines[0].startswith(f"NCCL_TEST: failed: rank 1 on {socket.gethostname()} is slow"), lines
    assert "NCCL_TEST_MIN_BUSBW_GBPS=0.05" in lines[0]


def _times(*seconds: float) -> list[RankTimes]:
    return [RankTimes(r, f"node{r // 2}", s) for r, s in enumerate(seconds)]


def test_verdict_passes_at_the_threshold_and_names_the_rank_the_others_waited_for() -> None:
    nbytes = 256 * MIB
    healthy = _times(2e-3, 2.1e-3, 2e-3, 2.05e-3)
    passed, line = verdict(healthy, nbytes, bus_bandwidth_gbps(nbytes, 4, 2.1e-3))
    assert passed and line.startswith("NCCL_TEST: passed") and "over 4 ranks" in line
    waited = _times(52e-3, 51e-3, 2e-3, 50e-3)  # rank 2 arrived last: the others spent ~50 ms waiting
    passed, line = verdict(waited, nbytes, 100.0)
    assert not passed and "rank 2 on node1 is slow" in line and "waited 48.5 ms" in line
    alike = _times(52e-3, 51e-3, 49e-3, 50e-3)  # a slow link: every rank waits alike
    passed, line = verdict(alike, nbytes, 100.0)
    assert not passed and "every rank waited alike (slowest: rank 0 on node0)" in line


def _one_rank_script(**settings: str) -> subprocess.CompletedProcess:
    """`python pytorch/nccl_preflight.py` as run.sub starts it, one rank on the CPU, with these NCCL_TEST_ settings."""
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO / 'pytorch'}:{REPO}",
           "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "DEVICE": "cpu", **settings}
    return subprocess.run([sys.executable, str(REPO / "pytorch" / "nccl_preflight.py")], env=env,
                          capture_output=True, text=True, timeout=120)


def test_one_rank_has_no_link_to_measure_and_passes_skipped() -> None:
    """One rank sends nothing (2 (n - 1) / n = 0): the config's 75 GB/s threshold is not failed at 0 GB/s."""
    done = _one_rank_script(NCCL_TEST_MIN_BUSBW_GBPS="75")
    assert done.returncode == 0 and not done.stderr, done.stdout + done.stderr
    assert done.stdout == ("NCCL_TEST: skipped: one rank, no link to measure (an all-reduce over one rank sends "
                           "nothing; NCCL_TEST_MIN_BUSBW_GBPS=75 applies to 2 ranks or more)\n")
    passed, line = verdict(_times(2e-3), 256 * MIB, 75.0)
    assert passed and line.startswith("NCCL_TEST: skipped: one rank")
    passed, line = verdict(_times(2e-3, 2e-3), 256 * MIB, 75.0)  # two ranks: 256 MiB in 2 ms is 134 GB/s
    assert passed and line.startswith("NCCL_TEST: passed") and "bus bandwidth 134 GB/s" in line


def test_bus_bandwidth_is_that_of_nccl_tests() -> None:
    # all_reduce_perf: algbw = bytes / time, busbw = algbw x 2 (n - 1) / n
    assert bus_bandwidth_gbps(10**9, 8, 1.0) == pytest.approx(1.75)


def test_rank_0_names_the_ranks_that_did_not_join() -> None:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 3, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 3, False, timeout=datetime.timedelta(seconds=5))
    client.set("preflight/host/2", "node1")
    missing = wait_for_ranks(store, DistEnv(0, 3, 0, 3, "127.0.0.1", port), "node0", timeout_s=0.2)
    assert missing == [1] and client.get("preflight/start") == b"stop"


def test_settings_name_a_bad_variable() -> None:
    with pytest.raises(ValueError, match="NCCL_TEST_MIN_BUSBW_GBPS='fast' must be a finite number >= 0"):
        Settings.from_environ({"NCCL_TEST_MIN_BUSBW_GBPS": "fast"}, on_gpu=False)


def test_the_rank_waited_for_is_named_from_under_half_the_median_and_the_bandwidth_is_the_slowest_ranks() -> None:
    """Exactly half the median (4 ms against 2 ms) is waiting alike, a little under it names the rank; 3 ranks (an
    odd count: the median is the middle one). The bus bandwidth is that of the slowest rank's time, by hand:
    256 MiB / 52 ms x 2 (3 - 1) / 3 = 6.88 GB/s."""
    nbytes = 256 * MIB
    passed, line = verdict(_times(4e-3, 4e-3, 2e-3, 4e-3), nbytes, 1e3)
    assert not passed and "every rank waited alike (slowest: rank 0 on node0)" in line
    passed, line = verdict(_times(4e-3, 4e-3, 1.9e-3, 4e-3), nbytes, 1e3)
    assert not passed and "rank 2 on node1 is slow: the other ranks waited 2.1 ms per all-reduce" in line
    passed, line = verdict(_times(50e-3, 2e-3, 52e-3), nbytes, 1e3)
    assert not passed and "rank 1 on node0 is slow: the other ranks waited 48.0 ms" in line
    assert f"over 3 ranks: bus bandwidth {268_435_456 / 0.052 * 4 / 3 / 1e9:.3g} GB/s" in line and "6.88" in line


def test_each_rank_times_only_its_timed_all_reduces(monkeypatch: pytest.MonkeyPatch) -> None:
    """2 warm-up all-reduces of 100 s, then timed ones of 1, 2 and 3 s on a clock the fake all-reduce advances: a
    mean of 2 s, the warm-ups left out and the sum divided by the 3 timed ones."""
    now, durations = [0.0], iter([100.0, 100.0, 1.0, 2.0, 3.0])

    def all_reduce(buffer: torch.Tensor) -> None:
        now[0] += next(durations)

    monkeypatch.setattr(preflight, "dist", SimpleNamespace(all_reduce=all_reduce))
    monkeypatch.setattr(preflight, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    settings = Settings.from_environ({"NCCL_TEST_ITERS": "3", "NCCL_TEST_WARMUP": "2"}, on_gpu=False)
    assert preflight.time_allreduce(torch.zeros(4), settings) == 2.0


@pytest.mark.parametrize("env, field, value", [
    ({}, "nbytes", 4 * MIB), ({"NCCL_TEST_BYTES": ""}, "nbytes", 4 * MIB), ({"NCCL_TEST_BYTES": "4"}, "nbytes", 4),
    ({"NCCL_TEST_ITERS": "1"}, "iters", 1), ({"NCCL_TEST_WARMUP": "0"}, "warmup", 0),
    ({"NCCL_TEST_MIN_BUSBW_GBPS": "0"}, "min_busbw_gbps", 0.0),
    ({"NCCL_TEST_BYTES": "3"}, "", "NCCL_TEST_BYTES='3' must be a finite number >= 4"),
    ({"NCCL_TEST_ITERS": "0"}, "", "NCCL_TEST_ITERS='0' must be a finite number >= 1"),
    ({"NCCL_TEST_WARMUP": "-1"}, "", "NCCL_TEST_WARMUP='-1' must be a finite number >= 0"),
    ({"NCCL_TEST_JOIN_S": "0"}, "", "NCCL_TEST_JOIN_S='0' must be a finite number >= 0.001"),
    ({"NCCL_TEST_ITERS": "2.5"}, "", "NCCL_TEST_ITERS='2.5' must be a finite number >= 1"),
    ({"NCCL_TEST_JOIN_S": "inf"}, "", "NCCL_TEST_JOIN_S='inf' must be a finite number >= 0.001"),
    ({"NCCL_TEST_MIN_BUSBW_GBPS": "nan"}, "", "NCCL_TEST_MIN_BUSBW_GBPS='nan' must be a finite number >= 0"),
])
def test_settings_at_their_lowest_values(env: dict[str, str], field: str, value: object) -> None:
    if not field:
        with pytest.raises(ValueError, match=re.escape(str(value))):
            Settings.from_environ(env, on_gpu=False)
        return
    assert getattr(Settings.from_environ(env, on_gpu=False), field) == value
    assert Settings.from_environ({}, on_gpu=True).nbytes == 256 * MIB  # a GPU's default


def test_one_rank_passes_skipped_without_a_store_and_a_bad_variable_still_exits_2(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(preflight.dist, "TCPStore", lambda *a, **k: pytest.fail("one rank joined a store"))
    one = {"RANK": "0", "WORLD_SIZE": "1", "DEVICE": "cpu", "NCCL_TEST_MIN_BUSBW_GBPS": "225"}
    assert preflight.main(one) == 0
    assert capsys.readouterr().out.startswith("NCCL_TEST: skipped: one rank, no link to measure")
    assert preflight.main({**one, "NCCL_TEST_ITERS": "0"}) == 2
    assert capsys.readouterr().err == "NCCL_TEST: NCCL_TEST_ITERS='0' must be a finite number >= 1; fix it in the config or " \
                                      "the environment\n"


@pytest.mark.parametrize("script", ["run.sub", "run_with_docker.sh"])
@pytest.mark.parametrize("nccl_test", ["1", "0"])
def test_launchers_start_the_pre_flight_on_every_gpu_before_the_first_run(tmp_path, script: str,
                                                                          nccl_test: str) -> None:
    dirs = {name: tmp_path / name for name in ("DATADIR_PHASE2", "EVALDIR", "CHECKPOINTDIR_PHASE1")}
    for folder in dirs.values():
        folder.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "NCCL_TEST": nccl_test, "DGXSYSTEM": "DGXH200_1x8",
           "NEXP": "1", "LOGDIR": str(tmp_path / "logs"), "CONT": "image:1", **{k: str(v) for k, v in dirs.items()}}
    done = subprocess.run(["bash", script, "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    preflight = [i for i, line in enumerate(lines) if "pytorch/nccl_preflight.py" in line]
    first_run = next(i for i, line in enumerate(lines) if line.startswith("# run 1 of 1"))
    assert len(preflight) == (nccl_test == "1") and all(i < first_run for i in preflight), lines
    if preflight:  # one process per GPU: srun's tasks, or torchrun's workers
        assert ("--ntasks-per-node=8" if script == "run.sub" else "--nproc_per_node=8") in lines[preflight[0]]


@pytest.mark.parametrize("rank, code, says", [(1, preflight.EXIT_LOST_RANK, True), (1, 0, False), (1, 1, False),
                                              (0, 1, True), (0, 0, True)])
def test_rank_0_speaks_for_the_job_and_a_rank_that_lost_it_for_itself(monkeypatch, capsys, rank, code, says):
    """One line per job (rank 0's), except from a rank that cannot reach rank 0's store: nobody else can say it."""
    monkeypatch.setattr(preflight, "run", lambda denv, env: (code, f"NCCL_TEST: line of rank {rank}"))
    env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert preflight.main(env) == code
    out = capsys.readouterr()
    assert (out.err if code else out.out) == (f"NCCL_TEST: line of rank {rank}\n" if says else "")


def test_the_script_exits_with_the_checks_code() -> None:
    """`python pytorch/nccl_preflight.py` as run.sub starts it: a bad variable ends in its line and exit 2."""
    done = _one_rank_script(NCCL_TEST_ITERS="0")
    assert done.returncode == 2 and done.stderr.startswith("NCCL_TEST: ") and "NCCL_TEST_ITERS" in done.stderr
