#!/usr/bin/env python3
"""Kill soak: a run killed at random moments and resumed each time must end like one left alone.

    python tools/kill_soak.py --help

The code is `mlperf_tools/testing/kill_soak.py` (tools/README.md lists every tool by kind).
"""

import sys

from mlperf_tools.entry import installed

with installed():
    from mlperf_tools.testing.kill_soak import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
