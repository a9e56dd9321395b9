#!/usr/bin/env python3
"""Build, check and score an MLPerf Training submission package for BERT.

    python tools/package_results.py --help

The code is `mlperf_tools/results/package_results.py` (tools/README.md lists every tool by kind).
"""

import sys

from mlperf_tools.entry import installed

with installed():
    from mlperf_tools.results.package_results import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
