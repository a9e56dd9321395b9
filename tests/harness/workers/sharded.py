"""One rank of the sharded-optimizer runs in test_sharded_optimizer.py (gloo on 127.0.0.1).

Usage: python -m tests.harness.workers.sharded OUT_DIR JOB[,JOB...] RANK WORLD NAME [JOB[,JOB...] RANK WORLD NAME ...]

Each group of four: jobs run one after the other in one process group of WORLD ranks, the world
called NAME, whose port its rank 0 takes when it gets there (`ports.agreed_port`, in
OUT_DIR/NAME.port). Each rank saves what it saw to OUT_DIR/<job>-w<WORLD>-rank<RANK>.pt (a ':' in
the job's name written '-from-'; the test compares). The groups run one after the other in this
process, so one Python start-up serves a rank's part in several worlds. The jobs:
- `equality`: for LAMB and ADAM and every clip mode, the same tiny BERT trained twice from the
  same weights on the same per-rank batches (two micro-batches per step, fp32): DDP with the
  unsharded `ForeachLamb` / `ForeachAdamW`, and DDP (hooks not reducing, each bucket handed to
  the sharded optimizer's reduce-scatter as the backward produces it) with the sharded one, in
  blocks of BLOCK_NUMEL elements. The collectives of each sharded step are counted.
- `grouped`: LAMB, sharded within groups of GROUP_SIZE ranks and all-reduced across them
  (`sharded.shard_groups`), in the clip modes of the 128x8 configs (the test compares it with
  the unsharded runs of `equality`).
- `fp16`: loss scaling on the device with overflows on rank 1 only, the step a `GraphedStep`
  (uncaptured off a GPU): unsharded capturable LAMB against the sharded capturable LAMB.
- `save` / `resume`: portable checkpoints. Four virtual ranks' batches make every step's global
  batch; a run of W ranks takes 4/W of them per rank as micro-batches, so every world size
  trains on the same global batches. `save-sharded` / `save-unsharded` train STEPS steps,
  writing a run checkpoint (`train.checkpoint.Checkpointer`) into OUT_DIR/<job>-w<WORLD> after
  SAVE_AT; `resume-sharded:SAVED` / `resume-unsharded:SAVED` load the checkpoint of the save job
  SAVED (e.g. `save-sharded-w4`) and train the rest, after checking that states which do not
  fit are refused. A resume waits for that checkpoint, which another process may still be writing
  (it appears whole: the checkpointer renames a finished file into place).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, ContextManager, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from mlperf_bert.optim.capturable import capturable
from mlperf_bert.optim.clipping import ClipConfig, ClipMode, apply_clip_mode, optimizer_clip_norm
from mlperf_bert.optim.loss_scale import DeviceLossScaler
from mlperf_bert.optim.optimizers import build_optimizer, parameter_groups
from mlperf_bert.optim.sharded import ShardedKernels, build_sharded_optimizer, shard_groups
from mlperf_bert.runtime.distributed import DistEnv
from mlperf_bert.train.checkpoint import Checkpointer, TrainingParts, read_checkpoint
from mlperf_bert.train.step import EagerStep, GraphedStep, Step
from tests.harness.ports import agreed_port
from tests.harness.workers.graphed_step import (ACCUMULATION, BUCKET_CAP_MB, GROWTH_INTERVAL, INIT_SCALE, MAX_NORM,
                                                SCHEDULE, examples, flat, model, overflow_on, rows, settle)

STEPS = 6
SAVE_AT = 3
VIRTUAL_RANKS = 4
COUNTED = ("all_reduce", "reduce_scatter_single", "all_gather_single")
BLOCK_NUMEL = 1500  # the tiny model's 6,722 parameters in 5 blocks
GROUP_SIZE = 2


@contextmanager
def watching(note: Callable[[str], None], names: tuple[str, ...] = COUNTED) -> Iterator[None]:
    """note(name) at every call of the collectives a step may make (the module attributes the
    trainer calls), before the call."""
    originals = {name: getattr(dist, name) for name in names}

    def watched(name: str) -> Callable:
        def call(*args, **kwargs):
            note(name)
            return originals[name](*args, **kwargs)
        return call

    for name in names:
        setattr(dist, name, watched(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def counting(counts: Counter) -> ContextManager[None]:
    """Counts the calls of the collectives a step may make."""
    return watching(lambda name: counts.update([name]))


def optimizer(net: torch.nn.Module, name: str, mode: ClipMode, sharded: bool, group_size: int = 0
              ) -> torch.optim.Optimizer:
    args = (parameter_groups(net, 0.01), name, SCHEDULE.base_lr, (0.9, 0.999), 1e-6, 0.01,
            optimizer_clip_norm(ClipConfig(mode, MAX_NORM)))
    if not sharded:
        return build_optimizer(*args, implementation="foreach")
    return build_sharded_optimizer(*args, "foreach", *shard_groups(group_size), block_numel=BLOCK_NUMEL)


def wrap(net: torch.nn.Module, name: str, mode: ClipMode, sharded: bool, group_size: int = 0):
    """DDP, then the optimizer (the sharded one flattens the weights DDP broadcast), then the hooks,
    which hand each bucket to the sharded optimizer's reduce-scatter."""
    ddp = DistributedDataParallel(net, bucket_cap_mb=BUCKET_CAP_MB)
    opt = optimizer(net, name, mode, sharded, group_size)
    sink = opt.shards if isinstance(opt, ShardedKernels) else None
    return ddp, opt, apply_clip_mode(ddp, ClipConfig(mode, MAX_NORM), reduces=not sharded, sink=sink)


def train(step: Step, net: torch.nn.Module, rank: int, counts: Counter) -> dict:
    """STEPS steps: the losses, the final weights, and each weight's path (the sum of its moves)."""
    losses, before, path = [], flat(net), torch.zeros_like(flat(net))
    for index in range(STEPS):
        with counting(counts):
            result = step([rows(rank, index, m) for m in range(ACCUMULATION)], SCHEDULE.lr_at(index))
        losses.append(float(result.loss))
        after = flat(net)
        path += (after - before).abs()
        before = after
    return {"losses": losses, "weights": before, "path": path}


def equality(rank: int, names: tuple[str, ...] = ("lamb", "adam"), modes: tuple[ClipMode, ...] = tuple(ClipMode),
             group_size: int = 0, kinds: tuple[bool, ...] = (False, True)) -> dict:
    out: dict = {}
    for name in names:
        for mode in modes:
            run: dict = {}
            for sharded in kinds:
                net = model()
                ddp, opt, clip = wrap(net, name, mode, sharded, group_size)
                step = EagerStep(ddp, opt, "fp32", ACCUMULATION, clip=clip)
                settle(step, net, rank)
                counts: Counter = Counter()
                kind = "sharded" if sharded else "unsharded"
                run[kind] = {**train(step, net, rank, counts), "collectives": {k: v / STEPS for k, v in counts.items()},
                             "blocks": len(opt.shards.blocks) if isinstance(opt, ShardedKernels) else 0}
            out[f"{name}/{mode.value}"] = run
    return out


def fp16(rank: int) -> dict:
    out = {}
    for mode in (ClipMode.AFTER_ALLREDUCE, ClipMode.BUCKETWISE):
        run: dict = {}
        for sharded in (False, True):
            net = model()
            index = [-1]
            overflow_on(net, rank, lambda: index[0])
            ddp, opt, clip = wrap(net, "lamb", mode, sharded)
            scaler = DeviceLossScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
            step = GraphedStep(ddp, capturable(opt, SCHEDULE), examples(rank), "fp32", scaler=scaler, clip=clip)
            scales, before, path = [], flat(net), torch.zeros_like(flat(net))
            for i in range(STEPS):
                index[0] = i
                step([rows(rank, i, m) for m in range(ACCUMULATION)], 0.0)  # the device schedule sets the lr
                scales.append(float(scaler.scale_tensor))
                after = flat(net)
                path += (after - before).abs()
                before = after
            reading = scaler.read()
            run["sharded" if sharded else "unsharded"] = {
                "scales": scales, "applied": reading.applied_steps, "skipped": reading.skipped_steps,
                "weights": before, "path": path}
        out[mode.value] = run
    return out


def portable_step(net: torch.nn.Module, world: int, sharded: bool) -> tuple[EagerStep, torch.optim.Optimizer]:
    """After-reduction clipping, so the step's arithmetic does not depend on how many ranks share it."""
    mode = ClipMode.AFTER_ALLREDUCE
    if world > 1:
        module, opt, clip = wrap(net, "lamb", mode, sharded)
    else:
        module, opt, clip = net, optimizer(net, "lamb", mode, sharded), None
    return EagerStep(module, opt, "fp32", VIRTUAL_RANKS // world, clip=clip), opt


def global_batch(rank: int, world: int, step: int) -> list:
    share = VIRTUAL_RANKS // world
    return [rows(v, step, 0) for v in range(rank * share, (rank + 1) * share)]


def mean_loss(loss: torch.Tensor, world: int) -> float:
    loss = loss.detach().clone()
    if world > 1:
        dist.all_reduce(loss)
    return float(loss) / world


def save_or_resume(job: str, rank: int, world: int, out_dir: Path) -> dict:
    job, _, source = job.partition(":")
    sharded = job.endswith("-sharded")
    net = model()
    step, opt = portable_step(net, world, sharded)
    parts = TrainingParts(net, opt)
    first, refused = 0, []
    if job.startswith("resume"):
        ckpt = read_checkpoint(_when_written(out_dir / source / f"ckpt-{SAVE_AT:012d}.pt"))
        refused = refusals(opt, ckpt["optimizer"])
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        first = SAVE_AT
    denv = DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world, master_addr="127.0.0.1",
                   master_port=0)
    writer = Checkpointer(out_dir / f"{job}-w{world}", keep=1, denv=denv, device=torch.device("cpu"))
    losses, weights = [], [flat(net)]
    for index in range(first, STEPS):
        result = step(global_batch(rank, world, index), SCHEDULE.lr_at(index))
        losses.append(mean_loss(result.loss, world))
        weights.append(flat(net))
        if index + 1 == SAVE_AT and job.startswith("save"):
            writer.save(parts, {"samples": SAVE_AT}, {}, "test")
    return {"losses": losses, "weights": weights, "refusals": refused}


def _when_written(path: Path, timeout_s: float = 600) -> Path:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} was not written in {timeout_s:.0f} s")
        time.sleep(0.1)
    return path


def refusals(opt: torch.optim.Optimizer, state: dict) -> list[str]:
    """What loading a saved optimizer state altered not to fit says (a wrong shape; a group too many).
    Checked before anything is loaded, so `opt` is left as it was."""
    messages = []
    bad_shape = {**state, "state": {**state["state"], 2: {k: v[:1] for k, v in state["state"][2].items()}}}
    extra_group = {**state, "param_groups": state["param_groups"] + [state["param_groups"][-1]]}
    for bad in (bad_shape, extra_group):
        try:
            opt.load_state_dict(bad)
        except ValueError as err:
            messages.append(str(err))
    return messages


def run_world(jobs: list[str], rank: int, world: int, name: str, out_dir: Path) -> None:
    port = agreed_port(out_dir / f"{name}.port", rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for job in jobs:
        if job == "equality":
            record = equality(rank)
        elif job == "grouped":
            record = equality(rank, ("lamb",), (ClipMode.AFTER_ALLREDUCE, ClipMode.BUCKETWISE), GROUP_SIZE, (True,))
        elif job == "fp16":
            record = fp16(rank)
        else:
            record = save_or_resume(job, rank, world, out_dir)
        torch.save(record, out_dir / f"{job.replace(':', '-from-')}-w{world}-rank{rank}.pt")
    dist.destroy_process_group()


def main() -> None:
    out_dir, groups = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    for at in range(0, len(groups), 4):
        jobs, rank, world, name = groups[at:at + 4]
        run_world(jobs.split(","), int(rank), int(world), name, out_dir)


if __name__ == "__main__":
    main()
