#!/usr/bin/env bash
# The network-namespace testbed: the compose experiment (etcd, two coordinators, N workers, the
# trace sink, `kvfleet replay`) on one Linux host, with every worker in its own network namespace
# behind a shaped link, so that live migrations cross links of a given rate, latency and loss.
# docs/netns-testbed.md explains the layout, the shaping and the measured numbers.
#
# Usage (as root):
#   scripts/netns-testbed.sh up [N] [--rate R] [--delay D] [--loss L] [--config FILE] [--out DIR]
#   scripts/netns-testbed.sh run [--requests N] [--arrivals R] [--seed S]
#   scripts/netns-testbed.sh down
#   scripts/netns-testbed.sh experiment [N] [link and run options]    up + run + down + check
#   scripts/netns-testbed.sh check DIR          link-model check of a finished run's migrations
#   scripts/netns-testbed.sh preflight          can this host run the testbed? (root, netns, tc, ...)
#   scripts/netns-testbed.sh status             the running testbed's namespaces and processes
#
#   N             workers (default: the config's `workers`)
#   --rate R      every link's rate, each direction (e.g. 100mbit, 1gbit)
#   --delay D     every link's one-way delay (e.g. 10ms, 500us)
#   --loss L      every link's packet loss (e.g. 1%)
#   --config F    link and workload config (default scripts/netns-testbed.conf)
#   --out DIR     results directory (default results/netns-<timestamp>)
#   --requests N  requests to replay; --arrivals R  arrival rate, req/s; --seed S  workload seed
#   --partition W:AT:FOR  cut worker W off the network AT s into the replay, for FOR s (every packet
#                 in or out of its namespace dropped, loopback aside); longer than the 2 s
#                 registration lease, its requests are re-placed and its late copies must not count
#   --bound PCT   link-model check: the largest median |error| that passes (default 25)
#
# `up` leaves the testbed running (its state is in /run/kvfleet-netns/<prefix>/); `run` replays a
# workload through it; `down` stops every process (SIGTERM first, so spans and stop lines are
# written), deletes the namespaces (with them the bridge, the veths and their rules), analyses the
# traces and runs the link-model check. `experiment` does all three and removes everything on any
# exit, also on failure or Ctrl-C. Nothing is created outside the testbed's namespaces: the bridge
# and every address live in the control namespace, so the host's interfaces, routes and firewall
# are never touched.
#
# Exit status: 0 when every request completed exactly once, no worker counted a KV error and (on
# a loss-free run) the link-model check passed; 1 otherwise; 2 for invalid arguments or a host
# that cannot run the testbed (the message says what is missing).
#
# Environment: KVFLEET_BIN_DIR (prebuilt binaries: skips `cargo build`), CARGO_TARGET_DIR,
# KVFLEET_NETNS_PREFIX (namespace prefix, default kvf: <prefix>-ctl, <prefix>-w0, ...),
# KVFLEET_NETNS_NET (the /24 inside the testbed, default 10.77.0), KVFLEET_KV_MEMORY (worker KV
# arena, overrides the config's kv_memory), KVFLEET_MODEL (overrides the config's model),
# KVFLEET_NETNS_RT=0 (run the delay line at normal instead of real-time priority).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PREFIX=${KVFLEET_NETNS_PREFIX:-kvf}
NET=${KVFLEET_NETNS_NET:-10.77.0}
STATE=/run/kvfleet-netns/$PREFIX
CTL=$PREFIX-ctl
CTL_IP=$NET.1
COORD_IPS=("$NET.2" "$NET.3")

say() { echo "[$(date +%H:%M:%S)] $*"; }
die() { echo "error: $*" >&2; exit 2; }
worker_ns() { echo "$PREFIX-w$1"; }
worker_ip() { echo "$NET.$((10 + $1))"; }
in_ns() { local ns=$1; shift; ip netns exec "$ns" "$@"; }

# ---------------------------------------------------------------------------------------------
# Units. Each prints the value in base units (bit/s, µs, parts per million) or fails naming it.

rate_bps() { # 100mbit -> 100000000
  local v=$1 what=$2 bps
  [[ "$v" =~ ^([0-9]+(\.[0-9]+)?)(bit|kbit|mbit|gbit)$ ]] || die "$what: '$v' is not a rate (a number with bit, kbit, mbit or gbit, e.g. 100mbit)"
  bps=$(python3 -c "import sys; print(int(round(float(sys.argv[1]) * {'bit': 1, 'kbit': 1e3, 'mbit': 1e6, 'gbit': 1e9}[sys.argv[2]])))" "${BASH_REMATCH[1]}" "${BASH_REMATCH[3]}")
  ((bps >= 8000 && bps <= 100000000000)) || die "$what: '$v' is outside 8kbit..100gbit"
  echo "$bps"
}

delay_us() { # 10ms -> 10000
  local v=$1 what=$2 us
  [[ "$v" =~ ^([0-9]+(\.[0-9]+)?)(us|ms|s)$ ]] || die "$what: '$v' is not a delay (a number with us, ms or s, e.g. 10ms)"
  us=$(python3 -c "import sys; print(int(round(float(sys.argv[1]) * {'us': 1, 'ms': 1e3, 's': 1e6}[sys.argv[2]])))" "${BASH_REMATCH[1]}" "${BASH_REMATCH[3]}")
  ((us <= 10000000)) || die "$what: '$v' is longer than 10 s"
  echo "$us"
}

loss_ppm() { # 1% -> 10000
  local v=$1 what=$2 ppm
  [[ "$v" =~ ^([0-9]+(\.[0-9]+)?)%$ ]] || die "$what: '$v' is not a loss (a percentage, e.g. 1%)"
  ppm=$(python3 -c "import sys; print(int(round(float(sys.argv[1]) * 1e4)))" "${BASH_REMATCH[1]}")
  ((ppm < 1000000)) || die "$what: '$v' must be below 100%"
  echo "$ppm"
}

positive_int() { [[ "$1" =~ ^[0-9]+$ && "$1" -gt 0 ]] || die "$2 must be a positive integer, got '$1'"; }

# ---------------------------------------------------------------------------------------------
# Config: `key = value` lines (see scripts/netns-testbed.conf), then the command line on top.

declare -A CONF=()
load_config() {
  local file=$1 lineno=0 line key value
  [ -f "$file" ] || die "config file $file does not exist"
  while IFS= read -r line || [ -n "$line" ]; do
    lineno=$((lineno + 1))
    line=${line%%#*}
    [[ "$line" =~ ^[[:space:]]*$ ]] && continue
    [[ "$line" =~ ^[[:space:]]*([A-Za-z0-9_.]+)[[:space:]]*=[[:space:]]*([^[:space:]]+)[[:space:]]*$ ]] \
      || die "$file:$lineno: expected 'key = value', got '$line'"
    key=${BASH_REMATCH[1]} value=${BASH_REMATCH[2]}
    case "$key" in
      workers | rate | delay | loss | requests | arrivals | seed | model | kv_memory | migration_timeout_ms | max_stages | \
        prompt_tokens | reasoning_tokens | answer_tokens) ;;
      w[0-9]*.rate | w[0-9]*.delay | w[0-9]*.loss) [[ "$key" =~ ^w[0-9]+\.(rate|delay|loss)$ ]] || die "$file:$lineno: unknown key '$key'" ;;
      *) die "$file:$lineno: unknown key '$key' (see scripts/netns-testbed.conf for the known keys)" ;;
    esac
    CONF[$key]=$value
  done <"$file"
}

# The link of worker $1: "rate_bps delay_us loss_ppm" (validated), from the config and overrides.
link_of() {
  local i=$1 r d l
  r=${OPT_RATE:-${CONF[w$i.rate]:-${CONF[rate]:-}}}
  d=${OPT_DELAY:-${CONF[w$i.delay]:-${CONF[delay]:-}}}
  l=${OPT_LOSS:-${CONF[w$i.loss]:-${CONF[loss]:-0%}}}
  [ -n "$r" ] || die "no rate for worker $i: set 'rate' in the config or pass --rate"
  [ -n "$d" ] || die "no delay for worker $i: set 'delay' in the config or pass --delay"
  local bps us ppm
  bps=$(rate_bps "$r" "rate of worker $i") || exit 2
  us=$(delay_us "$d" "delay of worker $i") || exit 2
  ppm=$(loss_ppm "$l" "loss of worker $i") || exit 2
  echo "$bps $us $ppm"
}

# ---------------------------------------------------------------------------------------------
# Preflight: everything the testbed needs, tried for real in a scratch namespace.

# Sets WHY (why this host cannot run the testbed; empty when it can) and HAS_NETEM (informational).
check_host() {
  local c probe=$PREFIX-probe
  WHY="" HAS_NETEM=0
  ((EUID == 0)) || { WHY="not running as root (network namespaces, veth and tc need root)"; return; }
  for c in ip tc iptables nft python3 etcd setsid; do
    command -v "$c" >/dev/null 2>&1 || { WHY="the '$c' command is not installed (apt-get install iproute2 iptables nftables python3 etcd-server util-linux)"; return; }
  done
  ip netns del "$probe" 2>/dev/null || true
  ip netns add "$probe" 2>/dev/null || { WHY="'ip netns add' failed (no network namespaces?)"; return; }
  if ! ip -n "$probe" link add p0 type veth peer name p1 2>/dev/null; then
    WHY="cannot create a veth pair (CONFIG_VETH)"
  elif ! ip -n "$probe" link add pbr type bridge 2>/dev/null; then
    WHY="cannot create a bridge (CONFIG_BRIDGE)"
  elif ! ip -n "$probe" link set p0 gso_max_segs 1 2>/dev/null; then
    WHY="'ip link set gso_max_segs' is not supported (iproute2 too old)"
  elif ! in_ns "$probe" tc qdisc add dev p0 root tbf rate 100mbit burst 32kb latency 50ms 2>/dev/null; then
    WHY="tc cannot add a tbf qdisc (CONFIG_NET_SCH_TBF)"
  elif ! in_ns "$probe" nft -f - 2>/dev/null <<EOF
table netdev probe {
  chain c {
    type filter hook ingress device p1 priority 0;
    numgen random mod 1000000 < 10000 counter drop
  }
}
EOF
  then
    WHY="nft cannot drop at random on a netdev ingress hook (CONFIG_NF_TABLES_NETDEV, CONFIG_NFT_NUMGEN)"
  elif ! in_ns "$probe" iptables -t mangle -A PREROUTING -m physdev --physdev-in p1 -j NFQUEUE --queue-num 0 2>/dev/null; then
    WHY="iptables cannot queue bridged packets to user space (physdev match, NFQUEUE target: CONFIG_NETFILTER_XT_MATCH_PHYSDEV, CONFIG_NETFILTER_XT_TARGET_NFQUEUE, CONFIG_NETFILTER_NETLINK_QUEUE)"
  elif [ "$(in_ns "$probe" cat /proc/sys/net/bridge/bridge-nf-call-iptables 2>/dev/null)" != 1 ] \
    && ! in_ns "$probe" sysctl -qw net.bridge.bridge-nf-call-iptables=1 2>/dev/null; then
    WHY="bridged packets do not traverse iptables (CONFIG_BRIDGE_NETFILTER)"
  fi
  in_ns "$probe" tc qdisc add dev p1 root netem delay 1ms 2>/dev/null && HAS_NETEM=1
  ip netns del "$probe"
}

preflight() {
  check_host
  [ -z "$WHY" ] || die "this host cannot run the netns testbed: $WHY"
  say "preflight: root, netns, veth, bridge, tc tbf, nft netdev loss, iptables NFQUEUE delay: ok"
  if ((HAS_NETEM)); then
    say "preflight: tc netem exists too; the testbed uses tbf + nft + a user-space delay line everywhere for the same behaviour on every kernel"
  else
    say "preflight: this kernel has no tc netem (sch_netem is not built in): delay comes from a user-space NFQUEUE delay line, loss from nft (as documented)"
  fi
}

# ---------------------------------------------------------------------------------------------
# Binaries and certificates (as scripts/lib/docker.sh does for compose).

build_binaries() {
  if [ -n "${KVFLEET_BIN_DIR:-}" ]; then
    BIN_DIR=$KVFLEET_BIN_DIR
  else
    say "cargo build (kvfleet, kvfleet-coordinator, kvfleet-worker)"
    (cd "$ROOT" && cargo build --quiet -p kvfleet -p kvfleet-coordinator -p kvfleet-worker --bins)
    BIN_DIR=${CARGO_TARGET_DIR:-$ROOT/target}/debug
  fi
  local b
  for b in kvfleet kvfleet-coordinator kvfleet-worker; do
    [ -x "$BIN_DIR/$b" ] || die "$BIN_DIR/$b is missing (cargo build -p kvfleet -p kvfleet-coordinator -p kvfleet-worker)"
  done
  BIN_DIR=$(cd "$BIN_DIR" && pwd)
}

make_pki() {
  local dir=$1 k=$BIN_DIR/kvfleet n
  rm -rf "$dir"
  "$k" certs init --dir "$dir/ca" >/dev/null
  for n in coordinator-0 coordinator-1; do
    "$k" certs issue --ca-dir "$dir/ca" --role coordinator --name "$n" --out "$dir/$n" >/dev/null
  done
  "$k" certs issue --ca-dir "$dir/ca" --role worker --name worker --out "$dir/worker" >/dev/null
  "$k" certs issue --ca-dir "$dir/ca" --role client --name client --out "$dir/client" >/dev/null
}

# ---------------------------------------------------------------------------------------------
# Processes: each runs in its own session (it outlives `up`), pid in $STATE/pids/NAME.

# spawn NAME NAMESPACE LOG CMD...
spawn() {
  local name=$1 ns=$2 log=$3
  shift 3
  rm -f "$STATE/pids/$name"
  # shellcheck disable=SC2016 # $$ is the inner shell's pid, which exec hands to ip and then CMD.
  setsid -f sh -c 'echo $$ >"$0"; exec ip netns exec "$@"' "$STATE/pids/$name" "$ns" "$@" </dev/null >"$log" 2>&1
  local i
  for ((i = 0; i < 50; i++)); do
    [ -s "$STATE/pids/$name" ] && return 0
    sleep 0.1
  done
  die "$name did not start (log: $log)"
}

pid_of() { cat "$STATE/pids/$1" 2>/dev/null || true; }
alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null && ! grep -q ') Z ' "/proc/$1/stat" 2>/dev/null; }

# Wait until file $1 has a line matching $2 (at most $3 s), failing with the log on timeout.
wait_for_line() {
  local file=$1 pattern=$2 limit=$3 what=$4 i
  for ((i = 0; i < limit * 10; i++)); do
    grep -q -- "$pattern" "$file" 2>/dev/null && return 0
    sleep 0.1
  done
  tail -20 "$file" >&2 || true
  echo "error: $what: no '$pattern' in $file after $limit s" >&2
  return 1
}

# SIGTERM the named processes, wait up to $1 s for them to exit, then SIGKILL what is left.
stop_procs() {
  local limit=$1 name pid i left
  shift
  local pids=()
  for name in "$@"; do
    pid=$(pid_of "$name")
    alive "$pid" && kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
  done
  for ((i = 0; i < limit * 10; i++)); do
    left=0
    for pid in "${pids[@]}"; do alive "$pid" && left=1; done
    ((left)) || return 0
    sleep 0.1
  done
  for pid in "${pids[@]}"; do alive "$pid" && kill -KILL "$pid" 2>/dev/null; done
  return 0
}

# ---------------------------------------------------------------------------------------------
# The delay line: a user-space NFQUEUE consumer in the control namespace. iptables queues every
# IPv4 packet a worker sends (physdev-in = its bridge port) to queue <i>; the consumer releases
# each queue's packets in arrival order, <delay> after they arrived. It sits on the bridge, not in
# the worker, because a packet held inside the sending host would still count against its socket
# (TCP small queues, UDP send buffers) and throttle the sender to buffer/delay.

write_delay_line() {
  cat >"$1" <<'PY'
"""NFQUEUE delay line: python3 delayline.py QUEUE:DELAY_US [...]. Packets are accepted (in order)
DELAY_US after they were read from the queue. Only the packet id travels to user space
(NFQNL_COPY_META); SIGTERM prints per-queue counters and exits."""
import collections, os, select, signal, socket, struct, sys, time

NETLINK_NETFILTER, SUBSYS_QUEUE = 12, 3
MSG_PACKET, MSG_CONFIG, MSG_VERDICT_BATCH = 0, 2, 3
NLM_F_REQUEST, NLM_F_ACK, NLMSG_ERROR = 1, 4, 2
CFG_CMD, CFG_PARAMS, CFG_QUEUE_MAXLEN, CFG_MASK, CFG_FLAGS = 1, 2, 3, 4, 5
CMD_BIND, COPY_META, NF_ACCEPT, F_GSO = 1, 1, 1, 4
PACKET_TYPE = (SUBSYS_QUEUE << 8) | MSG_PACKET

queues = {}
for arg in sys.argv[1:]:
    q, d = arg.split(":")
    queues[int(q)] = int(d) / 1e6
sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE: bursts must not overflow
sock.setsockopt(270, 5, 1)  # SOL_NETLINK, NETLINK_NO_ENOBUFS
sock.bind((0, 0))
seq = 0


def attr(kind, payload):
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * (-n % 4)


def message(queue, kind, attrs, flags=NLM_F_REQUEST):
    global seq
    seq += 1
    body = struct.pack("!BBH", socket.AF_UNSPEC, 0, queue) + b"".join(attrs)
    return struct.pack("=IHHII", 16 + len(body), (SUBSYS_QUEUE << 8) | kind, flags, seq, 0) + body


def configure(queue, attrs):
    sock.send(message(queue, MSG_CONFIG, attrs, NLM_F_REQUEST | NLM_F_ACK))
    data = sock.recv(65536)
    kind = struct.unpack_from("=H", data, 4)[0]
    err = struct.unpack_from("=i", data, 16)[0] if kind == NLMSG_ERROR else 0
    if err:
        sys.exit(f"delay line: configuring queue {queue} failed: {os.strerror(-err)}")


for q in queues:
    configure(q, [attr(CFG_CMD, struct.pack("!BBH", CMD_BIND, 0, 0))])
    # F_GSO: a GSO batch is queued whole (else the kernel would cut it into packets first).
    configure(q, [attr(CFG_PARAMS, struct.pack("!IB", 0, COPY_META)), attr(CFG_QUEUE_MAXLEN, struct.pack("!I", 1 << 16)),
                  attr(CFG_MASK, struct.pack("!I", F_GSO)), attr(CFG_FLAGS, struct.pack("!I", F_GSO))])
sock.setblocking(False)
pending = {q: collections.deque() for q in queues}
count = {q: 0 for q in queues}
# Per release, how late its oldest packet left, in 10 us buckets (bounded memory on long runs).
late = {q: collections.Counter() for q in queues}
worst_us = {q: 0.0 for q in queues}


def percentile_us(hist, p):
    total, seen = sum(hist.values()), 0
    for bucket in sorted(hist):
        seen += hist[bucket]
        if seen >= p * total:
            return (bucket + 1) * 10
    return 0


def stop(*_):
    for q in sorted(queues):
        print(f"delay line: queue {q}: {count[q]} packets (a GSO batch counts once) delayed {queues[q] * 1e3:g} ms in "
              f"{sum(late[q].values())} releases; released late by p50 {percentile_us(late[q], 0.5)} us, "
              f"p99 {percentile_us(late[q], 0.99)} us, max {worst_us[q]:.0f} us", flush=True)
    sys.exit(0)


signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
print(f"delay line ready: {', '.join(f'queue {q} {d * 1e3:g} ms' for q, d in sorted(queues.items()))}", flush=True)
mono = time.monotonic
while True:
    now = mono()
    due = None
    for q, line in pending.items():
        last = None
        if line and line[0][0] <= now:
            us = (now - line[0][0]) * 1e6
            late[q][int(us // 10)] += 1
            worst_us[q] = max(worst_us[q], us)
        while line and line[0][0] <= now:
            last = line.popleft()[1]
        if last is not None:
            # One batch verdict accepts every packet of the queue up to this id, in order.
            sock.send(message(q, MSG_VERDICT_BATCH, [attr(2, struct.pack("!II", NF_ACCEPT, last))]))
        if line and (due is None or line[0][0] < due):
            due = line[0][0]
    ready, _, _ = select.select([sock], [], [], None if due is None else max(0.0, due - mono()))
    if not ready:
        continue
    while True:
        try:
            data = sock.recv(1 << 16)
        except BlockingIOError:
            break
        arrived = mono()
        off = 0
        while off + 20 <= len(data):
            length, kind = struct.unpack_from("=IH", data, off)
            if kind == PACKET_TYPE:
                q = struct.unpack_from("!H", data, off + 18)[0]
                a, end = off + 20, off + length
                while a + 8 <= end:
                    alen, atype = struct.unpack_from("=HH", data, a)
                    if atype & 0x7FFF == 1:  # NFQA_PACKET_HDR: packet id first
                        pending[q].append((arrived + queues[q], struct.unpack_from("!I", data, a + 4)[0]))
                        count[q] += 1
                        break
                    a += (alen + 3) & ~3
            off += (length + 3) & ~3 if length else len(data)
PY
}

# ---------------------------------------------------------------------------------------------
# The link-model check: every migration's measured time against the simulator's fabric model.

write_link_check() {
  cat >"$1" <<'PY'
"""Link-model check: python3 linkcheck.py OUT BOUND_PCT.

Prediction = the simulator's fabric model (netmodel/src/link.rs, `Fabric`) for the configured
links: each worker has an egress and an ingress port of its link rate; a transfer src->dst runs at
min(rate_src / flows leaving src, rate_dst / flows entering dst) (= `bandwidth / max(...)` when the
rates are equal), re-shared whenever a transfer starts or drains, and completes one one-way latency
(the source link's delay) after its last byte left: alone, `bytes * 8 / rate + latency`
(`Fabric::estimate`). Every migration in the traces is a transfer of its KV bytes starting when
its migration span starts; aborted ones leave the fabric when they ended. Measured = the
migration's total time (prepare -> commit), the duration the simulator charges a migration.

The model leaves out two costs every real migration pays; the check reports them separately
("with costs", informational, not judged): the rate is the wire's, and a 1472-byte QUIC datagram
is 1514 bytes on it (UDP, IPv4, Ethernet headers) for about 1433 bytes of stream data (short
header, AEAD tag, STREAM frame), so serialisation takes 1514/1433 as long; and the protocol's two
round trips, PREPARE -> ready and COMMIT -> committed, each the source's plus the target's delay.
"""
import csv, json, statistics, sys

WIRE_PER_STREAM_BYTE = 1514 / 1433

out, bound = sys.argv[1], float(sys.argv[2])
links = {}
with open(f"{out}/testbed/links.tsv") as f:
    for row in csv.DictReader(f, delimiter="\t"):
        links[int(row["instance"])] = (int(row["rate_bps"]), int(row["delay_us"]), int(row["loss_ppm"]))
try:
    with open(f"{out}/traces/analysis.json") as f:
        migrations = json.load(f)["migrations"]
except (OSError, ValueError, KeyError) as e:
    sys.exit(f"link check: no trace analysis to check ({out}/traces/analysis.json: {e})")

flows = []
t0 = min((m["start_ns"] for m in migrations), default=0)
for m in migrations:
    if not m.get("bytes") or m.get("source") not in links or m.get("target") not in links:
        continue
    start = (m["start_ns"] - t0) / 1e9  # relative: absolute Unix seconds would cost float precision
    end = start + m["total_ms"] / 1e3
    flows.append({"m": m, "src": m["source"], "dst": m["target"], "start": start, "left": m["bytes"] * 8.0,
                  "cancel": None if m["outcome"] == "committed" else end, "drained": None})

# Fluid simulation of the fabric (floating point; the Rust model is exact to the nanosecond).
pending = sorted(flows, key=lambda fl: fl["start"])
active, now, i, steps = [], 0.0, 0, 0
while i < len(pending) or active:
    # Every step starts, drains or cancels at least one transfer.
    steps += 1
    assert steps <= 3 * len(flows) + 2, "link check: the fabric model made no progress (a bug)"
    egress, ingress = {}, {}
    for fl in active:
        egress[fl["src"]] = egress.get(fl["src"], 0) + 1
        ingress[fl["dst"]] = ingress.get(fl["dst"], 0) + 1
    for fl in active:
        fl["rate"] = min(links[fl["src"]][0] / egress[fl["src"]], links[fl["dst"]][0] / ingress[fl["dst"]])
    nxt = pending[i]["start"] if i < len(pending) else float("inf")
    for fl in active:
        nxt = min(nxt, now + fl["left"] / fl["rate"])
        if fl["cancel"] is not None:
            nxt = min(nxt, fl["cancel"])
    for fl in active:
        fl["left"] = max(0.0, fl["left"] - fl["rate"] * (nxt - now))
    now = nxt
    still = []
    for fl in active:
        if fl["left"] <= fl["rate"] * 1e-9:  # less than a nanosecond of work left: drained
            fl["drained"] = now
        elif fl["cancel"] is None or fl["cancel"] > now:
            still.append(fl)
    active = still
    while i < len(pending) and pending[i]["start"] <= now:
        active.append(pending[i])
        now = max(now, pending[i]["start"])
        i += 1

rows, errors, cost_errors = [], [], []
for fl in flows:
    m = fl["m"]
    if m["outcome"] != "committed" or fl["drained"] is None:
        continue
    rate, delay_us, _ = links[fl["src"]]
    delay, delay_back = delay_us / 1e6, links[fl["dst"]][1] / 1e6
    alone = m["bytes"] * 8 / rate + delay
    predicted = fl["drained"] - fl["start"] + delay
    with_costs = (predicted - delay) * WIRE_PER_STREAM_BYTE + delay + 2 * (delay + delay_back)
    measured = m["total_ms"] / 1e3
    err, cost_err = measured / predicted - 1, measured / with_costs - 1
    errors.append(err)
    cost_errors.append(cost_err)
    rows.append([m["migration_id"], m["request_id"], f"{fl['src']}->{fl['dst']}", m["bytes"], f"{alone * 1e3:.1f}",
                 f"{predicted * 1e3:.1f}", f"{measured * 1e3:.1f}", f"{err * 100:+.1f}",
                 f"{m['bytes'] * 8 / measured / 1e6:.1f}", f"{with_costs * 1e3:.1f}", f"{cost_err * 100:+.1f}"])
rows.sort(key=lambda r: float(r[6]))
header = ["migration", "request", "link", "bytes", "alone_ms", "predicted_ms", "measured_ms", "error_pct", "goodput_mbit_s",
          "with_costs_ms", "costs_error_pct"]
with open(f"{out}/linkcheck.csv", "w", newline="") as f:
    csv.writer(f).writerows([header] + rows)

lossy = any(l[2] > 0 for l in links.values())
lines = []
desc = sorted({(r, d, l) for r, d, l in links.values()})
lines.append("links: " + "; ".join(f"{r / 1e6:g} Mbit/s, {d / 1e3:g} ms one-way, {l / 1e4:g} % loss" for r, d, l in desc))
committed = sum(1 for fl in flows if fl["m"]["outcome"] == "committed")
lines.append(f"migrations: {len(flows)} in the traces, {committed} committed (compared below)")
if rows:
    w = [max(len(str(r[k])) for r in rows + [header]) for k in range(len(header))]
    for r in [header] + rows:
        lines.append("  " + "  ".join(str(c).rjust(w[k]) for k, c in enumerate(r)))
if not errors:
    lines.append("link model: no committed migration to compare" + ("" if lossy else ": FAIL (a loss-free run must migrate to be checked)"))
    verdict = "NONE"
else:
    a = sorted(abs(e) for e in errors)
    p90 = a[min(len(a) - 1, -(-len(a) * 9 // 10) - 1)]
    med = statistics.median(a)
    bias = statistics.median(errors)
    lines.append(f"link model: |error| median {med * 100:.1f} %, p90 {p90 * 100:.1f} %, max {a[-1] * 100:.1f} % "
                 f"(signed median {bias * 100:+.1f} %: measured slower when positive) over {len(errors)} migrations")
    c = sorted(abs(e) for e in cost_errors)
    lines.append(f"with costs (headers x{WIRE_PER_STREAM_BYTE:.3f}, + 2 round trips; informational): |error| median "
                 f"{statistics.median(c) * 100:.1f} %, signed median {statistics.median(cost_errors) * 100:+.1f} %")
    if lossy:
        lines.append("link model: not judged: the links drop packets, which the loss-free model does not describe "
                     "(QUIC's congestion control slows down on loss)")
        # For scale: Mathis et al.'s steady state of one Reno-like flow, MSS / RTT * 1.22 / sqrt(p).
        r, d, l = max(links.values(), key=lambda v: v[2])
        mathis = 1433 * 8 / (2 * d / 1e6) * 1.22 / (l / 1e6) ** 0.5
        goodputs = sorted(float(row[8]) for row in rows)
        lines.append(f"lossy links: one loss-limited flow at {l / 1e4:g} % loss and a {2 * d / 1e3:g} ms round trip "
                     f"moves about {mathis / 1e6:.1f} Mbit/s (Mathis et al.); committed migrations' goodput: median "
                     f"{statistics.median(goodputs):.1f}, max {goodputs[-1]:.1f} Mbit/s")
        verdict = "LOSSY"
    elif med * 100 <= bound:
        lines.append(f"link model: PASS (median |error| {med * 100:.1f} % <= {bound:g} %)")
        verdict = "PASS"
    else:
        lines.append(f"link model: FAIL (median |error| {med * 100:.1f} % > {bound:g} %)")
        verdict = "FAIL"
text = "\n".join(lines)
print(text)
with open(f"{out}/linkcheck.txt", "w") as f:
    f.write(text + "\n")
with open(f"{out}/linkcheck.json", "w") as f:
    json.dump({"verdict": verdict, "bound_pct": bound, "compared": len(errors),
               "median_abs_error_pct": statistics.median([abs(e) * 100 for e in errors]) if errors else None,
               "signed_median_error_pct": statistics.median([e * 100 for e in errors]) if errors else None,
               "with_costs_median_abs_error_pct": statistics.median([abs(e) * 100 for e in cost_errors]) if errors else None,
               "migrations": len(flows), "committed": committed}, f, indent=1)
sys.exit(1 if verdict == "FAIL" or (verdict == "NONE" and not lossy) else 0)
PY
}

# ---------------------------------------------------------------------------------------------
# up: namespaces, links, shaping, processes.

create_links() {
  local n=$1 i ns ip link bps us ppm burst limit queues=()
  ip netns add "$CTL"
  in_ns "$CTL" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
  ip -n "$CTL" link set lo up
  ip -n "$CTL" link add br0 type bridge
  ip -n "$CTL" addr add "$CTL_IP/24" dev br0
  ip -n "$CTL" addr add "${COORD_IPS[0]}/24" dev br0
  ip -n "$CTL" addr add "${COORD_IPS[1]}/24" dev br0
  ip -n "$CTL" link set br0 up
  # Bridged IPv4 must pass iptables (the delay line's NFQUEUE rule); on by default in a new namespace.
  in_ns "$CTL" sysctl -qw net.bridge.bridge-nf-call-iptables=1
  printf 'instance\tnamespace\tip\trate_bps\tdelay_us\tloss_ppm\n' >"$OUT/testbed/links.tsv"
  for ((i = 0; i < n; i++)); do
    ns=$(worker_ns "$i") ip=$(worker_ip "$i")
    link=$(link_of "$i") || exit 2
    read -r bps us ppm <<<"$link"
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$i" "$ns" "$ip" "$bps" "$us" "$ppm" >>"$OUT/testbed/links.tsv"
    ip netns add "$ns"
    in_ns "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
    ip -n "$ns" link set lo up
    # Created inside the namespaces: no interface ever appears in the host's namespace.
    ip -n "$CTL" link add "w$i" type veth peer name eth0 netns "$ns"
    # The bridge port cuts GSO batches into MTU-sized packets before they reach the worker, so
    # that loss below is per packet, as on a wire (the worker itself keeps sending GSO batches:
    # the delay line then handles one batch per message, ten times fewer than packets).
    ip -n "$CTL" link set "w$i" gso_max_segs 1 master br0 up
    ip -n "$ns" addr add "$ip/24" dev eth0
    ip -n "$ns" link set eth0 up
    # Rate, both directions: tbf where the worker sends, and where the bridge sends to it. Burst:
    # 2 ms at the rate (ShapeParams::fabric_gbps's choice), queue: 50 ms or 4 x delay.
    burst=$((bps / 8 / 500 > 16384 ? bps / 8 / 500 : 16384))
    limit=$((bps / 8 * (us * 4 > 50000 ? us * 4 : 50000) / 1000000))
    limit=$((limit > 65536 ? limit : 65536))
    in_ns "$ns" tc qdisc add dev eth0 root tbf rate "${bps}bit" burst "$burst" limit "$limit"
    in_ns "$CTL" tc qdisc add dev "w$i" root tbf rate "${bps}bit" burst "$burst" limit "$limit"
    # Loss: as the worker's interface receives packets (MTU-sized, see above). Every packet between
    # two workers crosses exactly one such hook, data and acknowledgements alike.
    {
      echo "table netdev kvfleet_link {"
      echo "  chain ingress {"
      echo "    type filter hook ingress device eth0 priority 0;"
      echo "    counter"
      ((ppm == 0)) || echo "    numgen random mod 1000000 < $ppm counter drop"
      echo "  }"
      echo "}"
    } | in_ns "$ns" nft -f -
    ((us == 0)) || queues+=("$i:$us")
  done
  if ((${#queues[@]})); then
    write_delay_line "$STATE/delayline.py"
    # Real-time priority (SCHED_FIFO; it sleeps between packets): on a busy host a delay line that
    # waits for a CPU releases packets late (measured: p99 1.3 ms late at normal priority, 0.16 ms
    # with it). KVFLEET_NETNS_RT=0 turns it off.
    local rt=()
    [ "${KVFLEET_NETNS_RT:-1}" = 0 ] || ! command -v chrt >/dev/null || rt=(chrt -f 10)
    spawn delayline "$CTL" "$OUT/logs/delayline.log" "${rt[@]}" python3 "$STATE/delayline.py" "${queues[@]}"
    wait_for_line "$OUT/logs/delayline.log" '^delay line ready' 10 "the delay line" || exit 1
    for q in "${queues[@]}"; do
      in_ns "$CTL" iptables -t mangle -A PREROUTING -m physdev --physdev-in "w${q%%:*}" -j NFQUEUE --queue-num "${q%%:*}"
    done
  fi
}

# Round trip from worker 0's namespace to the control namespace, measured with UDP (the delay
# line's own overhead shows here): "min median max" in ms.
probe_rtt() {
  local ns=$1 dst=$2
  # Not through in_ns: a backgrounded function would be a subshell, and $! not the echo server.
  ip netns exec "$CTL" python3 -c '
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], 9999)); s.settimeout(5)
try:
    while True:
        d, a = s.recvfrom(2048); s.sendto(d, a)
except socket.timeout:
    pass' "$dst" &
  local echo_pid=$!
  in_ns "$ns" python3 -c '
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(0.5); rtt = []
for i in range(10):
    for attempt in range(5):
        t = time.monotonic(); s.sendto(b"x" * 64, (sys.argv[1], 9999))
        try:
            s.recvfrom(2048); rtt.append((time.monotonic() - t) * 1e3); break
        except socket.timeout:
            pass
    time.sleep(0.01)
rtt.sort(); print(f"{rtt[0]:.2f} {rtt[len(rtt) // 2]:.2f} {rtt[-1]:.2f}" if rtt else "none")' "$dst"
  kill "$echo_pid" 2>/dev/null || true
  wait "$echo_pid" 2>/dev/null || true
}

# Whether a measured round trip (ms, or "none") includes at least most of a one-way delay (µs).
delay_in_effect() {
  [ "$1" != none ] && awk -v m="$1" -v us="$2" 'BEGIN { exit !(m * 1000 >= 0.8 * us) }'
}

# The delay line's state, for a run where packets were not delayed.
delay_diagnostics() {
  echo "## sysctl (control namespace)"
  in_ns "$CTL" sysctl net.bridge.bridge-nf-call-iptables
  echo "## iptables -t mangle -L PREROUTING -v -n (control namespace)"
  in_ns "$CTL" iptables -t mangle -L PREROUTING -v -n
  echo "## /proc/net/netfilter/nfnetlink_queue (control namespace)"
  in_ns "$CTL" cat /proc/net/netfilter/nfnetlink_queue
  echo "## delay line log"
  tail -n 20 "$OUT/logs/delayline.log"
  echo "## bridge ports"
  ip -n "$CTL" -d link show master br0
}

start_processes() {
  local n=$1 i ns ip pki=$OUT/pki otlp=http://$CTL_IP:4317
  spawn etcd "$CTL" "$OUT/logs/etcd.log" etcd --name kvfleet --data-dir "$STATE/etcd" \
    --listen-client-urls "http://$CTL_IP:2379" --advertise-client-urls "http://$CTL_IP:2379" \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster kvfleet=http://127.0.0.1:2380
  spawn traces "$CTL" "$OUT/logs/traces.log" "$BIN_DIR/kvfleet" traces collect --listen "$CTL_IP:4317" \
    --out "$OUT/traces/spans.jsonl" --append
  wait_for_line "$OUT/logs/etcd.log" 'ready to serve client requests' 30 etcd || exit 1
  for i in 0 1; do
    spawn "coordinator-$i" "$CTL" "$OUT/logs/coordinator-$i.log" env RUST_LOG=info "$BIN_DIR/kvfleet-coordinator" \
      --listen "${COORD_IPS[$i]}:7000" --advertise "${COORD_IPS[$i]}:7000" --etcd "http://$CTL_IP:2379" \
      --policy pascal --model "$MODEL" --headroom-blocks 16 --tls-dir "$pki/coordinator-$i" --otlp-endpoint "$otlp"
  done
  for ((i = 0; i < n; i++)); do
    ns=$(worker_ns "$i")
    # The compose worker's command line (docker-compose.yml), with the instance number fixed to
    # the namespace's index so the link config's w<i> is instance i.
    spawn "worker-$i" "$ns" "$OUT/logs/worker-$i.log" env RUST_LOG=info "$BIN_DIR/kvfleet-worker" \
      --instance "$i" --listen 0.0.0.0:7100 --advertise auto --kv-listen 0.0.0.0:7200 --kv-advertise auto \
      --etcd "http://$CTL_IP:2379" --tls-dir "$pki/worker" --model "$MODEL" --gpu h100-80gb --timing auto \
      --scheduler pascal --kv-memory "$KV_MEMORY" --cpu-memory "$KV_MEMORY" --kv-fill stamp --load-interval-ms 20 \
      --stop-copy-blocks 2 --max-stages "$MAX_STAGES" --migration-timeout-ms "$MIGRATION_TIMEOUT_MS" --metrics-listen 0.0.0.0:9100 --otlp-endpoint "$otlp"
  done
}

cmd_up() {
  local n=${ARG_N:-${CONF[workers]:-3}} i link bps us ppm
  positive_int "$n" "the number of workers"
  ((n <= 200)) || die "at most 200 workers (one /24), got $n"
  for ((i = 0; i < n; i++)); do link_of "$i" >/dev/null; done # validate before creating anything
  preflight
  [ ! -e "$STATE/state.env" ] || die "a testbed with prefix $PREFIX is already up (scripts/netns-testbed.sh down, or another KVFLEET_NETNS_PREFIX)"
  ip netns list | grep -q "^$CTL\b" && die "namespace $CTL exists but no state file: remove it with 'ip netns del $CTL' (and $PREFIX-w*) first"
  build_binaries
  UP_STARTED=1
  OUT=${OPT_OUT:-$ROOT/results/netns-$(date +%Y%m%d-%H%M%S)}
  mkdir -p "$OUT/logs" "$OUT/traces" "$OUT/testbed" "$STATE/pids"
  OUT=$(cd "$OUT" && pwd)
  cp "$CONFIG" "$OUT/testbed/config.conf"
  {
    echo "OUT=$OUT"
    echo "N=$n"
    echo "BIN_DIR=$BIN_DIR"
    echo "RUNS=0"
  } >"$STATE/state.env"
  say "netns testbed ($PREFIX): $n workers; results in $OUT"
  make_pki "$OUT/pki"
  create_links "$n"
  for ((i = 0; i < n; i++)); do
    link=$(link_of "$i") || exit 2
    read -r bps us ppm <<<"$link"
    say "link w$i ($(worker_ip "$i")): $(awk "BEGIN {print $bps / 1e6}") Mbit/s each way, $(awk "BEGIN {print $us / 1e3}") ms one-way, $(awk "BEGIN {print $ppm / 1e4}") % loss"
  done
  read -r lo med hi <<<"$(probe_rtt "$(worker_ns 0)" "$CTL_IP")"
  say "measured round trip w0 -> control: min $lo ms, median $med ms, max $hi ms (expected: the link delay, one way shaped)"
  read -r bps us ppm <<<"$(link_of 0)"
  if ((us > 0)) && ! delay_in_effect "$med" "$us"; then
    # Seen once in many runs: packets crossed without being queued. Record what the delay line
    # and its rule looked like, make sure bridged packets pass iptables, and measure again.
    delay_diagnostics >"$OUT/testbed/delay-diagnostics.txt" 2>&1
    say "warning: the round trip is below w0's one-way delay: the delay line is not in effect (state in testbed/delay-diagnostics.txt); checking the bridge's iptables hook and the delay rules, and measuring again"
    in_ns "$CTL" sysctl -qw net.bridge.bridge-nf-call-iptables=1
    for ((i = 0; i < n; i++)); do
      read -r bps us ppm <<<"$(link_of "$i")"
      ((us == 0)) || in_ns "$CTL" iptables -t mangle -C PREROUTING -m physdev --physdev-in "w$i" -j NFQUEUE --queue-num "$i" 2>/dev/null \
        || { say "the delay rule of w$i was missing: adding it again"; in_ns "$CTL" iptables -t mangle -A PREROUTING -m physdev --physdev-in "w$i" -j NFQUEUE --queue-num "$i"; }
    done
    read -r bps us ppm <<<"$(link_of 0)"
    read -r lo med hi <<<"$(probe_rtt "$(worker_ns 0)" "$CTL_IP")"
    say "measured round trip w0 -> control (again): min $lo ms, median $med ms, max $hi ms"
    delay_in_effect "$med" "$us" || {
      echo "error: packets cross the links without the configured delay (round trip $med ms, w0's delay $((us / 1000)) ms); see $OUT/testbed/delay-diagnostics.txt" >&2
      exit 1
    }
  fi
  echo "rtt_w0_ctl_ms min=$lo median=$med max=$hi" >"$OUT/testbed/rtt.txt"
  start_processes "$n"
  for ((i = 0; i < n; i++)); do
    wait_for_line "$OUT/logs/worker-$i.log" 'registered in etcd' 60 "worker $i" || { echo "worker $i did not register" >&2; exit 1; }
  done
  say "up: etcd, 2 coordinators, the trace sink on $CTL ($CTL_IP); $n workers registered"
}

# ---------------------------------------------------------------------------------------------
# run: replay a workload through the leader (from the control namespace), like compose does.

load_state() {
  [ -f "$STATE/state.env" ] || die "no testbed with prefix $PREFIX is up (scripts/netns-testbed.sh up N)"
  # shellcheck disable=SC1091
  source "$STATE/state.env"
}

# The workload settings, from the command line over the config, each checked.
validate_workload() {
  REQUESTS=${OPT_REQUESTS:-${CONF[requests]:-24}} ARRIVALS=${OPT_ARRIVALS:-${CONF[arrivals]:-4}} SEED=${OPT_SEED:-${CONF[seed]:-7}}
  positive_int "$REQUESTS" "requests"
  if [ -n "$OPT_PARTITION" ]; then
    [[ "$OPT_PARTITION" =~ ^([0-9]+):([0-9]+(\.[0-9]+)?):([0-9]+(\.[0-9]+)?)$ ]] \
      || die "--partition must be WORKER:AT_S:FOR_S (e.g. 1:2:5), got '$OPT_PARTITION'"
    PART_W=${BASH_REMATCH[1]} PART_AT=${BASH_REMATCH[2]} PART_FOR=${BASH_REMATCH[4]}
  fi
  [[ "$ARRIVALS" =~ ^[0-9]+(\.[0-9]+)?$ && ! "$ARRIVALS" =~ ^0+(\.0+)?$ ]] || die "arrivals must be a positive number of requests per second, got '$ARRIVALS'"
  [[ "$SEED" =~ ^[0-9]+$ ]] || die "seed must be a non-negative integer, got '$SEED'"
  local k
  for k in prompt_tokens reasoning_tokens answer_tokens; do
    [ -z "${CONF[$k]:-}" ] || positive_int "${CONF[$k]}" "$k"
  done
  [ -z "${CONF[workers]:-}" ] || positive_int "${CONF[workers]}" "workers"
}

# The workload: `kvfleet up`'s default (cli/src/up/default-up.toml) with the config's lengths.
write_replay_config() {
  local file=$1 requests=$2 arrivals=$3 seed=$4 p=${CONF[prompt_tokens]:-100} r=${CONF[reasoning_tokens]:-200} a=${CONF[answer_tokens]:-120}
  cat >"$file" <<TOML
# Written by scripts/netns-testbed.sh: the workload replayed through the testbed. The cluster's
# settings (model, KV sizes, policy) are the processes' flags; only [workload] and [slo] matter here.
[cluster]
instances = $N
model = "$MODEL"
gpu = "h100-80gb"

[workload]
seed = $seed
num_requests = $requests
[workload.arrivals]
kind = "poisson"
rate = $arrivals
[workload.lengths]
kind = "lognormal"
prompt_median = $p.0
prompt_sigma = 0.5
prompt_max = $((4 * p))
reasoning_median = $r.0
reasoning_sigma = 0.5
reasoning_max = $((4 * r))
answer_median = $a.0
answer_sigma = 0.5
answer_max = $((4 * a))
TOML
}

# A network partition: every packet into or out of worker W's namespace dropped (its loopback
# aside), from AT s to AT + FOR s; each step logged with its time into FILE.
partition() {
  local w=$1 at=$2 span=$3 file=$4 ns
  ns=$(worker_ns "$w")
  ((w < N)) || { echo "partition: no worker $w (the testbed has $N)" >>"$file"; return; }
  sleep "$at"
  in_ns "$ns" iptables -I INPUT 1 ! -i lo -j DROP
  in_ns "$ns" iptables -I OUTPUT 1 ! -o lo -j DROP
  echo "$(date +%s.%N) cut worker $w off ($ns) for $span s" >>"$file"
  say "partition: worker $w cut off for $span s"
  sleep "$span"
  heal "$w" "$file"
}

# End worker W's partition (nothing to do when none is on).
heal() {
  local ns
  ns=$(worker_ns "$1")
  if in_ns "$ns" iptables -D INPUT ! -i lo -j DROP 2>/dev/null; then
    in_ns "$ns" iptables -D OUTPUT ! -o lo -j DROP 2>/dev/null || true
    echo "$(date +%s.%N) healed worker $1" >>"$2"
    say "partition: worker $1 reachable again"
  fi
}

cmd_run() {
  load_state
  local requests=$REQUESTS arrivals=$ARRIVALS seed=$SEED run=$((RUNS + 1)) dir i rc=0
  dir=$OUT/replay
  ((run == 1)) || dir+="-$run"
  sed -i "s/^RUNS=.*/RUNS=$run/" "$STATE/state.env"
  write_replay_config "$dir.toml" "$requests" "$arrivals" "$seed"
  local args=(replay -c "$dir.toml" --coordinators "${COORD_IPS[0]}:7000,${COORD_IPS[1]}:7000" --tls-dir "$OUT/pki/client"
    --requests "$requests" --min-workers "$N" --out "$dir" --timeout-s 300 --id-base $(((run - 1) * 1000000)))
  args+=(--rate "$arrivals" --seed "$seed")
  say "replaying through the leader: kvfleet ${args[*]}"
  # In the background and waited for, so that a signal to this script is handled at once (bash
  # runs traps only after a foreground command ends); `down` kills it with the namespace.
  ip netns exec "$CTL" env RUST_LOG=warn "$BIN_DIR/kvfleet" "${args[@]}" >"$dir.log" 2>&1 &
  local replay_pid=$! cut_pid=""
  if [ -n "$OPT_PARTITION" ]; then
    partition "$PART_W" "$PART_AT" "$PART_FOR" "$dir-partition.txt" &
    cut_pid=$!
  fi
  wait "$replay_pid" || rc=$?
  if [ -n "$cut_pid" ]; then
    # A replay that ended inside the partition: heal it before anything reads the workers.
    kill "$cut_pid" 2>/dev/null || true
    wait "$cut_pid" 2>/dev/null || true
    heal "$PART_W" "$dir-partition.txt"
  fi
  cat "$dir.log"
  in_ns "$CTL" "$BIN_DIR/kvfleet" status --coordinator "${COORD_IPS[0]}:7000,${COORD_IPS[1]}:7000" \
    --tls-dir "$OUT/pki/client" >"$dir-status.txt" 2>&1 || true
  mkdir -p "$OUT/metrics"
  for ((i = 0; i < N; i++)); do
    in_ns "$CTL" python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' \
      "http://$(worker_ip "$i"):9100/metrics" >"$OUT/metrics/worker-$i.prom" 2>/dev/null || echo "(scraping worker $i failed)" >&2
  done
  local errs
  errs=$(cat "$OUT"/metrics/worker-*.prom 2>/dev/null | awk '/^kvfleet_kv_errors_total/ {s += $2} END {print s + 0}')
  say "workers' kvfleet_kv_errors_total after the run: $errs"
  ((rc == 0)) || { say "FAIL: kvfleet replay exit $rc (not every request completed exactly once: $dir/replay.json)"; return 1; }
  ((errs == 0)) || { say "FAIL: the workers counted $errs KV errors"; return 1; }
  say "run $run: every request completed exactly once ($dir/replay.json), no KV error"
}

# ---------------------------------------------------------------------------------------------
# down: stop every process, delete the namespaces, analyse the traces, check the link model.

cmd_down() {
  [ -f "$STATE/state.env" ] || { teardown_namespaces; say "nothing was up (prefix $PREFIX)"; return 0; }
  load_state
  local i workers=()
  for ((i = 0; i < N; i++)); do workers+=("worker-$i"); done
  # Workers first (they deregister and flush their spans), then the coordinators, then the rest.
  stop_procs 15 "${workers[@]}"
  stop_procs 10 coordinator-0 coordinator-1
  stop_procs 5 traces
  stop_procs 5 etcd delayline
  save_counters "$N"
  teardown_namespaces
  rm -rf "$STATE"
  say "down: processes stopped, namespaces deleted"
  finish_report "$OUT"
}

# What the shapers did, read before the namespaces go: tc and nft counters, and per worker the
# packets its interface received and the share the loss rule dropped (testbed/loss.tsv).
save_counters() {
  local n=$1 i ns got dropped
  printf 'instance\treceived_packets\tdropped_packets\tdropped_pct\n' >"$OUT/testbed/loss.tsv"
  for ((i = 0; i < n; i++)); do
    ns=$(worker_ns "$i")
    {
      echo "== w$i: tc -s qdisc (worker side, what it sends)"
      in_ns "$ns" tc -s qdisc show dev eth0
      echo "== w$i: tc -s qdisc (bridge side, what it receives)"
      in_ns "$CTL" tc -s qdisc show dev "w$i"
      echo "== w$i: nft (loss on receive)"
      in_ns "$ns" nft list table netdev kvfleet_link
    } >>"$OUT/testbed/counters.txt" 2>&1 || true
    # The first counter sees every packet, the second (if any) the dropped ones.
    read -r got dropped < <(in_ns "$ns" nft list table netdev kvfleet_link 2>/dev/null \
      | grep -o 'counter packets [0-9]*' | awk '{print $3}' | tr '\n' ' '; echo) || true
    [ -n "${got:-}" ] || continue
    printf '%s\t%s\t%s\t%s\n' "$i" "$got" "${dropped:-0}" "$(python3 -c "import sys; print(f'{100 * int(sys.argv[2]) / max(1, int(sys.argv[1])):.2f}')" "$got" "${dropped:-0}")" >>"$OUT/testbed/loss.tsv"
  done
  say "loss applied (packets received by each worker's interface, dropped by the loss rule):"
  column -t "$OUT/testbed/loss.tsv" | sed 's/^/  /'
}

# Kill whatever still runs in this prefix's namespaces (all of it started here) and delete them.
teardown_namespaces() {
  local ns pid
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$PREFIX-(ctl|w[0-9]+|probe)$" || true); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
}

# Stop lines, trace analysis, link check; returns non-zero when a KV error was counted or the check failed.
finish_report() {
  local out=$1 bin=${BIN_DIR:-} rc=0 errs lines
  lines=$(grep -h 'kvfleet-worker: stopped' "$out"/logs/worker-*.log 2>/dev/null || true)
  echo "$lines" | sed 's/^/  /'
  errs=$(echo "$lines" | grep -o 'kv_errors=[0-9]*' | awk -F= '{s += $2} END {print s + 0}')
  [ -n "$lines" ] || { say "no worker stop line found in $out/logs"; rc=1; }
  say "KV errors counted by the workers (stop lines): $errs"
  ((errs == 0)) || rc=1
  if [ -s "$out/traces/spans.jsonl" ] && [ -n "$bin" ]; then
    if "$bin/kvfleet" traces analyze "$out/traces/spans.jsonl" --out "$out/traces" >"$out/traces/analysis.txt" 2>&1; then
      say "traces: $(wc -l <"$out/traces/spans.jsonl") OTLP batches; analysis in $out/traces/"
    else
      say "kvfleet traces analyze failed: $out/traces/analysis.txt"
      rc=1
    fi
  fi
  cmd_check "$out" || rc=1
  return $rc
}

cmd_check() {
  local out=${1:-}
  [ -n "$out" ] && [ -f "$out/testbed/links.tsv" ] || die "check needs a testbed results directory (with testbed/links.tsv), got '${out}'"
  local script
  script=$(mktemp)
  write_link_check "$script"
  local rc=0
  python3 "$script" "$out" "$BOUND" || rc=$?
  rm -f "$script"
  return $rc
}

cmd_status() {
  if [ -f "$STATE/state.env" ]; then
    load_state
    echo "testbed $PREFIX: $N workers, results in $OUT"
    local f
    for f in "$STATE"/pids/*; do
      local pid
      pid=$(cat "$f")
      printf '  %-14s pid %-7s %s\n' "$(basename "$f")" "$pid" "$(alive "$pid" && echo running || echo gone)"
    done
  else
    echo "no testbed with prefix $PREFIX is up"
  fi
  ip netns list | grep -E "^$PREFIX-" || true
}

cmd_experiment() {
  local rc=0
  # Clean up on any exit once `up` has started creating things (not when another testbed is up).
  trap 'trap - EXIT INT TERM; ((UP_STARTED)) && { cmd_down || true; }; exit 1' INT TERM
  trap 'rc=$?; trap - EXIT; ((UP_STARTED)) && { cmd_down || rc=1; }; exit $rc' EXIT
  cmd_up
  cmd_run || rc=1
  trap - EXIT INT TERM
  cmd_down || rc=1
  if ((rc == 0)); then
    say "PASS: every request completed exactly once, no KV error$(grep -q 'link model: PASS' "$OUT/linkcheck.txt" 2>/dev/null && echo ', link model within bound')"
  else
    say "FAIL (results and logs in $OUT)"
  fi
  return $rc
}

# ---------------------------------------------------------------------------------------------

CMD=${1:-}
[ -n "$CMD" ] || { sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2; }
[[ "$CMD" != -h && "$CMD" != --help ]] || { sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0; }
shift
UP_STARTED=0 ARG_N="" OPT_RATE="" OPT_DELAY="" OPT_LOSS="" OPT_OUT="" OPT_REQUESTS="" OPT_ARRIVALS="" OPT_SEED="" OPT_PARTITION=""
CONFIG=$ROOT/scripts/netns-testbed.conf CONFIG_GIVEN=0 BOUND=25 CHECK_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --rate) OPT_RATE=${2:?--rate needs a value}; shift 2 ;;
    --delay) OPT_DELAY=${2:?--delay needs a value}; shift 2 ;;
    --loss) OPT_LOSS=${2:?--loss needs a value}; shift 2 ;;
    --config) CONFIG=${2:?--config needs a file} CONFIG_GIVEN=1; shift 2 ;;
    --out) OPT_OUT=${2:?--out needs a directory}; shift 2 ;;
    --requests) OPT_REQUESTS=${2:?--requests needs a number}; shift 2 ;;
    --arrivals) OPT_ARRIVALS=${2:?--arrivals needs a number}; shift 2 ;;
    --seed) OPT_SEED=${2:?--seed needs a number}; shift 2 ;;
    --partition) OPT_PARTITION=${2:?--partition needs WORKER:AT_S:FOR_S}; shift 2 ;;
    --bound) BOUND=${2:?--bound needs a percentage}; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *)
      if [ "$CMD" = check ] && [ -z "$CHECK_DIR" ]; then CHECK_DIR=$1
      elif [ -z "$ARG_N" ] && [[ "$CMD" = up || "$CMD" = experiment ]]; then ARG_N=$1
      else die "unexpected argument '$1' (see --help)"; fi
      shift ;;
  esac
done
[[ "$BOUND" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--bound must be a percentage (a number), got '$BOUND'"
[[ "$NET" =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || die "KVFLEET_NETNS_NET must be the first three octets of a /24 (e.g. 10.77.0), got '$NET'"
[[ "$PREFIX" =~ ^[A-Za-z0-9][A-Za-z0-9-]{0,15}$ ]] || die "KVFLEET_NETNS_PREFIX must be 1-16 letters, digits or '-', got '$PREFIX'"
# A running testbed keeps the config it was brought up with (for run, down and status).
if ! ((CONFIG_GIVEN)) && [[ "$CMD" = run || "$CMD" = down || "$CMD" = status ]] && [ -f "$STATE/state.env" ]; then
  CONFIG=$(sed -n 's/^OUT=//p' "$STATE/state.env")/testbed/config.conf
fi
load_config "$CONFIG"
validate_workload
MODEL=${KVFLEET_MODEL:-${CONF[model]:-r1-distill-qwen-32b}}
KV_MEMORY=${KVFLEET_KV_MEMORY:-${CONF[kv_memory]:-1GiB}}
MIGRATION_TIMEOUT_MS=${CONF[migration_timeout_ms]:-30000}
positive_int "$MIGRATION_TIMEOUT_MS" "migration_timeout_ms"
MAX_STAGES=${CONF[max_stages]:-3}
[[ "$MAX_STAGES" =~ ^[0-9]+$ ]] || die "max_stages must be a non-negative integer, got '$MAX_STAGES'"
case "$CMD" in
  up)
    # A failed `up` removes what it had created.
    trap 'rc=$?; trap - EXIT; if ((rc != 0 && UP_STARTED)); then say "up failed: tearing down"; cmd_down >/dev/null 2>&1 || true; fi; exit $rc' EXIT
    trap 'exit 130' INT TERM
    cmd_up ;;
  run) cmd_run ;;
  down) cmd_down ;;
  experiment) cmd_experiment ;;
  check) cmd_check "$CHECK_DIR" ;;
  preflight) preflight ;;
  status) cmd_status ;;
  *) die "unknown command '$CMD' (up, run, down, experiment, check, preflight, status; see --help)" ;;
esac
