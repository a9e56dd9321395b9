"""The training stream and the eval set over MLPerf hdf5 shards.

The shard format lives in `shards`, validation in `data_validate`; this module decides which
rank uses which item when.

Order of the training data. Let n shards hold T items (rows) in all, W ranks each take
b items per step (one micro-batch), seed s. (The trainer's "ranks" here are the micro-batch
slots of a step, ranks x accumulation steps, `input/slots.py`; at one micro-batch per step,
the ranks.)
- Pass e orders the shards by a permutation drawn from (s, e) and the rows of each shard by
  a permutation drawn from (s, e, shard). G_e is the resulting sequence of all T items.
- The stream is G_0 G_1 G_2 ... . Epoch e's steps cover X_e = (the tail of G_{e-1} that
  did not fill a global step) + G_e. It has S_e = len(X_e) // (W b) steps; rank r takes the
  contiguous block X_e[r S_e b : (r+1) S_e b] and yields it b items per step. The tail of
  X_e (fewer than W b items) opens X_{e+1}.
- So no item is dropped, every item is used exactly once per pass G_e, and every rank runs
  the same S_e steps (DDP needs that). All ranks compute the layout from the shards' row
  counts, which come from hdf5 metadata alone.
- A block is contiguous in shard order, so a rank reads only the shards its block covers:
  about n / W of them, plus the shards it shares with its neighbours at the block edges and
  the shard(s) holding the carried tail. With fewer shards than ranks, several ranks read
  the same shard and take disjoint parts of its shuffled rows.

The position (epoch, step) is the same on every rank; the rest of the layout is a function
of it, so `state_dict()` is tiny and a resumed run continues at exactly the next item.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from .batch import Item
from .validate import DataLimits, read_shard
from .shards import DataError, folder_problems, list_shards, shard_info

discover_shards = list_shards  # the trainer's name: the sorted shards of --input_dir / --eval_dir

__all__ = [
    "DataError", "DataLimits", "DataPosition", "Piece", "PretrainingDataset", "ShardReader", "ShardReaders",
    "StreamLayout",
    "discover_shards", "load_eval_set", "read_shard",
]

_LAYOUT_CACHE = 4  # epochs of rank blocks and row orders kept per layout


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of shard `shard`, counted in the row order pass `order_epoch` gives it."""

    shard: int
    order_epoch: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def slice_pieces(pieces: Sequence[Piece], start: int, stop: int) -> list[Piece]:
    """Items [start, stop) of the concatenation of `pieces`, as pieces."""
    sizes = np.fromiter((p.size for p in pieces), dtype=np.int64, count=len(pieces))
    ends = np.cumsum(sizes)
    first = int(np.searchsorted(ends, start, side="right"))
    out = []
    for i in range(first, len(pieces)):
        begin = int(ends[i] - sizes[i])
        if begin >= stop:
            break
        p = pieces[i]
        lo, hi = max(start - begin, 0), min(stop - begin, p.size)
        out.append(Piece(p.shard, p.order_epoch, p.start + lo, p.start + hi))
    return out


def _bounded_put(cache: dict, key: Any, value: Any) -> Any:
    if len(cache) >= _LAYOUT_CACHE:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value


class StreamLayout:
    """The arithmetic of the stream (module docstring): which rows each rank takes at each step."""

    def __init__(self, counts: Sequence[int], world_size: int, items_per_rank_step: int, seed: int):
        self.counts = [int(c) for c in counts]
        self.world_size = world_size
        self.items_per_rank_step = items_per_rank_step
        self.seed = seed
        self.total_items = sum(self.counts)
        self._blocks: dict[tuple[int, int], list[Piece]] = {}
        self._row_orders: dict[tuple[int, int], np.ndarray] = {}

    @property
    def global_step_items(self) -> int:
        return self.world_size * self.items_per_rank_step

    def shard_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch, 0]).permutation(len(self.counts))

    def row_order(self, epoch: int, shard: int) -> np.ndarray:
        """The order pass `epoch` visits the rows of `shard` in."""
        key = (epoch, shard)
        if key not in self._row_orders:
            order = np.random.default_rng([self.seed, epoch, 1, shard]).permutation(self.counts[shard])
            _bounded_put(self._row_orders, key, order)
        return self._row_orders[key]

    def carry_in(self, epoch: int) -> int:
        """Items of pass epoch-1 that open epoch `epoch` (they did not fill a global step)."""
        return (epoch * self.total_items) % self.global_step_items

    def steps_in_epoch(self, epoch: int) -> int:
        return (self.carry_in(epoch) + self.total_items) // self.global_step_items

    def _pass(self, epoch: int) -> list[Piece]:
        return [Piece(int(s), epoch, 0, self.counts[s]) for s in self.shard_order(epoch)]

    def rank_block(self, epoch: int, rank: int) -> list[Piece]:
        """Everything `rank` reads in epoch `epoch`, in the order it is used."""
        key = (epoch, rank)
        if key not in self._blocks:
            carry, total = self.carry_in(epoch), self.total_items
            stream = (slice_pieces(self._pass(epoch - 1), total - carry, total) if carry else []) + self._pass(epoch)
            size = self.steps_in_epoch(epoch) * self.items_per_rank_step
            _bounded_put(self._blocks, key, slice_pieces(stream, rank * size, (rank + 1) * size))
        return self._blocks[key]

    def step_pieces(self, epoch: int, rank: int, step: int) -> list[Piece]:
        b = self.items_per_rank_step
        return slice_pieces(self.rank_block(epoch, rank), step * b, (step + 1) * b)


@dataclass(frozen=True)
class DataPosition:
    """Where the stream stands: the next step to yield. The same on every rank."""

    epoch: int
    step: int


class ShardReader:
    """A list of shards: their row counts (hdf5 metadata, read once) and the shards loaded as lists
    of items, read on one background thread so the next shard is ready early.

    Several streams over the same shards (a rank's micro-batch slots, `input/slots.py`) may share
    one: one thread, one copy of a shard that several of them read. Each user says which shards
    it still needs (`keep_only`); a shard stays loaded while any user needs it.
    """

    def __init__(self, paths: Sequence[Path], limits: DataLimits, known_rows: Mapping[Path, int] | None = None):
        self.paths = [Path(p) for p in paths]
        self.limits = limits
        known = known_rows or {}
        self.counts = [known[p] if p in known else shard_info(p)[1] for p in self.paths]
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-reader")
        self._loaded: dict[int, Future] = {}
        self._needed: dict[int, set[int]] = {}  # id of a user -> the shards it keeps

    def request(self, shard: int) -> None:
        if shard not in self._loaded:
            self._loaded[shard] = self._pool.submit(read_shard, self.paths[shard], self.limits)

    def items(self, shard: int) -> list[Item]:
        self.request(shard)
        return self._loaded[shard].result()

    def keep_only(self, user: object, shards: set[int]) -> None:
        """`user` needs only `shards` from now on; shards no user needs are dropped."""
        self._needed[id(user)] = set(shards)
        kept = set().union(*self._needed.values())
        for shard in [s for s in self._loaded if s not in kept]:
            self._loaded.pop(shard).cancel()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._loaded.clear()


class ShardReaders:
    """One `ShardReader` per list of shards, for streams that share them; closed by its maker after them.

    known_rows: shard -> rows, as the folder's verification record gives them (no file opened for them).
    """

    def __init__(self, known_rows: Mapping[Path, int] | None = None) -> None:
        self._readers: dict[tuple[tuple[Path, ...], DataLimits], ShardReader] = {}
        self.known_rows = known_rows

    def get(self, paths: Sequence[Path], limits: DataLimits) -> ShardReader:
        key = (tuple(Path(p) for p in paths), limits)
        if key not in self._readers:
            self._readers[key] = ShardReader(key[0], limits, self.known_rows)
        return self._readers[key]

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()


class PretrainingDataset:
    """This rank's endless stream of micro-batches (lists of `items_per_rank_step` items).

    `shards` is the sorted shard list (`discover_shards`), identical on every rank. Every
    shard is validated by `read_shard` when it is first read; row counts are read up front
    from metadata. `read_ahead` loads the next shard on a background thread. Iteration never
    ends; the caller stops after its step budget. `position` is the next step to yield.
    readers: where to get the shard reader when several streams share one (their maker closes
    it); None: the stream reads on its own.
    """

    def __init__(
        self, shards: Sequence[Path], limits: DataLimits, *, rank: int, world_size: int,
        items_per_rank_step: int, seed: int, read_ahead: bool = True, readers: ShardReaders | None = None,
    ):
        _check_stream_args(shards, rank, world_size, items_per_rank_step, seed)
        self.rank = rank
        self.read_ahead = read_ahead
        self._own_reader = readers is None
        self._reader = ShardReader(shards, limits) if readers is None else readers.get(shards, limits)
        self.layout = StreamLayout(self._reader.counts, world_size, items_per_rank_step, seed)
        if self.layout.total_items < self.layout.global_step_items:
            self.close()
            raise DataError(
                f"{Path(shards[0]).parent}: {self.layout.total_items} items in {len(shards)} shards, fewer than "
                f"one global step ({world_size} micro-batches of {items_per_rank_step}); use more data or a "
                "smaller batch"
            )
        self.position = DataPosition(0, 0)
        self._prefetch()

    @property
    def total_items(self) -> int:
        return self.layout.total_items

    def steps_in_epoch(self, epoch: int) -> int:
        return self.layout.steps_in_epoch(epoch)

    def _take(self, piece: Piece) -> list[Item]:
        items = self._reader.items(piece.shard)
        rows = self.layout.row_order(piece.order_epoch, piece.shard)[piece.start:piece.stop]
        return [items[i] for i in rows]

    def _advance(self) -> None:
        epoch, step = self.position.epoch, self.position.step + 1
        if step == self.layout.steps_in_epoch(epoch):
            epoch, step = epoch + 1, 0
        self.position = DataPosition(epoch, step)

    def _upcoming_shards(self) -> list[int]:
        """Distinct shards in the order this rank will read them, from the current position on."""
        epoch, b = self.position.epoch, self.layout.items_per_rank_step
        block = self.layout.rank_block(epoch, self.rank)
        size = self.layout.steps_in_epoch(epoch) * b
        ahead = slice_pieces(block, self.position.step * b, size) + self.layout.rank_block(epoch + 1, self.rank)
        return list(dict.fromkeys(p.shard for p in ahead))

    def _prefetch(self) -> None:
        """Keeps only the shards of the next step and starts loading them plus the shard after."""
        needed = [p.shard for p in self.layout.step_pieces(self.position.epoch, self.rank, self.position.step)]
        ahead = [s for s in self._upcoming_shards() if s not in needed][:1]
        self._reader.keep_only(self, set(needed) | set(ahead))
        if self.read_ahead:
            for shard in needed + ahead:
                self._reader.request(shard)

    def next_batch(self) -> list[Item]:
        """The items of the current step; then moves on one step (into the next epoch at its end)."""
        pieces = self.layout.step_pieces(self.position.epoch, self.rank, self.position.step)
        batch = [item for piece in pieces for item in self._take(piece)]
        self._advance()
        self._prefetch()
        return batch

    def __iter__(self) -> Iterator[list[Item]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """The position plus what it depends on, so a mismatched resume is refused."""
        return {
            "epoch": self.position.epoch, "step": self.position.step, "seed": self.layout.seed,
            "world_size": self.layout.world_size, "items_per_rank_step": self.layout.items_per_rank_step,
            "total_items": self.layout.total_items,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        mine = self.state_dict()
        missing = sorted(set(mine) - set(state))
        if missing:
            raise DataError(f"data position: the saved state lacks {missing}; it was not made by PretrainingDataset")
        for key in ("seed", "world_size", "items_per_rank_step", "total_items"):
            if int(state[key]) != mine[key]:
                raise DataError(
                    f"data position: saved with {key}={state[key]}, this run has {mine[key]}; "
                    "resume with the same data, seed, ranks and batch size, or start without the saved state"
                )
        epoch, step = int(state["epoch"]), int(state["step"])
        if not 0 <= step < self.layout.steps_in_epoch(epoch):
            raise DataError(f"data position: step {step} is outside epoch {epoch}; the saved state is corrupt")
        self.position = DataPosition(epoch, step)
        self._prefetch()

    def close(self) -> None:
        if self._own_reader:
            self._reader.close()
        else:
            self._reader.keep_only(self, set())

    def __enter__(self) -> "PretrainingDataset":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_stream_args(shards: Sequence[Path], rank: int, world_size: int, items_per_rank_step: int, seed: int) -> None:
    if not shards:
        raise DataError("no training shards given; point --input_dir at a folder of *.hdf5 shards")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if items_per_rank_step < 1:
        raise ValueError(f"items_per_rank_step must be positive, got {items_per_rank_step}")
    if seed < 0:
        raise ValueError(f"the data seed must be >= 0, got {seed}")


def load_eval_set(
    eval_dir_or_file: Path | str, num_examples: int, rank: int, world_size: int, limits: DataLimits,
    shortfall_advice: str = "point the eval flag at the full eval set",
) -> list[Item]:
    """This rank's share of the first `num_examples` eval samples, one sample per item.

    shortfall_advice: the fix an error line gives when the source holds fewer samples (the
    caller knows which fixes its rules allow: a closed-division run may not evaluate fewer).

    Files are read in sorted order; packed rows are split into their sequences. Rank r gets
    samples r, r + W, r + 2W, ... so the ranks' counts differ by at most one.
    """
    if num_examples < 1:
        raise ValueError(f"num_examples must be positive, got {num_examples}")
    source = Path(eval_dir_or_file)
    if source.is_file():
        paths = [source]
    else:
        incomplete = folder_problems(source)
        if incomplete:
            raise DataError(incomplete[0])
        paths = list_shards(source)
    samples: list[Item] = []
    for path in paths:
        samples.extend((s,) for item in read_shard(path, limits) for s in item)
        if len(samples) >= num_examples:
            return samples[:num_examples][rank::world_size]
    raise DataError(
        f"{source}: {len(samples)} eval samples, fewer than the {num_examples} requested; {shortfall_advice}"
    )
