#!/usr/bin/env python3
"""MLPerf BERT phase-2 pretraining: parse flags, build the config, run, report.

Bad input (flags, shards, checkpoints) ends with one clear `error:` line and exit code 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run from a clone without installing

from mlperf_bert.checkpoint import CheckpointError  # noqa: E402
from mlperf_bert.cli import build_parser, config_from_args  # noqa: E402
from mlperf_bert.config import ConfigError  # noqa: E402
from mlperf_bert.data import DataError  # noqa: E402
from mlperf_bert.distributed import dist_env_from, init_distributed, shutdown  # noqa: E402
from mlperf_bert.trainer import resolve_device, run  # noqa: E402

USER_ERRORS = (ConfigError, DataError, CheckpointError, ValueError, FileNotFoundError)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        denv = dist_env_from(os.environ)
        cfg = config_from_args(args, denv.world_size)
        device = resolve_device(cfg.run.device, denv.local_rank)
        init_distributed(denv, device)
        result = run(cfg, denv, device)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    if denv.is_main:
        print(f"run_stop status={result.status} samples={result.samples} "
              f"mlm_accuracy={result.accuracy:.4f} seconds={result.seconds:.1f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
