//! `kvfleet`: the command line front door.
//!
//! - `kvfleet sim`: run a config (one run or a policies × rates sweep) in the deterministic
//!   simulator; print a summary table; write JSON, CSV and SVG plots.
//! - `kvfleet up`: a local multi-process cluster (etcd, coordinators, workers) replaying a workload.
//! - `kvfleet bench sim`: simulator speed (events/s) and the wall time of a large cluster run.
//! - `kvfleet bench timing`: timing-model error on measured points held out of the profile.
//! - `kvfleet traces collect|analyze`: the OTLP trace sink and the trace analyser.
//! - `kvfleet replay`: a workload through an already running cluster (docker-compose, swarm).
//!
//! Exit codes: 0 success, 1 runtime failure, 2 invalid input (bad flag, bad config, missing file).

mod bench;
mod bench_handoff;
mod bench_migration;
mod bench_parity;
mod certs;
mod comparison;
mod experiment;
mod goodput_cmd;
mod plots;
mod replay_cmd;
mod report;
mod serve;
mod sim_live;
mod status;
mod traces;
mod up;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use kvfleet_sim::config::RunPoint;
use kvfleet_sim::config::SimConfig;
use kvfleet_sim::{run_one, RunResult, SimError};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

#[derive(Parser)]
#[command(name = "kvfleet", version, about = "Emulate and simulate LLM-serving GPU clusters (PASCAL and baselines)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run an experiment config in the deterministic simulator.
    Sim(SimArgs),
    /// Start a local cluster (etcd if installed, two coordinators, N workers), replay a workload
    /// through it in real time, print the results, and shut everything down.
    Up(up::UpArgs),
    /// Start a local cluster and keep it up for real clients: an OpenAI-compatible API on
    /// 127.0.0.1:8000 (`--listen`) until Ctrl-C, which drains and stops every process.
    Serve(serve::ServeArgs),
    /// Benchmarks that print figures (not tests).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// One screen on a running cluster: leader, instances and their load, requests, migrations.
    Status(status::StatusArgs),
    /// The cluster PKI (mutual TLS) for processes started by hand: a CA and per-process certificates.
    #[command(subcommand)]
    Certs(certs::CertsCommand),
    /// The trace sink (OTLP/gRPC → OTLP JSON lines) and the trace analyser (docs/tracing.md).
    #[command(subcommand)]
    Traces(traces::TracesCommand),
    /// Replay a workload through a running cluster (compose, swarm, processes started by hand);
    /// fails unless every request completed exactly once.
    Replay(replay_cmd::ReplayArgs),
}

#[derive(Args)]
pub struct SimArgs {
    /// Experiment config (TOML). See examples/pascal-8xh100.toml; every field has a default.
    #[arg(short, long)]
    config: PathBuf,
    /// Run only this policy (preset or INTRA+INSTANCE); repeatable. Overrides `[sweep].policies`.
    #[arg(long = "policy")]
    policies: Vec<String>,
    /// Run only this arrival rate (req/s); repeatable. Overrides `[sweep].rates`.
    #[arg(long = "rate", allow_negative_numbers = true)]
    rates: Vec<f64>,
    /// Override the workload seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Runs per policy and rate, with seeds seed, seed + 1, …: the comparison table then gives
    /// each figure's mean and range over the seeds. Overrides `[sweep].seeds`.
    #[arg(long)]
    seeds: Option<u32>,
    /// Override the number of requests in the workload.
    #[arg(long)]
    requests: Option<u64>,
    /// Override one config value, `KEY=VALUE` with a dotted key (repeatable), e.g.
    /// `--set scheduler.intra.boundary_hold=true`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Print the rate at which the config's steady-state KV demand meets the cluster's KV
    /// capacity, and how it was found, then exit.
    #[arg(long)]
    capacity: bool,
    /// Sweep rates at these multiples of the capacity rate (e.g. 0.85,0.95,1,1.05,1.1) instead
    /// of `[sweep].rates`.
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true)]
    around_capacity: Vec<f64>,
    /// Directory for results.json, summary.csv, per-request CSVs and plots.
    #[arg(short, long, default_value = "results/sim")]
    out: PathBuf,
    /// Do not draw plots.
    #[arg(long)]
    no_plots: bool,
    /// Runs in parallel (default: number of CPUs).
    #[arg(short = 'j', long)]
    jobs: Option<usize>,
    /// No progress bar.
    #[arg(short, long)]
    quiet: bool,
}

/// Print a line to stdout. A closed pipe (`kvfleet sim … | head`) ends the program quietly, as
/// Unix tools do, instead of panicking like `println!`.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($arg)*) {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                std::process::exit(0);
            }
            panic!("writing to stdout: {e}");
        }
    }};
}

/// An error that is the user's input, not the program: exit code 2.
#[derive(Debug)]
pub struct InputError(pub String);

impl std::fmt::Display for InputError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for InputError {}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Sim(args) => {
            sim_logs();
            cmd_sim(args)
        }
        Command::Bench(b) => bench::run(b),
        Command::Up(args) => up::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Certs(c) => certs::run(c),
        Command::Status(a) => status::run(a),
        Command::Traces(t) => traces::run(t),
        Command::Replay(a) => replay_cmd::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if e.downcast_ref::<InputError>().is_some() {
                eprintln!("error: {e}");
                ExitCode::from(2)
            } else {
                eprintln!("error: {e:#}");
                ExitCode::from(1)
            }
        }
    }
}

/// `kvfleet sim` logs nothing unless `RUST_LOG` asks (e.g. `RUST_LOG=kvfleet::decisions=debug`
/// prints the controller's decisions, as the leader of `kvfleet up` logs them): then to stderr.
fn sim_logs() {
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_default_env() {
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let _ =
            tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr).try_init();
    }
}

/// What the command line overrides in a config.
#[derive(Default)]
pub struct Overrides<'a> {
    /// Policies replacing `[sweep].policies` (or the one policy).
    pub policies: &'a [String],
    /// Rates replacing `[sweep].rates`.
    pub rates: &'a [f64],
    /// The workload seed.
    pub seed: Option<u64>,
    /// Seeds per point (`[sweep].seeds`).
    pub seeds: Option<u32>,
    /// Requests in the workload.
    pub requests: Option<u64>,
    /// `KEY=VALUE` overrides of the config's TOML.
    pub sets: &'a [String],
}

/// Load a config, apply command-line overrides, and validate: every failure is an input error.
pub fn load_config(path: &Path, o: &Overrides) -> anyhow::Result<SimConfig> {
    let mut cfg = SimConfig::load_with(path, o.sets).map_err(|e| InputError(e.to_string()))?;
    if let Some(s) = o.seed {
        cfg.workload.seed = s;
    }
    if let Some(n) = o.requests {
        cfg.workload.num_requests = Some(n);
    }
    let (policies, rates) = (o.policies, o.rates);
    let seeds = o.seeds.or(cfg.sweep.as_ref().map(|s| s.seeds)).unwrap_or(1);
    if !policies.is_empty() || !rates.is_empty() || seeds != 1 {
        let base_rates = cfg.sweep.as_ref().map(|s| s.rates.clone());
        let goodput = cfg.sweep.as_ref().and_then(|s| s.goodput.clone());
        let base_policies = cfg.sweep.as_ref().map(|s| s.policies.clone());
        let policies = if policies.is_empty() {
            base_policies.unwrap_or_else(|| vec![cfg.scheduler.policy.clone()])
        } else {
            policies.to_vec()
        };
        let sweep = |policies, rates| {
            Some(kvfleet_sim::config::SweepConfig { policies, rates, seeds, goodput: goodput.clone() })
        };
        match (rates.is_empty(), base_rates) {
            (false, _) => cfg.sweep = sweep(policies, rates.to_vec()),
            (true, Some(r)) => cfg.sweep = sweep(policies, r),
            (true, None) => {
                cfg.scheduler.policy = policies[0].clone();
                // Several policies (or seeds) on the workload's own arrivals (a trace, or the
                // configured rate).
                cfg.sweep = (policies.len() > 1 || seeds != 1).then(|| sweep(policies, Vec::new())).flatten();
            }
        }
    }
    cfg.validate().map_err(|e| InputError(e.to_string().replace("`sweep.seeds`", "`--seeds` / `sweep.seeds`")))?;
    Ok(cfg)
}

fn cmd_sim(args: SimArgs) -> anyhow::Result<()> {
    let overrides = Overrides {
        policies: &args.policies,
        rates: &args.rates,
        seed: args.seed,
        seeds: args.seeds,
        requests: args.requests,
        sets: &args.sets,
    };
    let mut cfg = load_config(&args.config, &overrides)?;
    let base_dir = args.config.parent().map(Path::to_path_buf).unwrap_or_default();
    // Fail on workload/timing input errors before starting threads and progress bars.
    kvfleet_core::workload::generate(&cfg.workload, &base_dir).map_err(|e| InputError(format!("workload: {e}")))?;
    kvfleet_sim::timing_model(&cfg, &base_dir).map_err(|e| InputError(e.to_string()))?;

    if args.capacity || !args.around_capacity.is_empty() {
        if !args.around_capacity.is_empty() {
            // Bad factors are refused before anything is printed.
            kvfleet_sim::capacity::rates_around(1.0, &args.around_capacity)
                .map_err(|e| InputError(format!("--around-capacity: {e}")))?;
        }
        let c = kvfleet_sim::capacity::capacity(&cfg, &base_dir).map_err(|e| InputError(e.to_string()))?;
        say!("{}", capacity_lines(&c));
        if args.capacity {
            return Ok(());
        }
        if c.limit == kvfleet_sim::capacity::CapacityLimit::Batch {
            say!("note: the batch fills (max_num_seqs) before the KV does: these rates put no memory pressure on the cluster");
        }
        let rates = kvfleet_sim::capacity::rates_around(c.rate_rps, &args.around_capacity)
            .map_err(|e| InputError(format!("--around-capacity: {e}")))?;
        say!("sweeping {} req/s ({} × the capacity rate)", list(&rates), list(&args.around_capacity));
        if let Some(sweep) = cfg.sweep.as_mut() {
            sweep.rates = rates;
        } else {
            cfg.sweep = Some(kvfleet_sim::config::SweepConfig {
                policies: vec![cfg.scheduler.policy.clone()],
                rates,
                seeds: 1,
                goodput: None,
            });
        }
    }
    if let Some(sweep) = cfg.sweep.as_ref() {
        if let Some(g) = &sweep.goodput {
            return goodput_cmd::run(&args, g, &sweep.policies, &base_dir);
        }
    }
    let runs = cfg.runs();
    let started = Instant::now();
    let results = run_parallel(&cfg, &runs, &base_dir, args.jobs, args.quiet)?;
    let wall = started.elapsed().as_secs_f64();

    say!("{}", report::summary_table(&results));
    if !args.around_capacity.is_empty() && results.iter().all(|r| r.summary.preemptions_total == 0) {
        say!(
            "note: no run preempted a request: the swept rates put no memory pressure on the cluster \
             (the capacity estimate is high for this workload; sweep larger factors)"
        );
    }
    let live = sim_live::table(&results);
    if !live.is_empty() {
        say!("{live}");
    }
    let rejected = report::rejected_note(&results);
    if !rejected.is_empty() {
        say!("{}", rejected.trim_end());
    }
    let events: u64 = results.iter().map(|r| r.events).sum();
    say!(
        "{} run(s), {} simulated events in {:.2} s wall ({:.2} M events/s); timing model: {}",
        results.len(),
        events,
        wall,
        events as f64 / wall.max(1e-9) / 1e6,
        results.first().map_or("-", |r| r.timing.as_str())
    );
    let mut written = report::write_outputs(&args.out, &results)?;
    written.extend(sim_live::write_csvs(&args.out, &results)?);
    if let Some(c) = comparison::compare(&results, cfg.scheduler.intra.demotion_tokens) {
        let text = comparison::render(&c);
        say!("{}", text.trim_end());
        written.extend(comparison::write(&args.out, &c, &text)?);
    }
    if !args.no_plots {
        // The plots show the first seed's runs (a prefix: seeds are the outermost loop); the
        // comparison gives every figure's range over the seeds.
        let first_seed = results.iter().take_while(|r| r.seed == results[0].seed).count();
        written.extend(plots::write_plots(&args.out, &results[..first_seed])?);
    }
    say!("wrote {} files to {}", written.len(), args.out.display());
    Ok(())
}

fn list(values: &[f64]) -> String {
    values.iter().map(|v| format!("{v}")).collect::<Vec<_>>().join(", ")
}

/// What the capacity finder found, and from what.
fn capacity_lines(c: &kvfleet_sim::capacity::Capacity) -> String {
    let bound = match c.limit {
        kvfleet_sim::capacity::CapacityLimit::Kv => "steady-state KV demand meets the cluster's KV",
        kvfleet_sim::capacity::CapacityLimit::Batch => "the batch reaches max_num_seqs (KV not yet full)",
    };
    format!(
        "capacity    {:.2} req/s: {bound}\n            from {} sampled requests (mean output {:.0} tokens, {:.2} GB·s of KV each): \
         per instance a batch of {:.1} at {:.1} ms per iteration holds {:.1} of {:.1} GB",
        c.rate_rps,
        c.requests_sampled,
        c.mean_output_tokens,
        c.mean_kv_byte_seconds / 1e9,
        c.batch_per_instance,
        c.iteration_s * 1e3,
        c.kv_bytes_held / f64::from(c.instances.max(1)) / 1e9,
        c.kv_bytes_cluster as f64 / f64::from(c.instances.max(1)) / 1e9,
    )
}

/// Run every (policy, rate, seed) point on up to `jobs` threads; results come back in `runs` order.
pub fn run_parallel(
    cfg: &SimConfig,
    runs: &[RunPoint],
    base_dir: &Path,
    jobs: Option<usize>,
    quiet: bool,
) -> anyhow::Result<Vec<RunResult>> {
    let jobs = jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1)
        .min(runs.len().max(1));
    let per_run_total = kvfleet_core::workload::generate(&cfg.workload, base_dir).map(|r| r.len()).unwrap_or(0) as u64;
    let bar = if quiet { ProgressBar::hidden() } else { ProgressBar::new(per_run_total * runs.len() as u64) };
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests finished ({eta} left) {msg}",
        )
        .expect("static template"),
    );
    let finished_total = AtomicU64::new(0);
    let next = AtomicU64::new(0);
    let slots: Mutex<Vec<Option<Result<RunResult, SimError>>>> = Mutex::new((0..runs.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..jobs {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst) as usize;
                let Some(RunPoint { policy, rate, seed }) = runs.get(i) else { break };
                let mut last = 0u64;
                let res = run_one(&cfg.with_seed(*seed), policy, *rate, base_dir, |p| {
                    let f = p.finished as u64;
                    finished_total.fetch_add(f - last, Ordering::Relaxed);
                    last = f;
                    bar.set_position(finished_total.load(Ordering::Relaxed));
                });
                bar.set_message(format!("done: {policy} @ {}", report::rate_text(*rate)));
                slots.lock().expect("no thread panicked holding the lock")[i] = Some(res);
            });
        }
    });
    bar.finish_and_clear();
    let mut out = Vec::with_capacity(runs.len());
    for (i, slot) in slots.into_inner().expect("threads joined").into_iter().enumerate() {
        let res = slot.with_context(|| format!("run {i} did not complete"))?;
        // Every SimError comes from the config or the workload (a bug panics instead).
        let RunPoint { policy, rate, seed } = &runs[i];
        let at = rate.map_or("the workload's arrivals".into(), |r| format!("{} req/s", report::rate_label(Some(r))));
        out.push(res.map_err(|e| InputError(format!("run {policy} @ {at} (seed {seed}): {e}")))?);
    }
    Ok(out)
}
