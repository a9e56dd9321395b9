"""mlperf_bert.runtime.launch: torchrun for the trainer. A rank's own stop reaches the user as its one
line and its exit code; a crash keeps torchrun's report and its traceback."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from mlperf_bert.runtime.exits import (
    EXIT_BAD_INPUT,
    EXIT_DIR_VARIABLE,
    EXIT_DIVERGED,
    EXIT_LOST_RANK,
    EXIT_PREEMPTED,
    job_exit_code,
    record_exit_code,
    recorded_exit_codes,
    say_once,
)
from mlperf_bert.runtime.launch import (
    HeldRecords, args_problem, clean_stop_code, exit_folder, ignore_stop_signals, launcher_pid_exported,
    signalled_stop_code, wait_for_codes,
)
from mlperf_bert.runtime.orphan import LAUNCHER_PID_VARIABLE
from tests.harness.broken_packages import BREAKAGES, write_package
from tests.harness.commands import harness_importable
from tests.harness.demo import trainer_args
from tests.harness.launches import wait_for_steps, worker_command
from tests.harness.paths import REPO
from tests.harness.ports import free_port

LAUNCHER = REPO / "pytorch" / "launch.py"
TORCHRUN_NOISE = ("Traceback", "ChildFailedError", "torch/distributed/", "FAILED", "Root Cause")


def _failures(*entries: tuple[int, int, int]) -> dict[int, ProcessFailure]:
    """(pid, exit code, second) per global rank, as torchrun's agent reports its failed workers."""
    failures = {}
    for rank, (pid, code, second) in enumerate(entries):
        failure = ProcessFailure(local_rank=rank, pid=pid, exitcode=code, error_file="<N/A>")
        failure.timestamp = second
        failures[rank] = failure
    return failures


@pytest.mark.parametrize("failures, recorded, expected", [
    # rank 1 refused the input first; the agent then stopped rank 0 with SIGTERM
    (_failures((10, -signal.SIGTERM, 6), (11, EXIT_BAD_INPUT, 5)), {11: EXIT_BAD_INPUT}, EXIT_BAD_INPUT),
    # both stopped after their checkpoint
    (_failures((10, EXIT_PREEMPTED, 5), (11, EXIT_PREEMPTED, 5)), {10: 75, 11: 75}, EXIT_PREEMPTED),
    # rank 0 blew up; rank 1 saw a lost rank: the cause wins
    (_failures((10, EXIT_DIVERGED, 5), (11, EXIT_LOST_RANK, 8)), {10: 3, 11: 76}, EXIT_DIVERGED),
    (_failures((10, EXIT_LOST_RANK, 5), (11, EXIT_LOST_RANK, 5)), {10: 76, 11: 76}, EXIT_LOST_RANK),
    # an uncaught exception: exit 1, no code left
    (_failures((10, 1, 5), (11, EXIT_LOST_RANK, 8)), {11: 76}, None),
    # killed first (the OOM killer, a segfault): the survivors' 76 does not make it clean
    (_failures((10, -signal.SIGKILL, 5), (11, EXIT_LOST_RANK, 8)), {11: 76}, None),
    (_failures((10, -signal.SIGSEGV, 5),), {}, None),
    # exit 2 without a code left: Python's own "can't open file", not the trainer's refusal
    (_failures((10, EXIT_BAD_INPUT, 5),), {}, None),
    # a code left by another process of the same number does not count for this one
    (_failures((10, EXIT_BAD_INPUT, 5),), {12: EXIT_BAD_INPUT}, None),
    ({}, {}, None),
])
def test_clean_stop_code(failures, recorded, expected):
    assert clean_stop_code(failures, recorded) == expected


@pytest.mark.parametrize("failures, recorded, expected", [
    # rank 0 refused the input; the agent killed the straggler rank 1 outright
    (_failures((10, EXIT_BAD_INPUT, 5), (11, -signal.SIGKILL, 6)), {10: EXIT_BAD_INPUT}, EXIT_BAD_INPUT),
    # the first to fail died of SIGTERM from outside the agent: a crash, whatever came after
    (_failures((10, -signal.SIGTERM, 5), (11, EXIT_LOST_RANK, 8)), {11: 76}, None),
    # rank 3 failed first (the root cause), rank 0 was stopped after it
    (_failures((10, -signal.SIGTERM, 9), (11, EXIT_LOST_RANK, 9), (12, EXIT_LOST_RANK, 9),
               (13, EXIT_DIVERGED, 4)), {11: 76, 12: 76, 13: 3}, EXIT_DIVERGED),
    # a recorded code that is not the code the worker exited with
    (_failures((10, EXIT_BAD_INPUT, 5),), {10: EXIT_PREEMPTED}, None),
])
def test_clean_stop_code_tells_the_root_cause_from_the_teardown(failures, recorded, expected):
    assert clean_stop_code(failures, recorded) == expected


def test_stop_signals_are_all_ignored_once_the_agent_is_done():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        ignore_stop_signals()
        assert {sig: signal.getsignal(sig) for sig in before} == {sig: signal.SIG_IGN for sig in before}
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_held_records_reach_each_handler_at_its_own_level():
    logger = logging.getLogger("mlperf_bert_test_held")
    logger.setLevel(logging.DEBUG)  # every record reaches the held handler; each handler's level decides
    logger.propagate = False
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.handlers = [handler]
    held = HeldRecords(logger)
    logger.handlers = [held]
    for level, message in ((logging.INFO, "info"), (logging.WARNING, "warning"), (logging.ERROR, "error")):
        logger.log(level, message)
    assert seen == []
    held.show()
    assert seen == ["warning", "error"] and held.records == []


def test_the_exit_folder_and_the_launcher_pid_are_exported_only_while_the_launch_runs(monkeypatch):
    monkeypatch.delenv(EXIT_DIR_VARIABLE, raising=False)
    monkeypatch.delenv(LAUNCHER_PID_VARIABLE, raising=False)
    with exit_folder() as folder, launcher_pid_exported():
        assert os.environ[EXIT_DIR_VARIABLE] == str(folder) and folder.is_dir()
        assert os.environ[LAUNCHER_PID_VARIABLE] == str(os.getpid())
    assert EXIT_DIR_VARIABLE not in os.environ and LAUNCHER_PID_VARIABLE not in os.environ and not folder.exists()
    monkeypatch.setenv(LAUNCHER_PID_VARIABLE, "123")
    with launcher_pid_exported():
        assert os.environ[LAUNCHER_PID_VARIABLE] == str(os.getpid())
    assert os.environ[LAUNCHER_PID_VARIABLE] == "123"
    with exit_folder({EXIT_DIR_VARIABLE: "/given"}) as given:
        assert given == Path("/given") and EXIT_DIR_VARIABLE not in os.environ


def test_signalled_stop_code_needs_a_code_from_every_worker():
    assert signalled_stop_code({10: 75, 11: 75}, workers=2) == EXIT_PREEMPTED
    assert signalled_stop_code({10: 75}, workers=2) is None  # one worker died without a word
    assert signalled_stop_code({10: 75, 11: 1}, workers=2) is None


def test_wait_for_codes_outwaits_workers_still_writing_their_checkpoint(tmp_path):
    """A second signal to the agent ends its own wait early; the launcher then waits for the codes."""
    late = threading.Timer(0.3, lambda: (tmp_path / "11.code").write_text("75\n"))
    (tmp_path / "10.code").write_text("75\n")
    late.start()
    assert wait_for_codes(tmp_path, workers=2, timeout_s=30, running=lambda: [11]) == {10: 75, 11: 75}
    started = time.monotonic()
    assert wait_for_codes(tmp_path / "none", workers=2, timeout_s=30, running=lambda: []) == {}  # all gone
    assert wait_for_codes(tmp_path / "none", workers=2, timeout_s=0.3, running=lambda: [11]) == {}  # hung
    assert time.monotonic() - started < 5


def test_job_exit_code_prefers_the_cause_over_a_lost_rank():
    assert job_exit_code([76, 3, 76]) == 3
    assert job_exit_code([76, 76]) == 76
    assert job_exit_code([75, 2]) == 2
    assert job_exit_code([]) == 0


def test_exit_codes_and_lines_go_through_the_exit_folder(tmp_path, capsys):
    env = {"MLPERF_BERT_EXIT_DIR": str(tmp_path)}
    record_exit_code(75, env)
    assert recorded_exit_codes(tmp_path) == {os.getpid(): 75}
    for _ in range(3):  # three ranks with the same refusal print it once
        say_once("error: --foo is bad", env)
    say_once("error: rank 1 was lost", env)
    assert capsys.readouterr().err.splitlines() == ["error: --foo is bad", "error: rank 1 was lost"]
    say_once("error: --foo is bad", {})  # no launcher folder: every rank prints
    assert capsys.readouterr().err == "error: --foo is bad\n"


def _armed(launcher: int, folder: Path) -> subprocess.CompletedProcess[str]:
    """A process that arms the launcher watch (`runtime/orphan.py`) for pid `launcher`, then says so."""
    code = "from mlperf_bert.runtime.orphan import stop_with_launcher; print(stop_with_launcher())"
    env = {**os.environ, LAUNCHER_PID_VARIABLE: str(launcher), "MLPERF_BERT_EXIT_DIR": str(folder)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_a_worker_whose_launcher_died_before_it_asked_stops_with_76_and_one_line(tmp_path):
    """The launcher's pid is no longer the worker's parent when it arms: no signal would come."""
    done = _armed(os.getpid() + 10**6, tmp_path)  # a pid that is not this process's (the parent's)
    assert done.returncode == EXIT_LOST_RANK and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"error: the launcher of this node's ranks (torchrun agent, pid {os.getpid() + 10**6}) died; its ranks stop "
        "with exit code 76 instead of training on without it (no checkpoint); resume from the newest checkpoint, if any"]
    assert list(recorded_exit_codes(tmp_path).values()) == [EXIT_LOST_RANK]


def test_a_worker_of_a_live_launcher_trains_on(tmp_path):
    done = _armed(os.getpid(), tmp_path)  # this process is the parent
    assert (done.returncode, done.stdout, done.stderr) == (0, "True\n", "")
    assert not recorded_exit_codes(tmp_path)


def _launch(args: list[str], tmp_path: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """`pytorch/launch.py` as run_and_time.sh starts it, without an exit folder (it makes its own)."""
    env = harness_importable({**os.environ, "OMP_NUM_THREADS": "1"})  # args may start a harness worker
    env.pop("MLPERF_BERT_EXIT_DIR", None)
    command = [sys.executable, str(LAUNCHER), "--standalone", "--nproc_per_node=2", *args]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_refused_input_is_one_line_and_exit_2(demo_data, tmp_path):
    flags = trainer_args(demo_data, tmp_path / "out", "--do_train", "--warmup_steps", "99")
    done = _launch([str(REPO / "pytorch" / "run_pretraining.py"), *flags], tmp_path)
    assert done.returncode == EXIT_BAD_INPUT, done.stderr[-3000:]
    assert done.stderr.splitlines() == ["error: --warmup_steps must be an integer in [0, 6]; got 99"], done.stderr


def test_a_broken_optional_package_under_the_launcher_is_one_line_and_exit_2(demo_data, tmp_path):
    """torchao installed but failing with an AttributeError (a torchao for another torch): each rank refuses
    at start-up; the user sees one line, not both ranks' tracebacks and torchrun's ChildFailedError."""
    broken = write_package(tmp_path / "site", "torchao", BREAKAGES["AttributeError"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{broken}:{os.environ.get('PYTHONPATH', '')}"}
    env.pop("MLPERF_BERT_EXIT_DIR", None)
    flags = trainer_args(demo_data, tmp_path / "out", "--do_train", "--precision", "fp8")
    done = subprocess.run([sys.executable, str(LAUNCHER), "--standalone", "--nproc_per_node=2",
                           str(REPO / "pytorch" / "run_pretraining.py"), *flags],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == EXIT_BAD_INPUT, done.stderr[-3000:]
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: --precision fp8 needs torchao, which is installed but fails to import "
                           "(AttributeError: module 'sys' has no attribute 'int1'): ")
    assert not (tmp_path / "out").exists()


def test_a_crash_keeps_its_traceback_and_torchruns_report(demo_data, tmp_path):
    flags = trainer_args(demo_data, tmp_path / "out", "--do_train", "--max_steps", "50",
                         "--collective_timeout_s", "20")
    done = _launch(worker_command(flags, None, "--crash_at_step", "2", "--crash_rank", "1")[1:], tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "RuntimeError: injected crash after step 2 on rank 1" in done.stderr  # the worker's own traceback
    assert "ChildFailedError" in done.stderr and "Root Cause" in done.stderr  # torchrun's report


def test_a_missing_training_script_is_torchruns_to_report(tmp_path):
    """Python's own exit 2 ("can't open file") is no stop of the trainer: the report stays."""
    done = _launch([str(tmp_path / "missing.py")], tmp_path)
    assert done.returncode == 1 and "can't open file" in done.stderr and "ChildFailedError" in done.stderr


def test_sigterm_while_the_ranks_start_is_143_without_a_traceback(demo_data, tmp_path):
    """The ranks die of the forwarded signal before they can checkpoint: that is the signal's doing,
    not a crash (exit 128 + 15, as a shell says it), and nothing was trained."""
    flags = trainer_args(demo_data, tmp_path / "out", "--do_train")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MLPERF_BERT_EXIT_DIR", None)
    proc = subprocess.Popen([sys.executable, str(LAUNCHER), "--standalone", "--nproc_per_node=2",
                             str(REPO / "pytorch" / "run_pretraining.py"), *flags], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not _children_of(proc.pid) and time.monotonic() < deadline:  # the agent has started its workers
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "launch: stopped by SIGTERM before every rank stopped on its own (0 of 2" in stderr, stderr
    assert "Traceback" not in stderr and not (tmp_path / "out" / "checkpoints").exists()


def _processes_running(marker: str) -> list[int]:
    """The pids whose command line mentions `marker` (a test's own output folder)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker in cmdline.read_bytes().decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def test_sigterm_while_the_agent_starts_its_workers_leaves_no_worker_behind(demo_data, tmp_path):
    """SIGTERM after the agent started a worker but before torchrun tracks it (harness/workers/race_launch.py
    makes that moment certain): torchrun signals none, so the launcher does; a worker still waiting at the
    shutdown timeout for a peer that never started is killed. No traceback, no orphan, exit 143."""
    out = tmp_path / "out"
    env = harness_importable({**os.environ, "OMP_NUM_THREADS": "1"})
    env.pop("MLPERF_BERT_EXIT_DIR", None)
    command = [sys.executable, "-m", "tests.harness.workers.race_launch", "--standalone", "--nproc_per_node=2",
               "--shutdown-timeout=5", str(REPO / "pytorch" / "run_pretraining.py"),
               *trainer_args(demo_data, out, "--do_train")]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    assert "launch: stopped by SIGTERM before every rank stopped on its own (0 of 2" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "error:" not in done.stderr, done.stderr[-3000:]
    assert not _processes_running(str(out)) and not (out / "checkpoints").exists()


# torchrun's values that its agent would take, then fail on with a traceback or wait on forever.
BAD_LAUNCH_ARGS = [
    (["--nnodes=0"], "--nnodes 0: give the number of nodes (N >= 1) or MIN:MAX with 1 <= MIN <= MAX"),
    (["--nnodes=2:1"], "--nnodes 2:1: give the number of nodes"),
    (["--nnodes=1:2:3"], "--nnodes 1:2:3: give the number of nodes"),
    (["--nnodes=two"], "--nnodes two: give the number of nodes"),
    (["--nproc_per_node=0"], "--nproc_per_node 0: give the number of processes on this node (>= 1; one per GPU)"),
    (["--nproc_per_node=-2"], "--nproc_per_node -2: give the number of processes"),
    (["--nproc_per_node=many"], "--nproc_per_node many: give the number of processes"),
    (["--nnodes=2", "--node_rank=2"], "--node_rank 2 is outside 0..1 (--nnodes 2): give each node its own rank"),
    (["--nnodes=2", "--node_rank=9"], "--node_rank 9 is outside 0..1"),
    (["--nnodes=1:3", "--node_rank=3"], "--node_rank 3 is outside 0..2 (--nnodes 1:3)"),
    (["--nnodes=2", "--node_rank=-1"], "--node_rank -1 is outside 0..1"),
    (["--nnodes=2", "--master_port=295000"], "--master_port: port 295000 is outside 1..65535"),
    (["--nnodes=2", "--master_port=65536"], "--master_port: port 65536 is outside 1..65535"),
    (["--nnodes=2", "--master_port=0"], "--master_port: port 0 is outside 1..65535"),
    (["--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=node000:70000"],
     "--rdzv_endpoint: port 70000 is outside 1..65535"),
    (["--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=[fe80::1]:0"], "--rdzv_endpoint: port 0 is outside"),
    (["--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=node000:x9"], "--rdzv_endpoint: port x9 is outside"),
]
GOOD_LAUNCH_ARGS = [["--standalone", "--nproc_per_node=2"], ["--nproc_per_node=auto"], ["--nnodes=1:4"],
                    ["--nnodes=2", "--node_rank=1", "--master_port=65535"],
                    ["--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=node000"],  # torchrun's default port
                    ["--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=[fe80::1]:29400", "--node_rank=7"],
                    ["--standalone", "--master_port=0"],  # standalone picks its own endpoint
                    ["--standalone", "--rdzv_endpoint=node000:70000"],  # and ignores one given
                    ["--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=[fe80::1]"],  # IPv6, default port
                    ["--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=[fd00::1:2]"],
                    *(["--standalone", f"--nproc_per_node={word}"] for word in ("auto", "cpu", "gpu", "xpu"))]


@pytest.mark.parametrize("flags, says", BAD_LAUNCH_ARGS)
def test_a_launch_value_out_of_range_is_named(flags, says):
    problem = args_problem(torchrun.parse_args([*flags, "train.py"]))
    assert problem is not None and problem.startswith(says), problem


@pytest.mark.parametrize("flags", GOOD_LAUNCH_ARGS)
def test_launch_values_in_range_pass(flags):
    assert args_problem(torchrun.parse_args([*flags, "train.py"])) is None


def test_a_node_rank_no_node_completes_is_refused_before_the_agent_waits(tmp_path):
    """--node_rank 2 of 2 nodes would wait for the rendezvous until killed; refused at once."""
    command = [sys.executable, str(LAUNCHER), "--nnodes=2", "--node_rank=2", "--nproc_per_node=1",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(tmp_path / "never_started.py")]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (EXIT_BAD_INPUT, "")
    assert done.stderr.splitlines() == ["launch: --node_rank 2 is outside 0..1 (--nnodes 2): give each node its own "
                                        "rank in that range (a node with another rank waits forever for a rendezvous "
                                        "that never completes)"]


def _children_of(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in children.read_text().split()] if children.exists() else []


def test_preempted_under_the_launcher_is_the_trainers_line_and_75(demo_data, tmp_path):
    """SIGTERM to the agent (as scancel sends it): it forwards it; the workers checkpoint and exit 75."""
    flags = trainer_args(demo_data, tmp_path / "out", "--do_train", "--max_steps", "100000",
                         "--eval_iter_samples", "800000")
    env = harness_importable({**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())})
    command = [sys.executable, str(LAUNCHER), "--standalone", "--nproc_per_node=2",
               *worker_command(flags, tmp_path / "rec", "--step_sleep", "0.05")[1:]]
    with open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_for_steps(tmp_path / "rec", 0, 2, [proc], timeout=180)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = (tmp_path / "err.txt").read_text()
    assert code == EXIT_PREEMPTED, stderr[-3000:]
    assert "stopped (preempted): SIGTERM arrived" in stderr
    assert not [noise for noise in TORCHRUN_NOISE if noise in stderr], stderr[-3000:]
