//! Run results rendered for people and for other tools (JSON and CSV per run, a human summary
//! table): the headline numbers PASCAL §V reports — TTFT to the first *answer*
//! token (Fig. 10, 15(a)), SLO violation (Fig. 11, 15(b)), TPOT/E2E (Fig. 15(c)), blocking
//! latency (Fig. 13), KV transfer latency (§V-D) and throughput (§V-B).
//!
//! | output | what |
//! |---|---|
//! | [`summary_table`] | fixed-width text table, one row per run, ≤ 160 columns |
//! | `results.json` | every [`RunResult`] (summary + tail bins; per-request data is in the CSVs) |
//! | `summary.csv` | run identity, then [`RunSummary::csv_header`] columns |
//! | `requests-<policy>-<rate>.csv` | one row per [`RequestRecord`], derived latencies in seconds |
//! | `migrations-<policy>-<rate>.csv` | one row per [`MigrationRecord`], only when there were any (`aborted`: did not commit, refusals included) |
//! | `live-migrations*.csv` | one row per [`MigrationRecord`] with its outcome, stages and downtime ([`LIVE_MIGRATIONS_HEADER`], [`live_migration_row`]), written by `crate::sim_live` and `kvfleet up` / `kvfleet replay` alike |
//!
//! Every file is a pure function of the runs (no timestamps, no hash-map order; per-request
//! floats use a fixed `{:.6}`), so the same seed gives byte-identical outputs.

use anyhow::Context as _;
use kvfleet_core::metrics::{ttft_s, MigrationRecord, RequestRecord, RunSummary};
use kvfleet_core::time::Timestamp;
use kvfleet_sim::RunResult;
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// The widest the summary table may get.
const MAX_TABLE_COLUMNS: usize = 160;
/// Space between table columns.
const COLUMN_GAP: &str = "  ";

/// A run's rate as its report lines say it: `2.5 req/s`, or `trace` (the workload's own arrivals).
pub fn rate_text(rate: Option<f64>) -> String {
    rate.map_or_else(|| rate_label(None), |r| format!("{} req/s", rate_label(Some(r))))
}

/// A rate as it appears in file names and plot legends: shortest round-trip (`2.5`, `10`), or
/// `trace` for a run whose arrivals come from a trace.
pub fn rate_label(rate: Option<f64>) -> String {
    match rate {
        // Shortest round-trip (`2.5`), or scientific where that expansion is long: `1e308`, not
        // 309 digits (the label also names the run's files).
        Some(r) => {
            let (plain, sci) = (format!("{r}"), format!("{r:e}"));
            if plain.len() > 12 && sci.len() < plain.len() {
                sci
            } else {
                plain
            }
        }
        None => "trace".to_string(),
    }
}

/// `name` made safe for a file name: anything but ASCII alphanumerics and `.+-_` becomes `_`.
pub fn file_safe(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || "._+-".contains(c) { c } else { '_' }).collect()
}

/// The largest tail-bin TTFT of a run (PASCAL Fig. 10's worst bin), if any bin had ≥ 5 samples.
pub fn max_tail_ttft_s(run: &RunResult) -> Option<f64> {
    run.tail_ttft.iter().map(|b| b.ttft_s).fold(None, |m, v| Some(m.map_or(v, |m: f64| m.max(v))))
}

/// Left- or right-aligned column.
#[derive(Clone, Copy, PartialEq)]
enum Align {
    Left,
    Right,
}

/// The columns of [`summary_table`]: two header lines (name, unit) and alignment.
const COLUMNS: &[(&str, &str, Align)] = &[
    ("policy", "", Align::Left),
    ("rate", "req/s", Align::Right),
    ("done/total", "", Align::Right),
    ("TTFT", "p50 s", Align::Right),
    ("TTFT", "p99 s", Align::Right),
    ("tail TTFT", "max s", Align::Right),
    ("TTFAT", "p99 s", Align::Right),
    ("TPOT", "p50 s", Align::Right),
    ("E2E", "p50 s", Align::Right),
    ("blocking", "p99 s", Align::Right),
    ("SLO viol", "%", Align::Right),
    ("SLO attain", "%", Align::Right),
    ("output", "tok/s", Align::Right),
    ("migr", "#", Align::Right),
    ("migr xfer", "p99 s", Align::Right),
    ("preempt", "#", Align::Right),
    ("prefix hit", "%", Align::Right),
];

fn opt(v: Option<f64>, decimals: usize) -> String {
    match v {
        Some(v) if v.is_finite() => format!("{v:.decimals$}"),
        _ => "-".to_string(),
    }
}

/// The cells of one run's row, in [`COLUMNS`] order.
fn row_cells(run: &RunResult, seeds: bool) -> Vec<String> {
    let s = &run.summary;
    vec![
        if seeds { format!("{} s{}", run.policy, run.seed) } else { run.policy.clone() },
        opt(run.rate, 2),
        format!("{}/{}", s.requests_finished, s.requests_total),
        opt(s.ttft_p50_s, 3),
        opt(s.ttft_p99_s, 3),
        opt(max_tail_ttft_s(run), 3),
        opt(s.ttfat_p99_s, 3),
        opt(s.tpot_p50_s, 4),
        opt(s.e2e_p50_s, 3),
        opt(s.blocking_latency_p99_s, 3),
        opt(s.slo_violation_rate.map(|r| r * 100.0), 2),
        opt(s.slo_attainment.map(|r| r * 100.0), 1),
        opt(s.throughput_output_tokens_per_s, 1),
        s.migrations_total.to_string(),
        opt(s.migration_transfer_p99_s, 3),
        s.preemptions_total.to_string(),
        opt(s.prefix_hit_rate.map(|r| r * 100.0), 1),
    ]
}

/// `text` cut to `width` characters, the last one replaced by `~` when it was cut.
fn fit(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        return text.to_string();
    }
    let mut cut: String = text.chars().take(width.saturating_sub(1)).collect();
    cut.push('~');
    cut
}

/// A fixed-width table, one row per run: policy (with ` s<seed>` when the runs use several
/// seeds), rate, finished/total, TTFT p50/p99, the worst
/// tail-bin TTFT, TTFAT p99, TPOT p50, E2E p50, blocking p99, SLO violation %, SLO attainment %
/// (TTFT and TPOT within target, with a TTFT target set), output
/// throughput, migrations (count, P99 transfer), preemptions and the prefix-cache hit rate.
/// Missing values print as `-`.
/// Columns size to their content; the policy column is shortened (ending in `~`) when the table
/// would otherwise exceed 160 columns.
pub fn summary_table(runs: &[RunResult]) -> String {
    let seeds = several_seeds(runs);
    let rows: Vec<Vec<String>> = runs.iter().map(|r| row_cells(r, seeds)).collect();
    let mut widths: Vec<usize> = COLUMNS.iter().map(|(name, unit, _)| name.len().max(unit.len())).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let others: usize = widths[1..].iter().sum::<usize>() + COLUMN_GAP.len() * (widths.len() - 1);
    widths[0] = widths[0].min(MAX_TABLE_COLUMNS.saturating_sub(others)).max(COLUMNS[0].0.len());

    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (i, (cell, &(_, _, align))) in cells.zip(COLUMNS).enumerate() {
            if i > 0 {
                text.push_str(COLUMN_GAP);
            }
            let w = widths[i];
            let cell = fit(cell, w);
            // Writing to a String cannot fail.
            let _ = match align {
                Align::Left => write!(text, "{cell:<w$}"),
                Align::Right => write!(text, "{cell:>w$}"),
            };
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut COLUMNS.iter().map(|c| c.0));
    line(&mut COLUMNS.iter().map(|c| c.1));
    for row in &rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

/// A CSV field, quoted when it holds a separator, quote or line break.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// Seconds between two optional instants, `{:.6}`, or an empty cell.
fn span_cell(from: Option<Timestamp>, to: Option<Timestamp>) -> String {
    match (from, to) {
        (Some(a), Some(b)) => format!("{:.6}", b.saturating_since(a).as_secs_f64()),
        _ => String::new(),
    }
}

fn opt_cell(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.6}")).unwrap_or_default()
}

const REQUESTS_HEADER: &str = "id,arrival_s,prompt_tokens,reasoning_tokens,answer_tokens,placed_on,finished_on,\
ttft_s,ttfat_s,e2e_s,blocking_s,qoe,preemptions,migrations,rejected,cached_tokens,q3_s,replaced";

/// One request as a CSV line (no newline). Latencies follow [`kvfleet_core::metrics::summary`]:
/// a rejected request has none. `q3_s` is the wait in the queue of the instance its last
/// migration moved it to (a prefill → decode handoff's decode-queue wait): from that migration's
/// commit (`migrated_in`) to the start of the first iteration that ran it there; empty for a
/// request that never migrated. `replaced`: times the cluster started it over on another
/// instance (its instance died, or its handoff's bytes failed their checksum twice).
fn request_row(r: &RequestRecord) -> String {
    let live = !r.rejected;
    let (ttfat, e2e, blocking, q3) = if live {
        (
            span_cell(r.reasoning_end, r.first_answer_token),
            span_cell(Some(r.arrival), r.finish),
            span_cell(r.reasoning_end, r.first_scheduled_after_reasoning),
            span_cell(r.migrated_in, r.first_scheduled_after_migration),
        )
    } else {
        Default::default()
    };
    format!(
        "{},{:.6},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
        r.id.0,
        r.arrival.as_secs_f64(),
        r.prompt_tokens,
        r.reasoning_tokens,
        r.answer_tokens,
        r.placed_on.0,
        r.finished_on.map(|i| i.0.to_string()).unwrap_or_default(),
        opt_cell(ttft_s(r)),
        ttfat,
        e2e,
        blocking,
        opt_cell(r.qoe),
        r.preemptions,
        r.migrations,
        r.rejected,
        r.cached_tokens,
        q3,
        r.replaced,
    )
}

const MIGRATIONS_HEADER: &str = "request,from,to,bytes,start_s,end_s,transfer_s,aborted";

fn migration_row(m: &MigrationRecord) -> String {
    format!(
        "{},{},{},{},{:.6},{:.6},{:.6},{}",
        m.request.0,
        m.from.0,
        m.to.0,
        m.bytes,
        m.start.as_secs_f64(),
        m.end.as_secs_f64(),
        m.transfer_s(),
        !m.committed()
    )
}

/// The columns of `live-migrations*.csv`, the simulator's and the emulator's alike.
pub const LIVE_MIGRATIONS_HEADER: &str =
    "request,source,target,outcome,kv_tokens,stages,blocks,bytes,total_ms,downtime_ms,goodput_gbps,stage_bytes,stage_ms,abort_reason";

/// The most rejected requests a run's note names.
const REJECTED_NAMED: usize = 10;

/// One line per run that rejected requests, naming them (the first [`REJECTED_NAMED`]), so none
/// is lost silently (the per-request CSV flags each one too): a request the simulator rejects
/// never fits one instance's KV cache. Empty when no run rejected any.
pub fn rejected_note(runs: &[RunResult]) -> String {
    let mut out = String::new();
    for run in runs {
        let mut rejected: Vec<&RequestRecord> = run.records.iter().filter(|r| r.rejected).collect();
        if rejected.is_empty() {
            continue;
        }
        rejected.sort_by_key(|r| r.id);
        let named: Vec<String> = rejected
            .iter()
            .take(REJECTED_NAMED)
            .map(|r| {
                format!("request {} ({} + {} tokens)", r.id.0, r.prompt_tokens, r.reasoning_tokens + r.answer_tokens)
            })
            .collect();
        let more = rejected.len().saturating_sub(REJECTED_NAMED);
        let rate = rate_text(run.rate);
        let _ = writeln!(
            out,
            "rejected: {} @ {rate}: {} request(s) never fit an instance (prompt + output beyond its KV cache): {}{}",
            run.policy,
            rejected.len(),
            named.join(", "),
            if more > 0 { format!(" and {more} more (the per-request CSV lists them)") } else { String::new() }
        );
    }
    out
}

/// One row of `live-migrations*.csv` ([`LIVE_MIGRATIONS_HEADER`]), without newline.
pub fn live_migration_row(m: &MigrationRecord) -> String {
    let stage_bytes: Vec<String> = m.stage_bytes.iter().map(u64::to_string).collect();
    let stage_ms: Vec<String> = m.stage_times.iter().map(|t| format!("{:.3}", t.as_secs_f64() * 1e3)).collect();
    format!(
        "{},{},{},{},{},{},{},{},{:.3},{:.3},{:.3},{},{},\"{}\"",
        m.request.0,
        m.from.0,
        m.to.0,
        m.outcome_name(),
        m.kv_tokens(),
        m.stages(),
        m.blocks,
        m.bytes,
        m.transfer_s() * 1e3,
        m.downtime.map_or(0.0, |d| d.as_secs_f64() * 1e3),
        m.goodput_gbps(),
        stage_bytes.join(";"),
        stage_ms.join(";"),
        m.abort_reason().map(|r| r.replace('"', "'")).unwrap_or_default(),
    )
}

/// Write `header` and `rows` (each without newline) to `path`.
fn write_csv(path: &Path, header: &str, rows: impl Iterator<Item = String>) -> anyhow::Result<()> {
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = BufWriter::new(file);
    let write_all = || -> std::io::Result<()> {
        writeln!(w, "{header}")?;
        for row in rows {
            writeln!(w, "{row}")?;
        }
        w.flush()
    };
    write_all().with_context(|| format!("writing {}", path.display()))
}

/// Whether the runs use more than one workload seed.
pub fn several_seeds(runs: &[RunResult]) -> bool {
    runs.iter().any(|r| r.seed != runs[0].seed)
}

/// Unique `<policy>-<rate>` stems (`<policy>-<rate>-seed<seed>` when the runs use several
/// seeds), one per run in order; a repeated one gets `-2`, `-3`, … so no run overwrites another's
/// files.
pub fn run_stems(runs: &[RunResult]) -> Vec<String> {
    let mut seen = BTreeSet::new();
    let seeds = several_seeds(runs);
    runs.iter()
        .map(|run| {
            let mut base = format!("{}-{}", file_safe(&run.policy), file_safe(&rate_label(run.rate)));
            if seeds {
                base.push_str(&format!("-seed{}", run.seed));
            }
            let mut stem = base.clone();
            let mut k = 1;
            while !seen.insert(stem.clone()) {
                k += 1;
                stem = format!("{base}-{k}");
            }
            stem
        })
        .collect()
}

/// Writes `results.json`, `summary.csv`, and per run `requests-<stem>.csv` (plus
/// `migrations-<stem>.csv` when it migrated anything) into `out_dir`, creating it. Returns the
/// paths written, in that order.
pub fn write_outputs(out_dir: &Path, runs: &[RunResult]) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating output directory {}", out_dir.display()))?;
    let mut written = Vec::new();

    let json_path = out_dir.join("results.json");
    let mut json = serde_json::to_string_pretty(runs).context("serializing run results")?;
    json.push('\n');
    std::fs::write(&json_path, json).with_context(|| format!("writing {}", json_path.display()))?;
    written.push(json_path);

    let summary_path = out_dir.join("summary.csv");
    let header = format!("policy,intra,instance_policy,rate,seed,timing,{}", RunSummary::csv_header());
    let rows = runs.iter().map(|run| {
        format!(
            "{},{},{},{},{},{},{}",
            csv_field(&run.policy),
            csv_field(&run.intra),
            csv_field(&run.instance_policy),
            // Shortest round-trip, like the summary's own cells.
            run.rate.map(|r| r.to_string()).unwrap_or_default(),
            run.seed,
            csv_field(&run.timing),
            run.summary.csv_row()
        )
    });
    write_csv(&summary_path, &header, rows)?;
    written.push(summary_path);

    for (run, stem) in runs.iter().zip(run_stems(runs)) {
        let path = out_dir.join(format!("requests-{stem}.csv"));
        // By id, so the file does not depend on the order requests finished in.
        let mut order: Vec<&RequestRecord> = run.records.iter().collect();
        order.sort_by_key(|r| r.id);
        write_csv(&path, REQUESTS_HEADER, order.into_iter().map(request_row))?;
        written.push(path);
        if !run.migrations.is_empty() {
            let path = out_dir.join(format!("migrations-{stem}.csv"));
            write_csv(&path, MIGRATIONS_HEADER, run.migrations.iter().map(migration_row))?;
            written.push(path);
        }
    }
    Ok(written)
}

/// Hand-built runs shared by this file's and [`crate::plots`]' tests.
#[cfg(test)]
pub(crate) mod fixtures {
    use kvfleet_core::ids::{InstanceId, RequestId};
    use kvfleet_core::metrics::{MigrationOutcome, MigrationRecord, RequestRecord, SloTargets};
    use kvfleet_core::time::Timestamp;
    use kvfleet_sim::{RunIdentity, RunResult};
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn t(s: f64) -> Timestamp {
        Timestamp::from_secs_f64(s)
    }

    /// `n` finished requests with reasoning lengths spread over a few 256-token bins and TTFTs
    /// that grow with `slowdown`; every tenth is slow to answer (QoE 0.5), one is rejected.
    pub fn records(n: u64, slowdown: f64) -> Vec<RequestRecord> {
        (0..n)
            .map(|i| {
                let arrival = i as f64 * 0.5;
                let reasoning_tokens = (i % 4) as u32 * 256 + 10;
                let reasoning_end = arrival + 0.01 * f64::from(reasoning_tokens) * slowdown;
                let fat = reasoning_end + 0.1 * slowdown;
                let rejected = i == n - 1;
                RequestRecord {
                    cached_tokens: 0,
                    id: RequestId(n - 1 - i), // out of id order on purpose
                    arrival: t(arrival),
                    prompt_tokens: 100,
                    reasoning_tokens,
                    answer_tokens: 20,
                    placed_on: InstanceId((i % 2) as u32),
                    finished_on: (!rejected).then_some(InstanceId(1)),
                    first_scheduled: Some(t(arrival + 0.01)),
                    first_token: Some(t(arrival + 0.05)),
                    reasoning_end: Some(t(reasoning_end)),
                    first_scheduled_after_reasoning: Some(t(reasoning_end + 0.02)),
                    first_answer_token: (!rejected).then_some(t(fat)),
                    finish: (!rejected).then_some(t(fat + 1.9)),
                    qoe: (!rejected).then_some(if i % 10 == 0 { 0.5 } else { 1.0 }),
                    preemptions: u32::from(i % 7 == 0),
                    migrations: u32::from(i % 3 == 0),
                    rejected,
                    migrated_in: (i % 3 == 0).then_some(t(arrival + 0.07)),
                    first_scheduled_after_migration: (i % 3 == 0).then_some(t(arrival + 0.0725)),
                    replaced: 0,
                }
            })
            .collect()
    }

    pub fn run(
        policy: &str,
        rate: Option<f64>,
        records: Vec<RequestRecord>,
        migrations: Vec<MigrationRecord>,
    ) -> RunResult {
        let id = RunIdentity {
            policy: policy.to_string(),
            intra: "pascal".to_string(),
            instance_policy: "least-kv".to_string(),
            rate,
            timing: "analytic".to_string(),
            seed: 42,
        };
        RunResult::new(id, records, migrations, &SloTargets::default(), 42.0).with_engine_counters(
            Vec::new(),
            1234,
            1234,
        )
    }

    pub fn migrations(n: u64) -> Vec<MigrationRecord> {
        (0..n)
            .map(|i| MigrationRecord {
                request: RequestId(i * 3),
                from: InstanceId(0),
                to: InstanceId(1),
                bytes: 1 << 20,
                outcome: if i == 1 {
                    MigrationOutcome::Aborted("timed out".into())
                } else {
                    MigrationOutcome::Committed
                },
                start: t(i as f64),
                end: t(i as f64 + 0.125),
                ..Default::default()
            })
            .collect()
    }

    /// Two policies at two rates (the second rate slower), PASCAL with migrations.
    pub fn sweep() -> Vec<RunResult> {
        let mut runs = Vec::new();
        for (rate, slow) in [(1.0, 1.0), (2.5, 3.0)] {
            runs.push(run("pascal", Some(rate), records(40, slow), migrations(3)));
            runs.push(run("fcfs", Some(rate), records(40, slow * 4.0), Vec::new()));
        }
        runs
    }

    /// A fresh, empty directory under the system temp dir; removed by [`TempDir`]'s drop.
    pub struct TempDir(pub PathBuf);

    impl TempDir {
        pub fn new(tag: &str) -> TempDir {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!("kvfleet-{tag}-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::{self, TempDir};
    use super::*;

    fn read(path: &Path) -> String {
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    #[test]
    fn rejected_requests_are_named_per_run() {
        let runs = fixtures::sweep();
        let note = rejected_note(&runs);
        let rejecting = runs.iter().filter(|r| r.records.iter().any(|x| x.rejected)).count();
        assert!(rejecting > 0, "the fixtures reject a request per run");
        assert_eq!(note.lines().count(), rejecting, "{note}");
        let line = note.lines().next().unwrap();
        assert!(line.contains(&format!("{} @", runs[0].policy)) && line.contains(": 1 request(s) never fit"), "{line}");
        let r = runs[0].records.iter().find(|r| r.rejected).unwrap();
        let named =
            format!(": request {} ({} + {} tokens)", r.id.0, r.prompt_tokens, r.reasoning_tokens + r.answer_tokens);
        assert!(line.ends_with(&named), "{line}");
        let mut all = fixtures::sweep().remove(0);
        all.records.iter_mut().for_each(|x| x.rejected = true);
        let n = all.records.len();
        assert!(n > REJECTED_NAMED, "the fixture run has {n} requests");
        let line = rejected_note(std::slice::from_ref(&all));
        assert!(line.contains(&format!(": {n} request(s)")), "{line}");
        assert!(line.contains(&format!(" and {} more", n - REJECTED_NAMED)), "{line}");
        assert_eq!(line.matches(" tokens)").count(), REJECTED_NAMED, "{line}");
        let none: Vec<RunResult> = runs
            .into_iter()
            .map(|mut r| {
                r.records.iter_mut().for_each(|x| x.rejected = false);
                r
            })
            .collect();
        assert_eq!(rejected_note(&none), "");
    }

    #[test]
    fn table_has_a_row_per_run_and_dashes_for_missing() {
        let mut runs = fixtures::sweep();
        // A trace run where nothing finished: every latency is missing.
        runs.push(fixtures::run("round-robin", None, Vec::new(), Vec::new()));
        let table = summary_table(&runs);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 2 + runs.len(), "{table}");
        for (line, run) in lines[2..].iter().zip(&runs) {
            assert!(line.starts_with(&run.policy), "{line}");
        }
        let empty = lines.last().expect("row");
        let cells: Vec<&str> = empty.split_whitespace().collect();
        assert_eq!(cells.len(), COLUMNS.len(), "{empty}");
        // policy, rate, done/total, 10 latencies/rates, migr, migr p99, preempt, prefix hit.
        assert_eq!(cells[1], "-");
        assert_eq!(cells[2], "0/0");
        assert!(cells[3..13].iter().all(|c| *c == "-"), "{empty}");
        assert_eq!(&cells[13..], ["0", "-", "0", "-"]);
        // A full row: pascal at 1 req/s, 39 of 40 finished, 3 migrations.
        let pascal: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(&pascal[..3], ["pascal", "1.00", "39/40"]);
        assert_eq!(pascal[13], "3");
        // Every cell but the SLO attainment (no TTFT target) and the prefix-cache hit rate (these
        // prompts share no content).
        let blank: Vec<usize> = (0..pascal.len()).filter(|&i| pascal[i] == "-").collect();
        assert_eq!(blank, [11, pascal.len() - 1], "{}", lines[2]);
        assert!(lines.iter().all(|l| l.chars().count() <= MAX_TABLE_COLUMNS), "{table}");
    }

    #[test]
    fn table_shortens_long_policy_names_to_fit() {
        let long = "x".repeat(300);
        let table = summary_table(&[fixtures::run(&long, Some(1.0), fixtures::records(10, 1.0), Vec::new())]);
        assert!(table.lines().all(|l| l.chars().count() <= MAX_TABLE_COLUMNS), "{table}");
        assert!(table.contains("x~"), "{table}");
    }

    #[test]
    fn rate_labels_stay_short() {
        let label = |r| rate_label(Some(r));
        assert_eq!(
            [label(2.5), label(10.0), label(1e-9), label(1e308), label(1e-300)],
            ["2.5", "10", "0.000000001", "1e308", "1e-300"]
        );
        assert_eq!(rate_label(None), "trace");
    }

    #[test]
    fn stems_are_file_safe_and_unique() {
        let runs = vec![
            fixtures::run("pascal", Some(2.5), Vec::new(), Vec::new()),
            fixtures::run("pascal", Some(2.5), Vec::new(), Vec::new()),
            fixtures::run("fcfs+least-kv", None, Vec::new(), Vec::new()),
            fixtures::run("a/b c", Some(10.0), Vec::new(), Vec::new()),
        ];
        assert_eq!(run_stems(&runs), ["pascal-2.5", "pascal-2.5-2", "fcfs+least-kv-trace", "a_b_c-10"]);
    }

    #[test]
    fn outputs_exist_parse_back_and_are_byte_identical() {
        let runs = fixtures::sweep();
        let dir = TempDir::new("report");
        let paths = write_outputs(&dir.0, &runs).expect("write");
        let names: Vec<String> =
            paths.iter().map(|p| p.file_name().and_then(|n| n.to_str()).unwrap_or("").to_string()).collect();
        assert_eq!(
            names,
            [
                "results.json",
                "summary.csv",
                "requests-pascal-1.csv",
                "migrations-pascal-1.csv",
                "requests-fcfs-1.csv",
                "requests-pascal-2.5.csv",
                "migrations-pascal-2.5.csv",
                "requests-fcfs-2.5.csv",
            ]
        );
        assert!(paths.iter().all(|p| p.starts_with(&dir.0) && p.is_file()));

        // results.json: an array of the runs with their summaries.
        let json: serde_json::Value = serde_json::from_str(&read(&paths[0])).expect("json");
        let array = json.as_array().expect("array");
        assert_eq!(array.len(), runs.len());
        assert_eq!(array[1]["policy"], "fcfs");
        assert_eq!(array[0]["summary"]["requests_finished"], 39);
        assert_eq!(array[2]["rate"], 2.5);

        // summary.csv: header + one row per run, every row as wide as the header.
        let summary = read(&paths[1]);
        let lines: Vec<&str> = summary.lines().collect();
        assert_eq!(lines.len(), 1 + runs.len());
        let header: Vec<&str> = lines[0].split(',').collect();
        assert_eq!(&header[..7], ["policy", "intra", "instance_policy", "rate", "seed", "timing", "requests_total"]);
        let p99 = header.iter().position(|h| *h == "ttft_p99_s").expect("ttft_p99_s column");
        for (line, run) in lines[1..].iter().zip(&runs) {
            let cells: Vec<&str> = line.split(',').collect();
            assert_eq!(cells.len(), header.len(), "{line}");
            assert_eq!(cells[0], run.policy);
            assert_eq!(cells[3].parse::<f64>().ok(), run.rate);
            assert_eq!(cells[p99].parse::<f64>().ok(), run.summary.ttft_p99_s);
        }

        // requests CSV: header + every record, sorted by id, latencies parse back.
        let requests = read(&paths[2]);
        let lines: Vec<&str> = requests.lines().collect();
        assert_eq!(lines[0], REQUESTS_HEADER);
        assert_eq!(lines.len(), 1 + runs[0].records.len());
        let width = REQUESTS_HEADER.split(',').count();
        let mut last_id = None;
        let mut ttfts = Vec::new();
        for line in &lines[1..] {
            let cells: Vec<&str> = line.split(',').collect();
            assert_eq!(cells.len(), width, "{line}");
            let id: u64 = cells[0].parse().expect("id");
            assert!(last_id < Some(id), "ids ascending: {line}");
            last_id = Some(id);
            let rejected: bool = cells[14].parse().expect("rejected");
            let migrated = cells[13] != "0";
            if rejected || !migrated {
                assert_eq!(cells[16], "", "q3 only after a migration: {line}");
            } else {
                assert_eq!(cells[16], "0.002500", "{line}");
            }
            if rejected {
                assert_eq!(&cells[6..12], ["", "", "", "", "", ""], "{line}");
            } else {
                ttfts.push(cells[7].parse::<f64>().expect("ttft_s"));
                let e2e: f64 = cells[9].parse().expect("e2e_s");
                assert!(e2e >= ttfts[ttfts.len() - 1], "{line}");
            }
        }
        assert_eq!(ttfts.len() as u64, runs[0].summary.requests_finished);
        let max = ttfts.iter().cloned().fold(0.0, f64::max);
        assert!((max - runs[0].summary.ttft_max_s.expect("max")).abs() < 1e-6);

        // migrations CSV.
        let migrations = read(&paths[3]);
        let lines: Vec<&str> = migrations.lines().collect();
        assert_eq!(
            lines,
            [
                MIGRATIONS_HEADER,
                "0,0,1,1048576,0.000000,0.125000,0.125000,false",
                "3,0,1,1048576,1.000000,1.125000,0.125000,true",
                "6,0,1,1048576,2.000000,2.125000,0.125000,false"
            ]
        );

        // A second write of the same runs is byte-identical.
        let first: Vec<Vec<u8>> = paths.iter().map(|p| std::fs::read(p).expect("read")).collect();
        let again = write_outputs(&dir.0, &runs).expect("rewrite");
        assert_eq!(again, paths);
        for (p, before) in paths.iter().zip(&first) {
            assert_eq!(&std::fs::read(p).expect("read"), before, "{}", p.display());
        }
    }

    #[test]
    fn empty_runs_still_write_headers() {
        let dir = TempDir::new("report-empty");
        let paths = write_outputs(&dir.0, &[fixtures::run("pascal", None, Vec::new(), Vec::new())]).expect("write");
        assert_eq!(paths.len(), 3);
        assert_eq!(read(&paths[2]), format!("{REQUESTS_HEADER}\n"));
        let json: serde_json::Value = serde_json::from_str(&read(&paths[0])).expect("json");
        assert!(json[0]["summary"]["ttft_p99_s"].is_null());
        assert!(write_outputs(&dir.0, &[]).expect("no runs").len() == 2);
    }

    #[test]
    fn csv_fields_are_quoted_when_needed() {
        let table: &[(&str, &str)] = &[("plain", "plain"), ("a,b", "\"a,b\""), ("say \"hi\"", "\"say \"\"hi\"\"\"")];
        for (input, want) in table {
            assert_eq!(csv_field(input), *want);
        }
    }
}
