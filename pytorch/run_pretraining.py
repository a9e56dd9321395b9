#!/usr/bin/env python3
"""MLPerf BERT phase-2 pretraining: `python pytorch/run_pretraining.py --help` lists the flags.

The work lives in the installed `mlperf_bert` package (`mlperf_bert.main`); this file is the
entry point the MLPerf layout and the launchers name. It checks the torch version first, before
importing the package, whose imports an older torch may fail with a traceback instead of the
one line that says what to use (`mlperf_bert.runtime.torch_version`).
"""

import sys

import torch

from mlperf_bert.runtime.exits import EXIT_BAD_INPUT
from mlperf_bert.runtime.torch_version import torch_too_old

if __name__ == "__main__":
    too_old = torch_too_old(torch.__version__)
    if too_old is not None:
        print(f"error: {too_old}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    from mlperf_bert.train.faults import StopRequest
    from mlperf_bert.main import exit_now, main
    from mlperf_bert.runtime.orphan import stop_with_launcher

    stop_with_launcher()  # under pytorch/launch.py: stop if the launcher dies (runtime/orphan.py)
    exit_now(main(stop=StopRequest().install()))  # the handlers stay installed until the end
