//! RDMA transport (feature `rdma`): KV migration streams over InfiniBand or RoCE reliable-connected
//! queue pairs, through libibverbs and librdmacm (`rdma-sys`).
//!
//! The migration protocol is unchanged: it is the same sans-IO state machine
//! (`kvfleet_netmodel::migration`) and the same length-prefixed frames ([`crate::frame`]) as over
//! QUIC; only the byte mover differs. [`RdmaTransport`] implements [`KvTransport`] and its
//! connections [`KvConnection`], so a worker can hold an `Arc<dyn KvTransport>` of either kind.
//!
//! | piece | where |
//! |---|---|
//! | connection setup: rdma_cm address and route resolution, connect/accept, RC queue pair; the handshake (each side's receive ring address, rkey, size) in the private data | `rdma/verbs.rs` (all the unsafe code) |
//! | streams multiplexed as records written by RDMA WRITE WITH IMMEDIATE into the peer's registered ring; credits, per-stream flow control | `rdma/engine.rs` (no verbs, no threads) |
//! | record, immediate and handshake encodings | `rdma/wire.rs` |
//! | an emulated fabric (memcpy instead of a NIC) for hosts without RDMA devices | [`EmulatedFabric`] |
//!
//! # Addresses and control plane
//!
//! Peers are named by the same `SocketAddr` as QUIC's: the IP address of the RDMA interface (the
//! IPoIB interface on InfiniBand, the Ethernet interface on RoCE) and a port in rdma_cm's TCP port
//! space. The worker advertises that address through the coordinator exactly as it advertises
//! its QUIC address. rdma_cm derives the device, port and GID from the IP address: bind the
//! listener to the address of the NIC you want ([`RdmaConfig::device`] checks it, or picks that
//! device's address for a wildcard bind); outbound connections leave from the listener's address.
//!
//! # Data path
//!
//! Each connection registers a receive ring (`ring_bytes`, REMOTE_WRITE) and a staging region
//! mirroring the peer's ring. A stream write is copied into staging and written with one RDMA
//! WRITE WITH IMMEDIATE into the peer's ring; the immediate wakes the peer's completion thread,
//! which copies the data to the stream's queue and frees the ring space (credits flow back as
//! zero-length writes with immediate). So a byte is copied once on each side, as with QUIC, and
//! the NIC does the transfer without the peer's CPU. Zero-copy from the worker's KV arena (the
//! arena registered as one MR and blocks written straight into the target's reserved blocks)
//! needs block addresses in the protocol, which byte streams do not carry; it is the next step,
//! not done here.
//!
//! Every work request is signaled; blocking verbs calls run off the async runtime: connection
//! setup on `spawn_blocking`, completions and rdma_cm events on one thread per connection and one
//! per listener, waiting in `poll(2)`. There is no encryption or authentication on this path
//! (QUIC has mutual TLS): use it on a trusted fabric only.
//!
//! # What was run where
//!
//! No host this was developed on has an RDMA device or a kernel with Soft-RoCE, so the verbs
//! path (`rdma/verbs.rs`) is compiled and clippy-clean but has not been run. Everything else, the
//! engine and the [`KvTransport`] behaviour, runs in the tests over [`EmulatedFabric`];
//! `tests/rdma.rs` runs the same checks over real verbs when `ibv_get_device_list` finds a device
//! and says it skipped them otherwise.

mod emulated;
mod engine;
mod verbs;
mod wire;

pub use emulated::EmulatedFabric;
pub use engine::RdmaStats;

use crate::{BoxFuture, ConnectionPool, KvConnection, KvStream, KvTransport, TransportError};
use engine::Engine;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, watch};

/// How many established inbound connections may wait for `accept`.
const ACCEPT_BACKLOG: usize = 64;
/// The smallest ring accepted (a record is at most a quarter of it).
const MIN_RING_BYTES: usize = 4096;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// RDMA knobs; [`Default`] suits 100–400 Gbit/s InfiniBand or RoCE.
#[derive(Clone, Debug, PartialEq)]
pub struct RdmaConfig {
    /// The RDMA device to use (`mlx5_0`, as `ibv_devices` lists them): binding fails unless the
    /// listen address is on it; with a wildcard listen address, that device's first address is
    /// used. `None`: whichever device owns the listen address.
    pub device: Option<String>,
    /// Each connection's receive ring (the peer writes records into it): 16 MiB.
    pub ring_bytes: usize,
    /// The most stream bytes one RDMA WRITE carries: 1 MiB (capped at a quarter of the peer's
    /// ring).
    pub max_write_bytes: usize,
    /// Per-stream flow-control window: 64 MiB, QUIC's stream window (one stalled reader holds at
    /// most this much of the receiver's memory).
    pub stream_window_bytes: u64,
    /// Send queue depth in work requests (the receive queue is twice as deep): 128.
    pub send_queue_depth: u32,
    /// Address and route resolution plus the connection handshake, each side: 5 s.
    pub connect_timeout: Duration,
    /// An idle connection posts a zero-length write this often; a dead peer makes it fail after
    /// the NIC's retries, which closes the connection: 1 s.
    pub keepalive_interval: Duration,
    /// IP type of service for RoCE (`DSCP << 2`; selects the traffic class that PFC keeps
    /// lossless) or the IB traffic class: `None` keeps the device's default.
    pub tos: Option<u8>,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            device: None,
            ring_bytes: 16 << 20,
            max_write_bytes: 1 << 20,
            stream_window_bytes: 64 << 20,
            send_queue_depth: 128,
            connect_timeout: Duration::from_secs(5),
            keepalive_interval: Duration::from_secs(1),
            tos: None,
        }
    }
}

impl RdmaConfig {
    /// Check the knobs, naming the bad one.
    pub fn validate(&self) -> Result<(), TransportError> {
        let bad = |what: String| Err(TransportError::Config(format!("RDMA configuration: {what}")));
        if !(MIN_RING_BYTES..=wire::MAX_RING_BYTES).contains(&self.ring_bytes) || !self.ring_bytes.is_multiple_of(64) {
            return bad(format!(
                "ring_bytes = {} must be a multiple of 64 between {MIN_RING_BYTES} and {}",
                self.ring_bytes,
                wire::MAX_RING_BYTES
            ));
        }
        if self.max_write_bytes < 64 {
            return bad(format!("max_write_bytes = {} must be at least 64", self.max_write_bytes));
        }
        if self.stream_window_bytes < 4096 {
            return bad(format!("stream_window_bytes = {} must be at least 4096", self.stream_window_bytes));
        }
        if !(4..=1 << 15).contains(&self.send_queue_depth) {
            return bad(format!("send_queue_depth = {} must be between 4 and 32768", self.send_queue_depth));
        }
        if self.connect_timeout.is_zero() || self.keepalive_interval.is_zero() {
            return bad("connect_timeout and keepalive_interval must be positive".into());
        }
        if self.device.as_deref().is_some_and(str::is_empty) {
            return bad("device is empty (leave it unset to use the listen address's device)".into());
        }
        Ok(())
    }
}

/// An RDMA device and the network interfaces (with their addresses) it serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaDevice {
    /// The verbs name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// Its network interfaces (`ib0`, `ens1f0np0`), from sysfs.
    pub netdevs: Vec<String>,
    /// Their IP addresses: what to listen on and advertise.
    pub addrs: Vec<IpAddr>,
}

/// The error for a host without RDMA devices.
fn no_device(detail: &str) -> TransportError {
    TransportError::Config(format!("no RDMA device found ({detail}); use --transport quic"))
}

/// The RDMA devices of this host, with their interfaces and addresses; an error naming the
/// problem when there are none.
pub fn rdma_devices() -> Result<Vec<RdmaDevice>, TransportError> {
    let names = verbs::device_names().map_err(|e| no_device(&e))?;
    if names.is_empty() {
        return Err(no_device("ibv_get_device_list returned 0 devices"));
    }
    let ifaddrs = verbs::interface_addrs().unwrap_or_default();
    Ok(names
        .into_iter()
        .map(|name| {
            let netdevs = device_netdevs(&name);
            let addrs = ifaddrs.iter().filter(|(n, _)| netdevs.contains(n)).map(|(_, a)| *a).collect();
            RdmaDevice { name, netdevs, addrs }
        })
        .collect())
}

/// The network interfaces of RDMA device `name`: the PCI function's (`device/net/*`, IPoIB and
/// RoCE) and the RoCE GID table's (`ports/*/gid_attrs/ndevs/*`, also for rxe over any netdev).
fn device_netdevs(name: &str) -> Vec<String> {
    let base = std::path::Path::new("/sys/class/infiniband").join(name);
    let entries = |p: std::path::PathBuf| std::fs::read_dir(p).into_iter().flatten().flatten();
    let mut out: Vec<String> =
        entries(base.join("device/net")).map(|e| e.file_name().to_string_lossy().into()).collect();
    for port in entries(base.join("ports")) {
        for ndev in entries(port.path().join("gid_attrs/ndevs")) {
            if let Ok(s) = std::fs::read_to_string(ndev.path()) {
                let s = s.trim();
                if !s.is_empty() {
                    out.push(s.to_string());
                }
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// One connection's state, shared by its handles, its streams and its I/O thread.
pub(crate) struct Shared {
    pub(crate) engine: Mutex<Engine>,
    pub(crate) peer: SocketAddr,
}

impl Shared {
    pub(crate) fn new(engine: Engine, peer: SocketAddr) -> Shared {
        Shared { engine: Mutex::new(engine), peer }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Engine> {
        lock(&self.engine)
    }
}

enum Backend {
    Verbs(Mutex<Option<verbs::Listener>>),
    Emulated(EmulatedFabric),
}

/// An RDMA endpoint that listens and connects (see the module docs).
pub struct RdmaTransport {
    local: SocketAddr,
    config: RdmaConfig,
    backend: Backend,
    pool: ConnectionPool<RdmaConnection>,
    incoming: tokio::sync::Mutex<mpsc::Receiver<Arc<RdmaConnection>>>,
    closed: watch::Sender<bool>,
}

impl std::fmt::Debug for RdmaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.backend {
            Backend::Verbs(_) => "verbs",
            Backend::Emulated(_) => "emulated",
        };
        f.debug_struct("RdmaTransport").field("local", &self.local).field("fabric", &kind).finish_non_exhaustive()
    }
}

impl RdmaTransport {
    /// Listen on `listen` (the IP of an RDMA interface; port 0 picks one) over the real fabric.
    /// Needs a tokio runtime. Fails, naming the cause, on a host without RDMA devices.
    pub fn bind(listen: SocketAddr, config: RdmaConfig) -> Result<RdmaTransport, TransportError> {
        config.validate()?;
        let devices = rdma_devices()?;
        let mut listen = listen;
        if let Some(want) = &config.device {
            let Some(dev) = devices.iter().find(|d| &d.name == want) else {
                let have: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
                return Err(TransportError::Config(format!(
                    "RDMA device {want} not found; this host has {}",
                    have.join(", ")
                )));
            };
            if listen.ip().is_unspecified() {
                let ip = dev.addrs.iter().find(|a| a.is_ipv4()).or(dev.addrs.first()).ok_or_else(|| {
                    TransportError::Config(format!(
                        "RDMA device {want} has no IP address on its interfaces ({}): configure IPoIB or the RoCE \
                         interface, or listen on an explicit address",
                        dev.netdevs.join(", ")
                    ))
                })?;
                listen = SocketAddr::new(*ip, listen.port());
            }
        }
        let (tx, rx) = mpsc::channel(ACCEPT_BACKLOG);
        let listener = verbs::Listener::bind(listen, &config, tx)
            .map_err(|reason| TransportError::Bind { addr: listen, reason })?;
        let local = listener.local_addr();
        tracing::info!(%local, device = listener.device().unwrap_or("any"), "RDMA transport bound");
        Ok(Self::with_backend(local, config, Backend::Verbs(Mutex::new(Some(listener))), rx))
    }

    /// An endpoint on an [`EmulatedFabric`] (no RDMA device needed): the same engine and
    /// streams, with the NIC emulated. For tests.
    pub fn emulated(
        fabric: &EmulatedFabric,
        listen: SocketAddr,
        config: RdmaConfig,
    ) -> Result<RdmaTransport, TransportError> {
        config.validate()?;
        let (tx, rx) = mpsc::channel(ACCEPT_BACKLOG);
        let local = fabric.register(listen, &config, tx)?;
        Ok(Self::with_backend(local, config, Backend::Emulated(fabric.clone()), rx))
    }

    fn with_backend(
        local: SocketAddr,
        config: RdmaConfig,
        backend: Backend,
        rx: mpsc::Receiver<Arc<RdmaConnection>>,
    ) -> RdmaTransport {
        RdmaTransport {
            local,
            config,
            backend,
            pool: ConnectionPool::default(),
            incoming: tokio::sync::Mutex::new(rx),
            closed: watch::Sender::new(false),
        }
    }

    /// Like [`KvTransport::connect`], returning the concrete connection.
    pub async fn connect_rdma(&self, peer: SocketAddr) -> Result<Arc<RdmaConnection>, TransportError> {
        if *self.closed.borrow() {
            return Err(TransportError::EndpointClosed { local: self.local });
        }
        self.pool
            .get_or_connect(
                peer,
                |c| !c.is_closed(),
                || async move {
                    match &self.backend {
                        Backend::Emulated(fabric) => fabric.connect(self.local, peer, &self.config),
                        Backend::Verbs(_) => {
                            let config = self.config.clone();
                            let local_ip = self.local.ip();
                            // A dropped future leaves the task to finish; its connection is then
                            // dropped, which closes it.
                            tokio::task::spawn_blocking(move || {
                                verbs::connect(peer, Some(local_ip), &config).map(RdmaConnection::new)
                            })
                            .await
                            .map_err(|e| TransportError::Connect { peer, reason: format!("connect task: {e}") })?
                            .map_err(|reason| TransportError::Connect { peer, reason })
                        }
                    }
                },
            )
            .await
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &RdmaConfig {
        &self.config
    }
}

impl KvTransport for RdmaTransport {
    fn connect(&self, peer: SocketAddr) -> BoxFuture<'_, Result<Arc<dyn KvConnection>, TransportError>> {
        Box::pin(async move { Ok(self.connect_rdma(peer).await? as Arc<dyn KvConnection>) })
    }

    fn accept(&self) -> BoxFuture<'_, Result<Arc<dyn KvConnection>, TransportError>> {
        Box::pin(async move {
            let mut closed = self.closed.subscribe();
            let mut incoming = self.incoming.lock().await;
            tokio::select! {
                biased;
                _ = closed.wait_for(|c| *c) => Err(TransportError::EndpointClosed { local: self.local }),
                c = incoming.recv() => match c {
                    Some(c) => Ok(c as Arc<dyn KvConnection>),
                    None => Err(TransportError::EndpointClosed { local: self.local }),
                },
            }
        })
    }

    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn close(&self) {
        self.closed.send_replace(true);
        for c in self.pool.drain() {
            c.close("transport closed");
        }
        match &self.backend {
            Backend::Verbs(listener) => drop(lock(listener).take()),
            Backend::Emulated(fabric) => fabric.unregister(self.local),
        }
    }
}

impl Drop for RdmaTransport {
    /// Stop accepting; established connections live on until they are dropped or closed.
    fn drop(&mut self) {
        if let Backend::Emulated(fabric) = &self.backend {
            fabric.unregister(self.local);
        }
    }
}

/// Closes the connection when the last handle (connection or stream) goes away.
struct ConnInner {
    shared: Arc<Shared>,
}

impl Drop for ConnInner {
    fn drop(&mut self) {
        self.shared.lock().close_local("connection dropped");
    }
}

/// One RDMA connection (a reliable-connected queue pair) carrying any number of streams.
pub struct RdmaConnection {
    inner: Arc<ConnInner>,
}

impl std::fmt::Debug for RdmaConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaConnection").field("peer", &self.peer()).field("closed", &self.is_closed()).finish()
    }
}

impl RdmaConnection {
    pub(crate) fn new(shared: Arc<Shared>) -> Arc<RdmaConnection> {
        Arc::new(RdmaConnection { inner: Arc::new(ConnInner { shared }) })
    }

    fn shared(&self) -> &Shared {
        &self.inner.shared
    }

    /// Counters: records, bytes, ring wraps, credits.
    pub fn stats(&self) -> RdmaStats {
        self.shared().lock().stats()
    }

    /// Why the connection closed (`None` while open).
    pub fn close_reason(&self) -> Option<String> {
        self.shared().lock().close_reason().map(str::to_string)
    }

    /// Streams the connection still tracks (both halves of a finished stream dropped: forgotten).
    pub fn open_streams(&self) -> usize {
        self.shared().lock().open_streams()
    }

    fn stream_err(&self, what: &'static str) -> impl Fn(String) -> TransportError + '_ {
        move |reason| TransportError::Stream { peer: self.peer(), what, reason }
    }

    fn halves(&self, id: u32) -> KvStream {
        let w = RdmaWriter { conn: self.inner.clone(), id };
        let r = RdmaReader { conn: self.inner.clone(), id };
        (Box::new(w), Box::new(r))
    }
}

impl KvConnection for RdmaConnection {
    fn open_stream(&self) -> BoxFuture<'_, Result<KvStream, TransportError>> {
        Box::pin(async move {
            let id = self.shared().lock().open_stream().map_err(self.stream_err("opening a stream"))?;
            Ok(self.halves(id))
        })
    }

    fn accept_stream(&self) -> BoxFuture<'_, Result<KvStream, TransportError>> {
        Box::pin(async move {
            let id = std::future::poll_fn(|cx| self.shared().lock().poll_accept(cx))
                .await
                .map_err(self.stream_err("accepting a stream"))?;
            Ok(self.halves(id))
        })
    }

    fn peer(&self) -> SocketAddr {
        self.shared().peer
    }

    fn close(&self, reason: &str) {
        self.shared().lock().close_local(reason);
    }

    fn is_closed(&self) -> bool {
        self.shared().lock().is_closed()
    }
}

/// The sending half of an RDMA stream.
struct RdmaWriter {
    conn: Arc<ConnInner>,
    id: u32,
}

impl crate::SendHalf for RdmaWriter {}

impl AsyncWrite for RdmaWriter {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.conn.shared.lock().poll_write(self.id, cx, buf)
    }

    /// Writes are posted to the NIC as they are accepted: nothing waits to be flushed.
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.conn.shared.lock().check_open())
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.conn.shared.lock().shutdown_write(self.id))
    }
}

impl Drop for RdmaWriter {
    fn drop(&mut self) {
        self.conn.shared.lock().drop_writer(self.id);
    }
}

/// The receiving half of an RDMA stream.
struct RdmaReader {
    conn: Arc<ConnInner>,
    id: u32,
}

impl crate::RecvHalf for RdmaReader {}

impl AsyncRead for RdmaReader {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        self.conn.shared.lock().poll_read(self.id, cx, buf)
    }
}

impl Drop for RdmaReader {
    fn drop(&mut self) {
        self.conn.shared.lock().drop_reader(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_validation_names_the_bad_knob() {
        assert!(RdmaConfig::default().validate().is_ok());
        let msg = |c: RdmaConfig| c.validate().unwrap_err().to_string();
        assert!(msg(RdmaConfig { ring_bytes: 1000, ..Default::default() }).contains("ring_bytes = 1000"));
        assert!(msg(RdmaConfig { ring_bytes: 2 << 30, ..Default::default() }).contains("ring_bytes"));
        assert!(msg(RdmaConfig { max_write_bytes: 1, ..Default::default() }).contains("max_write_bytes = 1"));
        assert!(msg(RdmaConfig { stream_window_bytes: 10, ..Default::default() }).contains("stream_window_bytes"));
        assert!(msg(RdmaConfig { send_queue_depth: 1, ..Default::default() }).contains("send_queue_depth = 1"));
        assert!(msg(RdmaConfig { keepalive_interval: Duration::ZERO, ..Default::default() }).contains("keepalive"));
        assert!(msg(RdmaConfig { device: Some(String::new()), ..Default::default() }).contains("device is empty"));
    }
}
