"""The FP8 output gradient in one pass (model/fp8_cast.py, model/fp8_kernels.py): the Triton kernel against
torch's ops through Triton's interpreter, compiled for sm_90 with whole-row stores, the op in the FP8
layer's backward, and the dry run's count of its bytes."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import REPO
from mlperf_bert.dryrun.inductor import single_pass_calls
from mlperf_bert.dryrun.kernels import EXTERN, FUSED_OP, Launch, with_op_bytes
from mlperf_bert.model import fp8_cast
from mlperf_bert.model.fp8_delayed import E5M2, GRAD, DelayedFp8Linear
from test_fused_optim import SM90, needs_triton, run_interpreted

WORKER = REPO / "tests" / "_fp8_kernels_worker.py"
OP = "mlperf_bert.fp8_grad_cast_transpose"


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, Any]:
    return run_interpreted(WORKER, tmp_path_factory.mktemp("fp8") / "results.json")


def test_the_kernel_gives_torchs_fp8_bytes_bias_gradient_and_amax(interpreted):
    """Every case (both formats, with and without GELU's derivative, saturating and subnormal scales, ragged
    tiles): both FP8 copies byte for byte, zero padding up to 16 tokens, the amax exactly, the bias gradient
    to fp32 summation order."""
    assert len(interpreted) == 6
    for name, result in interpreted.items():
        rows, cols = (int(n) for n in name.split()[0].split("x"))
        assert result["transposed_shape"] == [cols, fp8_cast.padded(rows)], name
        assert (result["rows_differ"], result["transposed_differ"], result["padding_not_zero"]) == (0, 0, 0), name
        assert result["amax_difference"] == 0.0 and result["bias_relative"] <= 1e-6, name


def test_the_kernel_compiles_for_the_gpu_with_rounded_conversions_and_whole_row_stores():
    """Compiled for sm_90 (no GPU needed): FP8 and bf16 conversions round to nearest (`cvt.rn`, saturating for
    FP8), and with 16-byte-aligned operands (Triton's specialisation of any launch on real tensors) every
    global load and store is 128 bits wide: no one-byte stores of the transposed copy."""
    needs_triton()
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mlperf_bert.model import fp8_kernels

    signature = {"grad": "*bf16", "pre": "*bf16", "scale": "*fp32", "out": "*fp8e5", "out_t": "*fp8e5",
                 "partials": "*fp32", "amax": "*fp32", "M": "i32", "N": "i32", "M_pad": "i32"}
    constants = dict(FP8_MAX=57344.0, GELU=True, OUT=tl.float8e5, ROUND=tl.bfloat16, BLOCK_M=fp8_kernels.BLOCK_M,
                     BLOCK_N=fp8_kernels.BLOCK_N)
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(signature))}
    source = ASTSource(fn=fp8_kernels.kernel().run, signature={**signature, **dict.fromkeys(constants, "constexpr")},
                       constexprs=constants, attrs=aligned)
    ptx = triton.compile(source, target=GPUTarget(*SM90), options={"num_warps": 4}).asm["ptx"]
    assert {"cvt.rn.satfinite.e5m2x2.f32", "cvt.rn.bf16.f32"} <= set(re.findall(r"cvt\.[\w.]+", ptx))
    stores = set(re.findall(r"\bst\.global\.[\w.]+", ptx))
    assert "st.global.v4.b32" in stores and not stores & {"st.global.b8", "st.global.b16", "st.global.v2.b8"}, stores
    assert not set(re.findall(r"\bld\.global\.[\w.]+", ptx)) - {"ld.global.v4.b32", "ld.global.b32"}


# ---------------------------------------------------------------- the op in the FP8 layer


def test_the_op_and_its_fake_give_the_same_shapes_and_the_reference_values():
    torch.manual_seed(0)
    grad, pre = torch.randn(17, 8, dtype=torch.bfloat16), torch.randn(17, 8, dtype=torch.bfloat16)
    got = torch.ops.mlperf_bert.fp8_grad_cast_transpose(grad, pre, torch.tensor(300.0), E5M2)
    want = fp8_cast.reference(grad, pre, torch.tensor(300.0), E5M2)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.float(), b.float())
    assert got[1].shape == (8, 32) and got[1][:, 17:].float().eq(0).all()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fakes = torch.ops.mlperf_bert.fp8_grad_cast_transpose(mode.from_tensor(grad), None, mode.from_tensor(
            torch.tensor(1.0)), E5M2)
    assert [(t.shape, t.dtype) for t in fakes] == [(t.shape, t.dtype) for t in want]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gelu_layer_equals_the_plain_layer_then_autograds_gelu(dtype):
    """FC1 with GELU inside (its backward applies GELU's derivative in its one pass) gives the same output,
    gradients and gradient amax as the plain FP8 layer followed by F.gelu, bit for bit, over two steps (the
    second scaled by the first's gradient amax)."""
    torch.manual_seed(3)
    base = nn.Linear(16, 48).to(dtype)
    fused, plain = DelayedFp8Linear.from_linear(base), DelayedFp8Linear.from_linear(nn.Linear(16, 48).to(dtype))
    plain.load_state_dict(fused.state_dict())
    for step in range(2):
        x = torch.randn(21, 16, dtype=dtype)
        grad = torch.randn(21, 48, dtype=dtype) * (1 + 5 * step)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1, y2 = fused(x1, gelu=True), F.gelu(plain(x2))
        y1.backward(grad)
        y2.backward(grad)
        assert torch.equal(y1, y2) and torch.equal(x1.grad, x2.grad)
        assert torch.equal(fused.weight.grad, plain.weight.grad) and torch.equal(fused.bias.grad, plain.bias.grad)
        assert float(fused.amax[GRAD]) == float(plain.amax[GRAD]) > 0
        for layer in (fused, plain):
            layer.zero_grad()


# ---------------------------------------------------------------- the dry run's bytes


def test_the_dry_run_counts_each_call_as_one_pass_over_its_operands():
    """From the graph's fake values: a gradient of 24 x 40 bf16 with its pre-activation is read once each
    (2 x 1,920 bytes) and the scale (4); written: 960 + 40 x 32 FP8 bytes, 160 of bias gradient, 4 of amax."""
    grad, pre = torch.randn(24, 40, dtype=torch.bfloat16), torch.randn(24, 40, dtype=torch.bfloat16)

    def f(g: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.ops.mlperf_bert.fp8_grad_cast_transpose(g, h, torch.ones(()), E5M2)

    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(f, tracing_mode="fake")(grad, pre)
    assert single_pass_calls(graph) == {OP: [2 * 1920 + 4 + 960 + 40 * 32 + 160 + 4]}


def test_single_pass_launches_become_fused_ops_and_a_count_mismatch_is_an_error():
    found = [Launch("mm", EXTERN, None, "gemm"), Launch(OP, EXTERN, None, "custom op"),
             Launch(OP, EXTERN, None, "custom op")]
    counted = with_op_bytes(found, {OP: [100, 7]})
    assert [(launch.kind, launch.bytes) for launch in counted] == [(EXTERN, None), (FUSED_OP, 100), (FUSED_OP, 7)]
    assert counted[1].elementwise and not counted[0].elementwise
    with pytest.raises(ValueError, match="more often"):
        with_op_bytes(found, {OP: [100]})
    with pytest.raises(ValueError, match="does not make"):
        with_op_bytes(found, {OP: [1, 2, 3]})
