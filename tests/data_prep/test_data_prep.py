"""The `samples` step: tokenisation, instances, eval exclusion, workers, resume, bad input.

The corpus is Python's own documentation (and /usr/share/common-licenses) arranged into
MLCommons-format documents, with a WordPiece vocabulary trained on it in the test. The
compiled pipeline is compared row for row with data_prep/reference_algorithm.py, a
token-by-token rendering of the MLCommons algorithm; tests/data_prep/test_reference_samples.py holds
both against the outputs of the MLCommons scripts themselves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from data_prep import reference_algorithm as ref
from data_prep.corpus import EVAL_MARKER, installed_sentences, make_documents, write_corpus, write_documents
from data_prep.fileio import Manifest
from data_prep.formats import DataPrepError
from mlperf_bert.data.shards import read_samples
from mlperf_bert.data.shards import open_shard as open_h5
from data_prep.samples import SampleParams, create_samples
from data_prep.text import tokenize_file
from data_prep.verify_dataset import Limits, verify_directory
from data_prep.vocab import LineEncoder, load_vocab
from tests.harness.paths import REPO


PARAMS = SampleParams(dupe_factor=5)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("text"), num_parts=3, documents_per_part=70, eval_documents=40,
                        planted_eval_documents=3)


@pytest.fixture(scope="module")
def made(corpus, tmp_path_factory):
    """Samples of every part, eval documents excluded, one worker."""
    out = tmp_path_factory.mktemp("parts")
    manifest = create_samples(corpus.parts, out, corpus.vocab, PARAMS, workers=1, exclude_path=corpus.eval_text)
    return out, manifest


def all_samples(directory: Path):
    from mlperf_bert.data.shards import Samples

    return Samples.concat([read_samples(p) for p in sorted(directory.glob("*.hdf5"))])


def test_line_encoder_equals_the_reference_tokenizer(corpus):
    vocab = load_vocab(corpus.vocab)
    lines = [line.strip() for line in corpus.parts[0].read_text().splitlines() if line.strip()]
    lines += ["Café Ünïcode naïve — “quotes” 東京 x", "[MASK] [SEP] literal", "a" * 150 + " b", "a" * 201,
              "x\x0by\x0cz\x1fw \x7fq", "\x01\x02", "don't stop-me (now)!! a_b^c`d", "tab\there\u00a0nbsp",
              "ΑΛΕΞΑΝΔΡΟΣ ΣΣ", "private \ue000use", "line\u2028separator", "soft\u00adhyphen zero\u200bwidth"]
    ids, lengths = LineEncoder(vocab).encode(lines)
    python = ref.ReferenceTokenizer(vocab)
    expected = [python.ids(python.tokenize(line)) for line in lines]
    assert lengths.tolist() == [len(e) for e in expected]
    assert ids.tolist() == [i for e in expected for i in e]


def test_documents_and_sentences_follow_blank_lines(tmp_path, corpus):
    text = tmp_path / "part-00000-of-00001"
    text.write_text("\n\nfirst doc one.\nfirst doc two.\n\n\n\x01\x02\n\nsecond doc.\n \nthird doc a.\nthird doc b.\n")
    # Tiny blocks: documents and skipped lines cross block boundaries.
    tokenized = tokenize_file(text, LineEncoder(load_vocab(corpus.vocab)), block_bytes=16)
    assert tokenized.num_sentences == 5  # the line of control characters has no tokens
    assert np.diff(tokenized.document_starts).tolist() == [2, 1, 2]


def test_counts_agree_with_manifest_and_files_verify(made, corpus):
    out, manifest = made
    files = sorted(out.glob("*.hdf5"))
    assert [p.name for p in files] == [f"{p.name}.hdf5" for p in corpus.parts]
    for path in files:
        entry = manifest.files[path.name]
        samples = read_samples(path)
        assert entry["samples"] == len(samples) > 0
        assert entry["tokens"] == int(samples.lengths.sum())
        assert entry["predictions"] == int(samples.num_predictions.sum())
    vocab = load_vocab(corpus.vocab)
    problems, _ = verify_directory(out, Limits(vocab_size=vocab.size, cls_id=vocab.cls_id, sep_id=vocab.sep_id))
    assert problems == []


def test_masking_statistics(made, corpus):
    samples = all_samples(made[0])
    vocab = load_vocab(corpus.vocab)
    expected = [min(76, max(1, round(n * 0.15))) for n in samples.lengths.tolist()]  # Python's round, as the reference
    assert samples.num_predictions.tolist() == expected
    assert 0.14 <= samples.num_predictions.sum() / samples.lengths.sum() <= 0.16
    starts = np.repeat(np.concatenate([[0], np.cumsum(samples.lengths)[:-1]]), samples.num_predictions)
    shown = samples.input_ids[starts + samples.masked_lm_positions]
    masked = np.mean(shown == vocab.mask_id)
    kept = np.mean(shown == samples.masked_lm_ids)
    assert abs(masked - 0.8) < 0.015
    assert abs(kept - 0.1 - 0.1 / vocab.size) < 0.015
    assert abs(1 - masked - kept - 0.1) < 0.015  # the random replacements


def test_rows_equal_the_reference_algorithm(corpus, tmp_path):
    """Row for row, every key, against the token-by-token rendering (short targets made frequent)."""
    vocab = load_vocab(corpus.vocab)
    text = tmp_path / "part-00000-of-00001"
    write_documents(text, make_documents(installed_sentences(), 150, seed=3, sentences_per_document=(1, 12)))
    params = SampleParams(max_seq_length=128, max_predictions=20, short_seq_prob=0.3, dupe_factor=3)
    create_samples([text], tmp_path / "ours", corpus.vocab, params, workers=1)
    tokenizer = ref.ReferenceTokenizer(vocab)
    instances = ref.create_instances(text, tokenizer, vocab, dupe_factor=3, max_seq_length=128, max_predictions=20,
                                     short_seq_prob=0.3)
    rows = [ref.padded_features(i, tokenizer, 128, 20) for i in instances]
    with open_h5(tmp_path / "ours" / f"{text.name}.hdf5") as ours:
        for key in rows[0]:
            assert np.array_equal(ours[key][:].reshape(len(rows), -1), np.array([r[key] for r in rows])), key


def test_eval_documents_never_reach_training_samples(made, corpus):
    out, manifest = made
    marker = load_vocab(corpus.vocab).id(EVAL_MARKER)
    assert sum(e["excluded_documents"] for e in manifest.files.values()) == 3  # the planted copies
    assert marker not in all_samples(out).original_ids()


def test_eval_text_samples_carry_the_marker(corpus, tmp_path):
    create_samples([corpus.eval_text], tmp_path, corpus.vocab, PARAMS, workers=1)
    marker = load_vocab(corpus.vocab).id(EVAL_MARKER)
    samples = read_samples(tmp_path / "eval.hdf5")
    assert np.isin(marker, samples.original_ids())


def test_outputs_identical_for_one_and_two_workers(made, corpus, tmp_path):
    manifest = create_samples(corpus.parts, tmp_path, corpus.vocab, PARAMS, workers=2, exclude_path=corpus.eval_text)
    assert {k: v["sha256"] for k, v in manifest.files.items()} == {k: v["sha256"] for k, v in made[1].files.items()}


def test_every_file_is_seeded_alike_whatever_its_name(made, corpus, tmp_path):
    """The reference seeds random.Random(12345) afresh for each input file."""
    renamed = tmp_path / "eval.txt"
    renamed.write_bytes(corpus.parts[1].read_bytes())
    manifest = create_samples([renamed], tmp_path / "out", corpus.vocab, PARAMS, workers=1)
    with open_h5(tmp_path / "out" / "eval.hdf5") as theirs, open_h5(made[0] / f"{corpus.parts[1].name}.hdf5") as ours:
        assert manifest.files["eval.hdf5"]["samples"] == len(ours["input_ids"])
        assert all(np.array_equal(theirs[k][:], ours[k][:]) for k in ours)


def _prepare(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'pytorch'}", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(REPO / "data_prep" / "prepare.py"), "--quiet", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _samples_args(corpus, out: Path) -> list[str]:
    return ["samples", "--text", str(corpus.parts[0].parent), "--vocab", str(corpus.vocab), "--out", str(out),
            "--exclude_text", str(corpus.eval_text), "--dupe_factor", "5", "--workers", "1"]


def test_resume_after_kill_gives_the_uninterrupted_outputs(made, corpus, tmp_path):
    out = tmp_path / "parts"
    process = _prepare(*_samples_args(corpus, out))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        manifest = Manifest.load(out) if (out / "MANIFEST.json").is_file() else None
        if manifest is not None and manifest.files:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert len(Manifest.load(out).files) < len(corpus.parts)  # killed before the end
    process = _prepare(*_samples_args(corpus, out))
    assert process.wait() == 0, process.stderr.read()
    resumed = Manifest.load(out)
    assert {k: v["sha256"] for k, v in resumed.files.items()} == {k: v["sha256"] for k, v in made[1].files.items()}
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_resume_redoes_deleted_and_truncated_outputs(made, corpus, tmp_path):
    out, manifest = made
    copy = tmp_path / "parts"
    copy.mkdir()
    for path in out.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    names = sorted(manifest.files)
    (copy / names[0]).unlink()
    (copy / names[1]).write_bytes((copy / names[1]).read_bytes()[:1000])
    (copy / f".{names[2]}.tmp-99999").write_bytes(b"left by a killed run")
    redone = create_samples(corpus.parts, copy, corpus.vocab, PARAMS, workers=1, exclude_path=corpus.eval_text)
    assert {k: v["sha256"] for k, v in redone.files.items()} == {k: v["sha256"] for k, v in manifest.files.items()}
    assert not (copy / f".{names[2]}.tmp-99999").exists()


def test_other_parameters_in_the_same_folder_are_refused(made, corpus):
    with pytest.raises(DataPrepError, match="other settings.*seed"):
        create_samples(corpus.parts, made[0], corpus.vocab, SampleParams(dupe_factor=5, seed=1), workers=1,
                       exclude_path=corpus.eval_text)


def test_empty_text_file_is_refused(corpus, tmp_path):
    empty = tmp_path / "part-00000-of-00001"
    empty.write_bytes(b"")
    with pytest.raises(DataPrepError, match=r"part-00000-of-00001: the file is empty"):
        create_samples([empty], tmp_path / "out", corpus.vocab, PARAMS)
    empty.write_text("\n\n \n")
    with pytest.raises(DataPrepError, match="no sentence with tokens"):
        create_samples([empty], tmp_path / "out2", corpus.vocab, PARAMS)


def test_bytes_that_are_not_utf8_name_the_line(corpus, tmp_path):
    bad = tmp_path / "part-00000-of-00001"
    bad.write_bytes(b"fine sentence here.\nanother one.\n\nbroken \xff\xfe text.\n")
    with pytest.raises(DataPrepError, match=r"part-00000-of-00001: line 4: bytes b'\\xff' at column 7 are not UTF-8"):
        create_samples([bad], tmp_path / "out", corpus.vocab, PARAMS)
    lenient = SampleParams(dupe_factor=5, encoding_errors="replace")
    replaced = create_samples([bad], tmp_path / "out2", corpus.vocab, lenient)
    assert replaced.total_samples > 0


def test_vocabulary_without_mask_is_refused(corpus, tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(t for t in load_vocab(corpus.vocab).tokens if t != "[MASK]") + "\n")
    with pytest.raises(DataPrepError, match=r"vocab.txt: the vocabulary lacks \[MASK\]"):
        create_samples(corpus.parts[:1], tmp_path / "out", vocab, PARAMS)


def test_command_line_reports_bad_input_without_traceback(corpus, tmp_path):
    empty = tmp_path / "part-00000-of-00001"
    empty.write_bytes(b"")
    process = _prepare("samples", "--text", str(empty), "--vocab", str(corpus.vocab), "--out", str(tmp_path / "o"))
    _, err = process.communicate(timeout=60)
    assert process.returncode == 1
    assert "error:" in err and "is empty" in err and "Traceback" not in err
