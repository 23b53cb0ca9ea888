//! kvfleet's trace sink and trace analyser (docs/tracing.md).
//!
//! Every kvfleet process exports OpenTelemetry spans over OTLP/gRPC. This crate is the other end:
//!
//! - [`collect`]: [`Sink`], a real OTLP/gRPC receiver (the `TraceService/Export` service from
//!   OpenTelemetry's own proto definitions, `opentelemetry-proto`). Each Export request becomes
//!   one line of OTLP JSON in a file, the format of an OpenTelemetry Collector's `file` exporter,
//!   written before the request is acknowledged.
//! - [`otlp_json`]: the OTLP/JSON encoding of an Export request ([`otlp_json::encode_request`])
//!   and a lenient line-by-line reader ([`parse_reader`], [`parse_file`]) that turns a file of
//!   such lines (ours or a Collector's) into flat [`SpanRecord`]s; a malformed line becomes a
//!   [`LineWarning`] naming its line number and the rest is read.
//! - [`model`]: the spans joined into per-migration reconstructions ([`TracedMigration`]: phases,
//!   bytes, downtime, goodput, completeness) and per-request timelines ([`RequestTimeline`]),
//!   with P50/P90/P99 distributions per policy and per link ([`GroupStats`]).
//! - [`stats`]: [`stats::Percentiles`], P50/P90/P99 with `kvfleet_core`'s nearest-rank percentiles.
//! - [`report`]: the summary table, `analysis.json`, `migrations.csv`, `requests.csv`.
//! - [`plots`]: SVG plots (downtime vs sequence length, a Gantt chart of the slowest
//!   migrations' stages, CDFs of downtime and total time).
//!
//! The `kvfleet traces collect|analyze` commands (cli/src/traces.rs) are thin shells over these.

#![warn(missing_docs)]

pub mod collect;
pub mod model;
pub mod otlp_json;
pub mod plots;
pub mod report;
pub mod stats;

use std::path::PathBuf;

pub use collect::{Sink, SinkStats};
pub use model::{analyze, Analysis, GroupStats, Phase, RequestTimeline, TracedMigration};
pub use otlp_json::{parse_file, parse_reader, AttrValue, Attributes, LineWarning, ParsedTraces, SpanRecord};

/// What can go wrong in this crate. Every variant names the file or address it is about.
#[derive(Debug, thiserror::Error)]
pub enum TracesError {
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file's content is unusable (e.g. a compressed trace file) or could not be encoded.
    #[error("{path}: {what}")]
    Input {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        what: String,
    },
    /// The OTLP/gRPC listener could not be bound.
    #[error("cannot listen for OTLP on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: std::net::SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The OTLP/gRPC server failed while serving.
    #[error("OTLP server: {0}")]
    Server(#[from] tonic::transport::Error),
    /// An SVG plot could not be drawn or written.
    #[error("plot {name}: {what}")]
    Plot {
        /// The plot's name.
        name: String,
        /// What went wrong.
        what: String,
    },
}

impl TracesError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> TracesError {
        TracesError::Io { path: path.into(), source }
    }
}
