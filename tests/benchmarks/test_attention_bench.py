"""benchmarks/attention.py: interleaved rounds, ratios against sdpa, and a tiny CPU run as a user runs it."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from tests.harness.commands import load_script, run_cli
from tests.harness.paths import REPO

SCRIPT = REPO / "benchmarks" / "attention.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT, "attention_bench")


def test_grouped_bench_rounds_rotate_the_order_and_take_the_batches_in_turn(bench, monkeypatch):
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(bench, "attention_of", lambda backend, batch, bounds, dropout: (backend, batch))
    monkeypatch.setattr(bench, "time_once", lambda run, batch: calls.append((run[0], run[1])) or 1.0)
    seconds = bench.run_rounds([0, 1], ["sdpa", "grouped", "varlen"], 4, (128,), 0.0)
    assert [c[0] for c in calls] == ["sdpa", "grouped", "varlen", "grouped", "varlen", "sdpa",
                                     "varlen", "sdpa", "grouped", "sdpa", "grouped", "varlen"]
    assert [c[1] for c in calls] == [0] * 3 + [1] * 3 + [0] * 3 + [1] * 3
    assert seconds == {"sdpa": [1.0] * 4, "grouped": [1.0] * 4, "varlen": [1.0] * 4}


def test_grouped_bench_ratios_are_per_round_against_sdpa(bench):
    results = bench.summarise({"sdpa": "ok", "grouped": "ok", "varlen": "not available: no kernel"},
                              {"sdpa": [2.0, 4.0, 1.0], "grouped": [1.0, 1.0, 1.0]})
    grouped = next(r for r in results if r.backend == "grouped")
    assert grouped.ratio_vs_sdpa == [0.5, 0.25, 1.0]
    assert (grouped.ratio_median, grouped.ratio_min, grouped.ratio_max, grouped.median_ms) == (0.5, 0.25, 1.0, 1e3)
    assert grouped.ratio_q1 <= grouped.ratio_median <= grouped.ratio_q3
    assert next(r for r in results if r.backend == "varlen").status == "not available: no kernel"


def test_grouped_bench_lengths_follow_the_histogram_rescaled(bench):
    rng = np.random.default_rng(0)
    lengths = bench.wikipedia_lengths(rng, 2000, 128)
    assert min(lengths) >= 1 and max(lengths) <= 128
    assert 40 < np.mean(lengths) < 90  # the phase-2 mean, about 256 of 512, scaled by 1/4


def test_grouped_bench_tiny_cpu_run(tmp_path):
    out = tmp_path / "attention.json"
    result = run_cli([sys.executable, str(SCRIPT), "--sequences", "6", "--heads", "2", "--head_dim", "8",
                      "--rounds", "3", "--batches", "2", "--dropout", "0", "--json", str(out)], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    results = {r["backend"]: r for r in report["results"]}
    assert results["sdpa"]["ratio_vs_sdpa"] == [1.0, 1.0, 1.0]
    grouped = results["grouped"]
    assert grouped["status"] == "ok" and len(grouped["seconds"]) == 3 and grouped["ratio_min"] > 0
    assert results["varlen"]["status"] == "ok" or results["varlen"]["status"].startswith("not available")
    assert report["score_work_padded_over_grouped"] >= 1.0 and len(report["lengths"]) == 2


def test_grouped_bench_refuses_a_run_without_its_reference():
    result = run_cli([sys.executable, str(SCRIPT), "--backends", "grouped"])
    assert result.returncode != 0 and "--backends: a subset" in result.stderr
