#!/usr/bin/env bash
# Runs one MLPerf BERT phase-2 training run from the variables of a config_<SYSTEM>.sh file
# and prints the MLPerf RESULT line. Launch it once per node (it starts DGXNGPU processes
# with torchrun) or once per task under srun (the trainer then reads SLURM's variables).
# Several nodes meet through torchrun's rendezvous: RDZV_BACKEND=static (default; NODE_RANK,
# MASTER_ADDR, MASTER_PORT) or c10d (RDZV_ENDPOINT, default MASTER_ADDR:MASTER_PORT; RDZV_ID,
# default SLURM_JOB_ID; node ranks in join order, also under srun with one task per node).
#
#   source config_CPU_1x2.sh
#   DATADIR_PHASE2=... EVALDIR=... OUTPUT_DIR=... ./run_and_time.sh
#
# Exit code: the trainer's (0 done, 2 bad input, 3 numeric blow-up, 75 preempted with a
# checkpoint, 76 a lost rank; docs/FAULTS.md), also when torchrun or mpiexec started the ranks:
# each rank leaves its code in MLPERF_BERT_EXIT_DIR, and this script exits with the lowest
# one that is not 76 (a lost rank is what the others see when one fails), else 76. A bad config
# variable exits 2 before anything starts, naming the variable.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python3}

die() { echo "run_and_time.sh: $*" >&2; exit 2; }

# shellcheck source=/dev/null
source "$here/tools/script_args.sh"
for arg in "$@"; do
  help_or_refuse run_and_time.sh "${BASH_SOURCE[0]}" \
    "source config_<SYSTEM>.sh; DATADIR_PHASE2=... EVALDIR=... OUTPUT_DIR=... ./run_and_time.sh (no arguments)" "$arg"
done

require() {
  local name
  for name in "$@"; do
    [[ -n "${!name:-}" ]] || die "$name is not set; source a config_<SYSTEM>.sh file or export it"
  done
}

require DGXNGPU DGXNNODES BATCHSIZE GRADIENT_STEPS LR MAX_STEPS OPT_LAMB_BETA_1 OPT_LAMB_BETA_2 \
  WEIGHT_DECAY_RATE MAX_SAMPLES_TERMINATION TARGET_MLM_ACCURACY INPUT_LAYOUT PRECISION \
  DATADIR_PHASE2 EVALDIR

# Types of the config variables, checked here so that a bad one is named (the trainer would name
# its flag); ranges and combinations are the trainer's to check.
int_re='^[0-9]+$'
signed_int_re='^-?[0-9]+$'
number_re='^[-+]?([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][-+]?[0-9]+)?$'

check() {
  local kind=$1 re=$2 name
  shift 2
  for name in "$@"; do
    if [[ -n "${!name:-}" && ! "${!name}" =~ $re ]]; then
      die "$name=${!name} is not $kind; fix it in the config_<SYSTEM>.sh file or the environment"
    fi
  done
}
check "a whole number (0, 1, 2, ...)" "$int_re" DGXNGPU DGXNNODES BATCHSIZE GRADIENT_STEPS MAX_STEPS \
  MAX_SAMPLES_TERMINATION WARMUP_STEPS DECAY_STEPS EVAL_ITER_START_SAMPLES EVAL_ITER_SAMPLES \
  NUM_EVAL_EXAMPLES EVAL_BATCH_SIZE MAX_SEQ_LENGTH MAX_PREDICTIONS_PER_SEQ LOG_FREQ SYNC_EVERY \
  CHECKPOINT_EVERY_SAMPLES KEEP_CHECKPOINTS MAX_CONSECUTIVE_SKIPPED_STEPS SEED NODE_RANK MASTER_PORT \
  DIST_OPTIMIZER_GROUP_SIZE
check "an integer" "$signed_int_re" START_WARMUP_STEP
check "a number" "$number_re" LR OPT_LAMB_BETA_1 OPT_LAMB_BETA_2 WEIGHT_DECAY_RATE TARGET_MLM_ACCURACY \
  WARMUP_PROPORTION END_LEARNING_RATE OPT_EPSILON MAX_GRAD_NORM CHECKPOINT_EVERY_MINUTES COLLECTIVE_TIMEOUT_S
check "0 or 1 (off or on)" '^[01]$' CUDA_GRAPHS DECAY_FROM_WARMUP_END ECHO_MLLOG DIST_OPTIMIZER
check "0 or 1 (off or on)" '^[01]$' EVAL_CUDA_GRAPH UNVERIFIED_DATA
# torchrun's rendezvous when it starts the ranks of several nodes (docs/FAULTS.md, "Several nodes").
check "static or c10d" '^(static|c10d)$' RDZV_BACKEND
check "host:port" '^([^][:space:]:]+|\[[0-9A-Fa-f:.]+\]):[0-9]+$' RDZV_ENDPOINT
check "a run id (letters, digits, '.', '_', '-')" '^[A-Za-z0-9._-]+$' RDZV_ID
# shellcheck source=/dev/null
source "$here/tools/launch_checks.sh"
check_launch_ranges

[[ -d "$DATADIR_PHASE2" ]] || die "DATADIR_PHASE2=$DATADIR_PHASE2 is not a directory"
[[ -e "$EVALDIR" ]] || die "EVALDIR=$EVALDIR does not exist"

SEED=${SEED:-$RANDOM}
OUTPUT_DIR=${OUTPUT_DIR:-${LOGDIR:-$here/results}/run_${SEED}}
BERT_CONFIG=${BERT_CONFIG:-${CHECKPOINTDIR_PHASE1:-}/bert_config.json}
# Without a phase-1 folder or a named checkpoint the weights start random.
INIT_CHECKPOINT=${INIT_CHECKPOINT:-${CHECKPOINTDIR_PHASE1:+$CHECKPOINTDIR_PHASE1/model.ckpt-28252.pt}}
[[ -f "$BERT_CONFIG" ]] || die "BERT_CONFIG=$BERT_CONFIG not found (set BERT_CONFIG or CHECKPOINTDIR_PHASE1)"

# Config variable -> trainer flag: the one table of the mapping. A variable that is set passes
# its value; a switch variable (0 or 1, "switch" below) passes the bare flag when it is 1. The
# trainer gets the table too (MLPERF_BERT_FLAG_VARIABLES), so an error line naming a flag also
# names the variable that set it, with its value.
flag_table=(
  "DATADIR_PHASE2 --input_dir"
  "EVALDIR --eval_dir"
  "UNVERIFIED_DATA --unverified_data switch"
  "BERT_CONFIG --bert_config_path"
  "INIT_CHECKPOINT --init_checkpoint"
  "OUTPUT_DIR --output_dir"
  "SEED --seed"
  "BATCHSIZE --train_batch_size"
  "GRADIENT_STEPS --gradient_accumulation_steps"
  "LR --learning_rate"
  "MAX_STEPS --max_steps"
  "WARMUP_STEPS --warmup_steps"
  "WARMUP_PROPORTION --warmup_proportion"
  "START_WARMUP_STEP --start_warmup_step"
  "DECAY_STEPS --decay_steps"
  "END_LEARNING_RATE --end_learning_rate"
  "DECAY_FROM_WARMUP_END --decay_from_warmup_end switch"
  "OPTIMIZER --optimizer"
  "OPTIMIZER_IMPL --optimizer_impl"
  "DIST_OPTIMIZER --distributed_optimizer switch"
  "DIST_OPTIMIZER_GROUP_SIZE --dist_optimizer_group_size"
  "OPT_LAMB_BETA_1 --opt_lamb_beta_1"
  "OPT_LAMB_BETA_2 --opt_lamb_beta_2"
  "OPT_EPSILON --opt_epsilon"
  "WEIGHT_DECAY_RATE --weight_decay_rate"
  "MAX_GRAD_NORM --max_grad_norm"
  "CLIP_MODE --clip_mode"
  "INPUT_LAYOUT --input_layout"
  "BALANCE --balance"
  "BALANCE_DEAL --balance_deal"
  "MAX_SAMPLES_TERMINATION --max_samples_termination"
  "TARGET_MLM_ACCURACY --target_mlm_accuracy"
  "EVAL_ITER_START_SAMPLES --eval_iter_start_samples"
  "EVAL_ITER_SAMPLES --eval_iter_samples"
  "NUM_EVAL_EXAMPLES --num_eval_examples"
  "EVAL_BATCH_SIZE --eval_batch_size"
  "MAX_SEQ_LENGTH --max_seq_length"
  "MAX_PREDICTIONS_PER_SEQ --max_predictions_per_seq"
  "PRECISION --precision"
  "FP8_RECIPE --fp8_recipe"
  "FP8_LAYERS --fp8_layers"
  "CUDA_GRAPHS --cuda_graphs switch"
  "EVAL_CUDA_GRAPH --eval_cuda_graph switch"
  "ATTENTION_BACKEND --attention_backend"
  "ATTENTION_GROUP_BOUNDS --attention_group_bounds"
  "DEVICE --device"
  "LOG_FREQ --log_freq"
  "COMPILE_MODE --compile_mode"
  "SYNC_EVERY --sync_every"
  "INPUT_PIPELINE --input_pipeline"
  "DIVISION --submission_division"
  "SUBMISSION_ORG --submission_org"
  "SUBMISSION_PLATFORM --submission_platform"
  "SUBMISSION_STATUS --submission_status"
  "MLPERF_LOG_FILE --mlperf_log_file"
  "ECHO_MLLOG --echo_mllog switch"
  "CURVES --curves"
  # Long runs (docs/FAULTS.md); the MLPerf timing configs set none of these.
  "CHECKPOINT_DIR --checkpoint_dir"
  "CHECKPOINT_EVERY_SAMPLES --checkpoint_every_samples"
  "CHECKPOINT_EVERY_MINUTES --checkpoint_every_minutes"
  "KEEP_CHECKPOINTS --keep_checkpoints"
  "RESUME_FROM_CHECKPOINT --resume_from_checkpoint"
  "COLLECTIVE_TIMEOUT_S --collective_timeout_s"
  "MAX_CONSECUTIVE_SKIPPED_STEPS --max_consecutive_skipped_steps"
)

# This script's stdout is the run's log (run_with_docker.sh and run.sub tee it into LOGDIR and
# check it), so the MLPerf lines go there too; ECHO_MLLOG=0 where only the log file is read.
ECHO_MLLOG=${ECHO_MLLOG:-1}
if [[ "${INIT_CHECKPOINT:-none}" == none ]]; then
  INIT_CHECKPOINT=""  # random weights: no --init_checkpoint
elif [[ ! -e "$INIT_CHECKPOINT" ]]; then
  if [[ "${DIVISION:-closed}" == closed ]]; then  # random weights would break a closed-division rule
    die "INIT_CHECKPOINT=$INIT_CHECKPOINT not found: a closed-division run starts from the phase-1 checkpoint" \
      "(training_rules.adoc §2.4); point INIT_CHECKPOINT or CHECKPOINTDIR_PHASE1 at it" \
      "(data_prep/prepare.py convert-checkpoint makes it), or set DIVISION=open"
  fi
  die "INIT_CHECKPOINT=$INIT_CHECKPOINT not found (set INIT_CHECKPOINT=none to start from random weights)"
fi

flags=(--do_train)
names=()
for entry in "${flag_table[@]}"; do
  read -r name flag kind <<<"$entry"
  names+=("$name=$flag")
  if [[ "$kind" == switch ]]; then
    if [[ "${!name:-0}" == 1 ]]; then flags+=("$flag"); fi
  elif [[ -n "${!name:-}" ]]; then
    flags+=("$flag" "${!name}")
  fi
done
MLPERF_BERT_FLAG_VARIABLES="${names[*]}"
export MLPERF_BERT_FLAG_VARIABLES

# torchrun runs through pytorch/launch.py (mlperf_bert.runtime.launch): torchrun's flags and agent,
# but a rank's own stop (its one line, its exit code) reaches the user without torchrun's
# ChildFailedError report, which stays for a crash.
trainer=("$PYTHON" "$here/pytorch/run_pretraining.py")
RDZV_BACKEND=${RDZV_BACKEND:-static}
agent=""  # torchrun's agent, when this script starts one (pytorch/launch.py)
main_rank_file=""  # made by global rank 0 when this launch is one node of several
if [[ "$RDZV_BACKEND" == c10d && -n "${SLURM_STEP_NUM_TASKS:-}" && "$SLURM_STEP_NUM_TASKS" != "$DGXNNODES" ]]; then
  die "RDZV_BACKEND=c10d starts torchrun once per node: run one task per node (srun --ntasks-per-node=1)," \
    "not $SLURM_STEP_NUM_TASKS tasks for DGXNNODES=$DGXNNODES"
fi
if [[ ( "$RDZV_BACKEND" == c10d || -z "${RANK:-}${SLURM_PROCID:-}${PMI_RANK:-}${OMPI_COMM_WORLD_RANK:-}" ) \
      && $((10#$DGXNGPU * 10#$DGXNNODES)) -gt 1 ]]; then
  # Not started per task (or under c10d, one task per node): start one process per GPU (or CPU
  # worker) on this node.
  if [[ "${BALANCE:-none}" == cpu_exchange ]]; then
    # The CPU exchange talks MPI, so an MPI launcher starts the ranks (mpiexec next to $PYTHON
    # when there is one, as the mpich wheel installs it); torch.distributed meets at MASTER_PORT.
    python_dir=$(dirname "$(command -v "$PYTHON")")
    if [[ -x "$python_dir/mpiexec" ]]; then MPIEXEC=${MPIEXEC:-$python_dir/mpiexec}; fi
    export MASTER_PORT=${MASTER_PORT:-$((20000 + RANDOM % 20000))}
    trainer=("${MPIEXEC:-mpiexec}" -n "$DGXNGPU" "$PYTHON" "$here/pytorch/run_pretraining.py")
  elif [[ "$DGXNNODES" -gt 1 ]]; then
    # Once per node (run_with_docker.sh on every node, or run.sub's one task per node under c10d).
    if [[ "$RDZV_BACKEND" == c10d ]]; then
      # The agents meet at RDZV_ENDPOINT (the agent on that host serves the store) and take node
      # ranks in the order they join: NODE_RANK is not used.
      [[ -n "${RDZV_ENDPOINT:-}${MASTER_ADDR:-}" ]] || die "RDZV_BACKEND=c10d needs RDZV_ENDPOINT=host:port" \
        "(or MASTER_ADDR, with MASTER_PORT): the address of one of the nodes, the same on every node"
      rendezvous=(--rdzv_backend=c10d --rdzv_endpoint="${RDZV_ENDPOINT:-$MASTER_ADDR:${MASTER_PORT:-29500}}"
        --rdzv_id="${RDZV_ID:-${SLURM_JOB_ID:-mlperf_bert}}")
    else
      # Static: node NODE_RANK's ranks are NODE_RANK * DGXNGPU + local rank; node 0's agent serves the store.
      require NODE_RANK MASTER_ADDR
      rendezvous=(--node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="${MASTER_PORT:-29500}")
    fi
    agent="$here/pytorch/launch.py"
    main_rank_file=main-rank.${HOSTNAME:-$(uname -n)}.$$
    trainer=("$PYTHON" "$agent" --nnodes="$DGXNNODES" --nproc_per_node="$DGXNGPU" "${rendezvous[@]}" \
      "$here/pytorch/run_pretraining.py")
  else
    agent="$here/pytorch/launch.py"
    trainer=("$PYTHON" "$agent" --standalone --nproc_per_node="$DGXNGPU" "$here/pytorch/run_pretraining.py")
  fi
fi

# SIGUSR1 / SIGTERM are for the trainer (it checkpoints and exits 75, which this script passes
# on); this shell only waits for it instead of dying first.
trap ':' USR1 TERM
# The ranks' exit folder: run.sub hands every task of a run the same one (on the shared LOGDIR);
# otherwise this launch has its own.
if [[ -z "${MLPERF_BERT_EXIT_DIR:-}" ]]; then
  MLPERF_BERT_EXIT_DIR=$(mktemp -d)
  trap 'rm -rf "$MLPERF_BERT_EXIT_DIR"' EXIT
fi
mkdir -p "$MLPERF_BERT_EXIT_DIR"
export MLPERF_BERT_EXIT_DIR
if [[ -n "$main_rank_file" ]]; then
  main_rank_file=$MLPERF_BERT_EXIT_DIR/$main_rank_file
  export MLPERF_BERT_MAIN_RANK_FILE=$main_rank_file
fi
# shellcheck source=/dev/null
source "$here/tools/job_exit_code.sh"

start=$(date +%s)
start_fmt=$(date +%Y-%m-%d\ %r)
echo "STARTING TIMING RUN AT $start_fmt"
status=0
"${trainer[@]}" "${flags[@]}" || status=$?
if [[ -n "$agent" && $status -gt 128 ]]; then
  # The agent itself died of a signal (killed outright: it had no say): its workers stop on their
  # own within moments and leave their codes (runtime/orphan.py); wait for them, up to 10 s.
  for ((tries = 0; tries < 50; tries++)); do
    [[ $(find "$MLPERF_BERT_EXIT_DIR" -name '*.code' | wc -l) -lt $((10#$DGXNGPU)) ]] || break
    sleep 0.2
  done
fi
# A launcher's own code (torchrun and mpiexec say 1 for any failed rank) becomes the trainer's.
if [[ $status -ne 0 ]]; then status=$(job_exit_code "$MLPERF_BERT_EXIT_DIR" "$status"); fi
end=$(date +%s)
echo "ENDING TIMING RUN AT $(date +%Y-%m-%d\ %r)"
[[ $status -eq 0 ]] || exit "$status"
# Global rank 0's launch prints the RESULT line: the rank itself when started per task; one node of
# several learns it from rank 0's file (under c10d any node may get rank 0).
ran_rank_0() {
  if [[ -n "$main_rank_file" ]]; then [[ -e "$main_rank_file" ]]; else [[ "${SLURM_PROCID:-${RANK:-${NODE_RANK:-0}}}" == 0 ]]; fi
}
if ! ran_rank_0; then
  exit 0
elif [[ -n "${RESUME_FROM_CHECKPOINT:-}" ]]; then
  echo "no RESULT line: a run started with RESUME_FROM_CHECKPOINT is not a timing result"
else
  # The 7th field is the run_stop status of the MLPerf log (success, aborted, or unknown when
  # the log has no run_stop); the first six are the fields MLPerf result scripts read.
  run_stop=$(grep -h '"key": "run_stop"' "${MLPERF_LOG_FILE:-$OUTPUT_DIR/mlperf.log}" 2>/dev/null | tail -n 1 || true)
  run_status=$(sed -n 's/.*"status": *"\([a-z]*\)".*/\1/p' <<< "$run_stop")
  echo "RESULT,bert,$SEED,$((end - start)),${USER:-unknown},$start_fmt,${run_status:-unknown}"
  [[ "$run_status" == success ]] || echo "run_and_time.sh: the run did not reach the target (run_stop status ${run_status:-missing}); its time is not a result" >&2
fi
