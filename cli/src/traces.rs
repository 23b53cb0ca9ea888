//! `kvfleet traces collect|analyze`: the trace sink and the trace analyser (docs/tracing.md),
//! thin shells over the `kvfleet-otel` crate.
//!
//! - `collect` serves OTLP/gRPC (`TraceService/Export`) and appends every Export request to a
//!   file as one line of OTLP JSON. It prints `otlp on ADDR` once it accepts connections (other
//!   tools parse that line) and a span count when stopped by SIGINT or SIGTERM.
//! - `analyze` reads such a file (or an OpenTelemetry Collector `file` exporter's), warns about
//!   malformed lines by number on stderr, prints a summary table and writes JSON, CSV and SVG.

use crate::{say, InputError};
use anyhow::Context as _;
use clap::{Args, Subcommand};
use kvfleet_otel::{analyze, parse_file, plots, report, Sink, TracesError};
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum TracesCommand {
    /// Receive OpenTelemetry spans over OTLP/gRPC and write them to a file as OTLP JSON lines.
    Collect(CollectArgs),
    /// Per-migration breakdowns, distributions per policy and link, request timelines and plots
    /// from a file of OTLP JSON lines.
    Analyze(AnalyzeArgs),
}

#[derive(Args)]
pub struct CollectArgs {
    /// Address for the OTLP/gRPC listener (plaintext); port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:4317")]
    listen: SocketAddr,
    /// File to write (one OTLP JSON line per Export request); truncated unless --append.
    #[arg(short, long)]
    out: PathBuf,
    /// Append to --out instead of truncating it.
    #[arg(long)]
    append: bool,
}

#[derive(Args)]
pub struct AnalyzeArgs {
    /// OTLP JSON lines: from `kvfleet traces collect` or a Collector's `file` exporter.
    file: PathBuf,
    /// Directory for analysis.json, migrations.csv, requests.csv and the SVG plots.
    #[arg(short, long)]
    out: Option<PathBuf>,
    /// Also write the analysis as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Migrations listed in the table and drawn in the Gantt chart, slowest first.
    #[arg(long, default_value_t = 10)]
    slowest: usize,
    /// Warnings about malformed lines printed at most (all are in analysis.json).
    #[arg(long, default_value_t = 50)]
    max_warnings: usize,
}

pub fn run(cmd: TracesCommand) -> anyhow::Result<()> {
    match cmd {
        TracesCommand::Collect(a) => collect(a),
        TracesCommand::Analyze(a) => analyze_cmd(a),
    }
}

/// Completes on SIGINT or SIGTERM.
pub(crate) async fn stop_signal() {
    StopSignal::listen().wait().await;
}

/// SIGINT and SIGTERM, listened for from its creation on: one sent before [`StopSignal::wait`]
/// is awaited is not lost, and no longer kills the process (create it, inside the runtime,
/// before telling anyone to press Ctrl-C).
pub(crate) struct StopSignal {
    interrupt: Option<tokio::signal::unix::Signal>,
    terminate: Option<tokio::signal::unix::Signal>,
}

impl StopSignal {
    /// Start listening (needs a Tokio runtime context).
    pub(crate) fn listen() -> StopSignal {
        use tokio::signal::unix::{signal, SignalKind};
        StopSignal { interrupt: signal(SignalKind::interrupt()).ok(), terminate: signal(SignalKind::terminate()).ok() }
    }

    /// Until either signal arrives.
    pub(crate) async fn wait(self) {
        async fn recv(s: Option<tokio::signal::unix::Signal>) {
            match s {
                Some(mut s) => {
                    s.recv().await;
                }
                None => std::future::pending().await,
            }
        }
        tokio::select! {
            () = recv(self.interrupt) => {}
            () = recv(self.terminate) => {}
        }
    }
}

fn collect(args: CollectArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        let sink = Sink::bind(args.listen, &args.out, args.append).await.map_err(|e| match e {
            // A file that cannot be created is the user's input; a taken port is the machine's.
            TracesError::Io { .. } => anyhow::Error::new(InputError(e.to_string())),
            e => anyhow::Error::new(e),
        })?;
        say!("otlp on {}", sink.local_addr());
        let stats = sink.serve(stop_signal()).await.context("serving OTLP")?;
        say!(
            "received {} spans in {} export requests; wrote {} bytes to {}",
            stats.spans,
            stats.requests,
            stats.bytes,
            args.out.display()
        );
        Ok(())
    })
}

fn analyze_cmd(args: AnalyzeArgs) -> anyhow::Result<()> {
    let parsed = parse_file(&args.file).map_err(|e| InputError(e.to_string()))?;
    for w in parsed.warnings.iter().take(args.max_warnings) {
        eprintln!("warning: {}: {w}", args.file.display());
    }
    if parsed.warnings.len() > args.max_warnings {
        eprintln!("warning: {}: {} more warnings", args.file.display(), parsed.warnings.len() - args.max_warnings);
    }
    if parsed.spans.is_empty() {
        return Err(InputError(format!(
            "{}: no spans ({} lines, {} of them malformed)",
            args.file.display(),
            parsed.lines,
            parsed.warnings.len()
        ))
        .into());
    }
    let analysis = analyze(&parsed.spans);
    say!("{}", report::summary_table(&parsed, &analysis, args.slowest));
    let mut written = Vec::new();
    if let Some(path) = &args.json {
        written.push(report::write_json(path, &parsed, &analysis)?);
    }
    if let Some(dir) = &args.out {
        written.extend(report::write_outputs(dir, &parsed, &analysis)?);
        written.extend(plots::write_plots(dir, &analysis, args.slowest)?);
    }
    for p in &written {
        say!("wrote {}", p.display());
    }
    Ok(())
}
