"""Init-checkpoint loading: both accepted layouts, vocabulary padding, and strict errors."""

from __future__ import annotations

import pytest
import torch
import transformers

from mlperf_bert.model.init_checkpoint import CheckpointError, load_init_checkpoint, read_state_dict
from mlperf_bert.model.bert import BertConfig, BertForPreTraining

CFG = BertConfig(vocab_size=101, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=32, max_position_embeddings=32)


def hf_model() -> transformers.BertForPreTraining:
    torch.manual_seed(0)
    return transformers.BertForPreTraining(transformers.BertConfig(
        vocab_size=CFG.vocab_size, hidden_size=CFG.hidden_size, num_hidden_layers=CFG.num_hidden_layers,
        num_attention_heads=CFG.num_attention_heads, intermediate_size=CFG.intermediate_size,
        max_position_embeddings=CFG.max_position_embeddings,
    ))


def nvidia_style_state(vocab_rows: int) -> dict[str, torch.Tensor]:
    """The converted MLPerf phase-1 layout: HF names, decoder alias, vocabulary padded."""
    state = {k: v.clone() for k, v in hf_model().state_dict().items()}
    for name in ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias"):
        real = state[name]
        padded = torch.zeros((vocab_rows, *real.shape[1:]))
        padded[: real.shape[0]] = real
        state[name] = padded
    state["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"]
    state.pop("cls.predictions.decoder.bias", None)
    return state


def test_loads_model_dict_file_with_padded_vocabulary(tmp_path):
    state = nvidia_style_state(vocab_rows=104)
    torch.save({"model": state}, tmp_path / "ckpt.pt")
    model = BertForPreTraining(CFG)
    load_init_checkpoint(model, tmp_path / "ckpt.pt")
    got = model.bert.embeddings.word_embeddings.weight
    assert torch.equal(got[:101], state["bert.embeddings.word_embeddings.weight"][:101])
    assert torch.equal(model.bert.encoder.layer[1].output.dense.weight,
                       state["bert.encoder.layer.1.output.dense.weight"])


def test_loads_huggingface_directory_and_matches_its_outputs(tmp_path):
    hf = hf_model().eval()
    hf.save_pretrained(tmp_path / "hf")
    model = BertForPreTraining(CFG).eval()
    load_init_checkpoint(model, tmp_path / "hf")
    hf_state, ours = hf.state_dict(), dict(model.named_parameters())
    assert sorted(set(ours) - set(hf_state)) == []  # every parameter of ours is compared below
    for name, param in ours.items():
        tensor = hf_state[name]
        assert torch.equal(param[: tensor.shape[0]], tensor), name


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s.pop("bert.encoder.layer.0.attention.self.query.weight"),
         "missing tensor bert.encoder.layer.0.attention.self.query.weight"),
        (lambda s: s.__setitem__("bert.encoder.layer.7.output.dense.weight", torch.zeros(1)),
         "unexpected tensor bert.encoder.layer.7.output.dense.weight"),
        (lambda s: s.__setitem__("bert.pooler.dense.weight", torch.zeros(16, 8)),
         "bert.pooler.dense.weight has shape (16, 8), the model needs (16, 16)"),
        (lambda s: s.__setitem__("cls.predictions.bias", torch.zeros(50)),
         "cls.predictions.bias has 50 vocabulary rows, the BERT config needs 101"),
    ],
)
def test_strict_loading_names_the_bad_tensor(tmp_path, mutate, message):
    state = nvidia_style_state(vocab_rows=104)
    mutate(state)
    torch.save({"model": state}, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        load_init_checkpoint(BertForPreTraining(CFG), tmp_path / "bad.pt")
    assert "bad.pt" in str(err.value)


class NotATensor:
    """An arbitrary class: unpickling it would import and run project code."""


def test_refuses_pickled_code(tmp_path):
    torch.save({"model": {"x": NotATensor()}}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="evil.pt: cannot read the checkpoint"):
        read_state_dict(tmp_path / "evil.pt")


def test_missing_and_corrupt_files_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        read_state_dict(tmp_path / "nope.pt")
    (tmp_path / "corrupt.pt").write_bytes(b"\x00not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt.pt"):
        read_state_dict(tmp_path / "corrupt.pt")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(CheckpointError, match="no model.safetensors or pytorch_model.bin"):
        read_state_dict(tmp_path / "empty_dir")
