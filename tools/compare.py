#!/usr/bin/env python3
"""Side-by-side report of MLPerf BERT result folders (ours or any vendor's published logs).

    python tools/compare.py --help

The code is `mlperf_tools/results/compare.py` (tools/README.md lists every tool by kind).
"""

import sys

from mlperf_tools.entry import installed

with installed():
    from mlperf_tools.results.compare import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
