"""Dry runs of config_*.sh files at BERT-Large shapes, all in one process, with the flags run_and_time.sh passes.

`launch_env` sets a config's variables up for `run_and_time.sh` without data (empty folders, a
bert_config.json, one process as rank 0 of the config's world). `trainer_argv` runs the script
with a stand-in Python that only writes down its arguments, so the flags are exactly the ones a
real run gets. `trace` dry-runs them (`run.dry_run`) and returns the memory estimate and the
traced work as JSON-ready data; tools/plan.py runs it in a process of its own (`planned`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping
from unittest import mock

from ..config.batch_size import config_batch

REPO = Path(__file__).resolve().parents[3]
# The benchmark's model (REFERENCE: BERT-Large uncased, vocabulary 30522).
BERT_LARGE: dict[str, Any] = {
    "vocab_size": 30522, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
    "intermediate_size": 4096, "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
    "max_position_embeddings": 512, "type_vocab_size": 2, "initializer_range": 0.02}
STEPS = 2  # a graphed config traces its capture; an eager one its second step (the first builds the state)
TRACED_LAYERS = (1, 2)  # encoder layers of the two traces a config's estimate is extrapolated from


def exports(config: Path) -> dict[str, str]:
    """The `export NAME=value` lines of a config_*.sh file."""
    return dict(re.findall(r"^export (\w+)=(\S+)", config.read_text(), flags=re.M))


def world_size(env: Mapping[str, str]) -> int:
    return config_batch(env, "the config").world_size


def launch_env(config_env: Mapping[str, str], folder: Path, bert: Mapping[str, Any], python: Path) -> dict[str, str]:
    """A config's variables for run_and_time.sh without data: empty folders, `bert` as the model,
    `python` as the trainer's Python, one process as rank 0 of the config's world, random weights."""
    (folder / "bert_config.json").write_text(json.dumps(dict(bert)))
    for name in ("data", "eval", "out"):
        (folder / name).mkdir(exist_ok=True)
    (folder / "data" / "strata.json").write_text("{}")  # --balance local_presort's start-up check; no data is read
    return {**config_env, "PYTHON": str(python), "BERT_CONFIG": str(folder / "bert_config.json"),
            "DATADIR_PHASE2": str(folder / "data"), "EVALDIR": str(folder / "eval"),
            "OUTPUT_DIR": str(folder / "out"), "RANK": "0", "WORLD_SIZE": str(world_size(config_env)), "SEED": "1",
            "DIVISION": "open"}  # random weights (no phase-1 checkpoint here): not a closed-division run


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def trainer_argv(config_env: Mapping[str, str], folder: Path) -> list[str]:
    """The trainer flags run_and_time.sh passes for these variables (its own checks run first)."""
    argv_file = folder / "argv"
    python = executable(folder / "python", f"#!/bin/bash\nprintf '%s\\0' \"$@\" > {argv_file}\n")
    env = {**{k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "TMPDIR")},
           **launch_env(config_env, folder, BERT_LARGE, python)}
    done = subprocess.run(["bash", str(REPO / "run_and_time.sh")], env=env, capture_output=True, text=True,
                          cwd=folder)
    if not argv_file.exists():
        raise ValueError(f"run_and_time.sh refused the config: {done.stderr.strip().splitlines()[-1:]}")
    argv = argv_file.read_text().split("\0")[:-1]
    return argv[1:] if argv and argv[0].endswith("run_pretraining.py") else argv


@contextlib.contextmanager
def quick_build() -> Iterator[None]:
    """No random draws for the CPU model's weights: a fake device never sees their values."""
    import torch

    def keep(tensor: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        return tensor

    with contextlib.ExitStack() as stack:
        for name in ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_"):
            stack.enter_context(mock.patch.object(torch.nn.init, name, keep))
        yield


def _dry_run(config_env: Mapping[str, str], bert: Mapping[str, Any]) -> Any:
    """One dry run, its layers compiled afresh: Dynamo's code for an earlier build in this process is dropped
    first. Reused, an FP8 model's graphs ran the bf16 model's backward (torch._scaled_mm refused its operands'
    layout), and a second FP8 build ran the first's graphs, whose torch._scaled_mm calls no longer pass the
    counter of `record.counting_fp8_gemms` (a false "ran no FP8 GEMM")."""
    import torch

    from .run import dry_run

    torch._dynamo.reset()
    with tempfile.TemporaryDirectory(prefix="plan_") as scratch:
        folder = Path(scratch)
        argv = trainer_argv(config_env, folder)
        (folder / "bert_config.json").write_text(json.dumps(dict(bert)))
        with quick_build():
            return dry_run(argv, steps=STEPS, env={"RANK": "0", "WORLD_SIZE": str(world_size(config_env))})


def trace(config_env: Mapping[str, str], layers: int | None = None) -> dict[str, Any]:
    """One config's dry run at BERT-Large shapes: {"memory", "work", "world_size", "failures"}.

    layers None: BERT-Large's 24 encoder layers from traces of 1 and 2 (`estimate.extrapolate`: every
    layer is the same, a 24-layer trace costs 8x the time for the same numbers); else a trace of that many.
    """
    memory, work, failures = _traced(config_env, layers)
    if config_env.get("COMPILE_MODE", "none") != "none":
        # The memory of the same step run eagerly: the one GPU measurement (the H200 FP8 step, 37.28 GiB) sits at
        # the eager trace's peak (37.9 GiB), while the compiled layers' trace (aot_eager's partition, which saves
        # fewer activations) came out 23 % under it: a plan must not promise memory the GPU did not have.
        memory = _traced({**config_env, "COMPILE_MODE": "none"}, layers)[0]
    return {"memory": vars(memory), "work": work.to_dict(), "world_size": world_size(config_env),
            "failures": failures}


def _traced(config_env: Mapping[str, str], layers: int | None) -> tuple[Any, Any, list[str]]:
    """(memory, work, findings) of the config's dry run at BERT-Large shapes (`trace`)."""
    from .estimate import extrapolate

    if layers is not None:
        report = _dry_run(config_env, {**BERT_LARGE, "num_hidden_layers": layers})
        return report.memory, report.work, list(report.failures)
    reports = [_dry_run(config_env, {**BERT_LARGE, "num_hidden_layers": n}) for n in TRACED_LAYERS]
    one, two = [(r.memory, r.work) for r in reports]
    memory, work = extrapolate(one, two, int(BERT_LARGE["num_hidden_layers"]))
    return memory, work, [f for r in reports for f in r.failures]
