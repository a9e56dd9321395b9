"""Data preparation speed: sample creation per core, against the MLCommons algorithm, and packing.

`python benchmarks/data_prep_speed.py [--text_mb 4] [--reference_mb 1] [--text FILE --vocab vocab.txt]
[--json out.json]`

- samples: MB of text per second per core for one text part, this pipeline
  (data_prep.samples, one process, one tokenizer thread) and the token-by-token rendering of
  the MLCommons create_pretraining_data.py algorithm (data_prep.reference_algorithm:
  tokenise, make and mask instances, pad every feature list; the TFRecord serialisation of
  the reference is not counted, so the baseline is if anything flattered), side by side on
  the same input in one run; the two outputs are compared row for row (they must be equal).
  With --text/--vocab the side-by-side also runs on that file (e.g. a real part file and the
  MLPerf vocab.txt). Per core means per second of CPU time of the process, which stays
  meaningful on a shared machine; wall time is reported too.
- pool: the `samples` step over several parts with all cores (wall-clock MB/s).
- packing: sequences per second of planning + assigning (data_prep.packing) on lengths
  drawn from the published Wikipedia histogram, and of the whole `pack` step (read shards,
  plan, write packed shards) on the samples made here.
- shards: samples per second of the shuffled `reshard` and of `stratify`, and the bytes
  per sample of each format (for the disk estimates in data_prep/README.md).
Text is Python's documentation arranged as MLCommons documents (data_prep/corpus.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import tempfile
import time
from pathlib import Path


import numpy as np

from data_prep import reference_algorithm as ref
from data_prep.corpus import installed_sentences, make_documents, train_vocab, write_documents
from data_prep.fileio import Manifest
from mlperf_bert.data.shards import open_shard as open_h5
from mlperf_bert.runtime.files import output_file
from data_prep.pack import PackParams, pack_dataset, plan_packs
from data_prep.reshard import ReshardParams, reshard
from data_prep.samples import SampleJob, SampleParams, create_file_samples, create_samples
from data_prep.stratify import StratifyParams, stratify
from data_prep.vocab import load_vocab

ROOT = Path(__file__).resolve().parents[1]
os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread: per-core numbers

HISTOGRAM = ROOT / "pytorch" / "mlperf_bert" / "data" / "wikipedia_phase2_seqlen_histogram.json"


def write_part(path: Path, megabytes: float, seed: int) -> int:
    """A text part of about `megabytes` MB (documents of 2-40 consecutive sentences)."""
    sentences = installed_sentences()
    documents, size = [], 0
    while size < megabytes * 1e6:
        batch = make_documents(sentences, 50, seed + len(documents))
        documents += batch
        size += sum(len(s) + 1 for d in batch for s in d) + len(batch)
    return write_documents(path, documents)


def timed(fn) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) of fn()."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def bench_ours(part: Path, vocab: Path, out: Path, repeats: int = 3) -> dict:
    job = SampleJob(part, out / "part.hdf5", vocab, SampleParams())
    runs = [timed(lambda: create_file_samples(job)) for _ in range(repeats)]
    cpu, wall = min(r[0] for r in runs), min(r[1] for r in runs)
    mb = part.stat().st_size / 1e6
    return {"mb": mb, "cpu_s": cpu, "wall_s": wall, "mb_per_s_per_core": mb / cpu, "mb_per_s_wall": mb / wall}


def bench_reference(part: Path, vocab_path: Path) -> tuple[dict, list[dict]]:
    """(timings, the padded rows) of the plain-Python algorithm on `part`."""
    vocab = load_vocab(vocab_path)
    tokenizer = ref.ReferenceTokenizer(vocab)
    rows: list[dict] = []

    def run() -> None:
        instances = ref.create_instances(part, tokenizer, vocab)
        rows.extend(ref.padded_features(instance, tokenizer, 512, 76) for instance in instances)

    cpu, wall = timed(run)
    mb = part.stat().st_size / 1e6
    return {"mb": mb, "cpu_s": cpu, "wall_s": wall, "mb_per_s_per_core": mb / cpu, "mb_per_s_wall": mb / wall}, rows


def rows_equal(path: Path, rows: list[dict]) -> bool:
    with open_h5(path) as ours:
        return all(np.array_equal(ours[key][:].reshape(len(rows), -1), np.array([r[key] for r in rows]))
                   for key in rows[0])


def side_by_side(part: Path, vocab: Path, work: Path) -> dict:
    """Both implementations on one input, one after the other, and whether their outputs are equal."""
    ours = bench_ours(part, vocab, work)
    reference, rows = bench_reference(part, vocab)
    return {"input": part.name, "ours": ours, "reference": reference,
            "speedup_per_core": ours["mb_per_s_per_core"] / reference["mb_per_s_per_core"],
            "outputs_equal": rows_equal(work / "part.hdf5", rows)}


def bench_pool(parts: list[Path], vocab: Path, out: Path, workers: int) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu, wall = timed(lambda: create_samples(parts, out, vocab, SampleParams(), workers=workers))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    children = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    mb = sum(p.stat().st_size for p in parts) / 1e6
    return {"mb": mb, "workers": workers, "wall_s": wall, "cpu_s": cpu + children, "mb_per_s_wall": mb / wall,
            "mb_per_s_per_core": mb / (cpu + children)}


def bench_packing_plan(sequences: int) -> dict:
    counts = np.array(json.loads(HISTOGRAM.read_text())["counts"], dtype=np.float64)
    lengths = np.random.default_rng(0).choice(np.arange(1, 513), size=sequences, p=counts / counts.sum())
    results = {}
    for algorithm in ("spfhp", "lpfhp", "nnlshp"):
        params = PackParams(algorithm=algorithm, group_samples=sequences)
        start = time.perf_counter()
        table = plan_packs(lengths, np.array([sequences]), params, 512)
        seconds = time.perf_counter() - start
        results[algorithm] = {"sequences": sequences, "seconds": seconds, "sequences_per_s": sequences / seconds,
                              "efficiency": float(lengths.sum() / (table.shape[0] * 512)),
                              "sequences_per_pack": sequences / table.shape[0]}
    return results


def bench_reshard_and_stratify(parts: list[Path], out: Path) -> dict:
    """Samples per second of the shuffled reshard (fixed + varlength) and of stratify, plus bytes per sample."""
    dirs = {"fixed": out / "fixed", "varlength": out / "varlength"}
    total = sum(int(Manifest.load(parts[0].parent).files[p.name]["samples"]) for p in parts)
    _, reshard_wall = timed(lambda: reshard(parts, dirs, ReshardParams(num_shards=8, bucket_samples=total // 3)))
    shards = sorted(dirs["varlength"].glob("*.hdf5"))
    _, stratify_wall = timed(lambda: stratify(shards, out / "strata", StratifyParams(shards_per_stratum=2)))
    size = {fmt: sum(p.stat().st_size for p in d.glob("*.hdf5")) / total for fmt, d in dirs.items()}
    size["per_part_fixed"] = sum(p.stat().st_size for p in parts) / total
    return {"samples": total, "reshard_samples_per_s_wall": total / reshard_wall,
            "stratify_samples_per_s_wall": total / stratify_wall, "bytes_per_sample": size}


def bench_pack_step(shards: list[Path], out: Path) -> dict:
    cpu, wall = timed(lambda: pack_dataset(shards, out, PackParams(algorithm="lpfhp")))
    report = json.loads((out / "packing_report.json").read_text())
    return {"sequences": report["sequences"], "wall_s": wall, "cpu_s": cpu,
            "sequences_per_s_wall": report["sequences"] / wall, "efficiency": report["efficiency"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text_mb", type=float, default=4.0, help="size of the part this pipeline processes")
    parser.add_argument("--reference_mb", type=float, default=1.0, help="size of the part the reference processes")
    parser.add_argument("--pool_parts", type=int, default=4)
    parser.add_argument("--plan_sequences", type=int, default=2_000_000)
    parser.add_argument("--text", type=Path, help="also compare both implementations on this text file")
    parser.add_argument("--vocab", type=Path, help="vocab.txt for --text (the MLPerf one)")
    parser.add_argument("--samples_only", action="store_true", help="skip the packing and shard measurements")
    parser.add_argument("--json", type=output_file, help="also write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        vocab = train_vocab(installed_sentences(), work / "vocab.txt", vocab_size=8000)
        part = work / "part-00000-of-00001"
        write_part(part, args.text_mb, seed=0)
        small = work / "part-00001-of-00001"
        write_part(small, args.reference_mb, seed=1)
        results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                   "load_before": os.getloadavg(), "ours": bench_ours(part, vocab, work),
                   "side_by_side": side_by_side(small, vocab, work)}
        if args.text:
            results["side_by_side_text"] = side_by_side(args.text, args.vocab, work)
        pool_dir = work / "pool"
        pool_dir.mkdir()
        parts = [pool_dir / f"part-{i:05d}-of-{args.pool_parts:05d}" for i in range(args.pool_parts)]
        for i, path in enumerate(parts):
            write_part(path, args.text_mb / 2, seed=10 + i)
        results["pool"] = bench_pool(parts, vocab, work / "pool_out", os.cpu_count() or 1)
        if not args.samples_only:
            results["packing_plan"] = bench_packing_plan(args.plan_sequences)
            results["pack_step"] = bench_pack_step(sorted((work / "pool_out").glob("*.hdf5")), work / "packed")
            results["shards"] = bench_reshard_and_stratify(sorted((work / "pool_out").glob("*.hdf5")),
                                                           work / "shards")
        results["load_after"] = os.getloadavg()
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
