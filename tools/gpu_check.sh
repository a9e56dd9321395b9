#!/usr/bin/env bash
# The fake-CUDA dry run's real twin (`make gpu-check`): every shipped GPU config's flags, as
# run_and_time.sh builds them, run for a few steps and an eval on this machine's GPU by the
# same code the CPU test suite runs on fake CUDA (python -m mlperf_bert.dryrun --real).
# Synthetic batches; the model is BERT_CONFIG (default: BERT-Large). Exit code: 0 when every
# config passes, 1 when any run finds a host read or copy in a capture, too many host reads, or an
# fp8 config whose steps never called torch._scaled_mm; on a GPU without FP8 tensor cores (below
# compute capability 8.9) the fp8 configs fail at the trainer's start-up check, naming it.
#
#   make gpu-check                      # all config_*.sh without DEVICE=cpu
#   CONFIGS="config_DGXA100_1x8.sh" make gpu-check
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
STEPS=${STEPS:-5}
# shellcheck source=/dev/null
source "$here/tools/script_args.sh"
for arg in "$@"; do
  help_or_refuse gpu_check.sh "$0" "[CONFIGS=\"config_<SYSTEM>.sh ...\"] [STEPS=N] bash tools/gpu_check.sh" "$arg"
done
configs=${CONFIGS:-$(cd "$here" && grep -L '^export DEVICE=cpu' config_*.sh)}
for config in $configs; do
  [[ $config == /* ]] || config=$here/$config
  [[ -f $config ]] || { echo "gpu_check.sh: CONFIGS: no file $config; name config_<SYSTEM>.sh files" >&2; exit 2; }
done
[[ $STEPS =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check.sh: STEPS=$STEPS is not a whole number of steps (1 or more)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/data" "$work/eval"
echo '{}' > "$work/data/strata.json"  # local_presort's start-up check; the dry run reads no shards

if [[ -z "${BERT_CONFIG:-}" ]]; then
  BERT_CONFIG=$work/bert_config.json
  cat > "$BERT_CONFIG" <<'JSON'
{"vocab_size": 30522, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
 "intermediate_size": 4096, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
 "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512, "type_vocab_size": 2,
 "initializer_range": 0.02}
JSON
fi

cat > "$work/python" <<EOF_WRAPPER
#!/usr/bin/env bash
exec "$(command -v "$PYTHON")" -m mlperf_bert.dryrun --real --steps "$STEPS" -- "\$@"
EOF_WRAPPER
chmod +x "$work/python"

status=0
for config in $configs; do
  echo "== $config"
  (
    path=$config
    [[ $path == /* ]] || path=$here/$config
    # shellcheck source=/dev/null
    source "$path"
    # Random weights and synthetic batches: not a closed-division run (no phase-1 checkpoint).
    export WORLD_SIZE=1 RANK=0 PYTHON=$work/python BERT_CONFIG DATADIR_PHASE2=$work/data EVALDIR=$work/eval \
      OUTPUT_DIR=$work/out_${config##*/} SEED=1 DIVISION=open
    bash "$here/run_and_time.sh"
  ) || status=1
done
exit "$status"
