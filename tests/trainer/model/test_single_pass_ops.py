"""The single-pass ops (model/fp8_cast.py, model/fused_linear.py, their kernel model/fp8_kernels.py): the Triton
kernel against torch's ops through Triton's interpreter and compiled for sm_90 with whole-row stores, the ops
in the FP8 and bf16 layers (the same values as the layers without them), and the dry run's count of their
bytes."""

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
from mlperf_bert.model.fused_linear import linear_gelu, split_linear
from tests.harness.fp8_bert import NO_DROPOUT, random_batch
from tests.harness.triton_interpreter import SM90, needs_triton, run_interpreted

WORKER = "tests.harness.workers.single_pass"
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


@pytest.mark.parametrize("part", ["gelu", "cast"])
def test_the_kernel_gives_torchs_fp8_bytes_and_amax_of_the_forwards_operands(interpreted, part):
    """FC1's output through GELU (rounded to its dtype, as F.gelu) and a layer's input (bf16, fp16, fp32), cast to
    E4M3 with the transposed copy dW reads: both copies byte for byte, zero padding, the amax exactly; no column
    sums (the forward asks for none)."""
    assert len(interpreted[part]) == 3
    for name, result in interpreted[part].items():
        rows, cols = (int(n) for n in name.split()[0].split("x"))
        assert result["transposed_shape"] == [cols, fp8_cast.padded(rows)], name
        assert (result["rows_differ"], result["transposed_differ"], result["padding_not_zero"]) == (0, 0, 0), name
        assert result["amax_difference"] == 0.0 and result["no_sums"], name


def test_the_kernel_casts_a_weight_given_as_stacked_parts_where_they_are(interpreted):
    """An fp32 weight as 3, 2 or 1 row-wise parts (the query, key and value weights), each 16 rows high (the
    interpreter's tile): both E4M3 copies byte for byte with torch's cast of the stacked weight, the amax exactly."""
    assert len(interpreted["weight"]) == 3
    for name, result in interpreted["weight"].items():
        rows, cols = sum(int(h) for h in name.split("x")[0].split("+")), int(name.split("x")[1])
        assert result["transposed_shape"] == [cols, rows], name
        assert (result["rows_differ"], result["transposed_differ"], result["amax_difference"]) == (0, 0, 0.0), name


def test_the_norm_kernel_gives_layernorms_backward_and_the_fp8_operands_of_the_layer_before_it(interpreted):
    """LayerNorm's backward and the FP8 operands of the layer whose output reached it through dropout, with 0, 0.1
    and 0.5 dropped, bf16 and fp32: dS in its dtype within a last-place unit of torch's (a row is summed in another
    order), both FP8 copies within one FP8 step where a rounded value moved, zero padding, the bias, LayerNorm
    weight and bias gradients and the amax to fp32 summation order."""
    assert len(interpreted["norm"]) == 3
    for name, result in interpreted["norm"].items():
        rows, cols = (int(n) for n in name.split()[0].split("x"))
        fp32 = name.endswith("float32")
        assert result["ds_dtype"] == ("torch.float32" if fp32 else "torch.bfloat16"), name
        assert result["ds_max_ulps"] <= (64 if fp32 else 1), name
        assert result["fp8_differ"] <= max(result["ds_differ"], 1) and result["fp8_largest_relative_step"] <= 0.25, name
        assert result["transposed_shape"] == [cols, fp8_cast.padded(rows)], name
        assert result["transposed_equal"] and result["padding_not_zero"] == 0, name
        assert max(result[k] for k in ("bias_relative", "gamma_relative", "beta_relative")) <= 1e-5, name
        assert result["amax_relative"] <= 1e-2, name


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

    variants = [  # ACT, SUMS, PARTS, STACKED, FP8, the input's and the output's pointer types, the output's Triton
        # type, the conversion it rounds with
        # FC1's gradient, the QKV gradients, FC2's input, the QKV weights, a bf16 FC1's gradient
        (fp8_kernels.DGELU, True, 1, False, True, "bf16", "fp8e5", tl.float8e5, "cvt.rn.satfinite.e5m2x2.f32"),
        (fp8_kernels.NONE, True, 3, False, True, "bf16", "fp8e5", tl.float8e5, "cvt.rn.satfinite.e5m2x2.f32"),
        (fp8_kernels.GELU, False, 1, False, True, "bf16", "fp8e4nv", tl.float8e4nv, "cvt.rn.satfinite.e4m3x2.f32"),
        (fp8_kernels.NONE, False, 3, True, True, "fp32", "fp8e4nv", tl.float8e4nv, "cvt.rn.satfinite.e4m3x2.f32"),
        (fp8_kernels.DGELU, True, 1, False, False, "bf16", "bf16", tl.bfloat16, "cvt.rn.bf16.f32")]
    for act, sums, parts, stacked, fp8, given, pointer, out, conversion in variants:
        signature = {"x": f"*{given}", "x1": f"*{given}", "x2": f"*{given}", "pre": f"*{given}", "scale": "*fp32",
                     "out": f"*{pointer}", "out_t": f"*{pointer}", "partials": "*fp32", "amax": "*fp32",
                     "M": "i32", "N": "i32", "M_pad": "i32", "WIDTH": "i32"}
        aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(signature))}
        constants = dict(FP8_MAX=448.0, ACT=act, SUMS=sums, PARTS=parts, STACKED=stacked, FP8=fp8, OUT=out,
                         ROUND=tl.float32 if given == "fp32" else tl.bfloat16, BLOCK_M=fp8_cast.TILE_M,
                         BLOCK_N=fp8_cast.TILE_N)
        source = ASTSource(fn=fp8_kernels.kernel(fp8_cast.TILE_M, fp8_cast.TILE_N).run, constexprs=constants,
                           attrs=aligned, signature={**signature, **dict.fromkeys(constants, "constexpr")})
        ptx = triton.compile(source, target=GPUTarget(*SM90), options={"num_warps": 4}).asm["ptx"]
        rounded = {conversion} | ({"cvt.rn.bf16.f32"} if act != fp8_kernels.NONE else set())
        assert rounded <= set(re.findall(r"cvt\.[\w.]+", ptx)), conversion
        stores = set(re.findall(r"\bst\.global\.[\w.]+", ptx))
        assert "st.global.v4.b32" in stores and not stores & {"st.global.b8", "st.global.b16", "st.global.v2.b8"}
        assert not set(re.findall(r"\bld\.global\.[\w.]+", ptx)) - {"ld.global.v4.b32", "ld.global.b32"}
        assert ("atom.global" in ptx) == fp8  # the amax: FP8 outputs only


def test_the_norm_kernel_compiles_for_the_gpu_with_rounded_conversions_and_no_byte_stores():
    """The LayerNorm-backward kernel at the ops' tile, for sm_90: dS rounds to bf16 and G to E5M2 to nearest
    (saturating), and no store is narrower than 32 bits (the transposed FP8 copy in whole 16-byte rows)."""
    needs_triton()
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mlperf_bert.model import fp8_kernels

    signature = {"dy": "*bf16", "s": "*bf16", "mean": "*fp32", "rstd": "*fp32", "gamma": "*fp32", "keep": "*i1",
                 "scale": "*fp32", "ds_out": "*bf16", "out": "*fp8e5", "out_t": "*fp8e5", "partials": "*fp32",
                 "norm_partials": "*fp32", "amax": "*fp32", "M": "i32", "N": "i32", "M_pad": "i32", "DROP_SCALE": "fp32"}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(signature) - 1)}
    constants = dict(FP8_MAX=57344.0, OUT=tl.float8e5, ROUND=tl.bfloat16, BLOCK_M=fp8_cast.NORM_ROWS,
                     BLOCK_N=fp8_cast.NORM_COLUMNS)
    source = ASTSource(fn=fp8_kernels.norm_kernel(fp8_cast.NORM_ROWS, fp8_cast.NORM_COLUMNS).run,
                       constexprs=constants, attrs=aligned,
                       signature={**signature, **dict.fromkeys(constants, "constexpr")})
    ptx = triton.compile(source, target=GPUTarget(*SM90), options={"num_warps": 4}).asm["ptx"]
    assert {"cvt.rn.bf16.f32", "cvt.rn.satfinite.e5m2x2.f32"} <= set(re.findall(r"cvt\.[\w.]+", ptx))
    stores = set(re.findall(r"\bst\.global\.[\w.]+", ptx))
    assert "st.global.v4.b32" in stores and not stores & {"st.global.b8", "st.global.b16", "st.global.v2.b8"}


def test_the_kernel_gives_a_bf16_layers_gradient_and_bias_gradient_in_one_pass(interpreted):
    """Without FP8 outputs (the bf16 layers' pass): the gradient in its own dtype, equal to torch's (the query,
    key and value gradients concatenated exactly; through GELU's derivative within one unit in the last place:
    the interpreter's erf and exp are not torch's), and its column sums."""
    assert len(interpreted["bf16"]) == 4
    for name, result in interpreted["bf16"].items():
        gelu = "gelu=True" in name
        assert result["dtype_kept"] and result["max_ulps"] <= (1 if gelu else 0), name
        assert result["sums_relative"] <= (1e-4 if gelu else 1e-6), name


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
    x = torch.randn(17, 8, dtype=torch.bfloat16)
    got = torch.ops.mlperf_bert.fp8_cast_transpose(x, torch.tensor(100.0), torch.float8_e4m3fn)
    want = fp8_cast.cast_reference(x, torch.tensor(100.0), torch.float8_e4m3fn)
    assert all(a.dtype == b.dtype and torch.equal(a.float(), b.float()) for a, b in zip(got, want))
    assert torch.equal(got[1].t()[:17].float(), got[0].float()) and got[1][:, 17:].float().eq(0).all()
    with FakeTensorMode() as mode:
        fakes = torch.ops.mlperf_bert.fp8_cast_transpose(mode.from_tensor(x), mode.from_tensor(torch.tensor(1.0)),
                                                         torch.float8_e4m3fn)
    assert [(t.shape, t.dtype) for t in fakes] == [(t.shape, t.dtype) for t in want]


def _weight_and_norm_samples() -> dict[str, tuple]:
    torch.manual_seed(1)
    weights = [torch.randn(16, 8) * 0.1 for _ in range(3)]
    s, dy = torch.randn(17, 8, dtype=torch.bfloat16), torch.randn(17, 8, dtype=torch.bfloat16)
    gamma = torch.rand(8) + 0.5
    _, mean, rstd = torch.native_layer_norm(s.float(), [8], gamma, torch.zeros(8), 1e-12)
    keep = torch.rand(17, 8) > 0.1
    return {"fp8_weight_cast_transpose": (weights, torch.tensor(900.0), torch.float8_e4m3fn),
            "fp8_norm_grad_cast_transpose": (dy, s, mean, rstd, gamma, keep, 1 / 0.9, torch.tensor(3e3), E5M2)}


@pytest.mark.parametrize("name", ["fp8_weight_cast_transpose", "fp8_norm_grad_cast_transpose"])
def test_the_weight_and_norm_ops_pass_torchs_op_checks_and_give_their_references_values(name):
    """torch.library.opcheck (the schema, the fake against the real op, AOT dispatch with dynamic shapes) and the
    op's values equal its reference's: the stacked weight's copies (W8T the transpose of W8), the LayerNorm
    backward's seven outputs."""
    args = _weight_and_norm_samples()[name]
    op = getattr(torch.ops.mlperf_bert, name).default
    torch.library.opcheck(op, args)
    got = op(*args)
    want = fp8_cast.weight_reference(*args) if name.startswith("fp8_weight") else fp8_cast.norm_grad_reference(*args)
    assert len(got) == len(want) and all(a.dtype == b.dtype and torch.equal(a.float(), b.float())
                                         for a, b in zip(got, want))
    if name.startswith("fp8_weight"):
        assert got[0].shape == (48, 8) and torch.equal(got[1].t().float(), got[0].float())


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


@pytest.mark.parametrize("drop_p", [0.0, 0.3])
def test_the_fp8_mlp_with_the_layers_end_equals_the_mlp_then_dropout_and_layernorm(drop_p):
    """The MLP function with the encoder layer's end (dropout, the residual sum, LayerNorm in fp32 rounded once,
    as CUDA's autocast runs `bert.LayerNorm`) gives the same output, input gradient, FC1 and FC2 gradients and
    histories as the MLP function then those ops, bit for bit, over three steps; the LayerNorm's weight and bias
    gradients to fp32 summation order. The same seed draws the same dropout mask in both."""
    torch.manual_seed(4)
    first, second, norm = nn.Linear(16, 64), nn.Linear(64, 16), nn.LayerNorm(16, eps=1e-12)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.2, 0.2)
    fused = [DelayedFp8Linear.from_linear(copy.deepcopy(m)) for m in (first, second)] + [copy.deepcopy(norm)]
    apart = [DelayedFp8Linear.from_linear(copy.deepcopy(m)) for m in (first, second)] + [copy.deepcopy(norm)]

    def after(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
        dropped = torch.native_dropout(delayed_fp8_mlp(layers[0], layers[1], x), drop_p, True)[0]
        return F.layer_norm((x + dropped).float(), (16,), layers[2].weight, layers[2].bias, 1e-12).to(x.dtype)

    for step in range(3):
        x = (torch.randn(19, 16) * (1 + step)).to(torch.bfloat16)
        grad = torch.randn(19, 16).to(torch.bfloat16)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.manual_seed(10 + step)
        y1 = delayed_fp8_mlp(fused[0], fused[1], x1, fused[2], drop_p)
        torch.manual_seed(10 + step)
        y2 = after(apart, x2)
        y1.backward(grad)
        y2.backward(grad)
        assert y1.dtype == torch.bfloat16 and torch.equal(y1, y2) and torch.equal(x1.grad, x2.grad), step
        for a, b in zip(fused[:2], apart[:2]):
            assert torch.equal(a.weight.grad, b.weight.grad) and torch.equal(a.bias.grad, b.bias.grad), step
            assert torch.equal(a.amax, b.amax)
        torch.testing.assert_close(fused[2].weight.grad, apart[2].weight.grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fused[2].bias.grad, apart[2].bias.grad, rtol=1e-6, atol=1e-6)
        for a, b in zip(fused, apart):
            a.zero_grad()
            b.zero_grad()


def test_the_fp8_mlp_refuses_a_layers_end_without_the_layernorms_weight_and_bias():
    """A LayerNorm without weight and bias would leave the function nothing to tell its end by: refused."""
    fc1, fc2 = (DelayedFp8Linear.from_linear(nn.Linear(*shape)) for shape in ((16, 64), (64, 16)))
    with pytest.raises(ValueError, match="elementwise_affine=True"):
        delayed_fp8_mlp(fc1, fc2, torch.randn(4, 16), nn.LayerNorm(16, elementwise_affine=False), 0.1)


def test_each_encoder_layer_runs_the_fp8_mlp_unless_a_hook_watches_its_ffn(monkeypatch):
    """Training runs the MLP function in every layer; with a hook on the FFN (the numerics check's) the layer
    runs FC1 + GELU and FC2 apart (the same values: the test above), and the hook sees GELU's output."""
    from mlperf_bert.model import bert
    from mlperf_bert.model.fp8 import Fp8Recipe, convert_to_fp8

    calls: list[bool] = []  # per call, whether the layer's end ran in it
    monkeypatch.setattr(bert, "delayed_fp8_mlp", lambda *args: calls.append(len(args) > 3) or delayed_fp8_mlp(*args))
    torch.manual_seed(0)
    model = convert_to_fp8(bert.BertForPreTraining(NO_DROPOUT), torch.device("cpu"), Fp8Recipe("delayed"))
    batch = random_batch(1, 4, 16)
    layers = NO_DROPOUT.num_hidden_layers
    model(batch)
    assert calls == [True] * layers  # a training forward: the layer's end in the function too
    with torch.no_grad():  # an eval forward: the end after the function, no dropout drawn in it
        model(batch)
    assert calls == [True] * layers + [False] * layers
    del calls[:]
    seen: list[torch.Tensor] = []
    model.bert.encoder.layer[1].intermediate.register_forward_hook(lambda m, args, out: seen.append(out))
    model(batch)
    assert len(calls) == layers - 1 and len(seen) == 1
    model.bert.encoder.layer[0].output.LayerNorm.register_forward_hook(lambda m, args, out: seen.append(out))
    model(batch)  # a hook on the layer's LayerNorm: the end after the function, where the hook sees its output
    assert calls[layers - 1:] == [False] + [True] * (layers - 2) and len(seen) == 3


# ---------------------------------------------------------------- the bf16 layers


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_fused_linears_equal_torchs_layers(precision):
    """FC1 + GELU and the stacked QKV layer as `fused_linear`'s functions give torch's outputs and gradients bit
    for bit, under autocast (bf16: the bias gradient rounded to bf16, as autocast's linear gives it; the input
    in bf16, as the encoder's LayerNorms give it) and in fp32."""
    torch.manual_seed(5)
    fc1, qkv = nn.Linear(16, 64), nn.Linear(16, 3 * 64)
    enabled = precision == "bf16"
    x = torch.randn(23, 16, dtype=torch.bfloat16 if enabled else torch.float32)
    results = []
    for fused in (True, False):
        layers = copy.deepcopy((fc1, qkv))
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            if fused:
                y = linear_gelu(layers[0], xi)
                q, k, v = split_linear(layers[1].weight, layers[1].bias, xi, (64, 64, 64))
            else:
                y = F.gelu(layers[0](xi))
                q, k, v = layers[1](xi).split(64, dim=-1)
            loss = (y.float() * 1.5).sum() + (q.float() * k.float()).sum() + v.float().square().sum()
        loss.backward()
        results.append([y, q, k, v, xi.grad] + [p.grad for layer in layers for p in layer.parameters()])
    for got, want in zip(*results):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_on_cuda_the_weight_gradient_is_the_gemms_fp32_accumulator():
    """Traced on the fake CUDA device, a bf16 layer's weight gradient is one GEMM writing fp32 (`mm(out_dtype=)`):
    no bf16 product and no conversion after it; on the CPU, torch's bf16 product converted, as autocast gives it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from mlperf_bert.model.fused_linear import weight_gradient

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with FakeTensorMode(), Ops() as ops:
        g = torch.empty(48, 32, dtype=torch.bfloat16, device="cuda")
        x = torch.empty(48, 16, dtype=torch.bfloat16, device="cuda")
        grad_w = weight_gradient(g, x, torch.float32)
    assert grad_w.dtype == torch.float32 and grad_w.shape == (32, 16)
    assert [op for op in ops.seen if "mm" in op or "copy" in op or "convert" in op] == ["aten.mm.dtype"]
    g, x = torch.randn(48, 32, dtype=torch.bfloat16), torch.randn(48, 16, dtype=torch.bfloat16)
    assert torch.equal(weight_gradient(g, x, torch.float32), (g.t() @ x).float())


@pytest.mark.parametrize("fp8", [False, True])
def test_the_token_count_stays_symbolic_through_the_compiled_backward(fp8):
    """Under torch.compile with dynamic shapes (the unpadded layout: a token count per batch) the functions'
    forward and backward, the op calls included, trace once for every count: nothing in them specialises the
    graph to one (a recompile each batch). Both layers in one compiled module too, as an encoder layer holds
    four: a module-level float read by the FP8 scale made the second layer's function stop Dynamo (an
    assertion in its tracer)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(6)
    fc1, qkv = nn.Linear(16, 64), nn.Linear(16, 3 * 64)
    if fp8:
        fc1, qkv = DelayedFp8Linear.from_linear(fc1), DelayedFp8Linear.from_linear(qkv)
        fc1(torch.randn(8, 16), gelu=True).sum().backward()  # calibrated: the steady state's graph
        qkv(torch.randn(8, 16)).sum().backward()

    class Ffn(nn.Module):  # compiled as the trainer compiles its layers: a module holding the layer
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = fc1

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.fc1(x, gelu=True) if fp8 else linear_gelu(self.fc1, x)).sum()

    class Qkv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = qkv

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            blocks = (DelayedFp8Linear.split_outputs(self.qkv, [self.qkv.weight], self.qkv.bias, x, (64, 64, 64)) if fp8
                      else split_linear(self.qkv.weight, self.qkv.bias, x, (64, 64, 64)))
            return (blocks[0] * blocks[1]).sum() + blocks[2].square().sum()

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ffn, self.qkv = Ffn(), Qkv()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.ffn(x) + self.qkv(x)

    for module in (Ffn(), Qkv(), Both()):
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(module, backend=counter, dynamic=True)
        for tokens in (21, 37, 50):
            compiled(torch.randn(tokens, 16, requires_grad=True)).backward()
        assert counter.frame_count == 1, type(module).__name__


def test_the_bf16_ffn_runs_the_fused_function_unless_a_hook_watches_its_dense_layer(monkeypatch):
    from mlperf_bert.model import bert

    calls: list[int] = []
    monkeypatch.setattr(bert, "linear_gelu", lambda *args: calls.append(1) or linear_gelu(*args))
    ffn = bert.BertIntermediate(bert.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                num_attention_heads=2, intermediate_size=32))
    x = torch.randn(5, 16)
    plain = F.gelu(ffn.dense(x))
    assert torch.equal(ffn(x), plain) and len(calls) == 1
    seen: list[torch.Tensor] = []
    ffn.dense.register_forward_hook(lambda m, args, out: seen.append(out))
    assert torch.equal(ffn(x), plain) and len(calls) == 1 and len(seen) == 1


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

    def bf16_pass(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.ops.mlperf_bert.gradient_pass([a, b, c], None)

    graph = make_fx(bf16_pass, tracing_mode="fake")(*three)  # written: the gradient in bf16 and its sums
    assert single_pass_calls(graph) == {"mlperf_bert.gradient_pass": [3 * 3072 + 24 * 192 * 2 + 192 * 4]}


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


# ---------------------------------------------------------------- on a GPU (make bring-up: pytest -m gpu)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_on_the_gpu_the_kernels_give_the_reference_values():
    """Each op on CUDA tensors (the Triton kernel, BERT-Large's widths) against its CPU reference: FP8 bytes equal
    but for GELU's derivative (erf and exp: one unit in the last place of bf16 may move an FP8 rounding), sums and
    amax to fp32 rounding."""
    torch.manual_seed(0)
    cuda = torch.device("cuda")
    grads = [torch.randn(600, 1024, dtype=torch.bfloat16) for _ in range(3)]
    pre = torch.randn(600, 1024, dtype=torch.bfloat16)
    scale = torch.tensor(900.0)
    cases = [(fp8_cast.grad_cast_transpose, (grads, None, scale, E5M2), fp8_cast.reference),
             (fp8_cast.grad_cast_transpose, ([grads[0]], pre, scale, E5M2), fp8_cast.reference),
             (fp8_cast.gelu_cast_transpose, (pre, scale, torch.float8_e4m3fn), fp8_cast.gelu_reference),
             (fp8_cast.cast_transpose, (pre, scale, torch.float8_e4m3fn), fp8_cast.cast_reference)]
    for op, args, reference in cases:
        on_gpu = op(*[[g.to(cuda) for g in a] if isinstance(a, list) else a.to(cuda) if isinstance(a, torch.Tensor)
                      else a for a in args])
        for got, want in zip(on_gpu, reference(*args)):
            got = got.cpu().float()
            torch.testing.assert_close(got, want.float(), rtol=0.13 if got.dim() == 2 else 1e-5, atol=1e-6)
    from mlperf_bert.model.fused_linear import gradient_pass, reference as bf16_reference

    for args in ((grads, None), ([grads[0]], pre)):
        got = gradient_pass([g.to(cuda) for g in args[0]], None if args[1] is None else args[1].to(cuda))
        want = bf16_reference(*args)
        torch.testing.assert_close(got[0].cpu(), want[0], rtol=8e-3, atol=1e-6)
        torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-4, atol=1e-3)
    from mlperf_bert.model.fused_linear import weight_gradient

    g, x = grads[0].to(cuda), pre.to(cuda)
    exact = grads[0].double().t() @ pre.double()
    got = weight_gradient(g, x, torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu().double(), exact, rtol=1e-5, atol=1e-3)  # fp32 accumulation, not bf16
