"""Load balancing across real processes: 4 gloo ranks (2 nodes of 2) and `mpiexec -n 2`.

Each run is one launch of tests/harness/workers/balance.py per rank; the worker records, per policy
and step, the uids of the samples each rank trained on. The checks here compare them with
what the data holds (read independently with read_shard), with the unbalanced run of the
same stream, and with the pure policy functions of mlperf_bert.input.balance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest


from mlperf_bert.data.shards import list_shards
from data_prep.stratify import StratifyParams, stratify
from mlperf_bert.input import balance
from mlperf_bert.data.dataset import discover_shards, read_shard
from tests.harness.commands import require_tool
from tests.harness.demo import trainer_args
from tests.harness.paths import REPO
from tests.harness.ports import free_port
from tests.harness.workers.balance import BOUNDS, GLOO_CASES, LIMITS, MAX_LEN, MAX_PRED, MPI_CASES, write_dataset

pytestmark = pytest.mark.slow

WORKER = "tests.harness.workers.balance"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
SHARDS = [70, 70, 70]
GLOO_WORLD, GLOO_PER_NODE, GLOO_STEPS = 4, 2, 18
MPI_WORLD, MPI_STEPS = 2, 32
TRAIN_STEPS = 4
ORDERS = {"raster", "snake", "greedy"}


def base_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}


def launch_gloo(args: list[str], world: int, per_node: int, timeout: float = 240) -> None:
    """One worker process per rank, with the variables torchrun would set."""
    env = base_env()
    procs = [
        subprocess.Popen([sys.executable, "-m", WORKER, *args], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True,
                         env={**env, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(per_node),
                              "LOCAL_RANK": str(r % per_node)})
        for r in range(world)
    ]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out[-3000:]}"


def launch_mpi(args: list[str], world: int, timeout: float = 240) -> str:
    require_tool(MPIEXEC.exists(), f"{MPIEXEC} not found (pip install mpich)")
    result = subprocess.run([str(MPIEXEC), "-n", str(world), sys.executable, "-m", WORKER, *args], cwd=REPO,
                            env=base_env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result.stderr


def load_ranks(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("balance_data")
    plain = write_dataset(root / "plain", SHARDS)
    stratify(list_shards(plain), root / "stratified",
             StratifyParams(bounds=BOUNDS, shards_per_stratum=2, max_seq_length=MAX_LEN, max_predictions=MAX_PRED))
    return plain, root / "stratified"


@pytest.fixture(scope="module")
def lengths_by_uid(data) -> dict[int, int]:
    """uid -> length, read from the shards with the trainer's reader."""
    found = {}
    for path in discover_shards(data[0]):
        for item in read_shard(path, LIMITS):
            found[int(item[0].input_ids[1]) - 10] = item[0].length
    return found


@pytest.fixture(scope="module")
def gloo_runs(data, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("gloo_runs")
    launch_gloo(["exchange", str(data[0]), str(data[1]), str(out), str(GLOO_STEPS)], GLOO_WORLD, GLOO_PER_NODE)
    return load_ranks(out, GLOO_WORLD)


@pytest.fixture(scope="module")
def mpi_job(data, demo_data, tmp_path_factory) -> tuple[Path, str]:
    """One mpiexec job: the cpu_exchange cases, then a few trainer steps under every policy."""
    out = tmp_path_factory.mktemp("mpi_runs")
    stratified = out / "demo_stratified"
    stratify(list_shards(demo_data / "train"), stratified,
             StratifyParams(bounds=BOUNDS, max_seq_length=64, max_predictions=10))
    flags = trainer_args(demo_data, out, "--max_steps", str(TRAIN_STEPS), "--eval_iter_samples", "32", "--do_train")
    stderr = launch_mpi(["mpi", str(data[0]), str(data[1]), str(out), str(MPI_STEPS), str(demo_data / "train"),
                         str(stratified), *flags], MPI_WORLD)
    return out, stderr


@pytest.fixture(scope="module")
def mpi_runs(mpi_job) -> list[dict]:
    return load_ranks(mpi_job[0], MPI_WORLD)


def per_step(ranks: list[dict], case: str, key: str = "uids") -> list[list[list[int]]]:
    """[step][rank] -> the values that rank got at that step."""
    steps = len(ranks[0][case][key])
    return [[r[case][key][s] for r in ranks] for s in range(steps)]


def stratum_of(length: int) -> int:
    return int(np.searchsorted(BOUNDS, length, side="left"))


def epoch_ends(total: int, per_step: int, steps: int) -> list[int]:
    """Step counts at which the stream's epochs end (data/dataset.py: a pass plus the carried tail)."""
    ends, epoch, end = [], 0, 0
    while True:
        end += (epoch * total % per_step + total) // per_step
        if end > steps:
            return ends
        ends.append(end)
        epoch += 1


def assert_each_sample_once_per_pass(steps: list[list[int]], population: set[int], per_step: int) -> None:
    """At every epoch end, N samples consumed: each sample used p = N // T times, N - p T of them once more."""
    total = len(population)
    ends = epoch_ends(total, per_step, len(steps))
    assert len(ends) >= 2, "run the stream through two epochs"
    for end in ends:
        counts = Counter(u for step in steps[:end] for u in step)
        assert set(counts) <= population
        consumed = end * per_step
        passes, extra = divmod(consumed, total)
        uses = Counter(counts[u] for u in population)
        assert uses == Counter({passes + 1: extra, passes: total - extra}) - Counter(), (end, uses)


def check_exactly_once(ranks: list[dict], case: str, stratified: bool, lengths: dict[int, int]) -> None:
    steps = [[u for rank in step for u in rank] for step in per_step(ranks, case)]
    world = len(ranks)
    if not stratified:
        assert_each_sample_once_per_pass(steps, set(lengths), world * len(ranks[0][case]["uids"][0]))
        return
    for k in range(len(BOUNDS)):
        population = {u for u, n in lengths.items() if stratum_of(n) == k}
        in_k = [[u for u in step if stratum_of(lengths[u]) == k] for step in steps]
        assert len({len(s) for s in in_k}) == 1, "every step takes the same count from a stratum"
        assert_each_sample_once_per_pass(in_k, population, len(in_k[0]))


@pytest.mark.parametrize("case", list(GLOO_CASES))
def test_gloo_each_sample_used_once_per_pass(gloo_runs, lengths_by_uid, case):
    check_exactly_once(gloo_runs, case, GLOO_CASES[case][0], lengths_by_uid)


@pytest.mark.parametrize("case", list(MPI_CASES))
def test_mpi_each_sample_used_once_per_pass(mpi_runs, lengths_by_uid, case):
    check_exactly_once(mpi_runs, case, MPI_CASES[case][0], lengths_by_uid)


def unbalanced_case(cases: dict, case: str) -> str:
    return "strat_none" if cases[case][0] else "none"


def check_deal(ranks: list[dict], cases: dict, case: str, per_node: int) -> None:
    """Each rank got exactly what the pure policy deals from the unbalanced run's batches."""
    _, policy, order = cases[case]
    read = per_step(ranks, unbalanced_case(cases, case))
    got = per_step(ranks, case)
    read_lengths = np.array(per_step(ranks, unbalanced_case(cases, case), "lengths"))  # [steps, W, B]
    for s, (step_read, step_got) in enumerate(zip(read, got)):
        assert Counter(u for r in step_got for u in r) == Counter(u for r in step_read for u in r)
        flat_uids = np.array(step_read).reshape(-1)
        if policy == "local":
            assignment = balance.local_presort(read_lengths[s], per_node, order)
        else:
            assignment = balance.global_presort(read_lengths[s], order)
        assert [list(r) for r in flat_uids[assignment]] == step_got


@pytest.mark.parametrize("case", [c for c in GLOO_CASES if GLOO_CASES[c][2] in ORDERS])
def test_gloo_deal_is_the_policy_over_the_unchanged_step(gloo_runs, case):
    check_deal(gloo_runs, GLOO_CASES, case, GLOO_PER_NODE)


@pytest.mark.parametrize("case", [c for c in MPI_CASES if MPI_CASES[c][2] in ORDERS])
def test_mpi_deal_is_the_policy_over_the_unchanged_step(mpi_runs, case):
    check_deal(mpi_runs, MPI_CASES, case, MPI_WORLD)


def test_local_presort_keeps_samples_inside_the_node(gloo_runs):
    read, got = per_step(gloo_runs, "strat_none"), per_step(gloo_runs, "local_snake")
    for step_read, step_got in zip(read, got):
        for node in range(GLOO_WORLD // GLOO_PER_NODE):
            ranks = range(node * GLOO_PER_NODE, (node + 1) * GLOO_PER_NODE)
            assert sorted(u for r in ranks for u in step_got[r]) == sorted(u for r in ranks for u in step_read[r])


def test_same_seed_same_deal(gloo_runs):
    for rank in gloo_runs:
        assert rank["global_greedy"] == rank["global_greedy_again"]


def mean_max_tokens(ranks: list[dict], case: str) -> float:
    return float(np.mean(ranks[0][case]["max_tokens"]))


@pytest.mark.parametrize("better, worse", [("global_greedy", "global_snake"), ("global_snake", "none"),
                                           ("global_raster", "none"), ("local_greedy", "local_snake"),
                                           ("local_snake", "strat_none")])
def test_balancing_lowers_the_most_loaded_rank(gloo_runs, better, worse):
    assert mean_max_tokens(gloo_runs, better) < mean_max_tokens(gloo_runs, worse)


@pytest.mark.parametrize("case", list(GLOO_CASES))
def test_token_meter_reports_each_steps_extremes(gloo_runs, case):
    tokens = np.array([[sum(r) for r in step] for step in per_step(gloo_runs, case, "lengths")])  # [steps, W]
    for rank in gloo_runs:
        assert rank[case]["max_tokens"] == tokens.max(axis=1).tolist()
        assert rank[case]["min_tokens"] == tokens.min(axis=1).tolist()


@pytest.mark.parametrize("runs, case, reference", [("gloo_runs", "global_greedy", "none"),
                                                   ("gloo_runs", "local_snake", "strat_none"),
                                                   ("mpi_runs", "cpu_raster", "none"),
                                                   ("mpi_runs", "cpu_strat_snake", "strat_none")])
def test_data_position_is_the_consumed_one(request, runs, case, reference):
    """The saved position counts the batches handed out, not what the exchange thread read ahead."""
    for rank in request.getfixturevalue(runs):
        assert rank[case]["state"] == rank[reference]["state"]


def test_trainer_trains_under_every_policy_in_one_mpi_job(mpi_job, mpi_runs):
    """Two ranks started by mpiexec train a few steps under each policy, cpu_exchange included,
    and log each eval interval's per-rank token extremes."""
    out, stderr = mpi_job
    assert mpi_runs[0]["train"] == mpi_runs[1]["train"]
    for policy, result in mpi_runs[0]["train"].items():
        assert result["samples"] == TRAIN_STEPS * MPI_WORLD * 8
        lines = (out / policy / "mlperf.log").read_text().splitlines()
        events = [json.loads(line.split(":::MLLOG ", 1)[1]) for line in lines if ":::MLLOG" in line]
        stats = [e["value"] for e in events if e["key"] == "tracked_stats"]
        assert len(stats) == TRAIN_STEPS // 2, policy  # eval every 32 samples = 2 steps of 16
        assert all(0 < s["min_rank_tokens"] <= s["max_rank_tokens"] for s in stats)
    assert stderr.count("rank_tokens max") == 4 * TRAIN_STEPS // 2  # log_freq 2
