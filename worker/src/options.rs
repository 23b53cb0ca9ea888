//! The worker's options (clap flags, also the library's configuration) and how they size the
//! instance: model/GPU specs → KV bytes per token → block counts of the scaled-down arena.

use crate::arena::{ArenaLayout, KvFill};
use kvfleet_core::engine::sched::{DemotionBasis, SchedulerParams, WaitingAdmission};
use kvfleet_core::engine::{sizing, EngineConfig};
use kvfleet_core::spec::{GpuSpec, ModelSpec};
use kvfleet_core::{Dilation, TimeSpan};
use kvfleet_netmodel::migration::MigrationParams;
use std::net::SocketAddr;
use std::path::PathBuf;

/// One emulated GPU instance. Every flag has a default, so `kvfleet-worker` alone serves an
/// R1-Distill-Qwen-32B instance on an H100 (scaled to a 2 GiB arena) on a free loopback port.
#[derive(Clone, Debug, clap::Parser)]
#[command(name = "kvfleet-worker", version, about = "One emulated GPU serving instance of a kvfleet cluster")]
pub struct WorkerOptions {
    /// Address to serve gRPC on. Port 0 picks a free port; the bound address is printed as the
    /// first stdout line, `listening on ADDR`.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Address other processes use to reach this worker (default: the bound address). `auto`:
    /// this host's IP on the route to etcd (else the first `--coordinator`) with the `--listen`
    /// port, for replicas that share one command line (docker compose `--scale`, swarm, k8s).
    #[arg(long)]
    pub advertise: Option<String>,
    /// Instance id within the cluster (dense from 0), or `auto`: claim the lowest free number in
    /// etcd (atomically, under the registration's lease; needs `--etcd`).
    #[arg(long, default_value = "0", value_parser = parse_instance)]
    pub instance: u32,
    /// Model: a built-in name (`r1-distill-qwen-32b`, `llama-3-8b`, `qwen-7b`) or a model TOML path.
    #[arg(long, default_value = "r1-distill-qwen-32b")]
    pub model: String,
    /// GPU: a built-in name (`h100-96gb`, `h100-80gb`, `a100-80gb`, `v100-32gb`, `l40s`) or a TOML path.
    #[arg(long, default_value = "h100-96gb")]
    pub gpu: String,
    /// Timing model: `auto` (the measured profile where one exists for model and GPU, else
    /// analytic), `profile`, `analytic`, or `cuda` (live kernels on a local GPU; needs a build
    /// with `--features cuda`, settings from `KVFLEET_CUDA_*` variables).
    #[arg(long, default_value = "auto")]
    pub timing: String,
    /// Directory with `decode.csv`, `prefill.csv`, `copy.csv` for `profile` timing of another GPU/model.
    #[arg(long)]
    pub profile_dir: Option<PathBuf>,
    /// Measure Arrow's profile of this instance on its own timing model at start-up (prefill time
    /// per prompt length, and the most decode batch tokens within this SLO_TPOT, seconds) and
    /// register it: the leader's Arrow then weighs the instance with it (`kvfleet up` passes
    /// `[pd.arrow] slo_tpot_s` under `policy = "arrow"`).
    #[arg(long, value_parser = parse_positive_seconds)]
    pub arrow_slo_tpot_s: Option<f64>,
    /// Where measured Arrow profiles are cached, one file per model, GPU, TP, timing and SLO
    /// (default `$XDG_CACHE_HOME/kvfleet/arrow-profiles` or `~/.cache/kvfleet/arrow-profiles`).
    #[arg(long)]
    pub profile_cache: Option<PathBuf>,
    /// GPUs this instance spans (tensor parallelism): the analytic timing model splits each
    /// iteration across them and adds their all-reduces (measured profiles are one GPU's).
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: u32,
    /// Intra-instance scheduler: `fcfs`, `rr` or `pascal`.
    #[arg(long, default_value = "pascal", value_parser = ["fcfs", "rr", "pascal"])]
    pub scheduler: String,
    /// Round-robin token quantum (`rr`, and each queue of `pascal`).
    #[arg(long, default_value_t = 500)]
    pub quantum: u32,
    /// `pascal`: a reasoning request longer than this many tokens is demoted to the low queue.
    #[arg(long, default_value_t = 5000)]
    pub demotion_tokens: u32,
    /// `pascal`: what `--demotion-tokens` counts: `reasoning` tokens generated or `kv` footprint.
    #[arg(long, default_value = "reasoning", value_parser = ["reasoning", "kv"])]
    pub demotion_basis: String,
    /// Fidelity switch: a request between `</think>` and its first answer token keeps its GPU
    /// blocks against waiting requests (default: it may be preempted for them).
    #[arg(long)]
    pub boundary_hold: bool,
    /// Fidelity switch: `preempt` (waiting requests fit by priority and may preempt resident
    /// ones) or `free-memory` (vLLM: waiting requests only into free memory).
    #[arg(long, default_value = "preempt", value_parser = ["preempt", "free-memory"])]
    pub admission: String,
    /// Fidelity switch: t_i also fails while an answering request has waited longer than this
    /// many seconds after `</think>` for its first answer token (default: token pacers only).
    #[arg(long)]
    pub ttfat_starvation_s: Option<f64>,
    /// Chunked prefill: each iteration runs its decodes first, then prompt chunks up to this
    /// many tokens in all (default: whole prompts).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub chunked_prefill_tokens: Option<u32>,
    /// On a prefill instance, a handoff may start when a prefill's first iteration starts and
    /// follow it layer by layer: each block leaves in this many layer groups, each as soon as
    /// the iteration computing it has gone through those layers (`[pd] overlap = "layer"`,
    /// which uses 4). 1: blocks leave whole (`"chunk"`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub handoff_layer_groups: u32,
    /// Token pacer pace: the user's expected time per output token, in ms.
    #[arg(long, default_value_t = 100.0)]
    pub tpot_ms: f64,
    /// GPU KV pool size (real memory): bytes, or with a unit (`512MiB`, `2GiB`, `1.5GB`).
    #[arg(long = "kv-memory", default_value = "2GiB", value_parser = parse_bytes)]
    pub kv_memory_bytes: u64,
    /// CPU offload pool size (real memory); 0 makes preemption drop KV and recompute.
    #[arg(long = "cpu-memory", default_value = "2GiB", value_parser = parse_bytes)]
    pub cpu_memory_bytes: u64,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Most sequences in one iteration (vLLM `max_num_seqs`).
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: u32,
    /// Share the KV blocks of equal prompt content between requests (vLLM's automatic prefix
    /// caching; only requests whose spec carries content ids have any), and stream the cache's
    /// changes to the leader.
    #[arg(long)]
    pub prefix_caching: bool,
    /// Most prompt tokens prefilled in one iteration (one prompt is always allowed).
    #[arg(long, default_value_t = 8192)]
    pub max_batched_tokens: u32,
    /// Touch every page of the arena at start (slower start, all memory resident). Without it, the
    /// first touch of each page faults inside the engine loop; with `--kv-fill full` that shows
    /// as timer lateness (measured: p99 143 ms without, 0.16 ms with, 16 requests, 256 MiB pools).
    #[arg(long)]
    pub prefault: bool,
    /// How much of each token's KV slot is written: `full`, or `stamp` (first 64 bytes; for
    /// hosts running many workers).
    #[arg(long, value_enum, default_value_t = KvFill::Full)]
    pub kv_fill: KvFill,
    /// The cluster epoch as Unix nanoseconds: cluster time 0 (default: this worker's start).
    #[arg(long)]
    pub epoch_unix_ns: Option<u64>,
    /// Time dilation: one emulated second lasts this many real seconds (iterations, migration
    /// timers, link rate and latency all stretched; every time this worker reports is emulated).
    /// Default: the cluster record's (with `--etcd`), else 1 (real time).
    #[arg(long)]
    pub time_dilation: Option<Dilation>,
    /// Period of the load reports appended to the event log, in ms.
    #[arg(long, default_value_t = 100)]
    pub load_interval_ms: u64,
    /// Most unacknowledged token/load events held; beyond it the oldest are dropped (finished
    /// records and phase boundaries never are).
    #[arg(long, default_value_t = 1_000_000)]
    pub event_log_cap: usize,
    /// On SIGTERM/SIGINT/Shutdown: keep running this long (ms) for requests to finish before
    /// exiting; what is still running then is reported unfinished.
    #[arg(long, default_value_t = 0)]
    pub drain_grace_ms: u64,
    /// Verify the KV of every offloaded/reloaded request after the copy (costs memory bandwidth;
    /// migrations out are always checked).
    #[arg(long)]
    pub verify_kv: bool,
    /// A fault, to exercise the checksum check: every KV block this worker migrates out carries a
    /// checksum its bytes do not match, as if they were corrupted on the way, so each move out of
    /// it aborts at its target (`[migration] corrupt_sends_from` in `kvfleet up`).
    #[arg(long)]
    pub corrupt_sent_blocks: bool,
    /// Address to receive live KV migrations on (QUIC/UDP; mutual TLS with the cluster
    /// certificate). Default: the `--listen` IP, any free port. Needs a cluster certificate: with
    /// `--plaintext` there is no live migration (the coordinator re-materialises KV instead).
    #[arg(long)]
    pub kv_listen: Option<SocketAddr>,
    /// Address other workers send migrations to (default: `--advertise`'s host, else the bound
    /// address). `auto`: this host's IP as for `--advertise auto`, with the `--kv-listen` port.
    #[arg(long)]
    pub kv_advertise: Option<String>,
    /// Parallel QUIC data streams per migration.
    #[arg(long, default_value_t = 4)]
    pub migration_streams: usize,
    /// Pipelined stop-and-copy: pause for the final copy once fewer than this many new full
    /// blocks remain. (The migration defaults are `MigrationParams::default()`'s, the simulator's.)
    #[arg(long, default_value_t = MigrationParams::default().stop_copy_blocks)]
    pub stop_copy_blocks: u32,
    /// Time-based stop-and-copy (0: off, the block count decides): once a live stage measured
    /// the link, pause when the new blocks would copy within this many milliseconds at its
    /// goodput — a downtime budget that is right on any link, unlike a block count.
    #[arg(long, default_value_t = MigrationParams::default().stop_copy_after.map_or(0.0, |d| d.as_millis_f64()))]
    pub stop_copy_ms: f64,
    /// Pipelined stop-and-copy: most live copy stages before the final one (0: plain stop-and-copy).
    #[arg(long, default_value_t = MigrationParams::default().max_stages)]
    pub max_stages: u32,
    /// Deadline of one migration, ms (then it aborts and the request carries on here).
    #[arg(long, default_value_t = MigrationParams::default().timeout.0 / 1_000_000)]
    pub migration_timeout_ms: u64,
    /// Shape outgoing migration links to this rate (Gbit/s), to emulate a fabric slower than
    /// this host's loopback (e.g. 100 for 100 GbE). Default: unshaped.
    #[arg(long)]
    pub link_gbps: Option<f64>,
    /// Added one-way latency on outgoing migration links, µs (with or without `--link-gbps`).
    #[arg(long, default_value_t = 0.0)]
    pub link_latency_us: f64,
    /// Serve Prometheus metrics (`GET /metrics`, plain HTTP) on this address (port 0: any free
    /// port, printed as `metrics on ADDR` on stdout after the `listening on` line).
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    /// The control plane's mutual TLS (cluster certificate), or `--plaintext`.
    #[command(flatten)]
    pub tls: kvfleet_pki::TlsArgs,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        <WorkerOptions as clap::Parser>::parse_from(["kvfleet-worker"])
    }
}

/// An invalid flag or specification; the message names the flag.
#[derive(Debug, thiserror::Error)]
pub enum OptionsError {
    /// The model specification could not be loaded.
    #[error("`--model`: {0}")]
    Model(kvfleet_core::spec::SpecError),
    /// The GPU specification could not be loaded.
    #[error("`--gpu`: {0}")]
    Gpu(kvfleet_core::spec::SpecError),
    /// The timing model could not be built (unknown name, missing or unreadable profile).
    #[error("`--timing`: {0}")]
    Timing(kvfleet_core::timing::TimingError),
    /// Unknown scheduler or invalid scheduler parameters.
    #[error("`--scheduler`: {0}")]
    Scheduler(kvfleet_core::engine::sched::SchedulerError),
    /// A flag with a value out of range or unresolved (`auto`), or `--timing cuda` unavailable.
    #[error("`--{flag}`: {message}")]
    Invalid {
        /// The flag's name, without `--`.
        flag: &'static str,
        /// What is wrong with its value.
        message: String,
    },
    /// Invalid live-migration tuning (`--stop-copy-ms`, stage and timeout flags).
    #[error("{0}")]
    Migration(String),
}

/// Everything the options decide about the instance.
#[derive(Debug)]
pub struct InstanceShape {
    /// The served model (`--model`); its architecture fixes the KV bytes per token.
    pub model: ModelSpec,
    /// The emulated GPU (`--gpu`).
    pub gpu: GpuSpec,
    /// The engine's sizing: pools in blocks, batch limits, TPOT target.
    pub engine: EngineConfig,
    /// The KV arena's shape (same block counts as the engine).
    pub layout: ArenaLayout,
    /// Scheduler tuning (quantum, demotion threshold and basis).
    pub scheduler: SchedulerParams,
}

impl WorkerOptions {
    /// Resolve specs and size the pools; errors name the flag.
    pub fn shape(&self) -> Result<InstanceShape, OptionsError> {
        let invalid = |flag, message: String| OptionsError::Invalid { flag, message };
        if self.instance == AUTO_INSTANCE {
            return Err(invalid("instance", "`auto` is resolved by claiming a number in etcd: it needs --etcd".into()));
        }
        for (flag, value) in [("advertise", &self.advertise), ("kv-advertise", &self.kv_advertise)] {
            if value.as_deref() == Some(AUTO) {
                return Err(invalid(flag, "`auto` must be resolved to an address before the worker starts".into()));
            }
        }
        let model = ModelSpec::load(&self.model).map_err(OptionsError::Model)?;
        let gpu = GpuSpec::load(&self.gpu).map_err(OptionsError::Gpu)?;
        for (flag, v) in [
            ("block-size", self.block_size),
            ("max-num-seqs", self.max_num_seqs),
            ("max-batched-tokens", self.max_batched_tokens),
        ] {
            if v == 0 {
                return Err(invalid(flag, "must be > 0".into()));
            }
        }
        if !(self.tpot_ms.is_finite() && self.tpot_ms > 0.0) {
            return Err(invalid("tpot-ms", format!("must be a positive number of ms, got {}", self.tpot_ms)));
        }
        if self.load_interval_ms == 0 {
            return Err(invalid("load-interval-ms", "must be > 0".into()));
        }
        if !(1..=MAX_MIGRATION_STREAMS).contains(&self.migration_streams) {
            let got = self.migration_streams;
            return Err(invalid("migration-streams", format!("must be in 1..={MAX_MIGRATION_STREAMS}, got {got}")));
        }
        if self.event_log_cap == 0 {
            return Err(invalid("event-log-cap", "must be > 0 (0 would drop every token and load event)".into()));
        }
        if !(1..=MAX_TENSOR_PARALLEL).contains(&self.tensor_parallel_size) {
            let got = self.tensor_parallel_size;
            return Err(invalid(
                "tensor-parallel-size",
                format!("GPUs per instance must be in 1..={MAX_TENSOR_PARALLEL}, got {got}"),
            ));
        }
        if let Some(g) = self.link_gbps.filter(|g| !(g.is_finite() && *g > 0.0)) {
            return Err(invalid("link-gbps", format!("must be a positive number, got {g}")));
        }
        if !(self.link_latency_us.is_finite() && self.link_latency_us >= 0.0) {
            return Err(invalid("link-latency-us", format!("must be ≥ 0, got {}", self.link_latency_us)));
        }
        let kv_bytes_per_token = model.kv_bytes_per_token();
        let block_bytes = sizing::block_bytes(self.block_size, kv_bytes_per_token)
            .map_err(|e| invalid("block-size", e.to_string()))?;
        let gpu_blocks = sizing::gpu_pool_blocks(self.kv_memory_bytes, block_bytes).map_err(|e| {
            invalid("kv-memory", format!("{e} ({} tokens × {kv_bytes_per_token} B of {})", self.block_size, model.name))
        })?;
        let cpu_blocks = sizing::pool_blocks(self.cpu_memory_bytes, block_bytes)
            .map_err(|e| invalid("cpu-memory", e.to_string()))?;
        // The migration flags, checked here whether or not this worker migrates (with
        // `--plaintext` it never does): a bad one is refused at start, not at a first migration.
        self.migration_params(self.block_size, block_bytes)?;
        let demotion_basis = match self.demotion_basis.as_str() {
            "reasoning" => DemotionBasis::Reasoning,
            "kv" => DemotionBasis::Kv,
            other => return Err(invalid("demotion-basis", format!("`{other}` is not `reasoning` or `kv`"))),
        };
        let admission = match self.admission.as_str() {
            "preempt" => WaitingAdmission::Preempt,
            "free-memory" => WaitingAdmission::FreeMemory,
            other => return Err(invalid("admission", format!("`{other}` is not `preempt` or `free-memory`"))),
        };
        let scheduler = SchedulerParams {
            quantum_tokens: self.quantum,
            demotion_tokens: self.demotion_tokens,
            demotion_basis,
            boundary_hold: self.boundary_hold,
            admission,
            ttfat_starvation_s: self.ttfat_starvation_s,
            chunked_prefill_tokens: self.chunked_prefill_tokens,
        };
        scheduler.switches().map_err(|e| invalid("ttfat-starvation-s", e.to_string()))?;
        let engine = EngineConfig {
            prefix_caching: self.prefix_caching,
            block_size: self.block_size,
            gpu_blocks,
            cpu_blocks,
            max_num_seqs: self.max_num_seqs,
            max_batched_tokens: self.max_batched_tokens,
            kv_bytes_per_token,
            tpot: TimeSpan::from_millis_f64(self.tpot_ms),
        };
        let layout = ArenaLayout { block_size: self.block_size, kv_bytes_per_token, gpu_blocks, cpu_blocks };
        Ok(InstanceShape { model, gpu, engine, layout, scheduler })
    }

    /// The live-migration tuning for blocks of `block_size` tokens and `block_bytes` bytes:
    /// `MigrationParams::new`'s defaults, overridden by the migration flags.
    pub fn migration_params(&self, block_size: u32, block_bytes: u64) -> Result<MigrationParams, OptionsError> {
        let mut params = MigrationParams::new(block_size, block_bytes);
        params.stop_copy_blocks = self.stop_copy_blocks;
        params.max_stages = self.max_stages;
        if self.stop_copy_ms < 0.0 || !self.stop_copy_ms.is_finite() {
            return Err(OptionsError::Migration(format!("--stop-copy-ms must be ≥ 0, got {}", self.stop_copy_ms)));
        }
        params.stop_copy_after = (self.stop_copy_ms > 0.0).then(|| TimeSpan::from_millis_f64(self.stop_copy_ms));
        if self.migration_timeout_ms == 0 {
            return Err(OptionsError::Migration("--migration-timeout-ms must be > 0".into()));
        }
        params.timeout = TimeSpan(self.migration_timeout_ms.saturating_mul(1_000_000));
        params.validate().map_err(|e| OptionsError::Migration(e.to_string()))?;
        Ok(params)
    }
}

/// Most `--migration-streams` (QUIC streams per migration).
pub const MAX_MIGRATION_STREAMS: usize = 64;
/// Most `--tensor-parallel-size` (the simulator's bound on GPUs per instance).
pub const MAX_TENSOR_PARALLEL: u32 = 64;

/// `--instance auto` before it is resolved (never a real instance: the parser refuses it as a number).
pub const AUTO_INSTANCE: u32 = u32::MAX;
/// The value of `--instance`, `--advertise` and `--kv-advertise` that asks the binary to work it out.
pub const AUTO: &str = "auto";

/// `--instance`: a number below 2^32 - 1, or `auto` ([`AUTO_INSTANCE`]).
pub fn parse_instance(text: &str) -> Result<u32, String> {
    if text.trim().eq_ignore_ascii_case(AUTO) {
        return Ok(AUTO_INSTANCE);
    }
    match text.trim().parse::<u32>() {
        Ok(n) if n != AUTO_INSTANCE => Ok(n),
        _ => Err(format!("`{text}`: expected an instance number (0, 1, ...) or `auto`")),
    }
}

/// A positive, finite number of seconds (`--arrow-slo-tpot-s`).
pub fn parse_positive_seconds(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 => Ok(s),
        _ => Err(format!("`{text}`: expected a positive number of seconds")),
    }
}

/// A byte size: a plain number of bytes, or a number with a unit — binary `KiB`/`MiB`/`GiB`/`TiB`,
/// decimal `KB`/`MB`/`GB`/`TB`, or `B` (case-insensitive).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let scale: u64 = match unit.as_str() {
        "" | "b" => 1,
        "kib" | "k" => 1 << 10,
        "mib" | "m" => 1 << 20,
        "gib" | "g" => 1 << 30,
        "tib" | "t" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(format!("`{text}`: unknown unit `{unit}` (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)")),
    };
    if num.is_empty() {
        return Err(format!("`{text}`: expected a number of bytes such as 512MiB or 2GiB"));
    }
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(scale).ok_or_else(|| format!("`{text}` is too large"));
    }
    let x: f64 = num.parse().map_err(|_| format!("`{text}`: `{num}` is not a number"))?;
    let bytes = x * scale as f64;
    if !(bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64) {
        return Err(format!("`{text}` is out of range"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn byte_sizes_from_a_table() {
        let ok: &[(&str, u64)] = &[
            ("4096", 4096),
            ("2GiB", 2 << 30),
            ("512MiB", 512 << 20),
            ("512 mib", 512 << 20),
            ("1.5GB", 1_500_000_000),
            ("0", 0),
            ("3k", 3072),
        ];
        for &(text, want) in ok {
            assert_eq!(parse_bytes(text), Ok(want), "{text}");
        }
        for bad in ["", "GiB", "2 parsecs", "1.2.3MiB", "99999999999999TiB", "-1"] {
            assert!(parse_bytes(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn auto_values_parse_and_must_be_resolved_before_start() {
        let o = WorkerOptions::parse_from(["w", "--instance", "auto", "--advertise", "auto"]);
        assert_eq!(o.instance, AUTO_INSTANCE);
        let e = o.shape().unwrap_err().to_string();
        assert!(e.contains("--instance") && e.contains("--etcd"), "{e}");
        let o = WorkerOptions::parse_from(["w", "--instance", "7", "--advertise", "auto"]);
        assert_eq!(o.instance, 7);
        assert!(o.shape().unwrap_err().to_string().contains("--advertise"));
        let o = WorkerOptions::parse_from(["w", "--kv-advertise", "auto"]);
        assert!(o.shape().unwrap_err().to_string().contains("--kv-advertise"));
        assert_eq!(WorkerOptions::parse_from(["w", "--instance", "AUTO"]).instance, AUTO_INSTANCE);
    }

    #[test]
    fn shape_scales_capacity_never_the_token() {
        let o = WorkerOptions::parse_from(["w", "--kv-memory", "256MiB", "--cpu-memory", "0"]);
        let s = o.shape().unwrap();
        assert_eq!(s.engine.kv_bytes_per_token, 256 << 10, "32B model: 256 KiB per token");
        assert_eq!(s.layout.block_bytes(), 4 << 20);
        assert_eq!((s.engine.gpu_blocks, s.engine.cpu_blocks), (64, 0));
        let d = WorkerOptions::default();
        assert_eq!((d.scheduler.as_str(), d.kv_memory_bytes, d.load_interval_ms), ("pascal", 2 << 30, 100));
    }

    #[test]
    fn migration_defaults_are_the_simulators() {
        let d = WorkerOptions::default();
        let (bs, bb) = (16, 16 * 256 * 1024);
        assert_eq!(d.migration_params(bs, bb).unwrap(), MigrationParams::new(bs, bb));
        let o = WorkerOptions::parse_from([
            "w",
            "--migration-timeout-ms",
            "2500",
            "--stop-copy-ms",
            "5",
            "--max-stages",
            "0",
        ]);
        let p = o.migration_params(bs, bb).unwrap();
        assert_eq!(
            (p.timeout, p.stop_copy_after, p.max_stages),
            (TimeSpan(2_500_000_000), Some(TimeSpan(5_000_000)), 0)
        );
        let e = WorkerOptions::parse_from(["w", "--stop-copy-ms=-1"]).migration_params(bs, bb).unwrap_err();
        assert!(e.to_string().contains("--stop-copy-ms"), "{e}");
    }

    #[test]
    fn bad_options_name_the_flag() {
        let cases: &[(&[&str], &str)] = &[
            (&["--kv-memory", "1MiB"], "--kv-memory"),
            (&["--model", "gpt-9"], "--model"),
            (&["--gpu", "tpu"], "--gpu"),
            (&["--block-size", "0"], "--block-size"),
            (&["--tpot-ms=-1"], "--tpot-ms"),
            (&["--load-interval-ms", "0"], "--load-interval-ms"),
            (&["--ttfat-starvation-s=-1"], "--ttfat-starvation-s"),
            (&["--ttfat-starvation-s", "NaN"], "--ttfat-starvation-s"),
            (&["--migration-streams", "0"], "`--migration-streams`: must be in 1..=64, got 0"),
            (&["--migration-streams", "100000"], "--migration-streams"),
            (&["--event-log-cap", "0"], "--event-log-cap"),
            (&["--migration-timeout-ms", "0"], "--migration-timeout-ms"),
            (&["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
            (&["--link-gbps", "0"], "`--link-gbps`: must be a positive number, got 0"),
            (&["--link-gbps", "NaN"], "--link-gbps"),
            (&["--link-latency-us=-5"], "--link-latency-us"),
        ];
        for &(args, want) in cases {
            let o = WorkerOptions::try_parse_from(std::iter::once("w").chain(args.iter().copied())).unwrap();
            let e = o.shape().unwrap_err().to_string();
            assert!(e.contains(want), "{args:?} → {e}");
        }
        assert!(WorkerOptions::try_parse_from(["w", "--scheduler", "sjf"]).is_err());
        assert!(WorkerOptions::try_parse_from(["w", "--instance", "first"]).is_err());
        assert!(WorkerOptions::try_parse_from(["w", "--instance", "4294967295"]).is_err());
        assert!(WorkerOptions::try_parse_from(["w", "--kv-memory", "lots"]).is_err());
    }
}
