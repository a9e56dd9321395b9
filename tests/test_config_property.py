"""Hostile configs and shards: each is accepted or rejected with ConfigError / DataError, never
another exception and never a hang. Plus the rules for where a run may write."""

from __future__ import annotations

import argparse
import contextlib
import io
import signal
import tempfile
from pathlib import Path
from typing import Iterator

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlperf_bert.cli import build_parser, config_from_args, parse_config
from mlperf_bert.config import ConfigError, TrainConfig
from mlperf_bert.data import DataError, DataLimits, read_shard

LIMITS = DataLimits(max_seq_length=8, max_predictions_per_seq=2, vocab_size=30)
HANG_S = 30  # one example taking this long counts as a hang


@contextlib.contextmanager
def no_hang(seconds: int = HANG_S) -> Iterator[None]:
    """Fails the example (TimeoutError) if it runs longer than `seconds`."""
    def expire(signum, frame):
        raise TimeoutError(f"an example ran for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _valid_args(root: Path) -> list[str]:
    return ["--input_dir", str(root / "train"), "--eval_dir", str(root / "eval"), "--bert_config_path",
            str(root / "bert_config.json"), "--output_dir", str(root / "out"), "--max_steps", "10", "--do_train"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("config_root")


HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["", "\0", "..", "../../..", "/", "/etc/passwd", "auto", "nan", "-1", "1e309", "a" * 300,
                     "__import__('os').system('true')", "packed", "fp16", "cpu", "cuda", "lamb", "adam"]),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@settings(max_examples=300, deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(sorted(vars(build_parser().parse_args(
    ["--eval_dir", "e", "--bert_config_path", "b", "--output_dir", "o", "--max_steps", "1"])))), HOSTILE, max_size=3),
    world_size=st.one_of(st.integers(min_value=-2, max_value=9), HOSTILE))
def test_hostile_config_values_are_accepted_or_rejected_with_a_config_error(root, changes, world_size):
    args = build_parser().parse_args(_valid_args(root))
    for key, value in changes.items():
        setattr(args, key, value)
    with no_hang():
        try:
            cfg = config_from_args(argparse.Namespace(**vars(args)), world_size)
        except ConfigError as err:
            assert "--" in str(err) or str(err).startswith(("extra", "the world size (WORLD_SIZE")), str(err)
            return
    assert isinstance(cfg, TrainConfig)
    assert not (root / "out").exists()  # building a config writes nothing


FLAG_TEXT = st.one_of(st.text(max_size=10), st.sampled_from(["0", "-1", "1e400", "nan", "inf", "-inf", "3.5", "auto",
                                                             "..", "", "99999999999999999999999"]))


@settings(max_examples=200, deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flags=st.lists(st.tuples(st.sampled_from(sorted(
    o for a in build_parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help")),
    FLAG_TEXT), max_size=3))
def test_hostile_command_lines_are_rejected_by_argparse_or_the_config(root, flags):
    argv = _valid_args(root) + [part for flag, value in flags for part in (flag, value)]
    with no_hang(), contextlib.redirect_stderr(io.StringIO()) as usage:
        try:
            parse_config(argv, 2)
        except SystemExit as exit_:
            assert exit_.code == 2 and "error:" in usage.getvalue()  # argparse names the flag
        except ConfigError:
            pass


def test_an_output_path_cannot_escape_output_dir(root, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    base = _valid_args(root)
    base[base.index("--output_dir") + 1] = str(out)
    with pytest.raises(ConfigError, match="outside --output_dir"):
        parse_config(base + ["--checkpoint_dir", str(out / ".." / "elsewhere")], 1)
    (out / "checkpoints").symlink_to(tmp_path)
    with pytest.raises(ConfigError, match="--checkpoint_dir .* outside --output_dir"):
        parse_config(base, 1)  # the default folder is a symlink that leads out
    (out / "mlperf.log").symlink_to(tmp_path / "elsewhere.log")
    with pytest.raises(ConfigError, match="symlink that leads outside --output_dir"):
        parse_config(base + ["--checkpoint_dir", str(out / "ckpt")], 1)
    (out / "mlperf.log").unlink()
    log = tmp_path / "run.log"  # outside: an explicit --mlperf_log_file is the launcher's choice
    cfg = parse_config(base + ["--checkpoint_dir", str(out / "ckpt"), "--mlperf_log_file", str(log)], 1)
    assert cfg.checkpoint_dir == out / "ckpt" and cfg.run.mlperf_log_path == log


@pytest.mark.parametrize("extra, message", [
    (["--resume_from_checkpoint", "/no/such/ckpt.pt"], "--resume_from_checkpoint /no/such/ckpt.pt: no such file"),
    (["--keep_checkpoints", "0"], "--keep_checkpoints must be an integer >= 1"),
    (["--checkpoint_every_minutes", "nan"], "--checkpoint_every_minutes must be a number in"),
    (["--collective_timeout_s", "0"], "--collective_timeout_s must be a number in [1.0"),
    (["--seed", "-1"], "--seed must be an integer in [0, 4294967295]"),
    (["--warmup_steps", "11"], "--warmup_steps must be an integer in [0, 10]"),
    (["--end_learning_rate", "1"], "--end_learning_rate 1.0 is above --learning_rate"),
    (["--max_predictions_per_seq", "600"], "--max_predictions_per_seq must be an integer in [1, 512]"),
])
def test_bad_values_are_rejected_naming_the_flag_and_the_fix(root, extra, message):
    with pytest.raises(ConfigError) as err:
        parse_config(_valid_args(root) + extra, 1)
    assert message in str(err.value)


def test_checkpoints_need_training(root):
    argv = [a for a in _valid_args(root) if a != "--do_train"]
    with pytest.raises(ConfigError, match="add --do_train or drop them"):
        parse_config(argv + ["--checkpoint_every_samples", "100"], 1)


# --- shards ---------------------------------------------------------------------------------------

VLEN = h5py.vlen_dtype(np.dtype("int16"))


def _vlen(rows: list[list[int]]) -> np.ndarray:
    out = np.empty(len(rows), dtype=object)
    out[:] = [np.asarray(r, dtype=np.int64).astype(np.int16) for r in rows]
    return out


def _valid_shard(fmt: str) -> dict[str, np.ndarray]:
    """Three rows the reader accepts (vocab 30, at most 8 tokens and 2 predictions per sequence)."""
    ids = [[2, 5, 6, 3, 7, 3], [2, 9, 3, 8, 3], [2, 4, 4, 3, 5, 6, 3]]
    seg = [[0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1, 1]]
    pos, lab = [[1, 4], [2, 0], [1, 5]], [[5, 7], [3, 0], [4, 5]]
    if fmt == "varlength":
        return {"input_ids": _vlen(ids), "segment_ids": _vlen(seg),
                "masked_lm_positions": _vlen([[p for p in r if p] for r in pos]),
                "masked_lm_ids": _vlen([[lab[i][j] for j, p in enumerate(r) if p] for i, r in enumerate(pos)]),
                "next_sentence_labels": np.array([0, 1, 0], dtype=np.int8)}
    pad = lambda rows, width: np.array([r + [0] * (width - len(r)) for r in rows], dtype=np.int16)  # noqa: E731
    arrays = {"input_ids": pad(ids, 8), "input_mask": pad([[1] * len(r) for r in ids], 8).astype(np.int8),
              "segment_ids": pad(seg, 8).astype(np.int8), "masked_lm_positions": pad(pos, 2),
              "masked_lm_ids": pad(lab, 2), "next_sentence_labels": np.array([0, 1, 0], dtype=np.int8)}
    if fmt == "packed":
        del arrays["input_mask"]
        arrays["next_sentence_labels"] = np.array([[0, -1], [1, -1], [0, -1]], dtype=np.int8)
        arrays["packed_input_len"] = np.array([[6, 0], [5, 0], [7, 0]], dtype=np.int16)
        arrays["packed_masked_lm_len"] = np.array([[2, 0], [1, 0], [2, 0]], dtype=np.int16)
    return arrays


def _write(path: Path, arrays: dict[str, object]) -> None:
    with h5py.File(path, "w") as f:
        for key, value in arrays.items():
            if isinstance(value, str):
                f.create_group(key)
            elif isinstance(value, np.ndarray) and value.dtype == object:
                f.create_dataset(key, data=value, dtype=VLEN)
            else:
                f.create_dataset(key, data=value)


MUTATIONS = ("drop", "float", "string", "bool", "rows", "columns", "scalar", "3d", "value", "vlen", "int64")


def _set_one(array: np.ndarray, value: int, index: int) -> np.ndarray:
    """A copy of `array` with one entry (of one row, for variable-length rows) set to `value`."""
    edited = array.copy()
    if edited.dtype == object:
        row = edited[index % len(edited)].copy()
        if len(row):
            row[index % len(row)] = _wrapped(value, row.dtype)
        edited[index % len(edited)] = row
    elif edited.size:
        edited.reshape(-1)[index % edited.size] = _wrapped(value, edited.dtype)
    return edited


def _wrapped(value: int, dtype: np.dtype) -> np.generic:
    """`value` in `dtype`, wrapped around as a C cast would (int8 128 -> -128)."""
    return np.array(value, dtype=np.int64).astype(dtype)[()]


def _as_2d(array: np.ndarray) -> np.ndarray:
    rows = array.shape[0] if array.ndim else 1
    return array.reshape(rows, -1) if array.size else np.zeros((rows, 2), dtype=array.dtype)


def _mutate(arrays: dict, key: str, how: str, value: int, index: int) -> None:
    """One hostile edit of one key (the keys may be ones the format does not even have)."""
    old = arrays.get(key)
    numeric = isinstance(old, np.ndarray) and old.dtype.kind in "biufO"  # O: variable-length rows
    old = old if numeric else np.zeros((3, 2), dtype=np.int16)
    flat = _as_2d(old if old.dtype != object else np.zeros((len(old), 2), dtype=np.int16))
    edits = {
        "drop": lambda: None, "group": lambda: "group", "float": lambda: flat.astype(np.float32) + 0.5,
        "string": lambda: np.array([b"x"] * len(flat)), "bool": lambda: flat.astype(bool),
        "rows": lambda: flat[: index % (len(flat) + 1)], "columns": lambda: flat[:, :index % 3],
        "scalar": lambda: np.int64(value), "3d": lambda: flat[:, :, None],
        "vlen": lambda: _vlen([[value] * (index % 4)] * len(flat)), "int64": lambda: flat.astype(np.int64) * value,
    }
    if how == "value":
        arrays[key] = _set_one(old, value, index)
        return
    result = edits[how]()
    if result is None:
        arrays.pop(key, None)
    else:
        arrays[key] = result


SHARD_KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
              "next_sentence_labels", "packed_input_len", "packed_masked_lm_len")


@settings(max_examples=250, deadline=5000)
@given(fmt=st.sampled_from(["fixed", "varlength", "packed"]),
       edits=st.lists(st.tuples(st.sampled_from(SHARD_KEYS), st.sampled_from(MUTATIONS),
                                st.integers(min_value=-40000, max_value=40000), st.integers(0, 50)), max_size=3))
def test_hostile_shards_are_read_or_rejected_with_a_data_error(fmt, edits):
    arrays = _valid_shard(fmt)
    for key, how, value, index in edits:
        with np.errstate(all="ignore"):
            _mutate(arrays, key, how, value if how != "value" else int(np.clip(value, -32768, 32767)), index)
    with tempfile.TemporaryDirectory() as folder, no_hang():
        path = Path(folder) / "part_00000.hdf5"
        _write(path, arrays)
        try:
            items = read_shard(path, LIMITS)
        except DataError as err:
            assert str(err).startswith(str(path)), str(err)
            return
    assert items and all(1 <= len(s.input_ids) <= LIMITS.max_seq_length for item in items for s in item)


@settings(max_examples=60, deadline=5000)
@given(fmt=st.sampled_from(["fixed", "varlength", "packed"]), cut=st.floats(min_value=0.0, max_value=0.999))
def test_truncated_shards_are_rejected_with_a_data_error(fmt, cut):
    with tempfile.TemporaryDirectory() as folder, no_hang():
        path = Path(folder) / "part_00000.hdf5"
        _write(path, _valid_shard(fmt))
        data = path.read_bytes()
        path.write_bytes(data[: int(cut * len(data))])
        with pytest.raises(DataError, match="part_00000.hdf5"):
            read_shard(path, LIMITS)


def test_the_valid_shards_of_these_tests_are_valid():
    with tempfile.TemporaryDirectory() as folder:
        for fmt in ("fixed", "varlength", "packed"):
            path = Path(folder) / f"{fmt}.hdf5"
            _write(path, _valid_shard(fmt))
            assert [len(item[0].input_ids) for item in read_shard(path, LIMITS)] == [6, 5, 7], fmt


@pytest.mark.parametrize("key", ["input_ids", "input_mask"])
def test_a_group_where_a_dataset_belongs_is_a_data_error(key, tmp_path):
    arrays = _valid_shard("fixed")
    arrays[key] = "group"
    _write(tmp_path / "part_00000.hdf5", arrays)
    with pytest.raises(DataError, match=key):
        read_shard(tmp_path / "part_00000.hdf5", LIMITS)
