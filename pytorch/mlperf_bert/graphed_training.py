"""`--cuda_graphs` in the trainer: packed micro-batches on static shapes, one graph per step.

The packed layout's micro-batch (train_batch_size rows of max_seq_length tokens, each row
up to K sequences and Q masked positions, K and Q read from the packed shards) becomes one
`fast_path.static_packed_batch` on the host, so every step has the same tensor shapes.
`StaticPackedStep` then runs forward + backward + LAMB step as one CUDA graph
(`fast_path.GraphedTrainStep`, learning rate and step count on the device). With
graph=False the same static step runs eagerly: how the CPU test suite checks everything
but the capture itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import fast_path
from .batch import FlatBatch, Item
from .shards import DataError, check_keys, list_shards, open_shard
from .stratified import is_stratified, stratum_dir


@dataclass(frozen=True)
class StaticShape:
    """The sizes every static packed batch of a run shares (see fast_path.static_packed_batch)."""

    rows: int  # packed rows per micro-batch
    row_len: int  # tokens per row (max_seq_length)
    max_seqs_per_row: int  # K of the packed shards
    max_predictions: int  # Q: masked positions per row

    def batch(self, items: list[Item]) -> FlatBatch:
        return fast_path.static_packed_batch(items, self.rows, self.row_len, self.max_seqs_per_row,
                                             self.max_predictions)

    def example(self) -> FlatBatch:
        return fast_path.example_static_batch(self.rows, self.row_len, self.max_seqs_per_row, self.max_predictions)


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


class StaticPackedStep:
    """One training step on a static packed batch: a CUDA graph replay, or the same step eagerly.

    Replaces the trainer's optimizer with its capturable twin (`fast_path.capturable`);
    build it after any checkpoint is loaded. Returns the step's total loss (a device tensor
    the next call overwrites: fold it into running sums before calling again).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, shape: StaticShape,
                 precision: str, graph: bool) -> None:
        self.optimizer = fast_path.capturable(optimizer)
        self.shape = shape
        self._run: Callable[[FlatBatch], fast_path.StepOutput]
        if graph:
            self._run = fast_path.GraphedTrainStep(model, self.optimizer, shape.example(), precision)
        else:
            self._run = lambda batch: fast_path.train_step(model, self.optimizer, batch, precision)

    def __call__(self, batch: FlatBatch) -> torch.Tensor:
        return self._run(batch).loss.total
