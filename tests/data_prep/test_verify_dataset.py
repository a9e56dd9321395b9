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
from tests.harness.paths import REPO


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
    ok = subprocess.run([sys.executable, str(REPO / "data_prep" / "verify_dataset.py"), str(folders / "varlength"),
                         "--workers", "1"],
                        capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    missing = subprocess.run([sys.executable, str(REPO / "data_prep" / "verify_dataset.py"), str(folders / "nothing")],
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
    (lambda f: f["next_sentence_labels"].__setitem__(3, -1), "row 3: next_sentence_labels is not 0 or 1"),
    (lambda f: f["masked_lm_positions"].__setitem__((5, 1), f["masked_lm_positions"][5, 0]),
     "row 5: masked positions not ascending"),  # a position masked twice
    (lambda f: f["input_ids"].__setitem__((4, 1), -1), "row 4: input_ids outside [0, 600)"),
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
    # Lengths at the edges of the length rules: 4 and 5 tokens (MIN_LENGTH), 300 and 301 (the limit).
    for i, length in zip(rng.choice(np.flatnonzero(s.lengths[:-1] > 310), 8, replace=False), (4, 5, 300, 301) * 2):
        moved = int(s.lengths[i]) - length
        s.lengths[i], s.lengths[i + 1] = length, s.lengths[i + 1] + moved
    limits = Limits(300, 40, VOCAB, CLS, SEP)
    got = {message: set(np.flatnonzero(bad).tolist()) for bad, message in _sequence_checks(s, limits)}
    expected = _rules_one_by_one(s, limits)
    assert len(got) == 12
    for word in expected.keys() | {"decrease", "special tokens"}:
        message = next(m for m in got if word in m)
        assert got[message] == expected.get(word, set()), message
    assert all(expected.get(word) for word in ("decrease", "special tokens", "outside the sequence", "longer than",
                                               "shorter than"))
    assert {4, 5, 300, 301} <= set(s.lengths.tolist())


# ---------------------------------------------------------------- the verification record (VERIFIED.json)


def _read_record(folder: Path):
    from mlperf_bert.data.record import read_record

    record = read_record(folder)
    assert record is not None, folder
    return record


def test_the_record_holds_every_field_the_verification_saw(folders, tmp_path, capsys):
    """Each file's size, mtime, sha256, rows and sequences, and the folder's maxima and packed widths,
    each computed here again from the files."""
    from data_prep.fileio import sha256_file
    from mlperf_bert.data.shards import read_samples

    names = ("fixed", "packed")
    copies = [damaged(folders, name, tmp_path) for name in names]
    assert run_verify(capsys, *copies)[0] == 0
    for folder in copies:
        record = _read_record(folder)
        shards = sorted(folder.glob("*.hdf5"))
        assert record.ok and record.kind == "train" and record.eval_digests == () and record.problems == ()
        assert sorted(record.files) == [p.name for p in shards]
        samples = [read_samples(p) for p in shards]
        for path, rows in zip(shards, samples):
            entry = record.files[path.name]
            with h5py.File(path, "r") as handle:
                stored_rows = handle["input_ids"].shape[0]
            assert (entry.bytes, entry.mtime_ns) == (path.stat().st_size, path.stat().st_mtime_ns)
            assert (entry.sha256, entry.rows, entry.sequences) == (sha256_file(path), stored_rows, len(rows))
        assert record.sequences == sum(len(s) for s in samples) == 300
        assert record.longest == max(int(s.lengths.max()) for s in samples)
        assert record.most_predictions == max(int(s.num_predictions.max()) for s in samples)
        assert record.max_token_id == max(int(max(s.input_ids.max(), s.masked_lm_ids.max())) for s in samples)
    packed_widths = []
    for path in sorted(copies[1].glob("*.hdf5")):
        with h5py.File(path, "r") as handle:
            packed_widths.append(tuple(handle[k].shape[1] for k in ("input_ids", "packed_input_len",
                                                                    "masked_lm_positions")))
    assert _read_record(copies[1]).packed == tuple(max(w[i] for w in packed_widths) for i in range(3))
    assert _read_record(copies[0]).packed is None


def test_the_packed_widths_are_the_widest_of_any_shard_not_the_first(tmp_path):
    """`pack` sizes K and Q per shard: whichever shard has the widest row sets each recorded width."""
    from data_prep.verify_dataset import ShardReport, _packed_widths

    widths = [(512, 3, 80), (512, 4, 78), (384, 2, 90)]
    for order in (widths, widths[::-1], widths[1:] + widths[:1]):
        reports = {f"part_{i}.hdf5": ShardReport(tmp_path / f"part_{i}.hdf5", packed=w) for i, w in enumerate(order)}
        reports["fixed.hdf5"] = ShardReport(tmp_path / "fixed.hdf5")
        assert _packed_widths(reports) == (512, 4, 90)
    assert _packed_widths({"fixed.hdf5": ShardReport(tmp_path / "fixed.hdf5")}) is None


def test_a_label_above_every_input_id_is_the_recorded_largest_token_id(tmp_path, capsys):
    """The record's max_token_id is held against the model's vocabulary before the clock: a masked
    label counts as much as an input token."""
    samples = valid_samples(20, seed=4)
    samples.input_ids = np.minimum(samples.input_ids, VOCAB - 10).astype(np.int32)
    samples.masked_lm_ids[7] = VOCAB - 1
    write_samples(tmp_path / "data" / "part-00000-of-00001.hdf5", samples, "fixed", 512, 76)
    assert run_verify(capsys, tmp_path / "data")[0] == 0
    assert _read_record(tmp_path / "data").max_token_id == VOCAB - 1


def test_a_failed_verification_is_recorded_as_failed_with_its_problems(folders, tmp_path, capsys):
    folder = damaged(folders, "fixed", tmp_path)
    with h5py.File(sorted(folder.glob("*.hdf5"))[0], "r+") as handle:
        handle["next_sentence_labels"][3] = 2
    code, out = run_verify(capsys, folder)
    record = _read_record(folder)
    assert code == 1 and not record.ok
    assert record.problems and all(problem in out for problem in record.problems)
    assert any("row 3: next_sentence_labels is not 0 or 1" in problem for problem in record.problems)


def _eval_folder(root: Path, name: str, samples: Samples) -> Path:
    folder = root / name
    write_samples(folder / "eval.hdf5", samples, "fixed", 512, 76)
    return folder


def test_training_data_is_checked_against_every_eval_set_and_its_record_names_them(tmp_path, capsys):
    """Two eval sets: every leaked sample of either is counted (their hashes are looked up together),
    and the training folder's record lists both eval sets' digests, each the eval folder's own."""
    from mlperf_bert.data.integrity import eval_hashes, samples_digest

    first, second = valid_samples(150, seed=11), valid_samples(150, seed=12)
    evals = [_eval_folder(tmp_path, "eval_a", first), _eval_folder(tmp_path, "eval_b", second)]
    train = Samples.concat([valid_samples(200, seed=13), first.slice(0, 40), second.slice(60, 150)])
    write_samples(tmp_path / "train" / "part-00000-of-00001.hdf5", train, "fixed", 512, 76)
    code, out = run_verify(capsys, evals[0], tmp_path / "train", evals[1])  # eval sets by their files' names
    assert code == 1 and "130 eval samples of " in out and "(130, first at row 200)" in out, out
    digests = tuple(sorted(samples_digest(eval_hashes(folder)) for folder in evals))
    assert _read_record(tmp_path / "train").eval_digests == digests
    assert {_read_record(folder).samples_digest for folder in evals} == set(digests)
    assert all(_read_record(folder).kind == "eval" and _read_record(folder).ok for folder in evals)


def test_a_shard_changed_while_it_was_read_is_a_problem_and_keeps_its_earlier_time(folders, tmp_path, capsys,
                                                                                   monkeypatch):
    """The record's size and mtime are taken before the read: a file written during the read is
    reported, and its record entry no longer matches it (the trainer's stat check refuses it)."""
    from data_prep import verify_dataset
    from mlperf_bert.data.record import stale_problems

    folder = damaged(folders, "varlength", tmp_path)
    shard = sorted(folder.glob("*.hdf5"))[1]
    original = verify_dataset.verify_shard

    def touched_while_read(path, *args, **kwargs):
        report = original(path, *args, **kwargs)
        if Path(path) == shard:
            os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1_000_000_000))
        return report

    monkeypatch.setattr(verify_dataset, "verify_shard", touched_while_read)
    code, out = run_verify(capsys, folder)
    assert code == 1 and f"{shard}: changed while it was verified; verify the folder again" in out
    entry = _read_record(folder).files[shard.name]
    assert entry.mtime_ns == shard.stat().st_mtime_ns - 1_000_000_000
    assert any(str(shard) in problem for problem in stale_problems(_read_record(folder)))


# ---------------------------------------------------------------- which folders are eval sets, which training


def test_folders_data_prep_writes_are_training_folders_by_their_own_account(folders):
    from data_prep.verify_dataset import eval_reason, is_training_folder

    for name in ("parts", "fixed", "varlength", "packed", "strata"):
        assert is_training_folder(folders / name) and eval_reason(folders / name) is None, name


def test_a_training_folder_with_one_eval_named_file_is_not_an_eval_set(tmp_path):
    from data_prep.verify_dataset import eval_reason, is_eval_folder

    mixed = tmp_path / "mixed"
    write_samples(mixed / "part-00000-of-00001.hdf5", valid_samples(5), "fixed", 512, 76)
    write_samples(mixed / "eval_10k.hdf5", valid_samples(5, seed=1), "fixed", 512, 76)
    assert not is_eval_folder(mixed) and eval_reason(mixed) is None
    (mixed / "part-00000-of-00001.hdf5").unlink()
    assert eval_reason(mixed) == "eval files"


@pytest.mark.parametrize("stratum, shortest, longest, refused", [
    (0, 1, 128, False), (0, 1, 129, True), (1, 129, 512, False), (1, 128, 300, True), (1, 200, 513, True),
])
def test_a_stratum_holds_lengths_inside_its_bounds_at_both_edges(tmp_path, stratum, shortest, longest, refused):
    from data_prep.verify_dataset import ShardReport, _strata_problems

    (tmp_path / "strata.json").write_text(json.dumps({"bounds": [128, 512], "counts": [3, 3], "shares": [0.5, 0.5]}))
    reports = {f"stratum_{k}/a.hdf5": ShardReport(tmp_path / f"stratum_{k}" / "a.hdf5", sequences=3,
                                                  shortest=64 if k == 0 else 300, longest=100 if k == 0 else 400)
               for k in (0, 1)}
    reports[f"stratum_{stratum}/a.hdf5"].shortest, reports[f"stratum_{stratum}/a.hdf5"].longest = shortest, longest
    problems = _strata_problems(tmp_path, reports)
    low, high = (0, 128) if stratum == 0 else (128, 512)
    assert problems == ([f"{tmp_path}/stratum_{stratum}: holds lengths outside ({low}, {high}]"] if refused else [])
