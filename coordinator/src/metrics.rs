//! The coordinator's Prometheus metrics (`GET /metrics` on the `--http-listen` server, next to
//! the OpenAI API, as vLLM serves both on one port): leadership, the workers it sees, request and
//! migration counters, and the live-migration time histograms from the sources' measurements.

use crate::node::Node;
use kvfleet_telemetry::prom::{self, Exposition};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The exposition as this coordinator sees the cluster now (Prometheus text format 0.0.4,
/// [`prom::CONTENT_TYPE`]).
pub async fn render(node: &Arc<Node>) -> String {
    let mut page = Exposition::new(&node.opts.model.model);
    let leader = node.current_leader().await.filter(|l| !l.is_deposed());
    page.gauge("kvfleet_leader", "1 if this coordinator is the leader.", u32::from(leader.is_some()));
    let Some(leader) = leader else { return page.encode() };
    let status = leader.status("", node.clock());
    let alive = status.instances.iter().filter(|i| i.alive).count();
    page.gauge("kvfleet_workers_alive", "Registered workers with a live registration.", alive);
    page.gauge("kvfleet_requests_in_flight", "Accepted, unfinished requests.", status.requests_in_flight);
    let s = &leader.stats;
    for (name, help, v) in [
        ("kvfleet_requests_accepted_total", "Requests accepted by this leader.", &s.accepted),
        ("kvfleet_requests_finished_total", "Requests finished under this leader.", &s.finished),
        ("kvfleet_requests_replaced_total", "Requests re-placed after their worker died.", &s.replaced),
    ] {
        page.counter(name, help, v.load(Ordering::Relaxed));
    }
    page.counters(
        "kvfleet_migrations_total",
        "Migrations decided by this leader, by outcome.",
        "outcome",
        &[
            ("committed", s.migrations.load(Ordering::Relaxed)),
            ("failed", s.migration_failures.load(Ordering::Relaxed)),
        ],
    );
    let (total, downtime) = (prom::latency_histogram(), prom::latency_histogram());
    let mut bytes = 0u64;
    for m in status.migration_log.iter().filter(|m| m.committed()) {
        total.observe(m.total_ns() as f64 / 1e9);
        downtime.observe(m.downtime_ns as f64 / 1e9);
        bytes += m.bytes;
    }
    page.counter("kvfleet_migration_bytes_total", "KV bytes moved by committed live migrations.", bytes);
    page.histogram("kvfleet_migration_duration_seconds", "Live migration start to settle (committed).", &total);
    page.histogram("kvfleet_migration_downtime_seconds", "Pause on the source to resume on the target.", &downtime);
    page.encode()
}
