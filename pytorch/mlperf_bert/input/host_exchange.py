"""`--balance cpu_exchange` (Baidu): the balancing exchange done with MPI on the host, ahead of time.

A background thread reads the rank's next micro-batch, exchanges it over MPI_COMM_WORLD
(`exchange.exchange`: all-gather of the headers, deal, all-to-all of the samples) and builds
its flat batch (token stream, cu_seqlens, masked positions; pinned when training on a GPU),
so `next_batch` / `next_flat_batch` receive ready work and the exchange is off the trainer's
critical path. The thread works up to two micro-batches ahead of the trainer.

MPI and threads: mpi4py calls MPI_Init_thread when it is imported (on the main thread); after
that every MPI call comes from the one background thread, except MPI_Abort after that thread
failed and MPI_Finalize (mpi4py's exit hook) after it ended, so MPI_THREAD_SERIALIZED suffices
(MPICH and Open MPI provide MULTIPLE). MPI and torch.distributed share the job:
torch.distributed (the trainer's DDP and the imbalance meter) meets over its own TCP
rendezvous, from the launcher's rank variables (`distributed.dist_env_from` reads PMI_RANK /
PMI_SIZE); MPI only carries the exchange.

Shutdown: how many exchanges a thread runs depends only on how many batches the trainer
took (`Prefetcher`), so every rank's thread runs the same collectives and none is left
waiting in one that another rank abandoned. A rank whose thread fails aborts the MPI job,
since the others would wait for it forever.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Generic, TypeVar

import numpy as np

from ..data.batch import FlatBatch, Item, flatten_items
from ..runtime.distributed import DistEnv
from .exchange import exchange
from .sources import ItemStream, LocalSource, TokenMeter

if TYPE_CHECKING:
    from mpi4py import MPI

T = TypeVar("T")


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


    def abort(self, code: int = 1) -> None:
        self.comm.Abort(code)


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
    """Calls `produce` on one background thread, at most `ahead` results ahead of `get`.

    Result j (1, 2, ...) is produced once j <= consumed + ahead, consumed = results taken by
    `get` so far. `close` lets the thread finish every result it may produce at that moment
    and no other, so the number of `produce` calls is a function of the number of `get` calls
    alone, never of thread timing: ranks that consumed the same number of results run the
    same collectives. An exception in `produce` ends the thread; the `get` that would have
    returned that result raises it.
    """

    def __init__(self, produce: Callable[[], T], ahead: int = 2, name: str = "prefetch") -> None:
        if ahead < 1:
            raise ValueError(f"ahead must be >= 1, got {ahead}")
        self._produce = produce
        self.ahead = ahead
        self._ready: deque[T | _Failure] = deque()
        self._produced = self._consumed = 0
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _may_produce(self) -> bool:
        return self._produced < self._consumed + self.ahead

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._may_produce() or self._closing)
                if not self._may_produce():
                    return
            try:
                result: T | _Failure = self._produce()
            except BaseException as err:  # handed to the consumer, which raises it
                result = _Failure(err)
            with self._cond:
                self._ready.append(result)
                self._produced += 1
                self._cond.notify_all()
            if isinstance(result, _Failure):
                return

    def get(self) -> T:
        with self._cond:
            self._cond.wait_for(lambda: bool(self._ready))
            result = self._ready.popleft()
            self._consumed += 1
            self._cond.notify_all()
        if isinstance(result, _Failure):
            raise RuntimeError(f"the {self._thread.name} thread failed: {result.error}") from result.error
        return result

    def close(self, timeout_s: float = 60.0) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
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

    def __init__(self, dataset: ItemStream, comm: MpiCollectives, order: str, meter: TokenMeter | None = None,
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
        try:
            prepared = self._prefetch.get()
        except RuntimeError:
            # The other ranks' threads wait in a collective this rank will never join: end the job.
            traceback.print_exc()
            sys.stderr.flush()
            self.comm.abort()
            raise
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
