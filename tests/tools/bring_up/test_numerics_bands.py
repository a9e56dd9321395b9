"""tools/numerics_check.py's bands hold on unmodified models: the condition factor kappa of each row's
sum is what the fp64 reference says it is, the `make demo` model passes in bf16 (its NSP head's
weight gradient cancels), and no unmodified model of three sizes fails over seeds, precisions and
layouts (the property test).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from mlperf_tools.bring_up import numerics_check as nc
import pytest
import torch
import torch.nn.functional as F

from data_prep.make_demo_data import bert_config, parse_args as demo_args
from mlperf_bert.model.bert import BertConfig

CPU = torch.device("cpu")

# The models of the property test, as make_demo_data.py flags: the demo's as `make demo` trains it
# (config_CPU_1x2.sh: vocabulary 80), the check's default (make_demo_data.py's defaults, vocabulary
# 512) and a deeper, wider one. All have 2 heads of 64 or more and 128 positions.
MODEL_SIZES = {
    "make demo": ["--vocab_size", "80"],
    "numerics_check default": [],
    "4 layers, hidden 256": ["--num_hidden_layers", "4", "--hidden_size", "256", "--num_attention_heads", "4",
                             "--intermediate_size", "1024"],
}
SEEDS = range(10)
# Small enough for make test (per seed: one fp64 reference, six runs); 2 rows of 64 tokens hold 2 to
# 6 sequences, few enough for the NSP head's gradient to cancel as in the reported case.
PROPERTY_FLAGS = ["--rows", "2", "--batches", "1", "--max_seq_length", "64", "--max_predictions_per_seq", "10"]


def write_config(folder: Path, flags: list[str]) -> Path:
    path = folder / "bert_config.json"
    path.write_text(json.dumps(bert_config(demo_args(["--output_dir", "-", *flags]))))
    return path


def build(folder: Path, size: str, *flags: str) -> nc.Setup:
    path = write_config(folder, MODEL_SIZES[size])
    args = nc.parse_args(["--device", "cpu", "--bert_config_path", str(path), *flags])
    cfg, bert = nc.resolve_config(args, folder)
    return nc.build_setup(cfg, bert, args.rows, args.batches)


def check(setup: nc.Setup, reference: nc.Reference, precision: str, layout: str) -> list[nc.RowResult]:
    data = setup.cfg.data
    batches = nc.layout_batches([b.rows for b in setup.batches], layout, data.max_seq_length,
                                data.max_predictions_per_seq)
    tokens = max(b.reference_batch.num_tokens for b in batches)
    specs = nc.plan_rows(setup.bert, precision, data.max_seq_length, tokens, reference.shares)
    return nc.compare(specs, reference, nc.device_captures(setup.model, batches, precision, CPU))


# ---------------------------------------------------------------- the condition factor


def test_sum_squares_match_their_terms():
    """Each sum's terms' squares, from squared operands, equal the terms written out one by one."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((5, 3), (4, 3), (4,)))
    terms = [[[x[t, i] * w[o, i] for i in range(3)] + [b[o]] for o in range(4)] for t in range(5)]
    assert nc.gemm_squares(x, w, b) == pytest.approx(sum(float(v) ** 2 for row in terms for out in row for v in out))
    dy = torch.randn(5, 4, generator=g, dtype=torch.float64)
    outer = sum(float(dy[t, o] * x[t, i]) ** 2 for t in range(5) for o in range(4) for i in range(3))
    assert nc.outer_squares(dy, x) == pytest.approx(outer)
    q, k, v = (torch.randn(7, 2, 3, generator=g, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    expected = 0.0
    for start, end in ((0, 3), (3, 7)):
        for h in range(2):
            probs = torch.softmax(q[start:end, h] @ k[start:end, h].T / math.sqrt(3), dim=-1)
            expected += sum(float(probs[a, j] * v[start + j, h, d]) ** 2
                            for a in range(end - start) for j in range(end - start) for d in range(3))
    assert nc.attention_squares(q, k, v, cu) == pytest.approx(expected)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[nc.Setup, nc.Reference]:
    setup = build(tmp_path_factory.mktemp("demo"), "make demo")  # the tool's defaults: 2 batches of 2 rows
    return setup, nc.reference_captures(setup.reference, setup.batches)


def test_kappa_of_nsp_gradient_is_its_sequences_cancellation(demo):
    """kappa of the NSP weight's gradient, sum_s d_s pooled_s^T over the sequences, recomputed from the
    reference's own rows: d_s = (softmax(logits_s) - onehot(label_s)) / S."""
    setup, reference = demo
    for check_batch, captured, conditions in zip(setup.batches, reference.captures, reference.conditions):
        labels = check_batch.reference_batch.next_sentence_labels
        d = (torch.softmax(captured["nsp_logits"], -1) - F.one_hot(labels, 2)) / labels.shape[0]
        pooled = captured["pooler"]
        grad = d.T @ pooled
        assert torch.allclose(grad, captured["grad:cls.seq_relationship.weight"])
        terms = float(((d**2).sum(1) * (pooled**2).sum(1)).sum())
        assert conditions["grad:cls.seq_relationship.weight"] == pytest.approx(
            math.sqrt(terms) / float(torch.linalg.vector_norm(grad)))
    # The demo's handful of sequences cancel: the band of this row widens by far more than 1.
    assert max(c["grad:cls.seq_relationship.weight"] for c in reference.conditions) > 10


def test_kappa_of_embeddings_is_its_three_terms(demo):
    setup, reference = demo
    embeddings = setup.reference.bert.embeddings
    for check_batch, conditions in zip(setup.batches, reference.conditions):
        batch = check_batch.reference_batch
        terms = (embeddings.word_embeddings(batch.input_ids), embeddings.position_embeddings(batch.position_ids),
                 embeddings.token_type_embeddings(batch.segment_ids))
        squares = sum(float((t.detach() ** 2).sum()) for t in terms)
        total = float(torch.linalg.vector_norm(sum(terms).detach()))
        assert conditions["embeddings"] == pytest.approx(math.sqrt(squares) / total)


def test_make_demo_model_passes_in_bf16(tmp_path, capsys):
    """The reported case: `make demo`'s bert_config.json, bf16, the tool's defaults. The NSP head's weight
    gradient was 1.8x its band before the bands held cancellation."""
    path = write_config(tmp_path, MODEL_SIZES["make demo"])
    assert nc.main(["--device", "cpu", "--bert_config_path", str(path), "--precision", "bf16"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("PASS bf16 on cpu"), "\n".join(lines)
    nsp = next(line for line in lines if "cls.seq_relationship.weight" in line)
    assert float(nsp.split()[-2]) > 10, nsp  # its condition factor: the band widened where the sum cancels


def test_kappa_of_the_pooler_gemm_by_hand(demo):
    """The pooler's row, Y = X W^T + b over each sequence's first token: kappa = sqrt(sum over elements and terms of
    (x_i w_oi)^2 + b_o^2) / ||Y||, the terms written out from the reference's own last layer."""
    setup, reference = demo
    dense = setup.reference.bert.pooler.dense
    w, b = dense.weight.detach(), dense.bias.detach()
    last = f"layer{setup.bert.num_hidden_layers - 1}.output_ln"
    for check_batch, captured, conditions in zip(setup.batches, reference.captures, reference.conditions):
        first = check_batch.reference_batch.cu_seqlens[:-1].long()
        x = captured[last][first]
        y = x @ w.T + b
        assert torch.allclose(torch.tanh(y), captured["pooler"])
        squares = float((torch.einsum("si,oi->soi", x, w) ** 2).sum() + x.shape[0] * (b**2).sum())
        assert conditions["pooler"] == pytest.approx(math.sqrt(squares) / float(torch.linalg.vector_norm(y)), rel=1e-9)


# ---------------------------------------------------------------- the bands by hand

# One encoder layer of hidden 128 (2 heads of 64), FFN 512, 128 positions: the rows' bands written out from the
# formats' unit roundoff (module docstring): e(a, b, K, out)^2 = (u_a^2 + u_b^2 + K 2^-48 + u_out^2) / 3.
ONE_LAYER = BertConfig(vocab_size=512, hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=512, max_position_embeddings=128)
FP32_VARIANCE = 2.0**-48 / 3  # a LayerNorm, softmax or loss stage in fp32
# --precision -> (u of the GEMMs' format, u of the encoder GEMMs' operands forward, u of their output gradients)
ROUNDOFF = {"fp32": (2.0**-24, 2.0**-24, 2.0**-24), "bf16": (2.0**-8, 2.0**-8, 2.0**-8),
            "fp16": (2.0**-11, 2.0**-11, 2.0**-11), "fp8": (2.0**-8, 2.0**-4, 2.0**-3)}


def _bands(precision: str, shares: nc.Shares | None = None) -> dict[str, float]:
    return {spec.key: spec.band for spec in nc.plan_rows(ONE_LAYER, precision, 128, 256, shares)}


def test_unit_roundoff_is_half_each_formats_epsilon():
    dtypes = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
              "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    assert nc.UNIT_ROUNDOFF == {name: torch.finfo(dtype).eps / 2 for name, dtype in dtypes.items()}


@pytest.mark.parametrize("precision", list(ROUNDOFF))
def test_forward_bands_by_hand(precision):
    """8 x the rms of the errors along the path: the embeddings' LayerNorm; in the attention branch the QKV GEMM
    (K = 128, FP8 operands under fp8) and the attention (two GEMMs of K = max(64, 128) in the autocast format, then
    softmax); the FFN row adds to the stream the FFN GEMM and GELU's rounding (u^2 / 3)."""
    u, forward, _ = ROUNDOFF[precision]
    norm = u**2 / 3  # a LayerNorm's output rounded to the autocast dtype
    qkv = (2 * forward**2 + 128 * 2.0**-48 + u**2) / 3
    attention = 2 * (3 * u**2 + 128 * 2.0**-48) / 3 + FP32_VARIANCE
    output = (2 * forward**2 + 128 * 2.0**-48 + u**2) / 3 + FP32_VARIANCE  # the output projection and its LayerNorm
    bands = _bands(precision)
    assert bands["embeddings"] == pytest.approx(8 * math.sqrt(norm), rel=1e-12)
    assert bands["layer0.attention"] == pytest.approx(8 * math.sqrt(norm + qkv + attention), rel=1e-12)
    stream = norm + qkv + attention + output + norm  # share 1 without measured shares; the LayerNorm's output rounding
    assert bands["layer0.attention_ln"] == pytest.approx(8 * math.sqrt(stream), rel=1e-12)
    ffn = (2 * forward**2 + 128 * 2.0**-48 + u**2) / 3 + u**2 / 3
    assert bands["layer0.ffn"] == pytest.approx(8 * math.sqrt(stream + ffn), rel=1e-12)


def test_a_branchs_share_scales_its_variance_into_the_stream_by_hand():
    """bf16, attention branch at share 0.5 of its LayerNorm's input: the stream takes 0.25 of the branch's variance
    (QKV, attention, output projection and LayerNorm) plus the LayerNorm's output rounded to bf16. Gradients carry the
    whole forward without that credit: their bands do not move with the shares."""
    u = 2.0**-8
    branch = (3 * u**2 + 128 * 2.0**-48) / 3 + 2 * (3 * u**2 + 128 * 2.0**-48) / 3 + FP32_VARIANCE \
        + (3 * u**2 + 128 * 2.0**-48) / 3 + FP32_VARIANCE
    shared = _bands("bf16", [{"attention": 0.5, "ffn": 0.25}])
    plain = _bands("bf16")
    stream = u**2 / 3 + 0.25 * branch + u**2 / 3  # the embeddings' and the LayerNorm's outputs, rounded to bf16
    assert shared["layer0.attention_ln"] == pytest.approx(8 * math.sqrt(stream), rel=1e-12)
    assert shared["layer0.output_ln"] < plain["layer0.output_ln"]
    grads = [key for key in plain if key.startswith("grad:")]
    assert len(grads) == 16 and {key: shared[key] for key in grads} == {key: plain[key] for key in grads}


@pytest.mark.parametrize("precision", list(ROUNDOFF))
def test_gradient_bands_by_hand(precision):
    """Backward reaches the FFN's first weight one data-gradient GEMM after the FFN's second weight (K = 128: its
    output gradients in the backward format against forward-format operands), and each weight's own gradient GEMM
    (K = 256 tokens) is alike for both: the squared bands differ by that one GEMM's variance, x 8^2."""
    u, forward, backward = ROUNDOFF[precision]
    bands = _bands(precision)
    step = bands["grad:bert.encoder.layer.0.intermediate.dense.weight"] ** 2 \
        - bands["grad:bert.encoder.layer.0.output.dense.weight"] ** 2
    assert step == pytest.approx(64 * (backward**2 + forward**2 + 128 * 2.0**-48 + u**2) / 3, rel=1e-9)
    first = bands["grad:cls.predictions.transform.LayerNorm.weight"]
    assert first > bands["loss.total"]  # a gradient carries the whole forward and more


def test_an_error_exactly_at_its_band_passes_and_kappa_under_one_keeps_the_band():
    """The pass bound is error <= band; a sum whose terms share a sign (kappa 0.5) leaves the band as it is."""
    spec = nc.RowSpec("grad heads", "w", "grad:w", 0.25)
    ref = {"grad:w": torch.ones(4, dtype=torch.float64)}
    reference = nc.Reference([ref], [], [{"grad:w": 0.5}])
    (row,) = nc.compare([spec], reference, [{"grad:w": torch.ones(4, dtype=torch.float64) * 1.25}])
    assert (row.error, row.band, row.condition, row.ratio) == (0.25, 0.25, 1.0, 1.0) and row.inside
    assert not nc.RowResult("grad heads", "w", math.nextafter(0.25, 1.0), 0.25).inside


# ---------------------------------------------------------------- the property


@pytest.mark.parametrize("size", list(MODEL_SIZES))
def test_unmodified_model_passes_over_seeds(tmp_path, size):
    """No false alarm: 10 seeds (weights and sequences) x fp32, bf16 x unpadded, packed, padded."""
    failures, closest = [], 0.0
    for seed in SEEDS:
        setup = build(tmp_path, size, "--seed", str(seed), *PROPERTY_FLAGS)
        reference = nc.reference_captures(setup.reference, setup.batches)
        for layout in ("unpadded", "packed", "padded"):
            for precision in ("fp32", "bf16"):
                results = check(setup, reference, precision, layout)
                closest = max(closest, *(r.ratio for r in results))
                if nc.first_outside(results) is not None:
                    failures.append(f"seed {seed}: {nc.verdict(results, f'{precision} {layout}')}")
    assert not failures, "\n".join(failures)
    assert closest > 0.1  # the bands are not vacuous


def test_each_batch_is_judged_against_its_own_condition():
    """A batch whose sum cancels widens its own band only: a well-conditioned batch's error still counts."""
    spec = nc.RowSpec("grad heads", "w", "grad:w", 0.1)
    ref = {"grad:w": torch.ones(4, dtype=torch.float64)}
    reference = nc.Reference([ref, ref], [], [{"grad:w": 10.0}, {}])
    test = [{"grad:w": torch.ones(4, dtype=torch.float64) * 1.5}, {"grad:w": torch.ones(4, dtype=torch.float64) * 1.2}]
    (row,) = nc.compare([spec], reference, test)
    assert (row.error, row.band, row.condition) == pytest.approx((0.2, 0.1, 1.0))
    assert not row.inside
    # A non-finite value stays out of any band, an infinite one too (a sum of norm 0 whose terms are not).
    assert not nc.RowResult("grad heads", "w", math.inf, math.inf, math.inf).inside
