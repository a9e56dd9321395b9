"""Start-up checks: what a config needs from this machine, checked before anything runs.

`TrainConfig` validates itself from its values alone, so a `resolved_config.json` rebuilds into
the same config anywhere. What depends on the file system, the environment or the device is
checked here, once, by `check_environment` (called from `mlperf_bert.main` before the process
group starts and before anything is written). Each failure is a `ConfigError` naming the flag,
file or key and the fix.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Mapping

import torch

from .config.settings import RESUME_AUTO, ConfigError, TrainConfig
from .runtime.distributed import launched_by_mpi
from .model.bert import BertConfig
from .model.fp8 import fp8_unavailable
from .data.stratified import STRATA_FILE

GIB = 2**30


def check_environment(cfg: TrainConfig, environ: Mapping[str, str], device: torch.device) -> None:
    """Every machine-dependent check of `cfg`; raises ConfigError naming what to fix."""
    _require(not cfg.run.cuda_graphs or device.type == "cuda",
             f"--cuda_graphs needs a GPU; --device {cfg.run.device} runs this on {device.type}: drop --cuda_graphs "
             "or run on a GPU")
    if cfg.run.precision == "fp8":
        problem = fp8_unavailable(device)
        _require(problem is None, str(problem))
    _check_output_paths(cfg)
    _check_resume_file(cfg.checkpoint.resume_from)
    if cfg.data.balance == "local_presort":
        _check_stratified_input(cfg.data.input_dir)
    if cfg.data.balance == "cpu_exchange":
        _check_mpi_launch(environ)
    _check_model_fits(cfg, BertConfig.from_json(cfg.model.bert_config_path), memory_bytes(device))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _inside(path: Path, root: Path) -> bool:
    """Whether `path` stays under `root` once `..` and symlinks are resolved (both may not exist yet)."""
    return Path(os.path.realpath(path)).is_relative_to(Path(os.path.realpath(root)))


def _check_output_paths(cfg: TrainConfig) -> None:
    """Everything the run writes by its own choice stays inside --output_dir.

    The one exception is an explicit --mlperf_log_file: the launcher's deliberate choice of where
    the log is collected (run_and_time.sh puts it next to OUTPUT_DIR, as the MLPerf layout wants).
    """
    out, checkpoints = Path(cfg.run.output_dir), cfg.checkpoint_dir
    _require(not os.path.lexists(out) or os.path.isdir(out),
             f"--output_dir {out} exists and is not a directory; pick another")
    _require(_inside(checkpoints, out),
             f"--checkpoint_dir {checkpoints} resolves to {os.path.realpath(checkpoints)}, outside "
             f"--output_dir {out}: give a folder inside it (the default is {out / 'checkpoints'})")
    for name in ("mlperf.log", "resolved_config.json"):
        _require(_inside(out / name, out), f"{out / name} is a symlink that leads outside --output_dir; remove it")
    log = cfg.run.mlperf_log_path
    _require(not os.path.isdir(log), f"--mlperf_log_file {log} is a directory; give a file path")


def _check_resume_file(resume_from: str | None) -> None:
    _require(resume_from in (None, RESUME_AUTO) or os.path.isfile(resume_from),
             f"--resume_from_checkpoint {resume_from}: no such file; give a checkpoint file written by a "
             f"training run, or '{RESUME_AUTO}' for the newest one in --checkpoint_dir")


def _check_stratified_input(input_dir: str | None) -> None:
    """local_presort needs stratified batches, which only a stratified dataset folder gives."""
    _require(
        not input_dir or not Path(input_dir).is_dir() or (Path(input_dir) / STRATA_FILE).is_file(),
        f"--balance local_presort reads stratified local batches, but --input_dir {input_dir} has no "
        f"{STRATA_FILE}: make the stratified shards with `data_prep/prepare.py stratify --input {input_dir} "
        "--out DIR` and pass --input_dir DIR, or use --balance global_presort",
    )


def _check_mpi_launch(environ: Mapping[str, str]) -> None:
    """cpu_exchange talks MPI between the ranks: mpi4py must import and an MPI launcher must start them."""
    _require(
        importlib.util.find_spec("mpi4py") is not None,
        "--balance cpu_exchange exchanges samples with MPI, but mpi4py is not installed: "
        "pip install mpi4py mpich (or use --balance global_presort)",
    )
    _require(
        launched_by_mpi(environ),
        "--balance cpu_exchange needs ranks started by an MPI launcher (mpiexec -n N ..., or srun --mpi=pmix), "
        "not torchrun: start them with mpiexec, or use --balance global_presort",
    )


def memory_bytes(device: torch.device) -> int:
    """What one rank can hold: the GPU's memory, or the host's physical memory on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_model_fits(cfg: TrainConfig, bert: BertConfig, available: int) -> None:
    """Sequence length against the position table; weights + optimizer state against the memory."""
    path = cfg.model.bert_config_path
    _require(cfg.data.max_seq_length <= bert.max_position_embeddings,
             f"--max_seq_length {cfg.data.max_seq_length} exceeds max_position_embeddings "
             f"{bert.max_position_embeddings} of {path}: lower --max_seq_length or raise max_position_embeddings")
    _require(bert.training_bytes <= available,
             f"{path}: the model has {bert.parameter_count:,} parameters; fp32 weights, gradients and the "
             f"optimizer's two moments take {bert.training_bytes / GIB:,.1f} GiB, more than the "
             f"{available / GIB:,.1f} GiB this rank has: check vocab_size, hidden_size, num_hidden_layers "
             "and intermediate_size")
