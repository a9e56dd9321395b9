"""Every exit code of the trainer, in one place.

The launchers (`run_and_time.sh`, `run_with_docker.sh`, `run.sub`) and the docs read these
numbers; a change here is a change of the command-line contract.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from pathlib import Path
from typing import Iterable, Mapping

EXIT_OK = 0
EXIT_BAD_INPUT = 2  # a config, flag, dataset or checkpoint that cannot give a correct run
EXIT_DIVERGED = 3  # a numeric blow-up the run cannot step over
EXIT_IO_ERROR = 74  # sysexits EX_IOERR: an output could not be written
EXIT_PREEMPTED = 75  # sysexits EX_TEMPFAIL: stopped by SIGTERM / SIGUSR1 / Ctrl-C after a checkpoint
EXIT_LOST_RANK = 76  # sysexits EX_PROTOCOL: another rank died or stopped answering, or this rank's launcher died
EXIT_INTERRUPTED = 130  # a second Ctrl-C: the shell's code for death by SIGINT

# The trainer's own exit codes after a stop it chose (it printed one line saying why); any other
# non-zero code is a crash (an uncaught exception gives 1, a signal its negative number).
TRAINER_EXITS = frozenset({EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_IO_ERROR, EXIT_PREEMPTED, EXIT_LOST_RANK,
                           EXIT_INTERRUPTED})

# The launchers' exit folder: every rank that stops with a code of its own leaves it there as
# <pid>.code (torchrun, mpiexec and srun replace the ranks' codes by their own), and writes each
# distinct error line there once, so that N ranks hitting the same bad input print it once.
EXIT_DIR_VARIABLE = "MLPERF_BERT_EXIT_DIR"


# A launch that started ranks on one node of several (torchrun once per node) learns through this
# file whether global rank 0 was among them: with torchrun's c10d rendezvous any node may get it,
# and that node's launch holds the MLPerf log lines and prints the RESULT line.
MAIN_RANK_FILE_VARIABLE = "MLPERF_BERT_MAIN_RANK_FILE"


def mark_main_rank(environ: Mapping[str, str] = os.environ) -> None:
    """Creates $MLPERF_BERT_MAIN_RANK_FILE (global rank 0 calls this), when the launch named one."""
    path = environ.get(MAIN_RANK_FILE_VARIABLE)
    if path:
        with contextlib.suppress(OSError):  # without it the launch prints no RESULT line; the run goes on
            Path(path).touch()


def exit_dir(environ: Mapping[str, str] = os.environ) -> Path | None:
    folder = environ.get(EXIT_DIR_VARIABLE)
    return Path(folder) if folder else None


def record_exit_code(code: int, environ: Mapping[str, str] = os.environ) -> None:
    """Leaves `code` in $MLPERF_BERT_EXIT_DIR/<pid>.code for the launcher, when it asked for it."""
    folder = exit_dir(environ)
    if code != 0 and folder is not None:
        with contextlib.suppress(OSError):  # the exit code itself still goes out; the launcher falls back to it
            Path(folder, f"{os.getpid()}.code").write_text(f"{code}\n")


def recorded_exit_codes(folder: Path) -> dict[int, int]:
    """pid -> code of the ranks that recorded one (a file cut short by a kill is skipped)."""
    codes = {}
    for path in folder.glob("*.code"):
        with contextlib.suppress(OSError, ValueError):
            codes[int(path.stem)] = int(path.read_text())
    return codes


def job_exit_code(codes: Iterable[int]) -> int:
    """The code a launcher reports for its ranks' codes: the lowest that is not a lost rank (the
    others' 76 is what they saw of the rank that failed first), else 76; 0 when none failed.
    run_and_time.sh applies the same rule to the files of an mpiexec launch."""
    failed = sorted({code for code in codes if code != 0})
    return next((code for code in failed if code != EXIT_LOST_RANK), failed[0] if failed else EXIT_OK)


def say_once(line: str, environ: Mapping[str, str] = os.environ) -> None:
    """Prints `line` on stderr unless another rank under the same launcher already printed it.

    The first rank to create `<exit folder>/said-<hash>` (exclusively) prints; without an exit
    folder every rank prints.
    """
    line = " ".join(line.split("\n"))  # one line, also when a library's message spans several
    folder = exit_dir(environ)
    if folder is not None:
        marker = folder / f"said-{hashlib.sha1(line.encode()).hexdigest()[:16]}"
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        except OSError:
            pass  # no folder to agree through: print
    print(line, file=sys.stderr, flush=True)
