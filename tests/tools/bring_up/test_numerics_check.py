"""tools/numerics_check.py: the clean model passes in every CPU precision, and each planted bring-up
fault is named at the layer and quantity where it first appears.

The model is the demo's (2 layers, hidden 128), its fp64 reference built once for the module.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Callable

from mlperf_tools.bring_up import numerics_check as nc
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mlperf_bert.model.attention import FlatAttention, FlatLayout, sdpa_attention
from mlperf_bert.model.bert import BertForPreTraining, BertSelfOutput
from mlperf_bert.model.fp8 import convert_to_fp8

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> nc.Setup:
    args = nc.parse_args(["--device", "cpu", "--input_layout", "unpadded", "--rows", "2", "--batches", "2"])
    cfg, bert = nc.resolve_config(args, tmp_path_factory.mktemp("numerics"))
    return nc.build_setup(cfg, bert, args.rows, args.batches)


@pytest.fixture(scope="module")
def reference(setup: nc.Setup) -> nc.Reference:
    return nc.reference_captures(setup.reference, setup.batches)


def batches_as(setup: nc.Setup, layout: str) -> list[nc.CheckBatch]:
    data = setup.cfg.data
    return nc.layout_batches([b.rows for b in setup.batches], layout, data.max_seq_length,
                             data.max_predictions_per_seq)


def run(setup: nc.Setup, reference: nc.Reference, model: BertForPreTraining, precision: str = "fp32",
        layout: str = "unpadded", band_precision: str | None = None, graphs: bool = False) -> list[nc.RowResult]:
    batches = batches_as(setup, layout)
    tokens = max(b.reference_batch.num_tokens for b in batches)
    specs = nc.plan_rows(setup.bert, band_precision or precision, setup.cfg.data.max_seq_length, tokens,
                         reference.shares)
    return nc.compare(specs, reference, nc.device_captures(model, batches, precision, CPU, graphs))


def model_for(setup: nc.Setup, precision: str) -> BertForPreTraining:
    model = copy.deepcopy(setup.model)
    return convert_to_fp8(model, CPU) if precision == "fp8" else model


@pytest.mark.parametrize("precision,layout", [("fp32", "unpadded"), ("fp32", "packed"), ("fp32", "padded"),
                                              ("bf16", "unpadded"), ("bf16", "packed"), ("fp16", "unpadded"),
                                              ("fp8", "unpadded"), ("fp8", "packed")])
def test_unmodified_model_passes(setup, reference, precision, layout):
    results = run(setup, reference, model_for(setup, precision), precision, layout)
    assert nc.first_outside(results) is None, nc.format_table(results)
    # The bands are not vacuous: the closest row comes within a factor of 100 of its band.
    assert max(r.ratio for r in results) > 0.01, nc.format_table(results)
    rows = {(r.where, r.quantity) for r in results}
    assert {("layer 1", "output LN"), ("loss", "total"), ("grad layer 0", "attention.self.query.weight"),
            ("grad embeddings", "bert.embeddings.word_embeddings.weight")} <= rows


def test_bf16_run_fails_fp32_bands(setup, reference):
    """The bands tell precisions apart: a bf16 run judged by fp32's bands leaves them at once, at the embeddings'
    LayerNorm, whose output bf16 rounds."""
    results = run(setup, reference, model_for(setup, "bf16"), "bf16", band_precision="fp32")
    first = nc.first_outside(results)
    assert first is not None and first.where == "embeddings", nc.format_table(results)


def test_captured_step_matches_eager(setup, reference):
    """--cuda_graphs' path (capture, copy into the static batch, replay; direct calls off a GPU) reads
    each batch, not the first one again."""
    eager = run(setup, reference, model_for(setup, "fp32"), layout="packed")
    graphed = run(setup, reference, model_for(setup, "fp32"), layout="packed", graphs=True)
    assert [r.error for r in graphed] == pytest.approx([r.error for r in eager], rel=1e-3, abs=1e-12)
    assert nc.first_outside(graphed) is None


def test_packed_rows_with_padding_compare_real_tokens_only(setup):
    """A row whose sequences leave a tail: its pad tokens, dummy sequences and padded predictions
    never enter the comparison."""
    rows = [[row[:-1] if r == 0 else row for r, row in enumerate(b.rows)] for b in setup.batches]
    data = setup.cfg.data
    packed = nc.layout_batches(rows, "packed", data.max_seq_length, data.max_predictions_per_seq)
    assert packed[0].device_batch.num_tokens > packed[0].reference_batch.num_tokens
    reference = nc.reference_captures(setup.reference, packed)
    tokens = max(b.reference_batch.num_tokens for b in packed)
    specs = nc.plan_rows(setup.bert, "fp32", data.max_seq_length, tokens, reference.shares)
    results = nc.compare(specs, reference, nc.device_captures(model_for(setup, "fp32"), packed, "fp32", CPU))
    assert nc.first_outside(results) is None, nc.format_table(results)


# ---------------------------------------------------------------- planted faults


class ScaledByDim(FlatAttention):
    """Scores scaled by 1/d instead of 1/sqrt(d)."""

    def forward(self, q, k, v, cu_seqlens, layout):
        return super().forward(q / math.sqrt(q.shape[-1]), k, v, cu_seqlens, layout)


class KeyMaskOffByOne(FlatAttention):
    """The key mask one token too long: each sequence also attends to the (zero) slot after its end."""

    def forward(self, q, k, v, cu_seqlens, layout: FlatLayout):
        t, heads, dim = q.shape
        s, length = layout.num_seqs, layout.max_seqlen + 1

        def grid(x):
            out = x.new_zeros(s, length, heads, dim)
            out[layout.seq_index, layout.pos_index] = x
            return out.transpose(1, 2)

        valid = torch.zeros(s, length, dtype=torch.bool)
        valid[layout.seq_index, layout.pos_index] = True
        valid[layout.seq_index, layout.pos_index + 1] = True
        out = F.scaled_dot_product_attention(grid(q), grid(k), grid(v), attn_mask=valid[:, None, None, :])
        return out.transpose(1, 2)[layout.seq_index, layout.pos_index]


class DropoutInEval(FlatAttention):
    """Attention dropout that ignores eval mode."""

    def forward(self, q, k, v, cu_seqlens, layout):
        return sdpa_attention(q, k, v, layout, self.dropout_p)


class NoResidual(BertSelfOutput):
    """LayerNorm(dense(x)): the residual dropped."""

    def forward(self, x, residual):
        return self.LayerNorm(self.dropout(self.dense(x)))


def swap_class(module: nn.Module, cls: type) -> None:
    module.__class__ = cls  # same parameters, the faulty forward


def tanh_gelu(model: BertForPreTraining) -> None:
    model.bert.encoder.layer[1].intermediate.act = "gelu_pytorch_tanh"


def layer_norm_eps(model: BertForPreTraining) -> None:
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            module.eps = 1e-5  # PyTorch's default instead of BERT's 1e-12


def attention_scale(model: BertForPreTraining) -> None:
    swap_class(model.bert.encoder.layer[1].attention.self.attend, ScaledByDim)


def key_mask(model: BertForPreTraining) -> None:
    for layer in model.bert.encoder.layer:
        swap_class(layer.attention.self.attend, KeyMaskOffByOne)


def eval_dropout(model: BertForPreTraining) -> None:
    for layer in model.bert.encoder.layer:
        swap_class(layer.attention.self.attend, DropoutInEval)


def dropped_residual(model: BertForPreTraining) -> None:
    swap_class(model.bert.encoder.layer[1].output, NoResidual)


FAULTS: dict[str, tuple[Callable[[BertForPreTraining], None], tuple[str, str]]] = {
    "tanh GELU in layer 1": (tanh_gelu, ("layer 1", "FFN")),
    "LayerNorm eps 1e-5": (layer_norm_eps, ("embeddings", "output")),
    "attention scaled by 1/d in layer 1": (attention_scale, ("layer 1", "attention")),
    "key mask off by one": (key_mask, ("layer 0", "attention")),
    "attention dropout on in eval": (eval_dropout, ("layer 0", "attention")),
    "FFN residual dropped in layer 1": (dropped_residual, ("layer 1", "output LN")),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_planted_fault_is_named_where_it_first_appears(setup, reference, fault):
    plant, expected = FAULTS[fault]
    model = model_for(setup, "fp32")
    plant(model)
    results = run(setup, reference, model)
    first = nc.first_outside(results)
    assert first is not None, nc.format_table(results)
    assert (first.where, first.quantity) == expected, nc.format_table(results)
    assert first.ratio > 10, nc.format_table(results)
    line = nc.verdict(results, "fp32")
    assert line.startswith(f"FAIL fp32: {expected[0]} {expected[1]} is first out of band")


def test_non_finite_value_is_out_of_band():
    ref = torch.ones(4, dtype=torch.float64)
    assert nc.relative_error(torch.tensor([1.0, float("nan"), 1.0, 1.0], dtype=torch.float64), ref) == math.inf
    assert nc.relative_error(ref * 1.001, ref) == pytest.approx(1e-3)


# ---------------------------------------------------------------- the command line


def test_missing_bert_config_is_one_line(tmp_path, capsys):
    missing = tmp_path / "none.json"
    assert nc.main(["--device", "cpu", "--bert_config_path", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(missing) in err[0] and "cannot read the BERT config" in err[0]


def test_unsupported_setting_is_one_line(capsys):
    assert nc.main(["--device", "cpu", "--attention_backend", "varlen"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--attention_backend varlen" in err[0]


def test_cli_writes_json_and_exit_status(tmp_path, capsys):
    """--json into a folder that does not exist yet: the folder is made (the check's result was lost in a
    FileNotFoundError after the whole check)."""
    out = tmp_path / "reports" / "bring_up" / "numerics.json"
    assert nc.main(["--device", "cpu", "--rows", "1", "--batches", "1", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("PASS fp32 on cpu")
    report = json.loads(Path(out).read_text())
    assert report["passed"] and report["first_out_of_band"] is None and len(report["rows"]) == len(lines) - 3


@pytest.mark.parametrize("where", ["a_file/n.json", "a_folder"])
def test_a_json_path_it_cannot_write_is_refused_before_the_check(tmp_path, capsys, where):
    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_folder").mkdir()
    with pytest.raises(SystemExit) as stop:
        nc.main(["--device", "cpu", "--rows", "1", "--batches", "1", "--json", str(tmp_path / where)])
    captured = capsys.readouterr()
    assert stop.value.code == 2 and not captured.out  # refused before the check: no model line, no table
    [line] = captured.err.strip().splitlines()
    assert line.startswith("error: argument --json: ") and str(tmp_path / where.split("/")[0]) in line, line
