"""LAMB / ADAM(W): implementations agree with each other, with hand arithmetic and with torch."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from mlperf_bert.optim.optimizers import (
    ForeachAdamW,
    ForeachLamb,
    ReferenceAdamW,
    ReferenceLamb,
    apex_available,
    build_optimizer,
    parameter_groups,
)
from tests.harness.optimizer_runs import STEPS, assert_same_parameters, loss_fn, make_model, run, train

HAS_APEX = apex_available() and torch.cuda.is_available()


@pytest.mark.parametrize("name", ["lamb", "adam"])
@pytest.mark.parametrize("max_grad_norm", [None, 1.0, 0.05])
def test_foreach_matches_reference(name: str, max_grad_norm: float | None) -> None:
    reference = run(name, "reference", max_grad_norm)
    assert_same_parameters(reference, run(name, "foreach", max_grad_norm))
    moved = sum((p - q).abs().sum() for p, q in zip(reference.parameters(), make_model().parameters()))
    assert moved > 0.1


@pytest.mark.skipif(not HAS_APEX, reason="apex with CUDA extensions is not installed")
@pytest.mark.parametrize("max_grad_norm", [None, 1.0, 0.05])
def test_apex_lamb_matches_reference(max_grad_norm: float | None) -> None:
    assert_same_parameters(run("lamb", "reference", max_grad_norm),
                           run("lamb", "apex", max_grad_norm, device="cuda"), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not HAS_APEX, reason="apex with CUDA extensions is not installed")
def test_apex_adam_matches_reference() -> None:
    assert_same_parameters(run("adam", "reference", None, eps=1e-9),
                           run("adam", "apex", None, device="cuda", eps=1e-9), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["lamb", "adam"])
def test_tensor_learning_rate_equals_float(name: str) -> None:
    assert_same_parameters(run(name, "foreach", 1.0), run(name, "foreach", 1.0, lr=torch.tensor(2e-2)),
                           rtol=0.0, atol=0.0)
    assert_same_parameters(run(name, "reference", 1.0), run(name, "reference", 1.0, lr=torch.tensor(2e-2)))


@pytest.mark.parametrize("name", ["lamb", "adam"])
@pytest.mark.parametrize("implementation", ["reference", "foreach"])
def test_clipping_divides_by_global_norm(name: str, implementation: str) -> None:
    """Clipping at c equals no clipping on gradients pre-divided by max(1, ||g|| / c)."""
    bound = 0.05
    clipped, manual = make_model(), make_model()
    opt_clipped = build_optimizer(parameter_groups(clipped, 0.01), name, 2e-2, (0.9, 0.999), 1e-6, 0.01, bound,
                                  implementation)
    opt_manual = build_optimizer(parameter_groups(manual, 0.01), name, 2e-2, (0.9, 0.999), 1e-6, 0.01, None,
                                 implementation)
    for step in range(STEPS):
        for model, optimizer in ((clipped, opt_clipped), (manual, opt_manual)):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model, step).backward()
        grads = [p.grad for p in manual.parameters() if p.grad is not None]
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
        assert norm > bound
        for g in grads:
            g.div_(max(1.0, norm / bound))
        opt_clipped.step()
        opt_manual.step()
    assert_same_parameters(clipped, manual, rtol=1e-5, atol=1e-6)
    # Adam-type steps barely feel a global gradient scale; the moments do, linearly.
    for p, q in zip(clipped.parameters(), manual.parameters()):
        if p.grad is not None:
            for key in ("exp_avg", "exp_avg_sq"):
                expected = opt_manual.state[q][key]
                scale = float(expected.abs().max())
                torch.testing.assert_close(opt_clipped.state[p][key], expected, rtol=1e-5, atol=1e-5 * scale)


def test_clipping_below_bound_changes_nothing() -> None:
    assert_same_parameters(run("lamb", "foreach", None), run("lamb", "foreach", 1e9), rtol=0.0, atol=0.0)


def test_parameter_groups_exclude_biases_and_layer_norm() -> None:
    model = make_model()
    decay, no_decay = parameter_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert sorted(names[id(p)] for p in decay["params"]) == [
        "dense.weight", "embedding.weight", "head.weight", "unused", "zero_kernel"]
    assert sorted(names[id(p)] for p in no_decay["params"]) == [
        "LayerNorm.bias", "LayerNorm.weight", "dense.bias", "head.bias", "scale"]


def test_parameter_groups_skip_frozen_and_empty() -> None:
    model = torch.nn.Linear(3, 3, bias=False)
    model.weight.requires_grad_(False)
    assert parameter_groups(model, 0.1) == []
    model.weight.requires_grad_(True)
    assert [len(g["params"]) for g in parameter_groups(model, 0.1)] == [1]


@pytest.mark.parametrize("implementation", ["reference", "foreach"])
def test_lamb_with_zero_gradient_is_pure_decoupled_decay(implementation: str) -> None:
    """g = 0: decayed tensors become p*(1-lr) (trust ratio 1/wd), the rest stay put."""
    model = make_model()
    before = copy.deepcopy(model)
    lr = 0.1
    optimizer = build_optimizer(parameter_groups(model, 0.01), "lamb", lr, (0.9, 0.999), 1e-6, 0.01, 1.0,
                                implementation)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    decayed = {id(p) for p in parameter_groups(model, 0.01)[0]["params"]}
    for (name, p), q in zip(model.named_parameters(), before.parameters()):
        expected = q * (1 - lr) if id(p) in decayed else q
        torch.testing.assert_close(p, expected, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("cls", [ReferenceLamb, ForeachLamb])
def test_lamb_single_step_by_hand(cls: type) -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    optimizer = cls([p], lr=0.5, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.1, max_grad_norm=0.25)
    p.grad = torch.tensor([0.3, 0.4])  # norm 0.5 > 0.25: gradients are halved
    optimizer.step()
    # Step 1: m = 0.1*g', v = 0.001*g'^2 with g' = (0.15, 0.2); bias-corrected m_hat = g',
    # sqrt(v_hat) = |g'|, so the Adam part is g'/(|g'| + 1e-6).
    adam = [0.15 / (0.15 + 1e-6), 0.2 / (0.2 + 1e-6)]
    update = [adam[0] + 0.1 * 1.0, adam[1] + 0.1 * -2.0]
    ratio = math.sqrt(1.0 + 4.0) / math.sqrt(update[0] ** 2 + update[1] ** 2)
    expected = [1.0 - 0.5 * ratio * update[0], -2.0 - 0.5 * ratio * update[1]]
    torch.testing.assert_close(p.detach(), torch.tensor(expected), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(optimizer.state[p]["exp_avg"], torch.tensor([0.015, 0.02]), rtol=1e-6, atol=0.0)
    torch.testing.assert_close(optimizer.state[p]["exp_avg_sq"], torch.tensor([2.25e-5, 4.0e-5]), rtol=1e-6, atol=0.0)
    assert optimizer.param_groups[0]["step"] == 1


@pytest.mark.parametrize("cls", [ReferenceLamb, ForeachLamb])
def test_lamb_without_weight_decay_skips_trust_ratio(cls: type) -> None:
    """apex use_nvlamb=False: a weight_decay=0 tensor takes the plain Adam step."""
    p = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    optimizer = cls([p], lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, max_grad_norm=None)
    p.grad = torch.tensor([-2.0, 0.5])
    optimizer.step()
    expected = [3.0 + 0.01 * 2.0 / (2.0 + 1e-6), 4.0 - 0.01 * 0.5 / (0.5 + 1e-6)]
    torch.testing.assert_close(p.detach(), torch.tensor(expected), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("implementation", ["reference", "foreach"])
def test_adamw_matches_torch(implementation: str) -> None:
    ours, theirs = make_model(), make_model()
    optimizer = build_optimizer(parameter_groups(ours, 0.05), "adam", 1e-2, (0.8, 0.82), 1e-9, 0.05, None,
                                implementation)
    reference = torch.optim.AdamW(parameter_groups(theirs, 0.05), lr=1e-2, betas=(0.8, 0.82), eps=1e-9,
                                  weight_decay=0.05, foreach=False)
    train(ours, optimizer, range(STEPS))
    train(theirs, reference, range(STEPS))
    assert_same_parameters(ours, theirs, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["lamb", "adam"])
def test_state_round_trip_across_implementations(name: str) -> None:
    """3 foreach steps, save, load into a fresh reference optimizer, 3 more == 6 straight."""
    straight = run(name, "reference", 1.0)
    first = make_model()
    opt_first = build_optimizer(parameter_groups(first, 0.01), name, 2e-2, (0.9, 0.999), 1e-6, 0.01, 1.0, "foreach")
    train(first, opt_first, range(3))
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": opt_first.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = make_model(seed=1)
    resumed.load_state_dict(saved["model"])
    opt_resumed = build_optimizer(parameter_groups(resumed, 0.01), name, 2e-2, (0.9, 0.999), 1e-6, 0.01, 1.0,
                                  "reference")
    opt_resumed.load_state_dict(saved["optimizer"])
    assert [g["step"] for g in opt_resumed.param_groups] == [3, 3]
    train(resumed, opt_resumed, range(3, STEPS))
    assert_same_parameters(straight, resumed)


def test_load_state_keeps_the_live_lr_tensor() -> None:
    model = make_model()
    lr = torch.tensor(0.5)
    optimizer = ForeachLamb(parameter_groups(model, 0.01), lr=lr)
    saved = copy.deepcopy(optimizer.state_dict())
    for group in saved["param_groups"]:
        group["lr"] = torch.tensor(0.25)
    optimizer.load_state_dict(saved)
    assert all(group["lr"] is lr for group in optimizer.param_groups)
    assert lr.item() == 0.25


def test_unused_parameter_gets_no_state() -> None:
    model = make_model()
    optimizer = build_optimizer(parameter_groups(model, 0.01), "lamb", 1e-2, (0.9, 0.999), 1e-6, 0.01, 1.0, "foreach")
    train(model, optimizer, range(2))
    assert model.unused not in optimizer.state
    torch.testing.assert_close(model.unused.detach(), torch.ones(2, 2), rtol=0.0, atol=0.0)


def test_build_optimizer_choices() -> None:
    params = list(make_model().parameters())
    args = (1e-3, (0.9, 0.999), 1e-6, 0.01, 1.0)
    assert type(build_optimizer(params, "lamb", *args, implementation="reference")) is ReferenceLamb
    assert type(build_optimizer(params, "adamw", *args, implementation="foreach")) is ForeachAdamW
    assert type(build_optimizer(params, "adam", *args, implementation="reference")) is ReferenceAdamW
    # auto: apex when it is there; FusedAdam cannot clip, so clipped ADAM stays on foreach.
    assert type(build_optimizer(params, "adam", *args)) is ForeachAdamW
    auto_lamb = type(build_optimizer(params, "lamb", *args)).__name__
    assert auto_lamb == ("FusedLAMB" if apex_available() else "ForeachLamb")
    device_lr = build_optimizer(params, "lamb", torch.tensor(1e-3), *args[1:])
    assert type(device_lr) is ForeachLamb  # apex takes float learning rates only
    with pytest.raises(ValueError, match="optimizer name"):
        build_optimizer(params, "sgd", *args)
    with pytest.raises(ValueError, match="implementation"):
        build_optimizer(params, "lamb", *args, implementation="fused")
    with pytest.raises(ValueError, match="max_grad_norm"):
        build_optimizer(params, "lamb", 1e-3, (0.9, 0.999), 1e-6, 0.01, 0.0)
    with pytest.raises(ValueError, match="betas"):
        build_optimizer(params, "lamb", 1e-3, (0.9, 1.0), 1e-6, 0.01, 1.0)


@pytest.mark.skipif(apex_available(), reason="apex is installed")
def test_apex_requested_without_apex_says_how_to_fix() -> None:
    with pytest.raises(ImportError, match="foreach"):
        build_optimizer(list(make_model().parameters()), "lamb", 1e-3, (0.9, 0.999), 1e-6, 0.01, 1.0, "apex")
