"""Hooks: small classes the training loop calls at fixed points of a run.

The loop owns the order of events; a hook owns what happens at one of them (the MLPerf log,
the progress view, periodic checkpoints, preemption, the end-of-run summary). A hook keeps its
own state and sees the run only through the events below, so each is tested alone by feeding
it events. Events carry plain numbers; the step's loss stays a device tensor that hooks do
not read (a read waits for the device): `StepEnd.verdict.loss` is the loss the guard read
together with its agreement, on the steps it agreed. `StepEnd.verdict` is what every rank
agreed on after the step (`faults.Guard`): the one input on which a hook may stop the run. `RunStart.model` lets a hook instrument the model (the fault tests make one
forward's logits NaN that way).

Order within one run:
    run_start -> (step_end ... block_end -> eval_end)* -> run_end
A hook that raises `faults.TrainingStopped` from `step_end` stops the run at that step on
every rank, so such a hook must decide the same way on every rank (an agreed verdict).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from ..train.faults import Verdict


@dataclass(frozen=True)
class RunStart:
    samples: int  # > 0 when resumed from a checkpoint
    step: int
    stop_samples: int  # the sample limit (max_steps or max_samples_termination)
    global_batch_size: int
    output_dir: Path
    resumed: bool = False
    model: torch.nn.Module | None = None  # the model being trained (None where a hook is fed by hand)
    schedule_samples: int = 0  # samples until the LR schedule ends (max_steps x global batch); 0: not known
    data_check: str = ""  # what --unverified_data checked after run_start, in words ("" when nothing)


@dataclass(frozen=True)
class StepEnd:
    step: int  # optimizer steps applied so far
    samples: int  # training sequences consumed over all ranks so far
    loss: torch.Tensor  # this step's mean loss, a detached device scalar (not read yet)
    learning_rate: float  # the rate this step used
    tokens: int  # real (non-padding) tokens this rank trained on in this step
    skipped_steps: int  # fp16 overflow steps skipped so far
    next_eval_samples: int  # where the current block ends (the next eval, or the limit)
    verdict: Verdict = Verdict()  # what every rank agreed on after this step (stop signal, checkpoint due)


@dataclass(frozen=True)
class BlockEnd:
    step: int
    samples: int


@dataclass(frozen=True)
class EvalEnd:
    step: int
    samples: int
    accuracy: float  # masked-LM accuracy over the whole eval set
    loss: float
    seconds: float  # wall time of the eval itself
    skipped_steps: int = 0  # fp16 overflow steps skipped so far


@dataclass(frozen=True)
class RunEnd:
    status: str  # "success" or "aborted"
    step: int
    samples: int
    seconds: float  # run_start to run_stop
    evals: Sequence[tuple[int, float]] = field(default_factory=tuple)  # (samples, accuracy)
    reason: str = ""  # why an aborted run stopped (limit, preempted, numeric_blowup, ...)


class Hook:
    """A no-op at every event; subclasses override the events they care about."""

    def run_start(self, event: RunStart) -> None:
        pass

    def step_end(self, event: StepEnd) -> None:
        pass

    def block_end(self, event: BlockEnd) -> None:
        pass

    def eval_end(self, event: EvalEnd) -> None:
        pass

    def run_end(self, event: RunEnd) -> None:
        pass

    def close(self) -> None:
        """Releases files and threads; called once, also when the run fails."""


class Hooks(Hook):
    """Several hooks called in order at every event."""

    def __init__(self, hooks: Sequence[Hook]) -> None:
        self.hooks = list(hooks)

    def run_start(self, event: RunStart) -> None:
        for hook in self.hooks:
            hook.run_start(event)

    def step_end(self, event: StepEnd) -> None:
        for hook in self.hooks:
            hook.step_end(event)

    def block_end(self, event: BlockEnd) -> None:
        for hook in self.hooks:
            hook.block_end(event)

    def eval_end(self, event: EvalEnd) -> None:
        for hook in self.hooks:
            hook.eval_end(event)

    def run_end(self, event: RunEnd) -> None:
        for hook in self.hooks:
            hook.run_end(event)

    def close(self) -> None:
        for hook in self.hooks:
            hook.close()
