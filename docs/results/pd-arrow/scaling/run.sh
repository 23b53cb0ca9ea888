#!/bin/sh
# A3 (Arrow Fig. 8): SLO attainment of Arrow and of minimal-load placement as the cluster grows
# from 2 to 6 instances (half prefill at the start, at least one), Azure Conversation at 2.75 x its
# own rate (14.8 req/s: where 6-instance minimal-load attains 30-50 %). Needs
# target/release/kvfleet; prints a table into table.txt.
cd "$(dirname "$0")/../../../.."
D=docs/results/pd-arrow/scaling
echo "instances  arrow  minimal-load" > $D/table.txt
for n in 2 3 4 5 6; do
  p=$((n / 2))
  line="$n"
  for s in arrow minimal-load; do
    python3 scripts/arrow_sweep.py -c examples/arrow-h20.toml --base-rate 5.38 --setups $s --scales 2.75 \
      --set workload.num_requests=20000 --set cluster.instances=$n --set pd.prefill_instances=$p \
      --out /tmp/arrow-scaling/$s-$n --runs /tmp/arrow-scaling/runs/$s-$n > /dev/null || exit 1
    a=$(awk -F, 'NR == 2 { printf "%.1f%%", 100 * $4 }' /tmp/arrow-scaling/$s-$n/attainment.csv)
    line="$line  $a"
  done
  echo "$line" | tee -a $D/table.txt
done
