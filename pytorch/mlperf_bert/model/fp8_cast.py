"""FP8 operands made in one pass each, as custom ops: an FP8 linear layer's output gradient made ready for its
two backward GEMMs (`mlperf_bert::fp8_grad_cast_transpose`), FC2's input made from FC1's output
(`mlperf_bert::fp8_gelu_cast_transpose`), a layer's input made ready for its forward GEMM and its weight
gradient's (`mlperf_bert::fp8_cast_transpose`), a layer's weight for its forward GEMM and its input gradient's
(`mlperf_bert::fp8_weight_cast_transpose`), and the encoder layer's last LayerNorm backward with FC2's output
gradient made ready in the same pass (`mlperf_bert::fp8_norm_grad_cast_transpose`).

The backward of `fp8_delayed._DelayedFp8Matmul` needs, of its output gradient G [tokens, outputs]
(and, for the layer that GELU follows, of dGELU(H) * G): G in FP8 row-major for dX = G W, the same
values transposed for dW = G^T X, the bias gradient (G's column sums) and the amax the next step
scales by. Left to Inductor these are four consumers of G that it cannot put in one kernel (a global
max, column sums, a transposed copy, a row-major one): it reads G (and recomputes dGELU) once for
each, and writes the transposed copy with one-byte stores. NVIDIA's layers make all four in one pass
(TransformerEngine's `fp8_cast_transpose_bgrad_fused`, and its dGELU variant), and so does this op:

- CUDA: `fp8_kernels.py`'s Triton kernel, one read of G (and H), one write of each FP8 copy;
- CPU (and any other device): the same values from torch's own ops, `reference`: what the kernel
  is tested against (`tests/trainer/model/test_single_pass_ops.py`, through Triton's interpreter on the CPU);
- the fake device of the dry run: shapes only. The dry run counts the op's bytes as one pass
  (`single_pass_bytes`), as the kernel moves them.

FC2's input is GELU of FC1's output, cast to FP8 with FC2's delayed scale; its dW GEMM wants the transposed
copy. Left to Inductor, the forward reads FC1's output twice (GELU for the amax, GELU and the cast) and the
backward a third time (GELU and the cast again, transposed, as the partitioner recomputes rather than
saves them). `gelu_cast_transpose` reads it once and writes both FP8 copies and the amax; the transposed
copy is saved for the backward (`fp8_delayed._DelayedFp8Mlp`).

A training forward casts each FP8 layer's input X (a LayerNorm's output, or the layer's input) the same way:
`cast_transpose` writes X8 for the forward GEMM and X8T for the weight gradient's, with X's amax, in one pass.
Left to Inductor, the cast is fused into the LayerNorm's kernel and the transposed copy is made in the
backward, where the partitioner recomputes X8 from the LayerNorm's input (a transposed store that splits the
LayerNorm's backward in two kernels); an op's output is saved, never recomputed.

A weight is cast once per training forward, by the last training forward's amax (`fp8_delayed`), into W8 and its
transposed copy, the query, key and value weights read where they are: left to Inductor, its amax, its cast and,
in the backward, its cast again (recomputed from the fp32 parameter) with the transposed store read it three
times. The encoder layer ends in LayerNorm(x + dropout(FC2's output)): apart, Inductor's LayerNorm backward
writes FC2's output gradient for FC2's own pass to read and cast; `norm_grad_cast_transpose` writes it in FP8,
with the residual's gradient and the LayerNorm's weight and bias gradients, in its one pass (two over each
row's columns, the second from L2).

A `custom_op` and not a `triton_op`: the op is opaque to torch.compile either way (Inductor would not
fuse into the user kernel), and as a custom op its CPU implementation is torch's ops, not the kernel.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
import torch.nn.functional as F

NAMESPACE = "mlperf_bert"
# Tokens are padded to a multiple of this in the transposed copy: torch._scaled_mm wants the inner
# dimension of each GEMM to be a multiple of 16 (for dW that is the token dimension).
ALIGN = 16
# The ops that read each input once and write each output once, by the name the dry run's wrapper code
# calls them (`torch.ops.NS.OP.default`): their bytes are their operands' (`single_pass_bytes`).
# The kernel's tile (`fp8_kernels.py`): 4096 values, 8 KiB of bf16 read per operand. A gradient given in
# parts (the query, key and value gradients) is read in place when each part's width is a multiple of TILE_N.
TILE_M, TILE_N = 64, 64
SINGLE_PASS_OPS = (f"{NAMESPACE}.fp8_grad_cast_transpose", f"{NAMESPACE}.fp8_gelu_cast_transpose",
                   f"{NAMESPACE}.fp8_cast_transpose", f"{NAMESPACE}.fp8_weight_cast_transpose",
                   f"{NAMESPACE}.fp8_norm_grad_cast_transpose",
                   f"{NAMESPACE}.gradient_pass")  # the last: fused_linear.py's
# `norm_grad_cast_transpose`'s kernel: a program's rows, walked in steps of as many columns.
NORM_ROWS, NORM_COLUMNS = 16, 128


def padded(rows: int) -> int:
    return rows + (-rows % ALIGN)


def saturated_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale, saturated to the format's range (a value above last step's amax clamps), then cast."""
    limit = float(torch.finfo(dtype).max)
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def transposed(x8: torch.Tensor) -> torch.Tensor:
    """x8 [M, N] as [N, padded(M)] row-major, zero columns past M."""
    extra = padded(x8.shape[0]) - x8.shape[0]
    return (F.pad(x8, (0, 0, 0, extra)) if extra else x8).t().contiguous()


def reference(grads: list[torch.Tensor], pre: torch.Tensor | None, scale: torch.Tensor,
              fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`grad_cast_transpose`'s values from torch's ops: G, the column-wise concatenation of `grads` (dGELU(pre) *
    grad in grad's dtype when `pre` is given, with one part), then (G8 [M, N], G8T [N, padded(M)] with zero
    columns past M, G's column sums fp32, max |G| fp32)."""
    grad = grads[0] if len(grads) == 1 else torch.cat(grads, dim=1)
    g = grad if pre is None else torch.ops.aten.gelu_backward(grad, pre)
    g8 = saturated_cast(g, scale, fp8_dtype)
    return g8, transposed(g8), g.float().sum(0), g.detach().abs().amax().float()


def gelu_reference(pre: torch.Tensor, scale: torch.Tensor,
                   fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gelu_cast_transpose`'s values from torch's ops: `cast_reference` of Y = GELU(pre) in pre's dtype."""
    return cast_reference(F.gelu(pre), scale, fp8_dtype)


def cast_reference(x: torch.Tensor, scale: torch.Tensor,
                   fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`cast_transpose`'s values from torch's ops: (X8 [M, N], X8T [N, padded(M)] with zero columns past M,
    max |X| fp32)."""
    x8 = saturated_cast(x, scale, fp8_dtype)
    return x8, transposed(x8), x.detach().abs().amax().float()


def weight_reference(parts: Sequence[torch.Tensor], scale: torch.Tensor,
                     fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weight_cast_transpose`'s values from torch's ops: `cast_reference` of the row-wise parts stacked."""
    return cast_reference(parts[0] if len(parts) == 1 else torch.cat(list(parts)), scale, fp8_dtype)


def read_in_parts(grads: list[torch.Tensor], pre: torch.Tensor | None, tile: int = TILE_N) -> bool:
    """Whether `grad_cast_transpose` reads these parts in place (else the caller concatenates them first, where
    the compiled graph shows the copy): at most 3 parts of one shape, their width a multiple of the tile's
    (`tile` columns), no GELU."""
    if len(grads) == 1:
        return True
    # Compared, never hashed: a token count is symbolic under torch.compile, and hashing it would specialise
    # the graph to one count (a recompile for every batch of another).
    same = all(g.shape[0] == grads[0].shape[0] and g.shape[1] == grads[0].shape[1] for g in grads)
    return pre is None and len(grads) <= 3 and same and grads[0].shape[1] % tile == 0


@torch.library.custom_op(f"{NAMESPACE}::fp8_grad_cast_transpose", mutates_args=())
def grad_cast_transpose(grads: list[torch.Tensor], pre: torch.Tensor | None, scale: torch.Tensor,
                        fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(G8, G8T, bias gradient, amax) of the 2-D output gradient given as `grads`, its column-wise parts (one
    tensor, or the query, key and value gradients: `read_in_parts`) (module docstring, `reference`)."""
    return reference(grads, pre, scale, fp8_dtype)


@grad_cast_transpose.register_fake
def _grad_cast_transpose_fake(grads: list[torch.Tensor], pre: torch.Tensor | None, scale: torch.Tensor,
                              fp8_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    rows, cols, grad = grads[0].shape[0], sum(g.shape[1] for g in grads), grads[0]
    return (grad.new_empty((rows, cols), dtype=fp8_dtype), grad.new_empty((cols, padded(rows)), dtype=fp8_dtype),
            grad.new_empty((cols,), dtype=torch.float32), grad.new_empty((), dtype=torch.float32))


@grad_cast_transpose.register_kernel("cuda")
def _grad_cast_transpose_cuda(grads: list[torch.Tensor], pre: torch.Tensor | None, scale: torch.Tensor,
                              fp8_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    module = _triton_module()
    if module is None or not read_in_parts(grads, pre):
        return reference(grads, pre, scale, fp8_dtype)
    act = module.NONE if pre is None else module.DGELU
    g8, g8t, sums, amax = module.cast_transpose(
        module.kernel(TILE_M, TILE_N), [g.contiguous() for g in grads], None if pre is None else pre.contiguous(),
        scale.float(), fp8_dtype, padded(grads[0].shape[0]), act, sums=True)
    return g8, g8t, sums, amax


@torch.library.custom_op(f"{NAMESPACE}::fp8_gelu_cast_transpose", mutates_args=())
def gelu_cast_transpose(pre: torch.Tensor, scale: torch.Tensor,
                        fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Y8, Y8T, amax) of Y = GELU(pre) (module docstring, `gelu_reference`)."""
    return gelu_reference(pre, scale, fp8_dtype)


@gelu_cast_transpose.register_fake
def _gelu_cast_transpose_fake(pre: torch.Tensor, scale: torch.Tensor,
                              fp8_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    rows, cols = pre.shape
    return (pre.new_empty((rows, cols), dtype=fp8_dtype), pre.new_empty((cols, padded(rows)), dtype=fp8_dtype),
            pre.new_empty((), dtype=torch.float32))


@gelu_cast_transpose.register_kernel("cuda")
def _gelu_cast_transpose_cuda(pre: torch.Tensor, scale: torch.Tensor,
                              fp8_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return _forward_cast(pre, scale, fp8_dtype, gelu=True)


def _forward_cast(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                  gelu: bool) -> tuple[torch.Tensor, ...]:
    """(X8, X8T, amax) of X, or of GELU(X), on CUDA: the kernel with no column sums (the reference without Triton)."""
    module = _triton_module()
    if module is None:
        return (gelu_reference if gelu else cast_reference)(x, scale, fp8_dtype)
    x8, x8t, _, amax = module.cast_transpose(module.kernel(TILE_M, TILE_N), [x.contiguous()], None, scale.float(),
                                             fp8_dtype, padded(x.shape[0]), module.GELU if gelu else module.NONE,
                                             sums=False)
    return x8, x8t, amax


@torch.library.custom_op(f"{NAMESPACE}::fp8_cast_transpose", mutates_args=())
def cast_transpose(x: torch.Tensor, scale: torch.Tensor,
                   fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(X8, X8T, amax) of a layer's input X (module docstring, `cast_reference`): the FP8 operand of the forward
    GEMM and the transposed one its weight gradient's GEMM reads, made in the forward in one pass."""
    return cast_reference(x, scale, fp8_dtype)


@cast_transpose.register_fake
def _cast_transpose_fake(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return _gelu_cast_transpose_fake(x, scale, fp8_dtype)


@cast_transpose.register_kernel("cuda")
def _cast_transpose_cuda(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return _forward_cast(x, scale, fp8_dtype, gelu=False)


def stacked_in_place(parts: Sequence[torch.Tensor], tile: int = TILE_M) -> bool:
    """Whether `weight_cast_transpose` reads these row-wise parts in place (else the caller stacks them first,
    where the compiled graph shows the copy): at most 3 parts of one shape, their height a multiple of the
    tile's (`tile` rows)."""
    first = parts[0]
    same = all(p.shape[0] == first.shape[0] and p.shape[1] == first.shape[1] for p in parts)
    return len(parts) == 1 or (len(parts) <= 3 and same and first.shape[0] % tile == 0)


@torch.library.custom_op(f"{NAMESPACE}::fp8_weight_cast_transpose", mutates_args=())
def weight_cast_transpose(parts: list[torch.Tensor], scale: torch.Tensor,
                          fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(W8, W8T, amax) of a layer's weight W given as its row-wise parts (one tensor, or the query, key and value
    weights stacked: `stacked_in_place`): `cast_reference` of W, read once and where it is. W8 is the forward
    GEMM's operand, W8T (the same values transposed) the input gradient's; both are saved, not recomputed."""
    return weight_reference(parts, scale, fp8_dtype)


@weight_cast_transpose.register_fake
def _weight_cast_transpose_fake(parts: list[torch.Tensor], scale: torch.Tensor,
                                fp8_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    rows, cols, first = sum(p.shape[0] for p in parts), parts[0].shape[1], parts[0]
    return (first.new_empty((rows, cols), dtype=fp8_dtype), first.new_empty((cols, padded(rows)), dtype=fp8_dtype),
            first.new_empty((), dtype=torch.float32))


@weight_cast_transpose.register_kernel("cuda")
def _weight_cast_transpose_cuda(parts: list[torch.Tensor], scale: torch.Tensor,
                                fp8_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    module = _triton_module()
    if module is None or not stacked_in_place(parts):
        return weight_reference(parts, scale, fp8_dtype)
    rows = sum(p.shape[0] for p in parts)
    w8, w8t, _, amax = module.cast_transpose(module.kernel(TILE_M, TILE_N), [p.contiguous() for p in parts], None,
                                             scale.float(), fp8_dtype, padded(rows), module.NONE, sums=False,
                                             stacked=len(parts) > 1)
    return w8, w8t, amax


# dS, G8, G8T, bias gradient, amax, the LayerNorm weight's and bias's gradients (`norm_grad_cast_transpose`)
NormGrads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def norm_grad_reference(dy: torch.Tensor, s: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, gamma: torch.Tensor,
                        keep: torch.Tensor, drop_scale: float, scale: torch.Tensor,
                        fp8_dtype: torch.dtype) -> NormGrads:
    """`norm_grad_cast_transpose`'s values from torch's ops, as autograd takes them through `bert.LayerNorm` under
    autocast (fp32 statistics, the result rounded once) and dropout: dS = LayerNorm's backward in fp32 rounded to
    dY's dtype, G = dropout's backward of dS, then `reference` of G, and the LayerNorm weight's and bias's
    gradients in fp32."""
    ds, grad_gamma, grad_beta = torch.ops.aten.native_layer_norm_backward(
        dy.float(), s.float(), [s.shape[-1]], mean, rstd, gamma, torch.zeros_like(gamma), [True, True, True])
    ds = ds.to(dy.dtype)
    g8, g8_t, grad_b, amax = reference([torch.ops.aten.native_dropout_backward(ds, keep, drop_scale)], None, scale,
                                       fp8_dtype)
    return ds, g8, g8_t, grad_b, amax, grad_gamma, grad_beta


@torch.library.custom_op(f"{NAMESPACE}::fp8_norm_grad_cast_transpose", mutates_args=())
def norm_grad_cast_transpose(dy: torch.Tensor, s: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                             gamma: torch.Tensor, keep: torch.Tensor, drop_scale: float, scale: torch.Tensor,
                             fp8_dtype: torch.dtype) -> NormGrads:
    """LayerNorm(S)'s backward from dY [tokens, N] and the FP8 operands of the layer whose output reached S through
    dropout, in one pass over dY, S and the dropout's kept elements: (dS, G8, G8T, bias gradient, amax, the
    LayerNorm weight's and bias's gradients), G the layer's output gradient (`norm_grad_reference`). `mean`,
    `rstd`: the forward's statistics of S (`torch.native_layer_norm`'s). dS is the residual's gradient."""
    return norm_grad_reference(dy, s, mean, rstd, gamma, keep, drop_scale, scale, fp8_dtype)


@norm_grad_cast_transpose.register_fake
def _norm_grad_cast_transpose_fake(dy: torch.Tensor, s: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                                   gamma: torch.Tensor, keep: torch.Tensor, drop_scale: float, scale: torch.Tensor,
                                   fp8_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    rows, cols = dy.shape
    return (torch.empty_like(dy), *_grad_cast_transpose_fake([dy], None, scale, fp8_dtype),
            gamma.new_empty((cols,), dtype=torch.float32), gamma.new_empty((cols,), dtype=torch.float32))


@norm_grad_cast_transpose.register_kernel("cuda")
def _norm_grad_cast_transpose_cuda(dy: torch.Tensor, s: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                                   gamma: torch.Tensor, keep: torch.Tensor, drop_scale: float, scale: torch.Tensor,
                                   fp8_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    module = _triton_module()
    if module is None:
        return norm_grad_reference(dy, s, mean, rstd, gamma, keep, drop_scale, scale, fp8_dtype)
    return module.norm_grad(module.norm_kernel(NORM_ROWS, NORM_COLUMNS), dy.contiguous(), s.contiguous(),
                            mean.reshape(-1).float(), rstd.reshape(-1).float(), gamma.float().contiguous(),
                            keep.contiguous(), drop_scale, scale.float(), fp8_dtype, padded(dy.shape[0]))


@functools.cache
def _triton_module() -> Any:
    """`fp8_kernels`, or None where Triton does not import (torch's CPU wheels come without it)."""
    try:
        from . import fp8_kernels
    except ImportError:
        return None
    return fp8_kernels


def single_pass_bytes(operands: Sequence[Any]) -> int:
    """What a single-pass op moves: every tensor among its inputs read once, every output written once
    (`operands`: both, as tensors or anything else, which moves nothing). A symbolic size (a token count under
    dynamic shapes) counts at its hint, the size the graph was traced with, as Inductor counts its kernels."""
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    return sum(int(optimization_hint(t.numel())) * t.element_size() for t in operands if isinstance(t, torch.Tensor))
