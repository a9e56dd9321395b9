"""Two nodes for real: two run_and_time.sh launches on this machine, each with its own NODE_RANK,
their torchrun agents meeting at MASTER_ADDR:MASTER_PORT (gloo), as the 128x8 configs run on 128
nodes with run_with_docker.sh on each."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from _fault_launch import assert_same_tensors, free_port, load_checkpoint, mllog_events, wait_all
from conftest import REPO, demo_config_env
from mlperf_bert.runtime.exits import EXIT_LOST_RANK

# 24 steps of 16 samples (2 ranks x 8), evals every 96 samples, a checkpoint at the end.
RUN = {"MAX_STEPS": "24", "TARGET_MLM_ACCURACY": "0.999", "EVAL_ITER_START_SAMPLES": "96",
       "EVAL_ITER_SAMPLES": "96", "CHECKPOINT_EVERY_SAMPLES": "192", "WARMUP_STEPS": "4"}
BOUND_S = 60  # what the surviving node may take after the other vanished (collective timeout 20 s)


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


@pytest.mark.slow
def test_two_nodes_train_like_one_node_with_the_same_world_size(demo_data, tmp_path):
    one = _start(demo_data, tmp_path / "one", tmp_path / "one", DGXNNODES="1", DGXNGPU="2",
                 MASTER_PORT=str(free_port()))
    assert wait_all([one], 300) == [0], (tmp_path / "one.err").read_text()[-3000:]
    nodes = _two_nodes(demo_data, tmp_path / "two", tmp_path / "logs")
    codes = wait_all(nodes, 300)
    assert codes == [0, 0], [(tmp_path / "logs" / f"node{r}.err").read_text()[-3000:] for r in range(2)]

    assert [s for s, _ in _evals(tmp_path / "one")] == [96, 192, 288, 384]
    assert _evals(tmp_path / "two") == _evals(tmp_path / "one")  # the exact floats
    end = "checkpoints/ckpt-000000000384.pt"
    for part in ("model", "optimizer", "train_state"):
        assert_same_tensors(load_checkpoint(tmp_path / "one" / end)[part], load_checkpoint(tmp_path / "two" / end)[part])
    events = mllog_events(tmp_path / "two" / "mlperf.log")
    assert [e["value"] for e in events if e["key"] == "global_batch_size"] == [16]
    # Node 0 prints the result; node 1 only trains.
    assert "RESULT,bert,1," in (tmp_path / "logs" / "node0.out").read_text()
    assert "RESULT" not in (tmp_path / "logs" / "node1.out").read_text()


@pytest.mark.slow
def test_losing_a_node_ends_the_other_with_76_and_one_line(demo_data, tmp_path):
    """Node 1 vanishes mid-run (every process of it killed, as when the machine fails): node 0
    names the lost rank and exits 76 within the collective timeout, without a traceback."""
    out = tmp_path / "two"
    nodes = _two_nodes(demo_data, out, tmp_path / "logs", MAX_STEPS="100000", EVAL_ITER_START_SAMPLES="800000",
                       EVAL_ITER_SAMPLES="800000", CHECKPOINT_EVERY_SAMPLES="", COLLECTIVE_TIMEOUT_S="20")
    deadline, progress = time.monotonic() + 240, out / "train.log"
    while not (progress.exists() and "step 10 " in progress.read_text()):
        assert all(p.poll() is None for p in nodes) and time.monotonic() < deadline, \
            (tmp_path / "logs" / "node0.err").read_text()[-3000:]
        time.sleep(0.2)
    # Node 1's shell, torchrun agent and worker (torchrun puts workers in sessions of their own).
    for pid in [nodes[1].pid, *_descendants(nodes[1].pid)]:
        os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    code = wait_all([nodes[0]], BOUND_S)[0]
    wait_all([nodes[1]], 10)
    assert time.monotonic() - killed_at < BOUND_S
    stderr = (tmp_path / "logs" / "node0.err").read_text()
    assert code == EXIT_LOST_RANK, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rank 1 was lost" in errors[0], stderr[-3000:]
    assert not [noise for noise in ("Traceback", "ChildFailedError", "torch/distributed/") if noise in stderr], stderr


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
