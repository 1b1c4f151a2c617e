#!/usr/bin/env bash
# Start, inspect or stop N local reward server replicas (one per visible GPU, or N on CPU).
#
#   ./run_server.sh start  [--replicas N] [--base-port P] [--scorers a,b] [--host H] [--run-dir D] [-- SERVER_ARGS...]
#   ./run_server.sh status [--run-dir D]
#   ./run_server.sh stop   [--run-dir D]
#
# Replica i listens on base-port + i, logs to RUN_DIR/replica-i.log and records its pid in
# RUN_DIR/replica-i.pid (RUN_DIR defaults to ./.run/reward). With GPUs (CUDA_VISIBLE_DEVICES, else
# nvidia-smi) replica i is pinned to GPU i mod #GPUs and --replicas defaults to #GPUs; without GPUs it
# defaults to 1. Arguments after "--" go to every `python -m reward_server` (e.g. --max-batch-size 64);
# pass the token through REWARD_SERVER_TOKEN rather than --token. The interpreter is ${PYTHON:-python}.
# Each replica gets a unique --instance-id (RUN_DIR/replica-i.instance): it counts as ready only when its
# /readyz answers with that id, so a server of another pool on the same port is never taken for it.
set -euo pipefail

PYTHON="${PYTHON:-python}"
RUN_DIR="./.run/reward"
REPLICAS=""
BASE_PORT=8000
SCORERS="digit,brightness,jpeg_compressibility"
HOST="127.0.0.1"
READY_TIMEOUT_S="${READY_TIMEOUT_S:-180}"
STOP_GRACE_S="${STOP_GRACE_S:-75}"  # > drain grace + the server's 60 s graceful shutdown
SERVER_ARGS=()

usage() {
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
  exit "${1:-2}"
}

die() {
  echo "run_server.sh: $*" >&2
  exit 1
}

[[ $# -ge 1 ]] || usage
COMMAND="$1"
shift
while [[ $# -gt 0 ]]; do
  case "$1" in
    --replicas) REPLICAS="$2"; shift 2 ;;
    --base-port) BASE_PORT="$2"; shift 2 ;;
    --scorers) SCORERS="$2"; shift 2 ;;
    --host) HOST="$2"; shift 2 ;;
    --run-dir) RUN_DIR="$2"; shift 2 ;;
    -h|--help) usage 0 ;;
    --) shift; SERVER_ARGS=("$@"); break ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

# Prints the visible GPU ids, one per line (nothing on a CPU-only machine).
visible_gpus() {
  if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
    tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | sed '/^ *$/d'
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null || true
  fi
}

# Exit status 0 if URL/readyz answers 200 from the server started with --instance-id INSTANCE (not from
# whatever else may listen on that port).
is_ready() {
  "$PYTHON" - "$1" "$2" <<'EOF' >/dev/null 2>&1
import json, sys, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
with opener.open(sys.argv[1] + "/readyz", timeout=2) as reply:
    sys.exit(0 if reply.status == 200 and json.load(reply).get("instance") == sys.argv[2] else 1)
EOF
}

# Exit status 0 if the process exists and is not a zombie (a replica that died while we wait for it).
pid_alive() {
  # A live replica: the process exists, is not a zombie and runs reward_server. A pid file left by a crash
  # may name a number the system has since given to another process, which must never be signalled.
  local state args
  state="$(ps -o stat= -p "$1" 2>/dev/null)" || return 1
  args="$(ps -o args= -p "$1" 2>/dev/null)" || return 1
  [[ -n "$state" && "$state" != Z* && "$args" == *reward_server* ]]
}

url_of() {
  # The URL recorded next to the pid file by `start`.
  cat "$RUN_DIR/replica-$1.url"
}

instance_of() {
  # Empty for a pool started before instance ids were recorded: its replicas then never count as ready.
  cat "$RUN_DIR/replica-$1.instance" 2>/dev/null || true
}

# Prints why replica ID is not serving (WHY) and the end of its log, stops every replica and exits 1.
fail_start() {
  local id="$1" why="$2" log="$RUN_DIR/replica-$1.log"
  echo "run_server.sh: replica $id $why; end of its log $log:" >&2
  tail -n 30 "$log" >&2
  if grep -q "address already in use" "$log"; then
    echo "run_server.sh: port $(( BASE_PORT + id )) is taken by another process (another pool?): stop it," \
      "or pass another --base-port (replica i listens on base-port + i)" >&2
  fi
  cmd_stop >/dev/null
  exit 1
}

replica_ids() {
  local pidfile
  for pidfile in "$RUN_DIR"/replica-*.pid; do
    [[ -e "$pidfile" ]] || continue
    pidfile="${pidfile##*/replica-}"
    echo "${pidfile%.pid}"
  done | sort -n
}

cmd_start() {
  local id pid
  for id in $(replica_ids); do
    pid="$(cat "$RUN_DIR/replica-$id.pid")"
    pid_alive "$pid" && die "replica $id is already running (pid $pid); run './run_server.sh stop' first"
  done
  mkdir -p "$RUN_DIR"
  rm -f "$RUN_DIR"/replica-*.pid "$RUN_DIR"/replica-*.url "$RUN_DIR"/replica-*.instance

  local gpus=()
  mapfile -t gpus < <(visible_gpus)
  if [[ -z "$REPLICAS" ]]; then
    REPLICAS=$(( ${#gpus[@]} > 0 ? ${#gpus[@]} : 1 ))
  fi
  [[ "$REPLICAS" =~ ^[1-9][0-9]*$ ]] || die "--replicas must be a positive integer, got '$REPLICAS'"

  local i port device url instance
  for (( i = 0; i < REPLICAS; i++ )); do
    port=$(( BASE_PORT + i ))
    device=""
    [[ ${#gpus[@]} -gt 0 ]] && device="${gpus[$(( i % ${#gpus[@]} ))]}"
    url="http://$HOST:$port"
    [[ "$HOST" == *:* ]] && url="http://[$HOST]:$port"  # an IPv6 address
    instance="$(hostname)-$port-replica-$i-$(printf '%04x%04x' "$RANDOM" "$RANDOM")"
    CUDA_VISIBLE_DEVICES="$device" PYTHONUNBUFFERED=1 nohup "$PYTHON" -m reward_server \
      --scorers "$SCORERS" --host "$HOST" --port "$port" --instance-id "$instance" \
      ${SERVER_ARGS[@]+"${SERVER_ARGS[@]}"} >"$RUN_DIR/replica-$i.log" 2>&1 </dev/null &
    echo $! >"$RUN_DIR/replica-$i.pid"
    echo "$url" >"$RUN_DIR/replica-$i.url"
    echo "$instance" >"$RUN_DIR/replica-$i.instance"
    echo "replica $i: pid $!, ${device:+GPU $device, }$url, log $RUN_DIR/replica-$i.log"
  done

  local deadline=$(( SECONDS + READY_TIMEOUT_S ))
  for (( i = 0; i < REPLICAS; i++ )); do
    pid="$(cat "$RUN_DIR/replica-$i.pid")"
    until is_ready "$(url_of "$i")" "$(instance_of "$i")" && pid_alive "$pid"; do
      pid_alive "$pid" || fail_start "$i" "exited (pid $pid)"
      (( SECONDS <= deadline )) || fail_start "$i" "not ready after ${READY_TIMEOUT_S}s"
      sleep 0.2
    done
  done
  echo "ready:"
  for (( i = 0; i < REPLICAS; i++ )); do url_of "$i"; done
}

cmd_status() {
  local id pid state failed=0 any=0
  for id in $(replica_ids); do
    any=1
    pid="$(cat "$RUN_DIR/replica-$id.pid")"
    if ! pid_alive "$pid"; then
      state="dead"; failed=1
    elif is_ready "$(url_of "$id")" "$(instance_of "$id")"; then
      state="ready"
    else
      state="not ready"; failed=1
    fi
    echo "replica $id: pid $pid, $(url_of "$id"), $state"
  done
  [[ $any -eq 1 ]] || { echo "no replicas in $RUN_DIR"; return 3; }
  return $failed
}

cmd_stop() {
  local id pid pids=()
  for id in $(replica_ids); do
    pid="$(cat "$RUN_DIR/replica-$id.pid")"
    # It may exit between the check and the signal: then kill fails and there is nothing to wait for.
    if pid_alive "$pid" && kill -TERM "$pid" 2>/dev/null; then
      pids+=("$pid")
    fi
  done
  local deadline=$(( SECONDS + STOP_GRACE_S ))
  for pid in ${pids[@]+"${pids[@]}"}; do
    while pid_alive "$pid" && (( SECONDS < deadline )); do sleep 0.2; done
    if pid_alive "$pid"; then
      echo "run_server.sh: pid $pid still running after ${STOP_GRACE_S}s, killing it" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  rm -f "$RUN_DIR"/replica-*.pid "$RUN_DIR"/replica-*.url "$RUN_DIR"/replica-*.instance
  echo "stopped ${#pids[@]} replica(s)"
}

case "$COMMAND" in
  start) cmd_start ;;
  status) cmd_status ;;
  stop) cmd_stop ;;
  -h|--help|help) usage 0 ;;
  *) die "unknown command '$COMMAND' (start, status or stop)" ;;
esac
