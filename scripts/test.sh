#!/usr/bin/env bash
# Install what the tests need, build the whole workspace once, then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
# Under CI (.ci/run sets KVFLEET_CI_PHASES) each step says when it starts, in seconds.
step() { if [ -n "${KVFLEET_CI_PHASES:-}" ]; then echo "== [${SECONDS}s] $*"; fi; }
source scripts/lib/install-deps.sh
step "install"
install_deps
step "build"
cargo build --workspace --all-targets
step "tests"
cargo nextest run --workspace --no-fail-fast "$@"
