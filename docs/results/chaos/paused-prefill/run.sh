#!/bin/bash
cd "$(dirname "$0")/../../../.."
for spec in "arrow-pause-a|-c examples/arrow-up-4.toml --pause-worker-after-s 6 --pause-for-s 5" \
            "arrow-pause-b|-c examples/arrow-up-4.toml --pause-worker-after-s 6 --pause-for-s 5" \
            "arrow-pause-c|-c examples/arrow-up-4.toml --pause-worker-after-s 4 --pause-for-s 8" \
            "arrow-nofault|-c examples/arrow-up-4.toml" \
            "default-pause|--pause-worker-after-s 6 --pause-for-s 5" \
            "arrow-kill|-c examples/arrow-up-4.toml --kill-worker-after-s 7"; do
  name=${spec%%|*}; args=${spec#*|}
  start=$(date +%s)
  timeout 400 ./target/release/kvfleet up $args -q -o ${OUT:-/tmp/pauseruns}/$name > ${OUT:-/tmp/pauseruns}/$name.log 2>&1
  rc=$?
  echo "$name rc=$rc wall=$(( $(date +%s) - start ))s | $(grep -h 'requests finished,' ${OUT:-/tmp/pauseruns}/$name.log | head -1) | dropped: $(grep -hc 'dropped a copy the cluster' ${OUT:-/tmp/pauseruns}/$name/logs/worker-*.log 2>/dev/null | paste -sd+ | bc)"
done
