"""data_prep/make_demo_data.py, run as a user runs it, and its output read back by data/dataset.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest

from mlperf_bert.data.batch import Sample
from mlperf_bert.data.dataset import DataLimits, discover_shards, load_eval_set, read_shard
from tests.harness.paths import REPO

SCRIPT = REPO / "data_prep" / "make_demo_data.py"
HISTOGRAM = REPO / "pytorch" / "mlperf_bert" / "data" / "wikipedia_phase2_seqlen_histogram.json"
MAX_LEN, MAX_PRED, VOCAB = 128, 20, 512
LIMITS = DataLimits(MAX_LEN, MAX_PRED, VOCAB)


def run_cli(
    out: Path, *extra: str, num_train: int = 3000, num_eval: int = 1000, seed: int = 3
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, str(SCRIPT), "--output_dir", str(out), "--num_train", str(num_train),
        "--num_eval", str(num_eval), "--num_shards", "3", "--max_seq_length", str(MAX_LEN),
        "--max_predictions_per_seq", str(MAX_PRED), "--vocab_size", str(VOCAB), "--seed", str(seed), *extra,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    result = run_cli(out)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def manifest(demo: Path) -> dict:
    return json.loads((demo / "demo_data.json").read_text())


@pytest.fixture(scope="module")
def train(demo: Path) -> list[Sample]:
    return [s for path in discover_shards(demo / "train") for item in read_shard(path, LIMITS) for s in item]


@pytest.fixture(scope="module")
def evalset(demo: Path) -> list[Sample]:
    return [item[0] for item in load_eval_set(demo / "eval", 1000, 0, 1, LIMITS)]


def content_mask(s: Sample, first_content: int) -> np.ndarray:
    """[n] True where the original (unmasked) token is a content token, i.e. not [CLS]/[SEP]."""
    original = s.input_ids.copy()
    original[s.masked_lm_positions] = s.masked_lm_ids
    return original >= first_content


def test_layout_and_config(demo: Path, manifest: dict) -> None:
    shards = discover_shards(demo / "train")
    assert [p.name for p in shards] == [f"part_0000{i}_of_00003.hdf5" for i in range(3)]
    assert [len(read_shard(p, LIMITS)) for p in shards] == [1000, 1000, 1000]
    assert [p.name for p in discover_shards(demo / "eval")] == ["part_eval_1000.hdf5"]
    assert manifest["files"]["eval/part_eval_1000.hdf5"] == 1000
    assert not [p for p in demo.rglob("*") if ".tmp" in p.name]
    config = json.loads((demo / "bert_config.json").read_text())
    assert config["vocab_size"] == VOCAB and config["max_position_embeddings"] == MAX_LEN
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (128, 2, 2)
    assert config["intermediate_size"] == 512 and config["type_vocab_size"] == 2
    vocab = (demo / "vocab.txt").read_text().splitlines()
    assert len(vocab) == VOCAB and len(set(vocab)) == VOCAB
    for token, token_id in manifest["special_tokens"].items():
        assert vocab[token_id] == token
    assert vocab[0] == "[PAD]" and vocab[1].startswith("[unused")


def test_sequence_structure(train: list[Sample], manifest: dict) -> None:
    cls, sep = manifest["special_tokens"]["[CLS]"], manifest["special_tokens"]["[SEP]"]
    for s in train[:500]:
        seps = np.flatnonzero(s.input_ids == sep)
        assert s.input_ids[0] == cls and seps[-1] == s.length - 1 and len(seps) == 2
        np.testing.assert_array_equal(s.segment_ids, (np.arange(s.length) > seps[0]).astype(s.segment_ids.dtype))
        assert np.all(np.diff(s.masked_lm_positions) > 0)
        assert np.all(s.masked_lm_ids >= manifest["first_content_token"])  # never [CLS] or [SEP]


def expected_length_pmf(max_len: int, min_len: int) -> np.ndarray:
    """pmf over lengths 0..max_len: each histogram length l goes to round-half-up(l * max / 512)."""
    data = json.loads(HISTOGRAM.read_text())
    pmf = np.zeros(max_len + 1)
    for l, count in enumerate(data["counts"], start=1):
        scaled = (2 * l * max_len + data["max_seq_length"]) // (2 * data["max_seq_length"])
        pmf[min(max(scaled, min_len), max_len)] += count
    return pmf / pmf.sum()


def test_lengths_follow_scaled_histogram(train: list[Sample]) -> None:
    lengths = np.array([s.length for s in train])
    pmf = expected_length_pmf(MAX_LEN, 8)
    empirical = np.bincount(lengths, minlength=MAX_LEN + 1) / len(lengths)
    ks = np.abs(np.cumsum(empirical) - np.cumsum(pmf)).max()
    assert ks < 0.04  # 3000 samples: 99.9% of KS distances of a correct sampler stay below 0.036
    expected_mean = (np.arange(MAX_LEN + 1) * pmf).sum()
    assert abs(lengths.mean() - expected_mean) < 2.0
    assert abs((lengths == MAX_LEN).mean() - pmf[MAX_LEN]) < 0.03  # ~23% are full length


def test_masking_ratio_and_80_10_10(train: list[Sample], manifest: dict) -> None:
    first, mask_id = manifest["first_content_token"], manifest["special_tokens"]["[MASK]"]
    content = sum(int(content_mask(s, first).sum()) for s in train)
    predictions = sum(len(s.masked_lm_positions) for s in train)
    assert abs(predictions / content - 0.15) < 0.01
    assert max(len(s.masked_lm_positions) for s in train) <= MAX_PRED
    shown = np.concatenate([s.input_ids[s.masked_lm_positions] for s in train])
    labels = np.concatenate([s.masked_lm_ids for s in train])
    masked, unchanged = (shown == mask_id).mean(), (shown == labels).mean()
    assert abs(masked - 0.8) < 0.02 and abs(unchanged - 0.1) < 0.02
    assert abs((1 - masked - unchanged) - 0.1) < 0.02
    assert np.all(shown[(shown != mask_id)] >= first)  # random replacements are content tokens
    nsp = np.array([s.next_sentence_label for s in train])
    assert abs(nsp.mean() - 0.5) < 0.04


def successor_table(samples: list[Sample], first: int) -> dict[int, int]:
    """The most frequent visible successor of each token, learnt from the data alone."""
    counts: dict[int, Counter] = {}
    for s in samples:
        visible = content_mask(s, first)
        visible[s.masked_lm_positions] = False
        pairs = visible[:-1] & visible[1:]
        for a, b in zip(s.input_ids[:-1][pairs], s.input_ids[1:][pairs]):
            counts.setdefault(int(a), Counter())[int(b)] += 1
    return {a: c.most_common(1)[0][0] for a, c in counts.items()}


def oracle_accuracy(samples: list[Sample], successor: dict[int, int], first: int) -> float:
    """Predicts a masked token from its left visible neighbour, else from its right one."""
    predecessor = {b: a for a, b in successor.items()}
    correct = total = 0
    for s in samples:
        visible = content_mask(s, first)
        visible[s.masked_lm_positions] = False
        for pos, label in zip(s.masked_lm_positions, s.masked_lm_ids):
            left, right = pos - 1, pos + 1
            if visible[left]:
                guess = successor.get(int(s.input_ids[left]))
            elif right < s.length and visible[right]:
                guess = predecessor.get(int(s.input_ids[right]))
            else:
                guess = None
            correct += guess == label
            total += 1
    return correct / total


def test_masked_tokens_are_predictable_from_neighbours(
    train: list[Sample], evalset: list[Sample], manifest: dict
) -> None:
    first = manifest["first_content_token"]
    successor = successor_table(train, first)
    assert len(successor) == VOCAB - first  # every content token was seen with a successor
    assert oracle_accuracy(evalset, successor, first) > 0.9
    shuffled = dict(zip(successor, np.random.default_rng(0).permutation(list(successor.values()))))
    assert oracle_accuracy(evalset, shuffled, first) < 0.1  # the rule, not chance, does it


def test_next_sentence_label_is_predictable(evalset: list[Sample], train: list[Sample], manifest: dict) -> None:
    first, sep = manifest["first_content_token"], manifest["special_tokens"]["[SEP]"]
    successor = successor_table(train, first)
    agree = total = 0
    for s in evalset:
        a_end = int(np.flatnonzero(s.input_ids == sep)[0]) - 1
        if {a_end, a_end + 2} & set(s.masked_lm_positions.tolist()):
            continue  # A's last or B's first token is hidden
        follows = successor[int(s.input_ids[a_end])] == s.input_ids[a_end + 2]
        agree += follows == (s.next_sentence_label == 0)
        total += 1
    assert total > 500 and agree / total > 0.98


def read_all(directory: Path) -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for path in sorted(directory.rglob("*.hdf5")):
        with h5py.File(path, "r") as f:
            out[str(path.relative_to(directory))] = {k: f[k][()] for k in f}
    return out


def test_same_seed_same_data_other_seed_other_data(tmp_path: Path) -> None:
    runs = {name: tmp_path / name for name in ("a", "b", "c")}
    for name, seed in (("a", 9), ("b", 9), ("c", 10)):
        assert run_cli(runs[name], num_train=60, num_eval=20, seed=seed).returncode == 0
    a, b, c = (read_all(runs[n]) for n in ("a", "b", "c"))
    assert a.keys() == b.keys() == c.keys()
    for name in a:
        for key in a[name]:
            np.testing.assert_array_equal(a[name][key], b[name][key])
    assert any(not np.array_equal(a[n]["input_ids"], c[n]["input_ids"]) for n in a)


def test_varlength_format_holds_the_same_samples(tmp_path: Path) -> None:
    fixed, varlength = tmp_path / "fixed", tmp_path / "varlength"
    assert run_cli(fixed, num_train=60, num_eval=20).returncode == 0
    assert run_cli(varlength, "--format", "varlength", num_train=60, num_eval=20).returncode == 0
    with h5py.File(varlength / "train" / "part_00000_of_00003.hdf5", "r") as f:
        assert "input_mask" not in f and h5py.check_vlen_dtype(f["input_ids"].dtype) is not None
    for a, b in zip(sorted(fixed.rglob("*.hdf5")), sorted(varlength.rglob("*.hdf5"))):
        for x, y in zip(read_shard(a, LIMITS), read_shard(b, LIMITS)):
            for field in ("input_ids", "segment_ids", "masked_lm_positions", "masked_lm_ids"):
                np.testing.assert_array_equal(getattr(x[0], field), getattr(y[0], field))
            assert x[0].next_sentence_label == y[0].next_sentence_label


def test_bad_flags_and_stale_shards_are_refused(tmp_path: Path) -> None:
    result = run_cli(tmp_path / "x", "--num_shards", "0")
    assert result.returncode == 2 and "--num_shards" in result.stderr
    result = run_cli(tmp_path / "y", "--cycle_length", "300")
    assert result.returncode == 2 and "--vocab_size" in result.stderr
    stale = tmp_path / "z" / "train"
    stale.mkdir(parents=True)
    (stale / "part_00000_of_00009.hdf5").write_bytes(b"")
    result = run_cli(tmp_path / "z", num_train=30, num_eval=5)
    assert result.returncode != 0 and "part_00000_of_00009.hdf5" in result.stderr
    assert not (tmp_path / "z" / "eval").exists()


@pytest.fixture()
def module(monkeypatch: pytest.MonkeyPatch):
    """The script imported as a module, for its helpers."""
    spec = importlib.util.spec_from_file_location("make_demo_data", SCRIPT)
    loaded = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "make_demo_data", loaded)  # dataclasses look their module up
    spec.loader.exec_module(loaded)
    return loaded


@pytest.mark.parametrize("max_len, min_len", [(128, 8), (512, 1), (64, 12)])
def test_scaled_length_distribution_exactly(module, max_len: int, min_len: int) -> None:
    lengths, probs = module.scaled_length_distribution(HISTOGRAM, max_len, min_len)
    np.testing.assert_array_equal(lengths, np.arange(min_len, max_len + 1))
    np.testing.assert_allclose(probs, expected_length_pmf(max_len, min_len)[min_len:], rtol=1e-12, atol=0)


def test_interrupted_write_leaves_no_file(tmp_path: Path, module) -> None:
    target = tmp_path / "part_00000_of_00001.hdf5"
    with pytest.raises(KeyboardInterrupt):
        with module.atomic_path(target) as tmp:
            tmp.write_bytes(b"half a shard")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
