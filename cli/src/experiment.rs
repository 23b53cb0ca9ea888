//! The experiment pipeline the commands share: config → workload → backend → per-request records
//! → report.
//!
//! | stage | `kvfleet sim` | `kvfleet up` | `kvfleet replay` |
//! |---|---|---|---|
//! | config, workload | `load_config` (sweeps) | [`Plan::load`] | [`Plan::load`] |
//! | backend | the simulator, a run per sweep point | processes started here ([`crate::up`]) | a running cluster |
//! | records | [`RunResult`] per run | [`Replayed`] → [`RunResult`] | [`Replayed`] → [`RunResult`] |
//! | report | `report` tables, CSV/JSON, plots | [`Replayed::report`] | [`Replayed::report`] |
//!
//! The two real-time backends replay one workload through a cluster's leader
//! ([`crate::up::replay::replay`]); what differs between them is only how the cluster came to be
//! and what each checks afterwards (faults and the etcd audit for `up`, the exactly-once
//! accounting of `replay`).

use crate::up::replay::ReplayStats;
use crate::up::{live, DEFAULT_CONFIG};
use crate::{report, say, InputError};
use indicatif::{ProgressBar, ProgressStyle};
use kvfleet_core::metrics::{RequestRecord, RoleChange, RunIdentity, RunResult};
use kvfleet_core::workload::{ArrivalConfig, WorkloadConfig};
use kvfleet_core::RequestSpec;
use kvfleet_proto::v1;
use kvfleet_sim::config::{resolve_policy, SimConfig};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// What a command overrides in its config for one run.
#[derive(Default)]
pub struct PlanArgs<'a> {
    /// The config file; `None`: the embedded default of `kvfleet up`.
    pub config: Option<&'a Path>,
    /// Policy preset or INTRA+INSTANCE pair.
    pub policy: Option<&'a str>,
    /// Number of requests.
    pub requests: Option<u64>,
    /// Workload seed.
    pub seed: Option<u64>,
    /// Instances.
    pub workers: Option<u32>,
    /// Arrival rate of a Poisson or gamma workload, requests/s.
    pub rate: Option<f64>,
}

/// One run's config and its workload, checked: every bad input is an [`InputError`].
pub struct Plan {
    /// The config, overrides applied (no sweep: one run).
    pub cfg: SimConfig,
    /// The resolved policy pair.
    pub intra: String,
    pub instance_policy: String,
    /// The workload as generated (the rate override applied).
    pub workload: WorkloadConfig,
    /// Its requests, in arrival order, arrivals relative to the run's start.
    pub requests: Vec<RequestSpec>,
    rate: Option<f64>,
}

impl Plan {
    /// Load the config (or the embedded default), apply `a`, validate, generate the workload.
    pub fn load(a: &PlanArgs) -> anyhow::Result<Plan> {
        let mut cfg = match a.config {
            Some(p) => SimConfig::load(p).map_err(|e| InputError(e.to_string()))?,
            None => SimConfig::parse(DEFAULT_CONFIG, "<embedded default>").map_err(|e| InputError(e.to_string()))?,
        };
        let base_dir = a.config.and_then(|p| p.parent().map(Path::to_path_buf)).unwrap_or_default();
        if let Some(p) = a.policy {
            cfg.scheduler.policy = p.to_owned();
        }
        if let Some(n) = a.requests {
            cfg.workload.num_requests = Some(n);
        }
        if let Some(s) = a.seed {
            cfg.workload.seed = s;
        }
        if let Some(w) = a.workers {
            cfg.cluster.instances = w;
        }
        cfg.sweep = None;
        cfg.validate().map_err(|e| InputError(e.to_string()))?;
        let mut workload = cfg.workload.clone();
        if let Some(r) = a.rate {
            if !(r.is_finite() && r > 0.0) {
                return Err(InputError(format!("--rate must be a positive number, got {r}")).into());
            }
            match &mut workload.arrivals {
                ArrivalConfig::Poisson { rate } | ArrivalConfig::Gamma { rate, .. } => *rate = r,
                _ => return Err(InputError("--rate needs a poisson or gamma workload".into()).into()),
            }
        }
        let (intra, instance_policy) = resolve_policy(&cfg.scheduler.policy).map_err(|e| InputError(e.to_string()))?;
        let requests =
            kvfleet_core::workload::generate(&workload, &base_dir).map_err(|e| InputError(format!("workload: {e}")))?;
        Ok(Plan { cfg, intra, instance_policy, workload, requests, rate: a.rate })
    }

    /// What the run is, for its reports.
    pub fn identity(&self) -> RunIdentity {
        RunIdentity {
            policy: self.cfg.scheduler.policy.clone(),
            intra: self.intra.clone(),
            instance_policy: self.instance_policy.clone(),
            rate: self.rate.or_else(|| kvfleet_sim::arrival_rate(&self.workload.arrivals)),
            timing: self.cfg.cluster.timing.clone(),
            seed: self.cfg.workload.seed,
        }
    }
}

/// A real-time replay's progress: a bar on a terminal, else a line every 5 s (a log keeps them);
/// nothing with `quiet`.
pub struct Progress {
    bar: ProgressBar,
    lines: bool,
    total: u64,
    started: Instant,
    next_line: Instant,
}

impl Progress {
    /// Progress over `total` requests, from now.
    pub fn new(total: u64, quiet: bool) -> Progress {
        let interactive = std::io::stderr().is_terminal() && !quiet;
        let bar = if interactive { ProgressBar::new(total) } else { ProgressBar::hidden() };
        bar.set_style(
            ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests finished {msg}")
                .expect("static template"),
        );
        let started = Instant::now();
        Progress { bar, lines: !interactive && !quiet, total, started, next_line: started + Duration::from_secs(5) }
    }

    /// Show the counters now.
    pub fn update(&mut self, stats: &ReplayStats) {
        let finished = stats.finished.load(Ordering::Relaxed);
        let tokens = stats.tokens.load(Ordering::Relaxed);
        self.bar.set_position(finished);
        self.bar.set_message(format!("({tokens} tokens streamed)"));
        if self.lines && Instant::now() >= self.next_line {
            self.next_line += Duration::from_secs(5);
            say!(
                "progress    {finished}/{} finished, {tokens} tokens, {} resumed, {} retries ({:.0} s)",
                self.total,
                stats.resumed.load(Ordering::Relaxed),
                stats.retries.load(Ordering::Relaxed),
                self.started.elapsed().as_secs_f64()
            );
        }
    }

    /// Print `line` without tearing the bar.
    pub fn say(&self, line: &str) {
        self.bar.suspend(|| say!("{line}"));
    }

    /// The bar, for what prints beside it.
    pub fn bar(&self) -> &ProgressBar {
        &self.bar
    }

    /// Real time since the replay started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Clear the bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// What a real-time replay brought back.
pub struct Replayed {
    /// Final records, by request id.
    pub ok: Vec<RequestRecord>,
    /// One line per request that ended without a record.
    pub failed: Vec<String>,
    /// The leader's log of live migrations (each source's measurements).
    pub live_log: Vec<v1::MigrationStats>,
    /// The run's span in emulated seconds (what every reported time is in).
    pub span_s: f64,
    /// Prefill/decode disaggregation, from the leader: roles changed after the start, handoffs
    /// committed, held requests released to decode where they were prefilled.
    pub role_changes: Vec<v1::RoleChange>,
    pub handoffs: u64,
    pub handoffs_released: u64,
    /// Of `handoffs`, those decided while the prefill ran (`[pd] overlap`).
    pub handoffs_overlapped: u64,
    /// Cache-aware placements that copied a cached prefix first, and their bytes (the leader's
    /// count).
    pub prefix_fetches: u64,
    pub prefix_fetch_bytes: u64,
}

impl Replayed {
    /// Records → one [`RunResult`] under `plan`'s identity and SLO.
    pub fn run_result(&self, plan: &Plan) -> RunResult {
        let run =
            RunResult::new(plan.identity(), self.ok.clone(), live::records(&self.live_log), &plan.cfg.slo, self.span_s);
        let changes = self
            .role_changes
            .iter()
            .map(|c| RoleChange { at_s: c.at_ns as f64 / 1e9, instance: c.instance, role: c.role.clone() })
            .collect();
        let run = run
            .with_control(changes, Default::default())
            .with_prefix_fetches(self.prefix_fetches, self.prefix_fetch_bytes);
        if plan.cfg.pd.is_off() {
            run
        } else {
            run.with_handoffs()
        }
    }

    /// The line on prefill/decode handoffs and role flips (`None` when the run had neither).
    pub fn pd_line(&self) -> Option<String> {
        if self.handoffs + self.handoffs_released == 0 && self.role_changes.is_empty() {
            return None;
        }
        let to = |role: &str| self.role_changes.iter().filter(|c| c.role == role).count();
        let overlapped = match self.handoffs_overlapped {
            0 => String::new(),
            n => format!(" ({n} overlapped with their prefill)"),
        };
        Some(format!(
            "prefill/decode: {} handoffs moved to a decoder{overlapped}, {} decoded where prefilled; {} role flips ({} to decode, {} to prefill)",
            self.handoffs,
            self.handoffs_released,
            self.role_changes.len(),
            to("decode"),
            to("prefill")
        ))
    }

    /// Requests that migrated at least once.
    pub fn migrated(&self) -> usize {
        self.ok.iter().filter(|r| r.migrations > 0).count()
    }

    /// Requests their instance rejected (they never fit).
    pub fn rejected(&self) -> usize {
        self.ok.iter().filter(|r| r.rejected).count()
    }

    /// The report's second half, after the summary table and the command's own counts: the live
    /// migrations (table and `live-migrations.csv`), the failures (first five, all in
    /// `failed.txt`), then `results.json`, `summary.csv`, the per-request CSVs and the plots.
    /// Returns the files written.
    pub fn report(&self, out: &Path, run: &RunResult, plots: bool) -> anyhow::Result<Vec<PathBuf>> {
        say!("{}", live::table(&self.live_log).trim_end());
        let mut written = Vec::new();
        if !self.live_log.is_empty() {
            let path = out.join("live-migrations.csv");
            live::write_csv(&path, &self.live_log)?;
            written.push(path);
        }
        for e in self.failed.iter().take(5) {
            say!("  failed: {e}");
        }
        if !self.failed.is_empty() {
            let path = out.join("failed.txt");
            std::fs::write(&path, self.failed.join("\n") + "\n")?;
            say!("  (all {} failures in {})", self.failed.len(), path.display());
            written.push(path);
        }
        written.extend(report::write_outputs(out, std::slice::from_ref(run))?);
        if plots {
            written.extend(crate::plots::write_plots(out, std::slice::from_ref(run))?);
        }
        Ok(written)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_overrides_are_input_errors_naming_the_flag() {
        let rate = |r: f64| Plan::load(&PlanArgs { rate: Some(r), ..PlanArgs::default() }).err().map(|e| e.to_string());
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = rate(bad).expect("refused");
            assert!(e.starts_with("--rate must be a positive number"), "{e}");
        }
        let plan = Plan::load(&PlanArgs { rate: Some(2.5), requests: Some(7), ..PlanArgs::default() }).unwrap();
        assert_eq!(plan.requests.len(), 7);
        assert_eq!(plan.identity().rate, Some(2.5));
        let e = Plan::load(&PlanArgs { policy: Some("no-such-policy"), ..PlanArgs::default() }).err().unwrap();
        assert!(e.downcast_ref::<InputError>().is_some(), "{e}");
    }
}
