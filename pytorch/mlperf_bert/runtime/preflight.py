"""`NCCL_TEST=1`: a short all-reduce bandwidth check of the allocation before any run starts.

    python pytorch/nccl_preflight.py        # one process per GPU: srun (run.sub) or torchrun (run_with_docker.sh)

A 1,024-GPU job whose first collective stalls on one bad node costs the whole allocation; this
check costs seconds. Every rank joins a rendezvous store first (a rank that does not join within
NCCL_TEST_JOIN_S seconds is named, with the hosts that did join), then runs NCCL_TEST_ITERS
timed all-reduces of NCCL_TEST_BYTES (after NCCL_TEST_WARMUP untimed ones) over the default
process group: NCCL on GPUs, gloo on the CPU. Each iteration first rewrites the buffer (a pass
over device memory, the rank's own work) and then all-reduces it; every rank times the
all-reduce from the moment its buffer is ready until the result is on its device.

The job's bus bandwidth is that of nccl-tests' all_reduce_perf: bytes x 2 (n - 1) / n over the
slowest rank's mean all-reduce time. Below NCCL_TEST_MIN_BUSBW_GBPS (GB/s, the config's) the
check fails with one line, and exit code 1, naming where the time went:

- a rank that spent much less time inside the all-reduce than the others (under half their
  median) arrived last: the others waited for it, so it (its GPU, its host) is named;
- otherwise every rank waited alike, which is what a slow link or switch looks like from the
  ranks: the line gives the bandwidth and the slowest rank's host, without a culprit.

A job of one rank has no link to measure: the check says so and passes (exit 0).
A rank that does not join exits 76 (a lost rank, as the trainer's). The check reads no data and
writes nothing, so it runs before a run's log begins.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, TypeVar

import torch
import torch.distributed as dist

from .distributed import DistEnv, dist_env_from
from .exits import EXIT_LOST_RANK, EXIT_OK, record_exit_code

EXIT_TOO_SLOW = 1
PREFIX = "NCCL_TEST"
# Defaults: NVIDIA's run.sub times all_reduce_perf from 21 MB to 672 MB; 256 MiB is in that range.
GPU_BYTES, CPU_BYTES = 256 * 2**20, 4 * 2**20
WAITED_FOR = 0.5  # a rank inside the all-reduce less than this share of the median was waited for


@dataclass(frozen=True)
class Settings:
    min_busbw_gbps: float
    nbytes: int
    iters: int
    warmup: int
    join_s: float

    @classmethod
    def from_environ(cls, env: Mapping[str, str], on_gpu: bool) -> Settings:
        """The NCCL_TEST_* variables; ValueError names a bad one."""
        return cls(_number(env, "NCCL_TEST_MIN_BUSBW_GBPS", 0.0, float),
                   _number(env, "NCCL_TEST_BYTES", GPU_BYTES if on_gpu else CPU_BYTES, int, low=4),
                   _number(env, "NCCL_TEST_ITERS", 20, int, low=1),
                   _number(env, "NCCL_TEST_WARMUP", 3, int),
                   _number(env, "NCCL_TEST_JOIN_S", 120.0, float, low=1e-3))


N = TypeVar("N", int, float)


def _number(env: Mapping[str, str], name: str, default: N, kind: Callable[[str], N], low: float = 0) -> N:
    """NAME's value as `kind`, `default` when unset or empty; ValueError naming it when not a finite number >= low
    (an infinite NCCL_TEST_JOIN_S would overflow the store's timeout)."""
    text = env.get(name, "")
    if text == "":
        return default
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not low <= value < math.inf:
        raise ValueError(f"{name}={text!r} must be a finite number >= {low}; fix it in the config or the environment")
    return value


@dataclass(frozen=True)
class RankTimes:
    """One rank's means over the timed iterations, in seconds."""

    rank: int
    host: str
    in_allreduce: float  # from its buffer being ready to the result on its device


def bus_bandwidth_gbps(nbytes: int, world: int, seconds: float) -> float:
    """nccl-tests' all-reduce bus bandwidth: algorithm bandwidth x 2 (n - 1) / n, in GB/s."""
    return nbytes / seconds * 2 * (world - 1) / world / 1e9


def one_rank_line(threshold_gbps: float) -> str:
    """The pre-flight of a job of one rank: an all-reduce over one rank sends nothing (its bus bandwidth
    formula gives 0 for any time), so there is no link to measure and the check is skipped, not failed."""
    return (f"{PREFIX}: skipped: one rank, no link to measure (an all-reduce over one rank sends nothing; "
            f"NCCL_TEST_MIN_BUSBW_GBPS={threshold_gbps:g} applies to 2 ranks or more)")


def verdict(times: Sequence[RankTimes], nbytes: int, threshold_gbps: float) -> tuple[bool, str]:
    """(passed, the line to print) from every rank's times."""
    world = len(times)
    if world < 2:
        return True, one_rank_line(threshold_gbps)
    slowest = max(times, key=lambda t: t.in_allreduce)
    busbw = bus_bandwidth_gbps(nbytes, world, slowest.in_allreduce)
    facts = (f"all-reduce of {nbytes / 2**20:.0f} MiB over {world} ranks: bus bandwidth {busbw:.3g} GB/s "
             f"(NCCL_TEST_MIN_BUSBW_GBPS={threshold_gbps:g})")
    if busbw >= threshold_gbps:
        return True, f"{PREFIX}: passed: {facts}"
    median = statistics.median(t.in_allreduce for t in times)
    last = min(times, key=lambda t: t.in_allreduce)
    if world > 1 and last.in_allreduce < WAITED_FOR * median:
        waited = (median - last.in_allreduce) * 1e3
        return False, (f"{PREFIX}: failed: rank {last.rank} on {last.host} is slow: the other ranks waited "
                       f"{waited:.1f} ms per all-reduce for it; {facts}. Drain {last.host} and resubmit")
    return False, (f"{PREFIX}: failed: every rank waited alike (slowest: rank {slowest.rank} on {slowest.host}), "
                   f"as on a slow link or switch; {facts}. Check the fabric of this allocation")


START_KEY = "preflight/start"


def wait_for_ranks(store: dist.Store, denv: DistEnv, host: str, timeout_s: float) -> list[int] | None:
    """Announces this rank's host. Rank 0 returns the ranks that did not announce within the timeout and
    tells the others whether to go on; another rank returns None when told to stop, else []."""
    store.set(f"preflight/host/{denv.rank}", host)
    if not denv.is_main:
        return [] if store.get(START_KEY) == b"go" else None
    deadline = time.monotonic() + timeout_s
    missing = list(range(denv.world_size))
    while missing and time.monotonic() < deadline:
        missing = [r for r in missing if not store.check([f"preflight/host/{r}"])]
        if missing:
            time.sleep(0.05)
    store.set(START_KEY, "stop" if missing else "go")
    return missing


def hosts_of(store: dist.Store, world: int) -> list[str]:
    return [store.get(f"preflight/host/{r}").decode() for r in range(world)]


def local_step(buffer: torch.Tensor, value: float) -> None:
    """The rank's own work before each all-reduce: one pass over the buffer in device memory."""
    buffer.fill_(value)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_allreduce(buffer: torch.Tensor, settings: Settings) -> float:
    """This rank's mean seconds per all-reduce over the timed iterations (warm-up ones first)."""
    total = 0.0
    for i in range(settings.warmup + settings.iters):
        local_step(buffer, float(i))
        _sync(buffer.device)
        start = time.perf_counter()
        dist.all_reduce(buffer)
        _sync(buffer.device)
        if i >= settings.warmup:
            total += time.perf_counter() - start
    return total / settings.iters


def gather_times(mine: float, hosts: list[str], device: torch.device) -> list[RankTimes]:
    world = dist.get_world_size()
    seconds = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world)]
    dist.all_gather(seconds, torch.tensor([mine], dtype=torch.float64, device=device))
    return [RankTimes(r, hosts[r], float(t.item())) for r, t in enumerate(seconds)]


def run(denv: DistEnv, env: Mapping[str, str]) -> tuple[int, str | None]:
    """(exit code, the line rank 0 prints) of one rank's check."""
    on_gpu = torch.cuda.is_available() and env.get("DEVICE", "auto") != "cpu"
    device = torch.device("cuda", denv.local_rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    settings = Settings.from_environ(env, on_gpu)
    if denv.world_size == 1:  # no other rank to wait for, no bytes to time
        return EXIT_OK, one_rank_line(settings.min_busbw_gbps)
    host = socket.gethostname()
    # Under torchrun its agent already serves the store at MASTER_ADDR:MASTER_PORT: join it, as torch's
    # env:// and tcp:// rendezvous do; under srun rank 0 serves it.
    serves = denv.is_main and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        # The server does not wait for the others here: wait_for_ranks does, and names the missing ones.
        store = dist.TCPStore(denv.master_addr, denv.master_port, denv.world_size, serves,
                              timeout=datetime.timedelta(seconds=settings.join_s + 30), wait_for_workers=False)
        missing = wait_for_ranks(store, denv, host, settings.join_s)
    except (RuntimeError, OSError) as lost:  # torch's DistStoreError is a RuntimeError
        return EXIT_LOST_RANK, (f"{PREFIX}: failed: rank {denv.rank} on {host} could not reach rank 0's store at "
                                f"{denv.master_addr}:{denv.master_port} ({str(lost).splitlines()[0]})")
    if missing is None:  # rank 0 names the missing ranks
        return EXIT_LOST_RANK, None
    if missing:
        joined = sorted({store.get(f"preflight/host/{r}").decode() for r in range(denv.world_size) if r not in missing})
        return EXIT_LOST_RANK, (f"{PREFIX}: failed: rank(s) {', '.join(map(str, missing[:8]))}"
                                f"{' ...' if len(missing) > 8 else ''} did not join within {settings.join_s:g} s "
                                f"(joined hosts: {', '.join(joined) or 'none'}); check those nodes and resubmit")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo", store=store, rank=denv.rank, world_size=denv.world_size,
                            timeout=datetime.timedelta(seconds=settings.join_s + 30))
    try:
        buffer = torch.empty(settings.nbytes // 4, dtype=torch.float32, device=device)
        times = gather_times(time_allreduce(buffer, settings), hosts_of(store, denv.world_size), device)
    finally:
        dist.destroy_process_group()
    passed, line = verdict(times, buffer.numel() * 4, settings.min_busbw_gbps)
    return (EXIT_OK if passed else EXIT_TOO_SLOW), line


def main(env: Mapping[str, str] = os.environ) -> int:
    try:
        denv = dist_env_from(env)
        code, line = run(denv, env)
    except ValueError as bad:
        print(f"{PREFIX}: {bad}", file=sys.stderr, flush=True)
        return 2
    if line is not None and (denv.is_main or code == EXIT_LOST_RANK):
        print(line, file=sys.stderr if code else sys.stdout, flush=True)
    record_exit_code(code, env)
    return code
