"""Start-up checks: what a config needs from this machine, checked before anything runs.

`TrainConfig` validates itself from its values alone, so a `resolved_config.json` rebuilds into
the same config anywhere. What depends on the file system, the environment or the device is
checked here, once, by `check_environment` (called from `mlperf_bert.main` before the process
group starts and before anything is written). Each failure is a `ConfigError` naming the flag,
file or key and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Mapping

import torch

from .config.settings import RESUME_AUTO, ConfigError, TrainConfig
from .runtime.distributed import DistEnv, launched_by_mpi
from .runtime.optional import dependency_problem
from .input.dali_input import dali_problem
from .hooks.report import curves_problem
from .model.attention import AttentionNeeds, backend_problem
from .model.bert import BertConfig
from .model.compiling import compile_problem
from .model.fp8 import fp8_unavailable
from .model.init_checkpoint import check_init_checkpoint
from .model.precision import precision_problem
from .optim.optimizers import apex_problem
from .data.stratified import STRATA_FILE

GIB = 2**30


def check_device_request(requested: str, denv: DistEnv) -> None:
    """--device against the GPUs this node shows, before a device is picked: `cuda` needs one, and the
    node's ranks need a GPU each (two ranks on one GPU is a duplicate NCCL refuses mid-start). A
    launcher that hands each rank its own GPU (CUDA_VISIBLE_DEVICES per rank) shows each one GPU."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    build = "a CPU-only build of" if torch.version.cuda is None else "a CUDA build of"
    _require(requested != "cuda" or visible > 0,
             f"--device cuda, but no CUDA device is visible here ({build} torch {torch.__version__}): use --device "
             "cpu or auto, or run on a GPU node")
    uses_gpu = requested == "cuda" or (requested == "auto" and visible > 0)
    _require(not uses_gpu or visible <= 1 or denv.local_world_size <= visible,
             f"{denv.local_world_size} ranks on this node, but it shows {visible} GPUs: start at most {visible} "
             "(DGXNGPU, torchrun's --nproc_per_node), one rank per GPU")


def check_environment(cfg: TrainConfig, environ: Mapping[str, str], device: torch.device) -> None:
    """Every machine-dependent check of `cfg`; raises ConfigError naming what to fix."""
    _require(not cfg.run.cuda_graphs or device.type == "cuda",
             f"--cuda_graphs needs a GPU; --device {cfg.run.device} runs this on {device.type}: drop --cuda_graphs "
             "or run on a GPU")
    bert = BertConfig.from_json(cfg.model.bert_config_path)
    for problem in device_problems(cfg, bert, device):
        _require(problem is None, str(problem))
    _check_output_paths(cfg)
    if cfg.run.curves == "png":  # drawn after run_stop: a missing matplotlib would end the run without a summary
        problem = curves_problem()
        _require(problem is None, str(problem))
    _check_resume_file(cfg.checkpoint.resume_from)
    if cfg.data.balance == "local_presort":
        _check_stratified_input(cfg.data.input_dir)
    if cfg.data.balance == "cpu_exchange":
        _check_mpi_launch(environ)
    _check_model_fits(cfg, bert, memory_bytes(device))
    if cfg.model.init_checkpoint:
        check_init_checkpoint(cfg.model.init_checkpoint, bert)


def device_problems(cfg: TrainConfig, bert: BertConfig, device: torch.device) -> Iterator[str | None]:
    """What this device and its software cannot serve of `cfg`, each a line naming the flag and the fix
    (None where it can); lazily, so the first problem stops the checks. Every choice with a limit:
    --precision (bf16 and fp8 tensor cores; torchao), --attention_backend (the varlen kernels'
    device, precision, head size, dropout; flash-attn), --optimizer_impl (apex: CUDA only),
    --compile_mode (Triton on a GPU, a C++ compiler on the CPU) and --input_pipeline dali (DALI).
    An optional package that is installed but broken is refused by name wherever the run would
    use it."""
    yield precision_problem(cfg.run.precision, device)
    if cfg.run.precision == "fp8":
        yield fp8_unavailable(device, cfg.run.fp8_recipe or "tensorwise")
    needs = AttentionNeeds(device, cfg.run.precision, bert.head_dim, bert.attention_probs_dropout_prob)
    yield backend_problem(cfg.model.attention_backend, needs)
    yield apex_problem(cfg.optim.implementation, device.type == "cuda", cfg.device_steps)
    yield compile_problem(cfg.run.compile_mode, device)
    if cfg.run.input_pipeline == "dali":
        yield dali_problem()


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
    """cpu_exchange talks MPI between the ranks: mpi4py must be installed, an MPI launcher must start
    them, and MPI must start (importing `mpi4py.MPI` initialises it: only once the launcher is known)."""
    def mpi4py_problem(module: str) -> str | None:
        return dependency_problem(module, "mpi4py", "--balance cpu_exchange", "pip install mpi4py mpich",
                                  "use --balance global_presort")

    _require(mpi4py_problem("mpi4py") is None, str(mpi4py_problem("mpi4py")))
    _require(
        launched_by_mpi(environ),
        "--balance cpu_exchange needs ranks started by an MPI launcher (mpiexec -n N ..., or srun --mpi=pmix), "
        "not torchrun: start them with mpiexec, or use --balance global_presort",
    )
    _require(mpi4py_problem("mpi4py.MPI") is None, str(mpi4py_problem("mpi4py.MPI")))


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
