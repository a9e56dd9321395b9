"""Useful floating-point work of BERT pretraining, counted per real sequence.

"Useful" means the work a perfect implementation could not avoid for the real data:

* matrix multiplies only (2 FLOP per multiply-add); embedding look-ups, LayerNorm, GELU,
  softmax, dropout, the loss and the optimizer are left out (together well under 1% of the
  total for BERT-Large);
* real tokens only: padding tokens, padded rows of a packed batch and the empty sequences
  of a static-shape batch do no useful work;
* attention of a sequence of s tokens over its own s tokens (s^2 per head), never over
  padding or over other sequences of a packed row;
* the masked-LM head at the masked positions only, over the real vocabulary (the rows that
  pad the embedding to a multiple of 8 are not useful).

Forward work of one sequence of s real tokens with m masked positions, for hidden size h,
L layers, intermediate size i and vocabulary V:

    encoder GEMMs   2 * s * L * (4*h*h + 2*h*i)   (Q, K, V, attention output; FFN in and out)
    attention       4 * L * s*s * h                (Q K^T and P V, all heads together)
    pooler + NSP    2 * (h*h + 2*h)                 (on the [CLS] token)
    masked-LM head  2 * m * (h*h + h*V)             (transform dense + tied decoder)

Training work = 3 x forward: the backward pass computes, for every GEMM, one product for
the input gradient and one for the weight gradient, each as large as the forward one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .bert import BertConfig

MASKED_LM_PROB = 0.15  # share of a sequence's maskable tokens that are predicted (MLPerf data)
SPECIAL_TOKENS = 3  # [CLS] and two [SEP]: never masked
BACKWARD_FACTOR = 3  # forward + backward = 3 x forward


@dataclass(frozen=True)
class ModelShape:
    """The sizes that set the FLOP count; `vocab_size` is the real (unpadded) vocabulary."""

    hidden: int
    layers: int
    intermediate: int
    vocab_size: int

    @classmethod
    def of(cls, cfg: BertConfig) -> "ModelShape":
        return cls(cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size)

    @property
    def encoder_flops_per_token(self) -> int:
        """Forward FLOP of the encoder's weight GEMMs for one token, all layers."""
        h, i = self.hidden, self.intermediate
        return 2 * self.layers * (4 * h * h + 2 * h * i)

    @property
    def mlm_flops_per_prediction(self) -> int:
        h = self.hidden
        return 2 * (h * h + h * self.vocab_size)

    @property
    def nsp_flops_per_sequence(self) -> int:
        h = self.hidden
        return 2 * (h * h + 2 * h)


def forward_flops(shape: ModelShape, seq_lens: np.ndarray, num_masked: np.ndarray) -> np.ndarray:
    """Useful forward FLOP of each sequence: [S] lengths and [S] masked counts -> [S] float64.

    float64 because BERT-Large is ~1.7e11 FLOP per sequence: exact integers up to 2^53.
    """
    s = np.asarray(seq_lens, dtype=np.float64)
    m = np.asarray(num_masked, dtype=np.float64)
    if s.shape != m.shape:
        raise ValueError(f"seq_lens {s.shape} and num_masked {m.shape} must have the same shape")
    attention = 4.0 * shape.layers * shape.hidden * s * s
    return (s * shape.encoder_flops_per_token + attention + shape.nsp_flops_per_sequence
            + m * shape.mlm_flops_per_prediction)


def training_flops(shape: ModelShape, seq_lens: np.ndarray, num_masked: np.ndarray) -> float:
    """Useful FLOP of one training step (forward + backward) over these sequences."""
    return float(BACKWARD_FACTOR * forward_flops(shape, seq_lens, num_masked).sum())


def masked_count(seq_lens: np.ndarray, max_predictions: int = 76, prob: float = MASKED_LM_PROB) -> np.ndarray:
    """Predictions per sequence as the MLPerf data has them: min(P, max(1, round(prob * (n - 3))))."""
    maskable = np.maximum(np.asarray(seq_lens) - SPECIAL_TOKENS, 0)
    return np.minimum(max_predictions, np.maximum(1, np.round(prob * maskable))).astype(np.int64)


def expected_training_flops(shape: ModelShape, counts: np.ndarray, max_predictions: int = 76) -> float:
    """Mean useful training FLOP per real sequence for a length histogram.

    `counts[i]` = sequences of length i + 1 (lengths.load_length_histogram's convention).
    """
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 1 or counts.sum() <= 0:
        raise ValueError("counts must be a 1-D histogram with at least one sequence")
    lengths = np.arange(1, counts.shape[0] + 1)
    per_length = BACKWARD_FACTOR * forward_flops(shape, lengths, masked_count(lengths, max_predictions))
    return float((per_length * counts).sum() / counts.sum())
