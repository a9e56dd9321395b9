#!/usr/bin/env bash
# Runs NEXP MLPerf BERT phase-2 training runs of one single-node system in a Docker container.
#
#   CONT=mlperf-bert:latest DGXSYSTEM=DGXA100_1x8 \
#   DATADIR_PHASE2=/data/phase2 EVALDIR=/data/eval CHECKPOINTDIR_PHASE1=/data/phase1 \
#   LOGDIR=$PWD/results NEXP=10 ./run_with_docker.sh [--dry-run]
#
# Required: CONT (image built from the Dockerfile), DGXSYSTEM (selects config_${DGXSYSTEM}.sh
# next to this script), DATADIR_PHASE2, EVALDIR, CHECKPOINTDIR_PHASE1 (init checkpoint and
# bert_config.json). Optional: NEXP (runs, default 10: a BERT submission has 10), LOGDIR (default
# ./results), CLEAR_CACHES (1: drop the page cache before each run, as MLPerf requires),
# SEED (run i gets SEED+i-1; default: run_and_time.sh picks one), DATESTAMP, DOCKER_GPUS
# (docker --gpus value, default all; none for no GPUs), MLPERF_RULESET (default 5.0.0), NCCL_TEST
# (1: the all-reduce check of `preflight` below first; NCCL_TEST_MIN_BUSBW_GBPS from the config).
#
# Per run: drop the host page cache from a privileged helper container (no sudo needed), log
# cache_clear with mlperf_logging.mllog, print a :::SYSJSON line describing the machine, run
# run_and_time.sh, all into $LOGDIR/<DATESTAMP>_<i>.log; then run the MLPerf compliance checker
# on that log (its report goes to $LOGDIR/<DATESTAMP>_<i>.compliance.txt).
# --dry-run prints the docker commands instead of running them. A multi-node system runs this
# script on every node with NODE_RANK (0..DGXNNODES-1) and MASTER_ADDR (node 0) set, or with
# RDZV_BACKEND=c10d and MASTER_ADDR (any one node; RDZV_ENDPOINT, RDZV_ID: docs/FAULTS.md);
# under SLURM use run.sub instead.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
readonly here
readonly CONT_REPO=/workspace/bert CONT_DATA=/workspace/data_phase2 CONT_EVAL=/workspace/evaldata
readonly CONT_PHASE1=/workspace/phase1 CONT_LOGS=/results
readonly EXIT_BAD_INPUT=2  # the trainer's code for a config or data it refuses (runtime/exits.py)

die() { echo "run_with_docker.sh: $*" >&2; exit 2; }

require() {
  local name
  for name in "$@"; do
    [[ -n "${!name:-}" ]] || die "$name is not set (see the header of this script)"
  done
}

absolute() { if [[ "$1" == /* ]]; then echo "$1"; else echo "$PWD/$1"; fi; }

# shellcheck source=/dev/null
source "$here/tools/script_args.sh"
DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    *) help_or_refuse run_with_docker.sh "${BASH_SOURCE[0]}" "CONT=... DGXSYSTEM=... ./run_with_docker.sh [--dry-run]" "$arg" ;;
  esac
done

require CONT DGXSYSTEM DATADIR_PHASE2 EVALDIR CHECKPOINTDIR_PHASE1
NEXP=${NEXP:-10}
CLEAR_CACHES=${CLEAR_CACHES:-1}
DATESTAMP=${DATESTAMP:-$(date +%y%m%d%H%M%S%N)}
DOCKER_GPUS=${DOCKER_GPUS:-all}
MLPERF_RULESET=${MLPERF_RULESET:-5.0.0}
LOGDIR=$(absolute "${LOGDIR:-results}")
DATADIR_PHASE2=$(absolute "$DATADIR_PHASE2")
EVALDIR=$(absolute "$EVALDIR")
CHECKPOINTDIR_PHASE1=$(absolute "$CHECKPOINTDIR_PHASE1")
readonly CONT_NAME=mlperf_bert_${DATESTAMP}

config="$here/config_${DGXSYSTEM}.sh"
[[ -f "$config" ]] || die "no $config: DGXSYSTEM must name a config_<SYSTEM>.sh next to this script"
# shellcheck source=/dev/null
source "$config"
# The names the config exports; each is handed to the container with `docker exec --env NAME`.
mapfile -t config_names < <(sed -n 's/^[[:space:]]*export[[:space:]]\{1,\}\([A-Za-z_][A-Za-z0-9_]*\)=.*/\1/p' "$config")
# shellcheck source=/dev/null
source "$here/tools/launch_checks.sh"
check_launch_ranges
in_range NEXP 1 "" "the number of runs (a BERT submission has 10)"
in_range SEED 0 4294967295 "the trainer's seed range (run i gets SEED+i-1)"
NODE_RANK=${NODE_RANK:-0}
if [[ "${DGXNNODES:-1}" != 1 ]]; then
  # Without SLURM, a multi-node system runs this script once on every node (pdsh, ansible, ...).
  [[ -n "${MASTER_ADDR:-}" ]] || die "$DGXSYSTEM has DGXNNODES=$DGXNNODES: run this script on every node with \
NODE_RANK=0..$((DGXNNODES - 1)) and MASTER_ADDR=<node 0's address>, or use run.sub under SLURM"
fi
MASTER_PORT=${MASTER_PORT:-29500}

if [[ $DRY_RUN == 0 ]]; then
  for dir in "$DATADIR_PHASE2" "$EVALDIR" "$CHECKPOINTDIR_PHASE1"; do
    [[ -e "$dir" ]] || die "$dir does not exist"
  done
  mkdir -p "$LOGDIR"
fi

# Runs docker, or prints the command line under --dry-run.
dock() {
  if [[ $DRY_RUN == 1 ]]; then
    printf '%q ' docker "$@"
    printf '\n'
  else
    docker "$@"
  fi
}

# Runs a command with its stdout discarded, except under --dry-run where it is the printout.
quiet() { if [[ $DRY_RUN == 1 ]]; then "$@"; else "$@" >/dev/null; fi; }

start_container() {
  local gpus=()
  [[ "$DOCKER_GPUS" == none ]] || gpus=(--gpus "$DOCKER_GPUS")
  # --ipc=host: NCCL and data-loader workers need a large /dev/shm; memlock for pinned memory.
  quiet dock run --rm --detach --init --name "$CONT_NAME" "${gpus[@]}" --ipc=host --net=host \
    --ulimit memlock=-1 --ulimit stack=67108864 \
    -v "$DATADIR_PHASE2:$CONT_DATA:ro" -v "$EVALDIR:$CONT_EVAL:ro" \
    -v "$CHECKPOINTDIR_PHASE1:$CONT_PHASE1:ro" -v "$LOGDIR:$CONT_LOGS" \
    "$CONT" sleep infinity
}

cleanup() { quiet dock container rm --force "$CONT_NAME" || true; }

clear_caches() {
  # drop_caches is global to the kernel, so a privileged container clears the host's page cache.
  quiet dock run --rm --privileged --entrypoint /bin/bash "$CONT" \
    -c 'sync && echo 3 > /proc/sys/vm/drop_caches' || return
  dock exec "$CONT_NAME" python -c 'from mlperf_logging import mllog
from mlperf_logging.mllog import constants
mllog.get_mllogger().event(key=constants.CACHE_CLEAR, value=True)'
}

# The environment of the training process: the config's variables plus container paths.
exec_env() {
  local index=$1 name
  for name in "${config_names[@]}"; do printf '%s\0' --env "$name"; done
  printf '%s\0' --env "DATADIR_PHASE2=$CONT_DATA" --env "EVALDIR=$CONT_EVAL" \
    --env "CHECKPOINTDIR_PHASE1=$CONT_PHASE1" --env "LOGDIR=$CONT_LOGS" \
    --env "OUTPUT_DIR=$CONT_LOGS/${DATESTAMP}_${index}"
  if [[ -n "${SEED:-}" ]]; then printf '%s\0' --env "SEED=$((SEED + index - 1))"; fi
  if [[ "$CLEAR_CACHES" == 1 ]]; then printf '%s\0' --env MLPERF_CACHE_CLEARED=1; fi
  if [[ "${DGXNNODES:-1}" != 1 ]]; then
    printf '%s\0' --env "NODE_RANK=$NODE_RANK" --env "MASTER_ADDR=$MASTER_ADDR" --env "MASTER_PORT=$MASTER_PORT"
    for name in RDZV_BACKEND RDZV_ENDPOINT RDZV_ID; do
      if [[ -n "${!name:-}" ]]; then printf '%s\0' --env "$name=${!name}"; fi
    done
  fi
}

# NCCL_TEST=1: before the first run, a short all-reduce bandwidth check on every GPU (of every node,
# each running this script; pytorch/nccl_preflight.py through torchrun, as run_and_time.sh starts
# the trainer); below NCCL_TEST_MIN_BUSBW_GBPS, or with a rank that does not join, it prints one line
# naming the rank and host and no run starts.
preflight() {
  [[ "${NCCL_TEST:-0}" == 1 ]] || return 0
  local env_args rendezvous=(--standalone)
  mapfile -d '' -t env_args < <(exec_env 0)
  if [[ "${DGXNNODES:-1}" != 1 && "${RDZV_BACKEND:-static}" == c10d ]]; then
    rendezvous=(--nnodes="$DGXNNODES" --rdzv_backend=c10d --rdzv_endpoint="${RDZV_ENDPOINT:-$MASTER_ADDR:$MASTER_PORT}"
      --rdzv_id="${RDZV_ID:-mlperf_bert}_nccl_test")
  elif [[ "${DGXNNODES:-1}" != 1 ]]; then
    rendezvous=(--nnodes="$DGXNNODES" --node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT")
  fi
  dock exec "${env_args[@]}" "$CONT_NAME" python "$CONT_REPO/pytorch/launch.py" "${rendezvous[@]}" \
    --nproc_per_node="$DGXNGPU" "$CONT_REPO/pytorch/nccl_preflight.py"
}

run_one() {
  local index=$1 env_args
  mapfile -d '' -t env_args < <(exec_env "$index")
  echo "Beginning trial $index of $NEXP"
  if [[ "$CLEAR_CACHES" == 1 ]]; then
    clear_caches || return
  else
    echo "warning: CLEAR_CACHES=$CLEAR_CACHES: no cache_clear, the log will not comply" >&2
  fi
  dock exec "${env_args[@]}" "$CONT_NAME" python "$CONT_REPO/tools/package_results.py" sysjson \
    || echo "warning: no :::SYSJSON line (package_results.py sysjson failed)" >&2
  dock exec "${env_args[@]}" "$CONT_NAME" "$CONT_REPO/run_and_time.sh"
}

check_log() {
  local index=$1
  # The MLPerf log lines are in global rank 0's run log: node 0's under the static rendezvous, under
  # c10d the one with the RESULT line (run_and_time.sh prints it where global rank 0 ran).
  if [[ "${RDZV_BACKEND:-static}" == c10d ]]; then
    [[ $DRY_RUN == 1 ]] || grep -q '^RESULT,' "$LOGDIR/${DATESTAMP}_${index}.log" || return 0
  else
    [[ "$NODE_RANK" == 0 ]] || return 0
  fi
  quiet dock exec "$CONT_NAME" python -m mlperf_logging.compliance_checker --usage training \
    --ruleset "$MLPERF_RULESET" --log_output "$CONT_LOGS/${DATESTAMP}_${index}.compliance.txt" \
    "$CONT_LOGS/${DATESTAMP}_${index}.log" 2>/dev/null
}

main() {
  local index status failed=0 first_code=0 first_failed=0
  trap cleanup EXIT
  start_container
  status=0
  preflight || status=$?
  [[ $status == 0 ]] || { echo "run_with_docker.sh: NCCL_TEST failed (exit code $status): no run started" >&2; exit "$status"; }
  for ((index = 1; index <= NEXP; index++)); do
    if [[ $DRY_RUN == 1 ]]; then
      echo "# run $index of $NEXP -> $LOGDIR/${DATESTAMP}_${index}.log"
      run_one "$index"
      check_log "$index"
      continue
    fi
    status=0
    run_one "$index" 2>&1 | tee "$LOGDIR/${DATESTAMP}_${index}.log" || status=$?
    if [[ $status != 0 ]]; then
      # The trainer's line is in the log above; its code is run_and_time.sh's (docs/FAULTS.md).
      echo "run $index FAILED with exit code $status (log: $LOGDIR/${DATESTAMP}_${index}.log)" >&2
      failed=$((failed + 1))
      [[ $first_code != 0 ]] || first_code=$status first_failed=$index
      if [[ $status == "$EXIT_BAD_INPUT" ]]; then
        echo "run_with_docker.sh: bad input fails every run the same way: not starting the other runs" >&2
        break
      fi
    elif ! check_log "$index"; then
      echo "run $index does not comply: see $LOGDIR/${DATESTAMP}_${index}.compliance.txt" >&2
      failed=$((failed + 1))
    fi
  done
  # The first failed run's code is the trainer's (2 bad input, 3 blow-up, 75 preempted, 76 lost rank).
  if [[ $first_code != 0 ]]; then
    echo "run_with_docker.sh: $failed of $NEXP runs failed or do not comply; exit code $first_code (run $first_failed's)" >&2
    exit "$first_code"
  fi
  [[ $failed == 0 ]] || die "$failed of $NEXP runs do not comply"
}

main
