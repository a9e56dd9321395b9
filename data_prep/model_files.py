"""The two files a model needs besides data: a WordPiece vocab.txt trained on one's own text,
and a bert_config.json of a named BERT size.

The vocabulary keeps the MLPerf (Google BERT uncased) layout as far as a smaller vocabulary
allows: [PAD] first, then up to 99 [unusedN] tokens, [UNK] [CLS] [SEP] [MASK], the remaining
[unusedN] tokens, then the learnt tokens. `unused=994` gives the MLPerf ids exactly (0, 100,
101, 102, 103); the default 0 gives [PAD] [UNK] [CLS] [SEP] [MASK] at ids 0-4.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlperf_bert.runtime.files import atomic_path
from data_prep.formats import MAX_VOCAB_SIZE, DataPrepError
from data_prep.vocab import MAX_CHARS_PER_WORD, load_vocab

UNUSED_BEFORE_UNK = 99  # [unused0]..[unused98] sit between [PAD] and [UNK] in the MLPerf vocab

# The published BERT shapes: layers, hidden size, attention heads (feed-forward = 4 x hidden).
MODEL_SIZES = {
    "tiny": (2, 128, 2),
    "mini": (4, 256, 4),
    "small": (4, 512, 8),
    "medium": (8, 512, 8),
    "base": (12, 768, 12),
    "large": (24, 1024, 16),
}
MLPERF_VOCAB_SIZE = 30522


def special_tokens(unused: int) -> list[str]:
    """The reserved tokens in MLPerf vocab order, with `unused` [unusedN] tokens."""
    before = min(unused, UNUSED_BEFORE_UNK)
    return (["[PAD]"] + [f"[unused{i}]" for i in range(before)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
            + [f"[unused{i}]" for i in range(before, unused)])


def _check_vocab_args(files: list[Path], size: int, unused: int) -> None:
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise DataPrepError(f"no such text file: {', '.join(missing) or '(none given)'} (--text)")
    reserved = len(special_tokens(unused))
    if not reserved + 100 <= size <= MAX_VOCAB_SIZE:
        raise DataPrepError(f"--size {size}: must be between {reserved + 100} (the {reserved} reserved tokens "
                            f"and some text) and {MAX_VOCAB_SIZE} (token ids are stored as int16)")


def train_vocab(files: list[Path], out: Path, size: int, lower_case: bool = True, unused: int = 0,
                min_frequency: int = 2) -> int:
    """Train a WordPiece vocabulary on text files (one sentence a line) into `out`; its size."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    _check_vocab_args(files, size, unused)
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=MAX_CHARS_PER_WORD))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lower_case, strip_accents=lower_case)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=size, min_frequency=min_frequency,
                                        special_tokens=special_tokens(unused), continuing_subword_prefix="##")
    tokenizer.train([str(f) for f in files], trainer)
    tokens = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    text = "".join(f"{token}\n" for token, _ in tokens)

    with atomic_path(out) as tmp:
        tmp.write_text(text, encoding="utf-8")
        load_vocab(tmp)  # the same checks `prepare.py samples` makes, before the name exists
    return len(tokens)


def model_config(size: str, vocab_size: int = MLPERF_VOCAB_SIZE, max_position_embeddings: int = 512) -> dict[str, Any]:
    """A bert_config.json (Google BERT keys) of a named size."""
    if size not in MODEL_SIZES:
        raise DataPrepError(f"unknown model size {size!r}: choose one of {', '.join(MODEL_SIZES)}")
    layers, hidden, heads = MODEL_SIZES[size]
    return {
        "attention_probs_dropout_prob": 0.1,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": 4 * hidden,
        "max_position_embeddings": max_position_embeddings,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "type_vocab_size": 2,
        "vocab_size": vocab_size,
    }


def write_model_config(out: Path, config: dict[str, Any]) -> None:
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
