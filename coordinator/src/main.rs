//! `kvfleet-coordinator`: one coordinator process. Two or more campaign for leadership through
//! etcd; only the leader schedules. Without `--etcd`, one coordinator runs with an in-process store.

use anyhow::Context;
use clap::Parser;
use kvfleet_control::roles::{PdConfig, PdPolicy};
use kvfleet_control::ArrowProfile;
use kvfleet_coordinator::leader::PdSetup;
use kvfleet_coordinator::node::ClusterModel;
use kvfleet_coordinator::node::{serve, Node, NodeOptions};
use kvfleet_core::policy::cache_aware::PlacementCosts;
use kvfleet_core::policy::pascal::TieBreak;
use kvfleet_core::policy::registry::{build_policy, PolicyParams};
use kvfleet_core::policy::PrefixIndexMode;
use kvfleet_core::spec::{GpuSpec, ModelSpec};
use kvfleet_core::timing::build_timing;
use kvfleet_meta::{MemStore, MetaStore};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(
    name = "kvfleet-coordinator",
    version,
    about = "kvfleet coordinator: registry, leader election, instance-level scheduling"
)]
struct Args {
    /// Address to listen on for the gRPC API (port 0: any free port; printed as `listening on ADDR`).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// Address workers and clients should use (default: the bound listen address).
    #[arg(long)]
    advertise: Option<String>,
    #[command(flatten)]
    etcd: kvfleet_meta::EtcdArgs,
    #[command(flatten)]
    tls: kvfleet_pki::TlsArgs,
    #[command(flatten)]
    telemetry: kvfleet_telemetry::TelemetryArgs,
    /// Instance-level policy: pascal, pascal-nonadaptive, pascal-nomigration, least-kv, round-robin, random.
    #[arg(long, default_value = "pascal")]
    policy: String,
    /// Adaptive migration headroom, KV blocks.
    #[arg(long, default_value_t = 16)]
    headroom_blocks: u32,
    /// Fidelity switch: PASCAL's "sufficient memory" counts free GPU blocks less the reasoning
    /// requests waiting for them.
    #[arg(long)]
    demand_aware_memory: bool,
    /// How Alg. 2 breaks ties on r_i: `lowest-id` (the paper names no rule) or `most-free-gpu`
    /// (an extension).
    #[arg(long, default_value = "lowest-id", value_parser = ["lowest-id", "most-free-gpu"])]
    alg2_tie_break: String,
    /// How prefix-aware policies learn where prefixes are cached: `precise` (the workers' KV
    /// events) or `approx` (from placements alone).
    #[arg(long, default_value = "precise", value_parser = ["precise", "approx"])]
    prefix_index: String,
    /// Model the cluster serves (built-in name or TOML path); workers must match it.
    #[arg(long, default_value = "r1-distill-qwen-32b")]
    model: String,
    /// Prefill/decode disaggregation, as the `[pd]` table of an experiment config in JSON, e.g.
    /// `{"prefill_instances": 2, "policy": "arrow"}`: instances numbered below
    /// `prefill_instances` prefill and hand each request off to a decode instance (default: off).
    #[arg(long, value_name = "JSON")]
    pd: Option<String>,
    /// The GPU the workers emulate (Arrow profiles its prefill and decode times with `--timing`).
    #[arg(long, default_value = "h100-80gb")]
    gpu: String,
    /// The workers' timing model, for Arrow's profile: analytic, profile or auto.
    #[arg(long, default_value = "auto")]
    timing: String,
    /// GPUs per worker instance (tensor parallelism), for the same profiles.
    #[arg(long, default_value_t = 1)]
    tensor_parallel_size: u32,
    /// GPUs per worker instance of the initial decode pool under `--pd` (those numbered from its
    /// `prefill_instances` on), where it differs from `--tensor-parallel-size`: Arrow profiles
    /// them on their own.
    #[arg(long)]
    decode_tensor_parallel_size: Option<u32>,
    /// `cache-aware` placement: the link a prefix fetch crosses, Gbit/s (the experiment's
    /// `[link]`). Its prefill curve is profiled on `--timing` as Arrow's is.
    #[arg(long, default_value_t = 100.0)]
    placement_link_gbps: f64,
    /// `cache-aware` placement: that link's one-way latency, microseconds.
    #[arg(long, default_value_t = 10.0)]
    placement_link_latency_us: f64,
    /// `cache-aware`'s θ (> 1): an instance fetches the missing prefix from the best holder when
    /// that holder caches more than θ × its blocks.
    #[arg(long, default_value_t = kvfleet_core::policy::cache_aware::DEFAULT_FETCH_THRESHOLD)]
    fetch_threshold: f64,
    /// Leadership lease TTL in milliseconds (etcd rounds up to whole seconds, minimum ~2 s).
    #[arg(long, default_value_t = 2000)]
    lease_ttl_ms: u64,
    /// Embedded mode: worker registrations expire after this many milliseconds without a refresh.
    #[arg(long, default_value_t = 3000)]
    worker_ttl_ms: u64,
    /// Cluster clock origin (Unix ns) if this coordinator founds the cluster (default: now).
    #[arg(long)]
    epoch_unix_ns: Option<u64>,
    /// Time dilation if this coordinator founds the cluster (one emulated second lasts this many
    /// real seconds; every process of the cluster runs at it); one that joins must agree.
    #[arg(long, default_value_t = kvfleet_core::Dilation::NONE)]
    time_dilation: kvfleet_core::Dilation,
    /// Seed of the policy's random choices.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also serve the OpenAI-compatible HTTP API here (port 0: any free port; printed as
    /// `http on ADDR`). Plain HTTP: bind it to loopback or put a TLS proxy in front. Default:
    /// not served.
    #[arg(long)]
    http_listen: Option<String>,
    /// Require `Authorization: Bearer KEY` on the HTTP API's `/v1/*` routes (401 otherwise, as
    /// OpenAI answers; `/health` and `/metrics` stay open). Prefer the environment variable: a
    /// flag shows in `ps`. Default: no authentication.
    #[arg(long, env = "KVFLEET_API_KEY", hide_env_values = true, value_name = "KEY")]
    api_key: Option<kvfleet_coordinator::openai::ApiKey>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let service = kvfleet_telemetry::Service {
        name: "kvfleet-coordinator",
        instance_id: format!("coordinator-{}", args.advertise.as_deref().unwrap_or(&std::process::id().to_string())),
        attributes: vec![],
    };
    let telemetry = args.telemetry.clone();
    kvfleet_telemetry::run_main(service, &telemetry, run(args), is_bad_flag).await
}

/// Errors that name a flag whose value cannot work (a malformed etcd endpoint, an unknown or
/// unreadable model or GPU).
fn is_bad_flag(e: &(dyn std::error::Error + 'static)) -> bool {
    e.is::<kvfleet_core::spec::SpecError>()
        || matches!(e.downcast_ref(), Some(kvfleet_meta::MetaError::InvalidOption { .. }))
}

async fn run(args: Args) -> anyhow::Result<()> {
    // TLS first: a coordinator without its cluster certificate (and not --plaintext) stops here.
    let tls = args.tls.load().context("the control plane's TLS")?;
    let store: Arc<dyn MetaStore> = if args.etcd.etcd.is_empty() {
        tracing::warn!(
            "no --etcd endpoint given: running with an EMBEDDED in-process store (single coordinator, no failover)"
        );
        Arc::new(MemStore::new())
    } else {
        tracing::info!(endpoints = ?args.etcd.etcd, "connecting to etcd");
        let opts = args.etcd.options();
        Arc::new(
            kvfleet_meta::EtcdStore::connect_with_retry(&args.etcd.etcd, &opts, Duration::from_secs(60))
                .await
                .context("connecting to etcd")?,
        )
    };
    let spec = ModelSpec::load(&args.model).with_context(|| format!("--model {}", args.model))?;
    let pd = pd_setup(&args, &spec)?;
    let placement_costs = placement_costs(&args, &spec)?;
    let listener =
        tokio::net::TcpListener::bind(&args.listen).await.with_context(|| format!("binding {}", args.listen))?;
    let bound = listener.local_addr()?;
    let advertise = args.advertise.clone().unwrap_or_else(|| bound.to_string());
    println!("listening on {bound}");
    let http_listener = match &args.http_listen {
        Some(addr) => {
            let l =
                tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding --http-listen {addr}"))?;
            println!("http on {}", l.local_addr()?);
            tracing::info!(api_key_required = args.api_key.is_some(), "serving the OpenAI-compatible HTTP API");
            Some(l)
        }
        None => None,
    };
    let opts = NodeOptions {
        advertise: advertise.clone(),
        policy: args.policy.clone(),
        policy_params: PolicyParams {
            headroom_blocks: args.headroom_blocks,
            demand_aware_memory: args.demand_aware_memory,
            alg2_tie_break: if args.alg2_tie_break == "most-free-gpu" {
                TieBreak::MostFreeGpu
            } else {
                TieBreak::LowestId
            },
            prefix_index: if args.prefix_index == "approx" {
                PrefixIndexMode::Approx
            } else {
                PrefixIndexMode::Precise
            },
            fetch_threshold: args.fetch_threshold,
        },
        model: ClusterModel { model: spec.name.clone(), kv_bytes_per_token: spec.kv_bytes_per_token() },
        lease_ttl: Duration::from_millis(args.lease_ttl_ms),
        worker_ttl: Duration::from_millis(args.worker_ttl_ms),
        seed: args.seed,
        epoch_unix_ns: args.epoch_unix_ns,
        time_dilation: args.time_dilation,
        tls,
        pd,
        placement_costs,
    };
    let node = Node::new(opts, store).await.context("joining the cluster")?;
    tracing::info!(%advertise, policy = %args.policy, "coordinator up; campaigning for leadership");
    tokio::spawn(node.clone().campaign_loop());
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        tokio::select! { _ = term.recv() => {}, _ = tokio::signal::ctrl_c() => {} }
        tracing::info!("shutting down");
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    if let Some(l) = http_listener {
        let (node, stop, key) = (node.clone(), stopped(stop_rx.clone()), args.api_key.clone());
        tokio::spawn(async move {
            if let Err(e) = kvfleet_coordinator::openai::serve_http(node, l, key, stop).await {
                tracing::error!("the OpenAI HTTP API stopped: {e}");
            }
        });
    }
    serve(node, listener, stopped(stop_rx)).await.context("serving")?;
    Ok(())
}

/// What `cache-aware` weighs: the prefill curve of the workers' timing model (`--gpu`,
/// `--timing`) and the `--placement-link-*`; `None` for policies that weigh no costs.
fn placement_costs(args: &Args, model: &ModelSpec) -> anyhow::Result<Option<PlacementCosts>> {
    let params = PolicyParams { fetch_threshold: args.fetch_threshold, ..PolicyParams::default() };
    params.validate().map_err(|e| anyhow::anyhow!("--fetch-threshold: {e}"))?;
    let policy = build_policy(&args.policy, &params).map_err(|e| anyhow::anyhow!("--policy: {e}"))?;
    if !policy.needs_costs() {
        return Ok(None);
    }
    for (flag, v) in [
        ("--placement-link-gbps", args.placement_link_gbps),
        ("--placement-link-latency-us", args.placement_link_latency_us),
    ] {
        if !(v.is_finite() && v > 0.0) {
            anyhow::bail!("{flag} must be a positive number, got {v}");
        }
    }
    let gpu = GpuSpec::load(&args.gpu).with_context(|| format!("--gpu {}", args.gpu))?;
    let timing =
        build_timing(estimate_kind(&args.timing), model, &gpu, None, args.tensor_parallel_size).context("--timing")?;
    // Only the prefill curve is used; the decode SLO (any positive one) shapes only MT.
    let profile = ArrowProfile::measure(timing.as_ref(), 0.1).map_err(|e| anyhow::anyhow!("prefill profile: {e}"))?;
    Ok(Some(profile.placement_costs(args.placement_link_gbps, args.placement_link_latency_us)))
}

/// The timing model the leader estimates the workers' speed with: theirs, but for live GPU
/// timing (`cuda`), which needs the workers' GPUs: `auto` stands in, and under Arrow each
/// worker's own profile replaces it as the worker registers (`kvfleet-worker
/// --arrow-slo-tpot-s`).
fn estimate_kind(timing: &str) -> &str {
    if timing == "cuda" {
        "auto"
    } else {
        timing
    }
}

/// `--pd`, checked; Arrow's profile measured on the workers' timing model (`--gpu`, `--timing`).
fn pd_setup(args: &Args, model: &ModelSpec) -> anyhow::Result<PdSetup> {
    let Some(json) = &args.pd else { return Ok(PdSetup::default()) };
    let config: PdConfig = serde_json::from_str(json).context("--pd")?;
    // How many instances there will be is not known here: only the pool of decoders being left
    // non-empty is checked as workers join.
    config.validate(u32::MAX).map_err(|e| anyhow::anyhow!("--pd: {e}"))?;
    let mut decode_profile = None;
    let arrow_profile = match config.policy {
        PdPolicy::Static => None,
        PdPolicy::Arrow => {
            let gpu = GpuSpec::load(&args.gpu).with_context(|| format!("--gpu {}", args.gpu))?;
            let measure = |tp: u32, flag: &str| -> anyhow::Result<ArrowProfile> {
                let timing = build_timing(estimate_kind(&args.timing), model, &gpu, None, tp)
                    .with_context(|| format!("{flag} {tp}"))?;
                ArrowProfile::measure(timing.as_ref(), config.arrow.slo_tpot_s)
                    .map_err(|e| anyhow::anyhow!("Arrow's profile at {flag} {tp}: {e}"))
            };
            let profile = measure(args.tensor_parallel_size, "--tensor-parallel-size")?;
            tracing::info!(?profile, "Arrow's profile of the instances");
            if let Some(tp) = args.decode_tensor_parallel_size.filter(|&t| t != args.tensor_parallel_size) {
                let decode = measure(tp, "--decode-tensor-parallel-size")?;
                tracing::info!(profile = ?decode, tp, "Arrow's profile of the decode pool");
                decode_profile = Some(decode);
            }
            Some(profile)
        }
    };
    Ok(PdSetup { config, arrow_profile, decode_profile })
}
