//! The live migrations of a `kvfleet up` run, as the leader recorded them (each source's own
//! measurements): a summary table, `live-migrations.csv`, and the generic [`MigrationRecord`]s
//! the standard summary columns count.

use kvfleet_core::metrics::Distribution;
use kvfleet_core::metrics::MigrationRecord;
use kvfleet_core::{InstanceId, RequestId, Timestamp};
use kvfleet_proto::v1::MigrationStats;
use std::fmt::Write as _;
use std::path::Path;

fn total_s(m: &MigrationStats) -> f64 {
    m.total_ns() as f64 / 1e9
}

/// The standard per-migration records (start → end of the whole migration; aborted when it did
/// not commit).
pub fn records(log: &[MigrationStats]) -> Vec<MigrationRecord> {
    log.iter()
        .map(|m| MigrationRecord {
            request: RequestId(m.request_id),
            from: InstanceId(m.source),
            to: InstanceId(m.target),
            bytes: m.bytes,
            start: Timestamp(m.started_ns),
            end: Timestamp(m.ended_ns.max(m.started_ns)),
            aborted: !m.committed(),
        })
        .collect()
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |s| format!("{:.1}", s * 1e3))
}

/// One-screen summary: counts, P50/P99 total time and downtime, stages, bytes, goodput.
pub fn table(log: &[MigrationStats]) -> String {
    let ok: Vec<&MigrationStats> = log.iter().filter(|m| m.committed()).collect();
    let total = Distribution::new(ok.iter().map(|m| total_s(m)).collect());
    let down = Distribution::new(ok.iter().map(|m| m.downtime_ns as f64 / 1e9).collect());
    let bytes: u64 = ok.iter().map(|m| m.bytes).sum();
    let secs: f64 = ok.iter().map(|m| total_s(m)).sum();
    let stages = ok.iter().map(|m| m.stages as f64).sum::<f64>() / ok.len().max(1) as f64;
    let refused = log.iter().filter(|m| m.refused()).count();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "live migrations (QUIC, pipelined stop-and-copy): {} committed, {} aborted, {} refused by a full target \
         (nothing copied; the request stayed or went to another target)",
        ok.len(),
        log.len() - ok.len() - refused,
        refused
    );
    if ok.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "  total ms p50 {} p99 {} | downtime ms p50 {} p99 {} | stages {:.1} avg | {:.2} GiB moved | goodput {:.2} Gbit/s",
        ms(total.percentile(0.5)),
        ms(total.percentile(0.99)),
        ms(down.percentile(0.5)),
        ms(down.percentile(0.99)),
        stages,
        bytes as f64 / (1u64 << 30) as f64,
        if secs > 0.0 { bytes as f64 * 8.0 / secs / 1e9 } else { 0.0 }
    );
    for m in log.iter().filter(|m| !m.committed()).take(5) {
        let what = m.outcome_name();
        let _ = writeln!(out, "  {what}: request {} {}→{}: {}", m.request_id, m.source, m.target, m.abort_reason);
    }
    out
}

/// `live-migrations.csv`: one row per migration.
pub fn write_csv(path: &Path, log: &[MigrationStats]) -> std::io::Result<()> {
    let mut s = String::from(
        "request,source,target,outcome,kv_tokens,stages,blocks,bytes,total_ms,downtime_ms,goodput_gbps,stage_bytes,abort_reason\n",
    );
    for m in log {
        let t = total_s(m);
        let stage_bytes: Vec<String> = m.stage_bytes.iter().map(u64::to_string).collect();
        let _ = writeln!(
            s,
            "{},{},{},{},{},{},{},{},{:.3},{:.3},{:.3},{},\"{}\"",
            m.request_id,
            m.source,
            m.target,
            m.outcome_name(),
            m.kv_tokens,
            m.stages,
            m.blocks,
            m.bytes,
            t * 1e3,
            m.downtime_ns as f64 / 1e6,
            if t > 0.0 { m.bytes as f64 * 8.0 / t / 1e9 } else { 0.0 },
            stage_bytes.join(";"),
            m.abort_reason.replace('"', "'"),
        );
    }
    std::fs::write(path, s)
}
