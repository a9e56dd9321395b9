"""Run checkpoints: everything a stopped run needs to continue exactly where it stopped.

(`model/init_checkpoint.py` loads *init* checkpoints, weights only; this module saves and restores runs.)

Files. One `ckpt-<samples, 12 digits>.pt` per checkpoint in the checkpoint folder (inside
--output_dir), named by the training samples consumed, which only grow (optimizer steps do not
count fp16-skipped steps). Rank 0 writes it: torch.save into a temporary file in the same folder,
flush + fsync, os.replace onto the final name, fsync of the folder. A crash at any moment leaves
the previous set of checkpoints or the new one, never a torn file; a leftover temporary file
(`.ckpt-*.tmp`) is never read and is removed by the next write. After each write only the newest
`--keep_checkpoints` stay.

Contents: tensors and plain Python values only, so `torch.load(weights_only=True)` reads it and
a checkpoint cannot run code.
- `model`, `optimizer` (LAMB/Adam moments and per-group step, always in the unsharded layout: a
  sharded optimizer gathers its moments on every rank, so the file does not depend on sharding
  or on the number of ranks that shared the state), `scaler` (fp16 only, else None);
- `train_state`: `TrainState.state_dict()` (steps, samples, skipped steps, evals so far);
- `data`: `BatchSource.state_dict()`: the micro-batch slots of a step (M = ranks x accumulation
  steps, each of b items; input/slots.py) and the stream position (epoch, step) plus the seed
  and total items it depends on. The shard order of an epoch, the shard a slot reads and the
  offset in it are pure functions of (seed, epoch, step) (data/dataset.py), so these integers
  are the whole data position, the same for every rank; a resume with other data, seed, M or b
  is refused (the message says which flags give the saved M and b at this run's rank count).
- `rng`: one entry per rank (index = rank): torch's CPU generator, the CUDA generator of the
  rank's device, numpy's and Python's global generators. Gathered to rank 0 at every checkpoint
  (about 8 KB per rank, 8 MB at 1,024 ranks) so that one file, published by one rename, holds the
  whole run; per-rank files would need a second commit step to be atomic together.
- `fp8`: one entry per rank, gathered with `rng`: the delayed FP8 recipe's amax history of each
  layer (`model.fp8.scaling_states`: each rank's own, from its own micro-batches; empty under any
  other precision or recipe). It is not in `model`, whose keys stay those of every precision;
- `run`: world size, why it was written, the first attempt's run_start time and attempt number;
- `config`: the resolved config of the run that wrote it (a record; resuming does not read it).

Resume: rank 0 picks the file (`auto`: the newest in the folder, or none) and tells the others;
every rank reads it (memory-mapped, so ranks on one node share the pages), loads the model,
optimizer and scaler, and takes its own RNG and FP8 entries. The trainer restores the train state
and the data position. A checkpoint without `fp8` (written before the amax history was kept) or
a rank without an entry starts the delayed recipe's layers without history: their first step
calibrates on its own amax, as a fresh run's does, so that step is equivalent, not equal.

Another number of ranks: everything but `rng` is free of the world size, so a run saved at W
ranks resumes at W' ranks when the slots stay the same (W' x A' = W x A, same micro-batch): every
later step trains on the same samples, and with dropout 0 the weights equal the uninterrupted
run's up to the order of the gradient sums (tests/trainer/input/test_resume_world_size.py). A rank without a
saved RNG entry gets a state derived from the run seed, its rank and the samples consumed
(`derived_rng_seed`), and each rank's generator now draws for other slots than before: dropout
masks differ, so with dropout the steps are equivalent, not equal (and so is the first step of a
delayed-FP8 layer on a rank without a saved amax history).

VERSION 2: the data position counts micro-batch slots; version 1's depended on the rank count
and is refused.
"""

from __future__ import annotations

import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np
import torch
import torch.distributed as dist

from ..model.fp8 import ScalingState, load_scaling_states, scaling_states
from ..model.init_checkpoint import CheckpointError
from ..config.settings import RESUME_AUTO
from ..runtime.distributed import DistEnv
from ..optim.loss_scale import LossScaler
from ..runtime.files import TEMP_MARK, atomic_file
from ..runtime.load_errors import unloadable_reason

FORMAT = "mlperf_bert.run_checkpoint"
VERSION = 2
NAME = re.compile(r"ckpt-(\d{12,})\.pt")
REQUIRED_KEYS = ("model", "optimizer", "scaler", "train_state", "data", "rng", "run")


class ResumeError(CheckpointError):
    """A run checkpoint that cannot be resumed from; the message names the file and the fix."""


@dataclass
class TrainingParts:
    """The objects whose state a checkpoint holds, besides the train state and data position."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: LossScaler | None = None


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's generators as tensors and plain values (weights_only can read them)."""
    np_state = cast(tuple[Any, ...], np.random.get_state())  # the legacy form: a tuple
    py_state = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]), "numpy_has_gauss": int(np_state[3]), "numpy_gauss": float(np_state[4]),
        "python_version": int(py_state[0]), "python_state": torch.tensor(py_state[1], dtype=torch.int64),
        "python_gauss": py_state[2],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, state["numpy_pos"], state["numpy_has_gauss"], state["numpy_gauss"]))
    random.setstate((state["python_version"], tuple(state["python_state"].tolist()), state["python_gauss"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def host_scaling_states(model: torch.nn.Module) -> dict[str, ScalingState]:
    """`scaling_states` with the amax history on the host: gathered as objects and loaded on any device."""
    return {name: {key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
            for name, state in scaling_states(model).items()}


def gather_to_main(obj: Any, denv: DistEnv) -> list[Any] | None:
    """Every rank's `obj` on rank 0 (index = rank), None elsewhere. Collective."""
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * denv.world_size if denv.is_main else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def checkpoint_path(directory: Path, samples: int) -> Path:
    return directory / f"ckpt-{samples:012d}.pt"


def list_checkpoints(directory: Path) -> list[Path]:
    """Finished checkpoints of a folder, oldest first (temporary files are not listed)."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := NAME.fullmatch(p.name)) and p.is_file()]
    return [p for _, p in sorted(found)]


def write_atomic(payload: dict[str, Any], path: Path) -> None:
    """torch.save through `atomic_file`: fsync of the file, rename, fsync of the folder."""
    # The earlier checkpoints stay if this fails: pruning comes after a good write.
    with atomic_file(path, "wb", fsync_file=True, fsync_dir_after=True) as f:
        _save(payload, cast(BinaryIO, f))


class _Writer:
    """The file as torch.save sees it; keeps the OSError that torch's writer turns into a RuntimeError."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.f.flush()


def _save(payload: dict[str, Any], f: BinaryIO) -> None:
    writer = _Writer(f)
    try:
        torch.save(payload, cast(BinaryIO, writer))  # a file-like object: write and flush
    except RuntimeError:
        if writer.error is None:
            raise
        raise writer.error from None


def _remove_stale_temporaries(directory: Path) -> None:
    """Temporary files of writes that crashed (a folder that does not exist yet has none)."""
    for leftover in directory.glob(f".ckpt-*{TEMP_MARK}*"):
        leftover.unlink(missing_ok=True)


class Checkpointer:
    """When to write run checkpoints, and writing them (every rank calls `save` together).

    every_samples: write after the step that reaches or passes each multiple of it.
    every_minutes: rank 0's clock since the last checkpoint; `time_due` is rank 0's opinion,
    which `faults.StepGuard` makes every rank's at the same step.
    """

    def __init__(self, directory: Path, keep: int, denv: DistEnv, device: torch.device, *,
                 every_samples: int | None = None, every_minutes: float | None = None,
                 record: dict[str, Any] | None = None) -> None:
        self.directory, self.keep, self.denv, self.device = directory, keep, denv, device
        self.every_samples, self.every_minutes = every_samples, every_minutes
        self.record = dict(record or {})  # run facts saved with every checkpoint (run_start_ms, attempt)
        self.last_saved: dict | None = None  # the train state of the newest checkpoint written
        self._last_time = time.monotonic()

    def samples_due(self, before: int, after: int) -> bool:
        """Whether a step that took the sample count from `before` to `after` crossed a multiple."""
        n = self.every_samples
        return n is not None and after // n > before // n

    def time_due(self) -> bool:
        minutes = self.every_minutes
        return minutes is not None and self.denv.is_main and time.monotonic() - self._last_time >= 60 * minutes

    def is_saved(self, train_state: dict) -> bool:
        """Whether the newest checkpoint already holds this state (no second write at one step)."""
        return self.last_saved == train_state

    def save(self, parts: TrainingParts, train_state: dict, data_state: dict, reason: str,
             config: dict | None = None) -> Path:
        """Collective: gathers every rank's RNG states and FP8 amax history; rank 0 writes and prunes. Returns
        the path."""
        path = checkpoint_path(self.directory, int(train_state["samples"]))
        # Each rank's own generators and FP8 amax history (its own micro-batches'), in one gather.
        ranks = gather_to_main((rng_state(self.device), host_scaling_states(parts.model)), self.denv)
        # On every rank: a sharded optimizer gathers its whole state with a collective.
        optimizer_state = parts.optimizer.state_dict()
        if self.denv.is_main:
            assert ranks is not None  # rank 0 gathers
            payload = {
                "format": FORMAT, "version": VERSION,
                "model": parts.model.state_dict(), "optimizer": optimizer_state,
                "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
                "train_state": train_state, "data": data_state,
                "rng": [rng for rng, _ in ranks], "fp8": [fp8 for _, fp8 in ranks],
                "run": {**self.record, "world_size": self.denv.world_size, "reason": reason},
                "config": config or {},
            }
            _remove_stale_temporaries(self.directory)
            write_atomic(payload, path)
            self.prune()
        if dist.is_initialized():
            # Nobody leaves before the file is complete: a launcher kills the job when any rank
            # exits, and a preempted rank exits right after its checkpoint.
            dist.barrier()
        self.last_saved = dict(train_state)
        self._last_time = time.monotonic()
        return path

    def prune(self) -> None:
        for old in list_checkpoints(self.directory)[: -self.keep]:
            old.unlink(missing_ok=True)


def choose_resume(spec: str | None, directory: Path, denv: DistEnv) -> Path | None:
    """The checkpoint to resume from: rank 0 decides (`auto` may find none), every rank agrees."""
    choice = None
    if denv.is_main and spec is not None:
        found = list_checkpoints(directory) if spec == RESUME_AUTO else [Path(spec)]
        choice = str(found[-1]) if found else None
    if dist.is_initialized():
        box = [choice]
        dist.broadcast_object_list(box, src=0)
        choice = box[0]
    return Path(choice) if choice is not None else None


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Loads a run checkpoint safely (weights_only) and checks it is one."""
    if not path.is_file():
        raise ResumeError(f"{path}: checkpoint not found on this rank; the checkpoint folder must be on a file "
                          "system every node sees")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch raises many types for corrupt or unsafe files
        raise ResumeError(f"{path}: cannot read the checkpoint: {unloadable_reason(path, err)}; resume from an "
                          "older one (pass its path to --resume_from_checkpoint)") from err
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ResumeError(f"{path}: not a run checkpoint of this trainer (an init checkpoint goes to "
                          "--init_checkpoint)")
    if ckpt.get("version") == 1:
        raise ResumeError(f"{path}: checkpoint version 1, written by an older trainer whose data position depends "
                          "on the number of ranks; resume it with that trainer, or start a fresh run")
    if ckpt.get("version") != VERSION or any(k not in ckpt for k in REQUIRED_KEYS):
        raise ResumeError(f"{path}: checkpoint version {ckpt.get('version')} or its keys do not match this "
                          f"trainer (version {VERSION}); resume with the trainer that wrote it")
    return ckpt


def first_detail(err: BaseException) -> str:
    """torch's multi-line load_state_dict error as one clause: its first detail and how many follow."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if len(lines) <= 2:
        return " ".join(lines)
    return f"{lines[1].rstrip('.')} and {len(lines) - 2} more mismatches"


def restore(parts: TrainingParts, ckpt: dict[str, Any], path: Path, denv: DistEnv, device: torch.device,
            seed: int) -> None:
    """Loads model, optimizer, scaler, this rank's generators and FP8 amax history (train state and data:
    the caller).

    Any number of ranks: a rank the checkpoint has no RNG entry for (more ranks than the run that
    wrote it) seeds its generators from `derived_rng_seed(seed, rank, samples)`; without an FP8 entry
    its delayed-FP8 layers calibrate again.
    """
    try:
        parts.model.load_state_dict(ckpt["model"], strict=True)
        parts.optimizer.load_state_dict(ckpt["optimizer"])
    except (RuntimeError, KeyError, ValueError) as err:
        raise ResumeError(f"{path}: does not fit this model or optimizer ({first_detail(err)}); resume with the "
                          "same --bert_config_path and --optimizer") from err
    if parts.scaler is not None and ckpt["scaler"]:
        parts.scaler.load_state_dict(ckpt["scaler"])
    fp8 = ckpt.get("fp8") or []
    load_scaling_states(parts.model, fp8[denv.rank] if denv.rank < len(fp8) else None)
    if denv.rank < len(ckpt["rng"]):
        set_rng_state(ckpt["rng"][denv.rank], device)
    else:
        seed_generators(derived_rng_seed(seed, denv.rank, int(ckpt["train_state"]["samples"])))


def derived_rng_seed(seed: int, rank: int, samples: int) -> int:
    """A 64-bit seed for a rank the checkpoint has no RNG state of: the same at every resume of that
    checkpoint, different for each rank and each point of the run."""
    return int(np.random.SeedSequence([seed, rank, samples]).generate_state(1, np.uint64)[0])


def seed_generators(seed: int) -> None:
    """torch (CPU and every CUDA device), numpy's and Python's global generators from one seed."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
