"""BERT for pretraining, computed on a flat stream of real tokens.

Shapes: T = real tokens in the micro-batch, S = sequences, M = masked positions,
H = hidden size, V = vocabulary (padded to a multiple of 8 inside the model).

Parameter names equal HuggingFace `BertForPreTraining`'s, so its checkpoints and the
converted MLPerf phase-1 checkpoint load without renaming. The MLM decoder is tied to the
word embeddings and is applied only at the M masked positions; logits are cut back to the
real vocabulary so padded embedding rows never enter the softmax.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .attention import FlatAttention, FlatLayout, flat_layout
from .batch import FlatBatch


@dataclass(frozen=True)
class BertConfig:
    """The Google `bert_config.json` fields."""

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
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.hidden_act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (use 'gelu')")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_json(cls, path: str | Path) -> "BertConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: cannot read the BERT config ({err})") from err
        known = {f.name for f in fields(cls)}
        if "vocab_size" not in raw:
            raise ValueError(f"{path}: 'vocab_size' is missing")
        try:
            return cls(**{k: v for k, v in raw.items() if k in known})
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from err

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def padded_vocab_size(self) -> int:
        """Embedding rows, rounded up to a multiple of 8 for tensor-core GEMMs."""
        return 8 * math.ceil(self.vocab_size / 8)


@dataclass
class PretrainingOutput:
    mlm_logits: torch.Tensor  # [M, V] logits at the masked positions (real vocabulary)
    nsp_logits: torch.Tensor  # [S, 2]


def _gelu(x: torch.Tensor, kind: str) -> torch.Tensor:
    return F.gelu(x, approximate="tanh" if kind != "gelu" else "none")


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
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
        q, k, v = (p(x).view(t, self.heads, self.head_dim) for p in (self.query, self.key, self.value))
        return self.attend(q, k, v, cu_seqlens, layout).reshape(t, -1)  # [T, H]


class BertSelfOutput(nn.Module):
    """dense -> dropout -> LayerNorm(residual + .), used after attention and after the FFN."""

    def __init__(self, in_size: int, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(in_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(residual + self.dropout(self.dense(x)))


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
        return _gelu(self.dense(x), self.act)  # [T, intermediate]


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig, backend: str) -> None:
        super().__init__()
        self.attention = BertAttention(cfg, backend)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertSelfOutput(cfg.intermediate_size, cfg)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
        x = self.attention(x, cu_seqlens, layout)
        return self.output(self.intermediate(x), x)


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
    def __init__(self, cfg: BertConfig, backend: str) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg, backend)
        self.pooler = BertPooler(cfg)

    def forward(self, batch: FlatBatch) -> tuple[torch.Tensor, torch.Tensor]:
        layout = flat_layout(batch.cu_seqlens, batch.max_seqlen, batch.num_tokens, batch.row_len)
        x = self.encoder(self.embeddings(batch), batch.cu_seqlens, layout)  # [T, H]
        return x, self.pooler(x, batch.cu_seqlens)


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
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

    def __init__(self, cfg: BertConfig, attention_backend: str = "sdpa") -> None:
        super().__init__()
        self.config = cfg
        self.bert = BertModel(cfg, attention_backend)
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
