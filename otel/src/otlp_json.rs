//! OTLP/JSON: encoding an Export request as one line, and reading files of such lines.
//!
//! The encoding follows the OTLP specification's JSON mapping ("JSON Protobuf Encoding"), which
//! is what an OpenTelemetry Collector's `file` exporter writes: lowerCamelCase field names,
//! `traceId`/`spanId`/`parentSpanId` as lowercase hex (not base64, unlike plain proto3 JSON),
//! 64-bit integers (`*UnixNano`, `intValue`) as decimal strings, enums as integers, other bytes
//! as base64, fields at their default value omitted. It is written here rather than taken from
//! `opentelemetry-proto`'s `with-serde` derive because that one writes NaN and ±Infinity doubles
//! as `null` (the spec wants `"NaN"`, `"Infinity"`) and emits `null` for absent messages.
//!
//! Reading is lenient, because the files also come from other writers: numbers may be JSON
//! numbers or strings, ids hex or base64, field names lowerCamel or snake_case, enums integers
//! or names. A line that is not JSON or has no `resourceSpans` is skipped with a
//! [`LineWarning`]; a span without a valid id or time is skipped with a warning naming its line;
//! the rest of the file is read. A span seen twice (an exporter's retry after a lost
//! acknowledgement) is kept once.

use crate::TracesError;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, InstrumentationScope, KeyValue};
use opentelemetry_proto::tonic::trace::v1::{span, ResourceSpans, ScopeSpans, Span};
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashSet};
use std::io::BufRead;
use std::path::Path;
use std::sync::Arc;

// ---------------------------------------------------------------------------------------------
// Encoding

/// One Export request as an OTLP/JSON object `{"resourceSpans":[...]}`.
pub fn encode_request(req: &ExportTraceServiceRequest) -> Value {
    json!({ "resourceSpans": req.resource_spans.iter().map(encode_resource_spans).collect::<Vec<_>>() })
}

/// Inserts `key: value` unless `value` is the field's default (the JSON mapping omits those).
fn put(obj: &mut Map<String, Value>, key: &str, value: Value) {
    let default = match &value {
        Value::String(s) => s.is_empty(),
        Value::Number(n) => n.as_u64() == Some(0) || n.as_i64() == Some(0),
        Value::Array(a) => a.is_empty(),
        Value::Null => true,
        _ => false,
    };
    if !default {
        obj.insert(key.to_string(), value);
    }
}

fn encode_resource_spans(rs: &ResourceSpans) -> Value {
    let mut o = Map::new();
    if let Some(r) = &rs.resource {
        let mut res = Map::new();
        put(&mut res, "attributes", encode_attributes(&r.attributes));
        put(&mut res, "droppedAttributesCount", r.dropped_attributes_count.into());
        let refs = r.entity_refs.iter().map(|e| {
            let mut o = Map::new();
            put(&mut o, "schemaUrl", e.schema_url.clone().into());
            put(&mut o, "type", e.r#type.clone().into());
            put(&mut o, "idKeys", e.id_keys.clone().into());
            put(&mut o, "descriptionKeys", e.description_keys.clone().into());
            Value::Object(o)
        });
        put(&mut res, "entityRefs", refs.collect());
        o.insert("resource".into(), Value::Object(res));
    }
    o.insert("scopeSpans".into(), rs.scope_spans.iter().map(encode_scope_spans).collect());
    put(&mut o, "schemaUrl", rs.schema_url.clone().into());
    Value::Object(o)
}

fn encode_scope(s: &InstrumentationScope) -> Value {
    let mut o = Map::new();
    put(&mut o, "name", s.name.clone().into());
    put(&mut o, "version", s.version.clone().into());
    put(&mut o, "attributes", encode_attributes(&s.attributes));
    put(&mut o, "droppedAttributesCount", s.dropped_attributes_count.into());
    Value::Object(o)
}

fn encode_scope_spans(ss: &ScopeSpans) -> Value {
    let mut o = Map::new();
    if let Some(s) = &ss.scope {
        o.insert("scope".into(), encode_scope(s));
    }
    o.insert("spans".into(), ss.spans.iter().map(encode_span).collect());
    put(&mut o, "schemaUrl", ss.schema_url.clone().into());
    Value::Object(o)
}

fn encode_span(s: &Span) -> Value {
    let mut o = Map::new();
    o.insert("traceId".into(), hex(&s.trace_id).into());
    o.insert("spanId".into(), hex(&s.span_id).into());
    put(&mut o, "traceState", s.trace_state.clone().into());
    put(&mut o, "parentSpanId", hex(&s.parent_span_id).into());
    put(&mut o, "flags", s.flags.into());
    o.insert("name".into(), s.name.clone().into());
    put(&mut o, "kind", s.kind.into());
    o.insert("startTimeUnixNano".into(), s.start_time_unix_nano.to_string().into());
    o.insert("endTimeUnixNano".into(), s.end_time_unix_nano.to_string().into());
    put(&mut o, "attributes", encode_attributes(&s.attributes));
    put(&mut o, "droppedAttributesCount", s.dropped_attributes_count.into());
    put(&mut o, "events", s.events.iter().map(encode_event).collect());
    put(&mut o, "droppedEventsCount", s.dropped_events_count.into());
    put(&mut o, "links", s.links.iter().map(encode_link).collect());
    put(&mut o, "droppedLinksCount", s.dropped_links_count.into());
    if let Some(st) = &s.status {
        let mut status = Map::new();
        put(&mut status, "message", st.message.clone().into());
        put(&mut status, "code", st.code.into());
        o.insert("status".into(), Value::Object(status));
    }
    Value::Object(o)
}

fn encode_event(e: &span::Event) -> Value {
    let mut o = Map::new();
    o.insert("timeUnixNano".into(), e.time_unix_nano.to_string().into());
    o.insert("name".into(), e.name.clone().into());
    put(&mut o, "attributes", encode_attributes(&e.attributes));
    put(&mut o, "droppedAttributesCount", e.dropped_attributes_count.into());
    Value::Object(o)
}

fn encode_link(l: &span::Link) -> Value {
    let mut o = Map::new();
    o.insert("traceId".into(), hex(&l.trace_id).into());
    o.insert("spanId".into(), hex(&l.span_id).into());
    put(&mut o, "traceState", l.trace_state.clone().into());
    put(&mut o, "attributes", encode_attributes(&l.attributes));
    put(&mut o, "droppedAttributesCount", l.dropped_attributes_count.into());
    put(&mut o, "flags", l.flags.into());
    Value::Object(o)
}

fn encode_attributes(kvs: &[KeyValue]) -> Value {
    kvs.iter().map(|kv| json!({ "key": kv.key, "value": encode_any(kv.value.as_ref()) })).collect()
}

fn encode_any(v: Option<&AnyValue>) -> Value {
    use any_value::Value as V;
    match v.and_then(|v| v.value.as_ref()) {
        Some(V::StringValue(s)) => json!({ "stringValue": s }),
        Some(V::BoolValue(b)) => json!({ "boolValue": b }),
        Some(V::IntValue(i)) => json!({ "intValue": i.to_string() }),
        Some(V::DoubleValue(d)) => json!({ "doubleValue": encode_double(*d) }),
        Some(V::ArrayValue(a)) => {
            json!({ "arrayValue": { "values": a.values.iter().map(|v| encode_any(Some(v))).collect::<Vec<_>>() } })
        }
        Some(V::KvlistValue(l)) => json!({ "kvlistValue": { "values": encode_attributes(&l.values) } }),
        Some(V::BytesValue(b)) => json!({ "bytesValue": base64_encode(b) }),
        // String-table references exist only in the profiles signal; an empty value otherwise.
        Some(V::StringValueStrindex(_)) | None => json!({}),
    }
}

/// The proto3 JSON mapping of a double: a number, or the strings `NaN`, `Infinity`, `-Infinity`.
fn encode_double(d: f64) -> Value {
    if d.is_nan() {
        "NaN".into()
    } else if d.is_infinite() {
        if d > 0.0 { "Infinity" } else { "-Infinity" }.into()
    } else {
        d.into()
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding (the proto3 JSON mapping of `bytes`).
fn base64_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(B64[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Standard or URL-safe base64, padding optional; `None` if `s` is not base64.
fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let s = s.trim_end_matches('=');
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in s.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            _ => return None,
        };
        acc = acc << 6 | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

// ---------------------------------------------------------------------------------------------
// Reading

/// An attribute value, as OTLP's `AnyValue`.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(untagged)]
pub enum AttrValue {
    /// `stringValue`.
    Str(String),
    /// `boolValue`.
    Bool(bool),
    /// `intValue`.
    Int(i64),
    /// `doubleValue`.
    Double(f64),
    /// `bytesValue` (base64 in OTLP JSON), decoded.
    Bytes(Vec<u8>),
    /// `arrayValue`.
    Array(Vec<AttrValue>),
    /// `kvlistValue`.
    KvList(Attributes),
    /// An `AnyValue` with no value set.
    Empty,
}

/// Attributes by key (a repeated key: the last one wins, as in the OpenTelemetry SDKs).
pub type Attributes = BTreeMap<String, AttrValue>;

impl AttrValue {
    /// An integer: `intValue`, an integral `doubleValue`, or a string holding an integer.
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            AttrValue::Int(i) => Some(*i),
            AttrValue::Double(d) if d.fract() == 0.0 && d.abs() < 9.0e15 => Some(*d as i64),
            AttrValue::Str(s) => s.trim().parse().ok(),
            _ => None,
        }
    }

    /// A number: `doubleValue`, `intValue`, or a string holding a number.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            AttrValue::Double(d) => Some(*d),
            AttrValue::Int(i) => Some(*i as f64),
            AttrValue::Str(s) => s.trim().parse().ok(),
            _ => None,
        }
    }

    /// The string of a `stringValue`; `None` for any other kind.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            AttrValue::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// One span, flattened out of its resource and scope.
#[derive(Clone, Debug, PartialEq)]
pub struct SpanRecord {
    /// 1-based line of the file the span came from.
    pub line: usize,
    /// Lowercase hex, 32 digits.
    pub trace_id: String,
    /// Lowercase hex, 16 digits.
    pub span_id: String,
    /// `None` for a root span.
    pub parent_span_id: Option<String>,
    /// The span's name (`request`, `migration`, `migration.stage`, ...).
    pub name: String,
    /// `SpanKind` as its number (0 unspecified … 5 consumer).
    pub kind: i64,
    /// Start, Unix nanoseconds.
    pub start_ns: u64,
    /// End, Unix nanoseconds.
    pub end_ns: u64,
    /// The span's own attributes.
    pub attributes: Attributes,
    /// The attributes of the span's resource (`service.name`, `kvfleet.instance`, ...).
    pub resource: Arc<Attributes>,
    /// The instrumentation scope's name.
    pub scope: String,
    /// `Status.code` as its number (0 unset, 1 ok, 2 error).
    pub status_code: i64,
    /// `Status.message` (empty when unset).
    pub status_message: String,
}

impl SpanRecord {
    /// The span attribute `key`.
    pub fn attr(&self, key: &str) -> Option<&AttrValue> {
        self.attributes.get(key)
    }

    /// The span attribute `key` as an integer ([`AttrValue::as_i64`]).
    pub fn attr_i64(&self, key: &str) -> Option<i64> {
        self.attr(key).and_then(AttrValue::as_i64)
    }

    /// The span attribute `key` as a number ([`AttrValue::as_f64`]).
    pub fn attr_f64(&self, key: &str) -> Option<f64> {
        self.attr(key).and_then(AttrValue::as_f64)
    }

    /// The span attribute `key` if it is a string.
    pub fn attr_str(&self, key: &str) -> Option<&str> {
        self.attr(key).and_then(AttrValue::as_str)
    }

    /// End − start in milliseconds (0 when the end precedes the start).
    pub fn duration_ms(&self) -> f64 {
        self.end_ns.saturating_sub(self.start_ns) as f64 / 1e6
    }
}

/// A line (or a span on it) that could not be read.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct LineWarning {
    /// 1-based.
    pub line: usize,
    /// What was wrong with it.
    pub message: String,
}

impl std::fmt::Display for LineWarning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

/// Everything read from one file.
#[derive(Clone, Debug, Default)]
pub struct ParsedTraces {
    /// Every span read, in file order, duplicates dropped.
    pub spans: Vec<SpanRecord>,
    /// Lines or spans that could not be read.
    pub warnings: Vec<LineWarning>,
    /// Lines read, blank ones included.
    pub lines: usize,
    /// Lines that held an Export request (`resourceSpans`), empty ones included.
    pub requests: usize,
    /// Spans seen again with the same trace and span id, and dropped.
    pub duplicates: usize,
}

/// Reads a file of OTLP JSON lines. Fails only when the file cannot be read at all or is
/// compressed; a malformed line is a warning in the result.
pub fn parse_file(path: &Path) -> Result<ParsedTraces, TracesError> {
    let file = std::fs::File::open(path).map_err(|e| TracesError::io(path, e))?;
    let mut reader = std::io::BufReader::new(file);
    let head = reader.fill_buf().map_err(|e| TracesError::io(path, e))?;
    let compression = match head {
        [0x1f, 0x8b, ..] => Some("gzip"),
        [0x28, 0xb5, 0x2f, 0xfd, ..] => Some("zstd"),
        _ => None,
    };
    if let Some(c) = compression {
        let what = format!("the file is {c}-compressed; decompress it first (OTLP JSON lines expected)");
        return Err(TracesError::Input { path: path.to_path_buf(), what });
    }
    parse_reader(reader).map_err(|e| TracesError::io(path, e))
}

/// Reads OTLP JSON lines from `reader` (see the module doc for what is accepted).
pub fn parse_reader<R: BufRead>(mut reader: R) -> std::io::Result<ParsedTraces> {
    let mut out = ParsedTraces::default();
    let mut seen = HashSet::new();
    let mut buf = Vec::new();
    loop {
        buf.clear();
        if reader.read_until(b'\n', &mut buf)? == 0 {
            break;
        }
        out.lines += 1;
        let line = out.lines;
        let Ok(text) = std::str::from_utf8(&buf) else {
            out.warnings.push(LineWarning { line, message: "not UTF-8 text (binary OTLP is not supported)".into() });
            continue;
        };
        let text = text.trim();
        if text.is_empty() {
            continue;
        }
        let value: Value = match serde_json::from_str(text) {
            Ok(v) => v,
            Err(e) => {
                // serde_json ends its message with "at line 1 column C": within this line.
                let msg = e.to_string();
                let msg = msg.rfind(" at line ").map_or(msg.as_str(), |i| &msg[..i]);
                out.warnings.push(LineWarning { line, message: format!("not JSON (column {}): {msg}", e.column()) });
                continue;
            }
        };
        let Some(resource_spans) = field(&value, "resourceSpans") else {
            let message = if value.is_object() {
                "no resourceSpans (not an OTLP traces line)".to_string()
            } else {
                format!("expected a JSON object with resourceSpans, found {}", kind_of(&value))
            };
            out.warnings.push(LineWarning { line, message });
            continue;
        };
        out.requests += 1;
        let mut ctx = LineCtx { line, warnings: &mut out.warnings };
        for (ri, rs) in array(resource_spans, &mut ctx, "resourceSpans").iter().enumerate() {
            let resource = field(rs, "resource").and_then(|r| field(r, "attributes"));
            let resource = Arc::new(resource.map(|a| attributes(a, &mut ctx, "resource")).unwrap_or_default());
            let scope_spans = field(rs, "scopeSpans").or_else(|| field(rs, "instrumentationLibrarySpans"));
            for (si, ss) in scope_spans.map(|s| array(s, &mut ctx, "scopeSpans")).unwrap_or_default().iter().enumerate()
            {
                let scope = field(ss, "scope").or_else(|| field(ss, "instrumentationLibrary"));
                let scope = scope.and_then(|s| field(s, "name")).and_then(Value::as_str).unwrap_or_default();
                let spans = field(ss, "spans").map(|s| array(s, &mut ctx, "spans")).unwrap_or_default();
                for (pi, sp) in spans.iter().enumerate() {
                    let path = format!("resourceSpans[{ri}].scopeSpans[{si}].spans[{pi}]");
                    match read_span(sp, &mut ctx, &path, &resource, scope) {
                        Ok(s) => {
                            if seen.insert((s.trace_id.clone(), s.span_id.clone())) {
                                out.spans.push(s);
                            } else {
                                out.duplicates += 1;
                            }
                        }
                        Err(what) => ctx.warnings.push(LineWarning { line, message: format!("{path}: {what}") }),
                    }
                }
            }
        }
    }
    Ok(out)
}

/// Where warnings about the current line go.
struct LineCtx<'a> {
    line: usize,
    warnings: &'a mut Vec<LineWarning>,
}

impl LineCtx<'_> {
    fn warn(&mut self, message: String) {
        self.warnings.push(LineWarning { line: self.line, message });
    }
}

/// `obj[camel]`, or `obj[snake_case]` (proto3 JSON parsers accept both); `null` counts as absent.
fn field<'a>(obj: &'a Value, camel: &str) -> Option<&'a Value> {
    let obj = obj.as_object()?;
    let v = obj.get(camel).or_else(|| {
        let mut snake = String::with_capacity(camel.len() + 4);
        for c in camel.chars() {
            if c.is_ascii_uppercase() {
                snake.push('_');
                snake.push(c.to_ascii_lowercase());
            } else {
                snake.push(c);
            }
        }
        obj.get(&snake)
    })?;
    (!v.is_null()).then_some(v)
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn array<'a>(v: &'a Value, ctx: &mut LineCtx, what: &str) -> &'a [Value] {
    match v.as_array() {
        Some(a) => a,
        None => {
            ctx.warn(format!("{what} is {}, not an array; skipped", kind_of(v)));
            &[]
        }
    }
}

/// A `uint64`/`int64`: a JSON number or a decimal string.
fn u64_of(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

fn i64_of(v: &Value) -> Option<i64> {
    match v {
        Value::Number(n) => n.as_i64().or_else(|| n.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64)),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// An enum: its number, or its name looked up in `names` (index = number).
fn enum_of(v: &Value, names: &[&str]) -> Option<i64> {
    i64_of(v).or_else(|| names.iter().position(|n| Some(*n) == v.as_str()).map(|i| i as i64))
}

const SPAN_KINDS: [&str; 6] = [
    "SPAN_KIND_UNSPECIFIED",
    "SPAN_KIND_INTERNAL",
    "SPAN_KIND_SERVER",
    "SPAN_KIND_CLIENT",
    "SPAN_KIND_PRODUCER",
    "SPAN_KIND_CONSUMER",
];
const STATUS_CODES: [&str; 3] = ["STATUS_CODE_UNSET", "STATUS_CODE_OK", "STATUS_CODE_ERROR"];

/// A trace or span id (`bytes` long): hex as OTLP/JSON says, or base64 as plain proto3 JSON does.
fn id_of(v: &Value, bytes: usize) -> Result<String, String> {
    let s = v.as_str().ok_or_else(|| format!("is {}, not a string", kind_of(v)))?;
    if s.len() == 2 * bytes && s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return Ok(s.to_ascii_lowercase());
    }
    match base64_decode(s) {
        Some(b) if b.len() == bytes => Ok(hex(&b)),
        _ => Err(format!("{s:?} is not a {bytes}-byte id in hex")),
    }
}

fn read_span(
    sp: &Value,
    ctx: &mut LineCtx,
    path: &str,
    resource: &Arc<Attributes>,
    scope: &str,
) -> Result<SpanRecord, String> {
    if !sp.is_object() {
        return Err(format!("a span must be an object, found {}", kind_of(sp)));
    }
    let name = field(sp, "name").and_then(Value::as_str).unwrap_or_default().to_string();
    let named = |what: String| format!("({name:?}) {what}");
    let id = |key: &str, bytes: usize| -> Result<String, String> {
        let v = field(sp, key).ok_or_else(|| named(format!("no {key}")))?;
        id_of(v, bytes).map_err(|e| named(format!("{key} {e}")))
    };
    let trace_id = id("traceId", 16)?;
    let span_id = id("spanId", 8)?;
    let parent_span_id = match field(sp, "parentSpanId") {
        Some(Value::String(s)) if s.is_empty() => None,
        Some(_) => Some(id("parentSpanId", 8)?),
        None => None,
    };
    let time = |key: &str| -> Result<u64, String> {
        let v = field(sp, key).ok_or_else(|| named(format!("no {key}")))?;
        u64_of(v).ok_or_else(|| named(format!("{key} {v} is not an unsigned 64-bit integer")))
    };
    let start_ns = time("startTimeUnixNano")?;
    let end_ns = time("endTimeUnixNano")?;
    if end_ns < start_ns {
        ctx.warn(format!("{path}: ({name:?}) ends {} ns before it starts", start_ns - end_ns));
    }
    let attributes = field(sp, "attributes").map(|a| attributes(a, ctx, path)).unwrap_or_default();
    let kind = field(sp, "kind").and_then(|k| enum_of(k, &SPAN_KINDS)).unwrap_or(0);
    let status = field(sp, "status");
    let status_code = status.and_then(|s| field(s, "code")).and_then(|c| enum_of(c, &STATUS_CODES)).unwrap_or(0);
    let status_message =
        status.and_then(|s| field(s, "message")).and_then(Value::as_str).unwrap_or_default().to_string();
    Ok(SpanRecord {
        line: ctx.line,
        trace_id,
        span_id,
        parent_span_id,
        name,
        kind,
        start_ns,
        end_ns,
        attributes,
        resource: Arc::clone(resource),
        scope: scope.to_string(),
        status_code,
        status_message,
    })
}

/// A `KeyValue` list; an entry without a key or with an unreadable value is warned about and
/// left out.
fn attributes(v: &Value, ctx: &mut LineCtx, path: &str) -> Attributes {
    let mut out = Attributes::new();
    for kv in array(v, ctx, &format!("{path}.attributes")) {
        let Some(key) = field(kv, "key").and_then(Value::as_str) else {
            ctx.warn(format!("{path}: an attribute without a key: {kv}"));
            continue;
        };
        match field(kv, "value").map_or(Ok(AttrValue::Empty), |v| any_value(v, ctx, path)) {
            Ok(value) => {
                out.insert(key.to_string(), value);
            }
            Err(what) => ctx.warn(format!("{path}: attribute {key:?}: {what}")),
        }
    }
    out
}

fn any_value(v: &Value, ctx: &mut LineCtx, path: &str) -> Result<AttrValue, String> {
    if !v.is_object() {
        return Err(format!("an AnyValue must be an object, found {}", kind_of(v)));
    }
    // Unknown members are ignored, as the JSON mapping says.
    if let Some(s) = field(v, "stringValue") {
        return s.as_str().map(|s| AttrValue::Str(s.to_string())).ok_or_else(|| format!("stringValue {s}"));
    }
    if let Some(b) = field(v, "boolValue") {
        return b.as_bool().map(AttrValue::Bool).ok_or_else(|| format!("boolValue {b}"));
    }
    if let Some(i) = field(v, "intValue") {
        return i64_of(i).map(AttrValue::Int).ok_or_else(|| format!("intValue {i} is not a 64-bit integer"));
    }
    if let Some(d) = field(v, "doubleValue") {
        let parsed = match d {
            Value::Number(n) => n.as_f64(),
            Value::String(s) => match s.as_str() {
                "NaN" => Some(f64::NAN),
                "Infinity" => Some(f64::INFINITY),
                "-Infinity" => Some(f64::NEG_INFINITY),
                s => s.trim().parse().ok(),
            },
            _ => None,
        };
        return parsed.map(AttrValue::Double).ok_or_else(|| format!("doubleValue {d} is not a number"));
    }
    if let Some(a) = field(v, "arrayValue") {
        let values = field(a, "values").map(|vs| array(vs, ctx, path)).unwrap_or_default();
        return values.iter().map(|x| any_value(x, ctx, path)).collect::<Result<_, _>>().map(AttrValue::Array);
    }
    if let Some(l) = field(v, "kvlistValue") {
        return Ok(AttrValue::KvList(field(l, "values").map(|vs| attributes(vs, ctx, path)).unwrap_or_default()));
    }
    if let Some(b) = field(v, "bytesValue") {
        return b
            .as_str()
            .and_then(base64_decode)
            .map(AttrValue::Bytes)
            .ok_or_else(|| format!("bytesValue {b} is not base64"));
    }
    Ok(AttrValue::Empty)
}

#[cfg(test)]
#[path = "otlp_json_tests.rs"]
pub(crate) mod tests;
