#!/usr/bin/env bash
# Pulled against pushed handoffs ([pd] handoff), in the simulator and on real processes.
# Run from the repository root after `cargo build --release -p kvfleet -p kvfleet-worker -p kvfleet-coordinator`.
set -euo pipefail
K=./target/release/kvfleet
D=docs/results/pd-arrow/push-pull
# 1. The static 4 + 4 split of examples/pd-static.toml (32B on H100s) at 1 and 2 req/s.
for rate in 1 2; do for mode in pull push; do
  $K sim -c examples/pd-static.toml --set workload.arrivals.rate=$rate --set "pd.handoff=\"$mode\"" \
    -q --no-plots --out /tmp/push-pull/static-rate-$rate-$mode > $D/static-rate-$rate-$mode.txt
done; done
# 2. Arrow on 8 x H20 (examples/arrow-h20.toml, Azure conversation) at 4x and 6x the trace's rate.
for scale in 4 6 10; do for mode in pull push; do
  $K sim -c examples/arrow-h20.toml --set workload.rate_scale=$scale --set "pd.handoff=\"$mode\"" \
    -q --no-plots --out /tmp/push-pull/arrow-x$scale-$mode > $D/arrow-x$scale-$mode.txt
done; done
# 3. The real-process test's cluster (1 prefill + 2 decode workers, a burst of 16 into arenas that
#    hold about three requests each), three `up` runs per mode against one `sim` run, 4 Gbit/s links
#    in both (`up` shapes its links with --link-gbps).
for mode in pull push; do
  sed "s/handoff = \"push\"/handoff = \"$mode\"/" tests/fixtures/static-push.toml > /tmp/static-$mode.toml
  printf '[link]\nbandwidth_gbps = 4\n' >> /tmp/static-$mode.toml
  $K sim -c /tmp/static-$mode.toml -q --no-plots --out /tmp/push-pull/burst-$mode-sim > $D/burst-$mode-sim.txt
  for i in 1 2 3; do
    $K up -c /tmp/static-$mode.toml --no-etcd --cpu-memory 4MiB --link-gbps 4 -q \
      --out /tmp/burst-$mode-up-$i > $D/burst-$mode-up-$i.txt
  done
done
