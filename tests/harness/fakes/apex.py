"""Stand-ins for NVIDIA apex's fused optimizers and its `amp_C` extension, for tests of which
implementation `optim.build_optimizer` picks where apex is importable (apex needs CUDA to build).

`install(monkeypatch)` makes `import apex.optimizers` and `import amp_C` succeed for one test.
The optimizers only keep their arguments: no test steps them.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch


class _Recorded(torch.optim.Optimizer):
    def __init__(self, params: Any, **kwargs: Any) -> None:
        self.kwargs = kwargs
        super().__init__(params, {"lr": kwargs["lr"]})


class FusedLAMB(_Recorded):
    pass


class FusedAdam(_Recorded):
    pass


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    apex = types.ModuleType("apex")
    optimizers = types.ModuleType("apex.optimizers")
    optimizers.FusedLAMB, optimizers.FusedAdam = FusedLAMB, FusedAdam
    apex.optimizers = optimizers
    monkeypatch.setitem(sys.modules, "apex", apex)
    monkeypatch.setitem(sys.modules, "apex.optimizers", optimizers)
    monkeypatch.setitem(sys.modules, "amp_C", types.ModuleType("amp_C"))
