"""The bring-up's imports as the GPU machine sees them: what the repository's own code imports from outside
the standard library must be in the allowed set (the GPU image's packages and the carried wheels).

    python -s -m tests.harness.workers.image_imports REQUEST.json

REQUEST: {"repo": folder, "allowed": [names], "optional": [names], "entries": [script paths or module names]}.
Each entry is imported here (a script without running its main), with every other third-party package
missing for the repository's code, as on that machine. Then every module the entries can reach through the
repository's own imports, at module level or inside functions, is read for the third-party packages it
imports: each must be allowed, optional (a flag the bring-up does not pass needs it), or imported where an
ImportError is caught (TYPE_CHECKING blocks too). Prints a JSON list of problems, one line each.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import json
import runpy
import sys
from pathlib import Path
from types import FrameType
from typing import Any, Iterator

MISSING = "not in the GPU image's packages (tools/device_image.txt) nor carried (Makefile CARRY_WHEELS)"


class Blocker:
    """Third-party packages outside `allowed` are missing for code under `repo` (what others import is theirs)."""

    def __init__(self, repo: Path, allowed: set[str]) -> None:
        self.repo, self.allowed = repo, allowed
        self.environment = Path(sys.prefix).resolve()  # `make test`'s .venv lies inside the repository
        self.local: dict[str, bool] = {}
        self.ours: dict[str, bool] = {}  # a file -> the repository's own

    def is_ours(self, path: str) -> bool:
        if path not in self.ours:
            place = Path(path).resolve()
            self.ours[path] = place.is_relative_to(self.repo) and not place.is_relative_to(self.environment) \
                and "site-packages" not in place.parts
        return self.ours[path]

    def is_local(self, top: str) -> bool:
        """Whether the top-level module `top` is the repository's own (mlperf_bert, data_prep, tests, plan)."""
        if top not in self.local:
            spec = importlib.util.find_spec(top)
            places = [] if spec is None else [spec.origin or "", *(spec.submodule_search_locations or [])]
            self.local[top] = any(self.is_ours(place) for place in places if place)
        return self.local[top]

    def refused(self, name: str, importer: str | None) -> str | None:
        top = name.split(".")[0]
        if importer is None or not self.is_ours(importer):
            return None
        if top in sys.stdlib_module_names or top in self.allowed or self.is_local(top):
            return None
        return top

    def install(self) -> None:
        real_import, real_import_module = builtins.__import__, importlib.import_module

        def guarded_import(name: str, globals: dict | None = None, locals: Any = None, fromlist: Any = (),
                           level: int = 0) -> Any:
            top = self.refused(name, (globals or {}).get("__file__")) if level == 0 else None
            if top is not None:
                raise ModuleNotFoundError(f"No module named {top!r} ({MISSING})", name=top)
            return real_import(name, globals, locals, fromlist, level)

        def guarded_import_module(name: str, package: str | None = None) -> Any:
            caller: FrameType | None = sys._getframe(1)
            top = self.refused(name, caller.f_globals.get("__file__") if caller else None) \
                if not name.startswith(".") else None
            if top is not None:
                raise ModuleNotFoundError(f"No module named {top!r} ({MISSING})", name=top)
            return real_import_module(name, package)

        builtins.__import__ = guarded_import
        importlib.import_module = guarded_import_module  # type: ignore[assignment]


def import_entry(entry: str, repo: Path) -> None:
    if entry.endswith(".py"):
        runpy.run_path(str(repo / entry), run_name="__bring_up_imports__")  # its main does not run
    else:
        importlib.import_module(entry)


def _guarded_lines(tree: ast.AST) -> list[range]:
    """The lines where an ImportError is caught (a `try` whose handler takes it) or no import runs
    (`if TYPE_CHECKING:`)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            caught = " ".join(ast.unparse(h.type) if h.type else "BaseException" for h in node.handlers)
            if not any(name in caught for name in ("ImportError", "ModuleNotFoundError", "Exception")):
                continue
        elif not (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):
            continue
        lines.append(range(node.body[0].lineno, (node.body[-1].end_lineno or node.body[-1].lineno) + 1))
    return lines


def imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement under `tree`, and whether an ImportError around it is caught."""
    guarded = _guarded_lines(tree)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, any(node.lineno in lines for lines in guarded)


def module_names(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """What a statement may import, relative names resolved against `package`: `from a import b` may import
    the module a.b."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level else node.module
    return [base or ""] + [f"{base}.{alias.name}" for alias in node.names]


def reachable_problems(files: dict[Path, str], blocker: Blocker, optional: set[str]) -> list[str]:
    """Reads `files` (path -> package) and every repository module their imports reach."""
    problems: set[str] = set()
    todo, seen = list(files.items()), set(files)
    while todo:
        path, package = todo.pop()
        for node, guarded in imports(ast.parse(path.read_text(), str(path))):
            for name in module_names(node, package):
                top = name.split(".")[0]
                if not top or top in sys.stdlib_module_names:
                    continue
                if blocker.is_local(top):
                    todo += _new_local(name, seen)
                elif not (guarded or top in blocker.allowed or top in optional):
                    problems.add(f"{path.relative_to(blocker.repo)}:{node.lineno} imports {top}: {MISSING}")
    return sorted(problems)


def _new_local(name: str, seen: set[Path]) -> list[tuple[Path, str]]:
    """The repository module `name` (a name imported from a module is not one) when not yet read."""
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return []
    if spec is None or spec.origin is None or not spec.origin.endswith(".py") or Path(spec.origin) in seen:
        return []
    seen.add(Path(spec.origin))
    is_package = spec.submodule_search_locations is not None
    return [(Path(spec.origin), name if is_package else name.rpartition(".")[0])]


def entry_files(entries: list[str], repo: Path) -> dict[Path, str]:
    files: dict[Path, str] = {}
    for entry in entries:
        if entry.endswith(".py"):
            files[repo / entry] = ""
        else:
            files.update(_new_local(entry, set()))
    return files


def run(request: dict[str, Any]) -> list[str]:
    repo = Path(request["repo"]).resolve()
    blocker = Blocker(repo, set(request["allowed"]))
    blocker.install()
    problems = []
    for entry in request["entries"]:
        try:
            import_entry(entry, repo)
        except Exception as err:  # any failure to import is the finding, named with its entry
            problems.append(f"{entry}: {type(err).__name__}: {err}")
    return problems + reachable_problems(entry_files(request["entries"], repo), blocker, set(request["optional"]))


if __name__ == "__main__":
    print(json.dumps(run(json.loads(Path(sys.argv[1]).read_text()))))
