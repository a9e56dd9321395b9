"""The trainer's entry point: parse flags, build the config, run, report (`pytorch/run_pretraining.py`).

Bad input (flags, shards, checkpoints) ends with one clear `error:` line and exit code 2; the
other exit codes (preemption, lost rank, numeric blow-up) are listed in `mlperf_bert.faults`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

from .model.init_checkpoint import CheckpointError
from .config.cli import build_parser, config_from_args, launcher_flag_variables
from .config.settings import ConfigError
from .data.dataset import DataError
from .runtime.distributed import dist_env_from, init_distributed, shutdown
from .runtime.optional import DependencyError
from .runtime.exits import (
    EXIT_BAD_INPUT,
    EXIT_DIVERGED,
    EXIT_INTERRUPTED,
    EXIT_IO_ERROR,
    EXIT_PREEMPTED,
    mark_main_rank,
    record_exit_code,
    say_once,
)
from .train.faults import StopRequest, TrainingStopped
from .liveness import LostRank, watch_ranks
from .build import data_limits, eval_shortfall_advice, resolve_device
from .input.data_check import check_data_before_clock
from .model.bert import BertConfig
from .hooks.events import Hook
from .outputs import describe_write_error, own_output_dir
from .startup import check_device_request, check_environment
from .trainer import run

# DependencyError: an optional package a flag needs is missing or broken (`runtime/optional.py`).
USER_ERRORS = (ConfigError, DataError, CheckpointError, ValueError, FileNotFoundError, DependencyError)


def main(argv: list[str] | None = None, stop: StopRequest | None = None, hooks: Sequence[Hook] = ()) -> int:
    """Exit codes: 0 done, 2 bad input, 3 numeric blow-up, 74 write failure, 75 preempted (SIGTERM,
    SIGUSR1, Ctrl-C), 76 lost rank, 130 a second Ctrl-C (all in `runtime/exits.py`).

    stop: installed SIGTERM / SIGUSR1 handlers; None installs them for this call only.
    hooks: more hooks for the training loop (`trainer.run`).
    An error line naming flags also names the config variables behind them when a launcher
    passed its table (`mlperf_bert.flag_variables`).
    """
    argv = sys.argv[1:] if argv is None else argv
    try:
        names = launcher_flag_variables(os.environ)
    except ConfigError as err:
        say_once(f"error: {err}")
        return EXIT_BAD_INPUT

    def annotate(message: str) -> str:
        return names.annotate(message, argv)

    try:
        args = build_parser(annotate).parse_args(argv)
    except SystemExit as done:  # --help (0), or a bad flag (2) whose one-line error is printed
        return done.code if isinstance(done.code, int) else EXIT_BAD_INPUT
    if stop is not None:
        return _train(args, stop, hooks, annotate)
    with StopRequest() as own:
        return _train(args, own, hooks, annotate)


def _train(args: argparse.Namespace, stop: StopRequest, hooks: Sequence[Hook], annotate: Callable[[str], str]) -> int:
    group_broken = False
    try:
        denv = dist_env_from(os.environ)
        if denv.is_main:
            mark_main_rank()
        cfg = config_from_args(args, denv.world_size)
        check_device_request(cfg.run.device, denv)
        device = resolve_device(cfg.run.device, denv.local_rank)
        check_environment(cfg, os.environ, device)
        check_data_before_clock(cfg, data_limits(cfg, BertConfig.from_json(cfg.model.bert_config_path)),
                                eval_shortfall_advice(cfg), notes=denv.is_main)
        init_distributed(denv, device, cfg.faults.collective_timeout_s, cfg.run.cuda_graphs)
        with own_output_dir(cfg, denv), watch_ranks(denv, cfg.faults.collective_timeout_s):
            result = run(cfg, denv, device, stop, hooks)
    except USER_ERRORS as err:
        say_once(f"error: {annotate(str(err))}")
        return EXIT_BAD_INPUT
    except OSError as err:  # the MLPerf log, a checkpoint, resolved_config.json: nothing is skipped silently
        say_once(f"error: {describe_write_error(err)}")
        return EXIT_IO_ERROR
    except KeyboardInterrupt:
        say_once("error: interrupted by a second Ctrl-C before the checkpoint; no checkpoint was written")
        return EXIT_INTERRUPTED
    except TrainingStopped as stopped:
        if denv.is_main:
            print(f"stopped ({stopped.reason}): {stopped}. Checkpoint: {stopped.checkpoint}; continue with "
                  f"--resume_from_checkpoint {stopped.checkpoint} (or auto)", file=sys.stderr)
        return stopped.exit_code
    except LostRank as lost:
        group_broken = True  # tearing down a group with a dead member can hang: leave it to the exit
        say_once(f"error: {lost}")
        return lost.exit_code
    finally:
        if not group_broken:
            shutdown()
    if denv.is_main and not cfg.run.do_train:  # a training run's view and summary have said it
        print(f"run_stop status={result.status} samples={result.samples} "
              f"mlm_accuracy={result.accuracy:.4f} seconds={result.seconds:.1f}", file=sys.stderr)
    return 0


def exit_now(code: int) -> None:
    """Ends the process at once with `code` (after flushing) when the run stopped early.

    All ranks leave together after their checkpoint; a launcher (torchrun, srun
    --kill-on-bad-exit) kills the others as soon as the first exits non-zero, and Python's
    teardown would give such a kill time to replace the exit code 75 or 3. Nothing is left to
    clean up: the checkpoint and the MLPerf log are written and the process group is closed.
    """
    record_exit_code(code)
    if code in (EXIT_PREEMPTED, EXIT_DIVERGED):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

