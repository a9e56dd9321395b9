"""`samples` and `eval` against the outputs of the unmodified MLCommons scripts.

tests/harness/data/reference_samples/ (its README says how the files were made) holds what
create_pretraining_data.py and pick_eval_samples.py wrote for golden_text.txt with the MLPerf
vocab.txt, and the reference FullTokenizer's ids of every line. Every row, every key and the
row order must be equal. The compiled Mersenne Twister draws are held against Python's
`random` itself.
"""

from __future__ import annotations

import io
import lzma
import random
from pathlib import Path

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data_prep import mt19937 as mt
from data_prep import prepare
from data_prep import reference_algorithm as ref
from data_prep.eval_set import EvalParams, pick_indices
from mlperf_bert.data.shards import open_shard as open_h5
from data_prep.text import tokenize_file
from data_prep.vocab import LineEncoder, load_vocab
from tests.harness.golden_samples import KEYS, golden_arrays
from tests.harness.paths import REFERENCE_SAMPLES


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    """(text folder holding golden_text.txt as a part file, vocab.txt), unpacked."""
    folder = tmp_path_factory.mktemp("golden")
    text = folder / "text" / "part-00000-of-00001"
    text.parent.mkdir()
    text.write_bytes(lzma.decompress((REFERENCE_SAMPLES / "golden_text.txt.xz").read_bytes()))
    vocab = folder / "vocab.txt"
    vocab.write_bytes(lzma.decompress((REFERENCE_SAMPLES / "vocab.txt.xz").read_bytes()))
    return text, vocab


def run_samples(inputs, out: Path, *flags: str) -> Path:
    text, vocab = inputs
    argv = ["--quiet", "samples", "--text", str(text.parent), "--vocab", str(vocab), "--out", str(out), *flags]
    assert prepare.main(argv) == 0
    return out / f"{text.name}.hdf5"


def assert_rows_equal(path: Path, expected: dict[str, np.ndarray]) -> None:
    with open_h5(path) as ours:
        for key in KEYS:
            got = ours[key][:]
            assert got.shape == expected[key].shape, key
            differing = np.flatnonzero((got != expected[key]).reshape(len(got), -1).any(axis=1))
            assert differing.size == 0, f"{key}: {differing.size} rows differ, first {differing[:5].tolist()}"


def test_tokens_of_every_line_equal_the_reference(inputs):
    golden = np.load(io.BytesIO(lzma.decompress((REFERENCE_SAMPLES / "golden_text_tokens.npz.xz").read_bytes())))
    raw = inputs[0].read_bytes().split(b"\n")[:-1]
    lines = [line.decode().strip() for line in raw]
    ids, lengths = LineEncoder(load_vocab(inputs[1])).encode(lines)
    assert lengths.tolist() == golden["lengths"].tolist()
    assert np.array_equal(ids, golden["ids"])
    tokenized = tokenize_file(inputs[0], LineEncoder(load_vocab(inputs[1])))
    assert np.diff(tokenized.document_starts).tolist() == golden["doc_sentence_counts"].tolist()


def test_plain_python_tokenizer_equals_the_reference_on_every_line(inputs):
    golden = np.load(io.BytesIO(lzma.decompress((REFERENCE_SAMPLES / "golden_text_tokens.npz.xz").read_bytes())))
    tokenizer = ref.ReferenceTokenizer(load_vocab(inputs[1]))
    lines = [line.decode().strip() for line in inputs[0].read_bytes().split(b"\n")[:-1]]
    ids = [i for line in lines for i in tokenizer.ids(tokenizer.tokenize(line))]
    assert ids == golden["ids"].tolist()


def test_carriage_returns_inside_lines_are_deleted(inputs, tmp_path):
    text = tmp_path / "part-00000-of-00001"
    text.write_bytes(b"abc\rdef ghi.\r\nsecond line here.\n\nother doc.\n")
    tokenized = tokenize_file(text, LineEncoder(load_vocab(inputs[1])))
    tokenizer = ref.ReferenceTokenizer(load_vocab(inputs[1]))
    expected = [tokenizer.ids(tokenizer.tokenize(s)) for s in ("abcdef ghi.", "second line here.", "other doc.")]
    assert tokenized.tokens.tolist() == [i for e in expected for i in e]


def test_samples_512_equal_the_reference_and_eval_pick(inputs, tmp_path):
    made = run_samples(inputs, tmp_path / "parts")
    assert_rows_equal(made, golden_arrays("golden_512"))
    argv = ["--quiet", "eval", "--input", str(made), "--out", str(tmp_path), "--num_eval_samples", "1000"]
    assert prepare.main(argv) == 0
    assert_rows_equal(tmp_path / "eval_fixed" / "part_eval_1000.hdf5", golden_arrays("golden_512_pick1000"))


def test_samples_128_equal_the_reference_with_two_workers(inputs, tmp_path):
    text = inputs[0]
    second = tmp_path / "text" / "part-00001-of-00002"
    second.parent.mkdir()
    second.write_bytes(text.read_bytes())
    flags = ["--max_seq_length", "128", "--max_predictions", "20", "--dupe_factor", "2", "--workers", "2"]
    argv = ["--quiet", "samples", "--text", str(second.parent), str(text), "--vocab", str(inputs[1]),
            "--out", str(tmp_path / "out"), *flags]
    assert prepare.main(argv) == 0
    expected = golden_arrays("golden_128")
    assert_rows_equal(tmp_path / "out" / f"{text.name}.hdf5", expected)
    assert_rows_equal(tmp_path / "out" / f"{second.name}.hdf5", expected)


def test_plain_python_algorithm_equals_the_reference(inputs):
    vocab = load_vocab(inputs[1])
    tokenizer = ref.ReferenceTokenizer(vocab)
    instances = ref.create_instances(inputs[0], tokenizer, vocab, dupe_factor=2, max_seq_length=128,
                                     max_predictions=20)
    rows = [ref.padded_features(i, tokenizer, 128, 20) for i in instances]
    for key, expected in golden_arrays("golden_128").items():
        assert np.array_equal(np.array([r[key] for r in rows]).reshape(expected.shape), expected), key


@numba.njit
def _draws(words, position, bounds):
    out = np.empty((bounds.shape[0], 3))
    for i in range(bounds.shape[0]):
        out[i, 0] = mt.random_float(words, position)
        out[i, 1] = mt.randbelow(words, position, bounds[i])
        out[i, 2] = mt.randint(words, position, -3, bounds[i])
    return out


@numba.njit
def _shuffled(words, position, n):
    values = np.arange(n)
    mt.shuffle(words, position, values)
    return values


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**64), skip=st.integers(0, 700),
       bounds=st.lists(st.integers(1, 2**32 - 5) | st.integers(1, 600), min_size=1, max_size=300))
def test_compiled_draws_equal_python_random(seed, skip, bounds):
    rng = random.Random(seed)
    if skip:
        rng.getrandbits(32 * skip)  # start anywhere within the 624-word block
    words, position = mt.twister_from(rng)
    got = _draws(words, position, np.array(bounds, np.int64))
    expected = [(rng.random(), rng._randbelow(n), rng.randint(-3, n)) for n in bounds]
    assert got.tolist() == [list(map(float, e)) for e in expected]
    assert mt.to_random(words, position).getstate() == rng.getstate()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), n=st.integers(0, 3000))
def test_compiled_shuffle_equals_python_shuffle(seed, n):
    rng = random.Random(seed)
    words, position = mt.twister_from(rng)
    values = list(range(n))
    rng.shuffle(values)
    assert _shuffled(words, position, n).tolist() == values
    assert mt.to_random(words, position).random() == rng.random()


@pytest.mark.parametrize("total", [10_000, 10_875, 20_500, 843_343])
def test_eval_pick_uses_the_float_ratio(total):
    """pick_eval_samples.py: records[int(i * pick_ratio)], pick_ratio = N / num (float division)."""
    ratio = total / 10_000
    assert pick_indices(total, EvalParams()).tolist() == [int(i * ratio) for i in range(10_000)]
    if total in (10_875, 20_500):  # where the ratio's rounding differs from exact i * N // 10000
        assert pick_indices(total, EvalParams()).tolist() != [i * total // 10_000 for i in range(10_000)]
