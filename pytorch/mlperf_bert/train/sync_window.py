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
from dataclasses import replace
from typing import Any, Protocol, Sequence

import torch
from torch.utils._pytree import tree_map

from .faults import Position, StepFacts, StepGuard, Verdict, too_many_skips
from ..model.fp8 import ScalingState, load_scaling_states, scaling_states
from ..optim.loss_scale import DeviceLossScaler, LossScaleReading


class Snapshot(Protocol):
    def capture(self) -> None:
        """Remembers the current training state."""
        ...

    def restore(self) -> None:
        """Writes the remembered state back."""
        ...


def cloned(value: Any) -> Any:
    """A deep copy with every tensor `clone()`d: the same as `copy.deepcopy` for plain tensors,
    and safe for tensor subclasses that deepcopy cannot copy (the dry run's fake tensors)."""
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else copy.deepcopy(x), value)


class StateDictSnapshot:
    """Model and optimizer state as cloned state dicts, for eager steps and any optimizer.

    Restoring loads them back: parameters are written in place, optimizer state tensors are
    replaced (which a captured CUDA graph would not see; `InPlaceSnapshot` is for graphs).
    An optimizer whose state does not exist yet is restored to that empty state. The delayed
    FP8 recipe's amax history, which the state dict leaves out, is kept beside it
    (`fp8.scaling_states`): a roll-back and the checkpoint after it keep the good step's scales.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self._model_state: dict[str, torch.Tensor] = {}
        self._optimizer_state: dict[str, Any] = {}
        self._scaling: dict[str, ScalingState] = {}
        self.capture()

    def capture(self) -> None:
        self._model_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self._optimizer_state = cloned(self.optimizer.state_dict())
        self._scaling = scaling_states(self.model)

    @torch.no_grad()
    def restore(self) -> None:
        self.model.load_state_dict(self._model_state)
        self.optimizer.load_state_dict(cloned(self._optimizer_state))
        load_scaling_states(self.model, self._scaling)


class InPlaceSnapshot:
    """Every tensor a step changes, copied back in place (the addresses a CUDA graph keeps).

    Weights, buffers (the delayed FP8 recipe's amax history among them), optimizer moments, device
    step counts and lr tensors, plus `extra` (the fp16 loss scaler's tensors); and whether each
    FP8 layer had a history yet, a Python flag (`fp8.scaling_states`). The optimizer's state must
    exist when it is built (`optim.capturable.capturable` creates it).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 extra: Sequence[torch.Tensor] = ()) -> None:
        self.model = model
        self._live = self._tensors(model, optimizer) + list(extra)
        self._saved = [t.clone() for t in self._live]
        self._scaling = scaling_states(model)

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
        self._scaling = scaling_states(self.model)

    @torch.no_grad()
    def restore(self) -> None:
        torch._foreach_copy_(self._live, self._saved)
        load_scaling_states(self.model, self._scaling)


class SyncWindow:
    """A `faults.Guard` that reads the device once every N steps and rolls back on a non-finite loss.

    guard: the per-step guard whose agreement (`StepGuard.agree`) the window's reads use.
    start: the run's position when the window opens (after any resume); None until `begin` gives it
    (the trainer builds the window before the clock and opens the data after it).
    scaler: fp16's device loss scaler, whose counts each read brings along (`Verdict.loss_scale`):
    it skips overflowing steps on the device, so a non-finite fp16 loss is not a blow-up here;
    skips in a row beyond the guard's limit end the run at the read that sees them.
    """

    def __init__(self, every: int, guard: StepGuard, snapshot: Snapshot, start: Position | None,
                 scaler: DeviceLossScaler | None = None) -> None:
        if every < 1:
            raise ValueError(f"--sync_every must be >= 1, got {every}")
        self.every, self.guard, self.snapshot, self.scaler = every, guard, snapshot, scaler
        self._bad = torch.zeros((), dtype=torch.bool, device=guard.device)
        self.good = copy.deepcopy(start)

    def begin(self, start: Position) -> None:
        """The position the window opens at: where a roll-back before the first read returns to."""
        self.good = copy.deepcopy(start)

    def check_loss(self, loss: torch.Tensor, nonfinite_gradient: torch.Tensor | None = None) -> Verdict:
        """Folds this step's loss and gradient flag into the window's flag (queued kernels, no read)."""
        self.guard.last_loss = loss.detach()  # read with the window's agreement
        if self.guard.loss_checked:
            self._bad |= ~torch.isfinite(loss.detach().float())
        if nonfinite_gradient is not None:
            self._bad |= nonfinite_gradient > 0
        return Verdict()

    def after_step(self, facts: StepFacts) -> Verdict:
        """Every N steps (or when `facts.read_now`): the agreement, and a roll-back if a loss was not finite.

        A verdict with a non-finite loss has `rolled_back_to`: weights and optimizer are
        back at that point already; the caller restores progress and data position from it.
        Steps the device loss scaler skipped are uncounted here (`facts.uncount`), before the
        position is kept, so the run's step count is exact at every read.
        """
        self.guard.after_step(replace(facts, verdict=Verdict()))  # counts skipped updates in a row
        if not (facts.read_now or facts.step % self.every == 0):
            return Verdict()
        verdict = self.guard.agree(self._bad, counters=None if self.scaler is None else self.scaler.counters())
        if verdict.loss_scale is not None:
            assert self.scaler is not None  # counters are read only with a scaler
            self.scaler.reset_counters()
            facts.uncount(verdict.loss_scale.skipped_steps)
            self._check_skips(verdict.loss_scale, facts)
        if not verdict.nonfinite_loss:
            self.snapshot.capture()
            self.good = copy.deepcopy(facts.position())
            return verdict
        self.snapshot.restore()
        self._bad.zero_()
        if self.good is None:  # a roll-back with nowhere to go must not pass for "no roll-back"
            raise RuntimeError("SyncWindow rolled back before begin() gave it the run's start position")
        return replace(verdict, rolled_back_to=self.good)

    def _check_skips(self, reading: LossScaleReading, facts: StepFacts) -> None:
        if reading.most_skips_in_a_row >= self.guard.max_consecutive_skips:
            raise too_many_skips(reading.most_skips_in_a_row, facts.step - reading.skipped_steps, facts.samples)
