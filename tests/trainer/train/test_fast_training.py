"""The trainer's fast path on the CPU: --sync_every, the static packed step, read-ahead input, --compile_mode.

Everything of --cuda_graphs but the capture itself runs here: the static packed batches,
the capturable optimizer with its device learning rate, and the sync window that checks
losses after the update. The graph replay is tested on a GPU in test_fast_path.py.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import h5py
import pytest
import torch
from torch import nn

from mlperf_bert import trainer
from mlperf_bert.optim.loss_scale import DeviceLossScaler, LossScaleReading
from mlperf_bert.train.state import TrainState
from mlperf_bert.build import device_input
from mlperf_bert.config.cli import parse_config
from mlperf_bert.config.settings import ConfigError
from mlperf_bert.optim.capturable import capturable
from mlperf_bert.input.dali_input import dali_available
from mlperf_bert.data.validate import DataError
from mlperf_bert.input.device_input import DeviceInput
from mlperf_bert.runtime.exits import EXIT_DIVERGED
from mlperf_bert.train.faults import NumericBlowUp, Position, StepFacts, StepGuard, Verdict
from mlperf_bert.data.static_batch import packed_shape
from mlperf_bert.model.fp8 import scaling_states
from mlperf_bert.model.fp8_delayed import DelayedFp8Linear
from mlperf_bert.train.step import EagerStep
from mlperf_bert.train.sync_window import InPlaceSnapshot, StateDictSnapshot, SyncWindow
from tests.harness.commands import require_tool, run_cli
from tests.harness.cpu_run import cpu_run
from tests.harness.demo import trainer_args, verify_folder
from tests.harness.launches import Launch, load_checkpoint, log_tail, run_launches
from tests.harness.paths import TRAINER
from tests.harness.tensors import assert_same_tensors

FAR = 10**9  # a block end no test step reaches


@pytest.fixture(scope="module")
def packed_dir(demo_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packed")
    made = run_cli([sys.executable, "data_prep/prepare.py", "--quiet", "pack", "--input", str(demo_data / "train"),
                    "--out", str(out), "--algorithm", "nnlshp", "--max_seq_length", "64",
                    "--max_predictions", "10", "--workers", "1"])
    assert made.returncode == 0, made.stderr[-3000:]
    folder = sorted(out.rglob("*.hdf5"))[0].parent
    verify_folder(folder, "--eval_dir", str(demo_data / "eval"), "--max_seq_length", "64", "--max_predictions", "10")
    return folder


def no_dropout(demo_data: Path, tmp_path: Path) -> str:
    """The demo model's config without dropout, for comparing paths that draw different random numbers."""
    config = json.loads((demo_data / "bert_config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    path = tmp_path / "bert_config_no_dropout.json"
    path.write_text(json.dumps(config))
    return str(path)


def packed_flags(demo_data: Path, packed: Path, out: Path, *extra: str) -> list[str]:
    flags = trainer_args(demo_data, out, "--do_train", "--input_layout", "packed", "--train_batch_size", "4", *extra)
    flags[flags.index("--input_dir") + 1] = str(packed)
    return flags


# ---------------------------------------------------------------- --sync_every


def final_checkpoint(out: Path) -> dict:
    return load_checkpoint(sorted((out / "checkpoints").glob("ckpt-*.pt"))[-1])


@pytest.fixture(scope="module")
def input_runs(demo_data, tmp_path_factory) -> tuple[Path, dict[str, list[int | None]]]:
    """The trainer runs the --sync_every and DALI tests compare, one after the other in one process
    (`run_launches`); each test checks its own runs' exit codes."""
    out = tmp_path_factory.mktemp("input_runs")
    runs = {"sync-1": ["--sync_every", "1"], "sync-4": ["--sync_every", "4"],
            "torch": ["--input_layout", "padded", "--input_pipeline", "torch"],
            "dali": ["--input_layout", "padded", "--input_pipeline", "dali"]}
    launches = {name: Launch(1, trainer_args(demo_data, out / name, "--do_train", "--checkpoint_every_samples", "48",
                                             *extra), out / name / "logs")
                for name, extra in runs.items()}
    return out, run_launches(launches, out / "launches")


def assert_ran(out: Path, codes: dict[str, list[int | None]], *names: str) -> None:
    for name in names:
        assert codes[name] == [0], (name, log_tail(out / name / "logs" / "rank0.err"))


def test_sync_every_trains_bit_for_bit_like_per_step_checks(input_runs):
    out, codes = input_runs
    assert_ran(out, codes, "sync-1", "sync-4")
    per_step, windowed = final_checkpoint(out / "sync-1"), final_checkpoint(out / "sync-4")
    assert windowed["train_state"] == per_step["train_state"]
    assert_same_tensors(windowed["model"], per_step["model"])
    assert_same_tensors(windowed["optimizer"], per_step["optimizer"])


def test_dali_input_trains_bit_for_bit_like_the_torch_input(input_runs):
    require_tool(dali_available(), "NVIDIA DALI (nvidia-dali-cuda120) is not installed")
    out, codes = input_runs
    assert_ran(out, codes, "torch", "dali")
    torch_run, dali_run = final_checkpoint(out / "torch"), final_checkpoint(out / "dali")
    assert dali_run["data"] == torch_run["data"]  # read ahead, yet the position of the last batch used
    assert_same_tensors(dali_run["model"], torch_run["model"])


@pytest.mark.slow
def test_a_nan_inside_a_window_rolls_both_ranks_back_to_the_last_read(demo_data, tmp_path):
    # 2 ranks x 4 samples a step; reads at steps 4 and 8; rank 1's loss is NaN in step 6.
    flags = trainer_args(demo_data, tmp_path, "--do_train", "--train_batch_size", "4", "--max_steps", "8",
                         "--sync_every", "4")
    # The same run stopped cleanly after 4 steps is the state the roll-back must give.
    clean_flags = trainer_args(demo_data, tmp_path / "clean", "--do_train", "--train_batch_size", "4",
                               "--max_steps", "8", "--max_samples_termination", "32",
                               "--checkpoint_every_samples", "32")
    codes = run_launches({"nan": Launch(2, flags, tmp_path / "logs", ("--nan_at_step", "6", "--nan_rank", "1")),
                          "clean": Launch(2, clean_flags, tmp_path / "clean_logs")}, tmp_path / "launches")
    assert codes == {"nan": [EXIT_DIVERGED, EXIT_DIVERGED], "clean": [0, 0]}, \
        (log_tail(tmp_path / "logs" / "rank0.err"), log_tail(tmp_path / "clean_logs" / "rank0.err"))
    error = (tmp_path / "logs" / "rank0.err").read_text()
    assert "between steps 5 and 8; weights, optimizer and data position are rolled back to step 4" in error, \
        error[-2000:]
    rolled = load_checkpoint(tmp_path / "checkpoints" / "ckpt-000000000032.pt")
    assert rolled["run"]["reason"] == "numeric_blowup"
    clean = load_checkpoint(tmp_path / "clean" / "checkpoints" / "ckpt-000000000032.pt")
    assert rolled["train_state"] == clean["train_state"] == {"step": 4, "samples": 32, "skipped_steps": 0,
                                                              "evals": [(32, clean["train_state"]["evals"][0][1])]}
    assert_same_tensors(rolled["model"], clean["model"])
    assert_same_tensors(rolled["optimizer"], clean["optimizer"])
    assert rolled["data"] == clean["data"]


def test_state_dict_snapshot_restores_an_optimizer_that_had_no_state(demo_data, tmp_path):
    run = cpu_run(trainer_args(demo_data, tmp_path, "--do_train"))
    model, optimizer = run.eval.model, run.step.optimizer
    snapshot = StateDictSnapshot(model, optimizer)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.train_step(run, FAR)
    run.close()
    assert optimizer.state_dict()["state"]
    snapshot.restore()
    assert_same_tensors(dict(model.state_dict()), weights)
    assert optimizer.state_dict()["state"] == {}
    assert all("step" not in g for g in optimizer.param_groups)


@pytest.mark.parametrize("kind", [StateDictSnapshot, InPlaceSnapshot])
def test_snapshots_roll_the_delayed_fp8_history_back_with_the_weights(kind):
    """The amax history a roll-back returns to is the good read's, and so is whether a layer had one: a snapshot
    taken before the first step rolls back to layers that calibrate again, one taken later to its scales (the state
    dict holds neither, so a roll-back and the checkpoint after it would keep the bad steps' scales)."""
    torch.manual_seed(0)
    model = nn.Sequential(DelayedFp8Linear.from_linear(nn.Linear(16, 16)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(scale: float) -> None:
        model(scale * torch.randn(4, 16)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    fresh = scaling_states(model)
    snapshot = kind(model, optimizer)
    step(1.0)
    snapshot.restore()
    assert_same_tensors(scaling_states(model), fresh)
    step(1.0)
    snapshot.capture()
    good = scaling_states(model)
    step(100.0)  # another amax, as a step that blew up leaves
    snapshot.restore()
    assert_same_tensors(scaling_states(model), good)
    assert all(s["calibrated"] for s in good.values()) and not any(s["calibrated"] for s in fresh.values())


def facts(step: int, read_now: bool = False) -> StepFacts:
    return StepFacts(Verdict(), True, step, 8 * step, read_now, lambda: Position({"step": step}, {}))


def test_window_reads_only_when_due_and_flags_a_nan_seen_between_reads(demo_data, tmp_path):
    run = cpu_run(trainer_args(demo_data, tmp_path, "--do_train"))
    run.close()
    guard = StepGuard(torch.device("cpu"), loss_checked=True, max_consecutive_skips=3)
    window = SyncWindow(3, guard, StateDictSnapshot(run.eval.model, run.step.optimizer), Position({"step": 0}, {}))
    assert window.check_loss(torch.tensor(1.0)) == Verdict()  # folded on the device, nothing decided
    assert [window.after_step(facts(s)) for s in (1, 2)] == [Verdict(), Verdict()]  # not due: no read
    assert not window.after_step(facts(3)).nonfinite_loss
    assert window.good == Position({"step": 3}, {})
    window.check_loss(torch.tensor(float("nan")))
    window.check_loss(torch.tensor(2.0))  # a finite loss later does not clear it
    assert window.after_step(facts(4)) == Verdict()
    verdict = window.after_step(facts(5, read_now=True))  # before an eval or a checkpoint: read now
    assert verdict.nonfinite_loss and verdict.rolled_back_to == Position({"step": 3}, {})
    assert not window.after_step(facts(6)).nonfinite_loss  # the roll-back cleared the flag


def test_window_uncounts_device_skipped_fp16_steps_and_stops_on_too_many_in_a_row(demo_data, tmp_path):
    """Under fp16 the window's read brings the device scaler's counts: skipped steps are uncounted
    before the position is kept, a non-finite loss is an overflow (no roll-back), and a run of
    skips as long as the limit stops the run at the read."""
    run = cpu_run(trainer_args(demo_data, tmp_path, "--do_train"))
    run.close()
    scaler = DeviceLossScaler("cpu")
    guard = StepGuard(torch.device("cpu"), loss_checked=False, max_consecutive_skips=3)
    window = SyncWindow(3, guard, StateDictSnapshot(run.eval.model, run.step.optimizer), Position({"step": 0}, {}),
                        scaler)
    state = TrainState()
    skips = iter([False, True, True, False, True, True, True])

    def step(read_now: bool = False) -> Verdict:
        scaler._count(torch.tensor(next(skips)))  # what DeviceLossScaler.step records on the device
        window.check_loss(torch.tensor(float("inf")))  # an fp16 overflow's loss: not a blow-up here
        state.advance(True, 8)  # counted as applied until the read
        return window.after_step(StepFacts(Verdict(), True, state.step, state.samples, read_now,
                                           lambda: Position(state.state_dict(), {}), state.uncount))

    assert [step(), step()] == [Verdict(), Verdict()]
    verdict = step()
    assert verdict.loss_scale == LossScaleReading(2.0**16, 1, 2, 2) and not verdict.nonfinite_loss
    assert (state.step, state.skipped_steps, window.good.train_state["step"]) == (1, 2, 1)
    step(read_now=True)  # applied: the run of skips ends at 2
    assert (state.step, state.skipped_steps) == (2, 2)
    step(), step()
    with pytest.raises(NumericBlowUp, match="3 optimizer steps in a row were skipped"):
        step(read_now=True)


# ---------------------------------------------------------------- the static packed step (--cuda_graphs)


def test_packed_shape_reads_k_and_q_from_the_shards(packed_dir, demo_data):
    shape = packed_shape(str(packed_dir), rows=4, row_len=64)
    with h5py.File(sorted(packed_dir.glob("*.hdf5"))[0]) as f:
        per_row = f["packed_masked_lm_len"][:].sum(axis=1)
        assert (shape.max_seqs_per_row, shape.max_predictions) == (3, f["masked_lm_positions"].shape[1])
    assert (shape.rows, shape.row_len) == (4, 64)
    assert per_row.max() <= shape.max_predictions  # every row fits a static batch
    with pytest.raises(DataError, match="not a packed shard.*--input_layout packed"):
        packed_shape(str(demo_data / "train"), rows=4, row_len=64)


def test_static_packed_step_trains_like_the_flat_packed_step(demo_data, packed_dir, tmp_path):
    """--cuda_graphs' step, eager: static shapes, capturable LAMB, device lr, checked by the window."""
    # Without dropout: static batches hold more tokens (padding), so their dropout masks differ.
    flags = packed_flags(demo_data, packed_dir, tmp_path, "--bert_config_path", no_dropout(demo_data, tmp_path))
    flat, static = cpu_run(flags), cpu_run(flags)
    shape = packed_shape(str(packed_dir), rows=4, row_len=64)
    optimizer = capturable(static.step.optimizer)
    window = SyncWindow(2, StepGuard(torch.device("cpu"), True, 3), InPlaceSnapshot(static.eval.model, optimizer),
                        Position({}, {}))
    static.data.close()
    feed = device_input(static.cfg, torch.device("cpu"), static.source, shape)
    static = dataclasses.replace(static, step=EagerStep(static.eval.model, optimizer, "fp32", guard=window),
                                 guard=window, data=feed)
    assert isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)
    for _ in range(5):
        flat_loss = trainer.train_step(flat, FAR)
        static_loss = trainer.train_step(static, FAR)
        torch.testing.assert_close(static_loss, flat_loss, rtol=1e-5, atol=1e-6)
        assert static.data.state_dict() == flat.data.state_dict()
    assert (static.state.step, static.state.samples) == (flat.state.step, flat.state.samples) == (5, 40)
    assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(flat.schedule.lr_at(4))
    for (name, p), q in zip(flat.eval.model.named_parameters(), static.eval.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=name)
    flat.close()
    static.close()


@pytest.mark.parametrize("extra, message", [
    (["--cuda_graphs", "--device", "cuda", "--input_layout", "unpadded"], "static shapes: use it with --input_layout packed"),
    (["--cuda_graphs", "--device", "cuda", "--input_layout", "packed", "--optimizer_impl", "reference"],
     "--cuda_graphs needs --optimizer_impl foreach"),
    (["--sync_every", "0"], "--sync_every"),
    (["--sync_every", "5", "--precision", "fp16", "--device", "cuda", "--optimizer_impl", "apex"],
     "--precision fp16 with --sync_every > 1 needs --optimizer_impl foreach"),
    (["--compile_mode", "reduce-overhead"], "compile_mode"),
])
def test_fast_path_flags_are_checked(demo_data, tmp_path, extra, message):
    with pytest.raises((ConfigError, SystemExit)) as caught:
        parse_config(trainer_args(demo_data, tmp_path, "--do_train", *extra), 1)
    if caught.type is ConfigError:
        assert message in str(caught.value)


GRAPHS = ["--cuda_graphs", "--device", "cuda", "--input_layout", "packed"]


@pytest.mark.parametrize("extra, world_size, device_scaled", [
    ([*GRAPHS, "--precision", "fp16"], 1, True),
    ([*GRAPHS, "--gradient_accumulation_steps", "2"], 1, False),
    (GRAPHS, 8, False),
    (["--sync_every", "5", "--precision", "fp16", "--device", "cuda"], 8, True),
    (["--precision", "fp16", "--device", "cuda"], 8, False),  # per-step reads: GradScaler
])
def test_graphs_take_many_ranks_accumulation_and_fp16(demo_data, tmp_path, extra, world_size, device_scaled):
    cfg = parse_config(trainer_args(demo_data, tmp_path, "--do_train", *extra), world_size)
    assert (cfg.device_loss_scaling, cfg.device_steps) == (device_scaled, device_scaled or "--cuda_graphs" in extra)


# ---------------------------------------------------------------- read-ahead input


@dataclasses.dataclass
class Flat:
    values: torch.Tensor
    input_mask: torch.Tensor  # the real tokens DeviceInput counts

    def to(self, device: torch.device, non_blocking: bool = False) -> "Flat":
        return Flat(self.values.to(device, non_blocking=non_blocking), self.input_mask)


class CountingSource:
    """A BatchSource stand-in whose position is the number of batches read."""

    def __init__(self) -> None:
        self.read = 0

    def next_flat_batch(self) -> Flat:
        self.read += 1
        return Flat(torch.full((3,), self.read), torch.ones(3))

    def state_dict(self) -> dict:
        return {"step": self.read}


@pytest.mark.parametrize("pipeline", ["torch", "dali"])
def test_read_ahead_hands_out_the_same_batches_and_keeps_the_position_of_the_last_one(pipeline):
    if pipeline == "dali":
        require_tool(dali_available(), "NVIDIA DALI (nvidia-dali-cuda120) is not installed")
    plain, ahead = CountingSource(), CountingSource()
    build = lambda source: source.next_flat_batch()  # noqa: E731
    plain_input = DeviceInput(plain, build, torch.device("cpu"))
    ahead_input = DeviceInput(ahead, build, torch.device("cpu"), ahead=True, pipeline=pipeline)
    for step in range(1, 6):
        assert torch.equal(ahead_input.next().values, plain_input.next().values)
        assert ahead_input.state_dict() == plain_input.state_dict() == {"step": step}
        assert ahead.read > step  # the next batch is already read
    ahead_input.close()


# ---------------------------------------------------------------- --compile_mode


@pytest.mark.slow
def test_compiled_layers_train_like_eager_ones(demo_data, tmp_path):
    """Inductor on the CPU (C++ kernels): about a minute, most of it compiling.

    Without dropout: compiled dropout draws its own random numbers.
    """
    config = no_dropout(demo_data, tmp_path)
    launches = {mode: Launch(1, trainer_args(demo_data, tmp_path / mode, "--do_train", "--max_steps", "3",
                                             "--bert_config_path", config, "--checkpoint_every_samples", "24",
                                             "--compile_mode", mode, "--device", "cpu"), tmp_path / mode / "logs")
                for mode in ("none", "default")}  # one process, the eager run first (it traces nothing)
    for mode, codes in run_launches(launches, tmp_path / "launches").items():
        assert codes == [0], log_tail(tmp_path / mode / "logs" / "rank0.err")
    eager, compiled = final_checkpoint(tmp_path / "none"), final_checkpoint(tmp_path / "default")
    assert eager["model"].keys() == compiled["model"].keys()  # the checkpoint keeps the plain names
    for name, weight in eager["model"].items():
        torch.testing.assert_close(compiled["model"][name], weight, rtol=1e-3, atol=1e-5, msg=name)


# ---------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_run_trains_like_the_eager_packed_run(demo_data, packed_dir, tmp_path):
    """The trainer with --cuda_graphs against the same run stepping eagerly, fp32, no dropout."""
    config = no_dropout(demo_data, tmp_path)
    for name, extra in (("eager", []), ("graph", ["--cuda_graphs", "--sync_every", "3"])):
        args = packed_flags(demo_data, packed_dir, tmp_path / name, "--bert_config_path", config, "--device", "cuda",
                            "--optimizer_impl", "foreach", "--checkpoint_every_samples", "48", *extra)
        result = run_cli([sys.executable, str(TRAINER), *args])
        assert result.returncode == 0, result.stderr[-3000:]
    eager, graph = final_checkpoint(tmp_path / "eager"), final_checkpoint(tmp_path / "graph")
    assert graph["train_state"]["step"] == eager["train_state"]["step"] == 6
    for name, weight in eager["model"].items():
        torch.testing.assert_close(graph["model"][name], weight, rtol=1e-3, atol=1e-5, msg=name)
