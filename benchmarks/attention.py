"""Attention alone, forward and backward: sdpa, grouped and varlen on Wikipedia-length batches.

    PYTHONPATH=pytorch python benchmarks/attention.py --sequences 32 --rounds 12 --json attention.json
    PYTHONPATH=pytorch python benchmarks/attention.py --sequences 4 --heads 2 --head_dim 8 --rounds 2   # seconds

Each batch is `--sequences` lengths drawn from the Wikipedia phase-2 histogram (rescaled to
`--max_seq_length` as benchmarks/throughput.py does), with random q, k, v of BERT-Large's
heads. A round takes the next batch and runs every back-end once on it (the attention
forward, then its backward under one fixed upstream gradient), the back-ends' order rotated by
one each round so no back-end always runs first or after the same one. Machine noise on a
shared host moves whole rounds, so the figure of merit is each round's time ratio against
sdpa on the same batch: the median of the rounds and their spread (min, quartiles, max) are
reported, with each back-end's median time and the batches' score-work ratio (padded to the
batch's longest over grouped, `grouped_attention.score_entries`). A back-end that cannot run here
(varlen off a GPU, or PyTorch's varlen kernel with dropout) is reported with its reason.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from mlperf_bert.config.settings import DEFAULT_GROUP_BOUNDS, parse_group_bounds
from mlperf_bert.data.lengths import load_length_histogram
from mlperf_bert.model.attention import flat_layout, sdpa_attention, varlen_attention
from mlperf_bert.model.grouped_attention import grouped_attention, grouped_layout, score_entries
from mlperf_bert.runtime.files import output_file

BACKENDS = ("sdpa", "grouped", "varlen")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Batch:
    """One batch's lengths and its inputs on the device."""

    lengths: tuple[int, ...]
    q: torch.Tensor  # [T, heads, dim]
    k: torch.Tensor
    v: torch.Tensor
    upstream: torch.Tensor  # [T, heads, dim] gradient of the output


@dataclass
class Result:
    backend: str
    status: str  # "ok", or why it did not run
    seconds: list[float] = field(default_factory=list)  # per round
    ratio_vs_sdpa: list[float] = field(default_factory=list)  # per round
    median_ms: float = float("nan")
    ratio_median: float = float("nan")
    ratio_min: float = float("nan")
    ratio_q1: float = float("nan")  # quartiles of the rounds' ratios
    ratio_q3: float = float("nan")
    ratio_max: float = float("nan")


def wikipedia_lengths(rng: np.random.Generator, sequences: int, max_seq_length: int) -> tuple[int, ...]:
    """Lengths of the phase-2 histogram, l -> round(l * max / 512), at least 1 token."""
    counts = load_length_histogram()
    drawn = rng.choice(np.arange(1, counts.shape[0] + 1), size=sequences, p=counts / counts.sum())
    scaled = np.clip(np.floor(drawn * max_seq_length / counts.shape[0] + 0.5), 1, max_seq_length)
    return tuple(int(n) for n in scaled)


def make_batch(lengths: tuple[int, ...], heads: int, dim: int, dtype: torch.dtype, device: torch.device,
               seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    q, k, v, up = (torch.randn(tokens, heads, dim, generator=g).to(device, dtype) for _ in range(4))
    return Batch(lengths, q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), up)


def attention_of(backend: str, batch: Batch, bounds: tuple[int, ...], dropout: float
                 ) -> Callable[[], torch.Tensor]:
    """The back-end's forward over the batch, its index maps built once (as the model does per batch)."""
    cu = torch.tensor([0, *np.cumsum(batch.lengths)], dtype=torch.int32).to(batch.q.device)
    layout = flat_layout(cu, max(batch.lengths), sum(batch.lengths))
    if backend == "sdpa":
        return lambda: sdpa_attention(batch.q, batch.k, batch.v, layout, dropout)
    if backend == "grouped":
        groups = grouped_layout(cu, layout.seq_index, layout.pos_index, batch.lengths, bounds)
        return lambda: grouped_attention(batch.q, batch.k, batch.v, groups, dropout)
    return lambda: varlen_attention(batch.q, batch.k, batch.v, cu, max(batch.lengths), dropout)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(forward: Callable[[], torch.Tensor], batch: Batch) -> float:
    """Seconds of one forward and backward."""
    device = batch.q.device
    synchronize(device)
    start = time.perf_counter()
    out = forward()
    torch.autograd.grad(out, (batch.q, batch.k, batch.v), batch.upstream)
    synchronize(device)
    return time.perf_counter() - start


def runnable(backends: list[str], batch: Batch, bounds: tuple[int, ...], dropout: float) -> dict[str, str]:
    """'ok' or the reason each back-end cannot run here (one untimed try on the first batch)."""
    status = {}
    for backend in backends:
        try:
            time_once(attention_of(backend, batch, bounds, dropout), batch)
            status[backend] = "ok"
        except (RuntimeError, NotImplementedError) as err:
            status[backend] = f"not available: {str(err).splitlines()[0].split('. ')[0]}"  # the first sentence
    return status


def run_rounds(batches: list[Batch], backends: list[str], rounds: int, bounds: tuple[int, ...],
               dropout: float) -> dict[str, list[float]]:
    """Per back-end, the seconds of each round; round r runs batch r mod len(batches), order rotated by r."""
    seconds: dict[str, list[float]] = {b: [] for b in backends}
    for r in range(rounds):
        batch = batches[r % len(batches)]
        shift = r % len(backends)
        for backend in backends[shift:] + backends[:shift]:
            seconds[backend].append(time_once(attention_of(backend, batch, bounds, dropout), batch))
    return seconds


def summarise(status: dict[str, str], seconds: dict[str, list[float]]) -> list[Result]:
    results = []
    for backend, state in status.items():
        if state != "ok":
            results.append(Result(backend, state))
            continue
        times = seconds[backend]
        ratios = [t / s for t, s in zip(times, seconds["sdpa"])]
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        results.append(Result(backend, "ok", times, ratios, 1e3 * statistics.median(times), statistics.median(ratios),
                              min(ratios), q1, q3, max(ratios)))
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", type=int, default=32, help="sequences per batch")
    p.add_argument("--max_seq_length", type=int, default=512)
    p.add_argument("--batches", type=int, default=4, help="distinct batches, taken in turn by the rounds")
    p.add_argument("--rounds", type=int, default=12, help="timed rounds (each runs every back-end once)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.1, help="attention dropout (BERT's 0.1)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated subset of {BACKENDS}")
    p.add_argument("--attention_group_bounds", default=",".join(map(str, DEFAULT_GROUP_BOUNDS)))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", type=output_file, help="write the results here")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> tuple[list[str], tuple[int, ...], torch.device]:
    backends = args.backends.split(",")
    if "sdpa" not in backends or set(backends) - set(BACKENDS):
        raise SystemExit(f"--backends: a subset of {BACKENDS} that includes sdpa (the ratios' reference); "
                         f"got {args.backends!r}")
    if min(args.sequences, args.batches, args.rounds, args.heads, args.head_dim, args.max_seq_length) < 1:
        raise SystemExit("--sequences, --batches, --rounds, --heads, --head_dim and --max_seq_length must be >= 1")
    try:
        bounds = parse_group_bounds(args.attention_group_bounds)
    except ValueError as err:
        raise SystemExit(str(err)) from err
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    return backends, bounds, torch.device("cuda" if cuda else "cpu")


def print_table(results: list[Result], header: dict) -> None:
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in header.items()))
    print(f"{'backend':<9}{'median ms':>10}{'vs sdpa':>9}{'min':>7}{'q1':>7}{'q3':>7}{'max':>7}")
    for r in results:
        if r.status != "ok":
            print(f"{r.backend:<9}  {r.status}")
            continue
        print(f"{r.backend:<9}{r.median_ms:>10.1f}{r.ratio_median:>9.3f}{r.ratio_min:>7.3f}{r.ratio_q1:>7.3f}"
              f"{r.ratio_q3:>7.3f}{r.ratio_max:>7.3f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backends, bounds, device = check_args(args)
    rng = np.random.default_rng(args.seed)
    lengths = [wikipedia_lengths(rng, args.sequences, args.max_seq_length) for _ in range(args.batches)]
    batches = [make_batch(ls, args.heads, args.head_dim, DTYPES[args.dtype], device, args.seed + i)
               for i, ls in enumerate(lengths)]
    status = runnable(backends, batches[0], bounds, args.dropout)  # also the warm-up
    seconds = run_rounds(batches, [b for b in backends if status[b] == "ok"], args.rounds, bounds, args.dropout)
    results = summarise(status, seconds)
    work = [score_entries(ls) / score_entries(ls, bounds) for ls in lengths]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    header = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": name,
              "torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": args.dtype,
              "dropout": args.dropout, "sequences": args.sequences, "max_seq_length": args.max_seq_length,
              "heads": args.heads, "head_dim": args.head_dim, "rounds": args.rounds, "batches": args.batches,
              "bounds": ",".join(map(str, bounds)), "score_work_padded_over_grouped": statistics.mean(work)}
    print_table(results, header)
    if args.json is not None:
        args.json.write_text(json.dumps({**header, "lengths": lengths, "results": [asdict(r) for r in results]},
                                        indent=2) + "\n")
    return 0 if all(r.status == "ok" for r in results if r.backend != "varlen") else 1


if __name__ == "__main__":
    sys.exit(main())
