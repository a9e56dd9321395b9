"""Gradient clipping modes, and where each one clips relative to DDP's all-reduce.

Notation: W ranks, g_r = rank r's local gradient (all parameters), c = `--max_grad_norm`,
clip(x, t) = x * t / max(||x||_2, t), i.e. x unchanged when its L2 norm is within t
(the apex FusedLAMB form: no epsilon, so a gradient under the threshold is bit-identical).

| `--clip_mode`      | gradient the optimizer steps with             | clipped by                | all-reduce overlaps backward |
|--------------------|-----------------------------------------------|---------------------------|------------------------------|
| `none`             | mean_r g_r                                    | nobody                    | yes                          |
| `after_allreduce`  | clip(mean_r g_r, c)                           | the optimizer             | yes                          |
| `before_allreduce` | mean_r clip(g_r, c)                           | `BeforeAllreduceClipHook` | no                           |
| `bucketwise`       | per DDP bucket b: mean_r clip(g_r[b], c/sqrt(B)) | `BucketwiseClipHook`   | yes                          |

Who clips `after_allreduce`: the optimizer, never this module. LAMB (apex FusedLAMB
semantics) already computes the global norm of the averaged gradient and clips by it, which is
exactly clip(mean_r g_r, c); clipping here too would cost a second pass and clip twice.
`optimizer_clip_norm(config)` is the one switch: it hands c to the optimizer in that mode and
None in every other, so a gradient is never clipped by both.

`before_allreduce` needs each rank's norm over its whole gradient, which exists only when the
backward has ended. Its hook therefore holds every DDP bucket back, and when the last one is
handed over (`GradBucket.is_last()`) clips all of them by their joint norm and only then
launches their all-reduces: no overlap with the backward. A comm hook (rather than `no_sync`
plus a manual all-reduce) keeps the trainer identical for every mode and reuses DDP's own
flat buckets, so no extra gradient copy is made.

`bucketwise` (Samsung, MLPerf v2.0 open division) clips every bucket to c/sqrt(B) as soon as
DDP hands it over and launches its all-reduce right away, so communication still overlaps the
backward. Since sum_b (c/sqrt(B))^2 = c^2, the clipped local gradient has norm <= c, as in
`before_allreduce`. B is the real number of DDP buckets, learned by the hook from DDP's own calls:
DDP first buckets the parameters at construction (torch 2.x puts them all in one bucket) and
rebuilds the buckets once, in gradient-ready order, in the first forward after the first
synchronized backward. The layout seen in the second synchronized backward is thus final. During
its first two synchronized backwards the hook holds the buckets back like `before_allreduce`
until the bucket with `is_last()` arrives (B = its index + 1), clips each with c/sqrt(B) and
launches them: exact, without overlap for those two steps. From then on it clips and launches each
bucket immediately and checks each one against the learned layout (index, size, `is_last()`),
raising instead of silently clipping with a wrong B should DDP ever change the buckets again.

Loss scaling (fp16): gradients arrive multiplied by the loss scale s, and clipping is in
unscaled units, so the hooks clip the scaled gradient at threshold t * s (`ClipHandle.set_loss_scale`).
s is a float updated whenever the host scaler changes it, or the device scaler's live scale
tensor, set once and read by the hooks' kernels (no host read, graph-safe). bf16 and fp32
need nothing: s stays 1.

Non-finite gradients (fp16 overflow): a rank whose local bucket norm is inf/nan must make every
rank skip the step, although the other ranks' local gradients were finite (a norm can overflow
fp32 while every element is finite: its clip coefficient is then 0 and the rank's gradient
would silently drop out of the mean). Each hook keeps a rank-local device flag for the current
synchronized backward, and nothing here reads it on the host:
- `ClipHandle.local_nonfinite()` hands the rank's own flag to the guard, whose agreement
  all-reduces it with its other flags in the read it makes anyway (`faults.Guard.check_loss`);
- `ClipHandle.nonfinite_flag()` all-reduces it (max) on the device for a step that decides on
  the device (`loss_scale.DeviceLossScaler.step(also_skip=...)`, e.g. inside a CUDA graph).
Both return None in `none` / `after_allreduce`, where no hook runs; there every rank holds the
same averaged gradient, so the optimizer's / loss scaler's own overflow check already agrees.

Gradient accumulation: clipping applies to the accumulated gradient of the whole step, not per
micro-batch. The trainer runs all but the last micro-batch under `ddp.no_sync()`, so DDP calls the
hook only in the last backward, when each parameter holds the sum over the step's micro-batches;
that sum is what gets clipped. It also matches `after_allreduce`, where the optimizer sees the
accumulated gradient.

Sharded optimizer (`--distributed_optimizer`, `sharded.py`): the reduction is the optimizer's
reduce-scatter, not DDP's all-reduce. `apply_clip_mode(..., reduces=False)` keeps every mode's
place relative to it: the hooks scale each bucket by its clip coefficient / W as above but hand
it back unreduced, and `none` / `after_allreduce` get `local_mean_hook` (the bucket / W, DDP's
own arithmetic). `after_allreduce` is then the sharded optimizer's clip by the norm of the
reduced gradient, from its shards' partial sums; `before_allreduce` and `bucketwise` clip the
local gradient before the reduce-scatter exactly as before the all-reduce. With a sink (the
optimizer's `shards`) each hook hands a bucket over where it would have launched its
all-reduce, so the reduce-scatters overlap the backward exactly where the all-reduces did
(the table's last column): every mode but `before_allreduce`.

Usage, once after wrapping the model in DDP:

    clip = apply_clip_mode(ddp_model, config)
    optimizer = make_optimizer(..., max_grad_norm=optimizer_clip_norm(config))
    # per step: clip.set_loss_scale(s) when fp16; backward(s) as usual; then
    verdict = guard.check_loss(loss, clip.local_nonfinite())  # agreed with the guard's flags
    if not verdict.nonfinite_gradient:
        optimizer.step()
"""

import math
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

# DDP rebuilds its buckets once, before the second synchronized backward (see module docstring).
_LEARNING_BACKWARDS = 2


class ClipMode(str, Enum):
    """`--clip_mode`: where the gradient is clipped relative to the all-reduce (module docstring)."""

    NONE = "none"
    AFTER_ALLREDUCE = "after_allreduce"
    BEFORE_ALLREDUCE = "before_allreduce"
    BUCKETWISE = "bucketwise"


def all_reduce_overlaps_backward(mode: ClipMode) -> bool:
    """The module table's last column: whether DDP's all-reduce runs while the backward pass still computes
    (before_allreduce holds every bucket until the backward has ended)."""
    return mode != ClipMode.BEFORE_ALLREDUCE


def _parse_mode(mode: ClipMode | str) -> ClipMode:
    try:
        return ClipMode(mode)
    except ValueError:
        choices = ", ".join(m.value for m in ClipMode)
        raise ValueError(f"--clip_mode must be one of {choices}; got {mode!r}") from None


@dataclass(frozen=True)
class ClipConfig:
    """`--clip_mode` and `--max_grad_norm` (c, an L2 norm in unscaled gradient units)."""

    mode: ClipMode = ClipMode.AFTER_ALLREDUCE
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _parse_mode(self.mode))
        norm = self.max_grad_norm
        if isinstance(norm, bool) or not isinstance(norm, (int, float)) or not (0 < norm < math.inf):
            raise ValueError(f"--max_grad_norm must be a positive finite number; got {norm!r}")


def optimizer_clip_norm(config: ClipConfig) -> float | None:
    """The global-norm clip the optimizer applies to the averaged gradient, or None.

    Only `after_allreduce` is left to the optimizer; the hook modes have clipped already.
    """
    return config.max_grad_norm if config.mode is ClipMode.AFTER_ALLREDUCE else None


@dataclass(frozen=True)
class BucketLaunch:
    """One all-reduce issued by a clipping hook, kept for tests and profiling."""

    index: int  # DDP bucket index; 0 is the first bucket ready in the backward
    numel: int  # elements in the bucket's flat gradient
    time_ns: int  # time.perf_counter_ns() at launch, on the autograd thread


class BucketSink(Protocol):
    """Where a hook that does not reduce hands each bucket over (`sharded.Shards.take_bucket`)."""

    def take_bucket(self, params: Sequence[torch.Tensor], buffer: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class _HeldBucket:
    index: int
    buffer: torch.Tensor  # the bucket's flat gradient, clipped in place before its all-reduce
    params: Sequence[torch.Tensor]  # the bucket's parameters, in the buffer's order
    result: torch.futures.Future  # handed to DDP now, completed once the all-reduce ends


def _bucket_norm(buffer: torch.Tensor) -> torch.Tensor:
    """L2 norm of a flat gradient, accumulated in fp32 (0-dim, on the gradient's device)."""
    return torch.linalg.vector_norm(buffer, dtype=torch.float32)


def _clip_coefficient(norm: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """threshold / max(norm, threshold): 1 within the threshold, 0 for an infinite norm."""
    return threshold / norm.clamp(min=threshold)


def _first_tensor(done: torch.futures.Future) -> torch.Tensor:
    return done.value()[0]


def _pending_future(device: torch.device) -> torch.futures.Future:
    if device.type == "cuda":
        return torch.futures.Future(devices=[device])
    return torch.futures.Future()


def _completed(buffer: torch.Tensor) -> torch.futures.Future:
    """A future already holding `buffer`: the bucket handed back to DDP unreduced.

    No devices are named (as torch's own `noop_hook`): the bucket's kernels were queued on the
    current stream, which DDP's copy back into the gradients follows.
    """
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(buffer)
    return done


def _hand_over(buffer: torch.Tensor, params: Sequence[torch.Tensor],
               sink: BucketSink | None) -> torch.futures.Future:
    """An unreduced bucket: to the sink (which starts its reduce-scatter now), and back to DDP as it is."""
    if sink is not None:
        sink.take_bucket(params, buffer)
    return _completed(buffer)


@dataclass(frozen=True)
class LocalMeanHook:
    """The comm hook of `none` / `after_allreduce` under a sharded optimizer: the local bucket / W,
    not reduced; the optimizer's reduce-scatter sums it into the mean (DDP's own arithmetic),
    started at once when a sink is given."""

    process_group: dist.ProcessGroup | None
    sink: BucketSink | None = None

    def communicate(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer().div_(dist.get_world_size(self.process_group))
        return _hand_over(buffer, bucket.parameters(), self.sink)


def _complete_with(source: torch.futures.Future, target: torch.futures.Future) -> None:
    """Completes `target` with `source`'s tensor (or its error) once `source` is done."""

    def forward(done: torch.futures.Future) -> None:
        try:
            target.set_result(done.value())
        except Exception as error:  # an all-reduce failure must reach DDP's wait, not vanish
            target.set_exception(error)

    source.add_done_callback(forward)


@dataclass(eq=False)
class _ClipHook:
    """State shared by the clipping comm hooks (one instance per DDP model).

    `launches` and the non-finite flag describe the synchronized backward in progress (or
    the last finished one); `backward_count` counts finished synchronized backwards.
    """

    max_norm: float  # c, unscaled
    process_group: dist.ProcessGroup | None = None  # None = the default group
    loss_scale: float | torch.Tensor = 1.0  # s, the fp16 loss scale the gradients carry (module docstring)
    reduces: bool = True  # False: the bucket is scaled, not reduced (a sharded optimizer reduce-scatters)
    sink: BucketSink | None = None  # with reduces False: takes each scaled bucket as soon as it is launched
    backward_count: int = field(default=0, init=False)
    launches: list[BucketLaunch] = field(default_factory=list, init=False)
    _held: list[_HeldBucket] = field(default_factory=list, init=False, repr=False)
    _nonfinite: torch.Tensor | None = field(default=None, init=False, repr=False)  # 0-dim bool
    _next_index: int = field(default=0, init=False, repr=False)

    def communicate(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The DDP comm hook: `ddp.register_comm_hook(hook, type(hook).communicate)`."""
        index = bucket.index()
        if index != self._next_index:
            raise RuntimeError(
                f"DDP handed over bucket {index} while bucket {self._next_index} was expected; "
                "clipping hooks need DDP's in-order bucket launches"
            )
        if index == 0:
            self.launches.clear()
            self._nonfinite = None
        self._next_index = 0 if bucket.is_last() else index + 1
        result = self._on_bucket(_HeldBucket(index, bucket.buffer(), bucket.parameters(),
                                             _pending_future(bucket.buffer().device)), bucket.is_last())
        if bucket.is_last():
            self.backward_count += 1
        return result

    def _on_bucket(self, bucket: _HeldBucket, is_last: bool) -> torch.futures.Future:
        raise NotImplementedError

    def local_flag(self) -> torch.Tensor:
        """This rank's own vote as a 0-dim float32 device tensor (1: an inf/nan bucket norm in its last
        synchronized backward). Not read here."""
        if self._nonfinite is None:
            raise RuntimeError("the non-finite flag needs a synchronized backward through the DDP model first")
        return self._nonfinite.to(torch.float32)

    def agreed_flag(self) -> torch.Tensor:
        """`local_flag` all-reduced (max) over `process_group`: the same on every rank. A collective
        (every rank, every synchronized backward); not read here."""
        flag = self.local_flag()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        return flag

    def _note_norms(self, norms: torch.Tensor) -> None:
        bad = ~torch.isfinite(norms).all()
        self._nonfinite = bad if self._nonfinite is None else self._nonfinite | bad

    def _scale_and_launch(self, bucket: _HeldBucket, coefficient: torch.Tensor) -> torch.futures.Future:
        """Multiplies the bucket by its clip coefficient / W, then all-reduces (sum) it: the mean.

        With `reduces` False the scaled local bucket goes to the sink (the sharded optimizer's
        reduce-scatter, started now) and back to DDP as it is (`sharded.py`).
        """
        buffer = bucket.buffer
        buffer.mul_(coefficient / dist.get_world_size(self.process_group))
        self.launches.append(BucketLaunch(bucket.index, buffer.numel(), time.perf_counter_ns()))
        if not self.reduces:
            return _hand_over(buffer, bucket.params, self.sink)
        work = dist.all_reduce(buffer, group=self.process_group, async_op=True)
        return work.get_future().then(_first_tensor)

    def _hold(self, bucket: _HeldBucket) -> torch.futures.Future:
        self._held.append(bucket)
        return bucket.result

    def _release(self, last: _HeldBucket) -> torch.futures.Future:
        """Clips the held buckets plus this last one together and launches all their all-reduces."""
        buckets = [*self._held, last]
        self._held.clear()
        norms = torch.stack([_bucket_norm(b.buffer) for b in buckets])
        self._note_norms(norms)
        coefficients = self._held_coefficients(norms)
        for held, coefficient in zip(buckets[:-1], coefficients[:-1]):
            _complete_with(self._scale_and_launch(held, coefficient), held.result)
        return self._scale_and_launch(last, coefficients[-1])

    def _held_coefficients(self, norms: torch.Tensor) -> torch.Tensor:
        """Clip coefficient of every bucket of a whole backward, from the bucket norms [B]."""
        raise NotImplementedError


@dataclass(eq=False)
class BeforeAllreduceClipHook(_ClipHook):
    """Clips each rank's whole local gradient by its own norm, then averages (no overlap)."""

    def _on_bucket(self, bucket: _HeldBucket, is_last: bool) -> torch.futures.Future:
        return self._release(bucket) if is_last else self._hold(bucket)

    def _held_coefficients(self, norms: torch.Tensor) -> torch.Tensor:
        joint = _clip_coefficient(torch.linalg.vector_norm(norms), self.max_norm * self.loss_scale)
        return joint.expand(norms.shape[0])


@dataclass(eq=False)
class BucketwiseClipHook(_ClipHook):
    """Clips each DDP bucket to c/sqrt(B) and all-reduces it as soon as DDP hands it over.

    `bucket_numels` is the bucket layout (elements per bucket, in index order) of the last
    finished synchronized backward; B = `num_buckets`.
    """

    bucket_numels: tuple[int, ...] = field(default=(), init=False)

    @property
    def num_buckets(self) -> int | None:
        return len(self.bucket_numels) or None

    @property
    def overlaps(self) -> bool:
        """Whether the next backward launches each bucket's all-reduce as soon as it is ready."""
        return self.backward_count >= _LEARNING_BACKWARDS

    def _bucket_threshold(self, num_buckets: int) -> float | torch.Tensor:
        return self.max_norm * self.loss_scale / math.sqrt(num_buckets)

    def _on_bucket(self, bucket: _HeldBucket, is_last: bool) -> torch.futures.Future:
        if not self.overlaps:
            return self._learn(bucket, is_last)
        self._check_layout(bucket.index, bucket.buffer.numel(), is_last)
        norm = _bucket_norm(bucket.buffer)
        self._note_norms(norm)
        coefficient = _clip_coefficient(norm, self._bucket_threshold(len(self.bucket_numels)))
        return self._scale_and_launch(bucket, coefficient)

    def _learn(self, bucket: _HeldBucket, is_last: bool) -> torch.futures.Future:
        if not is_last:
            return self._hold(bucket)
        self.bucket_numels = tuple(b.buffer.numel() for b in self._held) + (bucket.buffer.numel(),)
        return self._release(bucket)

    def _held_coefficients(self, norms: torch.Tensor) -> torch.Tensor:
        return _clip_coefficient(norms, self._bucket_threshold(norms.shape[0]))

    def _check_layout(self, index: int, numel: int, is_last: bool) -> None:
        layout = self.bucket_numels
        if index >= len(layout) or numel != layout[index] or is_last != (index == len(layout) - 1):
            raise RuntimeError(
                f"DDP bucket {index} ({numel} elements, last={is_last}) does not match the layout "
                f"learned in the first synchronized backwards {layout}; DDP rebuilt its buckets "
                "again, so the bucket-wise threshold c/sqrt(B) would be wrong. Call apply_clip_mode "
                "on a freshly wrapped model."
            )


@dataclass(frozen=True)
class ClipHandle:
    """What the trainer keeps from `apply_clip_mode`: the config and the hook, if any."""

    config: ClipConfig
    hook: _ClipHook | None  # None for `none` and `after_allreduce`

    def set_loss_scale(self, scale: float | torch.Tensor) -> None:
        """Tells the hook the fp16 loss scale s, so it clips in unscaled units.

        A float is checked and taken as is; a device tensor (`DeviceLossScaler.scale_tensor`) is
        kept and read by the hooks' kernels every step, so it is set once and never read here.
        """
        if not isinstance(scale, torch.Tensor) and not (0 < scale < math.inf):
            raise ValueError(f"the loss scale must be a positive finite number; got {scale!r}")
        if self.hook is not None:
            self.hook.loss_scale = scale if isinstance(scale, torch.Tensor) else float(scale)

    def local_nonfinite(self) -> torch.Tensor | None:
        """This rank's non-finite-norm flag for the guard to agree on; None without a hook."""
        return None if self.hook is None else self.hook.local_flag()

    def nonfinite_flag(self) -> torch.Tensor | None:
        """The flag agreed by every rank on the device (a collective); None without a hook."""
        return None if self.hook is None else self.hook.agreed_flag()


def apply_clip_mode(ddp_model: DistributedDataParallel, config: ClipConfig, reduces: bool = True,
                    sink: BucketSink | None = None) -> ClipHandle:
    """Registers the mode's comm hook on `ddp_model` (none for `none` / `after_allreduce`).

    reduces: False under a sharded optimizer (`sharded.py`), which reduce-scatters the gradient
    itself: every mode's hook then hands DDP the local bucket divided by W (and clipped, in the
    hook modes) without reducing it, so each mode keeps its meaning relative to the reduction.
    sink: with reduces False, the sharded optimizer's `shards`: each bucket goes there as the
    hook launches it, so its reduce-scatter starts during the backward (None: the optimizer
    reduce-scatters everything in its step, after the backward).
    Call once, right after wrapping the model and before its first forward.
    """
    if reduces and sink is not None:
        raise ValueError("a bucket sink takes unreduced buckets: pass reduces=False with it")
    hook_types = {ClipMode.BEFORE_ALLREDUCE: BeforeAllreduceClipHook, ClipMode.BUCKETWISE: BucketwiseClipHook}
    hook_type = hook_types.get(config.mode)
    if hook_type is None:
        if not reduces:
            local = LocalMeanHook(ddp_model.process_group, sink)
            ddp_model.register_comm_hook(local, LocalMeanHook.communicate)
        return ClipHandle(config, None)
    hook = hook_type(max_norm=config.max_grad_norm, process_group=ddp_model.process_group, reduces=reduces, sink=sink)
    ddp_model.register_comm_hook(hook, hook_type.communicate)
    return ClipHandle(config, hook)
