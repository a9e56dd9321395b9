# shellcheck shell=bash
# The command line of every shell entry point (run_and_time.sh, run_with_docker.sh, run.sub, tools/*.sh,
# .ci/run), sourced before the script does anything: `--help` (or -h) prints the script's header comment,
# which says how to run it, and exits 0; an argument the script does not take is one line naming it and the
# usage, exit 2. Each script reads its own arguments and hands the ones it does not take to help_or_refuse.

# script_help SCRIPT: the header comment of the file SCRIPT (its comment lines from the second line to its
# first line of code; #SBATCH directives left out), without the comment marks.
script_help() {
  sed -n '2,/^[^#]/{/^#SBATCH/d;s/^#\( \|$\)//p;}' "$1"
}

# help_or_refuse NAME SCRIPT USAGE ARG: for `--help` or `-h`, SCRIPT's header on stdout and exit 0; any
# other ARG is refused: "NAME: unknown argument 'ARG'; usage: USAGE (--help says more)", exit 2.
help_or_refuse() {
  if [[ $4 == --help || $4 == -h ]]; then
    script_help "$2"
    exit 0
  fi
  echo "$1: unknown argument '$4'; usage: $3 (--help says more)" >&2
  exit 2
}
