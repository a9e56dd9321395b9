"""fp16 dynamic loss scaling with every decision on the device: no host read per step.

`DeviceLossScaler` computes what `torch.amp.GradScaler` computes (the same scale after every
step, the same skipped steps, the same weights) with three differences, all so that a step can
be replayed from a CUDA graph and a sync window (`--sync_every N`) reads the device once per N
steps instead of three times per step:

1. Skipping. GradScaler reads `found_inf` on the host and does not call `optimizer.step()` at
   all after an overflow. Here the optimizer always steps, and the step is then undone on the
   device: parameters, optimizer state tensors and the device step counts are copied aside
   before the step and written back with `torch.where(found_inf, before, after)`. The cost is
   one copy of parameters and optimizer state per step (memory traffic, no launch per tensor
   beyond a few multi-tensor kernels); the gain is a step with no branch on the host.
   The optimizer must keep its step count on the device (`optim.capturable.capturable`): a Python
   int count would advance on a skipped step and change every later bias correction (and,
   with a device schedule, the learning rate follows that count, so a skip does not advance it).
2. Counting. A skipped step does not count as a step (the MLPerf rules; `TrainState.step`).
   Applied and skipped steps, and the longest run of skips in a row, are device tensors
   advanced by the found-inf flag; a sync window reads them with its agreement (`counters()`,
   one transfer) and the trainer corrects its host counts then (`sync_window.SyncWindow`).
3. No `get_scale()` per step. `scale_tensor` is the live device value; clipping thresholds in
   scaled units must take it as a tensor.

Scale update: `torch._amp_update_scale_`, the kernel GradScaler itself calls (backoff on an
overflow, growth after `growth_interval` clean steps), so the scale sequence is bit-equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .sharded import ShardedKernels


@dataclass(frozen=True)
class LossScaleReading:
    """The scaler's counters since the last read, read on the host with a window's agreement."""

    scale: float
    applied_steps: int  # optimizer steps that changed the weights
    skipped_steps: int  # steps undone for a non-finite gradient
    most_skips_in_a_row: int  # the longest run of skipped steps (runs may start before the last read)

    @classmethod
    def from_values(cls, values: list[float]) -> "LossScaleReading":
        """From the `counters()` tensor's values, as read on the host."""
        scale, applied, skipped, in_a_row = values
        return cls(scale, int(applied), int(skipped), int(in_a_row))


def _device_step_counts(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    counts = [g.get("step") for g in optimizer.param_groups]
    tensors = [c for c in counts if isinstance(c, torch.Tensor)]
    if len(tensors) != len(counts):
        raise ValueError(f"{type(optimizer).__name__} counts steps on the host: a skipped step would still "
                         "advance its bias corrections; wrap it with optim.capturable.capturable() first")
    return tensors


def _step_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Everything an optimizer step writes: parameters, state tensors, device step counts."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = [t for p in params for t in optimizer.state.get(p, {}).values() if isinstance(t, torch.Tensor)]
    return params + state + _device_step_counts(optimizer)


class DeviceLossScaler:
    """GradScaler's arithmetic without host reads; see the module docstring for the differences.

    Per step: `scale(loss).backward()`, then `step(optimizer)`, then `update()`. Build it after
    the optimizer's state exists (`capturable` creates it), before any graph capture.
    """

    def __init__(self, device: torch.device | str, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.scale_tensor = torch.full((), init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self.applied_steps = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=device)
        self._skips_in_a_row = torch.zeros((), dtype=torch.int64, device=device)
        self._most_in_a_row = torch.zeros((), dtype=torch.int64, device=device)
        self._saved: list[torch.Tensor] | None = None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_tensor.to(loss.dtype)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the gradients by the scale in place and sets `found_inf` (GradScaler's kernel)."""
        self.found_inf.zero_()
        inv_scale = self.scale_tensor.double().reciprocal().float()
        if isinstance(optimizer, ShardedKernels):
            # Its reduce-scatter took the scaled local gradients during the backward: it unscales the
            # reduced shard, and agrees on non-finite values there (`step` below).
            optimizer.unscale_reduced(inv_scale)
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, inv_scale)

    def step(self, optimizer: torch.optim.Optimizer, also_skip: torch.Tensor | None = None) -> None:
        """Unscales, steps, and undoes the step on the device when a gradient was not finite.

        also_skip: a device flag (> 0: skip) agreed by every rank, e.g. a clipping hook's
        non-finite norm (`clipping.ClipHandle.nonfinite_flag`); it also backs the scale off.
        """
        self.unscale_(optimizer)
        if also_skip is not None:
            torch.maximum(self.found_inf, also_skip.to(self.found_inf.dtype), out=self.found_inf)
        live = _step_tensors(optimizer)  # updated in place by the step: listed once
        saved = self._buffers(live)
        states = len(optimizer.state)
        with torch.no_grad():
            torch._foreach_copy_(saved, live)
        optimizer.step()
        if len(optimizer.state) != states:
            raise RuntimeError("the optimizer created state inside step(): create it before the first scaled step")
        if isinstance(optimizer, ShardedKernels):
            # found_inf saw this rank's local gradient only; the sharded step agreed on the reduced
            # one (an inf in any rank's local gradient reaches it), so every rank skips alike.
            torch.maximum(self.found_inf, optimizer.agreed_nonfinite, out=self.found_inf)
        skip = self.found_inf > 0
        with torch.no_grad():
            for now, old in zip(live, saved):
                now.copy_(torch.where(skip, old, now))
        self._count(skip)

    def _count(self, skip: torch.Tensor) -> None:
        self.skipped_steps += skip.to(torch.int64)
        self.applied_steps += (~skip).to(torch.int64)
        self._skips_in_a_row.copy_(torch.where(skip, self._skips_in_a_row + 1, 0))
        torch.maximum(self._most_in_a_row, self._skips_in_a_row, out=self._most_in_a_row)

    def _buffers(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of the step's tensors, allocated once (stable addresses for a graph)."""
        if self._saved is None or [t.shape for t in self._saved] != [t.shape for t in like]:
            self._saved = [torch.empty_like(t) for t in like]
        return self._saved

    def update(self) -> None:
        """Backs off after an overflow, grows after `growth_interval` clean steps (on the device)."""
        torch._amp_update_scale_(self.scale_tensor, self._growth_tracker, self.found_inf, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)

    def counters(self) -> torch.Tensor:
        """[scale, applied, skipped, most skips in a row] since the last reset, float32 on the device
        (exact: the scale is a power of two, the counts stay far below 2**24).

        Not read here: a window reads it in the same transfer as its agreement
        (`LossScaleReading.from_values`), then calls `reset_counters`.
        """
        return torch.stack([self.scale_tensor.float(), self.applied_steps.float(), self.skipped_steps.float(),
                            self._most_in_a_row.float()])

    def reset_counters(self) -> None:
        """After a read: counting starts again (a run of skips in a row goes on counting)."""
        for counter in (self.applied_steps, self.skipped_steps):
            counter.zero_()
        self._most_in_a_row.copy_(self._skips_in_a_row)

    def read(self) -> LossScaleReading:
        """Counters since the last read, read on the host now, then reset (one transfer)."""
        reading = LossScaleReading.from_values(self.counters().tolist())
        self.reset_counters()
        return reading

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the scaler changes in a step: what a snapshot of the training state keeps."""
        return [self.scale_tensor, self._growth_tracker, self.found_inf, self.applied_steps, self.skipped_steps,
                self._skips_in_a_row, self._most_in_a_row]

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys, so a checkpoint reads the same either way."""
        return {"scale": float(self.scale_tensor), "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": int(self._growth_tracker)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale_tensor.fill_(state["scale"])
        self._growth_tracker.fill_(state["_growth_tracker"])
        self.growth_factor, self.backoff_factor = state["growth_factor"], state["backoff_factor"]
        self.growth_interval = state["growth_interval"]


LossScaler = torch.amp.GradScaler | DeviceLossScaler  # fp16's scaler: on the host, or on the device
