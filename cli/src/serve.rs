//! `kvfleet serve`: a local cluster kept up for real clients. It starts what `kvfleet up` starts
//! (etcd when installed, a coordinator, N workers, certificates, the trace sink), puts the
//! OpenAI-compatible API on `--listen` (default `127.0.0.1:8000`), prints how to reach it, and
//! runs until Ctrl-C or SIGTERM; then it stops the workers (they drain), the coordinator, the
//! sink and etcd, in that order, leaving no process behind.
//!
//! With `--api-key KEY` (or `KVFLEET_API_KEY`), the API's `/v1/*` routes require
//! `Authorization: Bearer KEY`; the key reaches the coordinator in its environment, not its argv,
//! and the printed `curl` and `clients` lines carry it.
//!
//! One coordinator: the API is the leader's (a standby answers 503), so `serve` runs the leader
//! only. Failover experiments are `kvfleet up`'s (`--kill-leader-after-s`).

use crate::up::cluster::{self, Cluster, ClusterSpec, Started};
use crate::up::DEFAULT_CONFIG;
use crate::{say, InputError};
use clap::Args;
use kvfleet_sim::config::{resolve_policy, SimConfig};
use std::path::PathBuf;

/// `kvfleet serve`'s flags.
#[derive(Args)]
pub struct ServeArgs {
    /// Cluster config (same format as `kvfleet sim`; its workload is not used); default: the
    /// embedded small cluster (4 workers, 32B model on H100 profile timing).
    #[arg(short, long)]
    config: Option<PathBuf>,
    /// Where the OpenAI-compatible API (and the coordinator's `/metrics`) listens.
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: String,
    /// Require `Authorization: Bearer KEY` on the API's `/v1/*` routes (401 otherwise, as OpenAI
    /// answers; `/health` and `/metrics` stay open). Handed to the coordinator in its environment,
    /// not its argv. Prefer the environment variable: a flag shows in `ps`. Default: no key.
    #[arg(long, env = "KVFLEET_API_KEY", hide_env_values = true, value_name = "KEY", value_parser = api_key)]
    api_key: Option<String>,
    /// Number of worker processes (default: `cluster.instances` of the config).
    #[arg(long)]
    workers: Option<u32>,
    /// Policy preset or INTRA+INSTANCE pair (default: the config's `scheduler.policy`).
    #[arg(long)]
    policy: Option<String>,
    /// Do not use etcd even if installed (the coordinator's embedded store).
    #[arg(long)]
    no_etcd: bool,
    #[command(flatten)]
    arena: crate::up::cluster::ArenaArgs,
    /// INSECURE: the control plane in plain text (no certificates; local debugging only).
    #[arg(long)]
    plaintext: bool,
    /// Export no spans.
    #[arg(long)]
    no_traces: bool,
    /// Logs, certificates, etcd data and traces.
    #[arg(short, long, default_value = "results/serve")]
    out: PathBuf,
}

/// An API key as the coordinator accepts it: at least one visible ASCII character.
fn api_key(key: &str) -> Result<String, String> {
    if key.is_empty() {
        return Err("the API key is empty (unset it to serve without authentication)".into());
    }
    if !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("an API key must be visible ASCII characters (no spaces or control characters)".into());
    }
    Ok(key.to_string())
}

/// `s` as one POSIX shell word: unchanged when it is plain, else single-quoted.
fn shell_word(s: &str) -> String {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.,:/=+@%".contains(&b)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// Run `kvfleet serve` until Ctrl-C / SIGTERM.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let mut cfg = match &args.config {
        Some(p) => SimConfig::load(p).map_err(|e| InputError(e.to_string()))?,
        None => SimConfig::parse(DEFAULT_CONFIG, "<embedded default>").map_err(|e| InputError(e.to_string()))?,
    };
    if let Some(p) = &args.policy {
        cfg.scheduler.policy = p.clone();
    }
    if let Some(w) = args.workers {
        cfg.cluster.instances = w;
    }
    cfg.sweep = None;
    cfg.validate().map_err(|e| InputError(e.to_string()))?;
    let (intra, instance_policy) = resolve_policy(&cfg.scheduler.policy).map_err(|e| InputError(e.to_string()))?;
    let listen: std::net::SocketAddr =
        args.listen.parse().map_err(|e| InputError(format!("--listen `{}`: {e}", args.listen)))?;
    // Taken already (another serve, a vLLM): say so now, not as a coordinator that failed to start.
    std::net::TcpListener::bind(listen).map_err(|e| InputError(format!("--listen {listen}: {e}")))?;
    std::fs::create_dir_all(&args.out)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let listen_text = listen.to_string();
    let spec = ClusterSpec {
        cfg: &cfg,
        intra: &intra,
        instance_policy: &instance_policy,
        out: &args.out,
        coordinators: 1,
        no_etcd: args.no_etcd,
        plaintext: args.plaintext,
        ca_dir: None,
        otlp_endpoint: None,
        no_traces: args.no_traces,
        kv_memory: &args.arena.kv_memory,
        cpu_memory: &args.arena.cpu_memory,
        kv_fill: &args.arena.kv_fill,
        link_gbps: None,
        link_latency_us: 0.0,
        no_prefault: false,
        http_listen: Some(&listen_text),
        api_key: args.api_key.as_deref(),
        clock: kvfleet_meta::layout::ClusterTime {
            epoch_unix_ns: crate::up::replay::unix_now_ns(),
            dilation: kvfleet_core::Dilation::NONE,
        },
        own_groups: true,
    };
    let mut cluster = Cluster::default();
    let served = (|| -> anyhow::Result<()> {
        let Started { metric_pages, logs, .. } = cluster::start(&spec, &rt, &mut cluster)?;
        // Listening before "Ctrl-C to stop" is printed: a Ctrl-C right after it stops cleanly.
        let stop = {
            let _in_runtime = rt.enter();
            crate::traces::StopSignal::listen()
        };
        let model = &cfg.cluster.model;
        let base = format!("http://{listen}/v1");
        say!("");
        say!("kvfleet serve: an OpenAI-compatible endpoint at {base}");
        say!(
            "  model     {model} ({} emulated {} instances, {} policy)",
            cfg.cluster.instances,
            cfg.cluster.gpu,
            cfg.scheduler.policy
        );
        let auth_header = match &args.api_key {
            Some(key) => format!(" -H {}", shell_word(&format!("Authorization: Bearer {key}"))),
            None => String::new(),
        };
        say!(
            "  try       curl {base}/chat/completions -H 'Content-Type: application/json'{auth_header} \
             -d '{{\"model\":\"{model}\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}],\
             \"kvfleet_reasoning_tokens\":8,\"max_tokens\":24}}'"
        );
        say!(
            "  clients   OPENAI_BASE_URL={base} OPENAI_API_KEY={} (openai, aiperf, vLLM's benchmark_serving)",
            args.api_key.as_deref().map_or("unused".to_string(), shell_word)
        );
        say!(
            "  auth      {}",
            if args.api_key.is_some() {
                "/v1/* needs Authorization: Bearer <the key>; /health and /metrics are open"
            } else {
                "none: any client that reaches the port may use it (--api-key or KVFLEET_API_KEY to require a key)"
            }
        );
        let workers: Vec<&str> =
            metric_pages.iter().filter(|(n, _)| n.starts_with("worker")).map(|(_, a)| a.as_str()).collect();
        say!(
            "  metrics   http://{listen}/metrics (coordinator); workers: http://{}/metrics",
            workers.join("/metrics, http://")
        );
        say!("  logs      {}", logs.display());
        say!("Ctrl-C to stop.");
        // Until stopped, a process of the cluster that dies or is stopped from outside is said.
        let mut watch = crate::up::watch::Watch::new();
        watch.replay_starts();
        let mut stopped = Box::pin(stop.wait());
        loop {
            let tick = rt.block_on(async {
                tokio::select! {
                    () = &mut stopped => false,
                    () = tokio::time::sleep(std::time::Duration::from_secs(1)) => true,
                }
            });
            if !tick {
                break;
            }
            for line in watch.check(&mut cluster, &[]) {
                say!("unplanned: {line}");
            }
        }
        say!("stopping: workers drain, then the coordinator, the trace sink and etcd");
        Ok(())
    })();
    for line in cluster.shutdown() {
        eprintln!("stopped {line}");
    }
    served
}
