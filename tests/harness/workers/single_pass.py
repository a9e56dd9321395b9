"""The single-pass kernel (model/fp8_kernels.py) on CPU tensors, through Triton's interpreter (tests/trainer/model/test_single_pass_ops.py).

Usage: TRITON_INTERPRET=1 python -m tests.harness.workers.single_pass OUT.json     (from the repository root)

Triton decides at import whether its own library functions are compiled or interpreted, so this runs
in a process of its own, started with TRITON_INTERPRET=1 before anything imports Triton. The kernel runs
with 16 x 16 tiles, so every case spans several tiles in both directions with ragged edges.

Triton 3.9's interpreter rounds a narrowing float conversion by adding the first cut-off bit to the
mantissa, with no carry into the exponent and no ties-to-even (-509.4 to E5M2 gives -256, not -512;
the GPU's `cvt.rn` gives -512). The worker converts through torch instead (`_convert_float` below),
which rounds to nearest even as the GPU does; the kernel's code is the GPU's, unchanged.

Written to OUT.json: `gradients`, per case (its name says the shape, the format, GELU's derivative or
not, the scale), against `fp8_cast.reference`: the FP8 copies' bytes that differ (row-major, transposed),
the padding columns that are not zero, the amax's difference, and the bias gradient's largest difference
relative to its largest value (the kernel sums tiles in another order); `gelu`, per case (shape, dtype),
the forward's GELU and E4M3 cast against `fp8_cast.gelu_reference`: the same counts, and whether the
column sums were left out as asked; `cast`, per case, a layer's input cast against `fp8_cast.cast_reference`,
the same counts; `weight`, per case (the parts' heights, columns), an fp32 weight given as row-wise parts
cast against `fp8_cast.weight_reference`, the same counts; `norm`, per case (shape, dropout, dtype), LayerNorm's
backward with the FP8 operands of the layer before it against `fp8_cast.norm_grad_reference` (`norm_case`);
`bf16`, per case (shape, parts, GELU's derivative or not, dtype), a bf16
layer's gradient pass against `fused_linear.reference`: the gradient's elements that differ and by how many
units in the last place at most (GELU's derivative: the interpreter's erf and exp are not torch's), and
the column sums' largest difference relative to their largest value.
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

from mlperf_bert.model import fp8_cast, fp8_kernels, fused_linear  # noqa: E402

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
    (21, (32, 32, 32), torch.float8_e5m2, False, None, torch.bfloat16),  # the query, key and value gradients
    (18, (16, 16), torch.float8_e5m2, False, None, torch.bfloat16),  # two parts of one tile's width
]


def case(rows: int, cols: int | tuple[int, ...], dtype: torch.dtype, gelu: bool, scale: float | None,
         grad_dtype: torch.dtype, k: fp8_kernels.Kernel) -> dict[str, float]:
    """cols: the gradient's width, or its parts' widths (read in place, each a multiple of the tile's)."""
    widths = cols if isinstance(cols, tuple) else (cols,)
    generator = torch.Generator().manual_seed(rows * 100 + sum(widths))
    grads = [(torch.randn(rows, width, generator=generator) * 3).to(grad_dtype) for width in widths]
    grads[0][0, :3] = 0.0  # exact zeros
    pre = torch.randn(rows, widths[0], generator=generator).to(grad_dtype) if gelu else None
    assert fp8_cast.read_in_parts(grads, pre, k.block_n)
    expected = fp8_cast.reference(grads, pre, torch.tensor(1.0), dtype)
    top = float(torch.finfo(dtype).max)
    chosen = torch.tensor(top / float(expected[3]) if scale is None else scale, dtype=torch.float32)
    want = fp8_cast.reference(grads, pre, chosen, dtype)
    act = fp8_kernels.NONE if pre is None else fp8_kernels.DGELU
    got = fp8_kernels.cast_transpose(k, grads, pre, chosen, dtype, fp8_cast.padded(rows), act, sums=True)
    as_bytes = [t.view(torch.uint8) for t in (got[0], got[1], want[0], want[1])]
    return {"rows_differ": int((as_bytes[0] != as_bytes[2]).sum()),
            "transposed_differ": int((as_bytes[1] != as_bytes[3]).sum()),
            "padding_not_zero": int(as_bytes[1][:, rows:].ne(0).sum()),
            "transposed_shape": list(got[1].shape),
            "amax_difference": float((got[3] - want[3]).abs()),
            "bias_relative": float((got[2] - want[2]).abs().max() / want[2].abs().max().clamp(min=1e-30))}


GELU_CASES = [(37, 40, torch.bfloat16), (16, 48, torch.float16), (9, 8, torch.float32)]  # rows, columns, dtype
CAST_CASES = [(37, 40, torch.bfloat16), (48, 33, torch.float16), (9, 8, torch.float32)]


def forward_case(rows: int, cols: int, dtype: torch.dtype, k: fp8_kernels.Kernel, gelu: bool) -> dict[str, float]:
    """A forward operand cast to E4M3 by its own amax: GELU of FC1's output (`fp8_cast.gelu_reference`) or a
    layer's input (`fp8_cast.cast_reference`), both copies and the amax."""
    x = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols + gelu)) * 2).to(dtype)
    x[0, :2] = 0.0  # exact zeros
    reference = fp8_cast.gelu_reference if gelu else fp8_cast.cast_reference
    scale = torch.tensor(448.0) / reference(x, torch.tensor(1.0), torch.float8_e4m3fn)[2]
    want = reference(x, scale, torch.float8_e4m3fn)
    got = fp8_kernels.cast_transpose(k, [x], None, scale, torch.float8_e4m3fn, fp8_cast.padded(rows),
                                     fp8_kernels.GELU if gelu else fp8_kernels.NONE, sums=False)
    return {"rows_differ": int((got[0].view(torch.uint8) != want[0].view(torch.uint8)).sum()),
            "transposed_differ": int((got[1].view(torch.uint8) != want[1].view(torch.uint8)).sum()),
            "padding_not_zero": int(got[1].view(torch.uint8)[:, rows:].ne(0).sum()),
            "transposed_shape": list(got[1].shape), "amax_difference": float((got[3] - want[2]).abs()),
            "no_sums": got[2] is None}


WEIGHT_CASES = [((16, 16, 16), 40), ((32, 32), 24), ((48,), 33)]  # the parts' heights (stacked row-wise), columns


def weight_case(heights: tuple[int, ...], cols: int, k: fp8_kernels.Kernel) -> dict[str, Any]:
    """A layer's fp32 weight given as row-wise parts (the query, key and value weights) read in place, cast to E4M3
    by its own amax with the transposed copy dX reads, against `fp8_cast.weight_reference`."""
    generator = torch.Generator().manual_seed(sum(heights) * cols)
    parts = [torch.randn(height, cols, generator=generator) * 0.05 * (i + 1) for i, height in enumerate(heights)]
    assert fp8_cast.stacked_in_place(parts, k.block_m)
    scale = torch.tensor(448.0) / fp8_cast.weight_reference(parts, torch.tensor(1.0), torch.float8_e4m3fn)[2]
    want = fp8_cast.weight_reference(parts, scale, torch.float8_e4m3fn)
    rows = sum(heights)
    got = fp8_kernels.cast_transpose(k, parts, None, scale, torch.float8_e4m3fn, fp8_cast.padded(rows),
                                     fp8_kernels.NONE, sums=False, stacked=len(parts) > 1)
    return {"rows_differ": int((got[0].view(torch.uint8) != want[0].view(torch.uint8)).sum()),
            "transposed_differ": int((got[1].view(torch.uint8) != want[1].view(torch.uint8)).sum()),
            "transposed_shape": list(got[1].shape), "amax_difference": float((got[3] - want[2]).abs())}


NORM_CASES = [(37, 40, 0.1, torch.bfloat16), (48, 24, 0.0, torch.bfloat16), (9, 16, 0.5, torch.float32)]  # rows,
# columns, dropout probability, dtype


def norm_case(rows: int, cols: int, drop_p: float, dtype: torch.dtype) -> dict[str, Any]:
    """LayerNorm's backward and the FP8 operands of the layer before its dropout (`fp8_cast.norm_grad_reference`),
    with 16 x 16 tiles (several row blocks and column steps, ragged both ways): the gradients' largest differences
    in units of their dtype's last place or relative to their largest value (the kernel sums a row in another
    order), the FP8 copies' bytes that differ (where a rounded gradient moved, each by at most one FP8 step), and
    the padding."""
    generator = torch.Generator().manual_seed(rows * cols)
    s = (torch.randn(rows, cols, generator=generator) * 2 + 0.5).to(dtype)
    dy = torch.randn(rows, cols, generator=generator).to(dtype)
    gamma = torch.rand(cols, generator=generator) + 0.5
    keep = torch.rand(rows, cols, generator=generator) >= drop_p
    _, mean, rstd = torch.native_layer_norm(s.float(), [cols], gamma, torch.zeros(cols), 1e-12)
    drop_scale = 1.0 / (1.0 - drop_p)
    plain = fp8_cast.norm_grad_reference(dy, s, mean, rstd, gamma, keep, drop_scale, torch.tensor(1.0),
                                         torch.float8_e5m2)
    scale = torch.tensor(57344.0) / plain[4]
    want = fp8_cast.norm_grad_reference(dy, s, mean, rstd, gamma, keep, drop_scale, scale, torch.float8_e5m2)
    got = fp8_kernels.norm_grad(fp8_kernels.norm_kernel(16, 16, interpret=True), dy, s, mean.reshape(-1),
                                rstd.reshape(-1), gamma, keep, drop_scale, scale, torch.float8_e5m2,
                                fp8_cast.padded(rows))
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    ulps = (got[0].view(bits).long() - want[0].view(bits).long()).abs()
    steps = (got[1].float() - want[1].float()).abs() / want[1].float().abs().clamp(min=2.0 ** -16)

    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max())

    return {"ds_max_ulps": int(ulps.max()), "ds_differ": int((got[0] != want[0]).sum()), "ds_dtype": str(got[0].dtype),
            "fp8_differ": int((got[1].view(torch.uint8) != want[1].view(torch.uint8)).sum()),
            "fp8_largest_relative_step": float(steps.max()),
            "transposed_equal": bool(torch.equal(got[2][:, :rows].view(torch.uint8), got[1].t().view(torch.uint8))),
            "padding_not_zero": int(got[2].view(torch.uint8)[:, rows:].ne(0).sum()),
            "transposed_shape": list(got[2].shape), "bias_relative": relative(got[3], want[3]),
            "amax_relative": float((got[4] - want[4]).abs() / want[4]), "gamma_relative": relative(got[5], want[5]),
            "beta_relative": relative(got[6], want[6]), "elements": rows * cols}


BF16_CASES = [(21, (32, 32, 32), False, torch.bfloat16), (37, (40,), True, torch.bfloat16),
              (9, (16, 16), False, torch.float32), (16, (24,), True, torch.float16)]


def gradient_case(rows: int, widths: tuple[int, ...], gelu: bool, dtype: torch.dtype,
                  k: fp8_kernels.Kernel) -> dict[str, float]:
    generator = torch.Generator().manual_seed(rows + sum(widths))
    grads = [(torch.randn(rows, width, generator=generator) * 2).to(dtype) for width in widths]
    pre = torch.randn(rows, widths[0], generator=generator).to(dtype) if gelu else None
    assert fp8_cast.read_in_parts(grads, pre, k.block_n)
    want = fused_linear.reference(grads, pre)
    got = fp8_kernels.gradient_sums(k, grads, pre)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    ulps = (got[0].view(bits).long() - want[0].view(bits).long()).abs()  # same signs: the distance in units last place
    return {"differ": int((got[0] != want[0]).sum()), "max_ulps": int(ulps.max()), "dtype_kept": got[0].dtype == dtype,
            "sums_relative": float((got[1] - want[1]).abs().max() / want[1].abs().max())}


def main(out: Path) -> None:
    k = fp8_kernels.kernel(16, 16, interpret=True)
    results = {f"{r}x{sum(c) if isinstance(c, tuple) else c} {str(d).split('.')[-1]} gelu={g} scale={s} "
               f"{str(t).split('.')[-1]} parts={len(c) if isinstance(c, tuple) else 1}": case(r, c, d, g, s, t, k)
               for r, c, d, g, s, t in CASES}
    gelu = {f"{r}x{c} {str(t).split('.')[-1]}": forward_case(r, c, t, k, gelu=True) for r, c, t in GELU_CASES}
    bf16 = {f"{r}x{sum(w)} parts={len(w)} gelu={g} {str(t).split('.')[-1]}": gradient_case(r, w, g, t, k)
            for r, w, g, t in BF16_CASES}
    cast = {f"{r}x{c} {str(t).split('.')[-1]}": forward_case(r, c, t, k, gelu=False) for r, c, t in CAST_CASES}
    weight = {f"{'+'.join(map(str, h))}x{c}": weight_case(h, c, k) for h, c in WEIGHT_CASES}
    norm = {f"{r}x{c} p={p} {str(t).split('.')[-1]}": norm_case(r, c, p, t) for r, c, p, t in NORM_CASES}
    out.write_text(json.dumps({"gradients": results, "gelu": gelu, "bf16": bf16, "cast": cast, "weight": weight,
                               "norm": norm}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
