"""Summary and curves of a finished run, rebuilt from its logs.

  python tools/replay_run.py --progress OUTPUT_DIR/train.log --mlperf_log mlperf.log --out DIR

--progress is the run's progress text: OUTPUT_DIR/train.log or the trainer's stderr (both have
`step N samples S ... loss L lr X` and `eval ... samples S mlm_accuracy A` lines). The MLPerf log
gives the status and the time to train (run_start to run_stop). The lines are replayed as events
into the same report hook a run uses, so DIR gets the summary.txt, summary.json and curves.png
that run would have written.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Iterator, Sequence

import torch
from mlperf_tools.results.compare import read_run

from mlperf_bert.train.faults import Verdict
from mlperf_bert.hooks.events import EvalEnd, Hook, RunEnd, RunStart, StepEnd
from mlperf_bert.hooks.report import RunReport

STEP = re.compile(r"\bstep (\d+) samples (\d+)(?:/\d+)? .*?\bloss (\S+) lr (\S+)")
EVAL = re.compile(r"\beval\b.*?\bsamples (\d+) mlm_accuracy (\S+)(?:.*?mlm_loss (\S+))?")


def events(lines: Sequence[str]) -> Iterator[StepEnd | EvalEnd]:
    """The step and eval events that the progress lines record, in order."""
    step = 0
    for line in lines:
        if found := STEP.search(line):
            step = int(found.group(1))
            loss = float(found.group(3))
            yield StepEnd(step=step, samples=int(found.group(2)), loss=torch.tensor(loss),
                          learning_rate=float(found.group(4)), tokens=0, skipped_steps=0,
                          next_eval_samples=sys.maxsize, verdict=Verdict(loss=loss))
        elif found := EVAL.search(line):
            yield EvalEnd(step=step, samples=int(found.group(1)), accuracy=float(found.group(2)),
                          loss=float(found.group(3) or "nan"), seconds=0.0)


def replay(progress: Path, mlperf_log: Path, out: Path, hook: Hook | None = None) -> RunReport:
    """Feed the logged run to a RunReport writing into `out` (and to `hook`, if given)."""
    run = read_run(mlperf_log)
    if run.run_start_ms is None or run.run_stop_ms is None or run.status is None:
        raise SystemExit(f"replay_run.py: {mlperf_log} has no run_start and run_stop: not a finished run")
    report = RunReport(loss_every=1, log_dir=out, mlperf_log=mlperf_log)
    hooks = [report] + ([hook] if hook else [])
    recorded = list(events(progress.read_text(errors="replace").splitlines()))
    if not recorded:
        raise SystemExit(f"replay_run.py: no `step N samples S ... loss L lr X` lines in {progress}")
    batch = int(run.values.get("global_batch_size") or 1)
    steps = run.values.get("opt_learning_rate_training_steps")  # the LR schedule, for the forecast line
    schedule = int(steps) * batch if isinstance(steps, (int, float)) and steps > 0 else 0
    for h in hooks:
        h.run_start(RunStart(samples=0, step=0, stop_samples=recorded[-1].samples,
                             global_batch_size=batch, output_dir=out, schedule_samples=schedule))
    for event in recorded:
        for h in hooks:
            if isinstance(event, StepEnd):
                h.step_end(event)
            else:
                h.eval_end(event)
    last = recorded[-1]
    end = RunEnd(status=run.status, step=last.step, samples=last.samples,
                 seconds=(run.run_stop_ms - run.run_start_ms) / 1000.0)
    for h in hooks:
        h.run_end(end)
        h.close()
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--progress", type=Path, required=True, help="train.log or the trainer's stderr")
    parser.add_argument("--mlperf_log", type=Path, required=True, help="the run's MLPerf log")
    parser.add_argument("--out", type=Path, required=True, help="summary and curves.png go here")
    args = parser.parse_args(argv)
    for path in (args.progress, args.mlperf_log):
        if not path.is_file():
            raise SystemExit(f"replay_run.py: {path} not found")
    args.out.mkdir(parents=True, exist_ok=True)
    replay(args.progress, args.mlperf_log, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
