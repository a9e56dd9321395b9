"""The graphed step over 2 gloo ranks equals the eager one: every clip mode, accumulation, fp16 scaling.

`tests/harness/workers/graphed_step.py` runs both steps on each rank (its docstring says how); here
the ranks' records are compared. Off a GPU the graphed step runs its captured function
uncaptured (`cuda_graphs.Replay`), so what is compared is the arithmetic a graph replays:
the DDP all-reduce and clipping hooks inside the step, the device learning rate, the
capturable LAMB and, for fp16, the device loss scaler against `torch.amp.GradScaler`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness.paths import REPO
from tests.harness.ports import free_port

WORKER = "tests.harness.workers.graphed_step"
WORLD = 2
MODES = ["none", "after_allreduce", "before_allreduce", "bucketwise"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("graphed_ranks")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", WORKER, str(r), str(WORLD), port, str(out)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{output}"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("mode", MODES)
def test_graphed_step_of_many_ranks_equals_the_eager_step(ranks, mode):
    for record in ranks:
        run = record["modes"][mode]
        assert [s["loss"] for s in run["graphed"]] == pytest.approx([s["loss"] for s in run["eager"]], rel=1e-5)
        assert all(s["applied"] for s in run["graphed"] + run["eager"])
        torch.testing.assert_close(run["graphed_weights"], run["eager_weights"], rtol=1e-5, atol=1e-6)
    # The ranks hold the same weights (the all-reduce ran), and training moved them.
    torch.testing.assert_close(ranks[0]["modes"][mode]["graphed_weights"], ranks[1]["modes"][mode]["graphed_weights"])
    first_losses = {r["modes"][mode]["eager"][0]["loss"] for r in ranks}
    assert len(first_losses) == WORLD  # different data on each rank


def test_clip_modes_give_different_weights(ranks):
    """The comparison above is not blind to the mode: each mode's arithmetic differs."""
    weights = [ranks[0]["modes"][mode]["eager_weights"] for mode in MODES]
    for i in range(len(MODES)):
        for j in range(i + 1, len(MODES)):
            assert not torch.allclose(weights[i], weights[j], rtol=1e-6, atol=1e-7), (MODES[i], MODES[j])


@pytest.mark.parametrize("mode", ["after_allreduce", "before_allreduce", "bucketwise"])
def test_device_loss_scaling_equals_grad_scaler_with_overflows_on_one_rank(ranks, mode):
    for record in ranks:
        run = record["fp16"][mode]
        assert run["device_scales"] == run["host_scales"]
        assert run["host_applied"] == run["device_applied"] == 4  # 6 steps, 2 skipped on every rank
        assert (run["device_skipped"], run["in_a_row"]) == (2, 2)
        torch.testing.assert_close(run["device_weights"], run["host_weights"], rtol=1e-5, atol=1e-6)
    scales = ranks[0]["fp16"][mode]["host_scales"]
    assert scales[2] < scales[1] and scales[3] < scales[2] and scales[-1] > scales[3]  # backed off, then grew
