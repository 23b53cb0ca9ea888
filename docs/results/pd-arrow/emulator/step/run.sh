#!/bin/sh
# The 8-worker Arrow example under its rate step: one simulator run, three emulator runs (4 Gbit/s
# links in both), and the table of README.md's "Eight workers under a rate step" from them.
# Release build first: cargo build --release -p kvfleet -p kvfleet-worker -p kvfleet-coordinator
set -e
B=./target/release/kvfleet
D=docs/results/pd-arrow/emulator/step
$B sim -c examples/arrow-up.toml --no-plots --out /tmp/arrow-step/sim > $D/sim.txt 2>&1
for i in 1 2 3; do
  $B up -c examples/arrow-up.toml --link-gbps 4 --out /tmp/arrow-step/up-$i > $D/up-$i.txt 2>&1
done
python3 $D/table.py /tmp/arrow-step/sim /tmp/arrow-step/up-1 /tmp/arrow-step/up-2 /tmp/arrow-step/up-3 | tee $D/table.txt
