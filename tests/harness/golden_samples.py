"""What the unmodified MLCommons scripts wrote for golden_text.txt with the MLPerf vocab.txt
(data/reference_samples/; its README says how the files were made), as arrays per key."""

from __future__ import annotations

import io
import lzma

import numpy as np

from tests.harness.paths import REFERENCE_SAMPLES

KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels")


def golden_arrays(name: str) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(lzma.decompress((REFERENCE_SAMPLES / f"{name}.npz.xz").read_bytes()))) as arrays:
        return {key: arrays[key] for key in arrays.files}
