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
//!
//! The sealed variant ([`Seal::Aes128Gcm`]) applies the cipher QUIC negotiates here (TLS 1.3
//! AES-128-GCM, ring's code, as rustls uses) to every datagram in user space: the sender seals each
//! one with a per-datagram nonce, the receiver opens it and counts only those that authenticate.
//! QUIC's goodput over *that* is the protocol's own overhead with the cipher's set apart.

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
/// A sealed data datagram: tag, 8-byte packet number (the nonce), ciphertext, 16-byte AEAD tag.
const TAG_SEALED: u8 = 1;
const SEALED_HEADER: usize = 9;
const TAG_END: u8 = 0xFF;
/// The sealed baseline's key: fixed, both ends know it (the bench measures the work, not secrecy).
const BENCH_KEY: [u8; 16] = *b"kvfleet-udp-aead";

/// What happens to each datagram's payload on the way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Seal {
    /// Sent as it is.
    #[default]
    Plain,
    /// Sealed with AES-128-GCM by the sender and opened by the receiver, one nonce per datagram.
    Aes128Gcm,
}

fn bench_key() -> ring::aead::LessSafeKey {
    let key = ring::aead::UnboundKey::new(&ring::aead::AES_128_GCM, &BENCH_KEY).expect("a 16-byte AES-128 key");
    ring::aead::LessSafeKey::new(key)
}

fn nonce(packet: u64) -> ring::aead::Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&packet.to_be_bytes());
    ring::aead::Nonce::assume_unique_for_key(n)
}
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
    let key = bench_key();
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
        for seg in buf[..m.len].chunks_mut(stride) {
            match seg.first() {
                Some(&TAG_DATA) => {
                    received += seg.len() as u64;
                    first.get_or_insert(now);
                    last = now;
                }
                // Counted only once it authenticates (a forged or damaged one is not goodput).
                Some(&TAG_SEALED) if seg.len() >= SEALED_HEADER + ring::aead::MAX_TAG_LEN => {
                    let (head, body) = seg.split_at_mut(SEALED_HEADER);
                    let packet = u64::from_be_bytes(head[1..].try_into().expect("8 bytes"));
                    if key.open_in_place(nonce(packet), ring::aead::Aad::from(&head[..]), body).is_ok() {
                        received += (SEALED_HEADER + body.len()) as u64;
                        first.get_or_insert(now);
                        last = now;
                    }
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
    udp_send_sealed(peer, bytes, segment, Seal::Plain).await
}

/// [`udp_send`], each datagram's payload treated as `seal` says.
pub async fn udp_send_sealed(
    peer: SocketAddr,
    bytes: u64,
    segment: usize,
    seal: Seal,
) -> Result<UdpReport, BenchError> {
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
    let plain = batch.clone();
    let key = bench_key();
    let mut packet = 0u64;
    let mut sent = 0u64;
    while sent < bytes {
        let left = (bytes - sent) as usize;
        let len = if left >= batch.len() { batch.len() } else { left.div_ceil(segment).min(per_send) * segment };
        if seal == Seal::Aes128Gcm {
            // Every datagram of the batch sealed afresh (a new packet number each), from the
            // plaintext, as QUIC seals every packet it sends.
            for (dst, src) in batch[..len].chunks_mut(segment).zip(plain.chunks(segment)) {
                let body_len = dst.len() - SEALED_HEADER - ring::aead::MAX_TAG_LEN;
                let (head, rest) = dst.split_at_mut(SEALED_HEADER);
                head[0] = TAG_SEALED;
                head[1..].copy_from_slice(&packet.to_be_bytes());
                let (body, tag_out) = rest.split_at_mut(body_len);
                body.copy_from_slice(&src[SEALED_HEADER..SEALED_HEADER + body_len]);
                let tag = key
                    .seal_in_place_separate_tag(nonce(packet), ring::aead::Aad::from(&head[..]), body)
                    .map_err(|_| BenchError::Protocol("AES-128-GCM sealing failed".into()))?;
                tag_out.copy_from_slice(tag.as_ref());
                packet += 1;
            }
        }
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
        // Sealed: the receiver opens every datagram; those that authenticate count.
        let r3 = udp_send_sealed(addr, 8 << 20, DEFAULT_SEGMENT_BYTES, Seal::Aes128Gcm).await.unwrap();
        assert!(r3.received > r3.sent / 10 && r3.received <= r3.sent, "{r3:?}");
        sink.abort();
    }

    /// A sealed datagram opens with the bench key and its packet number only: one flipped bit
    /// anywhere, or another nonce, and it is refused.
    #[test]
    fn sealed_datagrams_authenticate() {
        let key = bench_key();
        let head = [TAG_SEALED, 0, 0, 0, 0, 0, 0, 0, 7];
        let mut body = b"kv block bytes".to_vec();
        let tag = key.seal_in_place_separate_tag(nonce(7), ring::aead::Aad::from(&head), &mut body).unwrap();
        body.extend_from_slice(tag.as_ref());
        let open = |n: u64, mut b: Vec<u8>| key.open_in_place(nonce(n), ring::aead::Aad::from(&head), &mut b).is_ok();
        assert!(open(7, body.clone()));
        assert!(!open(8, body.clone()));
        let mut bad = body.clone();
        bad[3] ^= 1;
        assert!(!open(7, bad));
    }
}
