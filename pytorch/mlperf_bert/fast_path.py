"""The fast training path, applied to the model and the step from outside the model.

The model (`model.py`) stays a textbook BERT on flat tokens. What makes a step fast on a
GPU is added here, each piece usable on its own and each with a CPU-testable part:

- `compile_model`: regional `torch.compile` of every encoder layer and of the MLM head's
  transform, which fuses bias+GELU and dropout+residual+LayerNorm into a few kernels.
- `device_lr` / `capturable`: the learning rate as a device tensor, and a LAMB/AdamW whose
  step counter and bias corrections live on the device too, so the whole optimizer step
  can be replayed from a CUDA graph (the multi-tensor `ForeachLamb` arithmetic, unchanged).
- `StepMetrics`: loss and masked-LM accuracy summed on the device, read every N steps.
- `static_packed_batch`: packed rows as a `FlatBatch` of fixed shapes (padding tokens form
  their own dummy sequences, empty sequences pad `cu_seqlens`, ignored labels pad the
  predictions), so one CUDA graph serves every batch; `example_static_batch` gives one of
  the same shapes without reading data, for capturing at init.
- `DevicePrefetcher`: pinned host memory and host-to-device copies on a side stream.
- `train_step` (eager) and `GraphedTrainStep` (forward + backward + optimizer step
  captured as one CUDA graph on static buffers; `sync_window.InPlaceSnapshot` undoes its
  warm-up).

Precision: bf16 and fp16 through autocast; fp16 needs a `torch.amp.GradScaler`, whose
skip decision reads the device, so fp16 runs eagerly and CUDA graphs take bf16 or fp32.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, ContextManager, Generic, Iterable, Iterator, Sequence, TypeVar

import numpy as np
import torch

from .batch import FlatBatch, Item, Sample
from .config import COMPILE_MODES
from .model import BertForPreTraining, PretrainingLoss, PretrainingOutput, pretraining_loss
from .optim import ForeachAdamW, ForeachLamb
from .sync_window import InPlaceSnapshot

# F.cross_entropy's default ignore_index: labels of padded predictions and NSP slots.
IGNORE_INDEX = -100
AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str, cache_enabled: bool = True) -> ContextManager:
    """Autocast for "bf16" / "fp16", nothing for "fp32".

    Inside a CUDA-graph capture pass cache_enabled=False: cached casts of the weights would
    be made once at capture and never again.
    """
    if precision not in AUTOCAST_DTYPES:
        raise ValueError(f"precision must be one of {tuple(AUTOCAST_DTYPES)}, got {precision!r}")
    dtype = AUTOCAST_DTYPES[precision]
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=cache_enabled)


def compile_model(model: BertForPreTraining, mode: str = "default", dynamic: bool | None = None,
                  backend: str = "inductor") -> BertForPreTraining:
    """Compiles each encoder layer and the MLM transform in place (regional compile).

    All layers share one compiled graph, so compile time does not grow with depth. Inductor
    fuses the bias add + GELU after the FFN GEMM, and dropout + residual add + LayerNorm
    after each output projection. `dynamic=True` suits batches whose token count changes
    every step (padded, unpadded); static packed batches compile best with False.
    mode "none" leaves the model eager.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}")
    if mode == "none":
        return model
    options: dict[str, Any] = {"dynamic": dynamic, "backend": backend}
    if backend == "inductor":
        options["mode"] = mode
    for layer in model.bert.encoder.layer:
        layer.compile(**options)
    model.cls.predictions.transform.compile(**options)
    return model


# ---------------------------------------------------------------- optimizer on the device


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


class _DeviceStepCount:
    """Keeps each group's step count as a device tensor and computes bias corrections there.

    The host-side count of `ForeachLamb` is a Python int: a CUDA graph would bake the bias
    corrections of the captured step into every replay. Here `step` is a float64 0-dim
    tensor advanced by a kernel, and 1 - beta^step is evaluated on the device (float64,
    then float32, the precision the host value is used in).
    """

    param_groups: list[dict[str, Any]]
    state: dict[torch.Tensor, dict[str, Any]]
    _ensure_state: Callable[[torch.Tensor], None]  # from the optimizer class it is mixed into

    def _advance(self, group: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        step = self._step_tensor(group)
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


_CAPTURABLE = {ForeachLamb: CapturableLamb, ForeachAdamW: CapturableAdamW}


def capturable(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The graph-safe twin of a `ForeachLamb` / `ForeachAdamW`: same groups, same state.

    The lr becomes a device tensor and all state is created eagerly. Build it after any
    checkpoint is loaded; the old optimizer object must not be stepped afterwards.
    """
    cls = _CAPTURABLE.get(type(optimizer))
    if cls is None:
        raise ValueError(
            f"{type(optimizer).__name__} cannot run inside a CUDA graph: build the optimizer with "
            "implementation 'foreach' (--optimizer_impl foreach) for --cuda_graphs"
        )
    d = optimizer.defaults
    groups = [dict(g) for g in optimizer.param_groups]
    twin = cls(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
               max_grad_norm=optimizer.max_grad_norm)
    twin.state.update(optimizer.state)
    device_lr(twin, groups[0]["params"][0].device)
    twin.init_state()
    return twin


# ---------------------------------------------------------------- metrics without syncs


@dataclass
class StepOutput:
    loss: PretrainingLoss
    output: PretrainingOutput


@dataclass(frozen=True)
class MetricsReading:
    steps: int
    loss: float  # mean over steps of mlm + nsp
    mlm_loss: float
    nsp_loss: float
    mlm_accuracy: float  # correct / real masked positions, over all steps read


class StepMetrics:
    """Sums loss and masked-LM accuracy on the device; `read()` is the only host sync.

    Labels equal to IGNORE_INDEX (padding of a static batch) count neither as correct nor
    as predictions.
    """

    _LOSS, _MLM, _NSP, _CORRECT, _PREDICTED, _STEPS = range(6)

    def __init__(self, device: torch.device) -> None:
        self._sums = torch.zeros(6, dtype=torch.float64, device=device)

    def update(self, step: StepOutput, batch: FlatBatch) -> None:
        labels = batch.masked_lm_ids
        valid = labels != IGNORE_INDEX
        correct = (step.output.mlm_logits.detach().argmax(dim=-1) == labels) & valid
        values = (step.loss.total.detach(), step.loss.mlm.detach(), step.loss.nsp.detach(), correct.sum(),
                  valid.sum(), torch.ones((), device=labels.device))
        self._sums += torch.stack([v.to(torch.float64) for v in values])

    def read(self) -> MetricsReading:
        """Means since the last read (one device-to-host copy), then starts a new window."""
        loss, mlm, nsp, correct, predicted, steps = self._sums.tolist()
        if steps == 0:
            raise RuntimeError("StepMetrics.read() before any update()")
        self._sums.zero_()
        return MetricsReading(int(steps), loss / steps, mlm / steps, nsp / steps, correct / max(predicted, 1.0))


# ---------------------------------------------------------------- static-shape packed batch


def _check_static_rows(items: Sequence[Item], rows: int, row_len: int, max_seqs: int, max_predictions: int) -> None:
    if not any(items):
        raise ValueError("a static packed batch needs at least one sequence")
    if len(items) > rows:
        raise ValueError(f"{len(items)} packed rows do not fit a static batch of rows={rows}: raise rows "
                         "to the per-step pack count (--train_batch_size in the packed layout)")
    for r, item in enumerate(items):
        predictions = sum(s.masked_lm_positions.shape[0] for s in item)
        if len(item) > max_seqs:
            raise ValueError(f"packed row {r} holds {len(item)} sequences, more than max_seqs_per_row={max_seqs}")
        if sum(s.length for s in item) > row_len:
            raise ValueError(f"packed row {r} holds {sum(s.length for s in item)} tokens, more than row_len={row_len}")
        if predictions > max_predictions:
            raise ValueError(f"packed row {r} has {predictions} masked positions, more than max_predictions="
                             f"{max_predictions}: raise it to the widest row (the packed shards' Q)")


@dataclass
class _RowLayout:
    """Host arrays of a static batch while it is filled row by row."""

    input_ids: np.ndarray  # [T]
    segment_ids: np.ndarray  # [T]
    position_ids: np.ndarray  # [T]
    seqlens: list[int]  # non-empty sequences in token order: real ones and per-row padding
    nsp: list[int]  # one label per entry of seqlens (IGNORE_INDEX for padding)
    masked_positions: list[np.ndarray]
    masked_ids: list[np.ndarray]

    def place(self, sample: Sample, start: int) -> None:
        n = sample.length
        self.input_ids[start : start + n] = sample.input_ids
        self.segment_ids[start : start + n] = sample.segment_ids
        self.position_ids[start : start + n] = np.arange(n)
        self.seqlens.append(n)
        self.nsp.append(sample.next_sentence_label)
        self.masked_positions.append(sample.masked_lm_positions.astype(np.int64) + start)
        self.masked_ids.append(sample.masked_lm_ids.astype(np.int64))

    def place_row(self, item: Item, row_start: int, row_len: int) -> None:
        """The row's sequences left to right, then its tail as one dummy sequence."""
        offset = row_start
        for sample in item:
            self.place(sample, offset)
            offset += sample.length
        tail = row_start + row_len - offset
        if tail:  # pad tokens: id 0, position 0; a sequence of their own, so nothing attends to them
            self.seqlens.append(tail)
            self.nsp.append(IGNORE_INDEX)


def _padded(parts: list[np.ndarray], size: int, fill: int) -> torch.Tensor:
    values = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    out = np.full(size, fill, dtype=np.int64)
    out[: values.shape[0]] = values
    return torch.from_numpy(out)


def static_packed_batch(items: Sequence[Item], rows: int, row_len: int, max_seqs_per_row: int,
                        max_predictions: int) -> FlatBatch:
    """Packed rows as a FlatBatch whose shapes depend only on the four sizes.

    Shapes: T = rows * row_len tokens; S = rows * (max_seqs_per_row + 1) sequence slots,
    cu_seqlens [S+1]; M = rows * max_predictions predictions; max_seqlen = row_len.
    Row r owns tokens [r*row_len, (r+1)*row_len): its sequences, then its unused tail as
    one dummy sequence (a missing row is one dummy sequence of row_len tokens). A row thus
    needs up to max_seqs_per_row + 1 slots; the slots left over are empty sequences at the
    front of cu_seqlens (zero lengths starting at token 0, so every slot's [CLS] index is
    a valid token). Dummy and empty slots have NSP label IGNORE_INDEX, padded predictions
    point at token 0 with label IGNORE_INDEX: the loss, its gradients and StepMetrics equal
    those of `flatten_items(items)`. `row_len` is set, so attention runs row by row
    (`attention.row_attention`).
    """
    _check_static_rows(items, rows, row_len, max_seqs_per_row, max_predictions)
    t = rows * row_len
    layout = _RowLayout(np.zeros(t, np.int64), np.zeros(t, np.int64), np.zeros(t, np.int64), [], [], [], [])
    for r in range(rows):
        layout.place_row(items[r] if r < len(items) else (), r * row_len, row_len)
    slots = rows * (max_seqs_per_row + 1)
    empty = slots - len(layout.seqlens)
    lengths = np.concatenate([np.zeros(empty, np.int64), np.asarray(layout.seqlens, np.int64)])
    cu = np.zeros(slots + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    m = rows * max_predictions
    return FlatBatch(
        input_ids=torch.from_numpy(layout.input_ids),
        segment_ids=torch.from_numpy(layout.segment_ids),
        position_ids=torch.from_numpy(layout.position_ids),
        cu_seqlens=torch.from_numpy(cu),
        max_seqlen=row_len,
        masked_positions=_padded(layout.masked_positions, m, 0),
        masked_lm_ids=_padded(layout.masked_ids, m, IGNORE_INDEX),
        next_sentence_labels=_padded([np.full(empty, IGNORE_INDEX), np.asarray(layout.nsp, np.int64)], slots,
                                     IGNORE_INDEX),
        row_len=row_len,
    )


def example_static_batch(rows: int, row_len: int, max_seqs_per_row: int, max_predictions: int) -> FlatBatch:
    """A static packed batch of these sizes holding one synthetic sequence.

    For capturing a CUDA graph before any training data is read (at init, before
    run_start): GraphedTrainStep restores the weights after capture, so the content of
    the example never reaches the model.
    """
    placeholder = Sample(np.zeros(row_len, np.int64), np.zeros(row_len, np.int64), np.array([1]), np.array([0]), 0)
    return static_packed_batch([(placeholder,)], rows, row_len, max_seqs_per_row, max_predictions)


# ---------------------------------------------------------------- host-to-device prefetch

BatchT = TypeVar("BatchT")


def map_tensors(batch: BatchT, fn: Callable[[torch.Tensor], torch.Tensor]) -> BatchT:
    """A copy of a batch dataclass with `fn` applied to every tensor field."""
    changed = {f.name: fn(v) for f in fields(batch) for v in [getattr(batch, f.name)] if isinstance(v, torch.Tensor)}
    return replace(batch, **changed)


def _tensors(batch: Any) -> list[torch.Tensor]:
    return [v for f in fields(batch) for v in [getattr(batch, f.name)] if isinstance(v, torch.Tensor)]


class DevicePrefetcher(Generic[BatchT]):
    """Yields the batches of `batches` on `device`, the next one already on its way.

    A batch is any dataclass with tensor fields and a `.to(device, non_blocking)` method
    (FlatBatch, PaddedBatch). On CUDA the host tensors are pinned (unless they are already,
    or pin_memory=False) and copied with non_blocking=True on a side stream while the
    current step runs; the consumer's stream waits for that copy only when it takes the
    batch. Elsewhere batches are moved synchronously, in the same order.
    """

    def __init__(self, batches: Iterable[BatchT], device: torch.device | str, pin_memory: bool | None = None) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self._pin = cuda if pin_memory is None else pin_memory
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._source: Iterator[BatchT] = iter(batches)
        self._next = self._start_copy()

    def _start_copy(self) -> tuple[BatchT, Any] | None:
        host = next(self._source, None)
        if host is None:
            return None
        if self._pin:
            host = map_tensors(host, lambda t: t if t.is_pinned() else t.pin_memory())
        if self._stream is None:
            return host.to(self.device), None
        with torch.cuda.stream(self._stream):
            moved = host.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        return moved, done

    def __iter__(self) -> "DevicePrefetcher[BatchT]":
        return self

    def __next__(self) -> BatchT:
        if self._next is None:
            raise StopIteration
        batch, done = self._next
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            for t in _tensors(batch):  # memory made on the side stream is now used on this one
                t.record_stream(current)
        self._next = self._start_copy()
        return batch


# ---------------------------------------------------------------- the step


def _forward_backward(model: torch.nn.Module, batch: FlatBatch, precision: str, cache_enabled: bool = True,
                      scaler: torch.amp.GradScaler | None = None) -> StepOutput:
    with autocast(batch.input_ids.device, precision, cache_enabled):
        output = model(batch)
        loss = pretraining_loss(output, batch)
    (scaler.scale(loss.total) if scaler is not None else loss.total).backward()
    return StepOutput(loss, output)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: FlatBatch, precision: str,
               scaler: torch.amp.GradScaler | None = None) -> StepOutput:
    """One eager step: forward, loss, backward, optimizer step (through `scaler` for fp16)."""
    optimizer.zero_grad(set_to_none=True)
    result = _forward_backward(model, batch, precision, scaler=scaler)
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    return result


def _copy_batch(dst: FlatBatch, src: FlatBatch) -> None:
    """Copies `src` into the static buffers `dst`; shapes and max_seqlen must match."""
    if (src.max_seqlen, src.row_len) != (dst.max_seqlen, dst.row_len):
        raise ValueError(f"batch max_seqlen / row_len {src.max_seqlen} / {src.row_len} differ from the captured "
                         f"{dst.max_seqlen} / {dst.row_len}: build every batch with the same static_packed_batch sizes")
    for d, s in zip(_tensors(dst), _tensors(src)):
        if d.shape != s.shape:
            raise ValueError(f"batch tensor of shape {tuple(s.shape)} does not match the captured "
                             f"{tuple(d.shape)}: build every batch with the same static_packed_batch sizes")
        d.copy_(s, non_blocking=True)


class GraphedTrainStep:
    """Forward + backward + optimizer step of static-shape batches, replayed as one CUDA graph.

    Follows the whole-network capture recipe of the PyTorch CUDA-graph notes: a few warm-up
    steps on a side stream (they also trigger torch.compile and allocate optimizer state),
    gradients set to None so that backward allocates them from the graph's private pool,
    then capture. The warm-up steps change weights and optimizer state; both are restored
    afterwards, so the first replay is the run's first real step. Load checkpoints before
    building it: `load_state_dict` replaces optimizer state tensors, and the graph keeps
    reading the old ones.

    Each call copies a batch (host, ideally pinned, or device) into the static input
    buffers and replays the graph. The returned StepOutput holds static tensors that the
    next call overwrites: read them (e.g. StepMetrics.update) before calling again. The
    learning rate is read from the optimizer's device tensor at every replay: write it
    with `schedule.set_lr` before the call. Dropout draws new numbers on every replay.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, example: FlatBatch,
                 precision: str = "bf16", warmup_steps: int = 3) -> None:
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise RuntimeError(f"GraphedTrainStep needs a CUDA device, the model is on {device}; "
                               "run the eager train_step elsewhere")
        if precision == "fp16":
            raise ValueError("CUDA graphs take --precision bf16 or fp32: fp16 needs a loss scaler that skips "
                             "steps from the host")
        if not isinstance(optimizer, _DeviceStepCount):
            raise ValueError("wrap the optimizer with fast_path.capturable() before capturing it")
        self.model, self.optimizer, self.precision = model, optimizer, precision
        self.static = map_tensors(example, lambda t: t.to(device).clone())
        snapshot = InPlaceSnapshot(model, optimizer)
        self._warm_up(warmup_steps)
        self.graph = torch.cuda.CUDAGraph()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.cuda.graph(self.graph):
            self.result = self._step()
        snapshot.restore()

    def _step(self) -> StepOutput:
        result = _forward_backward(self.model, self.static, self.precision, cache_enabled=False)
        self.optimizer.step()
        return result

    def _warm_up(self, steps: int) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(steps):
                self.optimizer.zero_grad(set_to_none=True)
                self._step()
        torch.cuda.current_stream().wait_stream(side)

    def __call__(self, batch: FlatBatch) -> StepOutput:
        _copy_batch(self.static, batch)
        self.graph.replay()
        return self.result
