"""The sharded optimizer (optim/sharded.py) at many ranks in one process, against the unsharded one.

Each rank is a thread of this process; the three collectives the sharded step makes
(reduce-scatter, all-reduce, all-gather) are simulated by `Collectives`, summing the ranks'
tensors in rank order. So the layouts that only show at real world sizes run in milliseconds:
a total that no world size divides, shards of one element, ranks whose shard holds no piece
of a parameter group (the groups lie one after the other in the flat buffer), 32 ranks.
tests/trainer/optim/test_sharded_optimizer.py runs the real thing (gloo processes, DDP, clip modes, fp16).

Tolerance: the same formulas on the same numbers, except that a tensor's norm is the root of a
sum of per-rank partial sums instead of one reduction, and the mean gradient is the sum of the
ranks' gradients / W in rank order in both; a few fp32 roundings (rtol 1e-5 on weights that
move by about lr = 0.05 per step). Each planted bug in the layout or the reductions moves a
weight by a share of lr.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mlperf_bert.optim import sharded
from mlperf_bert.optim.optimizers import parameter_groups
from mlperf_bert.optim.sharded import build_sharded_optimizer
from tests.harness.thread_ranks import (BETAS, EPS, LR, STEPS, WEIGHT_DECAY, handed_over_step, hand_over, local_grads,
                                        mean_grads, model, on_ranks, optimizer, set_grads, sharded_step, unsharded_run,
                                        weights)

WORLDS = [2, 3, 8, 32]


@pytest.mark.parametrize("block_numel,world", [(9, 3), (9, 8), (20, 2), (1, 4)])
def test_blocks_reduce_scattered_as_buckets_arrive_equal_unsharded(block_numel, world, monkeypatch):
    """The flat buffer in blocks (of one parameter each, with 1), each reduce-scattered as soon as the
    buckets handed over during the backward complete it: the unsharded steps, and the first
    reduce-scatter is issued before the last bucket arrives. A backward whose step was skipped
    comes first: the next backward's buckets replace its gradients."""
    reference, _ = unsharded_run(world, "lamb", 0.5)

    def work(rank: int) -> tuple[torch.Tensor, list[int]]:
        net = model()
        opt = optimizer(net, "lamb", 0.5, True, block_numel=block_numel)
        hand_over(net, opt, [torch.full_like(g, 1e3) for g in local_grads(rank, 0)])  # no step took these
        issued = []
        for step in range(STEPS):
            issued = handed_over_step(net, opt, rank, world, step, sharded.dist.calls)
        assert len(opt.shards.blocks) > 2
        return weights(net), issued

    ranks = on_ranks(world, work, monkeypatch)
    for got, _ in ranks:
        torch.testing.assert_close(got, weights(reference), rtol=1e-5, atol=1e-7)
    issued = ranks[0][1]  # rank 0's count is exact: it records the calls
    assert issued[0] >= 1 and issued[-2] < issued[-1]  # one after the first bucket, more after the last


@pytest.mark.parametrize("world,group_size", [(4, 2), (6, 3), (8, 4)])
def test_shard_groups_equal_unsharded_and_agree_on_a_flag_across_groups(world, group_size, monkeypatch):
    """Sharded within groups of `group_size` consecutive ranks, all-reduced across them: the unsharded
    steps on every rank; a flag folded on one rank of one group reaches every rank of every group."""
    reference, _ = unsharded_run(world, "lamb", 0.5)

    def work(rank: int) -> tuple[torch.Tensor, list[float]]:
        first = rank - rank % group_size
        net = model()
        opt = optimizer(net, "lamb", 0.5, True, block_numel=9, process_group=tuple(range(first, first + group_size)),
                        replica_group=tuple(range(rank % group_size, world, group_size)))
        flags = []
        for step in range(STEPS):
            if rank == world - 1 and step == 1:
                opt.fold_flag(torch.tensor(1.0))
            handed_over_step(net, opt, rank, world, step)
            flags.append(float(opt.agreed_nonfinite))
        return weights(net), flags

    for got, flags in on_ranks(world, work, monkeypatch):
        torch.testing.assert_close(got, weights(reference), rtol=1e-5, atol=1e-7)
        assert flags == [0.0, 1.0] + [0.0] * (STEPS - 2)


@pytest.mark.parametrize("max_grad_norm", [None, 0.5], ids=["unclipped", "clipped"])
@pytest.mark.parametrize("name", ["lamb", "adam"])
@pytest.mark.parametrize("world", WORLDS)
def test_sharded_steps_equal_unsharded_at_every_world_size(world, name, max_grad_norm, monkeypatch):
    reference, _ = unsharded_run(world, name, max_grad_norm)

    def work(rank: int) -> torch.Tensor:
        net = model()
        opt = optimizer(net, name, max_grad_norm, True)
        for step in range(STEPS):
            sharded_step(net, opt, rank, world, step)
        return weights(net)

    ranks = on_ranks(world, work, monkeypatch)
    assert (weights(reference) - weights(model())).abs().max() > 0.5 * LR  # the weights moved
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(got, weights(reference), rtol=1e-5, atol=1e-7, msg=f"rank {rank} of {world}")


def test_the_layout_leaves_whole_groups_off_some_ranks():
    """What the equality above covers: at 8 ranks some shards hold no piece of a group, at 32
    most shards hold one or two elements, and 53 elements divide into no world size above 1."""
    groups = parameter_groups(model(), WEIGHT_DECAY)
    sizes = [sum(p.numel() for p in g["params"]) for g in groups]
    assert sizes == [37, 16] and all(sum(sizes) % world for world in WORLDS)
    shard = -(-sum(sizes) // 8)  # 7 elements: ranks 0 to 4 hold only decayed weights
    assert sizes[0] > 5 * shard


@pytest.mark.parametrize("world", [3, 8])
def test_the_state_dict_is_the_unsharded_layout_and_resumes_at_another_world_size(world, monkeypatch):
    """Saved at `world` ranks after 2 steps: equal to the unsharded state; loaded at 2 ranks (and
    unsharded), the third step equals the uninterrupted unsharded run's."""
    reference, reference_opt = unsharded_run(world, "lamb", 0.5, steps=2)
    saved_weights = weights(reference).clone()
    want = reference_opt.state_dict()

    def save(rank: int) -> dict:
        net = model()
        opt = optimizer(net, "lamb", 0.5, True)
        for step in range(2):
            sharded_step(net, opt, rank, world, step)
        return opt.state_dict()

    states = on_ranks(world, save, monkeypatch)
    for state in states:
        assert [g["step"] for g in state["param_groups"]] == [g["step"] for g in want["param_groups"]] == [2, 2]
        assert sorted(state["state"]) == sorted(want["state"])
        for index, entry in want["state"].items():
            for moment in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(state["state"][index][moment], entry[moment], rtol=1e-5, atol=1e-9)
    set_grads(reference, mean_grads(world, 2))
    reference_opt.step()

    def resume(rank: int) -> torch.Tensor:
        net = model()
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(saved_weights, net.parameters())
        opt = optimizer(net, "lamb", 0.5, True)
        opt.load_state_dict(states[0])
        set_grads(net, [g / 2 for g in mean_grads(world, 2)])  # the same global gradient, from 2 ranks
        opt.step()
        return weights(net)

    for got in on_ranks(2, resume, monkeypatch):
        torch.testing.assert_close(got, weights(reference), rtol=1e-5, atol=1e-7)


def test_a_fresh_unsharded_state_resets_the_moments_and_the_step_count(monkeypatch):
    """A state saved before the first step (no moments, no step count) loaded into a sharded
    optimizer that has stepped: its next step is a first step, as a fresh optimizer's."""
    world = 3
    fresh = optimizer(model(), "lamb", 0.5, False).state_dict()
    assert fresh["state"] == {} and "step" not in fresh["param_groups"][0]
    reference = model()
    reference_opt = optimizer(reference, "lamb", 0.5, False)
    set_grads(reference, mean_grads(world, 0))
    reference_opt.step()

    def work(rank: int) -> torch.Tensor:
        net = model()
        opt = optimizer(net, "lamb", 0.5, True)
        for step in range(2):
            sharded_step(net, opt, rank, world, step + 5)
        with torch.no_grad():  # back to the first weights, in place (the parameters are views of the flat buffer)
            for p, first in zip(net.parameters(), model().parameters()):
                p.copy_(first)
        opt.load_state_dict(fresh)
        assert [g["step"] for g in opt.param_groups] == [0, 0]
        sharded_step(net, opt, rank, world, 0)
        return weights(net)

    for got in on_ranks(world, work, monkeypatch):
        torch.testing.assert_close(got, weights(reference), rtol=1e-5, atol=1e-7)


def test_a_folded_flag_or_a_non_finite_gradient_on_one_rank_is_agreed_by_every_rank_for_one_step(monkeypatch):
    world = 3

    def work(rank: int) -> list[float]:
        net = model()
        opt = optimizer(net, "lamb", 0.5, True)
        seen = []
        for step in range(4):
            if rank == 1 and step == 0:
                opt.fold_flag(torch.tensor(1.0))  # a clipping hook's non-finite bucket norm, rank-local
            grads = [g / world for g in local_grads(rank, step)]
            if rank == 2 and step == 2:
                grads[3][1] = float("inf")
            set_grads(net, grads)
            opt.step()
            seen.append(float(opt.agreed_nonfinite))
        return seen

    assert on_ranks(world, work, monkeypatch) == [[1.0, 0.0, 1.0, 0.0]] * world


def test_a_loaded_device_learning_rate_stays_the_tensor_the_step_reads(monkeypatch):
    """A CUDA graph captured the lr tensor's address: loading a state writes into it, never replaces it."""
    def work(rank: int) -> None:
        saved_lr, live_lr = torch.tensor(0.02), torch.tensor(0.05)
        source = optimizer(model(), "adam", None, True, lr=saved_lr)
        state = source.state_dict()
        opt = optimizer(model(), "adam", None, True, lr=live_lr)
        opt.load_state_dict(state)
        assert all(group["lr"] is live_lr for group in opt.param_groups)
        assert float(live_lr) == pytest.approx(0.02)

    on_ranks(2, work, monkeypatch)


@pytest.mark.parametrize("implementation", ["reference", "apex"])
def test_every_implementation_but_the_multi_tensor_one_is_refused(implementation):
    with pytest.raises(ValueError, match=f"--optimizer_impl {implementation} cannot be sharded: use foreach"):
        build_sharded_optimizer(parameter_groups(model(), WEIGHT_DECAY), "lamb", LR, BETAS, EPS, WEIGHT_DECAY, None,
                                implementation)


@pytest.mark.parametrize("other", [torch.float64, torch.bfloat16])
def test_parameters_of_another_dtype_are_refused(other):
    net = model()
    net.weight0.data = net.weight0.data.to(other)
    with pytest.raises(ValueError, match="must share one dtype and device"):
        build_sharded_optimizer(parameter_groups(net, WEIGHT_DECAY), "lamb", LR, BETAS, EPS, WEIGHT_DECAY, None)


class Subgroups:
    """torch.distributed's subgroup calls of `shard_groups`, recorded: each returns what it was asked for."""

    def __init__(self, world: int) -> None:
        self.world, self.calls = world, []

    def get_world_size(self) -> int:
        return self.world

    def new_subgroups(self, size: int) -> tuple[Any, None]:
        self.calls.append(("consecutive", size))
        return ("consecutive", size), None

    def new_subgroups_by_enumeration(self, ranks: list[list[int]]) -> tuple[Any, None]:
        self.calls.append(("enumerated", ranks))
        return ("enumerated", ranks), None


@pytest.mark.parametrize("world, size, replicas", [
    (16, 8, [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]),  # 2 nodes of 8
    (12, 4, [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]),  # 3 nodes of 4
    (6, 3, [[0, 3], [1, 4], [2, 5]]),
    (4, 1, [[0, 1, 2, 3]]),  # every rank its own whole state, all four all-reduced
])
def test_shard_groups_are_consecutive_ranks_and_replicas_the_same_place_in_each(world, size, replicas, monkeypatch):
    fake = Subgroups(world)
    monkeypatch.setattr(sharded, "dist", fake)
    assert sharded.shard_groups(size) == (("consecutive", size), ("enumerated", replicas))
    assert fake.calls == [("consecutive", size), ("enumerated", replicas)]  # in this order on every rank


def test_shard_groups_of_1024_ranks_in_nodes_of_8(monkeypatch):
    fake = Subgroups(1024)
    monkeypatch.setattr(sharded, "dist", fake)
    _, (_, replicas) = sharded.shard_groups(8)
    assert len(replicas) == 8 and all(group == list(range(i, 1024, 8)) for i, group in enumerate(replicas))
    assert sorted(r for group in replicas for r in group) == list(range(1024)) and len(replicas[0]) == 128


@pytest.mark.parametrize("world, size", [(8, 0), (8, 8), (1, 1), (1024, 1024)])
def test_a_group_of_every_rank_is_no_subgroup(world, size, monkeypatch):
    fake = Subgroups(world)
    monkeypatch.setattr(sharded, "dist", fake)
    assert sharded.shard_groups(size) == (None, None) and fake.calls == []


@pytest.mark.parametrize("world, size", [(12, 8), (8, 3), (8, 16), (24, 16), (8, -2)])
def test_a_group_size_that_does_not_divide_the_ranks_is_refused_before_any_subgroup(world, size, monkeypatch):
    fake = Subgroups(world)
    monkeypatch.setattr(sharded, "dist", fake)
    with pytest.raises(ValueError, match=f"--dist_optimizer_group_size {size} must divide the {world} ranks"):
        sharded.shard_groups(size)
    assert fake.calls == []


def test_blocks_by_hand_padded_to_whole_shards():
    """Parameters of 5, 3, 4 and 7 elements in blocks of at most 9 over 3 ranks: [5, 3] (8, padded to 9), [4]
    (padded to 6), [7] (padded to 9); rank r's shard holds 3 + 2 + 3 elements of them. 5 + 4 fill one block
    exactly. A parameter larger than a block is a block alone; the last one of 1 element over 4 ranks takes one
    element of each shard."""
    blocks, offsets = sharded.plan_blocks([5, 3, 4, 7], 3, 9)
    assert [(b.first, b.stop, b.start, b.size, b.shard_start, b.chunk) for b in blocks] == [
        (0, 2, 0, 9, 0, 3), (2, 3, 9, 6, 3, 2), (3, 4, 15, 9, 5, 3)]
    assert offsets == [0, 5, 9, 15]
    blocks, _ = sharded.plan_blocks([5, 4], 3, 9)  # exactly a block's worth: one block
    assert [(b.first, b.stop, b.size) for b in blocks] == [(0, 2, 9)]
    blocks, offsets = sharded.plan_blocks([20, 1], 4, 9)
    assert [(b.first, b.stop, b.start, b.size, b.shard_start) for b in blocks] == [(0, 1, 0, 20, 0), (1, 2, 20, 4, 5)]
    assert offsets == [0, 20]
