"""This rank's micro-batches on the device, built on the host and, on a GPU, copied ahead.

`DeviceInput` wraps a `sources.BatchSource`. Each `next()` returns the next micro-batch on
the device. With `ahead` (the trainer's choice on CUDA) the following batch is already
built, pinned and on its way while the current step runs: `DevicePrefetcher`
(pinned memory, copies on a side stream) or, with `--input_pipeline dali`, NVIDIA DALI.

Reading ahead must not move the run's data position: `state_dict()` is the source's
position after the last batch *handed out*, so a checkpoint never skips the batches still
in flight. The source's token meter counts a batch when it is read, i.e. up to the
prefetch depth micro-batches early (the per-interval load statistics shift by as much).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, ClassVar, Generic, Iterable, Iterator, Protocol, TypeVar

import torch

from ..data.batch import IGNORE_INDEX, TensorBatch, map_tensors, tensor_fields
from .sources import BatchSource, TokenImbalance

HostBuilder = Callable[[BatchSource], Any]  # source -> host batch (FlatBatch or PaddedBatch)
DeviceFinisher = Callable[[Any], Any]  # device batch -> FlatBatch (e.g. batch.unpad)


def _identity(batch: Any) -> Any:
    return batch


class HostBatch(TensorBatch, Protocol):
    """A dataclass of tensors that moves to a device (FlatBatch, PaddedBatch)."""

    def to(self, device: torch.device, non_blocking: bool = False) -> Any: ...


BatchT = TypeVar("BatchT", bound=HostBatch)


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
            for _, t in tensor_fields(batch):  # memory made on the side stream is now used on this one
                t.record_stream(current)
        self._next = self._start_copy()
        return batch


def real_tokens(batch: Any) -> int:
    """Non-padding tokens of a host batch: padded (input_mask), flat or static packed (real sequences)."""
    mask = getattr(batch, "input_mask", None)
    if mask is not None:
        return int(mask.sum())
    lengths = batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]
    return int(lengths[batch.next_sentence_labels != IGNORE_INDEX].sum())


def prefetcher(batches: Iterator[Any], device: torch.device, pipeline: str) -> Iterator[Any]:
    """The host-to-device stage: "torch" (DevicePrefetcher) or "dali" (DaliPrefetcher)."""
    if pipeline == "torch":
        return DevicePrefetcher(batches, device)
    if pipeline == "dali":
        from .dali_input import DaliPrefetcher

        return DaliPrefetcher(batches, device)
    raise ValueError(f"--input_pipeline must be torch or dali, got {pipeline!r}")


class DeviceInput:
    """`next()`: the next micro-batch on `device`; a BatchSource's state, meter and close."""

    def __init__(self, source: BatchSource, build: HostBuilder, device: torch.device,
                 finish: DeviceFinisher = _identity, ahead: bool = False, pipeline: str = "torch") -> None:
        self.source, self.device = source, device
        self._build, self._finish = build, finish
        self._positions: deque[tuple[dict, int]] = deque()  # (source position, real tokens) per batch read
        self._position = source.state_dict()
        self.tokens = 0  # real tokens handed out by `next()` so far (counted on the host)
        self._ahead = prefetcher(self._host_batches(), device, pipeline) if ahead else None

    def _host_batches(self) -> Iterator[Any]:
        while True:
            batch = self._build(self.source)
            self._positions.append((self.source.state_dict(), real_tokens(batch)))
            yield batch

    def next(self) -> Any:
        if self._ahead is None:
            host = self._build(self.source)
            self._position, tokens = self.source.state_dict(), real_tokens(host)
            batch = host.to(self.device, non_blocking=True)
        else:
            batch = next(self._ahead)
            self._position, tokens = self._positions.popleft()
        self.tokens += tokens
        return self._finish(batch)

    def state_dict(self) -> dict:
        """The data position after the last batch handed out by `next()`."""
        return self._position

    def token_imbalance(self) -> TokenImbalance:
        return self.source.token_imbalance()

    def close(self) -> None:
        """Stops the prefetcher (the source itself belongs to, and is closed by, its opener)."""
        closer = getattr(self._ahead, "close", None)
        if closer is not None:
            closer()
