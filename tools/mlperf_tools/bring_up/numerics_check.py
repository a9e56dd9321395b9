"""Layer-by-layer numerics of the model under test against an fp64 reference on the CPU.

    PYTHONPATH=pytorch:. python tools/numerics_check.py                        # demo-size model, fp32, CPU
    PYTHONPATH=pytorch:. python tools/numerics_check.py --device cuda --precision bf16 \\
        --attention_backend varlen --compile_mode default --input_layout packed \\
        --bert_config_path bert_config.json [--init_checkpoint phase1/model.ckpt-28252.pt] [--cuda_graphs]

The configuration under test is given with the trainer's own flags (`config/cli.py`'s parser:
--precision, --attention_backend, --compile_mode, --cuda_graphs, --input_layout, --device,
--bert_config_path, --init_checkpoint, --seed, --max_seq_length, --max_predictions_per_seq) plus
--rows and --batches of this check; flags that only concern training are accepted and unused.
Without --bert_config_path the model is the demo's (data_prep/make_demo_data.py's defaults:
2 layers, hidden 128), so the check runs in seconds on a CPU.

What is compared. The model is built as the trainer builds it (`build.cpu_model`: seeded
weights or --init_checkpoint, FP8 layers under --precision fp8; `build.build_model`: device and
--compile_mode). The reference is a copy of the same weights in fp64 on the CPU, eager, with
the plainest exact attention (`sdpa`: per-sequence padding and a key mask), on flat batches of
the same sequences. Both run forward and backward (`train.step.forward_backward`, autocast as
in training; dropout off, as in eval) on `--batches` batches of `--rows` packed rows each,
drawn from the Wikipedia phase-2 length histogram (lengths scaled to --max_seq_length; the
throughput benchmark's synthetic sequences). The device run feeds them in --input_layout:
packed (static rows, attention row by row; under --cuda_graphs one captured forward+backward
replayed per batch), unpadded (flat) or padded (unpadded on the device); only real tokens,
sequences and predictions are compared. One row per layer and quantity:
  embeddings   the embedding LayerNorm's output
  layer i      attention (the attention back-end's output), attention LN (after the output
               projection, residual and LayerNorm), FFN (GELU of the first FFN GEMM),
               output LN (the layer's output)
  heads        pooler, NSP logits, MLM transform, MLM logits
  loss         mlm, nsp, total
  grad         each weight's gradient, in the order backward computes them (heads, the last
               layer down to the first, embeddings)
Each row's error is the normwise relative error ||test - ref|| / ||ref||, judged batch by batch
(the batch furthest out of its band counts). A non-finite value is an infinite error, outside any
band.

Tolerance bands, derived from the formats' rounding. Rounding to nearest with unit roundoff u
(fp32 2^-24, bf16 2^-8, fp16 2^-11, FP8 e4m3 2^-4, e5m2 2^-3) makes a relative error spread
evenly over [-u, u]: rms u/sqrt(3). A GEMM of inner size K whose two operands are rounded to
u_a and u_b, accumulated in fp32 (a random walk of K roundings: sqrt(K) 2^-24) and rounded to
u_out, has the normwise error
    e(K) = sqrt(u_a^2 + u_b^2 + K 2^-48 + u_out^2) / sqrt(3)
(independent errors add in quadrature; relative to the GEMM's result when its terms are
random-signed: the condition factor below corrects that where they are not). The operands are the
autocast dtype's (fp32 under fp32), e4m3 for the six GEMMs of each encoder layer under fp8 (their
backward's output gradients e5m2: torchao's recipe, model/fp8.py); softmax and the loss run in fp32
under autocast, so their stages cost e = 2^-24 / sqrt(3); a LayerNorm computes in fp32 and rounds its
output once to the autocast dtype (`bert.LayerNorm`: the residual stream and the next GEMM's input), so
its stage costs that dtype's u / sqrt(3) (2^-24 / sqrt(3) under fp32). Stages: the embeddings; per
layer the QKV GEMM, the two attention GEMMs (K = max(head_dim, max_seqlen)), the output projection
with its LayerNorm, the two FFN GEMMs; the heads. Errors add up along the path in variance:
- inside a residual branch (attention, FFN rows) a row carries the residual stream's variance S
  and the branch's own stages so far;
- where a branch rejoins the stream (the LayerNorm rows) S grows by the branch's variance times
  rho^2, rho = ||branch|| / ||residual + branch||, the branch's share of the LayerNorm's input,
  measured on the reference itself (`BranchShares`). This is what keeps a 24-layer stack's bands
  from growing with depth where its errors do not: LayerNorm and the residual dilute each branch's
  fresh rounding;
- a weight's gradient carries the whole forward's variance (without the rho credit: the backward
  stream's shares are not measured), the backward data-gradient GEMMs from the loss down to its
  stage and its own weight-gradient GEMM (K = tokens). Gradient bands are the loosest rows.
    band = GROWTH * sqrt(variance) * max(1, kappa)
GROWTH covers what the sum leaves out: each stage's amplification of the error it receives
(LayerNorm's 1/sigma, softmax, GELU) and the spread of a normwise error around its rms. It is 8,
set from measurements (docs/BRING_UP.md): clean runs of three model sizes on the CPU in fp32 and
bf16, packed, unpadded and padded, over seeds (tests/tools/bring_up/test_numerics_bands.py's property test), and
of the demo model in emulated FP8 stay within 0.28 of their bands, while the planted faults of
tests/tools/bring_up/test_numerics_check.py leave theirs by 16x to 10^6x in fp32.

Cancellation: the condition factor kappa. The variance above is relative to each row's own size,
which holds for a sum of random-signed terms (a random walk: |sum| ~ sqrt(sum of squares)) but not
for one whose terms cancel. Take a row computed as the sum y = sum_j t_j (per element: a GEMM's
dot product, a weight gradient's sum over tokens). Each term arrives with a relative error d_j of
rms e (its operands' rounding and the error they carry), so y's error is sum_j t_j d_j. Split
d_j = c + d'_j into what the terms share (similar inputs round alike) and what they do not: the
shared part cancels as the terms do, a relative error e of y; the independent part has rms
e * sqrt(sum_j t_j^2), relative to y
    e * kappa,   kappa = sqrt(sum_j t_j^2) / |sum_j t_j|
and over a row's elements, normwise, kappa = sqrt(sum over elements and terms of t^2) / ||y||.
Random-signed terms give kappa ~ 1, terms of one sign kappa <= 1, and cancelling terms kappa >> 1:
the NSP head's weight gradient sum_s (p_s - label_s) pooled_s runs over a few sequences whose
pooled vectors are nearly alike at seeded weights, and labels of both kinds keep only their small
differences (kappa up to 80 on the demo models). This is the classical summation bound's condition
number with squares for absolute values: that bound, |fl(sum t) - sum t| <= gamma_n sum_j |t_j|,
is for errors that conspire in sign and, for random-signed terms, is sqrt(n) times this one, which
would loosen every row by the square root of its inner size (16 at 256 tokens) where this check's
variances are rms throughout. A band is multiplied by max(1, kappa): below 1 the terms' own
rounding shrinks but the result's does not. kappa is measured per batch on the fp64 reference
(`SumConditions`), a second computation of each row's sum from squared operands, never from the
run under test:
  GEMM rows (FFN, pooler, NSP logits, MLM transform, MLM logits: the GEMM before the activation):
      Y = X W^T + b,  sum t^2 = sum_i ||X[:, i]||^2 ||W[:, i]||^2 + rows * ||b||^2
  attention: sum over sequences, heads, queries q and keys j of P_qj^2 ||v_j||^2
  LayerNorm rows: residual + branch (embeddings: word + position + token type), sum of ||term||^2
  weight gradients, dW = sum_t g_t x_t^T over the tokens (sequences, predictions) of the batch:
      sum_t ||g_t||^2 ||x_t||^2; a LayerNorm's weight sum_t ||g_t * xhat_t||^2; an embedding table
      sum_t ||g_t||^2, the tied word table also the MLM decoder's sum_m ||dlogits_m||^2 ||h_m||^2
  losses: means of positive terms, kappa <= 1, no factor.
kappa covers the row's own sum. A cancellation earlier on the path reaches the row as carried error
that the rms model and GROWTH account for (the softmax backward of near-uniform attention behind
the key weights' gradients, BRING_UP.md).

Output: a table with one row per layer and quantity (error, band, its condition factor,
error/band), the first row out of its band marked; the last line names it. Exit status 0 when
every row is inside its band, 1 when one is not, 2 for a usage error (one line naming the flag or
file).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from data_prep.make_demo_data import bert_config as demo_bert_config, parse_args as demo_args
from mlperf_bert.build import build_model, cpu_model, resolve_device
from mlperf_bert.config.cli import build_parser, config_from_args
from mlperf_bert.config.settings import ConfigError, TrainConfig
from mlperf_bert.data.batch import IGNORE_INDEX, FlatBatch, Item, PaddedBatch, flatten_items, pad_items, unpad
from mlperf_bert.data.static_batch import static_packed_batch
from mlperf_bert.model.bert import BertConfig, BertForPreTraining, BertLMPredictionHead, PretrainingOutput
from mlperf_bert.model.fp8 import Fp8Recipe
from mlperf_bert.optim.loss_scale import DeviceLossScaler
from mlperf_bert.startup import device_problems
from mlperf_bert.train.cuda_graphs import capture, copy_batch
from mlperf_bert.train.step import forward_backward
from mlperf_bert.runtime.files import output_file
from mlperf_tools.bring_up.workload import SEQS_PER_ROW, row_strategies, synthetic_sample

# Unit roundoff of each format (half the distance from 1 to the next number).
UNIT_ROUNDOFF = {"fp64": 2.0**-53, "fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11, "e4m3": 2.0**-4,
                 "e5m2": 2.0**-3}
GROWTH = 8.0  # see the module docstring
# fp16 gradients would underflow unscaled; a fixed scale keeps the check free of skipped steps.
FP16_LOSS_SCALE = 2.0**12
# The demo's model (data_prep/make_demo_data.py's defaults: 2 layers, hidden 128), the check's default.
DEMO_BERT = demo_bert_config(demo_args(["--output_dir", "-"]))


# ---------------------------------------------------------------- what a precision rounds


@dataclass(frozen=True)
class Formats:
    """The formats a --precision rounds to (names of UNIT_ROUNDOFF)."""

    gemm: str  # GEMM operands and outputs (the autocast dtype; fp32 without autocast)
    fp8_forward: str | None = None  # the encoder's FP8 GEMMs: activations and weights
    fp8_backward: str | None = None  # their output gradients


FORMATS = {"fp32": Formats("fp32"), "bf16": Formats("bf16"), "fp16": Formats("fp16"),
           "fp8": Formats("bf16", "e4m3", "e5m2")}


def gemm_error(a: str, b: str, k: int, out: str) -> float:
    """rms normwise error of a GEMM with operands rounded to formats a and b, inner size k, fp32 accumulation."""
    u = UNIT_ROUNDOFF
    return math.sqrt(u[a] ** 2 + u[b] ** 2 + k * u["fp32"] ** 2 + u[out] ** 2) / math.sqrt(3)


FP32_STAGE = UNIT_ROUNDOFF["fp32"] / math.sqrt(3)  # softmax and the loss: fp32 under autocast


def layer_norm_stage(formats: Formats) -> float:
    """A LayerNorm's stage error: computed in fp32, its output rounded once to the autocast dtype (`bert.LayerNorm`)."""
    return UNIT_ROUNDOFF[formats.gemm] / math.sqrt(3)


@dataclass(frozen=True)
class Stage:
    """One step of the forward pass: its forward error, its backward data-gradient error, the
    weight-gradient error of its parameters, the capture key it ends in (if compared) and its weights."""

    forward: float
    backward: float
    weight_grad: float
    key: str | None = None
    weights: tuple[str, ...] = ()
    layer: int | None = None  # the encoder layer whose residual branch holds this stage
    branch: str | None = None  # "attention" or "ffn"
    closes_branch: bool = False  # output projection + residual add + LayerNorm: the branch joins the stream
    joins: float = 0.0  # a closing stage's LayerNorm output rounding (variance), which enters the stream at full weight


@dataclass(frozen=True)
class RowSpec:
    where: str  # "layer 3", "heads", "grad layer 3"
    quantity: str
    key: str  # capture key
    band: float


def _gemm_stage(formats: Formats, k: int, tokens: int, fp8: bool, key: str | None = None,
                weights: tuple[str, ...] = (), extra: float = 0.0, layer: int | None = None,
                branch: str | None = None, closes_branch: bool = False) -> Stage:
    """A linear layer's stage; `extra`: the variance of the stage that follows it (LayerNorm, GELU)."""
    g = formats.gemm
    fwd = formats.fp8_forward if fp8 and formats.fp8_forward else g
    bwd = formats.fp8_backward if fp8 and formats.fp8_backward else g
    return Stage(math.sqrt(gemm_error(fwd, fwd, k, g) ** 2 + extra), gemm_error(bwd, fwd, k, g),
                 gemm_error(bwd, fwd, tokens, g), key, weights, layer, branch, closes_branch)


def plan_stages(bert: BertConfig, precision: str, max_seqlen: int, tokens: int) -> list[Stage]:
    """The forward pass as stages, in order (module docstring)."""
    f, h, i = FORMATS[precision], bert.hidden_size, bert.intermediate_size
    fp8 = precision == "fp8"
    norm = layer_norm_stage(f)
    fp32, rounded = FP32_STAGE**2, norm**2  # a LayerNorm's fp32 arithmetic; its output's rounding
    stages = [Stage(norm, norm, norm, "embeddings",
                    ("bert.embeddings.LayerNorm.weight", "bert.embeddings.token_type_embeddings.weight",
                     "bert.embeddings.position_embeddings.weight", "bert.embeddings.word_embeddings.weight"))]
    for n in range(bert.num_hidden_layers):
        p = f"bert.encoder.layer.{n}."
        attention_k = max(bert.head_dim, max_seqlen)
        core = math.sqrt(2) * gemm_error(f.gemm, f.gemm, attention_k, f.gemm)  # scores and probabilities x V
        qkv = tuple(f"{p}attention.self.{m}.weight" for m in ("query", "key", "value"))
        closing = replace(_gemm_stage(f, h, tokens, fp8, f"layer{n}.attention_ln",
                                      (f"{p}attention.output.dense.weight", f"{p}attention.output.LayerNorm.weight"),
                                      fp32, n, "attention", closes_branch=True), joins=rounded)
        stages += [
            _gemm_stage(f, h, tokens, fp8, None, qkv, 0.0, n, "attention"),
            Stage(math.sqrt(core**2 + FP32_STAGE**2), core, 0.0, f"layer{n}.attention", (), n, "attention"),  # softmax
            closing,
            _gemm_stage(f, h, tokens, fp8, f"layer{n}.ffn", (f"{p}intermediate.dense.weight",),
                        UNIT_ROUNDOFF[f.gemm] ** 2 / 3, n, "ffn"),
            replace(_gemm_stage(f, i, tokens, fp8, f"layer{n}.output_ln",
                                (f"{p}output.dense.weight", f"{p}output.LayerNorm.weight"), fp32, n, "ffn",
                                closes_branch=True), joins=rounded),
        ]
    stages += [
        _gemm_stage(f, h, tokens, False, "pooler", ("bert.pooler.dense.weight",)),
        _gemm_stage(f, h, tokens, False, "nsp_logits", ("cls.seq_relationship.weight",)),
        _gemm_stage(f, h, tokens, False, "mlm_transform",
                    ("cls.predictions.transform.dense.weight", "cls.predictions.transform.LayerNorm.weight"),
                    rounded),
        _gemm_stage(f, h, tokens, False, "mlm_logits"),
        Stage(FP32_STAGE, FP32_STAGE, 0.0, "loss"),
    ]
    return stages


# Capture key (after "layerN.") -> how the table names the quantity.
QUANTITY_NAMES = {"embeddings": "output", "attention": "attention", "attention_ln": "attention LN", "ffn": "FFN",
                  "output_ln": "output LN", "pooler": "pooler", "nsp_logits": "NSP logits",
                  "mlm_transform": "MLM transform", "mlm_logits": "MLM logits"}


def _row_name(key: str) -> tuple[str, str]:
    """(where, quantity) of a forward capture key."""
    if key.startswith("layer"):
        layer, _, quantity = key.partition(".")
        return f"layer {layer[len('layer'):]}", QUANTITY_NAMES[quantity]
    return ("embeddings" if key == "embeddings" else "heads"), QUANTITY_NAMES[key]


Shares = Sequence[dict[str, float]]  # per layer, per branch: ||branch|| / ||residual + branch||


def _forward_rows(stages: list[Stage], shares: Shares | None) -> Iterator[RowSpec]:
    """The residual stream's error variance grows by a branch's variance times the square of the
    branch's share of the LayerNorm's input (1 without a measured share); a row inside a branch
    carries the stream's variance and the branch's own so far."""
    stream, fresh = 0.0, 0.0
    for stage in stages:
        if stage.layer is None or stage.branch is None:
            stream += stage.forward**2
            variance = stream
        elif stage.closes_branch:
            share = 1.0 if shares is None else shares[stage.layer][stage.branch]
            stream += share**2 * (fresh + stage.forward**2) + stage.joins
            fresh, variance = 0.0, stream
        else:
            fresh += stage.forward**2
            variance = stream + fresh
        band = GROWTH * math.sqrt(variance)
        if stage.key == "loss":
            yield from (RowSpec("loss", part, f"loss.{part}", band) for part in ("mlm", "nsp", "total"))
        elif stage.key is not None:
            yield RowSpec(*_row_name(stage.key), stage.key, band)


def _grad_where(weight: str) -> str:
    if weight.startswith("bert.encoder.layer."):
        return "grad layer " + weight.split(".")[3]
    return "grad embeddings" if weight.startswith("bert.embeddings.") else "grad heads"


def _grad_rows(stages: list[Stage]) -> Iterator[RowSpec]:
    """Gradients in the order backward reaches them: the whole forward's variance, the data-gradient
    GEMMs from the loss down to the stage, and the stage's weight-gradient GEMM."""
    forward = sum(s.forward**2 for s in stages)
    backward = 0.0
    for stage in reversed(stages):
        backward += stage.backward**2
        for weight in reversed(stage.weights):
            quantity = weight.split(".", 4)[-1] if weight.startswith("bert.encoder.layer.") else weight
            band = GROWTH * math.sqrt(forward + backward + stage.weight_grad**2)
            yield RowSpec(_grad_where(weight), quantity, f"grad:{weight}", band)


def plan_rows(bert: BertConfig, precision: str, max_seqlen: int, tokens: int,
              shares: Shares | None = None) -> list[RowSpec]:
    """Every compared row with its band, in table order: the forward, the loss, the gradients.
    shares: each branch's share of its LayerNorm's input, measured on the reference (`BranchShares`)."""
    stages = plan_stages(bert, precision, max_seqlen, tokens)
    return [*_forward_rows(stages, shares), *_grad_rows(stages)]


# ---------------------------------------------------------------- batches


@dataclass(frozen=True)
class CheckBatch:
    """The sequences of `rows` packed rows, and where the device batch holds them (real tokens,
    sequences, predictions: indices into its token, sequence and prediction dimensions; None = all)."""

    rows: list[Item]
    device_batch: FlatBatch | PaddedBatch  # on the host; padded batches are unpadded on the device
    tokens: torch.Tensor | None = None
    sequences: torch.Tensor | None = None
    predictions: torch.Tensor | None = None

    @property
    def reference_batch(self) -> FlatBatch:
        return flatten_items([(s,) for row in self.rows for s in row])


def draw_rows(bert: BertConfig, rows: int, batches: int, max_seq_length: int, max_predictions: int,
              seed: int) -> list[list[Item]]:
    """`batches` x `rows` packed rows whose sequence lengths follow the Wikipedia phase-2 histogram."""
    rng = np.random.default_rng(seed)
    strategies, probs = row_strategies(max_seq_length)
    picks = rng.choice(len(strategies), size=(batches, rows), p=probs)
    return [[tuple(synthetic_sample(rng, n, bert.vocab_size, max_predictions) for n in strategies[j]) for j in batch]
            for batch in picks]


def _packed(rows: list[Item], row_len: int, widest: int) -> CheckBatch:
    batch = static_packed_batch(rows, len(rows), row_len, SEQS_PER_ROW, widest)
    tokens = torch.cat([torch.arange(r * row_len, r * row_len + sum(s.length for s in row)) for r, row in enumerate(rows)])
    sequences = torch.nonzero(batch.next_sentence_labels != IGNORE_INDEX).flatten()
    predictions = torch.nonzero(batch.masked_lm_ids != IGNORE_INDEX).flatten()
    return CheckBatch(rows, batch, tokens, sequences, predictions)


def layout_batches(drawn: list[list[Item]], layout: str, max_seq_length: int, max_predictions: int) -> list[CheckBatch]:
    """The drawn rows as the device batches of `layout` (the reference always takes them flat)."""
    if layout == "packed":
        widest = max(sum(s.masked_lm_positions.shape[0] for s in row) for rows in drawn for row in rows)
        return [_packed(rows, max_seq_length, widest) for rows in drawn]
    out = []
    for rows in drawn:
        singles = [(s,) for row in rows for s in row]
        flat = flatten_items(singles) if layout == "unpadded" else pad_items(singles, max_seq_length, max_predictions)
        out.append(CheckBatch(rows, flat))
    return out


# ---------------------------------------------------------------- running a model


def activation_modules(num_layers: int) -> dict[str, str]:
    """Submodule name -> capture key of every compared activation."""
    keys = {"bert.embeddings": "embeddings", "bert.pooler": "pooler", "cls.predictions.transform": "mlm_transform"}
    for n in range(num_layers):
        p = f"bert.encoder.layer.{n}."
        keys |= {p + "attention.self": f"layer{n}.attention", p + "attention": f"layer{n}.attention_ln",
                 p + "intermediate": f"layer{n}.ffn", p + "output": f"layer{n}.output_ln"}
    return keys


class Recorder:
    """Forward hooks that keep a copy of each compared module's output (a copy, so that under a CUDA
    graph the kept tensors are the graph's own buffers, refilled by every replay)."""

    def __init__(self, model: torch.nn.Module, num_layers: int) -> None:
        self.outputs: dict[str, torch.Tensor] = {}
        self._handles = [model.get_submodule(name).register_forward_hook(self._hook(key))
                         for name, key in activation_modules(num_layers).items()]

    def _hook(self, key: str) -> Callable:
        def keep(module: torch.nn.Module, inputs: object, output: torch.Tensor) -> None:
            self.outputs[key] = output.detach().clone()
        return keep

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class BranchShares:
    """Hooks measuring, per layer and residual branch, ||branch|| / ||residual + branch|| (the branch's
    output projection against its LayerNorm's input), the largest over the batches seen."""

    BRANCHES = {"attention": "attention.output", "ffn": "output"}

    def __init__(self, model: torch.nn.Module, num_layers: int) -> None:
        self.shares: list[dict[str, float]] = [dict.fromkeys(self.BRANCHES, 0.0) for _ in range(num_layers)]
        self._branch_norm: dict[tuple[int, str], float] = {}
        self._handles = []
        for n in range(num_layers):
            for branch, module in self.BRANCHES.items():
                prefix = f"bert.encoder.layer.{n}.{module}."
                self._handles += [
                    model.get_submodule(prefix + "dense").register_forward_hook(self._dense(n, branch)),
                    model.get_submodule(prefix + "LayerNorm").register_forward_pre_hook(self._norm_input(n, branch)),
                ]

    def _dense(self, n: int, branch: str) -> Callable:
        def keep(module: torch.nn.Module, inputs: object, output: torch.Tensor) -> None:
            self._branch_norm[n, branch] = float(torch.linalg.vector_norm(output.detach()))
        return keep

    def _norm_input(self, n: int, branch: str) -> Callable:
        def share(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            total = float(torch.linalg.vector_norm(inputs[0].detach()))
            ratio = min(1.0, self._branch_norm[n, branch] / total) if total > 0 else 1.0
            self.shares[n][branch] = max(self.shares[n][branch], ratio)
        return share

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _squares_per_row(x: torch.Tensor) -> torch.Tensor:
    """||x_t||^2 of each row t of x ([..., features] flattened to rows)."""
    flat = x.detach().reshape(-1, x.shape[-1])
    return (flat * flat).sum(-1)


def gemm_squares(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> float:
    """Sum over Y = X W^T + b's elements of its terms' squares: (X*X)(W*W)^T summed, plus b^2 per row."""
    xs = x.detach().reshape(-1, x.shape[-1])
    total = float(((xs * xs).sum(0) * (weight.detach() ** 2).sum(0)).sum())
    return total if bias is None else total + xs.shape[0] * float((bias.detach() ** 2).sum())


def outer_squares(grad: torch.Tensor, x: torch.Tensor) -> float:
    """sum_t ||g_t||^2 ||x_t||^2: the terms' squares of a weight gradient sum_t g_t x_t^T."""
    return float((_squares_per_row(grad) * _squares_per_row(x)).sum())


def attention_squares(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> float:
    """sum of P_qj^2 ||v_j||^2 over sequences, heads, queries and keys (q, k, v: [T, heads, dim]) of
    softmax(q k^T / sqrt(dim)) v; the probabilities computed again, sequence by sequence."""
    total, bounds = 0.0, cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x.detach()[start:end].transpose(0, 1) for x in (q, k, v))  # [heads, L, dim]
        probs = torch.softmax(qs @ ks.transpose(1, 2) / math.sqrt(qs.shape[-1]), dim=-1)
        total += float(((probs * probs) @ (vs * vs).sum(-1, keepdim=True)).sum())
    return total


class SumConditions:
    """Hooks on the fp64 reference that measure the condition kappa of the sum behind each row (the
    module docstring's "Cancellation"): each sum's terms' squares, summed again from squared operands,
    against the sum's norm. One batch at a time: `reset` before its forward, `conditions` after its
    backward."""

    def __init__(self, model: BertForPreTraining) -> None:
        self.model = model
        self.squares: dict[str, float] = {}  # row key -> sum of its terms' squares
        self.norms: dict[str, float] = {}  # forward row key -> ||sum||
        self._kept: dict[str, torch.Tensor] = {}
        layers = model.config.num_hidden_layers
        gemm_rows = {"bert.pooler.dense": "pooler", "cls.seq_relationship": "nsp_logits",
                     "cls.predictions.transform.dense": "mlm_transform"}
        gemm_rows |= {f"bert.encoder.layer.{n}.intermediate.dense": f"layer{n}.ffn" for n in range(layers)}
        hooks: list[torch.utils.hooks.RemovableHandle] = []
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                hooks.append(module.register_forward_hook(self._linear(name, gemm_rows.get(name))))
            elif isinstance(module, torch.nn.LayerNorm):
                hooks.append(module.register_forward_hook(self._layer_norm(name)))
            elif isinstance(module, torch.nn.Embedding):
                hooks.append(module.register_forward_hook(self._embedding(name)))
        hooks.append(model.get_submodule("bert.embeddings.LayerNorm").register_forward_pre_hook(self._embedding_sum))
        for n in range(layers):
            p = f"bert.encoder.layer.{n}."
            hooks.append(model.get_submodule(p + "attention.self.attend").register_forward_hook(self._attention(n)))
            for module, key in (("attention.output", f"layer{n}.attention_ln"), ("output", f"layer{n}.output_ln")):
                hooks += [model.get_submodule(p + module + ".dense").register_forward_hook(self._keep(key)),
                          model.get_submodule(p + module + ".LayerNorm").register_forward_pre_hook(self._residual(key))]
        hooks += [model.get_submodule("cls.predictions.transform").register_forward_hook(self._keep("mlm_logits")),
                  model.get_submodule("cls.predictions").register_forward_hook(self._decoder)]
        self._handles = hooks

    def _add(self, key: str, squares: float) -> None:
        self.squares[key] = self.squares.get(key, 0.0) + squares

    def _linear(self, name: str, row: str | None) -> Callable:
        def hook(module: torch.nn.Linear, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            x = inputs[0]
            if row is not None:
                self._add(row, gemm_squares(x, module.weight, module.bias))
                self.norms[row] = float(torch.linalg.vector_norm(output.detach()))
            output.register_hook(lambda grad: self._add(f"grad:{name}.weight", outer_squares(grad, x)))
        return hook

    def _layer_norm(self, name: str) -> Callable:
        def hook(module: torch.nn.LayerNorm, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            normed = F.layer_norm(inputs[0].detach(), module.normalized_shape, eps=module.eps)  # xhat
            output.register_hook(lambda grad: self._add(f"grad:{name}.weight", float(((grad * normed) ** 2).sum())))
        return hook

    def _embedding(self, name: str) -> Callable:
        def hook(module: torch.nn.Embedding, inputs: object, output: torch.Tensor) -> None:
            self._add("embeddings", float(_squares_per_row(output).sum()))  # a term of the embeddings' sum
            output.register_hook(lambda grad: self._add(f"grad:{name}.weight", float(_squares_per_row(grad).sum())))
        return hook

    def _embedding_sum(self, module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        self.norms["embeddings"] = float(torch.linalg.vector_norm(inputs[0].detach()))

    def _attention(self, n: int) -> Callable:
        def hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            q, k, v, cu_seqlens = inputs[:4]
            self._add(f"layer{n}.attention", attention_squares(q, k, v, cu_seqlens))
            self.norms[f"layer{n}.attention"] = float(torch.linalg.vector_norm(output.detach()))
        return hook

    def _keep(self, key: str) -> Callable:
        def hook(module: torch.nn.Module, inputs: object, output: torch.Tensor) -> None:
            self._kept[key] = output.detach()
        return hook

    def _residual(self, key: str) -> Callable:
        """The LayerNorm's input is residual + branch (the kept output projection): two terms."""
        def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            total, branch = inputs[0].detach(), self._kept.pop(key)
            self._add(key, float(_squares_per_row(total - branch).sum() + _squares_per_row(branch).sum()))
            self.norms[key] = float(torch.linalg.vector_norm(total))
        return hook

    def _decoder(self, module: BertLMPredictionHead, inputs: tuple, logits: torch.Tensor) -> None:
        """logits = h E^T + bias, E the tied word embeddings (its first `vocab_size` rows compared)."""
        hidden, table = self._kept.pop("mlm_logits"), inputs[1][: logits.shape[-1]]
        self._add("mlm_logits", gemm_squares(hidden, table, module.bias[: logits.shape[-1]]))
        self.norms["mlm_logits"] = float(torch.linalg.vector_norm(logits.detach()))
        logits.register_hook(lambda grad: self._add("grad:bert.embeddings.word_embeddings.weight",
                                                    outer_squares(grad, hidden)))

    def reset(self) -> None:
        self.squares.clear()
        self.norms.clear()
        self._kept.clear()

    def conditions(self) -> dict[str, float]:
        """Row key -> kappa of this batch (after its backward); infinite for a sum of norm 0 whose terms are not."""
        norms = self.norms | {f"grad:{name}": float(torch.linalg.vector_norm(p.grad))
                              for name, p in self.model.named_parameters() if p.grad is not None}
        return {key: _ratio(math.sqrt(squares), norms[key]) for key, squares in self.squares.items() if key in norms}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


Capture = dict[str, torch.Tensor]  # capture key -> fp64 CPU tensor (real tokens / sequences / predictions)


@dataclass
class Reference:
    """The fp64 reference's rows for each batch, its branches' shares of the residual stream and, per
    batch, the condition of each row's sum (row key -> kappa; a row without one has none)."""

    captures: list[Capture]
    shares: list[dict[str, float]]
    conditions: list[dict[str, float]]


def _select(tensor: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """On the CPU in its own dtype (`relative_error` computes in fp64): BERT-Large's gradients alone are
    1.3 GB in fp32."""
    t = tensor.detach().to("cpu")
    return t if index is None else t[index]


def _collect(outputs: Capture, out: PretrainingOutput, losses: dict[str, torch.Tensor], model: torch.nn.Module,
             batch: CheckBatch, grad_scale: float, graphed: bool = False) -> Capture:
    """The rows of one run. The model's gradients are handed over (set to None) unless a CUDA graph
    owns them (`graphed`): its replays write into the same tensors."""
    token_keys = {k for k in outputs if k.startswith("layer") or k == "embeddings"}
    got: Capture = {}
    for key, value in outputs.items():
        index = batch.tokens if key in token_keys else batch.sequences if key == "pooler" else batch.predictions
        got[key] = _select(value, index)
    got["mlm_logits"] = _select(out.mlm_logits, batch.predictions)
    got["nsp_logits"] = _select(out.nsp_logits, batch.sequences)
    got |= {f"loss.{k}": v.detach().to("cpu", torch.float64).reshape(1) for k, v in losses.items()}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grad = p.grad.detach().to("cpu")
            got[f"grad:{name}"] = grad / grad_scale if grad_scale != 1.0 else grad
    if not graphed:
        model.zero_grad(set_to_none=True)
    return got


def reference_model(model: torch.nn.Module, bert: BertConfig) -> BertForPreTraining:
    """The same weights in fp64 on the CPU, eager, sdpa attention, no FP8 layers."""
    reference = BertForPreTraining(bert, attention_backend="sdpa")
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    reference.load_state_dict(state)
    return reference.double().eval()


def reference_captures(reference: BertForPreTraining, batches: Sequence[CheckBatch]) -> Reference:
    """The reference's rows for each batch: fp64 throughout, the loss too (the trainer's loss reads fp32)."""
    layers = reference.config.num_hidden_layers
    recorder, shares, sums = Recorder(reference, layers), BranchShares(reference, layers), SumConditions(reference)
    captures, conditions = [], []
    try:
        for check in batches:
            batch = check.reference_batch
            reference.zero_grad(set_to_none=True)
            sums.reset()
            out = reference(batch)
            mlm = F.cross_entropy(out.mlm_logits, batch.masked_lm_ids)
            nsp = F.cross_entropy(out.nsp_logits, batch.next_sentence_labels)
            (mlm + nsp).backward()
            conditions.append(sums.conditions())
            flat = CheckBatch(check.rows, batch)
            captures.append(_collect(recorder.outputs, out, {"mlm": mlm, "nsp": nsp, "total": mlm + nsp}, reference,
                                     flat, 1.0))
    finally:
        recorder.remove()
        shares.remove()
        sums.remove()
    return Reference(captures, shares.shares, conditions)


def _device_batch(check: CheckBatch, device: torch.device) -> FlatBatch:
    batch = check.device_batch.to(device)
    return batch if isinstance(batch, FlatBatch) else unpad(batch)


def device_captures(model: BertForPreTraining, batches: Sequence[CheckBatch], precision: str, device: torch.device,
                    graphs: bool = False) -> list[Capture]:
    """The model under test on each batch: the trainer's forward and backward at `precision`, in eval
    mode; with `graphs`, captured once (`train.cuda_graphs.capture`) and replayed per batch."""
    model.eval()
    layers = model.config.num_hidden_layers
    scale = FP16_LOSS_SCALE if precision == "fp16" else 1.0
    recorder = Recorder(model, layers)
    try:
        run = _graphed_step(model, batches[0], precision, device, scale) if graphs else None
        captures = []
        for check in batches:
            if run is not None:
                static, replay = run
                copy_batch(static, _device_batch(check, device))
                result = replay()
            else:
                model.zero_grad(set_to_none=True)
                scaler = DeviceLossScaler(device, init_scale=scale) if precision == "fp16" else None
                result = forward_backward(model, _device_batch(check, device), precision, scaler=scaler)
            losses = {"mlm": result.loss.mlm, "nsp": result.loss.nsp, "total": result.loss.total}
            captures.append(_collect(recorder.outputs, result.output, losses, model, check, scale, run is not None))
    finally:
        recorder.remove()
    return captures


def _graphed_step(model: BertForPreTraining, first: CheckBatch, precision: str, device: torch.device,
                  scale: float) -> tuple[FlatBatch, Callable]:
    """Forward + backward captured as one CUDA graph on static buffers (run directly off a GPU)."""
    static = _device_batch(first, device)
    scaler = DeviceLossScaler(device, init_scale=scale) if precision == "fp16" else None
    # capture() clears gradients through an optimizer and restores the weights after its warm-up;
    # this one never steps (the captured function has no optimizer step).
    holder = torch.optim.SGD(model.parameters(), lr=0.0)
    replay = capture(lambda: forward_backward(model, static, precision, cache_enabled=False, scaler=scaler),
                     model, holder)
    return static, replay


# ---------------------------------------------------------------- comparing


@dataclass
class RowResult:
    """The batch furthest out of its band: its error, its band and the condition factor in that band."""

    where: str
    quantity: str
    error: float  # ||test - ref|| / ||ref||
    band: float  # the row's band times `condition`
    condition: float = 1.0  # max(1, kappa) of the row's sum in this batch

    @property
    def ratio(self) -> float:
        """error / band; infinite for a non-finite error (whatever the band) or a band of 0."""
        return self.error / self.band if math.isfinite(self.error) and self.band > 0 else math.inf

    @property
    def inside(self) -> bool:
        return math.isfinite(self.error) and self.error <= self.band

    @property
    def name(self) -> str:
        return f"{self.where} {self.quantity}"


def relative_error(test: torch.Tensor, ref: torch.Tensor) -> float:
    """||test - ref|| / ||ref||; infinite for a non-finite value or a shape the reference does not have."""
    if test.shape != ref.shape or not bool(torch.isfinite(test).all()):
        return math.inf
    test, ref = test.double(), ref.double()
    norm = float(torch.linalg.vector_norm(ref))
    diff = float(torch.linalg.vector_norm(test - ref))
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)


def compare(specs: Sequence[RowSpec], reference: Reference, test: Sequence[Capture]) -> list[RowResult]:
    """Each row in the batch furthest out of its band: the error against the band times that batch's
    condition factor max(1, kappa). A quantity the test run lacks (a gradient that never arrived) is
    an infinite error."""
    results = []
    for spec in specs:
        worst: RowResult | None = None
        for ref, conditions, got in zip(reference.captures, reference.conditions, test):
            value = got.get(spec.key)
            error = math.inf if value is None else relative_error(value, ref[spec.key])
            condition = max(1.0, conditions.get(spec.key, 1.0))
            row = RowResult(spec.where, spec.quantity, error, spec.band * condition, condition)
            if worst is None or row.ratio > worst.ratio:
                worst = row
        assert worst is not None, "compare needs at least one batch"
        results.append(worst)
    return results


def first_outside(results: Sequence[RowResult]) -> RowResult | None:
    return next((r for r in results if not r.inside), None)


def format_table(results: Sequence[RowResult]) -> str:
    first = first_outside(results)
    lines = [f"{'#':>4}  {'where':<16}{'quantity':<34}{'rel error':>11}{'band':>11}{'cond':>8}{'err/band':>10}"]
    for n, r in enumerate(results):
        mark = "  <- first out of band" if r is first else ("  out of band" if not r.inside else "")
        lines.append(f"{n:>4}  {r.where:<16}{r.quantity:<34}{r.error:>11.3e}{r.band:>11.3e}{r.condition:>8.2f}"
                     f"{r.ratio:>10.3f}{mark}")
    return "\n".join(lines)


def verdict(results: Sequence[RowResult], label: str) -> str:
    """The one closing line: which row left its band first, or that all are inside."""
    first = first_outside(results)
    if first is None:
        worst = max(results, key=lambda r: r.ratio)
        return f"PASS {label}: all {len(results)} rows inside their bands (closest: {worst.name}, {worst.ratio:.3f} of its band)"
    return (f"FAIL {label}: {first.name} is first out of band: relative error {first.error:.3e}, "
            f"{first.ratio:.1f}x its band {first.band:.3e}")


# ---------------------------------------------------------------- command line


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The trainer's parser, with its flags that concern only training given placeholders, plus the check's own."""
    parser = build_parser()
    parser.prog = "numerics_check.py"
    parser.description = __doc__.split("\n\n")[0]
    own = parser.add_argument_group("numerics check")
    own.add_argument("--rows", type=int, default=2, help="packed rows per batch")
    own.add_argument("--batches", type=int, default=2, help="batches (each compared; the worst counts)")
    own.add_argument("--json", type=output_file, help="also write the rows and the verdict here")
    # Placeholders first: a flag given again later wins (argparse keeps the last value).
    placeholders = ["--eval_dir", "-", "--output_dir", tempfile.gettempdir(), "--max_steps", "1",
                    "--submission_division", "open", "--max_seq_length", "0", "--bert_config_path", ""]
    args = parser.parse_args([*placeholders, *argv])
    if args.rows < 1 or args.batches < 1:
        parser.error("--rows and --batches must be >= 1")
    return args


def _demo_config_path(folder: Path) -> str:
    path = folder / "bert_config.json"
    path.write_text(json.dumps(DEMO_BERT, indent=2) + "\n")
    return str(path)


def resolve_config(args: argparse.Namespace, folder: Path) -> tuple[TrainConfig, BertConfig]:
    """The trainer's config of the run under test; the demo model without --bert_config_path, and
    --max_seq_length (when not given) the smaller of 512 and the model's positions."""
    if not args.bert_config_path:
        args.bert_config_path = _demo_config_path(folder)
    bert = BertConfig.from_json(args.bert_config_path)
    if args.max_seq_length == 0:
        args.max_seq_length = min(512, bert.max_position_embeddings)
    if args.max_seq_length > bert.max_position_embeddings:
        raise ConfigError(f"--max_seq_length {args.max_seq_length} exceeds max_position_embeddings "
                          f"{bert.max_position_embeddings} of {args.bert_config_path}")
    return config_from_args(args, world_size=1), bert


@dataclass
class Report:
    label: str
    device: str
    seconds: float
    rows: list[RowResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return first_outside(self.rows) is None

    def to_json(self) -> dict:
        first = first_outside(self.rows)
        return {"label": self.label, "device": self.device, "seconds": self.seconds, "passed": self.passed,
                "first_out_of_band": None if first is None else first.name, "verdict": verdict(self.rows, self.label),
                "rows": [asdict(r) | {"ratio": r.ratio} for r in self.rows]}


@dataclass
class Setup:
    """Both models and the batches, built as the trainer builds its model."""

    cfg: TrainConfig
    bert: BertConfig
    device: torch.device
    model: BertForPreTraining
    reference: BertForPreTraining
    batches: list[CheckBatch]


def build_setup(cfg: TrainConfig, bert: BertConfig, rows: int, batches: int) -> Setup:
    """The model under test (`build.cpu_model`, `build.build_model`), its fp64 reference and the batches;
    raises ConfigError / ValueError naming what this machine or model cannot run."""
    device = resolve_device(cfg.run.device, 0)
    problem = next((p for p in device_problems(cfg, bert, device) if p is not None), None)
    if problem is not None:
        raise ConfigError(problem)
    torch.manual_seed(cfg.run.seed)
    model = cpu_model(cfg, device)
    reference = reference_model(model, bert)
    model = build_model(cfg, device, model)
    length, predictions = cfg.data.max_seq_length, cfg.data.max_predictions_per_seq
    drawn = draw_rows(bert, rows, batches, length, predictions, cfg.run.seed)
    return Setup(cfg, bert, device, model, reference, layout_batches(drawn, cfg.data.input_layout, length, predictions))


def run_check(setup: Setup) -> Report:
    """Runs both models on the batches and compares them row by row."""
    start = time.perf_counter()
    cfg, run = setup.cfg, setup.cfg.run
    tokens = max(c.reference_batch.num_tokens for c in setup.batches)
    reference = reference_captures(setup.reference, setup.batches)
    specs = plan_rows(setup.bert, run.precision, cfg.data.max_seq_length, tokens, reference.shares)
    results = compare(specs, reference,
                      device_captures(setup.model, setup.batches, run.precision, setup.device, run.cuda_graphs))
    recipe = f" ({Fp8Recipe.of(run.fp8_recipe, run.fp8_layers).describe()})" if run.precision == "fp8" else ""
    label = (f"{run.precision}{recipe} on {setup.device.type}, attention {setup.model.bert.backend}, layout "
             f"{cfg.data.input_layout}, compile {run.compile_mode}{', CUDA graph' if run.cuda_graphs else ''}")
    name = torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else "cpu"
    return Report(label, name, time.perf_counter() - start, results)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory() as folder:
        try:
            cfg, bert = resolve_config(args, Path(folder))
            setup = build_setup(cfg, bert, args.rows, args.batches)
        except (ConfigError, ValueError, RuntimeError) as err:  # the flags, the files or this machine
            print(f"numerics_check.py: error: {str(err).splitlines()[0]}", file=sys.stderr)
            return 2
    report = run_check(setup)
    print(f"model: {bert.num_hidden_layers} layers, hidden {bert.hidden_size}; device {report.device}; "
          f"{args.batches} batches of {args.rows} rows of {cfg.data.max_seq_length} tokens; {report.seconds:.1f} s")
    print(format_table(report.rows))
    print(verdict(report.rows, report.label))
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
