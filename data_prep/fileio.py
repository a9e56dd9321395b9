"""Atomic outputs, checksums and the per-directory MANIFEST.json that makes reruns resume.

Every output is written under a hidden temporary name in its final directory and renamed
into place only when complete (`mlperf_bert.runtime.files.atomic_path`), so an interrupted run
never leaves a half-written shard under a real name. The manifest records each finished file's sha256 and sample count together
with the parameters that made it; a rerun skips the files whose checksum still matches and
refuses a directory that was made with other parameters.

Outputs are keyed on the content of their inputs, not their names: a content key is
[name, bytes, mtime_ns, sha256]. Two keys name the same content when name, size and sha256
agree; the sha256 is computed again only when size or mtime changed since it was recorded (in
the key given, or in the input's own folder manifest), so a rerun over unchanged inputs reads
no input twice, and a text part edited in place (same name, same flags) is noticed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from data_prep.formats import MANIFEST_NAME, DataPrepError
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


def write_json(path: Path | str, data: Any) -> None:
    with atomic_path(path) as temp:
        temp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def read_json(path: Path | str) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DataPrepError(f"{path}: cannot read JSON ({err}); delete it and rerun the step") from err


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


@functools.lru_cache(maxsize=16)
def _recorded_files(manifest: str, mtime_ns: int) -> dict[str, dict]:
    """The files table of a manifest as of `mtime_ns` (cached: many inputs share one folder)."""
    files = read_json(manifest).get("files", {})
    return files if isinstance(files, dict) else {}


def _known_sha256(path: Path, size: int, mtime_ns: int, known: list | None) -> str | None:
    """A recorded sha256 of `path` that still holds: same size and mtime as when it was recorded."""
    if known is not None and known[1:3] == [size, mtime_ns]:
        return known[3]
    manifest = path.parent / MANIFEST_NAME
    if not manifest.is_file():
        return None
    entry = _recorded_files(str(manifest), manifest.stat().st_mtime_ns).get(path.name, {})
    if entry.get("bytes") == size and entry.get("mtime_ns") == mtime_ns:
        return entry.get("sha256")
    return None


def content_key(path: Path, known: list | None = None) -> list:
    """[name, bytes, mtime_ns, sha256] of an input file (module docstring); `known`: its last key."""
    stat = path.stat()
    sha = _known_sha256(path, stat.st_size, stat.st_mtime_ns, known) or sha256_file(path)
    return [path.name, stat.st_size, stat.st_mtime_ns, sha]


def same_content(a: list | None, b: list | None) -> bool:
    """Whether two content keys (or lists of them) name the same content; mtimes do not count."""
    if a is None or b is None:
        return a is b
    if len(a) != len(b):
        return False
    if a and isinstance(a[0], list):
        return all(same_content(x, y) for x, y in zip(a, b))
    return [a[0], a[1], a[3]] == [b[0], b[1], b[3]]


def _normalised(params: dict[str, Any]) -> dict[str, Any]:
    """Parameters as JSON gives them back (tuples become lists), so saved and new compare equal."""
    return json.loads(json.dumps(params, sort_keys=True))


class Manifest:
    """MANIFEST.json of one output directory.

    Layout: {"kind": step name, "params": {...}, "files": {relative path: {"sha256", "bytes",
    "mtime_ns", "samples", "format", ...}}}. Saved atomically after every recorded file.
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
            log.warning("%s: its inputs changed since these outputs were made: making them again", directory)
            return cls(directory, kind, params)
        existing.params = wanted  # the same content; newer mtimes spare the next run the hashing
        return existing

    def is_done(self, name: str, source: Path | None = None) -> bool:
        """True when `name` was recorded and the file on disk still has its size and sha256.

        source: the one input `name` is made from (recorded with `record(..., source=...)`); it
        must still have the content it had then.
        """
        entry = self.files.get(name)
        path = self.directory / name
        if entry is None or not path.is_file() or path.stat().st_size != entry.get("bytes"):
            return False
        if source is not None and not same_content(content_key(source, entry.get("source")), entry.get("source")):
            return False
        return sha256_file(path) == entry.get("sha256")

    def record(self, name: str, samples: int, fmt: str, sha256: str | None = None, source: Path | None = None,
               **extra: Any) -> None:
        """Adds a finished file (its sha256 is computed unless the writer already has it).

        source: the one input the file is made from; its content key is kept for `is_done`.
        """
        path = self.directory / name
        stat = path.stat()
        self.files[name] = {"sha256": sha256 or sha256_file(path), "bytes": stat.st_size,
                            "mtime_ns": stat.st_mtime_ns, "samples": int(samples), "format": fmt, **extra}
        if source is not None:
            self.files[name]["source"] = content_key(source)
        self.save()

    def save(self) -> None:
        data = {"kind": self.kind, "params": self.params, "files": self.files}
        write_json(self.path, data)

    @property
    def total_samples(self) -> int:
        return sum(int(e["samples"]) for e in self.files.values())
