"""Clipping modes against their definitions, on real 4- and 2-process gloo runs.

The ranks (tests/harness/workers/clipping.py) only record what happened; the expected gradients are
computed here in float64 numpy from each rank's unclipped local gradient, with the bucket layout
DDP itself reports, never from the code under test.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mlperf_bert.optim.clipping import ClipConfig, ClipHandle, ClipMode, optimizer_clip_norm
from tests.harness.paths import REPO
from tests.harness.ports import free_port
from tests.harness.workers import clipping as worker  # shares the run's constants

WORKER = "tests.harness.workers.clipping"

CLIP_MODES = ["before_allreduce", "bucketwise"]
ALL_MODES = [m.value for m in ClipMode]


def launch(world: int, out_dir: Path) -> list[dict]:
    """Runs `world` worker processes to completion and loads what each rank recorded."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "pytorch"))
    port = str(free_port())
    procs = [
        subprocess.Popen([sys.executable, "-m", WORKER, str(r), str(world), port, str(out_dir)],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)
    ]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} of {world} failed:\n{output}"
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    """One launch of 4 processes: the default group of 4, then a subgroup of ranks 0 and 1."""
    return launch(4, tmp_path_factory.mktemp("clipping"))


@pytest.fixture(params=[2, 4], ids=lambda w: f"world{w}")
def ranks(request, runs) -> list[dict]:
    """What each rank of a `world`-process group recorded, in rank order."""
    return [run[request.param] for run in runs[: request.param]]


# ---- the definitions, in float64 -------------------------------------------------------------

def clip(x: np.ndarray, threshold: float) -> np.ndarray:
    return x * (threshold / max(np.linalg.norm(x), threshold))


def expected_gradient(mode: str, local: np.ndarray, buckets: list[np.ndarray], c: float) -> np.ndarray:
    """The averaged gradient a mode hands the optimizer; local = [W, N] unclipped rank gradients."""
    if mode in ("none", "after_allreduce"):  # after_allreduce: the optimizer clips the mean
        return local.mean(axis=0)
    if mode == "before_allreduce":
        return np.mean([clip(g, c) for g in local], axis=0)
    out = np.empty(local.shape[1])
    threshold = c / math.sqrt(len(buckets))
    for elements in buckets:
        out[elements] = np.mean([clip(g[elements], threshold) for g in local], axis=0)
    return out


def param_groups(record: dict) -> list[list[int]]:
    """DDP's rebuilt buckets as parameter indices, e.g. '9 8 7 6, 5 4' -> [[9, 8, 7, 6], [5, 4]]."""
    text = record["rebuilt_per_bucket_param_indices"]
    assert text, "DDP did not report its rebuilt buckets"
    return [[int(i) for i in group.split()] for group in text.split(",")]


def ddp_buckets(record: dict, step: int) -> list[np.ndarray] | None:
    """Flat element indices of every bucket DDP used in `step`, or None when DDP does not say.

    DDP rebuilds its buckets before the second synchronized backward; before that it reports
    only the sizes of its construction buckets, which pin the layout down only if there is one.
    """
    numels = record["param_numels"]
    starts = np.cumsum([0, *numels])
    if step > 0:
        groups = param_groups(record)
    elif len(record["initial_bucket_sizes"].split(",")) == 1:
        groups = [list(range(len(numels)))]
    else:
        return None
    return [np.concatenate([np.arange(starts[i], starts[i + 1]) for i in group]) for group in groups]


def stacked(ranks: list[dict], key: tuple, step: int, field: str) -> np.ndarray:
    return np.stack([r[key]["steps"][step][field].double().numpy() for r in ranks])


def assert_steps_match(ranks: list[dict], key: tuple, mode: str, local_field: str = "local") -> int:
    """Every rank's reduced gradient equals the definition on every step; returns steps checked."""
    checked = 0
    for step in range(len(ranks[0][key]["steps"])):
        buckets = ddp_buckets(ranks[0][key], step)
        if buckets is None:
            continue
        want = expected_gradient(mode, stacked(ranks, key, step, local_field), buckets, worker.MAX_NORM)
        for rank, got in enumerate(stacked(ranks, key, step, "reduced")):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"rank {rank} step {step}")
        checked += 1
    return checked


def assert_clipping_was_active(ranks: list[dict], key: tuple, mode: str) -> None:
    """Guards the comparison: the mode's result is far from the plain mean on some step."""
    gaps = []
    for step in range(1, len(ranks[0][key]["steps"])):
        local = stacked(ranks, key, step, "local")
        gaps.append(np.abs(expected_gradient(mode, local, ddp_buckets(ranks[0][key], step), worker.MAX_NORM)
                           - local.mean(axis=0)).max())
    assert max(gaps) > 1e-3


# ---- multi-process behaviour -------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("mode", ALL_MODES)
def test_gradient_reaching_the_optimizer_matches_the_mode(ranks, mode):
    key = ("plain", mode)
    assert assert_steps_match(ranks, key, mode) >= 3
    if mode in CLIP_MODES:
        assert_clipping_was_active(ranks, key, mode)


@pytest.mark.slow
def test_bucketwise_clips_some_buckets_and_leaves_others(ranks):
    """c/sqrt(B) is between bucket norms, so both branches of clip() are exercised."""
    record = ranks[0][("plain", "bucketwise")]
    threshold = worker.MAX_NORM / math.sqrt(record["hook_num_buckets"])
    norms = [np.linalg.norm(step["local"].numpy()[elements])
             for step in record["steps"][1:] for elements in ddp_buckets(record, 1)]
    assert min(norms) < threshold < max(norms)


@pytest.mark.slow
def test_hook_bucket_count_is_the_one_ddp_reports(ranks):
    for record in (r[("plain", "bucketwise")] for r in ranks):
        groups = param_groups(record)
        num_buckets = record["hook_num_buckets"]
        assert num_buckets == len(groups) == record["reducer_num_buckets"] >= 3
        ddp_bytes = [int(b) for b in record["rebuilt_bucket_sizes"].split(",")]
        assert [4 * n for n in record["hook_bucket_numels"]] == ddp_bytes
        assert record["hook_backward_count"] == len(record["steps"])
        for step in record["steps"][1:]:
            assert [(i, n) for i, n, _ in step["launches"]] == list(enumerate(record["hook_bucket_numels"]))


@pytest.mark.slow
def test_bucketwise_launches_all_reduces_before_the_backward_ends(ranks):
    """From the third step on, the first bucket is on the wire before layer 0's gradient exists;
    while learning B (steps 0-1) and in before_allreduce, every launch waits for the end."""
    for rank in ranks:
        for step_index, step in enumerate(rank[("plain", "bucketwise")]["steps"]):
            first_launch = min(t for _, _, t in step["launches"])
            assert (first_launch < step["first_layer_ns"]) == (step_index >= 2), step_index
        for step in rank[("plain", "before_allreduce")]["steps"]:
            assert min(t for _, _, t in step["launches"]) > step["first_layer_ns"]
        for mode in ("none", "after_allreduce"):
            assert all(step["launches"] == [] for step in rank[("plain", mode)]["steps"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", CLIP_MODES)
def test_a_nonfinite_bucket_on_one_rank_makes_every_rank_skip(ranks, mode):
    last = len(ranks) - 1
    for rank_index, rank in enumerate(ranks):
        for step_index, step in enumerate(rank[("nonfinite", mode)]["steps"]):
            overflow = step_index == worker.NONFINITE_STEP
            assert step["local_nonfinite"] == (overflow and rank_index == last)
            assert step["skip"] == overflow


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", *CLIP_MODES])
def test_accumulation_clips_the_accumulated_gradient(ranks, mode):
    key = ("accumulate", mode)
    assert assert_steps_match(ranks, key, mode) >= 2
    for record in (r[key] for r in ranks):  # one synchronized backward per step, not per micro-batch
        assert record["hook_backward_count"] in (None, len(record["steps"]))
    if mode in CLIP_MODES:
        assert_clipping_was_active(ranks, key, mode)
        assert_per_micro_batch_clipping_differs(ranks, key, mode)


def assert_per_micro_batch_clipping_differs(ranks: list[dict], key: tuple, mode: str) -> None:
    """The rejected alternative (clip each micro-batch, then sum) gives another gradient here."""
    step = len(ranks[0][key]["steps"]) - 1
    buckets = ddp_buckets(ranks[0][key], step)
    micro = [np.stack([r[key]["steps"][step]["local_per_micro"][m].double().numpy() for r in ranks])
             for m in range(2)]
    per_micro = sum(expected_gradient(mode, local, buckets, worker.MAX_NORM) for local in micro)
    got = ranks[0][key]["steps"][step]["reduced"].double().numpy()
    assert np.abs(got - per_micro).max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("mode", CLIP_MODES)
def test_loss_scaled_gradients_are_clipped_in_unscaled_units(ranks, mode):
    """Gradients carry the loss scale s; unscaled, the result is the unscaled definition."""
    key = ("scaled", mode)
    assert assert_steps_match(ranks, key, mode) >= 2
    assert_clipping_was_active(ranks, key, mode)


# ---- single-process API ------------------------------------------------------------------------

@pytest.mark.parametrize("norm", [0, -1.0, math.inf, math.nan, "1.0", True])
def test_config_rejects_bad_max_grad_norm(norm):
    with pytest.raises(ValueError, match="--max_grad_norm"):
        ClipConfig(ClipMode.BUCKETWISE, norm)


def test_config_parses_mode_names_and_rejects_unknown_ones():
    assert ClipConfig("before_allreduce").mode is ClipMode.BEFORE_ALLREDUCE
    with pytest.raises(ValueError, match="--clip_mode must be one of none, after_allreduce"):
        ClipConfig("bucket_wise")


@pytest.mark.parametrize("mode, optimizer_clips", [
    ("none", None), ("after_allreduce", 0.5), ("before_allreduce", None), ("bucketwise", None),
])
def test_only_after_allreduce_is_left_to_the_optimizer(mode, optimizer_clips):
    assert optimizer_clip_norm(ClipConfig(mode, 0.5)) == optimizer_clips


def test_handle_without_hook_never_skips_and_validates_the_loss_scale():
    handle = ClipHandle(ClipConfig("after_allreduce"), None)
    handle.set_loss_scale(2.0**16)
    assert handle.nonfinite_flag() is None and handle.local_nonfinite() is None
    with pytest.raises(ValueError, match="loss scale"):
        handle.set_loss_scale(math.inf)
