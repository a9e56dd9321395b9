# MLPerf BERT phase-2 training image: docker build -t mlperf-bert:latest .
#
# Base: NGC PyTorch 24.10 (PyTorch 2.5.0a0, CUDA 12.6, NCCL, cuDNN, apex, DALI, flash-attn,
# Python 3.10), with Hopper (H100/H200) support. It is preferred to 24.04 (PyTorch 2.3.0a0)
# because the LAMB step calls torch._foreach_norm(..., dtype=torch.float32), and that dtype
# argument is newer than PyTorch 2.3. It also predates the pip constraints file that NGC
# images carry from 25.03 on. Another base: --build-arg FROM_IMAGE_NAME=...
ARG FROM_IMAGE_NAME=nvcr.io/nvidia/pytorch:24.10-py3
FROM ${FROM_IMAGE_NAME}

WORKDIR /workspace/bert

# Exact pins for what the base image lacks; torch and numpy stay the image's own builds.
COPY requirements-container.txt .
RUN pip install --no-cache-dir -r requirements-container.txt

# --precision fp8 (the H100, H200, B200 and GB200 configs) needs torchao, which NGC images do not
# carry: give a release built for the base image's torch (torchao's compatibility table), e.g.
# --build-arg TORCHAO_SPEC=torchao==0.18.0 on a base with a matching torch. Empty: no FP8; the
# fp8 configs then stop at start-up with one line saying how to install it.
ARG TORCHAO_SPEC=""
# The pin is the build argument itself (package==version), which the linter cannot see.
# hadolint ignore=DL3013
RUN if [ -n "${TORCHAO_SPEC}" ]; then pip install --no-cache-dir "${TORCHAO_SPEC}"; fi

COPY . .
# The project itself (editable, so /workspace/bert is the code that runs and that logs name);
# --no-deps: its dependencies are the pins above plus the base image.
RUN pip install --no-cache-dir --no-deps -e . \
    && python -c "import h5py, tqdm, mlperf_logging.mllog, mlperf_bert" \
    && python -m mlperf_logging.compliance_checker --help > /dev/null
