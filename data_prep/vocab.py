"""The WordPiece vocabulary, the BERT-uncased tokenizer (`tokenizers`), and a fast line encoder.

The tokenizer is assembled from the `tokenizers` parts BertWordPieceTokenizer uses (BERT
normaliser: clean text, split CJK characters, strip accents, lower case; BERT
pre-tokeniser: whitespace and punctuation; WordPiece with at most 100 characters per word)
but without registering [CLS]/[SEP]/[MASK] as added tokens: the reference tokeniser
splits a literal "[MASK]" in the text into "[", "mask", "]", and so does this one.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from data_prep.formats import MAX_VOCAB_SIZE, DataPrepError
from mlperf_bert.shards import concat_ranges, offsets

if TYPE_CHECKING:  # imported where the tokenizer is built: `prep` extra only
    import tokenizers

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
MAX_CHARS_PER_WORD = 100  # longer words become [UNK], as in the reference tokeniser


@dataclass(frozen=True)
class Vocab:
    """vocab.txt: one token per line, the line number is the id."""

    path: str
    tokens: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.tokens)

    def id(self, token: str) -> int:
        return self.tokens.index(token)

    @property
    def cls_id(self) -> int:
        return self.id("[CLS]")

    @property
    def sep_id(self) -> int:
        return self.id("[SEP]")

    @property
    def mask_id(self) -> int:
        return self.id("[MASK]")


def load_vocab(path: Path | str) -> Vocab:
    """Reads and checks vocab.txt: UTF-8, no duplicates, the special tokens, int16-sized."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DataPrepError(
            f"{path}: cannot read the vocabulary ({err}); pass --vocab with the MLPerf vocab.txt") from err
    tokens = tuple(line.rstrip("\r\n") for line in text.splitlines())
    if not tokens:
        raise DataPrepError(f"{path}: the vocabulary is empty; pass --vocab with the MLPerf vocab.txt")
    missing = [t for t in SPECIAL_TOKENS if t not in tokens]
    if missing:
        raise DataPrepError(
            f"{path}: the vocabulary lacks {', '.join(missing)}; BERT needs {', '.join(SPECIAL_TOKENS)}")
    repeated = [t for t, n in Counter(tokens).items() if n > 1]
    if repeated:
        dup = repeated[0]
        raise DataPrepError(f"{path}: token {dup!r} appears twice; every line must hold a distinct token")
    if len(tokens) > MAX_VOCAB_SIZE:
        raise DataPrepError(f"{path}: {len(tokens)} tokens, but shards store ids as int16 (at most {MAX_VOCAB_SIZE})")
    return Vocab(str(path), tokens)


def make_tokenizer(vocab: Vocab) -> tokenizers.Tokenizer:
    """BERT-uncased WordPiece tokenizer over `vocab` that adds no special tokens."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordPiece

    model = WordPiece({t: i for i, t in enumerate(vocab.tokens)}, unk_token="[UNK]",
                      max_input_chars_per_word=MAX_CHARS_PER_WORD)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=True, lowercase=True
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tokenizer


# BERT's clean_text deletes control characters: 0x00-0x1f except tab, newline, carriage
# return, and 0x7f. (Python's split() would treat some of them as spaces.)
_ASCII_CONTROL = bytes(c for c in range(32) if chr(c) not in "\t\n\r") + b"\x7f"
# BERT's pre-tokeniser on ASCII: runs of non-space, non-punctuation characters, and every
# punctuation character (ASCII 33-47, 58-64, 91-96, 123-126) on its own.
_ASCII_WORD = re.compile(rb"[^\s!-/:-@\[-`{-~]+|[!-/:-@\[-`{-~]")


class LineEncoder:
    """Token ids of many lines at once, equal to `make_tokenizer(vocab)` line by line.

    Most Wikipedia lines are pure ASCII. For them BERT's normalisation and pre-tokenisation
    reduce to deleting control bytes, lower-casing and a regex split (all C loops), and each
    word's WordPiece ids come from a dict filled by batch-encoding the words not seen before
    with the Rust tokenizer. Lines with other characters (accents, CJK, Unicode punctuation)
    go through the Rust tokenizer whole. The cache is emptied when it holds
    `max_cached_words` words, which bounds its memory.
    """

    def __init__(self, tokenizer, max_cached_words: int = 1_000_000):
        self.tokenizer = tokenizer
        self.cache: dict[bytes, tuple[int, ...]] = {}
        self.max_cached_words = max_cached_words

    def _word_ids(self, words: list[bytes]) -> list[tuple[int, ...]]:
        distinct = set(words)
        missing = list(distinct.difference(self.cache))
        if len(self.cache) + len(missing) > self.max_cached_words:
            self.cache.clear()
            missing = list(distinct)
        if missing:
            encoded = self.tokenizer.encode_batch_fast([w.decode("ascii") for w in missing], add_special_tokens=False)
            self.cache.update(zip(missing, (tuple(e.ids) for e in encoded)))
        return list(map(self.cache.__getitem__, words))

    def _encode_ascii(self, lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
        text = "\n".join(lines).encode("ascii").translate(None, _ASCII_CONTROL).lower()
        words_per_line = [_ASCII_WORD.findall(line) for line in text.split(b"\n")]
        words = list(itertools.chain.from_iterable(words_per_line))
        pieces = self._word_ids(words)
        piece_lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
        word_counts = np.fromiter(map(len, words_per_line), dtype=np.int64, count=len(words_per_line))
        line_of_word = np.repeat(np.arange(len(lines)), word_counts)
        lengths = np.bincount(line_of_word, weights=piece_lengths, minlength=len(lines)).astype(np.int64)
        ids = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int32, count=int(piece_lengths.sum()))
        return ids, lengths

    def _encode_other(self, lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
        encoded = self.tokenizer.encode_batch_fast(lines, add_special_tokens=False)
        lengths = np.fromiter((len(e.ids) for e in encoded), dtype=np.int64, count=len(encoded))
        ids = itertools.chain.from_iterable(e.ids for e in encoded)
        return np.fromiter(ids, dtype=np.int32, count=int(lengths.sum())), lengths

    def encode(self, lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """([T] int32 ids of all lines concatenated, [n] int64 tokens per line)."""
        is_ascii = np.fromiter(map(str.isascii, lines), dtype=bool, count=len(lines))
        plain, other = np.flatnonzero(is_ascii), np.flatnonzero(~is_ascii)
        plain_ids, plain_lengths = self._encode_ascii([lines[i] for i in plain])
        other_ids, other_lengths = self._encode_other([lines[i] for i in other]) if other.size else (
            np.zeros(0, np.int32), np.zeros(0, np.int64))
        lengths = np.empty(len(lines), dtype=np.int64)
        lengths[plain], lengths[other] = plain_lengths, other_lengths
        source_start = np.empty(len(lines), dtype=np.int64)  # where each line's ids sit in [plain, other]
        source_start[plain] = offsets(plain_lengths)[:-1]
        source_start[other] = plain_ids.shape[0] + offsets(other_lengths)[:-1]
        ids = np.concatenate([plain_ids, other_ids])[concat_ranges(source_start, lengths)]
        return ids, lengths
