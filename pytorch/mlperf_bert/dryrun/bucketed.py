"""`BucketedDataParallel`: DDP's gradient exchange in Python, for the multi-rank dry run.

DDP's C++ reducer copies gradients into buckets it allocates itself and cannot take fake
tensors ("data is not allocated yet"). The dry run still needs the trainer's gradient exchange
on every path: the default all-reduce, and the clipping modes' comm hooks, which
`clipping.apply_clip_mode` registers on the DDP object. So this stand-in is a
`DistributedDataParallel` whose constructor builds no reducer (`build.Supplied.ddp` makes it
in DDP's place, and the trainer's `isinstance` checks hold); it overrides the part of DDP's
interface the trainer uses (`module`, `process_group`, `no_sync`, `register_comm_hook`,
forward) and at the end of each synchronized backward hands flat buckets, in DDP's order
(reverse parameter order, the first bucket capped at 1 MiB, then 25 MiB), to the registered
hook, or all-reduces their mean when none is registered. The collectives are real calls on
torch's fake process group (backend "fake", any world size), so their arguments are checked.

The choice over explicit all-reduces written into the dry run: the comm hooks under test are
the trainer's own (`clipping.py`), called through DDP's own hook protocol (`GradBucket`
methods `index`, `buffer`, `is_last`), so a hook that works here meets the same calls on a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        raise RuntimeError("a bucket holds only parameters that have a gradient")
    return p.grad


class Bucket:
    """The `dist.GradBucket` methods comm hooks call."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], is_last: bool) -> None:
        self._index, self._params, self._is_last = index, params, is_last
        self._buffer = torch.cat([_grad(p).reshape(-1) for p in params])

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def is_last(self) -> bool:
        return self._is_last

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        return [_grad(p) for p in self._params]

    def write_back(self, reduced: torch.Tensor) -> None:
        offset = 0
        for p in self._params:
            grad = _grad(p)
            n = grad.numel()
            grad.copy_(reduced[offset : offset + n].view_as(grad))
            offset += n


def bucket_params(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """DDP's first layout: reverse parameter order, 1 MiB first bucket, 25 MiB after."""
    buckets: list[list[torch.nn.Parameter]] = [[]]
    size, cap = 0, FIRST_BUCKET_BYTES
    for p in reversed(params):
        if buckets[-1] and size + p.numel() * p.element_size() > cap:
            buckets.append([])
            size, cap = 0, BUCKET_BYTES
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    return buckets


def _mean_all_reduce(_: Any, bucket: Bucket) -> torch.futures.Future:
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda done: done.value()[0])


class BucketedDataParallel(DistributedDataParallel):
    """The trainer-facing part of DistributedDataParallel, with buckets handled in Python."""

    def __init__(self, module: torch.nn.Module) -> None:
        torch.nn.Module.__init__(self)  # not DDP's: no reducer, no broadcast of the weights
        self.module = module
        if dist.group.WORLD is None:
            raise RuntimeError("BucketedDataParallel needs a process group: call dist.init_process_group first")
        self.process_group = dist.group.WORLD
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._hook: tuple[Any, Callable[[Any, Bucket], torch.futures.Future]] = (None, _mean_all_reduce)
        self._sync, self._queued = True, False
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        self._hook = (state, hook)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _on_grad(self, _: torch.Tensor) -> None:
        if self._sync and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._exchange)

    def _exchange(self) -> None:
        self._queued = False
        groups = bucket_params([p for p in self._params if p.grad is not None])
        state, hook = self._hook
        buckets = [Bucket(i, params, i == len(groups) - 1) for i, params in enumerate(groups)]
        # Every bucket is handed over before any is waited for, as DDP does: a hook may hold
        # buckets back until the last one arrives (clipping's before_allreduce).
        futures = [hook(state, bucket) for bucket in buckets]
        for bucket, future in zip(buckets, futures):
            bucket.write_back(future.wait())
