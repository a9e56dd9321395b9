"""One training step: the `Step` interface and its two implementations.

A step takes one optimizer step's micro-batches (already on the device) and the learning
rate, and returns a `StepResult`. Every caller (the trainer, the tests, the throughput
benchmark) runs one of these two classes, so what they measure is what the trainer runs:

- `EagerStep`: forward + backward per micro-batch (DDP's all-reduce on the last one only),
  the guard's verdict, then the update, op by op.
- `GraphedStep`: the same for static packed micro-batches, captured once as a CUDA graph
  (`cuda_graphs.capture`) and replayed; one rank or many, any accumulation, any precision.

The update (`apply_update`) is shared. It decides on the host only where the guard is a
per-step `faults.StepGuard` (its verdict may skip the update) or fp16 runs on
`torch.amp.GradScaler`; with a device loss scaler (`loss_scale.DeviceLossScaler`: fp16 under
a sync window or a graph) every decision stays on the device.

What a Step must do, and must not:
- It owns the optimizer it steps (`step.optimizer`; `GraphedStep` steps a capturable twin)
  and writes the learning rate itself, so a graph can read it from a device tensor (a
  capturable optimizer given the schedule computes it from its own device step count).
- It applies at most one update and leaves gradients cleared for the next call.
- It does not count steps or samples, read data, log, or checkpoint: the trainer does.
- Under a sync window nothing is read on the host (no `.item()`, no `bool(tensor)`): the loss
  and the clipping hooks' non-finite flag go to the window's device flag, and a device-scaled
  fp16 step reports `applied=True` until the window's read uncounts the skipped ones.
- The returned tensors may be static buffers that the next call overwrites: fold them into
  running sums (`metrics.StepMetrics`) before calling again.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from ..data.batch import FlatBatch, map_tensors
from ..optim.clipping import ClipHandle
from .cuda_graphs import capture, copy_batch, require_graphable
from .faults import Guard, Verdict
from ..optim.loss_scale import DeviceLossScaler, LossScaler
from ..model.bert import PretrainingLoss, PretrainingOutput, pretraining_loss
from ..model.precision import autocast
from ..optim.schedule import set_lr
from ..optim.sharded import ShardedKernels


@dataclass
class StepOutput:
    """One micro-batch's losses and model output."""

    loss: PretrainingLoss
    output: PretrainingOutput


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor  # mean total loss over the step's micro-batches: a detached device scalar, not read
    applied: bool  # False when the update was skipped (fp16 overflow, or a non-finite loss caught before it);
    # True for a device-scaled step, whose skips a sync window's read uncounts later
    verdict: Verdict  # the guard's verdict taken before the update (empty when the guard only folds a flag)
    last: StepOutput  # the last micro-batch's output, for on-device metrics


class Step(Protocol):
    optimizer: torch.optim.Optimizer

    def __call__(self, micro_batches: Iterable[FlatBatch], lr: float) -> StepResult:
        """One optimizer step over `micro_batches` at learning rate `lr` (module docstring)."""
        ...


def forward_backward(module: torch.nn.Module, batch: FlatBatch, precision: str, accumulation: int = 1,
                     cache_enabled: bool = True, scaler: LossScaler | None = None) -> StepOutput:
    """Forward, loss and backward of one micro-batch: the gradient of loss.total / accumulation."""
    with autocast(batch.input_ids.device, precision, cache_enabled):
        output = module(batch)
        loss = pretraining_loss(output, batch)
    share = loss.total / accumulation
    (scaler.scale(share) if scaler is not None else share).backward()
    return StepOutput(loss, output)


def accumulate(module: torch.nn.Module, micro_batches: Iterable[FlatBatch], precision: str, accumulation: int,
               scaler: LossScaler | None = None, cache_enabled: bool = True) -> tuple[torch.Tensor, StepOutput]:
    """Forward + backward of a step's micro-batches: their mean loss (a device scalar) and the last output.

    module: the model, or its DDP wrapper, which all-reduces in the last backward only (the
    earlier ones accumulate locally under `no_sync`, so clipping sees the step's whole gradient).
    """
    loss_sum: torch.Tensor | None = None
    last: StepOutput | None = None
    count = 0
    for count, batch in enumerate(micro_batches, start=1):
        ddp = module if isinstance(module, DistributedDataParallel) else None
        with nullcontext() if count == accumulation or ddp is None else ddp.no_sync():
            last = forward_backward(module, batch, precision, accumulation, cache_enabled, scaler)
        share = last.loss.total.detach() / accumulation
        loss_sum = share if loss_sum is None else loss_sum + share
    if count != accumulation or loss_sum is None or last is None:
        raise ValueError(f"a step takes {accumulation} micro-batches (gradient accumulation), got {count}")
    return loss_sum, last


def nonfinite_gradient(clip: ClipHandle | None, scaler: LossScaler | None) -> torch.Tensor | None:
    """The clipping hooks' flag for the guard to agree on; None where nobody else must (no hook, or
    a device scaler, which agrees on it on the device and skips the step itself)."""
    if clip is None or isinstance(scaler, DeviceLossScaler):
        return None
    return clip.local_nonfinite()


def _agreed_hook_flag(optimizer: torch.optim.Optimizer, clip: ClipHandle | None) -> torch.Tensor | None:
    """The clipping hooks' non-finite flag agreed on the device, for a device scaler's skip.

    A sharded optimizer agrees on it inside its own first collective (no extra all-reduce) and
    hands the result to the scaler itself (`loss_scale.DeviceLossScaler.step`).
    """
    if clip is None:
        return None
    if isinstance(optimizer, ShardedKernels):
        optimizer.fold_flag(clip.local_nonfinite())
        return None
    return clip.nonfinite_flag()


def apply_update(optimizer: torch.optim.Optimizer, verdict: Verdict, scaler: LossScaler | None,
                 clip: ClipHandle | None) -> bool:
    """The update after the guard's verdict; False when the host knows it was skipped.

    A device scaler skips on the device (found-inf, or the hooks' flag agreed on the device)
    and returns True: the skip is counted at the next sync window read.
    """
    if isinstance(scaler, DeviceLossScaler):
        scaler.step(optimizer, also_skip=_agreed_hook_flag(optimizer, clip))
        scaler.update()
        return True
    if verdict.nonfinite_loss or verdict.nonfinite_gradient:
        if scaler is not None and verdict.nonfinite_gradient:
            scaler.update(scaler.get_scale() * scaler.get_backoff_factor())
        return False
    if scaler is None:
        optimizer.step()
        return True
    scale_before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return scaler.get_scale() >= scale_before


class EagerStep:
    """The step run op by op: any precision, any number of micro-batches, one or many ranks.

    module: the model, or its DDP wrapper (all-reduce on the last micro-batch only).
    accumulation: micro-batches per step (each call takes exactly this many, read one at a
    time, so the next one is built on the host while the device runs the current one).
    guard: decides before the update (None: every update is applied, e.g. in a benchmark).
    scaler: fp16's loss scaler (a `DeviceLossScaler` needs a capturable optimizer).
    clip: the clipping hooks of `clipping.apply_clip_mode`.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: str,
                 accumulation: int = 1, guard: Guard | None = None, scaler: LossScaler | None = None,
                 clip: ClipHandle | None = None) -> None:
        self.module, self.optimizer, self.precision = module, optimizer, precision
        self.accumulation, self.guard, self.scaler, self.clip = accumulation, guard, scaler, clip
        if clip is not None and isinstance(scaler, DeviceLossScaler):
            clip.set_loss_scale(scaler.scale_tensor)  # the live device value, read by the hooks' kernels

    def __call__(self, micro_batches: Iterable[FlatBatch], lr: float) -> StepResult:
        if self.clip is not None and isinstance(self.scaler, torch.amp.GradScaler):
            self.clip.set_loss_scale(self.scaler.get_scale())
        loss, last = accumulate(self.module, micro_batches, self.precision, self.accumulation, self.scaler)
        # Before the update, so a non-finite loss never reaches the weights (faults.StepGuard).
        flag = nonfinite_gradient(self.clip, self.scaler)
        verdict = self.guard.check_loss(loss, flag) if self.guard is not None else Verdict()
        set_lr(self.optimizer, lr)
        applied = apply_update(self.optimizer, verdict, self.scaler, self.clip)
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, applied, verdict, last)


@dataclass(frozen=True)
class _Captured:
    """What the captured step returns: static tensors every replay overwrites."""

    loss: torch.Tensor
    last: StepOutput
    nonfinite_gradient: torch.Tensor | None


class GraphedStep:
    """Forward + backward (+ all-reduce and clipping) + update of static micro-batches, as one CUDA graph.

    Many ranks: the graph holds the DDP-wrapped model's whole step, the gradient all-reduce
    included, as in PyTorch's documented whole-network capture with DDP (NCCL >= 2.9.6,
    `TORCH_NCCL_ASYNC_ERROR_HANDLING=0` before the process group starts, 11 eager warm-up
    iterations; `cuda_graphs.capture`). Chosen over a distributed optimizer that reduce-scatters
    inside its step (NVIDIA's DistributedFusedLAMB) because the gradient exchange, the
    clipping comm hooks of every `--clip_mode` (bucket-wise too) and the LAMB arithmetic are
    then the eager step's own, so the graphed step is the eager one replayed, not a second
    implementation; the hooks run their Python once, at capture, and only their kernels and
    all-reduces are replayed. With `--distributed_optimizer` the optimizer is the sharded one
    (`optim/sharded.py`): the hooks then hand each bucket, unreduced, to its block-wise
    reduce-scatters as the backward produces it, and those, its partial-norm all-reduces and
    all-gathers are captured in the same graph. Their non-finite
    flag stays on the device: agreed in the graph
    for a device scaler, or folded into the sync window's flag. Bucket-wise clipping divides
    by DDP's settled bucket count from the first real step on (the warm-up settles it), where
    an eager run's first two steps still see the layout DDP built at construction.

    module: the model, or its DDP wrapper. optimizer: a `optim.capturable.capturable` one. examples:
    one static batch per micro-batch (`static_batch.example_static_batch`), which fix the
    shapes; their content never reaches the weights (the capture undoes its warm-up). Build
    it after any checkpoint is loaded. Dropout draws new numbers on every replay. The update
    always runs (a device scaler may undo it on the device); the guard only folds the loss.
    scaler: a `DeviceLossScaler`, required for fp16. Off a GPU the same step runs uncaptured
    (`cuda_graphs.Replay`), which is how its arithmetic is tested on the CPU.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, examples: Sequence[FlatBatch],
                 precision: str = "bf16", guard: Guard | None = None, scaler: DeviceLossScaler | None = None,
                 clip: ClipHandle | None = None, warmup_steps: int | None = None) -> None:
        device = next(module.parameters()).device
        require_graphable(precision, optimizer, scaler is not None)
        self.module, self.optimizer, self.precision = module, optimizer, precision
        self.guard, self.scaler, self.clip = guard, scaler, clip
        self.static = [map_tensors(example, lambda t: t.to(device).clone()) for example in examples]
        if clip is not None and scaler is not None:
            clip.set_loss_scale(scaler.scale_tensor)
        extra = () if scaler is None else scaler.tensors()
        self.replay = capture(self._captured, module, optimizer, extra, warmup_steps)

    def _captured(self) -> _Captured:
        loss, last = accumulate(self.module, self.static, self.precision, len(self.static), self.scaler,
                                cache_enabled=False)
        flag = nonfinite_gradient(self.clip, self.scaler)
        apply_update(self.optimizer, Verdict(), self.scaler, self.clip)
        return _Captured(loss, last, flag)

    def __call__(self, micro_batches: Iterable[FlatBatch], lr: float) -> StepResult:
        batches = list(micro_batches)
        if len(batches) != len(self.static):
            raise ValueError(f"a step takes {len(self.static)} micro-batches (gradient accumulation), got "
                             f"{len(batches)}")
        set_lr(self.optimizer, lr)
        for static, batch in zip(self.static, batches):
            copy_batch(static, batch)
        out = self.replay()
        verdict = self.guard.check_loss(out.loss, out.nonfinite_gradient) if self.guard is not None else Verdict()
        return StepResult(out.loss, True, verdict, out.last)
