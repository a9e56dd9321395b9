"""Where a rank's training micro-batches come from: the data stream plus load balancing.

A `BatchSource` hands the trainer this rank's items for the next micro-batch. The stream
under it is the rank's micro-batch slots (`slots.SlotStream`), each its own slice of the
shuffled data (`data.PretrainingDataset`), or of each length stratum when --input_dir is a
stratified folder (`stratified.StratifiedDataset`).
The policies (`--balance`, deal order `--balance_deal`) redistribute the samples of each
step across ranks; every rank keeps B samples and the step's samples stay the same:

  none            every rank trains on what it read
  global_presort  all ranks' samples sorted by length and dealt over all ranks (NVIDIA);
                  torch.distributed on a gloo group, in the step
  local_presort   the same inside each node only (Samsung; needs stratified data); the
                  node is LOCAL_WORLD_SIZE (or SLURM_NTASKS_PER_NODE) consecutive ranks
  cpu_exchange    global_presort's exchange with MPI on a background thread, one step
                  ahead of the trainer, flat batches prebuilt (Baidu; `host_exchange.py`)

The exchange runs on a gloo group of host tensors even when training uses NCCL, so it needs
no device copy or device sync (`exchange.py`).

Imbalance: every source records the real tokens of each micro-batch it hands out on this
rank; `token_imbalance()` all-gathers them (one small collective for a whole window of
micro-batches, for every policy, `none` included) and returns each micro-batch's most and
least loaded rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..data.batch import FlatBatch, Item, flatten_items, item_length
from .exchange import Collectives, exchange


class ItemStream(Protocol):
    """A rank's stream of micro-batches: `PretrainingDataset`, `StratifiedDataset`, `slots.SlotStream`."""

    def next_batch(self) -> list[Item]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TokenImbalance:
    """Real tokens of the most and the least loaded rank in each of n micro-batches."""

    max_tokens: np.ndarray  # [n] int64
    min_tokens: np.ndarray  # [n] int64

    @classmethod
    def empty(cls) -> "TokenImbalance":
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64))

    def __add__(self, other: "TokenImbalance") -> "TokenImbalance":
        return TokenImbalance(np.concatenate([self.max_tokens, other.max_tokens]),
                              np.concatenate([self.min_tokens, other.min_tokens]))

    @property
    def micro_batches(self) -> int:
        return int(self.max_tokens.shape[0])

    def mean_max(self) -> float:
        return float(self.max_tokens.mean()) if self.micro_batches else float("nan")

    def mean_min(self) -> float:
        return float(self.min_tokens.mean()) if self.micro_batches else float("nan")


class TokenMeter:
    """This rank's real tokens per micro-batch; their max and min over the ranks on demand.

    group: a gloo group of all ranks, or None for a single process.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._tokens: list[int] = []

    def record(self, items: Sequence[Item]) -> None:
        self._tokens.append(sum(item_length(i) for i in items))

    def collect(self) -> TokenImbalance:
        """Collective (every rank calls it after the same micro-batch): one all-gather of [n] int64."""
        mine = torch.tensor(self._tokens, dtype=torch.int64)
        self._tokens = []
        if self.group is None:
            per_rank = mine[None]
        else:
            parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(parts, mine, group=self.group)
            per_rank = torch.stack(parts)  # [W, n]
        return TokenImbalance(per_rank.max(dim=0).values.numpy(), per_rank.min(dim=0).values.numpy())


class BatchSource(Protocol):
    def next_batch(self) -> list[Item]:
        """This rank's items of the next micro-batch."""
        ...

    def next_flat_batch(self) -> FlatBatch:
        """The same as one host `FlatBatch` (prebuilt off the critical path where the source can)."""
        ...

    def token_imbalance(self) -> TokenImbalance:
        """Collective: max / min real tokens over the ranks of each micro-batch since the last call."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...


class LocalSource:
    """`--balance none`: every rank keeps the items it read."""

    def __init__(self, dataset: ItemStream, meter: TokenMeter | None = None) -> None:
        self.dataset = dataset
        self.meter = meter or TokenMeter()

    def _take(self) -> list[Item]:
        return self.dataset.next_batch()

    def next_batch(self) -> list[Item]:
        items = self._take()
        self.meter.record(items)
        return items

    def next_flat_batch(self) -> FlatBatch:
        return flatten_items(self.next_batch())

    def token_imbalance(self) -> TokenImbalance:
        return self.meter.collect()

    def state_dict(self) -> dict:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state)

    def close(self) -> None:
        self.dataset.close()


class ExchangeSource(LocalSource):
    """global_presort / local_presort: each micro-batch is exchanged over `comm` in the step.

    comm: the exchange group (all ranks, or this rank's node); order: raster, snake or greedy.
    """

    def __init__(self, dataset: ItemStream, comm: Collectives, order: str, meter: TokenMeter | None = None) -> None:
        super().__init__(dataset, meter)
        self.comm = comm
        self.order = order

    def _take(self) -> list[Item]:
        return exchange(self.dataset.next_batch(), self.comm, self.order).items
