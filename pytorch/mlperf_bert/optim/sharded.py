"""Sharded LAMB and ADAM(W) (`--distributed_optimizer`): each rank updates 1/W of the parameters.

Unsharded, every rank all-reduces the whole gradient and then runs the whole update: for
BERT-Large at 2 packs per GPU about 28 bytes of optimizer traffic per parameter and step on
every GPU. Here, per step:

1. DDP runs the backward as before, but its comm hook does not reduce: it takes the local
   bucket divided by W, clipped first in the modes that clip before the reduction, hands it to
   this optimizer (`Shards.take_bucket`, the hook's sink: `clipping.apply_clip_mode(...,
   reduces=False, sink=optimizer.shards)`) and gives it back to DDP unreduced.
2. The parameters lie in one flat buffer (in optimizer-group order), cut into blocks of whole
   parameters (`plan_blocks`: up to BLOCK_NUMEL elements, DDP's bucket size), each padded to a
   multiple of W; rank r owns the r-th W-th of every block, its shard. A bucket's gradients are
   copied into their places in a flat gradient buffer, and every block they complete is
   reduce-scattered (sum) right away, asynchronously: the reduction of the last layers' blocks
   runs while the backward computes the first layers' gradients. The step waits for them all;
   blocks no bucket completed (no hook installed, or a parameter outside the DDP model) are
   copied from `.grad` and reduce-scattered then.
3. One all-reduce of partial sums: per tensor, the squared norm of this rank's piece of the
   gradient, plus the folded non-finite flags. From it every rank knows the global gradient norm
   (clipping `after_allreduce`, and the fp16 overflow check: an inf/nan anywhere in any rank's
   local gradient reaches the reduced shard that owns it, so the summed norm is not finite on
   every rank). Reading the gradient shard for it is the update's first pass over the shard.
4. LAMB's groups with the trust ratio: the second pass (`fused.moments_and_norms`, the arithmetic
   of `ForeachLamb` on the slices of the parameters the shard holds) advances the moments and
   sums each piece's weights and update squared; one all-reduce of those per-tensor sums (2T
   floats), then the trust ratios.
5. The third pass (`fused.apply_update`) applies lr * ratio * update to the shard; a group
   without trust ratio (every ADAM group) advances its moments in this same pass.
6. The update is applied block by block, and each block's all-gather (into the flat parameter
   buffer, which the model's parameters are views of) is issued as soon as its pieces are
   applied, so it runs during the later blocks' updates; the step waits for all of them before
   it returns (on a GPU `wait` only orders the streams: the host goes on queueing the next
   forward). Not overlapped with the next forward: what reads the weights right after the step
   (a skipped fp16 step's undo in `loss_scale.DeviceLossScaler`, a sync-window snapshot, a
   checkpoint, the eval) would need a wait of its own, and a forward that waited per layer
   would need hooks on every module.

Which clipping modes overlap (`clipping.py`): `none`, `after_allreduce` (the optimizer clips
the reduced gradient) and `bucketwise` (from its third synchronized backward on, once DDP's
bucket layout is final) hand every bucket over as DDP launches it. `before_allreduce` cannot:
it clips the local gradient by its whole norm, known only when the last bucket is in, so its
hook holds every bucket back and the reduce-scatters start after the backward (as its
all-reduces do unsharded). Every mode gives the same arithmetic as before.

Shard groups (`--dist_optimizer_group_size N`, `shard_groups`, NVIDIA's `--dwu-group-size`):
N consecutive ranks (a node's GPUs) share one copy of the optimizer state. A block is
reduce-scattered within the group, its shard all-reduced over the W/N ranks holding the same
shard in the other groups (issued when the next block's reduce-scatter is, or in the step
for the last), and all-gathered within the group: the all-gather stays on the node's links,
and the traffic across nodes is the all-reduce of 1/N of the gradient. The partial-norm
all-reduce then runs over every rank (so a folded flag reaches them all) and divides the sums
by W/N (each shard is counted once per group); LAMB's second one (the weights' and the updates'
norms) stays within the group.

Collectives per step: 1 reduce-scatter + 1 all-gather per block (the bytes of the all-reduce
they replace), with shard groups 1 all-reduce across groups per block, + 1 small all-reduce
(ADAM) or 2 (LAMB) of T+1 and 2T floats (T = number of parameter tensors, 398 for
BERT-Large): `tests/trainer/optim/test_sharded_optimizer.py` counts them, `tests/trainer/optim/test_sharded_overlap.py`
checks when they are issued relative to the backward.

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
(the hooks' and the blocks' Python runs once, at capture; no host read anywhere in the step),
and the arithmetic is the unsharded optimizer's own. The blocks are the optimizer's, not DDP's
buckets: DDP rebuilds its buckets after the first step and the dry run's stand-in has its own,
while the flat layout (and the parameters' views of it) is fixed at construction; a block is
complete once every one of its parameters has arrived, whatever bucket brought it.

fp16: the comm hooks hand over the loss-scaled gradient, so the loss scaler does not unscale
`.grad` for this optimizer but has the step multiply the reduced shard by 1/s
(`unscale_reduced`; s is a power of two, so this equals unscaling before the sum).

The gradient is copied into the flat buffer (8 bytes per parameter on every rank, now during
the backward, from each bucket) rather than kept there: making each `.grad` a view of the buffer saves that copy and one gradient's memory,
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
from typing import Any, Iterable, Protocol, Sequence

import torch
import torch.distributed as dist

from . import fused
from .optimizers import (ForeachAdamW, ForeachKernels, ForeachLamb, LAMB_NAMES, LearningRate, check_state_fits,
                         clip_divisor, lamb_trust_ratio, _check_hyperparameters,
                         MOMENTS, _resolve_implementation)

# Elements per block when none is given: DDP's default bucket (25 MiB of fp32), so a block is
# complete about as often as DDP hands a bucket over.
BLOCK_NUMEL = (25 << 20) // 4


class Work(Protocol):
    """An asynchronous collective's handle (`dist.Work`)."""

    def wait(self) -> Any: ...


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that this rank's shard holds."""

    tensor: int  # the parameter's index among all parameters, in group order
    param: torch.nn.Parameter
    shard: slice  # where it lies in the shard
    source: slice  # where it lies in the flattened parameter
    flat: slice  # where it lies in the flat buffer
    block: int


@dataclass(frozen=True)
class Block:
    """Whole parameters [first, stop), at [start, start + size) of the flat buffer (size a multiple of
    W, padded). Rank r owns [start + r * chunk, start + (r + 1) * chunk), kept at `shard_start` of its shard."""

    first: int
    stop: int
    start: int
    size: int
    shard_start: int
    world: int

    @property
    def chunk(self) -> int:
        return self.size // self.world


def _slice(start: int, stop: int) -> slice:
    return slice(start, stop)


def plan_blocks(numels: Sequence[int], world: int, block_numel: int) -> tuple[list[Block], list[int]]:
    """Consecutive parameters in blocks of at most `block_numel` elements (a larger parameter alone),
    each padded to a multiple of `world`; and every parameter's offset in the flat buffer."""
    blocks: list[Block] = []
    offsets: list[int] = []
    first = filled = 0
    for index, numel in enumerate(numels):
        if filled and filled + numel > block_numel:
            blocks.append(_block(first, index, filled, blocks, world))
            first, filled = index, 0
        offsets.append(_end(blocks) + filled)
        filled += numel
    blocks.append(_block(first, len(numels), filled, blocks, world))
    return blocks, offsets


def _end(blocks: list[Block]) -> int:
    return blocks[-1].start + blocks[-1].size if blocks else 0


def _block(first: int, stop: int, filled: int, before: list[Block], world: int) -> Block:
    shard_start = sum(b.chunk for b in before)
    return Block(first, stop, _end(before), max(1, math.ceil(filled / world)) * world, shard_start, world)


class Shards:
    """The flat layout of the parameters over the ranks, the buffers on it, and the step's reductions.

    Every parameter of `groups` (in group order) lies in `flat_params` at its offset, and the
    parameter itself becomes a view of it (`.data` re-pointed), so the all-gathers write the
    weights in place. The buffer is cut into blocks (`plan_blocks`); rank r of the W ranks of
    `process_group` owns the r-th W-th of every block. `replica_group`: the ranks holding the same
    shard in the other shard groups (None: the shard group is every rank). Shared by an optimizer
    and its capturable twin (`capturable.capturable`), so the comm hooks feed whichever steps.

    Per step: `take_bucket` (the comm hooks, during the backward) copies a bucket's local gradients
    into `flat_grads` and reduce-scatters every block it completes; `reduce` (the step) does the
    same for the blocks nobody handed over, from `.grad`, and waits for all of them.
    """

    def __init__(self, groups: list[list[torch.nn.Parameter]], process_group: dist.ProcessGroup | None,
                 replica_group: dist.ProcessGroup | None = None, block_numel: int = BLOCK_NUMEL) -> None:
        params = [p for group in groups for p in group]
        _check_flattenable(params)
        self.process_group, self.replica_group = process_group, replica_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.replicas = 1 if replica_group is None else dist.get_world_size(replica_group)
        self.numels = [p.numel() for p in params]
        self.blocks, self.offsets = plan_blocks(self.numels, self.world, block_numel)
        self.shard_size = sum(b.chunk for b in self.blocks)
        first = params[0]
        self.flat_params = first.new_zeros(_end(self.blocks))
        self.flat_grads = torch.zeros_like(self.flat_params)
        self.grad_shard = first.new_zeros(self.shard_size)
        self.moments = {name: first.new_zeros(self.shard_size) for name in MOMENTS}
        with torch.no_grad():
            for p, offset, n in zip(params, self.offsets, self.numels):
                view = self.flat_params[offset : offset + n].view_as(p)
                view.copy_(p)
                p.data = view
        self.grad_views = [self.flat_grads[o : o + n].view_as(p) for p, o, n in zip(params, self.offsets, self.numels)]
        self.block_of = [b for b, block in enumerate(self.blocks) for _ in range(block.first, block.stop)]
        self._index = {id(p): i for i, p in enumerate(params)}
        self.pieces = self._pieces(groups)
        self._reset_round()

    def _pieces(self, groups: list[list[torch.nn.Parameter]]) -> list[list[Piece]]:
        """Per group, the pieces of its parameters inside this rank's part of each block, in order."""
        pieces: list[list[Piece]] = []
        index = 0
        for group in groups:
            pieces.append([])
            for p in group:
                b = self.block_of[index]
                lo = self.blocks[b].start + self.rank * self.blocks[b].chunk
                to_shard = self.blocks[b].shard_start - lo
                offset, n = self.offsets[index], self.numels[index]
                a, z = max(offset, lo), min(offset + n, lo + self.blocks[b].chunk)
                if a < z:
                    pieces[-1].append(Piece(index, p, _slice(a + to_shard, z + to_shard), _slice(a - offset, z - offset),
                                            _slice(a, z), b))
                index += 1
        return pieces

    def own(self, b: int, flat: torch.Tensor) -> torch.Tensor:
        """This rank's part of block b in a flat-layout buffer."""
        block = self.blocks[b]
        start = block.start + self.rank * block.chunk
        return flat[start : start + block.chunk]

    def in_shard(self, b: int, shard: torch.Tensor) -> torch.Tensor:
        """Block b's part of a shard-sized buffer."""
        block = self.blocks[b]
        return shard[block.shard_start : block.shard_start + block.chunk]

    def whole(self, b: int, flat: torch.Tensor) -> torch.Tensor:
        block = self.blocks[b]
        return flat[block.start : block.start + block.size]

    def full(self, shard: torch.Tensor) -> torch.Tensor:
        """A shard-sized buffer all-gathered into the flat layout (a collective)."""
        out = shard.new_empty(self.flat_params.numel())
        _wait_all([dist.all_gather_single(self.whole(b, out), self.in_shard(b, shard), group=self.process_group,
                                          async_op=True) for b in range(len(self.blocks))])
        return out

    def gather(self, b: int) -> Work:
        """Issues the all-gather of block b's updated weights (in place: this rank's part is already there)."""
        return dist.all_gather_single(self.whole(b, self.flat_params), self.own(b, self.flat_params),
                                      group=self.process_group, async_op=True)

    # -- the reduce-scatters, block by block -------------------------------------------------
    def _reset_round(self) -> None:
        self._missing = [b.stop - b.first for b in self.blocks]
        self._arrived = [False] * len(self.numels)
        self._launched = [False] * len(self.blocks)
        self._pending: list[Work] = []  # reductions the step waits for
        self._unsent: tuple[int, Work] | None = None  # a reduce-scatter whose all-reduce across groups is not issued

    def take_bucket(self, params: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        """A comm hook's bucket (the local gradients / W, clipped where the mode clips before the
        reduction, in the order of `params`): into the flat buffer; every block it completes is
        reduce-scattered now, while the backward goes on (`clipping.BucketSink`)."""
        indices = [self._index_of(p) for p in params]
        if any(self._arrived[i] for i in indices):
            self.discard_round()  # the gradients of a backward no step took: this one replaces them
        sources = buffer.split([self.numels[i] for i in indices])
        torch._foreach_copy_([self.grad_views[i] for i in indices],
                             [s.view_as(self.grad_views[i]) for s, i in zip(sources, indices)])
        for i in indices:
            self._arrived[i] = True
            self._missing[self.block_of[i]] -= 1
            if self._missing[self.block_of[i]] == 0:
                self._launch(self.block_of[i])

    def _index_of(self, p: torch.Tensor) -> int:
        index = self._index.get(id(p))
        if index is None:
            raise RuntimeError(f"a bucket holds a parameter {tuple(p.shape)} the sharded optimizer does not: "
                               "build it over the parameters of the DDP-wrapped model")
        return index

    def _launch(self, b: int) -> None:
        self._send_across()  # the previous block's: its reduce-scatter had this bucket's time to finish
        work = dist.reduce_scatter_single(self.in_shard(b, self.grad_shard), self.whole(b, self.flat_grads),
                                          group=self.process_group, async_op=True)
        self._launched[b] = True
        if self.replica_group is None:
            self._pending.append(work)
        else:
            self._unsent = (b, work)

    def _send_across(self) -> None:
        """With shard groups: the all-reduce over the replicas of the last reduce-scattered block's
        shard, once that reduce-scatter is done (on a GPU, `wait` only orders the streams)."""
        if self._unsent is None:
            return
        b, work = self._unsent
        self._unsent = None
        work.wait()
        self._pending.append(dist.all_reduce(self.in_shard(b, self.grad_shard), group=self.replica_group,
                                             async_op=True))

    def reduce(self, params: Sequence[torch.nn.Parameter]) -> None:
        """The step's gradient shard, summed over every rank: the blocks no bucket completed are copied
        from `.grad` and reduce-scattered now (in block order, the same on every rank); then all waited."""
        for b, block in enumerate(self.blocks):
            if not self._launched[b]:
                torch._foreach_copy_(self.grad_views[block.first : block.stop],
                                     [_grad(params[i], i) for i in range(block.first, block.stop)])
                self._launch(b)
        self._send_across()
        self.discard_round()

    def discard_round(self) -> None:
        """Waits for the reductions in flight (the flat buffers are reused) and forgets what arrived."""
        if self._unsent is not None:
            self._unsent[1].wait()
        _wait_all(self._pending)
        self._reset_round()


def _wait_all(works: Iterable[Work]) -> None:
    for work in works:
        work.wait()


def _grad(p: torch.nn.Parameter, index: int) -> torch.Tensor:
    if p.grad is None:
        raise RuntimeError(f"parameter {index} ({tuple(p.shape)}) has no gradient: the sharded optimizer "
                           "reduces every parameter's gradient each step")
    return p.grad


def _check_flattenable(params: list[torch.nn.Parameter]) -> None:
    if not params:
        raise ValueError("the sharded optimizer needs at least one parameter")
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) != 1:
        raise ValueError(f"the sharded optimizer keeps all parameters in one flat buffer: they must share one dtype "
                         f"and device, got {sorted(str(k) for k in kinds)}")


@dataclass(frozen=True)
class _GroupSlices:
    """One group's pieces as the lists the fused passes take (`fused.py`)."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]
    tensors: torch.Tensor  # int64 [pieces]: each piece's parameter index
    blocks: list[slice]  # per block, its pieces in these lists


class ShardedKernels(ForeachKernels):
    """The sharded step (module docstring) with `ForeachKernels`' arithmetic and state layout.

    param_groups hold the model's whole parameters, as the unsharded optimizer's do (the
    schedule, the loss scaler and the snapshots see the same groups); the state holds this
    rank's slices. Every parameter must have a gradient at each step (DDP's contract too).
    process_group: the ranks that share the parameters (None: the default group).
    replica_group: with shard groups (`shard_groups`), the ranks holding the same shard in the
    other groups; None: one shard group of every rank.
    shards: an existing layout to take over (the capturable twin's); None: built here, which
    re-points the parameters into the flat buffer. block_numel: elements per block (`plan_blocks`).
    """

    def __init__(self, params: Iterable[Any], lr: LearningRate, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, max_grad_norm: float | None = None,
                 process_group: dist.ProcessGroup | None = None, shards: Shards | None = None,
                 replica_group: dist.ProcessGroup | None = None, block_numel: int = BLOCK_NUMEL) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, max_grad_norm)
        groups = [list(g["params"]) for g in self.param_groups]
        self.shards = shards if shards is not None else Shards(groups, process_group, replica_group, block_numel)
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
        self._unscale: torch.Tensor | None = None

    def _group_slices(self, pieces: list[Piece]) -> _GroupSlices:
        s = self.shards
        blocks = [slice(sum(p.block < b for p in pieces), sum(p.block <= b for p in pieces))
                  for b in range(len(s.blocks))]
        return _GroupSlices(
            params=[s.flat_params[p.flat] for p in pieces], grads=[s.grad_shard[p.shard] for p in pieces],
            exp_avg=[s.moments["exp_avg"][p.shard] for p in pieces],
            exp_avg_sq=[s.moments["exp_avg_sq"][p.shard] for p in pieces],
            tensors=torch.tensor([p.tensor for p in pieces], dtype=torch.int64, device=s.flat_params.device),
            blocks=blocks)

    def _ensure_state(self, p: torch.Tensor) -> None:
        """The state exists from construction on (slices of the flat moments)."""

    def fold_flag(self, flag: torch.Tensor | None) -> None:
        """A rank-local device flag (> 0: skip) agreed in the next step's first collective, into
        `agreed_nonfinite` (e.g. a clipping hook's non-finite bucket norm). Not read here."""
        self._folded = flag

    def unscale_reduced(self, inv_scale: torch.Tensor) -> None:
        """fp16: the next step multiplies its reduced gradient shard by `inv_scale` (a device tensor).

        The loss scaler's unscale, moved after the reduction: the comm hooks handed the scaled
        local gradients to the reduce-scatter during the backward. The scale is a power of two,
        so unscaling the sum equals summing the unscaled gradients (`loss_scale.DeviceLossScaler`).
        """
        self._unscale = inv_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.shards.discard_round()  # a skipped step's reductions: waited for, then forgotten
        super().zero_grad(set_to_none)

    # -- the step ---------------------------------------------------------------------------
    def _update(self) -> None:
        s = self.shards
        s.reduce(self._params)
        if self._unscale is not None:
            s.grad_shard.mul_(self._unscale)
            self._unscale = None
        count = len(self._params)
        grad_norms, flags = self._first_sums(count)
        global_norm = torch.linalg.vector_norm(grad_norms)
        self.agreed_nonfinite.copy_(((~torch.isfinite(global_norm)) | (flags > 0)).to(torch.float32))
        divisor = clip_divisor(global_norm, self.max_grad_norm) if self.max_grad_norm is not None else None
        hypers = []
        for group in self.param_groups:
            corrections = self._advance(group)  # every rank counts every group, pieces or not
            hypers.append(fused.Hyper.of(group, corrections))
        ratios = self._trust_ratios(hypers, divisor, count) if self._any_trust_ratio() else None
        scales: list[torch.Tensor | None] = []
        for group, slices in zip(self.param_groups, self._slices):
            scale = None
            if slices.params:
                scale = fused.per_tensor(group["lr"], len(slices.params), slices.params[0])
                if ratios is not None and self._uses_trust_ratio(group):
                    scale = ratios[slices.tensors] * group["lr"]
            scales.append(scale)
        self._apply_and_gather(hypers, scales, divisor)

    def _apply_and_gather(self, hypers: list[fused.Hyper], scales: list[torch.Tensor | None],
                          divisor: torch.Tensor | None) -> None:
        """The update (the third pass), block by block; each block's all-gather is issued as soon as its
        pieces are applied, so it runs while the later blocks are updated. A group without trust ratio
        advances its moments in this pass too. All are waited for before the step returns: whatever
        reads the weights next (the forward, a skipped step's undo, a snapshot, a checkpoint) reads
        them gathered."""
        gathers = []
        for b in range(len(self.shards.blocks)):
            for group, slices, hyper, scale in zip(self.param_groups, self._slices, hypers, scales):
                pieces = slices.blocks[b]
                if scale is None or pieces.start == pieces.stop:
                    continue
                advances = not self._uses_trust_ratio(group)
                fused.apply_update(slices.params[pieces], slices.exp_avg[pieces], slices.exp_avg_sq[pieces],
                                   scale[pieces], hyper, slices.grads[pieces] if advances else None, divisor,
                                   static=True)
            gathers.append(self.shards.gather(b))
        _wait_all(gathers)

    def _first_sums(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One all-reduce: per-tensor squared norms of the gradient and the folded flags. Returns (the
        gradient's norms [T], the flags' sum).

        Over every rank (the default group) when there are shard groups, so a flag reaches them all:
        each shard is then counted once per replica, and the partial sums are divided by that count.
        """
        sums = self.agreed_nonfinite.new_zeros(count + 1)
        for slices in self._slices:
            if slices.params:
                sums.index_add_(0, slices.tensors, fused.squared_norms(slices.grads))
        if self._folded is not None:
            sums[count] = self._folded.to(sums.dtype)
            self._folded = None  # one step's flag
        s = self.shards
        if s.replica_group is None:
            dist.all_reduce(sums, group=s.process_group)
        else:
            dist.all_reduce(sums)
            sums[:count] /= s.replicas
        return sums[:count].sqrt(), sums[count]

    def _any_trust_ratio(self) -> bool:
        """Whether LAMB's second all-reduce runs: decided by the groups alone, the same on every rank."""
        return any(self._uses_trust_ratio(group) for group in self.param_groups)

    def _trust_ratios(self, hypers: list[fused.Hyper], divisor: torch.Tensor | None, count: int) -> torch.Tensor:
        """The second pass for the groups with the trust ratio (moments advanced, each piece's p * p and
        update * update summed), LAMB's second all-reduce of those sums [2T] within the shard group,
        and ||p|| / ||update|| per tensor [T]."""
        sums = self.agreed_nonfinite.new_zeros(2 * count)
        for group, slices, hyper in zip(self.param_groups, self._slices, hypers):
            if slices.params and self._uses_trust_ratio(group):
                pieces = fused.moments_and_norms(slices.params, slices.grads, slices.exp_avg, slices.exp_avg_sq,
                                                 hyper, divisor, static=True)
                sums.index_add_(0, slices.tensors, pieces[:, 0])
                sums.index_add_(0, slices.tensors + count, pieces[:, 1])
        dist.all_reduce(sums, group=self.shards.process_group)
        return lamb_trust_ratio(sums[:count].sqrt(), sums[count:].sqrt())

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


def shard_groups(group_size: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(shard group, replica group) of this rank for `--dist_optimizer_group_size N` (a collective:
    every rank calls it, in the same order). N consecutive ranks share one copy of the optimizer
    state; the ranks at the same place in every group hold the same shard and all-reduce it.
    N = 0 or the world size: (None, None), one shard group of every rank."""
    world = dist.get_world_size()
    if group_size in (0, world):
        return None, None
    if group_size < 1 or world % group_size:
        raise ValueError(f"--dist_optimizer_group_size {group_size} must divide the {world} ranks (or be 0: all)")
    shard, _ = dist.new_subgroups(group_size)
    replicas = [list(range(i, world, group_size)) for i in range(group_size)]
    replica, _ = dist.new_subgroups_by_enumeration(replicas)
    return shard, replica


def build_sharded_optimizer(groups: Any, name: str, lr: LearningRate, betas: tuple[float, float], eps: float,
                            weight_decay: float, max_grad_norm: float | None, implementation: str = "auto",
                            process_group: dist.ProcessGroup | None = None,
                            replica_group: dist.ProcessGroup | None = None,
                            block_numel: int = BLOCK_NUMEL) -> ShardedKernels:
    """`optimizers.build_optimizer`'s sharded counterpart (implementation "auto" or "foreach" only).

    Build it after DDP has wrapped the model (DDP broadcasts rank 0's weights first) and before
    the first step; it re-points the parameters into its flat buffer. Hand its `shards` to
    `clipping.apply_clip_mode(..., sink=...)` so the reduce-scatters start during the backward.
    """
    if implementation not in ("auto", "foreach"):
        raise ValueError(f"the sharded optimizer computes with the multi-tensor (foreach) kernels; "
                         f"--optimizer_impl {implementation} cannot be sharded: use foreach (or auto)")
    _resolve_implementation(name, "foreach", max_grad_norm, lr)  # checks the name
    _check_hyperparameters(lr, betas, eps, max_grad_norm)
    cls = ShardedLamb if name in LAMB_NAMES else ShardedAdamW
    return cls(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
               process_group=process_group, replica_group=replica_group, block_numel=block_numel)
