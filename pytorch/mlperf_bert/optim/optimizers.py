"""LAMB and ADAM(W) with the semantics of NVIDIA apex FusedLAMB / FusedAdam.

Closed-division BERT must train with LAMB as apex FusedLAMB computes it; the open division
(Samsung) used apex FusedAdam in AdamW mode. Each optimizer exists twice:

* `ReferenceLamb` / `ReferenceAdamW`: one Python loop over tensors, written to be read and
  to be the ground truth in tests;
* `ForeachLamb` / `ForeachAdamW`: the same arithmetic in at most three passes over the
  parameters (`fused.py`: Triton kernels on a GPU, multi-tensor `torch._foreach_*` ops on the
  CPU), with no device-to-host synchronisation.

`build_optimizer` picks one of them, or apex itself when it is installed.

LAMB step, as apex `FusedLAMB` with its defaults (bias_correction=True, grad_averaging=True,
adam_w_mode=True, use_nvlamb=False) computes it (`csrc/multi_tensor_lamb.cu`):

1. `norm` = L2 norm of ALL gradients of ALL groups together; when `norm > max_grad_norm`
   every gradient is divided by `norm / max_grad_norm` (global clipping, before the moments).
2. Per group, `group["step"] += 1` (one counter per group, a Python int, as apex keeps it).
3. `m = beta1*m + (1-beta1)*g`  (grad averaging: beta3 = 1-beta1);  `v = beta2*v + (1-beta2)*g*g`.
4. `update = (m / (1-beta1**step)) / (sqrt(v / (1-beta2**step)) + eps) + weight_decay * p`.
5. Trust ratio `r = ||p|| / ||update||` per tensor (p before this step), `r = 1` when either
   norm is 0. With use_nvlamb=False apex applies r ONLY to tensors whose group has
   weight_decay != 0; biases and LayerNorm parameters (weight_decay 0) take plain Adam steps.
6. `p -= lr * r * update`.

ADAM(W) (apex `FusedAdam`, adam_w_mode=True) is steps 1-4 and `p -= lr * update`, with the
global clipping of step 1 only when `max_grad_norm` is set.

Differences from apex, on purpose: gradients are left untouched (apex overwrites `p.grad`
with the update); `lr` may be a 0-dim tensor on the parameters' device (device-resident lr,
written in place by `schedule.set_lr`); bias corrections are computed in float64 on the host
(apex: float32), a difference far below the fp32 rounding of the update itself.

State layout (identical in every implementation, and equal to apex's): per parameter
`exp_avg`, `exp_avg_sq`; per group an int `step`. A state dict saved by one implementation
loads into any other.
"""

from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Iterable, Sequence, cast

import torch

from ..runtime.optional import DependencyError, dependency_problem, optional_import, require
from . import fused

LAMB_NAMES = ("lamb",)
ADAM_NAMES = ("adam", "adamw")
IMPLEMENTATIONS = ("auto", "reference", "foreach", "apex")

# Substrings of parameter names that never take weight decay (MLPerf BERT / TF reference
# `exclude_from_weight_decay`); any other 1-D parameter is excluded as well.
NO_DECAY_NAME_PARTS = ("bias", "LayerNorm", "layer_norm")

LearningRate = float | torch.Tensor


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Splits trainable parameters into a decayed group and a weight_decay=0 group.

    Biases, LayerNorm parameters (by name) and any other 1-D parameter are not decayed,
    as in MLPerf BERT. Groups keep model order; an empty group is dropped.
    """
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        excluded = param.ndim <= 1 or any(part in name for part in NO_DECAY_NAME_PARTS)
        (no_decay if excluded else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _check_hyperparameters(lr: LearningRate, betas: Sequence[float], eps: float, max_grad_norm: float | None) -> None:
    if not isinstance(lr, torch.Tensor) and lr < 0:
        raise ValueError(f"learning rate must be >= 0, got {lr}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {tuple(betas)}")
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0, or None to switch clipping off; got {max_grad_norm}")


def clip_divisor(global_norm: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """0-dim tensor every gradient is divided by: norm/max when norm > max, else 1 (apex)."""
    ratio = global_norm / max_grad_norm
    return torch.where(global_norm > max_grad_norm, ratio, torch.ones_like(ratio))


MOMENTS = ("exp_avg", "exp_avg_sq")


def check_state_fits(param_groups: list[dict[str, Any]], state_dict: dict[str, Any]) -> None:
    """Raises ValueError naming the first difference between a saved LAMB/ADAM state and these groups.

    The same check for every implementation (sharded or not): the number of groups, of
    parameters per group, and each saved moment's name and shape against its parameter's. A
    parameter without saved state is accepted (never stepped: its moments are zeros).
    """
    groups, state = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict):
        raise ValueError("the optimizer state has no 'state' and 'param_groups': not an optimizer's state dict")
    if len(groups) != len(param_groups):
        raise ValueError(f"the optimizer state has {len(groups)} parameter groups, this optimizer "
                         f"{len(param_groups)}: saved for another model or optimizer")
    for g, (saved, live) in enumerate(zip(groups, param_groups)):
        if len(saved["params"]) != len(live["params"]):
            raise ValueError(f"parameter group {g} holds {len(saved['params'])} parameters in the optimizer state, "
                             f"{len(live['params'])} in this model")
        for j, (index, param) in enumerate(zip(saved["params"], live["params"])):
            entry = state.get(index)
            if entry is None:
                continue
            for name in MOMENTS:
                moment = entry.get(name)
                if not isinstance(moment, torch.Tensor):
                    raise ValueError(f"parameter {j} of group {g} has no {name!r} in the optimizer state (it holds "
                                     f"{sorted(entry)}): not a LAMB/ADAM state")
                if moment.shape != param.shape:
                    raise ValueError(f"{name!r} of parameter {j} of group {g} has shape {tuple(moment.shape)} in "
                                     f"the optimizer state, the parameter {tuple(param.shape)}")


class _ApexSemantics(torch.optim.Optimizer):
    """Shared construction, step counting, clipping and state handling.

    LAMB is AdamW plus the per-tensor trust ratio, so one class attribute tells them apart.
    """

    trust_ratio: ClassVar[bool]

    def __init__(
        self,
        params: Iterable[Any],
        lr: LearningRate,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = None,
    ) -> None:
        _check_hyperparameters(lr, betas, eps, max_grad_norm)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        # Global, like apex (which reads it from self.defaults): clipping spans all groups.
        self.max_grad_norm = max_grad_norm

    def _with_grad(self, group: dict[str, Any]) -> list[torch.Tensor]:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("sparse gradients are not supported")
            self._ensure_state(p)
        return params

    def _ensure_state(self, p: torch.Tensor) -> None:
        """Zero moments for a parameter that has none yet (apex's layout: exp_avg, exp_avg_sq)."""
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _all_grads(self) -> list[torch.Tensor]:
        return [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]

    def _uses_trust_ratio(self, group: dict[str, Any]) -> bool:
        # apex use_nvlamb=False: the ratio only for tensors that are weight-decayed.
        return self.trust_ratio and group["weight_decay"] != 0

    @staticmethod
    def _advance(group: dict[str, Any]) -> tuple[float, float]:
        """Counts the step and returns the bias corrections (1-beta1^t, 1-beta2^t)."""
        group["step"] = group.get("step", 0) + 1
        beta1, beta2 = group["betas"]
        return 1.0 - beta1 ** group["step"], 1.0 - beta2 ** group["step"]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads as torch does, but keeps device-resident lr tensors (same object, new value).

        A trainer (or a captured CUDA graph) holds on to those tensors; torch's default would
        replace them with copies. A state that does not fit these parameters is refused first
        (`check_state_fits`), naming what differs.
        """
        check_state_fits(self.param_groups, state_dict)
        live_lrs = [g["lr"] for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, live in zip(self.param_groups, live_lrs):
            if isinstance(live, torch.Tensor):
                live.copy_(torch.as_tensor(group["lr"]))
                group["lr"] = live

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._update()
        return loss

    def _update(self) -> None:
        raise NotImplementedError


def lamb_trust_ratio(param_norm: torch.Tensor, update_norm: torch.Tensor) -> torch.Tensor:
    """||p|| / ||update||, or 1 where either norm is 0 (apex LAMBStage2Functor)."""
    usable = (param_norm != 0) & (update_norm != 0)
    return torch.where(usable, param_norm / torch.where(usable, update_norm, 1.0), 1.0)


class _ReferenceLoop(_ApexSemantics):
    """The readable form: one tensor at a time, each formula written out once."""

    def _update(self) -> None:
        grads = self._all_grads()
        divisor = None
        if self.max_grad_norm is not None and grads:
            squares = cast(torch.Tensor, sum(g.float().pow(2).sum() for g in grads))  # grads is not empty
            divisor = clip_divisor(torch.sqrt(squares), self.max_grad_norm)
        for group in self.param_groups:
            bc1, bc2 = self._advance(group)
            for p in self._with_grad(group):
                update = self._tensor_update(p, group, divisor, bc1, bc2)
                ratio = lamb_trust_ratio(p.norm(), update.norm()) if self._uses_trust_ratio(group) else 1.0
                p.sub_(update * (group["lr"] * ratio))

    def _tensor_update(self, p: torch.Tensor, group: dict[str, Any], divisor: torch.Tensor | None,
                       bc1: float, bc2: float) -> torch.Tensor:
        """Advances the moments of p; returns m_hat / (sqrt(v_hat) + eps) + weight_decay * p."""
        beta1, beta2 = group["betas"]
        grad = cast(torch.Tensor, p.grad)  # _with_grad yields only parameters that have one
        g = grad if divisor is None else grad / divisor
        m, v = self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"]
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        update = (m / bc1) / ((v / bc2).sqrt() + group["eps"])
        if group["weight_decay"] != 0:
            update = update + group["weight_decay"] * p
        return update


class ReferenceLamb(_ReferenceLoop):
    """LAMB (apex FusedLAMB semantics), one tensor at a time. MLPerf: eps 1e-6, clip 1.0."""

    trust_ratio = True


class ReferenceAdamW(_ReferenceLoop):
    """AdamW (apex FusedAdam adam_w_mode), one tensor at a time."""

    trust_ratio = False


class ForeachKernels(_ApexSemantics):
    """The fast form: the update in at most three passes over the parameters (`fused.py`), no host
    synchronisation.

    Pass 1, with clipping: the global gradient norm (`torch._foreach_norm`). Then per group: with the
    trust ratio, pass 2 advances the moments and sums each tensor's p * p and update * update, and
    pass 3 applies lr * ratio * update; without it, one pass advances and applies. On a GPU each
    pass is one Triton kernel over the group; on the CPU the same ops run multi-tensor
    (`torch._foreach_*`) arithmetic.

    `lr` may be a float or a 0-dim tensor on the parameters' device (a device-resident
    learning rate the schedule writes in place, so neither a host sync nor a graph
    re-capture is needed when it changes). Clipping and trust ratios stay on the device.
    """

    def _update(self) -> None:
        divisor = self._clip_divisor()
        for group in self.param_groups:
            corrections = self._advance(group)
            params = self._with_grad(group)
            if params:
                self._step_group(group, params, divisor, fused.Hyper.of(group, corrections))

    def _clip_divisor(self) -> torch.Tensor | None:
        """Pass 1: what every gradient is divided by (global clipping), or None without clipping."""
        grads = self._all_grads()
        if self.max_grad_norm is None or not grads:
            return None
        norms = torch._foreach_norm(grads, dtype=torch.float32)
        return clip_divisor(torch.linalg.vector_norm(torch.stack(norms)), self.max_grad_norm)

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor], divisor: torch.Tensor | None,
                    hyper: fused.Hyper) -> None:
        """Passes 2 and 3 of one group (one pass without the trust ratio)."""
        exp_avg = [self.state[p]["exp_avg"] for p in params]
        exp_avg_sq = [self.state[p]["exp_avg_sq"] for p in params]
        grads = [cast(torch.Tensor, p.grad) for p in params]  # parameters with a gradient only
        if not self._uses_trust_ratio(group):
            scales = fused.per_tensor(group["lr"], len(params), params[0])
            fused.apply_update(params, exp_avg, exp_avg_sq, scales, hyper, grads, divisor)
            return
        sums = fused.moments_and_norms(params, grads, exp_avg, exp_avg_sq, hyper, divisor)
        ratios = lamb_trust_ratio(sums[:, 0].sqrt(), sums[:, 1].sqrt())
        fused.apply_update(params, exp_avg, exp_avg_sq, ratios * group["lr"], hyper)


class ForeachLamb(ForeachKernels):
    """LAMB in three passes (`fused.py`); the arithmetic of `ReferenceLamb`."""

    trust_ratio = True


class ForeachAdamW(ForeachKernels):
    """AdamW in one pass per group (two with clipping, `fused.py`); the arithmetic of `ReferenceAdamW`."""

    trust_ratio = False


# apex's fused optimizers: the Python package, and the CUDA extension its kernels live in (a
# Python-only install of apex has the first without the second).
APEX_MODULES = (("apex.optimizers", "NVIDIA apex"), ("amp_C", "apex's CUDA extension amp_C"))
APEX_INSTALL = ("build apex from source for this torch and CUDA (pip install -v --no-build-isolation "
                "--config-settings '--build-option=--cpp_ext' --config-settings '--build-option=--cuda_ext' "
                "git+https://github.com/NVIDIA/apex)")
APEX_ALTERNATIVE = "use --optimizer_impl foreach"


def apex_available() -> bool:
    """True when apex's fused optimizers and their CUDA extension import; False when either is not
    installed. An apex that is installed but fails to import (built for another torch) raises a
    `DependencyError`: `--optimizer_impl auto` must not quietly run without it."""
    return all([optional_import(module, package, "--optimizer_impl auto (apex where it imports)", APEX_INSTALL,
                                APEX_ALTERNATIVE) for module, package in APEX_MODULES])


def apex_problem(implementation: str, on_gpu: bool, device_steps: bool) -> str | None:
    """Why --optimizer_impl `implementation` cannot run here (checked at start-up); None when it can.

    apex's kernels take CUDA tensors only. `auto` picks apex only for eager steps on a GPU
    (`_auto_implementation`), and there an apex that is installed but broken is refused rather than
    skipped; "apex" with device steps (--cuda_graphs) is the config's to refuse.
    """
    try:
        if implementation == "auto" and on_gpu and not device_steps:
            apex_available()
    except DependencyError as broken:
        return str(broken)
    if implementation != "apex":
        return None
    if not on_gpu:
        return f"--optimizer_impl apex runs apex's CUDA kernels, and this run is on the CPU: {APEX_ALTERNATIVE} or auto"
    problems = (dependency_problem(module, package, "--optimizer_impl apex", APEX_INSTALL, APEX_ALTERNATIVE)
                for module, package in APEX_MODULES)
    return next((problem for problem in problems if problem is not None), None)


def _build_apex(params: Any, name: str, lr: LearningRate, betas: tuple[float, float], eps: float,
                weight_decay: float, max_grad_norm: float | None) -> torch.optim.Optimizer:
    from apex.optimizers import FusedAdam, FusedLAMB

    if isinstance(lr, torch.Tensor):
        raise ValueError("implementation 'apex' takes lr as a float; use implementation 'foreach' for a tensor lr")
    if name in LAMB_NAMES:
        # apex clips when norm > max_grad_norm; an infinite bound switches clipping off.
        bound = math.inf if max_grad_norm is None else max_grad_norm
        return FusedLAMB(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         max_grad_norm=bound, use_nvlamb=False)
    if max_grad_norm is not None:
        raise ValueError("apex FusedAdam has no global clipping: pass max_grad_norm=None (clip in the "
                         "clipping module) or choose implementation 'foreach'")
    return FusedAdam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=True)


def _resolve_implementation(name: str, implementation: str, max_grad_norm: float | None, lr: LearningRate,
                            cuda_graphs: bool = False, on_gpu: bool = True) -> str:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"optimizer implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if name not in LAMB_NAMES + ADAM_NAMES:
        raise ValueError(f"optimizer name must be one of {LAMB_NAMES + ADAM_NAMES}, got {name!r}")
    if implementation == "auto":
        return _auto_implementation(name, max_grad_norm, lr, cuda_graphs, on_gpu)
    if implementation != "apex":
        return implementation
    if cuda_graphs:
        raise ValueError(f"--optimizer_impl apex cannot run inside a CUDA graph: {APEX_NOT_GRAPH_SAFE}; "
                         "use --optimizer_impl foreach (or auto) with --cuda_graphs")
    for module, package in APEX_MODULES:
        require(module, package, "--optimizer_impl apex", APEX_INSTALL, APEX_ALTERNATIVE)
    problem = apex_problem(implementation, on_gpu, cuda_graphs)
    if problem is not None:
        raise ValueError(problem)
    return implementation


def _on_gpu(params_or_groups: list) -> bool:
    """Whether the parameters handed to the optimizer are CUDA tensors (the first one decides)."""
    for item in params_or_groups:
        first = next(iter(item["params"]), None) if isinstance(item, dict) else item
        if first is not None:
            return bool(first.is_cuda)
    return False


# Why apex's FusedLAMB / FusedAdam are never captured: both keep the step count as a Python int
# and take lr as a float, so a graph would replay the bias corrections and learning rate of the
# captured step forever; FusedLAMB also reads its overflow buffer on the host.
APEX_NOT_GRAPH_SAFE = "its step count and learning rate are host numbers a graph would freeze at capture"


def _auto_implementation(name: str, max_grad_norm: float | None, lr: LearningRate, cuda_graphs: bool,
                         on_gpu: bool = True) -> str:
    """apex for eager steps on a GPU where it computes the same thing; foreach under CUDA graphs and on
    the CPU (apex's kernels take CUDA tensors only).

    apex takes a float lr only, and FusedAdam cannot clip globally: those stay on foreach.
    Under --cuda_graphs the step is captured, which apex's optimizers cannot be
    (APEX_NOT_GRAPH_SAFE), so foreach (whose capturable twin keeps all state on the device).
    """
    if cuda_graphs or not on_gpu:
        return "foreach"
    apex_fits = not isinstance(lr, torch.Tensor) and (name in LAMB_NAMES or max_grad_norm is None)
    return "apex" if apex_fits and apex_available() else "foreach"


def _optimizer_class(name: str, implementation: str) -> type[_ApexSemantics]:
    if name in LAMB_NAMES:
        return ReferenceLamb if implementation == "reference" else ForeachLamb
    return ReferenceAdamW if implementation == "reference" else ForeachAdamW


def build_optimizer(
    params_or_groups: Any,
    name: str,
    lr: LearningRate,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    max_grad_norm: float | None,
    implementation: str = "auto",
    cuda_graphs: bool = False,
) -> torch.optim.Optimizer:
    """Builds LAMB or ADAM(W).

    name: "lamb" | "adam" ("adamw" is accepted as a synonym; ADAM here is always decoupled
      weight decay, as apex FusedAdam adam_w_mode and Samsung's open submission).
    params_or_groups: parameters or groups (see `parameter_groups`); `weight_decay` is the
      default for groups that do not set their own.
    lr: float, or a 0-dim tensor (device-resident learning rate; not for apex).
    max_grad_norm: global gradient-norm clip inside the optimizer; None switches it off
      (when the clipping module has already clipped).
    implementation: "auto" (apex when it imports, lr is a float and, for ADAM, no clipping is
      asked for; otherwise "foreach"), "reference", "foreach" or "apex". Note that apex
      overwrites p.grad with the update inside step().
    cuda_graphs: the step will be captured in a CUDA graph: "auto" then never picks apex,
      and "apex" is refused (see APEX_NOT_GRAPH_SAFE).
    """
    params_or_groups = list(params_or_groups)
    chosen = _resolve_implementation(name, implementation, max_grad_norm, lr, cuda_graphs, _on_gpu(params_or_groups))
    _check_hyperparameters(lr, betas, eps, max_grad_norm)
    if chosen == "apex":
        return _build_apex(params_or_groups, name, lr, betas, eps, weight_decay, max_grad_norm)
    cls = _optimizer_class(name, chosen)
    return cls(params_or_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
               max_grad_norm=max_grad_norm)
