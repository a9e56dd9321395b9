"""Learning-rate schedule and eval schedule: values worked out by hand."""

from __future__ import annotations

import pytest
import torch

from mlperf_bert.config.closed_division import eval_interval_samples
from mlperf_bert.train.evaluation_interval import EvalSchedule
from mlperf_bert.optim.schedule import LRSchedule, set_lr

# NVIDIA DGXA100 8x8 (v2.0): lr 0.0015, 1271 steps, warmup 100 starting at -25.
NV_8X8 = LRSchedule(base_lr=0.0015, max_steps=1271, warmup_steps=100, start_warmup_step=-25)
# Samsung 128x8 open division: 299 steps, decay over 179 to end_lr, warmup 82 from -16.
SAMSUNG = LRSchedule(base_lr=0.000393, max_steps=299, warmup_steps=82, start_warmup_step=-16,
                     decay_steps=179, end_lr=4.9e-5, decay_start_step=82)


def test_negative_start_warmup_step() -> None:
    assert NV_8X8.lr_at(0) == pytest.approx(0.000375, rel=1e-12)  # 25/100 of the way up
    assert NV_8X8.lr_at(10) == pytest.approx(0.000525, rel=1e-12)
    assert NV_8X8.lr_at(74) == pytest.approx(0.001485, rel=1e-12)  # last warmup step: 99/100
    assert NV_8X8.in_warmup(74) and not NV_8X8.in_warmup(75)
    # First decay step: decay measured from step 0, so 75/1271 of it is already done.
    assert NV_8X8.lr_at(75) == pytest.approx(0.0015 * 1196 / 1271, rel=1e-12)
    assert NV_8X8.lr_at(1000) == pytest.approx(0.0015 * 271 / 1271, rel=1e-12)


def test_zero_warmup_is_pure_linear_decay() -> None:
    schedule = LRSchedule(base_lr=0.000425, max_steps=6700, warmup_steps=0)
    assert schedule.lr_at(0) == 0.000425
    assert schedule.lr_at(3350) == pytest.approx(0.0002125, rel=1e-12)
    assert schedule.lr_at(6699) == pytest.approx(0.000425 / 6700, rel=1e-9)


def test_decay_ends_at_exactly_zero_and_stays() -> None:
    assert NV_8X8.lr_at(1270) > 0.0
    assert NV_8X8.lr_at(1271) == 0.0
    assert NV_8X8.lr_at(5000) == 0.0


def test_warmup_from_step_zero() -> None:
    schedule = LRSchedule(base_lr=1.0, max_steps=1000, warmup_steps=100)
    assert schedule.lr_at(0) == 0.0
    assert schedule.lr_at(50) == 0.5
    assert schedule.lr_at(99) == 0.99
    assert schedule.lr_at(100) == 0.9  # decay: 1 - 100/1000


def test_warmup_proportion_truncates_like_nvidia() -> None:
    schedule = LRSchedule.from_warmup_proportion(base_lr=2.0, max_steps=1271, warmup_proportion=0.01)
    assert schedule.warmup_steps == 12  # int(12.71)
    assert schedule.lr_at(6) == 1.0
    with pytest.raises(ValueError, match="warmup_proportion"):
        LRSchedule.from_warmup_proportion(base_lr=1.0, max_steps=10, warmup_proportion=1.5)


def test_power_two_decay() -> None:
    schedule = LRSchedule(base_lr=4.0, max_steps=10, warmup_steps=0, power=2.0)
    assert schedule.lr_at(5) == 1.0  # 4 * (1/2)^2
    assert schedule.lr_at(8) == pytest.approx(0.16, rel=1e-12)  # 4 * (1/5)^2


def test_shorter_decay_holds_end_lr() -> None:
    schedule = LRSchedule(base_lr=1.0, max_steps=300, warmup_steps=0, decay_steps=200, end_lr=0.1)
    assert schedule.lr_at(100) == pytest.approx(0.55, rel=1e-12)  # 0.9 * 1/2 + 0.1
    assert schedule.lr_at(200) == pytest.approx(0.1, rel=1e-12)
    assert schedule.lr_at(299) == pytest.approx(0.1, rel=1e-12)


def test_samsung_decay_measured_from_warmup_steps() -> None:
    # Warmup ends at step 66 (82 - 16); their decay progress there is (66 - 82) / (179 - 82).
    assert SAMSUNG.lr_at(65) == pytest.approx(0.000393 * 81 / 82, rel=1e-12)
    overshoot = (0.000393 - 4.9e-5) * (1 + 16 / 97) + 4.9e-5
    assert SAMSUNG.lr_at(66) == pytest.approx(overshoot, rel=1e-12)
    assert SAMSUNG.lr_at(66) > SAMSUNG.base_lr
    assert SAMSUNG.lr_at(82) == pytest.approx(0.000393, rel=1e-12)
    assert SAMSUNG.lr_at(179) == pytest.approx(4.9e-5, rel=1e-12)
    assert SAMSUNG.lr_at(298) == pytest.approx(4.9e-5, rel=1e-12)


@pytest.mark.parametrize("schedule", [
    NV_8X8, SAMSUNG,
    LRSchedule(base_lr=0.0033, max_steps=470, warmup_steps=290, start_warmup_step=-100),
    LRSchedule(base_lr=1e-3, max_steps=50, warmup_steps=0, power=0.5),
])
def test_device_formula_matches_host(schedule: LRSchedule) -> None:
    steps = torch.arange(0, schedule.max_steps + 5)
    on_device = schedule.lr_tensor(steps)
    expected = torch.tensor([schedule.lr_at(int(s)) for s in steps], dtype=torch.float32)
    torch.testing.assert_close(on_device, expected, rtol=1e-6, atol=0.0)


def test_set_lr_float_and_device_tensor() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    floats = torch.optim.SGD([p], lr=1.0)
    set_lr(floats, 0.25)
    assert floats.param_groups[0]["lr"] == 0.25
    live = torch.tensor(1.0)
    tensors = torch.optim.SGD([{"params": [p], "lr": live}])
    set_lr(tensors, 0.125)
    assert tensors.param_groups[0]["lr"] is live
    assert live.item() == 0.125


@pytest.mark.parametrize("kwargs, message", [
    (dict(start_warmup_step=3), "start_warmup_step"),
    (dict(max_steps=0), "max_steps"),
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(decay_steps=0), "decay_steps"),
    (dict(decay_start_step=100), "decay_start_step"),
    (dict(power=0.0), "power"),
])
def test_bad_schedules_are_rejected(kwargs: dict, message: str) -> None:
    args = dict(base_lr=1.0, max_steps=100, warmup_steps=10) | kwargs
    with pytest.raises(ValueError, match=message):
        LRSchedule(**args)


def test_negative_step_is_rejected() -> None:
    with pytest.raises(ValueError, match="step must be >= 0"):
        NV_8X8.lr_at(-1)


# Eval interval: floor_to_multiple(0.05 * (230.23 * GBS + 3e6), 25000).
@pytest.mark.parametrize("global_batch_size, interval", [
    (256, 150_000), (448, 150_000), (1536, 150_000), (2048, 150_000),
    (3072, 175_000), (4096, 175_000), (8192, 225_000),
    (16384, 325_000),  # 0.05 * (230.23 * 16384 + 3e6) = 338,604.4: the published 512x8 value
])
def test_eval_interval_table(global_batch_size: int, interval: int) -> None:
    assert eval_interval_samples(global_batch_size) == interval


def test_eval_interval_boundary_is_exact() -> None:
    # 0.05 * (230.23 * g + 3e6) = 175,000 exactly at g = 500,000 / 230.23 = 2171.74, so
    # g = 2171 gives 174,991.5 (-> 150,000) and g = 2172 gives 175,003.0 (-> 175,000).
    assert eval_interval_samples(2171) == 150_000
    assert eval_interval_samples(2172) == 175_000
    with pytest.raises(ValueError, match="global_batch_size"):
        eval_interval_samples(0)


def test_eval_points_from_flags() -> None:
    schedule = EvalSchedule.for_batch_size(448)
    assert (schedule.start_samples, schedule.interval_samples) == (150_000, 150_000)
    assert list(schedule.points(600_000)) == [150_000, 300_000, 450_000, 600_000]
    custom = EvalSchedule.for_batch_size(448, start_samples=0, interval_samples=100_000, stop_samples=350_000)
    assert list(custom.points(10**9)) == [100_000, 200_000, 300_000]  # 0 skipped, stop exclusive


def test_eval_due_on_the_step_that_crosses_a_point() -> None:
    schedule = EvalSchedule(interval_samples=150_000, start_samples=150_000)
    due_after = [step for step in range(1, 1000) if schedule.due((step - 1) * 448, step * 448)]
    assert due_after == [335, 670]  # ceil(150000/448), ceil(300000/448)
    assert schedule.due(149_999, 150_000)
    assert not schedule.due(150_000, 150_447)
    assert schedule.next_point(150_000) == 300_000
    with pytest.raises(ValueError, match="backwards"):
        schedule.due(10, 5)
