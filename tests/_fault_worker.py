"""run_pretraining.py with test instruments, for the fault tests (resume, preemption, lost rank, NaN).

    python tests/_fault_worker.py [--record DIR] [--step_sleep S] [--nan_at_step N --nan_rank R] -- FLAGS

--record DIR   each rank appends one JSON line per training step to DIR/losses_rank<R>.jsonl
               ({"step", "samples", "loss"}; the loss as the exact float) and writes its pid to
               DIR/pid_rank<R> before training starts;
--step_sleep S sleeps S seconds after every step (an idle wait that leaves time to send a signal);
--nan_at_step  makes the loss of that training step (1-based) NaN on rank --nan_rank (default 0).

The instruments wrap `mlperf_bert.trainer.train_step` and `pretraining_loss` in this process
only; the trainer itself is unchanged. The exit code is run_pretraining.main's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from mlperf_bert import main as run_pretraining
from mlperf_bert import trainer
from mlperf_bert.faults import StopRequest

REPO = Path(__file__).resolve().parents[1]


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def record_steps(directory: Path, sleep_s: float) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"pid_rank{_rank()}").write_text(str(os.getpid()))
    inner = trainer.train_step
    out = directory / f"losses_rank{_rank()}.jsonl"

    def recorded(rt, data, state):
        loss = inner(rt, data, state)
        with out.open("a") as f:
            f.write(json.dumps({"step": state.step, "samples": state.samples, "loss": float(loss)}) + "\n")
        time.sleep(sleep_s)
        return loss

    trainer.train_step = recorded


def inject_nan(at_step: int, rank: int) -> None:
    inner = trainer.pretraining_loss
    calls = [0]

    def poisoned(out, batch):
        losses = inner(out, batch)
        calls[0] += 1  # one call per micro-batch; the fault tests use one micro-batch per step
        if calls[0] == at_step and _rank() == rank:
            losses.total = losses.total * math.nan
        return losses

    trainer.pretraining_loss = poisoned


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--record", type=Path)
    parser.add_argument("--step_sleep", type=float, default=0.0)
    parser.add_argument("--nan_at_step", type=int)
    parser.add_argument("--nan_rank", type=int, default=0)
    args = parser.parse_args(argv[:split])
    if args.record is not None:
        record_steps(args.record, args.step_sleep)
    if args.nan_at_step is not None:
        inject_nan(args.nan_at_step, args.nan_rank)
    return run_pretraining.main(argv[split + 1:], stop=StopRequest().install())


if __name__ == "__main__":
    run_pretraining.exit_now(main())
