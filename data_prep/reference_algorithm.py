"""A plain-Python, token-by-token rendering of the MLCommons sample creation algorithm.

It is the baseline the compiled pipeline is measured against (benchmarks/data_prep_speed.py)
and a second implementation the tests hold against the reference's golden outputs.
It works the way create_pretraining_data.py does: Python strings per token, one random
draw per decision from a single `random.Random`, the whole file's documents and instances
held in lists, instances shuffled at the end. The description of the algorithm is in
data_prep/instances.py.
"""

from __future__ import annotations

import random
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlperf_bert.data.shards import Samples
from data_prep.vocab import MAX_CHARS_PER_WORD, Vocab


class ReferenceTokenizer:
    """BERT's FullTokenizer(do_lower_case=True), character by character, in plain Python."""

    def __init__(self, vocab: Vocab):
        self.vocab = {token: i for i, token in enumerate(vocab.tokens)}

    @staticmethod
    def _is_whitespace(ch: str) -> bool:
        return ch in " \t\n\r" or unicodedata.category(ch) == "Zs"

    @staticmethod
    def _is_control(ch: str) -> bool:
        return ch not in "\t\n\r" and unicodedata.category(ch) in ("Cc", "Cf")

    @staticmethod
    def _is_punctuation(ch: str) -> bool:
        code = ord(ch)
        return 33 <= code <= 47 or 58 <= code <= 64 or 91 <= code <= 96 or 123 <= code <= 126 or \
            unicodedata.category(ch).startswith("P")

    @staticmethod
    def _is_cjk(code: int) -> bool:
        return 0x4E00 <= code <= 0x9FFF or 0x3400 <= code <= 0x4DBF or 0x20000 <= code <= 0x2A6DF or \
            0x2A700 <= code <= 0x2CEAF or 0xF900 <= code <= 0xFAFF or 0x2F800 <= code <= 0x2FA1F

    def _clean(self, line: str) -> str:
        out = []
        for ch in line:
            if ord(ch) in (0, 0xFFFD) or self._is_control(ch):
                continue
            out.append(" " if self._is_whitespace(ch) else f" {ch} " if self._is_cjk(ord(ch)) else ch)
        return "".join(out)

    def _split_punctuation(self, word: str) -> list[str]:
        pieces, current = [], ""
        for ch in word:
            if self._is_punctuation(ch):
                pieces += ([current] if current else []) + [ch]
                current = ""
            else:
                current += ch
        return pieces + ([current] if current else [])

    def _words(self, line: str) -> list[str]:
        """Basic tokenisation: clean, split on str.split(), lower, strip accents, split punctuation."""
        pieces = []
        for word in self._clean(line).split():
            stripped = "".join(c for c in unicodedata.normalize("NFD", word.lower()) if unicodedata.category(c) != "Mn")
            pieces.extend(self._split_punctuation(stripped))
        return " ".join(pieces).split()

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
    with open(path, encoding="utf-8", newline="\n") as handle:  # lines end at "\n" only
        for line in handle:
            line = line.replace("\r", "").strip()
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
    """(masked tokens, positions, original tokens at them), decisions drawn in the shuffled order."""
    candidates = [i for i, t in enumerate(tokens) if t not in ("[CLS]", "[SEP]")]
    rng.shuffle(candidates)
    count = min(max_predictions, max(1, int(round(len(tokens) * prob))))
    output = list(tokens)
    for index in candidates[:count]:
        if rng.random() < 0.8:
            output[index] = "[MASK]"
        elif rng.random() >= 0.5:
            output[index] = words[rng.randint(0, len(words) - 1)]
    picked = sorted(candidates[:count])
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
    """The instances as Samples (ragged), in their order."""
    return Samples(
        input_ids=np.array([i for x in instances for i in tokenizer.ids(x.tokens)], np.int32),
        segment_ids=np.array([s for x in instances for s in x.segment_ids], np.int8),
        lengths=np.array([len(x.tokens) for x in instances], np.int64),
        masked_lm_positions=np.array([p for x in instances for p in x.masked_lm_positions], np.int32),
        masked_lm_ids=np.array([i for x in instances for i in tokenizer.ids(x.masked_lm_labels)], np.int32),
        num_predictions=np.array([len(x.masked_lm_positions) for x in instances], np.int64),
        next_sentence_labels=np.array([int(x.is_random_next) for x in instances], np.int8),
    )
