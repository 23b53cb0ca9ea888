//! The live migrations of a `kvfleet up` run, as the leader recorded them (each source's own
//! measurements, `v1::MigrationStats`): turned into the [`MigrationRecord`]s the simulator fills
//! too ([`records`]), then a summary table and `live-migrations.csv` from those.

use crate::report::{live_migration_row, LIVE_MIGRATIONS_HEADER};
use kvfleet_core::metrics::{LiveMigrations, MigrationOutcome, MigrationRecord};
use kvfleet_core::{InstanceId, RequestId, TimeSpan, Timestamp};
use kvfleet_proto::v1::MigrationStats;
use std::fmt::Write as _;
use std::path::Path;

/// The leader's log as [`MigrationRecord`]s (start → end of the whole migration). What the log
/// does not carry: `kv_tokens_start` once the request paused (the log
/// keeps only the final count then), and `resumed_at` (it keeps the downtime). A paused
/// migration's last stage counts as its stop-and-copy.
pub fn records(log: &[MigrationStats]) -> Vec<MigrationRecord> {
    log.iter().map(record).collect()
}

fn record(m: &MigrationStats) -> MigrationRecord {
    let outcome = if m.committed() {
        MigrationOutcome::Committed
    } else if m.refused() {
        MigrationOutcome::Refused(m.abort_reason.clone())
    } else {
        MigrationOutcome::Aborted(m.abort_reason.clone())
    };
    let paused_at = (m.paused_ns != 0).then_some(Timestamp(m.paused_ns));
    let stages = m.stage_bytes.len() as u32;
    MigrationRecord {
        request: RequestId(m.request_id),
        from: InstanceId(m.source),
        to: InstanceId(m.target),
        outcome,
        checksum_mismatch: m.checksum_mismatch,
        in_doubt: m.in_doubt,
        bytes: m.bytes,
        bytes_skipped: m.bytes_skipped,
        start: Timestamp(m.started_ns),
        end: Timestamp(m.ended_ns.max(m.started_ns)),
        live_stages: if paused_at.is_some() { stages.saturating_sub(1) } else { stages },
        stage_bytes: m.stage_bytes.clone(),
        stage_times: m.stage_ns.iter().map(|&ns| TimeSpan(ns)).collect(),
        blocks: m.blocks,
        kv_tokens_start: paused_at.is_none().then_some(m.kv_tokens),
        kv_tokens_final: paused_at.map(|_| m.kv_tokens),
        paused_at,
        resumed_at: None,
        downtime: (paused_at.is_some() || m.downtime_ns != 0).then_some(TimeSpan(m.downtime_ns)),
    }
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |s| format!("{:.1}", s * 1e3))
}

/// One-screen summary of the leader's log: counts, P50/P99 total time and downtime, stages,
/// bytes, goodput.
pub fn table(log: &[MigrationStats]) -> String {
    records_table(&records(log))
}

fn records_table(migrations: &[MigrationRecord]) -> String {
    // The counts and distributions the simulator's migration line prints too.
    let live = LiveMigrations::new(migrations);
    let ok = || migrations.iter().filter(|m| m.committed());
    let skipped: u64 = ok().map(|m| m.bytes_skipped).sum();
    let secs: f64 = ok().map(MigrationRecord::transfer_s).sum();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "live migrations (QUIC, pipelined stop-and-copy): {} committed, {} aborted ({} on a checksum \
         mismatch), {} refused by the target (nothing copied: no room, or the request settled elsewhere; it \
         stayed or went to another target)",
        live.committed, live.aborted, live.checksum_mismatches, live.refused
    );
    if live.committed == 0 {
        return out;
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let _ = writeln!(
        out,
        "  total ms p50 {} p99 {} | downtime ms p50 {} p99 {} | stages {:.1} avg | {:.2} GiB moved{} | goodput {:.2} Gbit/s",
        ms(live.transfer_p50_s),
        ms(live.transfer_p99_s),
        ms(live.downtime_p50_s),
        ms(live.downtime_p99_s),
        live.stages_avg.unwrap_or(0.0),
        gib(live.bytes_committed),
        if skipped > 0 { format!(", {:.2} GiB not sent (cached at the target)", gib(skipped)) } else { String::new() },
        if secs > 0.0 { live.bytes_committed as f64 * 8.0 / secs / 1e9 } else { 0.0 }
    );
    for m in migrations.iter().filter(|m| !m.committed()).take(5) {
        let what = m.outcome_name();
        let why = m.abort_reason().unwrap_or_default();
        let _ = writeln!(out, "  {what}: request {} {}→{}: {why}", m.request.0, m.from.0, m.to.0);
    }
    out
}

/// `live-migrations.csv` of the leader's log: one row per migration, the columns of the
/// simulator's `live-migrations-<stem>.csv`.
pub fn write_csv(path: &Path, log: &[MigrationStats]) -> std::io::Result<()> {
    let mut s = format!("{LIVE_MIGRATIONS_HEADER}\n");
    for m in records(log) {
        s.push_str(&live_migration_row(&m));
        s.push('\n');
    }
    std::fs::write(path, s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_proto::REFUSED_PREFIX;

    fn stats(bytes: u64, paused_ns: u64, abort_reason: &str) -> MigrationStats {
        MigrationStats {
            source: 0,
            target: 1,
            request_id: 7,
            stages: 2,
            blocks: 30,
            bytes,
            started_ns: 1_000_000,
            paused_ns,
            ended_ns: 21_000_000,
            downtime_ns: if paused_ns != 0 { 500_000 } else { 0 },
            kv_tokens: 480,
            stage_bytes: vec![bytes / 2, bytes - bytes / 2],
            stage_ns: vec![12_000_000, 7_500_000],
            abort_reason: abort_reason.into(),
            in_doubt: false,
            bytes_skipped: 4096,
            checksum_mismatch: false,
        }
    }

    #[test]
    fn the_leaders_log_becomes_the_shared_record() {
        let ok = record(&stats(1 << 27, 15_000_000, ""));
        assert_eq!((ok.outcome_name(), ok.live_stages, ok.stages(), ok.blocks), ("committed", 1, 2, 30));
        assert_eq!((ok.kv_tokens_start, ok.kv_tokens_final, ok.kv_tokens()), (None, Some(480), 480));
        assert_eq!((ok.paused_at, ok.downtime), (Some(Timestamp(15_000_000)), Some(TimeSpan(500_000))));
        assert_eq!(ok.total_time(), TimeSpan(20_000_000));
        assert_eq!(ok.bytes_skipped, 4096);

        let mut refused = stats(0, 0, &format!("{REFUSED_PREFIX}: no room"));
        refused.stage_bytes.clear();
        let refused = record(&refused);
        assert_eq!((refused.outcome_name(), refused.live_stages, refused.downtime), ("refused", 0, None));
        assert_eq!((refused.kv_tokens_start, refused.kv_tokens_final), (Some(480), None));

        let log = [
            stats(1 << 27, 15_000_000, ""),
            stats(0, 0, &format!("{REFUSED_PREFIX}: no room")),
            stats(4096, 0, "timed out \"copying\""),
            MigrationStats {
                checksum_mismatch: true,
                ..stats(8192, 0, "peer aborted (ABORT_CODE_CHECKSUM_MISMATCH): checksum mismatch in block 3")
            },
        ];
        for (m, r) in log.iter().zip(records(&log)) {
            assert_eq!((m.outcome_name(), m.abort_reason.as_str()), (r.outcome_name(), r.abort_reason().unwrap_or("")));
        }
        let table = table(&log);
        assert!(
            table.starts_with(
                "live migrations (QUIC, pipelined stop-and-copy): 1 committed, 2 aborted (1 on a checksum mismatch), 1 refused"
            ),
            "{table}"
        );
        assert!(table.contains("  aborted: request 7 0→1: timed out \"copying\""), "{table}");
        assert!(table.contains("GiB not sent (cached at the target)"), "{table}");
    }

    #[test]
    fn the_csv_has_the_simulators_columns() {
        let dir = crate::report::fixtures::TempDir::new("up-live");
        std::fs::create_dir_all(&dir.0).unwrap();
        let path = dir.0.join("live-migrations.csv");
        write_csv(&path, &[stats(1 << 27, 15_000_000, ""), stats(4096, 0, "timed out \"copying\"")]).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let rows: Vec<&str> = text.lines().collect();
        assert_eq!(rows[0], LIVE_MIGRATIONS_HEADER);
        assert_eq!(
            rows[1],
            "7,0,1,committed,480,2,30,134217728,20.000,0.500,53.687,67108864;67108864,12.000;7.500,\"\""
        );
        assert_eq!(
            rows[2],
            "7,0,1,aborted,480,2,30,4096,20.000,0.000,0.000,2048;2048,12.000;7.500,\"timed out 'copying'\""
        );
    }
}
