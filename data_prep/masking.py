"""Sequences from span pairs, and masked-LM predictions, vectorised over a block of sequences.

Masking follows the MLCommons reference (no whole-word masking): in a sequence of n tokens,
num_to_predict = min(max_predictions, max(1, round(n * masked_lm_prob))) positions are drawn
uniformly without replacement from all tokens except [CLS] and the two [SEP] (Python's
round, i.e. half to even, on the same float product); each drawn position becomes [MASK]
with probability 0.8, keeps its token with 0.1, and becomes a token drawn uniformly from the
whole vocabulary with 0.1. Positions are stored in ascending order with the original tokens
as labels.

Drawing k of a row's c candidates without replacement, for all rows at once: draw k
candidates per row with replacement, keep the distinct ones (sort row-tagged keys, drop repeats),
draw again for the rows still short, until every row has k. Each round treats all
candidates alike, so the final set is a uniformly random k-subset, as the reference's
shuffle-and-take-k gives; with k ~ 0.15 c few rows need a second round. Only the M ~ 0.15 T
drawn positions are ever sorted, never all T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data_prep.pairs import A_END, A_START, B_END, B_START, IS_RANDOM
from mlperf_bert.shards import Samples, concat_ranges, offsets

_ROW_SHIFT = 10  # key = row << 10 | candidate index; candidates per row < 1024


@dataclass(frozen=True)
class MaskParams:
    vocab_size: int
    cls_id: int
    sep_id: int
    mask_id: int
    masked_lm_prob: float = 0.15
    max_predictions: int = 76


def assemble(tokens: np.ndarray, spans: np.ndarray, params: MaskParams) -> Samples:
    """[CLS] A [SEP] B [SEP] for every span row, with segment ids; no predictions yet."""
    la = spans[:, A_END] - spans[:, A_START]
    lb = spans[:, B_END] - spans[:, B_START]
    ones = np.ones_like(la)
    piece_lengths = np.stack([ones, la, ones, lb, ones], axis=1)  # [n, 5]
    dummy = np.zeros_like(la)  # specials read token 0 and are overwritten below
    piece_starts = np.stack([dummy, spans[:, A_START], dummy, spans[:, B_START], dummy], axis=1)
    ids = tokens[concat_ranges(piece_starts.ravel(), piece_lengths.ravel())].astype(np.int32)
    lengths = la + lb + 3
    bounds = offsets(lengths)
    ids[bounds[:-1]] = params.cls_id
    ids[bounds[:-1] + la + 1] = params.sep_id
    ids[bounds[1:] - 1] = params.sep_id
    segments = np.repeat(np.tile(np.array([0, 0, 0, 1, 1], np.int8), len(lengths)), piece_lengths.ravel())
    no_predictions = np.zeros(len(lengths), np.int64)
    return Samples(
        input_ids=ids, segment_ids=segments, lengths=lengths.astype(np.int64),
        masked_lm_positions=np.zeros(0, np.int32), masked_lm_ids=np.zeros(0, np.int32),
        num_predictions=no_predictions, next_sentence_labels=spans[:, IS_RANDOM].astype(np.int8),
    )


def num_to_predict(lengths: np.ndarray, params: MaskParams) -> np.ndarray:
    """[n] predictions per sequence; never more than its n - 3 candidate tokens."""
    rounded = np.rint(lengths * params.masked_lm_prob).astype(np.int64)  # rint: half to even, like round()
    return np.minimum(np.minimum(params.max_predictions, np.maximum(1, rounded)), lengths - 3)


def _distinct(keys: np.ndarray) -> np.ndarray:
    keys = np.sort(keys)
    return keys[np.concatenate([[True], keys[1:] != keys[:-1]])]  # np.unique hashes, which is slower here


def _draw_candidates(counts: np.ndarray, candidates: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """[sum(counts)] sorted keys row << 10 | c: counts[r] distinct candidate indices c < candidates[r] per row.

    Rows that are complete leave the loop, so later rounds only sort the few short rows.
    """
    if candidates.size and candidates.max() >= 1 << _ROW_SHIFT:
        raise ValueError(f"sequences of up to {1 << _ROW_SHIFT} tokens are supported, got {candidates.max()}")
    finished, keys = [], np.zeros(0, dtype=np.int64)
    need, done = counts.copy(), counts == 0
    while (active := np.flatnonzero(need)).size:
        row = np.repeat(active, need[active])
        drawn = (rng.random(row.shape[0]) * candidates[row]).astype(np.int64)
        keys = _distinct(np.concatenate([keys, (row << _ROW_SHIFT) | drawn]))
        need = np.where(done, 0, counts - np.bincount(keys >> _ROW_SHIFT, minlength=counts.shape[0]))
        done |= need == 0
        complete = done[keys >> _ROW_SHIFT]
        finished.append(keys[complete])
        keys = keys[~complete]
    return np.sort(np.concatenate(finished)) if finished else keys


def _choose_positions(samples: Samples, a_lengths: np.ndarray, counts: np.ndarray,
                      rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(row [M], position [M]) of the drawn tokens, ascending by row then position.

    Candidate c of a row is token c + 1 while inside A (positions 1..len(A)) and c + 2 in B
    (skipping the [SEP] after A); [CLS] and the final [SEP] are never candidates.
    """
    keys = _draw_candidates(counts, samples.lengths - 3, rng)
    row = keys >> _ROW_SHIFT
    candidate = keys & ((1 << _ROW_SHIFT) - 1)
    return row, candidate + np.where(candidate < a_lengths[row], 1, 2)


def mask_samples(samples: Samples, a_lengths: np.ndarray, params: MaskParams, rng: np.random.Generator) -> Samples:
    """Adds masked-LM predictions to unmasked Samples; `a_lengths` [n] are the tokens of sentence A."""
    counts = num_to_predict(samples.lengths, params)
    row, position = _choose_positions(samples, a_lengths, counts, rng)
    chosen = offsets(samples.lengths)[row] + position  # flat token index
    labels = samples.input_ids[chosen]
    action, keep_or_random = rng.random(chosen.shape[0]), rng.random(chosen.shape[0])
    random_ids = rng.integers(0, params.vocab_size, chosen.shape[0], dtype=np.int32)
    replacement = np.where(action < 0.8, params.mask_id, np.where(keep_or_random < 0.5, labels, random_ids))
    ids = samples.input_ids.copy()
    ids[chosen] = replacement
    return Samples(
        input_ids=ids, segment_ids=samples.segment_ids, lengths=samples.lengths,
        masked_lm_positions=position.astype(np.int32),
        masked_lm_ids=labels.astype(np.int32), num_predictions=counts,
        next_sentence_labels=samples.next_sentence_labels,
    )
