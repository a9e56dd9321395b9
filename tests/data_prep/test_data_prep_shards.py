"""reshard, eval, pack and stratify steps, the shard layouts, and the trainer reading them.

Samples are identified by the bytes of their content, so "every sample exactly once" is a
multiset comparison that does not trust any index bookkeeping of the code under test.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data_prep.corpus import write_corpus
from data_prep.eval_set import EvalParams, make_eval_set
from data_prep.fileio import read_json
from data_prep.formats import DataPrepError
from data_prep.pack import PackParams, pack_dataset
from data_prep.reshard import ReshardParams, reshard
from data_prep.samples import SampleParams, create_samples
from data_prep.stratify import StratifyParams, stratify
from data_prep.verify_dataset import Limits, verify_directory
from data_prep.vocab import load_vocab
from mlperf_bert.data.shards import (
    Samples, from_fixed, from_packed, from_varlength, list_shards, offsets, read_samples, to_fixed, to_packed,
    to_varlength,
)
from tests.harness.commands import run_cli
from tests.harness.paths import REPO


NUM_SHARDS = 5


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("dataset")
    corpus = write_corpus(root / "text", num_parts=2, documents_per_part=50, eval_documents=30)
    create_samples(corpus.parts, root / "parts", corpus.vocab, SampleParams(dupe_factor=3), workers=1)
    create_samples([corpus.eval_text], root / "eval_parts", corpus.vocab, SampleParams(dupe_factor=3), workers=1)
    dirs = {"fixed": root / "fixed", "varlength": root / "varlength"}
    reshard(sorted((root / "parts").glob("*.hdf5")), dirs, ReshardParams(num_shards=NUM_SHARDS, bucket_samples=700))
    vocab = load_vocab(corpus.vocab)
    return root, corpus, Limits(vocab_size=vocab.size, cls_id=vocab.cls_id, sep_id=vocab.sep_id)


def fingerprints(samples: Samples) -> Counter:
    """Multiset of per-sample content digests (tokens, segments, predictions, label)."""
    tok, pred = offsets(samples.lengths), offsets(samples.num_predictions)
    return Counter(
        (samples.input_ids[tok[i]:tok[i + 1]].tobytes(), samples.segment_ids[tok[i]:tok[i + 1]].tobytes(),
         samples.masked_lm_positions[pred[i]:pred[i + 1]].tobytes(),
         samples.masked_lm_ids[pred[i]:pred[i + 1]].tobytes(),
         int(samples.next_sentence_labels[i]))
        for i in range(len(samples))
    )


def folder_samples(directory: Path, pattern: str = "*.hdf5") -> Samples:
    return Samples.concat([read_samples(p) for p in sorted(directory.glob(pattern))])


def test_reshard_is_a_balanced_shuffled_permutation(dataset):
    root, _, limits = dataset
    parts = folder_samples(root / "parts")
    sizes = [len(read_samples(p)) for p in sorted((root / "fixed").glob("*.hdf5"))]
    assert len(sizes) == NUM_SHARDS and max(sizes) - min(sizes) <= 1 and sum(sizes) == len(parts)
    shuffled = folder_samples(root / "fixed")
    assert fingerprints(shuffled) == fingerprints(parts)
    assert fingerprints(folder_samples(root / "varlength")) == fingerprints(parts)
    assert not np.array_equal(shuffled.lengths, parts.lengths)  # the order changed
    for fmt in ("fixed", "varlength"):
        assert verify_directory(root / fmt, limits)[0] == []


def test_reshard_without_shuffle_keeps_the_order(dataset, tmp_path):
    root, _, _ = dataset
    inputs = sorted((root / "parts").glob("*.hdf5"))
    reshard(inputs, {"varlength": tmp_path}, ReshardParams(num_shards=3, shuffle=False))
    kept, parts = folder_samples(tmp_path), folder_samples(root / "parts")
    assert np.array_equal(kept.input_ids, parts.input_ids) and np.array_equal(kept.lengths, parts.lengths)


def test_reshard_resumes_to_identical_shards_with_two_workers(dataset, tmp_path):
    root, _, _ = dataset
    inputs = sorted((root / "parts").glob("*.hdf5"))
    params = ReshardParams(num_shards=NUM_SHARDS, bucket_samples=700, workers=2)
    reference = {p.name: p.read_bytes() for p in (root / "varlength").glob("*.hdf5")}
    reshard(inputs, {"varlength": tmp_path}, params)
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.hdf5")} == reference
    victim = sorted(tmp_path.glob("*.hdf5"))[2]
    victim.unlink()
    reshard(inputs, {"varlength": tmp_path}, params)
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.hdf5")} == reference


def test_eval_set_picks_evenly_spaced_samples(dataset, tmp_path):
    root, _, limits = dataset
    eval_file = root / "eval_parts" / "eval.hdf5"
    everything = read_samples(eval_file)
    n, total = 50, len(everything)
    make_eval_set([eval_file], {"fixed": tmp_path / "f", "varlength": tmp_path / "v"},
                  EvalParams(num_samples=n))
    picked = read_samples(tmp_path / "v" / "part_eval_50.hdf5")
    expected = everything.take(np.array([int(i * (total / n)) for i in range(n)]))
    assert np.array_equal(picked.input_ids, expected.input_ids)
    assert np.array_equal(picked.masked_lm_positions, expected.masked_lm_positions)
    assert fingerprints(read_samples(tmp_path / "f" / "part_eval_50.hdf5")) == fingerprints(expected)
    assert verify_directory(tmp_path / "v", limits)[0] == []


def test_eval_set_needs_enough_samples(dataset, tmp_path):
    root, _, _ = dataset
    with pytest.raises(DataPrepError, match="fewer than --num_eval_samples"):
        make_eval_set([root / "eval_parts" / "eval.hdf5"], {"varlength": tmp_path}, EvalParams())


@pytest.mark.parametrize("algorithm", ["nnlshp", "lpfhp", "spfhp"])
def test_packing_uses_every_sequence_exactly_once(dataset, tmp_path, algorithm):
    root, _, limits = dataset
    report = pack_dataset(sorted((root / "varlength").glob("*.hdf5")), tmp_path,
                          PackParams(algorithm=algorithm, group_samples=800))
    originals = folder_samples(root / "varlength")
    packed = folder_samples(tmp_path)
    assert fingerprints(packed) == fingerprints(originals)
    assert report["sequences_dropped"] == 0 and report["sequences"] == len(originals)
    assert report == read_json(tmp_path / "packing_report.json")
    assert abs(report["efficiency"] - originals.lengths.sum() / (report["packs"] * 512)) < 1e-12
    assert sum(report["packs_by_size"].values()) == report["packs"]
    assert verify_directory(tmp_path, limits)[0] == []


def test_stratified_shards_hold_their_lengths(dataset, tmp_path):
    root, _, limits = dataset
    record = stratify(sorted((root / "varlength").glob("*.hdf5")), tmp_path, StratifyParams(shards_per_stratum=3))
    originals = folder_samples(root / "varlength")
    bounds = [0, 128, 256, 384, 512]
    expected = [int(((originals.lengths > lo) & (originals.lengths <= hi)).sum()) for lo, hi in zip(bounds, bounds[1:])]
    assert record["counts"] == expected and read_json(tmp_path / "strata.json") == record
    assert np.allclose(record["shares"], np.array(expected) / len(originals))
    together = Counter()
    for k in range(4):
        stratum = folder_samples(tmp_path / f"stratum_{k}")
        assert ((stratum.lengths > bounds[k]) & (stratum.lengths <= bounds[k + 1])).all()
        sizes = [len(read_samples(p)) for p in (tmp_path / f"stratum_{k}").glob("*.hdf5")]
        assert max(sizes) - min(sizes) <= 1
        together += fingerprints(stratum)
    assert together == fingerprints(originals)
    assert verify_directory(tmp_path, limits)[0] == []


def test_trainer_reads_every_format(dataset, tmp_path):
    from mlperf_bert.data import validate as data_validate
    root, corpus, _ = dataset
    pack_dataset(sorted((root / "varlength").glob("*.hdf5")), tmp_path / "packed", PackParams(group_samples=800))
    stratify(sorted((root / "varlength").glob("*.hdf5")), tmp_path / "strata", StratifyParams(fmt="fixed"))
    limits = data_validate.DataLimits(512, 76, load_vocab(corpus.vocab).size)
    strata = sorted((tmp_path / "strata").glob("stratum_*"))
    for complete in (root / "fixed", root / "varlength", tmp_path / "packed", tmp_path / "strata"):
        data_validate.check_dataset(complete, limits)  # the trainer's start-up check accepts every output
    for folder in [root / "fixed", root / "varlength", tmp_path / "packed", *strata]:
        for shard in list_shards(folder):
            items = data_validate.read_shard(shard, limits)
            ours = read_samples(shard)
            sequences = [s for item in items for s in item]
            assert len(sequences) == len(ours)
            assert np.array_equal(np.concatenate([s.input_ids for s in sequences]), ours.input_ids)
            assert np.array_equal(np.concatenate([s.masked_lm_positions for s in sequences]), ours.masked_lm_positions)
            assert [s.next_sentence_label for s in sequences] == ours.next_sentence_labels.tolist()


@st.composite
def random_samples(draw) -> Samples:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    count = draw(st.integers(1, 12))
    lengths = rng.integers(5, 40, count)
    predictions = np.minimum(rng.integers(1, 8, count), lengths - 3)
    positions = np.concatenate([np.sort(rng.choice(np.arange(1, n - 1), k, replace=False))
                                for n, k in zip(lengths, predictions)])
    tokens = lengths.sum()
    return Samples(rng.integers(0, 900, tokens).astype(np.int32), rng.integers(0, 2, tokens).astype(np.int8),
                   lengths.astype(np.int64), positions.astype(np.int32),
                   rng.integers(0, 900, predictions.sum()).astype(np.int32), predictions.astype(np.int64),
                   rng.integers(0, 2, count).astype(np.int8))


def same(a: Samples, b: Samples) -> bool:
    return all(np.array_equal(getattr(a, k), getattr(b, k)) for k in a.__dataclass_fields__)


@settings(max_examples=40, deadline=None)
@given(random_samples(), st.integers(0, 2**32 - 1))
def test_layouts_round_trip(samples, seed):
    assert same(from_fixed(to_fixed(samples, 40, 8)), samples)
    assert same(from_varlength(to_varlength(samples)), samples)
    order = np.random.default_rng(seed).permutation(len(samples))
    table = np.full((len(samples), 3), -1)
    rows, slot, used = 0, 0, 0
    for index in order:  # first fit into rows of 80 tokens, at most 3 per row, filled left to right
        if slot == 3 or used + samples.lengths[index] > 80:
            rows, slot, used = rows + 1, 0, 0
        table[rows, slot], slot, used = index, slot + 1, used + samples.lengths[index]
    table = table[:rows + 1]
    unpacked, row_of = from_packed(to_packed(samples, table, 80))
    assert same(unpacked, samples.take(table[table >= 0]))
    assert np.array_equal(row_of, np.nonzero(table >= 0)[0])


def test_layout_limits_are_enforced():
    samples = Samples(np.zeros(10, np.int32), np.zeros(10, np.int8), np.array([10]), np.array([1], np.int32),
                      np.array([5], np.int32), np.array([1]), np.array([0], np.int8))
    with pytest.raises(DataPrepError, match="max_seq_length=8"):
        to_fixed(samples, 8, 4)
    with pytest.raises(DataPrepError, match="left to right"):
        to_packed(samples, np.array([[-1, 0, -1]]), 16)


def test_prepare_pack_runs_without_the_tfrecord_import_packages(demo_data, tmp_path):
    """A GPU machine without crc32c (only import-tfrecord needs it) still packs: tools/gpu_perf.sh makes its
    trainer's shards with `prepare.py pack` there."""
    fake = tmp_path / "site" / "crc32c"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'crc32c'\")\n")
    pythonpath = f"{tmp_path / 'site'}:{REPO / 'pytorch'}:{REPO}"
    done = run_cli([sys.executable, "data_prep/prepare.py", "--quiet", "pack", "--input", str(demo_data / "train"),
                    "--out", str(tmp_path / "packed"), "--max_seq_length", "64", "--workers", "1"],
                   env={"PYTHONPATH": pythonpath})
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "packed").glob("*.hdf5"))
