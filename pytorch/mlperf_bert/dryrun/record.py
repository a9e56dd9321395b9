"""What a dry run watches: host reads of the device, host<->device copies, graph captures.

`Recorder` is a TorchDispatchMode that runs inside FakeTensorMode. It sees every aten op
before the fake mode does, and records:

- host reads of the device: `aten._local_scalar_dense` (behind `.item()`, `.tolist()`, `float(t)`, `bool(t)`,
  `if t:`) and `aten.nonzero` (behind boolean indexing, whose output size the host must read),
  each with the first source line outside torch that asked for it;
- host<->device copies: `aten._to_copy` / `aten.copy_` between the CPU and 'cuda';
- whether each happened inside a CUDA-graph capture (`cuda_standins` sets `capturing`);
- the FP8 GEMMs (`torch._scaled_mm`) per phase and inside a capture (`counting_fp8_gemms`): where
  `--precision fp8` reaches the FP8 tensor-core path rather than torchao's emulation (which never
  calls it).

A fake tensor has no data, so a host read cannot return the device's value: it returns the
answer of a healthy run (0: no overflow, no non-finite loss, no stop request), except for
GradScaler's scale (2**16, its default start) and float64 tensors, the trainer's accumulated
sums (eval totals), which read 1.0 so that the ratios built from them are defined; a boolean mask reads as all true.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_TORCH_DIR = str(Path(torch.__file__).parent)
_HERE = str(Path(__file__).parent)
_READ = torch.ops.aten._local_scalar_dense.default
_SCALED_MM = torch.ops.aten._scaled_mm.default
# Page-locking is a host-memory matter the fake mode does not model: the tensor stands as is.
_PIN = (torch.ops.aten._pin_memory.default,)
_NONZERO = torch.ops.aten.nonzero.default
_INDEX = torch.ops.aten.index.Tensor
_RECORD_STREAM = torch.ops.aten.record_stream.default
_COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
CAPTURE = "capture"  # the key of `Recorder.fp8_gemms` that counts the GEMMs recorded into a graph


@dataclass(frozen=True)
class Event:
    kind: str  # "read" or "copy"
    where: str  # file:line of the first frame outside torch and this package
    phase: str  # the step / eval label current when it happened
    in_capture: bool
    detail: str = ""
    values: int = 1  # scalars read back to back by one call (`.tolist()` reads each element)


def caller_line() -> str:
    """The innermost frame of the code under test (not torch, not the dry-run harness)."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if not frame.filename.startswith((_TORCH_DIR, _HERE)) and "/contextlib.py" not in frame.filename:
            return f"{_short(frame.filename)}:{frame.lineno} ({frame.name})"
    return "<unknown>"


def _short(path: str) -> str:
    marker = "/mlperf_bert/"
    return "mlperf_bert/" + path.split(marker, 1)[1] if marker in path else path


def _device_of(value: Any) -> torch.device | None:
    return value.device if isinstance(value, torch.Tensor) else None


def _copy_devices(func: Any, args: tuple, kwargs: dict) -> tuple[torch.device | None, torch.device | None]:
    if func is torch.ops.aten.copy_.default:
        return _device_of(args[1]), _device_of(args[0])
    target = kwargs.get("device")
    return _device_of(args[0]), (torch.device(target) if target is not None else _device_of(args[0]))


def _reading_loss_scale() -> bool:
    return any(f.name == "get_scale" and f.filename.endswith("grad_scaler.py") for f in traceback.extract_stack())


def healthy_value(dtype: torch.dtype) -> bool | int | float:
    """What a host read returns on fake tensors (see the module docstring)."""
    if _reading_loss_scale():
        return 2.0**16
    if dtype == torch.bool:
        return False
    if dtype == torch.float64:
        return 1.0
    return 0.0 if dtype.is_floating_point else 0


class WatchingMode(TorchDispatchMode):
    """A dispatch mode that watches the ops of a run and changes nothing they compute (the Recorder, the cost
    tracer). It declares itself an infrastructure mode, as FakeTensorMode does: Dynamo compiles no frame while a
    user's dispatch mode is active, so under a plain one every compiled layer of a dry run would run eagerly."""

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True


@dataclass
class Recorder(WatchingMode):
    """Records host reads and host<->device copies; `phase` labels what runs now."""

    events: list[Event] = field(default_factory=list)
    phase: str = "build"
    capturing: bool = False  # set by the cuda stand-ins' capture (fake runs)
    fake: bool = True  # False on a real GPU: reads return the device's values, pinning is real
    called_fp8: Counter[str] = field(default_factory=Counter)  # torch._scaled_mm called from Python, eagerly
    dispatched_fp8: Counter[str] = field(default_factory=Counter)  # aten._scaled_mm seen by this mode
    _reading: bool = False  # the last op seen was a host read

    def __post_init__(self) -> None:
        super().__init__()

    @property
    def fp8_gemms(self) -> Counter[str]:
        """Phase (and CAPTURE) -> FP8 GEMMs: each phase's larger count of the two ways of seeing them
        (`counting_fp8_gemms`), which see the same GEMMs where both see them."""
        return Counter({key: max(self.called_fp8[key], self.dispatched_fp8[key])
                        for key in set(self.called_fp8) | set(self.dispatched_fp8)})

    def count_fp8(self, counter: Counter[str]) -> None:
        counter[self.phase] += 1
        counter[CAPTURE] += self.in_capture_now()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _SCALED_MM:
            self.count_fp8(self.dispatched_fp8)
        if func is _READ:
            self._note_read(args[0])
            if self.fake:
                return healthy_value(args[0].dtype)
            return func(*args, **kwargs)
        if func is _NONZERO:  # the output's size is read from the device
            self._note_read(args[0])
            return self._all_true_nonzero(args[0]) if self.fake else func(*args, **kwargs)
        if func is _INDEX and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self._note_read(args[0])  # boolean indexing is a nonzero: same host read
            return func(args[0], self._integer_indices(args[1])) if self.fake else func(*args, **kwargs)
        self._reading = False
        if self.fake and func in _PIN:
            return args[0]
        if self.fake and func is _RECORD_STREAM:  # allocator bookkeeping: no fake implementation, nothing to check
            return None
        if func in _COPIES:
            self._note_copy(func, args, kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _all_true_nonzero(mask: torch.Tensor) -> torch.Tensor:
        """nonzero of a mask taken as all true (every token real): the healthy answer's shape."""
        return torch.empty((mask.numel(), mask.dim()), dtype=torch.long, device=mask.device)

    @classmethod
    def _integer_indices(cls, indices: list) -> list:
        """Boolean masks as the integer indices of their (all true) elements, as indexing expands them."""
        out: list = []
        for index in indices:
            if index is None or index.dtype != torch.bool:
                out.append(index)
            else:
                positions = cls._all_true_nonzero(index)
                out.extend(positions[:, d] for d in range(index.dim()))
        return out

    def _note_read(self, tensor: torch.Tensor) -> None:
        """One event per call site: the scalars of one `.tolist()` arrive with no op between them.

        A host tensor's value is on the host already (the input's token count): not a read of the device.
        """
        if tensor.device.type == "cpu":
            self._reading = False
            return
        where = caller_line()
        last = self.events[-1] if self.events else None
        if self._reading and last is not None and last.where == where and last.phase == self.phase:
            self.events[-1] = replace(last, values=last.values + 1)
        else:
            self.events.append(Event("read", where, self.phase, self.in_capture_now()))
        self._reading = True

    def _note_copy(self, func: Any, args: tuple, kwargs: dict) -> None:
        src, dst = _copy_devices(func, args, kwargs)
        if src is None or dst is None or src.type == dst.type:
            return
        self.events.append(Event("copy", caller_line(), self.phase, self.in_capture_now(), f"{src.type}->{dst.type}"))

    def in_capture_now(self) -> bool:
        return self.capturing or (not self.fake and torch.cuda.is_current_stream_capturing())


@contextlib.contextmanager
def counting_fp8_gemms(recorder: Recorder) -> Iterator[None]:
    """Counts `torch._scaled_mm` calls into `recorder.fp8_gemms` (by phase, and CAPTURE inside a capture).

    Two ways, as neither sees every GEMM: eagerly, torchao calls it from its FP8 tensor subclass's own
    `__torch_dispatch__`, which runs below the Recorder's mode (the Recorder sees the subclass's
    `aten.mm`; the `_scaled_mm` inside it goes straight to the fake mode), so the Python function is
    counted; a compiled layer's graph calls `aten._scaled_mm` itself (AOTAutograd takes the subclass
    apart), which the Recorder sees, and the Python function only runs while Dynamo traces it (not
    counted then). Where both see a GEMM (the delayed recipe, eager) they count it once each.
    """
    original = torch._scaled_mm

    def counted(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            recorder.count_fp8(recorder.called_fp8)
        return original(*args, **kwargs)

    with mock.patch.object(torch, "_scaled_mm", counted):
        yield
