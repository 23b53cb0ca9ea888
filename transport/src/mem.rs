//! An in-memory transport for tests: endpoints on a [`MemNetwork`] hub, streams over
//! `tokio::io::duplex` pipes.
//!
//! Real enough to find bugs: streams have bounded buffers (backpressure), a writer's shutdown is
//! the reader's EOF, a dropped reader makes the writer fail, and a link can be cut
//! ([`MemConnection::sever`], [`MemNetwork::drop_peer`]) so that every pending and later read and
//! write on both sides fails with `NotConnected`, as quinn's do (a lost connection is an error, never a clean
//! EOF that could pass for a finished transfer).
//!
//! Each direction of a stream is its own duplex pipe of which only one direction is used, so
//! that dropping one half closes exactly that direction, as QUIC's independent halves do.

use crate::{BoxFuture, ConnectionPool, KvConnection, KvStream, KvTransport, TransportError};
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use tokio::io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf};
use tokio::sync::mpsc;

/// Buffer of each stream direction (bytes in flight before the writer waits).
pub const MEM_STREAM_BUFFER_BYTES: usize = 8 << 20;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The hub endpoints register on, by address.
#[derive(Clone, Default)]
pub struct MemNetwork {
    inner: Arc<Mutex<Hub>>,
}

#[derive(Default)]
struct Hub {
    listeners: HashMap<SocketAddr, Listener>,
    next_port: u16,
    next_id: u64,
}

struct Listener {
    /// Which [`MemTransport`] registered it (an address can be re-bound after a drop).
    id: u64,
    incoming: mpsc::UnboundedSender<Arc<MemConnection>>,
    /// Every connection of this endpoint (both directions), to sever them when it goes away.
    links: Vec<Weak<Link>>,
}

impl std::fmt::Debug for MemNetwork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemNetwork").field("endpoints", &lock(&self.inner).listeners.len()).finish()
    }
}

impl MemNetwork {
    /// An empty network.
    pub fn new() -> MemNetwork {
        MemNetwork::default()
    }

    /// Register an endpoint at `addr`; port 0 picks a free port (on `addr`'s IP).
    pub fn bind(&self, addr: SocketAddr) -> Result<MemTransport, TransportError> {
        let mut hub = lock(&self.inner);
        let mut addr = addr;
        if addr.port() == 0 {
            let free = (0..=u16::MAX).find_map(|_| {
                hub.next_port = hub.next_port.wrapping_add(1).max(10_000);
                let candidate = SocketAddr::new(addr.ip(), hub.next_port);
                (!hub.listeners.contains_key(&candidate)).then_some(candidate)
            });
            addr = free.ok_or(TransportError::Bind { addr, reason: "no free port left on this MemNetwork".into() })?;
        } else if hub.listeners.contains_key(&addr) {
            return Err(TransportError::Bind { addr, reason: "address already in use on this MemNetwork".into() });
        }
        let (tx, rx) = mpsc::unbounded_channel();
        hub.next_id += 1;
        let id = hub.next_id;
        hub.listeners.insert(addr, Listener { id, incoming: tx, links: Vec::new() });
        Ok(MemTransport {
            net: self.clone(),
            addr,
            id,
            incoming: tokio::sync::Mutex::new(rx),
            pool: ConnectionPool::default(),
            closed: AtomicBool::new(false),
        })
    }

    /// An endpoint on 127.0.0.1 with a fresh port (for tests).
    ///
    /// # Panics
    /// When all 55 535 ports from 10 000 up are taken.
    pub fn bind_any(&self) -> MemTransport {
        self.bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0)).expect("a free port on the MemNetwork")
    }

    /// Simulate `peer` crashing: unregister it and sever every connection it has.
    pub fn drop_peer(&self, peer: SocketAddr) {
        let listener = lock(&self.inner).listeners.remove(&peer);
        if let Some(listener) = listener {
            for link in listener.links.iter().filter_map(Weak::upgrade) {
                link.sever(&format!("peer {peer} dropped from the network"));
            }
        }
    }

    fn track(&self, addr: SocketAddr, link: &Arc<Link>) {
        if let Some(l) = lock(&self.inner).listeners.get_mut(&addr) {
            l.links.retain(|w| w.strong_count() > 0);
            l.links.push(Arc::downgrade(link));
        }
    }
}

/// One endpoint on a [`MemNetwork`].
pub struct MemTransport {
    net: MemNetwork,
    addr: SocketAddr,
    id: u64,
    incoming: tokio::sync::Mutex<mpsc::UnboundedReceiver<Arc<MemConnection>>>,
    pool: ConnectionPool<MemConnection>,
    closed: AtomicBool,
}

impl std::fmt::Debug for MemTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemTransport").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl MemTransport {
    /// Like [`KvTransport::connect`], returning the concrete connection (to `sever` it).
    pub async fn connect_mem(&self, peer: SocketAddr) -> Result<Arc<MemConnection>, TransportError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(TransportError::EndpointClosed { local: self.addr });
        }
        self.pool.get_or_connect(peer, |c| !c.is_closed(), || async { self.dial(peer) }).await
    }

    fn dial(&self, peer: SocketAddr) -> Result<Arc<MemConnection>, TransportError> {
        let link = Arc::new(Link {
            severed: AtomicBool::new(false),
            severed_tx: tokio::sync::watch::Sender::new(false),
            reason: Mutex::new(None),
            wakers: Mutex::default(),
        });
        let (to_server, server_streams) = mpsc::unbounded_channel();
        let (to_client, client_streams) = mpsc::unbounded_channel();
        let client = Arc::new(MemConnection::new(peer, link.clone(), to_server, client_streams));
        let server = Arc::new(MemConnection::new(self.addr, link.clone(), to_client, server_streams));
        {
            let hub = lock(&self.net.inner);
            let listener = hub.listeners.get(&peer).ok_or(TransportError::Unreachable { peer })?;
            listener.incoming.send(server).map_err(|_| TransportError::Unreachable { peer })?;
        }
        self.net.track(self.addr, &link);
        self.net.track(peer, &link);
        Ok(client)
    }
}

impl KvTransport for MemTransport {
    fn connect(&self, peer: SocketAddr) -> BoxFuture<'_, Result<Arc<dyn KvConnection>, TransportError>> {
        Box::pin(async move { Ok(self.connect_mem(peer).await? as Arc<dyn KvConnection>) })
    }

    fn accept(&self) -> BoxFuture<'_, Result<Arc<dyn KvConnection>, TransportError>> {
        Box::pin(async move {
            let mut incoming = self.incoming.lock().await;
            match incoming.recv().await {
                Some(c) if !self.closed.load(Ordering::Acquire) => Ok(c as Arc<dyn KvConnection>),
                _ => Err(TransportError::EndpointClosed { local: self.addr }),
            }
        })
    }

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        for c in self.pool.drain() {
            c.close("transport closed");
        }
        // Unregistering drops the hub's sender, which ends pending `accept`s, and severs the
        // connections accepted here.
        self.net.drop_peer(self.addr);
    }
}

impl Drop for MemTransport {
    /// Unregister (no new connections); established connections live on, as with QUIC.
    fn drop(&mut self) {
        let mut hub = lock(&self.net.inner);
        if hub.listeners.get(&self.addr).is_some_and(|l| l.id == self.id) {
            hub.listeners.remove(&self.addr);
        }
    }
}

/// The shared fate of a connection's two ends.
struct Link {
    severed: AtomicBool,
    /// Flips to true on sever (for `accept_stream`, which waits on a channel, not a pipe).
    severed_tx: tokio::sync::watch::Sender<bool>,
    reason: Mutex<Option<String>>,
    /// Tasks blocked on a pipe of this link, woken when it is severed.
    wakers: Mutex<Vec<Weak<Mutex<Option<Waker>>>>>,
}

impl Link {
    fn sever(&self, reason: &str) {
        lock(&self.reason).get_or_insert_with(|| reason.to_string());
        self.severed.store(true, Ordering::Release);
        self.severed_tx.send_replace(true);
        let wakers = std::mem::take(&mut *lock(&self.wakers));
        for w in wakers.iter().filter_map(Weak::upgrade) {
            if let Some(w) = lock(&w).take() {
                w.wake();
            }
        }
    }

    fn error(&self) -> io::Error {
        let reason = lock(&self.reason).clone().unwrap_or_default();
        io::Error::new(io::ErrorKind::NotConnected, format!("connection lost: {reason}"))
    }

    fn register(&self, slot: &Arc<Mutex<Option<Waker>>>) {
        let mut wakers = lock(&self.wakers);
        wakers.retain(|w| w.strong_count() > 0);
        wakers.push(Arc::downgrade(slot));
    }
}

/// One end of an in-memory connection.
pub struct MemConnection {
    peer: SocketAddr,
    link: Arc<Link>,
    to_peer: mpsc::UnboundedSender<KvStreamParts>,
    from_peer: tokio::sync::Mutex<mpsc::UnboundedReceiver<KvStreamParts>>,
}

type KvStreamParts = (MemPipe, MemPipe);

impl std::fmt::Debug for MemConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemConnection").field("peer", &self.peer).field("closed", &self.is_closed()).finish()
    }
}

impl MemConnection {
    fn new(
        peer: SocketAddr,
        link: Arc<Link>,
        to_peer: mpsc::UnboundedSender<KvStreamParts>,
        from_peer: mpsc::UnboundedReceiver<KvStreamParts>,
    ) -> MemConnection {
        MemConnection { peer, link, to_peer, from_peer: tokio::sync::Mutex::new(from_peer) }
    }

    /// Cut the link as a network failure would: every read and write on both ends fails with
    /// `NotConnected`, and both ends report `is_closed`.
    pub fn sever(&self) {
        self.link.sever("link severed");
    }

    fn pipe(&self, stream: DuplexStream) -> MemPipe {
        let waker = Arc::new(Mutex::new(None));
        self.link.register(&waker);
        MemPipe { stream, link: self.link.clone(), waker }
    }

    fn closed_error(&self, what: &'static str) -> TransportError {
        let reason = lock(&self.link.reason).clone().unwrap_or_else(|| "the peer dropped the connection".into());
        TransportError::Stream { peer: self.peer, what, reason }
    }
}

impl KvConnection for MemConnection {
    fn open_stream(&self) -> BoxFuture<'_, Result<KvStream, TransportError>> {
        Box::pin(async move {
            if self.is_closed() {
                return Err(self.closed_error("opening a stream"));
            }
            let (out_w, out_r) = tokio::io::duplex(MEM_STREAM_BUFFER_BYTES);
            let (in_w, in_r) = tokio::io::duplex(MEM_STREAM_BUFFER_BYTES);
            // The peer writes into `in_w` and reads from `out_r`.
            self.to_peer
                .send((self.pipe(in_w), self.pipe(out_r)))
                .map_err(|_| self.closed_error("opening a stream"))?;
            Ok((Box::new(self.pipe(out_w)) as _, Box::new(self.pipe(in_r)) as _))
        })
    }

    fn accept_stream(&self) -> BoxFuture<'_, Result<KvStream, TransportError>> {
        Box::pin(async move {
            let mut severed = self.link.severed_tx.subscribe();
            let mut from_peer = self.from_peer.lock().await;
            tokio::select! {
                biased;
                _ = severed.wait_for(|s| *s) => Err(self.closed_error("accepting a stream")),
                s = from_peer.recv() => match s {
                    Some((w, r)) if !self.is_closed() => Ok((Box::new(w) as _, Box::new(r) as _)),
                    _ => Err(self.closed_error("accepting a stream")),
                },
            }
        })
    }

    fn peer(&self) -> SocketAddr {
        self.peer
    }

    fn close(&self, reason: &str) {
        self.link.sever(&format!("closed: {reason}"));
    }

    fn is_closed(&self) -> bool {
        self.link.severed.load(Ordering::Acquire)
    }
}

/// One direction of a stream: a duplex end that fails once its link is severed.
struct MemPipe {
    stream: DuplexStream,
    link: Arc<Link>,
    waker: Arc<Mutex<Option<Waker>>>,
}

impl MemPipe {
    fn check(&self) -> io::Result<()> {
        if self.link.severed.load(Ordering::Acquire) {
            Err(self.link.error())
        } else {
            Ok(())
        }
    }

    /// Arrange to be woken on sever while the pipe itself is pending.
    fn park<T>(&self, cx: &Context<'_>) -> Poll<io::Result<T>> {
        *lock(&self.waker) = Some(cx.waker().clone());
        match self.check() {
            Err(e) => Poll::Ready(Err(e)),
            Ok(()) => Poll::Pending,
        }
    }
}

impl AsyncRead for MemPipe {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        self.check()?;
        match Pin::new(&mut self.stream).poll_read(cx, buf) {
            Poll::Pending => self.park(cx),
            // A clean EOF from a severed link must not look like the end of a transfer.
            Poll::Ready(Ok(())) => Poll::Ready(self.check()),
            other => other,
        }
    }
}

impl crate::SendHalf for MemPipe {}
impl crate::RecvHalf for MemPipe {}

impl AsyncWrite for MemPipe {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.check()?;
        match Pin::new(&mut self.stream).poll_write(cx, buf) {
            Poll::Pending => self.park(cx),
            other => other,
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.check()?;
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.check()?;
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
