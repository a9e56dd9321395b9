"""On-disk shard formats (docs/ARCHITECTURE.md): keys, storage dtypes, names, recognition.

The trainer's reader (pytorch/mlperf_bert/data_validate.py) accepts any integer dtype; the
widths here are the MLCommons ones, which halve the disk size of int32 shards.
"""

from __future__ import annotations

import re

import h5py
import numpy as np

MAX_SEQ_LENGTH = 512  # L: tokens per sequence, [CLS] and both [SEP] included
MAX_PREDICTIONS = 76  # P: masked positions per sequence
MAX_SEQUENCES_PER_PACK = 3  # K: slots of a packed row
STRATA_BOUNDS = (128, 256, 384, 512)  # stratum k holds lengths (bounds[k-1], bounds[k]]
NUM_EVAL_SAMPLES = 10_000

FIXED_KEYS = (
    "input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
    "next_sentence_labels",
)
VARLENGTH_KEYS = ("input_ids", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels")
PACKED_KEYS = VARLENGTH_KEYS + ("packed_input_len", "packed_masked_lm_len")
FORMAT_KEYS = {"fixed": FIXED_KEYS, "varlength": VARLENGTH_KEYS, "packed": PACKED_KEYS}

# Storage dtypes. int16 ids hold vocabularies of up to 32,767 entries (MLPerf: 30,522).
STORAGE_DTYPES = {
    "input_ids": np.int16,
    "input_mask": np.int8,
    "segment_ids": np.int8,
    "masked_lm_positions": np.int16,
    "masked_lm_ids": np.int16,
    "next_sentence_labels": np.int8,
    "packed_input_len": np.int16,
    "packed_masked_lm_len": np.int16,
}
MAX_VOCAB_SIZE = int(np.iinfo(np.int16).max) + 1

MANIFEST_NAME = "MANIFEST.json"
STRATA_NAME = "strata.json"
PACKING_REPORT_NAME = "packing_report.json"
EVAL_SHARD_NAME = "part_eval_10k.hdf5"
_TEXT_PART = re.compile(r"part-(\d+)-of-(\d+)$")


class DataPrepError(Exception):
    """Bad input or a failed step; the message names the file or flag and how to fix it."""


def shard_name(index: int, total: int) -> str:
    """NVIDIA's training shard name: part_00042_of_04320.hdf5."""
    return f"part_{index:05d}_of_{total:05d}.hdf5"


def text_part_index(name: str) -> int | None:
    """42 for the MLCommons text file part-00042-of-00500; None for other names."""
    match = _TEXT_PART.match(name)
    return int(match.group(1)) if match else None


def detect_format(handle: h5py.File) -> str:
    """'packed' when packed_input_len exists, 'varlength' for a variable-length input_ids, else 'fixed'."""
    if "input_ids" not in handle:
        found = ", ".join(sorted(handle.keys())) or "no keys"
        raise DataPrepError(f"{handle.filename}: no 'input_ids' key (found: {found}); not a BERT shard")
    if "packed_input_len" in handle:
        return "packed"
    return "varlength" if h5py.check_vlen_dtype(handle["input_ids"].dtype) is not None else "fixed"
