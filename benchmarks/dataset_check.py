"""Cost of the whole-folder row check of a data folder (`data_validate.check_dataset`; the trainer ran it
before run_start up to 07588e5, now the rows are checked in data_prep and as a shard is read).

    python benchmarks/dataset_check.py --gigabytes 1 --formats fixed varlength packed --json check.json
    python benchmarks/dataset_check.py --data_dir /data/hdf5_4320_shards_varlength --limit_shards 40

Without --data_dir it writes a synthetic folder per format (MLPerf widths: 512 tokens, 76
predictions, Wikipedia phase-2 lengths, 4 shards) of about --gigabytes each into a temporary
folder and checks it right after writing, so the files sit in the page cache: the numbers are
the check's own CPU cost (decoding and every rule), not the disk's. A cold read adds the
disk's time for the same bytes. Reported per format: shards, bytes on disk, seconds and
seconds per GB (best of --repeats).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from data_prep.packing import pack_index_table
from mlperf_bert.data.validate import DataLimits, check_dataset
from mlperf_bert.data.lengths import load_length_histogram
from mlperf_bert.data.shards import Samples, folder_shards, offsets, to_packed, write_arrays, write_samples
from mlperf_bert.runtime.files import output_file

L, P, VOCAB = 512, 76, 30522
SHARDS = 4
BYTES_PER_ROW = {"fixed": 2 * L + L + L + 2 * P * 2 + 1, "varlength": 1000, "packed": 2 * L + L + 2 * 3 * P * 2 + 15}


def synthetic_samples(count: int, rng: np.random.Generator) -> Samples:
    """Valid sequences: Wikipedia lengths (at least 8), ~15% masked, positions spread inside A and B."""
    counts = load_length_histogram()
    lengths = np.maximum(rng.choice(np.arange(1, counts.shape[0] + 1), count, p=counts / counts.sum()), 8)
    predictions = np.clip(np.rint(lengths * 0.15), 1, P).astype(np.int64)
    seq = np.repeat(np.arange(count), predictions)
    j = np.arange(int(predictions.sum())) - offsets(predictions)[seq]
    positions = 1 + (j * (lengths[seq] - 2)) // predictions[seq]  # strictly increasing, inside [1, len - 2]
    token_seq = np.repeat(np.arange(count), lengths)
    within = np.arange(int(lengths.sum())) - offsets(lengths)[token_seq]
    return Samples(
        input_ids=rng.integers(5, VOCAB, int(lengths.sum())).astype(np.int32),
        segment_ids=(within >= lengths[token_seq] // 2).astype(np.int8), lengths=lengths.astype(np.int64),
        masked_lm_positions=positions.astype(np.int32),
        masked_lm_ids=rng.integers(5, VOCAB, seq.shape[0]).astype(np.int32),
        num_predictions=predictions, next_sentence_labels=rng.integers(0, 2, count).astype(np.int8),
    )


def write_folder(folder: Path, fmt: str, gigabytes: float, rng: np.random.Generator) -> None:
    rows = int(gigabytes * 1e9 / BYTES_PER_ROW[fmt] / SHARDS)
    for s in range(SHARDS):
        name = folder / f"part_{s:05d}_of_{SHARDS:05d}.hdf5"
        if fmt == "packed":
            samples = synthetic_samples(int(rows * 2.3), rng)  # ~2.3 Wikipedia sequences fill a 512-token pack
            write_arrays(name, to_packed(samples, pack_index_table(samples.lengths, "lpfhp", rng, L, 3), L))
        else:
            write_samples(name, synthetic_samples(rows, rng), fmt, L, P)


def measure(folder: Path, repeats: int, limit_shards: int | None) -> dict:
    """Best time of check_dataset on the folder (or, with limit_shards, on its first shards one by one)."""
    shards = folder_shards(folder)[:limit_shards] if limit_shards else folder_shards(folder)
    targets = shards if limit_shards else [folder]
    size = sum(p.stat().st_size for p in shards)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for target in targets:
            check_dataset(target, DataLimits(L, P, VOCAB))
        best = min(best, time.perf_counter() - start)
    return {"shards": len(shards), "bytes": size, "seconds": round(best, 3),
            "seconds_per_gb": round(best / (size / 1e9), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=1.0, help="synthetic data per format")
    parser.add_argument("--formats", nargs="+", default=["fixed", "varlength", "packed"])
    parser.add_argument("--data_dir", type=Path, help="check this folder instead of synthetic data")
    parser.add_argument("--limit_shards", type=int, help="with --data_dir: only the first N shards")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=output_file)
    args = parser.parse_args()
    results: dict[str, dict] = {}
    if args.data_dir:
        results[str(args.data_dir)] = measure(args.data_dir, args.repeats, args.limit_shards)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for fmt in args.formats:
                write_folder(Path(tmp) / fmt, fmt, args.gigabytes, np.random.default_rng(0))
                results[fmt] = measure(Path(tmp) / fmt, args.repeats, None)
                print(fmt, results[fmt], flush=True)
    report = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
              "python": platform.python_version(), "results": results}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
