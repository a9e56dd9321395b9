"""Optional packages (torchao, flash-attn, apex, NVIDIA DALI, mpi4py): missing, or installed but broken in
any of the ways a broken install fails, each flag that needs one stops at start-up with one line that names
the flag, the package, the error and the fix (exit 2, nothing written), and never quietly runs without it.

Broken packages are fakes written into a folder put first on the path: an `__init__.py` that fails the
way real broken installs do (an undefined symbol, torchao's AttributeError on a torch without its dtype
(pytorch/ao#1613), a missing libmpi, a CUDA check, a dependency of its own gone).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mlperf_bert.model import attention
from mlperf_bert.model.attention import AttentionNeeds, backend_problem
from mlperf_bert.optim.optimizers import apex_problem
from mlperf_bert.runtime.optional import DependencyError, dependency_problem, optional_import
from tests.harness.broken_packages import BREAKAGES, write_package
from tests.harness.commands import run_cli
from tests.harness.demo import trainer_args
from tests.harness.paths import REPO

TRAINER = REPO / "pytorch" / "run_pretraining.py"


def problem_of(module: str, root: str | None = None) -> str | None:
    return dependency_problem(module, "the package", "--the_flag x", "pip install the-package", "use --the_flag y",
                              root)


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_an_installed_package_that_fails_to_import_is_one_line_naming_the_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, breakage: str) -> None:
    monkeypatch.syspath_prepend(str(write_package(tmp_path, f"broken_{breakage.lower()}", BREAKAGES[breakage])))
    problem = problem_of(f"broken_{breakage.lower()}")
    assert problem is not None and "\n" not in problem
    assert problem.startswith(f"--the_flag x needs the package, which is installed but fails to import ({breakage}: ")
    assert problem.endswith("reinstall it (pip install the-package), or use --the_flag y")
    with pytest.raises(DependencyError, match=breakage):
        optional_import(f"broken_{breakage.lower()}", "the package", "--the_flag x", "pip install the-package",
                        "use --the_flag y")


def test_a_missing_package_a_broken_one_and_a_working_one_are_told_apart(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    assert problem_of("a_package_nobody_installed") == ("--the_flag x needs the package, which is not installed: "
                                                        "pip install the-package, or use --the_flag y")
    assert problem_of("a_package_nobody_installed.sub") == problem_of("a_package_nobody_installed")
    assert not optional_import("a_package_nobody_installed", "p", "f", "i", "a")  # absent: the caller goes without
    monkeypatch.syspath_prepend(str(write_package(tmp_path, "half", "")))
    assert "installed but fails to import (ModuleNotFoundError: No module named 'half.sub')" in problem_of("half.sub")
    # a namespace folder shared with other packages (nvidia/ for DALI): absent is absent
    write_package(tmp_path, "shared.other", "")
    assert "which is not installed" in problem_of("shared.mine.fn", root="shared.mine")
    assert problem_of("json") is None and optional_import("json", "p", "f", "i", "a")
    long = "x" * 1000
    monkeypatch.syspath_prepend(str(write_package(tmp_path / "long", "wordy", f"raise ImportError('{long}\\nmore')")))
    wordy = problem_of("wordy") or ""
    assert "x" * 237 + "..." in wordy and "x" * 238 not in wordy and "more" not in wordy


def test_only_the_package_itself_not_found_is_not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module missing inside an installed package is a broken install, whatever its name shares with the
    package's: `hamper` importing `ham` (a prefix of its name, not a parent), `withext` importing its own extension
    `withext._C`, `torchao` importing `torchao.float8` of another release. A package under a namespace folder that
    is not there at all (`nvidia` for `nvidia.dali`) is not installed."""
    # names no other test imports: a package imported once stays in sys.modules, whatever the path says after
    monkeypatch.syspath_prepend(str(write_package(tmp_path / "a", "hamper", "import ham")))
    monkeypatch.syspath_prepend(str(write_package(tmp_path / "b", "withext", "import withext._C")))
    monkeypatch.syspath_prepend(str(write_package(tmp_path / "c", "newer", "")))
    assert "installed but fails to import (ModuleNotFoundError: No module named 'ham')" in (problem_of("hamper") or "")
    assert "installed but fails to import (ModuleNotFoundError: No module named 'withext._C')" in (
        problem_of("withext") or "")
    assert "installed but fails to import (ModuleNotFoundError: No module named 'newer.float8')" in (
        problem_of("newer.float8") or "")
    assert "which is not installed" in (problem_of("no_namespace_here.dali", root="no_namespace_here.dali") or "")
    for module in ("hamper", "withext", "newer.float8"):
        with pytest.raises(DependencyError, match="installed but fails to import"):
            optional_import(module, "p", "f", "i", "a")


def _refused(flags: list[str], broken: Path, tmp_path: Path, env: dict[str, str] | None = None) -> list[str]:
    """The trainer's stderr lines with `broken` first on the path; it must stop at start-up, exit 2."""
    path = f"{broken}:{REPO / 'pytorch'}:{REPO}"
    result = run_cli([sys.executable, str(TRAINER), *flags], env={"PYTHONPATH": path, **(env or {})})
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "out").exists()  # refused before anything was written
    return result.stderr.splitlines()


# Flags a CPU run can give, the package each needs, how a broken copy is faked, and the line's start.
CPU_FLAGS = {
    "torchao": (["--precision", "fp8"], "torchao", BREAKAGES["AttributeError"],
                "error: --precision fp8 needs torchao, which is installed but fails to import (AttributeError: "),
    "dali": (["--input_pipeline", "dali"], "nvidia.dali", BREAKAGES["RuntimeError"],
             "error: --input_pipeline dali needs NVIDIA DALI, which is installed but fails to import (RuntimeError: "),
    "mpi4py": (["--balance", "cpu_exchange"], "mpi4py.MPI", BREAKAGES["OSError"],
               "error: --balance cpu_exchange needs mpi4py, which is installed but fails to import (OSError: "),
}


@pytest.mark.parametrize("name", CPU_FLAGS)
def test_each_flag_with_a_broken_package_stops_the_trainer_at_start_up(demo_data: Path, tmp_path: Path,
                                                                      name: str) -> None:
    flags, module, body, start = CPU_FLAGS[name]
    broken = write_package(tmp_path / "site", module, body)
    mpi_rank = {"PMI_RANK": "0", "PMI_SIZE": "1"}  # as mpiexec starts a rank (cpu_exchange needs one)
    lines = _refused(trainer_args(demo_data, tmp_path / "out", "--do_train", *flags), broken, tmp_path, mpi_rank)
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(start), lines
    assert "reinstall it (pip install" in errors[0]


def test_a_broken_matplotlib_stops_a_run_that_would_draw_curves_at_start_up(demo_data: Path, tmp_path: Path) -> None:
    """The default --curves png draws after run_stop: the run trained to its end, then an ImportError traceback,
    exit 1, and no summary."""
    broken = write_package(tmp_path / "site", "matplotlib", BREAKAGES["ImportError"])
    lines = _refused(trainer_args(demo_data, tmp_path / "out", "--do_train", "--curves", "png"), broken, tmp_path)
    assert [line for line in lines if line.startswith("error:")] == [
        "error: --curves png (the default) needs matplotlib, which is installed but fails to import (ImportError: "
        "/site-packages/pkg/_C.so: undefined symbol: _ZN3c104cuda9SetDeviceEi): that copy does not fit this "
        "environment; reinstall it (pip install 'matplotlib>=3.7' (a dependency of this package)), or use --curves "
        "none (CURVES=none): the run then draws no curves.png"]


def test_torchao_not_installed_names_the_install(demo_data: Path, tmp_path: Path) -> None:
    """A path entry that hides the real torchao (the import machinery finds nothing under that name)."""
    hider = tmp_path / "site"
    hider.mkdir()
    (hider / "sitecustomize.py").write_text("import sys\nsys.modules['torchao'] = None\n")
    lines = _refused(trainer_args(demo_data, tmp_path / "out", "--do_train", "--precision", "fp8"), hider, tmp_path)
    assert [line for line in lines if line.startswith("error:")] == [
        "error: --precision fp8 needs torchao, which is not installed: pip install 'torchao==0.18.*' (the [fp8] "
        f"extra of this package), the release for torch 2.13; each torchao release fits one torch release, and this "
        f"is torch {torch.__version__}, or use --precision bf16"]


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """An Ampere-or-newer GPU as torch.cuda describes it (the GPU-only choices, checked on a CPU machine)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    return torch.device("cuda", 0)


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_a_broken_flash_attn_is_refused_for_varlen_and_for_auto_on_a_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpu: torch.device, breakage: str) -> None:
    monkeypatch.syspath_prepend(str(write_package(tmp_path, "flash_attn", BREAKAGES[breakage])))
    needs = AttentionNeeds(gpu, "bf16", 64, 0.1)
    for requested in ("varlen", "auto"):
        problem = backend_problem(requested, needs)
        assert problem is not None and problem.startswith(
            f"--attention_backend varlen (and auto on a GPU) needs flash-attn, which is installed but fails to "
            f"import ({breakage}: "), problem
    assert backend_problem("sdpa", needs) is None and backend_problem("grouped", needs) is None
    assert backend_problem("auto", AttentionNeeds(torch.device("cpu"), "bf16", 64, 0.1)) is None  # never imported
    with pytest.raises(DependencyError):
        attention.resolve_backend("auto", gpu, 512)  # the same refusal where the model is built


@pytest.mark.parametrize("module", ["apex", "amp_C"])
def test_a_broken_apex_is_refused_where_the_run_would_use_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            module: str) -> None:
    write_package(tmp_path, "apex.optimizers", "")
    write_package(tmp_path, "amp_C", "")
    write_package(tmp_path, module, BREAKAGES["AttributeError"])
    monkeypatch.syspath_prepend(str(tmp_path))
    for implementation in ("auto", "apex"):
        problem = apex_problem(implementation, on_gpu=True, device_steps=False)
        assert problem is not None and "which is installed but fails to import (AttributeError: " in problem, problem
    assert apex_problem("auto", on_gpu=False, device_steps=False) is None  # auto on the CPU never uses apex
    assert apex_problem("auto", on_gpu=True, device_steps=True) is None  # nor under CUDA graphs
    assert apex_problem("foreach", on_gpu=True, device_steps=False) is None
    assert apex_problem("apex", on_gpu=False, device_steps=False) == (
        "--optimizer_impl apex runs apex's CUDA kernels, and this run is on the CPU: use --optimizer_impl foreach "
        "or auto")


def test_apex_without_its_cuda_extension_is_not_installed_for_apex_and_skipped_by_auto(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Python-only apex (no amp_C) is a known install: auto goes without it, apex names the extension."""
    monkeypatch.syspath_prepend(str(write_package(tmp_path, "apex.optimizers", "")))
    assert apex_problem("auto", on_gpu=True, device_steps=False) is None
    problem = apex_problem("apex", on_gpu=True, device_steps=False)
    assert problem is not None and problem.startswith(
        "--optimizer_impl apex needs apex's CUDA extension amp_C, which is not installed: build apex"), problem
