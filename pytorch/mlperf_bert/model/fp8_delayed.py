"""`--fp8_recipe delayed`: a linear layer whose three GEMMs run in FP8, scaled by the previous step's amax.

NVIDIA's MLPerf BERT (TransformerEngine `DelayedScaling(amax_history_len=1, "most_recent")`) scales
each FP8 tensor by the absolute maximum that the same tensor had one step before. The cast then
needs no reduction of its own before it: it is a pointwise multiply, clamp and convert that
Inductor fuses into the kernel producing the tensor (the LayerNorm, GELU or dropout-add before
it), and the amax that the next step will use is reduced in the same pass. torchao's dynamic
scaling (`--fp8_recipe tensorwise`) must reduce the whole tensor first and cast after.

What each tensor gets:
- input x (E4M3): the scale of the previous forward's amax of x;
- weight W (E4M3): the previous training forward's amax of W, as TransformerEngine's delayed recipe scales
  weights. A step's update moves each weight by about the learning rate's fraction of it, so last step's
  amax bounds this step's but for that fraction, whose values saturate at the format's largest (the nearest
  E4M3 value to them anyway). The cast then reads W once: W8 for the forward GEMM, its transposed copy for
  dX, and the amax the next step scales by, in one pass (`fp8_cast.weight_cast_transpose`, which reads the
  query, key and value weights where they are), both copies saved for the backward;
- output gradient dY (E5M2, the wider range gradients need): the previous backward's amax.

The first forward and backward of a layer have no history: they scale by the tensor's own amax
(`calibrated` is then set; under torch.compile that is one recompile of each layer). Only a
training forward (one that records gradients) reads and writes the history: an eval forward
(no_grad) scales each input by its own amax and leaves the history as the last training step
left it, so the step after an eval scales as it would without the eval.

The history is training state: the next step reads it. It is not in the state dict (whose keys
stay those of every other precision, so checkpoints load across precisions); `scaling_state` and
`load_scaling_state` hand it to the run checkpoint (`fp8.scaling_states`, `train/checkpoint.py`),
so a resumed run scales its first step exactly as the uninterrupted run does.

GEMMs (`torch._scaled_mm`, fast accumulation in all three, as NVIDIA runs them): Y = X W^T + b in
the autocast dtype, dX = dY W, dW = dY^T X in fp32. The FP8 layout of `_scaled_mm` wants its first
operand row-major and its second column-major, hence the transposed copies of W for dX, and of dY
and X for dW; token counts that are not a multiple of 16 are padded with zero rows for dW (a no-op
for packed rows of 512). A training forward makes X's two FP8 copies and its amax in one pass
(`fp8_cast.cast_transpose`) and saves the transposed one for dW. dY's two FP8 copies, the bias
gradient and dY's amax come from one pass over dY (`fp8_cast.grad_cast_transpose`, a Triton kernel
on the GPU); the layer that GELU follows runs GELU itself (`forward(x, gelu=True)`), so that pass also
applies GELU's derivative. Off a GPU the GEMMs are
emulated (`scaled_mm`: the same FP8 operands dequantised, multiplied in fp32); everything else is the
same code.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .fp8_cast import (cast_transpose, gelu_cast_transpose, grad_cast_transpose, norm_grad_cast_transpose, padded,
                       read_in_parts, saturated_cast, stacked_in_place, weight_cast_transpose)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Slots of the amax buffer: the last training step's input, output-gradient and weight amax.
INPUT, GRAD, WEIGHT = 0, 1, 2
SLOTS = 3


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def scale_of(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 factor that maps amax onto the largest value of `dtype` (1 for an all-zero tensor)."""
    # A tensor of zeros has amax 0: its scale is then 1 (anything times 0 is 0 either way). The bound is a literal:
    # with dynamic shapes torch.compile reads a module-level float as an input (a symbolic float), which a second
    # FP8 layer's autograd function in the same graph cannot take (torch 2.13's Dynamo stops with
    # "lift_tracked_freevar_to_input should not be called on root SubgraphTracer").
    tiny = 1e-12
    amax = amax.float()
    return torch.where(amax > tiny, fp8_max(dtype) / amax.clamp(min=tiny), torch.ones_like(amax))


to_fp8 = saturated_cast


def amax_of(x: torch.Tensor) -> torch.Tensor:
    return x.detach().abs().amax().float()


def _column_major(x: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major (what _scaled_mm wants of its second operand)."""
    return x.t().contiguous().t()


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    """Zero rows up to a multiple of ALIGN (the token dimension, the inner one of dW's GEMM)."""
    extra = padded(x.shape[0]) - x.shape[0]
    return F.pad(x, (0, 0, 0, extra)) if extra else x


def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_inverse: torch.Tensor, b_inverse: torch.Tensor,
              out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(a / a_scale) @ (b / b_scale) (+ bias) for FP8 a (row-major) and b (column-major): `torch._scaled_mm`
    with fast accumulation on a GPU. Elsewhere the same operands dequantised to fp32 and multiplied (the CPU's
    `_scaled_mm` gives the same numbers but runs a scalar loop, minutes for the demo's model): FP8 rounding,
    no FP8 speed, as torchao's emulation."""
    if a.device.type == "cuda":
        return torch._scaled_mm(a, b, scale_a=a_inverse, scale_b=b_inverse, bias=bias, out_dtype=out_dtype,
                                use_fast_accum=True)
    out = (a.float() * a_inverse) @ (b.float() * b_inverse)
    return (out if bias is None else out + bias.float()).to(out_dtype)


def _input_fp8(x: torch.Tensor, amax: torch.Tensor, calibrated: bool,
               records: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(x in E4M3, its transposed copy for the weight gradient or None, its scale): by the history's amax once
    calibrated, else its own. A training forward (`records`) makes the transposed copy and the amax it leaves for
    the next step in the same pass (`fp8_cast.cast_transpose`); an eval forward only casts."""
    x_scale = scale_of(amax[INPUT] if calibrated else amax_of(x), E4M3)
    if not records:
        return to_fp8(x, x_scale, E4M3), None, x_scale
    x8, x8_t, x_amax = cast_transpose(x, x_scale, E4M3)
    amax[INPUT].copy_(x_amax)
    return x8, x8_t, x_scale


def _input_columns(saved: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The saved FP8 input as dW's second operand: column-major, tokens padded to ALIGN. A training forward saved
    its transposed copy (`_input_fp8`), which is that already; otherwise it is made here."""
    return saved.t() if transposed else _column_major(_pad_rows(saved))


def _weight_fp8(weights: tuple[torch.Tensor, ...], amax: torch.Tensor, calibrated: bool,
                records: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(W in E4M3, its transposed copy for dX or None, its scale) of the weight given as its row-wise parts (one,
    or the query, key and value weights: `stacked_in_place`). A training forward (`records`) scales by the
    history's amax once calibrated, else by W's own, and makes both copies and the amax it leaves for the next
    step in one pass; an eval forward scales by W's own amax and only casts (the history is the training's)."""
    if not records:
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        w_scale = scale_of(amax_of(weight), E4M3)
        return to_fp8(weight, w_scale, E4M3), None, w_scale
    parts = list(weights) if stacked_in_place(weights) else [torch.cat(weights)]  # else the graph shows the copy
    w_scale = scale_of(amax[WEIGHT] if calibrated else torch.stack([amax_of(w) for w in parts]).amax(), E4M3)
    w8, w8_t, w_amax = weight_cast_transpose(parts, w_scale, E4M3)
    amax[WEIGHT].copy_(w_amax)
    return w8, w8_t, w_scale


def _weight_columns(saved: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The saved FP8 weight as dX's second operand, column-major: a training forward saved its transposed copy
    (`_weight_fp8`), which is that already; otherwise it is made here."""
    return saved.t() if transposed else _column_major(saved)


def _backward_gemms(grads: list[torch.Tensor], pre: torch.Tensor | None, amax: torch.Tensor, grad_calibrated: bool,
                    x8_columns: torch.Tensor, x_scale: torch.Tensor, w8_columns: torch.Tensor,
                    w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dX, dW fp32, bias gradient fp32) of one FP8 layer from its output gradient, given as its column-wise parts
    (through GELU's derivative at `pre` when given): the gradient's FP8 copies, bias gradient and amax in one
    pass, then the two GEMMs. `x8_columns`: the layer's FP8 input, column-major, tokens padded to ALIGN;
    `w8_columns`: its FP8 weight, column-major."""
    grads = [g.contiguous() for g in grads]
    if not read_in_parts(grads, pre):
        grads = [torch.cat(grads, dim=1)]
    if grad_calibrated:
        g_scale = scale_of(amax[GRAD], E5M2)
    else:  # the first backward: its own amax, from a pass of its own
        g_scale = scale_of(grad_cast_transpose(grads, pre, torch.ones_like(w_scale), E5M2)[3], E5M2)
    g8, g8_t, grad_b, g_amax = grad_cast_transpose(grads, pre, g_scale, E5M2)
    amax[GRAD].copy_(g_amax)
    grad_x, grad_w = _gradient_gemms(g8, g8_t, g_scale, x8_columns, x_scale, w8_columns, w_scale, grads[0].dtype)
    return grad_x, grad_w, grad_b


def _gradient_gemms(g8: torch.Tensor, g8_t: torch.Tensor, g_scale: torch.Tensor, x8_columns: torch.Tensor,
                    x_scale: torch.Tensor, w8_columns: torch.Tensor, w_scale: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(dX in `dtype`, dW fp32) from the output gradient's FP8 copies: dX = G W and dW = G^T X."""
    g_inverse = g_scale.reciprocal()
    grad_x = scaled_mm(g8, w8_columns, g_inverse, w_scale.reciprocal(), dtype)
    grad_w = scaled_mm(g8_t, x8_columns, g_inverse, x_scale.reciprocal(), torch.float32)
    return grad_x, grad_w


def _norm_backward(grad_out: torch.Tensor, norm: list[torch.Tensor], drop_scale: float, amax: torch.Tensor,
                   grad_calibrated: bool) -> tuple[torch.Tensor, ...]:
    """(dS, G8, G8T, G's scale, bias gradient, the LayerNorm weight's and bias's gradients) of the layer whose
    output reaches LayerNorm(S) through dropout, from the LayerNorm's output gradient, in one pass
    (`fp8_cast.norm_grad_cast_transpose`); `norm`: S, its mean and rstd, the LayerNorm's weight, the kept mask."""
    s, mean, rstd, gamma, keep = norm
    grad_out = grad_out.contiguous()
    if grad_calibrated:
        g_scale = scale_of(amax[GRAD], E5M2)
    else:  # the first backward: its own amax, from a pass of its own
        ones = torch.ones((), dtype=torch.float32, device=grad_out.device)
        g_scale = scale_of(norm_grad_cast_transpose(grad_out, s, mean, rstd, gamma, keep, drop_scale, ones, E5M2)[4],
                           E5M2)
    ds, g8, g8_t, grad_b, g_amax, grad_gamma, grad_beta = norm_grad_cast_transpose(
        grad_out, s, mean, rstd, gamma, keep, drop_scale, g_scale, E5M2)
    amax[GRAD].copy_(g_amax)
    return ds, g8, g8_t, g_scale, grad_b, grad_gamma, grad_beta


def _bias(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if bias is None else bias.to(dtype)


class _DelayedFp8Matmul(torch.autograd.Function):
    """Y = X W^T (+ b) with FP8 operands, and GELU(Y) with `gelu`; the amax buffer's INPUT and GRAD slots give
    and take the scales. With `split` (stacked layers' output sizes) Y is returned as those column blocks, and
    their gradients come back apart: the backward reads them in place, never concatenated. The backward's output
    gradient (through GELU's derivative with `gelu`) becomes its FP8 copies, bias gradient and amax in one pass
    (`fp8_cast.grad_cast_transpose`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, weight1: torch.Tensor | None,
                weight2: torch.Tensor | None, bias: torch.Tensor | None,
                amax: torch.Tensor, calibrated: bool, grad_calibrated: bool,
                out_dtype: torch.dtype, records: bool, gelu: bool,
                split: tuple[int, ...] | None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        weights = tuple(w for w in (weight, weight1, weight2) if w is not None)  # row-wise parts of one weight
        x8, x8_t, x_scale = _input_fp8(x, amax, calibrated, records)
        w8, w8_t, w_scale = _weight_fp8(weights, amax, calibrated, records)
        out = scaled_mm(x8, w8.t(), x_scale.reciprocal(), w_scale.reciprocal(), out_dtype, _bias(bias, out_dtype))
        # With GELU its input is kept for its derivative, which the backward's one pass applies.
        ctx.save_for_backward(x8 if x8_t is None else x8_t, x_scale, w8 if w8_t is None else w8_t, w_scale, amax,
                              out if gelu else None)
        ctx.rows, ctx.transposed, ctx.w_transposed = x8.shape[0], x8_t is not None, w8_t is not None
        ctx.weight_rows = [w.shape[0] for w in weights]
        ctx.grad_calibrated, ctx.has_bias, ctx.x_dtype = grad_calibrated, bias is not None, x.dtype
        ctx.widths = split or (out.shape[-1],)
        out = F.gelu(out) if gelu else out
        return out if split is None else tuple(out.split(split, dim=-1))

    @staticmethod
    def backward(ctx, *grad_outs: torch.Tensor | None) -> tuple:
        x8, x_scale, w8, w_scale, amax, pre = ctx.saved_tensors
        # an unused block's gradient is None: zeros of its width
        grads = [g if g is not None else x8.new_zeros((ctx.rows, width), dtype=ctx.x_dtype)
                 for g, width in zip(grad_outs, ctx.widths)]
        grad_x, grad_w, grad_b = _backward_gemms(grads, pre, amax, ctx.grad_calibrated,
                                                 _input_columns(x8, ctx.transposed), x_scale,
                                                 _weight_columns(w8, ctx.w_transposed), w_scale)
        grad_ws = list(grad_w.split(ctx.weight_rows)) if len(ctx.weight_rows) > 1 else [grad_w]
        grad_ws += [None] * (3 - len(grad_ws))
        return (grad_x.to(ctx.x_dtype), *grad_ws, grad_b if ctx.has_bias else None,
                None, None, None, None, None, None, None)


class _DelayedFp8Mlp(torch.autograd.Function):
    """FC2(GELU(FC1(x))) with both layers' GEMMs in FP8, as NVIDIA's LayerNormMLP runs it: FC1's output is read
    once to make FC2's FP8 input, its transposed copy (saved for FC2's dW) and its amax
    (`fp8_cast.gelu_cast_transpose`), and nothing of GELU is recomputed in the backward, whose pass over FC2's
    input gradient applies GELU's derivative. The same values as the two layers apart (`_DelayedFp8Matmul`).

    With `gamma` (a training step's encoder layer), the layer's end too: LayerNorm(x + dropout(FC2's output)),
    the dropout drawn here (`torch.native_dropout`, what `F.dropout` runs on a GPU) and the sum and its
    statistics kept. Its backward is one pass over the LayerNorm's output gradient that also makes FC2's output
    gradient in FP8 (`fp8_cast.norm_grad_cast_transpose`), where apart from FC2 the LayerNorm's backward writes
    that gradient for FC2's pass to read. The same values as `bert.add_and_norm` after the MLP."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
                b2: torch.Tensor | None, amax1: torch.Tensor, amax2: torch.Tensor, calibrated: tuple[bool, bool],
                grad_calibrated: tuple[bool, bool], out_dtype: torch.dtype, records: bool,
                gamma: torch.Tensor | None, beta: torch.Tensor | None, eps: float, drop_p: float) -> torch.Tensor:
        x8, x8_t, x_scale = _input_fp8(x, amax1, calibrated[0], records)
        w1_8, w1_8t, w1_scale = _weight_fp8((w1,), amax1, calibrated[0], records)
        pre = scaled_mm(x8, w1_8.t(), x_scale.reciprocal(), w1_scale.reciprocal(), out_dtype, _bias(b1, out_dtype))
        if calibrated[1]:
            y_scale = scale_of(amax2[INPUT], E4M3)
        else:  # the first forward: GELU's own amax, from a pass of its own
            y_scale = scale_of(gelu_cast_transpose(pre, torch.ones_like(x_scale), E4M3)[2], E4M3)
        y8, y8_t, y_amax = gelu_cast_transpose(pre, y_scale, E4M3)
        if records:
            amax2[INPUT].copy_(y_amax)
        w2_8, w2_8t, w2_scale = _weight_fp8((w2,), amax2, calibrated[1], records)
        out = scaled_mm(y8, w2_8.t(), y_scale.reciprocal(), w2_scale.reciprocal(), out_dtype, _bias(b2, out_dtype))
        norm: tuple[torch.Tensor, ...] = ()
        if gamma is not None:
            dropped, keep = torch.native_dropout(out, drop_p, True)
            s = x + dropped
            normed, mean, rstd = torch.native_layer_norm(s.float(), [s.shape[-1]], gamma, beta, eps)
            norm, out = (s, mean, rstd, gamma, keep), normed.to(out_dtype)
        ctx.save_for_backward(x8 if x8_t is None else x8_t, x_scale, w1_8 if w1_8t is None else w1_8t, w1_scale, pre,
                              y8_t, y_scale, w2_8 if w2_8t is None else w2_8t, w2_scale, amax1, amax2, *norm)
        ctx.grad_calibrated, ctx.x_dtype, ctx.transposed = grad_calibrated, x.dtype, x8_t is not None
        ctx.w_transposed = w1_8t is not None  # both weights' copies are made by the same kind of forward
        ctx.has_bias = (b1 is not None, b2 is not None)
        ctx.drop_scale = 1.0 / (1.0 - drop_p) if drop_p < 1.0 else 0.0  # p = 1 keeps nothing: no gradient
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple:
        x8, x_scale, w1_8, w1_scale, pre, y8_t, y_scale, w2_8, w2_scale, amax1, amax2, *norm = ctx.saved_tensors
        w2_columns = _weight_columns(w2_8, ctx.w_transposed)
        grad_gamma = grad_beta = ds = None
        if norm:
            ds, g8, g8_t, g_scale, grad_b2, grad_gamma, grad_beta = _norm_backward(
                grad_out, norm, ctx.drop_scale, amax2, ctx.grad_calibrated[1])
            grad_y, grad_w2 = _gradient_gemms(g8, g8_t, g_scale, y8_t.t(), y_scale, w2_columns, w2_scale, ds.dtype)
        else:
            grad_y, grad_w2, grad_b2 = _backward_gemms([grad_out], None, amax2, ctx.grad_calibrated[1], y8_t.t(),
                                                       y_scale, w2_columns, w2_scale)
        grad_x, grad_w1, grad_b1 = _backward_gemms([grad_y], pre, amax1, ctx.grad_calibrated[0],
                                                   _input_columns(x8, ctx.transposed), x_scale,
                                                   _weight_columns(w1_8, ctx.w_transposed), w1_scale)
        if ds is not None:  # the residual's gradient: x reached the LayerNorm's input unchanged
            grad_x = grad_x + ds
        return (grad_x.to(ctx.x_dtype), grad_w1, grad_b1 if ctx.has_bias[0] else None, grad_w2,
                grad_b2 if ctx.has_bias[1] else None, None, None, None, None, None, None, grad_gamma, grad_beta,
                None, None)


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


def delayed_fp8_mlp(fc1: "DelayedFp8Linear", fc2: "DelayedFp8Linear", x: torch.Tensor,
                    norm: nn.LayerNorm | None = None, drop_p: float = 0.0) -> torch.Tensor:
    """fc2(GELU(fc1(x))) (exact GELU) in one FP8 function (`_DelayedFp8Mlp`), each layer with its own history; with
    `norm`, norm(x + dropout(that, drop_p)), the encoder layer's end, in the same function (a training forward's:
    the dropout is drawn, the backward fused with FC2's)."""
    flat = x.reshape(-1, x.shape[-1])
    records = torch.is_grad_enabled()
    if norm is not None and (norm.weight is None or norm.bias is None):
        raise ValueError("the FP8 MLP function runs the layer's end with a LayerNorm that has a weight and a bias "
                         "(elementwise_affine=True); without them, call it without `norm` and apply the LayerNorm after")
    gamma, beta, eps = (None, None, 0.0) if norm is None else (norm.weight, norm.bias, norm.eps)
    out = _DelayedFp8Mlp.apply(flat, fc1.weight, fc1.bias, fc2.weight, fc2.bias, fc1.amax, fc2.amax,
                               (fc1.calibrated and records, fc2.calibrated and records),
                               (fc1.grad_calibrated, fc2.grad_calibrated), _out_dtype(x), records, gamma, beta, eps,
                               drop_p)
    fc1.ran_forward(records, fc1.weight)
    fc2.ran_forward(records, fc2.weight)
    return out.reshape(*x.shape[:-1], fc2.weight.shape[0])


class DelayedFp8Linear(nn.Linear):
    """An nn.Linear (same parameters, same state-dict keys) computing its GEMMs in FP8 with delayed scaling."""

    amax: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | None = None) -> None:
        super().__init__(in_features, out_features, bias, device=device)
        # [input, output gradient, weight]: the last training step's amax of each. Not in the state dict: the run
        # checkpoint keeps it apart (`scaling_state`).
        self.register_buffer("amax", torch.zeros(SLOTS, device=device), persistent=False)
        self.calibrated = False  # a training forward has set amax[INPUT] and amax[WEIGHT]
        self.grad_calibrated = False  # a training forward ran, so its backward has set amax[GRAD]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "DelayedFp8Linear":
        """The layer in place of `linear`, holding the same parameter objects (optimizers and DDP see no change)."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, device=torch.device("meta"))
        new.weight = linear.weight
        new.bias = linear.bias
        new.amax = torch.zeros(SLOTS, device=linear.weight.device)
        return new

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """x W^T + b in FP8, and GELU of it with `gelu` (the exact, erf form: `F.gelu`'s default)."""
        return self.stacked(self, self.weight, self.bias, x, gelu)

    @staticmethod
    def stacked(owner: "DelayedFp8Linear", weight: torch.Tensor, bias: torch.Tensor | None,
                x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """x W^T + b in FP8 with `owner`'s amax history: the layer's own weight, or the stacked weights of
        several layers that read the same input (`split_outputs` gives them apart)."""
        out = DelayedFp8Linear._matmul(owner, (weight,), bias, x, gelu, None)
        assert isinstance(out, torch.Tensor)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def split_outputs(owner: "DelayedFp8Linear", weights: Sequence[torch.Tensor], bias: torch.Tensor | None,
                      x: torch.Tensor, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """The outputs of several layers that read the same input (query, key and value: `bert.fused_projection`):
        one FP8 GEMM over their weights stacked row-wise (at most 3, given apart: the cast reads them where they
        are), with `owner`'s history, given back as the column blocks `sizes`, whose gradients the backward reads
        where they are (no concatenation)."""
        blocks = DelayedFp8Linear._matmul(owner, tuple(weights), bias, x, False, sizes)
        return tuple(block.reshape(*x.shape[:-1], size) for block, size in zip(blocks, sizes))

    @staticmethod
    def _matmul(owner: "DelayedFp8Linear", weights: tuple[torch.Tensor, ...], bias: torch.Tensor | None,
                x: torch.Tensor, gelu: bool, split: tuple[int, ...] | None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if len(weights) > 3:
            raise ValueError(f"an FP8 GEMM stacks at most 3 layers' weights, got {len(weights)}")
        flat = x.reshape(-1, x.shape[-1])
        # Only a forward that records gradients (a training step) reads and writes the history; an eval
        # forward (no_grad) scales by its own amax and leaves the history to the next training step.
        records = torch.is_grad_enabled()
        weight1, weight2 = (*weights[1:], None, None)[:2]
        out = _DelayedFp8Matmul.apply(flat, weights[0], weight1, weight2, bias, owner.amax,
                                      owner.calibrated and records, owner.grad_calibrated, _out_dtype(x), records, gelu,
                                      split)
        owner.ran_forward(records, weights[0])
        return out

    def ran_forward(self, records: bool, weight: torch.Tensor) -> None:
        """A forward ran: a training one has set amax[INPUT], and its backward will set amax[GRAD]."""
        self.calibrated = self.calibrated or records
        if torch.is_grad_enabled() and weight.requires_grad:
            self.grad_calibrated = True

    def scaling_state(self) -> dict[str, torch.Tensor | bool]:
        """What the next training step reads besides the weights: the amax history (a copy, on the layer's
        device) and whether each slot holds one yet."""
        return {"amax": self.amax.detach().clone(), "calibrated": self.calibrated,
                "grad_calibrated": self.grad_calibrated}

    def load_scaling_state(self, state: dict[str, torch.Tensor | bool] | None) -> None:
        """`scaling_state`'s values back, in place (the buffer keeps its address); None: no history, the
        next forward and backward calibrate on their own amax, as a new layer's."""
        with torch.no_grad():
            if state is None:
                self.amax.zero_()
                self.calibrated = self.grad_calibrated = False
                return
            amax = state["amax"]
            assert isinstance(amax, torch.Tensor)
            if amax.numel() > SLOTS:
                raise ValueError(f"an FP8 layer's amax history holds {SLOTS} values, the checkpoint's {amax.numel()}: "
                                 "it was written by another release of the trainer; resume with that release")
            self.amax.zero_()
            self.amax[:amax.numel()].copy_(amax)
        self.calibrated, self.grad_calibrated = bool(state["calibrated"]), bool(state["grad_calibrated"])
        if amax.numel() < SLOTS:  # a history saved before the weight's slot: the next forward calibrates on its own
            self.calibrated = False

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fp8 delayed scaling"
