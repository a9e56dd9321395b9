"""run_pretraining.py with test instruments, for the fault tests (resume, preemption, lost rank, NaN).

    python -m tests.harness.workers.instrumented_trainer [--record DIR] [--step_sleep S]
                                                          [--nan_at_step N --nan_rank R] -- FLAGS

--record DIR   each rank appends one JSON line per training step to DIR/losses_rank<R>.jsonl
               ({"step", "samples", "loss"}; the loss as the exact float) and writes its pid to
               DIR/pid_rank<R> before training starts;
--step_sleep S sleeps S seconds after every step (an idle wait that leaves time to send a signal);
--nan_at_step  makes the loss of that training step (1-based) NaN on rank --nan_rank (default 0);
--crash_at_step N raises an unexpected RuntimeError after training step N on rank --crash_rank (a
               bug, not a stop of the trainer's own: the process exits 1 with a traceback).

The instruments are hooks (`mlperf_bert.hooks.events.Hook`) handed to run_pretraining.main: a recorder
at every step's end, and a fault that makes the model's masked-LM logits NaN in one training
forward. The trainer itself is unchanged. The exit code is run_pretraining.main's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mlperf_bert import main as run_pretraining
from mlperf_bert.train.faults import StopRequest
from mlperf_bert.hooks.events import Hook, RunStart, StepEnd


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class StepRecorder(Hook):
    """One JSON line per step with the exact loss; sleeps after each step."""

    def __init__(self, directory: Path, sleep_s: float) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"pid_rank{_rank()}").write_text(str(os.getpid()))
        self.directory, self.sleep_s = directory, sleep_s

    def step_end(self, event: StepEnd) -> None:
        # The rank when the step runs: trainer_runs.py sets a run's variables after building its hooks.
        with (self.directory / f"losses_rank{_rank()}.jsonl").open("a") as f:
            f.write(json.dumps({"step": event.step, "samples": event.samples, "loss": float(event.loss)}) + "\n")
        time.sleep(self.sleep_s)


class NaNLoss(Hook):
    """Makes one training forward's masked-LM logits NaN on one rank (so that step's loss is NaN)."""

    def __init__(self, at_step: int, rank: int) -> None:
        self.at_step, self.rank, self.forwards = at_step, rank, 0

    def run_start(self, event: RunStart) -> None:
        assert event.model is not None, "the trainer hands its model to run_start"
        event.model.register_forward_hook(self._poison)

    def _poison(self, module: torch.nn.Module, inputs: Any, output: Any) -> Any:
        if not module.training:  # evals do not count
            return output
        self.forwards += 1  # one forward per micro-batch; the fault tests use one micro-batch per step
        if self.forwards != self.at_step or _rank() != self.rank:
            return output
        return dataclasses.replace(output, mlm_logits=output.mlm_logits * math.nan)


class Crash(Hook):
    """Raises an exception the trainer does not expect after one training step on one rank."""

    def __init__(self, at_step: int, rank: int) -> None:
        self.at_step, self.rank = at_step, rank

    def step_end(self, event: StepEnd) -> None:
        if event.step == self.at_step and _rank() == self.rank:
            raise RuntimeError(f"injected crash after step {event.step} on rank {self.rank}")


def hooks_of(instruments: list[str]) -> list[Hook]:
    """The hooks the instrument flags (the module docstring's, before `--`) ask for."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--record", type=Path)
    parser.add_argument("--step_sleep", type=float, default=0.0)
    parser.add_argument("--nan_at_step", type=int)
    parser.add_argument("--nan_rank", type=int, default=0)
    parser.add_argument("--crash_at_step", type=int)
    parser.add_argument("--crash_rank", type=int, default=0)
    args = parser.parse_args(instruments)
    hooks: list[Hook] = []
    if args.record is not None:
        hooks.append(StepRecorder(args.record, args.step_sleep))
    if args.nan_at_step is not None:
        hooks.append(NaNLoss(args.nan_at_step, args.nan_rank))
    if args.crash_at_step is not None:
        hooks.append(Crash(args.crash_at_step, args.crash_rank))
    return hooks


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--")
    return run_pretraining.main(argv[split + 1:], stop=StopRequest().install(), hooks=hooks_of(argv[:split]))


if __name__ == "__main__":
    run_pretraining.exit_now(main())
