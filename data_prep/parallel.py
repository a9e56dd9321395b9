"""A process pool for independent jobs whose results the parent records (manifests, progress)."""

from __future__ import annotations

import multiprocessing
from typing import Callable, Iterator, Sequence, TypeVar

Job = TypeVar("Job")
Result = TypeVar("Result")


def run_jobs(fn: Callable[[Job], Result], jobs: Sequence[Job], workers: int,
             initializer: Callable[[], None] | None = None) -> Iterator[Result]:
    """fn(job) for every job, in completion order; in this process when one worker suffices.

    Workers are spawned, not forked: a fork would copy the parent's thread pools (the Rust
    tokenizer's, OpenMP's) in whatever state they are. `initializer` runs in each worker,
    never in this process.
    """
    if workers <= 1 or len(jobs) <= 1:
        yield from map(fn, jobs)
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(min(workers, len(jobs)), initializer=initializer) as pool:
        yield from pool.imap_unordered(fn, jobs)
