"""A rank whose launcher died stops at once instead of training on as an orphan.

torchrun starts each worker in a session of its own, so when its agent is killed outright
(SIGKILL, the OOM killer, a crash of the agent) nothing stops the workers: they keep their
place in the process group and would train on with no launcher to collect their exit codes or
to stop them. `pytorch/launch.py` exports its pid (`MLPERF_BERT_LAUNCHER_PID`); a worker that
finds it asks the kernel (Linux `prctl(PR_SET_PDEATHSIG)`) for SIGHUP when its parent dies, then
checks its parent once more, since the launcher may have died before the request. On SIGHUP
with the launcher gone, the rank says so in one line (once per node, through the exit folder),
leaves exit code 76 and ends: a lost launcher is a lost part of the run, like a lost rank, and
there is no checkpoint (the other ranks stop too, as their collectives with this one fail:
`liveness.py` names it). A SIGHUP while the launcher lives is ignored (the workers have no
terminal to hang up).

The handler runs in the main thread between Python bytecodes. A main thread held in a CUDA wait
for a collective that never completes does not get there; the heartbeat thread of `liveness.py`
then ends the rank once its neighbour stays silent.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from types import FrameType
from typing import Mapping

from .exits import EXIT_LOST_RANK, record_exit_code, say_once

LAUNCHER_PID_VARIABLE = "MLPERF_BERT_LAUNCHER_PID"
LAUNCHER_LOST_SIGNAL = signal.SIGHUP
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def launcher_pid(environ: Mapping[str, str] = os.environ) -> int | None:
    """The pid `pytorch/launch.py` exported, or None (started otherwise, or not a pid)."""
    value = environ.get(LAUNCHER_PID_VARIABLE, "")
    return int(value) if value.isdigit() else None


def request_parent_death_signal(signum: int) -> bool:
    """Asks the (Linux) kernel for `signum` when this process's parent dies; whether it agreed."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def launcher_lost(pid: int) -> None:
    """One line for the node, exit code 76 left for the shell, and the end of this process."""
    say_once(f"error: the launcher of this node's ranks (torchrun agent, pid {pid}) died; its ranks stop with "
             f"exit code {EXIT_LOST_RANK} instead of training on without it (no checkpoint); resume from the "
             "newest checkpoint, if any")
    record_exit_code(EXIT_LOST_RANK)
    sys.stdout.flush()
    os._exit(EXIT_LOST_RANK)  # the main thread may be inside a collective: no teardown


def stop_with_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """Arms the stop (module docstring) when `pytorch/launch.py` started this process; whether it is armed."""
    pid = launcher_pid(environ)
    if pid is None or not sys.platform.startswith("linux"):
        return False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if os.getppid() != pid:
            launcher_lost(pid)

    signal.signal(LAUNCHER_LOST_SIGNAL, on_signal)
    if not request_parent_death_signal(LAUNCHER_LOST_SIGNAL):
        return False
    if os.getppid() != pid:  # died before the request: no signal will come
        launcher_lost(pid)
    return True
