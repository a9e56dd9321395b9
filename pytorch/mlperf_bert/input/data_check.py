"""The data checks a run makes before the clock, from the folder listings and verification records alone.

MLPerf: "The clock must start before any part of the system touches the dataset"
(training_rules.adoc §11, Run Results); metadata (document counts and sizes) may be used before
it (§6.4, Other Uses of Data). So before `run_start` a run reads `VERIFIED.json`, the record
`data_prep/verify_dataset.py` writes after reading every row, and compares it with the files by
`os.stat` and a listing of names (`data.record`); for a folder without a current record it also
reads what data_prep wrote beside the shards (MANIFEST.json's names and sizes, the refusal
marker; `shards.folder_problems`). What it decides, in either division:

- what the listing and the records show is refused: a record that says the verification failed,
  or says `ok` against its own fields (problems listed, two shards of equal sha256:
  `Record.contradiction`), data_prep's refusal marker, a temporary file of an interrupted step, a file the manifest or the
  record lists that is missing, a gap in part_i_of_N numbering;
- the record against this run: the longest sequence, the most predictions and the largest token
  id the verification saw must fit the run's limits; the eval set must hold --num_eval_examples;
- a folder without a current record (none, or a file changed, added or removed since), or a
  training folder not checked for samples of this eval set, is refused with the one command that
  verifies it. Only an open run with --unverified_data trains it: the rows are then checked as
  they are read (`validate.read_shard`), and `check_after_clock` looks for copied shards and eval
  samples in the training shards once the clock runs, so their time counts.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ..config.settings import TrainConfig
from ..data.dataset import DataError, DataLimits
from ..data.integrity import check_integrity
from ..data.record import RECORD_NAME, Record, read_record, reverify_advice, stale_problems
from ..data.shards import folder_problems, folder_shards, list_shards
from ..data.static_batch import StaticShape
from ..runtime.distributed import DistEnv

UNVERIFIED_FLAG = "--unverified_data"
UNVERIFIED_CHECK_KEY = "unverified_data_check_seconds"  # MLPerf log: the check after run_start, and its time
AFTER_CLOCK_CHECK = "the quick check for copied shards and eval samples in training (probed rows of each shard)"


def _folder(path: str) -> Path:
    """The folder a data flag names (a single eval file's folder holds its record)."""
    return Path(path) if not Path(path).is_file() else Path(path).parent


def _first(problems: list[str]) -> str:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return problems[0] + more


@dataclass(frozen=True)
class Folder:
    """A data folder as its listing and its record show it."""

    path: Path
    record: Record | None  # its record while the folder is unchanged since it was verified, else None
    stale: str  # why no current record vouches for it ("" when one does)
    advice: str  # the command that verifies it

    @classmethod
    def examine(cls, folder: Path, eval_dir: str | None = None) -> Folder:
        """The folder's record against its files; raises DataError for what the listing and records decide."""
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
            return cls(folder, record, "", advice)
        listed = _listing_problems(folder, record, advice)
        if listed:
            raise DataError(_first(listed))
        return cls(folder, None, _first(stale), advice)


def _listing_problems(folder: Path, record: Record | None, advice: str) -> list[str]:
    """What the names, sizes, manifest and record of a folder without a current record show is wrong."""
    if record is None and not folder_shards(folder):
        list_shards(folder)  # raises for a folder that is not there or holds no shard
    problems = folder_problems(folder)
    named = {line.split(": ", 1)[0] for line in problems}
    gone = [folder / name for name in sorted(record.files) if not (folder / name).exists()] if record else []
    return problems + [f"{path}: listed in {RECORD_NAME} but missing (a deleted shard, or a record of other files); "
                       f"restore it, or {advice}"
                       for path in gone if str(path) not in named]


def unvouched(train: Folder, evals: Folder) -> str | None:
    """Why no current record vouches that the training folder holds no copied shards and no sample of
    this eval set (§6.5, §6.6); None when the records do."""
    if train.stale or evals.stale:
        return train.stale or evals.stale
    assert train.record is not None and evals.record is not None
    return _not_held_out(train.record, evals.record)


def _not_held_out(train: Record, evals: Record) -> str | None:
    """Why the training record does not vouch that the eval set is held out; None when it does."""
    if evals.samples_digest in train.eval_digests:
        return None
    return f"{train.folder} was not checked for samples of the eval set {evals.folder}"


def _refuse_unverified(cfg: TrainConfig, why: str, what: str, advice: str) -> None:
    """An unverified folder: refused with the command that verifies it, unless the open division's flag trains it."""
    if cfg.data.unverified_data:
        return
    if cfg.run.submission_division == "closed":
        raise DataError(f"closed division: the {what} must be verified before a timed run, and {why}; {advice}")
    raise DataError(f"{why}: the {what} must be verified before a run; {advice}, or pass {UNVERIFIED_FLAG} to "
                    "train unverified data (copied shards and eval samples in training are then looked for after "
                    "run_start, in the timed run)")


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


def _held_out(cfg: TrainConfig, train: Record, evals: Record) -> None:
    """Both records current: the training folder must have been checked for samples of this eval set."""
    why = _not_held_out(train, evals)
    if why is None or cfg.data.unverified_data:
        return
    advice = reverify_advice(train.folder, evals.folder)
    if cfg.run.submission_division == "closed":
        raise DataError(f"closed division: {why} (training_rules.adoc §6.5: the eval set is held out); {advice}")
    raise DataError(f"{why} (the eval set is held out, training_rules.adoc §6.5); {advice}, or pass "
                    f"{UNVERIFIED_FLAG} to look for them after run_start, in the timed run")


def check_data_before_clock(cfg: TrainConfig, limits: DataLimits, shortfall_advice: str,
                            notes: bool = True) -> None:
    """Every data check of a run before `run_start`; raises DataError naming the folder and the fix.

    shortfall_advice: what to do when the eval set is smaller than --num_eval_examples.
    notes: say what --unverified_data leaves to the checks after run_start (rank 0 does).
    """
    assert cfg.data.eval_dir is not None, "TrainConfig requires --eval_dir"
    evals = Folder.examine(_folder(cfg.data.eval_dir))
    if evals.stale:
        _refuse_unverified(cfg, evals.stale, "eval set", evals.advice)
    if evals.record is not None:
        _fits(evals.record, limits)
        _eval_holds(evals.record, cfg.eval.num_eval_examples, shortfall_advice)
    if not cfg.run.do_train or cfg.data.input_dir is None:
        return
    train = Folder.examine(Path(cfg.data.input_dir), cfg.data.eval_dir)
    if train.stale:
        _refuse_unverified(cfg, train.stale, "training folder", train.advice)
    if train.record is not None:
        _fits(train.record, limits)
    if train.record is not None and evals.record is not None:
        _held_out(cfg, train.record, evals.record)
    why = unvouched(train, evals)
    if why is not None and notes:
        print(f"note: {UNVERIFIED_FLAG}: {why}; {AFTER_CLOCK_CHECK} runs after run_start, in the timed run",
              file=sys.stderr, flush=True)


@dataclass(frozen=True)
class AfterClock:
    """What `check_after_clock` did: why it ran, how long it took, and the problem it found (None: none)."""

    why: str
    seconds: float
    problem: str | None

    def line(self) -> str:
        """What ran, for the console and the run's summary."""
        found = "refused the data" if self.problem else "found none"
        return (f"{UNVERIFIED_FLAG} ({self.why}): {AFTER_CLOCK_CHECK} ran after run_start, {self.seconds:.1f} s "
                f"inside the timed run, and {found}")

    def refusal(self) -> str:
        """The error line of the problem it found."""
        return (f"{self.problem} (found by {UNVERIFIED_FLAG}'s check after run_start, {self.seconds:.1f} s "
                "inside the timed run)")


def check_after_clock(cfg: TrainConfig, denv: DistEnv) -> AfterClock | None:
    """--unverified_data's integrity check, once the clock runs (it reads the shards); None when no check is due.

    Rank 0 reads the probed rows of every training shard and the eval set (`integrity.check_integrity`,
    the quick check); every rank gets its verdict, so every rank stops alike.
    """
    if not (cfg.data.unverified_data and cfg.run.do_train and cfg.data.input_dir is not None):
        return None
    assert cfg.data.eval_dir is not None, "TrainConfig requires --eval_dir"
    why = unvouched(Folder.examine(Path(cfg.data.input_dir), cfg.data.eval_dir),
                    Folder.examine(_folder(cfg.data.eval_dir)))
    if why is None:
        return None
    start = time.perf_counter()
    problem = _integrity_problem(cfg) if denv.is_main else None
    if dist.is_initialized():
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    return AfterClock(why, time.perf_counter() - start, problem)


def _integrity_problem(cfg: TrainConfig) -> str | None:
    assert cfg.data.input_dir is not None
    train = Path(cfg.data.input_dir)
    try:
        check_integrity(folder_shards(train) or list_shards(train), cfg.data.eval_dir, cfg.eval.num_eval_examples)
    except DataError as err:
        return str(err)
    return None


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
