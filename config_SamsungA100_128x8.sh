# shellcheck shell=bash
# 128 nodes x 8 A100: Samsung's MLPerf v2.0 open-division BERT recipe (ADAM, stratified local
# presort, bucket-wise gradient clipping before the all-reduce).
# Batch arithmetic: 16 sequences/GPU x 8 GPUs x 128 nodes x 1 accumulation step = 16,384 global batch.
# Eval interval (REFERENCE formula): floor_25k(0.05 x (230.23 x 16384 + 3,000,000)) = 325,000 samples.
# 299 steps x 16,384 = 4,898,816 samples of schedule. LR: linear warm-up over 82 steps started
# at step -16 (so it ends at step 66); linear decay measured from step 82 (the warm-up length, as
# Samsung's scheduler counts it: steps 66-81 run up to ~14% above LR) down to 4.945e-5 at step 179,
# held there to step 299. Runs stop at 7M samples at the latest (the 128x8 limit).
# RCP (training 5.0.0, bert): GBS 16384 has its own RCP: RCP mean 5,505,422 samples to converge, minimum acceptable olympic mean 5,400,269, maximum speed-up 1.0195; open division: no RCP check
export DGXSYSTEM=SamsungA100_128x8
export DGXNNODES=128
export DGXNGPU=8
export WALLTIME=15

export BATCHSIZE=16
export GRADIENT_STEPS=1
export LR=0.000393
export MAX_STEPS=299
export DECAY_STEPS=179
export END_LEARNING_RATE=4.945e-5
export DECAY_FROM_WARMUP_END=1
export WARMUP_STEPS=82
export START_WARMUP_STEP=-16
# ADAM betas and weight decay (the trainer's --opt_lamb_beta_* flags are the optimizer's betas).
export OPT_LAMB_BETA_1=0.8004
export OPT_LAMB_BETA_2=0.8175
export WEIGHT_DECAY_RATE=0.00289
export OPTIMIZER=adam
export OPT_EPSILON=1e-9
export MAX_GRAD_NORM=1.0
# Each DDP bucket is clipped to 1/sqrt(B) as DDP hands it over, so the all-reduce keeps
# overlapping the backward pass at 1,024 GPUs (clip-before of the whole gradient would not).
export CLIP_MODE=bucketwise
# Sharded ADAM: the gradient is reduce-scattered, each GPU updates 1/1,024 of the parameters and
# the weights are all-gathered. The bucket-wise clip still clips each DDP bucket of the local
# gradient before it is reduced, so it means the same before a reduce-scatter as before an
# all-reduce. Unsharded, every GPU's ADAM step moves the same ~28 bytes per parameter as LAMB's
# (~9.5 GB, ~6 ms of A100 HBM time), whatever the GPU count; at 16 sequences per GPU (4x the
# DGX A100 128x8 config's 2 packs) forward and backward take ~4x longer, so that is ~10 % of the
# step here against ~30 % there (docs/PERFORMANCE.md): a smaller share, the same milliseconds.
export DIST_OPTIMIZER=1
# Shard within each node's 8 GPUs (NVIDIA's --dwu-group-size): reduce-scatter and all-gather are
# rings of 8 over NVLink, not of 1,024 ranks (NCCL's per-hop latency paid 7 times per block, not
# 1,023), and the nodes exchange 1/8 of the gradient per GPU in an all-reduce (a tree across 128
# nodes); the bytes over InfiniBand are those of DDP's all-reduce (docs/PERFORMANCE.md, on paper).
export DIST_OPTIMIZER_GROUP_SIZE=8

export EVAL_ITER_START_SAMPLES=325000
export EVAL_ITER_SAMPLES=325000
export MAX_SAMPLES_TERMINATION=7000000
export TARGET_MLM_ACCURACY=0.720
export NUM_EVAL_EXAMPLES=10000
export EVAL_BATCH_SIZE=16
export MAX_SEQ_LENGTH=512
export MAX_PREDICTIONS_PER_SEQ=76

# Stratified local presort: fixed per-stratum counts per local batch (6/3/2/5 of 16), sorted and
# dealt in snake order inside each node. Needs unpadded sequences, not packs, and DATADIR_PHASE2
# set to a stratified dataset (`data_prep/prepare.py stratify`).
export INPUT_LAYOUT=unpadded
export BALANCE=local_presort
# Precision is not in the published recipe; bf16 as in the NVIDIA A100 configs.
export PRECISION=bf16
export CUDA_GRAPHS=0
# Encoder layers compiled by torch.compile (Inductor): bias+GELU fused into one kernel, dropout +
# residual add + LayerNorm into another, where NVIDIA uses its fused kernels. The mode
# benchmarks/throughput.py times on a GPU (`--from_config` this file). Not yet timed against eager on
# a GPU: docs/PERFORMANCE.md, "Compile mode of the shipped configs", gives the reason for the choice.
export COMPILE_MODE=default
# Eval on packed rows of one static shape kept on the GPU, the forward captured once as a CUDA graph
# and replayed per batch; the host reads the accuracy once per eval (NVIDIA's --eval_cuda_graph).
export EVAL_CUDA_GRAPH=1
export SYNC_EVERY=10  # host reads every 10 steps; a non-finite loss rolls back (docs/FAULTS.md)

# NCCL_TEST=1 (run.sub, run_with_docker.sh): the all-reduce bus bandwidth, GB/s as nccl-tests'
# all_reduce_perf reports it, below which the job stops before its first run: a quarter of a node's
# 200 GB/s of InfiniBand (8 x 200 Gb/s HDR, one adapter per GPU), which bounds the all-reduce across
# nodes: a node with a dead or slow adapter falls below it.
export NCCL_TEST_MIN_BUSBW_GBPS=50

export DIVISION=open
export SUBMISSION_ORG=reference
export SUBMISSION_PLATFORM=128xSamsung_A100
