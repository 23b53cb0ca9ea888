#!/usr/bin/env python3
"""One row per run directory (`kvfleet sim` / `kvfleet up` --out): TTFT, E2E, attainment, the
handoffs' q2 / c / q3 (results.json `handoffs`) and each flip's time from the run's first arrival,
instance and new role."""
import csv, glob, json, sys


def ms(v):
    return "-" if v is None else f"{1e3 * v:.0f}"


print("| run | TTFT p50 / p99 s | E2E p50 s | SLO attainment | handoffs | q2 p50 / p99 ms | c p50 / p99 ms | q3 p50 / p99 ms | flips (s after the first arrival: instance → role) |")
print("|---|---|---|---|---|---|---|---|---|")
for d in sys.argv[1:]:
    r = json.load(open(f"{d}/results.json"))[0]
    s = r["summary"]
    h = r.get("handoffs") or {}
    rows = list(csv.DictReader(open(glob.glob(f"{d}/requests-*.csv")[0])))
    t0 = min(float(x["arrival_s"]) for x in rows)
    flips = ", ".join(f"+{c['at_s'] - t0:.3f} {c['instance']} → {c['role']}" for c in r.get("role_changes") or [])
    print(f"| {d.rstrip('/').split('/')[-1]} | {s['ttft_p50_s']:.3f} / {s['ttft_p99_s']:.3f} | {s['e2e_p50_s']:.3f} | "
          f"{100 * s['slo_attainment']:.1f} % | {h.get('handoffs', '-')} | {ms(h.get('q2_p50_s'))} / {ms(h.get('q2_p99_s'))} | "
          f"{ms(h.get('c_p50_s'))} / {ms(h.get('c_p99_s'))} | {ms(h.get('q3_p50_s'))} / {ms(h.get('q3_p99_s'))} | {flips or 'none'} |")
