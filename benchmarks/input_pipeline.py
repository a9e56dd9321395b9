"""Input pipelines side by side: PyTorch's DevicePrefetcher against DALI's (DaliPrefetcher).

    PYTHONPATH=pytorch:tools python benchmarks/input_pipeline.py --device cuda --batches 200 --json input.json
    PYTHONPATH=pytorch:tools python benchmarks/input_pipeline.py --config tiny --device cpu --batches 4    # seconds

Batches are the packed rows of throughput.py's synthetic data (config large: 48 rows of 512
tokens, K = 3 sequences per row, lengths from the Wikipedia phase-2 histogram) as static
packed batches (static_batch.static_packed_batch; Q = the widest row, as in the packed shards).
Every path delivers the same batches to the same consumer:

  torch          device_input.DevicePrefetcher over batches prepared before timing
  dali           DaliPrefetcher over the same prepared batches
  torch_prepare  DevicePrefetcher over static_packed_batch applied as batches are pulled
                 (on the consumer's thread, one batch ahead)
  dali_prepare   DaliPrefetcher.from_items: static_packed_batch runs in DALI's feed,
                 --depth batches ahead

The consumer takes a batch, reads every field (one reduction per tensor, summed into a
checksum that must agree between paths) and then spends --step_ms in a stand-in for the
training step: matrix multiplies on a GPU, a busy host thread on a CPU. Reported per path:
batches/s, host CPU ms per batch (CPU time of all the process's threads over the timed
batches), on a GPU the mean time the consumer's stream waits for a batch, and the setup time
(building the prefetcher, which also starts its first copies).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from mlperf_bert.input.device_input import DevicePrefetcher
from mlperf_bert.data.static_batch import static_packed_batch
from mlperf_bert.data.batch import FlatBatch, Item
from mlperf_bert.input.dali_input import INSTALL_HINT, DaliPrefetcher, dali_available
from mlperf_bert.runtime.files import output_file
from throughput import CONFIGS, SEQS_PER_ROW, BenchConfig, resolve_device, synthetic_steps

PATHS = ("torch", "dali", "torch_prepare", "dali_prepare")


@dataclass(frozen=True)
class Context:
    device: torch.device
    batches: int  # timed
    warmup: int  # untimed, first
    depth: int  # DALI's prefetch_queue_depth
    step_ms: float

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@dataclass(frozen=True)
class Workload:
    """The same batches for every path: as packed rows, and prepared."""

    rows: list[list[Item]]  # warmup + batches, cfg.rows packed rows each
    prepare: Callable[[Sequence[Item]], FlatBatch]
    prepared: list[FlatBatch]
    max_predictions: int  # Q: the widest row's masked positions


def widest_row(steps: list[list[Item]]) -> int:
    """Masked positions of the widest packed row: the Q of a packed shard holding these rows."""
    return max(sum(s.masked_lm_positions.shape[0] for s in row) for rows in steps for row in rows)


def build_workload(cfg: BenchConfig, seed: int) -> Workload:
    rows = synthetic_steps(cfg, seed)
    q = widest_row(rows)
    prepare = partial(static_packed_batch, rows=cfg.rows, row_len=cfg.max_seq_length,
                      max_seqs_per_row=SEQS_PER_ROW, max_predictions=q)
    return Workload(rows, prepare, [prepare(r) for r in rows], q)


# ---------------------------------------------------------------- the consumer


def checksum_terms(batch: Any, index: int) -> tuple[list[torch.Tensor], int]:
    """Sums of every field, weighted by field and batch position so that swaps change the total.

    Returns the device terms (one reduction per tensor field) and the host term (int fields).
    """
    device_terms, host_term = [], 0
    for k, f in enumerate(fields(batch)):
        value, weight = getattr(batch, f.name), (k + 1) * (index + 1)
        if isinstance(value, torch.Tensor):
            device_terms.append(value.sum(dtype=torch.int64) * weight)
        elif isinstance(value, tuple):  # FlatBatch.host_seqlens
            host_term += sum(value) * weight
        elif value is not None:  # FlatBatch.row_len is None outside static packed batches
            host_term += int(value) * weight
    return device_terms, host_term


class Consumer:
    """Takes batches as a training step would: reads every field, then a stand-in step."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._device_sum = torch.zeros((), dtype=torch.int64, device=ctx.device)
        self._host_sum = 0
        self._waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._step = make_step(ctx)

    def take(self, batches: Iterator[Any], index: int, timed: bool) -> None:
        before = self._event()
        batch = next(batches)
        after = self._event()
        if timed and before is not None:
            self._waits.append((before, after))
        device_terms, host_term = checksum_terms(batch, index)
        self._device_sum += torch.stack(device_terms).sum()
        self._host_sum += host_term
        self._step()

    def _event(self) -> torch.cuda.Event | None:
        if self.ctx.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.ctx.device))
        return event

    def checksum(self) -> int:
        return int(self._device_sum) + self._host_sum

    def mean_wait_ms(self) -> float | None:
        """Mean GPU time between the consumer stream reaching next() and passing it (call after a sync)."""
        if not self._waits:
            return None
        return sum(a.elapsed_time(b) for a, b in self._waits) / len(self._waits)


def make_step(ctx: Context) -> Callable[[], None]:
    """A stand-in step of about ctx.step_ms: queued matrix multiplies on a GPU, a busy host thread elsewhere."""
    if ctx.step_ms <= 0:
        return lambda: None
    if ctx.device.type != "cuda":
        return partial(busy_wait, ctx.step_ms / 1e3)
    a = torch.randn(2048, 2048, device=ctx.device, dtype=torch.bfloat16)
    repeats = max(1, round(ctx.step_ms / matmul_ms(a)))

    def step() -> None:
        for _ in range(repeats):
            a @ a

    return step


def busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def matmul_ms(a: torch.Tensor, repeats: int = 20) -> float:
    """Milliseconds of one a @ a on a's device."""
    a @ a
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ a
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / repeats


# ---------------------------------------------------------------- one path


@dataclass
class Result:
    path: str
    status: str  # "ok", or why the path did not run
    setup_ms: float = 0.0
    batches: int = 0
    seconds: float = 0.0
    batches_per_s: float = 0.0
    host_cpu_ms_per_batch: float = 0.0
    consumer_wait_ms_per_batch: float | None = None  # GPU only
    checksum: int = 0


@contextmanager
def open_path(path: str, work: Workload, ctx: Context) -> Iterator[Iterator[FlatBatch]]:
    """The path's prefetcher over the workload; DALI's is closed on the way out."""
    prepare = path.endswith("_prepare")
    if path.startswith("torch"):
        yield DevicePrefetcher(map(work.prepare, work.rows) if prepare else work.prepared, ctx.device)
        return
    prefetcher = (DaliPrefetcher.from_items(work.rows, work.prepare, ctx.device, ctx.depth) if prepare
                  else DaliPrefetcher(work.prepared, ctx.device, ctx.depth))
    with prefetcher:
        yield prefetcher


def run_path(path: str, work: Workload, ctx: Context) -> Result:
    if path.startswith("dali") and not dali_available():
        return Result(path, f"not available: {INSTALL_HINT}")
    consumer = Consumer(ctx)
    start = time.perf_counter()
    with open_path(path, work, ctx) as batches:
        setup = time.perf_counter() - start
        for i in range(ctx.warmup):
            consumer.take(batches, i, timed=False)
        ctx.synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(ctx.warmup, ctx.warmup + ctx.batches):
            consumer.take(batches, i, timed=True)
        ctx.synchronize()
        seconds, cpu_seconds = time.perf_counter() - wall, time.process_time() - cpu
        if next(batches, None) is not None:
            return Result(path, "failed: the prefetcher yielded more batches than it was given")
    return Result(path, "ok", 1e3 * setup, ctx.batches, seconds, ctx.batches / seconds,
                  1e3 * cpu_seconds / ctx.batches, consumer.mean_wait_ms(), consumer.checksum())


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=tuple(CONFIGS), default="large", help="throughput.py's batch shapes")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {PATHS}")
    p.add_argument("--batches", type=int, default=100, help="timed batches per path")
    p.add_argument("--warmup", type=int, default=3, help="untimed batches first")
    p.add_argument("--rows", type=int, help="packed rows per batch (default: 48 large, 4 tiny)")
    p.add_argument("--depth", type=int, default=2, help="DALI prefetch_queue_depth")
    p.add_argument("--step_ms", type=float, default=0.0, help="stand-in training step per batch, milliseconds")
    p.add_argument("--json", type=output_file, help="write the results here")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> list[str]:
    paths = args.paths.split(",")
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        raise SystemExit(f"--paths: unknown {unknown}; choose from {PATHS}")
    if args.batches < 1 or args.warmup < 0 or args.depth < 1 or (args.rows is not None and args.rows < 1):
        raise SystemExit("--batches, --depth and --rows must be >= 1, --warmup >= 0")
    return paths


def dali_version() -> str | None:
    if not dali_available():
        return None
    import nvidia.dali

    return nvidia.dali.__version__


def header(ctx: Context, cfg: BenchConfig, work: Workload) -> dict:
    cuda = ctx.device.type == "cuda"
    first = work.prepared[0]
    host_bytes = sum(v.numel() * v.element_size() for f in fields(first)
                     for v in [getattr(first, f.name)] if isinstance(v, torch.Tensor))
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(ctx.device) if cuda else platform.processor() or "cpu",
        "cpu_cores": os.cpu_count(), "torch": torch.__version__, "dali": dali_version(),
        "python": platform.python_version(), "rows": cfg.rows, "row_len": cfg.max_seq_length,
        "seqs_per_row": SEQS_PER_ROW, "max_predictions": work.max_predictions, "bytes_per_batch": host_bytes,
        "batches": ctx.batches, "warmup": ctx.warmup, "depth": ctx.depth, "step_ms": ctx.step_ms,
    }


def format_row(r: Result) -> str:
    if r.status != "ok":
        return f"{r.path:<14}  {r.status}"
    wait = "-" if r.consumer_wait_ms_per_batch is None else f"{r.consumer_wait_ms_per_batch:.3f}"
    return (f"{r.path:<14}{r.setup_ms:>9.1f}{r.batches_per_s:>11.1f}{r.host_cpu_ms_per_batch:>19.3f}{wait:>16}"
            f"  {r.checksum}")


def print_table(results: list[Result], head: dict) -> None:
    title = f"{'path':<14}{'setup ms':>9}{'batches/s':>11}{'host CPU ms/batch':>19}{'stream wait ms':>16}  checksum"
    print("\n".join([" ".join(f"{k}={v}" for k, v in head.items()), title] + [format_row(r) for r in results]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    paths = check_args(args)
    ctx = Context(resolve_device(args.device), args.batches, args.warmup, args.depth, args.step_ms)
    base = CONFIGS[args.config]
    cfg = replace(base, rows=args.rows or base.rows, steps=args.batches, warmup=args.warmup)
    work = build_workload(cfg, args.seed)
    results = [run_path(path, work, ctx) for path in paths]
    head = header(ctx, cfg, work)
    print_table(results, head)
    if args.json is not None:
        args.json.write_text(json.dumps({**head, "results": [asdict(r) for r in results]}, indent=2) + "\n")
    agree = len({r.checksum for r in results if r.status == "ok"}) <= 1
    if not agree:
        print("checksums differ: the paths did not deliver the same batches", file=sys.stderr)
    return 0 if agree and all(r.status == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
