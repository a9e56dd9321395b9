"""`Samples`: many pretraining sequences as flat vectors, and the fixed / varlength layouts.

Every step works on this one in-memory form: the real tokens of N sequences concatenated
into T-long vectors plus per-sequence lengths, and the M masked positions likewise. Gathers,
format conversions and checks are then a handful of numpy calls instead of a Python loop
per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np

from data_prep.formats import STORAGE_DTYPES, DataPrepError


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[sum(lengths)] int64: start_0 .. start_0+len_0-1, start_1 .. , as one vector."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    shift = np.repeat(np.asarray(starts, dtype=np.int64) - (ends - lengths), lengths)
    return np.arange(int(ends[-1]) if ends.size else 0, dtype=np.int64) + shift


def offsets(lengths: np.ndarray) -> np.ndarray:
    """[N+1] int64 exclusive prefix sum: item i spans [offsets[i], offsets[i+1])."""
    out = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


@dataclass
class Samples:
    """N sequences as flat vectors. T = total tokens, M = total masked positions."""

    input_ids: np.ndarray  # [T] int32 token ids, [CLS] A [SEP] B [SEP] per sequence
    segment_ids: np.ndarray  # [T] int8, 0 for [CLS] A [SEP], 1 for B [SEP]
    lengths: np.ndarray  # [N] int64 tokens per sequence
    masked_lm_positions: np.ndarray  # [M] int32 positions inside their own sequence, ascending
    masked_lm_ids: np.ndarray  # [M] int32 original token at each masked position
    num_predictions: np.ndarray  # [N] int64 masked positions per sequence
    next_sentence_labels: np.ndarray  # [N] int8, 1 when B is a random sentence

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @classmethod
    def empty(cls) -> Samples:
        dtypes = (np.int32, np.int8, np.int64, np.int32, np.int32, np.int64, np.int8)  # in field order
        return cls(*(np.zeros(0, dtype=d) for d in dtypes))

    def take(self, index: np.ndarray) -> Samples:
        """The sequences `index` (any order, repeats allowed) as a new Samples."""
        index = np.asarray(index, dtype=np.int64)
        tok = concat_ranges(offsets(self.lengths)[:-1][index], self.lengths[index])
        pred = concat_ranges(offsets(self.num_predictions)[:-1][index], self.num_predictions[index])
        return Samples(
            input_ids=self.input_ids[tok], segment_ids=self.segment_ids[tok], lengths=self.lengths[index],
            masked_lm_positions=self.masked_lm_positions[pred], masked_lm_ids=self.masked_lm_ids[pred],
            num_predictions=self.num_predictions[index], next_sentence_labels=self.next_sentence_labels[index],
        )

    def slice(self, start: int, stop: int) -> Samples:
        return self.take(np.arange(start, stop))

    @staticmethod
    def concat(parts: Sequence[Samples]) -> Samples:
        if not parts:
            return Samples.empty()
        return Samples(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(Samples)))

    def original_ids(self) -> np.ndarray:
        """[T] the token ids before masking: masked slots get their label back."""
        ids = self.input_ids.copy()
        seq = np.repeat(np.arange(len(self)), self.num_predictions)
        ids[offsets(self.lengths)[seq] + self.masked_lm_positions] = self.masked_lm_ids
        return ids


def _check_fits(samples: Samples, max_seq_length: int, max_predictions: int) -> None:
    if len(samples) and samples.lengths.max() > max_seq_length:
        raise DataPrepError(f"a sequence has {samples.lengths.max()} tokens, more than max_seq_length={max_seq_length}")
    if len(samples) and samples.num_predictions.max() > max_predictions:
        raise DataPrepError(
            f"a sequence has {samples.num_predictions.max()} predictions, more than max_predictions={max_predictions}"
        )


def to_fixed(samples: Samples, max_seq_length: int, max_predictions: int) -> dict[str, np.ndarray]:
    """The MLCommons padded arrays: [N, L] tokens, [N, P] predictions (0 = padding slot)."""
    _check_fits(samples, max_seq_length, max_predictions)
    n = len(samples)
    keep = np.arange(max_seq_length) < samples.lengths[:, None]  # [N, L]
    real = np.arange(max_predictions) < samples.num_predictions[:, None]  # [N, P]
    out = {
        "input_ids": np.zeros((n, max_seq_length), STORAGE_DTYPES["input_ids"]),
        "input_mask": keep.astype(STORAGE_DTYPES["input_mask"]),
        "segment_ids": np.zeros((n, max_seq_length), STORAGE_DTYPES["segment_ids"]),
        "masked_lm_positions": np.zeros((n, max_predictions), STORAGE_DTYPES["masked_lm_positions"]),
        "masked_lm_ids": np.zeros((n, max_predictions), STORAGE_DTYPES["masked_lm_ids"]),
        "next_sentence_labels": samples.next_sentence_labels.astype(STORAGE_DTYPES["next_sentence_labels"]),
    }
    out["input_ids"][keep] = samples.input_ids
    out["segment_ids"][keep] = samples.segment_ids
    out["masked_lm_positions"][real] = samples.masked_lm_positions
    out["masked_lm_ids"][real] = samples.masked_lm_ids
    return out


def from_fixed(arrays: dict[str, np.ndarray]) -> Samples:
    """Inverse of `to_fixed`; real tokens are where input_mask is 1, predictions where position != 0."""
    keep = arrays["input_mask"].astype(bool)
    real = arrays["masked_lm_positions"] != 0
    labels = np.asarray(arrays["next_sentence_labels"]).reshape(-1)
    return Samples(
        input_ids=arrays["input_ids"][keep].astype(np.int32), segment_ids=arrays["segment_ids"][keep].astype(np.int8),
        lengths=keep.sum(axis=1).astype(np.int64),
        masked_lm_positions=arrays["masked_lm_positions"][real].astype(np.int32),
        masked_lm_ids=arrays["masked_lm_ids"][real].astype(np.int32),
        num_predictions=real.sum(axis=1).astype(np.int64), next_sentence_labels=labels.astype(np.int8),
    )


def _split_rows(values: np.ndarray, lengths: np.ndarray, dtype: type) -> np.ndarray:
    """Object array [N] of per-row arrays, the value form of an hdf5 variable-length dataset."""
    values, bounds = values.astype(dtype), offsets(lengths).tolist()
    # fromiter keeps one object per row even when all rows have the same length
    return np.fromiter((values[a:b] for a, b in zip(bounds[:-1], bounds[1:])), dtype=object, count=lengths.shape[0])


def to_varlength(samples: Samples) -> dict[str, np.ndarray]:
    """NVIDIA's trimmed rows: object arrays of per-sequence vectors, plus the [N] labels."""
    return {
        "input_ids": _split_rows(samples.input_ids, samples.lengths, STORAGE_DTYPES["input_ids"]),
        "segment_ids": _split_rows(samples.segment_ids, samples.lengths, STORAGE_DTYPES["segment_ids"]),
        "masked_lm_positions": _split_rows(
            samples.masked_lm_positions, samples.num_predictions, STORAGE_DTYPES["masked_lm_positions"]
        ),
        "masked_lm_ids": _split_rows(samples.masked_lm_ids, samples.num_predictions, STORAGE_DTYPES["masked_lm_ids"]),
        "next_sentence_labels": samples.next_sentence_labels.astype(STORAGE_DTYPES["next_sentence_labels"]),
    }


def _join_rows(rows: np.ndarray, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((r.shape[0] for r in rows), dtype=np.int64, count=rows.shape[0])
    flat: np.ndarray = np.concatenate(list(rows)).astype(dtype) if rows.shape[0] else np.zeros(0, dtype)
    return flat, lengths


def from_varlength(arrays: dict[str, np.ndarray]) -> Samples:
    """Inverse of `to_varlength`. Row-length mismatches between keys raise DataPrepError."""
    ids, lengths = _join_rows(arrays["input_ids"], np.int32)
    seg, seg_lengths = _join_rows(arrays["segment_ids"], np.int8)
    pos, counts = _join_rows(arrays["masked_lm_positions"], np.int32)
    labels, label_counts = _join_rows(arrays["masked_lm_ids"], np.int32)
    for name, got, want in (("segment_ids", seg_lengths, lengths), ("masked_lm_ids", label_counts, counts)):
        if not np.array_equal(got, want):
            row = int(np.flatnonzero(got != want)[0])
            raise DataPrepError(f"row {row}: {name} has {got[row]} entries, expected {want[row]}")
    return Samples(ids, seg, lengths, pos, labels, counts,
                   np.asarray(arrays["next_sentence_labels"]).reshape(-1).astype(np.int8))


def to_packed(samples: Samples, packs: np.ndarray, max_seq_length: int) -> dict[str, np.ndarray]:
    """Packed rows: `packs` [R, K] holds the sample indices of each row, -1 for an empty slot.

    Slots are filled left to right; sequence j of a row starts where sequence j-1 ends, and
    its masked positions are shifted by that start. Q, the width of the prediction arrays,
    is the largest number of predictions in one row.
    """
    valid = packs >= 0  # [R, K]
    order = packs[valid]  # sample indices in row-major slot order
    if np.any(valid[:, 1:] & ~valid[:, :-1]):
        raise DataPrepError("packs must fill their slots left to right (an empty slot is followed by a full one)")
    seqs = samples.take(order)
    input_len = np.zeros(packs.shape, np.int64)
    input_len[valid] = seqs.lengths
    mlm_len = np.zeros(packs.shape, np.int64)
    mlm_len[valid] = seqs.num_predictions
    row_len, row_pred = input_len.sum(axis=1), mlm_len.sum(axis=1)
    if row_len.size and row_len.max() > max_seq_length:
        raise DataPrepError(f"a pack holds {row_len.max()} tokens, more than max_seq_length={max_seq_length}")
    width = max(int(row_pred.max()) if row_pred.size else 0, 1)
    keep = np.arange(max_seq_length) < row_len[:, None]
    real = np.arange(width) < row_pred[:, None]
    slot_start = np.cumsum(input_len, axis=1) - input_len  # [R, K] first row position of each slot
    rows = packs.shape[0]
    out = {
        "input_ids": np.zeros((rows, max_seq_length), STORAGE_DTYPES["input_ids"]),
        "segment_ids": np.zeros((rows, max_seq_length), STORAGE_DTYPES["segment_ids"]),
        "masked_lm_positions": np.zeros((rows, width), STORAGE_DTYPES["masked_lm_positions"]),
        "masked_lm_ids": np.zeros((rows, width), STORAGE_DTYPES["masked_lm_ids"]),
        "next_sentence_labels": np.full(packs.shape, -1, STORAGE_DTYPES["next_sentence_labels"]),
        "packed_input_len": input_len.astype(STORAGE_DTYPES["packed_input_len"]),
        "packed_masked_lm_len": mlm_len.astype(STORAGE_DTYPES["packed_masked_lm_len"]),
    }
    out["input_ids"][keep] = seqs.input_ids
    out["segment_ids"][keep] = seqs.segment_ids
    out["masked_lm_positions"][real] = seqs.masked_lm_positions + np.repeat(slot_start[valid], seqs.num_predictions)
    out["masked_lm_ids"][real] = seqs.masked_lm_ids
    out["next_sentence_labels"][valid] = seqs.next_sentence_labels
    return out


def from_packed(arrays: dict[str, np.ndarray]) -> tuple[Samples, np.ndarray]:
    """Inverse of `to_packed`: the sequences in row-major slot order and [S] the row of each."""
    input_len = arrays["packed_input_len"].astype(np.int64)
    mlm_len = arrays["packed_masked_lm_len"].astype(np.int64)
    valid = input_len > 0
    keep = np.arange(arrays["input_ids"].shape[1]) < input_len.sum(axis=1, keepdims=True)
    real = np.arange(arrays["masked_lm_positions"].shape[1]) < mlm_len.sum(axis=1, keepdims=True)
    slot_start = np.cumsum(input_len, axis=1) - input_len
    positions = arrays["masked_lm_positions"][real].astype(np.int64) - np.repeat(slot_start[valid], mlm_len[valid])
    samples = Samples(
        input_ids=arrays["input_ids"][keep].astype(np.int32), segment_ids=arrays["segment_ids"][keep].astype(np.int8),
        lengths=input_len[valid], masked_lm_positions=positions.astype(np.int32),
        masked_lm_ids=arrays["masked_lm_ids"][real].astype(np.int32), num_predictions=mlm_len[valid],
        next_sentence_labels=arrays["next_sentence_labels"][valid].astype(np.int8),
    )
    return samples, np.nonzero(valid)[0].astype(np.int64)
