//! The live migrations of `kvfleet sim` runs, reported as `kvfleet up` reports the emulator's
//! (`up/live.rs`): one line per run (committed / aborted / refused, stages, downtime and transfer
//! time P50/P99) and `live-migrations-<stem>.csv`, written from the runs' [`MigrationRecord`]s
//! by the emulator's writer ([`live_migration_row`]).
//!
//! [`MigrationRecord`]: kvfleet_core::metrics::MigrationRecord

use crate::report::{live_migration_row, rate_text, run_stems, LIVE_MIGRATIONS_HEADER};
use anyhow::Context as _;
use kvfleet_sim::RunResult;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |s| format!("{:.1}", s * 1e3))
}

/// One line per run that migrated anything (empty when none did).
pub fn table(runs: &[RunResult]) -> String {
    let mut out = String::new();
    for run in runs.iter().filter(|r| !r.migrations.is_empty()) {
        if out.is_empty() {
            out.push_str("live migrations (virtual time, pipelined stop-and-copy over the [link] fabric):\n");
        }
        let l = &run.live_migrations;
        let rate = rate_text(run.rate);
        let _ = write!(out, "  {} @ {rate}: {} committed, {} aborted", run.policy, l.committed, l.aborted);
        if l.checksum_mismatches > 0 {
            let _ = write!(out, " ({} on a checksum mismatch)", l.checksum_mismatches);
        }
        let _ = write!(out, ", {} refused", l.refused);
        if l.committed > 0 {
            let _ = write!(
                out,
                " | stages {:.1} avg | downtime ms p50 {} p99 {} | transfer ms p50 {} p99 {}",
                l.stages_avg.unwrap_or(0.0),
                ms(l.downtime_p50_s),
                ms(l.downtime_p99_s),
                ms(l.transfer_p50_s),
                ms(l.transfer_p99_s),
            );
        }
        out.push('\n');
    }
    out.push_str(&flips(runs));
    out.push_str(&handoffs(runs));
    out
}

/// One line per run whose instances changed roles (Arrow's flips): how many each way.
fn flips(runs: &[RunResult]) -> String {
    let mut out = String::new();
    for run in runs.iter().filter(|r| !r.role_changes.is_empty()) {
        if out.is_empty() {
            out.push_str("role flips (prefill/decode pools):\n");
        }
        let to = |role: &str| run.role_changes.iter().filter(|c| c.role == role).count();
        let rate = rate_text(run.rate);
        let _ = writeln!(
            out,
            "  {} @ {rate}: {} flips, {} to decode, {} to prefill",
            run.policy,
            run.role_changes.len(),
            to("decode"),
            to("prefill")
        );
    }
    out
}

/// One line per prefill/decode run that handed requests off: q2, c and q3 P50/P99.
fn handoffs(runs: &[RunResult]) -> String {
    let mut out = String::new();
    for run in runs {
        let Some(h) = run.handoffs.as_ref().filter(|h| h.handoffs > 0) else { continue };
        if out.is_empty() {
            out.push_str("handoffs (prefill -> decode):\n");
        }
        let rate = rate_text(run.rate);
        let _ = writeln!(out, "  {} @ {rate}: {} handed off | {h}", run.policy, h.handoffs);
    }
    out
}

/// `live-migrations-<stem>.csv` per run that migrated anything; returns the paths written.
pub fn write_csvs(out_dir: &Path, runs: &[RunResult]) -> anyhow::Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    for (run, stem) in runs.iter().zip(run_stems(runs)) {
        if run.migrations.is_empty() {
            continue;
        }
        let path = out_dir.join(format!("live-migrations-{stem}.csv"));
        let mut text = format!("{LIVE_MIGRATIONS_HEADER}\n");
        for m in &run.migrations {
            text.push_str(&live_migration_row(m));
            text.push('\n');
        }
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::fixtures::TempDir;
    use kvfleet_sim::config::SimConfig;

    /// PASCAL on two instances with capped KV: requests migrate at `</think>`.
    fn run(policy: &str) -> RunResult {
        let text = "[cluster]\ninstances = 2\nkv_cache_gb = 3.0\ncpu_swap_gb = 8.0\n\
                    [workload]\nseed = 11\nnum_requests = 60\nmax_prompt_tokens = 2048\nmax_output_tokens = 2048\n\
                    [workload.arrivals]\nkind = \"poisson\"\nrate = 2.0\n\
                    [workload.lengths]\nkind = \"lognormal\"\nprompt_median = 200.0\nreasoning_median = 300.0\nanswer_median = 100.0\n";
        let cfg = SimConfig::parse(text, "test.toml").unwrap();
        kvfleet_sim::run_one(&cfg, policy, None, Path::new("."), |_| {}).unwrap()
    }

    #[test]
    fn runs_that_migrated_get_a_line_and_a_csv_row_per_migration() {
        let runs = vec![run("pascal"), run("fcfs")];
        let live = &runs[0].live_migrations;
        assert!(live.committed > 0, "{live:?}");
        let table = table(&runs);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 2, "a title and one line for pascal (fcfs never migrates):\n{table}");
        let want = format!(
            "pascal @ 2 req/s: {} committed, {} aborted, {} refused |",
            live.committed, live.aborted, live.refused
        );
        assert!(lines[1].contains(&want) && lines[1].contains("downtime ms p50"), "{table}");

        let tmp = TempDir::new("sim-live");
        std::fs::create_dir_all(&tmp.0).unwrap();
        let written = write_csvs(&tmp.0, &runs).unwrap();
        assert_eq!(written, [tmp.0.join("live-migrations-pascal-2.csv")]);
        let csv = std::fs::read_to_string(&written[0]).unwrap();
        let rows: Vec<&str> = csv.lines().collect();
        assert_eq!(rows[0], LIVE_MIGRATIONS_HEADER);
        assert_eq!(rows.len() - 1, runs[0].migrations.len());
        let committed = rows[1..].iter().filter(|r| r.split(',').nth(3) == Some("committed")).count();
        // Every stage's bytes come with its time, and the stages fit in the migration.
        for row in rows[1..].iter().filter(|r| r.split(',').nth(3) == Some("committed")) {
            let cells: Vec<&str> = row.split(',').collect();
            let ms: Vec<f64> = cells[12].split(';').map(|t| t.parse().unwrap()).collect();
            assert_eq!(ms.len(), cells[11].split(';').count(), "{row}");
            assert!(ms.iter().all(|&t| t > 0.0), "{row}");
            assert!(ms.iter().sum::<f64>() <= cells[8].parse::<f64>().unwrap() + 1e-3, "{row}");
        }
        assert_eq!(committed as u64, live.committed);
        assert_eq!(table, super::table(&[run("pascal"), run("fcfs")]), "the same run prints the same");
    }
}
