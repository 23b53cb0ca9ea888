# The RDMA transport (`kvfleet-transport`, feature `rdma`) builds against libibverbs and librdmacm
# through bindgen, which needs libclang and pkg-config. Source this file and call
# `install_rdma_deps`: it installs what is missing (apt; sudo when not root), then builds the
# crate with the feature (`install_rdma_packages` only installs). No RDMA device is needed to
# build (nor to run its emulated tests).
install_rdma_deps() {
  install_rdma_packages && cargo build -p kvfleet-transport --features rdma
}

install_rdma_packages() {
  local missing=() pkg
  for pkg in libibverbs-dev librdmacm-dev libclang-dev; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  # rdma-sys's build script asks pkg-config where the verbs headers are.
  command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
  if ((${#missing[@]})); then
    if ! command -v apt-get >/dev/null 2>&1; then
      echo "install_rdma_deps: no apt-get; install ${missing[*]} (rdma-core and libclang development files)" >&2
      return 1
    fi
    local SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    echo "installing: ${missing[*]}" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}
