#!/usr/bin/env python3
"""Side by side, per policy, the summary figures `kvfleet bench parity` got from the simulator
(`<dir>/<workload>/sim/summary.csv`) and the emulator (`.../emu/summary.csv`), as a Markdown table.

    scripts/sim_vs_emu.py /tmp/edge
"""
import csv
import pathlib
import sys

COLUMNS = [
    ("TTFT p50 s", "ttft_p50_s", 2),
    ("TTFT p99 s", "ttft_p99_s", 2),
    ("E2E p50 s", "e2e_p50_s", 2),
    ("E2E p99 s", "e2e_p99_s", 2),
    ("blocking p99 s", "blocking_latency_p99_s", 2),
    ("SLO viol %", "slo_violation_rate", None),
    ("output tok/s", "throughput_output_tokens_per_s", 0),
    ("migrations", "migrations_total", 0),
]


def row(path):
    with open(path) as f:
        return next(csv.DictReader(f))


def cell(r, key, decimals):
    v = r.get(key, "")
    if v == "":
        return "-"
    x = float(v)
    return f"{100 * x:.2f}" if decimals is None else f"{x:.{decimals}f}"


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    root = pathlib.Path(sys.argv[1])
    runs = sorted(p for p in root.iterdir() if (p / "sim" / "summary.csv").exists() and (p / "emu" / "summary.csv").exists())
    if not runs:
        print(f"error: no <workload>/sim and /emu summaries under {root}", file=sys.stderr)
        return 2
    print("| run | backend | " + " | ".join(c[0] for c in COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for run in runs:
        for backend, name in (("sim", "kvfleet sim"), ("emu", "kvfleet up")):
            r = row(run / backend / "summary.csv")
            print(f"| {run.name} | {name} | " + " | ".join(cell(r, k, d) for _, k, d in COLUMNS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
