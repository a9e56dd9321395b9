"""One training step: the `Step` interface and its two implementations.

A step takes one optimizer step's micro-batches (already on the device) and the learning
rate, and returns a `StepResult`. Every caller (the trainer, the tests, the throughput
benchmark) runs one of these two classes, so what they measure is what the trainer runs:

- `EagerStep`: forward + backward per micro-batch (DDP's all-reduce on the last one only),
  the guard's verdict before the update, then the optimizer step (through the fp16 loss
  scaler and the clipping hooks' overflow agreement when there are any).
- `GraphedStep`: forward + backward + optimizer step of one static packed micro-batch,
  captured once as a CUDA graph (`cuda_graphs.capture`) and replayed.

What a Step must do, and must not:
- It owns the optimizer it steps (`step.optimizer`; `GraphedStep` steps a capturable twin)
  and writes the learning rate itself, so a graph can read it from a device tensor.
- It applies at most one update and leaves gradients cleared (None) for the next call.
- It does not count steps or samples, read data, log, or checkpoint: the trainer does.
- A graphed step reads nothing from the device on the host (no `.item()`, no `bool(tensor)`,
  no host-side loss-scaler decisions): its update runs inside the graph, and its loss goes
  to the guard's device-side flag (`faults.Guard.check_loss`), agreed on later by the
  sync window. A step that must decide on the host (fp16's overflow skip) is eager.
- The returned tensors may be static buffers that the next call overwrites: fold them into
  running sums (`metrics.StepMetrics`) before calling again.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Iterable, Protocol

import torch
from torch.nn.parallel import DistributedDataParallel

from .batch import FlatBatch
from .clipping import ClipHandle
from .cuda_graphs import capture, copy_batch, require_graphable
from .device_input import map_tensors
from .faults import Guard, Verdict
from .model import PretrainingLoss, PretrainingOutput, pretraining_loss
from .precision import autocast
from .schedule import set_lr


@dataclass
class StepOutput:
    """One micro-batch's losses and model output."""

    loss: PretrainingLoss
    output: PretrainingOutput


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor  # mean total loss over the step's micro-batches: a detached device scalar, not read
    applied: bool  # False when the update was skipped (fp16 overflow, or a non-finite loss caught before it)
    verdict: Verdict  # the guard's verdict taken before the update (empty when the guard only folds a flag)
    last: StepOutput  # the last micro-batch's output, for on-device metrics


class Step(Protocol):
    optimizer: torch.optim.Optimizer

    def __call__(self, micro_batches: Iterable[FlatBatch], lr: float) -> StepResult:
        """One optimizer step over `micro_batches` at learning rate `lr` (module docstring)."""
        ...


def forward_backward(module: torch.nn.Module, batch: FlatBatch, precision: str, accumulation: int = 1,
                     cache_enabled: bool = True, scaler: torch.amp.GradScaler | None = None) -> StepOutput:
    """Forward, loss and backward of one micro-batch: the gradient of loss.total / accumulation."""
    with autocast(batch.input_ids.device, precision, cache_enabled):
        output = module(batch)
        loss = pretraining_loss(output, batch)
    share = loss.total / accumulation
    (scaler.scale(share) if scaler is not None else share).backward()
    return StepOutput(loss, output)


class EagerStep:
    """The step run op by op: any precision, any number of micro-batches, one or many ranks.

    module: the model, or its DDP wrapper (all-reduce on the last micro-batch only).
    accumulation: micro-batches per step (each call takes exactly this many, read one at a
    time, so the next one is built on the host while the device runs the current one).
    guard: decides before the update (None: every update is applied, e.g. in a benchmark).
    scaler: fp16's loss scaler. clip: the clipping hooks of `clipping.apply_clip_mode`.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: str,
                 accumulation: int = 1, guard: Guard | None = None, scaler: torch.amp.GradScaler | None = None,
                 clip: ClipHandle | None = None) -> None:
        self.module, self.optimizer, self.precision = module, optimizer, precision
        self.accumulation, self.guard, self.scaler, self.clip = accumulation, guard, scaler, clip
        self.device = next(module.parameters()).device

    def __call__(self, micro_batches: Iterable[FlatBatch], lr: float) -> StepResult:
        loss_sum = torch.zeros((), device=self.device)
        if self.clip is not None and self.scaler is not None:
            self.clip.set_loss_scale(self.scaler.get_scale())
        count = 0
        for count, batch in enumerate(micro_batches, start=1):
            last = self._micro_step(batch, sync=count == self.accumulation)
            loss_sum += last.loss.total.detach() / self.accumulation
        if count != self.accumulation:
            raise ValueError(f"a step takes {self.accumulation} micro-batches (gradient accumulation), got {count}")
        # Before the update, so a non-finite loss never reaches the weights (faults.StepGuard).
        verdict = self.guard.check_loss(loss_sum) if self.guard is not None else Verdict()
        set_lr(self.optimizer, lr)
        applied = not verdict.nonfinite_loss and self._update()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_sum, applied, verdict, last)

    def _micro_step(self, batch: FlatBatch, sync: bool) -> StepOutput:
        # DDP all-reduces on the last micro-batch only; earlier ones accumulate locally.
        ddp = self.module if isinstance(self.module, DistributedDataParallel) else None
        with nullcontext() if sync or ddp is None else ddp.no_sync():
            return forward_backward(self.module, batch, self.precision, self.accumulation, scaler=self.scaler)

    def _update(self) -> bool:
        """Applies the update; False when a non-finite gradient (fp16 overflow) skips it on every rank."""
        if self.clip is not None and self.clip.found_nonfinite():
            if self.scaler is not None:
                self.scaler.update(self.scaler.get_scale() * self.scaler.get_backoff_factor())
            return False
        if self.scaler is None:
            self.optimizer.step()
            return True
        scale_before = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= scale_before


class GraphedStep:
    """Forward + backward + optimizer step of one static packed micro-batch, as one CUDA graph.

    optimizer: a `cuda_graphs.capturable` optimizer, its learning rate a device tensor. The
    example batch fixes the shapes (`static_batch.example_static_batch`); its content never
    reaches the weights (the capture undoes its warm-up). Build it after any checkpoint is
    loaded. Dropout draws new numbers on every replay. The update is always applied; the
    guard only folds the loss into its device flag, read later by the sync window.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, example: FlatBatch,
                 precision: str = "bf16", guard: Guard | None = None, warmup_steps: int = 3) -> None:
        device = next(model.parameters()).device
        require_graphable(device, precision, optimizer)
        self.model, self.optimizer, self.precision, self.guard = model, optimizer, precision, guard
        self.static = map_tensors(example, lambda t: t.to(device).clone())
        self.graph, self.result = capture(self._captured, model, optimizer, warmup_steps)

    def _captured(self) -> StepOutput:
        result = forward_backward(self.model, self.static, self.precision, cache_enabled=False)
        self.optimizer.step()
        return result

    def __call__(self, micro_batches: Iterable[FlatBatch], lr: float) -> StepResult:
        (batch,) = micro_batches  # --cuda_graphs steps take one micro-batch (config.TrainConfig)
        set_lr(self.optimizer, lr)
        copy_batch(self.static, batch)
        self.graph.replay()
        loss = self.result.loss.total.detach()
        verdict = self.guard.check_loss(loss) if self.guard is not None else Verdict()
        return StepResult(loss, True, verdict, self.result)
