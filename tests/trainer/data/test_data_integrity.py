"""Copied training shards and eval samples in the training data (data/integrity.py): refused by
data_prep/verify_dataset.py (every sequence), by the trainer's start-up check (sampled rows) and
by prepare.py's verification; a clean set passes all three."""

from __future__ import annotations

import argparse
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_prep import prepare, verify_dataset
from data_prep.packing import pack_index_table
from mlperf_bert.data.integrity import (
    PROBE_ROWS, ShardDigest, check_integrity, eval_hashes, leaked, probed_rows, sequence_hashes,
)
from data_prep.tfrecords import example_class, masked_crc
from mlperf_bert.data.shards import (
    FIXED_KEYS, REFUSED_NAME, DataError, Samples, decode, folder_problems, list_shards, read_samples, to_fixed,
    to_packed, to_varlength, write_samples,
)
from mlperf_bert.data.validate import DataLimits, check_dataset
from tests.harness.commands import run_cli
from tests.harness.demo import trainer_args
from tests.harness.paths import TRAINER

L, P = 64, 10


def _key(samples: Samples, i: int) -> tuple:
    """An independent identity of sequence i: its fields as bytes."""
    one = samples.slice(i, i + 1)
    return (one.input_ids.tobytes(), one.segment_ids.tobytes(), one.masked_lm_positions.tobytes(),
            one.masked_lm_ids.tobytes(), int(one.next_sentence_labels[0]))


def test_equal_hashes_exactly_for_equal_samples_in_every_layout(demo_data):
    samples = read_samples(list_shards(demo_data / "train")[0])
    # Repeats and near-repeats: the same sample twice, and copies with one field changed.
    near = samples.take(np.arange(5))
    near.next_sentence_labels = 1 - near.next_sentence_labels
    varied = Samples.concat([samples, samples.take(np.array([3, 3, 7])), near])
    hashes = sequence_hashes(varied)
    keys = [_key(varied, i) for i in range(len(varied))]
    for i in range(len(varied)):
        same_key = {j for j in range(len(varied)) if keys[j] == keys[i]}
        assert set(np.flatnonzero(hashes == hashes[i]).tolist()) == same_key
    packs = pack_index_table(samples.lengths, "spfhp", np.random.default_rng(0), L, 3)
    for arrays, fmt in ((to_fixed(samples, L, P), "fixed"), (to_varlength(samples), "varlength"),
                        (to_packed(samples, packs, L), "packed")):
        decoded, _ = decode(arrays, fmt)
        assert sorted(sequence_hashes(decoded).tolist()) == sorted(sequence_hashes(samples).tolist()), fmt


def _copy(demo_data: Path, tmp_path: Path) -> Path:
    root = tmp_path / "data"
    shutil.copytree(demo_data, root)
    return root


def _shards(root: Path) -> list[Path]:
    return list_shards(root / "train")


def _rewrite(path: Path, samples: Samples, **options) -> None:
    path.unlink()
    write_samples(path, samples, "fixed", L, P, **options)


def _leak(root: Path, where: int, count: int) -> Path:
    """Puts the first `count` eval samples into training shard 1 at row `where`."""
    shard = _shards(root)[1]
    train, evals = read_samples(shard), read_samples(list_shards(root / "eval")[0])
    _rewrite(shard, Samples.concat([train.slice(0, where), evals.slice(0, count), train.slice(where, len(train))]))
    return shard


def _verify(*folders: Path, extra: tuple[str, ...] = ()) -> tuple[int, str]:
    args = [*map(str, folders), "--workers", "1", *extra]
    done = run_cli([sys.executable, "data_prep/verify_dataset.py", *args])
    return done.returncode, done.stdout + done.stderr


def test_a_clean_set_passes_every_check(demo_data):
    code, output = _verify(demo_data / "train", demo_data / "eval")
    assert code == 0, output
    check_integrity(_shards(demo_data), demo_data / "eval", 200)


def test_byte_identical_shards_are_refused_naming_them(demo_data, tmp_path):
    root = _copy(demo_data, tmp_path)
    first, second, third = _shards(root)
    shutil.copyfile(first, second)
    shutil.copyfile(first, third)
    code, output = _verify(root / "train")
    assert code == 1
    assert f"{first}, {second} and 1 more: 3 byte-identical training shards" in output
    with pytest.raises(DataError, match=f"{first}, {second} and 1 more: 3 byte-identical"):
        check_integrity(_shards(root), None, None)


def test_row_identical_shards_are_refused_also_with_their_rows_reordered(demo_data, tmp_path):
    root = _copy(demo_data, tmp_path)
    first, second, _ = _shards(root)
    rows = read_samples(first)
    _rewrite(second, rows, compression="gzip")  # the same rows, other bytes
    with pytest.raises(DataError, match=f"{first}, {second}: 2 row-identical"):
        check_integrity(_shards(root), None, None)
    _rewrite(second, rows.take(np.arange(len(rows))[::-1]))  # the same rows, reversed: only the full check
    check_integrity(_shards(root), None, None)
    code, output = _verify(root / "train")
    assert code == 1 and f"{first}, {second}: 2 row-identical (the same samples, stored differently)" in output


def test_shards_that_agree_only_on_the_probed_rows_are_not_refused(demo_data, tmp_path):
    root = _copy(demo_data, tmp_path)
    first, second, _ = _shards(root)
    rows = read_samples(first)
    other = read_samples(_shards(root)[2])
    start = (len(rows) - PROBE_ROWS) // 2
    changed = Samples.concat([rows.slice(0, start - 3), other.slice(0, 3), rows.slice(start - 3 + 3, len(rows))])
    assert len(changed) == len(rows)
    _rewrite(second, changed)
    check_integrity(_shards(root), None, None)
    assert _verify(root / "train")[0] == 0


def test_eval_samples_in_a_training_shard_are_counted_by_verify_dataset(demo_data, tmp_path):
    root = _copy(demo_data, tmp_path)
    shard = _leak(root, 10, 50)
    code, output = _verify(root / "train", root / "eval")
    assert code == 1
    assert f"50 eval samples of {root / 'eval'} are also training samples in {shard} (50, first at row 10)" in output
    code, output = _verify(root / "train")  # without an eval folder there is nothing to compare with: said so
    assert code == 0 and f"warning: leak check skipped: no eval set given, so no folder was checked for eval " \
                         f"samples ({root / 'train'})" in output
    assert "--eval_dir EVALDIR" in output
    code, output = _verify(root / "train", extra=("--eval_dir", str(root / "eval")))
    assert code == 1 and "50 eval samples" in output


def test_the_start_up_check_finds_eval_samples_in_the_rows_it_probes(demo_data, tmp_path):
    root = _copy(demo_data, tmp_path)
    rows = len(read_samples(_shards(root)[1]))
    shard = _leak(root, (rows + 20 - PROBE_ROWS) // 2, 20)  # inside the middle block of the longer shard
    first = (rows + 20 - PROBE_ROWS) // 2
    with pytest.raises(DataError, match=rf"20 eval samples of .* in the probed rows in {shard} "
                                        rf"\(20, first at row {first}\)"):
        check_integrity(_shards(root), root / "eval", 200)
    with pytest.raises(DataError, match=r"^10 eval samples"):  # a run evaluating on the first 10 only
        check_integrity(_shards(root), root / "eval", 10)
    assert eval_hashes(root / "eval", 10).size == 10


def test_eval_samples_outside_the_probed_rows_are_left_to_the_full_check(demo_data, tmp_path):
    root = _copy(demo_data, tmp_path)
    _leak(root, 5, 3)
    check_integrity(_shards(root), root / "eval", 200)  # the documented limit of the quick check
    assert _verify(root / "train", root / "eval")[0] == 1


def _trained_after_verifying(root: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """data_prep's verification of the changed folders (it writes their records), then an open-division run."""
    verify = run_cli([sys.executable, "data_prep/verify_dataset.py", str(root / "train"), str(root / "eval"),
                      "--workers", "1"])
    assert verify.returncode == 1, verify.stdout + verify.stderr
    return run_cli([sys.executable, str(TRAINER), *trainer_args(root, tmp_path / "out", "--do_train")])


def test_the_trainer_refuses_a_leaky_training_folder_its_verification_found(demo_data, tmp_path):
    root = _copy(demo_data, tmp_path)
    rows = len(read_samples(_shards(root)[1]))
    shard = _leak(root, (rows + 20 - PROBE_ROWS) // 2, 20)
    done = _trained_after_verifying(root, tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr
    assert f"20 eval samples of {root / 'eval'}" in errors[0] and str(shard) in errors[0]
    assert not (tmp_path / "out" / "mlperf.log").exists()


def test_the_trainer_refuses_copied_shards_its_verification_found(demo_data, tmp_path):
    root = _copy(demo_data, tmp_path)
    first, second, _ = _shards(root)
    shutil.copyfile(first, second)
    done = _trained_after_verifying(root, tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"verification failed ({first}, {second}: 2 byte-identical training shards" in done.stderr


def test_prepare_verify_refuses_a_leaky_set(demo_data, tmp_path, capsys):
    root = _copy(demo_data, tmp_path)
    _leak(root, 0, 5)
    with pytest.raises(SystemExit) as stopped:
        prepare.main(["verify", str(root / "train"), str(root / "eval"), "--workers", "1"])
    assert stopped.value.code == 1 and "5 eval samples" in capsys.readouterr().err
    # `prepare.py all` ends with this verification of every folder it wrote, eval folders included.
    args = argparse.Namespace(max_seq_length=None, max_predictions=None, workers=1)
    with pytest.raises(DataError, match="verification failed"):
        prepare._verify([root / "train", root / "eval"], None, args)
    assert verify_dataset.is_eval_folder(root / "eval") and not verify_dataset.is_eval_folder(root / "train")
    # The refused training folder is marked, so neither the trainer nor a data_prep step takes it for a
    # finished dataset; the eval folder passed and is not marked.
    marker = root / "train" / REFUSED_NAME
    assert "5 eval samples" in marker.read_text() and not (root / "eval" / REFUSED_NAME).exists()
    refused = folder_problems(root / "train")
    assert len(refused) == 1 and "data_prep's verification refused this folder" in refused[0]
    with pytest.raises(DataError, match="verification refused this folder"):
        check_dataset(root / "train", DataLimits(512, 76, 1 << 15))


def test_a_set_fixed_and_verified_again_loses_its_refusal(demo_data, tmp_path):
    """prepare.py's verification drops the old verdict first: once the cause is gone, the folder is valid."""
    root = _copy(demo_data, tmp_path)
    (root / "train" / REFUSED_NAME).write_text("an earlier verification found 5 eval samples in part_0\n")
    assert folder_problems(root / "train")
    args = argparse.Namespace(max_seq_length=None, max_predictions=None, workers=1)
    prepare._verify([root / "train", root / "eval"], None, args)
    assert not (root / "train" / REFUSED_NAME).exists() and folder_problems(root / "train") == []


def test_leaked_marks_exactly_the_members():
    eval_set = np.array([3, 9, 27], np.uint64)
    assert leaked(np.array([1, 3, 27, 28, 9], np.uint64), eval_set).tolist() == [False, True, True, False, True]
    assert not leaked(np.array([5], np.uint64), np.zeros(0, np.uint64)).any()


@pytest.mark.parametrize("chunk", [1, 5, 97])
def test_a_sequence_hash_does_not_depend_on_how_the_tokens_are_chunked(demo_data, monkeypatch, chunk):
    """Runs of CHUNK_TOKENS tokens are hashed together: a run may end inside a long sequence's
    neighbour or hold only empty sequences; each sequence's hash is still its own."""
    samples = read_samples(list_shards(demo_data / "train")[0]).slice(0, 40)
    # Empty sequences (first, last and in the middle): their tokens move to a neighbour.
    for empty, neighbour in ((0, 1), (20, 21), (39, 38)):
        samples.lengths[neighbour] += samples.lengths[empty]
        samples.num_predictions[neighbour] += samples.num_predictions[empty]
        samples.lengths[empty] = samples.num_predictions[empty] = 0
    whole = sequence_hashes(samples)
    monkeypatch.setattr("mlperf_bert.data.integrity.CHUNK_TOKENS", chunk)
    assert np.array_equal(sequence_hashes(samples), whole)
    one_by_one = [sequence_hashes(samples.slice(i, i + 1))[0] for i in range(len(samples))]
    assert np.array_equal(np.array(one_by_one, np.uint64), whole)
    assert len(set(whole.tolist())) == len({_key(samples, i) for i in range(len(samples))})


def _write_tfrecord(path: Path, samples: Samples) -> None:
    """`samples` as the reference's TFRecord file (framing, both checksums, tf.train.Example), without TensorFlow."""
    arrays, example_type = to_fixed(samples, L, P), example_class()
    with open(path, "wb") as out:
        for i in range(len(samples)):
            example = example_type()
            for key in FIXED_KEYS:
                example.features.feature[key].int64_list.value.extend(np.atleast_1d(arrays[key][i]).tolist())
            data = example.SerializeToString()
            length = struct.pack("<Q", len(data))
            out.write(length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data)))


def _verify_here(capsys, *args: Path | str) -> tuple[int, str, str]:
    """verify_dataset in this process: (exit code, stdout, stderr)."""
    code = verify_dataset.main([*map(str, args), "--workers", "1"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_an_imported_eval_set_is_an_eval_set_wherever_it_stands(demo_data, tmp_path, capsys):
    """data_prep/README's import-tfrecord of eval_10k gives a folder verify_dataset takes for an eval set."""
    root = _copy(demo_data, tmp_path)
    _write_tfrecord(tmp_path / "eval_10k", read_samples(list_shards(root / "eval")[0]))
    imported = root / "eval_10k"
    assert prepare.main(["--quiet", "import-tfrecord", "--input", str(tmp_path / "eval_10k"), "--out", str(imported),
                         "--max_seq_length", str(L), "--max_predictions", str(P), "--workers", "1"]) == 0
    shard = _leak(root, 10, 50)
    for folders in ((root / "train", imported), (imported, root / "train")):
        code, out, err = _verify_here(capsys, *folders)
        assert code == 1, out + err
        assert f"eval sets: {imported} (imported eval files)" in out
        assert f"leak check: {root / 'train'} against these eval sets" in out
        assert f"50 eval samples of {imported} are also training samples in {shard}" in err
        assert f"OK: {imported}" in out and f"FAILED: {root / 'train'}" in out


def test_a_folder_neither_eval_nor_training_is_named_and_checked_as_training(demo_data, tmp_path, capsys):
    root = _copy(demo_data, tmp_path)
    _leak(root, 0, 5)
    odd = root / "held_out"  # the eval samples under a name that says nothing
    odd.mkdir()
    shutil.copyfile(list_shards(root / "eval")[0], odd / "samples.hdf5")
    code, _, err = _verify_here(capsys, root / "train", odd)
    assert code == 0  # nothing to compare with, but not silently:
    assert f"warning: leak check skipped: no eval set given, so no folder was checked for eval samples " \
           f"({root / 'train'}, {odd})" in err
    assert f"warning: {odd}: neither an eval set" in err and f"pass it as --eval_dir {odd}" in err
    code, out, err = _verify_here(capsys, root / "train", "--eval_dir", odd)
    assert code == 1 and f"eval sets: {odd} (--eval_dir)" in out and f"5 eval samples of {odd}" in err


def test_import_keeps_eval_files_out_of_a_training_folder(demo_data, tmp_path):
    samples = read_samples(list_shards(demo_data / "eval")[0])
    _write_tfrecord(tmp_path / "part-00000-of-00001", samples)
    _write_tfrecord(tmp_path / "eval_10k", samples)
    args = ["--max_seq_length", str(L), "--max_predictions", str(P), "--workers", "1"]
    assert prepare.main(["--quiet", "import-tfrecord", "--input", str(tmp_path / "part-00000-of-00001"),
                         "--out", str(tmp_path / "parts"), *args]) == 0
    with pytest.raises(DataError, match=r"mixes eval files \(eval_10k.hdf5\) with training files"):
        prepare.cmd_import_tfrecord(prepare.build_parser().parse_args(
            ["import-tfrecord", "--input", str(tmp_path / "eval_10k"), "--out", str(tmp_path / "parts"), *args]))


# The sample fields a hash covers: changing any one entry of any of them makes another sample.
FIELDS = ("input_ids", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels")


@pytest.mark.parametrize("field", FIELDS)
def test_every_field_of_a_sample_is_in_its_hash(demo_data, field):
    """One entry of one field changed, in the first, a middle and the last sequence: that sequence's
    hash changes and no other."""
    samples = read_samples(list_shards(demo_data / "train")[0]).slice(0, 30)
    before = sequence_hashes(samples)
    for seq in (0, 14, 29):
        changed = samples.take(np.arange(len(samples)))
        values = getattr(changed, field)
        if field == "next_sentence_labels":
            at = seq
        else:
            lengths = changed.lengths if field in ("input_ids", "segment_ids") else changed.num_predictions
            at = int(lengths[:seq].sum()) + int(lengths[seq]) // 2
        values[at] = 1 - values[at] if field in ("segment_ids", "next_sentence_labels") else values[at] + 1
        after = sequence_hashes(changed)
        assert after[seq] != before[seq], (field, seq)
        assert np.array_equal(np.delete(after, seq), np.delete(before, seq)), (field, seq)


def test_the_probe_is_the_first_row_the_middle_block_and_the_last_row():
    assert probed_rows(1000, 64).tolist() == [0, *range(468, 532), 999]
    assert probed_rows(4321, 64).tolist() == [0, *range(2128, 2192), 4320]
    assert probed_rows(65, 64).tolist() == list(range(65))
    assert probed_rows(10, 64).tolist() == list(range(10))
    assert probed_rows(1, 64).tolist() == [0]


def test_empty_shards_are_not_copies_of_each_other(tmp_path):
    empty = Samples.concat([])
    for name in ("part_0.hdf5", "part_1.hdf5"):
        write_samples(tmp_path / name, empty, "fixed", L, P)
    check_integrity(list_shards(tmp_path), None, None)


def test_a_leak_past_the_first_block_is_named_by_its_shard_row(demo_data):
    """Shards at real sizes are read in blocks (verify_dataset's BLOCK_ROWS): the first leaked row is
    the shard's row, not the block's."""
    train = read_samples(list_shards(demo_data / "train")[0]).slice(0, 40)
    evals = read_samples(list_shards(demo_data / "eval")[0])
    eval_set = eval_hashes(demo_data / "eval")
    digest = ShardDigest()
    for block, rows in ((train.slice(0, 20), np.arange(0, 20)),
                        (Samples.concat([train.slice(20, 27), evals.slice(5, 8), train.slice(27, 30)]),
                         np.arange(20, 33))):
        digest.add(block, rows, eval_set)
    assert (digest.sequences, digest.leaked, digest.first_leaked_row) == (33, 3, 27)
