# shellcheck shell=bash
# NVIDIA DGX H100 (8x H100 80GB), 1 node: the hyper-parameters of NVIDIA's MLPerf v3.0 closed
# result (unchanged in its v4.0 H200 one), packed and with CUDA graphs as there.
# Batch arithmetic: 48 packs/GPU x 2 sequences/pack x 8 GPUs x 1 accumulation step = 768 global
# batch (a pack holds 1.999 sequences on average and counts as 2, as NVIDIA logs it: 48 -> 768).
# Eval interval (REFERENCE formula): floor_25k(0.05 x (230.23 x 768 + 3,000,000)) = 150,000 samples.
# 3,680 steps x 768 = 2,826,240 samples of LR schedule; runs stop at 4.5M samples at the latest
# (NVIDIA's H100 config sets the same limit).
# Precision: bf16, where NVIDIA trained in FP8 (TransformerEngine). FP8 ships only where it measured
# faster than bf16 on the GPU: one H200, 2026-11-27 (commit 8b184cd, docs/PERFORMANCE.md), the
# shipped step in FP8 (torchao tensorwise, every encoder GEMM) took 158.0 ms, in bf16 144.0 ms.
# The H100 is the same Hopper chip with slower memory, where the casts (memory-bound) cost more.
# tools/gpu_perf.sh times the FP8 recipes (FP8_RECIPE=tensorwise|rowwise|rowwise_gw_hp|delayed,
# FP8_LAYERS=encoder|ffn) beside bf16 and fp16 in one run; PRECISION=fp8 with the recipe that wins
# comes back here once one measures faster.
# Attention: per sequence inside the packed rows (--attention_backend auto picks the varlen flash
# kernel on a GPU, attention dropout included), as NVIDIA's packed attention over cu_seqlens.
# Source: mlcommons/training_results_v4.0, NVIDIA/benchmarks/bert/implementations/
# eos_ngc23.04_pytorch/config_DGXH100_1x8x48x1_pack.sh (FP8: its --use_transformer_engine2).
# RCP (training 5.0.0, bert): GBS 768 interpolated between the RCPs at GBS 448 and 4608: RCP mean 2,443,934 samples to converge, minimum acceptable olympic mean 2,306,738, maximum speed-up 1.0595
export DGXSYSTEM=DGXH100_1x8
export DGXNNODES=1
export DGXNGPU=8
# SLURM limit, minutes: NVIDIA's run takes 5.5 min; the A100 1x8 config's 60 leaves room for start-up.
export WALLTIME=60

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
# At one node the gradient of each GPU is clipped before the all-reduce, as NVIDIA's 1x8 A100 config does.
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
# graph, replayed every step, as in NVIDIA's run.
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
# all_reduce_perf reports it, below which the job stops before its first run: a quarter of the 450
# GB/s one-way NVLink 4 rate of an H100/H200, low enough for a healthy node under a short test, high
# enough to catch a GPU that fell back to PCIe.
export NCCL_TEST_MIN_BUSBW_GBPS=110

export DIVISION=closed
export SUBMISSION_ORG=reference
# Named as the A100 1x8 config's platform (REFERENCE.md does not give NVIDIA's H100 name).
export SUBMISSION_PLATFORM=1xNVIDIA_DGX_H100
