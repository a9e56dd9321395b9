"""tools/mutants.py: the mutant list fits the source, and the runner tells killed, survived and invalid apart.

The runner is exercised on a tiny tree of its own (one module, one test file), so these tests
take seconds; `python tools/mutants.py` runs the real list (docs/TESTING.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mlperf_tools.testing import mutants
from mlperf_tools.testing.mutant_list import Mutant
from mlperf_tools.testing.mutants import MUTANTS


def test_every_mutant_of_the_list_fits_the_current_source():
    """A snippet the code no longer holds (or holds twice) fails here, not silently in a later run."""
    mutants.check_list(MUTANTS)
    assert len(MUTANTS) >= 80 and len({m.module for m in MUTANTS}) >= 8


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "pytorch" / "toy").mkdir(parents=True)
    (tmp_path / "pytorch" / "toy" / "__init__.py").write_text("")
    (tmp_path / "pytorch" / "toy" / "rules.py").write_text(
        "LIMIT = 512\n\n\ndef allowed(n: int) -> bool:\n    return 0 < n <= LIMIT\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_rules.py").write_text(
        "from toy.rules import allowed\n\n\ndef test_edges():\n    assert allowed(512) and not allowed(513)\n")
    return tmp_path


def _mutant(find: str, replace: str) -> Mutant:
    return Mutant("toy-1", "pytorch/toy/rules.py", find, replace, "a toy bug", ("tests/test_rules.py",))


@pytest.mark.parametrize("pytest_exit, result", [(1, mutants.KILLED), (0, mutants.SURVIVED), (None, mutants.KILLED),
                                                 (4, mutants.INVALID)])
def test_a_mutant_is_judged_by_its_tests_on_the_mutated_module_which_is_restored(tmp_path, monkeypatch, pytest_exit,
                                                                                  result):
    """pytest's exit 1 (a test failed) or a timeout (None) kills; 0 survives; a usage error is invalid."""
    tree = _tree(tmp_path)
    module = tree / "pytorch" / "toy" / "rules.py"
    before = module.read_text()
    seen = []

    def tests_on(copy, tests, timeout_s):
        seen.append((copy, tests, module.read_text()))
        return pytest_exit, "FAILED tests/test_rules.py::test_edges" if pytest_exit == 1 else ""

    monkeypatch.setattr(mutants, "run_tests", tests_on)
    outcome = mutants.run_mutant(tree, _mutant("return 0 < n <= LIMIT", "return 0 < n <= LIMIT + 1"), 60)
    assert outcome.result == result, outcome.note
    assert seen == [(tree, ("tests/test_rules.py",), before.replace("<= LIMIT", "<= LIMIT + 1"))]
    assert module.read_text() == before


def test_a_mutant_that_does_not_import_is_invalid_not_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(mutants, "run_tests", lambda *args: pytest.fail("an unimportable mutant was tested"))
    outcome = mutants.run_mutant(_tree(tmp_path), _mutant("return 0 < n <= LIMIT", "return 0 < n <= LIMIT +"), 60)
    assert outcome.result == mutants.INVALID and "does not import: SyntaxError" in outcome.note


@pytest.mark.parametrize("find, says", [("return n > 0", "not found"), ("LIMIT", r"found 2 times \(make it unique\)")])
def test_a_snippet_not_in_the_module_once_is_refused(tmp_path, find, says):
    with pytest.raises(mutants.ListError, match=f"mutant toy-1: its snippet is {says} in pytorch/toy/rules.py"):
        mutants.check_list([_mutant(find, "x")], _tree(tmp_path))


def test_the_score_counts_only_valid_mutants():
    outcomes = [mutants.Outcome(MUTANTS[0], result, 1.0) for result in
                (mutants.KILLED, mutants.KILLED, mutants.KILLED, mutants.SURVIVED, mutants.INVALID)]
    assert mutants.score(outcomes) == 0.75
    assert "score: 75.0% of the valid mutants killed" in mutants.report(outcomes)


def test_each_round_gets_its_own_score_line():
    first, second = MUTANTS[0], Mutant("toy-2", MUTANTS[0].module, "x", "y", "a toy bug", round=2)
    outcomes = [mutants.Outcome(first, mutants.KILLED, 1.0), mutants.Outcome(second, mutants.KILLED, 1.0),
                mutants.Outcome(second, mutants.SURVIVED, 1.0), mutants.Outcome(second, mutants.INVALID, 1.0)]
    text = mutants.report(outcomes)
    assert "round 1: 100.0% of 1 valid mutants killed (1 killed, 0 survived, 0 invalid)" in text
    assert "round 2: 50.0% of 2 valid mutants killed (1 killed, 1 survived, 1 invalid)" in text


def test_round_selects_the_mutants_of_that_round_only_and_an_unknown_round_is_refused(capsys):
    rounds = {m.round for m in MUTANTS}
    assert {1, 2} <= rounds
    for n in rounds:
        chosen = mutants.select(None, None, n)
        assert chosen and {m.round for m in chosen} == {n}
    assert mutants.select("closed_division", None, 2) == []
    assert mutants.main(["--round", "99", "--list"]) == 2
    assert "--round 99: no mutant of that round; the list has rounds 1, 2, 3" in capsys.readouterr().err


def test_no_keyword_filter_names_a_test_folder():
    """pytest's -k matches the folders of a test's path too: a filter word inside a folder's name ("not trainer"
    against tests/trainer/) would deselect, or select, every test of a mutant's set."""
    import re

    from mlperf_tools.testing.mutant_list import MODULE_TESTS

    for tests in [*MODULE_TESTS.values(), *(m.tests for m in MUTANTS)]:  # a mutant's own (), its module's
        folders = {part for test in tests if test.startswith("tests/") for part in Path(test.split("::")[0]).parent.parts}
        for flag, expression in zip(tests, tests[1:]):
            if flag == "-k":
                words = set(re.findall(r"\w+", expression)) - {"and", "or", "not"}
                assert not {w for w in words for f in folders if w in f}, (expression, tests)
