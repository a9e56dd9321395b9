"""One rank of the multi-process clipping runs in test_clipping.py (gloo on 127.0.0.1).

Usage: python -m tests.harness.workers.clipping RANK WORLD PORT OUT_DIR

Each rank trains small DDP models under every clip mode, first over all WORLD processes (the
default group), then over a subgroup of the first two (a real 2-process group, which also checks
that the hooks follow DDP's process group), and saves what it observed to OUT_DIR/rank{RANK}.pt,
keyed by group size: its own unclipped local gradients (from a plain, non-DDP copy of the
model on the same data), the gradients DDP left on the parameters, the hook's all-reduce
launches, when the first layer's gradient was computed, the non-finite votes and the bucket
layout DDP reports. The test computes what each mode should have produced from these.
"""

import copy
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mlperf_bert.optim.clipping import ClipConfig, ClipMode, apply_clip_mode

MAX_NORM = 1.0
LOSS_SCALE = 1024.0
# A 4 kB bucket cap closes a bucket at every 40x40 weight (6.4 kB): 4 buckets for 5 layers.
BUCKET_CAP_MB = 0.004
IN, WIDTH, OUT, BATCH = 16, 40, 8, 8
NONFINITE_STEP = 2  # first step with an overlapping bucket-wise hook
NONFINITE_LAYER = 4  # a middle Linear, so only one bucket overflows


def make_model() -> nn.Sequential:
    """Five Linear layers with tanh between them, with the same weights on every rank."""
    torch.manual_seed(1234)
    widths = [IN, WIDTH, WIDTH, WIDTH, WIDTH, OUT]
    layers: list[nn.Module] = []
    for n_in, n_out in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(n_in, n_out), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def make_batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Different data on every rank, step and micro-batch."""
    generator = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    x = torch.randn(BATCH, IN, generator=generator)
    target = 3.0 * torch.randn(BATCH, OUT, generator=generator)
    return x, target


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, target = batch
    return ((model(x) - target) ** 2).mean()


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def local_gradient(reference: nn.Module, batches: list) -> torch.Tensor:
    """The unclipped, unreduced gradient of this rank's step (summed over micro-batches)."""
    reference.zero_grad(set_to_none=True)
    for batch in batches:
        loss_of(reference, batch).backward()
    return flat_grad(reference)


def inject_inf(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")
    return grad


def ddp_step(ddp: DistributedDataParallel, batches: list, loss_scale: float, inject: bool) -> int:
    """Runs the step's micro-batches (all but the last under no_sync); returns when the first
    layer's weight gradient was computed in the synchronized backward (perf_counter_ns)."""
    model = ddp.module
    first_layer_ns: list[int] = []
    ddp.zero_grad(set_to_none=True)
    for micro, batch in enumerate(batches):
        last = micro == len(batches) - 1
        hooks = [model[0].weight.register_hook(lambda g: first_layer_ns.append(time.perf_counter_ns()))]
        if inject and last:
            hooks.append(model[NONFINITE_LAYER].weight.register_hook(inject_inf))
        with nullcontext() if last else ddp.no_sync():
            (loss_of(ddp, batch) * loss_scale).backward()
        for hook in hooks:
            hook.remove()
    return first_layer_ns[-1]


def run_scenario(group: dist.ProcessGroup | None, mode: ClipMode, steps: int, micro_batches: int = 1,
                 loss_scale: float = 1.0, inject_inf_on_rank: int | None = None) -> dict:
    rank = dist.get_rank(group)
    model = make_model()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB, process_group=group)
    initial_layout = ddp._get_ddp_logging_data()["bucket_sizes"]
    handle = apply_clip_mode(ddp, ClipConfig(mode, MAX_NORM))
    handle.set_loss_scale(loss_scale)
    record: dict = {"initial_bucket_sizes": initial_layout, "steps": []}
    for step in range(steps):
        batches = [make_batch(rank, step, m) for m in range(micro_batches)]
        inject = inject_inf_on_rank == rank and step == NONFINITE_STEP
        first_layer_ns = ddp_step(ddp, batches, loss_scale, inject)
        hook = handle.hook
        record["steps"].append({
            "local": local_gradient(reference, batches),
            "local_per_micro": [local_gradient(reference, [b]) for b in batches],
            "reduced": flat_grad(model) / loss_scale,
            "first_layer_ns": first_layer_ns,
            "launches": [] if hook is None else [(l.index, l.numel, l.time_ns) for l in hook.launches],
            "local_nonfinite": None if hook is None else bool(hook.local_flag()),
            "skip": _agreed_skip(handle),
        })
    record.update(ddp_layout(ddp, handle))
    return record


def _agreed_skip(handle) -> bool:
    """What every rank decides from the hooks' flags (False without a hook), read on the host."""
    flag = handle.nonfinite_flag()
    return flag is not None and bool(flag > 0)


def ddp_layout(ddp: DistributedDataParallel, handle) -> dict:
    """The bucket layout as DDP reports it, next to what the hook learned."""
    logging = ddp._get_ddp_logging_data()
    hook = handle.hook
    return {
        "param_numels": [p.numel() for p in ddp.module.parameters()],
        "rebuilt_bucket_sizes": logging.get("rebuilt_bucket_sizes"),
        "rebuilt_per_bucket_param_indices": logging.get("rebuilt_per_bucket_param_indices"),
        "reducer_num_buckets": len(ddp.reducer._get_zeros_like_grad_buckets()),
        "hook_num_buckets": getattr(hook, "num_buckets", None),
        "hook_bucket_numels": getattr(hook, "bucket_numels", None),
        "hook_backward_count": None if hook is None else hook.backward_count,
    }


def run_all(group: dist.ProcessGroup | None) -> dict:
    results = {}
    for mode in ClipMode:
        results[("plain", mode.value)] = run_scenario(group, mode, steps=4)
    for mode in (ClipMode.NONE, ClipMode.BEFORE_ALLREDUCE, ClipMode.BUCKETWISE):
        results[("accumulate", mode.value)] = run_scenario(group, mode, steps=3, micro_batches=2)
    for mode in (ClipMode.BEFORE_ALLREDUCE, ClipMode.BUCKETWISE):
        results[("scaled", mode.value)] = run_scenario(group, mode, steps=3, loss_scale=LOSS_SCALE)
        results[("nonfinite", mode.value)] = run_scenario(
            group, mode, steps=4, inject_inf_on_rank=dist.get_world_size(group) - 1
        )
    return results


def main(rank: int, world: int, port: int, out_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {world: run_all(None)}
        pair = dist.new_group([0, 1])  # every rank must take part in creating it
        if rank < 2:
            results[2] = run_all(pair)
        torch.save(results, out_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
