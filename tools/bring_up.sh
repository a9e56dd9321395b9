#!/usr/bin/env bash
# Validates and measures a new machine in one call (`make bring-up`), sized to fit 9 minutes on one
# H100 or H200. In order of value, each step within what is left of BUDGET_S (a step that would not
# fit is skipped and says so):
#   env        torch, CUDA device, compute capability, optional packages; the precisions it supports
#   numerics   tools/numerics_check.py on BERT-Large (BERT_CONFIG) against its fp64 CPU reference:
#              the shipped fast path (packed, compiled, CUDA graph; fp8 where supported, else bf16),
#              every supported precision (packed rows, eager) and the varlen kernel on unpadded batches
#   pytest     the GPU tests (pytest -m gpu)
#   throughput benchmarks/throughput.py: packed vs HuggingFace padded, bf16 and fp8, interleaved rounds
#   gpu-check  make gpu-check (tools/gpu_check.sh) one shipped config at a time, with each config's peak
#              device memory of its steps (the dry run's line) beside tools/plan.py's estimate if present
# Everything lands in one folder: summary.txt (one line per step, the verdict last), bring_up.log
# (every step's output), numerics.json, throughput.json, pytest_gpu.xml.
#
#   bash tools/bring_up.sh [FOLDER]      # FOLDER: default $OUT, else ./bring_up_out
#   SMOKE=1 bash tools/bring_up.sh DIR   # CPU smoke mode (demo-size model, seconds): what `make test` runs
#
# Offline: wheels in carry/wheels (`make carry` fills it where a package registry is reachable) are
# installed into a temporary folder put first on PYTHONPATH (pip install --no-index; nothing else on
# the machine changes). Variables: PYTHON (python3), BERT_CONFIG (BERT-Large), BUDGET_S (510 s: 9 minutes
# less a margin), CONFIGS (gpu-check's configs; default every config_*.sh without DEVICE=cpu), BENCH_CONFIG
# (the throughput benchmark's model: large), BRING_UP_DEVICE (cpu runs the GPU sequence on the CPU, to try it).
# Exit status: 0 when every step that ran passed and one ran at least, 1 otherwise, 2 for a usage error (a BUDGET_S
# that is not whole seconds, a folder that cannot be written).
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-${OUT:-$here/bring_up_out}}
PYTHON=${PYTHON:-python3}
SMOKE=${SMOKE:-0}
budget=${BUDGET_S:-510}
start=$SECONDS
# shellcheck source=/dev/null
source "$here/tools/script_args.sh"
# shellcheck source=/dev/null
source "$here/tools/budget_steps.sh"

usage_error() { echo "bring_up.sh: $*" >&2; exit 2; }

# Every argument, variable and the device are checked before the folder is touched.
for arg in "$@"; do
  [[ $arg != -* ]] || help_or_refuse bring_up.sh "$0" "[SMOKE=1] bash tools/bring_up.sh [FOLDER]" "$arg"
done
(($# <= 1)) || usage_error "one argument at most, the output folder (got $#)"
check_budget bring_up.sh "$budget"

numerics() {
  local name=$1
  shift
  step "numerics $name" 90 "$PYTHON" tools/numerics_check.py --device "$device" --json "$work/numerics_${name// /_}.json" "$@"
}

# tools/plan.py's traced training peak of config $1 (its "memory per device: training N GiB" line), else
# the line it stopped with; its whole output goes to the log.
plan_estimate() {
  local out rc training
  out=$(cd "$here" && timeout 60 "$PYTHON" tools/plan.py "$1" 2>&1)
  rc=$?
  printf '=== plan %s\n%s\n' "$1" "$out" >> "$log"
  training=$(sed -n 's/^ *memory per device: \(training [0-9.]* GiB\).*/\1/p' <<< "$out" | head -n 1)
  if [[ -n $training ]]; then
    echo "tools/plan.py $training"
  elif ((rc == 124)); then
    echo "tools/plan.py timed out (60 s)"
  else
    echo "tools/plan.py failed (exit $rc): $(grep -v '^\s*$' <<< "$out" | tail -n 1)"
  fi
}

gpu_check_config() {
  local config=$1 plan_note="tools/plan.py not present: no estimate"
  step "gpu-check $config" 100 env CONFIGS="$config" STEPS=3 PYTHON="$PYTHON" BERT_CONFIG="$bert" \
    bash tools/gpu_check.sh
  local verdict peak
  verdict=$(grep -E '^dry run: (passed|FAILED)|: error:' "$work/step.log" | tail -n 1)
  peak=$(grep -o 'peak device memory of .* GiB' "$work/step.log" | tail -n 1)
  [[ -f $here/tools/plan.py ]] && plan_note=$(plan_estimate "$config")
  note "    ${verdict:-no dry run verdict}; ${peak:-no peak memory line}; estimate: $plan_note"
}

if [[ $SMOKE == 1 ]]; then
  device=cpu
elif [[ -n ${BRING_UP_DEVICE:-} ]]; then  # the full sequence on another device (cpu: to try the script itself)
  device=$BRING_UP_DEVICE
elif "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  device=cuda
else
  usage_error "no CUDA device visible to $PYTHON; SMOKE=1 runs the CPU smoke mode"
fi
if [[ $SMOKE != 1 ]]; then
  [[ -z ${BERT_CONFIG:-} || -f $BERT_CONFIG ]] || usage_error "BERT_CONFIG=$BERT_CONFIG: no such file; give a" \
    "bert_config.json, or leave it unset for BERT-Large"
  for config in ${CONFIGS:-}; do
    [[ -f $config && $config == /* || -f $here/$config ]] || usage_error "CONFIGS: no file $config; name" \
      "config_<SYSTEM>.sh files of the repository"
  done
fi

# The test files with GPU tests (pytest -m gpu), under every folder of tests/.
gpu_test_files() { (cd "$here" && grep -rl --include='test_*.py' 'mark.gpu' tests | sort); }

work="" log="" failed=0 ran_steps=0 precisions=()  # tools/budget_steps.sh sets them, and summary
open_folder bring_up.sh bring_up.log numerics.json throughput.json pytest_gpu.xml
machine_lines bring-up "$device"

if [[ $SMOKE == 1 ]]; then
  # The demo-size model, one precision, each step in its smallest form: the script cannot rot.
  numerics fp32 --precision fp32 --input_layout packed --rows 1 --batches 1
  note "pytest gpu: skipped (CPU smoke mode; would run $(gpu_test_files | tr '\n' ' '))"
  step "throughput tiny" 60 "$PYTHON" benchmarks/throughput.py --config tiny --device cpu --precision fp32 \
    --layouts packed --rounds 1 --steps 1 --warmup 0 --json "$out/throughput.json"
  note "gpu-check: skipped (CPU smoke mode; make gpu-check needs a GPU)"
else
  bert=${BERT_CONFIG:-$work/bert_config.json}
  [[ -n ${BERT_CONFIG:-} ]] || cat > "$bert" <<'JSON'
{"vocab_size": 30522, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
 "intermediate_size": 4096, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
 "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512, "type_vocab_size": 2,
 "initializer_range": 0.02}
JSON
  large=(--bert_config_path "$bert" --rows 1 --batches 1)
  fast=bf16
  [[ " ${precisions[*]} " == *" fp8 "* ]] && fast=fp8
  # The shipped configs' path first, then each precision eager, the ones MLPerf trains in first.
  numerics "fast path $fast" --precision "$fast" --input_layout packed --compile_mode default --cuda_graphs "${large[@]}"
  for p in bf16 fp8 fp32 fp16; do
    [[ " ${precisions[*]} " == *" $p "* ]] && numerics "$p" --precision "$p" --input_layout packed --compile_mode none "${large[@]}"
  done
  [[ " ${precisions[*]} " == *" bf16 "* ]] && numerics "varlen bf16" --precision bf16 --input_layout unpadded \
    --attention_backend varlen "${large[@]}"
  mapfile -t gpu_tests < <(gpu_test_files)
  if ! "$PYTHON" -c 'import nvidia.dali' 2> /dev/null; then  # its wheel is far over what can be carried
    mapfile -t gpu_tests < <(printf '%s\n' "${gpu_tests[@]}" | grep -v test_dali_input.py)
    note "pytest gpu: tests/trainer/input/test_dali_input.py left out: NVIDIA DALI is not installed here"
  fi
  step "pytest gpu" 100 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu --junitxml="$out/pytest_gpu.xml" \
    "${gpu_tests[@]}"
  bench=bf16
  [[ " ${precisions[*]} " == *" fp8 "* ]] && bench=bf16,fp8
  step "throughput" 150 "$PYTHON" benchmarks/throughput.py --config "${BENCH_CONFIG:-large}" --device "$device" --precision "$bench" \
    --layouts packed,hf_padded --rounds 3 --steps 5 --warmup 3 --json "$out/throughput.json"
  for config in ${CONFIGS:-$(cd "$here" && grep -L '^export DEVICE=cpu' config_*.sh)}; do
    gpu_check_config "$config"
  done
fi

# One numerics.json: every check's report.
"$PYTHON" - "$out/numerics.json" "$work"/numerics_*.json <<'PY' 2>>"$log" || true
import json, sys
reports = [json.load(open(path)) for path in sys.argv[2:]]
json.dump(reports, open(sys.argv[1], "w"), indent=1)
PY
if ((ran_steps == 0)); then
  note "bring-up: FAILED: no check ran (every step was skipped: the budget of $budget s was spent before the first; raise BUDGET_S); details in $log"
  exit 1
fi
note "bring-up: $([[ $failed == 0 ]] && echo passed || echo 'FAILED (the lines above)') in $((SECONDS - start)) s; details in $log"
exit "$failed"
