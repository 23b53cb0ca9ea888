//! The raw UDP-with-GSO baseline of `kvfleet bench migration`: what this host's kernel carries
//! between two processes in datagrams of QUIC's size, through the same I/O layer quinn uses
//! (`quinn-udp`: GSO on send, GRO on receive, 32 MiB socket buffers), with no protocol, no
//! encryption and no flow control.
//!
//! The sender blasts `bytes` in `segment`-byte datagrams, as many per `sendmsg` as GSO allows,
//! then asks for a report until it gets one. The receiver counts the bytes it read and the time
//! from the first to the last datagram; goodput is received bytes over that time, so datagrams
//! the receiver could not absorb (dropped at its socket) do not count. QUIC's goodput over this
//! is the cost of the protocol itself (packet assembly, AEAD, ACKs, flow control, copies) on this
//! host; the TCP baseline beside it shows what the kernel's own stack does with 64 KiB segments.

use crate::bench::{BenchError, Goodput};
use std::io::IoSliceMut;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::Interest;
use tokio::net::UdpSocket;

/// An Ethernet-path QUIC datagram (1500-byte MTU less IPv4, UDP and headroom); `kvfleet bench
/// migration` sends in the size QUIC's MTU discovery reached instead, so both move the same packets.
pub const DEFAULT_SEGMENT_BYTES: usize = 1452;
const SOCKET_BUFFER_BYTES: usize = 32 << 20;
const TAG_DATA: u8 = 0;
const TAG_END: u8 = 0xFF;
const TAG_REPORT: u8 = 0xFE;

/// What the receiver saw of one transfer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UdpReport {
    /// Bytes sent (datagram payloads, the tag byte included).
    pub sent: u64,
    /// Bytes received (datagram payloads, the tag byte included).
    pub received: u64,
    /// First to last data datagram at the receiver.
    pub elapsed_s: f64,
}

impl UdpReport {
    /// Bytes received over the receiver's elapsed time.
    pub fn goodput(&self) -> Goodput {
        Goodput { bytes: self.received, elapsed_s: self.elapsed_s }
    }

    /// Share of the sent bytes the receiver never read.
    pub fn loss(&self) -> f64 {
        1.0 - self.received as f64 / self.sent.max(1) as f64
    }
}

fn io(what: &str) -> impl FnOnce(std::io::Error) -> BenchError + '_ {
    move |cause| BenchError::Io { what: what.to_string(), cause }
}

fn socket(addr: SocketAddr) -> Result<(UdpSocket, quinn_udp::UdpSocketState), BenchError> {
    let std = crate::quic::udp_socket(addr, SOCKET_BUFFER_BYTES).map_err(io("binding a UDP socket"))?;
    std.set_nonblocking(true).map_err(io("a non-blocking UDP socket"))?;
    let state = quinn_udp::UdpSocketState::new((&std).into()).map_err(io("UDP GSO/GRO set-up"))?;
    Ok((UdpSocket::from_std(std).map_err(io("registering the UDP socket"))?, state))
}

/// Bind the receiver; `ready` gets its address. Serves transfers one after another, forever.
pub async fn serve_udp(listen: SocketAddr, ready: impl FnOnce(SocketAddr)) -> Result<(), BenchError> {
    let (sock, state) = socket(listen)?;
    ready(sock.local_addr().map_err(io("UDP local address"))?);
    let gro = state.gro_segments().max(1);
    let mut buf = vec![0u8; gro * 65_536];
    let (mut received, mut first, mut last) = (0u64, None::<Instant>, Instant::now());
    loop {
        let mut meta = [quinn_udp::RecvMeta::default()];
        let n = {
            let mut bufs = [IoSliceMut::new(&mut buf)];
            sock.async_io(Interest::READABLE, || state.recv((&sock).into(), &mut bufs, &mut meta))
                .await
                .map_err(io("receiving UDP"))?
        };
        if n == 0 {
            continue;
        }
        let m = meta[0];
        let stride = m.stride.max(1);
        let now = Instant::now();
        for seg in buf[..m.len].chunks(stride) {
            match seg.first() {
                Some(&TAG_DATA) => {
                    received += seg.len() as u64;
                    first.get_or_insert(now);
                    last = now;
                }
                Some(&TAG_END) => {
                    let elapsed = first.map_or(0, |f| last.duration_since(f).as_nanos() as u64);
                    let mut report = [0u8; 17];
                    report[0] = TAG_REPORT;
                    report[1..9].copy_from_slice(&received.to_be_bytes());
                    report[9..17].copy_from_slice(&elapsed.to_be_bytes());
                    sock.send_to(&report, m.addr).await.map_err(io("sending the UDP report"))?;
                    (received, first) = (0, None);
                }
                _ => {}
            }
        }
    }
}

/// Send `bytes` to a [`serve_udp`] receiver in `segment`-byte datagrams; its report.
pub async fn udp_send(peer: SocketAddr, bytes: u64, segment: usize) -> Result<UdpReport, BenchError> {
    let any: SocketAddr =
        if peer.is_ipv4() { ([127, 0, 0, 1], 0).into() } else { (std::net::Ipv6Addr::LOCALHOST, 0).into() };
    let (sock, state) = socket(any)?;
    let segment = segment.clamp(64, 65_507);
    // A GSO send is one UDP datagram to the kernel: at most 64 KiB in all (quinn-udp swallows the
    // EMSGSIZE of a larger one, as it does for MTU probes, so a too-large batch would vanish).
    let per_send = state.max_gso_segments().clamp(1, 65_507 / segment);
    let mut batch = vec![0u8; segment * per_send];
    for (i, b) in batch.iter_mut().enumerate() {
        *b = if i % segment == 0 { TAG_DATA } else { i as u8 };
    }
    let mut sent = 0u64;
    while sent < bytes {
        let left = (bytes - sent) as usize;
        let len = if left >= batch.len() { batch.len() } else { left.div_ceil(segment).min(per_send) * segment };
        let t = quinn_udp::Transmit {
            destination: peer,
            ecn: None,
            contents: &batch[..len],
            segment_size: (len > segment).then_some(segment),
            src_ip: None,
        };
        sock.async_io(Interest::WRITABLE, || state.send((&sock).into(), &t)).await.map_err(io("sending UDP"))?;
        sent += len as u64;
    }
    // The end marker can be lost like any datagram: repeat it until the report comes.
    let mut end = [0u8; 9];
    end[0] = TAG_END;
    end[1..].copy_from_slice(&sent.to_be_bytes());
    let mut report = [0u8; 64];
    for _ in 0..40 {
        sock.send_to(&end, peer).await.map_err(io("sending the UDP end marker"))?;
        if let Ok(r) = tokio::time::timeout(Duration::from_millis(50), sock.recv_from(&mut report)).await {
            let (n, _) = r.map_err(io("receiving the UDP report"))?;
            if n == 17 && report[0] == TAG_REPORT {
                let received = u64::from_be_bytes(report[1..9].try_into().expect("8 bytes"));
                let elapsed_ns = u64::from_be_bytes(report[9..17].try_into().expect("8 bytes"));
                return Ok(UdpReport { sent, received, elapsed_s: elapsed_ns as f64 / 1e9 });
            }
        }
    }
    Err(BenchError::Protocol(format!("no report from the UDP receiver at {peer} within 2 s")))
}

#[cfg(test)]
mod tests {
    use super::*;

    // Two threads: a sender blasting on a current-thread runtime would starve the receiver task.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_transfer_is_counted_by_the_receiver() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let sink = tokio::spawn(serve_udp("127.0.0.1:0".parse().unwrap(), move |a| {
            let _ = tx.send(a);
        }));
        let addr = rx.await.unwrap();
        let r = udp_send(addr, 8 << 20, DEFAULT_SEGMENT_BYTES).await.unwrap();
        assert!(r.sent >= 8 << 20);
        // Most of it arrives (a batch too large for GSO used to vanish without an error).
        assert!(r.received > r.sent / 10 && r.received <= r.sent, "{r:?}");
        assert!(r.elapsed_s >= 0.0 && r.loss() < 1.0, "{r:?}");
        // A second transfer starts from zero.
        let r2 = udp_send(addr, 1 << 20, DEFAULT_SEGMENT_BYTES).await.unwrap();
        assert!(r2.received <= r2.sent, "{r2:?}");
        sink.abort();
    }
}
