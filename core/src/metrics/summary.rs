//! One run's headline numbers, reduced from per-request records: PASCAL §V-A "Metric" (TTFT to the
//! first *answer* token; SLO violation = QoE < 0.95), Fig. 13 (reasoning latency and blocking
//! latency), §V-D (KV transfer latency), plus throughput (within 3 % of baselines, §V-B).
//!
//! [`RunSummary`] is flat so that a run is one JSON object and one CSV row. A statistic over an
//! empty set (no finished request, no migration) is `None`: `null` in JSON, an empty CSV cell.
//!
//! Which records feed which statistic:
//!
//! | statistic | records | value |
//! |---|---|---|
//! | TTFT | not rejected, with a first answer token (finished or not) | `first_answer_token − arrival` |
//! | TTFAT | those, with a reasoning end | `first_answer_token − reasoning_end` |
//! | TPOT | finished, ≥ 2 answer tokens | `(finish − first_answer_token) / (answer_tokens − 1)` |
//! | E2E | finished | `finish − arrival` |
//! | reasoning latency | with a reasoning end | `reasoning_end − arrival` |
//! | blocking latency | with a reasoning end and a first schedule after it | `first_scheduled_after_reasoning − reasoning_end` |
//! | QoE, SLO violation | finished, with a QoE | mean; share with `qoe < qoe_threshold` |
//! | throughput | finished | (reasoning + answer tokens) and requests ÷ makespan |
//!
//! "Finished" means `finish` is set and the request was not rejected. The makespan runs from the
//! first arrival of any record to the last finish. Percentiles are nearest-rank
//! ([`super::percentile`]).

use super::migration::MigrationRecord;
use super::percentile::Distribution;
use super::record::RequestRecord;
use crate::time::Timestamp;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

/// The service-level targets a run is judged against (PASCAL §V-A). Defaults: TPOT 0.1 s, TTFAT
/// 0.25 s, QoE threshold 0.95.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SloTargets {
    /// Target time per answer token: the reading pace of the QoE pacer.
    pub tpot_s: f64,
    /// Target time from the end of reasoning to the first answer token.
    pub ttfat_s: f64,
    /// A request violates its SLO when its QoE is below this.
    pub qoe_threshold: f64,
    /// Target time to first token (arrival → first answer token). Set, a request attains its SLO
    /// when it finished with TTFT and TPOT both within target ([`RunSummary::slo_attainment`],
    /// Arrow's and DistServe's goodput criterion).
    pub ttft_s: Option<f64>,
}

impl Default for SloTargets {
    fn default() -> Self {
        SloTargets { tpot_s: 0.1, ttfat_s: 0.25, qoe_threshold: 0.95, ttft_s: None }
    }
}

/// A run's summary. Latencies in seconds; `None` where the underlying set is empty.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    /// Request records in the run (finished, unfinished and rejected).
    pub requests_total: u64,
    /// Requests that finished (not rejected, `finish` set).
    pub requests_finished: u64,
    /// Requests rejected because they could never fit in an instance's GPU KV memory.
    pub requests_rejected: u64,

    /// Mean TTFT (arrival → first answer token).
    pub ttft_mean_s: Option<f64>,
    /// Median TTFT.
    pub ttft_p50_s: Option<f64>,
    /// P90 TTFT.
    pub ttft_p90_s: Option<f64>,
    /// P99 TTFT.
    pub ttft_p99_s: Option<f64>,
    /// Largest TTFT.
    pub ttft_max_s: Option<f64>,

    /// Mean TTFAT (end of reasoning → first answer token).
    pub ttfat_mean_s: Option<f64>,
    /// Median TTFAT.
    pub ttfat_p50_s: Option<f64>,
    /// P99 TTFAT.
    pub ttfat_p99_s: Option<f64>,
    /// Share of TTFAT samples `≤ slo_ttfat_s`.
    pub ttfat_within_target_frac: Option<f64>,

    /// Mean TPOT over the answer phase of finished requests.
    pub tpot_mean_s: Option<f64>,
    /// Median TPOT.
    pub tpot_p50_s: Option<f64>,
    /// P99 TPOT.
    pub tpot_p99_s: Option<f64>,

    /// Mean end-to-end latency (arrival → last token) of finished requests.
    pub e2e_mean_s: Option<f64>,
    /// Median end-to-end latency.
    pub e2e_p50_s: Option<f64>,
    /// P99 end-to-end latency.
    pub e2e_p99_s: Option<f64>,

    /// Mean reasoning latency (arrival → `</think>`), PASCAL Fig. 13.
    pub reasoning_latency_mean_s: Option<f64>,
    /// P99 reasoning latency.
    pub reasoning_latency_p99_s: Option<f64>,

    /// Median blocking latency (`</think>` → first iteration that runs the request again).
    pub blocking_latency_p50_s: Option<f64>,
    /// P99 blocking latency.
    pub blocking_latency_p99_s: Option<f64>,
    /// Largest blocking latency.
    pub blocking_latency_max_s: Option<f64>,

    /// Mean Andes QoE of finished requests (0–1; 1.0 when tokens always kept ahead of the reading pace).
    pub qoe_mean: Option<f64>,
    /// Share of finished requests (with a QoE) whose QoE is below `slo_qoe_threshold`.
    pub slo_violation_rate: Option<f64>,

    /// First arrival → last finish.
    pub makespan_s: Option<f64>,
    /// Reasoning + answer tokens of finished requests per second of makespan.
    pub throughput_output_tokens_per_s: Option<f64>,
    /// Finished requests per second of makespan.
    pub throughput_requests_per_s: Option<f64>,

    /// Preemptions summed over all requests.
    pub preemptions_total: u64,

    /// Prompt tokens first prefills found in a prefix cache (not computed).
    #[serde(default)]
    pub prefix_cached_tokens: u64,
    /// `prefix_cached_tokens` over the prompt tokens of every request that was not rejected;
    /// `None` when nothing was cached (no shared content, or prefix caching off).
    #[serde(default)]
    pub prefix_hit_rate: Option<f64>,
    /// Median TTFT of requests whose first prefill found nothing cached (`None` without caching).
    #[serde(default)]
    pub ttft_p50_no_hit_s: Option<f64>,
    /// Median TTFT of requests that found at most half their prompt cached.
    #[serde(default)]
    pub ttft_p50_low_hit_s: Option<f64>,
    /// Median TTFT of requests that found more than half their prompt cached.
    #[serde(default)]
    pub ttft_p50_high_hit_s: Option<f64>,

    /// With a TTFT target ([`SloTargets::ttft_s`]): the share of all requests (rejected and
    /// unfinished ones missing it) that finished with TTFT ≤ `slo_ttft_s` and TPOT ≤ `slo_tpot_s`.
    #[serde(default)]
    pub slo_attainment: Option<f64>,
    /// [`SloTargets::ttft_s`] used.
    #[serde(default)]
    pub slo_ttft_s: Option<f64>,
    /// Placements that first copied a cached prompt prefix from another instance
    /// (`cache-aware`).
    #[serde(default)]
    pub prefix_fetches: u64,
    /// Bytes those copies moved.
    #[serde(default)]
    pub prefix_fetch_bytes: u64,

    /// KV-cache migrations logged, aborted ones included.
    pub migrations_total: u64,
    /// Migrations that did not commit (the request stayed on its source): aborted ones and
    /// those the target refused.
    pub migrations_aborted: u64,
    /// Bytes of every migration, aborted ones included (what they sent before aborting).
    pub migration_bytes_total: u64,
    /// Block bytes migrations did not send because their target's prefix cache held them.
    #[serde(default)]
    pub migration_bytes_skipped: u64,
    /// Median `end − start` of committed migrations.
    pub migration_transfer_p50_s: Option<f64>,
    /// P99 transfer time of committed migrations.
    pub migration_transfer_p99_s: Option<f64>,

    /// The targets this summary was computed against, so a CSV row stands on its own:
    /// [`SloTargets::tpot_s`] used.
    pub slo_tpot_s: f64,
    /// [`SloTargets::ttfat_s`] used.
    pub slo_ttfat_s: f64,
    /// [`SloTargets::qoe_threshold`] used.
    pub slo_qoe_threshold: f64,
}

/// One CSV cell.
enum Cell {
    Count(u64),
    Value(Option<f64>),
}

impl RunSummary {
    /// Every field in declaration order (the order of the CSV columns) with its value. Keep in
    /// step with the struct: a test checks the names against the serde field names.
    fn cells(&self) -> Vec<(&'static str, Cell)> {
        use Cell::{Count as C, Value as V};
        vec![
            ("requests_total", C(self.requests_total)),
            ("requests_finished", C(self.requests_finished)),
            ("requests_rejected", C(self.requests_rejected)),
            ("ttft_mean_s", V(self.ttft_mean_s)),
            ("ttft_p50_s", V(self.ttft_p50_s)),
            ("ttft_p90_s", V(self.ttft_p90_s)),
            ("ttft_p99_s", V(self.ttft_p99_s)),
            ("ttft_max_s", V(self.ttft_max_s)),
            ("ttfat_mean_s", V(self.ttfat_mean_s)),
            ("ttfat_p50_s", V(self.ttfat_p50_s)),
            ("ttfat_p99_s", V(self.ttfat_p99_s)),
            ("ttfat_within_target_frac", V(self.ttfat_within_target_frac)),
            ("tpot_mean_s", V(self.tpot_mean_s)),
            ("tpot_p50_s", V(self.tpot_p50_s)),
            ("tpot_p99_s", V(self.tpot_p99_s)),
            ("e2e_mean_s", V(self.e2e_mean_s)),
            ("e2e_p50_s", V(self.e2e_p50_s)),
            ("e2e_p99_s", V(self.e2e_p99_s)),
            ("reasoning_latency_mean_s", V(self.reasoning_latency_mean_s)),
            ("reasoning_latency_p99_s", V(self.reasoning_latency_p99_s)),
            ("blocking_latency_p50_s", V(self.blocking_latency_p50_s)),
            ("blocking_latency_p99_s", V(self.blocking_latency_p99_s)),
            ("blocking_latency_max_s", V(self.blocking_latency_max_s)),
            ("qoe_mean", V(self.qoe_mean)),
            ("slo_violation_rate", V(self.slo_violation_rate)),
            ("makespan_s", V(self.makespan_s)),
            ("throughput_output_tokens_per_s", V(self.throughput_output_tokens_per_s)),
            ("throughput_requests_per_s", V(self.throughput_requests_per_s)),
            ("preemptions_total", C(self.preemptions_total)),
            ("migrations_total", C(self.migrations_total)),
            ("migrations_aborted", C(self.migrations_aborted)),
            ("migration_bytes_total", C(self.migration_bytes_total)),
            ("migration_bytes_skipped", C(self.migration_bytes_skipped)),
            ("migration_transfer_p50_s", V(self.migration_transfer_p50_s)),
            ("migration_transfer_p99_s", V(self.migration_transfer_p99_s)),
            ("slo_tpot_s", V(Some(self.slo_tpot_s))),
            ("slo_ttfat_s", V(Some(self.slo_ttfat_s))),
            ("slo_qoe_threshold", V(Some(self.slo_qoe_threshold))),
            ("prefix_cached_tokens", C(self.prefix_cached_tokens)),
            ("prefix_hit_rate", V(self.prefix_hit_rate)),
            ("ttft_p50_no_hit_s", V(self.ttft_p50_no_hit_s)),
            ("ttft_p50_low_hit_s", V(self.ttft_p50_low_hit_s)),
            ("ttft_p50_high_hit_s", V(self.ttft_p50_high_hit_s)),
            ("slo_attainment", V(self.slo_attainment)),
            ("slo_ttft_s", V(self.slo_ttft_s)),
            ("prefix_fetches", C(self.prefix_fetches)),
            ("prefix_fetch_bytes", C(self.prefix_fetch_bytes)),
        ]
    }

    /// The CSV header line (no trailing newline): the field names, comma-separated.
    pub fn csv_header() -> String {
        RunSummary::default().cells().iter().map(|(name, _)| *name).collect::<Vec<_>>().join(",")
    }

    /// This summary as one CSV line (no trailing newline), columns as in [`Self::csv_header`].
    /// `None` is an empty cell; numbers use Rust's shortest round-trip formatting.
    pub fn csv_row(&self) -> String {
        let mut row = String::new();
        for (i, (_, cell)) in self.cells().iter().enumerate() {
            if i > 0 {
                row.push(',');
            }
            // Writing to a String cannot fail.
            let _ = match cell {
                Cell::Count(n) => write!(row, "{n}"),
                Cell::Value(Some(v)) => write!(row, "{v}"),
                Cell::Value(None) => Ok(()),
            };
        }
        row
    }
}

fn span_s(from: Timestamp, to: Timestamp) -> f64 {
    to.saturating_since(from).as_secs_f64()
}

/// Reduces a run's request and migration logs to its [`RunSummary`] (see the module doc for which
/// records feed which statistic).
pub fn summarize(records: &[RequestRecord], migrations: &[MigrationRecord], slo: &SloTargets) -> RunSummary {
    let mut ttft = Vec::with_capacity(records.len());
    let mut ttfat = Vec::new();
    let mut tpot = Vec::with_capacity(records.len());
    let mut e2e = Vec::with_capacity(records.len());
    let mut reasoning = Vec::new();
    let mut blocking = Vec::new();
    let mut qoe = Vec::with_capacity(records.len());
    let mut attained = 0u64;
    let mut finished = 0u64;
    let mut rejected = 0u64;
    let mut output_tokens = 0u64;
    let mut preemptions = 0u64;
    let mut first_arrival: Option<Timestamp> = None;
    let mut last_finish: Option<Timestamp> = None;

    let (mut prompt_tokens, mut cached_tokens) = (0u64, 0u64);
    let mut ttft_by_hit: [Vec<f64>; 3] = Default::default();
    for r in records {
        preemptions += u64::from(r.preemptions);
        if !r.rejected {
            prompt_tokens += u64::from(r.prompt_tokens);
            cached_tokens += u64::from(r.cached_tokens);
        }
        first_arrival = Some(first_arrival.map_or(r.arrival, |a| a.min(r.arrival)));
        if r.rejected {
            rejected += 1;
            continue;
        }
        if let Some(fat) = r.first_answer_token {
            ttft.push(span_s(r.arrival, fat));
            // By the share of the prompt found cached: none, at most half, more than half.
            let bucket = match r.cached_tokens {
                0 => 0,
                c if u64::from(c) * 2 <= u64::from(r.prompt_tokens) => 1,
                _ => 2,
            };
            ttft_by_hit[bucket].push(span_s(r.arrival, fat));
            if let Some(end) = r.reasoning_end {
                ttfat.push(span_s(end, fat));
            }
        }
        if let Some(end) = r.reasoning_end {
            reasoning.push(span_s(r.arrival, end));
            if let Some(sched) = r.first_scheduled_after_reasoning {
                blocking.push(span_s(end, sched));
            }
        }
        let Some(finish) = r.finish else { continue };
        finished += 1;
        last_finish = Some(last_finish.map_or(finish, |f| f.max(finish)));
        output_tokens += u64::from(r.reasoning_tokens) + u64::from(r.answer_tokens);
        e2e.push(span_s(r.arrival, finish));
        let request_tpot = match (r.first_answer_token, r.answer_tokens >= 2) {
            (Some(fat), true) => Some(span_s(fat, finish) / f64::from(r.answer_tokens - 1)),
            _ => None,
        };
        if let Some(t) = request_tpot {
            tpot.push(t);
        }
        if let (Some(target), Some(fat)) = (slo.ttft_s, r.first_answer_token) {
            if span_s(r.arrival, fat) <= target && request_tpot.is_none_or(|t| t <= slo.tpot_s) {
                attained += 1;
            }
        }
        if let Some(q) = r.qoe {
            qoe.push(q);
        }
    }

    let ttft = Distribution::new(ttft);
    let by_hit: [Option<f64>; 3] =
        ttft_by_hit.map(|v| if cached_tokens == 0 { None } else { Distribution::new(v).percentile(0.5) });
    let ttfat = Distribution::new(ttfat);
    let tpot = Distribution::new(tpot);
    let e2e = Distribution::new(e2e);
    let reasoning = Distribution::new(reasoning);
    let blocking = Distribution::new(blocking);
    let slo_violation_rate = if qoe.is_empty() {
        None
    } else {
        Some(qoe.iter().filter(|&&q| q < slo.qoe_threshold).count() as f64 / qoe.len() as f64)
    };
    let qoe = Distribution::new(qoe);

    let makespan_s = match (first_arrival, last_finish) {
        (Some(a), Some(f)) => Some(span_s(a, f)),
        _ => None,
    };
    let per_s = |count: u64| makespan_s.filter(|&m| m > 0.0).map(|m| count as f64 / m);

    let transfers =
        Distribution::new(migrations.iter().filter(|m| m.committed()).map(MigrationRecord::transfer_s).collect());

    RunSummary {
        requests_total: records.len() as u64,
        requests_finished: finished,
        requests_rejected: rejected,
        ttft_mean_s: ttft.mean(),
        ttft_p50_s: ttft.percentile(0.5),
        ttft_p90_s: ttft.percentile(0.9),
        ttft_p99_s: ttft.percentile(0.99),
        ttft_max_s: ttft.max(),
        ttfat_mean_s: ttfat.mean(),
        ttfat_p50_s: ttfat.percentile(0.5),
        ttfat_p99_s: ttfat.percentile(0.99),
        ttfat_within_target_frac: ttfat.fraction_at_most(slo.ttfat_s),
        tpot_mean_s: tpot.mean(),
        tpot_p50_s: tpot.percentile(0.5),
        tpot_p99_s: tpot.percentile(0.99),
        e2e_mean_s: e2e.mean(),
        e2e_p50_s: e2e.percentile(0.5),
        e2e_p99_s: e2e.percentile(0.99),
        reasoning_latency_mean_s: reasoning.mean(),
        reasoning_latency_p99_s: reasoning.percentile(0.99),
        blocking_latency_p50_s: blocking.percentile(0.5),
        blocking_latency_p99_s: blocking.percentile(0.99),
        blocking_latency_max_s: blocking.max(),
        qoe_mean: qoe.mean(),
        slo_violation_rate,
        slo_attainment: slo.ttft_s.filter(|_| !records.is_empty()).map(|_| attained as f64 / records.len() as f64),
        makespan_s,
        throughput_output_tokens_per_s: per_s(output_tokens),
        throughput_requests_per_s: per_s(finished),
        preemptions_total: preemptions,
        prefix_cached_tokens: cached_tokens,
        prefix_hit_rate: (cached_tokens > 0).then(|| cached_tokens as f64 / prompt_tokens as f64),
        ttft_p50_no_hit_s: by_hit[0],
        ttft_p50_low_hit_s: by_hit[1],
        ttft_p50_high_hit_s: by_hit[2],
        migrations_total: migrations.len() as u64,
        migrations_aborted: migrations.iter().filter(|m| !m.committed()).count() as u64,
        migration_bytes_total: migrations.iter().map(|m| m.bytes).sum(),
        migration_bytes_skipped: migrations.iter().map(|m| m.bytes_skipped).sum(),
        migration_transfer_p50_s: transfers.percentile(0.5),
        migration_transfer_p99_s: transfers.percentile(0.99),
        slo_tpot_s: slo.tpot_s,
        slo_ttfat_s: slo.ttfat_s,
        slo_qoe_threshold: slo.qoe_threshold,
        slo_ttft_s: slo.ttft_s,
        prefix_fetches: 0,
        prefix_fetch_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{InstanceId, RequestId};
    use crate::metrics::MigrationOutcome;

    fn t(s: f64) -> Timestamp {
        Timestamp::from_secs_f64(s)
    }

    fn close(got: Option<f64>, want: f64) -> bool {
        got.is_some_and(|g| (g - want).abs() < 1e-9)
    }

    /// Four requests and a rejected one; expected values are worked out beside each record.
    fn hand_records() -> Vec<RequestRecord> {
        vec![
            // TTFT 2.1, TTFAT 0.1, TPOT (3.1−2.1)/10 = 0.1, E2E 3.1, reasoning 2.0, blocking 0.
            RequestRecord {
                id: RequestId(0),
                arrival: t(0.0),
                reasoning_tokens: 100,
                answer_tokens: 11,
                reasoning_end: Some(t(2.0)),
                first_scheduled_after_reasoning: Some(t(2.0)),
                first_answer_token: Some(t(2.1)),
                finish: Some(t(3.1)),
                qoe: Some(1.0),
                ..Default::default()
            },
            // TTFT 4.6, TTFAT 0.6, TPOT 2.0/4 = 0.5, E2E 6.6, reasoning 4.0, blocking 0.5.
            RequestRecord {
                id: RequestId(1),
                arrival: t(1.0),
                reasoning_tokens: 300,
                answer_tokens: 5,
                reasoning_end: Some(t(5.0)),
                first_scheduled_after_reasoning: Some(t(5.5)),
                first_answer_token: Some(t(5.6)),
                finish: Some(t(7.6)),
                qoe: Some(0.9),
                preemptions: 2,
                ..Default::default()
            },
            // No reasoning, one answer token: TTFT 0.5, E2E 0.5, no TPOT sample.
            RequestRecord {
                id: RequestId(2),
                arrival: t(2.0),
                answer_tokens: 1,
                first_answer_token: Some(t(2.5)),
                finish: Some(t(2.5)),
                qoe: Some(1.0),
                ..Default::default()
            },
            // Rejected: counted in totals only (its preemption too).
            RequestRecord { id: RequestId(3), arrival: t(3.0), rejected: true, ..Default::default() },
            // Unfinished at the end of the run: TTFT 4.2, TTFAT 2.2, reasoning 2.0, blocking 2.0.
            RequestRecord {
                id: RequestId(4),
                arrival: t(4.0),
                reasoning_tokens: 50,
                answer_tokens: 20,
                reasoning_end: Some(t(6.0)),
                first_scheduled_after_reasoning: Some(t(8.0)),
                first_answer_token: Some(t(8.2)),
                preemptions: 1,
                ..Default::default()
            },
        ]
    }

    fn hand_migrations() -> Vec<MigrationRecord> {
        let m = |id, bytes, start, end, outcome| MigrationRecord {
            request: RequestId(id),
            from: InstanceId(0),
            to: InstanceId(1),
            outcome,
            bytes,
            start: t(start),
            end: t(end),
            ..Default::default()
        };
        let (ok, aborted) = (MigrationOutcome::Committed, MigrationOutcome::Aborted("timed out".into()));
        vec![
            m(0, 1000, 2.0, 2.1, ok.clone()),
            m(1, 500, 5.0, 5.4, aborted),
            m(4, 2000, 6.0, 6.3, ok),
            // A refusal: nothing sent; counted among the aborted ones, not in the transfer times.
            m(5, 0, 7.0, 7.0, MigrationOutcome::Refused("refused by the target: no room".into())),
        ]
    }

    #[test]
    fn attainment_needs_both_targets_and_counts_every_request() {
        // (TTFT target, TPOT target, attainment): requests 0 (TTFT 2.1, TPOT 0.1), 1 (4.6, 0.5)
        // and 2 (0.5, no TPOT) finished; the rejected and the unfinished one never attain.
        let table = [(2.5, 0.2, 0.4), (5.0, 0.5, 0.6), (5.0, 0.2, 0.4), (2.0, 1.0, 0.2), (0.4, 1.0, 0.0)];
        for (ttft, tpot, want) in table {
            let slo = SloTargets { ttft_s: Some(ttft), tpot_s: tpot, ..SloTargets::default() };
            let s = summarize(&hand_records(), &[], &slo);
            assert!(close(s.slo_attainment, want), "TTFT ≤ {ttft}, TPOT ≤ {tpot}: {:?}", s.slo_attainment);
            assert_eq!(s.slo_ttft_s, Some(ttft));
        }
        assert_eq!(summarize(&hand_records(), &[], &SloTargets::default()).slo_attainment, None, "no TTFT target");
    }

    #[test]
    fn summarize_hand_built_run() {
        let s = summarize(&hand_records(), &hand_migrations(), &SloTargets::default());
        assert_eq!((s.requests_total, s.requests_finished, s.requests_rejected), (5, 3, 1));
        // TTFT {0.5, 2.1, 4.2, 4.6}: mean 11.4/4; P50 = x[ceil(2)−1] = 2.1; P90 = x[ceil(3.6)−1] = 4.6.
        let checks: &[(&str, Option<f64>, f64)] = &[
            ("ttft_mean", s.ttft_mean_s, 2.85),
            ("ttft_p50", s.ttft_p50_s, 2.1),
            ("ttft_p90", s.ttft_p90_s, 4.6),
            ("ttft_p99", s.ttft_p99_s, 4.6),
            ("ttft_max", s.ttft_max_s, 4.6),
            // TTFAT {0.1, 0.6, 2.2}: one of three within 0.25 s.
            ("ttfat_mean", s.ttfat_mean_s, 2.9 / 3.0),
            ("ttfat_p50", s.ttfat_p50_s, 0.6),
            ("ttfat_p99", s.ttfat_p99_s, 2.2),
            ("ttfat_within", s.ttfat_within_target_frac, 1.0 / 3.0),
            // TPOT {0.1, 0.5}.
            ("tpot_mean", s.tpot_mean_s, 0.3),
            ("tpot_p50", s.tpot_p50_s, 0.1),
            ("tpot_p99", s.tpot_p99_s, 0.5),
            // E2E {0.5, 3.1, 6.6}.
            ("e2e_mean", s.e2e_mean_s, 3.4),
            ("e2e_p50", s.e2e_p50_s, 3.1),
            ("e2e_p99", s.e2e_p99_s, 6.6),
            // Reasoning {2.0, 2.0, 4.0}; blocking {0, 0.5, 2.0}.
            ("reasoning_mean", s.reasoning_latency_mean_s, 8.0 / 3.0),
            ("reasoning_p99", s.reasoning_latency_p99_s, 4.0),
            ("blocking_p50", s.blocking_latency_p50_s, 0.5),
            ("blocking_p99", s.blocking_latency_p99_s, 2.0),
            ("blocking_max", s.blocking_latency_max_s, 2.0),
            // QoE {1.0, 0.9, 1.0}: one of three below 0.95.
            ("qoe_mean", s.qoe_mean, 2.9 / 3.0),
            ("violation", s.slo_violation_rate, 1.0 / 3.0),
            // Makespan 0 → 7.6 s; output tokens (100+11) + (300+5) + (0+1) = 417.
            ("makespan", s.makespan_s, 7.6),
            ("tok_per_s", s.throughput_output_tokens_per_s, 417.0 / 7.6),
            ("req_per_s", s.throughput_requests_per_s, 3.0 / 7.6),
            // Committed transfers {0.1, 0.3}.
            ("mig_p50", s.migration_transfer_p50_s, 0.1),
            ("mig_p99", s.migration_transfer_p99_s, 0.3),
        ];
        for (name, got, want) in checks {
            assert!(close(*got, *want), "{name}: got {got:?}, want {want}");
        }
        assert_eq!(s.preemptions_total, 3);
        // The refusal counts as aborted, as the summary always counted every migration that did
        // not commit.
        assert_eq!((s.migrations_total, s.migrations_aborted, s.migration_bytes_total), (4, 2, 3500));
    }

    #[test]
    fn violation_threshold_is_strict_and_configurable() {
        let recs = hand_records();
        let at = |thr: f64| {
            let slo = SloTargets { qoe_threshold: thr, ..SloTargets::default() };
            summarize(&recs, &[], &slo).slo_violation_rate
        };
        assert_eq!(at(0.9), Some(0.0), "QoE equal to the threshold is not a violation");
        assert_eq!(at(0.95), Some(1.0 / 3.0));
        assert_eq!(at(1.01), Some(1.0));
    }

    #[test]
    fn prefix_hits_are_summed_and_ttft_split_by_the_share_cached() {
        let rec = |id: u64, cached: u32, ttft: f64| RequestRecord {
            id: RequestId(id),
            prompt_tokens: 100,
            cached_tokens: cached,
            first_answer_token: Some(Timestamp::from_secs_f64(ttft)),
            ..Default::default()
        };
        let records = [rec(1, 0, 1.0), rec(2, 48, 2.0), rec(3, 50, 4.0), rec(4, 80, 3.0)];
        let s = summarize(&records, &[], &SloTargets::default());
        assert_eq!(s.prefix_cached_tokens, 178);
        assert_eq!(s.prefix_hit_rate, Some(0.445));
        assert_eq!((s.ttft_p50_no_hit_s, s.ttft_p50_high_hit_s), (Some(1.0), Some(3.0)));
        let low = s.ttft_p50_low_hit_s.expect("two requests at most half cached");
        assert!((2.0..=4.0).contains(&low), "{low}");
        // Nothing cached: no split.
        let none = summarize(&records[..1], &[], &SloTargets::default());
        assert_eq!((none.prefix_hit_rate, none.ttft_p50_no_hit_s), (None, None));
    }

    #[test]
    fn empty_run_is_all_none() {
        let s = summarize(&[], &[], &SloTargets::default());
        assert_eq!(s.requests_total, 0);
        assert_eq!(s.ttft_p99_s, None);
        assert_eq!(s.throughput_output_tokens_per_s, None);
        assert_eq!(s.migration_transfer_p99_s, None);
        assert_eq!(s.slo_violation_rate, None);
        let json = serde_json::to_value(&s).unwrap();
        assert!(json["ttft_p99_s"].is_null());
        let row = s.csv_row();
        assert!(row.starts_with("0,0,0,,,,"), "{row}");
        assert!(row.ends_with(",0.1,0.25,0.95,0,,,,,,,0,0"), "{row}");
    }

    #[test]
    fn csv_header_matches_serde_fields_and_row() {
        let s = summarize(&hand_records(), &hand_migrations(), &SloTargets::default());
        let header = RunSummary::csv_header();
        let mut columns: Vec<&str> = header.split(',').collect();
        let row = s.csv_row();
        assert_eq!(row.split(',').count(), columns.len());
        let json = serde_json::to_value(&s).unwrap();
        let mut keys: Vec<&str> = json.as_object().unwrap().keys().map(String::as_str).collect();
        columns.sort_unstable();
        keys.sort_unstable();
        assert_eq!(columns, keys);
        // Round trip through JSON.
        let back: RunSummary = serde_json::from_value(json).unwrap();
        assert_eq!(back, s);
        // The first cells in order.
        assert!(row.starts_with("5,3,1,2.85"), "{row}");
    }

    #[test]
    fn slo_targets_defaults_and_unknown_fields() {
        let d: SloTargets = toml::from_str("").unwrap();
        assert_eq!(d, SloTargets::default());
        let p: SloTargets = toml::from_str("qoe_threshold = 0.9").unwrap();
        assert_eq!((p.tpot_s, p.ttfat_s, p.qoe_threshold), (0.1, 0.25, 0.9));
        assert!(toml::from_str::<SloTargets>("qoe_treshold = 0.9").is_err());
    }
}
