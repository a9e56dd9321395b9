"""Attention per sequence inside packed rows (`model/varlen_flash.py`): exact against the masked path.

On the CPU the ops run their reference implementation; the GPU runs PyTorch's flash kernel or cuDNN's
through the same ops (same autograd, same fake plumbing for compile and the dry run). What the CPU
checks, for both kernels: the ops' forward and their hand-written backward equal row attention with a
block-diagonal mask (the path packed rows took before) and a second, autograd-differentiated
implementation, on static packed batches from the real batch builder (empty sequence slots in front,
padding tails); the backward reuses the forward's dropout mask; a whole model on each varlen back-end
trains like the masked one; torch.compile keeps each op whole in one graph; the fake outputs are the
kernels'. The GPU calls themselves run here against emulated aten kernels (the reference behind each
kernel's signature and layouts): the batch's lengths, the dropout and the forward's seed reach them.
Then the start-up checks of varlen_cudnn, and GPU-only tests of the kernels themselves: cuDNN's against
flash's, and each one's dropout rate and its backward's mask (that probe checked here on the emulated kernels).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mlperf_bert.data.static_batch import static_packed_batch
from mlperf_bert.model import attention as backends
from mlperf_bert.model import varlen_flash as ops
from mlperf_bert.model.attention import AttentionNeeds, backend_problem, flat_layout, resolve_backend, row_attention
from mlperf_bert.model.bert import BertConfig, BertForPreTraining, pretraining_loss
from mlperf_bert.model.varlen_flash import reference_attention, reference_gradients, varlen_cudnn, varlen_flash
from tests.harness.tiny_bert import MAX_PREDICTIONS, MAX_SEQS, ROW_LEN, ROWS, make_rows

HEADS, DIM = 2, 8
ATTENTION = {"flash": varlen_flash, "cudnn": varlen_cudnn}
KERNELS = pytest.mark.parametrize("kernel", list(ATTENTION))


def forward_op(kernel: str):
    return getattr(torch.ops.mlperf_bert, f"varlen_{kernel}_forward")


def seed_of(rng_a: torch.Tensor) -> int:
    """The reference's seed in a forward's outputs: flash's rng_state[0], cuDNN's philox seed."""
    return int(rng_a.reshape(-1)[0].to(torch.int64))


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


@KERNELS
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_op_equals_the_masked_row_path_forward_and_backward(kernel: str, seed: int):
    cu = packed_cu_seqlens(seed)
    tokens = int(cu[-1])
    q, k, v = qkv(tokens, seed)
    expected = masked_attention(q, k, v, cu)
    got = ATTENTION[kernel](q, k, v, cu, ROW_LEN, 0.0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(got)
    for g, e in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@KERNELS
def test_op_keeps_half_precision_inputs_and_matches_fp32(kernel: str):
    cu = packed_cu_seqlens(3)
    q, k, v = qkv(int(cu[-1]), 3, torch.bfloat16)
    got = ATTENTION[kernel](q, k, v, cu, ROW_LEN, 0.0)
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


@KERNELS
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_forward_and_backward_use_one_mask(kernel: str, p: float):
    cu = packed_cu_seqlens(5)
    q, k, v = qkv(int(cu[-1]), 5)
    torch.manual_seed(11)
    out, _, rng_a, _ = forward_op(kernel)(q, k, v, cu, ROW_LEN, p)
    seed = seed_of(rng_a)
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


@pytest.mark.parametrize("backend", ["varlen", "varlen_cudnn"])
def test_varlen_model_trains_like_the_masked_model_on_static_packed_rows(backend: str):
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=32)
    batch = static_packed_batch(make_rows(np.random.default_rng(7), ROWS), 5, ROW_LEN, MAX_SEQS, MAX_PREDICTIONS)
    torch.manual_seed(0)
    masked = BertForPreTraining(cfg, "sdpa")
    varlen = BertForPreTraining(cfg, backend)
    varlen.load_state_dict(masked.state_dict())
    losses = []
    for model in (masked, varlen):
        loss = pretraining_loss(model(batch), batch).total
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for (name, a), b in zip(masked.named_parameters(), varlen.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


@KERNELS
def test_compile_keeps_each_direction_one_extern_op_in_one_graph(kernel: str):
    """A backend that keeps AOTAutograd's forward and backward graphs: one of each (no graph break: the op sits
    between two other ops, so a break anywhere on its way splits them), each calling its custom op once and no
    aten attention kernel (the op is not decomposed)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs: dict[str, list[list]] = {"forward": [], "backward": []}

    def keeping(direction: str):
        def compiler(gm: torch.fx.GraphModule, example_inputs: list) -> object:
            graphs[direction].append([n.target for n in gm.graph.nodes if n.op == "call_function"])
            return make_boxed_func(gm.forward)
        return compiler

    cu = packed_cu_seqlens(8)
    q, k, v = qkv(int(cu[-1]), 8)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c: ATTENTION[kernel](a * 2, b, c, cu, ROW_LEN, 0.0) + 1,
                             backend=aot_autograd(fw_compiler=keeping("forward"), bw_compiler=keeping("backward")))
    got = compiled(q, k, v)
    torch.testing.assert_close(got, masked_attention(q * 2, k, v, cu) + 1, rtol=1e-5, atol=1e-6)
    got.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    assert [len(graphs["forward"]), len(graphs["backward"])] == [1, 1], graphs
    for direction, graph in zip(graphs, (graphs["forward"][0], graphs["backward"][0])):
        op = getattr(torch.ops.mlperf_bert, f"varlen_{kernel}_{direction}").default
        assert graph.count(op) == 1, graph
        assert not [t for t in graph if "attention" in str(t) or "softmax" in str(t)], graph


@KERNELS
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_max_seqlen_exactly_the_longest_sequence_in_each_precision(kernel: str, dtype: torch.dtype, tolerance: float):
    """max_seqlen at its least (the longest sequence, 5 tokens; an empty one in the middle): output and gradients
    in the inputs' dtype, equal to the loop over sequences in fp32 to the dtype's rounding."""
    cu = torch.tensor([0, 3, 8, 8, 12], dtype=torch.int32)
    q, k, v = qkv(12, 9, dtype)
    got = ATTENTION[kernel](q, k, v, cu, 5, 0.0)
    grad = torch.randn(12, HEADS, DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = torch.autograd.grad(got, (q, k, v), grad)
    assert got.dtype == dtype and all(g.dtype == dtype for g in grads)
    exact = [x.detach().float().requires_grad_(True) for x in (q, k, v)]
    expected = autograd_attention(*exact, cu, None)
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)
    for g, e in zip(grads, torch.autograd.grad(expected, exact, grad.float())):
        torch.testing.assert_close(g.float(), e, rtol=tolerance, atol=tolerance)


# The kernels' forward and backward outputs as torch's CUDA code allocates them (flash: its meta functions;
# cuDNN, packed path: attention.cu, cudnn/MHA.cpp), for 7 tokens: (shape, dtype of q or a fixed one, strides).
KERNEL_OUTPUTS = {
    "flash": [((7, HEADS, DIM), None, (HEADS * DIM, DIM, 1)), ((HEADS, 7), torch.float32, (7, 1)),
              ((2,), torch.uint64, (1,)), ((), torch.uint64, ())],
    "cudnn": [((7, HEADS, DIM), None, (HEADS * DIM, DIM, 1)), ((7, HEADS, 1), torch.float32, (HEADS, 1, 1)),
              ((), torch.int64, ()), ((), torch.int64, ())],
}


@KERNELS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_outputs_have_the_kernels_shapes_dtypes_and_strides(kernel: str, dtype: torch.dtype):
    """The dry run counts the ops' bytes from their fake outputs and compile lays out buffers by them: they must be
    the kernel's, forward and backward, and the CPU path's too (flash's fake is the aten op's own meta function)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    backward_op = getattr(torch.ops.mlperf_bert, f"varlen_{kernel}_backward")

    def outputs(mode) -> list[tuple[torch.Size, torch.dtype, tuple[int, ...]]]:
        with mode:
            q, k, v = (torch.ones(7, HEADS, DIM, dtype=dtype) for _ in range(3))
            forward = forward_op(kernel)(q, k, v, cu, 4, 0.0)
            backward = backward_op(forward[0], q, k, v, forward[0], forward[1], cu, 4, 0.0, forward[2], forward[3])
        return [(t.shape, t.dtype, t.stride()) for t in (*forward, *backward)]

    real = outputs(contextlib.nullcontext())
    gradients = [((7, HEADS, DIM), dtype, (HEADS * DIM, DIM, 1))] * 3
    assert real == [(shape, kind or dtype, strides) for shape, kind, strides in KERNEL_OUTPUTS[kernel]] + gradients
    assert outputs(FakeTensorMode(allow_non_fake_inputs=True)) == real


class EmulatedKernels:
    """torch's GPU kernels on the CPU: each aten op's signature (as the ops call it) checked the way its CUDA code
    reads it, its outputs in its layouts, computed by the reference. Each forward draws a Philox-like (seed,
    offset) pair, and the dropout mask comes from both: a backward redraws the forward's mask only when handed
    that forward's pair."""

    def __init__(self) -> None:
        self.drawn: list[tuple[int, int]] = []

    def draw(self) -> tuple[int, int]:
        """A seed, and an offset that advances per call as Philox's does."""
        self.drawn.append((int(torch.randint(0, 2**40, (1,))), 16 * (len(self.drawn) + 1)))
        return self.drawn[-1]

    @staticmethod
    def mask_seed(seed: int, offset: int) -> int:
        return seed * 1_000_003 + offset

    @staticmethod
    def _lengths(cum_q: torch.Tensor, cum_k: torch.Tensor, max_q: int, max_k: int) -> None:
        assert cum_q.dtype == torch.int32 and torch.equal(cum_q, cum_k) and max_q == max_k  # self-attention

    def flash_forward(self, q, k, v, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, **kw):
        self._lengths(cum_q, cum_k, max_q, max_k)
        assert not is_causal and not return_debug_mask and not kw
        seed, offset = self.draw()
        out, lse = reference_attention(q, k, v, cum_q, max_q, dropout_p, self.mask_seed(seed, offset))
        rng_state = torch.tensor([seed, offset], dtype=torch.int64).to(torch.uint64)
        return out, lse, rng_state, torch.zeros((), dtype=torch.uint64), torch.empty(0, dtype=q.dtype)

    def flash_backward(self, grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal,
                       rng_state, unused, **kw):
        self._lengths(cum_q, cum_k, max_q, max_k)
        assert not is_causal and not kw and lse.shape == (q.shape[1], q.shape[0])
        seed, offset = rng_state.to(torch.int64).tolist()
        return reference_gradients(grad_out, q, k, v, cum_q, max_q, dropout_p, self.mask_seed(seed, offset))

    def cudnn_forward(self, q, k, v, attn_bias, cum_q, cum_k, max_q, max_k, compute_log_sumexp, dropout_p,
                      is_causal, return_debug_mask, **kw):
        self._lengths(cum_q, cum_k, max_q, max_k)
        assert attn_bias is None and compute_log_sumexp and not is_causal and not return_debug_mask and not kw
        seed, offset = self.draw()
        out, lse = reference_attention(q, k, v, cum_q, max_q, dropout_p, self.mask_seed(seed, offset))
        return (out, lse.transpose(0, 1).unsqueeze(-1).contiguous(), cum_q, cum_k, max_q, max_k,
                torch.tensor(seed), torch.tensor(offset), torch.empty(0))

    def cudnn_backward(self, grad_out, q, k, v, out, lse, philox_seed, philox_offset, attn_bias, cum_q, cum_k,
                       max_q, max_k, dropout_p, is_causal, **kw):
        self._lengths(cum_q, cum_k, max_q, max_k)
        assert attn_bias is None and not is_causal and not kw and lse.shape == (q.shape[0], q.shape[1], 1)
        seed = self.mask_seed(int(philox_seed), int(philox_offset))
        return reference_gradients(grad_out, q, k, v, cum_q, max_q, dropout_p, seed)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for kernel in ATTENTION:
            for direction in ("forward", "backward"):
                monkeypatch.setattr(torch.ops.aten, f"_{kernel}_attention_{direction}",
                                    getattr(self, f"{kernel}_{direction}"))
        monkeypatch.setattr(ops, "runs_kernel", lambda q: True)


@KERNELS
def test_gpu_kernel_calls_get_the_batchs_lengths_its_dropout_and_the_forwards_seed(kernel: str,
                                                                                  monkeypatch: pytest.MonkeyPatch):
    """The ops' GPU branch against emulated kernels: the output is the kernel's attention over the packed batch's
    sequences (empty ones in front, padding tails) under its dropout mask, and the gradients are taken under the
    same mask though another forward ran in between: the backward was handed its own forward's seed and offset."""
    kernels = EmulatedKernels()
    kernels.install(monkeypatch)
    cu = packed_cu_seqlens(10)
    q, k, v = qkv(int(cu[-1]), 10)
    p = 0.1
    out = ATTENTION[kernel](q, k, v, cu, ROW_LEN, p)
    drawn = kernels.drawn[-1]
    ATTENTION[kernel](*qkv(int(cu[-1]), 11), cu, ROW_LEN, p)  # the generator moves on
    keep = dropout_keep(EmulatedKernels.mask_seed(*drawn), cu, p)
    assert 0 < float((keep == 0).float().mean()) < 2 * p
    expected = autograd_attention(q, k, v, cu, keep)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    for g, e in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device, capability, precision, head_dim, dropout, cudnn, refused", [
    ("cpu", (9, 0), "bf16", 64, 0.1, 91002, " runs GPU kernels only (cuDNN's fused attention), and this run is on "
                                            "the cpu: use --attention_backend auto, sdpa or grouped"),
    ("cuda", (7, 9), "fp16", 64, 0.0, 91002, " needs a GPU of compute capability >= 8.0 (Ampere or newer), but "
                                             "NVIDIA X is 7.9"),
    ("cuda", (8, 0), "fp16", 64, 0.0, 90000, None),  # A100, cuDNN 9.0.0: both at their least
    ("cuda", (9, 0), "fp32", 64, 0.0, 91002, " takes fp16 / bf16 inputs, and --precision fp32 gives it fp32"),
    ("cuda", (9, 0), "bf16", 128, 0.0, 91002, None),
    ("cuda", (9, 0), "bf16", 136, 0.0, 91002, " takes head sizes up to 128 in steps of 8, and hidden_size / "
                                              "num_attention_heads of the BERT config is 136"),
    ("cuda", (9, 0), "bf16", 64, 0.0, None, " needs torch's cuDNN attention over packed sequences (cuDNN >= 9.0, "
                                            "aten._cudnn_attention_forward), and this torch"),
    ("cuda", (9, 0), "bf16", 64, 0.0, 8907, " needs torch's cuDNN attention"),
    # BERT's attention dropout 0.1 would be rounded: refused for training; 0.125 is 2/16; eval has none (0.0).
    ("cuda", (9, 0), "bf16", 64, 0.1, 91002, ": cuDNN's attention dropout comes in steps of 1/16 (torch's SDPA sends "
                                             "no other dropout to cuDNN), and attention_probs_dropout_prob of the "
                                             "BERT config is 0.1: use --attention_backend varlen (PyTorch's flash "
                                             "kernel) or auto"),
    ("cuda", (9, 0), "fp8", 64, 0.125, 91002, None),
])
def test_varlen_cudnn_start_up_checks_refuse_in_one_line_what_cannot_run(
        monkeypatch: pytest.MonkeyPatch, device: str, capability: tuple[int, int], precision: str, head_dim: int,
        dropout: float, cudnn: int | None, refused: str | None):
    """Each limit of torch's cuDNN attention at the value it names (and a value past it), on a GPU described to
    start-up; where cuDNN's kernel could run, `auto` still takes the flash one."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA X")
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: cudnn is not None)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: cudnn)
    monkeypatch.setattr(backends, "flash_kernel_available", lambda: True)  # as in every CUDA build
    monkeypatch.setattr(backends, "_flash_attn_varlen", lambda: None)
    needs = AttentionNeeds(torch.device(device, 0), precision, head_dim, dropout)
    problem = backend_problem("varlen_cudnn", needs)
    if refused is not None:
        assert problem is not None and problem.startswith("--attention_backend varlen_cudnn" + refused), problem
        assert "\n" not in problem
        return
    assert problem is None
    assert resolve_backend("auto", needs.device, dropout, 512, precision=precision, head_dim=head_dim) == "varlen"


# ---------------------------------------------------------------- GPU only: the kernels themselves


def _kernel_or_skip(kernel: str, dropout: float) -> None:
    """Skips where start-up would refuse the kernel on this GPU, naming why."""
    problem = backend_problem("varlen" if kernel == "flash" else "varlen_cudnn",
                              AttentionNeeds(torch.device("cuda"), "bf16", 64, dropout))
    if problem is not None:
        pytest.skip(problem)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cudnn_kernel_equals_the_flash_kernel_forward_and_backward_on_a_packed_batch():
    """Sequences longer than the head size, empty ones in front, bf16, no dropout: the two kernels agree."""
    _kernel_or_skip("cudnn", 0.0)
    _kernel_or_skip("flash", 0.0)
    lengths = [0, 0, 300, 212, 0, 512, 17, 495]
    cu = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(int(cu[-1]), 16, 64, device="cuda", generator=generator, dtype=torch.bfloat16)
               .requires_grad_(True) for _ in range(3))
    grad = torch.randn(int(cu[-1]), 16, 64, device="cuda", generator=generator, dtype=torch.bfloat16)
    results = []
    for attention in (varlen_flash, varlen_cudnn):
        out = attention(q, k, v, cu, 512, 0.0)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    for got, expected in zip(*results):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


def dropout_probe(kernel: str, p: float, device: str, sequences: int, heads: int) -> None:
    """q = k = 0 makes every probability of a sequence of n = 64 tokens 1/n, and v's one-hot rows (key j's
    value is e_j) make out[i, h, j] = keep[i, h, j] / (n (1 - p)): the output shows the kernel's mask. Its share
    of zeros is the dropout rate the kernel applied, and dV = sum over the queries of those entries (for
    grad_out = 1) only if the backward redrew the forward's mask."""
    n, dtype = 64, torch.bfloat16 if device == "cuda" else torch.float32
    cu = torch.arange(0, n * sequences + 1, n, dtype=torch.int32, device=device)
    q = torch.zeros(n * sequences, heads, n, device=device, dtype=dtype, requires_grad=True)
    k = torch.zeros_like(q, requires_grad=True)
    one_hot = torch.eye(n, device=device, dtype=dtype)[None, :, None, :]  # [1, key, 1, dim]
    v = one_hot.expand(sequences, n, heads, n).reshape(n * sequences, heads, n).clone().requires_grad_(True)
    out = ATTENTION[kernel](q, k, v, cu, n, p)
    dropped = float((out == 0).float().mean())
    spread = (p * (1 - p) / out.numel()) ** 0.5  # of the share of zeros, for independent draws
    assert abs(dropped - p) < 6 * spread, f"{kernel} dropped {dropped:.4f} of the probabilities for p = {p}"
    out.backward(torch.ones_like(out))
    seen = out.float().view(sequences, n, heads, n).sum(1).transpose(1, 2)  # [S, key, heads]: over the queries
    expected = seen[..., None].expand(sequences, n, heads, n).reshape(n * sequences, heads, n)
    torch.testing.assert_close(v.grad.float(), expected, rtol=2e-2, atol=2e-2)


@KERNELS
def test_the_dropout_probe_reads_the_emulated_kernels_mask(kernel: str, monkeypatch: pytest.MonkeyPatch):
    """The GPU test below on the emulated kernels: its reading of the mask and of the backward holds."""
    EmulatedKernels().install(monkeypatch)
    dropout_probe(kernel, 0.125, "cpu", sequences=8, heads=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernel, p", [("flash", 0.1), ("cudnn", 0.125)])
def test_the_kernels_dropout_rate_and_the_backward_redrawing_its_mask(kernel: str, p: float):
    """cuDNN at 2/16, a dropout start-up lets it take. BERT's 0.1 start-up refuses for cuDNN; the rate cuDNN applies
    to it is `dropout_probe("cudnn", 0.1, "cuda", 64, 16)`'s message."""
    _kernel_or_skip(kernel, p)
    dropout_probe(kernel, p, "cuda", sequences=64, heads=16)
