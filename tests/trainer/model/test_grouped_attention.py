"""The grouped attention back-end: its grouping, and exact agreement with the sdpa reference.

Tolerances. fp32: rtol 1e-5, atol 1e-6 (outputs and gradients). Both back-ends compute the
same masked softmax; a grid padded to 128 instead of 513 keys only drops exact zeros, but the
CPU kernel sums the keys in blocks whose split follows the grid width, so the last bits of a
sum differ (measured: 1e-7 absolute on outputs, 5e-7 on gradients of O(1) values). bf16:
rtol 1.6e-2, atol 1e-2, about two bf16 steps (8 significant bits, a step is 2^-8 relative):
the same reordering can move a rounding of an output or of an intermediate probability by one
step (measured: 1e-3 on outputs, 4e-3 on gradients of O(1) values).
"""

from __future__ import annotations

import copy
import json
import sys

import numpy as np
import pytest
import torch

from mlperf_bert.config.settings import ConfigError, parse_group_bounds
from mlperf_bert.data.batch import FlatBatch, Item, Sample, flatten_items, pad_items, unpad
from mlperf_bert.data.lengths import load_length_histogram
from mlperf_bert.data.static_batch import static_packed_batch
from mlperf_bert.model import attention
from mlperf_bert.model.attention import (AttentionNeeds, FlatAttention, backend_problem, batch_layout, flat_layout,
                                         resolve_backend, sdpa_attention)
from mlperf_bert.model.bert import BertConfig, BertForPreTraining, pretraining_loss
from mlperf_bert.model.grouped_attention import (bucket_of, grouped_attention, grouped_layout, host_lengths,
                                                 length_groups, score_entries)
from tests.harness.commands import run_cli
from tests.harness.demo import trainer_args
from tests.harness.paths import TRAINER

BOUNDS = (128, 256, 384, 512)
HEADS, DIM = 2, 8
TOLERANCES = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}}
CASES = {
    "one_sequence": [77],
    "one_group": [128, 1, 64, 100, 128],
    "every_group": [5, 130, 300, 512, 200, 400, 60, 385, 2, 256],
    "boundary_128_129": [128, 129, 128, 129],
    "over_the_last_bound": [513, 40, 600],
    "empty_sequences": [0, 5, 0, 130, 0],  # as a static batch's empty slots: in no group
}


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)


def qkv(tokens: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, HEADS, DIM, generator=g).to(dtype).requires_grad_() for _ in range(3)]


def both_backends(lengths: list[int], dtype: torch.dtype, dropout: float = 0.0
                  ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(sdpa, grouped): the output and the gradients of q, k, v under one random upstream gradient."""
    cu = cu_of(lengths)
    layout = flat_layout(cu, max(lengths), sum(lengths))
    groups = grouped_layout(cu, layout.seq_index, layout.pos_index, lengths, BOUNDS)
    q, k, v = qkv(sum(lengths), dtype)
    upstream = torch.randn(sum(lengths), HEADS, DIM, generator=torch.Generator().manual_seed(9)).to(dtype)
    results = []
    for run in (lambda: sdpa_attention(q, k, v, layout, dropout), lambda: grouped_attention(q, k, v, groups, dropout)):
        out = run()
        results.append((out, *torch.autograd.grad(out, (q, k, v), upstream)))
    return results[0], results[1]


# ---------------------------------------------------------------- the grouping, on the host


def test_grouped_bucket_puts_a_bound_in_its_own_group_and_one_more_token_in_the_next():
    assert [bucket_of(n, BOUNDS) for n in (1, 128, 129, 256, 257, 384, 385, 512, 513)] == [0, 0, 1, 1, 2, 2, 3, 3, 4]


def test_grouped_length_groups_hold_each_sequence_once_in_batch_order():
    lengths = [5, 130, 128, 129, 400, 1, 300, 513, 256, 257, 400]
    groups = length_groups(lengths, BOUNDS)
    assert [g.bucket for g in groups] == [0, 1, 2, 3, 4]
    assert [g.sequences for g in groups] == [(0, 2, 5), (1, 3, 8), (6, 9), (4, 10), (7,)]
    assert [g.longest for g in groups] == [128, 256, 300, 400, 513]
    assert [g.uniform for g in groups] == [False, False, False, True, True]
    assert [g.sequences for g in length_groups(lengths, (1000,))] == [tuple(range(len(lengths)))]
    assert [g.sequences for g in length_groups([0, 3, 0, 200], BOUNDS)] == [(1,), (3,)]


@pytest.mark.parametrize("bad", [(), (0, 128), (256, 128), (128, 128)])
def test_grouped_bounds_must_be_positive_and_increasing(bad: tuple[int, ...]):
    with pytest.raises(ValueError, match="positive and strictly increasing"):
        length_groups([3], bad)


def test_grouped_bounds_flag_parses_and_names_itself_when_wrong():
    assert parse_group_bounds("128,256,384,512") == BOUNDS
    assert parse_group_bounds(" 64, 512") == (64, 512)
    for text in ("128;256", "256,128", "0,128", "", "128,-1"):
        with pytest.raises(ConfigError, match="--attention_group_bounds must be"):
            parse_group_bounds(text)


def test_grouped_score_entries_count_the_grids():
    lengths = [10, 130, 129, 500]
    assert score_entries(lengths) == 4 * 500**2
    assert score_entries(lengths, BOUNDS) == 10**2 + 2 * 130**2 + 500**2


def test_grouped_wikipedia_batches_do_less_than_half_the_padded_score_work():
    """The issue's count: 32- and 96-sequence batches of the phase-2 histogram, about 2.3x."""
    counts = load_length_histogram()
    rng = np.random.default_rng(0)
    for size in (32, 96):
        ratios = [score_entries(lengths) / score_entries(lengths, BOUNDS)
                  for lengths in (rng.choice(np.arange(1, 513), size, p=counts / counts.sum()).tolist()
                                  for _ in range(100))]
        assert 2.1 < float(np.mean(ratios)) < 2.5, (size, np.mean(ratios))


def test_grouped_host_lengths_never_read_the_device():
    cu = cu_of([3, 4])
    assert host_lengths(cu, None) == (3, 4)  # a CPU tensor is host memory already
    assert host_lengths(cu.to("meta"), (3, 4)) == (3, 4)
    with pytest.raises(ValueError, match="host_seqlens"):
        host_lengths(cu.to("meta"), None)


class _GpuLengths:
    """cu_seqlens as a GPU holds it, on a machine without one: reading it is the stall to avoid."""

    device = torch.device("cuda", 0)

    def tolist(self) -> list[int]:
        raise AssertionError("the sequence lengths were read from the device")


@pytest.mark.parametrize("device", ["cuda", "xpu", "mps"])
def test_grouped_host_lengths_never_read_a_gpu_tensor(device: str):
    gpu = _GpuLengths()
    gpu.device = torch.device(device, 0)
    with pytest.raises(ValueError, match="host_seqlens"):
        host_lengths(gpu, None)  # type: ignore[arg-type]
    assert host_lengths(gpu, [3, 4]) == (3, 4)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the device's index maps


def test_grouped_layout_grids_hold_the_host_groups_tokens():
    lengths = CASES["every_group"]
    cu = cu_of(lengths)
    layout = flat_layout(cu, max(lengths), sum(lengths))
    grouped = grouped_layout(cu, layout.seq_index, layout.pos_index, lengths, BOUNDS)
    groups = length_groups(lengths, BOUNDS)
    cells = grouped.gather.split([grid.cells for grid in grouped.grids])
    assert len(cells) == len(groups) and grouped.gather.shape == (sum(g.cells for g in grouped.grids),)
    for group, grid, group_cells in zip(groups, grouped.grids, cells):
        assert (grid.sequences, grid.longest) == (len(group.sequences), group.longest)
        rows = group_cells.view(grid.sequences, grid.longest)
        for row, seq in enumerate(group.sequences):
            n, start = lengths[seq], int(cu[seq])
            assert rows[row].tolist() == list(range(start, start + n)) + [start + n - 1] * (group.longest - n)
            if grid.key_mask is not None:
                assert grid.key_mask[row, 0, 0].tolist() == [True] * n + [False] * (group.longest - n)
    # Every token has its own cell, and that cell holds it.
    assert len(set(grouped.slot.tolist())) == sum(lengths)
    assert grouped.gather[grouped.slot].tolist() == list(range(sum(lengths)))


# ---------------------------------------------------------------- exactness against sdpa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_equals_sdpa_forward_and_backward(case: str, dtype: torch.dtype):
    sdpa, grouped = both_backends(CASES[case], dtype)
    for name, want, got in zip(("output", "dq", "dk", "dv"), sdpa, grouped):
        torch.testing.assert_close(got, want, **TOLERANCES[dtype], msg=f"{case} {name}")


def test_grouped_dropout_keeps_every_token_inside_its_sequence():
    lengths = [40, 200, 129, 128, 300]
    cu = cu_of(lengths)
    layout = flat_layout(cu, max(lengths), sum(lengths))
    groups = grouped_layout(cu, layout.seq_index, layout.pos_index, lengths, BOUNDS)
    q, k, v = (x.detach() for x in qkv(sum(lengths), torch.float32))
    for seq in range(len(lengths)):
        own = slice(int(cu[seq]), int(cu[seq + 1]))
        changed = [x.clone() for x in (k, v)]
        for x in changed:
            x[: own.start] += 100.0  # every token of every other sequence, keys and values
            x[own.stop :] += 100.0
        torch.manual_seed(5)
        before = grouped_attention(q, k, v, groups, 0.5)
        torch.manual_seed(5)
        after = grouped_attention(q, *changed, groups, 0.5)
        torch.testing.assert_close(after[own], before[own], rtol=0, atol=0)
        assert not torch.allclose(after, before)
    torch.manual_seed(5)
    dropped = grouped_attention(q, k, v, groups, 0.5)
    assert not torch.allclose(dropped, grouped_attention(q, k, v, groups, 0.0))  # dropout is applied


# ---------------------------------------------------------------- in the model

TINY = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=300)


def sample(rng: np.random.Generator, n: int) -> Sample:
    k = int(rng.integers(1, min(3, n - 1) + 1))
    return Sample(rng.integers(4, TINY.vocab_size, n), (np.arange(n) >= n // 2).astype(np.int64),
                  np.sort(rng.choice(np.arange(1, n), size=k, replace=False)), rng.integers(4, TINY.vocab_size, k),
                  int(rng.integers(0, 2)))


def items(lengths: list[tuple[int, ...]], seed: int = 0) -> list[Item]:
    rng = np.random.default_rng(seed)
    return [tuple(sample(rng, n) for n in row) for row in lengths]


def loss_and_grads(model: BertForPreTraining, batch: FlatBatch) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = pretraining_loss(model(batch), batch).total
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_training_signal(batch: FlatBatch, bounds: tuple[int, ...] = (16, 64, 128)) -> None:
    torch.manual_seed(0)
    sdpa = BertForPreTraining(TINY, "sdpa")
    grouped = BertForPreTraining(TINY, "grouped", group_bounds=bounds)
    grouped.load_state_dict(sdpa.state_dict())
    want_loss, want = loss_and_grads(sdpa, batch)
    got_loss, got = loss_and_grads(grouped, batch)
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_grouped_model_trains_like_sdpa_on_packed_rows():
    """Rows of up to three sequences, as the packed shards hold them, flattened on the host."""
    batch = flatten_items(items([(10, 70, 3), (129,), (128, 16), (17, 200)]))
    assert batch.host_seqlens == (10, 70, 3, 129, 128, 16, 17, 200)
    assert len(length_groups(batch.host_seqlens, (16, 64, 128))) == 4
    assert_same_training_signal(batch)


def test_grouped_model_trains_like_sdpa_on_a_padded_batch_unpadded_with_its_lengths():
    batch = unpad(pad_items(items([(12,), (90,), (20,), (65,)], seed=1), 128, 4))
    assert batch.host_seqlens == (12, 90, 20, 65) and batch.max_seqlen == 90
    assert_same_training_signal(batch)


def test_grouped_model_runs_static_packed_rows_row_by_row():
    static = static_packed_batch(items([(10, 8, 6), (12, 5), (20,)], seed=2), rows=4, row_len=24,
                                 max_seqs_per_row=3, max_predictions=9)
    layout = batch_layout(static, "grouped")
    assert layout.row_len == 24 and layout.groups is None  # the same row attention as sdpa
    assert_same_training_signal(static)


def test_grouped_module_refuses_a_layout_without_groups():
    batch = flatten_items(items([(5,)]))
    q = k = v = torch.zeros(5, HEADS, DIM)
    with pytest.raises(ValueError, match="batch_layout"):
        FlatAttention("grouped", 0.0)(q, k, v, batch.cu_seqlens, batch_layout(batch, "sdpa"))


def test_grouped_model_copies_without_its_streams():
    model = BertForPreTraining(TINY, "grouped")
    twin = copy.deepcopy(model)
    assert twin.bert.group_streams is not model.bert.group_streams and twin.bert.group_bounds == BOUNDS


# ---------------------------------------------------------------- auto


@pytest.mark.parametrize("device, flash, torch_varlen, max_len, expected", [
    ("cpu", False, False, 512, "grouped"),
    ("cpu", False, False, 128, "sdpa"),  # one group: grouped would only add its index maps
    ("cpu", False, False, None, "sdpa"),
    ("cpu", True, True, 512, "grouped"),  # the kernels are GPU kernels
    ("cuda", True, True, 512, "varlen"),
    ("cuda", False, True, 512, "varlen"),  # PyTorch's flash kernel, with its dropout
    ("cuda", False, True, 128, "varlen"),
    ("cuda", False, False, 512, "grouped"),  # a torch without flash kernels and no flash-attn
    ("cuda", False, False, 128, "sdpa"),
])
def test_grouped_is_autos_choice_where_varlen_cannot_run_and_groups_split(
        monkeypatch: pytest.MonkeyPatch, device: str, flash: bool, torch_varlen: bool, max_len: int | None,
        expected: str):
    monkeypatch.setattr(attention, "_flash_attn_varlen", lambda: object() if flash else None)
    monkeypatch.setattr(attention, "flash_kernel_available", lambda: torch_varlen)
    fake_gpu(monkeypatch, (9, 0))
    assert resolve_backend("auto", torch.device(device), max_len) == expected
    assert resolve_backend("grouped", torch.device(device), max_len) == "grouped"


def fake_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], name: str = "NVIDIA H100") -> None:
    """What torch.cuda says about the GPU, for the device checks on a machine without one."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


# Runs the varlen kernels cannot take, whoever's kernel it is: auto leaves varlen for them.
VARLEN_MISFITS = {
    "V100 (7.0)": ((7, 0), "bf16", 64, "compute capability >= 8.0 (Ampere or newer), but NVIDIA H100 is 7.0"),
    "T4 (7.5)": ((7, 5), "fp16", 64, "but NVIDIA H100 is 7.5"),
    "fp32": ((9, 0), "fp32", 64, "takes fp16 / bf16 inputs, and --precision fp32 gives it fp32"),
    "head 320": ((9, 0), "bf16", 320, "head sizes up to 256 in steps of 8"),
    "head 12": ((9, 0), "bf16", 12, "hidden_size / num_attention_heads of the BERT config is 12"),
}


@pytest.mark.parametrize("case", VARLEN_MISFITS)
@pytest.mark.parametrize("flash", [True, False])
def test_auto_never_picks_varlen_where_its_kernels_cannot_run(monkeypatch: pytest.MonkeyPatch, case: str,
                                                             flash: bool):
    capability, precision, head_dim, reason = VARLEN_MISFITS[case]
    monkeypatch.setattr(attention, "_flash_attn_varlen", lambda: object() if flash else None)
    monkeypatch.setattr(attention, "flash_kernel_available", lambda: True)
    fake_gpu(monkeypatch, capability)
    cuda = torch.device("cuda", 0)
    assert resolve_backend("auto", cuda, 512, precision=precision, head_dim=head_dim) == "grouped"
    needs = AttentionNeeds(cuda, precision, head_dim, 0.1)
    problem = backend_problem("varlen", needs)
    assert problem is not None and problem.startswith("--attention_backend varlen ") and reason in problem, problem
    assert problem.endswith(attention.OTHER_BACKENDS) or "use --precision bf16, fp16 or fp8" in problem
    assert backend_problem("auto", needs) is None
    assert backend_problem("sdpa", needs) is None and backend_problem("grouped", needs) is None


# Every back-end x device x kernel: what start-up says (None: it runs). Both kernels take dropout; a
# torch built without flash kernels and no flash-attn leaves varlen nothing to run.
BACKEND_MATRIX = [
    # backend, device, flash-attn, torch's flash kernel, refused with
    ("sdpa", "cpu", False, False, None), ("grouped", "cpu", False, False, None),
    ("auto", "cpu", False, False, None),
    ("varlen", "cpu", True, True, "runs GPU kernels only (flash-attn's or PyTorch's varlen attention), and this "
                                  "run is on the cpu"),
    ("sdpa", "cuda", False, False, None), ("grouped", "cuda", False, False, None),
    ("auto", "cuda", False, False, None), ("auto", "cuda", False, True, None),
    ("varlen", "cuda", True, True, None), ("varlen", "cuda", True, False, None),
    ("varlen", "cuda", False, True, None),
    ("varlen", "cuda", False, False, "needs flash-attention kernels: this torch"),  # the line's start and end
    ("varlen", "cuda", False, False, "and flash-attn is not installed (pip install flash-attn"),
]


@pytest.mark.parametrize("backend, device, flash, torch_varlen, refused", BACKEND_MATRIX)
def test_every_backend_on_every_device_is_served_or_refused_at_start_up(
        monkeypatch: pytest.MonkeyPatch, backend: str, device: str, flash: bool, torch_varlen: bool,
        refused: str | None):
    monkeypatch.setattr(attention, "_flash_attn_varlen", lambda: object() if flash else None)
    monkeypatch.setattr(attention, "flash_kernel_available", lambda: torch_varlen)
    fake_gpu(monkeypatch, (9, 0))
    problem = backend_problem(backend, AttentionNeeds(torch.device(device), "bf16", 64, 0.1))
    if refused is None:
        assert problem is None
    else:
        assert problem is not None and refused in problem and "\n" not in problem, problem


# ---------------------------------------------------------------- in the trainer


@pytest.mark.slow
def test_grouped_trainer_runs_padded_and_unpadded_batches_alike(demo_data, tmp_path):
    """run_pretraining.py with --attention_backend grouped and four groups over the demo's 64 tokens:
    the padded layout (lengths read with the longest when unpadding) trains like the unpadded one
    (lengths known on the host), attention dropout included."""
    accuracies = {}
    for layout in ("padded", "unpadded"):
        out = tmp_path / layout
        result = run_cli([sys.executable, str(TRAINER), *trainer_args(
            demo_data, out, "--do_train", "--input_layout", layout, "--attention_backend", "grouped",
            "--attention_group_bounds", "16,32,48")])
        assert result.returncode == 0, result.stderr[-3000:]
        resolved = json.loads((out / "resolved_config.json").read_text())
        assert resolved["model"]["attention_backend"] == "grouped", resolved["model"]
        accuracies[layout] = [e["value"] for e in map(json.loads, (
            line.split(":::MLLOG ", 1)[1] for line in (out / "mlperf.log").read_text().splitlines()
            if ":::MLLOG" in line)) if e["key"] == "eval_accuracy"]
    assert accuracies["padded"] and accuracies["padded"] == pytest.approx(accuracies["unpadded"], abs=1e-6)
    assert json.loads((demo_data / "bert_config.json").read_text())["attention_probs_dropout_prob"] > 0


def test_compiling_keeps_the_grouped_path_out_of_compiled_graphs():
    """Group shapes change every batch: compile_model must make torch.compile break its graph around
    the grouped call (torch.compiler.disable), and the eager entry point must then reach it."""
    from mlperf_bert.model import compiling, grouped_attention as grouped

    model = BertForPreTraining(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=16, max_position_embeddings=32))
    compiling.compile_model(model, "default", backend="eager")  # backend eager: nothing is built until called
    assert getattr(grouped._grouped_attention, "_torchdynamo_disable", False)
    assert grouped._grouped_attention._torchdynamo_orig_callable is grouped._eager_grouped_attention
