"""The sharded optimizer (`--distributed_optimizer`) equals the unsharded one, on 2 and 4 gloo ranks.

`tests/harness/workers/sharded.py` trains the same tiny BERT both ways on each rank (its docstring says
how); here the ranks' records are compared. One launch of six processes: equality at 2 and 4
ranks side by side and the checkpoints written at 4 ranks, sharded and unsharded, then, in the
2-rank processes, every resume at 2 and 1 ranks.

Tolerance, from what differs and nothing else. Both runs compute the same formulas on the
same numbers, except (a) a tensor's norm (LAMB's trust ratio, the clipping norm) is the square
root of a sum of per-rank partial sums of squares instead of one reduction, and (b) the sum
over ranks is a reduce-scatter instead of an all-reduce (and, across world sizes, micro-batch
accumulation instead of a rank sum). Each is a few fp32 roundings of a norm or a sum. A
rounding of a sum is relative to its addends, not to the sum: where the ranks' gradients of a
weight nearly cancel, the reduced gradient differs by eps = 2**-24 times the addends, and
ADAM's normalisation turns that into a move of the size of the typical update. So a weight may
differ by ROUNDINGS * eps * (the longest "path" of any weight: the sum of its moves over the
run), plus one unit in the last place of the weight per step (a stored weight rounds to fp32
after every update, and an update a rounding apart may land on the neighbouring float), and an
unmoved weight not at all. ROUNDINGS = 32 covers the roundings of (a) and (b) at 4 ranks
(measured beyond the ulp term: at most 0.6 eps x path at 2 ranks, 10 at 4, on 2026-11-25); a
real difference in the arithmetic (a wrong shard, a norm missing a rank's part, a clip by
another norm) moves weights by a share of the path itself, about a million times more, as the
mode-to-mode comparison below shows.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness.paths import REPO
from tests.harness.tensors import EPS, ROUNDINGS, assert_within_rounding

WORKER = "tests.harness.workers.sharded"
MODES = ["none", "after_allreduce", "before_allreduce", "bucketwise"]
RUNS = [f"{name}/{mode}" for name in ("lamb", "adam") for mode in MODES]
SAVE_AT, STEPS = 3, 6  # as in the worker


def _launch(processes: list[list[tuple[str, int, int, str]]], out: Path) -> None:
    """Starts every process at once, each running its (jobs, rank, world, world's name) groups in turn."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [(groups, subprocess.Popen(
        [sys.executable, "-m", WORKER, str(out), *[str(part) for group in groups for part in group]], cwd=REPO, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)) for groups in processes]
    for groups, proc in procs:
        output = proc.communicate(timeout=900)[0]
        assert proc.returncode == 0, f"{groups} failed:\n{output}"


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict[str, list[dict]]:
    """Equality at 2 and 4 ranks and the checkpoints written at 4 ranks, sharded and unsharded;
    then, in the 2-rank world's processes, every resume at 2 and 1 ranks (each waits for the
    4-rank checkpoint it reads): six processes in all."""
    out = tmp_path_factory.mktemp("sharded")
    resumes_w2 = "resume-sharded:save-sharded-w4,resume-sharded:save-unsharded-w4"
    resumes_w1 = "resume-sharded:save-sharded-w4,resume-unsharded:save-sharded-w4"
    pair = [[("equality,fp16", rank, 2, "w2"), (resumes_w2, rank, 2, "resume-w2")] for rank in range(2)]
    pair[0].append((resumes_w1, 0, 1, "resume-w1"))
    _launch([*pair, *[[("save-unsharded,save-sharded,equality,grouped", rank, 4, "w4")] for rank in range(4)]], out)
    found: dict[str, list[dict]] = {}
    for path in sorted(out.glob("*-rank*.pt")):
        key, rank = path.stem.rsplit("-rank", 1)
        found.setdefault(key, []).insert(int(rank), torch.load(path, weights_only=False))
    return found


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("run", RUNS)
def test_distributed_optimizer_equals_unsharded_for_each_optimizer_and_clip_mode(records, run, world):
    """LAMB and ADAM, every clip mode, two micro-batches per step: the same losses and weights."""
    for record in records[f"equality-w{world}"]:
        unsharded, sharded = record[run]["unsharded"], record[run]["sharded"]
        assert sharded["losses"] == pytest.approx(unsharded["losses"], rel=1e-6)
        assert_within_rounding(sharded["weights"], unsharded["weights"], unsharded["path"], STEPS)
        assert unsharded["path"].max() > 1e-3  # training moved the weights
    ranks = records[f"equality-w{world}"]
    for other in ranks[1:]:  # the all-gather gave every rank all weights
        assert torch.equal(other[run]["sharded"]["weights"], ranks[0][run]["sharded"]["weights"])
    assert len({r[run]["unsharded"]["losses"][0] for r in ranks}) == world  # each rank had its own data


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_comparison_tells_clip_modes_apart(records, world):
    """The bound above is not blind: between clip modes the weights differ far beyond it."""
    record = records[f"equality-w{world}"][0]
    for name in ("lamb", "adam"):
        runs = [record[f"{name}/{mode}"]["sharded"] for mode in MODES]
        for i in range(len(runs)):
            for j in range(i + 1, len(runs)):
                difference = (runs[i]["weights"] - runs[j]["weights"]).abs().max()
                assert difference > 1000 * ROUNDINGS * EPS * runs[i]["path"].max(), (name, MODES[i], MODES[j])


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_optimizer_step_makes_one_reduce_scatter_and_all_gather_per_block_and_few_all_reduces(
        records, world):
    """Per step and block: 1 reduce-scatter, 1 all-gather; and 2 all-reduces of partial sums for LAMB,
    1 for ADAM (no other collective: the clipping hooks do not reduce); unsharded, DDP's Python
    hooks all-reduce each bucket and nothing else is reduced."""
    for run in RUNS:
        sharded = records[f"equality-w{world}"][0][run]["sharded"]
        small, blocks = (2 if run.startswith("lamb") else 1), sharded["blocks"]
        assert blocks > 2, run  # the tiny model is cut into several blocks
        assert sharded["collectives"] == {"reduce_scatter_single": blocks, "all_gather_single": blocks,
                                          "all_reduce": small}, run
        unsharded = records[f"equality-w{world}"][0][run]["unsharded"]["collectives"]
        assert set(unsharded) <= {"all_reduce"}, run


@pytest.mark.parametrize("mode", ["after_allreduce", "bucketwise"])
def test_shard_groups_of_two_ranks_equal_unsharded_and_all_reduce_each_block_across_groups(records, mode):
    """4 ranks, the optimizer sharded within 2 groups of 2 (`--dist_optimizer_group_size 2`): the same
    weights as unsharded, every rank; per block one reduce-scatter in the group, one all-reduce
    across the groups and one all-gather in the group."""
    ranks = records["grouped-w4"]
    for record, plain in zip(ranks, records["equality-w4"]):
        unsharded, sharded = plain[f"lamb/{mode}"]["unsharded"], record[f"lamb/{mode}"]["sharded"]
        assert sharded["losses"] == pytest.approx(unsharded["losses"], rel=1e-6)
        assert_within_rounding(sharded["weights"], unsharded["weights"], unsharded["path"], STEPS)
        blocks = sharded["blocks"]
        assert sharded["collectives"] == {"reduce_scatter_single": blocks, "all_gather_single": blocks,
                                          "all_reduce": blocks + 2}
    for other in ranks[1:]:
        assert torch.equal(other[f"lamb/{mode}"]["sharded"]["weights"], ranks[0][f"lamb/{mode}"]["sharded"]["weights"])


@pytest.mark.parametrize("mode", ["after_allreduce", "bucketwise"])
def test_sharded_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(records, mode):
    """Device loss scaling, graphed step: infinite activations on rank 1 at steps 2 and 3 only. Every
    rank skips both (the reduced gradient carries the inf to whichever rank owns it, and the sharded
    step agrees), the scale backs off and grows as unsharded, and the weights stay equal within the
    roundings of the module docstring (a weight near 1.0, a LayerNorm's, may land one ulp apart)."""
    ranks = records["fp16-w2"]
    for record in ranks:
        unsharded, sharded = record[mode]["unsharded"], record[mode]["sharded"]
        assert sharded["skipped"] == unsharded["skipped"] == 2
        assert sharded["applied"] == unsharded["applied"] == 4
        assert sharded["scales"] == unsharded["scales"]
        assert_within_rounding(sharded["weights"], unsharded["weights"], unsharded["path"], STEPS)
    assert torch.equal(ranks[0][mode]["sharded"]["weights"], ranks[1][mode]["sharded"]["weights"])


def _path(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each weight's accumulated path after every step (0 at the start)."""
    paths = [torch.zeros_like(weights[0])]
    for before, after in zip(weights, weights[1:]):
        paths.append(paths[-1] + (after - before).abs())
    return paths


@pytest.mark.parametrize("resumed", [
    "resume-sharded-from-save-sharded-w4-w2",
    "resume-sharded-from-save-sharded-w4-w1",
    "resume-unsharded-from-save-sharded-w4-w1",
    "resume-sharded-from-save-unsharded-w4-w2",
])
def test_sharded_checkpoint_resumes_at_other_world_sizes_and_unsharded(records, resumed):
    """A run checkpoint written sharded at 4 ranks resumes sharded at 2 and 1 and unsharded, and one
    written unsharded resumes sharded: the following steps equal the uninterrupted unsharded run's
    at 4 ranks (every world size trains on the same global batches)."""
    reference = records["save-unsharded-w4"][0]
    paths = _path(reference["weights"])
    for record in records[resumed]:
        assert record["losses"] == pytest.approx(reference["losses"][SAVE_AT:], rel=1e-6)
        for step, weights in enumerate(record["weights"]):
            at = SAVE_AT + step
            assert_within_rounding(weights, reference["weights"][at], paths[at], at)
    sharded_run = records["save-sharded-w4"][0]  # and the sharded run from the start, too
    assert sharded_run["losses"] == pytest.approx(reference["losses"], rel=1e-6)
    assert_within_rounding(sharded_run["weights"][-1], reference["weights"][-1], paths[-1], STEPS)


def test_sharded_resume_refuses_an_optimizer_state_that_does_not_fit_naming_the_cause(records):
    for record in (records["resume-sharded-from-save-sharded-w4-w2"]
                   + records["resume-unsharded-from-save-sharded-w4-w1"]):
        shape, groups = record["refusals"]
        assert "'exp_avg' of parameter 2 of group 0 has shape (1, 16)" in shape and "the parameter (2, 16)" in shape
        assert "3 parameter groups, this optimizer 2" in groups
