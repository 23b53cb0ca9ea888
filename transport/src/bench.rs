//! Goodput measurements for `kvfleet bench migration`: QUIC (what migrations use) against a raw
//! TCP baseline measured the same way on the same host.
//!
//! Both sides are plain library functions so the CLI can run the sink in one process and the
//! sender in another ([`serve_sink`] runs until the process ends and reports its address through
//! `ready`), or both in one process ([`tcp_sink`], [`quic_sink`] spawn it).
//!
//! # What is measured
//!
//! The sender splits `bytes` over `streams` parallel streams (TCP: one connection each; QUIC: one
//! connection, that many streams, each carrying length-prefixed frames of `chunk_bytes` as the
//! migration's data streams do). The clock starts once connected (handshakes excluded) and stops
//! when the receiver has acknowledged every byte, so buffered-but-undelivered data never counts.
//! Goodput counts payload bytes only.
//!
//! # Measured (2-core shared VM, loopback, two processes, 1–2 GiB, 4 MiB frames, 4 streams)
//!
//! Raw TCP 19–39 Gbit/s; raw UDP with GSO/GRO (1452-byte datagrams) 19–31 Gbit/s. QUIC (quinn
//! 0.11, TLS 1.3 AES-128-GCM, default [`QuicTuning`]): 11–18 Gbit/s; **QUIC / best UDP
//! 0.45–0.70** (median 0.58) over nine `kvfleet bench migration` runs in session 7 (0.31–0.63,
//! median 0.46 in session 6; 0.20–0.31 in session 4). Sender and receiver each run at 87–103 % of
//! a core: goodput is CPU per byte.
//!
//! What mattered, largest first:
//! - the datagram size: the path's MTU (loopback: 65 507-byte datagrams, found by MTU discovery
//!   up to the route's interface MTU) against 1452 bytes: ×2.5–4 (per-packet work divided);
//! - UDP segmentation offload (GSO), at 1452 bytes: off → 0.7 Gbit/s, on → 2.4 (×3.4);
//! - the payload handed to quinn whole ([`crate::SendHalf::write_chunk`]) instead of copied into
//!   its send buffer: that copy was 18 % of the sender's CPU, and a 512 MiB send buffer of copies
//!   evicted everything from the cache; with it gone, 8.7–9.2 → 13–15 Gbit/s;
//! - received payloads kept as quinn's buffers ([`crate::RecvHalf::read_chunk`],
//!   [`crate::FrameReader::recv_with_payload`]) instead of read into the frame buffer: that copy
//!   was ~22 % of the receiver's CPU; 14.5 → 18.0 Gbit/s (mean of four alternated pairs, won 4/4);
//! - flow control below the receiver's socket buffer: with a 512 MiB connection window over a
//!   32 MiB UDP receive buffer the (now faster) sender overran a CPU-bound receiver, which dropped
//!   12–15 % of all packets; a 64 MiB window over a 64 MiB buffer: no loss, +20 %;
//! - a reader that never reads past the frame it is filling (a capacity-sized overshoot was
//!   copied again when the buffer grew for the next 4 MiB frame);
//! - GSO batches within one 64 KiB send: quinn batches 10 datagrams, and the kernel refuses (and
//!   quinn-udp silently drops) a batch above 64 KiB, so 9000-byte datagrams once lost a third of
//!   all packets and tripped black-hole detection; the endpoint's socket now splits such batches;
//! - a current-thread runtime per process: +10–25 % over a 2-worker runtime (fewer cross-thread
//!   wake-ups between the endpoint driver, the connection and the stream tasks);
//! - not the congestion controller once nothing was lost (Cubic ≈ NewReno ≥ BBR), nor send
//!   fairness or 1 vs 4 MiB frames, within the noise of a shared host.
//!
//! What is left (perf, both processes, session 7): nothing of ours. AES-GCM 30–32 % of each side
//! (ring's VAES-AVX2 code, as fast as this CPU goes); the kernel's UDP copies (11–15 %); quinn's
//! packet assembly copy on the sender (~17 %) and its copy of every received datagram batch into
//! a new buffer on the receiver (~18 %, `quinn::endpoint::RecvState::poll_socket`). Each side's
//! endpoint thread does all of its side's per-byte work, and the two fill this host's two cores.

use crate::frame::{FrameReader, FrameWriter};
use crate::quic::{QuicTransport, QuicTuning};
use crate::{KvConnection, KvTransport, TransportError};
use bytes::Bytes;
use kvfleet_pki::NodeIdentity;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::task::JoinSet;
use tracing::{debug, warn};

/// TCP socket buffers requested for the baseline (the kernel may cap them).
pub const TCP_SOCKET_BUFFER_BYTES: u32 = 4 << 20;
/// Default QUIC frame payload: one 32B-model KV block (16 tokens × 256 KiB).
pub const DEFAULT_CHUNK_BYTES: usize = 4 << 20;
/// TCP read/write granularity.
const TCP_IO_BYTES: usize = 1 << 20;

/// A measured transfer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Goodput {
    /// Payload bytes acknowledged by the receiver.
    pub bytes: u64,
    /// Seconds from the first byte sent to the last acknowledgement.
    pub elapsed_s: f64,
}

impl Goodput {
    /// Goodput in Gbit/s (10⁹ bits per second).
    pub fn gbit_per_s(&self) -> f64 {
        if self.elapsed_s > 0.0 {
            self.bytes as f64 * 8.0 / self.elapsed_s / 1e9
        } else {
            0.0
        }
    }
}

/// Which sink to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SinkKind {
    /// Raw TCP (the baseline).
    Tcp,
    /// QUIC with the cluster's mutual TLS.
    Quic,
    /// Raw UDP datagrams with GSO/GRO ([`crate::bench_udp`]).
    Udp,
}

/// What went wrong in a benchmark, naming the step.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// An I/O step failed.
    #[error("{what}: {cause}")]
    Io {
        /// The step.
        what: String,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// The KV transport failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A frame could not be read or written.
    #[error("frames: {0}")]
    Frame(#[from] crate::FrameError),
    /// The peer broke the benchmark's protocol (short transfer, missing report).
    #[error("{0}")]
    Protocol(String),
    /// A QUIC benchmark was started without a cluster identity.
    #[error("a QUIC sink or sender needs a cluster identity")]
    NoIdentity,
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BenchError {
    let what = what.into();
    move |cause| BenchError::Io { what, cause }
}

/// One data frame of the QUIC benchmark (a stand-in for a KV block frame).
#[derive(Clone, PartialEq, prost::Message)]
pub struct BenchChunk {
    /// Payload (decoded zero-copy from the frame buffer).
    #[prost(bytes = "bytes", tag = "1")]
    pub data: Bytes,
}

impl BenchChunk {
    /// The field number of `data`.
    pub const DATA_TAG: u32 = 1;
}

/// The receiver's acknowledgement of one stream.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BenchAck {
    /// Payload bytes received on the stream.
    #[prost(uint64, tag = "1")]
    pub bytes: u64,
}

/// A sink running in a background task of this process; stops when dropped.
#[derive(Debug)]
pub struct SinkHandle {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<Result<(), BenchError>>,
}

impl SinkHandle {
    /// Where senders connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for SinkHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Run a sink at `listen` until the process ends (or binding/accepting fails); `ready` gets the
/// bound address once it accepts. A QUIC sink needs `identity`.
pub async fn serve_sink(
    kind: SinkKind,
    listen: SocketAddr,
    identity: Option<&NodeIdentity>,
    tuning: QuicTuning,
    ready: impl FnOnce(SocketAddr),
) -> Result<(), BenchError> {
    match kind {
        SinkKind::Tcp => {
            let listener = TcpListener::bind(listen).await.map_err(io_err(format!("binding TCP {listen}")))?;
            ready(listener.local_addr().map_err(io_err("TCP local address"))?);
            serve_tcp(listener).await
        }
        SinkKind::Quic => {
            let transport = QuicTransport::bind(listen, identity.ok_or(BenchError::NoIdentity)?, tuning)?;
            ready(transport.local_addr());
            serve_quic(transport).await
        }
        SinkKind::Udp => crate::bench_udp::serve_udp(listen, ready).await,
    }
}

/// A TCP sink in a background task.
pub async fn tcp_sink(listen: SocketAddr) -> Result<SinkHandle, BenchError> {
    let listener = TcpListener::bind(listen).await.map_err(io_err(format!("binding TCP {listen}")))?;
    let addr = listener.local_addr().map_err(io_err("TCP local address"))?;
    Ok(SinkHandle { addr, task: tokio::spawn(serve_tcp(listener)) })
}

/// A QUIC sink in a background task.
pub async fn quic_sink(
    listen: SocketAddr,
    identity: &NodeIdentity,
    tuning: QuicTuning,
) -> Result<SinkHandle, BenchError> {
    let transport = QuicTransport::bind(listen, identity, tuning)?;
    let addr = transport.local_addr();
    Ok(SinkHandle { addr, task: tokio::spawn(serve_quic(transport)) })
}

fn tune_tcp(stream: &TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        debug!(error = %e, "TCP_NODELAY");
    }
}

async fn serve_tcp(listener: TcpListener) -> Result<(), BenchError> {
    loop {
        let (stream, peer) = listener.accept().await.map_err(io_err("accepting TCP"))?;
        tune_tcp(&stream);
        let sock = socket2::SockRef::from(&stream);
        let _ = sock.set_recv_buffer_size(TCP_SOCKET_BUFFER_BYTES as usize);
        tokio::spawn(async move {
            if let Err(e) = tcp_receive(stream).await {
                warn!(%peer, error = %e, "TCP sink connection failed");
            }
        });
    }
}

/// Per transfer: a u64 length, that many bytes, answered with a u64 count. Repeats until EOF.
async fn tcp_receive(mut stream: TcpStream) -> Result<(), BenchError> {
    let mut buf = vec![0u8; TCP_IO_BYTES];
    loop {
        let mut len = [0u8; 8];
        match stream.read_exact(&mut len).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(io_err("reading a TCP transfer header")(e)),
        }
        let want = u64::from_be_bytes(len);
        let mut got = 0u64;
        while got < want {
            let n = stream.read(&mut buf).await.map_err(io_err("reading TCP data"))?;
            if n == 0 {
                return Err(BenchError::Protocol(format!("TCP sender stopped after {got} of {want} bytes")));
            }
            got += n as u64;
        }
        stream.write_all(&got.to_be_bytes()).await.map_err(io_err("writing the TCP ack"))?;
    }
}

async fn serve_quic(transport: QuicTransport) -> Result<(), BenchError> {
    loop {
        let conn = transport.accept().await?;
        tokio::spawn(async move {
            loop {
                let (w, r) = match conn.accept_stream().await {
                    Ok(s) => s,
                    Err(e) => {
                        debug!(peer = %conn.peer(), error = %e, "QUIC sink connection ended");
                        return;
                    }
                };
                let peer = conn.peer();
                tokio::spawn(async move {
                    if let Err(e) = quic_receive(w, r).await {
                        warn!(%peer, error = %e, "QUIC sink stream failed");
                    }
                });
            }
        });
    }
}

async fn quic_receive(w: crate::StreamWriter, r: crate::StreamReader) -> Result<(), BenchError> {
    let mut reader = FrameReader::new(r);
    let mut bytes = 0u64;
    // The payload stays in the buffers it arrived in (as a migration's KV blocks do).
    while let Some((chunk, payload)) = reader.recv_with_payload::<BenchChunk>(&[BenchChunk::DATA_TAG]).await? {
        bytes += payload.map_or(chunk.data.len(), |p| p.len()) as u64;
    }
    let mut writer = FrameWriter::new(w);
    writer.send(&BenchAck { bytes }).await?;
    writer.finish().await?;
    Ok(())
}

/// Split `bytes` over `streams` (the first ones get the remainder).
fn shares(bytes: u64, streams: usize) -> Vec<u64> {
    let n = streams.max(1) as u64;
    (0..n).map(|i| bytes / n + u64::from(i < bytes % n)).collect()
}

/// Send `bytes` over `streams` TCP connections to a [`SinkKind::Tcp`] sink.
pub async fn tcp_send(peer: SocketAddr, bytes: u64, streams: usize) -> Result<Goodput, BenchError> {
    let mut conns = Vec::new();
    for _ in 0..streams.max(1) {
        let socket = if peer.is_ipv4() { TcpSocket::new_v4() } else { TcpSocket::new_v6() }
            .map_err(io_err("creating a TCP socket"))?;
        let _ = socket.set_send_buffer_size(TCP_SOCKET_BUFFER_BYTES);
        let _ = socket.set_recv_buffer_size(TCP_SOCKET_BUFFER_BYTES);
        let stream = socket.connect(peer).await.map_err(io_err(format!("connecting TCP to {peer}")))?;
        tune_tcp(&stream);
        conns.push(stream);
    }
    let data: Arc<[u8]> = (0..TCP_IO_BYTES).map(|i| i as u8).collect();
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    for (mut stream, share) in conns.into_iter().zip(shares(bytes, streams)) {
        let data = data.clone();
        tasks.spawn(async move {
            stream.write_all(&share.to_be_bytes()).await.map_err(io_err("writing TCP header"))?;
            let mut left = share;
            while left > 0 {
                let n = (left as usize).min(data.len());
                stream.write_all(&data[..n]).await.map_err(io_err("writing TCP data"))?;
                left -= n as u64;
            }
            let mut ack = [0u8; 8];
            stream.read_exact(&mut ack).await.map_err(io_err("reading the TCP ack"))?;
            check_ack(u64::from_be_bytes(ack), share)
        });
    }
    let acked = join_all(tasks).await?;
    Ok(Goodput { bytes: acked, elapsed_s: start.elapsed().as_secs_f64() })
}

fn check_ack(acked: u64, sent: u64) -> Result<u64, BenchError> {
    if acked == sent {
        Ok(acked)
    } else {
        Err(BenchError::Protocol(format!("receiver acknowledged {acked} of {sent} bytes")))
    }
}

async fn join_all(mut tasks: JoinSet<Result<u64, BenchError>>) -> Result<u64, BenchError> {
    let mut total = 0;
    while let Some(r) = tasks.join_next().await {
        total += r.map_err(|e| BenchError::Protocol(format!("sender task failed: {e}")))??;
    }
    Ok(total)
}

/// [`quic_send_measured`]'s goodput with the default tuning.
pub async fn quic_send(
    peer: SocketAddr,
    identity: &NodeIdentity,
    bytes: u64,
    streams: usize,
    chunk_bytes: usize,
) -> Result<Goodput, BenchError> {
    Ok(quic_send_measured(peer, identity, QuicTuning::default(), bytes, streams, chunk_bytes).await?.goodput)
}

/// A QUIC transfer and what its connection's path saw.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QuicRun {
    /// Bytes moved and the time they took.
    pub goodput: Goodput,
    /// The datagram size MTU discovery reached (UDP payload bytes).
    pub datagram_bytes: u16,
    /// Packets sent.
    pub sent_packets: u64,
    /// Packets declared lost by the sender.
    pub lost_packets: u64,
}

/// Send `bytes` over one QUIC connection with `streams` parallel streams of `chunk_bytes`
/// frames to a [`SinkKind::Quic`] sink.
pub async fn quic_send_measured(
    peer: SocketAddr,
    identity: &NodeIdentity,
    tuning: QuicTuning,
    bytes: u64,
    streams: usize,
    chunk_bytes: usize,
) -> Result<QuicRun, BenchError> {
    let local = SocketAddr::new(
        if peer.is_ipv4() { IpAddr::V4(Ipv4Addr::UNSPECIFIED) } else { IpAddr::V6(Ipv6Addr::UNSPECIFIED) },
        0,
    );
    let transport = QuicTransport::bind(local, identity, tuning)?;
    let qconn = transport.connect_quic(peer).await?;
    let conn: Arc<dyn KvConnection> = qconn.clone();
    let chunk: Bytes = (0..chunk_bytes.max(1)).map(|i| (i % 251) as u8).collect();
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    for share in shares(bytes, streams) {
        let conn: Arc<dyn KvConnection> = conn.clone();
        let chunk = chunk.clone();
        tasks.spawn(async move {
            let (w, r) = conn.open_stream().await?;
            let mut writer = FrameWriter::new(w);
            let mut left = share;
            while left > 0 {
                let n = (left as usize).min(chunk.len());
                // The payload goes to the stream whole, uncopied (as a migration's KV blocks do).
                writer.send_with_payload(&BenchChunk::default(), &[BenchChunk::DATA_TAG], chunk.slice(..n)).await?;
                left -= n as u64;
            }
            writer.finish().await?;
            let ack: Option<BenchAck> = FrameReader::new(r).recv().await?;
            let ack = ack.ok_or_else(|| BenchError::Protocol("QUIC sink closed the stream without an ack".into()))?;
            check_ack(ack.bytes, share)
        });
    }
    let acked = join_all(tasks).await;
    let elapsed_s = start.elapsed().as_secs_f64();
    // Losses, congestion events and the path MTU explain a poor run (RUST_LOG=debug).
    debug!(stats = ?qconn.quinn().stats(), "QUIC benchmark connection");
    let path = qconn.quinn().stats().path;
    conn.close("benchmark done");
    transport.close();
    Ok(QuicRun {
        goodput: Goodput { bytes: acked?, elapsed_s },
        datagram_bytes: path.current_mtu,
        sent_packets: path.sent_packets,
        lost_packets: path.lost_packets,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_split_exactly() {
        assert_eq!(shares(10, 3), vec![4, 3, 3]);
        assert_eq!(shares(10, 0), vec![10]);
        assert_eq!(shares(2, 4), vec![1, 1, 0, 0]);
        assert_eq!(shares(u64::MAX, 7).iter().map(|&s| u128::from(s)).sum::<u128>(), u128::from(u64::MAX));
    }

    #[test]
    fn goodput_in_gbit() {
        assert_eq!(Goodput { bytes: 1_250_000_000, elapsed_s: 1.0 }.gbit_per_s(), 10.0);
        assert_eq!(Goodput { bytes: 5, elapsed_s: 0.0 }.gbit_per_s(), 0.0);
    }
}
