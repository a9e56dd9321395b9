"""The eval forward: masked-LM hits, predictions and loss summed on the device, eager or as a CUDA graph.

Both steps add to one float64 [3] tensor (correct, counted, loss sum) and leave the host read to
the caller, which makes it once, after the ranks' all-reduce (`trainer.evaluate`):

- `EagerEval` runs the model on each batch as it comes (any shapes).
- `GraphedEval` (`--eval_cuda_graph`) runs on static packed batches of one shape
  (`input.eval_input`, cached on the device): its forward is captured once (`prepare`, before the
  clock, after everything that re-points the weights, such as the sharded optimizer's flat
  buffer) and each batch is copied into the graph's static input and replayed; no kernel is
  launched one by one and nothing is read back per batch. Off a GPU the same function runs
  directly (`cuda_graphs.Replay`), which is how it is tested against the eager eval.

Labels of IGNORE_INDEX (the padding of a static batch) count neither as hits nor as predictions
and add no loss, so both steps score the same positions.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, Protocol, Sequence

import torch
import torch.nn.functional as F

from ..data.batch import IGNORE_INDEX, FlatBatch
from ..data.static_batch import StaticShape
from ..model.bert import BertForPreTraining
from ..model.precision import autocast
from .cuda_graphs import Replay, capture_forward, copy_batch

CORRECT, COUNTED, LOSS = range(3)
# A packed eval row holds at most this many sequences (as the packed shards' K).
EVAL_SEQS_PER_ROW = 3


def eval_shape(eval_batch_size: int, max_seq_length: int, max_predictions_per_seq: int) -> StaticShape:
    """The one shape of `--eval_cuda_graph`'s batches, from the flags alone (the graph is captured before
    the eval set may be read).

    Rows: half the eval batch size, rounded up (a packed row holds about two sequences, as the configs
    count packs). Predictions per row: one sequence's maximum plus one per further sequence, since a
    sequence's masked count is 15 % of its tokens, rounded; a sequence that would exceed it starts a
    new row (`pack_rows`), so the bound costs packing density, never correctness.
    """
    return StaticShape(math.ceil(eval_batch_size / 2), max_seq_length, EVAL_SEQS_PER_ROW,
                       max_predictions_per_seq + EVAL_SEQS_PER_ROW - 1)


def add_eval_totals(model: BertForPreTraining, batch: FlatBatch, precision: str, totals: torch.Tensor) -> None:
    """Adds the batch's masked-LM hits, counted predictions and summed loss to `totals` (float64 [3])."""
    with autocast(totals.device, precision):
        logits = model(batch).mlm_logits.float()
    labels = batch.masked_lm_ids
    counted = labels != IGNORE_INDEX
    hits = (logits.argmax(dim=-1) == labels) & counted
    loss = F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE_INDEX)
    totals += torch.stack([hits.sum(), counted.sum(), loss]).to(torch.float64)


@contextmanager
def scoring(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode (dropout off) without gradients, then the model's mode as it was."""
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(training)


class EvalStep(Protocol):
    def prepare(self) -> None:
        """Whatever must happen before the clock (a capture); nothing for the eager step."""

    def totals(self, batches: Sequence[FlatBatch]) -> torch.Tensor:
        """This rank's sums over `batches` on the device (float64 [3]: correct, counted, loss), scored in
        eval mode without gradients."""


class EagerEval:
    def __init__(self, model: BertForPreTraining, precision: str, device: torch.device) -> None:
        self.model, self.precision, self.device = model, precision, device

    def prepare(self) -> None:
        pass

    def totals(self, batches: Sequence[FlatBatch]) -> torch.Tensor:
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        with scoring(self.model):
            for batch in batches:
                add_eval_totals(self.model, batch, self.precision, totals)
        return totals


class GraphedEval:
    """The eval forward on one static shape, captured once and replayed per batch."""

    def __init__(self, model: BertForPreTraining, precision: str, device: torch.device, shape: StaticShape) -> None:
        self.model, self.precision, self.device, self.shape = model, precision, device, shape
        self._sums = torch.zeros(3, dtype=torch.float64, device=device)
        self._static: FlatBatch | None = None
        self._replay: Replay[None] | None = None

    def _forward(self) -> None:
        assert self._static is not None
        add_eval_totals(self.model, self._static, self.precision, self._sums)

    def prepare(self) -> None:
        """Captures the forward in eval mode (dropout off) on an example batch; the weights are untouched."""
        if self._replay is not None:
            return
        self._static = self.shape.example().to(self.device)
        with scoring(self.model):
            self._replay = capture_forward(self._forward, self.device)
        self._sums.zero_()  # the warm-up's and the capture's sums of the example

    def totals(self, batches: Sequence[FlatBatch]) -> torch.Tensor:
        self.prepare()
        assert self._static is not None and self._replay is not None
        self._sums.zero_()
        with scoring(self.model):  # what a GPU's graph holds already; off a GPU the forward runs here
            for batch in batches:
                copy_batch(self._static, batch)
                self._replay()
        return self._sums.clone()
