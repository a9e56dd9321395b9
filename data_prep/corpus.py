"""Small MLCommons-format text corpora from freely licensed text installed on every machine.

For tests, benchmarks and demos without the 13 GB Wikipedia download: the sentences of
Python's own documentation (`pydoc_data.topics`, PSF licence) and, where present, the
licence texts under /usr/share/common-licenses, arranged into documents of consecutive
sentences (one sentence per line, blank line between documents) like the MLCommons parts.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

COMMON_LICENSES = Path("/usr/share/common-licenses")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(])")
_MIN_WORDS = 4


def installed_sentences() -> list[str]:
    """Sentences (whitespace collapsed, at least 4 words) of the installed documentation texts."""
    import pydoc_data.topics

    texts = list(pydoc_data.topics.topics.values())
    if COMMON_LICENSES.is_dir():
        texts += [p.read_text(errors="replace") for p in sorted(COMMON_LICENSES.iterdir()) if p.is_file()]
    sentences = []
    for text in texts:
        for paragraph in re.split(r"\n\s*\n", text):
            for sentence in _SENTENCE_END.split(" ".join(paragraph.split())):
                if len(sentence.split()) >= _MIN_WORDS:
                    sentences.append(sentence)
    return sentences


def make_documents(
    sentences: list[str], num_documents: int, seed: int, sentences_per_document: tuple[int, int] = (2, 40)
) -> list[list[str]]:
    """Documents of consecutive sentences starting at random places (sizes uniform in the range)."""
    rng = random.Random(seed)
    low, high = sentences_per_document
    documents = []
    for _ in range(num_documents):
        size = rng.randint(low, high)
        start = rng.randrange(max(len(sentences) - size, 1))
        documents.append(sentences[start:start + size])
    return documents


def write_documents(path: Path | str, documents: Iterable[list[str]]) -> int:
    """Writes one sentence per line, a blank line after each document; returns the bytes written."""
    text = "".join("\n".join(doc) + "\n\n" for doc in documents)
    Path(path).write_text(text, encoding="utf-8")
    return len(text.encode("utf-8"))


def train_vocab(
    sentences: Iterable[str], path: Path | str, vocab_size: int = 2000, extra_tokens: tuple[str, ...] = ()
) -> Path:
    """Trains a BERT-uncased WordPiece vocabulary (tokenizers) and writes it as vocab.txt.

    [PAD] [UNK] [CLS] [SEP] [MASK] take ids 0..4 as in the MLPerf vocabulary; `extra_tokens`
    are appended as whole-word entries.
    """
    from tokenizers import BertWordPieceTokenizer

    tokenizer = BertWordPieceTokenizer(lowercase=True, strip_accents=True)
    tokenizer.train_from_iterator(
        list(sentences), vocab_size=vocab_size, min_frequency=2,
        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
    )
    ordered = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    tokens = [t for t, _ in ordered] + [t for t in extra_tokens if t not in tokenizer.get_vocab()]
    Path(path).write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return Path(path)


EVAL_MARKER = "evalmarker"  # a whole-word vocabulary entry that only eval documents contain


@dataclass(frozen=True)
class CorpusFiles:
    parts: list[Path]  # part-XXXXX-of-YYYYY training text files
    eval_text: Path  # eval.txt; every sentence ends with EVAL_MARKER
    vocab: Path


def write_corpus(
    directory: Path | str, num_parts: int = 2, documents_per_part: int = 120, eval_documents: int = 80,
    seed: int = 0, vocab_size: int = 2000, planted_eval_documents: int = 0,
) -> CorpusFiles:
    """A small MLCommons-style text folder (parts, eval.txt) and a vocabulary trained on it.

    `planted_eval_documents` copies of eval documents are appended to the last training
    part, as a test that the samples step keeps eval documents out of training.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    sentences = installed_sentences()
    eval_source = make_documents(sentences, eval_documents, seed + 10_000)
    eval_docs = [[f"{s} {EVAL_MARKER}" for s in doc] for doc in eval_source]
    parts = []
    for i in range(num_parts):
        documents = make_documents(sentences, documents_per_part, seed + i)
        if i == num_parts - 1:
            documents += eval_docs[:planted_eval_documents]
        parts.append(directory / f"part-{i:05d}-of-{num_parts:05d}")
        write_documents(parts[-1], documents)
    eval_text = directory / "eval.txt"
    write_documents(eval_text, eval_docs)
    vocab = train_vocab(sentences, directory / "vocab.txt", vocab_size, extra_tokens=(EVAL_MARKER,))
    return CorpusFiles(parts, eval_text, vocab)
