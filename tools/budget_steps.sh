# shellcheck shell=bash
# shellcheck disable=SC2034,SC2154  # the variables below are the sourcing script's
# The step machinery of the budgeted GPU scripts (tools/bring_up.sh, tools/gpu_perf.sh), sourced by them.
# A script sets `here` (the repository root), PYTHON, `out` (the output folder), `budget` (seconds for the
# whole script) and `start` ($SECONDS at its start), then calls open_folder, which sets
#   summary  out's summary.txt     log  out's one log of everything     work  a temporary folder
#   failed   0; a step that fails sets it to 1
# Each step's summary line: its name, its status, its seconds and the last line it printed.

# open_folder SCRIPT LOG_NAME OUTPUT...: makes the output folder $out and in it an empty summary.txt and
# LOG_NAME, makes $work (removed at exit) and puts this tree first on PYTHONPATH. A usage error (exit 2)
# where it cannot, or where $out holds an earlier run's summary.txt, LOG_NAME or OUTPUT (the files the
# script writes): a measurement is never overwritten. The script calls it once every input is checked.
open_folder() {
  local name earlier=()
  for name in summary.txt "${@:2}"; do
    [[ -e $out/$name ]] && earlier+=("$name")
  done
  if ((${#earlier[@]})); then
    echo "$1: $out holds an earlier run (${earlier[*]}); give a new folder (bash tools/$1 DIR), or move that" \
      "one away" >&2
    exit 2
  fi
  mkdir -p "$out" || { echo "$1: cannot create the output folder $out" >&2; exit 2; }
  out=$(cd "$out" && pwd)
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  summary=$out/summary.txt
  log=$out/$2
  # Every line goes to these two files: a folder that takes neither stops here, named, not at the first step.
  { : > "$summary" && : > "$log"; } 2> /dev/null || {
    echo "$1: cannot write to the output folder $out; give one you can write (bash tools/$1 DIR)" >&2
    exit 2
  }
  export PYTHONPATH="$here/pytorch:$here/tools:$here${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  failed=0
}

# check_budget SCRIPT BUDGET: BUDGET_S must be a whole number of seconds (a usage error otherwise: exit 2; the
# shell's arithmetic would read "9m" as an error and "abc" as an unset variable). Sets `budget` to it, read as
# decimal ("0510" is 510, not octal). 0 is a budget: every step is skipped, and a run where none ran fails.
check_budget() {
  if [[ ! $2 =~ ^[0-9]+$ ]]; then
    echo "$1: BUDGET_S=$2 is not a whole number of seconds (e.g. BUDGET_S=470)" >&2
    exit 2
  fi
  budget=$((10#$2))
}

note() { echo "$*" | tee -a "$summary"; }

budget_left() { echo $((budget - (SECONDS - start))); }

# fits NAME NEED_S [WHY]: true when NEED_S seconds of the budget are left; otherwise a summary line
# saying that NAME is skipped (and WHY, when given), and false.
fits() {
  local left
  left=$(budget_left)
  ((left >= $2)) && return 0
  ((left < 0)) && left=0
  note "$(printf '%-26s %s' "$1" "skipped: ${left} s left of the budget, needs $2 s${3:+ ($3)}")"
  return 1
}

# step NAME LIMIT_S COMMAND...: runs COMMAND within min(LIMIT_S, the budget left), its output in the log
# and in $work/step.log (for the caller to read after it); one summary line. A step with under 15 s
# left is skipped. `ran_steps` counts the steps that ran. At its limit the command gets SIGTERM, and
# SIGKILL KILL_AFTER_S later: a step may take STEP_OVER_S past its limit, that grace and its summary
# lines and the caller's reports after it. A caller that keeps time free for the steps after this one
# gives it a limit STEP_OVER_S short of what it may spend.
KILL_AFTER_S=10
STEP_OVER_S=$((KILL_AFTER_S + 3))
ran_steps=0
step() {
  local name=$1 limit=$2 left rc t0 status last
  shift 2
  : > "$work/step.log"
  left=$(budget_left)
  if ((left < 15)); then
    note "$(printf '%-26s %s' "$name" "skipped: budget spent")"
    return 0
  fi
  ((limit > left)) && limit=$left
  t0=$SECONDS
  ran_steps=$((ran_steps + 1))
  { echo "=== $name: $*"; } >> "$log"
  (cd "$here" && timeout --kill-after="$KILL_AFTER_S" "$limit" "$@") > "$work/step.log" 2>&1
  rc=$?
  cat "$work/step.log" >> "$log"
  case $rc in
    0) status=passed ;;
    124 | 137) status="timed out (${limit} s)"; failed=1 ;;
    *) status="FAILED (exit $rc)"; failed=1 ;;
  esac
  last=$(grep -v '^\s*$' "$work/step.log" | tail -n 1)
  note "$(printf '%-26s %-24s %4d s  %s' "$name" "$status" $((SECONDS - t0)) "$last")"
  return 0
}

# The wheels of carry/wheels (`make carry`) installed offline into $work/site, put first on PYTHONPATH.
install_carried() {
  local wheels=("$here"/carry/wheels/*.whl)
  if [[ ! -e ${wheels[0]} ]]; then
    note "carry: no wheels in carry/wheels (make carry fills it); using what is installed"
    return
  fi
  if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" \
      "${wheels[@]}" >> "$log" 2>&1; then
    export PYTHONPATH="$work/site:$PYTHONPATH"
    note "carry: installed ${#wheels[@]} wheel(s) offline: ${wheels[*]##*/}"
  else
    note "carry: pip install --no-index of carry/wheels FAILED (see ${log##*/}); using what is installed"
    failed=1
  fi
}

# machine_lines TITLE DEVICE: the summary's first lines: TITLE, date, host, commit and budget (or the smoke
# mode), the carried wheels outside the smoke mode, the facts of the machine and the precisions it supports
# on DEVICE (sets `facts` and `precisions`). Where torch or this package does not import, the script ends (1).
machine_lines() {
  local mode="budget ${budget} s" commit
  [[ $SMOKE == 1 ]] && mode="CPU smoke mode"
  commit=$(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo unknown)
  note "$1 $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), commit $commit, $mode"
  [[ $SMOKE == 1 ]] || install_carried
  if ! facts=$(cd "$here" && describe_machine "$2" 2>> "$log"); then
    note "env: FAILED: torch or this package does not import (${log##*/})"
    exit 1
  fi
  note "env: $(head -n 1 <<< "$facts")"
  read -r -a precisions <<< "$(sed -n 's/^precisions: //p' <<< "$facts")"
  note "env: precisions supported: ${precisions[*]}"
}

# describe_machine DEVICE: the machine's facts on one line, then `precisions: ...`, those it supports
# (the trainer's own start-up checks decide).
describe_machine() {
  "$PYTHON" - "$1" <<'PY'
import importlib.util, platform, sys
import torch
from mlperf_bert.model.fp8 import fp8_unavailable
from mlperf_bert.model.precision import precision_problem
device = torch.device(sys.argv[1])
name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
cc = ".".join(map(str, torch.cuda.get_device_capability(device))) if device.type == "cuda" else "-"
found = {m: importlib.util.find_spec(m) is not None for m in ("torchao", "flash_attn", "triton", "mlperf_logging")}
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, device {name}, "
      f"compute capability {cc}; " + ", ".join(f"{m} {'yes' if ok else 'no'}" for m, ok in found.items()))
supported = [p for p in ("fp32", "bf16", "fp16", "fp8")
             if not (p == "fp16" and device.type != "cuda") and precision_problem(p, device) is None
             and (p != "fp8" or fp8_unavailable(device) is None)]
print("precisions: " + " ".join(supported))
PY
}
