"""An optional NVIDIA DALI input pipeline: host batches to the device through DALI.

`DaliPrefetcher` keeps the contract of `device_input.DevicePrefetcher` (host batch dataclasses
in; the same batches, in order, on `device` out) but moves them with a DALI pipeline:

- one `fn.external_source` with one output per tensor field of the batch class. Each host
  batch is one sample of a DALI batch of one, so its tensors may change shape from batch to
  batch (T, S, M of a FlatBatch) without padding; dtype and rank must stay the same.
- the fields that are not tensors (FlatBatch.max_seqlen) never enter DALI: every host batch
  handed to DALI waits in a FIFO until its outputs come back, and the returned batch is that
  host batch with its tensors replaced, so they travel in the same order.
- on CUDA, DALI copies the outputs to the GPU (`.gpu()`) on its own stream while earlier
  steps run, `prefetch_queue_depth` batches ahead; the consumer's current stream waits for
  a batch's copy only when it takes that batch. On the CPU the pipeline runs without a GPU
  (device_id None).
- outputs become torch tensors through DLPack, without a copy; they keep DALI's buffer alive
  after the pipeline is closed, and keep the host dtypes exactly (int64 ids, int32 cu_seqlens).

Preparation: `DaliPrefetcher.from_items(items, prepare, ...)` runs `prepare` (e.g.
`batch.flatten_items`, or `static_batch.static_packed_batch` with fixed sizes) in the external
source's feed. DALI calls the feed from the thread that takes batches, `prefetch_queue_depth`
batches ahead of the one it returns: on a GPU the host builds batch i + depth while the
kernels of the queued steps run; on a CPU device preparation and step share that thread.

DALI is optional: `dali_problem()` says why it does not import (not installed, or installed but
broken), the start-up check refuses `--input_pipeline dali` with that line, and building a
DaliPrefetcher without it raises it as a `DependencyError` (an ImportError).
"""

from __future__ import annotations

import itertools
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, is_dataclass, replace
from types import TracebackType
from typing import Any, Callable, ContextManager, Generic, Iterable, Iterator, NamedTuple, Sequence, TypeVar

import numpy as np
import torch

from ..data.batch import Item, tensor_fields
from ..runtime.optional import DependencyError, dependency_problem

BatchT = TypeVar("BatchT")

INSTALL_HINT = "pip install nvidia-dali-cuda120; NVIDIA's PyTorch NGC containers ship it"
# torch dtype -> name of the DALIDataType that holds it bit for bit (numpy must know the dtype too)
_DALI_TYPE_NAMES = {
    torch.int64: "INT64", torch.int32: "INT32", torch.int16: "INT16", torch.int8: "INT8",
    torch.uint8: "UINT8", torch.bool: "BOOL", torch.float64: "FLOAT64", torch.float32: "FLOAT",
    torch.float16: "FLOAT16",
}
# The pipeline's only operators are the external source and the host-to-device copy: one
# DALI worker thread is enough, and leaves the cores to the trainer.
_DALI_THREADS = 1


class _Dali(NamedTuple):
    """The parts of DALI this module uses, imported on demand."""

    fn: Any
    types: Any
    Pipeline: type


# The DALI modules this file imports; DALI is `nvidia.dali` (`nvidia` is a folder other NVIDIA wheels share).
_DALI_MODULES = ("nvidia.dali.fn", "nvidia.dali.types", "nvidia.dali.pipeline")
_DALI_ROOT = "nvidia.dali"


def dali_problem() -> str | None:
    """None when NVIDIA DALI imports; else one line: not installed, or installed but broken (checked at start-up)."""
    for module in _DALI_MODULES:
        problem = dependency_problem(module, "NVIDIA DALI", "--input_pipeline dali", INSTALL_HINT,
                                     "use --input_pipeline torch", root=_DALI_ROOT)
        if problem is not None:
            return problem
    return None


def _import_dali() -> _Dali:
    problem = dali_problem()
    if problem is not None:
        raise DependencyError(problem)
    from nvidia.dali import fn, types
    from nvidia.dali.pipeline import Pipeline

    return _Dali(fn, types, Pipeline)


def dali_available() -> bool:
    """True when NVIDIA DALI imports in this environment."""
    return dali_problem() is None


# ---------------------------------------------------------------- the host side


@dataclass(frozen=True)
class _Field:
    """One tensor field of the batch class: one DALI output."""

    name: str
    dtype: torch.dtype
    ndim: int


def _tensor_fields(batch: Any) -> tuple[_Field, ...]:
    """The tensor fields of the first batch; every later batch must have the same."""
    if not is_dataclass(batch) or isinstance(batch, type):
        raise TypeError(f"DaliPrefetcher takes batch dataclasses with tensor fields (FlatBatch, PaddedBatch), "
                        f"got {type(batch).__name__}")
    found = tuple(_Field(name, t.dtype, t.dim()) for name, t in tensor_fields(batch))
    if not found:
        raise TypeError(f"{type(batch).__name__} has no tensor fields: nothing for DALI to move")
    for f in found:
        if f.dtype not in _DALI_TYPE_NAMES:
            raise TypeError(f"field {f.name!r} is {f.dtype}; DALI takes {sorted(map(str, _DALI_TYPE_NAMES))}")
    return found


def _host_array(batch: Any, field: _Field, index: int) -> np.ndarray:
    """One field of host batch `index` as a contiguous numpy view (no copy when contiguous)."""
    value = getattr(batch, field.name)
    if not isinstance(value, torch.Tensor) or value.dtype != field.dtype or value.dim() != field.ndim:
        got = f"{value.dtype} {value.dim()}-D" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"batch {index}: field {field.name!r} is {got}, batch 0 had {field.dtype} {field.ndim}-D; "
                         "every batch of one DaliPrefetcher needs the same tensor fields, dtypes and ranks")
    if value.device.type != "cpu":
        raise ValueError(f"batch {index}: field {field.name!r} is on {value.device}; DaliPrefetcher takes host "
                         "batches (it does the host-to-device copy itself)")
    return value.contiguous().numpy()


class _HostFeed:
    """The external source's feed: one host batch per pipeline iteration, as numpy arrays.

    DALI pulls it (next()) from the thread that runs the pipeline, in order; each batch it
    hands over waits in `pending` until the consumer pairs it with DALI's outputs.
    StopIteration from the source ends DALI's input.
    """

    def __init__(self, first: Any, rest: Iterator[Any]) -> None:
        self.fields = _tensor_fields(first)
        self.batch_class = type(first)
        self.pending: deque[Any] = deque()
        self._source = itertools.chain([first], rest)
        self._count = 0

    def __iter__(self) -> "_HostFeed":
        return self

    def __next__(self) -> tuple[np.ndarray, ...]:
        batch = next(self._source)
        if type(batch) is not self.batch_class:
            raise ValueError(f"batch {self._count} is a {type(batch).__name__}, batch 0 was a "
                             f"{self.batch_class.__name__}; one DaliPrefetcher takes one batch class")
        arrays = tuple(_host_array(batch, f, self._count) for f in self.fields)
        self.pending.append(batch)
        self._count += 1
        return arrays


# ---------------------------------------------------------------- the pipeline


def _target_device(device: torch.device | str) -> torch.device:
    """The output device, with an explicit CUDA index (DALI's device_id)."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"DaliPrefetcher on {device}: no CUDA device is visible")
        return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device.type != "cpu":
        raise ValueError(f"DaliPrefetcher delivers to 'cpu' or 'cuda', not {device}: use --input_pipeline torch")
    return device


def _build_pipeline(dali: _Dali, feed: _HostFeed, device: torch.device, depth: int) -> Any:
    """A pipeline of one external source (one output per tensor field), copied to `device`."""
    pipe = dali.Pipeline(batch_size=1, num_threads=_DALI_THREADS, device_id=device.index,
                         prefetch_queue_depth=depth, exec_dynamic=True)
    dtypes = [getattr(dali.types.DALIDataType, _DALI_TYPE_NAMES[f.dtype]) for f in feed.fields]
    with pipe:
        outputs = dali.fn.external_source(source=feed, num_outputs=len(feed.fields), batch=False,
                                          dtype=dtypes, ndim=[f.ndim for f in feed.fields])
        if device.type == "cuda":
            outputs = [o.gpu() for o in outputs]
        pipe.set_outputs(*outputs)
    pipe.build()
    return pipe


class DaliPrefetcher(Generic[BatchT]):
    """Yields the batches of `batches` on `device` through a DALI pipeline, in order.

    A batch is any dataclass with tensor fields (FlatBatch, PaddedBatch); every batch must
    have the same class, tensor dtypes and ranks. DALI pulls `prefetch_queue_depth` batches
    when the prefetcher is built and one more for every batch taken, so up to that many are
    being copied while the caller works on the current one. Returned batches stay valid
    after the next one is taken and after close(). An empty input yields nothing and starts
    no pipeline. Use it as an iterator, then close() it (or use it as a context manager);
    like a generator, a closed or exhausted prefetcher raises StopIteration. An error of
    the source (or of `prepare`) is raised by the call that pulls that batch into the
    queue, up to `prefetch_queue_depth` batches before it would be returned.
    """

    def __init__(self, batches: Iterable[BatchT], device: torch.device | str,
                 prefetch_queue_depth: int = 2) -> None:
        dali = _import_dali()
        if prefetch_queue_depth < 1:
            raise ValueError(f"prefetch_queue_depth must be >= 1 (batches DALI prepares ahead), "
                             f"got {prefetch_queue_depth}")
        self.device = _target_device(device)
        self.prefetch_queue_depth = prefetch_queue_depth
        source = iter(batches)
        first = next(source, None)
        self._feed = _HostFeed(first, source) if first is not None else None
        self._pipe = _build_pipeline(dali, self._feed, self.device, prefetch_queue_depth) if self._feed else None
        if self._pipe is not None:
            self._pipe.schedule_run()  # DALI pulls the first `depth` batches and starts their copies now

    @classmethod
    def from_items(cls, items: Iterable[Sequence[Item]], prepare: Callable[[Sequence[Item]], BatchT],
                   device: torch.device | str, prefetch_queue_depth: int = 2) -> "DaliPrefetcher[BatchT]":
        """Batches built by `prepare` from each element of `items`, inside the pipeline's feed.

        `prepare` runs when DALI pulls a batch, `prefetch_queue_depth` batches ahead of the one
        returned, in the order of `items`: e.g. `batch.flatten_items`, or
        `functools.partial(static_batch.static_packed_batch, rows=..., row_len=..., ...)`.
        """
        return cls(map(prepare, items), device, prefetch_queue_depth)

    def __iter__(self) -> "DaliPrefetcher[BatchT]":
        return self

    def __next__(self) -> BatchT:
        if self._pipe is None:
            raise StopIteration
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        try:
            outputs = self._pipe.share_outputs(stream)  # the consumer stream waits for this batch only
        except StopIteration:
            self.close()
            raise
        batch = self._as_batch(outputs)
        self._pipe.release_outputs()
        self._pipe.schedule_run()  # pulls the next host batch into the freed slot
        return batch

    def _as_batch(self, outputs: Sequence[Any]) -> BatchT:
        """The oldest pending host batch with its tensors replaced by DALI's outputs (DLPack views)."""
        feed = self._feed
        assert feed is not None, "a pipeline runs only with a host feed"
        host = feed.pending.popleft()
        scope: ContextManager = torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()
        with scope:  # from_dlpack passes the current stream of this device to DALI
            tensors = {f.name: torch.from_dlpack(out[0]) for f, out in zip(feed.fields, outputs)}
        return replace(host, **tensors)

    def close(self) -> None:
        """Frees the pipeline (its thread, queues and pending host batches). Safe to call again."""
        self._pipe = None  # nothing else refers to it: DALI shuts it down now
        self._feed = None

    def __enter__(self) -> "DaliPrefetcher[BatchT]":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
