#!/usr/bin/env bash
# The sans-IO crates (the simulator, the network model, the wire messages, the cluster controller)
# must not depend on the async/RPC stack: fails, naming the crate and the offending dependency, if
# any normal (non-dev, non-build) dependency of theirs is tokio, hyper, tonic, axum, tower or h2
# (or one of their family, e.g. tokio-util, hyper-util, tower-service).
set -euo pipefail
cd "$(dirname "$0")/.."

crates=(kvfleet-sim kvfleet-netmodel kvfleet-wire kvfleet-control)
forbidden='^(tokio|hyper|tonic|axum|tower|h2)(-[A-Za-z0-9_-]+)?$'

failed=0
for crate in "${crates[@]}"; do
  tree=$(cargo tree -p "$crate" -e normal --prefix none)
  offenders=$(awk -v re="$forbidden" '$1 ~ re { print $1 " " $2 }' <<<"$tree" | sort -u | paste -sd, - | sed 's/,/, /g')
  if [ -n "$offenders" ]; then
    echo "check-deps: FAIL: $crate depends on the async/RPC stack: $offenders (see: cargo tree -p $crate -e normal -i ${offenders%% *})" >&2
    failed=1
  else
    echo "check-deps: ok: $crate"
  fi
done
exit "$failed"
