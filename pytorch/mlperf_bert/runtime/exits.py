"""Every exit code of the trainer, in one place.

The launchers (`run_and_time.sh`, `run_with_docker.sh`, `run.sub`) and the docs read these
numbers; a change here is a change of the command-line contract.
"""

EXIT_OK = 0
EXIT_BAD_INPUT = 2  # a config, flag, dataset or checkpoint that cannot give a correct run
EXIT_DIVERGED = 3  # a numeric blow-up the run cannot step over
EXIT_IO_ERROR = 74  # sysexits EX_IOERR: an output could not be written
EXIT_PREEMPTED = 75  # sysexits EX_TEMPFAIL: stopped by SIGTERM / SIGUSR1 / Ctrl-C after a checkpoint
EXIT_LOST_RANK = 76  # sysexits EX_PROTOCOL: another rank died or stopped answering
EXIT_INTERRUPTED = 130  # a second Ctrl-C: the shell's code for death by SIGINT
