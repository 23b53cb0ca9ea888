#!/usr/bin/env python3
"""How long the emulator's control plane takes to hear what the simulator acts on at once.

Reads a `kvfleet up` run's process logs, written with

    RUST_LOG=info,kvfleet::moves=debug,kvfleet::iterations=debug kvfleet up ... --out RUN

and prints, as P50 / P90 / max in milliseconds:

- a request's arrival -> its submit reaching the leader (the client's way, one request after
  another in arrival order);
- a prefill's end on its worker's timeline -> the leader hearing `PrefillDone` (what a handoff
  waits for), split into the worker's part (the iteration completed -> the event streamed) and
  the way to the leader.

Usage: scripts/control_latency.py RUN_DIR
"""
import datetime
import glob
import re
import sys

FIELD = re.compile(r"(\w+)=(\d+)")


def wall(line):
    stamp = re.sub(r"\x1b\[[0-9;]*m", "", line).split()[0]
    return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").timestamp()


def fields(line):
    return {k: int(v) for k, v in FIELD.findall(line)}


def summary(ms):
    if not ms:
        return "none"
    ms = sorted(ms)
    return "P50 %.1f  P90 %.1f  max %.1f  (n = %d)" % (ms[len(ms) // 2], ms[int(0.9 * len(ms))], ms[-1], len(ms))


def main(run):
    completed, streamed = {}, {}
    for path in glob.glob(run + "/logs/worker-*.log"):
        for line in open(path):
            if "iteration completed" in line:
                completed[fields(line)["end_ns"]] = wall(line)
            elif "prefill done streamed" in line:
                streamed.setdefault(fields(line)["request"], wall(line))
    submits, heard = [], {}
    for line in open(run + "/logs/coordinator-0.log"):
        if "submit heard" in line:
            f = fields(line)
            submits.append((f["received_ns"] - f["arrival_ns"]) / 1e6)
        elif "prefill done heard" in line:
            f = fields(line)
            heard.setdefault(f["request"], (f["at_ns"], f["heard_ns"], wall(line)))
    total, worker, way = [], [], []
    for request, (at_ns, heard_ns, heard_wall) in sorted(heard.items()):
        total.append((heard_ns - at_ns) / 1e6)
        if at_ns in completed and request in streamed:
            worker.append((streamed[request] - completed[at_ns]) * 1e3)
            way.append((heard_wall - streamed[request]) * 1e3)
    print("arrival -> submit at the leader (ms):        ", summary(submits))
    print("prefill end -> leader hears PrefillDone (ms):", summary(total))
    print("  iteration completed -> event streamed (ms):", summary(worker))
    print("  event streamed -> leader hears it (ms):    ", summary(way))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
