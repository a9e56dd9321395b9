"""Preemption: a signal to one rank stops every rank at one step with a checkpoint, exit 75; the
resumed run ends exactly where the uninterrupted run ends. run.sub requeues such a run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from mlperf_bert.runtime.exits import EXIT_PREEMPTED
from mlperf_bert.train.faults import StopRequest
from tests.harness.demo import trainer_args
from tests.harness.launches import (load_checkpoint, losses, mllog_events, pid_of, run_ranks, start_torchrun, wait_all,
                                    wait_for_steps, worker_command)
from tests.harness.paths import FAKE_COMMANDS, REPO
from tests.harness.tensors import assert_same_tensors


def _flags(demo_data: Path, out: Path, *extra: str) -> list[str]:
    # 2 ranks x 4 = 8 samples per step, 12 steps, evals every 32 samples. Periodic checkpoints
    # are on (every 1,000 samples: never inside this run) so the run ends with a final checkpoint.
    return trainer_args(demo_data, out, "--do_train", "--train_batch_size", "4", "--max_steps", "12",
                        "--checkpoint_every_samples", "1000", "--collective_timeout_s", "60", *extra)


@pytest.mark.slow
def test_sigusr1_to_one_rank_stops_both_and_the_resumed_run_matches(demo_data, tmp_path):
    reference, run = tmp_path / "reference", tmp_path / "run"
    assert run_ranks(worker_command(_flags(demo_data, reference), reference / "rec"), 2, reference / "logs") == [0, 0]

    # torchrun, as on a workstation; SLURM's --signal=USR1 reaches the ranks the same way.
    command = worker_command(_flags(demo_data, run), run / "rec", "--step_sleep", "0.3")
    run.mkdir()
    launcher = start_torchrun(command, 2, run / "torchrun.log")
    wait_for_steps(run / "rec", 1, 2, [launcher])
    os.kill(pid_of(run / "rec", 1), signal.SIGUSR1)  # rank 1 only: rank 0 learns it at the next step
    assert wait_all([launcher], timeout=120) != [0]
    report = (run / "torchrun.log").read_text()
    codes = set(re.findall(r"rank\s*:\s*(\d+) \(local_rank.*\n\s*exitcode\s*:\s*(-?\d+)", report))
    assert codes == {("0", str(EXIT_PREEMPTED)), ("1", str(EXIT_PREEMPTED))}, report[-3000:]
    assert "stopped (preempted): SIGUSR1 arrived; every rank stopped after step" in report

    stopped_at = len(losses(run / "rec", 0))
    assert len(losses(run / "rec", 1)) == stopped_at < 12  # both ranks took the same last step
    checkpoint = run / "checkpoints" / f"ckpt-{8 * stopped_at:012d}.pt"
    saved = load_checkpoint(checkpoint)
    assert saved["run"]["reason"] == "preempted" and saved["train_state"]["step"] == stopped_at
    assert len(saved["rng"]) == 2 and not saved["rng"][0]["torch"].equal(saved["rng"][1]["torch"])
    events = mllog_events(run / "mlperf.log")
    stop = [e for e in events if e["key"] == "run_stop"][-1]
    assert stop["metadata"] == {**stop["metadata"], "status": "aborted", "epoch_num": 8 * stopped_at}
    assert [e["key"] for e in events].count("preempted") == 1

    # The next attempt: same output folder, --resume_from_checkpoint auto (what run.sub passes).
    resumed = worker_command(_flags(demo_data, run, "--resume_from_checkpoint", "auto"), run / "rec2")
    assert run_ranks(resumed, 2, run / "logs2") == [0, 0]
    for rank in (0, 1):
        assert losses(run / "rec2", rank) == losses(reference / "rec", rank)[stopped_at:]
        assert losses(run / "rec", rank) == losses(reference / "rec", rank)[:stopped_at]
    final = "ckpt-000000000096.pt"
    mine, theirs = load_checkpoint(run / "checkpoints" / final), load_checkpoint(reference / "checkpoints" / final)
    for part in ("model", "optimizer", "rng"):
        assert_same_tensors({part: mine[part]}, {part: theirs[part]})
    assert mine["train_state"] == theirs["train_state"]


def _fake_slurm_bin(tmp_path: Path) -> Path:
    """scontrol that records `requeue`, and a run_and_time.sh whose first attempt is preempted."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/usr/bin/env bash\nif [[ "$1" == requeue ]]; then echo "$2" >> "$REQUEUED"; exit 0; fi\n'
                        f'exec {FAKE_COMMANDS / "scontrol"} "$@"\n')
    scontrol.chmod(0o755)
    python = bin_dir / "fake_python"  # the SYSJSON and compliance steps: nothing to check in fake logs
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)
    return bin_dir


def _fake_run_and_time(submit: Path) -> None:
    """Trainer stand-in: rank 0 records what it was given; every rank exits 75 once for run 1."""
    script = submit / "run_and_time.sh"
    script.write_text("""#!/usr/bin/env bash
set -euo pipefail
rank=$SLURM_PROCID
if [[ $rank == 0 ]]; then
  echo "{\\"output\\": \\"$OUTPUT_DIR\\", \\"resume\\": \\"${RESUME_FROM_CHECKPOINT:-}\\"}" >> "$CALLS"
fi
if [[ "$OUTPUT_DIR" == *_1 && ! -e "$OUTPUT_DIR.preempted.$rank" ]]; then
  touch "$OUTPUT_DIR.preempted.$rank"
  echo "attempt 1 of run 1, rank $rank: preempted"
  exit 75
fi
echo "rank $rank: run finished"
""")
    script.chmod(0o755)


def test_run_sub_requeues_a_preempted_run_and_the_next_attempt_resumes_it(tmp_path):
    submit = tmp_path / "submit"
    submit.mkdir()
    shutil.copy(REPO / "run.sub", submit)
    shutil.copy(REPO / "config_CPU_1x2.sh", submit)
    (submit / "tools").mkdir()
    for tool in ("job_exit_code.sh", "launch_checks.sh", "script_args.sh"):
        shutil.copy(REPO / "tools" / tool, submit / "tools")
    _fake_run_and_time(submit)
    for name in ("data", "eval", "phase1"):
        (tmp_path / name).mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DGX"))}
    bin_dir = _fake_slurm_bin(tmp_path)
    env.update(PATH=f"{bin_dir}:{FAKE_COMMANDS}:{env['PATH']}", PYTHON=str(bin_dir / "fake_python"), DGXSYSTEM="CPU_1x2",
               NEXP="2",
               DATADIR_PHASE2=str(tmp_path / "data"), EVALDIR=str(tmp_path / "eval"),
               CHECKPOINTDIR_PHASE1=str(tmp_path / "phase1"), CLEAR_CACHES="0", SLURM_JOB_ID="77",
               SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="testhost", SLURM_SUBMIT_DIR=str(submit),
               FAKE_SRUN_LOG=str(tmp_path / "srun.jsonl"), CALLS=str(tmp_path / "calls.jsonl"),
               REQUEUED=str(tmp_path / "requeued"), DATESTAMP="first")

    def attempt() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(submit / "run.sub")], cwd=submit, env=env, capture_output=True,
                              text=True, timeout=120, check=False)

    first = attempt()
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "requeued").read_text().split() == ["77"]
    assert "requeue" in first.stderr and "run 1" in first.stderr
    env["DATESTAMP"] = "second"  # a requeued job starts the batch script again, with a new date
    second = attempt()
    assert second.returncode == 0, second.stderr
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    logs = submit / "results"
    assert calls == [{"output": f"{logs}/first_1", "resume": ""}, {"output": f"{logs}/first_1", "resume": "auto"},
                     {"output": f"{logs}/first_2", "resume": ""}]
    assert (tmp_path / "requeued").read_text().split() == ["77"]  # no second requeue
    both = (logs / "first_1.log").read_text()
    assert "attempt 1 of run 1, rank 0: preempted" in both and "rank 0: run finished" in both  # appended
    assert not list(logs.glob(".resume_*"))


def test_a_stop_request_records_the_signal_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    with StopRequest() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.signal_number == signal.SIGUSR1 and stop.requested
    assert signal.getsignal(signal.SIGUSR1) is before
