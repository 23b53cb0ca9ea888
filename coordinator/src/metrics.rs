//! The coordinator's Prometheus metrics (`GET /metrics` on the `--http-listen` server, next to
//! the OpenAI API, as vLLM serves both on one port): leadership, the workers it sees, request and
//! migration counters, and the live-migration time histograms from the sources' measurements.

use crate::node::Node;
use kvfleet_core::metrics::prom::{gauge, Histogram};
use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The exposition as this coordinator sees the cluster now.
pub async fn render(node: &Arc<Node>) -> String {
    let mut out = String::new();
    let l = format!("model_name=\"{}\"", node.opts.model.model);
    let leader = node.current_leader().await.filter(|l| !l.is_deposed());
    gauge(
        &mut out,
        "kvfleet_leader",
        "1 if this coordinator is the leader.",
        "gauge",
        &l,
        leader.is_some() as u8 as f64,
    );
    let Some(leader) = leader else { return out };
    let status = leader.status("", node.epoch_unix_ns());
    let alive = status.instances.iter().filter(|i| i.alive).count();
    gauge(&mut out, "kvfleet_workers_alive", "Registered workers with a live registration.", "gauge", &l, alive as f64);
    gauge(
        &mut out,
        "kvfleet_requests_in_flight",
        "Accepted, unfinished requests.",
        "gauge",
        &l,
        status.requests_in_flight as f64,
    );
    let s = &leader.stats;
    for (name, help, v) in [
        ("kvfleet_requests_accepted_total", "Requests accepted by this leader.", &s.accepted),
        ("kvfleet_requests_finished_total", "Requests finished under this leader.", &s.finished),
        ("kvfleet_requests_replaced_total", "Requests re-placed after their worker died.", &s.replaced),
    ] {
        gauge(&mut out, name, help, "counter", &l, v.load(Ordering::Relaxed) as f64);
    }
    let _ = writeln!(out, "# HELP kvfleet_migrations_total Migrations decided by this leader, by outcome.\n# TYPE kvfleet_migrations_total counter");
    let _ =
        writeln!(out, "kvfleet_migrations_total{{{l},outcome=\"committed\"}} {}", s.migrations.load(Ordering::Relaxed));
    let _ = writeln!(
        out,
        "kvfleet_migrations_total{{{l},outcome=\"failed\"}} {}",
        s.migration_failures.load(Ordering::Relaxed)
    );
    let (mut total, mut downtime) = (Histogram::latency(), Histogram::latency());
    let mut bytes = 0u64;
    for m in status.migration_log.iter().filter(|m| m.committed()) {
        total.observe(m.total_ns() as f64 / 1e9);
        downtime.observe(m.downtime_ns as f64 / 1e9);
        bytes += m.bytes;
    }
    gauge(
        &mut out,
        "kvfleet_migration_bytes_total",
        "KV bytes moved by committed live migrations.",
        "counter",
        &l,
        bytes as f64,
    );
    total.render(&mut out, "kvfleet_migration_duration_seconds", "Live migration start to settle (committed).", &l);
    downtime.render(&mut out, "kvfleet_migration_downtime_seconds", "Pause on the source to resume on the target.", &l);
    out
}
