"""The fake CUDA device where torch is a CUDA build (a GPU machine's), and the dry run's graph counts on a GPU.

A CUDA build registers its own CUDA hooks and guard when `import torch` loads libtorch_cuda, after the
fake device: tests/harness/fakes/cuda_build/ makes this CPU-only torch do the same (sitecustomize.py loads
cuda_build.cpp as torch is imported, in every process the test starts).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from mlperf_bert.dryrun.native import build, build_dir
from mlperf_bert.dryrun.record import Recorder
from mlperf_bert.dryrun.run import cuda_calls
from mlperf_bert.dryrun.shipped import exports

from mlperf_tools.planning import plan
from tests.harness.paths import FAKES, REPO

CUDA_BUILD = FAKES / "cuda_build"


def _ordered(traced: Any) -> Any:
    """A trace with its op lists sorted: the order ops were first seen in is no answer of the planner's."""
    if isinstance(traced, dict):
        return {key: _ordered(value) for key, value in traced.items()}
    if isinstance(traced, list):
        return sorted((_ordered(item) for item in traced), key=json.dumps)
    return traced


def test_plan_traces_the_same_where_torch_registers_its_own_cuda_hooks(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU machine tools/plan.py once said "the dry run of config_DGXH200_1x8.sh failed: Key already
    registered with the same priority: CUDAHooks". With torch registering its own, the config is traced
    afresh (a plan cache of its own; the compiled fake device shared) to what a CPU-only torch traces."""
    config = REPO / "config_DGXH200_1x8.sh"
    envs = {config.name: exports(config)}
    expected = plan.traces(envs)
    library = build(CUDA_BUILD / "cuda_build.cpp")
    (tmp_path / "dryrun").symlink_to(build_dir(), target_is_directory=True)
    monkeypatch.setenv("MLPERF_BERT_BUILD_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_BUILD_LIBRARY", str(library))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(CUDA_BUILD), os.environ.get("PYTHONPATH", "")]))
    assert _ordered(plan.traces(envs)) == _ordered(expected)
    assert list((tmp_path / "plan").glob("*.json")), "the plan came from a cache, not from a trace"


class _GraphOfTheGpu:
    """torch.cuda.CUDAGraph's calls, on a machine that has none: what each did is written down."""

    def __init__(self, *_: Any, **__: Any) -> None:
        self.calls: list[str] = []

    def capture_begin(self, *_: Any, **__: Any) -> None:
        self.calls.append("capture_begin")

    def capture_end(self) -> None:
        self.calls.append("capture_end")

    def replay(self) -> None:
        self.calls.append("replay")


@pytest.fixture
def gpu_graph(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _GraphOfTheGpu)
    yield


def test_real_gpu_dry_run_counts_its_graphs_captures_and_replays(gpu_graph: None) -> None:
    """`--real` once reported "0 capture(s), 0 replay(s)" for a graphed config: only the fake device's
    stand-in counted. The real graph is counted the same way, and still does its own work."""
    recorder = Recorder(fake=False)
    with cuda_calls(recorder, fake=False) as log:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin()
        graph.capture_end()
        for phase in ("step 1", "step 2", "eval"):
            recorder.phase = phase
            graph.replay()
    assert (log.captures, log.replays, dict(log.phase_replays)) == (1, 3, {"step 1": 1, "step 2": 1, "eval": 1})
    assert graph.calls == ["capture_begin", "capture_end", "replay", "replay", "replay"]
    assert torch.cuda.CUDAGraph is _GraphOfTheGpu  # put back
