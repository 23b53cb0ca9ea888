//! The trace sink: an OTLP/gRPC `TraceService` that appends each Export request to a file as
//! one line of OTLP JSON (the OpenTelemetry Collector `file` exporter's format).
//!
//! A request is written — one `write` of the whole line, under a lock, so lines never
//! interleave — *before* it is acknowledged: once an exporter has its `ExportTraceServiceResponse`
//! the spans are in the operating system's hands, and killing the sink loses none of them.
//! Requests without spans are acknowledged and not written. Plaintext gRPC only; compressed
//! requests are refused with `UNIMPLEMENTED` (exporters send uncompressed by default).
//!
//! ```no_run
//! # async fn f() -> Result<(), kvfleet_otel::TracesError> {
//! let sink = kvfleet_otel::Sink::bind("127.0.0.1:4317".parse().unwrap(), "spans.jsonl".as_ref(), false).await?;
//! println!("otlp on {}", sink.local_addr());
//! let stats = sink.serve(async { tokio::signal::ctrl_c().await.ok(); }).await?;
//! println!("{} spans", stats.spans);
//! # Ok(()) }
//! ```

use crate::otlp_json::encode_request;
use crate::TracesError;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use std::future::Future;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tonic::{Request, Response, Status};

/// The largest Export request accepted (tonic's default is 4 MiB; a worker flushing a long
/// run's migration spans in one batch can exceed that).
pub const MAX_REQUEST_BYTES: usize = 64 << 20;

/// What a sink received, so far or in all.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SinkStats {
    /// Export requests written (those with at least one span).
    pub requests: u64,
    /// Spans in those requests.
    pub spans: u64,
    /// Bytes written to the file, newlines included.
    pub bytes: u64,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    spans: AtomicU64,
    bytes: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> SinkStats {
        SinkStats {
            requests: self.requests.load(Ordering::Relaxed),
            spans: self.spans.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
        }
    }
}

/// A live count of what a running [`Sink`] has written.
#[derive(Clone)]
pub struct StatsHandle(Arc<Counters>);

impl StatsHandle {
    /// The counts now.
    pub fn get(&self) -> SinkStats {
        self.0.snapshot()
    }
}

/// A bound, not yet serving, trace sink.
pub struct Sink {
    listener: tokio::net::TcpListener,
    local_addr: SocketAddr,
    service: SpanFileService,
}

impl Sink {
    /// Binds `listen` (port 0: any free port) and opens `out` (truncated, or appended to when
    /// `append`). Nothing is accepted until [`Sink::serve`].
    pub async fn bind(listen: SocketAddr, out: &Path, append: bool) -> Result<Sink, TracesError> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(out)
            .map_err(|e| TracesError::io(out, e))?;
        let listener =
            tokio::net::TcpListener::bind(listen).await.map_err(|source| TracesError::Bind { addr: listen, source })?;
        let local_addr = listener.local_addr().map_err(|source| TracesError::Bind { addr: listen, source })?;
        let service = SpanFileService {
            file: Arc::new(Mutex::new(file)),
            path: Arc::new(out.to_path_buf()),
            counters: Arc::default(),
        };
        Ok(Sink { listener, local_addr, service })
    }

    /// The address actually bound (the port chosen when 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// A handle that reads the counts while [`Sink::serve`] runs.
    pub fn stats(&self) -> StatsHandle {
        StatsHandle(Arc::clone(&self.service.counters))
    }

    /// Serves until `shutdown` completes, then finishes the requests in flight (each is written
    /// before its response) and returns what was received.
    pub async fn serve(self, shutdown: impl Future<Output = ()> + Send) -> Result<SinkStats, TracesError> {
        let counters = Arc::clone(&self.service.counters);
        let incoming = tonic::transport::server::TcpIncoming::from(self.listener).with_nodelay(Some(true));
        let svc = TraceServiceServer::new(self.service).max_decoding_message_size(MAX_REQUEST_BYTES);
        tonic::transport::Server::builder().add_service(svc).serve_with_incoming_shutdown(incoming, shutdown).await?;
        Ok(counters.snapshot())
    }
}

/// [`Sink::bind`] then [`Sink::serve`]; `on_ready` gets the bound address before serving starts.
pub async fn serve(
    listen: SocketAddr,
    out: PathBuf,
    shutdown: impl Future<Output = ()> + Send,
    on_ready: impl FnOnce(SocketAddr),
) -> Result<SinkStats, TracesError> {
    let sink = Sink::bind(listen, &out, false).await?;
    on_ready(sink.local_addr());
    sink.serve(shutdown).await
}

#[derive(Clone)]
struct SpanFileService {
    file: Arc<Mutex<std::fs::File>>,
    path: Arc<PathBuf>,
    counters: Arc<Counters>,
}

#[tonic::async_trait]
impl TraceService for SpanFileService {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let req = request.into_inner();
        let spans: usize = req.resource_spans.iter().flat_map(|r| &r.scope_spans).map(|s| s.spans.len()).sum();
        if spans > 0 {
            let mut line = serde_json::to_vec(&encode_request(&req))
                .map_err(|e| Status::internal(format!("encoding spans as JSON: {e}")))?;
            line.push(b'\n');
            let len = line.len() as u64;
            let file = Arc::clone(&self.file);
            let written = tokio::task::spawn_blocking(move || {
                let mut f = file.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                f.write_all(&line).and_then(|()| f.flush())
            })
            .await
            .map_err(|e| Status::internal(format!("writer task: {e}")))?;
            if let Err(e) = written {
                tracing::error!(path = %self.path.display(), error = %e, "writing spans failed");
                return Err(Status::unavailable(format!("writing {}: {e}", self.path.display())));
            }
            self.counters.requests.fetch_add(1, Ordering::Relaxed);
            self.counters.spans.fetch_add(spans as u64, Ordering::Relaxed);
            self.counters.bytes.fetch_add(len, Ordering::Relaxed);
            tracing::debug!(spans, bytes = len, "export written");
        }
        Ok(Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::otlp_json::parse_file;
    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_client::TraceServiceClient;
    use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, InstrumentationScope, KeyValue};
    use opentelemetry_proto::tonic::resource::v1::Resource;
    use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};

    fn kv(key: &str, v: any_value::Value) -> KeyValue {
        KeyValue { key: key.into(), value: Some(AnyValue { value: Some(v) }), key_strindex: 0 }
    }

    fn request(trace: u8, names: &[&str]) -> ExportTraceServiceRequest {
        let spans = names
            .iter()
            .enumerate()
            .map(|(i, name)| Span {
                trace_id: vec![trace; 16],
                span_id: vec![i as u8 + 1; 8],
                parent_span_id: if i == 0 { vec![] } else { vec![1; 8] },
                name: name.to_string(),
                kind: 1,
                start_time_unix_nano: 1_700_000_000_000_000_000 + i as u64,
                end_time_unix_nano: 1_700_000_000_500_000_000,
                attributes: vec![
                    kv("kvfleet.request.id", any_value::Value::IntValue(i64::MAX - i as i64)),
                    kv("kvfleet.policy", any_value::Value::StringValue("pascal".into())),
                    kv("kvfleet.migration.downtime_ms", any_value::Value::DoubleValue(0.25)),
                ],
                ..Default::default()
            })
            .collect();
        ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(Resource {
                    attributes: vec![kv("service.name", any_value::Value::StringValue("kvfleet-worker".into()))],
                    ..Default::default()
                }),
                scope_spans: vec![ScopeSpans {
                    scope: Some(InstrumentationScope { name: "kvfleet".into(), ..Default::default() }),
                    spans,
                    schema_url: String::new(),
                }],
                schema_url: String::new(),
            }],
        }
    }

    /// The sink in-process on a free port, a real tonic OTLP client, and the file read back.
    #[tokio::test]
    async fn exports_from_a_tonic_client_are_written_as_otlp_json_lines() {
        let dir = std::env::temp_dir().join(format!("kvfleet-otel-sink-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("spans.jsonl");
        let sink = Sink::bind("127.0.0.1:0".parse().unwrap(), &out, false).await.unwrap();
        let addr = sink.local_addr();
        assert_ne!(addr.port(), 0);
        let stats = sink.stats();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(sink.serve(async {
            let _ = stopped.await;
        }));

        let mut client = TraceServiceClient::connect(format!("http://{addr}")).await.unwrap();
        client.export(request(0xaa, &["request", "placement"])).await.unwrap();
        // An empty request is acknowledged and not written.
        client.export(ExportTraceServiceRequest::default()).await.unwrap();
        client.export(request(0xbb, &["migration"])).await.unwrap();
        // Acknowledged means written: the file is complete before the sink stops.
        assert_eq!(stats.get(), SinkStats { requests: 2, spans: 3, bytes: std::fs::metadata(&out).unwrap().len() });
        let text = std::fs::read_to_string(&out).unwrap();
        assert_eq!(text.lines().count(), 2, "{text}");
        assert!(text.lines().all(|l| l.starts_with(r#"{"resourceSpans":[{"#)), "{text}");

        let parsed = parse_file(&out).unwrap();
        assert!(parsed.warnings.is_empty(), "{:?}", parsed.warnings);
        assert_eq!(parsed.requests, 2);
        let names: Vec<&str> = parsed.spans.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["request", "placement", "migration"]);
        let placement = &parsed.spans[1];
        assert_eq!(placement.trace_id, "aa".repeat(16));
        assert_eq!(placement.span_id, "02".repeat(8));
        assert_eq!(placement.parent_span_id.as_deref(), Some("0101010101010101"));
        assert_eq!(placement.start_ns, 1_700_000_000_000_000_001);
        assert_eq!(placement.attr_i64("kvfleet.request.id"), Some(i64::MAX - 1));
        assert_eq!(placement.attr_str("kvfleet.policy"), Some("pascal"));
        assert_eq!(placement.attr_f64("kvfleet.migration.downtime_ms"), Some(0.25));
        assert_eq!(placement.resource.get("service.name").and_then(|v| v.as_str()), Some("kvfleet-worker"));
        assert_eq!(placement.scope, "kvfleet");
        assert_eq!(parsed.spans[0].parent_span_id, None);

        stop.send(()).unwrap();
        let total = server.await.unwrap().unwrap();
        assert_eq!(total.spans, 3);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn binding_a_taken_port_names_the_address() {
        let dir = std::env::temp_dir().join(format!("kvfleet-otel-bind-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let err = Sink::bind(addr, &dir.join("x.jsonl"), false).await.err().expect("the port is taken");
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
        let err = Sink::bind("127.0.0.1:0".parse().unwrap(), &dir.join("no/such/dir/x.jsonl"), false)
            .await
            .err()
            .expect("the directory is missing");
        assert!(err.to_string().contains("no/such/dir/x.jsonl"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
