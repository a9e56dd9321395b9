"""The GPUs of the shipped configs, as the fake CUDA device presents them to torch, Dynamo and Inductor.

A CPU-only torch has no device properties to give: `device_properties(gpu)` answers for `gpu`
(`torch.cuda.get_device_properties`, its capability and name, and Dynamo's device interface, whose
cache Inductor reads). The dry run presents DRY_RUN_GPU (compute capability 9.0); the compiled-step
report (`compiled.py`) presents the config's own GPU, whose capability and SM count decide the code
Inductor generates.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Iterator
from unittest import mock

import torch

GB = 1e9


@dataclass(frozen=True)
class Gpu:
    """What Inductor reads of a GPU when it generates code for it."""

    name: str
    capability: tuple[int, int]
    sms: int  # streaming multiprocessors: reduction and persistent-kernel heuristics
    memory_gb: float

    def properties(self) -> SimpleNamespace:
        """A stand-in for torch.cuda.get_device_properties(): the fields Inductor and Triton read."""
        major, minor = self.capability
        return SimpleNamespace(
            name=self.name, major=major, minor=minor, multi_processor_count=self.sms,
            total_memory=int(self.memory_gb * GB), regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
            max_threads_per_block=1024, warp_size=32, gcnArchName="", is_integrated=False, is_multi_gpu_board=False,
            L2_cache_size=50 * 2**20, shared_memory_per_block_optin=227 * 1024)


# The configs' GPUs (the SXM parts of their datasheets: compute capability and SM count).
GPUS = {gpu.name: gpu for gpu in (
    Gpu("A100", (8, 0), 108, 80.0),
    Gpu("H100", (9, 0), 132, 80.0),
    Gpu("H200", (9, 0), 132, 141.0),
    Gpu("B200", (10, 0), 148, 180.0),
    Gpu("GB200", (10, 0), 148, 186.0),
)}


def gpu_of_system(system: str) -> Gpu:
    """The GPU of a config's DGXSYSTEM ("DGXH200_1x8" -> H200, "GB200_2x4" -> GB200, "SamsungA100_128x8" -> A100)."""
    head = system.split("_")[0]
    for name in sorted(GPUS, key=len, reverse=True):
        if head.endswith(name):
            return GPUS[name]
    raise ValueError(f"DGXSYSTEM={system!r} names none of the GPUs {sorted(GPUS)}: name one of them in DGXSYSTEM "
                     "(or pass --gpu)")


DRY_RUN_GPU = GPUS["H100"]


@contextlib.contextmanager
def device_properties(gpu: Gpu) -> Iterator[None]:
    """`gpu`'s properties, capability and name wherever torch, Dynamo and Inductor read them."""
    from torch._dynamo import device_interface

    props = gpu.properties()
    major, minor = gpu.capability

    def properties(*_: Any, **__: Any) -> SimpleNamespace:
        return props

    cuda: dict[str, Callable[..., Any]] = {
        "get_device_properties": properties, "get_device_capability": lambda *_, **__: gpu.capability,
        "get_device_name": lambda *_, **__: f"NVIDIA {gpu.name} (fake device)"}
    interface: dict[str, Callable[..., Any]] = {
        "get_device_properties": properties, "device_count": lambda: 1, "current_device": lambda: 0,
        "is_bf16_supported": lambda *_, **__: True, "get_compute_capability": lambda *_, **__: major * 10 + minor}
    with contextlib.ExitStack() as stack:
        for name, value in cuda.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, value))
        for name, value in interface.items():
            stack.enter_context(mock.patch.object(device_interface.CudaInterface, name, staticmethod(value)))
        stack.enter_context(mock.patch.dict(device_interface.caching_worker_device_properties, {"cuda": [props]}))
        yield


