#!/usr/bin/env bash
# `kvfleet bench migration` on another host, from binaries built here: the migration-goodput
# figures of docs/results/migration/ on a machine with more cores than the 2-core build host.
#
#   scripts/bench-migration-host.sh --prepare   # build host: stripped release binaries -> target/host-bin/
#   scripts/bench-migration-host.sh [RUNS]      # the other host: one full run, then RUNS (3) runs of
#                                               # the 16k-token (4 GiB) migration alone
#
# Binaries: $KVFLEET_BIN (default target/host-bin). Output: $RESULTS (default
# results/bench-migration-host) with host.txt (cores, CPU), full/ and 16k-N/ (each the bench's
# printout, migrations.csv, goodput.json); with $OUT set (the device tool) also
# $OUT/bench-migration-host.tgz and $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${KVFLEET_BIN:-target/host-bin}
RESULTS=${RESULTS:-results/bench-migration-host}

if [ "${1:-}" = "--prepare" ]; then
    set -e
    cargo build --release -p kvfleet -p kvfleet-worker
    mkdir -p target/host-bin
    for b in kvfleet kvfleet-worker; do
        cp "${CARGO_TARGET_DIR:-target}/release/$b" target/host-bin/
        strip target/host-bin/$b
    done
    ls -la target/host-bin
    exit 0
fi
RUNS=${1:-3}
case "$RUNS" in ''|*[!0-9]*) echo "bench-migration-host: RUNS must be a count, got \`$RUNS\`" >&2; exit 2 ;; esac
for b in kvfleet kvfleet-worker; do
    [ -x "$BIN/$b" ] || { echo "bench-migration-host: $BIN/$b missing (run --prepare on the build host)" >&2; exit 2; }
done

mkdir -p "$RESULTS"
{
    echo "date: $(date -u +%FT%TZ)"
    echo "cores: $(nproc)"
    grep -m1 "model name" /proc/cpuinfo
    echo "cpu flags (aes, avx2, vaes, avx512f): $(grep -m1 -o -w 'aes\|avx2\|vaes\|avx512f' /proc/cpuinfo | sort -u | tr '\n' ' ')"
    free -g | head -2
    uname -a
} > "$RESULTS/host.txt"
cat "$RESULTS/host.txt"

run() {
    local name=$1; shift
    echo "=== $name: kvfleet bench migration $*"
    "$BIN/kvfleet" bench migration --out "$RESULTS/$name" "$@" 2>&1 | tee "$RESULTS/$name.txt"
    echo "=== $name: exit ${PIPESTATUS[0]}"
}
run full
for i in $(seq 1 "$RUNS"); do
    run "16k-$i" --lengths 16384 --no-blocking
done

if [ -n "${OUT:-}" ]; then
    {
        cat "$RESULTS/host.txt"
        for f in "$RESULTS"/*.txt; do
            [ "$f" = "$RESULTS/host.txt" ] && continue
            echo "--- $(basename "$f")"
            grep -i "gbit\|ratio\|target\|migration /\|limit\|exit" "$f" | head -40
        done
    } > "$OUT/summary.txt"
    tar -czf "$OUT/bench-migration-host.tgz" --exclude='*.log' --exclude=pki -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
    tar -czf "$OUT/bench-migration-host-logs.tgz" --exclude=pki -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
fi
