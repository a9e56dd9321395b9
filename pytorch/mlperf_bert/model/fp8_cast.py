"""An FP8 linear layer's output gradient made ready for its two backward GEMMs in one pass: the custom op
`mlperf_bert::fp8_grad_cast_transpose`.

The backward of `fp8_delayed._DelayedFp8Matmul` needs, of its output gradient G [tokens, outputs]
(and, for the layer that GELU follows, of dGELU(H) * G): G in FP8 row-major for dX = G W, the same
values transposed for dW = G^T X, the bias gradient (G's column sums) and the amax the next step
scales by. Left to Inductor these are four consumers of G that it cannot put in one kernel (a global
max, column sums, a transposed copy, a row-major one): it reads G (and recomputes dGELU) once for
each, and writes the transposed copy with one-byte stores. NVIDIA's layers make all four in one pass
(TransformerEngine's `fp8_cast_transpose_bgrad_fused`, and its dGELU variant), and so does this op:

- CUDA: `fp8_kernels.py`'s Triton kernel, one read of G (and H), one write of each FP8 copy;
- CPU (and any other device): the same values from torch's own ops, `reference`: what the kernel
  is tested against (`tests/test_fp8_kernels.py`, through Triton's interpreter on the CPU);
- the fake device of the dry run: shapes only. The dry run counts the op's bytes as one pass
  (`single_pass_bytes`), as the kernel moves them.

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
SINGLE_PASS_OPS = (f"{NAMESPACE}.fp8_grad_cast_transpose",)


def padded(rows: int) -> int:
    return rows + (-rows % ALIGN)


def saturated_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale, saturated to the format's range (a value above last step's amax clamps), then cast."""
    limit = float(torch.finfo(dtype).max)
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def reference(grad: torch.Tensor, pre: torch.Tensor | None, scale: torch.Tensor,
              fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's values from torch's ops: G (dGELU(pre) * grad in grad's dtype when `pre` is given), then
    (G8 [M, N], G8T [N, padded(M)] with zero columns past M, G's column sums fp32, max |G| fp32)."""
    g = grad if pre is None else torch.ops.aten.gelu_backward(grad, pre)
    g8 = saturated_cast(g, scale, fp8_dtype)
    extra = padded(g8.shape[0]) - g8.shape[0]
    g8t = (F.pad(g8, (0, 0, 0, extra)) if extra else g8).t().contiguous()
    return g8, g8t, g.float().sum(0), g.detach().abs().amax().float()


@torch.library.custom_op(f"{NAMESPACE}::fp8_grad_cast_transpose", mutates_args=())
def grad_cast_transpose(grad: torch.Tensor, pre: torch.Tensor | None, scale: torch.Tensor,
                        fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(G8, G8T, bias gradient, amax) of the 2-D output gradient `grad` (module docstring, `reference`)."""
    return reference(grad, pre, scale, fp8_dtype)


@grad_cast_transpose.register_fake
def _grad_cast_transpose_fake(grad: torch.Tensor, pre: torch.Tensor | None, scale: torch.Tensor,
                              fp8_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    rows, cols = grad.shape
    return (grad.new_empty((rows, cols), dtype=fp8_dtype), grad.new_empty((cols, padded(rows)), dtype=fp8_dtype),
            grad.new_empty((cols,), dtype=torch.float32), grad.new_empty((), dtype=torch.float32))


@grad_cast_transpose.register_kernel("cuda")
def _grad_cast_transpose_cuda(grad: torch.Tensor, pre: torch.Tensor | None, scale: torch.Tensor,
                              fp8_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    module = _triton_module()
    if module is None:
        return reference(grad, pre, scale, fp8_dtype)
    return module.grad_cast_transpose(module.kernel(), grad.contiguous(), None if pre is None else pre.contiguous(),
                                      scale.float(), fp8_dtype, padded(grad.shape[0]))


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
    (`operands`: both, as tensors or anything else, which moves nothing)."""
    return sum(t.numel() * t.element_size() for t in operands if isinstance(t, torch.Tensor))
