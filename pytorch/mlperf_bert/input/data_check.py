"""The data checks a run makes before the clock, from the verification records alone.

MLPerf: "The clock must start before any part of the system touches the dataset"
(training_rules.adoc §11, Run Results); metadata (document counts and sizes) may be used before
it (§6.4, Other Uses of Data). So before `run_start` a run reads only `VERIFIED.json`, the record
`data_prep/verify_dataset.py` writes after reading every row, and compares it with the files by
`os.stat` (`data.record`). What it decides:

- a record that says the verification failed, or says `ok` against its own fields (problems
  listed, two shards of equal sha256: `Record.contradiction`): refused (any division);
- the record against this run: the longest sequence, the most predictions and the largest token
  id the verification saw must fit the run's limits; the eval set must hold --num_eval_examples;
- closed division (a timed result): both folders must have a record, unchanged since it was
  written, and the training folder must have been checked for samples of this eval set. A
  changed or unverified folder is refused with the command that verifies it;
- open division: a missing or out-of-date record is a note. The rows are then checked as they
  are read (`validate.read_shard`), after the clock, and a bad one stops the run with exit 2;
  copied shards and eval samples in the training set are not looked for.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..config.settings import TrainConfig
from ..data.dataset import DataError, DataLimits
from ..data.record import RECORD_NAME, Record, read_record, reverify_advice, stale_problems
from ..data.static_batch import StaticShape


def _folder(path: str) -> Path:
    """The folder a data flag names (a single eval file's folder holds its record)."""
    return Path(path) if not Path(path).is_file() else Path(path).parent


def _usable(folder: Path, closed: bool, what: str, notes: bool, eval_dir: str | None = None) -> Record | None:
    """The folder's record when it holds; None (after a note) for an open run without a current one."""
    record = read_record(folder)
    advice = reverify_advice(folder, eval_dir)
    if record is not None and record.contradiction:
        raise DataError(f"{record.path}: {record.contradiction}; a record that contradicts itself was changed "
                        f"after data_prep wrote it and is not trusted: {advice}")
    if record is not None and not record.ok:
        first = record.problems[0] if record.problems else "no problem recorded"
        raise DataError(f"{folder}: data_prep's verification failed ({first}; all problems in {record.path}); "
                        f"fix the data, then {advice}")
    stale = stale_problems(record) if record is not None else [f"{folder}: no {RECORD_NAME}"]
    if not stale:
        return record
    more = f" (and {len(stale) - 1} more)" if len(stale) > 1 else ""
    if closed:
        raise DataError(f"closed division: the {what} must be verified before a timed run, and {stale[0]}{more}; "
                        f"{advice}")
    if notes:
        print(f"note: {stale[0]}{more}: rows are checked as they are read; copied shards and eval samples in the "
              f"training set are not looked for ({advice})", file=sys.stderr, flush=True)
    return None


def _fits(record: Record, limits: DataLimits) -> None:
    """The largest values the verification saw, against the run's limits."""
    checks = ((record.longest, limits.max_seq_length, "tokens", "--max_seq_length"),
              (record.most_predictions, limits.max_predictions_per_seq, "masked positions",
               "--max_predictions_per_seq"))
    for seen, limit, what, flag in checks:
        if seen > limit:
            raise DataError(f"{record.folder}: its verification record has a sequence of {seen} {what}, more than "
                            f"{flag} {limit}: raise {flag} or use data made for this length")
    if record.max_token_id >= limits.vocab_size:
        raise DataError(f"{record.folder}: its verification record has token id {record.max_token_id}, outside "
                        f"vocab_size {limits.vocab_size}: check that the data was made with this model's vocabulary")


def _eval_holds(record: Record, wanted: int, shortfall_advice: str) -> None:
    if record.sequences < wanted:
        raise DataError(f"{record.folder}: {record.sequences} eval samples, fewer than the {wanted} requested; "
                        f"{shortfall_advice}")


def check_data_before_clock(cfg: TrainConfig, limits: DataLimits, shortfall_advice: str,
                            notes: bool = True) -> None:
    """Every data check of a run before `run_start`; raises DataError naming the folder and the fix.

    shortfall_advice: what to do when the eval set is smaller than --num_eval_examples.
    notes: print the open division's note on a folder without a current record (rank 0 does).
    """
    closed = cfg.run.submission_division == "closed"
    assert cfg.data.eval_dir is not None, "TrainConfig requires --eval_dir"
    evals = _usable(_folder(cfg.data.eval_dir), closed, "eval set", notes)
    if evals is not None:
        _fits(evals, limits)
        _eval_holds(evals, cfg.eval.num_eval_examples, shortfall_advice)
    if not cfg.run.do_train or cfg.data.input_dir is None:
        return
    train = _usable(Path(cfg.data.input_dir), closed, "training folder", notes, cfg.data.eval_dir)
    if train is not None:
        _fits(train, limits)
    if closed and train is not None and evals is not None and evals.samples_digest not in train.eval_digests:
        raise DataError(f"closed division: {train.folder} was not checked for samples of the eval set "
                        f"{evals.folder} (training_rules.adoc §6.5: the eval set is held out); "
                        f"{reverify_advice(train.folder, evals.folder)}")


def recorded_shape(input_dir: str, rows: int, row_len: int) -> StaticShape:
    """--cuda_graphs' static shape (K sequences and Q predictions per packed row) from the verification
    record: the graph is captured before the clock, when no shard may be read."""
    record = read_record(input_dir)
    if record is None:
        raise DataError(f"{input_dir}: --cuda_graphs captures its step before the clock, from the packed widths "
                        f"in {RECORD_NAME}, which this folder lacks; {reverify_advice(input_dir)}")
    if record.packed is None:
        raise DataError(f"{input_dir}: not a packed folder ({record.format} shards); --cuda_graphs needs "
                        "--input_layout packed with shards from `data_prep/prepare.py pack`")
    width, k, q = record.packed
    if width > row_len:
        raise DataError(f"{input_dir}: packed rows are {width} tokens wide, more than --max_seq_length {row_len}")
    return StaticShape(rows, row_len, k, q)
