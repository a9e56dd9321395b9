"""Cost of the dataset integrity checks (`mlperf_bert.data.integrity`).

    python benchmarks/integrity_check.py quick --out /tmp/quick --json quick.json
    python benchmarks/integrity_check.py full --gigabytes 1 --json full.json [--baseline /tmp/base]

quick: the quick integrity check (`check_integrity`, `verify_dataset.py --quick`; the trainer's
start-up check up to 07588e5) on a folder shaped like NVIDIA's
`hdf5_4320_shards_varlength`: 4,320 varlength shards of 36,279 or 36,280 rows (156,726,829
sequences in all, REFERENCE.md), plus a 10,000-sample eval shard. Only the rows the check reads
(the first, the last and the middle `PROBE_ROWS`) hold data; the other rows of the chunked
variable-length datasets are never written, so the folder takes about 1 GB instead of ~160 GB
while every shard has the real row count, keys and layout. Reported: seconds for the whole
check (best of --repeats): wall and this process's CPU time (what it costs an idle core on a
shared machine), from the page cache when --out was written just before.

full: data_prep/verify_dataset.py's `verify_directory` on synthetic varlength shards of about
--gigabytes (MLPerf widths, Wikipedia lengths), with the integrity digests and an eval set, and
again with the digest step replaced by a no-op: the difference is what the full check adds.
With --baseline TREE (a checkout of the verification before the integrity checks existed:
`git worktree add /tmp/base 9866348`) the same folder is also verified by that tree's
`verify_directory`, in a child process with TREE first on its path, in turn with the others in
every repeat: the issue's yardstick is that verification's time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

from dataset_check import L, P, VOCAB, synthetic_samples, write_folder
from mlperf_bert.data.shards import STORAGE_DTYPES, folder_shards, to_varlength, write_samples
from mlperf_bert.runtime.files import output_file

MLPERF_SEQUENCES = 156_726_829
MLPERF_SHARDS = 4320
VLEN_CHUNK_ROWS = 1024


def shard_rows(total: int, shards: int) -> list[int]:
    return [total // shards + (i < total % shards) for i in range(shards)]


def write_sparse_shard(path: Path, rows: int, rng: np.random.Generator) -> None:
    """A varlength shard of `rows` rows whose probed rows hold real sequences, the rest unwritten."""
    from mlperf_bert.data.integrity import PROBE_ROWS
    start = max(0, (rows - PROBE_ROWS) // 2)
    written = np.unique(np.r_[0, rows - 1, np.arange(start, min(rows, start + PROBE_ROWS))])
    arrays = to_varlength(synthetic_samples(written.shape[0], rng))
    with h5py.File(path, "w") as handle:
        for key in ("input_ids", "segment_ids", "masked_lm_positions", "masked_lm_ids"):
            dataset = handle.create_dataset(key, shape=(rows,), dtype=h5py.vlen_dtype(STORAGE_DTYPES[key]),
                                            chunks=(VLEN_CHUNK_ROWS,))
            for i, row in zip(written, arrays[key]):
                dataset[i] = row
        labels = np.zeros(rows, STORAGE_DTYPES["next_sentence_labels"])
        labels[written] = arrays["next_sentence_labels"]
        handle.create_dataset("next_sentence_labels", data=labels)


def write_quick_folder(out: Path, shards: int, total: int, seed: int) -> tuple[Path, Path]:
    rng = np.random.default_rng(seed)
    train, evals = out / "train", out / "eval"
    train.mkdir(parents=True, exist_ok=True)
    evals.mkdir(exist_ok=True)
    for i, rows in enumerate(shard_rows(total, shards)):
        path = train / f"part_{i:05d}_of_{shards:05d}.hdf5"
        if not path.exists():
            write_sparse_shard(path, rows, rng)
    eval_shard = evals / "part_eval_10k.hdf5"
    if not eval_shard.exists():
        write_samples(eval_shard, synthetic_samples(10_000, rng), "varlength", L, P)
    return train, evals


def best_times(run, repeats: int) -> tuple[float, float]:
    """(wall, CPU) seconds of the fastest of `repeats` calls; on a shared machine the CPU time of
    this process is what the call costs an idle core (page-cache reads count as system time)."""
    best = (float("inf"), float("inf"))
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        best = min(best, (time.perf_counter() - wall, time.process_time() - cpu))
    return round(best[0], 3), round(best[1], 3)


def quick(args: argparse.Namespace) -> dict:
    # Imported here, as in `full`: the `verify` child runs this file against a tree without them.
    from mlperf_bert.data.integrity import PROBE_ROWS, check_integrity

    train, evals = write_quick_folder(args.out, args.shards, args.sequences, args.seed)
    shards = folder_shards(train)
    rows = sum(int(h5py.File(p, "r")["next_sentence_labels"].shape[0]) for p in shards[:3])
    wall, cpu = best_times(lambda: check_integrity(shards, evals, 10_000), args.repeats)
    return {"shards": len(shards), "rows_first_3_shards": rows, "rows_total": args.sequences,
            "probe_rows": PROBE_ROWS, "wall_seconds": wall, "cpu_seconds": cpu,
            "load_average_1min": round(os.getloadavg()[0], 2)}


def verify_times(folder: Path, eval_folder: Path | None, repeats: int) -> tuple[float, float]:
    """(wall, CPU) of the verification importable here (`verify_directory`; with the eval set when given)."""
    from data_prep import verify_dataset

    limits = verify_dataset.Limits(L, P, VOCAB)
    extra = (verify_dataset.EvalSets.read([eval_folder]),) if eval_folder else ()

    def verify() -> None:
        problems, _ = verify_dataset.verify_directory(folder, limits, False, None, 1, *extra)
        assert not problems, problems[:3]

    return best_times(verify, repeats)


def baseline_times(tree: Path, folder: Path) -> tuple[float, float]:
    """`verify_times` of another checkout's verification (no eval set), timed in a child process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "pytorch"), str(tree)])}
    done = subprocess.run([sys.executable, __file__, "verify", "--folder", str(folder), "--expect_tree", str(tree)],
                          env=env, capture_output=True, text=True, check=True)
    wall, cpu = json.loads(done.stdout.splitlines()[-1])
    return wall, cpu


def full(args: argparse.Namespace) -> dict:
    from mlperf_bert.data import integrity
    from data_prep import verify_dataset

    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        folder, evals = Path(tmp) / "train", Path(tmp) / "eval"
        folder.mkdir()
        evals.mkdir()
        write_folder(folder, "varlength", args.gigabytes, rng)
        write_samples(evals / "part_eval_10k.hdf5", synthetic_samples(10_000, rng), "varlength", L, P)
        size = sum(p.stat().st_size for p in folder_shards(folder))
        runs: dict[str, list[tuple[float, float]]] = {"with": [], "without": [], "baseline": []}
        add, judge = integrity.ShardDigest.add, verify_dataset._integrity_problems
        for _ in range(args.repeats):  # in turn, so a change of the machine's load hits every variant alike
            runs["with"].append(verify_times(folder, evals, 1))
            integrity.ShardDigest.add = lambda self, samples, rows, eval_set: None  # type: ignore[method-assign]
            verify_dataset._integrity_problems = lambda directory, reports, names: []
            try:
                runs["without"].append(verify_times(folder, evals, 1))
            finally:
                integrity.ShardDigest.add, verify_dataset._integrity_problems = add, judge  # type: ignore[method-assign]
            if args.baseline:
                runs["baseline"].append(baseline_times(args.baseline, folder))
    best = {name: min(times) for name, times in runs.items() if times}
    result = {"bytes": size, "wall_cpu_seconds_with_integrity": best["with"],
              "wall_cpu_seconds_without": best["without"],
              "cpu_added_percent": round(100 * (best["with"][1] / best["without"][1] - 1), 1),
              "load_average_1min": round(os.getloadavg()[0], 2)}
    if "baseline" in best:
        result.update({"baseline_tree": str(args.baseline), "wall_cpu_seconds_baseline": best["baseline"],
                       "cpu_vs_baseline_percent": round(100 * (best["with"][1] / best["baseline"][1] - 1), 1)})
    return result


def verify_only(args: argparse.Namespace) -> None:
    """The child of `baseline_times`: prints [wall, CPU] of one verification of --folder."""
    from data_prep import verify_dataset

    where = Path(verify_dataset.__file__).resolve()
    if args.expect_tree and args.expect_tree.resolve() not in where.parents:
        raise SystemExit(f"imported {where}, not the verification of {args.expect_tree}")
    print(json.dumps(verify_times(args.folder, None, 1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("quick", "full", "verify"), help="verify: internal, see --baseline")
    parser.add_argument("--out", type=Path, help="quick: folder for the generated set (kept, reused)")
    parser.add_argument("--shards", type=int, default=MLPERF_SHARDS)
    parser.add_argument("--sequences", type=int, default=MLPERF_SEQUENCES)
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=output_file)
    parser.add_argument("--baseline", type=Path, help="full: also time this checkout's verification (see above)")
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--expect_tree", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode == "verify":
        verify_only(args)
        return
    if args.mode == "quick" and args.out is None:
        parser.error("quick needs --out")
    result = {"mode": args.mode, "date": datetime.date.today().isoformat(), "python": platform.python_version(),
              "machine": platform.processor() or platform.machine(),
              **(quick(args) if args.mode == "quick" else full(args))}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
