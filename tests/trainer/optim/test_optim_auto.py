"""--optimizer_impl auto: apex's fused optimizers for eager steps on a GPU where apex imports, never
for a step captured in a CUDA graph nor for CPU tensors (apex is faked: it needs CUDA to build; the
parameters pass for CUDA ones through `optimizers._on_gpu`)."""

from __future__ import annotations

import pytest
import torch

from mlperf_bert.optim import optimizers
from mlperf_bert.optim.capturable import capturable
from mlperf_bert.optim.optimizers import ForeachAdamW, ForeachLamb, apex_available, build_optimizer
from tests.harness.fakes import apex as fake_apex

ARGS = (1e-3, (0.9, 0.999), 1e-6, 0.01, 1.0)


def params() -> list[torch.nn.Parameter]:
    return list(torch.nn.Linear(4, 3).parameters())


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parameters count as CUDA tensors (apex's kernels take nothing else)."""
    monkeypatch.setattr(optimizers, "_on_gpu", lambda params: True)


def test_on_the_cpu_auto_never_picks_apex_and_apex_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_apex.install(monkeypatch)
    assert type(build_optimizer(params(), "lamb", *ARGS)) is ForeachLamb
    with pytest.raises(ValueError, match="^--optimizer_impl apex runs apex's CUDA kernels, and this run is on the CPU: "
                                         "use --optimizer_impl foreach or auto$"):
        build_optimizer(params(), "lamb", *ARGS, implementation="apex")


def test_auto_picks_apex_lamb_for_eager_steps(gpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_apex.install(monkeypatch)
    assert apex_available()
    chosen = build_optimizer(params(), "lamb", *ARGS)
    assert type(chosen) is fake_apex.FusedLAMB
    assert chosen.kwargs["max_grad_norm"] == 1.0 and chosen.kwargs["use_nvlamb"] is False


def test_auto_adam_takes_apex_only_without_global_clipping(gpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_apex.install(monkeypatch)
    assert type(build_optimizer(params(), "adam", *ARGS)) is ForeachAdamW
    assert type(build_optimizer(params(), "adam", *ARGS[:-1], None)) is fake_apex.FusedAdam


@pytest.mark.parametrize("name, expected", [("lamb", ForeachLamb), ("adam", ForeachAdamW)])
def test_auto_under_cuda_graphs_never_picks_apex(gpu: None, monkeypatch: pytest.MonkeyPatch, name: str,
                                                 expected: type) -> None:
    fake_apex.install(monkeypatch)
    for clip in (1.0, None):
        chosen = build_optimizer(params(), name, *ARGS[:-1], clip, cuda_graphs=True)
        assert type(chosen) is expected
        capturable(chosen)  # what --cuda_graphs does with it: accepted


def test_explicit_apex_under_cuda_graphs_is_refused(gpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_apex.install(monkeypatch)
    with pytest.raises(ValueError, match="--optimizer_impl apex cannot run inside a CUDA graph"):
        build_optimizer(params(), "lamb", *ARGS, implementation="apex", cuda_graphs=True)


def test_without_apex_auto_is_foreach_either_way() -> None:
    assert not apex_available()
    for graphs in (False, True):
        assert type(build_optimizer(params(), "lamb", *ARGS, cuda_graphs=graphs)) is ForeachLamb


def test_apex_fused_lamb_is_what_capture_refuses(gpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up failure the auto choice avoids: apex's FusedLAMB handed to the graph."""
    fake_apex.install(monkeypatch)
    with pytest.raises(ValueError, match="cannot run inside a CUDA graph"):
        capturable(build_optimizer(params(), "lamb", *ARGS))
