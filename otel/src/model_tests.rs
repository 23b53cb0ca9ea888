//! Tests of the joins, completeness, distributions and outputs on the synthetic fixture
//! (fixtures/migrations.jsonl: m-1 committed 0→1 under `pascal`, m-2 aborted 0→2 under `pascal`,
//! m-3 committed 2→3 under `rr` with one live stage and the target's `verify` lost).

use super::*;
use crate::otlp_json::{parse_reader, ParsedTraces};

fn fixture() -> ParsedTraces {
    parse_reader(crate::otlp_json::tests::FIXTURE.as_bytes()).unwrap()
}

fn by_id<'a>(a: &'a Analysis, id: &str) -> &'a TracedMigration {
    a.migrations.iter().find(|m| m.migration_id == id).unwrap_or_else(|| panic!("no {id} in {:?}", a.migrations))
}

#[test]
fn a_committed_migration_joins_its_source_and_target_phases() {
    let a = analyze(&fixture().spans);
    let ids: Vec<&str> = a.migrations.iter().map(|m| m.migration_id.as_str()).collect();
    assert_eq!(ids, ["m-1", "m-2", "m-3"]);
    let m = by_id(&a, "m-1");
    assert_eq!((m.policy.as_str(), m.link.as_str(), m.source, m.target), ("pascal", "0->1", Some(0), Some(1)));
    assert_eq!((m.outcome.as_str(), m.complete, m.missing.len()), ("committed", true, 0));
    assert_eq!(m.request_id, Some(1));
    let names: Vec<(&str, &str)> = m.phases.iter().map(|p| (p.side, p.name.as_str())).collect();
    assert_eq!(
        names,
        [
            ("source", "prepare"),
            ("source", "stage"),
            ("source", "stage"),
            ("source", "pause"),
            ("source", "stop_copy"),
            ("source", "downtime"),
            ("source", "commit"),
            ("target", "target"),
            ("target", "reserve"),
            ("target", "verify"),
            ("target", "attach"),
        ]
    );
    let t = &m.times;
    assert_eq!(
        (t.prepare_ms, t.live_copy_ms, t.pause_ms, t.stop_copy_ms, t.commit_ms),
        (Some(1.0), Some(19.0), Some(0.5), Some(1.5), Some(1.2))
    );
    assert_eq!((t.reserve_ms, t.verify_ms, t.attach_ms), (Some(0.5), Some(0.7), Some(0.2)));
    assert_eq!((m.downtime_ms, m.total_ms, m.goodput_gbps), (Some(2.5), 23.2, Some(92.5)));
    assert_eq!(
        (m.kv_tokens, m.blocks, m.bytes, m.stages, m.live_stages),
        (Some(4096), Some(256), Some(256 << 20), Some(3), 2)
    );
    assert_eq!((m.link_gbps, m.link_latency_us), (Some(100.0), Some(10.0)));
    let stop = m.phases.iter().find(|p| p.name == "stop_copy").unwrap();
    assert_eq!((stop.offset_ms, stop.stage_index, stop.bytes), (20.5, Some(2), Some(16 << 20)));
}

#[test]
fn an_aborted_migration_is_complete_with_abort_and_downtime() {
    let a = analyze(&fixture().spans);
    let m = by_id(&a, "m-2");
    assert_eq!((m.outcome.as_str(), m.complete), ("aborted", true), "{:?}", m.missing);
    assert_eq!(m.abort_reason.as_deref(), Some("target refused, out of KV"));
    assert_eq!((m.downtime_ms, m.goodput_gbps, m.target), (Some(4.6), None, Some(2)));
    assert!(m.phases.iter().any(|p| p.name == "abort" && p.duration_ms == 0.0));
    assert!(m.phases.iter().any(|p| p.side == "target" && p.name == "reserve"));
}

#[test]
fn missing_phases_are_named() {
    let a = analyze(&fixture().spans);
    let m = by_id(&a, "m-3");
    // Line 6 spells the trace id in upper case: still joined to its `rr` request.
    assert_eq!((m.policy.as_str(), m.link.as_str()), ("rr", "2->3"));
    assert!(!m.complete);
    assert_eq!(m.missing, ["verify", "stage (1 of 2 live stages)"]);

    // Drop m-1's pause, then its whole target side.
    let spans = fixture().spans;
    let without = |drop: &dyn Fn(&SpanRecord) -> bool| -> Analysis {
        analyze(&spans.iter().filter(|s| !drop(s)).cloned().collect::<Vec<_>>())
    };
    let a = without(&|s| s.name == "migration.pause" && s.trace_id == "a1".repeat(16));
    assert_eq!(by_id(&a, "m-1").missing, ["pause"]);
    let a = without(&|s| s.name == "migration.target" && s.trace_id == "a1".repeat(16));
    let m = by_id(&a, "m-1");
    assert_eq!(m.missing, ["target"]);
    assert!(m.phases.iter().all(|p| p.side == "source"));
    // An aborted migration that was paused needs its downtime.
    let a = without(&|s| s.name == "migration.downtime" && s.trace_id == "b2".repeat(16));
    let m = by_id(&a, "m-2");
    assert_eq!(m.missing, ["downtime"]);
    // The attribute still gives the downtime; without it, the span's length would.
    assert_eq!(m.downtime_ms, Some(4.6));
    // No request span: the policy is unknown.
    let a = without(&|s| s.name == "request" && s.trace_id == "b2".repeat(16));
    assert_eq!(by_id(&a, "m-2").policy, "unknown");
}

#[test]
fn a_target_span_whose_parent_was_lost_joins_by_migration_id() {
    let mut spans = fixture().spans;
    for s in spans.iter_mut().filter(|s| s.name == "migration.target" && s.trace_id == "a1".repeat(16)) {
        s.parent_span_id = Some("ffffffffffffffff".into());
    }
    let a = analyze(&spans);
    let m = by_id(&a, "m-1");
    assert!(m.complete, "{:?}", m.missing);
    assert_eq!(a.unjoined_target_spans, 0);
    // A target span nobody claims is counted.
    spans.retain(|s| s.name != "migration" || s.trace_id != "a1".repeat(16));
    assert_eq!(analyze(&spans).unjoined_target_spans, 1);
}

#[test]
fn distributions_per_policy_and_link() {
    let a = analyze(&fixture().spans);
    let keys: Vec<&str> = a.by_policy.iter().map(|g| g.key.as_str()).collect();
    assert_eq!(keys, ["pascal", "rr"]);
    let pascal = &a.by_policy[0];
    assert_eq!((pascal.migrations, pascal.committed, pascal.aborted, pascal.other, pascal.incomplete), (2, 1, 1, 0, 0));
    let d = &pascal.downtime_ms;
    assert_eq!((d.n, d.p50, d.p90, d.p99), (2, Some(2.5), Some(4.6), Some(4.6)));
    let t = &pascal.total_ms;
    assert_eq!((t.p50, t.p99), (Some(15.0), Some(23.2)));
    // Goodput counts committed migrations only.
    assert_eq!((pascal.goodput_gbps.n, pascal.goodput_gbps.p50), (1, Some(92.5)));
    assert_eq!(pascal.bytes, (256 + 64) << 20);
    let rr = &a.by_policy[1];
    assert_eq!((rr.migrations, rr.incomplete, rr.downtime_ms.p99), (1, 1, Some(2.8)));
    let links: Vec<&str> = a.by_link.iter().map(|g| g.key.as_str()).collect();
    assert_eq!(links, ["0->1", "0->2", "2->3"]);
    assert_eq!((a.overall.migrations, a.overall.downtime_ms.p50, a.overall.total_ms.max), (3, Some(2.8), Some(30.0)));
    let slow: Vec<&str> = a.slowest(2).iter().map(|m| m.migration_id.as_str()).collect();
    assert_eq!(slow, ["m-3", "m-1"]);
}

#[test]
fn request_timelines_follow_a_request_across_instances() {
    let a = analyze(&fixture().spans);
    assert_eq!((a.spans, a.traces, a.requests.len()), (38, 3, 3));
    let r = &a.requests[0];
    assert_eq!(
        (r.request_id, r.policy.as_str(), r.prompt_tokens, r.duration_ms),
        (Some(1), "pascal", Some(100), 200.0)
    );
    let phases: Vec<(&str, Option<i64>)> = r.phases.iter().map(|p| (p.name.as_str(), p.instance)).collect();
    assert_eq!(phases, [("queued", Some(0)), ("prefill", Some(0)), ("reasoning", Some(0)), ("answering", Some(1))]);
    assert_eq!(r.instances, [0, 1]);
    assert_eq!(r.phase_ms.get("reasoning"), Some(&25.5));
    let p = r.placement.as_ref().unwrap();
    assert_eq!((p.candidates, p.chosen, p.reason.as_deref()), (Some(4), Some(0), Some("least loaded")));
    let migs: Vec<(&str, Option<f64>, f64)> =
        r.migrations.iter().map(|m| (m.migration_id.as_str(), m.downtime_ms, m.offset_ms)).collect();
    assert_eq!(migs, [("m-1", Some(2.5), 10.0)]);
    assert_eq!(a.requests[1].migrations[0].outcome, "aborted");
    assert!(a.requests[2].phases.is_empty());
}

#[test]
fn outputs_table_csv_json_and_plots() {
    let parsed = fixture();
    let a = analyze(&parsed.spans);
    let table = crate::report::summary_table(&parsed, &a, 2);
    assert!(
        table.starts_with(
            "38 spans in 3 traces from 6 lines (4 export requests, 2 warnings, 1 duplicate spans dropped)"
        ),
        "{table}"
    );
    assert!(table.contains("migrations: 3 (2 committed, 1 aborted, 0 other; 1 incomplete)"), "{table}");
    assert!(table.contains("slowest 2 migrations"), "{table}");
    assert!(table.contains("no (missing verify, stage (1 of 2 live stages))"), "{table}");
    let pascal_row = table.lines().find(|l| l.starts_with("pascal ")).unwrap();
    assert!(pascal_row.contains("2.50/4.60/4.60"), "{pascal_row}");

    let csv = crate::report::migrations_csv(&a.migrations);
    let rows: Vec<&str> = csv.lines().collect();
    assert_eq!(rows.len(), 4);
    assert!(rows[2].starts_with("m-2,") && rows[2].ends_with(",\"target refused, out of KV\""), "{}", rows[2]);
    let header: Vec<&str> = rows[0].split(',').collect();
    let row1: Vec<&str> = rows[1].split(',').collect();
    assert_eq!(header.len(), row1.len());
    let col = |name: &str| row1[header.iter().position(|h| *h == name).unwrap()];
    assert_eq!((col("downtime_ms"), col("kv_tokens"), col("complete")), ("2.5", "4096", "true"));
    let req_csv = crate::report::requests_csv(&a.requests);
    assert!(req_csv.lines().nth(1).unwrap().starts_with(&format!("1,{},pascal,", "a1".repeat(16))), "{req_csv}");
    assert!(req_csv.lines().nth(1).unwrap().contains(",0,0;1,1,2.5,"), "{req_csv}");

    let json = crate::report::analysis_json(&parsed, &a);
    assert_eq!(json["input"]["warnings"][0].as_str().unwrap().split(':').next(), Some("line 3"));
    assert_eq!(json["by_policy"][0]["downtime_ms"]["p90"], 4.6);
    assert_eq!(json["migrations"][2]["missing"][0], "verify");

    let dir = std::env::temp_dir().join(format!("kvfleet-otel-out-{}", std::process::id()));
    let mut files = crate::report::write_outputs(&dir, &parsed, &a).unwrap();
    files.extend(crate::plots::write_plots(&dir, &a, 3).unwrap());
    let names: Vec<String> = files.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(
        names,
        [
            "analysis.json",
            "migrations.csv",
            "requests.csv",
            "downtime_vs_kv_tokens.svg",
            "gantt_slowest.svg",
            "cdf_downtime.svg",
            "cdf_total.svg"
        ]
    );
    let gantt = std::fs::read_to_string(dir.join("gantt_slowest.svg")).unwrap();
    assert!(gantt.starts_with("<svg") && gantt.contains("m-3 2-&gt;3 committed"), "{}", &gantt[..300.min(gantt.len())]);
    let back: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("analysis.json")).unwrap()).unwrap();
    assert_eq!(back["overall"]["migrations"], 3);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn no_migrations_means_no_plots_and_a_short_table() {
    let a = analyze(&[]);
    let dir = std::env::temp_dir().join(format!("kvfleet-otel-empty-{}", std::process::id()));
    assert!(crate::plots::write_plots(&dir, &a, 5).unwrap().is_empty());
    let table = crate::report::summary_table(&ParsedTraces::default(), &a, 5);
    assert_eq!(table.lines().count(), 3, "{table}");
    std::fs::remove_dir_all(&dir).unwrap();
}
