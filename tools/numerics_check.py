#!/usr/bin/env python3
"""Layer-by-layer numerics of the model under test against an fp64 reference on the CPU.

    python tools/numerics_check.py --help

The code is `mlperf_tools/bring_up/numerics_check.py` (tools/README.md lists every tool by kind).
"""

import sys

from mlperf_tools.entry import installed

with installed():
    from mlperf_tools.bring_up.numerics_check import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
