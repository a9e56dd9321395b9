"""The WordPiece vocabulary and a line encoder equal to the reference `FullTokenizer`.

The MLCommons reference tokenises with BERT's `FullTokenizer(do_lower_case=True)`: delete
control and format characters (categories Cc, Cf, plus U+0000 and U+FFFD; tab, newline and
carriage return are spaces), turn Zs spaces into " ", put spaces around CJK ideographs,
split on Python's `str.split()` (so U+2028/U+2029 also separate words), then per word:
Python `str.lower()` (with Greek final sigma), NFD, drop combining marks (Mn), split off
punctuation (ASCII symbols and categories P*), and greedy longest-match-first WordPiece
with at most 200 characters per word ([UNK] for longer or unmatchable words).

`LineEncoder` gives exactly those ids. Pure-ASCII lines (most of Wikipedia) take a fast
path where the rules above reduce to deleting control bytes, lower-casing and a regex
split, and WordPiece comes from the Rust `tokenizers` model, whose greedy matching on
ASCII words is the reference's. Every other line goes through `ExactTokenizer`, a
word-cached Python rendering of the reference rules, because the Rust BERT normaliser
differs from them outside ASCII (final sigma, private-use characters, U+2028).
[CLS]/[SEP]/[MASK] are never added tokens: a literal "[MASK]" in the text is "[", "mask", "]".
"""

from __future__ import annotations

import itertools
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from data_prep.formats import MAX_VOCAB_SIZE, DataPrepError
from mlperf_bert.data.shards import concat_ranges, offsets

if TYPE_CHECKING:  # imported where the tokenizer is built: `prep` extra only
    import tokenizers

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
MAX_CHARS_PER_WORD = 200  # longer words become [UNK], as in the reference WordpieceTokenizer


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
    """Rust WordPiece over `vocab` (BERT normaliser and pre-tokeniser), adding no special tokens.

    Equal to the reference only on pure-ASCII text; LineEncoder uses it for ASCII words.
    """
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
_ASCII_PIECE = re.compile(_ASCII_WORD.pattern.decode())


# CJK Unified Ideographs blocks the reference puts spaces around (_is_chinese_char).
_CJK = re.compile("[\u4e00-\u9fff\u3400-\u4dbf\U00020000-\U0002a6df\U0002a700-\U0002b73f"
                  "\U0002b740-\U0002b81f\U0002b820-\U0002ceaf\uf900-\ufaff\U0002f800-\U0002fa1f]")


class _CleanTable(dict):
    """str.translate table of the reference's _clean_text, filled as characters are met.

    Tab, newline, carriage return and Zs become " "; Cc, Cf, U+0000 and U+FFFD are deleted;
    every other character maps to itself.
    """

    def __missing__(self, code: int) -> str | None:
        char = chr(code)
        if char in "\t\n\r" or unicodedata.category(char) == "Zs":
            value: str | None = " "
        elif code in (0, 0xFFFD) or unicodedata.category(char) in ("Cc", "Cf"):
            value = None
        else:
            value = char
        self[code] = value
        return value


def _is_punctuation(char: str) -> bool:
    code = ord(char)
    return 33 <= code <= 47 or 58 <= code <= 64 or 91 <= code <= 96 or 123 <= code <= 126 or \
        unicodedata.category(char).startswith("P")


def _split_punctuation(word: str) -> list[str]:
    pieces, current = [], ""
    for char in word:
        if _is_punctuation(char):
            pieces += [current, char] if current else [char]
            current = ""
        else:
            current += char
    return pieces + [current] if current else pieces


class ExactTokenizer:
    """The reference FullTokenizer(do_lower_case=True), with the ids of each word cached."""

    def __init__(self, vocab: Vocab, max_cached_words: int = 1_000_000):
        self.ids = {token: i for i, token in enumerate(vocab.tokens)}
        self.unk = self.ids["[UNK]"]
        self.clean = _CleanTable()
        self.cache: dict[str, tuple[int, ...]] = {}
        self.max_cached_words = max_cached_words

    def _wordpiece(self, word: str) -> list[int]:
        if len(word) > MAX_CHARS_PER_WORD:
            return [self.unk]
        pieces, start = [], 0
        while start < len(word):
            for end in range(len(word), start, -1):
                piece = self.ids.get(word[start:end] if start == 0 else "##" + word[start:end])
                if piece is not None:
                    break
            else:
                return [self.unk]
            pieces.append(piece)
            start = end
        return pieces

    def _word_ids(self, word: str) -> tuple[int, ...]:
        """Ids of one whitespace-separated word: lower, strip accents, split punctuation, WordPiece."""
        if word.isascii():  # no accents to strip; punctuation is the ASCII set
            parts = _ASCII_PIECE.findall(word.lower())
        else:
            folded = "".join(c for c in unicodedata.normalize("NFD", word.lower()) if unicodedata.category(c) != "Mn")
            parts = " ".join(_split_punctuation(folded)).split()
        return tuple(i for part in parts for i in self._wordpiece(part))

    def encode(self, line: str) -> list[int]:
        """Token ids of one (stripped) line."""
        text = _CJK.sub(r" \g<0> ", line.translate(self.clean))
        out: list[int] = []
        for word in text.split():
            ids = self.cache.get(word)
            if ids is None:
                if len(self.cache) >= self.max_cached_words:
                    self.cache.clear()
                ids = self.cache[word] = self._word_ids(word)
            out.extend(ids)
        return out


class LineEncoder:
    """Token ids of many lines at once, equal to the reference FullTokenizer line by line.

    Pure-ASCII lines: deleting control bytes, lower-casing and a regex split are C loops,
    and each word's WordPiece ids come from a dict filled by batch-encoding the words not
    seen before with the Rust tokenizer. Other lines: ExactTokenizer. The ASCII word cache
    is emptied when it holds `max_cached_words` words, which bounds its memory.
    """

    def __init__(self, vocab: Vocab, max_cached_words: int = 1_000_000):
        self.tokenizer = make_tokenizer(vocab)
        self.exact = ExactTokenizer(vocab, max_cached_words)
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
        encoded = [self.exact.encode(line) for line in lines]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        return np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int32, count=int(lengths.sum())), lengths

    def encode(self, lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """([T] int32 ids of all lines concatenated, [n] int64 tokens per line)."""
        is_ascii = np.fromiter(map(str.isascii, lines), dtype=bool, count=len(lines))
        plain, other = np.flatnonzero(is_ascii), np.flatnonzero(~is_ascii)
        plain_ids, plain_lengths = self._encode_ascii([lines[i] for i in plain])
        other_ids, other_lengths = self._encode_other([lines[i] for i in other])
        lengths = np.empty(len(lines), dtype=np.int64)
        lengths[plain], lengths[other] = plain_lengths, other_lengths
        source_start = np.empty(len(lines), dtype=np.int64)  # where each line's ids sit in [plain, other]
        source_start[plain] = offsets(plain_lengths)[:-1]
        source_start[other] = plain_ids.shape[0] + offsets(other_lengths)[:-1]
        ids = np.concatenate([plain_ids, other_ids])[concat_ranges(source_start, lengths)]
        return ids, lengths
