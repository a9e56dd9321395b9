"""The fused optimizer's Triton kernels on CPU tensors, through Triton's interpreter (test_fused_optim.py).

Usage: TRITON_INTERPRET=1 python -m tests.harness.workers.fused_kernels OUT.json     (from the repository root)

Triton decides at import whether its own library functions (tl.sum, tl.cdiv) are compiled or
interpreted, so this runs in a process of its own, started with TRITON_INTERPRET=1 before anything
imports Triton (torch.optim does). The kernels run with CHUNK 3 (a group takes several describe
launches) and BLOCK 4 for the single passes (a tensor spans several programs), 32 for the optimizers'
steps (the interpreter runs each program's ops one at a time). Written to OUT.json, for the test:

- `kernels`: per case (each pass; with and without the clip divisor, bias corrections on the host
  or on the device, weight decay on and off, addresses described on the device or built once on
  the host, each at least once), the largest difference from the multi-tensor ops, relative to the
  largest value;
- `optimizers`: LAMB (unclipped, clipped, clipped hard, the capturable twin with its device step
  count and lr) and AdamW stepped with the kernels, against `ReferenceLamb` / `ReferenceAdamW`;
  and the sharded LAMB at 3 ranks, in blocks of 9 elements (threads, `thread_ranks.on_ranks`),
  against the unsharded one;
- `launches`: the kernel passes of one step (the parameters' elements the pass kernel covered, over
  their number), and how many launches each kernel took.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

if __name__ == "__main__" and os.environ.get("TRITON_INTERPRET") != "1":  # before anything imports Triton
    sys.exit("start this with TRITON_INTERPRET=1 (module docstring)")

import pytest  # noqa: E402  (thread_ranks takes a MonkeyPatch)
import torch  # noqa: E402

from mlperf_bert.optim import fused, fused_kernels  # noqa: E402
from mlperf_bert.optim.capturable import capturable  # noqa: E402
from mlperf_bert.optim.optimizers import build_optimizer, parameter_groups  # noqa: E402
from tests.harness import optimizer_runs  # noqa: E402
from tests.harness import thread_ranks as ranks  # noqa: E402

SHAPES = [(5, 3), (3,), (4, 4), (7,), (0,), (1,), (9,), (2, 2)]  # 8 tensors: 3 describe launches of 3
STEPS = 3  # of each optimizer (optimizer_runs' model: bias corrections of steps 1 to 3)
LAUNCHES: Counter[str] = Counter()
ELEMENTS: Counter[str] = Counter()  # elements the pass kernel covered, by what it did


class Counted:
    """A kernel whose launches are counted (and, for the pass kernel, the elements they covered)."""

    def __init__(self, name: str, kernel: Any) -> None:
        self.name, self.kernel = name, kernel

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            LAUNCHES[self.name] += 1
            if self.name == "step":
                ELEMENTS["advance" if kwargs["ADVANCE"] else "apply"] += int(args[1][:, 0].sum())
            return self.kernel[grid](*args, **kwargs)
        return launch


def counted(block: int) -> fused_kernels.Kernels:
    k = fused_kernels.kernels(interpret=True, block=block, chunk=3)
    return fused_kernels.Kernels(Counted("describe", k.describe), Counted("step", k.step), Counted("sums", k.sums),
                                 block=block, chunk=3)


KERNELS = counted(4)  # a single pass: tensors of up to 16 elements span several programs
STEPS_KERNELS = counted(32)  # the optimizers' steps
ROUTE = {"kernels": True}  # False: the ops' CPU kernels run the multi-tensor code (a reference run)
ONE_AT_A_TIME = threading.Lock()  # the interpreter patches triton.language while it runs: one kernel at a time


@fused._moments_op.register_kernel("cpu")
def _moments(params, grads, exp_avg, exp_avg_sq, divisor, corrections, *rest):  # type: ignore[no-untyped-def]
    *numbers, static = rest  # beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2; static
    if not ROUTE["kernels"]:
        return fused.multi_tensor_moments(params, grads, exp_avg, exp_avg_sq, divisor, corrections, *numbers)
    with ONE_AT_A_TIME:
        return fused.triton_moments(STEPS_KERNELS, params, grads, exp_avg, exp_avg_sq, divisor, corrections,
                                    *numbers, static=static)


@fused._apply_op.register_kernel("cpu")
def _apply(params, grads, exp_avg, exp_avg_sq, scales, divisor, corrections, *rest):  # type: ignore[no-untyped-def]
    *numbers, static = rest
    if not ROUTE["kernels"]:
        return fused.multi_tensor_apply(params, grads or None, exp_avg, exp_avg_sq, scales, divisor, corrections,
                                        *numbers)
    with ONE_AT_A_TIME:
        fused.triton_apply(STEPS_KERNELS, params, grads or None, exp_avg, exp_avg_sq, scales, divisor,
                           corrections, *numbers, static=static)


def relative_difference(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    scale = max([float(w.abs().max()) for w in want if w.numel()] + [1e-30])
    return max([float((g - w).abs().max()) for g, w in zip(got, want) if g.numel()] + [0.0]) / scale


def tensors(seed: int) -> list[list[torch.Tensor]]:
    """params, grads, exp_avg, exp_avg_sq of SHAPES (the moments as after a few steps)."""
    generator = torch.Generator().manual_seed(seed)

    def draw(scale: float = 1.0, positive: bool = False) -> list[torch.Tensor]:
        drawn = [torch.randn(shape, generator=generator) * scale for shape in SHAPES]
        return [t.abs() for t in drawn] if positive else drawn

    return [draw(), draw(3.0), draw(0.3), draw(0.1, positive=True)]


def kernel_case(mode: str, divisor: bool, device_corrections: bool, weight_decay: float, static: bool) -> float:
    """One pass by the kernels and by the multi-tensor ops on equal copies: the largest difference."""
    bc1, bc2 = 1 - 0.9**3, 1 - 0.999**3
    corrections = torch.tensor([bc1, bc2]) if device_corrections else None
    numbers = (0.9, 0.999, 1e-6, weight_decay, 0.0 if device_corrections else bc1, 0.0 if device_corrections else bc2)
    d = torch.tensor(2.5) if divisor else None
    scales = torch.linspace(0.01, 0.08, len(SHAPES))
    got, want = tensors(1), tensors(1)
    p, g, m, v = got
    out: list[torch.Tensor] = []
    expected: list[torch.Tensor] = []
    if mode == "moments":
        out = [fused.triton_moments(KERNELS, p, g, m, v, d, corrections, *numbers, static=static)]
        expected = [fused.multi_tensor_moments(*want, d, corrections, *numbers)]
    else:
        advance = mode == "advance and apply"
        fused.triton_apply(KERNELS, p, g if advance else None, m, v, scales, d, corrections, *numbers, static=static)
        fused.multi_tensor_apply(want[0], want[1] if advance else None, want[2], want[3], scales, d, corrections,
                                 *numbers)
    return relative_difference(out + p + m + v, expected + want[0] + want[2] + want[3])


# (pass, divisor, device corrections, weight decay, static): every value of each switch with every pass.
CASES = [("moments", True, False, 0.01, False), ("moments", False, True, 0.0, True),
         ("moments", True, True, 0.01, True), ("apply", False, False, 0.01, False),
         ("apply", True, True, 0.0, True), ("advance and apply", True, False, 0.0, False),
         ("advance and apply", False, True, 0.01, True), ("advance and apply", True, True, 0.01, False)]


def kernel_cases() -> dict[str, float]:
    results = {}
    for mode, divisor, device_corrections, weight_decay, static in CASES:
        name = f"{mode}, divisor {divisor}, device corrections {device_corrections}, weight decay {weight_decay}, " \
               f"static {static}"
        results[name] = kernel_case(mode, divisor, device_corrections, weight_decay, static)
    return results


def train(name: str, implementation: str, max_grad_norm: float | None, lr: Any = 2e-2, twin: bool = False) -> list:
    model = optimizer_runs.make_model()
    optimizer = build_optimizer(parameter_groups(model, 0.01), name, lr, (0.9, 0.999), 1e-6, 0.01, max_grad_norm,
                                implementation)
    if twin:
        optimizer = capturable(optimizer)  # the step count and lr on the device, as under --cuda_graphs
    optimizer_runs.train(model, optimizer, range(STEPS))
    return [p.detach().clone() for p in model.parameters()]


def optimizer_cases() -> dict[str, float]:
    results = {}
    for name, clip, twin in (("lamb", None, False), ("lamb", 1.0, False), ("lamb", 0.05, False), ("lamb", 1.0, True),
                             ("adam", 1.0, False)):
        label = f"{name}, clip {clip}" + (", capturable" if twin else "")
        results[label] = relative_difference(train(name, "foreach", clip, twin=twin), train(name, "reference", clip))
    results["sharded lamb, 3 ranks, blocks of 9 elements"] = sharded_case(3, 9)
    return results


def sharded_case(world: int, block_numel: int) -> float:
    ROUTE["kernels"] = False
    reference, _ = ranks.unsharded_run(world, "lamb", 0.5)
    ROUTE["kernels"] = True

    def work(rank: int) -> torch.Tensor:
        net = ranks.model()
        opt = ranks.optimizer(net, "lamb", 0.5, True, block_numel=block_numel)
        for step in range(ranks.STEPS):
            ranks.sharded_step(net, opt, rank, world, step)
        return ranks.weights(net)

    with pytest.MonkeyPatch.context() as monkeypatch:
        got = ranks.on_ranks(world, work, monkeypatch)
    return max(relative_difference([g], [ranks.weights(reference)]) for g in got)


def launches() -> dict[str, Any]:
    """One step of LAMB (clipped) and of AdamW on `optimizer_runs`' model, the kernels counted."""
    counts = {}
    for name in ("lamb", "adam"):
        model = optimizer_runs.make_model()
        optimizer = build_optimizer(parameter_groups(model, 0.01), name, 2e-2, (0.9, 0.999), 1e-6, 0.01, 1.0,
                                    "foreach")
        optimizer_runs.train(model, optimizer, range(1))
        LAUNCHES.clear()
        ELEMENTS.clear()
        optimizer_runs.train(model, optimizer, range(1, 2))
        stepped = sum(p.numel() for p in model.parameters() if p.grad is not None)
        counts[name] = {"launches": dict(LAUNCHES),
                        "passes": {kind: n / stepped for kind, n in ELEMENTS.items()},
                        "tensors": sum(p.grad is not None for p in model.parameters())}
    return counts


def main() -> None:
    started = time.perf_counter()
    results = {"kernels": kernel_cases(), "optimizers": optimizer_cases(), "launches": launches()}
    results["seconds"] = time.perf_counter() - started
    Path(sys.argv[1]).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
