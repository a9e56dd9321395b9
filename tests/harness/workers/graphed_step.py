"""One rank of the multi-process graphed-step runs in test_graphed_step_ranks.py (gloo on 127.0.0.1).

Usage: python -m tests.harness.workers.graphed_step RANK WORLD PORT OUT_DIR

The same tiny BERT, DDP-wrapped with small buckets (several per backward, so bucket-wise
clipping has something to divide), is trained twice from the same weights on the same
per-rank static packed batches:

Both start from DDP's settled bucket layout: the graphed step's capture warm-up lets DDP rebuild
its buckets (and the bucket-wise hook learn their number B) before the first real step, so the
eager step gets the same two warm-up steps, undone (`settle`); otherwise its first step would
clip bucket-wise with the construction-time layout's B.

- `modes`: for every clip mode, `EagerStep` against `GraphedStep` (two micro-batches per step,
  fp32). Off a GPU the graphed step runs its captured function uncaptured, with the capture's
  warm-up and restore, so this compares the arithmetic a CUDA graph would replay.
- `fp16`: loss scaling with overflows injected on rank 1 only: `EagerStep` on
  `torch.amp.GradScaler` with a plain LAMB counting its steps on the host and the learning rate
  from the host schedule, against `GraphedStep` on `DeviceLossScaler` with the capturable LAMB
  computing its learning rate from its device step count.

Each rank saves what it saw to OUT_DIR/rank{RANK}.pt; the test compares.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from mlperf_bert.data.batch import FlatBatch
from mlperf_bert.optim.clipping import ClipConfig, ClipMode, apply_clip_mode, optimizer_clip_norm
from mlperf_bert.optim.capturable import capturable
from mlperf_bert.optim.loss_scale import DeviceLossScaler
from mlperf_bert.model.bert import BertForPreTraining
from mlperf_bert.optim.optimizers import ForeachLamb, parameter_groups
from mlperf_bert.optim.schedule import LRSchedule
from mlperf_bert.data.static_batch import static_packed_batch
from mlperf_bert.train.step import EagerStep, GraphedStep, Step
from mlperf_bert.train.sync_window import StateDictSnapshot
from tests.harness.tiny_bert import MAX_PREDICTIONS, MAX_SEQS, ROW_LEN, TINY, make_rows

STEPS = 6
ACCUMULATION = 2
BUCKET_CAP_MB = 0.01  # about 2,600 floats: the tiny model's gradient arrives in several buckets
MAX_NORM = 0.05  # small enough that every clip mode clips
SCHEDULE = LRSchedule(base_lr=2e-2, max_steps=STEPS, warmup_steps=3)  # the lr changes every step
OVERFLOW_STEPS = {2, 3}  # on rank 1 only, two in a row
INIT_SCALE, GROWTH_INTERVAL = 2.0**10, 2


def rows(rank: int, step: int, micro: int) -> FlatBatch:
    rng = np.random.default_rng([rank, step + 1, micro])  # step -1: the capture example
    lengths = [tuple(int(x) for x in rng.integers(4, 8, size=3)) for _ in range(3)]
    return static_packed_batch(make_rows(rng, lengths), 3, ROW_LEN, MAX_SEQS, MAX_PREDICTIONS)


def model() -> BertForPreTraining:
    torch.manual_seed(0)
    return BertForPreTraining(TINY)


def lamb(net: torch.nn.Module, mode: ClipMode) -> ForeachLamb:
    norm = optimizer_clip_norm(ClipConfig(mode, MAX_NORM))
    return ForeachLamb(parameter_groups(net, 0.01), lr=SCHEDULE.base_lr, weight_decay=0.01, max_grad_norm=norm)


def wrap(net: torch.nn.Module, mode: ClipMode):
    ddp = DistributedDataParallel(net, bucket_cap_mb=BUCKET_CAP_MB)
    return ddp, apply_clip_mode(ddp, ClipConfig(mode, MAX_NORM))


def overflow_on(net: torch.nn.Module, rank: int, step_of: Callable[[], int]) -> None:
    """Rank 1's embeddings turn infinite at OVERFLOW_STEPS: a NaN loss and gradient there only."""

    def blow_up(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return output * float("inf") if rank == 1 and step_of() in OVERFLOW_STEPS else output

    net.bert.embeddings.register_forward_hook(blow_up)


def settle(step: EagerStep, net: torch.nn.Module, rank: int, scaler: torch.amp.GradScaler | None = None) -> None:
    """Two eager steps on the capture examples, then weights, optimizer and scaler as before."""
    snapshot = StateDictSnapshot(net, step.optimizer)
    scaler_state = scaler.state_dict() if scaler is not None else None
    for _ in range(2):
        step(examples(rank), SCHEDULE.base_lr)
    snapshot.restore()
    if scaler is not None:
        scaler.load_state_dict(scaler_state)


def examples(rank: int) -> list[FlatBatch]:
    return [rows(rank, -1, m) for m in range(ACCUMULATION)]  # what the graphed step captures, then undoes


def flat(net: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in net.parameters()]).clone()


def train(step: Step, rank: int, lr_at: Callable[[int], float], applied_steps: list[int]) -> list[dict]:
    seen = []
    for index in range(STEPS):
        result = step([rows(rank, index, m) for m in range(ACCUMULATION)], lr_at(applied_steps[0]))
        applied_steps[0] += result.applied
        seen.append({"loss": float(result.loss), "applied": result.applied})
    return seen


def compare_modes(rank: int) -> dict:
    out = {}
    for mode in ClipMode:
        eager_net, graph_net = model(), model()
        ddp, clip = wrap(eager_net, mode)
        eager = EagerStep(ddp, lamb(eager_net, mode), "fp32", ACCUMULATION, clip=clip)
        settle(eager, eager_net, rank)
        ddp, clip = wrap(graph_net, mode)
        graphed = GraphedStep(ddp, capturable(lamb(graph_net, mode)), examples(rank), "fp32", clip=clip)
        out[mode.value] = {
            "eager": train(eager, rank, SCHEDULE.lr_at, [0]), "eager_weights": flat(eager_net),
            "graphed": train(graphed, rank, SCHEDULE.lr_at, [0]), "graphed_weights": flat(graph_net),
        }
    return out


def compare_loss_scaling(rank: int) -> dict:
    out = {}
    for mode in (ClipMode.AFTER_ALLREDUCE, ClipMode.BEFORE_ALLREDUCE, ClipMode.BUCKETWISE):
        host_net, device_net = model(), model()
        host_steps, device_steps = [0], [0]
        index = {"host": -1, "device": -1}
        overflow_on(host_net, rank, lambda: index["host"])
        overflow_on(device_net, rank, lambda: index["device"])
        ddp, clip = wrap(host_net, mode)
        host_scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
        host = EagerStep(ddp, lamb(host_net, mode), "fp32", ACCUMULATION, scaler=host_scaler, clip=clip)
        settle(host, host_net, rank, host_scaler)
        ddp, clip = wrap(device_net, mode)
        device_scaler = DeviceLossScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
        device = GraphedStep(ddp, capturable(lamb(device_net, mode), SCHEDULE), examples(rank), "fp32",
                             scaler=device_scaler, clip=clip)
        host_scales, device_scales = [], []
        for step in range(STEPS):
            index["host"] = index["device"] = step
            batches = [rows(rank, step, m) for m in range(ACCUMULATION)]
            host_steps[0] += host(batches, SCHEDULE.lr_at(host_steps[0])).applied
            host_scales.append(host_scaler.get_scale())
            device(batches, 123.0)  # the host lr is ignored: the device schedule sets it
            device_scales.append(float(device_scaler.scale_tensor))
        reading = device_scaler.read()
        out[mode.value] = {"host_scales": host_scales, "device_scales": device_scales,
                           "host_applied": host_steps[0], "device_applied": reading.applied_steps,
                           "device_skipped": reading.skipped_steps, "in_a_row": reading.most_skips_in_a_row,
                           "host_weights": flat(host_net), "device_weights": flat(device_net)}
    return out


def main() -> None:
    rank, world, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    record = {"modes": compare_modes(rank), "fp16": compare_loss_scaling(rank)}
    torch.save(record, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
