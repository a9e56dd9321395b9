"""The global batch size, counted one way for the trainer and for the tools that read a config file.

`TrainConfig.global_batch_size` (what the trainer logs as `global_batch_size`) and the tools that plan
or package a `config_<SYSTEM>.sh` file (tools/plan.py, recipe.py, package_results.py, kill_soak.py)
all count it here:

- `--train_batch_size` (`BATCHSIZE`) is per rank and optimizer step, the accumulation inside it:
  the micro-batch is BATCHSIZE / GRADIENT_STEPS, so accumulation does not multiply the global batch
  (56 x 8 GPUs = 448 at GRADIENT_STEPS=1 and at GRADIENT_STEPS=4, whose micro-batches are 14);
- the world size is DGXNGPU x DGXNNODES (run_and_time.sh starts DGXNGPU processes on each node);
- a packed row counts as 2 sequences, as NVIDIA logs it (it holds 1.999 on average).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

SEQUENCES_PER_PACK = 2


@dataclass(frozen=True)
class BatchShape:
    """One optimizer step's batch: items per rank (sequences, or packs), accumulation, ranks, layout."""

    train_batch_size: int  # per rank and optimizer step, accumulation inside (--train_batch_size, BATCHSIZE)
    accumulation_steps: int  # micro-batches per optimizer step (--gradient_accumulation_steps, GRADIENT_STEPS)
    world_size: int  # ranks
    packed: bool  # --input_layout packed: an item is a pack of 2 sequences

    @property
    def micro_batch_size(self) -> int:
        return self.train_batch_size // self.accumulation_steps

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step over all ranks."""
        return self.train_batch_size * self.world_size * (SEQUENCES_PER_PACK if self.packed else 1)


def config_batch(variables: Mapping[str, str], source: str) -> BatchShape:
    """The batch of a config file's variables (BATCHSIZE, GRADIENT_STEPS, DGXNGPU, DGXNNODES, INPUT_LAYOUT),
    as run_and_time.sh hands them to the trainer. GRADIENT_STEPS unset: 1, the trainer's default.
    ValueError, naming `source` and the variable, for a missing or non-positive count or a BATCHSIZE that
    the accumulation steps do not divide (the trainer refuses it)."""
    def count(name: str, default: str | None = None) -> int:
        value = variables.get(name) or default
        if value is None:
            raise ValueError(f"{source}: no export of {name} (a config_*.sh sets it)")
        if not value.isdigit() or int(value) <= 0:
            raise ValueError(f"{source}: {name}={value} is not a positive whole number")
        return int(value)

    batch = BatchShape(count("BATCHSIZE"), count("GRADIENT_STEPS", "1"), count("DGXNGPU") * count("DGXNNODES"),
                       variables.get("INPUT_LAYOUT") == "packed")
    if batch.train_batch_size % batch.accumulation_steps:
        raise ValueError(f"{source}: BATCHSIZE={batch.train_batch_size} is not divisible by GRADIENT_STEPS="
                         f"{batch.accumulation_steps} (BATCHSIZE is per GPU and optimizer step, the accumulation "
                         "inside it: the micro-batch is their quotient)")
    return batch
