"""Nothing silent at the output side: a run owns its folder, write failures stop it with one
line naming the file, and Ctrl-C stops it like SIGTERM.

A full disk is a file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: writes past it fail with
EFBIG) or /dev/full (every write fails with ENOSPC): both work unprivileged, in any container.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from mlperf_bert.runtime.exits import EXIT_BAD_INPUT, EXIT_IO_ERROR, EXIT_PREEMPTED
from mlperf_bert.train.faults import StopRequest
from mlperf_bert.hooks.mllog import MLPerfLogger
from mlperf_bert.outputs import LOCK_NAME
from mlperf_bert.runtime.files import write_text_atomic
from mlperf_bert.train.checkpoint import write_atomic
from tests.harness.demo import trainer_args
from tests.harness.launches import mllog_events, run_ranks, worker_command
from tests.harness.paths import REPO, TRAINER


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def _limited(limit: int):
    def preexec() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    return preexec


def _train(args: list[str], limit: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(TRAINER), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, preexec_fn=_limited(limit) if limit else None)


def _error_lines(stderr: str, out: Path | None = None) -> list[str]:
    """What the run said besides its progress view (`run ...`, `step N ...`, `eval ...`, `run_stop ...`)
    and the summary it printed (OUTPUT_DIR/summary.txt, when `out` is given)."""
    summary = out / "summary.txt" if out is not None else None
    printed = set(summary.read_text().splitlines()) if summary is not None and summary.exists() else set()
    return [line for line in stderr.splitlines() if line.strip() and line not in printed
            and not line.startswith(("run ", "step ", "eval ", "run_stop "))]


# --- write failures -------------------------------------------------------------------------

def test_a_full_disk_under_the_mlperf_log_raises_naming_it():
    logger = MLPerfLogger("/dev/full", rank=0)
    with pytest.raises(OSError, match="No space left") as failed:
        logger.init_start()
    assert failed.value.filename == "/dev/full"
    logger.close()


def test_a_full_disk_under_the_logs_stdout_copy_raises_naming_it(monkeypatch):
    full = open("/dev/full", "w")
    monkeypatch.setattr(sys, "stdout", full)
    logger = MLPerfLogger(None, rank=0)
    with pytest.raises(OSError, match="No space left") as failed:
        logger.init_start()
    logger.close()
    with contextlib.suppress(OSError):  # the unwritten line is still in the file's buffer
        full.close()
    assert failed.value.filename.startswith("stdout")


def test_a_failed_log_write_leaves_only_whole_lines(tmp_path):
    log = tmp_path / "mlperf.log"
    logger = MLPerfLogger(str(log), rank=0)
    logger.init_start()
    whole = log.read_bytes()
    with file_size_limit(len(whole) + 40), pytest.raises(OSError) as failed:
        for _ in range(20):
            logger.event("tracked_stats", {"loss": 1.0})
    logger.close()
    assert failed.value.filename == str(log)
    text = log.read_text()
    assert text.endswith("\n") and text.startswith(whole.decode())
    assert all(json.loads(line.split(":::MLLOG ", 1)[1]) for line in text.splitlines())


def test_a_failed_checkpoint_write_keeps_the_last_good_one(tmp_path):
    good = tmp_path / "ckpt-000000000008.pt"
    write_atomic({"model": torch.zeros(10)}, good)
    before = good.read_bytes()
    new = tmp_path / "ckpt-000000000016.pt"
    with file_size_limit(len(before) + 1000), pytest.raises(OSError) as failed:
        write_atomic({"model": torch.zeros(100_000)}, new)
    assert failed.value.filename == str(new)
    assert sorted(p.name for p in tmp_path.iterdir()) == [good.name]  # no torn file, no temporary
    assert good.read_bytes() == before


def test_training_into_a_full_mlperf_log_stops_with_one_error_line(demo_data, tmp_path):
    result = _train(trainer_args(demo_data, tmp_path / "out", "--do_train", "--mlperf_log_file", "/dev/full"))
    assert result.returncode == EXIT_IO_ERROR, result.stderr[-2000:]
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: cannot write /dev/full: ") and "ENOSPC" in lines[0]


def test_a_checkpoint_on_a_full_disk_stops_the_run_with_one_error_line(demo_data, tmp_path):
    out = tmp_path / "out"
    result = _train(trainer_args(demo_data, out, "--do_train", "--checkpoint_every_samples", "16"), limit=150_000)
    assert result.returncode == EXIT_IO_ERROR, result.stderr[-2000:]
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and "error: cannot write " + str(out / "checkpoints" / "ckpt-") in lines[0], lines
    assert "EFBIG" in lines[0]
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]


def test_a_full_disk_under_resolved_config_stops_the_run_with_one_error_line(demo_data, tmp_path):
    out = tmp_path / "out"
    result = _train(trainer_args(demo_data, out, "--do_train"), limit=200)  # the first file written
    assert result.returncode == EXIT_IO_ERROR, result.stderr[-2000:]
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot write {out / 'resolved_config.json'}: "), lines
    assert "EFBIG" in lines[0]
    assert not (out / "mlperf.log").exists() and not (out / "resolved_config.json").exists()


def test_an_output_folder_the_run_may_not_write_is_refused_up_front(demo_data):
    # sysfs refuses new entries even to root, as a read-only or foreign file system would.
    result = _train(trainer_args(demo_data, Path("/sys/mlperf_bert_out"), "--do_train"))
    assert result.returncode == EXIT_BAD_INPUT, result.stderr[-2000:]
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: cannot write /sys/mlperf_bert_out: "), lines
    assert "pick a writable --output_dir" in lines[0]


def test_a_failed_small_file_write_names_the_file_and_keeps_the_old_one(tmp_path):
    path = tmp_path / "resolved_config.json"
    write_text_atomic(path, "{}\n")
    with file_size_limit(100), pytest.raises(OSError) as failed:
        write_text_atomic(path, "x" * 1000)
    assert failed.value.filename == str(path)
    assert path.read_text() == "{}\n" and [p.name for p in tmp_path.iterdir()] == [path.name]


# --- the output folder belongs to one run ----------------------------------------------------

def test_a_second_run_into_a_used_folder_is_refused_and_the_log_kept(demo_data, tmp_path):
    out = tmp_path / "out"
    first = _train(trainer_args(demo_data, out, "--do_train", "--max_steps", "2"))
    assert first.returncode == 0, first.stderr[-2000:]
    log = (out / "mlperf.log").read_bytes()
    second = _train(trainer_args(demo_data, out, "--do_train", "--max_steps", "2"))
    assert second.returncode == 2
    lines = _error_lines(second.stderr)
    assert len(lines) == 1 and f"{out / 'mlperf.log'} already holds the MLPerf log of another run" in lines[0]
    assert "--resume_from_checkpoint auto" in lines[0]
    assert (out / "mlperf.log").read_bytes() == log
    assert not (out / LOCK_NAME).exists()


def test_every_rank_refuses_a_used_folder_together(demo_data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mlperf.log").write_text(":::MLLOG {}\n")
    flags = trainer_args(demo_data, out, "--do_train", "--train_batch_size", "4", "--collective_timeout_s", "60")
    assert run_ranks(worker_command(flags), 2, tmp_path / "logs", timeout=120) == [2, 2]
    for rank in (0, 1):
        lines = _error_lines((tmp_path / "logs" / f"rank{rank}.err").read_text())
        assert len(lines) == 1 and "already holds the MLPerf log of another run" in lines[0], lines
    assert (out / "mlperf.log").read_text() == ":::MLLOG {}\n"


def _hold_lock(out: Path) -> subprocess.Popen:
    """Another process that owns `out` (as a running trainer would) until it is killed."""
    out.mkdir(parents=True, exist_ok=True)
    code = ("import fcntl, json, os, socket, sys, time\n"
            f"fd = os.open({str(out / LOCK_NAME)!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.write(fd, json.dumps({'pid': os.getpid(), 'host': socket.gethostname()}).encode())\n"
            "print('held', flush=True)\n"
            "time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_two_runs_into_one_folder_at_once_the_second_is_refused(demo_data, tmp_path):
    out = tmp_path / "out"
    holder = _hold_lock(out)
    try:
        result = _train(trainer_args(demo_data, out, "--do_train"))
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 2
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and f"the run of pid {holder.pid} on host {socket.gethostname()} running" in lines[0]
    assert not (out / "mlperf.log").exists()


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_note(demo_data, tmp_path):
    out = tmp_path / "out"
    holder = _hold_lock(out)
    holder.kill()  # killed: its flock is gone, its lock file stays
    holder.wait()
    result = _train(trainer_args(demo_data, out, "--do_train", "--max_steps", "2"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"taking over the lock of pid {holder.pid}, which has ended" in result.stderr
    assert not (out / LOCK_NAME).exists()


def test_a_lock_from_another_host_is_refused_naming_the_fix(demo_data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_text(json.dumps({"pid": 4242, "host": "node-elsewhere"}))
    result = _train(trainer_args(demo_data, out, "--do_train"))
    assert result.returncode == 2
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and "pid 4242 on host node-elsewhere may still be running" in lines[0]
    assert f"delete {out / LOCK_NAME} once that run has ended" in lines[0]


# --- Ctrl-C -----------------------------------------------------------------------------------

def test_ctrl_c_finishes_the_step_checkpoints_and_logs_run_stop_aborted(demo_data, tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = trainer_args(demo_data, out, "--do_train", "--max_steps", "100000", "--checkpoint_every_samples", "100000")
    proc = subprocess.Popen([sys.executable, str(TRAINER), *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    log, deadline = out / "mlperf.log", time.monotonic() + 120
    while not (log.exists() and '"block_start"' in log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == EXIT_PREEMPTED, stderr[-2000:]
    lines = _error_lines(stderr, out)
    assert len(lines) == 1 and lines[0].startswith("stopped (preempted): SIGINT arrived"), lines
    assert (out / "summary.txt").read_text().startswith("status: aborted (preempted)\n")
    stop = [e for e in mllog_events(log) if e["key"] == "run_stop"]
    assert len(stop) == 1 and stop[0]["metadata"]["status"] == "aborted"
    saved = list((out / "checkpoints").glob("ckpt-*.pt"))
    assert len(saved) == 1 and torch.load(saved[0], weights_only=True)["run"]["reason"] == "preempted"


def test_a_second_ctrl_c_interrupts_at_once():
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signal_number == signal.SIGINT  # the first one only asks for a stop
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
