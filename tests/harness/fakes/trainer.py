#!/usr/bin/env python3
"""A stand-in for run_and_time.sh in launcher and packaging tests.

It reads what run_and_time.sh reads (the config_<SYSTEM>.sh variables, SEED, the data paths, the
rank variables of torchrun or SLURM) and prints what it prints on rank 0: a complete MLPerf
training 5.0.0 BERT log written with mlperf_logging.mllog, then the RESULT line. The run is
synthetic: its timestamps are computed (a 300 samples/s/accelerator training speed), not waited
for, and it converges at a sample count that depends on the seed.

FAKE_TRAINER_RECORD=DIR   each rank writes DIR/rank_<rank>.json with the variables it saw.
FAKE_TRAINER_ALLREDUCE=1  all ranks join a gloo process group from MASTER_ADDR / MASTER_PORT
                          and all-reduce their rank (the sum is recorded), as the trainer would.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Mapping

from mlperf_logging.mllog.mllog import MLLogger

SAMPLES_PER_S_PER_ACCELERATOR = 300.0
EVAL_SECONDS = 10.0
INIT_SECONDS = 60.0
RECORDED = ("DGXSYSTEM", "DGXNNODES", "DGXNGPU", "BATCHSIZE", "SEED", "DATADIR_PHASE2", "EVALDIR",
            "CHECKPOINTDIR_PHASE1", "LOGDIR", "OUTPUT_DIR", "MASTER_ADDR", "MASTER_PORT",
            "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "RANK")


def sample_config(system: str, gpus: int, nodes: int = 1) -> str:
    """A config_<SYSTEM>.sh for tests: NVIDIA's 1x8 hyperparameters at 56 sequences per GPU."""
    return "\n".join([
        "# shellcheck shell=bash",
        f"export DGXSYSTEM={system}", f"export DGXNNODES={nodes}", f"export DGXNGPU={gpus}",
        "export WALLTIME=60", "export BATCHSIZE=56", "export GRADIENT_STEPS=1",
        "export LR=0.000425", "export MAX_STEPS=6700", "export WARMUP_STEPS=0",
        "export START_WARMUP_STEP=0", "export OPT_LAMB_BETA_1=0.9", "export OPT_LAMB_BETA_2=0.999",
        "export WEIGHT_DECAY_RATE=0.01", "export OPT_EPSILON=1e-6",
        "export EVAL_ITER_START_SAMPLES=150000", "export EVAL_ITER_SAMPLES=150000",
        "export MAX_SAMPLES_TERMINATION=4500000", "export TARGET_MLM_ACCURACY=0.720",
        "export DIVISION=closed", "export SUBMISSION_ORG=TestOrg",
        f"export SUBMISSION_PLATFORM={nodes}xTEST_{gpus}GPU", ""])


def global_batch_size(config: Mapping[str, str]) -> int:
    """Per-GPU batch x GPUs per node x nodes: BATCHSIZE holds the accumulation steps, as the trainer's
    --train_batch_size does (mlperf_bert.config.batch_size; not imported: the stand-in runs without it)."""
    return int(config["BATCHSIZE"]) * int(config["DGXNGPU"]) * int(config["DGXNNODES"])


def eval_points(config: Mapping[str, str], seed: int) -> list[int]:
    """Samples at each eval up to convergence; the last one reaches the target."""
    gbs = global_batch_size(config)
    interval = int(config["EVAL_ITER_SAMPLES"])
    start = int(config.get("EVAL_ITER_START_SAMPLES", interval))
    needed = 2_450_000 + 60_000 * (seed % 9)  # samples to converge, spread like real runs
    points, k = [], 0
    while not points or points[-1] < needed:
        points.append(math.ceil((start + k * interval) / gbs) * gbs)
        k += 1
    return points


def _accuracy(samples: int, last: int, target: float) -> float:
    """Below the target until the last eval, which is just above it."""
    if samples >= last:
        return target + 0.0003
    return 0.34 + (target - 0.005 - 0.34) * (samples / last) ** 0.3


def _log_header(log: MLLogger, config: Mapping[str, str], seed: int, t: float) -> None:
    at = int(t)
    log.start("init_start", time_ms=at)
    for key, value in (("submission_benchmark", "bert"),
                       ("submission_org", config["SUBMISSION_ORG"]),
                       ("submission_division", config["DIVISION"]),
                       ("submission_status", config.get("SUBMISSION_STATUS", "onprem")),
                       ("submission_platform", config["SUBMISSION_PLATFORM"]),
                       ("seed", seed),
                       ("global_batch_size", global_batch_size(config)),
                       ("gradient_accumulation_steps", int(config.get("GRADIENT_STEPS", "1"))),
                       ("opt_base_learning_rate", float(config["LR"])),
                       ("opt_lamb_epsilon", float(config.get("OPT_EPSILON", "1e-6"))),
                       ("opt_learning_rate_training_steps", int(config["MAX_STEPS"])),
                       ("opt_learning_rate_warmup_steps", int(config["WARMUP_STEPS"])),
                       ("num_warmup_steps", int(config["WARMUP_STEPS"])),
                       ("start_warmup_step", int(config["START_WARMUP_STEP"])),
                       ("opt_lamb_beta_1", float(config["OPT_LAMB_BETA_1"])),
                       ("opt_lamb_beta_2", float(config["OPT_LAMB_BETA_2"])),
                       ("opt_lamb_weight_decay_rate", float(config["WEIGHT_DECAY_RATE"]))):
        log.event(key, value, time_ms=at)


def synthetic_log(config: Mapping[str, str], seed: int, start_ms: float) -> str:
    """The MLPerf lines of one synthetic converged run starting at start_ms (epoch ms)."""
    stream = io.StringIO()
    logger = logging.Logger(f"fake_trainer_{seed}")
    logger.addHandler(logging.StreamHandler(stream))
    log = MLLogger(logger=logger)
    _log_header(log, config, seed, start_ms)
    t = start_ms + INIT_SECONDS * 1000
    log.end("init_stop", time_ms=int(t))
    log.start("run_start", time_ms=int(t))
    log.start("block_start", metadata={"first_epoch_num": 1, "epoch_count": 1}, time_ms=int(t))
    rate = SAMPLES_PER_S_PER_ACCELERATOR * int(config["DGXNGPU"]) * int(config["DGXNNODES"])
    points, seen = eval_points(config, seed), 0
    target = float(config.get("TARGET_MLM_ACCURACY", "0.72"))
    for samples in points:
        t += (samples - seen) / rate * 1000
        seen = samples
        log.start("eval_start", metadata={"epoch_num": samples}, time_ms=int(t))
        t += EVAL_SECONDS * 1000
        log.end("eval_stop", metadata={"epoch_num": samples}, time_ms=int(t))
        log.event("eval_accuracy", _accuracy(samples, points[-1], target),
                  metadata={"epoch_num": samples}, time_ms=int(t))
    log.end("block_stop", metadata={"first_epoch_num": 1}, time_ms=int(t))
    log.event("train_samples", seen, time_ms=int(t))
    log.event("eval_samples", 10000, time_ms=int(t))
    log.end("run_stop", metadata={"status": "success"}, time_ms=int(t))
    return stream.getvalue()


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def _allreduce_rank_sum() -> int:
    """Join a gloo group from MASTER_ADDR / MASTER_PORT and all-reduce the ranks."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    dist.init_process_group("gloo", init_method="env://", rank=_rank(), world_size=world)
    total = torch.tensor([_rank()])
    dist.all_reduce(total)
    dist.destroy_process_group()
    return int(total.item())


def record(directory: Path) -> None:
    seen = {name: os.environ.get(name) for name in RECORDED}
    if os.environ.get("FAKE_TRAINER_ALLREDUCE") == "1":
        seen["allreduce_rank_sum"] = _allreduce_rank_sum()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"rank_{_rank()}.json").write_text(json.dumps(seen))


def main() -> int:
    if os.environ.get("FAKE_TRAINER_RECORD"):
        record(Path(os.environ["FAKE_TRAINER_RECORD"]))
    if _rank() != 0:
        return 0
    seed = int(os.environ.get("SEED", "1"))
    start = time.time()
    sys.stdout.write(synthetic_log(os.environ, seed, start * 1000))
    user = os.environ.get("USER", "unknown")
    print(f"RESULT,bert,{seed},{int(time.time() - start)},{user},{time.strftime('%Y-%m-%d %r')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
