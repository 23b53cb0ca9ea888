//! `kvfleet up`: a local cluster on loopback. It starts etcd (when installed; else one
//! coordinator with its embedded store), two coordinators and N workers, replays a workload
//! through the leader in real time, prints the same table and files as `kvfleet sim`, and then
//! shuts everything down, leaving no process behind.

mod audit;
mod chaos;
pub mod cluster;
pub(crate) mod live;
pub mod procs;
pub mod replay;
mod scrape;
pub(crate) mod watch;

use crate::experiment::{Plan, PlanArgs, Progress, Replayed};
use crate::{report, say, InputError};
use anyhow::bail;
use clap::Args;
use cluster::{Cluster, ClusterSpec, Started};
use kvfleet_core::TimeSpan;
use kvfleet_meta::layout::ClusterTime;
use replay::{replay, schedule, GiveUp, ReplayStats};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The embedded default: a small PASCAL cluster that finishes in about a minute on a laptop.
pub const DEFAULT_CONFIG: &str = include_str!("default-up.toml");

/// Timer lateness (p50, seconds) past which `kvfleet up` says a worker ran behind its model.
const LATE_NOTE_S: f64 = 0.05;

#[derive(Args)]
pub struct UpArgs {
    /// Experiment config (same format as `kvfleet sim`); default: the embedded small cluster
    /// (4 workers, 32B model on H100 profile timing, 120 short reasoning requests at 4 req/s).
    #[arg(short, long)]
    config: Option<PathBuf>,
    /// Number of worker processes (default: `cluster.instances` of the config).
    #[arg(long)]
    workers: Option<u32>,
    /// Coordinators to start when etcd is available (the others stand by).
    #[arg(long, default_value_t = 2)]
    coordinators: u32,
    /// Do not use etcd even if installed: one coordinator with its embedded store.
    #[arg(long)]
    no_etcd: bool,
    /// Policy preset or INTRA+INSTANCE pair (default: the config's `scheduler.policy`).
    #[arg(long)]
    policy: Option<String>,
    /// Arrival rate, requests/s (Poisson/gamma workloads).
    #[arg(long, allow_negative_numbers = true)]
    rate: Option<f64>,
    /// Number of requests.
    #[arg(long)]
    requests: Option<u64>,
    /// Workload seed.
    #[arg(long)]
    seed: Option<u64>,
    #[command(flatten)]
    arena: cluster::ArenaArgs,
    /// Shape every worker's outgoing migration links to this rate (Gbit/s), to emulate a fabric
    /// slower than this host's loopback (e.g. the config's `[link] bandwidth_gbps`, as
    /// `kvfleet bench parity` does). Default: unshaped.
    #[arg(long)]
    link_gbps: Option<f64>,
    /// Added one-way latency on every worker's outgoing migration links, µs.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    link_latency_us: f64,
    /// Time dilation K: every emulated duration (GPU iterations, migration links and timers,
    /// the workload's arrivals) lasts K times longer in real time, and every reported figure is
    /// in emulated time, so this host can emulate a fabric faster than its transport (shaped to
    /// rate ÷ K). `auto`: measure this host's QUIC goodput and choose K so that `--link-gbps`
    /// ÷ K stays well below it (printed).
    #[arg(long, default_value = "1")]
    time_dilation: cluster::DilationArg,
    /// Do not pre-fault the workers' KV arenas (faster start-up; the first touch of each page then
    /// lands inside the engine loop and shows up as timer lateness of up to hundreds of ms).
    #[arg(long)]
    no_prefault: bool,
    /// Output directory (results, CSVs, plots, process logs).
    #[arg(short, long, default_value = "results/up")]
    out: PathBuf,
    /// Fault injection: kill -9 the leader coordinator this many seconds into the replay.
    #[arg(long, allow_negative_numbers = true)]
    kill_leader_after_s: Option<f64>,
    /// Fault injection: kill -9 worker 0 this many seconds into the replay.
    #[arg(long, allow_negative_numbers = true)]
    kill_worker_after_s: Option<f64>,
    /// Fault injection: SIGSTOP worker 0 this many seconds into the replay and SIGCONT it
    /// `--pause-for-s` later (longer than its registration lease: its requests are re-placed,
    /// and its late copies must not count).
    #[arg(long, allow_negative_numbers = true)]
    pause_worker_after_s: Option<f64>,
    /// Fault injection: SIGSTOP the leader coordinator this many seconds into the replay and
    /// SIGCONT it `--pause-for-s` later (a standby takes over; its clients must move too).
    #[arg(long, allow_negative_numbers = true)]
    pause_leader_after_s: Option<f64>,
    /// How long `--pause-worker-after-s` / `--pause-leader-after-s` keep a process stopped, s.
    #[arg(long, default_value_t = 5.0, allow_negative_numbers = true)]
    pause_for_s: f64,
    /// Chaos: a random schedule of faults drawn from this seed (kill -9 and SIGSTOP of the
    /// leader and of workers, workers restarted at once under their number, etcd killed and
    /// restarted); the run then checks every request completed exactly once and etcd holds
    /// what the clients got, and prints a chaos table. Same seed, same schedule.
    #[arg(long, value_name = "SEED")]
    chaos: Option<u64>,
    /// Faults in the `--chaos` schedule.
    #[arg(long, default_value_t = 6)]
    chaos_faults: usize,
    /// The `--chaos` faults fall within this many seconds of the replay's start.
    #[arg(long, default_value_t = 30.0, allow_negative_numbers = true)]
    chaos_span_s: f64,
    /// Fault injection: kill -9 etcd this many seconds into the replay and restart it (same data)
    /// two seconds later.
    #[arg(long, allow_negative_numbers = true)]
    restart_etcd_after_s: Option<f64>,
    /// Issue the cluster's certificates from this CA (a directory with `ca.pem` and `ca.key`)
    /// instead of a fresh one generated in `OUT/pki`.
    #[arg(long, conflicts_with = "plaintext")]
    ca_dir: Option<PathBuf>,
    /// INSECURE: run the control plane in plain text (no certificates; local debugging only).
    #[arg(long)]
    plaintext: bool,
    /// Send every process's spans to this OTLP/gRPC endpoint (Jaeger, Tempo, a Collector)
    /// instead of the built-in trace sink.
    #[arg(long, value_name = "URL", conflicts_with = "no_traces")]
    otlp_endpoint: Option<String>,
    /// Export no spans (by default a `kvfleet traces collect` sink writes `OUT/traces.jsonl` and
    /// the run ends with its analysis in `OUT/traces/`).
    #[arg(long)]
    no_traces: bool,
    /// Give up when no request finishes and no token streams for this many seconds while requests
    /// are outstanding: the run then fails naming every unfinished request and where it was.
    #[arg(long, default_value_t = 120.0, allow_negative_numbers = true)]
    stall_timeout_s: f64,
    /// No progress bar.
    #[arg(short, long)]
    quiet: bool,
}

pub fn run(args: UpArgs) -> anyhow::Result<()> {
    let mut plan = Plan::load(&PlanArgs {
        config: args.config.as_deref(),
        policy: args.policy.as_deref(),
        requests: args.requests,
        seed: args.seed,
        workers: args.workers,
        rate: args.rate,
    })?;
    if let Some(g) = args.link_gbps.filter(|g| !(g.is_finite() && *g > 0.0)) {
        return Err(InputError(format!("--link-gbps must be a positive number, got {g}")).into());
    }
    if !(args.link_latency_us.is_finite() && args.link_latency_us >= 0.0) {
        return Err(InputError(format!("--link-latency-us must be ≥ 0, got {}", args.link_latency_us)).into());
    }
    check_run_flags(&args)?;

    let dilation = args.time_dilation.resolve(args.link_gbps, &args.out)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let clock = ClusterTime { epoch_unix_ns: replay::unix_now_ns(), dilation };
    let mut cluster = Cluster::default();
    let result = (|| -> anyhow::Result<()> {
        let spec = ClusterSpec {
            cfg: &plan.cfg,
            intra: &plan.intra,
            instance_policy: &plan.instance_policy,
            out: &args.out,
            coordinators: args.coordinators,
            no_etcd: args.no_etcd,
            plaintext: args.plaintext,
            ca_dir: args.ca_dir.as_deref(),
            otlp_endpoint: args.otlp_endpoint.as_deref(),
            no_traces: args.no_traces,
            kv_memory: &args.arena.kv_memory,
            cpu_memory: &args.arena.cpu_memory,
            kv_fill: &args.arena.kv_fill,
            link_gbps: args.link_gbps,
            link_latency_us: args.link_latency_us,
            no_prefault: args.no_prefault,
            http_listen: None,
            api_key: None,
            clock,
            own_groups: false,
        };
        let faults = faults(&args, plan.cfg.cluster.instances as usize);
        let mut watch = watch::Watch::new();
        let Started { finder, metric_pages, etcd_url, etcd_options, logs } = cluster::start(&spec, &rt, &mut cluster)
            .map_err(|e| {
            // A process that died or was stopped meanwhile is the cause, not the one that
            // then waited for it.
            match watch.check(&mut cluster, &[]).join("; ") {
                cause if cause.is_empty() => e,
                cause => {
                    let then = format!("{e:#}");
                    let then = then.lines().next().unwrap_or_default().trim_end_matches(", which ends:");
                    InputError(format!("the cluster did not start: {cause} (then: {then})")).into()
                }
            }
        })?;
        // Replay.
        schedule(&mut plan.requests, clock, Duration::from_millis(300));
        let total = plan.requests.len() as u64;
        let stats = Arc::new(ReplayStats::default());
        let mut progress = Progress::new(total, args.quiet);
        let give_up = GiveUp::default();
        // Given in emulated seconds, like every other time of a dilated run.
        let mut stall = StallWatch::new(dilation.real(TimeSpan::from_secs_f64(args.stall_timeout_s)));
        watch.replay_starts();
        let (records, chaos_log) = rt.block_on(async {
            let replay_task = tokio::spawn(replay(
                finder.clone(),
                plan.requests.clone(),
                clock,
                stats.clone(),
                dilation.real(TimeSpan::from_secs_f64(30.0)),
                give_up.clone(),
            ));
            let mut chaos = chaos::Chaos::new(faults);
            // SIGINT / SIGTERM end the replay (its requests reported unfinished) and the run then
            // stops every process it started, instead of leaving them behind.
            let mut interrupted = Box::pin(crate::traces::stop_signal());
            let mut stopping = false;
            while !replay_task.is_finished() {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                    () = &mut interrupted, if !stopping => {
                        stopping = true;
                        progress.say("interrupted: stopping the replay and every process");
                        give_up.give_up("interrupted (SIGINT or SIGTERM)");
                    }
                }
                progress.update(&stats);
                let counters = (stats.finished.load(Ordering::Relaxed), stats.tokens.load(Ordering::Relaxed));
                if let Some(idle) = stall.check(counters) {
                    let why = format!("no request finished and no token streamed for {:.0} s", idle.as_secs_f64());
                    progress.say(&format!("stalled: {why} (--stall-timeout-s); giving up on the unfinished requests"));
                    give_up.give_up(why);
                }
                chaos.step(&mut cluster, &finder, progress.bar()).await;
                if !stopping {
                    for line in watch.check(&mut cluster, &chaos.paused_pids()) {
                        progress.say(&format!("unplanned: {line}"));
                    }
                }
            }
            chaos.finish();
            (replay_task.await.unwrap_or_default(), chaos.log)
        });
        progress.finish();
        let wall = progress.elapsed().as_secs_f64();
        let (ok, failed) = replay::partition(records);
        // The leader's record: live migrations (each source's measurements), roles, handoffs.
        let last = rt.block_on(finder.leader(Duration::from_secs(10))).map(|(_, s)| s).unwrap_or_default();
        let replayed = Replayed {
            ok,
            failed,
            live_log: last.migration_log,
            // The run's span as the cluster lived it: what every other reported time is in.
            span_s: dilation.emulated(progress.elapsed()).as_secs_f64(),
            role_changes: last.role_changes,
            handoffs: last.handoffs,
            handoffs_released: last.handoffs_released,
            handoffs_overlapped: last.handoffs_overlapped,
            prefix_fetches: last.prefix_fetches,
            prefix_fetch_bytes: last.prefix_fetch_bytes,
        };
        // What each worker counted itself, before it stops.
        let pages = scrape::save_all(&args.out.join("metrics"), &metric_pages)?;
        let run = replayed.run_result(&plan);
        say!("{}", report::summary_table(std::slice::from_ref(&run)));
        let rejected = replayed.rejected();
        say!(
            "{} of {} requests finished, {} rejected (never fit an instance), {} failed, in {:.1} s; {} migrated (at </think> or handed off); \
             {} started over on another instance; {} resumed after a leader change; {} client retries",
            replayed.ok.len() - rejected,
            total,
            rejected,
            replayed.failed.len(),
            replayed.span_s,
            replayed.migrated(),
            replayed.ok.iter().filter(|r| r.replaced > 0).count(),
            stats.resumed.load(Ordering::Relaxed),
            stats.retries.load(Ordering::Relaxed)
        );
        let rejected_by_name = report::rejected_note(std::slice::from_ref(&run));
        if !rejected_by_name.is_empty() {
            say!("{}", rejected_by_name.trim_end());
        }
        if let Some(line) = replayed.pd_line() {
            say!("{line}");
        }
        if let Some(h) = run.handoffs.as_ref().filter(|h| h.handoffs > 0) {
            say!("  handoffs: {h}");
        }
        // Each leader stores the migrations it settles for the next one; a move a killed leader
        // had in flight is logged by the next from its source's measurements as it settles it.
        // Only a leader killed between a move's reply and storing it, or a source restarted
        // since, leaves a move without a record.
        let logged = run.live_migrations.committed as usize;
        if logged < replayed.migrated() {
            say!(
                "note: {} requests migrated but the leaders logged {logged} committed migrations: a leader was \
                 killed before it stored some, or their source restarted before a new leader asked it (each \
                 migration's spans are in the traces)",
                replayed.migrated()
            );
        }
        if replayed.prefix_fetches > 0 {
            say!(
                "cache-aware: {} placements copied a cached prefix from another worker first ({:.2} GiB)",
                replayed.prefix_fetches,
                replayed.prefix_fetch_bytes as f64 / (1u64 << 30) as f64
            );
        }
        if !dilation.is_none() {
            say!(
                "time dilation {dilation}: {wall:.1} s of real time emulated {:.1} s; every time above is emulated",
                replayed.span_s
            );
        }
        // A worker whose host could not keep up ran its engine's timeline behind the wall clock:
        // its figures are still the model's, but say so.
        let behind: Vec<String> = pages
            .iter()
            .filter_map(|(name, body)| {
                let p50 = scrape::sample(body, "kvfleet_timer_lateness_seconds", "quantile=\"0.5\"")?;
                (p50 > LATE_NOTE_S).then(|| format!("{name} {:.0} ms", p50 * 1e3))
            })
            .collect();
        if !behind.is_empty() {
            say!(
                "note: workers ran behind their modelled iterations (timer lateness p50: {}): this host could not \
                 emulate the model in real time, so the run lasted longer than its workload; every time above is still \
                 the model's (a request waits for its arrival on its engine's timeline). A release build or \
                 --time-dilation K keeps pace",
                behind.join(", ")
            );
        }
        for line in &chaos_log.not_injected {
            say!("note: {line}");
        }
        for line in &watch.seen {
            say!("unplanned: {line}");
        }
        for ms in &chaos_log.failovers_ms {
            say!("leader failover took {ms} ms (the leader killed or stopped → a new leader answering)");
        }
        let written = replayed.report(&args.out, &run, true)?;
        // The cluster's own record of the run must be what the clients got.
        let audited = match &etcd_url {
            Some(url) => match rt.block_on(audit::audit(url, &etcd_options, &replayed.ok)) {
                Ok(a) => {
                    say!("{}", a.line());
                    for d in a.differ.iter().take(5) {
                        say!("  differs: {d}");
                    }
                    Some(a)
                }
                Err(e) => {
                    say!("etcd results: not audited ({e:#})");
                    None
                }
            },
            None => None,
        };
        if let Some(seed) = args.chaos {
            let (ok, failed) = (&replayed.ok, &replayed.failed);
            let report = chaos::report(seed, &chaos_log, total, ok, failed, audited.as_ref(), &run.migrations);
            say!("{}", report.table().trim_end());
            std::fs::write(args.out.join("chaos.json"), serde_json::to_string_pretty(&report)? + "\n")?;
        }
        say!("wrote {} files to {} (process logs in {})", written.len(), args.out.display(), logs.display());
        if !replayed.failed.is_empty() {
            if let Some(cause) = watch.cause() {
                // Not kvfleet's doing: a process of the cluster died or was stopped from outside.
                return Err(InputError(format!("{} requests did not complete: {cause}", replayed.failed.len())).into());
            }
            bail!("{} requests did not complete", replayed.failed.len());
        }
        let mut ids: Vec<u64> = replayed.ok.iter().map(|r| r.id.0).collect();
        ids.dedup();
        if ids.len() != replayed.ok.len() {
            bail!("duplicate records: a request completed more than once");
        }
        if let Some(a) = audited.filter(|a| !a.clean()) {
            bail!("{}: etcd does not hold what the clients got", a.line());
        }
        Ok(())
    })();
    for line in cluster.shutdown() {
        tracing_line(&line);
    }
    // Every process flushed its spans into the sink before the sink stopped: analyse them.
    if result.is_ok() && !args.no_traces && args.otlp_endpoint.is_none() {
        if let Err(e) = analyze_traces(&args.out.join("traces.jsonl"), &args.out.join("traces")) {
            say!("traces      not analysed: {e:#}");
        }
    }
    result
}

/// Most faults a `--chaos` schedule may hold, and most coordinators a run may start.
const MAX_CHAOS_FAULTS: usize = 1000;
const MAX_COORDINATORS: u32 = 16;

/// The run's own flags (coordinators, fault times, stall timeout, trace endpoint) checked before
/// any process starts: each bad one is one line naming it.
fn check_run_flags(args: &UpArgs) -> Result<(), InputError> {
    let bad = |line: String| Err(InputError(line));
    if !(1..=MAX_COORDINATORS).contains(&args.coordinators) {
        return bad(format!("--coordinators must be in 1..={MAX_COORDINATORS}, got {}", args.coordinators));
    }
    let times = [
        ("--kill-leader-after-s", args.kill_leader_after_s),
        ("--kill-worker-after-s", args.kill_worker_after_s),
        ("--pause-worker-after-s", args.pause_worker_after_s),
        ("--pause-leader-after-s", args.pause_leader_after_s),
        ("--restart-etcd-after-s", args.restart_etcd_after_s),
    ];
    for (flag, at) in times {
        if let Some(at) = at.filter(|at| !(at.is_finite() && *at >= 0.0)) {
            return bad(format!("{flag} must be a number of seconds ≥ 0, got {at}"));
        }
    }
    let spans = [
        ("--pause-for-s", args.pause_for_s),
        ("--chaos-span-s", args.chaos_span_s),
        ("--stall-timeout-s", args.stall_timeout_s),
    ];
    for (flag, s) in spans {
        if !(s.is_finite() && s > 0.0) {
            return bad(format!("{flag} must be a positive number of seconds, got {s}"));
        }
    }
    if args.chaos_faults > MAX_CHAOS_FAULTS {
        return bad(format!("--chaos-faults must be at most {MAX_CHAOS_FAULTS}, got {}", args.chaos_faults));
    }
    if let Some(url) = &args.otlp_endpoint {
        kvfleet_telemetry::check_endpoint(url).map_err(|e| InputError(e.to_string()))?;
    }
    Ok(())
}

/// The faults to inject: the single ones asked for, and a seeded schedule (printed).
fn faults(args: &UpArgs, workers: usize) -> Vec<chaos::Scheduled> {
    let mut faults: Vec<chaos::Scheduled> = [
        (args.kill_leader_after_s, chaos::Fault::KillLeader),
        (args.kill_worker_after_s, chaos::Fault::KillWorker(0)),
        (args.restart_etcd_after_s, chaos::Fault::RestartEtcd),
        (args.pause_worker_after_s, chaos::Fault::PauseWorker(0, args.pause_for_s)),
        (args.pause_leader_after_s, chaos::Fault::PauseLeader(args.pause_for_s)),
    ]
    .into_iter()
    .filter_map(|(at, fault)| at.map(|at_s| chaos::Scheduled { at_s, fault }))
    .collect();
    if let Some(seed) = args.chaos {
        let etcd = !args.no_etcd && procs::find_etcd().is_some();
        faults.extend(chaos::random_schedule(seed, args.chaos_faults, args.chaos_span_s, workers, etcd));
        say!("chaos       seed {seed}: {} faults within {} s", args.chaos_faults, args.chaos_span_s);
        for f in &faults {
            say!("            {:>5.1} s  {}", f.at_s, f.fault);
        }
    }
    faults
}

/// `kvfleet traces analyze OUT/traces.jsonl --out OUT/traces`, with a one-line summary.
fn analyze_traces(file: &Path, dir: &Path) -> anyhow::Result<()> {
    let parsed = kvfleet_otel::parse_file(file)?;
    let a = kvfleet_otel::analyze(&parsed.spans);
    let mut written = kvfleet_otel::report::write_outputs(dir, &parsed, &a)?;
    written.extend(kvfleet_otel::plots::write_plots(dir, &a, 10)?);
    let complete = a.migrations.iter().filter(|m| m.complete).count();
    say!(
        "traces      {} spans in {} traces: {} requests, {} migrations ({} with every phase); {} files in {} \
         (kvfleet traces analyze {})",
        a.spans,
        a.traces,
        a.requests.len(),
        a.migrations.len(),
        complete,
        written.len(),
        dir.display(),
        file.display()
    );
    Ok(())
}

/// Notices a run that stopped making progress: nothing finished and nothing streamed for `limit`.
struct StallWatch {
    limit: Duration,
    last: (u64, u64),
    since: Instant,
    fired: bool,
}

impl StallWatch {
    fn new(limit: Duration) -> Self {
        StallWatch { limit, last: (0, 0), since: Instant::now(), fired: false }
    }

    /// Feed the current (finished, tokens) counters; `Some(idle)` once, when the limit passes.
    fn check(&mut self, now: (u64, u64)) -> Option<Duration> {
        if now != self.last {
            self.last = now;
            self.since = Instant::now();
            return None;
        }
        let idle = self.since.elapsed();
        if self.fired || idle < self.limit {
            return None;
        }
        self.fired = true;
        Some(idle)
    }
}

fn tracing_line(line: &str) {
    eprintln!("stopped {line}");
}

#[cfg(test)]
mod tests {
    use super::StallWatch;
    use std::time::Duration;

    #[test]
    fn a_stall_fires_once_and_progress_postpones_it() {
        let mut never = StallWatch::new(Duration::from_secs(3600));
        assert_eq!(never.check((0, 0)), None, "within the limit");
        let mut w = StallWatch::new(Duration::ZERO);
        assert_eq!(w.check((1, 0)), None, "a finished request is progress");
        assert_eq!(w.check((1, 5)), None, "a streamed token is progress");
        assert!(w.check((1, 5)).is_some(), "no change past the limit: stalled");
        assert_eq!(w.check((1, 5)), None, "reported once");
    }
}
