"""Learning-rate schedule: linear warmup, then polynomial decay.

The formula is the one of the MLPerf BERT reference (`create_optimizer` in the TF reference's
optimization.py), which NVIDIA's `LinearWarmupPolyDecayScheduler` evaluates on the device.
With `step` = number of optimizer updates already applied (0 for the first update):

    warmup, while step - start_warmup_step < warmup_steps:
        lr = base_lr * (step - start_warmup_step) / warmup_steps
    decay, afterwards:
        lr = (base_lr - end_lr) * (1 - min(step, decay_steps) / decay_steps) ** power + end_lr

Things worth knowing:

* The decay is measured from step 0, not from the end of warmup: when warmup ends the decay
  is already under way, so the lr drops from ~base_lr to base_lr*(1 - w/decay_steps) at
  w = warmup_steps + start_warmup_step. A negative `start_warmup_step` starts the ramp part
  way up (at step 0 the lr is already base_lr * -start/warmup) and ends it earlier.
* NVIDIA's scheduler adds one to the step when start_warmup_step != 0 (its `offset_step`
  compensates a priming step of their trainer); this module follows the reference: the lr
  of update n is `lr_at(n)` whatever start_warmup_step is.
* `decay_steps` (default max_steps) lets the decay end before training does; from then
  on the lr stays at `end_lr`. Samsung's open-division run trained 299 steps with the decay
  over 179 and end_lr 4.945e-5 (12.6% of its base lr 3.93e-4), so the tail is not 0. Their
  scheduler also measures the decay from `warmup_steps` rather than from step 0 (the lr
  overshoots base_lr by about 14% where their shifted warmup ends); set
  `decay_start_step=warmup_steps` for that variant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LRSchedule:
    """Linear warmup + polynomial decay; all step counts are optimizer updates."""

    base_lr: float
    max_steps: int  # training steps (`opt_learning_rate_training_steps`)
    warmup_steps: int  # `opt_learning_rate_warmup_steps` / `num_warmup_steps`
    start_warmup_step: int = 0  # <= 0: shifts the warmup ramp earlier
    power: float = 1.0  # `opt_lamb_learning_rate_decay_poly_power`
    decay_steps: int | None = None  # steps over which the lr decays; None = max_steps
    end_lr: float = 0.0  # lr reached at decay_steps and held afterwards
    decay_start_step: int = 0  # step where decay progress is 0 (reference 0; Samsung warmup_steps)

    def __post_init__(self) -> None:
        if self.base_lr < 0 or self.end_lr < 0:
            raise ValueError(f"base_lr and end_lr must be >= 0, got {self.base_lr}, {self.end_lr}")
        if self.max_steps <= 0:
            raise ValueError(f"max_steps must be > 0, got {self.max_steps}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.start_warmup_step > 0:
            raise ValueError(f"start_warmup_step must be <= 0 (it moves the warmup earlier), got {self.start_warmup_step}")
        if self.power <= 0:
            raise ValueError(f"power must be > 0, got {self.power}")
        if not 0 <= self.decay_start_step < self.total_decay_steps:
            raise ValueError(f"decay_start_step must be in [0, decay_steps={self.total_decay_steps}), "
                             f"got {self.decay_start_step}")

    @property
    def total_decay_steps(self) -> int:
        steps = self.max_steps if self.decay_steps is None else self.decay_steps
        if steps <= 0:
            raise ValueError(f"decay_steps must be > 0, got {steps}")
        return steps

    @classmethod
    def from_warmup_proportion(cls, base_lr: float, max_steps: int, warmup_proportion: float,
                               **kwargs: Any) -> "LRSchedule":
        """warmup_steps = int(max_steps * warmup_proportion), as NVIDIA's run_pretraining."""
        if not 0.0 <= warmup_proportion <= 1.0:
            raise ValueError(f"warmup_proportion must be in [0, 1], got {warmup_proportion}")
        return cls(base_lr=base_lr, max_steps=max_steps, warmup_steps=int(max_steps * warmup_proportion), **kwargs)

    def in_warmup(self, step: int) -> bool:
        return step - self.start_warmup_step < self.warmup_steps

    def lr_at(self, step: int) -> float:
        """Learning rate of the update applied after `step` updates (step >= 0)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.in_warmup(step):
            return self.base_lr * (step - self.start_warmup_step) / self.warmup_steps
        span = self.total_decay_steps - self.decay_start_step
        progress = (min(step, self.total_decay_steps) - self.decay_start_step) / span
        return (self.base_lr - self.end_lr) * (1.0 - progress) ** self.power + self.end_lr

    def lr_tensor(self, step: torch.Tensor) -> torch.Tensor:
        """`lr_at` evaluated on the device from an integer step tensor (no host sync).

        For CUDA-graph capture, where the step lives on the device. float32 result.
        """
        t = step.to(torch.float64)
        warm_t = t - self.start_warmup_step
        warm = self.base_lr * warm_t / max(self.warmup_steps, 1)
        span = self.total_decay_steps - self.decay_start_step
        progress = (torch.clamp(t, max=self.total_decay_steps) - self.decay_start_step) / span
        decay = (self.base_lr - self.end_lr) * (1.0 - progress) ** self.power + self.end_lr
        return torch.where(warm_t < self.warmup_steps, warm, decay).to(torch.float32)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Writes `lr` into every param group.

    A group whose lr is a tensor (device-resident lr) is filled in place, which queues a
    device kernel and never waits for the device; otherwise the float is stored.
    """
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
