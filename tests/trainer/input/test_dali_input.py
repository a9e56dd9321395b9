"""dali_input.DaliPrefetcher against device_input.DevicePrefetcher, and benchmarks/input_pipeline.py."""

from __future__ import annotations

import json
import sys
import weakref
from dataclasses import fields, replace
from functools import partial

import numpy as np
import pytest
import torch

from mlperf_bert.input import dali_input
from mlperf_bert.input.device_input import DevicePrefetcher
from mlperf_bert.data.static_batch import static_packed_batch
from mlperf_bert.data.batch import FlatBatch, Sample, flatten_items, pad_items
from mlperf_bert.input.dali_input import DaliPrefetcher, dali_available
from tests.harness.commands import require_tool

import input_pipeline

ROW_LEN, MAX_SEQS, MAX_PREDICTIONS = 24, 3, 6
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def dali() -> None:
    """Skips without DALI on a developer's machine; fails under CI, which must have it."""
    require_tool(dali_available(), f"NVIDIA DALI is not installed ({dali_input.INSTALL_HINT})")


def random_sample(rng: np.random.Generator, n: int) -> Sample:
    """n tokens, two of them masked."""
    return Sample(rng.integers(4, 50, n), (np.arange(n) > n // 2).astype(np.int64),
                  np.sort(rng.choice(np.arange(1, n - 1), 2, replace=False)), rng.integers(4, 50, 2),
                  int(rng.integers(0, 2)))


def random_rows(rng: np.random.Generator, count: int, longest: int = ROW_LEN // MAX_SEQS) -> list[tuple[Sample, ...]]:
    """`count` packed rows of 1..3 sequences of 5..`longest` tokens; the first sequence has `longest`."""
    rows = []
    for r in range(count):
        lengths = rng.integers(5, longest + 1, size=int(rng.integers(1, MAX_SEQS + 1)))
        lengths[0] = longest if r == 0 else lengths[0]
        rows.append(tuple(random_sample(rng, int(n)) for n in lengths))
    return rows


def flat_batches(seed: int, sizes: list[int]) -> list[FlatBatch]:
    """Unpadded batches of sizes[i] rows whose max_seqlen differs from batch to batch (6 + 3 i)."""
    rng = np.random.default_rng(seed)
    return [flatten_items(random_rows(rng, n, longest=6 + 3 * i)) for i, n in enumerate(sizes)]


def static_prepare(rows: int):
    return partial(static_packed_batch, rows=rows, row_len=ROW_LEN, max_seqs_per_row=MAX_SEQS,
                   max_predictions=MAX_PREDICTIONS)


def assert_same_batches(got: list, expected: list) -> None:
    """Same count, order, class, and per field the same value, dtype and shape."""
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert type(g) is type(e), i
        for f in fields(e):
            x, y = getattr(g, f.name), getattr(e, f.name)
            if isinstance(y, torch.Tensor):
                assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.cpu(), y.cpu()), (i, f.name)
            else:
                assert x == y, (i, f.name)


def torch_path(batches: list) -> list:
    return list(DevicePrefetcher(batches, "cpu", pin_memory=False))


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_flat_batches_equal_the_torch_prefetchers(dali, depth):
    batches = flat_batches(1, [1, 4, 2, 7, 3])  # T, S and M change every batch; the last has 3 rows
    with DaliPrefetcher(batches, "cpu", prefetch_queue_depth=depth) as prefetcher:
        got = list(prefetcher)
    assert_same_batches(got, torch_path(batches))
    assert got[0].cu_seqlens.dtype == torch.int32 and got[0].input_ids.dtype == torch.int64


def test_static_packed_batches_of_each_size_equal_the_torch_prefetchers(dali):
    rng = np.random.default_rng(2)
    for rows in (1, 3, 8):
        prepare = static_prepare(rows)
        batches = [prepare(random_rows(rng, int(n))) for n in rng.integers(1, rows + 1, size=4)]
        with DaliPrefetcher(batches, "cpu") as prefetcher:
            assert_same_batches(list(prefetcher), torch_path(batches))


def test_padded_two_dimensional_batches_pass_too(dali):
    rng = np.random.default_rng(3)
    batches = [pad_items([(s,) for row in random_rows(rng, 3) for s in row], ROW_LEN, MAX_PREDICTIONS)
               for _ in range(3)]
    with DaliPrefetcher(batches, "cpu") as prefetcher:
        assert_same_batches(list(prefetcher), torch_path(batches))


def test_outputs_are_new_memory_that_outlives_the_pipeline(dali):
    batches = flat_batches(4, [2, 3, 2])
    prefetcher = DaliPrefetcher(batches, "cpu")
    got = [next(prefetcher), next(prefetcher)]
    prefetcher.close()
    assert got[0].input_ids.data_ptr() != batches[0].input_ids.data_ptr()
    assert_same_batches(got, batches[:2])


def test_empty_input_yields_nothing_and_starts_no_pipeline(dali):
    prefetcher = DaliPrefetcher([], "cpu")
    assert list(prefetcher) == [] and prefetcher._pipe is None
    prefetcher.close()


def test_end_of_input_stops_for_good_and_frees_the_pipeline(dali):
    batches = flat_batches(5, [2, 1])
    prefetcher = DaliPrefetcher(iter(batches), "cpu")
    pipe = weakref.ref(prefetcher._pipe)
    assert_same_batches([next(prefetcher), next(prefetcher)], batches)
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(prefetcher)
    assert pipe() is None


def test_close_twice_frees_the_pipeline_and_ends_iteration(dali):
    prefetcher = DaliPrefetcher(flat_batches(6, [2, 2, 2]), "cpu")
    pipe = weakref.ref(prefetcher._pipe)
    next(prefetcher)
    prefetcher.close()
    prefetcher.close()
    assert pipe() is None
    with pytest.raises(StopIteration):
        next(prefetcher)


@pytest.mark.parametrize("prepare", [flatten_items, static_prepare(4)], ids=["flatten_items", "static_packed"])
def test_prepare_in_the_pipeline_equals_preparing_on_the_host(dali, prepare):
    rng = np.random.default_rng(7)
    items = [random_rows(rng, int(n)) for n in rng.integers(1, 5, size=6)]
    with DaliPrefetcher.from_items(items, prepare, "cpu") as prefetcher:
        assert_same_batches(list(prefetcher), [prepare(i) for i in items])


def test_prepare_runs_in_order_prefetch_queue_depth_batches_ahead(dali):
    rng = np.random.default_rng(8)
    items = [random_rows(rng, 2) for _ in range(5)]
    prepared: list[int] = []

    def prepare(rows):
        prepared.append(next(i for i, item in enumerate(items) if item is rows))
        return flatten_items(rows)

    prefetcher = DaliPrefetcher.from_items(items, prepare, "cpu", prefetch_queue_depth=3)
    assert prepared == [0, 1, 2]  # pulled at construction, the copies already on their way
    next(prefetcher)
    assert prepared == [0, 1, 2, 3]
    assert len(list(prefetcher)) == 4 and prepared == [0, 1, 2, 3, 4]


def test_a_batch_that_changes_a_dtype_is_named(dali):
    batches = flat_batches(9, [2, 2, 2])
    batches[1] = replace(batches[1], segment_ids=batches[1].segment_ids.to(torch.int32))
    prefetcher = DaliPrefetcher(batches, "cpu", prefetch_queue_depth=1)
    with pytest.raises(ValueError, match="batch 1: field 'segment_ids' is torch.int32"):
        next(prefetcher)  # returning batch 0 pulls batch 1 into the queue
    prefetcher.close()


def test_bad_arguments_are_refused_with_the_fix(dali):
    with pytest.raises(TypeError, match="batch dataclasses"):
        DaliPrefetcher([torch.zeros(3)], "cpu")
    with pytest.raises(ValueError, match="prefetch_queue_depth must be >= 1"):
        DaliPrefetcher(flat_batches(10, [1]), "cpu", prefetch_queue_depth=0)
    with pytest.raises(ValueError, match="--input_pipeline torch"):
        DaliPrefetcher(flat_batches(10, [1]), "meta")


def test_without_dali_the_error_names_the_flag_and_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # makes `import nvidia.dali` fail
    assert not dali_available()
    with pytest.raises(ImportError, match=r"--input_pipeline dali .* pip install nvidia-dali-cuda120"):
        DaliPrefetcher(flat_batches(11, [1]), "cpu")


@pytest.mark.gpu
@needs_cuda
def test_cuda_outputs_are_on_the_device_and_equal(dali):
    batches = [static_prepare(4)(random_rows(np.random.default_rng(12), 3)) for _ in range(4)]
    with DaliPrefetcher(batches, "cuda") as prefetcher:
        got = list(prefetcher)
    assert all(t.is_cuda for g in got for t in (g.input_ids, g.cu_seqlens, g.next_sentence_labels))
    expected = list(DevicePrefetcher(batches, "cuda"))
    assert_same_batches(got, expected)


# ---------------------------------------------------------------- benchmarks/input_pipeline.py


def test_benchmark_delivers_the_same_batches_on_every_path(dali, tmp_path):
    out = tmp_path / "input.json"
    code = input_pipeline.main(["--config", "tiny", "--device", "cpu", "--batches", "3", "--warmup", "1",
                                "--rows", "3", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["rows"] == 3 and report["dali"] is not None
    results = {r["path"]: r for r in report["results"]}
    assert set(results) == set(input_pipeline.PATHS)
    assert len({r["checksum"] for r in results.values()}) == 1
    for r in results.values():
        assert r["status"] == "ok" and r["batches"] == 3, r
        assert r["batches_per_s"] == pytest.approx(3 / r["seconds"]) and r["host_cpu_ms_per_batch"] > 0
        assert r["consumer_wait_ms_per_batch"] is None  # CPU: no stream to wait on


def test_benchmark_checksum_sees_order_and_field_swaps():
    a, b = flat_batches(13, [2, 3])
    total = lambda batches: sum(  # noqa: E731
        int(sum(input_pipeline.checksum_terms(x, i)[0])) + input_pipeline.checksum_terms(x, i)[1]
        for i, x in enumerate(batches))
    swapped = replace(a, input_ids=a.segment_ids, segment_ids=a.input_ids)
    assert total([a, b]) != total([b, a]) and total([a, b]) != total([swapped, b])
