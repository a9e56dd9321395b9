"""Stratified local batches: a fixed count of samples from each length stratum per step.

A stratified dataset folder (`data_prep/prepare.py stratify`) holds one sub-folder of shards
per length stratum, `stratum_0` .. `stratum_{S-1}`, and `strata.json`:
    {"bounds": [128, 256, 384, 512], "counts": [...], "shares": [...], "shards": [...], "format": ...}
(stratum k holds the lengths (bounds[k-1], bounds[k]]; shares = counts / total).

Every local batch of B samples takes c_k samples from stratum k, with c = the shares times B,
largest-remainder rounded (`stratum_counts`: 6/3/2/5 at B = 16 on Wikipedia). Each
stratum is its own `PretrainingDataset` stream with c_k items per rank and step, so within a
stratum every sample is used exactly once per pass, in a random order, split over the ranks
as in `dataset.py`. The strata run through their passes at nearly the same pace (c_k / B is
close to the stratum's share), not in lockstep.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .batch import Item
from .dataset import DataError, DataLimits, PretrainingDataset, ShardReaders, discover_shards

STRATA_FILE = "strata.json"
STRATUM_BOUNDS = (128, 256, 384, 512)  # upper bounds of the length strata, tokens


def stratum_shares(counts: np.ndarray, bounds: Sequence[int] = STRATUM_BOUNDS) -> list[float]:
    """Fraction of sequences in each length stratum (lengths (bounds[s-1], bounds[s]]).

    `counts[i]` = sequences of length i + 1 (the package's histogram convention).
    """
    counts = np.asarray(counts, dtype=np.float64)
    edges = [0, *bounds]
    if list(edges) != sorted(set(edges)) or edges[-1] != counts.shape[0]:
        raise ValueError(
            f"stratum bounds must increase and end at the histogram length {counts.shape[0]}, got {tuple(bounds)}"
        )
    total = counts.sum()
    if total <= 0:
        raise ValueError("the length histogram is empty")
    return [float(counts[lo:hi].sum() / total) for lo, hi in zip(edges[:-1], edges[1:])]


def stratum_counts(shares: Sequence[float], local_batch: int) -> list[int]:
    """Samples per stratum in one local batch: shares * local_batch, largest-remainder rounded.

    Floors every quota, then gives the samples still missing to the strata with the largest
    fractional parts, so the counts sum to local_batch exactly (6/3/2/5 for the Wikipedia
    shares at 16).
    """
    shares_arr = np.asarray(shares, dtype=np.float64)
    if local_batch < 1 or (shares_arr < 0).any() or not np.isclose(shares_arr.sum(), 1.0):
        raise ValueError(f"need local_batch >= 1 and non-negative shares summing to 1, got {local_batch}, {shares}")
    quotas = shares_arr * local_batch
    counts = np.floor(quotas).astype(np.int64)
    missing = local_batch - int(counts.sum())
    by_remainder = np.argsort(-(quotas - counts), kind="stable")
    counts[by_remainder[:missing]] += 1
    return [int(c) for c in counts]


def is_stratified(input_dir: Path | str) -> bool:
    return (Path(input_dir) / STRATA_FILE).is_file()


def stratum_dir(input_dir: Path | str, k: int) -> Path:
    return Path(input_dir) / f"stratum_{k}"


@dataclass(frozen=True)
class Strata:
    """The contents of strata.json."""

    bounds: tuple[int, ...]  # upper length bound of each stratum, tokens
    counts: tuple[int, ...]  # samples in each stratum
    shares: tuple[float, ...]  # counts / total

    @classmethod
    def read(cls, input_dir: Path | str) -> "Strata":
        path = Path(input_dir) / STRATA_FILE
        try:
            record = json.loads(path.read_text())
            strata = cls(tuple(int(b) for b in record["bounds"]), tuple(int(c) for c in record["counts"]),
                         tuple(float(s) for s in record["shares"]))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise DataError(f"{path}: not a readable strata record ({err}); rerun `data_prep/prepare.py stratify`") from err
        strata.check(path)
        return strata

    def check(self, path: Path) -> None:
        if not len(self.bounds) == len(self.counts) == len(self.shares) or not self.bounds:
            raise DataError(f"{path}: bounds, counts and shares must have one entry per stratum")
        if list(self.bounds) != sorted(set(self.bounds)) or min(self.counts) < 0 or sum(self.counts) == 0:
            raise DataError(f"{path}: bounds must increase and counts be non-negative with a positive total")
        if abs(sum(self.shares) - 1.0) > 1e-6 or min(self.shares) < 0:
            raise DataError(f"{path}: shares must be non-negative and sum to 1, got {list(self.shares)}")

    def per_batch(self, local_batch: int) -> list[int]:
        """Samples of each stratum in one local batch; refuses a batch too small to reach every stratum."""
        counts = stratum_counts(self.shares, local_batch)
        starved = [k for k, (n, c) in enumerate(zip(counts, self.counts)) if n == 0 and c > 0]
        if starved:
            raise DataError(
                f"a local batch of {local_batch} takes no sample from strata {starved} (shares "
                f"{[round(s, 4) for s in self.shares]}), so they would never be trained on; "
                "use a larger micro-batch or unstratified data"
            )
        return counts


class StratifiedDataset:
    """This rank's stream of stratified micro-batches; the `PretrainingDataset` interface.

    Stratum k's stream uses seed `seed * S + k` (S strata), so the strata shuffle independently
    and the same seed gives the same batches. readers: shared by several streams over the folder
    (`PretrainingDataset`).
    """

    def __init__(self, input_dir: Path | str, limits: DataLimits, *, rank: int, world_size: int,
                 items_per_rank_step: int, seed: int, read_ahead: bool = True,
                 readers: ShardReaders | None = None) -> None:
        self.strata = Strata.read(input_dir)
        self.per_batch = self.strata.per_batch(items_per_rank_step)
        num = len(self.per_batch)
        self.streams: dict[int, PretrainingDataset] = {}
        try:
            for k in (k for k in range(num) if self.per_batch[k] > 0):
                self.streams[k] = PretrainingDataset(
                    discover_shards(stratum_dir(input_dir, k)), limits, rank=rank, world_size=world_size,
                    items_per_rank_step=self.per_batch[k], seed=seed * num + k, read_ahead=read_ahead,
                    readers=readers)
                _check_total(input_dir, k, self.streams[k].total_items, self.strata.counts[k])
        except BaseException:
            self.close()
            raise

    def next_batch(self) -> list[Item]:
        """c_0 items of stratum 0, then c_1 of stratum 1, ...; then every stream moves on one step."""
        return [item for stream in self.streams.values() for item in stream.next_batch()]

    def state_dict(self) -> dict:
        return {"per_batch": list(self.per_batch), "strata": {str(k): s.state_dict() for k, s in self.streams.items()}}

    def load_state_dict(self, state: dict) -> None:
        if list(state.get("per_batch", [])) != self.per_batch:
            raise DataError(
                f"data position: saved with stratum counts {state.get('per_batch')}, this run takes "
                f"{self.per_batch}; resume with the same data and micro-batch size"
            )
        for k, stream in self.streams.items():
            stream.load_state_dict(state["strata"][str(k)])

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()


def _check_total(input_dir: Path | str, k: int, found: int, recorded: int) -> None:
    if found != recorded:
        raise DataError(
            f"{stratum_dir(input_dir, k)}: {found} samples in the shards, {STRATA_FILE} records {recorded}; "
            "rerun `data_prep/prepare.py stratify` into an empty folder"
        )
