"""Process-group setup from torchrun's or SLURM's environment, and small collectives.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT. Under an MPI
launcher (mpiexec of MPICH or Open MPI, needed by `--balance cpu_exchange`) the launcher's own
variables give the same facts (PMI_RANK / PMI_SIZE / MPI_LOCALRANKID / MPI_LOCALNRANKS, or
OMPI_COMM_WORLD_*); under `srun` without either, SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID do.
The launcher's variables win over SLURM's because a process that mpiexec starts inside a SLURM
allocation inherits the batch script's SLURM_PROCID. The rendezvous address comes from
MASTER_ADDR (set by run.sub; set it for a multi-node mpiexec) or the first node of the job.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int(env: Mapping[str, str], *names: str, default: int) -> int:
    for name in names:
        if env.get(name, "") != "":
            try:
                return int(env[name].split("(")[0])  # SLURM_TASKS_PER_NODE may read "8(x2)"
            except ValueError as err:
                raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from err
    return default


# TCP ports the rendezvous store can listen on (0 would pick one the other ranks cannot know).
PORTS = range(1, 65536)

# Rank facts per launcher: MPICH / Intel MPI (hydra), Open MPI, PMIx (srun --mpi=pmix).
MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
MPI_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
MPI_LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK")
MPI_LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")


def launched_by_mpi(env: Mapping[str, str]) -> bool:
    """True when an MPI launcher started this process (so MPI_Init joins the other ranks)."""
    return any(env.get(name, "") != "" for name in MPI_RANK_VARS)


def dist_env_from(env: Mapping[str, str]) -> DistEnv:
    """Reads rank facts from torchrun variables first, then an MPI launcher's, then SLURM's."""
    world = _int(env, "WORLD_SIZE", *MPI_SIZE_VARS, "SLURM_NTASKS", default=1)
    rank = _int(env, "RANK", *MPI_RANK_VARS, "SLURM_PROCID", default=0)
    local_rank = _int(env, "LOCAL_RANK", *MPI_LOCAL_RANK_VARS, "SLURM_LOCALID", default=0)
    local_world = _int(env, "LOCAL_WORLD_SIZE", *MPI_LOCAL_SIZE_VARS, "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                       default=world)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world size {world}; check RANK/WORLD_SIZE, PMI_RANK/PMI_SIZE "
                         "or SLURM_PROCID/SLURM_NTASKS")
    local_world = min(local_world, world)
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} is outside the {local_world} ranks of this node; check "
                         "LOCAL_RANK/LOCAL_WORLD_SIZE, MPI_LOCALRANKID/MPI_LOCALNRANKS or SLURM_LOCALID/"
                         "SLURM_NTASKS_PER_NODE")
    port = _int(env, "MASTER_PORT", default=29500)
    if world > 1 and port not in PORTS:  # one process never opens the rendezvous
        raise ValueError(f"MASTER_PORT={port} is outside 1..65535: give a free TCP port on the first node (29500 is "
                         "usual)")
    addr = env.get("MASTER_ADDR") or env.get("SLURM_LAUNCH_NODE_IPADDR") or "127.0.0.1"
    return DistEnv(rank, world, local_rank, local_world, addr, port)


# PyTorch's CUDA-graph notes: NCCL collectives captured in a graph (DDP inside a graphed step)
# need NCCL's asynchronous error handling off, set before the process group starts.
GRAPH_NCCL_VARIABLE = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def graph_nccl_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The NCCL variables a graphed multi-GPU step needs, or a ValueError naming one set otherwise."""
    value = env.get(GRAPH_NCCL_VARIABLE, "0")
    if value != "0":
        raise ValueError(f"--cuda_graphs on many GPUs captures NCCL all-reduces, which needs {GRAPH_NCCL_VARIABLE}=0; "
                         f"it is set to {value!r}: unset it or set it to 0")
    return {GRAPH_NCCL_VARIABLE: "0"}


def init_distributed(denv: DistEnv, device: torch.device, timeout_s: float = 600.0, cuda_graphs: bool = False) -> None:
    """Starts the default process group (gloo on the CPU, NCCL on GPUs) when world > 1."""
    if not denv.is_distributed or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and cuda_graphs:
        os.environ.update(graph_nccl_settings(os.environ))
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{denv.master_addr}:{denv.master_port}",
        rank=denv.rank,
        world_size=denv.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sums `t` over ranks in place (no-op on a single process)."""
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
