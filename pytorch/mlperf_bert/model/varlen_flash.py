"""Attention per sequence on flat tokens, with dropout: PyTorch's own flash-attention kernel.

`varlen_flash(q, k, v, cu_seqlens, max_seqlen, dropout_p)` runs one flash-attention call over
every sequence of a flat batch ([T, heads, head_dim], sequence i owning tokens
cu_seqlens[i]:cu_seqlens[i+1]). On a GPU it is `aten._flash_attention_forward` / `_backward`,
the kernels under PyTorch's SDPA, called with cumulative lengths: no padding is computed,
attention dropout is the kernel's own (Philox, graph-safe), and it needs no package beyond
torch. (`torch.nn.attention.varlen.varlen_attn` calls the same kernel but fixes dropout at 0;
BERT trains with 0.1.)

A packed row of 512 tokens holds about two sequences: a block-diagonal mask over the whole row
computes every score of the row and masks half of them, this computes only the sequences'
own. A static packed batch keeps `cu_seqlens` at one length (empty sequences fill it,
`static_batch.static_packed_batch`), so one CUDA graph serves every batch.

The op is a `torch.library.custom_op`, so torch.compile keeps it whole and the dry run traces
it on fake tensors (its fake implementation is the aten op's own meta function). On the CPU the
same op runs a reference implementation: per-sequence attention in fp32 on a padded grid, with
dropout drawn from a seed that the backward draws again. It makes the op's wiring (autograd,
empty sequences, a row's padding tail) testable against the masked path without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NAMESPACE = "mlperf_bert"
# The rng state the CPU reference keeps, shaped as the GPU kernel's (a Philox seed and offset).
_RNG_STATE_SHAPE = (2,)


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


def _seed_of(rng_state: torch.Tensor) -> int:
    return int(rng_state[0].to(torch.int64))


# ---------------------------------------------------------------- the op


@torch.library.custom_op(f"{NAMESPACE}::varlen_flash_forward", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
             dropout_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, logsumexp, rng_state, rng_unused): the flash kernel's outputs that its backward takes."""
    if q.device.type == "cuda":
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, False, False)
        return out, lse, rng_state, unused
    seed = int(torch.randint(0, 2**62, (1,)).item())
    out, lse = reference_attention(q, k, v, cu_seqlens, max_seqlen, dropout_p, seed)
    rng_state = torch.tensor([seed, 0], dtype=torch.int64).to(torch.uint64)
    return out, lse, rng_state, torch.zeros((), dtype=torch.uint64)


@_forward.register_fake
def _forward_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                  dropout_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    rng_state = q.new_empty(_RNG_STATE_SHAPE, dtype=torch.uint64)
    return out, lse, rng_state, q.new_empty((), dtype=torch.uint64)


@torch.library.custom_op(f"{NAMESPACE}::varlen_flash_backward", mutates_args=())
def _backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, dropout_p: float,
                 rng_state: torch.Tensor, unused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv). On a GPU the flash backward, which redraws the forward's dropout from rng_state."""
    if q.device.type == "cuda":
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out, q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, False,
            rng_state, unused)
        return dq, dk, dv
    return reference_gradients(grad_out, q, k, v, cu_seqlens, max_seqlen, dropout_p, _seed_of(rng_state))


@_backward_op.register_fake
def _backward_fake(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, dropout_p: float,
                   rng_state: torch.Tensor, unused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    q, k, v, cu_seqlens, max_seqlen, dropout_p = inputs
    out, lse, rng_state, unused = output
    ctx.save_for_backward(q, k, v, cu_seqlens, out, lse, rng_state, unused)
    ctx.max_seqlen, ctx.dropout_p = max_seqlen, dropout_p  # type: ignore[attr-defined]


def _autograd_backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor, *_: torch.Tensor) -> tuple:
    q, k, v, cu_seqlens, out, lse, rng_state, unused = ctx.saved_tensors  # type: ignore[attr-defined]
    dq, dk, dv = _backward_op(grad_out.contiguous(), q, k, v, out, lse, cu_seqlens,
                              ctx.max_seqlen, ctx.dropout_p, rng_state, unused)  # type: ignore[attr-defined]
    return dq, dk, dv, None, None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def varlen_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                 dropout_p: float) -> torch.Tensor:
    """Attention of each sequence over its own tokens: [T, heads, dim] -> [T, heads, dim].

    cu_seqlens: [S+1] int32, first token of each sequence (empty sequences allowed); max_seqlen: the
    longest sequence, or more (a static batch passes its row length)."""
    return _forward(q, k, v, cu_seqlens.to(torch.int32), max_seqlen, float(dropout_p))[0]
