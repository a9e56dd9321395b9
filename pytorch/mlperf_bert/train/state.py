"""The run's progress: every number that changes during a run and that a resume needs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainState:
    """Steps, samples, skipped steps and evals so far; saved in every checkpoint."""

    step: int = 0  # optimizer steps applied (fp16 steps skipped for overflow do not count)
    samples: int = 0  # training sequences consumed over all ranks (the MLPerf epoch_num)
    skipped_steps: int = 0
    evals: list[tuple[int, float]] = field(default_factory=list)  # (samples, accuracy)

    def advance(self, applied: bool, samples: int) -> None:
        """After a step that consumed `samples` sequences (over all ranks), applied or skipped."""
        self.samples += samples
        if applied:
            self.step += 1
        else:
            self.skipped_steps += 1

    def uncount(self, skipped: int) -> None:
        """`skipped` steps counted as applied were skipped on the device (fp16 overflow, found at a read)."""
        if not 0 <= skipped <= self.step:
            raise ValueError(f"cannot uncount {skipped} of {self.step} applied steps")
        self.step -= skipped
        self.skipped_steps += skipped

    def state_dict(self) -> dict:
        return {"step": self.step, "samples": self.samples, "skipped_steps": self.skipped_steps,
                "evals": list(self.evals)}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.samples = int(state["step"]), int(state["samples"])
        self.skipped_steps, self.evals = int(state["skipped_steps"]), [tuple(e) for e in state["evals"]]
