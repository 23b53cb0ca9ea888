//! The goodput benchmark functions: a smoke test (always) and the measurement (ignored; run it
//! in release: `cargo test -p kvfleet-transport --release --test bench -- --ignored --nocapture`).

use kvfleet_pki::{ClusterCa, Role};
use kvfleet_transport::bench::{self, SinkKind};
use kvfleet_transport::QuicTuning;
use std::net::SocketAddr;
use std::time::Duration;

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), f).await.expect("benchmark hung")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_and_quic_senders_are_acknowledged_in_full() {
    let ca = ClusterCa::generate("bench").unwrap();
    let sink_id = ca.issue(Role::Worker, "sink", &[]).unwrap();
    let sender_id = ca.issue(Role::Worker, "sender", &[]).unwrap();
    let bytes = (8 << 20) + 12345;

    let tcp = bench::tcp_sink(loopback()).await.unwrap();
    let g = within(bench::tcp_send(tcp.addr(), bytes, 3)).await.unwrap();
    assert_eq!(g.bytes, bytes);
    assert!(g.elapsed_s > 0.0 && g.gbit_per_s() > 0.0);

    let quic = bench::quic_sink(loopback(), &sink_id, QuicTuning::default()).await.unwrap();
    let g = within(bench::quic_send(quic.addr(), &sender_id, bytes, 3, 1 << 20)).await.unwrap();
    assert_eq!(g.bytes, bytes);

    // serve_sink reports its address and serves more than one sender.
    let (tx, rx) = tokio::sync::oneshot::channel();
    let id = sink_id.clone();
    let server = tokio::spawn(async move {
        bench::serve_sink(SinkKind::Quic, loopback(), Some(&id), QuicTuning::default(), |a| {
            let _ = tx.send(a);
        })
        .await
    });
    let addr = within(rx).await.unwrap();
    for streams in [1, 2] {
        let g = within(bench::quic_send(addr, &sender_id, 1 << 20, streams, 256 << 10)).await.unwrap();
        assert_eq!(g.bytes, 1 << 20);
    }
    server.abort();

    // A QUIC sink without an identity is a clear error.
    let err = bench::serve_sink(SinkKind::Quic, loopback(), None, QuicTuning::default(), |_| {}).await.unwrap_err();
    assert!(matches!(err, bench::BenchError::NoIdentity));
}

/// Prints TCP and QUIC goodput for 1, 4 and 8 streams (both ends in this process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement: run in release with --nocapture"]
async fn measure_goodput() {
    let bytes: u64 = std::env::var("KVFLEET_BENCH_BYTES").ok().and_then(|s| s.parse().ok()).unwrap_or(1 << 30);
    let ca = ClusterCa::generate("bench").unwrap();
    let sink_id = ca.issue(Role::Worker, "sink", &[]).unwrap();
    let sender_id = ca.issue(Role::Worker, "sender", &[]).unwrap();
    let tcp = bench::tcp_sink(loopback()).await.unwrap();
    let quic = bench::quic_sink(loopback(), &sink_id, QuicTuning::default()).await.unwrap();
    println!("{} MiB per run, 4 MiB frames, default QuicTuning", bytes >> 20);
    for streams in [1, 4, 8] {
        let t = bench::tcp_send(tcp.addr(), bytes, streams).await.unwrap();
        let q = bench::quic_send(quic.addr(), &sender_id, bytes, streams, bench::DEFAULT_CHUNK_BYTES).await.unwrap();
        println!(
            "streams {streams}: TCP {:6.2} Gbit/s, QUIC {:6.2} Gbit/s, QUIC/TCP {:.2}",
            t.gbit_per_s(),
            q.gbit_per_s(),
            q.gbit_per_s() / t.gbit_per_s()
        );
    }
}
