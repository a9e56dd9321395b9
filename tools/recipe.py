#!/usr/bin/env python3
"""A BERT recipe for N accelerators: global batch, per-device batch, accumulation, hyperparameters.

    python tools/recipe.py --help

The code is `mlperf_tools/planning/recipe.py` (tools/README.md lists every tool by kind).
"""

import sys

from mlperf_tools.entry import installed

with installed():
    from mlperf_tools.planning.recipe import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
