"""One rank of the multi-process load-balancing runs in test_balance_dist.py, and their data.

Usage (the rank comes from RANK / WORLD_SIZE / LOCAL_WORLD_SIZE / MASTER_PORT, or from an MPI
launcher's variables, read by mlperf_bert.runtime.distributed.dist_env_from as the trainer reads them):

    python -m tests.harness.workers.balance exchange DATA STRATIFIED OUT STEPS     # gloo policies
    python -m tests.harness.workers.balance mpi DATA STRATIFIED OUT STEPS [TRAIN_DATA TRAIN_STRATIFIED ARGS...]

Both run every case of their table (`mpi`: cpu_exchange, under mpiexec) for STEPS micro-batches
from fresh sources and write OUT/rank{R}.json: per case and step the uids and lengths of the
samples this rank got (in order), the source's token imbalance over those steps and its data
position. Every sample carries its uid in input_ids[1] (= ID_BASE + uid). With TRAIN_* and
trainer flags, `mpi` then runs mlperf_bert.trainer.run once per policy in the same job and adds
{"train": {policy: {status, samples}}}, the MLPerf logs going to OUT/<policy>/.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import h5py
import numpy as np
import torch

from mlperf_bert.config.cli import parse_config
from mlperf_bert.data.dataset import DataLimits, PretrainingDataset, discover_shards
from mlperf_bert.runtime.distributed import DistEnv, dist_env_from, init_distributed, shutdown
from mlperf_bert.input.exchange import TorchCollectives
from mlperf_bert.input.source_factory import node_group, world_group
from mlperf_bert.input.sources import ExchangeSource, LocalSource, TokenMeter
from mlperf_bert.data.stratified import StratifiedDataset

ID_BASE = 10
VOCAB = 5000
MAX_LEN, MAX_PRED = 64, 5
LIMITS = DataLimits(MAX_LEN, MAX_PRED, VOCAB)
MICRO_BATCH = 8
SEED = 3
BOUNDS = (16, 32, 48, 64)  # strata of the test data (lengths 4..64)

# name -> (stratified stream?, policy, deal order); "again" repeats a case from a fresh source.
GLOO_CASES = {
    "none": (False, "none", ""),
    "global_raster": (False, "global", "raster"),
    "global_snake": (False, "global", "snake"),
    "global_greedy": (False, "global", "greedy"),
    "global_greedy_again": (False, "global", "greedy"),
    "strat_none": (True, "none", ""),
    "local_snake": (True, "local", "snake"),
    "local_greedy": (True, "local", "greedy"),
}
MPI_CASES = {
    "none": (False, "none", ""),
    "cpu_raster": (False, "cpu", "raster"),
    "cpu_greedy": (False, "cpu", "greedy"),
    "strat_none": (True, "none", ""),
    "cpu_strat_snake": (True, "cpu", "snake"),
}


def sample_arrays(uids: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Varlength shard columns: one sample per uid, lengths uniform in 4..MAX_LEN."""
    rows: dict[str, list[np.ndarray]] = {k: [] for k in ("input_ids", "segment_ids", "masked_lm_positions",
                                                          "masked_lm_ids")}
    for uid in uids:
        n = int(rng.integers(4, MAX_LEN + 1))
        ids = rng.integers(ID_BASE, VOCAB, size=n)
        ids[0], ids[1] = 1, ID_BASE + uid
        k = int(rng.integers(1, min(MAX_PRED, n - 2) + 1))
        rows["input_ids"].append(ids)
        rows["segment_ids"].append((np.arange(n) >= n // 2).astype(np.int64))
        rows["masked_lm_positions"].append(np.sort(rng.choice(np.arange(2, n), size=k, replace=False)))
        rows["masked_lm_ids"].append(rng.integers(0, VOCAB, size=k))
    arrays = {}
    for key, values in rows.items():
        column = np.empty(len(values), dtype=object)
        column[:] = [v.astype(np.int16) for v in values]
        arrays[key] = column
    arrays["next_sentence_labels"] = rng.integers(0, 2, size=len(uids)).astype(np.int8)
    return arrays


def write_dataset(out: Path, shard_sizes: list[int], seed: int = 0) -> Path:
    """Varlength shards part_0000i.hdf5 under `out`, uids 0..sum(shard_sizes)-1."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    first = 0
    for i, size in enumerate(shard_sizes):
        with h5py.File(out / f"part_{i:05d}.hdf5", "w") as f:
            for key, column in sample_arrays(np.arange(first, first + size), rng).items():
                dtype = h5py.vlen_dtype(np.int16) if column.dtype == object else column.dtype
                f.create_dataset(key, data=column, dtype=dtype)
        first += size
    return out


def open_case(case: tuple[bool, str, str], data: Path, stratified: Path, denv: DistEnv):
    stratify, policy, order = case
    if stratify:
        stream = StratifiedDataset(stratified, LIMITS, rank=denv.rank, world_size=denv.world_size,
                                   items_per_rank_step=MICRO_BATCH, seed=SEED)
    else:
        stream = PretrainingDataset(discover_shards(data), LIMITS, rank=denv.rank, world_size=denv.world_size,
                                    items_per_rank_step=MICRO_BATCH, seed=SEED)
    world = world_group()
    meter = TokenMeter(world)
    if policy == "none":
        return LocalSource(stream, meter)
    if policy == "cpu":
        from mlperf_bert.input.host_exchange import CpuExchangeSource, mpi_collectives

        return CpuExchangeSource(stream, mpi_collectives(denv), order, meter)
    group = node_group(denv) if policy == "local" else world
    return ExchangeSource(stream, TorchCollectives(group), order, meter)


def run_case(source, steps: int) -> dict:
    uids, lengths = [], []
    for _ in range(steps):
        items = source.next_batch()
        uids.append([int(item[0].input_ids[1]) - ID_BASE for item in items])
        lengths.append([item[0].length for item in items])
    imbalance = source.token_imbalance()
    record = {"uids": uids, "lengths": lengths, "max_tokens": imbalance.max_tokens.tolist(),
              "min_tokens": imbalance.min_tokens.tolist(), "state": source.state_dict()}
    source.close()
    return record


def train_policies(out: Path, data: str, stratified: str, flags: list[str], denv: DistEnv) -> dict:
    """The trainer under each policy in turn, inside the job's one torch.distributed group."""
    from mlperf_bert.trainer import run

    results = {}
    for policy in ("none", "global_presort", "local_presort", "cpu_exchange"):
        input_dir = stratified if policy == "local_presort" else data
        cfg = parse_config([*flags, "--input_dir", input_dir, "--output_dir", str(out / policy), "--balance", policy],
                           denv.world_size)
        result = run(cfg, denv, torch.device("cpu"))
        results[policy] = {"status": result.status, "samples": result.samples}
    return results


def main(argv: list[str]) -> None:
    mode, data, stratified, out, steps = argv[0], Path(argv[1]), Path(argv[2]), Path(argv[3]), int(argv[4])
    torch.set_num_threads(1)
    denv = dist_env_from(os.environ)
    init_distributed(denv, torch.device("cpu"))
    try:
        cases = GLOO_CASES if mode == "exchange" else MPI_CASES
        results = {name: run_case(open_case(case, data, stratified, denv), steps) for name, case in cases.items()}
        if len(argv) > 5:
            results["train"] = train_policies(out, argv[5], argv[6], argv[7:], denv)
    finally:
        shutdown()
    (out / f"rank{denv.rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
