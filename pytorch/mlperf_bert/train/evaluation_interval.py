"""When to evaluate: the MLPerf BERT eval-interval rule and the resulting eval points.

Rule (MLPerf Training, BERT): evaluate every
    floor_to_multiple(0.05 * (230.23 * global_batch_size + 3_000_000), 25_000)
training samples (`config/closed_division.eval_interval_samples`, beside the other rules). An eval is due at the first step whose cumulative sample count reaches a
point `start + k * interval` (k = 0, 1, ...), as NVIDIA's trainer does with
`ceil(point / samples_per_step)`; a point at 0 samples is never due, because no step ends
there (the rules allow skipping the eval at 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ..config.closed_division import eval_interval_samples


@dataclass(frozen=True)
class EvalSchedule:
    """Eval points `start_samples + k * interval_samples` below `stop_samples` (if set).

    Corresponds to NVIDIA's flags eval_iter_start_samples / eval_iter_samples and their
    max_samples_termination bound.
    """

    interval_samples: int
    start_samples: int
    stop_samples: int | None = None

    def __post_init__(self) -> None:
        if self.interval_samples <= 0:
            raise ValueError(f"eval_iter_samples must be > 0, got {self.interval_samples}")
        if self.start_samples < 0:
            raise ValueError(f"eval_iter_start_samples must be >= 0, got {self.start_samples}")
        if self.stop_samples is not None and self.stop_samples <= 0:
            raise ValueError(f"max_samples_termination must be > 0, got {self.stop_samples}")

    @classmethod
    def for_batch_size(cls, global_batch_size: int, start_samples: int | None = None,
                       interval_samples: int | None = None, stop_samples: int | None = None) -> "EvalSchedule":
        """The rule's interval for `global_batch_size`, unless overridden; start defaults to it."""
        interval = eval_interval_samples(global_batch_size) if interval_samples is None else interval_samples
        start = interval if start_samples is None else start_samples
        return cls(interval_samples=interval, start_samples=start, stop_samples=stop_samples)

    def next_point(self, samples: int) -> int | None:
        """The first eval point strictly after `samples`, or None when there is none."""
        if samples < self.start_samples:
            point = self.start_samples
        else:
            point = self.start_samples + ((samples - self.start_samples) // self.interval_samples + 1) * self.interval_samples
        if self.stop_samples is not None and point >= self.stop_samples:
            return None
        return point

    def due(self, samples_before: int, samples_after: int) -> bool:
        """True when a step that took the count from samples_before to samples_after reached a point."""
        if samples_after < samples_before:
            raise ValueError(f"samples went backwards: {samples_before} -> {samples_after}")
        point = self.next_point(samples_before)
        return point is not None and point <= samples_after

    def points(self, up_to: int) -> Iterator[int]:
        """Eval points in (0, up_to], in order."""
        point = self.next_point(0)
        while point is not None and point <= up_to:
            yield point
            point = self.next_point(point)
