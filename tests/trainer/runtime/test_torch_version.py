"""The oldest torch the trainer runs on: declared once (runtime/torch_version.py), refused at start-up in one
line, and met by every stack the project names: the Dockerfile's default base, the GPU machine's image and the
Makefile's CPU pin, the oldest of which is the minimum itself."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from mlperf_bert.runtime.torch_version import MIN_TORCH, TRAINING_IMAGE, release_of, torch_too_old
from tests.harness.paths import REPO

OLD = "2.5.0a0+e000cf0ad9"  # NGC PyTorch 24.10's, the base before


@pytest.mark.parametrize("version, release", [("2.11.0a0+b4e4ee81d3", (2, 11)), ("2.11.0+cu130", (2, 11)),
                                              ("2.13.0+cpu", (2, 13)), ("2.9.1", (2, 9)), ("3.0.0", (3, 0))])
def test_a_torch_release_counts_by_its_major_and_minor_number(version: str, release: tuple[int, int]) -> None:
    """NGC's pre-release builds (2.11.0a0) are their release; 2.9 is older than 2.11 (numbers, not strings)."""
    assert release_of(version) == release
    assert (torch_too_old(version) is None) == (release >= MIN_TORCH)


def test_the_refusal_names_the_torch_found_the_minimum_and_the_fix() -> None:
    assert MIN_TORCH == (2, 11) and torch_too_old("2.11.0a0+b4e4ee81d3") is None
    assert torch_too_old("2.10.0a0+b4e4ee81d3") is not None
    assert torch_too_old(OLD) == (f"torch {OLD} is older than 2.11, the oldest this trainer runs on: use the training "
                                  "image (Dockerfile, on NGC PyTorch 26.03), or pip install 'torch>=2.11'")


def test_the_trainer_refuses_an_older_torch_before_importing_the_package() -> None:
    """run_pretraining.py under a torch that says it is 24.10's: exit 2, one error line, no traceback, and the
    package's trainer never imported (an older torch may fail its imports)."""
    script = ("import runpy, sys, torch\n"
              f"torch.__version__ = {OLD!r}\n"
              "sys.argv = ['run_pretraining.py', '--help']\n"
              "try:\n"
              "    runpy.run_path('pytorch/run_pretraining.py', run_name='__main__')\n"
              "finally:\n"
              "    print('mlperf_bert.main' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"error: {torch_too_old(OLD)}"]
    assert done.stdout.strip() == "False"


def _dockerfile_base() -> tuple[str, str, str]:
    """The default base's NGC release, the PyTorch and Python its comment names."""
    text = (REPO / "Dockerfile").read_text()
    tag = re.search(r"^ARG FROM_IMAGE_NAME=nvcr\.io/nvidia/pytorch:(\d\d\.\d\d)-py3$", text, re.M)
    named = re.search(r"^# Base: NGC PyTorch (\d\d\.\d\d) \(PyTorch (\d+\.\d+), [^)]*Python (\d+\.\d+)", text, re.M)
    assert tag and named, "the Dockerfile names its base, and that base's PyTorch and Python, in its first comment"
    assert named.group(1) == tag.group(1), (named.group(1), tag.group(1))
    return tag.group(1), named.group(2), named.group(3)


def test_the_image_the_gpu_machine_and_the_cpu_pin_meet_the_minimum_and_the_oldest_is_it() -> None:
    release, base_torch, base_python = _dockerfile_base()
    device = re.search(r"\btorch (\d+\.\d+\.\d+\S*?)[;)]", (REPO / "tools" / "device_image.txt").read_text())
    pin = re.search(r"^TORCH_SPEC \?= torch==(\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert device and pin
    stacks = {"Dockerfile base": base_torch, "GPU image": device.group(1), "Makefile TORCH_SPEC": pin.group(1)}
    releases = {name: release_of(version) for name, version in stacks.items()}
    assert all(r >= MIN_TORCH for r in releases.values()), releases
    assert min(releases.values()) == MIN_TORCH, releases  # the minimum is a torch some stack runs
    assert f"NGC PyTorch {release}" in TRAINING_IMAGE  # the refusal names the image that fixes it
    python = re.search(r"^# python_version: (\d+\.\d+) \(the interpreter of nvcr\.io/nvidia/pytorch:(\d\d\.\d\d)-py3",
                       (REPO / "requirements-container.txt").read_text(), re.M)
    assert python and python.groups() == (base_python, release)
