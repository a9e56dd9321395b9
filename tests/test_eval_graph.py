"""--eval_cuda_graph on the CPU: packed static eval batches and the captured eval forward score like the eager eval.

Off a GPU the captured forward runs directly (`cuda_graphs.Replay`), so these tests check its
arithmetic: the static shape, the packing of the eval set into rows, the copy into the graph's
static input and the sums kept on the device. The fake-CUDA dry run checks the capture itself
(tests/test_dryrun.py).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from mlperf_bert.config.settings import ConfigError, RunSettings
from mlperf_bert.data.batch import IGNORE_INDEX, Sample
from mlperf_bert.data.dataset import DataLimits, load_eval_set
from mlperf_bert.data.static_batch import pack_rows
from mlperf_bert.input.eval_input import eval_batches
from mlperf_bert.model.bert import BertConfig, BertForPreTraining
from mlperf_bert.train.eval_step import CORRECT, COUNTED, LOSS, EagerEval, GraphedEval, eval_shape

CPU = torch.device("cpu")
EVAL_BATCH = 40  # sequences per eager batch; 20 packed rows per static batch


@pytest.fixture(scope="module")
def eval_items(demo_data: Path) -> list:
    bert = BertConfig.from_json(demo_data / "bert_config.json")
    return load_eval_set(demo_data / "eval", 200, 0, 1, DataLimits(64, 10, bert.vocab_size))


@pytest.fixture(scope="module")
def model(demo_data: Path) -> BertForPreTraining:
    torch.manual_seed(3)
    return BertForPreTraining(BertConfig.from_json(demo_data / "bert_config.json"), attention_backend="sdpa")


def test_pack_rows_places_every_sequence_once_within_the_row_limits(eval_items) -> None:
    shape = eval_shape(EVAL_BATCH, 64, 10)
    rows = pack_rows(eval_items, shape.row_len, shape.max_seqs_per_row, shape.max_predictions)
    packed = [id(s) for row in rows for s in row]
    assert sorted(packed) == sorted(id(s) for item in eval_items for s in item)  # each exactly once
    for row in rows:
        assert len(row) <= shape.max_seqs_per_row and sum(s.length for s in row) <= shape.row_len
        assert sum(s.masked_lm_positions.shape[0] for s in row) <= shape.max_predictions
    assert len(rows) < 0.75 * len(eval_items)  # rows are shared: the eval costs fewer padded tokens


@pytest.mark.parametrize("seed", range(20))
def test_pack_rows_keeps_every_sequence_of_any_lengths(seed: int) -> None:
    """Odd and even counts, sequences that fill a row alone, and the last one left in the middle."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 65, size=int(rng.integers(1, 12)))
    items = [(Sample(np.ones(n, np.int64), np.zeros(n, np.int64), np.arange(1, 1 + n // 7), np.ones(n // 7, np.int64),
                     0),) for n in lengths]
    rows = pack_rows(items, 64, 3, 12)
    assert sorted(id(s) for row in rows for s in row) == sorted(id(item[0]) for item in items)
    assert all(sum(s.length for s in row) <= 64 and len(row) <= 3 for row in rows)


def test_pack_rows_names_a_sequence_that_fits_no_row(eval_items) -> None:
    with pytest.raises(ValueError, match="does not fit a row of 16 tokens"):
        pack_rows(eval_items, 16, 3, 10)


def test_graphed_eval_scores_like_the_eager_eval(model, eval_items) -> None:
    """Same hits and predictions exactly; the loss to rounding (other batches, attention per row)."""
    eager = EagerEval(model, "fp32", CPU).totals(eval_batches(eval_items, EVAL_BATCH))
    shape = eval_shape(EVAL_BATCH, 64, 10)
    graphed = GraphedEval(model, "fp32", CPU, shape).totals(eval_batches(eval_items, EVAL_BATCH, shape))
    assert model.training  # the capture put the model back in training mode
    predictions = sum(s.masked_lm_positions.shape[0] for item in eval_items for s in item)
    assert eager[COUNTED] == predictions and graphed[COUNTED] == predictions
    assert graphed[CORRECT] == eager[CORRECT] > 0
    assert graphed[LOSS].item() == pytest.approx(eager[LOSS].item(), rel=1e-6)


def test_graphed_eval_adds_nothing_to_the_eager_arithmetic_of_the_same_batches(model, eval_items) -> None:
    """On the same static batches the replayed forward (copy into the static input, sums on the device)
    gives the eager sums bit for bit, eval after eval, and leaves the weights as they were."""
    shape = eval_shape(EVAL_BATCH, 64, 10)
    batches = eval_batches(eval_items, EVAL_BATCH, shape)
    assert all(b.input_ids.shape == batches[0].input_ids.shape for b in batches)  # one static shape
    assert (batches[-1].masked_lm_ids == IGNORE_INDEX).any()  # the padding the sums must skip
    weights = copy.deepcopy(model.state_dict())
    eager = EagerEval(model, "fp32", CPU).totals(batches)
    graphed = GraphedEval(model, "fp32", CPU, shape)
    first, second = graphed.totals(batches), graphed.totals(batches[:1])
    assert torch.equal(first, eager)
    assert second[COUNTED] < first[COUNTED]  # each eval starts from zero
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_eval_cuda_graph_is_refused_on_the_cpu() -> None:
    with pytest.raises(ConfigError, match="--eval_cuda_graph needs a GPU; drop it on the CPU"):
        RunSettings(output_dir="out", device="cpu", eval_cuda_graph=True)
