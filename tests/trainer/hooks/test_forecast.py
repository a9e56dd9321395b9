"""The run forecast: its rows refitted from the published logs, its backtest on systems it was
not fitted on, tools/forecast.py on a published log and against the official RCP checker, and
the forecast lines of the live view and the summary."""

from __future__ import annotations

import io
import json
import math
import statistics
import subprocess
import sys
import tarfile
from dataclasses import astuple
from pathlib import Path

import pytest

from mlperf_tools.planning import forecast as forecast_cli
import forecast_backtest
from mlperf_bert.hooks.events import EvalEnd, RunEnd, RunStart
from mlperf_bert.hooks.forecast import (ROWS, SCHEDULE_RANGE, Forecast, fit, outside_reason, predict, progress_logit,
                                        row_for)
from mlperf_bert.hooks.live import LiveView
from mlperf_bert.hooks.report import RunReport
from mlperf_tools.results.scoring import rcp_window
from tests.harness.paths import MLPERF_LOGS, REPO
from tests.harness.rcp_results import mllog_line, official_verdict, synthetic_result

NVIDIA_448 = MLPERF_LOGS / "v2.0/NVIDIA/results/dgxa100_ngc22.04_pytorch/bert/result_0.txt"
SCHEDULE_448 = 6700 * 448  # NVIDIA's v2.0 A100 schedule: 6,700 steps of 448


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> list[forecast_backtest.Published]:
    folder = tmp_path_factory.mktemp("forecast_logs")
    with tarfile.open(forecast_backtest.LOGS) as archive:
        archive.extractall(folder, filter="data")
    runs, skipped = forecast_backtest.load(folder)
    assert (len(runs), skipped) == (405, 5)
    return runs


def test_the_shipped_rows_are_the_fit_of_the_published_logs(published):
    refit = fit([p.observed for p in published])
    assert [(r.evals, r.runs) for r in ROWS] == [(r.evals, r.runs) for r in refit]
    for shipped, fitted in zip(ROWS, refit):
        assert astuple(shipped)[1:6] == pytest.approx(astuple(fitted)[1:6], rel=1e-6), shipped.evals
    schedules = [p.observed.schedule_samples for p in published]
    assert SCHEDULE_RANGE == (min(schedules), max(schedules))


@pytest.mark.parametrize("evals", [2, 3])
def test_on_systems_left_out_of_the_fit_the_interval_holds_about_80_percent(published, evals):
    outcomes = forecast_backtest.backtest(published, evals)
    assert len({o.system for o in outcomes}) == 41
    coverage = statistics.mean(o.covered for o in outcomes)
    errors = [abs(o.samples[0] / o.real_samples - 1) for o in outcomes]
    assert 0.72 <= coverage <= 0.88, coverage
    assert statistics.median(errors) < 0.08
    # the plain log-linear extrapolation the model replaces is far worse
    naive = [abs(o.naive / o.real_samples - 1) for o in outcomes if o.naive is not None]
    assert statistics.median(naive) > 5 * statistics.median(errors)


def _evals(accuracies: list[float], interval: int = 150_000) -> list[tuple[float, float]]:
    return [(interval * (i + 1.0), a) for i, a in enumerate(accuracies)]


def test_the_forecast_follows_the_schedule_and_the_progress_and_never_ends_before_the_next_eval():
    early = [0.375, 0.40, 0.48]
    base = predict(_evals(early), SCHEDULE_448)
    assert base.low < base.samples < base.high
    assert predict(_evals(early), 2 * SCHEDULE_448).samples > base.samples  # a longer schedule ends later
    assert predict(_evals([0.375, 0.40, 0.60]), SCHEDULE_448).samples < base.samples  # further along: sooner
    late = predict(_evals([0.40] * 19 + [0.7195]), SCHEDULE_448)  # 20 evals in, just short of the target
    assert late.low >= 21 * 150_000
    reached = predict(_evals([0.40, 0.65, 0.7201]), SCHEDULE_448)
    assert (reached.reached, reached.samples, reached.high) == (True, 450_000, 450_000)


def test_a_run_that_went_on_past_the_target_reached_it_at_its_first_eval_there():
    """Evals at 150,000 a piece; the first at or past 0.720 is the 3rd (450,000 samples, 210 s), exactly at it
    or over it, whatever the evals after it read (above, or back under the target)."""
    seconds = [90.0, 150.0, 210.0, 270.0, 330.0]
    for accuracies in ([0.40, 0.65, 0.720, 0.7215, 0.7230], [0.40, 0.65, 0.7201, 0.7195, 0.7199]):
        result = predict(_evals(accuracies), SCHEDULE_448, seconds)
        assert (result.reached, result.evals, result.samples, result.low, result.high) == (True, 3, 450_000,
                                                                                           450_000, 450_000)
        assert result.seconds == (210.0, 210.0, 210.0)
        assert result.line() == "0.720 reached at 450,000 samples"
    just_under = predict(_evals([0.40, 0.65, 0.7199999]), SCHEDULE_448)
    assert not just_under.reached and just_under.samples >= 600_000  # no sooner than the next eval


def test_wall_time_follows_the_runs_own_pace_between_evals():
    evals = _evals([0.375, 0.40, 0.48])
    seconds = [90.0, 150.0, 210.0]  # a minute a 150,000 samples after a 30 s start
    result = predict(evals, SCHEDULE_448, seconds)
    assert result.seconds is not None
    pace = 60.0 / 150_000
    expected = tuple(210.0 + (s - 450_000) * pace for s in (result.samples, result.low, result.high))
    assert result.seconds == pytest.approx(expected)


def test_an_eval_before_training_is_left_out():
    before = predict([(0.0, 0.34)], SCHEDULE_448, [10.0])
    assert before.line() == "none (no eval after the first training step yet)"
    evals, seconds = _evals([0.375, 0.40]), [90.0, 150.0]
    assert predict([(0.0, 0.34), *evals], SCHEDULE_448, [10.0, *seconds]) == predict(evals, SCHEDULE_448, seconds)


def test_a_schedule_far_outside_the_published_runs_gets_no_numbers():
    result = predict(_evals([0.4, 0.5]), 64_000)  # the CPU demo's 1,000 steps of 64
    assert result.outside and math.isnan(result.samples)
    assert result.line().startswith("none (the LR schedule spans 64,000 samples")


def test_a_run_at_the_target_at_its_first_eval_reached_it_there():
    """The first eval (index 0) at 0.720 exactly, after an eval before training (10 s) that the forecast leaves out:
    reached at 150,000 samples, 90 s after run_start, whatever the later evals read."""
    result = predict([(0.0, 0.34), *_evals([0.720, 0.70])], SCHEDULE_448, [10.0, 90.0, 150.0])
    assert (result.reached, result.samples, result.low, result.high) == (True, 150_000, 150_000, 150_000)
    assert result.seconds == (90.0, 90.0, 90.0)
    alone = predict(_evals([0.7201]), SCHEDULE_448)
    assert (alone.reached, alone.evals, alone.samples) == (True, 1, 150_000)


def test_the_forecast_is_the_rows_formula_worked_out_by_hand():
    """Two evals, the second half way from 0.34 to 0.720 (logit 0): row 2's intercept + its schedule slope x
    ln(3,001,600), its residual quantiles -0.1206993 and +0.09447066 around it; typed here from the formula."""
    result = predict([(150_000, 0.40), (300_000, 0.53)], SCHEDULE_448)
    centre = 8.793835 + 0.392252 * math.log(3_001_600)
    assert (result.evals, result.reached) == (2, False)
    assert result.samples == pytest.approx(math.exp(centre), rel=1e-6)  # 2.29M
    assert (result.low, result.high) == pytest.approx((math.exp(centre - 0.1206993), math.exp(centre + 0.09447066)),
                                                      rel=1e-6)
    # One eval: row 1, progress 0.06 / 0.38 (logit ln 0.1875); the pace from run_start, 90 s for 150,000 samples.
    one = predict([(150_000, 0.40)], SCHEDULE_448, [90.0])
    samples = math.exp(8.342933 + 0.3931198 * math.log(3_001_600) - 0.2377062 * math.log(0.1875))  # 2.20M
    assert one.samples == pytest.approx(samples, rel=1e-6)
    assert one.seconds is not None and one.seconds[0] == pytest.approx(90.0 + (samples - 150_000) * 90.0 / 150_000)


def test_one_eval_just_short_of_the_target_ends_no_sooner_than_the_next_eval():
    """At 300,000 samples and 0.7195 (progress clipped to 0.995) the fit says 420,000 samples, before the next eval
    at 600,000 (one eval: the next is as far on as the first): the forecast and its interval are that eval."""
    result = predict([(300_000, 0.7195)], SCHEDULE_448)
    assert not result.reached and (result.samples, result.low, result.high) == (600_000, 600_000, 600_000)


def test_rows_and_schedule_range_at_their_edges():
    """Row k for k evals up to the last row, the last row after it; a schedule exactly a quarter past either end of
    the fitted range is still forecast, a sample further is not."""
    assert [row_for(k, ROWS).evals for k in (1, 11, 12, 13, 40)] == [1, 11, 12, 12, 12]
    low, high = SCHEDULE_RANGE
    assert outside_reason(low / 1.25) == outside_reason(high * 1.25) == ""
    assert outside_reason(low / 1.25 - 1) and outside_reason(high * 1.25 + 1)
    assert progress_logit(0.30) == progress_logit(0.34) == pytest.approx(math.log(0.005 / 0.995))
    assert progress_logit(0.75) == progress_logit(0.720) == pytest.approx(math.log(0.995 / 0.005))


@pytest.mark.parametrize("evals,seconds,message", [([], None, "at least one eval"),
                                                   (_evals([0.4]), [1.0, 2.0], "2 eval times for 1 evals")])
def test_bad_forecast_input_is_refused(evals, seconds, message):
    with pytest.raises(ValueError, match=message):
        predict(evals, SCHEDULE_448, seconds)


# ---------------------------------------------------------------------------------------------
# tools/forecast.py


def _running_log(source: Path, evals: int, target: Path) -> Path:
    """The log as it stood when its `evals`-th eval was written (no run_stop yet)."""
    lines, seen = [], 0
    for line in source.read_text(encoding="latin-1").splitlines(keepends=True):
        if seen == evals or '"key": "run_stop"' in line:
            break
        lines.append(line)
        seen += '"key": "eval_accuracy"' in line
    target.write_text("".join(lines))
    return target


def test_the_cli_forecasts_a_running_log_as_the_model_does(tmp_path, capsys):
    running = _running_log(NVIDIA_448, 3, tmp_path / "result_0.txt")
    records = [json.loads(line.split(":::MLLOG ", 1)[1]) for line in NVIDIA_448.read_text().splitlines()
               if ":::MLLOG " in line]
    start = next(r["time_ms"] for r in records if r["key"] == "run_start")
    evals = [r for r in records if r["key"] == "eval_accuracy"][:3]
    expected = predict([(r["metadata"]["epoch_num"], r["value"]) for r in evals], SCHEDULE_448,
                       [(r["time_ms"] - start) / 1000 for r in evals])
    assert forecast_cli.main([str(running)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{running}: forecast: {expected.line()}"
    assert out[1].startswith("RCP: ") and "GBS 448 has its own RCP" in out[1]
    assert len(out) == 2  # a running log has no real end to show
    # the finished log replayed from its first 3 evals says the same, then its real end
    assert forecast_cli.main([str(NVIDIA_448), "--evals", "3"]) == 0
    replay = capsys.readouterr().out.splitlines()
    assert replay[0].split(": ", 1)[1] == out[0].split(": ", 1)[1]
    assert replay[2] == "real end: 2.70M samples, 18.8 min after run_start"


def test_the_cli_on_a_log_that_went_on_past_the_target_names_the_first_eval_there(tmp_path, capsys):
    """NVIDIA's run reached 0.7200 at its eval at 2,703,232 samples; two more evals and no run_stop after it
    (3.00M samples at the last) do not move the point it reached the target."""
    lines = NVIDIA_448.read_text().splitlines(keepends=True)
    last_eval = max(i for i, line in enumerate(lines) if '"key": "eval_accuracy"' in line)
    more = [f':::MLLOG {{"namespace": "", "time_ms": {ms}, "event_type": "POINT_IN_TIME", "key": "eval_accuracy", '
            f'"value": {value}, "metadata": {{"epoch_num": {samples}}}}}\n'
            for ms, value, samples in ((1653327388000, 0.7204, 2_852_864), (1653327450000, 0.7230, 3_002_496))]
    log = tmp_path / "result_0.txt"
    log.write_text("".join(lines[:last_eval + 1] + more))
    assert forecast_cli.main([str(log)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{log}: forecast: 0.720 reached at 2.70M samples", out


def _forecast(low: float, high: float) -> Forecast:
    return Forecast(3, (low + high) / 2, low, high, False)


def test_the_rcp_outlook_agrees_with_the_official_checker(tmp_path):
    window = rcp_window(768, "5.0.0")
    bound = math.ceil(window.min_mean or 0)
    inside = forecast_cli.rcp_outlook(_forecast(bound, bound + 300_000), window)
    below = forecast_cli.rcp_outlook(_forecast(bound - 300_000, bound - 1), window)
    straddling = forecast_cli.rcp_outlook(_forecast(bound - 1, bound + 1), window)
    assert (inside.status, below.status, straddling.status) == (forecast_cli.INSIDE, forecast_cli.BELOW,
                                                                forecast_cli.UNCERTAIN)
    # a result whose runs all land at the interval's low end (inside) or high end (below)
    assert official_verdict(synthetic_result(tmp_path / "inside" / "bert", bound))[0] is True
    assert official_verdict(synthetic_result(tmp_path / "below" / "bert", bound - 1))[0] is False


def test_the_rcp_outlook_at_exactly_the_bound():
    """The interval's low end exactly at the minimum acceptable olympic mean passes (the checker's `>=`); its high end
    exactly there is uncertain, one step under it below; a window above every RCP, or a schedule the published runs
    do not cover, has no outlook."""
    window = rcp_window(768, "5.0.0")
    bound = window.min_mean or 0.0
    assert bound % 1 != 0  # a float bound: `ceil` or `round` in the comparison would show
    status = {name: forecast_cli.rcp_outlook(forecast, window).status for name, forecast in {
        "low at it": _forecast(bound, bound + 300_000), "high at it": _forecast(bound - 300_000, bound),
        "high under it": _forecast(bound - 300_000, math.nextafter(bound, 0.0))}.items()}
    assert status == {"low at it": forecast_cli.INSIDE, "high at it": forecast_cli.UNCERTAIN,
                      "high under it": forecast_cli.BELOW}
    above = rcp_window(32768, "5.0.0")
    assert forecast_cli.rcp_outlook(_forecast(bound, bound), above).status == forecast_cli.NO_WINDOW
    outside = Forecast(2, math.nan, math.nan, math.nan, False, None, "the LR schedule spans 64,000 samples")
    assert forecast_cli.rcp_outlook(outside, window).status == forecast_cli.NO_WINDOW


def _log(path: Path, accuracies: list[float], gbs: object = 448, steps: object = 6700) -> Path:
    """A run log: run_start at 0 s, an eval every 150,000 samples a minute apart from 90 s, no run_stop."""
    lines = [mllog_line("submission_benchmark", "bert", 0), mllog_line("global_batch_size", gbs, 0),
             mllog_line("opt_learning_rate_training_steps", steps, 0), mllog_line("run_start", None, 0)]
    lines += [mllog_line("eval_accuracy", accuracy, 90_000 + 60_000 * i, epoch_num=150_000 * (i + 1))
              for i, accuracy in enumerate(accuracies)]
    path.write_text("".join(lines))
    return path


def test_the_first_eval_exactly_at_0720_is_where_the_cli_says_the_run_converged(tmp_path, capsys):
    """Evals 0.40, 0.65, exactly 0.720, 0.7195 and 0.7230: converged at the third (450,000 samples), as the log
    replayed from its first 3 (all the evals the forecast reads) and from all 5 says."""
    log = _log(tmp_path / "result_0.txt", [0.40, 0.65, 0.720, 0.7195, 0.7230])
    run = forecast_cli.read_log(log)
    for count in (3, 5, None):
        forecast = forecast_cli.forecast_run(run, count)
        assert (forecast.reached, forecast.evals, forecast.samples, forecast.seconds) == (
            True, 3, 450_000, (210.0, 210.0, 210.0)), count
    assert forecast_cli.main([str(log), "--evals", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{log}: forecast: 0.720 reached at 450,000 samples" and len(out) == 2  # no real end: all evals
    assert forecast_cli.main([str(log), "--evals", "4"]) == 0
    assert capsys.readouterr().out.splitlines()[2] == "real end: status still running after 750,000 samples"


def test_the_cli_forecasts_from_the_first_k_evals_and_their_times(tmp_path):
    """--evals 2 of 4: the model on the first two evals and their seconds after run_start (90 and 150 s), the LR
    schedule 4,000 steps x 768 samples."""
    run = forecast_cli.read_log(_log(tmp_path / "result_0.txt", [0.375, 0.40, 0.48, 0.63], 768, 4000))
    assert forecast_cli.schedule_samples(run) == 3_072_000
    assert forecast_cli.forecast_run(run, 2) == predict(_evals([0.375, 0.40]), 3_072_000, [90.0, 150.0])
    with pytest.raises(forecast_cli.ForecastError, match="--evals 5: .* has only 4 evals"):
        forecast_cli.forecast_run(run, 5)


@pytest.mark.parametrize("gbs,steps,message", [(True, 6700, "no positive global_batch_size in the log (found True)"),
                                               (448, 0, "no positive opt_learning_rate_training_steps in the log "
                                                        "(found 0)"),
                                               ("448", 6700, "no positive global_batch_size in the log (found '448')")])
def test_a_schedule_the_log_gives_in_the_wrong_form_is_refused(tmp_path, capsys, gbs, steps, message):
    log = _log(tmp_path / "result_0.txt", [0.40, 0.45], gbs, steps)
    assert forecast_cli.main([str(log)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("text,message", [
    ("", "not an MLPerf run log"),
    (':::MLLOG {"key": "submission_benchmark", "value": "bert", "time_ms": 0}\n', "no eval_accuracy line yet"),
    (':::MLLOG {"key": "submission_benchmark", "value": "bert", "time_ms": 0}\n'
     ':::MLLOG {"key": "eval_accuracy", "value": 0.4, "time_ms": 5, "metadata": {"epoch_num": 150000}}\n',
     "no positive opt_learning_rate_training_steps in the log")])
def test_cli_errors_are_one_line_and_exit_2(tmp_path, capsys, text, message):
    log = tmp_path / "result_0.txt"
    log.write_text(text)
    assert forecast_cli.main([str(log)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1, err


def test_the_script_runs_from_the_command_line():
    done = subprocess.run([sys.executable, str(REPO / "tools" / "forecast.py"), str(NVIDIA_448), "--evals", "2"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0 and ": forecast: 0.720 at " in done.stdout and ", from 2 evals\n" in done.stdout, \
        done.stderr


# ---------------------------------------------------------------------------------------------
# The live view and the summary


class Clock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


ACCURACIES = [0.375, 0.40, 0.48, 0.63]


def _start(tmp_path: Path) -> RunStart:
    return RunStart(samples=0, step=0, stop_samples=4_500_000, global_batch_size=448, output_dir=tmp_path,
                    schedule_samples=SCHEDULE_448)


def test_the_live_view_prints_the_forecast_after_every_eval(tmp_path):
    clock, stream = Clock(), io.StringIO()
    view = LiveView(stream=stream, interactive=False, clock=clock)
    view.run_start(_start(tmp_path))
    evals = _evals(ACCURACIES)
    for i, (samples, accuracy) in enumerate(evals):
        clock.now += 60.0
        view.eval_end(EvalEnd(step=i + 1, samples=int(samples), accuracy=accuracy, loss=2.0, seconds=5.0))
    view.close()
    lines = [line for line in stream.getvalue().splitlines() if "forecast" in line]
    seconds = [60.0 * (i + 1) for i in range(len(evals))]
    assert lines == [f"forecast: {predict(evals[:k], SCHEDULE_448, seconds[:k]).line()}"
                     for k in range(1, len(evals) + 1)]
    assert (tmp_path / "train.log").read_text().count("forecast: 0.720 at ") == len(evals)


@pytest.mark.parametrize("resumed,schedule", [(True, SCHEDULE_448), (False, 64_000)])
def test_a_resumed_run_or_an_uncovered_schedule_gets_no_forecast_line(tmp_path, resumed, schedule):
    stream = io.StringIO()
    view = LiveView(stream=stream, interactive=False, clock=Clock())
    view.run_start(RunStart(samples=0, step=0, stop_samples=4_500_000, global_batch_size=448, output_dir=tmp_path,
                            resumed=resumed, schedule_samples=schedule))
    view.eval_end(EvalEnd(step=1, samples=150_000, accuracy=0.4, loss=2.0, seconds=5.0))
    view.close()
    assert "forecast" not in stream.getvalue() and "eval 1 step 1" in stream.getvalue()


def test_the_summary_sets_the_early_forecast_beside_the_end(tmp_path):
    report = RunReport(stream=io.StringIO())
    report.run_start(_start(tmp_path))
    evals = _evals(ACCURACIES)
    for i, (samples, accuracy) in enumerate(evals):
        report.eval_end(EvalEnd(step=i + 1, samples=int(samples), accuracy=accuracy, loss=2.0, seconds=5.0))
    report.run_end(RunEnd("aborted", 4, 600_000, 300.0, reason="limit"))
    summary = (tmp_path / "summary.txt").read_text()
    early = predict(evals[:3], SCHEDULE_448).line()
    latest = predict(evals, SCHEDULE_448).line()
    assert f"forecast: {early}; now {latest}\n" in summary
