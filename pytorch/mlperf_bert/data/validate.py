"""Validating shards for the trainer: every row against the model's limits, and whole folders.

A shard is decoded (`shards`) into flat vectors and every rule runs vectorised on them, so a
shard of 40k rows is checked in milliseconds, and only then are the `Sample`s cut out of them
(as views, without copying). `check_dataset` runs the same rules over a whole folder in
blocks of rows, without keeping the data, before training starts (docs/PERFORMANCE.md has
its cost per GB). A bad shard raises `DataError` naming the file, the row and how to fix it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from .batch import Item, Sample
from .shards import (
    REGENERATE, DataError, Samples, check_keys, decode, folder_problems, folder_shards, layout_checks, list_shards,
    open_shard, read_arrays, shard_widths,
)

CHECK_BLOCK_ROWS = 1 << 14  # rows per read in check_dataset: ~40 MB of a 512-token fixed shard


@dataclass(frozen=True)
class DataLimits:
    """What the model accepts; every sequence of every shard is checked against these."""

    max_seq_length: int  # tokens per sequence, [CLS] and [SEP]s included
    max_predictions_per_seq: int  # masked positions per sequence
    vocab_size: int  # token ids must lie in [0, vocab_size)

    def __post_init__(self) -> None:
        for name in ("max_seq_length", "max_predictions_per_seq", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"DataLimits.{name} must be positive, got {getattr(self, name)}")


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def _sequence_checks(samples: Samples, limits: DataLimits) -> list[tuple[np.ndarray, str, str]]:
    """(bad [S] mask, problem, fix) for the per-sequence rules."""
    n = samples.lengths
    return [
        (n < 1, "sequence has no tokens", REGENERATE),
        (n > limits.max_seq_length, f"sequence is longer than max_seq_length={limits.max_seq_length}",
         "raise --max_seq_length or regenerate the data for this length"),
        (samples.num_predictions > limits.max_predictions_per_seq,
         f"more masked positions than max_predictions_per_seq={limits.max_predictions_per_seq}",
         "raise --max_predictions_per_seq or regenerate the data"),
        ((samples.next_sentence_labels != 0) & (samples.next_sentence_labels != 1), "next_sentence_labels is not 0 or 1", REGENERATE),
    ]


def _token_checks(samples: Samples, limits: DataLimits) -> list[tuple[np.ndarray, np.ndarray, str, str]]:
    """(bad mask over a flat column, entries per sequence of that column, problem, fix)."""
    per_token, per_pred = samples.lengths, samples.num_predictions
    seq_of_pred = np.repeat(np.arange(per_pred.shape[0]), per_pred)
    vocab_fix = "check that the data was made with this vocabulary or raise vocab_size in bert_config.json"
    pos = samples.masked_lm_positions
    return [
        ((samples.input_ids < 0) | (samples.input_ids >= limits.vocab_size), per_token,
         f"input_ids outside [0, vocab_size={limits.vocab_size})", vocab_fix),
        ((samples.segment_ids != 0) & (samples.segment_ids != 1), per_token, "segment_ids is not 0 or 1", REGENERATE),
        ((samples.masked_lm_ids < 0) | (samples.masked_lm_ids >= limits.vocab_size), per_pred,
         f"masked_lm_ids outside [0, vocab_size={limits.vocab_size})", vocab_fix),
        (pos == 0, per_pred, "a masked position is 0 (the [CLS] token) for a real prediction", REGENERATE),
        ((pos < 0) | (pos >= samples.lengths[seq_of_pred]), per_pred,
         "a masked position lies outside its sequence", REGENERATE),
    ]


def _rule_violation(samples: Samples, limits: DataLimits) -> tuple[int, str, str] | None:
    """(sequence, problem, fix) of the first sequence that breaks a rule, or None."""
    for bad, problem, fix in _sequence_checks(samples, limits):
        if bad.any():
            return _first(bad), problem, fix
    for bad, per_sequence, problem, fix in _token_checks(samples, limits):
        if bad.any():
            return int(np.searchsorted(np.cumsum(per_sequence), _first(bad), side="right")), problem, fix
    return None


def check_block(path: Path, arrays: dict[str, np.ndarray], fmt: str, first_row: int,
                limits: DataLimits) -> tuple[Samples, np.ndarray]:
    """Decodes rows [first_row, first_row + n) after checking their layout and every rule.

    Returns the Samples and [S] the shard row of each sequence; the first bad row raises.
    """
    def error(row: int, problem: str, fix: str = REGENERATE) -> DataError:
        return DataError(f"{path}: row {first_row + row}: {problem}; {fix}")

    for bad, problem in layout_checks(arrays, fmt):
        if bad.any():
            raise error(_first(bad), problem)
    try:
        samples, rows = decode(arrays, fmt)
    except DataError as err:  # varlength rows whose keys disagree in length
        raise DataError(f"{path}: {err} (rows counted from {first_row}); {REGENERATE}") from err
    violation = _rule_violation(samples, limits)
    if violation is not None:
        sequence, problem, fix = violation
        raise error(int(rows[sequence]), problem, fix)
    return samples, rows + first_row


def _split(values: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    """Views values[a:b] for consecutive runs of `counts`; plain slicing is ~10x faster than np.split."""
    ends = np.cumsum(counts).tolist()
    return [values[a:b] for a, b in zip([0] + ends[:-1], ends)]


def build_items(samples: Samples, row_of_sequence: np.ndarray, num_rows: int) -> list[Item]:
    """Cuts the flat vectors into `Sample`s (views) and groups them by row into Items."""
    cut = [
        Sample(input_ids=i, segment_ids=s, masked_lm_positions=p, masked_lm_ids=m, next_sentence_label=int(y))
        for i, s, p, m, y in zip(
            _split(samples.input_ids, samples.lengths), _split(samples.segment_ids, samples.lengths),
            _split(samples.masked_lm_positions, samples.num_predictions),
            _split(samples.masked_lm_ids, samples.num_predictions), samples.next_sentence_labels,
        )
    ]
    per_row = np.bincount(row_of_sequence, minlength=num_rows)
    if (per_row == 1).all():
        return [(s,) for s in cut]
    bounds = np.concatenate([[0], np.cumsum(per_row)])
    return [tuple(cut[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def _checked_rows(handle: h5py.File, path: Path) -> tuple[str, int]:
    fmt, rows = check_keys(handle)
    if rows == 0:
        raise DataError(f"{path}: shard has no rows; remove the file or regenerate it with data_prep")
    return fmt, rows


def read_shard(path: Path | str, limits: DataLimits) -> list[Item]:
    """All items of one shard, in file order, after validating every row against `limits`."""
    path = Path(path)
    with open_shard(path) as handle:
        fmt, rows = _checked_rows(handle, path)
        samples, row_of_sequence = check_block(path, read_arrays(handle, fmt, 0, rows), fmt, 0, limits)
    return build_items(samples, row_of_sequence, rows)


def check_shard(path: Path | str, limits: DataLimits, block_rows: int = CHECK_BLOCK_ROWS) -> int:
    """`read_shard`'s checks block by block, keeping nothing; returns the shard's rows."""
    path = Path(path)
    with open_shard(path) as handle:
        fmt, rows = _checked_rows(handle, path)
        for start in range(0, rows, block_rows):
            stop = min(start + block_rows, rows)
            check_block(path, read_arrays(handle, fmt, start, stop), fmt, start, limits)
    return rows


def check_widths(shards: list[Path]) -> None:
    """One folder, one dataset: every shard has the first one's format and row width."""
    first = shard_widths(shards[0])
    for path in shards[1:]:
        fmt, width, _ = shard_widths(path)
        if (fmt, width) != first[:2]:
            raise DataError(f"{path}: a {fmt} shard of width {width}, but {shards[0].name} is {first[0]} of width "
                            f"{first[1]}; one folder must hold one dataset, move the odd shards out")


def check_dataset(source: Path | str, limits: DataLimits, rank: int = 0, world_size: int = 1) -> list[Path]:
    """The whole-folder check of a data folder (or one shard); returns its shards.

    Cheap checks first, on every shard: the folder is complete (`shards.folder_problems`:
    MANIFEST.json's files present with their sizes, no temporary files, no gaps in the
    numbering), keys, dtypes, ranks and widths from hdf5 metadata. Then every row of shards
    rank, rank + world_size, ... against `limits`, in blocks (the ranks share the reading).
    """
    source = Path(source)
    problems = folder_problems(source)
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise DataError(problems[0] + more)
    shards = folder_shards(source) if source.is_dir() else []
    shards = shards or list_shards(source)
    check_widths(shards)
    for path in shards[rank::world_size]:
        check_shard(path, limits)
    return shards
