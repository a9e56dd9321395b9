"""`--sync_every N`: the host reads the device once every N steps, not once per step.

By default every step agrees on its verdict (`faults.StepGuard`: non-finite loss, stop
signal, time-based checkpoint) before the update: one device-to-host read in the middle of
every step. With N > 1, and always for a CUDA-graphed step (whose update is inside the
graph), the update comes first and the check later: each step only folds "was the loss
finite" into a device flag, and every N steps the ranks agree once.

The promise of `docs/FAULTS.md` still holds, that a non-finite loss never reaches the
weights a checkpoint keeps: the window holds a copy of the training state at the last read
that found every loss finite (weights, optimizer state, progress and data position) and
rolls back to it before the run stops. A stop signal or a time-based checkpoint waits for
the next read, at most N - 1 steps later. Cost: one copy of the weights and optimizer
state in device memory, refreshed every N steps (for BERT-Large about 4 GB, a few
milliseconds on an H200, i.e. well under 1 % of N steps for N >= 10).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .faults import StepGuard, Verdict


class Snapshot(Protocol):
    def capture(self) -> None:
        """Remembers the current training state."""
        ...

    def restore(self) -> None:
        """Writes the remembered state back."""
        ...


class StateDictSnapshot:
    """Model and optimizer state as cloned state dicts, for eager steps and any optimizer.

    Restoring loads them back: parameters are written in place, optimizer state tensors are
    replaced (which a captured CUDA graph would not see; `InPlaceSnapshot` is for graphs).
    An optimizer whose state does not exist yet is restored to that empty state.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self._model_state: dict[str, torch.Tensor] = {}
        self._optimizer_state: dict[str, Any] = {}
        self.capture()

    def capture(self) -> None:
        self._model_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self._optimizer_state = copy.deepcopy(self.optimizer.state_dict())

    @torch.no_grad()
    def restore(self) -> None:
        self.model.load_state_dict(self._model_state)
        self.optimizer.load_state_dict(copy.deepcopy(self._optimizer_state))


class InPlaceSnapshot:
    """Every tensor a step changes, copied back in place (the addresses a CUDA graph keeps).

    Weights, buffers, optimizer moments, device step counts and lr tensors. The optimizer's
    state must exist when it is built (`fast_path.capturable` creates it).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._live = self._tensors(model, optimizer)
        self._saved = [t.clone() for t in self._live]

    @staticmethod
    def _tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        tensors = [p.detach() for p in model.parameters()] + list(model.buffers())
        for group in optimizer.param_groups:
            tensors += [v for v in group.values() if isinstance(v, torch.Tensor)]
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return tensors

    @torch.no_grad()
    def capture(self) -> None:
        torch._foreach_copy_(self._saved, self._live)

    @torch.no_grad()
    def restore(self) -> None:
        torch._foreach_copy_(self._live, self._saved)


@dataclass(frozen=True)
class GoodPoint:
    """Progress and data position at the last read that found every loss finite."""

    train_state: dict
    data_state: dict


class SyncWindow:
    """Non-finite losses collected on the device; one agreement and one host read every N steps."""

    def __init__(self, every: int, guard: StepGuard, snapshot: Snapshot, train_state: dict,
                 data_state: dict) -> None:
        if every < 1:
            raise ValueError(f"--sync_every must be >= 1, got {every}")
        self.every, self.guard, self.snapshot = every, guard, snapshot
        self._bad = torch.zeros((), dtype=torch.bool, device=guard.device)
        self.good = GoodPoint(copy.deepcopy(train_state), copy.deepcopy(data_state))

    def observe(self, loss: torch.Tensor) -> None:
        """Folds this step's loss into the flag (a queued kernel, no read)."""
        self._bad |= ~torch.isfinite(loss.detach().float())

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def agree(self, stop_signal: int, checkpoint_due: bool) -> Verdict:
        """Collective, every rank at the same step: the window's verdict (the one host read)."""
        return self.guard.agree(self._bad, stop_signal, checkpoint_due)

    def mark_good(self, train_state: dict, data_state: dict) -> None:
        """After a verdict without a non-finite loss: this is the new point to roll back to."""
        self.snapshot.capture()
        self.good = GoodPoint(copy.deepcopy(train_state), copy.deepcopy(data_state))

    def roll_back(self) -> GoodPoint:
        """Weights and optimizer back to the last good point; returns its progress and data position."""
        self.snapshot.restore()
        self._bad.zero_()
        return self.good
