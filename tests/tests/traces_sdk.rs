//! The trace sink speaks real OTLP: the official OpenTelemetry Python SDK
//! (`opentelemetry-sdk` + `opentelemetry-exporter-otlp-proto-grpc`, BatchSpanProcessor) exports
//! to a running `kvfleet traces collect`, and the file it writes holds exactly those spans —
//! names, ids, parent links, times, attributes of several types — read back through the
//! analyser's parser and through `kvfleet traces analyze`. Skipped (with a message) when the
//! Python modules are missing.

use kvfleet_otel::{AttrValue, SpanRecord};
use kvfleet_tests::{describe, kvfleet_bin, run_kvfleet, TempDir};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The SDK and its gRPC exporter, or why not.
fn python_otel_sdk() -> Result<(), String> {
    let import = "import opentelemetry.sdk.trace, opentelemetry.exporter.otlp.proto.grpc.trace_exporter";
    match Command::new("python3").args(["-c", import]).output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(String::from_utf8_lossy(&o.stderr).trim().lines().last().unwrap_or_default().to_string()),
        Err(e) => Err(format!("python3: {e}")),
    }
}

/// `kvfleet traces collect` as a child process, its stdout read line by line on a thread so a
/// test can wait with a deadline; killed and reaped on drop.
struct Collector {
    child: std::process::Child,
    lines: mpsc::Receiver<String>,
    addr: String,
    log: std::path::PathBuf,
}

impl Collector {
    fn start(out: &Path, log: &Path) -> Collector {
        let mut child = Command::new(kvfleet_bin())
            .args(["traces", "collect", "--listen", "127.0.0.1:0", "--out"])
            .arg(out)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log).expect("log file"))
            .spawn()
            .expect("spawn kvfleet traces collect");
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut c = Collector { child, lines, addr: String::new(), log: log.to_path_buf() };
        let first = c.line(Duration::from_secs(30));
        c.addr = first
            .strip_prefix("otlp on ")
            .unwrap_or_else(|| panic!("expected `otlp on ADDR`, got {first:?}; log:\n{}", c.log_text()))
            .to_string();
        c
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The next stdout line (panics with the log after `within`, or when stdout closed).
    fn line(&self, within: Duration) -> String {
        self.lines
            .recv_timeout(within)
            .unwrap_or_else(|e| panic!("no line from the collector ({e}); log:\n{}", self.log_text()))
    }

    /// SIGTERM, then wait (at most 10 s) for a clean exit.
    fn terminate(&mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        let kill = Command::new("kill").args(["-TERM", &pid]).status().expect("run kill");
        assert!(kill.success(), "kill -TERM {pid} failed");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "the collector ignored SIGTERM for 10 s; log:\n{}", self.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("temp paths are UTF-8")
}

fn span<'a>(spans: &'a [SpanRecord], name: &str) -> &'a SpanRecord {
    spans.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no {name} span in {spans:#?}"))
}

#[test]
fn python_opentelemetry_sdk_exports_land_in_the_file() {
    if let Err(why) = python_otel_sdk() {
        println!(
            "SKIPPED: the OpenTelemetry Python SDK is not importable ({why}); \
             `pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc`"
        );
        return;
    }
    let tmp = TempDir::new("traces-sdk");
    let file = tmp.join("spans.jsonl");
    let mut collector = Collector::start(&file, &tmp.join("collect.log"));

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("otel_sdk_client.py");
    let out = Command::new("python3").arg(&script).args(["--endpoint", &collector.addr]).output().expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "otel_sdk_client.py failed:\n--- stdout\n{stdout}--- stderr\n{stderr}");
    assert!(!stderr.contains("Failed to export"), "the SDK reports a failed export:\n{stderr}");
    let sent: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));

    // The spans were acknowledged, so they are in the file (written before the response).
    let text = std::fs::read_to_string(&file).expect("the collector's file");
    let trace_id = sent["request"]["trace_id"].as_str().unwrap();
    assert!(text.contains(&format!(r#""traceId":"{trace_id}""#)), "ids are hex in the file:\n{text}");
    assert!(text.contains(r#""startTimeUnixNano":"1700000000000000000""#), "64-bit times are strings:\n{text}");
    assert!(text.contains(r#"{"intValue":"1099511627776"}"#), "64-bit ints are strings:\n{text}");

    let parsed = kvfleet_otel::parse_file(&file).unwrap();
    assert!(parsed.warnings.is_empty(), "{:?}", parsed.warnings);
    assert_eq!(parsed.spans.len(), 3, "{:#?}", parsed.spans);
    for name in ["request", "migration", "migration.stage"] {
        let s = span(&parsed.spans, name);
        let want = &sent[name];
        assert_eq!(s.trace_id, want["trace_id"].as_str().unwrap(), "{name}");
        assert_eq!(s.span_id, want["span_id"].as_str().unwrap(), "{name}");
        assert_eq!(s.parent_span_id.as_deref(), want["parent"].as_str(), "{name}");
        assert_eq!((s.start_ns, s.end_ns), (want["start"].as_u64().unwrap(), want["end"].as_u64().unwrap()), "{name}");
        assert_eq!(s.scope, "kvfleet.sdk-test");
        assert_eq!(s.resource.get("service.name"), Some(&AttrValue::Str("kvfleet-sdk-test".into())));
        assert_eq!(s.resource.get("kvfleet.instance"), Some(&AttrValue::Int(7)));
        assert_eq!(s.resource.get("telemetry.sdk.language"), Some(&AttrValue::Str("python".into())));
    }
    let request = span(&parsed.spans, "request");
    assert_eq!(request.kind, 2, "SpanKind.SERVER");
    assert_eq!(request.attr("kvfleet.request.id"), Some(&AttrValue::Int(42)));
    assert_eq!(request.attr("kvfleet.policy"), Some(&AttrValue::Str("pascal".into())));
    assert_eq!(request.attr("kvfleet.sdk.flag"), Some(&AttrValue::Bool(true)));
    let ints = AttrValue::Array(vec![AttrValue::Int(1), AttrValue::Int(2), AttrValue::Int(3)]);
    assert_eq!(request.attr("kvfleet.sdk.ints"), Some(&ints));
    let migration = span(&parsed.spans, "migration");
    assert_eq!(migration.attr("kvfleet.migration.downtime_ms"), Some(&AttrValue::Double(1.25)));
    assert_eq!(migration.attr("kvfleet.migration.abort_reason"), Some(&AttrValue::Str("test, with a comma".into())));
    let stage = span(&parsed.spans, "migration.stage");
    assert_eq!(stage.attr("kvfleet.stage.bytes"), Some(&AttrValue::Int(1 << 40)));

    // The analyser joins them: one aborted migration of request 42 under `pascal`.
    let a = kvfleet_otel::analyze(&parsed.spans);
    let [m] = &a.migrations[..] else { panic!("{:#?}", a.migrations) };
    assert_eq!((m.migration_id.as_str(), m.policy.as_str(), m.request_id), ("sdk-1", "pascal", Some(42)));
    assert_eq!((m.outcome.as_str(), m.downtime_ms, m.live_stages, m.kv_tokens), ("aborted", Some(1.25), 1, Some(4096)));
    assert_eq!(m.missing, ["abort"], "the SDK test sends no migration.abort span");
    assert_eq!(a.requests.len(), 1);
    assert_eq!(a.requests[0].migrations.len(), 1);

    let dir = tmp.join("analysis");
    let run = run_kvfleet(["traces", "analyze", path_str(&file), "--out", path_str(&dir)]);
    assert!(run.status.success(), "{}", describe(&run));
    let table = String::from_utf8_lossy(&run.stdout);
    assert!(table.contains("migrations: 1 (0 committed, 1 aborted, 0 other; 1 incomplete)"), "{table}");
    for f in ["analysis.json", "migrations.csv", "requests.csv", "gantt_slowest.svg", "cdf_total.svg"] {
        assert!(dir.join(f).is_file(), "{f} missing; {}", describe(&run));
    }

    // SIGTERM: a clean exit and the count of what was received.
    let status = collector.terminate();
    assert!(status.success(), "exit {status}; log:\n{}", collector.log_text());
    let last = collector.line(Duration::from_secs(5));
    assert!(last.starts_with("received 3 spans in "), "{last}");
}

#[test]
fn collect_and_analyze_name_bad_input() {
    let tmp = TempDir::new("traces-bad");
    let out = run_kvfleet(["traces", "collect", "--listen", "127.0.0.1:0", "--out", "/nonexistent-dir/spans.jsonl"]);
    assert_eq!(out.status.code(), Some(2), "{}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent-dir/spans.jsonl"), "{}", describe(&out));

    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let file = tmp.join("x.jsonl");
    let out = run_kvfleet(["traces", "collect", "--listen", &addr, "--out", path_str(&file)]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains(&addr), "{}", describe(&out));

    // One good line between two bad ones: both reported by number, the good one analysed.
    let good = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../otel/fixtures/migrations.jsonl"))
        .unwrap()
        .lines()
        .nth(1)
        .unwrap()
        .to_string();
    let path = tmp.write("mixed.jsonl", &format!("not json\n{good}\n{{\"resourceSpans\": 3}}\n"));
    let out = run_kvfleet(["traces", "analyze", path_str(&path)]);
    assert!(out.status.success(), "{}", describe(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("line 1: not JSON (column 2)"), "{stderr}");
    assert!(stderr.contains("line 3: resourceSpans is a number, not an array; skipped"), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("migrations: 2 (1 committed, 1 aborted"), "{stdout}");

    let empty = tmp.write("empty.jsonl", "");
    let out = run_kvfleet(["traces", "analyze", path_str(&empty)]);
    assert_eq!(out.status.code(), Some(2), "{}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no spans"), "{}", describe(&out));
}
