#!/usr/bin/env python3
"""Before the cluster hour: a config's device memory, step time and time to train, without a GPU.

    python tools/plan.py --help

The code is `mlperf_tools/planning/plan.py` (tools/README.md lists every tool by kind).
"""

import sys

from mlperf_tools.entry import installed

with installed():
    from mlperf_tools.planning.plan import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
