"""Recording stand-ins for the parts of `torch.cuda` a CPU-only torch cannot run.

Streams, events and graphs have no device to talk to in a dry run: the stand-ins keep the
calls' shape (what was captured, how often it was replayed, how often the host waited, how many
side streams were made, how often an event was recorded and a stream waited for one) in a
`CudaLog`, and mark the `Recorder` as capturing between `capture_begin` and `capture_end`, so
that host reads and copies inside a capture are caught. `install` patches them into
`torch.cuda` (with a device-less `torch.futures.Future`, SDPA choosing its kernel as on a GPU, and
flash-attention kernels present, as in every CUDA build) for
the length of a `with` block.

Captures and replays are counted in one place for both devices (`counted`): the stand-in graph is
counted, and on a real GPU `count_graphs` puts a counted twin of `torch.cuda.CUDAGraph` in its
place, so that `--real` reports the captures and replays it ran.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from .gpus import DRY_RUN_GPU, Gpu, device_properties
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


class _NoDeviceGraph:
    """A CUDA graph with nothing to capture: between capture_begin and capture_end the recorder is capturing."""

    def __init__(self, *_: Any, **__: Any) -> None:
        self.captured = False

    def capture_begin(self, *_: Any, **__: Any) -> None:
        _state.recorder.capturing = True

    def capture_end(self) -> None:
        _state.recorder.capturing = False
        self.captured = True

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("CUDAGraph.replay() before a capture")

    def pool(self) -> tuple[int, int]:
        return (0, 0)


def counted(graph: type) -> type:
    """`graph` (the stand-in, or torch's CUDAGraph on a GPU) counting each capture and replay into the log,
    replays by the recorder's phase, once the graph's own call has returned."""

    class Counted(graph):
        def capture_end(self) -> None:
            super().capture_end()
            _state.log.captures += 1

        def replay(self) -> None:
            super().replay()
            _state.log.replays += 1
            _state.log.phase_replays[_state.recorder.phase] += 1

    return Counted


@contextlib.contextmanager
def _graph(cuda_graph: _NoDeviceGraph, pool: Any = None, stream: Any = None, **_: Any) -> Iterator[None]:
    cuda_graph.capture_begin()
    try:
        yield
    finally:
        cuda_graph.capture_end()


@contextlib.contextmanager
def _stream(stream: Any) -> Iterator[None]:
    yield


class _Future(torch.futures.Future):
    """A future that keeps no devices: a CUDA one (`Future(devices=[cuda])`, the clipping hooks' held
    buckets) refuses a fake tensor, whose storage is on 'meta'."""

    def __init__(self, *, devices: Any = None) -> None:
        super().__init__()

    def __class_getitem__(cls, item: Any) -> type:  # `Future[...]` in annotations evaluated at run time
        return cls


_SDPA = torch.nn.functional.scaled_dot_product_attention


def _gpu_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, **extra: Any) -> torch.Tensor:
    """SDPA as a GPU runs it for fp16 / bf16 inputs: flash attention without a mask, memory-efficient attention
    (the mask as an additive bias) with one. A CPU-only torch has no CUDA kernel choice, and the fake device
    would run the math path, which materialises every score, probability and dropout mask."""
    if query.device.type != "cuda" or query.dtype not in (torch.float16, torch.bfloat16) or extra:
        return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     **extra)
    if attn_mask is None:
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                                  scale=scale)[0]
    bias = attn_mask
    if attn_mask.dtype == torch.bool:
        bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~attn_mask, -math.inf)
    bias = bias.expand(*query.shape[:-1], key.shape[-2])
    return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, query.requires_grad,
                                                                  dropout_p, is_causal, scale=scale)[0]


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
    "synchronize": _synchronize,
    "Stream": _Stream,
    "Event": _Event,
    "CUDAGraph": counted(_NoDeviceGraph),
    "graph": _graph,
    "stream": _stream,
    "current_stream": lambda device=None: _DEFAULT,
    "default_stream": lambda device=None: _DEFAULT,
    "is_current_stream_capturing": lambda: _state.recorder.capturing,
    "max_memory_allocated": lambda device=None: 0,
    "reset_peak_memory_stats": lambda device=None: None,
    # Dynamo saves and restores the CUDA RNG state around each frame it compiles, and AOTAutograd's and
    # Inductor's passes switch devices: a state of the kernel's shape (Philox seed and offset), no switches.
    "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
    "set_rng_state": lambda new_state, device="cuda": None,
    "_lazy_init": lambda: None,
    "_exchange_device": lambda device: 0,
    "_maybe_exchange_device": lambda device: 0,
}


@contextlib.contextmanager
def count_graphs(recorder: Recorder) -> Iterator[CudaLog]:
    """On a real GPU: torch.cuda.CUDAGraph counted (`counted`) into a new log, `recorder`'s phases labelling the
    replays; restores on exit."""
    _state.recorder, _state.log = recorder, CudaLog()
    real = torch.cuda.CUDAGraph
    torch.cuda.CUDAGraph = counted(real)  # type: ignore[misc, assignment]
    try:
        yield _state.log
    finally:
        torch.cuda.CUDAGraph = real  # type: ignore[misc]


@contextlib.contextmanager
def install(recorder: Recorder, gpu: Gpu = DRY_RUN_GPU) -> Iterator[CudaLog]:
    """Patches torch.cuda with the stand-ins, recording into `recorder`, the device presenting itself as `gpu`;
    restores on exit."""
    saved = {name: getattr(torch.cuda, name, None) for name in STANDINS}
    future, flash_available = torch.futures.Future, torch.backends.cuda.is_flash_attention_available
    _state.recorder, _state.log = recorder, CudaLog()
    properties = device_properties(gpu)
    properties.__enter__()
    for name, value in STANDINS.items():
        setattr(torch.cuda, name, value)
    torch.futures.Future = _Future  # type: ignore[misc]
    torch.nn.functional.scaled_dot_product_attention = _gpu_sdpa  # type: ignore[assignment]
    # CUDA builds of torch have flash-attention kernels (the varlen back-end's); a CPU-only one has none.
    torch.backends.cuda.is_flash_attention_available = lambda: True
    try:
        yield _state.log
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
        properties.__exit__(None, None, None)
        torch.futures.Future = future  # type: ignore[misc]
        torch.nn.functional.scaled_dot_product_attention = _SDPA
        torch.backends.cuda.is_flash_attention_available = flash_available
