"""A tiny BERT with and without dropout, and random batches for it, that the delayed FP8 recipe's tests train."""

from __future__ import annotations

import dataclasses

import numpy as np

from mlperf_bert.data.batch import FlatBatch, Sample, flatten_items
from mlperf_bert.model.bert import BertConfig

TINY = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
NO_DROPOUT = dataclasses.replace(TINY, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def random_batch(seed: int, sequences: int, length: int, scale_ids: bool = False) -> FlatBatch:
    rng = np.random.default_rng(seed)
    items = [(Sample(rng.integers(1, 8 if scale_ids else TINY.vocab_size, length), (np.arange(length) >= length // 2),
                     np.sort(rng.choice(np.arange(1, length), 3, replace=False)), rng.integers(1, TINY.vocab_size, 3),
                     int(rng.integers(0, 2))),) for _ in range(sequences)]
    return flatten_items(items)
