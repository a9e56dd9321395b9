"""Atomic outputs, checksums and the per-directory MANIFEST.json that makes reruns resume.

Every output is written under a hidden temporary name in its final directory and renamed
into place only when complete (`mlperf_bert.runtime.files.atomic_path`), so an interrupted run
never leaves a half-written shard under a real name. The manifest records each finished
file's sha256 and sample count together with the parameters that made it; a rerun skips the
files whose checksum still matches and refuses a directory that was made with other parameters.

Outputs are keyed on the content of their inputs, not their names: a content key is
[name, bytes, sha256]. A manifest holds content only (names, sizes, sha256, sample counts,
parameters), never times, so the same inputs and flags give byte-identical folders, manifests
included, whatever the number of workers. Within one process a file's sha256 is computed at
most once while the file stays as it is (`file_sha256`, keyed on its inode, size, mtime and
ctime; a writer's own digest counts too), so `prepare.py all` hashes each text part and each
output once. Nothing is trusted across processes: a rerun hashes its inputs again, which is
what notices a text part edited in place with the same name, size and even mtime.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

from data_prep.formats import MANIFEST_NAME, PACKING_REPORT_NAME, STRATA_NAME, DataPrepError
from mlperf_bert.data.shards import folder_shards
from mlperf_bert.runtime.files import TEMP_MARK, atomic_path, remove_path

log = logging.getLogger("data_prep")

_HASH_BLOCK = 1 << 22  # bytes read per sha256 update


def remove_stale_temps(directory: Path) -> int:
    """Deletes what interrupted runs left under temporary names; returns how many."""
    if not directory.is_dir():
        return 0
    stale = [p for p in directory.rglob(f".*{TEMP_MARK}*")]
    for path in stale:
        remove_path(path)
    return len(stale)


FINAL_REPORTS = (PACKING_REPORT_NAME, STRATA_NAME)  # written last by pack / stratify: the folder is complete


def _few(names: list[str], shown: int = 5) -> str:
    """The first names of a list, and how many more there are."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def write_json(path: Path | str, data: Any) -> None:
    with atomic_path(path) as temp:
        temp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def read_json(path: Path | str) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DataPrepError(f"{path}: cannot read JSON ({err}); delete it and rerun the step") from err


def read_json_object(path: Path | str) -> dict[str, Any]:
    """A record data_prep wrote (strata.json, packing_report.json): a JSON object, or one line naming the file."""
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise DataPrepError(f"{path}: a JSON {type(raw).__name__}, not the object data_prep writes; delete it and "
                            "rerun the step")
    return raw


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


RACY_NS = 2_000_000_000  # a file changed this recently may change again without its stat showing it
# sha256 of the files hashed or written by this process, by file identity (`_identity`). A
# memo, not a record: it dies with the process, so a rerun always hashes its inputs afresh.
_KNOWN_SHA256: dict[tuple[int, ...], str] = {}


def _identity(stat: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is replaced or written: an atomic rename gives a new inode, an
    in-place write a new ctime (which no user can set back, unlike mtime)."""
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


def file_sha256(path: Path) -> str:
    """sha256 of a file, computed once per process for as long as the file stays as it is.

    A file changed within the last RACY_NS is hashed every time: a second write inside the
    same timestamp tick would leave size, mtime and ctime as they were (git's "racily clean").
    """
    stat = path.stat()
    before = _identity(stat)
    known = _KNOWN_SHA256.get(before)
    if known is not None:
        return known
    started = time.time_ns()
    digest = sha256_file(path)
    if _identity(path.stat()) == before and started - stat.st_ctime_ns > RACY_NS:
        _KNOWN_SHA256[before] = digest
    return digest


def remember_sha256(path: Path, digest: str) -> None:
    """The sha256 a writer computed for the file it just wrote (so this process need not read it)."""
    _KNOWN_SHA256[_identity(path.stat())] = digest


def content_key(path: Path) -> list:
    """[name, bytes, sha256] of an input file (module docstring)."""
    return [path.name, path.stat().st_size, file_sha256(path)]


def _comparable(key: list) -> list:
    # Manifests of earlier versions keep an mtime between size and sha256: it never counts.
    return [key[0], key[1], key[-1]]


def same_content(a: list | None, b: list | None) -> bool:
    """Whether two content keys (or lists of them) name the same content."""
    if a is None or b is None or not a or not b:
        return a == b
    if isinstance(a[0], list):  # lists of keys
        return len(a) == len(b) and all(same_content(x, y) for x, y in zip(a, b))
    return len(a) >= 3 and len(b) >= 3 and _comparable(a) == _comparable(b)


def changed_inputs(old: list[list] | None, new: list[list]) -> list[str]:
    """Input names whose content differs between two lists of content keys, and what happened."""
    before = {key[0]: key for key in old or []}
    after = {key[0]: key for key in new}
    lines = [f"{name} (new)" for name in after if name not in before]
    lines += [f"{name} (other content)" for name in after
              if name in before and not same_content(before[name], after[name])]
    return lines + [f"{name} (gone)" for name in before if name not in after]


def _normalised(params: dict[str, Any]) -> dict[str, Any]:
    """Parameters as JSON gives them back (tuples become lists), so saved and new compare equal."""
    return json.loads(json.dumps(params, sort_keys=True))


class Manifest:
    """MANIFEST.json of one output directory.

    Layout: {"kind": step name, "params": {...}, "files": {relative path: {"sha256", "bytes",
    "samples", "format", ...}}}. Saved atomically after every recorded file, keys sorted.
    params["inputs"], when a step gives it, holds the content keys of the step's inputs: when
    they changed, every output is stale and the step starts over in the same directory.
    """

    def __init__(self, directory: Path, kind: str, params: dict[str, Any], files: dict[str, dict] | None = None):
        self.directory = Path(directory)
        self.kind = kind
        self.params = _normalised(params)
        self.files: dict[str, dict] = dict(files or {})

    @property
    def path(self) -> Path:
        return self.directory / MANIFEST_NAME

    @classmethod
    def load(cls, directory: Path) -> Manifest | None:
        path = Path(directory) / MANIFEST_NAME
        if not path.is_file():
            return None
        raw = read_json(path)
        if not isinstance(raw, dict) or not isinstance(raw.get("files"), dict):
            raise DataPrepError(f"{path}: not a data_prep manifest (no 'files' table); delete it and rerun")
        return cls(path.parent, str(raw.get("kind", "")), raw.get("params", {}), raw["files"])

    @classmethod
    def open(cls, directory: Path, kind: str, params: dict[str, Any]) -> Manifest:
        """The directory's manifest for this step; a new one when there is none yet.

        Raises when the directory holds outputs of another step or of other parameters,
        because mixing them would silently give a dataset that no single command made.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(directory)
        existing = cls.load(directory)
        if existing is None:
            return cls(directory, kind, params)
        wanted = _normalised(params)
        changed = sorted(k for k in set(wanted) | set(existing.params) if k != "inputs" and
                         wanted.get(k) != existing.params.get(k))
        if existing.kind != kind or changed:
            raise DataPrepError(
                f"{directory}: holds '{existing.kind}' outputs made with other settings "
                f"(differs in: {', '.join(changed) or 'step'}); use a new output directory or delete this one"
            )
        if not same_content(wanted.get("inputs"), existing.params.get("inputs")):
            changed_names = changed_inputs(existing.params.get("inputs"), wanted.get("inputs") or [])
            log.warning("%s: made from other inputs than these (%s): deleting its %d outputs and making them again",
                        directory, _few(changed_names), len(existing.files))
            fresh = cls(directory, kind, params)
            fresh.start_over(existing)
            return fresh
        existing.params = wanted  # the same content (keys of an earlier layout become today's)
        return existing

    def start_over(self, old: Manifest) -> None:
        """Deletes the outputs of `old` and the step's final report, then saves this manifest.

        Outputs of other inputs must not stay beside the new ones: a stratum that now gets
        fewer shards would keep its old part_i_of_N files, and a report its old counts. The
        shards of the folder go too when `old` does not list them (renamed into place, then
        interrupted before they were recorded). Deleting comes first, so an interruption leaves
        the old manifest, which the next run replaces again.
        """
        stale = {self.directory / name for name in old.files} | set(folder_shards(self.directory))
        for path in sorted(stale) + [self.directory / name for name in FINAL_REPORTS]:
            remove_path(path)
        self.save()

    def is_done(self, name: str, source: Path | None = None) -> bool:
        """True when `name` was recorded and the file on disk still has its size and sha256.

        source: the one input `name` is made from (recorded with `record(..., source=...)`); it
        must still have the content it had then.
        """
        entry = self.files.get(name)
        path = self.directory / name
        if entry is None or not path.is_file() or path.stat().st_size != entry.get("bytes"):
            return False
        if source is not None and not same_content(content_key(source), entry.get("source")):
            return False
        return file_sha256(path) == entry.get("sha256")

    def record(self, name: str, samples: int, fmt: str, sha256: str | None = None, source: list | None = None,
               **extra: Any) -> None:
        """Adds a finished file (its sha256 is computed unless the writer already has it).

        source: the content key (`content_key`) of the one input the file is made from, taken
        before it was read, so an input edited while it was read is made again next time.
        """
        path = self.directory / name
        if sha256 is None:
            sha256 = file_sha256(path)
        else:
            remember_sha256(path, sha256)
        self.files[name] = {"sha256": sha256, "bytes": path.stat().st_size, "samples": int(samples), "format": fmt,
                            **extra}
        if source is not None:
            self.files[name]["source"] = source
        self.save()

    def forget(self, names: list[str]) -> None:
        """Drops files from the manifest (their outputs were deleted on purpose) and saves it."""
        for name in names:
            self.files.pop(name, None)
        self.save()

    def save(self) -> None:
        data = {"kind": self.kind, "params": self.params, "files": self.files}
        write_json(self.path, data)

    @property
    def total_samples(self) -> int:
        return sum(int(e["samples"]) for e in self.files.values())
