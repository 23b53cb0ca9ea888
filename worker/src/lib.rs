//! kvfleet-worker: one process = one emulated GPU serving instance.
//!
//! The `core` [`Engine`] runs in real time on this host's clock, with a real KV arena in host
//! memory, behind the `kvfleet.v1.Worker` gRPC service. No scheduling logic lives here: the engine
//! decides, the worker keeps time, moves bytes and talks to the network.
//!
//! | module | what lives there |
//! |---|---|
//! | [`arena`] | the real KV arena: GPU + CPU pools (mmap), deterministic token content, checksums, verification, tier copies |
//! | [`driver`] | the real-time engine loop on its own thread: deadline-based iterations, KV writes, events, commands; `driver/live.rs`: its half of a live migration |
//! | [`ledger`] | where every request stands on this instance (submitted, moving out, in doubt, left, reserved for an inbound migration, ...): one pure state machine the driver consults |
//! | [`migrate`] | live migration over QUIC, both roles (the async shell of the netmodel machines); `migrate/trace.rs`: its spans |
//! | [`events`] | the event log: dense sequence numbers, kept until acknowledged, replayable, bounded |
//! | [`service`] | the tonic `Worker` service: validation, commands to the driver, event streams |
//! | [`timing_select`] | `--timing`: the core's models, and `cuda` (live GPU kernels) with the `cuda` feature |
//! | [`clock`] | cluster time (ns since the cluster epoch) ↔ `Instant` |
//! | [`lateness`] | timer lateness histogram (p50/p99/max) |
//! | [`options`] | flags / configuration, instance sizing from model and GPU specs |
//! | [`register`] | joining the cluster: etcd registration under a lease, or through the coordinator |
//!
//! Start a worker in-process with [`start`] (returns a [`WorkerHandle`] with its address and info,
//! the hook for registration with a coordinator) or [`run`] (until a future resolves); the
//! `kvfleet-worker` binary is [`start`] plus signal handling.

#![warn(missing_docs)]

pub mod arena;
pub mod arrow_profile;
pub mod clock;
pub mod driver;
pub mod events;
pub mod lateness;
pub mod ledger;
pub mod metrics;
pub mod migrate;
pub mod options;
pub mod register;
pub mod service;
pub mod timing_select;

pub use driver::{DriverReport, DriverStats};
pub use options::WorkerOptions;
pub use service::ShutdownTrigger;

use driver::{Command, Driver, DriverConfig};
use kvfleet_core::engine::sched::build_scheduler;
use kvfleet_core::engine::Engine;
use kvfleet_core::timing::TimingModel;
use kvfleet_core::InstanceId;
use kvfleet_proto::v1;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;

/// How long the gRPC server may take to close its connections once the engine has stopped.
const SERVER_STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a worker could not start, or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// Invalid flags or instance sizing (model, GPU, scheduler, timing model).
    #[error(transparent)]
    Options(#[from] options::OptionsError),
    /// The cluster epoch cannot be placed on this host's clock.
    #[error(transparent)]
    Clock(#[from] clock::ClockError),
    /// The KV arena could not be mapped.
    #[error(transparent)]
    Arena(#[from] arena::ArenaError),
    /// Binding a listener (gRPC or metrics) failed.
    #[error("cannot listen on {addr}: {cause}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS error.
        cause: std::io::Error,
    },
    /// The gRPC server refused the TLS configuration.
    #[error("TLS configuration: {0}")]
    Tls(tonic::transport::Error),
    /// The QUIC live-migration endpoint could not be set up (`--kv-listen`, `--link-gbps`, parameters).
    #[error("live migration endpoint: {0}")]
    Migration(String),
    /// The cluster certificate or key could not be loaded.
    #[error("the control plane's TLS: {0}")]
    Pki(#[from] kvfleet_pki::PkiError),
    /// The gRPC server failed while serving.
    #[error("gRPC server: {0}")]
    Serve(tonic::transport::Error),
    /// The engine thread could not be spawned.
    #[error("cannot start the engine thread: {0}")]
    Thread(std::io::Error),
    /// The engine thread (or a blocking start-up task) died without a report.
    #[error("the engine thread panicked")]
    DriverPanicked,
    /// Arrow's profile of this instance could not be measured (`--arrow-slo-tpot-s`).
    #[error("{0}")]
    ArrowProfile(String),
}

/// What a stopped worker reports.
#[derive(Clone, Debug, Default)]
pub struct WorkerReport {
    /// The engine loop's final report.
    pub driver: DriverReport,
}

/// A running worker. Dropping it starts a graceful stop (so a forgotten handle leaves no
/// server behind); [`WorkerHandle::wait`] waits for the stop.
pub struct WorkerHandle {
    info: v1::WorkerInfo,
    local_addr: SocketAddr,
    shutdown: ShutdownTrigger,
    commands: Sender<Command>,
    identity: Option<kvfleet_pki::NodeIdentity>,
    metrics_addr: Option<SocketAddr>,
    done: Option<tokio::task::JoinHandle<Result<WorkerReport, WorkerError>>>,
}

impl std::fmt::Debug for WorkerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerHandle")
            .field("local_addr", &self.local_addr)
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl WorkerHandle {
    /// What the worker tells a coordinator about itself (the registration payload).
    pub fn info(&self) -> &v1::WorkerInfo {
        &self.info
    }
    /// The cluster identity this worker serves with (`None`: `--plaintext`).
    pub fn identity(&self) -> Option<&kvfleet_pki::NodeIdentity> {
        self.identity.as_ref()
    }
    /// Where Prometheus metrics are served (`--metrics-listen`).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }
    /// The address the gRPC server is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
    /// Begin a graceful stop: no new requests; stop once empty or after `--drain-grace-ms`.
    pub fn shutdown(&self) {
        self.shutdown.trigger();
    }
    /// A clonable trigger for the same stop (for signal handlers, registration watchdogs).
    pub fn shutdown_trigger(&self) -> ShutdownTrigger {
        self.shutdown.clone()
    }
    /// Follow the registration's state as [`register::registration_loop`] (etcd) or
    /// [`register::coordinator_loop`] (embedded store) publishes it: while it
    /// has lapsed, the worker refuses requests arriving by migration (see [`ledger`]). A worker
    /// that follows nothing counts as registered.
    pub fn follow_registration(&self, mut registered: tokio::sync::watch::Receiver<bool>) {
        let commands = self.commands.clone();
        let now = *registered.borrow_and_update();
        let _ = commands.send(Command::Registration { registered: now });
        tokio::spawn(async move {
            while registered.changed().await.is_ok() {
                let now = *registered.borrow_and_update();
                if commands.send(Command::Registration { registered: now }).is_err() {
                    return; // the engine stopped
                }
            }
        });
    }
    /// What the registration loop calls when etcd (or the embedded store's coordinator) says the
    /// registration expired.
    pub fn expiry(&self) -> Expiry {
        Expiry { commands: self.commands.clone() }
    }
    /// Timer lateness, engine, arena and log counters (None once the engine has stopped).
    pub async fn stats(&self) -> Option<DriverStats> {
        let (tx, rx) = oneshot::channel();
        self.commands.send(Command::Stats { reply: tx }).ok()?;
        rx.await.ok()
    }
    /// Wait until the worker has stopped (after a shutdown from any source) and the server closed.
    pub async fn wait(mut self) -> Result<WorkerReport, WorkerError> {
        match self.done.take() {
            Some(done) => done.await.map_err(|_| WorkerError::DriverPanicked)?,
            None => Err(WorkerError::DriverPanicked),
        }
    }
}

/// A way to tell the engine its registration expired in etcd: the coordinator has evicted this
/// worker and re-places what it held, so the requests running here are dropped before the
/// worker registers again (after that, a request re-placed here must not be the one dropped).
#[derive(Clone, Debug)]
pub struct Expiry {
    commands: Sender<Command>,
}

impl Expiry {
    /// Drop every request running here; returns how many (0 once the engine has stopped).
    pub async fn drop_running(&self) -> usize {
        let (tx, rx) = oneshot::channel();
        if self.commands.send(Command::Expired { reply: tx }).is_err() {
            return 0;
        }
        rx.await.unwrap_or(0)
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        if self.done.is_some() {
            self.shutdown.trigger();
        }
    }
}

/// Arrow's profile of this instance on `timing` for SLO_TPOT `slo` (cached, [`arrow_profile`]),
/// measured off the async threads (live GPU timing runs kernels).
async fn measure_arrow_profile(
    opts: &WorkerOptions,
    shape: &options::InstanceShape,
    timing: Arc<dyn TimingModel>,
    slo: f64,
) -> Result<v1::ArrowProfile, WorkerError> {
    let mut timing_key = opts.timing.clone();
    if let Some(dir) = &opts.profile_dir {
        timing_key = format!("{timing_key}:{}", dir.display());
    }
    let key = arrow_profile::ProfileKey {
        model: shape.model.name.clone(),
        gpu: shape.gpu.name.clone(),
        tensor_parallel_size: opts.tensor_parallel_size,
        timing: timing_key,
        slo_tpot_s: slo,
    };
    let cache = opts.profile_cache.clone().or_else(arrow_profile::default_cache_dir);
    let (p, source) =
        tokio::task::spawn_blocking(move || arrow_profile::profile(timing.as_ref(), &key, cache.as_deref()))
            .await
            .map_err(|_| WorkerError::DriverPanicked)?
            .map_err(WorkerError::ArrowProfile)?;
    tracing::info!(
        prefill_a = p.prefill.a,
        prefill_b = p.prefill.b,
        prefill_c = p.prefill.c,
        decode_max_tokens = p.decode_max_tokens,
        slo_tpot_s = slo,
        source = ?source,
        "Arrow profile of this instance"
    );
    Ok(v1::ArrowProfile {
        prefill_a: p.prefill.a,
        prefill_b: p.prefill.b,
        prefill_c: p.prefill.c,
        decode_max_tokens: p.decode_max_tokens,
        slo_tpot_s: slo,
    })
}

/// Build the instance, bind the listener, start the engine thread and the gRPC server.
pub async fn start(opts: WorkerOptions) -> Result<WorkerHandle, WorkerError> {
    // TLS first: without a cluster certificate (and not --plaintext) the worker does not start.
    let identity = opts.tls.load()?;
    let shape = opts.shape()?;
    let timing: Arc<dyn TimingModel> = Arc::from(timing_select::build(
        &opts.timing,
        &shape.model,
        &shape.gpu,
        opts.profile_dir.as_deref(),
        opts.tensor_parallel_size,
    )?);
    let sched = build_scheduler(&opts.scheduler, &shape.scheduler).map_err(options::OptionsError::Scheduler)?;
    let clock = clock::ClusterClock::new(opts.epoch_unix_ns, opts.time_dilation.unwrap_or_default())?;
    let (layout, fill, prefault) = (shape.layout, opts.kv_fill, opts.prefault);
    // Pre-faulting gigabytes takes a while: keep it off the async threads.
    let arena = tokio::task::spawn_blocking(move || arena::KvArena::new(layout, fill, prefault))
        .await
        .map_err(|_| WorkerError::DriverPanicked)??;
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|cause| WorkerError::Bind { addr: opts.listen, cause })?;
    let local_addr = listener.local_addr().map_err(|cause| WorkerError::Bind { addr: opts.listen, cause })?;
    let mut info = v1::WorkerInfo {
        instance: opts.instance,
        model: shape.model.name.clone(),
        kv_bytes_per_token: shape.engine.kv_bytes_per_token,
        block_size: shape.engine.block_size,
        gpu_blocks: shape.engine.gpu_blocks,
        cpu_blocks: shape.engine.cpu_blocks,
        scheduler: opts.scheduler.clone(),
        timing: timing.name().to_string(),
        advertise: opts.advertise.clone().unwrap_or_else(|| local_addr.to_string()),
        kv_arena_bytes: arena.mapped_bytes(),
        kv_address: String::new(),
        // Tells this process from an earlier one under the same `--instance` that re-registers
        // before the old registration lapses (the coordinator then re-places what the old held).
        incarnation: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            .max(1),
        arrow_profile: match opts.arrow_slo_tpot_s {
            Some(slo) => Some(measure_arrow_profile(&opts, &shape, timing.clone(), slo).await?),
            None => None,
        },
        renews_lease: 0,
    };
    tracing::info!(
        instance = info.instance,
        model = %info.model,
        gpu_blocks = info.gpu_blocks,
        cpu_blocks = info.cpu_blocks,
        kv_arena_bytes = info.kv_arena_bytes,
        scheduler = %info.scheduler,
        timing = %info.timing,
        tensor_parallel_size = opts.tensor_parallel_size,
        handoff_layer_groups = opts.handoff_layer_groups,
        epoch_unix_ns = clock.epoch_unix_ns(),
        time_dilation = %clock.dilation(),
        "worker ready on {local_addr}"
    );

    let log = Arc::new(events::EventLog::new(opts.event_log_cap));
    let block_geometry = (shape.engine.block_size, shape.engine.block_bytes());
    let engine = Engine::new(InstanceId(opts.instance), shape.engine, timing, sched);
    let driver = Driver::new(DriverConfig {
        engine,
        arena,
        clock,
        log: log.clone(),
        load_interval: Duration::from_millis(opts.load_interval_ms),
        verify_kv: opts.verify_kv,
        announce_every: crate::driver::ANNOUNCE_HELD_EVERY,
        submit_grace: crate::driver::SUBMIT_GRACE,
        layer_groups: opts.handoff_layer_groups,
    });
    let (commands, rx) = std::sync::mpsc::channel();
    let (report_tx, report_rx) = oneshot::channel();
    std::thread::Builder::new()
        .name(format!("kvfleet-engine-{}", opts.instance))
        .spawn(move || {
            let _ = report_tx.send(driver.run(rx));
        })
        .map_err(WorkerError::Thread)?;

    let shutdown = ShutdownTrigger::new(commands.clone(), Duration::from_millis(opts.drain_grace_ms));
    let migrator = match &identity {
        Some(id) => {
            let m = start_migrator(&opts, id, block_geometry, local_addr, commands.clone(), clock)?;
            info.kv_address = match (&opts.kv_advertise, &opts.advertise) {
                (Some(a), _) => a.clone(),
                (None, Some(adv)) => {
                    let host = adv.rsplit_once(':').map_or(adv.as_str(), |(h, _)| h);
                    format!("{host}:{}", m.local_addr().port())
                }
                (None, None) => m.local_addr().to_string(),
            };
            tokio::spawn(m.clone().serve());
            tracing::info!(kv_address = %info.kv_address, "live migration over QUIC (mutual TLS)");
            Some(m)
        }
        None => {
            tracing::warn!("--plaintext: no live-migration endpoint (QUIC needs the cluster certificate)");
            None
        }
    };
    let metrics_addr = match opts.metrics_listen {
        Some(addr) => Some(serve_metrics(addr, info.model.clone(), commands.clone(), migrator.clone()).await?),
        None => None,
    };
    let svc = service::WorkerService::new(info.clone(), commands.clone(), log, shutdown.clone(), migrator.clone());
    let mut server = tonic::transport::Server::builder();
    if let Some(id) = &identity {
        server = server.tls_config(id.tonic_server()).map_err(WorkerError::Tls)?;
    }
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let (stop_server, server_stopped) = oneshot::channel::<()>();
    let serve = server.add_service(v1::worker_server::WorkerServer::new(svc)).serve_with_incoming_shutdown(
        incoming,
        async move {
            let _ = server_stopped.await;
        },
    );
    let mut server_task = tokio::spawn(serve);
    let trigger = shutdown.clone();
    let done = tokio::spawn(async move {
        // The engine stops first (its log closes, so event streams end), then the server.
        let report = tokio::select! {
            r = report_rx => r.map_err(|_| WorkerError::DriverPanicked),
            served = &mut server_task => {
                // The server died on its own: stop the engine too.
                trigger.trigger();
                return match served {
                    Ok(Err(e)) => Err(WorkerError::Serve(e)),
                    _ => Err(WorkerError::DriverPanicked),
                };
            }
        };
        let _ = stop_server.send(());
        if let Some(m) = &migrator {
            m.close();
        }
        match tokio::time::timeout(SERVER_STOP_TIMEOUT, &mut server_task).await {
            Ok(Ok(Err(e))) => return Err(WorkerError::Serve(e)),
            Ok(_) => {}
            Err(_) => {
                tracing::warn!(
                    "gRPC connections still open {SERVER_STOP_TIMEOUT:?} after the engine stopped; closing them"
                );
                server_task.abort();
            }
        }
        Ok(WorkerReport { driver: report? })
    });
    Ok(WorkerHandle { info, local_addr, metrics_addr, shutdown, commands, identity, done: Some(done) })
}

/// `GET /metrics` on `addr` (axum, [`metrics::router`]): each scrape asks the engine thread for
/// its counters and load.
async fn serve_metrics(
    addr: SocketAddr,
    model: String,
    commands: std::sync::mpsc::Sender<driver::Command>,
    migrator: Option<Arc<migrate::Migrator>>,
) -> Result<SocketAddr, WorkerError> {
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|cause| WorkerError::Bind { addr, cause })?;
    let bound = listener.local_addr().map_err(|cause| WorkerError::Bind { addr, cause })?;
    let scrape = move || {
        let (commands, model, migrator) = (commands.clone(), model.clone(), migrator.clone());
        async move {
            let (stats_tx, stats_rx) = oneshot::channel();
            let (load_tx, load_rx) = oneshot::channel();
            commands.send(driver::Command::Stats { reply: stats_tx }).ok()?;
            commands.send(driver::Command::Load { reply: load_tx }).ok()?;
            let (stats, load) = (stats_rx.await.ok()?, load_rx.await.ok()?);
            let mig = migrator.map(|m| m.metrics()).unwrap_or_default();
            Some(metrics::render(&model, &stats, &load, &mig))
        }
    };
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, metrics::router(scrape)).await {
            tracing::warn!("the metrics server on {bound} stopped: {e}");
        }
    });
    tracing::info!("Prometheus metrics on http://{bound}/metrics");
    Ok(bound)
}

/// The QUIC endpoint for live migrations (shaped when `--link-gbps`/`--link-latency-us` ask).
fn start_migrator(
    opts: &WorkerOptions,
    identity: &kvfleet_pki::NodeIdentity,
    (block_size, block_bytes): (u32, u64),
    local_addr: SocketAddr,
    commands: std::sync::mpsc::Sender<driver::Command>,
    clock: clock::ClusterClock,
) -> Result<Arc<migrate::Migrator>, WorkerError> {
    use kvfleet_transport::{KvTransport, QuicTransport, QuicTuning, Shaped};
    let listen = opts.kv_listen.unwrap_or_else(|| SocketAddr::new(local_addr.ip(), 0));
    let quic = QuicTransport::bind(listen, identity, QuicTuning::default())
        .map_err(|e| WorkerError::Migration(format!("--kv-listen {listen}: {e}")))?;
    let transport: Arc<dyn KvTransport> = if opts.link_gbps.is_some() || opts.link_latency_us > 0.0 {
        // The shaper runs in real time: a dilated cluster's link moves rate ÷ K bytes per real
        // second, with K × the latency, which is the configured rate and latency in emulated time.
        let k = clock.dilation();
        let mut p = kvfleet_netmodel::shaping::ShapeParams::fabric_gbps(
            k.real_rate(opts.link_gbps.unwrap_or(f64::INFINITY)),
            kvfleet_core::TimeSpan(k.real_ns(kvfleet_core::TimeSpan::from_secs_f64(opts.link_latency_us * 1e-6).0)),
        );
        if opts.link_gbps.is_none() {
            p.rate_bytes_per_s = None;
        }
        Arc::new(Shaped::new(quic, p).map_err(|e| WorkerError::Migration(format!("--link-gbps: {e}")))?)
    } else {
        Arc::new(quic)
    };
    let params = opts.migration_params(block_size, block_bytes).map_err(|e| WorkerError::Migration(e.to_string()))?;
    let link = migrate::trace::LinkShape { gbps: opts.link_gbps.unwrap_or(0.0), latency_us: opts.link_latency_us };
    let cfg = migrate::MigrateConfig {
        params,
        streams: opts.migration_streams,
        link,
        corrupt_sent_blocks: opts.corrupt_sent_blocks,
    };
    Ok(migrate::Migrator::new(transport, commands, clock, cfg, opts.instance))
}

/// Run a worker until `shutdown` resolves (then stop gracefully) or it stops by itself (the
/// `Shutdown` RPC). For the bound address, use [`start`] instead.
pub async fn run(opts: WorkerOptions, shutdown: impl Future<Output = ()>) -> Result<WorkerReport, WorkerError> {
    let handle = start(opts).await?;
    let trigger = handle.shutdown_trigger();
    let wait = handle.wait();
    tokio::pin!(wait, shutdown);
    tokio::select! {
        r = &mut wait => return r,
        _ = &mut shutdown => trigger.trigger(),
    }
    wait.await
}
