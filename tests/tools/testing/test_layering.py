"""The folder tree is the architecture: imports flow one way, and a wheel ships it all.

`tools/check_layering.py` reads every module's imports (lazy ones too) with `ast`; these tests
run it on the real package and the whole repository (the tools' package, their entry points,
the benchmarks and the tests included), and on copies with a wrong-way import, an import of the
spine, a circle, an entry point that reaches past its package and test machinery that imports a
test added, to show that it names both files and the rule.
"""

from __future__ import annotations

import ast
import os
import re
import runpy
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mlperf_tools.testing import check_layering
from tests.harness.paths import REPO

PACKAGE = REPO / "pytorch" / "mlperf_bert"


def test_the_package_imports_flow_one_way():
    assert check_layering.problems(PACKAGE) == []


def test_the_repository_imports_flow_one_way():
    """The three packages by their own rules, and the parts between them (PARTS): every file of
    tools/, benchmarks/ and tests/ is read."""
    found, files = check_layering.repository_problems(REPO)
    assert found == []
    assert files >= sum(len(list(REPO.glob(files))) for files in ("tools/**/*.py", "benchmarks/*.py", "tests/**/*.py"))


def test_the_parts_rules_form_layers():
    """PARTS itself has no circle: the trainer imports nothing of the others, and nothing imports the
    entry points."""
    graph = {name: set(part.may_import) - {name} for name, part in check_layering.PARTS.items()}
    assert check_layering._cycles(graph) == []
    assert check_layering.PARTS["mlperf_bert"].may_import == frozenset()
    assert check_layering.PARTS["tools"].may_import == {"mlperf_tools"}  # entry points stay thin
    assert not any("tools" in part.may_import for part in check_layering.PARTS.values())
    assert not any(check_layering.TESTS in part.may_import for part in check_layering.PARTS.values())  # nor a test


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_imports_between_parts_are_named_with_the_rule(tmp_path):
    """A repository in miniature: each wrong import between parts is one line with the file and the rule."""
    repo = _tree(tmp_path, {
        "pytorch/mlperf_bert/__init__.py": "",
        "pytorch/mlperf_bert/trainer.py": "def f():\n    from mlperf_tools.results import scoring  # lazy\n",
        "data_prep/__init__.py": "import mlperf_bert\n",
        "tools/mlperf_tools/__init__.py": "import data_prep\n",
        "tools/plan.py": "import mlperf_bert.config\nfrom mlperf_tools.planning import plan\n",
        "tools/compare.py": "from mlperf_tools.results.compare import main\n",
        "benchmarks/a.py": "import b\nimport numpy\n",
        "benchmarks/b.py": "from a import x\nimport compare\n",
        "pytorch/run_pretraining.py": "from mlperf_bert.trainer import f\n",
    })
    rule = "(PARTS in tools/mlperf_tools/testing/check_layering.py)"
    assert check_layering.part_problems(repo) == [
        f"benchmarks/b.py imports tools/compare.py: rule: benchmarks may import benchmarks, data_prep, "
        f"mlperf_bert, mlperf_tools, not tools {rule}",
        f"pytorch/mlperf_bert/trainer.py imports tools/mlperf_tools/: rule: mlperf_bert may import nothing else, "
        f"not mlperf_tools {rule}",
        f"tools/plan.py imports pytorch/mlperf_bert/: rule: tools may import mlperf_tools, not mlperf_bert {rule}",
        "import circle between files: benchmarks/a.py -> benchmarks/b.py "
        "(rule: no module imports itself through others)",
    ]


def test_the_test_machinery_imports_no_test_and_a_test_no_other_test(tmp_path):
    """The package `tests` in miniature: machinery that imports a test, and a test that imports another test or a
    conftest.py, are each one line with the file and the rule; a test importing the machinery is none."""
    repo = _tree(tmp_path, {
        "pytorch/mlperf_bert/__init__.py": "",
        "tests/__init__.py": "",
        "tests/conftest.py": "from tests.harness import served\n",
        "tests/harness/__init__.py": "",
        "tests/harness/served.py": "import mlperf_bert\nfrom tests.harness.ports import free_port\n",
        "tests/harness/ports.py": "def free_port():\n    from tests.model.test_bert import TINY  # lazy\n",
        "tests/model/__init__.py": "",
        "tests/model/test_bert.py": "from mlperf_bert import model\nfrom tests.harness.served import Served\nTINY = 1\n",
        "tests/model/test_fp8.py": "from .test_bert import TINY\nfrom tests import conftest\n",
    })
    rule = "(PARTS in tools/mlperf_tools/testing/check_layering.py)"
    tests_rule = "rule: tests may import benchmarks, data_prep, mlperf_bert, mlperf_tools, test machinery, not tests"
    assert check_layering.part_problems(repo) == [
        "tests/harness/ports.py imports tests/model/test_bert.py: rule: test machinery may import data_prep, "
        f"mlperf_bert, mlperf_tools, test machinery, not tests {rule}",
        f"tests/model/test_fp8.py imports tests/conftest.py: {tests_rule} {rule}",
        f"tests/model/test_fp8.py imports tests/model/test_bert.py: {tests_rule} {rule}",
    ]


def test_tools_readme_lists_every_tool_by_kind():
    """tools/README.md's table names each file of tools/ once, under a kind; a new tool without a row fails."""
    rows = [line.split("|")[1:4] for line in (REPO / "tools" / "README.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| kind")]
    listed = [command.strip().strip("`").rstrip("/") for _, command, _ in rows]
    present = sorted(p.name for p in (REPO / "tools").iterdir()
                     if p.name not in ("README.md", "mlperf_tools", "__pycache__"))
    assert sorted(listed) == present
    assert {kind.strip() for kind, _, _ in rows} == {"results", "planning", "bring-up", "launch", "test system"}


def test_an_entry_point_without_the_project_installed_says_so():
    """`python tools/plan.py` with no site-packages (a fresh machine's python): one line naming the fix."""
    done = subprocess.run([sys.executable, "-S", str(REPO / "tools" / "plan.py"), "--help"], capture_output=True,
                          text=True, cwd=REPO, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "plan.py: " in done.stderr and "install the project first" in done.stderr


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
    done = subprocess.run([sys.executable, str(REPO / "tools" / "check_layering.py"), str(copy)],
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert "mlperf_bert/optim/clipping.py imports mlperf_bert/train/step.py" in done.stdout


def test_data_prep_reads_shards_without_torch():
    """data_prep imports the shard format, the integrity checks and the atomic writes, and
    tools/package_results.py the closed-division rules; none may pull in torch."""
    code = ("import sys; import data_prep.fileio, data_prep.formats, data_prep.verify_dataset, "
            "mlperf_bert.data.shards, mlperf_bert.data.integrity, mlperf_bert.data.lengths, "
            "mlperf_bert.config.closed_division; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@pytest.mark.slow
def test_a_wheel_ships_every_subpackage(tmp_path):
    """A non-editable build holds every module of the source tree and the package data."""
    source = tmp_path / "src"
    source.mkdir()
    shutil.copy(REPO / "pyproject.toml", source)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(REPO / "pytorch", source / "pytorch", ignore=ignore)
    shutil.copytree(REPO / "data_prep", source / "data_prep", ignore=ignore)
    shutil.copytree(REPO / "tools" / "mlperf_tools", source / "tools" / "mlperf_tools", ignore=ignore)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, capture_output=True)
    wheel, = (tmp_path / "dist").glob("mlperf_bert-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {str(p.relative_to(REPO / "pytorch")) for p in PACKAGE.rglob("*.py")}
    expected |= {str(p.relative_to(REPO)) for p in (REPO / "data_prep").rglob("*.py")}
    expected |= {str(p.relative_to(REPO / "tools")) for p in (REPO / "tools" / "mlperf_tools").rglob("*.py")}
    expected |= {"mlperf_bert/data/wikipedia_phase2_seqlen_histogram.json", "mlperf_bert/dryrun/fake_cuda.cpp"}
    assert not expected - shipped, sorted(expected - shipped)
    assert "mlperf_bert/dryrun/run.py" in shipped and "mlperf_bert/train/step.py" in shipped


ENTRY_POINTS = sorted((REPO / "tools").glob("*.py"))


@pytest.mark.parametrize("script", ENTRY_POINTS, ids=lambda p: p.name)
def test_each_entry_point_reaches_its_main(script: Path, monkeypatch, capsys):
    """`python tools/<name>.py --help` as a user types it (run in this process: seconds for all of them)."""
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(script), run_name="__main__")
    assert stopped.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out


def test_every_tool_the_documents_name_is_there():
    """Each `tools/<name>.py` or `.sh` that README.md and docs/ name exists at that path."""
    named = {match for doc in [REPO / "README.md", *(REPO / "docs").glob("*.md"), REPO / "Makefile"]
             for match in re.findall(r"(?<![\w/])tools/[\w/]+\.(?:py|sh)\b", doc.read_text())}  # not tests/tools/
    assert len(named) >= 12
    assert sorted(name for name in named if not (REPO / name).is_file()) == []


@pytest.mark.parametrize("broken", ["mlperf_bert.model.gone", "numpy.core._multiarray_umath"])
def test_an_import_failing_inside_an_installed_package_is_not_blamed_on_the_install(tmp_path, broken):
    """`python tools/plan.py` where the project is installed but one of its modules imports a module that is not
    there (a file left out of a checkout; a package's own extension gone): the traceback of that import, not "install
    the project first", which would send the user to reinstall a project that is installed."""
    package = broken.split(".")[0]
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text(f"import {broken}\n")
    done = subprocess.run([sys.executable, str(REPO / "tools" / "plan.py"), "--help"], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 1 and "install the project first" not in done.stderr, done.stderr
    assert re.search(rf"ModuleNotFoundError: No module named '{package}\.[\w.]+'\n$", done.stderr), done.stderr


def test_a_folder_that_is_no_package_is_refused(tmp_path):
    """A mistyped path once passed as '0 modules: imports layered': a check that read nothing is no pass."""
    done = subprocess.run([sys.executable, str(REPO / "tools" / "check_layering.py"), str(tmp_path / "mlperf_bertt")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "is not a package folder (no __init__.py)" in done.stderr, done.stderr
