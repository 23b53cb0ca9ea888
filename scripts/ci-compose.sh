#!/usr/bin/env bash
# CI: the docker-compose experiment on a small workload, then its chaos variant (leader and a
# worker killed, a worker cut off the network); both must complete every request exactly once.
# Skipped, with a message saying why and exit status 0, where there is no usable Docker (no
# daemon, no compose). Expects the workspace built (`cargo build --workspace`; it rebuilds the
# three binaries it needs if not). About 2 minutes on 2 cores.
#
# Usage: scripts/ci-compose.sh [--requests N]   (default 24 for the plain run; the chaos run uses 40)
set -euo pipefail
source "$(dirname "$0")/lib/docker.sh"
cd "$KVFLEET_ROOT"

requests=24
while [ $# -gt 0 ]; do
  case "$1" in
    --requests) requests=$2; shift 2 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

why=$(docker_unavailable)
if [ -n "$why" ]; then
  echo "== compose experiment SKIPPED: $why (needs a Docker daemon and docker compose)"
  exit 0
fi

stamp=$(date +%Y%m%d-%H%M%S)
echo "== compose experiment ($requests requests)"
scripts/compose-experiment.sh --requests "$requests" --out "results/ci-$stamp-compose"
echo "== compose experiment with chaos (40 requests)"
# The chaos timeline spans ~13 s after the first arrival: the workload must outlast it.
scripts/compose-experiment.sh --chaos --requests 40 --out "results/ci-$stamp-chaos"
echo "== compose experiments passed (results/ci-$stamp-*)"
