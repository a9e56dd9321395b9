"""Recording stand-ins for the parts of `torch.cuda` a CPU-only torch cannot run.

Streams, events and graphs have no device to talk to in a dry run: the stand-ins keep the
calls' shape (what was captured, how often it was replayed, how often the host waited, how many
side streams were made, how often an event was recorded and a stream waited for one) in a
`CudaLog`, and mark the `Recorder` as capturing between `capture_begin` and `capture_end`, so
that host reads and copies inside a capture are caught. `install` patches them into
`torch.cuda` for the length of a `with` block.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from .record import Recorder, caller_line


@dataclass
class CudaLog:
    syncs: list[str] = field(default_factory=list)  # host waits: synchronize(), Event/Stream.synchronize()
    captures: int = 0
    replays: int = 0
    phase_replays: Counter[str] = field(default_factory=Counter)  # the recorder's phase -> replays in it
    streams: int = 0  # side streams made (torch.cuda.Stream())
    event_records: int = 0  # Event.record / Stream.record_event
    stream_waits: int = 0  # a stream ordered after an event or another stream (no host wait)


class _Stream(torch.Stream):
    """A torch.Stream on cuda:0 (tensors' record_stream takes only those)."""

    def __new__(cls, device: Any = None, priority: int = 0, **_: Any) -> "_Stream":
        return super().__new__(cls, stream_id=0, device_index=0, device_type=1)

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        _state.log.streams += 1

    def wait_stream(self, other: torch.Stream) -> None:
        _state.log.stream_waits += 1

    def wait_event(self, event: torch.Event) -> None:
        _state.log.stream_waits += 1

    def record_event(self, event: torch.Event | None = None) -> torch.Event:
        _state.log.event_records += 1
        return event or _Event()

    def synchronize(self) -> None:
        _state.log.syncs.append(caller_line())

    def query(self) -> bool:
        return True


class _Event(torch.Event):
    """A torch.Event whose every method is a no-op (a CPU event underneath: there is no CUDA one to make)."""

    def __new__(cls, enable_timing: bool = False, **_: Any) -> "_Event":
        return super().__new__(cls, device="cpu")

    def __init__(self, enable_timing: bool = False, **_: Any) -> None:
        pass

    def record(self, stream: torch.Stream | None = None) -> None:
        _state.log.event_records += 1

    def wait(self, stream: torch.Stream | None = None) -> None:
        _state.log.stream_waits += 1

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _state.log.syncs.append(caller_line())

    def elapsed_time(self, other: torch.Event) -> float:
        return 0.0


class _CUDAGraph:
    def __init__(self, *_: Any, **__: Any) -> None:
        self.captured = False

    def capture_begin(self, *_: Any, **__: Any) -> None:
        _state.recorder.capturing = True

    def capture_end(self) -> None:
        _state.recorder.capturing = False
        self.captured = True
        _state.log.captures += 1

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("CUDAGraph.replay() before a capture")
        _state.log.replays += 1
        _state.log.phase_replays[_state.recorder.phase] += 1

    def pool(self) -> tuple[int, int]:
        return (0, 0)


@contextlib.contextmanager
def _graph(cuda_graph: _CUDAGraph, pool: Any = None, stream: Any = None, **_: Any) -> Iterator[None]:
    cuda_graph.capture_begin()
    try:
        yield
    finally:
        cuda_graph.capture_end()


@contextlib.contextmanager
def _stream(stream: Any) -> Iterator[None]:
    yield


@dataclass
class _State:
    recorder: Recorder = field(default_factory=Recorder)
    log: CudaLog = field(default_factory=CudaLog)


_state = _State()
_DEFAULT = _Stream()


def _synchronize(device: Any = None) -> None:
    _state.log.syncs.append(caller_line())


STANDINS: dict[str, Any] = {
    "is_available": lambda: True,
    "device_count": lambda: 1,
    "current_device": lambda: 0,
    "set_device": lambda device: None,
    "is_bf16_supported": lambda *a, **k: True,
    "get_device_capability": lambda device=None: (9, 0),
    "get_device_name": lambda device=None: "fake CUDA device (dry run)",
    "synchronize": _synchronize,
    "Stream": _Stream,
    "Event": _Event,
    "CUDAGraph": _CUDAGraph,
    "graph": _graph,
    "stream": _stream,
    "current_stream": lambda device=None: _DEFAULT,
    "default_stream": lambda device=None: _DEFAULT,
    "is_current_stream_capturing": lambda: _state.recorder.capturing,
    "max_memory_allocated": lambda device=None: 0,
    "reset_peak_memory_stats": lambda device=None: None,
}


@contextlib.contextmanager
def install(recorder: Recorder) -> Iterator[CudaLog]:
    """Patches torch.cuda with the stand-ins, recording into `recorder`; restores on exit."""
    saved = {name: getattr(torch.cuda, name, None) for name in STANDINS}
    _state.recorder, _state.log = recorder, CudaLog()
    for name, value in STANDINS.items():
        setattr(torch.cuda, name, value)
    try:
        yield _state.log
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
