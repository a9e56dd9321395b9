"""Host-side cost of each load-balancing policy per training step, 8 ranks in one process.

    PYTHONPATH=pytorch python benchmarks/balance_cost.py [--local-batch 16 56] [--steps 2000]

For one node of 8 ranks it measures, per step:
  assign   balance.balance on the all-gathered [8, B] lengths: what every rank computes
           after the all-gather of the lengths (the collective itself is not included)
  build    the same plus building all 8 ranks' flat batches (batch.flatten_items) from the
           pooled samples: the host work a step needs with or without balancing
and the payload every rank receives when the samples themselves are all-gathered (int16
tokens and segment ids, int16 masked positions and labels, one label byte). With 8 ranks
a node is the whole job, so local_* and global_* policies do the same work here.
"""

from __future__ import annotations

import argparse
import time
from typing import Sequence

import numpy as np

from mlperf_bert import balance
from mlperf_bert.batch import Sample, flatten_items
from mlperf_bert.packing import load_length_histogram

RANKS = 8


def make_samples(lengths: np.ndarray, rng: np.random.Generator) -> list[Sample]:
    """Synthetic samples of the given lengths with 15% masked positions."""
    samples = []
    for n in lengths.tolist():
        masked = np.sort(rng.choice(np.arange(1, max(n, 2)), size=max(1, int(0.15 * n)), replace=n < 2))
        samples.append(
            Sample(
                input_ids=rng.integers(1000, 30000, size=n).astype(np.int16),
                segment_ids=(np.arange(n) >= n // 2).astype(np.int8),
                masked_lm_positions=masked.astype(np.int16),
                masked_lm_ids=rng.integers(1000, 30000, size=masked.shape[0]).astype(np.int16),
                next_sentence_label=int(rng.integers(0, 2)),
            )
        )
    return samples


def exchange_bytes(samples: Sequence[Sample]) -> int:
    """Bytes of all pooled samples: what each rank receives from an all-gather of them."""
    return sum(
        s.input_ids.nbytes + s.segment_ids.nbytes + s.masked_lm_positions.nbytes + s.masked_lm_ids.nbytes + 1
        for s in samples
    )


def time_policy(policy: str, steps_lengths: np.ndarray, pools: list[list[Sample]], build: bool) -> float:
    """Microseconds per step of the policy (and of building the batches when `build`)."""
    start = time.perf_counter()
    for lengths, pool in zip(steps_lengths, pools):
        assignment = balance.balance(lengths, policy, gpus_per_node=RANKS)
        if build:
            for rank_indices in assignment:
                flatten_items([(pool[i],) for i in rank_indices])
    return (time.perf_counter() - start) / steps_lengths.shape[0] * 1e6


def report(local_batch: int, steps: int, build_steps: int, seed: int) -> None:
    counts = load_length_histogram()
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(counts) / counts.sum()
    steps_lengths = np.searchsorted(cdf, rng.random((steps, RANKS, local_batch)), side="right") + 1
    pools = [make_samples(step.ravel(), rng) for step in steps_lengths[:build_steps]]
    payload = np.mean([exchange_bytes(pool) for pool in pools])
    print(f"local batch {local_batch}, {RANKS} ranks: all-gathered payload {payload / 1024:.0f} KiB per rank per step")
    print(f"{'policy':<16}{'assign us':>11}{'build us':>11}")
    for policy in balance.POLICIES:
        assign = time_policy(policy, steps_lengths, [[]] * steps, build=False)
        build = time_policy(policy, steps_lengths[:build_steps], pools, build=True)
        print(f"{policy:<16}{assign:>11.1f}{build:>11.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local-batch", type=int, nargs="+", default=[16, 56])
    parser.add_argument("--steps", type=int, default=2000, help="steps timed for the assignment alone")
    parser.add_argument("--build-steps", type=int, default=100, help="steps timed with batch building")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for local_batch in args.local_batch:
        report(local_batch, args.steps, args.build_steps, args.seed)


if __name__ == "__main__":
    main()
