#!/usr/bin/env python3
"""The figures of tools/gpu_perf.sh's steps in one line each.

    python tools/gpu_perf_report.py --help

The code is `mlperf_tools/bring_up/gpu_perf_report.py` (tools/README.md lists every tool by kind).
"""

import sys

from mlperf_tools.entry import installed

with installed():
    from mlperf_tools.bring_up.gpu_perf_report import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
