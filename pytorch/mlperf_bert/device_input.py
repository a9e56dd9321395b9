"""This rank's micro-batches on the device, built on the host and, on a GPU, copied ahead.

`DeviceInput` wraps a `sources.BatchSource`. Each `next()` returns the next micro-batch on
the device. With `ahead` (the trainer's choice on CUDA) the following batch is already
built, pinned and on its way while the current step runs: `fast_path.DevicePrefetcher`
(pinned memory, copies on a side stream) or, with `--input_pipeline dali`, NVIDIA DALI.

Reading ahead must not move the run's data position: `state_dict()` is the source's
position after the last batch *handed out*, so a checkpoint never skips the batches still
in flight. The source's token meter counts a batch when it is read, i.e. up to the
prefetch depth micro-batches early (the per-interval load statistics shift by as much).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterator

import torch

from .sources import BatchSource, TokenImbalance

HostBuilder = Callable[[BatchSource], Any]  # source -> host batch (FlatBatch or PaddedBatch)
DeviceFinisher = Callable[[Any], Any]  # device batch -> FlatBatch (e.g. batch.unpad)


def _identity(batch: Any) -> Any:
    return batch


def prefetcher(batches: Iterator[Any], device: torch.device, pipeline: str) -> Iterator[Any]:
    """The host-to-device stage: "torch" (DevicePrefetcher) or "dali" (DaliPrefetcher)."""
    if pipeline == "torch":
        from .fast_path import DevicePrefetcher

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
        self._positions: deque[dict] = deque()  # source position after each batch read, oldest first
        self._position = source.state_dict()
        self._ahead = prefetcher(self._host_batches(), device, pipeline) if ahead else None

    def _host_batches(self) -> Iterator[Any]:
        while True:
            batch = self._build(self.source)
            self._positions.append(self.source.state_dict())
            yield batch

    def next(self) -> Any:
        if self._ahead is None:
            batch = self._build(self.source).to(self.device, non_blocking=True)
            self._position = self.source.state_dict()
        else:
            batch = next(self._ahead)
            self._position = self._positions.popleft()
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
