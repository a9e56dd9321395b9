#!/usr/bin/env bash
# The prepared GPU measurement: one command, sized to fit 8 minutes on one H100 or H200, that times the
# shipped config of the GPU it runs on (benchmarks/throughput.py --from_config) and what it is made of.
# In order of value, each step within what is left of BUDGET_S (a step that would not fit is skipped
# and says so; the variants leave the time the last two steps need):
#   shipped     the config's own step (packed rows, its precision, compile mode, CUDA graph), and a
#               profile of it: the top 30 kernels by device time
#   variants    the same step with config variables changed (the table below): bf16, FP8 recipes and
#               layers, cuDNN's varlen attention, eager bf16, fp16; each as a multiple of the shipped step's time;
#               the FP8 delayed step profiled too (its top 30 kernels)
#   compiled    beside the GPU steps, on the CPU: the Inductor code of the shipped step and of the FP8 delayed
#               one, generated on the fake device and counted (python -m mlperf_bert.dryrun.compiled: graphs,
#               kernels by kind and the bytes Inductor counts), to lay beside the two profiles' kernel times
#   packed-hf   our packed model against HuggingFace's BertForPreTraining padded to 512, bf16
#   trainer     run_pretraining.py itself with the config's flags (run_and_time.sh, one GPU) on packed
#               shards of the config's shape (data_prep, BERT-Large, random weights) for TRAINER_WARMUP +
#               TRAINER_STEPS steps: its samples/s after the warm-up beside the benchmark's step time
# One folder: summary.txt (one line per step, the verdict last), gpu_perf.log (everything printed),
# throughput.json (every benchmark run's results), trainer.json (the trainer against the benchmark),
# kernels.txt and kernels_fp8_delayed.txt (the profile tables of the shipped and FP8 delayed steps),
# compiled_shipped.json and compiled_fp8_delayed.json (the compiled-step reports): 8 files.
#
#   bash tools/gpu_perf.sh [FOLDER]      # FOLDER: default $OUT, else ./gpu_perf_out
#   SMOKE=1 bash tools/gpu_perf.sh DIR   # CPU smoke mode (tiny sizes, eager, seconds): what `make test` runs
#
# Variables: PYTHON (python3), CONFIG (default: by the GPU's name, H200 -> config_DGXH200_1x8.sh, H100,
# B200, A100 likewise), BUDGET_S (470 s: 8 minutes less a margin, compiles included), VARIANTS (labels
# of the table below, comma-separated: only those), TRAINER_WARMUP (10), TRAINER_STEPS (40; fewer than 30
# timed steps is a failure).
# Offline, as tools/bring_up.sh: wheels in carry/wheels are installed into a temporary folder first on
# PYTHONPATH. Exit status: 0 when every step that ran passed (and at least one ran), 1 otherwise, 2 for
# a usage error.
set -uo pipefail

# The shipped step's variants, in order of value: `label|config variables` (set on top of the config by
# throughput.py --config_var). bf16 and the FP8 recipes decide each config's PRECISION (FP8 ships only where
# it measures faster than bf16); "varlen cudnn" is the shipped per-sequence attention on cuDNN's kernel
# against the FA2 one the config runs (which `auto` keeps until this measures); "rows masked" is the
# attention of the 2026-11-27 run (one call per packed row under a block-diagonal mask) against the shipped
# per-sequence varlen kernel; fp16 is NVIDIA's precision. A variant whose variable run_and_time.sh does not
# read is skipped with a note, as is one whose PRECISION this device lacks, a GPU kernel's (varlen*) off a
# GPU, or one whose values the config already has. The smoke mode times the first that runs.
variants=(
  "bf16|PRECISION=bf16"
  "fp8 delayed|PRECISION=fp8 FP8_RECIPE=delayed"
  "varlen cudnn|ATTENTION_BACKEND=varlen_cudnn"
  "fp8 tensorwise|PRECISION=fp8 FP8_RECIPE=tensorwise"
  "rows masked|ATTENTION_BACKEND=grouped"
  "fp16|PRECISION=fp16"
  "fp8 delayed ffn|PRECISION=fp8 FP8_RECIPE=delayed FP8_LAYERS=ffn"
  "fp8 rowwise|PRECISION=fp8 FP8_RECIPE=rowwise"
  "fp8 rowwise_gw_hp|PRECISION=fp8 FP8_RECIPE=rowwise_gw_hp"
  "bf16 eager|PRECISION=bf16 COMPILE_MODE=none"
)

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-${OUT:-$here/gpu_perf_out}}
PYTHON=${PYTHON:-python3}
SMOKE=${SMOKE:-0}
budget=${BUDGET_S:-470}
start=$SECONDS
trainer_warmup=${TRAINER_WARMUP:-10}
trainer_steps=${TRAINER_STEPS:-40}
report=$here/tools/gpu_perf_report.py
# shellcheck source=/dev/null
source "$here/tools/script_args.sh"
# shellcheck source=/dev/null
source "$here/tools/budget_steps.sh"

usage_error() { echo "gpu_perf.sh: $*" >&2; exit 2; }

# Every argument, variable, the device and the config are checked before the folder is touched.
for arg in "$@"; do
  [[ $arg != -* ]] || help_or_refuse gpu_perf.sh "$0" "[SMOKE=1] [CONFIG=config_<SYSTEM>.sh] bash tools/gpu_perf.sh [FOLDER]" "$arg"
done
(($# <= 1)) || usage_error "one argument at most, the output folder (got $#)"
check_budget gpu_perf.sh "$budget"
[[ $trainer_warmup =~ ^[0-9]+$ && $trainer_steps =~ ^[0-9]+$ ]] ||
  usage_error "TRAINER_WARMUP=$trainer_warmup and TRAINER_STEPS=$trainer_steps must be whole numbers of steps"
declare -A wanted=()
if [[ -n ${VARIANTS:-} ]]; then
  IFS=, read -r -a picked <<< "$VARIANTS"
  for label in "${picked[@]}"; do
    printf '%s\n' "${variants[@]%%|*}" | grep -qxF "$label" ||
      usage_error "VARIANTS: no variant '$label'; choose from: $(printf '%s, ' "${variants[@]%%|*}" | sed 's/, $//')"
    wanted[$label]=1
  done
fi
# Where this runs, and the seconds each kind of step is expected to take (from the first H200 run:
# a compiled BERT-Large set-up takes about 35 s to compile and capture, plus 10 s to start).
if [[ $SMOKE == 1 ]]; then
  device=cpu
  # Every step in its smallest form: the toy model and batches, one round, eager (Inductor on a CPU
  # would take longer than the whole smoke run).
  bench=(--config tiny --device cpu --rounds 1 --steps 2 --warmup 1)
  smoke_vars=(COMPILE_MODE=none)
  need_variant=15 need_hf=15 need_trainer=15
elif gpu=$("$PYTHON" -c 'import torch; assert torch.cuda.is_available(); print(torch.cuda.get_device_name())' \
    2>/dev/null); then
  device=cuda
  bench=(--config large --device cuda --rounds 3 --steps 10 --warmup 3)
  smoke_vars=()
  need_variant=60 need_hf=80 need_trainer=110
else
  usage_error "no CUDA device visible to $PYTHON; SMOKE=1 runs the CPU smoke mode"
fi

# config_for DEVICE_NAME: the shipped single-node config of that GPU.
config_for() {
  case $1 in
    *H200*) echo config_DGXH200_1x8.sh ;;
    *H100*) echo config_DGXH100_1x8.sh ;;
    *B200*) echo config_DGXB200_1x8.sh ;;
    *A100*) echo config_DGXA100_1x8.sh ;;
  esac
}

if [[ -n ${CONFIG:-} ]]; then
  config=$CONFIG
elif [[ $SMOKE == 1 ]]; then
  config=config_DGXH200_1x8.sh  # the shipped H200 step at toy sizes
else
  config=$(config_for "$gpu")
  [[ -n $config ]] || usage_error "no shipped config for the $gpu; name one: CONFIG=config_<SYSTEM>.sh"
fi
config_path=$config
[[ $config_path == /* ]] || config_path=$here/$config
[[ -f $config_path ]] || usage_error "CONFIG=$config: no such file; give a config_<SYSTEM>.sh of the repository"

# config_value NAME: the config's value of NAME (sourced as the launchers source it).
config_value() {
  bash -c 'source "$0" && echo "${!1:-}"' "$config_path" "$1"
}

# known_to_launcher NAME: whether run_and_time.sh reads the config variable NAME.
known_to_launcher() { grep -qw -- "$1" "$here/run_and_time.sh"; }

# record: every benchmark run so far, as one throughput.json (after each step, so that a run cut short
# keeps what it measured).
record() {
  local items=() file
  for file in "$work"/tp_*.json; do
    [[ -e $file ]] && items+=("$(basename "$file" .json | sed 's/^tp_//')=$file")
  done
  "$PYTHON" "$report" merge "$out/throughput.json" "${items[@]}" 2>> "$log"
}

# bench_step NAME LIMIT_S JSON [FLAGS...]: throughput.py, then its figures as indented summary lines.
bench_step() {
  local name=$1 limit=$2 json=$3
  shift 3
  step "$name" "$limit" "$PYTHON" benchmarks/throughput.py "${bench[@]}" --json "$json" "$@"
  if [[ -f $json ]]; then
    local against=()
    [[ $json != "$work/tp_shipped.json" && -f $work/tp_shipped.json ]] && against=(--against "$work/tp_shipped.json")
    "$PYTHON" "$report" bench "$json" "${against[@]}" 2>&1 | sed 's/^/    /' |
      tee -a "$summary"
  fi
  record
}

shipped() {
  local from=(--from_config "$config")
  for var in "${smoke_vars[@]}"; do from+=(--config_var "$var"); done
  bench_step "shipped $config" 150 "$work/tp_shipped.json" "${from[@]}" --profile_dir "$work/profile"
  keep_kernels "$work/profile" kernels.txt
}

# variant LABEL VARS: the shipped step with VARS on top, unless the launcher or the device lacks them, or
# the config already has them.
variant() {
  local label=$1 vars=$2 var same=1 from=(--from_config "$config") reserve=$((need_hf + need_trainer)) left
  read -r -a given <<< "$vars"
  for var in "${given[@]}"; do
    if ! known_to_launcher "${var%%=*}"; then
      note "$(printf '%-26s %s' "variant $label" "skipped: run_and_time.sh does not read ${var%%=*} yet")"
      return
    fi
    if [[ $var == PRECISION=* && " ${precisions[*]} " != *" ${var#PRECISION=} "* ]]; then
      note "$(printf '%-26s %s' "variant $label" "skipped: ${var#PRECISION=} is not supported on this device")"
      return
    fi
    if [[ $var == ATTENTION_BACKEND=varlen* && $device != cuda ]]; then
      note "$(printf '%-26s %s' "variant $label" "skipped: ${var#ATTENTION_BACKEND=} runs GPU kernels only")"
      return
    fi
    [[ $(config_value "${var%%=*}") == "${var#*=}" ]] || same=0
  done
  if ((same)); then  # e.g. bf16 on the A100 config, which trains in bf16
    note "$(printf '%-26s %s' "variant $label" "skipped: $config already has $vars (the shipped step)")"
    return
  fi
  if [[ $SMOKE == 1 && -n $smoke_variant ]]; then  # one shows that the machinery works; each costs a start-up
    note "$(printf '%-26s %s' "variant $label" "skipped: the smoke mode times one variant ($smoke_variant)")"
    return
  fi
  smoke_variant=$label
  # The reserve stays free after the variant, whatever it takes past its limit (STEP_OVER_S).
  fits "variant $label" $((need_variant + reserve + STEP_OVER_S)) "${reserve} s kept for packed-hf and the trainer" ||
    return
  left=$(($(budget_left) - reserve - STEP_OVER_S))
  for var in "${smoke_vars[@]}" "${given[@]}"; do from+=(--config_var "$var"); done
  local slug=${label// /_} profile=()
  [[ $label == "$profiled_variant" ]] && profile=(--profile_dir "$work/profile_$slug")
  bench_step "variant $label" $((left < 150 ? left : 150)) "$work/tp_variant_$slug.json" "${from[@]}" "${profile[@]}"
  ((${#profile[@]})) && keep_kernels "$work/profile_$slug" "kernels_$slug.txt"
}

# keep_kernels PROFILE_DIR NAME: the profile's kernel table into the folder as NAME, and its summary line.
keep_kernels() {
  local table
  table=$(find "$1" -name '*.txt' 2>/dev/null | head -n 1)
  if [[ -n $table ]]; then
    cp "$table" "$out/$2"
    note "    $("$PYTHON" "$report" kernels "$table" 2>&1); $2: the top 30"
  fi
}

# The compiled-step reports (CPU only, `nice`d beside the GPU steps): the shipped step and the FP8 delayed one.
# Started first, collected last (compiled_wait). Not in the smoke mode: tests/trainer/dryrun/test_compiled_step.py runs the
# command, and a CPU-only machine has no GPU step to run it beside.
compiled_start() {
  if [[ $SMOKE == 1 ]]; then
    note "$(printf '%-26s %s' "compiled reports" "skipped: the smoke mode (tests/trainer/dryrun/test_compiled_step.py runs the command)")"
    return
  fi
  local name vars
  for name in shipped fp8_delayed; do
    vars=()
    [[ $name == fp8_delayed ]] && vars=(--config_var PRECISION=fp8 --config_var FP8_RECIPE=delayed)
    echo "=== compiled $name (background): python -m mlperf_bert.dryrun.compiled $config ${vars[*]}" >> "$log"
    (cd "$here" && nice -n 19 timeout --kill-after="$KILL_AFTER_S" "$budget" "$PYTHON" -m mlperf_bert.dryrun.compiled \
      "$config" "${vars[@]}" --json "$out/compiled_$name.json" > "$work/compiled_$name.log" 2>&1
      echo $? > "$work/compiled_$name.rc") &
  done
}

compiled_wait() {
  [[ $SMOKE == 1 ]] && return
  wait
  local name rc status
  for name in shipped fp8_delayed; do
    cat "$work/compiled_$name.log" >> "$log"
    rc=$(cat "$work/compiled_$name.rc" 2>/dev/null || echo "?")
    ran_steps=$((ran_steps + 1))
    case $rc in
      0) status=passed ;;
      *) status="FAILED (exit $rc)"; failed=1 ;;
    esac
    note "$(printf '%-26s %-24s %s' "compiled $name" "$status" \
      "$(grep -E '^one step|^graph breaks' "$work/compiled_$name.log" | tr '\n' ';' | sed 's/;$//')")"
  done
}

packed_vs_hf() {
  fits "packed-hf bf16" "$need_hf" || return
  local shape=() limit=150 left
  [[ $SMOKE == 1 ]] || shape=(--rounds 3 --steps 5 --warmup 3)  # HF padded is 2-6x slower: fewer steps
  left=$(($(budget_left) - need_trainer - STEP_OVER_S))  # the trainer's time stays free where both fit
  ((left >= need_hf && left < limit)) && limit=$left
  bench_step "packed-hf bf16" "$limit" "$work/tp_packed_vs_hf.json" --precision bf16 --layouts packed,hf_padded \
    "${shape[@]}"
}

# trainer_data DIR BATCH SEQ_LENGTH PREDICTIONS LAYOUT: BERT-Large-shaped sequences (make_demo_data.py: the
# Wikipedia length histogram, MLPerf masking), packed for a packed LAYOUT and verified as real data is,
# enough for every step of the run.
trainer_data() {
  local data=$1 batch=$2 seq_length=$3 predictions=$4 layout=$5 seqs vocab bert
  seqs=$((batch * (trainer_warmup + trainer_steps + 10)))
  [[ $layout == packed ]] && seqs=$((2 * seqs))  # a pack holds about 2 sequences
  if [[ $SMOKE == 1 ]]; then  # throughput.py's tiny model
    vocab=512 bert=(--hidden_size 32 --num_hidden_layers 2 --num_attention_heads 2 --intermediate_size 64)
  else  # BERT-Large
    vocab=30522 bert=(--hidden_size 1024 --num_hidden_layers 24 --num_attention_heads 16 --intermediate_size 4096)
  fi
  local shape=(--max_seq_length "$seq_length" --max_predictions "$predictions")
  {
    printf '%q ' "$PYTHON" data_prep/make_demo_data.py --output_dir "$data" --num_train "$seqs" --num_eval 256 \
      --num_shards 2 --max_seq_length "$seq_length" --max_predictions_per_seq "$predictions" --vocab_size "$vocab" \
      "${bert[@]}"
    echo
    if [[ $layout == packed ]]; then
      printf '%q ' "$PYTHON" data_prep/prepare.py --quiet pack --input "$data/train" --out "$data/packed" \
        "${shape[@]}" --workers 1
      echo
      printf '%q ' "$PYTHON" data_prep/verify_dataset.py "$data/packed" --eval_dir "$data/eval" \
        --vocab_size "$vocab" "${shape[@]}" --workers 1
      echo
    fi
  } > "$work/trainer_data.sh"
  step "trainer data" 120 bash -e "$work/trainer_data.sh"
}

trainer() {
  fits "trainer" "$need_trainer" || return
  local data=$work/trainer_data layout train_dir sizes=()
  layout=$(config_value INPUT_LAYOUT)
  if [[ $SMOKE == 1 ]]; then  # throughput.py's tiny step: 4 rows of 64 tokens
    sizes=(BATCHSIZE=4 MAX_SEQ_LENGTH=64 MAX_PREDICTIONS_PER_SEQ=10 DEVICE=cpu CUDA_GRAPHS=0 EVAL_CUDA_GRAPH=0)
    trainer_data "$data" 4 64 10 "$layout"
  else
    trainer_data "$data" "$(config_value BATCHSIZE)" "$(config_value MAX_SEQ_LENGTH)" \
      "$(config_value MAX_PREDICTIONS_PER_SEQ)" "$layout"
  fi
  train_dir=$data/train
  [[ $layout == packed ]] && train_dir=$data/packed
  # The config's flags on one GPU (world size 1: the step of one of its ranks); random weights, so
  # the open division; the run stops after its steps; progress lines every 10 steps, at the config's
  # host reads (SYNC_EVERY=10), so that each line's time is the device's.
  local vars=(PYTHON="$PYTHON" DGXNGPU=1 DGXNNODES=1 DATADIR_PHASE2="$train_dir" EVALDIR="$data/eval"
    BERT_CONFIG="$data/bert_config.json" INIT_CHECKPOINT=none DIVISION=open OUTPUT_DIR="$work/trainer_out" SEED=1
    NUM_EVAL_EXAMPLES=256 MAX_STEPS=$((trainer_warmup + trainer_steps)) LOG_FREQ="$log_every" ECHO_MLLOG=0
    "${smoke_vars[@]}" "${sizes[@]}")
  # shellcheck disable=SC2016  # $0 and $@ are the inner shell's
  step "trainer" 240 bash -c 'source "$0" && exec env "$@"' "$config_path" "${vars[@]}" bash run_and_time.sh
  step "trainer vs benchmark" 30 "$PYTHON" "$report" trainer "$work/trainer_out/train.log" \
    "$work/tp_shipped.json" --warmup "$trainer_warmup" --min_steps "$min_trainer_steps" --json "$out/trainer.json"
}

work="" summary="" log="" failed=0 precisions=()  # tools/budget_steps.sh sets them
open_folder gpu_perf.sh gpu_perf.log throughput.json trainer.json kernels.txt kernels_fp8_delayed.txt \
  compiled_shipped.json compiled_fp8_delayed.json
machine_lines gpu-perf "$device"
note "config: $config$([[ $SMOKE == 1 ]] && echo " at toy sizes, ${smoke_vars[*]}")"
log_every=10 min_trainer_steps=30
if [[ $SMOKE == 1 ]]; then
  trainer_warmup=${TRAINER_WARMUP:-2} trainer_steps=${TRAINER_STEPS:-6} log_every=2 min_trainer_steps=4
fi

compiled_start
shipped
smoke_variant="" profiled_variant="fp8 delayed"
for entry in "${variants[@]}"; do
  [[ -z ${VARIANTS:-} || -n ${wanted[${entry%%|*}]:-} ]] && variant "${entry%%|*}" "${entry#*|}"
done
packed_vs_hf
trainer
compiled_wait

# shellcheck disable=SC2154  # counted by step() (tools/budget_steps.sh)
if ((ran_steps == 0)); then
  failed=1
  note "gpu-perf: FAILED: no step ran (BUDGET_S=$budget leaves no time) in $((SECONDS - start)) s"
else
  verdict=passed
  [[ $failed == 0 ]] || verdict="FAILED (the lines above)"
  note "gpu-perf: $verdict ($ran_steps steps ran) in $((SECONDS - start)) s; details in $log"
fi
exit "$failed"
