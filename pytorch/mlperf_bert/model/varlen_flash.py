"""Attention per sequence on flat tokens, with dropout: PyTorch's flash-attention and cuDNN kernels.

`varlen_flash(q, k, v, cu_seqlens, max_seqlen, dropout_p)` and `varlen_cudnn(...)` run one attention
call over every sequence of a flat batch ([T, heads, head_dim], sequence i owning tokens
cu_seqlens[i]:cu_seqlens[i+1]), each over one kernel of the CUDA builds of torch, called with
cumulative lengths: no padding is computed, attention dropout is the kernel's own (Philox, its seed
and offset kept on the device, so graph-safe), and neither needs a package beyond torch.

- flash (`--attention_backend varlen`): `aten._flash_attention_forward` / `_backward`, the FA2 kernels
  under PyTorch's SDPA. (`torch.nn.attention.varlen.varlen_attn` calls the same kernel but fixes
  dropout at 0; BERT trains with 0.1.)
- cudnn (`--attention_backend varlen_cudnn`): `aten._cudnn_attention_forward` / `_backward` with
  `cum_seq_q` / `cum_seq_k`, cuDNN's fused flash attention (on Hopper its native sm90 kernels) over
  the packed tokens. Its outputs as torch's CUDA code allocates them (`attention.cu`,
  `cudnn/MHA.cpp`, packed path): output [T, heads, dim] contiguous in q's dtype, logsumexp
  [T, heads, 1] fp32, the Philox seed and offset as int64 scalars on the device (written by a kernel
  from the generator's state, also inside a CUDA-graph capture), which its backward takes.

A packed row of 512 tokens holds about two sequences: a block-diagonal mask over the whole row
computes every score of the row and masks half of them, these compute only the sequences' own. A
static packed batch keeps `cu_seqlens` at one length (empty sequences fill it,
`static_batch.static_packed_batch`), so one CUDA graph serves every batch.

Each kernel is a `VarlenKernel`: its two aten calls, their outputs' shapes on fake tensors, and how
the CPU reference's results take its outputs' layout. `_define_ops` makes the same pair of
`torch.library.custom_op`s of each (`mlperf_bert::varlen_<kernel>_forward` / `_backward`, one
autograd formula), so torch.compile keeps each whole and the dry run traces it on fake tensors. On
the CPU the ops run one reference implementation: per-sequence attention in fp32 on a padded grid,
with dropout drawn from a seed that the backward draws again. It makes the ops' wiring (autograd,
empty sequences, a row's padding tail) testable against the masked path without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

NAMESPACE = "mlperf_bert"

# (output, logsumexp, rng_a, rng_b): a kernel's forward outputs that its backward takes; rng_a holds the seed.
Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
Gradients = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def flash_kernel_available() -> bool:
    """Whether this torch has the flash-attention CUDA kernels (CUDA builds for Linux and Windows do)."""
    return bool(torch.backends.cuda.is_flash_attention_available())


# ---------------------------------------------------------------- the reference (CPU)


@dataclass(frozen=True)
class _Grid:
    """A flat batch's padded grid: index maps and the valid slots."""

    seq_index: torch.Tensor  # [T]
    pos_index: torch.Tensor  # [T]
    valid: torch.Tensor  # [S, L]

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, max_seqlen: int) -> "_Grid":
        cu = cu_seqlens.long().cpu()
        lengths = cu[1:] - cu[:-1]
        seq_index = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)
        pos_index = torch.arange(seq_index.shape[0]) - cu[:-1][seq_index]
        return cls(seq_index, pos_index, torch.arange(max_seqlen)[None, :] < lengths[:, None])

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, heads, dim] -> [S, heads, L, dim] in fp32, zeros outside the sequences."""
        s, max_seqlen = self.valid.shape
        out = torch.zeros(s, max_seqlen, x.shape[1], x.shape[2], dtype=torch.float32)
        out[self.seq_index, self.pos_index] = x.float()
        return out.transpose(1, 2)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[S, heads, L, dim] -> [T, heads, dim]."""
        return x.transpose(1, 2)[self.seq_index, self.pos_index]


@dataclass(frozen=True)
class _Probabilities:
    """softmax(q k^T / sqrt(dim)) per sequence, its logsumexp and the kept-and-rescaled dropout mask."""

    probs: torch.Tensor  # [S, heads, L, L] before dropout
    lse: torch.Tensor  # [S, heads, L]
    keep: torch.Tensor | None  # [S, heads, L, L]: 1 / (1 - p) where kept, 0 where dropped; None without dropout

    @property
    def dropped(self) -> torch.Tensor:
        return self.probs if self.keep is None else self.probs * self.keep


def _probabilities(grid: _Grid, q: torch.Tensor, k: torch.Tensor, dropout_p: float, seed: int) -> _Probabilities:
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [S, heads, L, L]
    # A finite floor, not -inf: an empty sequence's rows stay finite (their outputs are never read).
    scores = scores.masked_fill(~grid.valid[:, None, None, :], torch.finfo(torch.float32).min)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    keep = None
    if dropout_p > 0:
        generator = torch.Generator().manual_seed(seed)
        keep = (torch.rand(probs.shape, generator=generator) >= dropout_p).float() / (1.0 - dropout_p)
    return _Probabilities(probs, lse, keep)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                        max_seqlen: int, dropout_p: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [T, heads, dim] in q's dtype, logsumexp [heads, T] fp32): softmax(q k^T / sqrt(dim)) v per
    sequence in fp32, probabilities dropped with probability dropout_p (kept ones scaled by 1 / (1 - p)),
    the mask drawn from a generator seeded with `seed`."""
    grid = _Grid.of(cu_seqlens, max_seqlen)
    p = _probabilities(grid, grid.pad(q), grid.pad(k), dropout_p, seed)
    out = grid.unpad(p.dropped @ grid.pad(v))
    return out.to(q.dtype), grid.unpad(p.lse[..., None])[..., 0].transpose(0, 1).contiguous()


def reference_gradients(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cu_seqlens: torch.Tensor, max_seqlen: int, dropout_p: float,
                        seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `reference_attention` with the same seed, written out (as flash's backward does):
    with P the probabilities, D the kept mask over (1 - p) and O = (P * D) V,
    dV = (P * D)^T dO, dP = (dO V^T) * D, dS = P * (dP - rowsum(dP * P)), dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d).
    """
    grid = _Grid.of(cu_seqlens, max_seqlen)
    qg, kg, vg, dout = grid.pad(q), grid.pad(k), grid.pad(v), grid.pad(grad_out)
    p = _probabilities(grid, qg, kg, dropout_p, seed)
    dv = p.dropped.transpose(-1, -2) @ dout
    dp = dout @ vg.transpose(-1, -2)
    if p.keep is not None:
        dp = dp * p.keep
    ds = p.probs * (dp - (dp * p.probs).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    dq, dk = ds @ kg, ds.transpose(-1, -2) @ qg
    return tuple(grid.unpad(g).to(x.dtype) for g, x in ((dq, q), (dk, k), (dv, v)))  # type: ignore[return-value]


def _seed_of(rng_a: torch.Tensor) -> int:
    """The reference's seed, from where the CPU path put it: the first element of the kernel's seed output."""
    return int(rng_a.reshape(-1)[0].to(torch.int64))


# ---------------------------------------------------------------- the kernels


@dataclass(frozen=True)
class VarlenKernel:
    """One attention kernel of torch's behind the varlen ops: how each direction is called on a GPU, what its
    forward gives on fake tensors, and the CPU reference's (logsumexp [heads, T], seed) in its outputs' layout."""

    name: str  # the ops are mlperf_bert::varlen_<name>_forward / _backward
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], Outputs]
    backward: Callable[..., Gradients]  # (grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, dropout_p, rng_a, rng_b)
    reference_outputs: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    # On fake tensors; None: `forward` / `backward` themselves, where the aten ops have meta functions.
    fake_forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], Outputs] | None = None
    fake_backward: Callable[..., Gradients] | None = None

    @property
    def op_names(self) -> tuple[str, str]:
        return f"varlen_{self.name}_forward", f"varlen_{self.name}_backward"


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                   dropout_p: float) -> Outputs:
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, False, False)
    return out, lse, rng_state, unused


def _flash_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, dropout_p: float,
                    rng_state: torch.Tensor, unused: torch.Tensor) -> Gradients:
    """Redraws the forward's dropout from rng_state (seed and offset)."""
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad_out, q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, False, rng_state, unused)
    return dq, dk, dv


def _flash_reference_outputs(lse: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logsumexp [heads, T] as the kernel's; its rng_state [2] uint64 (seed, offset) and the unused scalar."""
    return lse, torch.tensor([seed, 0], dtype=torch.int64).to(torch.uint64), torch.zeros((), dtype=torch.uint64)


def _cudnn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                   dropout_p: float) -> Outputs:
    """cuDNN's packed attention: (output, logsumexp [T, heads, 1], philox seed, philox offset). The cumulative
    lengths it hands back are its inputs themselves (an op may not return its inputs); no bias, not causal."""
    out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, True, dropout_p, False, False)
    return out, lse, seed, offset


def _cudnn_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, dropout_p: float, seed: torch.Tensor,
                    offset: torch.Tensor) -> Gradients:
    """Redraws the forward's dropout from its philox seed and offset; None: no attention bias."""
    dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
        grad_out, q, k, v, out, lse, seed, offset, None, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
        False)
    return dq, dk, dv


def _cudnn_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                dropout_p: float) -> Outputs:
    """What the packed path allocates (cudnn/MHA.cpp, `run_cudnn_SDP_fprop_nestedtensor`): torch registers no
    meta function for `_cudnn_attention_forward`."""
    tokens, heads = q.shape[0], q.shape[1]
    out = q.new_empty((tokens, heads, v.shape[2]))
    lse = q.new_empty((tokens, heads, 1), dtype=torch.float32)
    return out, lse, q.new_empty((), dtype=torch.int64), q.new_empty((), dtype=torch.int64)


def _cudnn_reference_outputs(lse: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logsumexp [heads, T] as the kernel's [T, heads, 1]; the seed and offset as int64 scalars."""
    return (lse.transpose(0, 1).unsqueeze(-1).contiguous(), torch.tensor(seed, dtype=torch.int64),
            torch.tensor(0, dtype=torch.int64))


def _empty_gradients(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     *_: object) -> Gradients:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


FLASH = VarlenKernel("flash", _flash_forward, _flash_backward, _flash_reference_outputs)
CUDNN = VarlenKernel("cudnn", _cudnn_forward, _cudnn_backward, _cudnn_reference_outputs, _cudnn_fake,
                     _empty_gradients)
KERNELS = (FLASH, CUDNN)
VARLEN_OPS = frozenset(name for kernel in KERNELS for name in kernel.op_names)  # what the dry run's cost counts


# ---------------------------------------------------------------- the ops


def runs_kernel(q: torch.Tensor) -> bool:
    """Whether the ops call the GPU kernel (a CUDA tensor) or the CPU reference; the tests of the kernels'
    wiring point it at the CPU, with an emulated kernel."""
    return q.device.type == "cuda"


def _reference_forward(kernel: VarlenKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cu_seqlens: torch.Tensor, max_seqlen: int, dropout_p: float) -> Outputs:
    seed = int(torch.randint(0, 2**62, (1,)).item())
    out, lse = reference_attention(q, k, v, cu_seqlens, max_seqlen, dropout_p, seed)
    return (out, *kernel.reference_outputs(lse, seed))


def _define_ops(kernel: VarlenKernel) -> Callable[..., Outputs]:
    """The kernel's forward and backward custom ops, their fake implementations and autograd; returns the
    forward op."""
    forward_name, backward_name = (f"{NAMESPACE}::{name}" for name in kernel.op_names)

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                dropout_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if runs_kernel(q):
            return kernel.forward(q, k, v, cu_seqlens, max_seqlen, dropout_p)
        return _reference_forward(kernel, q, k, v, cu_seqlens, max_seqlen, dropout_p)

    def backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, dropout_p: float, rng_a: torch.Tensor,
                 rng_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if runs_kernel(q):
            return kernel.backward(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, dropout_p, rng_a, rng_b)
        return reference_gradients(grad_out, q, k, v, cu_seqlens, max_seqlen, dropout_p, _seed_of(rng_a))

    forward_op = torch.library.custom_op(forward_name, forward, mutates_args=())
    backward_op = torch.library.custom_op(backward_name, backward, mutates_args=())
    forward_op.register_fake(kernel.fake_forward or kernel.forward)
    backward_op.register_fake(kernel.fake_backward or kernel.backward)

    def setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
        q, k, v, cu_seqlens, max_seqlen, dropout_p = inputs
        out, lse, rng_a, rng_b = output
        ctx.save_for_backward(q, k, v, cu_seqlens, out, lse, rng_a, rng_b)
        ctx.max_seqlen, ctx.dropout_p = max_seqlen, dropout_p  # type: ignore[attr-defined]

    def autograd_backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor, *_: torch.Tensor) -> tuple:
        q, k, v, cu_seqlens, out, lse, rng_a, rng_b = ctx.saved_tensors  # type: ignore[attr-defined]
        dq, dk, dv = backward_op(grad_out.contiguous(), q, k, v, out, lse, cu_seqlens,
                                 ctx.max_seqlen, ctx.dropout_p, rng_a, rng_b)  # type: ignore[attr-defined]
        return dq, dk, dv, None, None, None

    forward_op.register_autograd(autograd_backward, setup_context=setup_context)
    return forward_op


_FLASH_OP = _define_ops(FLASH)
_CUDNN_OP = _define_ops(CUDNN)


def varlen_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                 dropout_p: float) -> torch.Tensor:
    """Attention of each sequence over its own tokens on the flash kernel: [T, heads, dim] -> [T, heads, dim].

    cu_seqlens: [S+1] int32, first token of each sequence (empty sequences allowed); max_seqlen: the
    longest sequence, or more (a static batch passes its row length)."""
    return _FLASH_OP(q, k, v, cu_seqlens.to(torch.int32), max_seqlen, float(dropout_p))[0]


def varlen_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                 dropout_p: float) -> torch.Tensor:
    """`varlen_flash` on cuDNN's kernel."""
    return _CUDNN_OP(q, k, v, cu_seqlens.to(torch.int32), max_seqlen, float(dropout_p))[0]
