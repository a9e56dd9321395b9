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
