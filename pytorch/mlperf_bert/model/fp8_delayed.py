"""`--fp8_recipe delayed`: a linear layer whose three GEMMs run in FP8, scaled by the previous step's amax.

NVIDIA's MLPerf BERT (TransformerEngine `DelayedScaling(amax_history_len=1, "most_recent")`) scales
each FP8 tensor by the absolute maximum that the same tensor had one step before. The cast then
needs no reduction of its own before it: it is a pointwise multiply, clamp and convert that
Inductor fuses into the kernel producing the tensor (the LayerNorm, GELU or dropout-add before
it), and the amax that the next step will use is reduced in the same pass. torchao's dynamic
scaling (`--fp8_recipe tensorwise`) must reduce the whole tensor first and cast after.

What each tensor gets:
- input x (E4M3): the scale of the previous forward's amax of x;
- weight W (E4M3): its own amax, each forward: the weights are small (at most 4M values per layer)
  and change every step, so they are cast once per step from their current value;
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
for packed rows of 512). dY's two FP8 copies, the bias gradient and dY's amax come from one pass over dY
(`fp8_cast.grad_cast_transpose`, a Triton kernel on the GPU); the layer that GELU follows runs GELU
itself (`forward(x, gelu=True)`), so that pass also applies GELU's derivative. Off a GPU the GEMMs are
emulated (`scaled_mm`: the same FP8 operands dequantised, multiplied in fp32); everything else is the
same code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fp8_cast import grad_cast_transpose, padded, saturated_cast

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# A tensor of zeros has amax 0: its scale is then 1 (anything times 0 is 0 either way).
_TINY = 1e-12
INPUT, GRAD = 0, 1  # slots of the amax buffer: the last input and output-gradient amax


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def scale_of(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 factor that maps amax onto the largest value of `dtype` (1 for an all-zero tensor)."""
    amax = amax.float()
    return torch.where(amax > _TINY, fp8_max(dtype) / amax.clamp(min=_TINY), torch.ones_like(amax))


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


class _DelayedFp8Matmul(torch.autograd.Function):
    """Y = X W^T (+ b) with FP8 operands, and GELU(Y) with `gelu`; the amax buffer's INPUT and GRAD slots give
    and take the scales. The backward's output gradient (through GELU's derivative with `gelu`) becomes its
    FP8 copies, bias gradient and amax in one pass (`fp8_cast.grad_cast_transpose`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                amax: torch.Tensor, calibrated: bool, grad_calibrated: bool,
                out_dtype: torch.dtype, records: bool, gelu: bool) -> torch.Tensor:
        x_scale = scale_of(amax[INPUT] if calibrated else amax_of(x), E4M3)
        x8 = to_fp8(x, x_scale, E4M3)
        if records:  # a training forward: the next one scales by this amax
            amax[INPUT].copy_(amax_of(x))
        w_scale = scale_of(amax_of(weight), E4M3)
        w8 = to_fp8(weight, w_scale, E4M3)
        out = scaled_mm(x8, w8.t(), x_scale.reciprocal(), w_scale.reciprocal(), out_dtype,
                        None if bias is None else bias.to(out_dtype))
        # With GELU its input is kept for its derivative, which the backward's one pass applies.
        ctx.save_for_backward(x8, x_scale, w8, w_scale, amax, out if gelu else None)
        ctx.grad_calibrated, ctx.has_bias, ctx.x_dtype = grad_calibrated, bias is not None, x.dtype
        return F.gelu(out) if gelu else out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple:
        x8, x_scale, w8, w_scale, amax, pre = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        if ctx.grad_calibrated:
            g_scale = scale_of(amax[GRAD], E5M2)
        else:  # the first backward: its own amax, from a pass of its own
            g_scale = scale_of(grad_cast_transpose(grad_out, pre, torch.ones_like(w_scale), E5M2)[3], E5M2)
        g8, g8_t, grad_b, g_amax = grad_cast_transpose(grad_out, pre, g_scale, E5M2)
        amax[GRAD].copy_(g_amax)
        g_inverse = g_scale.reciprocal()
        grad_x = scaled_mm(g8, _column_major(w8), g_inverse, w_scale.reciprocal(), grad_out.dtype)
        grad_w = scaled_mm(g8_t, _column_major(_pad_rows(x8)), g_inverse, x_scale.reciprocal(), torch.float32)
        return (grad_x.to(ctx.x_dtype), grad_w, grad_b if ctx.has_bias else None,
                None, None, None, None, None, None)


class DelayedFp8Linear(nn.Linear):
    """An nn.Linear (same parameters, same state-dict keys) computing its GEMMs in FP8 with delayed scaling."""

    amax: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | None = None) -> None:
        super().__init__(in_features, out_features, bias, device=device)
        # [input, output gradient]: the last training step's amax of each. Not in the state dict: the run
        # checkpoint keeps it apart (`scaling_state`).
        self.register_buffer("amax", torch.zeros(2, device=device), persistent=False)
        self.calibrated = False  # a training forward has set amax[INPUT]
        self.grad_calibrated = False  # a training forward ran, so its backward has set amax[GRAD]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "DelayedFp8Linear":
        """The layer in place of `linear`, holding the same parameter objects (optimizers and DDP see no change)."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, device=torch.device("meta"))
        new.weight = linear.weight
        new.bias = linear.bias
        new.amax = torch.zeros(2, device=linear.weight.device)
        return new

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """x W^T + b in FP8, and GELU of it with `gelu` (the exact, erf form: `F.gelu`'s default)."""
        return self.stacked(self, self.weight, self.bias, x, gelu)

    @staticmethod
    def stacked(owner: "DelayedFp8Linear", weight: torch.Tensor, bias: torch.Tensor | None,
                x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """x W^T + b in FP8 with `owner`'s amax history: the layer's own weight, or the stacked weights of
        several layers that read the same input (query, key and value: `bert.fused_projection`)."""
        device_type = x.device.type
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        flat = x.reshape(-1, x.shape[-1])
        # Only a forward that records gradients (a training step) reads and writes the history; an eval
        # forward (no_grad) scales by its own amax and leaves the history to the next training step.
        records = torch.is_grad_enabled()
        out = _DelayedFp8Matmul.apply(flat, weight, bias, owner.amax, owner.calibrated and records,
                                      owner.grad_calibrated, out_dtype, records, gelu)
        owner.calibrated = owner.calibrated or records
        if torch.is_grad_enabled() and weight.requires_grad:
            owner.grad_calibrated = True
        return out.reshape(*x.shape[:-1], weight.shape[0])

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
            self.amax.copy_(amax)
        self.calibrated, self.grad_calibrated = bool(state["calibrated"]), bool(state["grad_calibrated"])

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fp8 delayed scaling"
