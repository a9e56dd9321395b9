"""The trainer's run built in this process, on the CPU, as `trainer.run` builds it (`build.build_run`)."""

from __future__ import annotations

from typing import Any

import torch

from mlperf_bert.build import Run, build_run
from mlperf_bert.config.cli import parse_config
from mlperf_bert.runtime.distributed import DistEnv
from mlperf_bert.train.faults import StopRequest

ONE = DistEnv(0, 1, 0, 1, "127.0.0.1", 0)


def cpu_run(flags: list[str]) -> Run:
    """One process's run of these trainer flags (no signal handlers installed); close() it after."""
    return build_run(parse_config(flags, 1), ONE, torch.device("cpu"), StopRequest())


def poison_training_forwards(model: torch.nn.Module, steps: set[int], factor: float) -> None:
    """Multiplies the masked-LM logits of the given (1-based) training forwards by `factor` (inf, NaN)."""
    calls = [0]

    def hook(module: torch.nn.Module, inputs: Any, output: Any) -> Any:
        if not module.training:
            return output
        calls[0] += 1
        if calls[0] not in steps:
            return output
        output.mlm_logits = output.mlm_logits * factor
        return output

    model.register_forward_hook(hook)


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}

