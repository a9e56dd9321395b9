"""Numeric blow-ups: a NaN loss or a run of fp16 overflow skips stops the run with the last good state."""

from __future__ import annotations

import math

import pytest
import torch

from _fault_launch import assert_same_tensors, load_checkpoint, losses, mllog_events, run_ranks, worker_command
from conftest import trainer_args
from mlperf_bert import trainer
from mlperf_bert.cli import parse_config
from mlperf_bert.distributed import DistEnv
from mlperf_bert.faults import EXIT_DIVERGED, NumericBlowUp, StepGuard
from mlperf_bert.mllog import MLPerfLogger
from mlperf_bert.sources import open_batch_source


@pytest.mark.slow
def test_a_nan_loss_on_one_rank_stops_both_before_the_update_with_a_checkpoint(demo_data, tmp_path):
    # 2 ranks x 4 samples per step; checkpoints every 16 samples, so step 2 (16 samples) is on disk.
    flags = trainer_args(demo_data, tmp_path, "--do_train", "--train_batch_size", "4", "--max_steps", "8",
                         "--checkpoint_every_samples", "16")
    command = worker_command(flags, tmp_path / "rec", "--nan_at_step", "3", "--nan_rank", "1")
    assert run_ranks(command, 2, tmp_path / "logs") == [EXIT_DIVERGED, EXIT_DIVERGED]
    error = (tmp_path / "logs" / "rank0.err").read_text()
    assert "stopped (numeric_blowup): the training loss is not finite (NaN or inf) on at least one rank in step 3" \
        in error, error[-2000:]
    assert [len(losses(tmp_path / "rec", r)) for r in (0, 1)] == [2, 2]  # step 3 never finished

    good = load_checkpoint(tmp_path / "checkpoints" / "ckpt-000000000016.pt")
    last = load_checkpoint(tmp_path / "checkpoints" / "ckpt-000000000024.pt")
    assert last["run"]["reason"] == "numeric_blowup"
    assert last["train_state"] == {**good["train_state"], "samples": 24, "skipped_steps": 1}
    assert all(torch.isfinite(t).all() for t in last["model"].values())
    assert_same_tensors(last["model"], good["model"])  # the poisoned update was never applied
    assert_same_tensors(last["optimizer"]["state"], good["optimizer"]["state"])  # moments (the lr is per step)
    assert [g["step"] for g in last["optimizer"]["param_groups"]] == [2, 2]
    assert last["data"]["step"] == good["data"]["step"] + 1  # a resume starts after the bad batch
    events = mllog_events(tmp_path / "mlperf.log")
    assert [e["key"] for e in events][-4:] == ["numeric_blowup", "run_stop", "train_samples", "eval_samples"]
    assert events[-3]["metadata"]["status"] == "aborted"


@pytest.fixture
def fp16_runtime(demo_data, tmp_path):
    """The trainer's runtime with a (CPU) fp16 loss scaler, as `--precision fp16` builds it on a GPU."""
    flags = trainer_args(demo_data, tmp_path, "--do_train", "--max_steps", "20", "--max_consecutive_skipped_steps", "3")
    cfg = parse_config(flags, 1)
    denv = DistEnv(0, 1, 0, 1, "127.0.0.1", 0)
    device = torch.device("cpu")
    logger = MLPerfLogger(str(tmp_path / "mlperf.log"), 0)
    rt = trainer.Runtime(cfg, denv, device, trainer.build_model(cfg, device), logger)
    trainer.build_training(rt)
    trainer.load_eval_batches(rt)
    rt.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    rt.guard = StepGuard(device, check_loss=False, max_consecutive_skips=cfg.faults.max_consecutive_skipped_steps)
    source = open_batch_source(cfg, denv, trainer.data_limits(cfg, rt.model.config))
    yield rt, trainer.device_input(rt, source)
    source.close()
    logger.close()


def _overflow_at(monkeypatch, steps: set[int]) -> None:
    """Multiplies the loss by inf in the given (1-based) steps: every gradient overflows."""
    inner, calls = trainer.pretraining_loss, [0]

    def loss(out, batch):
        result = inner(out, batch)
        calls[0] += 1
        if calls[0] in steps:
            result.total = result.total * math.inf
        return result

    monkeypatch.setattr(trainer, "pretraining_loss", loss)


def test_overflow_steps_are_skipped_counted_and_stop_the_run_after_too_many(fp16_runtime, monkeypatch, tmp_path):
    rt, data = fp16_runtime
    _overflow_at(monkeypatch, {2, 3, 5, 6, 7})
    state = trainer.TrainState()
    before = {k: v.clone() for k, v in rt.model.state_dict().items()}
    trainer.train_step(rt, data, state)  # 1: applied
    after_one = {k: v.clone() for k, v in rt.model.state_dict().items()}
    assert not torch.equal(before["cls.predictions.bias"], after_one["cls.predictions.bias"])
    for _ in range(3):  # 2, 3 skipped; 4 applied (the count of skips in a row starts again)
        trainer.train_step(rt, data, state)
    assert (state.step, state.skipped_steps, rt.scaler.get_scale()) == (2, 2, 2.0**8)
    trainer.run_eval(rt, state)
    logged = [e for e in mllog_events(tmp_path / "mlperf.log") if e["key"] == "skipped_steps"]
    assert [(e["value"], e["metadata"]["epoch_num"]) for e in logged] == [(2, 32)]
    weights = {k: v.clone() for k, v in rt.model.state_dict().items()}
    trainer.train_step(rt, data, state)  # 5
    trainer.train_step(rt, data, state)  # 6
    with pytest.raises(NumericBlowUp, match="3 optimizer steps in a row were skipped for fp16 overflow"):
        trainer.train_step(rt, data, state)  # 7: the third skip in a row
    assert (state.step, state.skipped_steps, state.samples) == (2, 5, 56)
    assert_same_tensors(dict(rt.model.state_dict()), weights)  # skipped steps leave the weights alone


def test_a_nan_loss_in_fp32_raises_before_the_optimizer_step(fp16_runtime, monkeypatch):
    rt, data = fp16_runtime
    rt.scaler = None
    rt.guard = StepGuard(rt.device, check_loss=True, max_consecutive_skips=3)
    _overflow_at(monkeypatch, {1})
    weights = {k: v.clone() for k, v in rt.model.state_dict().items()}
    state = trainer.TrainState()
    with pytest.raises(NumericBlowUp, match="not finite"):
        trainer.train_step(rt, data, state)
    assert_same_tensors(dict(rt.model.state_dict()), weights)
    assert rt.optimizer.state_dict()["state"] == {}  # no moments were ever updated
    assert (state.step, state.skipped_steps, state.samples) == (0, 1, 8)
