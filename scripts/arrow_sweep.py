#!/usr/bin/env python3
"""SLO attainment against arrival rate for Arrow, a static prefill/decode split and an
aggregated cluster, on one `kvfleet sim` config (docs/results/pd-arrow/).

Runs `kvfleet sim -c CONFIG` once per (setup, rate scale) with `workload.rate_scale` set, reads
each run's `summary.csv` (`slo_attainment` needs `[slo] ttft_s` in the config), then prints a
table of attainment per rate, each setup's goodput (the highest rate whose attainment is at least
the target, linearly interpolated between the rates run) and the goodput ratios, and writes
`attainment.csv` and `attainment.svg` into OUT.

    scripts/arrow_sweep.py --kvfleet target/release/kvfleet -c examples/arrow-h20.toml \\
        --scales 1,2,3,4,5,6,8,10 --out docs/results/pd-arrow/conv-qwen3-8b
"""

import argparse
import concurrent.futures
import csv
import json
import math
import os
import subprocess
import sys

SETUPS = {
    "arrow": ["--set", "pd.policy=arrow"],
    "static": ["--set", "pd.policy=static"],
    "aggregated": ["--set", "pd.policy=static", "--set", "pd.prefill_instances=0"],
    # Arrow's request scheduling baselines (§6.3): its pools, no SLO filter, no flips.
    "minimal-load": ["--set", "pd.policy=arrow", "--set", "pd.arrow.placement=minimal-load"],
    "round-robin": ["--set", "pd.policy=arrow", "--set", "pd.arrow.placement=round-robin"],
}


def run(kvfleet, config, setup, scale, runs, extra):
    folder = os.path.join(runs, f"{setup}-x{scale:g}")
    cmd = [kvfleet, "sim", "-c", config, "-q", "--no-plots", "--out", folder,
           "--set", f"workload.rate_scale={scale}", *extra, *SETUPS[setup]]
    # The setup's own settings come last, so they win over extras (aggregated's prefill_instances = 0).
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)}: exit {done.returncode}\n{done.stderr}")
    with open(os.path.join(folder, "summary.csv")) as f:
        row = next(csv.DictReader(f))
    if not row.get("slo_attainment"):
        sys.exit(f"{config}: no slo_attainment in {folder}/summary.csv (set [slo] ttft_s)")
    with open(os.path.join(folder, "results.json")) as f:
        flips = len(json.load(f)[0].get("role_changes", []))
    row = dict(row, **handoff_times(folder))
    return setup, scale, float(row["slo_attainment"]), float(row["requests_total"]), flips, row


def pct(values, q):
    if not values:
        return ""
    values = sorted(values)
    rank = math.ceil(len(values) * q)  # nearest rank
    return f"{1e3 * values[min(len(values), max(1, rank)) - 1]:.1f}"


# The handoff's latency breakdown in attainment.csv: q2, c, q3 (see handoff_times).
HANDOFF_COLUMNS = ("q2_p50_ms", "q2_p99_ms", "c_p50_ms", "c_p99_ms", "q3_p50_ms", "q3_p99_ms")


def handoff_times(folder):
    """q2 (first token -> its handoff starts: the wait for a decoder), c (the handoff's copy) and
    q3 (the handoff's commit -> the first iteration that runs the request on the decode instance),
    P50/P99 in ms, from a run's request and migration CSVs (its first migration is its handoff;
    q3 is the requests CSV's `q3_s`, measured after a request's last migration, which is its
    handoff unless it moved again)."""
    files = os.listdir(folder)
    reqs = next((f for f in files if f.startswith("requests-")), None)
    migs = next((f for f in files if f.startswith("migrations-")), None)
    if not reqs or not migs:
        return {}
    first_token, q3 = {}, []
    with open(os.path.join(folder, reqs)) as f:
        for r in csv.DictReader(f):
            if r["ttft_s"]:
                first_token[r["id"]] = float(r["arrival_s"]) + float(r["ttft_s"])
            if r.get("q3_s"):
                q3.append(float(r["q3_s"]))
    q2, c, seen = [], [], set()
    with open(os.path.join(folder, migs)) as f:
        for m in csv.DictReader(f):
            if m["request"] in seen or m["request"] not in first_token:
                continue
            seen.add(m["request"])
            q2.append(max(0.0, float(m["start_s"]) - first_token[m["request"]]))
            c.append(float(m["transfer_s"]))
    return {"q2_p50_ms": pct(q2, 0.5), "q2_p99_ms": pct(q2, 0.99), "c_p50_ms": pct(c, 0.5), "c_p99_ms": pct(c, 0.99),
            "q3_p50_ms": pct(q3, 0.5), "q3_p99_ms": pct(q3, 0.99)}


def goodput(points, target):
    """Highest rate with attainment >= target, interpolated where the curve crosses it."""
    best = None
    points = sorted(points)
    for i, (rate, att) in enumerate(points):
        if att >= target:
            best = rate
            if i + 1 < len(points) and points[i + 1][1] < target:
                r2, a2 = points[i + 1]
                best = rate + (r2 - rate) * (att - target) / (att - a2)
    return best


def svg(series, target, path):
    w, h, m = 640, 400, 50
    rates = [r for pts in series.values() for r, _ in pts]
    xmax = max(rates) * 1.05
    colors = {"arrow": "#d62728", "static": "#1f77b4", "aggregated": "#2ca02c", "minimal-load": "#9467bd",
              "round-robin": "#8c564b"}
    x = lambda r: m + (w - 2 * m) * r / xmax
    y = lambda a: h - m - (h - 2 * m) * a
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<line x1="{m}" y1="{y(0)}" x2="{w - m}" y2="{y(0)}" stroke="black"/>',
             f'<line x1="{m}" y1="{y(0)}" x2="{m}" y2="{y(1)}" stroke="black"/>',
             f'<line x1="{m}" y1="{y(target)}" x2="{w - m}" y2="{y(target)}" stroke="grey" stroke-dasharray="4"/>',
             f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">arrival rate (req/s)</text>',
             f'<text x="14" y="{h / 2}" transform="rotate(-90 14 {h / 2})" text-anchor="middle">SLO attainment</text>']
    for t in range(0, 11, 2):
        parts.append(f'<text x="{m - 6}" y="{y(t / 10) + 4}" text-anchor="end">{t * 10}%</text>')
    step = max(1, round(xmax / 8))
    for r in range(0, int(xmax) + 1, step):
        parts.append(f'<text x="{x(r)}" y="{y(0) + 16}" text-anchor="middle">{r}</text>')
    for k, (name, pts) in enumerate(sorted(series.items())):
        pts = sorted(pts)
        line = " ".join(f"{x(r):.1f},{y(a):.1f}" for r, a in pts)
        c = colors.get(name, "black")
        parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{line}"/>')
        parts += [f'<circle cx="{x(r):.1f}" cy="{y(a):.1f}" r="3" fill="{c}"/>' for r, a in pts]
        parts.append(f'<text x="{w - m - 90}" y="{m + 16 * k}" fill="{c}">{name}</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvfleet", default="target/release/kvfleet")
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--scales", default="1,2,3,4,5,6,8,10")
    ap.add_argument("--setups", default="arrow,static,aggregated")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--base-rate", type=float, required=True, help="the trace's own rate, req/s")
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", help="where each run's own output goes (default: OUT/runs)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--set", action="append", default=[], help="extra --set for every run")
    a = ap.parse_args()
    scales = [float(s) for s in a.scales.split(",")]
    setups = a.setups.split(",")
    for s in setups:
        if s not in SETUPS:
            sys.exit(f"--setups: unknown setup {s!r} (known: {', '.join(SETUPS)})")
    extra = [x for kv in a.set for x in ("--set", kv)]
    os.makedirs(a.out, exist_ok=True)
    jobs = [(s, k) for s in setups for k in scales]
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        runs = a.runs or os.path.join(a.out, "runs")
        results = list(pool.map(lambda j: run(a.kvfleet, a.config, j[0], j[1], runs, extra), jobs))
    series = {s: [] for s in setups}
    with open(os.path.join(a.out, "attainment.csv"), "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["setup", "rate_scale", "rate_req_s", "slo_attainment", "flips", "ttft_p50_s", "ttft_p99_s",
                      "tpot_p50_s", *HANDOFF_COLUMNS])
        for setup, scale, att, _, flips, row in results:
            rate = a.base_rate * scale
            series[setup].append((rate, att))
            out.writerow([setup, scale, f"{rate:.2f}", f"{att:.4f}", flips, row["ttft_p50_s"], row["ttft_p99_s"],
                          row["tpot_p50_s"], *(row.get(k, "") for k in HANDOFF_COLUMNS)])
    print("rate req/s  " + "  ".join(f"{s:>10}" for s in setups))
    for scale in scales:
        cells = []
        for s in setups:
            r = next(r for r in results if r[0] == s and r[1] == scale)
            cells.append(f"{100 * r[2]:9.1f}%" + (f" ({r[4]} flips)" if s == "arrow" else ""))
        print(f"{a.base_rate * scale:10.1f}  " + "  ".join(cells))
    good = {s: goodput(series[s], a.target) for s in setups}
    print(f"goodput (attainment >= {100 * a.target:.0f} %): " +
          ", ".join(f"{s} {g:.1f} req/s" if g else f"{s} below the lowest rate" for s, g in good.items()))
    for s in setups:
        if s != "arrow" and good.get("arrow") and good.get(s):
            print(f"arrow / {s}: {good['arrow'] / good[s]:.2f}x")
    svg(series, a.target, os.path.join(a.out, "attainment.svg"))


if __name__ == "__main__":
    main()
