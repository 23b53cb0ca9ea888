#!/usr/bin/env bash
# Set up a fresh Debian/Ubuntu machine and run kvfleet's main job: `kvfleet up`, a local cluster
# (etcd, two coordinators, four worker processes emulating H100s) replaying a small PASCAL workload
# in real time. Prints the summary table; results, CSVs, SVG plots and process logs go to
# results/up/. Extra arguments go to `kvfleet up` (see `kvfleet up --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/install-deps.sh
install_deps
cargo build --release --workspace --bins
"${CARGO_TARGET_DIR:-target}/release/kvfleet" up --out results/up "$@"
