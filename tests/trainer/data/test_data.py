"""hdf5 shard reading, validation, the rank-split training stream and the eval set.

Shards are written here with plain per-row h5py code, independent of the vectorised reader.
Every sample carries a unique id in input_ids[1] (= ID_BASE + id), so tests can count uses.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from mlperf_bert.data.batch import Item, Sample
from mlperf_bert.data.dataset import (
    DataError, DataLimits, PretrainingDataset, discover_shards, load_eval_set, read_shard,
)
from mlperf_bert.data.validate import check_dataset, check_shard

VOCAB = 5000
ID_BASE = 10
LIMITS = DataLimits(max_seq_length=32, max_predictions_per_seq=5, vocab_size=VOCAB)
L, P, K = 32, 5, 3  # row width, prediction slots, sequences per packed row


def make_sample(uid: int, rng: np.random.Generator, max_len: int = L, min_predictions: int = 0) -> Sample:
    n = int(rng.integers(4, max_len + 1))
    ids = rng.integers(ID_BASE, VOCAB, size=n)
    ids[0], ids[1] = 1, ID_BASE + uid
    seg = (np.arange(n) >= n // 2).astype(np.int64)
    k = int(rng.integers(min_predictions, min(P, n - 2) + 1))
    pos = np.sort(rng.choice(np.arange(2, n), size=k, replace=False))
    return Sample(ids, seg, pos, rng.integers(0, VOCAB, size=k), int(rng.integers(0, 2)))


def make_samples(first_uid: int, count: int, seed: int = 0, max_len: int = L, min_predictions: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed + first_uid)
    return [make_sample(first_uid + i, rng, max_len, min_predictions) for i in range(count)]


def uid(item: Item) -> int:
    return int(item[0].input_ids[1]) - ID_BASE


def fixed_arrays(samples: list[Sample]) -> dict[str, np.ndarray]:
    n = len(samples)
    out = {k: np.zeros((n, L), np.int16) for k in ("input_ids", "input_mask", "segment_ids")}
    out |= {k: np.zeros((n, P), np.int16) for k in ("masked_lm_positions", "masked_lm_ids")}
    out["next_sentence_labels"] = np.zeros(n, np.int8)
    for r, s in enumerate(samples):
        out["input_ids"][r, :s.length] = s.input_ids
        out["input_mask"][r, :s.length] = 1
        out["segment_ids"][r, :s.length] = s.segment_ids
        k = len(s.masked_lm_positions)
        out["masked_lm_positions"][r, :k] = s.masked_lm_positions
        out["masked_lm_ids"][r, :k] = s.masked_lm_ids
        out["next_sentence_labels"][r] = s.next_sentence_label
    return out


def varlength_arrays(samples: list[Sample]) -> dict[str, np.ndarray]:
    def rows(name: str) -> np.ndarray:
        out = np.empty(len(samples), dtype=object)
        for r, s in enumerate(samples):
            out[r] = getattr(s, name).astype(np.int16)
        return out

    keys = ("input_ids", "segment_ids", "masked_lm_positions", "masked_lm_ids")
    arrays = {k: rows(k) for k in keys}
    arrays["next_sentence_labels"] = np.array([s.next_sentence_label for s in samples], np.int8)
    return arrays


def packed_arrays(items: list[Item]) -> dict[str, np.ndarray]:
    n = len(items)
    out = {k: np.zeros((n, L), np.int16) for k in ("input_ids", "segment_ids")}
    out |= {k: np.zeros((n, K * P), np.int16) for k in ("masked_lm_positions", "masked_lm_ids")}
    out["next_sentence_labels"] = np.full((n, K), -1, np.int8)
    out |= {k: np.zeros((n, K), np.int16) for k in ("packed_input_len", "packed_masked_lm_len")}
    for r, item in enumerate(items):
        start = pred = 0
        for j, s in enumerate(item):
            k = len(s.masked_lm_positions)
            out["input_ids"][r, start:start + s.length] = s.input_ids
            out["segment_ids"][r, start:start + s.length] = s.segment_ids
            out["masked_lm_positions"][r, pred:pred + k] = s.masked_lm_positions + start
            out["masked_lm_ids"][r, pred:pred + k] = s.masked_lm_ids
            out["next_sentence_labels"][r, j] = s.next_sentence_label
            out["packed_input_len"][r, j], out["packed_masked_lm_len"][r, j] = s.length, k
            start, pred = start + s.length, pred + k
    return out


def pack(samples: list[Sample]) -> list[Item]:
    """Greedy first-fit into rows of L tokens, at most K sequences each."""
    rows: list[list[Sample]] = []
    for s in samples:
        row = next((r for r in rows if len(r) < K and sum(x.length for x in r) + s.length <= L), None)
        if row is None:
            rows.append(row := [])
        row.append(s)
    return [tuple(r) for r in rows]


def write(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    with h5py.File(path, "w") as f:
        for key, value in arrays.items():
            if value.dtype == object:
                f.create_dataset(key, data=value, dtype=h5py.vlen_dtype(np.int16))
            else:
                f.create_dataset(key, data=value)
    return path


def assert_same_items(got: list[Item], want: list[Item]) -> None:
    assert len(got) == len(want)
    for g_item, w_item in zip(got, want):
        assert len(g_item) == len(w_item)
        for g, w in zip(g_item, w_item):
            for name in ("input_ids", "segment_ids", "masked_lm_positions", "masked_lm_ids"):
                np.testing.assert_array_equal(getattr(g, name), getattr(w, name), err_msg=name)
            assert g.next_sentence_label == w.next_sentence_label


# ---------------------------------------------------------------- round trips

@pytest.mark.parametrize("fmt", ["fixed", "varlength"])
def test_single_sequence_formats_round_trip(tmp_path: Path, fmt: str) -> None:
    samples = make_samples(0, 40)
    arrays = fixed_arrays(samples) if fmt == "fixed" else varlength_arrays(samples)
    items = read_shard(write(tmp_path / "s.hdf5", arrays), LIMITS)
    assert_same_items(items, [(s,) for s in samples])


def test_packed_round_trip_keeps_rows_together(tmp_path: Path) -> None:
    packed = pack(make_samples(0, 60, max_len=20))
    assert max(len(i) for i in packed) == K and min(len(i) for i in packed) >= 1
    items = read_shard(write(tmp_path / "p.hdf5", packed_arrays(packed)), LIMITS)
    assert_same_items(items, packed)


def test_fixed_padding_slots_anywhere_are_dropped(tmp_path: Path) -> None:
    samples = make_samples(0, 3)
    arrays = fixed_arrays(samples)
    arrays["masked_lm_positions"][0] = [0, 3, 0, 2, 0]
    arrays["masked_lm_ids"][0] = [9, 7, 9, 8, 9]
    items = read_shard(write(tmp_path / "s.hdf5", arrays), LIMITS)
    np.testing.assert_array_equal(items[0][0].masked_lm_positions, [3, 2])
    np.testing.assert_array_equal(items[0][0].masked_lm_ids, [7, 8])


# ---------------------------------------------------------------- bad input

def _set(key: str, index: tuple, value: int):
    """Sets one entry; for a variable-length key `index` is (row, entry)."""
    def edit(arrays: dict[str, np.ndarray]) -> None:
        target = arrays[key]
        if target.dtype == object:
            target[index[0]][index[1]] = value
        else:
            target[index] = value
    return edit


def _drop(key: str):
    return lambda arrays: arrays.pop(key)


def _truncate_rows(key: str):
    def edit(arrays: dict[str, np.ndarray]) -> None:
        arrays[key] = arrays[key][:-1]
    return edit


def _extra_predictions(arrays: dict[str, np.ndarray]) -> None:
    for key in ("masked_lm_positions", "masked_lm_ids"):
        arrays[key][6] = np.concatenate([arrays[key][6], np.full(P, 2, np.int16)])


def _mask_hole(arrays: dict[str, np.ndarray]) -> None:
    arrays["input_mask"][4, 1] = 0


def _long_row(arrays: dict[str, np.ndarray]) -> None:
    for key in ("input_ids", "segment_ids"):
        arrays[key][2] = np.concatenate([arrays[key][2], np.full(L, 0, np.int16)])


def _packed_overflow(arrays: dict[str, np.ndarray]) -> None:
    arrays["packed_input_len"][1, 0] += L


def _packed_wrong_group(arrays: dict[str, np.ndarray]) -> None:
    """Counts the first prediction of a row's second sequence as its first sequence's."""
    row = int(np.flatnonzero((arrays["packed_input_len"] > 0).sum(axis=1) >= 2)[0])
    lens = arrays["packed_masked_lm_len"][row]
    lens[0] += 1
    lens[1] -= 1


BAD_CASES = {
    "missing key": ("fixed", _drop("masked_lm_ids"), "key 'masked_lm_ids' missing"),
    "row count mismatch": ("fixed", _truncate_rows("next_sentence_labels"), "different row counts"),
    "token id too large": ("fixed", _set("input_ids", (3, 2), VOCAB), "input_ids outside [0, vocab_size=5000)"),
    "token id negative": ("fixed", _set("input_ids", (3, 2), -1), "input_ids outside"),
    "label id too large": ("varlength", _set("masked_lm_ids", (5, 0), VOCAB), "masked_lm_ids outside"),
    "sequence too long": ("varlength", _long_row, "longer than max_seq_length=32"),
    "too many predictions": ("varlength", _extra_predictions, "more masked positions"),
    "position beyond sequence": ("fixed", _set("masked_lm_positions", (7, 0), L - 1), "outside its sequence"),
    "position 0 in varlength": ("varlength", _set("masked_lm_positions", (8, 0), 0), "is 0 (the [CLS] token)"),
    "mask not a prefix": ("fixed", _mask_hole, "input_mask is not a prefix of ones"),
    "mask value 2": ("fixed", _set("input_mask", (2, 0), 2), "input_mask is not a prefix of ones"),
    "nsp label 2": ("fixed", _set("next_sentence_labels", (9,), 2), "next_sentence_labels is not 0 or 1"),
    "segment id 2": ("fixed", _set("segment_ids", (1, 0), 2), "segment_ids is not 0 or 1"),
    "packed lengths beyond row": ("packed", _packed_overflow, "packed_input_len sums beyond the row width"),
    "packed predictions regrouped": ("packed", _packed_wrong_group, "outside its sequence"),
    "packed nsp label": ("packed", _set("next_sentence_labels", (0, 0), 3), "next_sentence_labels is not 0 or 1"),
}


def _bad_arrays(fmt: str, edit) -> dict[str, np.ndarray]:
    samples = make_samples(0, 12, seed=3, max_len=14, min_predictions=1)
    writers = {"fixed": fixed_arrays, "varlength": varlength_arrays, "packed": lambda s: packed_arrays(pack(s))}
    arrays = writers[fmt](samples)
    edit(arrays)
    return arrays


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_raises_data_error_naming_file(tmp_path: Path, case: str) -> None:
    fmt, edit, expected = BAD_CASES[case]
    path = write(tmp_path / "part_00003_of_04320.hdf5", _bad_arrays(fmt, edit))
    with pytest.raises(DataError) as err:
        read_shard(path, LIMITS)
    message = str(err.value)
    assert str(path) in message and expected in message, message
    assert "; " in message  # the problem is followed by a fix


@pytest.mark.parametrize("key, row, column, value", [
    ("next_sentence_labels", 9, None, 5), ("input_ids", 7, 3, VOCAB + 3), ("masked_lm_positions", 10, 0, L),
])
def test_error_names_the_offending_row(tmp_path: Path, key: str, row: int, column: int | None, value: int) -> None:
    arrays = fixed_arrays(make_samples(0, 12, min_predictions=1))
    arrays[key][(row,) if column is None else (row, column)] = value
    with pytest.raises(DataError, match=f"row {row}:"):
        read_shard(write(tmp_path / "s.hdf5", arrays), LIMITS)


def test_packed_error_names_the_row(tmp_path: Path) -> None:
    packed = pack(make_samples(0, 40, max_len=12, min_predictions=1))
    arrays = packed_arrays(packed)
    row = len(packed) - 2
    arrays["input_ids"][row, int(arrays["packed_input_len"][row].sum()) - 1] = VOCAB
    with pytest.raises(DataError, match=f"row {row}: input_ids outside"):
        read_shard(write(tmp_path / "p.hdf5", arrays), LIMITS)


def test_limits_from_config_are_enforced(tmp_path: Path) -> None:
    path = write(tmp_path / "s.hdf5", fixed_arrays(make_samples(0, 20)))
    longest = max(item[0].length for item in read_shard(path, LIMITS))
    with pytest.raises(DataError, match="max_seq_length"):
        read_shard(path, DataLimits(longest - 1, P, VOCAB))
    with pytest.raises(DataError, match="vocab_size"):
        read_shard(path, DataLimits(L, P, ID_BASE + 5))


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_file_raises_data_error(tmp_path: Path, damage: str) -> None:
    path = write(tmp_path / "part_00001.hdf5", fixed_arrays(make_samples(0, 200)))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not hdf5" * 100)
    with pytest.raises(DataError, match="part_00001.hdf5"):
        read_shard(path, LIMITS)


def test_discover_shards(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        discover_shards(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="no \\*.hdf5"):
        discover_shards(tmp_path)
    for name in ("b.hdf5", "a.h5", "c.hdf5"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in discover_shards(tmp_path)] == ["a.h5", "b.hdf5", "c.hdf5"]


# ---------------------------------------------------------------- the start-up check of a folder

def numbered(directory: Path, sizes: list[int]) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    return [write(directory / f"part_{i:05d}_of_{len(sizes):05d}.hdf5", fixed_arrays(make_samples(100 * i, n)))
            for i, n in enumerate(sizes)]


def test_check_shard_reads_in_blocks_and_names_the_row_of_the_file(tmp_path: Path) -> None:
    arrays = fixed_arrays(make_samples(0, 50, min_predictions=1))
    arrays["input_ids"][37, 1] = VOCAB
    path = write(tmp_path / "s.hdf5", arrays)
    with pytest.raises(DataError, match="row 37: input_ids outside"):
        check_shard(path, LIMITS, block_rows=8)  # row 37 is row 5 of the fifth block
    arrays["input_ids"][37, 1] = ID_BASE
    assert check_shard(write(tmp_path / "s.hdf5", arrays), LIMITS, block_rows=8) == 50


def test_check_dataset_splits_the_rows_between_ranks(tmp_path: Path) -> None:
    shards = numbered(tmp_path, [20, 20, 20])
    with h5py.File(shards[1], "r+") as f:
        f["next_sentence_labels"][3] = 4
    check_dataset(tmp_path, LIMITS, rank=0, world_size=2)  # rank 0 reads shards 0 and 2
    with pytest.raises(DataError, match=f"{shards[1]}: row 3: next_sentence_labels"):
        check_dataset(tmp_path, LIMITS, rank=1, world_size=2)


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "part_00001_of_00003.hdf5").unlink(), "part_00001_of_00003.hdf5: missing, the folder has 2 of 3"),
    (lambda d: (d / ".part_00002_of_00003.hdf5.tmp-77").write_bytes(b"x"), "a temporary file of an interrupted step"),
    (lambda d: (d / "part_00002_of_00003.hdf5").write_bytes(b"x" * 10), "cannot be opened as hdf5"),
    (lambda d: write(d / "part_00002_of_00003.hdf5", fixed_arrays(make_samples(0, 5, max_len=L)) | {
        k: np.zeros((5, 2 * L), np.int16) for k in ("input_ids", "input_mask", "segment_ids")}),
     "part_00002_of_00003.hdf5: a fixed shard of width 64, but part_00000_of_00003.hdf5 is fixed of width 32"),
])
def test_check_dataset_refuses_incomplete_or_mixed_folders(tmp_path: Path, damage, message: str) -> None:
    numbered(tmp_path, [20, 20, 20])
    damage(tmp_path)
    with pytest.raises(DataError, match=re.escape(message)):
        check_dataset(tmp_path, LIMITS)


def test_check_dataset_compares_the_manifest(tmp_path: Path) -> None:
    shards = numbered(tmp_path, [20, 20])
    files = {p.name: {"bytes": p.stat().st_size, "samples": 20} for p in shards}
    (tmp_path / "MANIFEST.json").write_text(json.dumps({"kind": "reshard", "params": {}, "files": files}))
    check_dataset(tmp_path, LIMITS)
    files[shards[0].name]["bytes"] += 1
    (tmp_path / "MANIFEST.json").write_text(json.dumps({"kind": "reshard", "params": {}, "files": files}))
    with pytest.raises(DataError, match="bytes, MANIFEST.json says .* \\(truncated or replaced\\)"):
        check_dataset(tmp_path, LIMITS)
    (tmp_path / "MANIFEST.json").write_text(json.dumps({"kind": "reshard", "params": {}, "files": {}}))
    with pytest.raises(DataError, match="not listed in MANIFEST.json"):
        check_dataset(tmp_path, LIMITS)


def test_eval_folder_missing_a_listed_file_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "part_eval_40.hdf5", fixed_arrays(make_samples(0, 40)))
    files = {path.name: {"bytes": path.stat().st_size}, "part_eval_extra.hdf5": {"bytes": 1}}
    (tmp_path / "MANIFEST.json").write_text(json.dumps({"kind": "eval", "params": {}, "files": files}))
    with pytest.raises(DataError, match="part_eval_extra.hdf5: listed in MANIFEST.json but missing"):
        load_eval_set(tmp_path, 40, 0, 1, LIMITS)


# ---------------------------------------------------------------- the training stream

def write_shards(directory: Path, sizes: list[int], fmt: str = "fixed") -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    first = 0
    for i, size in enumerate(sizes):
        samples = make_samples(first, size, max_len=16)
        arrays = fixed_arrays(samples) if fmt == "fixed" else varlength_arrays(samples)
        write(directory / f"part_{i:05d}_of_{len(sizes):05d}.hdf5", arrays)
        first += size
    return discover_shards(directory)


def run_epochs(shards: list[Path], world: int, b: int, epochs: int, seed: int = 7) -> list[list[list[int]]]:
    """uids per [epoch][rank], in the order each rank yields them."""
    out = [[[] for _ in range(world)] for _ in range(epochs)]
    for rank in range(world):
        with PretrainingDataset(shards, LIMITS, rank=rank, world_size=world, items_per_rank_step=b, seed=seed) as ds:
            for epoch in range(epochs):
                for _ in range(ds.steps_in_epoch(epoch)):
                    assert ds.position.epoch == epoch
                    batch = ds.next_batch()
                    assert len(batch) == b
                    out[epoch][rank].extend(uid(i) for i in batch)
    return out


UNEVEN = [7, 3, 12, 1, 9, 5]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("sizes", [UNEVEN, [13, 4]], ids=["6 shards", "2 shards"])
def test_every_item_used_exactly_once_per_pass(tmp_path: Path, world: int, sizes: list[int]) -> None:
    shards, b, epochs = write_shards(tmp_path, sizes), 2, 4
    total, global_step = sum(sizes), world * 2
    used = run_epochs(shards, world, b, epochs)
    stream = []
    for epoch, per_rank in enumerate(used):
        assert len({len(r) for r in per_rank}) == 1  # every rank ran the same number of steps
        stream.extend(u for rank in per_rank for u in rank)
        assert len(stream) == ((epoch + 1) * total) // global_step * global_step
    # The first `total` items used are one full pass, the next `total` the second, ...
    for p in range(len(stream) // total):
        assert sorted(stream[p * total:(p + 1) * total]) == list(range(total))
    tail = stream[(len(stream) // total) * total:]
    assert len(set(tail)) == len(tail)
    assert len(used[0][0]) * world <= total < (len(used[0][0]) + b) * world


def test_each_rank_reads_only_its_own_shards(tmp_path: Path) -> None:
    sizes = [10] * 12
    shards, world = write_shards(tmp_path, sizes), 3
    for rank in range(world):
        ds = PretrainingDataset(shards, LIMITS, rank=rank, world_size=world, items_per_rank_step=4, seed=1)
        read = {p.shard for p in ds.layout.rank_block(0, rank)}
        assert len(read) <= len(sizes) // world + 1
        ds.close()


def test_shuffled_differently_each_epoch_and_reproducible(tmp_path: Path) -> None:
    shards = write_shards(tmp_path, UNEVEN)
    first = run_epochs(shards, 2, 3, 3, seed=11)
    again = run_epochs(shards, 2, 3, 3, seed=11)
    other = run_epochs(shards, 2, 3, 3, seed=12)
    assert first == again
    assert first != other
    assert first[1] != first[2] and first[0] != first[1]


def test_rows_inside_a_shard_are_shuffled_every_epoch(tmp_path: Path) -> None:
    used = run_epochs(write_shards(tmp_path, [40]), 1, 4, 3)
    orders = [epoch[0] for epoch in used]
    assert sorted(orders[0]) == list(range(40))
    assert orders[0] != sorted(orders[0])
    assert orders[0] != orders[1] != orders[2]


def test_same_batches_without_read_ahead(tmp_path: Path) -> None:
    shards = write_shards(tmp_path, UNEVEN, fmt="varlength")
    kwargs = dict(rank=1, world_size=2, items_per_rank_step=3, seed=4)
    with PretrainingDataset(shards, LIMITS, **kwargs) as ahead:
        with PretrainingDataset(shards, LIMITS, read_ahead=False, **kwargs) as plain:
            for _ in range(20):
                assert [uid(i) for i in ahead.next_batch()] == [uid(i) for i in plain.next_batch()]


def test_next_shard_is_read_ahead_on_a_background_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlperf_bert.data.dataset as data

    reads: list[tuple[str, str]] = []

    def recording_read(path: Path, limits: DataLimits) -> list[Item]:
        reads.append((path.name, threading.current_thread().name))
        return read_shard(path, limits)

    monkeypatch.setattr(data, "read_shard", recording_read)
    shards = write_shards(tmp_path, [10, 10, 10])
    with PretrainingDataset(shards, LIMITS, rank=0, world_size=1, items_per_rank_step=5, seed=2) as ds:
        first = ds.next_batch()
        deadline = time.monotonic() + 10
        while len(reads) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        # one step into the first shard, the second one is already being read
        assert len(reads) == 2 and reads[0][0] != reads[1][0]
        assert all(thread.startswith("shard-reader") for _, thread in reads)
        assert {uid(i) // 10 for i in first} == {int(reads[0][0][5:10])}


@pytest.mark.parametrize("resume_after", [1, 5, 13])
def test_state_round_trip_resumes_at_the_same_item(tmp_path: Path, resume_after: int) -> None:
    shards = write_shards(tmp_path, UNEVEN)
    kwargs = dict(rank=0, world_size=2, items_per_rank_step=3, seed=5)
    with PretrainingDataset(shards, LIMITS, **kwargs) as ds:
        assert ds.steps_in_epoch(0) < 13  # the last case resumes in a later epoch
        for _ in range(resume_after):
            ds.next_batch()
        state = ds.state_dict()
        expected = [[uid(i) for i in ds.next_batch()] for _ in range(6)]
    with PretrainingDataset(shards, LIMITS, **kwargs) as resumed:
        resumed.load_state_dict(dict(state))
        assert [[uid(i) for i in resumed.next_batch()] for _ in range(6)] == expected


def test_resume_with_other_world_size_is_refused(tmp_path: Path) -> None:
    shards = write_shards(tmp_path, UNEVEN)
    with PretrainingDataset(shards, LIMITS, rank=0, world_size=2, items_per_rank_step=3, seed=5) as ds:
        state = ds.state_dict()
    with PretrainingDataset(shards, LIMITS, rank=0, world_size=3, items_per_rank_step=3, seed=5) as other:
        with pytest.raises(DataError, match="world_size=2"):
            other.load_state_dict(state)


def test_too_little_data_for_one_step(tmp_path: Path) -> None:
    shards = write_shards(tmp_path, [3, 2])
    with pytest.raises(DataError, match="fewer than one global step"):
        PretrainingDataset(shards, LIMITS, rank=0, world_size=2, items_per_rank_step=3, seed=0)


def test_bad_shard_is_reported_when_read(tmp_path: Path) -> None:
    shards = write_shards(tmp_path, [4, 4])
    arrays = fixed_arrays(make_samples(100, 4))
    arrays["input_ids"][0, 0] = VOCAB + 1
    write(shards[1], arrays)
    with PretrainingDataset(shards, LIMITS, rank=0, world_size=1, items_per_rank_step=4, seed=0) as ds:
        with pytest.raises(DataError, match=shards[1].name):
            for _ in range(2):
                ds.next_batch()


# ---------------------------------------------------------------- eval set

def test_eval_set_takes_first_examples_split_across_ranks(tmp_path: Path) -> None:
    shards = write_shards(tmp_path / "eval", [6, 6, 6])
    per_rank = [load_eval_set(tmp_path / "eval", 14, r, 3, LIMITS) for r in range(3)]
    assert [len(x) for x in per_rank] == [5, 5, 4]
    assert sorted(uid(i) for part in per_rank for i in part) == list(range(14))
    assert [uid(i) for i in per_rank[1]] == list(range(1, 14, 3))
    single = load_eval_set(shards[0], 6, 0, 1, LIMITS)
    assert [uid(i) for i in single] == list(range(6))
    with pytest.raises(DataError, match="18 eval samples, fewer than the 19"):
        load_eval_set(tmp_path / "eval", 19, 0, 1, LIMITS)


def test_eval_set_unpacks_packed_rows(tmp_path: Path) -> None:
    samples = make_samples(0, 30, max_len=12)
    path = write(tmp_path / "eval.hdf5", packed_arrays(pack(samples)))
    items = load_eval_set(path, 25, 0, 1, LIMITS)
    assert all(len(i) == 1 for i in items)
    assert [uid(i) for i in items] == [uid((s,)) for item in pack(samples) for s in item][:25]
