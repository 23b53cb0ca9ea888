//! `kvfleet-worker`: one emulated GPU instance as a process.
//!
//! Prints `listening on ADDR` as its first stdout line (parents start it with `--listen
//! 127.0.0.1:0` and read the port from there); logs go to stderr (`RUST_LOG`, default `info`).
//!
//! SIGTERM / SIGINT (or the `Shutdown` RPC) stop it gracefully: it accepts no new requests, keeps
//! running for `--drain-grace-ms` (default 0) so that requests can finish, then exits with status 0.
//! Requests still running then are reported unfinished (in the log and the final stderr line); the
//! coordinator re-places them, as it does for a worker that died.

use anyhow::Context;
use clap::Parser;
use kvfleet_meta::layout::WorkerRecord;
use kvfleet_meta::{EtcdStore, MetaStore};
use kvfleet_worker::register::{cluster_record, coordinator_loop, etcd_loop};
use kvfleet_worker::{start, WorkerOptions};
use std::sync::Arc;
use std::time::Duration;

/// The worker's flags plus how it joins a cluster.
#[derive(Parser, Debug)]
#[command(name = "kvfleet-worker", version, about = "One emulated GPU serving instance")]
struct Cli {
    #[command(flatten)]
    opts: WorkerOptions,
    #[command(flatten)]
    etcd: kvfleet_meta::EtcdArgs,
    /// Embedded-store clusters: coordinator addresses (comma-separated) to register through.
    #[arg(long, value_delimiter = ',')]
    coordinator: Vec<String>,
    /// Registration lease TTL in milliseconds (etcd rounds up to whole seconds, minimum ~2 s).
    #[arg(long, default_value_t = 2000)]
    registration_ttl_ms: u64,
}
use std::io::Write;
use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    match serve(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvfleet-worker: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(cli: Cli) -> anyhow::Result<()> {
    let mut opts = cli.opts;
    // Join the cluster's store first: the model must match and the clock epoch is the cluster's.
    let store: Option<Arc<dyn MetaStore>> = if cli.etcd.etcd.is_empty() {
        None
    } else {
        let s = EtcdStore::connect_with_retry(&cli.etcd.etcd, &cli.etcd.options(), Duration::from_secs(60))
            .await
            .context("connecting to etcd")?;
        Some(Arc::new(s))
    };
    if let Some(store) = &store {
        let spec =
            kvfleet_core::spec::ModelSpec::load(&opts.model).with_context(|| format!("--model {}", opts.model))?;
        let rec = cluster_record(store.as_ref(), &spec.name, spec.kv_bytes_per_token()).await?;
        if opts.epoch_unix_ns.is_none() {
            opts.epoch_unix_ns = Some(rec.epoch_unix_ns);
        }
    }
    let listen = opts.listen;
    let handle = start(opts).await.with_context(|| format!("starting the worker (--listen {listen})"))?;
    let info = handle.info().clone();
    let ttl = Duration::from_millis(cli.registration_ttl_ms);
    if let Some(store) = store {
        let rec = WorkerRecord::from(&info);
        tokio::spawn(etcd_loop(store, rec, ttl));
    } else if !cli.coordinator.is_empty() {
        let trigger = handle.shutdown_trigger();
        let coordinators = cli.coordinator.clone();
        let tls = handle.identity().cloned();
        tokio::spawn(async move {
            if let Err(e) = coordinator_loop(coordinators, info, tls).await {
                tracing::error!("{e}; stopping");
                trigger.trigger();
            }
        });
    } else {
        tracing::warn!("neither --etcd nor --coordinator given: not registered with any cluster");
    }
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {}", handle.local_addr()).context("writing the address to stdout")?;
        if let Some(m) = handle.metrics_addr() {
            writeln!(out, "metrics on {m}").context("writing the address to stdout")?;
        }
        out.flush().context("writing the address to stdout")?;
    }
    let trigger = handle.shutdown_trigger();
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::spawn(async move {
        tokio::select! {
            _ = sigterm.recv() => tracing::info!("SIGTERM: draining"),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: draining"),
        }
        trigger.trigger();
    });
    let report = handle.wait().await.context("serving")?;
    let s = &report.driver.stats;
    eprintln!(
        "kvfleet-worker: stopped: iterations={} tokens={} lateness_p50_us={:.0} lateness_p99_us={:.0} lateness_max_us={:.0} \
         kv_tokens_written={} kv_blocks_copied={} kv_tokens_verified={} kv_errors={} events_dropped={} unfinished={:?}",
        s.engine.iterations,
        s.engine.tokens,
        s.lateness.p50_us,
        s.lateness.p99_us,
        s.lateness.max_us,
        s.kv.tokens_written,
        s.kv.blocks_copied,
        s.kv.tokens_verified,
        s.kv.errors,
        s.log.dropped,
        report.driver.unfinished.iter().map(|r| r.0).collect::<Vec<_>>(),
    );
    Ok(())
}
