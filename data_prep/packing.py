"""Sequence packing: several short sequences share one fixed-length row.

Algorithms from Krell et al., "Efficient sequence packing without cross-contamination"
(arXiv 2107.02027). All of them work on the histogram of sequence lengths, never on single
sequences, so planning the 16.28M-sequence Wikipedia set takes milliseconds (SPFHP, LPFHP)
or a few seconds (NNLSHP, a least-squares fit over 22,102 strategies):

- SPFHP, shortest-pack-first: lengths longest first; each sequence goes into the open pack
  with the most free space that fits it (worst fit decreasing).
- LPFHP, longest-pack-first: the same, but into the open pack with the least free space
  that fits it (best fit decreasing).
  Both give the result of placing sequences one at a time. A sequence that fits no open
  pack starts a new one, and the next ones of its length follow it there while they fit;
  the published SPFHP gives each such sequence a pack of its own, hence its lower 0.99604
  (at most 12 per pack) where this SPFHP reaches LPFHP's 0.99813.
- NNLSHP: choose how often to use each pack strategy that fills a row exactly (at most 3
  sequences) by non-negative least squares, round down, and pack what is left with LPFHP.

SPFHP and LPFHP reach 0.998+ efficiency when a pack may hold many sequences (the published
runs allow 12), but only ~0.895 at the 3 slots of the packed shard format: this histogram
needs almost every pack that is not a single 512-token sequence to hold exactly 3, which a
greedy decreasing order does not plan for. NNLSHP reaches 0.9988 at K = 3.

A plan lists strategies (the lengths that share one pack) with repeat counts; `assign_packs`
then maps real sample indices onto a plan, for the data preparation that writes packed shards.

Histograms follow `mlperf_bert.data.lengths`: counts[i] is the number of sequences of length i + 1
tokens, for i in [0, max_sequence_length).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from mlperf_bert.data.lengths import lengths_histogram, validate_counts

ALGORITHMS = ("spfhp", "lpfhp", "nnlshp")

# A strategy: the lengths of the sequences that share one pack, longest first.
Strategy = tuple[int, ...]


@dataclass(frozen=True, eq=False)  # eq would compare the repeats arrays ambiguously
class PackingPlan:
    """How a histogram of sequences is packed: `repeats[j]` packs hold `strategies[j]`."""

    strategies: tuple[Strategy, ...]
    repeats: np.ndarray  # [S] int64, packs per strategy, all > 0
    max_sequence_length: int  # tokens per pack
    num_input_sequences: int  # sequences in the histogram the plan was made for

    @property
    def num_packs(self) -> int:
        return int(self.repeats.sum())

    @property
    def num_sequences(self) -> int:
        sizes = np.array([len(s) for s in self.strategies], dtype=np.int64)
        return int((sizes * self.repeats).sum())

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens over all packs."""
        totals = np.array([sum(s) for s in self.strategies], dtype=np.int64)
        return int((totals * self.repeats).sum())

    @property
    def efficiency(self) -> float:
        """Real tokens / (packs * max_sequence_length); 1.0 means no padding at all."""
        return self.num_tokens / max(self.num_packs * self.max_sequence_length, 1)

    @property
    def sequences_per_pack(self) -> float:
        return self.num_sequences / max(self.num_packs, 1)

    @property
    def dropped(self) -> int:
        """Input sequences that found no pack (0 for every algorithm here)."""
        return self.num_input_sequences - self.num_sequences

    @property
    def max_sequences_in_pack(self) -> int:
        return max((len(s) for s in self.strategies), default=0)

    def sequence_counts(self) -> np.ndarray:
        """Histogram [max_sequence_length] of the packed sequences (same convention as input)."""
        counts = np.zeros(self.max_sequence_length, dtype=np.int64)
        for strategy, repeat in zip(self.strategies, self.repeats):
            for length in strategy:
                counts[length - 1] += repeat
        return counts

    def pack_table(self) -> np.ndarray:
        """[num_packs, max_sequences_in_pack] lengths of every pack, 0 marks an empty slot."""
        width = self.max_sequences_in_pack
        table = np.zeros((len(self.strategies), width), dtype=np.int64)
        for j, strategy in enumerate(self.strategies):
            table[j, : len(strategy)] = strategy
        return np.repeat(table, self.repeats, axis=0)


def pack_histogram(
    counts: np.ndarray,
    algorithm: str,
    max_sequence_length: int = 512,
    max_sequences_per_pack: int | None = 3,
) -> PackingPlan:
    """Packs every sequence of a length histogram into rows of `max_sequence_length` tokens.

    `max_sequences_per_pack` is K, the slots of the packed shard format (3); None means
    unlimited (the published SPFHP / LPFHP runs use 12). NNLSHP supports K <= 3.
    """
    counts = validate_counts(counts, max_sequence_length)
    k = _validate_k(max_sequences_per_pack, max_sequence_length, algorithm)
    if algorithm == "spfhp":
        packs = _fit_decreasing(counts, max_sequence_length, k, best_fit=False)
    elif algorithm == "lpfhp":
        packs = _fit_decreasing(counts, max_sequence_length, k, best_fit=True)
    else:
        packs = _nnls_packs(counts, max_sequence_length, k)
    return _make_plan(packs, max_sequence_length, int(counts.sum()))


def _validate_k(k: int | None, max_sequence_length: int, algorithm: str) -> int:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown packing algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    if max_sequence_length < 1:
        raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
    if k is None:
        k = max_sequence_length  # no pack can hold more than this many 1-token sequences
    if k < 1:
        raise ValueError(f"max_sequences_per_pack must be >= 1 (or None for unlimited), got {k}")
    if algorithm == "nnlshp" and k > 3:
        raise ValueError(f"nnlshp enumerates packs of at most 3 sequences; got max_sequences_per_pack={k}")
    return min(k, max_sequence_length)


def _make_plan(packs: Mapping[Strategy, int], max_sequence_length: int, num_input: int) -> PackingPlan:
    strategies = tuple(sorted((s for s, n in packs.items() if n > 0), reverse=True))
    repeats = np.array([packs[s] for s in strategies], dtype=np.int64)
    return PackingPlan(strategies, repeats, max_sequence_length, num_input)


class _OpenPacks:
    """Packs that can still take a sequence, grouped by free space in tokens.

    `groups[space]` maps a strategy to how many open packs hold it; `totals[space]` is the
    number of open packs with that free space, kept as an array so the fitting space for a
    length is one vectorised search.
    """

    def __init__(self, max_sequence_length: int, max_sequences: int) -> None:
        self.max_sequences = max_sequences  # K: a pack holding K sequences is closed
        self.groups: list[dict[Strategy, int]] = [{} for _ in range(max_sequence_length + 1)]
        self.totals = np.zeros(max_sequence_length + 1, dtype=np.int64)

    def find(self, length: int, best_fit: bool) -> int | None:
        """Free space of the pack a `length` sequence goes into; None when none fits."""
        fitting = np.flatnonzero(self.totals[length:])
        if fitting.size == 0:
            return None
        return length + int(fitting[0] if best_fit else fitting[-1])

    def pop(self, space: int) -> tuple[Strategy, int]:
        strategy, n = self.groups[space].popitem()
        self.totals[space] -= n
        return strategy, n

    def add(self, strategy: Strategy, n: int, space: int) -> None:
        group = self.groups[space]
        group[strategy] = group.get(strategy, 0) + n
        self.totals[space] += n

    def drain(self, into: Counter) -> None:
        for group in self.groups:
            into.update(group)


def _fit_decreasing(counts: np.ndarray, max_len: int, k: int, best_fit: bool) -> Counter:
    """Best-fit (LPFHP) or worst-fit (SPFHP) decreasing, on whole groups of equal packs.

    Gives what placing the sequences one at a time gives, in one step per group of packs
    with the same strategy: with worst fit, each pack of the group takes one sequence (then
    its siblings have more space); with best fit, each takes as many as fit before the next
    pack is touched (no open pack has a free space between the length and this space).
    """
    done: Counter = Counter()
    open_packs = _OpenPacks(max_len, k)
    for length in range(max_len, 0, -1):
        left = int(counts[length - 1])
        while left > 0:
            space = open_packs.find(length, best_fit)
            if space is None:
                # Fits no open pack: new packs, each filled while nothing else fits either.
                _fill((), left, max_len, length, left, min(k, max_len // length), open_packs, done)
                break
            strategy, n = open_packs.pop(space)
            copies = min(k - len(strategy), space // length) if best_fit else 1
            left = _fill(strategy, n, space, length, left, copies, open_packs, done)
    open_packs.drain(done)
    return done


def _fill(
    strategy: Strategy,
    n: int,
    space: int,
    length: int,
    left: int,
    copies: int,
    open_packs: _OpenPacks,
    done: Counter,
) -> int:
    """Adds `copies` sequences of `length` to each of n packs holding `strategy` (free
    `space`) while `left` lasts, the last pack taking the remainder; returns what is left."""
    full = min(n, left // copies)
    if full:
        _place(strategy + (length,) * copies, full, space - copies * length, open_packs, done)
    left -= full * copies
    untouched = n - full
    if untouched and left:  # 0 < left < copies
        _place(strategy + (length,) * left, 1, space - left * length, open_packs, done)
        untouched, left = untouched - 1, 0
    if untouched and strategy:
        open_packs.add(strategy, untouched, space)
    return left


def _place(strategy: Strategy, n: int, space: int, open_packs: _OpenPacks, done: Counter) -> None:
    """Files n packs holding `strategy` as closed (full, or K sequences) or still open."""
    if space == 0 or len(strategy) >= open_packs.max_sequences:
        done[strategy] += n
    else:
        open_packs.add(strategy, n, space)


def _exact_fill_strategies(max_len: int, k: int) -> np.ndarray:
    """[S, 3] every multiset of <= k (<= 3) lengths summing to exactly max_len, longest first.

    0 marks an empty slot. 22,102 strategies for max_len 512, k 3.
    """
    rows = [np.array([[max_len, 0, 0]])]
    if k >= 2:
        short = np.arange(1, max_len // 2 + 1)
        rows.append(np.stack([max_len - short, short, np.zeros_like(short)], axis=1))
    if k >= 3:
        for smallest in range(1, max_len // 3 + 1):
            middle = np.arange(smallest, (max_len - smallest) // 2 + 1)
            rows.append(np.stack([max_len - smallest - middle, middle, np.full_like(middle, smallest)], axis=1))
    return np.concatenate(rows).astype(np.int64)


def _strategy_matrix(strategies: np.ndarray, max_len: int) -> np.ndarray:
    """[max_len, S] float: entry (l-1, j) = how many sequences of length l strategy j holds."""
    matrix = np.zeros((max_len + 1, strategies.shape[0]))
    columns = np.broadcast_to(np.arange(strategies.shape[0]), strategies.T.shape)
    np.add.at(matrix, (strategies.T, columns), 1.0)
    return matrix[1:]  # row 0 counted the empty slots


def _usage(strategies: np.ndarray, repeats: np.ndarray, max_len: int) -> np.ndarray:
    """[max_len] sequences of each length that `repeats` packs of `strategies` hold."""
    slots = np.broadcast_to(repeats[:, None], strategies.shape)
    return np.bincount(strategies.ravel(), weights=slots.ravel(), minlength=max_len + 1)[1:].astype(np.int64)


def _nnls_packs(counts: np.ndarray, max_len: int, k: int) -> Counter:
    """NNLSHP: exact-fill strategies weighted by NNLS, rounded down, rest packed by LPFHP."""
    strategies = _exact_fill_strategies(max_len, k)
    # A strategy needing a length the histogram lacks could only overshoot; leave it out.
    present = np.concatenate([[True], counts > 0])  # present[length]; slot 0 = empty slot
    strategies = strategies[present[strategies].all(axis=1)]
    weights = _nnls_weights(strategies, counts.astype(np.float64), max_len)
    repeats = _round_within(strategies, np.floor(weights).astype(np.int64), counts)
    packs: Counter = Counter()
    for j in np.flatnonzero(repeats):
        packs[tuple(int(x) for x in strategies[j] if x)] += int(repeats[j])
    residual = counts - _usage(strategies, repeats, max_len)
    packs.update(_fit_decreasing(residual, max_len, k, best_fit=True))
    return packs


def _nnls_weights(strategies: np.ndarray, target: np.ndarray, max_len: int) -> np.ndarray:
    """x >= 0 minimising ||A x - target|| over all strategies (A = _strategy_matrix).

    One dense NNLS over all 22k columns takes 25-40 s. The optimum uses fewer than max_len
    columns, nearly the same ones as the LP relaxation (most packs with A x <= target), which
    HiGHS solves in a few seconds. So: solve NNLS on the LP's columns, keep the columns in
    use and add those that violate optimality (gradient A_j . (target - A x) > 0), repeat
    until none does. Each round lowers the residual strictly, so no working set comes back;
    the final KKT check makes the result an optimum of the full NNLS.
    """
    from scipy.optimize import nnls  # scipy is needed by data preparation only

    padded = np.concatenate([[0.0], target])  # padded[length]; an empty slot reads 0
    working = _lp_support(strategies, target, max_len)
    weights = np.zeros(strategies.shape[0])
    tolerance = 1e-9 * max(float(target.max()), 1.0)
    while True:
        matrix = _strategy_matrix(strategies[working], max_len)
        weights[:] = 0.0
        if working.size:  # scipy's nnls crashes on a matrix without columns
            weights[working], _ = nnls(matrix, target, maxiter=100 * matrix.shape[1])
        residual = padded - np.concatenate([[0.0], matrix @ weights[working]])
        gradient = residual[strategies].sum(axis=1)
        gradient[working] = 0.0
        violators = np.flatnonzero(gradient > tolerance)
        if violators.size == 0:
            return weights
        support = working[weights[working] > 0]
        working = np.union1d(support, violators[np.argsort(-gradient[violators])[:max_len // 4]])


def _lp_support(strategies: np.ndarray, target: np.ndarray, max_len: int) -> np.ndarray:
    """Columns used by an optimum of: max sum(x) s.t. A x <= target, x >= 0."""
    from scipy.optimize import linprog
    from scipy.sparse import csc_matrix

    if strategies.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    slots = strategies > 0
    columns = np.broadcast_to(np.arange(strategies.shape[0])[:, None], strategies.shape)
    matrix = csc_matrix(
        (np.ones(int(slots.sum())), (strategies[slots] - 1, columns[slots])), shape=(max_len, strategies.shape[0])
    )
    result = linprog(-np.ones(strategies.shape[0]), A_ub=matrix, b_ub=target, bounds=(0, None), method="highs")
    if result.status != 0:
        raise RuntimeError(f"NNLSHP: the LP relaxation failed: {result.message}")
    return np.flatnonzero(result.x > 0)


def _round_within(strategies: np.ndarray, repeats: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Lowers `repeats` until no length is used more often than the histogram holds it.

    Least squares may overshoot a rare length; packs that overshoot are removed, the most
    used strategy first, and their other sequences return to the residual. Removing packs
    only lowers usage, so a length fixed earlier stays fixed.
    """
    repeats = repeats.copy()
    used = _usage(strategies, repeats, counts.shape[0])
    for length in np.flatnonzero(used > counts) + 1:
        users = np.flatnonzero((strategies == length).any(axis=1) & (repeats > 0))
        for j in users[np.argsort(-repeats[users], kind="stable")]:
            over = int(used[length - 1] - counts[length - 1])
            if over <= 0:
                break
            cut = min(int(repeats[j]), -(-over // int((strategies[j] == length).sum())))
            repeats[j] -= cut
            np.subtract.at(used, strategies[j][strategies[j] > 0] - 1, cut)
    return repeats


def pack_index_table(
    lengths: np.ndarray,
    plan_or_algorithm: PackingPlan | str,
    rng: np.random.Generator,
    max_sequence_length: int = 512,
    max_sequences_per_pack: int | None = 3,
) -> np.ndarray:
    """[P, K] sample indices of every pack (-1 = empty slot); each of 0..N-1 appears once.

    `lengths` [N] are the real lengths of the samples. Given an algorithm name, the plan is
    made from their histogram with `max_sequence_length` and `max_sequences_per_pack`; a
    given plan must have been made for exactly that histogram. Which sample of a length
    fills which slot, and the order of the packs, are drawn from `rng`, so consecutive packs
    are not grouped by strategy. Within a pack the longest sequence comes first.
    """
    lengths = np.asarray(lengths)
    counts = lengths_histogram(lengths, _plan_length(plan_or_algorithm, max_sequence_length))
    plan = _resolve_plan(plan_or_algorithm, counts, max_sequence_length, max_sequences_per_pack)
    table = plan.pack_table()[rng.permutation(plan.num_packs)]  # [P, K] lengths, 0 = empty
    filled = table > 0
    shuffled = rng.permutation(lengths.shape[0])
    by_length = shuffled[np.argsort(lengths[shuffled], kind="stable")]
    slot_samples = np.empty_like(by_length)
    # Slots sorted by length line up with samples sorted by length: same multiset.
    slot_samples[np.argsort(table[filled], kind="stable")] = by_length
    indices = np.full(table.shape, -1, dtype=np.int64)
    indices[filled] = slot_samples
    return indices


def assign_packs(
    lengths: np.ndarray,
    plan_or_algorithm: PackingPlan | str,
    rng: np.random.Generator,
    max_sequence_length: int = 512,
    max_sequences_per_pack: int | None = 3,
) -> list[np.ndarray]:
    """`pack_index_table` as one index array per pack (empty slots dropped)."""
    table = pack_index_table(lengths, plan_or_algorithm, rng, max_sequence_length, max_sequences_per_pack)
    if table.shape[0] == 0:
        return []
    filled = table >= 0
    return np.split(table[filled], np.cumsum(filled.sum(axis=1))[:-1])


def _plan_length(plan_or_algorithm: PackingPlan | str, max_sequence_length: int) -> int:
    if isinstance(plan_or_algorithm, PackingPlan):
        return plan_or_algorithm.max_sequence_length
    return max_sequence_length


def _resolve_plan(
    plan_or_algorithm: PackingPlan | str, counts: np.ndarray, max_len: int, k: int | None
) -> PackingPlan:
    if isinstance(plan_or_algorithm, str):
        return pack_histogram(counts, plan_or_algorithm, max_len, k)
    if not np.array_equal(plan_or_algorithm.sequence_counts(), counts):
        raise ValueError(
            "the packing plan was made for a different length histogram than these samples; "
            "build it with pack_histogram(lengths_histogram(lengths), ...) or pass an algorithm name"
        )
    return plan_or_algorithm
