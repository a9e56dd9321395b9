"""Run checkpoints: a resumed run continues bitwise like the uninterrupted one; files are safe."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from mlperf_bert.model.fp8 import scaling_states
from mlperf_bert.model.fp8_delayed import DelayedFp8Linear
from mlperf_bert.runtime.distributed import DistEnv
from mlperf_bert.train.checkpoint import (
    FORMAT,
    Checkpointer,
    ResumeError,
    TrainingParts,
    choose_resume,
    derived_rng_seed,
    list_checkpoints,
    read_checkpoint,
    restore,
    rng_state,
    set_rng_state,
    write_atomic,
)
from tests.harness.demo import trainer_args
from tests.harness.launches import (Launch, load_checkpoint, log_tail, losses, mllog_events, run_launches, run_ranks,
                                    worker_command)
from tests.harness.tensors import assert_same_tensors

SINGLE = DistEnv(0, 1, 0, 1, "127.0.0.1", 0)


def _flags(demo_data: Path, out: Path, *extra: str) -> list[str]:
    # 8 steps of 8 samples; evals at 24, 48 and 64 (max_steps); checkpoints every 16 samples.
    return trainer_args(demo_data, out, "--do_train", "--max_steps", "8", "--eval_iter_samples", "24",
                        "--checkpoint_every_samples", "16", "--keep_checkpoints", "10", *extra)


def _evals(log: Path) -> list[tuple[int, float, float]]:
    events = mllog_events(log)
    accuracy = {e["metadata"]["epoch_num"]: e["value"] for e in events if e["key"] == "eval_accuracy"}
    loss = {e["metadata"]["epoch_num"]: e["value"] for e in events if e["key"] == "eval_loss"}
    return sorted((samples, accuracy[samples], loss[samples]) for samples in accuracy)


@pytest.mark.slow
def test_resumed_run_matches_the_uninterrupted_run_bitwise(demo_data, tmp_path):
    assert json.loads((demo_data / "bert_config.json").read_text())["hidden_dropout_prob"] > 0  # RNG matters
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert run_ranks(worker_command(_flags(demo_data, full), full / "rec"), 1, full / "logs") == [0]
    assert [p.name for p in list_checkpoints(full / "checkpoints")] == [
        f"ckpt-{s:012d}.pt" for s in (16, 32, 48, 64)]
    # 48 samples is also an eval point: the checkpoint precedes that eval, so the resumed run owes it.
    start = full / "checkpoints" / "ckpt-000000000048.pt"
    flags = _flags(demo_data, resumed, "--resume_from_checkpoint", str(start))
    assert run_ranks(worker_command(flags, resumed / "rec"), 1, resumed / "logs") == [0]

    assert losses(resumed / "rec") == losses(full / "rec")[6:]  # steps 7 and 8, exact floats
    final_full, final_resumed = (load_checkpoint(d / "checkpoints" / "ckpt-000000000064.pt") for d in (full, resumed))
    for part in ("model", "optimizer"):
        assert_same_tensors(final_full[part], final_resumed[part])
    assert final_full["train_state"] == final_resumed["train_state"]
    assert final_resumed["run"]["attempt"] == 2
    assert _evals(resumed / "mlperf.log") == [e for e in _evals(full / "mlperf.log") if e[0] >= 48]

    keys = [e["key"] for e in mllog_events(resumed / "mlperf.log")]
    assert "run_start" not in keys and keys.count("resumed_from_checkpoint") == 1  # never a timing result
    event = next(e for e in mllog_events(resumed / "mlperf.log") if e["key"] == "resumed_from_checkpoint")
    assert event["value"] == str(start) and event["metadata"]["epoch_num"] == 48 and event["metadata"]["step"] == 6


# FP8 runs, name: (ranks, flags): the delayed recipe and a torchao one. 4 steps; the resumed runs start from the
# checkpoint after step 2. One rank: the checkpoint keeps each rank's history, but under DDP every forward takes
# rank 0's (DDP broadcasts buffers), so more ranks would tell nothing more.
FP8_RUNS = {"delayed": (1, ("--fp8_recipe", "delayed")), "tensorwise": (1, ("--fp8_recipe", "tensorwise"))}


@pytest.fixture(scope="module")
def fp8_runs(demo_data, tmp_path_factory):
    """Each FP8 run's uninterrupted run and its resume from the middle, in one process per rank."""
    out = tmp_path_factory.mktemp("fp8_resume")
    launches = {}
    for name, (world, flags) in FP8_RUNS.items():
        fp8 = ("--precision", "fp8", *flags, "--max_steps", "4")
        full, resumed = out / f"{name}_full", out / f"{name}_resumed"
        start = full / "checkpoints" / f"ckpt-{16 * world:012d}.pt"
        for run, extra in ((full, ()), (resumed, ("--resume_from_checkpoint", str(start)))):
            launches[run.name] = Launch(world, _flags(demo_data, run, *fp8, *extra), run / "logs",
                                        ("--record", str(run / "rec")))
    for name, codes in run_launches(launches, out / "launches").items():
        assert codes == [0] * len(codes), (name, log_tail(launches[name].logs / "rank0.err"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", FP8_RUNS)
def test_fp8_run_resumes_bitwise_like_the_uninterrupted_run(fp8_runs, name):
    """FP8 state is training state: the delayed recipe's amax history (model/fp8_delayed.py) scales the first
    resumed step as it scaled that step in the uninterrupted run; torchao's recipes keep no state between steps.
    Losses of every rank, the final weights, optimizer and histories: bitwise."""
    world, _ = FP8_RUNS[name]
    full, resumed = fp8_runs / f"{name}_full", fp8_runs / f"{name}_resumed"
    for rank in range(world):
        assert len(losses(full / "rec", rank)) == 4, rank
        assert losses(resumed / "rec", rank) == losses(full / "rec", rank)[2:], rank  # steps 3 and 4, exact floats
    end = f"ckpt-{32 * world:012d}.pt"  # 4 steps of 8 samples a rank
    final_full, final_resumed = (load_checkpoint(d / "checkpoints" / end) for d in (full, resumed))
    for part in ("model", "optimizer", "fp8"):
        assert_same_tensors(final_full[part], final_resumed[part], part)
    histories = final_full["fp8"]
    assert len(histories) == world
    if name.startswith("delayed"):  # one history per FP8 layer and rank
        for history in histories:
            # The fused QKV GEMM keeps its history in the query layer's (bert.fused_projection).
            used = {n for n in history if not n.endswith(("self.key", "self.value"))}
            assert len(history) == 12 and len(used) == 8
            assert all(s["calibrated"] == s["grad_calibrated"] == (n in used) for n, s in history.items())
    else:
        assert histories == [{}] * world


@pytest.mark.slow
def test_resuming_a_run_that_reached_its_target_trains_no_further(demo_data, tmp_path):
    """A job killed after its run ended (its end checkpoint written) and started again with `auto`."""
    done, again = tmp_path / "done", tmp_path / "again"
    flags = _flags(demo_data, done, "--target_mlm_accuracy", "0.0001")  # the first eval (24 samples) succeeds
    assert run_ranks(worker_command(flags, done / "rec"), 1, done / "logs") == [0]
    end = list_checkpoints(done / "checkpoints")[-1]
    assert end.name == "ckpt-000000000024.pt" and len(losses(done / "rec")) == 3
    resumed = _flags(demo_data, again, "--target_mlm_accuracy", "0.0001", "--resume_from_checkpoint", str(end))
    assert run_ranks(worker_command(resumed, again / "rec"), 1, again / "logs") == [0]
    assert losses(again / "rec") == []  # not one more step
    assert [p.name for p in list_checkpoints(again / "checkpoints")] == [end.name]
    for part in ("model", "optimizer", "train_state", "data"):
        assert_same_tensors(load_checkpoint(end)[part], load_checkpoint(again / "checkpoints" / end.name)[part])
    stops = [e for e in mllog_events(again / "mlperf.log") if e["key"] == "run_stop"]
    assert [(e["metadata"]["status"], e["metadata"]["epoch_num"]) for e in stops] == [("success", 24)]


def _parts(seed: int = 0) -> TrainingParts:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return TrainingParts(model, optimizer)


def _save(checkpointer: Checkpointer, parts: TrainingParts, samples: int) -> Path:
    state = {"step": samples // 8, "samples": samples, "skipped_steps": 0, "evals": [(8, 0.5)]}
    return checkpointer.save(parts, state, {"epoch": 0, "step": samples // 8}, "periodic")


def test_only_the_newest_checkpoints_are_kept_and_auto_picks_the_newest(tmp_path):
    parts, folder = _parts(), tmp_path / "ckpts"
    checkpointer = Checkpointer(folder, 2, SINGLE, torch.device("cpu"), every_samples=16)
    for samples in (16, 32, 48, 64, 80):
        _save(checkpointer, parts, samples)
    (folder / ".ckpt-000000000096.pt.123.tmp").write_bytes(b"torn")  # a crashed write
    assert [p.name for p in list_checkpoints(folder)] == ["ckpt-000000000064.pt", "ckpt-000000000080.pt"]
    assert choose_resume("auto", folder, SINGLE) == folder / "ckpt-000000000080.pt"
    assert choose_resume("auto", tmp_path / "none_yet", SINGLE) is None
    (folder / "ckpt-1000000000000.pt").write_bytes(b"")  # 13 digits: ordered by number, not by name
    assert list_checkpoints(folder)[-1].name == "ckpt-1000000000000.pt"
    assert checkpointer.samples_due(8, 16) and checkpointer.samples_due(15, 23) and not checkpointer.samples_due(16, 24)


def test_a_crash_while_writing_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    path = tmp_path / "ckpt-000000000016.pt"
    write_atomic({"value": torch.ones(3)}, path)

    def crash(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        write_atomic({"value": torch.zeros(3)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["value"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary file left behind


class _RunsCode:
    def __reduce__(self):
        return (exec, ("open(__import__('os').environ['MARKER'], 'w').close()",))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path, monkeypatch):
    marker = tmp_path / "code_ran"
    monkeypatch.setenv("MARKER", str(marker))
    path = tmp_path / "ckpt-000000000008.pt"
    torch.save({"format": FORMAT, "version": 1, "payload": _RunsCode()}, path)
    with pytest.raises(ResumeError, match="cannot read the checkpoint"):
        read_checkpoint(path)
    assert not marker.exists()


def test_a_checkpoint_restores_into_a_fresh_run_at_any_world_size(tmp_path):
    parts = _parts(seed=1)
    checkpointer = Checkpointer(tmp_path, 3, SINGLE, torch.device("cpu"))
    path = _save(checkpointer, parts, 16)
    fresh = _parts(seed=2)
    ckpt = read_checkpoint(path)
    restore(fresh, ckpt, path, SINGLE, torch.device("cpu"), seed=9)
    assert_same_tensors(fresh.model.state_dict(), parts.model.state_dict())
    assert_same_tensors(fresh.optimizer.state_dict()["state"], parts.optimizer.state_dict()["state"])
    saved = torch.rand(3)  # rank 0 continues its own generator
    # Rank 1 of two: no saved entry; a state from the seed, its rank and the samples, the same every time.
    draws = []
    for _ in range(2):
        restore(_parts(seed=3), ckpt, path, DistEnv(1, 2, 1, 2, "127.0.0.1", 0), torch.device("cpu"), seed=9)
        draws.append((torch.rand(3), np.random.rand(), random.random()))
    assert torch.equal(draws[0][0], draws[1][0]) and draws[0][1:] == draws[1][1:]
    assert not torch.equal(draws[0][0], saved)
    assert derived_rng_seed(9, 1, 16) not in (derived_rng_seed(9, 2, 16), derived_rng_seed(9, 1, 24),
                                              derived_rng_seed(8, 1, 16))


def _delayed_parts(seed: int) -> TrainingParts:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(DelayedFp8Linear.from_linear(torch.nn.Linear(16, 16)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    return TrainingParts(model, optimizer)


def test_a_checkpoint_keeps_the_delayed_fp8_history_and_one_written_without_it_calibrates_again(tmp_path):
    """The amax history is not in the state dict (its keys stay every precision's): the checkpoint keeps it per
    rank under `fp8`. A checkpoint without that key (written before it was kept) still loads: the layers start
    without history and calibrate on their next step's own amax, as a fresh run's first step does."""
    parts = _delayed_parts(seed=1)
    path = _save(Checkpointer(tmp_path, 3, SINGLE, torch.device("cpu")), parts, 16)
    saved = scaling_states(parts.model)
    assert list(parts.model.state_dict()) == ["0.weight", "0.bias"]
    fresh = _delayed_parts(seed=2)
    restore(fresh, read_checkpoint(path), path, SINGLE, torch.device("cpu"), seed=9)
    assert_same_tensors(scaling_states(fresh.model), saved)
    assert saved["0"]["calibrated"] and saved["0"]["grad_calibrated"]
    older = tmp_path / "ckpt-000000000008.pt"
    torch.save({k: v for k, v in load_checkpoint(path).items() if k != "fp8"}, older)
    restore(fresh, read_checkpoint(older), older, SINGLE, torch.device("cpu"), seed=9)
    layer = fresh.model[0]
    assert not layer.calibrated and not layer.grad_calibrated and layer.amax.eq(0).all()
    assert_same_tensors(fresh.model.state_dict(), parts.model.state_dict())


def test_a_version_1_checkpoint_is_refused_naming_why(tmp_path):
    path = tmp_path / "ckpt-000000000008.pt"
    torch.save({"format": FORMAT, "version": 1}, path)
    with pytest.raises(ResumeError, match="version 1, written by an older trainer whose data position depends on "
                                          "the number of ranks"):
        read_checkpoint(path)


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    torch.manual_seed(5)
    np.random.seed(6)
    random.seed(7)
    np.random.normal()  # leaves a cached Gaussian in numpy's state
    write_atomic({"rng": [rng_state(torch.device("cpu"))]}, tmp_path / "rng.pt")
    expected = (torch.rand(4), np.random.normal(size=3), np.random.rand(2), random.random(), random.gauss(0, 1))
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True)["rng"][0], torch.device("cpu"))
    again = (torch.rand(4), np.random.normal(size=3), np.random.rand(2), random.random(), random.gauss(0, 1))
    assert torch.equal(expected[0], again[0])
    for a, b in zip(expected[1:], again[1:]):
        assert np.array_equal(a, b)


def test_resume_needs_a_readable_run_checkpoint(tmp_path):
    init_style = tmp_path / "init.pt"
    torch.save({"model": {"w": torch.ones(1)}}, init_style)
    with pytest.raises(ResumeError, match="not a run checkpoint"):
        read_checkpoint(init_style)
    with pytest.raises(ResumeError, match="not found on this rank"):
        read_checkpoint(tmp_path / "missing.pt")


@pytest.mark.slow
@pytest.mark.parametrize("change, says", [
    (("--train_batch_size", "4"), "data position: saved with 1 slots of 8 items per step"),  # the data position
    (("--bert_config_path", "WIDER"), "does not fit this model or optimizer"),  # another model
    (("--resume_from_checkpoint", "BAD"), "cannot read the checkpoint"),  # another file
])
def test_a_refused_resume_adds_nothing_to_the_log_it_continues(served_trainer, demo_data, tmp_path, change, says):
    out = tmp_path / "run"
    first = served_trainer.run_in(tmp_path, _flags(demo_data, out, "--max_steps", "2",
                                                   "--checkpoint_every_samples", "16"))
    assert first.returncode == 0, first.stderr[-2000:]
    log = (out / "mlperf.log").read_bytes()
    flags = _flags(demo_data, out, "--resume_from_checkpoint", "auto")
    flag, value = change
    if value == "BAD":
        (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
        value = str(tmp_path / "bad.pt")
    if value == "WIDER":
        bert = json.loads((demo_data / "bert_config.json").read_text())
        (tmp_path / "wider.json").write_text(json.dumps({**bert, "intermediate_size": 2 * bert["intermediate_size"]}))
        value = str(tmp_path / "wider.json")
    at = flags.index(flag)
    flags[at + 1] = value
    done = served_trainer.run_in(tmp_path, flags)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0] and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == errors[0]  # the error is the last line, whole
    assert (out / "mlperf.log").read_bytes() == log
