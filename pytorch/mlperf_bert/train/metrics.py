"""Loss and masked-LM accuracy summed on the device, read every N steps (one host sync per read)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.batch import IGNORE_INDEX, FlatBatch
from .step import StepOutput


@dataclass(frozen=True)
class MetricsReading:
    steps: int
    loss: float  # mean over steps of mlm + nsp
    mlm_loss: float
    nsp_loss: float
    mlm_accuracy: float  # correct / real masked positions, over all steps read


class StepMetrics:
    """Sums loss and masked-LM accuracy on the device; `read()` is the only host sync.

    Labels equal to IGNORE_INDEX (padding of a static batch) count neither as correct nor
    as predictions.
    """

    _LOSS, _MLM, _NSP, _CORRECT, _PREDICTED, _STEPS = range(6)

    def __init__(self, device: torch.device) -> None:
        self._sums = torch.zeros(6, dtype=torch.float64, device=device)

    def update(self, step: StepOutput, batch: FlatBatch) -> None:
        labels = batch.masked_lm_ids
        valid = labels != IGNORE_INDEX
        correct = (step.output.mlm_logits.detach().argmax(dim=-1) == labels) & valid
        values = (step.loss.total.detach(), step.loss.mlm.detach(), step.loss.nsp.detach(), correct.sum(),
                  valid.sum(), torch.ones((), device=labels.device))
        self._sums += torch.stack([v.to(torch.float64) for v in values])

    def read(self) -> MetricsReading:
        """Means since the last read (one device-to-host copy), then starts a new window."""
        loss, mlm, nsp, correct, predicted, steps = self._sums.tolist()
        if steps == 0:
            raise RuntimeError("StepMetrics.read() before any update()")
        self._sums.zero_()
        return MetricsReading(int(steps), loss / steps, mlm / steps, nsp / steps, correct / max(predicted, 1.0))


