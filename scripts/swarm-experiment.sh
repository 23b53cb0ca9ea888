#!/usr/bin/env bash
# The Docker Swarm experiment: deploy docker-compose.yml as a stack (`docker stack deploy`), replay
# a workload through the leader, roll every worker over to a new task mid-run (`docker service
# update --force`: one at a time, the new one first; a stopping worker deregisters and its requests
# are re-placed), check that no request was lost or run twice, and remove the stack.
#
# On a machine that is not in a swarm it creates a single-node swarm (`docker swarm init` on
# 127.0.0.1) and leaves it at the end; a machine already in a swarm (a manager) is used as it is,
# and stays in it. For several machines: join them to the swarm first, and make the images exist on
# every node (README "Multi-node experiments").
#
# Usage: scripts/swarm-experiment.sh [--requests N] [--workers N] [--rate R] [--out DIR] [--no-update]
#   --requests  requests to replay (default 40)      --workers  worker replicas (default 4)
#   --rate      arrival rate, req/s (default: the config's 4)
#   --no-update no rolling update (just deploy, replay, remove)
#   --out       results directory (default results/<timestamp>)
# Environment: KVFLEET_STACK (default kvfleet), KVFLEET_SUBNET (overlay subnet, default
# 10.77.7.0/24), KVFLEET_SWARM_ADDR (advertise address for `swarm init`, default 127.0.0.1), and
# those of scripts/lib/docker.sh and docker-compose.yml.
set -euo pipefail
source "$(dirname "$0")/lib/docker.sh"
cd "$KVFLEET_ROOT"

requests=40 workers=4 rate="" out="" update=1
while [ $# -gt 0 ]; do
  case "$1" in
    --requests) requests=$2; shift 2 ;;
    --workers) workers=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --no-update) update=0; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$requests" =~ ^[0-9]+$ && "$requests" -gt 0 ]] || die "--requests must be a positive integer, got '$requests'"
[[ "$workers" =~ ^[0-9]+$ && "$workers" -gt 1 ]] || die "--workers must be at least 2 (a rolling update needs somewhere to go), got '$workers'"
command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1 || die "no Docker daemon answers (docker info failed)"

out=${out:-results/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out/logs" "$out/traces"
out=$(cd "$out" && pwd)
stack=${KVFLEET_STACK:-kvfleet}
export KVFLEET_WORKERS=$workers KVFLEET_TRACES_DIR=$out/traces KVFLEET_NET_DRIVER=overlay
export KVFLEET_SUBNET=${KVFLEET_SUBNET:-10.77.7.0/24}
started=$(date +%s)
say "swarm experiment: stack $stack, $requests requests, $workers workers$( ((update)) && echo ', rolling update mid-run'); results in $out"

initialized=0 had_gwbridge=""
case "$(docker info --format '{{.Swarm.LocalNodeState}}')" in
  active)
    [ "$(docker info --format '{{.Swarm.ControlAvailable}}')" = true ] || die "this node is in a swarm but not a manager"
    say "using the existing swarm (this node is a manager)" ;;
  inactive)
    addr=${KVFLEET_SWARM_ADDR:-127.0.0.1}
    had_gwbridge=$(docker network ls -q --filter name=^docker_gwbridge$)
    say "docker swarm init --advertise-addr $addr (single-node swarm; left again at the end)"
    docker swarm init --advertise-addr "$addr" --listen-addr "$addr:2377" >/dev/null
    initialized=1 ;;
  *) die "swarm state is $(docker info --format '{{.Swarm.LocalNodeState}}'); expected active or inactive" ;;
esac
docker stack ls --format '{{.Name}}' | grep -qx "$stack" && die "a stack named $stack is already deployed (KVFLEET_STACK=another name)"

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  for s in etcd coordinator-0 coordinator-1 worker traces; do
    docker service logs --no-task-ids --raw "${stack}_$s" >"$out/logs/$s.log" 2>&1 || true
  done
  docker ps -aq --filter "label=kvfleet.client" --filter "network=${stack}_kvfleet" | xargs -r docker rm -f >/dev/null 2>&1 || true
  docker stack rm "$stack" >/dev/null 2>&1 || true
  # The stack's network goes a little after its services; wait so that nothing is left behind.
  for _ in $(seq 60); do
    docker network ls --format '{{.Name}}' | grep -qx "${stack}_kvfleet" || break
    sleep 1
  done
  for _ in $(seq 30); do
    [ -z "$(docker volume ls -q --filter "label=com.docker.stack.namespace=$stack")" ] && break
    docker volume ls -q --filter "label=com.docker.stack.namespace=$stack" | xargs -r docker volume rm >/dev/null 2>&1 || sleep 1
  done
  if ((initialized)); then
    docker swarm leave --force >/dev/null 2>&1 || true
    # `swarm init` made docker_gwbridge; leave the host's networks as they were.
    [ -n "$had_gwbridge" ] || docker network rm docker_gwbridge >/dev/null 2>&1 || true
    say "left the single-node swarm"
  fi
  say "stack $stack removed; $(($(date +%s) - started)) s in all"
  exit "$rc"
}
trap cleanup EXIT INT TERM

build_binaries
make_pki "$out/pki"
build_images

say "docker stack deploy -c docker-compose.yml $stack ($workers workers)"
docker stack deploy --resolve-image never -c "$KVFLEET_ROOT/docker-compose.yml" "$stack" >"$out/logs/stack-deploy.log" 2>&1 \
  || { cat "$out/logs/stack-deploy.log"; die "stack deploy failed"; }
net=${stack}_kvfleet

replay_args=(replay --coordinators coordinator-0:7000,coordinator-1:7000 --tls-dir /pki --requests "$requests"
  --min-workers "$workers" --out /results/replay --timeout-s 240)
[ -z "$rate" ] || replay_args+=(--rate "$rate")
say "replaying through the leader: kvfleet ${replay_args[*]}"
kv_client "$net" "$out" "${replay_args[@]}" >"$out/replay.log" 2>&1 &
replay_pid=$!

update_rc=0
if ((update)); then
  if wait_for_line "$out/replay.log" '^replaying' 180; then
    sleep 4
    say "rolling update: docker service update --force ${stack}_worker (one task at a time, start-first)"
    t0=$(date +%s)
    docker service update --force --detach=false --quiet "${stack}_worker" >"$out/logs/service-update.log" 2>&1 || update_rc=$?
    say "rolling update done in $(($(date +%s) - t0)) s (exit $update_rc)"
  else
    say "the replay never started (see $out/replay.log)"
    update_rc=1
  fi
fi
replay_rc=0
wait "$replay_pid" || replay_rc=$?
cat "$out/replay.log"
docker service ps --format '{{.Name}} {{.CurrentState}} {{.Error}}' "${stack}_worker" >"$out/worker-tasks.txt" 2>&1 || true
kv_client "$net" "$out" status --coordinator coordinator-0:7000,coordinator-1:7000 --tls-dir /pki >"$out/status.txt" 2>&1 || true
echo "-- worker tasks (docker service ps)"
cat "$out/worker-tasks.txt"
echo "-- cluster status after the run"
cat "$out/status.txt"
if ((replay_rc == 0 && update_rc == 0)); then
  say "PASS: every request completed exactly once ($out/replay/replay.json)"
else
  say "FAIL: replay exit $replay_rc, rolling update exit $update_rc (logs in $out/logs)"
  exit 1
fi
