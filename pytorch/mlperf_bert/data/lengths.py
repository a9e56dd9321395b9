"""Histograms of sequence lengths: counts[i] = sequences of length i + 1 tokens.

The Wikipedia phase-2 histogram ships in the package data (data/wikipedia_phase2_seqlen_histogram.json).
The load-balancing simulations, the throughput benchmark, the FLOP model and the demo data
draw lengths from it; data_prep's packing plans work on histograms of the same form.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import numpy as np

_WIKIPEDIA_HISTOGRAM = "wikipedia_phase2_seqlen_histogram.json"


def validate_counts(counts: np.ndarray, max_sequence_length: int) -> np.ndarray:
    """`counts` as int64 after checking it is a histogram of `max_sequence_length` whole, non-negative counts."""
    counts = np.asarray(counts)
    if counts.ndim != 1 or counts.shape[0] != max_sequence_length:
        raise ValueError(
            f"counts must be a 1-D histogram of {max_sequence_length} entries "
            f"(counts[i] = sequences of length i+1), got shape {counts.shape}"
        )
    if not np.issubdtype(counts.dtype, np.integer) and not np.all(counts == np.round(counts)):
        raise ValueError("counts must be whole numbers of sequences")
    if (counts < 0).any():
        raise ValueError("counts must be non-negative")
    return counts.astype(np.int64)


def load_length_histogram(path: str | Path | None = None) -> np.ndarray:
    """Reads `{"counts": [...]}` (counts[i] = sequences of length i+1) from a JSON file.

    Without a path: the Wikipedia phase-2 histogram shipped in the package data.
    """
    if path is None:
        text = resources.files("mlperf_bert.data").joinpath(_WIKIPEDIA_HISTOGRAM).read_text()
        path = _WIKIPEDIA_HISTOGRAM
    else:
        text = Path(path).read_text()
    raw = json.loads(text)
    counts = raw.get("counts") if isinstance(raw, dict) else None
    if not isinstance(counts, list) or not counts:
        raise ValueError(f"{path}: expected a JSON object with a non-empty list 'counts' (sequences per length 1..L)")
    return validate_counts(np.array(counts), len(counts))


def lengths_histogram(lengths: np.ndarray, max_sequence_length: int = 512) -> np.ndarray:
    """[max_sequence_length] counts of `lengths` (counts[i] = sequences of length i+1)."""
    lengths = np.asarray(lengths)
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {lengths.shape}")
    if lengths.size and (lengths.min() < 1 or lengths.max() > max_sequence_length):
        raise ValueError(
            f"sequence lengths must lie in [1, {max_sequence_length}], "
            f"got [{lengths.min()}, {lengths.max()}]"
        )
    return np.bincount(lengths.astype(np.int64) - 1, minlength=max_sequence_length)
