"""CUDA graphs: everything a step needs to be captured once and replayed, in one place.

- `require_graphable`: the preconditions of `--cuda_graphs` at run time (config-level ones,
  such as packed input, are `config.TrainConfig`'s).
- the optimizer a graph replays is `optim/capturable.py`'s: step count, bias corrections
  and learning rate on the device.
- `capture`: the whole-network capture recipe of the PyTorch CUDA-graph notes. A few warm-up
  steps on a side stream (they also trigger torch.compile, allocate optimizer state, and let
  DDP rebuild its buckets: 11 with DDP, as those notes ask), gradients set to None so that
  backward allocates them from the graph's private pool, then capture. The warm-up changes
  weights, optimizer and loss-scaler state; all are restored afterwards
  (`sync_window.InPlaceSnapshot`), so the first replay is the run's first real step. Off a
  GPU the same warm-up and restore run, and each "replay" calls the step directly: the
  arithmetic of the captured step, checked on the CPU (`Replay`).
- `capture_forward`: the same capture for a step that changes no weights (the eval forward:
  `eval_step.GraphedEval`), so nothing is snapshotted or cleared around it.
- `copy_batch`: a batch into the static input buffers a graph reads.

`step.GraphedStep` is the trainer's step built from these.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, Sequence, TypeVar

import torch
from torch.nn.parallel import DistributedDataParallel

from ..data.batch import FlatBatch, tensor_fields
from ..optim.capturable import DeviceStepCount
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
    if not isinstance(optimizer, DeviceStepCount):
        raise ValueError("wrap the optimizer with optim.capturable.capturable() before capturing it")


def copy_batch(dst: FlatBatch, src: FlatBatch) -> None:
    """Copies `src` into the static buffers `dst`; shapes and max_seqlen must match."""
    if (src.max_seqlen, src.row_len) != (dst.max_seqlen, dst.row_len):
        raise ValueError(f"batch max_seqlen / row_len {src.max_seqlen} / {src.row_len} differ from the captured "
                         f"{dst.max_seqlen} / {dst.row_len}: build every batch with the same static_packed_batch sizes")
    for (_, d), (_, s) in zip(tensor_fields(dst), tensor_fields(src)):
        if d.shape != s.shape:
            raise ValueError(f"batch tensor of shape {tuple(s.shape)} does not match the captured "
                             f"{tuple(d.shape)}: build every batch with the same static_packed_batch sizes")
        d.copy_(s, non_blocking=True)


def _nothing() -> None:
    pass


class Replay(Generic[T]):
    """A captured step: calling it runs the step once more and returns what the step returned.

    On a GPU it replays the CUDA graph (the returned tensors are the graph's static outputs,
    overwritten by every call). Elsewhere it calls `prepare` (what the capture did first: clear
    the gradients of a training step) and then the step itself: the same arithmetic, one op at
    a time.
    """

    def __init__(self, step: Callable[[], T], prepare: Callable[[], None] = _nothing,
                 graph: torch.cuda.CUDAGraph | None = None, result: T | None = None) -> None:
        self._step, self._prepare, self.graph, self._result = step, prepare, graph, result

    def __call__(self) -> T:
        if self.graph is None:
            self._prepare()
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
    replay = _captured(step, lambda: optimizer.zero_grad(set_to_none=True), warmup,
                       next(module.parameters()).device)
    snapshot.restore()
    return replay


def capture_forward(step: Callable[[], T], device: torch.device, warmup_steps: int = WARMUP_STEPS) -> Replay[T]:
    """Captures a step that changes no weights or optimizer state (a forward under no_grad).

    The warm-up calls compile the step's layers for its shapes and mode; whatever the step
    accumulates during them is the caller's to reset. Off a GPU nothing is captured (`Replay`).
    """
    return _captured(step, _nothing, warmup_steps, device)


def _captured(step: Callable[[], T], prepare: Callable[[], None], warmup_steps: int,
              device: torch.device) -> Replay[T]:
    if device.type != "cuda":
        _warm_up(step, prepare, warmup_steps)
        return Replay(step, prepare)
    graph, result = _capture_cuda_graph(step, prepare, warmup_steps)
    return Replay(step, prepare, graph, result)


def _warm_up(step: Callable[[], T], prepare: Callable[[], None], steps: int) -> None:
    for _ in range(steps):
        prepare()
        step()


def _capture_cuda_graph(step: Callable[[], T], prepare: Callable[[], None],
                        warmup_steps: int) -> tuple[torch.cuda.CUDAGraph, T]:
    """The GPU-only part: warm-up on a side stream, then capture (a training step's gradients unallocated)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _warm_up(step, prepare, warmup_steps)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    prepare()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result
