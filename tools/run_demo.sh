#!/usr/bin/env bash
# `make demo`: make the demo data, train config_CPU_1x2.sh to its target on the CPU, check the
# MLPerf log with the official compliance checker (rulesets 5.0.0 and 2.0.0), print the result.
# `tools/run_demo.sh --data-only` makes the demo data (in DEMO_DATA), verified, and stops.
# Runs go to demo_runs/<system>/ (not committed; LOGDIR overrides): results/ holds only the
# runs that were packaged on purpose. DEMO_CONFIG names another config file to train;
# PRECISION in the environment replaces the config's (`PRECISION=fp8 make demo`: the encoder's
# linear layers in emulated FP8, the rest bf16), and its runs go to demo_runs/<system>_<precision>/.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"
# shellcheck source=/dev/null
source tools/script_args.sh
data_only=0
for arg in "$@"; do
  case "$arg" in
    --data-only) data_only=1 ;;
    *) help_or_refuse run_demo.sh "${BASH_SOURCE[0]}" "bash tools/run_demo.sh [--data-only]" "$arg" ;;
  esac
done
PYTHON=${PYTHON:-python3}
DEMO_DATA=${DEMO_DATA:-$here/demo_data}

precision=${PRECISION:-}
# shellcheck source=/dev/null
source "${DEMO_CONFIG:-$here/config_CPU_1x2.sh}"
PRECISION=${precision:-$PRECISION}

if [[ ! -f "$DEMO_DATA/.complete" ]]; then
  echo "making the demo dataset in $DEMO_DATA"
  "$PYTHON" data_prep/make_demo_data.py --output_dir "$DEMO_DATA" --seed 12345 \
    --num_train "$DEMO_NUM_TRAIN" --num_eval "$NUM_EVAL_EXAMPLES" --num_shards "$DEMO_NUM_SHARDS" \
    --max_seq_length "$MAX_SEQ_LENGTH" --max_predictions_per_seq "$MAX_PREDICTIONS_PER_SEQ" \
    --vocab_size "$DEMO_VOCAB_SIZE" --hidden_size "$DEMO_HIDDEN_SIZE" \
    --num_hidden_layers "$DEMO_NUM_LAYERS" --num_attention_heads "$DEMO_NUM_HEADS" \
    --intermediate_size "$DEMO_INTERMEDIATE_SIZE"
  touch "$DEMO_DATA/.complete"
fi
# A run trains verified data only (VERIFIED.json, docs/DATA_INTEGRITY.md): demo data made before the
# verification records gets them here, as make_demo_data.py writes them for new data.
if [[ ! -f "$DEMO_DATA/train/VERIFIED.json" || ! -f "$DEMO_DATA/eval/VERIFIED.json" ]]; then
  echo "verifying the demo dataset in $DEMO_DATA"
  "$PYTHON" data_prep/verify_dataset.py "$DEMO_DATA/train" "$DEMO_DATA/eval" --eval_dir "$DEMO_DATA/eval" \
    --vocab_size "$(wc -l < "$DEMO_DATA/vocab.txt")" --max_seq_length "$MAX_SEQ_LENGTH" \
    --max_predictions "$MAX_PREDICTIONS_PER_SEQ" --workers 1 > /dev/null
fi
if ((data_only)); then exit 0; fi

SEED=${SEED:-$RANDOM}
stamp=$(date +%y%m%d%H%M%S)
LOGDIR=${LOGDIR:-$here/demo_runs/$DGXSYSTEM${precision:+_$precision}}
mkdir -p "$LOGDIR"
log="$LOGDIR/${stamp}_${SEED}.log"
export SEED PYTHON
export DATADIR_PHASE2="$DEMO_DATA/train" EVALDIR="$DEMO_DATA/eval"
export BERT_CONFIG="$DEMO_DATA/bert_config.json" INIT_CHECKPOINT=none
export OUTPUT_DIR="$LOGDIR/${stamp}_${SEED}" MLPERF_LOG_FILE="$log"
# The checks below read the MLPerf log file; stdout.txt keeps only the launcher's lines.
export ECHO_MLLOG=0

mkdir -p "$OUTPUT_DIR"
echo "training $DGXSYSTEM, precision $PRECISION (seed $SEED); MLPerf log: $log"
"$here/run_and_time.sh" > "$OUTPUT_DIR/stdout.txt" || {
  echo "the demo run failed; its output is in $OUTPUT_DIR/stdout.txt" >&2
  exit 1
}

failed=0
for ruleset in 5.0.0 2.0.0; do
  report="$OUTPUT_DIR/compliance_$ruleset.txt"
  "$PYTHON" -m mlperf_logging.compliance_checker --usage training --ruleset "$ruleset" \
    --log_output "$report" "$log" > /dev/null 2>&1 || true
  if grep -q "SUCCESS" "$report"; then
    echo "compliance checker, ruleset $ruleset: SUCCESS"
  else
    echo "compliance checker, ruleset $ruleset: FAILED (see $report)"
    failed=1
  fi
done
grep '^RESULT,' "$OUTPUT_DIR/stdout.txt" || true
"$PYTHON" - "$log" <<'PY'
import json, sys
events = [json.loads(l.split(":::MLLOG ", 1)[1]) for l in open(sys.argv[1]) if ":::MLLOG" in l]
acc = [e for e in events if e["key"] == "eval_accuracy"]
start = next(e["time_ms"] for e in events if e["key"] == "run_start")
stop = next(e for e in events if e["key"] == "run_stop")
print(f"status {stop['metadata']['status']}: masked-LM accuracy {acc[-1]['value']:.4f} after "
      f"{acc[-1]['metadata']['epoch_num']} samples, {(stop['time_ms'] - start) / 60000:.2f} minutes")
sys.exit(0 if stop["metadata"]["status"] == "success" else 1)
PY
exit "$failed"
