"""The FP8 output gradient in one pass (model/fp8_cast.py, model/fp8_kernels.py): the Triton kernel against
torch's ops through Triton's interpreter, compiled for sm_90 with whole-row stores, the op in the FP8
layer's backward, and the dry run's count of its bytes."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mlperf_bert.dryrun.inductor import single_pass_calls
from mlperf_bert.dryrun.kernels import EXTERN, FUSED_OP, Launch, with_op_bytes
from mlperf_bert.model import fp8_cast
from mlperf_bert.model.fp8_delayed import E5M2, GRAD, DelayedFp8Linear, delayed_fp8_mlp
from tests.harness.fp8_bert import NO_DROPOUT, random_batch
from tests.harness.triton_interpreter import SM90, needs_triton, run_interpreted

WORKER = "tests.harness.workers.fp8_kernels"
OP = "mlperf_bert.fp8_grad_cast_transpose"


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, Any]:
    return run_interpreted(WORKER, tmp_path_factory.mktemp("fp8") / "results.json")


def test_the_kernel_gives_torchs_fp8_bytes_bias_gradient_and_amax(interpreted):
    """Every case (both formats, with and without GELU's derivative, saturating and subnormal scales, ragged
    tiles, the gradient given as 2 or 3 parts read in place): both FP8 copies byte for byte, zero padding up to
    16 tokens, the amax exactly, the bias gradient to fp32 summation order."""
    assert len(interpreted["gradients"]) == 8
    for name, result in interpreted["gradients"].items():
        rows, cols = (int(n) for n in name.split()[0].split("x"))
        assert result["transposed_shape"] == [cols, fp8_cast.padded(rows)], name
        assert (result["rows_differ"], result["transposed_differ"], result["padding_not_zero"]) == (0, 0, 0), name
        assert result["amax_difference"] == 0.0 and result["bias_relative"] <= 1e-6, name


def test_the_kernel_gives_torchs_fp8_bytes_and_amax_of_gelu_in_the_forward(interpreted):
    """FC1's output through GELU (rounded to its dtype, as F.gelu), cast to E4M3: both copies byte for byte,
    zero padding, the amax exactly; no column sums (the forward asks for none)."""
    assert len(interpreted["gelu"]) == 3
    for name, result in interpreted["gelu"].items():
        rows, cols = (int(n) for n in name.split()[0].split("x"))
        assert result["transposed_shape"] == [cols, fp8_cast.padded(rows)], name
        assert (result["rows_differ"], result["transposed_differ"], result["padding_not_zero"]) == (0, 0, 0), name
        assert result["amax_difference"] == 0.0 and result["no_sums"], name


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

    variants = [(fp8_kernels.DGELU, True, 1, tl.float8e5, "fp8e5", "e5m2"),  # a gradient, GELU's derivative
                (fp8_kernels.NONE, True, 3, tl.float8e5, "fp8e5", "e5m2"),  # the query, key and value gradients
                (fp8_kernels.GELU, False, 1, tl.float8e4nv, "fp8e4nv", "e4m3")]  # FC2's input
    for act, sums, parts, fp8, pointer, conversion in variants:
        signature = {"x": "*bf16", "x1": "*bf16", "x2": "*bf16", "pre": "*bf16", "scale": "*fp32",
                     "out": f"*{pointer}", "out_t": f"*{pointer}", "partials": "*fp32", "amax": "*fp32",
                     "M": "i32", "N": "i32", "M_pad": "i32", "WIDTH": "i32"}
        aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(signature))}
        constants = dict(FP8_MAX=448.0, ACT=act, SUMS=sums, PARTS=parts, OUT=fp8, ROUND=tl.bfloat16,
                         BLOCK_M=fp8_cast.TILE_M, BLOCK_N=fp8_cast.TILE_N)
        source = ASTSource(fn=fp8_kernels.kernel(fp8_cast.TILE_M, fp8_cast.TILE_N).run, constexprs=constants,
                           attrs=aligned, signature={**signature, **dict.fromkeys(constants, "constexpr")})
        ptx = triton.compile(source, target=GPUTarget(*SM90), options={"num_warps": 4}).asm["ptx"]
        rounded = {f"cvt.rn.satfinite.{conversion}x2.f32"} | ({"cvt.rn.bf16.f32"} if act != fp8_kernels.NONE else set())
        assert rounded <= set(re.findall(r"cvt\.[\w.]+", ptx))
        stores = set(re.findall(r"\bst\.global\.[\w.]+", ptx))
        assert "st.global.v4.b32" in stores and not stores & {"st.global.b8", "st.global.b16", "st.global.v2.b8"}
        assert not set(re.findall(r"\bld\.global\.[\w.]+", ptx)) - {"ld.global.v4.b32", "ld.global.b32"}


# ---------------------------------------------------------------- the op in the FP8 layer


def test_the_op_and_its_fake_give_the_same_shapes_and_the_reference_values():
    torch.manual_seed(0)
    grad, pre = torch.randn(17, 8, dtype=torch.bfloat16), torch.randn(17, 8, dtype=torch.bfloat16)
    got = torch.ops.mlperf_bert.fp8_grad_cast_transpose([grad], pre, torch.tensor(300.0), E5M2)
    want = fp8_cast.reference([grad], pre, torch.tensor(300.0), E5M2)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.float(), b.float())
    assert got[1].shape == (8, 32) and got[1][:, 17:].float().eq(0).all()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fakes = torch.ops.mlperf_bert.fp8_grad_cast_transpose([mode.from_tensor(grad)], None, mode.from_tensor(
            torch.tensor(1.0)), E5M2)
    assert [(t.shape, t.dtype) for t in fakes] == [(t.shape, t.dtype) for t in want]


def test_parts_are_read_in_place_only_where_every_tile_lies_in_one_part():
    """The kernel reads a part per tile: parts of one shape whose width is a multiple of the tile's, at most
    3, no GELU; anything else is concatenated first, in the graph (the dry run then counts the copy)."""
    def parts(*widths: int, rows: int = 8) -> list[torch.Tensor]:
        return [torch.zeros(rows, w) for w in widths]

    assert fp8_cast.read_in_parts(parts(1024, 1024, 1024), None) and fp8_cast.read_in_parts(parts(64, 64), None)
    assert fp8_cast.read_in_parts(parts(100), torch.zeros(8, 100))  # one part: anything
    assert not fp8_cast.read_in_parts(parts(96, 96, 96), None)  # 96 is not a multiple of 64
    assert not fp8_cast.read_in_parts(parts(64, 128), None) and not fp8_cast.read_in_parts(parts(64, 64, 64, 64), None)
    assert not fp8_cast.read_in_parts(parts(64, 64), torch.zeros(8, 128))
    assert fp8_cast.read_in_parts(parts(32, 32), None, tile=16)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fp8_mlp_equals_fc1_gelu_and_fc2_apart(dtype):
    """FC1, GELU and FC2 in one function (FC2's FP8 input and its transposed copy from one pass over FC1's
    output, saved for the backward) give the same output, gradients and both layers' amax histories as the two
    layers apart, bit for bit, over three steps (the first calibrates, the next scale by the history)."""
    torch.manual_seed(4)
    first, second = nn.Linear(16, 64).to(dtype), nn.Linear(64, 16).to(dtype)
    fused = [DelayedFp8Linear.from_linear(copy.deepcopy(m)) for m in (first, second)]
    apart = [DelayedFp8Linear.from_linear(copy.deepcopy(m)) for m in (first, second)]
    for step in range(3):
        x = torch.randn(19, 16, dtype=dtype) * (1 + step)
        grad = torch.randn(19, 16, dtype=dtype)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1, y2 = delayed_fp8_mlp(fused[0], fused[1], x1), apart[1](apart[0](x2, gelu=True))
        y1.backward(grad)
        y2.backward(grad)
        assert torch.equal(y1, y2) and torch.equal(x1.grad, x2.grad), step
        for a, b in zip(fused, apart):
            assert torch.equal(a.weight.grad, b.weight.grad) and torch.equal(a.bias.grad, b.bias.grad), step
            assert torch.equal(a.amax, b.amax)
            assert (a.calibrated, a.grad_calibrated) == (b.calibrated, b.grad_calibrated)
            a.zero_grad()
            b.zero_grad()
    with torch.no_grad():  # an eval forward: the same output, the histories untouched
        before = [m.amax.clone() for m in fused]
        assert torch.equal(delayed_fp8_mlp(fused[0], fused[1], x), apart[1](apart[0](x, gelu=True)))
        assert all(torch.equal(m.amax, b) for m, b in zip(fused, before))


def test_each_encoder_layer_runs_the_fp8_mlp_unless_a_hook_watches_its_ffn(monkeypatch):
    """Training runs the MLP function in every layer; with a hook on the FFN (the numerics check's) the layer
    runs FC1 + GELU and FC2 apart (the same values: the test above), and the hook sees GELU's output."""
    from mlperf_bert.model import bert
    from mlperf_bert.model.fp8 import Fp8Recipe, convert_to_fp8

    calls: list[int] = []
    monkeypatch.setattr(bert, "delayed_fp8_mlp", lambda *args: calls.append(1) or delayed_fp8_mlp(*args))
    torch.manual_seed(0)
    model = convert_to_fp8(bert.BertForPreTraining(NO_DROPOUT), torch.device("cpu"), Fp8Recipe("delayed"))
    batch = random_batch(1, 4, 16)
    model(batch)
    assert len(calls) == NO_DROPOUT.num_hidden_layers
    seen: list[torch.Tensor] = []
    model.bert.encoder.layer[1].intermediate.register_forward_hook(lambda m, args, out: seen.append(out))
    model(batch)
    assert len(calls) == 2 * NO_DROPOUT.num_hidden_layers - 1 and len(seen) == 1


# ---------------------------------------------------------------- the dry run's bytes


def test_the_dry_run_counts_each_call_as_one_pass_over_its_operands():
    """From the graph's fake values: a gradient of 24 x 40 bf16 with its pre-activation is read once each
    (2 x 1,920 bytes) and the scale (4); written: 960 + 40 x 32 FP8 bytes, 160 of bias gradient, 4 of amax."""
    grad, pre = torch.randn(24, 40, dtype=torch.bfloat16), torch.randn(24, 40, dtype=torch.bfloat16)

    def f(g: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.ops.mlperf_bert.fp8_grad_cast_transpose([g], h, torch.ones(()), E5M2)

    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(f, tracing_mode="fake")(grad, pre)
    assert single_pass_calls(graph) == {OP: [2 * 1920 + 4 + 960 + 40 * 32 + 160 + 4]}

    def parts(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.ops.mlperf_bert.fp8_grad_cast_transpose([a, b, c], None, torch.ones(()), E5M2)

    three = [torch.randn(24, 64, dtype=torch.bfloat16) for _ in range(3)]  # each part read once: 3 x 3,072 bytes
    graph = make_fx(parts, tracing_mode="fake")(*three)
    assert single_pass_calls(graph) == {OP: [3 * 3072 + 4 + 24 * 192 + 192 * 32 + 192 * 4 + 4]}


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
