"""The suite's own set-up: under pytest-xdist the workers build the shared demo dataset once."""

from __future__ import annotations

from pathlib import Path

from tests.harness.shared_folder import shared_by_workers


class _WorkerTemp:
    """A worker's tmp_path_factory: its own folder under the run's common one."""

    def __init__(self, run: Path, worker: str) -> None:
        self.base = run / f"popen-{worker}"
        self.base.mkdir(parents=True, exist_ok=True)

    def getbasetemp(self) -> Path:
        return self.base

    def mktemp(self, name: str) -> Path:
        raise AssertionError("a worker must not make its own copy")


def test_workers_build_the_shared_folder_once_and_all_use_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    built: list[Path] = []

    def make(folder: Path) -> Path:
        built.append(folder)
        (folder / "shard").write_text("rows")
        return folder

    first = shared_by_workers(_WorkerTemp(tmp_path, "gw0"), "demo", make)  # type: ignore[arg-type]
    second = shared_by_workers(_WorkerTemp(tmp_path, "gw1"), "demo", make)  # type: ignore[arg-type]
    assert first == second == tmp_path / "demo" and built == [first]
    assert (second / "shard").read_text() == "rows"


def test_a_build_that_failed_half_way_is_made_again(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "partial").write_text("half")  # no demo.done: the worker that built it died

    folder = shared_by_workers(_WorkerTemp(tmp_path, "gw0"), "demo", lambda f: f)  # type: ignore[arg-type]
    assert folder.is_dir() and not (folder / "partial").exists()
