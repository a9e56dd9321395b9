"""BERT for pretraining, computed on a flat stream of real tokens.

Shapes: T = real tokens in the micro-batch, S = sequences, M = masked positions,
H = hidden size, V = vocabulary (padded to a multiple of 8 inside the model).

Parameter names equal HuggingFace `BertForPreTraining`'s, so its checkpoints and the
converted MLPerf phase-1 checkpoint load without renaming. The MLM decoder is tied to the
word embeddings and is applied only at the M masked positions; logits are cut back to the
real vocabulary so padded embedding rows never enter the softmax.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Sequence, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .attention import FlatAttention, FlatLayout, batch_layout
from .fp8_delayed import DelayedFp8Linear, delayed_fp8_mlp
from .fused_linear import linear_gelu, split_linear
from .grouped_attention import StreamPool, check_bounds
from ..data.batch import FlatBatch
from ..config.settings import DEFAULT_GROUP_BOUNDS, ConfigError

# The Google bert_config.json keys. The first five set the model's shape and have no
# sensible default, so a file must give them; the others default to BERT's published values
# (Devlin et al. 2018; the MLPerf phase-1 checkpoint's bert_config.json has the same ones).
REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
DEFAULTED_KEYS = {
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "initializer_range": 0.02,
    "layer_norm_eps": 1e-12,
}
HIDDEN_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh")
# Bytes per parameter while training: fp32 weights, gradients and the optimizer's two moments.
TRAINING_BYTES_PER_PARAMETER = 16


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_value(key: str, value: object) -> None:
    """The type and range of one key; raises ConfigError naming the key."""
    if key == "hidden_act":
        ok, want = value in HIDDEN_ACTS, f"one of {', '.join(HIDDEN_ACTS)}"
    elif key.endswith("_prob"):
        ok, want = _is_real(value) and 0.0 <= value < 1.0, "a number in [0, 1)"
    elif key in ("initializer_range", "layer_norm_eps"):
        ok, want = _is_real(value) and 0.0 < value < 1.0, "a number in (0, 1)"
    elif key == "type_vocab_size":
        ok, want = _is_int(value) and value >= 2, "an integer >= 2 (segment ids are 0 and 1)"
    else:
        ok, want = _is_int(value) and value >= 1, "an integer >= 1"
    if not ok:
        raise ConfigError(f"{key} must be {want}; got {value!r}")


@dataclass(frozen=True)
class BertConfig:
    """The Google `bert_config.json` fields (defaults: BERT-Large; `from_json` requires REQUIRED_KEYS)."""

    vocab_size: int
    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    intermediate_size: int = 4096
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_value(f.name, getattr(self, f.name))
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                              f"{self.num_attention_heads}: each head gets hidden_size / num_attention_heads features")

    @classmethod
    def from_json(cls, path: str | Path) -> "BertConfig":
        """Reads and validates a bert_config.json; ConfigError names the file and the key."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ConfigError(f"{path}: cannot read the BERT config ({err})") from err
        try:
            return cls(**_known_keys(raw))
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from err

    @property
    def parameter_count(self) -> int:
        """Trainable parameters of BertForPreTraining (padded vocabulary; the decoder is tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.padded_vocab_size
        embeddings = (v + self.max_position_embeddings + self.type_vocab_size) * h + 2 * h
        layer = 4 * h * h + 2 * h * i + i + 9 * h  # Q, K, V, output, FFN in and out, two LayerNorms
        heads = (h * h + h) + (h * h + 3 * h) + v + (2 * h + 2)  # pooler, MLM transform, MLM bias, NSP
        return embeddings + self.num_hidden_layers * layer + heads

    @property
    def head_dim(self) -> int:
        """Features per attention head."""
        return self.hidden_size // self.num_attention_heads

    @property
    def training_bytes(self) -> int:
        """Memory of weights, gradients and optimizer moments in fp32 (activations not counted)."""
        return TRAINING_BYTES_PER_PARAMETER * self.parameter_count

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def padded_vocab_size(self) -> int:
        """Embedding rows, rounded up to a multiple of 8 for tensor-core GEMMs."""
        return 8 * math.ceil(self.vocab_size / 8)


def _known_keys(raw: object) -> dict:
    """The file's keys: required ones present, unknown ones refused, the rest defaulted."""
    if not isinstance(raw, dict):
        raise ConfigError(f"must hold a JSON object of BERT config keys; got {type(raw).__name__}")
    missing = [key for key in REQUIRED_KEYS if key not in raw]
    if missing:
        raise ConfigError(f"{', '.join(missing)} missing; a bert_config.json must give {', '.join(REQUIRED_KEYS)}")
    unknown = sorted(set(raw) - set(REQUIRED_KEYS) - set(DEFAULTED_KEYS))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(map(repr, unknown))}; the keys are "
                          f"{', '.join(REQUIRED_KEYS + tuple(DEFAULTED_KEYS))}")
    return {**DEFAULTED_KEYS, **raw}


@dataclass
class PretrainingOutput:
    mlm_logits: torch.Tensor  # [M, V] logits at the masked positions (real vocabulary)
    nsp_logits: torch.Tensor  # [S, 2]


def _gelu(x: torch.Tensor, kind: str) -> torch.Tensor:
    return F.gelu(x, approximate="tanh" if kind != "gelu" else "none")


def fused_projection(linears: Sequence[nn.Linear], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The outputs of `linears` on the same input: one GEMM over their stacked weights (query, key and
    value: [T, H] x [H, 3H]), split into views, so the input is read (and under FP8 cast) once and its
    gradient comes from one GEMM, not three and two adds. The parameters stay the three layers' own
    (HuggingFace's names). Layers of another kind (torchao's Float8Linear) run one by one."""
    kinds = {type(linear) for linear in linears}
    if kinds != {nn.Linear} and kinds != {DelayedFp8Linear}:
        return tuple(linear(x) for linear in linears)
    biases = [linear.bias for linear in linears]
    bias = None if any(b is None for b in biases) else torch.cat(biases)  # type: ignore[arg-type]
    sizes = tuple(linear.out_features for linear in linears)
    if kinds == {DelayedFp8Linear}:  # its cast reads the weights, and its backward their gradients, where they are
        weights = [linear.weight for linear in linears]
        return DelayedFp8Linear.split_outputs(linears[0], weights, bias, x, sizes)  # type: ignore[arg-type]
    weight = torch.cat([linear.weight for linear in linears])
    if bias is not None:  # the same, with the bias gradient in the same pass
        return split_linear(weight, bias, x, sizes)
    return F.linear(x, weight, bias).split(sizes, dim=-1)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose output, under autocast, is in the autocast dtype (bf16 / fp16), as NVIDIA's fused
    LayerNorm writes it. Statistics and normalisation stay fp32; only the result is rounded, once. That result
    is the residual stream and what the next GEMM reads: the GEMM reads it in the autocast dtype anyway, and an
    fp32 copy of it doubles what each LayerNorm, residual add and their gradients move, for no gain the GEMMs
    can keep. Without autocast (fp32) nothing changes.

    The fp32 normalisation is explicit: CUDA's autocast runs layer_norm in fp32, but the CPU's runs it in the
    autocast dtype, weight and bias rounded to it too (its weight and bias gradients then about 10 % off fp32's
    in a bf16 step), so a CPU step would not be the GPU's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if not torch.is_autocast_enabled(device):
            return super().forward(x)
        with torch.autocast(device, enabled=False):
            out = F.layer_norm(x.float(), self.normalized_shape, self.weight, self.bias, self.eps)
        return out.to(torch.get_autocast_dtype(device))


def _keep_the_sum(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """`add_and_norm`'s policy: the residual sum is saved for the backward, and so is everything else the region
    makes (nothing is recomputed, as in eager)."""
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.add.Tensor else CheckpointPolicy.PREFER_SAVE


_KEEP_THE_SUM = functools.partial(create_selective_checkpoint_contexts, _keep_the_sum)


class _NoInPlaceNote(logging.Filter):
    """torch warns, once per process, at every selective-checkpoint region it compiles that the region must not
    hold in-place ops; `add_and_norm`'s holds none (an add, a LayerNorm, a cast), so a run's log goes without it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_NoInPlaceNote())


def _norm_of_sum(norm: LayerNorm, residual: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    return norm(residual + update)


def add_and_norm(norm: LayerNorm, residual: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """norm(residual + update), with the sum kept for the backward under torch.compile.

    Left to itself, the partitioner recomputes the first LayerNorm's input in the backward from the layer's
    input, the dropout mask and the output projection's result: Inductor then makes the LayerNorm's backward in
    two kernels, the normalised input stored in fp32 between them (0.55 GB a BERT-Large layer). With the sum
    saved (bf16, 0.05 GB written in the forward) the backward is one kernel, its weight and bias gradients
    summed in the same pass (0.28 GB), as for the second LayerNorm, whose sum the partitioner saves on its own.
    A selective-checkpoint region whose policy saves everything (`_keep_the_sum`) says so; eager runs the same
    ops without it, and so saves the sum anyway."""
    if not torch.compiler.is_compiling():
        return _norm_of_sum(norm, residual, update)
    out = checkpoint(_norm_of_sum, norm, residual, update, use_reentrant=False, context_fn=_KEEP_THE_SUM)
    assert isinstance(out, torch.Tensor)
    return out


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        x = (
            self.word_embeddings(batch.input_ids)
            + self.position_embeddings(batch.position_ids)
            + self.token_type_embeddings(batch.segment_ids)
        )  # [T, H]
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig, backend: str) -> None:
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.attend = FlatAttention(backend, cfg.attention_probs_dropout_prob)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = (p.view(t, self.heads, self.head_dim)
                   for p in fused_projection((self.query, self.key, self.value), x))  # one GEMM where it can
        return self.attend(q, k, v, cu_seqlens, layout).reshape(t, -1)  # [T, H]


class BertSelfOutput(nn.Module):
    """dense -> dropout -> LayerNorm(residual + .), used after attention and after the FFN."""

    def __init__(self, in_size: int, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(in_size, cfg.hidden_size)
        self.LayerNorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.after_dense(self.dense(x), residual)

    def after_dense(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return add_and_norm(self.LayerNorm, residual, self.dropout(h))


class BertAttention(nn.Module):
    def __init__(self, cfg: BertConfig, backend: str) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg, backend)
        self.output = BertSelfOutput(cfg.hidden_size, cfg)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
        return self.output(self.self(x, cu_seqlens, layout), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The backward takes GELU's derivative and the bias gradient in its one pass over the gradient, unless a
        # hook asks for the dense layer's output (the numerics check's), which that function never makes.
        if self.act == "gelu" and not (self.dense._forward_hooks or self.dense._forward_pre_hooks):
            if isinstance(self.dense, DelayedFp8Linear):
                return self.dense(x, gelu=True)
            if type(self.dense) is nn.Linear and self.dense.bias is not None:
                return linear_gelu(self.dense, x)
        return _gelu(self.dense(x), self.act)  # [T, intermediate]


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig, backend: str) -> None:
        super().__init__()
        self.attention = BertAttention(cfg, backend)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertSelfOutput(cfg.intermediate_size, cfg)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
        x = self.attention(x, cu_seqlens, layout)
        fc1, fc2 = self.intermediate.dense, self.output.dense
        if isinstance(fc1, DelayedFp8Linear) and isinstance(fc2, DelayedFp8Linear) and self._mlp_unobserved():
            if torch.is_grad_enabled() and self._end_fusable():  # and the layer's end, fused with FC2's backward
                dropout = self.output.dropout
                return delayed_fp8_mlp(fc1, fc2, x, self.output.LayerNorm, dropout.p if dropout.training else 0.0)
            return self.output.after_dense(delayed_fp8_mlp(fc1, fc2, x), x)  # FC1, GELU and FC2 in one FP8 function
        return self.output(self.intermediate(x), x)

    def _end_fusable(self) -> bool:
        """The layer's end can run in the FP8 MLP function: its LayerNorm has a weight and a bias, and no hook asks
        for what the function never makes apart, the dropped FC2 output and the LayerNorm's input (otherwise the
        dropout, sum and LayerNorm run after the function, as in eval)."""
        norm = self.output.LayerNorm
        watched = any(m._forward_hooks or m._forward_pre_hooks for m in (self.output.dropout, norm))
        return not watched and norm.weight is not None and norm.bias is not None

    def _mlp_unobserved(self) -> bool:
        """The FP8 MLP function applies (exact GELU) and no hook asks for what it never makes: FC1's output and
        GELU's in the autocast dtype (the numerics check's FFN rows). With a hook, FC1 + GELU and FC2 run apart:
        the same values, bit for bit (tests/trainer/model/test_single_pass_ops.py)."""
        watched = (self.intermediate, self.intermediate.dense, self.output.dense)
        return self.intermediate.act == "gelu" and not any(m._forward_hooks or m._forward_pre_hooks for m in watched)


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig, backend: str) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, backend) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, cu_seqlens, layout)
        return x


class BertPooler(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        first = x[cu_seqlens[:-1].long()]  # [S, H]: the [CLS] token of each sequence
        return torch.tanh(self.dense(first))


class BertModel(nn.Module):
    """group_bounds: the length groups of the grouped back-end, whose side streams (on a GPU)
    this model keeps for all its layers."""

    def __init__(self, cfg: BertConfig, backend: str, group_bounds: Sequence[int] = DEFAULT_GROUP_BOUNDS) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg, backend)
        self.pooler = BertPooler(cfg)
        self.backend, self.group_bounds = backend, check_bounds(group_bounds)
        self.group_streams = StreamPool(len(self.group_bounds) + 1)

    def forward(self, batch: FlatBatch) -> tuple[torch.Tensor, torch.Tensor]:
        layout = batch_layout(batch, self.backend, self.group_bounds, self.group_streams)
        x = self.encoder(self.embeddings(batch), batch.cu_seqlens, layout)  # [T, H]
        return x, self.pooler(x, batch.cu_seqlens)


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(_gelu(self.dense(x), self.act))


class BertLMPredictionHead(nn.Module):
    """Transform + decoder tied to the word embeddings (passed in at call time)."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.transform = BertPredictionHeadTransform(cfg)
        self.bias = nn.Parameter(torch.zeros(cfg.padded_vocab_size))
        self.vocab_size = cfg.vocab_size

    def forward(self, x: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        logits = F.linear(self.transform(x), word_embeddings, self.bias)  # [M, V_padded]
        return logits[:, : self.vocab_size]


class BertPreTrainingHeads(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(cfg)
        self.seq_relationship = nn.Linear(cfg.hidden_size, 2)


class BertForPreTraining(nn.Module):
    """Embeddings -> encoder -> MLM head at masked positions + NSP head on [CLS]."""

    def __init__(self, cfg: BertConfig, attention_backend: str = "sdpa",
                 group_bounds: Sequence[int] = DEFAULT_GROUP_BOUNDS) -> None:
        super().__init__()
        self.config = cfg
        self.bert = BertModel(cfg, attention_backend, group_bounds)
        self.cls = BertPreTrainingHeads(cfg)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, batch: FlatBatch) -> PretrainingOutput:
        hidden, pooled = self.bert(batch)
        masked = hidden[batch.masked_positions]  # [M, H]: the MLM head never sees other tokens
        word_embeddings = self.bert.embeddings.word_embeddings.weight
        return PretrainingOutput(
            mlm_logits=self.cls.predictions(masked, word_embeddings),
            nsp_logits=self.cls.seq_relationship(pooled),
        )


@dataclass
class PretrainingLoss:
    total: torch.Tensor  # mlm + nsp, what backward() is called on
    mlm: torch.Tensor  # mean cross-entropy over the masked positions
    nsp: torch.Tensor  # mean cross-entropy over the sequences


def pretraining_loss(out: PretrainingOutput, batch: FlatBatch) -> PretrainingLoss:
    """Masked-LM plus next-sentence cross-entropy, as in BERT and MLPerf."""
    mlm = F.cross_entropy(out.mlm_logits.float(), batch.masked_lm_ids)
    nsp = F.cross_entropy(out.nsp_logits.float(), batch.next_sentence_labels)
    return PretrainingLoss(total=mlm + nsp, mlm=mlm, nsp=nsp)
