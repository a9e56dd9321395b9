"""Optimizer-step time and peak memory, sharded (`--distributed_optimizer`) against unsharded, on W gloo processes.

    PYTHONPATH=pytorch OMP_NUM_THREADS=1 python benchmarks/sharded_optimizer.py --world 2 4 8 --layers 2

The parameters have BERT-Large's shapes (vocabulary 30,522, hidden 1,024, FFN 4,096, 512
positions, the MLM transform and NSP heads) with `--layers` encoder layers (24 is BERT-Large:
336 M parameters; on a small machine fewer layers keep W processes in memory; every layer
adds the same 12.6 M parameters, so the per-parameter figures carry over). Every rank holds
its own random gradient. What is timed is what the sharded optimizer replaces:

- unsharded: one all-reduce of the whole gradient (one flat buffer, DDP's best case) and the
  whole `ForeachLamb` / `ForeachAdamW` step on every rank;
- sharded: `sharded.ShardedLamb` / `ShardedAdamW.step()`: the gradient copied into the flat
  buffer and reduce-scattered, the partial-norm all-reduces, the update of 1/W of the
  parameters, the all-gather of the weights.

Besides the whole step, the time outside the collectives is printed (the wall time inside
`dist.all_reduce` / `reduce_scatter_single` / `all_gather_single` subtracted): gloo's CPU
reduce-scatter and all-gather are several times slower than its all-reduce on the same bytes
(NCCL's are not), so on the CPU the whole step mostly measures gloo.

Each variant runs in its own processes, `--steps` steps after one warm-up step; a step's time
is the slowest rank's (barrier, step, max over ranks), and the median step is printed. Memory
is the largest process's peak resident set during the steps (VmHWM, reset once the optimizer
is built) above what it held with its parameters and gradients alone: the optimizer's state,
its buffers (the sharded one's flat weights and gradients) and the step's temporaries.

Exposed communication (`--exposed`): whole training steps (forward, backward through DDP, the
sharded step) of an MLP of `--layers` blocks Linear(H, 4H) -> GELU -> Linear(4H, H), with every
collective the sharded optimizer issues sent over a modelled link (`LinkModel`), in two
variants: the reduce-scatter after the backward in one piece (the hooks hand DDP unreduced
buckets and the step reduce-scatters, as before the overlap), and the overlapped one (each
block reduce-scattered as the backward completes it, the all-gathers issued block by block).
Printed: the step time and the time the host spent waiting for the link (the exposed part of
the communication), median over the steps of the slowest rank.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mlperf_bert.optim.optimizers import build_optimizer
from mlperf_bert.optim.sharded import build_sharded_optimizer

VOCAB, HIDDEN, FFN, POSITIONS = 30522, 1024, 4096, 512


def bert_large_shapes(layers: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(decayed, not decayed) parameter shapes of BERT-Large with `layers` encoder layers."""
    decay = [(VOCAB, HIDDEN), (POSITIONS, HIDDEN), (2, HIDDEN)]
    no_decay = [(HIDDEN,), (HIDDEN,)]  # embedding LayerNorm
    for _ in range(layers):
        decay += [(HIDDEN, HIDDEN)] * 4 + [(FFN, HIDDEN), (HIDDEN, FFN)]
        no_decay += [(HIDDEN,)] * 4 + [(FFN,), (HIDDEN,)] + [(HIDDEN,)] * 4  # biases, 2 LayerNorms
    decay += [(HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (2, HIDDEN)]  # pooler, MLM transform, NSP
    no_decay += [(HIDDEN,), (HIDDEN,), (HIDDEN,), (HIDDEN,), (VOCAB,), (2,)]
    return decay, no_decay


def parameters(layers: int, rank: int) -> list[dict]:
    """The groups, weights equal on every rank, gradients per rank."""
    weights = torch.Generator().manual_seed(0)
    grads = torch.Generator().manual_seed(1 + rank)
    groups = []
    for shapes, decay in zip(bert_large_shapes(layers), (0.01, 0.0)):
        params = []
        for shape in shapes:
            p = torch.nn.Parameter(torch.randn(shape, generator=weights) * 0.02)
            p.grad = torch.randn(shape, generator=grads) * 1e-3
            params.append(p)
        groups.append({"params": params, "weight_decay": decay})
    return groups


def status_mib(field: str) -> float:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """Sets the peak resident set back to the current one (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


class CollectiveClock:
    """Wall time spent inside the collectives the step calls (the `dist` functions, wrapped)."""

    NAMES = ("all_reduce", "reduce_scatter_single", "all_gather_single")

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in self.NAMES:
            setattr(dist, name, self._timed(getattr(dist, name)))

    def _timed(self, collective):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return collective(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return call


def run_rank(rank: int, world: int, store: str, args: argparse.Namespace, sharded: bool, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    groups = parameters(args.layers, rank)
    baseline = status_mib("VmRSS")
    hyper = (groups, args.optimizer, 1e-3, (0.9, 0.999), 1e-6, 0.01, 1.0)
    if sharded:
        optimizer = build_sharded_optimizer(*hyper)
        grads = [p.grad for g in groups for p in g["params"]]

        def step() -> None:
            optimizer.step()
    else:
        optimizer = build_optimizer(*hyper, implementation="foreach")
        params = [p for g in groups for p in g["params"]]
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        grads = [view.view_as(p) for view, p in zip(flat.split([p.numel() for p in params]), params)]
        for p, view in zip(params, grads):
            p.grad = view  # the gradients are views of one flat buffer: one all-reduce, as DDP's buckets

        def step() -> None:
            dist.all_reduce(flat)
            flat.div_(world)
            optimizer.step()
    saved = [g.clone() for g in grads]
    baseline += sum(g.numel() * g.element_size() for g in saved) / 2**20  # the benchmark's copy, not the optimizer's
    reset_peak()  # construction transients (the sharded one copies the weights into its flat buffer) left out
    times, update_times = [], []
    clock = CollectiveClock()
    for i in range(args.steps + 1):
        torch._foreach_copy_(grads, saved)  # the same gradient every step (the all-reduce overwrote it)
        dist.barrier()
        clock.seconds = 0.0
        start = time.perf_counter()
        step()
        total = time.perf_counter() - start
        took = torch.tensor([total, total - clock.seconds])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if i > 0:
            times.append(float(took[0]))
            update_times.append(float(took[1]))
    memory = torch.tensor([status_mib("VmHWM") - baseline])
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    if rank == 0:
        count = sum(p.numel() for g in groups for p in g["params"])
        Path(out).write_text(f"{statistics.median(times) * 1e3:.1f} {statistics.median(update_times) * 1e3:.1f} "
                             f"{float(memory):.0f} {count}")
    dist.destroy_process_group()


def measure(world: int, args: argparse.Namespace, sharded: bool) -> tuple[float, float, float, int]:
    """(step ms, step ms outside collectives, peak MiB, parameters)."""
    with tempfile.TemporaryDirectory() as tmp:
        store, out = str(Path(tmp) / "store"), str(Path(tmp) / "result")
        mp.spawn(run_rank, args=(world, store, args, sharded, out), nprocs=world)
        ms, update_ms, mib, count = Path(out).read_text().split()
    return float(ms), float(update_ms), float(mib), int(count)


class LinkModel:
    """A model of one rank's network link, not a measurement of one.

    Each collective really runs (gloo, asynchronously), and is also booked on the modelled link:
    it starts when issued or when the link is free (one collective at a time), and lasts
    `latency_s` plus the bytes a ring algorithm sends per rank divided by `bytes_per_s` (reduce-
    scatter and all-gather (W-1)/W of the full buffer, all-reduce twice that). `wait()` returns
    no earlier than the booked end (sleeping the rest), and a call without `async_op` waits at
    once; `exposed_s` sums the time the host spent in those waits: the communication the step
    did not hide. What it leaves out: contention between ranks, NCCL's protocols and
    topology, and gloo's own CPU time, which shares the cores with the compute here.
    """

    def __init__(self, world: int, bytes_per_s: float, latency_s: float) -> None:
        self.world, self.bytes_per_s, self.latency_s = world, bytes_per_s, latency_s
        self.free_at = 0.0
        self.exposed_s = 0.0
        self.booked_s = 0.0

    def seconds(self, name: str, numel: int, element_size: int) -> float:
        ring = (self.world - 1) / self.world * numel * element_size
        return self.latency_s + (2 * ring if name == "all_reduce" else ring) / self.bytes_per_s

    def install(self) -> None:
        """Wraps the `dist` calls the sharded optimizer makes (it looks them up at each call)."""
        for name, full in (("all_reduce", 0), ("reduce_scatter_single", 1), ("all_gather_single", 0)):
            setattr(dist, name, self._wrapped(name, getattr(dist, name), full))

    def _wrapped(self, name: str, collective, full: int):
        def call(*args, async_op: bool = False, **kwargs):
            work = collective(*args, async_op=True, **kwargs)
            tensor = args[full]  # the full-size buffer: the all-reduced tensor, or the input / output
            start = max(time.perf_counter(), self.free_at)
            self.free_at = start + self.seconds(name, tensor.numel(), tensor.element_size())
            self.booked_s += self.free_at - start
            handle = _OnLink(work, self.free_at, self)
            if async_op:
                return handle
            handle.wait()
            return None
        return call


class _OnLink:
    def __init__(self, work, end: float, link: LinkModel) -> None:
        self.work, self.end, self.link = work, end, link

    def wait(self) -> bool:
        start = time.perf_counter()
        self.work.wait()
        left = self.end - time.perf_counter()
        if left > 0:
            time.sleep(left)
        self.link.exposed_s += time.perf_counter() - start
        return True


def mlp(layers: int, hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                  torch.nn.Linear(4 * hidden, hidden)) for _ in range(layers)]
    return torch.nn.Sequential(*blocks)


def exposed_rank(rank: int, world: int, store: str, args: argparse.Namespace, overlap: bool, out: str) -> None:
    """One rank of `--exposed`: whole steps with the modelled link; rank 0 writes the medians."""
    from torch.nn.parallel import DistributedDataParallel

    from mlperf_bert.optim.clipping import ClipConfig, ClipMode, apply_clip_mode
    from mlperf_bert.optim.optimizers import parameter_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    net = mlp(args.layers, args.hidden)
    ddp = DistributedDataParallel(net, bucket_cap_mb=args.bucket_mb)
    # Overlapped: blocks of DDP's bucket size (the trainer's 25 MiB default); before: one piece.
    block = int(args.bucket_mb * 2**20) // 4 if overlap else sum(p.numel() for p in net.parameters())
    optimizer = build_sharded_optimizer(parameter_groups(net, 0.01), args.optimizer, 1e-4, (0.9, 0.999), 1e-6, 0.01,
                                        1.0, block_numel=block)
    apply_clip_mode(ddp, ClipConfig(ClipMode.AFTER_ALLREDUCE), reduces=False, sink=optimizer.shards if overlap else None)
    link = LinkModel(world, args.link_gb_per_s * 1e9, args.link_latency_us * 1e-6)
    link.install()
    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(rank))
    times, exposed, booked = [], [], []
    for i in range(args.steps + 2):  # DDP settles its buckets in the first two
        dist.barrier()
        link.exposed_s = link.booked_s = 0.0
        start = time.perf_counter()
        ddp(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        took = torch.tensor([time.perf_counter() - start, link.exposed_s, link.booked_s])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if i >= 2:
            times.append(float(took[0]))
            exposed.append(float(took[1]))
            booked.append(float(took[2]))
    if rank == 0:
        count = sum(p.numel() for p in net.parameters())
        Path(out).write_text(f"{statistics.median(times) * 1e3:.1f} {statistics.median(exposed) * 1e3:.1f} "
                             f"{statistics.median(booked) * 1e3:.1f} {len(optimizer.shards.blocks)} {count}")
    dist.destroy_process_group()


def measure_exposed(world: int, args: argparse.Namespace, overlap: bool) -> list[str]:
    """(step ms, exposed ms, link-booked ms, blocks, parameters) of the slowest rank, as text."""
    with tempfile.TemporaryDirectory() as tmp:
        store, out = str(Path(tmp) / "store"), str(Path(tmp) / "result")
        mp.spawn(exposed_rank, args=(world, store, args, overlap, out), nprocs=world)
        return Path(out).read_text().split()


def exposed_main(args: argparse.Namespace) -> None:
    print(f"{args.optimizer}, MLP of {args.layers} x (Linear({args.hidden}, {4 * args.hidden}), GELU, "
          f"Linear({4 * args.hidden}, {args.hidden})), {args.tokens} rows per rank; modelled link "
          f"{args.link_gb_per_s} GB/s, {args.link_latency_us} us per collective; DDP buckets and blocks of "
          f"{args.bucket_mb} MiB; median of {args.steps} steps, "
          "slowest rank")
    print("| world | parameters | variant | blocks | step ms | link busy ms | exposed ms |")
    print("|---|---|---|---|---|---|---|")
    for world in args.world:
        for overlap in (False, True):
            ms, exposed, booked, blocks, count = measure_exposed(world, args, overlap)
            variant = "overlapped, block by block" if overlap else "after the backward, one piece"
            print(f"| {world} | {int(count) / 1e6:.1f} M | {variant} | {blocks} | {float(ms):.0f} | {float(booked):.0f} "
                  f"| {float(exposed):.0f} |", flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4, 8], help="process counts to measure")
    parser.add_argument("--layers", type=int, default=24, help="encoder layers (24: BERT-Large)")
    parser.add_argument("--optimizer", choices=("lamb", "adam"), default="lamb")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up steps")
    parser.add_argument("--exposed", action="store_true",
                        help="measure exposed communication of whole steps over a modelled link instead")
    parser.add_argument("--hidden", type=int, default=512, help="--exposed: the MLP's width H")
    parser.add_argument("--tokens", type=int, default=256, help="--exposed: rows of the input per rank")
    parser.add_argument("--link_gb_per_s", type=float, default=1.0, help="--exposed: modelled bandwidth, GB/s")
    parser.add_argument("--link_latency_us", type=float, default=50.0,
                        help="--exposed: modelled latency per collective, microseconds")
    parser.add_argument("--bucket_mb", type=float, default=25.0,
                        help="--exposed: DDP's bucket cap and the overlapped optimizer's block size, MiB")
    args = parser.parse_args()
    for name in ("steps", "hidden", "tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.link_gb_per_s <= 0 or args.link_latency_us < 0 or args.bucket_mb <= 0:
        parser.error("--link_gb_per_s and --bucket_mb must be positive and --link_latency_us not negative")
    return args


def main() -> None:
    args = parse_args()
    if args.exposed:
        exposed_main(args)
        return
    print(f"{args.optimizer}, BERT-Large shapes with {args.layers} layer(s); median step of the slowest rank "
          "(all / outside the collectives), peak RSS above parameters + gradients (largest rank)")
    print("| world | parameters | unsharded step ms | sharded step ms | unsharded outside collectives ms | "
          "sharded outside collectives ms | unsharded MiB | sharded MiB |")
    for world in args.world:
        plain = measure(world, args, sharded=False)
        split = measure(world, args, sharded=True)
        print(f"| {world} | {plain[3] / 1e6:.1f} M | {plain[0]:.0f} | {split[0]:.0f} | {plain[1]:.0f} | {split[1]:.0f} "
              f"| {plain[2]:.0f} | {split[2]:.0f} |", flush=True)


if __name__ == "__main__":
    main()
