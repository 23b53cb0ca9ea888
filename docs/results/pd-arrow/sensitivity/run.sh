#!/bin/sh
# Arrow sensitivity sweep (docs/results/pd-arrow/README.md): each knob moved alone, goodput of
# Arrow on both traces. Needs target/release/kvfleet; run from anywhere.
cd "$(dirname "$0")/../../../.."
D=docs/results/pd-arrow/sensitivity
: > $D/table.txt
for v in "defaults:" "l_expand=0.8:pd.arrow.l_expand=0.8" "l_expand=1.0:pd.arrow.l_expand=1.0" "l_shrink=0.2:pd.arrow.l_shrink=0.2" "l_shrink=0.5:pd.arrow.l_shrink=0.5" "cooldown_s=1:pd.arrow.cooldown_s=1" "cooldown_s=20:pd.arrow.cooldown_s=20" "interval_s=0.25:pd.arrow.interval_s=0.25" "interval_s=4:pd.arrow.interval_s=4"; do
  name=${v%%:*}; set=${v#*:}; extra=""; [ -n "$set" ] && extra="--set $set"
  for t in conv code; do
    if [ $t = conv ]; then args="--base-rate 5.38 --scales 3,3.5,4,4.5,5,5.5"; else args="--base-rate 2.45 --scales 1,1.5,2,2.5,3 --set workload.lengths.path=../data/traces/AzureLLMInferenceTrace_code.csv --set slo.ttft_s=6 --set slo.tpot_s=0.1 --set pd.arrow.slo_ttft_s=6 --set pd.arrow.slo_tpot_s=0.1"; fi
    g=$(python3 scripts/arrow_sweep.py -c examples/arrow-h20.toml $args --setups arrow --set workload.num_requests=20000 $extra --out /tmp/sens/$t-$name --runs /tmp/sens-runs/$t-$name | grep goodput)
    echo "$t $name: $g" | tee -a $D/table.txt
  done
done
