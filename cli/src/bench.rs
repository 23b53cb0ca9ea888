//! `kvfleet bench …`: benchmarks that print figures measured in one run. Not tests: they assert
//! nothing about wall time; they report it.

use crate::InputError;
use clap::{Args, Subcommand};
use kvfleet_core::workload::{ArrivalConfig, LengthConfig, WorkloadConfig};
use kvfleet_sim::config::SimConfig;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Simulator speed: a large cluster (default 1000 instances) over a long workload (default
    /// one hour of arrivals); prints wall time, simulated events/s and requests/s.
    Sim(SimBench),
    /// Timing-model error: the profile model on measured points held out of its own table
    /// (leave-one-out), and the analytic roofline on every measured point; MAPE per regime.
    Timing,
}

#[derive(Args)]
pub struct SimBench {
    /// Number of instances.
    #[arg(long, default_value_t = 1000)]
    instances: u32,
    /// Simulated span of arrivals, seconds.
    #[arg(long, default_value_t = 3600.0)]
    duration_s: f64,
    /// Cluster-wide Poisson arrival rate, requests/s (default: 0.1 req/s per instance).
    #[arg(long)]
    rate: Option<f64>,
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
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Sim(b) => bench_sim(b),
        BenchCommand::Timing => {
            let report = kvfleet_core::timing::HoldoutReport::builtin_h100_qwen32b()
                .map_err(|e| anyhow::anyhow!("building the held-out report: {e}"))?;
            crate::say!("{report}");
            Ok(())
        }
    }
}

fn bench_sim(b: SimBench) -> anyhow::Result<()> {
    let rate = b.rate.unwrap_or(0.1 * b.instances as f64);
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
        "bench sim: {} instances, {:.0} s of Poisson arrivals at {rate} req/s = {} requests, policy {}, lengths {}",
        b.instances,
        b.duration_s,
        requests.len(),
        b.policy,
        b.azure_trace.as_ref().map_or("ServeGen DeepSeek-R1".to_string(), |p| p.display().to_string())
    );
    let results = crate::run_parallel(&cfg, &[(b.policy.clone(), None)], &base, Some(1), false)?;
    let wall = t0.elapsed().as_secs_f64();
    let r = &results[0];
    let tokens: u64 = r.instances.iter().map(|s| s.tokens).sum();
    let iterations: u64 = r.instances.iter().map(|s| s.iterations).sum();
    let full_plans: u64 = r.instances.iter().map(|s| s.full_plans).sum();
    crate::say!("  simulated span     {:>12.1} s (virtual)", r.sim_end_s);
    crate::say!("  wall time          {:>12.2} s (workload generation {:.2} s)", wall, gen_s);
    crate::say!("  events             {:>12} ({:.2} M events/s)", r.events, r.events as f64 / wall / 1e6);
    crate::say!("  engine iterations  {:>12} ({:.2} M iterations/s)", iterations, iterations as f64 / wall / 1e6);
    crate::say!("  full re-plans      {:>12} ({:.1} % of iterations)", full_plans, 100.0 * full_plans as f64 / iterations.max(1) as f64);
    crate::say!("  tokens generated   {:>12} ({:.1} M tokens/s)", tokens, tokens as f64 / wall / 1e6);
    crate::say!("  speed-up vs real   {:>12.0}×", r.sim_end_s / wall);
    crate::say!("  finished requests  {:>12} of {}", r.summary.requests_finished, r.summary.requests_total);
    Ok(())
}
