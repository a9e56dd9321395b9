"""Data-side cost of each load-balancing policy per training step, 8 ranks.

    python benchmarks/balance_cost.py [--local-batch 16 56] [--steps 2000]      # host work, one process
    python benchmarks/balance_cost.py --collectives [--ranks 8] [--exchange-steps 60]

In one process, for one node of 8 ranks, per step:
  assign    balance.balance on the all-gathered [8, B] lengths: what every rank computes after
            the all-gather of the lengths (the collective itself is not included)
  host      one rank's whole host work of an exchange without the communication: encode its
            headers and the bodies it sends, deal, route, decode the B samples it receives
  build     assign plus building all 8 ranks' flat batches (batch.flatten_items) from the
            pooled samples: the host work a step needs with or without balancing
and the payload a rank receives when the samples themselves are all-gathered (what NVIDIA's
exchange padding moves) against what the all-to-all of `input/exchange.py` moves.

With --collectives it also starts 8 processes (gloo, torch.distributed) and then
`mpiexec -n 8` (MPI) that run the real exchange (`exchange.exchange`) on synthetic samples
whose lengths follow the Wikipedia histogram, and reports per step the mean over steps of the
slowest rank's time (a step waits for it), for every deal order; the MPI run also measures
how long the trainer waits in `next_batch` of the CPU exchange source when its step takes
--step-ms (the exchange runs on the background thread meanwhile), and the imbalance meter's
one collective per log window. On a machine with fewer cores than ranks these numbers include
the ranks' competition for the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from mlperf_bert.input import balance
from mlperf_bert.data.batch import Item, Sample, flatten_items
from mlperf_bert.input.exchange import (
    decode_body, encode_body, encode_header, exchange, incoming, outgoing,
)
from mlperf_bert.data.lengths import load_length_histogram

RANKS = 8
ORDERS = ("raster", "snake", "greedy")
SCRIPT = Path(__file__).resolve()


def make_samples(lengths: np.ndarray, rng: np.random.Generator) -> list[Sample]:
    """Synthetic samples of the given lengths with 15% masked positions."""
    samples = []
    for n in lengths.tolist():
        masked = np.sort(rng.choice(np.arange(1, max(n, 2)), size=max(1, int(0.15 * n)), replace=n < 2))
        samples.append(
            Sample(
                input_ids=rng.integers(1000, 30000, size=n).astype(np.int16),
                segment_ids=(np.arange(n) >= n // 2).astype(np.int8),
                masked_lm_positions=masked.astype(np.int16),
                masked_lm_ids=rng.integers(1000, 30000, size=masked.shape[0]).astype(np.int16),
                next_sentence_label=int(rng.integers(0, 2)),
            )
        )
    return samples


def draw_lengths(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    counts = load_length_histogram()
    cdf = np.cumsum(counts) / counts.sum()
    return np.searchsorted(cdf, rng.random(shape), side="right") + 1


def gather_bytes(samples: Sequence[Sample]) -> int:
    """Bytes of all pooled samples at their stored widths: what an all-gather of them delivers to a rank."""
    return sum(
        s.input_ids.nbytes + s.segment_ids.nbytes + s.masked_lm_positions.nbytes + s.masked_lm_ids.nbytes + 1
        for s in samples
    )


def time_policy(policy: str, steps_lengths: np.ndarray, pools: list[list[Sample]], build: bool) -> float:
    """Microseconds per step of the policy (and of building the batches when `build`)."""
    start = time.perf_counter()
    for lengths, pool in zip(steps_lengths, pools):
        assignment = balance.balance(lengths, policy, gpus_per_node=RANKS)
        if build:
            for rank_indices in assignment:
                flatten_items([(pool[i],) for i in rank_indices])
    return (time.perf_counter() - start) / steps_lengths.shape[0] * 1e6


def encoded(pool: list[Sample]) -> tuple[np.ndarray, list[np.ndarray]]:
    """The headers and bodies of every pooled sample, as the other ranks would send them."""
    return encode_header([(s,) for s in pool]), [encode_body(s) for s in pool]


def host_work(pool: list[Sample], headers: np.ndarray, bodies: list[np.ndarray], order: str) -> int:
    """Rank 0's exchange host work for one step of the pooled [RANKS * B] samples; returns int32s received.

    Timed: its header, the deal, routing, encoding what it sends, decoding what it receives in
    deal order and flattening its batch. `headers` / `bodies` stand for what the collectives deliver.
    """
    local_batch = len(pool) // RANKS
    encode_header([(s,) for s in pool[:local_batch]])
    assignment = balance.deal(headers[:, 0], RANKS, order)
    send_ids, _ = outgoing(assignment, 0, local_batch)
    np.concatenate([np.zeros(0, np.int32)] + [encode_body(pool[i]) for i in send_ids])
    recv_ids, positions = incoming(assignment, 0, local_batch)
    mine: list[Item] = [()] * local_batch
    for i, position in zip(recv_ids, positions):
        mine[position] = (decode_body(bodies[i], headers[i]),)
    flatten_items(mine)
    return int(sum(bodies[i].shape[0] for i in recv_ids))


def time_host_work(pools: list[list[Sample]], order: str) -> tuple[float, float]:
    """(microseconds per step, int32 values received per step) of one rank's exchange host work."""
    inputs = [encoded(pool) for pool in pools]
    start = time.perf_counter()
    received = [host_work(pool, headers, bodies, order) for pool, (headers, bodies) in zip(pools, inputs)]
    return (time.perf_counter() - start) / len(pools) * 1e6, float(np.mean(received))


def report(local_batch: int, steps: int, build_steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    steps_lengths = draw_lengths((steps, RANKS, local_batch), rng)
    pools = [make_samples(step.ravel(), rng) for step in steps_lengths[:build_steps]]
    gathered = np.mean([gather_bytes(pool) for pool in pools])
    print(f"local batch {local_batch}, {RANKS} ranks: an all-gather of the samples delivers "
          f"{gathered / 1024:.0f} KiB per rank per step")
    print(f"{'policy':<16}{'assign us':>11}{'build us':>11}")
    for policy in balance.POLICIES:
        assign = time_policy(policy, steps_lengths, [[]] * steps, build=False)
        build = time_policy(policy, steps_lengths[:build_steps], pools, build=True)
        print(f"{policy:<16}{assign:>11.1f}{build:>11.1f}")
    for order in ORDERS:
        micros, values = time_host_work(pools, order)
        print(f"exchange host work, {order:<7}{micros:>9.1f} us per rank; the all-to-all delivers "
              f"{values * 4 / 1024:.0f} KiB per rank")


# --- the real collectives ---------------------------------------------------------------------

def worker_samples(rank: int, local_batch: int, steps: int) -> list[list[Item]]:
    rng = np.random.default_rng([rank, local_batch])
    lengths = draw_lengths((steps, local_batch), rng)
    return [[(s,) for s in make_samples(step, rng)] for step in lengths]


def time_exchanges(comm, batches: list[list[Item]], order: str, barrier) -> tuple[list[float], list[int]]:
    """Seconds of each step's exchange on this rank (the ranks aligned by `barrier` before each),
    and each step's most loaded rank after the deal, in tokens."""
    times, most = [], []
    for items in batches:
        barrier()
        start = time.perf_counter()
        done = exchange(items, comm, order)
        times.append(time.perf_counter() - start)
        most.append(int(done.group_tokens.max()))
    return times, most


def exchange_results(comm, batches: list[list[Item]], barrier) -> dict[str, list]:
    """{order: seconds per step, "max tokens <order>": tokens of the most loaded rank per step}."""
    results: dict[str, list] = {}
    for order in ORDERS:
        results[order], results[f"max tokens {order}"] = time_exchanges(comm, batches, order, barrier)
    results["max tokens none"] = [int(t) for t in unbalanced_max_tokens(comm, batches)]
    return results


def unbalanced_max_tokens(comm, batches: list[list[Item]]) -> np.ndarray:
    """[steps] tokens of the most loaded rank without balancing."""
    mine = np.array([sum(item[0].length for item in items) for items in batches], dtype=np.int32)
    return comm.all_gather(mine).max(axis=0)


def gloo_worker(local_batch: int, steps: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from mlperf_bert.runtime.distributed import dist_env_from, init_distributed, shutdown
    from mlperf_bert.input.exchange import TorchCollectives
    from mlperf_bert.input.sources import TokenMeter

    denv = dist_env_from(os.environ)
    init_distributed(denv, torch.device("cpu"))
    comm = TorchCollectives(dist.new_group(backend="gloo"))
    batches = worker_samples(denv.rank, local_batch, steps)
    results = exchange_results(comm, batches, dist.barrier)
    meter = TokenMeter(comm.group)
    meter_times = []
    for _ in range(steps):
        for items in batches[:10]:
            meter.record(items)
        dist.barrier()
        start = time.perf_counter()
        meter.collect()
        meter_times.append(time.perf_counter() - start)
    results["meter (10 steps)"] = meter_times
    shutdown()
    (out / f"gloo_{local_batch}_rank{denv.rank}.json").write_text(json.dumps(results))


def mpi_worker(local_batch: int, steps: int, step_ms: float, out: Path) -> None:
    from mlperf_bert.runtime.distributed import dist_env_from
    from mlperf_bert.input.host_exchange import CpuExchangeSource, mpi_collectives

    denv = dist_env_from(os.environ)
    comm = mpi_collectives(denv)
    batches = worker_samples(denv.rank, local_batch, steps)
    results = exchange_results(comm, batches, comm.comm.Barrier)
    results["cpu_exchange wait"] = cpu_exchange_waits(CpuExchangeSource(_Replay(batches), comm, "greedy"), steps,
                                                      step_ms, comm.comm.Barrier)
    (out / f"mpi_{local_batch}_rank{denv.rank}.json").write_text(json.dumps(results))


class _Replay:
    """An item stream that replays prepared batches (the `ItemStream` protocol)."""

    def __init__(self, batches: list[list[Item]]) -> None:
        self.batches = batches
        self.position = 0

    def next_batch(self) -> list[Item]:
        self.position += 1
        return self.batches[(self.position - 1) % len(self.batches)]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]

    def close(self) -> None:
        pass


def cpu_exchange_waits(source, steps: int, step_ms: float, barrier) -> list[float]:
    """Seconds the trainer waits in next_flat_batch per step when each step computes for step_ms."""
    source.next_flat_batch()  # starts the thread; its first batch is not overlapped with anything
    waits = []
    for _ in range(steps):
        time.sleep(step_ms / 1000)  # the device step, which leaves the host cores to the exchange thread
        start = time.perf_counter()
        source.next_flat_batch()
        waits.append(time.perf_counter() - start)
    source.close()
    barrier()
    return waits


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, local_batch: int, out: Path) -> None:
    """8 gloo processes (torchrun's variables), then mpiexec -n 8."""
    common = ["--local-batch", str(local_batch), "--exchange-steps", str(args.exchange_steps), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(args.ranks), "LOCAL_WORLD_SIZE": str(args.ranks)}
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), "--worker", "gloo", *common],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(args.ranks)]
    if any(p.wait() for p in procs):
        raise SystemExit("a gloo worker failed")
    mpiexec = Path(sys.executable).parent / "mpiexec"
    subprocess.run([str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(args.ranks), sys.executable,
                    str(SCRIPT), "--worker", "mpi", "--step-ms", str(args.step_ms), *common],
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)


def summarize_collectives(out: Path, backend: str, local_batch: int, ranks: int) -> None:
    per_rank = [json.loads((out / f"{backend}_{local_batch}_rank{r}.json").read_text()) for r in range(ranks)]
    for name in per_rank[0]:
        if name.startswith("max tokens"):
            print(f"{backend:<5} B={local_batch:<3} {name:<18} mean {np.mean(per_rank[0][name]):9.1f} tokens")
            continue
        seconds = np.array([rank[name] for rank in per_rank])  # [ranks, steps]
        slowest = seconds.max(axis=0) * 1e3
        print(f"{backend:<5} B={local_batch:<3} {name:<18} slowest rank per step: mean {slowest.mean():7.2f} ms, "
              f"median {np.median(slowest):7.2f} ms, p90 {np.percentile(slowest, 90):7.2f} ms")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local-batch", type=int, nargs="+", default=[16, 56])
    parser.add_argument("--steps", type=int, default=2000, help="steps timed for the assignment alone")
    parser.add_argument("--build-steps", type=int, default=100, help="steps timed with batch building")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--collectives", action="store_true", help="also time the real exchanges (gloo and MPI)")
    parser.add_argument("--ranks", type=int, default=RANKS, help="processes of the real exchanges")
    parser.add_argument("--exchange-steps", type=int, default=60, help="steps timed per real exchange")
    parser.add_argument("--step-ms", type=float, default=55.0, help="simulated device step of the cpu_exchange wait")
    parser.add_argument("--worker", choices=("gloo", "mpi"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker == "gloo":
        gloo_worker(args.local_batch[0], args.exchange_steps, args.out)
        return
    if args.worker == "mpi":
        mpi_worker(args.local_batch[0], args.exchange_steps, args.step_ms, args.out)
        return
    for local_batch in args.local_batch:
        report(local_batch, args.steps, args.build_steps, args.seed)
    if args.collectives:
        with tempfile.TemporaryDirectory() as tmp:
            for local_batch in args.local_batch:
                launch(args, local_batch, Path(tmp))
                for backend in ("gloo", "mpi"):
                    summarize_collectives(Path(tmp), backend, local_batch, args.ranks)


if __name__ == "__main__":
    main()
