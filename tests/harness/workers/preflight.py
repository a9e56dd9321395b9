"""One rank of the NCCL_TEST pre-flight (`mlperf_bert.runtime.preflight`), its own work slowed when asked.

    python -m tests.harness.workers.preflight SLOW_RANK DELAY_S

RANK, WORLD_SIZE and MASTER_ADDR/PORT are set as torchrun sets them. The rank numbered SLOW_RANK sleeps
DELAY_S before each all-reduce: a GPU or host that is slow at its own work, which every other rank then
waits for inside the all-reduce.
"""

import os
import sys
import time

import torch

from mlperf_bert.runtime import preflight

slow_rank, delay = int(sys.argv[1]), float(sys.argv[2])
own_work = preflight.local_step


def slowed(buffer: torch.Tensor, value: float) -> None:
    time.sleep(delay)
    own_work(buffer, value)


if int(os.environ["RANK"]) == slow_rank:
    preflight.local_step = slowed
sys.exit(preflight.main())
