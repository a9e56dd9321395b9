"""Load-balancing policies: strata counts, deals as permutations with equal counts per GPU,
and the balance each deal order reaches, checked against plain-Python deals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlperf_bert.data import stratified
from mlperf_bert.input import balance
from mlperf_bert.data.lengths import load_length_histogram


@pytest.fixture(scope="module")
def wikipedia() -> np.ndarray:
    return load_length_histogram()


def draw(counts: np.ndarray, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.choice(np.arange(1, counts.shape[0] + 1), size=shape, p=counts / counts.sum())


def python_deal(lengths: list[int], bins: int, order: str) -> list[list[int]]:
    """The deal orders written out one sample at a time."""
    ranked = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    rows = [ranked[r : r + bins] for r in range(0, len(ranked), bins)]
    out: list[list[int]] = [[] for _ in range(bins)]
    if order in ("raster", "snake"):
        for r, row in enumerate(rows):
            if order == "snake" and r % 2:
                row = row[::-1]
            for b, sample in enumerate(row):
                out[b].append(sample)
        return out
    loads = [0] * bins
    for row in reversed(rows):
        by_load = sorted(range(bins), key=lambda b: (loads[b], b))
        for b, sample in zip(by_load, reversed(row)):
            out[b].insert(0, sample)
            loads[b] += lengths[sample]
    return out


def test_wikipedia_strata_give_6_3_2_5_at_local_batch_16(wikipedia: np.ndarray) -> None:
    shares = stratified.stratum_shares(wikipedia)
    total = wikipedia.sum()
    independent = [wikipedia[lo:hi].sum() / total for lo, hi in ((0, 128), (128, 256), (256, 384), (384, 512))]
    assert shares == pytest.approx(independent)
    assert shares == pytest.approx([0.369, 0.197, 0.117, 0.316], abs=5e-4)  # REFERENCE.md
    assert stratified.stratum_counts(shares, 16) == [6, 3, 2, 5]


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6).filter(lambda w: sum(w) > 0.01),
    local_batch=st.integers(1, 64),
)
def test_largest_remainder_rounding(weights: list[float], local_batch: int) -> None:
    shares = [w / sum(weights) for w in weights]
    counts = stratified.stratum_counts(shares, local_batch)
    quotas = [s * local_batch for s in shares]
    assert sum(counts) == local_batch
    rounded_up = [q - int(q) for c, q in zip(counts, quotas) if c > int(q)]
    rounded_down = [q - int(q) for c, q in zip(counts, quotas) if c == int(q)]
    assert all(int(q) <= c <= int(q) + 1 for c, q in zip(counts, quotas))
    assert not rounded_up or not rounded_down or min(rounded_up) >= max(rounded_down) - 1e-12


@pytest.mark.parametrize("order", balance.ORDERS)
@pytest.mark.parametrize("bins,per_bin", [(1, 5), (4, 1), (8, 16), (3, 7)])
def test_deal_matches_the_python_deal(order: str, bins: int, per_bin: int) -> None:
    lengths = np.random.default_rng(bins * per_bin).integers(1, 40, size=bins * per_bin)  # many ties
    dealt = balance.deal(lengths, bins, order)
    assert dealt.shape == (bins, per_bin)
    assert dealt.tolist() == python_deal(lengths.tolist(), bins, order)


@pytest.mark.parametrize("order", balance.ORDERS)
def test_deal_is_a_permutation_per_step_and_deterministic(order: str) -> None:
    lengths = np.random.default_rng(0).integers(1, 513, size=(5, 3, 64))  # leading dims = steps
    dealt = balance.deal(lengths, 8, order)
    assert dealt.shape == (5, 3, 8, 8)
    flat = dealt.reshape(5, 3, 64)
    assert (np.sort(flat, axis=-1) == np.arange(64)).all()
    assert np.array_equal(dealt, balance.deal(lengths.copy(), 8, order))
    assert np.array_equal(dealt[2, 1], balance.deal(lengths[2, 1], 8, order))


def bin_loads(lengths: np.ndarray, dealt: np.ndarray) -> np.ndarray:
    return np.take_along_axis(lengths, dealt.reshape(lengths.shape), axis=-1).reshape(dealt.shape).sum(axis=-1)


def test_snake_narrows_the_spread_of_raster(wikipedia: np.ndarray) -> None:
    lengths = draw(wikipedia, (200, 128), seed=1)
    raster = bin_loads(lengths, balance.deal(lengths, 8, "raster"))
    snake = bin_loads(lengths, balance.deal(lengths, 8, "snake"))
    spread = lambda loads: (loads.max(axis=-1) - loads.min(axis=-1)).mean()  # noqa: E731
    assert spread(snake) < 0.5 * spread(raster)


def test_greedy_beats_snake_on_average(wikipedia: np.ndarray) -> None:
    lengths = draw(wikipedia, (300, 128), seed=2)  # 8 GPUs x 16 samples per step
    snake = bin_loads(lengths, balance.deal(lengths, 8, "snake")).max(axis=-1)
    greedy = bin_loads(lengths, balance.deal(lengths, 8, "greedy")).max(axis=-1)
    mean_load = lengths.sum(axis=-1) / 8  # no deal can have a max below this
    assert greedy.mean() < snake.mean()
    assert (greedy - mean_load).mean() < 0.5 * (snake - mean_load).mean()


@pytest.mark.parametrize("policy", balance.POLICIES)
def test_policies_keep_the_step_and_each_gpu_count(policy: str) -> None:
    lengths = np.random.default_rng(3).integers(1, 513, size=(4, 16, 6))  # 4 steps, 16 GPUs, B = 6
    assignment = balance.balance(lengths, policy, gpus_per_node=4)
    assert assignment.shape == lengths.shape
    assert (np.sort(assignment.reshape(4, -1), axis=-1) == np.arange(96)).all()
    tokens = balance.gpu_tokens(lengths, assignment)
    assert np.array_equal(tokens.sum(axis=-1), lengths.sum(axis=(-1, -2)))
    if policy.startswith("local"):
        node_of_sample = assignment // (4 * 6)
        node_of_gpu = np.arange(16)[:, None] // 4
        assert (node_of_sample == node_of_gpu).all()
    if policy == "none":
        assert np.array_equal(tokens, lengths.sum(axis=-1))


def test_global_policies_balance_better_than_none(wikipedia: np.ndarray) -> None:
    lengths = draw(wikipedia, (20, 64, 16), seed=4)
    worst = {
        policy: balance.gpu_tokens(lengths, balance.balance(lengths, policy, 8)).max(axis=-1).mean()
        for policy in balance.POLICIES
    }
    assert worst["global_greedy"] <= worst["global_snake"] < worst["global_presort"] < worst["none"]
    assert worst["local_greedy"] < worst["local_snake"] < worst["local_presort"] < worst["none"]


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="cannot be dealt evenly"):
        balance.deal(np.arange(10), 4, "snake")
    with pytest.raises(ValueError, match="unknown deal order"):
        balance.deal(np.arange(8), 4, "zigzag")
    with pytest.raises(ValueError, match="unknown balance policy"):
        balance.balance(np.ones((8, 2)), "local_zigzag")
    with pytest.raises(ValueError, match="gpus_per_node=3"):
        balance.balance(np.ones((8, 2)), "local_snake", gpus_per_node=3)
    with pytest.raises(ValueError, match="summing to 1"):
        stratified.stratum_counts([0.5, 0.2], 16)
    with pytest.raises(ValueError, match="end at the histogram length"):
        stratified.stratum_shares(np.ones(512), bounds=(128, 256))
