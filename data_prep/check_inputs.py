"""Step `check-inputs`: are the downloaded inputs the benchmark's? Sizes and md5 sums.

The table is the one MLCommons publishes with the BERT reference (mlcommons/training,
language_model/tensorflow/bert/dataset.md, "MD5sums of provided files" and "Files in
<bert>/results directory"). That page lists only six of the 500 text parts; the md5 sums of
all of them ship with the text as `bert_reference_results_text_md5.txt` (md5sum format):
pass it with --md5_list and every part is checked. A file the tables do not know is
reported as not checked, never as good.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from data_prep.fileio import read_json
from data_prep.formats import DataPrepError

log = logging.getLogger(__name__)

# name: (size in bytes, md5), from the published table.
PUBLISHED: dict[str, tuple[int | None, str]] = {
    "bert_config.json": (314, "7f59165e21b7d566db610ff6756c926b"),
    "vocab.txt": (231_508, "64800d5d8528ce344256daf115d4965e"),
    "model.ckpt-28252.index": (17_371, "f97de3ae180eb8d479555c939d50d048"),
    "model.ckpt-28252.meta": (24_740_228, "dbd16c731e8a8113bc08eeed0326b8e7"),
    "model.ckpt-28252.data-00000-of-00001": (4_034_713_312, "50797acd537880bfb5a7ade80d976129"),
    "eval.txt": (32_851_144, "2a220f790517261547b1b45ed3ada07a"),
    "eval.md5": (330_000, "71a58382a68947e93e88aa0d42431b6c"),
    "part-00000-of-00500": (27_150_902, "a64a7c31eff5cd38ae6d94f7a6229dab"),
    "part-00001-of-00500": (27_198_569, "549a9ed4f805257245bec936563abfd0"),
    "part-00002-of-00500": (27_395_616, "1a1366ddfc03aef9d41ce552ee247abf"),
    "part-00497-of-00500": (24_775_043, "66835aa75d4855f2e678e8f3d73812e9"),
    "part-00498-of-00500": (24_575_505, "e6d68a7632e9f4aa1a94128cce556dc9"),
    "part-00499-of-00500": (21_873_644, "b3b087ad24e3770d879a351664cebc5a"),
}
# The TF2 checkpoint shares the TF1 file names; recognised only to say which one it is.
TF2_CHECKPOINT = {"fc34dd7a54afc07f2d8e9d64471dc672": "model.ckpt-28252.index",
                  "77d642b721cf590c740c762c7f476e04": "model.ckpt-28252.data-00000-of-00001"}
REQUIRED = ("bert_config.json", "vocab.txt", "model.ckpt-28252.index", "model.ckpt-28252.meta",
            "model.ckpt-28252.data-00000-of-00001", "eval.txt", *(f"part-{i:05d}-of-00500" for i in range(500)))
_MD5_LINE = re.compile(r"^([0-9a-fA-F]{32})\s+\*?(.+?)\s*$")


@dataclass
class Report:
    good: list[str]
    bad: list[str]  # one line each: file, what differs, what to do
    unchecked: list[str]  # input files no table knows
    missing: list[str]  # required inputs not found


def read_md5_list(path: Path) -> dict[str, tuple[int | None, str]]:
    """An md5sum-format file ("<md5>  <name>" per line) as table entries without sizes."""
    table: dict[str, tuple[int | None, str]] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        match = _MD5_LINE.match(line)
        if match is None:
            raise DataPrepError(f"{path}: line {number} is not '<md5>  <file name>'; give an md5sum output file")
        table[Path(match.group(2)).name] = (None, match.group(1).lower())
    return table


def read_table(path: Path) -> dict[str, tuple[int | None, str]]:
    """A JSON table {name: [size or null, md5]} that replaces the published one."""
    raw = read_json(path)
    try:
        return {str(name): (None if size is None else int(size), str(md5).lower()) for name, (size, md5) in raw.items()}
    except (AttributeError, TypeError, ValueError) as err:
        raise DataPrepError(f"{path}: expected {{\"file name\": [size or null, \"md5\"]}}") from err


def md5_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _files(paths: list[Path]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        if not path.exists():
            raise DataPrepError(f"{path}: no such file or folder (check-inputs INPUTS)")
        found += [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return found


def _check(path: Path, size: int | None, md5: str) -> str | None:
    """None when the file matches, else what differs."""
    actual_size = path.stat().st_size
    if size is not None and actual_size != size:
        return f"{actual_size:,} bytes, expected {size:,}"
    actual = md5_file(path)
    return None if actual == md5 else f"md5 {actual}, expected {md5}"


_LOOKS_LIKE_INPUT = re.compile(r"^(part-\d{5}-of-\d{5}|eval\.txt|vocab\.txt|bert_config\.json|model\.ckpt-.*)$")


def check_inputs(paths: list[Path], table: dict[str, tuple[int | None, str]], required: tuple[str, ...] = REQUIRED,
                 ) -> Report:
    """Checks every file under `paths` that the table names; lists the rest and what is missing.

    A required input counts as present only when a file of that name matches. Files of the
    TF2 checkpoint (same names, other md5) are listed as not checked, not as wrong.
    """
    report, checked = Report([], [], [], []), set()
    for path in _files(paths):
        if path.name not in table:
            if _LOOKS_LIKE_INPUT.match(path.name):
                report.unchecked.append(str(path))
            continue
        log.info("check-inputs: %s", path)
        problem = _check(path, *table[path.name])
        if problem is None:
            report.good.append(str(path))
        elif TF2_CHECKPOINT.get(md5_file(path)) == path.name:
            report.unchecked.append(f"{path} (the TF2 checkpoint's file; the TF1 checkpoint is the one used)")
            continue
        else:
            report.bad.append(f"{path}: {problem}; download it again")
        checked.add(path.name)
    report.missing = [name for name in required if name not in checked]
    return report
