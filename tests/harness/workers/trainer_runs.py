"""Several trainer runs, one after the other, in this one process: a test's runs without a Python start-up each.

    python -m tests.harness.workers.trainer_runs PLAN.json

PLAN.json is a list of runs, each {"flags": [...], "env": {...}, "port": PATH, "err": PATH,
"instruments": [...], "code": PATH}: the run's variables (RANK, WORLD_SIZE, ...) are set, MASTER_PORT
to the port its ranks agree on in the file `port` (`ports.agreed_port`), its stderr goes to
`err` (file descriptor 2, so every writer's lines land there), `instruments` are instrumented_trainer.py's
flags (--nan_at_step ...), and run_pretraining.main's exit code is written to `code` (1, with the
traceback in `err`, where it raised). A run that fails does not stop the others: each test reads
its own runs' codes. The trainer itself is the one
a launch starts (`mlperf_bert.main.main`); only the interpreter is shared, which the runs' tests
are not about (start-up itself is tested by the launcher tests).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from mlperf_bert import main as run_pretraining
from tests.harness.ports import agreed_port
from tests.harness.served import serve_one
from tests.harness.workers.instrumented_trainer import hooks_of


def run_one(run: dict, stdout: int, stderr: int) -> int:
    """One run of the plan, as `served.serve_one` runs a request: its variables for this run only."""
    port = agreed_port(Path(run["port"]), int(run["env"]["RANK"]))
    hooks = hooks_of(run.get("instruments", []))
    request = {"argv": run["flags"], "env": {**run["env"], "MASTER_PORT": port}, "stdout": os.devnull,
               "stderr": run["err"]}
    return serve_one(lambda argv: run_pretraining.main(argv, hooks=hooks), request, stdout, stderr)


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    stdout, stderr = os.dup(1), os.dup(2)  # this process's own, between the runs
    for run in plan:
        Path(run["err"]).parent.mkdir(parents=True, exist_ok=True)
        Path(run["code"]).write_text(str(run_one(run, stdout, stderr)))


if __name__ == "__main__":
    main()
