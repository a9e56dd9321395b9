"""The LAMB / AdamW update in at most three passes (optim/fused.py).

- The passes of one step, counted as torch dispatches them (each op weighted by the share of the
  parameters' elements it sweeps): at most 3 for LAMB, unsharded, capturable or sharded; 17 before.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import test_sharded_ranks as ranks
from mlperf_bert.optim.capturable import capturable
from mlperf_bert.optim.optimizers import build_optimizer, parameter_groups


# ---------------------------------------------------------------- passes over the parameters


class Sweeps(TorchDispatchMode):
    """Each dispatched op's sweep: the elements of its largest tensor argument or result (a list of
    tensors counts as one), as a share of `numel`. A multi-tensor op over a group, or a fused pass,
    sweeps the group's share; an op on per-tensor norms sweeps next to nothing; a view, nothing. Ops
    dispatched while `COLLECTIVE.on` is set (a simulated collective's own arithmetic) are not the update's."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel = numel
        self.ops: list[tuple[str, float]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(COLLECTIVE, "on", False) or func.is_view:  # a view moves no data
            return out
        sizes = [sum(t.numel() for t in tree_flatten(a)[0] if isinstance(t, torch.Tensor))
                 for a in (*args, *kwargs.values(), out)]
        self.ops.append((func.__name__, max(sizes, default=0) / self.numel))
        return out

    @property
    def passes(self) -> float:
        return sum(share for _, share in self.ops)


COLLECTIVE = threading.local()


def layers() -> torch.nn.Module:
    """Decayed matrices and undecayed vectors, their elements many more than their tensors."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 64))


def step_sweeps(model: torch.nn.Module, optimizer: Any, numel: int) -> Sweeps:
    """The second step's sweeps (the first creates the state)."""
    for step in range(2):
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(4, 128, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
        if step == 1:
            with Sweeps(numel) as sweeps:
                optimizer.step()
        else:
            optimizer.step()
    return sweeps


@pytest.mark.parametrize("name,twin,passes", [("lamb", False, 3), ("lamb", True, 3), ("adam", False, 2)],
                         ids=["lamb", "lamb-capturable", "adamw"])
def test_one_step_sweeps_the_parameters_at_most_three_times(name, twin, passes):
    """Clipped: the gradient norm, then LAMB's moments-and-norms and apply passes (AdamW's one). Before
    the fused passes the same step swept them 17 times (docs/PERFORMANCE.md)."""
    model = layers()
    optimizer = build_optimizer(parameter_groups(model, 0.01), name, 1e-3, (0.9, 0.999), 1e-6, 0.01, 1.0, "foreach")
    if twin:
        optimizer = capturable(optimizer)
    sweeps = step_sweeps(model, optimizer, sum(p.numel() for p in model.parameters()))
    assert sweeps.passes <= passes + 0.05, sweeps.ops  # the rest: ops on per-tensor sums
    assert sweeps.passes > passes - 0.1, sweeps.ops  # the count is not blind: every pass is there


def test_one_sharded_step_sweeps_the_shard_at_most_three_times(monkeypatch):
    """At 2 ranks (threads, the gradients handed over as the comm hooks do): each rank sweeps its
    shard three times, the gradient's partial norms, the moments with the trust ratio's sums, the
    apply. The collectives' own copies are not counted (they move the data of the reduce-scatter
    and the all-gathers, which replace the unsharded all-reduce)."""
    world = 2
    for name in ("all_reduce", "reduce_scatter_single", "all_gather_single"):
        monkeypatch.setattr(ranks.Collectives, name, _uncounted(getattr(ranks.Collectives, name)))

    def work(rank: int) -> float:
        net = layers()
        opt = ranks.optimizer(net, "lamb", 0.5, True)
        shard = sum(p.numel() for slices in opt._slices for p in slices.params)
        for step in range(2):
            generator = torch.Generator().manual_seed(10 * step + rank)
            ranks.hand_over(net, opt, [torch.randn(p.shape, generator=generator) / world for p in net.parameters()])
            with Sweeps(shard) as sweeps:
                opt.step()
        assert sweeps.passes <= 3.05, sweeps.ops  # the rest: ops on per-tensor sums
        return sweeps.passes

    assert min(ranks.on_ranks(world, work, monkeypatch)) > 2.9  # each rank's shard: mostly decayed weights


def _uncounted(collective: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        COLLECTIVE.on = True
        try:
            return collective(*args, **kwargs)
        finally:
            COLLECTIVE.on = False
    return call
