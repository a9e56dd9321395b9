"""Synthetic MLPerf-like work: sequences of the Wikipedia phase-2 lengths, masked as the MLPerf data
is, dealt into packed rows of an NNLSHP plan. The throughput benchmark times it; the numerics check
runs it through each precision against an fp64 reference.
"""

from __future__ import annotations

import numpy as np

from data_prep import packing
from mlperf_bert.data.batch import Sample
from mlperf_bert.data.lengths import load_length_histogram
import mlperf_bert.model.flops as flops

CLS, SEP, MASK, FIRST_TOKEN = 1, 2, 3, 4  # synthetic vocabulary: three special ids, then words
MIN_LENGTH = 5  # [CLS] A [SEP] B [SEP] with one token in A and in B
SEQS_PER_ROW = 3  # K of the packed shards


def length_histogram(max_seq_length: int) -> np.ndarray:
    """The Wikipedia histogram, lengths rescaled to max_seq_length (l -> round(l * max / 512))."""
    counts = load_length_histogram()
    if max_seq_length == counts.shape[0]:
        return counts
    scaled = np.floor(np.arange(1, counts.shape[0] + 1) * max_seq_length / counts.shape[0] + 0.5).astype(np.int64)
    scaled = np.clip(scaled, MIN_LENGTH, max_seq_length)
    return np.bincount(scaled - 1, weights=counts, minlength=max_seq_length).astype(np.int64)


def row_strategies(max_seq_length: int) -> tuple[tuple[packing.Strategy, ...], np.ndarray]:
    """Row contents of an NNLSHP plan of the histogram and the probability of each."""
    plan = packing.pack_histogram(length_histogram(max_seq_length), "nnlshp", max_seq_length, SEQS_PER_ROW)
    return plan.strategies, plan.repeats / plan.repeats.sum()


def synthetic_sample(rng: np.random.Generator, n: int, vocab_size: int, max_predictions: int) -> Sample:
    """[CLS] A [SEP] B [SEP] of n random tokens, masked as the MLPerf data is."""
    len_a = int(rng.integers(1, n - 3))  # A and B at least one token each
    ids = rng.integers(FIRST_TOKEN, vocab_size, n)
    ids[[0, len_a + 1, n - 1]] = (CLS, SEP, SEP)
    candidates = np.concatenate([np.arange(1, len_a + 1), np.arange(len_a + 2, n - 1)])
    k = int(flops.masked_count(np.array([n]), max_predictions)[0])
    positions = np.sort(rng.choice(candidates, size=k, replace=False))
    labels = ids[positions].copy()
    ids[positions] = MASK
    segments = (np.arange(n) > len_a + 1).astype(np.int64)
    return Sample(ids, segments, positions, labels, int(rng.integers(0, 2)))
