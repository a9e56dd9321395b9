"""Training-step time of every clip mode, on W CPU processes (gloo).

    PYTHONPATH=pytorch OMP_NUM_THREADS=1 python benchmarks/clip_step_time.py [--world 2]
    python benchmarks/clip_step_time.py --device cuda --world 8 ...   (one process per GPU, NCCL)

A small transformer encoder (token embedding, N post-LN layers, vocabulary head) is wrapped in
DDP once per mode, with the same weights. Steps of the modes are interleaved (step i of every
mode, then step i+1 ...) so that background load falls on all modes alike. A step is zero_grad,
forward, backward (DDP all-reduces, clipping hooks), the non-finite vote, the optimizer's clip
(after_allreduce only) and an AdamW step. The first `--warmup` steps are dropped: they include
DDP's bucket rebuild and the bucket-wise hook's two learning steps, which do not overlap.
Prints rank 0's step times per mode (ms). On GPUs a step ends with a device synchronize, so
its time includes the all-reduces still in flight.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mlperf_bert.optim.clipping import ClipConfig, ClipHandle, ClipMode, apply_clip_mode, optimizer_clip_norm


class TinyEncoder(nn.Module):
    """Token ids [B, L] -> vocabulary logits [B, L, V]."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        layer = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


class ModeRunner:
    """One DDP copy of the model trained under one clip mode."""

    def __init__(self, mode: ClipMode, args: argparse.Namespace, device: torch.device):
        torch.manual_seed(0)
        model = TinyEncoder(args.vocab, args.hidden, args.layers, args.heads).to(device)
        ids = [device.index] if device.type == "cuda" else None
        self.ddp = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=args.bucket_cap_mb)
        config = ClipConfig(mode, max_grad_norm=1.0)
        self.clip: ClipHandle = apply_clip_mode(self.ddp, config)
        self.optimizer_clip = optimizer_clip_norm(config)
        self.optimizer = torch.optim.AdamW(self.ddp.parameters(), lr=1e-4)
        self.seconds: list[float] = []

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> None:
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.ddp(tokens)
        nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        flag = self.clip.nonfinite_flag()
        if flag is None or not bool(flag > 0):
            if self.optimizer_clip is not None:
                nn.utils.clip_grad_norm_(self.ddp.parameters(), self.optimizer_clip)
            self.optimizer.step()
        if tokens.is_cuda:
            torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - start)

    def num_buckets(self) -> str:
        hook = self.clip.hook
        return str(hook.num_buckets) if hasattr(hook, "num_buckets") else "-"


def run_rank(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    runners = {mode: ModeRunner(mode, args, device) for mode in ClipMode}
    generator = torch.Generator().manual_seed(rank)
    for _ in range(args.warmup + args.steps):
        tokens = torch.randint(args.vocab, (args.batch, args.seq), generator=generator).to(device)
        for runner in runners.values():
            runner.step(tokens, tokens)
    if rank == 0:
        print_table(runners, args.warmup)
    dist.destroy_process_group()


def print_table(runners: dict[ClipMode, ModeRunner], warmup: int) -> None:
    """Median, fastest and 90th-percentile step (ms) per mode; `vs none` compares medians."""
    params = sum(p.numel() for p in runners[ClipMode.NONE].ddp.parameters())
    print(f"{params / 1e6:.2f}M parameters ({4 * params / 2**20:.1f} MiB of fp32 gradient)")
    base = statistics.median(runners[ClipMode.NONE].seconds[warmup:])
    print(f"{'mode':<18} {'B':>3} {'median':>8} {'min':>8} {'p90':>8} {'vs none':>8}")
    for mode, runner in runners.items():
        ms = sorted(1e3 * s for s in runner.seconds[warmup:])
        median, p90 = statistics.median(ms), ms[int(0.9 * (len(ms) - 1))]
        print(f"{mode.value:<18} {runner.num_buckets():>3} {median:>8.1f} {ms[0]:>8.1f} {p90:>8.1f} "
              f"{median / (1e3 * base):>8.3f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="processes (one per GPU with --device cuda)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo; cuda: NCCL")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps per mode")
    parser.add_argument("--bucket_cap_mb", type=float, default=1.0, help="DDP bucket size (MiB)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() == 0:
        parser.error("--device cuda: no CUDA device is visible")
    return args


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        mp.spawn(run_rank, args=(args.world, store, args), nprocs=args.world)


if __name__ == "__main__":
    main()
