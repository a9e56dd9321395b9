#!/usr/bin/env python3
"""When will this run reach 0.720, and will its samples to converge pass the RCP check?

    python tools/forecast.py --help

The code is `mlperf_tools/planning/forecast.py` (tools/README.md lists every tool by kind).
"""

import sys

from mlperf_tools.entry import installed

with installed():
    from mlperf_tools.planning.forecast import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
