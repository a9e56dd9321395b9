"""The live view and the end-of-run report, fed events as the training loop sends them."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mlperf_bert.train.faults import Verdict
from mlperf_bert.hooks.events import BlockEnd, EvalEnd, RunEnd, RunStart, StepEnd
from mlperf_bert.hooks.live import LiveView
from mlperf_bert.hooks.report import RunReport, plot_curves
from tests.harness.paths import REPO


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _step(step: int, samples: int, next_eval: int, loss: float = 2.5, tokens: int = 100) -> StepEnd:
    return StepEnd(step=step, samples=samples, loss=torch.tensor(loss), learning_rate=1e-3,
                   tokens=tokens, skipped_steps=0, next_eval_samples=next_eval, verdict=Verdict(loss=loss))


def _view(tmp_path: Path, samples: int = 0, resumed: bool = False, **kwargs):
    clock, stream = Clock(), io.StringIO()
    view = LiveView(log_every=2, stream=stream, interactive=False, clock=clock, **kwargs)
    view.run_start(RunStart(samples=samples, step=samples // 8, stop_samples=160, global_batch_size=8,
                            output_dir=tmp_path, resumed=resumed))
    return view, clock, stream


def _rate(line: str) -> float:
    return float(re.search(r"samples/s (\S+)", line).group(1))


def test_rate_counts_training_steps_only_and_restarts_after_an_eval(tmp_path):
    view, clock, stream = _view(tmp_path)
    for step in (1, 2):  # 8 samples per second of training
        clock.now += 1.0
        view.step_end(_step(step, 8 * step, next_eval=16))
    view.block_end(BlockEnd(step=2, samples=16))
    clock.now += 50.0  # a long eval
    view.eval_end(EvalEnd(step=2, samples=16, accuracy=0.36, loss=4.0, seconds=50.0))
    for step in (3, 4):  # 16 samples per second now
        clock.now += 0.5
        view.step_end(_step(step, 8 * step, next_eval=64))
    lines = [line for line in stream.getvalue().splitlines() if line.startswith("step ")]
    assert [_rate(line) for line in lines] == [8.0, 16.0]
    # 32 samples to the next eval at 16 samples/s, and the history with % of target.
    assert "eta_eval 0:00:02" in lines[1]
    assert "evals 0.360 (50.0% of target)" in lines[1]
    assert "tokens/s 200" in lines[1]  # 100 tokens a step, 2 steps a second
    view.close()


def test_first_rate_after_a_resume_counts_only_the_new_samples(tmp_path):
    view, clock, stream = _view(tmp_path, samples=800, resumed=True)
    clock.now += 2.0
    view.step_end(_step(101, 808, next_eval=900))
    clock.now += 2.0
    view.step_end(_step(102, 816, next_eval=900))
    line = stream.getvalue().splitlines()[-1]
    assert _rate(line) == 4.0  # 16 samples in 4 s, not 816 in 4 s
    assert "resumed at step 100 samples 800" in stream.getvalue()
    view.close()


def test_no_rate_before_time_passes_is_shown_as_unknown(tmp_path):
    view, clock, stream = _view(tmp_path)
    view.step_end(_step(2, 16, next_eval=32))
    line = stream.getvalue().splitlines()[-1]
    assert "samples/s nan" in line and "eta_eval ?" in line
    view.close()


def test_train_log_has_one_line_per_interval_and_per_eval(tmp_path):
    view, clock, stream = _view(tmp_path)
    for step in range(1, 5):
        clock.now += 1.0
        view.step_end(_step(step, 8 * step, next_eval=40))
    clock.now += 1.0
    view.step_end(_step(5, 40, next_eval=40))  # the eval step is logged although 5 % 2 != 0
    view.block_end(BlockEnd(step=5, samples=40))
    view.eval_end(EvalEnd(step=5, samples=40, accuracy=0.72, loss=1.5, seconds=3.0))
    # Read before close: the log is flushed line by line.
    lines = (tmp_path / "train.log").read_text().splitlines()
    kinds = [line.split(" ", 2)[1] for line in lines]
    assert kinds == ["run", "step", "step", "step", "eval"]
    assert "mlm_accuracy 0.7200 (100.0% of target 0.720)" in lines[-1]
    view.run_end(RunEnd(status="success", step=5, samples=40, seconds=9.0))
    view.close()
    assert "run_stop status success" in (tmp_path / "train.log").read_text()


def test_progress_line_carries_skipped_steps_and_the_callers_fields_at_that_step(tmp_path):
    asked = []

    def load() -> str:
        asked.append(len(asked) + 1)
        return f"rank_tokens max {300 + len(asked)} min 200"

    view, clock, stream = _view(tmp_path, fields=load)
    for step in (1, 2, 3):
        clock.now += 1.0
        view.step_end(StepEnd(step=step, samples=8 * step, loss=torch.tensor(2.0), learning_rate=1e-3, tokens=100,
                              skipped_steps=step - 1, next_eval_samples=24, verdict=Verdict(loss=2.0)))
    lines = [line for line in stream.getvalue().splitlines() if line.startswith("step ")]
    assert asked == [1, 2]  # asked only when a line is written: step 2, and step 3 (the eval step)
    assert "skipped 1 " in lines[0] and "rank_tokens max 301 min 200" in lines[0]
    assert "skipped 2 " in lines[1] and "rank_tokens max 302 min 200" in lines[1]
    view.close()


def test_a_terminal_gets_a_bar_not_lines(tmp_path):
    clock, stream = Clock(), io.StringIO()
    view = LiveView(log_every=1, stream=stream, interactive=True, clock=clock)
    view.run_start(RunStart(samples=0, step=0, stop_samples=80, global_batch_size=8, output_dir=tmp_path))
    clock.now += 1.0
    view.step_end(_step(1, 8, next_eval=40))
    view.close()
    out = stream.getvalue()
    assert "\r" in out and "8.0 seq/s" in out and "8/80 seq" in out
    assert len(re.findall(r"seq/s", out.splitlines()[-1].split("\r")[-1])) == 1  # ours, not tqdm's
    assert not re.search(r"^step 1 ", out, re.M)
    assert "step 1 samples 8/80" in (tmp_path / "train.log").read_text()


def _run_report(tmp_path: Path, status: str = "success", curves: bool = True) -> tuple[RunReport, str]:
    stream = io.StringIO()
    report = RunReport(loss_every=1, mlperf_log=tmp_path / "logs" / "mlperf.log", stream=stream, curves=curves)
    (tmp_path / "logs").mkdir()
    report.run_start(RunStart(samples=0, step=0, stop_samples=4000, global_batch_size=8,
                              output_dir=tmp_path / "out"))
    evals = []
    for step in range(1, 501):
        report.step_end(_step(step, 8 * step, next_eval=8 * (step // 100 + 1) * 100, loss=8.0 / step ** 0.3))
        if step % 100 == 0:
            accuracy = 0.75 * (1 - 0.8 ** (step / 100))
            evals.append((8 * step, accuracy))
            report.eval_end(EvalEnd(step=step, samples=8 * step, accuracy=accuracy, loss=2.0, seconds=1.0))
    report.run_end(RunEnd(status=status, step=500, samples=4000, seconds=80.0, evals=tuple(evals),
                          reason="" if status == "success" else "limit"))
    return report, stream.getvalue()


def test_summary_is_printed_and_written(tmp_path):
    report, printed = _run_report(tmp_path, status="aborted")
    text = (tmp_path / "out" / "summary.txt").read_text()
    assert printed == text
    assert text.startswith("status: aborted (limit)\n")
    assert "time to train: 80.0 s" in text and "throughput: 50.0 samples/s" in text
    assert "5: samples 4000 mlm_accuracy 0.5042" in text
    assert f"curves: {tmp_path / 'logs' / 'curves.png'}" in text
    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert written["status"] == "aborted" and written["samples"] == 4000 and len(written["evals"]) == 5
    assert not list((tmp_path / "out").glob(".*tmp"))


@pytest.mark.parametrize("broken", ["not importable", "fails inside"])
def test_a_matplotlib_that_fails_at_the_end_leaves_the_summary_and_says_why(tmp_path, monkeypatch, broken):
    """--curves png and a matplotlib that no longer imports when the run is over (start-up checks only the
    package): the run ended in an ImportError traceback, exit 1, without summary.txt or summary.json."""
    if broken == "not importable":
        monkeypatch.setitem(sys.modules, "matplotlib", None)
    else:
        monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    _, printed = _run_report(tmp_path, curves=True)
    text = (tmp_path / "out" / "summary.txt").read_text()
    assert printed == text and not list(tmp_path.rglob("*.png"))
    [line] = [line for line in text.splitlines() if line.startswith("curves")]
    assert re.fullmatch(r"curves: none: matplotlib fails to import \(ModuleNotFoundError: import of matplotlib.* "
                        r"halted; None in sys.modules\); use --curves none "
                        r"\(CURVES=none\): the run then draws no curves.png", line), line
    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert "curves" not in written["files"] and written["no_curves"] == line.removeprefix("curves: none: ")


def test_without_curves_the_summary_names_no_picture(tmp_path):
    """--curves none: the summary alone, and no line or field pointing at a picture that is not there."""
    _, printed = _run_report(tmp_path, curves=False)
    assert not list(tmp_path.rglob("*.png"))
    assert printed.startswith("status: success\n") and "curves:" not in printed
    assert "curves" not in json.loads((tmp_path / "out" / "summary.json").read_text())["files"]


def _check_png(path: Path) -> None:
    assert path.stat().st_size > 20_000
    with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB"))
    assert pixels.shape[0] > 300 and pixels.shape[1] > 500
    colours = np.unique(pixels.reshape(-1, 3), axis=0)
    assert len(colours) > 50  # lines, text antialiasing, target line: not a blank canvas


def test_curves_png_is_a_real_picture_next_to_the_mlperf_log(tmp_path):
    _run_report(tmp_path)
    _check_png(tmp_path / "logs" / "curves.png")


@pytest.mark.parametrize("largest", [0, 96, 4_000_000])
def test_curves_for_runs_of_any_size(tmp_path, largest):
    """An empty run, a few CPU steps and a full run all give a readable picture."""
    points = [(int(largest * k / 4), 5.0 - k) for k in range(1, 5)] if largest else []
    evals = [(s, 0.2 * k) for k, (s, _) in enumerate(points)]
    plot_curves(points, evals, tmp_path / "c.png")
    _check_png(tmp_path / "c.png")


def test_replay_of_a_shipped_demo_run_writes_its_summary_and_curves(tmp_path):
    """The MLPerf log of a demo run in results/ and progress lines in the trainer's format."""
    from mlperf_tools.results.replay_run import main as replay_main

    from mlperf_tools.results.compare import read_run

    log = REPO / "results" / "CPU_1x2" / "261121070848_1001.log"
    run = read_run(log)
    progress = [f"step {k} samples {64 * k} samples/s 200.0 loss {6.0 - k / 30:.4f} lr 1.0e-02 skipped 0"
                for k in range(10, 130, 10)]
    progress += [f"eval samples {int(s)} mlm_accuracy {a:.4f} mlm_loss 1.0" for s, a in run.evals]
    in_order = sorted(progress, key=lambda line: int(re.search(r"samples (\d+)", line).group(1)))
    (tmp_path / "stderr.txt").write_text("\n".join(in_order) + "\n")
    assert replay_main(["--progress", str(tmp_path / "stderr.txt"), "--mlperf_log", str(log),
                        "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "summary.txt").read_text()
    seconds = (run.run_stop_ms - run.run_start_ms) / 1000
    assert text.startswith(f"status: success\ntime to train: {seconds:.1f} s")
    assert f"mlm_accuracy {run.evals[-1][1]:.4f}" in text and f"MLPerf log: {log}" in text
    assert "\nforecast: none (the LR schedule spans 64,000 samples" in text  # the demo's 1,000 steps of 64
    _check_png(tmp_path / "out" / "curves.png")
    assert (tmp_path / "out" / "curves.png").stat().st_mode & 0o044  # readable by others (umask 022)


def test_replay_without_progress_lines_names_the_file(tmp_path):
    from mlperf_tools.results.replay_run import main as replay_main

    log = REPO / "results" / "CPU_1x2" / "261121070848_1001.log"
    (tmp_path / "empty.txt").write_text("nothing here\n")
    with pytest.raises(SystemExit, match="no `step N samples S"):
        replay_main(["--progress", str(tmp_path / "empty.txt"), "--mlperf_log", str(log), "--out", str(tmp_path)])
