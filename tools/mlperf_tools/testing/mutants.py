"""Mutation testing: do the targeted tests fail on the bugs a later edit could plant?

    python tools/mutants.py [--module M] [--round N] [--only ID ...] [--list] [--no-baseline] [--timeout S]
                            [--json PATH]

Each mutant (`mlperf_tools/testing/mutant_list.py`) is one realistic bug in one module: an exact snippet of the
module's source and what replaces it, a line that says what bug it stands for, and the test
files (pytest arguments: files, node ids, `-k` selections) that should catch it. The runner:

1. refuses (exit 2) a mutant whose snippet is not in its module exactly once, or that changes
   nothing, so the list cannot rot silently when the code changes;
2. copies the working tree (tracked and untracked files git does not ignore) to a scratch
   folder, so the tree others use is never touched; everything runs there with PYTHONPATH
   pointing at the copy;
3. runs each distinct set of targeted tests once on the unchanged copy (the baseline): a set
   that fails there would kill every mutant, so the run stops (--no-baseline skips this);
4. per mutant: writes the mutated module into the copy, imports it in a fresh interpreter (a
   module that no longer imports is an *invalid* mutant, not a killed one), runs its tests with
   `pytest -x -q`, records *killed* (a test failed, or the tests ran past --timeout) or
   *survived* (they passed), and restores the module;
5. prints a table, the counts per module and the score: killed / (killed + survived), and the
   score of each round (`Mutant.round`: the study that wrote it; --round N selects one).

Exit 0 when every selected mutant was killed, 1 when one survived or was invalid, 2 on a refused list.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from mlperf_tools.testing import mutant_list, mutant_list_tools
from mlperf_tools.testing.mutant_list import Mutant
from mlperf_bert.runtime.files import output_file

# The trainer's and data preparation's mutants, then the tools' (planner, recipe, forecast, scoring, bands).
MUTANTS: list[Mutant] = mutant_list.MUTANTS + mutant_list_tools.TOOL_MUTANTS
MODULE_TESTS: dict[str, tuple[str, ...]] = {**mutant_list.MODULE_TESTS, **mutant_list_tools.TOOL_MODULE_TESTS}

REPO = Path(__file__).resolve().parents[3]  # tools/mlperf_tools/<kind>/<module>.py: the tools work on a checkout
DEFAULT_TIMEOUT_S = 900.0
KILLED, SURVIVED, INVALID = "killed", "survived", "invalid"


class ListError(Exception):
    """The mutant list does not fit the source (a snippet gone or ambiguous, a duplicate id)."""


def import_name(module: str) -> str:
    """`pytorch/mlperf_bert/data/record.py` -> `mlperf_bert.data.record`; `data_prep/x.py` -> `data_prep.x`;
    `tools/mlperf_tools/planning/plan.py` -> `mlperf_tools.planning.plan`."""
    parts = Path(module).with_suffix("").parts
    return ".".join(parts[1:] if parts[0] in ("pytorch", "tools") else parts)


def tests_of(mutant: Mutant) -> tuple[str, ...]:
    return mutant.tests if mutant.tests else MODULE_TESTS[mutant.module]


def mutated_source(mutant: Mutant, root: Path = REPO) -> tuple[str, str]:
    """(original, mutated) source of the mutant's module under `root`; ListError unless the
    snippet occurs exactly once and the replacement changes it."""
    path = root / mutant.module
    if not path.is_file():
        raise ListError(f"mutant {mutant.id}: {mutant.module} does not exist")
    source = path.read_text()
    found = source.count(mutant.find)
    if found != 1:
        where = "not found" if found == 0 else f"found {found} times (make it unique)"
        raise ListError(f"mutant {mutant.id}: its snippet is {where} in {mutant.module}: {mutant.find!r}; "
                        "update tools/mlperf_tools/testing/mutant_list.py to the current source")
    if mutant.find == mutant.replace:
        raise ListError(f"mutant {mutant.id}: the replacement equals the snippet")
    return source, source.replace(mutant.find, mutant.replace)


def check_list(mutants: Iterable[Mutant], root: Path = REPO) -> None:
    """ListError for the first mutant that does not fit the source, repeats an id or names a test file that is
    not there."""
    seen: set[str] = set()
    for mutant in mutants:
        if mutant.id in seen:
            raise ListError(f"mutant {mutant.id}: the id is used twice")
        seen.add(mutant.id)
        if not mutant.bug:
            raise ListError(f"mutant {mutant.id}: no description of the bug it stands for")
        if mutant.module not in MODULE_TESTS and not mutant.tests:
            raise ListError(f"mutant {mutant.id}: no tests given and no default tests for {mutant.module}")
        for test in tests_of(mutant):
            path = test.split("::")[0]
            if path.endswith(".py") and not (root / path).is_file():
                raise ListError(f"mutant {mutant.id}: its test file {path} does not exist; update "
                                "tools/mlperf_tools/testing/mutant_list.py to where the test is now")
        mutated_source(mutant, root)


def scratch_copy(root: Path = REPO) -> Path:
    """The working tree's files (tracked, and untracked ones git does not ignore) in a new temp folder."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                            capture_output=True).stdout.decode().split("\0")
    copy = Path(tempfile.mkdtemp(prefix="mutants_"))
    for name in filter(None, listed):
        source = root / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    return copy


def _env(copy: Path) -> dict[str, str]:
    path = os.pathsep.join([str(copy / "pytorch"), str(copy / "tools"), str(copy)])  # the copy's packages first
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def _forget_bytecode(path: Path) -> None:
    """Removes the module's cached bytecode: a same-size edit in the same second could otherwise
    be run from the stale cache."""
    for cached in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        cached.unlink()


def run_tests(copy: Path, tests: tuple[str, ...], timeout_s: float) -> tuple[int | None, str]:
    """pytest's exit code on the tests in the copy (None: past the timeout) and its output's tail."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]
    try:
        done = subprocess.run(command, cwd=copy, env=_env(copy), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, ""
    return done.returncode, (done.stdout + done.stderr)[-3000:]


def imports(copy: Path, module: str) -> tuple[bool, str]:
    done = subprocess.run([sys.executable, "-c", f"import {import_name(module)}"], cwd=copy, env=_env(copy),
                          capture_output=True, text=True, timeout=300)
    return done.returncode == 0, done.stderr.strip().splitlines()[-1:][0] if done.returncode else ""


@dataclass
class Outcome:
    mutant: Mutant
    result: str
    seconds: float
    note: str = ""


def run_mutant(copy: Path, mutant: Mutant, timeout_s: float) -> Outcome:
    original, mutated = mutated_source(mutant, copy)
    path = copy / mutant.module
    started = time.monotonic()
    try:
        path.write_text(mutated)
        _forget_bytecode(path)
        ok, why = imports(copy, mutant.module)
        if not ok:
            return Outcome(mutant, INVALID, time.monotonic() - started, f"does not import: {why}")
        code, tail = run_tests(copy, tests_of(mutant), timeout_s)
    finally:
        path.write_text(original)
        _forget_bytecode(path)
    seconds = time.monotonic() - started
    if code is None:
        return Outcome(mutant, KILLED, seconds, f"tests ran past {timeout_s:.0f} s")
    if code == 0:
        return Outcome(mutant, SURVIVED, seconds)
    if code == 1:
        failed = [line for line in tail.splitlines() if line.startswith(("FAILED tests/", "ERROR tests/"))]
        return Outcome(mutant, KILLED, seconds, failed[0][:110] if failed else "")
    return Outcome(mutant, INVALID, seconds, f"pytest exit {code}: {tail.strip().splitlines()[-1:]}")


def baseline(copy: Path, mutants: list[Mutant], timeout_s: float) -> list[str]:
    """The test sets that fail on the unchanged tree (each set run once)."""
    failing = []
    for tests in dict.fromkeys(tests_of(m) for m in mutants):
        code, tail = run_tests(copy, tests, timeout_s)
        if code != 0:
            failing.append(f"{' '.join(tests)}: exit {code}\n{tail}")
    return failing


def report(outcomes: list[Outcome]) -> str:
    lines = [f"{'id':<14} {'result':<9} {'s':>5}  bug / note"]
    for o in outcomes:
        lines.append(f"{o.mutant.id:<14} {o.result:<9} {o.seconds:5.0f}  {o.mutant.bug}"
                     + (f" [{o.note}]" if o.note and o.result != KILLED else ""))
    lines.append("")
    lines.append(f"{'module':<45} {'mutants':>7} {'killed':>6} {'survived':>8} {'invalid':>7}")
    per: dict[str, Counter] = {}
    for o in outcomes:
        per.setdefault(o.mutant.module, Counter())[o.result] += 1
    total: Counter = Counter()
    for module, counts in per.items():
        total.update(counts)
        lines.append(f"{module:<45} {sum(counts.values()):>7} {counts[KILLED]:>6} {counts[SURVIVED]:>8} "
                     f"{counts[INVALID]:>7}")
    lines.append(f"{'all':<45} {sum(total.values()):>7} {total[KILLED]:>6} {total[SURVIVED]:>8} {total[INVALID]:>7}")
    lines.append(f"score: {score(outcomes):.1%} of the valid mutants killed")
    for n in sorted({o.mutant.round for o in outcomes}):
        mine = [o for o in outcomes if o.mutant.round == n]
        counts = Counter(o.result for o in mine)
        lines.append(f"round {n}: {score(mine):.1%} of {counts[KILLED] + counts[SURVIVED]} valid mutants killed "
                     f"({counts[KILLED]} killed, {counts[SURVIVED]} survived, {counts[INVALID]} invalid)")
    return "\n".join(lines)


def score(outcomes: list[Outcome]) -> float:
    valid = [o for o in outcomes if o.result != INVALID]
    return sum(o.result == KILLED for o in valid) / len(valid) if valid else 0.0


def select(module: str | None, only: list[str] | None, round_: int | None = None) -> list[Mutant]:
    chosen = [m for m in MUTANTS if (module is None or module in m.module) and (not only or m.id in only)
              and (round_ is None or m.round == round_)]
    unknown = set(only or ()) - {m.id for m in MUTANTS}
    if unknown:
        raise ListError(f"no mutant with id {', '.join(sorted(unknown))} (see --list)")
    rounds = sorted({m.round for m in MUTANTS})
    if round_ is not None and round_ not in rounds:
        raise ListError(f"--round {round_}: no mutant of that round; the list has rounds {', '.join(map(str, rounds))}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", help="only the mutants of modules whose path contains this")
    parser.add_argument("--round", type=int, metavar="N", help="only the mutants of round N (Mutant.round)")
    parser.add_argument("--only", action="append", metavar="ID", help="only this mutant (repeatable)")
    parser.add_argument("--list", action="store_true", help="check the list against the source and print it")
    parser.add_argument("--no-baseline", action="store_true", help="skip running the tests on the unchanged tree")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per mutant's tests")
    parser.add_argument("--json", type=output_file, help="also write the outcomes here")
    args = parser.parse_args(argv)
    try:
        check_list(MUTANTS)
        mutants = select(args.module, args.only, args.round)
    except ListError as err:
        print(f"mutants.py: {err}", file=sys.stderr)
        return 2
    if args.list:
        for m in mutants:
            print(f"{m.id:<14} {m.module}: {m.bug}  [{' '.join(tests_of(m))}]")
        print(f"{len(mutants)} mutants")
        return 0
    copy = scratch_copy()
    try:
        if not args.no_baseline:
            failing = baseline(copy, mutants, args.timeout)
            if failing:
                print("mutants.py: the targeted tests fail on the unchanged tree, so no mutant can be judged:\n"
                      + "\n".join(failing), file=sys.stderr)
                return 2
        outcomes = []
        for mutant in mutants:
            outcome = run_mutant(copy, mutant, args.timeout)
            print(f"{mutant.id:<14} {outcome.result:<9} {outcome.seconds:5.0f}s {outcome.note}", flush=True)
            outcomes.append(outcome)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    print()
    print(report(outcomes))
    if args.json:
        args.json.write_text(json.dumps([{"id": o.mutant.id, "module": o.mutant.module, "round": o.mutant.round,
                                          "result": o.result, "seconds": round(o.seconds, 1), "note": o.note}
                                         for o in outcomes], indent=1) + "\n")
    return 0 if all(o.result == KILLED for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
