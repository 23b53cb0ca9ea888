# Shared by scripts/compose-experiment.sh, scripts/swarm-experiment.sh and scripts/ci-compose.sh:
# find Docker and compose, build the binaries and the FROM-scratch images, make the certificates,
# and run the `kvfleet` image as a one-off client on the cluster's network.
#
# Environment: KVFLEET_BIN_DIR (prebuilt binaries: skips `cargo build`), CARGO_TARGET_DIR,
# KVFLEET_IMAGE (default kvfleet:local), KVFLEET_DOCKER_CONTEXT (staged build contexts).

KVFLEET_ROOT=${KVFLEET_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
export KVFLEET_IMAGE=${KVFLEET_IMAGE:-kvfleet:local}
export KVFLEET_ETCD_IMAGE=${KVFLEET_ETCD_IMAGE:-kvfleet-etcd:local}
export KVFLEET_DOCKER_CONTEXT=${KVFLEET_DOCKER_CONTEXT:-${CARGO_TARGET_DIR:-$KVFLEET_ROOT/target}/docker}

say() { echo "[$(date +%H:%M:%S)] $*"; }
die() { echo "error: $*" >&2; exit 1; }

# Why Docker cannot be used here, or nothing when it can.
docker_unavailable() {
  command -v docker >/dev/null 2>&1 || { echo "the docker command is not installed"; return; }
  docker info >/dev/null 2>&1 || { echo "no Docker daemon answers (docker info failed)"; return; }
  if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null 2>&1; then
    echo "neither 'docker compose' nor 'docker-compose' is installed"
  fi
}

# The compose command: `docker compose` (v2) or `docker-compose` (v1), as an array DC.
find_compose() {
  if docker compose version >/dev/null 2>&1; then
    DC=(docker compose)
  elif command -v docker-compose >/dev/null 2>&1; then
    DC=(docker-compose)
  else
    die "neither 'docker compose' nor 'docker-compose' is installed"
  fi
}

# The kvfleet binaries: KVFLEET_BIN_DIR if set, else a (usually no-op) debug build of the three.
build_binaries() {
  if [ -n "${KVFLEET_BIN_DIR:-}" ]; then
    BIN_DIR=$KVFLEET_BIN_DIR
  else
    say "cargo build (kvfleet, kvfleet-coordinator, kvfleet-worker)"
    (cd "$KVFLEET_ROOT" && cargo build --quiet -p kvfleet -p kvfleet-coordinator -p kvfleet-worker --bins)
    BIN_DIR=${CARGO_TARGET_DIR:-$KVFLEET_ROOT/target}/debug
  fi
  for b in kvfleet kvfleet-coordinator kvfleet-worker; do
    [ -x "$BIN_DIR/$b" ] || die "$BIN_DIR/$b is missing"
  done
  export KVFLEET_BIN_DIR=$BIN_DIR
}

# Stage the contexts (docker/stage.sh) and build both images FROM scratch: nothing is pulled.
# (The same contexts are the `build:` sections of docker-compose.yml.)
build_images() {
  "$KVFLEET_ROOT/docker/stage.sh" --bin-dir "$BIN_DIR" --out "$KVFLEET_DOCKER_CONTEXT" >/dev/null
  say "building images $KVFLEET_IMAGE and $KVFLEET_ETCD_IMAGE (FROM scratch)"
  local log=$KVFLEET_DOCKER_CONTEXT/build.log
  { docker build -t "$KVFLEET_IMAGE" "$KVFLEET_DOCKER_CONTEXT/kvfleet" \
      && docker build -t "$KVFLEET_ETCD_IMAGE" "$KVFLEET_DOCKER_CONTEXT/etcd"; } >"$log" 2>&1 \
    || { cat "$log" >&2; die "building the images failed"; }
  # The previous builds' images, now untagged (only kvfleet's: they carry this label).
  docker image prune -f --filter label=org.kvfleet.image >/dev/null 2>&1 || true
}

# A cluster CA and one certificate per role into $1: ca/, coordinator-0/, coordinator-1/,
# worker/ (shared by every replica: peers verify cluster membership, not names), client/.
make_pki() {
  local dir=$1 k="$BIN_DIR/kvfleet"
  rm -rf "$dir"
  "$k" certs init --dir "$dir/ca" >/dev/null
  for n in coordinator-0 coordinator-1; do
    "$k" certs issue --ca-dir "$dir/ca" --role coordinator --name "$n" --out "$dir/$n" >/dev/null
  done
  "$k" certs issue --ca-dir "$dir/ca" --role worker --name worker --out "$dir/worker" >/dev/null
  "$k" certs issue --ca-dir "$dir/ca" --role client --name client --out "$dir/client" >/dev/null
  export KVFLEET_PKI=$dir
}

# Run the kvfleet CLI image on network $1 with the client certificate in /pki and $2 at /results:
# kv_client NET RESULTS_DIR ARGS...
kv_client() {
  local net=$1 results=$2
  shift 2
  docker run --rm --label kvfleet.client=1 --network "$net" -v "$KVFLEET_PKI/client:/pki:ro" \
    -v "$results:/results" -e RUST_LOG=warn "$KVFLEET_IMAGE" "$@"
}

# The leader's service name (coordinator-0 or coordinator-1), asked through any coordinator.
leader_service() {
  local net=$1 results=$2
  kv_client "$net" "$results" status --coordinator coordinator-0:7000,coordinator-1:7000 --tls-dir /pki 2>/dev/null \
    | awk '/^leader/ {split($2, a, ":"); print a[1]; exit}'
}

# Wait until file $1 has a line matching $2 (at most $3 seconds); false on timeout.
wait_for_line() {
  local file=$1 pattern=$2 limit=$3 i
  for ((i = 0; i < limit * 10; i++)); do
    grep -q -- "$pattern" "$file" 2>/dev/null && return 0
    sleep 0.1
  done
  return 1
}
