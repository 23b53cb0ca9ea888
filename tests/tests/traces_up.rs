//! Traces of a real run: `kvfleet up` exports every process's spans into its `kvfleet traces
//! collect` sink and analyses them; the analysis must hold every migration the workers counted,
//! each with all its phases on both sides, and the downtimes the workers measured themselves.

use kvfleet_tests::{describe, etcd_installed, run_kvfleet, TempDir};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// The workers' own counters (from `OUT/metrics/worker-N.prom`), by worker instance.
#[derive(Debug, Default, Clone, Copy)]
struct WorkerCounts {
    committed: f64,
    aborted: f64,
    refused: f64,
    unknown: f64,
    downtime_sum_s: f64,
    downtime_count: f64,
}

/// The value of the sample `name{...labels}` whose labels contain `label` (any labels if empty).
fn sample(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name) && l.contains(label))
        .map(|l| l.rsplit(' ').next().expect("a value").parse::<f64>().expect("a number"))
        .sum()
}

/// `OUT/metrics/worker-N.prom` by instance.
fn workers_text(dir: &Path) -> BTreeMap<i64, String> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).expect("OUT/metrics written") {
        let path = e.expect("entry").path();
        let name = path.file_stem().and_then(|s| s.to_str()).expect("utf-8 name").to_string();
        if let Some(n) = name.strip_prefix("worker-") {
            out.insert(n.parse().expect("worker-N.prom"), std::fs::read_to_string(&path).expect("readable"));
        }
    }
    out
}

/// `tests/parse_metrics.py` (prometheus_client's parser) over every saved page: each parses, the
/// workers' and the leader's families have the types the README documents.
fn check_prometheus_parse(dir: &Path) {
    let mut files: Vec<String> =
        std::fs::read_dir(dir).expect("OUT/metrics").map(|e| e.expect("entry").path().display().to_string()).collect();
    files.sort();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("parse_metrics.py");
    let o = std::process::Command::new("python3").arg(&script).args(&files).output();
    let o = match o {
        Ok(o) if o.status.code() == Some(77) => {
            eprintln!("SKIPPED the Prometheus parser check: {}", String::from_utf8_lossy(&o.stderr).trim());
            return;
        }
        Ok(o) => o,
        Err(e) => {
            eprintln!("SKIPPED the Prometheus parser check: python3 not runnable: {e}");
            return;
        }
    };
    assert!(o.status.success(), "prometheus_client could not parse: {}", String::from_utf8_lossy(&o.stderr));
    let parsed: Value = serde_json::from_slice(&o.stdout).expect("the script prints JSON");
    let mut leaders = 0;
    for (file, families) in parsed.as_object().expect("by file") {
        let ty = |f: &str| families[f].as_str().unwrap_or("missing").to_string();
        if file.contains("worker-") {
            for (f, t) in [
                ("vllm:num_requests_running", "gauge"),
                ("vllm:gpu_cache_usage_perc", "gauge"),
                ("vllm:num_preemptions", "counter"),
                ("vllm:time_to_first_token_seconds", "histogram"),
                ("vllm:time_per_output_token_seconds", "histogram"),
                ("vllm:e2e_request_latency_seconds", "histogram"),
                ("kvfleet_timer_lateness_seconds", "summary"),
                ("kvfleet_kv_errors", "counter"),
                ("kvfleet_migrations", "counter"),
                ("kvfleet_migration_downtime_seconds", "histogram"),
            ] {
                assert_eq!(ty(f), t, "{file}: {f}");
            }
        } else if families.get("kvfleet_workers_alive").is_some() {
            leaders += 1;
            assert_eq!(ty("kvfleet_leader"), "gauge", "{file}");
            assert_eq!(ty("kvfleet_requests_finished"), "counter", "{file}");
            assert_eq!(ty("kvfleet_migration_downtime_seconds"), "histogram", "{file}");
        } else {
            assert_eq!(ty("kvfleet_leader"), "gauge", "{file}: a standby says it is not the leader");
        }
    }
    assert_eq!(leaders, 1, "exactly one coordinator leads: {parsed}");
}

fn worker_counts(dir: &Path) -> BTreeMap<i64, WorkerCounts> {
    let mut out = BTreeMap::new();
    for (instance, text) in workers_text(dir) {
        let c = WorkerCounts {
            committed: sample(&text, "kvfleet_migrations_total", "outcome=\"committed\""),
            aborted: sample(&text, "kvfleet_migrations_total", "outcome=\"aborted\""),
            refused: sample(&text, "kvfleet_migrations_total", "outcome=\"refused\""),
            unknown: sample(&text, "kvfleet_migrations_total", "outcome=\"unknown\""),
            downtime_sum_s: sample(&text, "kvfleet_migration_downtime_seconds_sum", ""),
            downtime_count: sample(&text, "kvfleet_migration_downtime_seconds_count", ""),
        };
        out.insert(instance, c);
    }
    out
}

#[test]
fn traces_of_a_run_hold_every_migration_with_its_phases_and_the_workers_downtimes() {
    let tmp = TempDir::new("traces-up");
    let out = tmp.join("out");
    let mut args: Vec<String> = [
        "up",
        "--workers",
        "3",
        "--requests",
        "30",
        "--rate",
        "8",
        "--kv-memory",
        "768MiB",
        "--cpu-memory",
        "512MiB",
        "--kv-fill",
        "stamp",
        "-q",
        "--out",
        out.to_str().expect("utf-8 temp path"),
    ]
    .map(String::from)
    .to_vec();
    if !etcd_installed() {
        args.push("--no-etcd".into());
    }
    let o = run_kvfleet(&args);
    assert!(o.status.success(), "{}", describe(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stdout.contains("traces      "), "kvfleet up reports its traces: {stdout}");

    let analysis: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("traces/analysis.json")).expect("analysis written"))
            .expect("analysis.json parses");
    let migrations = analysis["migrations"].as_array().expect("a migrations array");
    let workers = worker_counts(&out.join("metrics"));
    assert_eq!(workers.len(), 3, "every worker's metrics saved: {workers:?}");
    let total = |f: fn(&WorkerCounts) -> f64| workers.values().map(f).sum::<f64>();
    assert!(total(|c| c.committed) >= 1.0, "the run migrated something: {workers:?}\n{stdout}");

    // Every migration each worker counted is in the traces, with the same outcome.
    for (&instance, c) in &workers {
        let of = |outcome: &str| {
            migrations.iter().filter(|m| m["source"] == instance && m["outcome"] == outcome).count() as f64
        };
        assert_eq!(of("committed"), c.committed, "worker {instance} committed: {c:?}");
        assert_eq!(of("aborted"), c.aborted, "worker {instance} aborted: {c:?}");
        assert_eq!(of("refused"), c.refused, "worker {instance} refused: {c:?}");
        assert_eq!(of("unknown"), c.unknown, "worker {instance} unknown: {c:?}");
        // Downtime: the same measurement in the span and in the worker's histogram.
        let down: Vec<f64> = migrations
            .iter()
            .filter(|m| m["source"] == instance && m["outcome"] == "committed")
            .map(|m| m["downtime_ms"].as_f64().expect("a committed migration has a downtime") / 1e3)
            .collect();
        assert_eq!(down.len() as f64, c.downtime_count, "worker {instance}");
        let sum: f64 = down.iter().sum();
        assert!(
            (sum - c.downtime_sum_s).abs() <= 1e-6 * (1.0 + c.downtime_count),
            "worker {instance}: traces say {sum} s of downtime, its metrics {} s",
            c.downtime_sum_s
        );
    }

    // Every /metrics page parses with the Prometheus project's own parser, with the documented
    // types; no KV byte was lost on any worker.
    for (instance, text) in workers_text(&out.join("metrics")) {
        assert_eq!(sample(&text, "kvfleet_kv_errors_total", ""), 0.0, "worker {instance}: KV errors");
    }
    check_prometheus_parse(&out.join("metrics"));

    // The coordinator's log of settled live migrations names the same ones.
    let csv = std::fs::read_to_string(out.join("live-migrations.csv")).expect("live-migrations.csv");
    let logged = csv.lines().skip(1).count();
    let settled = migrations.iter().filter(|m| m["outcome"] != "finished").count();
    assert_eq!(settled, logged, "traces vs the coordinator's migration log");

    for m in migrations {
        let id = &m["migration_id"];
        assert_eq!(m["complete"], true, "{id}: every phase present, missing {}", m["missing"]);
        // Joined to its request's trace (context through MigrateOut's gRPC metadata).
        let stops: Vec<&str> = stderr.lines().filter(|l| l.starts_with("stopped ")).collect();
        assert_eq!(m["policy"], "pascal", "{id}: joined to its request span ({stops:?})\n{m}");
        assert!(m["request_span_id"].is_string(), "{id}");
        let phases: Vec<(&str, &str)> = m["phases"]
            .as_array()
            .expect("phases")
            .iter()
            .map(|p| (p["side"].as_str().expect("side"), p["name"].as_str().expect("name")))
            .collect();
        let has = |side, name| phases.contains(&(side, name));
        if m["outcome"] == "committed" {
            for name in ["prepare", "pause", "stop_copy", "commit", "downtime"] {
                assert!(has("source", name), "{id}: source phase {name} in {phases:?}");
            }
            // The target's spans joined through the migration protocol's Prepare.trace_context.
            for name in ["reserve", "verify", "attach"] {
                assert!(has("target", name), "{id}: target phase {name} in {phases:?}");
            }
            let stages = m["stages"].as_i64().expect("stage count");
            let live = phases.iter().filter(|p| **p == ("source", "stage")).count() as i64;
            assert_eq!(live, stages - 1, "{id}: one span per live stage");
        }
    }
}
