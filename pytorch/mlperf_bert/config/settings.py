"""The typed config tree of a training run.

Each component owns one frozen dataclass; `TrainConfig` joins them and rejects bad
combinations when it is built, with a message that names the flag and the fix. Nothing
mutates a config afterwards: derived numbers are properties. The resolved config is
written next to the logs (`TrainConfig.to_dict`) and rebuilds with `TrainConfig.from_dict`.

Each field declared with `flag(...)` is also a command-line flag (`cli.py` generates them), so
its default, choices, help text and --help section are written here and nowhere else.
Validation reads the values only, never files or the environment: what a run needs from the
machine it starts on is checked by `startup.check_environment`.
"""

from __future__ import annotations

import math
import os
import typing
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Iterator

from .batch_size import BatchShape
from .closed_division import closed_division_problem

INPUT_LAYOUTS = ("padded", "unpadded", "packed")
ATTENTION_BACKENDS = ("auto", "sdpa", "varlen", "varlen_cudnn", "grouped")
# The grouped back-end's length groups (0,128], (128,256], (256,384], (384,512]: Baidu's four
# (the unpadded-BERT paper, section IV-A-2). A length above the last bound forms one more group.
DEFAULT_GROUP_BOUNDS = (128, 256, 384, 512)
OPTIMIZERS = ("lamb", "adam")
OPTIMIZER_IMPLS = ("auto", "reference", "foreach", "apex")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
# --precision fp8: how each tensor is scaled (model/fp8.py) and which GEMMs run in FP8.
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_gw_hp", "delayed")
FP8_LAYER_SETS = ("encoder", "ffn")
COMPILE_MODES = ("none", "default", "max-autotune-no-cudagraphs")  # torch.compile modes without its own graphs
INPUT_PIPELINES = ("torch", "dali")
CURVES = ("png", "none")  # --curves: the end-of-run picture, or none
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


# The --help sections, in order; every flag belongs to one (`flag(group=...)`).
GROUPS = ("data", "model", "batch and optimizer", "schedule", "clipping", "precision and fast path", "balance",
          "evaluation and stopping", "checkpoints and faults", "run and logging")


def flag(help: str, group: str, default: Any = MISSING, *, name: str | None = None,
         choices: tuple[str, ...] | None = None, metavar: str | None = None, exclusive: str | None = None) -> Any:
    """A config field that is also a command-line flag: its default, choices and help live here only.

    name: the flag's spelling when it differs from the field's (MLPerf names such as
    --opt_lamb_beta_1); exclusive: flags sharing this tag may not be given together.
    """
    meta = {"help": help, "group": group, "flag": name, "choices": choices, "metavar": metavar, "exclusive": exclusive}
    return field(default=default, metadata=meta)


def flag_name(f: Field) -> str:
    return f.metadata.get("flag") or f.name


def settings_fields(cls: type) -> Iterator[tuple[Field, Any]]:
    """(field, resolved type) of a config dataclass, in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        yield f, hints[f.name]


def is_flag(f: Field) -> bool:
    return "help" in f.metadata


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


def parse_group_bounds(text: str) -> tuple[int, ...]:
    """`--attention_group_bounds` ("128,256,384,512") as increasing positive lengths."""
    parts = [part.strip() for part in str(text).split(",")]
    _require(all(part.isdigit() for part in parts),
             f"--attention_group_bounds must be comma-separated whole numbers such as 128,256,384,512; got {text!r}")
    bounds = tuple(int(part) for part in parts)
    _require(bounds[0] > 0 and all(a < b for a, b in zip(bounds, bounds[1:])),
             f"--attention_group_bounds must be positive and increasing (each an upper length of a group); got {text!r}")
    return bounds


@dataclass(frozen=True)
class ModelSettings:
    bert_config_path: str = flag("Google-format bert_config.json (model shape; checked at start-up)", "model")
    init_checkpoint: str | None = flag("{'model': state_dict} .pt file or HuggingFace directory; without it the "
                                       "weights start random", "model", None)
    attention_backend: str = flag("sdpa: reference, runs anywhere; varlen: GPU kernels on flat tokens (flash); "
                                  "varlen_cudnn: the same on cuDNN's fused attention; grouped: "
                                  "one SDPA per length group (--attention_group_bounds), groups on their own CUDA "
                                  "streams; auto picks varlen on a GPU when it is exact, else grouped when "
                                  "--max_seq_length spans more than one group", "precision and fast path", "auto",
                                  choices=ATTENTION_BACKENDS)
    attention_group_bounds: str = flag("--attention_backend grouped: upper lengths of its groups, comma-separated "
                                       "and increasing", "precision and fast path",
                                       ",".join(map(str, DEFAULT_GROUP_BOUNDS)), metavar="N,N,...")

    def __post_init__(self) -> None:
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        parse_group_bounds(self.attention_group_bounds)
        _path("bert_config_path", self.bert_config_path, hint=" (the Google bert_config.json)")
        _path("init_checkpoint", self.init_checkpoint, required=False)

    @property
    def group_bounds(self) -> tuple[int, ...]:
        return parse_group_bounds(self.attention_group_bounds)


@dataclass(frozen=True)
class DataSettings:
    input_dir: str | None = flag("folder of training hdf5 shards (fixed, varlength or packed); needed with "
                                 "--do_train", "data")
    eval_dir: str = flag("folder (or file) of the eval hdf5 shard(s)", "data")
    max_seq_length: int = flag("longest sequence, in tokens", "data", 512)
    max_predictions_per_seq: int = flag("masked positions per sequence", "data", 76)
    input_layout: str = flag("padded: every sequence padded to --max_seq_length; unpadded: real tokens only; "
                             "packed: packed shards, up to 3 sequences per row", "data", "unpadded",
                             choices=INPUT_LAYOUTS)
    balance: str = flag("load balancing of unpadded batches across ranks", "balance", "none",
                        choices=BALANCE_POLICIES)
    balance_deal: str = flag("how sorted samples are dealt to ranks; auto: raster for global_presort and "
                             "cpu_exchange, snake for local_presort (greedy balances best)", "balance", "auto",
                             choices=BALANCE_DEALS)
    unverified_data: bool = flag("open division: train a folder that has no current verification record "
                                 "(VERIFIED.json of data_prep/verify_dataset.py); copied shards and eval samples in "
                                 "training are then looked for after run_start, in the timed run", "data", False)

    def __post_init__(self) -> None:
        _choice("input_layout", self.input_layout, INPUT_LAYOUTS)
        _choice("balance", self.balance, BALANCE_POLICIES)
        _choice("balance_deal", self.balance_deal, BALANCE_DEALS)
        _flag("unverified_data", self.unverified_data)
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

    @property
    def deal_order(self) -> str:
        """The deal order of the balancing policy: raster, snake or greedy (`balance.deal`)."""
        if self.balance_deal != "auto":
            return self.balance_deal
        return DEFAULT_DEALS.get(self.balance, "raster")


@dataclass(frozen=True)
class OptimSettings:
    optimizer: str = flag("lamb (closed division) or adam", "batch and optimizer", "lamb", choices=OPTIMIZERS)
    learning_rate: float = flag("peak learning rate", "batch and optimizer", 4e-4)
    beta1: float = flag("first-moment decay", "batch and optimizer", 0.9, name="opt_lamb_beta_1")
    beta2: float = flag("second-moment decay", "batch and optimizer", 0.999, name="opt_lamb_beta_2")
    epsilon: float = flag("optimizer epsilon", "batch and optimizer", 1e-6, name="opt_epsilon")
    weight_decay_rate: float = flag("decoupled weight decay, not applied to biases and LayerNorm",
                                    "batch and optimizer", 0.01)
    max_grad_norm: float = flag("gradient clipping norm", "clipping", 1.0)
    clip_mode: str = flag("where gradients are clipped relative to the all-reduce", "clipping", "after_allreduce",
                          choices=CLIP_MODES)
    implementation: str = flag("auto: apex when importable, else PyTorch multi-tensor (foreach)",
                               "batch and optimizer", "auto", name="optimizer_impl", choices=OPTIMIZER_IMPLS)
    distributed: bool = flag("shard the optimizer over the ranks: gradients reduce-scattered, each rank updates "
                             "1/N of the parameters, weights all-gathered (optim/sharded.py)", "batch and optimizer",
                             False, name="distributed_optimizer")
    distributed_group_size: int = flag("with --distributed_optimizer: shard within groups of N consecutive ranks "
                                       "(e.g. a node's GPUs) and all-reduce the shards across groups, as NVIDIA's "
                                       "--dwu-group-size; 0: one group of every rank", "batch and optimizer", 0,
                                       name="dist_optimizer_group_size")

    def __post_init__(self) -> None:
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("optimizer_impl", self.implementation, OPTIMIZER_IMPLS)
        _flag("distributed_optimizer", self.distributed)
        _count("dist_optimizer_group_size", self.distributed_group_size, low=0)
        _require(self.distributed or self.distributed_group_size == 0,
                 "--dist_optimizer_group_size shards the distributed optimizer: add --distributed_optimizer or drop it")
        _require(not self.distributed or self.implementation in ("auto", "foreach"),
                 f"--distributed_optimizer computes with the multi-tensor kernels: use --optimizer_impl foreach (or "
                 f"auto), not {self.implementation}")
        _choice("clip_mode", self.clip_mode, CLIP_MODES)
        _positive("learning_rate", self.learning_rate)
        _positive("opt_epsilon", self.epsilon)
        _positive("max_grad_norm", self.max_grad_norm)
        for name, beta in (("opt_lamb_beta_1", self.beta1), ("opt_lamb_beta_2", self.beta2)):
            _require(_is_real(beta) and 0.0 <= beta < 1.0, f"--{name} must be in [0, 1); got {beta!r}")
        _real("weight_decay_rate", self.weight_decay_rate, 0.0, 1.0)


@dataclass(frozen=True)
class ScheduleSettings:
    max_steps: int = flag("optimizer steps; the LR reaches --end_learning_rate here unless --decay_steps says "
                          "otherwise", "schedule")
    warmup_steps: int | None = flag("linear warm-up steps (without it or --warmup_proportion: no warm-up)", "schedule", None, exclusive="warmup")
    warmup_proportion: float | None = flag("warm-up as a fraction of --max_steps", "schedule", None,
                                           exclusive="warmup")
    start_warmup_step: int = flag("schedule offset; negative values start the warm-up part-way (NVIDIA configs)",
                                  "schedule", 0)
    decay_steps: int | None = flag("steps over which the LR decays to --end_learning_rate (default: --max_steps)",
                                   "schedule", None)
    end_learning_rate: float = flag("LR after the decay", "schedule", 0.0)
    decay_from_warmup_end: bool = flag("measure decay progress from the end of warm-up (Samsung's schedule)",
                                       "schedule", False)

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
        self._check_no_zero_plateau()

    def _check_no_zero_plateau(self) -> None:
        """The LR must not sit at 0 before --max_steps: such steps change nothing and only burn time."""
        decay = self.decay_steps or self.max_steps
        warm_end = self.resolved_warmup_steps + self.start_warmup_step  # first step after the warm-up
        warm = "--warmup_proportion" if self.warmup_proportion is not None else "--warmup_steps"
        _require(
            warm_end <= decay,
            f"{warm} ends the warm-up at step {warm_end}, after --decay_steps {decay} has already brought the "
            f"learning rate down to --end_learning_rate {self.end_learning_rate}: the warm-up would jump to "
            f"{self.end_learning_rate} at step {warm_end}. Give --decay_steps >= {warm_end} (or drop it: the "
            "decay then runs to --max_steps), or shorten the warm-up",
        )
        _require(
            self.end_learning_rate > 0 or decay == self.max_steps,
            f"--decay_steps {decay} brings the learning rate to --end_learning_rate 0 at step {decay}, and it "
            f"stays 0 until --max_steps {self.max_steps}: those steps train nothing. Drop --decay_steps (the "
            "decay then runs to --max_steps), lower --max_steps to it, or give --end_learning_rate > 0",
        )

    @property
    def resolved_warmup_steps(self) -> int:
        if self.warmup_proportion is not None:
            return int(self.warmup_proportion * self.max_steps)
        return self.warmup_steps or 0


@dataclass(frozen=True)
class EvalSettings:
    target_mlm_accuracy: float = flag("stop with success at this masked-LM accuracy", "evaluation and stopping",
                                      0.720)
    num_eval_examples: int = flag("eval samples (the first N of --eval_dir)", "evaluation and stopping", 10000)
    eval_batch_size: int = flag("eval sequences per rank and step", "evaluation and stopping", 128)
    eval_iter_start_samples: int | None = flag("samples before the first eval (default: --eval_iter_samples)",
                                               "evaluation and stopping", None)
    eval_iter_samples: int | None = flag("samples between evals (default: the MLPerf formula of the global batch "
                                         "size)", "evaluation and stopping", None)

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
    output_dir: str = flag("where the MLPerf log, resolved_config.json and checkpoints go", "run and logging")
    seed: int = flag("seed of weights, data order and dropout", "run and logging", 12345)
    do_train: bool = flag("train; without it the init checkpoint is evaluated once", "run and logging", False)
    max_samples_termination: int | None = flag("stop with status aborted after this many samples (default: only "
                                               "--max_steps stops)", "evaluation and stopping", None)
    precision: str = flag("fp32 (CPU), bf16, fp16 with dynamic loss scaling (GPU), or fp8: the encoder's linear "
                          "layers in FP8 through torchao, the rest bf16 (GPUs of compute capability >= 8.9; "
                          "emulated on the CPU)", "precision and fast path", "fp32", choices=PRECISIONS)
    fp8_recipe: str | None = flag("--precision fp8: tensorwise, rowwise, rowwise_gw_hp (torchao's dynamic scaling, "
                                  "fast accumulation in all three GEMMs) or delayed (each scale from the same "
                                  "tensor's amax one step before, as NVIDIA's TransformerEngine runs; "
                                  "model/fp8_delayed.py); default tensorwise", "precision and fast path", None,
                                  choices=FP8_RECIPES)
    fp8_layers: str | None = flag("--precision fp8: encoder (QKV, attention output and both FFN GEMMs of every "
                                  "layer) or ffn (the two FFN GEMMs only, the largest); default encoder",
                                  "precision and fast path", None, choices=FP8_LAYER_SETS)
    device: str = flag("auto: cuda when available", "run and logging", "auto", choices=DEVICES)
    log_freq: int = flag("steps between progress lines on stderr", "run and logging", 10)
    init_loss_scale: float = flag("fp16 initial loss scale", "precision and fast path", 2.0**16)
    cuda_graphs: bool = flag("capture the packed training step as a CUDA graph", "precision and fast path", False)
    eval_cuda_graph: bool = flag("eval on packed rows of one static shape, kept on the GPU, its forward captured "
                                 "once as a CUDA graph and replayed per batch (train/eval_step.py)",
                                 "precision and fast path", False)
    mlperf_log_file: str | None = flag("MLPerf log path (default: OUTPUT_DIR/mlperf.log)", "run and logging", None)
    echo_mllog: bool = flag("also print the MLPerf log's lines to stdout, for launchers that collect the log "
                            "from there (run_and_time.sh)", "run and logging", False)
    curves: str = flag("png: at the end draw the training loss and eval accuracy in OUTPUT_DIR/curves.png "
                       "(matplotlib, about a second of CPU); none: only summary.txt and summary.json, for sweeps "
                       "of many short runs", "run and logging", "png", choices=CURVES)
    submission_division: str = flag("logged as submission_division; closed checks the closed-division rules "
                                    "(docs/CLOSED_DIVISION.md) before anything is read",
                                    "run and logging", "closed", choices=DIVISIONS)
    submission_org: str = flag("logged as submission_org", "run and logging", "reference")
    submission_platform: str = flag("logged as submission_platform", "run and logging", "unknown")
    submission_status: str = flag("logged as submission_status", "run and logging", "onprem",
                                  choices=SUBMISSION_STATUSES)
    compile_mode: str = flag("torch.compile each encoder layer (fuses bias+GELU and dropout+residual+LayerNorm)",
                             "precision and fast path", "none", choices=COMPILE_MODES)
    sync_every: int = flag("steps between host reads of the device (loss check, stop agreement); above 1 a "
                           "non-finite loss rolls the run back to the last good read, and fp16 skips overflows "
                           "on the device (docs/FAULTS.md)",
                           "precision and fast path", 1)
    input_pipeline: str = flag("host-to-device input: torch (pinned memory, side-stream copies) or NVIDIA DALI",
                               "precision and fast path", "torch", choices=INPUT_PIPELINES)

    def __post_init__(self) -> None:
        _choice("precision", self.precision, PRECISIONS)
        for name, allowed in (("fp8_recipe", FP8_RECIPES), ("fp8_layers", FP8_LAYER_SETS)):
            value = getattr(self, name)
            if value is not None:
                _choice(name, value, allowed)
                _require(self.precision == "fp8", f"--{name} applies to --precision fp8 only; drop it with "
                                                  f"--precision {self.precision}")
        _choice("device", self.device, DEVICES)
        _choice("curves", self.curves, CURVES)
        _choice("submission_division", self.submission_division, DIVISIONS)
        _choice("submission_status", self.submission_status, SUBMISSION_STATUSES)
        _path("output_dir", self.output_dir)
        _count("seed", self.seed, 0, 2**32 - 1)
        _flag("do_train", self.do_train)
        _flag("cuda_graphs", self.cuda_graphs)
        _flag("eval_cuda_graph", self.eval_cuda_graph)
        _require(not (self.eval_cuda_graph and self.device == "cpu"),
                 "--eval_cuda_graph needs a GPU; drop it on the CPU")
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

    directory: str | None = flag("run checkpoints; must be inside --output_dir (default: OUTPUT_DIR/checkpoints)",
                                 "checkpoints and faults", None, name="checkpoint_dir")
    every_samples: int | None = flag("write a checkpoint after the step that passes each multiple of this many "
                                     "samples", "checkpoints and faults", None, name="checkpoint_every_samples")
    every_minutes: float | None = flag("write a checkpoint when this many minutes passed since the last one "
                                       "(rank 0's clock, agreed by all ranks at a step)", "checkpoints and faults",
                                       None, name="checkpoint_every_minutes")
    keep: int = flag("newest checkpoints kept, older ones deleted after each write", "checkpoints and faults", 3,
                     name="keep_checkpoints")
    resume_from: str | None = flag("continue a run from a checkpoint file; auto: the newest in --checkpoint_dir, "
                                   "or a fresh start when there is none (a resumed run is never a timing result)",
                                   "checkpoints and faults", None, name="resume_from_checkpoint",
                                   metavar="PATH|auto")

    def __post_init__(self) -> None:
        _path("checkpoint_dir", self.directory, required=False)
        if self.every_samples is not None:
            _count("checkpoint_every_samples", self.every_samples)
        if self.every_minutes is not None:
            _real("checkpoint_every_minutes", self.every_minutes, 1e-3, 1e6)
        _count("keep_checkpoints", self.keep, 1)
        _path("resume_from_checkpoint", self.resume_from, required=False, hint=" (a checkpoint file or 'auto')")

    @property
    def periodic(self) -> bool:
        return self.every_samples is not None or self.every_minutes is not None


@dataclass(frozen=True)
class FaultSettings:
    """How the run reacts to lost ranks and numeric blow-ups (see docs/FAULTS.md)."""

    collective_timeout_s: float = flag("seconds a rank waits in a collective before the run stops naming the "
                                       "lost rank; must exceed the time to write a checkpoint",
                                       "checkpoints and faults", 600.0)
    max_consecutive_skipped_steps: int = flag("fp16: stop (with a checkpoint) after this many overflow-skipped "
                                              "steps in a row (seen at the next read under --sync_every)",
                                              "checkpoints and faults", 50)

    def __post_init__(self) -> None:
        _real("collective_timeout_s", self.collective_timeout_s, 1.0, 7 * 24 * 3600.0)
        _count("max_consecutive_skipped_steps", self.max_consecutive_skipped_steps)


@dataclass(frozen=True)
class TrainConfig:
    model: ModelSettings
    data: DataSettings
    optim: OptimSettings
    schedule: ScheduleSettings
    eval: EvalSettings
    run: RunSettings
    train_batch_size: int = flag("per rank and optimizer step: sequences, or packs with --input_layout packed",
                                 "batch and optimizer", 8)
    gradient_accumulation_steps: int = flag("micro-batches per optimizer step (micro-batch = --train_batch_size / "
                                            "this)", "batch and optimizer", 1)
    world_size: int = 1  # processes; from the launcher's environment, not a flag
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    faults: FaultSettings = field(default_factory=FaultSettings)

    def __post_init__(self) -> None:
        _count("train_batch_size", self.train_batch_size)
        _count("gradient_accumulation_steps", self.gradient_accumulation_steps)
        _require(isinstance(self.world_size, int) and not isinstance(self.world_size, bool) and self.world_size >= 1,
                 f"the world size (WORLD_SIZE, or the launcher's task count) must be an integer >= 1; "
                 f"got {self.world_size!r}")
        self._check_checkpoints()
        group = self.optim.distributed_group_size
        _require(group == 0 or self.world_size % group == 0,
                 f"--dist_optimizer_group_size {group} must divide the {self.world_size} ranks (or be 0: every rank)")
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
        if self.run.submission_division == "closed":
            _require(not self.data.unverified_data,
                     "closed division: a timed run trains verified data only (training_rules.adoc §6.5, §6.6): "
                     "drop --unverified_data and verify the folders with data_prep/verify_dataset.py, or run in "
                     "the open division (--submission_division open)")
            problem = closed_division_problem(self)
            _require(problem is None, problem or "")

    def _check_fast_path(self) -> None:
        """--cuda_graphs and --sync_every: what a step without host reads can take."""
        run = self.run
        _require(not self.device_steps or self.optim.implementation in ("auto", "foreach"),
                 f"{self._device_steps_reason} needs --optimizer_impl foreach (or auto): its step count, "
                 "learning rate and fp16 overflow skip stay on the device")
        if not run.cuda_graphs:
            return
        for ok, message in (
            (run.device != "cpu", "--cuda_graphs needs a GPU; drop it on the CPU"),
            (self.data.input_layout == "packed", "--cuda_graphs needs static shapes: use it with --input_layout packed"),
        ):
            _require(ok, message)

    @property
    def sharded_optimizer(self) -> bool:
        """--distributed_optimizer on more than one rank (on one, the unsharded optimizer is the same thing)."""
        return self.optim.distributed and self.world_size > 1

    @property
    def device_loss_scaling(self) -> bool:
        """fp16 with the loss scaler on the device (`loss_scale.DeviceLossScaler`): under a graph or a window,
        and with a sharded optimizer (whose skip is agreed on the device, where GradScaler's is one rank's)."""
        return self.run.precision == "fp16" and (self.run.cuda_graphs or self.run.sync_every > 1
                                                 or self.sharded_optimizer)

    @property
    def device_steps(self) -> bool:
        """The optimizer counts its steps on the device (`optim.capturable.capturable`)."""
        return self.run.cuda_graphs or self.device_loss_scaling

    @property
    def _device_steps_reason(self) -> str:
        if self.run.cuda_graphs:
            return "--cuda_graphs"
        return "--precision fp16 with --sync_every > 1" if self.run.sync_every > 1 else \
            "--precision fp16 with --distributed_optimizer"

    def _check_checkpoints(self) -> None:
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
    def batch(self) -> BatchShape:
        """The step's batch, counted as the tools count a config file's (`config/batch_size.py`)."""
        return BatchShape(self.train_batch_size, self.gradient_accumulation_steps, self.world_size,
                          self.data.input_layout == "packed")

    @property
    def micro_batch_size(self) -> int:
        return self.batch.micro_batch_size

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step over all ranks (packs count as 2 sequences, as NVIDIA logs it)."""
        return self.batch.global_batch_size

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        """The inverse of `to_dict` (a `resolved_config.json`), validated as when built from flags."""
        return _from_dict(cls, data)


def _from_dict(cls: type, data: object) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{cls.__name__}: expected a JSON object; got {data!r}")
    known = {f.name: kind for f, kind in settings_fields(cls)}
    unknown = sorted(set(data) - set(known))
    _require(not unknown, f"{cls.__name__}: unknown key(s) {', '.join(unknown)}; the keys are {', '.join(known)}")
    values = {name: _from_dict(known[name], value) if is_dataclass(known[name]) else value
              for name, value in data.items()}
    try:
        return cls(**values)
    except TypeError as err:  # a required key is missing
        raise ConfigError(f"{cls.__name__}: {err}") from err
