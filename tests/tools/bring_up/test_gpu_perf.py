"""tools/gpu_perf.sh, the prepared GPU measurement, as a user starts it (its CPU smoke mode runs every step it
has), its table of variants, and tools/gpu_perf_report.py's figures (throughput.py's --config_var:
tests/benchmarks/test_config_benchmark.py)."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from mlperf_tools.bring_up import gpu_perf_report
from tests.harness.commands import load_script, run_cli
from tests.harness.paths import REPO

H200 = REPO / "config_DGXH200_1x8.sh"
SCRIPT = REPO / "tools" / "gpu_perf.sh"


@pytest.fixture(scope="module")
def bench():
    return load_script(REPO / "benchmarks" / "throughput.py", "throughput_gpu_perf")


@pytest.fixture(scope="module")
def report():
    return gpu_perf_report


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("gpu_perf")
    done = run_cli(["bash", str(SCRIPT), str(out)], env={"SMOKE": "1", "PYTHON": sys.executable}, timeout=300)
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 0, summary + done.stderr
    return out, summary


def _row(summary: str, name: str) -> str:
    return next(line for line in summary.splitlines() if line.startswith(name))


def variants_table() -> list[tuple[str, dict[str, str]]]:
    """The `label|NAME=VALUE ...` rows of gpu_perf.sh's variants table."""
    block = re.search(r"^variants=\(\n(.*?)^\)", SCRIPT.read_text(), re.S | re.M)
    assert block, "gpu_perf.sh has no variants=( ... ) table"
    rows = [line.strip().strip('"') for line in block.group(1).splitlines() if line.strip()]
    return [(label, dict(v.split("=", 1) for v in given.split())) for label, given in (r.split("|") for r in rows)]


def test_smoke_mode_runs_every_step_and_writes_one_folder(smoke):
    out, summary = smoke
    lines = summary.splitlines()
    assert lines[0].startswith("gpu-perf ") and "CPU smoke mode" in lines[0]
    assert "config: config_DGXH200_1x8.sh at toy sizes, COMPILE_MODE=none" in lines
    for name in ("shipped config_DGXH200_1x8.sh", "variant fp8 delayed ", "packed-hf bf16", "trainer data",
                 "trainer ", "trainer vs benchmark"):
        assert " passed " in _row(summary, name), _row(summary, name)
    assert lines[-1].startswith("gpu-perf: passed (6 steps ran)"), lines[-1]
    assert "    top kernels (self time): " in summary
    assert re.search(r"^    packed/fp8 \[COMPILE_MODE=none, PRECISION=fp8, FP8_RECIPE=delayed\]: [\d.]+ ms/step, .*x the "
                     r"shipped step's time$", summary, re.M), summary
    assert re.search(r"trainer [\d.]+ samples/s, [\d.]+ ms/step over steps 2-8 .* benchmark packed/bf16 "
                     r"\[COMPILE_MODE=none\] [\d.]+ ms/step .* trainer/benchmark step time [\d.]+$", summary, re.M)
    # the device tool brings back 8 files: everything is in these
    # (compiled_*.json only beside a GPU's steps: the smoke mode says so in a line)
    assert sorted(p.name for p in out.iterdir()) == ["gpu_perf.log", "kernels.txt", "kernels_fp8_delayed.txt",
                                                     "summary.txt", "throughput.json", "trainer.json"]
    assert _row(summary, "compiled reports").endswith("skipped: the smoke mode (tests/trainer/dryrun/test_compiled_step.py runs the "
                                                       "command)")
    assert "kernels_fp8_delayed.txt: the top 30" in summary
    assert "=== trainer: bash -c" in (out / "gpu_perf.log").read_text()


def test_smoke_mode_skips_what_this_tree_or_device_lacks_with_a_line_each(smoke):
    _, summary = smoke
    launcher = (REPO / "run_and_time.sh").read_text()
    for label, given in variants_table():
        row = _row(summary, f"variant {label} ")
        unknown = [name for name in given if not re.search(rf"\b{name}\b", launcher)]
        if unknown:
            assert f"skipped: run_and_time.sh does not read {unknown[0]} yet" in row, row
        elif given.get("PRECISION") == "fp16":  # autocast in fp16 is a GPU's
            assert row.endswith("skipped: fp16 is not supported on this device"), row
        elif given.get("ATTENTION_BACKEND", "").startswith("varlen"):  # GPU kernels: cuDNN's beside the shipped FA2
            assert row.endswith(f"skipped: {given['ATTENTION_BACKEND']} runs GPU kernels only"), row
        elif label == "bf16":  # the H200 config trains in bf16: this variant is its shipped step
            assert row.endswith("skipped: config_DGXH200_1x8.sh already has PRECISION=bf16 (the shipped step)"), row
        elif label != "fp8 delayed":
            assert row.endswith("skipped: the smoke mode times one variant (fp8 delayed)"), row


def test_an_override_changes_the_timed_set_up_and_is_recorded(smoke):
    out, _ = smoke
    runs = json.loads((out / "throughput.json").read_text())
    assert set(runs) == {"shipped", "variant_fp8_delayed", "packed_vs_hf"}
    shipped, fp8 = runs["shipped"], runs["variant_fp8_delayed"]
    assert shipped["results"][0]["precision"] == "bf16" and shipped["config_vars"] == {"COMPILE_MODE": "none"}
    assert fp8["precisions"] == ["fp8"] and fp8["from_config"].endswith("config_DGXH200_1x8.sh")
    assert fp8["config_vars"] == fp8["results"][0]["config_vars"] == {"COMPILE_MODE": "none", "PRECISION": "fp8",
                                                                       "FP8_RECIPE": "delayed"}
    assert fp8["fp8"] == {"scaling": "delayed", "layers": "encoder"}
    assert {r["layout"] for r in runs["packed_vs_hf"]["results"]} == {"packed", "hf_padded"}
    trainer = json.loads((out / "trainer.json").read_text())
    assert trainer["trainer"]["last_step"] - trainer["trainer"]["first_step"] == 6
    assert trainer["benchmark"]["label"] == "packed/bf16 [COMPILE_MODE=none]"
    assert trainer["trainer_over_benchmark_step_time"] > 0


def test_a_run_where_no_step_ran_is_not_a_pass(tmp_path):
    """BUDGET_S too small for any step; on the A100 config, which trains in bf16, the bf16 variant is its step."""
    done = run_cli(["bash", str(SCRIPT), str(tmp_path)], env={"SMOKE": "1", "PYTHON": sys.executable, "BUDGET_S": "5",
                                                             "CONFIG": "config_DGXA100_1x8.sh"})
    lines = (tmp_path / "summary.txt").read_text().splitlines()
    assert done.returncode == 1, lines
    assert "shipped config_DGXA100_1x8.sh skipped: budget spent" in lines
    assert ("variant bf16               skipped: config_DGXA100_1x8.sh already has PRECISION=bf16 (the shipped step)"
            in lines)
    # 15 s of its own, 30 kept for what follows and 13 it may take past its limit (budget_steps.sh's STEP_OVER_S)
    assert re.fullmatch(r"variant fp8 delayed +skipped: \d s left of the budget, needs 58 s \(30 s kept for "
                        r"packed-hf and the trainer\)", _row("\n".join(lines), "variant fp8 delayed "))
    assert lines[-1].startswith("gpu-perf: FAILED: no step ran")


@pytest.mark.parametrize(("env", "line"), [
    ({"BUDGET_S": "8min"}, "gpu_perf.sh: BUDGET_S=8min is not a whole number of seconds (e.g. BUDGET_S=470)"),
    ({"VARIANTS": "bf16,fp4"}, "gpu_perf.sh: VARIANTS: no variant 'fp4'; choose from: bf16, fp8 delayed"),
])
def test_usage_errors_are_one_line_and_exit_2(tmp_path, env, line):
    done = run_cli(["bash", str(SCRIPT), str(tmp_path)], env={"SMOKE": "1", "PYTHON": sys.executable, **env})
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith(line), done.stderr


EARLIER = {"summary.txt": "gpu-perf: passed (6 steps ran)\n", "gpu_perf.log": "last week's log\n",
           "throughput.json": "{}\n", "trainer.json": "{}\n", "kernels.txt": "flash_bprop 9.95%\n"}


def _earlier_measurement(folder: Path, names=EARLIER) -> Path:
    folder.mkdir(exist_ok=True)
    for name in names:
        (folder / name).write_text(EARLIER[name])
    return folder


@pytest.mark.parametrize(("env", "line"), [
    ({"SMOKE": "1", "CONFIG": "config_DGXH300_1x8.sh"},
     "gpu_perf.sh: CONFIG=config_DGXH300_1x8.sh: no such file; give a config_<SYSTEM>.sh of the repository"),
    ({"SMOKE": "0"}, f"gpu_perf.sh: no CUDA device visible to {sys.executable}; SMOKE=1 runs the CPU smoke mode"),
    ({"SMOKE": "1", "VARIANTS": "fp4"}, "gpu_perf.sh: VARIANTS: no variant 'fp4'"),
    ({"SMOKE": "1"}, "gpu_perf.sh: {out} holds an earlier run (summary.txt gpu_perf.log throughput.json trainer.json "
                     "kernels.txt); give a new folder (bash tools/gpu_perf.sh DIR), or move that one away"),
])
def test_an_earlier_measurement_is_left_as_it_was(tmp_path, env, line):
    """A typo, a machine without a GPU, or last week's folder: one line, exit 2, and the earlier files untouched."""
    out = _earlier_measurement(tmp_path / "last_week")
    done = run_cli(["bash", str(SCRIPT), str(out)], env={"PYTHON": sys.executable, **env})
    assert done.returncode == 2 and not done.stdout, done.stdout + done.stderr
    assert done.stderr.splitlines()[0].startswith(line.format(out=out)) and len(done.stderr.splitlines()) == 1
    assert {p.name: p.read_text() for p in out.iterdir()} == EARLIER


def test_one_file_of_an_earlier_run_is_enough_to_refuse_the_folder(tmp_path):
    out = _earlier_measurement(tmp_path / "cut_short", ["throughput.json"])
    done = run_cli(["bash", str(SCRIPT), str(out)], env={"SMOKE": "1", "PYTHON": sys.executable})
    assert done.returncode == 2 and "holds an earlier run (throughput.json)" in done.stderr, done.stderr
    assert [p.name for p in out.iterdir()] == ["throughput.json"]


def _recording_timeout(bin_dir: Path, log: Path) -> None:
    """A `timeout` first on PATH that records when it started, the seconds to SIGTERM and on to SIGKILL and the
    command, and runs the command without a limit."""
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "timeout").write_text(f"""#!/bin/bash
kill=${{1#--kill-after=}} term=$2
shift 2
echo "$(date +%s.%N) $term $kill $*" >> {log}
exec "$@"
""")
    (bin_dir / "timeout").chmod(0o755)


def _timed(log: Path) -> list[tuple[float, int, int, str]]:
    """(started, seconds to SIGTERM, seconds to SIGKILL after it, command) of each step."""
    rows = [line.split(" ", 3) for line in log.read_text().splitlines()]
    return [(float(t), int(term), int(kill), command) for t, term, kill, command in rows]


def test_budget_steps_at_exactly_their_limit(tmp_path):
    """tools/budget_steps.sh with the clock stubbed (budget_left says $LEFT): a step that needs N s fits with N s
    left and not with N - 1; a step runs with 15 s left and not with 14; its limit is the budget left below it."""
    _recording_timeout(tmp_path / "bin", tmp_path / "timed.log")
    script = f"""
here={REPO} summary={tmp_path}/summary.txt log={tmp_path}/log work={tmp_path}
source tools/budget_steps.sh
budget_left() {{ echo "$LEFT"; }}
LEFT=60; fits "fits at 60" 60 && echo "fits at 60"
LEFT=59; fits "short by 1" 60 "why" || echo "short by 1"
LEFT=15; step "runs at 15" 30 true
LEFT=14; step "skipped at 14" 30 true
LEFT=30; step "limit at 30" 30 true
LEFT=31; step "limit under 31" 30 true
LEFT=29; step "limit over 29" 30 true
echo "ran $ran_steps"
"""
    done = run_cli(["bash", "-c", script], env={"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0] == "fits at 60" and out[-1] == "ran 4", out
    assert re.fullmatch(r"short by 1 +skipped: 59 s left of the budget, needs 60 s \(why\)", out[1]), out
    assert "short by 1" in out and re.fullmatch(r"skipped at 14 +skipped: budget spent", out[4]), out
    assert [term for _, term, _, _ in _timed(tmp_path / "timed.log")] == [15, 30, 30, 29]


@pytest.mark.parametrize("budget", [330, 230])
def test_every_variant_leaves_the_reserve_for_packed_hf_and_the_trainer(tmp_path, budget):
    """The GPU sequence with every step instant (a fake GPU python; the timeout only records): each variant may run
    to its SIGKILL and still leave packed-hf's and the trainer's 190 s; packed-hf leaves the trainer's 110 s where
    both fit. At 330 s every variant runs; at 230 s none fits, and packed-hf is the step that must keep time."""
    _recording_timeout(tmp_path / "bin", tmp_path / "timed.log")
    python = tmp_path / "bin" / "python"
    python.write_text(f"""#!/bin/bash
case "$1" in
  -c) echo "NVIDIA H200" ;;
  -) echo "python 3.12.3, torch 2.13.0, CUDA 12.9, device NVIDIA H200, compute capability 9.0; torchao yes"
     echo "precisions: fp32 bf16 fp16 fp8" ;;
  */gpu_perf_report.py) exec {sys.executable} "$@" ;;
esac
""")
    python.chmod(0o755)
    start = time.time()
    done = run_cli(["bash", str(SCRIPT), str(tmp_path / "out")],
                   env={"PYTHON": str(python), "BUDGET_S": str(budget), "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})
    summary = (tmp_path / "out" / "summary.txt").read_text()
    timed = {re.search(r"tp_(\w+)\.json", command).group(1): (t, term, kill) for t, term, kill, command in
             _timed(tmp_path / "timed.log") if "benchmarks/throughput.py" in command}
    variants = [name for name in timed if name.startswith("variant_")]
    shipped = [label for label, given in variants_table() if given == {"PRECISION": "bf16"}]  # the config's own step
    every = len(variants_table()) - len(shipped)
    assert len(variants) == (every if budget == 330 else 0) and "packed_vs_hf" in timed, summary + done.stderr
    for name, reserve in [*((v, 80 + 110) for v in variants), ("packed_vs_hf", 110)]:
        started, term, kill = timed[name]
        left = budget - (started - start) + 1  # the script's clock counts whole seconds from after `start`
        assert term + kill <= left - reserve, (name, term, kill, left, summary)
    assert re.search(r"^trainer +FAILED", summary, re.M), summary  # it ran (on data the fake python never made)


def test_every_variant_the_launcher_reads_is_accepted_by_the_trainer(bench):
    """A variant is a line of the table: a misspelt value would show only on a GPU, so each one the launcher
    knows goes through run_and_time.sh and the trainer's parser here."""
    launcher = (REPO / "run_and_time.sh").read_text()
    checked = 0
    for label, given in variants_table():
        if all(re.search(rf"\b{name}\b", launcher) for name in given):
            train = bench.config_setup(H200, given).train
            assert train.run.precision == given.get("PRECISION", "bf16"), label
            assert train.run.compile_mode == given.get("COMPILE_MODE", "default"), label
            assert train.run.fp8_recipe == given.get("FP8_RECIPE"), label
            assert train.run.fp8_layers == given.get("FP8_LAYERS"), label
            assert train.model.attention_backend == given.get("ATTENTION_BACKEND", "auto"), label
            checked += 1
    assert checked == len(variants_table())  # the launcher reads every variable of the table


# ---------------------------------------------------------------- tools/gpu_perf_report.py

def _progress(step: int, samples: int, rate: float) -> str:
    return (f"2026-11-27T10:00:00 step {step} samples {samples}/4800 samples/s {rate} tokens/s 1 loss 7.0 lr 1e-3 "
            f"skipped 0 next_eval 150000 eta_eval 0:01:00 evals none")


def test_trainer_rate_is_taken_between_progress_lines_after_the_warm_up(report):
    """Steps 1-10 take 20 s (compile), then 0.2 s a step at 96 samples a step: each line's rate counts from
    run_start, the interval's rate from the lines alone."""
    seconds = {10: 20.0, 20: 22.0, 30: 24.0, 40: 26.0}
    lines = ["run started at step 0 samples 0; sample limit 4800, global batch 96"]
    lines += [_progress(step, 96 * step, round(96 * step / t, 1)) for step, t in seconds.items()]
    lines += ["eval 1 step 40 samples 3840 mlm_accuracy 0.1", _progress(50, 4800, 9999.0)]  # after an eval: left out
    rate = report.trainer_rate("\n".join(lines), warmup=10, min_steps=30)
    assert (rate.first_step, rate.last_step, rate.samples_per_step) == (10, 40, 96)
    assert rate.ms_per_step == pytest.approx(200, rel=2e-3) and rate.samples_per_s == pytest.approx(480, rel=2e-3)


def test_a_trainer_that_stopped_early_is_a_failure_naming_the_steps(report, tmp_path):
    log = tmp_path / "train.log"
    log.write_text("\n".join([_progress(10, 960, 48.0), _progress(20, 1920, 87.3)]) + "\n")
    done = run_cli([sys.executable, "tools/gpu_perf_report.py", "trainer", str(log), str(tmp_path / "none.json"),
                    "--warmup", "10", "--min_steps", "30"])
    assert done.returncode == 1
    assert done.stderr.strip() == (f"gpu_perf_report.py trainer: {log}: 2 progress line(s), 10 step(s) timed after "
                                   "the 10 warm-up step(s); needs 30: did the trainer stop early?")


def test_top_kernels_reads_the_device_share_of_a_gpu_profile_table(report):
    header = ("Name    Self CPU %    Self CPU    CPU total %    CPU total    CPU time avg    Self CUDA    "
              "Self CUDA %    CUDA total    CUDA time avg    # of Calls")
    row = ("{name}    0.00%    0.000us    0.00%    0.000us    0.000us    46.886ms    {share}    46.886ms    "
           "651.198us    72")
    table = "\n".join(["-" * 40, header, "-" * 40, row.format(name="flash_bprop", share="9.95%"),
                       row.format(name="nvjet_gemm", share="9.34%"), "-" * 40, "Self CPU time total: 483.317ms"])
    assert report.top_kernels(table, 5) == "flash_bprop 9.95%, nvjet_gemm 9.34%"
