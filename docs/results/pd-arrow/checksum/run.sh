#!/usr/bin/env bash
# Handoffs whose bytes fail their checksum, in both backends: the 2 prefill + 2 decode fixture
# whose prefill instance 0 corrupts every block it sends (`[migration] corrupt_sends_from = [0]`).
# Writes sim.txt, up.txt and the runs' CSVs here.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
HERE=docs/results/pd-arrow/checksum
CFG=tests/fixtures/corrupt-handoffs.toml
./target/release/kvfleet sim -c "$CFG" --out /tmp/corrupt-sim | tee "$HERE/sim.txt"
./target/release/kvfleet up -c "$CFG" --no-etcd --kv-fill stamp --out /tmp/corrupt-up | tee "$HERE/up.txt"
cp /tmp/corrupt-sim/live-migrations*.csv "$HERE/sim-live-migrations.csv"
cp /tmp/corrupt-up/live-migrations.csv "$HERE/up-live-migrations.csv"
grep -h "computed again" /tmp/corrupt-up/logs/coordinator-0.log > "$HERE/up-reprefills.log" || true
