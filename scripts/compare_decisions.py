#!/usr/bin/env python3
"""Compare the controller's decisions of two runs, line by line.

Both `kvfleet sim` and the leader of `kvfleet up` log every placement and `</think>` decision with
the loads it saw when `RUST_LOG` enables the target `kvfleet::decisions` at debug level:

    RUST_LOG=kvfleet::decisions=debug kvfleet sim --config C.toml --out sim 2> sim-decisions.log
    RUST_LOG=info,kvfleet::decisions=debug kvfleet bench parity --workloads C.toml --out P
    scripts/compare_decisions.py sim-decisions.log P/C/emu/logs/coordinator-0.log [max]

Prints each decision (by kind and request) whose chosen instance or loads differ, times relative
to each run's first decision, `DIFF-TO` where the choice itself differs. A load is
`instance:kv_blocks:reasoning:fresh_answering:slo_ok`; for Arrow's flips (kind `flip`, the flip's
number as its request) `instance:role:queued_prefill_ms:decode_tokens:itl_ms`.
"""
import re
import sys

LINE = re.compile(r'kind="(\w+)" at_ns=(\d+) request=(\d+) to=(\d+)(?: role=\w+)? loads=(.*)$')


def parse(path):
    out = []
    with open(path) as f:
        for line in f:
            line = re.sub(r"\x1b\[[0-9;]*m", "", line)
            if "kvfleet::decisions" not in line:
                continue
            m = LINE.search(line)
            if m:
                out.append((m[1], int(m[2]), int(m[3]), int(m[4]), m[5].strip()))
    return out


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    a, b = parse(sys.argv[1]), parse(sys.argv[2])
    limit = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    if not a or not b:
        sys.exit("no decisions found (was RUST_LOG=kvfleet::decisions=debug set?)")
    a0, b0 = a[0][1], b[0][1]
    theirs = {(k, r): (t, to, loads) for k, t, r, to, loads in b}
    shown = 0
    for kind, t, r, to, loads in a:
        if (kind, r) not in theirs:
            print(f"{kind} {r}: only in the first run")
            continue
        bt, bto, bloads = theirs[(kind, r)]
        if to == bto and loads == bloads:
            continue
        flag = "DIFF-TO" if to != bto else "diff-load"
        print(f"{kind:5} req {r:3} A t={(t - a0) / 1e9:8.3f} to {to} [{loads}]")
        print(f"{'':13} B t={(bt - b0) / 1e9:8.3f} to {bto} [{bloads}] {flag}")
        shown += 1
        if shown >= limit:
            break


if __name__ == "__main__":
    main()
