//! `kvfleet up`: a local cluster on loopback. It starts etcd (when installed; else one
//! coordinator with its embedded store), two coordinators and N workers, replays a workload
//! through the leader in real time, prints the same table and files as `kvfleet sim`, and then
//! shuts everything down, leaving no process behind.

pub(crate) mod live;
pub mod procs;
pub mod replay;
mod scrape;

use crate::{report, say, InputError};
use anyhow::{bail, Context};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use kvfleet_core::metrics::{summarize, tail_ttft_by_reasoning_bin};
use kvfleet_sim::config::{resolve_policy, SimConfig};
use procs::{find_etcd, free_port, sibling_binary, EtcdSpec, Proc};
use replay::{replay, schedule, GiveUp, LeaderFinder, ReplayStats};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The embedded default: a small PASCAL cluster that finishes in about a minute on a laptop.
pub const DEFAULT_CONFIG: &str = include_str!("default-up.toml");

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
    /// Real KV arena per worker (GPU pool), e.g. 1GiB. Capacity is scaled to the host; the per-token
    /// size is the model's.
    #[arg(long, default_value = "1GiB")]
    kv_memory: String,
    /// CPU offload arena per worker.
    #[arg(long, default_value = "1GiB")]
    cpu_memory: String,
    /// KV content written per token: `full` (every byte) or `stamp` (first 64 bytes).
    #[arg(long, default_value = "full")]
    kv_fill: String,
    /// Shape every worker's outgoing migration links to this rate (Gbit/s), to emulate a fabric
    /// slower than this host's loopback (e.g. the config's `[link] bandwidth_gbps`, as
    /// `kvfleet bench parity` does). Default: unshaped.
    #[arg(long)]
    link_gbps: Option<f64>,
    /// Added one-way latency on every worker's outgoing migration links, µs.
    #[arg(long, default_value_t = 0.0)]
    link_latency_us: f64,
    /// Do not pre-fault the workers' KV arenas (faster start-up; the first touch of each page then
    /// lands inside the engine loop and shows up as timer lateness of up to hundreds of ms).
    #[arg(long)]
    no_prefault: bool,
    /// Output directory (results, CSVs, plots, process logs).
    #[arg(short, long, default_value = "results/up")]
    out: PathBuf,
    /// Fault injection: kill -9 the leader coordinator this many seconds into the replay.
    #[arg(long)]
    kill_leader_after_s: Option<f64>,
    /// Fault injection: kill -9 worker 0 this many seconds into the replay.
    #[arg(long)]
    kill_worker_after_s: Option<f64>,
    /// Fault injection: kill -9 etcd this many seconds into the replay and restart it (same data)
    /// two seconds later.
    #[arg(long)]
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
    #[arg(long, default_value_t = 120.0)]
    stall_timeout_s: f64,
    /// No progress bar.
    #[arg(short, long)]
    quiet: bool,
}

/// The cluster's PKI for this run: a CA (fresh in `OUT/pki`, or the operator's) and a certificate
/// per process; `None` with `--plaintext`.
struct Pki {
    ca: kvfleet_pki::ClusterCa,
    dir: PathBuf,
}

impl Pki {
    fn new(args: &UpArgs) -> anyhow::Result<Option<Pki>> {
        if args.plaintext {
            say!("{}", kvfleet_pki::PLAINTEXT_WARNING);
            return Ok(None);
        }
        let dir = args.out.join("pki");
        let _ = std::fs::remove_dir_all(&dir);
        let ca = match &args.ca_dir {
            Some(d) => kvfleet_pki::ClusterCa::load(d).map_err(|e| InputError(format!("--ca-dir: {e}")))?,
            None => {
                let ca = kvfleet_pki::ClusterCa::generate("kvfleet up")?;
                ca.save(&dir)?;
                ca
            }
        };
        // Only the CA certificate is needed beside the node certificates (not the operator's key).
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(kvfleet_pki::CA_CERT_FILE), ca.cert_pem())?;
        Ok(Some(Pki { ca, dir }))
    }

    /// Issue `stem`'s certificate into the PKI directory; the child's TLS flags.
    fn issue(pki: Option<&Pki>, role: kvfleet_pki::Role, stem: &str) -> anyhow::Result<Vec<String>> {
        let Some(pki) = pki else { return Ok(vec!["--plaintext".into()]) };
        let files = kvfleet_pki::IdentityFiles::in_dir(&pki.dir, stem);
        pki.ca.issue(role, stem, &[])?.save(&files)?;
        Ok(kvfleet_pki::TlsArgs::files(&files).to_args())
    }
}

struct Cluster {
    etcd: Option<(Proc, String)>,
    etcd_spec: Option<EtcdSpec>,
    coordinators: Vec<Proc>,
    workers: Vec<Proc>,
    /// The built-in trace sink (`kvfleet traces collect`).
    sink: Option<Proc>,
}

impl Cluster {
    /// Stop workers first (they drain), then coordinators, then the trace sink (after everyone
    /// flushed their spans into it), then etcd. Every child is reaped.
    fn shutdown(&mut self) -> Vec<String> {
        let mut report = Vec::new();
        // Ten seconds each: a process flushes its last spans as it stops; on a loaded host that
        // can take longer than its own shutdown.
        for p in self.workers.iter_mut().chain(self.coordinators.iter_mut()).chain(self.sink.iter_mut()) {
            let s = p.stop(Duration::from_secs(10));
            report.push(format!("{}: {s}", p.name));
        }
        if let Some((p, _)) = self.etcd.as_mut() {
            let s = p.stop(Duration::from_secs(5));
            report.push(format!("etcd: {s}"));
        }
        report
    }
}

pub fn run(args: UpArgs) -> anyhow::Result<()> {
    let mut cfg = match &args.config {
        Some(p) => SimConfig::load(p).map_err(|e| InputError(e.to_string()))?,
        None => SimConfig::parse(DEFAULT_CONFIG, "<embedded default>").map_err(|e| InputError(e.to_string()))?,
    };
    let base_dir = args.config.as_ref().and_then(|p| p.parent().map(Path::to_path_buf)).unwrap_or_default();
    if let Some(p) = &args.policy {
        cfg.scheduler.policy = p.clone();
    }
    if let Some(n) = args.requests {
        cfg.workload.num_requests = Some(n);
    }
    if let Some(s) = args.seed {
        cfg.workload.seed = s;
    }
    if let Some(w) = args.workers {
        cfg.cluster.instances = w;
    }
    cfg.sweep = None;
    cfg.validate().map_err(|e| InputError(e.to_string()))?;
    if let Some(g) = args.link_gbps.filter(|g| !(g.is_finite() && *g > 0.0)) {
        return Err(InputError(format!("--link-gbps must be a positive number, got {g}")).into());
    }
    if !(args.link_latency_us.is_finite() && args.link_latency_us >= 0.0) {
        return Err(InputError(format!("--link-latency-us must be ≥ 0, got {}", args.link_latency_us)).into());
    }
    let rate = match args.rate {
        Some(r) if !(r.is_finite() && r > 0.0) => {
            return Err(InputError(format!("--rate must be a positive number, got {r}")).into())
        }
        r => r,
    };
    let (intra, instance_policy) = resolve_policy(&cfg.scheduler.policy).map_err(|e| InputError(e.to_string()))?;
    let mut workload = cfg.workload.clone();
    if let Some(r) = rate {
        match &mut workload.arrivals {
            kvfleet_core::workload::ArrivalConfig::Poisson { rate }
            | kvfleet_core::workload::ArrivalConfig::Gamma { rate, .. } => *rate = r,
            _ => return Err(InputError("--rate needs a poisson or gamma workload".into()).into()),
        }
    }
    let mut requests =
        kvfleet_core::workload::generate(&workload, &base_dir).map_err(|e| InputError(format!("workload: {e}")))?;
    let coordinator_bin = sibling_binary("kvfleet-coordinator")?;
    let worker_bin = sibling_binary("kvfleet-worker")?;
    let logs = args.out.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let epoch_unix_ns = replay::unix_now_ns();
    let mut cluster =
        Cluster { etcd: None, etcd_spec: None, coordinators: Vec::new(), workers: Vec::new(), sink: None };
    let result = (|| -> anyhow::Result<()> {
        // The control plane's certificates (mutual TLS), then etcd or the embedded store.
        let pki = Pki::new(&args)?;
        let client_tls = match &pki {
            Some(p) => {
                Pki::issue(Some(p), kvfleet_pki::Role::Client, "client")?;
                say!(
                    "pki         {} (mutual TLS; CA {})",
                    p.dir.display(),
                    if args.ca_dir.is_some() { "supplied" } else { "generated" }
                );
                Some(kvfleet_pki::NodeIdentity::load(&kvfleet_pki::IdentityFiles::in_dir(&p.dir, "client"))?)
            }
            None => None,
        };
        let etcd = if args.no_etcd { None } else { find_etcd() };
        let n_coord = if etcd.is_some() { args.coordinators.max(1) } else { 1 };
        if let Some(bin) = etcd {
            let dir = args.out.join("etcd");
            std::fs::create_dir_all(&dir)?;
            let _ = std::fs::remove_dir_all(dir.join("etcd-data"));
            let spec = EtcdSpec::new(&bin, &dir)?;
            cluster.etcd = Some((spec.start()?, spec.url()));
            cluster.etcd_spec = Some(spec);
            say!("etcd        {}", cluster.etcd.as_ref().map_or("", |e| e.1.as_str()));
        } else {
            say!(
                "etcd        not used ({}): one coordinator with an embedded store",
                if args.no_etcd { "--no-etcd" } else { "not installed" }
            );
        }
        let etcd_url = cluster.etcd.as_ref().map(|e| e.1.clone());
        // Spans: to the operator's backend, or to a sink of our own.
        let otlp = if args.no_traces {
            None
        } else if let Some(url) = &args.otlp_endpoint {
            say!("traces      exported to {url}");
            Some(url.clone())
        } else {
            let exe = std::env::current_exe().context("locating the kvfleet binary")?;
            let file = args.out.join("traces.jsonl");
            let _ = std::fs::remove_file(&file);
            let a = ["traces", "collect", "--listen", "127.0.0.1:0", "--out"].map(String::from);
            let mut a = a.to_vec();
            a.push(file.display().to_string());
            let p = Proc::spawn("trace-sink", &exe, &a, &logs.join("trace-sink.log"), Some(Duration::from_secs(30)))?;
            let url = format!("http://{}", p.addr()?);
            say!("traces      {url} -> {} (pid {})", file.display(), p.pid());
            cluster.sink = Some(p);
            Some(url)
        };
        let otlp_args: Vec<String> = otlp.iter().flat_map(|u| ["--otlp-endpoint".to_string(), u.clone()]).collect();
        let mut metric_pages = Vec::new();
        for i in 0..n_coord {
            let mut a = vec![
                "--policy".to_string(),
                instance_policy.clone(),
                "--model".into(),
                cfg.cluster.model.clone(),
                "--headroom-blocks".into(),
                cfg.scheduler.instance.headroom_blocks.to_string(),
                "--epoch-unix-ns".into(),
                epoch_unix_ns.to_string(),
            ];
            if let Some(u) = &etcd_url {
                a.extend(["--etcd".into(), u.clone()]);
            }
            a.extend(otlp_args.iter().cloned());
            // Its /metrics (and the OpenAI API) on a loopback port, scraped at the end.
            let http = format!("127.0.0.1:{}", free_port()?);
            a.extend(["--http-listen".into(), http.clone()]);
            metric_pages.push((format!("coordinator-{i}"), http));
            a.extend(Pki::issue(pki.as_ref(), kvfleet_pki::Role::Coordinator, &format!("coordinator-{i}"))?);
            let p = Proc::spawn(
                &format!("coordinator-{i}"),
                &coordinator_bin,
                &a,
                &logs.join(format!("coordinator-{i}.log")),
                Some(Duration::from_secs(30)),
            )?;
            say!("coordinator {} (pid {})", p.addr()?, p.pid());
            cluster.coordinators.push(p);
        }
        let coord_addrs: Vec<String> = cluster.coordinators.iter().filter_map(|p| p.addr.clone()).collect();
        let finder = LeaderFinder::new(coord_addrs.clone(), client_tls.clone());
        let (_, status) = rt.block_on(finder.leader(Duration::from_secs(30))).context("waiting for a leader")?;
        say!("leader      {} (store: {})", status.leader, status.store);
        for i in 0..cfg.cluster.instances {
            let mut a = vec![
                "--instance".to_string(),
                i.to_string(),
                "--model".into(),
                cfg.cluster.model.clone(),
                "--gpu".into(),
                cfg.cluster.gpu.clone(),
                "--timing".into(),
                cfg.cluster.timing.clone(),
                "--scheduler".into(),
                intra.clone(),
                "--quantum".into(),
                cfg.scheduler.intra.quantum_tokens.to_string(),
                "--demotion-tokens".into(),
                cfg.scheduler.intra.demotion_tokens.to_string(),
                "--tpot-ms".into(),
                (cfg.slo.tpot_s * 1e3).to_string(),
                "--block-size".into(),
                cfg.cluster.block_size.to_string(),
                "--max-num-seqs".into(),
                cfg.cluster.max_num_seqs.to_string(),
                "--kv-memory".into(),
                args.kv_memory.clone(),
                "--cpu-memory".into(),
                args.cpu_memory.clone(),
                "--kv-fill".into(),
                args.kv_fill.clone(),
                "--epoch-unix-ns".into(),
                epoch_unix_ns.to_string(),
                "--load-interval-ms".into(),
                "20".into(),
                // The live-migration knobs of the config's `[migration]`, as the simulator uses them.
                "--stop-copy-blocks".into(),
                cfg.migration.stop_copy_blocks.to_string(),
                "--stop-copy-ms".into(),
                cfg.migration.stop_copy_ms.to_string(),
                "--max-stages".into(),
                cfg.migration.max_stages.to_string(),
                "--migration-timeout-ms".into(),
                (cfg.migration.timeout_ms.round() as u64).to_string(),
            ];
            if let Some(gbps) = args.link_gbps {
                a.extend(["--link-gbps".into(), gbps.to_string()]);
            }
            if args.link_latency_us > 0.0 {
                a.extend(["--link-latency-us".into(), args.link_latency_us.to_string()]);
            }
            if !args.no_prefault {
                a.push("--prefault".into());
            }
            a.extend(otlp_args.iter().cloned());
            let metrics_addr = format!("127.0.0.1:{}", free_port()?);
            a.extend(["--metrics-listen".into(), metrics_addr.clone()]);
            metric_pages.push((format!("worker-{i}"), metrics_addr));
            a.extend(Pki::issue(pki.as_ref(), kvfleet_pki::Role::Worker, &format!("worker-{i}"))?);
            match &etcd_url {
                Some(u) => a.extend(["--etcd".into(), u.clone()]),
                None => a.extend(["--coordinator".into(), coord_addrs.join(",")]),
            }
            let p = Proc::spawn(
                &format!("worker-{i}"),
                &worker_bin,
                &a,
                &logs.join(format!("worker-{i}.log")),
                Some(Duration::from_secs(30)),
            )?;
            cluster.workers.push(p);
        }
        // All workers registered and visible to the leader.
        let want = cfg.cluster.instances as usize;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (_, s) = rt.block_on(finder.leader(Duration::from_secs(10)))?;
            let alive = s.instances.iter().filter(|i| i.alive).count();
            if alive >= want {
                break;
            }
            if Instant::now() > deadline {
                bail!("only {alive} of {want} workers registered within 30 s; see {}", logs.display());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        say!("workers     {want} registered ({} scheduler, {} KV arena each)", intra, args.kv_memory);
        // Every child's pid, so callers (and tests) can check that none outlives `kvfleet up`.
        let pids: Vec<String> = cluster
            .etcd
            .iter()
            .map(|e| &e.0)
            .chain(&cluster.coordinators)
            .chain(&cluster.workers)
            .chain(&cluster.sink)
            .map(|p| format!("{} {}", p.pid(), p.name))
            .collect();
        std::fs::write(args.out.join("pids.txt"), pids.join("\n") + "\n")?;

        // Replay.
        schedule(&mut requests, epoch_unix_ns, Duration::from_millis(300));
        let total = requests.len() as u64;
        let stats = Arc::new(ReplayStats::default());
        let bar = if args.quiet { ProgressBar::hidden() } else { ProgressBar::new(total) };
        bar.set_style(
            ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests finished {msg}")
                .expect("static template"),
        );
        let started = Instant::now();
        let mut failover_ms: Option<u128> = None;
        let give_up = GiveUp::default();
        let mut stall = StallWatch::new(Duration::from_secs_f64(args.stall_timeout_s));
        let records = rt.block_on(async {
            let replay_task = tokio::spawn(replay(
                finder.clone(),
                requests.clone(),
                epoch_unix_ns,
                stats.clone(),
                Duration::from_secs(30),
                give_up.clone(),
            ));
            let mut chaos_leader = args.kill_leader_after_s.map(|s| started + Duration::from_secs_f64(s));
            let mut chaos_worker = args.kill_worker_after_s.map(|s| started + Duration::from_secs_f64(s));
            let mut chaos_etcd = args.restart_etcd_after_s.map(|s| started + Duration::from_secs_f64(s));
            let mut etcd_back_at: Option<Instant> = None;
            while !replay_task.is_finished() {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let (finished, tokens) = (stats.finished.load(Ordering::Relaxed), stats.tokens.load(Ordering::Relaxed));
                bar.set_position(finished);
                bar.set_message(format!("({tokens} tokens streamed)"));
                if let Some(idle) = stall.check((finished, tokens)) {
                    let why = format!("no request finished and no token streamed for {:.0} s", idle.as_secs_f64());
                    bar.suspend(|| say!("stalled: {why} (--stall-timeout-s); giving up on the unfinished requests"));
                    give_up.give_up(why);
                }
                if chaos_leader.is_some_and(|t| Instant::now() >= t) {
                    chaos_leader = None;
                    if let Ok((_, s)) = finder.leader(Duration::from_secs(5)).await {
                        if let Some(p) =
                            cluster.coordinators.iter_mut().find(|p| p.addr.as_deref() == Some(s.leader.as_str()))
                        {
                            bar.suspend(|| say!("chaos: kill -9 leader {} (pid {})", s.leader, p.pid()));
                            p.kill9();
                            let killed_at = Instant::now();
                            // Failover time: until another coordinator answers as leader.
                            let deadline = killed_at + Duration::from_secs(30);
                            while Instant::now() < deadline {
                                if let Ok((_, s2)) = finder.leader(Duration::from_millis(200)).await {
                                    if s2.leader != s.leader {
                                        let ms = killed_at.elapsed().as_millis();
                                        bar.suspend(|| say!("failover: new leader {} after {ms} ms", s2.leader));
                                        failover_ms = Some(ms);
                                        break;
                                    }
                                }
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                        }
                    }
                }
                if chaos_etcd.is_some_and(|t| Instant::now() >= t) {
                    chaos_etcd = None;
                    if let Some((p, _)) = cluster.etcd.as_mut() {
                        bar.suspend(|| say!("chaos: kill -9 etcd (pid {})", p.pid()));
                        p.kill9();
                        etcd_back_at = Some(Instant::now() + Duration::from_secs(2));
                    }
                }
                if etcd_back_at.is_some_and(|t| Instant::now() >= t) {
                    etcd_back_at = None;
                    if let (Some(spec), Some(slot)) = (cluster.etcd_spec.as_ref(), cluster.etcd.as_mut()) {
                        match spec.start() {
                            Ok(p) => {
                                bar.suspend(|| say!("chaos: etcd restarted (pid {})", p.pid()));
                                slot.0 = p;
                            }
                            Err(e) => bar.suspend(|| say!("chaos: etcd restart failed: {e:#}")),
                        }
                    }
                }
                if chaos_worker.is_some_and(|t| Instant::now() >= t) {
                    chaos_worker = None;
                    if let Some(p) = cluster.workers.first_mut() {
                        bar.suspend(|| say!("chaos: kill -9 worker-0 (pid {})", p.pid()));
                        p.kill9();
                    }
                }
            }
            replay_task.await.unwrap_or_default()
        });
        bar.finish_and_clear();
        let wall = started.elapsed().as_secs_f64();
        let (ok, failed) = replay::partition(records);
        // The leader's record of live migrations (each source's measurements).
        let live_log =
            rt.block_on(finder.leader(Duration::from_secs(10))).map(|(_, s)| s.migration_log).unwrap_or_default();
        let migrations = live::records(&live_log);
        // What each worker counted itself, before it stops.
        scrape::save_all(&args.out.join("metrics"), &metric_pages)?;
        let summary = summarize(&ok, &migrations, &cfg.slo);
        let tail_ttft = tail_ttft_by_reasoning_bin(&ok, 256);
        let migrated = ok.iter().filter(|r| r.migrations > 0).count();
        let run = kvfleet_sim::RunResult {
            policy: cfg.scheduler.policy.clone(),
            intra: intra.clone(),
            instance_policy: instance_policy.clone(),
            rate: rate.or_else(|| kvfleet_sim::arrival_rate(&workload.arrivals)),
            timing: cfg.cluster.timing.clone(),
            summary,
            tail_ttft,
            records: ok.clone(),
            migrations,
            live_migrations: Default::default(),
            instances: Vec::new(),
            events: 0,
            sim_end_s: wall,
        };
        say!("{}", report::summary_table(std::slice::from_ref(&run)));
        say!(
            "{} of {} requests finished ({} failed) in {:.1} s; {} migrated at </think>; {} resumed after a leader change; {} client retries",
            ok.len(),
            total,
            failed.len(),
            wall,
            migrated,
            stats.resumed.load(Ordering::Relaxed),
            stats.retries.load(Ordering::Relaxed)
        );
        say!("{}", live::table(&live_log).trim_end());
        if !live_log.is_empty() {
            live::write_csv(&args.out.join("live-migrations.csv"), &live_log)?;
        }
        if let Some(ms) = failover_ms {
            say!("leader failover took {ms} ms (kill -9 → a new leader answering)");
        }
        for e in failed.iter().take(5) {
            say!("  failed: {e}");
        }
        if !failed.is_empty() {
            std::fs::write(args.out.join("failed.txt"), failed.join("\n") + "\n")?;
            say!("  (all {} failures in {})", failed.len(), args.out.join("failed.txt").display());
        }
        let mut written = report::write_outputs(&args.out, std::slice::from_ref(&run))?;
        written.extend(crate::plots::write_plots(&args.out, std::slice::from_ref(&run))?);
        say!("wrote {} files to {} (process logs in {})", written.len(), args.out.display(), logs.display());
        if !failed.is_empty() {
            bail!("{} requests did not complete", failed.len());
        }
        let mut ids: Vec<u64> = ok.iter().map(|r| r.id.0).collect();
        ids.dedup();
        if ids.len() != ok.len() {
            bail!("duplicate records: a request completed more than once");
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
