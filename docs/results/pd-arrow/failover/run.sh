#!/usr/bin/env bash
# The CI test `up_with_arrow_hands_requests_off_and_flips_a_decoder` as a command, run under load:
# examples/arrow-up-4.toml with a TTFT SLO that forces flips, TP-2 decoders, chunked prefill with
# overlapped handoffs, the leader killed after 8 s; ROUNDS rounds of two runs at once beside two
# busy loops (the 2-core host then runs each about as slowly as the full test suite does).
# Each run's summary goes to $OUT/<round><a|b>.log, its output to $OUT/<round><a|b>/.
# Usage: docs/results/pd-arrow/failover/run.sh [ROUNDS] [OUT]   (needs target/debug/kvfleet:
# cargo build --workspace)
set -euo pipefail
cd "$(dirname "$0")/../../../.."
rounds=${1:-6}
out=${2:-/tmp/arrow-failover}
mkdir -p "$out"
cfg="$out/arrow.toml"
sed -e 's/slo_ttft_s = 1.5/slo_ttft_s = 0.001/' \
    -e 's/^\[cluster\]$/[cluster]\ndecode_tensor_parallel_size = 2/' \
    -e 's/^policy = "arrow"$/policy = "arrow"\noverlap = "chunk"/' \
    -e 's/^\[scheduler\]$/[scheduler.intra]\nchunked_prefill_tokens = 256\n\n[scheduler]/' \
    examples/arrow-up-4.toml > "$cfg"
one() {
  rm -rf "${out:?}/$1"
  timeout 400 target/debug/kvfleet up -c "$cfg" --requests 60 --kill-leader-after-s 8 -q \
    --out "$out/$1" > "$out/$1.log" 2>&1 || true
}
for r in $(seq 1 "$rounds"); do
  (while :; do :; done) & h1=$!
  (while :; do :; done) & h2=$!
  one "${r}a" & one "${r}b"
  wait %3 2>/dev/null || true
  kill "$h1" "$h2"
  wait 2>/dev/null || true
  grep -h "requests finished" "$out/${r}a.log" "$out/${r}b.log" | sed "s/^/round $r: /"
done
echo "runs with every request finished: $(grep -l '60 of 60 requests finished' "$out"/*.log | wc -l) of $((2 * rounds))"
grep -h "failed:" "$out"/*.log || true
