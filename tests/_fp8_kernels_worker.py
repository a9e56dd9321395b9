"""The FP8 gradient kernel (model/fp8_kernels.py) on CPU tensors, through Triton's interpreter (test_fp8_kernels.py).

Usage: TRITON_INTERPRET=1 python tests/_fp8_kernels_worker.py OUT.json

Triton decides at import whether its own library functions are compiled or interpreted, so this runs
in a process of its own, started with TRITON_INTERPRET=1 before anything imports Triton. The kernel runs
with 16 x 16 tiles, so every case spans several tiles in both directions with ragged edges.

Triton 3.9's interpreter rounds a narrowing float conversion by adding the first cut-off bit to the
mantissa, with no carry into the exponent and no ties-to-even (-509.4 to E5M2 gives -256, not -512;
the GPU's `cvt.rn` gives -512). The worker converts through torch instead (`_convert_float` below),
which rounds to nearest even as the GPU does; the kernel's code is the GPU's, unchanged.

Written to OUT.json, per case (its name says the shape, the format, GELU or not, the scale), against
`fp8_cast.reference`: the FP8 copies' bytes that differ (row-major, transposed), the padding columns
that are not zero, the amax's difference, and the bias gradient's largest difference relative to its
largest value (the kernel sums tiles in another order).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__" and os.environ.get("TRITON_INTERPRET") != "1":  # before anything imports Triton
    sys.exit("start this with TRITON_INTERPRET=1 (module docstring)")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from mlperf_bert.model import fp8_cast, fp8_kernels  # noqa: E402

_TORCH = {tl.float8e5: torch.float8_e5m2, tl.float8e4nv: torch.float8_e4m3fn, tl.bfloat16: torch.bfloat16,
          tl.float16: torch.float16, tl.float32: torch.float32}
_original = interpreter._convert_float


def _convert_float(data: np.ndarray, src: Any, dst: Any, rounding: Any) -> np.ndarray:
    """Narrowing conversions to nearest even through torch (module docstring); everything else as Triton's."""
    if src.primitive_bitwidth <= dst.primitive_bitwidth or src not in _TORCH or dst not in _TORCH:
        return _original(data, src, dst, rounding)
    source = torch.from_numpy(np.ascontiguousarray(data)).view(_TORCH[src])
    return source.to(_TORCH[dst]).view(torch.uint8 if dst.primitive_bitwidth == 8 else torch.int16).numpy()


interpreter._convert_float = _convert_float

CASES = [  # rows, columns, FP8 format, GELU, scale (None: amax maps onto the format's largest value), gradient dtype
    (37, 40, torch.float8_e5m2, False, None, torch.bfloat16),
    (37, 40, torch.float8_e5m2, True, None, torch.bfloat16),
    (48, 33, torch.float8_e4m3fn, False, None, torch.bfloat16),
    (16, 16, torch.float8_e5m2, True, None, torch.float16),
    (20, 24, torch.float8_e5m2, False, 1.0e4, torch.bfloat16),  # most values saturate
    (9, 8, torch.float8_e4m3fn, True, 1.0e-3, torch.float32),  # subnormals and zeros
]


def case(rows: int, cols: int, dtype: torch.dtype, gelu: bool, scale: float | None, grad_dtype: torch.dtype,
         k: fp8_kernels.Kernel) -> dict[str, float]:
    generator = torch.Generator().manual_seed(rows * 100 + cols)
    grad = (torch.randn(rows, cols, generator=generator) * 3).to(grad_dtype)
    grad[0, :3] = 0.0  # exact zeros, and one value at the edge of the range
    pre = torch.randn(rows, cols, generator=generator).to(grad_dtype) if gelu else None
    expected = fp8_cast.reference(grad, pre, torch.tensor(1.0), dtype)
    top = float(torch.finfo(dtype).max)
    chosen = torch.tensor(top / float(expected[3]) if scale is None else scale, dtype=torch.float32)
    want = fp8_cast.reference(grad, pre, chosen, dtype)
    got = fp8_kernels.grad_cast_transpose(k, grad, pre, chosen, dtype, fp8_cast.padded(rows))
    as_bytes = [t.view(torch.uint8) for t in (got[0], got[1], want[0], want[1])]
    return {"rows_differ": int((as_bytes[0] != as_bytes[2]).sum()),
            "transposed_differ": int((as_bytes[1] != as_bytes[3]).sum()),
            "padding_not_zero": int(as_bytes[1][:, rows:].ne(0).sum()),
            "transposed_shape": list(got[1].shape),
            "amax_difference": float((got[3] - want[3]).abs()),
            "bias_relative": float((got[2] - want[2]).abs().max() / want[2].abs().max().clamp(min=1e-30))}


def main(out: Path) -> None:
    k = fp8_kernels.kernel(interpret=True, block_m=16, block_n=16)
    results = {f"{r}x{c} {str(d).split('.')[-1]} gelu={g} scale={s} {str(t).split('.')[-1]}": case(r, c, d, g, s, t, k)
               for r, c, d, g, s, t in CASES}
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
