"""CUDA graphs: everything a step needs to be captured once and replayed, in one place.

- `require_graphable`: the preconditions of `--cuda_graphs` at run time (config-level ones,
  such as packed input, are `config.TrainConfig`'s).
- `device_lr` / `capturable`: the learning rate as a device tensor, and a LAMB/AdamW whose
  step counter and bias corrections live on the device too, so the whole optimizer step
  can be replayed from a graph (the multi-tensor `ForeachLamb` arithmetic, unchanged). Given
  the run's schedule, it also computes its learning rate from that device step count, so an
  fp16 step skipped on the device (`loss_scale`) does not advance the schedule either.
- `capture`: the whole-network capture recipe of the PyTorch CUDA-graph notes. A few warm-up
  steps on a side stream (they also trigger torch.compile, allocate optimizer state, and let
  DDP rebuild its buckets: 11 with DDP, as those notes ask), gradients set to None so that
  backward allocates them from the graph's private pool, then capture. The warm-up changes
  weights, optimizer and loss-scaler state; all are restored afterwards
  (`sync_window.InPlaceSnapshot`), so the first replay is the run's first real step. Off a
  GPU the same warm-up and restore run, and each "replay" calls the step directly: the
  arithmetic of the captured step, checked on the CPU (`Replay`).
- `copy_batch`: a batch into the static input buffers a graph reads.

`step.GraphedStep` is the trainer's step built from these.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Callable, Generic, Sequence, TypeVar

import torch
from torch.nn.parallel import DistributedDataParallel

from .batch import FlatBatch
from .optim import ForeachAdamW, ForeachLamb, _ForeachKernels
from .schedule import LRSchedule
from .sync_window import InPlaceSnapshot

T = TypeVar("T")

# Eager iterations before capturing a DDP model (PyTorch's CUDA-graph notes: DDP needs at
# least 11 before its state settles); 3 suffice without DDP (compile, optimizer state).
DDP_WARMUP_STEPS = 11
WARMUP_STEPS = 3


def require_graphable(precision: str, optimizer: torch.optim.Optimizer, device_scaled: bool) -> None:
    """Raises, naming the fix, unless a step with `optimizer` can be captured."""
    if precision == "fp16" and not device_scaled:
        raise ValueError("an fp16 step in a CUDA graph needs loss_scale.DeviceLossScaler: GradScaler skips "
                         "steps from the host")
    if not isinstance(optimizer, _DeviceStepCount):
        raise ValueError("wrap the optimizer with cuda_graphs.capturable() before capturing it")


def device_lr(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Replaces each group's float lr with a 0-dim float32 tensor on `device`.

    `schedule.set_lr` then fills it in place (a queued kernel, no sync), and a captured
    CUDA graph reads the new value on every replay.
    """
    for group in optimizer.param_groups:
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            group["lr"] = lr.to(device=device, dtype=torch.float32)
        else:
            group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)


class _DeviceStepCount(_ForeachKernels):
    """Keeps each group's step count as a device tensor and computes bias corrections there.

    The host-side count of `ForeachLamb` is a Python int: a CUDA graph would bake the bias
    corrections of the captured step into every replay. Here `step` is a float64 0-dim
    tensor advanced by a kernel, and 1 - beta^step is evaluated on the device (float64,
    then float32, the precision the host value is used in). With a `schedule`, each group's
    lr tensor is set to `schedule.lr_tensor(step)` first: the lr of the update after `step`
    applied ones, whatever the host last wrote into it.
    """

    schedule: LRSchedule | None = None

    # The bias corrections as device tensors where the host version returns floats: the
    # foreach arithmetic takes either.
    def _advance(self, group: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        step = self._step_tensor(group)
        if self.schedule is not None:
            group["lr"].copy_(self.schedule.lr_tensor(step))
        step.add_(1)
        beta1, beta2 = group["betas"]
        return (1.0 - torch.pow(beta1, step)).float(), (1.0 - torch.pow(beta2, step)).float()

    @staticmethod
    def _step_tensor(group: dict[str, Any]) -> torch.Tensor:
        step = group.get("step", 0)
        if not isinstance(step, torch.Tensor):
            step = torch.tensor(float(step), dtype=torch.float64, device=group["params"][0].device)
            group["step"] = step
        return step

    def init_state(self) -> None:
        """Creates every moment buffer and step tensor now, before warm-up and capture."""
        for group in self.param_groups:
            self._step_tensor(group)
            for p in group["params"]:
                self._ensure_state(p)


class CapturableLamb(_DeviceStepCount, ForeachLamb):
    """`ForeachLamb` with the step count on the device: safe to capture in a CUDA graph."""


class CapturableAdamW(_DeviceStepCount, ForeachAdamW):
    """`ForeachAdamW` with the step count on the device: safe to capture in a CUDA graph."""


_CAPTURABLE: dict[type[torch.optim.Optimizer], type[_DeviceStepCount]] = {
    ForeachLamb: CapturableLamb, ForeachAdamW: CapturableAdamW}


def capturable(optimizer: torch.optim.Optimizer, schedule: LRSchedule | None = None) -> _DeviceStepCount:
    """The graph-safe twin of a `ForeachLamb` / `ForeachAdamW`: same groups, same state.

    The lr becomes a device tensor and all state is created eagerly. Build it after any
    checkpoint is loaded; the old optimizer object must not be stepped afterwards.
    schedule: the lr then follows the device step count (see `_DeviceStepCount`); None: the
    lr is what `schedule.set_lr` last wrote.
    """
    cls = _CAPTURABLE.get(type(optimizer))
    if cls is None or not isinstance(optimizer, _ForeachKernels):
        raise ValueError(
            f"{type(optimizer).__name__} cannot run inside a CUDA graph: build the optimizer with "
            "implementation 'foreach' (--optimizer_impl foreach) for --cuda_graphs"
        )
    d = optimizer.defaults
    groups = [dict(g) for g in optimizer.param_groups]
    twin = cls(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
               max_grad_norm=optimizer.max_grad_norm)
    twin.state.update(optimizer.state)
    twin.schedule = schedule
    device_lr(twin, groups[0]["params"][0].device)
    twin.init_state()
    return twin


def _tensors(batch: Any) -> list[torch.Tensor]:
    return [v for f in fields(batch) for v in [getattr(batch, f.name)] if isinstance(v, torch.Tensor)]


def copy_batch(dst: FlatBatch, src: FlatBatch) -> None:
    """Copies `src` into the static buffers `dst`; shapes and max_seqlen must match."""
    if (src.max_seqlen, src.row_len) != (dst.max_seqlen, dst.row_len):
        raise ValueError(f"batch max_seqlen / row_len {src.max_seqlen} / {src.row_len} differ from the captured "
                         f"{dst.max_seqlen} / {dst.row_len}: build every batch with the same static_packed_batch sizes")
    for d, s in zip(_tensors(dst), _tensors(src)):
        if d.shape != s.shape:
            raise ValueError(f"batch tensor of shape {tuple(s.shape)} does not match the captured "
                             f"{tuple(d.shape)}: build every batch with the same static_packed_batch sizes")
        d.copy_(s, non_blocking=True)


class Replay(Generic[T]):
    """A captured step: calling it runs the step once more and returns what the step returned.

    On a GPU it replays the CUDA graph (the returned tensors are the graph's static outputs,
    overwritten by every call). Elsewhere it calls the step itself, with gradients cleared
    first as a capture leaves them: the same arithmetic, one op at a time.
    """

    def __init__(self, step: Callable[[], T], optimizer: torch.optim.Optimizer,
                 graph: torch.cuda.CUDAGraph | None = None, result: T | None = None) -> None:
        self._step, self._optimizer, self.graph, self._result = step, optimizer, graph, result

    def __call__(self) -> T:
        if self.graph is None:
            self._optimizer.zero_grad(set_to_none=True)
            return self._step()
        self.graph.replay()
        return self._result  # type: ignore[return-value]  # set together with the graph


def warmup_steps_for(module: torch.nn.Module) -> int:
    return DDP_WARMUP_STEPS if isinstance(module, DistributedDataParallel) else WARMUP_STEPS


def capture(step: Callable[[], T], module: torch.nn.Module, optimizer: torch.optim.Optimizer,
            extra_state: Sequence[torch.Tensor] = (), warmup_steps: int | None = None) -> Replay[T]:
    """Captures `step` (forward + backward + optimizer step on static buffers) as one graph.

    module: the model, or its DDP wrapper. extra_state: more tensors the step changes (the
    loss scaler's), restored with the weights. Weights and optimizer state are as before the
    call. Load checkpoints before: `load_state_dict` replaces optimizer state tensors, and the
    graph keeps reading the old ones. Off a GPU nothing is captured (`Replay`).
    """
    snapshot = InPlaceSnapshot(module, optimizer, extra_state)
    warmup = warmup_steps_for(module) if warmup_steps is None else warmup_steps
    device = next(module.parameters()).device
    if device.type != "cuda":
        _warm_up(step, optimizer, warmup)
        snapshot.restore()
        return Replay(step, optimizer)
    graph, result = _capture_cuda_graph(step, optimizer, warmup)
    snapshot.restore()
    return Replay(step, optimizer, graph, result)


def _warm_up(step: Callable[[], T], optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        step()


def _capture_cuda_graph(step: Callable[[], T], optimizer: torch.optim.Optimizer,
                        warmup_steps: int) -> tuple[torch.cuda.CUDAGraph, T]:
    """The GPU-only part: warm-up on a side stream, then capture with gradients unallocated."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _warm_up(step, optimizer, warmup_steps)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        result = step()
    return graph, result
