"""The verification record: what data_prep's full verification checked, read before the clock.

MLPerf times a run from the moment any part of the system touches the dataset: "The clock must
start before any part of the system touches the dataset or when the maximum model
initialization time is exceeded" (training_rules.adoc §11, Run Results); metadata such as
document counts and sizes may be used before it (§6.4, Other Uses of Data). So the checks that
read rows run outside the timed process: `data_prep/verify_dataset.py` reads every row of a
folder and writes `RECORD_NAME` into it, with each file's size, modification time, content
digest and row count, the largest token id, length and prediction count it saw, the packed
widths, the digest of the folder's samples and the eval sets the folder was checked against.

Before `run_start` the trainer reads this record and nothing else of the folder: it compares
the record with the files by `os.stat` and a listing of names (`stale_problems`), and with the
run's limits and eval set (`record_problems`). Torch-free: data_prep writes it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .shards import REFUSED_NAME, TEMP_MARK, DataError, folder_shards

RECORD_NAME = "VERIFIED.json"
RECORD_VERSION = 1
VERIFY_COMMAND = "python data_prep/verify_dataset.py"


@dataclass(frozen=True)
class FileEntry:
    """One verified shard as it was when verified."""

    bytes: int
    mtime_ns: int
    sha256: str
    rows: int
    sequences: int


@dataclass(frozen=True)
class Record:
    """The contents of a folder's RECORD_NAME (`write_record` writes the same fields)."""

    folder: Path
    ok: bool  # the verification found no problem
    kind: str  # "train" or "eval"
    format: str  # fixed, varlength or packed
    files: dict[str, FileEntry]  # relative path -> entry
    sequences: int
    longest: int  # tokens of the longest sequence
    most_predictions: int  # masked positions of the sequence with the most
    max_token_id: int  # the largest input or masked-LM id
    packed: tuple[int, int, int] | None  # (row width L, sequences per row K, predictions per row Q)
    samples_digest: str  # sha256 of the sorted unique sample hashes (`integrity.sequence_hashes`)
    eval_digests: tuple[str, ...]  # samples_digest of every eval set the folder was checked against
    problems: tuple[str, ...] = field(default=())

    @property
    def path(self) -> Path:
        return self.folder / RECORD_NAME

    @property
    def rows(self) -> int:
        return sum(entry.rows for entry in self.files.values())

    @property
    def contradiction(self) -> str | None:
        """Why an `ok` record cannot be what the verification wrote, from its own fields (None: it can).

        The verification writes `ok` only without problems, and refuses two shards with samples of equal
        content (`integrity.duplicate_groups`; equal sha256 is the byte-identical kind). A record that says
        `ok` and lists problems, or equal sha256s of two such shards, was changed after it was written
        (a status edited by hand from failed). Empty sha256s (--no_checksums) are no evidence.
        """
        if not self.ok:
            return None
        if self.problems:
            return f"status ok, yet it lists {len(self.problems)} problem(s) the verification found"
        by_digest: dict[str, list[str]] = {}
        for name, entry in sorted(self.files.items()):
            if entry.sha256 and entry.sequences:
                by_digest.setdefault(entry.sha256, []).append(name)
        copies = next((names for names in by_digest.values() if len(names) > 1), None)
        if copies:
            return (f"status ok, yet {copies[0]} and {copies[1]} have the same sha256: byte-identical shards, "
                    "which the verification refuses")
        return None


def _entry(raw: dict[str, Any]) -> FileEntry:
    return FileEntry(int(raw["bytes"]), int(raw["mtime_ns"]), str(raw["sha256"]), int(raw["rows"]),
                     int(raw["sequences"]))


def _parse(folder: Path, raw: Any) -> Record:
    """The record's fields; ValueError, KeyError or TypeError naming what is not as `record_json` writes it."""
    if not isinstance(raw, dict):
        raise ValueError(f"a JSON {type(raw).__name__}, not the record's object")
    if not isinstance(raw.get("files"), dict):
        raise ValueError(f"'files' is a JSON {type(raw.get('files')).__name__}, not a table of file name -> entry")
    if int(raw.get("version", 0)) != RECORD_VERSION:
        raise ValueError(f"version {raw.get('version')}, this trainer reads version {RECORD_VERSION}")
    packed = raw.get("packed")
    return Record(folder, raw["status"] == "ok", str(raw["kind"]), str(raw["format"]),
                  {str(name): _entry(entry) for name, entry in raw["files"].items()}, int(raw["sequences"]),
                  int(raw["longest"]), int(raw["most_predictions"]), int(raw["max_token_id"]),
                  tuple(int(v) for v in packed) if packed else None,  # type: ignore[arg-type]
                  str(raw["samples_digest"]), tuple(str(d) for d in raw["eval_digests"]),
                  tuple(str(p) for p in raw.get("problems", [])))


def read_record(folder: Path | str) -> Record | None:
    """The folder's record, None when it has none; an unreadable one raises DataError naming the fix."""
    folder = Path(folder)
    path = folder / RECORD_NAME
    if not path.is_file():
        return None
    try:
        return _parse(folder, json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path}: not a readable verification record ({err}); run `{VERIFY_COMMAND} {folder}` "
                        "to verify the folder again") from err


def record_json(record: Record, checked: str, limits: dict[str, int | None], verified_at: str) -> str:
    """The record as written: `checked` says what the verification covered, in words."""
    body = {
        "version": RECORD_VERSION, "status": "ok" if record.ok else "failed", "kind": record.kind,
        "format": record.format, "checked": checked, "limits": limits, "verified_at": verified_at,
        "sequences": record.sequences, "longest": record.longest, "most_predictions": record.most_predictions,
        "max_token_id": record.max_token_id, "packed": list(record.packed) if record.packed else None,
        "samples_digest": record.samples_digest, "eval_digests": list(record.eval_digests),
        "problems": list(record.problems),
        "files": {name: vars(entry) for name, entry in sorted(record.files.items())},
    }
    return json.dumps(body, indent=1) + "\n"


def stale_problems(record: Record) -> list[str]:
    """What changed in the folder since it was verified, from `os.stat` and file names alone.

    A listed file missing, or of another size or modification time; a shard the record does not
    list; a temporary file of an interrupted step; data_prep's refusal marker.
    """
    folder, problems = record.folder, []
    for name, entry in sorted(record.files.items()):
        path = folder / name
        try:
            st = path.stat()
        except OSError:
            problems.append(f"{path}: verified, now missing")
            continue
        if (st.st_size, st.st_mtime_ns) != (entry.bytes, entry.mtime_ns):
            problems.append(f"{path}: changed since it was verified (size or modification time)")
    listed = {folder / name for name in record.files}
    problems += [f"{path}: a shard the verification did not see" for path in folder_shards(folder)
                 if path not in listed]
    problems += [f"{path}: a temporary file of an interrupted step" for path in folder.rglob(f".*{TEMP_MARK}*")]
    if (folder / REFUSED_NAME).exists():
        problems.append(f"{folder / REFUSED_NAME}: data_prep's verification refused this folder")
    return problems


def reverify_advice(folder: Path | str, eval_dir: Path | str | None = None) -> str:
    against = f" --eval_dir {eval_dir}" if eval_dir is not None else ""
    return f"run `{VERIFY_COMMAND} {folder}{against}` (it reads every row and writes {RECORD_NAME})"
