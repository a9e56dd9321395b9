"""--eval_cuda_graph on the CPU: packed static eval batches and the captured eval forward score like the eager eval.

Off a GPU the captured forward runs directly (`cuda_graphs.Replay`), so these tests check its
arithmetic: the static shape, the packing of the eval set into rows, the copy into the graph's
static input and the sums kept on the device. The fake-CUDA dry run checks the capture itself
(tests/trainer/dryrun/test_dryrun.py).
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
from mlperf_bert.data.shards import DataError
from mlperf_bert.data.static_batch import StaticShape, pack_rows
from mlperf_bert.input.eval_input import EvalInput, eval_batches
from mlperf_bert.model.bert import BertConfig, BertForPreTraining
from mlperf_bert.train.eval_step import CORRECT, COUNTED, LOSS, EagerEval, GraphedEval, eval_shape, scoring

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


def _synthetic_eval_set(count: int, seed: int = 0) -> list:
    """`count` eval items of 5 to 64 tokens, one masked position per 7 tokens (at least one), each its own input ids
    (a running number) so that every sequence can be found again in the batches."""
    lengths = np.random.default_rng(seed).integers(5, 65, size=count)
    return [(Sample(np.full(n, i, np.int64), np.zeros(n, np.int64), np.arange(1, 1 + max(n // 7, 1)),
                    np.full(max(n // 7, 1), i, np.int64), i % 2),) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("count, batches, last", [(10_000, 79, 10_000 - 78 * 128), (9_216, 72, 128)])
def test_eager_batches_hold_every_sample_once_with_a_last_shorter_batch(count: int, batches: int, last: int) -> None:
    """MLPerf scores all 10,000 eval samples: 78 batches of 128 and a last one of 16 (9,216 divides into 72)."""
    items = _synthetic_eval_set(count)
    got = eval_batches(items, 128)
    assert (len(got), got[-1].num_sequences) == (batches, last)
    ids = torch.cat([batch.masked_lm_ids for batch in got])
    assert torch.equal(ids.sort().values, torch.arange(count).repeat_interleave(
        torch.tensor([item[0].masked_lm_ids.shape[0] for item in items])))


def test_packed_static_batches_hold_every_sample_of_every_ranks_share_once() -> None:
    """10,000 samples split over ranks as the eval set is (rank r takes r, r + W, ...; 3 ranks: 3,334, 3,333, 3,333),
    packed into static batches of 64 rows of 64 tokens: every sample once over the ranks, each prediction once, in
    batches of one shape whose last one is padded."""
    items, world = _synthetic_eval_set(10_000), 3
    shape = eval_shape(128, 64, 10)
    seen: list[torch.Tensor] = []
    for rank in range(world):
        got = eval_batches(items[rank::world], 128, shape)
        assert {b.input_ids.shape for b in got} == {(shape.rows * shape.row_len,)}
        assert (got[-1].next_sentence_labels == IGNORE_INDEX).any()  # padding slots, ignored by the sums
        seen += [b.masked_lm_ids[b.masked_lm_ids != IGNORE_INDEX] for b in got]
        real = sum(int((b.next_sentence_labels != IGNORE_INDEX).sum()) for b in got)
        assert real == len(items[rank::world])
    counts = torch.tensor([item[0].masked_lm_ids.shape[0] for item in items])
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(10_000).repeat_interleave(counts))


def test_both_evals_count_every_prediction_of_a_set_the_batch_size_does_not_divide(model, eval_items) -> None:
    """197 samples in eager batches of 40 (the last of 37) and in static batches: every prediction counted."""
    items = eval_items[:197]
    predictions = sum(s.masked_lm_positions.shape[0] for item in items for s in item)
    shape = eval_shape(EVAL_BATCH, 64, 10)
    eager = EagerEval(model, "fp32", CPU).totals(eval_batches(items, EVAL_BATCH))
    graphed = GraphedEval(model, "fp32", CPU, shape).totals(eval_batches(items, EVAL_BATCH, shape))
    assert eager[COUNTED] == graphed[COUNTED] == predictions and graphed[CORRECT] == eager[CORRECT]


@pytest.mark.parametrize("batch, rows", [(128, 64), (127, 64), (1, 1)])
def test_the_static_shape_rounds_half_the_eval_batch_up(batch: int, rows: int) -> None:
    """Rows: ceil(eval batch / 2); predictions per row: a sequence's 76 and one for each of the 2 more a row holds."""
    assert eval_shape(batch, 512, 76) == StaticShape(rows, 512, 3, 78)


def test_eval_input_reads_once_caches_on_the_device_and_raises_a_read_error_at_the_first_eval() -> None:
    items = _synthetic_eval_set(10)
    reads = []
    source = EvalInput(lambda: reads.append(1) or items, 4, CPU)
    assert not source.started and not reads  # nothing read before the clock starts it
    source.start()
    source.start()  # once
    first = source.batches()
    assert source.batches() is first and len(reads) == 1 and [b.num_sequences for b in first] == [4, 4, 2]

    def broken() -> list:
        raise DataError("eval.hdf5: row 3: input_ids outside [0, vocab_size=128)")

    failing = EvalInput(broken, 4, CPU)
    failing.start()  # the error waits for the first eval
    with pytest.raises(DataError, match="row 3"):
        failing.batches()


def test_eval_input_reads_into_its_static_shape_and_not_again_after_the_first_eval() -> None:
    """--eval_cuda_graph's input: the background read packs into the static shape the graph was captured with
    (every batch rows x row_len tokens), and a start after the first eval (the next block's) reads nothing."""
    items, shape, reads = _synthetic_eval_set(10), eval_shape(4, 64, 10), []
    source = EvalInput(lambda: reads.append(1) or items, 4, CPU, shape)
    source.start()
    batches = source.batches()
    assert [(b.row_len, b.input_ids.shape[0]) for b in batches] == [(64, shape.rows * 64)] * len(batches)
    assert sum(b.num_sequences for b in batches) >= 10  # empty rows pad the last batch
    source.start()
    assert source.started and source.batches() is batches and len(reads) == 1


def test_scoring_gives_the_model_back_in_the_mode_it_had() -> None:
    """Eval mode inside (dropout off), then training mode again, or eval mode again for an eval-only run."""
    model = torch.nn.Dropout(0.5)
    for training in (True, False):
        model.train(training)
        with scoring(model):
            assert not model.training and not torch.is_grad_enabled()
        assert model.training is training


def test_eval_cuda_graph_is_refused_on_the_cpu() -> None:
    with pytest.raises(ConfigError, match="--eval_cuda_graph needs a GPU; drop it on the CPU"):
        RunSettings(output_dir="out", device="cpu", eval_cuda_graph=True)
