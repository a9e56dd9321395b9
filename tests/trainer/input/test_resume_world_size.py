"""A run checkpoint resumes at another number of ranks: the same samples in every later step.

The data of a step is M = ranks x accumulation micro-batch slots of b items (input/slots.py);
a run saved at 4 ranks x 1 resumes at 2 x 2 or 1 x 4 (same global batch, same micro-batch).

Stream level: the slot layout at one micro-batch per step is each rank's plain stream, every
layout of the same M and b hands out the same micro-batches, a saved position continues at any
of them, and a different M or b is refused with the flags to set.

Trainer level (the real trainer, gloo ranks on the CPU, dropout 0, the default after-all-reduce
clipping): one uninterrupted 4-rank run with --distributed_optimizer and one without, each
checkpointing after every step; resumes from step SAVE_AT at 2 ranks (sharded), 1 rank and 4
ranks unsharded, and from the unsharded checkpoint at 2 ranks sharded. Their final weights
equal the uninterrupted run's up to rounding: every micro-batch is the same, so what differs is
only the order of the gradient sums (micro-batch accumulation instead of a rank sum, the
sharded optimizer's norms from partial sums over other shards) -- the differences
test_sharded_optimizer.py bounds at the optimizer level, so its bound
(`assert_within_rounding`: ROUNDINGS x eps x the longest path of a weight, plus an ulp of the
weight per step) is used here. The path is summed over the uninterrupted run's per-step
checkpoints from step 1 on (it misses the first step's move; the resumed steps, whose sums
differ, all lie after SAVE_AT, so it still covers them). Eval accuracy is a ratio of integer
counts summed over the ranks: it matches exactly unless a rounding flips an argmax, which
weights within ~1e-7 of each other do not on 200 samples.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mlperf_bert.data import dataset as data_module
from mlperf_bert.data.dataset import DataError, PretrainingDataset, discover_shards, read_shard
from mlperf_bert.input.slots import SlotLayout, SlotStream
from mlperf_bert.input.source_factory import open_stream
from mlperf_bert.runtime.distributed import DistEnv
from mlperf_bert.runtime.exits import EXIT_BAD_INPUT
from tests.harness.demo import trainer_args
from tests.harness.launches import Launch, load_checkpoint, log_tail, mllog_events, run_launches
from tests.harness.tensors import assert_within_rounding
from tests.harness.workers.balance import ID_BASE, LIMITS, write_dataset

SEED = 3
LAYOUTS = [(4, 1), (2, 2), (1, 4)]  # (ranks, micro-batches per step): 4 slots each


def uid(item) -> int:
    return int(item[0].input_ids[1]) - ID_BASE


def denv(rank: int, world: int) -> DistEnv:
    return DistEnv(rank, world, rank, world, "127.0.0.1", 0)


def streams(folder: Path, world: int, accumulation: int, micro_batch: int) -> list:
    return [open_stream(str(folder), LIMITS, denv(r, world), micro_batch, SEED, accumulation) for r in range(world)]


def steps_of(ranks: list, accumulation: int, steps: int) -> list[list[list[int]]]:
    """[step][slot] -> uids: each rank's micro-batches of a step, ranks in order (= slot order)."""
    out = []
    for _ in range(steps):
        out.append([[uid(i) for i in rank.next_batch()] for rank in ranks for _ in range(accumulation)])
    return out


def close(ranks: list) -> None:
    for rank in ranks:
        rank.close()


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("plain"), [50, 37, 41], seed=1)


@pytest.mark.parametrize("world", [1, 3])
def test_one_micro_batch_per_step_gives_each_rank_its_plain_stream(plain, world):
    for rank in range(world):
        slot = open_stream(str(plain), LIMITS, denv(rank, world), 4, SEED)
        with PretrainingDataset(discover_shards(plain), LIMITS, rank=rank, world_size=world, items_per_rank_step=4,
                                seed=SEED) as alone:
            for _ in range(2 * alone.steps_in_epoch(0) + 1):  # into the third epoch
                assert [uid(i) for i in slot.next_batch()] == [uid(i) for i in alone.next_batch()]
        slot.close()


def test_every_layout_of_the_same_slots_hands_out_the_same_micro_batches(plain):
    """And each epoch uses every item at most once, each pass over the data exactly once (the
    stream order: an epoch's slot blocks one after the other, as data/dataset.py lays them out)."""
    total, micro_batch, epochs = 128, 3, (10, 11)  # steps of 12 items; 8 and then 4 left over
    per_layout = []
    for world, accumulation in LAYOUTS:
        ranks = streams(plain, world, accumulation, micro_batch)
        per_layout.append(steps_of(ranks, accumulation, sum(epochs) + 2))
        close(ranks)
    assert per_layout[0] == per_layout[1] == per_layout[2]
    stream, first = [], 0
    for steps in epochs:
        epoch = per_layout[0][first:first + steps]
        stream += [u for slot in range(4) for step in epoch for u in step[slot]]
        first += steps
    assert sorted(stream[:total]) == list(range(total))
    assert len(set(stream[total:])) == len(stream) - total  # the second pass, partly


def test_stratified_slots_hand_out_the_same_micro_batches_at_any_world_size(stratified):
    per_layout = []
    for world, accumulation in [(2, 1), (1, 2)]:
        ranks = streams(stratified, world, accumulation, 8)
        per_layout.append(steps_of(ranks, accumulation, 12))
        close(ranks)
    assert per_layout[0] == per_layout[1]
    first = [u for slot in per_layout[0][0] for u in slot]
    assert len(set(first)) == len(first) == 16


@pytest.mark.parametrize("world, accumulation", LAYOUTS[1:])
def test_a_position_saved_at_4_ranks_continues_at_other_world_sizes(plain, world, accumulation):
    saved = streams(plain, 4, 1, 3)
    steps_of(saved, 1, 13)  # into the second epoch
    state = saved[0].state_dict()
    assert all(rank.state_dict() == {**state, "ranks": 4, "accumulation": 1} for rank in saved)
    expected = steps_of(saved, 1, 6)
    close(saved)
    resumed = streams(plain, world, accumulation, 3)
    for rank in resumed:
        rank.load_state_dict(state)
    assert steps_of(resumed, accumulation, 6) == expected
    close(resumed)


@pytest.mark.parametrize("world, accumulation, micro_batch, fix", [
    (2, 1, 2, "set --gradient_accumulation_steps 2 and --train_batch_size 4"),
    (1, 2, 4, "set --gradient_accumulation_steps 4 and --train_batch_size 8"),
    (3, 1, 2, "resume at a number of ranks that divides 4"),
])
def test_another_slot_count_or_micro_batch_is_refused_naming_the_flags(plain, world, accumulation, micro_batch, fix):
    state = SlotLayout(4, 1, 2).record()
    here = SlotLayout(world, accumulation, micro_batch)
    assert here.mismatch(state) == (
        "data position: saved with 4 slots of 2 items per step (4 ranks x 1 accumulation step); "
        f"this run has {world} x {accumulation} of {micro_batch}: {fix}")
    assert SlotLayout(2, 2, 2).mismatch(state) is None


def test_positions_without_slots_or_inside_a_step_are_refused(plain):
    with PretrainingDataset(discover_shards(plain), LIMITS, rank=0, world_size=2, items_per_rank_step=3,
                            seed=SEED) as old:
        old_state = old.state_dict()  # what a version-1 checkpoint held
    stream = open_stream(str(plain), LIMITS, denv(0, 1), 3, SEED, 2)
    with pytest.raises(DataError, match="saved without micro-batch slots"):
        stream.load_state_dict(old_state)
    stream.next_batch()
    with pytest.raises(DataError, match="saved after micro-batch 1 of a step"):
        stream.load_state_dict(stream.state_dict())
    stream.close()


def test_the_slots_of_a_rank_share_one_reader(plain, monkeypatch):
    """Four slots on one rank over three shards: each shard read once, on one thread."""
    reads: list[str] = []

    def recording_read(path, limits):
        reads.append(Path(path).name)
        return read_shard(path, limits)

    monkeypatch.setattr(data_module, "read_shard", recording_read)
    stream = open_stream(str(plain), LIMITS, denv(0, 1), 3, SEED, 4)
    assert isinstance(stream, SlotStream)
    for _ in range(8):
        stream.next_batch()
    stream.close()
    assert sorted(reads) == sorted(p.name for p in discover_shards(plain))


# ---------------------------------------------------------------- the trainer

SAVE_AT, STEPS, MICRO_BATCH = 3, 6, 2  # 6 steps of 4 slots x 2 samples; evals every 16 samples
GLOBAL = 4 * MICRO_BATCH


def _flags(data: Path, config: Path, out: Path, world: int, *extra: str) -> list[str]:
    accumulation = 4 // world
    return trainer_args(data, out, "--do_train", "--bert_config_path", str(config), "--max_steps", str(STEPS),
                        "--train_batch_size", str(MICRO_BATCH * accumulation),
                        "--gradient_accumulation_steps", str(accumulation), "--eval_iter_samples", "16",
                        "--checkpoint_every_samples", str(GLOBAL), "--keep_checkpoints", "100", *extra)


def _checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"ckpt-{step * GLOBAL:012d}.pt"


RESUMES = {  # name: (ranks, the uninterrupted run it continues, flags)
    "sharded-w2": (2, "sharded", ["--distributed_optimizer"]),
    "w1": (1, "sharded", ["--distributed_optimizer"]),  # one rank: nothing to shard
    "unsharded-w4": (4, "sharded", []),
    "sharded-w2-from-unsharded": (2, "unsharded", ["--distributed_optimizer"]),
    "balanced-sharded-w2": (2, "sharded", ["--distributed_optimizer", "--balance", "global_presort"]),
}
REFUSED = {  # name: (ranks, train_batch_size, accumulation, the fix the error line names)
    "global-batch-w2": (2, 2, 1, "set --gradient_accumulation_steps 2 and --train_batch_size 4"),
    "micro-batch-w1": (1, 8, 2, "set --gradient_accumulation_steps 4 and --train_batch_size 8"),
}


@pytest.fixture(scope="module")
def runs(demo_data, tmp_path_factory) -> Path:
    """Every launch in one go, in order: the uninterrupted runs, every resume, the refused resumes
    (`run_launches`: one process per rank, each running its rank of every launch in turn)."""
    out = tmp_path_factory.mktemp("world_size")
    config = out / "bert_config_no_dropout.json"
    bert = json.loads((demo_data / "bert_config.json").read_text())
    config.write_text(json.dumps({**bert, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}))
    full = {"sharded": (4, ["--distributed_optimizer"]), "unsharded": (4, [])}
    launches = {name: Launch(world, _flags(demo_data, config, out / name, world, *extra), out / name / "logs")
                for name, (world, extra) in full.items()}
    for name, (world, source, extra) in RESUMES.items():
        flags = _flags(demo_data, config, out / name, world, *extra, "--resume_from_checkpoint",
                       str(_checkpoint(out / source, SAVE_AT)))
        launches[name] = Launch(world, flags, out / name / "logs")
    for name, (world, batch, accumulation, _) in REFUSED.items():
        flags = _flags(demo_data, config, out / name, 4, "--train_batch_size", str(batch),
                       "--gradient_accumulation_steps", str(accumulation), "--resume_from_checkpoint",
                       str(_checkpoint(out / "sharded", SAVE_AT)))
        launches[name] = Launch(world, flags, out / name / "logs")
    codes = run_launches(launches, out / "launches")
    for name, launch in launches.items():
        expect = EXIT_BAD_INPUT if name in REFUSED else 0
        assert codes[name] == [expect] * launch.world, (name, codes[name], log_tail(launch.logs / "rank0.err"))
    return out


def _weights(path: Path) -> torch.Tensor:
    model = load_checkpoint(path)["model"]
    return torch.cat([t.flatten() for t in model.values() if t.is_floating_point()])


def _path(run: Path) -> torch.Tensor:
    """Each weight's path over the run: the sum of its moves between the per-step checkpoints."""
    weights = [_weights(_checkpoint(run, step)) for step in range(1, STEPS + 1)]
    return sum(((b - a).abs() for a, b in zip(weights, weights[1:])), torch.zeros_like(weights[0]))


def _evals(run: Path) -> dict[int, tuple[float, float]]:
    events = mllog_events(run / "mlperf.log")
    loss = {e["metadata"]["epoch_num"]: e["value"] for e in events if e["key"] == "eval_loss"}
    return {e["metadata"]["epoch_num"]: (e["value"], loss[e["metadata"]["epoch_num"]])
            for e in events if e["key"] == "eval_accuracy"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sharded-w2", "w1", "unsharded-w4", "sharded-w2-from-unsharded"])
def test_distributed_optimizer_checkpoint_resumes_at_other_world_sizes_like_the_uninterrupted_run(runs, name):
    """Resumed at 2 x 2, 1 x 4 or 4 x 1 unsharded (and an unsharded checkpoint at 2 x 2 sharded):
    the final weights within rounding of the uninterrupted run's, the same evals, train state and
    data position."""
    world, source, _ = RESUMES[name]
    full, resumed = runs / source, runs / name
    path = _path(full)
    assert path.max() > 1e-3  # training moved the weights
    assert_within_rounding(_weights(_checkpoint(resumed, STEPS)), _weights(_checkpoint(full, STEPS)), path,
                           STEPS - SAVE_AT)
    end_full, end_resumed = (load_checkpoint(_checkpoint(run, STEPS)) for run in (full, resumed))
    assert end_resumed["data"] == {**end_full["data"], "ranks": world, "accumulation": 4 // world}
    assert end_resumed["train_state"]["samples"] == end_full["train_state"]["samples"] == STEPS * GLOBAL
    evals_full, evals_resumed = _evals(full), _evals(resumed)
    assert sorted(evals_resumed) == [s for s in sorted(evals_full) if s > SAVE_AT * GLOBAL] == [32, 48]
    for samples, (accuracy, loss) in evals_resumed.items():
        assert accuracy == evals_full[samples][0]
        assert loss == pytest.approx(evals_full[samples][1], rel=1e-5)
    note = (f"ckpt-{SAVE_AT * GLOBAL:012d}.pt: written at 4 ranks, resumed at {world} x {4 // world} micro-batches: "
            "every step trains on the same samples")
    assert (note in (resumed / "logs" / "rank0.err").read_text()) == (world != 4)


@pytest.mark.slow
def test_a_balanced_distributed_optimizer_resume_at_other_world_size_is_allowed_and_says_it_regroups(runs):
    """--balance global_presort deals a step's samples over the ranks per micro-batch: at 2 ranks
    the same samples train in each step, grouped into other micro-batches. Allowed, said in one
    line, and the run ends at the same data position."""
    err = (runs / "balanced-sharded-w2" / "logs" / "rank0.err").read_text()
    assert "; --balance global_presort groups them into other micro-batches over 2 ranks" in err
    end_full, end = (load_checkpoint(_checkpoint(runs / run, STEPS)) for run in ("sharded", "balanced-sharded-w2"))
    assert end["data"]["stream"] == end_full["data"]["stream"]
    assert end["train_state"]["samples"] == STEPS * GLOBAL


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_resume_with_another_global_batch_or_micro_batch_is_refused_with_one_line(runs, name):
    world, batch, accumulation, fix = REFUSED[name]
    checkpoint = _checkpoint(runs / "sharded", SAVE_AT)
    errors = [line for line in (runs / name / "logs" / "rank0.err").read_text().splitlines()
              if line.startswith("error:")]
    assert errors == [  # every rank exited 2 (the fixture checks); rank 0 says why
        f"error: {checkpoint}: data position: saved with 4 slots of 2 items per step (4 ranks x 1 accumulation "
        f"step); this run has {world} x {accumulation} of {batch // accumulation}: {fix}"]
    assert not (runs / name / "checkpoints").exists()  # nothing trained
