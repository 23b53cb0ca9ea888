//! The RDMA transport (feature `rdma`): the shared transport behaviour over the emulated fabric
//! (always), and over real verbs when this host has an RDMA device (skipped with a message
//! otherwise: `ibv_get_device_list` finds none on hosts without InfiniBand, RoCE or Soft-RoCE).
#![cfg(feature = "rdma")]

mod common;

use common::*;
use kvfleet_transport::rdma::{rdma_devices, EmulatedFabric, RdmaConfig, RdmaConnection, RdmaTransport};
use kvfleet_transport::{FrameReader, FrameWriter, KvConnection, KvTransport, TransportError};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

fn any_addr() -> SocketAddr {
    "10.0.0.1:0".parse().unwrap()
}

fn emulated_pair_with(config: RdmaConfig) -> (EmulatedFabric, Arc<RdmaTransport>, Arc<RdmaTransport>) {
    let fabric = EmulatedFabric::new();
    let a = Arc::new(RdmaTransport::emulated(&fabric, any_addr(), config.clone()).unwrap());
    let b = Arc::new(RdmaTransport::emulated(&fabric, any_addr(), config).unwrap());
    (fabric, a, b)
}

fn emulated_pair() -> (EmulatedFabric, Arc<RdmaTransport>, Arc<RdmaTransport>) {
    emulated_pair_with(RdmaConfig::default())
}

/// A tight configuration: a 64 KiB ring (records of at most 16 KiB, wraps every few frames) and
/// a 256 KiB stream window, so ring credits and flow control work all the time.
fn tight() -> RdmaConfig {
    RdmaConfig { ring_bytes: 64 << 10, stream_window_bytes: 256 << 10, send_queue_depth: 8, ..RdmaConfig::default() }
}

// ---- The shared behaviour over the emulated fabric ----------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_round_trip_is_byte_exact() {
    let (_f, a, b) = emulated_pair();
    let _srv = spawn_echo_server(b.clone());
    echo_round_trip(a.as_ref(), b.local_addr()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_concurrent_streams_arrive_intact() {
    let (_f, a, b) = emulated_pair();
    let _srv = spawn_ack_server(b.clone());
    concurrent_streams(a.as_ref(), b.local_addr(), 8, 4, 1 << 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_small_ring_and_window_keep_concurrent_streams_intact() {
    let (_f, a, b) = emulated_pair_with(tight());
    let _srv = spawn_ack_server(b.clone());
    concurrent_streams(a.as_ref(), b.local_addr(), 6, 3, 1 << 20).await;
    let conn = a.connect_rdma(b.local_addr()).await.unwrap();
    let stats = conn.stats();
    assert!(stats.ring_wraps >= 250, "18 MiB through a 64 KiB ring wraps it hundreds of times: {stats:?}");
    assert!(stats.data_bytes_sent >= 18 << 20, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_connections_are_reused_while_alive() {
    let (_f, a, b) = emulated_pair();
    let (_srv, accepted) = spawn_counting_echo_server(b.clone());
    connection_reuse(a.as_ref(), b.local_addr(), &accepted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_peer_close_fails_the_other_side() {
    let (_f, a, b) = emulated_pair();
    peer_close_fails_streams(a.as_ref(), b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_closing_the_transport_ends_accept() {
    let (_f, _a, b) = emulated_pair();
    close_ends_accept(b).await;
}

// ---- RDMA-specific behaviour (emulated fabric) -----------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_unknown_peers_are_unreachable_and_taken_addresses_refused() {
    let (f, a, b) = emulated_pair();
    let nowhere: SocketAddr = "10.9.9.9:9".parse().unwrap();
    match a.connect(nowhere).await {
        Err(TransportError::Unreachable { peer }) => assert_eq!(peer, nowhere),
        other => panic!("expected Unreachable, got {:?}", other.map(|c| c.peer())),
    }
    let err = RdmaTransport::emulated(&f, b.local_addr(), RdmaConfig::default()).unwrap_err();
    assert!(matches!(err, TransportError::Bind { .. }), "{err}");
    let err =
        RdmaTransport::emulated(&f, any_addr(), RdmaConfig { ring_bytes: 100, ..Default::default() }).unwrap_err();
    assert!(err.to_string().contains("ring_bytes = 100"), "{err}");
}

/// A reader that goes away makes the peer's writer fail (not hang); the other streams go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_a_dropped_reader_fails_the_peers_writer() {
    let (_f, a, b) = emulated_pair_with(tight());
    let server = tokio::spawn({
        let b = b.clone();
        async move {
            let conn = b.accept().await.expect("accept");
            let (_w, r) = conn.accept_stream().await.expect("accept stream");
            let mut reader = FrameReader::new(r);
            let first: TestFrame = reader.recv().await.expect("recv").expect("a frame");
            drop(reader);
            (conn, first.seq)
        }
    });
    let conn = within("connect", a.connect(b.local_addr())).await.unwrap();
    let (w, _r) = conn.open_stream().await.unwrap();
    let mut writer = FrameWriter::new(w);
    writer.send(&TestFrame { seq: 5, data: payload(5, 0, 100) }).await.unwrap();
    let (server_conn, seq) = within("server", server).await.unwrap();
    assert_eq!(seq, 5);
    let err = within("write to a stopped stream", async {
        loop {
            if let Err(e) = writer.send(&TestFrame { seq: 6, data: payload(5, 1, 64 << 10) }).await {
                return e;
            }
        }
    })
    .await;
    match err {
        kvfleet_transport::FrameError::Io(e) => assert_eq!(e.kind(), io::ErrorKind::BrokenPipe, "{e}"),
        other => panic!("expected a BrokenPipe I/O error, got {other:?}"),
    }
    assert!(!conn.is_closed() && !server_conn.is_closed(), "only the stream failed");
    // The connection still carries new streams.
    let (w2, r2) = conn.open_stream().await.unwrap();
    let mut writer = FrameWriter::new(w2);
    writer.send(&TestFrame { seq: 7, data: payload(7, 0, 3000) }).await.unwrap();
    writer.finish().await.unwrap();
    let (sw2, sr2) = within("accept stream", server_conn.accept_stream()).await.unwrap();
    let got: TestFrame = within("recv", FrameReader::new(sr2).recv()).await.unwrap().expect("a frame");
    assert_eq!((got.seq, got.data), (7, payload(7, 0, 3000)));
    let mut back = FrameWriter::new(sw2);
    back.send(&TestFrame { seq: 8, data: payload(8, 0, 10) }).await.unwrap();
    back.finish().await.unwrap();
    let echoed: TestFrame = within("recv", FrameReader::new(r2).recv()).await.unwrap().expect("a frame");
    assert_eq!(echoed.seq, 8);
}

/// Dropping every handle of a connection (and its streams) closes it; the peer notices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_dropping_a_connection_closes_it_for_the_peer() {
    let (_f, a, b) = emulated_pair();
    let conn: Arc<RdmaConnection> = a.connect_rdma(b.local_addr()).await.unwrap();
    let server = within("accept", b.accept()).await.unwrap();
    let (w, r) = conn.open_stream().await.unwrap();
    let (sw, sr) = within("accept stream", server.accept_stream()).await.unwrap();
    drop((w, r, sw, sr));
    assert_eq!(conn.open_streams(), 0, "a stream whose halves are all dropped is forgotten");
    a.close(); // drops the pooled handle
    drop(conn);
    let err = within("accept stream after the peer went", server.accept_stream()).await.err().expect("an error");
    assert!(err.to_string().contains("closed by the peer"), "{err}");
    assert!(server.is_closed());
}

// ---- Real verbs, when this host has an RDMA device ------------------------------------------------

/// The address to run the real tests on: `KVFLEET_RDMA_ADDR`, else the first address of an RDMA
/// device's interface. `None` (with a message saying why) when there is no device.
fn rdma_test_addr() -> Option<IpAddr> {
    let devices = match rdma_devices() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipping the real-RDMA tests: {e}");
            return None;
        }
    };
    if let Ok(a) = std::env::var("KVFLEET_RDMA_ADDR") {
        return Some(a.parse().unwrap_or_else(|_| panic!("KVFLEET_RDMA_ADDR={a} is not an IP address")));
    }
    let found = devices.iter().flat_map(|d| d.addrs.iter().copied()).find(|a| a.is_ipv4());
    if found.is_none() {
        eprintln!(
            "skipping the real-RDMA tests: devices {:?} have no IPv4 address on their interfaces; set KVFLEET_RDMA_ADDR",
            devices.iter().map(|d| &d.name).collect::<Vec<_>>()
        );
    }
    found
}

fn verbs_pair(ip: IpAddr) -> (Arc<RdmaTransport>, Arc<RdmaTransport>) {
    let a = Arc::new(RdmaTransport::bind(SocketAddr::new(ip, 0), RdmaConfig::default()).expect("bind"));
    let b = Arc::new(RdmaTransport::bind(SocketAddr::new(ip, 0), RdmaConfig::default()).expect("bind"));
    (a, b)
}

/// Without a device, binding fails with a message that names the problem and the way out.
#[test]
fn without_a_device_bind_names_the_problem() {
    if rdma_devices().is_ok() {
        eprintln!("this host has an RDMA device; the no-device error is not exercised");
        return;
    }
    let err = RdmaTransport::bind("127.0.0.1:0".parse().unwrap(), RdmaConfig::default()).unwrap_err().to_string();
    assert!(err.contains("no RDMA device found (ibv_get_device_list"), "{err}");
    assert!(err.contains("use --transport quic"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_shared_behaviour() {
    let Some(ip) = rdma_test_addr() else { return };
    let (a, b) = verbs_pair(ip);
    let (_srv, accepted) = spawn_counting_echo_server(b.clone());
    connection_reuse(a.as_ref(), b.local_addr(), &accepted).await;
    echo_round_trip(a.as_ref(), b.local_addr()).await;
    let (c, d) = verbs_pair(ip);
    let _srv = spawn_ack_server(d.clone());
    concurrent_streams(c.as_ref(), d.local_addr(), 8, 8, 4 << 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_peer_close_and_transport_close() {
    let Some(ip) = rdma_test_addr() else { return };
    let (a, b) = verbs_pair(ip);
    peer_close_fails_streams(a.as_ref(), b).await;
    let (_c, d) = verbs_pair(ip);
    close_ends_accept(d).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_unknown_device_is_named() {
    let Some(ip) = rdma_test_addr() else { return };
    let config = RdmaConfig { device: Some("no_such_dev0".into()), ..RdmaConfig::default() };
    let err = RdmaTransport::bind(SocketAddr::new(ip, 0), config).unwrap_err().to_string();
    assert!(err.contains("RDMA device no_such_dev0 not found"), "{err}");
}
