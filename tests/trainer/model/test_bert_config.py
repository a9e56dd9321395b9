"""bert_config.json: every key required or defaulted, typed, in range; errors name the file and key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from mlperf_bert.config.settings import ConfigError
from mlperf_bert.model.bert import DEFAULTED_KEYS, REQUIRED_KEYS, BertConfig, BertForPreTraining
from tests.harness.demo import trainer_args

LARGE = {"vocab_size": 30522, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
         "intermediate_size": 4096}
TINY = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 32}


def _write(tmp_path: Path, config: object) -> Path:
    path = tmp_path / "bert_config.json"
    path.write_text(json.dumps(config))
    return path


def test_the_required_keys_are_the_shape_and_the_rest_are_berts_defaults(tmp_path):
    loaded = BertConfig.from_json(_write(tmp_path, LARGE))
    assert loaded == BertConfig(**LARGE)
    assert {k: getattr(loaded, k) for k in DEFAULTED_KEYS} == {
        "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": 512, "type_vocab_size": 2, "initializer_range": 0.02, "layer_norm_eps": 1e-12}
    assert set(REQUIRED_KEYS) == set(LARGE)


BAD = [
    ({k: v for k, v in LARGE.items() if k != "hidden_size"}, "hidden_size missing"),
    ({**LARGE, "num_attention_heads": 0}, "num_attention_heads must be an integer >= 1; got 0"),
    ({**LARGE, "hidden_size": "1024"}, "hidden_size must be an integer >= 1; got '1024'"),
    ({**LARGE, "vocab_size": 1e9}, "vocab_size must be an integer >= 1; got 1000000000.0"),
    ({**LARGE, "num_hidden_layers": True}, "num_hidden_layers must be an integer >= 1; got True"),
    ({**LARGE, "intermediate_size": -4096}, "intermediate_size must be an integer >= 1; got -4096"),
    ({**LARGE, "type_vocab_size": 1}, "type_vocab_size must be an integer >= 2 (segment ids are 0 and 1)"),
    ({**LARGE, "hidden_dropout_prob": 1.5}, "hidden_dropout_prob must be a number in [0, 1); got 1.5"),
    ({**LARGE, "attention_probs_dropout_prob": "0.1"}, "attention_probs_dropout_prob must be a number in [0, 1)"),
    ({**LARGE, "initializer_range": 0}, "initializer_range must be a number in (0, 1); got 0"),
    ({**LARGE, "hidden_act": "relu"}, "hidden_act must be one of gelu"),
    ({**LARGE, "hidden_size": 1000}, "hidden_size 1000 is not divisible by num_attention_heads 16"),
    ({**LARGE, "hidden_szie": 1024}, "unknown key(s) 'hidden_szie'"),
    ([1, 2], "must hold a JSON object"),
]


@pytest.mark.parametrize("config, message", BAD, ids=[m.split(";")[0][:40] for _, m in BAD])
def test_a_bad_bert_config_names_the_file_and_the_key(tmp_path, config, message):
    path = _write(tmp_path, config)
    with pytest.raises(ConfigError) as err:
        BertConfig.from_json(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_an_unreadable_bert_config_is_a_config_error(tmp_path):
    path = tmp_path / "bert_config.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read the BERT config"):
        BertConfig.from_json(path)


@pytest.mark.parametrize("shape", [TINY, {**TINY, "vocab_size": 61, "type_vocab_size": 3}])
def test_the_parameter_count_matches_the_models_and_huggingfaces(shape):
    bert = BertConfig(**shape)
    ours = sum(p.numel() for p in BertForPreTraining(bert).parameters())
    padded = {**shape, "vocab_size": bert.padded_vocab_size}  # our embedding rows are padded to 8
    hf = transformers.BertForPreTraining(transformers.BertConfig(**padded)).num_parameters()
    assert bert.parameter_count == ours == hf


def test_bert_large_has_its_published_size():
    assert BertConfig(**LARGE).parameter_count == pytest.approx(335e6, rel=0.01)  # "340M" in the paper


CLI_CASES = [
    ({k: v for k, v in TINY.items() if k != "hidden_size"}, "hidden_size missing"),
    ({**TINY, "num_attention_heads": 0}, "num_attention_heads must be an integer"),
    ({**TINY, "vocab_size": "many"}, "vocab_size must be an integer"),
    ({**TINY, "type_vocab_size": 1}, "type_vocab_size must be an integer >= 2"),
    ({**TINY, "hidden_dropout_prob": 1.5}, "hidden_dropout_prob must be a number in [0, 1)"),
    ({**TINY, "vocab_size": 10**9}, "more than the"),  # 16 bytes x 16e9 parameters: no machine's memory
    ({**TINY, "max_position_embeddings": 32}, "--max_seq_length 64 exceeds max_position_embeddings 32"),
]


@pytest.mark.parametrize("config, message", CLI_CASES, ids=[m[:30] for _, m in CLI_CASES])
def test_the_trainer_refuses_a_bad_bert_config_before_anything_runs(served_trainer, demo_data, tmp_path, config,
                                                                    message):
    path = _write(tmp_path, config)
    args = trainer_args(demo_data, tmp_path / "out", "--do_train", "--device", "cpu")
    args[args.index("--bert_config_path") + 1] = str(path)
    result = served_trainer.run_in(tmp_path, args)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(path) in errors[0] and message in errors[0], result.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_the_memory_estimate_uses_the_device_it_is_given(tmp_path):
    from mlperf_bert.config.cli import parse_config
    from mlperf_bert.startup import _check_model_fits

    cfg = parse_config(["--eval_dir", "e", "--bert_config_path", str(tmp_path / "b.json"), "--output_dir",
                        str(tmp_path / "o"), "--max_steps", "1", "--submission_division", "open"], 1)
    large = BertConfig(**LARGE)
    _check_model_fits(cfg, large, 80 * 2**30)  # 5.0 GiB of weights and optimizer state fit an 80 GB GPU
    with pytest.raises(ConfigError, match=r"take 5\.0 GiB, more than the 4\.0 GiB"):
        _check_model_fits(cfg, large, 4 * 2**30)
