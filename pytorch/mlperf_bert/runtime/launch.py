"""torchrun for the trainer: its workers' own exit codes and lines, without torchrun's report.

    python pytorch/launch.py <torchrun's flags> pytorch/run_pretraining.py <flags>
    (or python -m mlperf_bert.runtime.launch ...)

takes torchrun's flags (`torch.distributed.run`) and runs its agent in this process. torchrun
alone answers any failed worker with its own exit code 1, a 30-line `ChildFailedError`
traceback and a per-rank table, also when the trainer stopped on purpose and has already
printed the one line that says why (bad input, a numeric blow-up, a write failure, a
preemption, a lost rank: `runtime/exits.py`). Here:

- each worker stops at once, with one line and exit code 76, if this process dies without
  stopping it (killed outright: torchrun's workers run in sessions of their own; `orphan.py`);
- the workers' stdout and stderr are untouched (they inherit this process's), so the trainer's
  lines and the MLPerf log lines arrive as they are written;
- torchrun's own log records (they are about the agent and its workers, not about the run) are
  held until the agent is done;
- a **clean stop**: every worker that failed left its code in the exit folder
  (`$MLPERF_BERT_EXIT_DIR/<pid>.code`, made here when the caller gave none) and exited with that
  code, or was stopped by the agent after another worker had failed first. The held records
  are dropped, nothing is added to the trainer's line, and the exit code is the trainer's
  (`exits.job_exit_code`: the lowest that is not a lost rank);
- the agent itself got SIGTERM / SIGINT (preemption, Ctrl-C): it forwards the signal and waits for
  its workers (a second signal cuts that wait short: then this process waits, up to torchrun's
  shutdown timeout); when every worker left a code, that is a clean stop too; otherwise (a
  worker still starting dies of the signal) torchrun's log lines and one line of ours follow,
  exit 128 + the signal, as a shell reports a death by signal;
- the rendezvous store stopped answering mid-run (c10d: the agent that serves it, on the
  endpoint's node, died) and the agent stopped its workers: when each left a code (they saw a
  lost rank), that is a clean stop too; otherwise it is a crash;
- anything else is a **crash** (an uncaught exception exits 1 without a code, a signal kills a
  worker first): the held records and torchrun's report with its traceback are printed, as
  torchrun prints them, and the exit code is 1.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from .exits import EXIT_DIR_VARIABLE, TRAINER_EXITS, job_exit_code, recorded_exit_codes
from .orphan import LAUNCHER_PID_VARIABLE

AGENT_LOGGER = "torch.distributed"  # torchrun's agent, rendezvous and launcher log under this name
TEARDOWN_SIGNALS = (-signal.SIGTERM, -signal.SIGKILL)  # how the agent stops the workers left
SHUTDOWN_TIMEOUT_S = 30.0  # torchrun's own wait for its workers after a signal, unless --shutdown-timeout


class HeldRecords(logging.Handler):
    """Keeps log records until `show` hands them to the handlers it stood in for."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger = logger
        self.records: list[logging.LogRecord] = []
        self.replaced = list(logger.handlers)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def show(self) -> None:
        for record in self.records:
            for handler in self.replaced:
                if record.levelno >= handler.level:
                    handler.handle(record)
        self.records.clear()


@contextmanager
def held_agent_logs() -> Iterator[HeldRecords]:
    """torchrun's log records go to a `HeldRecords` while the block runs (none are printed)."""
    logger = logging.getLogger(AGENT_LOGGER)
    held = HeldRecords(logger)
    logger.handlers = [held]
    try:
        yield held
    finally:
        logger.handlers = held.replaced


@contextmanager
def exit_folder(environ: Mapping[str, str] = os.environ) -> Iterator[Path]:
    """The caller's exit folder, or a temporary one exported to the workers (removed after)."""
    given = environ.get(EXIT_DIR_VARIABLE)
    if given:
        yield Path(given)
        return
    made = tempfile.mkdtemp(prefix="mlperf_bert_exits_")
    os.environ[EXIT_DIR_VARIABLE] = made
    try:
        yield Path(made)
    finally:
        del os.environ[EXIT_DIR_VARIABLE]
        shutil.rmtree(made, ignore_errors=True)


@contextmanager
def launcher_pid_exported() -> Iterator[None]:
    """This process's pid in the workers' environment while the block runs: a worker stops when
    its launcher dies (`orphan.py`)."""
    previous = os.environ.get(LAUNCHER_PID_VARIABLE)
    os.environ[LAUNCHER_PID_VARIABLE] = str(os.getpid())
    try:
        yield
    finally:
        if previous is None:
            del os.environ[LAUNCHER_PID_VARIABLE]
        else:
            os.environ[LAUNCHER_PID_VARIABLE] = previous


def clean_stop_code(failures: Mapping[int, ProcessFailure], recorded: Mapping[int, int]) -> int | None:
    """The trainer's exit code when every failed worker stopped on purpose (module docstring), else
    None (a crash). failures: torchrun's, by global rank; recorded: pid -> code from the exit folder.
    """
    if not failures:
        return None
    first = min(failures, key=lambda rank: failures[rank].timestamp)  # torchrun's root cause
    codes = []
    for rank, failure in failures.items():
        if failure.exitcode in TRAINER_EXITS and recorded.get(failure.pid) == failure.exitcode:
            codes.append(failure.exitcode)
        elif rank != first and failure.exitcode in TEARDOWN_SIGNALS:
            continue  # stopped by the agent once the first worker had failed
        else:
            return None
    return job_exit_code(codes)


def signalled_stop_code(recorded: Mapping[int, int], workers: int) -> int | None:
    """After a signal to the agent: the trainer's code when each of its `workers` left one, else None."""
    codes = list(recorded.values())
    if len(codes) < workers or not all(code in TRAINER_EXITS for code in codes):
        return None
    return job_exit_code(codes)


def ignore_stop_signals() -> None:
    """The agent is done: a further SIGTERM / SIGINT must not cut short the verdict (torchrun's
    handlers would raise one more SignalException)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def live_children() -> list[int]:
    """This process's children that still run (the workers, as the agent runs here)."""
    found = []
    for task in Path("/proc/self/task").glob("*"):
        for pid in (task / "children").read_text().split() if (task / "children").exists() else []:
            stat = Path(f"/proc/{pid}/stat")
            with contextlib.suppress(OSError, IndexError):
                if stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(pid))
    return found


def wait_for_codes(folder: Path, workers: int, timeout_s: float,
                   running: Callable[[], list[int]] = live_children) -> dict[int, int]:
    """The recorded codes once `workers` ranks left one, no worker runs any more, or at the timeout.

    Normally the agent has waited for its workers already. A second signal during that wait
    ends the agent's wait early while the workers still finish their step and checkpoint.
    """
    deadline = time.monotonic() + timeout_s
    codes = recorded_exit_codes(folder)
    while len(codes) < workers and running() and time.monotonic() < deadline:
        time.sleep(0.1)
        codes = recorded_exit_codes(folder)
    return codes


def main(argv: Sequence[str] | None = None) -> int:
    """Runs torchrun's agent on `argv` (torchrun's command line); the exit code (module docstring)."""
    args = torchrun.parse_args(list(sys.argv[1:] if argv is None else argv))
    with exit_folder() as folder, launcher_pid_exported(), held_agent_logs() as held:
        try:
            torchrun.run(args)
        except ChildFailedError as failed:
            ignore_stop_signals()
            code = clean_stop_code(failed.failures, recorded_exit_codes(folder))
            if code is None:
                held.show()
                raise
            return code
        except (RendezvousConnectionError, SignalException) as stopped:  # the agent stopped its workers itself
            ignore_stop_signals()
            workers = torchrun.determine_local_world_size(args.nproc_per_node)
            codes = wait_for_codes(folder, workers, args.shutdown_timeout or SHUTDOWN_TIMEOUT_S)
            code = signalled_stop_code(codes, workers)
            if code is not None:
                return code
            held.show()  # some worker went before it could say why: torchrun's lines (then ours)
            if not isinstance(stopped, SignalException):
                raise
            print(f"launch: stopped by {signal.Signals(stopped.sigval).name} before every rank stopped on its "
                  f"own ({len(codes)} of {workers} left an exit code): a rank still starting has no "
                  "checkpoint to leave; any rank's own traceback is above", file=sys.stderr)
            return 128 + int(stopped.sigval)
        held.show()
    return 0


if __name__ == "__main__":
    sys.exit(main())
