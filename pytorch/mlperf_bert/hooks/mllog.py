"""The MLPerf log (`:::MLLOG {json}` lines) behind a small interface.

Lines are produced by `mlperf_logging.mllog.mllog.MLLogger`, the official encoder, but each
`MLPerfLogger` owns a private `logging.Logger` (not registered with the logging module), so
two loggers in one process never share handlers, unlike `mllog.config()`, which configures
a process-wide logger. Only rank 0 writes; every other rank gets a logger whose methods do
nothing, so call sites need no rank checks.

mllog records the file and line of the caller; every public method here calls `_emit`
directly, which passes the stack offset that points past this module to the trainer's line.

For BERT an "epoch" is a count of training samples: pass samples seen wherever an
`epoch_num` / `first_epoch_num` is asked for.

A failed write (full disk, read-only or vanished file system) raises OSError naming the log at
the event that failed, and the file is cut back to its last whole line: `logging.FileHandler`
would report the error to stderr and let training go on with a log cut mid-line.

Values must be JSON-serialisable Python values (call `.item()` on tensors yourself: doing
it here would hide a device sync).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Iterable, Mapping

from mlperf_logging.mllog import constants
from mlperf_logging.mllog.mllog import MLLogger

from ..optim.schedule import LRSchedule

DIVISIONS = ("closed", "open")
SUBMISSION_STATUSES = ("onprem", "cloud", "preview", "research")
RUN_STATUSES = (constants.SUCCESS, constants.ABORTED)

# mllog.get_caller walks 2 frames into mllog itself plus `stack_offset` more; from
# `MLLogger.event` the frames are: _emit (1) -> public method (2) -> its caller (3).
_CALLER_STACK_OFFSET = 3


class LogFileHandler(logging.Handler):
    """Appends each record as one line with one os.write; a write error raises (module docstring)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self._fd: int | None = None  # opened at the first line: a run that never starts leaves no file
        self._closed = False

    def emit(self, record: logging.LogRecord) -> None:
        if self._closed:
            raise ValueError(f"{self.path}: the MLPerf log is closed")
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        data = (self.format(record) + "\n").encode()
        size = os.fstat(self._fd).st_size
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as err:
            self._cut_back(size)
            raise OSError(err.errno, err.strerror, self.path) from err

    def _cut_back(self, size: int) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, size)
        except OSError:
            pass  # a device or a vanished file system: the error being raised says enough

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._closed = True
        super().close()


class HeldUntilStart(logging.Handler):
    """Holds the lines of the untimed init until the run starts (`pass_on`), then passes each on.

    A run refused before it starts (a bad resume, a data folder refused before the clock) writes
    nothing to the MLPerf log, which may be the log of the run it was resuming. Each line keeps
    the time it was logged at; a write error of a target raises, as it does without the hold.
    """

    def __init__(self, targets: list[logging.Handler]) -> None:
        super().__init__(level=logging.INFO)
        self.targets = targets
        self.held: list[logging.LogRecord] | None = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.held is not None:
            self.held.append(record)
            return
        for target in self.targets:
            target.handle(record)

    def pass_on(self) -> None:
        # Not `release`: logging.Handler.release unlocks the handler after every emit.
        held, self.held = self.held or [], None
        for record in held:
            self.emit(record)


class EchoHandler(logging.StreamHandler):
    """The log's copy on stdout, where launchers collect it: a failed write raises, as for the file."""

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]  # called inside emit's except clause
        if isinstance(err, OSError):
            raise OSError(err.errno, err.strerror or str(err), "stdout (the MLPerf log's copy)") from err
        super().handleError(record)


class MLPerfLogger:
    """Writes the MLPerf log of one run (rank 0 only).

    path: file to append to, or None for stdout. rank: this process's global rank.
    echo_stdout: also print every line to stdout (the trainer's --echo_mllog). Off by default,
    so a console shows the progress view rather than JSON; on where a launcher collects the
    log from stdout (run_and_time.sh under run_with_docker.sh, which tees it into LOGDIR).
    hold_until_start: keep every line until `run_start` or `release` (the trainer's): a run
    refused before it starts leaves its log, maybe the one of the run it resumes, untouched.
    """

    def __init__(self, path: str | None, rank: int, echo_stdout: bool = False, hold_until_start: bool = False) -> None:
        self.init_started_at = time.time()
        self.enabled = rank == 0
        self._handlers: list[logging.Handler] = []
        self._mllogger: MLLogger | None = None
        if self.enabled:
            if path is not None:
                self._handlers.append(LogFileHandler(path))
            if path is None or echo_stdout:
                self._handlers.append(EchoHandler(sys.stdout))
            sink = logging.Logger(f"mlperf_bert.mllog.{id(self)}", level=logging.INFO)
            sink.propagate = False
            for handler in self._handlers:
                handler.setLevel(logging.INFO)
            self._hold = HeldUntilStart(self._handlers)
            if not hold_until_start:
                self._hold.pass_on()
            sink.addHandler(self._hold)
            self._mllogger = MLLogger(logger=sink)

    def close(self) -> None:
        for handler in self._handlers:
            handler.close()
        self._handlers = []
        self._mllogger = None

    def __enter__(self) -> "MLPerfLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _emit(self, kind: str, key: str, value: Any = None, metadata: Mapping[str, Any] | None = None) -> None:
        if self._mllogger is None:
            return
        write = {"start": self._mllogger.start, "end": self._mllogger.end, "event": self._mllogger.event}[kind]
        write(key=key, value=value, metadata=dict(metadata) if metadata else None, stack_offset=_CALLER_STACK_OFFSET)

    def event(self, key: str, value: Any = None, metadata: Mapping[str, Any] | None = None) -> None:
        self._emit("event", key, value, metadata)

    def cache_clear(self, cleared: bool = True) -> None:
        """cleared: whether the page cache was really dropped before this run."""
        self._emit("event", constants.CACHE_CLEAR, cleared)

    def init_start(self) -> None:
        self.init_started_at = time.time()
        self._emit("start", constants.INIT_START)

    def init_seconds(self) -> float:
        """Seconds since init_start (on every rank, also those that write no log)."""
        return time.time() - self.init_started_at

    def init_stop(self) -> None:
        self._emit("end", constants.INIT_STOP)

    def run_start(self) -> None:
        self.release()
        self._emit("start", constants.RUN_START)

    def release(self) -> None:
        """The run has started (or resumed): the init lines held so far are written, and every line after them."""
        if self._mllogger is not None:
            self._hold.pass_on()

    def run_stop(self, status: str, epoch_num: int | None = None) -> None:
        """status: "success" (target reached) or "aborted"; epoch_num: samples trained."""
        if status not in RUN_STATUSES:
            raise ValueError(f"run_stop status must be one of {RUN_STATUSES}, got {status!r}")
        metadata: dict[str, Any] = {constants.STATUS: status}
        if epoch_num is not None:
            metadata[constants.EPOCH_NUM] = epoch_num
        self._emit("end", constants.RUN_STOP, None, metadata)

    def submission_info(self, org: str, division: str, platform: str, status: str, benchmark: str = constants.BERT) -> None:
        """Logs submission_benchmark / _org / _division / _status / _platform."""
        _check_submission(org, division, platform, status)
        for key, value in _submission_items(benchmark, org, division, status, platform):
            self._emit("event", key, value)

    def hyperparameters(self, values: Mapping[str, Any]) -> None:
        """One event per key (seed, global_batch_size, opt_* ... in insertion order)."""
        for key, value in values.items():
            self._emit("event", key, value)

    def weights_initialization(self, tensor_names: Iterable[str]) -> None:
        """One weights_initialization event per tensor (closed BERT, ruleset 2.0.0)."""
        for name in tensor_names:
            self._emit("event", constants.WEIGHTS_INITIALIZATION, None, {"tensor": name})

    def block_start(self, first_epoch_num: int, epoch_count: int) -> None:
        """first_epoch_num: samples seen when the block starts; epoch_count: samples it spans (> 0)."""
        metadata = {constants.FIRST_EPOCH_NUM: first_epoch_num, constants.EPOCH_COUNT: epoch_count}
        self._emit("start", constants.BLOCK_START, None, metadata)

    def block_stop(self, first_epoch_num: int) -> None:
        self._emit("end", constants.BLOCK_STOP, None, {constants.FIRST_EPOCH_NUM: first_epoch_num})

    def eval_start(self, epoch_num: int) -> None:
        self._emit("start", constants.EVAL_START, None, {constants.EPOCH_NUM: epoch_num})

    def eval_stop(self, epoch_num: int) -> None:
        self._emit("end", constants.EVAL_STOP, None, {constants.EPOCH_NUM: epoch_num})

    def eval_accuracy(self, value: float, epoch_num: int) -> None:
        """value: masked-LM accuracy as a Python float; epoch_num: samples trained."""
        self._emit("event", constants.EVAL_ACCURACY, float(value), {constants.EPOCH_NUM: epoch_num})

    def train_samples(self, n: int) -> None:
        self._emit("event", constants.TRAIN_SAMPLES, int(n))

    def eval_samples(self, n: int) -> None:
        self._emit("event", constants.EVAL_SAMPLES, int(n))

    def tracked_stats(self, stats: Mapping[str, float], step: int) -> None:
        """Throughput / loss / lr, say, as `tracked_stats` with metadata step."""
        self._emit("event", "tracked_stats", dict(stats), {"step": step})


def _check_submission(org: str, division: str, platform: str, status: str) -> None:
    if not org or not platform:
        raise ValueError("submission org and platform must be non-empty strings")
    if division not in DIVISIONS:
        raise ValueError(f"submission division must be one of {DIVISIONS}, got {division!r}")
    if status not in SUBMISSION_STATUSES:
        raise ValueError(f"submission status must be one of {SUBMISSION_STATUSES}, got {status!r}")


def _submission_items(benchmark: str, org: str, division: str, status: str, platform: str) -> list[tuple[str, str]]:
    return [
        (constants.SUBMISSION_BENCHMARK, benchmark),
        (constants.SUBMISSION_ORG, org),
        (constants.SUBMISSION_DIVISION, division),
        (constants.SUBMISSION_STATUS, status),
        (constants.SUBMISSION_PLATFORM, platform),
    ]


def optimizer_hyperparameters(name: str, schedule: LRSchedule, betas: tuple[float, float], eps: float,
                              weight_decay: float) -> dict[str, Any]:
    """MLPerf keys for the optimizer and lr schedule.

    LAMB logs the closed-BERT keys of every ruleset: both epsilon keys (opt_lamb_epsilon since
    3.x, opt_epsilon in 2.0.0) and both warmup keys. ADAM (open division) uses the opt_adamw_*
    keys plus the schedule keys.
    """
    values: dict[str, Any] = {
        constants.OPT_NAME: name,
        constants.OPT_BASE_LR: schedule.base_lr,
        constants.OPT_LR_TRAINING_STEPS: schedule.max_steps,
        constants.OPT_LR_WARMUP_STEPS: schedule.warmup_steps,
        constants.NUM_WARMUP_STEPS: schedule.warmup_steps,
        constants.START_WARMUP_STEP: schedule.start_warmup_step,
        constants.OPT_LAMB_LR_DECAY_POLY_POWER: schedule.power,
        constants.OPT_LR_DECAY_STEPS: schedule.total_decay_steps,
        constants.OPT_END_LR: schedule.end_lr,
        constants.OPT_LR_DECAY_START_STEP: schedule.decay_start_step,
    }
    if name == "lamb":
        values.update({
            constants.OPT_LAMB_EPSILON: eps,
            "opt_epsilon": eps,
            constants.OPT_LAMB_BETA_1: betas[0],
            constants.OPT_LAMB_BETA_2: betas[1],
            constants.OPT_LAMB_WEIGHT_DECAY: weight_decay,
        })
    else:
        values.update({
            constants.OPT_ADAMW_EPSILON: eps,
            constants.OPT_ADAMW_BETA_1: betas[0],
            constants.OPT_ADAMW_BETA_2: betas[1],
            constants.OPT_ADAMW_WEIGHT_DECAY: weight_decay,
        })
    return values


_EMBEDDINGS = ("word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm/gamma", "LayerNorm/beta")
_LAYER_DENSES = ("attention/self/query", "attention/self/key", "attention/self/value", "attention/output/dense")


def _dense(prefix: str) -> list[str]:
    return [f"{prefix}/kernel", f"{prefix}/bias"]


def _layer_norm(prefix: str) -> list[str]:
    return [f"{prefix}/LayerNorm/gamma", f"{prefix}/LayerNorm/beta"]


def _encoder_layer(index: int) -> list[str]:
    p = f"bert/encoder/layer_{index}"
    names = [n for d in _LAYER_DENSES for n in _dense(f"{p}/{d}")]
    names += _layer_norm(f"{p}/attention/output")
    names += _dense(f"{p}/intermediate/dense") + _dense(f"{p}/output/dense") + _layer_norm(f"{p}/output")
    return names


def bert_tf_tensor_names(num_hidden_layers: int) -> list[str]:
    """The TF checkpoint names of BERT pretraining tensors (398 for 24 layers).

    Order: embeddings, encoder layers, pooler, masked-LM head, next-sentence head.
    """
    if num_hidden_layers <= 0:
        raise ValueError(f"num_hidden_layers must be > 0, got {num_hidden_layers}")
    names = [f"bert/embeddings/{e}" for e in _EMBEDDINGS]
    for i in range(num_hidden_layers):
        names += _encoder_layer(i)
    names += _dense("bert/pooler/dense")
    names += ["cls/predictions/output_bias"]
    names += _dense("cls/predictions/transform/dense") + _layer_norm("cls/predictions/transform")
    names += ["cls/seq_relationship/output_weights", "cls/seq_relationship/output_bias"]
    return names
