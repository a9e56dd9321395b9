"""Step `eval`: the 10,000-sample eval set, picked from the samples made from eval.txt.

As MLCommons pick_eval_samples.py: of the N eval samples (the `samples` step's output for
eval.txt, which is the reference's eval_intermediate, row for row), record
int(i * (N / 10000)) for i = 0..9999, in file order, with float division.

Eval samples come only from eval.txt: the `samples` step can exclude every training
document that equals an eval document (`--exclude_text`), and random next sentences are
drawn from the same file, so no eval text reaches a training sample.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from data_prep.fileio import Manifest
from data_prep.formats import EVAL_SHARD_NAME, NUM_EVAL_SAMPLES, DataPrepError
from data_prep.sources import SourceSet, inputs_record, write_formats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalParams:
    num_samples: int = NUM_EVAL_SAMPLES
    max_seq_length: int = 512
    max_predictions: int = 76
    compression: str | None = None


def eval_shard_name(num_samples: int) -> str:
    """part_eval_10k.hdf5 for the benchmark's 10,000 samples, part_eval_<n>.hdf5 otherwise."""
    return EVAL_SHARD_NAME if num_samples == NUM_EVAL_SAMPLES else f"part_eval_{num_samples}.hdf5"


def pick_indices(total: int, params: EvalParams) -> np.ndarray:
    """[num_samples] indices int(i * (total / num_samples)) into the eval samples, as the reference."""
    if total < params.num_samples:
        raise DataPrepError(
            f"the eval text gave {total} samples, fewer than --num_eval_samples {params.num_samples}; "
            "use the full eval.txt or pick fewer samples"
        )
    # float64 product truncated: Python's int(i * (total / num_samples)), value for value.
    return (np.arange(params.num_samples, dtype=np.int64) * (total / params.num_samples)).astype(np.int64)


def make_eval_set(inputs: list[Path], out_dirs: dict[str, Path], params: EvalParams) -> dict[str, Manifest]:
    """Writes the eval shard in every format of `out_dirs` (format -> folder)."""
    sources = SourceSet(inputs)
    record = {**asdict(params), "inputs": inputs_record(sources.paths)}
    manifests = {fmt: Manifest.open(d, "eval", {**record, "format": fmt}) for fmt, d in out_dirs.items()}
    name = eval_shard_name(params.num_samples)
    todo = {fmt: m for fmt, m in manifests.items() if not m.is_done(name)}
    if not todo:
        log.info("eval: %s already made", name)
        return manifests
    samples = sources.gather(pick_indices(sources.total, params))
    write_formats(samples, name, todo, params.max_seq_length, params.max_predictions, params.compression)
    log.info("eval: picked %d of %d samples into %s", len(samples), sources.total,
             ", ".join(str(m.directory) for m in todo.values()))
    return manifests
