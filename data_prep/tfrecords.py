"""Step `import-tfrecord`: the reference's TFRecord files -> the fixed hdf5 files the trainer reads.

For users who already ran the MLCommons scripts (500 training part files, eval_intermediate
or eval_10k). No TensorFlow: a TFRecord file is a sequence of records
    uint64 length | uint32 masked crc32c(length) | data | uint32 masked crc32c(data)
(little-endian; masked crc = rotate right 15 + 0xa282ead8), and each record's data is a
serialized `tf.train.Example`, parsed here by `protobuf` from the message definitions built
below. Both checksums are verified: a damaged file stops with its name and the record
number. Rows keep the file's record order; int64 values are narrowed to the storage dtypes
after a check that they fit. Each input gives OUT/<name>.hdf5, recorded in MANIFEST.json
like the `samples` step's files (with the content key of its TFRecord, so a file replaced under
the same name is converted again), so `reshard` and `eval` take them as they are. An eval file
(eval_intermediate, eval_10k) must be imported into its own folder, never beside training
parts: verify_dataset then recognises that folder as an eval set by its eval_* file names.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import BinaryIO, Iterator

import crc32c
import h5py
import numpy as np

from data_prep.fileio import Manifest, content_key, sha256_file
from mlperf_bert.runtime.files import atomic_path
from data_prep.formats import DataPrepError, refuse_mixed_roles
from mlperf_bert.data.shards import FIXED_KEYS, STORAGE_DTYPES
from mlperf_bert.data.shards import ArrayAppender
from data_prep.parallel import run_jobs

log = logging.getLogger(__name__)

_MASK_DELTA = 0xA282EAD8
BLOCK_ROWS = 4096


def masked_crc(data: bytes) -> int:
    """TFRecord's masked crc32c of `data`."""
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def _read_exact(handle: BinaryIO, size: int, path: Path, record: int, what: str) -> bytes:
    data = handle.read(size)
    if len(data) != size:
        raise DataPrepError(f"{path}: record {record}: file ends inside the {what} ({len(data)} of {size} bytes); "
                            "the file is truncated, download or convert it again")
    return data


def read_records(path: Path) -> Iterator[bytes]:
    """The data of every record of a TFRecord file, both checksums verified."""
    with open(path, "rb") as handle:
        record = 0
        while header := handle.read(12):
            if len(header) < 12:
                raise DataPrepError(f"{path}: record {record}: file ends inside the record header; "
                                    "the file is truncated, download or convert it again")
            length, length_crc = struct.unpack("<QI", header)
            if masked_crc(header[:8]) != length_crc:
                raise DataPrepError(f"{path}: record {record}: the length's checksum is wrong; not a TFRecord file, "
                                    "or a damaged one (compressed files must be decompressed first)")
            data = _read_exact(handle, length, path, record, "record data")
            (data_crc,) = struct.unpack("<I", _read_exact(handle, 4, path, record, "data checksum"))
            if masked_crc(data) != data_crc:
                raise DataPrepError(f"{path}: record {record}: the data's checksum is wrong; the file is damaged")
            yield data
            record += 1


@cache
def example_class() -> type:
    """The tf.train.Example message class (tensorflow/core/example/{example,feature}.proto)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto(name="data_prep_tf_example.proto", package="tensorflow",
                                               syntax="proto3")
    label = kind = descriptor_pb2.FieldDescriptorProto  # holds both the LABEL_* and TYPE_* constants
    for name, value_type in (("BytesList", kind.TYPE_BYTES), ("FloatList", kind.TYPE_FLOAT),
                             ("Int64List", kind.TYPE_INT64)):
        proto.message_type.add(name=name).field.add(name="value", number=1, label=label.LABEL_REPEATED,
                                                   type=value_type)
    feature = proto.message_type.add(name="Feature")
    feature.oneof_decl.add(name="kind")
    for number, (name, type_name) in enumerate((("bytes_list", "BytesList"), ("float_list", "FloatList"),
                                                ("int64_list", "Int64List")), start=1):
        feature.field.add(name=name, number=number, label=label.LABEL_OPTIONAL, type=kind.TYPE_MESSAGE,
                          type_name=f".tensorflow.{type_name}", oneof_index=0)
    features = proto.message_type.add(name="Features")
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, label=label.LABEL_OPTIONAL, type=kind.TYPE_STRING)
    entry.field.add(name="value", number=2, label=label.LABEL_OPTIONAL, type=kind.TYPE_MESSAGE,
                    type_name=".tensorflow.Feature")
    features.field.add(name="feature", number=1, label=label.LABEL_REPEATED, type=kind.TYPE_MESSAGE,
                       type_name=".tensorflow.Features.FeatureEntry")
    proto.message_type.add(name="Example").field.add(name="features", number=1, label=label.LABEL_OPTIONAL,
                                                     type=kind.TYPE_MESSAGE, type_name=".tensorflow.Features")
    pool = descriptor_pool.DescriptorPool()  # private: no clash with TensorFlow's own registration
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))


@dataclass(frozen=True)
class ImportJob:
    source: Path
    output_path: Path
    max_seq_length: int
    max_predictions: int
    compression: str | None


def _row(data: bytes, job: ImportJob, record: int) -> list[list[int]]:
    """The six int64 features of one record, checked for presence and length."""
    from google.protobuf.message import DecodeError

    example = example_class()()
    try:
        example.ParseFromString(data)
    except DecodeError as err:
        raise DataPrepError(f"{job.source}: record {record}: not a tf.train.Example ({err})") from err
    features = example.features.feature
    row = []
    for key in FIXED_KEYS:
        width = {"masked_lm_positions": job.max_predictions, "masked_lm_ids": job.max_predictions,
                 "next_sentence_labels": 1}.get(key, job.max_seq_length)
        values = list(features[key].int64_list.value) if key in features else None
        if values is None or len(values) != width:
            found = "missing" if values is None else f"{len(values)} int64 values"
            raise DataPrepError(f"{job.source}: record {record}: feature {key} is {found}, expected {width} "
                                "(check --max_seq_length / --max_predictions against the file)")
        row.append(values)
    return row


def _block(rows: list[list[list[int]]], job: ImportJob, first_record: int) -> dict[str, np.ndarray]:
    out = {}
    for k, key in enumerate(FIXED_KEYS):
        wide = np.array([row[k] for row in rows], dtype=np.int64)
        info = np.iinfo(STORAGE_DTYPES[key])
        if wide.size and (wide.min() < info.min or wide.max() > info.max):
            bad = first_record + int(np.flatnonzero((wide < info.min) | (wide > info.max))[0] // wide[0].size)
            raise DataPrepError(f"{job.source}: record {bad}: {key} holds a value outside {STORAGE_DTYPES[key]}")
        out[key] = wide.astype(STORAGE_DTYPES[key]).reshape((len(rows),) if key == "next_sentence_labels" else
                                                            (len(rows), -1))
    return out


def import_file(job: ImportJob) -> tuple[str, int, str]:
    """(output name, rows, sha256) of one converted TFRecord file (runs in a pool worker)."""
    count = 0
    with atomic_path(job.output_path) as temp, h5py.File(temp, "w") as handle:
        appender, rows = ArrayAppender(handle, job.compression), []
        for record, data in enumerate(read_records(job.source)):
            rows.append(_row(data, job, record))
            if len(rows) == BLOCK_ROWS:
                appender.append(_block(rows, job, count))
                count, rows = count + len(rows), []
        if rows:
            appender.append(_block(rows, job, count))
            count += len(rows)
    if count == 0:
        job.output_path.unlink()
        raise DataPrepError(f"{job.source}: no records; give the reference's TFRecord files")
    return job.output_path.name, count, sha256_file(job.output_path)


def output_name(source: Path) -> str:
    """part-00000-of-00500.tfrecord -> part-00000-of-00500.hdf5; eval_10k -> eval_10k.hdf5."""
    name = source.name.removesuffix(".tfrecord").removesuffix(".tfrecords")
    return f"{name}.hdf5"


def import_tfrecords(sources: list[Path], out_dir: Path, max_seq_length: int, max_predictions: int,
                     compression: str | None = None, workers: int = 1) -> Manifest:
    """Converts (or completes the conversion of) `sources` into `out_dir`."""
    if not sources:
        raise DataPrepError("no TFRecord files given (--input)")
    params = {"max_seq_length": max_seq_length, "max_predictions": max_predictions, "compression": compression}
    names = [output_name(p) for p in sources]
    if len(set(names)) != len(names):
        raise DataPrepError("two inputs would give the same output name; import them into separate folders")
    manifest = Manifest.open(out_dir, "import-tfrecord", params)
    refuse_mixed_roles(sorted({*manifest.files, *names}), f"--input (with what {out_dir} holds)")
    jobs = [ImportJob(p, out_dir / n, max_seq_length, max_predictions, compression)
            for p, n in zip(sources, names) if not manifest.is_done(n, source=p)]
    log.info("import-tfrecord: %d of %d files to convert into %s", len(jobs), len(sources), out_dir)
    source_keys = {job.output_path.name: content_key(job.source) for job in jobs}  # the input as it was read
    for name, count, sha256 in run_jobs(import_file, jobs, workers):
        manifest.record(name, count, "fixed", sha256=sha256, source=source_keys[name])
        log.info("import-tfrecord: %s: %d samples", name, count)
    return manifest
