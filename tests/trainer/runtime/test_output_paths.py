"""Files a command writes at the end of its work: the folder above is made, or the path refused, before the work
(`mlperf_bert.runtime.files.output_file`); a check that runs for minutes must not end in FileNotFoundError with
its result lost. Folders given as --out are made by the command itself (compare.py, replay_run.py)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from mlperf_bert.runtime.files import output_file, output_file_problem
from tests.harness.paths import REPO

# Every command-line flag that names a file the command writes after its work, in every entry point: the
# trainer's package, the tools' package, the data preparation and the benchmarks.
SOURCES = sorted([*REPO.glob("pytorch/mlperf_bert/**/*.py"), *REPO.glob("tools/mlperf_tools/**/*.py"),
                  *REPO.glob("data_prep/*.py"), *REPO.glob("benchmarks/*.py")])
OUTPUT_FLAGS = ("--json", "--report", "--plot", "--cost_json")


def test_missing_folders_are_made(tmp_path):
    path = tmp_path / "reports" / "week 48" / "n.json"
    assert output_file(str(path)) == path and path.parent.is_dir() and not path.exists()


@pytest.mark.parametrize(("where", "says"), [("a_folder", "{path} is a folder; give the path of a file"),
                                            ("a_file/n.json", "cannot make its folder {parent} (")])
def test_a_path_it_cannot_write_is_named(tmp_path, where, says):
    (tmp_path / "a_folder").mkdir()
    (tmp_path / "a_file").write_text("")
    path = tmp_path / where
    assert output_file_problem(path).startswith(says.format(path=path, parent=path.parent))
    with pytest.raises(argparse.ArgumentTypeError):
        output_file(str(path))


def test_every_output_file_flag_is_checked_before_the_work():
    """A flag in OUTPUT_FLAGS parsed as a bare Path was written only at the end (numerics_check.py --json: after
    the whole check)."""
    unchecked = []
    for source in SOURCES:
        text = source.read_text()
        for match in re.finditer(r"add_argument\(\s*\"(--[a-z_]+)\"[^)]*?type=(\w+)", text):
            if match.group(1) in OUTPUT_FLAGS and match.group(2) != "output_file":
                unchecked.append(f"{source.relative_to(REPO)}: {match.group(1)} type={match.group(2)}")
    assert not unchecked

