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
set -euo pipefail

PYTHON="${PYTHON:-python}"
RUN_DIR="./.run/reward"
REPLICAS=""
BASE_PORT=8000
SCORERS="digit,brightness,jpeg_compressibility"
HOST="127.0.0.1"
READY_TIMEOUT_S="${READY_TIMEOUT_S:-180}"
STOP_GRACE_S="${STOP_GRACE_S:-30}"
SERVER_ARGS=()

usage() {
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
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

# Exit status 0 if http://HOST:PORT/readyz answers 200.
is_ready() {
  "$PYTHON" - "$1" <<'EOF' >/dev/null 2>&1
import sys, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
sys.exit(0 if opener.open(sys.argv[1] + "/readyz", timeout=2).status == 200 else 1)
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
  rm -f "$RUN_DIR"/replica-*.pid "$RUN_DIR"/replica-*.url

  local gpus=()
  mapfile -t gpus < <(visible_gpus)
  if [[ -z "$REPLICAS" ]]; then
    REPLICAS=$(( ${#gpus[@]} > 0 ? ${#gpus[@]} : 1 ))
  fi
  [[ "$REPLICAS" =~ ^[1-9][0-9]*$ ]] || die "--replicas must be a positive integer, got '$REPLICAS'"

  local i port device url
  for (( i = 0; i < REPLICAS; i++ )); do
    port=$(( BASE_PORT + i ))
    device=""
    [[ ${#gpus[@]} -gt 0 ]] && device="${gpus[$(( i % ${#gpus[@]} ))]}"
    url="http://$HOST:$port"
    [[ "$HOST" == *:* ]] && url="http://[$HOST]:$port"  # an IPv6 address
    CUDA_VISIBLE_DEVICES="$device" PYTHONUNBUFFERED=1 nohup "$PYTHON" -m reward_server \
      --scorers "$SCORERS" --host "$HOST" --port "$port" --instance-id "$(hostname)-replica-$i" \
      ${SERVER_ARGS[@]+"${SERVER_ARGS[@]}"} >"$RUN_DIR/replica-$i.log" 2>&1 </dev/null &
    echo $! >"$RUN_DIR/replica-$i.pid"
    echo "$url" >"$RUN_DIR/replica-$i.url"
    echo "replica $i: pid $!, ${device:+GPU $device, }$url, log $RUN_DIR/replica-$i.log"
  done

  local deadline=$(( SECONDS + READY_TIMEOUT_S ))
  for (( i = 0; i < REPLICAS; i++ )); do
    pid="$(cat "$RUN_DIR/replica-$i.pid")"
    until is_ready "$(url_of "$i")"; do
      if ! pid_alive "$pid"; then
        echo "run_server.sh: replica $i exited; end of its log:" >&2
        tail -n 30 "$RUN_DIR/replica-$i.log" >&2
        cmd_stop >/dev/null
        exit 1
      fi
      if (( SECONDS > deadline )); then
        echo "run_server.sh: replica $i not ready after ${READY_TIMEOUT_S}s; end of its log:" >&2
        tail -n 30 "$RUN_DIR/replica-$i.log" >&2
        cmd_stop >/dev/null
        exit 1
      fi
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
    elif is_ready "$(url_of "$id")"; then
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
    if pid_alive "$pid"; then
      kill -TERM "$pid"
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
  rm -f "$RUN_DIR"/replica-*.pid "$RUN_DIR"/replica-*.url
  echo "stopped ${#pids[@]} replica(s)"
}

case "$COMMAND" in
  start) cmd_start ;;
  status) cmd_status ;;
  stop) cmd_stop ;;
  -h|--help|help) usage 0 ;;
  *) die "unknown command '$COMMAND' (start, status or stop)" ;;
esac
