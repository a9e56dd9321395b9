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
from data_prep.h5io import iter_blocks, read_samples, sequence_lengths, shard_info, write_samples
from data_prep.ragged import Samples, offsets

READ_BLOCK_ROWS = 1 << 16  # rows per read when streaming a shard


def list_shards(path: Path | str) -> list[Path]:
    """The *.hdf5 / *.h5 files of a folder, sorted by name (or the file itself)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataPrepError(f"{path}: no such file or folder; give the folder that holds the input shards")
    shards = sorted(p for p in path.iterdir() if p.suffix in (".hdf5", ".h5") and p.is_file())
    if not shards:
        raise DataPrepError(f"{path}: no *.hdf5 or *.h5 files; run the step that makes them first")
    return shards


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
