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
# The reference's eval files (eval.txt, eval_intermediate, eval_10k) and what this tool makes of
# them (eval.hdf5, eval_10k.hdf5, part_eval_10k.hdf5): a name starting so holds eval samples.
EVAL_NAME_PREFIXES = ("eval", "part_eval")
_TEXT_PART = re.compile(r"part-(\d+)-of-(\d+)$")

# One error type for bad data in both packages: a shard the trainer's reader refuses is
# caught by data_prep's commands like their own errors.
DataPrepError = DataError

__all__ = [
    "EVAL_NAME_PREFIXES", "EVAL_SHARD_NAME", "MANIFEST_NAME", "MAX_PREDICTIONS", "MAX_SEQ_LENGTH",
    "MAX_SEQUENCES_PER_PACK", "MAX_VOCAB_SIZE", "NUM_EVAL_SAMPLES", "PACKING_REPORT_NAME", "STRATA_NAME", "DataPrepError",
    "is_eval_name", "refuse_mixed_roles", "shard_name", "text_part_index",
]


def shard_name(index: int, total: int) -> str:
    """NVIDIA's training shard name: part_00042_of_04320.hdf5."""
    return f"part_{index:05d}_of_{total:05d}.hdf5"


def text_part_index(name: str) -> int | None:
    """42 for the MLCommons text file part-00042-of-00500; None for other names."""
    match = _TEXT_PART.match(name)
    return int(match.group(1)) if match else None


def is_eval_name(name: str) -> bool:
    """Whether a file name is one of the reference's eval files or this tool's eval outputs."""
    return name.startswith(EVAL_NAME_PREFIXES)


def refuse_mixed_roles(names: list[str], flag: str) -> None:
    """Eval and training inputs must go to separate folders: reshard reads every file of a folder,
    so an eval file beside the training parts would put eval samples into training shards."""
    evals = [n for n in names if is_eval_name(n)]
    if evals and len(evals) < len(names):
        train = next(n for n in names if not is_eval_name(n))
        raise DataPrepError(f"{flag} mixes eval files ({', '.join(evals)}) with training files ({train} ...); "
                            f"run the step once for each, into separate --out folders")
