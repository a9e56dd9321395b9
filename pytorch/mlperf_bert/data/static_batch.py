"""Packed rows on static shapes: what `--cuda_graphs` feeds its captured step.

The packed layout's micro-batch (train_batch_size rows of max_seq_length tokens, each row
up to K sequences and Q masked positions, K and Q read from the packed shards) becomes one
`static_packed_batch` on the host, so every step has the same tensor shapes and one CUDA
graph serves every batch. Padding tokens form their own dummy sequences, empty sequences pad
`cu_seqlens`, ignored labels pad the predictions: the loss and its gradients equal those of
the flat batch of the same rows. The packing itself (rows from sequences) is data_prep's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .batch import IGNORE_INDEX, FlatBatch, Item, Sample
from .shards import DataError, check_keys, list_shards, open_shard
from .stratified import is_stratified, stratum_dir

# F.cross_entropy's default ignore_index: labels of padded predictions and NSP slots.


def _check_static_rows(items: Sequence[Item], rows: int, row_len: int, max_seqs: int, max_predictions: int) -> None:
    if not any(items):
        raise ValueError("a static packed batch needs at least one sequence")
    if len(items) > rows:
        raise ValueError(f"{len(items)} packed rows do not fit a static batch of rows={rows}: raise rows "
                         "to the per-step pack count (--train_batch_size in the packed layout)")
    for r, item in enumerate(items):
        predictions = sum(s.masked_lm_positions.shape[0] for s in item)
        if len(item) > max_seqs:
            raise ValueError(f"packed row {r} holds {len(item)} sequences, more than max_seqs_per_row={max_seqs}")
        if sum(s.length for s in item) > row_len:
            raise ValueError(f"packed row {r} holds {sum(s.length for s in item)} tokens, more than row_len={row_len}")
        if predictions > max_predictions:
            raise ValueError(f"packed row {r} has {predictions} masked positions, more than max_predictions="
                             f"{max_predictions}: raise it to the widest row (the packed shards' Q)")


@dataclass
class _RowLayout:
    """Host arrays of a static batch while it is filled row by row."""

    input_ids: np.ndarray  # [T]
    segment_ids: np.ndarray  # [T]
    position_ids: np.ndarray  # [T]
    seqlens: list[int]  # non-empty sequences in token order: real ones and per-row padding
    nsp: list[int]  # one label per entry of seqlens (IGNORE_INDEX for padding)
    masked_positions: list[np.ndarray]
    masked_ids: list[np.ndarray]

    def place(self, sample: Sample, start: int) -> None:
        n = sample.length
        self.input_ids[start : start + n] = sample.input_ids
        self.segment_ids[start : start + n] = sample.segment_ids
        self.position_ids[start : start + n] = np.arange(n)
        self.seqlens.append(n)
        self.nsp.append(sample.next_sentence_label)
        self.masked_positions.append(sample.masked_lm_positions.astype(np.int64) + start)
        self.masked_ids.append(sample.masked_lm_ids.astype(np.int64))

    def place_row(self, item: Item, row_start: int, row_len: int) -> None:
        """The row's sequences left to right, then its tail as one dummy sequence."""
        offset = row_start
        for sample in item:
            self.place(sample, offset)
            offset += sample.length
        tail = row_start + row_len - offset
        if tail:  # pad tokens: id 0, position 0; a sequence of their own, so nothing attends to them
            self.seqlens.append(tail)
            self.nsp.append(IGNORE_INDEX)


def _padded(parts: list[np.ndarray], size: int, fill: int) -> torch.Tensor:
    values = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    out = np.full(size, fill, dtype=np.int64)
    out[: values.shape[0]] = values
    return torch.from_numpy(out)


def static_packed_batch(items: Sequence[Item], rows: int, row_len: int, max_seqs_per_row: int,
                        max_predictions: int) -> FlatBatch:
    """Packed rows as a FlatBatch whose shapes depend only on the four sizes.

    Shapes: T = rows * row_len tokens; S = rows * (max_seqs_per_row + 1) sequence slots,
    cu_seqlens [S+1]; M = rows * max_predictions predictions; max_seqlen = row_len.
    Row r owns tokens [r*row_len, (r+1)*row_len): its sequences, then its unused tail as
    one dummy sequence (a missing row is one dummy sequence of row_len tokens). A row thus
    needs up to max_seqs_per_row + 1 slots; the slots left over are empty sequences at the
    front of cu_seqlens (zero lengths starting at token 0, so every slot's [CLS] index is
    a valid token). Dummy and empty slots have NSP label IGNORE_INDEX, padded predictions
    point at token 0 with label IGNORE_INDEX: the loss, its gradients and `metrics.StepMetrics` equal
    those of `flatten_items(items)`. `row_len` is set, so attention runs row by row
    (`attention.row_attention`).
    """
    _check_static_rows(items, rows, row_len, max_seqs_per_row, max_predictions)
    t = rows * row_len
    layout = _RowLayout(np.zeros(t, np.int64), np.zeros(t, np.int64), np.zeros(t, np.int64), [], [], [], [])
    for r in range(rows):
        layout.place_row(items[r] if r < len(items) else (), r * row_len, row_len)
    slots = rows * (max_seqs_per_row + 1)
    empty = slots - len(layout.seqlens)
    lengths = np.concatenate([np.zeros(empty, np.int64), np.asarray(layout.seqlens, np.int64)])
    cu = np.zeros(slots + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    m = rows * max_predictions
    return FlatBatch(
        input_ids=torch.from_numpy(layout.input_ids),
        segment_ids=torch.from_numpy(layout.segment_ids),
        position_ids=torch.from_numpy(layout.position_ids),
        cu_seqlens=torch.from_numpy(cu),
        max_seqlen=row_len,
        masked_positions=_padded(layout.masked_positions, m, 0),
        masked_lm_ids=_padded(layout.masked_ids, m, IGNORE_INDEX),
        next_sentence_labels=_padded([np.full(empty, IGNORE_INDEX), np.asarray(layout.nsp, np.int64)], slots,
                                     IGNORE_INDEX),
        row_len=row_len,
    )


def pack_rows(items: Sequence[Item], row_len: int, max_seqs_per_row: int, max_predictions: int) -> list[Item]:
    """The sequences of `items` packed into rows of at most row_len tokens, max_seqs_per_row sequences and
    max_predictions masked positions (every sequence alone must fit; ValueError names one that does not).

    Longest first, each row then takes the shortest sequences left while they fit: one pass over the
    sorted lengths. For sets scored as a whole (the eval set), where order does not matter.
    """
    samples = sorted((s for item in items for s in item), key=lambda s: s.length)
    for s in samples:
        if s.length > row_len or s.masked_lm_positions.shape[0] > max_predictions:
            raise ValueError(f"a sequence of {s.length} tokens and {s.masked_lm_positions.shape[0]} masked positions "
                             f"does not fit a row of {row_len} tokens and {max_predictions} predictions")
    rows: list[Item] = []
    low, high = 0, len(samples) - 1
    while low <= high:
        row, tokens, predictions = [samples[high]], samples[high].length, samples[high].masked_lm_positions.shape[0]
        high -= 1
        while low <= high and len(row) < max_seqs_per_row:
            short = samples[low]
            if tokens + short.length > row_len or predictions + short.masked_lm_positions.shape[0] > max_predictions:
                break
            row.append(short)
            tokens, predictions = tokens + short.length, predictions + short.masked_lm_positions.shape[0]
            low += 1
        rows.append(tuple(row))
    return rows


def example_static_batch(rows: int, row_len: int, max_seqs_per_row: int, max_predictions: int) -> FlatBatch:
    """A static packed batch of these sizes holding one synthetic sequence.

    For capturing a CUDA graph before any training data is read (at init, before
    run_start): `cuda_graphs.capture` restores the weights after capture, so the content of
    the example never reaches the model.
    """
    placeholder = Sample(np.zeros(row_len, np.int64), np.zeros(row_len, np.int64), np.array([1]), np.array([0]), 0)
    return static_packed_batch([(placeholder,)], rows, row_len, max_seqs_per_row, max_predictions)


@dataclass(frozen=True)
class StaticShape:
    """The sizes every static packed batch of a run shares (see static_packed_batch)."""

    rows: int  # packed rows per micro-batch
    row_len: int  # tokens per row (max_seq_length)
    max_seqs_per_row: int  # K of the packed shards
    max_predictions: int  # Q: masked positions per row

    def batch(self, items: Sequence[Item]) -> FlatBatch:
        return static_packed_batch(items, self.rows, self.row_len, self.max_seqs_per_row, self.max_predictions)

    def example(self) -> FlatBatch:
        return example_static_batch(self.rows, self.row_len, self.max_seqs_per_row, self.max_predictions)


def _first_shard(input_dir: str) -> Path:
    folder = stratum_dir(input_dir, 0) if is_stratified(input_dir) else Path(input_dir)
    return list_shards(folder)[0]


def packed_shape(input_dir: str, rows: int, row_len: int) -> StaticShape:
    """K and Q from the first packed shard's column counts (packed_input_len, masked_lm_positions)."""
    path = _first_shard(input_dir)
    with open_shard(path) as handle:
        if "packed_input_len" not in handle:
            raise DataError(f"{path}: not a packed shard (no packed_input_len); --cuda_graphs needs "
                            "--input_layout packed with shards from `data_prep/prepare.py pack`")
        check_keys(handle)
        k = int(handle["packed_input_len"].shape[1])
        q = int(handle["masked_lm_positions"].shape[1])
        width = int(handle["input_ids"].shape[1])
    if width > row_len:
        raise DataError(f"{path}: rows are {width} tokens wide, more than --max_seq_length {row_len}")
    return StaticShape(rows, row_len, k, q)
