"""tools/mlperf_tools/results/scoring.py and `package_results.py rcp`: the olympic score, the RCP window and the
choice of N consecutive runs, against the rules and the official mlperf_logging checkers."""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from mlperf_tools.results import package_results
from mlperf_tools.results import scoring
from mlperf_tools.results.compare import RunLog
from tests.harness.paths import REPO
from tests.harness.rcp_results import synthetic_result as _synthetic_result

CONFIGS = sorted(REPO.glob("config_*.sh"))

# The global batch sizes of the shipped configs, as the systems they copy logged them
# (REFERENCE.md's table of published configurations; the CPU demo's logs in results/CPU_1x2).
PUBLISHED_GBS = {"config_CPU_1x2.sh": 64, "config_DGXA100_1x8.sh": 448, "config_DGXA100_128x8.sh": 4096,
                 "config_DGXH100_1x8.sh": 768, "config_DGXH200_1x8.sh": 768, "config_DGXB200_1x8.sh": 768,
                 "config_GB200_2x4.sh": 768, "config_SamsungA100_128x8.sh": 16384}


def _run(name: str, start_min: float, minutes: float | None) -> RunLog:
    """A run that started at `start_min` and converged after `minutes` (None: aborted after a minute,
    faster than any run that converged, so that only counting it as infinite puts it last)."""
    start = int(start_min * 60_000)
    stop = start + int((minutes if minutes is not None else 1.0) * 60_000)
    status = "success" if minutes is not None else "aborted"
    return RunLog(Path(name), {"seed": name}, start, stop, status, (), False, None)


# ---------------------------------------------------------------------------------------------
# The olympic score and M > N runs


def test_one_run_that_did_not_converge_is_the_slowest_and_two_make_the_result_invalid():
    times = [10.0, 11.0, 12.0, 13.0, 14.0]
    runs = [_run(f"r{i}", i, m) for i, m in enumerate(times)]
    assert scoring.olympic_minutes(runs) == 12.0
    one_failed = runs[:4] + [_run("r4", 4, None)]
    assert scoring.olympic_minutes(one_failed) == pytest.approx((11 + 12 + 13) / 3)  # drops 10 and the failed run
    two_failed = runs[:3] + [_run("r3", 3, None), _run("r4", 4, None)]
    assert math.isinf(scoring.olympic_minutes(two_failed))


# Launch order r0..r11; r0 did not converge. The three windows of 10 consecutive runs score
# W0 = r0..r9: 11..18 (r0 dropped as the slowest, r1 = 10 as the fastest) -> 14.5,
# W1 = r1..r10: 10..17 (5 and 18 dropped) -> 13.5, W2 = r2..r11: 9, 11..17 -> 13.375.
# The median is W1: r0 (failed) and r11 are dropped.
TWELVE = [None, 10, 11, 12, 13, 14, 15, 16, 17, 18, 5, 9]


def test_select_takes_the_median_window_of_consecutive_runs_by_launch_time():
    runs = [_run(f"r{i}", 100 * i, m) for i, m in enumerate(TWELVE)]
    shuffled = runs[:]
    random.Random(3).shuffle(shuffled)  # the order given, and file names, do not matter: run_start does
    selection = scoring.select_consecutive(shuffled, 10)
    assert selection.scores == (14.5, 13.5, 13.375)
    assert selection.chosen == 1
    assert selection.kept == tuple(runs[1:11])
    assert selection.dropped == (runs[0], runs[11])


def test_select_takes_the_slower_of_two_middle_windows():
    runs = [_run(f"r{i}", i, m) for i, m in enumerate(TWELVE[1:])]  # 11 runs: two windows
    selection = scoring.select_consecutive(runs, 10)
    assert selection.scores == (13.5, 13.375)
    assert selection.chosen == 0


def test_select_refuses_a_result_whose_median_window_is_invalid():
    minutes = list(TWELVE)
    minutes[0], minutes[1], minutes[2] = 10, None, None  # W0 and W1 hold two failed runs, W2 one
    runs = [_run(f"r{i}", i, m) for i, m in enumerate(minutes)]
    with pytest.raises(scoring.ScoringError, match=r"\(r0 \.\. r9\) .*whole result is invalid"):
        scoring.select_consecutive(runs, 10)


def test_a_run_that_never_reached_run_start_is_ordered_by_its_first_logged_time(tmp_path):
    log = tmp_path / "crashed.log"
    log.write_text('noise\n:::MLLOG {"time_ms": 4242, "key": "init_start", "event_type": "INTERVAL_START"}\n')
    crashed = RunLog(log, {}, None, None, None, (), False, None)
    assert scoring.launch_ms(crashed) == 4242


def test_olympic_mean_by_hand_on_uneven_times():
    """30, 10, 11, 12, 20 minutes: without 10 and 30, (11 + 12 + 20) / 3 = 14.33 (the plain mean is 16.6); three
    runs keep the middle one; the RCP verdict's olympic samples drop the same two."""
    runs = [_run(f"r{i}", i, m) for i, m in enumerate([30.0, 10.0, 11.0, 12.0, 20.0])]
    assert scoring.olympic_minutes(runs) == pytest.approx(43 / 3, rel=1e-12)
    assert scoring.olympic_minutes(runs[2:]) == pytest.approx(12.0)  # 11, 12, 20
    verdict = scoring.RcpVerdict(None, (100.0, 1.0, 10.0, 2.0, 3.0), False, "", 1.0)
    assert verdict.olympic_samples == pytest.approx(5.0)  # (2 + 3 + 10) / 3


def test_select_with_exactly_as_many_runs_as_the_window_and_with_four_windows():
    """10 runs for windows of 10: the one window, nothing dropped; 3 is the smallest window. 13 runs: four windows
    (W0 r0..r9 = 11..18 with r0 failed, W1 r1..r10, W2 r2..r11, W3 r3..r12 = 8, 9, 12..17 without 5 and 18) score
    14.5, 13.5, 13.375 and 13.0 by hand; of the two middle ones (13.375, 13.5) the slower, W1."""
    runs = [_run(f"r{i}", i, m) for i, m in enumerate([*TWELVE, 8])]
    ten = scoring.select_consecutive(runs[:10], 10)
    assert (ten.scores, ten.chosen, ten.kept, ten.dropped) == ((14.5,), 0, tuple(runs[:10]), ())
    assert scoring.select_consecutive(runs[1:4], 3).kept == tuple(runs[1:4])
    with pytest.raises(scoring.ScoringError, match="--select 2: an olympic score needs at least 3 runs"):
        scoring.select_consecutive(runs[1:4], 2)
    thirteen = scoring.select_consecutive(runs, 10)
    assert thirteen.scores == pytest.approx((14.5, 13.5, 13.375, (8 + 9 + 12 + 13 + 14 + 15 + 16 + 17) / 8))
    assert thirteen.chosen == 1 and thirteen.dropped == (runs[0], runs[11], runs[12])


def _rcp_table() -> dict[int, list[float]]:
    """rcps_bert.json of training 5.0.0 as published: samples to converge of each reference run, by batch size."""
    path = Path(scoring.rcp_checker("5.0.0")._construct_json_filename("training", "5.0.0", "bert"))
    return {int(record["BS"]): list(record["Epochs to converge"]) for record in json.loads(path.read_text()).values()}


def _bound_by_hand(mean: float, stdev: float, reference_runs: int) -> float:
    """The smallest olympic mean of 10 runs (8 kept) a one-sided t-test at 5 % does not call faster than the RCP:
    mean + t_0.05(df) x stdev x sqrt(1/n + 1/8), the pooled deviation the RCP's own."""
    from scipy import stats

    df = reference_runs + 8 - 2
    return mean + stats.t.ppf(0.05, df) * stdev * math.sqrt(1 / reference_runs + 1 / 8)


def test_rcp_window_by_hand_from_the_tables_neighbours():
    """GBS 448 has its own RCP: the olympic mean of its 23 runs (21 kept), their population deviation, the bound
    with 21 reference runs. GBS 768 lies between the pruned neighbours 448 and 4,608 (1,536 and 3,072 lie above
    that line): mean and deviation interpolated linearly at (768 - 448) / (4,608 - 448) = 1/13, the bound with the
    checker's 20 reference runs for an interpolation. GBS 64 is checked against 448."""
    table = _rcp_table()
    olympic = {bs: statistics.fmean(sorted(samples)[1:-1]) for bs, samples in table.items()}
    stdev = {bs: statistics.pstdev(samples) for bs, samples in table.items()}
    own = scoring.rcp_window(448, "5.0.0")
    assert (own.rcp_mean, float(own.record["RCP Stdev"])) == pytest.approx((olympic[448], stdev[448]), rel=1e-12)
    assert own.min_mean == pytest.approx(_bound_by_hand(olympic[448], stdev[448], 21), rel=1e-7)
    share = (768 - 448) / (4608 - 448)
    assert share == pytest.approx(1 / 13)
    mean = olympic[448] + share * (olympic[4608] - olympic[448])
    deviation = stdev[448] + share * (stdev[4608] - stdev[448])
    window = scoring.rcp_window(768, "5.0.0")
    assert (window.rcp_mean, float(window.record["RCP Stdev"])) == pytest.approx((mean, deviation), rel=1e-12)
    assert window.min_mean == pytest.approx(_bound_by_hand(mean, deviation, 20), rel=1e-7)
    assert window.max_speedup == pytest.approx(mean / _bound_by_hand(mean, deviation, 20), rel=1e-7)
    below = scoring.rcp_window(64, "5.0.0")
    assert below.rcp_mean == pytest.approx(olympic[448], rel=1e-12)


def test_an_rcp_bound_exactly_met_passes_with_its_normalization():
    """Ten runs whose olympic mean is exactly the minimum acceptable one pass, normalized by RCP mean / bound (the
    maximum speed-up); one step under it fails, unnormalized. The margin calls the bound itself above it."""
    window = scoring.rcp_window(768, "5.0.0")
    assert window.record is not None and window.min_mean is not None
    bound = window.min_mean
    checker = scoring.rcp_checker("5.0.0")
    assert scoring._judge(checker, window.record, [bound] * 10) == pytest.approx((True, window.max_speedup))
    assert scoring._judge(checker, window.record, [math.nextafter(bound, 0.0)] * 10) == (False, 1.0)
    verdict = scoring.RcpVerdict(window, (bound,) * 10, True, "RCP Interpolation", window.max_speedup)
    assert verdict.margin() == f"olympic mean {bound:,.0f} samples to converge, 0 (0.00%) above the minimum " \
                               f"acceptable {bound:,.0f}"


# ---------------------------------------------------------------------------------------------
# One set of hyperparameters per result


def _with(values: dict, name: str) -> RunLog:
    return RunLog(Path(name), values, 0, 60_000, "success", (), False, None)


def test_the_run_that_differs_from_the_others_is_named_with_both_values():
    common = {"global_batch_size": 768, "opt_base_learning_rate": 0.00096, "seed": 1}
    runs = [_with({**common, "seed": i}, f"result_{i}.txt") for i in range(10)]
    runs[0] = _with({**common, "global_batch_size": 1536}, "result_0.txt")  # the odd one comes first
    mismatch, = scoring.hyperparameter_mismatches(runs)
    assert (mismatch.path.name, mismatch.key, mismatch.value, mismatch.expected) == (
        "result_0.txt", "global_batch_size", 1536, 768)
    assert "global_batch_size is 1536 but 768 in result_1.txt" in mismatch.line()


def test_a_key_only_some_runs_log_is_a_mismatch_and_seeds_are_not():
    runs = [_with({"seed": i, "opt_lamb_beta_1": 0.9}, f"result_{i}.txt") for i in range(3)]
    runs.append(_with({"seed": 9}, "result_3.txt"))
    mismatch, = scoring.hyperparameter_mismatches(runs)
    assert (mismatch.path.name, mismatch.key) == ("result_3.txt", "opt_lamb_beta_1")
    assert "opt_lamb_beta_1 is not logged but 0.9" in mismatch.line()


# ---------------------------------------------------------------------------------------------
# The RCP window


@pytest.mark.parametrize("gbs,coverage,sizes", [(448, scoring.COVERED, (448,)),
                                                (768, scoring.INTERPOLATED, (448, 4608)),
                                                (64, scoring.BELOW, (448,)),
                                                (32768, scoring.ABOVE, (16384,))])
def test_where_a_batch_size_stands_among_the_pruned_rcps(gbs, coverage, sizes):
    window = scoring.rcp_window(gbs, "5.0.0")
    assert (window.coverage, window.rcp_batch_sizes) == (coverage, sizes)
    if coverage == scoring.ABOVE:
        assert window.record is None and "an RCP at GBS 32768 must be submitted" in window.describe()
        return
    # the bound is the RCP mean over the maximum speed-up, the t-test's minimum acceptable mean
    assert window.min_mean == pytest.approx(window.record["Min Epochs"], abs=1e-3)
    assert window.max_speedup == pytest.approx(window.rcp_mean / window.min_mean)


def test_an_rcp_the_checker_prunes_is_interpolated_and_said_so():
    """4096 has an RCP in rcps_bert.json, slower than the line from 448 to 4608: the checker drops it."""
    table = json.loads((Path(scoring.rcp_checker("5.0.0")._construct_json_filename(
        "training", "5.0.0", "bert"))).read_text())
    assert any(record["BS"] == 4096 for record in table.values())
    window = scoring.rcp_window(4096, "5.0.0")
    assert (window.coverage, window.rcp_batch_sizes, window.pruned) == (scoring.INTERPOLATED, (448, 4608), True)
    assert "its own RCP is pruned" in window.describe()


def _official_rcp_checker(folder: Path) -> bool:
    done = subprocess.run([sys.executable, "-m", "mlperf_logging.rcp_checker", str(folder), "--rcp_usage",
                           "training", "--rcp_version", "5.0.0", "--log_output", str(folder.parent / "rcp.log")],
                          capture_output=True, text=True, check=False, cwd=folder.parent)
    assert done.returncode in (0, 1), done.stderr
    return done.returncode == 0


def test_the_printed_bound_at_gbs_768_decides_as_the_official_rcp_checker(tmp_path, capsys):
    from mlperf_logging.rcp_checker.rcp_checker import check_directory

    assert package_results.main(["rcp", "--gbs", "768"]) == 0
    printed = capsys.readouterr().out
    bound = int(printed.split("minimum acceptable olympic mean ")[1].split(", maximum")[0].replace(",", ""))
    inside = _synthetic_result(tmp_path / "inside" / "bert", bound + 1)
    outside = _synthetic_result(tmp_path / "outside" / "bert", bound - 1)
    for folder, official, samples in ((inside, True, bound + 1), (outside, False, bound - 1)):
        assert _official_rcp_checker(folder) is official
        verdict = scoring.rcp_verdict(sorted(folder.glob("result_*.txt")), "5.0.0")
        assert (verdict.passed, verdict.olympic_samples) == (official, samples), verdict
    # inside the window but faster than the RCP mean: the score is normalized, as check_directory says
    _, _, factor = check_directory(str(inside), "training", "5.0.0", False, False, rcp_pass="pruned_rcps")
    verdict = scoring.rcp_verdict(sorted(inside.glob("result_*.txt")), "5.0.0")
    assert verdict.norm_factor == factor > 1.0
    assert "above the minimum acceptable" in verdict.margin()


def test_two_runs_that_did_not_converge_fail_the_rcp_check_as_officially(tmp_path):
    folder = _synthetic_result(tmp_path / "slow" / "bert", 2_600_000)
    for name in ("result_0.txt", "result_1.txt"):
        path = folder / name
        path.write_text(path.read_text().replace('"success"', '"aborted"'))
    verdict = scoring.rcp_verdict(sorted(folder.glob("result_*.txt")), "5.0.0")
    assert (verdict.passed, verdict.message) == (False, "Insufficient convergence")
    assert _official_rcp_checker(folder) is False


# ---------------------------------------------------------------------------------------------
# `package_results.py rcp` and the configs' RCP comments


def test_every_shipped_config_carries_the_rcp_line_the_tool_prints(capsys):
    assert {path.name for path in CONFIGS} == set(PUBLISHED_GBS)
    assert package_results.main(["rcp", *map(str, CONFIGS)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 * len(CONFIGS)
    for path, (arithmetic, comment) in zip(CONFIGS, zip(lines[::2], lines[1::2])):
        assert arithmetic.startswith(f"{path}: global batch size {PUBLISHED_GBS[path.name]} (")
        assert comment.startswith("# RCP (training 5.0.0, bert): GBS ")
        assert comment + "\n" in path.read_text(), f"{path.name}: stale or missing RCP comment; run " \
            f"`python tools/package_results.py rcp {path.name} --write`"


def test_write_replaces_a_stale_rcp_comment_and_keeps_the_rest(tmp_path, capsys):
    config = tmp_path / "config_X.sh"
    original = (REPO / "config_DGXH100_1x8.sh").read_text()
    config.write_text(original.replace("maximum speed-up 1.0595", "maximum speed-up 9.9"))
    assert package_results.main(["rcp", str(config), "--write"]) == 0
    assert config.read_text() == original
    assert capsys.readouterr().out.endswith(f"{config}: RCP comment written\n")
    config.write_text("".join(line for line in original.splitlines(keepends=True) if not line.startswith("# RCP")))
    assert package_results.main(["rcp", str(config), "--write"]) == 0
    assert config.read_text() == original  # inserted as the last line of the leading comments


@pytest.mark.parametrize("args,message", [(["--gbs", "0"], "--gbs 0: a global batch size is a positive"),
                                          (["--gbs", "768", "--ruleset", "6.0.0"], "no BERT RCPs for training "
                                                                                  "ruleset 6.0.0"),
                                          ([], "rcp needs config_<SYSTEM>.sh files or --gbs N")])
def test_rcp_errors_are_one_line_and_exit_2(args, message):
    done = subprocess.run([sys.executable, str(REPO / "tools" / "package_results.py"), "rcp", *args],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
