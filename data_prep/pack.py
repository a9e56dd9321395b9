"""Step `pack`: training samples -> packed shards (up to K=3 sequences per L-token row).

L is the inputs' sequence length (their MANIFEST.json or fixed width); a --max_seq_length
that disagrees with it is refused.

The packing algorithms (NNLSHP, LPFHP, SPFHP) live in data_prep.packing and work on the
length histogram. To bound memory the samples are packed in groups of consecutive input
shards (about `group_samples` sequences each, each group its own histogram and plan; with
~10^6 sequences per group the histogram is smooth enough that the efficiency equals the
whole-set one). Packs keep the random order `assign_packs` gives them and are cut into
balanced output shards. Every sequence is checked to be in exactly one pack before anything
is written, and packing_report.json records efficiency, sequences per pack and drops (0).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data_prep.fileio import Manifest, read_json_object, write_json
from data_prep.formats import PACKING_REPORT_NAME, DataPrepError, shard_name
from data_prep.packing import assign_packs
from data_prep.sources import SourceSet, agreed_length, balanced_bounds, inputs_record, recorded_lengths
from mlperf_bert.data.shards import Samples, offsets, to_packed, write_arrays

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackParams:
    algorithm: str = "nnlshp"
    max_seq_length: int | None = None  # row length; default: the inputs' (MANIFEST.json or fixed width)
    max_sequences_per_pack: int = 3
    num_shards: int | None = None  # default: as many as there are input shards
    group_samples: int = 1_000_000  # sequences packed (and held in memory) together
    seed: int = 12345
    compression: str | None = None


def _groups(counts: np.ndarray, group_samples: int) -> list[tuple[int, int]]:
    """Consecutive file ranges [f0, f1) holding about `group_samples` samples (at least one file)."""
    groups, first, size = [], 0, 0
    for f, count in enumerate(counts.tolist()):
        if size and size + count > group_samples:
            groups.append((first, f))
            first, size = f, 0
        size += count
    groups.append((first, len(counts)))
    return groups


def pack_table(packs: list[np.ndarray], width: int) -> np.ndarray:
    """[P, width] sample indices of each pack, -1 in empty slots (slots filled left to right)."""
    sizes = np.fromiter((p.shape[0] for p in packs), dtype=np.int64, count=len(packs))
    if sizes.size and sizes.max() > width:
        raise DataPrepError(f"a pack holds {sizes.max()} sequences, more than --max_sequences_per_pack {width}")
    table = np.full((len(packs), width), -1, dtype=np.int64)
    row = np.repeat(np.arange(len(packs)), sizes)
    table[row, np.arange(row.shape[0]) - offsets(sizes)[row]] = np.concatenate(packs) if packs else []
    return table


def plan_packs(lengths: np.ndarray, file_counts: np.ndarray, params: PackParams, row_length: int) -> np.ndarray:
    """[P, K] global sample indices of every pack, group after group, each group's packs in random order."""
    starts = offsets(file_counts)
    tables = []
    for g, (f0, f1) in enumerate(_groups(file_counts, params.group_samples)):
        lo, hi = int(starts[f0]), int(starts[f1])
        rng = np.random.default_rng([params.seed, g])
        packs = assign_packs(lengths[lo:hi], params.algorithm, rng, row_length,
                             params.max_sequences_per_pack)
        table = pack_table(packs, params.max_sequences_per_pack)
        tables.append(np.where(table >= 0, table + lo, -1))
    return np.concatenate(tables)


def check_every_sample_once(table: np.ndarray, total: int) -> None:
    used = np.bincount(table[table >= 0], minlength=total)
    if used.shape[0] != total or not (used == 1).all():
        lost, repeated = int((used == 0).sum()), int((used > 1).sum())
        raise DataPrepError(
            f"packing is wrong: {lost} sequences in no pack, {repeated} in several; nothing was written")


def packing_report(table: np.ndarray, lengths: np.ndarray, params: PackParams, row_length: int) -> dict:
    """Efficiency (real tokens / row capacity), sequences per pack and the pack-size histogram.

    Only what the inputs and flags decide (no timings), so a rerun writes the same bytes.
    """
    per_pack = (table >= 0).sum(axis=1)
    packed = int(per_pack.sum())
    tokens = int(lengths.sum())
    return {
        "algorithm": params.algorithm, "max_sequences_per_pack": params.max_sequences_per_pack,
        "max_seq_length": row_length, "sequences": int(lengths.shape[0]), "packs": int(table.shape[0]),
        "tokens": tokens, "efficiency": tokens / max(table.shape[0] * row_length, 1),
        "sequences_per_pack": packed / max(table.shape[0], 1), "sequences_dropped": int(lengths.shape[0]) - packed,
        "packs_by_size": {str(k): int((per_pack == k).sum()) for k in range(1, params.max_sequences_per_pack + 1)},
    }


class _GroupReader:
    """Loads the samples of the few input ranges a shard's packs come from (keeps the last two)."""

    def __init__(self, sources: SourceSet, groups: list[tuple[int, int]]):
        self.sources = sources
        self.bounds = np.array([sources.starts[f0] for f0, _ in groups] + [sources.total], dtype=np.int64)
        self.cache: dict[int, Samples] = {}

    def group(self, g: int) -> Samples:
        if g not in self.cache:
            while len(self.cache) >= 2:
                self.cache.pop(next(iter(self.cache)))
            self.cache[g] = self.sources.read_range(int(self.bounds[g]), int(self.bounds[g + 1]))
        return self.cache[g]

    def samples_for(self, table: np.ndarray) -> tuple[Samples, np.ndarray]:
        """(Samples of the groups `table` touches, `table` re-indexed into them)."""
        valid = table >= 0
        group_of = np.searchsorted(self.bounds, table[valid], side="right") - 1
        groups, slot = np.unique(group_of, return_inverse=True)
        parts = [self.group(int(g)) for g in groups]
        local_start = offsets(np.array([len(p) for p in parts], dtype=np.int64))
        local = np.full_like(table, -1)
        local[valid] = table[valid] - self.bounds[group_of] + local_start[slot]
        return Samples.concat(parts), local


def pack_dataset(inputs: list[Path], out_dir: Path, params: PackParams) -> dict:
    """Packs `inputs` (fixed or varlength shards) into balanced packed shards in `out_dir`."""
    sources = SourceSet(inputs)
    length = agreed_length(params.max_seq_length, recorded_lengths(sources.paths[0].parent), "max_seq_length")
    num_shards = params.num_shards or len(sources.paths)
    manifest = Manifest.open(out_dir, "pack", {**asdict(params), "max_seq_length": length, "num_shards": num_shards,
                                               "inputs": inputs_record(sources.paths)})
    report_path = out_dir / PACKING_REPORT_NAME
    names = [shard_name(s, num_shards) for s in range(num_shards)]
    if report_path.is_file() and all(manifest.is_done(name) for name in names):
        log.info("pack: %s is complete", out_dir)
        return read_json_object(report_path)
    started = time.perf_counter()
    lengths = sources.lengths()
    table = plan_packs(lengths, sources.counts, params, length)
    check_every_sample_once(table, sources.total)
    if table.shape[0] < num_shards:
        raise DataPrepError(f"{table.shape[0]} packs cannot fill {num_shards} shards; use a smaller --num_pack_shards")
    report = packing_report(table, lengths, params, length)
    log.info("pack: %d sequences -> %d packs (%.4f efficiency, %.3f sequences per pack, %d dropped; planned in %.1f s)",
             report["sequences"], report["packs"], report["efficiency"], report["sequences_per_pack"],
             report["sequences_dropped"], time.perf_counter() - started)
    _write_shards(sources, table, names, manifest, params, length)
    write_json(report_path, report)
    return report


def _write_shards(sources: SourceSet, table: np.ndarray, names: list[str], manifest: Manifest,
                  params: PackParams, row_length: int) -> None:
    """Cuts the packs into balanced shards (in pack order) and writes the ones not done yet."""
    reader = _GroupReader(sources, _groups(sources.counts, params.group_samples))
    bounds = balanced_bounds(table.shape[0], len(names))
    for s, name in enumerate(tqdm(names, desc="pack write", unit="shard")):
        if not manifest.is_done(name):
            samples, local = reader.samples_for(table[bounds[s]:bounds[s + 1]])
            write_arrays(manifest.directory / name, to_packed(samples, local, row_length),
                         params.compression)
            manifest.record(name, int(bounds[s + 1] - bounds[s]), "packed", sequences=int((local >= 0).sum()))
