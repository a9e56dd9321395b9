"""`pytorch/launch.py` whose agent gets SIGTERM while it starts its workers: after the first worker
process exists and before torchrun tracks any (its handlers are made in one expression, which the
signal's exception leaves unfinished). What a SIGTERM sent the moment a worker appears meets now
and then on a loaded machine, made certain.

    python -m tests.harness.workers.race_launch <pytorch/launch.py's arguments>
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from torch.distributed.elastic.multiprocessing import api

from mlperf_bert.runtime.launch import main

_start_worker = api.get_subprocess_handler


def _start_then_signal(*args: Any, **kwargs: Any) -> Any:
    handler = _start_worker(*args, **kwargs)
    if kwargs.get("local_rank_id") == 0:
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun's handler raises at the next bytecode: here
    return handler


if __name__ == "__main__":
    api.get_subprocess_handler = _start_then_signal
    sys.exit(main())
