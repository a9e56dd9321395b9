"""Batch sources in one process: the exchange's encoding and routing, the stratified reader,
the imbalance meter, the prefetch thread, the launcher variables and the config checks.

The multi-process behaviour (real collectives, gloo and MPI) is in test_balance_dist.py.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest

from mlperf_bert import startup
from mlperf_bert.input import balance
from mlperf_bert.data.batch import Sample, flatten_items
from mlperf_bert.config.settings import ConfigError, DataSettings
from mlperf_bert.data.dataset import DataError, read_shard
from mlperf_bert.runtime.distributed import dist_env_from, launched_by_mpi
from mlperf_bert.input.exchange import decode_body, encode_body, encode_header, incoming, outgoing
from mlperf_bert.input.host_exchange import Prefetcher
from mlperf_bert.input.sources import LocalSource, TokenImbalance, TokenMeter
from mlperf_bert.data.stratified import Strata, StratifiedDataset, stratum_counts
from tests.harness.workers.balance import BOUNDS, ID_BASE, LIMITS, write_dataset


def uid(item) -> int:
    return int(item[0].input_ids[1]) - ID_BASE


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("plain"), [60, 60, 60], seed=1)


@pytest.fixture(scope="module")
def samples(plain) -> list[Sample]:
    return [item[0] for path in sorted(plain.glob("*.hdf5")) for item in read_shard(path, LIMITS)]


# --- the exchange's encoding and routing ------------------------------------------------------

def test_body_round_trip_keeps_every_field(samples):
    header = encode_header([(s,) for s in samples])
    for s, row in zip(samples, header):
        back = decode_body(encode_body(s), row)
        assert row.tolist() == [s.length, len(s.masked_lm_positions), s.next_sentence_label]
        for name in ("input_ids", "segment_ids", "masked_lm_positions", "masked_lm_ids"):
            np.testing.assert_array_equal(getattr(back, name), getattr(s, name))
        assert back.next_sentence_label == s.next_sentence_label


def test_packed_rows_are_refused(samples):
    with pytest.raises(ValueError, match="packed rows"):
        encode_header([(samples[0], samples[1])])


@pytest.mark.parametrize("world, local_batch, order", [(4, 8, "raster"), (3, 5, "snake"), (8, 2, "greedy")])
def test_routing_delivers_each_sample_to_its_rank_in_deal_order(world, local_batch, order):
    """What every rank sends to d, in send order, is what d expects from it, in arrival order."""
    lengths = np.random.default_rng(world).integers(1, 512, size=world * local_batch)
    assignment = balance.deal(lengths, world, order)
    channel = {}  # (source, destination) -> flat ids in send order
    for source in range(world):
        ids, destinations = outgoing(assignment, source, local_batch)
        assert (ids // local_batch == source).all() and (np.diff(destinations) >= 0).all()
        for d in range(world):
            channel[source, d] = ids[destinations == d].tolist()
    for d in range(world):
        arrived, positions = incoming(assignment, d, local_batch)
        assert arrived.tolist() == [i for s in range(world) for i in channel[s, d]]
        placed = np.empty_like(arrived)
        placed[positions] = arrived
        assert placed.tolist() == assignment[d].tolist()


# --- the stratified reader --------------------------------------------------------------------

def strata_uids(samples: list[Sample]) -> dict[int, set[int]]:
    by_stratum: dict[int, set[int]] = {}
    for s in samples:
        by_stratum.setdefault(int(np.searchsorted(BOUNDS, s.length)), set()).add(int(s.input_ids[1]) - ID_BASE)
    return by_stratum


def test_strata_counts_come_from_strata_json(stratified):
    record = json.loads((stratified / "strata.json").read_text())
    strata = Strata.read(stratified)
    assert list(strata.shares) == record["shares"]
    assert strata.per_batch(8) == stratum_counts(record["shares"], 8)
    assert sum(strata.per_batch(8)) == 8


def test_each_rank_reads_fixed_stratum_counts_and_every_sample_once(stratified, samples):
    world, batch = 2, 8
    streams = [StratifiedDataset(stratified, LIMITS, rank=r, world_size=world, items_per_rank_step=batch, seed=5)
               for r in range(world)]
    counts = streams[0].per_batch
    by_stratum = strata_uids(samples)
    steps = min(len(by_stratum[k]) // (world * c) for k, c in enumerate(counts))  # in every stratum's first pass
    seen = []
    for _ in range(steps):
        for stream in streams:
            batch_items = stream.next_batch()
            strata = [int(np.searchsorted(BOUNDS, item[0].length)) for item in batch_items]
            assert Counter(strata) == Counter({k: c for k, c in enumerate(counts) if c})
            seen += [uid(item) for item in batch_items]
    assert len(seen) == len(set(seen))
    for stream in streams:
        stream.close()


def test_stratified_stream_resumes_at_its_position_and_repeats_for_a_seed(stratified):
    def stream(seed: int) -> StratifiedDataset:
        return StratifiedDataset(stratified, LIMITS, rank=1, world_size=2, items_per_rank_step=8, seed=seed)

    first, again, other = stream(5), stream(5), stream(6)
    for _ in range(3):
        assert [uid(i) for i in first.next_batch()] == [uid(i) for i in again.next_batch()]
    assert [uid(i) for i in first.next_batch()] != [uid(i) for i in other.next_batch()]
    resumed = stream(5)
    resumed.load_state_dict(first.state_dict())
    assert [uid(i) for i in resumed.next_batch()] == [uid(i) for i in first.next_batch()]
    for s in (first, again, other, resumed):
        s.close()


def test_a_local_batch_that_skips_a_stratum_is_refused(stratified):
    with pytest.raises(DataError, match="never be trained on"):
        Strata.read(stratified).per_batch(2)


def test_strata_json_that_disagrees_with_the_shards_is_refused(stratified, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for k in range(len(BOUNDS)):
        (copy / f"stratum_{k}").symlink_to(stratified / f"stratum_{k}")
    record = json.loads((stratified / "strata.json").read_text())
    record["counts"][0] += 1
    (copy / "strata.json").write_text(json.dumps(record))
    with pytest.raises(DataError, match="records"):
        StratifiedDataset(copy, LIMITS, rank=0, world_size=1, items_per_rank_step=8, seed=0)
    (copy / "strata.json").write_text(json.dumps({"bounds": [16, 32]}))
    with pytest.raises(DataError, match="strata record"):
        Strata.read(copy)


# --- the local source and the imbalance meter -------------------------------------------------

def test_local_source_records_each_batch_and_flattens_it(stratified):
    source = LocalSource(StratifiedDataset(stratified, LIMITS, rank=0, world_size=1, items_per_rank_step=8, seed=0))
    items = source.next_batch()
    flat = source.next_flat_batch()
    loads = source.token_imbalance()
    assert loads.max_tokens.tolist() == loads.min_tokens.tolist() == [sum(i[0].length for i in items),
                                                                       flat.num_tokens]
    assert source.token_imbalance().micro_batches == 0  # the window restarts after each call
    source.close()


def test_token_imbalance_concatenates_windows():
    a = TokenImbalance(np.array([10, 20]), np.array([1, 2]))
    b = TokenImbalance(np.array([30]), np.array([3]))
    both = TokenImbalance.empty() + a + b
    assert (both.mean_max(), both.mean_min(), both.micro_batches) == (20.0, 2.0, 3)
    assert np.isnan(TokenImbalance.empty().mean_max())


def test_single_process_meter_reports_its_own_tokens(samples):
    meter = TokenMeter()
    meter.record([(s,) for s in samples[:3]])
    meter.record([(samples[3],)])
    loads = meter.collect()
    expected = [sum(s.length for s in samples[:3]), samples[3].length]
    assert loads.max_tokens.tolist() == loads.min_tokens.tolist() == expected
    assert flatten_items([(s,) for s in samples[:3]]).num_tokens == expected[0]


# --- the prefetch thread ----------------------------------------------------------------------

class Counting:
    """produce(): 1, 2, 3, ... ; fails at `fail_at`."""

    def __init__(self, fail_at: int = 0) -> None:
        self.calls = 0
        self.fail_at = fail_at
        self.lock = threading.Lock()

    def __call__(self) -> int:
        with self.lock:
            self.calls += 1
            if self.calls == self.fail_at:
                raise OSError("disk gone")
            return self.calls


@pytest.mark.parametrize("ahead, taken", [(1, 0), (1, 5), (2, 3), (3, 7)])
def test_prefetcher_produces_exactly_taken_plus_ahead(ahead, taken):
    """The number of produce calls depends only on how many results were taken (ranks stay in step)."""
    produce = Counting()
    prefetch = Prefetcher(produce, ahead=ahead)
    assert [prefetch.get() for _ in range(taken)] == list(range(1, taken + 1))
    prefetch.close()
    assert produce.calls == taken + ahead


def test_prefetcher_raises_the_producers_error_in_order():
    prefetch = Prefetcher(Counting(fail_at=3), ahead=2)
    assert [prefetch.get(), prefetch.get()] == [1, 2]
    with pytest.raises(RuntimeError, match="disk gone"):
        prefetch.get()
    prefetch.close()


# --- launcher variables and config checks ----------------------------------------------------

@pytest.mark.parametrize("env, expected", [
    ({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, (1, 4, 1, 2)),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, (3, 4, 1, 2)),
    # mpiexec inside a SLURM allocation: the processes inherit the batch script's SLURM_PROCID
    ({"PMI_RANK": "2", "PMI_SIZE": "4", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, (2, 4, 0, 4)),
    # torchrun inside an MPI job: torchrun's variables win
    ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "PMI_RANK": "1", "PMI_SIZE": "2"},
     (5, 8, 1, 4)),
])
def test_rank_facts_from_each_launcher(env, expected):
    denv = dist_env_from(env)
    assert (denv.rank, denv.world_size, denv.local_rank, denv.local_world_size) == expected


def test_mpi_launch_is_recognised():
    assert launched_by_mpi({"PMI_RANK": "0"}) and launched_by_mpi({"OMPI_COMM_WORLD_RANK": "0"})
    assert not launched_by_mpi({"RANK": "0", "SLURM_PROCID": "0"})


def data_settings(input_dir: Path | str, balance_policy: str, deal: str = "auto") -> DataSettings:
    return DataSettings(str(input_dir), "eval", input_layout="unpadded", balance=balance_policy, balance_deal=deal)


def test_deal_order_defaults_to_the_published_one_and_can_be_chosen(plain, stratified):
    assert data_settings(plain, "global_presort").deal_order == "raster"
    assert data_settings(stratified, "local_presort").deal_order == "snake"
    assert data_settings(plain, "global_presort", "greedy").deal_order == "greedy"


def test_config_rejects_senseless_balance_combinations(plain, stratified):
    with pytest.raises(ConfigError, match="prepare.py stratify"):
        startup._check_stratified_input(str(plain))  # the start-up check of the machine's files
    startup._check_stratified_input(str(stratified))
    with pytest.raises(ConfigError, match="--balance_deal snake"):
        data_settings(plain, "none", "snake")
    with pytest.raises(ConfigError, match="mpiexec"):
        startup._check_mpi_launch({"RANK": "0"})
    startup._check_mpi_launch({"PMI_RANK": "0"})
    assert data_settings(stratified, "cpu_exchange").balance == "cpu_exchange"
