#!/usr/bin/env python3
"""Mutation testing: do the targeted tests fail on the bugs a later edit could plant?

    python tools/mutants.py --help

The code is `mlperf_tools/testing/mutants.py` (tools/README.md lists every tool by kind).
"""

import sys

from mlperf_tools.entry import installed

with installed():
    from mlperf_tools.testing.mutants import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
