"""The balance simulator, run as a user runs it: it must reproduce Table 5 of the Samsung
paper and agree with a sample-by-sample computation on a small case."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import ModuleType

import numpy as np
import pytest

from data_prep.packing import pack_histogram
from mlperf_bert.data.lengths import load_length_histogram
from mlperf_tools.planning import simulate_balance
from tests.harness.paths import REPO

SCRIPT = REPO / "tools" / "simulate_balance.py"

# Kim et al., Table 5: 1024 GPUs, 8 per node, local batch 16; (min, max) per-GPU tokens.
TABLE_5 = {
    "none": (1886, 6459),
    "stratified": (3620, 4482),
    "stratified+local_presort": (3743, 4401),
    "stratified+local_snake": (3900, 4246),
    "stratified+global_presort": (3807, 4313),
}


def run_simulator(*flags: str) -> dict[str, dict[str, float]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "pytorch"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *flags, "--json"], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(done.stdout)


def load_tool() -> ModuleType:
    return simulate_balance


@pytest.fixture(scope="module")
def table5_run() -> dict[str, dict[str, float]]:
    flags = ["--gpus", "1024", "--gpus-per-node", "8", "--local-batch", "16", "--trials", "1000"]
    return run_simulator(*flags, "--seed", "0", "--packers", "lpfhp")


@pytest.mark.parametrize("policy", sorted(TABLE_5))
def test_reproduces_table_5(table5_run: dict[str, dict[str, float]], policy: str) -> None:
    low, high = TABLE_5[policy]
    assert table5_run[policy]["min"] == pytest.approx(low, rel=0.02)
    assert table5_run[policy]["max"] == pytest.approx(high, rel=0.02)


def test_greedy_beats_snake_and_gains_follow_the_model(table5_run: dict[str, dict[str, float]]) -> None:
    assert table5_run["stratified+local_greedy"]["max"] < table5_run["stratified+local_snake"]["max"]
    assert table5_run["stratified+global_greedy"]["max"] < table5_run["stratified+global_presort"]["max"]
    for row in table5_run.values():
        assert row["min"] <= row["max"]
        assert row["step_time_gain_vs_padded"] == pytest.approx(16 * 512 / row["max"])
    assert table5_run["packing_2"]["max"] == 16 / 2 * 512
    rate = pack_histogram(load_length_histogram(), "lpfhp", 512, 3).sequences_per_pack
    assert table5_run["packing_lpfhp"]["max"] == pytest.approx(16 / rate * 512)


def loads_by_rows(lengths: list[int], bins: int, order: str) -> list[int]:
    """Per-bin token sums of one deal, one sample at a time."""
    ranked = sorted(lengths)
    loads = [0] * bins
    rows = [ranked[r : r + bins] for r in range(0, len(ranked), bins)]
    if order == "greedy":
        for row in reversed(rows):
            targets = sorted(range(bins), key=lambda b: (loads[b], b))
            for b, length in zip(targets, sorted(row, reverse=True)):
                loads[b] += length
        return loads
    for r, row in enumerate(rows):
        for position, length in enumerate(row):
            loads[bins - 1 - position if order == "snake" and r % 2 else position] += length
    return loads


def brute_force_loads(step: np.ndarray, policy: str, gpus_per_node: int) -> list[int]:
    """Per-GPU tokens of one step [G, B] under a balance.POLICIES entry."""
    per_gpu = step.tolist()
    if policy == "none":
        return [sum(batch) for batch in per_gpu]
    scope, order = policy.split("_")
    order = {"presort": "raster"}.get(order, order)
    groups = len(per_gpu) if scope == "global" else gpus_per_node
    loads: list[int] = []
    for first in range(0, len(per_gpu), groups):
        pooled = [length for batch in per_gpu[first : first + groups] for length in batch]
        loads += loads_by_rows(pooled, groups, order)
    return loads


def test_small_case_matches_brute_force() -> None:
    tool = load_tool()
    setup = tool.Setup(gpus=4, gpus_per_node=2, local_batch=4, trials=3)
    flags = ["--gpus", "4", "--gpus-per-node", "2", "--local-batch", "4", "--trials", "3", "--seed", "7"]
    report = run_simulator(*flags, "--packers")
    draws = tool.draw_trials(load_length_histogram(), setup, np.random.default_rng(7))
    for name, source, policy in tool.EXCHANGE_POLICIES:
        per_trial = [brute_force_loads(step, policy, 2) for step in draws[source]]
        assert report[name]["min"] == pytest.approx(np.mean([min(loads) for loads in per_trial]))
        assert report[name]["max"] == pytest.approx(np.mean([max(loads) for loads in per_trial]))


def test_bad_flags_are_named() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--gpus", "12", "--gpus-per-node", "8", "--local-batch", "16"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO / "pytorch")),
    )
    assert done.returncode != 0
    assert "--gpus-per-node" in done.stderr
