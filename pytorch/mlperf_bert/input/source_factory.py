"""Which `BatchSource` a run's --balance builds, over which stream, after which data check.

`open_batch_source` is the one entry, called after `run_start` (it reads the dataset): it
takes the shards and their row counts from the folder's verification record when it is
current (no file opened), else checks the folder from its metadata (`check_input_data`); opens
the rank's stream (its micro-batch slots, `slots.py`, over plain shards or a stratified folder)
and wraps it in the source of the configured policy (`sources.py` says what each policy does).
Every row is checked as it is read (`validate.read_shard`). The MPI-backed `cpu_exchange`
source is imported only when chosen: mpi4py starts MPI on import.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from ..config.settings import TrainConfig
from ..data.dataset import DataError, DataLimits, PretrainingDataset, ShardReaders, discover_shards
from ..data.stratified import StratifiedDataset, is_stratified
from ..data.record import read_record, stale_problems
from ..data.shards import folder_problems, folder_shards
from ..data.validate import check_widths
from ..runtime.distributed import DistEnv
from .exchange import TorchCollectives
from .slots import SlotLayout, SlotStream
from .sources import BatchSource, ExchangeSource, ItemStream, LocalSource, TokenMeter


def check_input_data(input_dir: str) -> None:
    """A training folder without a current verification record (--unverified_data), from its metadata
    (after the clock; `data_check` saw the same listing before it, for a run started by `main`).

    Complete (`shards.folder_problems`: MANIFEST.json's files present with their sizes, no
    temporary files, no gaps in the numbering, not refused by data_prep) and one dataset (every
    shard of one format and width). Every rank sees the same folder, so every rank stops alike.
    """
    problems = folder_problems(input_dir)
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise DataError(problems[0] + more)
    check_widths(folder_shards(Path(input_dir)) or discover_shards(input_dir))


def recorded_rows(input_dir: str) -> dict[Path, int] | None:
    """Each shard's rows from the folder's verification record, when the record is current; else None."""
    record = read_record(input_dir)
    if record is None or not record.ok or stale_problems(record):
        return None
    return {record.folder / name: entry.rows for name, entry in record.files.items()}


def open_stream(input_dir: str, limits: DataLimits, denv: DistEnv, micro_batch: int, seed: int,
                accumulation: int = 1, rows: dict[Path, int] | None = None) -> ItemStream:
    """The rank's micro-batch slots (`slots.py`) over stratified folders (strata.json) or plain shards.

    accumulation: micro-batches per optimizer step (--gradient_accumulation_steps).
    rows: shard -> rows, known from the verification record (None: read from each shard's metadata).
    """
    layout = SlotLayout(denv.world_size, accumulation, micro_batch)
    readers = ShardReaders(rows)
    if is_stratified(input_dir):
        def make(slot: int) -> ItemStream:
            return StratifiedDataset(input_dir, limits, rank=slot, world_size=layout.slots,
                                     items_per_rank_step=micro_batch, seed=seed, readers=readers)
    else:
        shards = discover_shards(input_dir)

        def make(slot: int) -> ItemStream:
            return PretrainingDataset(shards, limits, rank=slot, world_size=layout.slots,
                                      items_per_rank_step=micro_batch, seed=seed, readers=readers)
    return SlotStream.open(make, layout, denv.rank, readers)


def world_group() -> dist.ProcessGroup:
    """A gloo group of all ranks (the data path's host collectives); every rank calls it."""
    if not dist.is_initialized():
        raise RuntimeError("the data path of a multi-process run needs torch.distributed; call init_distributed first")
    return dist.new_group(backend="gloo")


def node_group(denv: DistEnv) -> dist.ProcessGroup:
    """A gloo group of this rank's node: ranks [n N, (n + 1) N), N = local_world_size.

    Every rank creates every node's group, in the same order (torch.distributed requires it).
    """
    per_node = denv.local_world_size
    if denv.world_size % per_node:
        raise ValueError(
            f"{denv.world_size} ranks do not split into nodes of {per_node} (LOCAL_WORLD_SIZE / "
            "SLURM_NTASKS_PER_NODE); launch the same number of ranks on every node"
        )
    groups = [dist.new_group(list(range(first, first + per_node)), backend="gloo")
              for first in range(0, denv.world_size, per_node)]
    return groups[denv.rank // per_node]


def open_batch_source(cfg: TrainConfig, denv: DistEnv, limits: DataLimits) -> BatchSource:
    """Builds the configured source; the caller closes it. Every rank calls it at the same point."""
    assert cfg.data.input_dir is not None, "TrainConfig requires --input_dir with --do_train"
    rows = recorded_rows(cfg.data.input_dir)
    if rows is None:
        check_input_data(cfg.data.input_dir)
    stream = open_stream(cfg.data.input_dir, limits, denv, cfg.micro_batch_size, cfg.run.seed,
                         cfg.gradient_accumulation_steps, rows)
    try:
        return _balanced(stream, cfg, denv)
    except BaseException:
        stream.close()
        raise


def _balanced(stream: ItemStream, cfg: TrainConfig, denv: DistEnv) -> BatchSource:
    policy, order = cfg.data.balance, cfg.data.deal_order
    if not denv.is_distributed:
        return LocalSource(stream)  # one rank: nothing to balance
    world = world_group()
    meter = TokenMeter(world)
    if policy == "none":
        return LocalSource(stream, meter)
    if policy == "cpu_exchange":
        from .host_exchange import CpuExchangeSource, mpi_collectives  # mpi4py starts MPI on import

        pin = cfg.run.device != "cpu" and torch.cuda.is_available()
        return CpuExchangeSource(stream, mpi_collectives(denv), order, meter, pin=pin)
    group = node_group(denv) if policy == "local_presort" else world
    return ExchangeSource(stream, TorchCollectives(group), order, meter)
