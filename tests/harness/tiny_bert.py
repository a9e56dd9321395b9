"""A tiny BERT and random packed rows for it: the fast path's tests and the graphed-step ranks train it."""

from __future__ import annotations

import numpy as np
import torch

from mlperf_bert.data.batch import Item, Sample
from mlperf_bert.model.bert import BertConfig, BertForPreTraining

ROW_LEN, MAX_SEQS, MAX_PREDICTIONS = 24, 3, 9
TINY = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=32)


def make_sample(rng: np.random.Generator, n: int) -> Sample:
    k = int(rng.integers(1, min(3, n - 1) + 1))
    return Sample(
        input_ids=rng.integers(4, TINY.vocab_size, n),
        segment_ids=(np.arange(n) >= n // 2).astype(np.int64),
        masked_lm_positions=np.sort(rng.choice(np.arange(1, n), size=k, replace=False)),
        masked_lm_ids=rng.integers(4, TINY.vocab_size, k),
        next_sentence_label=int(rng.integers(0, 2)),
    )


def make_rows(rng: np.random.Generator, lengths: list[tuple[int, ...]]) -> list[Item]:
    return [tuple(make_sample(rng, n) for n in row) for row in lengths]


# A full row (no tail), a row with a tail, a single sequence, three sequences with a tail.
ROWS = [(10, 8, 6), (12, 5), (20,), (4, 4, 5)]


def tiny_model(seed: int = 0) -> BertForPreTraining:
    torch.manual_seed(seed)
    return BertForPreTraining(TINY)
