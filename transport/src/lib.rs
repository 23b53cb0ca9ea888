//! kvfleet-transport: the byte movers of KV-cache live migration.
//!
//! A live migration (the protocol is `kvfleet_netmodel::migration`) uses one connection
//! between two workers: a control stream plus several parallel data streams, each carrying
//! length-prefixed protobuf frames. This crate moves those bytes and knows nothing of the
//! protocol.
//!
//! | module | what lives there |
//! |---|---|
//! | [`frame`] | length-prefixed protobuf frames (`u32` big-endian length + prost body): a pure decoder and async [`FrameReader`]/[`FrameWriter`], generic over any `prost::Message` |
//! | this file | the [`KvTransport`] / [`KvConnection`] traits (object-safe, boxed futures) and [`TransportError`] |
//! | [`mem`] | an in-memory transport for tests ([`MemNetwork`]): duplex pipes, severable links |
//! | [`quic`] | QUIC over quinn with mutual TLS from the cluster CA ([`QuicTransport`], [`QuicTuning`]) |
//! | [`shaped`] | a wrapper transport ([`Shaped`]) that limits each link's rate and adds latency (`kvfleet_netmodel::shaping`) to emulate a fabric |
//! | [`bench`](mod@bench) | goodput measurements for `kvfleet bench migration`: raw TCP baseline vs QUIC |
//!
//! # Streams
//!
//! A stream is a pair of halves, `(writer, reader)`. The opener must write first: QUIC announces
//! a stream to the peer only with its first bytes, so `accept_stream` on the other side returns
//! only then (the in-memory transport is more eager; do not rely on it). Shutting the writer down
//! (`AsyncWriteExt::shutdown`) is a clean end of stream: the peer's reads return EOF. When the
//! connection is closed or lost, pending and later reads and writes fail with an I/O error of
//! kind `NotConnected` (quinn's; the in-memory transport does the same), never a clean EOF.
//! A lost peer that sends nothing is detected after [`QuicTuning::idle_timeout`]. The writer is a
//! [`SendHalf`]: besides `AsyncWrite`, it takes owned buffers whole ([`SendHalf::write_chunk`]),
//! which QUIC queues without a copy (a migration's KV blocks go that way). The reader is a
//! [`RecvHalf`]: besides `AsyncRead`, it hands over received buffers ([`RecvHalf::read_chunk`]),
//! which QUIC does without a copy ([`FrameReader::recv_with_payload`] keeps a block that way).
//!
//! # Connections
//!
//! [`KvTransport::connect`] pools outbound connections, one holder at a time: connecting returns
//! a live connection to the peer that no one else holds (one a finished transfer gave back), else
//! a new one. So migrations to one peer one after another reuse a connection, and migrations at
//! the same time each have one of their own (on a [`shaped::Shaped`] transport, a flow of their
//! own on the NIC, as the simulator's fabric counts transfers). Connections accepted from a peer
//! are not pooled for outbound use: their streams are served by whoever called
//! [`KvTransport::accept`].

#![warn(missing_docs)]

pub mod bench;
pub mod bench_udp;
pub mod frame;
pub mod mem;
pub mod quic;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod shaped;

use bytes::Bytes;
use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncRead, AsyncWrite};

pub use frame::{FrameCodec, FrameError, FrameReader, FrameWriter, DEFAULT_MAX_FRAME_BYTES};
pub use kvfleet_netmodel::Payload;
pub use mem::{MemConnection, MemNetwork, MemTransport};
pub use quic::{
    quinn_client_config, quinn_configs, route_udp_payload, CongestionControl, QuicConnection, QuicTransport,
    QuicTuning, KV_ALPN, MAX_UDP_PAYLOAD, STREAM_ABANDONED,
};
pub use shaped::{Shaped, ShapedConnection, ShapedLink, ShapedReader, ShapedWriter};

/// A boxed, sendable future (what the object-safe traits return).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
/// The sending half of a stream.
pub type StreamWriter = Box<dyn SendHalf>;
/// The receiving half of a stream.
pub type StreamReader = Box<dyn RecvHalf>;

/// A stream's sending half: bytes through [`AsyncWrite`], or owned buffers handed over whole.
///
/// A KV block is megabytes; copying it into the transport's send buffer was the largest single
/// cost of a QUIC migration's sender (18 % of its CPU on loopback). A transport that queues owned
/// buffers (QUIC) overrides [`SendHalf::write_chunk`] to take the block without a copy; the
/// default writes it through `AsyncWrite`.
pub trait SendHalf: AsyncWrite + Send + Unpin {
    /// Write all of `chunk` (no copy where the transport can keep the buffer itself).
    fn write_chunk(&mut self, chunk: Bytes) -> BoxFuture<'_, std::io::Result<()>> {
        Box::pin(async move { tokio::io::AsyncWriteExt::write_all(self, &chunk).await })
    }
}

impl<T: SendHalf + ?Sized> SendHalf for Box<T> {
    fn write_chunk(&mut self, chunk: Bytes) -> BoxFuture<'_, std::io::Result<()>> {
        (**self).write_chunk(chunk)
    }
}

/// In-process pipes (tests, examples) copy.
impl SendHalf for tokio::io::DuplexStream {}

/// How much a default [`RecvHalf::read_chunk`] reads at most into one new buffer.
const READ_CHUNK_BYTES: usize = 64 << 10;

/// A stream's receiving half: bytes through [`AsyncRead`], or the next received buffer itself.
///
/// QUIC delivers a KV block as tens of received packet buffers; reading them through `AsyncRead`
/// copies each into the reader's buffer, the largest cost of a QUIC migration's receiver that was
/// its own (~22 % of its CPU on loopback). A transport that keeps received data in owned buffers
/// (QUIC) overrides [`RecvHalf::read_chunk`] to hand them over; the default reads into a new one.
pub trait RecvHalf: AsyncRead + Send + Unpin {
    /// The stream's next bytes, at most `max` (at least one unless `max` is 0), as an owned
    /// buffer; `None` at the end of the stream. Errors as [`AsyncRead`]'s.
    fn read_chunk(&mut self, max: usize) -> BoxFuture<'_, std::io::Result<Option<Bytes>>> {
        Box::pin(async move {
            if max == 0 {
                return Ok(Some(Bytes::new()));
            }
            let limit = max.min(READ_CHUNK_BYTES);
            let mut buf = bytes::BytesMut::with_capacity(limit);
            let n = tokio::io::AsyncReadExt::read_buf(self, &mut bytes::BufMut::limit(&mut buf, limit)).await?;
            Ok((n > 0).then(|| buf.freeze()))
        })
    }
}

impl<T: RecvHalf + ?Sized> RecvHalf for Box<T> {
    fn read_chunk(&mut self, max: usize) -> BoxFuture<'_, std::io::Result<Option<Bytes>>> {
        (**self).read_chunk(max)
    }
}

/// In-process pipes (tests, examples) copy.
impl RecvHalf for tokio::io::DuplexStream {}
/// A bidirectional stream: `(writer, reader)`.
pub type KvStream = (StreamWriter, StreamReader);

/// What failed, naming the peer (or local address) and the step.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TransportError {
    /// The local endpoint could not be bound.
    #[error("binding {addr}: {reason}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Why it failed.
        reason: String,
    },
    /// The TLS configuration could not be built from the cluster identity.
    #[error("TLS setup: {0}")]
    Tls(String),
    /// The transport's configuration is unusable (e.g. no RDMA device).
    #[error("configuration: {0}")]
    Config(String),
    /// A connection to the peer could not be established.
    #[error("connecting to {peer}: {reason}")]
    Connect {
        /// The peer.
        peer: SocketAddr,
        /// Why it failed.
        reason: String,
    },
    /// The connection was closed (by either side, or lost).
    #[error("connection to {peer} is closed: {reason}")]
    Closed {
        /// The peer.
        peer: SocketAddr,
        /// Why it closed.
        reason: String,
    },
    /// Opening, accepting or using one stream of the connection failed.
    #[error("{what} on the connection to {peer}: {reason}")]
    Stream {
        /// The peer.
        peer: SocketAddr,
        /// The step (`opening a stream`, ...).
        what: &'static str,
        /// Why it failed.
        reason: String,
    },
    /// The local transport was shut down.
    #[error("the transport on {local} is closed")]
    EndpointClosed {
        /// Its address.
        local: SocketAddr,
    },
    /// No transport listens at the peer's address (in-memory network).
    #[error("{peer}: nothing listens there")]
    Unreachable {
        /// The peer.
        peer: SocketAddr,
    },
}

/// A way to reach other workers: outbound connections (pooled) and inbound ones.
///
/// Object-safe (`Arc<dyn KvTransport>`): every async method returns a [`BoxFuture`].
pub trait KvTransport: Send + Sync + 'static {
    /// A live connection to `peer` that no other caller holds: a pooled idle one if one is
    /// still open, else a new one (see the crate docs' "Connections").
    fn connect(&self, peer: SocketAddr) -> BoxFuture<'_, Result<Arc<dyn KvConnection>, TransportError>>;
    /// The next inbound connection (failed handshakes are logged and skipped); an error only once
    /// the transport is closed.
    fn accept(&self) -> BoxFuture<'_, Result<Arc<dyn KvConnection>, TransportError>>;
    /// The address peers connect to.
    fn local_addr(&self) -> SocketAddr;
    /// Close every connection and stop accepting; pending `accept`s fail.
    fn close(&self);
}

/// One connection to a peer, carrying any number of concurrent streams.
pub trait KvConnection: Send + Sync + 'static {
    /// Open a new bidirectional stream (write on it first; see the crate docs).
    fn open_stream(&self) -> BoxFuture<'_, Result<KvStream, TransportError>>;
    /// The next stream the peer opened; an error once the connection is closed.
    fn accept_stream(&self) -> BoxFuture<'_, Result<KvStream, TransportError>>;
    /// The peer's address.
    fn peer(&self) -> SocketAddr;
    /// Close the connection now; the peer's streams fail with `reason`. Unsent data may be lost:
    /// wait for an application-level acknowledgement first.
    fn close(&self, reason: &str);
    /// Whether the connection is closed (by either side, or lost).
    fn is_closed(&self) -> bool;
}

/// Outbound connections by peer. A connection serves one holder at a time: a connect returns a
/// live pooled connection that nobody else holds (the pool's own handle is its only one), else a
/// new one. Transfers to one peer one after another reuse a connection (and its congestion
/// window); transfers at the same time each get their own, so on a shaped NIC each is a flow of
/// its own, as the simulator's fabric shares a port per transfer. One async slot per peer: connects
/// to one peer make their connections one at a time, connects to different peers do not wait for
/// each other.
pub(crate) struct ConnectionPool<C: ?Sized> {
    slots: Mutex<HashMap<SocketAddr, PoolSlot<C>>>,
}

/// One peer's pooled connections, locked while a connect to that peer is in progress.
type PoolSlot<C> = Arc<tokio::sync::Mutex<Vec<Arc<C>>>>;

impl<C: ?Sized> Default for ConnectionPool<C> {
    fn default() -> Self {
        ConnectionPool { slots: Mutex::new(HashMap::new()) }
    }
}

impl<C: ?Sized + Send + Sync> ConnectionPool<C> {
    /// A live pooled connection to `peer` (per `is_live`) that no one else holds, or a new one
    /// from `make`, pooled. It is the caller's until it drops every handle it got (streams may
    /// hold handles too).
    pub(crate) async fn get_or_connect<F, Fut>(
        &self,
        peer: SocketAddr,
        is_live: impl Fn(&C) -> bool,
        make: F,
    ) -> Result<Arc<C>, TransportError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Arc<C>, TransportError>>,
    {
        let slot = {
            let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            slots.entry(peer).or_default().clone()
        };
        let mut slot = slot.lock().await;
        slot.retain(|c| is_live(c));
        // Handles are cloned only here, under the slot's lock, so a count of one stays one until
        // this returns.
        if let Some(idle) = slot.iter().find(|c| Arc::strong_count(c) == 1) {
            return Ok(idle.clone());
        }
        let conn = make().await?;
        slot.push(conn.clone());
        Ok(conn)
    }

    /// Every pooled connection (to close them), emptying the pool.
    pub(crate) fn drain(&self) -> Vec<Arc<C>> {
        let slots: Vec<_> = self.slots.lock().unwrap_or_else(|e| e.into_inner()).drain().map(|(_, s)| s).collect();
        slots.into_iter().filter_map(|s| s.try_lock().ok().map(|mut s| std::mem::take(&mut *s))).flatten().collect()
    }
}
