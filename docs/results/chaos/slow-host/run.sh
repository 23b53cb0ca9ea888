#!/usr/bin/env bash
# The two real-process Arrow tests' scenarios at once, on workers too slow for their model: what
# failed both tests in CI (session 22's last run). Builds the binaries with the KV byte loops left
# unoptimised (as every debug build compiled them before kvfleet-kvbytes), so a worker falls
# seconds behind and goes unheard for 10 s while its registration holds.
#   bash docs/results/chaos/slow-host/run.sh [OUT]        (about 5 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=${1:-/tmp/kvfleet-slow-host}
cargo build --config 'profile.dev.package.kvfleet-kvbytes.opt-level=0' -p kvfleet --bins -p kvfleet-worker -p kvfleet-coordinator
flip="$out/arrow-flip.toml"
mkdir -p "$out"
# The flip test's config (tests/tests/up.rs: up_with_arrow_hands_requests_off_and_flips_a_decoder).
sed -e 's/slo_ttft_s = 1.5/slo_ttft_s = 0.001/' \
    -e 's/^\[cluster\]$/[cluster]\ndecode_tensor_parallel_size = 2/' \
    -e 's/^policy = "arrow"$/policy = "arrow"\noverlap = "chunk"/' \
    -e 's/^\[scheduler\]$/[scheduler.intra]\nchunked_prefill_tokens = 256\n\n[scheduler]/' \
    examples/arrow-up-4.toml > "$flip"
./target/debug/kvfleet up -c examples/arrow-up-4.toml --requests 30 --pause-worker-after-s 6 --pause-for-s 5 \
    -q --out "$out/paused" > "$out/paused.txt" 2>&1 &
./target/debug/kvfleet up -c "$flip" --requests 60 --kill-leader-after-s 8 -q --out "$out/flip" > "$out/flip.txt" 2>&1 &
wait || true
grep -h "requests finished\|failed: request" "$out/paused.txt" "$out/flip.txt" || true
echo "workers given up for silence while registered: $(cat "$out"/*/logs/coordinator-*.log | grep -c 'unreachable while it is still a member' || true)"
echo "expelled: $(cat "$out"/*/logs/coordinator-*.log | grep -c 'expelled: its registration revoked' || true)"
echo "broken MigrateOut calls settled by asking the target: $(cat "$out"/*/logs/coordinator-*.log | grep -c 'migrate-out call broke' || true)"
echo "(rebuild the normal debug binaries afterwards: cargo build -p kvfleet --bins -p kvfleet-worker -p kvfleet-coordinator)"
