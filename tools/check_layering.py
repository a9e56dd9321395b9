"""Checks that the imports of `mlperf_bert` flow one way: no circles, no import up the layers.

    python tools/check_layering.py [PACKAGE_DIR]     (default: pytorch/mlperf_bert)

The rules are the package's own: each subpackage's `__init__.py` docstring has a line
`May import: a/, b/` (or `nothing`; `the spine` lets a subpackage import the top-level
modules). The top-level modules are the spine and may import anything. Every import is read
with `ast`, the ones inside functions (lazy imports) too, and checked for:
- an import of a subpackage that its `May import` line does not name,
- an import of the spine from below it,
- a circle between files, or between subpackages.
Each problem is one line naming both files and the rule. Exit 0 when there is none, 1 otherwise.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "mlperf_bert"
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


def _resolve(module: Module, node: ast.ImportFrom) -> str | None:
    """The dotted module (without the package) a `from ... import` names, or None if outside."""
    if node.level == 0:
        if node.module is None or not (node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
            return None
        return node.module[len(PACKAGE) + 1:]
    here = module.name.split(".") if module.path.name == "__init__.py" else module.name.split(".")[:-1]
    here = [p for p in here if p]
    if node.level - 1 > len(here):
        return None
    base = here[: len(here) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: Module, known: dict[str, Module]) -> set[str]:
    """The package's modules that `module` imports, at the top or lazily, by dotted name."""
    tree = ast.parse(module.path.read_text(), filename=str(module.path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    found.add(alias.name[len(PACKAGE) + 1:])
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
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
    graph = {name: imports(module, known) for name, module in known.items()}
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


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "pytorch" / PACKAGE
    found = problems(root)
    for line in found:
        print(line)
    if not found:
        print(f"{root}: {len(modules(root))} modules, imports layered, no circles")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
