"""Atomic outputs, checksums and the per-directory MANIFEST.json that makes reruns resume.

Every output is written under a hidden temporary name in its final directory and renamed
into place only when complete, so an interrupted run never leaves a half-written shard under
a real name. The manifest records each finished file's sha256 and sample count together
with the parameters that made it; a rerun skips the files whose checksum still matches and
refuses a directory that was made with other parameters.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from data_prep.formats import MANIFEST_NAME, DataPrepError

_TEMP_MARK = ".tmp-"
_HASH_BLOCK = 1 << 22  # bytes read per sha256 update


def temp_name(path: Path) -> Path:
    """Hidden sibling of `path` that no shard glob (*.hdf5) matches."""
    return path.with_name(f".{path.name}{_TEMP_MARK}{os.getpid()}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextmanager
def atomic_output(path: Path | str) -> Iterator[Path]:
    """Yields a temporary path (file or directory) that becomes `path` only on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_name(path)
    _remove(temp)
    try:
        yield temp
        if temp.is_dir() and path.exists():
            _remove(path)  # os.replace cannot replace a non-empty directory
        os.replace(temp, path)
    finally:
        if temp.exists():
            _remove(temp)


def remove_stale_temps(directory: Path) -> int:
    """Deletes what interrupted runs left under temporary names; returns how many."""
    if not directory.is_dir():
        return 0
    stale = [p for p in directory.rglob(f".*{_TEMP_MARK}*")]
    for path in stale:
        _remove(path)
    return len(stale)


def write_json(path: Path | str, data: Any) -> None:
    with atomic_output(Path(path)) as temp:
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


def _normalised(params: dict[str, Any]) -> dict[str, Any]:
    """Parameters as JSON gives them back (tuples become lists), so saved and new compare equal."""
    return json.loads(json.dumps(params, sort_keys=True))


class Manifest:
    """MANIFEST.json of one output directory.

    Layout: {"kind": step name, "params": {...}, "files": {relative path: {"sha256", "bytes",
    "samples", "format"}}}. Saved atomically after every recorded file.
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
        if existing.kind != kind or existing.params != wanted:
            changed = sorted(k for k in set(wanted) | set(existing.params) if wanted.get(k) != existing.params.get(k))
            raise DataPrepError(
                f"{directory}: holds '{existing.kind}' outputs made with other settings "
                f"(differs in: {', '.join(changed) or 'step'}); use a new output directory or delete this one"
            )
        return existing

    def is_done(self, name: str) -> bool:
        """True when `name` was recorded and the file on disk still has its size and sha256."""
        entry = self.files.get(name)
        path = self.directory / name
        if entry is None or not path.is_file() or path.stat().st_size != entry.get("bytes"):
            return False
        return sha256_file(path) == entry.get("sha256")

    def record(self, name: str, samples: int, fmt: str, sha256: str | None = None, **extra: Any) -> None:
        """Adds a finished file (its sha256 is computed unless the writer already has it)."""
        path = self.directory / name
        self.files[name] = {"sha256": sha256 or sha256_file(path), "bytes": path.stat().st_size,
                            "samples": int(samples), "format": fmt, **extra}
        self.save()

    def save(self) -> None:
        data = {"kind": self.kind, "params": self.params, "files": self.files}
        write_json(self.path, data)

    @property
    def total_samples(self) -> int:
        return sum(int(e["samples"]) for e in self.files.values())
