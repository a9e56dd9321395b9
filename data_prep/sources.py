"""Many input shards seen as one numbered sequence of samples, and balanced output shards.

Sample g of a SourceSet is row g - start(f) of the file f whose range holds it, files in the
order given (sorted by name by `list_shards`). Every later step (reshard, eval, pack,
stratify) reads its input through this, so it accepts this tool's per-part files as well as
MLCommons / NVIDIA fixed or varlength shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

from data_prep.fileio import Manifest, content_key
from data_prep.formats import DataPrepError
from mlperf_bert.data.shards import (
    MANIFEST_NAME, Samples, folder_shards, iter_blocks, offsets, read_manifest, read_samples, sequence_lengths,
    shard_info, shard_widths, write_samples,
)

READ_BLOCK_ROWS = 1 << 16  # rows per read when streaming a shard
LENGTH_NAMES = ("max_seq_length", "max_predictions")


def balanced_bounds(total: int, parts: int) -> np.ndarray:
    """[parts+1] boundaries splitting `total` items into `parts` runs whose sizes differ by at most one."""
    if parts < 1:
        raise DataPrepError(f"cannot split {total} samples into {parts} shards; give a positive shard count")
    return (np.arange(parts + 1, dtype=np.int64) * total) // parts


class SourceSet:
    """Fixed or varlength shards read as one sequence of samples."""

    def __init__(self, paths: list[Path]):
        self.paths = [Path(p) for p in paths]
        infos = [shard_info(p) for p in self.paths]
        packed = [p for p, (fmt, _) in zip(self.paths, infos) if fmt == "packed"]
        if packed:
            raise DataPrepError(f"{packed[0]}: is a packed shard; this step needs fixed or varlength samples")
        self.counts = np.array([rows for _, rows in infos], dtype=np.int64)
        self.starts = offsets(self.counts)

    @property
    def total(self) -> int:
        return int(self.starts[-1])

    def read_range(self, start: int, stop: int) -> Samples:
        """Samples [start, stop) of the whole set."""
        parts = []
        for path, first, count in zip(self.paths, self.starts[:-1], self.counts):
            lo, hi = max(start - first, 0), min(stop - first, count)
            if hi > lo:
                parts.append(read_samples(path, int(lo), int(hi)))
        return Samples.concat(parts)

    def gather(self, index: np.ndarray) -> Samples:
        """Samples `index` (any order), reading each file once, block by block."""
        index = np.asarray(index, dtype=np.int64)
        order = np.argsort(index, kind="stable")
        wanted = index[order]
        parts = []
        for start, block in self.blocks():
            lo, hi = np.searchsorted(wanted, [start, start + len(block)])
            if hi > lo:
                parts.append(block.take(wanted[lo:hi] - start))
        gathered = Samples.concat(parts)
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.shape[0])
        return gathered.take(inverse)

    def blocks(self, block_rows: int = READ_BLOCK_ROWS) -> Iterator[tuple[int, Samples]]:
        """(first global index, Samples) blocks over all files in order."""
        for path, start in zip(self.paths, self.starts[:-1]):
            position = int(start)
            for block in iter_blocks(path, block_rows):
                yield position, block
                position += len(block)

    def lengths(self) -> np.ndarray:
        """[total] real length of every sample."""
        return np.concatenate([sequence_lengths(p) for p in self.paths])


def write_formats(
    samples: Samples, name: str, manifests: dict[str, Manifest], max_seq_length: int, max_predictions: int,
    compression: str | None,
) -> None:
    """Writes one shard in every format of `manifests` (format -> its directory's manifest) and records it."""
    for fmt, manifest in manifests.items():
        write_samples(manifest.directory / name, samples, fmt, max_seq_length, max_predictions, compression)
        manifest.record(name, len(samples), fmt)


def inputs_record(paths: list[Path]) -> list[list]:
    """The content key of every input file (fileio.content_key), stored with a step's parameters:
    outputs of other inputs, even under the same names, are made again."""
    return [content_key(p) for p in paths]


def recorded_lengths(directory: Path) -> dict[str, tuple[int, str]]:
    """{"max_seq_length" / "max_predictions": (value, where it comes from)}, as far as a folder tells.

    Its MANIFEST.json parameters first; else the widths of its first shard when that is fixed
    (a packed shard gives only the row length: its prediction columns hold a whole row's).
    """
    if not directory.is_dir():
        return {}
    params = (read_manifest(directory) or {}).get("params", {})
    found = {k: (int(params[k]), f"{directory / MANIFEST_NAME}") for k in LENGTH_NAMES if params.get(k)}
    shards = folder_shards(directory)
    if shards and len(found) < len(LENGTH_NAMES):
        fmt, width, predictions = shard_widths(shards[0])
        widths = {"max_seq_length": width, "max_predictions": predictions if fmt == "fixed" else None}
        found = {k: (v, f"the width of {shards[0]}") for k, v in widths.items() if v is not None} | found
    return found


def agreed_length(given: int | None, recorded: dict[str, tuple[int, str]], name: str) -> int:
    """The length a step uses: the flag `--name` when given, which must match what the input records."""
    found = recorded.get(name)
    if given is not None:
        if found is not None and given != found[0]:
            raise DataPrepError(f"--{name} {given}, but the input was made with {name} {found[0]} ({found[1]}); "
                                f"pass --{name} {found[0]}, or remake the input with {given}")
        return given
    if found is None:
        raise DataPrepError(f"the input records no {name} (no MANIFEST.json, no fixed shard); pass --{name}")
    return found[0]

