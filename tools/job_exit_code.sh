# shellcheck shell=bash
# job_exit_code DIR FALLBACK: the exit code of a launch whose ranks leave their own codes in DIR
# (MLPERF_BERT_EXIT_DIR, one <pid>.code file per rank that stopped with a code of its own):
# the lowest code that is not 76 (a lost rank is what the others see when one fails), else 76;
# FALLBACK (the launcher's own code) when no rank left one. mlperf_bert.runtime.exits.job_exit_code
# is the same rule for the torchrun launcher. Sourced by run_and_time.sh and run.sub.
job_exit_code() {
  local dir=$1 fallback=$2 codes
  codes=$(cat "$dir"/*.code 2>/dev/null | sort -n | uniq) || true
  if [[ -z "$codes" ]]; then
    echo "$fallback"
  else
    grep -vx 76 <<<"$codes" | head -n 1 | grep . || echo 76
  fi
}
