# shellcheck shell=bash
# The launch variables with a range, checked before anything starts: a value outside it would end
# in torchrun's traceback (a port above 65535), wait forever (a node rank no node completes) or
# quietly do something else (NODE_RANK=1 on one node prints no RESULT line). Sourced by
# run_and_time.sh, run_with_docker.sh and run.sub, which each define `die MESSAGE...` (one line,
# exit 2). Unset variables are left alone: each script has its defaults and required names.

# in_range NAME LOW HIGH FIX: NAME, when set, must be a whole number in LOW..HIGH (HIGH "": no bound).
in_range() {
  local name=$1 low=$2 high=$3 fix=$4 value=${!1:-} range
  [[ -n "$value" ]] || return 0
  range=${high:+in $low..$high}
  # At most 10 digits: bash arithmetic wraps around silently past 2^63.
  if [[ ! "$value" =~ ^[0-9]{1,10}$ ]] || (( 10#$value < low )) || { [[ -n "$high" ]] && (( 10#$value > high )); }
  then
    die "$name=$value must be a whole number ${range:->= $low}: $fix"
  fi
}

# endpoint_port_in_range NAME: NAME (host:port or [v6]:port), when set, has a port in 1..65535.
endpoint_port_in_range() {
  local name=$1 value=${!1:-} port
  [[ -n "$value" ]] || return 0
  port=${value##*:}
  if [[ ! "$port" =~ ^[0-9]{1,5}$ ]] || (( 10#$port < 1 || 10#$port > 65535 )); then
    die "$name=$value: the port must be a whole number in 1..65535; give host:port with a free TCP port"
  fi
}

# check_launch_ranges: the node and GPU counts, this node's rank among them, and the rendezvous ports.
check_launch_ranges() {
  in_range DGXNNODES 1 "" "the number of nodes; fix it in the config_<SYSTEM>.sh file"
  in_range DGXNGPU 1 "" "processes per node (one per GPU); fix it in the config_<SYSTEM>.sh file"
  in_range NODE_RANK 0 $((10#${DGXNNODES:-1} - 1)) \
    "each node's own rank among DGXNNODES=${DGXNNODES:-1} nodes (node 0 serves the rendezvous)"
  in_range MASTER_PORT 1 65535 "a free TCP port on the rendezvous node (29500 is usual)"
  endpoint_port_in_range RDZV_ENDPOINT
}
