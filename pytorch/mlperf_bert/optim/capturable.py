"""Optimizers whose whole step can be replayed from a CUDA graph.

- `device_lr`: each group's learning rate as a 0-dim device tensor that `schedule.set_lr`
  fills in place, so a replayed graph reads the new value.
- `capturable`: the graph-safe twin of a `ForeachLamb` / `ForeachAdamW`, sharded or not (the same
  fused passes, `fused.py`) whose step counter and bias corrections live on the device too.
  Given the run's schedule it also computes its learning rate from that device step count,
  so an fp16 step skipped on the device (`loss_scale.DeviceLossScaler`) advances neither.

Used by `train/step.GraphedStep` and by the device loss scaler under a sync window.
"""

from __future__ import annotations

from typing import Any

import torch

from .optimizers import ForeachAdamW, ForeachKernels, ForeachLamb
from .schedule import LRSchedule
from .sharded import ShardedAdamW, ShardedKernels, ShardedLamb


def device_lr(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Replaces each group's float lr with a 0-dim float32 tensor on `device`.

    `schedule.set_lr` then fills it in place (a queued kernel, no sync), and a captured
    CUDA graph reads the new value on every replay.
    """
    for group in optimizer.param_groups:
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            group["lr"] = lr.to(device=device, dtype=torch.float32)
        else:
            group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)


class DeviceStepCount(ForeachKernels):
    """Keeps each group's step count as a device tensor and computes bias corrections there.

    The host-side count of `ForeachLamb` is a Python int: a CUDA graph would bake the bias
    corrections of the captured step into every replay. Here `step` is a float64 0-dim
    tensor advanced by a kernel, and 1 - beta^step is evaluated on the device (float64,
    then float32, the precision the host value is used in). With a `schedule`, each group's
    lr tensor is set to `schedule.lr_tensor(step)` first: the lr of the update after `step`
    applied ones, whatever the host last wrote into it.
    """

    schedule: LRSchedule | None = None

    # The bias corrections as device tensors where the host version returns floats: the
    # fused passes take either (`fused.Hyper.op_args`).
    def _advance(self, group: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        step = self._step_tensor(group)
        if self.schedule is not None:
            group["lr"].copy_(self.schedule.lr_tensor(step))
        step.add_(1)
        beta1, beta2 = group["betas"]
        return (1.0 - torch.pow(beta1, step)).float(), (1.0 - torch.pow(beta2, step)).float()

    @staticmethod
    def _step_tensor(group: dict[str, Any]) -> torch.Tensor:
        step = group.get("step", 0)
        if not isinstance(step, torch.Tensor):
            step = torch.tensor(float(step), dtype=torch.float64, device=group["params"][0].device)
            group["step"] = step
        return step

    def init_state(self) -> None:
        """Creates every moment buffer and step tensor now, before warm-up and capture."""
        for group in self.param_groups:
            self._step_tensor(group)
            for p in group["params"]:
                self._ensure_state(p)


class CapturableLamb(DeviceStepCount, ForeachLamb):
    """`ForeachLamb` with the step count on the device: safe to capture in a CUDA graph."""


class CapturableAdamW(DeviceStepCount, ForeachAdamW):
    """`ForeachAdamW` with the step count on the device: safe to capture in a CUDA graph."""


class CapturableShardedLamb(DeviceStepCount, ShardedLamb):
    """`sharded.ShardedLamb` with the step count on the device: its collectives are captured too."""


class CapturableShardedAdamW(DeviceStepCount, ShardedAdamW):
    """`sharded.ShardedAdamW` with the step count on the device."""


_CAPTURABLE: dict[type[torch.optim.Optimizer], type[DeviceStepCount]] = {
    ForeachLamb: CapturableLamb, ForeachAdamW: CapturableAdamW,
    ShardedLamb: CapturableShardedLamb, ShardedAdamW: CapturableShardedAdamW}


def capturable(optimizer: torch.optim.Optimizer, schedule: LRSchedule | None = None) -> DeviceStepCount:
    """The graph-safe twin of a `ForeachLamb` / `ForeachAdamW`: same groups, same state.

    The lr becomes a device tensor and all state is created eagerly. Build it after any
    checkpoint is loaded; the old optimizer object must not be stepped afterwards.
    schedule: the lr then follows the device step count (see `DeviceStepCount`); None: the
    lr is what `schedule.set_lr` last wrote.
    """
    cls = _CAPTURABLE.get(type(optimizer))
    if cls is None or not isinstance(optimizer, ForeachKernels):
        raise ValueError(
            f"{type(optimizer).__name__} cannot run inside a CUDA graph: build the optimizer with "
            "implementation 'foreach' (--optimizer_impl foreach) for --cuda_graphs"
        )
    d = optimizer.defaults
    groups = [dict(g) for g in optimizer.param_groups]
    # A sharded twin takes over the flat layout (and the moments on it) instead of building its own.
    shared: dict[str, Any] = {"shards": optimizer.shards} if isinstance(optimizer, ShardedKernels) else {}
    twin = cls(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
               max_grad_norm=optimizer.max_grad_norm, **shared)
    twin.state.update(optimizer.state)
    twin.schedule = schedule
    device_lr(twin, groups[0]["params"][0].device)
    twin.init_state()
    return twin
