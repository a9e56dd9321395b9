"""Ranks as threads of one process: the sharded step's collectives (reduce-scatter, all-reduce,
all-gather) simulated by `Collectives`, summing the ranks' tensors in rank order, and the small
model, gradients and optimizers the sharded optimizer's tests step on them against the unsharded one."""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch

from mlperf_bert.optim import sharded
from mlperf_bert.optim.optimizers import build_optimizer, parameter_groups
from mlperf_bert.optim.sharded import build_sharded_optimizer

SHAPES = [(5, 3), (3,), (4, 4), (7,), (2, 3), (1,), (5,)]  # 53 elements: no world size divides them
LR, BETAS, EPS, WEIGHT_DECAY = 0.05, (0.9, 0.999), 1e-6, 0.01
STEPS = 3


class Done:
    """The handle of a simulated collective: it completed before the call returned."""

    def wait(self) -> bool:
        return True


class Collectives:
    """torch.distributed's calls of the sharded step, for W ranks that are threads of this process.

    A group is a tuple of ranks (None: all). Every rank makes the same calls in the same order, each
    on its own group (the sharded step does), so one barrier over all threads serves every group.
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * world
        self.local = threading.local()
        self.calls: list[str] = []  # rank 0's calls, in order

    def _members(self, group: tuple[int, ...] | None) -> tuple[int, ...]:
        return tuple(range(self.world)) if group is None else group

    def get_world_size(self, group: Any = None) -> int:
        return len(self._members(group))

    def get_rank(self, group: Any = None) -> int:
        return self._members(group).index(self.local.rank)

    def _exchange(self, tensor: torch.Tensor, group: Any, name: str) -> list[torch.Tensor]:
        if self.local.rank == 0:
            self.calls.append(name)
        self.slots[self.local.rank] = tensor.detach().clone()
        self.barrier.wait()
        gathered = [self.slots[r] for r in self._members(group)]
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return [t for t in gathered if t is not None]

    def all_reduce(self, tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Done:
        tensor.copy_(torch.stack(self._exchange(tensor, group, "all_reduce")).sum(0))
        return Done()

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, group: Any = None,
                              async_op: bool = False) -> Done:
        parts = torch.stack(self._exchange(input, group, "reduce_scatter")).sum(0).view(self.get_world_size(group), -1)
        output.copy_(parts[self.get_rank(group)])
        return Done()

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, group: Any = None,
                          async_op: bool = False) -> Done:
        output.copy_(torch.cat(self._exchange(input, group, "all_gather")))
        return Done()


def on_ranks(world: int, work: Callable[[int], Any], monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """work(rank) on `world` threads sharing simulated collectives; the results in rank order."""
    collectives = Collectives(world)
    monkeypatch.setattr(sharded, "dist", collectives)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        collectives.local.rank = rank
        try:
            results[rank] = work(rank)
        except BaseException as err:  # one rank failing must not leave the others waiting
            errors.append(err)
            collectives.barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), None)
    if first is not None or errors:
        raise first or errors[0]
    return results


def model() -> torch.nn.Module:
    """Decayed matrices and undecayed vectors (named so `parameter_groups` tells them apart)."""
    net = torch.nn.Module()
    generator = torch.Generator().manual_seed(0)
    for i, shape in enumerate(SHAPES):
        name = f"bias{i}" if len(shape) == 1 else f"weight{i}"
        net.register_parameter(name, torch.nn.Parameter(torch.randn(*shape, generator=generator)))
    return net


def local_grads(rank: int, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(*shape, generator=generator) for shape in SHAPES]


def mean_grads(world: int, step: int) -> list[torch.Tensor]:
    """What the reduce-scatter hands the ranks: the ranks' gradients / W, summed in rank order."""
    per_rank = [[g / world for g in local_grads(rank, step)] for rank in range(world)]
    return [torch.stack(parts).sum(0) for parts in zip(*per_rank)]


def optimizer(net: torch.nn.Module, name: str, max_grad_norm: float | None, sharded_: bool, lr: Any = LR,
              **layout: Any):
    groups = parameter_groups(net, WEIGHT_DECAY)
    if sharded_:
        return build_sharded_optimizer(groups, name, lr, BETAS, EPS, WEIGHT_DECAY, max_grad_norm, **layout)
    return build_optimizer(groups, name, lr, BETAS, EPS, WEIGHT_DECAY, max_grad_norm, implementation="foreach")


def set_grads(net: torch.nn.Module, grads: list[torch.Tensor]) -> None:
    for p, g in zip(net.parameters(), grads):
        p.grad = g.clone()


def weights(net: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in net.parameters()])


def unsharded_run(world: int, name: str, max_grad_norm: float | None, steps: int = STEPS):
    net = model()
    opt = optimizer(net, name, max_grad_norm, False)
    for step in range(steps):
        set_grads(net, mean_grads(world, step))
        opt.step()
    return net, opt


def sharded_step(net: torch.nn.Module, opt: Any, rank: int, world: int, step: int) -> None:
    set_grads(net, [g / world for g in local_grads(rank, step)])  # the comm hook's local bucket / W
    opt.step()


def handed_over_step(net: torch.nn.Module, opt: Any, rank: int, world: int, step: int,
                     calls: list[str] | None = None) -> list[int]:
    """As the comm hooks do during the backward: the local gradients / W in DDP's order (reverse
    parameter order, two parameters a bucket) into `take_bucket`, no `.grad` set; then the step.
    Returns how many collectives rank 0 had issued after each bucket."""
    issued = hand_over(net, opt, [g / world for g in local_grads(rank, step)], calls)
    opt.step()
    return issued


def hand_over(net: torch.nn.Module, opt: Any, grads: list[torch.Tensor], calls: list[str] | None = None) -> list[int]:
    params = list(net.parameters())
    order = list(reversed(range(len(params))))
    issued = []
    for start in range(0, len(order), 2):
        bucket = order[start : start + 2]
        opt.shards.take_bucket([params[i] for i in bucket], torch.cat([grads[i].reshape(-1) for i in bucket]))
        issued.append(len(calls) if calls is not None else 0)
    return issued
