"""The typed config tree of a training run.

Each component owns one frozen dataclass; `TrainConfig` joins them and rejects bad
combinations when it is built, with a message that names the flag and the fix. Nothing
mutates a config afterwards: derived numbers are properties. The resolved config is
written next to the logs (`TrainConfig.to_dict`).
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

INPUT_LAYOUTS = ("padded", "unpadded", "packed")
OPTIMIZERS = ("lamb", "adam")
OPTIMIZER_IMPLS = ("auto", "reference", "foreach", "apex")
PRECISIONS = ("fp32", "bf16", "fp16")
COMPILE_MODES = ("none", "default", "max-autotune-no-cudagraphs")  # torch.compile modes without its own graphs
INPUT_PIPELINES = ("torch", "dali")
DEVICES = ("auto", "cpu", "cuda")
DIVISIONS = ("closed", "open")
SUBMISSION_STATUSES = ("onprem", "cloud", "preview", "research")
CLIP_MODES = ("none", "after_allreduce", "before_allreduce", "bucketwise")
BALANCE_POLICIES = ("none", "global_presort", "local_presort", "cpu_exchange")
BALANCE_DEALS = ("auto", "raster", "snake", "greedy")
RESUME_AUTO = "auto"
MAX_SEQ_LENGTH_LIMIT = 8192  # tokens; BERT uses 512, anything beyond this is a typo
MAX_STEPS_LIMIT = 10**9  # optimizer steps; keeps sample counts far inside int64
# The deal each policy was published with: NVIDIA's global presort and Baidu's CPU exchange
# deal sample i of the sorted step to rank i mod W (raster), Samsung's local presort snakes.
DEFAULT_DEALS = {"global_presort": "raster", "local_presort": "snake", "cpu_exchange": "raster"}


class ConfigError(ValueError):
    """A flag or config variable with a bad value; the message says how to fix it."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, f"--{name} must be one of {', '.join(allowed)}; got {value!r}")


def _is_real(value: object) -> bool:
    """An int or a finite float (bool is not a number here; ints are finite however large)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or math.isfinite(value)


def _positive(name: str, value: float) -> None:
    _require(_is_real(value) and value > 0, f"--{name} must be a positive number; got {value!r}")


def _real(name: str, value: float, low: float, high: float, *, open_high: bool = False) -> None:
    """A finite number in [low, high] (or [low, high) with open_high)."""
    ok = _is_real(value) and low <= value and (value < high if open_high else value <= high)
    _require(ok, f"--{name} must be a number in [{low}, {high}{')' if open_high else ']'}; got {value!r}")


def _count(name: str, value: int, low: int = 1, high: int | None = None) -> None:
    """An integer in [low, high] (high None: no upper bound)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)
    bound = f">= {low}" if high is None else f"in [{low}, {high}]"
    _require(ok, f"--{name} must be an integer {bound}; got {value!r}")


def _text(name: str, value: str | None, *, required: bool = True, hint: str = "") -> None:
    """A non-empty string without NUL characters (None allowed when not required)."""
    if value is None and not required:
        return
    ok = isinstance(value, str) and value != "" and "\0" not in value
    _require(ok, f"--{name} must be a non-empty string{hint}; got {value!r}")


def _path(name: str, value: str | None, *, required: bool = True, hint: str = "") -> None:
    """A path the file system can take: names of at most 255 bytes, at most 4096 bytes in all."""
    _text(name, value, required=required, hint=hint)
    if value is None:
        return
    try:
        raw = os.fsencode(value)
    except UnicodeError:
        raw = b"/" * 4096  # not encodable for the file system: rejected below
    ok = len(raw) < 4096 and all(len(part) <= 255 for part in raw.split(b"/"))
    _require(ok, f"--{name} {value[:60]!r}...: a file name longer than 255 bytes, or a path longer than 4096, "
                 "cannot exist; shorten it")


def _flag(name: str, value: bool) -> None:
    _require(isinstance(value, bool), f"--{name} is a switch (True or False); got {value!r}")


@dataclass(frozen=True)
class ModelSettings:
    bert_config_path: str
    init_checkpoint: str | None = None
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        _choice("attention_backend", self.attention_backend, ("auto", "sdpa", "varlen"))
        _path("bert_config_path", self.bert_config_path, hint=" (the Google bert_config.json)")
        _path("init_checkpoint", self.init_checkpoint, required=False)


@dataclass(frozen=True)
class DataSettings:
    input_dir: str | None
    eval_dir: str
    max_seq_length: int = 512
    max_predictions_per_seq: int = 76
    input_layout: str = "unpadded"
    balance: str = "none"
    balance_deal: str = "auto"

    def __post_init__(self) -> None:
        _choice("input_layout", self.input_layout, INPUT_LAYOUTS)
        _choice("balance", self.balance, BALANCE_POLICIES)
        _choice("balance_deal", self.balance_deal, BALANCE_DEALS)
        _path("input_dir", self.input_dir, required=False)
        _path("eval_dir", self.eval_dir, hint=" (the folder of the eval hdf5 file)")
        _count("max_seq_length", self.max_seq_length, 1, MAX_SEQ_LENGTH_LIMIT)
        _count("max_predictions_per_seq", self.max_predictions_per_seq, 1, self.max_seq_length)
        _require(
            not (self.input_layout == "packed" and self.balance != "none"),
            "--balance redistributes sequences, but packed rows are already balanced: "
            "use --balance none with --input_layout packed",
        )
        _require(
            not (self.input_layout == "padded" and self.balance != "none"),
            "padded batches cost the same on every rank: use --balance none with --input_layout padded",
        )
        _require(
            self.balance != "none" or self.balance_deal == "auto",
            f"--balance_deal {self.balance_deal} orders the deal of a balancing policy: "
            "pick one with --balance or drop --balance_deal",
        )
        if self.balance == "local_presort":
            _check_stratified_input(self.input_dir)
        if self.balance == "cpu_exchange":
            _check_mpi_launch()

    @property
    def deal_order(self) -> str:
        """The deal order of the balancing policy: raster, snake or greedy (`balance.deal`)."""
        if self.balance_deal != "auto":
            return self.balance_deal
        return DEFAULT_DEALS.get(self.balance, "raster")


def _check_stratified_input(input_dir: str | None) -> None:
    """local_presort needs stratified batches, which only a stratified dataset folder gives."""
    from .stratified import STRATA_FILE  # here, not at the top: the config tree stays free of numpy and h5py

    _require(
        not input_dir or not Path(input_dir).is_dir() or (Path(input_dir) / STRATA_FILE).is_file(),
        f"--balance local_presort reads stratified local batches, but --input_dir {input_dir} has no "
        f"{STRATA_FILE}: make the stratified shards with `data_prep/prepare.py stratify --input {input_dir} "
        "--out DIR` and pass --input_dir DIR, or use --balance global_presort",
    )


def _check_mpi_launch() -> None:
    """cpu_exchange talks MPI between the ranks: mpi4py must import and an MPI launcher must start them."""
    from .distributed import launched_by_mpi  # here, not at the top: the config tree stays free of torch

    _require(
        importlib.util.find_spec("mpi4py") is not None,
        "--balance cpu_exchange exchanges samples with MPI, but mpi4py is not installed: "
        "pip install mpi4py mpich (or use --balance global_presort)",
    )
    _require(
        launched_by_mpi(os.environ),
        "--balance cpu_exchange needs ranks started by an MPI launcher (mpiexec -n N ..., or srun --mpi=pmix), "
        "not torchrun: start them with mpiexec, or use --balance global_presort",
    )


@dataclass(frozen=True)
class OptimSettings:
    optimizer: str = "lamb"
    learning_rate: float = 4e-4
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-6
    weight_decay_rate: float = 0.01
    max_grad_norm: float = 1.0
    clip_mode: str = "after_allreduce"
    implementation: str = "auto"

    def __post_init__(self) -> None:
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("optimizer_impl", self.implementation, OPTIMIZER_IMPLS)
        _choice("clip_mode", self.clip_mode, CLIP_MODES)
        _positive("learning_rate", self.learning_rate)
        _positive("opt_epsilon", self.epsilon)
        _positive("max_grad_norm", self.max_grad_norm)
        for name, beta in (("opt_lamb_beta_1", self.beta1), ("opt_lamb_beta_2", self.beta2)):
            _require(_is_real(beta) and 0.0 <= beta < 1.0, f"--{name} must be in [0, 1); got {beta!r}")
        _real("weight_decay_rate", self.weight_decay_rate, 0.0, 1.0)


@dataclass(frozen=True)
class ScheduleSettings:
    max_steps: int
    warmup_steps: int | None = None
    warmup_proportion: float | None = None
    start_warmup_step: int = 0
    decay_steps: int | None = None  # None: the LR decays over max_steps
    end_learning_rate: float = 0.0
    decay_from_warmup_end: bool = False  # Samsung: decay progress counts from the end of warm-up

    def __post_init__(self) -> None:
        _count("max_steps", self.max_steps, 1, MAX_STEPS_LIMIT)
        _count("start_warmup_step", self.start_warmup_step, -self.max_steps, 0)
        if self.decay_steps is not None:
            _count("decay_steps", self.decay_steps, 1, self.max_steps)
        _real("end_learning_rate", self.end_learning_rate, 0.0, math.inf)
        _flag("decay_from_warmup_end", self.decay_from_warmup_end)
        _require(
            self.warmup_steps is None or self.warmup_proportion is None,
            "give --warmup_steps or --warmup_proportion, not both",
        )
        if self.warmup_proportion is not None:
            _real("warmup_proportion", self.warmup_proportion, 0.0, 1.0)
        if self.warmup_steps is not None:
            _count("warmup_steps", self.warmup_steps, 0, self.max_steps)
        _require(
            not self.decay_from_warmup_end or self.resolved_warmup_steps < (self.decay_steps or self.max_steps),
            "--decay_from_warmup_end decays after the warm-up, so the warm-up must end before --decay_steps "
            "(or --max_steps): shorten the warm-up or lengthen the decay",
        )

    @property
    def resolved_warmup_steps(self) -> int:
        if self.warmup_proportion is not None:
            return int(self.warmup_proportion * self.max_steps)
        return self.warmup_steps or 0


@dataclass(frozen=True)
class EvalSettings:
    target_mlm_accuracy: float = 0.720
    num_eval_examples: int = 10000
    eval_batch_size: int = 128
    eval_iter_start_samples: int | None = None
    eval_iter_samples: int | None = None

    def __post_init__(self) -> None:
        _require(_is_real(self.target_mlm_accuracy) and 0 < self.target_mlm_accuracy < 1,
                 f"--target_mlm_accuracy must be in (0, 1); got {self.target_mlm_accuracy!r}")
        _count("num_eval_examples", self.num_eval_examples)
        _count("eval_batch_size", self.eval_batch_size)
        for name in ("eval_iter_start_samples", "eval_iter_samples"):
            if getattr(self, name) is not None:
                _count(name, getattr(self, name))


@dataclass(frozen=True)
class RunSettings:
    output_dir: str
    seed: int = 12345
    do_train: bool = True
    max_samples_termination: int | None = None
    precision: str = "fp32"
    device: str = "auto"
    log_freq: int = 10
    init_loss_scale: float = 2.0**16
    cuda_graphs: bool = False
    mlperf_log_file: str | None = None
    submission_division: str = "closed"
    submission_org: str = "reference"
    submission_platform: str = "unknown"
    submission_status: str = "onprem"
    compile_mode: str = "none"
    sync_every: int = 1
    input_pipeline: str = "torch"

    def __post_init__(self) -> None:
        _choice("precision", self.precision, PRECISIONS)
        _choice("device", self.device, DEVICES)
        _choice("submission_division", self.submission_division, DIVISIONS)
        _choice("submission_status", self.submission_status, SUBMISSION_STATUSES)
        _path("output_dir", self.output_dir)
        _count("seed", self.seed, 0, 2**32 - 1)
        _flag("do_train", self.do_train)
        _flag("cuda_graphs", self.cuda_graphs)
        _choice("compile_mode", self.compile_mode, COMPILE_MODES)
        _count("sync_every", self.sync_every)
        _choice("input_pipeline", self.input_pipeline, INPUT_PIPELINES)
        _count("log_freq", self.log_freq)
        _real("init_loss_scale", self.init_loss_scale, 2.0**-24, 2.0**64)
        if self.max_samples_termination is not None:
            _count("max_samples_termination", self.max_samples_termination)
        _path("mlperf_log_file", self.mlperf_log_file, required=False)
        for name in ("submission_org", "submission_platform"):
            _text(name, getattr(self, name))

    @property
    def mlperf_log_path(self) -> Path:
        return Path(self.mlperf_log_file) if self.mlperf_log_file else Path(self.output_dir) / "mlperf.log"


@dataclass(frozen=True)
class CheckpointSettings:
    """Run checkpoints (model, optimizer, schedule, RNG of every rank, data position) and resume.

    Periodic checkpoints are off unless every_samples or every_minutes is set (MLPerf timing
    configs leave both unset); a preempted or diverged run writes one regardless.
    """

    directory: str | None = None  # None: OUTPUT_DIR/checkpoints
    every_samples: int | None = None  # after the first step at or past each multiple
    every_minutes: float | None = None  # wall clock of rank 0, agreed by all ranks at a step
    keep: int = 3  # newest checkpoints kept; older ones are deleted after each write
    resume_from: str | None = None  # a checkpoint file, or "auto": the newest in `directory`, if any

    def __post_init__(self) -> None:
        _path("checkpoint_dir", self.directory, required=False)
        if self.every_samples is not None:
            _count("checkpoint_every_samples", self.every_samples)
        if self.every_minutes is not None:
            _real("checkpoint_every_minutes", self.every_minutes, 1e-3, 1e6)
        _count("keep_checkpoints", self.keep, 1)
        _path("resume_from_checkpoint", self.resume_from, required=False, hint=" (a checkpoint file or 'auto')")
        if self.resume_from not in (None, RESUME_AUTO):
            _require(os.path.isfile(self.resume_from),
                     f"--resume_from_checkpoint {self.resume_from}: no such file; give a checkpoint file "
                     f"written by a training run, or '{RESUME_AUTO}' for the newest one in --checkpoint_dir")

    @property
    def periodic(self) -> bool:
        return self.every_samples is not None or self.every_minutes is not None


@dataclass(frozen=True)
class FaultSettings:
    """How the run reacts to lost ranks and numeric blow-ups (see docs/FAULTS.md)."""

    collective_timeout_s: float = 600.0  # longest wait in a collective; must exceed a checkpoint write
    max_consecutive_skipped_steps: int = 50  # fp16 overflow skips in a row before the run stops

    def __post_init__(self) -> None:
        _real("collective_timeout_s", self.collective_timeout_s, 1.0, 7 * 24 * 3600.0)
        _count("max_consecutive_skipped_steps", self.max_consecutive_skipped_steps)


def _inside(path: Path, root: Path) -> bool:
    """Whether `path` stays under `root` once `..` and symlinks are resolved (both may not exist yet)."""
    return Path(os.path.realpath(path)).is_relative_to(Path(os.path.realpath(root)))


def _check_output_paths(run: RunSettings, checkpoint_dir: Path) -> None:
    """Everything the run writes by its own choice stays inside --output_dir.

    The one exception is an explicit --mlperf_log_file: the launcher's deliberate choice of where
    the log is collected (run_and_time.sh puts it next to OUTPUT_DIR, as the MLPerf layout wants).
    """
    out = Path(run.output_dir)
    _require(not os.path.lexists(out) or os.path.isdir(out),
             f"--output_dir {out} exists and is not a directory; pick another")
    _require(_inside(checkpoint_dir, out),
             f"--checkpoint_dir {checkpoint_dir} resolves to {os.path.realpath(checkpoint_dir)}, outside "
             f"--output_dir {out}: give a folder inside it (the default is {out / 'checkpoints'})")
    for name in ("mlperf.log", "resolved_config.json"):
        _require(_inside(out / name, out), f"{out / name} is a symlink that leads outside --output_dir; remove it")
    log = run.mlperf_log_path
    _require(not os.path.isdir(log), f"--mlperf_log_file {log} is a directory; give a file path")


@dataclass(frozen=True)
class TrainConfig:
    model: ModelSettings
    data: DataSettings
    optim: OptimSettings
    schedule: ScheduleSettings
    eval: EvalSettings
    run: RunSettings
    train_batch_size: int = 8  # per rank and optimizer step (sequences, or packs when packed)
    gradient_accumulation_steps: int = 1
    world_size: int = 1
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    faults: FaultSettings = field(default_factory=FaultSettings)

    def __post_init__(self) -> None:
        _count("train_batch_size", self.train_batch_size)
        _count("gradient_accumulation_steps", self.gradient_accumulation_steps)
        _require(isinstance(self.world_size, int) and not isinstance(self.world_size, bool) and self.world_size >= 1,
                 f"the world size (WORLD_SIZE, or the launcher's task count) must be an integer >= 1; "
                 f"got {self.world_size!r}")
        self._check_checkpoints()
        _require(
            self.schedule.end_learning_rate <= self.optim.learning_rate,
            f"--end_learning_rate {self.schedule.end_learning_rate} is above --learning_rate "
            f"{self.optim.learning_rate}; the decay must go down (lower --end_learning_rate)",
        )
        _require(
            self.train_batch_size % self.gradient_accumulation_steps == 0,
            f"--train_batch_size {self.train_batch_size} is not divisible by "
            f"--gradient_accumulation_steps {self.gradient_accumulation_steps}; "
            "the micro-batch is their quotient",
        )
        _require(
            not self.run.do_train or bool(self.data.input_dir),
            "--do_train needs --input_dir (the folder of training shards)",
        )
        _require(
            self.run.precision != "fp16" or self.run.device != "cpu",
            "--precision fp16 needs a GPU; use fp32 (or bf16) on the CPU",
        )
        self._check_fast_path()
        _require(
            self.optim.optimizer == "lamb" or self.run.submission_division == "open",
            "the closed division requires LAMB: use --optimizer lamb or --submission_division open",
        )

    def _check_fast_path(self) -> None:
        """--cuda_graphs and --sync_every: what a step without host reads can take."""
        run = self.run
        _require(run.precision != "fp16" or run.sync_every == 1,
                 "--sync_every > 1 needs --precision bf16 or fp32: fp16's loss scaler reads the device every step")
        if not run.cuda_graphs:
            return
        for ok, message in (
            (run.device != "cpu", "--cuda_graphs needs a GPU; drop it on the CPU"),
            (self.data.input_layout == "packed", "--cuda_graphs needs static shapes: use it with --input_layout packed"),
            (run.precision != "fp16", "--cuda_graphs takes --precision bf16 or fp32: fp16's loss scaler skips "
                                      "steps from the host"),
            (self.world_size == 1, f"--cuda_graphs captures one process's step; this run has {self.world_size} "
                                   "processes: run multi-GPU jobs without --cuda_graphs"),
            (self.gradient_accumulation_steps == 1, "--cuda_graphs captures one micro-batch per step: use "
                                                    "--gradient_accumulation_steps 1"),
            (self.optim.implementation in ("auto", "foreach"), "--cuda_graphs needs --optimizer_impl foreach "
                                                               "(or auto): its step runs inside the graph"),
        ):
            _require(ok, message)

    def _check_checkpoints(self) -> None:
        _check_output_paths(self.run, self.checkpoint_dir)
        _require(
            self.run.do_train or (self.checkpoint.resume_from is None and not self.checkpoint.periodic),
            "checkpoints and --resume_from_checkpoint belong to training: add --do_train or drop them",
        )

    @property
    def checkpoint_dir(self) -> Path:
        """Where run checkpoints go (inside --output_dir, checked when the config is built)."""
        directory = self.checkpoint.directory
        return Path(directory) if directory else Path(self.run.output_dir) / "checkpoints"

    @property
    def micro_batch_size(self) -> int:
        return self.train_batch_size // self.gradient_accumulation_steps

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step over all ranks (packs count as 2 sequences, as NVIDIA logs it)."""
        per_item = 2 if self.data.input_layout == "packed" else 1
        return self.train_batch_size * self.world_size * per_item

    def to_dict(self) -> dict:
        return asdict(self)
