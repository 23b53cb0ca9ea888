#!/usr/bin/env bash
# Stage the build contexts of kvfleet's two images, both FROM scratch (no registry needed):
#
#   OUT/kvfleet/  rootfs/usr/local/bin/{kvfleet,kvfleet-coordinator,kvfleet-worker} + their shared
#                 libraries and dynamic loader (as `ldd` lists them) + docker/Dockerfile.kvfleet
#   OUT/etcd/     rootfs/usr/local/bin/etcd (Debian's etcd-server) + its libraries + docker/Dockerfile.etcd
#
# Usage: docker/stage.sh [--bin-dir DIR] [--etcd PATH] [--out DIR]
#   --bin-dir  where the kvfleet binaries are (default: $KVFLEET_BIN_DIR, else
#              ${CARGO_TARGET_DIR:-target}/debug: the binaries `cargo build --workspace` made)
#   --etcd     the etcd binary (default: `command -v etcd`; Debian: apt-get install etcd-server)
#   --out      the contexts' parent (default: $KVFLEET_DOCKER_CONTEXT, else ${CARGO_TARGET_DIR:-target}/docker)
# Debug symbols are stripped from the copies (from debug binaries the kvfleet image is ~70 MB).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
bin_dir=${KVFLEET_BIN_DIR:-$target/debug}
etcd_bin=$(command -v etcd || true)
out=${KVFLEET_DOCKER_CONTEXT:-$target/docker}
while [ $# -gt 0 ]; do
  case "$1" in
    --bin-dir) bin_dir=$2; shift 2 ;;
    --etcd) etcd_bin=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "docker/stage.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "docker/stage.sh: $*" >&2; exit 1; }

# Copy a binary and every shared object it loads (ldd's resolved paths, plus the loader) into a rootfs.
stage_binary() {
  local bin=$1 rootfs=$2 dest=$3
  [ -x "$bin" ] || die "$bin: not found or not executable"
  mkdir -p "$rootfs$(dirname "$dest")"
  if ! strip --strip-debug -o "$rootfs$dest" "$bin" 2>/dev/null; then
    cp -L "$bin" "$rootfs$dest"
  fi
  chmod 0755 "$rootfs$dest"
  local lib
  # `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)` and `/lib64/ld-linux-x86-64.so.2 (0x…)`
  for lib in $(ldd "$bin" 2>/dev/null | awk '/=> \// {print $3} /^[ \t]*\// {print $1}'); do
    [ -e "$rootfs$lib" ] || { mkdir -p "$rootfs$(dirname "$lib")"; cp -L "$lib" "$rootfs$lib"; }
  done
}

stage_context() {
  local name=$1
  local ctx=$out/$name
  rm -rf "$ctx"
  mkdir -p "$ctx/rootfs/tmp" "$ctx/rootfs/etc"
  chmod 1777 "$ctx/rootfs/tmp"
  # Name lookups (glibc): files, then DNS (Docker's embedded resolver in /etc/resolv.conf).
  echo "hosts: files dns" > "$ctx/rootfs/etc/nsswitch.conf"
  echo "root:x:0:0:root:/:/sbin/nologin" > "$ctx/rootfs/etc/passwd"
  cp "$root/docker/Dockerfile.$name" "$ctx/Dockerfile"
  echo "$ctx"
}

ctx=$(stage_context kvfleet)
for b in kvfleet kvfleet-coordinator kvfleet-worker; do
  [ -x "$bin_dir/$b" ] || die "$bin_dir/$b is missing: build first (cargo build --workspace, or pass --bin-dir)"
  stage_binary "$bin_dir/$b" "$ctx/rootfs" "/usr/local/bin/$b"
done
echo "staged $(du -sh "$ctx" | cut -f1) into $ctx (from $bin_dir)"

[ -n "$etcd_bin" ] || die "etcd is not installed (Debian/Ubuntu: apt-get install etcd-server), or pass --etcd PATH"
ctx=$(stage_context etcd)
stage_binary "$etcd_bin" "$ctx/rootfs" /usr/local/bin/etcd
echo "staged $(du -sh "$ctx" | cut -f1) into $ctx (from $etcd_bin)"
