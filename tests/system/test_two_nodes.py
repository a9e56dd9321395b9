"""Two nodes for real: two run_and_time.sh launches on this machine, each with its own NODE_RANK,
their torchrun agents meeting at MASTER_ADDR:MASTER_PORT (gloo), as the 128x8 configs run on 128
nodes with run_with_docker.sh on each: under the static rendezvous (node ranks from NODE_RANK) and
under c10d (node ranks in join order). Then a node that vanishes, and a torchrun agent killed alone."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from mlperf_bert.runtime.exits import EXIT_LOST_RANK
from tests.harness.demo import demo_config_env
from tests.harness.launches import load_checkpoint, mllog_events, wait_all
from tests.harness.paths import REPO
from tests.harness.ports import free_port
from tests.harness.tensors import assert_same_tensors

# 24 steps of 16 samples (2 ranks x 8), evals every 96 samples, a checkpoint at the end.
RUN = {"MAX_STEPS": "24", "TARGET_MLM_ACCURACY": "0.999", "EVAL_ITER_START_SAMPLES": "96",
       "EVAL_ITER_SAMPLES": "96", "CHECKPOINT_EVERY_SAMPLES": "192", "WARMUP_STEPS": "4"}
BOUND_S = 60  # what the surviving node may take after the other vanished (collective timeout 20 s)
# Trains until stopped: no eval, no checkpoint.
LONG_RUN = {"MAX_STEPS": "100000", "EVAL_ITER_START_SAMPLES": "800000", "EVAL_ITER_SAMPLES": "800000",
            "CHECKPOINT_EVERY_SAMPLES": "", "COLLECTIVE_TIMEOUT_S": "20"}


def _start(data: Path, out: Path, log: Path, **variables: str) -> subprocess.Popen:
    env = demo_config_env(data, OUTPUT_DIR=str(out), **{**RUN, **variables})
    env.pop("MLPERF_BERT_EXIT_DIR", None)
    with open(log.with_suffix(".out"), "w") as stdout, open(log.with_suffix(".err"), "w") as stderr:
        return subprocess.Popen(["bash", str(REPO / "run_and_time.sh")], env=env, cwd=REPO, stdout=stdout,
                                stderr=stderr, start_new_session=True)


def _two_nodes(data: Path, out: Path, logs: Path, **variables: str) -> list[subprocess.Popen]:
    """Node 0 and node 1, one rank each, into one OUTPUT_DIR (a shared file system)."""
    logs.mkdir(parents=True, exist_ok=True)
    where = {"DGXNNODES": "2", "DGXNGPU": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
             **variables}
    return [_start(data, out, logs / f"node{rank}", NODE_RANK=str(rank), **where) for rank in range(2)]


def _evals(out: Path) -> list[tuple[int, float]]:
    return [(e["metadata"]["epoch_num"], e["value"]) for e in mllog_events(out / "mlperf.log")
            if e["key"] == "eval_accuracy"]


@pytest.fixture(scope="module")
def one_node(demo_data, tmp_path_factory) -> Path:
    """The OUTPUT_DIR of a one-node run with two ranks: what two nodes of one rank each must match."""
    out = tmp_path_factory.mktemp("one_node")
    one = _start(demo_data, out / "out", out / "run", DGXNNODES="1", DGXNGPU="2", MASTER_PORT=str(free_port()))
    assert wait_all([one], 300) == [0], (out / "run.err").read_text()[-3000:]
    assert [s for s, _ in _evals(out / "out")] == [96, 192, 288, 384]
    return out / "out"


@pytest.mark.slow
@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_two_nodes_train_like_one_node_with_the_same_world_size(demo_data, one_node, tmp_path, rdzv):
    """Under c10d the agents take node ranks in join order: global rank 0 may run on either launch,
    and that launch prints the MLPerf lines and the RESULT line."""
    nodes = _two_nodes(demo_data, tmp_path / "two", tmp_path / "logs", RDZV_BACKEND=rdzv)
    codes = wait_all(nodes, 300)
    assert codes == [0, 0], [(tmp_path / "logs" / f"node{r}.err").read_text()[-3000:] for r in range(2)]

    assert _evals(tmp_path / "two") == _evals(one_node)  # the exact floats
    end = "checkpoints/ckpt-000000000384.pt"
    for part in ("model", "optimizer", "train_state"):
        assert_same_tensors(load_checkpoint(one_node / end)[part], load_checkpoint(tmp_path / "two" / end)[part])
    events = mllog_events(tmp_path / "two" / "mlperf.log")
    assert [e["value"] for e in events if e["key"] == "global_batch_size"] == [16]
    # Global rank 0's node prints the MLPerf lines and the result; the other only trains.
    outs = [(tmp_path / "logs" / f"node{r}.out").read_text() for r in range(2)]
    main = [r for r in range(2) if ":::MLLOG" in outs[r]]
    assert len(main) == 1 and (rdzv == "c10d" or main == [0]), outs
    assert "RESULT,bert,1," in outs[main[0]] and "RESULT" not in outs[1 - main[0]]


def _worker_of(node: subprocess.Popen) -> tuple[int, int, int]:
    """(agent pid, worker pid, worker's global rank) of a one-rank node: the shell's child and grandchild."""
    (agent,) = _children(node.pid)
    (worker,) = _children(agent)
    environ = dict(e.split("=", 1) for e in Path(f"/proc/{worker}/environ").read_text().split("\0") if "=" in e)
    return agent, worker, int(environ["RANK"])


def _children(pid: int) -> list[int]:
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


def _running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie waits only for its reaper: it runs no more)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _listens_on(pid: int, port: int) -> bool:
    """Whether process `pid` holds the socket listening on TCP `port` (IPv4 or IPv6)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    return any(os.readlink(fd) in inodes for fd in Path(f"/proc/{pid}/fd").iterdir())


@dataclasses.dataclass
class Killed:
    """What one kill left: the launches' exit codes and how long after the kill they ended."""
    logs: Path
    codes: list[int]
    seconds: float
    lost: int  # the node whose process was killed
    agent: int  # its torchrun agent's pid
    worker_running: bool  # its worker, when the launches ended
    rank: int  # that worker's global rank


# name: (rendezvous, what is killed: one node's torchrun agent, or every process of node 1)
KILLS = {"static-node 1": ("static", "node 1"), "static-node 0": ("static", "node 0"),
         "c10d-store host": ("c10d", "store host"), "static-whole node 1": ("static", "whole node 1")}


@pytest.fixture(scope="module")
def kills(demo_data, tmp_path_factory) -> dict[str, Killed]:
    """Each kill of KILLS on two nodes of its own. The next pair of nodes starts as soon as the
    previous kill is made, while its survivor waits to learn of it (idle), and a thread per kill
    times the launches' end from its own kill: one start-up at a time, the waits side by side."""
    found: dict[str, Killed] = {}
    waits = []
    for name, (rdzv, target) in KILLS.items():
        tmp = tmp_path_factory.mktemp(name.replace(" ", "_"))
        nodes, killed_at, killed, worker = _kill_when_training(demo_data, tmp, rdzv, target)
        waits.append(threading.Thread(target=_wait_after_kill, args=(found, name, nodes, killed_at, killed, worker)))
        waits[-1].start()
    for wait in waits:
        wait.join()
    return found


def _kill_when_training(demo_data: Path, tmp: Path, rdzv: str,
                        target: str) -> tuple[list[subprocess.Popen], float, Killed, int]:
    """Two nodes started and `target` killed once they train: the launches, the kill's time, what
    is known of it so far, and the pid of the killed node's worker."""
    out, logs, port = tmp / "two", tmp / "logs", free_port()
    nodes = _two_nodes(demo_data, out, logs, RDZV_BACKEND=rdzv, MASTER_PORT=str(port), **LONG_RUN)
    try:
        _wait_for_step(nodes, out, logs)
    except BaseException:
        wait_all(nodes, 0)  # ends both launches (their agents' workers stop with them) before failing
        raise
    processes = [_worker_of(node) for node in nodes]
    lost = 1 if target == "whole node 1" else {"node 1": 1, "node 0": 0}.get(target)
    if lost is None:
        lost = next(n for n, (agent, _, _) in enumerate(processes) if _listens_on(agent, port))
    agent, worker, rank = processes[lost]
    if target == "whole node 1":  # node 1's shell, torchrun agent and worker (in a session of its own)
        for pid in [nodes[1].pid, *_descendants(nodes[1].pid)]:
            os.kill(pid, signal.SIGKILL)
    else:
        os.kill(agent, signal.SIGKILL)
    return nodes, time.monotonic(), Killed(logs, [], 0.0, lost, agent, True, rank), worker


def _wait_after_kill(found: dict[str, Killed], name: str, nodes: list[subprocess.Popen], killed_at: float,
                     killed: Killed, worker: int) -> None:
    try:
        codes = wait_all(nodes, BOUND_S)
    except subprocess.TimeoutExpired:  # wait_all has killed what ran on: the test reads the time and the codes
        codes = [node.returncode for node in nodes]
    ended = time.monotonic()
    found[name] = dataclasses.replace(killed, codes=codes, seconds=ended - killed_at, worker_running=_running(worker))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["static-node 1", "static-node 0", "c10d-store host"])
def test_a_killed_agent_stops_its_worker_and_ends_the_other_node_with_76(kills, name):
    """One node's torchrun agent alone is SIGKILLed mid-run: node 1's, node 0's (it serves the
    workers' store), or under c10d the one serving the rendezvous store (the other agent loses it).
    Its worker, in a session of its own, would train on as an orphan; it stops with one line and 76
    instead, so its launch exits 76 and the other node names the lost rank and exits 76, as when
    the whole node vanishes."""
    killed = kills[name]
    logs, lost = killed.logs, killed.lost
    assert killed.seconds < BOUND_S, killed
    assert not killed.worker_running
    assert killed.codes == [EXIT_LOST_RANK] * 2, [(logs / f"node{n}.err").read_text()[-3000:] for n in range(2)]
    own = (logs / f"node{lost}.err").read_text()
    assert [line for line in own.splitlines() if line.startswith("error:")] == [
        f"error: the launcher of this node's ranks (torchrun agent, pid {killed.agent}) died; its ranks stop with "
        f"exit code {EXIT_LOST_RANK} instead of training on without it (no checkpoint); resume from the newest "
        "checkpoint, if any"], own[-3000:]
    _assert_one_lost_rank_line((logs / f"node{1 - lost}.err").read_text(), killed.rank)


def _wait_for_step(nodes: list[subprocess.Popen], out: Path, logs: Path) -> None:
    """Until the run logged step 10 (both nodes running)."""
    deadline, progress = time.monotonic() + 240, out / "train.log"
    while not (progress.exists() and "step 10 " in progress.read_text()):
        assert all(p.poll() is None for p in nodes) and time.monotonic() < deadline, \
            [(logs / f"node{n}.err").read_text()[-3000:] for n in range(2)]
        time.sleep(0.2)


def _assert_one_lost_rank_line(stderr: str, rank: int = 1) -> None:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"rank {rank} was lost" in errors[0], stderr[-3000:]
    assert not [noise for noise in ("Traceback", "ChildFailedError", "torch/distributed/", "TCPStore.cpp")
                if noise in stderr], stderr


@pytest.mark.slow
def test_losing_a_node_ends_the_other_with_76_and_one_line(kills):
    """Node 1 vanishes mid-run (every process of it killed, as when the machine fails): node 0
    names the lost rank and exits 76 within the collective timeout, without a traceback."""
    killed = kills["static-whole node 1"]
    stderr = (killed.logs / "node0.err").read_text()
    assert killed.seconds < BOUND_S, killed
    assert killed.codes[0] == EXIT_LOST_RANK, stderr[-3000:]
    _assert_one_lost_rank_line(stderr)


def _descendants(leader: int) -> list[int]:
    """The processes descended from `leader` (read while it lives: orphans move to init)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [leader]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
