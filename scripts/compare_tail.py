#!/usr/bin/env python3
"""Compare binned tail TTFT (PASCAL Fig. 10) between policies from a `kvfleet sim` results.json.

For each rate and each baseline, over the reasoning-length bins both runs report, prints the mean
per-bin reduction of the tail TTFT (1 - policy/baseline), the reduction of the mean tail over the
bins, and how many bins improved.

    scripts/compare_tail.py docs/results/pascal-8xh100/results.json [--policy pascal]
"""
import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("--policy", default="pascal")
    ap.add_argument("--max-reasoning", type=int, default=None, help="only bins below this many reasoning tokens")
    args = ap.parse_args()
    try:
        runs = json.load(open(args.results))
    except (OSError, ValueError) as e:
        print(f"error: {args.results}: {e}", file=sys.stderr)
        return 2
    by = {(r["policy"], r["rate"]): {b["lo"]: b["ttft_s"] for b in r["tail_ttft"]} for r in runs}
    rates = sorted({r["rate"] for r in runs if r["rate"] is not None})
    policies = sorted({r["policy"] for r in runs} - {args.policy})
    print(f"{'rate':>5}  {'vs':<20} {'bins':>4} {'improved':>8} {'mean per-bin':>13} {'mean of tails':>14}")
    for rate in rates:
        mine = by.get((args.policy, rate))
        if mine is None:
            continue
        for base in policies:
            other = by.get((base, rate), {})
            bins = sorted(b for b in mine if b in other and (args.max_reasoning is None or b < args.max_reasoning))
            if not bins:
                continue
            red = [1 - mine[b] / other[b] for b in bins if other[b] > 0]
            better = sum(1 for b in bins if mine[b] < other[b])
            tails = 1 - sum(mine[b] for b in bins) / sum(other[b] for b in bins)
            print(f"{rate:>5}  {base:<20} {len(bins):>4} {better:>4}/{len(bins):<3} {100*sum(red)/len(red):>12.1f}% {100*tails:>13.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
