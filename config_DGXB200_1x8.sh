# shellcheck shell=bash
# NVIDIA DGX B200 (8x B200-SXM 180GB), 1 node: the hyper-parameters of NVIDIA's MLPerf v5.0 closed
# result (3.49 min olympic mean of 10 runs), the same as its H100/H200 ones, in FP8, packed, with
# CUDA graphs. Source: mlcommons/training_results_v5.0, NVIDIA/benchmarks/bert/implementations/
# nyx_n1_ngc25.04_pytorch/config_DGXB200_1x8x48x1_pack.sh and NVIDIA/systems/nyx_n1_ngc25.04_pytorch.json.
# Batch arithmetic: 48 packs/GPU x 2 sequences/pack x 8 GPUs x 1 accumulation step = 768 global
# batch (a pack holds 1.999 sequences on average and counts as 2, as NVIDIA logs it: 48 -> 768).
# Eval interval (REFERENCE formula): floor_25k(0.05 x (230.23 x 768 + 3,000,000)) = 150,000 samples.
# 3,680 steps x 768 = 2,826,240 samples of LR schedule (no warm-up: WARMUP_PROPORTION=0.0 there);
# runs stop at 4.5M samples at the latest, as NVIDIA's.
# Precision: bf16, where NVIDIA trained in FP8 (TransformerEngine). FP8 ships only where it measured
# faster than bf16 on the GPU, and it has not been timed on a B200 yet; on one H200 (2026-11-27,
# docs/PERFORMANCE.md) torchao's tensorwise FP8 step took 158.0 ms against bf16's 144.0 ms.
# tools/gpu_perf.sh times the FP8 recipes (FP8_RECIPE=tensorwise|rowwise|rowwise_gw_hp|delayed,
# FP8_LAYERS=encoder|ffn) beside bf16 and fp16 in one run; PRECISION=fp8 with the recipe that wins
# comes back here once one measures faster. NVIDIA ran fp16 with a loss scaler (INIT_LOSS_SCALE=1024).
# Attention: per sequence inside the packed rows (--attention_backend auto picks the varlen flash
# kernel on a GPU, attention dropout included), as NVIDIA's flash-attn varlen there.
# Not the same step: NVIDIA graphs the encoder only (--cuda_graph_mode segmented) and steps apex's
# DistributedFusedLAMB, which clips each GPU's gradient before the reduction; this trainer graphs
# the whole step with DDP and LAMB, clipping before the all-reduce the same way.
# Image: Blackwell needs a newer base than the Dockerfile's default (NVIDIA's v5.0 used
# nvcr.io/nvidia/pytorch:25.04-py3: --build-arg FROM_IMAGE_NAME=...), with torchao for FP8 (--build-arg TORCHAO_SPEC=...).
# RCP (training 5.0.0, bert): GBS 768 interpolated between the RCPs at GBS 448 and 4608: RCP mean 2,443,934 samples to converge, minimum acceptable olympic mean 2,306,738, maximum speed-up 1.0595
export DGXSYSTEM=DGXB200_1x8
export DGXNNODES=1
export DGXNGPU=8
# SLURM limit, minutes: NVIDIA's own is 22 for one run (5 + 12 + 5); its runs take 2.8-3.9 min.
export WALLTIME=22

export BATCHSIZE=48
export GRADIENT_STEPS=1
export LR=0.00096
export MAX_STEPS=3680
export WARMUP_STEPS=0
export START_WARMUP_STEP=0
export OPT_LAMB_BETA_1=0.60466
export OPT_LAMB_BETA_2=0.85437
export WEIGHT_DECAY_RATE=0.1
export OPTIMIZER=lamb
export OPT_EPSILON=1e-6
export MAX_GRAD_NORM=1.0
# DistributedFusedLAMB with clip_after_ar=False: each GPU's gradient is clipped before the reduction.
export CLIP_MODE=before_allreduce

export EVAL_ITER_START_SAMPLES=150000
export EVAL_ITER_SAMPLES=150000
export MAX_SAMPLES_TERMINATION=4500000
export TARGET_MLM_ACCURACY=0.720
export NUM_EVAL_EXAMPLES=10000
export EVAL_BATCH_SIZE=128
export MAX_SEQ_LENGTH=512
export MAX_PREDICTIONS_PER_SEQ=76

export INPUT_LAYOUT=packed
export BALANCE=none
export PRECISION=bf16
# Each rank's packed step (forward, backward, all-reduce, clipping, optimizer) runs as one CUDA
# graph, replayed every step.
export CUDA_GRAPHS=1
# Encoder layers compiled by torch.compile (Inductor): bias+GELU fused into one kernel, dropout +
# residual add + LayerNorm into another, where NVIDIA uses its fused kernels. The mode
# benchmarks/throughput.py times on a GPU (`--from_config` this file). Not yet timed against eager on
# a GPU: docs/PERFORMANCE.md, "Compile mode of the shipped configs", gives the reason for the choice.
export COMPILE_MODE=default
# Eval on packed rows of one static shape kept on the GPU, the forward captured once as a CUDA graph
# and replayed per batch; the host reads the accuracy once per eval (NVIDIA's --eval_cuda_graph).
export EVAL_CUDA_GRAPH=1
export SYNC_EVERY=10  # host reads every 10 steps; a non-finite loss rolls back (docs/FAULTS.md)

# NCCL, as NVIDIA's v5.0 config_common.sh (mlcommons/training_results_v5.0, NVIDIA/benchmarks/bert):
# NVLink SHARP: the NVSwitches reduce the all-reduce's data themselves (Hopper and Blackwell NVSwitch
# systems), where NCCL's rings would pass it GPU to GPU.
export NCCL_NVLS_ENABLE=1
# NCCL registers no user buffer for zero-copy transfers, neither those of collectives captured in a
# CUDA graph (GRAPH) nor those of eager ones (LOCAL): it copies them through its own buffers. NVIDIA's
# v5.0 setting; its v2.0 DGX A100 128x8 config registered graph buffers (=1), before NVLS.
export NCCL_GRAPH_REGISTER=0
export NCCL_LOCAL_REGISTER=0
# NCCL_TEST=1 (run.sub, run_with_docker.sh): the all-reduce bus bandwidth, GB/s as nccl-tests'
# all_reduce_perf reports it, below which the job stops before its first run: a quarter of the 900
# GB/s one-way NVLink 5 rate of a B200/GB200, low enough for a healthy system under a short test,
# high enough to catch a GPU that fell back to PCIe.
export NCCL_TEST_MIN_BUSBW_GBPS=225

export DIVISION=closed
export SUBMISSION_ORG=reference
# NVIDIA's v5.0 log says "1xNVIDIA HGX B200" (spaces as underscores here, as in the other configs).
export SUBMISSION_PLATFORM=1xNVIDIA_HGX_B200
