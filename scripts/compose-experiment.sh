#!/usr/bin/env bash
# The docker-compose experiment: build the binaries and the FROM-scratch images, bring up etcd, two
# coordinators, N workers and the trace sink (docker-compose.yml), replay a workload through the
# leader with `kvfleet replay` (in a container on the compose network), collect results, logs and
# traces into results/<timestamp>/, and bring everything down (also on failure or Ctrl-C).
#
# Usage: scripts/compose-experiment.sh [--chaos] [--requests N] [--workers N] [--rate R] [--out DIR]
#   --chaos     mid-run: kill the leader coordinator (docker compose kill), kill one worker
#               (docker kill), cut another worker off the network for 5 s (docker network
#               disconnect/connect), then restart the killed ones; the run must still complete every
#               request exactly once
#   --requests  requests to replay (default 40)      --workers  worker replicas (default 4)
#   --rate      arrival rate, req/s (default: the config's 4)
#   --out       results directory (default results/<timestamp>)
# Exit status: 0 when every request completed exactly once (replay.json), non-zero otherwise.
# Environment: see scripts/lib/docker.sh (KVFLEET_BIN_DIR skips the cargo build) and
# docker-compose.yml (KVFLEET_KV_MEMORY, KVFLEET_POLICY, ...); KVFLEET_PROJECT (default kvfleet).
set -euo pipefail
source "$(dirname "$0")/lib/docker.sh"
cd "$KVFLEET_ROOT"

chaos=0 requests=40 workers=4 rate="" out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --chaos) chaos=1; shift ;;
    --requests) requests=$2; shift 2 ;;
    --workers) workers=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$requests" =~ ^[0-9]+$ && "$requests" -gt 0 ]] || die "--requests must be a positive integer, got '$requests'"
[[ "$workers" =~ ^[0-9]+$ && "$workers" -gt 0 ]] || die "--workers must be a positive integer, got '$workers'"
((chaos == 0 || workers >= 3)) || die "--chaos needs at least 3 workers (one killed, one cut off, one serving)"
why=$(docker_unavailable)
[ -z "$why" ] || die "$why"
find_compose

out=${out:-results/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out/logs" "$out/traces"
out=$(cd "$out" && pwd)
export KVFLEET_PROJECT=${KVFLEET_PROJECT:-kvfleet}
export KVFLEET_WORKERS=$workers KVFLEET_TRACES_DIR=$out/traces
DCP=("${DC[@]}" -f "$KVFLEET_ROOT/docker-compose.yml" -p "$KVFLEET_PROJECT")
started=$(date +%s)
say "compose experiment: $requests requests, $workers workers$( ((chaos)) && echo ', with chaos'); results in $out"
say "compose: ${DC[*]} ($("${DC[@]}" version --short 2>/dev/null || true)); docker $(docker version --format '{{.Server.Version}}')"

build_binaries
make_pki "$out/pki"
build_images

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  # Stop the kvfleet processes first (SIGTERM: they flush their spans to the sink), then the rest.
  "${DCP[@]}" stop -t 10 worker coordinator-0 coordinator-1 >/dev/null 2>&1 || true
  "${DCP[@]}" stop -t 5 traces >/dev/null 2>&1 || true
  for s in etcd coordinator-0 coordinator-1 worker traces; do
    "${DCP[@]}" logs --no-color "$s" >"$out/logs/$s.log" 2>&1 || true
  done
  # One-off clients still attached (an interrupted replay) would keep the network alive.
  [ -z "${net:-}" ] || docker ps -aq --filter "network=$net" --filter "label=kvfleet.client" | xargs -r docker rm -f >/dev/null 2>&1 || true
  "${DCP[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  say "cluster down (${DCP[*]} down -v); $(($(date +%s) - started)) s in all"
  local spans=$out/traces/spans.jsonl
  if [ -s "$spans" ]; then
    if "$BIN_DIR/kvfleet" traces analyze "$spans" --out "$out/traces" >"$out/traces/analysis.txt" 2>&1; then
      say "traces: $(wc -l <"$spans") OTLP batches in $spans; analysis in $out/traces/analysis.txt"
    else
      say "traces: $(wc -l <"$spans") OTLP batches in $spans (kvfleet traces analyze failed: $out/traces/analysis.txt)"
    fi
  fi
  exit "$rc"
}
trap cleanup EXIT INT TERM

say "starting etcd, 2 coordinators, $workers workers, the trace sink"
"${DCP[@]}" up -d --scale worker="$workers" >"$out/logs/compose-up.log" 2>&1 || { cat "$out/logs/compose-up.log"; die "compose up failed"; }
net=$(docker network ls --filter "label=com.docker.compose.project=$KVFLEET_PROJECT" --format '{{.Name}}' | head -1)
[ -n "$net" ] || die "the compose network of project $KVFLEET_PROJECT was not found"

replay_args=(replay --coordinators coordinator-0:7000,coordinator-1:7000 --tls-dir /pki --requests "$requests"
  --min-workers "$workers" --out /results/replay --timeout-s 240)
[ -z "$rate" ] || replay_args+=(--rate "$rate")
say "replaying through the leader: kvfleet ${replay_args[*]}"
kv_client "$net" "$out" "${replay_args[@]}" >"$out/replay.log" 2>&1 &
replay_pid=$!

chaos_run() {
  local log=$out/chaos.log victim cut cut_ip leader
  wait_for_line "$out/replay.log" '^replaying' 120 || { echo "replay never started" >>"$log"; return 1; }
  mapfile -t ws < <("${DCP[@]}" ps -q worker)
  victim=${ws[0]} cut=${ws[1]}
  sleep 3
  leader=$(leader_service "$net" "$out")
  [ -n "$leader" ] || { say "chaos: no leader found" | tee -a "$log"; return 1; }
  say "chaos: ${DC[*]} kill $leader (the leader)" | tee -a "$log"
  "${DCP[@]}" kill -s SIGKILL "$leader" >/dev/null 2>&1
  sleep 2
  say "chaos: docker kill worker $(docker inspect -f '{{.Name}}' "$victim")" | tee -a "$log"
  docker kill "$victim" >/dev/null
  sleep 2
  cut_ip=$(docker inspect -f "{{(index .NetworkSettings.Networks \"$net\").IPAddress}}" "$cut")
  say "chaos: docker network disconnect worker $(docker inspect -f '{{.Name}}' "$cut") ($cut_ip) for 5 s" | tee -a "$log"
  docker network disconnect -f "$net" "$cut"
  sleep 5
  docker network connect --ip "$cut_ip" "$net" "$cut"
  say "chaos: reconnected it; restarting $leader and the killed worker" | tee -a "$log"
  "${DCP[@]}" start "$leader" >/dev/null 2>&1
  docker start "$victim" >/dev/null
  say "chaos: done" | tee -a "$log"
}
chaos_rc=0
if ((chaos)); then
  chaos_run || chaos_rc=$?
fi
replay_rc=0
wait "$replay_pid" || replay_rc=$?
cat "$out/replay.log"
kv_client "$net" "$out" status --coordinator coordinator-0:7000,coordinator-1:7000 --tls-dir /pki >"$out/status.txt" 2>&1 || true
((chaos)) && { echo "-- chaos"; cat "$out/chaos.log"; }
echo "-- cluster status after the run"
cat "$out/status.txt"
if ((replay_rc == 0 && chaos_rc == 0)); then
  say "PASS: every request completed exactly once ($out/replay/replay.json)"
else
  say "FAIL: replay exit $replay_rc, chaos exit $chaos_rc (logs in $out/logs)"
  exit 1
fi
