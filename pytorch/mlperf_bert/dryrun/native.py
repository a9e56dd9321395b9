"""Builds and loads `fake_cuda.cpp`: a CUDA device for FakeTensorMode in a CPU-only PyTorch.

Compiled with g++ against the installed torch's headers, libc10 and libtorch_cpu (found
without importing torch, which must not be imported yet: torch settles on "no accelerator" at
import), cached under the build folder by a hash of the source and the torch build, and
loaded with RTLD_GLOBAL so that its static registrations reach torch's registries.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_cuda.cpp")
BUILD_DIR_ENV = "MLPERF_BERT_BUILD_DIR"


class NativeBuildError(RuntimeError):
    pass


def build_dir() -> Path:
    """$MLPERF_BERT_BUILD_DIR, else ~/.cache/mlperf_bert (outside the source tree)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlperf_bert"
    return Path(os.environ.get(BUILD_DIR_ENV, default)) / "dryrun"


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise NativeBuildError("torch is not installed in this Python; install it first")
    return Path(spec.origin).parent


def _compile_command(torch_dir: Path, source: Path, output: Path) -> list[str]:
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise NativeBuildError(f"the fake CUDA device needs a C++ compiler: {compiler} is not on PATH "
                               "(apt-get install g++, or set CXX)")
    include = torch_dir / "include"
    lib = torch_dir / "lib"
    return [compiler, "-shared", "-fPIC", "-O1", "-std=c++20", "-w", f"-I{include}",
            f"-I{include / 'torch/csrc/api/include'}", str(source), f"-L{lib}", "-lc10", "-ltorch_cpu",
            f"-Wl,-rpath,{lib}", "-o", str(output)]


def _content_hash(torch_dir: Path, source: Path) -> str:
    digest = hashlib.sha256(source.read_bytes())
    digest.update((torch_dir / "version.py").read_bytes())
    digest.update(str(torch_dir).encode())
    return digest.hexdigest()[:16]


def build(source: Path = SOURCE) -> Path:
    """The shared library of `source` (the fake device's, or a test's) for this torch build; compiled once
    (about 2-10 s)."""
    torch_dir = _torch_dir()
    target = build_dir() / f"{source.stem}_{_content_hash(torch_dir, source)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    done = subprocess.run(_compile_command(torch_dir, source, partial), capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise NativeBuildError(f"compiling {source} failed:\n{done.stderr[-4000:]}")
    partial.replace(target)
    return target


_loaded: list[Path] = []


def load() -> Path:
    """Builds if needed and loads the fake CUDA device; call before the first `import torch`."""
    if _loaded:
        return _loaded[0]
    if "torch" in sys.modules:
        raise NativeBuildError("torch is already imported: the fake CUDA device must be loaded first "
                               "(run the dry run in its own process: python -m mlperf_bert.dryrun)")
    library = build()
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    _loaded.append(library)
    return library
