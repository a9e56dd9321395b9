#!/usr/bin/env python3
"""MLPerf BERT phase-2 pretraining: `python pytorch/run_pretraining.py --help` lists the flags.

The work lives in the installed `mlperf_bert` package (`mlperf_bert.main`); this file is the
entry point the MLPerf layout and the launchers name.
"""

from mlperf_bert.train.faults import StopRequest
from mlperf_bert.main import exit_now, main
from mlperf_bert.runtime.orphan import stop_with_launcher

if __name__ == "__main__":
    stop_with_launcher()  # under pytorch/launch.py: stop if the launcher dies (runtime/orphan.py)
    exit_now(main(stop=StopRequest().install()))  # the handlers stay installed until the end
