"""The bring-up carries what it needs: every import of the repository's code that tools/bring_up.sh and its
GPU tests reach is in the GPU machine's image (tools/device_image.txt) or a wheel `make carry` brings (the
Makefile's CARRY_WHEELS). The first GPU run stopped on `import crc32c`, which was neither.

The entries are found by following bring_up.sh's commands (the scripts and modules it and the shell
scripts it starts run, the GPU test files it picks and the scripts those start), and imported in a
process of their own where every other third-party package is missing for the repository's code
(tests/harness/workers/image_imports.py). Nothing is downloaded.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

from tests.harness.commands import run_cli
from tests.harness.paths import REPO

# Needed only behind a flag or a step the bring-up does not take; each is checked where it is used
# (runtime/optional.py) or has the step that needs it say so.
OPTIONAL = {
    "apex": "--optimizer_impl apex (NVIDIA's container)",
    "flash_attn": "--attention_backend varlen takes PyTorch's own kernel without it",
    "nvidia": "--input_pipeline dali; bring_up.sh leaves tests/trainer/input/test_dali_input.py out without DALI",
    "tensorflow": "data_prep convert-checkpoint of a TensorFlow checkpoint",
}
SCRIPT = re.compile(r"(?:\$\{?\w+\}?/)?([\w./-]+\.py)\b")  # "$here/pytorch/run_pretraining.py": the path
QUOTED_SCRIPT = re.compile(r"[\"']([\w./-]+\.py)[\"']")  # a test starts it: run_cli([python, "data_prep/prepare.py"])
SHELL_SCRIPT = re.compile(r"(?:\$\{?\w+\}?/)?([\w./-]+\.sh)\b")
MODULE = re.compile(r"-m\s+(mlperf_bert[\w.]*)|^\s*(?:from|import)\s+(mlperf_bert[\w.]*)", re.M)
HARNESS = re.compile(r"tests\.harness\.[\w.]+")  # a harness module a test imports or starts
GPU_TESTS = re.compile(r"mark\.gpu")  # the GPU test files, picked as bring_up.sh picks them


def image_packages() -> set[str]:
    lines = (REPO / "tools" / "device_image.txt").read_text().splitlines()
    return {line.split("#")[0].strip() for line in lines} - {""}


def carried_packages() -> set[str]:
    """The import names of the Makefile's CARRY_WHEELS (a wheel's name with '-' as '_')."""
    found = re.search(r"^CARRY_WHEELS \?= (.*)$", (REPO / "Makefile").read_text(), re.M)
    assert found, "the Makefile sets no CARRY_WHEELS"
    return {re.split(r"[=<>~!]", wheel)[0].lower().replace("-", "_") for wheel in found.group(1).split()}


def _repo_file(name: str, folder: Path) -> str | None:
    for place in (REPO / name.lstrip("/"), folder / name):
        if place.is_file() and place.resolve().is_relative_to(REPO):
            return str(place.resolve().relative_to(REPO))
    return None


def _named(path: Path) -> tuple[set[str], set[str]]:
    """The Python entries (repository scripts, mlperf_bert modules) and shell scripts `path` names: in a
    Python file the scripts it starts, as quoted paths."""
    text = path.read_text()
    pattern = QUOTED_SCRIPT if path.suffix == ".py" else SCRIPT
    scripts = {found for name in pattern.findall(text)
               if not Path(name).name.startswith("test_") and (found := _repo_file(name, path.parent))}
    modules = {name for match in MODULE.findall(text) for name in match if name}
    shells = {found for name in SHELL_SCRIPT.findall(text) if (found := _repo_file(name, path.parent))}
    return scripts | modules, shells


def bring_up_entries() -> set[str]:
    """What tools/bring_up.sh runs: followed through the shell scripts it starts and its GPU test files."""
    entries: set[str] = set()
    todo, seen = ["tools/bring_up.sh"], set()
    while todo:
        shell = todo.pop()
        seen.add(shell)
        named, shells = _named(REPO / shell)
        entries |= named
        todo += sorted(shells - seen)
    gpu_tests = {str(p.relative_to(REPO)) for p in REPO.glob("tests/**/test_*.py") if GPU_TESTS.search(p.read_text())}
    harness = _harness_modules(gpu_tests | {"tests/conftest.py"})
    for test in gpu_tests | {f"{module.replace('.', '/')}.py" for module in harness} | {"tests/conftest.py"}:
        entries |= _named(REPO / test)[0]
    return entries | gpu_tests | harness


def _harness_modules(files: set[str]) -> set[str]:
    """The harness modules `files` import or start (`python -m tests.harness.workers...`), and theirs in turn."""
    found: set[str] = set()
    todo = sorted(files)
    while todo:
        tree = ast.parse((REPO / todo.pop()).read_text())
        named = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                 and isinstance(node.value, str)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                named |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        for module in {name for name in named if HARNESS.fullmatch(name)} - found:
            if (REPO / f"{module.replace('.', '/')}.py").is_file():  # a module, not a package or a name in one
                found.add(module)
                todo.append(f"{module.replace('.', '/')}.py")
    return found


def _problems(tmp_path: Path, entries: set[str], allowed: set[str]) -> list[str]:
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"repo": str(REPO), "allowed": sorted(allowed), "optional": sorted(OPTIONAL),
                                   "entries": sorted(entries)}))
    paths = [REPO / "pytorch", REPO, *(REPO / folder for folder in ("tools", "benchmarks"))]
    # bring_up.sh's PYTHONPATH and pytest's pythonpath (pyproject); no user site-packages.
    done = run_cli([sys.executable, "-s", "-m", "tests.harness.workers.image_imports", str(request)],
                   env={"PYTHONPATH": ":".join(map(str, paths))}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_bring_up_entries_are_followed_from_its_commands() -> None:
    entries = bring_up_entries()
    assert {"tools/numerics_check.py", "benchmarks/throughput.py", "tools/plan.py", "pytorch/run_pretraining.py",
            "mlperf_bert.dryrun", "mlperf_bert.model.fp8", "data_prep/prepare.py", "data_prep/make_demo_data.py",
            "tests/trainer/train/test_fast_training.py", "tests.harness.workers.instrumented_trainer"} <= entries, sorted(entries)


def test_bring_up_imports_only_the_image_and_the_carried_wheels(tmp_path: Path) -> None:
    assert _problems(tmp_path, bring_up_entries(), image_packages() | carried_packages()) == []


def test_an_import_in_neither_is_named_with_its_line(tmp_path: Path) -> None:
    """The first GPU run's failure, made again: crc32c without its wheel. prepare.py imports it only in its
    import-tfrecord step now, so the module imports; the import inside the function is still named."""
    problems = _problems(tmp_path, {"data_prep/prepare.py"}, image_packages() | carried_packages() - {"crc32c"})
    assert problems and not any("ModuleNotFoundError" in p for p in problems), problems
    assert any(re.fullmatch(r"data_prep/tfrecords\.py:\d+ imports crc32c: not in .*", p) for p in problems), problems
