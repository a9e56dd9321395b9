#!/usr/bin/env python3
"""torchrun for the trainer: `python pytorch/launch.py <torchrun's flags> pytorch/run_pretraining.py <flags>`.

run_and_time.sh starts several ranks per node through this file (`mlperf_bert.runtime.launch`):
torchrun's agent, but a rank's own stop reaches the user as its one line and its exit code.
Like run_pretraining.py, it imports the `mlperf_bert` package beside it.
"""

import os
import sys

# torch's C++ log lines (not its Python warnings) at ERROR, read as torch loads, for the agent and
# its workers, unless TORCH_CPP_LOG_LEVEL is set: when a node dies, each client of a rendezvous
# store it served (an agent under c10d, a rank's heartbeat) prints 15 lines of C++ frames per call
# before Python hears of it and says in one line what was lost.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from mlperf_bert.runtime.launch import main  # noqa: E402  (after the log level)

if __name__ == "__main__":
    sys.exit(main())
