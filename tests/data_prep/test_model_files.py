"""`prepare.py vocab` and `prepare.py model-config`: one's own corpus, end to end to the trainer."""

from __future__ import annotations

import json
import sys

import pytest

from data_prep.corpus import write_corpus
from data_prep.formats import DataPrepError
from data_prep.model_files import MODEL_SIZES, model_config, special_tokens, train_vocab
from data_prep.vocab import load_vocab, make_tokenizer
from tests.harness.commands import run_cli
from tests.harness.paths import TRAINER

MAX_LEN, MAX_PRED = 64, 10


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("text"), num_parts=2, documents_per_part=40, eval_documents=30)


def _prepare(*args: str):
    return run_cli([sys.executable, "data_prep/prepare.py", "--quiet", *args])


def test_vocab_has_the_mlperf_special_token_order(corpus, tmp_path):
    done = _prepare("vocab", "--text", *map(str, corpus.parts), "--out", str(tmp_path / "vocab.txt"),
                    "--size", "1200", "--unused", "994")
    assert done.returncode == 0, done.stderr
    tokens = (tmp_path / "vocab.txt").read_text().splitlines()
    assert len(tokens) == 1200 and len(set(tokens)) == 1200
    # The ids of the MLPerf vocab.txt: [PAD] 0, [unused0] 1, [UNK] 100 ... [MASK] 103, [unused99] 104.
    assert [tokens[i] for i in (0, 1, 99, 100, 101, 102, 103, 104, 998)] == [
        "[PAD]", "[unused0]", "[unused98]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused99]", "[unused993]"]
    assert any(t.startswith("##") for t in tokens[999:]) and "the" in tokens[999:]
    assert not list(tmp_path.glob(".*tmp"))


def test_vocab_tokenises_like_huggingface_bert(corpus, tmp_path):
    """The trained vocab.txt read by transformers' BertTokenizer (Python WordPiece) and by the
    samples step's tokenizer gives the same ids for the corpus's own lines."""
    from transformers import BertTokenizer

    out = tmp_path / "vocab.txt"
    assert train_vocab(corpus.parts, out, size=800) == 800
    assert out.read_text().splitlines()[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    reference = BertTokenizer(str(out), do_lower_case=True)
    ours = make_tokenizer(load_vocab(out))
    lines = [line for line in corpus.parts[0].read_text().splitlines() if line.strip()][:200]
    for line in lines:
        assert ours.encode(line, add_special_tokens=False).ids == reference.encode(line, add_special_tokens=False)


@pytest.mark.parametrize("size,unused,message", [(50, 0, "--size 50: must be between 105"),
                                                 (40000, 0, "and 32768"), (1000, 994, "between 1099")])
def test_impossible_vocab_sizes_name_the_flag(corpus, tmp_path, size, unused, message):
    with pytest.raises(DataPrepError, match=message):
        train_vocab(corpus.parts, tmp_path / "vocab.txt", size=size, unused=unused)
    assert not (tmp_path / "vocab.txt").exists()


def test_missing_text_file_is_one_clear_line(tmp_path):
    done = _prepare("vocab", "--text", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "vocab.txt"))
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "nope.txt" in done.stderr and not (tmp_path / "vocab.txt").exists()


@pytest.mark.parametrize("size", sorted(MODEL_SIZES))
def test_model_configs_have_the_published_shapes_and_load_in_transformers(size):
    from transformers import BertConfig

    published = {"tiny": (2, 128), "mini": (4, 256), "small": (4, 512), "medium": (8, 512), "base": (12, 768),
                 "large": (24, 1024)}  # BERT's README: L, H; heads = H / 64, feed-forward = 4H
    config = BertConfig(**model_config(size))
    layers, hidden = published[size]
    assert (config.num_hidden_layers, config.hidden_size) == (layers, hidden)
    assert config.num_attention_heads == hidden // 64 and config.intermediate_size == 4 * hidden
    assert config.vocab_size == 30522


def test_large_is_the_mlperf_model_config():
    mlperf = {"attention_probs_dropout_prob": 0.1, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
              "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 4096,
              "max_position_embeddings": 512, "num_attention_heads": 16, "num_hidden_layers": 24,
              "type_vocab_size": 2, "vocab_size": 30522}
    assert model_config("large") == mlperf


def test_special_tokens_keep_the_order_when_few_are_unused():
    assert special_tokens(2) == ["[PAD]", "[unused0]", "[unused1]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@pytest.mark.slow
def test_own_corpus_end_to_end_to_the_trainer(corpus, tmp_path):
    vocab, config = tmp_path / "vocab.txt", tmp_path / "bert_config.json"
    steps = [("vocab", "--text", str(corpus.parts[0].parent), "--out", str(vocab), "--size", "700"),
             ("model-config", "--size", "tiny", "--vocab", str(vocab), "--out", str(config),
              "--max_position_embeddings", str(MAX_LEN)),
             ("samples", "--text", str(corpus.parts[0].parent), "--vocab", str(vocab), "--out", str(tmp_path / "train"),
              "--exclude_text", str(corpus.eval_text), "--dupe_factor", "2", "--workers", "1",
              "--max_seq_length", str(MAX_LEN), "--max_predictions", str(MAX_PRED)),
             ("samples", "--text", str(corpus.eval_text), "--vocab", str(vocab), "--out", str(tmp_path / "eval"),
              "--dupe_factor", "1", "--workers", "1", "--max_seq_length", str(MAX_LEN),
              "--max_predictions", str(MAX_PRED))]
    for step in steps:
        done = _prepare(*step)
        assert done.returncode == 0, (step[0], done.stderr[-2000:])
    assert json.loads(config.read_text())["vocab_size"] == 700
    # Steps run alone write no verification record (`prepare.py all` verifies what it writes): a run needs one.
    verified = _prepare("verify", str(tmp_path / "train"), str(tmp_path / "eval"), "--eval_dir", str(tmp_path / "eval"),
                        "--vocab", str(vocab), "--workers", "1")
    assert verified.returncode == 0, verified.stdout[-2000:] + verified.stderr[-2000:]
    out = tmp_path / "out"
    done = run_cli([sys.executable, str(TRAINER), "--do_train", "--input_dir", str(tmp_path / "train"),
                    "--eval_dir", str(tmp_path / "eval"), "--bert_config_path", str(config), "--output_dir", str(out),
                    "--max_seq_length", str(MAX_LEN), "--max_predictions_per_seq", str(MAX_PRED),
                    "--num_eval_examples", "40", "--train_batch_size", "4", "--max_steps", "3",
                    "--eval_iter_samples", "100", "--submission_division", "open", "--curves", "none"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"key": "eval_accuracy"' in (out / "mlperf.log").read_text()
