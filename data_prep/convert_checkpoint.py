"""Phase-1 checkpoint conversion between TF1, PyTorch `{'model': state_dict}` and HuggingFace.

`python data_prep/prepare.py convert-checkpoint --input model.ckpt-28252 --bert_config
bert_config.json --output phase1.pt --pad_vocab_to 8`

Inputs: a TF1 checkpoint prefix (model.ckpt-28252: .index + .data files; needs TensorFlow,
`pip install tensorflow-cpu`, imported only here), a PyTorch file, or a HuggingFace
`save_pretrained` folder. Outputs: a PyTorch file (`.pt`) or a HuggingFace folder.

Names are HuggingFace BertForPreTraining's. TF -> HF rules: "/" -> ".", layer_N ->
layer.N, kernel/gamma -> weight, beta -> bias; dense kernels are [in, out] in TF and
transposed to torch's [out, in]; cls/predictions/output_bias -> cls.predictions.bias;
cls/seq_relationship/output_weights is already [2, H] (TF multiplies by its transpose) and
is kept. Optimizer slots (adam_m, adam_v), global_step and loss-scale variables are dropped.
The MLM decoder weight is tied to the word embeddings and not stored separately.
`--pad_vocab_to 8` appends zero rows to the vocabulary tensors (NVIDIA's padded embedding).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path
from types import ModuleType

import numpy as np

from mlperf_bert.runtime.files import atomic_path
from mlperf_bert.runtime.load_errors import unloadable_reason
from mlperf_bert.runtime.optional import dependency_problem
from data_prep.formats import DataPrepError

log = logging.getLogger(__name__)

VOCAB_TENSORS = ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias")
TIED = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")
HF_BUFFERS = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")
_TF_SPECIAL = {
    "cls/predictions/output_bias": "cls.predictions.bias",
    "cls/seq_relationship/output_weights": "cls.seq_relationship.weight",
    "cls/seq_relationship/output_bias": "cls.seq_relationship.bias",
}
_TF_LEAF = {"kernel": "weight", "gamma": "weight", "beta": "bias", "bias": "bias"}
_EMBEDDINGS = re.compile(r"bert/embeddings/(word|position|token_type)_embeddings$")
_LAYER = re.compile(r"layer_(\d+)")


def tf_to_hf_name(tf_name: str) -> str | None:
    """HuggingFace name of a TF1 BERT variable; None for optimizer and bookkeeping variables."""
    if tf_name in _TF_SPECIAL:
        return _TF_SPECIAL[tf_name]
    if _EMBEDDINGS.match(tf_name):
        return tf_name.replace("/", ".") + ".weight"
    parts = tf_name.split("/")
    if parts[0] not in ("bert", "cls") or parts[-1] not in _TF_LEAF:
        return None
    return _LAYER.sub(r"layer.\1", "/".join(parts[:-1])).replace("/", ".") + "." + _TF_LEAF[parts[-1]]


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of BertForPreTraining (decoder tied) with its shape for a bert_config.json."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    shapes = {
        "bert.embeddings.word_embeddings.weight": (v, h),
        "bert.embeddings.position_embeddings.weight": (config.get("max_position_embeddings", 512), h),
        "bert.embeddings.token_type_embeddings.weight": (config.get("type_vocab_size", 2), h),
        "bert.embeddings.LayerNorm.weight": (h,), "bert.embeddings.LayerNorm.bias": (h,),
        "bert.pooler.dense.weight": (h, h), "bert.pooler.dense.bias": (h,),
        "cls.predictions.bias": (v,), "cls.predictions.transform.dense.weight": (h, h),
        "cls.predictions.transform.dense.bias": (h,), "cls.predictions.transform.LayerNorm.weight": (h,),
        "cls.predictions.transform.LayerNorm.bias": (h,), "cls.seq_relationship.weight": (2, h),
        "cls.seq_relationship.bias": (2,),
    }
    layer = {
        "attention.self.query.weight": (h, h), "attention.self.query.bias": (h,),
        "attention.self.key.weight": (h, h), "attention.self.key.bias": (h,),
        "attention.self.value.weight": (h, h), "attention.self.value.bias": (h,),
        "attention.output.dense.weight": (h, h), "attention.output.dense.bias": (h,),
        "attention.output.LayerNorm.weight": (h,), "attention.output.LayerNorm.bias": (h,),
        "intermediate.dense.weight": (i, h), "intermediate.dense.bias": (i,),
        "output.dense.weight": (h, i), "output.dense.bias": (h,),
        "output.LayerNorm.weight": (h,), "output.LayerNorm.bias": (h,),
    }
    for n in range(config["num_hidden_layers"]):
        shapes.update({f"bert.encoder.layer.{n}.{k}": s for k, s in layer.items()})
    return shapes


def check_state(state: dict, config: dict, source: Path) -> None:
    """Names and shapes must equal what the config implies (vocabulary rows may be padded)."""
    want = expected_shapes(config)
    problems = [f"missing {k}" for k in want if k not in state]
    problems += [f"unexpected {k}" for k in state if k not in want]
    for name, shape in want.items():
        got = tuple(state[name].shape) if name in state else shape
        padded_ok = name in VOCAB_TENSORS and got[0] >= shape[0] and got[1:] == shape[1:]
        if got != shape and not padded_ok:
            problems.append(f"{name} is {got}, the config needs {shape}")
    if problems:
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        raise DataPrepError(f"{source}: does not match the BERT config: {shown}")


def _import_tensorflow() -> ModuleType:
    problem = dependency_problem("tensorflow", "TensorFlow", "reading a TF1 checkpoint",
                                 "pip install tensorflow-cpu (only this step uses it)",
                                 "convert the checkpoint on a machine where TensorFlow works")
    if problem is not None:
        raise DataPrepError(problem)
    import tensorflow as tf

    return tf


def read_tf_checkpoint(prefix: Path) -> dict[str, np.ndarray]:
    """The BERT weights of a TF1 checkpoint, renamed and transposed to HuggingFace layout."""
    prefix = Path(prefix)
    if prefix.is_dir():
        found = sorted(prefix.glob("*.index"))
        if len(found) != 1:
            raise DataPrepError(
                f"{prefix}: holds {len(found)} checkpoints; give the prefix, e.g. {prefix}/model.ckpt-28252")
        prefix = found[0].with_suffix("")
    if not prefix.with_name(prefix.name + ".index").is_file():
        raise DataPrepError(
            f"{prefix}: no {prefix.name}.index; give the checkpoint prefix (model.ckpt-28252, no suffix)")
    tf = _import_tensorflow()
    reader = tf.train.load_checkpoint(str(prefix))
    state, skipped = {}, []
    for tf_name in sorted(reader.get_variable_to_shape_map()):
        name = tf_to_hf_name(tf_name)
        if name is None:
            skipped.append(tf_name)
            continue
        value = np.asarray(reader.get_tensor(tf_name), dtype=np.float32)
        state[name] = np.ascontiguousarray(value.T) if tf_name.endswith("/kernel") else value
    log.info("convert: %d tensors from %s (%d optimizer/bookkeeping variables skipped)", len(state), prefix,
             len(skipped))
    return state


def read_bert_config(path: Path) -> dict:
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DataPrepError(
            f"{path}: cannot read the BERT config ({err}); pass --bert_config bert_config.json") from err
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size") if k not in config]
    if missing:
        raise DataPrepError(f"{path}: BERT config without {', '.join(missing)}")
    return config


def read_pt(path: Path) -> dict[str, np.ndarray]:
    import torch

    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for corrupt or unsafe files
        raise DataPrepError(f"{path}: cannot read the PyTorch checkpoint: {unloadable_reason(path, err)}") from err
    state = raw.get("model", raw) if isinstance(raw, dict) else None
    if not isinstance(state, dict):
        raise DataPrepError(f"{path}: expected {{'model': state_dict}}")
    return {k: v.float().numpy() for k, v in state.items() if k not in TIED + HF_BUFFERS}


def read_hf(directory: Path) -> tuple[dict[str, np.ndarray], dict]:
    """(state, bert_config dict) of a HuggingFace save_pretrained folder."""
    from transformers import BertForPreTraining

    try:
        model = BertForPreTraining.from_pretrained(str(directory))
    except (OSError, ValueError) as err:
        raise DataPrepError(f"{directory}: not a HuggingFace BertForPreTraining folder ({err})") from err
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items() if k not in TIED + HF_BUFFERS}
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
            "type_vocab_size", "initializer_range", "layer_norm_eps")
    return state, {k: getattr(model.config, k) for k in keys}


def pad_vocab(state: dict[str, np.ndarray], multiple: int) -> dict[str, np.ndarray]:
    """Zero rows appended to the vocabulary tensors up to a multiple of `multiple`."""
    if multiple <= 1:
        return state
    padded = dict(state)
    for name in VOCAB_TENSORS:
        rows = state[name].shape[0]
        extra = -rows % multiple
        padded[name] = np.concatenate([state[name], np.zeros((extra,) + state[name].shape[1:], np.float32)])
    return padded


def unpad_vocab(state: dict[str, np.ndarray], vocab_size: int) -> dict[str, np.ndarray]:
    return {k: (v[:vocab_size] if k in VOCAB_TENSORS else v) for k, v in state.items()}


def write_pt(state: dict[str, np.ndarray], path: Path) -> None:
    import torch

    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}
    with atomic_path(path) as temp:
        torch.save({"model": tensors}, temp)


def write_hf(state: dict[str, np.ndarray], config: dict, directory: Path) -> None:
    """A HuggingFace BertForPreTraining folder (config.json + model.safetensors)."""
    import torch
    from transformers import BertConfig, BertForPreTraining

    model = BertForPreTraining(BertConfig(**config))
    real = unpad_vocab(state, config["vocab_size"])
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in real.items()}
    result = model.load_state_dict(tensors, strict=False)
    missing = [k for k in result.missing_keys if k not in TIED + HF_BUFFERS]
    if missing or result.unexpected_keys:
        raise DataPrepError(
            f"{directory}: HuggingFace model mismatch: missing {missing}, unexpected {result.unexpected_keys}")
    with atomic_path(directory) as temp:
        model.save_pretrained(str(temp))


def detect_kind(path: Path) -> str:
    """'hf' for a folder with config.json, 'pt' for .pt/.pth/.bin files, 'tf' otherwise."""
    if path.is_dir() and (path / "config.json").is_file():
        return "hf"
    if path.suffix in (".pt", ".pth", ".bin"):
        return "pt"
    return "tf"


def convert(source: Path, output: Path, bert_config: Path | None, to: str | None = None, pad_vocab_to: int = 1) -> None:
    """Converts `source` (tf / pt / hf) into `output` (pt file or hf folder)."""
    kind, target = detect_kind(source), to or ("pt" if output.suffix in (".pt", ".pth") else "hf")
    if kind == "hf":
        state, config = read_hf(source)
    else:
        if bert_config is None:
            raise DataPrepError(f"{source}: a {kind} checkpoint needs --bert_config bert_config.json")
        config = read_bert_config(bert_config)
        state = read_tf_checkpoint(source) if kind == "tf" else read_pt(source)
    check_state(state, config, source)
    if target == "pt":
        write_pt(pad_vocab(unpad_vocab(state, config["vocab_size"]), pad_vocab_to), output)
    else:
        write_hf(state, config, output)
    log.info("convert: %s (%s) -> %s (%s)", source, kind, output, target)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", type=Path, required=True,
                        help="TF1 checkpoint prefix (model.ckpt-28252), a .pt file or a HuggingFace folder")
    parser.add_argument("--bert_config", type=Path, help="bert_config.json (needed for TF and .pt inputs)")
    parser.add_argument("--output", type=Path, required=True, help="a .pt file or a folder for HuggingFace")
    parser.add_argument("--to", choices=("pt", "hf"), help="output kind (default: pt for .pt/.pth, else hf)")
    parser.add_argument("--pad_vocab_to", type=int, default=1,
                        help="pad the vocabulary rows of a .pt output to a multiple of this (8 for NVIDIA's layout)")


def run(args: argparse.Namespace) -> int:
    convert(args.input, args.output, args.bert_config, args.to, args.pad_vocab_to)
    return 0
