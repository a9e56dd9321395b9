"""Times the packing algorithms on a length histogram and reports what they reach.

    PYTHONPATH=pytorch python benchmarks/packing_speed.py [--histogram FILE] [--repeats 5]

For every (algorithm, K) it prints the best wall time of `--repeats` runs of
pack_histogram, the efficiency (real tokens / (packs * 512)), sequences per pack and the
number of packs; then the time pack_index_table needs to map `--samples` sampled lengths
onto an NNLSHP plan of their histogram.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np

from data_prep import packing
from mlperf_bert.data.lengths import lengths_histogram, load_length_histogram

# (algorithm, K): the packed-shard K = 3, the published K = 12, unlimited.
CASES = tuple((a, k) for a in ("spfhp", "lpfhp") for k in (3, 12, None)) + (("nnlshp", 3),)


def best_time(run: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Best wall time in seconds over `repeats` calls, and the last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - start)
    return best, result


def report_algorithms(counts: np.ndarray, repeats: int) -> None:
    print(f"{'algorithm':<10}{'K':>6}{'seconds':>10}{'efficiency':>12}{'seq/pack':>10}{'packs':>11}")
    for algorithm, k in CASES:
        runs = 1 if algorithm == "nnlshp" else repeats
        seconds, plan = best_time(lambda: packing.pack_histogram(counts, algorithm, 512, k), runs)
        k_text = "inf" if k is None else str(k)
        print(
            f"{algorithm:<10}{k_text:>6}{seconds:>10.3f}{plan.efficiency:>12.5f}"
            f"{plan.sequences_per_pack:>10.4f}{plan.num_packs:>11,}"
        )


def report_assignment(counts: np.ndarray, samples: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(counts) / counts.sum()
    lengths = np.searchsorted(cdf, rng.random(samples), side="right") + 1
    plan = packing.pack_histogram(lengths_histogram(lengths), "nnlshp", 512, 3)
    seconds, table = best_time(lambda: packing.pack_index_table(lengths, plan, rng), 3)
    print(f"pack_index_table: {samples:,} samples -> {table.shape[0]:,} packs in {seconds:.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--histogram", default=None, help="JSON {'counts': [...]}; default: the Wikipedia histogram")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=1_000_000, help="lengths for the assignment timing")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    counts = load_length_histogram(args.histogram)
    report_algorithms(counts, args.repeats)
    report_assignment(counts, args.samples, args.seed)


if __name__ == "__main__":
    main()
