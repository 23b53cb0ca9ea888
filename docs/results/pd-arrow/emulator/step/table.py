#!/usr/bin/env python3
"""One row per run directory (`kvfleet sim` / `kvfleet up` --out): TTFT, E2E, attainment,
handoffs and each flip's time from the run's first arrival, instance and new role."""
import csv, glob, json, sys

print("| run | TTFT p50 / p99 s | E2E p50 s | SLO attainment | handoffs (transfer p50 ms) | flips (s after the first arrival: instance → role) |")
print("|---|---|---|---|---|---|")
for d in sys.argv[1:]:
    r = json.load(open(f"{d}/results.json"))[0]
    s = r["summary"]
    rows = list(csv.DictReader(open(glob.glob(f"{d}/requests-*.csv")[0])))
    t0 = min(float(x["arrival_s"]) for x in rows)
    flips = ", ".join(f"+{c['at_s'] - t0:.3f} {c['instance']} → {c['role']}" for c in r.get("role_changes") or [])
    lm = r.get("live_migrations") or {}
    moved = lm.get("committed", s.get("migrations_total"))
    xfer = s.get("migration_transfer_p50_s") or 0.0
    print(f"| {d.rstrip('/').split('/')[-1]} | {s['ttft_p50_s']:.3f} / {s['ttft_p99_s']:.3f} | {s['e2e_p50_s']:.3f} | "
          f"{100 * s['slo_attainment']:.1f} % | {moved} ({1000 * xfer:.0f}) | {flips or 'none'} |")
