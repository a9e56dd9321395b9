"""The MLPerf clock: no byte of the dataset is read before run_start (training_rules.adoc §11).

Every process of a run records each file it opens under the training and eval folders, with
the time (tests/harness/open_audit/sitecustomize.py: Python's audit hook, and h5py.File, which opens
in C); the MLPerf log's run_start time splits the opens into before and after the clock. Those
audited runs are processes of their own (the hook is installed at start-up); the refusals before
the clock are served by one process of the module (the served_trainer fixture).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pytest

from mlperf_bert.config.closed_division import init_overrun
from mlperf_bert.data.record import RECORD_NAME, FileEntry, Record, read_record, stale_problems
from mlperf_bert.data.shards import REFUSED_NAME
from tests.harness.closed_runs import check_closed_log, closed_run_inputs
from tests.harness.commands import run_cli
from tests.harness.demo import copy_verified, demo_config_env, trainer_args, verify_folder
from tests.harness.launches import mllog_events
from tests.harness.paths import OPEN_AUDIT, REPO, TRAINER
from tests.harness.refusals import refused_before_the_clock


def _audited(env: dict[str, str], log: Path, *folders: Path) -> dict[str, str]:
    return {**env, "PYTHONPATH": os.pathsep.join([str(OPEN_AUDIT), env.get("PYTHONPATH", "")]),
            "OPEN_AUDIT_LOG": str(log), "OPEN_AUDIT_DIRS": os.pathsep.join(map(str, folders))}


def _opens(log: Path) -> list[tuple[float, int, Path]]:
    rows = [line.split(" ", 2) for line in log.read_text().splitlines()] if log.exists() else []
    return [(float(t), int(pid), Path(path)) for t, pid, path in rows]


def _run_start_s(mlperf_log: Path) -> float:
    starts = [e["time_ms"] for e in mllog_events(mlperf_log) if e["key"] == "run_start"]
    assert len(starts) == 1, mlperf_log.read_text()[-2000:]
    return starts[0] / 1000


def _check_clock(audit_log: Path, mlperf_log: Path, train: Path, evals: Path) -> None:
    """Before run_start only the verification records are opened; after it, the shards and the eval set."""
    start = _run_start_s(mlperf_log)
    opens = _opens(audit_log)
    early = sorted({path for t, _, path in opens if t < start})
    assert all(path.name == RECORD_NAME for path in early), early
    late = {path for t, _, path in opens if t >= start}
    assert any(path.parent == train and path.suffix == ".hdf5" for path in late), late
    assert any(path.parent == evals and path.suffix == ".hdf5" for path in late), late


def test_the_demo_config_reads_no_data_before_run_start_in_any_process(demo_data, tmp_path):
    """run_and_time.sh with config_CPU_1x2.sh: torchrun and its two workers, open division. Rank 0 is
    held for 3 s at its MLPerf log's first write, just before run_start: rank 1 may not read meanwhile."""
    train, evals = demo_data / "train", demo_data / "eval"
    log = tmp_path / "mlperf.log"
    env = demo_config_env(demo_data, OUTPUT_DIR=str(tmp_path / "out"), MAX_STEPS="4", WARMUP_STEPS="1",
                          EVAL_ITER_SAMPLES="32", EVAL_ITER_START_SAMPLES="32", MLPERF_LOG_FILE=str(log),
                          OPEN_AUDIT_PAUSE=f"{log}:3")
    done = run_cli(["bash", str(REPO / "run_and_time.sh")], _audited(env, tmp_path / "opens.txt", train, evals))
    assert done.returncode == 0, done.stderr[-3000:]
    _check_clock(tmp_path / "opens.txt", tmp_path / "mlperf.log", train, evals)
    readers = {pid for _, pid, path in _opens(tmp_path / "opens.txt") if path.suffix == ".hdf5"}
    assert len(readers) == 2  # both ranks read their data, each after the clock
    keys = [e["key"] for e in mllog_events(tmp_path / "mlperf.log")]
    assert keys.index("init_duration_seconds") == keys.index("run_start") + 1


@dataclass(frozen=True)
class ClosedInputs:
    """closed_run_inputs, made once for the module: its eval set's verification is a process of its own."""
    folder: Path  # the eval set, the model config and its checkpoint, which the runs only read
    args: tuple[str, ...]

    @property
    def eval(self) -> Path:
        return self.folder / "eval"

    def args_for(self, tmp_path: Path, train: Path | None = None) -> list[str]:
        """The closed run's flags, writing to tmp_path/out, on `train` when given."""
        args = list(self.args)
        args[args.index("--output_dir") + 1] = str(tmp_path / "out")
        if train is not None:
            args[args.index("--input_dir") + 1] = str(train)
        return args


@pytest.fixture(scope="module")
def closed(demo_data, tmp_path_factory) -> ClosedInputs:
    folder = tmp_path_factory.mktemp("closed")
    return ClosedInputs(folder, tuple(closed_run_inputs(demo_data, folder)))


def test_a_closed_run_reads_no_data_before_run_start_and_logs_the_rules_it_kept(demo_data, closed, tmp_path):
    args = closed.args_for(tmp_path)
    train, evals = demo_data / "train", closed.eval
    done = run_cli([sys.executable, str(TRAINER), *args], env=_audited(dict(os.environ), tmp_path / "o.txt",
                                                                           train, evals))
    assert done.returncode == 0, done.stderr[-3000:]
    _check_clock(tmp_path / "o.txt", tmp_path / "out" / "mlperf.log", train, evals)
    check_closed_log(tmp_path / "out" / "mlperf.log", tmp_path)  # and the closed division's rules, logged


def test_a_closed_run_refuses_a_folder_changed_since_its_verification(served_trainer, demo_data, closed, tmp_path):
    train = copy_verified(demo_data / "train", tmp_path / "train")
    shard = sorted(train.glob("*.hdf5"))[1]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1))
    done = served_trainer.run_in(tmp_path, closed.args_for(tmp_path, train))
    refused_before_the_clock(done, tmp_path, "closed division", str(shard), "changed since it was verified",
                              f"data_prep/verify_dataset.py {train}")


def test_a_closed_run_refuses_a_folder_without_a_record(served_trainer, demo_data, closed, tmp_path):
    train = copy_verified(demo_data / "train", tmp_path / "train")
    (train / RECORD_NAME).unlink()
    done = served_trainer.run_in(tmp_path, closed.args_for(tmp_path, train))
    refused_before_the_clock(done, tmp_path, f"no {RECORD_NAME}", "verify_dataset.py")


def test_a_closed_run_refuses_training_data_not_checked_against_its_eval_set(served_trainer, demo_data, closed,
                                                                            tmp_path):
    train = copy_verified(demo_data / "train", tmp_path / "train")
    verify_folder(train, "--max_seq_length", "64", "--max_predictions", "10")  # no eval set given
    done = served_trainer.run_in(tmp_path, closed.args_for(tmp_path, train))
    refused_before_the_clock(done, tmp_path, "was not checked for samples of the eval set", "§6.5",
                              f"--eval_dir {closed.eval}")


def test_a_failed_verification_is_refused_in_the_open_division_too(served_trainer, demo_data, tmp_path):
    train = copy_verified(demo_data / "train", tmp_path / "train")
    shutil.copy2(sorted(train.glob("*.hdf5"))[0], train / "part_00002_of_00003.hdf5")  # a copied shard
    verify = run_cli([sys.executable, "data_prep/verify_dataset.py", str(train), "--workers", "1"])
    assert verify.returncode == 1 and not read_record(train).ok
    args = trainer_args(demo_data, tmp_path / "out", "--do_train")
    args[args.index("--input_dir") + 1] = str(train)
    done = served_trainer.run_in(tmp_path, args)
    refused_before_the_clock(done, tmp_path, "verification failed", "byte-identical")


@pytest.fixture(scope="module")
def failed_verification(demo_data, closed, tmp_path_factory) -> Path:
    """The demo's training folder with its third shard a copy of the first, verified against the closed
    eval set (once for the module): the verification fails."""
    train = copy_verified(demo_data / "train", tmp_path_factory.mktemp("copied_shard") / "train")
    first, _, third = sorted(train.glob("*.hdf5"))
    shutil.copy2(first, third)
    verify = run_cli([sys.executable, "data_prep/verify_dataset.py", str(train), "--eval_dir", str(closed.eval),
                      "--workers", "1"])
    assert verify.returncode == 1, verify.stdout + verify.stderr
    return train


@pytest.mark.parametrize("edit", ["status", "status and problems"])
def test_a_closed_run_refuses_a_record_edited_from_failed_to_ok(served_trainer, failed_verification, closed, tmp_path,
                                                                edit):
    """A copied shard fails the verification; the record's status changed by hand to ok (and its problems
    emptied too) still holds the two equal sha256s: one line naming the record and the command to rewrite it."""
    train = copy_verified(failed_verification, tmp_path / "train")
    first, _, third = sorted(train.glob("*.hdf5"))
    path = train / RECORD_NAME
    raw = json.loads(path.read_text())
    assert raw["status"] == "failed" and raw["problems"]
    assert raw["files"][first.name]["sha256"] == raw["files"][third.name]["sha256"]
    raw["status"] = "ok"
    if edit == "status and problems":
        raw["problems"] = []
    path.write_text(json.dumps(raw))
    done = served_trainer.run_in(tmp_path, closed.args_for(tmp_path, train))
    error = refused_before_the_clock(done, tmp_path, f"{path}: status ok, yet",
                                      f"`python data_prep/verify_dataset.py {train} --eval_dir {closed.eval}`")
    why = ("it lists 1 problem(s)" if edit == "status" else
           f"{first.name} and {third.name} have the same sha256")
    assert why in error, error


def _record(ok: bool, shas: tuple[str, ...], sequences: tuple[int, ...], problems: tuple[str, ...] = ()) -> Record:
    files = {f"part_{i}.hdf5": FileEntry(100, 1, sha, 10, n) for i, (sha, n) in enumerate(zip(shas, sequences))}
    return Record(Path("/data"), ok, "train", "fixed", files, sum(sequences), 64, 10, 100, None, "d", (), problems)


def test_an_ok_record_contradicts_itself_only_with_problems_or_copies_the_verification_refuses():
    assert _record(True, ("a", "b", "c"), (5, 5, 5)).contradiction is None
    assert _record(True, ("a", "b"), (5, 5), ("part_1.hdf5: row 3 is bad",)).contradiction == (
        "status ok, yet it lists 1 problem(s) the verification found")
    assert _record(True, ("a", "b", "a"), (5, 5, 5)).contradiction == (
        "status ok, yet part_0.hdf5 and part_2.hdf5 have the same sha256: byte-identical shards, which the "
        "verification refuses")
    assert _record(True, ("", ""), (5, 5)).contradiction is None  # --no_checksums: no sha256 written
    assert _record(True, ("a", "a"), (0, 0)).contradiction is None  # empty shards: no samples twice
    assert _record(False, ("a", "a"), (5, 5), ("copies",)).contradiction is None  # failed: refused as failed


def test_an_unverified_folder_trained_anyway_stops_at_the_bad_row_with_run_stop_aborted(served_trainer, demo_data,
                                                                                       tmp_path):
    train = copy_verified(demo_data / "train", tmp_path / "train")
    (train / RECORD_NAME).unlink()
    for shard in sorted(train.glob("*.hdf5")):
        with h5py.File(shard, "r+") as handle:
            handle["input_ids"][5, 1] = 500  # outside the demo's vocabulary of 128
    args = trainer_args(demo_data, tmp_path / "out", "--do_train", "--unverified_data")
    args[args.index("--input_dir") + 1] = str(train)
    done = served_trainer.run_in(tmp_path, args)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"note: --unverified_data: {train}: no {RECORD_NAME}" in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "row 5: input_ids outside [0, vocab_size=128)" in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    events = mllog_events(tmp_path / "out" / "mlperf.log")
    assert [e["key"] for e in events].count("run_start") == 1
    assert events[-1]["key"] == "run_stop" and events[-1]["metadata"]["status"] == "aborted"


# ---------------------------------------------------------------------------------------------
# the record against the files, by os.stat alone


@pytest.fixture()
def verified(demo_data, tmp_path) -> Path:
    return copy_verified(demo_data / "train", tmp_path / "train")


def _change(folder: Path, how: str) -> str:
    shard = sorted(folder.glob("*.hdf5"))[0]
    if how == "mtime":
        os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns - 1))
        return "changed since it was verified"
    if how == "size":
        mtime = shard.stat().st_mtime_ns
        with open(shard, "ab") as handle:
            handle.write(b"\0")
        os.utime(shard, ns=(mtime, mtime))  # the same time: the size alone tells
        return "changed since it was verified"
    if how == "missing":
        shard.unlink()
        return "verified, now missing"
    if how == "unlisted":
        shutil.copy2(shard, folder / "part_extra.hdf5")
        return "a shard the verification did not see"
    if how == "temporary":
        (folder / f".{shard.name}.tmp-123").write_bytes(b"")
        return "a temporary file"
    (folder / REFUSED_NAME).write_text("bad\n")
    return "refused this folder"


@pytest.mark.parametrize("how", ["mtime", "size", "missing", "unlisted", "temporary", "refused"])
def test_each_change_since_the_verification_is_seen_by_stat_alone(verified, how, monkeypatch):
    record = read_record(verified)
    assert record is not None and record.ok and stale_problems(record) == []
    says = _change(verified, how)
    monkeypatch.setattr("builtins.open", lambda *a, **k: pytest.fail("the stale check opened a file"))
    problems = stale_problems(record)
    assert len(problems) == 1 and says in problems[0], problems


def test_the_record_holds_what_the_verification_saw(demo_data):
    from mlperf_bert.data.shards import list_shards, read_samples

    record = read_record(demo_data / "train")
    samples = [read_samples(path) for path in list_shards(demo_data / "train")]
    assert record.sequences == sum(len(s) for s in samples) == record.rows
    assert record.longest == max(int(s.lengths.max()) for s in samples)
    assert record.most_predictions == max(int(s.num_predictions.max()) for s in samples)
    assert record.max_token_id == max(int(max(s.input_ids.max(), s.masked_lm_ids.max())) for s in samples)
    assert record.eval_digests == (read_record(demo_data / "eval").samples_digest,)
    for name, entry in record.files.items():
        assert (entry.bytes, entry.mtime_ns) == ((demo_data / "train" / name).stat().st_size,
                                                 (demo_data / "train" / name).stat().st_mtime_ns)


@pytest.mark.parametrize("limit, says", [("--max_seq_length", "a sequence of 64 tokens, more than --max_seq_length 63"),
                                         ("--max_predictions_per_seq", "more than --max_predictions_per_seq 8"),
                                         ("vocab", "outside vocab_size 127")])
def test_the_record_is_held_against_the_run_limits_before_the_clock(served_trainer, demo_data, tmp_path, limit, says):
    args = trainer_args(demo_data, tmp_path / "out", "--do_train")
    if limit == "vocab":
        bert = json.loads((demo_data / "bert_config.json").read_text())
        (tmp_path / "b.json").write_text(json.dumps({**bert, "vocab_size": 127}))
        args[args.index("--bert_config_path") + 1] = str(tmp_path / "b.json")
    else:
        args[args.index(limit) + 1] = "63" if limit == "--max_seq_length" else "8"
    done = served_trainer.run_in(tmp_path, args)
    refused_before_the_clock(done, tmp_path, says)


@pytest.mark.parametrize("division, minutes, over", [("closed", 30, False), ("closed", 30.02, True),
                                                     ("open", 240, False), ("open", 240.02, True)])
def test_an_initialization_past_the_division_maximum_is_said(division, minutes, over):
    line = init_overrun(minutes * 60, division)
    assert (line is not None) == over
    if over:
        assert f"more than the {30 if division == 'closed' else 240} minutes" in line and "§11" in line


def test_the_graph_shape_from_the_record_holds_the_widest_row_of_every_shard(demo_data, tmp_path):
    """`pack` sizes Q per shard: the static shape is the largest over the shards, as read from them."""
    from mlperf_bert.data.static_batch import StaticShape
    from mlperf_bert.input.data_check import recorded_shape

    packed = tmp_path / "packed"
    done = run_cli([sys.executable, "data_prep/prepare.py", "pack", "--input", str(demo_data / "train"),
                    "--out", str(packed), "--max_seq_length", "64", "--workers", "1"])
    assert done.returncode == 0, done.stderr
    verify_folder(packed, "--max_seq_length", "64", "--max_predictions", "10")
    widths = []
    for shard in sorted(packed.glob("*.hdf5")):
        with h5py.File(shard, "r") as handle:
            widths.append((handle["input_ids"].shape[1], handle["packed_input_len"].shape[1],
                           handle["masked_lm_positions"].shape[1]))
    _, k, q = np.max(widths, axis=0)
    assert recorded_shape(str(packed), 4, 64) == StaticShape(4, 64, int(k), int(q))


def test_a_bad_row_read_by_one_of_two_ranks_ends_the_run_with_run_stop_aborted(demo_data, tmp_path):
    """run_and_time.sh, two ranks, an unverified folder trained anyway (UNVERIFIED_DATA=1) with one bad shard:
    the rank that reads it stops with exit 2; rank 0 (which writes the MLPerf log) ends the log with run_stop
    aborted either way."""
    train = copy_verified(demo_data / "train", tmp_path / "train")
    (train / RECORD_NAME).unlink()
    shard = sorted(train.glob("*.hdf5"))[2]
    with h5py.File(shard, "r+") as handle:
        handle["input_ids"][5, 1] = 500
    env = demo_config_env(demo_data, OUTPUT_DIR=str(tmp_path / "out"), WARMUP_STEPS="1", UNVERIFIED_DATA="1",
                          DATADIR_PHASE2=str(train), MLPERF_LOG_FILE=str(tmp_path / "mlperf.log"))
    done = run_cli(["bash", str(REPO / "run_and_time.sh")], env)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"error: {shard}: row 5: input_ids outside [0, vocab_size=128)" in done.stderr
    assert "Traceback" not in done.stderr
    events = mllog_events(tmp_path / "mlperf.log")
    assert events[-1]["key"] == "run_stop" and events[-1]["metadata"]["status"] == "aborted"


def test_row_counts_come_from_the_record_only_while_it_is_current(verified):
    """A shard rewritten with other rows after its verification: the stream reads its counts from the shards."""
    from mlperf_bert.data.shards import read_samples, write_samples
    from mlperf_bert.input.source_factory import recorded_rows

    shard = sorted(verified.glob("*.hdf5"))[0]
    counts = recorded_rows(str(verified))
    assert counts is not None and counts[shard] == len(read_samples(shard))
    write_samples(shard, read_samples(shard).slice(0, 100), "fixed", 64, 10)
    assert recorded_rows(str(verified)) is None
