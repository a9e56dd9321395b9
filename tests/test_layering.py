"""The package's folder tree is its architecture: imports flow one way, and a wheel ships it all.

`tools/check_layering.py` reads every module's imports (lazy ones too) with `ast`; these tests
run it on the real package, and on copies with a wrong-way import, an import of the spine
and a circle added, to show that it names both files and the rule.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import check_layering

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pytorch" / "mlperf_bert"


def test_the_package_imports_flow_one_way():
    assert check_layering.problems(PACKAGE) == []


def test_the_tree_has_subpackages_and_a_small_spine():
    subpackages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    spine = sorted(p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len([s for s in subpackages if s != "dryrun"]) >= 5, subpackages
    assert len(spine) <= 6, spine
    rules = check_layering.declared_rules(PACKAGE)
    assert set(rules) == set(subpackages)  # every subpackage declares what it may import
    assert rules["runtime"] == set() and "hooks" not in rules["train"] and "input" not in rules["train"]


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / "mlperf_bert"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _add_lazy_import(path: Path, statement: str) -> None:
    """Appends a function whose body imports: a lazy import, as a refactor might leave one."""
    text = path.read_text()
    path.write_text(text + f"\n\ndef _added_for_the_test():\n    {statement}\n")
    ast.parse(path.read_text())


def test_a_wrong_way_import_is_named_with_both_files_and_the_rule(tmp_path):
    copy = _copy(tmp_path)
    _add_lazy_import(copy / "data" / "batch.py", "from ..hooks.events import Hook  # noqa")
    found = check_layering.problems(copy)
    assert found[0].startswith("mlperf_bert/data/batch.py imports mlperf_bert/hooks/events.py: ")
    assert "data/ may import runtime/, not hooks/" in found[0]
    # hooks/ reaches data/ through train/, so the folders now form a circle too
    assert found[1:] == ["import circle between subpackages: data, hooks, input, model, train "
                         "(rule: the subpackages form layers; one of these imports must go)"]


def test_an_import_of_the_spine_from_below_is_refused(tmp_path):
    copy = _copy(tmp_path)
    _add_lazy_import(copy / "train" / "step.py", "from .. import trainer  # noqa")
    found = check_layering.problems(copy)
    assert any(line.startswith("mlperf_bert/train/step.py imports mlperf_bert/trainer.py: rule: nothing below "
                               "the spine imports the spine") for line in found), found


def test_a_circle_between_files_is_named(tmp_path):
    copy = _copy(tmp_path)
    # validate.py imports batch.py; batch.py importing validate.py closes a circle inside data/
    _add_lazy_import(copy / "data" / "batch.py", "from .validate import DataLimits  # noqa")
    found = check_layering.problems(copy)
    assert found == ["import circle between files: mlperf_bert/data/batch.py -> mlperf_bert/data/validate.py "
                     "(rule: no module imports itself through others)"]


def test_the_command_line_fails_on_a_broken_rule(tmp_path):
    copy = _copy(tmp_path)
    _add_lazy_import(copy / "optim" / "clipping.py", "import mlperf_bert.train.step  # noqa")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "check_layering.py"), str(copy)],
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert "mlperf_bert/optim/clipping.py imports mlperf_bert/train/step.py" in done.stdout


def test_data_prep_reads_shards_without_torch():
    """data_prep imports the shard format, the integrity checks and the atomic writes, and
    tools/package_results.py the closed-division rules; none may pull in torch."""
    code = ("import sys; import data_prep.fileio, data_prep.formats, data_prep.verify_dataset, "
            "mlperf_bert.data.shards, mlperf_bert.data.integrity, mlperf_bert.data.lengths, "
            "mlperf_bert.config.closed_division; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.slow
def test_a_wheel_ships_every_subpackage(tmp_path):
    """A non-editable build holds every module of the source tree and the package data."""
    source = tmp_path / "src"
    source.mkdir()
    shutil.copy(ROOT / "pyproject.toml", source)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(ROOT / "pytorch", source / "pytorch", ignore=ignore)
    shutil.copytree(ROOT / "data_prep", source / "data_prep", ignore=ignore)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, capture_output=True)
    wheel, = (tmp_path / "dist").glob("mlperf_bert-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {str(p.relative_to(ROOT / "pytorch")) for p in PACKAGE.rglob("*.py")}
    expected |= {str(p.relative_to(ROOT)) for p in (ROOT / "data_prep").rglob("*.py")}
    expected |= {"mlperf_bert/data/wikipedia_phase2_seqlen_histogram.json", "mlperf_bert/dryrun/fake_cuda.cpp"}
    assert not expected - shipped, sorted(expected - shipped)
    assert "mlperf_bert/dryrun/run.py" in shipped and "mlperf_bert/train/step.py" in shipped
