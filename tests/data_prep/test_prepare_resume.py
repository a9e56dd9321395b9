"""`prepare.py all` is deterministic and resumes on the content of its inputs, not their names.

The same inputs and flags give byte-identical folders (shards, reports and manifests) whatever
the number of workers; a text part edited in place (same name, same size, same flags) or cut to
half its documents makes every output that depends on it again, and the result equals a fresh
run on the edited text; a touched but unchanged part makes nothing again; a part that is gone
is named."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from data_prep.corpus import write_corpus
from data_prep.fileio import Manifest, content_key, sha256_file, write_json
from data_prep.formats import MANIFEST_NAME, PACKING_REPORT_NAME, STRATA_NAME
from data_prep.prepare import main as prepare

MAX_LEN, MAX_PRED = 64, 10


def _all(text: Path, vocab: Path, out: Path) -> None:
    code = prepare(["--quiet", "all", "--text_dir", str(text), "--vocab", str(vocab), "--out", str(out),
                    "--dupe_factor", "2", "--max_seq_length", str(MAX_LEN), "--max_predictions", str(MAX_PRED),
                    "--num_shards", "2", "--num_eval_samples", "20", "--workers", "1", "--skip_stratify"])
    assert code == 0


# Stratified too, with more shards per stratum than the short strata hold, so that a change in the
# inputs changes how many shards a stratum gets (and so the names of its shards).
FULL = ("--num_shards", "2", "--shards_per_stratum", "4")


def _run_all(text: Path, vocab: Path, out: Path, *flags: str) -> int:
    return prepare(["--quiet", "all", "--text_dir", str(text), "--vocab", str(vocab), "--out", str(out),
                    "--dupe_factor", "2", "--max_seq_length", str(MAX_LEN), "--max_predictions", str(MAX_PRED),
                    "--num_eval_samples", "20", *flags])


def _dataset(out: Path) -> dict[str, str]:
    """sha256 of every file data_prep writes into a dataset: shards, manifests and reports."""
    names = {MANIFEST_NAME, PACKING_REPORT_NAME, STRATA_NAME}
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*"))
            if p.is_file() and (p.suffix == ".hdf5" or p.name in names)}


def _text_copy(corpus, tmp_path: Path) -> Path:
    text = tmp_path / "text"
    text.mkdir()
    for path in [*corpus.parts, corpus.eval_text]:
        shutil.copyfile(path, text / path.name)
    return text


def _outputs(out: Path) -> dict[str, tuple[bytes, int]]:
    """Every hdf5 output: its bytes and mtime."""
    return {str(p.relative_to(out)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(out.rglob("*.hdf5"))}


def _edit_in_place(part: Path) -> None:
    """Two different letters swapped: same name, same size, other samples."""
    text = part.read_text()
    i = next(i for i in range(len(text) - 1) if text[i].isalpha() and text[i + 1].isalpha() and text[i] != text[i + 1])
    part.write_text(text[:i] + text[i + 1] + text[i] + text[i + 2:])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("text"), num_parts=2, documents_per_part=25, eval_documents=15,
                        vocab_size=400)


def test_an_edited_text_part_makes_its_outputs_again(corpus, tmp_path):
    out = tmp_path / "data"
    _all(corpus.parts[0].parent, corpus.vocab, out)
    before = _outputs(out)
    size = corpus.parts[1].stat().st_size
    _edit_in_place(corpus.parts[1])
    assert corpus.parts[1].stat().st_size == size
    _all(corpus.parts[0].parent, corpus.vocab, out)
    after = _outputs(out)
    fresh = tmp_path / "fresh"
    _all(corpus.parts[0].parent, corpus.vocab, fresh)
    assert {k: v[0] for k, v in after.items()} == {k: v[0] for k, v in _outputs(fresh).items()}
    changed = {k for k in before if before[k][0] != after[k][0]}
    assert f"parts/{corpus.parts[1].name}.hdf5" in changed and any(k.startswith("hdf5_2_shards") for k in changed)
    assert after[f"parts/{corpus.parts[0].name}.hdf5"] == before[f"parts/{corpus.parts[0].name}.hdf5"]  # not redone


def test_a_touched_but_unchanged_part_makes_nothing_again(corpus, tmp_path):
    out = tmp_path / "data"
    _all(corpus.parts[0].parent, corpus.vocab, out)
    before = _outputs(out)
    stat = corpus.parts[0].stat()
    os.utime(corpus.parts[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    _all(corpus.parts[0].parent, corpus.vocab, out)
    assert _outputs(out) == before


def test_the_same_inputs_give_the_same_bytes_whatever_the_workers(corpus, tmp_path):
    text = _text_copy(corpus, tmp_path)
    assert _run_all(text, corpus.vocab, tmp_path / "one", *FULL, "--workers", "1") == 0
    assert _run_all(text, corpus.vocab, tmp_path / "two", *FULL, "--workers", "2") == 0
    first = _dataset(tmp_path / "one")
    assert {"packed_2_nnlshp/packing_report.json", "stratified_2/strata.json", "parts/MANIFEST.json"} <= set(first)
    assert _dataset(tmp_path / "two") == first
    assert _run_all(text, corpus.vocab, tmp_path / "one", *FULL, "--workers", "2") == 0  # a rerun: nothing to do
    assert _dataset(tmp_path / "one") == first


def _cut_to_half(part: Path) -> None:
    """The same name, the first half of its documents."""
    documents = part.read_text().split("\n\n")[:-1]
    part.write_text("".join(document + "\n\n" for document in documents[:len(documents) // 2]))


def test_a_part_cut_to_half_its_documents_makes_every_output_again(corpus, tmp_path, caplog):
    text = _text_copy(corpus, tmp_path)
    out = tmp_path / "data"
    assert _run_all(text, corpus.vocab, out, *FULL, "--workers", "1") == 0
    shards_before = json.loads((out / "stratified_2" / STRATA_NAME).read_text())["shards"]
    _cut_to_half(text / corpus.parts[1].name)
    with caplog.at_level(logging.WARNING, logger="data_prep"):
        assert _run_all(text, corpus.vocab, out, *FULL, "--workers", "1") == 0
    assert f"making them again: {corpus.parts[1].name}" in caplog.text  # the changed part is named
    assert f"{corpus.parts[1].name}.hdf5 (other content)" in caplog.text
    assert json.loads((out / "stratified_2" / STRATA_NAME).read_text())["shards"] != shards_before  # other names
    assert _run_all(text, corpus.vocab, tmp_path / "fresh", *FULL, "--workers", "1") == 0
    assert _dataset(out) == _dataset(tmp_path / "fresh")


def test_a_part_that_is_gone_is_named_until_its_samples_are_deleted(corpus, tmp_path, capsys):
    text = _text_copy(corpus, tmp_path)
    out = tmp_path / "data"
    assert _run_all(text, corpus.vocab, out, *FULL, "--workers", "1") == 0
    (text / corpus.parts[1].name).unlink()
    capsys.readouterr()
    assert _run_all(text, corpus.vocab, out, *FULL, "--workers", "1") == 1
    orphan = f"{corpus.parts[1].name}.hdf5"
    assert f"holds the samples of 1 text parts that are no longer in --text_dir ({orphan})" in capsys.readouterr().err
    (out / "parts" / orphan).unlink()  # as the message says
    assert _run_all(text, corpus.vocab, out, *FULL, "--workers", "1") == 0
    assert _run_all(text, corpus.vocab, tmp_path / "fresh", *FULL, "--workers", "1") == 0
    assert _dataset(out) == _dataset(tmp_path / "fresh")


def test_manifest_keys_of_the_earlier_layout_count_by_content(tmp_path):
    """Keys that still hold an mtime ([name, bytes, mtime_ns, sha256]) name the same content as today's;
    other content, even of the same size, deletes the folder's outputs before they are made again."""
    source, out = tmp_path / "in.hdf5", tmp_path / "out"
    source.write_bytes(b"x" * 10)
    out.mkdir()
    (out / "a.hdf5").write_bytes(b"y")
    name, size, digest = content_key(source)
    write_json(out / MANIFEST_NAME, {"kind": "reshard", "params": {"seed": 1, "inputs": [[name, size, 5, digest]]},
                                     "files": {"a.hdf5": {"sha256": sha256_file(out / "a.hdf5"), "bytes": 1,
                                                          "mtime_ns": 5, "samples": 1, "format": "fixed"}}})
    assert Manifest.open(out, "reshard", {"seed": 1, "inputs": [content_key(source)]}).is_done("a.hdf5")
    source.write_bytes(b"z" * 10)
    assert Manifest.open(out, "reshard", {"seed": 1, "inputs": [content_key(source)]}).files == {}
    assert not (out / "a.hdf5").exists() and Manifest.load(out).files == {}
    # A shard renamed into place by an interrupted run, before it was recorded, goes too.
    (out / "b.hdf5").write_bytes(b"w")
    source.write_bytes(b"v" * 10)
    Manifest.open(out, "reshard", {"seed": 1, "inputs": [content_key(source)]})
    assert not (out / "b.hdf5").exists()
