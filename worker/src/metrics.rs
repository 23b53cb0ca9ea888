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
use kvfleet_core::metrics::RequestRecord;
use kvfleet_core::policy::LoadReport;
use kvfleet_telemetry::prom::{self, Exposition};
use prometheus_client::metrics::histogram::Histogram;
use std::future::Future;

/// Per-token buckets (seconds), as vLLM's TPOT histogram.
const TPOT_BUCKETS: &[f64] = &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5];

/// Per-request latency histograms, fed with every finished record. A clone shares the
/// histograms (prometheus-client's are handles) and copies the counts.
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
            ttft: prom::latency_histogram(),
            ttft_answer: prom::latency_histogram(),
            tpot: prom::histogram(TPOT_BUCKETS),
            e2e: prom::latency_histogram(),
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

/// Live-migration counters of one worker (as source). A clone shares the histograms and copies
/// the counts.
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
    /// KV bytes not sent because the target's prefix cache held them.
    pub bytes_skipped: u64,
    /// Prefix fetches this worker made (cache-aware placement).
    pub prefix_fetches: u64,
    /// The bytes they received.
    pub prefix_fetch_bytes: u64,
    /// Fetched blocks that arrived out of order or failed their checksum (the fetch stopped).
    pub prefix_fetch_errors: u64,
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
            bytes_skipped: 0,
            prefix_fetches: 0,
            prefix_fetch_bytes: 0,
            prefix_fetch_errors: 0,
            total: prom::latency_histogram(),
            downtime: prom::latency_histogram(),
        }
    }
}

/// The whole exposition (Prometheus text format 0.0.4, [`prom::CONTENT_TYPE`]).
pub fn render(model: &str, stats: &DriverStats, load: &LoadReport, migrations: &MigrationMetrics) -> String {
    let mut page = Exposition::new(model);
    let running = load.reasoning_requests + load.answering_requests;
    page.gauge("vllm:num_requests_running", "Requests in execution batches or resident.", running);
    page.gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", load.waiting_requests);
    let gpu = if load.gpu_total_blocks > 0 { load.gpu_used_blocks as f64 / load.gpu_total_blocks as f64 } else { 0.0 };
    page.gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage (1 = full).", gpu);
    page.counter("vllm:num_preemptions_total", "Preemptions.", stats.engine.preemptions);
    page.counter("vllm:generation_tokens_total", "Generated tokens.", stats.engine.tokens);
    let r = &stats.requests_metrics;
    page.counters("vllm:request_success_total", "Finished requests.", "finished_reason", &[("stop", r.finished)]);
    page.histogram("vllm:time_to_first_token_seconds", "Arrival to first output token (emulated time).", &r.ttft);
    page.histogram("vllm:time_per_output_token_seconds", "Per answer token after the first.", &r.tpot);
    page.histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", &r.e2e);
    page.histogram("kvfleet_ttft_answer_seconds", "Arrival to first answer token (PASCAL TTFT).", &r.ttft_answer);
    page.counter("kvfleet_requests_rejected_total", "Requests that can never fit this instance.", r.rejected);
    page.counter("kvfleet_engine_iterations_total", "Engine iterations.", stats.engine.iterations);
    page.gauge("kvfleet_kv_cpu_used_blocks", "CPU (offload) KV blocks in use.", load.cpu_used_blocks);
    page.counter(
        "kvfleet_kv_tokens_written_total",
        "Tokens whose KV was written to the arena.",
        stats.kv.tokens_written,
    );
    page.counter("kvfleet_kv_tokens_verified_total", "Tokens checked against their content.", stats.kv.tokens_verified);
    page.counter(
        "kvfleet_kv_tokens_reused_total",
        "Prompt tokens found written in a shared prefix block (a cache hit): not written again.",
        stats.kv.tokens_reused,
    );
    let p = &stats.prefix;
    page.counter("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", p.query_tokens);
    page.counter("vllm:prefix_cache_hits_total", "Of those, tokens found cached (not prefilled).", p.hit_tokens);
    page.counters(
        "kvfleet_prefix_cache_evictions_total",
        "Cached KV blocks evicted to make room, per tier.",
        "tier",
        &[("gpu", p.evictions), ("cpu", p.cpu_evictions)],
    );
    page.counter(
        "kvfleet_kv_errors_total",
        "KV verification failures and arena errors (must stay 0).",
        stats.kv.errors,
    );
    let lat = &stats.lateness;
    page.summary(
        "kvfleet_timer_lateness_seconds",
        "Engine wake-up lateness behind the modelled iteration end.",
        &[("0.5", lat.p50_us / 1e6), ("0.99", lat.p99_us / 1e6), ("1", lat.max_us / 1e6)],
        lat.mean_us * lat.samples as f64 / 1e6,
        lat.samples,
    );
    let m = migrations;
    page.counters(
        "kvfleet_migrations_total",
        "Live migrations out of this worker by outcome.",
        "outcome",
        &[("committed", m.committed), ("aborted", m.aborted), ("refused", m.refused), ("unknown", m.unknown)],
    );
    page.counter("kvfleet_migration_bytes_total", "KV bytes sent by live migrations.", m.bytes);
    page.counter(
        "kvfleet_migration_bytes_skipped_total",
        "KV bytes live migrations did not send: the target's prefix cache held them.",
        m.bytes_skipped,
    );
    page.counter(
        "kvfleet_prefix_fetches_total",
        "Cached prompt prefixes this worker copied from another worker before a request started here.",
        m.prefix_fetches,
    );
    page.counter("kvfleet_prefix_fetch_bytes_total", "KV bytes those prefix fetches received.", m.prefix_fetch_bytes);
    page.counter(
        "kvfleet_prefix_fetch_errors_total",
        "Fetched prefix blocks that arrived out of order or corrupt (the fetch stopped there).",
        m.prefix_fetch_errors,
    );
    page.histogram("kvfleet_migration_duration_seconds", "Live migration start to settle (committed).", &m.total);
    page.histogram("kvfleet_migration_downtime_seconds", "Pause on the source to resume on the target.", &m.downtime);
    page.encode()
}

/// The `--metrics-listen` HTTP service: `GET /metrics` answers the page `scrape` renders (503
/// when it has none: the worker is stopping), any other path 404. Every answer closes its
/// connection (`Connection: close`): one scrape per connection is all Prometheus needs, and
/// clients that read to the end of the stream keep working.
pub fn router<F, Fut>(scrape: F) -> axum::Router
where
    F: Fn() -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Option<String>> + Send + 'static,
{
    use axum::http::{header, StatusCode};
    use axum::response::IntoResponse;
    let page = move || {
        let body = scrape();
        async move {
            let close = (header::CONNECTION, "close");
            match body.await {
                Some(b) => ([(header::CONTENT_TYPE, prom::CONTENT_TYPE), close], b).into_response(),
                None => (StatusCode::SERVICE_UNAVAILABLE, [close], "the worker is stopping\n").into_response(),
            }
        }
    };
    let not_found =
        || async { (StatusCode::NOT_FOUND, [(header::CONNECTION, "close")], "only GET /metrics is served here\n") };
    axum::Router::new().route("/metrics", axum::routing::get(page)).fallback(not_found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_core::{RequestId, Timestamp};

    /// A worker that finished one request (TTFT 30 ms, first answer token at 2 s, done at 3 s,
    /// 11 answer tokens), rejected one and committed one migration.
    fn worker_page() -> String {
        let mut stats = DriverStats::default();
        let s = |x: f64| Some(Timestamp((x * 1e9) as u64));
        stats.requests_metrics.observe(&RequestRecord {
            id: RequestId(1),
            arrival: Timestamp(0),
            answer_tokens: 11,
            first_token: s(0.03),
            first_answer_token: s(2.0),
            finish: s(3.0),
            ..RequestRecord::default()
        });
        stats.requests_metrics.observe(&RequestRecord { rejected: true, ..RequestRecord::default() });
        stats.engine.tokens = 90;
        stats.lateness.samples = 4;
        stats.lateness.mean_us = 250.0;
        stats.prefix.query_tokens = 1000;
        stats.prefix.hit_tokens = 640;
        stats.prefix.evictions = 3;
        stats.kv.tokens_reused = 512;
        let load = LoadReport {
            reasoning_requests: 1,
            answering_requests: 1,
            gpu_used_blocks: 1,
            gpu_total_blocks: 4,
            ..LoadReport::default()
        };
        let migrations =
            MigrationMetrics { committed: 1, bytes: 4096, bytes_skipped: 2048, ..MigrationMetrics::default() };
        migrations.downtime.observe(0.007);
        render("x", &stats, &load, &migrations)
    }

    #[test]
    fn the_page_has_cumulative_vllm_histograms_gauges_and_counters_by_name() {
        let out = worker_page();
        let has = |line: &str| assert!(out.lines().any(|l| l == line), "no line {line:?} in:\n{out}");
        // Histograms: HELP/TYPE, cumulative buckets, +Inf, sum and count.
        has("# HELP vllm:time_to_first_token_seconds Arrival to first output token (emulated time).");
        has("# TYPE vllm:time_to_first_token_seconds histogram");
        has(r#"vllm:time_to_first_token_seconds_bucket{model_name="x",le="0.02"} 0"#);
        has(r#"vllm:time_to_first_token_seconds_bucket{model_name="x",le="0.04"} 1"#);
        has(r#"vllm:time_to_first_token_seconds_bucket{model_name="x",le="320"} 1"#);
        has(r#"vllm:time_to_first_token_seconds_bucket{model_name="x",le="+Inf"} 1"#);
        has(r#"vllm:time_to_first_token_seconds_count{model_name="x"} 1"#);
        // TPOT: (3.0 - 2.0) / 10 answer tokens after the first.
        has(r#"vllm:time_per_output_token_seconds_bucket{model_name="x",le="0.075"} 0"#);
        has(r#"vllm:time_per_output_token_seconds_bucket{model_name="x",le="0.1"} 1"#);
        has(r#"vllm:time_per_output_token_seconds_sum{model_name="x"} 0.1"#);
        has(r#"kvfleet_migration_downtime_seconds_bucket{model_name="x",le="0.005"} 0"#);
        has(r#"kvfleet_migration_downtime_seconds_bucket{model_name="x",le="0.01"} 1"#);
        let buckets = out.lines().filter(|l| l.starts_with("vllm:e2e_request_latency_seconds_bucket")).count();
        assert_eq!(buckets, prom::LATENCY_BUCKETS.len() + 1);
        // Gauges and counters, the counters' HELP and TYPE named with `_total` as vLLM's.
        has("# TYPE vllm:num_requests_running gauge");
        has(r#"vllm:num_requests_running{model_name="x"} 2"#);
        has(r#"vllm:gpu_cache_usage_perc{model_name="x"} 0.25"#);
        has("# TYPE vllm:generation_tokens_total counter");
        has(r#"vllm:generation_tokens_total{model_name="x"} 90"#);
        has(r#"vllm:request_success_total{model_name="x",finished_reason="stop"} 1"#);
        has(r#"kvfleet_requests_rejected_total{model_name="x"} 1"#);
        has(r#"kvfleet_migrations_total{model_name="x",outcome="committed"} 1"#);
        has(r#"kvfleet_migrations_total{model_name="x",outcome="unknown"} 0"#);
        has(r#"kvfleet_migration_bytes_total{model_name="x"} 4096"#);
        has(r#"kvfleet_migration_bytes_skipped_total{model_name="x"} 2048"#);
        has(r#"vllm:prefix_cache_queries_total{model_name="x"} 1000"#);
        has(r#"vllm:prefix_cache_hits_total{model_name="x"} 640"#);
        has(r#"kvfleet_kv_tokens_reused_total{model_name="x"} 512"#);
        has(r#"kvfleet_prefix_cache_evictions_total{model_name="x",tier="gpu"} 3"#);
        // The summary prometheus-client has no type for.
        has("# TYPE kvfleet_timer_lateness_seconds summary");
        has(r#"kvfleet_timer_lateness_seconds_sum{model_name="x"} 0.001"#);
        has(r#"kvfleet_timer_lateness_seconds_count{model_name="x"} 4"#);
    }

    #[test]
    fn a_clone_shares_the_histograms() {
        let mut m = RequestMetrics::default();
        let snapshot = m.clone();
        m.observe(&RequestRecord { finish: Some(Timestamp(1_000_000_000)), ..RequestRecord::default() });
        let mut page = Exposition::new("x");
        page.histogram("e2e_seconds", "E2E.", &snapshot.e2e);
        assert!(page.encode().contains("e2e_seconds_count{model_name=\"x\"} 1\n"));
        assert_eq!((m.finished, snapshot.finished), (1, 0));
    }

    /// The answer to one raw HTTP/1.1 request, read until the server closes the connection.
    async fn ask(addr: std::net::SocketAddr, request: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        let mut reply = String::new();
        let read = s.read_to_string(&mut reply);
        tokio::time::timeout(std::time::Duration::from_secs(10), read).await.expect("the connection closes").unwrap();
        reply
    }

    #[tokio::test]
    async fn http_answers_metrics_and_404s_the_rest() {
        for (page, path, want) in
            [(Some(worker_page()), "/metrics", "200 OK"), (None, "/metrics", "503"), (Some(String::new()), "/", "404")]
        {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let app = router(move || std::future::ready(page.clone()));
            let server = tokio::spawn(async move { axum::serve(listener, app).await });
            let reply = ask(addr, &format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n")).await;
            server.abort();
            assert!(reply.starts_with(&format!("HTTP/1.1 {want}")), "{reply}");
            let ok = want == "200 OK";
            assert_eq!(reply.contains("content-type: text/plain; version=0.0.4; charset=utf-8\r\n"), ok, "{reply}");
            assert_eq!(reply.contains("\r\n\r\n# HELP vllm:num_requests_running "), ok, "{reply}");
        }
    }
}
