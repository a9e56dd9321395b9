# shellcheck shell=bash
# The CPU demo: a tiny BERT (2 layers, hidden 128) trained by 2 CPU processes on the generated
# demo dataset (data_prep/make_demo_data.py) to 0.72 masked-LM accuracy in about 100 steps.
# Batch arithmetic: 32 sequences/process x 2 processes x 1 accumulation step = 64 global batch.
# The MLPerf eval-interval formula gives 150,000 samples at GBS 64, far beyond this run, so the
# demo evaluates every 1,600 samples (25 steps) on its 1,000 eval sequences.
# RCP (training 5.0.0, bert): GBS 64 is below every RCP: checked against the smallest, GBS 448 (converging faster than that needs an RCP at GBS 64): RCP mean 2,414,421 samples to converge, minimum acceptable olympic mean 2,274,732, maximum speed-up 1.0614; open division: no RCP check
export DGXSYSTEM=CPU_1x2
export DGXNNODES=1
export DGXNGPU=2
export WALLTIME=15
export DEVICE=cpu

export BATCHSIZE=32
export GRADIENT_STEPS=1
export LR=0.02
export MAX_STEPS=1000
export WARMUP_STEPS=40
export START_WARMUP_STEP=0
export OPT_LAMB_BETA_1=0.9
export OPT_LAMB_BETA_2=0.999
export WEIGHT_DECAY_RATE=0.01
export OPTIMIZER=lamb
export OPT_EPSILON=1e-6
export MAX_GRAD_NORM=1.0
export CLIP_MODE=after_allreduce

export EVAL_ITER_START_SAMPLES=1600
export EVAL_ITER_SAMPLES=1600
export MAX_SAMPLES_TERMINATION=64000
export TARGET_MLM_ACCURACY=0.720
export NUM_EVAL_EXAMPLES=1000
export EVAL_BATCH_SIZE=250
export MAX_SEQ_LENGTH=128
export MAX_PREDICTIONS_PER_SEQ=20

export INPUT_LAYOUT=unpadded
export BALANCE=none
export PRECISION=fp32
export CUDA_GRAPHS=0

export DIVISION=open
export SUBMISSION_ORG=reference
export SUBMISSION_PLATFORM=CPU_2_processes
export SUBMISSION_STATUS=research

# The generated demo dataset and model (read by tools/run_demo.sh).
export DEMO_NUM_TRAIN=20000
export DEMO_NUM_SHARDS=4
export DEMO_VOCAB_SIZE=80
export DEMO_HIDDEN_SIZE=128
export DEMO_NUM_LAYERS=2
export DEMO_NUM_HEADS=2
export DEMO_INTERMEDIATE_SIZE=512
