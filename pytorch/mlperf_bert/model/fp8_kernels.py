"""The Triton kernel of `fp8_cast`'s ops: a tensor's two FP8 copies (row-major and transposed), its column
sums and its amax in one pass over it. For `grad_cast_transpose`: an output gradient's copies, bias gradient
and amax (TransformerEngine's `fp8_cast_transpose_bgrad_fused`, and its dGELU variant); for
`gelu_cast_transpose`: GELU of FC1's output, cast for FC2, and its amax (NVIDIA's FC1 epilogue and cast).

Imported only where it runs: by `fp8_cast.py` for CUDA tensors, and by the tests, which run it on CPU
tensors through Triton's interpreter (`kernel(interpret=True)`, in a process started with
TRITON_INTERPRET=1). Triton comes with torch's CUDA wheels, not with its CPU ones.

Each program covers a BLOCK_M x BLOCK_N tile of G [M, N] (rows: tokens, columns: features). It reads
the tile once, applies ACT (GELU: G is FC1's output, GELU(G) rounded to G's dtype as F.gelu gives it;
DGELU: G is the gradient of GELU's output and the same tile of FC1's output H is read too, G becoming
dGELU(H) * G rounded to G's dtype, as autograd's GELU backward gives it), and writes:
- G8 [M, N] = saturate(G * scale) in FP8, the first operand of dX = G W (row-major);
- G8T [N, M_pad] = the same values transposed, the first operand of dW = G^T X; the rows past M
  (up to M_pad, a multiple of 16, the GEMM's alignment) are zeros, so the token padding costs no pass;
- with SUMS, the tile's column sums into partials[tile row, N] (the bias gradient is their sum, a
  [M / BLOCK_M, N] reduction, small), in fixed order: a step's result does not depend on the order
  programs ran in;
- the tile's max |G| into amax (an atomic max: the maximum is the same whatever the order).

The transposed store goes through `tl.trans`, which Triton lays out through shared memory, so both
copies are written in whole rows: the one-byte scattered stores of an element-wise transpose are gone.
Conversions to FP8 and to the gradient's dtype round to nearest even (`fp_downcast_rounding="rtne"`:
PTX `cvt.rn`), as torch's `.to` does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

_SQRT_HALF = tl.constexpr(0.7071067811865476)  # a jit function reads globals only as constexpr
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


NONE, GELU, DGELU = 0, 1, 2  # ACT: what is applied to the tile before the cast


def _cast_transpose(x, x1, x2, pre, scale, out, out_t, partials, amax, M, N, M_pad, WIDTH,
                    FP8_MAX: tl.constexpr, ACT: tl.constexpr, SUMS: tl.constexpr, PARTS: tl.constexpr,
                    STACKED: tl.constexpr, FP8: tl.constexpr, OUT: tl.constexpr, ROUND: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One BLOCK_M x BLOCK_N tile (module docstring). Programs: (M_pad / BLOCK_M, N / BLOCK_N), rounded up.
    PARTS > 1: G is the concatenation of x, x1 (and x2), so that each tile reads one part in place (no
    concatenated copy): column-wise, each [M, WIDTH] with WIDTH a multiple of BLOCK_N (the query, key and value
    gradients), or with STACKED row-wise, each [WIDTH, N] with WIDTH a multiple of BLOCK_M (their weights).
    FP8 off (a bf16 layer's gradient): G itself is stored in its dtype (OUT = ROUND), no transposed copy, no
    amax; `scale`, `out_t` and `amax` are not touched."""
    tile_m = tl.program_id(0)
    tile_n = tl.program_id(1)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    if PARTS == 1:
        g = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
    else:
        if STACKED:
            part = tile_m * BLOCK_M // WIDTH
            local = (rows[:, None] - part * WIDTH).to(tl.int64) * N + cols[None, :]
        else:
            part = tile_n * BLOCK_N // WIDTH
            local = rows[:, None].to(tl.int64) * WIDTH + (cols[None, :] - part * WIDTH)
        source = x
        if part == 1:
            source = x1
        if part == 2:
            source = x2
        g = tl.load(source + local, mask=inside, other=0.0).to(tl.float32)
    if ACT == 1:  # h * Phi(h), F.gelu's exact form
        g = (g * 0.5 * (1.0 + tl.math.erf(g * _SQRT_HALF))).to(ROUND, fp_downcast_rounding="rtne").to(tl.float32)
    if ACT == 2:  # d/dh [h * Phi(h)] = Phi(h) + h * phi(h), autograd's exact GELU
        h = tl.load(pre + offsets, mask=inside, other=0.0).to(tl.float32)
        cdf = 0.5 * (1.0 + tl.math.erf(h * _SQRT_HALF))
        pdf = tl.exp(-0.5 * h * h) * _INV_SQRT_2PI
        g = (g * (cdf + h * pdf)).to(ROUND, fp_downcast_rounding="rtne").to(tl.float32)
    if FP8:
        q = tl.clamp(g * tl.load(scale), -FP8_MAX, FP8_MAX).to(OUT, fp_downcast_rounding="rtne")
        tl.store(out + offsets, q, mask=inside)
        transposed = cols[:, None].to(tl.int64) * M_pad + rows[None, :]
        tl.store(out_t + transposed, tl.trans(q), mask=(cols[:, None] < N) & (rows[None, :] < M_pad))
        tl.atomic_max(amax, tl.max(tl.abs(g)))
    else:
        tl.store(out + offsets, g.to(OUT, fp_downcast_rounding="rtne"), mask=inside)
    if SUMS:
        tl.store(partials + tile_m * N + cols, tl.sum(g, axis=0), mask=cols < N)


@triton.jit
def _column_step(dy, s, gamma, mu, inv, rows, real, start, N, BLOCK_N: tl.constexpr):
    """A program's rows at BLOCK_N columns from `start`: the columns, the mask, the offsets, and dY, Xhat and
    dXhat = dY * gamma in fp32."""
    cols = start + tl.arange(0, BLOCK_N)
    inside = real[:, None] & (cols[None, :] < N)
    offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    d = tl.load(dy + offsets, mask=inside, other=0.0).to(tl.float32)
    xhat = (tl.load(s + offsets, mask=inside, other=0.0).to(tl.float32) - mu[:, None]) * inv[:, None]
    dxhat = d * tl.load(gamma + cols, mask=cols < N, other=0.0)[None, :]
    return cols, inside, offsets, d, xhat, dxhat


def _norm_grad_cast_transpose(dy, s, mean, rstd, gamma, keep, scale, ds_out, out, out_t, partials, norm_partials,
                              amax, M, N, M_pad, DROP_SCALE, FP8_MAX: tl.constexpr, OUT: tl.constexpr,
                              ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """BLOCK_M rows of LayerNorm's backward and the FP8 operands of the layer before its dropout (`norm_grad`'s
    docstring). Programs: M_pad / BLOCK_M, rounded up; each walks its rows' N columns twice in BLOCK_N steps: the
    first pass sums each row's two LayerNorm terms and writes the weight and bias gradients' column partials, the
    second writes dS, G's two FP8 copies and G's column partials (its rows' tiles are in L2 from the first)."""
    tile_m = tl.program_id(0)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    real = rows < M
    mu = tl.load(mean + rows, mask=real, other=0.0)
    inv = tl.load(rstd + rows, mask=real, other=0.0)
    dot = tl.zeros([BLOCK_M], dtype=tl.float32)  # sum over the row of dXhat * Xhat
    total = tl.zeros([BLOCK_M], dtype=tl.float32)  # sum over the row of dXhat
    for start in range(0, N, BLOCK_N):
        cols, inside, offsets, d, xhat, dxhat = _column_step(dy, s, gamma, mu, inv, rows, real, start, N, BLOCK_N)
        dot += tl.sum(dxhat * xhat, axis=1)
        total += tl.sum(dxhat, axis=1)
        tl.store(norm_partials + (2 * tile_m) * N + cols, tl.sum(d * xhat, axis=0), mask=cols < N)
        tl.store(norm_partials + (2 * tile_m + 1) * N + cols, tl.sum(d, axis=0), mask=cols < N)
    dot = dot / N
    total = total / N
    largest = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols, inside, offsets, d, xhat, dxhat = _column_step(dy, s, gamma, mu, inv, rows, real, start, N, BLOCK_N)
        ds = ((dxhat - total[:, None] - xhat * dot[:, None]) * inv[:, None]).to(ROUND, fp_downcast_rounding="rtne")
        tl.store(ds_out + offsets, ds, mask=inside)
        kept = tl.load(keep + offsets, mask=inside, other=0).to(tl.float32)
        g = (ds.to(tl.float32) * kept * DROP_SCALE).to(ROUND, fp_downcast_rounding="rtne").to(tl.float32)
        q = tl.clamp(g * tl.load(scale), -FP8_MAX, FP8_MAX).to(OUT, fp_downcast_rounding="rtne")
        tl.store(out + offsets, q, mask=inside)
        transposed = cols[:, None].to(tl.int64) * M_pad + rows[None, :]
        tl.store(out_t + transposed, tl.trans(q), mask=(cols[:, None] < N) & (rows[None, :] < M_pad))
        tl.store(partials + tile_m * N + cols, tl.sum(g, axis=0), mask=cols < N)
        largest = tl.maximum(largest, tl.max(tl.abs(g), axis=1))
    tl.atomic_max(amax, tl.max(largest))


_TRITON_DTYPES = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5,
                  torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@dataclass(frozen=True)
class Kernel:
    """The kernel, compiled for the GPU or interpreted, and the tile it runs with."""

    run: Any
    block_m: int
    block_n: int


@functools.cache
def kernel(block_m: int, block_n: int, interpret: bool = False) -> Kernel:
    """The kernel with tiles of block_m x block_n (`fp8_cast.TILE_M`, `TILE_N` for the ops), for the GPU
    (`triton.jit`), or for Triton's interpreter on CPU tensors (tests; the process must have been started with
    TRITON_INTERPRET=1)."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return Kernel(InterpretedFunction(_cast_transpose), block_m, block_n)
    return Kernel(triton.jit(_cast_transpose), block_m, block_n)


@functools.cache
def norm_kernel(block_m: int, block_n: int, interpret: bool = False) -> Kernel:
    """`_norm_grad_cast_transpose` with BLOCK_M rows a program walked BLOCK_N columns at a time, for the GPU or
    for Triton's interpreter (as `kernel`)."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return Kernel(InterpretedFunction(_norm_grad_cast_transpose), block_m, block_n)
    return Kernel(triton.jit(_norm_grad_cast_transpose), block_m, block_n)


def norm_grad(k: Kernel, dy: torch.Tensor, s: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
              gamma: torch.Tensor, keep: torch.Tensor, drop_scale: float, scale: torch.Tensor, fp8_dtype: torch.dtype,
              padded_rows: int) -> tuple[torch.Tensor, ...]:
    """(dS in dY's dtype, G8, G8T, G's column sums fp32, G's amax fp32, the LayerNorm weight's and bias's gradients
    fp32) of LayerNorm(S)'s backward from dY [M, N], G = dropout's backward of dS (`keep` the kept elements, bool)
    cast to FP8 by `scale` (`fp8_cast.norm_grad_reference`)."""
    rows, cols = dy.shape
    device = dy.device
    ds = torch.empty_like(dy)
    out = torch.empty((rows, cols), dtype=fp8_dtype, device=device)
    out_t = torch.empty((cols, padded_rows), dtype=fp8_dtype, device=device)
    amax = torch.zeros((), dtype=torch.float32, device=device)
    tiles = triton.cdiv(padded_rows, k.block_m)
    partials = torch.empty((tiles, cols), dtype=torch.float32, device=device)
    norm_partials = torch.empty((tiles, 2, cols), dtype=torch.float32, device=device)
    k.run[(tiles,)](dy, s, mean, rstd, gamma, keep, scale, ds, out, out_t, partials, norm_partials, amax, rows, cols,
                    padded_rows, drop_scale, FP8_MAX=float(torch.finfo(fp8_dtype).max), OUT=_TRITON_DTYPES[fp8_dtype],
                    ROUND=_TRITON_DTYPES[dy.dtype], BLOCK_M=k.block_m, BLOCK_N=k.block_n)
    norm_sums = norm_partials.sum(0)
    return ds, out, out_t, partials.sum(0), amax, norm_sums[0], norm_sums[1]


def cast_transpose(k: Kernel, parts: list[torch.Tensor], pre: torch.Tensor | None, scale: torch.Tensor,
                   fp8_dtype: torch.dtype, padded_rows: int, act: int, sums: bool, stacked: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(X8, X8T, column sums fp32 [N] with `sums` else None, amax fp32 []) of X, the column-wise concatenation
    of the contiguous 2-D `parts` (at most 3, of one width, a multiple of the tile's when more than one), or with
    `stacked` their row-wise one (of one height, a multiple of the tile's, `padded_rows` their total), after `act`
    (module docstring; `pre`: FC1's output, for DGELU, with one part)."""
    rows, cols = _concatenated_shape(parts, stacked)
    device = parts[0].device
    out = torch.empty((rows, cols), dtype=fp8_dtype, device=device)
    out_t = torch.empty((cols, padded_rows), dtype=fp8_dtype, device=device)
    amax = torch.zeros((), dtype=torch.float32, device=device)
    sums_of = _launch(k, parts, pre, scale, out, out_t, amax, padded_rows, act, sums, fp8=True, stacked=stacked)
    return out, out_t, sums_of, amax


def _concatenated_shape(parts: list[torch.Tensor], stacked: bool) -> tuple[int, int]:
    rows, width = parts[0].shape
    return (rows * len(parts), width) if stacked else (rows, width * len(parts))


def gradient_sums(k: Kernel, parts: list[torch.Tensor], pre: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(G in the parts' dtype [M, N], its column sums fp32 [N]) of G, the concatenated `parts` (through GELU's
    derivative at `pre` when given): a bf16 layer's output gradient and bias gradient in one pass."""
    rows, width = parts[0].shape
    out = torch.empty((rows, width * len(parts)), dtype=parts[0].dtype, device=parts[0].device)
    sums = _launch(k, parts, pre, out, out, out, out, rows, DGELU if pre is not None else NONE, True, fp8=False)
    assert sums is not None
    return out, sums


def _launch(k: Kernel, parts: list[torch.Tensor], pre: torch.Tensor | None, scale: torch.Tensor, out: torch.Tensor,
            out_t: torch.Tensor, amax: torch.Tensor, padded_rows: int, act: int, sums: bool,
            fp8: bool, stacked: bool = False) -> torch.Tensor | None:
    rows, cols = _concatenated_shape(parts, stacked)
    width = parts[0].shape[0] if stacked else parts[0].shape[1]  # a part's extent along the concatenation
    tiles = (triton.cdiv(padded_rows, k.block_m), triton.cdiv(cols, k.block_n))
    partials = torch.empty((tiles[0] if sums else 1, cols), dtype=torch.float32, device=out.device)
    x, x1, x2 = (parts + parts[-1:] * 2)[:3]
    fp8_max = float(torch.finfo(out.dtype).max) if fp8 else 0.0
    k.run[tiles](x, x1, x2, x if pre is None else pre, scale, out, out_t, partials, amax, rows, cols, padded_rows,
                 width, FP8_MAX=fp8_max, ACT=act, SUMS=sums, PARTS=len(parts), STACKED=stacked, FP8=fp8,
                 OUT=_TRITON_DTYPES[out.dtype], ROUND=_TRITON_DTYPES[x.dtype], BLOCK_M=k.block_m, BLOCK_N=k.block_n)
    return partials.sum(0) if sums else None
