#!/usr/bin/env python3
"""The PASCAL reproduction table (docs/results/pascal-reproduction/README.md) from the
`comparison.json` files `kvfleet sim` writes: one column per run directory, one row per figure
of the paper's evaluation, each with the paper's value and our target, `✓` / `✗` where a
target is met or missed.

    scripts/pascal_table.py --edge 8.18 --over 8.99 literal=DIR fixed=DIR ...

`--edge` is the capacity-edge rate, `--over` the 1.1× rate; rates up to the edge are checked for
the SLO row where a directory ran them.
"""
import argparse
import json
import sys


def load(path):
    try:
        with open(f"{path}/comparison.json") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        print(f"error: {path}/comparison.json: {e}", file=sys.stderr)
        sys.exit(2)


def near(a, b):
    return a is not None and b is not None and abs(a - b) < 1e-6


def tail(c, rate, baseline):
    return next((t for t in c["tail"] if near(t["rate"], rate) and t["baseline"] == baseline), None)


def pol(c, rate, policy):
    return next((p for p in c["policies"] if near(p["rate"], rate) and p["policy"] == policy), None)


def mean(r):
    return None if r is None else r["mean"]


def pct(r):
    if r is None:
        return "-"
    if r["n"] > 1 and r["min"] != r["max"]:
        return f"{100*r['mean']:+.1f} % [{100*r['min']:+.0f} … {100*r['max']:+.0f}]"
    return f"{100*r['mean']:+.1f} %"


def mark(ok):
    return "" if ok is None else (" ✓" if ok else " ✗")


def rows(c, edge, over):
    out = {}
    for base, key in (("fcfs", "max vs FCFS"), ("rr", "max vs RR")):
        t = tail(c, edge, base)
        if t is None:
            out[key] = "-"
            continue
        lo, hi = (-0.85, -0.45) if base == "fcfs" else (-0.45, -0.20)
        m = mean(t["max_reduction"])
        secs = f" ({mean(t['max_reduction_policy_s']):.0f} s vs {mean(t['max_reduction_baseline_s']):.0f} s)"
        out[key] = pct(t["max_reduction"]) + secs + mark(m is not None and lo <= m <= hi)
    worst = []
    for base in ("fcfs", "rr"):
        t = tail(c, edge, base)
        w = t and mean(t["worst_trusted_increase"])
        worst.append(f"{pct(t['worst_trusted_increase']) if t else '-'}{mark(None if w is None else w <= 0.15)}")
    out["worst increase"] = " / ".join(worst)
    # PASCAL's SLO violation at every rate up to the edge against min(FCFS, RR) + 0.3 pp.
    rates = sorted({p["rate"] for p in c["policies"] if p["rate"] is not None and p["rate"] <= edge + 1e-9})
    slo_ok, worst_gap = True, None
    for r in rates:
        p, f, rr = (mean((pol(c, r, x) or {}).get("slo_violation_pct")) for x in ("pascal", "fcfs", "rr"))
        if None in (p, f, rr):
            continue
        gap = p - min(f, rr)
        worst_gap = gap if worst_gap is None else max(worst_gap, gap)
        slo_ok &= gap <= 0.3
    p, f, rr = (mean((pol(c, edge, x) or {}).get("slo_violation_pct")) for x in ("pascal", "fcfs", "rr"))
    out["SLO vs baselines"] = (
        f"{p:.2f} % vs FCFS {f:.2f} %, RR {rr:.2f} % (worst gap {worst_gap:+.2f} pp over {len(rates)} rates)"
        + mark(slo_ok)
        if None not in (p, f, rr, worst_gap)
        else "-"
    )
    na, pa = mean((pol(c, edge, "pascal-nonadaptive") or {}).get("slo_violation_pct")), p
    out["NonAdaptive vs PASCAL SLO"] = (
        f"{na:.2f} % vs {pa:.2f} %" + mark(na >= 3 * pa and pa <= 1.5) if None not in (na, pa) else "-"
    )
    n = pol(c, edge, "pascal-nonadaptive")
    if n:
        p50, p99 = mean(n["e2e_p50_vs_subject"]), mean(n["e2e_p99_vs_subject"])
        out["NonAdaptive E2E"] = f"{100*p50:+.1f} % / {100*p99:+.1f} %" + mark(0.10 <= p50 <= 0.30 and 0 <= p99 <= 0.25)
    b = {x: mean((pol(c, edge, x) or {}).get("blocking_p99_s")) for x in ("pascal", "pascal-nomigration", "pascal-nonadaptive")}
    if None not in b.values():
        ok = b["pascal"] <= 1 and b["pascal-nomigration"] >= 5 * b["pascal"] and b["pascal"] < min(b["pascal-nonadaptive"], b["pascal-nomigration"])
        out["blocking P99"] = (
            f"PASCAL {b['pascal']:.2f} s, NoMigration {b['pascal-nomigration']:.2f} s, NonAdaptive {b['pascal-nonadaptive']:.2f} s" + mark(ok)
        )
    thr = [mean((pol(c, edge, x) or {}).get("throughput_vs_subject")) for x in ("fcfs", "rr")]
    if None not in thr:
        out["throughput"] = f"FCFS {100*thr[0]:+.1f} %, RR {100*thr[1]:+.1f} % vs PASCAL" + mark(all(abs(t) <= 0.03 for t in thr))
    x = mean((pol(c, edge, "pascal") or {}).get("transfer_p99_s"))
    out["P99 transfer"] = f"{x:.3f} s" + mark(0.07 <= x <= 0.5) if x is not None else "-"
    t = tail(c, over, "rr")
    if t is not None:
        w = mean(t["worst_trusted_increase"])
        s = mean((pol(c, over, "pascal") or {}).get("slo_violation_pct"))
        rs = mean((pol(c, over, "rr") or {}).get("slo_violation_pct"))
        out["1.1× edge"] = f"worst bin vs RR {pct(t['worst_trusted_increase'])}; SLO {s:.1f} % vs RR {rs:.1f} %" + mark(w is not None and w <= 0)
    return out


PAPER = [
    ("max vs FCFS", "−61 % (43 s) / −72 % (64 s)", "−45 … −85 %"),
    ("max vs RR", "−33 % (90 s) / −29 % (73 s)", "−20 … −45 %"),
    ("worst increase", "+6.1 % / +9.2 %", "≤ +15 % (vs FCFS / vs RR; bins < demotion, ≥ 10 samples)"),
    ("SLO vs baselines", "≤ both at every rate", "≤ min(RR, FCFS) + 0.3 pp at every rate up to the edge"),
    ("NonAdaptive vs PASCAL SLO", "7.45 % vs 0.69 %", "NonAdaptive ≥ 3× PASCAL, PASCAL ≤ 1.5 %"),
    ("NonAdaptive E2E", "+20.1 % / +9.7 %", "p50 +10 … +30 %, p99 0 … +25 %"),
    ("blocking P99", "NoMigration up to 27.39 s, PASCAL ≈ 0", "PASCAL ≤ 1 s, NoMigration ≥ 5×, PASCAL lowest"),
    ("throughput", "within 3 %", "within 3 %"),
    ("P99 transfer", "0.14 s / 0.25 s", "0.5–2× (0.07–0.5 s)"),
    ("1.1× edge", "TTFT kept low", "PASCAL's tail ≤ RR's in every trusted bin"),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--edge", type=float, required=True)
    ap.add_argument("--over", type=float, required=True)
    ap.add_argument("runs", nargs="+", help="NAME=DIR")
    a = ap.parse_args()
    cols = []
    for spec in a.runs:
        name, _, path = spec.partition("=")
        if not path:
            print(f"error: `{spec}`: expected NAME=DIR", file=sys.stderr)
            return 2
        cols.append((name, rows(load(path), a.edge, a.over)))
    print("| figure | paper (AlpacaEval / Arena-Hard) | target | " + " | ".join(n for n, _ in cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for key, paper, target in PAPER:
        print(f"| {key} | {paper} | {target} | " + " | ".join(r.get(key, "-") for _, r in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
