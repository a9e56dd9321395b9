"""`--balance cpu_exchange` (Baidu): the balancing exchange done with MPI on the host, ahead of time.

A background thread reads the rank's next micro-batch, exchanges it over MPI_COMM_WORLD
(`exchange.exchange`: all-gather of the headers, deal, all-to-all of the samples) and builds
its flat batch (token stream, cu_seqlens, masked positions; pinned when training on a GPU),
so `next_batch` / `next_flat_batch` receive ready work and the exchange is off the trainer's
critical path. The thread runs up to two micro-batches ahead (one waiting in the queue, one
waiting to be queued).

MPI and threads: mpi4py calls MPI_Init_thread when it is imported (on the main thread); after
that every MPI call comes from the one background thread, and MPI_Finalize (mpi4py's exit
hook) comes after that thread has ended, so MPI_THREAD_SERIALIZED suffices (MPICH and Open MPI
provide MULTIPLE). MPI and torch.distributed share the job: torch.distributed (the trainer's
DDP and the imbalance meter) uses its own TCP rendezvous from the launcher's rank variables
(`distributed.dist_env_from` reads PMI_RANK / PMI_SIZE), MPI only carries the exchange.

Shutdown: the thread never stops between collectives; it checks for `close()` only while
waiting to queue a finished batch. Every rank's thread therefore runs the same number of
exchanges (the trainers consume the same number of batches), and no rank is left waiting
in a collective that another rank has abandoned.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Generic, TypeVar

import numpy as np

from .batch import FlatBatch, Item, flatten_items
from .distributed import DistEnv
from .exchange import Collectives, exchange
from .sources import ItemStream, LocalSource, TokenMeter

if TYPE_CHECKING:
    from mpi4py import MPI

T = TypeVar("T")
_POLL_S = 0.1  # how often a thread waiting to queue a batch checks for close()


class MpiCollectives:
    """`Collectives` over an mpi4py communicator (int32 numpy buffers)."""

    def __init__(self, comm: "MPI.Comm") -> None:
        from mpi4py import MPI

        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._int32 = MPI.INT32_T

    def all_gather(self, local: np.ndarray) -> np.ndarray:
        mine = np.ascontiguousarray(local, dtype=np.int32)
        out = np.empty((self.size, *mine.shape), dtype=np.int32)
        self.comm.Allgather(mine, out)
        return out

    def all_to_all(self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray) -> np.ndarray:
        out = np.empty(int(recv_counts.sum()), dtype=np.int32)
        self.comm.Alltoallv([np.ascontiguousarray(send, dtype=np.int32), (send_counts, _displacements(send_counts)),
                             self._int32], [out, (recv_counts, _displacements(recv_counts)), self._int32])
        return out


def _displacements(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


def mpi_collectives(denv: DistEnv) -> MpiCollectives:
    """MPI_COMM_WORLD, after checking the thread level and that MPI agrees with the rank variables."""
    from mpi4py import MPI  # initializes MPI (thread level MULTIPLE requested by mpi4py's default)

    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        raise RuntimeError("--balance cpu_exchange calls MPI from a background thread: the MPI library must "
                           "provide MPI_THREAD_SERIALIZED or MULTIPLE (MPICH and Open MPI do)")
    comm = MPI.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (denv.rank, denv.world_size):
        raise RuntimeError(
            f"MPI sees rank {comm.Get_rank()} of {comm.Get_size()}, the launcher's variables say {denv.rank} of "
            f"{denv.world_size}: start every rank with mpiexec (one process per GPU), without torchrun"
        )
    return MpiCollectives(comm)


@dataclass
class _Failure:
    error: BaseException


class Prefetcher(Generic[T]):
    """Calls `produce` on one background thread and hands its results to `get` in order.

    At most `depth` results wait in the queue (plus one waiting to be queued). An exception in
    `produce` ends the thread and is raised by the `get` that would have returned its result.
    """

    def __init__(self, produce: Callable[[], T], depth: int = 1, name: str = "prefetch") -> None:
        self._produce = produce
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                result: T | _Failure = self._produce()
            except BaseException as err:  # handed to the consumer, which raises it
                result = _Failure(err)
            if not self._put(result) or isinstance(result, _Failure):
                return

    def _put(self, result: object) -> bool:
        """Queues `result`; False when close() was called while waiting."""
        while not self._stop.is_set():
            try:
                self._queue.put(result, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def get(self) -> T:
        result = self._queue.get()
        if isinstance(result, _Failure):
            raise RuntimeError(f"the {self._thread.name} thread failed: {result.error}") from result.error
        return result

    def close(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)


@dataclass(frozen=True)
class _Prepared:
    items: list[Item]
    flat: FlatBatch
    state: dict  # the stream's position after this micro-batch


class CpuExchangeSource(LocalSource):
    """The `BatchSource` of --balance cpu_exchange (module docstring).

    The thread starts with the first batch; `load_state_dict` must come before it. `state_dict`
    is the position after the last batch handed out, not the thread's read-ahead position.
    """

    def __init__(self, dataset: ItemStream, comm: Collectives, order: str, meter: TokenMeter | None = None,
                 pin: bool = False) -> None:
        super().__init__(dataset, meter)
        self.comm = comm
        self.order = order
        self.pin = pin
        self._state = dataset.state_dict()
        self._prefetch: Prefetcher[_Prepared] | None = None

    def _prepare(self) -> _Prepared:
        """Background thread: read, exchange, flatten."""
        items = exchange(self.dataset.next_batch(), self.comm, self.order).items
        flat = flatten_items(items)
        return _Prepared(items, flat.pin_memory() if self.pin else flat, self.dataset.state_dict())

    def _next(self) -> _Prepared:
        if self._prefetch is None:
            self._prefetch = Prefetcher(self._prepare, name="cpu-exchange")
        prepared = self._prefetch.get()
        self._state = prepared.state
        self.meter.record(prepared.items)
        return prepared

    def next_batch(self) -> list[Item]:
        return self._next().items

    def next_flat_batch(self) -> FlatBatch:
        return self._next().flat

    def state_dict(self) -> dict:
        return self._state

    def load_state_dict(self, state: dict) -> None:
        if self._prefetch is not None:
            raise RuntimeError("load the data position before the first batch: the exchange thread has started")
        self.dataset.load_state_dict(state)
        self._state = self.dataset.state_dict()

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.close()
        self.dataset.close()
