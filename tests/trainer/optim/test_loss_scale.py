"""DeviceLossScaler equals torch.amp.GradScaler over a run with overflows, without host reads."""

from __future__ import annotations

import io

import pytest
import torch

from mlperf_bert.optim.capturable import capturable
from mlperf_bert.optim.loss_scale import DeviceLossScaler
from mlperf_bert.optim.optimizers import build_optimizer, parameter_groups

STEPS = 30
OVERFLOW_STEPS = {2, 3, 9, 10, 11, 20}  # consecutive ones too: back-off twice in a row
GROWTH_INTERVAL = 3  # short, so the run grows the scale several times between overflows


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, 6, generator=gen), torch.randn(16, 2, generator=gen)


def loss_at(model: torch.nn.Module, step: int) -> torch.Tensor:
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    return loss * float("inf") if step in OVERFLOW_STEPS else loss


def lamb(model: torch.nn.Module) -> torch.optim.Optimizer:
    return build_optimizer(parameter_groups(model, 0.01), "lamb", 1e-2, (0.9, 0.999), 1e-6, 0.01, 1.0, "foreach")


def run_grad_scaler(model: torch.nn.Module) -> tuple[list[float], int]:
    optimizer, scaler = lamb(model), torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=GROWTH_INTERVAL)
    scales, skipped = [], 0
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss_at(model, step)).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.get_scale() < before
        scales.append(scaler.get_scale())
    return scales, skipped


def run_device_scaler(model: torch.nn.Module) -> tuple[list[float], int, int]:
    optimizer = capturable(lamb(model))
    scaler = DeviceLossScaler("cpu", init_scale=2.0**10, growth_interval=GROWTH_INTERVAL)
    scales = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss_at(model, step)).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(float(scaler.scale_tensor))
    reading = scaler.read()
    return scales, reading.skipped_steps, reading.applied_steps


def test_same_scales_skips_and_weights_as_grad_scaler() -> None:
    ours, theirs = make_model(), make_model()
    their_scales, their_skipped = run_grad_scaler(theirs)
    our_scales, our_skipped, applied = run_device_scaler(ours)
    assert our_scales == their_scales
    assert our_skipped == their_skipped == len(OVERFLOW_STEPS)
    assert applied == STEPS - len(OVERFLOW_STEPS)
    assert len(set(their_scales)) > 3  # the run both grew and backed off
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_skipped_step_leaves_weights_state_and_step_count_untouched() -> None:
    model = make_model()
    optimizer = capturable(lamb(model))
    scaler = DeviceLossScaler("cpu", init_scale=2.0**10)
    scaler.scale(loss_at(model, 0)).backward()
    scaler.step(optimizer)
    weights = [p.detach().clone() for p in model.parameters()]
    moments = [{key: value.clone() for key, value in state.items()} for state in optimizer.state.values()]
    steps = [g["step"].clone() for g in optimizer.param_groups]
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss_at(model, 2)).backward()  # an overflow step
    scaler.step(optimizer)
    for p, w in zip(model.parameters(), weights):
        assert torch.equal(p, w)
    for state, saved in zip(optimizer.state.values(), moments, strict=True):
        for key, value in state.items():
            assert torch.equal(value, saved[key])
    assert [g["step"] for g in optimizer.param_groups] == steps
    assert scaler.read().skipped_steps == 1


def test_host_step_count_is_refused() -> None:
    model = make_model()
    optimizer = lamb(model)
    scaler = DeviceLossScaler("cpu")
    scaler.scale(loss_at(model, 0)).backward()
    with pytest.raises(ValueError, match="capturable"):
        scaler.step(optimizer)


def test_state_dict_round_trips_through_grad_scaler() -> None:
    scaler = DeviceLossScaler("cpu", init_scale=8.0, growth_interval=5)
    reference = torch.amp.GradScaler("cpu")
    reference.load_state_dict(scaler.state_dict())
    assert reference.get_scale() == 8.0 and reference.get_growth_interval() == 5
    back = DeviceLossScaler("cpu")
    back.load_state_dict(reference.state_dict())
    assert back.state_dict() == scaler.state_dict()


def _resumable_run(device_scaled: bool, resume_after: int | None = None) -> tuple[list[float], torch.nn.Module]:
    """STEPS steps of either scaler; `resume_after`: its state, the model's and the optimizer's go through a
    weights-only file after that step and a fresh model, optimizer and scaler continue from it (as a resumed run
    builds them: the optimizer's state loaded before it is made capturable)."""
    model, scales = make_model(), []

    def build(state: dict | None = None) -> tuple[torch.optim.Optimizer, DeviceLossScaler | torch.amp.GradScaler]:
        optimizer = lamb(model)
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        if device_scaled:
            optimizer = capturable(optimizer)
            scaler: DeviceLossScaler | torch.amp.GradScaler = DeviceLossScaler("cpu", growth_interval=GROWTH_INTERVAL)
        else:
            scaler = torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
        scaler.load_state_dict(state["scaler"] if state is not None else {**scaler.state_dict(), "scale": 2.0**10})
        return optimizer, scaler

    optimizer, scaler = build()
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss_at(model, step)).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(float(scaler.scale_tensor) if isinstance(scaler, DeviceLossScaler) else scaler.get_scale())
        if step == resume_after:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict()}, buffer)
            model = make_model()  # other weights until the checkpoint's load
            buffer.seek(0)
            optimizer, scaler = build(torch.load(buffer, weights_only=True))
    return scales, model


@pytest.mark.parametrize("device_scaled", [False, True])
@pytest.mark.parametrize("resume_after", [10, 13])  # inside a run of overflows; two clean steps into a growth interval
def test_an_fp16_run_resumed_from_its_scaler_state_continues_bitwise(device_scaled: bool, resume_after: int) -> None:
    """fp16's dynamic loss scale and the clean steps counted toward its next growth are training state: a checkpoint's
    scaler state continues the scale sequence, and so the weights, bitwise."""
    scales, model = _resumable_run(device_scaled)
    resumed_scales, resumed = _resumable_run(device_scaled, resume_after)
    assert resumed_scales == scales and len(set(scales)) > 3
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
