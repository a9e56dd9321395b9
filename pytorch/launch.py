#!/usr/bin/env python3
"""torchrun for the trainer: `python pytorch/launch.py <torchrun's flags> pytorch/run_pretraining.py <flags>`.

run_and_time.sh starts several ranks per node through this file (`mlperf_bert.runtime.launch`):
torchrun's agent, but a rank's own stop reaches the user as its one line and its exit code.
Like run_pretraining.py, it imports the `mlperf_bert` package beside it.
"""

import sys

from mlperf_bert.runtime.launch import main

if __name__ == "__main__":
    sys.exit(main())
