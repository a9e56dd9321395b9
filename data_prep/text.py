"""Streaming the MLCommons text files into compact token arrays.

Input format (MLCommons cleanup scripts, as create_pretraining_data.py reads it): one
sentence per line, documents separated by blank lines. The file is read in blocks of about
`block_bytes`, each block tokenised at once (vocab.LineEncoder), and only numpy
arrays are kept: a 27 MB part becomes ~7M int32 tokens plus sentence and document offsets
(~35 MB), never a Python list per sentence or token.

As in the reference: lines end at "\n" only, every "\r" is deleted, lines are stripped, a
blank line ends a document, a line whose tokenisation is empty is skipped, and documents
without sentences disappear.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from data_prep.formats import DataPrepError
from mlperf_bert.data.shards import concat_ranges, offsets
from data_prep.vocab import LineEncoder

BLOCK_BYTES = 1 << 20  # text bytes tokenised per encode_batch call


@dataclass
class TokenizedText:
    """D documents of S sentences of T tokens, as flat arrays."""

    tokens: np.ndarray  # [T] int32 token ids
    sentence_starts: np.ndarray  # [S+1] int64: sentence s is tokens[sentence_starts[s]:sentence_starts[s+1]]
    document_starts: np.ndarray  # [D+1] int64: document d is sentences [document_starts[d], document_starts[d+1])

    @property
    def num_documents(self) -> int:
        return int(self.document_starts.shape[0] - 1)

    @property
    def num_sentences(self) -> int:
        return int(self.sentence_starts.shape[0] - 1)

    def document_token_range(self, doc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """First token and token count of documents `doc`."""
        first = self.sentence_starts[self.document_starts[doc]]
        return first, self.sentence_starts[self.document_starts[doc + 1]] - first

    def document_keys(self) -> list[bytes]:
        """A digest of each document's token ids: equal documents (after normalisation) share it."""
        first, count = self.document_token_range(np.arange(self.num_documents))
        return [hashlib.sha1(self.tokens[a:a + n].tobytes()).digest() for a, n in zip(first.tolist(), count.tolist())]

    def keep_documents(self, keep: np.ndarray) -> TokenizedText:
        """The documents where `keep` [D] is True, in order."""
        docs = np.flatnonzero(keep)
        sentence_counts = np.diff(self.document_starts)[docs]
        sentences = concat_ranges(self.document_starts[docs], sentence_counts)
        lengths = np.diff(self.sentence_starts)[sentences]
        tokens = self.tokens[concat_ranges(self.sentence_starts[sentences], lengths)]
        return TokenizedText(tokens, offsets(lengths), offsets(sentence_counts))


def _decode(path: Path, line_number: int, raw: bytes, errors: str) -> str:
    try:
        return raw.decode("utf-8", errors)
    except UnicodeDecodeError as err:
        bad = raw[err.start:err.end]
        raise DataPrepError(
            f"{path}: line {line_number}: bytes {bad!r} at column {err.start} are not UTF-8; "
            "fix the file, or pass --encoding_errors replace (or ignore) to accept it"
        ) from err


def read_line_blocks(path: Path, errors: str = "strict", block_bytes: int = BLOCK_BYTES) -> Iterator[list[str]]:
    """The file's lines, decoded, in blocks of about `block_bytes` (line numbers count from 1)."""
    with open(path, "rb") as handle:
        line_number = 1
        while raw_lines := handle.readlines(block_bytes):
            # The reference's line reader (tf.gfile) drops every carriage return, also inside a line.
            yield [_decode(path, line_number + i, raw.replace(b"\r", b""), errors) for i, raw in enumerate(raw_lines)]
            line_number += len(raw_lines)


@dataclass
class _DocumentSplitter:
    """Carries "a blank line was seen" across blocks and sentences that tokenise to nothing."""

    pending_break: bool = True  # the first sentence of the file opens a document

    def sentences(self, lines: list[str]) -> tuple[list[str], np.ndarray]:
        """Stripped non-blank lines and [n] bool: a blank line came since the previous one."""
        texts, breaks = [], []
        for line in lines:
            stripped = line.strip()
            if not stripped:
                self.pending_break = True
                continue
            texts.append(stripped)
            breaks.append(self.pending_break)
            self.pending_break = False
        return texts, np.array(breaks, dtype=bool)

    def document_starts(self, breaks: np.ndarray, kept: np.ndarray) -> np.ndarray:
        """[k] bool for the kept sentences: does each open a new document?

        A blank line before a skipped (token-less) sentence still separates the documents
        around it, so breaks are counted cumulatively and compared between kept sentences.
        """
        seen = np.cumsum(breaks)  # blank-line gaps up to and including each sentence
        kept_idx = np.flatnonzero(kept)
        before = np.concatenate([[0], seen[kept_idx[:-1]]])  # gaps up to the previous kept sentence
        last_kept = seen[kept_idx[-1]] if kept_idx.size else 0
        if seen.size and seen[-1] > last_kept:  # a gap before a skipped sentence at the block's end
            self.pending_break = True
        return seen[kept_idx] > before[: kept_idx.size]


def tokenize_file(path: Path | str, encoder: LineEncoder, errors: str = "strict",
                  block_bytes: int = BLOCK_BYTES) -> TokenizedText:
    """Tokenises one MLCommons text file into a TokenizedText (streaming, bounded memory)."""
    path = Path(path)
    if not path.is_file():
        raise DataPrepError(f"{path}: input text file not found")
    if path.stat().st_size == 0:
        raise DataPrepError(f"{path}: the file is empty (0 bytes); re-download or remove it from the input list")
    splitter = _DocumentSplitter()
    token_blocks, length_blocks, opens_blocks = [], [], []
    for lines in read_line_blocks(path, errors, block_bytes):
        texts, breaks = splitter.sentences(lines)
        if not texts:
            continue
        ids, lengths = encoder.encode(texts)
        token_blocks.append(ids)
        kept = lengths > 0
        opens = splitter.document_starts(breaks, kept)
        length_blocks.append(lengths[kept])
        opens_blocks.append(opens)
    if not length_blocks or not np.concatenate(length_blocks).size:
        raise DataPrepError(f"{path}: no sentence with tokens in the file (only blank lines?); check the input")
    lengths = np.concatenate(length_blocks)
    opens = np.concatenate(opens_blocks)
    opens[0] = True
    doc_starts = np.append(np.flatnonzero(opens), lengths.shape[0]).astype(np.int64)
    return TokenizedText(np.concatenate(token_blocks), offsets(lengths), doc_starts)
