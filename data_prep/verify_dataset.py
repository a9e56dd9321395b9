"""Checks dataset folders: `python data_prep/verify_dataset.py DIR... [--eval_dir EVALDIR] [--vocab vocab.txt]`.

For every shard (fixed, varlength or packed; stratum_k/ sub-folders included) it checks,
vectorised over blocks of rows: the keys and their integer dtypes, equal row counts,
widths, the padding layout (input_mask a prefix of ones, zeros after it, masked slots
packed to the front), [CLS] A [SEP] B [SEP] structure and segment ids, token ids inside
the vocabulary, lengths and prediction counts inside the limits, masked positions inside
their sequence (never [CLS] or [SEP], ascending) and next-sentence labels. A half-written
folder is refused (`mlperf_bert.data.shards.folder_problems`: temporary files, files the manifest
lists but are missing or of another size, gaps in part_i_of_N numbering). With a
MANIFEST.json it compares sha256 and sample count of every file; with strata.json and
packing_report.json it checks the strata bounds and counts and that no sequence was dropped.
Integrity (`mlperf_bert.data.integrity`, over every sequence): training shards that hold the
same samples as another shard of their folder (byte-identical copies, or the same rows stored
differently or in another order), and eval samples inside training shards, counted per shard,
when an eval folder is given: as --eval_dir, or as a DIRECTORY recognised as an eval set by
what it holds (MANIFEST.json kind "eval", or only eval*/part_eval_* files, as import-tfrecord
makes of eval_10k), never by its place among the folders. It prints which folders it took for
eval sets, and warns when training folders were checked against none or a folder is neither.
The length limits are the flags, else the folder's manifest, else a fixed shard's widths.
Exits 0 when everything holds, 1 otherwise, printing one line per problem that names the
file, the first bad row and what is wrong. Each folder gets its verification record,
VERIFIED.json (`mlperf_bert.data.record`): what was checked, each file's size, modification time,
sha256 and rows, and the verdict; the trainer reads it before MLPerf's clock starts instead of
the rows.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from data_prep.fileio import Manifest, read_json_object, sha256_file
from data_prep.formats import (
    MAX_PREDICTIONS, MAX_SEQ_LENGTH, PACKING_REPORT_NAME, STRATA_NAME, DataPrepError, is_eval_name,
)
from data_prep.parallel import run_jobs
from data_prep.sources import recorded_lengths
from data_prep.vocab import Vocab, load_vocab
from mlperf_bert.runtime.files import write_text_atomic
from mlperf_bert.data.record import RECORD_NAME, Record, record_json, FileEntry
from mlperf_bert.data.integrity import (
    ShardDigest, check_integrity, duplicate_groups, duplicate_message, eval_hashes, leakage_message, same_bytes, samples_digest,
)
from mlperf_bert.data.shards import (
    FORMAT_KEYS, MANIFEST_NAME, REFUSED_NAME, Samples, check_keys, folder_problems, folder_shards, from_fixed, from_packed,
    from_varlength, layout_checks, offsets, open_shard, segment_sums,
)

BLOCK_ROWS = 4096  # rows per read: a few MB per array, so the passes over a block run from the CPU cache
NO_EVAL = np.zeros(0, np.uint64)
MIN_LENGTH = 5  # [CLS] A [SEP] B [SEP] with one token each in A and B


@dataclass(frozen=True)
class EvalSets:
    """The eval samples a training folder may not hold: their sorted hashes, and the folders' names."""

    hashes: np.ndarray
    names: str
    digests: dict[Path, str]  # each eval folder's `samples_digest`: how a verification record names it

    @classmethod
    def read(cls, folders: list[Path]) -> EvalSets | None:
        if not folders:
            return None
        each = {folder: eval_hashes(folder) for folder in folders}
        hashes = np.unique(np.concatenate(list(each.values())))
        return cls(hashes, ", ".join(map(str, folders)), {f: samples_digest(h) for f, h in each.items()})


EVAL_RULE = "MANIFEST.json kind 'eval', or every file named eval*/part_eval_*"
TRAINING_SHARD = re.compile(r"part[-_]\d+[-_]of[-_]\d+\.(hdf5|h5)$")  # part_00042_of_04320, part-00042-of-00500


def _readable_manifest(directory: Path) -> Manifest | None:
    """The folder's manifest; None also when it is unreadable (its verification names that)."""
    try:
        return Manifest.load(directory)
    except DataPrepError:
        return None


def eval_reason(directory: Path) -> str | None:
    """Why `directory` is an eval set, or None: `prepare.py eval` made it (MANIFEST.json kind "eval"),
    or every file it holds is named as an eval file (`formats.is_eval_name`): eval_10k.hdf5 that
    import-tfrecord made of the reference's eval_10k, eval.hdf5 that `samples` made of eval.txt,
    NVIDIA's part_eval_10k.hdf5."""
    if not directory.is_dir():
        return None
    manifest = _readable_manifest(directory)
    if manifest is not None and manifest.kind == "eval":
        return "MANIFEST.json kind 'eval'"
    names = list(manifest.files) if manifest is not None else [p.name for p in folder_shards(directory)]
    if names and all(is_eval_name(Path(name).name) for name in names):
        return f"{'imported ' if manifest is not None and manifest.kind == 'import-tfrecord' else ''}eval files"
    return None


def is_eval_folder(directory: Path) -> bool:
    """An eval set (`eval_reason`)."""
    return eval_reason(directory) is not None


def is_training_folder(directory: Path) -> bool:
    """Training data by its own account: a data_prep manifest of a training step, or shards that all
    carry a training part's name (NVIDIA's part_i_of_N, MLCommons' part-i-of-N)."""
    if not directory.is_dir() or is_eval_folder(directory):
        return False
    manifest = _readable_manifest(directory)
    if manifest is not None:
        return manifest.kind in ("samples", "import-tfrecord", "reshard", "pack", "stratify")
    shards = folder_shards(directory)
    return bool(shards) and all(TRAINING_SHARD.match(p.name) for p in shards)


@dataclass(frozen=True)
class LeakCheck:
    """Which folders are eval sets (given with --eval_dir or recognised) and which are checked against them.

    Folders are recognised by what they hold, never by their place on the command line, so
    `verify_dataset.py TRAIN EVAL` and `verify_dataset.py EVAL TRAIN` check the same.
    """

    eval_folders: dict[Path, str]  # eval set -> how it was recognised
    training: list[Path]
    unrecognised: list[Path]  # neither an eval set nor training data by their files: checked as training

    @classmethod
    def plan(cls, directories: list[Path], eval_dirs: list[Path]) -> LeakCheck:
        evals = {Path(d): "--eval_dir" for d in eval_dirs}
        for directory in directories:
            reason = eval_reason(directory)
            if reason is not None and directory not in evals:
                evals[directory] = reason
        rest = [d for d in dict.fromkeys(directories) if d not in evals]
        return cls(evals, rest, [d for d in rest if not is_training_folder(d)])

    def lines(self) -> list[tuple[str, bool]]:
        """(message, is a warning) lines that say what the leak check compares."""
        lines = []
        if self.eval_folders:
            lines.append(("eval sets: " + ", ".join(f"{d} ({why})" for d, why in self.eval_folders.items()), False))
        if self.training and self.eval_folders:
            lines.append((f"leak check: {', '.join(map(str, self.training))} against these eval sets", False))
        elif self.training:
            lines.append((f"leak check skipped: no eval set given, so no folder was checked for eval samples "
                          f"({', '.join(map(str, self.training))}); pass the eval folder with --eval_dir EVALDIR "
                          f"(a folder argument counts as an eval set when it has {EVAL_RULE})", True))
        for directory in self.unrecognised:
            lines.append((f"{directory}: neither an eval set ({EVAL_RULE}) nor training data (a data_prep "
                          f"manifest, or part_i_of_N shards): checked as training data; if it is an eval set, "
                          f"pass it as --eval_dir {directory}", True))
        return lines

    def report(self) -> None:
        for line, warning in self.lines():
            print(f"warning: {line}" if warning else line, file=sys.stderr if warning else sys.stdout)


@dataclass(frozen=True)
class Limits:
    max_seq_length: int = MAX_SEQ_LENGTH
    max_predictions: int = MAX_PREDICTIONS
    vocab_size: int | None = None  # token ids must lie in [0, vocab_size) when given
    cls_id: int | None = None  # known from --vocab: every sequence must start with it
    sep_id: int | None = None


@dataclass
class ShardReport:
    path: Path
    fmt: str = "?"
    rows: int = 0
    sequences: int = 0
    shortest: int = MAX_SEQ_LENGTH + 1  # sequence lengths seen, for the strata check
    longest: int = 0
    sha256: str | None = None  # computed unless --no_checksums
    stat: tuple[int, int] = (0, 0)  # (bytes, mtime_ns) before the file was read: the record's
    max_token_id: int = 0  # largest input or masked-LM id
    most_predictions: int = 0  # masked positions of the sequence with the most
    packed: tuple[int, int, int] | None = None  # packed shards: (row width, K, Q)
    digest: str = ""  # order-free digest of the shard's sequences (`integrity.ShardDigest`)
    leaked: int = 0  # sequences that are eval samples
    first_leaked_row: int | None = None
    problems: list[str] = field(default_factory=list)

    def flag(self, bad: np.ndarray, rows: np.ndarray, what: str) -> None:
        """Records `what` once, naming the first bad row and how many rows are bad."""
        if bad.any():
            hit = np.unique(rows[np.flatnonzero(bad)])
            more = f" (and {hit.shape[0] - 1} more rows)" if hit.shape[0] > 1 else ""
            self.problems.append(f"{self.path}: row {hit[0]}{more}: {what}")


def _any_per_row(bad: np.ndarray) -> np.ndarray:
    return np.asarray(bad.reshape(bad.shape[0], -1).any(axis=1))


def _fixed_layout_checks(a: dict[str, np.ndarray], limits: Limits) -> list[tuple[np.ndarray, str]]:
    """(bad rows, problem) for the padded layout: what decoding needs, and the padding data_prep writes."""
    mask, real = a["input_mask"], a["masked_lm_positions"] != 0
    return layout_checks(a, "fixed") + [
        (_any_per_row((mask == 0) & ((a["input_ids"] != 0) | (a["segment_ids"] != 0))),
         "input_ids or segment_ids are not 0 on padding"),
        (_any_per_row(np.diff(real.astype(np.int8), axis=1) > 0), "a masked slot after an empty one (position 0)"),
        (_any_per_row(~real & (a["masked_lm_ids"] != 0)), "masked_lm_ids is not 0 in an empty slot"),
    ]


def _packed_layout_checks(a: dict[str, np.ndarray], limits: Limits) -> list[tuple[np.ndarray, str]]:
    """(bad rows, problem) for the packed slots: what decoding needs, and the layout data_prep writes."""
    input_len, mlm_len = a["packed_input_len"].astype(np.int64), a["packed_masked_lm_len"].astype(np.int64)
    empty = input_len == 0
    used = np.arange(a["input_ids"].shape[1]) < input_len.sum(axis=1, keepdims=True)
    real = np.arange(a["masked_lm_positions"].shape[1]) < mlm_len.sum(axis=1, keepdims=True)
    return layout_checks(a, "packed") + [
        (_any_per_row(empty[:, :-1] & ~empty[:, 1:]), "an empty slot before a full one"),
        (_any_per_row(empty & ((mlm_len != 0) | (a["next_sentence_labels"] != -1))),
         "an empty slot has predictions or a label other than -1"),
        (_any_per_row(~used & ((a["input_ids"] != 0) | (a["segment_ids"] != 0))), "tokens after the packed sequences"),
        (_any_per_row(~real & ((a["masked_lm_positions"] != 0) | (a["masked_lm_ids"] != 0))),
         "masked slots after the packed predictions are not 0"),
    ]


def _per_sequence(bad: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """[N] True where a sequence holds a bad entry; bounds: [N+1] its entries' offsets (`offsets`).

    Only the bad entries are looked up, so a clean block costs one pass over `bad` and no
    per-entry owner array.
    """
    out = np.zeros(bounds.shape[0] - 1, bool)
    out[np.searchsorted(bounds, np.flatnonzero(bad), side="right") - 1] = True
    return out


def _outside(values: np.ndarray, upper: int) -> np.ndarray:
    """values < 0 or values >= upper, in one pass: a negative integer read as unsigned is >= upper."""
    if values.dtype.kind != "i" or upper > np.iinfo(values.dtype).max:
        return (values < 0) | (values >= upper)
    return np.asarray(values.view(values.dtype.str.replace("i", "u")) >= upper)


def _sequence_checks(s: Samples, limits: Limits) -> list[tuple[np.ndarray, str]]:
    """(bad sequences, problem) for every per-sequence rule; the A-segment lengths are shared."""
    bounds = offsets(s.lengths)
    a_len = segment_sums(s.segment_ids == 0, s.lengths, np.int64)  # [CLS] A [SEP] in a valid sequence
    return _structure_checks(s, limits, bounds, a_len) + _prediction_checks(s, limits, a_len)


def _structure_checks(s: Samples, limits: Limits, bounds: np.ndarray,
                      a_len: np.ndarray) -> list[tuple[np.ndarray, str]]:
    """(bad sequences, problem): lengths, [CLS]/[SEP] layout, segments, ids, labels."""
    n, start = s.lengths, bounds[:-1]
    nonempty = n > 0
    first, last = start[nonempty], (start + n - 1)[nonempty]
    seg = s.segment_ids
    decreases = np.zeros(seg.shape[0], bool)
    np.less(seg[1:], seg[:-1], out=decreases[1:])
    decreases[first] = False  # a segment may only grow inside a sequence
    checks = [
        (n < MIN_LENGTH, f"sequence shorter than {MIN_LENGTH} tokens ([CLS] A [SEP] B [SEP])"),
        (n > limits.max_seq_length, f"sequence longer than max_seq_length={limits.max_seq_length}"),
        (s.num_predictions > limits.max_predictions, f"more than max_predictions={limits.max_predictions} predictions"),
        ((s.next_sentence_labels != 0) & (s.next_sentence_labels != 1), "next_sentence_labels is not 0 or 1"),
        (_per_sequence(_outside(seg, 2), bounds), "segment_ids other than 0 and 1"),
        (_per_sequence(decreases, bounds), "segment_ids decrease (1 then 0)"),
        (_scatter(nonempty, (seg[first] != 0) | (seg[last] != 1)), "segment_ids do not start with 0 and end with 1"),
    ]
    if limits.vocab_size is not None:
        checks.append((_per_sequence(_outside(s.input_ids, limits.vocab_size), bounds),
                       f"input_ids outside [0, {limits.vocab_size})"))
    if limits.cls_id is not None and limits.sep_id is not None:
        sep_a = (start + np.maximum(a_len, 1) - 1)[nonempty]
        wrong = (s.input_ids[first] != limits.cls_id) | (s.input_ids[last] != limits.sep_id) | (
            s.input_ids[sep_a] != limits.sep_id)
        checks.append((_scatter(nonempty, wrong), "not [CLS] A [SEP] B [SEP] (special tokens misplaced)"))
    return checks


def _scatter(where: np.ndarray, values: np.ndarray) -> np.ndarray:
    out = np.zeros(where.shape[0], bool)
    out[where] = values
    return out


def _prediction_checks(s: Samples, limits: Limits, a_len: np.ndarray) -> list[tuple[np.ndarray, str]]:
    """(bad sequences, problem): masked positions inside the sequence, ascending; labels in vocab."""
    bounds = offsets(s.num_predictions)
    owner = np.repeat(np.arange(len(s)), s.num_predictions)
    pos = s.masked_lm_positions.astype(np.int64)
    sep_a = a_len[owner] - 1
    same = np.concatenate([[False], owner[1:] == owner[:-1]])
    checks = [
        (_per_sequence((pos < 1) | (pos >= s.lengths[owner] - 1) | (pos == sep_a), bounds),
         "a masked position outside the sequence or on [CLS]/[SEP]"),
        (_per_sequence(same & (np.diff(pos, prepend=0) <= 0), bounds), "masked positions not ascending"),
    ]
    if limits.vocab_size is not None:
        checks.append((_per_sequence(_outside(s.masked_lm_ids, limits.vocab_size), bounds),
                       f"masked_lm_ids outside [0, {limits.vocab_size})"))
    return checks


def _width_problem(handle: h5py.File, fmt: str, limits: Limits) -> str | None:
    """A fixed shard's rows must be exactly max_seq_length tokens and max_predictions slots wide."""
    widths = (handle["input_ids"].shape[1:], handle["masked_lm_positions"].shape[1:])
    if fmt != "fixed" or widths == ((limits.max_seq_length,), (limits.max_predictions,)):
        return None
    return (f"rows are {widths[0]} tokens / {widths[1]} predictions wide, "
            f"expected ({limits.max_seq_length},) / ({limits.max_predictions},)")


def _check_block(handle: h5py.File, fmt: str, lo: int, hi: int, limits: Limits, report: ShardReport,
                 seen: ShardDigest, eval_set: np.ndarray) -> None:
    arrays = {k: handle[k][lo:hi] for k in FORMAT_KEYS[fmt]}
    rows = np.arange(lo, hi)
    if fmt == "fixed":
        for bad, what in _fixed_layout_checks(arrays, limits):
            report.flag(bad, rows, what)
        samples, seq_rows = from_fixed(arrays), rows
    elif fmt == "varlength":
        try:
            samples, seq_rows = from_varlength(arrays), rows
        except DataPrepError as err:
            report.problems.append(f"{report.path}: rows from {lo}: {err}")
            return
    else:
        for bad, what in _packed_layout_checks(arrays, limits):
            report.flag(bad, rows, what)
        if report.problems:
            return
        samples, local_rows = from_packed(arrays)
        seq_rows = rows[local_rows]
    for bad, what in _sequence_checks(samples, limits):
        report.flag(bad, seq_rows, what)
    seen.add(samples, seq_rows, eval_set)
    report.sequences += len(samples)
    if len(samples):
        report.shortest = min(report.shortest, int(samples.lengths.min()))
        report.longest = max(report.longest, int(samples.lengths.max()))
        report.most_predictions = max(report.most_predictions, int(samples.num_predictions.max()))
        ids = [int(a.max()) for a in (samples.input_ids, samples.masked_lm_ids) if a.size]
        report.max_token_id = max([report.max_token_id, *ids])


def verify_shard(path: Path, limits: Limits, block_rows: int = BLOCK_ROWS,
                 eval_set: np.ndarray = NO_EVAL) -> ShardReport:
    """All checks of one shard; problems are collected in the report, never raised.

    eval_set: sorted hashes of eval samples (`integrity.eval_hashes`) counted when found here.
    """
    report = ShardReport(Path(path))
    seen = ShardDigest()
    try:
        with open_shard(path) as handle:
            fmt, rows = check_keys(handle)  # keys, integer dtypes, ranks, equal row counts and widths
            problem = _width_problem(handle, fmt, limits)
            if problem:
                report.problems.append(f"{report.path}: {problem}")
                return report
            report.fmt, report.rows = fmt, rows
            if fmt == "packed":
                report.packed = (int(handle["input_ids"].shape[1]), int(handle["packed_input_len"].shape[1]),
                                 int(handle["masked_lm_positions"].shape[1]))
            for lo in range(0, rows, block_rows):
                _check_block(handle, fmt, lo, min(lo + block_rows, rows), limits, report, seen, eval_set)
                if len(report.problems) > 20:
                    break
    except DataPrepError as err:
        report.problems.append(str(err))
    report.digest, report.leaked, report.first_leaked_row = seen.digest(), seen.leaked, seen.first_leaked_row
    return report


def _manifest_problems(
    directory: Path, manifest: Manifest, reports: dict[str, ShardReport], checksums: bool
) -> list[str]:
    """sha256 and row counts against the manifest (presence and sizes: `shards.folder_problems`)."""
    problems = []
    for name, entry in sorted(manifest.files.items()):
        path = directory / name
        if not path.is_file() or path.stat().st_size != entry.get("bytes"):
            continue
        report = reports.get(name)
        digest = report.sha256 if report is not None and report.sha256 else (sha256_file(path) if checksums else None)
        if checksums and digest != entry.get("sha256"):
            problems.append(f"{path}: sha256 differs from the manifest (the file changed or is corrupt)")
        if report is not None and report.fmt != "?" and report.rows != entry.get("samples"):
            problems.append(f"{path}: {report.rows} rows, the manifest says {entry.get('samples')}")
    return problems


def _strata_problems(directory: Path, reports: dict[str, ShardReport]) -> list[str]:
    path = directory / STRATA_NAME
    strata = read_json_object(path)
    bounds, counts = strata.get("bounds", []), strata.get("counts", [])
    problems, found = [], []
    for k, bound in enumerate(bounds):
        low = bounds[k - 1] if k else 0
        stratum = [r for name, r in reports.items() if name.startswith(f"stratum_{k}/") and r.sequences]
        if stratum and (min(r.shortest for r in stratum) <= low or max(r.longest for r in stratum) > bound):
            problems.append(f"{directory}/stratum_{k}: holds lengths outside ({low}, {bound}]")
        found.append(sum(r.sequences for r in stratum))
    if found != counts:
        problems.append(f"{path}: counts {counts}, but the stratum folders hold {found}")
    total = max(sum(found), 1)
    if not np.allclose(strata.get("shares", []), [c / total for c in found], atol=1e-9):
        problems.append(f"{path}: shares do not equal counts / total")
    return problems


def _packing_problems(directory: Path, reports: dict[str, ShardReport]) -> list[str]:
    path = directory / PACKING_REPORT_NAME
    report = read_json_object(path)
    rows, sequences = sum(r.rows for r in reports.values()), sum(r.sequences for r in reports.values())
    problems = []
    if report.get("sequences_dropped") != 0:
        problems.append(f"{path}: {report.get('sequences_dropped')} sequences dropped; repack with another algorithm")
    if report.get("packs") != rows or report.get("sequences") != sequences:
        problems.append(f"{path}: reports {report.get('packs')} packs / {report.get('sequences')} sequences, "
                        f"the shards hold {rows} / {sequences}")
    return problems


def _integrity_problems(directory: Path, reports: dict[str, ShardReport], eval_names: str) -> list[str]:
    """Shards that are copies of each other, and eval samples in the shards (`integrity`)."""
    whole = {r.path: r.digest for r in reports.values() if r.sequences and not r.problems}
    problems = []
    for group in duplicate_groups(whole):
        first, second = (reports[p.relative_to(directory).as_posix()] for p in group[:2])
        exact = first.sha256 == second.sha256 if first.sha256 and second.sha256 else same_bytes(group[0], group[1])
        problems.append(duplicate_message(group, exact))
    where = [(r.path, r.leaked, r.first_leaked_row or 0) for r in reports.values() if r.leaked]
    if where:
        problems.append(leakage_message(where, eval_names, probed=False))
    return problems


@dataclass(frozen=True)
class _ShardJob:
    path: Path
    limits: Limits
    checksum: bool
    eval_set: np.ndarray


def _verify_job(job: _ShardJob) -> ShardReport:
    before = job.path.stat()
    report = verify_shard(job.path, job.limits, eval_set=job.eval_set)
    if job.checksum:
        report.sha256 = sha256_file(job.path)
    report.stat = (before.st_size, before.st_mtime_ns)
    if job.path.stat().st_mtime_ns != before.st_mtime_ns:
        report.problems.append(f"{job.path}: changed while it was verified; verify the folder again")
    return report


def verify_directory(directory: Path | str, limits: Limits, checksums: bool = True,
                     expect_samples: int | None = None, workers: int = 1,
                     eval_sets: EvalSets | None = None) -> tuple[list[str], dict[str, ShardReport]]:
    """(problems, per-shard reports) of a dataset folder; shards are checked by `workers` processes.

    eval_sets: the eval samples no shard of this folder may hold (none for an eval folder).
    """
    directory = Path(directory)
    if not directory.is_dir():
        return [f"{directory}: not a folder"], {}
    shards = folder_shards(directory)
    if not shards:
        return [f"{directory}: no *.hdf5 shards here or in stratum_*/ folders"], {}
    eval_set = eval_sets.hashes if eval_sets is not None else NO_EVAL
    jobs = [_ShardJob(p, limits, checksums, eval_set) for p in shards]
    done = {r.path: r for r in run_jobs(_verify_job, jobs, workers)}
    reports = {p.relative_to(directory).as_posix(): done[p] for p in shards}
    problems = [msg for r in reports.values() for msg in r.problems]
    problems += _integrity_problems(directory, reports, eval_sets.names if eval_sets is not None else "")
    try:
        problems += folder_problems(directory)
        manifest = Manifest.load(directory)
        if manifest is not None:
            problems += _manifest_problems(directory, manifest, reports, checksums)
        if (directory / STRATA_NAME).is_file():
            problems += _strata_problems(directory, reports)
        if (directory / PACKING_REPORT_NAME).is_file():
            problems += _packing_problems(directory, reports)
    except DataPrepError as err:
        problems.append(str(err))
    total = sum(r.sequences for r in reports.values())
    if expect_samples is not None and total != expect_samples:
        problems.append(f"{directory}: {total} samples, expected {expect_samples}")
    return problems, reports


def limits_for(directory: Path, args: argparse.Namespace, vocab: Vocab | None) -> tuple[Limits, str]:
    """The limits a folder is checked against: the flags, else the folder's own lengths, else MLPerf's."""
    found = recorded_lengths(directory)
    chosen = {}
    for name, default in (("max_seq_length", MAX_SEQ_LENGTH), ("max_predictions", MAX_PREDICTIONS)):
        given = getattr(args, name)
        chosen[name] = (given, "flag") if given else found.get(name, (default, "assumed, pass --" + name))
    origin = ", ".join(f"{name} {value} ({where})" for name, (value, where) in chosen.items())
    length, predictions = chosen["max_seq_length"][0], chosen["max_predictions"][0]
    if vocab is not None:
        return Limits(length, predictions, vocab.size, vocab.cls_id, vocab.sep_id), origin
    return Limits(length, predictions, args.vocab_size), origin


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", type=Path, nargs="+",
                        help="dataset folders to check, training and eval in any order: eval sets are recognised "
                             "by what they hold (see --eval_dir), and every other folder is checked for eval samples")
    parser.add_argument("--vocab", type=Path, help="vocab.txt: checks ids and the [CLS]/[SEP] layout")
    parser.add_argument("--vocab_size", type=int, help="checks ids against this size (without --vocab)")
    parser.add_argument("--max_seq_length", type=int,
                        help="default: from MANIFEST.json or a fixed/packed shard's width, else 512")
    parser.add_argument("--max_predictions", type=int,
                        help="default: from MANIFEST.json or a fixed shard's width, else 76")
    parser.add_argument("--expect_samples", type=int, help="total samples (sequences) the folder must hold")
    parser.add_argument("--no_checksums", action="store_true", help="skip the sha256 comparison with MANIFEST.json")
    parser.add_argument("--eval_dir", type=Path, action="append",
                        help="an eval folder no training folder may hold samples of; a DIRECTORY is an eval set "
                             f"too when it has {EVAL_RULE} (what `prepare.py eval` writes, and what "
                             "import-tfrecord makes of eval_10k / eval_intermediate), whatever its place among "
                             "the folders; the others are checked against every eval set")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: all cores)")
    parser.add_argument("--quick", action="store_true",
                        help="only the quick integrity check (copied shards and eval samples, from a few rows per "
                             "shard, mlperf_bert.data.integrity.check_integrity); writes no verification record")


def _packed_widths(reports: dict[str, ShardReport]) -> tuple[int, int, int] | None:
    """The widest packed row of a folder (row width, K, Q), each the largest over its shards: the
    static shape of a CUDA-graphed step must hold every row (`pack` sizes Q per shard)."""
    widths = [r.packed for r in reports.values() if r.packed is not None]
    return tuple(max(w[i] for w in widths) for i in range(3)) if widths else None  # type: ignore[return-value]


def verification_record(directory: Path, reports: dict[str, ShardReport], problems: list[str], own_digest: str,
                        eval_sets: EvalSets | None) -> Record:
    """What the trainer reads before the clock instead of the rows (`mlperf_bert.data.record`).

    own_digest: the folder's `samples_digest` when it is an eval set ("" for training folders).
    """
    files = {name: FileEntry(r.stat[0], r.stat[1], r.sha256 or "", r.rows, r.sequences) for name, r in reports.items()}
    formats = sorted({r.fmt for r in reports.values()})
    packed = _packed_widths(reports)
    return Record(
        directory, not problems, "eval" if own_digest else "train", "/".join(formats), files,
        sum(r.sequences for r in reports.values()), max((r.longest for r in reports.values()), default=0),
        max((r.most_predictions for r in reports.values()), default=0),
        max((r.max_token_id for r in reports.values()), default=0), packed, own_digest,
        tuple(sorted(eval_sets.digests.values())) if eval_sets is not None else (), tuple(problems[:100]))


def _write_record(record: Record, limits: Limits, eval_sets: EvalSets | None) -> None:
    against = f"; eval samples looked for: {eval_sets.names}" if eval_sets is not None else "; no eval set given"
    structure = ", [CLS]/[SEP] structure" if limits.cls_id is not None else ""
    ids = "ids" if limits.vocab_size is not None else "ids (no vocabulary size given)"
    checked = (f"every row of every shard (layout{structure}, {ids}, lengths, masked positions), "
               f"copied shards{against}")
    limits_seen = {"max_seq_length": limits.max_seq_length, "max_predictions": limits.max_predictions,
                   "vocab_size": limits.vocab_size}
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    write_text_atomic(record.path, record_json(record, checked, limits_seen, stamp))


def _verify_one(directory: Path, args: argparse.Namespace, vocab: Vocab | None,
                eval_sets: EvalSets | None, own_digest: str = "") -> list[str]:
    """Checks one folder, writes its verification record, prints its problems and an OK / FAILED line;
    the problems (none: valid). own_digest: the folder's samples digest when it is an eval set."""
    limits = Limits()
    try:
        limits, origin = limits_for(directory, args, vocab)
        problems, reports = verify_directory(directory, limits, not args.no_checksums, args.expect_samples,
                                             args.workers, eval_sets)
    except DataPrepError as err:
        problems, reports, origin = [str(err)], {}, "unknown lengths"
    if directory.is_dir():
        _write_record(verification_record(directory, reports, problems, own_digest, eval_sets), limits, eval_sets)
    for problem in problems:
        print(problem, file=sys.stderr)
    formats = sorted({r.fmt for r in reports.values()})
    sequences = sum(r.sequences for r in reports.values())
    status = "FAILED" if problems else "OK"
    print(f"{status}: {directory}: {len(reports)} shards ({', '.join(formats)}), {sequences} samples, {origin}"
          + (f", {len(problems)} problems" if problems else ""))
    return problems


def mark_refused(directory: Path, problems: list[str]) -> None:
    """Leaves REFUSED_NAME in a folder this verification refused: the trainer, verify_dataset and every
    data_prep step that reads the folder then refuse it too (`shards.folder_problems`), so a set that
    failed is never taken for a finished one."""
    write_text_atomic(directory / REFUSED_NAME, "\n".join(problems) + "\n")


def run(args: argparse.Namespace, refuse: bool = False) -> int:
    """Verifies every folder of `args.directory`; prints problems; 0 when all are valid.

    refuse: the caller just wrote these folders (`prepare.py`): the old verdicts (REFUSED_NAME) are
    dropped first, and each folder that fails is marked refused.
    """
    try:
        vocab = load_vocab(args.vocab) if args.vocab else None
    except DataPrepError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    directories = [Path(directory) for directory in args.directory]
    leak_check = LeakCheck.plan(directories, getattr(args, "eval_dir", None) or [])
    leak_check.report()
    eval_folders = list(leak_check.eval_folders)
    try:
        eval_sets = EvalSets.read(eval_folders)
    except DataPrepError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if getattr(args, "quick", False):
        return _quick(directories, eval_folders)
    if refuse:
        for directory in directories:
            (directory / REFUSED_NAME).unlink(missing_ok=True)
    failed = False
    for directory in directories:
        is_eval = directory in eval_folders
        own = eval_sets.digests[directory] if is_eval and eval_sets is not None else ""
        problems = _verify_one(directory, args, vocab, None if is_eval else eval_sets, own)
        if problems and refuse and directory.is_dir():
            mark_refused(directory, problems)
        failed = failed or bool(problems)
    return 1 if failed else 0


def _quick(directories: list[Path], eval_folders: list[Path]) -> int:
    """The probe-based integrity check of each training folder: minutes on the full set where the full
    check takes process-hours; a pre-check, so it writes no record (docs/DATA_INTEGRITY.md)."""
    failed = False
    for directory in (d for d in directories if d not in eval_folders):
        try:
            sources: list[Path | None] = [*eval_folders] or [None]
            for source in sources:
                check_integrity(folder_shards(directory), source, None)
            print(f"OK (quick): {directory}: no copied shards or eval samples found in the probed rows")
        except DataPrepError as err:
            print(str(err), file=sys.stderr)
            print(f"FAILED (quick): {directory}")
            failed = True
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
