# MLPerf BERT phase-2 training image: docker build -t mlperf-bert:latest .
#
# Base: NGC PyTorch 26.03 (PyTorch 2.11, CUDA 13.2, Python 3.12, NCCL, cuDNN), with Hopper and
# Blackwell support. The trainer needs torch 2.11 or newer (pytorch/mlperf_bert/runtime/torch_version.py:
# the torch it is tested on, and torchao 0.18 for --precision fp8) and refuses an older one at
# start-up; tests/trainer/runtime/test_torch_version.py keeps this base, that minimum, tools/device_image.txt and the
# Makefile's TORCH_SPEC in agreement. NVIDIA's PyTorch release notes
# (docs.nvidia.com/deeplearning/frameworks/pytorch-release-notes/) name each release's torch:
# rel-25-12.html, "PyTorch container image version 25.12 is based on 2.10.0a0", one release short;
# 26.03 ships PyTorch 2.11 with CUDA 13.2 (as its users report it: check `python -c "import torch;
# print(torch.__version__)"` in the image, and rel-26-03.html, before moving the base). NGC images
# carry a pip constraints file from 25.03 on (/etc/pip/constraint.txt, PIP_CONSTRAINT): the pins
# below are installed past it. apex, DALI and flash-attn are optional: a flag that needs one the
# base lacks stops at start-up with one line. Another base: --build-arg FROM_IMAGE_NAME=...
ARG FROM_IMAGE_NAME=nvcr.io/nvidia/pytorch:26.03-py3
FROM ${FROM_IMAGE_NAME}

WORKDIR /workspace/bert

# Exact pins for what the base image lacks; torch and numpy stay the image's own builds.
COPY requirements-container.txt .
RUN PIP_CONSTRAINT='' pip install --no-cache-dir -r requirements-container.txt

# --precision fp8 (the H100, H200, B200 and GB200 configs) needs torchao, which NGC images do not
# carry: give a release built for the base image's torch (torchao's compatibility table), e.g.
# --build-arg TORCHAO_SPEC=torchao==0.18.0 for the default base's torch 2.11. Empty: no FP8; the
# fp8 configs then stop at start-up with one line saying how to install it.
ARG TORCHAO_SPEC=""
# The pin is the build argument itself (package==version), which the linter cannot see.
# hadolint ignore=DL3013
RUN if [ -n "${TORCHAO_SPEC}" ]; then PIP_CONSTRAINT='' pip install --no-cache-dir "${TORCHAO_SPEC}"; fi

COPY . .
# The project itself (editable, so /workspace/bert is the code that runs and that logs name);
# --no-deps: its dependencies are the pins above plus the base image.
RUN pip install --no-cache-dir --no-deps -e . \
    && python -c "import h5py, tqdm, mlperf_logging.mllog, mlperf_bert" \
    && python -m mlperf_logging.compliance_checker --help > /dev/null
