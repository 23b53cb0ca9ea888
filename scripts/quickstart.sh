#!/usr/bin/env bash
# Set up a fresh Debian/Ubuntu machine and run kvfleet's main job: the PASCAL 8×H100 example sweep
# in the deterministic simulator. Prints the summary table; results, CSVs and SVG plots go to
# results/pascal-8xh100/.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/install-deps.sh
install_deps
cargo build --release --bin kvfleet
./target/release/kvfleet sim --config examples/pascal-8xh100.toml --out results/pascal-8xh100 "$@"
