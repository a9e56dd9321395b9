#!/usr/bin/env python3
"""Simulates the per-GPU token counts of one training step under each load-balancing policy.

    python tools/simulate_balance.py --help

The code is `mlperf_tools/planning/simulate_balance.py` (tools/README.md lists every tool by kind).
"""

import sys

from mlperf_tools.entry import installed

with installed():
    from mlperf_tools.planning.simulate_balance import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
