"""Hostile configs and shards: each is accepted or rejected with ConfigError / DataError, never
another exception and never a hang. Plus the rules for where a run may write."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import tempfile
from pathlib import Path
from typing import Iterator

import h5py
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlperf_bert.config.cli import build_parser, config_from_args, parse_config
from mlperf_bert.config.settings import ConfigError, TrainConfig
from mlperf_bert.data.dataset import DataError, DataLimits, read_shard
from mlperf_bert.startup import check_environment

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
            str(root / "bert_config.json"), "--output_dir", str(root / "out"), "--max_steps", "10", "--do_train",
            "--submission_division", "open"]


TINY_BERT = {"vocab_size": 32, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
             "intermediate_size": 16, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("config_root")
    (folder / "bert_config.json").write_text(json.dumps(TINY_BERT))
    return folder


def started(argv: list[str]) -> TrainConfig:
    """The config as main.py builds it: flags, then the start-up checks of this machine."""
    cfg = parse_config(argv, 1)
    check_environment(cfg, {}, torch.device("cpu"))
    return cfg


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
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # resolved_config.json rebuilds


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
        started(base + ["--checkpoint_dir", str(out / ".." / "elsewhere")])
    (out / "checkpoints").symlink_to(tmp_path)
    with pytest.raises(ConfigError, match="--checkpoint_dir .* outside --output_dir"):
        started(base)  # the default folder is a symlink that leads out
    (out / "mlperf.log").symlink_to(tmp_path / "elsewhere.log")
    with pytest.raises(ConfigError, match="symlink that leads outside --output_dir"):
        started(base + ["--checkpoint_dir", str(out / "ckpt")])
    (out / "mlperf.log").unlink()
    log = tmp_path / "run.log"  # outside: an explicit --mlperf_log_file is the launcher's choice
    cfg = started(base + ["--checkpoint_dir", str(out / "ckpt"), "--mlperf_log_file", str(log)])
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
    (["--dist_optimizer_group_size", "2"], "--dist_optimizer_group_size shards the distributed optimizer: add "
                                           "--distributed_optimizer or drop it"),
    (["--distributed_optimizer", "--dist_optimizer_group_size", "-1"],
     "--dist_optimizer_group_size must be an integer >= 0"),
    (["--distributed_optimizer", "--dist_optimizer_group_size", "3"],
     "--dist_optimizer_group_size 3 must divide the 1 ranks (or be 0: every rank)"),
])
def test_bad_values_are_rejected_naming_the_flag_and_the_fix(root, extra, message):
    with pytest.raises(ConfigError) as err:
        started(_valid_args(root) + extra)
    assert message in str(err.value)


def test_checkpoints_need_training(root):
    argv = [a for a in _valid_args(root) if a != "--do_train"]
    with pytest.raises(ConfigError, match="add --do_train or drop them"):
        parse_config(argv + ["--checkpoint_every_samples", "100"], 1)


# --- config purity, the resolved config, --help ------------------------------------------------

class _NoEnvironment(dict):
    def __getitem__(self, key):
        raise AssertionError(f"building a config read the environment ({key})")

    get = __getitem__


def _no_filesystem(*args, **kwargs):
    raise AssertionError("building a config touched the file system")


SHIPPED_LIKE = ["--balance", "global_presort", "--checkpoint_every_samples", "64", "--resume_from_checkpoint",
                "/nowhere/ckpt-64.pt", "--warmup_steps", "2", "--start_warmup_step", "-1", "--decay_steps", "8",
                "--end_learning_rate", "1e-5", "--decay_from_warmup_end", "--mlperf_log_file", "/elsewhere/x.log"]


def test_building_a_config_reads_neither_files_nor_the_environment(monkeypatch):
    argv = ["--input_dir", "/no/train", "--eval_dir", "/no/eval", "--bert_config_path", "/no/bert.json",
            "--output_dir", "/no/out", "--max_steps", "10", "--do_train", "--submission_division", "open",
            *SHIPPED_LIKE]
    args = build_parser().parse_args(argv)
    for name in ("exists", "lexists", "isfile", "isdir", "realpath", "islink"):
        monkeypatch.setattr(os.path, name, _no_filesystem)
    for name in ("exists", "is_file", "is_dir", "resolve", "stat"):
        monkeypatch.setattr(Path, name, _no_filesystem)
    monkeypatch.setattr(os, "environ", _NoEnvironment())
    assert config_from_args(args, 4).data.balance == "global_presort"


@pytest.mark.parametrize("world_size", [1, 3])
def test_a_resolved_config_rebuilds_into_the_same_config_elsewhere(tmp_path, world_size):
    """resolved_config.json names paths of the machine that ran; they need not exist here."""
    argv = ["--input_dir", "/cluster/train", "--eval_dir", "/cluster/eval", "--bert_config_path",
            "/cluster/bert_config.json", "--output_dir", "/cluster/out", "--max_steps", "10", "--do_train",
            "--learning_rate", "0.000425", "--opt_lamb_beta_2", "0.88", "--input_layout", "unpadded",
            "--submission_division", "open", *SHIPPED_LIKE]
    cfg = parse_config(argv, world_size)
    (tmp_path / "resolved_config.json").write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True))
    rebuilt = TrainConfig.from_dict(json.loads((tmp_path / "resolved_config.json").read_text()))
    assert rebuilt == cfg and rebuilt.global_batch_size == cfg.global_batch_size


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["optim"].update(beta1=1.5), "--opt_lamb_beta_1 must be in [0, 1)"),
    (lambda d: d["schedule"].update(decay_stpes=3), "unknown key(s) decay_stpes"),
    (lambda d: d.pop("run"), "missing 1 required"),
    (lambda d: d.update(data=[]), "DataSettings: expected a JSON object"),
])
def test_a_bad_resolved_config_is_a_config_error(root, edit, message):
    data = json.loads(json.dumps(parse_config(_valid_args(root), 1).to_dict()))
    edit(data)
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict(data)
    assert message in str(err.value)


def _flag_actions() -> list[argparse.Action]:
    return [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]


def test_every_flag_has_help_a_topic_and_its_default_once():
    parser = build_parser()
    topics = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    grouped = [dest for title, dests in topics.items() if title not in ("options", "positional arguments")
               for dest in dests]
    for action in _flag_actions():
        assert action.help and action.help.strip(), action.option_strings
        assert grouped.count(action.dest) == 1, f"{action.option_strings} is in no topic (or in two)"
        shown = parser.formatter_class("x")._get_help_string(action) % {"default": action.default}
        assert shown.count("default") <= 1 + action.help.count("--default"), shown
        if action.required:
            assert shown.endswith("(required)")
        elif action.default is not None and action.default is not False:
            assert shown.endswith(f"(default: {action.default})"), shown
    assert list(topics)[2:] == ["data", "model", "batch and optimizer", "schedule", "clipping",
                                "precision and fast path", "balance", "evaluation and stopping",
                                "checkpoints and faults", "run and logging"]


# The flags of the shipped shell configs and tests, with their type and default, as they were.
FLAG_CONTRACT = {
    "--train_batch_size": (int, 8), "--gradient_accumulation_steps": (int, 1), "--learning_rate": (float, 4e-4),
    "--opt_lamb_beta_1": (float, 0.9), "--opt_lamb_beta_2": (float, 0.999), "--opt_epsilon": (float, 1e-6),
    "--weight_decay_rate": (float, 0.01), "--max_grad_norm": (float, 1.0), "--clip_mode": (str, "after_allreduce"),
    "--optimizer": (str, "lamb"), "--optimizer_impl": (str, "auto"), "--input_layout": (str, "unpadded"),
    "--max_seq_length": (int, 512), "--max_predictions_per_seq": (int, 76), "--balance": (str, "none"),
    "--balance_deal": (str, "auto"), "--warmup_steps": (int, None), "--warmup_proportion": (float, None),
    "--start_warmup_step": (int, 0), "--decay_steps": (int, None), "--end_learning_rate": (float, 0.0),
    "--target_mlm_accuracy": (float, 0.72), "--num_eval_examples": (int, 10000), "--eval_batch_size": (int, 128),
    "--eval_iter_start_samples": (int, None), "--eval_iter_samples": (int, None),
    "--max_samples_termination": (int, None), "--seed": (int, 12345), "--precision": (str, "fp32"),
    "--fp8_recipe": (str, None), "--fp8_layers": (str, None),
    "--device": (str, "auto"), "--log_freq": (int, 10), "--init_loss_scale": (float, 65536.0),
    "--compile_mode": (str, "none"), "--sync_every": (int, 1), "--input_pipeline": (str, "torch"),
    "--curves": (str, "png"),
    "--dist_optimizer_group_size": (int, 0),
    "--submission_division": (str, "closed"), "--submission_org": (str, "reference"),
    "--submission_platform": (str, "unknown"), "--submission_status": (str, "onprem"),
    "--attention_backend": (str, "auto"), "--attention_group_bounds": (str, "128,256,384,512"), "--init_checkpoint": (str, None), "--input_dir": (str, None),
    "--mlperf_log_file": (str, None), "--checkpoint_dir": (str, None), "--checkpoint_every_samples": (int, None),
    "--checkpoint_every_minutes": (float, None), "--keep_checkpoints": (int, 3),
    "--resume_from_checkpoint": (str, None), "--collective_timeout_s": (float, 600.0),
    "--max_consecutive_skipped_steps": (int, 50), "--eval_dir": (str, None), "--bert_config_path": (str, None),
    "--output_dir": (str, None), "--max_steps": (int, None),
}
SWITCHES = {"--do_train", "--cuda_graphs", "--decay_from_warmup_end", "--echo_mllog", "--distributed_optimizer",
            "--eval_cuda_graph", "--unverified_data"}


def test_flags_keep_their_spelling_type_and_default():
    actions = {a.option_strings[0]: a for a in _flag_actions()}
    assert set(actions) == set(FLAG_CONTRACT) | SWITCHES
    for name, (kind, default) in FLAG_CONTRACT.items():
        assert (actions[name].type or str, actions[name].default) == (kind, default), name
    assert all(actions[name].default is False and actions[name].nargs == 0 for name in SWITCHES)
    assert {a.option_strings[0] for a in actions.values() if a.required} == {
        "--eval_dir", "--bert_config_path", "--output_dir", "--max_steps"}


@pytest.mark.parametrize("extra, flags", [
    (["--max_steps", "1000", "--warmup_steps", "40", "--decay_steps", "10"], ("--warmup_steps", "--decay_steps 10")),
    (["--max_steps", "100", "--warmup_proportion", "0.5", "--decay_steps", "20", "--end_learning_rate", "1e-5"],
     ("--warmup_proportion", "--decay_steps >= 50")),
    (["--max_steps", "1000", "--decay_steps", "10"], ("--decay_steps 10", "--end_learning_rate 0", "--max_steps 1000")),
])
def test_a_schedule_that_sits_at_learning_rate_zero_is_refused(root, extra, flags):
    argv = _valid_args(root)
    del argv[argv.index("--max_steps"):argv.index("--max_steps") + 2]
    with pytest.raises(ConfigError) as err:
        parse_config(argv + extra, 1)
    assert all(flag in str(err.value) for flag in flags), str(err.value)


def test_schedules_that_decay_to_a_floor_or_to_the_last_step_are_accepted(root):
    argv = [*_valid_args(root)[:-5], "--submission_division", "open"]  # without --max_steps 10 --do_train
    samsung = ["--max_steps", "299", "--warmup_steps", "82", "--start_warmup_step", "-16", "--decay_steps", "179",
               "--end_learning_rate", "4.945e-5", "--decay_from_warmup_end"]
    assert parse_config(argv + samsung, 1).schedule.decay_steps == 179
    assert parse_config(argv + ["--max_steps", "50", "--warmup_steps", "50"], 1).schedule.warmup_steps == 50


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
