"""`BucketedDataParallel`: DDP's gradient exchange in Python, for the multi-rank dry run.

DDP's C++ reducer copies gradients into buckets it allocates itself and cannot take fake
tensors ("data is not allocated yet"). The dry run still needs the trainer's gradient exchange
on every path: the default all-reduce, and the clipping modes' comm hooks, which
`clipping.apply_clip_mode` registers on the DDP object. So this stand-in is a
`DistributedDataParallel` whose constructor builds no reducer (`build.Supplied.ddp` makes it
in DDP's place, and the trainer's `isinstance` checks hold); it overrides the part of DDP's
interface the trainer uses (`module`, `process_group`, `no_sync`, `register_comm_hook`,
forward) and, in each synchronized backward, hands flat buckets in DDP's order (reverse
parameter order, the first bucket capped at 1 MiB, then `bucket_cap_mb`, 25 MiB by default)
to the registered hook, or all-reduces their mean when none is registered. As DDP does, a
bucket goes over as soon as its last gradient is accumulated and every earlier bucket has gone
(so a hook's collectives start during the backward), and the results are written back into
the gradients at the end of the backward. The collectives are real calls on
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


def bucket_params(params: list[torch.nn.Parameter], bucket_bytes: int = BUCKET_BYTES) -> list[list[torch.nn.Parameter]]:
    """DDP's first layout: reverse parameter order, first bucket at most 1 MiB, `bucket_bytes` after."""
    buckets: list[list[torch.nn.Parameter]] = [[]]
    size, cap = 0, min(FIRST_BUCKET_BYTES, bucket_bytes)
    for p in reversed(params):
        if buckets[-1] and size + p.numel() * p.element_size() > cap:
            buckets.append([])
            size, cap = 0, bucket_bytes
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    return buckets


def _mean_all_reduce(_: Any, bucket: Bucket) -> torch.futures.Future:
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda done: done.value()[0])


class BucketedDataParallel(DistributedDataParallel):
    """The trainer-facing part of DistributedDataParallel, with buckets handled in Python."""

    def __init__(self, module: torch.nn.Module, bucket_cap_mb: float = BUCKET_BYTES / 2**20) -> None:
        torch.nn.Module.__init__(self)  # not DDP's: no reducer, no broadcast of the weights
        self.module = module
        if dist.group.WORLD is None:
            raise RuntimeError("BucketedDataParallel needs a process group: call dist.init_process_group first")
        self.process_group = dist.group.WORLD
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._layout = bucket_params(self._params, max(1, int(bucket_cap_mb * 2**20)))
        self._bucket_of = {id(p): b for b, params in enumerate(self._layout) for p in params}
        self._hook: tuple[Any, Callable[[Any, Bucket], torch.futures.Future]] = (None, _mean_all_reduce)
        self._sync, self._queued = True, False
        self._reset()
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _reset(self) -> None:
        self._ready = [0] * len(self._layout)
        self._launched: list[tuple[Bucket, torch.futures.Future]] = []

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

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self._ready[self._bucket_of[id(p)]] += 1
        while len(self._launched) < len(self._layout) and self._complete(len(self._launched)):
            self._launch(len(self._launched))

    def _complete(self, b: int) -> bool:
        return self._ready[b] == len(self._layout[b])

    def _launch(self, b: int) -> None:
        params = [p for p in self._layout[b] if p.grad is not None]  # all, but at the end of a backward
        state, hook = self._hook
        bucket = Bucket(b, params, b == len(self._layout) - 1)
        self._launched.append((bucket, hook(state, bucket)))

    def _finish(self) -> None:
        """At the end of the backward: buckets left (a parameter that got no gradient) go now; then
        every bucket is waited for, as DDP does after handing all of them over (a hook may hold
        buckets back until the last one arrives: clipping's before_allreduce)."""
        self._queued = False
        while len(self._launched) < len(self._layout):
            self._launch(len(self._launched))
        for bucket, future in self._launched:
            bucket.write_back(future.wait())
        self._reset()
