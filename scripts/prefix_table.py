#!/usr/bin/env python3
"""Prefix-caching results as a Markdown table, from `kvfleet sim` output directories.

For each run: prefix-cache hit rate, TTFT p50 / p99, TTFT p50 by hit bucket (no hit, at most
half the prompt cached, more than half) and cache-aware's prefix fetches, read from `summary.csv` and the per-request CSVs
(`cached_tokens` / `prompt_tokens`).

    scripts/prefix_table.py docs/results/prefix/synthetic docs/results/prefix/conversation
"""
import csv
import pathlib
import sys


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def cell(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)


def table(directory: pathlib.Path) -> str:
    rows = list(csv.DictReader(open(directory / "summary.csv")))
    out = [
        f"**{directory.name}**\n",
        "| policy | rate | hit % | TTFT p50 s | TTFT p99 s | TTFT p50, no hit | ≤ 50 % cached | > 50 % cached | SLO viol % | prefix fetches (GB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rate = r["rate"] or "trace"
        stem = f"{r['policy']}-{rate}" if r["rate"] else f"{r['policy']}-trace"
        path = directory / f"requests-{stem}.csv"
        buckets = {"none": [], "low": [], "high": []}
        if path.exists():
            for q in csv.DictReader(open(path)):
                if not q["ttft_s"]:
                    continue
                share = int(q["cached_tokens"]) / max(1, int(q["prompt_tokens"]))
                key = "none" if share == 0 else ("low" if share <= 0.5 else "high")
                buckets[key].append(float(q["ttft_s"]))
        hit = float(r["prefix_hit_rate"]) * 100 if r["prefix_hit_rate"] else 0.0
        slo = float(r["slo_violation_rate"]) * 100 if r["slo_violation_rate"] else None
        out.append(
            f"| {r['policy']} | {rate} | {hit:.1f} | {cell(float(r['ttft_p50_s']))} | {cell(float(r['ttft_p99_s']))} "
            f"| {cell(pct(buckets['none'], 0.5))} ({len(buckets['none'])}) | {cell(pct(buckets['low'], 0.5))} ({len(buckets['low'])}) "
            f"| {cell(pct(buckets['high'], 0.5))} ({len(buckets['high'])}) | {cell(slo)} "
            f"| {int(r.get('prefix_fetches') or 0)} ({int(r.get('prefix_fetch_bytes') or 0) / 1e9:.1f}) |"
        )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    for d in sys.argv[1:]:
        print(table(pathlib.Path(d)))
