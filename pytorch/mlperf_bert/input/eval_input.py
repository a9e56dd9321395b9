"""This rank's eval batches, read once the clock runs and while the first training block trains.

The eval set is part of the dataset, so it is read after `run_start` (training_rules.adoc §11:
the clock starts before any part of the system touches the dataset). `EvalInput.start` reads it
on one background thread; the first eval waits for it only if it is not ready yet, and moves the
batches to the device once, where they stay for every later eval. A bad eval file raises its
`DataError` at that first eval.

With a static shape (`--eval_cuda_graph`) the sequences are packed into rows on that thread
(`static_batch.pack_rows`) and every batch is a static packed batch of that one shape, which the
captured eval forward reads (`train/eval_step.py`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import torch

from ..data.batch import FlatBatch, Item, flatten_items
from ..data.static_batch import StaticShape, pack_rows

EvalLoader = Callable[[], Sequence[Item]]  # this rank's eval items, read from disk


def eval_batches(items: Sequence[Item], batch_size: int, shape: StaticShape | None = None) -> list[FlatBatch]:
    """Flat host batches of `batch_size` items (the last one shorter); with `shape`, the items' sequences
    packed into rows and `shape.rows` rows per static batch (the last one padded with empty rows)."""
    if shape is None:
        return [flatten_items(items[i : i + batch_size]) for i in range(0, len(items), batch_size)]
    rows = pack_rows(items, shape.row_len, shape.max_seqs_per_row, shape.max_predictions)
    return [shape.batch(rows[i : i + shape.rows]) for i in range(0, len(rows), shape.rows)]


class EvalInput:
    """The eval batches: loaded on a background thread after `start`, on the device after the first `batches`."""

    def __init__(self, load: EvalLoader, batch_size: int, device: torch.device,
                 shape: StaticShape | None = None) -> None:
        self._load, self.batch_size, self.device, self.shape = load, batch_size, device, shape
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._on_device: list[FlatBatch] | None = None

    @classmethod
    def of(cls, items: Sequence[Item], batch_size: int, device: torch.device,
           shape: StaticShape | None = None) -> EvalInput:
        """Eval items already in memory (the dry run's, a test's)."""
        return cls(lambda: items, batch_size, device, shape)

    @property
    def started(self) -> bool:
        return self._pending is not None or self._on_device is not None

    def start(self) -> None:
        """Begins reading the eval set (once); called when the clock has started."""
        if self.started:
            return
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval-reader")
        self._pending = self._pool.submit(lambda: eval_batches(self._load(), self.batch_size, self.shape))

    def batches(self) -> list[FlatBatch]:
        """The batches on the device: waits for the reader if it is still at work; its error is raised here."""
        if self._on_device is None:
            self.start()
            assert self._pending is not None
            try:
                host = self._pending.result()
            finally:
                self.close()
            self._on_device = [batch.to(self.device) for batch in host]
        return self._on_device

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._pending = None, None
