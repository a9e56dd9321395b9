"""Reading and writing hdf5 shards of every format, in row blocks, with clear errors.

A shard that h5py cannot open or read (truncated copy, disk full during writing) becomes a
`DataPrepError` naming the file. Writes go through `atomic_output`, so a shard exists under
its real name only once it is complete.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import h5py
import numpy as np

from data_prep.fileio import atomic_output
from data_prep.formats import FORMAT_KEYS, DataPrepError, detect_format
from data_prep.ragged import Samples, from_fixed, from_packed, from_varlength, to_fixed, to_varlength

CHUNK_BYTES = 1 << 19  # ~512 KiB hdf5 chunks for appended datasets
CORRUPT_FIX = "the file is truncated or corrupt; delete it and rerun the step that made it (or re-copy it)"


@contextmanager
def open_h5(path: Path | str, mode: str = "r") -> Iterator[h5py.File]:
    """h5py.File whose open and read failures are DataPrepErrors naming the file."""
    path = Path(path)
    try:
        handle = h5py.File(path, mode)
    except (OSError, ValueError) as err:
        raise DataPrepError(f"{path}: cannot be opened as hdf5 ({err}); {CORRUPT_FIX}") from err
    try:
        with handle:
            yield handle
    except (OSError, RuntimeError) as err:
        raise DataPrepError(f"{path}: reading failed ({err}); {CORRUPT_FIX}") from err


def shard_info(path: Path | str) -> tuple[str, int]:
    """(format, rows) of a shard from its metadata alone."""
    with open_h5(path) as handle:
        fmt = detect_format(handle)
        missing = [k for k in FORMAT_KEYS[fmt] if k not in handle]
        if missing:
            raise DataPrepError(f"{path}: {fmt} shard without key {missing[0]!r}; re-create it")
        return fmt, int(handle["input_ids"].shape[0])


def read_rows(handle: h5py.File, fmt: str, start: int, stop: int) -> Samples:
    """Rows [start, stop) as Samples (for packed shards: all sequences of those rows)."""
    arrays = {k: handle[k][start:stop] for k in FORMAT_KEYS[fmt]}
    if fmt == "fixed":
        return from_fixed(arrays)
    if fmt == "varlength":
        return from_varlength(arrays)
    return from_packed(arrays)[0]


def read_samples(path: Path | str, start: int = 0, stop: int | None = None) -> Samples:
    """Rows [start, stop) of a shard of any format (whole shard by default)."""
    with open_h5(path) as handle:
        fmt = detect_format(handle)
        stop = int(handle["input_ids"].shape[0]) if stop is None else stop
        try:
            return read_rows(handle, fmt, start, stop)
        except DataPrepError as err:
            raise DataPrepError(f"{path}: {err}") from err


def iter_blocks(path: Path | str, block_rows: int) -> Iterator[Samples]:
    """The shard's rows as consecutive Samples blocks of at most `block_rows` rows."""
    with open_h5(path) as handle:
        fmt = detect_format(handle)
        rows = int(handle["input_ids"].shape[0])
        for start in range(0, rows, block_rows):
            yield read_rows(handle, fmt, start, min(start + block_rows, rows))


def sequence_lengths(path: Path | str) -> np.ndarray:
    """[rows] real length of every row of a fixed or varlength shard."""
    with open_h5(path) as handle:
        fmt = detect_format(handle)
        if fmt == "fixed":
            return handle["input_mask"][()].astype(bool).sum(axis=1).astype(np.int64)
        if fmt == "varlength":
            rows = handle["segment_ids"][()]
            return np.fromiter((r.shape[0] for r in rows), dtype=np.int64, count=rows.shape[0])
    raise DataPrepError(f"{path}: a packed shard has no per-row length; give fixed or varlength shards")


def _create(handle: h5py.File, key: str, values: np.ndarray, compression: str | None) -> None:
    if values.dtype == object:
        dtype = h5py.vlen_dtype(values[0].dtype if values.shape[0] else np.int16)
        dataset = handle.create_dataset(key, shape=values.shape, dtype=dtype, compression=compression)
        if len({row.shape[0] for row in values}) > 1:
            dataset[...] = values
        else:
            # h5py turns an object array of equal-length rows into a 2-D array and refuses
            # it, so such a column (e.g. a stratum of one length) is written row by row.
            for i, row in enumerate(values):
                dataset[i] = row
    else:
        handle.create_dataset(key, data=values, compression=compression)


def write_arrays(path: Path | str, arrays: dict[str, np.ndarray], compression: str | None = None) -> None:
    """Writes one shard atomically; object arrays become hdf5 variable-length datasets."""
    with atomic_output(Path(path)) as temp, h5py.File(temp, "w") as handle:
        for key, values in arrays.items():
            _create(handle, key, values, compression)


def write_samples(
    path: Path | str, samples: Samples, fmt: str, max_seq_length: int, max_predictions: int,
    compression: str | None = None,
) -> None:
    """Writes Samples as a fixed or varlength shard."""
    if fmt == "fixed":
        arrays = to_fixed(samples, max_seq_length, max_predictions)
    elif fmt == "varlength":
        arrays = to_varlength(samples)
    else:
        raise DataPrepError(f"unknown sample format {fmt!r}; choose fixed or varlength")
    write_arrays(path, arrays, compression)


class ArrayAppender:
    """Appends row blocks to resizable datasets of an open, writable hdf5 file.

    Datasets are created by the first block, with the shapes and dtypes it has; chunks of
    about CHUNK_BYTES keep appends and later sequential reads cheap.
    """

    def __init__(self, handle: h5py.File, compression: str | None = None):
        self.handle = handle
        self.compression = compression
        self.rows = 0

    def _dataset(self, key: str, block: np.ndarray) -> h5py.Dataset:
        if key not in self.handle:
            row_shape = block.shape[1:]
            row_bytes = max(int(np.prod(row_shape, dtype=np.int64)) * block.dtype.itemsize, 1)
            chunk = (max(CHUNK_BYTES // row_bytes, 1),) + row_shape
            self.handle.create_dataset(key, shape=(0,) + row_shape, maxshape=(None,) + row_shape,
                                       dtype=block.dtype, chunks=chunk, compression=self.compression)
        return self.handle[key]

    def append(self, arrays: dict[str, np.ndarray]) -> None:
        for key, block in arrays.items():
            dataset = self._dataset(key, block)
            start = dataset.shape[0]
            dataset.resize(start + block.shape[0], axis=0)
            dataset[start:] = block
        self.rows = int(self.handle[next(iter(arrays))].shape[0])
