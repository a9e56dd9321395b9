#!/usr/bin/env python3
"""Checks that imports flow one way in the packages, the tools and the benchmarks.

    python tools/check_layering.py --help

The code is `mlperf_tools/testing/check_layering.py` (tools/README.md lists every tool by kind).
"""

import sys

from mlperf_tools.entry import installed

with installed():
    from mlperf_tools.testing.check_layering import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
