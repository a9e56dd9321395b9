"""tools/compare.py against published vendor logs and the official MLPerf tools."""

from __future__ import annotations

import glob
import json
import math
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

from mlperf_tools.results import compare
from tests.harness.paths import MLPERF_LOGS


PACKAGES = [("v2.0/NVIDIA", "2.0.0"), ("v2.0/Baidu", "2.0.0"), ("v4.0/NVIDIA", "4.0.0")]


def _copy(package: str, tmp_path: Path) -> Path:
    """The official tools may write scaling.json into a package, so they get a copy."""
    target = tmp_path / package.replace("/", "_")
    shutil.copytree(MLPERF_LOGS / package, target)
    return target


def _only_row(folder: Path) -> compare.SystemSummary:
    systems = compare.discover(folder)
    assert len(systems) == 1
    return compare.summarize(systems[0])


@pytest.mark.parametrize("package,ruleset", PACKAGES)
def test_olympic_time_matches_the_official_result_summarizer(package, ruleset, tmp_path):
    from mlperf_logging.result_summarizer.result_summarizer import summarize_results

    folder = _copy(package, tmp_path)
    strong, *_ = summarize_results(str(folder), "training", ruleset)
    assert len(strong) == 1
    assert _only_row(folder).olympic_minutes == pytest.approx(float(strong["bert"].iloc[0]), abs=1e-9)


def test_published_scores_and_convergence_counts():
    """The olympic times REFERENCE.md quotes, and Baidu's one run that did not converge."""
    nvidia_a100 = _only_row(MLPERF_LOGS / "v2.0/NVIDIA")
    baidu = _only_row(MLPERF_LOGS / "v2.0/Baidu")
    nvidia_h200 = _only_row(MLPERF_LOGS / "v4.0/NVIDIA")
    assert round(nvidia_a100.olympic_minutes, 3) == 18.442
    assert round(baidu.olympic_minutes, 2) == 16.60
    assert round(nvidia_h200.olympic_minutes, 2) == 5.21
    assert (nvidia_a100.runs, nvidia_a100.converged) == (10, 10)
    assert (baidu.runs, baidu.converged) == (10, 9)
    assert nvidia_a100.global_batch_size == "448" and nvidia_h200.global_batch_size == "768"


@pytest.mark.parametrize("package,ruleset", PACKAGES)
def test_samples_to_converge_match_the_rcp_checker(package, ruleset):
    from mlperf_logging.rcp_checker.rcp_checker import read_submission_file

    for system in compare.discover(MLPERF_LOGS / package):
        for run in system.runs:
            # Logs whose epoch_num is not a sample count are read by train_samples (RCP option).
            _, expected, _, _ = read_submission_file(str(run.path), ruleset, run.samples_reconstructed)
            ours = run.samples_to_converge
            assert (ours if ours is not None else 1e9) == expected, run.path


def test_reconstructed_eval_samples_reproduce_logged_train_samples():
    """Baidu logs epoch_num = 1 at every eval; the eval-interval formula must land on the
    train_samples each run logged at its end."""
    runs = compare.discover(MLPERF_LOGS / "v2.0/Baidu")[0].runs
    assert all(run.samples_reconstructed for run in runs)
    assert [run.evals[-1][0] for run in runs] == [float(run.values["train_samples"]) for run in runs]
    first = runs[0].evals
    assert [s for s, _ in first[:3]] == [150_080.0, 300_160.0, 450_240.0]  # ceil(k*150000/448)*448


@pytest.mark.parametrize("gbs,interval", [(256, 150_000), (448, 150_000), (2048, 150_000),
                                          (3072, 175_000), (4096, 175_000), (8192, 225_000),
                                          (16384, 325_000)])
def test_eval_interval_formula(gbs, interval):
    assert compare.eval_interval(gbs) == interval


def test_throughput_per_accelerator_matches_published_anchors():
    """REFERENCE.md: A100 ~300 sequences/s per GPU (v2.0), H200 ~1,000 including eval (v4.0)."""
    a100 = _only_row(MLPERF_LOGS / "v2.0/NVIDIA")
    h200 = _only_row(MLPERF_LOGS / "v4.0/NVIDIA")
    assert a100.accelerators == 8 and h200.accelerators == 8
    assert 280 < a100.samples_per_s_per_accelerator < 320
    assert 950 < h200.samples_per_s_per_accelerator < 1050


def test_olympic_mean_drops_fastest_and_slowest():
    assert compare.olympic_mean([5.0, 1.0, 3.0, 4.0, 100.0]) == pytest.approx(4.0)
    assert compare.olympic_mean([2.0, 4.0, 3.0, math.inf]) == pytest.approx(3.5)
    assert compare.olympic_mean([2.0, 4.0, math.inf, math.inf]) is None
    assert compare.olympic_mean([2.0, 4.0]) == pytest.approx(3.0)


def test_plain_folder_of_logs_gives_the_same_numbers(tmp_path):
    source = sorted((MLPERF_LOGS / "v2.0/NVIDIA").glob("results/*/bert/result_*.txt"))
    for index, path in enumerate(source):
        shutil.copyfile(path, tmp_path / f"261121_{index + 1}.log")
    (tmp_path / "261121_1.compliance.txt").write_text("INFO - Running compliance on file\n")
    row = _only_row(tmp_path)
    assert row.runs == 10
    assert row.olympic_minutes == pytest.approx(_only_row(MLPERF_LOGS / "v2.0/NVIDIA").olympic_minutes)
    assert row.accelerators is None and row.samples_per_s_per_accelerator is None
    with (tmp_path / "261121_1.log").open("a") as log:
        log.write(':::SYSJSON {"number_of_nodes": "1", "accelerators_per_node": "8"}\n')
    assert _only_row(tmp_path).accelerators == 8


def test_folder_without_logs_is_a_clear_error(tmp_path):
    (tmp_path / "notes.txt").write_text("no logs here\n")
    with pytest.raises(SystemExit, match="no MLPerf BERT logs"):
        compare.discover(tmp_path)


def test_report_and_plots(tmp_path, capsys):
    from matplotlib import image

    out = tmp_path / "report"
    assert compare.main([str(MLPERF_LOGS / "v2.0/NVIDIA"), str(MLPERF_LOGS / "v2.0/Baidu"), "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert report == capsys.readouterr().out
    table = [line for line in report.splitlines() if line.startswith("| ")]
    assert len(table) == 3  # header and one row per system
    assert "| 10 (9) |" in table[2] and "| 18.442 |" in table[1]
    for name in ("accuracy.png", "time_to_train.png"):
        pixels = image.imread(out / name)
        assert pixels.shape[0] > 400 and pixels.shape[1] > 800
        assert pixels[..., :3].std() > 0.05  # something was drawn


def test_plots_with_a_matplotlib_that_fails_to_import_are_refused_before_the_logs(tmp_path, monkeypatch):
    """An installed matplotlib whose pyplot does not import: said as that (it was "plots need matplotlib (pip install
    matplotlib)" for any import failure), before any log is read or folder made."""
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    monkeypatch.setattr(compare, "discover", lambda folder: pytest.fail("read the logs first"))
    with pytest.raises(SystemExit) as stop:
        compare.main([str(MLPERF_LOGS / "v2.0/NVIDIA"), "--out", str(tmp_path / "report")])
    assert str(stop.value).startswith("compare.py: compare.py --out (its PNG plots) needs matplotlib, which is "
                                      "installed but fails to import (ModuleNotFoundError: "), stop.value
    assert str(stop.value).endswith("or pass --no-plots") and not (tmp_path / "report").exists()


def test_samsung_open_division_1024_gpus(tmp_path):
    # 9 MB of 1024-rank logs, kept compressed (190 kB) in the repository.
    with tarfile.open(MLPERF_LOGS / "v2.0" / "Samsung.tar.gz") as archive:
        archive.extractall(tmp_path, filter="data")
    row = _only_row(tmp_path / "Samsung")
    assert (row.division, row.accelerators, row.global_batch_size) == ("open", 1024, "16384")
    assert (row.runs, row.converged) == (10, 10)
    files = glob.glob(str(tmp_path / "Samsung/results/*/bert/result_*.txt"))
    assert row.samples_min == row.samples_max == 2_932_736 and len(files) == 10


def test_archive_is_read_directly_and_its_unpacked_copy_removed(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(compare.tempfile, "tempdir", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    assert compare.main([str(MLPERF_LOGS / "v2.0" / "Samsung.tar.gz"), "--out", str(tmp_path / "out")]) == 0
    table = capsys.readouterr().out
    assert "| Samsung/samsung_supercomputer21_dgxa100_n128_pytorch | open | 1024 | 16384 | 10 (10) |" in table
    assert "2.933M" in table
    assert list((tmp_path / "scratch").iterdir()) == []
    assert (tmp_path / "out" / "accuracy.png").stat().st_size > 20_000


def test_broken_archive_is_a_clear_error(tmp_path):
    bad = tmp_path / "logs.tar.gz"
    bad.write_bytes(b"not an archive")
    with pytest.raises(SystemExit, match=f"cannot unpack {bad}"):
        compare.main([str(bad), "--no-plots"])


def _small_run(path: Path, evals: list[tuple[int, float]]) -> None:
    records = [{"key": "submission_benchmark", "value": "bert", "event_type": "POINT_IN_TIME", "time_ms": 0},
               {"key": "global_batch_size", "value": 32, "event_type": "POINT_IN_TIME", "time_ms": 0},
               {"key": "run_start", "event_type": "INTERVAL_START", "time_ms": 1000}]
    records += [{"key": "eval_accuracy", "value": acc, "event_type": "POINT_IN_TIME", "time_ms": 2000,
                 "metadata": {"epoch_num": samples}} for samples, acc in evals]
    records.append({"key": "run_stop", "event_type": "INTERVAL_END", "time_ms": 9000,
                    "metadata": {"status": "aborted"}})
    path.write_text("".join(f":::MLLOG {json.dumps(r)}\n" for r in records))


def test_small_cpu_runs_get_a_samples_axis_of_their_size(tmp_path):
    """A few hundred samples: the x axis counts samples (not millions, where they sat at 0)."""
    logs = tmp_path / "cpu"
    logs.mkdir()
    _small_run(logs / "run_1.log", [(96, 0.2), (192, 0.41), (288, 0.55)])
    _small_run(logs / "run_2.log", [(96, 0.25), (192, 0.43)])
    systems = compare.discover(logs)
    rows = [compare.summarize(s) for s in systems]
    plt = compare._pyplot()
    fig, ax = plt.subplots()
    compare._draw_curves(ax, systems, rows)
    assert ax.get_xlabel() == "training samples"
    assert ax.get_xlim() == pytest.approx((0, 288 * 1.03))
    plt.close(fig)
    assert "0.5500 @ 288" in compare.markdown_curves(rows)
    assert compare._zoom_limits(rows)[0] == pytest.approx(0.54)


@pytest.mark.parametrize("largest,expected", [
    (500, (1.0, "")), (50_000, (1e3, " (thousands)")), (2_932_736, (1e6, " (millions)"))])
def test_samples_scale(largest, expected):
    assert compare.samples_scale(largest) == expected
