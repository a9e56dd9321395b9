"""Numeric blow-ups: a NaN loss or a run of fp16 overflow skips stops the run with the last good state."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mlperf_bert import trainer
from mlperf_bert.runtime.exits import EXIT_DIVERGED
from mlperf_bert.train.faults import NumericBlowUp, StepGuard
from mlperf_bert.train.step import EagerStep
from tests.harness.cpu_run import cpu_run, poison_training_forwards, state_of
from tests.harness.demo import trainer_args
from tests.harness.launches import load_checkpoint, losses, mllog_events, run_ranks, worker_command
from tests.harness.tensors import assert_same_tensors

FAR = 10**9  # a block end no test step reaches


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
    assert last["data"]["stream"]["step"] == good["data"]["stream"]["step"] + 1  # a resume starts after the bad batch
    events = mllog_events(tmp_path / "mlperf.log")
    assert [e["key"] for e in events][-4:] == ["numeric_blowup", "run_stop", "train_samples", "eval_samples"]
    assert events[-3]["metadata"]["status"] == "aborted"


@pytest.fixture
def fp16_run(demo_data, tmp_path):
    """The trainer's run with a (CPU) fp16 loss scaler in its step, as `--precision fp16` builds it on a GPU."""
    flags = trainer_args(demo_data, tmp_path, "--do_train", "--max_steps", "20", "--max_consecutive_skipped_steps", "3")
    run = cpu_run(flags)
    guard = StepGuard(torch.device("cpu"), loss_checked=False, max_consecutive_skips=3)
    step = EagerStep(run.eval.model, run.step.optimizer, "fp32", guard=guard,
                     scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    yield dataclasses.replace(run, step=step, guard=guard)
    run.close()
    run.eval.logger.close()


def test_overflow_steps_are_skipped_counted_and_stop_the_run_after_too_many(fp16_run, tmp_path):
    run = fp16_run
    model, state, scaler = run.eval.model, run.state, run.step.scaler
    poison_training_forwards(model, {2, 3, 5, 6, 7}, math.inf)  # every gradient of those steps overflows
    before = state_of(model)
    trainer.train_step(run, FAR)  # 1: applied
    after_one = state_of(model)
    assert not torch.equal(before["cls.predictions.bias"], after_one["cls.predictions.bias"])
    for _ in range(3):  # 2, 3 skipped; 4 applied (the count of skips in a row starts again)
        trainer.train_step(run, FAR)
    assert (state.step, state.skipped_steps, scaler.get_scale()) == (2, 2, 2.0**8)
    trainer.run_eval(run.eval, state, run.hooks)
    logged = [e for e in mllog_events(tmp_path / "mlperf.log") if e["key"] == "skipped_steps"]
    assert [(e["value"], e["metadata"]["epoch_num"]) for e in logged] == [(2, 32)]
    weights = state_of(model)
    trainer.train_step(run, FAR)  # 5
    trainer.train_step(run, FAR)  # 6
    with pytest.raises(NumericBlowUp, match="3 optimizer steps in a row were skipped for fp16 overflow"):
        trainer.train_step(run, FAR)  # 7: the third skip in a row
    assert (state.step, state.skipped_steps, state.samples) == (2, 5, 56)
    assert_same_tensors(dict(model.state_dict()), weights)  # skipped steps leave the weights alone


def test_a_nan_loss_in_fp32_raises_before_the_optimizer_step(demo_data, tmp_path):
    run = cpu_run(trainer_args(demo_data, tmp_path, "--do_train", "--max_steps", "20"))
    poison_training_forwards(run.eval.model, {1}, math.nan)
    weights = state_of(run.eval.model)
    with pytest.raises(NumericBlowUp, match="not finite"):
        trainer.train_step(run, FAR)
    run.close()
    assert_same_tensors(dict(run.eval.model.state_dict()), weights)
    assert run.step.optimizer.state_dict()["state"] == {}  # no moments were ever updated
    assert (run.state.step, run.state.skipped_steps, run.state.samples) == (0, 1, 8)
