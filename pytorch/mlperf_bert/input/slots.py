"""Micro-batch slots: which items each micro-batch of an optimizer step takes, whatever the rank count.

An optimizer step takes M = W x A micro-batches of b items (W ranks, A = --gradient_accumulation_steps,
b = the micro-batch, --train_batch_size / A). Slot s in [0, M) is a stream of its own: stream s of
the data split M ways (`data.PretrainingDataset`, or `data.StratifiedDataset` for a stratified
folder, built with rank=s and world_size=M). Rank r owns slots r A .. r A + A - 1; its j-th
micro-batch of a step is slot r A + j (`SlotStream` cycles through them).

So the items of every step depend on M, b, the data and the seed, not on W: a run checkpointed at
4 ranks x 1 micro-batch resumes at 2 x 2 or 1 x 4 and trains on the same items in every later
step, each micro-batch the same as before (only the order in which gradients are summed changes).
At A = 1, slot r is rank r's stream exactly as without slots.

Cost at A > 1: the A slots of a rank read A places of the epoch at once. Each keeps its current
shard and reads the next one ahead, so a rank holds up to 2A shards in memory instead of 2. The
slots share one `data.ShardReader` per folder: one reader thread, the row counts read once, and
one copy of a shard that several slots read (few shards, or a slot's block edge).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..data.batch import Item
from ..data.dataset import DataError, ShardReaders
from .sources import ItemStream


@dataclass(frozen=True)
class SlotLayout:
    """W ranks x A micro-batches of b items per optimizer step."""

    world_size: int
    accumulation: int
    micro_batch: int

    @property
    def slots(self) -> int:
        return self.world_size * self.accumulation

    def slots_of(self, rank: int) -> range:
        """Rank `rank`'s slots, in the order of its micro-batches."""
        return range(rank * self.accumulation, (rank + 1) * self.accumulation)

    def record(self) -> dict[str, int]:
        return {"slots": self.slots, "micro_batch": self.micro_batch, "ranks": self.world_size,
                "accumulation": self.accumulation}

    def mismatch(self, saved: dict) -> str | None:
        """Why a data position saved under another layout cannot continue here (the flags to set), or None."""
        slots, micro_batch = int(saved["slots"]), int(saved["micro_batch"])
        if (slots, micro_batch) == (self.slots, self.micro_batch):
            return None
        here = f"this run has {self.world_size} x {self.accumulation} of {self.micro_batch}"
        steps = int(saved["accumulation"])
        problem = (f"data position: saved with {slots} slots of {micro_batch} items per step ({saved['ranks']} ranks "
                   f"x {steps} accumulation step{'s' if steps != 1 else ''}); {here}")
        if slots % self.world_size:
            return f"{problem}: resume at a number of ranks that divides {slots}"
        accumulation = slots // self.world_size
        return (f"{problem}: set --gradient_accumulation_steps {accumulation} and --train_batch_size "
                f"{accumulation * micro_batch}")


class SlotStream:
    """A rank's micro-batches: one from each of its slot streams in turn (the `ItemStream` interface).

    `state_dict` holds the layout and the position of the slot read next. Between optimizer
    steps (where checkpoints are written) every slot stands at the same position, whatever the
    rank, so that one position restores every slot of every rank at any world size.
    """

    def __init__(self, streams: Sequence[ItemStream], layout: SlotLayout, readers: ShardReaders | None = None) -> None:
        if len(streams) != layout.accumulation:
            raise ValueError(f"{len(streams)} slot streams for {layout.accumulation} micro-batches per step")
        self.streams, self.layout, self.readers = list(streams), layout, readers
        self._next = 0  # the micro-batch of the step read next

    @classmethod
    def open(cls, make: Callable[[int], ItemStream], layout: SlotLayout, rank: int,
             readers: ShardReaders | None = None) -> "SlotStream":
        """Rank `rank`'s slots, stream s made by make(s); `readers` (theirs, shared) closed with them."""
        streams: list[ItemStream] = []
        try:
            for slot in layout.slots_of(rank):
                streams.append(make(slot))
        except BaseException:
            _close(streams, readers)
            raise
        return cls(streams, layout, readers)

    def next_batch(self) -> list[Item]:
        items = self.streams[self._next].next_batch()
        self._next = (self._next + 1) % len(self.streams)
        return items

    def state_dict(self) -> dict:
        return {**self.layout.record(), "next_micro_batch": self._next, "stream": self.streams[self._next].state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "slots" not in state:
            raise DataError("data position: saved without micro-batch slots (by an older trainer, whose data order "
                            "depends on the number of ranks); resume it with that trainer, or start a fresh run")
        problem = self.layout.mismatch(state)
        if problem:
            raise DataError(problem)
        if int(state["next_micro_batch"]) != 0:
            raise DataError(f"data position: saved after micro-batch {state['next_micro_batch']} of a step, not "
                            "between steps where checkpoints are written; the saved state is corrupt")
        for stream in self.streams:
            stream.load_state_dict(state["stream"])
        self._next = 0

    def close(self) -> None:
        _close(self.streams, self.readers)


def _close(streams: Sequence[ItemStream], readers: ShardReaders | None) -> None:
    """The streams first: they release their shards of the shared readers, which close last."""
    for stream in streams:
        stream.close()
    if readers is not None:
        readers.close()
