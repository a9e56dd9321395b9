"""The fast path's parts: static packed batches, device-side metrics and optimizer, prefetch, compile.

CPU tests check each part against the plain path it replaces; the CUDA-graph and varlen
tests need a GPU and are skipped without one.
"""

from __future__ import annotations

import copy
from dataclasses import fields

import numpy as np
import pytest
import torch

from mlperf_bert.model.attention import flat_layout, row_attention, sdpa_attention
from mlperf_bert.data.batch import FlatBatch, flatten_items, pad_items
from mlperf_bert.model.bert import BertConfig, BertForPreTraining, pretraining_loss
from mlperf_bert.optim.optimizers import ForeachLamb, ReferenceLamb, parameter_groups
from mlperf_bert.optim.schedule import set_lr
from mlperf_bert.model.compiling import compile_model
from mlperf_bert.model.fp8 import convert_to_fp8, fp8_unavailable
from mlperf_bert.optim.capturable import capturable, device_lr
from mlperf_bert.input.device_input import DevicePrefetcher
from mlperf_bert.train.metrics import StepMetrics
from mlperf_bert.model.precision import autocast
from mlperf_bert.data.batch import IGNORE_INDEX
from mlperf_bert.data.static_batch import example_static_batch, static_packed_batch
from mlperf_bert.train.step import EagerStep, GraphedStep
from mlperf_bert.train.sync_window import InPlaceSnapshot
from tests.harness.tiny_bert import MAX_PREDICTIONS, MAX_SEQS, ROW_LEN, ROWS, TINY, make_rows, tiny_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def loss_and_grads(model: BertForPreTraining, batch: FlatBatch) -> tuple[list[float], dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = pretraining_loss(model(batch), batch)
    loss.total.backward()
    return [loss.total.item(), loss.mlm.item(), loss.nsp.item()], {
        name: p.grad.clone() for name, p in model.named_parameters()
    }


def test_static_packed_batch_gives_the_unpadded_loss_and_gradients():
    items = make_rows(np.random.default_rng(1), ROWS)
    model = tiny_model()
    static = static_packed_batch(items, rows=5, row_len=ROW_LEN, max_seqs_per_row=MAX_SEQS,
                                           max_predictions=MAX_PREDICTIONS)
    assert int(static.seqlens().eq(0).sum()) > 0  # the batch really has empty sequences
    flat_losses, flat_grads = loss_and_grads(model, flatten_items(items))
    static_losses, static_grads = loss_and_grads(model, static)
    np.testing.assert_allclose(static_losses, flat_losses, rtol=1e-6)
    for name, grad in flat_grads.items():
        torch.testing.assert_close(static_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def qkv_for(batch: FlatBatch, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch.num_tokens, 2, 8, generator=g) for _ in range(3)]


def test_row_attention_equals_per_sequence_attention_on_a_static_batch():
    static = static_packed_batch(make_rows(np.random.default_rng(3), ROWS), rows=5, row_len=ROW_LEN,
                                           max_seqs_per_row=MAX_SEQS, max_predictions=MAX_PREDICTIONS)
    assert static.row_len == ROW_LEN
    rows = flat_layout(static.cu_seqlens, static.max_seqlen, static.num_tokens, static.row_len)
    grid = flat_layout(static.cu_seqlens, static.max_seqlen, static.num_tokens)
    q, k, v = qkv_for(static, 0)
    torch.testing.assert_close(row_attention(q, k, v, rows, 0.0), sdpa_attention(q, k, v, grid, 0.0),
                               rtol=1e-5, atol=1e-6)


def test_row_attention_with_dropout_never_reads_another_sequence_of_the_row():
    static = static_packed_batch(make_rows(np.random.default_rng(4), ROWS[:1]), rows=1, row_len=ROW_LEN,
                                           max_seqs_per_row=MAX_SEQS, max_predictions=MAX_PREDICTIONS)
    layout = flat_layout(static.cu_seqlens, static.max_seqlen, static.num_tokens, static.row_len)
    q, k, v = qkv_for(static, 1)
    first = slice(0, int(static.seqlens()[static.seqlens() > 0][0]))  # the row's first sequence
    changed = v.clone()
    changed[first.stop:] += 100.0  # every other token of the row, the dummy tail included
    torch.manual_seed(5)
    before = row_attention(q, k, v, layout, 0.5)
    torch.manual_seed(5)
    after = row_attention(q, k, changed, layout, 0.5)
    torch.testing.assert_close(after[first], before[first])
    assert not torch.allclose(after[first.stop:], before[first.stop:])


def test_static_packed_batch_shapes_depend_only_on_the_sizes():
    rng = np.random.default_rng(2)
    sizes = dict(rows=4, row_len=ROW_LEN, max_seqs_per_row=MAX_SEQS, max_predictions=MAX_PREDICTIONS)
    a = static_packed_batch(make_rows(rng, ROWS), **sizes)
    b = static_packed_batch(make_rows(rng, [(24,), (3, 3)]), **sizes)
    example = example_static_batch(**sizes)
    for f in fields(FlatBatch):
        shapes = {v.shape if isinstance(v, torch.Tensor) else v for v in (getattr(x, f.name) for x in (a, b, example))}
        assert len(shapes) == 1, f.name
    assert a.num_tokens == 4 * ROW_LEN and a.num_sequences == 4 * (MAX_SEQS + 1)
    assert int(a.cu_seqlens[-1]) == a.num_tokens and a.masked_lm_ids.shape[0] == 4 * MAX_PREDICTIONS


def test_static_packed_batch_keeps_rows_in_place():
    items = make_rows(np.random.default_rng(3), ROWS)
    static = static_packed_batch(items, rows=4, row_len=ROW_LEN, max_seqs_per_row=MAX_SEQS,
                                           max_predictions=MAX_PREDICTIONS)
    for r, item in enumerate(items):
        row = np.concatenate([s.input_ids for s in item])
        np.testing.assert_array_equal(static.input_ids[r * ROW_LEN : r * ROW_LEN + row.shape[0]].numpy(), row)
    lengths = static.seqlens()
    assert int(lengths.max()) <= ROW_LEN == static.max_seqlen
    assert (static.next_sentence_labels != IGNORE_INDEX).sum() == sum(len(i) for i in items)


@pytest.mark.parametrize(
    "rows, lengths, message",
    [
        (1, [(5,), (5,)], "rows=1"),
        (2, [(5, 5, 5, 5)], "max_seqs_per_row=3"),
        (2, [(20, 10)], "row_len=24"),
        (2, [()], "at least one sequence"),
    ],
)
def test_static_packed_batch_rejects_rows_that_do_not_fit(rows, lengths, message):
    items = make_rows(np.random.default_rng(4), lengths)
    with pytest.raises(ValueError, match=message):
        static_packed_batch(items, rows=rows, row_len=ROW_LEN, max_seqs_per_row=MAX_SEQS,
                                      max_predictions=MAX_PREDICTIONS)


def test_static_packed_batch_rejects_too_many_predictions():
    items = make_rows(np.random.default_rng(5), [(12, 12)])
    with pytest.raises(ValueError, match="max_predictions=1"):
        static_packed_batch(items, rows=1, row_len=ROW_LEN, max_seqs_per_row=MAX_SEQS, max_predictions=1)


LR = 1e-3  # the learning rate of lamb()


def lamb(model: torch.nn.Module) -> ForeachLamb:
    return ForeachLamb(parameter_groups(model, 0.01), lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                       max_grad_norm=1.0)


def test_step_metrics_equal_eager_readings_of_the_unpadded_batches():
    rng = np.random.default_rng(6)
    model = tiny_model()
    optimizer = lamb(model)
    metrics = StepMetrics(torch.device("cpu"))
    eager_losses, correct, predicted = [], 0, 0
    for _ in range(3):
        items = make_rows(rng, ROWS)
        flat = flatten_items(items)
        with torch.no_grad():
            out = model(flat)
            eager_losses.append(pretraining_loss(out, flat).total.item())
            correct += int((out.mlm_logits.argmax(-1) == flat.masked_lm_ids).sum())
            predicted += flat.masked_lm_ids.numel()
        static = static_packed_batch(items, 4, ROW_LEN, MAX_SEQS, MAX_PREDICTIONS)
        metrics.update(EagerStep(model, optimizer, "fp32")([static], LR).last, static)
    reading = metrics.read()
    assert reading.steps == 3
    assert reading.loss == pytest.approx(np.mean(eager_losses), rel=1e-6)
    assert reading.mlm_accuracy == pytest.approx(correct / predicted)
    assert reading.loss == pytest.approx(reading.mlm_loss + reading.nsp_loss, rel=1e-6)
    with pytest.raises(RuntimeError, match="before any update"):
        metrics.read()  # a read starts a new window


def test_capturable_lamb_steps_like_foreach_lamb_with_a_device_lr():
    rng = np.random.default_rng(7)
    plain_model, graph_model = tiny_model(), tiny_model()
    plain = lamb(plain_model)
    twin = capturable(lamb(graph_model))
    assert all(isinstance(g["lr"], torch.Tensor) for g in twin.param_groups)
    for step in range(4):
        batch = flatten_items(make_rows(rng, ROWS))
        for model, optimizer in ((plain_model, plain), (graph_model, twin)):
            EagerStep(model, optimizer, "fp32")([batch], 1e-3 * (step + 1))
    for (name, p), q in zip(plain_model.named_parameters(), graph_model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-8, msg=name)
    assert [float(g["step"]) for g in twin.param_groups] == [g["step"] for g in plain.param_groups]


def test_snapshot_undoes_training_steps_in_place():
    rng = np.random.default_rng(15)
    batches = [flatten_items(make_rows(rng, ROWS)) for _ in range(3)]
    model, fresh = tiny_model(), tiny_model()
    optimizer, fresh_optimizer = capturable(lamb(model)), capturable(lamb(fresh))
    snapshot = InPlaceSnapshot(model, optimizer)
    weights = [p.data_ptr() for p in model.parameters()]
    for batch in batches[:2]:  # the warm-up a graph capture would do
        EagerStep(model, optimizer, "fp32")([batch], LR)
    snapshot.restore()
    assert [p.data_ptr() for p in model.parameters()] == weights
    EagerStep(model, optimizer, "fp32")([batches[2]], LR)
    EagerStep(fresh, fresh_optimizer, "fp32")([batches[2]], LR)
    for p, q in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert [float(g["step"]) for g in optimizer.param_groups] == [1.0] * len(optimizer.param_groups)


def test_capturable_names_the_fix_for_other_optimizers():
    model = tiny_model()
    reference = ReferenceLamb(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="implementation 'foreach'"):
        capturable(reference)


def test_device_lr_makes_set_lr_fill_a_tensor():
    optimizer = lamb(tiny_model())
    device_lr(optimizer, torch.device("cpu"))
    lrs = [g["lr"] for g in optimizer.param_groups]
    set_lr(optimizer, 0.25)
    assert all(g["lr"] is lr and float(lr) == 0.25 for g, lr in zip(optimizer.param_groups, lrs))


def batches_equal(a, b) -> bool:
    return all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for f in fields(a) for x, y in [(getattr(a, f.name), getattr(b, f.name))]
    )


def test_prefetcher_yields_the_same_batches_in_order():
    rng = np.random.default_rng(8)
    flat = [flatten_items(make_rows(rng, ROWS)) for _ in range(3)]
    padded = [pad_items(make_rows(rng, [(5,), (9,)]), ROW_LEN, MAX_PREDICTIONS) for _ in range(2)]
    for batches in (flat, padded):
        got = list(DevicePrefetcher(iter(batches), "cpu", pin_memory=False))
        assert len(got) == len(batches) and all(batches_equal(g, b) for g, b in zip(got, batches))
    assert list(DevicePrefetcher([], "cpu")) == []


def test_compile_model_keeps_the_loss_and_gradients():
    items = make_rows(np.random.default_rng(9), ROWS)
    batch = flatten_items(items)
    eager = tiny_model()
    compiled = compile_model(copy.deepcopy(eager), mode="default", backend="aot_eager")
    eager_losses, eager_grads = loss_and_grads(eager, batch)
    compiled_losses, compiled_grads = loss_and_grads(compiled, batch)
    np.testing.assert_allclose(compiled_losses, eager_losses, rtol=1e-5)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_compile_model_rejects_unknown_modes():
    with pytest.raises(ValueError, match="compile mode"):
        compile_model(tiny_model(), mode="reduce-overhead")


def static_batches(seed: int, count: int, rows: int = 4) -> list[FlatBatch]:
    rng = np.random.default_rng(seed)
    return [static_packed_batch(make_rows(rng, ROWS), rows, ROW_LEN, MAX_SEQS, MAX_PREDICTIONS)
            for _ in range(count)]


def test_graphed_step_refuses_fp16_without_a_device_scaler_and_plain_optimizers():
    model = tiny_model()
    example = static_batches(10, 1)[0]
    with pytest.raises(ValueError, match="DeviceLossScaler"):
        GraphedStep(model, capturable(lamb(model)), [example], precision="fp16")
    with pytest.raises(ValueError, match="capturable"):
        GraphedStep(model, lamb(model), [example])


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]
# FP8 on a GPU needs its tensor cores; a GPU without them refuses FP8 at start-up (test_fp8.py).
needs_fp8_gpu = pytest.mark.skipif(not torch.cuda.is_available() or fp8_unavailable(torch.device("cuda")) is not None,
                                   reason="needs a GPU with FP8 tensor cores (compute capability 8.9+)")
GRAPH_CASES = [("cpu", "fp32"), ("cpu", "fp8"),
               pytest.param("cuda", "fp32", marks=[pytest.mark.gpu, needs_cuda]),
               pytest.param("cuda", "fp8", marks=[pytest.mark.gpu, needs_fp8_gpu])]


@pytest.mark.parametrize("device, precision", GRAPH_CASES)
def test_graphed_step_matches_the_eager_step(device, precision):
    """On a GPU the captured graph replayed; on the CPU the same step run uncaptured (cuda_graphs.Replay).
    fp8: the FP8 layers' scales come from each step's own tensors, so the warm-up the capture undoes leaves
    nothing behind (on the CPU their GEMMs are emulated)."""
    batches = static_batches(11, 4)
    convert = (lambda m: convert_to_fp8(m, torch.device(device))) if precision == "fp8" else (lambda m: m)
    eager_model, graph_model = convert(tiny_model()).to(device), convert(tiny_model()).to(device)
    eager_opt = capturable(lamb(eager_model))
    example = example_static_batch(4, ROW_LEN, MAX_SEQS, MAX_PREDICTIONS)  # captured, then undone
    graphed = GraphedStep(graph_model, capturable(lamb(graph_model)), [example], precision=precision)
    eager = EagerStep(eager_model, eager_opt, precision)
    for step, batch in enumerate(batches):
        lr = 1e-3 * (step + 1)
        expected = eager([batch.to(device)], lr)
        replayed = graphed([batch.pin_memory() if device == "cuda" else batch], lr)
        torch.testing.assert_close(replayed.loss, expected.loss, rtol=1e-5, atol=1e-6)
    for p, q in zip(eager_model.parameters(), graph_model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- GPU only


@pytest.mark.gpu
@needs_cuda
def test_varlen_attention_handles_the_static_batch():
    from mlperf_bert.model.attention import (
        AttentionNeeds, _flash_attn_varlen, backend_problem, flash_kernel_available,
    )

    batch = static_batches(12, 1)[0].to("cuda")
    sdpa = tiny_model().cuda()
    varlen = BertForPreTraining(TINY, attention_backend="varlen").cuda()
    varlen.load_state_dict(sdpa.state_dict())
    if _flash_attn_varlen() is None and not flash_kernel_available():  # start-up refuses it, naming the fix
        problem = backend_problem("varlen", AttentionNeeds(torch.device("cuda"), "bf16", TINY.head_dim, 0.1))
        assert problem is not None and "needs flash-attention kernels" in problem, problem
        return
    with autocast(torch.device("cuda"), "bf16"):
        expected = pretraining_loss(sdpa(batch), batch).total.float()
        got = pretraining_loss(varlen(batch), batch).total.float()
    assert torch.isfinite(got)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=1e-3)


@pytest.mark.gpu
@needs_cuda
def test_prefetcher_pins_and_copies_on_a_side_stream():
    batches = static_batches(13, 3)
    got = list(DevicePrefetcher(batches, "cuda"))
    assert all(g.input_ids.is_cuda and batches_equal(g.to("cpu"), b) for g, b in zip(got, batches))


@pytest.mark.gpu
@needs_cuda
def test_graphed_bf16_loss_curve_stays_within_one_percent_of_fp32_eager():
    """The numerics target: 50 steps on the same data, bf16 CUDA graph vs the fp32 reference path."""
    cfg = BertConfig(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                     intermediate_size=512, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    reference = BertForPreTraining(cfg).cuda()
    fast = copy.deepcopy(reference)
    rng = np.random.default_rng(14)
    lengths = [tuple(int(x) for x in rng.integers(5, 8, size=3)) for _ in range(8)]
    batches = [static_packed_batch(make_rows(rng, lengths), 8, ROW_LEN, MAX_SEQS, MAX_PREDICTIONS)
               for _ in range(50)]
    ref_step = EagerStep(reference, lamb(reference), "fp32")
    graphed = GraphedStep(fast, capturable(lamb(fast)), [batches[0]], precision="bf16")
    ref_curve, fast_curve = [], []
    for batch in batches:
        ref_curve.append(ref_step([batch.to("cuda")], LR).loss.item())
        fast_curve.append(graphed([batch], LR).loss.item())
    np.testing.assert_allclose(fast_curve, ref_curve, rtol=0.01)


def test_bf16_static_path_loss_curve_stays_within_one_percent_of_fp32_reference_on_the_cpu():
    """The numerics target without the graph: 50 steps of the fast path's step (static packed
    batches, bf16 autocast, capturable LAMB with a device lr) against the fp32 reference path
    (flat batches, ReferenceLamb), on the same data."""
    cfg = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     max_position_embeddings=32)
    torch.manual_seed(0)
    reference = BertForPreTraining(cfg)
    fast = copy.deepcopy(reference)
    rng = np.random.default_rng(16)
    # Five batches seen ten times each: enough for the loss to fall well below its start.
    distinct = [make_rows(rng, [tuple(int(x) for x in rng.integers(5, 8, size=3)) for _ in range(6)]) for _ in range(5)]
    steps = distinct * 10
    ref_opt = ReferenceLamb(parameter_groups(reference, 0.01), lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)
    fast_opt = capturable(ForeachLamb(parameter_groups(fast, 0.01), lr=1e-2, weight_decay=0.01,
                                                max_grad_norm=1.0))
    ref_step, fast_step = EagerStep(reference, ref_opt, "fp32"), EagerStep(fast, fast_opt, "bf16")
    ref_curve, fast_curve = [], []
    for step, rows in enumerate(steps):
        lr = 1e-2 * (1 - step / len(steps))
        ref_curve.append(ref_step([flatten_items(rows)], lr).loss.item())
        static = static_packed_batch(rows, 6, ROW_LEN, MAX_SEQS, MAX_PREDICTIONS)
        fast_curve.append(fast_step([static], lr).loss.item())
    assert ref_curve[-1] < ref_curve[0] - 0.5  # it learns: the comparison is not between two flat lines
    np.testing.assert_allclose(fast_curve, ref_curve, rtol=0.01)
