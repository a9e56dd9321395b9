"""Mixed precision: which autocast a `--precision` runs under.

bf16 and fp16 run the model under autocast (matmuls in half precision, reductions and the
loss in fp32); fp16 also needs a `torch.amp.GradScaler`, whose skip decision reads the
device, which is why fp16 steps run eagerly (`step.EagerStep`) unless its scaler lives on the
device (`optim.loss_scale.DeviceLossScaler`). fp8 runs under bf16's autocast: its FP8 GEMMs are
modules of their own (`fp8.convert_to_fp8`), and everything else computes as under bf16.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager

import torch

AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16,
                                                   "fp8": torch.bfloat16}


def autocast(device: torch.device, precision: str, cache_enabled: bool = True) -> ContextManager:
    """Autocast for "bf16" / "fp16" / "fp8" (bf16 around its FP8 layers), nothing for "fp32".

    Inside a CUDA-graph capture pass cache_enabled=False: cached casts of the weights would
    be made once at capture and never again.
    """
    if precision not in AUTOCAST_DTYPES:
        raise ValueError(f"precision must be one of {tuple(AUTOCAST_DTYPES)}, got {precision!r}")
    dtype = AUTOCAST_DTYPES[precision]
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=cache_enabled)


# bf16 tensor cores arrive with compute capability 8.0 (Ampere); FP8 needs 8.9 (`fp8.capability_problem`).
BF16_MIN_CAPABILITY = (8, 0)


def precision_problem(precision: str, device: torch.device) -> str | None:
    """Why `device` cannot run --precision `precision`, with the fix; None when it can. The CPU runs
    every precision (bf16 and fp16 autocast, fp8 emulated); a GPU below compute capability 8.0
    (V100, T4) has no bf16 matrix units (fp8, bf16 outside its GEMMs, needs 8.9: `fp8_unavailable`)."""
    if device.type != "cuda" or precision != "bf16":
        return None
    capability = tuple(torch.cuda.get_device_capability(device))
    if capability >= BF16_MIN_CAPABILITY:
        return None
    major, minor = BF16_MIN_CAPABILITY
    return (f"--precision {precision} needs bf16 tensor cores (compute capability >= {major}.{minor}: Ampere or "
            f"newer), but {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: use --precision "
            "fp16 or fp32 on this GPU")
