//! Starting a local cluster on loopback, shared by `kvfleet up` (which then replays a workload)
//! and `kvfleet serve` (which keeps it up for real clients): certificates, etcd (or the embedded
//! store), the trace sink, coordinators and workers, each a child process that no error or panic
//! leaves behind.

use super::procs::{find_etcd, sibling_binary, EtcdSpec, EtcdTlsFiles, Proc};
use super::replay::LeaderFinder;
use crate::{say, InputError};
use anyhow::{bail, Context};
use kvfleet_core::Dilation;
use kvfleet_meta::layout::ClusterTime;
use kvfleet_sim::config::SimConfig;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// `--time-dilation`: a factor, or `auto` (measured).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DilationArg {
    /// This factor.
    Fixed(Dilation),
    /// Chosen from this host's measured QUIC goodput and the link to emulate.
    Auto,
}

impl std::str::FromStr for DilationArg {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.trim() == "auto" {
            Ok(DilationArg::Auto)
        } else {
            text.parse().map(DilationArg::Fixed)
        }
    }
}

/// The share of this host's QUIC goodput that `--time-dilation auto` lets a shaped link use in real
/// time: a migration between two worker processes moves about half of what the bare transport
/// does here (`kvfleet bench migration`), and the engines share the cores.
pub const AUTO_DILATION_SHARE: f64 = 0.4;

/// The dilation `auto` chooses: the least whole K with `link ÷ K ≤ AUTO_DILATION_SHARE × quic`.
pub fn auto_dilation(link_gbps: f64, quic_gbps: f64) -> Dilation {
    let k = (link_gbps / (AUTO_DILATION_SHARE * quic_gbps.max(1e-3))).ceil();
    Dilation::new(k.clamp(1.0, Dilation::MAX)).unwrap_or(Dilation::NONE)
}

impl DilationArg {
    /// The factor to run at; `auto` measures this host's QUIC goodput between two processes
    /// (files under `out/dilation`) and says what it chose.
    pub fn resolve(self, link_gbps: Option<f64>, out: &Path) -> anyhow::Result<Dilation> {
        self.resolve_with(link_gbps, || crate::bench_migration::quic_goodput_gbps(&out.join("dilation"), 512 << 20, 4))
    }

    /// The factor to run at; `auto` asks `quic_gbps` for this host's QUIC goodput (Gbit/s) and
    /// says what it chose for the link.
    pub fn resolve_with(
        self,
        link_gbps: Option<f64>,
        quic_gbps: impl FnOnce() -> anyhow::Result<f64>,
    ) -> anyhow::Result<Dilation> {
        match self {
            DilationArg::Fixed(d) => Ok(d),
            DilationArg::Auto => {
                let Some(link) = link_gbps else {
                    return Err(InputError(
                        "--time-dilation auto needs --link-gbps (the fabric rate to emulate)".into(),
                    )
                    .into());
                };
                let quic = quic_gbps()?;
                let d = auto_dilation(link, quic);
                say!(
                    "time dilation: this host's QUIC carries {quic:.2} Gbit/s between two processes; to emulate \
                     {link} Gbit/s links K = {d} (links shaped to {:.2} Gbit/s of real time)",
                    link / d.factor()
                );
                Ok(d)
            }
        }
    }
}

/// Each worker's real memory, as `kvfleet up` and `kvfleet serve` take it.
#[derive(clap::Args)]
pub struct ArenaArgs {
    /// Real KV arena per worker (GPU pool), e.g. 1GiB. Capacity is scaled to the host; the per-token
    /// size is the model's.
    #[arg(long, default_value = "1GiB")]
    pub kv_memory: String,
    /// CPU offload arena per worker.
    #[arg(long, default_value = "1GiB")]
    pub cpu_memory: String,
    /// KV content written per token: `full` (every byte) or `stamp` (first 64 bytes).
    #[arg(long, default_value = "full", value_parser = ["full", "stamp"])]
    pub kv_fill: String,
}

/// What to start.
pub struct ClusterSpec<'a> {
    /// The experiment config: model, GPU, timing, scheduler knobs, `[migration]`, instances.
    pub cfg: &'a SimConfig,
    /// Intra-instance scheduler name (resolved from the policy).
    pub intra: &'a str,
    /// Instance-level policy name (resolved from the policy).
    pub instance_policy: &'a str,
    /// Output directory: logs, PKI, etcd data, traces.
    pub out: &'a Path,
    /// Coordinators to start when etcd is available.
    pub coordinators: u32,
    /// Do not use etcd even if installed.
    pub no_etcd: bool,
    /// No certificates (local debugging only).
    pub plaintext: bool,
    /// Issue certificates from this CA instead of a fresh one.
    pub ca_dir: Option<&'a Path>,
    /// Send spans to this OTLP endpoint instead of the built-in sink.
    pub otlp_endpoint: Option<&'a str>,
    /// Export no spans.
    pub no_traces: bool,
    /// Each worker's GPU KV arena (`--kv-memory`).
    pub kv_memory: &'a str,
    /// Each worker's CPU offload arena (`--cpu-memory`).
    pub cpu_memory: &'a str,
    /// KV content written per token (`full` or `stamp`).
    pub kv_fill: &'a str,
    /// Shape migration links to this rate, Gbit/s.
    pub link_gbps: Option<f64>,
    /// Added one-way latency on migration links, µs.
    pub link_latency_us: f64,
    /// Do not pre-fault the KV arenas.
    pub no_prefault: bool,
    /// The first coordinator's HTTP address (OpenAI API, `/metrics`); others get free ports.
    pub http_listen: Option<&'a str>,
    /// The key every coordinator's `/v1/*` HTTP routes require (passed as `KVFLEET_API_KEY`, not
    /// in argv); `None`: none (an inherited `KVFLEET_API_KEY` is removed).
    pub api_key: Option<&'a str>,
    /// The cluster clock: origin (Unix ns) and time dilation.
    pub clock: ClusterTime,
    /// Children in process groups of their own (`kvfleet serve` stops them itself on Ctrl-C).
    pub own_groups: bool,
}

/// A started cluster's handles.
pub struct Started {
    /// Finds the leader among the coordinators (for replays and status).
    pub finder: LeaderFinder,
    /// `(name, HTTP address)` of every process's `/metrics`.
    pub metric_pages: Vec<(String, String)>,
    /// etcd's client URL (`None`: embedded store).
    pub etcd_url: Option<String>,
    /// How to connect to that etcd: mutual TLS with the CLI's own cluster certificate (`client`),
    /// or none with `--plaintext`.
    pub etcd_options: kvfleet_meta::EtcdOptions,
    /// Where the processes' logs are.
    pub logs: PathBuf,
}

/// The cluster's PKI for this run: a CA (fresh in `OUT/pki`, or the operator's) and a certificate
/// per process; `None` with `--plaintext`.
pub struct Pki {
    ca: kvfleet_pki::ClusterCa,
    dir: PathBuf,
}

impl Pki {
    fn new(args: &ClusterSpec) -> anyhow::Result<Option<Pki>> {
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

    /// etcd's own certificate (`etcd.pem`/`etcd.key`, a service certificate with no kvfleet
    /// role) and the CA it trusts for clients and peers.
    fn etcd_server(&self) -> anyhow::Result<EtcdTlsFiles> {
        let files = kvfleet_pki::IdentityFiles::in_dir(&self.dir, "etcd");
        self.ca.issue_service("etcd", &[])?.save(&files)?;
        Ok(EtcdTlsFiles { ca: files.ca, cert: files.cert, key: files.key })
    }

    /// The etcd flags of the process whose certificate is `stem` (issued by [`Pki::issue`]): it
    /// is also its etcd client certificate (node certificates carry the clientAuth EKU that
    /// etcd's `--client-cert-auth` requires). None with `--plaintext`.
    fn etcd_client_args(pki: Option<&Pki>, stem: &str) -> Vec<String> {
        let Some(pki) = pki else { return Vec::new() };
        let files = kvfleet_pki::IdentityFiles::in_dir(&pki.dir, stem);
        let path = |p: PathBuf| p.display().to_string();
        vec![
            "--etcd-ca".into(),
            path(files.ca),
            "--etcd-cert".into(),
            path(files.cert),
            "--etcd-key".into(),
            path(files.key),
        ]
    }

    /// How the CLI itself (the audit) connects to etcd, as the `stem` process.
    fn etcd_options(pki: Option<&Pki>, stem: &str) -> kvfleet_meta::EtcdOptions {
        let tls = pki.map(|pki| {
            let files = kvfleet_pki::IdentityFiles::in_dir(&pki.dir, stem);
            kvfleet_meta::EtcdTls {
                ca_cert_pem: Some(files.ca),
                client_cert_pem: Some(files.cert),
                client_key_pem: Some(files.key),
                domain_name: None,
            }
        });
        kvfleet_meta::EtcdOptions { tls, ..kvfleet_meta::EtcdOptions::default() }
    }
}

/// Every process of a local cluster, stopped (and reaped) by [`Cluster::shutdown`] or on drop.
#[derive(Default)]
pub struct Cluster {
    /// etcd and its client URL (`None`: the coordinator's embedded store).
    pub etcd: Option<(Proc, String)>,
    /// How to start etcd again on the same data (fault injection).
    pub etcd_spec: Option<EtcdSpec>,
    /// Coordinator processes.
    pub coordinators: Vec<Proc>,
    /// Worker processes, instance 0 first.
    pub workers: Vec<Proc>,
    /// The built-in trace sink (`kvfleet traces collect`).
    pub sink: Option<Proc>,
}

impl Cluster {
    /// Every process: etcd, the coordinators, the workers, the trace sink.
    pub fn processes(&self) -> impl Iterator<Item = &Proc> {
        self.etcd.iter().map(|(p, _)| p).chain(&self.coordinators).chain(&self.workers).chain(&self.sink)
    }

    /// [`Cluster::processes`], to ask each how it is doing (which reaps the exited).
    pub fn processes_mut(&mut self) -> impl Iterator<Item = &mut Proc> {
        let Cluster { etcd, coordinators, workers, sink, .. } = self;
        etcd.iter_mut().map(|(p, _)| p).chain(coordinators).chain(workers).chain(sink)
    }

    /// Stop workers first (they drain), then coordinators, then the trace sink (after everyone
    /// flushed their spans into it), then etcd. Every child is reaped.
    pub fn shutdown(&mut self) -> Vec<String> {
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

/// The GPUs and KV arena of each worker. Under `[pd]` the initial decode pool (instances from
/// `prefill_instances` on) may span another tensor-parallel degree
/// (`cluster.decode_tensor_parallel_size`); its workers' arenas are `--kv-memory` scaled as the
/// config scales an instance's KV with its GPUs (the same under `kv_cache_gb`), so that the
/// emulator's pools keep the simulator's proportions.
struct WorkerHardware {
    /// The first instance of the decode pool (`instances` when there is none).
    decode_from: u32,
    decode_tp: u32,
    /// The decode pool's arena, bytes.
    decode_kv_memory: String,
}

impl WorkerHardware {
    fn new(args: &ClusterSpec) -> anyhow::Result<WorkerHardware> {
        let c = &args.cfg.cluster;
        let decode_tp = c.decode_tensor_parallel_size.unwrap_or(c.tensor_parallel_size);
        let same = WorkerHardware {
            decode_from: c.instances,
            decode_tp: c.tensor_parallel_size,
            decode_kv_memory: args.kv_memory.to_string(),
        };
        if args.cfg.pd.is_off() || decode_tp == c.tensor_parallel_size {
            return Ok(same);
        }
        let bytes =
            kvfleet_worker::options::parse_bytes(args.kv_memory).map_err(|e| InputError(format!("--kv-memory {e}")))?;
        let (model, gpu) = args.cfg.specs().map_err(|e| InputError(e.to_string()))?;
        let blocks = |tp| {
            args.cfg
                .engine_config_tp(&model, &gpu, tp)
                .map(|e| u128::from(e.gpu_blocks))
                .map_err(|e| InputError(e.to_string()))
        };
        let (base, decode) = (blocks(c.tensor_parallel_size)?.max(1), blocks(decode_tp)?);
        let decode_bytes = u64::try_from(u128::from(bytes) * decode / base).map_err(|_| {
            InputError(format!("--kv-memory {} scaled to the decode pool is too large", args.kv_memory))
        })?;
        Ok(WorkerHardware {
            decode_from: args.cfg.pd.prefill_instances,
            decode_tp,
            decode_kv_memory: decode_bytes.to_string(),
        })
    }

    /// Worker `i`'s tensor-parallel degree and `--kv-memory`.
    fn of<'a>(&'a self, i: u32, args: &'a ClusterSpec) -> (u32, &'a str) {
        if i >= self.decode_from {
            (self.decode_tp, &self.decode_kv_memory)
        } else {
            (args.cfg.cluster.tensor_parallel_size, args.kv_memory)
        }
    }

    /// A line about the decode pool, where its hardware differs.
    fn describe(&self, args: &ClusterSpec) -> Option<String> {
        (self.decode_from < args.cfg.cluster.instances && self.decode_tp != args.cfg.cluster.tensor_parallel_size).then(
            || {
                format!(
                    "decode pool workers {}..{} span {} GPUs each (the rest {}), {:.1} MiB KV arena each",
                    self.decode_from,
                    args.cfg.cluster.instances,
                    self.decode_tp,
                    args.cfg.cluster.tensor_parallel_size,
                    kvfleet_worker::options::parse_bytes(&self.decode_kv_memory).unwrap_or(0) as f64 / (1 << 20) as f64
                )
            },
        )
    }
}

/// A line saying so when the workers' real KV arenas hold fewer (or more) blocks than the config
/// sizes an instance at: the emulator runs the arena's capacity, the simulator the config's.
fn capacity_note(args: &ClusterSpec) -> anyhow::Result<Option<String>> {
    let bytes =
        kvfleet_worker::options::parse_bytes(args.kv_memory).map_err(|e| InputError(format!("--kv-memory {e}")))?;
    let (model, gpu) = args.cfg.specs().map_err(|e| InputError(e.to_string()))?;
    let config = args.cfg.engine_config(&model, &gpu).map_err(|e| InputError(e.to_string()))?;
    let block = config.block_bytes();
    let arena_blocks = bytes / block.max(1);
    if arena_blocks == 0 {
        // Said here, before any process starts (each worker would refuse it at start-up).
        return Err(InputError(format!(
            "--kv-memory {}: {bytes} bytes hold no KV block ({block} bytes: {} tokens of {})",
            args.kv_memory, config.block_size, model.name
        ))
        .into());
    }
    let config_blocks = u64::from(config.gpu_blocks);
    if arena_blocks.abs_diff(config_blocks) * 100 <= config_blocks {
        return Ok(None);
    }
    Ok(Some(format!(
        "capacity    each worker's KV arena (--kv-memory {}) holds {arena_blocks} blocks of {:.1} MiB, but the \
         config sizes an instance at {config_blocks} ({:.1} GB): the emulator runs the arena's capacity, {:.0} % of \
         the config's (match them with --kv-memory or [cluster] kv_cache_gb, as `kvfleet bench parity` does)",
        args.kv_memory,
        block as f64 / (1 << 20) as f64,
        (config_blocks * block) as f64 / 1e9,
        arena_blocks as f64 * 100.0 / config_blocks as f64
    )))
}

/// This host's memory, bytes: RAM and swap (`/proc/meminfo`; `None` where it cannot be read).
fn host_memory() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    host_memory_of(&text)
}

fn host_memory_of(meminfo: &str) -> Option<(u64, u64)> {
    let field = |name: &str| {
        meminfo.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix(':')?;
            let kib: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
            kib.checked_mul(1024)
        })
    };
    Some((field("MemTotal")?, field("SwapTotal").unwrap_or(0)))
}

/// Refuses arenas no worker on this host could map (one worker's KV and CPU pools beyond its RAM
/// and swap: each worker would fail at start-up), and says so when all the workers' arenas
/// together exceed its RAM (they are touched as requests fill them: a full run would swap or be
/// killed).
fn memory_check(args: &ClusterSpec, hardware: &WorkerHardware, host: (u64, u64)) -> anyhow::Result<Option<String>> {
    let parse = |flag: &str, text: &str| {
        kvfleet_worker::options::parse_bytes(text).map_err(|e| InputError(format!("{flag} {e}")))
    };
    let cpu = parse("--cpu-memory", args.cpu_memory)?;
    let mut total: u128 = 0;
    let mut largest = 0u64;
    for i in 0..args.cfg.cluster.instances {
        let kv = parse("--kv-memory", hardware.of(i, args).1)?;
        let worker = kv.saturating_add(cpu);
        largest = largest.max(worker);
        total += u128::from(worker);
    }
    let (ram, swap) = host;
    let gib = |b: u128| b as f64 / (1u64 << 30) as f64;
    if largest > ram.saturating_add(swap) {
        return Err(InputError(format!(
            "--kv-memory {} with --cpu-memory {}: {:.1} GiB per worker is more than this host's memory \
             ({:.1} GiB RAM, {:.1} GiB swap); no worker could map its arena",
            args.kv_memory,
            args.cpu_memory,
            gib(u128::from(largest)),
            gib(u128::from(ram)),
            gib(u128::from(swap))
        ))
        .into());
    }
    Ok((total > u128::from(ram) && args.kv_fill == "full").then(|| {
        format!(
            "memory      the {} workers' arenas come to {:.1} GiB against this host's {:.1} GiB of RAM: a run \
             that fills them will swap or be killed (smaller --kv-memory / --cpu-memory, or --kv-fill stamp)",
            args.cfg.cluster.instances,
            gib(total),
            gib(u128::from(ram))
        )
    }))
}

/// Start everything `args` asks for into `cluster` (which stops what was started when dropped,
/// also after an error), and wait until every worker is registered with the leader.
pub fn start(args: &ClusterSpec, rt: &tokio::runtime::Runtime, cluster: &mut Cluster) -> anyhow::Result<Started> {
    let coordinator_bin = sibling_binary("kvfleet-coordinator")?;
    let worker_bin = sibling_binary("kvfleet-worker")?;
    let logs = args.out.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let epoch_unix_ns = args.clock.epoch_unix_ns;
    let hardware = WorkerHardware::new(args)?;
    if let Some(note) = host_memory().map(|host| memory_check(args, &hardware, host)).transpose()?.flatten() {
        say!("{note}");
    }
    if let Some(note) = capacity_note(args)? {
        say!("{note}");
    }
    // The control plane's certificates (mutual TLS), then etcd or the embedded store.
    let pki = Pki::new(args)?;
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
        // Mutual TLS from the cluster CA: etcd refuses clients (and peers) without a cluster
        // certificate; plain http only with --plaintext.
        let tls = pki.as_ref().map(Pki::etcd_server).transpose()?;
        let mut spec = EtcdSpec { own_group: args.own_groups, tls, ..EtcdSpec::new(&bin, &dir)? };
        let proc = spec.launch(Duration::from_secs(30))?;
        cluster.etcd = Some((proc, spec.url()));
        let auth = if spec.tls.is_some() { "client-certificate TLS" } else { "plain http, no auth" };
        cluster.etcd_spec = Some(spec);
        say!("etcd        {} ({auth})", cluster.etcd.as_ref().map_or("", |e| e.1.as_str()));
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
    } else if let Some(url) = args.otlp_endpoint {
        say!("traces      exported to {url}");
        Some(url.to_string())
    } else {
        let exe = std::env::current_exe().context("locating the kvfleet binary")?;
        let file = args.out.join("traces.jsonl");
        let _ = std::fs::remove_file(&file);
        let a = ["traces", "collect", "--listen", "127.0.0.1:0", "--out"].map(String::from);
        let mut a = a.to_vec();
        a.push(file.display().to_string());
        let sink_log = logs.join("trace-sink.log");
        let p = Proc::spawn_with("trace-sink", &exe, &a, &sink_log, Some(Duration::from_secs(30)), args.own_groups)?;
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
            args.instance_policy.to_string(),
            "--model".into(),
            args.cfg.cluster.model.clone(),
            "--headroom-blocks".into(),
            args.cfg.scheduler.instance.headroom_blocks.to_string(),
            "--alg2-tie-break".into(),
            serde_name(&args.cfg.scheduler.instance.alg2_tie_break),
            "--prefix-index".into(),
            args.cfg.scheduler.instance.prefix_index.name().into(),
            "--epoch-unix-ns".into(),
            epoch_unix_ns.to_string(),
            "--time-dilation".into(),
            args.clock.dilation.to_string(),
            // What Arrow's and cache-aware's profiles measure, and the link cache-aware weighs
            // (the config's `[link]`, as the simulator's).
            "--gpu".into(),
            args.cfg.cluster.gpu.clone(),
            "--timing".into(),
            args.cfg.cluster.timing.clone(),
            "--tensor-parallel-size".into(),
            args.cfg.cluster.tensor_parallel_size.to_string(),
            "--decode-tensor-parallel-size".into(),
            hardware.decode_tp.to_string(),
            "--placement-link-gbps".into(),
            args.cfg.link.bandwidth_gbps.to_string(),
            "--placement-link-latency-us".into(),
            args.cfg.link.latency_us.to_string(),
            "--fetch-threshold".into(),
            args.cfg.scheduler.instance.fetch_threshold.to_string(),
        ];
        if args.cfg.scheduler.instance.demand_aware_memory {
            a.push("--demand-aware-memory".into());
        }
        if !args.cfg.pd.is_off() {
            // The split and the policy; Arrow profiles the workers' timing model.
            let pd = serde_json::to_string(&args.cfg.pd).context("[pd] as JSON")?;
            a.extend(["--pd".into(), pd]);
        }
        if let Some(u) = &etcd_url {
            a.extend(["--etcd".into(), u.clone()]);
            a.extend(Pki::etcd_client_args(pki.as_ref(), &format!("coordinator-{i}")));
        }
        a.extend(otlp_args.iter().cloned());
        // Its /metrics and the OpenAI API: where asked (the first coordinator), else a free
        // loopback port (scraped at the end).
        // (port 0: it binds any free port and prints it, read below).
        let http = match (i, args.http_listen) {
            (0, Some(addr)) => addr.to_string(),
            _ => "127.0.0.1:0".to_string(),
        };
        a.extend(["--http-listen".into(), http]);
        a.extend(Pki::issue(pki.as_ref(), kvfleet_pki::Role::Coordinator, &format!("coordinator-{i}"))?);
        let mut p = Proc::spawn_with_env(
            &format!("coordinator-{i}"),
            &coordinator_bin,
            &a,
            &[("KVFLEET_API_KEY", args.api_key)],
            &logs.join(format!("coordinator-{i}.log")),
            Some(Duration::from_secs(30)),
            args.own_groups,
        )?;
        let http = p.announced("http on ", "--http-listen", Duration::from_secs(30))?;
        metric_pages.push((format!("coordinator-{i}"), http));
        say!("coordinator {} (pid {})", p.addr()?, p.pid());
        cluster.coordinators.push(p);
    }
    let coord_addrs: Vec<String> = cluster.coordinators.iter().filter_map(|p| p.addr.clone()).collect();
    let finder = LeaderFinder::new(coord_addrs.clone(), client_tls.clone());
    let (_, status) = rt.block_on(finder.leader(Duration::from_secs(30))).context("waiting for a leader")?;
    say!("leader      {} (store: {})", status.leader, status.store);
    for i in 0..args.cfg.cluster.instances {
        let (tp, kv_memory) = hardware.of(i, args);
        let mut a = vec![
            "--instance".to_string(),
            i.to_string(),
            "--model".into(),
            args.cfg.cluster.model.clone(),
            "--gpu".into(),
            args.cfg.cluster.gpu.clone(),
            "--timing".into(),
            args.cfg.cluster.timing.clone(),
            "--tensor-parallel-size".into(),
            tp.to_string(),
            "--scheduler".into(),
            args.intra.to_string(),
            "--quantum".into(),
            args.cfg.scheduler.intra.quantum_tokens.to_string(),
            "--demotion-tokens".into(),
            args.cfg.scheduler.intra.demotion_tokens.to_string(),
            "--demotion-basis".into(),
            serde_name(&args.cfg.scheduler.intra.demotion_basis),
            "--admission".into(),
            serde_name(&args.cfg.scheduler.intra.admission),
            "--tpot-ms".into(),
            (args.cfg.slo.tpot_s * 1e3).to_string(),
            "--block-size".into(),
            args.cfg.cluster.block_size.to_string(),
            "--max-num-seqs".into(),
            args.cfg.cluster.max_num_seqs.to_string(),
            "--kv-memory".into(),
            kv_memory.to_string(),
            "--cpu-memory".into(),
            args.cpu_memory.to_string(),
            "--kv-fill".into(),
            args.kv_fill.to_string(),
            "--epoch-unix-ns".into(),
            epoch_unix_ns.to_string(),
            "--time-dilation".into(),
            args.clock.dilation.to_string(),
            "--load-interval-ms".into(),
            "20".into(),
            // The live-migration knobs of the config's `[migration]`, as the simulator uses them.
            "--stop-copy-blocks".into(),
            args.cfg.migration.stop_copy_blocks.to_string(),
            "--stop-copy-ms".into(),
            args.cfg.migration.stop_copy_ms.to_string(),
            "--max-stages".into(),
            args.cfg.migration.max_stages.to_string(),
            "--migration-timeout-ms".into(),
            (args.cfg.migration.timeout_ms.ceil() as u64).to_string(), // ≥ 1 ms (the worker takes whole ms, > 0)
        ];
        if args.cfg.scheduler.intra.boundary_hold {
            a.push("--boundary-hold".into());
        }
        if args.cfg.cluster.prefix_caching {
            a.push("--prefix-caching".into());
        }
        if let Some(s) = args.cfg.scheduler.intra.ttfat_starvation_s {
            a.extend(["--ttfat-starvation-s".into(), s.to_string()]);
        }
        if args.cfg.pd.overlap == kvfleet_sim::config::Overlap::Layer {
            let groups = kvfleet_sim::config::LAYER_GROUPS;
            a.extend(["--handoff-layer-groups".into(), groups.to_string()]);
        }
        if let Some(c) = args.cfg.scheduler.intra.chunked_prefill_tokens {
            a.extend(["--chunked-prefill-tokens".into(), c.to_string()]);
        }
        if args.cfg.migration.corrupt_sends_from.contains(&i) {
            a.push("--corrupt-sent-blocks".into());
        }
        if args.cfg.pd.policy == kvfleet_sim::config::PdPolicy::Arrow && !args.cfg.pd.is_off() {
            // Each worker measures Arrow's profile of itself on its own timing (live kernels under
            // `timing = "cuda"`, cached on disk) and registers it; the leader weighs it with that.
            a.extend(["--arrow-slo-tpot-s".into(), args.cfg.pd.arrow.slo_tpot_s.to_string()]);
        }
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
        // Any free port, printed after its address (a port picked here could be taken first).
        a.extend(["--metrics-listen".into(), "127.0.0.1:0".into()]);
        a.extend(Pki::issue(pki.as_ref(), kvfleet_pki::Role::Worker, &format!("worker-{i}"))?);
        match &etcd_url {
            Some(u) => {
                a.extend(["--etcd".into(), u.clone()]);
                a.extend(Pki::etcd_client_args(pki.as_ref(), &format!("worker-{i}")));
            }
            None => a.extend(["--coordinator".into(), coord_addrs.join(",")]),
        }
        let mut p = Proc::spawn_with(
            &format!("worker-{i}"),
            &worker_bin,
            &a,
            &logs.join(format!("worker-{i}.log")),
            Some(Duration::from_secs(30)),
            args.own_groups,
        )?;
        metric_pages
            .push((format!("worker-{i}"), p.announced("metrics on ", "--metrics-listen", Duration::from_secs(30))?));
        cluster.workers.push(p);
    }
    // All workers registered and visible to the leader.
    let want = args.cfg.cluster.instances as usize;
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
    say!("workers     {want} registered ({} scheduler, {} KV arena each)", args.intra, args.kv_memory);
    if let Some(line) = hardware.describe(args) {
        say!("{line}");
    }
    // Every child's pid, so callers (and tests) can check that none outlives `kvfleet up`.
    let pids: Vec<String> = cluster.processes().map(|p| format!("{} {}", p.pid(), p.name)).collect();
    std::fs::write(args.out.join("pids.txt"), pids.join("\n") + "\n")?;

    let etcd_options = Pki::etcd_options(pki.as_ref(), "client");
    Ok(Started { finder, metric_pages, etcd_url, etcd_options, logs })
}

/// A config enum's name as its TOML spells it (the workers' and coordinators' flags take the same
/// names).
fn serde_name<T: serde::Serialize>(value: &T) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(s)) => s,
        other => other.map(|v| v.to_string()).unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec<'a>(cfg: &'a SimConfig, kv: &'a str, cpu: &'a str, fill: &'a str) -> ClusterSpec<'a> {
        ClusterSpec {
            cfg,
            intra: "fcfs",
            instance_policy: "least-kv",
            out: Path::new("."),
            coordinators: 1,
            no_etcd: true,
            plaintext: true,
            ca_dir: None,
            otlp_endpoint: None,
            no_traces: true,
            kv_memory: kv,
            cpu_memory: cpu,
            kv_fill: fill,
            link_gbps: None,
            link_latency_us: 0.0,
            no_prefault: false,
            http_listen: None,
            api_key: None,
            clock: ClusterTime { epoch_unix_ns: 0, dilation: kvfleet_core::Dilation::NONE },
            own_groups: false,
        }
    }

    #[test]
    fn arenas_beyond_the_host_are_refused_and_beyond_its_ram_noted() {
        let cfg = SimConfig::parse(crate::up::DEFAULT_CONFIG, "<embedded default>").unwrap();
        let n = u64::from(cfg.cluster.instances);
        let gib = 1u64 << 30;
        let check = |kv: &str, cpu: &str, fill: &str, host: (u64, u64)| {
            let args = spec(&cfg, kv, cpu, fill);
            memory_check(&args, &WorkerHardware::new(&args).unwrap(), host)
        };
        // One worker's 8 + 1 GiB: beyond 8 GiB of RAM and no swap, refused; with 2 GiB of swap, not.
        let err = check("8GiB", "1GiB", "full", (8 * gib, 0)).unwrap_err().to_string();
        assert!(err.contains("--kv-memory 8GiB") && err.contains("9.0 GiB per worker"), "{err}");
        assert!(check("8GiB", "1GiB", "full", (8 * gib, 2 * gib)).is_ok());
        // All workers' arenas beyond the RAM: a note while the fill touches every byte, none with stamps.
        let ram = 3 * n * gib / 2;
        let note = check("1GiB", "1GiB", "full", (ram, 0)).unwrap().expect("a note");
        assert!(note.contains(&format!("the {n} workers' arenas come to {:.1} GiB", 2.0 * n as f64)), "{note}");
        assert_eq!(check("1GiB", "1GiB", "stamp", (ram, 0)).unwrap(), None);
        assert_eq!(check("1GiB", "1GiB", "full", (2 * n * gib, 0)).unwrap(), None);
    }

    #[test]
    fn host_memory_reads_ram_and_swap() {
        let text = "MemTotal:       24608156 kB\nMemFree:  100 kB\nSwapTotal:       1048576 kB\n";
        assert_eq!(host_memory_of(text), Some((24608156 * 1024, 1 << 30)));
        assert_eq!(host_memory_of("MemTotal: 1024 kB\n"), Some((1 << 20, 0)));
        assert_eq!(host_memory_of("SwapTotal: 1024 kB\n"), None);
    }

    #[test]
    fn auto_dilation_keeps_the_shaped_link_under_the_transport() {
        // 100 Gbit/s on a host whose QUIC does 10: 100 / (0.4 × 10) = 25.
        assert_eq!(auto_dilation(100.0, 10.0).factor(), 25.0);
        // A link the host carries as it is: real time.
        assert_eq!(auto_dilation(2.0, 10.0).factor(), 1.0);
        // Rounded up to a whole factor, never past the largest.
        assert_eq!(auto_dilation(400.0, 21.0).factor(), 48.0);
        assert_eq!(auto_dilation(1e9, 0.0).factor(), Dilation::MAX);
        assert_eq!("auto".parse::<DilationArg>().unwrap(), DilationArg::Auto);
        assert_eq!("3".parse::<DilationArg>().unwrap(), DilationArg::Fixed(Dilation::new(3.0).unwrap()));
        assert!("0.5".parse::<DilationArg>().is_err());
    }
}
