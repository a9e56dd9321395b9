"""Strict loading of init checkpoints into `BertForPreTraining`.

Accepted inputs:
- a PyTorch file holding `{'model': state_dict}` with HuggingFace/NVIDIA parameter names,
  the layout of the converted MLPerf phase-1 checkpoint (its vocabulary may be padded to a
  multiple of 8);
- a HuggingFace `save_pretrained` directory (`model.safetensors` or `pytorch_model.bin`).

Loading is strict: a missing or unexpected tensor, or a wrong shape, is a `CheckpointError`
that names it. Files are read with `weights_only=True`, so a checkpoint cannot run code.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .bert import BertForPreTraining

# Tensors that some checkpoints store twice because the MLM decoder is tied to them.
TIED_ALIASES = {
    "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
    "cls.predictions.decoder.bias": "cls.predictions.bias",
}
# Non-parameter buffers that HuggingFace models save and that carry no learned state.
IGNORED_BUFFERS = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")
# Tensors whose first dimension is the (possibly padded) vocabulary.
VOCAB_ROWS = ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias")


class CheckpointError(ValueError):
    """An init checkpoint that cannot be loaded; the message names the file and tensor."""


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Reads the tensors of a checkpoint file or HuggingFace directory (no model needed)."""
    path = Path(path)
    if path.is_dir():
        return _read_hf_dir(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: init checkpoint not found (give a .pt file or a HuggingFace directory)")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for corrupt or unsafe files
        raise CheckpointError(f"{path}: cannot read the checkpoint ({type(err).__name__}: {err})") from err
    if isinstance(raw, dict) and isinstance(raw.get("model"), dict):
        raw = raw["model"]
    if not isinstance(raw, dict) or not all(isinstance(v, torch.Tensor) for v in raw.values()):
        raise CheckpointError(f"{path}: expected {{'model': state_dict}} of tensors")
    return dict(raw)


def _read_hf_dir(path: Path) -> dict[str, torch.Tensor]:
    safetensors_file = path / "model.safetensors"
    if safetensors_file.is_file():
        from safetensors.torch import load_file

        try:
            return load_file(str(safetensors_file))
        except Exception as err:
            raise CheckpointError(f"{safetensors_file}: cannot read ({err})") from err
    bin_file = path / "pytorch_model.bin"
    if bin_file.is_file():
        return read_state_dict(bin_file)
    raise CheckpointError(f"{path}: no model.safetensors or pytorch_model.bin in this directory")


def _drop_aliases(state: dict[str, torch.Tensor], source: Path) -> dict[str, torch.Tensor]:
    state = {k: v for k, v in state.items() if k not in IGNORED_BUFFERS}
    for alias, target in TIED_ALIASES.items():
        if alias in state and target in state and state[alias].shape != state[target].shape:
            raise CheckpointError(f"{source}: tied tensor {alias} has shape {tuple(state[alias].shape)}, "
                                  f"but {target} has {tuple(state[target].shape)}")
        if alias in state and target not in state:
            state[target] = state[alias]
        state.pop(alias, None)
    return state


def _fit_vocab(tensor: torch.Tensor, rows: int, vocab_size: int, name: str, source: Path) -> torch.Tensor:
    """Copies the real vocabulary rows into a tensor with the model's (padded) row count."""
    if tensor.shape[0] < vocab_size:
        raise CheckpointError(
            f"{source}: {name} has {tensor.shape[0]} vocabulary rows, the BERT config needs {vocab_size}"
        )
    fitted = tensor.new_zeros((rows, *tensor.shape[1:]))
    fitted[:vocab_size] = tensor[:vocab_size]
    return fitted


def adapt_state_dict(
    state: dict[str, torch.Tensor], model: BertForPreTraining, source: str | Path = "<checkpoint>"
) -> dict[str, torch.Tensor]:
    """Renames tied aliases, fits padded vocabularies, and checks names and shapes strictly."""
    source = Path(source)
    state = _drop_aliases(state, source)
    expected = model.state_dict()
    for name in VOCAB_ROWS:
        if name in state:
            state[name] = _fit_vocab(state[name], expected[name].shape[0], model.config.vocab_size, name, source)
    problems = [f"missing tensor {k}" for k in expected if k not in state]
    problems += [f"unexpected tensor {k}" for k in state if k not in expected]
    problems += [
        f"{k} has shape {tuple(state[k].shape)}, the model needs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(f"{source}: does not match the BERT config: {shown}")
    return state


def load_init_checkpoint(model: BertForPreTraining, path: str | Path) -> None:
    """Loads an init checkpoint strictly into `model` (in place)."""
    state = adapt_state_dict(read_state_dict(path), model, path)
    model.load_state_dict(state, strict=True)
