"""BucketedDataParallel hands DDP's buckets to comm hooks as DDP does (real tensors, one rank)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mlperf_bert.dryrun.bucketed import FIRST_BUCKET_BYTES, BucketedDataParallel, bucket_params


def test_buckets_follow_ddp_layout() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, FIRST_BUCKET_BYTES // 4, 5, 7)]
    buckets = bucket_params(params)
    # reverse order; the first bucket closes at 1 MiB, the rest share the 25 MiB one
    assert [[p.numel() for p in b] for b in buckets] == [[7, 5], [FIRST_BUCKET_BYTES // 4, 10]]


def test_hook_sees_every_bucket_in_order_once_per_synchronized_backward(tmp_path: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.Linear(600, 3))
        ddp = BucketedDataParallel(model)
        seen: list[tuple[int, int, bool]] = []

        def hook(state: Any, bucket: Any) -> torch.futures.Future:
            seen.append((bucket.index(), bucket.buffer().numel(), bucket.is_last()))
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(bucket.buffer() * 2)
            return done

        ddp.register_comm_hook(None, hook)
        x = torch.randn(4, 600)
        with ddp.no_sync():
            ddp(x).sum().backward()
        assert seen == []
        local = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        ddp(x).sum().backward()
        sizes = [p.numel() for p in model.parameters()]
        assert [s[0] for s in seen] == list(range(len(seen))) and seen[-1][2] and sum(s[1] for s in seen) == sum(sizes)
        for p, g in zip(model.parameters(), local):
            torch.testing.assert_close(p.grad, 2 * g)  # the hook's result is written back
    finally:
        dist.destroy_process_group()
