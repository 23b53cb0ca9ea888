#!/bin/sh
# A1 (Fig. 6) for Qwen3-32B (TP 1, 8 instances) and Llama-3.1-70B (TP 2, 4 instances of 2 GPUs,
# static 2P+2D), Table 1's SLOs, and A4 (Fig. 9 right): Qwen3-32B on 8 GPUs with TP-1 prefill
# and TP-2 decode instances. Run from the repository root after
# `cargo build --release -p kvfleet`; about 2 minutes on a 2-core host.
set -e
O=docs/results/pd-arrow
mkdir -p $O/conv-qwen3-32b $O/code-qwen3-32b $O/conv-llama70b-tp2 $O/code-llama70b-tp2 $O/tp-hetero/p6-d1 $O/tp-hetero/p4-d2 $O/tp-hetero/p2-d3
R=${RUNS:-/tmp/arrow-runs}
CODE="--set workload.lengths.path=../data/traces/AzureLLMInferenceTrace_code.csv"
slo() { echo "--set slo.ttft_s=$1 --set slo.tpot_s=$2 --set pd.arrow.slo_ttft_s=$1 --set pd.arrow.slo_tpot_s=$2"; }
Q32="--set cluster.model=qwen3-32b --set workload.num_requests=20000"
L70="--set cluster.model=llama-3.1-70b --set cluster.tensor_parallel_size=2 --set cluster.instances=4 --set pd.prefill_instances=2 --set workload.num_requests=20000"
scripts/arrow_sweep.py -c examples/arrow-h20.toml --base-rate 5.38 --scales 0.4,0.6,0.8,1,1.25,1.5,1.75,2,2.5 \
  $Q32 $(slo 6 0.175) --out $O/conv-qwen3-32b --runs $R/conv32 | tee $O/conv-qwen3-32b/table.txt
scripts/arrow_sweep.py -c examples/arrow-h20.toml --base-rate 2.45 --scales 0.1,0.2,0.3,0.4,0.5,0.6,0.8,1,1.25,1.5,2 \
  $Q32 $CODE $(slo 10 0.125) --out $O/code-qwen3-32b --runs $R/code32 | tee $O/code-qwen3-32b/table.txt
scripts/arrow_sweep.py -c examples/arrow-h20.toml --base-rate 5.38 --scales 0.1,0.15,0.2,0.25,0.3,0.35,0.4,0.5,0.6,0.8 \
  $L70 $(slo 3 0.2) --out $O/conv-llama70b-tp2 --runs $R/conv70 | tee $O/conv-llama70b-tp2/table.txt
scripts/arrow_sweep.py -c examples/arrow-h20.toml --base-rate 2.45 --target 0.5 --scales 0.05,0.1,0.15,0.2,0.25,0.3,0.4,0.5,0.6 \
  $L70 $CODE $(slo 10 0.2) --out $O/code-llama70b-tp2 --runs $R/code70 | tee $O/code-llama70b-tp2/table.txt
for split in "6 1" "4 2" "2 3"; do
  set -- $split
  scripts/arrow_sweep.py -c examples/arrow-h20.toml --base-rate 5.38 --setups arrow,static \
    --scales 0.2,0.4,0.6,0.8,1,1.25,1.5,1.75,2 $Q32 $(slo 6 0.175) --set cluster.decode_tensor_parallel_size=2 \
    --set cluster.instances=$(($1 + $2)) --set pd.prefill_instances=$1 --out $O/tp-hetero/p$1-d$2 --runs $R/a4-$1-$2 | tee $O/tp-hetero/p$1-d$2/table.txt
done
