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
  exit 128 + the signal, as a shell reports a death by signal. A worker the agent started but
  did not yet track when the signal came gets it from here, and one still running at the end
  is killed: no worker outlives this process;
- the rendezvous store stopped answering mid-run (c10d: the agent that serves it, on the
  endpoint's node, died) and the agent stopped its workers: when each left a code (they saw a
  lost rank), that is a clean stop too; otherwise it is a crash;
- values torchrun would take and then fail on with a traceback, or wait on forever (a static
  --node_rank outside 0..NNODES-1, a port outside 1..65535, a node or process count below 1), are
  refused before the agent starts: one line, exit code 2 (`args_problem`);
- anything else is a **crash** (an uncaught exception exits 1 without a code, a signal kills a
  worker first): the held records and torchrun's report with its traceback are printed, as
  torchrun prints them, and the exit code is 1.
"""

from __future__ import annotations

import argparse
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

from .exits import EXIT_BAD_INPUT, EXIT_DIR_VARIABLE, TRAINER_EXITS, job_exit_code, recorded_exit_codes
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


# TCP ports a rendezvous can listen on (0 would make the store pick one no other node knows).
PORTS = range(1, 65536)
NPROC_KEYWORDS = ("auto", "cpu", "gpu", "xpu")  # torchrun's --nproc_per_node words besides a count


def node_range(nnodes: str) -> tuple[int, int] | None:
    """torchrun's --nnodes (N or MIN:MAX) as (MIN, MAX), or None when it is neither with 1 <= MIN <= MAX."""
    parts = nnodes.split(":")
    if len(parts) > 2 or not all(part.isdigit() for part in parts):
        return None
    low, high = int(parts[0]), int(parts[-1])
    return (low, high) if 1 <= low <= high else None


def endpoint_port(endpoint: str) -> str | None:
    """The port of a host:port (or [v6]:port) rendezvous endpoint; None without one (torchrun's default)."""
    host, sep, port = endpoint.rpartition(":")
    return port if sep and not host.endswith(":") and "]" not in port else None


def args_problem(args: argparse.Namespace) -> str | None:
    """torchrun's values that it would take and then fail on deep in its agent (a ValueError traceback) or
    wait on forever (a static node rank no other node completes); one line naming the flag and the fix."""
    nodes = node_range(args.nnodes)
    if nodes is None:
        return f"--nnodes {args.nnodes}: give the number of nodes (N >= 1) or MIN:MAX with 1 <= MIN <= MAX"
    nproc = str(args.nproc_per_node)
    if not (nproc.isdigit() and int(nproc) >= 1) and nproc not in NPROC_KEYWORDS:
        return (f"--nproc_per_node {nproc}: give the number of processes on this node (>= 1; one per GPU), or one "
                f"of {', '.join(NPROC_KEYWORDS)}")
    static = args.rdzv_backend == "static" and not args.standalone
    if static and not 0 <= args.node_rank < nodes[1]:
        return (f"--node_rank {args.node_rank} is outside 0..{nodes[1] - 1} (--nnodes {args.nnodes}): give each node "
                "its own rank in that range (a node with another rank waits forever for a rendezvous that never "
                "completes)")
    if args.standalone:  # torchrun picks the endpoint itself
        return None
    if args.rdzv_endpoint:
        flag, port = "--rdzv_endpoint", endpoint_port(args.rdzv_endpoint)
    elif static:
        flag, port = "--master_port", None if args.master_port is None else str(args.master_port)
    else:
        return None
    if port is not None and not (port.isdigit() and int(port) in PORTS):
        return f"{flag}: port {port} is outside 1..65535: give a free TCP port in that range (29500 is usual)"
    return None


def signal_workers(signum: int, running: Callable[[], list[int]] = live_children) -> list[int]:
    """Sends `signum` to every worker still running here; their pids."""
    pids = running()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    return pids


def stopped_by_agent(stopped: RendezvousConnectionError | SignalException, folder: Path, workers: int,
                     timeout_s: float, held: HeldRecords) -> int:
    """The exit code once the agent stopped its workers itself (a signal to it, or the rendezvous lost).

    torchrun signals the workers it tracks and waits for them. A signal that reaches the agent while
    it starts them leaves those already started untracked: every worker still running gets the
    signal here (a tracked one again when a second signal cut torchrun's wait short: a second
    Ctrl-C then ends the ranks at once, as it ends a rank run alone). Whatever still runs at the
    timeout is killed: a rank waiting for a peer that never came would otherwise outlive this
    process, and die later of the vanished store with a traceback of its own.
    """
    if isinstance(stopped, SignalException):
        signal_workers(int(stopped.sigval))
    codes = wait_for_codes(folder, workers, timeout_s)
    code = signalled_stop_code(codes, workers)
    if code is not None:
        return code
    signal_workers(signal.SIGKILL)
    held.show()  # some worker went before it could say why: torchrun's lines (then ours)
    if not isinstance(stopped, SignalException):
        raise stopped
    print(f"launch: stopped by {signal.Signals(stopped.sigval).name} before every rank stopped on its "
          f"own ({len(codes)} of {workers} left an exit code): a rank still starting has no "
          "checkpoint to leave; any rank's own traceback is above", file=sys.stderr)
    return 128 + int(stopped.sigval)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs torchrun's agent on `argv` (torchrun's command line); the exit code (module docstring)."""
    args = torchrun.parse_args(list(sys.argv[1:] if argv is None else argv))
    problem = args_problem(args)
    if problem is not None:
        print(f"launch: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
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
            return stopped_by_agent(stopped, folder, workers, args.shutdown_timeout or SHUTDOWN_TIMEOUT_S, held)
        held.show()
    return 0


if __name__ == "__main__":
    sys.exit(main())
