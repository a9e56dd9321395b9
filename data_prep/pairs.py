"""Sentence pairs (A, B) for next-sentence prediction: the reference algorithm on token spans.

The MLCommons create_pretraining_data.py builds each instance from a document like this:
- a target length is drawn once per document: max_seq_length - 3, or with probability
  short_seq_prob a uniform integer in [2, max_seq_length - 3];
- consecutive sentences are gathered into a chunk until it holds >= target tokens or the
  document ends; A is the first a_end sentences of the chunk (a_end uniform in
  [1, sentences - 1], or 1 for a one-sentence chunk);
- B is the rest of the chunk, except when the chunk has one sentence or with probability 1/2:
  then B is read from a random other document of the same file, from a random sentence on,
  until it holds >= target - len(A) tokens, and the chunk's unused sentences are put back
  (the next chunk starts right after A);
- the pair is truncated to max_seq_length - 3 tokens by repeatedly dropping one token from
  the longer of A and B (B on ties), from its front or back with probability 1/2 each.

Here every sentence of a document is a contiguous range of the file's token array, so A and
B are (start, end) token offsets, chunk ends are one binary search over the document's
sentence offsets, and truncation is vectorised: how many tokens each side loses follows from
the two lengths, and how many of them come off the front is Binomial(lost, 1/2), the same
distribution as the reference's token-by-token coin flips.
"""

from __future__ import annotations

import random
from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

from data_prep.text import TokenizedText

# Columns of the [n, 5] span table.
A_START, A_END, B_START, B_END, IS_RANDOM = range(5)


@dataclass(frozen=True)
class PairParams:
    max_seq_length: int = 512
    short_seq_prob: float = 0.1

    @property
    def max_num_tokens(self) -> int:
        """Tokens of A + B: the sequence also holds [CLS] and two [SEP]."""
        return self.max_seq_length - 3


class PairMaker:
    """Makes the span rows of one file's documents; all randomness comes from `rng`."""

    def __init__(self, text: TokenizedText, params: PairParams, rng: random.Random):
        self.text = text
        self.params = params
        self.rng = rng
        self.doc_starts = text.document_starts.tolist()  # D+1 Python ints: documents are few
        self.sentence_starts = text.sentence_starts  # S+1 numpy: searched, never copied

    def _target_length(self) -> int:
        if self.rng.random() < self.params.short_seq_prob:
            return self._uniform(2, self.params.max_num_tokens)
        return self.params.max_num_tokens

    def _uniform(self, low: int, high: int) -> int:
        """Uniform integer in [low, high]; random() scaled is ~10x cheaper than randint()."""
        return low + int(self.rng.random() * (high - low + 1))

    def _random_b(self, doc: int, target_b: int) -> tuple[int, int]:
        """Token span of B read from a random other document (10 tries to avoid `doc`)."""
        num_docs = len(self.doc_starts) - 1
        for _ in range(10):
            other = self._uniform(0, num_docs - 1)
            if other != doc:
                break
        first, stop = self.doc_starts[other], self.doc_starts[other + 1]
        start = self._uniform(first, stop - 1)
        bounds = self.sentence_starts[start:stop + 1].tolist()
        # B ends with the first sentence that brings it to >= target_b tokens (at least one sentence).
        end = min(max(bisect_left(bounds, bounds[0] + target_b), 1), len(bounds) - 1)
        return bounds[0], bounds[end]

    def document(self, doc: int, out: list[int]) -> None:
        """Appends the spans (5 ints each, see the column names) of document `doc` to `out`."""
        first, stop = self.doc_starts[doc], self.doc_starts[doc + 1]
        bounds = self.sentence_starts[first:stop + 1].tolist()  # token offsets of its sentences
        n = stop - first
        target = self._target_length()
        i = 0
        while i < n:
            # Last sentence of the chunk: the first j with tokens(i..j) >= target, or the document end.
            j = min(bisect_left(bounds, bounds[i] + target, i + 1) - 1, n - 1)
            size = j - i + 1
            a_end = i + (self._uniform(1, size - 1) if size >= 2 else 1)
            if size == 1 or self.rng.random() < 0.5:
                b_start, b_end = self._random_b(doc, target - (bounds[a_end] - bounds[i]))
                out.extend((bounds[i], bounds[a_end], b_start, b_end, 1))
                i = a_end  # the chunk's unused sentences go back to the document
            else:
                out.extend((bounds[i], bounds[a_end], bounds[a_end], bounds[j + 1], 0))
                i = j + 1


def truncate_pairs(spans: np.ndarray, max_num_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """Shortens every pair to at most `max_num_tokens`, as the reference's truncate_seq_pair.

    The reference drops tokens one at a time from the longer side (B on ties). So with
    excess e and length gap d: if e <= d the longer side loses all e; otherwise both are
    first cut to the shorter length, and the remaining r = e - d alternate starting with B
    (B loses ceil(r/2), A floor(r/2)). Each side's losses come off the front Binomial(n, 1/2) times.
    """
    spans = spans.copy()
    la = spans[:, A_END] - spans[:, A_START]
    lb = spans[:, B_END] - spans[:, B_START]
    excess = np.maximum(la + lb - max_num_tokens, 0)
    gap, shorter = np.abs(la - lb), np.minimum(la, lb)
    alternating = excess - gap
    one_sided = alternating <= 0
    a_longer = la > lb
    cut_a = np.where(one_sided, np.where(a_longer, excess, 0), la - shorter + alternating // 2)
    cut_b = np.where(one_sided, np.where(a_longer, 0, excess), lb - shorter + (alternating + 1) // 2)
    for start, end, cut in ((A_START, A_END, cut_a), (B_START, B_END, cut_b)):
        front = rng.binomial(cut, 0.5)
        spans[:, start] += front
        spans[:, end] -= cut - front
    return spans
