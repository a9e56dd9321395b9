"""How MLPerf scores a BERT result, with the official tools' own code where they have it.

* One result, one set of hyperparameters: `hyperparameter_mismatches` names the run whose
  global batch size, learning rate, warm-up, ... differ from the others'.
* The olympic score with non-converged runs (training_rules.adoc §12): `olympic_minutes`.
* The reference convergence points (§13): `rcp_window` is the window one global batch size gets
  from `mlperf_logging.rcp_checker.RCP_Checker` (its pruned RCP set and its interpolation), and
  `rcp_verdict` is the RCP checker's decision on a result folder, with the normalization factor.
* M > N runs (§12.1): `select_consecutive` picks the N consecutive runs, by launch time, whose
  olympic score is the median of all sliding windows.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from mlperf_tools.results.compare import MLLOG_TOKEN, RunLog, olympic_mean

BENCHMARK = "bert"

# The hyperparameters a BERT log records that one result fixes for all its runs: the tunable ones
# (training_rules.adoc §9.1) and the shape of the batch and the model's input. Hyperparameter
# borrowing replaces them "once per benchmark entry" (§9.2), and the RCP checker matches a whole
# result to one RCP by its global batch size (§13). Seeds differ from run to run by design.
FIXED_HYPERPARAMETERS = (
    "global_batch_size", "d_batch_size", "gradient_accumulation_steps", "opt_name",
    "opt_base_learning_rate", "opt_end_learning_rate", "opt_epsilon", "opt_lamb_epsilon",
    "opt_learning_rate_training_steps", "opt_learning_rate_warmup_steps", "opt_learning_rate_decay_steps",
    "opt_lamb_learning_rate_decay_poly_power", "num_warmup_steps", "start_warmup_step",
    "opt_lamb_beta_1", "opt_lamb_beta_2", "opt_lamb_weight_decay_rate", "opt_gradient_clip_norm",
    "opt_gradient_clip_mode", "max_sequence_length", "max_predictions_per_seq",
)


class ScoringError(Exception):
    """A result that cannot be scored; the message says which run and why."""


@contextmanager
def quiet_logging() -> Iterator[None]:
    """Silence the official checkers' root-logger chatter while they run in this process."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(previous)


# ---------------------------------------------------------------------------------------------
# One set of hyperparameters per result


class _NotLogged:
    def __repr__(self) -> str:
        return "not logged"


NOT_LOGGED: Any = _NotLogged()


@dataclass(frozen=True)
class Mismatch:
    """Run `path` logs `value` for `key` where the other runs of the result log `expected`."""

    path: Path
    key: str
    value: Any
    expected: Any
    example: Path  # one run that logs the expected value

    def line(self) -> str:
        """What differs, for a line that starts with the run's file name."""
        return (f"{self.key} is {self.value!r} but {self.expected!r} in {self.example.name} and the other "
                "runs; all runs of one result use the same hyperparameters (training_rules.adoc §9.2): "
                "package this run with runs of its own settings")


def _majority(values: Sequence[Any]) -> Any:
    """The most common value (the first run's among equally common ones)."""
    keys = [json.dumps(v, sort_keys=True, default=repr) for v in values]
    counts = Counter(keys)
    best = max(counts.values())
    return next(v for v, k in zip(values, keys) if counts[k] == best)


def hyperparameter_mismatches(runs: Sequence[RunLog]) -> list[Mismatch]:
    """Every run whose fixed hyperparameter differs from the value most runs log, key by key."""
    mismatches = []
    for key in FIXED_HYPERPARAMETERS:
        values = [run.values.get(key, NOT_LOGGED) for run in runs]
        expected = _majority(values)
        example = next(run.path for run, v in zip(runs, values) if v == expected)
        mismatches += [Mismatch(run.path, key, v, expected, example)
                       for run, v in zip(runs, values) if v != expected]
    return mismatches


# ---------------------------------------------------------------------------------------------
# The olympic score


def run_minutes(run: RunLog) -> float:
    """A run's time to train; +inf for a run that did not converge (training_rules.adoc §12)."""
    return run.minutes if run.converged and run.minutes is not None else math.inf


def olympic_minutes(runs: Sequence[RunLog]) -> float:
    """Mean of the run times without the fastest and the slowest; one non-converged run is the
    slowest and dropped, two or more make the result invalid (+inf) (training_rules.adoc §12)."""
    score = olympic_mean([run_minutes(run) for run in runs])
    return math.inf if score is None else score


# ---------------------------------------------------------------------------------------------
# Reference convergence points

COVERED, INTERPOLATED, BELOW, ABOVE = "covered", "interpolated", "below", "above"


@lru_cache(maxsize=None)
def rcp_checker(ruleset: str) -> Any:
    """mlperf_logging's RCP checker for BERT: its RCP table, statistics and pruning."""
    from mlperf_logging.rcp_checker.rcp_checker import RCP_Checker

    try:
        with quiet_logging():
            return RCP_Checker("training", ruleset, BENCHMARK, False)
    except Exception as err:  # it raises a bare Exception for an unknown ruleset, OSError without a BERT table
        raise ScoringError(f"mlperf_logging has no BERT RCPs for training ruleset {ruleset} ({err}); "
                           f"BERT's last round is 5.0.0: pass --ruleset 5.0.0") from err


@dataclass(frozen=True)
class RcpWindow:
    """The RCP window of one global batch size, as the RCP checker builds it (pruned RCPs)."""

    ruleset: str
    global_batch_size: int
    coverage: str  # COVERED, INTERPOLATED (between two RCPs), BELOW (every RCP) or ABOVE (every RCP)
    rcp_batch_sizes: tuple[int, ...]  # the RCPs it uses: itself, its two neighbours, or the nearest
    record: Mapping[str, Any] | None  # the checker's record ("RCP Mean", "Min Epochs", "Max Speedup")
    pruned: bool = False  # the table has an RCP at this batch size, which the checker prunes

    @property
    def rcp_mean(self) -> float | None:
        return None if self.record is None else float(self.record["RCP Mean"])

    @property
    def min_mean(self) -> float | None:
        """The smallest olympic mean of samples to converge the checker accepts."""
        return None if self.record is None else float(self.record["RCP Mean"] / self.record["Max Speedup"])

    @property
    def max_speedup(self) -> float | None:
        """RCP mean / minimum acceptable mean: the largest normalization factor a score can get."""
        return None if self.record is None else float(self.record["Max Speedup"])

    def where(self) -> str:
        gbs, sizes = self.global_batch_size, self.rcp_batch_sizes
        if self.coverage == COVERED:
            return f"GBS {gbs} has its own RCP"
        if self.coverage == INTERPOLATED:
            pruned = " (its own RCP is pruned: slower than that interpolation)" if self.pruned else ""
            return f"GBS {gbs} interpolated between the RCPs at GBS {sizes[0]} and {sizes[1]}{pruned}"
        if self.coverage == BELOW:
            return (f"GBS {gbs} is below every RCP: checked against the smallest, GBS {sizes[0]} "
                    f"(converging faster than that needs an RCP at GBS {gbs})")
        return f"GBS {gbs} is above every RCP (the largest is GBS {sizes[0]}): an RCP at GBS {gbs} must be submitted"

    def describe(self) -> str:
        """One line: where the batch size stands and, when there is a window, its numbers."""
        if self.record is None:
            return self.where()
        return (f"{self.where()}: RCP mean {self.rcp_mean:,.0f} samples to converge, minimum acceptable "
                f"olympic mean {self.min_mean:,.0f}, maximum speed-up {self.max_speedup:.4f}")


def rcp_window(global_batch_size: int, ruleset: str) -> RcpWindow:
    """The window the RCP checker (`check_directory`, pruned RCPs) applies to this batch size."""
    checker, rcps = rcp_checker(ruleset), "pruned_rcps"
    own = checker._find_rcp(global_batch_size, rcps)
    if own is not None:
        return RcpWindow(ruleset, global_batch_size, COVERED, (global_batch_size,), own)
    low = checker._find_top_min_rcp(global_batch_size, rcps)
    high = checker._find_bottom_max_rcp(global_batch_size, rcps)
    if low is not None and high is not None:
        with quiet_logging():
            _, record = checker._create_interp_rcp(global_batch_size, low, high)
        pruned = checker._find_rcp(global_batch_size, "full_rcps") is not None
        return RcpWindow(ruleset, global_batch_size, INTERPOLATED, (low["BS"], high["BS"]), record, pruned)
    if high is not None:
        smallest = checker._find_min_rcp(rcps)
        return RcpWindow(ruleset, global_batch_size, BELOW, (smallest["BS"],), smallest)
    if low is None:
        raise ScoringError(f"mlperf_logging has no BERT RCPs for training ruleset {ruleset}")
    return RcpWindow(ruleset, global_batch_size, ABOVE, (low["BS"],), None)


@dataclass(frozen=True)
class RcpVerdict:
    """The RCP checker's decision on one result folder, with the numbers behind it."""

    window: RcpWindow | None  # None when the folder has no single global batch size
    samples: tuple[float, ...]  # per run, as the checker reads them (1e9 for a run that did not converge)
    passed: bool
    message: str  # the checker's words: "RCP found", "RCP Interpolation", "Insufficient convergence", ...
    norm_factor: float  # what the score is multiplied by (1.0 unless faster than the RCP mean)

    @property
    def olympic_samples(self) -> float | None:
        kept = sorted(self.samples)[1:-1]
        return sum(kept) / len(kept) if kept else None

    def margin(self) -> str:
        """The olympic mean against the minimum acceptable one, in samples and percent."""
        mean, bound = self.olympic_samples, self.window.min_mean if self.window else None
        if mean is None or bound is None:
            return "no RCP bound to compare with"
        side = "above" if mean >= bound else "below"
        return (f"olympic mean {mean:,.0f} samples to converge, {abs(mean - bound):,.0f} "
                f"({abs(mean / bound - 1):.2%}) {side} the minimum acceptable {bound:,.0f}")


def _judge(checker: Any, record: Mapping[str, Any], samples: Sequence[float]) -> tuple[bool, float]:
    """The checker's own comparison; it may write scaling.json into the folder it is given."""
    with tempfile.TemporaryDirectory(prefix="rcp_") as scratch, quiet_logging():
        passed, factor = checker._eval_submission_record(dict(record), list(samples), scratch)
    return bool(passed), float(factor) if passed else 1.0


def rcp_verdict(result_files: Sequence[Path], ruleset: str) -> RcpVerdict:
    """What `python -m mlperf_logging.rcp_checker` decides for these files (pruned RCPs, samples
    from eval_accuracy's epoch_num as the package checker reads them), branch by branch."""
    from mlperf_logging.rcp_checker.rcp_checker import get_submission_epochs

    with quiet_logging():
        gbs, samples, _ = get_submission_epochs([str(f) for f in result_files], ruleset, False)
    if gbs == -1:
        return RcpVerdict(None, (), False, "Could not detect global_batch_size", 1.0)
    window = rcp_window(int(gbs), ruleset)
    if samples is None:
        return RcpVerdict(window, (), False, "Insufficient convergence", 1.0)
    missing = f"Missing RCP, please submit RCP with BS = {gbs}"
    if window.record is None:
        return RcpVerdict(window, tuple(samples), False, missing, 1.0)
    passed, factor = _judge(rcp_checker(ruleset), window.record, samples)
    message = {COVERED: "RCP found", INTERPOLATED: "RCP Interpolation"}.get(
        window.coverage, "RCP not found but slower convergence on smaller batch size" if passed else missing)
    return RcpVerdict(window, tuple(samples), passed, message, factor)


# ---------------------------------------------------------------------------------------------
# M > N runs: the N consecutive runs closest to the median


def launch_ms(run: RunLog) -> int:
    """When a run started: its run_start, or for a run that never got there its first logged time."""
    if run.run_start_ms is not None:
        return run.run_start_ms
    with run.path.open(encoding="latin-1") as lines:
        for line in lines:
            if MLLOG_TOKEN in line:
                try:
                    return int(json.loads(line[line.find(MLLOG_TOKEN) + len(MLLOG_TOKEN):])["time_ms"])
                except (ValueError, KeyError, TypeError):
                    continue
    raise ScoringError(f"{run.path}: no timestamped MLPerf line, so the run cannot be ordered by launch time")


@dataclass(frozen=True)
class Selection:
    """Sliding windows of `size` runs over all runs in launch order, and the median one."""

    runs: tuple[RunLog, ...]  # every run, in launch order
    size: int
    scores: tuple[float, ...]  # olympic minutes of the window starting at each run (+inf: invalid)
    chosen: int  # first run of the median window

    @property
    def kept(self) -> tuple[RunLog, ...]:
        return self.runs[self.chosen:self.chosen + self.size]

    @property
    def dropped(self) -> tuple[RunLog, ...]:
        return self.runs[:self.chosen] + self.runs[self.chosen + self.size:]


def select_consecutive(runs: Sequence[RunLog], size: int) -> Selection:
    """The window of `size` consecutive runs (by launch time) whose olympic score is the median of
    all windows' (training_rules.adoc §12.1). Failed runs count as infinitely slow inside each
    window, so a window with two of them scores +inf. With an even number of windows the slower of
    the two middle ones is taken, so that no choice can favour the submitter."""
    if size < 3:
        raise ScoringError(f"--select {size}: an olympic score needs at least 3 runs")
    if len(runs) < size:
        raise ScoringError(f"--select {size}: only {len(runs)} runs to choose from")
    ordered = tuple(sorted(runs, key=lambda run: (launch_ms(run), str(run.path))))
    scores = tuple(olympic_minutes(ordered[i:i + size]) for i in range(len(ordered) - size + 1))
    by_score = sorted(range(len(scores)), key=lambda i: (scores[i], i))
    chosen = by_score[len(by_score) // 2]
    selection = Selection(ordered, size, scores, chosen)
    if math.isinf(scores[chosen]):
        raise ScoringError(f"the median window of {size} consecutive runs ({_names(selection.kept)}) has more "
                           "than one run that did not converge, so the whole result is invalid "
                           "(training_rules.adoc §12.1)")
    return selection


def _names(runs: Sequence[RunLog]) -> str:
    return f"{runs[0].path.name} .. {runs[-1].path.name}"
