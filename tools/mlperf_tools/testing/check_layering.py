"""Checks that imports flow one way: inside each package, and between the packages, the tools and the
benchmarks. No circles, no import up the layers.

    python tools/check_layering.py                 the whole repository
    python tools/check_layering.py PACKAGE_DIR     one package (e.g. a copy of pytorch/mlperf_bert)

Inside a package (`mlperf_bert`, `mlperf_tools`, `data_prep`) the rules are the package's own: each
subpackage's `__init__.py` docstring has a line `May import: a/, b/` (or `nothing`; `the spine`
lets a subpackage import the top-level modules). The top-level modules are the spine and may
import anything. Every import is read with `ast`, the ones inside functions (lazy imports) too,
and checked for:
- an import of a subpackage that its `May import` line does not name,
- an import of the spine from below it,
- a circle between files, or between subpackages.

Between the parts of the repository the rules are `PARTS` below: the trainer imports none of the
others; the data preparation imports the trainer's data format; the tools' package imports both;
an entry point in `tools/` imports only the tools' package (it is a few lines that call a `main`
there); a benchmark imports the packages and other benchmarks, without circles; nothing imports an
entry point or a benchmark from outside benchmarks/. The tests are the package `tests`: its machinery
(tests/harness) imports the three packages and itself, never a test; a test module (or a conftest.py)
imports the packages, the benchmarks and the machinery, never another test. Each problem is one line
naming both files and the rule. Exit 0 when there is none, 1 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

SPINE = "the spine"
_MAY_IMPORT = re.compile(r"^May import:(?P<rule>.*?)(?:\n\s*\n|\Z)", re.M | re.S)  # up to a blank line


@dataclass(frozen=True)
class Module:
    name: str  # dotted, without the package: "train.step", "main", "" for the package itself
    path: Path

    @property
    def group(self) -> str:
        """The subpackage that holds it, or SPINE for a top-level module."""
        return self.name.split(".")[0] if "." in self.name or self._is_package_init else SPINE

    @property
    def _is_package_init(self) -> bool:
        return self.path.name == "__init__.py" and self.name != ""


def modules(root: Path) -> dict[str, Module]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = Module(".".join(parts), path)
    return found


def _resolve(module: Module, node: ast.ImportFrom, package: str) -> str | None:
    """The dotted module (without the package) a `from ... import` names, or None if outside."""
    if node.level == 0:
        if node.module is None or not (node.module == package or node.module.startswith(package + ".")):
            return None
        return node.module[len(package) + 1:]
    here = module.name.split(".") if module.path.name == "__init__.py" else module.name.split(".")[:-1]
    here = [p for p in here if p]
    if node.level - 1 > len(here):
        return None
    base = here[: len(here) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: Module, known: dict[str, Module], package: str) -> set[str]:
    """The package's modules that `module` imports, at the top or lazily, by dotted name."""
    tree = ast.parse(module.path.read_text(), filename=str(module.path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == package or alias.name.startswith(package + "."):
                    found.add(alias.name[len(package) + 1:])
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node, package)
            if target is None:
                continue
            # `from x import name`: name is a module when x.name is one, else an attribute of x
            named = [f"{target}.{a.name}".lstrip(".") for a in node.names]
            submodules = [n for n in named if n in known]
            found.update(submodules if submodules else [target])
    found.discard(module.name)
    return {name for name in found if name in known}


def declared_rules(root: Path) -> dict[str, set[str]]:
    """Subpackage -> the groups it may import, from each `__init__.py` docstring."""
    rules: dict[str, set[str]] = {}
    for init in sorted(root.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        match = _MAY_IMPORT.search(doc)
        if match is None:
            raise SystemExit(f"{init}: its docstring has no 'May import:' line; add one naming the "
                             "subpackages it may import (or 'nothing')")
        rule = " ".join(match.group("rule").split())
        allowed = set(re.findall(r"(\w+)/", rule))
        if SPINE in rule:
            allowed.add(SPINE)
        rules[init.parent.name] = allowed
    return rules


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def problems(root: Path) -> list[str]:
    """Every broken rule under `root` (a copy of the package works too), one line each."""
    known = modules(root)
    rules = declared_rules(root)
    graph = {name: imports(module, known, root.name) for name, module in known.items()}
    found: list[str] = []
    for name, targets in sorted(graph.items()):
        source = known[name]
        for target in sorted(targets):
            line = _rule_broken(source, known[target], rules, root)
            if line:
                found.append(line)
    for cycle in _cycles(graph):
        files = " -> ".join(_rel(known[n].path, root) for n in cycle)
        found.append(f"import circle between files: {files} (rule: no module imports itself through others)")
    groups: dict[str, set[str]] = {}
    for name, targets in graph.items():
        groups.setdefault(known[name].group, set()).update(known[t].group for t in targets)
    for group, targets in groups.items():
        targets.discard(group)
    for cycle in _cycles(groups):
        found.append(f"import circle between subpackages: {', '.join(cycle)} "
                     "(rule: the subpackages form layers; one of these imports must go)")
    return found


def _rel(path: Path, root: Path) -> str:
    return str(Path(root.name) / path.relative_to(root))


def _rule_broken(source: Module, target: Module, rules: dict[str, set[str]], root: Path) -> str | None:
    src_group, dst_group = source.group, target.group
    if src_group == SPINE or src_group == dst_group:
        return None
    allowed = rules.get(src_group, set())
    if dst_group in allowed:
        return None
    where = f"{_rel(source.path, root)} imports {_rel(target.path, root)}"
    if dst_group == SPINE:
        return f"{where}: rule: nothing below the spine imports the spine ({src_group}/ may import " \
               f"{_describe(allowed)})"
    return f"{where}: rule: {src_group}/ may import {_describe(allowed)}, not {dst_group}/ " \
           f"(see {_rel(root / src_group / '__init__.py', root)})"


def _describe(allowed: set[str]) -> str:
    if not allowed:
        return "nothing"
    return ", ".join(sorted(g if g == SPINE else f"{g}/" for g in allowed))


# ---------------------------------------------------------------------------------------------
# Between the parts of the repository

REPO = Path(__file__).resolve().parents[3]  # tools/mlperf_tools/testing/check_layering.py
PACKAGES = {"mlperf_bert": "pytorch/mlperf_bert", "data_prep": "data_prep", "mlperf_tools": "tools/mlperf_tools"}
TESTS, HARNESS = "tests", "test machinery"  # the package `tests`: its test modules, and tests/harness


@dataclass(frozen=True)
class Part:
    files: str  # glob under the repository
    may_import: frozenset[str]  # the parts it may import


def _part(files: str, *may_import: str) -> Part:
    return Part(files, frozenset(may_import))


PARTS: dict[str, Part] = {
    "mlperf_bert": _part("pytorch/mlperf_bert/**/*.py"),  # the trainer: everything else builds on it
    "data_prep": _part("data_prep/**/*.py", "mlperf_bert"),  # the shard format and checks are the trainer's
    "mlperf_tools": _part("tools/mlperf_tools/**/*.py", "mlperf_bert", "data_prep"),
    "tools": _part("tools/*.py", "mlperf_tools"),  # entry points: a few lines calling mlperf_tools
    "trainer entry points": _part("pytorch/*.py", "mlperf_bert"),
    "benchmarks": _part("benchmarks/*.py", "mlperf_bert", "data_prep", "mlperf_tools", "benchmarks"),
    # The first part whose files match owns a file: the machinery before the tests around it.
    HARNESS: _part("tests/harness/**/*.py", "mlperf_bert", "data_prep", "mlperf_tools", HARNESS),
    TESTS: _part("tests/**/*.py", "mlperf_bert", "data_prep", "mlperf_tools", "benchmarks", HARNESS),
}


def _owners(repo: Path) -> dict[Path, str]:
    """Each file of the repository's parts -> its part."""
    owners: dict[Path, str] = {}
    for name, part in PARTS.items():
        for path in sorted(repo.glob(part.files)):
            owners.setdefault(path, name)
    return owners


def _scripts(owners: dict[Path, str]) -> dict[str, Path]:
    """Top-level import name -> file, for the files imported as plain modules (not packages, not the tests)."""
    return {path.stem: path for path, part in owners.items() if part not in PACKAGES and part not in (TESTS, HARNESS)}


def _is_module(name: str, repo: Path) -> bool:
    path = repo.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path, repo: Path) -> set[str]:
    """The modules a file imports, at the top or lazily, by dotted name: `from a import b` names a.b where that
    is a module of the repository, else a; a relative import is resolved against the file's folder."""
    tree = ast.parse(path.read_text(), filename=str(path))
    folder = list(path.parent.relative_to(repo).parts)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(folder[: len(folder) - node.level + 1] + ([base] if base else []))
            named = [f"{base}.{alias.name}" for alias in node.names]
            found.update([name for name in named if _is_module(name, repo)] or [base])
    return found


def _target(name: str, scripts: dict[str, Path], owners: dict[Path, str], repo: Path) -> tuple[str, str] | None:
    """The part a module of `name` belongs to and its file, or None for the standard library or a dependency."""
    top = name.split(".")[0]
    if top in PACKAGES:
        return top, f"{PACKAGES[top]}/"
    if top == "tests":
        path = repo.joinpath(*name.split("."))
        shown = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
        return HARNESS if name.startswith("tests.harness") else TESTS, str(shown.relative_to(repo))
    if top in scripts:
        return owners[scripts[top]], str(scripts[top].relative_to(repo))
    return None


def part_problems(repo: Path = REPO) -> list[str]:
    """Every import between parts that PARTS does not allow, and every circle between the files of a part that
    imports itself (the benchmarks, the test machinery)."""
    owners = _owners(repo)
    scripts = _scripts(owners)
    found: list[str] = []
    graph: dict[str, set[str]] = {}  # file -> file, inside a part that may import itself
    for path, source in sorted(owners.items()):
        for name in sorted(_imports(path, repo)):
            resolved = _target(name, scripts, owners, repo)
            if resolved is None:
                continue  # the standard library or a dependency
            target, target_file = resolved
            if target == source and target in PACKAGES:
                continue  # inside a package: its own May-import rules
            if target == source and target in PARTS[source].may_import:
                graph.setdefault(str(path.relative_to(repo)), set()).add(target_file)
            if target not in PARTS[source].may_import:
                allowed = ", ".join(sorted(PARTS[source].may_import)) or "nothing else"
                found.append(f"{path.relative_to(repo)} imports {target_file}: rule: {source} may import "
                             f"{allowed}, not {target} (PARTS in tools/mlperf_tools/testing/check_layering.py)")
    for cycle in _cycles(graph):
        found.append(f"import circle between files: {' -> '.join(cycle)} (rule: no module imports itself through "
                     "others)")
    return found


def repository_problems(repo: Path = REPO) -> tuple[list[str], int]:
    """Every broken rule in the repository: each package's own, then the parts'; and the files read."""
    found: list[str] = []
    for folder in PACKAGES.values():
        found += problems(repo / folder)
    found += part_problems(repo)
    return found, len(_owners(repo))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package_dir", nargs="?", type=Path,
                        help="check one package (a folder with __init__.py); default: the whole repository")
    args = parser.parse_args(argv)
    if args.package_dir is not None:
        root = args.package_dir
        if not (root / "__init__.py").is_file():
            parser.error(f"{root} is not a package folder (no __init__.py); name one such as pytorch/mlperf_bert")
        found, summary = problems(root), f"{root}: {len(modules(root))} modules"
    else:
        found, count = repository_problems()
        summary = f"{count} files in {len(PACKAGES)} packages, the tools' entry points, the benchmarks and the tests"
    for line in found:
        print(line)
    if not found:
        print(f"{summary}: imports layered, no circles")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
