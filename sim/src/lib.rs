//! kvfleet-sim: a deterministic discrete-event simulator of a kvfleet cluster.
//!
//! It drives the very same `kvfleet-core` engines, schedulers and instance policies as the
//! emulator, in virtual time, with the `kvfleet-netmodel` fabric standing in for the network.
//! Same config and seed → byte-identical records and summaries.
//!
//! - [`config`]: the experiment TOML (`SimConfig`), presets, instance sizing, validation;
//! - [`cluster`]: the event loop;
//! - [`migration`]: one live KV migration (the netmodel protocol machines) over the fabric;
//! - [`capacity`]: the rate where steady-state KV demand meets capacity, and sweep rates around it;
//! - [`run_one`]: one (policy, rate) point of a config (`kvfleet sim` runs a sweep's points in
//!   parallel).

#![warn(missing_docs)]

pub mod capacity;
pub mod cluster;
pub mod config;
pub mod goodput;
pub mod migration;

use cluster::{Cluster, ClusterOutcome, Progress};
use config::{resolve_policy, ConfigError, PdPolicy, SimConfig};
pub use kvfleet_core::metrics::{LiveMigrations, RunIdentity, RunResult};
use kvfleet_core::policy::registry::build_policy;
use kvfleet_core::time::{Timestamp, RUN_LIMIT};
use kvfleet_core::timing::TimingModel;
use kvfleet_core::workload::{generate, ArrivalConfig};
use std::path::Path;
use std::sync::Arc;

/// Why a run could not be set up or did not finish.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The experiment config is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The workload could not be generated (or a rate sweep does not fit its arrival process).
    #[error("workload: {0}")]
    Workload(String),
    /// The timing model could not be built.
    #[error("timing model: {0}")]
    Timing(String),
    /// The policy or the cluster could not be built.
    #[error("{0}")]
    Setup(String),
    /// The virtual clock passed the run's time limit, or the events ran out with requests
    /// unfinished.
    #[error(transparent)]
    Run(#[from] cluster::RunError),
}

/// Build the timing model a config asks for (shared by every instance of a run).
pub fn timing_model(cfg: &SimConfig, base_dir: &Path) -> Result<Arc<dyn TimingModel>, SimError> {
    timing_model_tp(cfg, base_dir, cfg.cluster.tensor_parallel_size)
}

/// [`timing_model`] for instances of `tp` GPUs.
fn timing_model_tp(cfg: &SimConfig, base_dir: &Path, tp: u32) -> Result<Arc<dyn TimingModel>, SimError> {
    let (model, gpu) = cfg.specs()?;
    let dir = cfg.cluster.profile_dir.as_ref().map(|d| base_dir.join(d));
    let t = kvfleet_core::timing::profile::build_timing(&cfg.cluster.timing, &model, &gpu, dir.as_deref(), tp)
        .map_err(|e| SimError::Timing(e.to_string()))?;
    Ok(Arc::from(t))
}

/// Set the workload's arrival rate (sweeps), whatever its arrival process.
fn with_rate(cfg: &SimConfig, rate: Option<f64>) -> Result<SimConfig, SimError> {
    let mut cfg = cfg.clone();
    if let Some(r) = rate {
        match &mut cfg.workload.arrivals {
            ArrivalConfig::Poisson { rate } => *rate = r,
            ArrivalConfig::Gamma { rate, .. } => *rate = r,
            other => {
                return Err(SimError::Workload(format!(
                    "a sweep over rates needs a poisson or gamma arrival process, not `kind = \"{}\"`; scale its rate with `workload.rate_scale`",
                    other.kind()
                )))
            }
        }
    }
    Ok(cfg)
}

/// The mean rate of a synthetic arrival process (None for traces).
pub fn arrival_rate(a: &ArrivalConfig) -> Option<f64> {
    match a {
        ArrivalConfig::Poisson { rate } | ArrivalConfig::Gamma { rate, .. } => Some(*rate),
        _ => None,
    }
}

/// Run one (policy, rate) point of a config.
pub fn run_one(
    cfg: &SimConfig,
    policy: &str,
    rate: Option<f64>,
    base_dir: &Path,
    progress: impl FnMut(Progress),
) -> Result<RunResult, SimError> {
    run_one_until(cfg, policy, rate, base_dir, RUN_LIMIT, progress)
}

/// [`run_one`], stopping with [`SimError::Run`] once the virtual clock passes `until` (at
/// most [`RUN_LIMIT`]).
pub fn run_one_until(
    cfg: &SimConfig,
    policy: &str,
    rate: Option<f64>,
    base_dir: &Path,
    until: Timestamp,
    progress: impl FnMut(Progress),
) -> Result<RunResult, SimError> {
    let cfg = with_rate(cfg, rate)?;
    let (intra, inst) = resolve_policy(policy)?;
    let (model, gpu) = cfg.specs()?;
    let engine = cfg.engine_config(&model, &gpu)?;
    let timing = timing_model(&cfg, base_dir)?;
    let requests = generate(&cfg.workload, base_dir).map_err(|e| SimError::Workload(e.to_string()))?;
    let block = engine.block_size;
    if engine.prefix_caching
        && !kvfleet_core::kv::tiles_content_unit(block)
        && requests.iter().any(|r| !r.content_ids.is_empty())
    {
        return Err(SimError::Setup(format!(
            "`cluster.block_size` = {block} does not divide the {} tokens of a content id: prefix caching \
             needs a divisor (16, 32, …) or `cluster.prefix_caching = false`",
            kvfleet_core::kv::TRACE_BLOCK_TOKENS
        )));
    }
    let policy_impl = build_policy(&inst, &cfg.scheduler.instance).map_err(|e| SimError::Setup(e.to_string()))?;
    let policy_impl_needs_costs = policy_impl.needs_costs();
    let mut cluster = Cluster::new(
        cfg.cluster.instances,
        &engine,
        timing.clone(),
        &intra,
        &cfg.scheduler.intra,
        policy_impl,
        cfg.link.clone(),
        cfg.migration.params(),
        cfg.workload.seed,
    )
    .map_err(SimError::Setup)?;
    if policy_impl_needs_costs {
        cluster.use_placement_costs(timing.as_ref(), &cfg.link, cfg.slo.tpot_s).map_err(SimError::Setup)?;
    }
    // A decode pool of another tensor-parallel degree: its instances' engines, timing and (for
    // Arrow) profile are their own.
    let decode_tp = cfg.cluster.decode_tensor_parallel_size.filter(|&t| t != cfg.cluster.tensor_parallel_size);
    let decoders = if cfg.pd.is_off() { 0..0 } else { cfg.pd.prefill_instances..cfg.cluster.instances };
    let decode_timing = match decode_tp {
        Some(tp) => {
            let engine = cfg.engine_config_tp(&model, &gpu, tp)?;
            let timing = timing_model_tp(&cfg, base_dir, tp)?;
            for i in decoders {
                cluster.set_instance_hardware(i, &engine, timing.clone()).map_err(SimError::Setup)?;
            }
            Some(timing)
        }
        None => None,
    };
    cluster.split_prefill_decode(&cfg.pd);
    cluster.corrupt_sends_from(&cfg.migration.corrupt_sends_from);
    if cfg.pd.policy == PdPolicy::Arrow {
        cluster.use_arrow(cfg.pd.arrow, timing.as_ref()).map_err(SimError::Setup)?;
        if let Some(t) = &decode_timing {
            cluster.use_decode_pool_profile(cfg.pd.arrow.slo_tpot_s, t.as_ref()).map_err(SimError::Setup)?;
        }
    }
    cluster.set_leaping(cfg.simulator.leap_iterations);
    let ClusterOutcome { records, migrations, instances, events, queue_events, end, role_changes, decisions, fetches } =
        cluster.run_until(&requests, until.min(RUN_LIMIT), progress)?;
    let id = RunIdentity {
        policy: policy.to_string(),
        intra,
        instance_policy: inst,
        rate: rate.or_else(|| arrival_rate(&cfg.workload.arrivals)),
        timing: timing.name().to_string(),
        seed: cfg.workload.seed,
    };
    let run = RunResult::new(id, records, migrations, &cfg.slo, end.as_secs_f64())
        .with_engine_counters(instances, events, queue_events)
        .with_control(role_changes, decisions)
        .with_prefix_fetches(fetches.fetches, fetches.bytes);
    Ok(if cfg.pd.is_off() { run } else { run.with_handoffs() })
}
