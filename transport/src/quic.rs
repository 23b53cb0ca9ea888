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
use kvfleet_pki::Role;
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
    /// Per-stream receive window: how far one stream may run ahead of its reader: 16 MiB (a
    /// migration's 4 data streams together fill the connection's window).
    pub stream_receive_window_bytes: u64,
    /// Connection-wide receive window (all streams together): 64 MiB, a 400 Gbps × 1.3 ms
    /// bandwidth-delay product. At most the UDP socket's receive buffer: flow control, not the
    /// socket overflowing, must hold back a sender faster than its receiver. With 512 MiB over a
    /// 32 MiB buffer, a CPU-bound receiver on loopback dropped 12–15 % of all packets (each one
    /// encrypted, sent, lost, and sent again) and goodput fell by a fifth (see [`crate::bench`]).
    pub receive_window_bytes: u64,
    /// Connection-wide send buffer (bytes accepted from writers but not yet acknowledged): 128 MiB,
    /// twice the peer's receive window. Writers wait beyond it, so a fast reader of KV blocks
    /// does not pin more snapshots than the link can take.
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
    /// The largest UDP payload MTU discovery may try (from 1200 bytes up), a cap on the path's
    /// own: an outgoing connection searches up to the MTU of the interface its route to the peer
    /// leaves by (`IP_MTU`, less the IP and UDP headers): 1472 bytes on Ethernet, 8972 on jumbo
    /// frames, 65 507 on loopback. Default 65 507 (no cap). Large datagrams divide quinn's
    /// per-packet work (header protection, AEAD set-up, ACK bookkeeping, one `sendmsg` slot):
    /// on this host's loopback, 16 KiB datagrams moved 2.5 × the goodput of 1452-byte ones.
    pub mtu_upper_bound: u16,
    /// Requested `SO_SNDBUF`/`SO_RCVBUF` of the UDP socket: 64 MiB (the connection's receive
    /// window), so bursts are not dropped by the receiving socket (drops read as congestion).
    /// Forced past `net.core.{w,r}mem_max` where the process has `CAP_NET_ADMIN`, else capped by
    /// the kernel.
    pub socket_buffer_bytes: usize,
    /// Round-robin between streams with data (fair; keeps the control stream responsive next to
    /// bulk data streams) or finish one stream's buffered data first. No goodput difference.
    pub send_fairness: bool,
    /// Run the endpoint and its connections (packet assembly, encryption, ACKs, the socket) on a
    /// thread of their own with a single-threaded runtime, instead of on the caller's runtime:
    /// no cross-thread hand-offs between the endpoint driver, the connection drivers and their
    /// timers, and no competition with the process's other tasks. Default on.
    pub dedicated_thread: bool,
}

impl Default for QuicTuning {
    fn default() -> Self {
        QuicTuning {
            stream_receive_window_bytes: 16 << 20,
            receive_window_bytes: 64 << 20,
            send_window_bytes: 128 << 20,
            max_concurrent_bidi_streams: 256,
            keep_alive_interval: Some(Duration::from_secs(2)),
            idle_timeout: Duration::from_secs(10),
            initial_rtt: Duration::from_millis(1),
            congestion: CongestionControl::Cubic,
            segmentation_offload: true,
            mtu_upper_bound: MAX_UDP_PAYLOAD,
            socket_buffer_bytes: 64 << 20,
            send_fairness: true,
            dedicated_thread: true,
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
    tuning: QuicTuning,
    pool: ConnectionPool<QuicConnection>,
    incoming: tokio::sync::Mutex<mpsc::Receiver<Arc<QuicConnection>>>,
    acceptor: tokio::task::JoinHandle<()>,
    /// The endpoint's own thread, if [`QuicTuning::dedicated_thread`] (connections hold it too).
    thread: Option<Arc<NetThread>>,
}

/// A thread running a single-threaded tokio runtime for one endpoint's quinn tasks; it stops
/// once the transport and every connection made through it are dropped.
#[derive(Debug)]
struct NetThread {
    handle: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl NetThread {
    fn start(name: String) -> std::io::Result<Arc<NetThread>> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let handle = rt.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (started_tx, started) = std::sync::mpsc::sync_channel::<()>(1);
        std::thread::Builder::new().name(name).spawn(move || {
            let _ = started_tx.send(());
            let _ = rt.block_on(stopped);
        })?;
        // The thread names itself as it starts: once it runs, it shows under its name.
        let _ = started.recv();
        Ok(Arc::new(NetThread { handle, stop: Some(stop) }))
    }
}

impl Drop for NetThread {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// quinn's tokio runtime pinned to one runtime (the endpoint's [`NetThread`]): its drivers are
/// spawned there and its socket and timers registered with that runtime's reactor, whichever
/// runtime the caller of `connect` or `accept` runs on.
#[derive(Debug)]
struct PinnedRuntime(tokio::runtime::Handle);

impl quinn::Runtime for PinnedRuntime {
    fn new_timer(&self, at: std::time::Instant) -> std::pin::Pin<Box<dyn quinn::AsyncTimer>> {
        let _in = self.0.enter();
        quinn::TokioRuntime.new_timer(at)
    }

    fn spawn(&self, future: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>) {
        self.0.spawn(future);
    }

    fn wrap_udp_socket(&self, socket: std::net::UdpSocket) -> std::io::Result<Arc<dyn quinn::AsyncUdpSocket>> {
        let _in = self.0.enter();
        quinn::TokioRuntime.wrap_udp_socket(socket)
    }

    fn now(&self) -> std::time::Instant {
        quinn::TokioRuntime.now()
    }
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
        let thread = match tuning.dedicated_thread {
            // Named after the bound port (`top -H`, profiles): "kv-quic-40123".
            true => {
                let port = socket.local_addr().map_err(bind_err)?.port();
                Some(NetThread::start(format!("kv-quic-{port}")).map_err(bind_err)?)
            }
            false => None,
        };
        let runtime: Arc<dyn quinn::Runtime> = match &thread {
            Some(t) => Arc::new(PinnedRuntime(t.handle.clone())),
            None => Arc::new(quinn::TokioRuntime),
        };
        let socket = runtime.wrap_udp_socket(socket).map_err(bind_err)?;
        let socket = Arc::new(SplittingSocket::new(socket, tuning.mtu_upper_bound.max(1200)));
        let endpoint = quinn::Endpoint::new_with_abstract_socket(endpoint_config, Some(server), socket, runtime)
            .map_err(bind_err)?;
        let local = endpoint.local_addr().map_err(bind_err)?;
        let (tx, rx) = mpsc::channel(ACCEPT_BACKLOG);
        let acceptor = tokio::spawn(accept_loop(endpoint.clone(), tx, thread.clone()));
        debug!(%local, "QUIC transport bound");
        Ok(QuicTransport {
            endpoint,
            local,
            client,
            tuning: tuning.clone(),
            pool: ConnectionPool::default(),
            incoming: tokio::sync::Mutex::new(rx),
            acceptor,
            thread,
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
                        .connect_with(self.client_for(peer)?, peer, CLUSTER_SERVER_NAME)
                        .map_err(|e| err(e.to_string()))?;
                    let conn = connecting.await.map_err(|e| err(e.to_string()))?;
                    debug!(%peer, "QUIC connection established");
                    Ok(Arc::new(QuicConnection { peer, conn, _thread: self.thread.clone() }))
                },
            )
            .await
    }

    /// The client configuration for a connection to `peer`: MTU discovery searches up to the
    /// MTU of the interface the route to `peer` leaves by, capped by the tuning.
    fn client_for(&self, peer: SocketAddr) -> Result<quinn::ClientConfig, TransportError> {
        let Some(route) = route_udp_payload(peer) else { return Ok(self.client.clone()) };
        let bound = route.min(self.tuning.mtu_upper_bound).max(1200);
        if bound == self.tuning.mtu_upper_bound.max(1200) {
            return Ok(self.client.clone());
        }
        let tuning = QuicTuning { mtu_upper_bound: bound, ..self.tuning.clone() };
        debug!(%peer, bound, "QUIC MTU discovery bound from the route");
        let mut client = self.client.clone();
        client.transport_config(Arc::new(tuning.transport_config()?));
        Ok(client)
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
async fn accept_loop(endpoint: quinn::Endpoint, tx: mpsc::Sender<Arc<QuicConnection>>, thread: Option<Arc<NetThread>>) {
    while let Some(incoming) = endpoint.accept().await {
        let tx = tx.clone();
        let thread = thread.clone();
        tokio::spawn(async move {
            let peer = incoming.remote_address();
            match incoming.await {
                Ok(conn) => {
                    // Mutual TLS proved the peer is the cluster's; only a worker may move KV.
                    if let Some(role) = peer_role(&conn).filter(|r| *r != Role::Worker) {
                        warn!(%peer, role = role.as_str(), "refused a QUIC connection: the KV port takes worker certificates only");
                        conn.close(
                            quinn::VarInt::from_u32(KV_ROLE_REFUSED),
                            b"the KV port takes worker certificates only",
                        );
                        return;
                    }
                    debug!(%peer, "QUIC connection accepted");
                    // Nobody accepting any more: the connection is dropped (closed).
                    let _ = tx.send(Arc::new(QuicConnection { peer, conn, _thread: thread })).await;
                }
                Err(e) => warn!(%peer, error = %e, "refused a QUIC connection (handshake failed)"),
            }
        });
    }
}

/// QUIC application close code for a peer whose certificate is not a worker's.
pub const KV_ROLE_REFUSED: u32 = 0x4b56;

/// The role in the peer's certificate (`None` without one, or without a kvfleet role: only
/// possible when the server does not ask for client certificates).
fn peer_role(conn: &quinn::Connection) -> Option<Role> {
    let certs = conn.peer_identity()?.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>().ok()?;
    Some(certs.first().and_then(|c| kvfleet_pki::role_of(c.as_ref())).unwrap_or(Role::Client))
}

/// The largest UDP payload there is (IPv4's 16-bit length less the IP and UDP headers); also the
/// most one `sendmsg` may carry, GSO batch included (the kernel answers more with `EMSGSIZE`).
pub const MAX_UDP_PAYLOAD: u16 = 65_507;

/// The UDP payload that fits the MTU of the interface the route to `peer` leaves by (Linux's
/// `IP_MTU`/`IPV6_MTU` of a socket connected to it; nothing is sent), or `None` where unknown.
pub fn route_udp_payload(peer: SocketAddr) -> Option<u16> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let local: SocketAddr = if peer.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().ok()?;
        let socket = std::net::UdpSocket::bind(local).ok()?;
        socket.connect(peer).ok()?;
        let (level, opt, headers) = if peer.is_ipv4() {
            (libc::IPPROTO_IP, libc::IP_MTU, 28)
        } else {
            (libc::IPPROTO_IPV6, libc::IPV6_MTU, 48)
        };
        let mut mtu: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: a valid socket fd and a c_int out-parameter of the size passed.
        let rc =
            unsafe { libc::getsockopt(socket.as_raw_fd(), level, opt, std::ptr::from_mut(&mut mtu).cast(), &mut len) };
        if rc != 0 || mtu <= headers {
            return None;
        }
        Some(u16::try_from(mtu - headers).unwrap_or(MAX_UDP_PAYLOAD).min(MAX_UDP_PAYLOAD))
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = peer;
        None
    }
}

/// quinn's UDP socket, with GSO batches that fit one `sendmsg`. quinn batches up to 10 datagrams
/// of a connection's current MTU; above 6.5 kB datagrams (jumbo frames, loopback) that exceeds
/// the 64 KiB a send may carry, and the kernel would refuse the whole batch (`EMSGSIZE`: every
/// datagram lost). Such a batch goes out as several sends of whole datagrams instead. The GRO
/// receive slots are sized to hold one 64 KiB coalesced read rather than 64 of the largest
/// datagram (quinn allocates payload × segments × 32 slots per endpoint: 128 MiB at 64 KiB).
#[derive(Debug)]
struct SplittingSocket {
    inner: Arc<dyn quinn::AsyncUdpSocket>,
    receive_segments: usize,
}

impl SplittingSocket {
    fn new(inner: Arc<dyn quinn::AsyncUdpSocket>, max_payload: u16) -> SplittingSocket {
        let receive_segments =
            (64 * 1024usize).div_ceil(usize::from(max_payload)).clamp(1, inner.max_receive_segments());
        SplittingSocket { inner, receive_segments }
    }
}

/// How a transmit of `len` bytes in `segment`-byte datagrams splits into sends of at most
/// [`MAX_UDP_PAYLOAD`] bytes of whole datagrams: the byte ranges, in order.
fn send_ranges(len: usize, segment: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let per_send = (usize::from(MAX_UDP_PAYLOAD) / segment.max(1)).max(1) * segment.max(1);
    (0..len).step_by(per_send).map(move |start| start..(start + per_send).min(len))
}

impl quinn::AsyncUdpSocket for SplittingSocket {
    fn create_io_poller(self: Arc<Self>) -> std::pin::Pin<Box<dyn quinn::UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &quinn::udp::Transmit) -> std::io::Result<()> {
        let Some(segment) = transmit.segment_size.filter(|_| transmit.contents.len() > usize::from(MAX_UDP_PAYLOAD))
        else {
            return self.inner.try_send(transmit);
        };
        // A send that blocks after others went out is retried whole by quinn: the receiver drops
        // the repeated packets as duplicates, which is cheaper than losing them.
        for range in send_ranges(transmit.contents.len(), segment) {
            let contents = &transmit.contents[range];
            let part = quinn::udp::Transmit {
                contents,
                segment_size: (contents.len() > segment).then_some(segment),
                ..*transmit
            };
            self.inner.try_send(&part)?;
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut std::task::Context,
        bufs: &mut [std::io::IoSliceMut<'_>],
        meta: &mut [quinn::udp::RecvMeta],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.receive_segments
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
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
    /// Keeps the endpoint's thread (its drivers) running while the connection lives.
    _thread: Option<Arc<NetThread>>,
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

/// A QUIC send stream that is abandoned, not finished, when dropped before shutdown.
///
/// quinn finishes a dropped stream, so everything written to it is still delivered; a migration
/// that aborts mid-copy would then keep its target's link busy with KV nobody wants (hundreds of
/// MiB may be queued: the send window is 128 MiB). Dropping this one without `shutdown` resets the
/// stream instead (RESET_STREAM: the queued data is discarded, the reader sees the reset). A
/// writer that completes its transfer shuts down (`FrameWriter::finish`) as before.
struct QuicSendStream {
    inner: quinn::SendStream,
    shut_down: bool,
}

impl QuicSendStream {
    fn new(inner: quinn::SendStream) -> QuicSendStream {
        QuicSendStream { inner, shut_down: false }
    }
}

/// The application error code of a stream abandoned by its writer.
pub const STREAM_ABANDONED: u32 = 1;

impl Drop for QuicSendStream {
    fn drop(&mut self) {
        if !self.shut_down {
            // Already finished, reset or closed: nothing left to discard.
            let _ = self.inner.reset(STREAM_ABANDONED.into());
        }
    }
}

impl tokio::io::AsyncWrite for QuicSendStream {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        tokio::io::AsyncWrite::poll_write(std::pin::Pin::new(&mut self.inner), cx, buf).map_err(with_cause)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        tokio::io::AsyncWrite::poll_flush(std::pin::Pin::new(&mut self.inner), cx).map_err(with_cause)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        // Once shutdown began, the stream is being finished: never reset it afterwards.
        self.shut_down = true;
        tokio::io::AsyncWrite::poll_shutdown(std::pin::Pin::new(&mut self.inner), cx).map_err(with_cause)
    }
}

/// quinn's stream errors say "connection lost" and keep why inside; the reason (the peer's
/// close, a TLS alert such as a refused certificate, an idle timeout) is what a log needs.
fn with_cause(e: std::io::Error) -> std::io::Error {
    let cause = e.get_ref().and_then(|inner| {
        let lost = |c: &quinn::ConnectionError| format!("connection lost: {c}");
        match (inner.downcast_ref::<quinn::WriteError>(), inner.downcast_ref::<quinn::ReadError>()) {
            (Some(quinn::WriteError::ConnectionLost(c)), _) | (_, Some(quinn::ReadError::ConnectionLost(c))) => {
                Some(lost(c))
            }
            _ => None,
        }
    });
    match cause {
        Some(text) => std::io::Error::new(e.kind(), text),
        None => e,
    }
}

/// quinn queues the block itself (a `Bytes` clone per packet's worth), no copy.
impl crate::SendHalf for QuicSendStream {
    fn write_chunk(&mut self, chunk: bytes::Bytes) -> BoxFuture<'_, std::io::Result<()>> {
        Box::pin(async move { self.inner.write_chunk(chunk).await.map_err(|e| with_cause(e.into())) })
    }
}

/// A QUIC receive stream whose errors name their cause ([`with_cause`]).
struct QuicRecvStream(quinn::RecvStream);

impl tokio::io::AsyncRead for QuicRecvStream {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        tokio::io::AsyncRead::poll_read(std::pin::Pin::new(&mut self.0), cx, buf).map_err(with_cause)
    }
}

/// quinn hands over the received packets' buffers (slices of them), no copy.
impl crate::RecvHalf for QuicRecvStream {
    fn read_chunk(&mut self, max: usize) -> BoxFuture<'_, std::io::Result<Option<bytes::Bytes>>> {
        Box::pin(async move {
            if max == 0 {
                return Ok(Some(bytes::Bytes::new()));
            }
            let chunk = self.0.read_chunk(max, true).await.map_err(|e| with_cause(e.into()))?;
            Ok(chunk.map(|c| c.bytes))
        })
    }
}

impl KvConnection for QuicConnection {
    fn open_stream(&self) -> BoxFuture<'_, Result<KvStream, TransportError>> {
        Box::pin(async move {
            let (send, recv) = self.conn.open_bi().await.map_err(self.stream_err("opening a stream"))?;
            Ok((Box::new(QuicSendStream::new(send)) as _, Box::new(QuicRecvStream(recv)) as _))
        })
    }

    fn accept_stream(&self) -> BoxFuture<'_, Result<KvStream, TransportError>> {
        Box::pin(async move {
            let (send, recv) = self.conn.accept_bi().await.map_err(self.stream_err("accepting a stream"))?;
            Ok((Box::new(QuicSendStream::new(send)) as _, Box::new(QuicRecvStream(recv)) as _))
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

#[cfg(test)]
mod split_tests {
    use super::*;

    #[test]
    fn batches_split_into_sends_of_whole_datagrams_within_64_kib() {
        let ranges: Vec<_> = send_ranges(10 * 16_384, 16_384).collect();
        // 3 datagrams of 16 KiB per send (49 152 bytes), 10 datagrams in 4 sends.
        assert_eq!(ranges, vec![0..49_152, 49_152..98_304, 98_304..147_456, 147_456..163_840]);
        // The last datagram of a batch may be short.
        let ranges: Vec<_> = send_ranges(4 * 30_000 + 7, 30_000).collect();
        assert_eq!(ranges, vec![0..60_000, 60_000..120_000, 120_000..120_007]);
        for r in send_ranges(10 * 65_507, 65_507) {
            assert_eq!(r.len(), 65_507);
        }
    }

    #[test]
    fn loopback_route_allows_large_datagrams() {
        // Linux loopback's MTU is 65 536 unless someone changed it; anything else must still
        // leave room for at least a minimum QUIC datagram.
        let payload = route_udp_payload("127.0.0.1:9".parse().unwrap()).expect("IP_MTU of loopback");
        assert!(payload >= 1200, "loopback payload {payload}");
        assert!(payload <= MAX_UDP_PAYLOAD);
    }
}
