//! The QUIC transport: the shared transport behaviour, mutual TLS, and lost connections.

mod common;

use common::*;
use kvfleet_pki::{ClusterCa, NodeIdentity, Role};
use kvfleet_transport::{
    quinn_client_config, quinn_configs, FrameReader, FrameWriter, KvTransport, QuicTransport, QuicTuning,
    TransportError,
};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn identity(ca: &ClusterCa, name: &str) -> NodeIdentity {
    ca.issue(Role::Worker, name, &[]).expect("issue a certificate")
}

fn pair_with(tuning: QuicTuning) -> (ClusterCa, Arc<QuicTransport>, Arc<QuicTransport>) {
    let ca = ClusterCa::generate("test").unwrap();
    let a = Arc::new(QuicTransport::bind(loopback(), &identity(&ca, "0"), tuning.clone()).unwrap());
    let b = Arc::new(QuicTransport::bind(loopback(), &identity(&ca, "1"), tuning).unwrap());
    (ca, a, b)
}

fn pair() -> (ClusterCa, Arc<QuicTransport>, Arc<QuicTransport>) {
    pair_with(QuicTuning::default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_is_byte_exact() {
    let (_ca, a, b) = pair();
    let _srv = spawn_echo_server(b.clone());
    echo_round_trip(a.as_ref(), b.local_addr()).await;
}

/// Only workers move KV: a cluster member with another role (a client's, a coordinator's
/// certificate) completes the TLS handshake but is closed before it can open a stream, and the
/// server never hands its connection to the migration code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kv_port_takes_worker_certificates_only() {
    let (ca, _a, b) = pair();
    let accepted = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let counter = accepted.clone();
    let server = b.clone();
    let _srv = tokio::spawn(async move {
        // Kept open: a dropped connection is closed, which the worker's stream below would see.
        let mut held = Vec::new();
        while let Ok(conn) = server.accept().await {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            held.push(conn);
        }
    });
    for role in [Role::Client, Role::Coordinator, Role::Operator] {
        let id = ca.issue(role, "not-a-worker", &[]).unwrap();
        let c = QuicTransport::bind(loopback(), &id, QuicTuning::default()).unwrap();
        let tried = tokio::time::timeout(Duration::from_secs(5), async {
            let conn = c.connect(b.local_addr()).await.map_err(|e| e.to_string())?;
            let (w, _r) = conn.open_stream().await.map_err(|e| e.to_string())?;
            let mut w = FrameWriter::new(w);
            let frame = common::TestFrame { seq: 1, data: vec![7u8; 1 << 20].into() };
            w.send(&frame).await.map_err(|e| e.to_string())?;
            w.finish().await.map_err(|e| e.to_string())?;
            tokio::time::sleep(Duration::from_millis(300)).await;
            conn.open_stream().await.map(|_| ()).map_err(|e| e.to_string())
        })
        .await;
        assert!(!matches!(tried, Ok(Ok(()))), "a {} certificate moved KV: {tried:?}", role.as_str());
    }
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 0, "no such connection reached accept");
    // A worker's is served as before.
    let w = QuicTransport::bind(loopback(), &identity(&ca, "2"), QuicTuning::default()).unwrap();
    let conn = w.connect(b.local_addr()).await.expect("a worker connects");
    conn.open_stream().await.expect("and opens a stream");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_arrive_intact() {
    let (_ca, a, b) = pair();
    let _srv = spawn_ack_server(b.clone());
    concurrent_streams(a.as_ref(), b.local_addr(), 8, 4, 1 << 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_reused_while_alive() {
    let (_ca, a, b) = pair();
    let (_srv, accepted) = spawn_counting_echo_server(b.clone());
    connection_reuse(a.as_ref(), b.local_addr(), &accepted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_close_fails_the_other_side() {
    let (_ca, a, b) = pair();
    peer_close_fails_streams(a.as_ref(), b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_the_transport_ends_accept() {
    let (_ca, _a, b) = pair();
    close_ends_accept(b).await;
}

/// Try a connection and one echoed frame; Ok only if the server really served us.
async fn try_exchange(client: &QuicTransport, server: SocketAddr) -> Result<(), String> {
    let conn = client.connect(server).await.map_err(|e| e.to_string())?;
    let (w, r) = conn.open_stream().await.map_err(|e| e.to_string())?;
    let mut writer = FrameWriter::new(w);
    writer.send(&TestFrame { seq: 1, data: payload(1, 1, 100) }).await.map_err(|e| e.to_string())?;
    writer.finish().await.map_err(|e| e.to_string())?;
    match FrameReader::new(r).recv::<TestFrame>().await {
        Ok(Some(f)) if f.seq == 1 => Ok(()),
        other => Err(format!("{other:?}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_cluster_members_can_exchange() {
    let (ca, a, b) = pair();
    let _srv = spawn_echo_server(b.clone());
    // A member works (so the failures below are about the certificates).
    within("member", try_exchange(&a, b.local_addr())).await.expect("a cluster member must get through");

    // A client whose certificate comes from another CA, although it trusts ours.
    let other = ClusterCa::generate("other").unwrap();
    let foreign = identity(&other, "intruder");
    let impostor = NodeIdentity { ca_pem: ca.cert_pem().to_string(), ..foreign.clone() };
    let c = QuicTransport::bind(loopback(), &impostor, QuicTuning::default()).unwrap();
    let err = within("foreign client cert", try_exchange(&c, b.local_addr())).await.expect_err("foreign cert");
    // The server closes the connection with the TLS alert naming the cause.
    assert!(err.contains("UnknownIssuer"), "{err}");

    // A client presenting no certificate at all.
    let mut roots = rustls::RootCertStore::empty();
    use rustls::pki_types::pem::PemObject;
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca.cert_pem().as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let anonymous = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tuning = QuicTuning::default();
    let (server_cfg, _) = quinn_configs(&identity(&ca, "2"), &tuning).unwrap();
    let client_cfg = quinn_client_config(anonymous, &tuning).unwrap();
    let d = QuicTransport::with_configs(loopback(), server_cfg, client_cfg, &tuning).unwrap();
    let err = within("no client cert", try_exchange(&d, b.local_addr())).await.expect_err("no cert");
    assert!(err.contains("no certificates"), "{err}");

    // A server from another CA is refused by our client at connect.
    let rogue = Arc::new(QuicTransport::bind(loopback(), &foreign, QuicTuning::default()).unwrap());
    let _rogue_srv = spawn_echo_server(rogue.clone());
    match within("rogue server", a.connect(rogue.local_addr())).await {
        Err(TransportError::Connect { peer, reason }) => {
            assert_eq!(peer, rogue.local_addr());
            assert!(reason.to_lowercase().contains("certificate") || reason.contains("issuer"), "{reason}");
        }
        other => panic!("expected a Connect error, got {:?}", other.map(|c| c.peer())),
    }
}

/// A UDP relay between a client and a server that can be cut, to lose a connection silently
/// (no CONNECTION_CLOSE reaches either side), as when a peer crashes or the path breaks.
async fn relay(server: SocketAddr) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let sock = tokio::net::UdpSocket::bind(loopback()).await.unwrap();
    let addr = sock.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut client = None;
        let mut buf = vec![0u8; 1 << 16];
        while let Ok((n, from)) = sock.recv_from(&mut buf).await {
            let to = if from == server { client } else { Some(*client.insert(from)).map(|_| server) };
            if let Some(to) = to {
                let _ = sock.send_to(&buf[..n], to).await;
            }
        }
    });
    (addr, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silently_lost_connection_fails_both_sides_after_the_idle_timeout() {
    let tuning = QuicTuning {
        idle_timeout: Duration::from_millis(800),
        keep_alive_interval: Some(Duration::from_millis(200)),
        ..QuicTuning::default()
    };
    let (_ca, a, b) = pair_with(tuning);
    let (via, cut) = relay(b.local_addr()).await;
    let conn = within("connect", a.connect(via)).await.expect("connect through the relay");
    let (w, r) = conn.open_stream().await.unwrap();
    let mut writer = FrameWriter::new(w);
    writer.send(&TestFrame { seq: 1, data: payload(1, 1, 1000) }).await.unwrap();
    let server_conn = within("accept", b.accept()).await.unwrap();
    let (_sw, sr) = within("accept stream", server_conn.accept_stream()).await.unwrap();
    let mut server_reader = FrameReader::new(sr);
    assert_eq!(within("first frame", server_reader.recv::<TestFrame>()).await.unwrap().map(|f| f.seq), Some(1));

    cut.abort();
    // Both sides are blocked in a read that no data will ever satisfy.
    let client_read = tokio::spawn(async move { FrameReader::new(r).recv::<TestFrame>().await });
    let server_read = tokio::spawn(async move { server_reader.recv::<TestFrame>().await });
    assert_lost(&within("client read", client_read).await.unwrap().expect_err("client read"), "client read");
    assert_lost(&within("server read", server_read).await.unwrap().expect_err("server read"), "server read");
    assert!(conn.is_closed() && server_conn.is_closed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connecting_to_nothing_fails_with_the_peer_named() {
    let tuning = QuicTuning { idle_timeout: Duration::from_millis(500), ..QuicTuning::default() };
    let (_ca, a, _b) = pair_with(tuning);
    // A bound but silent UDP socket: the handshake never completes.
    let silent = std::net::UdpSocket::bind(loopback()).unwrap();
    let peer = silent.local_addr().unwrap();
    match within("connect", a.connect(peer)).await {
        Err(e @ TransportError::Connect { .. }) => assert!(e.to_string().contains(&peer.to_string()), "{e}"),
        other => panic!("expected a Connect error, got {:?}", other.map(|c| c.peer())),
    }
}

/// Write `bytes` of a counting pattern on a new stream from `a` to `b`; the accepted side.
async fn open_and_accept(
    a: &QuicTransport,
    b: &QuicTransport,
) -> (kvfleet_transport::StreamWriter, kvfleet_transport::StreamReader, Arc<dyn kvfleet_transport::KvConnection>) {
    let conn = a.connect(b.local_addr()).await.unwrap();
    let (w, _r) = conn.open_stream().await.unwrap();
    let accepting = async {
        let inbound = b.accept().await.unwrap();
        let (_w, r) = inbound.accept_stream().await.unwrap();
        (r, inbound)
    };
    // quinn announces a stream with its first bytes: write them before accepting.
    let mut w = w;
    tokio::io::AsyncWriteExt::write_all(&mut w, &[0u8; 16]).await.unwrap();
    let (r, inbound) = accepting.await;
    (w, r, inbound)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_dropped_unfinished_discards_its_queued_data() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_ca, a, b) = pair();
    let (mut w, mut r, _inbound) = open_and_accept(&a, &b).await;
    // 8 MiB fit the stream's 16 MiB window, so the writes complete while the reader reads nothing.
    let chunk = vec![7u8; 1 << 20];
    for _ in 0..8 {
        w.write_all(&chunk).await.unwrap();
    }
    drop(w);
    let mut got = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    let end = loop {
        match r.read(&mut buf).await {
            Ok(0) => break Ok(()),
            Ok(n) => got += n as u64,
            Err(e) => break Err(e),
        }
    };
    // A finished stream would end cleanly after all 8 MiB; an abandoned one is reset, and what
    // had not been sent yet never is.
    let err = end.expect_err(&format!("a clean end after {got} bytes: the dropped writer finished the stream"));
    assert!(err.to_string().contains("reset"), "{err}");
    assert!(got <= (8 << 20) + 16);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_datagrams_on_loopback_carry_data_intact() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let route = kvfleet_transport::route_udp_payload(b_addr()).expect("loopback MTU");
    let (_ca, a, b) = pair();
    let (mut w, mut r, _inbound) = open_and_accept(&a, &b).await;
    let data: Vec<u8> = (0..(48usize << 20)).map(|i| (i % 251) as u8).collect();
    let (sent, received) = tokio::join!(
        async {
            w.write_all(&data).await.unwrap();
            w.shutdown().await.unwrap();
        },
        async {
            let mut got = Vec::new();
            r.read_to_end(&mut got).await.unwrap();
            got
        }
    );
    let () = sent;
    assert_eq!(&received[..16], &[0u8; 16]);
    assert!(received[16..] == data[..], "48 MiB arrived byte-exact");
    let conn = a.connect_quic(b.local_addr()).await.unwrap();
    let mtu = conn.quinn().stats().path.current_mtu;
    if route > 6_553 {
        // Ten datagrams of this size exceed one 64 KiB send: the batches were split.
        assert!(mtu > 6_553, "MTU discovery stayed at {mtu} on a route allowing {route}");
    }
}

fn b_addr() -> SocketAddr {
    "127.0.0.1:9".parse().unwrap()
}

/// Owned blocks handed over whole (`write_chunk`, what a migration's KV blocks use) and plain
/// writes interleave on one stream and arrive byte-exact and in order, on the endpoint's own
/// thread and on the caller's runtime alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owned_chunks_and_writes_interleave_byte_exact() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for dedicated_thread in [true, false] {
        let (_ca, a, b) = pair_with(QuicTuning { dedicated_thread, ..QuicTuning::default() });
        let (mut w, mut r, _inbound) = open_and_accept(&a, &b).await;
        let mut expected = vec![0u8; 16];
        let sending = async {
            for i in 0..12u64 {
                let block = payload(1, i, (4 << 20) + i as usize * 1013);
                expected.extend_from_slice(&block);
                if i % 3 == 0 {
                    w.write_all(&block).await.unwrap();
                } else {
                    w.write_chunk(block).await.unwrap();
                }
            }
            w.write_chunk(bytes::Bytes::new()).await.unwrap();
            w.shutdown().await.unwrap();
        };
        let mut got = Vec::new();
        within("interleaved chunks", async { tokio::join!(sending, r.read_to_end(&mut got)).1.unwrap() }).await;
        assert!(
            got == expected,
            "dedicated_thread {dedicated_thread}: {} of {} bytes, or out of order",
            got.len(),
            expected.len()
        );
    }
}

/// Threads of this process whose name starts with `prefix` (Linux: `/proc/self/task/*/comm`).
fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|tasks| {
            tasks
                .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|name| name.trim_end().starts_with(prefix))
                .count()
        })
        .unwrap_or(0)
}

/// The endpoint's thread runs while anything made through it lives: a connection outlives the
/// transport that made it, and once both are gone the thread stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_outlives_its_transport_and_then_the_thread_stops() {
    let (_ca, a, b) = pair();
    let name = format!("kv-quic-{}", a.local_addr().port());
    assert_eq!(threads_named(&name), 1, "the endpoint runs on a thread of its own");
    let _srv = spawn_echo_server(b.clone());
    let conn = a.connect(b.local_addr()).await.unwrap();
    drop(a);
    // Still served: a frame goes out and comes back over the connection alone.
    let (w, r) = conn.open_stream().await.unwrap();
    let (mut w, mut r) = (FrameWriter::new(w), FrameReader::new(r));
    let sent = TestFrame { seq: 2, data: payload(1, 2, 100_000) };
    within("echo after the transport was dropped", async {
        w.send(&sent).await.unwrap();
        assert_eq!(r.recv::<TestFrame>().await.unwrap(), Some(sent.clone()));
    })
    .await;
    drop((w, r, conn));
    within("the endpoint thread stops", async {
        while threads_named(&name) > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}
