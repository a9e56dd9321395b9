"""Where a rank's training micro-batches come from: the data stream plus load balancing.

A `BatchSource` hands the trainer this rank's items for the next micro-batch. With
`--balance none` that is the rank's own slice of the shuffled data; the balancing policies
redistribute the samples of each global step across ranks first (`balance.py` holds the
policies as pure functions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .batch import Item, item_length
from .config import TrainConfig
from .data import DataLimits, PretrainingDataset, discover_shards
from .distributed import DistEnv


@dataclass(frozen=True)
class BatchStats:
    """Real tokens of one micro-batch on the least and the most loaded rank."""

    min_tokens: int
    max_tokens: int


class BatchSource(Protocol):
    def next_batch(self) -> list[Item]: ...

    def last_stats(self) -> BatchStats | None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...


class LocalSource:
    """`--balance none`: every rank keeps the items it read."""

    def __init__(self, dataset: PretrainingDataset) -> None:
        self.dataset = dataset
        self._tokens = 0

    def next_batch(self) -> list[Item]:
        items = self.dataset.next_batch()
        self._tokens = sum(item_length(i) for i in items)
        return items

    def last_stats(self) -> BatchStats | None:
        return None  # knowing the other ranks' load would cost a collective per step

    def state_dict(self) -> dict:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state)

    def close(self) -> None:
        self.dataset.close()


def open_batch_source(cfg: TrainConfig, denv: DistEnv, limits: DataLimits) -> BatchSource:
    """Builds the configured source; the caller closes it."""
    if cfg.data.balance != "none":
        raise NotImplementedError(f"--balance {cfg.data.balance} is not available in this build")
    shards = discover_shards(cfg.data.input_dir)
    dataset = PretrainingDataset(shards, limits, rank=denv.rank, world_size=denv.world_size,
                                 items_per_rank_step=cfg.micro_batch_size, seed=cfg.run.seed)
    return LocalSource(dataset)
