# Shared by scripts/quickstart.sh, scripts/test.sh and .ci/run: install what the build needs,
# only when it is missing (apt needs root; sudo is used when available).
install_deps() {
  local missing=()
  command -v protoc >/dev/null 2>&1 || missing+=(protobuf-compiler)
  # etcd: the emulator's metadata store (`kvfleet up` runs without it, with an embedded store).
  command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
  # nft and iptables: the network-namespace testbed's loss and delay rules (its test runs as root).
  command -v nft >/dev/null 2>&1 || missing+=(nftables)
  command -v iptables >/dev/null 2>&1 || missing+=(iptables)
  if ((${#missing[@]})); then
    local SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    echo "installing: ${missing[*]}" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  # The OpenAI-compatible API is tested with the official `openai` Python client, the trace sink
  # with the official OpenTelemetry SDK's OTLP/gRPC exporter (all from PyPI).
  local pkgs=()
  if command -v python3 >/dev/null 2>&1; then
    python3 -c "import openai" >/dev/null 2>&1 || pkgs+=(openai)
    python3 -c "import opentelemetry.sdk, opentelemetry.exporter.otlp.proto.grpc" >/dev/null 2>&1 \
      || pkgs+=(opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc)
    # /metrics is checked with the Prometheus project's own text-format parser.
    python3 -c "import prometheus_client" >/dev/null 2>&1 || pkgs+=(prometheus_client)
  fi
  if ((${#pkgs[@]})); then
    echo "installing Python packages: ${pkgs[*]}" >&2
    python3 -m pip install --quiet "${pkgs[@]}" >/dev/null 2>&1 \
      || python3 -m pip install --quiet --break-system-packages "${pkgs[@]}" >/dev/null 2>&1 \
      || echo "warning: could not install ${pkgs[*]}; the tests that use them will be skipped" >&2
  fi
  command -v cargo >/dev/null 2>&1 || { echo "cargo not found: install Rust (https://rustup.rs)" >&2; exit 1; }
  if ! cargo nextest --version >/dev/null 2>&1; then
    echo "installing cargo-nextest" >&2
    cargo install --locked cargo-nextest >/dev/null
  fi
}
