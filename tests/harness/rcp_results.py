"""Synthetic BERT results for the official RCP checker: ten result files with a chosen global
batch size and olympic mean of samples to converge, and the checker's verdict on a folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlperf_tools.results.scoring import quiet_logging


def mllog_line(key: str, value: Any, time_ms: int, **metadata: Any) -> str:
    record = {"namespace": "", "time_ms": time_ms, "event_type": "POINT_IN_TIME", "key": key,
              "value": value, "metadata": metadata}
    return ":::MLLOG " + json.dumps(record) + "\n"


def synthetic_result(folder: Path, olympic_samples: int, gbs: int = 768) -> Path:
    """Ten result files whose olympic mean of samples to converge is `olympic_samples`: the eight
    middle runs spread evenly around it, and one far faster and one far slower run dropped."""
    folder.mkdir(parents=True)
    spread = [0, 0, -4000, 4000, -8000, 8000, -12000, 12000, -400000, 400000]
    for i, offset in enumerate(spread):
        lines = [mllog_line("submission_benchmark", "bert", 0), mllog_line("global_batch_size", gbs, 0),
                 mllog_line("eval_accuracy", 0.7201, 1000, epoch_num=olympic_samples + offset),
                 mllog_line("run_stop", None, 1001, status="success")]
        (folder / f"result_{i}.txt").write_text("".join(lines))
    return folder


def official_verdict(folder: Path, ruleset: str = "5.0.0") -> tuple[bool, str]:
    """(passed, message) of mlperf_logging's `check_directory` on the pruned RCPs, as the package checker runs it."""
    from mlperf_logging.rcp_checker.rcp_checker import check_directory

    with quiet_logging():
        passed, message, _ = check_directory(str(folder), "training", ruleset, False, False, rcp_pass="pruned_rcps")
    return bool(passed), str(message)
