"""The trainer's hooks and guards fed by hand: each decides from its events alone."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from mlperf_bert.train.faults import NumericBlowUp, Position, Preempted, StepFacts, StepGuard, StopRequest, Verdict
from mlperf_bert.hooks.events import BlockEnd, EvalEnd, RunEnd, RunStart, StepEnd
from mlperf_bert.hooks.mllog import MLPerfLogger
from mlperf_bert.input.sources import TokenImbalance
from mlperf_bert.hooks.train_hooks import EvalLine, MLPerfLog, PeriodicCheckpoints, Preemption, RankLoad
from tests.harness.launches import mllog_events


def step_end(step: int, samples: int, verdict: Verdict = Verdict(), loss: float = 1.0) -> StepEnd:
    return StepEnd(step, samples, torch.tensor(loss), 1e-3, 100, 0, 10**9, verdict)


class Every16:
    """Stands in for train_checkpoint.Checkpointer: a checkpoint every 16 samples."""

    def samples_due(self, before: int, after: int) -> bool:
        return after // 16 > before // 16


class RecordingWriter:
    def __init__(self) -> None:
        self.checkpointer, self.saved = Every16(), []

    def save(self, reason: str, data_state: dict | None = None) -> Path:
        self.saved.append(reason)
        return Path("ckpt")


def test_preemption_stops_only_on_an_agreed_signal():
    hook = Preemption()
    hook.step_end(step_end(3, 24))
    with pytest.raises(Preempted, match="SIGTERM arrived; every rank stopped after step 4 \\(32 samples\\)"):
        hook.step_end(step_end(4, 32, Verdict(stop_signal=int(signal.SIGTERM))))


def test_periodic_checkpoints_follow_samples_and_the_agreed_clock():
    writer = RecordingWriter()
    hook = PeriodicCheckpoints(writer, global_batch_size=8)
    saved_at = []
    for step in range(1, 7):
        due = Verdict(checkpoint_due=step == 3)  # rank 0's clock, agreed at step 3
        before = len(writer.saved)
        hook.step_end(step_end(step, 8 * step, due))
        if len(writer.saved) > before:
            saved_at.append(step)
    assert saved_at == [2, 3, 4, 6] and set(writer.saved) == {"periodic"}


def test_mlperf_log_writes_eval_results_and_the_run_end(tmp_path):
    logger = MLPerfLogger(str(tmp_path / "mlperf.log"), 0)
    hook = MLPerfLog(logger, eval_samples=200)
    hook.eval_end(EvalEnd(step=4, samples=32, accuracy=0.5, loss=2.0, seconds=0.1, skipped_steps=1))
    hook.run_end(RunEnd("aborted", step=6, samples=48, seconds=3.0))
    logger.close()
    events = [(e["key"], e["value"], e["metadata"].get("epoch_num")) for e in mllog_events(tmp_path / "mlperf.log")]
    assert events == [("eval_accuracy", 0.5, 32), ("eval_loss", 2.0, 32), ("skipped_steps", 1, 32),
                      ("run_stop", None, 48), ("train_samples", 48, None), ("eval_samples", 200, None)]


def test_a_run_that_fails_after_run_start_still_ends_its_log_aborted(tmp_path):
    """close() (called on every way out of a run) logs run_stop aborted once, only for a run that
    started and had no run_end; a log that cannot be written then does not hide the run's own error."""
    logger = MLPerfLogger(str(tmp_path / "mlperf.log"), 0)
    never_started = MLPerfLog(logger, eval_samples=200)
    never_started.close()
    finished = MLPerfLog(logger, eval_samples=200)
    finished.run_start(RunStart(0, 0, 96, 16, tmp_path))
    finished.run_end(RunEnd("success", step=6, samples=96, seconds=1.0))
    finished.close()
    failed = MLPerfLog(logger, eval_samples=200)
    failed.run_start(RunStart(32, 2, 96, 16, tmp_path, resumed=True))
    failed.step_end(step_end(3, 48))
    failed.close()
    failed.close()
    logger.close()
    stops = [(e["metadata"]["status"], e["metadata"]["epoch_num"]) for e in mllog_events(tmp_path / "mlperf.log")
             if e["key"] == "run_stop"]
    assert stops == [("success", 96), ("aborted", 48)]

    class FullDisk(MLPerfLogger):
        def run_stop(self, status: str, epoch_num: int | None = None) -> None:
            raise OSError(28, "No space left on device")

    broken = MLPerfLog(FullDisk(None, 0), eval_samples=200)
    broken.run_start(RunStart(0, 0, 96, 16, tmp_path))
    broken.close()  # no OSError


class Loads:
    """Stands in for DeviceInput: each gather, the loads of the micro-batches since the last one."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.gathers = 0
        self.pending = [TokenImbalance(np.array([10, 30]), np.array([5, 15])),
                        TokenImbalance(np.array([40]), np.array([20]))]

    def token_imbalance(self) -> TokenImbalance:
        self.gathers += 1
        return self.pending.pop(0) if self.pending else TokenImbalance.empty()


def test_rank_load_gathers_at_progress_lines_and_logs_each_interval(tmp_path):
    logger = MLPerfLogger(str(tmp_path / "mlperf.log"), 0)
    loads = Loads()
    hook = RankLoad(loads, logger, log_freq=2)
    hook.step_end(step_end(1, 8))
    assert loads.gathers == 0  # a collective: only at the steps where rank 0 writes a line
    hook.step_end(step_end(2, 16))
    assert loads.gathers == 1 and hook.progress_fields() == "rank_tokens max 20 min 10"
    hook.step_end(StepEnd(3, 24, torch.tensor(1.0), 1e-3, 100, 0, next_eval_samples=24))  # the eval step
    assert loads.gathers == 2 and hook.progress_fields() == "rank_tokens max 40 min 20"
    hook.block_end(BlockEnd(step=3, samples=24))
    logger.close()
    stats = [e for e in mllog_events(tmp_path / "mlperf.log") if e["key"] == "tracked_stats"]
    # The interval's three micro-batches (max 10, 30, 40; min 5, 15, 20), whatever the lines saw.
    assert [(s["value"], s["metadata"]["step"]) for s in stats] == [({"max_rank_tokens": 80 / 3,
                                                                      "min_rank_tokens": 40 / 3}, 3)]


def test_eval_line_prints_on_rank_0_only(capsys):
    event = EvalEnd(step=1, samples=8, accuracy=0.25, loss=3.5, seconds=0.1)
    EvalLine(is_main=False).eval_end(event)
    assert capsys.readouterr().err == ""
    EvalLine(is_main=True).eval_end(event)
    assert capsys.readouterr().err == "eval samples 8 mlm_accuracy 0.2500 mlm_loss 3.5000\n"


def facts(verdict: Verdict, applied: bool, step: int) -> StepFacts:
    return StepFacts(verdict, applied, step, 8 * step, False, lambda: Position({}, {}))


def test_step_guard_returns_its_verdict_and_stops_after_too_many_skips():
    stop = StopRequest()
    guard = StepGuard(torch.device("cpu"), loss_checked=True, max_consecutive_skips=2, stop=stop,
                      checkpoint_due=lambda: True)
    assert guard.check_loss(torch.tensor(1.0)) == Verdict(checkpoint_due=True, loss=1.0)  # read with the flags
    stop.signal_number = int(signal.SIGUSR1)
    verdict = guard.check_loss(torch.tensor(float("inf")))
    assert verdict == Verdict(nonfinite_loss=True, stop_signal=int(signal.SIGUSR1), checkpoint_due=True,
                              loss=float("inf"))
    assert guard.after_step(facts(verdict, True, 1)) is verdict  # per step: the verdict from before the update
    guard.after_step(facts(Verdict(), False, 1))
    with pytest.raises(NumericBlowUp, match="2 optimizer steps in a row were skipped"):
        guard.after_step(facts(Verdict(), False, 1))
