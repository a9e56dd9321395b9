"""benchmarks/throughput.py: its synthetic data and its tiny CPU run, as a user runs it."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mlperf_bert.model import flops
from mlperf_bert.data.batch import flatten_items, pad_items
from mlperf_bert.model.bert import BertConfig, BertForPreTraining, pretraining_loss
from mlperf_bert.data.lengths import load_length_histogram
from mlperf_tools.bring_up import workload
from tests.harness.commands import load_script, run_cli
from tests.harness.paths import REPO

SCRIPT = REPO / "benchmarks" / "throughput.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT, "throughput_bench")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("throughput") / "tiny.json"
    result = run_cli([sys.executable, str(SCRIPT), "--config", "tiny", "--device", "cpu", "--steps", "2",
                      "--warmup", "1", "--rounds", "3", "--json", str(out)], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text())


def test_tiny_cpu_run_reports_every_layout_with_positive_rates(tiny_run):
    results = {r["layout"]: r for r in tiny_run["results"]}
    assert set(results) == {"padded", "unpadded", "packed", "hf_padded"}
    assert tiny_run["peak_tflops"] > 0 and tiny_run["peak_dtype"] == "float32"
    assert tiny_run["precisions"] == ["fp32"] and tiny_run["rounds"] == 3
    for r in results.values():
        assert r["status"] == "ok" and r["precision"] == "fp32", r
        assert r["steps"] == 2 and r["sequences_per_s"] > 0 and r["useful_tflops"] > 0
        assert r["utilisation"] == pytest.approx(r["useful_tflops"] / tiny_run["peak_tflops"], rel=1e-6)
        assert len(r["round_seconds"]) == 3 and r["seconds"] == pytest.approx(np.median(r["round_seconds"]))


def test_tiny_cpu_run_takes_each_speedup_within_its_round(tiny_run):
    """Per round: hf_padded's seconds over the set-up's; the reported speed-up is their median, with the spread."""
    results = {r["layout"]: r for r in tiny_run["results"]}
    hf = results["hf_padded"]["round_seconds"]
    for r in results.values():
        per_round = [h / s for h, s in zip(hf, r["round_seconds"])]
        assert r["speedups_vs_hf"] == pytest.approx(per_round)
        assert r["speedup_vs_hf"] == pytest.approx(np.median(per_round))
        assert (r["speedup_min"], r["speedup_max"]) == pytest.approx((min(per_round), max(per_round)))
    assert results["hf_padded"]["speedups_vs_hf"] == [1.0, 1.0, 1.0]


def test_rounds_run_every_setup_once_in_rotating_order(bench, monkeypatch):
    """Round r starts with set-up r (mod n): no set-up always runs first, or right after the same neighbour."""
    order: list[str] = []
    cfg = bench.CONFIGS["tiny"]
    ctx = bench.Context(cfg, torch.device("cpu"), "fp32", "none", False, "auto", "sdpa", 0, ("fp32",))

    def setup(name: str):
        runner = bench.Runner(lambda batch: order.append(name), [None] * (cfg.warmup + cfg.steps), lambda: 0.0,
                              prefetch=False)
        return bench.Setup(ctx, bench.Result(name, "fp32", "ok"), runner)

    setups = [setup(name) for name in "abc"]
    monkeypatch.setattr(bench, "build_runner",
                        lambda layout, ctx, steps: next(s.runner for s in setups if s.result.layout == layout))
    bench.run_rounds(setups, [], rounds=4)
    timed = order[3 * cfg.warmup:]  # after each set-up's warm-up steps
    rounds = [timed[i:i + 3 * cfg.steps:cfg.steps] for i in range(0, len(timed), 3 * cfg.steps)]
    assert rounds == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert all(len(s.result.round_seconds) == 4 for s in setups)


@pytest.mark.slow
def test_fp8_is_a_precision_axis_reported_as_emulated_on_the_cpu(tmp_path):
    out = tmp_path / "fp8.json"
    result = run_cli([sys.executable, str(SCRIPT), "--config", "tiny", "--device", "cpu", "--precision", "bf16,fp8",
                      "--layouts", "packed,hf_padded", "--steps", "1", "--rounds", "2", "--warmup", "1",
                      "--json", str(out)], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    setups = {(r["layout"], r["precision"]): r for r in report["results"]}
    assert set(setups) == {(layout, p) for layout in ("packed", "hf_padded") for p in ("bf16", "fp8")}
    for (layout, precision), r in setups.items():
        assert r["status"] == "ok" and len(r["speedups_vs_hf"]) == 2, r
        assert ("FP8 emulated (tensorwise, encoder GEMMs) (not a speed)" in r["notes"]) == (precision == "fp8"), r
    # Each precision's speed-ups are against hf_padded at that precision.
    fp8_hf = setups[("hf_padded", "fp8")]["round_seconds"]
    packed = setups[("packed", "fp8")]
    assert packed["speedups_vs_hf"] == pytest.approx([h / s for h, s in zip(fp8_hf, packed["round_seconds"])])
    assert "packed/fp8" in result.stdout


def test_tiny_cpu_run_times_the_same_work_in_every_layout(tiny_run):
    results = tiny_run["results"]
    assert len({(r["sequences"], r["tokens"], r["useful_flop"]) for r in results}) == 1
    for r in results:
        assert r["tokens_per_s"] / r["sequences_per_s"] == pytest.approx(r["tokens"] / r["sequences"])
        assert r["sequences"] >= tiny_run["rows_per_step"] * r["steps"]  # at least one sequence per packed row


def test_tiny_cpu_run_starts_from_the_uniform_loss(tiny_run):
    """Freshly initialised models predict uniformly: loss ~ ln(vocab) + ln(2) in every layout."""
    uniform = math.log(tiny_run["bert"]["vocab_size"]) + math.log(2)
    for r in tiny_run["results"]:
        assert abs(r["loss"] - uniform) < 0.5, r


def test_synthetic_rows_follow_the_packed_shard_limits_and_the_masking_rule(bench):
    cfg = bench.CONFIGS["tiny"]
    steps = bench.synthetic_steps(cfg, seed=3)
    assert len(steps) == cfg.warmup + cfg.steps and all(len(rows) == cfg.rows for rows in steps)
    for row in (row for rows in steps for row in rows):
        assert 1 <= len(row) <= workload.SEQS_PER_ROW and sum(s.length for s in row) <= cfg.max_seq_length
        for s in row:
            sep = np.flatnonzero(s.input_ids == workload.SEP)
            assert s.input_ids[0] == workload.CLS and sep[-1] == s.length - 1
            assert s.masked_lm_positions.shape[0] == flops.masked_count(np.array([s.length]), cfg.max_predictions)[0]
            assert set(s.masked_lm_positions).isdisjoint({0, *sep})
            assert (s.input_ids[s.masked_lm_positions] == workload.MASK).all()
            assert (s.masked_lm_ids >= workload.FIRST_TOKEN).all()


def test_synthetic_lengths_follow_the_rescaled_histogram(bench):
    counts = workload.length_histogram(64)
    assert counts.shape == (64,) and counts.sum() == load_length_histogram().sum()
    strategies, probs = workload.row_strategies(64)
    rng = np.random.default_rng(0)
    picks = rng.choice(len(strategies), size=20000, p=probs)
    lengths = np.concatenate([np.array(strategies[j]) for j in picks])
    expected_mean = (np.arange(1, 65) * counts).sum() / counts.sum()
    assert lengths.mean() == pytest.approx(expected_mean, rel=0.02)
    assert (lengths == 64).mean() == pytest.approx(counts[-1] / counts.sum(), abs=0.02)


def test_hf_labels_hold_the_masked_tokens_only(bench):
    cfg = bench.CONFIGS["tiny"]
    seqs = [s for row in bench.synthetic_steps(cfg, seed=4)[0] for s in row]
    padded = pad_items([(s,) for s in seqs], cfg.max_seq_length, cfg.max_predictions)
    hf = bench.HFBatch.of(padded)
    for i, s in enumerate(seqs):
        expected = torch.full((cfg.max_seq_length,), -100, dtype=torch.int64)
        expected[torch.from_numpy(s.masked_lm_positions)] = torch.from_numpy(s.masked_lm_ids)
        assert torch.equal(hf.labels[i], expected)
    assert torch.equal(hf.attention_mask.sum(1), torch.tensor([s.length for s in seqs]))


def test_unknown_layout_is_named(bench):
    with pytest.raises(SystemExit, match="unknown \\['fast'\\]"):
        bench.build_context(bench.parse_args(["--config", "tiny", "--device", "cpu", "--layouts", "padded,fast"]))


def test_unknown_precision_is_named(bench):
    with pytest.raises(SystemExit, match="--precision: unknown \\['fp4'\\]"):
        bench.build_context(bench.parse_args(["--config", "tiny", "--device", "cpu", "--precision", "bf16,fp4"]))


# ---------------------------------------------------------------- the FLOP formula

TINY_BERT = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def counted_training_flops(model: BertForPreTraining, items: list) -> int:
    """Matrix-multiply FLOP of forward + backward as torch's FlopCounterMode sees them.

    The math SDPA back-end runs attention as bmm's the counter can see; a vocabulary that
    is a multiple of 8 makes the decoder's padded vocabulary the real one.
    """
    batch = flatten_items(items)
    model.zero_grad(set_to_none=True)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        pretraining_loss(model(batch), batch).total.backward()
    return counter.get_total_flops()


def lengths_and_masked(items: list) -> tuple[np.ndarray, np.ndarray]:
    seqs = [s for item in items for s in item]
    return np.array([s.length for s in seqs]), np.array([s.masked_lm_positions.shape[0] for s in seqs])


def single_sequences(bench, seed: int, lengths: list[int]) -> list:
    rng = np.random.default_rng(seed)
    return [(workload.synthetic_sample(rng, n, TINY_BERT.vocab_size, 10),) for n in lengths]


def test_formula_equals_torch_flop_counter_on_equal_lengths(bench):
    torch.manual_seed(0)
    model = BertForPreTraining(TINY_BERT)
    items = single_sequences(bench, 0, [12, 12, 12])
    shape = flops.ModelShape.of(TINY_BERT)
    assert flops.training_flops(shape, *lengths_and_masked(items)) == counted_training_flops(model, items)


def test_formula_counts_attention_per_sequence_not_per_padded_grid(bench):
    torch.manual_seed(0)
    model = BertForPreTraining(TINY_BERT)
    items = single_sequences(bench, 1, [5, 9, 40])
    per_sequence = sum(counted_training_flops(model, [item]) for item in items)
    assert flops.training_flops(flops.ModelShape.of(TINY_BERT), *lengths_and_masked(items)) == per_sequence
    assert counted_training_flops(model, items) > per_sequence  # the SDPA grid pads to the longest


def test_formula_by_hand_for_one_small_sequence():
    shape = flops.ModelShape(hidden=8, layers=1, intermediate=16, vocab_size=16)
    encoder = 2 * 4 * (4 * 8 * 8 + 2 * 8 * 16)  # 4 tokens, QKV + output (4 h^2) and FFN (2 h i)
    attention = 4 * 4 * 4 * 8  # 4 L s^2 h
    pooler_nsp = 2 * (8 * 8 + 2 * 8)
    mlm = 2 * 1 * (8 * 8 + 8 * 16)  # one masked position
    assert flops.training_flops(shape, np.array([4]), np.array([1])) == 3 * (encoder + attention + pooler_nsp + mlm)


def test_bert_large_costs_about_500_gflop_per_wikipedia_sequence():
    """REFERENCE.md: ~500 GFLOP of training per real sequence; 790 TFLOP/s -> ~1,580 sequences/s."""
    per_sequence = flops.expected_training_flops(flops.ModelShape.of(BertConfig(vocab_size=30522)),
                                                 load_length_histogram())
    assert per_sequence == pytest.approx(500e9, rel=0.01)
    assert 790e12 / per_sequence == pytest.approx(1580, rel=0.01)


def test_masked_count_follows_the_dataset_rule():
    assert flops.masked_count(np.array([5, 100, 512, 600])).tolist() == [1, 15, 76, 76]


def test_tiny_cpu_run_with_grouped_attention_runs_every_layout(tmp_path):
    """--attention_backend grouped with bounds that split the tiny config's 64 tokens into four groups."""
    out = tmp_path / "grouped.json"
    result = run_cli([sys.executable, str(SCRIPT), "--config", "tiny", "--device", "cpu", "--steps", "1",
                      "--warmup", "1", "--attention_backend", "grouped", "--attention_group_bounds", "16,32,48",
                      "--json", str(out)], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    results = {r["layout"]: r for r in json.loads(out.read_text())["results"]}
    assert all(r["status"] == "ok" and math.isfinite(r["loss"]) for r in results.values()), results
    assert results["padded"]["notes"].startswith("attention grouped,")
    assert results["unpadded"]["notes"].startswith("attention grouped,")
    assert results["packed"]["notes"].startswith("attention grouped per row,")
