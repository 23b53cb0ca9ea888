//! The experiment configuration (TOML) shared by `kvfleet sim` and, later, `kvfleet up`.
//!
//! Every field has a default, so a config file only states what differs from PASCAL's setup
//! (8 × H100 96 GB, 100 Gbps, DeepSeek-R1-Distill-Qwen-32B, profile timing).

pub use kvfleet_control::roles::{Overlap, PdConfig, PdPolicy};
use kvfleet_core::engine::sched::{build_scheduler, SchedulerParams, SCHEDULER_NAMES};
use kvfleet_core::engine::sizing;
use kvfleet_core::engine::EngineConfig;
use kvfleet_core::metrics::SloTargets;
use kvfleet_core::policy::registry::{policy_names, PolicyParams};
use kvfleet_core::spec::{GpuSpec, ModelSpec};
use kvfleet_core::time::TimeSpan;
use kvfleet_core::workload::WorkloadConfig;
use kvfleet_netmodel::migration::MigrationParams;
/// Layer groups a handoff following a prefill layer by layer sends each block in (`[pd] overlap = "layer"`).
pub use kvfleet_netmodel::migration::LAYER_GROUPS;
use kvfleet_netmodel::LinkParams;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Why an experiment config could not be read or used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The config is not valid TOML for a [`SimConfig`].
    #[error("invalid config {path}: {message}")]
    Parse {
        /// The file (or other origin) of the text.
        path: String,
        /// The parser's message, on one line.
        message: String,
    },
    /// A value is out of range or inconsistent; names the field.
    #[error("invalid config: {0}")]
    Invalid(String),
}

/// Most instances one experiment may have (a simulated cluster of 1,000 runs an hour of arrivals
/// in about a minute; the bound only catches typos).
pub const MAX_INSTANCES: u32 = 1 << 16;

/// Most KV blocks, GPU and CPU pools of every instance together, that one simulation keeps
/// (4 bytes of bookkeeping each: 1 GiB).
pub const MAX_CLUSTER_BLOCKS: u64 = 1 << 28;

/// A whole experiment.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimConfig {
    /// The instances: count, model, GPU, memory carving (`[cluster]`).
    pub cluster: ClusterConfig,
    /// Which schedulers run, and their knobs (`[scheduler]`).
    pub scheduler: SchedulerConfig,
    /// SLO targets (TPOT, TTFAT, QoE threshold) the summary measures attainment against (`[slo]`).
    pub slo: SloTargets,
    /// The simulated network: per-instance NIC bandwidth and latency (`[link]`).
    pub link: LinkParams,
    /// Live migration tuning (the pipelined stop-and-copy protocol's knobs).
    pub migration: MigrationConfig,
    /// Prefill/decode disaggregation (`[pd]`; off by default: every instance does both).
    #[serde(skip_serializing_if = "PdConfig::is_off")]
    pub pd: PdConfig,
    /// The requests: arrival process, length distributions, seed (`[workload]`).
    pub workload: WorkloadConfig,
    /// Optional sweep: policies × arrival rates. Without it, one run of `scheduler.policy`.
    pub sweep: Option<SweepConfig>,
    /// How the simulator runs (`[simulator]`): never what it computes.
    #[serde(skip_serializing_if = "SimulatorConfig::is_default")]
    pub simulator: SimulatorConfig,
}

/// How the simulator runs. Every setting here leaves the results byte for byte as they are.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimulatorConfig {
    /// Let an engine plan, as one event, the iterations after which it changes nothing the
    /// controller reads (a run of decodes between KV blocks, arrivals, finishes and `</think>`);
    /// `false` steps every iteration as an event of its own.
    pub leap_iterations: bool,
}

impl Default for SimulatorConfig {
    fn default() -> Self {
        SimulatorConfig { leap_iterations: true }
    }
}

impl SimulatorConfig {
    fn is_default(&self) -> bool {
        *self == SimulatorConfig::default()
    }
}

/// The instances: how many, which model on which GPU, and how their memory is carved up.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// Number of serving instances (one GPU each).
    pub instances: u32,
    /// Built-in model name (`r1-distill-qwen-32b`, `llama-3-8b`, `qwen-7b`, `qwen3-8b`, `qwen3-32b`,
    /// `llama-3.1-70b`) or a model TOML path.
    pub model: String,
    /// Built-in GPU name (`h100-96gb`, `h100-80gb`, `a100-80gb`, `v100-32gb`, `l40s`, `h20-141gb`) or
    /// a TOML path.
    pub gpu: String,
    /// Timing model: `auto` (profile where a table exists for the model, else analytic),
    /// `profile` or `analytic`.
    pub timing: String,
    /// Directory with `decode.csv`/`prefill.csv`/`copy.csv` for `profile` timing of other GPUs/models.
    pub profile_dir: Option<PathBuf>,
    /// GPUs per instance (tensor parallelism, vLLM `tensor_parallel_size`): the analytic timing
    /// model splits each iteration's work across them and adds their all-reduces; the instance's
    /// memory is theirs together. Measured profiles are one GPU's (`timing = "auto"` then takes
    /// the analytic model).
    pub tensor_parallel_size: u32,
    /// GPUs per instance of the initial decode pool under `[pd]` (Arrow's heterogeneous test:
    /// prefill TP 1, decode TP 2); default `tensor_parallel_size`. Instances keep their GPUs when
    /// they flip roles.
    pub decode_tensor_parallel_size: Option<u32>,
    /// Fraction of GPU memory the engine may use (vLLM `gpu_memory_utilization`).
    pub gpu_memory_utilization: f64,
    /// KV cache per instance in GB (1e9 B). Overrides the memory-utilization arithmetic; use it
    /// to cap memory as PASCAL §III does (50 % of the oracle capacity).
    pub kv_cache_gb: Option<f64>,
    /// CPU offload pool per instance in GB (preempted KV goes here; 0 = recompute instead).
    pub cpu_swap_gb: f64,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Most sequences per iteration.
    pub max_num_seqs: u32,
    /// Most prompt tokens prefilled per iteration.
    pub max_batched_tokens: u32,
    /// Prompts with equal leading content share KV blocks (vLLM's automatic prefix caching,
    /// on by default as in vLLM). Only workloads with content ids (Mooncake `hash_ids`,
    /// `[workload.prefix]`) have anything to share; without them results are the same either way.
    pub prefix_caching: bool,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            instances: 8,
            model: "r1-distill-qwen-32b".into(),
            gpu: "h100-96gb".into(),
            timing: "auto".into(),
            profile_dir: None,
            tensor_parallel_size: 1,
            decode_tensor_parallel_size: None,
            gpu_memory_utilization: 0.9,
            kv_cache_gb: None,
            cpu_swap_gb: 64.0,
            block_size: 16,
            max_num_seqs: 256,
            max_batched_tokens: 8192,
            prefix_caching: true,
        }
    }
}

/// Which schedulers run, and their knobs.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulerConfig {
    /// A preset (`pascal`, `pascal-nomigration`, `pascal-nonadaptive`, `fcfs`, `rr`) or an explicit
    /// `INTRA+INSTANCE` pair such as `rr+round-robin` (intra: fcfs, rr, pascal; instance: pascal,
    /// pascal-nonadaptive, pascal-nomigration, least-kv, round-robin, random).
    pub policy: String,
    /// Intra-instance knobs (quantum, demotion threshold).
    pub intra: SchedulerParams,
    /// Instance-level knobs (adaptive-migration headroom).
    pub instance: PolicyParams,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            policy: "pascal".into(),
            intra: SchedulerParams::default(),
            instance: PolicyParams::default(),
        }
    }
}

/// The live-migration protocol's knobs (`[migration]`), named as the workers' flags name them;
/// the defaults are `MigrationParams::default()`'s, the emulator's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MigrationConfig {
    /// Pipelined stop-and-copy: pause for the final copy once fewer than this many new full
    /// blocks remain.
    pub stop_copy_blocks: u32,
    /// Time-based stop-and-copy (0: off, the block count decides): once a live stage measured the
    /// link, pause when the new blocks would copy within this many milliseconds at its goodput.
    pub stop_copy_ms: f64,
    /// Most live copy stages before the final one (0: plain, blocking stop-and-copy).
    pub max_stages: u32,
    /// Deadline of one migration, ms (then it aborts and the request carries on at its source).
    pub timeout_ms: f64,
    /// A fault to exercise the checksum check: the instances whose migrations out deliver every
    /// block with bytes that do not hash to the sender's checksum (a bad NIC or memory), so each
    /// such move aborts at its target. Empty (default): none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub corrupt_sends_from: Vec<u32>,
}

impl Default for MigrationConfig {
    fn default() -> Self {
        let p = MigrationParams::default();
        MigrationConfig {
            stop_copy_blocks: p.stop_copy_blocks,
            stop_copy_ms: p.stop_copy_after.map_or(0.0, |d| d.as_millis_f64()),
            max_stages: p.max_stages,
            timeout_ms: p.timeout.as_millis_f64(),
            corrupt_sends_from: Vec::new(),
        }
    }
}

impl MigrationConfig {
    /// The protocol parameters (the engines' geometry fills in `block_size` / `block_bytes`).
    pub fn params(&self) -> MigrationParams {
        MigrationParams {
            stop_copy_blocks: self.stop_copy_blocks,
            max_stages: self.max_stages,
            timeout: TimeSpan::from_millis_f64(self.timeout_ms),
            stop_copy_after: (self.stop_copy_ms > 0.0).then(|| TimeSpan::from_millis_f64(self.stop_copy_ms)),
            ..MigrationParams::default()
        }
    }

    /// `stop_copy_ms` finite and ≥ 0, `timeout_ms` finite and > 0.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.stop_copy_ms.is_finite() && self.stop_copy_ms >= 0.0) {
            return Err(ConfigError::Invalid(format!(
                "`migration.stop_copy_ms` must be ≥ 0 (0: off), got {}",
                self.stop_copy_ms
            )));
        }
        if !self.timeout_ms.is_finite() || TimeSpan::from_millis_f64(self.timeout_ms) == TimeSpan::ZERO {
            return Err(ConfigError::Invalid(format!("`migration.timeout_ms` must be > 0, got {}", self.timeout_ms)));
        }
        Ok(())
    }
}

/// A grid of runs.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweepConfig {
    /// Policies (presets or INTRA+INSTANCE pairs).
    pub policies: Vec<String>,
    /// Arrival rates in requests/s; each replaces the workload's arrival rate. Empty: the
    /// workload's own arrivals (e.g. a trace) for every policy.
    #[serde(default)]
    pub rates: Vec<f64>,
    /// Seeds per (policy, rate) point: the workload's seed, seed + 1, … (1: one run per point).
    #[serde(default = "one_seed")]
    pub seeds: u32,
    /// `[sweep.goodput]`: search each setup's goodput instead of running `rates`.
    #[serde(default)]
    pub goodput: Option<crate::goodput::GoodputConfig>,
}

fn one_seed() -> u32 {
    1
}

/// Most seeds per point a sweep may ask for.
pub const MAX_SEEDS: u32 = 1000;

/// One run of a config: a policy at a rate (or the workload's own arrivals) with one seed.
#[derive(Clone, Debug, PartialEq)]
pub struct RunPoint {
    /// Preset name or `INTRA+INSTANCE`.
    pub policy: String,
    /// Arrival rate replacing the workload's, req/s.
    pub rate: Option<f64>,
    /// The workload seed.
    pub seed: u64,
}

/// The presets of PASCAL §V: (name, intra-instance scheduler, instance-level policy).
pub const PRESETS: &[(&str, &str, &str)] = &[
    ("pascal", "pascal", "pascal"),
    ("pascal-nomigration", "pascal", "pascal-nomigration"),
    ("pascal-nonadaptive", "pascal", "pascal-nonadaptive"),
    ("pascal-kv", "pascal", "pascal-kv"),
    ("fcfs", "fcfs", "least-kv"),
    ("rr", "rr", "least-kv"),
];

/// Resolve a policy name into (intra, instance) names, validating both.
pub fn resolve_policy(name: &str) -> Result<(String, String), ConfigError> {
    if let Some((_, intra, inst)) = PRESETS.iter().find(|(n, _, _)| *n == name) {
        return Ok((intra.to_string(), inst.to_string()));
    }
    let presets: Vec<&str> = PRESETS.iter().map(|p| p.0).collect();
    let (intra, inst) = name.split_once('+').ok_or_else(|| {
        ConfigError::Invalid(format!(
            "unknown policy `{name}`: use a preset ({}) or INTRA+INSTANCE with INTRA in {{{}}} and INSTANCE in {{{}}}",
            presets.join(", "),
            SCHEDULER_NAMES.join(", "),
            policy_names().join(", ")
        ))
    })?;
    if !SCHEDULER_NAMES.contains(&intra) {
        return Err(ConfigError::Invalid(format!(
            "unknown intra-instance scheduler `{intra}` in policy `{name}` (valid: {})",
            SCHEDULER_NAMES.join(", ")
        )));
    }
    if !policy_names().contains(&inst) {
        return Err(ConfigError::Invalid(format!(
            "unknown instance policy `{inst}` in policy `{name}` (valid: {})",
            policy_names().join(", ")
        )));
    }
    Ok((intra.to_string(), inst.to_string()))
}

impl SimConfig {
    /// Parse a TOML file. Every relative path inside resolves against the file's directory: the
    /// model and GPU files here, the profile directory and the workload's traces when they are
    /// read (with that directory as `base_dir`).
    pub fn load(path: &Path) -> Result<SimConfig, ConfigError> {
        Self::load_with(path, &[])
    }

    /// [`SimConfig::load`] with `KEY=VALUE` overrides applied to the file's TOML first, each key a
    /// dotted path (`scheduler.intra.boundary_hold=true`, `workload.lengths.overflow=resample`);
    /// a value that is not TOML is taken as a string. An ablation is one `--set` away.
    pub fn load_with(path: &Path, sets: &[String]) -> Result<SimConfig, ConfigError> {
        let mut text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Io { path: path.display().to_string(), source })?;
        if !sets.is_empty() {
            text = apply_sets(&text, &path.display().to_string(), sets)?;
        }
        let mut cfg = Self::parse_unchecked(&text, &path.display().to_string())?;
        let dir = path.parent().unwrap_or(Path::new(""));
        for spec in [&mut cfg.cluster.model, &mut cfg.cluster.gpu] {
            if kvfleet_core::spec::looks_like_path(spec) && Path::new(spec.as_str()).is_relative() {
                *spec = dir.join(spec.as_str()).display().to_string();
            }
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parse TOML text and validate it; `origin` names it in errors. Relative paths stay relative
    /// to the working directory ([`SimConfig::load`] resolves them against the file's).
    pub fn parse(text: &str, origin: &str) -> Result<SimConfig, ConfigError> {
        let cfg = Self::parse_unchecked(text, origin)?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn parse_unchecked(text: &str, origin: &str) -> Result<SimConfig, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse { path: origin.into(), message: one_line(&e.to_string()) })
    }

    /// Everything that can be checked without running: names, ranges, model fits the GPU.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let c = &self.cluster;
        if c.instances == 0 || c.instances > MAX_INSTANCES {
            return Err(ConfigError::Invalid(format!(
                "`cluster.instances` must be in 1..={MAX_INSTANCES}, got {}",
                c.instances
            )));
        }
        self.pd.validate(c.instances).map_err(ConfigError::Invalid)?;
        if !(c.gpu_memory_utilization > 0.0 && c.gpu_memory_utilization <= 1.0) {
            return Err(ConfigError::Invalid(format!(
                "`cluster.gpu_memory_utilization` must be in (0, 1], got {}",
                c.gpu_memory_utilization
            )));
        }
        if let Some(gb) = c.kv_cache_gb {
            if !(gb.is_finite() && gb > 0.0) {
                return Err(ConfigError::Invalid(format!("`cluster.kv_cache_gb` must be a positive number, got {gb}")));
            }
        }
        if !(c.cpu_swap_gb.is_finite() && c.cpu_swap_gb >= 0.0) {
            return Err(ConfigError::Invalid(format!("`cluster.cpu_swap_gb` must be ≥ 0, got {}", c.cpu_swap_gb)));
        }
        for (field, v) in [
            ("block_size", c.block_size),
            ("max_num_seqs", c.max_num_seqs),
            ("max_batched_tokens", c.max_batched_tokens),
        ] {
            if v == 0 {
                return Err(ConfigError::Invalid(format!("`cluster.{field}` must be > 0")));
            }
        }
        let ttft = self.slo.ttft_s.map(|v| ("ttft_s", v));
        for (field, v) in [("tpot_s", self.slo.tpot_s), ("ttfat_s", self.slo.ttfat_s)].into_iter().chain(ttft) {
            if !(v.is_finite() && v > 0.0) {
                return Err(ConfigError::Invalid(format!("`slo.{field}` must be > 0, got {v}")));
            }
        }
        if !(0.0..=1.0).contains(&self.slo.qoe_threshold) {
            return Err(ConfigError::Invalid(format!(
                "`slo.qoe_threshold` must be in [0, 1], got {}",
                self.slo.qoe_threshold
            )));
        }
        let mut policies = vec![&self.scheduler.policy];
        if let Some(sweep) = &self.sweep {
            if sweep.policies.is_empty() {
                return Err(ConfigError::Invalid("`sweep.policies` must not be empty".into()));
            }
            policies.extend(&sweep.policies);
            if !(1..=MAX_SEEDS).contains(&sweep.seeds) {
                return Err(ConfigError::Invalid(format!(
                    "`sweep.seeds` must be 1 to {MAX_SEEDS} (runs per policy and rate), got {}",
                    sweep.seeds
                )));
            }
            for &r in &sweep.rates {
                if !(r.is_finite() && r > 0.0) {
                    return Err(ConfigError::Invalid(format!("`sweep.rates` must be positive request rates, got {r}")));
                }
            }
            if let Some(g) = &sweep.goodput {
                g.validate(&sweep.policies).map_err(ConfigError::Invalid)?;
                if self.slo.ttft_s.is_none() {
                    return Err(ConfigError::Invalid(
                        "`[sweep.goodput]` measures SLO attainment: it needs `[slo] ttft_s`".into(),
                    ));
                }
            }
        }
        for p in policies {
            let (intra, _) = resolve_policy(p)?;
            build_scheduler(&intra, &self.scheduler.intra)
                .map_err(|e| ConfigError::Invalid(format!("`scheduler.intra` for policy `{p}`: {e}")))?;
        }
        self.scheduler.instance.validate().map_err(|e| ConfigError::Invalid(format!("`scheduler.instance`: {e}")))?;
        self.link.validate().map_err(|e| ConfigError::Invalid(format!("link: {e}")))?;
        self.migration.validate()?;
        if let Some(&i) = self.migration.corrupt_sends_from.iter().find(|&&i| i >= c.instances) {
            return Err(ConfigError::Invalid(format!(
                "`migration.corrupt_sends_from` names instance {i}, but the cluster has {} (0..{})",
                c.instances, c.instances
            )));
        }
        self.workload.validate().map_err(|e| ConfigError::Invalid(format!("workload: {e}")))?;
        let (model, gpu) = self.specs()?;
        for (field, tp) in [
            ("tensor_parallel_size", Some(c.tensor_parallel_size)),
            ("decode_tensor_parallel_size", c.decode_tensor_parallel_size),
        ] {
            let Some(tp) = tp else { continue };
            kvfleet_core::timing::analytic::check_tp(&model, &gpu, tp)
                .map_err(|e| ConfigError::Invalid(format!("`cluster.{field}`: {e}")))?;
            if tp > 1 && c.timing == "profile" {
                return Err(ConfigError::Invalid(format!(
                    "`cluster.{field}` = {tp} needs timing = \"analytic\" or \"auto\": a measured profile is one GPU's"
                )));
            }
            self.engine_config_tp(&model, &gpu, tp)?;
        }
        if c.decode_tensor_parallel_size.is_some() && self.pd.is_off() {
            return Err(ConfigError::Invalid(
                "`cluster.decode_tensor_parallel_size` sizes the decode pool: it needs `[pd] prefill_instances`".into(),
            ));
        }
        if self.pd.overlap == Overlap::Chunk && self.scheduler.intra.chunked_prefill_tokens.is_none() {
            return Err(ConfigError::Invalid(
                "`pd.overlap = \"chunk\"` hands a prefill off chunk by chunk: it needs \
                 `scheduler.intra.chunked_prefill_tokens`"
                    .into(),
            ));
        }
        let e = self.engine_config(&model, &gpu)?;
        let blocks = c.instances as u64 * (e.gpu_blocks as u64 + e.cpu_blocks as u64);
        if blocks > MAX_CLUSTER_BLOCKS {
            return Err(ConfigError::Invalid(format!(
                "{} instances × {} KV blocks is {blocks} blocks, more than the {MAX_CLUSTER_BLOCKS} one simulation keeps \
                 (fewer instances, less memory per instance, or a larger `cluster.block_size`)",
                c.instances,
                e.gpu_blocks as u64 + e.cpu_blocks as u64
            )));
        }
        Ok(())
    }

    /// Loads the model and GPU named by `cluster.model` and `cluster.gpu` (built-in or TOML path).
    pub fn specs(&self) -> Result<(ModelSpec, GpuSpec), ConfigError> {
        let model =
            ModelSpec::load(&self.cluster.model).map_err(|e| ConfigError::Invalid(format!("`cluster.model`: {e}")))?;
        let gpu = GpuSpec::load(&self.cluster.gpu).map_err(|e| ConfigError::Invalid(format!("`cluster.gpu`: {e}")))?;
        Ok((model, gpu))
    }

    /// Size one instance: KV blocks on the GPU after weights (or `kv_cache_gb`), CPU pool, limits.
    /// Every count is bounded ([`sizing`]) before an engine allocates anything.
    pub fn engine_config(&self, model: &ModelSpec, gpu: &GpuSpec) -> Result<EngineConfig, ConfigError> {
        self.engine_config_tp(model, gpu, self.cluster.tensor_parallel_size)
    }

    /// [`SimConfig::engine_config`] for an instance of `tp` GPUs.
    pub fn engine_config_tp(&self, model: &ModelSpec, gpu: &GpuSpec, tp: u32) -> Result<EngineConfig, ConfigError> {
        let c = &self.cluster;
        let kv_bytes_per_token = model.kv_bytes_per_token();
        let block_bytes = sizing::block_bytes(c.block_size, kv_bytes_per_token)
            .map_err(|e| ConfigError::Invalid(format!("`cluster.block_size`: {e}")))?;
        let gb = |field: &str, gb: f64| {
            sizing::gb_to_bytes(gb)
                .ok_or_else(|| ConfigError::Invalid(format!("`cluster.{field}` is out of range: {gb}")))
        };
        let (field, kv_bytes) = match c.kv_cache_gb {
            Some(v) => ("kv_cache_gb", gb("kv_cache_gb", v)?),
            None => {
                // The instance's GPUs together hold the weights once (split) and the KV.
                let gpus = f64::from(tp.max(1));
                let usable = (gpus * gpu.memory_bytes() as f64 * c.gpu_memory_utilization) as u64;
                let kv = usable.checked_sub(model.weight_bytes()).filter(|&b| b > 0).ok_or_else(|| {
                    ConfigError::Invalid(format!(
                        "model `{}` ({:.1} GB of weights) leaves no KV memory on {} × `{}` at gpu_memory_utilization {}",
                        model.name,
                        model.weight_bytes() as f64 / 1e9,
                        tp,
                        gpu.name,
                        c.gpu_memory_utilization
                    ))
                })?;
                if kv < block_bytes {
                    return Err(ConfigError::Invalid(format!(
                        "`cluster.block_size` = {}: one block ({:.2} GB) is more than the {:.2} GB of KV memory the \
                         weights leave on {} × `{}`",
                        c.block_size,
                        block_bytes as f64 / 1e9,
                        kv as f64 / 1e9,
                        tp,
                        gpu.name
                    )));
                }
                ("gpu_memory_utilization", kv)
            }
        };
        let gpu_blocks = sizing::gpu_pool_blocks(kv_bytes, block_bytes)
            .map_err(|e| ConfigError::Invalid(format!("`cluster.{field}`: {e}")))?;
        let cpu_blocks = sizing::pool_blocks(gb("cpu_swap_gb", c.cpu_swap_gb)?, block_bytes)
            .map_err(|e| ConfigError::Invalid(format!("`cluster.cpu_swap_gb`: {e}")))?;
        Ok(EngineConfig {
            prefix_caching: c.prefix_caching,
            block_size: c.block_size,
            gpu_blocks,
            cpu_blocks,
            max_num_seqs: c.max_num_seqs,
            max_batched_tokens: c.max_batched_tokens,
            kv_bytes_per_token,
            tpot: TimeSpan::from_secs_f64(self.slo.tpot_s),
        })
    }

    /// The runs this config asks for, in sweep order: seeds outermost, then rates, then policies.
    pub fn runs(&self) -> Vec<RunPoint> {
        let base = self.workload.seed;
        let point = |policy: &String, rate: Option<f64>, k: u32| RunPoint {
            policy: policy.clone(),
            rate,
            seed: base.wrapping_add(u64::from(k)),
        };
        match &self.sweep {
            None => vec![point(&self.scheduler.policy, None, 0)],
            Some(s) => {
                let rates: Vec<Option<f64>> =
                    if s.rates.is_empty() { vec![None] } else { s.rates.iter().map(|&r| Some(r)).collect() };
                (0..s.seeds.max(1))
                    .flat_map(|k| {
                        rates
                            .iter()
                            .flat_map(move |&r| s.policies.iter().map(move |p| point(p, r, k)))
                            .collect::<Vec<_>>()
                    })
                    .collect()
            }
        }
    }

    /// This config with the workload seed `seed` (one point of a multi-seed sweep).
    pub fn with_seed(&self, seed: u64) -> SimConfig {
        let mut cfg = self.clone();
        cfg.workload.seed = seed;
        cfg
    }
}

/// `text` (TOML) with each `KEY=VALUE` of `sets` written into it.
pub fn apply_sets(text: &str, origin: &str, sets: &[String]) -> Result<String, ConfigError> {
    let parse_error = |message: String| ConfigError::Parse { path: origin.into(), message: one_line(&message) };
    let mut doc: toml::Table = toml::from_str(text).map_err(|e| parse_error(e.to_string()))?;
    for set in sets {
        let bad = || {
            ConfigError::Invalid(format!(
                "--set `{set}`: expected KEY=VALUE with a dotted KEY such as scheduler.intra.boundary_hold=true"
            ))
        };
        let (key, value) = set.split_once('=').ok_or_else(bad)?;
        let path: Vec<&str> = key.trim().split('.').collect();
        if path.iter().any(|p| p.is_empty()) {
            return Err(bad());
        }
        let value = value.trim();
        let value = toml::from_str::<toml::Table>(&format!("v = {value}"))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(value.to_string()));
        let (last, parents) = path.split_last().ok_or_else(bad)?;
        let mut table = &mut doc;
        for p in parents {
            let entry = table.entry(p.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
            table = entry.as_table_mut().ok_or_else(|| {
                ConfigError::Invalid(format!("--set `{set}`: `{p}` is a value in the config, not a table"))
            })?;
        }
        table.insert(last.to_string(), value);
    }
    toml::to_string(&doc).map_err(|e| parse_error(e.to_string()))
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_override_nested_keys_and_refuse_malformed_ones() {
        let text = "[scheduler]\npolicy = \"fcfs\"\n[workload]\nseed = 1\n[workload.lengths]\nkind = \"lognormal\"\n";
        let sets = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let out = apply_sets(
            text,
            "c.toml",
            &sets(&[
                "scheduler.intra.boundary_hold=true",
                "workload.seed = 7",
                "scheduler.policy=pascal",
                "workload.lengths.overflow=resample",
            ]),
        )
        .unwrap();
        let cfg = SimConfig::parse(&out, "c.toml").unwrap();
        assert!(cfg.scheduler.intra.boundary_hold);
        assert_eq!(cfg.workload.seed, 7);
        assert_eq!(cfg.scheduler.policy, "pascal", "a bare word is a string");
        for bad in ["scheduler.intra.boundary_hold", "=3", "a..b=1", "scheduler.policy.x=1"] {
            let e = apply_sets(text, "c.toml", &sets(&[bad])).unwrap_err().to_string();
            assert!(e.contains("--set") && !e.contains('\n'), "{bad}: {e}");
        }
        // An unknown key is the config's own error, naming it.
        let out = apply_sets(text, "c.toml", &sets(&["scheduler.intra.hold=true"])).unwrap();
        assert!(SimConfig::parse(&out, "c.toml").unwrap_err().to_string().contains("hold"));
    }

    #[test]
    fn defaults_are_pascals_setup() {
        let cfg = SimConfig::parse("", "<empty>").unwrap();
        let (m, g) = cfg.specs().unwrap();
        let e = cfg.engine_config(&m, &g).unwrap();
        assert_eq!(cfg.cluster.instances, 8);
        assert_eq!(e.block_bytes(), 16 * 262_144);
        // 96 GB × 0.9 − 65.5 GB of weights ≈ 20.9 GB of KV ≈ 4,980 blocks of 4 MiB.
        assert!((4_500..5_500).contains(&e.gpu_blocks), "{}", e.gpu_blocks);
    }

    /// An instance of two GPUs holds the weights once between them: its KV pool is their memory
    /// less one copy of the weights (more than twice one GPU's pool).
    #[test]
    fn tensor_parallel_instances_pool_their_gpus_memory() {
        let blocks = |tp: u32| {
            let text = format!("[cluster]\nmodel = \"qwen3-32b\"\ngpu = \"h20-141gb\"\ntensor_parallel_size = {tp}");
            let cfg = SimConfig::parse(&text, "c.toml").unwrap();
            let (m, g) = cfg.specs().unwrap();
            let weights = m.weight_bytes() as f64;
            let expect = ((tp as f64 * 141e9 * 0.9 - weights) / (16.0 * 262_144.0)).floor() as u32;
            (cfg.engine_config(&m, &g).unwrap().gpu_blocks, expect)
        };
        let ((one, one_expect), (two, two_expect)) = (blocks(1), blocks(2));
        assert_eq!((one, two), (one_expect, two_expect));
        assert!(two > 2 * one, "{one} -> {two}");
    }

    #[test]
    fn bad_values_name_the_field() {
        let cases = [
            ("[scheduler]\npolicy = \"sjf\"", "unknown policy `sjf`"),
            ("[scheduler]\npolicy = \"sjf+least-kv\"", "intra-instance scheduler `sjf`"),
            ("[cluster]\ninstances = 0", "cluster.instances"),
            ("[cluster]\nmodel = \"gpt-9\"", "cluster.model"),
            ("[cluster]\nbogus = 1", "unknown field `bogus`"),
            ("[sweep]\npolicies = [\"pascal\"]\nrates = [-1.0]", "sweep.rates"),
            ("[sweep]\npolicies = [\"pascal\"]\nseeds = 0", "sweep.seeds"),
            ("[sweep]\npolicies = [\"pascal\"]\nseeds = 1001", "sweep.seeds"),
            ("[cluster]\nmodel = \"r1-distill-qwen-32b\"\ngpu = \"v100-32gb\"", "leaves no KV memory"),
            ("[cluster]\ntensor_parallel_size = 3", "tensor_parallel_size"),
            ("[cluster]\ntensor_parallel_size = 0", "tensor_parallel_size"),
            ("[cluster]\ngpu = \"l40s\"\nmodel = \"qwen-7b\"\ntensor_parallel_size = 2", "no NVLink"),
            ("[cluster]\ntensor_parallel_size = 2\ntiming = \"profile\"", "one GPU's"),
            ("[migration]\ntimeout_ms = 0", "migration.timeout_ms"),
            ("[migration]\ntimeout_ms = 1e-9", "migration.timeout_ms"),
            ("[migration]\nstop_copy_ms = -1", "migration.stop_copy_ms"),
            ("[migration]\nstop_copy_ms = nan", "migration.stop_copy_ms"),
            ("[migration]\nmax_stages = -1", "max_stages = -1 | ^^ invalid value"),
            ("[migration]\nstop_copy_bytes = 1", "unknown field `stop_copy_bytes`"),
            (
                "[cluster]\ninstances = 4\n[migration]\ncorrupt_sends_from = [1, 4]",
                "`migration.corrupt_sends_from` names instance 4, but the cluster has 4 (0..4)",
            ),
            ("[migration]\ncorrupt_sends_from = [-1]", "corrupt_sends_from = [-1]"),
            ("[migration]\ncorrupt_sends_from = 0", "invalid type"),
            ("[scheduler.intra]\nquantum_tokens = 0", "`scheduler.intra` for policy `pascal`"),
            ("[sweep]\npolicies = [\"fcfs\", \"rr\"]\n[scheduler.intra]\ndemotion_tokens = 0", "demotion_tokens"),
            ("[cluster]\nkv_cache_gb = 1e9", "`cluster.kv_cache_gb`: 1000000000000000000 bytes are"),
            ("[cluster]\nkv_cache_gb = 1e300", "`cluster.kv_cache_gb` is out of range"),
            ("[cluster]\ncpu_swap_gb = 1e9", "`cluster.cpu_swap_gb`: "),
            ("[cluster]\nkv_cache_gb = 0.001", "hold no KV block"),
            (
                "[cluster]\nblock_size = 100000000",
                "`cluster.block_size` = 100000000: one block (26214.40 GB) is more than",
            ),
            ("[slo]\ntpot_s = 0", "`slo.tpot_s` must be > 0"),
            ("[slo]\nttft_s = -1", "`slo.ttft_s` must be > 0, got -1"),
            ("[slo]\nttft_s = nan", "`slo.ttft_s` must be > 0, got NaN"),
        ];
        for (text, want) in cases {
            let e = SimConfig::parse(text, "x.toml").unwrap_err().to_string();
            assert!(e.contains(want), "{text:?} → {e}");
        }
    }

    #[test]
    fn migration_knobs_default_to_the_protocols_and_override_it() {
        let cfg = SimConfig::parse("", "<empty>").unwrap();
        assert_eq!(cfg.migration.params(), MigrationParams::default());
        let text = "[migration]\nstop_copy_blocks = 4\nstop_copy_ms = 10\nmax_stages = 0\ntimeout_ms = 250.5";
        let p = SimConfig::parse(text, "x.toml").unwrap().migration.params();
        assert_eq!((p.stop_copy_blocks, p.max_stages), (4, 0));
        assert_eq!(p.stop_copy_after, Some(TimeSpan::from_millis_f64(10.0)));
        assert_eq!(p.timeout, TimeSpan::from_nanos(250_500_000));
    }

    #[test]
    fn presets_and_pairs_resolve() {
        assert_eq!(resolve_policy("fcfs").unwrap(), ("fcfs".into(), "least-kv".into()));
        assert_eq!(resolve_policy("rr+random").unwrap(), ("rr".into(), "random".into()));
    }
}
