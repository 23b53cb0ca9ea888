#!/usr/bin/env bash
# The GPU fidelity run (timing model vs live CUDA kernels), in one command on a GPU host:
#   1. profile     scripts/profile-gpu: the default model's tables + an off-grid held-out split
#   2. reproduce   our tables vs the shipped H100 profile at the same grid points (32B model only)
#   3. bench       kvfleet bench timing: profile / analytic / live-CUDA MAPE per regime on the
#                  held-out points (and the shipped profile on them)
#   4. tests       the kvfleet-cuda tests that need a GPU
#   5. replay      kvfleet up, one worker, the same short workload with --timing cuda and profile
# Everything lands in docs/results/gpu/ (RESULTS); with $OUT set (the device tool) also as
# $OUT/gpu-results.tgz plus $OUT/summary.txt. A failed step is recorded and the rest still run.
#
#   scripts/gpu-fidelity.sh --prepare        # build host (cargo, no GPU needed): release binaries
#                                            # with the `cuda` feature + GPU test binaries -> target/gpu-bin/
#   scripts/gpu-fidelity.sh [--quick] [--steps profile,reproduce,bench,tests,replay]   # GPU host
#
# Binaries: $KVFLEET_BIN (default target/gpu-bin from --prepare); else `cargo build` if cargo is
# there; else the Rust steps are skipped with a message. Python: python3 with PyTorch (CUDA).
# Env: MODEL (r1-distill-qwen-32b), GPU_SPEC (h100-80gb), RESULTS (docs/results/gpu);
# KVFLEET_FIDELITY_NO_GPU=1 skips the GPU check (to exercise this script on a host without one).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
MODEL=${MODEL:-r1-distill-qwen-32b}
GPU_SPEC=${GPU_SPEC:-h100-80gb}
RESULTS=${RESULTS:-docs/results/gpu}
BIN=${KVFLEET_BIN:-target/gpu-bin}
FEATURES="kvfleet/cuda,kvfleet-worker/cuda"
QUICK=""
STEPS="profile,reproduce,bench,tests,replay"

while [ $# -gt 0 ]; do
    case "$1" in
        --prepare) PREPARE=1 ;;
        --quick) QUICK="--quick" ;;
        --steps) shift; STEPS="${1:?--steps needs a comma-separated list}" ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "gpu-fidelity: unknown argument \`$1\` (see --help)" >&2; exit 2 ;;
    esac
    shift
done

if [ -n "${PREPARE:-}" ]; then
    command -v cargo >/dev/null || { echo "gpu-fidelity --prepare: cargo not found (install Rust, see README)" >&2; exit 2; }
    TD=${CARGO_TARGET_DIR:-target}
    set -e
    cargo build --release -p kvfleet -p kvfleet-worker -p kvfleet-coordinator --features "$FEATURES"
    exes=$(cargo test --release -p kvfleet-cuda --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        print(m["target"]["kind"][0], m["target"]["name"], m["executable"])
')
    mkdir -p target/gpu-bin
    rm -f target/gpu-bin/*
    for b in kvfleet kvfleet-worker kvfleet-coordinator; do cp "$TD/release/$b" target/gpu-bin/; done
    while read -r kind name exe; do
        [ -n "$exe" ] && cp "$exe" "target/gpu-bin/kvfleet-cuda-test-$kind-$name"
    done <<<"$exes"
    strip target/gpu-bin/* 2>/dev/null || true
    # A build sharing the target folder may have replaced a binary with one without the feature.
    for b in kvfleet kvfleet-worker; do
        grep -q 'no CUDA driver (libcuda.so)' "target/gpu-bin/$b" ||
            { echo "gpu-fidelity --prepare: target/gpu-bin/$b lacks the cuda feature (replaced by a concurrent build?); run again" >&2; exit 1; }
    done
    ls -la target/gpu-bin
    size=$(du -sm target/gpu-bin | cut -f1)
    echo "target/gpu-bin: ${size} MiB (the device tool carries at most 64 MiB with the working tree)"
    [ "$size" -lt 60 ] || echo "WARNING: over 60 MiB; carry fewer files or build on the GPU host"
    exit 0
fi

mkdir -p "$RESULTS"
exec > >(tee "$RESULTS/run.log") 2>&1
say() { echo "gpu-fidelity: $*"; }
declare -A STATUS
step() { case ",$STEPS," in *",$1,"*) return 0 ;; *) STATUS[$1]="not requested"; return 1 ;; esac; }

say "$(date -u +%FT%TZ) in $REPO; model $MODEL, GPU spec $GPU_SPEC, results $RESULTS"
{
    echo "date_utc: $(date -u +%FT%TZ)"
    echo "host: $(uname -a)"
    echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --porcelain 2>/dev/null | wc -l) changed files"
    echo "--- nvidia-smi"; { command -v nvidia-smi >/dev/null && nvidia-smi; } 2>&1 || echo "nvidia-smi not available"
    echo "--- python"; python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available() and torch.cuda.get_device_name(0))' 2>&1
    echo "--- cargo"; command -v cargo && cargo --version || echo "no cargo"
} >"$RESULTS/env.txt"
cat "$RESULTS/env.txt"

# KVFLEET_FIDELITY_NO_GPU=1 runs the steps anyway (to check this script on a host without a GPU).
if [ -z "${KVFLEET_FIDELITY_NO_GPU:-}" ] && ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    say "no CUDA GPU visible to python3's PyTorch (or no PyTorch): this run needs a GPU host; see $RESULTS/env.txt"
    exit 2
fi

# The CUDA user-space libraries live-CUDA timing dlopens: cuBLAS and NVRTC (13 or 12), wherever a
# toolkit or PyTorch's wheels put them.
sitedirs=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)
libdirs=$(find /usr/local /usr/lib /usr/lib64 /opt $sitedirs -maxdepth 9 \( -name 'libcublas.so.1[23]' -o -name 'libnvrtc.so.1[23]' \) \
    -printf '%h\n' 2>/dev/null | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:-}"
say "LD_LIBRARY_PATH for cuBLAS/NVRTC: ${libdirs:-<none found>}"

if [ ! -x "$BIN/kvfleet" ]; then
    if command -v cargo >/dev/null; then
        say "no binaries in $BIN: building with cargo (--features $FEATURES)"
        if cargo build --release -p kvfleet -p kvfleet-worker -p kvfleet-coordinator --features "$FEATURES"; then
            BIN=${CARGO_TARGET_DIR:-target}/release
        fi
    fi
fi
HAVE_BIN=""
[ -x "$BIN/kvfleet" ] && HAVE_BIN=1
[ -n "$HAVE_BIN" ] || say "no kvfleet binaries (run scripts/gpu-fidelity.sh --prepare on a build host and carry target/gpu-bin): Rust steps skipped"

PROFILE="$RESULTS/profile"
if step profile; then
    say "1. profiling $MODEL (held-out split) -> $PROFILE"
    if python3 scripts/profile-gpu --model "$MODEL" --out "$PROFILE" --holdout $QUICK 2>&1 | tee "$RESULTS/profile.log"; then
        STATUS[profile]=ok
    else
        STATUS[profile]=FAILED
    fi
fi

if step reproduce; then
    if [ "$MODEL" = r1-distill-qwen-32b ] && [ -f "$PROFILE/decode.csv" ]; then
        say "2. our tables vs the shipped H100 profile (core/profiles/h100-qwen2.5-32b)"
        python3 - "$PROFILE" core/profiles/h100-qwen2.5-32b >"$RESULTS/reproduce.txt" <<'EOF' && STATUS[reproduce]=ok || STATUS[reproduce]=FAILED
import csv, sys, statistics
ours, shipped = sys.argv[1], sys.argv[2]
def load(d, f, key):
    rows = [r for r in csv.DictReader(l for l in open(f"{d}/{f}") if not l.startswith("#"))]
    return {key(r): float(r["iter_ms"]) for r in rows}
print(f"ratio = ours / shipped at common grid points ({ours} vs {shipped})")
print(f"{'point':<24} {'ours ms':>10} {'shipped ms':>11} {'ratio':>7}")
all_err = []
for f, key, name in [("decode.csv", lambda r: (int(r["batch"]), int(r["context"])), "decode b={} ctx={}"),
                     ("prefill.csv", lambda r: (int(r["tokens"]),), "prefill {}")]:
    a, b = load(ours, f, key), load(shipped, f, key)
    errs = []
    for k in sorted(set(a) & set(b)):
        r = a[k] / b[k]
        errs.append(abs(r - 1) * 100)
        print(f"{name.format(*k):<24} {a[k]:>10.3f} {b[k]:>11.3f} {r:>7.3f}")
    if errs:
        print(f"{f}: n={len(errs)} mean |diff| {statistics.mean(errs):.2f} %, max {max(errs):.2f} %")
        all_err += errs
if all_err:
    print(f"all: n={len(all_err)} mean |diff| {statistics.mean(all_err):.2f} %, max {max(all_err):.2f} %")
EOF
        cat "$RESULTS/reproduce.txt"
    else
        STATUS[reproduce]="skipped (only for r1-distill-qwen-32b with a profile)"
    fi
fi

if step bench; then
    if [ -n "$HAVE_BIN" ] && [ -f "$PROFILE/heldout/decode.csv" ]; then
        say "3. kvfleet bench timing on the held-out points (profile, analytic, live CUDA)"
        if "$BIN/kvfleet" bench timing --model "$MODEL" --gpu "$GPU_SPEC" --profile "$PROFILE" --held-out "$PROFILE/heldout" \
            --csv "$RESULTS/fidelity-points.csv" --cuda >"$RESULTS/fidelity.txt" 2>&1; then
            STATUS[bench]=ok
        else
            say "with --cuda it failed ($(tail -1 "$RESULTS/fidelity.txt")); again without live CUDA"
            mv "$RESULTS/fidelity.txt" "$RESULTS/fidelity-cuda-error.txt"
            "$BIN/kvfleet" bench timing --model "$MODEL" --gpu "$GPU_SPEC" --profile "$PROFILE" --held-out "$PROFILE/heldout" \
                --csv "$RESULTS/fidelity-points.csv" >"$RESULTS/fidelity.txt" 2>&1 && STATUS[bench]="ok without cuda" || STATUS[bench]=FAILED
        fi
        cat "$RESULTS/fidelity.txt"
        if [ "$MODEL" = r1-distill-qwen-32b ]; then
            "$BIN/kvfleet" bench timing --held-out "$PROFILE/heldout" --csv "$RESULTS/fidelity-builtin-points.csv" \
                >"$RESULTS/fidelity-builtin.txt" 2>&1 || STATUS[bench]+=" (builtin-profile run FAILED)"
            tail -25 "$RESULTS/fidelity-builtin.txt"
        fi
    else
        STATUS[bench]="skipped (no binaries or no held-out profile)"
    fi
fi

if step tests; then
    tests=$(ls "$BIN"/kvfleet-cuda-test-* 2>/dev/null)
    if [ -n "$tests" ]; then
        say "4. kvfleet-cuda tests on the GPU"
        STATUS[tests]=ok
        for t in $tests; do
            echo "== $t" >>"$RESULTS/gpu-tests.txt"
            "$t" --nocapture --test-threads 1 >>"$RESULTS/gpu-tests.txt" 2>&1 || STATUS[tests]=FAILED
        done
        cat "$RESULTS/gpu-tests.txt"
    elif command -v cargo >/dev/null; then
        say "4. cargo test -p kvfleet-cuda on the GPU"
        cargo test --release -p kvfleet-cuda -- --nocapture --test-threads 1 >"$RESULTS/gpu-tests.txt" 2>&1 && STATUS[tests]=ok || STATUS[tests]=FAILED
        cat "$RESULTS/gpu-tests.txt"
    else
        STATUS[tests]="skipped (no test binaries, no cargo)"
    fi
fi

if step replay; then
    if [ -n "$HAVE_BIN" ] && [ -x "$BIN/kvfleet-worker" ] && [ -x "$BIN/kvfleet-coordinator" ]; then
        say "5. short replays: one worker, --timing cuda vs profile"
        STATUS[replay]=ok
        for timing in cuda auto; do
            cfg="$RESULTS/replay-$timing.toml"
            sed -e "s/^timing = .*/timing = \"$timing\"/" -e "s/^model = .*/model = \"$MODEL\"/" -e "s/^gpu = .*/gpu = \"$GPU_SPEC\"/" \
                cli/src/up/default-up.toml >"$cfg"
            timeout 300 "$BIN/kvfleet" up -c "$cfg" --workers 1 --requests 30 --rate 1 --no-etcd --no-traces -q --out "$RESULTS/replay-$timing" \
                >"$RESULTS/replay-$timing.txt" 2>&1 || STATUS[replay]="FAILED ($timing)"
            tail -30 "$RESULTS/replay-$timing.txt"
        done
        # Worker logs hold each worker's timing line and its final counters.
        grep -H -E "timing=|stopped" "$RESULTS"/replay-*/logs/worker-*.log 2>/dev/null | tail -8 >"$RESULTS/replay-worker-lines.txt" || true
    else
        STATUS[replay]="skipped (needs kvfleet, kvfleet-worker, kvfleet-coordinator binaries)"
    fi
fi

{
    echo "gpu-fidelity summary ($(date -u +%FT%TZ)), model $MODEL, GPU spec $GPU_SPEC"
    echo "GPU: $(python3 -c 'import torch; print(torch.cuda.get_device_name(0))' 2>/dev/null)"
    for s in profile reproduce bench tests replay; do printf '  %-10s %s\n' "$s" "${STATUS[$s]:-?}"; done
    echo "commands:"
    echo "  python3 scripts/profile-gpu --model $MODEL --out $PROFILE --holdout $QUICK"
    echo "  KVFLEET_CUDA_* unset (defaults); LD_LIBRARY_PATH+=${libdirs:-<none>}"
    echo "  kvfleet bench timing --model $MODEL --gpu $GPU_SPEC --profile $PROFILE --held-out $PROFILE/heldout --csv $RESULTS/fidelity-points.csv --cuda"
    echo "  kvfleet bench timing --held-out $PROFILE/heldout   # the shipped profile on our held-out points"
    echo "  kvfleet up -c $RESULTS/replay-{cuda,auto}.toml --workers 1 --requests 30 --rate 1 --no-etcd --no-traces -q"
    [ -f "$RESULTS/reproduce.txt" ] && { echo "--- reproduce (tail)"; tail -3 "$RESULTS/reproduce.txt"; }
    [ -f "$RESULTS/fidelity.txt" ] && { echo "--- fidelity (held-out table)"; sed -n '/held out of the profile/,$p' "$RESULTS/fidelity.txt"; }
} >"$RESULTS/summary.txt"
cat "$RESULTS/summary.txt"

if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
    tar czf "$OUT/gpu-results.tgz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")" --exclude='*.bin' 2>/dev/null
    cp "$RESULTS/summary.txt" "$OUT/summary.txt"
    say "results also in \$OUT/gpu-results.tgz"
fi
case "${STATUS[profile]:-}" in FAILED) exit 1 ;; esac
exit 0
