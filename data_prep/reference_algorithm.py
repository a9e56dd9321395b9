"""A plain-Python, token-by-token rendering of the MLCommons sample creation algorithm.

It is the baseline the fast pipeline is measured against (benchmarks/data_prep_speed.py)
and the independent implementation the tests compare its statistics and tokenisation with.
It works the way create_pretraining_data.py does: Python strings per token, one random
draw per decision from a single `random.Random`, the whole file's documents and instances
held in lists, instances shuffled at the end. The description of the algorithm is in
data_prep/pairs.py and data_prep/masking.py.
"""

from __future__ import annotations

import random
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlperf_bert.shards import Samples
from data_prep.vocab import MAX_CHARS_PER_WORD, Vocab


class ReferenceTokenizer:
    """BERT-uncased basic tokenisation + greedy longest-match-first WordPiece, in Python."""

    def __init__(self, vocab: Vocab):
        self.vocab = {token: i for i, token in enumerate(vocab.tokens)}

    @staticmethod
    def _char_kind(ch: str) -> str:
        if ch in " \t\n\r" or unicodedata.category(ch) == "Zs":
            return "space"
        if ch == "\x00" or ch == "\ufffd" or unicodedata.category(ch).startswith("C"):
            return "drop"
        code = ord(ch)
        if 33 <= code <= 47 or 58 <= code <= 64 or 91 <= code <= 96 or 123 <= code <= 126 or \
                unicodedata.category(ch).startswith("P"):
            return "punct"
        if 0x4E00 <= code <= 0x9FFF or 0x3400 <= code <= 0x4DBF or 0x20000 <= code <= 0x2A6DF or \
                0x2A700 <= code <= 0x2CEAF or 0xF900 <= code <= 0xFAFF or 0x2F800 <= code <= 0x2FA1F:
            return "cjk"
        return "char"

    def _words(self, line: str) -> list[str]:
        """Cleaned, lower-cased, accent-stripped words, punctuation and CJK characters on their own."""
        words: list[str] = []
        current: list[str] = []
        for ch in line:
            kind = self._char_kind(ch)
            if kind in ("space", "punct", "cjk") and current:
                words.append("".join(current))
                current = []
            if kind in ("punct", "cjk"):
                words.append(ch)
            elif kind == "char":
                current.append(ch)
        if current:
            words.append("".join(current))
        out = []
        for word in words:
            stripped = "".join(c for c in unicodedata.normalize("NFD", word.lower()) if unicodedata.category(c) != "Mn")
            out.extend(self._split_punctuation(stripped))
        return out

    def _split_punctuation(self, word: str) -> list[str]:
        """Accent stripping can expose punctuation; split it off again."""
        pieces, current = [], ""
        for ch in word:
            if self._char_kind(ch) == "punct":
                pieces += ([current] if current else []) + [ch]
                current = ""
            else:
                current += ch
        return pieces + ([current] if current else [])

    def _wordpiece(self, word: str) -> list[str]:
        if len(word) > MAX_CHARS_PER_WORD:
            return ["[UNK]"]
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    break
                end -= 1
            if end == start:
                return ["[UNK]"]
            pieces.append(piece)
            start = end
        return pieces

    def tokenize(self, line: str) -> list[str]:
        return [piece for word in self._words(line) for piece in self._wordpiece(word)]

    def ids(self, tokens: list[str]) -> list[int]:
        return [self.vocab[t] for t in tokens]


@dataclass
class Instance:
    tokens: list[str]
    segment_ids: list[int]
    is_random_next: bool
    masked_lm_positions: list[int]
    masked_lm_labels: list[str]


def read_documents(path: Path, tokenizer: ReferenceTokenizer) -> list[list[list[str]]]:
    """Documents as lists of tokenised sentences; blank lines separate documents."""
    documents: list[list[list[str]]] = [[]]
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                documents.append([])
                continue
            tokens = tokenizer.tokenize(line)
            if tokens:
                documents[-1].append(tokens)
    return [d for d in documents if d]


def _truncate(first: list[str], second: list[str], limit: int, rng: random.Random) -> None:
    while len(first) + len(second) > limit:
        longer = first if len(first) > len(second) else second
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def _mask(tokens: list[str], prob: float, max_predictions: int, words: list[str],
          rng: random.Random) -> tuple[list[str], list[int], list[str]]:
    """(masked tokens, positions, original tokens at them), one draw per decision."""
    candidates = [i for i, t in enumerate(tokens) if t not in ("[CLS]", "[SEP]")]
    rng.shuffle(candidates)
    count = min(max_predictions, max(1, int(round(len(tokens) * prob))))
    output, picked = list(tokens), sorted(candidates[:count])
    for index in picked:
        if rng.random() < 0.8:
            output[index] = "[MASK]"
        elif rng.random() >= 0.5:
            output[index] = words[rng.randint(0, len(words) - 1)]
    return output, picked, [tokens[i] for i in picked]


def _random_b(documents: list, doc: int, target_b: int, rng: random.Random) -> list[str]:
    for _ in range(10):
        other = rng.randint(0, len(documents) - 1)
        if other != doc:
            break
    sentences = documents[other]
    b: list[str] = []
    for sentence in sentences[rng.randint(0, len(sentences) - 1):]:
        b.extend(sentence)
        if len(b) >= target_b:
            break
    return b


def document_instances(documents: list, doc: int, max_seq_length: int, short_seq_prob: float, masked_lm_prob: float,
                       max_predictions: int, words: list[str], rng: random.Random) -> list[Instance]:
    """The pairs of one document, token lists built and truncated one token at a time."""
    sentences, limit = documents[doc], max_seq_length - 3
    target = rng.randint(2, limit) if rng.random() < short_seq_prob else limit
    instances, chunk, size, i = [], [], 0, 0
    while i < len(sentences):
        chunk.append(sentences[i])
        size += len(sentences[i])
        if i == len(sentences) - 1 or size >= target:
            a_count = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            a = [t for s in chunk[:a_count] for t in s]
            is_random = len(chunk) == 1 or rng.random() < 0.5
            if is_random:
                b = _random_b(documents, doc, target - len(a), rng)
                i -= len(chunk) - a_count
            else:
                b = [t for s in chunk[a_count:] for t in s]
            _truncate(a, b, limit, rng)
            tokens = ["[CLS]"] + a + ["[SEP]"] + b + ["[SEP]"]
            segments = [0] * (len(a) + 2) + [1] * (len(b) + 1)
            masked, positions, labels = _mask(tokens, masked_lm_prob, max_predictions, words, rng)
            instances.append(Instance(masked, segments, is_random, positions, labels))
            chunk, size = [], 0
        i += 1
    return instances


def create_instances(path: Path, tokenizer: ReferenceTokenizer, vocab: Vocab, seed: int = 12345, dupe_factor: int = 10,
                     max_seq_length: int = 512, max_predictions: int = 76, masked_lm_prob: float = 0.15,
                     short_seq_prob: float = 0.1) -> list[Instance]:
    """All instances of one text file, shuffled, as create_pretraining_data.py makes them."""
    rng = random.Random(seed)
    documents = read_documents(path, tokenizer)
    rng.shuffle(documents)
    words = list(vocab.tokens)
    instances = []
    for _ in range(dupe_factor):
        for doc in range(len(documents)):
            instances += document_instances(documents, doc, max_seq_length, short_seq_prob, masked_lm_prob,
                                            max_predictions, words, rng)
    rng.shuffle(instances)
    return instances


def padded_features(instance: Instance, tokenizer: ReferenceTokenizer, max_seq_length: int,
                    max_predictions: int) -> dict[str, list[int]]:
    """The padded integer lists the reference writes for one instance (its per-token output step)."""
    ids = tokenizer.ids(instance.tokens)
    pad = max_seq_length - len(ids)
    missing = max_predictions - len(instance.masked_lm_positions)
    return {
        "input_ids": ids + [0] * pad, "input_mask": [1] * len(ids) + [0] * pad,
        "segment_ids": instance.segment_ids + [0] * pad,
        "masked_lm_positions": instance.masked_lm_positions + [0] * missing,
        "masked_lm_ids": tokenizer.ids(instance.masked_lm_labels) + [0] * missing,
        "next_sentence_labels": [int(instance.is_random_next)],
    }


def to_samples(instances: list[Instance], tokenizer: ReferenceTokenizer) -> Samples:
    """The instances as Samples, for comparing statistics with the fast pipeline."""
    return Samples(
        input_ids=np.array([i for x in instances for i in tokenizer.ids(x.tokens)], np.int32),
        segment_ids=np.array([s for x in instances for s in x.segment_ids], np.int8),
        lengths=np.array([len(x.tokens) for x in instances], np.int64),
        masked_lm_positions=np.array([p for x in instances for p in x.masked_lm_positions], np.int32),
        masked_lm_ids=np.array([i for x in instances for i in tokenizer.ids(x.masked_lm_labels)], np.int32),
        num_predictions=np.array([len(x.masked_lm_positions) for x in instances], np.int64),
        next_sentence_labels=np.array([int(x.is_random_next) for x in instances], np.int8),
    )
