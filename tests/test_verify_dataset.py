"""verify_dataset.py: valid folders pass; each kind of damage is named with its file and row."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from data_prep.pack import PackParams, pack_dataset
from data_prep.reshard import ReshardParams, reshard
from data_prep.stratify import StratifyParams, stratify
from data_prep.verify_dataset import main
from mlperf_bert.data.shards import Samples, write_samples

ROOT = Path(__file__).resolve().parents[1]

VOCAB, CLS, SEP, MASK = 600, 2, 3, 4


def valid_samples(count: int, seed: int = 0) -> Samples:
    """[CLS] A [SEP] B [SEP] sequences with reference-style masking, built without data_prep."""
    rng = np.random.default_rng(seed)
    ids, segments, positions, labels, lengths, counts = [], [], [], [], [], []
    for n in rng.integers(5, 513, count).tolist():
        a = int(rng.integers(1, n - 3))
        seq = rng.integers(5, VOCAB, n)
        seq[[0, a + 1, n - 1]] = CLS, SEP, SEP
        candidates = np.setdiff1d(np.arange(1, n - 1), [a + 1])
        chosen = np.sort(rng.choice(candidates, min(76, max(1, round(n * 0.15))), replace=False))
        labels.append(seq[chosen].copy())
        seq[chosen[rng.random(chosen.shape[0]) < 0.8]] = MASK
        ids.append(seq), positions.append(chosen), lengths.append(n), counts.append(chosen.shape[0])
        segments.append((np.arange(n) > a + 1).astype(np.int8))
    return Samples(np.concatenate(ids).astype(np.int32), np.concatenate(segments), np.array(lengths),
                   np.concatenate(positions).astype(np.int32), np.concatenate(labels).astype(np.int32),
                   np.array(counts), rng.integers(0, 2, count).astype(np.int8))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    write_samples(root / "parts" / "part-00000-of-00001.hdf5", valid_samples(300), "fixed", 512, 76)
    dirs = {"fixed": root / "fixed", "varlength": root / "varlength"}
    reshard([root / "parts" / "part-00000-of-00001.hdf5"], dirs, ReshardParams(num_shards=3))
    pack_dataset(sorted(dirs["varlength"].glob("*.hdf5")), root / "packed", PackParams(algorithm="lpfhp"))
    stratify(sorted(dirs["varlength"].glob("*.hdf5")), root / "strata", StratifyParams(shards_per_stratum=2))
    return root


def damaged(folders: Path, name: str, tmp_path: Path) -> Path:
    copy = tmp_path / name
    shutil.copytree(folders / name, copy)
    return copy


def run_verify(capsys, *args, workers: int = 1) -> tuple[int, str]:
    code = main([str(a) for a in args] + ["--vocab_size", str(VOCAB), "--workers", str(workers)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_valid_folders_pass(folders, capsys):
    names = ("parts", "fixed", "varlength", "packed", "strata")
    code, out = run_verify(capsys, *(folders / n for n in names), workers=2)
    assert code == 0, out
    assert out.count("OK:") == 5 and "300 samples" in out


def test_command_line_script(folders):
    env = {**os.environ, "PYTHONPATH": ""}
    ok = subprocess.run([sys.executable, str(ROOT / "data_prep" / "verify_dataset.py"), str(folders / "varlength"),
                         "--workers", "1"],
                        capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    missing = subprocess.run([sys.executable, str(ROOT / "data_prep" / "verify_dataset.py"), str(folders / "nothing")],
                             capture_output=True, text=True, env=env)
    assert missing.returncode == 1 and "not a folder" in missing.stderr


def test_truncated_shard_is_named(folders, tmp_path, capsys):
    folder = damaged(folders, "varlength", tmp_path)
    shard = sorted(folder.glob("*.hdf5"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    code, out = run_verify(capsys, folder)
    assert code == 1
    assert f"{shard}: cannot be opened as hdf5" in out and "truncated" in out


@pytest.mark.parametrize("damage, message", [
    (lambda f: f["input_ids"].__setitem__((4, 1), VOCAB + 7), "row 4: input_ids outside [0, 600)"),
    (lambda f: f["input_mask"].__setitem__((9, 2), 0), "row 9: input_mask is not a prefix of ones"),
    (lambda f: f["masked_lm_positions"].__setitem__((2, 0), int(f["input_mask"][2].sum()) - 1),
     "row 2: a masked position outside the sequence or on [CLS]/[SEP]"),
    (lambda f: f["segment_ids"].__setitem__((6, 0), 1), "row 6: segment_ids do not start with 0"),
    (lambda f: f["next_sentence_labels"].__setitem__(3, 2), "row 3: next_sentence_labels is not 0 or 1"),
])
def test_damaged_fixed_rows_are_named(folders, tmp_path, capsys, damage, message):
    folder = damaged(folders, "fixed", tmp_path)
    shard = sorted(folder.glob("*.hdf5"))[0]
    with h5py.File(shard, "r+") as handle:
        damage(handle)
    code, out = run_verify(capsys, folder)
    assert code == 1
    assert f"{shard}: {message}" in out
    assert f"{shard}: sha256 differs from the manifest" in out


def test_manifest_mismatches(folders, tmp_path, capsys):
    folder = damaged(folders, "varlength", tmp_path)
    shards = sorted(folder.glob("*.hdf5"))
    shards[0].unlink()
    shutil.copy(shards[1], folder / "stray.hdf5")
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    manifest["files"][shards[2].name]["samples"] += 1
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))
    code, out = run_verify(capsys, folder)
    assert code == 1
    assert f"{shards[0]}: listed in MANIFEST.json but missing" in out
    assert f"{folder / 'stray.hdf5'}: not listed in MANIFEST.json" in out
    assert f"{shards[2]}: 100 rows, the manifest says 101" in out


def test_strata_and_packing_reports_are_checked(folders, tmp_path, capsys):
    strata = damaged(folders, "strata", tmp_path)
    record = json.loads((strata / "strata.json").read_text())
    record["counts"][0] += 5
    (strata / "strata.json").write_text(json.dumps(record))
    packed = damaged(folders, "packed", tmp_path)
    report = json.loads((packed / "packing_report.json").read_text())
    report["sequences_dropped"] = 4
    (packed / "packing_report.json").write_text(json.dumps(report))
    code, out = run_verify(capsys, strata, packed)
    assert code == 1
    assert f"{strata / 'strata.json'}: counts" in out and "but the stratum folders hold" in out
    assert f"{packed / 'packing_report.json'}: 4 sequences dropped" in out


def test_packed_slot_damage_is_named(folders, tmp_path, capsys):
    folder = damaged(folders, "packed", tmp_path)
    shard = sorted(folder.glob("*.hdf5"))[0]
    with h5py.File(shard, "r+") as handle:
        lengths = handle["packed_input_len"][()]
        row = int(np.flatnonzero(lengths[:, -1] == 0)[0])
        handle["next_sentence_labels"][row, -1] = 0
    code, out = run_verify(capsys, folder)
    assert code == 1 and f"{shard}: row {row}: an empty slot has predictions or a label other than -1" in out


def test_vocabulary_checks_the_special_tokens(folders, tmp_path, capsys):
    vocab = tmp_path / "vocab.txt"
    swapped = ["[PAD]", "[UNK]", "[SEP]", "[CLS]", "[MASK]"]  # [CLS] and [SEP] trade ids
    vocab.write_text("\n".join(swapped + [f"w{i}" for i in range(VOCAB - 5)]) + "\n")
    code = main([str(folders / "varlength"), "--vocab", str(vocab), "--workers", "1"])
    out = capsys.readouterr()
    assert code == 1 and "not [CLS] A [SEP] B [SEP]" in out.err


def test_missing_key_and_non_hdf5_file(folders, tmp_path, capsys):
    folder = damaged(folders, "varlength", tmp_path)
    shard = sorted(folder.glob("*.hdf5"))[0]
    with h5py.File(shard, "r+") as handle:
        del handle["masked_lm_ids"]
    (folder / "notes.hdf5").write_text("not hdf5 at all")
    code, out = run_verify(capsys, folder)
    assert code == 1
    assert f"{shard}: key 'masked_lm_ids' missing" in out
    assert f"{folder / 'notes.hdf5'}: cannot be opened as hdf5" in out


def _rules_one_by_one(s: Samples, limits) -> dict[str, set[int]]:
    """Every per-sequence rule written plainly, one sequence at a time: the reference for the
    vectorised checks. Keys are words of the problem line each rule prints."""
    found: dict[str, set[int]] = {}
    token_at, pred_at = np.r_[0, np.cumsum(s.lengths)], np.r_[0, np.cumsum(s.num_predictions)]
    for i in range(len(s)):
        n = int(s.lengths[i])
        ids = s.input_ids[token_at[i]:token_at[i + 1]].tolist()
        seg = s.segment_ids[token_at[i]:token_at[i + 1]].tolist()
        pos = s.masked_lm_positions[pred_at[i]:pred_at[i + 1]].tolist()
        labels = s.masked_lm_ids[pred_at[i]:pred_at[i + 1]].tolist()
        a_len = seg.count(0)
        broken = {
            "shorter than": n < 5,
            "longer than": n > limits.max_seq_length,
            "more than max_predictions": len(pos) > limits.max_predictions,
            "next_sentence_labels": int(s.next_sentence_labels[i]) not in (0, 1),
            "other than 0 and 1": any(v not in (0, 1) for v in seg),
            "decrease": any(b < a for a, b in zip(seg, seg[1:])),
            "start with 0": n > 0 and (seg[0] != 0 or seg[-1] != 1),
            "input_ids outside": any(not 0 <= v < limits.vocab_size for v in ids),
            "special tokens": n > 0 and (ids[0] != CLS or ids[-1] != SEP or ids[max(a_len, 1) - 1] != SEP),
            "outside the sequence": any(p < 1 or p >= n - 1 or p == a_len - 1 for p in pos),
            "not ascending": any(b <= a for a, b in zip(pos, pos[1:])),
            "masked_lm_ids outside": any(not 0 <= v < limits.vocab_size for v in labels),
        }
        for word, bad in broken.items():
            if bad:
                found.setdefault(word, set()).add(i)
    return found


def test_vectorised_sequence_rules_equal_the_rules_applied_one_sequence_at_a_time():
    from data_prep.verify_dataset import Limits, _sequence_checks

    rng = np.random.default_rng(7)
    s = valid_samples(400, seed=3)
    # Damage a random fifth of every column with values around each rule's edges (negatives,
    # the vocabulary's end, segment ids 2 and -1, positions 0 and past the end), and empty and
    # over-long sequences by moving lengths between neighbours (the token total stays).
    for column, low, high in ((s.input_ids, -3, VOCAB + 3), (s.segment_ids, -1, 3), (s.masked_lm_ids, -3, VOCAB + 3),
                              (s.masked_lm_positions, -2, 520), (s.next_sentence_labels, -1, 3)):
        hit = rng.random(column.shape[0]) < 0.2
        column[hit] = rng.integers(low, high, int(hit.sum()))
    for i in rng.choice(len(s) - 1, 20, replace=False):
        moved = int(s.lengths[i])
        s.lengths[i], s.lengths[i + 1] = 0, s.lengths[i + 1] + moved
    limits = Limits(300, 40, VOCAB, CLS, SEP)
    got = {message: set(np.flatnonzero(bad).tolist()) for bad, message in _sequence_checks(s, limits)}
    expected = _rules_one_by_one(s, limits)
    assert len(got) == 12
    for word in expected.keys() | {"decrease", "special tokens"}:
        message = next(m for m in got if word in m)
        assert got[message] == expected.get(word, set()), message
    assert all(expected.get(word) for word in ("decrease", "special tokens", "outside the sequence", "longer than"))
