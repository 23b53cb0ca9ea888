#!/usr/bin/env bash
# Install what the tests need, build the whole workspace once, then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/install-deps.sh
install_deps
cargo build --workspace --all-targets
cargo nextest run --workspace --no-fail-fast "$@"
