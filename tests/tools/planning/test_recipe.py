"""tools/recipe.py: its RCP statuses against the official RCP checker for 1 to 512 devices, its
memory split, the hyperparameter set it borrows, and the config it writes (NVIDIA's 8-GPU choice,
the trainer's closed-division rules)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlperf_tools.planning import recipe
from mlperf_bert.config.cli import parse_config
from mlperf_bert.config.closed_division import closed_division_problem
from mlperf_tools.results.package_results import config_global_batch_size, read_config
from mlperf_tools.results.scoring import ABOVE, BELOW, COVERED, INTERPOLATED
from tests.harness.demo import config_exports
from tests.harness.paths import REPO
from tests.harness.rcp_results import official_verdict, synthetic_result

RULESET = "5.0.0"
# What the official checker answers for a result at each status (converging like the RCP mean).
OFFICIAL = {COVERED: (True, "RCP found"), INTERPOLATED: (True, "RCP Interpolation"),
            BELOW: (True, "RCP not found but slower convergence on smaller batch size"),
            ABOVE: (False, "Missing RCP, please submit RCP with BS = {gbs}")}


@pytest.fixture(scope="module")
def sets() -> list[recipe.HyperparameterSet]:
    return recipe.rcp_sets(RULESET) + recipe.config_sets(sorted(REPO.glob("config_*.sh")))


def _write(tmp_path: Path, *args: str) -> tuple[Path, dict[str, str]]:
    path = tmp_path / "configs" / "config_T.sh"  # a folder made by --write (was a FileNotFoundError traceback)
    assert recipe.main([*args, "--write", str(path)]) == 0
    return path, config_exports(path)


@pytest.mark.parametrize("devices", [1, 2, 6, 8, 64, 512])
def test_every_status_and_the_written_choice_are_what_the_official_checker_says(tmp_path, sets, devices):
    found = recipe.candidates(devices, 80.0, RULESET, sets)
    one_of_each = {c.window.coverage: c for c in found}
    assert {COVERED, INTERPOLATED, ABOVE} <= set(one_of_each)
    for coverage, candidate in one_of_each.items():
        gbs = candidate.global_batch_size
        mean = round(candidate.window.rcp_mean or 2_500_000)
        verdict = official_verdict(synthetic_result(tmp_path / f"{gbs}" / "bert", mean, gbs))
        passed, words = OFFICIAL[coverage]
        assert verdict == (passed, words.format(gbs=gbs)), (devices, gbs, candidate.status)
    # the written config's batch size, with its runs at the printed minimum and just under it
    path, exports = _write(tmp_path, "--gpus", str(devices), "--memory_gb", "80")
    gbs, _ = config_global_batch_size(read_config(path), path)
    chosen = recipe.choose(found, 4)
    assert chosen is not None and gbs == chosen.global_batch_size
    assert int(exports["BATCHSIZE"]) >= 4 and chosen.window.coverage in (COVERED, INTERPOLATED)
    bound = round(chosen.window.min_mean or 0)
    assert official_verdict(synthetic_result(tmp_path / "at" / "bert", bound + 1, gbs))[0] is True
    assert official_verdict(synthetic_result(tmp_path / "under" / "bert", bound - 1, gbs))[0] is False


def test_eight_a100s_get_nvidias_published_config(tmp_path):
    _, written = _write(tmp_path, "--gpus", "8", "--device", "A100")
    nvidia = config_exports(REPO / "config_DGXA100_1x8.sh")
    same = ("DGXNNODES", "DGXNGPU", "BATCHSIZE", "GRADIENT_STEPS", "LR", "MAX_STEPS", "WARMUP_STEPS",
            "START_WARMUP_STEP", "OPT_LAMB_BETA_1", "OPT_LAMB_BETA_2", "WEIGHT_DECAY_RATE", "OPT_EPSILON",
            "EVAL_ITER_START_SAMPLES", "EVAL_ITER_SAMPLES", "MAX_SAMPLES_TERMINATION", "TARGET_MLM_ACCURACY")
    assert {k: float(written[k]) for k in same} == {k: float(nvidia[k]) for k in same}
    assert set(nvidia) <= set(written)  # every variable NVIDIA's file sets
    assert written["DGXSYSTEM"] == "T"
    # Every other variable as NVIDIA's file sets it, the set-up (compile mode, eval graph, NCCL check) included;
    # the recipe's own choices: the system's name, the clip mode it borrows with the set, epsilon's spelling.
    differ = {k for k in nvidia if written[k] != nvidia[k]}
    assert differ <= {"DGXSYSTEM", "SUBMISSION_PLATFORM", "CLIP_MODE", "OPT_EPSILON"}, differ
    assert {"COMPILE_MODE", "EVAL_CUDA_GRAPH", "NCCL_TEST_MIN_BUSBW_GBPS"} <= set(nvidia)


def test_set_up_comes_from_the_nearest_shipped_system() -> None:
    """1,024 A100s take the 128x8 config's sharded optimizer and its shard groups; a count that cannot split into
    groups of 8 (1,004), so every rank shares the state; 8 of an unknown device take the nearest device count's."""
    configs = sorted(REPO.glob("config_*.sh"))
    path, env = recipe.nearest_system(configs, "A100", 1024)
    assert path.name == "config_DGXA100_128x8.sh"
    setup = recipe.setup_exports(env, {"BATCHSIZE"}, 1024)
    assert setup["DIST_OPTIMIZER"] == "1" and setup["DIST_OPTIMIZER_GROUP_SIZE"] == "8"
    assert not set(recipe.NOT_SETUP) & set(setup) and "BATCHSIZE" not in setup
    assert "DIST_OPTIMIZER_GROUP_SIZE" not in recipe.setup_exports(env, set(), 1004)
    assert recipe.nearest_system(configs, "A100", 16)[0].name == "config_DGXA100_1x8.sh"
    assert recipe.shipped_device(recipe.nearest_system(configs, "MI300X", 8)[1]) != "MI300X"


def test_a_size_above_every_rcp_is_written_when_asked_with_its_status_and_a_limit_at_the_schedules_end(tmp_path, capsys):
    path, exports = _write(tmp_path, "--gpus", "8", "--memory_gb", "80", "--gbs", "16392")
    assert re.search(r"^\*\s+16392\s.*\smissing\s", capsys.readouterr().out, re.M)  # the chosen row
    assert "# RCP (training 5.0.0, bert): GBS 16392 is above every RCP" in path.read_text()
    schedule_end = int(exports["MAX_STEPS"]) * 16392
    assert schedule_end <= int(exports["MAX_SAMPLES_TERMINATION"]) < schedule_end + 100_000


def _trainer_flags(exports: dict[str, str], tmp_path: Path) -> list[str]:
    """The flags run_and_time.sh makes of these variables (its own table)."""
    table = re.findall(r'^\s+"(\w+) (--\w+)( switch)?"', (REPO / "run_and_time.sh").read_text(), re.M)
    flags = ["--input_dir", str(tmp_path), "--eval_dir", str(tmp_path), "--bert_config_path", str(tmp_path / "b.json"),
             "--output_dir", str(tmp_path / "out"), "--do_train", "--init_checkpoint", str(tmp_path / "phase1.pt")]
    for name, flag, switch in table:
        if name in exports and not switch:
            flags += [flag, exports[name]]
        elif name in exports and exports[name] == "1":
            flags.append(flag)
    return flags


@pytest.mark.parametrize("devices,memory", [(1, "24"), (6, "80")])
def test_a_written_config_keeps_the_closed_division_rules(tmp_path, devices, memory):
    _, exports = _write(tmp_path, "--gpus", str(devices), "--memory_gb", memory)
    cfg = parse_config(_trainer_flags(exports, tmp_path), devices)
    assert closed_division_problem(cfg) is None
    assert cfg.global_batch_size == int(exports["BATCHSIZE"]) * devices


def test_the_fewest_accumulation_steps_that_fit_the_memory():
    limit = recipe.max_micro_batch(24.0)
    assert recipe.device_memory_gb(limit) <= 24.0 * recipe.USABLE_FRACTION < recipe.device_memory_gb(limit + 1)
    steps = recipe.accumulation_steps(448, limit)  # one 24 GB device at GBS 448
    assert 448 % steps == 0 and 448 // steps <= limit
    assert all(448 // fewer > limit for fewer in range(1, steps) if 448 % fewer == 0)
    assert steps == 14  # 32 sequences a micro-batch


def test_a_set_is_borrowed_from_its_own_batch_size_else_the_nearest(sets):
    assert recipe.borrowable(448, sets).source == "RCP bert_ref_448"
    assert recipe.borrowable(768, sets).source == "config_DGXB200_1x8.sh"  # NVIDIA's 768 set, the shipped configs'
    assert recipe.borrowable(2048, sets).global_batch_size == 1536  # nearer than 3072 in ratio


@pytest.mark.parametrize("args,message", [
    (["--gpus", "0", "--memory_gb", "80"], "--gpus 0: give the number of accelerators"),
    (["--gpus", "8"], "give --memory_gb M or --device NAME"),
    (["--gpus", "8", "--device", "MI300X"], "--device MI300X: its memory is not known here; pass --memory_gb"),
    (["--gpus", "8", "--memory_gb", "80", "--gbs", "100"], "--gbs 100: a global batch size must be a multiple of"),
    (["--gpus", "8", "--memory_gb", "8"], "--memory_gb 8: one device needs 7.9 GB for a single sequence"),
    (["--gpus", "8", "--memory_gb", "80", "--write", "x.sh"], "--write x.sh: name the file config_<SYSTEM>.sh"),
    (["--gpus", "8", "--memory_gb", "80", "--write", "configs/x.sh"],
     "--write configs/x.sh: name the file config_<SYSTEM>.sh"),  # no folder made for a name it refuses
    (["--gpus", "8", "--memory_gb", "80", "--write", "config_X_1x8.sh/config_X_1x8.sh"],
     "--write config_X_1x8.sh/config_X_1x8.sh: cannot make its folder config_X_1x8.sh (File exists)"),
    (["--gpus", "6", "--memory_gb", "80", "--gpus_per_node", "4", "--write", "config_A.sh"],
     "--gpus_per_node 4: 6 devices do not split into nodes of 4")])
def test_errors_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config_X_1x8.sh").write_text("")  # a file where --write wants a folder
    assert recipe.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1 and [p.name for p in tmp_path.iterdir()] == [
        "config_X_1x8.sh"], err


def test_the_script_runs_from_the_command_line():
    done = subprocess.run([sys.executable, str(REPO / "tools" / "recipe.py"), "--gpus", "8", "--device", "H100"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "choice: GBS 448 = 56 sequences" in done.stdout, done.stderr


# ---------------------------------------------------------------------------------------------
# Boundaries and hand computations


@pytest.mark.parametrize("memory_gb, micro", [(80.0, 146), (141.0, 271), (40.0, 64), (24.0, 32), (23.0, 30),
                                              (9.8, 3), (8.8, 0)])
def test_micro_batch_that_fits_by_hand(memory_gb, micro):
    """floor((0.9 M - 7.5) / 0.44): 80 GB -> 64.5 / 0.44 = 146.6; exactly at the limit, 23 GB holds 30 (0.9 x 23 =
    20.7 GB = 7.5 + 30 x 0.44) and 9.8 GB holds 3 (8.82 GB); 8.8 GB (7.92 usable) not one (7.94)."""
    assert recipe.max_micro_batch(memory_gb) == micro


@pytest.mark.parametrize("per_device, limit, steps", [(32, 32, 1), (64, 32, 2), (75, 32, 3), (61, 32, 61),
                                                      (448, 146, 4), (56, 14, 4)])
def test_fewest_accumulation_steps_by_hand(per_device, limit, steps):
    """75 sequences in micro-batches of at most 32: 3 of 25 (75 / 2 is not whole); 61 (prime) only 61 of 1; a
    per-device batch exactly at the limit needs no accumulation."""
    assert recipe.accumulation_steps(per_device, limit) == steps


def test_candidate_sizes_on_device_counts_that_do_not_divide_the_rcp_points():
    """6 devices: every size a multiple of 6, on both sides of each table point (444 and 450 around 448, the
    latter also the first past the largest point) and the smallest with 4 sequences a device (24); 7 devices: 448 is
    a multiple (64 x 7), 16,387 is past 16,384."""
    assert recipe.candidate_sizes(6, [448], 4) == [24, 444, 450]
    sizes = recipe.candidate_sizes(7, [256, 448, 16384], 4)
    assert sizes == [28, 252, 259, 448, 16380, 16387] and all(size % 7 == 0 for size in sizes)
    for devices in (6, 7, 12, 100):
        found = recipe.candidate_sizes(devices, [256, 448, 1536, 3072, 4096, 4608, 16384], 4)
        assert all(size % devices == 0 for size in found), devices


def test_a_device_batch_exactly_at_the_minimum_is_allowed(sets):
    """112 devices at GBS 448 (the fastest RCP point): exactly 4 sequences each, which --min_device_batch 4 allows;
    with 5 it is ruled out."""
    found = recipe.candidates(112, 80.0, RULESET, sets)
    chosen = recipe.choose(found, 4)
    assert chosen is not None and (chosen.global_batch_size, chosen.per_device) == (448, 4)
    stricter = recipe.choose(found, 5)
    assert stricter is not None and stricter.per_device >= 5 and stricter.global_batch_size != 448


def test_a_written_config_over_nodes_of_four_holds_its_own_arithmetic(tmp_path, capsys):
    """12 devices of 24 GB, 4 a node: 3 nodes, GBS 456 (448, the fastest point, is no multiple of 12): 38 a device
    in 2 micro-batches of 19 (at most 32 fit). The header's arithmetic, memory line and limit agree with the
    variables, by hand (micro x accumulation x 12 = GBS, 7.5 + 0.44 x micro GB, ceil(1.85 x RCP mean / 100,000)
    hundred thousand samples)."""
    path, exports = _write(tmp_path, "--gpus", "12", "--memory_gb", "24", "--gpus_per_node", "4")
    gbs, _ = config_global_batch_size(read_config(path), path)
    per_device, steps = int(exports["BATCHSIZE"]), int(exports["GRADIENT_STEPS"])
    micro = per_device // steps
    assert (exports["DGXNNODES"], exports["DGXNGPU"], gbs, per_device, steps) == ("3", "4", 456, 38, 2)
    text = path.read_text()
    assert f"# Batch arithmetic: {micro} sequences/GPU x {steps} accumulation step(s) x 12 GPUs = {gbs} global " \
           f"batch (BATCHSIZE {per_device} per GPU and optimizer step)." in text
    assert "# Memory estimate per GPU: 15.9 GB of 24 GB" in text  # 7.5 + 0.44 x 19
    from mlperf_tools.results.scoring import rcp_window

    window = rcp_window(gbs, RULESET)
    assert window.rcp_mean is not None
    assert int(exports["MAX_SAMPLES_TERMINATION"]) == math.ceil(1.85 * window.rcp_mean / 100_000) * 100_000
