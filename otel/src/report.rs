//! The analysis as text: the summary table, `analysis.json`, `migrations.csv`, `requests.csv`.

use crate::model::{Analysis, GroupStats, RequestTimeline, TracedMigration};
use crate::otlp_json::ParsedTraces;
use crate::stats::Percentiles;
use crate::TracesError;
use serde_json::json;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn opt(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "-".to_string(), |v| format!("{v:.decimals$}"))
}

fn opt_i(v: Option<i64>) -> String {
    v.map_or_else(|| "-".to_string(), |v| v.to_string())
}

fn triple(p: &Percentiles, decimals: usize) -> String {
    format!("{}/{}/{}", opt(p.p50, decimals), opt(p.p90, decimals), opt(p.p99, decimals))
}

/// One row per group: counts, then P50/P90/P99 of downtime, total time and goodput.
fn group_table(out: &mut String, title: &str, groups: &[GroupStats]) {
    let width = groups.iter().map(|g| g.key.len()).chain([title.len()]).max().unwrap_or(0);
    let _ = writeln!(
        out,
        "{title:<width$} {:>5} {:>6} {:>5} {:>5} {:>10} | {:>24} | {:>26} | {:>20}",
        "n",
        "commit",
        "abort",
        "other",
        "incomplete",
        "downtime ms P50/P90/P99",
        "total ms P50/P90/P99",
        "goodput Gb/s P50/P90/P99"
    );
    for g in groups {
        let _ = writeln!(
            out,
            "{:<width$} {:>5} {:>6} {:>5} {:>5} {:>10} | {:>24} | {:>26} | {:>20}",
            g.key,
            g.migrations,
            g.committed,
            g.aborted,
            g.other,
            g.incomplete,
            triple(&g.downtime_ms, 2),
            triple(&g.total_ms, 1),
            triple(&g.goodput_gbps, 2),
        );
    }
}

/// The table `kvfleet traces analyze` prints.
pub fn summary_table(parsed: &ParsedTraces, a: &Analysis, slowest: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} spans in {} traces from {} lines ({} export requests, {} warnings, {} duplicate spans dropped)",
        a.spans,
        a.traces,
        parsed.lines,
        parsed.requests,
        parsed.warnings.len(),
        parsed.duplicates
    );
    let migrated = a.requests.iter().filter(|r| !r.migrations.is_empty()).count();
    let _ = writeln!(out, "requests: {} ({} with a migration)", a.requests.len(), migrated);
    let o = &a.overall;
    let _ = writeln!(
        out,
        "migrations: {} ({} committed, {} aborted, {} other; {} incomplete){}",
        o.migrations,
        o.committed,
        o.aborted,
        o.other,
        o.incomplete,
        if a.unjoined_target_spans > 0 {
            format!("; {} target spans without their migration", a.unjoined_target_spans)
        } else {
            String::new()
        }
    );
    if a.migrations.is_empty() {
        return out;
    }
    out.push('\n');
    group_table(&mut out, "policy", &a.by_policy);
    out.push('\n');
    group_table(&mut out, "link", &a.by_link);

    let slow = a.slowest(slowest);
    if slow.is_empty() {
        return out;
    }
    let _ = writeln!(out, "\nslowest {} migrations (ms):", slow.len());
    let id_w = slow.iter().map(|m| m.migration_id.len()).chain([9]).max().unwrap_or(9);
    let _ = writeln!(
        out,
        "{:<id_w$} {:<10} {:<8} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7} {:>9} {:>7} {:>7} {:>7} {:>7} complete",
        "migration",
        "outcome",
        "link",
        "kv_tokens",
        "MB",
        "total",
        "downtime",
        "prepare",
        "live",
        "pause",
        "stop_copy",
        "commit",
        "reserve",
        "verify",
        "attach"
    );
    for m in slow {
        let t = &m.times;
        let _ = writeln!(
            out,
            "{:<id_w$} {:<10} {:<8} {:>9} {:>9} {:>9.2} {:>9} {:>8} {:>8} {:>7} {:>9} {:>7} {:>7} {:>7} {:>7} {}",
            m.migration_id,
            m.outcome,
            m.link,
            opt_i(m.kv_tokens),
            opt(m.bytes.map(|b| b as f64 / 1e6), 2),
            m.total_ms,
            opt(m.downtime_ms, 2),
            opt(t.prepare_ms, 2),
            opt(t.live_copy_ms, 2),
            opt(t.pause_ms, 2),
            opt(t.stop_copy_ms, 2),
            opt(t.commit_ms, 2),
            opt(t.reserve_ms, 2),
            opt(t.verify_ms, 2),
            opt(t.attach_ms, 2),
            if m.complete { "yes".to_string() } else { format!("no (missing {})", m.missing.join(", ")) }
        );
    }
    out
}

/// `analysis.json`: what was read, the distributions, every migration and request timeline.
pub fn analysis_json(parsed: &ParsedTraces, a: &Analysis) -> serde_json::Value {
    json!({
        "input": {
            "lines": parsed.lines,
            "export_requests": parsed.requests,
            "spans": a.spans,
            "traces": a.traces,
            "duplicate_spans": parsed.duplicates,
            "warnings": parsed.warnings.iter().map(ToString::to_string).collect::<Vec<_>>(),
        },
        "overall": a.overall,
        "by_policy": a.by_policy,
        "by_link": a.by_link,
        "unjoined_target_spans": a.unjoined_target_spans,
        "migrations": a.migrations,
        "requests": a.requests,
    })
}

/// A CSV field, quoted when it holds a comma, quote or line break.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

fn csv_f(v: Option<f64>) -> String {
    v.map(|v| v.to_string()).unwrap_or_default()
}

fn csv_i(v: Option<i64>) -> String {
    v.map(|v| v.to_string()).unwrap_or_default()
}

/// `migrations.csv`: one row per migration, by start time; empty cells are unknown values.
pub fn migrations_csv(ms: &[TracedMigration]) -> String {
    let mut out = String::from(
        "migration_id,trace_id,request_id,policy,link,source,target,outcome,complete,missing,kv_tokens,blocks,bytes,\
         stages,live_stages,total_ms,downtime_ms,goodput_gbps,prepare_ms,live_copy_ms,pause_ms,stop_copy_ms,commit_ms,\
         reserve_ms,verify_ms,attach_ms,link_gbps,link_latency_us,start_unix_ns,abort_reason\n",
    );
    for m in ms {
        let t = &m.times;
        let row = [
            csv_field(&m.migration_id),
            m.trace_id.clone(),
            csv_i(m.request_id),
            csv_field(&m.policy),
            csv_field(&m.link),
            csv_i(m.source),
            csv_i(m.target),
            csv_field(&m.outcome),
            m.complete.to_string(),
            csv_field(&m.missing.join(";")),
            csv_i(m.kv_tokens),
            csv_i(m.blocks),
            csv_i(m.bytes),
            csv_i(m.stages),
            m.live_stages.to_string(),
            m.total_ms.to_string(),
            csv_f(m.downtime_ms),
            csv_f(m.goodput_gbps),
            csv_f(t.prepare_ms),
            csv_f(t.live_copy_ms),
            csv_f(t.pause_ms),
            csv_f(t.stop_copy_ms),
            csv_f(t.commit_ms),
            csv_f(t.reserve_ms),
            csv_f(t.verify_ms),
            csv_f(t.attach_ms),
            csv_f(m.link_gbps),
            csv_f(m.link_latency_us),
            m.start_ns.to_string(),
            csv_field(m.abort_reason.as_deref().unwrap_or_default()),
        ];
        out.push_str(&row.join(","));
        out.push('\n');
    }
    out
}

const REQUEST_PHASES: [&str; 5] = ["queued", "prefill", "reasoning", "answering", "preempted"];

/// `requests.csv`: one row per request, by start time; `instances` is `;`-separated in order.
pub fn requests_csv(rs: &[RequestTimeline]) -> String {
    let mut out = String::from(
        "request_id,trace_id,policy,start_unix_ns,duration_ms,prompt_tokens,reasoning_tokens,answer_tokens,placed_on,\
         instances,migrations,migration_downtime_ms",
    );
    for p in REQUEST_PHASES {
        let _ = write!(out, ",{p}_ms");
    }
    out.push('\n');
    for r in rs {
        let downtime: f64 = r.migrations.iter().filter_map(|m| m.downtime_ms).sum();
        let mut row = vec![
            csv_i(r.request_id),
            r.trace_id.clone(),
            csv_field(&r.policy),
            r.start_ns.to_string(),
            r.duration_ms.to_string(),
            csv_i(r.prompt_tokens),
            csv_i(r.reasoning_tokens),
            csv_i(r.answer_tokens),
            csv_i(r.placement.as_ref().and_then(|p| p.chosen)),
            r.instances.iter().map(i64::to_string).collect::<Vec<_>>().join(";"),
            r.migrations.len().to_string(),
            if r.migrations.is_empty() { String::new() } else { downtime.to_string() },
        ];
        row.extend(REQUEST_PHASES.iter().map(|p| csv_f(r.phase_ms.get(*p).copied())));
        out.push_str(&row.join(","));
        out.push('\n');
    }
    out
}

fn write(path: PathBuf, text: &str) -> Result<PathBuf, TracesError> {
    std::fs::write(&path, text).map_err(|e| TracesError::io(&path, e))?;
    Ok(path)
}

/// Writes `analysis.json`, `migrations.csv` and `requests.csv` into `dir` (created if missing).
pub fn write_outputs(dir: &Path, parsed: &ParsedTraces, a: &Analysis) -> Result<Vec<PathBuf>, TracesError> {
    std::fs::create_dir_all(dir).map_err(|e| TracesError::io(dir, e))?;
    Ok(vec![
        write_json(&dir.join("analysis.json"), parsed, a)?,
        write(dir.join("migrations.csv"), &migrations_csv(&a.migrations))?,
        write(dir.join("requests.csv"), &requests_csv(&a.requests))?,
    ])
}

/// Writes [`analysis_json`] (pretty-printed) to `path`.
pub fn write_json(path: &Path, parsed: &ParsedTraces, a: &Analysis) -> Result<PathBuf, TracesError> {
    let text = serde_json::to_string_pretty(&analysis_json(parsed, a)).map_err(|e| TracesError::Input {
        path: path.to_path_buf(),
        what: format!("encoding the analysis as JSON: {e}"),
    })?;
    write(path.to_path_buf(), &(text + "\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_fields_with_separators_are_quoted() {
        assert_eq!(csv_field("plain"), "plain");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"no\""), "\"say \"\"no\"\"\"");
    }
}
