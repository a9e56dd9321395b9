"""Step `reshard`: per-part sample files -> N balanced training shards (fixed and varlength).

Shard s holds output positions [s*T//N, (s+1)*T//N) of the T samples, so shard sizes differ
by at most one (NVIDIA's layout: 4320 shards named part_XXXXX_of_04320.hdf5).

Without shuffling, output position = input order. With shuffling (the default) input
sample i goes to output position destination[i] of a seeded random permutation: a full
shuffle across all shards. Random reads from hundreds of files would re-read every chunk
many times, so the shuffle is done in two sequential passes with bounded memory: pass 1
streams the inputs once and appends every sample to the spill file of the bucket (group of
consecutive output shards) its position falls in; pass 2 loads one bucket at a time, orders
it by position and writes its shards. The spill needs about as much disk as the varlength
shards, and is deleted at the end.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data_prep.fileio import Manifest, sha256_file
from mlperf_bert.runtime.files import temp_name
from data_prep.formats import DataPrepError, shard_name
from data_prep.parallel import run_jobs
from data_prep.sources import SourceSet, balanced_bounds, inputs_record
from mlperf_bert.data.shards import Samples, write_samples

log = logging.getLogger(__name__)

# Spill dtypes: storage widths (ids < 32768, lengths <= 512) keep the temporary files small.
_SPILL_DTYPES = {
    "input_ids": np.int16, "segment_ids": np.int8, "lengths": np.int16, "masked_lm_positions": np.int16,
    "masked_lm_ids": np.int16, "num_predictions": np.int16, "next_sentence_labels": np.int8,
}
_MEMORY_DTYPES = {
    "input_ids": np.int32, "segment_ids": np.int8, "lengths": np.int64, "masked_lm_positions": np.int32,
    "masked_lm_ids": np.int32, "num_predictions": np.int64, "next_sentence_labels": np.int8,
}


@dataclass(frozen=True)
class ReshardParams:
    num_shards: int = 4320
    formats: tuple[str, ...] = ("fixed", "varlength")
    shuffle: bool = True
    seed: int = 12345
    max_seq_length: int = 512
    max_predictions: int = 76
    bucket_samples: int = 1_000_000  # samples a worker holds in memory at once (about 1.5 KB each)
    compression: str | None = None
    workers: int = 1  # processes writing buckets in parallel


def shard_dir_name(num_shards: int, fmt: str) -> str:
    """NVIDIA-style folder name, e.g. hdf5_4320_shards_varlength."""
    return f"hdf5_{num_shards}_shards_{fmt}"


class _Spill:
    """Raw per-bucket append files: bucket_00003.<field>.bin plus bucket_00003.position.bin."""

    def __init__(self, directory: Path):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def _file(self, bucket: int, key: str) -> Path:
        return self.directory / f"bucket_{bucket:05d}.{key}.bin"

    def add(self, bucket: int, samples: Samples, positions: np.ndarray) -> None:
        for key, dtype in _SPILL_DTYPES.items():
            with open(self._file(bucket, key), "ab") as handle:
                handle.write(getattr(samples, key).astype(dtype).tobytes())
        with open(self._file(bucket, "position"), "ab") as handle:
            handle.write(positions.astype(np.int64).tobytes())

    def load(self, bucket: int) -> tuple[Samples, np.ndarray]:
        arrays = {}
        for key, dtype in _SPILL_DTYPES.items():
            path = self._file(bucket, key)
            values = np.fromfile(path, dtype=dtype) if path.exists() else np.zeros(0, dtype)
            arrays[key] = values.astype(_MEMORY_DTYPES[key])
        position_file = self._file(bucket, "position")
        positions = np.fromfile(position_file, dtype=np.int64) if position_file.exists() else np.zeros(0, np.int64)
        return Samples(**arrays), positions


def _buckets(num_shards: int, shard_size: float, bucket_samples: int) -> list[tuple[int, int]]:
    """Consecutive shard ranges [s0, s1) of about `bucket_samples` samples each."""
    per_bucket = max(int(bucket_samples // max(shard_size, 1.0)), 1)
    return [(s, min(s + per_bucket, num_shards)) for s in range(0, num_shards, per_bucket)]


def _spill_inputs(sources: SourceSet, destination: np.ndarray, bucket_starts: np.ndarray,
                  needed: set[int], spill: _Spill) -> None:
    """Pass 1: every input sample to the spill of the bucket its output position lies in."""
    with tqdm(total=sources.total, unit="samples", desc="reshard pass 1") as bar:
        for start, block in sources.blocks():
            positions = destination[start:start + len(block)]
            bucket_of = np.searchsorted(bucket_starts, positions, side="right") - 1
            for bucket in np.unique(bucket_of):
                if int(bucket) in needed:
                    rows = np.flatnonzero(bucket_of == bucket)
                    spill.add(int(bucket), block.take(rows), positions[rows])
            bar.update(len(block))


def _manifests(out_dirs: dict[str, Path], params: ReshardParams, sources: SourceSet) -> dict[str, Manifest]:
    record = {k: v for k, v in asdict(params).items() if k not in ("formats", "bucket_samples", "workers")}
    record["inputs"] = inputs_record(sources.paths)
    return {fmt: Manifest.open(d, "reshard", {**record, "format": fmt}) for fmt, d in out_dirs.items()}


@dataclass(frozen=True)
class _BucketJob:
    """Pass 2 of one bucket, self-contained so that a pool worker can run it."""

    bucket: int
    position_bounds: tuple[int, ...]  # output positions where each of the bucket's shards starts, and its end
    names: tuple[str, ...]  # the bucket's shard names
    todo: tuple[tuple[str, str], ...]  # (format, shard name) to write
    out_dirs: tuple[tuple[str, Path], ...]
    spill_dir: Path | None  # None: read the input range directly (no shuffle)
    inputs: tuple[Path, ...]
    params: ReshardParams


def _write_bucket(job: _BucketJob) -> list[tuple[str, str, int, str]]:
    """Writes the bucket's shards; returns (format, name, samples, sha256) of each written file."""
    p, bounds = job.params, job.position_bounds
    if job.spill_dir is not None:
        samples, positions = _Spill(job.spill_dir).load(job.bucket)
        samples = samples.take(np.argsort(positions, kind="stable"))
    else:
        samples = SourceSet(list(job.inputs)).read_range(bounds[0], bounds[-1])
    written, dirs = [], dict(job.out_dirs)
    for k, name in enumerate(job.names):
        shard = samples.slice(bounds[k] - bounds[0], bounds[k + 1] - bounds[0])
        for fmt in (f for f, n in job.todo if n == name):
            write_samples(dirs[fmt] / name, shard, fmt, p.max_seq_length, p.max_predictions, p.compression)
            written.append((fmt, name, len(shard), sha256_file(dirs[fmt] / name)))
    return written


def reshard(inputs: list[Path], out_dirs: dict[str, Path], params: ReshardParams) -> dict[str, Manifest]:
    """Writes (or completes) the balanced shards of `inputs` into `out_dirs` (format -> folder)."""
    sources = SourceSet(inputs)
    total, n = sources.total, params.num_shards
    if total < n:
        raise DataPrepError(f"{total} samples cannot fill --num_shards {n}; use fewer shards")
    manifests = _manifests(out_dirs, params, sources)
    bounds = balanced_bounds(total, n)
    names = [shard_name(s, n) for s in range(n)]
    spill_dir = temp_name(next(iter(out_dirs.values())) / "spill") if params.shuffle else None
    buckets = _buckets(n, total / n, params.bucket_samples)
    jobs = []
    for b, (s0, s1) in enumerate(buckets):
        todo = tuple((fmt, names[s]) for s in range(s0, s1) for fmt, m in manifests.items() if not m.is_done(names[s]))
        if todo:
            jobs.append(_BucketJob(b, tuple(int(x) for x in bounds[s0:s1 + 1]), tuple(names[s0:s1]), todo,
                                   tuple(out_dirs.items()), spill_dir, tuple(sources.paths), params))
    log.info("reshard: %d samples -> %d shards, %d buckets to do", total, n, len(jobs))
    if jobs:
        try:
            if spill_dir is not None:
                _spill(sources, params, bounds[[s0 for s0, _ in buckets]], jobs, spill_dir)
            for written in tqdm(run_jobs(_write_bucket, jobs, params.workers), total=len(jobs), desc="reshard write"):
                for fmt, name, count, digest in written:
                    manifests[fmt].record(name, count, fmt, sha256=digest)
        finally:
            if spill_dir is not None:
                shutil.rmtree(spill_dir, ignore_errors=True)
    return manifests


def _spill(sources: SourceSet, params: ReshardParams, bucket_starts: np.ndarray, jobs: list[_BucketJob],
           spill_dir: Path) -> None:
    """Pass 1 for the buckets of `jobs`: draws the permutation and spills every input sample."""
    destination = np.random.default_rng([params.seed, sources.total]).permutation(sources.total)  # [total] int64
    _spill_inputs(sources, destination, bucket_starts, {j.bucket for j in jobs}, _Spill(spill_dir))
