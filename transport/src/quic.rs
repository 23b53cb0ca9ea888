//! QUIC transport (quinn) with mutual TLS from the cluster CA.
//!
//! One UDP endpoint per worker both listens and connects. The server requires a client
//! certificate from the cluster CA and clients verify the server against
//! [`kvfleet_pki::CLUSTER_SERVER_NAME`] (see `kvfleet-pki`), so only cluster members can open or
//! accept a KV transfer; the ALPN [`KV_ALPN`] keeps other QUIC protocols out.
//!
//! [`QuicTuning`] sets quinn up for bulk transfer of 4 MiB KV blocks over a few parallel streams
//! rather than for the web's many small requests: large flow-control windows so a stream is never
//! window-limited at datacenter bandwidth-delay products, a small initial RTT estimate (loopback
//! and datacenter RTTs are microseconds, quinn's default of 333 ms would slow the first loss
//! recovery), and large socket buffers. The defaults are what measured best on loopback; the
//! measurements and which knobs mattered are in [`crate::bench`].

use crate::{BoxFuture, ConnectionPool, KvConnection, KvStream, KvTransport, TransportError};
use kvfleet_pki::{NodeIdentity, CLUSTER_SERVER_NAME};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tracing::{debug, warn};

/// The ALPN protocol id of kvfleet KV transfers (both sides insist on it).
pub const KV_ALPN: &[u8] = b"kvfleet-kv/1";

/// How many established inbound connections may wait for `accept`.
const ACCEPT_BACKLOG: usize = 64;

/// Which congestion controller quinn runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CongestionControl {
    /// CUBIC (RFC 9438), quinn's default.
    Cubic,
    /// BBR (quinn's experimental implementation).
    Bbr,
    /// NewReno (RFC 9002).
    NewReno,
}

/// QUIC knobs for bulk KV transfer; [`Default`] is the measured choice for loopback and
/// datacenter links.
#[derive(Clone, Debug, PartialEq)]
pub struct QuicTuning {
    /// Per-stream receive window: how far one stream may run ahead of its reader. 64 MiB covers a
    /// 400 Gbps × 1 ms bandwidth-delay product, so one stream is never window-limited.
    pub stream_receive_window_bytes: u64,
    /// Connection-wide receive window (all streams together): 512 MiB.
    pub receive_window_bytes: u64,
    /// Connection-wide send buffer (bytes accepted from writers but not yet acknowledged): 512 MiB.
    pub send_window_bytes: u64,
    /// Concurrent bidirectional streams a peer may open: 256 (a control stream plus data streams
    /// for many migrations at once).
    pub max_concurrent_bidi_streams: u32,
    /// Keep-alive pings on an idle connection (well under the idle timeout): 2 s.
    pub keep_alive_interval: Option<Duration>,
    /// A connection silent for this long is dead (the peer crashed or the path broke): 10 s.
    pub idle_timeout: Duration,
    /// The RTT assumed before the first sample: 1 ms (quinn's default is 333 ms).
    pub initial_rtt: Duration,
    /// The congestion controller: Cubic (no loss-free difference measured; quinn's BBR is
    /// experimental and was slightly slower).
    pub congestion: CongestionControl,
    /// Let the kernel segment large UDP sends (GSO); quinn's default, ×3.4 goodput on loopback.
    pub segmentation_offload: bool,
    /// The largest UDP payload MTU discovery may try (from 1200 bytes up; above the path MTU is
    /// safe): 1452, Ethernet's. Larger values measured worse on loopback (quinn's black-hole
    /// detection falls back to 1200 after the first losses of large packets); raise it for
    /// jumbo-frame fabrics only after measuring.
    pub mtu_upper_bound: u16,
    /// Requested `SO_SNDBUF`/`SO_RCVBUF` of the UDP socket: 32 MiB, so bursts are not dropped by
    /// the receiving socket (drops read as congestion). Forced past `net.core.{w,r}mem_max` where
    /// the process has `CAP_NET_ADMIN`, else capped by the kernel.
    pub socket_buffer_bytes: usize,
    /// Round-robin between streams with data (fair; keeps the control stream responsive next to
    /// bulk data streams) or finish one stream's buffered data first. No goodput difference.
    pub send_fairness: bool,
}

impl Default for QuicTuning {
    fn default() -> Self {
        QuicTuning {
            stream_receive_window_bytes: 64 << 20,
            receive_window_bytes: 512 << 20,
            send_window_bytes: 512 << 20,
            max_concurrent_bidi_streams: 256,
            keep_alive_interval: Some(Duration::from_secs(2)),
            idle_timeout: Duration::from_secs(10),
            initial_rtt: Duration::from_millis(1),
            congestion: CongestionControl::Cubic,
            segmentation_offload: true,
            mtu_upper_bound: 1452,
            socket_buffer_bytes: 32 << 20,
            send_fairness: true,
        }
    }
}

impl QuicTuning {
    /// quinn's transport configuration for these knobs.
    pub fn transport_config(&self) -> Result<quinn::TransportConfig, TransportError> {
        let varint = |name: &str, v: u64| {
            quinn::VarInt::from_u64(v)
                .map_err(|_| TransportError::Config(format!("QUIC tuning: {name} = {v} is too large")))
        };
        let mut t = quinn::TransportConfig::default();
        t.stream_receive_window(varint("stream_receive_window_bytes", self.stream_receive_window_bytes)?)
            .receive_window(varint("receive_window_bytes", self.receive_window_bytes)?)
            .send_window(self.send_window_bytes)
            .max_concurrent_bidi_streams(self.max_concurrent_bidi_streams.into())
            .max_concurrent_uni_streams(0u32.into())
            .keep_alive_interval(self.keep_alive_interval)
            .max_idle_timeout(Some(quinn::IdleTimeout::try_from(self.idle_timeout).map_err(|_| {
                TransportError::Config(format!("QUIC tuning: idle_timeout {:?} is too large", self.idle_timeout))
            })?))
            .initial_rtt(self.initial_rtt)
            .enable_segmentation_offload(self.segmentation_offload)
            .send_fairness(self.send_fairness);
        let mut mtu = quinn::MtuDiscoveryConfig::default();
        mtu.upper_bound(self.mtu_upper_bound.max(1200));
        t.mtu_discovery_config(Some(mtu));
        match self.congestion {
            CongestionControl::Cubic => {
                t.congestion_controller_factory(Arc::new(quinn::congestion::CubicConfig::default()))
            }
            CongestionControl::Bbr => {
                t.congestion_controller_factory(Arc::new(quinn::congestion::BbrConfig::default()))
            }
            CongestionControl::NewReno => {
                t.congestion_controller_factory(Arc::new(quinn::congestion::NewRenoConfig::default()))
            }
        };
        Ok(t)
    }
}

/// A QUIC endpoint that listens and connects (one UDP socket).
pub struct QuicTransport {
    endpoint: quinn::Endpoint,
    local: SocketAddr,
    client: quinn::ClientConfig,
    pool: ConnectionPool<QuicConnection>,
    incoming: tokio::sync::Mutex<mpsc::Receiver<Arc<QuicConnection>>>,
    acceptor: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for QuicTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicTransport").field("local", &self.local).finish_non_exhaustive()
    }
}

fn tls_err(what: &str) -> impl Fn(String) -> TransportError + '_ {
    move |e| TransportError::Tls(format!("{what}: {e}"))
}

impl QuicTransport {
    /// Bind `listen` (port 0 picks one) with this node's cluster identity. Needs a tokio runtime.
    pub fn bind(
        listen: SocketAddr,
        identity: &NodeIdentity,
        tuning: QuicTuning,
    ) -> Result<QuicTransport, TransportError> {
        let (server, client) = quinn_configs(identity, &tuning)?;
        Self::with_configs(listen, server, client, &tuning)
    }

    /// Bind with ready-made quinn configurations (tests use it to present foreign certificates).
    pub fn with_configs(
        listen: SocketAddr,
        server: quinn::ServerConfig,
        client: quinn::ClientConfig,
        tuning: &QuicTuning,
    ) -> Result<QuicTransport, TransportError> {
        let bind_err = |e: std::io::Error| TransportError::Bind { addr: listen, reason: e.to_string() };
        let socket = udp_socket(listen, tuning.socket_buffer_bytes).map_err(bind_err)?;
        let mut endpoint_config = quinn::EndpointConfig::default();
        endpoint_config
            .max_udp_payload_size(tuning.mtu_upper_bound.max(1200))
            .map_err(|e| TransportError::Bind { addr: listen, reason: format!("mtu_upper_bound: {e}") })?;
        let runtime = Arc::new(quinn::TokioRuntime);
        let endpoint = quinn::Endpoint::new(endpoint_config, Some(server), socket, runtime).map_err(bind_err)?;
        let local = endpoint.local_addr().map_err(bind_err)?;
        let (tx, rx) = mpsc::channel(ACCEPT_BACKLOG);
        let acceptor = tokio::spawn(accept_loop(endpoint.clone(), tx));
        debug!(%local, "QUIC transport bound");
        Ok(QuicTransport {
            endpoint,
            local,
            client,
            pool: ConnectionPool::default(),
            incoming: tokio::sync::Mutex::new(rx),
            acceptor,
        })
    }

    /// Like [`KvTransport::connect`], returning the concrete connection.
    pub async fn connect_quic(&self, peer: SocketAddr) -> Result<Arc<QuicConnection>, TransportError> {
        self.pool
            .get_or_connect(
                peer,
                |c| !c.is_closed(),
                || async move {
                    let err = |reason: String| TransportError::Connect { peer, reason };
                    let connecting = self
                        .endpoint
                        .connect_with(self.client.clone(), peer, CLUSTER_SERVER_NAME)
                        .map_err(|e| err(e.to_string()))?;
                    let conn = connecting.await.map_err(|e| err(e.to_string()))?;
                    debug!(%peer, "QUIC connection established");
                    Ok(Arc::new(QuicConnection { peer, conn }))
                },
            )
            .await
    }

    /// The underlying quinn endpoint (statistics, tests).
    pub fn endpoint(&self) -> &quinn::Endpoint {
        &self.endpoint
    }
}

/// quinn's server and client configurations for `identity` (mutual TLS, [`KV_ALPN`]) and `tuning`.
pub fn quinn_configs(
    identity: &NodeIdentity,
    tuning: &QuicTuning,
) -> Result<(quinn::ServerConfig, quinn::ClientConfig), TransportError> {
    let transport = Arc::new(tuning.transport_config()?);

    let mut server_tls = identity.rustls_server().map_err(|e| tls_err("server config")(e.to_string()))?;
    server_tls.alpn_protocols = vec![KV_ALPN.to_vec()];
    let server_crypto = QuicServerConfig::try_from(server_tls).map_err(|e| tls_err("QUIC server")(e.to_string()))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
    server.transport_config(transport.clone());

    let client_tls = identity.rustls_client().map_err(|e| tls_err("client config")(e.to_string()))?;
    let client = quinn_client_config(client_tls, tuning)?;
    Ok((server, client))
}

/// A quinn client configuration from any rustls client config (gets [`KV_ALPN`] and `tuning`).
pub fn quinn_client_config(
    mut tls: rustls::ClientConfig,
    tuning: &QuicTuning,
) -> Result<quinn::ClientConfig, TransportError> {
    tls.alpn_protocols = vec![KV_ALPN.to_vec()];
    let crypto = QuicClientConfig::try_from(tls).map_err(|e| tls_err("QUIC client")(e.to_string()))?;
    let mut client = quinn::ClientConfig::new(Arc::new(crypto));
    client.transport_config(Arc::new(tuning.transport_config()?));
    Ok(client)
}

/// Accept connections and run their handshakes concurrently, so one slow or hostile client does
/// not hold up the others; failed handshakes are logged and dropped.
async fn accept_loop(endpoint: quinn::Endpoint, tx: mpsc::Sender<Arc<QuicConnection>>) {
    while let Some(incoming) = endpoint.accept().await {
        let tx = tx.clone();
        tokio::spawn(async move {
            let peer = incoming.remote_address();
            match incoming.await {
                Ok(conn) => {
                    debug!(%peer, "QUIC connection accepted");
                    // Nobody accepting any more: the connection is dropped (closed).
                    let _ = tx.send(Arc::new(QuicConnection { peer, conn })).await;
                }
                Err(e) => warn!(%peer, error = %e, "refused a QUIC connection (handshake failed)"),
            }
        });
    }
}

pub(crate) fn udp_socket(addr: SocketAddr, buffer_bytes: usize) -> std::io::Result<std::net::UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    if addr.is_ipv6() {
        socket.set_only_v6(false).ok();
    }
    // Best effort: the kernel caps (or refuses) large buffers; a smaller one still works.
    if let Err(e) = socket.set_recv_buffer_size(buffer_bytes) {
        debug!(error = %e, "could not set the UDP receive buffer size");
    }
    if let Err(e) = socket.set_send_buffer_size(buffer_bytes) {
        debug!(error = %e, "could not set the UDP send buffer size");
    }
    #[cfg(target_os = "linux")]
    force_buffer_sizes(&socket, buffer_bytes);
    socket.bind(&addr.into())?;
    Ok(socket.into())
}

/// With `CAP_NET_ADMIN` the kernel lets a socket exceed `net.core.{r,w}mem_max`; a receive buffer
/// that absorbs bursts avoids drops that the congestion controller would read as congestion.
#[cfg(target_os = "linux")]
fn force_buffer_sizes(socket: &socket2::Socket, buffer_bytes: usize) {
    use std::os::fd::AsRawFd;
    let value = libc::c_int::try_from(buffer_bytes).unwrap_or(libc::c_int::MAX);
    for opt in [libc::SO_RCVBUFFORCE, libc::SO_SNDBUFFORCE] {
        // SAFETY: a valid socket fd, a c_int option value of the size passed.
        let rc = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                std::ptr::from_ref(&value).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            debug!(error = %std::io::Error::last_os_error(), "no privilege to exceed the UDP buffer limit");
        }
    }
}

impl KvTransport for QuicTransport {
    fn connect(&self, peer: SocketAddr) -> BoxFuture<'_, Result<Arc<dyn KvConnection>, TransportError>> {
        Box::pin(async move { Ok(self.connect_quic(peer).await? as Arc<dyn KvConnection>) })
    }

    fn accept(&self) -> BoxFuture<'_, Result<Arc<dyn KvConnection>, TransportError>> {
        Box::pin(async move {
            match self.incoming.lock().await.recv().await {
                Some(c) => Ok(c as Arc<dyn KvConnection>),
                None => Err(TransportError::EndpointClosed { local: self.local }),
            }
        })
    }

    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn close(&self) {
        self.pool.drain();
        self.endpoint.close(0u32.into(), b"transport closed");
    }
}

impl Drop for QuicTransport {
    /// Stop accepting; established connections live on until they are dropped or closed.
    fn drop(&mut self) {
        self.acceptor.abort();
    }
}

/// One QUIC connection.
#[derive(Debug)]
pub struct QuicConnection {
    peer: SocketAddr,
    conn: quinn::Connection,
}

impl QuicConnection {
    /// The underlying quinn connection (statistics, RTT).
    pub fn quinn(&self) -> &quinn::Connection {
        &self.conn
    }

    fn stream_err(&self, what: &'static str) -> impl Fn(quinn::ConnectionError) -> TransportError + '_ {
        move |e| TransportError::Stream { peer: self.peer, what, reason: e.to_string() }
    }
}

impl KvConnection for QuicConnection {
    fn open_stream(&self) -> BoxFuture<'_, Result<KvStream, TransportError>> {
        Box::pin(async move {
            let (send, recv) = self.conn.open_bi().await.map_err(self.stream_err("opening a stream"))?;
            Ok((Box::new(send) as _, Box::new(recv) as _))
        })
    }

    fn accept_stream(&self) -> BoxFuture<'_, Result<KvStream, TransportError>> {
        Box::pin(async move {
            let (send, recv) = self.conn.accept_bi().await.map_err(self.stream_err("accepting a stream"))?;
            Ok((Box::new(send) as _, Box::new(recv) as _))
        })
    }

    fn peer(&self) -> SocketAddr {
        self.peer
    }

    fn close(&self, reason: &str) {
        self.conn.close(0u32.into(), reason.as_bytes());
    }

    fn is_closed(&self) -> bool {
        self.conn.close_reason().is_some()
    }
}
