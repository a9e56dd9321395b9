#!/usr/bin/env python3
"""Summary and curves of a finished run, rebuilt from its logs.

    python tools/replay_run.py --help

The code is `mlperf_tools/results/replay_run.py` (tools/README.md lists every tool by kind).
"""

import sys

from mlperf_tools.entry import installed

with installed():
    from mlperf_tools.results.replay_run import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
