"""Attention per sequence inside packed rows (`model/varlen_flash.py`): exact against the masked path.

On the CPU the op runs its reference implementation; the GPU runs PyTorch's flash kernel through
the same op (same autograd, same fake implementation for compile and the dry run). What the CPU
checks: the op's forward and its hand-written backward equal row attention with a block-diagonal
mask (the path packed rows took before) and a second, autograd-differentiated implementation, on
static packed batches from the real batch builder (empty sequence slots in front, padding tails);
the backward reuses the forward's dropout mask; a whole model on the varlen back-end trains like
the masked one; torch.compile keeps the op in one graph.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mlperf_bert.data.static_batch import static_packed_batch
from mlperf_bert.model.attention import flat_layout, row_attention
from mlperf_bert.model.bert import BertConfig, BertForPreTraining, pretraining_loss
from mlperf_bert.model.varlen_flash import reference_attention, reference_gradients, varlen_flash
from test_fast_path import MAX_PREDICTIONS, MAX_SEQS, ROW_LEN, ROWS, make_rows

HEADS, DIM = 2, 8


def packed_cu_seqlens(seed: int, rows: int = 5) -> torch.Tensor:
    batch = static_packed_batch(make_rows(np.random.default_rng(seed), ROWS), rows, ROW_LEN, MAX_SEQS,
                                MAX_PREDICTIONS)
    assert int(batch.seqlens().eq(0).sum()) > 0  # empty slots in front: the fixed-size cu_seqlens
    return batch.cu_seqlens


def qkv(tokens: int, seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, HEADS, DIM, generator=generator, dtype=dtype).requires_grad_(True) for _ in range(3)]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    return row_attention(q, k, v, flat_layout(cu, ROW_LEN, q.shape[0], ROW_LEN), 0.0)


def autograd_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                       keep: torch.Tensor | None) -> torch.Tensor:
    """A second implementation: a loop over sequences, F.softmax, autograd; `keep` the dropout factors."""
    cuts = cu.long().tolist()
    outs = []
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        if a == b:
            continue
        qi, ki, vi = (x[a:b].transpose(0, 1) for x in (q, k, v))  # [heads, n, dim]
        probs = F.softmax(qi @ ki.transpose(-1, -2) / DIM**0.5, dim=-1)
        if keep is not None:
            probs = probs * keep[i, :, : b - a, : b - a]
        outs.append((probs @ vi).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_op_equals_the_masked_row_path_forward_and_backward(seed: int):
    cu = packed_cu_seqlens(seed)
    tokens = int(cu[-1])
    q, k, v = qkv(tokens, seed)
    expected = masked_attention(q, k, v, cu)
    got = varlen_flash(q, k, v, cu, ROW_LEN, 0.0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(got)
    for g, e in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_op_keeps_half_precision_inputs_and_matches_fp32():
    cu = packed_cu_seqlens(3)
    q, k, v = qkv(int(cu[-1]), 3, torch.bfloat16)
    got = varlen_flash(q, k, v, cu, ROW_LEN, 0.0)
    assert got.dtype == torch.bfloat16
    expected = masked_attention(*(x.float() for x in (q, k, v)), cu)
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)


def test_logsumexp_is_per_token_and_head():
    cu = torch.tensor([0, 0, 3, 7], dtype=torch.int32)
    q, k, v = qkv(7, 4)
    _, lse = reference_attention(q, k, v, cu, 8, 0.0, 0)
    assert lse.shape == (HEADS, 7)
    scores = (q[3:7].transpose(0, 1) @ k[3:7].transpose(0, 1).transpose(-1, -2)) / DIM**0.5  # second sequence
    torch.testing.assert_close(lse[:, 3:7], torch.logsumexp(scores, dim=-1))


def dropout_keep(seed: int, cu: torch.Tensor, p: float) -> torch.Tensor:
    """The reference's kept-and-rescaled factors, drawn as it draws them ([S, heads, L, L])."""
    shape = (cu.shape[0] - 1, HEADS, ROW_LEN, ROW_LEN)
    return (torch.rand(shape, generator=torch.Generator().manual_seed(seed)) >= p).float() / (1 - p)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_forward_and_backward_use_one_mask(p: float):
    cu = packed_cu_seqlens(5)
    q, k, v = qkv(int(cu[-1]), 5)
    torch.manual_seed(11)
    out, _, rng_state, _ = torch.ops.mlperf_bert.varlen_flash_forward(q, k, v, cu, ROW_LEN, p)
    seed = int(rng_state[0].to(torch.int64))
    expected = autograd_attention(q, k, v, cu, dropout_keep(seed, cu, p))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    for g, e in zip(got, torch.autograd.grad(expected, (q, k, v), grad)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    # dropout really drops: a share near p of the probabilities is zero
    dropped = float((dropout_keep(seed, cu, p) == 0).float().mean())
    assert abs(dropped - p) < 0.02


def test_hand_written_gradients_equal_autograd_without_dropout_and_with_empty_sequences():
    cu = torch.tensor([0, 0, 0, 5, 5, 12, 24], dtype=torch.int32)
    q, k, v = qkv(24, 6)
    grad = torch.randn(24, HEADS, DIM)
    got = reference_gradients(grad, q, k, v, cu, ROW_LEN, 0.0, 0)
    expected = torch.autograd.grad(autograd_attention(q, k, v, cu, None), (q, k, v), grad)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_varlen_model_trains_like_the_masked_model_on_static_packed_rows():
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=32)
    batch = static_packed_batch(make_rows(np.random.default_rng(7), ROWS), 5, ROW_LEN, MAX_SEQS, MAX_PREDICTIONS)
    torch.manual_seed(0)
    masked = BertForPreTraining(cfg, "sdpa")
    varlen = BertForPreTraining(cfg, "varlen")
    varlen.load_state_dict(masked.state_dict())
    losses = []
    for model in (masked, varlen):
        loss = pretraining_loss(model(batch), batch).total
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for (name, a), b in zip(masked.named_parameters(), varlen.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_compile_keeps_the_op_in_one_graph():
    cu = packed_cu_seqlens(8)
    q, k, v = qkv(int(cu[-1]), 8)
    compiled = torch.compile(lambda a, b, c: varlen_flash(a, b, c, cu, ROW_LEN, 0.0), fullgraph=True,
                             backend="aot_eager")
    got = compiled(q, k, v)
    torch.testing.assert_close(got, masked_attention(q, k, v, cu), rtol=1e-5, atol=1e-6)
    got.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_max_seqlen_exactly_the_longest_sequence_in_each_precision(dtype: torch.dtype, tolerance: float):
    """max_seqlen at its least (the longest sequence, 5 tokens; an empty one in the middle): output and gradients
    in the inputs' dtype, equal to the loop over sequences in fp32 to the dtype's rounding."""
    cu = torch.tensor([0, 3, 8, 8, 12], dtype=torch.int32)
    q, k, v = qkv(12, 9, dtype)
    got = varlen_flash(q, k, v, cu, 5, 0.0)
    grad = torch.randn(12, HEADS, DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = torch.autograd.grad(got, (q, k, v), grad)
    assert got.dtype == dtype and all(g.dtype == dtype for g in grads)
    exact = [x.detach().float().requires_grad_(True) for x in (q, k, v)]
    expected = autograd_attention(*exact, cu, None)
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)
    for g, e in zip(grads, torch.autograd.grad(expected, exact, grad.float())):
        torch.testing.assert_close(g.float(), e, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_outputs_have_the_real_ops_shapes_and_dtypes(dtype: torch.dtype):
    """The dry run counts the op's bytes from its fake outputs: they must be the real op's, forward and backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cu = torch.tensor([0, 3, 7], dtype=torch.int32)

    def outputs(mode) -> list[tuple[torch.Size, torch.dtype]]:
        with mode:
            q, k, v = (torch.ones(7, HEADS, DIM, dtype=dtype) for _ in range(3))
            forward = torch.ops.mlperf_bert.varlen_flash_forward(q, k, v, cu, 4, 0.0)
            backward = torch.ops.mlperf_bert.varlen_flash_backward(forward[0], q, k, v, forward[0], forward[1], cu,
                                                                   4, 0.0, forward[2], forward[3])
        return [(t.shape, t.dtype) for t in (*forward, *backward)]

    real = outputs(contextlib.nullcontext())
    assert real[:2] == [((7, HEADS, DIM), dtype), ((HEADS, 7), torch.float32)]  # out like q, logsumexp [heads, T]
    assert outputs(FakeTensorMode(allow_non_fake_inputs=True)) == real
