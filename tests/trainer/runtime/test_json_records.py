"""JSON records a command reads, edited by hand into valid JSON of another shape (`[]`, a table turned into a list):
one line naming the file and the fix, no traceback. The trainer's VERIFIED.json: tests/trainer/input/test_unverified_data.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from data_prep import make_demo_data
from data_prep.fileio import DataPrepError, read_json_object
from mlperf_bert.data.lengths import load_length_histogram
from mlperf_bert.runtime.files import json_object
from mlperf_tools.bring_up import gpu_perf_report
from mlperf_tools.planning import simulate_balance
from mlperf_tools.results import compare, package_results
from tests.harness.paths import MLPERF_LOGS

NVIDIA = MLPERF_LOGS / "v2.0" / "NVIDIA"
SYSTEM = "dgxa100_ngc22.04_pytorch"


@pytest.fixture
def listed(tmp_path: Path) -> Path:
    path = tmp_path / "record.json"
    path.write_text("[]\n")
    return path


def test_a_json_object_is_read_and_anything_else_named(tmp_path: Path, listed: Path) -> None:
    (tmp_path / "ok.json").write_text('{"a": 1}')
    (tmp_path / "cut.json").write_text('{"a": ')
    assert json_object(tmp_path / "ok.json") == {"a": 1}
    with pytest.raises(ValueError, match=rf"^{listed}: a JSON list, not an object$"):
        json_object(listed)
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'cut.json'}: not JSON \("):
        json_object(tmp_path / "cut.json")


def test_a_system_description_that_is_a_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """compare.py and package_results.py on a package whose systems/<system>.json is `[]`."""
    package = tmp_path / "NVIDIA"
    shutil.copytree(NVIDIA / "results", package / "results")
    (package / "systems").mkdir()
    (package / "systems" / f"{SYSTEM}.json").write_text("[]")
    with pytest.raises(SystemExit) as stop:
        compare.main([str(package)])
    assert str(stop.value) == (f"compare.py: {package}/systems/{SYSTEM}.json: a JSON list, not an object: a system "
                               "description is a JSON object (MLPerf's systems/*.json)")
    with pytest.raises(package_results.PackageError, match=rf"systems/{SYSTEM}.json: a JSON list, not an object: "):
        package_results._division(package, SYSTEM)


@pytest.mark.parametrize("text", ["[]", '{"factor": 2}', '{"scaling_factor": [2]}'])
def test_a_scaling_file_without_its_number(tmp_path: Path, text: str) -> None:
    (tmp_path / "scaling.json").write_text(text)
    with pytest.raises(package_results.PackageError, match=r"scaling.json: no number under \"scaling_factor\""):
        package_results._scaling_factor(tmp_path)


def test_a_benchmark_file_that_is_a_list(listed: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """gpu_perf_report.py bench, as tools/gpu_perf.sh starts it on each step's throughput.json."""
    assert gpu_perf_report.main(["bench", str(listed)]) == 1
    assert capsys.readouterr().err.strip() == f"gpu_perf_report.py bench: {listed}: a JSON list, not an object"


def test_a_length_histogram_that_is_a_list(listed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """simulate_balance.py --histogram and make_demo_data.py --histogram."""
    with pytest.raises(ValueError, match="expected a JSON object with a non-empty list 'counts'"):
        load_length_histogram(listed)
    with pytest.raises(SystemExit, match=rf"^simulate_balance.py: --histogram: {listed}: expected a JSON object"):
        simulate_balance.main(["--gpus", "8", "--gpus-per-node", "8", "--local-batch", "16", "--histogram",
                               str(listed)])
    with pytest.raises(SystemExit) as stop:
        make_demo_data.main(["--output_dir", str(tmp_path / "demo"), "--histogram", str(listed)])
    [line] = capsys.readouterr().err.strip().splitlines()[-1:]
    assert stop.value.code == 2 and f": error: --histogram {listed}: not a length histogram (TypeError: " in line
    assert not (tmp_path / "demo").exists()


def test_a_data_prep_record_that_is_a_list(listed: Path) -> None:
    """strata.json and packing_report.json, read by stratify, pack and verify_dataset."""
    with pytest.raises(DataPrepError, match=rf"^{listed}: a JSON list, not the object data_prep writes; delete it"):
        read_json_object(listed)
    listed.write_text(json.dumps({"bounds": [128]}))
    assert read_json_object(listed) == {"bounds": [128]}
