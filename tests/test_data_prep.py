"""The `samples` step: tokenisation, pairs, masking, eval exclusion, workers, resume, bad input.

The corpus is Python's own documentation (and /usr/share/common-licenses) arranged into
MLCommons-format documents, with a WordPiece vocabulary trained on it in the test. The fast
pipeline is compared with data_prep/reference_algorithm.py, a token-by-token rendering of
the MLCommons algorithm, and with small independent loops written here.
"""

from __future__ import annotations

import os
import random
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
from mlperf_bert.shards import read_samples
from data_prep.pairs import A_END, A_START, B_END, B_START, IS_RANDOM, PairMaker, PairParams, truncate_pairs
from data_prep.samples import SampleParams, create_samples, file_rngs
from data_prep.text import tokenize_file
from data_prep.verify_dataset import Limits, verify_directory
from data_prep.vocab import LineEncoder, load_vocab, make_tokenizer

ROOT = Path(__file__).resolve().parents[1]

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
    from mlperf_bert.shards import Samples

    return Samples.concat([read_samples(p) for p in sorted(directory.glob("*.hdf5"))])


def test_line_encoder_equals_rust_tokenizer_and_reference_tokenizer(corpus):
    vocab = load_vocab(corpus.vocab)
    tokenizer = make_tokenizer(vocab)
    lines = [line.strip() for line in corpus.parts[0].read_text().splitlines() if line.strip()]
    lines += ["Café Ünïcode naïve — “quotes” 東京 x", "[MASK] [SEP] literal", "a" * 150 + " b",
              "x\x0by\x0cz\x1fw \x7fq", "\x01\x02", "don't stop-me (now)!! a_b^c`d", "tab\there\u00a0nbsp"]
    ids, lengths = LineEncoder(tokenizer).encode(lines)
    rust = [e.ids for e in tokenizer.encode_batch(lines, add_special_tokens=False)]
    python = ref.ReferenceTokenizer(vocab)
    assert lengths.tolist() == [len(r) for r in rust]
    assert ids.tolist() == [i for r in rust for i in r]
    assert [python.ids(python.tokenize(line)) for line in lines] == rust


def test_documents_and_sentences_follow_blank_lines(tmp_path, corpus):
    text = tmp_path / "part-00000-of-00001"
    text.write_text("\n\nfirst doc one.\nfirst doc two.\n\n\n\x01\x02\n\nsecond doc.\n \nthird doc a.\nthird doc b.\n")
    encoder = LineEncoder(make_tokenizer(load_vocab(corpus.vocab)))
    tokenized = tokenize_file(text, encoder, block_bytes=16)  # tiny blocks: boundaries cross blocks
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


def test_statistics_match_the_reference_algorithm(corpus, tmp_path):
    """Pairs per text, NSP ratio and sequence lengths, against the token-by-token algorithm.

    400 short documents, so that the per-document draws (short target length, random next)
    average out; the tolerances are about 3 standard deviations of the difference, measured
    over seeds on this kind of file.
    """
    vocab = load_vocab(corpus.vocab)
    text = tmp_path / "part-00000-of-00001"
    write_documents(text, make_documents(installed_sentences(), 400, seed=3, sentences_per_document=(2, 10)))
    create_samples([text], tmp_path / "ours", corpus.vocab, PARAMS, workers=1)
    ours = read_samples(tmp_path / "ours" / f"{text.name}.hdf5")
    tokenizer = ref.ReferenceTokenizer(vocab)
    theirs = ref.to_samples(ref.create_instances(text, tokenizer, vocab, dupe_factor=PARAMS.dupe_factor), tokenizer)
    assert abs(len(ours) / len(theirs) - 1) < 0.04
    assert abs(ours.next_sentence_labels.mean() - theirs.next_sentence_labels.mean()) < 0.035
    assert abs(ours.lengths.mean() / theirs.lengths.mean() - 1) < 0.03
    assert abs(np.mean(ours.lengths < 100) - np.mean(theirs.lengths < 100)) < 0.035
    masked_share = [s.num_predictions.sum() / s.lengths.sum() for s in (ours, theirs)]
    assert abs(masked_share[0] - masked_share[1]) < 0.002


def _sentence_loop_spans(tokenized, doc, rng: random.Random, max_num_tokens: int, short_seq_prob: float) -> list[tuple]:
    """The reference's per-sentence loop on token offsets, drawing random numbers in the same order."""
    def uniform(low, high):
        return low + int(rng.random() * (high - low + 1))

    s, d = tokenized.sentence_starts.tolist(), tokenized.document_starts.tolist()
    first, stop = d[doc], d[doc + 1]
    target = uniform(2, max_num_tokens) if rng.random() < short_seq_prob else max_num_tokens
    spans, chunk_start, size, i = [], first, 0, first
    while i < stop:
        size += s[i + 1] - s[i]
        if i == stop - 1 or size >= target:
            count = i - chunk_start + 1
            a_end = chunk_start + (uniform(1, count - 1) if count >= 2 else 1)
            if count == 1 or rng.random() < 0.5:
                for _ in range(10):
                    other = uniform(0, len(d) - 2)
                    if other != doc:
                        break
                j = uniform(d[other], d[other + 1] - 1)
                begin, end = s[j], s[j]
                while j < d[other + 1]:
                    end = s[j + 1]
                    j += 1
                    if end - begin >= target - (s[a_end] - s[chunk_start]):
                        break
                spans.append((s[chunk_start], s[a_end], begin, end, 1))
                i = a_end - 1
            else:
                spans.append((s[chunk_start], s[a_end], s[a_end], s[i + 1], 0))
            chunk_start, size = i + 1, 0
        i += 1
    return spans


def test_pair_spans_equal_the_sentence_by_sentence_loop(corpus):
    tokenized = tokenize_file(corpus.parts[1], LineEncoder(make_tokenizer(load_vocab(corpus.vocab))))
    params = PairParams(max_seq_length=128, short_seq_prob=0.3)
    maker = PairMaker(tokenized, params, random.Random(7))
    loop_rng = random.Random(7)
    for doc in range(tokenized.num_documents):
        fast: list[int] = []
        maker.document(doc, fast)
        slow = _sentence_loop_spans(tokenized, doc, loop_rng, params.max_num_tokens, params.short_seq_prob)
        assert [tuple(fast[k:k + 5]) for k in range(0, len(fast), 5)] == slow


def _truncate_token_by_token(a: list, b: list, limit: int, rng: random.Random) -> None:
    while len(a) + len(b) > limit:
        longer = a if len(a) > len(b) else b
        longer.pop(0) if rng.random() < 0.5 else longer.pop()


def test_truncation_matches_the_token_loop():
    rng = np.random.default_rng(0)
    la, lb = rng.integers(1, 400, 2000), rng.integers(1, 400, 2000)
    spans = np.stack([np.zeros_like(la), la, np.full_like(la, 1000), 1000 + lb, np.zeros_like(la)], axis=1)
    cut = truncate_pairs(spans, 125, rng)
    loop_rng = random.Random(0)
    for row, (a, b) in enumerate(zip(la.tolist(), lb.tolist())):
        ta, tb = list(range(a)), list(range(1000, 1000 + b))
        _truncate_token_by_token(ta, tb, 125, loop_rng)
        assert (cut[row, A_END] - cut[row, A_START], cut[row, B_END] - cut[row, B_START]) == (len(ta), len(tb))
        assert cut[row, A_START] >= 0 and cut[row, A_END] <= a
        assert cut[row, B_START] >= 1000 and cut[row, B_END] <= 1000 + b
    front = cut[:, A_START] + (cut[:, B_START] - 1000)
    removed = la + lb - (cut[:, A_END] - cut[:, A_START]) - (cut[:, B_END] - cut[:, B_START])
    assert abs(front.sum() / removed.sum() - 0.5) < 0.02  # each removed token: front or back, p = 1/2


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


def test_file_seeds_depend_on_the_file_index_only():
    a, b = file_rngs(12345, "part-00007-of-00500")[1].random(3), file_rngs(12345, "part-00007-of-00500")[1].random(3)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, file_rngs(12345, "part-00008-of-00500")[1].random(3))


def _prepare(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'pytorch'}", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(ROOT / "data_prep" / "prepare.py"), "--quiet", *args], env=env,
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


def test_spans_keep_inside_their_documents(corpus):
    """A and the actual-next B come from one document; random B starts a different document's sentence."""
    tokenized = tokenize_file(corpus.parts[2], LineEncoder(make_tokenizer(load_vocab(corpus.vocab))))
    spans: list[int] = []
    maker = PairMaker(tokenized, PairParams(), random.Random(3))
    for doc in range(tokenized.num_documents):
        maker.document(doc, spans)
    table = np.array(spans).reshape(-1, 5)
    doc_first_token = tokenized.sentence_starts[tokenized.document_starts]
    doc_of_token = np.searchsorted(doc_first_token, table[:, [A_START, B_START]], side="right")
    same = doc_of_token[:, 0] == doc_of_token[:, 1]
    assert same[table[:, IS_RANDOM] == 0].all()
    assert (table[:, A_END] > table[:, A_START]).all() and (table[:, B_END] > table[:, B_START]).all()


def test_masked_positions_are_uniform_over_the_candidates():
    """Every non-special position is drawn equally often; [CLS] and both [SEP] never."""
    from data_prep.masking import MaskParams, assemble, mask_samples

    rows, la, lb = 3000, 40, 60
    spans = np.tile(np.array([[0, la, 100, 100 + lb, 0]]), (rows, 1))
    params = MaskParams(vocab_size=500, cls_id=2, sep_id=3, mask_id=4)
    tokens = np.arange(200, dtype=np.int32) + 100
    samples = mask_samples(assemble(tokens, spans, params), spans[:, 1] - spans[:, 0], params, np.random.default_rng(5))
    n, k = la + lb + 3, round((la + lb + 3) * 0.15)
    assert (samples.num_predictions == k).all()
    positions = samples.masked_lm_positions.reshape(rows, k)
    assert (np.diff(positions, axis=1) > 0).all()  # distinct and ascending
    hits = np.bincount(positions.ravel(), minlength=n)
    assert hits[[0, la + 1, n - 1]].sum() == 0
    candidates = np.setdiff1d(np.arange(n), [0, la + 1, n - 1])
    expected = rows * k / candidates.shape[0]
    assert np.abs(hits[candidates] - expected).max() < 5 * np.sqrt(expected)
