"""Strict loading of init checkpoints into `BertForPreTraining`.

Accepted inputs:
- a PyTorch file holding `{'model': state_dict}` with HuggingFace/NVIDIA parameter names,
  the layout of the converted MLPerf phase-1 checkpoint (its vocabulary may be padded to a
  multiple of 8);
- a HuggingFace `save_pretrained` directory (`model.safetensors` or `pytorch_model.bin`).

Loading is strict: a missing or unexpected tensor, or a wrong shape, is a `CheckpointError`
that names it. Files are read with `weights_only=True`, so a checkpoint cannot run code; a file
that fails to load is one line saying why (`runtime.load_errors`). `check_init_checkpoint` runs
the same checks at start-up on the mapped file, before anything is written.
"""

from __future__ import annotations

import warnings
import zipfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ..runtime.load_errors import unloadable_reason
from ..runtime.optional import describe_error
from .bert import BertConfig, BertForPreTraining

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


NOT_FOUND_FIX = "give a .pt file or a HuggingFace directory"
FORMAT_FIX = ("give the {'model': state_dict} file data_prep/prepare.py convert-checkpoint writes, or a "
              "HuggingFace directory")


def read_state_dict(path: str | Path, lazy: bool = False) -> dict[str, torch.Tensor]:
    """Reads the tensors of a checkpoint file or HuggingFace directory (no model needed).

    lazy: map the file instead of reading it (torch's mmap; safetensors' header): the tensors'
    names and shapes are there, their data is read only when touched. For the start-up check.
    """
    path = Path(path)
    if path.is_dir():
        return _read_hf_dir(path, lazy)
    if not path.is_file():
        raise CheckpointError(f"{path}: init checkpoint not found ({NOT_FOUND_FIX})")
    raw = _torch_load(path, lazy)
    if isinstance(raw, dict) and isinstance(raw.get("model"), dict):
        raw = raw["model"]
    if not isinstance(raw, dict) or not all(isinstance(v, torch.Tensor) for v in raw.values()):
        raise CheckpointError(f"{path}: expected {{'model': state_dict}} of tensors, found {_kind(raw)}: {FORMAT_FIX}")
    return dict(raw)


def _kind(raw: object) -> str:
    if isinstance(raw, dict):
        others = sorted({type(v).__name__ for v in raw.values() if not isinstance(v, torch.Tensor)})
        return f"a dict with {', '.join(others)} values"
    return f"a {type(raw).__name__}"


def _torch_load(path: Path, lazy: bool) -> object:
    """`torch.load` with weights_only (a checkpoint cannot run code); a failure is one CheckpointError line."""
    try:
        with warnings.catch_warnings():  # torch's notes on a foreign pickle come before the refusal it explains
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True, mmap=lazy and zipfile.is_zipfile(path))
    except Exception as err:  # torch raises many types for damaged, foreign or unsafe files
        raise CheckpointError(f"{path}: cannot load the init checkpoint: {unloadable_reason(path, err)}; "
                              f"{FORMAT_FIX}") from err


def _read_hf_dir(path: Path, lazy: bool = False) -> dict[str, torch.Tensor]:
    safetensors_file = path / "model.safetensors"
    if safetensors_file.is_file():
        try:
            return _safetensors_shapes(safetensors_file) if lazy else load_file(str(safetensors_file))
        except Exception as err:  # safetensors raises its own types for a damaged header or data
            raise CheckpointError(f"{safetensors_file}: cannot read ({describe_error(err)}); copy or write it "
                                  "again") from err
    bin_file = path / "pytorch_model.bin"
    if bin_file.is_file():
        return read_state_dict(bin_file, lazy)
    raise CheckpointError(f"{path}: no model.safetensors or pytorch_model.bin in this directory")


def _safetensors_shapes(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as meta tensors of their shapes (its header only)."""
    with safe_open(str(path), framework="pt") as f:
        return {key: torch.empty(f.get_slice(key).get_shape(), device="meta") for key in f.keys()}


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


def check_init_checkpoint(path: str | Path, bert: BertConfig) -> None:
    """The start-up check of --init_checkpoint: it loads safely and its names and shapes fit `bert`,
    found without reading its data (the file mapped, the model built on the meta device)."""
    state = {name: torch.empty(t.shape, device="meta") for name, t in read_state_dict(path, lazy=True).items()}
    with torch.device("meta"):
        model = BertForPreTraining(bert)
    adapt_state_dict(state, model, path)


def load_init_checkpoint(model: BertForPreTraining, path: str | Path) -> None:
    """Loads an init checkpoint strictly into `model` (in place)."""
    state = adapt_state_dict(read_state_dict(path), model, path)
    model.load_state_dict(state, strict=True)
