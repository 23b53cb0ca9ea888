//! Behaviour every `KvTransport` must show, run against the in-memory and the QUIC transport.
#![allow(dead_code)]

use bytes::Bytes;
use kvfleet_transport::{FrameError, FrameReader, FrameWriter, KvConnection, KvTransport, StreamReader, StreamWriter};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A frame shaped like a KV transfer frame.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TestFrame {
    #[prost(uint64, tag = "1")]
    pub seq: u64,
    #[prost(bytes = "bytes", tag = "2")]
    pub data: Bytes,
}

/// A receiver's summary of one stream.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TestAck {
    #[prost(uint64, tag = "1")]
    pub frames: u64,
    #[prost(uint64, tag = "2")]
    pub bytes: u64,
    #[prost(uint64, tag = "3")]
    pub checksum: u64,
}

/// Safety net only: a hang fails the test instead of blocking the run.
pub async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    match tokio::time::timeout(Duration::from_secs(30), f).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: timed out (hang)"),
    }
}

/// Deterministic content: stream `s`, frame `i`, `len` bytes.
pub fn payload(s: u64, i: u64, len: usize) -> Bytes {
    let seed = s.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    (0..len).map(|k| (seed.wrapping_add(k as u64).wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8).collect()
}

/// FNV-1a over the bytes, chained.
pub fn checksum(mut h: u64, data: &[u8]) -> u64 {
    if h == 0 {
        h = 0xcbf2_9ce4_8422_2325;
    }
    for b in data {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Serve every connection and stream: echo frames back until EOF, then finish.
pub fn spawn_echo_server(server: Arc<dyn KvTransport>) -> tokio::task::JoinHandle<()> {
    spawn_counting_echo_server(server).0
}

/// [`spawn_echo_server`], counting the connections it accepts.
pub fn spawn_counting_echo_server(server: Arc<dyn KvTransport>) -> (tokio::task::JoinHandle<()>, Arc<AtomicUsize>) {
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    let task = tokio::spawn(async move {
        while let Ok(conn) = server.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                while let Ok((w, r)) = conn.accept_stream().await {
                    tokio::spawn(echo(w, r));
                }
            });
        }
    });
    (task, accepted)
}

async fn echo(w: StreamWriter, r: StreamReader) -> Result<(), FrameError> {
    let mut reader = FrameReader::new(r);
    let mut writer = FrameWriter::new(w);
    while let Some(f) = reader.recv::<TestFrame>().await? {
        writer.send(&f).await?;
    }
    writer.finish().await
}

/// Serve every connection and stream: summarise each stream in a `TestAck` after its EOF.
pub fn spawn_ack_server(server: Arc<dyn KvTransport>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Ok(conn) = server.accept().await {
            tokio::spawn(async move {
                while let Ok((w, r)) = conn.accept_stream().await {
                    tokio::spawn(async move {
                        let mut reader = FrameReader::new(r);
                        let mut ack = TestAck::default();
                        while let Some(f) = reader.recv::<TestFrame>().await? {
                            ack.frames += 1;
                            ack.bytes += f.data.len() as u64;
                            ack.checksum = checksum(ack.checksum, &f.data);
                        }
                        let mut writer = FrameWriter::new(w);
                        writer.send(&ack).await?;
                        writer.finish().await?;
                        Ok::<_, FrameError>(())
                    });
                }
            });
        }
    })
}

/// Frames of assorted sizes (empty, tiny, a 4 MiB KV block) come back byte for byte.
pub async fn echo_round_trip(client: &dyn KvTransport, server_addr: SocketAddr) {
    let conn = within("connect", client.connect(server_addr)).await.expect("connect");
    assert_eq!(conn.peer(), server_addr);
    let (w, r) = conn.open_stream().await.expect("open stream");
    let sizes = [0usize, 1, 1000, 4 << 20, 17];
    let sent: Vec<TestFrame> =
        sizes.iter().enumerate().map(|(i, &n)| TestFrame { seq: i as u64, data: payload(1, i as u64, n) }).collect();
    let to_send = sent.clone();
    let writer = tokio::spawn(async move {
        let mut writer = FrameWriter::new(w);
        for f in &to_send {
            writer.send(f).await?;
        }
        writer.finish().await
    });
    let mut reader = FrameReader::new(r);
    let mut got = Vec::new();
    while let Some(f) = within("echo", reader.recv::<TestFrame>()).await.expect("recv") {
        got.push(f);
    }
    writer.await.unwrap().expect("send");
    assert_eq!(got.len(), sent.len());
    for (g, s) in got.iter().zip(&sent) {
        assert_eq!(g.seq, s.seq);
        assert!(g.data == s.data, "frame {} differs ({} vs {} bytes)", s.seq, g.data.len(), s.data.len());
    }
}

/// `streams` concurrent streams on one connection, `frames` × `frame_bytes` each, all verified.
pub async fn concurrent_streams(
    client: &dyn KvTransport,
    server_addr: SocketAddr,
    streams: u64,
    frames: u64,
    frame_bytes: usize,
) {
    let conn = within("connect", client.connect(server_addr)).await.expect("connect");
    let mut tasks = tokio::task::JoinSet::new();
    for s in 0..streams {
        let conn: Arc<dyn KvConnection> = conn.clone();
        tasks.spawn(async move {
            let (w, r) = conn.open_stream().await.expect("open stream");
            let mut writer = FrameWriter::new(w);
            let mut expect = TestAck::default();
            for i in 0..frames {
                let data = payload(s, i, frame_bytes);
                expect.frames += 1;
                expect.bytes += data.len() as u64;
                expect.checksum = checksum(expect.checksum, &data);
                writer.send(&TestFrame { seq: i, data }).await.expect("send");
            }
            writer.finish().await.expect("finish");
            let ack: TestAck = FrameReader::new(r).recv().await.expect("ack").expect("an ack before EOF");
            assert_eq!(ack, expect, "stream {s}");
        });
    }
    within("concurrent streams", async {
        while let Some(r) = tasks.join_next().await {
            r.expect("stream task");
        }
    })
    .await;
}

/// A second connect reuses the live connection (also when racing); after close, a new one.
/// A connection serves one holder at a time (`client` has made no connection to the server yet):
/// two held at once are two connections, one given back is handed out again, a closed one never
/// is. `accepted` counts the connections the server at `server_addr` accepted
/// ([`spawn_counting_echo_server`]); an echo on each connection makes sure the server has seen it
/// before the count is read.
pub async fn connection_reuse(client: &dyn KvTransport, server_addr: SocketAddr, accepted: &AtomicUsize) {
    let before = accepted.load(Ordering::SeqCst);
    let made = || accepted.load(Ordering::SeqCst) - before;
    let (a, b) =
        within("connect", async { tokio::join!(client.connect(server_addr), client.connect(server_addr)) }).await;
    let (a, b) = (a.expect("connect"), b.expect("connect"));
    echo_on(&a, 1).await;
    echo_on(&b, 2).await;
    assert_eq!(made(), 2, "two holders at once shared a connection");
    drop(b);
    let c = within("connect again", client.connect(server_addr)).await.expect("connect again");
    echo_on(&c, 3).await;
    assert_eq!(made(), 2, "a connection given back was not reused");
    a.close("test closes it");
    assert!(a.is_closed());
    drop(a);
    // `c` is held and `a` is closed: a new one.
    let d = within("reconnect", client.connect(server_addr)).await.expect("reconnect");
    assert!(!d.is_closed(), "a closed connection was handed out again");
    echo_on(&d, 4).await;
    assert_eq!(made(), 3, "a closed connection was handed out again");
}

/// One frame echoed on a new stream of `conn`.
async fn echo_on(conn: &Arc<dyn KvConnection>, seq: u64) {
    let (w, r) = conn.open_stream().await.expect("open stream");
    let mut writer = FrameWriter::new(w);
    writer.send(&TestFrame { seq, data: payload(seq, seq, 100) }).await.expect("send");
    writer.finish().await.expect("finish");
    let echoed: TestFrame = within("echo", FrameReader::new(r).recv()).await.expect("recv").expect("a frame");
    assert_eq!(echoed.seq, seq);
}

/// The error a read or write of a lost connection must give (both transports use quinn's).
pub fn assert_lost(err: &FrameError, what: &str) {
    match err {
        FrameError::Io(e) if e.kind() == io::ErrorKind::NotConnected => {}
        other => panic!("{what}: expected a NotConnected I/O error, got {other:?}"),
    }
}

/// When the server closes the connection mid-stream, the client's pending read fails (an
/// error, not a clean EOF, and no hang), writes fail, and the connection reports closed.
pub async fn peer_close_fails_streams(client: &dyn KvTransport, server: Arc<dyn KvTransport>) {
    let server_addr = server.local_addr();
    let srv = tokio::spawn(async move {
        let conn = server.accept().await.expect("accept");
        let (_w, r) = conn.accept_stream().await.expect("accept stream");
        let mut reader = FrameReader::new(r);
        let first: TestFrame = reader.recv().await.expect("recv").expect("first frame");
        conn.close("server gives up");
        first.seq
    });
    let conn = within("connect", client.connect(server_addr)).await.expect("connect");
    let (w, r) = conn.open_stream().await.expect("open stream");
    let mut writer = FrameWriter::new(w);
    writer.send(&TestFrame { seq: 1, data: payload(1, 1, 10) }).await.expect("send");
    assert_eq!(within("server", srv).await.unwrap(), 1);
    let mut reader = FrameReader::new(r);
    let err = within("read after peer close", reader.recv::<TestFrame>()).await.expect_err("read must fail");
    assert_lost(&err, "read");
    assert!(conn.is_closed());
    let err = within("write after peer close", async {
        loop {
            if let Err(e) = writer.send(&TestFrame { seq: 2, data: payload(1, 2, 64 << 10) }).await {
                return e;
            }
        }
    })
    .await;
    assert_lost(&err, "write");
    assert!(within("accept stream", conn.accept_stream()).await.is_err());
    assert!(within("open stream", conn.open_stream()).await.is_err());
}

/// Closing the transport ends a pending accept with an error.
pub async fn close_ends_accept(server: Arc<dyn KvTransport>) {
    let s = server.clone();
    let pending = tokio::spawn(async move { s.accept().await.map(|_| ()) });
    tokio::task::yield_now().await;
    server.close();
    let r = within("accept after close", pending).await.unwrap();
    assert!(matches!(r, Err(kvfleet_transport::TransportError::EndpointClosed { .. })), "{r:?}");
}
