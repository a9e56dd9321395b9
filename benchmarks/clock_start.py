"""What a run reads before MLPerf's clock starts, before and after the verification record.

    python benchmarks/clock_start.py demo --data demo_data --json demo.json
    python benchmarks/clock_start.py mlperf --out /tmp/q4320 --json mlperf.json

Before (the trainer up to 07588e5): before `run_start` every rank checked the rows of every W-th
training shard (`validate.check_dataset`), rank 0 ran the quick integrity check
(`integrity.check_integrity`) and every rank loaded its eval share onto the device
(`dataset.load_eval_set`); the shards' row counts came from hdf5 metadata when the stream opened.
After: before `run_start` the trainer reads `VERIFIED.json` of both folders and `stat`s their files
(`input.data_check`); after it, the stream takes its row counts from the record.

demo: both on a folder of `data_prep/make_demo_data.py` (train/ and eval/, verified), in this
process, one rank, best of --repeats (wall and CPU seconds).
mlperf: the new check on a folder shaped like NVIDIA's `hdf5_4320_shards_varlength` (4,320 shards
of 36,279 or 36,280 rows, written sparse by `integrity_check.py`, about 1 GB), with a record made
from the files' metadata; and the row counts read from 4,320 shards' metadata against the record.
The old check's row reading on the real ~160 GB set is not run here: docs/PERFORMANCE.md, "Start-up
check of the training data", gives it per GB.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable

from mlperf_bert.data.dataset import DataLimits, load_eval_set
from mlperf_bert.data.integrity import check_integrity
from mlperf_bert.data.record import RECORD_NAME, FileEntry, Record, read_record, record_json, stale_problems
from mlperf_bert.data.shards import folder_shards, shard_info
from mlperf_bert.data.validate import check_dataset
from mlperf_bert.runtime.files import output_file


def best(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(wall, CPU) seconds of the fastest of `repeats` calls."""
    times = []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return min(times)


def current_record(folder: Path) -> Record:
    record = read_record(folder)
    assert record is not None and not stale_problems(record), f"{folder}: verify it first"
    return record


def demo(args: argparse.Namespace) -> dict:
    train, evals = args.data / "train", args.data / "eval"
    bert = json.loads((args.data / "bert_config.json").read_text())
    record = current_record(evals)
    limits = DataLimits(record.longest, record.most_predictions, bert["vocab_size"])

    shards = check_dataset(train, limits)
    return {
        # before run_start up to 07588e5; now data_prep's verification, outside the timed process:
        "row_and_integrity_checks_s": best(lambda: check_integrity(check_dataset(train, limits), evals,
                                                                   record.sequences), args.repeats),
        # before run_start up to 07588e5; now after it, on a background thread beside the first block:
        "eval_load_s": best(lambda: load_eval_set(evals, record.sequences, 0, 1, limits), args.repeats),
        # when the stream opens: hdf5 metadata up to 07588e5; now the record's counts
        "row_counts_from_shards_s": best(lambda: [shard_info(path) for path in shards], args.repeats),
        # what a run now reads before run_start: both records, and a stat of every file
        "records_checked_s": best(lambda: (current_record(train), current_record(evals)), args.repeats),
    }


def make_record(folder: Path) -> None:
    """A record from the files' metadata alone: for timing the check, not a verification."""
    files = {}
    for path in folder_shards(folder):
        st = path.stat()
        files[path.relative_to(folder).as_posix()] = FileEntry(st.st_size, st.st_mtime_ns, "", shard_info(path)[1], 0)
    record = Record(folder, True, "train", "varlength", files, 0, 0, 0, 0, None, "", ())
    (folder / RECORD_NAME).write_text(record_json(record, "metadata only (benchmark)", {}, "benchmark"))


def mlperf(args: argparse.Namespace) -> dict:
    train = args.out / "train"
    if not train.is_dir():
        sys.exit(f"{train}: write the sparse 4,320-shard set first: "
                 f"python benchmarks/integrity_check.py quick --out {args.out}")
    if not (train / RECORD_NAME).is_file():
        make_record(train)
    shards = folder_shards(train)
    return {"shards": len(shards),
            "record_check_s": best(lambda: current_record(train), args.repeats),
            "rows_from_metadata_s": best(lambda: [shard_info(p) for p in shards], args.repeats),
            "rows_from_record_s": best(lambda: current_record(train).files, args.repeats)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("demo", "mlperf"))
    parser.add_argument("--data", type=Path, default=Path("demo_data"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/q4320"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=output_file)
    args = parser.parse_args(argv)
    result = {"mode": args.mode, "date": datetime.date.today().isoformat(), "machine": platform.processor()
              or platform.machine(), "cpus": os.cpu_count(), **(demo(args) if args.mode == "demo" else mlperf(args))}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
