"""How often each clip mode really clips in the CPU demo, measured along that mode's own run.

    python benchmarks/clip_activity.py --seed 1 --steps 125 --out docs/CLIPPING_STUDY.md

Clipping modes can only differ where clipping is active. For every mode, 2 processes (gloo)
train the demo from the flags run_and_time.sh builds for `config_CPU_1x2.sh` with that
CLIP_MODE (`clip_study.trainer_flags`), through the trainer's own `build_run` and
`trainer.train_step`. One thing is added: a
recording DDP comm hook that notes each bucket's local gradient norm, then hands the bucket to
the mode's own hook (`apply_clip_mode`'s) or to PyTorch's plain averaging all-reduce, and notes
the averaged bucket's norm when the all-reduce ends. Per mode, with c = --max_grad_norm:

    after_allreduce   clips a step when ||mean_r g_r|| > c (the optimizer's global clip)
    before_allreduce  clips rank r's gradient when ||g_r|| > c
    bucketwise        clips bucket b of rank r when ||g_r[b]|| > c / sqrt(B), B = buckets

The table gives the share of these decisions that clip, the mean clip coefficient
(min(1, threshold / norm); 1 = untouched) and the norms; it replaces the `clip_activity`
section of --out.
"""

import argparse
import dataclasses
import json
import math
import socket
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from clip_study import REPO, RunSpec, StudySetup, trainer_flags, write_section
from mlperf_bert import trainer
from mlperf_bert.build import Supplied, build_run
from mlperf_bert.config.cli import parse_config
from mlperf_bert.config.settings import CLIP_MODES
from mlperf_bert.runtime.distributed import DistEnv, init_distributed
from mlperf_bert.train.faults import StopRequest

WORLD = 2
CommHook = Callable[[object, dist.GradBucket], torch.futures.Future]


@dataclass
class StepNorms:
    """One synchronized backward on one rank: per-bucket L2 norms, in bucket index order."""

    local: list[float] = field(default_factory=list)  # ||g_r[b]|| as DDP hands bucket b over
    averaged: dict[int, float] = field(default_factory=dict)  # bucket -> norm after the all-reduce


@dataclass(eq=False)
class NormRecorder:
    """A DDP comm hook that records bucket norms around an inner hook (see the module docstring)."""

    inner_state: object
    inner_hook: CommHook
    steps: list[StepNorms] = field(default_factory=list)

    def communicate(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if bucket.index() == 0:
            self.steps.append(StepNorms())
        record, index = self.steps[-1], bucket.index()
        record.local.append(torch.linalg.vector_norm(bucket.buffer(), dtype=torch.float32).item())

        def note_average(done: torch.futures.Future) -> torch.Tensor:
            tensor = done.value()
            record.averaged[index] = torch.linalg.vector_norm(tensor, dtype=torch.float32).item()
            return tensor

        return self.inner_hook(self.inner_state, bucket).then(note_average)


class RecordingDDP(DistributedDataParallel):
    """The trainer's DDP wrapper with a `NormRecorder` as its one comm hook.

    DDP takes one hook only: the recorder is registered at once around PyTorch's averaging
    all-reduce, and the hook a clip mode registers (`apply_clip_mode`) runs inside it instead.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        super().__init__(model)
        self.recorder = NormRecorder(self.process_group, default_hooks.allreduce_hook)
        super().register_comm_hook(self.recorder, NormRecorder.communicate)

    def register_comm_hook(self, state: object, hook: CommHook) -> None:  # type: ignore[override]
        self.recorder.inner_state, self.recorder.inner_hook = state, hook


def record_mode(flags: list[str], denv: DistEnv, steps: int) -> list[StepNorms]:
    """Trains `steps` steps of one mode with the trainer's own run and step; this rank's records."""
    cfg = parse_config(flags, denv.world_size)
    wrapped: list[RecordingDDP] = []

    def recording_ddp(model: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
        wrapped.append(RecordingDDP(model, device))
        return wrapped[-1]

    with StopRequest() as stop:
        run = build_run(cfg, denv, torch.device("cpu"), stop, supplied=Supplied(ddp=recording_ddp))
        try:
            for _ in range(steps):
                trainer.train_step(run, until=run.state.samples + cfg.global_batch_size)
        finally:
            run.close()
    return wrapped[0].recorder.steps


def worker(rank: int, port: int, runs: dict[str, list[str]], steps: int, result: str) -> None:
    torch.set_num_threads(1)
    denv = DistEnv(rank, WORLD, rank, WORLD, "127.0.0.1", port)
    init_distributed(denv, torch.device("cpu"))
    gathered = {}
    for mode, flags in runs.items():
        mine = [dataclasses.asdict(s) for s in record_mode(flags, denv, steps)]
        everyone: list[list[dict]] = [[] for _ in range(WORLD)]
        dist.all_gather_object(everyone, mine)
        gathered[mode] = everyone
    if rank == 0:
        Path(result).write_text(json.dumps(gathered))
    dist.destroy_process_group()


@dataclass(frozen=True)
class Decisions:
    """Clip decisions of one mode: (norm, threshold) pairs, one per decision."""

    pairs: list[tuple[float, float]]

    @property
    def clipped_share(self) -> float:
        return sum(norm > limit for norm, limit in self.pairs) / len(self.pairs)

    @property
    def mean_coefficient(self) -> float:
        return statistics.mean(min(1.0, limit / norm) if norm > 0 else 1.0 for norm, limit in self.pairs)


def _rank_norm(bucket_norms: Sequence[float]) -> float:
    return math.sqrt(sum(n * n for n in bucket_norms))


def decisions(mode: str, ranks: list[list[dict]], c: float) -> Decisions:
    """The mode's clip decisions over all steps (and ranks, and buckets) of its run."""
    if mode == "before_allreduce":
        return Decisions([(_rank_norm(s["local"]), c) for steps in ranks for s in steps])
    if mode == "bucketwise":
        return Decisions([(n, c / math.sqrt(len(s["local"]))) for steps in ranks for s in steps for n in s["local"]])
    # after_allreduce, and for comparison none: the global norm of the averaged gradient.
    return Decisions([(_rank_norm(s["averaged"].values()), c) for s in ranks[0]])


def _median_p90(values: Sequence[float]) -> str:
    ordered = sorted(values)
    return f"{statistics.median(ordered):.2f} / {ordered[int(0.9 * (len(ordered) - 1))]:.2f}"


def table(gathered: dict[str, list[list[dict]]], c: float) -> list[str]:
    rows = ["| clip mode | steps | buckets B | local norm ‖g_r‖ median / p90 | averaged norm median / p90 "
            "| decisions that clip | mean clip coefficient |", "|---|---|---|---|---|---|---|"]
    for mode, ranks in gathered.items():
        local = [_rank_norm(s["local"]) for steps in ranks for s in steps]
        averaged = [_rank_norm(s["averaged"].values()) for s in ranks[0]]
        chosen = decisions(mode, ranks, c)
        share, coefficient = f"{chosen.clipped_share:.0%}", f"{chosen.mean_coefficient:.3f}"
        if mode == "none":  # what after_allreduce's rule would do to this run's gradients
            share, coefficient = f"none (after_allreduce's rule: {share})", f"none ({coefficient})"
        rows.append(f"| {mode} | {len(ranks[0])} | {len(ranks[0][-1]['local'])} | {_median_p90(local)} | "
                    f"{_median_p90(averaged)} | {share} | {coefficient} |")
    return rows


def render(gathered: dict[str, list[list[dict]]], args: argparse.Namespace) -> str:
    command = " ".join(["python", "benchmarks/clip_activity.py", *sys.argv[1:]])
    return "\n".join([
        "Command:", "", f"    {command}", "",
        f"Seed {args.seed}, the first {args.steps} steps of each mode, c = {args.max_grad_norm:g}. 'Averaged norm' "
        "is the norm of the all-reduced gradient before the optimizer: for after_allreduce and none "
        "the unclipped mean, for the hook modes the mean of the clipped local gradients.", "",
        *table(gathered, args.max_grad_norm),
    ])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=125, help="steps per mode (the demo reaches 0.72 in ~125)")
    parser.add_argument("--modes", nargs="+", choices=CLIP_MODES, default=list(CLIP_MODES))
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--config", type=Path, default=REPO / "config_CPU_1x2.sh")
    parser.add_argument("--demo_data", type=Path, default=REPO / "demo_data")
    parser.add_argument("--out", type=Path, help="Markdown file whose clip_activity section is replaced")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        setup = StudySetup(args.config.resolve(), args.demo_data.resolve(), Path(tmp), None)
        runs = {mode: trainer_flags(setup.config, setup.overrides(RunSpec(mode, args.seed, args.max_grad_norm)))
                for mode in args.modes}
        result = Path(tmp) / "norms.json"
        mp.spawn(worker, args=(free_port(), runs, args.steps, str(result)), nprocs=WORLD)
        gathered = json.loads(result.read_text())
    body = render(gathered, args)
    if args.out is not None:
        write_section(args.out, "clip_activity", body)
    print(body)


if __name__ == "__main__":
    main()
