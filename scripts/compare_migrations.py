#!/usr/bin/env python3
"""Compare the live migrations of a `kvfleet bench parity` workload, request by request.

    scripts/compare_migrations.py P/<workload>/sim/live-migrations-*.csv P/<workload>/emu/live-migrations.csv [last_request]

Prints each migrated request's source->target, stages, total and downtime (ms) and per-stage times
in the simulator and the emulator, then, over the requests both moved between the same pair of
instances (up to `last_request`, e.g. the first placement apart), the emulated total time's error
against the simulated one and the downtime difference.
"""
import csv
import statistics
import sys


def load(path):
    with open(path) as f:
        return {int(r["request"]): r for r in csv.DictReader(f)}


def row(r):
    if r is None:
        return "-"
    stages = r.get("stage_ms", "")
    return (f"{r['source']}->{r['target']} st{r['stages']} tot {float(r['total_ms']):7.1f} "
            f"dt {float(r['downtime_ms']):6.1f} [{stages}]")


def main():
    sim, emu = load(sys.argv[1]), load(sys.argv[2])
    last = int(sys.argv[3]) if len(sys.argv) > 3 else None
    print("request  sim: src->dst stages total_ms downtime_ms [stage_ms] | emu: the same")
    for k in sorted(set(sim) | set(emu)):
        print(k, row(sim.get(k)), "|", row(emu.get(k)))
    alike = [k for k in sim if k in emu and (last is None or k <= last)
             and (sim[k]["source"], sim[k]["target"]) == (emu[k]["source"], emu[k]["target"])]
    if not alike:
        print("no request moved alike in both")
        return
    err = [abs(float(emu[k]["total_ms"]) / float(sim[k]["total_ms"]) - 1) * 100 for k in alike]
    dt = [float(emu[k]["downtime_ms"]) - float(sim[k]["downtime_ms"]) for k in alike]
    print(f"{len(alike)} moved alike{'' if last is None else f' up to request {last}'}: "
          f"total time |error| median {statistics.median(err):.1f} % mean {statistics.mean(err):.1f} %; "
          f"downtime emu - sim median {statistics.median(dt):+.1f} ms mean {statistics.mean(dt):+.1f} ms")


if __name__ == "__main__":
    main()
