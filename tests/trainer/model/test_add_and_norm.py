"""`bert.add_and_norm`: a LayerNorm of a residual sum whose sum is kept for the backward under torch.compile (the
partitioner would recompute it, and Inductor then makes the LayerNorm's backward in two kernels: the H200 step's
count is in tests/trainer/dryrun/test_compiled_step.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.decomposition import select_decomp_table

from mlperf_bert.model import bert
from mlperf_bert.model.attention import flat_layout
from mlperf_bert.model.bert import LayerNorm, add_and_norm


def _backward_ops(fn, *inputs: torch.Tensor) -> list[str]:
    """The ops of the backward graph that `fn` compiles to under the min-cut partitioner (Inductor's)."""
    seen: list[str] = []

    def forward_compiler(gm: torch.fx.GraphModule, _inputs: list) -> object:
        return make_boxed_func(gm.forward)

    def backward_compiler(gm: torch.fx.GraphModule, _inputs: list) -> object:
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler,
                           partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    out.float().sum().backward()
    return seen


def _inputs(dtype: torch.dtype) -> tuple[LayerNorm, torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    norm = LayerNorm(64, eps=1e-12)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.1, 0.1)
    residual = torch.randn(40, 64, dtype=dtype, requires_grad=True)
    update = (torch.randn(40, 64) * 3).to(dtype).requires_grad_()
    return norm, residual, update


def _layer_backward_adds(monkeypatch: pytest.MonkeyPatch, plain: bool) -> int:
    """The adds in the compiled backward of a small encoder layer (bf16 autocast, dropout on, as it trains)."""
    if plain:
        monkeypatch.setattr(bert, "add_and_norm", lambda norm, residual, update: norm(residual + update))
    torch.manual_seed(0)
    cfg = bert.BertConfig(vocab_size=101, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                          intermediate_size=256)
    layer = bert.BertLayer(cfg, "sdpa").to(torch.bfloat16).train()
    cu_seqlens = torch.tensor([0, 16, 32], dtype=torch.int32)
    layout = flat_layout(cu_seqlens, 16, 32)

    def step(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return layer(x, cu_seqlens, layout)

    ops = _backward_ops(step, torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True))
    monkeypatch.undo()
    return ops.count("aten.add.Tensor")


def test_compiled_the_first_layer_norms_input_is_saved_not_recomputed(monkeypatch):
    """Under Inductor's partitioner (min-cut, Inductor's decompositions) an encoder layer written with a plain
    `norm(residual + update)` recomputes the first LayerNorm's input in the backward (one add more); through
    `add_and_norm` the backward reads it saved."""
    assert _layer_backward_adds(monkeypatch, plain=False) == _layer_backward_adds(monkeypatch, plain=True) - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_values_and_gradients_are_eagers(dtype):
    """Compiled (the partitioned graphs run by aten) and eager give the same output and gradients, bit for bit, in
    fp32 and under bf16 autocast."""
    results = []
    for compiled in (False, True):
        norm, residual, update = copy.deepcopy(_inputs(dtype))
        fn = (lambda r, u: add_and_norm(norm, r, u))
        torch._dynamo.reset()
        run = torch.compile(fn, backend="aot_eager", fullgraph=True) if compiled else fn
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = run(residual, update)
        (out.float() * torch.linspace(-1, 1, 64)).sum().backward()
        results.append([out, residual.grad, update.grad, norm.weight.grad, norm.bias.grad])
    for got, want in zip(*results):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_under_the_cpus_autocast_the_layernorm_normalises_in_fp32_as_under_cudas():
    """CUDA's autocast runs layer_norm in fp32 and the CPU's in bf16 (weight and bias rounded too); `LayerNorm`
    normalises in fp32 on both, the result rounded once: under the CPU's autocast its output and all three
    gradients equal an fp32 LayerNorm's, bit for bit (the CPU's own bf16 one is 10 % off fp32 in its weight
    gradient: a CPU step would not be the GPU's)."""
    torch.manual_seed(3)
    norm = LayerNorm(64, eps=1e-12)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    reference = copy.deepcopy(norm)
    x = (torch.randn(40, 64) * 3 + 1).to(torch.bfloat16)
    grad = torch.randn(40, 64).to(torch.bfloat16)
    got_x, want_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = norm(got_x)
    want = torch.nn.functional.layer_norm(want_x.float(), (64,), reference.weight, reference.bias, 1e-12)
    want = want.to(torch.bfloat16)
    got.backward(grad)
    want.backward(grad)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want) and torch.equal(got_x.grad, want_x.grad)
    assert torch.equal(norm.weight.grad, reference.weight.grad) and torch.equal(norm.bias.grad, reference.bias.grad)
