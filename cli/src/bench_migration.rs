//! `kvfleet bench migration`: how fast and how disruptive a live KV migration is on this host.
//!
//! (a) the host's baselines: raw UDP with GSO/GRO in QUIC-sized datagrams, and raw TCP, between two
//! processes; (b) QUIC goodput over the same loopback with the cluster's mutual TLS, and the ratios; (c) real migrations between two real
//! worker processes for sequences of 256 … 16k tokens of the 32B model (256 KiB of KV per token):
//! total time and downtime of the pipelined stop-and-copy, beside a blocking stop-and-copy
//! (`--max-stages 0`: pause, copy everything, resume) whose downtime is its whole copy.
//!
//! With `--link-gbps` the workers shape their migration links to that rate, and each migration is
//! also run in the simulator (`kvfleet_sim::migration::simulate_one`: the same protocol machines,
//! the same model's KV geometry and H100 timing, the same knobs, over a fabric link of that rate),
//! with the ratio emulated / simulated total time: how far the simulator's link model is from a
//! real transfer at the rate it models.

use crate::up::procs::{sibling_binary, Proc};
use crate::{say, InputError};
use clap::Args;
use kvfleet_pki::{ClusterCa, IdentityFiles, NodeIdentity, Role, TlsArgs};
use kvfleet_proto::v1;
use kvfleet_proto::v1::worker_event::Event;
use kvfleet_transport::bench::{self, SinkKind, DEFAULT_CHUNK_BYTES};
use kvfleet_transport::bench_udp;
use kvfleet_transport::QuicTuning;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

const KV_BYTES_PER_TOKEN: u64 = 256 << 10;

#[derive(Args)]
pub struct MigrationBench {
    /// Bytes per goodput measurement (a, b).
    #[arg(long, default_value = "1GiB", value_parser = kvfleet_worker::options::parse_bytes)]
    bytes: u64,
    /// Parallel streams for the goodput measurements (the workers use `--migration-streams`, 4).
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// Sequence lengths (tokens) to migrate.
    #[arg(long, value_delimiter = ',', default_value = "256,1024,4096,8192,16384")]
    lengths: Vec<u32>,
    /// The workers' `--stop-copy-blocks`: pause for the final copy once fewer new full blocks
    /// remain (default 16). With `--stop-copy-ms` it only decides before the first live stage.
    #[arg(long, default_value_t = 16)]
    stop_copy_blocks: u32,
    /// The workers' `--stop-copy-ms`: once a live stage has measured the link, pause when the new
    /// blocks would copy within this budget (0: off, the block count decides throughout). 16
    /// blocks are 64 MiB: ~5 ms at 100 Gbit/s but ~200 ms over this host's ~2.5 Gbit/s loopback
    /// QUIC; a time budget is right on both.
    #[arg(long, default_value_t = 10.0)]
    stop_copy_ms: f64,
    /// Shape the workers' migration links to this rate (Gbit/s; their `--link-gbps`) and compare
    /// each migration with the simulator's over a link of the same rate. Default: unshaped, and
    /// no simulation (loopback QUIC has no fixed rate to model).
    #[arg(long)]
    link_gbps: Option<f64>,
    /// Added one-way latency on the workers' migration links, µs (their `--link-latency-us`), and
    /// the simulated link's latency (at least 1 µs there: the model needs a positive latency;
    /// loopback's own is of that order).
    #[arg(long, default_value_t = 0.0)]
    link_latency_us: f64,
    /// The workers' `--migration-timeout-ms` (and the simulation's): a 16k-token copy (4 GiB) takes
    /// ~17 s at 2 Gbit/s, beyond the default 10 s.
    #[arg(long, default_value_t = kvfleet_worker::options::WorkerOptions::default().migration_timeout_ms)]
    migration_timeout_ms: u64,
    /// The workers' time dilation (a factor, or `auto`: from the QUIC goodput measured in (b) and
    /// `--link-gbps`, so that the shaped link, not this host, sets the pace). Every time reported
    /// is emulated.
    #[arg(long, default_value = "1")]
    time_dilation: crate::up::cluster::DilationArg,
    /// Skip the blocking stop-and-copy comparison.
    #[arg(long)]
    no_blocking: bool,
    /// Also hand off a request after its prefill, as prefill/decode disaggregation does: the
    /// source is a prefill instance holding the request after its first token (nothing changes
    /// during the copy), moved with the pipelined protocol (mode `handoff`).
    #[arg(long)]
    handoff: bool,
    /// Also move each request to a target whose prefix cache holds its first this many prompt
    /// tokens (a request over the same content ran there first; mode `cached`): only what the
    /// target lacks is sent. 0: off.
    #[arg(long, default_value_t = 0)]
    cached_prefix: u32,
    /// Output directory (migrations.csv, goodput.json, process logs).
    #[arg(short, long, default_value = "results/bench-migration")]
    out: PathBuf,
}

/// The hidden sink process of (a) and (b).
#[derive(Args)]
pub struct SinkArgs {
    #[arg(long, value_parser = ["tcp", "quic", "udp"])]
    kind: String,
    #[command(flatten)]
    tls: TlsArgs,
}

pub fn run_sink(a: SinkArgs) -> anyhow::Result<()> {
    let kind = match a.kind.as_str() {
        "tcp" => SinkKind::Tcp,
        "udp" => SinkKind::Udp,
        _ => SinkKind::Quic,
    };
    let identity = if kind == SinkKind::Quic { a.tls.load()? } else { None };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(bench::serve_sink(kind, "127.0.0.1:0".parse()?, identity.as_ref(), QuicTuning::default(), |addr| {
        println!("listening on {addr}");
    }))?;
    Ok(())
}

struct Row {
    tokens: u32,
    mode: &'static str,
    stats: v1::MigrationStats,
    sim: Option<Simulated>,
    /// CPU the two workers spent while it ran.
    cpu: Option<PairCpu>,
}

/// CPU seconds two processes spent over the same interval.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PairCpu {
    /// The sender (a migration's source).
    source_s: f64,
    /// The receiver (its target).
    target_s: f64,
}

impl PairCpu {
    /// Between two readings of `cpu_seconds` for (source, target).
    fn between(before: [Option<f64>; 2], after: [Option<f64>; 2]) -> Option<PairCpu> {
        Some(PairCpu { source_s: after[0]? - before[0]?, target_s: after[1]? - before[1]? })
    }
}

/// The simulator's run of the same migration (`--link-gbps`).
struct Simulated {
    total_ms: f64,
    /// Pause → `CommitReply` at the source, as the worker measures its downtime.
    downtime_ms: f64,
    stages: usize,
    bytes: u64,
    /// Why it did not commit (`None` if it did).
    abort_reason: Option<String>,
}

impl Row {
    /// Emulated ÷ simulated total time.
    fn total_ratio(&self) -> Option<f64> {
        self.sim.as_ref().map(|s| ms(self.stats.total_ns()) / s.total_ms.max(1e-9))
    }
}

/// The simulator's side of the comparison: the bench workers' model, GPU, timing and KV geometry.
struct SimSide {
    cfg: kvfleet_sim::config::SimConfig,
    engine: kvfleet_core::engine::EngineConfig,
    timing: std::sync::Arc<dyn kvfleet_core::timing::TimingModel>,
}

impl SimSide {
    fn new(link_gbps: f64, link_latency_us: f64, b: &MigrationBench) -> anyhow::Result<SimSide> {
        let mut cfg = kvfleet_sim::config::SimConfig::default();
        // The workers' defaults: R1-Distill-Qwen-32B on an H100, `auto` timing (its profile).
        let worker = kvfleet_worker::options::WorkerOptions::default();
        cfg.cluster.model = worker.model.clone();
        cfg.cluster.gpu = worker.gpu.clone();
        cfg.cluster.timing = worker.timing.clone();
        cfg.cluster.block_size = worker.block_size;
        cfg.link.bandwidth_gbps = link_gbps;
        cfg.link.latency_us = link_latency_us.max(1.0);
        cfg.migration.stop_copy_blocks = b.stop_copy_blocks;
        cfg.migration.stop_copy_ms = b.stop_copy_ms;
        cfg.migration.timeout_ms = b.migration_timeout_ms as f64;
        cfg.link.validate().map_err(|e| InputError(format!("--link-gbps / --link-latency-us: {e}")))?;
        let (model, gpu) = cfg.specs()?;
        let engine = cfg.engine_config(&model, &gpu)?;
        let timing = kvfleet_sim::timing_model(&cfg, Path::new("."))?;
        Ok(SimSide { cfg, engine, timing })
    }

    /// The migration of a request of `prompt_tokens` with the workers' `--max-stages`.
    fn simulate(&self, prompt_tokens: u32, max_stages: u32) -> anyhow::Result<Simulated> {
        let migration = kvfleet_sim::config::MigrationConfig { max_stages, ..self.cfg.migration.clone() };
        // The worker's source holds the prompt and its first token's KV when it migrates.
        let (r, report) = kvfleet_sim::migration::simulate_one(
            prompt_tokens + 1,
            self.cfg.link.clone(),
            migration.params(),
            &self.engine,
            self.timing.clone(),
        )?;
        Ok(Simulated {
            total_ms: r.transfer_s() * 1e3,
            // The source's own downtime (to its `CommitReply`), as the workers measure it.
            downtime_ms: report.downtime.map_or(0.0, |d| d.as_secs_f64() * 1e3),
            stages: report.stages.len(),
            bytes: r.bytes,
            abort_reason: r.abort_reason().map(ToString::to_string),
        })
    }
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// A bench's own cluster CA, saved under `dir`: workers' certificates by name, and the bench's
/// identity towards them (it orders migrations as a coordinator would).
pub(crate) struct BenchPki {
    pub ca: ClusterCa,
    dir: PathBuf,
}

impl BenchPki {
    pub fn new(dir: PathBuf, name: &str) -> anyhow::Result<BenchPki> {
        let ca = ClusterCa::generate(name)?;
        ca.save(&dir)?;
        Ok(BenchPki { ca, dir })
    }

    /// The certificate arguments of worker `stem` (issued and saved now).
    pub fn worker_args(&self, stem: &str) -> anyhow::Result<Vec<String>> {
        let files = IdentityFiles::in_dir(&self.dir, stem);
        self.ca.issue(Role::Worker, stem, &[])?.save(&files)?;
        Ok(TlsArgs::files(&files).to_args())
    }

    /// The bench's identity towards the workers.
    pub fn client(&self) -> anyhow::Result<NodeIdentity> {
        Ok(self.ca.issue(Role::Coordinator, "bench", &[])?)
    }
}

/// This host's QUIC goodput between two processes with the cluster's mutual TLS, Gbit/s: `bytes`
/// over `streams` streams to a `kvfleet bench sink` (its certificates and log under `dir`).
pub fn quic_goodput_gbps(dir: &Path, bytes: u64, streams: usize) -> anyhow::Result<f64> {
    std::fs::create_dir_all(dir)?;
    let ca = ClusterCa::generate("transport goodput")?;
    let files = IdentityFiles::in_dir(dir, "sink");
    ca.issue(Role::Worker, "sink", &[])?.save(&files)?;
    // The KV port takes worker certificates only: the sender is a worker, as in a migration.
    let client = ca.issue(Role::Worker, "sender", &[])?;
    let me = std::env::current_exe()?;
    let mut args = vec!["bench".to_string(), "sink".into(), "--kind".into(), "quic".into()];
    args.extend(TlsArgs::files(&files).to_args());
    let sink = Proc::spawn("quic-sink", &me, &args, &dir.join("quic-sink.log"), Some(Duration::from_secs(10)))?;
    let peer: SocketAddr = sink.addr()?.parse()?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let run = rt.block_on(bench::quic_send_measured(
        peer,
        &client,
        QuicTuning::default(),
        bytes,
        streams,
        DEFAULT_CHUNK_BYTES,
    ))?;
    Ok(run.goodput.gbit_per_s())
}

pub fn run(b: MigrationBench) -> anyhow::Result<()> {
    if b.lengths.is_empty() || b.lengths.contains(&0) {
        return Err(InputError("--lengths needs positive token counts".into()).into());
    }
    let logs = b.out.join("logs");
    std::fs::create_dir_all(&logs)?;
    let pki = BenchPki::new(b.out.join("pki"), "bench migration")?;
    let ca = &pki.ca;
    let issue = |stem: &str| pki.worker_args(stem);
    let client = pki.client()?;
    let me = std::env::current_exe()?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;

    // (a) and (b): goodput between two processes.
    say!(
        "bench migration: goodput between two processes on loopback ({} per run, {} streams)",
        human(b.bytes),
        b.streams
    );
    let sink_args = |kind: &str| vec!["bench".to_string(), "sink".into(), "--kind".into(), kind.into()];
    let tcp =
        Proc::spawn("tcp-sink", &me, &sink_args("tcp"), &logs.join("tcp-sink.log"), Some(Duration::from_secs(10)))?;
    let tcp_peer: SocketAddr = tcp.addr()?.parse()?;
    let tcp_g = rt.block_on(bench::tcp_send(tcp_peer, b.bytes, b.streams))?;
    drop(tcp);
    let mut quic_args = sink_args("quic");
    quic_args.extend(issue("sink")?);
    let quic = Proc::spawn("quic-sink", &me, &quic_args, &logs.join("quic-sink.log"), Some(Duration::from_secs(10)))?;
    let quic_peer: SocketAddr = quic.addr()?.parse()?;
    // CPU both processes spend on the transfer (handshake included), as a share of one core.
    let sink_pid = quic.pid().to_string();
    let cpu_before = (cpu_seconds("self"), cpu_seconds(&sink_pid));
    // The KV port takes worker certificates only: the sender is a worker, as in a migration.
    let sender = ca.issue(Role::Worker, "sender", &[])?;
    let quic_r = rt.block_on(bench::quic_send_measured(
        quic_peer,
        &sender,
        QuicTuning::default(),
        b.bytes,
        b.streams,
        DEFAULT_CHUNK_BYTES,
    ))?;
    let cpu_after = (cpu_seconds("self"), cpu_seconds(&sink_pid));
    drop(quic);
    let quic_g = quic_r.goodput;
    // The UDP baselines: Ethernet-sized datagrams in GSO batches (GRO makes them cheap on
    // loopback), and datagrams of the size QUIC's MTU discovery reached on this path. The ratio
    // is taken against the faster: the best this host's kernel does with raw datagrams.
    let datagram = usize::from(quic_r.datagram_bytes);
    let mut sizes = vec![bench_udp::DEFAULT_SEGMENT_BYTES];
    if datagram != bench_udp::DEFAULT_SEGMENT_BYTES {
        sizes.push(datagram);
    }
    let udp_args = sink_args("udp");
    let mut udp_runs = Vec::new();
    for &size in &sizes {
        let udp = Proc::spawn(
            "udp-sink",
            &me,
            &udp_args,
            &logs.join(format!("udp-sink-{size}.log")),
            Some(Duration::from_secs(10)),
        )?;
        let udp_peer: SocketAddr = udp.addr()?.parse()?;
        udp_runs.push((size, rt.block_on(bench_udp::udp_send(udp_peer, b.bytes, size))?));
    }
    for (size, r) in &udp_runs {
        say!(
            "  (a) raw UDP, GSO/GRO   {:>8.2} Gbit/s   ({size}-byte datagrams{}; the receiver read {:.1} % of what was sent)",
            r.goodput().gbit_per_s(),
            if *size == datagram { ", QUIC's" } else { "" },
            100.0 * (1.0 - r.loss())
        );
    }
    // The same datagrams sealed with QUIC's cipher in user space: what is left between it and QUIC
    // is the protocol's own work (packets, ACKs, flow control, copies), the cipher set apart.
    let sealed = {
        let udp =
            Proc::spawn("udp-sink", &me, &udp_args, &logs.join("udp-sink-sealed.log"), Some(Duration::from_secs(10)))?;
        let udp_peer: SocketAddr = udp.addr()?.parse()?;
        rt.block_on(bench_udp::udp_send_sealed(udp_peer, b.bytes, datagram, bench_udp::Seal::Aes128Gcm))?
    };
    say!(
        "      UDP + AES-128-GCM   {:>8.2} Gbit/s   ({datagram}-byte datagrams, each sealed and opened in user space as QUIC's packets are; read {:.1} %)",
        sealed.goodput().gbit_per_s(),
        100.0 * (1.0 - sealed.loss())
    );
    let udp_g = udp_runs
        .iter()
        .map(|(_, r)| r.goodput())
        .max_by(|a, b| a.gbit_per_s().total_cmp(&b.gbit_per_s()))
        .expect("one UDP run");
    let same_size = udp_runs.iter().find(|(size, _)| *size == datagram).map(|(_, r)| r.goodput());
    let ratio = quic_g.gbit_per_s() / udp_g.gbit_per_s();
    say!("      raw TCP            {:>8.2} Gbit/s   (the kernel's own stack, 64 KiB segments)", tcp_g.gbit_per_s());
    let sealed_g = sealed.goodput().gbit_per_s();
    say!(
        "  (b) QUIC (mutual TLS)  {:>8.2} Gbit/s   QUIC / best UDP = {:.2} (target ≥ 0.8); QUIC / UDP in its datagram size = {:.2}; QUIC / UDP + AEAD = {:.2}; QUIC / TCP = {:.2}",
        quic_g.gbit_per_s(),
        ratio,
        same_size.map_or(f64::NAN, |g| quic_g.gbit_per_s() / g.gbit_per_s()),
        quic_g.gbit_per_s() / sealed_g,
        quic_g.gbit_per_s() / tcp_g.gbit_per_s()
    );
    say!(
        "      QUIC path: {datagram}-byte datagrams (MTU discovery), {} of {} packets lost",
        quic_r.lost_packets,
        quic_r.sent_packets
    );
    let share = |before: Option<f64>, after: Option<f64>| match (before, after) {
        (Some(b0), Some(b1)) => format!("{:.0} %", 100.0 * (b1 - b0) / quic_g.elapsed_s.max(1e-9)),
        _ => "?".to_string(),
    };
    say!(
        "      QUIC CPU: sender {}, receiver {} of one core (on {} cores; near 100 % each, goodput is CPU per byte)",
        share(cpu_before.0, cpu_after.0),
        share(cpu_before.1, cpu_after.1),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    // (c) real migrations between two worker processes.
    let worker = sibling_binary("kvfleet-worker")?;
    let mut modes = vec![("pipelined", "3")];
    if !b.no_blocking {
        modes.push(("blocking", "0"));
    }
    if b.handoff {
        modes.push(("handoff", "3"));
    }
    if b.cached_prefix > 0 {
        modes.push(("cached", "3"));
    }
    let threshold = if b.stop_copy_ms > 0.0 {
        format!("stop-and-copy once the rest copies within {} ms", b.stop_copy_ms)
    } else {
        format!("stop-and-copy below {} new blocks", b.stop_copy_blocks)
    };
    say!(
        "  (c) live migration of one decoding request between two worker processes (32B model, 256 KiB/token, \
         {threshold}):"
    );
    let mut stop_args = vec![
        "--stop-copy-blocks".to_string(),
        b.stop_copy_blocks.to_string(),
        "--migration-timeout-ms".to_string(),
        b.migration_timeout_ms.to_string(),
    ];
    if b.stop_copy_ms > 0.0 {
        stop_args.extend(["--stop-copy-ms".to_string(), b.stop_copy_ms.to_string()]);
    }
    // `auto`: from the goodput just measured in (b).
    let dilation = b.time_dilation.resolve_with(b.link_gbps, || Ok(quic_g.gbit_per_s()))?;
    if !dilation.is_none() {
        stop_args.extend(["--time-dilation".to_string(), dilation.to_string()]);
        say!("      time dilation {dilation}: every time below is emulated (real time ÷ {dilation})");
    }
    if let Some(g) = b.link_gbps {
        stop_args.extend(["--link-gbps".to_string(), g.to_string()]);
        say!("      migration links shaped to {g} Gbit/s, +{} µs; beside each, the simulator's run", b.link_latency_us);
    }
    if b.link_latency_us > 0.0 {
        stop_args.extend(["--link-latency-us".to_string(), b.link_latency_us.to_string()]);
    }
    let sim = b.link_gbps.map(|g| SimSide::new(g, b.link_latency_us, &b)).transpose()?;
    let pair = WorkerPair { worker: &worker, logs: &logs, issue: &issue, client: &client, dilation };
    let mut rows = Vec::new();
    // On a terminal: which migration runs now and for how long (a 16k-token blocking copy takes
    // ten seconds or more here). Hidden when stderr is not a terminal.
    let bar = indicatif::ProgressBar::new((b.lengths.len() * modes.len()) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} migrations {msg}")
            .expect("a valid template"),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    for &tokens in &b.lengths {
        for &(mode, stages) in &modes {
            bar.set_message(format!("({tokens} tokens, {mode})"));
            let how = Move {
                tokens,
                max_stages: stages,
                handoff: mode == "handoff",
                prefill_chunk: None,
                overlap: kvfleet_sim::config::Overlap::None,
                cached_prefix: if mode == "cached" { b.cached_prefix.min(tokens) } else { 0 },
                model: None,
                kv_bytes_per_token: KV_BYTES_PER_TOKEN,
            };
            let Moved { stats, cpu, .. } = rt.block_on(migrate_once(&pair, how, &stop_args))?;
            let simulated = match &sim {
                Some(s) if mode != "cached" => Some(s.simulate(tokens, stages.parse()?)?),
                _ => None,
            };
            bar.inc(1);
            bar.suspend(|| {
                say!(
                    "      {:>6} tokens {:>9} {:>4}: total {:>8.1} ms  downtime {:>8.1} ms  stages {}  {:.2} Gbit/s{}{}",
                    tokens,
                    human(stats.bytes),
                    mode,
                    ms(stats.total_ns()),
                    ms(stats.downtime_ns),
                    stats.stages,
                    stats.bytes as f64 * 8.0 / (stats.total_ns().max(1) as f64),
                    simulated.as_ref().map_or(String::new(), |s| format!(
                        "  (simulated: total {:.1} ms, downtime {:.1} ms, stages {}{})",
                        s.total_ms,
                        s.downtime_ms,
                        s.stages,
                        s.abort_reason.as_ref().map_or(String::new(), |r| format!(", ABORTED: {r}"))
                    )),
                    if stats.committed() { String::new() } else { format!("  ABORTED: {}", stats.abort_reason) }
                )
            });
            rows.push(Row { tokens, mode, stats, sim: simulated, cpu });
        }
    }
    bar.finish_and_clear();
    say!("{}", table(&rows));
    // Against QUIC only where nothing else sets the pace (a shaped link or stretched time does).
    if b.link_gbps.is_none() && dilation.is_none() {
        let quic_cpu = PairCpu::between([cpu_before.0, cpu_before.1], [cpu_after.0, cpu_after.1]);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if let Some(v) = verdict(&rows, quic_g.gbit_per_s(), quic_cpu, b.bytes, cores) {
            say!("{v}");
        }
    }
    if b.cached_prefix > 0 {
        say!("{}", cached_table(&rows, b.cached_prefix));
    }
    if let Some(g) = b.link_gbps {
        say!("{}", sim_table(&rows, g));
    }
    let gbps = [udp_g.gbit_per_s(), tcp_g.gbit_per_s(), quic_g.gbit_per_s(), sealed_g];
    write_outputs(&b.out, &rows, gbps, datagram)?;
    say!("wrote {} (migrations.csv, goodput.json; logs in {})", b.out.display(), logs.display());
    Ok(())
}

fn human(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.0} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

/// What every pair of bench workers shares.
#[derive(Clone, Copy)]
pub(crate) struct WorkerPair<'a> {
    pub worker: &'a Path,
    pub logs: &'a Path,
    /// The certificate arguments of a worker by name.
    pub issue: &'a dyn Fn(&str) -> anyhow::Result<Vec<String>>,
    /// The bench's identity towards them (a coordinator's).
    pub client: &'a NodeIdentity,
    pub dilation: kvfleet_core::Dilation,
}

/// One bench migration.
#[derive(Clone, Copy)]
pub(crate) struct Move<'a> {
    /// The request's prompt, tokens.
    pub tokens: u32,
    /// The workers' `--max-stages` (`0`: a blocking copy).
    pub max_stages: &'a str,
    /// Moved as a prefill/decode handoff (held after its prefill).
    pub handoff: bool,
    /// The source prefills in chunks of this many tokens (`None`: whole prompts).
    pub prefill_chunk: Option<u32>,
    /// A handoff overlapped with its prefill (the move follows it): started once the first chunk
    /// is written (`Chunk`) or once the first iteration starts, following it layer by layer
    /// (`Layer`).
    pub overlap: kvfleet_sim::config::Overlap,
    /// Leading prompt tokens the target caches before the move (0: none, no prefix caching).
    pub cached_prefix: u32,
    /// The workers' `--model` and `--gpu` (their defaults when `None`) and that model's KV bytes
    /// per token (sizes their arenas).
    pub model: Option<(&'a str, &'a str)>,
    pub kv_bytes_per_token: u64,
}

/// What one bench migration measured.
pub(crate) struct Moved {
    /// The source's measurements.
    pub stats: v1::MigrationStats,
    /// CPU the two workers spent during the move.
    pub cpu: Option<PairCpu>,
    /// A handoff's prefill end on the source (its first token; cluster time, ns).
    pub prefill_done_ns: Option<u64>,
}

/// Start two workers sized for the request, run it on the first, migrate it to the second once
/// it decodes, and return the source's measurements.
pub(crate) async fn migrate_once(pair: &WorkerPair<'_>, how: Move<'_>, stop_args: &[String]) -> anyhow::Result<Moved> {
    let WorkerPair { worker, logs, issue, client, dilation } = *pair;
    let Move { tokens, max_stages, handoff, prefill_chunk, overlap, cached_prefix, model, kv_bytes_per_token } = how;
    // Room for the prompt plus what it decodes during the copy, on both sides.
    let arena = ((tokens as u64 + 1040) * kv_bytes_per_token).div_ceil(64 << 20) * (64 << 20);
    let mut procs = Vec::new();
    for i in 0..2u32 {
        let mut a: Vec<String> = [
            "--instance",
            &i.to_string(),
            "--kv-memory",
            &arena.to_string(),
            "--cpu-memory",
            "64MiB",
            "--kv-fill",
            "stamp",
            "--prefault",
            "--max-stages",
            max_stages,
            "--max-batched-tokens",
            &(tokens + 16).max(8192).to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(stop_args.iter().cloned());
        a.extend(issue(&format!("worker-{i}"))?);
        if cached_prefix > 0 {
            a.push("--prefix-caching".into());
        }
        if let Some((model, gpu)) = model {
            a.extend(["--model".into(), model.into(), "--gpu".into(), gpu.into()]);
        }
        if let Some(chunk) = prefill_chunk {
            a.extend(["--chunked-prefill-tokens".into(), chunk.to_string()]);
        }
        if overlap == kvfleet_sim::config::Overlap::Layer {
            let groups = kvfleet_sim::config::LAYER_GROUPS;
            a.extend(["--handoff-layer-groups".into(), groups.to_string()]);
        }
        let mode = match overlap {
            kvfleet_sim::config::Overlap::None => "",
            kvfleet_sim::config::Overlap::Chunk => "-overlap",
            kvfleet_sim::config::Overlap::Layer => "-layers",
        };
        let log = logs.join(format!("worker-{tokens}-{max_stages}-{cached_prefix}{mode}-{i}.log"));
        procs.push(Proc::spawn(&format!("worker-{i}"), worker, &a, &log, Some(Duration::from_secs(60)))?);
    }
    let connect = |addr: &str| -> anyhow::Result<v1::worker_client::WorkerClient<tonic::transport::Channel>> {
        let ch = kvfleet_pki::endpoint(addr, Some(client)).map_err(anyhow::Error::msg)?.connect_lazy();
        Ok(v1::worker_client::WorkerClient::new(ch))
    };
    let (mut src, mut dst) = (connect(procs[0].addr()?)?, connect(procs[1].addr()?)?);
    let target_kv = dst.info(v1::InfoRequest {}).await?.into_inner().kv_address;
    // How long to wait for a worker's event: a minute of emulated time (a long prompt's prefill,
    // stretched by the dilation).
    let minute = dilation.real(kvfleet_core::TimeSpan::from_secs_f64(60.0));
    if handoff {
        // A prefill instance: the request is held after its first token, its KV final.
        src.set_role(v1::SetRoleRequest { role: "prefill".into(), hand_off: true }).await?;
    }
    // With a cached prefix the prompt has content (one id per 512 tokens), and a request over
    // its first `cached_prefix` tokens runs on the target first, leaving them in its cache.
    let ids: Vec<u64> = if cached_prefix > 0 { (1..=u64::from(tokens.div_ceil(512))).collect() } else { Vec::new() };
    if cached_prefix > 0 {
        let warm = v1::RequestSpec {
            id: 2,
            prompt_tokens: cached_prefix,
            reasoning_tokens: 1,
            answer_tokens: 1,
            content_ids: ids[..cached_prefix.div_ceil(512) as usize].to_vec(),
            ..Default::default()
        };
        let accepted = dst.submit(v1::SubmitRequest { spec: Some(warm), incarnation: 0 }).await?.into_inner();
        anyhow::ensure!(accepted.accepted, "the target refused the warm-up request: {}", accepted.reason);
        let mut events = dst.events(v1::EventsRequest { after_seq: 0 }).await?.into_inner();
        let done = first_event(&mut events, minute, |e| matches!(e, Event::Finished(_)).then_some(())).await;
        anyhow::ensure!(done.is_some(), "the warm-up request did not finish within 60 s (emulated)");
    }
    let spec = v1::RequestSpec {
        id: 1,
        arrival_ns: 0,
        prompt_tokens: tokens,
        reasoning_tokens: 1000,
        answer_tokens: 1,
        content_ids: ids,
    };
    let accepted = src.submit(v1::SubmitRequest { spec: Some(spec), incarnation: 0 }).await?.into_inner();
    anyhow::ensure!(accepted.accepted, "the source refused the request: {}", accepted.reason);
    // Migrate once it decodes (its prompt is prefilled and written), or, handed off, once it is
    // held after its prefill.
    let mut events = src.events(v1::EventsRequest { after_seq: 0 }).await?.into_inner();
    // An overlapped handoff starts once the prefill does (its first chunk written, or its first
    // iteration started).
    let mut prefill_done_ns = None;
    let first = first_event(&mut events, minute, |e| {
        let ready = match e {
            Event::Tokens(_) => !handoff,
            Event::PrefillStarted(_) => overlap.overlaps(),
            Event::PrefillDone(p) => {
                prefill_done_ns = Some(p.at_ns);
                handoff
            }
            _ => false,
        };
        ready.then_some(())
    })
    .await;
    anyhow::ensure!(first.is_some(), "no token from the source within 60 s (emulated)");
    let req = v1::MigrateOutRequest { request_id: 1, target: 1, target_kv_address: target_kv, ..Default::default() };
    let pids = [procs[0].pid().to_string(), procs[1].pid().to_string()];
    let cpu_before = [cpu_seconds(&pids[0]), cpu_seconds(&pids[1])];
    let out = src.migrate_out(req).await?.into_inner();
    let cpu = PairCpu::between(cpu_before, [cpu_seconds(&pids[0]), cpu_seconds(&pids[1])]);
    if handoff && prefill_done_ns.is_none() {
        // Overlapped: the prefill ended during the move (its event is in the log).
        let done = |e| match e {
            Event::PrefillDone(p) => Some(p.at_ns),
            _ => None,
        };
        prefill_done_ns = first_event(&mut events, minute, done).await;
    }
    for p in &mut procs {
        p.stop(Duration::from_secs(5));
    }
    let stats = out.stats.ok_or_else(|| anyhow::anyhow!("the source reported no migration measurements"))?;
    Ok(Moved { stats, cpu, prefill_done_ns })
}

/// The first of a worker's `events` that `pick` maps to a value, within `limit` (real time);
/// `None` when the stream ends or fails, or the time runs out.
async fn first_event<T>(
    events: &mut tonic::Streaming<v1::WorkerEvent>,
    limit: Duration,
    mut pick: impl FnMut(Event) -> Option<T>,
) -> Option<T> {
    let found = tokio::time::timeout(limit, async {
        while let Ok(Some(ev)) = events.message().await {
            if let Some(v) = ev.event.and_then(&mut pick) {
                return Some(v);
            }
        }
        None
    });
    found.await.ok().flatten()
}

/// The committed pipelined migration that moved the most bytes.
fn longest_pipelined(rows: &[Row]) -> Option<&Row> {
    rows.iter().filter(|r| r.mode == "pipelined" && r.stats.committed()).max_by_key(|r| r.stats.bytes)
}

/// How the longest unshaped pipelined migration compares with the QUIC transport measured in the
/// same run (the issue's targets: goodput ≥ 0.9 × QUIC's, total ≤ 1.15 × bytes ÷ QUIC goodput),
/// and, short of a target, what limits it: the host's CPU (with the CPU per byte of each side
/// against QUIC's own), or waiting.
fn verdict(rows: &[Row], quic_gbps: f64, quic_cpu: Option<PairCpu>, quic_bytes: u64, cores: usize) -> Option<String> {
    let r = longest_pipelined(rows)?;
    let (bytes, total_ns) = (r.stats.bytes, r.stats.total_ns().max(1));
    let gbps = bytes as f64 * 8.0 / total_ns as f64;
    let ratio = gbps / quic_gbps;
    let ideal_ms = bytes as f64 * 8.0 / quic_gbps / 1e6;
    let total_ratio = ms(total_ns) / ideal_ms;
    let mut s = String::new();
    let mark = |ok: bool| if ok { "met" } else { "NOT met" };
    let _ = writeln!(
        s,
        "  migration / QUIC = {ratio:.2} ({} tokens pipelined: {gbps:.2} of QUIC's {quic_gbps:.2} Gbit/s; target ≥ 0.9: {})",
        r.tokens,
        mark(ratio >= 0.9)
    );
    let _ = writeln!(
        s,
        "  total {:.0} ms = {total_ratio:.2} × (bytes ÷ QUIC goodput = {ideal_ms:.0} ms) (target ≤ 1.15: {})",
        ms(total_ns),
        mark(total_ratio <= 1.15)
    );
    if ratio < 0.9 {
        let _ = write!(s, "  short by {:.0} % of the goodput target; ", 100.0 * (0.9 - ratio) / 0.9);
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        match r.cpu {
            Some(c) => {
                let busy = (c.source_s + c.target_s) / (total_ns as f64 / 1e9) / cores.max(1) as f64;
                let per_gib = |cpu: f64, b: u64| cpu / gib(b).max(1e-12);
                let (src, dst) = (per_gib(c.source_s, bytes), per_gib(c.target_s, bytes));
                let _ = write!(
                    s,
                    "limit: {} (the two workers kept {:.0} % of the host's {cores} cores busy). CPU per GiB moved: \
                     source {src:.2} s, target {dst:.2} s",
                    if busy >= 0.85 { "CPU" } else { "not CPU: the pipeline waits" },
                    busy * 100.0
                );
                if let Some(q) = quic_cpu {
                    let (qs, qr) = (per_gib(q.source_s, quic_bytes), per_gib(q.target_s, quic_bytes));
                    let _ = write!(
                        s,
                        "; QUIC alone: sender {qs:.2} s, receiver {qr:.2} s ({:.2}× and {:.2}× of it)",
                        src / qs.max(1e-12),
                        dst / qr.max(1e-12)
                    );
                }
                s.push('\n');
            }
            None => s.push_str("no CPU reading of the workers (/proc)\n"),
        }
    }
    Some(s)
}

fn table(rows: &[Row]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n  tokens      KV   pipelined total ms   downtime ms   stages   blocking downtime ms   downtime ratio   handoff total ms   Gbit/s"
    );
    let mut lengths: Vec<u32> = rows.iter().map(|r| r.tokens).collect();
    lengths.dedup();
    for t in lengths {
        let p = rows.iter().find(|r| r.tokens == t && r.mode == "pipelined");
        let b = rows.iter().find(|r| r.tokens == t && r.mode == "blocking");
        let h = rows.iter().find(|r| r.tokens == t && r.mode == "handoff");
        let Some(p) = p else { continue };
        let total = ms(p.stats.total_ns());
        let blocking = b.map(|b| ms(b.stats.downtime_ns));
        let _ = writeln!(
            s,
            "  {:>6} {:>8} {:>20.1} {:>13.1} {:>8} {:>22} {:>16} {:>18} {:>8}",
            t,
            human(p.stats.bytes),
            total,
            ms(p.stats.downtime_ns),
            p.stats.stages,
            blocking.map_or("-".into(), |v| format!("{v:.1}")),
            blocking.map_or("-".into(), |v| format!("{:.3}", ms(p.stats.downtime_ns) / v.max(1e-9))),
            h.map_or("-".into(), |h| format!("{:.1}", ms(h.stats.total_ns()))),
            h.map_or("-".into(), |h| format!("{:.2}", h.stats.bytes as f64 * 8.0 / h.stats.total_ns().max(1) as f64)),
        );
    }
    s
}

/// The moves to a target caching the prompt's first `cached` tokens against full copies.
fn cached_table(rows: &[Row], cached: u32) -> String {
    let mut s = format!("\n  to a target caching the first {cached} prompt tokens vs a full copy (pipelined)\n");
    let _ = writeln!(
        s,
        "  tokens   sent bytes   skipped bytes   bytes ratio   total ms   full total ms   time ratio   outcome"
    );
    for c in rows.iter().filter(|r| r.mode == "cached") {
        let Some(full) = rows.iter().find(|r| r.tokens == c.tokens && r.mode == "pipelined") else { continue };
        let ratio = |a: f64, b: f64| if b > 0.0 { format!("{:.3}", a / b) } else { "-".into() };
        let _ = writeln!(
            s,
            "  {:>6} {:>12} {:>15} {:>13} {:>10.1} {:>15.1} {:>12}   {}",
            c.tokens,
            human(c.stats.bytes),
            human(c.stats.bytes_skipped),
            ratio(c.stats.bytes as f64, full.stats.bytes as f64),
            ms(c.stats.total_ns()),
            ms(full.stats.total_ns()),
            ratio(c.stats.total_ns() as f64, full.stats.total_ns() as f64),
            if c.stats.committed() {
                "committed (every token verified at COMMIT)".to_string()
            } else {
                format!("ABORTED: {}", c.stats.abort_reason)
            },
        );
    }
    s
}

/// Emulated against simulated, per migration (rows with a simulation only).
fn sim_table(rows: &[Row], link_gbps: f64) -> String {
    let mut s = format!("\n  emulated (shaped to {link_gbps} Gbit/s) vs simulated\n");
    let _ = writeln!(
        s,
        "  tokens      mode   emu total ms   sim total ms   emu/sim   emu downtime ms   sim downtime ms   stages emu/sim"
    );
    for r in rows {
        let (Some(sim), Some(ratio)) = (&r.sim, r.total_ratio()) else { continue };
        let _ = writeln!(
            s,
            "  {:>6} {:>9} {:>14.1} {:>14.1} {:>9.3} {:>17.1} {:>17.1} {:>10}/{}{}{}",
            r.tokens,
            r.mode,
            ms(r.stats.total_ns()),
            sim.total_ms,
            ratio,
            ms(r.stats.downtime_ns),
            sim.downtime_ms,
            r.stats.stages,
            sim.stages,
            if sim.bytes == r.stats.bytes {
                String::new()
            } else {
                format!("   (bytes {} / {})", r.stats.bytes, sim.bytes)
            },
            match (r.stats.committed(), &sim.abort_reason) {
                (true, None) => String::new(),
                (_, sim_abort) => format!(
                    "   ABORTED: emulated {}, simulated {}",
                    if r.stats.committed() { "committed" } else { &r.stats.abort_reason },
                    sim_abort.as_deref().unwrap_or("committed")
                ),
            }
        );
    }
    s
}

/// `gbps`: raw UDP (best), TCP, QUIC, sealed UDP.
fn write_outputs(out: &Path, rows: &[Row], gbps: [f64; 4], datagram_bytes: usize) -> anyhow::Result<()> {
    let [udp_gbps, tcp_gbps, quic_gbps, sealed_gbps] = gbps;
    let mut csv = String::from(
        "tokens,mode,bytes,stages,total_ms,downtime_ms,goodput_gbps,stage_bytes,abort_reason,\
         sim_bytes,sim_stages,sim_total_ms,sim_downtime_ms,total_ratio,sim_abort_reason,source_cpu_s,target_cpu_s\n",
    );
    for r in rows {
        let st = &r.stats;
        let total = st.total_ns();
        let stage_bytes: Vec<String> = st.stage_bytes.iter().map(u64::to_string).collect();
        let sim = match (&r.sim, r.total_ratio()) {
            (Some(s), Some(ratio)) => {
                let abort = s.abort_reason.as_deref().unwrap_or("").replace('"', "'");
                format!("{},{},{:.3},{:.3},{ratio:.4},\"{abort}\"", s.bytes, s.stages, s.total_ms, s.downtime_ms)
            }
            _ => ",,,,,".to_string(),
        };
        let cpu = r.cpu.map_or(",".to_string(), |c| format!("{:.3},{:.3}", c.source_s, c.target_s));
        let _ = writeln!(
            csv,
            "{},{},{},{},{:.3},{:.3},{:.3},{},\"{}\",{sim},{cpu}",
            r.tokens,
            r.mode,
            st.bytes,
            st.stages,
            ms(total),
            ms(st.downtime_ns),
            st.bytes as f64 * 8.0 / total.max(1) as f64,
            stage_bytes.join(";"),
            st.abort_reason.replace('"', "'")
        );
    }
    std::fs::write(out.join("migrations.csv"), csv)?;
    let json = serde_json::json!({
        "udp_gso_gbit_per_s": udp_gbps,
        "quic_over_udp_gso": quic_gbps / udp_gbps,
        "tcp_gbit_per_s": tcp_gbps,
        "quic_gbit_per_s": quic_gbps,
        "quic_over_tcp": quic_gbps / tcp_gbps,
        "udp_aes128gcm_gbit_per_s": sealed_gbps,
        "quic_over_udp_aes128gcm": quic_gbps / sealed_gbps,
        "migration_over_quic": longest_pipelined(rows).map(|r| r.stats.bytes as f64 * 8.0 / r.stats.total_ns().max(1) as f64 / quic_gbps),
        "datagram_bytes": datagram_bytes,
    });
    std::fs::write(out.join("goodput.json"), serde_json::to_string_pretty(&json)?)?;
    Ok(())
}

/// User + system CPU seconds a process has used (`/proc/PID/stat`; `pid` "self" for this one), or
/// `None` where there is no such file (not Linux, process gone).
fn cpu_seconds(pid: &str) -> Option<f64> {
    parse_cpu_seconds(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// User + system CPU seconds from the text of a `/proc/PID/stat`.
fn parse_cpu_seconds(stat: &str) -> Option<f64> {
    // The command name (field 2) may hold spaces and parentheses: count fields after its last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 (utime, stime) are the 12th and 13th after the name, in clock ticks of
    // USER_HZ, which Linux fixes at 100 for everything it exports in /proc.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(tokens: u32, mode: &'static str, bytes: u64, total_ms: u64, cpu: Option<PairCpu>) -> Row {
        let stats = v1::MigrationStats {
            bytes,
            started_ns: 1_000,
            ended_ns: 1_000 + total_ms * 1_000_000,
            ..Default::default()
        };
        Row { tokens, mode, stats, sim: None, cpu }
    }

    /// The verdict judges the longest committed pipelined migration against QUIC's goodput and,
    /// short of the target, names the limit with each side's CPU per byte against QUIC's.
    #[test]
    fn the_verdict_compares_the_longest_pipelined_migration_with_quic_and_names_the_limit() {
        const GIB: u64 = 1 << 30;
        // 1 GiB in 1 s: 8.59 Gbit/s; 4 GiB in 2 s: 17.18 Gbit/s. QUIC: 20 Gbit/s.
        let cpu = PairCpu { source_s: 1.0, target_s: 2.0 };
        let quic_cpu = Some(PairCpu { source_s: 0.5, target_s: 0.5 });
        let mut rows =
            vec![row(4096, "pipelined", GIB, 1000, Some(cpu)), row(16384, "pipelined", 4 * GIB, 2000, Some(cpu))];
        rows.push(row(16384, "blocking", 8 * GIB, 1000, None));
        let v = verdict(&rows, 20.0, quic_cpu, GIB, 2).unwrap();
        assert!(v.contains("migration / QUIC = 0.86 (16384 tokens"), "{v}");
        assert!(v.contains("target ≥ 0.9: NOT met"), "{v}");
        // Bytes ÷ QUIC goodput: 4 GiB at 20 Gbit/s = 1718 ms; 2000 / 1718 = 1.16.
        assert!(v.contains("= 1.16 × (bytes ÷ QUIC goodput = 1718 ms) (target ≤ 1.15: NOT met)"), "{v}");
        // 0.859 of 0.9; 3 CPU-s over 2 s on 2 cores: 75 %, the pipeline waits; per GiB 0.25 and 0.5 s.
        assert!(v.contains("short by 5 % of the goodput target"), "{v}");
        assert!(v.contains("limit: not CPU: the pipeline waits (the two workers kept 75 %"), "{v}");
        assert!(
            v.contains(
                "source 0.25 s, target 0.50 s; QUIC alone: sender 0.50 s, receiver 0.50 s (0.50× and 1.00× of it)"
            ),
            "{v}"
        );
        // Busy host: the limit is CPU.
        let busy = PairCpu { source_s: 2.0, target_s: 2.0 };
        rows[1].cpu = Some(busy);
        assert!(verdict(&rows, 20.0, quic_cpu, GIB, 2).unwrap().contains("limit: CPU (the two workers kept 100 %"));
        // Fast enough: both targets met, no limit named.
        let v = verdict(&rows, 18.0, quic_cpu, GIB, 2).unwrap();
        assert!(v.contains("= 0.95") && v.contains("target ≥ 0.9: met") && !v.contains("limit"), "{v}");
        // An aborted longest copy is not judged; nothing pipelined: no verdict.
        rows[1].stats.abort_reason = "disconnected".into();
        assert!(verdict(&rows, 20.0, quic_cpu, GIB, 2).unwrap().contains("(4096 tokens"));
        assert!(verdict(&rows[2..], 20.0, quic_cpu, GIB, 2).is_none());
    }

    #[test]
    fn the_simulated_side_copies_the_workers_kv_at_the_link_rate() {
        let b = MigrationBench {
            bytes: 1 << 20,
            streams: 1,
            lengths: vec![1024],
            stop_copy_blocks: 16,
            stop_copy_ms: 10.0,
            link_gbps: Some(2.0),
            link_latency_us: 0.0,
            migration_timeout_ms: 10_000,
            time_dilation: crate::up::cluster::DilationArg::Fixed(kvfleet_core::Dilation::NONE),
            no_blocking: false,
            handoff: false,
            cached_prefix: 0,
            out: PathBuf::new(),
        };
        let side = SimSide::new(2.0, 0.0, &b).unwrap();
        let blocking = side.simulate(1024, 0).unwrap();
        assert_eq!(blocking.abort_reason, None);
        // The 32B model's 4 MiB blocks: 1025 tokens and the one decoded before the pause.
        assert_eq!((blocking.stages, blocking.bytes), (1, 65 * 16 * KV_BYTES_PER_TOKEN));
        let wire_ms = blocking.bytes as f64 * 8.0 / 2e9 * 1e3;
        assert!(blocking.total_ms > wire_ms && blocking.total_ms < wire_ms + 100.0, "{} ms", blocking.total_ms);
        let pipelined = side.simulate(1024, 3).unwrap();
        assert!(pipelined.stages >= 2 && pipelined.downtime_ms < blocking.downtime_ms / 4.0);
        assert!(SimSide::new(0.0, 0.0, &b).is_err(), "a zero rate is refused");
    }

    #[test]
    fn cpu_seconds_are_utime_plus_stime_after_a_name_with_spaces() {
        let stat = "4242 (kv (quic) 1) S 1 4242 4242 0 -1 4194560 500 0 0 0 250 130 0 0 20 0 3 0 99 0 0";
        assert_eq!(parse_cpu_seconds(stat), Some(3.8));
        assert_eq!(parse_cpu_seconds("4242 (truncated) S 1 2"), None);
        assert_eq!(parse_cpu_seconds("no name at all"), None);
    }

    #[test]
    fn this_process_cpu_time_grows_while_it_computes() {
        let start = cpu_seconds("self").expect("/proc/self/stat on Linux");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut x = 1u64;
        // Busy until the kernel has charged at least 3 clock ticks (or the deadline passes).
        while cpu_seconds("self").unwrap() < start + 0.03 && std::time::Instant::now() < deadline {
            for i in 0..100_000u64 {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(i));
            }
        }
        assert!(cpu_seconds("self").unwrap() >= start + 0.03, "no CPU time charged in 10 s of computing ({x})");
    }
}
