"""Dry runs on request, one after the other, in this one process: a test module's dry runs without a
Python start-up (torch, the fake device, torch._dynamo: about 3 s of CPU) each.

    python tests/_dryrun_server.py

Each line on stdin is one request, {"argv": [...], "env": {...}, "output": PATH}: `python -m
mlperf_bert.dryrun ARGV` as its own process would run it (its `main`), with ENV's variables set
(WORLD_SIZE, RANK), its stdout and stderr (file descriptors 1 and 2, so every writer's lines land
there) in OUTPUT. The answer is one line on stdout, {"code": N}: main's return value, or 1 with the
traceback in OUTPUT where it raised, as the command would exit. The fake device loads before torch
(`main` loads it; nothing here imports torch before), once for every request, as the planner's
traces share it (mlperf_bert/dryrun/shipped.py).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from mlperf_bert.dryrun.__main__ import main


def serve_one(request: dict, stdout: int, stderr: int) -> int:
    os.environ.update(request["env"])
    sys.stdout.flush()
    sys.stderr.flush()
    with open(request["output"], "w") as output:
        os.dup2(output.fileno(), 1)
        os.dup2(output.fileno(), 2)
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


def serve() -> None:
    stdout, stderr = os.dup(1), os.dup(2)  # this process's own, before a request's output takes them
    with os.fdopen(os.dup(stdout), "w") as reply:
        for line in sys.stdin:
            code = serve_one(json.loads(line), stdout, stderr)
            reply.write(json.dumps({"code": code}) + "\n")
            reply.flush()


if __name__ == "__main__":
    serve()
