//! Tests of the OTLP/JSON encoder and the lenient reader.

use super::*;
use opentelemetry_proto::tonic::common::v1::{ArrayValue, KeyValueList};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::Status;

/// The synthetic file of docs/tracing.md spans shared with the model tests.
pub(crate) const FIXTURE: &str = include_str!("../fixtures/migrations.jsonl");

fn kv(key: &str, v: Option<any_value::Value>) -> KeyValue {
    KeyValue { key: key.into(), value: Some(AnyValue { value: v }), key_strindex: 0 }
}

fn sample_request(double: f64) -> ExportTraceServiceRequest {
    use any_value::Value as V;
    let root = Span {
        trace_id: (1..=16).collect(),
        span_id: vec![0xde, 0xad, 0xbe, 0xef, 0, 0, 0, 1],
        name: "request".into(),
        kind: 2,
        start_time_unix_nano: 1_700_000_000_123_456_789,
        end_time_unix_nano: u64::MAX,
        attributes: vec![
            kv("s", Some(V::StringValue("pascal".into()))),
            kv("b", Some(V::BoolValue(true))),
            kv("i", Some(V::IntValue(i64::MIN))),
            kv("d", Some(V::DoubleValue(double))),
            kv("bytes", Some(V::BytesValue(vec![0, 1, 2, 250, 251]))),
            kv("arr", Some(V::ArrayValue(ArrayValue { values: vec![AnyValue { value: Some(V::IntValue(7)) }] }))),
            kv("kvl", Some(V::KvlistValue(KeyValueList { values: vec![kv("k", Some(V::StringValue("v".into())))] }))),
            kv("empty", None),
        ],
        status: Some(Status { message: "boom".into(), code: 2 }),
        ..Default::default()
    };
    let child = Span {
        trace_id: (1..=16).collect(),
        span_id: vec![2; 8],
        parent_span_id: vec![0xde, 0xad, 0xbe, 0xef, 0, 0, 0, 1],
        name: "placement".into(),
        start_time_unix_nano: 5,
        end_time_unix_nano: 6,
        events: vec![span::Event { time_unix_nano: 5, name: "e".into(), ..Default::default() }],
        ..Default::default()
    };
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource {
                attributes: vec![kv("service.name", Some(V::StringValue("kvfleet-worker".into())))],
                ..Default::default()
            }),
            scope_spans: vec![ScopeSpans {
                scope: Some(InstrumentationScope {
                    name: "kvfleet".into(),
                    version: "0.1".into(),
                    ..Default::default()
                }),
                spans: vec![root, child],
                schema_url: String::new(),
            }],
            schema_url: "https://opentelemetry.io/schemas/1.26.0".into(),
        }],
    }
}

#[test]
fn encoding_follows_the_otlp_json_mapping() {
    let v = encode_request(&sample_request(f64::NAN));
    let span = &v["resourceSpans"][0]["scopeSpans"][0]["spans"][0];
    // Ids are hex, not base64; 64-bit integers are strings; enums are numbers.
    assert_eq!(span["traceId"], "0102030405060708090a0b0c0d0e0f10");
    assert_eq!(span["spanId"], "deadbeef00000001");
    assert_eq!(span["startTimeUnixNano"], "1700000000123456789");
    assert_eq!(span["endTimeUnixNano"], u64::MAX.to_string());
    assert_eq!(span["kind"], 2);
    assert_eq!(span["status"], json!({ "message": "boom", "code": 2 }));
    let attrs = &span["attributes"];
    assert_eq!(attrs[2], json!({ "key": "i", "value": { "intValue": i64::MIN.to_string() } }));
    assert_eq!(attrs[3], json!({ "key": "d", "value": { "doubleValue": "NaN" } }));
    assert_eq!(attrs[4], json!({ "key": "bytes", "value": { "bytesValue": "AAEC+vs=" } }));
    assert_eq!(attrs[5]["value"], json!({ "arrayValue": { "values": [{ "intValue": "7" }] } }));
    assert_eq!(attrs[6]["value"]["kvlistValue"]["values"][0]["key"], "k");
    assert_eq!(attrs[7], json!({ "key": "empty", "value": {} }));
    // Defaults are omitted: a root span has no parentSpanId, nothing is null.
    let obj = span.as_object().unwrap();
    for absent in ["parentSpanId", "traceState", "flags", "droppedAttributesCount", "events", "links"] {
        assert!(!obj.contains_key(absent), "{absent} in {span}");
    }
    assert!(!v.to_string().contains("null"), "{v}");
    let child = &v["resourceSpans"][0]["scopeSpans"][0]["spans"][1];
    assert_eq!(child["parentSpanId"], "deadbeef00000001");
    assert_eq!(child["events"][0]["timeUnixNano"], "5");
    assert!(child.get("status").is_none(), "{child}");
    assert_eq!(v["resourceSpans"][0]["schemaUrl"], "https://opentelemetry.io/schemas/1.26.0");
    assert_eq!(v["resourceSpans"][0]["scopeSpans"][0]["scope"], json!({ "name": "kvfleet", "version": "0.1" }));
    assert_eq!(encode_double(f64::INFINITY), "Infinity");
    assert_eq!(encode_double(f64::NEG_INFINITY), "-Infinity");
}

/// An independent decoder — `opentelemetry-proto`'s serde derive — reads our lines back to the
/// same protobuf message.
#[test]
fn opentelemetry_proto_serde_reads_our_encoding_back_to_the_same_message() {
    let req = sample_request(0.125);
    let line = encode_request(&req).to_string();
    let back: ExportTraceServiceRequest = serde_json::from_str(&line).unwrap();
    assert_eq!(back, req);
}

#[test]
fn our_encoding_reads_back_through_the_parser() {
    let line = encode_request(&sample_request(f64::INFINITY)).to_string();
    let parsed = parse_reader(line.as_bytes()).unwrap();
    assert!(parsed.warnings.is_empty(), "{:?}", parsed.warnings);
    let [root, child] = &parsed.spans[..] else { panic!("{:?}", parsed.spans) };
    assert_eq!(root.trace_id, "0102030405060708090a0b0c0d0e0f10");
    assert_eq!((root.start_ns, root.end_ns), (1_700_000_000_123_456_789, u64::MAX));
    assert_eq!(root.parent_span_id, None);
    assert_eq!((root.kind, root.status_code, root.status_message.as_str()), (2, 2, "boom"));
    assert_eq!(root.attr("s"), Some(&AttrValue::Str("pascal".into())));
    assert_eq!(root.attr("b"), Some(&AttrValue::Bool(true)));
    assert_eq!(root.attr("i"), Some(&AttrValue::Int(i64::MIN)));
    assert_eq!(root.attr("d"), Some(&AttrValue::Double(f64::INFINITY)));
    assert_eq!(root.attr("bytes"), Some(&AttrValue::Bytes(vec![0, 1, 2, 250, 251])));
    assert_eq!(root.attr("arr"), Some(&AttrValue::Array(vec![AttrValue::Int(7)])));
    let kvl = Attributes::from([("k".to_string(), AttrValue::Str("v".into()))]);
    assert_eq!(root.attr("kvl"), Some(&AttrValue::KvList(kvl)));
    assert_eq!(root.attr("empty"), Some(&AttrValue::Empty));
    assert_eq!(root.resource.get("service.name"), Some(&AttrValue::Str("kvfleet-worker".into())));
    assert_eq!((root.scope.as_str(), root.line), ("kvfleet", 1));
    assert_eq!(child.parent_span_id.as_deref(), Some("deadbeef00000001"));
}

#[test]
fn the_fixture_is_read_with_its_two_bad_lines_reported_by_number() {
    let parsed = parse_reader(FIXTURE.as_bytes()).unwrap();
    assert_eq!(parsed.lines, 6);
    assert_eq!(parsed.requests, 4);
    let lines: Vec<usize> = parsed.warnings.iter().map(|w| w.line).collect();
    assert_eq!(lines, [3, 5], "{:?}", parsed.warnings);
    let text: Vec<String> = parsed.warnings.iter().map(ToString::to_string).collect();
    assert_eq!(text[0], "line 3: not JSON (column 102): EOF while parsing a string");
    assert_eq!(text[1], "line 5: no resourceSpans (not an OTLP traces line)");
    // Lines 1, 2, 4 and 6 are read in full; line 6 repeats one span of line 1.
    assert_eq!(parsed.spans.len(), 4 + 17 + 7 + 10);
    assert_eq!(parsed.duplicates, 1);
    // Line 6 writes ints as JSON numbers and ids in upper case.
    let m3 = parsed.spans.iter().find(|s| s.attr_str("kvfleet.migration.id") == Some("m-3")).unwrap();
    assert_eq!((m3.line, m3.trace_id.as_str()), (6, "c3".repeat(16).as_str()));
    assert_eq!(m3.attr_i64("kvfleet.migration.kv_tokens"), Some(8192));
    assert_eq!(m3.resource.get("kvfleet.instance"), Some(&AttrValue::Int(2)));
}

#[test]
fn other_writers_spellings_are_accepted() {
    // snake_case names, base64 ids (plain proto3 JSON), enum names, numbers for 64-bit ints.
    let trace_b64 = base64_encode(&[0xab; 16]);
    let span_b64 = base64_encode(&[0xcd; 8]);
    let line = json!({ "resource_spans": [{ "scope_spans": [{ "spans": [{
        "trace_id": trace_b64, "span_id": span_b64, "parent_span_id": "",
        "name": "x", "kind": "SPAN_KIND_CLIENT",
        "start_time_unix_nano": 10, "end_time_unix_nano": "20",
        "status": { "code": "STATUS_CODE_ERROR" },
        "attributes": [{ "key": "n", "value": { "int_value": 3 } }, { "key": "f", "value": { "doubleValue": "2.5" } }],
    }]}]}]});
    let parsed = parse_reader(format!("\n{line}\n").as_bytes()).unwrap();
    assert!(parsed.warnings.is_empty(), "{:?}", parsed.warnings);
    let s = &parsed.spans[0];
    assert_eq!((s.trace_id.as_str(), s.span_id.as_str()), ("ab".repeat(16).as_str(), "cd".repeat(8).as_str()));
    assert_eq!((s.kind, s.status_code, s.start_ns, s.end_ns, s.line), (3, 2, 10, 20, 2));
    assert_eq!(s.parent_span_id, None);
    assert_eq!((s.attr_i64("n"), s.attr_f64("f")), (Some(3), Some(2.5)));
}

#[test]
fn a_bad_span_or_attribute_is_reported_and_its_neighbours_kept() {
    let good = |id: &str| json!({ "traceId": "11".repeat(16), "spanId": id, "name": "ok", "startTimeUnixNano": "1", "endTimeUnixNano": "2" });
    let bad_id = json!({ "traceId": "xyz", "spanId": "22".repeat(8), "name": "bad", "startTimeUnixNano": "1", "endTimeUnixNano": "2" });
    let no_time = json!({ "traceId": "11".repeat(16), "spanId": "33".repeat(8), "name": "late" });
    let mut bad_attr = good(&"44".repeat(8));
    bad_attr["attributes"] =
        json!([{ "key": "n", "value": { "intValue": "12x" } }, { "key": "ok", "value": { "boolValue": false } }]);
    let line = json!({ "resourceSpans": [{ "scopeSpans": [{ "spans": [good(&"01".repeat(8)), bad_id, no_time, bad_attr] }] }] });
    let text = format!("{line}\n[1,2]\n");
    let parsed = parse_reader(text.as_bytes()).unwrap();
    let warnings: Vec<String> = parsed.warnings.iter().map(ToString::to_string).collect();
    assert_eq!(
        warnings,
        [
            r#"line 1: resourceSpans[0].scopeSpans[0].spans[1]: ("bad") traceId "xyz" is not a 16-byte id in hex"#,
            r#"line 1: resourceSpans[0].scopeSpans[0].spans[2]: ("late") no startTimeUnixNano"#,
            r#"line 1: resourceSpans[0].scopeSpans[0].spans[3]: attribute "n": intValue "12x" is not a 64-bit integer"#,
            "line 2: expected a JSON object with resourceSpans, found an array",
        ]
    );
    let ids: Vec<&str> = parsed.spans.iter().map(|s| s.span_id.as_str()).collect();
    assert_eq!(ids, ["01".repeat(8), "44".repeat(8)]);
    assert_eq!(parsed.spans[1].attr("ok"), Some(&AttrValue::Bool(false)));
    assert_eq!(parsed.spans[1].attr("n"), None);
}

#[test]
fn binary_and_compressed_files_are_refused_clearly() {
    let dir = std::env::temp_dir().join(format!("kvfleet-otel-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let gz = dir.join("spans.jsonl.gz");
    std::fs::write(&gz, [0x1f, 0x8b, 8, 0, 0, 0]).unwrap();
    let err = parse_file(&gz).unwrap_err().to_string();
    assert!(err.contains("spans.jsonl.gz") && err.contains("gzip-compressed"), "{err}");
    let missing = parse_file(&dir.join("nope.jsonl")).unwrap_err().to_string();
    assert!(missing.contains("nope.jsonl"), "{missing}");
    std::fs::remove_dir_all(&dir).unwrap();

    let parsed = parse_reader(&b"\xff\xfe binary\n{\"resourceSpans\":[]}\n"[..]).unwrap();
    assert_eq!(parsed.warnings[0].to_string(), "line 1: not UTF-8 text (binary OTLP is not supported)");
    assert_eq!((parsed.requests, parsed.spans.len()), (1, 0));
}

#[test]
fn base64_round_trips_and_rejects_garbage() {
    for n in 0..20u8 {
        let bytes: Vec<u8> = (0..n).map(|i| i.wrapping_mul(37)).collect();
        assert_eq!(base64_decode(&base64_encode(&bytes)), Some(bytes));
    }
    assert_eq!(base64_encode(b"any carnal pleas"), "YW55IGNhcm5hbCBwbGVhcw==");
    assert_eq!(base64_decode("YW55IGNhcm5hbCBwbGVhcw"), Some(b"any carnal pleas".to_vec()));
    assert_eq!(base64_decode("not base64!"), None);
}
