"""The typed config tree of a training run.

Each component owns one frozen dataclass; `TrainConfig` joins them and rejects bad
combinations when it is built, with a message that names the flag and the fix. Nothing
mutates a config afterwards: derived numbers are properties. The resolved config is
written next to the logs (`TrainConfig.to_dict`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

INPUT_LAYOUTS = ("padded", "unpadded", "packed")
OPTIMIZERS = ("lamb", "adam")
OPTIMIZER_IMPLS = ("auto", "reference", "foreach", "apex")
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
DIVISIONS = ("closed", "open")
SUBMISSION_STATUSES = ("onprem", "cloud", "preview", "research")
CLIP_MODES = ("none", "after_allreduce", "before_allreduce", "bucketwise")
BALANCE_POLICIES = ("none", "global_presort", "local_presort", "cpu_exchange")


class ConfigError(ValueError):
    """A flag or config variable with a bad value; the message says how to fix it."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, f"--{name} must be one of {', '.join(allowed)}; got {value!r}")


def _positive(name: str, value: float) -> None:
    _require(math.isfinite(value) and value > 0, f"--{name} must be a positive number; got {value}")


@dataclass(frozen=True)
class ModelSettings:
    bert_config_path: str
    init_checkpoint: str | None = None
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        _choice("attention_backend", self.attention_backend, ("auto", "sdpa", "varlen"))
        _require(bool(self.bert_config_path), "--bert_config_path is required (the Google bert_config.json)")


@dataclass(frozen=True)
class DataSettings:
    input_dir: str | None
    eval_dir: str
    max_seq_length: int = 512
    max_predictions_per_seq: int = 76
    input_layout: str = "unpadded"
    balance: str = "none"

    def __post_init__(self) -> None:
        _choice("input_layout", self.input_layout, INPUT_LAYOUTS)
        _choice("balance", self.balance, BALANCE_POLICIES)
        _positive("max_seq_length", self.max_seq_length)
        _positive("max_predictions_per_seq", self.max_predictions_per_seq)
        _require(bool(self.eval_dir), "--eval_dir is required (the folder of the eval hdf5 file)")
        _require(
            not (self.input_layout == "packed" and self.balance != "none"),
            "--balance redistributes sequences, but packed rows are already balanced: "
            "use --balance none with --input_layout packed",
        )
        _require(
            not (self.input_layout == "padded" and self.balance != "none"),
            "padded batches cost the same on every rank: use --balance none with --input_layout padded",
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
            _require(0.0 <= beta < 1.0, f"--{name} must be in [0, 1); got {beta}")
        _require(self.weight_decay_rate >= 0, f"--weight_decay_rate must be >= 0; got {self.weight_decay_rate}")


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
        _positive("max_steps", self.max_steps)
        _require(self.start_warmup_step <= 0, "--start_warmup_step must be <= 0 (it starts the warm-up early)")
        if self.decay_steps is not None:
            _positive("decay_steps", self.decay_steps)
            _require(self.decay_steps <= self.max_steps, "--decay_steps must be <= --max_steps")
        _require(self.end_learning_rate >= 0, "--end_learning_rate must be >= 0")
        _require(
            self.warmup_steps is None or self.warmup_proportion is None,
            "give --warmup_steps or --warmup_proportion, not both",
        )
        if self.warmup_proportion is not None:
            _require(0 <= self.warmup_proportion <= 1, "--warmup_proportion must be in [0, 1]")
        _require((self.warmup_steps or 0) >= 0, "--warmup_steps must be >= 0")

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
        _require(0 < self.target_mlm_accuracy < 1, "--target_mlm_accuracy must be in (0, 1)")
        _positive("num_eval_examples", self.num_eval_examples)
        _positive("eval_batch_size", self.eval_batch_size)
        for name in ("eval_iter_start_samples", "eval_iter_samples"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"--{name} must be positive; got {value}")


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

    def __post_init__(self) -> None:
        _choice("precision", self.precision, PRECISIONS)
        _choice("device", self.device, DEVICES)
        _choice("submission_division", self.submission_division, DIVISIONS)
        _choice("submission_status", self.submission_status, SUBMISSION_STATUSES)
        _positive("log_freq", self.log_freq)
        _positive("init_loss_scale", self.init_loss_scale)
        if self.max_samples_termination is not None:
            _positive("max_samples_termination", self.max_samples_termination)

    @property
    def mlperf_log_path(self) -> Path:
        return Path(self.mlperf_log_file) if self.mlperf_log_file else Path(self.output_dir) / "mlperf.log"


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
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _positive("train_batch_size", self.train_batch_size)
        _positive("gradient_accumulation_steps", self.gradient_accumulation_steps)
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
        _require(
            not (self.run.cuda_graphs and self.run.device == "cpu"),
            "--cuda_graphs needs a GPU; drop it on the CPU",
        )
        _require(
            not (self.run.cuda_graphs and self.data.input_layout != "packed"),
            "--cuda_graphs needs static shapes: use it with --input_layout packed",
        )
        _require(
            self.optim.optimizer == "lamb" or self.run.submission_division == "open",
            "the closed division requires LAMB: use --optimizer lamb or --submission_division open",
        )

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
