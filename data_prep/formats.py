"""Names and benchmark sizes of the data preparation's outputs.

The shard format itself (keys, storage dtypes, recognition, reading and writing) lives in
`mlperf_bert.data.shards`, which the trainer reads with too.
"""

from __future__ import annotations

import re

from mlperf_bert.data.shards import MANIFEST_NAME, MAX_VOCAB_SIZE, PACKING_REPORT_NAME, STRATA_NAME, DataError

MAX_SEQ_LENGTH = 512  # L: tokens per sequence, [CLS] and both [SEP] included
MAX_PREDICTIONS = 76  # P: masked positions per sequence
MAX_SEQUENCES_PER_PACK = 3  # K: slots of a packed row
NUM_EVAL_SAMPLES = 10_000

EVAL_SHARD_NAME = "part_eval_10k.hdf5"
_TEXT_PART = re.compile(r"part-(\d+)-of-(\d+)$")

# One error type for bad data in both packages: a shard the trainer's reader refuses is
# caught by data_prep's commands like their own errors.
DataPrepError = DataError

__all__ = [
    "EVAL_SHARD_NAME", "MANIFEST_NAME", "MAX_PREDICTIONS", "MAX_SEQ_LENGTH", "MAX_SEQUENCES_PER_PACK",
    "MAX_VOCAB_SIZE", "NUM_EVAL_SAMPLES", "PACKING_REPORT_NAME", "STRATA_NAME", "DataPrepError",
    "shard_name", "text_part_index",
]


def shard_name(index: int, total: int) -> str:
    """NVIDIA's training shard name: part_00042_of_04320.hdf5."""
    return f"part_{index:05d}_of_{total:05d}.hdf5"


def text_part_index(name: str) -> int | None:
    """42 for the MLCommons text file part-00042-of-00500; None for other names."""
    match = _TEXT_PART.match(name)
    return int(match.group(1)) if match else None
