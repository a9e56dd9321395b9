"""A CPU-only torch made to register CUDA hooks and a CUDA guard as it is imported, as a CUDA build does.

On PYTHONPATH, with $CUDA_BUILD_LIBRARY naming cuda_build.cpp compiled (mlperf_bert.dryrun.native.build),
every Python process started loads that library when it first imports torch: after the fake CUDA device
where the dry run loads one (tests/trainer/dryrun/test_cuda_build.py).
"""

from __future__ import annotations

import ctypes
import importlib.abc
import os
import sys
from typing import Any


class _LoadsWithTorch(importlib.abc.MetaPathFinder):
    def __init__(self, library: str) -> None:
        self.library: str | None = library

    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name == "torch" and self.library is not None:
            ctypes.CDLL(self.library, mode=ctypes.RTLD_GLOBAL)
            self.library = None
        return None  # torch itself is found as usual


if os.environ.get("CUDA_BUILD_LIBRARY"):
    sys.meta_path.insert(0, _LoadsWithTorch(os.environ["CUDA_BUILD_LIBRARY"]))
