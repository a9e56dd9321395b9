"""Starting instrumented trainer processes (workers/instrumented_trainer.py) for the fault tests, per rank or
under torchrun, or many runs in one process per rank (workers/trainer_runs.py), and reading what they leave."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.harness.paths import REPO
from tests.harness.ports import free_port

# Run as `python -m` from the repository root (the package `tests` is found there).
WORKER = "tests.harness.workers.instrumented_trainer"
RUNS_WORKER = "tests.harness.workers.trainer_runs"


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **(extra or {})}


def worker_command(flags: list[str], record: Path | None = None, *instruments: str) -> list[str]:
    rec = ["--record", str(record)] if record is not None else []
    return [sys.executable, "-m", WORKER, *rec, *instruments, "--", *flags]


def start_ranks(command: list[str], world: int, logs: Path) -> list[subprocess.Popen]:
    """`world` processes of `command` with RANK / WORLD_SIZE set, as an MPI or srun launch gives them."""
    logs.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = _env({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
        with open(logs / f"rank{rank}.err", "w") as err:
            procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err))
    return procs


def start_torchrun(command: list[str], world: int, log: Path) -> subprocess.Popen:
    """torchrun --standalone over `command` (its python, then `-m MODULE` or a script, and arguments)."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 f"--nproc_per_node={world}", *command[1:]], cwd=REPO, env=_env(),
                                stdout=out, stderr=subprocess.STDOUT)


@dataclasses.dataclass(frozen=True)
class Launch:
    """One trainer run of `world` ranks; rank R's stderr goes to logs/rank<R>.err, as under start_ranks."""
    world: int
    flags: list[str]
    logs: Path
    instruments: tuple[str, ...] = ()  # workers/instrumented_trainer.py's flags


def run_launches(launches: dict[str, Launch], work: Path, timeout: float = 600) -> dict[str, list[int | None]]:
    """Each launch's exit codes (rank by rank; None where a rank never ended its run), the launches run in
    order on one process per rank: process R runs rank R of every launch of more than R ranks
    (workers/trainer_runs.py), so a rank costs one Python start-up however many runs it takes part in.
    Each run has a port of its own, taken by its rank 0 when it gets there, and starts when all its
    ranks reach it: as every launch has a rank 0, the launches run one after the other, so one that
    reads another's checkpoint comes after it. A rank whose process died before its run has no code;
    the process's own stderr is in work/process<R>.err."""
    work.mkdir(parents=True, exist_ok=True)
    plans: list[list[dict]] = [[] for _ in range(max(launch.world for launch in launches.values()))]
    for name, launch in launches.items():
        launch.logs.mkdir(parents=True, exist_ok=True)
        for rank in range(launch.world):
            env = {"RANK": str(rank), "WORLD_SIZE": str(launch.world), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(launch.world), "MASTER_ADDR": "127.0.0.1"}
            plans[rank].append({"flags": launch.flags, "env": env, "port": str(work / f"{name}.port"),
                                "instruments": list(launch.instruments), "err": str(launch.logs / f"rank{rank}.err"),
                                "code": str(work / f"{name}.{rank}.code")})
    procs = []
    for rank, plan in enumerate(plans):
        (work / f"plan{rank}.json").write_text(json.dumps(plan))
        with open(work / f"process{rank}.err", "w") as err:  # what happens outside every run's own stderr
            procs.append(subprocess.Popen([sys.executable, "-m", RUNS_WORKER, str(work / f"plan{rank}.json")],
                                          cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=err))
    wait_all(procs, timeout)
    codes = {}
    for name, launch in launches.items():
        files = [work / f"{name}.{rank}.code" for rank in range(launch.world)]
        codes[name] = [int(f.read_text()) if f.exists() else None for f in files]
    return codes


def log_tail(path: Path, chars: int = 3000) -> str:
    """The end of a run's log, for a failure message (which may be about a run that never started)."""
    return path.read_text()[-chars:] if path.exists() else f"{path} was never written"


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(deadline - time.monotonic(), 0.1)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)
                p.wait()


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL to the process, or to its whole group when it leads one (a launcher and its children)."""
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
            return
    except ProcessLookupError:
        return
    proc.kill()


def run_ranks(command: list[str], world: int, logs: Path, timeout: float = 300) -> list[int]:
    return wait_all(start_ranks(command, world, logs), timeout)


def losses(record: Path, rank: int = 0) -> list[dict]:
    path = record / f"losses_rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_steps(record: Path, rank: int, steps: int, procs: list[subprocess.Popen], timeout: float = 120) -> None:
    """Blocks until `rank` has recorded `steps` training steps (fails if the processes end first)."""
    deadline = time.monotonic() + timeout
    while len(losses(record, rank)) < steps:
        assert time.monotonic() < deadline, f"rank {rank} did not reach step {steps} in {timeout} s"
        assert all(p.poll() is None for p in procs), "a process ended before training got going"
        time.sleep(0.05)


def pid_of(record: Path, rank: int) -> int:
    return int((record / f"pid_rank{rank}").read_text())


def mllog_events(path: Path) -> list[dict]:
    return [json.loads(line.split(":::MLLOG ", 1)[1]) for line in path.read_text().splitlines() if ":::MLLOG" in line]


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)
