#!/usr/bin/env bash
# `make test`: the system tools some tests start for real (shellcheck on every script, a
# single-node SLURM for run.sub). Installed from Debian when running as root with apt-get;
# otherwise the missing ones are named here, and the tests that need them fail saying so.
set -euo pipefail

# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/script_args.sh"
for arg in "$@"; do
  help_or_refuse install_test_tools.sh "${BASH_SOURCE[0]}" "bash tools/install_test_tools.sh (no arguments)" "$arg"
done
missing=()
command -v shellcheck >/dev/null || missing+=(shellcheck)
PATH="/usr/sbin:$PATH" command -v slurmctld >/dev/null || missing+=(slurm-wlm)
(( ${#missing[@]} )) || exit 0

if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
  apt-get update -qq >/dev/null 2>&1 || true
  if DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1
  then
    exit 0
  fi
fi
echo "note: ${missing[*]} not installed (apt-get install ${missing[*]}, as root); the tests that need them will fail" >&2
