#!/usr/bin/env bash
# Runs one MLPerf BERT phase-2 training run from the variables of a config_<SYSTEM>.sh file
# and prints the MLPerf RESULT line. Launch it once per node (it starts DGXNGPU processes
# with torchrun) or once per task under srun (the trainer then reads SLURM's variables).
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
  CHECKPOINT_EVERY_SAMPLES KEEP_CHECKPOINTS MAX_CONSECUTIVE_SKIPPED_STEPS SEED NODE_RANK MASTER_PORT
check "an integer" "$signed_int_re" START_WARMUP_STEP
check "a number" "$number_re" LR OPT_LAMB_BETA_1 OPT_LAMB_BETA_2 WEIGHT_DECAY_RATE TARGET_MLM_ACCURACY \
  WARMUP_PROPORTION END_LEARNING_RATE OPT_EPSILON MAX_GRAD_NORM CHECKPOINT_EVERY_MINUTES COLLECTIVE_TIMEOUT_S
check "0 or 1 (off or on)" '^[01]$' CUDA_GRAPHS DECAY_FROM_WARMUP_END ECHO_MLLOG DIST_OPTIMIZER
for name in DGXNGPU DGXNNODES; do
  (( 10#${!name} >= 1 )) || die "$name=${!name} must be at least 1"
done

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
  "CUDA_GRAPHS --cuda_graphs switch"
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
if [[ -z "${RANK:-}${SLURM_PROCID:-}${PMI_RANK:-}${OMPI_COMM_WORLD_RANK:-}" && $((10#$DGXNGPU * 10#$DGXNNODES)) -gt 1 ]]; then
  # Not started per task: start one process per GPU (or CPU worker) on this node.
  if [[ "${BALANCE:-none}" == cpu_exchange ]]; then
    # The CPU exchange talks MPI, so an MPI launcher starts the ranks (mpiexec next to $PYTHON
    # when there is one, as the mpich wheel installs it); torch.distributed meets at MASTER_PORT.
    python_dir=$(dirname "$(command -v "$PYTHON")")
    if [[ -x "$python_dir/mpiexec" ]]; then MPIEXEC=${MPIEXEC:-$python_dir/mpiexec}; fi
    export MASTER_PORT=${MASTER_PORT:-$((20000 + RANDOM % 20000))}
    trainer=("${MPIEXEC:-mpiexec}" -n "$DGXNGPU" "$PYTHON" "$here/pytorch/run_pretraining.py")
  elif [[ "$DGXNNODES" -gt 1 ]]; then
    # Once per node (run_with_docker.sh on every node): torchrun meets node 0 at MASTER_ADDR.
    require NODE_RANK MASTER_ADDR
    trainer=("$PYTHON" "$here/pytorch/launch.py" --nnodes="$DGXNNODES" --node_rank="$NODE_RANK" \
      --nproc_per_node="$DGXNGPU" --master_addr="$MASTER_ADDR" --master_port="${MASTER_PORT:-29500}" \
      "$here/pytorch/run_pretraining.py")
  else
    trainer=("$PYTHON" "$here/pytorch/launch.py" --standalone --nproc_per_node="$DGXNGPU" \
      "$here/pytorch/run_pretraining.py")
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
# shellcheck source=/dev/null
source "$here/tools/job_exit_code.sh"

start=$(date +%s)
start_fmt=$(date +%Y-%m-%d\ %r)
echo "STARTING TIMING RUN AT $start_fmt"
status=0
"${trainer[@]}" "${flags[@]}" || status=$?
# A launcher's own code (torchrun and mpiexec say 1 for any failed rank) becomes the trainer's.
if [[ $status -ne 0 ]]; then status=$(job_exit_code "$MLPERF_BERT_EXIT_DIR" "$status"); fi
end=$(date +%s)
echo "ENDING TIMING RUN AT $(date +%Y-%m-%d\ %r)"
[[ $status -eq 0 ]] || exit "$status"
if [[ "${SLURM_PROCID:-${RANK:-${NODE_RANK:-0}}}" != 0 ]]; then
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
