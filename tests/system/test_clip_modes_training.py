"""Clip modes and configs end to end: config_*.sh -> run_and_time.sh -> flags -> TrainConfig -> run.

* Every clip mode trains the CPU demo config with 2 processes when CLIP_MODE selects it,
  and the resolved config and the MLPerf log name the mode.
* The flags run_and_time.sh builds from each shipped hardware config are accepted by the
  trainer and give the published hyperparameters (REFERENCE.md's table).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


from clip_study import (
    RunOutcome,
    launch_command,
    launch_env,
    paired_table,
    read_mllog,
    summary_table,
    trainer_flags,
    write_section,
)
from mlperf_bert.config.cli import parse_config
from mlperf_bert.config.settings import CLIP_MODES, TrainConfig
from mlperf_bert.config.closed_division import eval_interval_samples
from mlperf_bert.build import hyperparameters, lr_schedule
from tests.harness.paths import REPO

DEMO_CONFIG = REPO / "config_CPU_1x2.sh"
# A clip norm far below the tiny model's gradient norms, so that every mode really clips.
SMALL_CLIP_NORM = 0.01
STEPS, BATCH_PER_RANK, RANKS = 3, 8, 2


def _demo_overrides(data: Path, out: Path, mode: str) -> dict[str, str]:
    """config_CPU_1x2.sh shrunk to conftest's demo data (64 tokens, 10 predictions, 200 eval)."""
    samples = STEPS * BATCH_PER_RANK * RANKS
    return {
        "CLIP_MODE": mode, "MAX_GRAD_NORM": str(SMALL_CLIP_NORM), "SEED": "7", "PYTHON": sys.executable,
        "DATADIR_PHASE2": str(data / "train"), "EVALDIR": str(data / "eval"),
        "BERT_CONFIG": str(data / "bert_config.json"), "INIT_CHECKPOINT": "none", "OUTPUT_DIR": str(out),
        "MAX_SEQ_LENGTH": "64", "MAX_PREDICTIONS_PER_SEQ": "10", "NUM_EVAL_EXAMPLES": "200",
        "EVAL_BATCH_SIZE": "100", "BATCHSIZE": str(BATCH_PER_RANK), "MAX_STEPS": "100",
        "EVAL_ITER_START_SAMPLES": str(samples), "EVAL_ITER_SAMPLES": str(samples),
        "MAX_SAMPLES_TERMINATION": str(samples), "WARMUP_STEPS": "0",
    }


@pytest.fixture(scope="module")
def demo_runs(demo_data, tmp_path_factory) -> dict[str, tuple[int, Path]]:
    """Each mode's run of the demo config through run_and_time.sh: (exit code, output dir)."""
    runs = {}
    for mode in CLIP_MODES:
        out = tmp_path_factory.mktemp(f"clip_{mode}")
        done = subprocess.run(launch_command(DEMO_CONFIG, _demo_overrides(demo_data, out, mode)), cwd=REPO,
                              env=launch_env(), capture_output=True, text=True, timeout=300, check=False)
        (out / "launch_output.txt").write_text(done.stdout + done.stderr)
        runs[mode] = (done.returncode, out)
    return runs


def _events(out: Path, key: str) -> list[dict]:
    return [e for e in read_mllog(out / "mlperf.log") if e["key"] == key]


@pytest.mark.slow
@pytest.mark.parametrize("mode", CLIP_MODES)
def test_clip_mode_selected_by_config_variable_trains_two_processes(demo_runs, mode):
    code, out = demo_runs[mode]
    assert code == 0, (out / "launch_output.txt").read_text()[-3000:]
    resolved = json.loads((out / "resolved_config.json").read_text())
    assert resolved["optim"]["clip_mode"] == mode
    assert resolved["optim"]["max_grad_norm"] == SMALL_CLIP_NORM
    assert resolved["world_size"] == RANKS
    assert [e["value"] for e in _events(out, "opt_gradient_clip_mode")] == [mode]
    assert [e["value"] for e in _events(out, "opt_gradient_clip_norm")] == [SMALL_CLIP_NORM]
    stop = _events(out, "run_stop")
    # The run completed: every step trained, then the stop at max_samples_termination.
    assert [(e["metadata"]["status"], e["metadata"]["epoch_num"]) for e in stop] == [
        ("aborted", STEPS * BATCH_PER_RANK * RANKS)]
    assert "RESULT,bert,7," in (out / "launch_output.txt").read_text()


@pytest.mark.slow
def test_clip_modes_change_training_where_they_clip_differently(demo_runs):
    """With every gradient clipped, the update depends on where: the runs must differ.

    `none` vs `after_allreduce`: clipping at all; `after_allreduce` vs `before_allreduce`:
    clipping the average vs each rank's gradient. (`bucketwise` equals `before_allreduce` when
    DDP makes a single bucket, as it does for this tiny model, so that pair is not compared.)
    """
    loss = {}
    for mode, (code, out) in demo_runs.items():
        assert code == 0, (out / "launch_output.txt").read_text()[-3000:]
        loss[mode] = _events(out, "eval_loss")[-1]["value"]
    assert all(math.isfinite(v) for v in loss.values()), loss
    assert loss["none"] != loss["after_allreduce"], loss
    assert loss["after_allreduce"] != loss["before_allreduce"], loss


# ---------------------------------------------------------------------------------------------
# The shipped configs, through run_and_time.sh's own flag mapping


def _config_from_launcher(config: str, world_size: int, tmp_path: Path) -> TrainConfig:
    """Sources CONFIG, lets run_and_time.sh build the trainer flags, parses them as the trainer does."""
    for folder in ("data", "eval"):
        (tmp_path / folder).mkdir()
    (tmp_path / "bert_config.json").write_text("{}")
    # local_presort insists on a stratified dataset folder; the flags are all this test reads.
    (tmp_path / "data" / "strata.json").write_text(json.dumps(
        {"bounds": [128, 256, 384, 512], "counts": [369, 197, 117, 316], "shares": [0.369, 0.197, 0.117, 0.317]}))
    # A closed-division config must name the phase-1 checkpoint; it is not read here.
    checkpoint = tmp_path / "model.ckpt-28252.pt"
    checkpoint.touch()
    overrides = {"DATADIR_PHASE2": str(tmp_path / "data"), "EVALDIR": str(tmp_path / "eval"),
                 "BERT_CONFIG": str(tmp_path / "bert_config.json"), "INIT_CHECKPOINT": str(checkpoint),
                 "OUTPUT_DIR": str(tmp_path / "out"), "SEED": "1",
                 # multi-node configs launch once per node, told the node's place
                 "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    return parse_config(trainer_flags(REPO / config, overrides), world_size=world_size)


def test_samsung_config_maps_to_adam_bucketwise_open_division(tmp_path):
    cfg = _config_from_launcher("config_SamsungA100_128x8.sh", 1024, tmp_path)
    assert (cfg.optim.optimizer, cfg.optim.epsilon) == ("adam", 1e-9)
    assert (cfg.optim.clip_mode, cfg.optim.max_grad_norm) == ("bucketwise", 1.0)
    assert cfg.run.submission_division == "open"
    assert (cfg.data.balance, cfg.data.deal_order, cfg.data.input_layout) == ("local_presort", "snake", "unpadded")
    assert (cfg.train_batch_size, cfg.global_batch_size) == (16, 16384)
    assert (cfg.optim.learning_rate, cfg.optim.beta1, cfg.optim.beta2) == (0.000393, 0.8004, 0.8175)
    assert cfg.optim.weight_decay_rate == 0.00289
    sched = cfg.schedule
    assert (sched.max_steps, sched.decay_steps, sched.warmup_steps, sched.start_warmup_step) == (299, 179, 82, -16)
    assert (sched.end_learning_rate, sched.decay_from_warmup_end) == (4.945e-5, True)
    assert cfg.eval.eval_iter_samples == cfg.eval.eval_iter_start_samples == 325_000
    assert eval_interval_samples(cfg.global_batch_size) == 325_000
    assert cfg.run.max_samples_termination == 7_000_000
    logged = hyperparameters(cfg)
    assert (logged["opt_gradient_clip_mode"], logged["opt_adamw_epsilon"]) == ("bucketwise", 1e-9)


def test_samsung_schedule_warms_up_from_minus_16_then_holds_the_end_lr(tmp_path):
    """LR values from the schedule's definition, computed here by hand for this config."""
    schedule = lr_schedule(_config_from_launcher("config_SamsungA100_128x8.sh", 1024, tmp_path))
    base, end = 0.000393, 4.945e-5
    assert schedule.lr_at(0) == pytest.approx(base * 16 / 82)  # warm-up already 16 steps in
    assert schedule.lr_at(65) == pytest.approx(base * 81 / 82)  # last warm-up step
    assert schedule.lr_at(82) == pytest.approx(base)  # decay progress counts from step 82
    assert schedule.lr_at(130) == pytest.approx(end + (base - end) * (179 - 130) / (179 - 82))
    assert schedule.lr_at(179) == schedule.lr_at(298) == pytest.approx(end)


@dataclass(frozen=True)
class Published:
    """One row of REFERENCE.md's "Published configurations" table (NVIDIA; LAMB, eps 1e-6, clip 1.0)."""

    world: int
    per_gpu: int  # sequences, or packs when packed
    gbs: int
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    steps: int
    warmup: tuple[int, int]  # (warm-up steps, start step)
    interval: int
    layout: str
    balance: str
    clip: str
    cuda_graphs: bool
    precision: str = "bf16"  # NVIDIA's FP8 from H100 on is not copied: see PUBLISHED's comment
    sharded: bool = False  # NVIDIA's DistributedFusedLAMB at scale (here --distributed_optimizer)


# H100 to GB200: NVIDIA trained the encoder's GEMMs in FP8 (TransformerEngine); these configs train bf16, the
# one setting they do not take from NVIDIA: FP8 ships only where it measured faster than bf16 on the GPU, and
# torchao's measured 0.91x of bf16 on one H200 (docs/PERFORMANCE.md).
PUBLISHED = {
    "config_DGXA100_1x8.sh": Published(8, 56, 448, 0.000425, (0.9, 0.999), 0.01, 6700, (0, 0), 150_000,
                                       "unpadded", "global_presort", "before_allreduce", False),
    "config_DGXA100_128x8.sh": Published(1024, 2, 4096, 0.00255, (0.71, 0.88), 0.0166629, 820, (256, -76), 175_000,
                                         "packed", "none", "after_allreduce", True, sharded=True),
    "config_DGXH100_1x8.sh": Published(8, 48, 768, 0.00096, (0.60466, 0.85437), 0.1, 3680, (0, 0), 150_000,
                                       "packed", "none", "before_allreduce", True),
    "config_DGXH200_1x8.sh": Published(8, 48, 768, 0.00096, (0.60466, 0.85437), 0.1, 3680, (0, 0), 150_000,
                                       "packed", "none", "before_allreduce", True),
    "config_DGXB200_1x8.sh": Published(8, 48, 768, 0.00096, (0.60466, 0.85437), 0.1, 3680, (0, 0), 150_000,
                                       "packed", "none", "before_allreduce", True),
    "config_GB200_2x4.sh": Published(8, 48, 768, 0.00096, (0.60466, 0.85437), 0.1, 3680, (0, 0), 150_000,
                                     "packed", "none", "before_allreduce", True),
}


@pytest.mark.parametrize("config", sorted(PUBLISHED))
def test_nvidia_configs_give_the_published_hyperparameters(tmp_path, config):
    want = PUBLISHED[config]
    cfg = _config_from_launcher(config, want.world, tmp_path)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps, cfg.global_batch_size) == (want.per_gpu, 1, want.gbs)
    assert (cfg.optim.optimizer, cfg.optim.epsilon, cfg.run.submission_division) == ("lamb", 1e-6, "closed")
    assert (cfg.optim.learning_rate, (cfg.optim.beta1, cfg.optim.beta2)) == (want.lr, want.betas)
    assert cfg.optim.weight_decay_rate == want.weight_decay
    sched = cfg.schedule
    assert (sched.max_steps, (sched.warmup_steps, sched.start_warmup_step)) == (want.steps, want.warmup)
    assert (cfg.optim.clip_mode, cfg.optim.max_grad_norm) == (want.clip, 1.0)
    assert (cfg.data.input_layout, cfg.data.balance) == (want.layout, want.balance)
    assert cfg.eval.eval_iter_samples == cfg.eval.eval_iter_start_samples == want.interval
    assert eval_interval_samples(cfg.global_batch_size) == want.interval
    assert (cfg.run.precision, cfg.run.cuda_graphs) == (want.precision, want.cuda_graphs)
    assert cfg.optim.distributed == want.sharded


# ---------------------------------------------------------------------------------------------
# The study script (benchmarks/clip_study.py)


def test_study_table_counts_every_run_but_averages_only_those_reaching_the_target():
    runs = [RunOutcome("bucketwise", seed, 1.0, status, samples, accuracy, 500.0) for seed, status, samples, accuracy in
            [(1, "success", 6400, 0.73), (2, "success", 8000, 0.72), (3, "aborted", 64000, 0.70)]]
    cells = [cell.strip() for cell in summary_table(runs, ["bucketwise"])[2].split("|")[1:-1]]
    assert cells[:5] == ["bucketwise", "2 / 3", "7,200", "1,131", "6,400 / 8,000"]  # std of (6400, 8000)
    assert cells[5] == f"{(0.73 + 0.72 + 0.70) / 3:.4f}"


def test_study_pairs_modes_by_seed_and_skips_seeds_where_either_missed_the_target():
    samples = {("after_allreduce", 1): 8000, ("after_allreduce", 2): 7000, ("after_allreduce", 3): 9000,
               ("bucketwise", 1): 7000, ("bucketwise", 2): 7000, ("bucketwise", 3): 64000}
    runs = [RunOutcome(mode, seed, 1.0, "aborted" if n == 64000 else "success", n, 0.72, 1.0)
            for (mode, seed), n in samples.items()]
    cells = [cell.strip() for cell in paired_table(runs, ["after_allreduce", "bucketwise"], "after_allreduce")[2]
             .split("|")[1:-1]]
    # Seeds 1 and 2 only: deltas -1000 and 0.
    assert cells == ["bucketwise", "2", "-500", "707", "500", "1 / 1 / 0"]


def test_study_rewrites_only_its_own_section(tmp_path):
    doc = tmp_path / "study.md"
    doc.write_text("# Study\n\nreading written by hand\n")
    write_section(doc, "clip_study", "table 1")
    write_section(doc, "clip_study", "table 2")
    write_section(doc, "clip_activity", "activity")
    assert doc.read_text() == ("# Study\n\nreading written by hand\n<!-- clip_study:begin -->\ntable 2\n"
                               "<!-- clip_study:end -->\n<!-- clip_activity:begin -->\nactivity\n"
                               "<!-- clip_activity:end -->\n")


@pytest.mark.benchmark
def test_clip_study_trains_the_demo_and_writes_its_table(tmp_path):
    """Two real demo runs (minutes): `pytest -m benchmark tests/system/test_clip_modes_training.py`."""
    data = tmp_path / "demo_data"
    made = subprocess.run(["bash", "tools/run_demo.sh", "--data-only"], cwd=REPO,
                          env={**launch_env(), "DEMO_DATA": str(data), "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]
    out = tmp_path / "study.md"
    command = [sys.executable, "benchmarks/clip_study.py", "--seeds", "1", "--modes", "none", "bucketwise",
               "--demo_data", str(data), "--runs_dir", str(tmp_path / "runs"), "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = [json.loads(line) for line in (tmp_path / "runs" / "runs.jsonl").read_text().splitlines()]
    assert [(r["mode"], r["status"]) for r in runs] == [("none", "success"), ("bucketwise", "success")]
    table = out.read_text()
    assert "| none | 1 / 1 |" in table and "| bucketwise | 1 / 1 |" in table
