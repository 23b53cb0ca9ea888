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
use kvfleet_worker::options::{AUTO, AUTO_INSTANCE};
use kvfleet_worker::register::{claim_instance, cluster_record, coordinator_loop, registration_loop, route_ip};
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
    #[command(flatten)]
    telemetry: kvfleet_telemetry::TelemetryArgs,
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
    let service = kvfleet_telemetry::Service {
        name: "kvfleet-worker",
        // `--instance auto` is claimed later, in etcd: such a worker goes by its host name (its
        // spans carry the claimed number as attributes).
        instance_id: if cli.opts.instance == AUTO_INSTANCE {
            format!("worker-{}", std::fs::read_to_string("/etc/hostname").unwrap_or_default().trim())
        } else {
            format!("worker-{}", cli.opts.instance)
        },
        attributes: if cli.opts.instance == AUTO_INSTANCE {
            vec![]
        } else {
            vec![kvfleet_telemetry::KeyValue::new("kvfleet.instance", i64::from(cli.opts.instance))]
        },
    };
    let telemetry = cli.telemetry.clone();
    kvfleet_telemetry::run_main(service, &telemetry, serve(cli), is_bad_flag).await
}

/// Errors that name a flag whose value cannot work: the user's input, not the program's failure.
fn is_bad_flag(c: &(dyn std::error::Error + 'static)) -> bool {
    c.is::<kvfleet_worker::options::OptionsError>()
        || matches!(c.downcast_ref(), Some(kvfleet_worker::WorkerError::Options(_)))
        || matches!(c.downcast_ref(), Some(kvfleet_meta::MetaError::InvalidOption { .. }))
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
    resolve_auto_addresses(&mut opts, &cli.etcd.etcd, &cli.coordinator).await?;
    if let Some(store) = &store {
        let spec =
            kvfleet_core::spec::ModelSpec::load(&opts.model).with_context(|| format!("--model {}", opts.model))?;
        let rec = cluster_record(store.as_ref(), &spec.name, spec.kv_bytes_per_token()).await?;
        if opts.epoch_unix_ns.is_none() {
            opts.epoch_unix_ns = Some(rec.epoch_unix_ns);
        }
        match opts.time_dilation {
            None => opts.time_dilation = Some(rec.time_dilation),
            Some(ours) if ours != rec.time_dilation => {
                return Err(kvfleet_worker::options::OptionsError::Invalid {
                    flag: "time-dilation",
                    message: format!("{ours}, but the cluster record says {}", rec.time_dilation),
                }
                .into())
            }
            Some(_) => {}
        }
    }
    let ttl = Duration::from_millis(cli.registration_ttl_ms);
    // `--instance auto`: the lowest free number, held under the lease the registration will use.
    let claim = match (&store, opts.instance == AUTO_INSTANCE) {
        (Some(store), true) => {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            let owner = format!(
                "{} {} pid {} at {} ns",
                host.trim(),
                opts.advertise.as_deref().unwrap_or("-"),
                std::process::id(),
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
            );
            let claim = claim_instance(store.clone(), &owner, ttl).await.context("--instance auto")?;
            opts.instance = claim.instance;
            Some(claim)
        }
        (None, true) => anyhow::bail!("--instance auto needs --etcd (the number is claimed in etcd)"),
        (_, false) => None,
    };
    let listen = opts.listen;
    let handle = start(opts).await.with_context(|| format!("starting the worker (--listen {listen})"))?;
    let info = handle.info().clone();
    // SIGTERM first deregisters (the coordinator re-places this worker's requests at once), then drains.
    let (deregister_tx, deregister_rx) = tokio::sync::watch::channel(false);
    let fatal: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
    let mut registration = None;
    if let Some(store) = store {
        let rec = WorkerRecord::from(&info);
        let (trigger, fatal, expiry) = (handle.shutdown_trigger(), fatal.clone(), handle.expiry());
        // Not registered until the record is written; lapsed whenever the lease is lost.
        let (registered, follow) = tokio::sync::watch::channel(false);
        handle.follow_registration(follow);
        registration = Some(tokio::spawn(async move {
            if let Err(e) = registration_loop(store, rec, ttl, claim, deregister_rx, registered, Some(expiry)).await {
                tracing::error!("{e}; stopping");
                *fatal.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                trigger.trigger();
            }
        }));
    } else if !cli.coordinator.is_empty() {
        let trigger = handle.shutdown_trigger();
        let coordinators = cli.coordinator.clone();
        let tls = handle.identity().cloned();
        let (registered, follow) = tokio::sync::watch::channel(false);
        handle.follow_registration(follow);
        let expiry = handle.expiry();
        tokio::spawn(async move {
            if let Err(e) = coordinator_loop(coordinators, info, tls, registered, Some(expiry)).await {
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
        if let Some(registration) = registration {
            let _ = deregister_tx.send(true);
            let _ = tokio::time::timeout(Duration::from_secs(3), registration).await;
            // Let the leader see the registration go before submits are refused as draining.
            tokio::time::sleep(Duration::from_millis(200)).await;
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
    if let Some(e) = fatal.lock().unwrap_or_else(|p| p.into_inner()).take() {
        anyhow::bail!("registration: {e}");
    }
    Ok(())
}

/// `--advertise auto` / `--kv-advertise auto`: this host's IP on the route to etcd (else the first
/// coordinator), with the `--listen` / `--kv-listen` port, which must then be fixed.
async fn resolve_auto_addresses(
    opts: &mut WorkerOptions,
    etcd: &[String],
    coordinators: &[String],
) -> anyhow::Result<()> {
    let wants = |v: &Option<String>| v.as_deref().is_some_and(|a| a.eq_ignore_ascii_case(AUTO));
    if !wants(&opts.advertise) && !wants(&opts.kv_advertise) {
        return Ok(());
    }
    let targets: Vec<String> = etcd.iter().chain(coordinators).cloned().collect();
    let ip = route_ip(&targets).await.map_err(|e| anyhow::anyhow!("`auto` address: {e}"))?;
    if wants(&opts.advertise) {
        anyhow::ensure!(opts.listen.port() != 0, "--advertise auto needs a fixed --listen port (not 0)");
        opts.advertise = Some(std::net::SocketAddr::new(ip, opts.listen.port()).to_string());
    }
    if wants(&opts.kv_advertise) {
        let port = opts.kv_listen.map_or(0, |a| a.port());
        anyhow::ensure!(port != 0, "--kv-advertise auto needs --kv-listen with a fixed port (not 0)");
        opts.kv_advertise = Some(std::net::SocketAddr::new(ip, port).to_string());
    }
    tracing::info!(advertise = ?opts.advertise, kv_advertise = ?opts.kv_advertise, "resolved `auto` addresses");
    Ok(())
}
