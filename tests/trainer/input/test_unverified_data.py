"""No unchecked data trains: a folder no current verification record vouches for is refused before
run_start with the one command that verifies it; only an open run with --unverified_data trains it,
and then looks for copied shards and eval samples after run_start, where the log and the summary say
the time counted. What the folder listing and the records decide is refused before run_start either way.

Each case as a user meets it: the trainer started as a process on a folder data_prep made (the
session's demo data, changed as the case needs).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from data_prep.verify_dataset import mark_refused
from mlperf_bert.config.cli import parse_config
from mlperf_bert.config.settings import ConfigError
from mlperf_bert.data.dataset import DataError, DataLimits
from mlperf_bert.data.record import RECORD_NAME
from mlperf_bert.input.data_check import UNVERIFIED_CHECK_KEY, check_after_clock, check_data_before_clock
from mlperf_bert.runtime.distributed import dist_env_from
from tests.harness.demo import copy_verified, trainer_args, verify_folder
from tests.harness.launches import mllog_events
from tests.harness.refusals import refused_before_the_clock
from tests.harness.served import Served

FLAG = "--unverified_data"


def _train(served_trainer: Served, demo_data: Path, tmp_path: Path, train: Path,
           *extra: str) -> subprocess.CompletedProcess:
    args = trainer_args(demo_data, tmp_path / "out", "--do_train", *extra)
    args[args.index("--input_dir") + 1] = str(train)
    return served_trainer.run_in(tmp_path, args)


def _verify_command(demo_data: Path, train: Path) -> str:
    return f"`python data_prep/verify_dataset.py {train} --eval_dir {demo_data / 'eval'}`"


def _copied_shards(demo_data: Path, tmp_path: Path) -> Path:
    """The v2.1 shuffle bug's output: every training shard a byte copy of the first, and no record."""
    train = copy_verified(demo_data / "train", tmp_path / "train")
    first, *rest = sorted(train.glob("*.hdf5"))
    for shard in rest:
        shutil.copyfile(first, shard)
    (train / RECORD_NAME).unlink()
    return train


def _eval_shard_in_training(demo_data: Path, tmp_path: Path) -> Path:
    train = copy_verified(demo_data / "train", tmp_path / "train")
    shutil.copy2(next((demo_data / "eval").glob("*.hdf5")), train)
    return train


def _refused_after_run_start(done: subprocess.CompletedProcess, tmp_path: Path, says: str) -> None:
    """The check after run_start stopped the run: one error line; the MLPerf log (run_start, the check and
    its time, run_stop aborted) and the summary say the check ran inside the timed run."""
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert says in errors[0] and "check after run_start" in errors[0] and "inside the timed run" in errors[0]
    keys = [e["key"] for e in mllog_events(tmp_path / "out" / "mlperf.log")]
    assert keys.count("run_start") == 1 and keys.index("run_start") < keys.index(UNVERIFIED_CHECK_KEY)
    events = mllog_events(tmp_path / "out" / "mlperf.log")
    check = next(e for e in events if e["key"] == UNVERIFIED_CHECK_KEY)
    assert check["metadata"]["status"] == "refused" and check["value"] >= 0
    assert events[-1]["key"] == "run_stop" and events[-1]["metadata"]["status"] == "aborted"
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert summary.startswith("status: aborted (the data check after run_start refused the data)")
    assert f"data check: {FLAG}" in summary and "inside the timed run" in summary and "refused the data" in summary


def test_copied_training_shards_without_a_record_are_refused_before_run_start(served_trainer, demo_data, tmp_path):
    train = _copied_shards(demo_data, tmp_path)
    done = _train(served_trainer, demo_data, tmp_path, train)
    refused_before_the_clock(done, tmp_path, f"{train}: no {RECORD_NAME}", _verify_command(demo_data, train), FLAG)
    assert "note:" not in done.stderr  # nothing trains after a note


def test_copied_training_shards_trained_anyway_are_refused_by_the_check_after_run_start(served_trainer, demo_data,
                                                                                        tmp_path):
    train = _copied_shards(demo_data, tmp_path)
    done = _train(served_trainer, demo_data, tmp_path, train, FLAG)
    assert f"note: {FLAG}: {train}: no {RECORD_NAME}" in done.stderr
    _refused_after_run_start(done, tmp_path, "3 byte-identical training shards")


@pytest.mark.parametrize("flag", [False, True])
def test_an_eval_shard_copied_into_training_is_never_trained_on(served_trainer, demo_data, tmp_path, flag):
    train = _eval_shard_in_training(demo_data, tmp_path)
    shard = train / next((demo_data / "eval").glob("*.hdf5")).name
    done = _train(served_trainer, demo_data, tmp_path, train, *([FLAG] if flag else []))
    if not flag:
        refused_before_the_clock(done, tmp_path, f"{shard}: a shard the verification did not see",
                                  _verify_command(demo_data, train))
        return
    _refused_after_run_start(done, tmp_path, f"eval samples of {demo_data / 'eval'} are also training samples")


def _marked_refused(demo_data: Path, tmp_path: Path) -> tuple[Path, str]:
    """A folder data_prep's verification refused (its marker), whose record is gone."""
    train = copy_verified(demo_data / "train", tmp_path / "train")
    mark_refused(train, [f"{train}/part_00001_of_00003.hdf5: row 3: input_ids outside [0, 128)"])
    (train / RECORD_NAME).unlink()
    return train, "data_prep's verification refused this folder (" + f"{train}/part_00001_of_00003.hdf5: row 3"


def _record_of_other_files(demo_data: Path, tmp_path: Path) -> tuple[Path, str]:
    """The eval folder's record copied beside the training shards."""
    train = copy_verified(demo_data / "train", tmp_path / "train")
    shutil.copy2(demo_data / "eval" / RECORD_NAME, train / RECORD_NAME)
    missing = train / next((demo_data / "eval").glob("*.hdf5")).name
    return train, f"{missing}: listed in {RECORD_NAME} but missing"


@pytest.mark.parametrize("case", [_marked_refused, _record_of_other_files])
def test_what_the_listing_and_records_decide_is_refused_before_run_start(served_trainer, demo_data, tmp_path, case):
    """Decided by names and records alone: refused before the clock, even where unverified data may train (the
    run as a user starts it; each verdict with and without the flag is also checked in this process below)."""
    train, says = case(demo_data, tmp_path)
    done = _train(served_trainer, demo_data, tmp_path, train, FLAG)
    refused_before_the_clock(done, tmp_path, says)


@pytest.mark.parametrize("edit", [lambda record: [], lambda record: {**record, "files": list(record["files"])},
                                  lambda record: {**record, "files": {name: [1, 2] for name in record["files"]}}],
                         ids=["a list", "files a list", "entries lists"])
def test_a_record_of_the_wrong_shape_is_one_line_naming_it_and_the_verify_command(served_trainer, demo_data, tmp_path,
                                                                                   edit):
    """VERIFIED.json edited by hand into valid JSON of another shape ended in an AttributeError traceback."""
    train = copy_verified(demo_data / "train", tmp_path / "train")
    record = train / RECORD_NAME
    record.write_text(json.dumps(edit(json.loads(record.read_text()))))
    done = _train(served_trainer, demo_data, tmp_path, train)
    refused_before_the_clock(done, tmp_path, f"{record}: not a readable verification record (",
                              f"run `python data_prep/verify_dataset.py {train}` to verify the folder again")


def test_a_folder_not_checked_against_the_eval_set_is_refused_or_checked_after_run_start(served_trainer, demo_data,
                                                                                         tmp_path):
    """Verified without an eval set: no record says the eval samples are held out. Refused with the command
    that checks it; with the flag the run trains, and the MLPerf log and the summary say the check's time
    counted."""
    train = copy_verified(demo_data / "train", tmp_path / "train")
    verify_folder(train, "--max_seq_length", "64", "--max_predictions", "10")
    refused = _train(served_trainer, demo_data, tmp_path, train)
    refused_before_the_clock(refused, tmp_path, f"{train} was not checked for samples of the eval set",
                              _verify_command(demo_data, train), FLAG)
    done = _train(served_trainer, demo_data, tmp_path, train, FLAG)
    assert done.returncode == 0, done.stderr[-3000:]
    events = mllog_events(tmp_path / "out" / "mlperf.log")
    keys = [e["key"] for e in events]
    assert keys.index("run_start") < keys.index(UNVERIFIED_CHECK_KEY) < keys.index("block_start")
    check = events[keys.index(UNVERIFIED_CHECK_KEY)]
    assert check["metadata"]["status"] == "passed" and "was not checked for samples" in check["metadata"]["why"]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert "ran after run_start" in summary["data_check"] and "found none" in summary["data_check"]
    assert "data check: " in (tmp_path / "out" / "summary.txt").read_text()


def test_the_check_after_run_start_runs_only_where_no_record_vouches(demo_data, tmp_path):
    """The flag with data the records vouch for reads nothing after run_start; unvouched data is checked."""
    args = [*trainer_args(demo_data, tmp_path / "out", "--do_train"), FLAG]
    denv = dist_env_from({})
    assert check_after_clock(parse_config(args, 1), denv) is None
    args[args.index("--input_dir") + 1] = str(_copied_shards(demo_data, tmp_path))
    checked = check_after_clock(parse_config(args, 1), denv)
    assert checked is not None and "byte-identical" in (checked.problem or "")


def test_the_closed_division_refuses_the_flag(demo_data, tmp_path):
    args = [*trainer_args(demo_data, tmp_path / "out", "--do_train"), FLAG]
    args[args.index("--submission_division") + 1] = "closed"
    with pytest.raises(ConfigError, match="closed division: a timed run trains verified data only.*"
                                          "--submission_division open"):
        parse_config(args, 1)


# ---------------------------------------------------------------------------------------------
# the verdicts before run_start, in the process: records present and wrong, not only absent


def _edit_record(folder: Path, **fields: object) -> None:
    path = folder / RECORD_NAME
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _check(demo_data: Path, tmp_path: Path, train: Path, evals: Path, *extra: str) -> None:
    args = trainer_args(demo_data, tmp_path / "out", "--do_train", *extra)
    args[args.index("--input_dir") + 1], args[args.index("--eval_dir") + 1] = str(train), str(evals)
    check_data_before_clock(parse_config(args, 1), DataLimits(64, 10, 128), "point --eval_dir at the full set")


@pytest.fixture()
def folders(demo_data: Path, tmp_path: Path) -> tuple[Path, Path]:
    return copy_verified(demo_data / "train", tmp_path / "train"), copy_verified(demo_data / "eval", tmp_path / "eval")


@pytest.mark.parametrize("link", ["another eval set", "the eval set replaced"])
def test_a_training_record_checked_against_another_eval_set_is_refused_or_checked_after_run_start(
        demo_data, tmp_path, folders, capsys, link):
    """Both records current, the training one naming an eval set: not this one (its digest, or this eval folder's
    samples replaced and verified again since). Refused; with the flag, noted and checked after run_start."""
    train, evals = folders
    digest = json.loads((evals / RECORD_NAME).read_text())["samples_digest"]
    if link == "another eval set":
        _edit_record(train, eval_digests=["0" * 64])
    else:
        _edit_record(evals, samples_digest="0" * 64)
    with pytest.raises(DataError, match=f"{train} was not checked for samples of the eval set {evals}"):
        _check(demo_data, tmp_path, train, evals)
    _check(demo_data, tmp_path, train, evals, FLAG)
    assert f"note: {FLAG}: {train} was not checked for samples of the eval set" in capsys.readouterr().err
    _edit_record(train, eval_digests=["0" * 64, digest])  # checked against two sets, this one among them
    _edit_record(evals, samples_digest=digest)
    _check(demo_data, tmp_path, train, evals)
    assert "note:" not in capsys.readouterr().err


def _marker_beside_a_record(train: Path, evals: Path) -> str:
    mark_refused(train, [f"{train}/part_00001_of_00003.hdf5: row 3: input_ids outside [0, 128)"])
    return "data_prep's verification refused this folder (" + f"{train}/part_00001_of_00003.hdf5: row 3"


def _manifest_naming_a_missing_shard(train: Path, evals: Path) -> str:
    (train / RECORD_NAME).unlink()
    files = {p.name: {"bytes": p.stat().st_size} for p in train.glob("*.hdf5")}
    (train / "MANIFEST.json").write_text(json.dumps({"kind": "reshard", "params": {},
                                                     "files": {**files, "part_00003_of_00004.hdf5": {}}}))
    return f"{train / 'part_00003_of_00004.hdf5'}: listed in MANIFEST.json but missing"


def _record_of_one_shard_more(train: Path, evals: Path) -> str:
    """The record of the folder it sits in, plus an entry for a shard the folder no longer holds."""
    raw = json.loads((train / RECORD_NAME).read_text())
    gone = {**raw["files"]["part_00000_of_00003.hdf5"], "sha256": "f" * 64}
    _edit_record(train, files={**raw["files"], "part_00003_of_00004.hdf5": gone})
    return f"{train / 'part_00003_of_00004.hdf5'}: listed in {RECORD_NAME} but missing"


@pytest.mark.parametrize("flag", [False, True])
@pytest.mark.parametrize("case", [_marker_beside_a_record, _manifest_naming_a_missing_shard, _record_of_one_shard_more])
def test_what_the_listing_decides_is_refused_whatever_the_flag(demo_data, tmp_path, folders, case, flag):
    train, evals = folders
    says = case(train, evals)
    with pytest.raises(DataError, match=re.escape(says)):
        _check(demo_data, tmp_path, train, evals, *([FLAG] if flag else []))


@pytest.mark.parametrize("requested, recorded", [(201, 200), (200, 200), (10_000, 9_216), (10_000, 10_000)])
def test_the_eval_record_holds_the_samples_requested_at_the_boundary(demo_data, tmp_path, folders, requested,
                                                                     recorded):
    train, evals = folders
    _edit_record(evals, sequences=recorded)
    check = lambda: _check(demo_data, tmp_path, train, evals, "--num_eval_examples", str(requested))  # noqa: E731
    if recorded >= requested:
        check()
        return
    with pytest.raises(DataError, match=f"{recorded} eval samples, fewer than the {requested} requested"):
        check()


def test_a_single_eval_file_as_eval_dir_is_judged_by_its_folders_record(demo_data, tmp_path, folders, capsys):
    """--eval_dir may name the one eval shard (the MLPerf eval set is one file): its folder's record vouches for
    it, so a verified pair passes before the clock with nothing left for after it."""
    train, evals = folders
    shard, = evals.glob("*.hdf5")
    _check(demo_data, tmp_path, train, shard)
    assert "note:" not in capsys.readouterr().err
    _edit_record(train, eval_digests=["0" * 64])  # and the link to it is still checked
    with pytest.raises(DataError, match="was not checked for samples of the eval set"):
        _check(demo_data, tmp_path, train, shard)
