#!/bin/sh
# Arrow in the emulator against the simulator, on examples/arrow-up-4.toml (4 workers, 2P + 2D at
# the start, 60 requests): `kvfleet up` (real processes, etcd, live KV handoffs over QUIC) and
# `kvfleet sim` (the same controller in virtual time), the migration links shaped to the same
# rate in both. Needs target/release/{kvfleet,kvfleet-worker,kvfleet-coordinator}; writes the
# printouts and summaries here.
cd "$(dirname "$0")/../../../.."
D=docs/results/pd-arrow/emulator
B=target/release/kvfleet
for g in 2 10; do
  $B up -c examples/arrow-up-4.toml --link-gbps $g --out /tmp/arrow-emu/up-$g -q > $D/up-$g.txt 2>&1 || exit 1
  $B sim -c examples/arrow-up-4.toml --set link.bandwidth_gbps=$g --out /tmp/arrow-emu/sim-$g > $D/sim-$g.txt 2>&1 || exit 1
  cp /tmp/arrow-emu/up-$g/summary.csv $D/up-$g-summary.csv
  cp /tmp/arrow-emu/sim-$g/summary.csv $D/sim-$g-summary.csv
done
# 10 Gbit/s again, with time dilation 4 (every emulated duration stretched 4x, every reported time
# divided by 4): the host's QUIC no longer sets the pace of the handoffs.
$B up -c examples/arrow-up-4.toml --link-gbps 10 --time-dilation 4 --out /tmp/arrow-emu/up-10-k4 -q > $D/up-10-k4.txt 2>&1 || exit 1
cp /tmp/arrow-emu/up-10-k4/summary.csv $D/up-10-k4-summary.csv
# Heterogeneous TP: the decode pool (instances 2, 3) spans two GPUs per instance, the prefill pool
# one; 2 Gbit/s links.
sed 's/^\[cluster\]$/[cluster]\ndecode_tensor_parallel_size = 2/' examples/arrow-up-4.toml > /tmp/arrow-up-tp.toml
$B up -c /tmp/arrow-up-tp.toml --link-gbps 2 --out /tmp/arrow-emu/tp2-up-2 -q > $D/tp2-up-2.txt 2>&1 || exit 1
$B sim -c /tmp/arrow-up-tp.toml --set link.bandwidth_gbps=2 --out /tmp/arrow-emu/tp2-sim-2 > $D/tp2-sim-2.txt 2>&1 || exit 1
cp /tmp/arrow-emu/tp2-up-2/summary.csv $D/tp2-up-2-summary.csv
cp /tmp/arrow-emu/tp2-sim-2/summary.csv $D/tp2-sim-2-summary.csv
