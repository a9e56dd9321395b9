#!/usr/bin/env python3
"""`NCCL_TEST=1`'s pre-flight: a short all-reduce bandwidth check, one process per GPU (`mlperf_bert.runtime.preflight`).

run.sub starts it with srun, run_with_docker.sh through pytorch/launch.py (torchrun), before the
first run; it imports the `mlperf_bert` package beside it, as run_pretraining.py does.
"""

import sys

from mlperf_bert.runtime.preflight import main

if __name__ == "__main__":
    sys.exit(main())
