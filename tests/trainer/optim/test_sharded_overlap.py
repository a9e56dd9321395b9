"""The sharded optimizer's reduce-scatters start during the backward: the order of gradients and collectives.

One process. A recorder notes, in order, every parameter's gradient becoming ready (a
post-accumulate-grad hook registered before DDP's own) and every collective the step issues
(the `dist` functions wrapped). Two set-ups: the dry run's `BucketedDataParallel` on torch's
fake process group at 4 ranks (collectives checked, nothing exchanged), and PyTorch's own DDP
on a one-rank gloo group (its C++ reducer calls the comm hooks). The arithmetic is checked
elsewhere (tests/trainer/optim/test_sharded_ranks.py, tests/trainer/optim/test_sharded_optimizer.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from mlperf_bert.dryrun.bucketed import BucketedDataParallel
from mlperf_bert.dryrun.run import fake_process_group
from mlperf_bert.optim.clipping import ClipConfig, ClipMode, apply_clip_mode, optimizer_clip_norm
from mlperf_bert.optim.optimizers import parameter_groups
from mlperf_bert.optim.sharded import build_sharded_optimizer
from tests.harness.workers.sharded import watching

LAYERS, WIDTH = 6, 32
BUCKET_CAP_MB = 5000 / 2**20  # about one layer (1,056 floats) a bucket
BLOCK_NUMEL = 1024  # one weight matrix a block; the biases share one


@contextmanager
def one_rank_gloo(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def steps(wrapper: str, mode: ClipMode, tmp_path: Path, count: int = 3) -> list[str]:
    """`count` steps of a 6-layer MLP, sharded; the events of the last one (bucket-wise clipping
    launches at once from its third synchronized backward on)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    events: list[str] = []
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(lambda _: events.append("grad"))
    context = fake_process_group(4) if wrapper == "bucketed" else one_rank_gloo(tmp_path)
    with context:
        ddp = BucketedDataParallel(net, bucket_cap_mb=BUCKET_CAP_MB) if wrapper == "bucketed" else \
            DistributedDataParallel(net, bucket_cap_mb=BUCKET_CAP_MB)
        config = ClipConfig(mode, 1.0)
        opt = build_sharded_optimizer(parameter_groups(net, 0.01), "lamb", 1e-3, (0.9, 0.999), 1e-6, 0.01,
                                      optimizer_clip_norm(config), block_numel=BLOCK_NUMEL)
        apply_clip_mode(ddp, config, reduces=False, sink=opt.shards)
        with watching(events.append):
            for _ in range(count):
                events.clear()
                ddp(torch.randn(4, WIDTH)).square().sum().backward()
                events.append("backward ended")
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert len(opt.shards.blocks) == LAYERS + 1
    return events


@pytest.mark.parametrize("wrapper", ["bucketed", "ddp"])
@pytest.mark.parametrize("mode", [ClipMode.NONE, ClipMode.AFTER_ALLREDUCE, ClipMode.BUCKETWISE])
def test_the_first_reduce_scatter_starts_before_the_last_gradient_is_ready(wrapper, mode, tmp_path):
    events = steps(wrapper, mode, tmp_path)
    last_grad = len(events) - 1 - events[::-1].index("grad")
    first = events.index("reduce_scatter_single")
    assert first < last_grad, events
    # every block's reduce-scatter within the backward, every all-gather in the step after it
    assert events[: events.index("backward ended")].count("reduce_scatter_single") == LAYERS + 1, events
    assert events.index("all_gather_single") > events.index("backward ended")
    assert events.count("all_gather_single") == LAYERS + 1


@pytest.mark.parametrize("wrapper", ["bucketed", "ddp"])
def test_before_allreduce_reduce_scatters_only_after_the_whole_backward(wrapper, tmp_path):
    """It clips by the norm of the whole local gradient, known only once the last bucket is in:
    no reduce-scatter can start earlier (the one mode that does not overlap)."""
    events = steps(wrapper, ClipMode.BEFORE_ALLREDUCE, tmp_path, count=2)
    last_grad = len(events) - 1 - events[::-1].index("grad")
    assert events.index("reduce_scatter_single") > last_grad, events
    assert events.count("reduce_scatter_single") == LAYERS + 1
