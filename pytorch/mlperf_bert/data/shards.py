"""The hdf5 shard format in one place: keys, dtypes, recognition, decoding, reading, writing.

The trainer and data_prep both use this module; docs/ARCHITECTURE.md describes the formats
(fixed, varlength, packed, stratified folders). In memory every format becomes `Samples`:
the real tokens of N sequences concatenated into flat vectors plus per-sequence lengths, and
the masked positions likewise, so decoding, conversion and checks are a handful of numpy
calls instead of a Python loop per sequence. Readers accept any integer dtype; writers use
the MLCommons widths (`STORAGE_DTYPES`). A file h5py cannot open or read becomes a
`DataError` naming it, and a shard appears under its real name only once complete.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator, Sequence

import h5py
import numpy as np

from ..runtime.files import TEMP_MARK, atomic_path

FIXED_KEYS = (
    "input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
    "next_sentence_labels",
)
VARLENGTH_KEYS = ("input_ids", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels")
PACKED_KEYS = VARLENGTH_KEYS + ("packed_input_len", "packed_masked_lm_len")
FORMAT_KEYS = {"fixed": FIXED_KEYS, "varlength": VARLENGTH_KEYS, "packed": PACKED_KEYS}
TOKEN_KEYS = ("input_ids", "input_mask", "segment_ids")  # [N, L] in fixed and packed shards
PREDICTION_KEYS = ("masked_lm_positions", "masked_lm_ids")  # [N, P] (packed: [N, Q])
SLOT_KEYS = ("next_sentence_labels", "packed_input_len", "packed_masked_lm_len")  # [N, K] in packed shards

# Storage dtypes. int16 ids hold vocabularies of up to 32,767 entries (MLPerf: 30,522).
STORAGE_DTYPES: dict[str, type[np.signedinteger]] = {
    "input_ids": np.int16,
    "input_mask": np.int8,
    "segment_ids": np.int8,
    "masked_lm_positions": np.int16,
    "masked_lm_ids": np.int16,
    "next_sentence_labels": np.int8,
    "packed_input_len": np.int16,
    "packed_masked_lm_len": np.int16,
}
MAX_VOCAB_SIZE = int(np.iinfo(np.int16).max) + 1

SHARD_SUFFIXES = (".hdf5", ".h5")
MANIFEST_NAME = "MANIFEST.json"
STRATA_NAME = "strata.json"  # the last file `stratify` writes
PACKING_REPORT_NAME = "packing_report.json"  # the last file `pack` writes
REFUSED_NAME = "VERIFICATION_FAILED.txt"  # data_prep verified the folder and refused it; the problems inside
CHUNK_BYTES = 1 << 19  # ~512 KiB hdf5 chunks for appended datasets
REGENERATE = "regenerate the shard with data_prep"
CORRUPT = "the file is truncated or corrupt; re-copy it or rerun the step that made it"
_NUMBERED = re.compile(r"part_(\d+)_of_(\d+)\.hdf5$")


class DataError(ValueError):
    """Bad training, eval or input data; the message names the file, the problem and the fix."""


# ---------------------------------------------------------------- flat sequences in memory

def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[sum(lengths)] int64: start_0 .. start_0+len_0-1, start_1 .. , as one vector.

    Ones with a jump at the first entry of each range, summed up: one cumsum, no repeat of the
    starts (the per-token step of the integrity hashes and of `Samples.take`).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    full = lengths > 0
    begin, size = np.broadcast_to(np.asarray(starts, dtype=np.int64), lengths.shape)[full], lengths[full]
    out = np.ones(int(lengths.sum()), dtype=np.int64)
    if out.size:
        first = offsets(size)[:-1]  # where each non-empty range begins in `out`
        out[0] = begin[0]
        out[first[1:]] = begin[1:] - (begin[:-1] + size[:-1] - 1)  # from the last of the previous range
    return np.cumsum(out, out=out)


def segment_sums(values: np.ndarray, lengths: np.ndarray, dtype: type | None = None) -> np.ndarray:
    """[N] sums of consecutive runs of `values` of the given lengths (0 allowed), in `dtype`
    (default: values'; unsigned integers wrap)."""
    sums = np.zeros(lengths.shape[0], dtype=dtype or values.dtype)
    full = lengths > 0
    if full.any():  # reduceat sums from each start to the next; empty runs have none
        sums[full] = np.add.reduceat(values, offsets(lengths)[:-1][full], dtype=sums.dtype)
    return sums


def offsets(lengths: np.ndarray) -> np.ndarray:
    """[N+1] int64 exclusive prefix sum: item i spans [offsets[i], offsets[i+1])."""
    out = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


@dataclass
class Samples:
    """N sequences as flat vectors. T = total tokens, M = total masked positions."""

    input_ids: np.ndarray  # [T] int32 token ids, [CLS] A [SEP] B [SEP] per sequence
    segment_ids: np.ndarray  # [T] int8, 0 for [CLS] A [SEP], 1 for B [SEP]
    lengths: np.ndarray  # [N] int64 tokens per sequence
    masked_lm_positions: np.ndarray  # [M] int32 positions inside their own sequence, ascending
    masked_lm_ids: np.ndarray  # [M] int32 original token at each masked position
    num_predictions: np.ndarray  # [N] int64 masked positions per sequence
    next_sentence_labels: np.ndarray  # [N] int8, 1 when B is a random sentence

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @classmethod
    def empty(cls) -> Samples:
        dtypes = (np.int32, np.int8, np.int64, np.int32, np.int32, np.int64, np.int8)  # in field order
        return cls(*(np.zeros(0, dtype=d) for d in dtypes))

    def take(self, index: np.ndarray) -> Samples:
        """The sequences `index` (any order, repeats allowed) as a new Samples."""
        index = np.asarray(index, dtype=np.int64)
        tok = concat_ranges(offsets(self.lengths)[:-1][index], self.lengths[index])
        pred = concat_ranges(offsets(self.num_predictions)[:-1][index], self.num_predictions[index])
        return Samples(
            input_ids=self.input_ids[tok], segment_ids=self.segment_ids[tok], lengths=self.lengths[index],
            masked_lm_positions=self.masked_lm_positions[pred], masked_lm_ids=self.masked_lm_ids[pred],
            num_predictions=self.num_predictions[index], next_sentence_labels=self.next_sentence_labels[index],
        )

    def slice(self, start: int, stop: int) -> Samples:
        return self.take(np.arange(start, stop))

    @staticmethod
    def concat(parts: Sequence[Samples]) -> Samples:
        if not parts:
            return Samples.empty()
        return Samples(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(Samples)))

    def original_ids(self) -> np.ndarray:
        """[T] the token ids before masking: masked slots get their label back."""
        ids = self.input_ids.copy()
        seq = np.repeat(np.arange(len(self)), self.num_predictions)
        ids[offsets(self.lengths)[seq] + self.masked_lm_positions] = self.masked_lm_ids
        return ids


# ---------------------------------------------------------------- the layouts on disk

def storage_dtype(key: str, values: np.ndarray) -> type[np.signedinteger]:
    """`STORAGE_DTYPES[key]`, widened to int32 when a value does not fit (ids of a vocabulary over 32,768)."""
    dtype = STORAGE_DTYPES[key]
    info = np.iinfo(dtype)
    if values.size and (values.max() > info.max or values.min() < info.min):
        return np.int32
    return dtype


def _check_fits(samples: Samples, max_seq_length: int, max_predictions: int) -> None:
    if len(samples) and samples.lengths.max() > max_seq_length:
        raise DataError(f"a sequence has {samples.lengths.max()} tokens, more than max_seq_length={max_seq_length}")
    if len(samples) and samples.num_predictions.max() > max_predictions:
        raise DataError(
            f"a sequence has {samples.num_predictions.max()} predictions, more than max_predictions={max_predictions}"
        )


def to_fixed(samples: Samples, max_seq_length: int, max_predictions: int) -> dict[str, np.ndarray]:
    """The MLCommons padded arrays: [N, L] tokens, [N, P] predictions (0 = padding slot)."""
    _check_fits(samples, max_seq_length, max_predictions)
    n = len(samples)
    keep = np.arange(max_seq_length) < samples.lengths[:, None]  # [N, L]
    real = np.arange(max_predictions) < samples.num_predictions[:, None]  # [N, P]
    out = {
        "input_ids": np.zeros((n, max_seq_length), storage_dtype("input_ids", samples.input_ids)),
        "input_mask": keep.astype(STORAGE_DTYPES["input_mask"]),
        "segment_ids": np.zeros((n, max_seq_length), STORAGE_DTYPES["segment_ids"]),
        "masked_lm_positions": np.zeros((n, max_predictions), STORAGE_DTYPES["masked_lm_positions"]),
        "masked_lm_ids": np.zeros((n, max_predictions), storage_dtype("masked_lm_ids", samples.masked_lm_ids)),
        "next_sentence_labels": samples.next_sentence_labels.astype(STORAGE_DTYPES["next_sentence_labels"]),
    }
    out["input_ids"][keep] = samples.input_ids
    out["segment_ids"][keep] = samples.segment_ids
    out["masked_lm_positions"][real] = samples.masked_lm_positions
    out["masked_lm_ids"][real] = samples.masked_lm_ids
    return out


def from_fixed(arrays: dict[str, np.ndarray]) -> Samples:
    """Inverse of `to_fixed`; real tokens are where input_mask is 1, predictions where position != 0."""
    keep = arrays["input_mask"].astype(bool)
    real = arrays["masked_lm_positions"] != 0
    labels = np.asarray(arrays["next_sentence_labels"]).reshape(-1)
    return Samples(
        input_ids=arrays["input_ids"][keep].astype(np.int32), segment_ids=arrays["segment_ids"][keep].astype(np.int8),
        lengths=keep.sum(axis=1).astype(np.int64),
        masked_lm_positions=arrays["masked_lm_positions"][real].astype(np.int32),
        masked_lm_ids=arrays["masked_lm_ids"][real].astype(np.int32),
        num_predictions=real.sum(axis=1).astype(np.int64), next_sentence_labels=labels.astype(np.int8),
    )


def _split_rows(values: np.ndarray, lengths: np.ndarray, key: str) -> np.ndarray:
    """Object array [N] of per-row arrays, the value form of an hdf5 variable-length dataset."""
    values, bounds = values.astype(storage_dtype(key, values)), offsets(lengths).tolist()
    # fromiter keeps one object per row even when all rows have the same length
    return np.fromiter((values[a:b] for a, b in zip(bounds[:-1], bounds[1:])), dtype=object, count=lengths.shape[0])


def to_varlength(samples: Samples) -> dict[str, np.ndarray]:
    """NVIDIA's trimmed rows: object arrays of per-sequence vectors, plus the [N] labels."""
    return {
        "input_ids": _split_rows(samples.input_ids, samples.lengths, "input_ids"),
        "segment_ids": _split_rows(samples.segment_ids, samples.lengths, "segment_ids"),
        "masked_lm_positions": _split_rows(samples.masked_lm_positions, samples.num_predictions, "masked_lm_positions"),
        "masked_lm_ids": _split_rows(samples.masked_lm_ids, samples.num_predictions, "masked_lm_ids"),
        "next_sentence_labels": samples.next_sentence_labels.astype(STORAGE_DTYPES["next_sentence_labels"]),
    }


def _join_rows(rows: np.ndarray, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    # map(len) and concatenate's own cast: one pass over the rows each (h5py hands one array per row)
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=rows.shape[0])
    flat: np.ndarray = np.concatenate(list(rows), dtype=dtype) if rows.shape[0] else np.zeros(0, dtype)
    return flat, lengths


def from_varlength(arrays: dict[str, np.ndarray]) -> Samples:
    """Inverse of `to_varlength`. Row-length mismatches between keys raise DataError."""
    ids, lengths = _join_rows(arrays["input_ids"], np.int32)
    seg, seg_lengths = _join_rows(arrays["segment_ids"], np.int8)
    pos, counts = _join_rows(arrays["masked_lm_positions"], np.int32)
    labels, label_counts = _join_rows(arrays["masked_lm_ids"], np.int32)
    for name, got, want in (("segment_ids", seg_lengths, lengths), ("masked_lm_ids", label_counts, counts)):
        if not np.array_equal(got, want):
            row = int(np.flatnonzero(got != want)[0])
            raise DataError(f"row {row}: {name} has {got[row]} entries, expected {want[row]}")
    return Samples(ids, seg, lengths, pos, labels, counts,
                   np.asarray(arrays["next_sentence_labels"]).reshape(-1).astype(np.int8))


def to_packed(samples: Samples, packs: np.ndarray, max_seq_length: int) -> dict[str, np.ndarray]:
    """Packed rows: `packs` [R, K] holds the sample indices of each row, -1 for an empty slot.

    Slots are filled left to right; sequence j of a row starts where sequence j-1 ends, and
    its masked positions are shifted by that start. Q, the width of the prediction arrays,
    is the largest number of predictions in one row.
    """
    valid = packs >= 0  # [R, K]
    if np.any(valid[:, 1:] & ~valid[:, :-1]):
        raise DataError("packs must fill their slots left to right (an empty slot is followed by a full one)")
    seqs = samples.take(packs[valid])  # row-major slot order
    input_len = np.zeros(packs.shape, np.int64)
    input_len[valid] = seqs.lengths
    mlm_len = np.zeros(packs.shape, np.int64)
    mlm_len[valid] = seqs.num_predictions
    row_len, row_pred = input_len.sum(axis=1), mlm_len.sum(axis=1)
    if row_len.size and row_len.max() > max_seq_length:
        raise DataError(f"a pack holds {row_len.max()} tokens, more than max_seq_length={max_seq_length}")
    width = max(int(row_pred.max()) if row_pred.size else 0, 1)
    keep = np.arange(max_seq_length) < row_len[:, None]
    real = np.arange(width) < row_pred[:, None]
    slot_start = np.cumsum(input_len, axis=1) - input_len  # [R, K] first row position of each slot
    rows = packs.shape[0]
    out = {
        "input_ids": np.zeros((rows, max_seq_length), storage_dtype("input_ids", seqs.input_ids)),
        "segment_ids": np.zeros((rows, max_seq_length), STORAGE_DTYPES["segment_ids"]),
        "masked_lm_positions": np.zeros((rows, width), STORAGE_DTYPES["masked_lm_positions"]),
        "masked_lm_ids": np.zeros((rows, width), storage_dtype("masked_lm_ids", seqs.masked_lm_ids)),
        "next_sentence_labels": np.full(packs.shape, -1, STORAGE_DTYPES["next_sentence_labels"]),
        "packed_input_len": input_len.astype(STORAGE_DTYPES["packed_input_len"]),
        "packed_masked_lm_len": mlm_len.astype(STORAGE_DTYPES["packed_masked_lm_len"]),
    }
    out["input_ids"][keep] = seqs.input_ids
    out["segment_ids"][keep] = seqs.segment_ids
    out["masked_lm_positions"][real] = seqs.masked_lm_positions + np.repeat(slot_start[valid], seqs.num_predictions)
    out["masked_lm_ids"][real] = seqs.masked_lm_ids
    out["next_sentence_labels"][valid] = seqs.next_sentence_labels
    return out


def from_packed(arrays: dict[str, np.ndarray]) -> tuple[Samples, np.ndarray]:
    """Inverse of `to_packed`: the sequences in row-major slot order and [S] the row of each."""
    input_len = arrays["packed_input_len"].astype(np.int64)
    mlm_len = arrays["packed_masked_lm_len"].astype(np.int64)
    valid = input_len > 0
    keep = np.arange(arrays["input_ids"].shape[1]) < input_len.sum(axis=1, keepdims=True)
    real = np.arange(arrays["masked_lm_positions"].shape[1]) < mlm_len.sum(axis=1, keepdims=True)
    slot_start = np.cumsum(input_len, axis=1) - input_len
    positions = arrays["masked_lm_positions"][real].astype(np.int64) - np.repeat(slot_start[valid], mlm_len[valid])
    samples = Samples(
        input_ids=arrays["input_ids"][keep].astype(np.int32), segment_ids=arrays["segment_ids"][keep].astype(np.int8),
        lengths=input_len[valid], masked_lm_positions=positions.astype(np.int32),
        masked_lm_ids=arrays["masked_lm_ids"][real].astype(np.int32), num_predictions=mlm_len[valid],
        next_sentence_labels=arrays["next_sentence_labels"][valid].astype(np.int8),
    )
    return samples, np.nonzero(valid)[0].astype(np.int64)


def decode(arrays: dict[str, np.ndarray], fmt: str) -> tuple[Samples, np.ndarray]:
    """(Samples, [S] row of each sequence, counted from the first row of `arrays`)."""
    if fmt == "packed":
        return from_packed(arrays)
    samples = from_fixed(arrays) if fmt == "fixed" else from_varlength(arrays)
    return samples, np.arange(len(samples), dtype=np.int64)


# ---------------------------------------------------------------- checks of the raw layout

def _any_per_row(bad: np.ndarray) -> np.ndarray:
    return np.asarray(bad.reshape(bad.shape[0], -1).any(axis=1))


def _fixed_layout_checks(a: dict[str, np.ndarray]) -> list[tuple[np.ndarray, str]]:
    mask = a["input_mask"]
    bad = _any_per_row((mask != 0) & (mask != 1)) | _any_per_row(np.diff(mask.astype(np.int8), axis=1) > 0)
    return [(bad, "input_mask is not a prefix of ones followed by zeros")]


def _packed_layout_checks(a: dict[str, np.ndarray]) -> list[tuple[np.ndarray, str]]:
    input_len, mlm_len = a["packed_input_len"].astype(np.int64), a["packed_masked_lm_len"].astype(np.int64)
    width, q = a["input_ids"].shape[1], a["masked_lm_positions"].shape[1]
    return [
        (_any_per_row((input_len < 0) | (mlm_len < 0)), "negative packed length"),
        (input_len.sum(axis=1) > width, f"packed_input_len sums beyond the row width {width}"),
        (mlm_len.sum(axis=1) > q, f"packed_masked_lm_len sums beyond the {q} masked_lm_positions columns"),
        (_any_per_row((input_len == 0) & (mlm_len != 0)), "an empty slot (packed_input_len 0) has predictions"),
        ((input_len == 0).all(axis=1), "the row holds no sequence (all packed_input_len are 0)"),
    ]


def layout_checks(arrays: dict[str, np.ndarray], fmt: str) -> list[tuple[np.ndarray, str]]:
    """(bad [rows] mask, problem) for what decoding relies on: the input_mask prefix, the packed slots.

    Padding slots of the predictions may lie anywhere (position 0 marks them); what data_prep
    writes is stricter, and data_prep/verify_dataset.py checks that too.
    """
    if fmt == "fixed":
        return _fixed_layout_checks(arrays)
    if fmt == "packed":
        return _packed_layout_checks(arrays)
    return []


# ---------------------------------------------------------------- reading

@contextmanager
def open_shard(path: Path | str, mode: str = "r") -> Iterator[h5py.File]:
    """h5py.File whose open and read failures are DataErrors naming the file."""
    path = Path(path)
    try:
        handle = h5py.File(path, mode)
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: cannot be opened as hdf5 ({err}); {CORRUPT}") from err
    try:
        with handle:
            yield handle
    except (OSError, RuntimeError) as err:
        raise DataError(f"{path}: reading failed ({err}); {CORRUPT}") from err


def is_vlen(handle: h5py.File, key: str) -> bool:
    return h5py.check_vlen_dtype(handle[key].dtype) is not None


def detect_format(handle: h5py.File) -> str:
    """'packed' when packed_input_len exists, 'varlength' for a variable-length input_ids, else 'fixed'."""
    if "input_ids" not in handle:
        found = ", ".join(sorted(handle.keys())) or "no keys"
        raise DataError(f"{handle.filename}: key 'input_ids' missing (found: {found}); not a BERT shard, {REGENERATE}")
    if not isinstance(handle["input_ids"], h5py.Dataset):
        raise DataError(f"{handle.filename}: 'input_ids' is an hdf5 group, not a dataset; {REGENERATE}")
    if "packed_input_len" in handle:
        return "packed"
    return "varlength" if is_vlen(handle, "input_ids") else "fixed"


def _expected_ndim(fmt: str, key: str) -> int:
    if fmt == "varlength" or (fmt == "fixed" and key == "next_sentence_labels"):
        return 1
    return 2


def _key_problem(handle: h5py.File, fmt: str, key: str) -> str | None:
    """What is wrong with the dtype or rank of one dataset, from metadata alone."""
    if key not in handle:
        return f"key {key!r} missing (found: {', '.join(sorted(handle.keys()))}; a {fmt} shard needs it)"
    if not isinstance(handle[key], h5py.Dataset):
        return f"{key!r} is an hdf5 group, not a dataset"
    vlen = fmt == "varlength" and key != "next_sentence_labels"
    if is_vlen(handle, key) != vlen:
        kind = "variable-length" if is_vlen(handle, key) else "fixed-width"
        return f"key {key!r} is {kind}, which the {fmt} format (recognised from the other keys) does not allow"
    dtype = h5py.check_vlen_dtype(handle[key].dtype) if vlen else handle[key].dtype
    shape = handle[key].shape
    ndim = 1 if key == "next_sentence_labels" and len(shape) == 2 and shape[1] == 1 and fmt == "fixed" else len(shape)
    if ndim != _expected_ndim(fmt, key) or not np.issubdtype(dtype, np.integer):
        return f"key {key!r} is {len(shape)}-D {dtype}, expected {_expected_ndim(fmt, key)}-D integers"
    return None


def _width_problem(handle: h5py.File, fmt: str) -> str | None:
    """Keys that share a width must agree: tokens [N, L], predictions [N, P], packed slots [N, K]."""
    for group in (TOKEN_KEYS, PREDICTION_KEYS, SLOT_KEYS) if fmt != "varlength" else ():
        shapes = {k: handle[k].shape for k in group if k in FORMAT_KEYS[fmt]}
        if len(set(shapes.values())) > 1:
            return f"keys must have the same shape, got {shapes}"
    rows = {k: handle[k].shape[0] if handle[k].shape else 0 for k in FORMAT_KEYS[fmt]}
    if len(set(rows.values())) > 1:
        return f"keys have different row counts ({', '.join(f'{k}={n}' for k, n in rows.items())})"
    return None


def check_keys(handle: h5py.File) -> tuple[str, int]:
    """(format, rows) after checking keys, integer dtypes, ranks and shared widths (metadata only)."""
    fmt = detect_format(handle)
    for key in FORMAT_KEYS[fmt]:
        problem = _key_problem(handle, fmt, key)
        if problem:
            raise DataError(f"{handle.filename}: {problem}; {REGENERATE}")
    problem = _width_problem(handle, fmt)
    if problem:
        raise DataError(f"{handle.filename}: {problem}; {REGENERATE}")
    return fmt, int(handle["input_ids"].shape[0])


def shard_info(path: Path | str) -> tuple[str, int]:
    """(format, rows) of a shard from its metadata alone, after `check_keys`."""
    with open_shard(path) as handle:
        return check_keys(handle)


def shard_widths(path: Path | str) -> tuple[str, int | None, int | None]:
    """(format, L, P): row and prediction widths of a fixed or packed shard; None for varlength."""
    with open_shard(path) as handle:
        fmt, _ = check_keys(handle)
        if fmt == "varlength":
            return fmt, None, None
        return fmt, int(handle["input_ids"].shape[1]), int(handle["masked_lm_positions"].shape[1])


def read_arrays(handle: h5py.File, fmt: str, start: int, stop: int) -> dict[str, np.ndarray]:
    """Rows [start, stop) of every key of the format; a [N, 1] label column becomes [N]."""
    arrays = {k: handle[k][start:stop] for k in FORMAT_KEYS[fmt]}
    if fmt == "fixed":
        arrays["next_sentence_labels"] = arrays["next_sentence_labels"].reshape(-1)
    return arrays


def read_picked(handle: h5py.File, fmt: str, rows: np.ndarray) -> dict[str, np.ndarray]:
    """The rows `rows` (increasing, unique) of every key of the format, one hdf5 read per key."""
    arrays = {k: handle[k][rows] for k in FORMAT_KEYS[fmt]}
    if fmt == "fixed":
        arrays["next_sentence_labels"] = arrays["next_sentence_labels"].reshape(-1)
    return arrays


def read_rows(handle: h5py.File, fmt: str, start: int, stop: int) -> Samples:
    """Rows [start, stop) as Samples (for packed shards: all sequences of those rows)."""
    try:
        return decode(read_arrays(handle, fmt, start, stop), fmt)[0]
    except DataError as err:
        raise DataError(f"{handle.filename}: {err}") from err


def read_samples(path: Path | str, start: int = 0, stop: int | None = None) -> Samples:
    """Rows [start, stop) of a shard of any format (whole shard by default)."""
    with open_shard(path) as handle:
        fmt = detect_format(handle)
        stop = int(handle["input_ids"].shape[0]) if stop is None else stop
        return read_rows(handle, fmt, start, stop)


def iter_blocks(path: Path | str, block_rows: int) -> Iterator[Samples]:
    """The shard's rows as consecutive Samples blocks of at most `block_rows` rows."""
    with open_shard(path) as handle:
        fmt = detect_format(handle)
        rows = int(handle["input_ids"].shape[0])
        for start in range(0, rows, block_rows):
            yield read_rows(handle, fmt, start, min(start + block_rows, rows))


def sequence_lengths(path: Path | str) -> np.ndarray:
    """[rows] real length of every row of a fixed or varlength shard."""
    with open_shard(path) as handle:
        fmt = detect_format(handle)
        if fmt == "fixed":
            return handle["input_mask"][()].astype(bool).sum(axis=1).astype(np.int64)
        if fmt == "varlength":
            rows = handle["segment_ids"][()]
            return np.fromiter((r.shape[0] for r in rows), dtype=np.int64, count=rows.shape[0])
    raise DataError(f"{path}: a packed shard has no per-row length; give fixed or varlength shards")


def is_shard(path: Path) -> bool:
    return path.suffix in SHARD_SUFFIXES and path.is_file() and not path.name.startswith(".")


def list_shards(path: Path | str) -> list[Path]:
    """The *.hdf5 / *.h5 files of a folder, sorted by name (or the file itself)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"{path}: data folder does not exist; check the flag that names it")
    shards = sorted(p for p in path.iterdir() if is_shard(p))
    if not shards:
        raise DataError(f"{path}: no *.hdf5 or *.h5 shards found; point the flag at the folder holding the shards")
    return shards


# ---------------------------------------------------------------- whole folders

def read_manifest(directory: Path) -> dict | None:
    """MANIFEST.json of a data_prep output folder ({"kind", "params", "files"}), or None."""
    path = directory / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: cannot read JSON ({err}); rerun the step that made {directory}") from err
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise DataError(f"{path}: not a data_prep manifest (no 'files' table); rerun the step that made {directory}")
    return manifest


def folder_shards(directory: Path) -> list[Path]:
    """Shards directly in `directory` and in its stratum_k sub-folders, sorted."""
    found = [p for p in directory.glob("*") if is_shard(p)] + [p for p in directory.glob("stratum_*/*") if is_shard(p)]
    return sorted(found)


def _temp_problems(directory: Path, fix: str) -> list[str]:
    leftovers = sorted(p for p in directory.rglob(f".*{TEMP_MARK}*"))
    return [f"{p}: a temporary file of an interrupted step (the folder is half-written); {fix}" for p in leftovers]


def _numbering_problems(shards: list[Path], listed: set[Path], fix: str) -> list[str]:
    """part_i_of_N names promise N shards in their folder: every missing index not in `listed` is a problem."""
    problems = []
    by_folder: dict[tuple[Path, int], set[int]] = {}
    for path in shards:
        match = _NUMBERED.match(path.name)
        if match:
            by_folder.setdefault((path.parent, int(match.group(2))), set()).add(int(match.group(1)))
    for (folder, total), present in sorted(by_folder.items()):
        width = max(5, len(str(total)))
        names = [folder / f"part_{i:0{width}d}_of_{total:0{width}d}.hdf5" for i in range(total) if i not in present]
        problems += [f"{path}: missing, the folder has {len(present)} of {total} shards; {fix}"
                     for path in names if path not in listed][:3]
    return problems


def _manifest_problems(directory: Path, manifest: dict, shards: list[Path], fix: str) -> list[str]:
    """Files the manifest lists that are missing or have another size, and shards it does not list."""
    problems = []
    for name, entry in sorted(manifest["files"].items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"{path}: listed in {MANIFEST_NAME} but missing; {fix}")
        elif isinstance(entry, dict) and "bytes" in entry and path.stat().st_size != entry["bytes"]:
            problems.append(f"{path}: {path.stat().st_size} bytes, {MANIFEST_NAME} says {entry['bytes']} "
                            f"(truncated or replaced); {fix}")
    listed = set(manifest["files"])
    problems += [f"{p}: not listed in {MANIFEST_NAME} (a shard of another run?); remove it or {fix}"
                 for p in shards if p.relative_to(directory).as_posix() not in listed]
    kind = manifest.get("kind")
    final = {"pack": PACKING_REPORT_NAME, "stratify": STRATA_NAME}.get(str(kind))
    if final and not (directory / final).is_file():
        problems.append(f"{directory / final}: missing, so the '{kind}' step did not finish; {fix}")
    return problems


def refused_problems(directory: Path) -> list[str]:
    """The folder's REFUSED_NAME marker as a problem line: data_prep wrote the folder, then its
    verification refused it (copied shards, leaked eval samples, bad rows), so it is no dataset."""
    marker = directory / REFUSED_NAME
    if not marker.is_file():
        return []
    reason = next(iter(marker.read_text(errors="replace").splitlines()), "") or "no reason recorded"
    return [f"{directory}: data_prep's verification refused this folder ({reason}; all problems in {marker}); "
            f"fix the cause and rerun the data_prep step, which verifies again and removes {REFUSED_NAME}"]


def folder_problems(directory: Path | str) -> list[str]:
    """Why a dataset folder is incomplete or refused, from names, sizes and MANIFEST.json alone (no data read).

    Catches what an interrupted or partly deleted folder looks like: temporary files, shards
    listed in the manifest but missing or of another size, shards it does not list, gaps in
    part_i_of_N numbering, and a pack / stratify step without its final report; and a folder
    that data_prep's own verification refused (`refused_problems`).
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    fix = f"rerun the data_prep step that writes {directory} to complete it (it resumes), or re-copy the folder"
    shards = folder_shards(directory)
    problems = refused_problems(directory) + _temp_problems(directory, fix)
    manifest = read_manifest(directory)
    if manifest is not None:
        problems += _manifest_problems(directory, manifest, shards, fix)
    listed = {directory / name for name in manifest["files"]} if manifest is not None else set()
    return problems + _numbering_problems(shards, listed, fix)


# ---------------------------------------------------------------- writing

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
    with atomic_path(path) as temp, h5py.File(temp, "w") as handle:
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
        raise DataError(f"unknown sample format {fmt!r}; choose fixed or varlength")
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
