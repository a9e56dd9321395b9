"""Step `stratify`: training samples -> one folder of balanced shards per length stratum.

Strata (Samsung's stratified local presort): by default the quarters of the sequence length
L, so 1-128, 129-256, 257-384, 385-512 at L = 512, in folders stratum_0 .. stratum_3. L (and
P, the prediction width of fixed outputs) come from the inputs' MANIFEST.json or fixed widths;
a flag that disagrees with them is refused, since the strata of 512 applied to 128-token data
would put every sample in stratum 0. Samples keep their input order inside a stratum (the
reshard step already shuffled them) and each stratum is cut into `shards_per_stratum`
balanced shards (fewer when a stratum has fewer samples). strata.json records
{"bounds", "counts", "shares"} with shares = counts / total, which the trainer turns into
the per-stratum sample counts of a local batch.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data_prep.fileio import Manifest, read_json_object, write_json
from data_prep.formats import STRATA_NAME, DataPrepError, shard_name
from data_prep.sources import SourceSet, agreed_length, balanced_bounds, inputs_record, recorded_lengths
from mlperf_bert.data.shards import Samples, write_samples

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StratifyParams:
    bounds: tuple[int, ...] | None = None  # default: the quarters of max_seq_length
    shards_per_stratum: int | None = None  # default: as many as there are input shards
    fmt: str = "varlength"
    max_seq_length: int | None = None  # default: what the inputs record
    max_predictions: int | None = None  # default: what the inputs record
    compression: str | None = None


@dataclass(frozen=True)
class StrataLayout:
    """What the stratum shards are written with: `StratifyParams` with the inputs' lengths filled in."""

    bounds: tuple[int, ...]
    fmt: str
    max_seq_length: int
    max_predictions: int  # 0 when the inputs record none (varlength outputs need none)
    compression: str | None


def strata_layout(params: StratifyParams, inputs: list[Path]) -> StrataLayout:
    """The lengths from the flags or the inputs (which must agree), the bounds checked against them."""
    recorded = recorded_lengths(Path(inputs[0]).parent)
    length = agreed_length(params.max_seq_length, recorded, "max_seq_length")
    predictions = params.max_predictions or 0
    if params.fmt == "fixed" or "max_predictions" in recorded:
        predictions = agreed_length(params.max_predictions, recorded, "max_predictions")
    bounds = tuple(params.bounds) if params.bounds else tuple(length * k // 4 for k in range(1, 5))
    if bounds[-1] != length:
        raise DataPrepError(f"strata bounds {list(bounds)} end at {bounds[-1]}, not at max_seq_length {length}; "
                            f"give --strata_bounds that end at {length}")
    return StrataLayout(bounds, params.fmt, length, predictions, params.compression)


def stratum_of(lengths: np.ndarray, bounds: tuple[int, ...]) -> np.ndarray:
    """[N] stratum index: 0 for lengths <= bounds[0], k for bounds[k-1] < length <= bounds[k]."""
    strata = np.searchsorted(np.asarray(bounds), lengths, side="left")
    if strata.size and strata.max() >= len(bounds):
        raise DataPrepError(f"a sequence of {lengths.max()} tokens is longer than the last stratum bound {bounds[-1]}")
    return strata


def stratum_dir(k: int) -> str:
    return f"stratum_{k}"


class _StratumWriter:
    """Collects one stratum's samples in input order and writes each shard once it is full."""

    def __init__(self, k: int, count: int, shards: int, manifest: Manifest, layout: StrataLayout):
        self.k, self.manifest, self.layout = k, manifest, layout
        self.shards = min(shards, count)
        self.bounds = balanced_bounds(count, self.shards) if self.shards else np.zeros(1, np.int64)
        self.pending: list[Samples] = []
        self.buffered = 0
        self.next_shard = 0

    def add(self, samples: Samples) -> None:
        self.pending.append(samples)
        self.buffered += len(samples)
        while self.next_shard < self.shards and self.buffered >= self._size(self.next_shard):
            merged = Samples.concat(self.pending)
            size = self._size(self.next_shard)
            self._write(merged.slice(0, size))
            rest = merged.slice(size, len(merged))
            self.pending, self.buffered = [rest], len(rest)
            self.next_shard += 1

    def _size(self, j: int) -> int:
        return int(self.bounds[j + 1] - self.bounds[j])

    def _write(self, samples: Samples) -> None:
        name = f"{stratum_dir(self.k)}/{shard_name(self.next_shard, self.shards)}"
        if not self.manifest.is_done(name):
            p = self.layout
            write_samples(self.manifest.directory / name, samples, p.fmt, p.max_seq_length, p.max_predictions,
                          p.compression)
            self.manifest.record(name, len(samples), p.fmt, stratum=self.k)


def strata_record(counts: np.ndarray, bounds: tuple[int, ...], shards: list[int], fmt: str) -> dict:
    total = max(int(counts.sum()), 1)
    return {"bounds": list(bounds), "counts": [int(c) for c in counts],
            "shares": [float(c) / total for c in counts], "shards": shards, "format": fmt}


def _finished(out_dir: Path, manifest: Manifest) -> dict | None:
    """strata.json when it exists and every shard it implies is done, else None."""
    path = out_dir / STRATA_NAME
    if not path.is_file():
        return None
    record = read_json_object(path)
    names = [f"{stratum_dir(k)}/{shard_name(j, n)}" for k, n in enumerate(record.get("shards", [])) for j in range(n)]
    return record if names and all(manifest.is_done(name) for name in names) else None


def stratify(inputs: list[Path], out_dir: Path, params: StratifyParams) -> dict:
    """Writes (or completes) the stratified shards of `inputs` under `out_dir`; returns strata.json."""
    if params.fmt not in ("fixed", "varlength"):
        raise DataPrepError(f"--format {params.fmt!r}: stratified shards are fixed or varlength")
    sources = SourceSet(inputs)
    layout = strata_layout(params, sources.paths)
    per_stratum = params.shards_per_stratum or len(sources.paths)
    settings = {**asdict(params), **asdict(layout), "shards_per_stratum": per_stratum,
                "inputs": inputs_record(sources.paths)}
    manifest = Manifest.open(out_dir, "stratify", settings)
    finished = _finished(out_dir, manifest)
    if finished is not None:
        log.info("stratify: %s is complete", out_dir)
        return finished
    strata = stratum_of(sources.lengths(), layout.bounds)
    counts = np.bincount(strata, minlength=len(layout.bounds))
    writers = [_StratumWriter(k, int(c), per_stratum, manifest, layout) for k, c in enumerate(counts)]
    for k, writer in enumerate(writers):
        (out_dir / stratum_dir(k)).mkdir(parents=True, exist_ok=True)
        if writer.shards == 0:
            log.warning("stratify: stratum %d (lengths up to %d) is empty", k, layout.bounds[k])
    with tqdm(total=sources.total, unit="samples", desc="stratify") as bar:
        for start, block in sources.blocks():
            block_strata = strata[start:start + len(block)]
            for k, writer in enumerate(writers):
                writer.add(block.take(np.flatnonzero(block_strata == k)))
            bar.update(len(block))
    record = strata_record(counts, layout.bounds, [w.shards for w in writers], layout.fmt)
    write_json(out_dir / STRATA_NAME, record)
    log.info("stratify: counts %s, shares %s", record["counts"], [round(s, 4) for s in record["shares"]])
    return record
