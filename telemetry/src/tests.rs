use super::*;
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};

/// A global provider exporting synchronously into memory (nextest runs each test in its own
/// process, so the global state is this test's).
fn in_memory() -> (InMemorySpanExporter, SdkTracerProvider) {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder().with_simple_exporter(exporter.clone()).build();
    global::set_tracer_provider(provider.clone());
    global::set_text_map_propagator(TraceContextPropagator::new());
    (exporter, provider)
}

#[test]
fn measured_spans_keep_their_times_and_parents() {
    let (exporter, _p) = in_memory();
    let t0 = unix_time(1_700_000_000_000_000_000);
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let mut m = OpenSpan::start("migration", &Context::new(), at(0), vec![KeyValue::new("kvfleet.request.id", 7i64)]);
    m.child("migration.stage", at(1), at(5), vec![KeyValue::new("kvfleet.stage.index", 0i64)]);
    // A child whose end precedes its start (clock skew between measurements) is clamped.
    m.child("migration.abort", at(9), at(8), vec![]);
    m.set([KeyValue::new("kvfleet.migration.outcome", "committed")]);
    let parent = m.span_context().clone();
    m.end(at(10));
    let spans = exporter.get_finished_spans().unwrap();
    assert_eq!(spans.len(), 3);
    let root = spans.iter().find(|s| s.name == "migration").unwrap();
    let stage = spans.iter().find(|s| s.name == "migration.stage").unwrap();
    let abort = spans.iter().find(|s| s.name == "migration.abort").unwrap();
    assert_eq!((root.start_time, root.end_time), (at(0), at(10)));
    assert_eq!((stage.start_time, stage.end_time), (at(1), at(5)));
    assert_eq!((abort.start_time, abort.end_time), (at(9), at(9)));
    assert_eq!(stage.parent_span_id, parent.span_id());
    assert_eq!(stage.span_context.trace_id(), parent.trace_id());
    assert!(root.attributes.iter().any(|kv| kv.key.as_str() == "kvfleet.migration.outcome"));
    assert!(root.attributes.iter().any(|kv| kv.key.as_str() == "kvfleet.request.id"));
}

#[test]
fn context_crosses_carriers_and_grpc_metadata() {
    let (exporter, _p) = in_memory();
    let req = OpenSpan::start("request", &Context::new(), SystemTime::now(), vec![]);
    let carrier = req.carrier();
    assert!(carrier.get("traceparent").is_some_and(|t| t.starts_with("00-")), "{carrier:?}");
    let back = extract(&carrier);
    assert_eq!(back.span().span_context().span_id(), req.span_context().span_id());
    assert!(back.span().span_context().is_remote());

    let r = request_with(req.context(), ());
    let over_grpc = extract_metadata(r.metadata());
    assert_eq!(over_grpc.span().span_context().trace_id(), req.span_context().trace_id());
    assert_eq!(over_grpc.span().span_context().span_id(), req.span_context().span_id());

    // A span started under the extracted context is the request's child: one trace.
    let now = SystemTime::now();
    record("migration", &over_grpc, now, now, vec![]);
    req.end(SystemTime::now());
    let spans = exporter.get_finished_spans().unwrap();
    let m = spans.iter().find(|s| s.name == "migration").unwrap();
    let r = spans.iter().find(|s| s.name == "request").unwrap();
    assert_eq!(m.parent_span_id, r.span_context.span_id());
    assert_eq!(m.span_context.trace_id(), r.span_context.trace_id());
}

#[test]
fn nothing_is_injected_without_a_span_and_garbage_extracts_to_nothing() {
    let _ = in_memory();
    assert!(inject(&Context::new()).is_empty());
    let mut md = tonic::metadata::MetadataMap::new();
    inject_metadata(&Context::new(), &mut md);
    assert!(md.is_empty());
    let junk: Carrier = [("traceparent".to_string(), "00-nothex-zz-01".to_string())].into();
    assert!(!extract(&junk).span().span_context().is_valid());
}

#[tokio::test]
async fn a_bad_endpoint_is_named() {
    let args = TelemetryArgs { otlp_endpoint: Some("127.0.0.1:4317".into()) };
    let svc = Service { name: "kvfleet-test", instance_id: "t".into(), attributes: vec![] };
    let err = provider(svc.clone(), args.otlp_endpoint.as_deref().unwrap()).expect_err("refused");
    let msg = err.to_string();
    assert!(msg.contains("--otlp-endpoint") && msg.contains("127.0.0.1:4317") && msg.contains("http://"), "{msg}");
    assert!(provider(svc, "http://127.0.0.1:4317").is_ok());
}
