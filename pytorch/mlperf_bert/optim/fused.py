"""The LAMB / AdamW update in at most three passes over the parameters, as two custom ops.

Today's multi-tensor form of the update (`advance_moments`, `adam_direction`, `apply_updates`) is
about 17 `torch._foreach_*` launches per group, each a pass over parameter-sized memory. LAMB needs
each tensor's ||p|| and ||update|| before it can apply anything, so the fewest passes are:

1. the global gradient norm, only when the optimizer clips (`torch._foreach_norm`, the caller's);
2. `moments_and_norms`: reads g, m, v, p; writes m and v; returns each tensor's sum of p * p and of
   update * update (p before the step);
3. `apply_update`: reads m, v, p, computes the update again, writes p -= scale * update, scale being
   lr * trust ratio per tensor.

A group without trust ratio (LAMB's undecayed one, every AdamW group) takes steps 2 and 3 in one
pass: `apply_update` with the gradients advances the moments first. Recomputing the update in step 3
costs no more memory traffic than storing it in step 2 and reading it back (per element: 16 bytes
read and 4 written, against 4 written in step 2 and 12 read in step 3), and needs no buffer.

Each op runs, per device:
- CUDA: the Triton kernels of `fused_kernels.py`, one launch per pass over a whole list of tensors;
  tensors that are not all float32 and contiguous, or no Triton, take the multi-tensor code instead;
- CPU (and any other device): the multi-tensor code, `torch._foreach_*` as before: the reference the
  kernels are tested against (`tests/trainer/optim/test_fused_optim.py`, through Triton's interpreter on the CPU);
- the fake device of the dry run: shapes only (`register_fake`).

Why these, and not another library's:
- `torch.compile` of the update: Inductor fuses the element-wise multi-tensor arithmetic into
  combined kernels, but each tensor's norm is a reduction it schedules as a kernel of its own, and it
  materialises the update between the reduction and its use: not three passes, and nothing a CPU
  test could check (Inductor writes C++ there, not the GPU's kernels).
- apex's `FusedLAMB` stays what `--optimizer_impl auto` picks for eager steps where it imports
  (`optimizers._auto_implementation`); it keeps its step count and lr on the host, so no CUDA graph
  can replay it, and it cannot be sharded (`sharded.py`).
- `torch.library.triton_op`: it exists so that `torch.compile` can trace into the Triton kernels;
  nothing compiles the optimizer step, and this op's CPU implementation is the multi-tensor code, not
  a kernel. A `custom_op` with a CUDA kernel, as `model/varlen_flash.py`'s, keeps the two apart.

The ops never read the device on the host, and their kernels' tables are built so that a CUDA graph
replays them (`fused_kernels.py`). Optimizer state is untouched in layout: exp_avg / exp_avg_sq per
parameter, in place.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence, cast

import torch

NAMESPACE = "mlperf_bert"
# The ops' names as the dry run's cost tracer reports them (the planner counts them as the optimizer's).
OP_PREFIX = "fused_adam_"

Correction = float | torch.Tensor


@dataclass(frozen=True)
class Hyper:
    """A group's numbers for one step: betas, eps, weight decay, and the bias corrections (1 - beta^t,
    host floats, or 0-dim device tensors in the capturable optimizer)."""

    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    corrections: tuple[Correction, Correction]

    @classmethod
    def of(cls, group: dict[str, Any], corrections: tuple[Correction, Correction]) -> "Hyper":
        beta1, beta2 = group["betas"]
        return cls(beta1, beta2, group["eps"], group["weight_decay"], corrections)

    def op_args(self) -> dict[str, Any]:
        """The ops' scalar arguments: the corrections as one float32 [2] device tensor, or as two floats."""
        numbers = dict(beta1=self.beta1, beta2=self.beta2, eps=self.eps, weight_decay=self.weight_decay)
        bc1, bc2 = self.corrections
        if isinstance(bc1, torch.Tensor) and isinstance(bc2, torch.Tensor):
            return dict(numbers, corrections=torch.stack([bc1, bc2]).float(), bias_correction1=0.0,
                        bias_correction2=0.0)
        return dict(numbers, corrections=None, bias_correction1=float(bc1), bias_correction2=float(bc2))


# ---------------------------------------------------------------- the multi-tensor arithmetic


def advance_moments(grads: list[torch.Tensor], exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor],
                    divisor: torch.Tensor | None, beta1: float, beta2: float) -> None:
    """m = beta1 * m + (1 - beta1) * g, v = beta2 * v + (1 - beta2) * g * g, in place, with g = grad / divisor."""
    scaled = torch._foreach_div(grads, divisor) if divisor is not None else list(grads)
    torch._foreach_mul_(exp_avg, beta1)
    torch._foreach_add_(exp_avg, scaled, alpha=1.0 - beta1)
    torch._foreach_mul_(exp_avg_sq, beta2)
    torch._foreach_addcmul_(exp_avg_sq, scaled, scaled, value=1.0 - beta2)


def adam_direction(params: list[torch.Tensor], exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor],
                   corrections: tuple[Correction, Correction], eps: float, weight_decay: float) -> list[torch.Tensor]:
    """m_hat / (sqrt(v_hat) + eps) + weight_decay * p, new tensors; corrections (1 - beta1^t, 1 - beta2^t)."""
    bc1, bc2 = cast(tuple[Any, Any], corrections)  # a float or a 0-dim tensor: `_foreach_div` takes either
    denominator = torch._foreach_div(exp_avg_sq, bc2)
    torch._foreach_sqrt_(denominator)
    torch._foreach_add_(denominator, eps)
    updates = torch._foreach_div(exp_avg, bc1)
    torch._foreach_div_(updates, denominator)
    if weight_decay != 0:
        torch._foreach_add_(updates, params, alpha=weight_decay)
    return list(updates)


def apply_updates(params: list[torch.Tensor], updates: list[torch.Tensor], scales: torch.Tensor | float) -> None:
    """p -= scale * update, with `scales` a float, a 0-dim tensor or one value per tensor.

    Always multiply-then-subtract, so a float lr and an equal tensor lr give the same bits.
    """
    if isinstance(scales, torch.Tensor) and scales.ndim == 1:
        torch._foreach_mul_(updates, list(scales.to(updates[0].dtype).unbind()))
    else:
        torch._foreach_mul_(updates, scales)
    torch._foreach_sub_(params, updates)


def squared_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norms of the tensors, float32 [len]."""
    return torch.stack(torch._foreach_norm(tensors, dtype=torch.float32)).square()


def _bias_corrections(corrections: torch.Tensor | None, bias_correction1: float,
                      bias_correction2: float) -> tuple[Correction, Correction]:
    if corrections is None:
        return bias_correction1, bias_correction2
    return corrections[0], corrections[1]


def multi_tensor_moments(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avg: list[torch.Tensor],
                         exp_avg_sq: list[torch.Tensor], divisor: torch.Tensor | None,
                         corrections: torch.Tensor | None, beta1: float, beta2: float, eps: float,
                         weight_decay: float, bias_correction1: float, bias_correction2: float) -> torch.Tensor:
    """`moments_and_norms` as multi-tensor ops (the reference the kernels are tested against)."""
    advance_moments(grads, exp_avg, exp_avg_sq, divisor, beta1, beta2)
    updates = adam_direction(params, exp_avg, exp_avg_sq, _bias_corrections(corrections, bias_correction1,
                                                                            bias_correction2), eps, weight_decay)
    return torch.stack([squared_norms(params), squared_norms(updates)], dim=1)


def multi_tensor_apply(params: list[torch.Tensor], grads: list[torch.Tensor] | None, exp_avg: list[torch.Tensor],
                       exp_avg_sq: list[torch.Tensor], scales: torch.Tensor, divisor: torch.Tensor | None,
                       corrections: torch.Tensor | None, beta1: float, beta2: float, eps: float,
                       weight_decay: float, bias_correction1: float, bias_correction2: float) -> None:
    """`apply_update` as multi-tensor ops (the reference the kernels are tested against)."""
    if grads is not None:
        advance_moments(grads, exp_avg, exp_avg_sq, divisor, beta1, beta2)
    updates = adam_direction(params, exp_avg, exp_avg_sq, _bias_corrections(corrections, bias_correction1,
                                                                            bias_correction2), eps, weight_decay)
    apply_updates(params, updates, scales)


# ---------------------------------------------------------------- the ops


@torch.library.custom_op(f"{NAMESPACE}::{OP_PREFIX}moments", mutates_args=("exp_avg", "exp_avg_sq"))
def _moments_op(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avg: list[torch.Tensor],
                exp_avg_sq: list[torch.Tensor], divisor: torch.Tensor | None, corrections: torch.Tensor | None,
                beta1: float, beta2: float, eps: float, weight_decay: float, bias_correction1: float,
                bias_correction2: float, static: bool) -> torch.Tensor:
    """Pass 2 (module docstring): advances the moments; returns [T, 2] float32: sum(p * p), sum(update * update)."""
    return multi_tensor_moments(params, grads, exp_avg, exp_avg_sq, divisor, corrections, beta1, beta2, eps,
                                weight_decay, bias_correction1, bias_correction2)


@_moments_op.register_fake
def _moments_fake(params: list[torch.Tensor], *_: Any, **__: Any) -> torch.Tensor:
    return params[0].new_empty((len(params), 2), dtype=torch.float32)


@_moments_op.register_kernel("cuda")
def _moments_cuda(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avg: list[torch.Tensor],
                  exp_avg_sq: list[torch.Tensor], divisor: torch.Tensor | None, corrections: torch.Tensor | None,
                  beta1: float, beta2: float, eps: float, weight_decay: float, bias_correction1: float,
                  bias_correction2: float, static: bool) -> torch.Tensor:
    args = (divisor, corrections, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2)
    kernels = triton_kernels(params, grads, exp_avg, exp_avg_sq)
    if kernels is None:
        return multi_tensor_moments(params, grads, exp_avg, exp_avg_sq, *args)
    return triton_moments(kernels, params, grads, exp_avg, exp_avg_sq, *args, static=static)


@torch.library.custom_op(f"{NAMESPACE}::{OP_PREFIX}apply", mutates_args=("params", "exp_avg", "exp_avg_sq"))
def _apply_op(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avg: list[torch.Tensor],
              exp_avg_sq: list[torch.Tensor], scales: torch.Tensor, divisor: torch.Tensor | None,
              corrections: torch.Tensor | None, beta1: float, beta2: float, eps: float, weight_decay: float,
              bias_correction1: float, bias_correction2: float, static: bool) -> None:
    """Pass 3 (module docstring): p -= scales[i] * update; with `grads` (not empty), advances the moments first."""
    multi_tensor_apply(params, grads or None, exp_avg, exp_avg_sq, scales, divisor, corrections, beta1, beta2, eps,
                       weight_decay, bias_correction1, bias_correction2)


@_apply_op.register_fake
def _apply_fake(*_: Any, **__: Any) -> None:
    return None


@_apply_op.register_kernel("cuda")
def _apply_cuda(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avg: list[torch.Tensor],
                exp_avg_sq: list[torch.Tensor], scales: torch.Tensor, divisor: torch.Tensor | None,
                corrections: torch.Tensor | None, beta1: float, beta2: float, eps: float, weight_decay: float,
                bias_correction1: float, bias_correction2: float, static: bool) -> None:
    args = (divisor, corrections, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2)
    kernels = triton_kernels(params, grads, exp_avg, exp_avg_sq)
    if kernels is None:
        multi_tensor_apply(params, grads or None, exp_avg, exp_avg_sq, scales, *args)
    else:
        triton_apply(kernels, params, grads or None, exp_avg, exp_avg_sq, scales, *args, static=static)


@functools.cache
def _triton_module() -> Any:
    """`fused_kernels`, or None where Triton does not import (torch's CPU wheels come without it)."""
    try:
        from . import fused_kernels
    except ImportError:
        return None
    return fused_kernels


def triton_kernels(*lists: Sequence[torch.Tensor]) -> Any:
    """The compiled kernels when they can take these tensors (float32, contiguous); else None."""
    module = _triton_module()
    fits = all(t.dtype == torch.float32 and t.is_contiguous() for ts in lists for t in ts)
    return module.kernels() if module is not None and fits else None


def _scalars(corrections: torch.Tensor | None, beta1: float, beta2: float, eps: float, weight_decay: float,
             bias_correction1: float, bias_correction2: float) -> Any:
    return _triton_module().Scalars(beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2,
                                    corrections)


def triton_moments(kernels: Any, params: list[torch.Tensor], grads: list[torch.Tensor], exp_avg: list[torch.Tensor],
                   exp_avg_sq: list[torch.Tensor], divisor: torch.Tensor | None, corrections: torch.Tensor | None,
                   *numbers: float, static: bool = False) -> torch.Tensor:
    """`moments_and_norms` by the Triton kernels `kernels` (compiled, or interpreted in the tests)."""
    return _triton_module().run_pass(kernels, params, grads, exp_avg, exp_avg_sq, _scalars(corrections, *numbers),
                                     divisor, norms=True, static=static)


def triton_apply(kernels: Any, params: list[torch.Tensor], grads: list[torch.Tensor] | None,
                 exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor], scales: torch.Tensor,
                 divisor: torch.Tensor | None, corrections: torch.Tensor | None, *numbers: float,
                 static: bool = False) -> None:
    """`apply_update` by the Triton kernels `kernels` (compiled, or interpreted in the tests)."""
    _triton_module().run_pass(kernels, params, grads, exp_avg, exp_avg_sq, _scalars(corrections, *numbers),
                              divisor, scales=scales, static=static)


# ---------------------------------------------------------------- what the optimizers call


def moments_and_norms(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avg: list[torch.Tensor],
                      exp_avg_sq: list[torch.Tensor], hyper: Hyper, divisor: torch.Tensor | None = None,
                      static: bool = False) -> torch.Tensor:
    """Pass 2: advances the moments (g = grad / divisor) and returns [T, 2] float32, each tensor's
    sum of p * p and of update * update (this rank's part of them, for a shard's pieces).
    static: the tensors never move (views of fixed buffers): their kernel tables are built once."""
    return _moments_op(params, grads, exp_avg, exp_avg_sq, divisor, static=static, **hyper.op_args())


def apply_update(params: list[torch.Tensor], exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor],
                 scales: torch.Tensor, hyper: Hyper, grads: list[torch.Tensor] | None = None,
                 divisor: torch.Tensor | None = None, static: bool = False) -> None:
    """Pass 3: p -= scales[i] * update for each tensor i (scales float32 [T]). With `grads` the moments
    are advanced first, in the same pass (a group without trust ratio)."""
    _apply_op(params, grads or [], exp_avg, exp_avg_sq, scales, divisor, static=static, **hyper.op_args())


def per_tensor(lr: float | torch.Tensor, count: int, like: torch.Tensor) -> torch.Tensor:
    """The learning rate as one float32 value per tensor [count], on `like`'s device (no host copy)."""
    if isinstance(lr, torch.Tensor):
        return lr.to(torch.float32).reshape(1).repeat(count)
    return torch.full((count,), lr, dtype=torch.float32, device=like.device)
