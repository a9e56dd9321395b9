# shellcheck shell=bash
# NVIDIA DGX A100, 128 nodes x 8 GPUs: the published MLPerf v2.0 closed configuration.
# Batch arithmetic: 2 packs/GPU x 2 sequences/pack x 8 GPUs x 128 nodes x 1 accumulation step
# = 4,096 global batch (a pack holds 1.999 sequences on average and counts as 2, as NVIDIA logs it).
# Eval interval (REFERENCE formula): floor_25k(0.05 x (230.23 x 4096 + 3,000,000)) = 175,000 samples.
# 820 steps x 4,096 = 3,358,720 samples of LR schedule; runs stop at 7M samples at the latest.
# RCP (training 5.0.0, bert): GBS 4096 interpolated between the RCPs at GBS 448 and 4608 (its own RCP is pruned: slower than that interpolation): RCP mean 2,750,860 samples to converge, minimum acceptable olympic mean 2,651,583, maximum speed-up 1.0374
export DGXSYSTEM=DGXA100_128x8
export DGXNNODES=128
export DGXNGPU=8
export WALLTIME=15

export BATCHSIZE=2
export GRADIENT_STEPS=1
export LR=0.00255
export MAX_STEPS=820
export WARMUP_STEPS=256
export START_WARMUP_STEP=-76
export OPT_LAMB_BETA_1=0.71
export OPT_LAMB_BETA_2=0.88
export WEIGHT_DECAY_RATE=0.0166629
export OPTIMIZER=lamb
export OPT_EPSILON=1e-6
export MAX_GRAD_NORM=1.0
# At scale the all-reduce must overlap the backward pass: clip after it (NVIDIA's clipafter configs).
export CLIP_MODE=after_allreduce
# Sharded LAMB, as NVIDIA's run (apex DistributedFusedLAMB, --distributed_lamb): the gradient is
# reduce-scattered, each GPU updates 1/1,024 of the parameters and the weights are all-gathered.
# Unsharded, every GPU's LAMB step reads and writes ~28 bytes per parameter (~9.5 GB, ~6 ms of
# A100 HBM time against ~13 ms of forward and backward at 2 packs per GPU); sharded it is
# microseconds, and the reduce-scatter plus all-gather move the bytes of the all-reduce they replace
# (the reduce-scatters overlap the backward, as NVIDIA's --dwu-overlap-reductions).
export DIST_OPTIMIZER=1
# Shard within each node's 8 GPUs (NVIDIA's --dwu-group-size): reduce-scatter and all-gather are
# rings of 8 over NVLink, not of 1,024 ranks (NCCL's per-hop latency paid 7 times per block, not
# 1,023), and the nodes exchange 1/8 of the gradient per GPU in an all-reduce (a tree across 128
# nodes); the bytes over InfiniBand are those of DDP's all-reduce (docs/PERFORMANCE.md, on paper).
export DIST_OPTIMIZER_GROUP_SIZE=8

export EVAL_ITER_START_SAMPLES=175000
export EVAL_ITER_SAMPLES=175000
export MAX_SAMPLES_TERMINATION=7000000
export TARGET_MLM_ACCURACY=0.720
export NUM_EVAL_EXAMPLES=10000
export EVAL_BATCH_SIZE=16
export MAX_SEQ_LENGTH=512
export MAX_PREDICTIONS_PER_SEQ=76

export INPUT_LAYOUT=packed
export BALANCE=none
export PRECISION=bf16
# As NVIDIA's run: the whole packed iteration (forward, backward, gradient all-reduce, clipping,
# optimizer step) captured as one CUDA graph per rank and replayed every step. At 2 packs per GPU
# an eager step is bound by the host launching kernels; packed rows give the graph static shapes.
export CUDA_GRAPHS=1
# Encoder layers compiled by torch.compile (Inductor): bias+GELU fused into one kernel, dropout +
# residual add + LayerNorm into another, where NVIDIA uses its fused kernels. The mode
# benchmarks/throughput.py times on a GPU (`--from_config` this file). Not yet timed against eager on
# a GPU: docs/PERFORMANCE.md, "Compile mode of the shipped configs", gives the reason for the choice.
export COMPILE_MODE=default
# Eval on packed rows of one static shape kept on the GPU, the forward captured once as a CUDA graph
# and replayed per batch; the host reads the accuracy once per eval (NVIDIA's --eval_cuda_graph).
export EVAL_CUDA_GRAPH=1
# Host reads of the device (loss check, stop agreement) every 10 steps, not every step; a
# non-finite loss rolls back to the last read (docs/FAULTS.md).
export SYNC_EVERY=10

# NCCL, as NVIDIA's v2.0 DGX A100 128x8 config (REFERENCE.md): the buffers of the collectives captured
# in the step's CUDA graph are registered with NCCL once, so each replay's reduce-scatter and all-gather
# move them without staging copies. (A100's NVSwitch has no NVLink SHARP: NCCL_NVLS_ENABLE does not apply.)
export NCCL_GRAPH_REGISTER=1
# NCCL_TEST=1 (run.sub, run_with_docker.sh): the all-reduce bus bandwidth, GB/s as nccl-tests'
# all_reduce_perf reports it, below which the job stops before its first run: a quarter of a node's
# 200 GB/s of InfiniBand (8 x 200 Gb/s HDR, one adapter per GPU), which bounds the all-reduce across
# nodes: a node with a dead or slow adapter falls below it.
export NCCL_TEST_MIN_BUSBW_GBPS=50

export DIVISION=closed
export SUBMISSION_ORG=reference
export SUBMISSION_PLATFORM=128xNVIDIA_DGX_A100
