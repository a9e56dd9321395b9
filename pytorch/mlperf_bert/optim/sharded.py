"""Sharded LAMB and ADAM(W) (`--distributed_optimizer`): each rank updates 1/W of the parameters.

Unsharded, every rank all-reduces the whole gradient and then runs the whole update: for
BERT-Large at 2 packs per GPU about 28 bytes of optimizer traffic per parameter and step on
every GPU. Here, per step:

1. DDP runs the backward as before, but its comm hook does not reduce: it hands back the local
   bucket divided by W, clipped first in the modes that clip before the reduction
   (`clipping.apply_clip_mode(..., reduces=False)`).
2. The local gradients are copied into one flat buffer (every parameter, in optimizer-group
   order, padded to a multiple of W) and reduce-scattered (sum): rank r receives the mean
   gradient of the contiguous slice [r*S, (r+1)*S) of that buffer, its shard.
3. One all-reduce of partial sums: per tensor, the squared norms of this rank's piece of the
   gradient and (LAMB) of the weights, plus the folded non-finite flags. From it every rank
   knows the global gradient norm (clipping `after_allreduce`, and the fp16 overflow check:
   an inf/nan anywhere in any rank's local gradient reaches the reduced shard that owns it, so
   the summed norm is not finite on every rank) and each tensor's weight norm.
4. The moments and the update of the shard: the multi-tensor arithmetic of `ForeachLamb` /
   `ForeachAdamW` (`optimizers.adam_updates`), on the slices of the parameters the shard holds.
5. LAMB only: one all-reduce of the per-tensor squared norms of the update's pieces, then the
   trust ratios; `optimizers.apply_updates` applies lr * ratio * update to the shard.
6. One all-gather of the updated shards into the flat parameter buffer, which the model's
   parameters are views of: every rank holds all weights again.

Collectives per step: 1 reduce-scatter + 1 all-gather (the bytes of the all-reduce they
replace) + 1 small all-reduce (ADAM) or 2 (LAMB) of 2T+1 and T floats (T = number of
parameter tensors, 398 for BERT-Large): `tests/test_sharded_optimizer.py` counts them.

Why this implementation, and not a library's (the evidence):
- PyTorch FSDP2 (`fully_shard`) shards every parameter along dim 0 and replaces DDP. The
  clipping modes that clip before the reduction are DDP comm hooks over DDP's buckets
  (`clipping.py`); FSDP2 reduce-scatters per `fully_shard` unit (its
  `set_custom_reduce_scatter` could scale a unit's gradient), so `bucketwise` would clip per
  layer with another B, and `before_allreduce` needs the norm of the whole local gradient
  before the first reduce-scatter, which per-unit reduce-scatters launched during the
  backward do not wait for. It also re-gathers the parameters in every forward (per unit),
  a different traffic plan from one all-gather per step, and its per-unit hooks with their
  own streams and host-side state are not what PyTorch documents as capturable in a CUDA
  graph. Its per-tensor norms would still be partial sums to combine (the trust ratio): the
  same arithmetic as here.
- apex `DistributedFusedLAMB` (the NGC container) is not importable on this project's test
  machines, so nothing built on it could be tested here. In the source read for this choice
  it keeps its step count in a Python int and its overflow in a host flag
  (`optimizers.APEX_NOT_GRAPH_SAFE`; later versions may differ), and its
  state is packed per rank (fp32 master shards in its own block/chunk order), so a checkpoint
  could not move between sharded and unsharded runs or world sizes; its ADAM sibling
  (`DistributedFusedAdam`) has yet another layout.
- ZeroRedundancyOptimizer keeps DDP's all-reduce: it saves memory and math, not traffic.
So the reduce-scatter is this module's own, behind DDP's hook protocol: every clipping mode
keeps its hook, the CUDA-graphed step captures the collectives as it captures DDP's all-reduce
(no host read anywhere in the step), and the arithmetic is the unsharded optimizer's own.
What it does not do yet: overlap the reduce-scatter with the backward (NVIDIA's
`--dwu-overlap-reductions`, blocks launched as DDP hands buckets over), and the all-gather with
the next forward.

The gradient is copied into the flat buffer (8 bytes per parameter on every rank) rather than
kept there: making each `.grad` a view of the buffer saves that copy and one gradient's memory,
but autograd then adds every backward into the existing gradient (12 bytes per parameter,
where it otherwise takes the new gradient as it is) and the buffer must be zeroed each step
(4 more): twice the traffic of the copy, for memory BERT does not lack.

State and checkpoints. The moments live as two flat shard buffers (S floats each); each
parameter's `state` holds views of its slice of them (none where the shard holds no part of
it), so the device loss scaler and the sync window snapshot them as any optimizer state.
`state_dict()` (a collective: every rank calls it) all-gathers them and returns exactly the
unsharded optimizer's layout (whole `exp_avg` / `exp_avg_sq` per parameter, the group's
`step`), so a checkpoint does not depend on the number of ranks or on sharding: one saved at
4 sharded ranks resumes at 2, at 1, or unsharded, and an unsharded one resumes sharded.
`load_state_dict` checks that the state fits (`optimizers.check_state_fits`) and takes each
rank's slice.

Equality with the unsharded optimizer: the same formulas on the same numbers, except that a
tensor's norm is the square root of a sum of per-rank partial sums of squares instead of one
reduction, and the gradient's sum over ranks is taken by a reduce-scatter instead of an
all-reduce: both change results only by float rounding (reduction order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist

from .optimizers import (ForeachAdamW, ForeachKernels, ForeachLamb, LAMB_NAMES, LearningRate, adam_updates,
                         apply_updates, check_state_fits, clip_divisor, lamb_trust_ratio, _check_hyperparameters,
                         MOMENTS, _resolve_implementation)


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that this rank's shard holds."""

    tensor: int  # the parameter's index among all parameters, in group order
    param: torch.nn.Parameter
    shard: slice  # where it lies in the shard
    source: slice  # where it lies in the flattened parameter


def _slice(start: int, stop: int) -> slice:
    return slice(start, stop)


class Shards:
    """The flat layout of the parameters over the ranks, and the buffers on it.

    Every parameter of `groups` (in group order) lies in `flat_params` at its offset, and the
    parameter itself becomes a view of it (`.data` re-pointed), so the all-gather writes the
    weights in place. Rank r owns [r*S, (r+1)*S), S = ceil(total / W). Shared by an optimizer
    and its capturable twin (`capturable.capturable`).
    """

    def __init__(self, groups: list[list[torch.nn.Parameter]], process_group: dist.ProcessGroup | None) -> None:
        params = [p for group in groups for p in group]
        _check_flattenable(params)
        self.process_group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.total = sum(self.numels)
        self.shard_size = max(1, math.ceil(self.total / self.world))
        first = params[0]
        self.flat_params = first.new_zeros(self.world * self.shard_size)
        self.flat_grads = torch.zeros_like(self.flat_params)
        self.grad_shard = first.new_zeros(self.shard_size)
        self.moments = {name: first.new_zeros(self.shard_size) for name in MOMENTS}
        with torch.no_grad():
            for p, offset, n in zip(params, self.offsets, self.numels):
                view = self.flat_params[offset : offset + n].view_as(p)
                view.copy_(p)
                p.data = view
        self.grad_views = [self.flat_grads[o : o + n].view_as(p) for p, o, n in zip(params, self.offsets, self.numels)]
        self.pieces = self._pieces(groups)

    @property
    def start(self) -> int:
        return self.rank * self.shard_size

    def param_shard(self) -> torch.Tensor:
        return self.flat_params[self.start : self.start + self.shard_size]

    def _pieces(self, groups: list[list[torch.nn.Parameter]]) -> list[list[Piece]]:
        """Per group, the pieces of its parameters inside [start, start + S), in order."""
        lo, hi = self.start, self.start + self.shard_size
        pieces: list[list[Piece]] = []
        index = 0
        for group in groups:
            pieces.append([])
            for p in group:
                offset, n = self.offsets[index], self.numels[index]
                a, b = max(offset, lo), min(offset + n, hi)
                if a < b:
                    pieces[-1].append(Piece(index, p, _slice(a - lo, b - lo), _slice(a - offset, b - offset)))
                index += 1
        return pieces

    def full(self, shard: torch.Tensor) -> torch.Tensor:
        """A shard-sized buffer all-gathered into the flat layout (a collective)."""
        out = shard.new_empty(self.world * self.shard_size)
        dist.all_gather_single(out, shard, group=self.process_group)
        return out


def _check_flattenable(params: list[torch.nn.Parameter]) -> None:
    if not params:
        raise ValueError("the sharded optimizer needs at least one parameter")
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) != 1:
        raise ValueError(f"the sharded optimizer keeps all parameters in one flat buffer: they must share one dtype "
                         f"and device, got {sorted(str(k) for k in kinds)}")


@dataclass(frozen=True)
class _GroupSlices:
    """One group's pieces as the lists the multi-tensor kernels take."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]
    tensors: torch.Tensor  # int64 [pieces]: each piece's parameter index


class ShardedKernels(ForeachKernels):
    """The sharded step (module docstring) with `ForeachKernels`' arithmetic and state layout.

    param_groups hold the model's whole parameters, as the unsharded optimizer's do (the
    schedule, the loss scaler and the snapshots see the same groups); the state holds this
    rank's slices. Every parameter must have a gradient at each step (DDP's contract too).
    process_group: the ranks that share the parameters (None: the default group).
    shards: an existing layout to take over (the capturable twin's); None: built here, which
    re-points the parameters into the flat buffer.
    """

    def __init__(self, params: Iterable[Any], lr: LearningRate, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, max_grad_norm: float | None = None,
                 process_group: dist.ProcessGroup | None = None, shards: Shards | None = None) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, max_grad_norm)
        groups = [list(g["params"]) for g in self.param_groups]
        self.shards = shards if shards is not None else Shards(groups, process_group)
        self._params = [p for g in groups for p in g]
        self._slices = [self._group_slices(pieces) for pieces in self.shards.pieces]
        for pieces in self.shards.pieces:
            for piece in pieces:
                self.state[piece.param] = {k: self.shards.moments[k][piece.shard] for k in MOMENTS}
        device = self._params[0].device
        # 1 when the last step's gradient was not finite on some rank (or a folded flag was set): the
        # same on every rank. A fixed tensor, written in place (a graph reads its address).
        self.agreed_nonfinite = torch.zeros((), dtype=torch.float32, device=device)
        self._folded: torch.Tensor | None = None

    def _group_slices(self, pieces: list[Piece]) -> _GroupSlices:
        s = self.shards
        return _GroupSlices(
            params=[s.param_shard()[p.shard] for p in pieces], grads=[s.grad_shard[p.shard] for p in pieces],
            exp_avg=[s.moments["exp_avg"][p.shard] for p in pieces],
            exp_avg_sq=[s.moments["exp_avg_sq"][p.shard] for p in pieces],
            tensors=torch.tensor([p.tensor for p in pieces], dtype=torch.int64, device=s.flat_params.device))

    def _ensure_state(self, p: torch.Tensor) -> None:
        """The state exists from construction on (slices of the flat moments)."""

    def fold_flag(self, flag: torch.Tensor | None) -> None:
        """A rank-local device flag (> 0: skip) agreed in the next step's first collective, into
        `agreed_nonfinite` (e.g. a clipping hook's non-finite bucket norm). Not read here."""
        self._folded = flag

    # -- the step ---------------------------------------------------------------------------
    def _update(self) -> None:
        self._reduce_scatter()
        count = len(self._params)
        param_sq, grad_norms, flags = self._first_sums(count)
        global_norm = torch.linalg.vector_norm(grad_norms)
        self.agreed_nonfinite.copy_(((~torch.isfinite(global_norm)) | (flags > 0)).to(torch.float32))
        divisor = clip_divisor(global_norm, self.max_grad_norm) if self.max_grad_norm is not None else None
        updates = []
        for group, slices in zip(self.param_groups, self._slices):
            corrections = self._advance(group)  # every rank counts every group, pieces or not
            updates.append(adam_updates(group, slices.params, slices.grads, slices.exp_avg, slices.exp_avg_sq,
                                        divisor, corrections) if slices.params else [])
        ratios = self._trust_ratios(updates, param_sq, count) if self._any_trust_ratio() else None
        for group, slices, update in zip(self.param_groups, self._slices, updates):
            if not slices.params:
                continue
            scales: torch.Tensor | float = group["lr"]
            if ratios is not None and self._uses_trust_ratio(group):
                scales = ratios[slices.tensors] * group["lr"]
            apply_updates(slices.params, update, scales)
        s = self.shards
        dist.all_gather_single(s.flat_params, s.param_shard(), group=s.process_group)

    def _reduce_scatter(self) -> None:
        """Local gradients (already / W by the comm hook) into the flat buffer; the shard of their sum."""
        grads = []
        for index, p in enumerate(self._params):
            if p.grad is None:
                raise RuntimeError(f"parameter {index} ({tuple(p.shape)}) has no gradient: the sharded optimizer "
                                   "reduces every parameter's gradient each step")
            grads.append(p.grad)
        s = self.shards
        torch._foreach_copy_(s.grad_views, grads)
        dist.reduce_scatter_single(s.grad_shard, s.flat_grads, group=s.process_group)

    def _first_sums(self, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One all-reduce: per-tensor squared norms of the gradient and (LAMB) the weights, and the
        folded flags. Returns (the weights' squared norms [T], the gradient's norms [T], the flags' sum)."""
        sums = self.agreed_nonfinite.new_zeros(2 * count + 1)
        for group, slices in zip(self.param_groups, self._slices):
            if not slices.params:
                continue
            sums.index_add_(0, slices.tensors, _squares(slices.grads))
            if self._uses_trust_ratio(group):
                sums.index_add_(0, slices.tensors + count, _squares(slices.params))
        if self._folded is not None:
            sums[2 * count] = self._folded.to(sums.dtype)
            self._folded = None  # one step's flag
        dist.all_reduce(sums, group=self.shards.process_group)
        return sums[count : 2 * count], sums[:count].sqrt(), sums[2 * count]

    def _any_trust_ratio(self) -> bool:
        """Whether LAMB's second all-reduce runs: decided by the groups alone, the same on every rank."""
        return any(self._uses_trust_ratio(group) for group in self.param_groups)

    def _trust_ratios(self, updates: list[list[torch.Tensor]], param_sq: torch.Tensor, count: int) -> torch.Tensor:
        """LAMB's second all-reduce: the updates' per-tensor norms; ||p|| / ||update|| per tensor [T]."""
        update_sq = param_sq.new_zeros(count)
        for group, slices, update in zip(self.param_groups, self._slices, updates):
            if update and self._uses_trust_ratio(group):
                update_sq.index_add_(0, slices.tensors, _squares(update))
        dist.all_reduce(update_sq, group=self.shards.process_group)
        return lamb_trust_ratio(param_sq.sqrt(), update_sq.sqrt())

    # -- state: the unsharded layout ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The unsharded optimizer's state dict (whole moments per parameter). A collective."""
        packed = super().state_dict()
        s = self.shards
        full = {name: s.full(s.moments[name]) for name in MOMENTS}
        packed["state"] = {
            index: {name: full[name][o : o + n].view_as(p).clone() for name in MOMENTS}
            for index, (p, o, n) in enumerate(zip(self._params, s.offsets, s.numels))
        }
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads any LAMB/ADAM state of these parameters, sharded or not when saved: this rank's slices."""
        check_state_fits(self.param_groups, state_dict)
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            for key, value in saved.items():
                if key != "params":
                    _set_live(group, key, value)
            if "step" not in saved:  # saved before the first step: the count starts again
                _set_live(group, "step", 0)
        saved_state = state_dict["state"]
        indices = [i for saved in state_dict["param_groups"] for i in saved["params"]]
        with torch.no_grad():
            for pieces in self.shards.pieces:
                for piece in pieces:
                    entry = saved_state.get(indices[piece.tensor])
                    for name in MOMENTS:
                        live = self.state[piece.param][name]
                        if entry is None:
                            live.zero_()  # never stepped when saved: the unsharded optimizer's zeros
                        else:
                            live.copy_(entry[name].reshape(-1)[piece.source])


def _squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norms of the tensors, float32 [len]."""
    return torch.stack(torch._foreach_norm(tensors, dtype=torch.float32)).square()


def _set_live(group: dict[str, Any], key: str, value: Any) -> None:
    """A saved group value into a live group; tensors the step holds on to keep their object."""
    live = group.get(key)
    if key == "step" and live is None:
        group[key] = int(value)
    elif isinstance(live, torch.Tensor):
        live.copy_(torch.as_tensor(value))
    elif isinstance(value, torch.Tensor):
        group[key] = value.item() if key != "step" else int(value.item())
    else:
        group[key] = value


class ShardedLamb(ShardedKernels, ForeachLamb):
    """LAMB, sharded; the arithmetic of `ForeachLamb`."""


class ShardedAdamW(ShardedKernels, ForeachAdamW):
    """AdamW, sharded; the arithmetic of `ForeachAdamW`."""


def build_sharded_optimizer(groups: Any, name: str, lr: LearningRate, betas: tuple[float, float], eps: float,
                            weight_decay: float, max_grad_norm: float | None, implementation: str = "auto",
                            process_group: dist.ProcessGroup | None = None) -> ShardedKernels:
    """`optimizers.build_optimizer`'s sharded counterpart (implementation "auto" or "foreach" only).

    Build it after DDP has wrapped the model (DDP broadcasts rank 0's weights first) and before
    the first step; it re-points the parameters into its flat buffer.
    """
    if implementation not in ("auto", "foreach"):
        raise ValueError(f"the sharded optimizer computes with the multi-tensor (foreach) kernels; "
                         f"--optimizer_impl {implementation} cannot be sharded: use foreach (or auto)")
    _resolve_implementation(name, "foreach", max_grad_norm, lr)  # checks the name
    _check_hyperparameters(lr, betas, eps, max_grad_norm)
    cls = ShardedLamb if name in LAMB_NAMES else ShardedAdamW
    return cls(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
               process_group=process_group)
