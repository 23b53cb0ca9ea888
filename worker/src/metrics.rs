//! Prometheus metrics of one worker (`--metrics-listen ADDR`, `GET /metrics`, text format 0.0.4).
//!
//! vLLM's names where vLLM has the metric, so dashboards built for vLLM work unchanged:
//! `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:gpu_cache_usage_perc`,
//! `vllm:cpu_cache_usage_perc`, `vllm:num_preemptions_total`, `vllm:generation_tokens_total`,
//! `vllm:time_to_first_token_seconds`, `vllm:time_per_output_token_seconds`,
//! `vllm:e2e_request_latency_seconds`, `vllm:request_success_total` (all labelled
//! `model_name`). kvfleet's own: `kvfleet_ttft_answer_seconds` (PASCAL's TTFT: arrival → first
//! *answer* token), `kvfleet_timer_lateness_seconds` (summary), `kvfleet_kv_*`,
//! `kvfleet_migration_*` (outcomes, bytes, total time and downtime histograms). Times are the
//! emulated (cluster-clock) ones.

use crate::driver::DriverStats;
use kvfleet_core::metrics::prom::{gauge, Histogram};
use kvfleet_core::metrics::RequestRecord;
use kvfleet_core::policy::LoadReport;
use std::fmt::Write as _;

/// Per-token buckets (seconds), as vLLM's TPOT histogram.
const TPOT_BUCKETS: &[f64] = &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5];

/// Per-request latency histograms, fed with every finished record.
#[derive(Clone, Debug)]
pub struct RequestMetrics {
    /// Arrival to first output token, seconds (emulated time).
    pub ttft: Histogram,
    /// Arrival to first *answer* token (PASCAL's TTFT), seconds.
    pub ttft_answer: Histogram,
    /// Time per answer token after the first, seconds.
    pub tpot: Histogram,
    /// Arrival to last token, seconds.
    pub e2e: Histogram,
    /// Requests finished on this instance.
    pub finished: u64,
    /// Requests rejected because they can never fit this instance.
    pub rejected: u64,
}

impl Default for RequestMetrics {
    fn default() -> Self {
        RequestMetrics {
            ttft: Histogram::latency(),
            ttft_answer: Histogram::latency(),
            tpot: Histogram::new(TPOT_BUCKETS),
            e2e: Histogram::latency(),
            finished: 0,
            rejected: 0,
        }
    }
}

impl RequestMetrics {
    /// Count one finished (or rejected) request and add its latencies to the histograms.
    pub fn observe(&mut self, r: &RequestRecord) {
        if r.rejected {
            self.rejected += 1;
            return;
        }
        self.finished += 1;
        let secs = |from: kvfleet_core::Timestamp, to: Option<kvfleet_core::Timestamp>| {
            to.map(|t| t.saturating_since(from).as_secs_f64())
        };
        if let Some(v) = secs(r.arrival, r.first_token) {
            self.ttft.observe(v);
        }
        if let Some(v) = secs(r.arrival, r.first_answer_token) {
            self.ttft_answer.observe(v);
        }
        if let Some(v) = secs(r.arrival, r.finish) {
            self.e2e.observe(v);
        }
        if let (Some(first), Some(end)) = (r.first_answer_token, r.finish) {
            if r.answer_tokens > 1 {
                self.tpot.observe(end.saturating_since(first).as_secs_f64() / (r.answer_tokens - 1) as f64);
            }
        }
    }
}

/// Live-migration counters of one worker (as source).
#[derive(Clone, Debug)]
pub struct MigrationMetrics {
    /// Migrations that committed (the target owns the request).
    pub committed: u64,
    /// Migrations aborted after connecting (the request resumed here), refusals excluded.
    pub aborted: u64,
    /// Declined `Prepare`s (the target had no room; nothing copied).
    pub refused: u64,
    /// Migrations in doubt: the connection broke after COMMIT was sent (the request stays paused).
    pub unknown: u64,
    /// KV bytes sent, all outcomes.
    pub bytes: u64,
    /// Start to settle of committed migrations, seconds.
    pub total: Histogram,
    /// Pause on the source to resume on the target of committed migrations, seconds.
    pub downtime: Histogram,
}

impl Default for MigrationMetrics {
    fn default() -> Self {
        MigrationMetrics {
            committed: 0,
            aborted: 0,
            refused: 0,
            unknown: 0,
            bytes: 0,
            total: Histogram::latency(),
            downtime: Histogram::latency(),
        }
    }
}

/// The whole exposition.
pub fn render(model: &str, stats: &DriverStats, load: &LoadReport, migrations: &MigrationMetrics) -> String {
    let mut out = String::new();
    let l = format!("model_name=\"{model}\"");
    let running = load.reasoning_requests + load.answering_requests;
    gauge(
        &mut out,
        "vllm:num_requests_running",
        "Requests in execution batches or resident.",
        "gauge",
        &l,
        running as f64,
    );
    gauge(
        &mut out,
        "vllm:num_requests_waiting",
        "Requests waiting to be scheduled.",
        "gauge",
        &l,
        load.waiting_requests as f64,
    );
    let gpu = if load.gpu_total_blocks > 0 { load.gpu_used_blocks as f64 / load.gpu_total_blocks as f64 } else { 0.0 };
    gauge(&mut out, "vllm:gpu_cache_usage_perc", "GPU KV-cache usage (1 = full).", "gauge", &l, gpu);
    gauge(&mut out, "vllm:num_preemptions_total", "Preemptions.", "counter", &l, stats.engine.preemptions as f64);
    gauge(&mut out, "vllm:generation_tokens_total", "Generated tokens.", "counter", &l, stats.engine.tokens as f64);
    let ok = format!("{l},finished_reason=\"stop\"");
    gauge(
        &mut out,
        "vllm:request_success_total",
        "Finished requests.",
        "counter",
        &ok,
        stats.requests_metrics.finished as f64,
    );
    let r = &stats.requests_metrics;
    r.ttft.render(&mut out, "vllm:time_to_first_token_seconds", "Arrival to first output token (emulated time).", &l);
    r.tpot.render(&mut out, "vllm:time_per_output_token_seconds", "Per answer token after the first.", &l);
    r.e2e.render(&mut out, "vllm:e2e_request_latency_seconds", "Arrival to last token.", &l);
    r.ttft_answer.render(&mut out, "kvfleet_ttft_answer_seconds", "Arrival to first answer token (PASCAL TTFT).", &l);
    gauge(
        &mut out,
        "kvfleet_requests_rejected_total",
        "Requests that can never fit this instance.",
        "counter",
        &l,
        r.rejected as f64,
    );
    gauge(
        &mut out,
        "kvfleet_engine_iterations_total",
        "Engine iterations.",
        "counter",
        &l,
        stats.engine.iterations as f64,
    );
    gauge(
        &mut out,
        "kvfleet_kv_cpu_used_blocks",
        "CPU (offload) KV blocks in use.",
        "gauge",
        &l,
        load.cpu_used_blocks as f64,
    );
    gauge(
        &mut out,
        "kvfleet_kv_tokens_written_total",
        "Tokens whose KV was written to the arena.",
        "counter",
        &l,
        stats.kv.tokens_written as f64,
    );
    gauge(
        &mut out,
        "kvfleet_kv_tokens_verified_total",
        "Tokens checked against their content.",
        "counter",
        &l,
        stats.kv.tokens_verified as f64,
    );
    gauge(
        &mut out,
        "kvfleet_kv_errors_total",
        "KV verification failures and arena errors (must stay 0).",
        "counter",
        &l,
        stats.kv.errors as f64,
    );
    let lat = &stats.lateness;
    let _ = writeln!(out, "# HELP kvfleet_timer_lateness_seconds Engine wake-up lateness behind the modelled iteration end.\n# TYPE kvfleet_timer_lateness_seconds summary");
    for (q, v) in [("0.5", lat.p50_us), ("0.99", lat.p99_us), ("1", lat.max_us)] {
        let _ = writeln!(out, "kvfleet_timer_lateness_seconds{{{l},quantile=\"{q}\"}} {}", v / 1e6);
    }
    let _ = writeln!(out, "kvfleet_timer_lateness_seconds_sum{{{l}}} {}", lat.mean_us * lat.samples as f64 / 1e6);
    let _ = writeln!(out, "kvfleet_timer_lateness_seconds_count{{{l}}} {}", lat.samples);
    let m = migrations;
    let _ = writeln!(out, "# HELP kvfleet_migrations_total Live migrations out of this worker by outcome.\n# TYPE kvfleet_migrations_total counter");
    for (outcome, n) in
        [("committed", m.committed), ("aborted", m.aborted), ("refused", m.refused), ("unknown", m.unknown)]
    {
        let _ = writeln!(out, "kvfleet_migrations_total{{{l},outcome=\"{outcome}\"}} {n}");
    }
    gauge(
        &mut out,
        "kvfleet_migration_bytes_total",
        "KV bytes sent by live migrations.",
        "counter",
        &l,
        m.bytes as f64,
    );
    m.total.render(&mut out, "kvfleet_migration_duration_seconds", "Live migration start to settle (committed).", &l);
    m.downtime.render(
        &mut out,
        "kvfleet_migration_downtime_seconds",
        "Pause on the source to resume on the target.",
        &l,
    );
    out
}

/// Answer one HTTP/1.x request on `stream`: `GET /metrics` → the exposition `body()`, anything
/// else 404. Minimal by design (Prometheus scrapes one path); the connection closes after it.
pub async fn answer<S, F, Fut>(mut stream: S, body: F)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Option<String>>,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 4096];
    let mut have = 0;
    // Read until the end of the request head (or the buffer is full: a bad request).
    while have < buf.len() {
        match stream.read(&mut buf[have..]).await {
            Ok(0) | Err(_) => break,
            Ok(n) => have += n,
        }
        if buf[..have].windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    let head = String::from_utf8_lossy(&buf[..have]);
    let mut parts = head.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, ctype, text) = if method == "GET" && (path == "/metrics" || path.starts_with("/metrics?")) {
        match body().await {
            Some(b) => ("200 OK", "text/plain; version=0.0.4; charset=utf-8", b),
            None => ("503 Service Unavailable", "text/plain", "the worker is stopping\n".to_string()),
        }
    } else {
        ("404 Not Found", "text/plain", "only GET /metrics is served here\n".to_string())
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
        text.len()
    );
    let _ = stream.write_all(reply.as_bytes()).await;
    let _ = stream.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_core::{RequestId, Timestamp};

    #[test]
    fn histograms_are_cumulative_and_records_feed_the_vllm_latencies() {
        let mut m = RequestMetrics::default();
        let s = |x: f64| Some(Timestamp((x * 1e9) as u64));
        m.observe(&RequestRecord {
            id: RequestId(1),
            arrival: Timestamp(0),
            answer_tokens: 11,
            first_token: s(0.03),
            first_answer_token: s(2.0),
            finish: s(3.0),
            ..RequestRecord::default()
        });
        m.observe(&RequestRecord { rejected: true, ..RequestRecord::default() });
        assert_eq!((m.finished, m.rejected), (1, 1));
        let mut out = String::new();
        m.ttft.render(&mut out, "t", "h", "model_name=\"x\"");
        assert!(out.contains("t_bucket{model_name=\"x\",le=\"0.02\"} 0\n"), "{out}");
        assert!(out.contains("t_bucket{model_name=\"x\",le=\"0.04\"} 1\n"), "{out}");
        assert!(out.contains("t_bucket{model_name=\"x\",le=\"+Inf\"} 1\n"), "{out}");
        assert!(out.contains("t_count{model_name=\"x\"} 1\n"));
        assert_eq!(m.tpot.count(), 1, "(3.0 - 2.0) / 10 answer tokens after the first");
        assert!((m.tpot.sum() - 0.1).abs() < 1e-9);
    }

    #[tokio::test]
    async fn http_answers_metrics_and_404s_the_rest() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        for (req, want) in [("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", "200 OK"), ("GET / HTTP/1.1\r\n\r\n", "404")] {
            let (mut client, server) = tokio::io::duplex(1 << 16);
            let task = tokio::spawn(answer(server, || async { Some("vllm:num_requests_running 1\n".to_string()) }));
            client.write_all(req.as_bytes()).await.unwrap();
            let mut reply = String::new();
            client.read_to_string(&mut reply).await.unwrap();
            task.await.unwrap();
            assert!(reply.starts_with(&format!("HTTP/1.1 {want}")), "{reply}");
            assert_eq!(reply.contains("vllm:num_requests_running"), want == "200 OK");
        }
    }
}
