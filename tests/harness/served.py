"""A command's `main` served to a test module by one process: the module's runs without a Python start-up
each (torch, torch._dynamo, the project: about 3 s of CPU a run).

    python -m tests.harness.served trainer|dryrun     (from the repository root)

Each line on stdin is one request, {"argv": [...], "env": {...}, "stdout": PATH, "stderr": PATH}: the
command's main as its own process would run it (`run_pretraining.py ARGV`, `python -m mlperf_bert.dryrun
ARGV`), ENV's variables set, its stdout and stderr (file descriptors 1 and 2, so every writer's lines land
there; one file where both paths are the same) in the two files. The answer is one line on stdout, {"code":
N}: main's return value, which the command exits with, or 1 with the traceback where it raised, as the
command would end. A dry run's fake device loads before torch (the dry run's main loads it; nothing here
imports torch before) and serves every request, as the planner's traces share it (mlperf_bert/dryrun/
shipped.py).

`Served` is the test's side. The tests served are about what a run computes and says; the commands'
own start-up and ends (signals, a launcher's exit codes) are tested on processes of their own.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Callable

from tests.harness.paths import REPO


class Served:
    """The test's side: `run` sends one request and waits for its answer."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.process = self._start()

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "tests.harness.served", self.kind], cwd=REPO,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)

    def run(self, argv: list[str], stdout: Path, stderr: Path | None = None, env: dict[str, str] | None = None,
            timeout_s: float = 600) -> subprocess.CompletedProcess:
        """The command's run of ARGV as a finished process: its exit code, stdout and stderr (both in
        stdout when `stderr` is None)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        errors = stdout if stderr is None else stderr
        request = {"argv": argv, "env": env or {}, "stdout": str(stdout), "stderr": str(errors)}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        answer = self.process.stdout.readline() if ready else ""
        out, err = (path.read_text() if path.exists() else "" for path in (stdout, errors))
        if not answer:  # a run that hangs or kills its process: the next request gets a process of its own
            self.process.kill()
            self.process.wait()
            self.process = self._start()
        assert answer, f"the served process gave no answer in {timeout_s:.0f} s or ended: {(out + err)[-3000:]}"
        return subprocess.CompletedProcess(argv, int(json.loads(answer)["code"]), out, "" if stderr is None else err)

    def run_in(self, folder: Path, argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """`run` with the stdout and stderr files in `folder` (a test's tmp_path)."""
        return self.run(argv, folder / "served.out", folder / "served.err", env)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _trainer_main() -> Callable[[list[str]], int]:
    from mlperf_bert.main import main
    from mlperf_bert.train.faults import StopRequest

    return lambda argv: main(argv, stop=StopRequest().install())  # as run_pretraining.py starts it


def _dryrun_main() -> Callable[[list[str]], int]:
    from mlperf_bert.dryrun.__main__ import main

    return main


def _redirected(request: dict) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    with open(request["stdout"], "w") as out:
        os.dup2(out.fileno(), 1)
        if request["stderr"] == request["stdout"]:
            os.dup2(out.fileno(), 2)
            return
    with open(request["stderr"], "w") as err:
        os.dup2(err.fileno(), 2)


def serve_one(main: Callable[[list[str]], int], request: dict, stdout: int, stderr: int) -> int:
    environ = dict(os.environ)
    os.environ.update(request["env"])  # for this request only
    _redirected(request)
    try:
        return main(list(request["argv"]))
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    except Exception:  # the command's own end: a traceback and exit 1
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        os.environ.clear()
        os.environ.update(environ)


def serve(kind: str) -> None:
    main = {"trainer": _trainer_main, "dryrun": _dryrun_main}[kind]()
    stdout, stderr = os.dup(1), os.dup(2)  # this process's own, before a request's output takes them
    with os.fdopen(os.dup(stdout), "w") as reply:
        for line in sys.stdin:
            code = serve_one(main, json.loads(line), stdout, stderr)
            reply.write(json.dumps({"code": code}) + "\n")
            reply.flush()


if __name__ == "__main__":
    serve(sys.argv[1])
