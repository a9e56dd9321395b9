"""Dataset integrity: training shards that are copies of each other, and eval samples in training.

Two failures no row check sees, because every row of such a set is valid:
- duplicate shards: NVIDIA's v2.1 `shuffle_samples.py` wrote every training shard as a copy of
  one (mlcommons/training_results_v2.1 issue 10); a run then trains on 1/4320 of the data and
  stalls near 0.63 accuracy. MLPerf wants each datum exactly once (training_rules.adoc §6.6).
- eval leakage: eval samples inside the training shards make the accuracy a training accuracy
  and the target is "reached" early (the test set is held out, §6.5).

A sample is compared whole: its tokens as stored (masked), segments, masked positions and
labels, and next-sentence label, whatever the layout (fixed, varlength or packed rows), through
`sequence_hashes`, a 64-bit hash per sequence computed with a few vectorised numpy passes. A
sample made again from the same text with other masks is another sample.

Two depths:
- `check_integrity` (`data_prep/verify_dataset.py --quick`, a pre-check; the trainer reads no row before
  its clock starts): per shard, the row count and the
  hashes of its first row, its last row and a block of `PROBE_ROWS` rows in the middle. Shards
  that agree on all of these are compared in full (the first pair of each group) before the
  folder is refused, so a chance agreement never refuses good data. The probed sequences are
  looked up among the eval samples. It reads about `PROBE_ROWS + 2` rows per shard; what it
  can miss (docs/DATA_INTEGRITY.md): copies that differ only in rows it does not read, copies
  with their rows in another order, and eval samples outside the probed rows.
- `ShardDigest` over every sequence (data_prep/verify_dataset.py): an order-free digest of a
  shard's sequence hashes, and how many of its sequences are eval samples. It catches every
  duplicate shard (byte- or row-identical, rows in any order) and every leaked eval sample.

Torch-free: data_prep imports it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import h5py
import numpy as np

from .shards import (
    DataError, Samples, check_keys, concat_ranges, decode, list_shards, offsets, open_shard, read_arrays,
    read_picked, segment_sums,
)

PROBE_ROWS = 64  # rows read from the middle of each shard by the quick check
_MAX_WIDTH = 8192  # positions the coefficient tables cover (settings.MAX_SEQ_LENGTH_LIMIT)
CHUNK_TOKENS = 1 << 16  # tokens hashed together: each temporary is 512 KB


def _coefficients(seed: int) -> np.ndarray:
    """[_MAX_WIDTH] odd 64-bit multipliers, one per position: fixed, so hashes compare across runs."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return rng.integers(0, 2**63, _MAX_WIDTH, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


_TOKEN, _POSITION, _SCALARS = (_coefficients(seed) for seed in (11, 13, 15))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: spreads every input bit over the 64 output bits (uint64 wraps)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _weighted(keys: np.ndarray, lengths: np.ndarray, table: np.ndarray) -> np.ndarray:
    """[N] sum over each sequence of key * table[position in the sequence], mod 2^64.

    keys: uint64, one per entry of the flat column (overwritten); the table's random odd
    multipliers make the sum depend on every key and its place. A key of 0 adds nothing, which
    no real entry has: a token key holds its id (never 0, [PAD]) and a prediction its position
    (never 0, [CLS]), and lengths are hashed apart.
    """
    places = concat_ranges(np.zeros_like(lengths), lengths)
    np.multiply(keys, np.take(table, places), out=keys)
    return segment_sums(keys, lengths)


def _packed(high: np.ndarray, low: np.ndarray, shift: int) -> np.ndarray:
    """uint64 keys high << shift | low (low non-negative and below 2^shift in valid data).

    Each ufunc casts as it goes (a negative low wraps, as int64 viewed as uint64 would), so the
    keys cost two passes and no temporary.
    """
    keys = np.left_shift(high, shift, dtype=np.uint64, casting="unsafe")
    np.add(keys, low, out=keys, dtype=np.uint64, casting="unsafe")
    return keys


def _chunks(bounds: np.ndarray, entries: int) -> list[tuple[int, int]]:
    """(first, end) sequence ranges of about `entries` entries each; bounds: [N+1] `offsets`."""
    cuts = np.unique(np.r_[np.searchsorted(bounds, np.arange(0, bounds[-1], entries)), bounds.shape[0] - 1])
    return list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))


def sequence_hashes(samples: Samples) -> np.ndarray:
    """[N] uint64: one hash per sequence over all of its fields (equal samples, equal hashes).

    A token is keyed by (input id, segment id), a prediction by (position, label); each key is
    weighted by a random multiplier of its place, summed per sequence with the sequence's
    length, prediction count and next-sentence label, and the sum is mixed. Computed on runs
    of `CHUNK_TOKENS` tokens, whose temporaries stay in the CPU's cache (3x faster than whole
    blocks of a shard on the 2-core VM of docs/PERFORMANCE.md).
    """
    if len(samples) and (samples.lengths.max() > _MAX_WIDTH or samples.num_predictions.max() > _MAX_WIDTH):
        raise DataError(f"a sequence is longer than {_MAX_WIDTH} tokens or predictions; regenerate the data")
    tokens, predictions = offsets(samples.lengths), offsets(samples.num_predictions)
    h = np.zeros(len(samples), dtype=np.uint64)
    for lo, hi in _chunks(tokens, CHUNK_TOKENS):
        t, p = slice(tokens[lo], tokens[hi]), slice(predictions[lo], predictions[hi])
        h[lo:hi] = _weighted(_packed(samples.input_ids[t], samples.segment_ids[t], 8), samples.lengths[lo:hi], _TOKEN)
        h[lo:hi] += _weighted(_packed(samples.masked_lm_positions[p], samples.masked_lm_ids[p], 32),
                              samples.num_predictions[lo:hi], _POSITION)
    scalars = (samples.lengths, samples.num_predictions, samples.next_sentence_labels)
    for k, values in enumerate(scalars):
        h += _mix(values.astype(np.int64).view(np.uint64) + np.uint64(k + 1)) * _SCALARS[k]
    return _mix(h)


# ---------------------------------------------------------------- eval samples

def eval_hashes(eval_dir_or_file: Path | str, num_examples: int | None = None) -> np.ndarray:
    """Sorted unique hashes of the eval samples (the first `num_examples`, as the trainer reads them)."""
    found: list[np.ndarray] = []
    total = 0
    for path in list_shards(eval_dir_or_file):
        with open_shard(path) as handle:
            fmt, rows = check_keys(handle)
            hashes = sequence_hashes(decode(read_arrays(handle, fmt, 0, rows), fmt)[0])
        found.append(hashes)
        total += hashes.shape[0]
        if num_examples is not None and total >= num_examples:
            break
    hashes = np.concatenate(found) if found else np.zeros(0, np.uint64)
    return np.unique(hashes[:num_examples] if num_examples is not None else hashes)


def samples_digest(hashes: np.ndarray) -> str:
    """sha256 of a set of samples' sorted unique hashes: equal for sets holding the same samples."""
    return hashlib.sha256(np.unique(hashes).astype("<u8").tobytes()).hexdigest()


def leaked(hashes: np.ndarray, eval_set: np.ndarray) -> np.ndarray:
    """[N] bool: which of `hashes` are eval samples (`eval_set` sorted, as `eval_hashes` gives it)."""
    if eval_set.size == 0 or hashes.size == 0:
        return np.zeros(hashes.shape[0], bool)
    at = np.minimum(np.searchsorted(eval_set, hashes), eval_set.size - 1)
    return np.asarray(eval_set[at] == hashes)


# ---------------------------------------------------------------- the full check, shard by shard

@dataclass
class ShardDigest:
    """What the full check keeps of one shard: an order-free digest of its sequences and its leaks."""

    sequences: int = 0
    leaked: int = 0
    first_leaked_row: int | None = None
    _hashes: list[np.ndarray] = field(default_factory=list)

    def add(self, samples: Samples, rows: np.ndarray, eval_set: np.ndarray) -> None:
        """One decoded block; rows: [S] the shard row of each sequence."""
        hashes = sequence_hashes(samples)
        hits = leaked(hashes, eval_set)
        if hits.any() and self.first_leaked_row is None:
            self.first_leaked_row = int(rows[np.flatnonzero(hits)[0]])
        self.leaked += int(hits.sum())
        self.sequences += hashes.shape[0]
        self._hashes.append(hashes)

    def digest(self) -> str:
        """sha256 of the sorted hashes: equal for shards holding the same sequences in any order."""
        hashes = np.sort(np.concatenate(self._hashes)) if self._hashes else np.zeros(0, np.uint64)
        return hashlib.sha256(hashes.astype("<u8").tobytes()).hexdigest()


def duplicate_groups(digests: dict[Path, str]) -> list[list[Path]]:
    """Shards with equal digests, each group sorted, groups in the order of their first shard."""
    groups: dict[str, list[Path]] = {}
    for path in sorted(digests):
        groups.setdefault(digests[path], []).append(path)
    return [paths for paths in groups.values() if len(paths) > 1]


def same_bytes(a: Path, b: Path, block: int = 1 << 24) -> bool:
    """Whether two files are byte-identical (read in blocks; stops at the first difference)."""
    if a.stat().st_size != b.stat().st_size:
        return False
    with a.open("rb") as fa, b.open("rb") as fb:
        while True:
            x, y = fa.read(block), fb.read(block)
            if x != y:
                return False
            if not x:
                return True


def duplicate_message(group: Sequence[Path], exact: bool) -> str:
    """One line for a group of copies: the files, which kind of copy, and the fix."""
    kind = "byte-identical" if exact else "row-identical (the same samples, stored differently)"
    others = f" and {len(group) - 2} more" if len(group) > 2 else ""
    return (f"{group[0]}, {group[1]}{others}: {len(group)} {kind} training shards; every sample must be in "
            "the training set once (training_rules.adoc §6.6): regenerate the shards (data_prep/prepare.py "
            "reshard) instead of copying them")


def leakage_message(where: Sequence[tuple[Path, int, int]], eval_source: Path | str, probed: bool) -> str:
    """One line for eval samples found in training shards: (shard, count, first row) per shard."""
    total = sum(count for _, count, _ in where)
    shown = ", ".join(f"{path} ({count}, first at row {row})" for path, count, row in where[:3])
    more = f" and {len(where) - 3} more shards" if len(where) > 3 else ""
    scope = "in the probed rows " if probed else ""
    return (f"{total} eval samples of {eval_source} are also training samples {scope}in {shown}{more}: the "
            "accuracy would be measured on training data (training_rules.adoc §6.5); rebuild the training "
            "shards without the eval samples (data_prep/verify_dataset.py TRAIN_DIR EVAL_DIR counts them all)")


# ---------------------------------------------------------------- the quick check (verify_dataset.py --quick)

@dataclass(frozen=True)
class Probe:
    """What the quick check reads of one shard."""

    path: Path
    fingerprint: tuple  # (format, rows, digest of the probed rows' sequence hashes)
    hashes: np.ndarray  # the probed sequences' hashes (eval samples are looked up among them)
    rows: np.ndarray  # the shard row of each of those sequences


def probed_rows(rows: int, probe_rows: int = PROBE_ROWS) -> np.ndarray:
    """The first row, `probe_rows` rows from the middle and the last row, increasing."""
    start = max(0, (rows - probe_rows) // 2)
    return np.unique(np.r_[0, np.arange(start, min(rows, start + probe_rows)), rows - 1])


def probe_shard(path: Path, probe_rows: int = PROBE_ROWS) -> Probe:
    """`probed_rows` of one shard, read with one hdf5 read per key (after its keys, from metadata: the
    quick check may be the first reader of a shard)."""
    with open_shard(path) as handle:
        fmt, rows = check_keys(handle)
        if rows == 0:
            return Probe(path, (fmt, 0), np.zeros(0, np.uint64), np.zeros(0, np.int64))
        picked = probed_rows(rows, probe_rows)
        arrays = read_picked(handle, fmt, picked)
    samples, local = decode(arrays, fmt)
    hashes, seq_rows = sequence_hashes(samples), picked[local]
    digest = hashlib.sha256(hashes.astype("<u8").tobytes() + seq_rows.astype("<i8").tobytes()).hexdigest()
    return Probe(path, (fmt, rows, digest), hashes, seq_rows)


def _all_hashes(path: Path) -> np.ndarray:
    with open_shard(path) as handle:
        fmt, rows = check_keys(handle)
        return np.sort(sequence_hashes(decode(read_arrays(handle, fmt, 0, rows), fmt)[0]))


def _confirmed_copies(probes: Iterable[Probe]) -> list[list[Path]]:
    """Groups of shards whose probes agree, kept when their first two shards hold the same sequences."""
    groups: dict[tuple, list[Path]] = {}
    for probe in probes:
        if probe.fingerprint[1:2] != (0,):
            groups.setdefault(probe.fingerprint, []).append(probe.path)
    return [paths for paths in groups.values()
            if len(paths) > 1 and np.array_equal(_all_hashes(paths[0]), _all_hashes(paths[1]))]


def check_integrity(shards: Sequence[Path], eval_source: Path | str | None, num_eval: int | None,
                    probe_rows: int = PROBE_ROWS) -> None:
    """The quick check of a training folder's shards; raises DataError naming the files.

    eval_source, num_eval: the eval set the run evaluates on (None: no leakage check).
    """
    probes = [probe_shard(path, probe_rows) for path in shards]
    for group in _confirmed_copies(probes):
        raise DataError(duplicate_message(group, same_bytes(group[0], group[1])))
    if eval_source is None:
        return
    eval_set = eval_hashes(eval_source, num_eval)
    where = []
    for probe in probes:
        hits = leaked(probe.hashes, eval_set)
        if hits.any():
            where.append((probe.path, int(hits.sum()), int(probe.rows[np.flatnonzero(hits)[0]])))
    if where:
        raise DataError(leakage_message(where, eval_source, probed=True))
