//! `kvfleet bench …`: benchmarks that print figures measured in one run. Not tests: they assert
//! nothing about wall time; they report it.

use crate::InputError;
use clap::{Args, Subcommand};
use kvfleet_core::workload::{ArrivalConfig, LengthConfig, WorkloadConfig};
use kvfleet_sim::config::SimConfig;
use std::path::PathBuf;
use std::time::Instant;

#[path = "bench_timing.rs"]
mod bench_timing;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Simulator speed: a large cluster (default 1000 instances) over a long workload (default
    /// one hour of arrivals); prints wall time, simulated events/s and requests/s.
    Sim(SimBench),
    /// How many worker processes this host sustains: for each count, start that many workers
    /// (small pre-faulted arenas), keep every one busy, and report their timer lateness; prints the
    /// largest count whose worst worker p99 stays under 1 ms.
    Workers(WorkersBench),
    /// Timing-model error: the profile model on measured points held out of its own table
    /// (leave-one-out), and the analytic roofline on every measured point; MAPE per regime. With
    /// `--held-out DIR`, also on measured points never in the profile; `--cuda` adds live CUDA timing.
    Timing(bench_timing::TimingBench),
    /// Live migration: raw TCP vs QUIC goodput between two processes, and real migrations of
    /// 256…16k-token requests between two worker processes (total time, downtime; pipelined vs
    /// blocking stop-and-copy).
    Migration(crate::bench_migration::MigrationBench),
    /// Prefill/decode handoffs of 1k/4k/16k-token prompts, one-shot and overlapped with the
    /// chunked prefill, between two worker processes and in the simulator: the time each exposes
    /// after the first token, and the ratio overlapped ÷ one-shot.
    Handoff(crate::bench_handoff::HandoffBench),
    /// Simulator ↔ emulator parity: each workload (default: the quickstart, a Mooncake-trace
    /// workload, a migration-heavy PASCAL run) through `kvfleet sim` and `kvfleet up`; per-request
    /// TTFT/E2E error, placement agreement, migrations and downtime, side by side.
    Parity(crate::bench_parity::ParityBench),
    /// (internal) the receiving process of `bench migration`'s goodput runs.
    #[command(hide = true)]
    Sink(crate::bench_migration::SinkArgs),
}

#[derive(Args)]
pub struct SimBench {
    /// Number of instances.
    #[arg(long, default_value_t = 1000)]
    instances: u32,
    /// Simulated span of arrivals, seconds.
    #[arg(long, default_value_t = 3600.0)]
    duration_s: f64,
    /// Cluster-wide Poisson arrival rate, requests/s (default: 0.1 req/s per instance);
    /// several, comma-separated, run one after another (the controller's decision time per rate).
    #[arg(long, value_delimiter = ',')]
    rate: Vec<f64>,
    /// Disaggregate with Arrow: half the instances start as prefill instances.
    #[arg(long)]
    arrow: bool,
    /// Policy preset or INTRA+INSTANCE pair.
    #[arg(long, default_value = "pascal")]
    policy: String,
    /// Lengths from this Azure trace (rows reused in order, reasoning share drawn from ServeGen)
    /// instead of the ServeGen length distributions.
    #[arg(long)]
    azure_trace: Option<PathBuf>,
    /// Workload seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Run the simulator leaping over quiet iterations (`leap`, its default), stepping every
    /// iteration (`step`), or both, one after the other, compared side by side (`both`).
    #[arg(long, value_enum, default_value_t = SimMode::Both)]
    mode: SimMode,
}

/// How `bench sim` runs the simulator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SimMode {
    /// Leaping over quiet iterations (`[simulator] leap_iterations = true`).
    Leap,
    /// Every iteration an event of its own.
    Step,
    /// Both, and their ratio.
    Both,
}

#[derive(Args)]
pub struct WorkersBench {
    /// Worker counts to try, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "8,16,32,48")]
    counts: Vec<u32>,
    /// Seconds of load per count.
    #[arg(long, default_value_t = 10.0)]
    duration_s: f64,
    /// KV arena per worker (GPU pool); the CPU pool is the same size.
    #[arg(long, default_value = "128MiB")]
    kv_memory: String,
    /// Requests kept in flight per worker.
    #[arg(long, default_value_t = 4)]
    per_worker: u32,
    /// Where worker logs go.
    #[arg(long, default_value = "results/bench-workers")]
    out: PathBuf,
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Sim(b) => bench_sim(b),
        BenchCommand::Migration(b) => crate::bench_migration::run(b),
        BenchCommand::Handoff(b) => crate::bench_handoff::run(b),
        BenchCommand::Parity(b) => crate::bench_parity::run(b),
        BenchCommand::Sink(a) => crate::bench_migration::run_sink(a),
        BenchCommand::Workers(b) => bench_workers(b),
        BenchCommand::Timing(b) => bench_timing::run(b),
    }
}

fn bench_sim(b: SimBench) -> anyhow::Result<()> {
    let rates = if b.rate.is_empty() { vec![0.1 * b.instances as f64] } else { b.rate.clone() };
    let mut latency = Vec::new();
    for &rate in &rates {
        if !(rate.is_finite() && rate > 0.0) {
            return Err(InputError(format!("--rate must be positive numbers, got {rate}")).into());
        }
        latency.push((rate, bench_sim_at(&b, rate)?));
    }
    crate::say!("controller decision time (wall, per decision; p50 / p99 / max µs):");
    crate::say!("  {:>10}  {:>26}  {:>26}", "rate req/s", "placing an arrival", "handing off a prefill");
    for (rate, d) in latency {
        crate::say!("  {rate:>10.1}  {:>26}  {:>26}", micros(&d.arrival_ns), micros(&d.handoff_ns));
    }
    Ok(())
}

/// p50 / p99 / max of `ns` in µs, `-` for none.
fn micros(ns: &[u32]) -> String {
    let d = kvfleet_core::metrics::Distribution::new(ns.iter().map(|&v| f64::from(v) / 1e3).collect());
    match (d.percentile(0.5), d.percentile(0.99), d.max()) {
        (Some(p50), Some(p99), Some(max)) => format!("{p50:.1} / {p99:.1} / {max:.0}"),
        _ => "-".into(),
    }
}

fn bench_sim_at(b: &SimBench, rate: f64) -> anyhow::Result<kvfleet_core::metrics::DecisionTimes> {
    let mut cfg = SimConfig::default();
    cfg.cluster.instances = b.instances;
    cfg.scheduler.policy = b.policy.clone();
    cfg.workload = WorkloadConfig {
        seed: b.seed,
        duration_s: Some(b.duration_s),
        arrivals: ArrivalConfig::Poisson { rate },
        max_prompt_tokens: Some(16_384),
        max_output_tokens: Some(16_384),
        ..WorkloadConfig::default()
    };
    if b.arrow {
        cfg.pd.prefill_instances = (b.instances / 2).max(1);
        cfg.pd.policy = kvfleet_sim::config::PdPolicy::Arrow;
    }
    if let Some(path) = &b.azure_trace {
        cfg.workload.lengths = LengthConfig::Trace(kvfleet_core::workload::TraceLengths {
            path: path.clone(),
            format: kvfleet_core::workload::TraceFormat::Azure,
            reason_ratio: None,
        });
    }
    cfg.validate().map_err(|e| InputError(e.to_string()))?;
    let base = std::env::current_dir()?;
    let t0 = Instant::now();
    let requests = kvfleet_core::workload::generate(&cfg.workload, &base).map_err(|e| InputError(e.to_string()))?;
    let gen_s = t0.elapsed().as_secs_f64();
    crate::say!(
        "bench sim: {} instances, {:.0} s of Poisson arrivals at {rate} req/s = {} requests, policy {}{}, lengths {} \
         (workload generation {gen_s:.2} s)",
        b.instances,
        b.duration_s,
        requests.len(),
        b.policy,
        if b.arrow { " with Arrow's prefill/decode pools" } else { "" },
        b.azure_trace.as_ref().map_or("ServeGen DeepSeek-R1".to_string(), |p| p.display().to_string())
    );
    let modes: &[bool] = match b.mode {
        SimMode::Leap => &[true],
        SimMode::Step => &[false],
        SimMode::Both => &[true, false],
    };
    let mut runs = Vec::new();
    for &leap in modes {
        let mut cfg = cfg.clone();
        cfg.simulator.leap_iterations = leap;
        let t = Instant::now();
        let point = kvfleet_sim::config::RunPoint { policy: b.policy.clone(), rate: None, seed: cfg.workload.seed };
        let mut results = crate::run_parallel(&cfg, &[point], &base, Some(1), false)?;
        runs.push((if leap { "leaping" } else { "stepping" }, results.remove(0), t.elapsed().as_secs_f64()));
    }
    let r = &runs[0].1;
    crate::say!("  simulated span     {:>12.1} s (virtual)", r.span_s);
    crate::say!("  finished requests  {:>12} of {}", r.summary.requests_finished, r.summary.requests_total);
    let iterations: u64 = r.instances.iter().map(|s| s.iterations).sum();
    let tokens: u64 = r.instances.iter().map(|s| s.tokens).sum();
    let full_plans: u64 = r.instances.iter().map(|s| s.full_plans).sum();
    crate::say!("  events             {:>12} (every iteration end and every other event)", r.events);
    crate::say!(
        "  engine iterations  {:>12} ({:.1} % re-planned in full)",
        iterations,
        100.0 * full_plans as f64 / iterations.max(1) as f64
    );
    crate::say!("  tokens generated   {:>12}", tokens);
    if b.arrow {
        crate::say!("  role flips         {:>12}", r.role_changes.len());
    }
    let row = |label: &str, f: &dyn Fn(&kvfleet_sim::RunResult, f64) -> String| {
        let cells: String = runs.iter().map(|(_, r, wall)| format!("  {:>14}", f(r, *wall))).collect();
        crate::say!("  {label:<26}{cells}");
    };
    let header: String = runs.iter().map(|(name, _, _)| format!("  {name:>14}")).collect();
    crate::say!("  {:<26}{header}", "");
    row("wall time (s)", &|_, w| format!("{w:.2}"));
    row("events handled", &|r, _| r.queue_events.to_string());
    row("events / s (M)", &|r, w| format!("{:.2}", r.events as f64 / w / 1e6));
    row("iterations / s (M)", &|_, w| format!("{:.2}", iterations as f64 / w / 1e6));
    row("tokens / s (M)", &|_, w| format!("{:.1}", tokens as f64 / w / 1e6));
    row("speed-up vs real time", &|r, w| format!("{:.0}x", r.span_s / w));
    if let [(_, leaping, leap_wall), (_, stepping, step_wall)] = &runs[..] {
        let same = leaping.same_outcome(stepping);
        crate::say!(
            "  leaping / stepping: {:.2}x faster ({:.1} events per event handled); results {}",
            step_wall / leap_wall,
            leaping.events as f64 / leaping.queue_events.max(1) as f64,
            if same { "identical" } else { "DIFFERENT (a bug: please report)" }
        );
    }
    Ok(runs.swap_remove(0).1.decisions)
}

/// `lateness_p99_us=N` etc. from a worker's final stderr line.
fn stop_line_field(log: &std::path::Path, field: &str) -> Option<f64> {
    let text = std::fs::read_to_string(log).ok()?;
    let line = text.lines().rev().find(|l| l.contains("kvfleet-worker: stopped"))?;
    let key = format!("{field}=");
    let rest = &line[line.find(&key)? + key.len()..];
    rest.split_whitespace().next()?.parse().ok()
}

/// Voluntary and involuntary context switches of every thread of `pid` so far (0 if unreadable).
fn context_switches(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
        .flat_map(|status| {
            status
                .lines()
                .filter(|l| l.starts_with("voluntary_ctxt_switches:") || l.starts_with("nonvoluntary_ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// Resident memory of `pid`, KiB (0 if unreadable).
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

/// Most worker processes `bench workers` starts at once.
const MAX_BENCH_WORKERS: u32 = 1024;

fn bench_workers(b: WorkersBench) -> anyhow::Result<()> {
    use crate::up::procs::{sibling_binary, Proc};
    use kvfleet_proto::v1;
    use std::time::Duration;
    if let Some(n) = b.counts.iter().find(|&&n| !(1..=MAX_BENCH_WORKERS).contains(&n)) {
        return Err(InputError(format!("--counts: each count must be in 1..={MAX_BENCH_WORKERS}, got {n}")).into());
    }
    if !(b.duration_s.is_finite() && b.duration_s > 0.0) || b.per_worker == 0 {
        let why = format!("--duration-s and --per-worker must be positive, got {} and {}", b.duration_s, b.per_worker);
        return Err(InputError(why).into());
    }
    let worker_bin = sibling_binary("kvfleet-worker")?;
    std::fs::create_dir_all(&b.out)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    crate::say!(
        "bench workers: {} s of load per count, {} requests in flight per worker, {} arenas (pre-faulted)",
        b.duration_s,
        b.per_worker,
        b.kv_memory
    );
    crate::say!(
        "{:>8} {:>14} {:>14} {:>14} {:>12} {:>12} {:>16}",
        "workers",
        "p99 median us",
        "p99 worst us",
        "max worst us",
        "iterations",
        "RSS MiB/wkr",
        "wake-ups/s/wkr"
    );
    let mut best = None;
    for &n in &b.counts {
        let mut procs = Vec::new();
        for i in 0..n {
            let args: Vec<String> = [
                "--instance",
                &i.to_string(),
                "--kv-memory",
                &b.kv_memory,
                "--cpu-memory",
                &b.kv_memory,
                "--kv-fill",
                "stamp",
                "--prefault",
                "--load-interval-ms",
                "1000",
                "--plaintext",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            let log = b.out.join(format!("worker-{n}-{i}.log"));
            procs.push((
                Proc::spawn(&format!("worker-{i}"), &worker_bin, &args, &log, Some(Duration::from_secs(60)))?,
                log,
            ));
        }
        let addrs: Vec<String> = procs.iter().filter_map(|(p, _)| p.addr.clone()).collect();
        let duration = Duration::from_secs_f64(b.duration_s);
        let switches_before: u64 = procs.iter().map(|(p, _)| context_switches(p.pid())).sum();
        let load_started = std::time::Instant::now();
        let per_worker = b.per_worker;
        rt.block_on(async {
            let mut tasks = Vec::new();
            for (w, addr) in addrs.iter().enumerate() {
                let addr = addr.clone();
                tasks.push(tokio::spawn(async move {
                    let Ok(ep) = tonic::transport::Endpoint::from_shared(format!("http://{addr}")) else { return };
                    let Ok(ch) = ep.connect().await else { return };
                    let mut c = v1::worker_client::WorkerClient::new(ch);
                    let until = tokio::time::Instant::now() + duration;
                    let mut id = (w as u64) << 32;
                    // Keep `per_worker` short reasoning requests in flight until the time is up.
                    while tokio::time::Instant::now() < until {
                        let load = c.load(v1::LoadRequest {}).await.map(|r| r.into_inner()).unwrap_or_default();
                        let in_flight = load.reasoning_requests + load.answering_requests;
                        for _ in in_flight..per_worker {
                            id += 1;
                            let spec = v1::RequestSpec {
                                id,
                                arrival_ns: 0,
                                prompt_tokens: 32,
                                reasoning_tokens: 60,
                                answer_tokens: 40,
                                content_ids: Vec::new(),
                            };
                            let _ = c.submit(v1::SubmitRequest { spec: Some(spec), incarnation: 0 }).await;
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    let _ = c.shutdown(v1::ShutdownRequest {}).await;
                }));
            }
            for t in tasks {
                let _ = t.await;
            }
        });
        // Wake-ups: context switches of every thread (each sleep that ends is one), over the load.
        let switches: u64 = procs.iter().map(|(p, _)| context_switches(p.pid())).sum();
        let wakeups =
            switches.saturating_sub(switches_before) as f64 / load_started.elapsed().as_secs_f64() / f64::from(n);
        let rss_mib = procs.iter().map(|(p, _)| rss_kib(p.pid())).sum::<u64>() as f64 / 1024.0 / f64::from(n);
        let mut p99s = Vec::new();
        let mut maxes = Vec::new();
        let mut iterations = 0.0;
        for (p, log) in procs.iter_mut() {
            p.stop(Duration::from_secs(10));
            p99s.extend(stop_line_field(log, "lateness_p99_us"));
            maxes.extend(stop_line_field(log, "lateness_max_us"));
            iterations += stop_line_field(log, "iterations").unwrap_or(0.0);
        }
        p99s.sort_by(|a, b| a.total_cmp(b));
        let median = p99s.get(p99s.len() / 2).copied().unwrap_or(f64::NAN);
        let worst = p99s.last().copied().unwrap_or(f64::NAN);
        let max = maxes.iter().cloned().fold(f64::NAN, f64::max);
        crate::say!(
            "{n:>8} {median:>14.0} {worst:>14.0} {max:>14.0} {iterations:>12.0} {rss_mib:>12.0} {wakeups:>16.0}"
        );
        if p99s.len() == n as usize && worst < 1000.0 {
            best = Some(n);
        }
    }
    match best {
        Some(n) => crate::say!("largest count with every worker's p99 lateness < 1 ms: {n}"),
        None => crate::say!("no count kept every worker's p99 lateness under 1 ms"),
    }
    Ok(())
}
