"""The encoder's bf16 (fp16, fp32) linear layers whose backward makes the output gradient and its bias gradient in
one pass: the custom op `mlperf_bert::gradient_pass`, and two autograd functions that call it.

Left to Inductor, the bias gradient (the output gradient's column sums) is a reduction kernel of its own
that reads the gradient again: after FC1's GELU backward (0.20 GB a BERT-Large layer, on top of the GELU
backward's 0.60) and after the query, key and value gradients are concatenated for the stacked QKV
layer's GEMMs (0.15 GB, on top of the concatenation's 0.30). The op reads the gradient (its parts, and
FC1's output for GELU's derivative) once and writes the gradient the GEMMs read and its column sums:

- CUDA: `fp8_kernels.py`'s kernel with its FP8 outputs off (`gradient_sums`), one read and one write;
- CPU (and any other device): torch's ops (`reference`), what the kernel is tested against;
- the fake device: shapes only; the dry run counts its bytes as one pass (`fp8_cast.SINGLE_PASS_OPS`).

The values are autograd's for the same layers: the gradient is GELU's backward in the gradient's dtype,
the GEMMs are the same matrix products in the same dtype (under autocast, the autocast dtype), and the
bias gradient is rounded to that dtype, as autocast's linear gives it; only its summation order is the
kernel's (fp32 partial sums of 64-row tiles). One difference on CUDA: the weight gradient is the GEMM's fp32
accumulator, not rounded to bf16 first (`weight_gradient`).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .fp8_cast import NAMESPACE, TILE_M, TILE_N, _triton_module, read_in_parts


def reference(grads: list[torch.Tensor], pre: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(G, G's column sums fp32): G the column-wise concatenation of `grads`, through GELU's derivative at `pre`
    (autograd's, in the gradient's dtype) when given."""
    grad = grads[0].clone() if len(grads) == 1 else torch.cat(grads, dim=1)  # an op's result is never its input
    g = grad if pre is None else torch.ops.aten.gelu_backward(grad, pre)
    return g, g.float().sum(0)


@torch.library.custom_op(f"{NAMESPACE}::gradient_pass", mutates_args=())
def gradient_pass(grads: list[torch.Tensor], pre: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the output gradient, its bias gradient fp32) from its column-wise parts (`fp8_cast.read_in_parts`) and,
    for FC1, FC1's output (module docstring)."""
    return reference(grads, pre)


@gradient_pass.register_fake
def _gradient_pass_fake(grads: list[torch.Tensor], pre: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = grads[0].shape[0], sum(g.shape[1] for g in grads)
    return grads[0].new_empty((rows, cols)), grads[0].new_empty((cols,), dtype=torch.float32)


@gradient_pass.register_kernel("cuda")
def _gradient_pass_cuda(grads: list[torch.Tensor], pre: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    module = _triton_module()
    if module is None or not read_in_parts(grads, pre):
        return reference(grads, pre)
    return module.gradient_sums(module.kernel(TILE_M, TILE_N), [g.contiguous() for g in grads],
                                None if pre is None else pre.contiguous())


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


class _Linear(torch.autograd.Function):
    """Y = X W^T + b (GELU(Y) with `gelu`; the column blocks `split` of Y without), in X's compute dtype; the
    backward's output gradient and bias gradient from one pass (`gradient_pass`), then dX = G W, dW = G^T X."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype, gelu: bool,
                split: tuple[int, ...] | None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        with torch.autocast(x.device.type, enabled=False):  # the casts autocast would make, made here
            x, w, b = x.to(dtype), weight.to(dtype), bias.to(dtype)
            out = F.linear(x, w, b)
            ctx.save_for_backward(x, w, out if gelu else None)
            ctx.widths, ctx.dtypes = split or (out.shape[-1],), (weight.dtype, bias.dtype)
            if gelu:
                return F.gelu(out)
            return out if split is None else tuple(out.split(split, dim=-1))

    @staticmethod
    def backward(ctx, *grad_outs: torch.Tensor | None) -> tuple:
        x, w, pre = ctx.saved_tensors
        grads = [(g if g is not None else x.new_zeros((x.shape[0], width))).contiguous()
                 for g, width in zip(grad_outs, ctx.widths)]
        if len(grads) == 1 and pre is None:  # nothing to fuse: the bias gradient is a sum of its own
            g, grad_b = grads[0], grads[0].float().sum(0)
        else:
            g, grad_b = gradient_pass(grads if read_in_parts(grads, pre) else [torch.cat(grads, dim=1)], pre)
        grad_w = weight_gradient(g, x, ctx.dtypes[0])
        return (g @ w, grad_w, grad_b.to(x.dtype).to(ctx.dtypes[1]), None, None, None)


def weight_gradient(g: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """G^T X in the weight's dtype. On CUDA, with bf16 or fp16 operands and an fp32 weight, the GEMM writes its fp32
    accumulator (`torch.mm(..., out_dtype=)`, cuBLAS): no product rounded to the operands' dtype and no kernel
    converting it (0.04 GB a BERT-Large layer for FC1's and the QKV layer's), as NVIDIA's weight-gradient GEMMs
    write fp32 gradients. Elsewhere (the CPU has no such GEMM) the product in the operands' dtype, converted."""
    if g.is_cuda and g.dtype in (torch.bfloat16, torch.float16) and dtype == torch.float32:
        return torch.mm(g.t(), x, out_dtype=torch.float32)
    return (g.t() @ x).to(dtype)


def linear_gelu(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """GELU(linear(x)) (the exact, erf form), its backward's GELU derivative and bias gradient in one pass."""
    flat = x.reshape(-1, x.shape[-1])
    out = _Linear.apply(flat, linear.weight, linear.bias, _compute_dtype(x), True, None)
    return out.reshape(*x.shape[:-1], linear.out_features)


def split_linear(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor,
                 sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """x W^T + b for stacked layers (query, key and value), as their column blocks `sizes`: the backward reads
    the blocks' gradients where they are, with the bias gradient in the same pass."""
    flat = x.reshape(-1, x.shape[-1])
    blocks = _Linear.apply(flat, weight, bias, _compute_dtype(x), False, tuple(sizes))
    return tuple(block.reshape(*x.shape[:-1], size) for block, size in zip(blocks, sizes))
