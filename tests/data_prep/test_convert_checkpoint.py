"""TF1 checkpoint -> PyTorch / HuggingFace conversion, checked against a numpy BERT on the raw TF arrays.

A small TF1 checkpoint is written here with tf.compat.v1 variables under the MLPerf names
(plus Adam slots and global_step, as in model.ckpt-28252). The converted HuggingFace
folder is loaded by transformers' BertForPreTraining and the converted .pt file by this
repository's model; both must give the logits a numpy forward pass computes straight from
the TF arrays (x @ kernel + bias, as TF does). transformers 5 no longer ships
load_tf_weights_in_bert, hence the numpy reference.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from data_prep.convert_checkpoint import convert, read_pt
from data_prep.formats import DataPrepError


CONFIG = {"vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 64, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
          "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 64, "type_vocab_size": 2,
          "initializer_range": 0.02}


def tf_variable_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    shapes = {"bert/embeddings/word_embeddings": (v, h),
              "bert/embeddings/position_embeddings": (c["max_position_embeddings"], h),
              "bert/embeddings/token_type_embeddings": (2, h), "bert/embeddings/LayerNorm/gamma": (h,),
              "bert/embeddings/LayerNorm/beta": (h,), "bert/pooler/dense/kernel": (h, h),
              "bert/pooler/dense/bias": (h,),
              "cls/predictions/transform/dense/kernel": (h, h), "cls/predictions/transform/dense/bias": (h,),
              "cls/predictions/transform/LayerNorm/gamma": (h,), "cls/predictions/transform/LayerNorm/beta": (h,),
              "cls/predictions/output_bias": (v,), "cls/seq_relationship/output_weights": (2, h),
              "cls/seq_relationship/output_bias": (2,)}
    for n in range(c["num_hidden_layers"]):
        p = f"bert/encoder/layer_{n}/"
        for part in ("query", "key", "value"):
            shapes[p + f"attention/self/{part}/kernel"], shapes[p + f"attention/self/{part}/bias"] = (h, h), (h,)
        shapes.update({p + "attention/output/dense/kernel": (h, h), p + "attention/output/dense/bias": (h,),
                       p + "attention/output/LayerNorm/gamma": (h,), p + "attention/output/LayerNorm/beta": (h,),
                       p + "intermediate/dense/kernel": (h, i), p + "intermediate/dense/bias": (i,),
                       p + "output/dense/kernel": (i, h), p + "output/dense/bias": (h,),
                       p + "output/LayerNorm/gamma": (h,), p + "output/LayerNorm/beta": (h,)})
    return shapes


@pytest.fixture(scope="module")
def tf_checkpoint(tmp_path_factory):
    import tensorflow as tf  # `make test` installs tensorflow-cpu; imported here, as it takes seconds
    root = tmp_path_factory.mktemp("tf1")
    rng = np.random.default_rng(0)
    weights = {}
    graph = tf.Graph()
    with graph.as_default():
        for name, shape in tf_variable_shapes(CONFIG).items():
            weights[name] = rng.normal(0.0, 0.3, shape).astype(np.float32)
            if name.endswith("gamma"):
                weights[name] += 1.0
            tf.compat.v1.get_variable(name, initializer=weights[name])
            for slot in ("adam_m", "adam_v"):  # optimizer state, as in the MLPerf checkpoint
                tf.compat.v1.get_variable(f"{name}/{slot}", initializer=np.ones(shape, np.float32))
        tf.compat.v1.train.get_or_create_global_step()
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            tf.compat.v1.train.Saver().save(session, str(root / "model.ckpt"), global_step=28252)
    (root / "bert_config.json").write_text(json.dumps(CONFIG))
    return root, weights


def _layer_norm(x, gamma, beta):
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-12) * gamma + beta


def _gelu(x):
    from scipy.special import erf

    return 0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))


def numpy_bert(w: dict, ids: np.ndarray, segments: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([B, T, V] masked-LM logits, [B, 2] next-sentence logits) from TF-named arrays."""
    heads = CONFIG["num_attention_heads"]
    b, t = ids.shape
    x = w["bert/embeddings/word_embeddings"][ids] + w["bert/embeddings/position_embeddings"][:t] + \
        w["bert/embeddings/token_type_embeddings"][segments]
    x = _layer_norm(x, w["bert/embeddings/LayerNorm/gamma"], w["bert/embeddings/LayerNorm/beta"])
    for n in range(CONFIG["num_hidden_layers"]):
        p = f"bert/encoder/layer_{n}/"

        def dense(v, name, prefix=p):
            return v @ w[prefix + name + "/kernel"] + w[prefix + name + "/bias"]

        q, k, v = (dense(x, f"attention/self/{s}").reshape(b, t, heads, -1).transpose(0, 2, 1, 3)
                   for s in ("query", "key", "value"))
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        context = (probs / probs.sum(-1, keepdims=True) @ v).transpose(0, 2, 1, 3).reshape(b, t, -1)
        x = _layer_norm(x + dense(context, "attention/output/dense"), w[p + "attention/output/LayerNorm/gamma"],
                        w[p + "attention/output/LayerNorm/beta"])
        x = _layer_norm(x + dense(_gelu(dense(x, "intermediate/dense")), "output/dense"),
                        w[p + "output/LayerNorm/gamma"], w[p + "output/LayerNorm/beta"])
    pooled = np.tanh(x[:, 0] @ w["bert/pooler/dense/kernel"] + w["bert/pooler/dense/bias"])
    h = _gelu(x @ w["cls/predictions/transform/dense/kernel"] + w["cls/predictions/transform/dense/bias"])
    h = _layer_norm(h, w["cls/predictions/transform/LayerNorm/gamma"], w["cls/predictions/transform/LayerNorm/beta"])
    mlm = h @ w["bert/embeddings/word_embeddings"].T + w["cls/predictions/output_bias"]
    nsp = pooled @ w["cls/seq_relationship/output_weights"].T + w["cls/seq_relationship/output_bias"]
    return mlm, nsp


def _inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.integers(0, CONFIG["vocab_size"], (2, 20)), (np.arange(20) >= 9).astype(np.int64)[None].repeat(2, 0)


def test_huggingface_output_matches_the_tf_arrays(tf_checkpoint, tmp_path):
    import torch
    from transformers import BertForPreTraining

    root, weights = tf_checkpoint
    convert(root / "model.ckpt-28252", tmp_path / "hf", root / "bert_config.json")
    model = BertForPreTraining.from_pretrained(str(tmp_path / "hf")).eval()
    ids, segments = _inputs()
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids), token_type_ids=torch.from_numpy(segments))
    mlm, nsp = numpy_bert(weights, ids, segments)
    np.testing.assert_allclose(out.prediction_logits.numpy(), mlm, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(out.seq_relationship_logits.numpy(), nsp, atol=2e-4, rtol=1e-4)


def test_padded_pt_file_loads_into_the_trainer_model(tf_checkpoint, tmp_path):
    import torch

    root, weights = tf_checkpoint
    convert(root / "model.ckpt-28252", tmp_path / "phase1.pt", root / "bert_config.json", pad_vocab_to=8)
    state = torch.load(tmp_path / "phase1.pt", weights_only=True)["model"]
    assert len(state) == 5 + 16 * CONFIG["num_hidden_layers"] + 2 + 7  # 398 for BERT-Large's 24 layers
    assert state["bert.embeddings.word_embeddings.weight"].shape == (104, 32)
    assert not state["bert.embeddings.word_embeddings.weight"][99:].any()
    assert not state["cls.predictions.bias"][99:].any()
    np.testing.assert_array_equal(state["bert.encoder.layer.1.intermediate.dense.weight"].numpy(),
                                  weights["bert/encoder/layer_1/intermediate/dense/kernel"].T)
    np.testing.assert_array_equal(state["cls.seq_relationship.weight"].numpy(),
                                  weights["cls/seq_relationship/output_weights"])
    from mlperf_bert.data import batch as batch_module
    from mlperf_bert.model import bert as model_module, init_checkpoint as checkpoint
    model = model_module.BertForPreTraining(model_module.BertConfig.from_json(root / "bert_config.json")).eval()
    checkpoint.load_init_checkpoint(model, tmp_path / "phase1.pt")
    ids, segments = _inputs()
    positions = np.array([3, 11, 17])
    items = [(batch_module.Sample(ids[r], segments[r], positions, ids[r][positions], 0),) for r in range(2)]
    with torch.no_grad():
        out = model(batch_module.flatten_items(items))
    mlm, nsp = numpy_bert(weights, ids, segments)
    np.testing.assert_allclose(out.mlm_logits.numpy(), mlm[:, positions].reshape(-1, CONFIG["vocab_size"]),
                               atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(out.nsp_logits.numpy(), nsp, atol=2e-4, rtol=1e-4)


def test_round_trips_between_pt_and_huggingface(tf_checkpoint, tmp_path):
    root, _ = tf_checkpoint
    convert(root / "model.ckpt-28252", tmp_path / "direct.pt", root / "bert_config.json")
    convert(root / "model.ckpt-28252", tmp_path / "hf", root / "bert_config.json")
    convert(tmp_path / "hf", tmp_path / "from_hf.pt", None)
    convert(tmp_path / "direct.pt", tmp_path / "hf_again", root / "bert_config.json")
    convert(tmp_path / "hf_again", tmp_path / "twice.pt", None, pad_vocab_to=8)
    direct = read_pt(tmp_path / "direct.pt")
    for other in (read_pt(tmp_path / "from_hf.pt"), read_pt(tmp_path / "twice.pt")):
        assert set(other) == set(direct)
        for name, value in direct.items():
            np.testing.assert_array_equal(other[name][: value.shape[0]], value)


def test_wrong_config_and_missing_checkpoint_are_named(tf_checkpoint, tmp_path):
    root, _ = tf_checkpoint
    wrong = tmp_path / "bert_config.json"
    wrong.write_text(json.dumps({**CONFIG, "intermediate_size": 128}))
    message = r"does not match the BERT config: .*intermediate.dense.weight is \(64, 32\)"
    with pytest.raises(DataPrepError, match=message):
        convert(root / "model.ckpt-28252", tmp_path / "x.pt", wrong)
    with pytest.raises(DataPrepError, match="no model.ckpt-1.index"):
        convert(root / "model.ckpt-1", tmp_path / "x.pt", root / "bert_config.json")
    assert not (tmp_path / "x.pt").exists()
