//! OpenTelemetry for kvfleet processes (docs/tracing.md is the span schema).
//!
//! - [`init`]: the process's `tracing` subscriber — logs to stderr (`RUST_LOG`, default `info`)
//!   and, with `--otlp-endpoint` / `OTEL_EXPORTER_OTLP_ENDPOINT`, an OTLP/gRPC exporter fed both
//!   by `tracing` spans (through `tracing-opentelemetry`) and by [`OpenSpan`]s.
//! - W3C trace context (`traceparent`) in and out of gRPC metadata ([`inject_metadata`],
//!   [`extract_metadata`]) and plain string maps such as the migration protocol's
//!   `Prepare.trace_context` ([`inject`], [`extract`]).
//! - [`OpenSpan`]: a span whose start and end are *measured* times (the cluster clock, converted
//!   to Unix time) rather than "now". The migration state machine is sans-IO and records when each
//!   phase happened; its driver turns that report into spans after the fact, so the exported
//!   phases are exactly the measurements the metrics use.
//! - [`prom`]: the Prometheus `/metrics` page of the workers and coordinators (prometheus-client).
//!
//! Without an endpoint the global tracer is OpenTelemetry's no-op one: spans cost a few
//! allocations, carry invalid contexts, and nothing is injected into requests.

#![warn(missing_docs)]

pub mod prom;

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::{Span as _, SpanContext, TraceContextExt, Tracer as _, TracerProvider as _};
use opentelemetry::{global, InstrumentationScope};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

pub use opentelemetry::{Context, KeyValue};

/// The instrumentation scope of every kvfleet span.
pub const SCOPE: &str = "kvfleet";

/// A W3C trace-context carrier (`traceparent`, `tracestate`), as sent in `Prepare.trace_context`.
pub type Carrier = HashMap<String, String>;

/// Where a process sends its spans. Shared by every kvfleet binary.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TelemetryArgs {
    /// OTLP/gRPC endpoint to export spans to, e.g. `http://127.0.0.1:4317` (`kvfleet traces
    /// collect`, Jaeger, Tempo or an OpenTelemetry Collector). Unset: no spans are exported.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,
}

/// Who is exporting: the OpenTelemetry resource of this process.
#[derive(Debug, Clone)]
pub struct Service {
    /// `service.name`: `kvfleet-coordinator`, `kvfleet-worker`, `kvfleet`.
    pub name: &'static str,
    /// `service.instance.id`: `worker-3`, `coordinator-1`.
    pub instance_id: String,
    /// More resource attributes (`kvfleet.instance` for workers).
    pub attributes: Vec<KeyValue>,
}

/// Errors of [`init`].
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The OTLP endpoint is not a usable URL, or the exporter could not be built for it.
    #[error("--otlp-endpoint {endpoint:?}: {reason}")]
    Endpoint {
        /// The endpoint as given.
        endpoint: String,
        /// Why it was rejected.
        reason: String,
    },
    /// The global `tracing` subscriber could not be installed (e.g. one is already set).
    #[error("installing the tracing subscriber: {0}")]
    Subscriber(String),
}

/// The installed exporter; [`Telemetry::shutdown`] flushes what is still queued.
#[must_use = "call shutdown() before exiting so queued spans are exported"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// True when spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Export every queued span and stop the exporter (bounded by the exporter's own timeout).
    pub fn shutdown(&self) {
        if let Some(p) = &self.provider {
            if let Err(e) = p.force_flush() {
                eprintln!("kvfleet: flushing spans: {e}");
            }
            let _ = p.shutdown();
        }
    }
}

/// A binary's `main` around `run`: telemetry set up for `service` ([`init`]), `run` awaited,
/// spans flushed. An error is one line on stderr, `NAME: error: …`, and exit status 2 when a
/// cause in its chain is the user's input (`bad_input`, or an OTLP endpoint that is no URL: a
/// flag whose value cannot work), else 1.
pub async fn run_main<F>(
    service: Service,
    args: &TelemetryArgs,
    run: F,
    bad_input: fn(&(dyn std::error::Error + 'static)) -> bool,
) -> std::process::ExitCode
where
    F: std::future::Future<Output = anyhow::Result<()>>,
{
    let name = service.name;
    let result = match init(service, args) {
        Ok(telemetry) => {
            let result = run.await;
            telemetry.shutdown();
            result
        }
        Err(e) => Err(e.into()),
    };
    let Err(e) = result else { return std::process::ExitCode::SUCCESS };
    eprintln!("{name}: error: {e:#}");
    let bad_endpoint =
        |c: &(dyn std::error::Error + 'static)| matches!(c.downcast_ref(), Some(TelemetryError::Endpoint { .. }));
    if e.chain().any(|c| bad_input(c) || bad_endpoint(c)) {
        std::process::ExitCode::from(2)
    } else {
        std::process::ExitCode::FAILURE
    }
}

/// Install the process's subscriber (logs to stderr; spans to `args.otlp_endpoint` if set) and
/// the W3C propagator. Call once, inside the tokio runtime (the gRPC exporter lives on it).
pub fn init(service: Service, args: &TelemetryArgs) -> Result<Telemetry, TelemetryError> {
    global::set_text_map_propagator(TraceContextPropagator::new());
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .with_filter(filter);
    let endpoint = args.otlp_endpoint.as_deref().map(str::trim).filter(|e| !e.is_empty());
    let Some(endpoint) = endpoint else {
        tracing_subscriber::registry().with(fmt).try_init().map_err(|e| TelemetryError::Subscriber(e.to_string()))?;
        return Ok(Telemetry { provider: None });
    };
    let provider = provider(service, endpoint)?;
    global::set_tracer_provider(provider.clone());
    // Only kvfleet's own spans: the exporter's gRPC client (tonic, h2, hyper) logs through
    // `tracing` too, and exporting those would feed the exporter with its own work.
    let otel = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer(SCOPE))
        .with_filter(tracing_subscriber::filter::filter_fn(|m| m.target().starts_with("kvfleet")))
        .with_filter(tracing_subscriber::filter::LevelFilter::INFO);
    tracing_subscriber::registry()
        .with(fmt)
        .with(otel)
        .try_init()
        .map_err(|e| TelemetryError::Subscriber(e.to_string()))?;
    tracing::info!(endpoint, "exporting spans over OTLP/gRPC");
    Ok(Telemetry { provider: Some(provider) })
}

/// Whether `endpoint` is an OTLP/gRPC endpoint a process can export to: an `http://` or
/// `https://` URL (what a launcher checks before it starts processes that would each refuse it).
pub fn check_endpoint(endpoint: &str) -> Result<(), TelemetryError> {
    let bad = |reason: String| TelemetryError::Endpoint { endpoint: endpoint.to_string(), reason };
    if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
        return Err(bad("expected an http:// or https:// URL, e.g. http://127.0.0.1:4317".into()));
    }
    endpoint.parse::<tonic::transport::Uri>().map(drop).map_err(|e| bad(e.to_string()))
}

fn provider(service: Service, endpoint: &str) -> Result<SdkTracerProvider, TelemetryError> {
    use opentelemetry_otlp::WithExportConfig;
    let bad = |reason: String| TelemetryError::Endpoint { endpoint: endpoint.to_string(), reason };
    check_endpoint(endpoint)?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .with_timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| bad(e.to_string()))?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service.name)
        .with_attribute(KeyValue::new("service.instance.id", service.instance_id))
        .with_attributes(service.attributes)
        .build();
    // Export every 500 ms (the SDK's default is 5 s): a process stopped or killed loses at most
    // that much, and a run's last spans reach the sink before the run is torn down.
    let batch = opentelemetry_sdk::trace::BatchConfigBuilder::default()
        .with_scheduled_delay(Duration::from_millis(500))
        .with_max_queue_size(8192)
        .build();
    let processor = opentelemetry_sdk::trace::BatchSpanProcessor::builder(exporter).with_batch_config(batch).build();
    Ok(SdkTracerProvider::builder().with_span_processor(processor).with_resource(resource).build())
}

fn tracer() -> global::BoxedTracer {
    global::tracer_with_scope(InstrumentationScope::builder(SCOPE).build())
}

/// Unix time of `ns` nanoseconds since the epoch (the cluster clock's `epoch_unix_ns + t`).
pub fn unix_time(ns: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(ns)
}

// ------------------------------------------------------------------------ propagation

/// The trace context of the current `tracing` span (through `tracing-opentelemetry`), else of
/// OpenTelemetry's current context.
pub fn current() -> Context {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let cx = tracing::Span::current().context();
    if cx.span().span_context().is_valid() {
        cx
    } else {
        Context::current()
    }
}

/// `cx` as a W3C carrier (empty when `cx` holds no valid span).
pub fn inject(cx: &Context) -> Carrier {
    let mut c = Carrier::new();
    if cx.span().span_context().is_valid() {
        global::get_text_map_propagator(|p| p.inject_context(cx, &mut c));
    }
    c
}

/// The context a carrier names (an empty context when it names none or is malformed).
pub fn extract(c: &Carrier) -> Context {
    global::get_text_map_propagator(|p| p.extract(c))
}

/// Put `cx` into outgoing gRPC metadata.
pub fn inject_metadata(cx: &Context, md: &mut tonic::metadata::MetadataMap) {
    if cx.span().span_context().is_valid() {
        global::get_text_map_propagator(|p| p.inject_context(cx, &mut MetadataInjector(md)));
    }
}

/// The context in incoming gRPC metadata.
pub fn extract_metadata(md: &tonic::metadata::MetadataMap) -> Context {
    global::get_text_map_propagator(|p| p.extract(&MetadataExtractor(md)))
}

/// A gRPC request carrying `cx`.
pub fn request_with<T>(cx: &Context, msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    inject_metadata(cx, r.metadata_mut());
    r
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct MetadataExtractor<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

// ------------------------------------------------------------------------ measured spans

/// A span started at a measured time and ended, later, at another; children are recorded whole.
pub struct OpenSpan {
    span: global::BoxedSpan,
    cx: Context,
}

impl OpenSpan {
    /// Start `name` at `start` under `parent` (a root span when `parent` holds none).
    pub fn start(name: &'static str, parent: &Context, start: SystemTime, attributes: Vec<KeyValue>) -> OpenSpan {
        let span = tracer()
            .span_builder(name)
            .with_start_time(start)
            .with_attributes(attributes)
            .start_with_context(&tracer(), parent);
        let cx = parent.with_remote_span_context(span.span_context().clone());
        OpenSpan { span, cx }
    }

    /// The context of this span, for children and for propagation.
    pub fn context(&self) -> &Context {
        &self.cx
    }

    /// This span's identity.
    pub fn span_context(&self) -> &SpanContext {
        self.span.span_context()
    }

    /// This span as a W3C carrier.
    pub fn carrier(&self) -> Carrier {
        inject(&self.cx)
    }

    /// Add attributes (e.g. the outcome, once known).
    pub fn set(&mut self, attributes: impl IntoIterator<Item = KeyValue>) {
        for kv in attributes {
            self.span.set_attribute(kv);
        }
    }

    /// Record a whole child span `[start, end]`.
    pub fn child(&self, name: &'static str, start: SystemTime, end: SystemTime, attributes: Vec<KeyValue>) {
        record(name, &self.cx, start, end, attributes);
    }

    /// End at `end`; the span is exported.
    pub fn end(mut self, end: SystemTime) {
        self.span.end_with_timestamp(end);
    }
}

/// Record a whole span `[start, end]` under `parent`.
pub fn record(name: &'static str, parent: &Context, start: SystemTime, end: SystemTime, attributes: Vec<KeyValue>) {
    let mut span = tracer()
        .span_builder(name)
        .with_start_time(start)
        .with_attributes(attributes)
        .start_with_context(&tracer(), parent);
    span.end_with_timestamp(end.max(start));
}

#[cfg(test)]
mod tests;
