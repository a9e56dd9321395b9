"""Text -> data_prep's whole pipeline -> the trainer, in every input layout and on stratified shards."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from data_prep import reshard as reshard_module
from data_prep.corpus import write_corpus
from data_prep.fileio import sha256_file
from data_prep.formats import DataPrepError
from data_prep.stratify import StratifyParams, stratify
from data_prep.verify_dataset import main as verify_main
from mlperf_bert.data import shards
from tests.harness.commands import run_cli
from tests.harness.launches import mllog_events
from tests.harness.served import Served

MAX_LEN, MAX_PRED = 64, 10


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pipeline")
    corpus = write_corpus(root / "text", num_parts=2, documents_per_part=40, eval_documents=30, vocab_size=600)
    done = run_cli([sys.executable, "data_prep/prepare.py", "--quiet", "all", "--text_dir", str(root / "text"),
                    "--vocab", str(corpus.vocab), "--out", str(root / "data"), "--dupe_factor", "2",
                    "--max_seq_length", str(MAX_LEN), "--max_predictions", str(MAX_PRED), "--num_shards", "4",
                    "--num_eval_samples", "60", "--workers", "1"])
    assert done.returncode == 0, done.stderr[-3000:]
    stratify_by_quartiles(root / "data")
    vocab_size = len(corpus.vocab.read_text().splitlines())
    (root / "bert_config.json").write_text(json.dumps({
        "vocab_size": vocab_size, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": MAX_LEN, "type_vocab_size": 2,
    }))
    return root


def stratify_by_quartiles(data: Path) -> None:
    """The small corpus's pairs are mostly near max_seq_length, so the default quarter bounds
    leave strata nearly empty; bounds at the length quartiles give four usable strata."""
    lengths = np.concatenate([h5py.File(p, "r")["input_mask"][()].sum(axis=1)
                              for p in sorted(only(data, "hdf5_*_shards_fixed").glob("*.hdf5"))])
    bounds = sorted({int(q) for q in np.quantile(lengths, [0.25, 0.5, 0.75])} - {MAX_LEN}) + [MAX_LEN]
    done = run_cli([sys.executable, "data_prep/prepare.py", "--quiet", "stratify", "--input",
                    str(only(data, "hdf5_*_shards_varlength")), "--out", str(data / "stratified_quartiles"),
                    "--max_seq_length", str(MAX_LEN), "--max_predictions", str(MAX_PRED),
                    "--strata_bounds", ",".join(map(str, bounds))])
    assert done.returncode == 0, done.stderr[-3000:]
    # A step run alone writes no verification record (`all` verifies what it writes): a run needs one.
    assert verify_main([str(data / "stratified_quartiles"), "--eval_dir", str(only(data, "eval_varlength")),
                        "--workers", "1"]) == 0


def only(root: Path, pattern: str) -> Path:
    found = sorted(root.glob(pattern))
    assert len(found) == 1, (pattern, [p.name for p in root.iterdir()])
    return found[0]


@pytest.mark.slow
@pytest.mark.parametrize("folder, layout", [
    ("hdf5_*_shards_fixed", "padded"),
    ("hdf5_*_shards_varlength", "unpadded"),
    ("packed_*", "packed"),
    ("stratified_quartiles", "unpadded"),
])
def test_trainer_trains_on_every_prepared_folder(served_trainer, prepared, tmp_path, folder, layout):
    data = prepared / "data"
    out = tmp_path / "out"
    result = served_trainer.run_in(tmp_path, ["--do_train", "--input_dir", str(only(data, folder)),
                                   "--eval_dir", str(only(data, "eval_varlength")), "--bert_config_path",
                                   str(prepared / "bert_config.json"), "--output_dir", str(out), "--input_layout",
                                   layout, "--max_seq_length", str(MAX_LEN), "--max_predictions_per_seq",
                                   str(MAX_PRED), "--num_eval_examples", "60", "--train_batch_size", "4",
                                   "--max_steps", "3", "--eval_iter_samples", "100", "--submission_division", "open",
                                   "--curves", "none"])
    assert result.returncode == 0, result.stderr[-3000:]
    log = (out / "mlperf.log").read_text()
    assert '"key": "run_stop"' in log and '"key": "eval_accuracy"' in log


# ---------------------------------------------------------------- incomplete or damaged folders

def copy_of(prepared: Path, pattern: str, tmp_path: Path) -> Path:
    copy = tmp_path / pattern.replace("*", "x")
    shutil.copytree(only(prepared / "data", pattern), copy)
    return copy


def train(served_trainer: Served, prepared: Path, input_dir: Path, tmp_path: Path,
          layout: str = "unpadded", *extra: str) -> subprocess.CompletedProcess:
    """One training step, open division (each shard's rows are checked when the step reads it)."""
    return served_trainer.run_in(tmp_path, [
        "--do_train", "--input_dir", str(input_dir), *extra,
        "--eval_dir", str(only(prepared / "data", "eval_varlength")),
        "--bert_config_path", str(prepared / "bert_config.json"), "--output_dir", str(tmp_path / "out"),
        "--input_layout", layout, "--max_seq_length", str(MAX_LEN), "--max_predictions_per_seq", str(MAX_PRED),
        "--num_eval_examples", "60", "--train_batch_size", "4", "--max_steps", "1", "--eval_iter_samples", "100",
        "--submission_division", "open", "--curves", "none"])


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one `error:` line of a refused run (and nothing like a traceback)."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[0]


def interrupted_reshard(prepared: Path, out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`prepare.py reshard` stopped by Ctrl-C after two of its four shards."""
    written = []

    def write_two(*args, **kwargs):
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(args[0])
        return shards.write_samples(*args, **kwargs)

    monkeypatch.setattr(reshard_module, "write_samples", write_two)
    parts = sorted((prepared / "data" / "parts").glob("*.hdf5"))
    with pytest.raises(KeyboardInterrupt):
        reshard_module.reshard(parts, {"varlength": out}, reshard_module.ReshardParams(
            num_shards=4, formats=("varlength",), max_seq_length=MAX_LEN, max_predictions=MAX_PRED, workers=1))
    assert len(list(out.glob("*.hdf5"))) == 2


@pytest.mark.parametrize("extra", [(), ("--unverified_data",)])
def test_shard_deleted_after_the_manifest_is_refused_before_run_start(served_trainer, prepared, tmp_path, extra):
    """The folder's listing decides it: refused before the clock, even when unverified data may train."""
    folder = copy_of(prepared, "hdf5_*_shards_varlength", tmp_path)
    gone = sorted(folder.glob("*.hdf5"))[2]
    gone.unlink()
    result = train(served_trainer, prepared, folder, tmp_path, "unpadded", *extra)
    assert result.returncode == 2
    assert error_line(result).startswith(f"error: {gone}: listed in MANIFEST.json but missing")
    assert not (tmp_path / "out" / "mlperf.log").exists()


def test_half_written_reshard_is_refused(served_trainer, prepared, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "reshard"
    interrupted_reshard(prepared, folder, monkeypatch)
    missing = folder / "part_00002_of_00004.hdf5"
    result = train(served_trainer, prepared, folder, tmp_path)
    assert result.returncode == 2
    assert error_line(result).startswith(f"error: {missing}: missing, the folder has 2 of 4 shards; rerun")
    assert verify_main([str(folder), "--workers", "1"]) == 1
    assert f"{missing}: missing, the folder has 2 of 4 shards" in capsys.readouterr().err


def test_temporary_file_of_a_killed_step_is_refused(served_trainer, prepared, tmp_path, capsys):
    folder = copy_of(prepared, "hdf5_*_shards_varlength", tmp_path)
    leftover = folder / ".part_00003_of_00004.hdf5.tmp-4242"  # what a killed writer leaves behind
    leftover.write_bytes(b"half a shard")
    result = train(served_trainer, prepared, folder, tmp_path)
    assert result.returncode == 2
    assert error_line(result).startswith(f"error: {leftover}: a temporary file of an interrupted step")
    assert verify_main([str(folder), "--workers", "1"]) == 1
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("key, value, problem", [
    ("input_ids", 10**4, "input_ids outside [0, vocab_size="),
    ("next_sentence_labels", 7, "next_sentence_labels is not 0 or 1"),
])
def test_a_bad_row_stops_the_run_when_its_shard_is_read(served_trainer, prepared, tmp_path, key, value, problem):
    """An open run told to train a folder changed since its verification (--unverified_data): rows are
    checked as they are read (after run_start: no row is read before the clock), and the first bad one
    ends the run."""
    folder = copy_of(prepared, "hdf5_*_shards_fixed", tmp_path)
    shards_ = sorted(folder.glob("*.hdf5"))
    for shard in shards_:  # whichever shard the run reads first holds one
        with h5py.File(shard, "r+") as handle:
            handle[key][(5, 1) if key == "input_ids" else 5] = value
    result = train(served_trainer, prepared, folder, tmp_path, "padded", "--unverified_data")
    assert result.returncode == 2
    assert "changed since it was verified" in result.stderr  # --unverified_data's note
    line = error_line(result)
    assert line.startswith("error: ") and f": row 5: {problem}" in line and any(str(s) in line for s in shards_)
    events = mllog_events(tmp_path / "out" / "mlperf.log")
    assert [e["key"] for e in events].count("run_start") == 1 and events[-1]["metadata"]["status"] == "aborted"


def test_verify_reads_the_lengths_from_the_manifest(prepared, tmp_path, capsys):
    fixed = only(prepared / "data", "hdf5_*_shards_fixed")
    assert verify_main([str(fixed), "--workers", "1"]) == 0  # 64-wide rows were refused as "expected 512"
    assert f"max_seq_length {MAX_LEN} ({fixed / 'MANIFEST.json'})" in capsys.readouterr().out
    folder = copy_of(prepared, "hdf5_*_shards_varlength", tmp_path)
    shard = sorted(folder.glob("*.hdf5"))[0]
    samples = shards.read_samples(shard)
    longer = shards.Samples.concat([samples.slice(0, 3), samples.slice(0, 1)])
    longer.input_ids = np.concatenate([longer.input_ids, np.full(MAX_LEN, longer.input_ids[1], np.int32)])
    longer.segment_ids = np.concatenate([longer.segment_ids, np.ones(MAX_LEN, np.int8)])
    longer.lengths[-1] += MAX_LEN  # one sequence of up to 2 * MAX_LEN tokens: fine at 512, not at 64
    shards.write_samples(shard, longer, "varlength", 2 * MAX_LEN, MAX_PRED)
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    manifest["files"][shard.name] |= {"bytes": shard.stat().st_size, "samples": 4, "sha256": sha256_file(shard)}
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))
    assert verify_main([str(folder), "--workers", "1"]) == 1
    assert f"{shard}: row 3: sequence longer than max_seq_length={MAX_LEN}" in capsys.readouterr().err


@pytest.mark.parametrize("step", ["stratify", "pack"])
def test_stratify_and_pack_alone_take_the_length_of_their_input(prepared, tmp_path, step):
    source = only(prepared / "data", "hdf5_*_shards_varlength")
    command = [sys.executable, "data_prep/prepare.py", "--quiet", step, "--input", str(source), "--out"]
    refused = run_cli(command + [str(tmp_path / "default")])  # the flag's default is 512
    assert refused.returncode == 1 and not (tmp_path / "default" / "MANIFEST.json").exists()
    assert error_line(refused) == (
        f"error: --max_seq_length 512, but the input was made with max_seq_length {MAX_LEN} "
        f"({source / 'MANIFEST.json'}); pass --max_seq_length {MAX_LEN}, or remake the input with 512")
    done = run_cli(command + [str(tmp_path / "ok"), "--max_seq_length", str(MAX_LEN),
                              "--max_predictions", str(MAX_PRED)])
    assert done.returncode == 0, done.stderr[-3000:]


def test_stratify_bounds_follow_the_input_length(prepared, tmp_path):
    source = only(prepared / "data", "hdf5_*_shards_varlength")
    record = stratify(shards.list_shards(source), tmp_path / "strata", StratifyParams())
    lengths = np.concatenate([shards.sequence_lengths(p) for p in shards.list_shards(source)])
    assert record["bounds"] == [16, 32, 48, 64]
    assert record["counts"] == np.bincount(np.searchsorted([16, 32, 48, 64], lengths), minlength=4).tolist()
    with pytest.raises(DataPrepError, match="strata bounds \\[128, 256, 384, 512\\] end at 512, not at max_seq"):
        stratify(shards.list_shards(source), tmp_path / "wide", StratifyParams(bounds=(128, 256, 384, 512)))
