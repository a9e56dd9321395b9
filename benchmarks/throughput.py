"""Side-by-side training throughput of BERT phase 2, every input layout and HuggingFace, one process.

    PYTHONPATH=pytorch:tools python benchmarks/throughput.py --config large --json throughput.json
    PYTHONPATH=pytorch:tools python benchmarks/throughput.py --config large --precision bf16,fp8
    PYTHONPATH=pytorch:tools python benchmarks/throughput.py --config tiny --device cpu    # seconds, for CI
    PYTHONPATH=pytorch:tools python benchmarks/throughput.py --from_config config_DGXH200_1x8.sh  # a config's set-up
    PYTHONPATH=pytorch:tools python benchmarks/throughput.py --from_config config_DGXH200_1x8.sh \
        --config_var PRECISION=bf16 --config_var COMPILE_MODE=none       # the same step, bf16 and eager

Every set-up (a layout at a precision) trains a freshly initialised model (same seed) with
LAMB on the same synthetic batches: `--warmup` untimed steps once, then `--rounds` rounds of
`--steps` timed steps. Each round runs every set-up once, in an order that rotates by one
set-up per round, so a slow minute of a shared machine falls on all of them alike, and each
set-up's speed-up against `hf_padded` (at the same precision) is taken within the round:
the report gives its median over the rounds with the lowest and highest (the spread), and
rates from each set-up's median round. The layouts:

  padded     our model; host batches padded to max_seq_length, unpadded on the device
  unpadded   our model; the step's sequences sorted by length (presort), flat on the host
  packed     our model; the step's packed rows as one static-shape batch, replayed as one
             CUDA graph on a GPU (eager elsewhere, or with --graphs off)
  hf_padded  HuggingFace BertForPreTraining, padded to max_seq_length, --hf_attention (sdpa)

A step is `--rows` packed rows (NVIDIA's H100/H200 configuration: 48 rows of 512 tokens per
GPU); the padded and unpadded layouts get exactly the sequences of those rows, so real
sequences per step are the same for every layout. Rows are drawn from an NNLSHP packing
plan of the Wikipedia phase-2 length histogram (K = 3 sequences per row), so sequence
lengths follow that histogram; masking is the dataset's: min(P, max(1, round(0.15 (n-3))))
predictions per sequence at positions 1..n-2 other than the middle [SEP]. Host batches are
built (and pinned on a GPU) before timing; the timed loop covers host-to-device copies and
training steps.

Precisions (`--precision`, comma-separated): fp32, bf16, fp16, and fp8, the trainer's
`--precision fp8` (the encoder's linear layers through torchao's Float8Linear, `model/fp8.py`;
the same layers of the HuggingFace model, whose names are the same). Off a GPU of compute
capability >= 8.9 FP8 is emulated: its numbers show that it runs, not how fast it is.

`--from_config config_X.sh` times exactly the set-up a config trains with: the config is
sourced and handed to `run_and_time.sh` (its one table of config variables to trainer flags),
whose trainer command is caught and parsed by the trainer's own parser into its `TrainConfig`;
layout, precision, compile mode, CUDA graphs, attention back-end and its groups, optimizer and
sharding come from that config, the step from its per-GPU batch (packed rows; a flat layout
gets the sequences of half as many rows, since a pack holds 2 sequences as the configs count
them). One process cannot shard: a sharded config is timed with the optimizer's whole update,
which is what the sharded optimizer computes on one rank. `--config_var NAME=VALUE` (repeatable)
sets a config variable on top of the config before run_and_time.sh reads it, as an `export` after
the config's own would: the same step with one thing changed, labelled `packed/bf16 [PRECISION=bf16]`
and recorded in the results (`config_vars`).

Reported per set-up: real sequences/s, real tokens/s, useful TFLOP/s (mlperf_bert.model.flops:
3 x forward matrix multiplies over real tokens only) and utilisation against the peak
matrix-multiply rate measured in the same run (bf16 on a GPU, fp32 on a CPU), the speed-up
against hf_padded (median, lowest, highest of the rounds) and every round's seconds.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from clip_study import RUN_AND_TIME, launch_env, trainer_flags
from mlperf_bert.model import flops
from mlperf_tools.bring_up.workload import SEQS_PER_ROW, length_histogram, row_strategies, synthetic_sample
from mlperf_bert.model.compiling import compile_model
from mlperf_bert.config.settings import ATTENTION_BACKENDS, COMPILE_MODES, DEFAULT_GROUP_BOUNDS, parse_group_bounds
from mlperf_bert.optim.capturable import capturable, device_lr
from mlperf_bert.input.device_input import DevicePrefetcher, map_tensors
from mlperf_bert.train.metrics import StepMetrics
from mlperf_bert.model.precision import autocast
from mlperf_bert.data.batch import IGNORE_INDEX
from mlperf_bert.data.static_batch import static_packed_batch
from mlperf_bert.train.step import EagerStep, GraphedStep, Step
from mlperf_bert.model.attention import resolve_backend
from mlperf_bert.data.batch import FlatBatch, Item, PaddedBatch, Sample, flatten_items, pad_items, unpad
from mlperf_bert.model.bert import BertConfig, BertForPreTraining
from mlperf_bert.model.fp8 import Fp8Recipe, convert_to_fp8
from mlperf_bert.optim.optimizers import build_optimizer, parameter_groups
from mlperf_bert.config.cli import parse_config
from mlperf_bert.config.settings import ConfigError, TrainConfig
from mlperf_bert.runtime.files import output_file

LAYOUTS = ("padded", "unpadded", "packed", "hf_padded")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
REFERENCE = "hf_padded"  # the layout every speed-up is measured against, round by round


@dataclass(frozen=True)
class BenchConfig:
    bert: BertConfig
    max_seq_length: int
    max_predictions: int  # per sequence, and per packed row
    rows: int  # packed rows per step
    steps: int  # timed steps per round
    warmup: int
    rounds: int


CONFIGS = {
    "large": BenchConfig(BertConfig(vocab_size=30522), 512, 76, rows=48, steps=10, warmup=5, rounds=5),
    "tiny": BenchConfig(
        BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                   max_position_embeddings=64),
        64, 10, rows=4, steps=3, warmup=1, rounds=3,
    ),
}


# ---------------------------------------------------------------- synthetic data


def synthetic_steps(cfg: BenchConfig, seed: int) -> list[list[Item]]:
    """warmup + steps batches of cfg.rows packed rows each."""
    rng = np.random.default_rng(seed)
    strategies, probs = row_strategies(cfg.max_seq_length)
    picks = rng.choice(len(strategies), size=(cfg.warmup + cfg.steps, cfg.rows), p=probs)
    make = lambda n: synthetic_sample(rng, n, cfg.bert.vocab_size, cfg.max_predictions)  # noqa: E731
    return [[tuple(make(n) for n in strategies[j]) for j in step] for step in picks]


def sequences(rows: list[Item]) -> list[Sample]:
    return [s for row in rows for s in row]


# ---------------------------------------------------------------- measurement


@dataclass(frozen=True)
class Context:
    cfg: BenchConfig
    device: torch.device
    precision: str
    compile_mode: str
    graphs: bool
    attention_backend: str
    hf_attention: str
    group_bounds: tuple[int, ...]
    seed: int
    precisions: tuple[str, ...] = ()  # every precision of the run; `precision` is this context's
    optimizer: str = "lamb"  # with the H100 1x8 hyperparameters either way (`make_optimizer`)
    sharded: bool = False  # the config shards its optimizer (timed unsharded: one process, see the docstring)
    layouts: tuple[str, ...] = LAYOUTS
    fp8: Fp8Recipe = Fp8Recipe()  # under fp8: the recipe (a config's FP8_RECIPE and FP8_LAYERS)
    config_vars: tuple[tuple[str, str], ...] = ()  # --config_var overrides of a --from_config set-up

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@dataclass
class Runner:
    """One layout, built and ready: `step` trains on one batch taken from `feed`."""

    step: Callable[[Any], None]
    host_batches: list[Any]  # warmup + steps, in order
    read_loss: Callable[[], float]  # mean loss of the steps since the last read
    prefetch: bool = True  # feed batches through DevicePrefetcher; else hand host batches to `step`
    notes: str = ""


def feed(runner: Runner, ctx: Context, batches: list[Any]) -> Iterator[Any]:
    return iter(DevicePrefetcher(batches, ctx.device)) if runner.prefetch else iter(batches)


def warm_up(runner: Runner, ctx: Context) -> None:
    """The ctx.cfg.warmup untimed steps (compile, graph capture, optimizer state); their loss is dropped."""
    for batch in feed(runner, ctx, runner.host_batches[: ctx.cfg.warmup]):
        runner.step(batch)
    if ctx.cfg.warmup:
        runner.read_loss()
    ctx.synchronize()


def time_round(runner: Runner, ctx: Context) -> float:
    """Seconds for one round: the timed steps (every batch after the warm-up ones), host-to-device copies included."""
    batches = feed(runner, ctx, runner.host_batches[ctx.cfg.warmup :])
    ctx.synchronize()
    start = time.perf_counter()
    for batch in batches:
        runner.step(batch)
    ctx.synchronize()
    return time.perf_counter() - start


def matmul_peak_tflops(device: torch.device, size: int, repeats: int = 10) -> tuple[float, str]:
    """Best-case matrix-multiply rate measured now: bf16 on a GPU, fp32 on a CPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync()
    seconds = (time.perf_counter() - start) / repeats
    return 2 * size**3 / seconds / 1e12, str(dtype).replace("torch.", "")


# ---------------------------------------------------------------- our model, three layouts


def pinned(batch: Any, ctx: Context) -> Any:
    return map_tensors(batch, torch.Tensor.pin_memory) if ctx.device.type == "cuda" else batch


def build_ours(ctx: Context, dynamic: bool) -> tuple[BertForPreTraining, torch.optim.Optimizer, str]:
    torch.manual_seed(ctx.seed)
    bert = ctx.cfg.bert
    backend = resolve_backend(ctx.attention_backend, ctx.device, ctx.cfg.max_seq_length, ctx.group_bounds)
    model = BertForPreTraining(bert, attention_backend=backend, group_bounds=ctx.group_bounds)
    model = fp8_layers(model, ctx).to(ctx.device)
    compile_model(model, ctx.compile_mode, dynamic=dynamic)
    optimizer = make_optimizer(model, ctx)
    device_lr(optimizer, ctx.device)
    return model, optimizer, f"attention {backend}, compile {ctx.compile_mode}{fp8_note(ctx)}{optimizer_note(ctx)}"


def optimizer_note(ctx: Context) -> str:
    note = "" if ctx.optimizer == "lamb" else f", {ctx.optimizer}"
    return note + (", sharded optimizer timed whole (one process)" if ctx.sharded else "")


def fp8_layers(model: torch.nn.Module, ctx: Context) -> torch.nn.Module:
    """Under fp8, the trainer's FP8 layers (`model/fp8.py`); HuggingFace's BERT has the same layer names."""
    return convert_to_fp8(model, ctx.device, ctx.fp8) if ctx.precision == "fp8" else model


def fp8_note(ctx: Context) -> str:
    if ctx.precision != "fp8":
        return ""
    recipe = f" ({ctx.fp8.describe()})"
    return f", FP8 GEMMs{recipe}" if ctx.device.type == "cuda" else f", FP8 emulated{recipe} (not a speed)"


LR = 9.6e-4  # the MLPerf 1x8 H100 peak learning rate (REFERENCE.md)


def make_optimizer(model: torch.nn.Module, ctx: Context) -> torch.optim.Optimizer:
    """The MLPerf 1x8 H100 optimizer settings (REFERENCE.md), multi-tensor LAMB (or ADAM, as a config asks)."""
    return build_optimizer(parameter_groups(model, 0.1), ctx.optimizer, LR, (0.60466, 0.85437), 1e-6, 0.1, 1.0,
                           "foreach")


def scaler_for(ctx: Context) -> torch.amp.GradScaler | None:
    return torch.amp.GradScaler(ctx.device.type) if ctx.precision == "fp16" else None


def flat_runner(ctx: Context, steps: list[list[Item]], layout: str) -> Runner:
    """Our model on padded (unpadded on the device) or presorted unpadded batches."""
    model, optimizer, notes = build_ours(ctx, dynamic=True)
    metrics, train = StepMetrics(ctx.device), EagerStep(model, optimizer, ctx.precision, scaler=scaler_for(ctx))
    cfg = ctx.cfg
    if layout == "padded":
        host = [pad_items([(s,) for s in sequences(rows)], cfg.max_seq_length, cfg.max_predictions) for rows in steps]
    else:
        host = [flatten_items([(s,) for s in sorted(sequences(rows), key=lambda s: -s.length)]) for rows in steps]

    def step(batch: PaddedBatch | FlatBatch) -> None:
        flat = unpad(batch) if isinstance(batch, PaddedBatch) else batch
        metrics.update(train([flat], LR).last, flat)

    return Runner(step, [pinned(b, ctx) for b in host], lambda: metrics.read().loss, notes=notes)


def packed_runner(ctx: Context, steps: list[list[Item]]) -> Runner:
    """Our model on static-shape packed batches: one CUDA graph per step on a GPU."""
    model, optimizer, notes = build_ours(ctx, dynamic=False)
    for backend in ("sdpa", "grouped"):  # static packed batches carry row_len: attention per row
        notes = notes.replace(f"attention {backend},", f"attention {backend} per row,")
    cfg = ctx.cfg
    # Q of a packed shard: the widest row's predictions (three sequences can exceed the per-sequence 76).
    widest = max(sum(s.masked_lm_positions.shape[0] for s in row) for rows in steps for row in rows)
    host = [pinned(static_packed_batch(rows, cfg.rows, cfg.max_seq_length, SEQS_PER_ROW, widest), ctx)
            for rows in steps]
    metrics = StepMetrics(ctx.device)
    graphed = ctx.graphs and ctx.device.type == "cuda" and ctx.precision != "fp16"
    train: Step
    if graphed:
        train = GraphedStep(model, capturable(optimizer), [host[0]], ctx.precision)
    else:
        train = EagerStep(model, optimizer, ctx.precision, scaler=scaler_for(ctx))

    def step(batch: FlatBatch) -> None:
        # A graph reads its own static copy of the batch: the metrics read the same copy.
        metrics.update(train([batch], LR).last, train.static[0] if isinstance(train, GraphedStep) else batch)

    notes += ", CUDA graph" if graphed else ", eager"
    return Runner(step, host, lambda: metrics.read().loss, prefetch=not graphed, notes=notes)


# ---------------------------------------------------------------- HuggingFace


@dataclass
class HFBatch:
    """BertForPreTraining's padded inputs; labels -100 except at masked positions."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    token_type_ids: torch.Tensor  # [B, L]
    labels: torch.Tensor  # [B, L]
    next_sentence_label: torch.Tensor  # [B]

    @classmethod
    def of(cls, padded: PaddedBatch) -> "HFBatch":
        labels = torch.full_like(padded.input_ids, IGNORE_INDEX)
        rows, slots = torch.nonzero(padded.masked_lm_positions, as_tuple=True)
        labels[rows, padded.masked_lm_positions[rows, slots]] = padded.masked_lm_ids[rows, slots]
        return cls(padded.input_ids, padded.input_mask, padded.segment_ids, labels, padded.next_sentence_labels)

    def to(self, device: torch.device, non_blocking: bool = False) -> "HFBatch":
        return map_tensors(self, lambda t: t.to(device, non_blocking=non_blocking))


def hf_model(ctx: Context) -> torch.nn.Module:
    import transformers

    b = ctx.cfg.bert
    config = transformers.BertConfig(
        vocab_size=b.vocab_size, hidden_size=b.hidden_size, num_hidden_layers=b.num_hidden_layers,
        num_attention_heads=b.num_attention_heads, intermediate_size=b.intermediate_size,
        hidden_dropout_prob=b.hidden_dropout_prob, attention_probs_dropout_prob=b.attention_probs_dropout_prob,
        max_position_embeddings=b.max_position_embeddings, attn_implementation=ctx.hf_attention,
    )
    torch.manual_seed(ctx.seed)
    return fp8_layers(transformers.BertForPreTraining(config), ctx).to(ctx.device)


def hf_runner(ctx: Context, steps: list[list[Item]]) -> Runner:
    model = hf_model(ctx)
    optimizer, scaler = make_optimizer(model, ctx), scaler_for(ctx)
    loss_sum, count = torch.zeros((), device=ctx.device), [0]
    cfg = ctx.cfg
    host = [HFBatch.of(pad_items([(s,) for s in sequences(rows)], cfg.max_seq_length, cfg.max_predictions))
            for rows in steps]

    def step(batch: HFBatch) -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast(ctx.device, ctx.precision):
            loss = model(**vars(batch)).loss
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        loss_sum.add_(loss.detach())
        count[0] += 1

    def read_loss() -> float:
        mean = loss_sum.item() / max(count[0], 1)
        loss_sum.zero_()
        count[0] = 0
        return mean

    notes = f"attention {model.config._attn_implementation}, padded to {cfg.max_seq_length}{fp8_note(ctx)}"
    return Runner(step, [pinned(b, ctx) for b in host], read_loss, notes=notes)


# ---------------------------------------------------------------- results


@dataclass
class Result:
    layout: str
    precision: str
    status: str  # "ok", or why the set-up did not run
    notes: str = ""
    seconds: float = 0.0  # the median round's
    steps: int = 0  # timed steps per round
    sequences: int = 0  # real sequences in one round
    tokens: int = 0  # real tokens in one round
    useful_flop: float = 0.0
    loss: float = float("nan")  # mean training loss over every timed step
    sequences_per_s: float = 0.0
    tokens_per_s: float = 0.0
    useful_tflops: float = 0.0
    utilisation: float = 0.0  # useful_tflops / measured matmul peak
    round_seconds: list[float] = field(default_factory=list)  # each round's, in round order
    speedups_vs_hf: list[float] = field(default_factory=list)  # per round: hf_padded's seconds / this one's
    speedup_vs_hf: float | None = None  # their median
    speedup_min: float | None = None
    speedup_max: float | None = None
    config_vars: dict[str, str] = field(default_factory=dict)  # --config_var overrides, in the given order

    @property
    def name(self) -> str:
        """`packed/bf16`, with the overrides of the config when there are any: `packed/bf16 [PRECISION=bf16]`."""
        given = ", ".join(f"{k}={v}" for k, v in self.config_vars.items())
        return f"{self.layout}/{self.precision}" + (f" [{given}]" if given else "")

    @property
    def file_stem(self) -> str:
        """The name as a file name: `packed_bf16_PRECISION=bf16`."""
        return re.sub(r"[^A-Za-z0-9_.=-]+", "_", self.name).strip("_")


@dataclass(frozen=True)
class Work:
    sequences: int
    tokens: int
    useful_flop: float


def timed_work(cfg: BenchConfig, steps: list[list[Item]]) -> Work:
    seqs = [s for rows in steps[cfg.warmup :] for s in sequences(rows)]
    lengths = np.array([s.length for s in seqs])
    masked = np.array([s.masked_lm_positions.shape[0] for s in seqs])
    return Work(len(seqs), int(lengths.sum()), flops.training_flops(flops.ModelShape.of(cfg.bert), lengths, masked))


def build_runner(layout: str, ctx: Context, steps: list[list[Item]]) -> Runner:
    if layout in ("padded", "unpadded"):
        return flat_runner(ctx, steps, layout)
    if layout == "packed":
        return packed_runner(ctx, steps)
    return hf_runner(ctx, steps)


def profile_layout(runner: Runner, ctx: Context, result: Result, out_dir: Path) -> None:
    """Three more steps under torch.profiler: a Chrome trace and a table of the top ops."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for batch in feed(runner, ctx, runner.host_batches[-3:]):
            runner.step(batch)
        ctx.synchronize()
    out_dir.mkdir(parents=True, exist_ok=True)
    stem, name = result.file_stem, result.name
    prof.export_chrome_trace(str(out_dir / f"{stem}.trace.json"))
    key = "self_device_time_total" if ctx.device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=30)
    (out_dir / f"{stem}.txt").write_text(table + "\n")
    print(f"--- profile of {name} (3 steps) ---\n{table}", file=sys.stderr)


def free_memory(ctx: Context) -> None:
    """Returns a failed or finished set-up's model, graph and optimizer state to the allocator."""
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


def guarded(result: Result, ctx: Context, action: Callable[[], Any]) -> Any:
    """`action()`, or None with `result.status` saying why it failed (the other set-ups go on)."""
    try:
        return action()
    except torch.OutOfMemoryError as err:
        result.status = f"out of memory: {str(err).splitlines()[0]}"
    except ImportError as err:
        result.status = f"not available: {err}"
    except (RuntimeError, ValueError) as err:  # e.g. no varlen kernel for this dropout, FP8 on odd shapes
        result.status = f"failed: {str(err).splitlines()[0]}"
    free_memory(ctx)
    return None


@dataclass
class Setup:
    """One layout at one precision: its context, its runner once built, and its result so far."""

    ctx: Context
    result: Result
    runner: Runner | None = None
    losses: list[float] = field(default_factory=list)


def rotation(count: int, round_index: int) -> list[int]:
    """The order of the set-ups in a round: each round starts one set-up later than the one before."""
    return [(round_index + i) % count for i in range(count)]


def run_rounds(setups: list[Setup], steps: list[list[Item]], rounds: int) -> None:
    """Builds and warms up every set-up, then times `rounds` rounds of all of them in rotating order."""
    for setup in setups:
        setup.runner = guarded(setup.result, setup.ctx, lambda: build_runner(setup.result.layout, setup.ctx, steps))
        if setup.runner is not None:
            runner = setup.runner
            guarded(setup.result, setup.ctx, lambda: warm_up(runner, setup.ctx))
    for r in range(rounds):
        for setup in (setups[i] for i in rotation(len(setups), r)):
            if setup.result.status != "ok" or setup.runner is None:
                continue
            runner = setup.runner
            seconds = guarded(setup.result, setup.ctx, lambda: time_round(runner, setup.ctx))
            if seconds is not None:
                setup.result.round_seconds.append(seconds)
                setup.losses.append(runner.read_loss())


def finish(setup: Setup, work: Work, peak: float) -> Result:
    """Rates from the set-up's median round; the loss over all its rounds."""
    r = setup.result
    if r.status != "ok":
        return r
    seconds = float(np.median(r.round_seconds))
    tflops = work.useful_flop / seconds / 1e12
    r.notes = setup.runner.notes if setup.runner is not None else ""
    r.seconds, r.steps, r.sequences, r.tokens, r.useful_flop = seconds, setup.ctx.cfg.steps, work.sequences, \
        work.tokens, work.useful_flop
    r.loss = float(np.mean(setup.losses))
    r.sequences_per_s, r.tokens_per_s = work.sequences / seconds, work.tokens / seconds
    r.useful_tflops, r.utilisation = tflops, tflops / peak
    return r


def add_speedups(results: list[Result]) -> None:
    """Per round: hf_padded's seconds at the same precision over the set-up's; their median, lowest, highest."""
    reference = {r.precision: r for r in results if r.layout == REFERENCE and r.status == "ok"}
    for r in results:
        hf = reference.get(r.precision)
        if hf is None or r.status != "ok" or len(hf.round_seconds) != len(r.round_seconds):
            continue
        r.speedups_vs_hf = [h / s for h, s in zip(hf.round_seconds, r.round_seconds)]
        r.speedup_vs_hf = float(np.median(r.speedups_vs_hf))
        r.speedup_min, r.speedup_max = min(r.speedups_vs_hf), max(r.speedups_vs_hf)


def print_table(results: list[Result], header: dict) -> None:
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in header.items()
                   if v is not None and not isinstance(v, (dict, list)))
          + f" precisions={','.join(header['precisions'])}")
    width = max([16] + [len(r.name) + 2 for r in results])  # a label with --config_var overrides is longer
    print(f"{'set-up':<{width}}{'ms/step':>9}{'seq/s':>10}{'tokens/s':>12}{'TFLOP/s':>9}{'util':>7}{'loss':>8}"
          f"{'vs HF (min-max)':>18}  notes")
    for r in results:
        if r.status != "ok":
            print(f"{r.name:<{width}}  {r.status}")
            continue
        vs_hf = f"{r.speedup_vs_hf:.2f} ({r.speedup_min:.2f}-{r.speedup_max:.2f})" if r.speedup_vs_hf else "-"
        print(f"{r.name:<{width}}{1e3 * r.seconds / r.steps:>9.2f}{r.sequences_per_s:>10.1f}{r.tokens_per_s:>12.0f}"
              f"{r.useful_tflops:>9.3f}{r.utilisation:>7.1%}{r.loss:>8.3f}{vs_hf:>18}  {r.notes}")
    rounds = [" ".join(f"{s:.3f}" for s in r.round_seconds) for r in results if r.status == "ok"]
    for r, line in zip((r for r in results if r.status == "ok"), rounds):
        print(f"  {r.name}: seconds per round {line}; vs HF per round "
              + (" ".join(f"{x:.2f}" for x in r.speedups_vs_hf) or "-"))


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=tuple(CONFIGS), default="large")
    p.add_argument("--from_config", type=Path, metavar="config_X.sh",
                   help="time exactly this shipped config's set-up (layout, precision, compile mode, graphs, "
                        f"attention, optimizer, per-GPU batch); not with {', '.join(CONFIG_SETUP_FLAGS)}")
    p.add_argument("--config_var", action="append", default=[], metavar="NAME=VALUE",
                   help="with --from_config: set this config variable before run_and_time.sh reads the config "
                        "(repeatable), e.g. PRECISION=bf16 or COMPILE_MODE=none")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--precision", default="auto",
                   help=f"comma-separated subset of {PRECISIONS}, each run with every layout; auto: bf16 on a "
                        "GPU, fp32 on a CPU")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {LAYOUTS}")
    p.add_argument("--steps", type=int, help="timed steps per round (default: 10 large, 3 tiny)")
    p.add_argument("--rounds", type=int, help="rounds; each runs every set-up once (default: 5 large, 3 tiny)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default: 5 large, 1 tiny)")
    p.add_argument("--rows", type=int, help="packed rows per step (default: 48 large, 4 tiny)")
    p.add_argument("--attention_backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="grouped runs the padded and unpadded layouts per length group; packed rows run row by row")
    p.add_argument("--attention_group_bounds", default=",".join(map(str, DEFAULT_GROUP_BOUNDS)),
                   help="the grouped back-end's length groups (upper lengths, increasing)")
    p.add_argument("--attention_dropout", type=float,
                   help="override the config's 0.1 (e.g. 0 for PyTorch's varlen kernel, which has no dropout)")
    p.add_argument("--compile", choices=("auto",) + COMPILE_MODES, default="auto",
                   help="torch.compile mode for our layers; auto: default on a GPU, none on a CPU")
    p.add_argument("--graphs", choices=("auto", "on", "off"), default="auto", help="CUDA graph for packed")
    p.add_argument("--hf_attention", choices=("sdpa", "eager", "flash_attention_2"), default="sdpa")
    p.add_argument("--peak_size", type=int, help="matmul size for the peak (default 8192 GPU, 256 CPU)")
    p.add_argument("--profile_dir", type=Path, help="also profile 3 steps per set-up; traces and tables go here")
    p.add_argument("--json", type=output_file, help="write the results here")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


# Flags a config's set-up decides: --from_config refuses them (a config's figure is the config's).
CONFIG_SETUP_FLAGS = ("--precision", "--layouts", "--rows", "--attention_backend", "--attention_group_bounds",
                      "--compile", "--graphs")


@dataclass(frozen=True)
class ConfigSetup:
    """What a shipped config trains with: the trainer's own config of it, at the config's world size."""

    path: Path
    train: TrainConfig
    config_vars: dict[str, str] = field(default_factory=dict)  # set on top of the config (--config_var)

    @property
    def rows(self) -> int:
        """Packed rows per step: the per-GPU micro-batch in packs, or half its sequences for a flat layout."""
        micro = self.train.micro_batch_size
        return micro if self.train.data.input_layout == "packed" else max(1, (micro + 1) // 2)


def config_world_size(config: Path) -> int:
    """DGXNGPU x DGXNNODES of a config, sourced in bash as the launchers source it."""
    done = subprocess.run(["bash", "-c", 'source "$0" && echo "${DGXNGPU:-} ${DGXNNODES:-}"', str(config.resolve())],
                          env=launch_env(), capture_output=True, text=True, timeout=60, check=False)
    counts = done.stdout.split()
    if done.returncode != 0 or len(counts) != 2 or not all(c.isdigit() for c in counts):
        raise SystemExit(f"--from_config {config}: DGXNGPU and DGXNNODES must be whole numbers ({done.stderr.strip()})")
    return int(counts[0]) * int(counts[1])


# Variables the benchmark sets itself when it asks run_and_time.sh for a config's flags: the run's folders
# and files (placeholders no set-up depends on) and the interpreter that catches the flags.
PLACEHOLDER_VARS = ("DATADIR_PHASE2", "EVALDIR", "BERT_CONFIG", "INIT_CHECKPOINT", "OUTPUT_DIR", "SEED",
                    "NODE_RANK", "MASTER_ADDR", "PYTHON")
CONFIG_VAR = re.compile(r"([A-Z][A-Z0-9_]*)=(.*)", re.S)


def parse_config_vars(given: list[str], launcher: Path = RUN_AND_TIME) -> dict[str, str]:
    """`--config_var NAME=VALUE` flags as {NAME: VALUE} (a later one wins); SystemExit names a malformed one,
    a placeholder, and a variable the launcher never reads (its override would change nothing)."""
    known = launcher.read_text()
    values: dict[str, str] = {}
    for item in given:
        match = CONFIG_VAR.fullmatch(item)
        if match is None:
            raise SystemExit(f"--config_var {item}: give NAME=VALUE with an UPPER_CASE config variable name, "
                             "e.g. --config_var PRECISION=bf16")
        name, value = match.groups()
        if name in PLACEHOLDER_VARS:
            raise SystemExit(f"--config_var {item}: the benchmark sets {name} itself (no set-up depends on it)")
        if not re.search(rf"\b{name}\b", known):
            raise SystemExit(f"--config_var {item}: {launcher.name} does not read {name}, so it would change "
                             "nothing; give a variable of its flag table")
        values[name] = value
    return values


def trainer_flags_of(config: Path, config_vars: dict[str, str] | None = None) -> tuple[list[str], int]:
    """The trainer flags `run_and_time.sh` builds from `config` and `config_vars` on top of it
    (`clip_study.trainer_flags`: the launcher's own table of config variables, never a second mapping), and
    the config's world size. Only the run's folders and files, which no set-up depends on, are placeholders."""
    with tempfile.TemporaryDirectory(prefix="config_setup_") as tmp:
        folder = Path(tmp)
        for name in ("data", "eval"):
            (folder / name).mkdir()
        (folder / "bert_config.json").write_text("{}\n")
        (folder / "init.pt").touch()  # a closed-division config names the phase-1 checkpoint; never read here
        placeholders = {"DATADIR_PHASE2": str(folder / "data"), "EVALDIR": str(folder / "eval"),
                        "BERT_CONFIG": str(folder / "bert_config.json"), "INIT_CHECKPOINT": str(folder / "init.pt"),
                        "OUTPUT_DIR": str(folder / "out"), "SEED": "1", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        try:
            flags = trainer_flags(config.resolve(), {**(config_vars or {}), **placeholders})
        except RuntimeError as refused:
            lines = str(refused).strip().splitlines()
            raise SystemExit(f"--from_config {config}{given_note(config_vars)}: run_and_time.sh refused it: "
                             f"{lines[-1]}") from refused
    return flags, config_world_size(config)


def given_note(config_vars: dict[str, str] | None) -> str:
    return "".join(f" --config_var {k}={v}" for k, v in (config_vars or {}).items())


def config_setup(config: Path, config_vars: dict[str, str] | None = None) -> ConfigSetup:
    """The config's set-up with `config_vars` set on top, parsed and validated by the trainer (SystemExit with
    the line naming a problem)."""
    if not config.is_file():
        raise SystemExit(f"--from_config {config}: no such file; give a config_<SYSTEM>.sh of the repository")
    flags, world = trainer_flags_of(config, config_vars)
    try:
        return ConfigSetup(config, parse_config(flags, world), dict(config_vars or {}))
    except ConfigError as err:
        raise SystemExit(f"--from_config {config}{given_note(config_vars)}: the trainer refuses it: {err}") from err


def given_setup_flags(argv: list[str]) -> list[str]:
    return [flag for flag in CONFIG_SETUP_FLAGS if any(a == flag or a.startswith(f"{flag}=") for a in argv)]


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    return torch.device("cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu")


def bench_config(args: argparse.Namespace) -> BenchConfig:
    base = CONFIGS[args.config]
    bert = base.bert
    if args.attention_dropout is not None:
        bert = BertConfig(**{**bert.to_dict(), "attention_probs_dropout_prob": args.attention_dropout})
    cfg = BenchConfig(bert, base.max_seq_length, base.max_predictions, args.rows or base.rows,
                      args.steps or base.steps, base.warmup if args.warmup is None else args.warmup,
                      args.rounds or base.rounds)
    if min(cfg.rows, cfg.steps, cfg.rounds) < 1 or cfg.warmup < 0:
        raise SystemExit("--rows, --steps and --rounds must be >= 1, --warmup >= 0")
    return cfg


def chosen(flag: str, given: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """A comma-separated subset of `allowed`, in the given order; SystemExit names the unknown ones."""
    names = tuple(given.split(","))
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise SystemExit(f"{flag}: unknown {unknown}; choose from {allowed}")
    return names


def build_context(args: argparse.Namespace) -> Context:
    """The run's settings at its first precision (`contexts` gives one per precision)."""
    if args.from_config is not None:
        return config_context(args, config_setup(args.from_config, parse_config_vars(args.config_var)))
    if args.config_var:
        raise SystemExit("--config_var sets a variable of a config: it needs --from_config config_X.sh")
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    chosen("--layouts", args.layouts, LAYOUTS)
    precision = args.precision if args.precision != "auto" else ("bf16" if cuda else "fp32")
    precisions = chosen("--precision", precision, PRECISIONS)
    compile_mode = args.compile if args.compile != "auto" else ("default" if cuda else "none")
    graphs = args.graphs == "on" or (args.graphs == "auto" and cuda)
    try:
        bounds = parse_group_bounds(args.attention_group_bounds)
    except ValueError as err:
        raise SystemExit(str(err)) from err
    return Context(bench_config(args), device, precisions[0], compile_mode, graphs, args.attention_backend,
                   args.hf_attention, bounds, args.seed, precisions, layouts=chosen("--layouts", args.layouts, LAYOUTS))


def config_context(args: argparse.Namespace, setup: ConfigSetup) -> Context:
    """The benchmark's settings of a config's set-up (`--from_config`): its layout alone, at its precision.

    The GPU is the config's: `--device` still says where this process runs (auto: cuda when there is one).
    """
    train = setup.train
    cfg = bench_config(args)
    if args.config == "large":  # the config's step; `--config tiny` keeps its toy sizes (a smoke run)
        cfg = replace(cfg, max_seq_length=train.data.max_seq_length,
                      max_predictions=train.data.max_predictions_per_seq, rows=setup.rows)
    run = train.run
    return Context(cfg, resolve_device(args.device), run.precision, run.compile_mode, run.cuda_graphs,
                   train.model.attention_backend, args.hf_attention, train.model.group_bounds, args.seed,
                   (run.precision,), optimizer=train.optim.optimizer, sharded=train.optim.distributed,
                   layouts=(train.data.input_layout,), fp8=Fp8Recipe.of(run.fp8_recipe, run.fp8_layers),
                   config_vars=tuple(setup.config_vars.items()))


def header(ctx: Context, peak: float, peak_dtype: str, from_config: Path | None = None) -> dict:
    cfg = ctx.cfg
    name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else platform.processor() or "cpu"
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "device": name, "torch": torch.__version__,
        "python": platform.python_version(), "precisions": list(ctx.precisions), "compile": ctx.compile_mode,
        "graphs": ctx.graphs, "attention_backend": ctx.attention_backend, "optimizer": ctx.optimizer,
        "sharded": ctx.sharded, "rows_per_step": cfg.rows, "steps": cfg.steps, "rounds": cfg.rounds,
        "warmup": cfg.warmup, "max_seq_length": cfg.max_seq_length, "peak_tflops": peak, "peak_dtype": peak_dtype,
        "bert": cfg.bert.to_dict(), "fp8": asdict(ctx.fp8) if "fp8" in ctx.precisions else None,
        "from_config": None if from_config is None else str(from_config), "config_vars": dict(ctx.config_vars),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    refused = given_setup_flags(sys.argv[1:] if argv is None else argv) if args.from_config else []
    if refused:
        raise SystemExit(f"--from_config takes the set-up from the config: drop {', '.join(refused)}")
    ctx = build_context(args)
    peak, peak_dtype = matmul_peak_tflops(ctx.device, args.peak_size or (8192 if ctx.device.type == "cuda" else 256))
    steps = synthetic_steps(ctx.cfg, args.seed)
    work = timed_work(ctx.cfg, steps)
    setups = [Setup(replace(ctx, precision=precision), Result(layout, precision, "ok",
                                                              config_vars=dict(ctx.config_vars)))
              for precision in ctx.precisions for layout in ctx.layouts]
    run_rounds(setups, steps, ctx.cfg.rounds)
    results = [finish(setup, work, peak) for setup in setups]
    add_speedups(results)
    if args.profile_dir is not None:
        for setup in setups:
            if setup.result.status == "ok" and setup.runner is not None:
                profile_layout(setup.runner, setup.ctx, setup.result, args.profile_dir)
    head = header(ctx, peak, peak_dtype, args.from_config)
    print_table(results, head)
    if args.json is not None:
        args.json.write_text(json.dumps({**head, "results": [asdict(r) for r in results]}, indent=2) + "\n")
    return 0 if all(r.status == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
