"""The oldest torch the trainer runs on, and the one line that refuses an older one.

MIN_TORCH is 2.11. What sets it:
- `--precision fp8` with torchao's recipes needs torchao 0.18 (the `[fp8]` extra), whose FP8
  training is built for torch 2.11 and newer;
- the torch.library custom ops of `model/varlen_flash.py` (`custom_op`, `register_fake`,
  `register_autograd`) and the flash kernels' cumulative-length calls they wrap, and the
  autocast, foreach and compile calls across the package, have run on torch 2.11 (the GPU
  machine's image, tools/device_image.txt) and 2.13 (the tests, the Makefile's TORCH_SPEC) only;
  an older torch fails somewhere inside a run, after its clock started, or not at all but silently
  otherwise.
The Dockerfile's default base ships a torch at least this new; tests/trainer/runtime/test_torch_version.py keeps
the base, the GPU image, the Makefile's pin and this number in agreement.

NGC images carry pre-release builds (`2.11.0a0+<commit>`): a release counts by its major and
minor number. Free of torch: the caller passes `torch.__version__`, before importing the package
parts an older torch cannot import.
"""

from __future__ import annotations

import re

MIN_TORCH = (2, 11)
# The image whose torch is MIN_TORCH or newer (the Dockerfile's default base).
TRAINING_IMAGE = "the training image (Dockerfile, on NGC PyTorch 26.03)"


def release_of(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: `2.11.0a0+b4e4ee8` and `2.11.0+cu130` are both (2, 11)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(found.group(1)), int(found.group(2))


def torch_too_old(version: str) -> str | None:
    """The start-up line for a torch older than MIN_TORCH, naming it, the minimum and the fix; None otherwise."""
    if release_of(version) >= MIN_TORCH:
        return None
    minimum = ".".join(map(str, MIN_TORCH))
    return (f"torch {version} is older than {minimum}, the oldest this trainer runs on: use {TRAINING_IMAGE}, "
            f"or pip install 'torch>={minimum}'")
