//! The in-memory transport: the shared transport behaviour plus severing links.

mod common;

use common::*;
use kvfleet_transport::{FrameReader, FrameWriter, KvConnection, KvTransport, MemNetwork, TransportError};
use std::sync::Arc;

fn pair() -> (MemNetwork, Arc<kvfleet_transport::MemTransport>, Arc<kvfleet_transport::MemTransport>) {
    let net = MemNetwork::new();
    let a = Arc::new(net.bind_any());
    let b = Arc::new(net.bind_any());
    (net, a, b)
}

#[tokio::test]
async fn round_trip_is_byte_exact() {
    let (_net, a, b) = pair();
    let _srv = spawn_echo_server(b.clone());
    echo_round_trip(a.as_ref(), b.local_addr()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_arrive_intact() {
    let (_net, a, b) = pair();
    let _srv = spawn_ack_server(b.clone());
    concurrent_streams(a.as_ref(), b.local_addr(), 8, 8, 1 << 20).await;
}

#[tokio::test]
async fn connections_are_reused_while_alive() {
    let (_net, a, b) = pair();
    let (_srv, accepted) = spawn_counting_echo_server(b.clone());
    connection_reuse(a.as_ref(), b.local_addr(), &accepted).await;
}

#[tokio::test]
async fn peer_close_fails_the_other_side() {
    let (_net, a, b) = pair();
    peer_close_fails_streams(a.as_ref(), b).await;
}

#[tokio::test]
async fn closing_the_transport_ends_accept() {
    let (_net, _a, b) = pair();
    close_ends_accept(b).await;
}

#[tokio::test]
async fn binding_a_taken_address_fails_and_unknown_peers_are_unreachable() {
    let (net, a, b) = pair();
    assert!(matches!(net.bind(b.local_addr()), Err(TransportError::Bind { .. })));
    let nowhere = "127.0.0.1:9".parse().unwrap();
    match a.connect(nowhere).await {
        Err(TransportError::Unreachable { peer }) => assert_eq!(peer, nowhere),
        other => panic!("expected Unreachable, got {:?}", other.map(|c| c.peer())),
    }
}

/// A severed link fails a reader blocked mid-transfer on both sides, and writers, with
/// NotConnected (never a clean EOF that could pass for a finished transfer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn severing_a_link_fails_blocked_reads_and_writes_on_both_sides() {
    let (_net, a, b) = pair();
    let conn = a.connect_mem(b.local_addr()).await.unwrap();
    let server_conn = b.accept().await.unwrap();
    let (cw, cr) = conn.open_stream().await.unwrap();
    let (_sw, sr) = server_conn.accept_stream().await.unwrap();
    // The server also writes on a stream the client never accepts, until its pipe is full.
    let (sw, _sr2) = server_conn.open_stream().await.unwrap();
    // Both sides block in a read (nobody writes on the first stream).
    let client_read = tokio::spawn(async move { FrameReader::new(cr).recv::<TestFrame>().await });
    let server_read = tokio::spawn(async move { FrameReader::new(sr).recv::<TestFrame>().await });
    let server_write = tokio::spawn(async move {
        let mut w = FrameWriter::new(sw);
        loop {
            if let Err(e) = w.send(&TestFrame { seq: 0, data: payload(0, 0, 1 << 20) }).await {
                return e;
            }
        }
    });
    let accept = tokio::spawn({
        let server_conn = server_conn.clone();
        async move { server_conn.accept_stream().await.map(|_| ()) }
    });
    tokio::task::yield_now().await;
    conn.sever();
    assert!(conn.is_closed() && server_conn.is_closed());
    assert_lost(&within("client read", client_read).await.unwrap().expect_err("client read"), "client read");
    assert_lost(&within("server read", server_read).await.unwrap().expect_err("server read"), "server read");
    assert_lost(&within("server write", server_write).await.unwrap(), "server write");
    assert!(within("accept stream", accept).await.unwrap().is_err());
    drop(cw);
    // A severed connection is not reused.
    let again = a.connect(b.local_addr()).await.unwrap();
    assert!(!again.is_closed());
}

#[tokio::test]
async fn dropping_a_peer_from_the_network_fails_its_connections() {
    let (net, a, b) = pair();
    let conn = a.connect(b.local_addr()).await.unwrap();
    let _server_conn = b.accept().await.unwrap();
    let (_w, r) = conn.open_stream().await.unwrap();
    let read = tokio::spawn(async move { FrameReader::new(r).recv::<TestFrame>().await });
    net.drop_peer(b.local_addr());
    assert_lost(&within("read", read).await.unwrap().expect_err("read"), "read");
    assert!(conn.is_closed());
    assert!(matches!(a.connect(b.local_addr()).await.map(|c| c.peer()), Err(TransportError::Unreachable { .. })));
}

#[tokio::test]
async fn a_dropped_reader_fails_the_writer_and_a_finished_writer_is_eof() {
    let (_net, a, b) = pair();
    let conn = a.connect(b.local_addr()).await.unwrap();
    let server_conn = b.accept().await.unwrap();
    let (cw, cr) = conn.open_stream().await.unwrap();
    let (sw, sr) = server_conn.accept_stream().await.unwrap();
    drop(sr);
    let mut w = FrameWriter::new(cw);
    let err = w.send(&TestFrame { seq: 0, data: payload(0, 0, 10) }).await.expect_err("reader is gone");
    assert!(
        matches!(err, kvfleet_transport::FrameError::Io(ref e) if e.kind() == std::io::ErrorKind::BrokenPipe),
        "{err:?}"
    );
    // The other direction: finish → clean EOF.
    let mut w = FrameWriter::new(sw);
    w.send(&TestFrame { seq: 1, data: payload(0, 1, 10) }).await.unwrap();
    w.finish().await.unwrap();
    let mut r = FrameReader::new(cr);
    assert_eq!(r.recv::<TestFrame>().await.unwrap().map(|f| f.seq), Some(1));
    assert!(r.recv::<TestFrame>().await.unwrap().is_none());
}
