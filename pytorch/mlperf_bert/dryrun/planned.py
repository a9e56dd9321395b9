"""The planner's dry runs, in one process: each config's trace and, for a compiled one, Inductor's code for its step.

    python -m mlperf_bert.dryrun.planned REQUEST.json RESULT.json

REQUEST holds {"trace": {key: env}, "inductor": {key: env}}, each env {variable: value} (a
config's exports, changed as the caller likes). RESULT gets {"trace": {key: `shipped.trace`'s
memory, work, world size and findings}, "inductor": {key: `compiled_step`'s report}}.
tools/plan.py runs it and caches each answer. Its own process: the fake CUDA device loads before
torch. MLPERF_BERT_TRACE_LAYERS=24 traces the whole model instead of extrapolating from one and
two layers (the check of `estimate.extrapolate`, docs/PERFORMANCE.md).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping


def compiled_step(config_env: Mapping[str, str], name: str, layers: int | None = None) -> dict[str, Any]:
    """Inductor's code for a compiled config's training step at BERT-Large shapes, generated for the config's GPU
    (`compiled.trace`, nothing launched): its kernels and the bytes Inductor counts for them, scaled to 24 layers
    from one and two (layers None) as `shipped.trace` is. Graph breaks are reported, not refused (the command
    `python -m mlperf_bert.dryrun.compiled` refuses them)."""
    from .compiled import TOP, trace
    from .shipped import TRACED_LAYERS

    counts = [layers] if layers is not None else list(TRACED_LAYERS)
    return trace(config_env, counts, None, name).to_dict(TOP)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m mlperf_bert.dryrun.planned REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    from .native import load

    load()
    from .shipped import trace

    request = json.loads(Path(argv[0]).read_text())
    layers = int(os.environ["MLPERF_BERT_TRACE_LAYERS"]) if os.environ.get("MLPERF_BERT_TRACE_LAYERS") else None
    result = {"trace": {key: trace(env, layers) for key, env in request.get("trace", {}).items()},
              "inductor": {key: compiled_step(env, key, layers) for key, env in request.get("inductor", {}).items()}}
    Path(argv[1]).write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # as `compiled`'s command: no pool of compile workers
    sys.exit(main(sys.argv[1:]))
