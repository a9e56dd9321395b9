"""Init-checkpoint loading: both accepted layouts, vocabulary padding, and strict errors."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
import transformers

from mlperf_bert.model.init_checkpoint import (CheckpointError, check_init_checkpoint, load_init_checkpoint,
                                               read_state_dict)
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
    with pytest.raises(CheckpointError, match="evil.pt: cannot load the init checkpoint: it holds Python objects"):
        read_state_dict(tmp_path / "evil.pt")


def _write_pickle(path, obj, protocol: int = 4) -> None:
    path.write_bytes(pickle.dumps(obj, protocol=protocol))


# Every kind of file that is not an init checkpoint, and what the one line says about it.
NOT_CHECKPOINTS = {
    "a text file": (lambda p: p.write_text("hello, not a checkpoint\n"), "it is not a file torch.save wrote"),
    "an empty file": (lambda p: p.write_bytes(b""), "the file is empty"),
    "numpy arrays in torch.save": (lambda p: torch.save({"model": {"a": np.zeros(3)}}, p),
                                   "it holds Python objects besides tensors"),
    "a whole model in torch.save": (lambda p: torch.save(torch.nn.Linear(2, 2), p),
                                    "it holds Python objects besides tensors"),
    "a plain pickle": (lambda p: _write_pickle(p, {"model": {"x": [1, 2]}}), "it holds Python objects besides tensors"),
    "a torch.save archive cut short": (lambda p: (torch.save({"model": {"x": torch.zeros(64)}}, p),
                                                  p.write_bytes(p.read_bytes()[:200])),
                                       "the torch.save archive is truncated or damaged"),
    "a legacy torch.save file cut short": (lambda p: (torch.save({"x": torch.zeros(4)}, p,
                                                                 _use_new_zipfile_serialization=False),
                                                      p.write_bytes(p.read_bytes()[:40])),
                                           "the file ends early"),
    "a list of tensors": (lambda p: torch.save([torch.zeros(2)], p), "expected {'model': state_dict} of tensors, "
                                                                        "found a list"),
    "a dict with other values": (lambda p: torch.save({"model": {"x": 3}}, p), "found a dict with int values"),
}


@pytest.mark.parametrize("kind", NOT_CHECKPOINTS)
@pytest.mark.parametrize("lazy", [False, True])
def test_a_file_that_is_not_a_checkpoint_is_one_line_naming_it(tmp_path, kind, lazy, recwarn):
    """One line with the file, what it is and the fix; never torch's pages of text, and never its advice
    to load with weights_only=False (which lets a file run code)."""
    write, reason = NOT_CHECKPOINTS[kind]
    path = tmp_path / "given.pt"
    write(path)
    with pytest.raises(CheckpointError) as refused:
        read_state_dict(path, lazy=lazy)
    message = str(refused.value)
    assert message.startswith(f"{path}: ") and reason in message, message
    assert "\n" not in message and "weights_only=False" not in message and "trust" not in message
    assert "convert-checkpoint" in message  # the fix
    assert not [w for w in recwarn if "pickle protocol" in str(w.message)]  # torch's notes stay out


def test_the_start_up_check_matches_names_and_shapes_of_the_mapped_file(tmp_path):
    """The meta-device model against the mapped file (safetensors: its header) finds what loading would."""
    state = nvidia_style_state(vocab_rows=104)
    torch.save({"model": state}, tmp_path / "ckpt.pt")
    check_init_checkpoint(tmp_path / "ckpt.pt", CFG)  # fits
    narrow = BertConfig(**{**CFG.to_dict(), "intermediate_size": 48})
    with pytest.raises(CheckpointError, match=r"ckpt.pt: does not match the BERT config: .*intermediate.dense.weight "
                                              r"has shape \(32, 16\), the model needs \(48, 16\)"):
        check_init_checkpoint(tmp_path / "ckpt.pt", narrow)
    hf_model().save_pretrained(tmp_path / "hf")  # safetensors: its header only
    check_init_checkpoint(tmp_path / "hf", CFG)
    with pytest.raises(CheckpointError, match="hf: does not match the BERT config"):
        check_init_checkpoint(tmp_path / "hf", narrow)


def test_missing_and_corrupt_files_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        read_state_dict(tmp_path / "nope.pt")
    (tmp_path / "corrupt.pt").write_bytes(b"\x00not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt.pt"):
        read_state_dict(tmp_path / "corrupt.pt")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(CheckpointError, match="no model.safetensors or pytorch_model.bin"):
        read_state_dict(tmp_path / "empty_dir")
