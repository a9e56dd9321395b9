"""`import-tfrecord`: TFRecords written by TensorFlow, as the reference writes them, come back exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from data_prep import prepare
from data_prep.formats import DataPrepError
from mlperf_bert.data.shards import open_shard as open_h5
from data_prep.tfrecords import import_tfrecords, read_records
from tests.harness.golden_samples import KEYS, golden_arrays

ROWS = 300  # of golden_128: three blocks when blocks hold 128 rows


def _feature(values, floats: bool = False) -> tf.train.Feature:
    if floats:
        return tf.train.Feature(float_list=tf.train.FloatList(value=list(values)))
    return tf.train.Feature(int64_list=tf.train.Int64List(value=[int(v) for v in values]))


def write_reference_tfrecord(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """The features create_pretraining_data.py writes, masked_lm_weights included."""
    with tf.io.TFRecordWriter(str(path)) as writer:
        for i in range(len(arrays["input_ids"])):
            features = {key: _feature(np.atleast_1d(arrays[key][i])) for key in KEYS}
            features["masked_lm_weights"] = _feature((arrays["masked_lm_positions"][i] != 0).astype(float), True)
            writer.write(tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString())


@pytest.fixture(scope="module")
def golden_rows():
    return {key: values[:ROWS] for key, values in golden_arrays("golden_128").items()}


@pytest.fixture(scope="module")
def records(golden_rows, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tfrecords")
    write_reference_tfrecord(folder / "part-00000-of-00500", golden_rows)
    return folder


def test_round_trip_through_the_command_line(records, golden_rows, tmp_path, monkeypatch):
    monkeypatch.setattr("data_prep.tfrecords.BLOCK_ROWS", 128)  # several blocks per file
    argv = ["--quiet", "import-tfrecord", "--input", str(records), "--out", str(tmp_path), "--max_seq_length",
            "128", "--max_predictions", "20", "--workers", "1"]
    assert prepare.main(argv) == 0
    with open_h5(tmp_path / "part-00000-of-00500.hdf5") as handle:
        assert sorted(handle.keys()) == sorted(KEYS)
        for key in KEYS:
            assert handle[key].dtype == golden_rows[key].dtype
            assert np.array_equal(handle[key][:], golden_rows[key]), key
    assert prepare.main(argv) == 0  # done already: nothing to redo


def test_damaged_record_names_the_file_and_record(records, tmp_path):
    original = (records / "part-00000-of-00500").read_bytes()
    data = bytearray(original)
    sizes = [len(r) + 16 for r in read_records(records / "part-00000-of-00500")]
    data[sum(sizes[:3]) + 20] ^= 0xFF  # a byte inside record 3's data
    bad = tmp_path / "part-00001-of-00500"
    bad.write_bytes(bytes(data))
    with pytest.raises(DataPrepError, match=r"part-00001-of-00500: record 3: the data's checksum is wrong"):
        import_tfrecords([bad], tmp_path / "out", 128, 20)
    assert not list((tmp_path / "out").glob("*.hdf5"))  # nothing half-written
    bad.write_bytes(original[: sum(sizes[:5]) + 30])
    with pytest.raises(DataPrepError, match=r"record 5: file ends inside the record data"):
        import_tfrecords([bad], tmp_path / "out2", 128, 20)


def test_wrong_lengths_and_missing_features_are_refused(records, golden_rows, tmp_path):
    with pytest.raises(DataPrepError, match=r"record 0: feature input_ids is 128 int64 values, expected 512"):
        import_tfrecords([records / "part-00000-of-00500"], tmp_path / "out", 512, 76)
    partial = tmp_path / "eval_10k"
    with tf.io.TFRecordWriter(str(partial)) as writer:
        features = {"input_ids": _feature(golden_rows["input_ids"][0])}
        writer.write(tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString())
    with pytest.raises(DataPrepError, match=r"eval_10k: record 0: feature input_mask is missing"):
        import_tfrecords([partial], tmp_path / "out3", 128, 20)
