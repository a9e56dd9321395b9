"""`check-inputs`: sizes and md5 sums against a table, on small files made here."""

from __future__ import annotations

import hashlib
import json
import lzma

import pytest

from data_prep import prepare
from data_prep.check_inputs import PUBLISHED, REQUIRED, TF2_CHECKPOINT, check_inputs, read_md5_list, read_table
from tests.harness.paths import REFERENCE_SAMPLES


@pytest.fixture
def downloads(tmp_path):
    """Two files, a table that matches them, and an md5sum list for a third."""
    folder = tmp_path / "bert_data"
    (folder / "tf1_ckpt").mkdir(parents=True)
    files = {"vocab.txt": b"[PAD]\n[UNK]\n", "tf1_ckpt/model.ckpt-28252.index": b"index bytes",
             "part-00003-of-00500": b"a sentence.\n\n"}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    table = {name.split("/")[-1]: [len(data), hashlib.md5(data).hexdigest()] for name, data in list(files.items())[:2]}
    (tmp_path / "table.json").write_text(json.dumps(table))
    md5_list = tmp_path / "bert_reference_results_text_md5.txt"
    md5_list.write_text(f"{hashlib.md5(files['part-00003-of-00500']).hexdigest()}  results4/part-00003-of-00500\n")
    return folder, tmp_path / "table.json", md5_list


def _run(*argv: str) -> int:
    return prepare.main(["--quiet", "check-inputs", *argv])


def test_matching_files_pass_and_unknown_ones_are_reported(downloads, capsys):
    folder, table, md5_list = downloads
    assert _run(str(folder), "--table", str(table), "--allow_missing") == 0
    captured = capsys.readouterr()
    assert "2 files match" in captured.out
    assert "not checked" in captured.err and "part-00003-of-00500" in captured.err
    assert _run(str(folder), "--table", str(table), "--md5_list", str(md5_list), "--allow_missing") == 0
    assert "3 files match" in capsys.readouterr().out


def test_changed_file_fails_naming_it(downloads, capsys):
    folder, table, md5_list = downloads
    (folder / "vocab.txt").write_bytes(b"[PAD]\n[UNK]\n[CLS]\n")
    assert _run(str(folder), "--table", str(table), "--allow_missing") == 1
    assert "vocab.txt: 18 bytes, expected 12" in capsys.readouterr().err
    (folder / "vocab.txt").write_bytes(b"[PAD]\n[UNX]\n")  # same size, other content
    assert _run(str(folder), "--table", str(table), "--allow_missing") == 1
    assert "vocab.txt: md5" in capsys.readouterr().err


def test_missing_inputs_fail_unless_allowed(downloads, capsys):
    folder, table, md5_list = downloads
    assert _run(str(folder), "--table", str(table)) == 1
    err = capsys.readouterr().err
    assert "missing inputs" in err and "eval.txt" in err and "part-00499-of-00500" in err
    report = check_inputs([folder], {**read_table(table), **read_md5_list(md5_list)})
    assert len(report.good) == 3
    assert set(report.missing) == set(REQUIRED) - {"vocab.txt", "model.ckpt-28252.index", "part-00003-of-00500"}


def test_published_table_holds_the_mlperf_vocabulary():
    assert PUBLISHED["vocab.txt"] == (231_508, "64800d5d8528ce344256daf115d4965e")


def test_published_table_accepts_the_real_vocabulary(tmp_path):
    (tmp_path / "vocab.txt").write_bytes(lzma.decompress((REFERENCE_SAMPLES / "vocab.txt.xz").read_bytes()))
    report = check_inputs([tmp_path], PUBLISHED, required=("vocab.txt",))
    assert report.good == [str(tmp_path / "vocab.txt")] and not report.bad


def test_tf2_checkpoint_files_are_named_not_failed(tmp_path, monkeypatch, capsys):
    data = b"pretend TF2 index"
    monkeypatch.setitem(TF2_CHECKPOINT, hashlib.md5(data).hexdigest(), "model.ckpt-28252.index")
    (tmp_path / "tf2_ckpt").mkdir()
    (tmp_path / "tf2_ckpt" / "model.ckpt-28252.index").write_bytes(data)
    table = {"model.ckpt-28252.index": (None, "0" * 32)}
    report = check_inputs([tmp_path], table, required=("model.ckpt-28252.index",))
    assert not report.bad and report.missing == ["model.ckpt-28252.index"]
    assert "TF2 checkpoint" in report.unchecked[0]
