//! `kvfleet replay`: replay a workload through a cluster that is already running (docker compose,
//! Docker Swarm, Kubernetes, processes started by hand) and check its outcome.
//!
//! It finds the leader through `--coordinators`, waits for the workers, submits every request at
//! its arrival time on the cluster clock (the load generator of `kvfleet up`: a broken stream is
//! resumed through the new leader), then prints the summary table of `kvfleet up`, writes the same
//! files (`results.json`, `summary.csv`, per-request CSVs, plots, `live-migrations.csv`) plus
//! `replay.json` (the exactly-once accounting), and exits non-zero unless every request completed
//! exactly once: one final record per request, none failed, none rejected, none duplicated.

use crate::experiment::{Plan, PlanArgs, Progress, Replayed};
use crate::up::replay::{replay, schedule, GiveUp, LeaderFinder, ReplayStats};
use crate::{report, say, InputError};
use anyhow::{bail, Context};
use clap::Args;
use kvfleet_core::metrics::RequestRecord;
use kvfleet_core::{RequestId, RequestSpec, Timestamp};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct ReplayArgs {
    /// Coordinator addresses, comma-separated (any of them: the leader is found through them).
    #[arg(long, value_delimiter = ',', required = true)]
    coordinators: Vec<String>,
    /// Experiment config: the workload and SLO (default: the embedded `kvfleet up` config). The
    /// cluster's own settings (model, policy, KV sizes) are the processes' flags, not this file's.
    #[arg(short, long)]
    config: Option<PathBuf>,
    /// Number of requests.
    #[arg(long)]
    requests: Option<u64>,
    /// Arrival rate, requests/s (Poisson/gamma workloads).
    #[arg(long, allow_negative_numbers = true)]
    rate: Option<f64>,
    /// Workload seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Added to every request id. The cluster keeps results by id, so a second replay against
    /// the same cluster needs other ids (else it is answered with the first run's records, which
    /// the check reports as stale).
    #[arg(long, default_value_t = 0)]
    id_base: u64,
    /// Start once at least this many workers are alive (default: the config's `cluster.instances`).
    #[arg(long)]
    min_workers: Option<u32>,
    /// How long to wait for a leader and the workers, seconds.
    #[arg(long, default_value_t = 120.0)]
    wait_s: f64,
    /// Give up this many seconds after the first arrival; unfinished requests then count as failed.
    #[arg(long, default_value_t = 600.0)]
    timeout_s: f64,
    /// Output directory (results, CSVs, plots, `replay.json`).
    #[arg(short, long, default_value = "results/replay")]
    out: PathBuf,
    /// Do not draw plots.
    #[arg(long)]
    no_plots: bool,
    /// No progress bar or progress lines.
    #[arg(short, long)]
    quiet: bool,
    /// The client's cluster certificate (mutual TLS), or `--plaintext`.
    #[command(flatten)]
    tls: kvfleet_pki::TlsArgs,
}

/// The exactly-once accounting of one replay (`replay.json`).
#[derive(Debug, Default, PartialEq, serde::Serialize)]
pub struct Outcome {
    pub requests: usize,
    /// Requests with exactly one final, not rejected record.
    pub completed: usize,
    /// Requests that ended without a record (an error, or the timeout).
    pub failed: usize,
    /// Requests rejected by their worker (they could never fit).
    pub rejected: usize,
    /// Request ids with more than one final record.
    pub duplicates: usize,
    /// Final records for ids that were never submitted.
    pub unknown: usize,
    /// Records of an earlier run with the same ids (their arrival is not the one submitted).
    pub stale: usize,
    pub resumed: u64,
    pub retries: u64,
    pub wall_s: f64,
    pub exactly_once: bool,
}

/// Count what came back against what was submitted (`submitted`: each request's id and its
/// arrival on the cluster clock).
pub fn account(submitted: &[RequestSpec], records: &[RequestRecord], failed: usize) -> Outcome {
    let mut seen = std::collections::BTreeMap::<u64, u32>::new();
    for r in records {
        *seen.entry(r.id.0).or_default() += 1;
    }
    let wanted: std::collections::BTreeMap<u64, Timestamp> = submitted.iter().map(|s| (s.id.0, s.arrival)).collect();
    let rejected = records.iter().filter(|r| r.rejected).count();
    let duplicates = seen.values().filter(|&&n| n > 1).count();
    let unknown = seen.keys().filter(|id| !wanted.contains_key(id)).count();
    let stale = records.iter().filter(|r| wanted.get(&r.id.0).is_some_and(|a| *a != r.arrival)).count();
    let completed = records
        .iter()
        .filter(|r| !r.rejected && wanted.get(&r.id.0) == Some(&r.arrival) && seen.get(&r.id.0) == Some(&1))
        .count();
    Outcome {
        requests: submitted.len(),
        completed,
        failed,
        rejected,
        duplicates,
        unknown,
        stale,
        exactly_once: completed == submitted.len() && failed == 0 && duplicates == 0 && unknown == 0 && stale == 0,
        ..Outcome::default()
    }
}

pub fn run(args: ReplayArgs) -> anyhow::Result<()> {
    let mut plan = Plan::load(&PlanArgs {
        config: args.config.as_deref(),
        requests: args.requests,
        seed: args.seed,
        rate: args.rate,
        ..PlanArgs::default()
    })?;
    for (flag, v) in [("--wait-s", args.wait_s), ("--timeout-s", args.timeout_s)] {
        if !(v.is_finite() && v > 0.0) {
            return Err(InputError(format!("{flag} must be a positive number of seconds, got {v}")).into());
        }
    }
    for r in &mut plan.requests {
        r.id =
            r.id.0
                .checked_add(args.id_base)
                .map(RequestId)
                .ok_or_else(|| InputError("--id-base is too large".into()))?;
    }
    let tls = args.tls.load().map_err(|e| InputError(e.to_string()))?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let want_workers = args.min_workers.unwrap_or(plan.cfg.cluster.instances) as usize;
    let finder = LeaderFinder::new(args.coordinators.clone(), tls);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let wait = Duration::from_secs_f64(args.wait_s);

    // A leader, then enough live workers.
    let deadline = Instant::now() + wait;
    let started = Instant::now();
    let status = loop {
        // Asked in turns of a few seconds, each miss said, so a wait for a cluster that is still
        // starting (or not there) is never silent.
        let turn = deadline.saturating_duration_since(Instant::now()).min(Duration::from_secs(10));
        let (_, s) = match rt.block_on(finder.leader(turn)) {
            Ok(found) => found,
            Err(e) if Instant::now() < deadline => {
                let waited = started.elapsed().as_secs_f64();
                say!(
                    "waiting     for a leader among {:?} ({waited:.0} s of --wait-s {}): {}",
                    args.coordinators,
                    args.wait_s,
                    e.message()
                );
                continue;
            }
            Err(e) => {
                let why = format!(
                    "no leader among {:?} within {} s (--wait-s): {}",
                    args.coordinators,
                    args.wait_s,
                    e.message()
                );
                return Err(InputError(why).into());
            }
        };
        let alive = s.instances.iter().filter(|i| i.alive).count();
        if alive >= want_workers {
            break s;
        }
        if Instant::now() > deadline {
            let why = format!(
                "only {alive} of {want_workers} workers alive after {:.0} s (--wait-s, --min-workers)",
                args.wait_s
            );
            return Err(InputError(why).into());
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let alive = status.instances.iter().filter(|i| i.alive).count();
    say!("leader      {} (store: {}); {alive} workers alive", status.leader, status.store);

    // Replay on the cluster clock.
    let clock = crate::up::replay::status_clock(&status).map_err(|e| anyhow::anyhow!("the leader's status: {e}"))?;
    if !clock.dilation.is_none() {
        say!("time        the cluster runs at time dilation {}: every time reported is emulated", clock.dilation);
    }
    schedule(&mut plan.requests, clock, Duration::from_millis(500));
    let total = plan.requests.len();
    say!("replaying   {total} requests ({}, seed {})", plan.cfg.scheduler.policy, plan.cfg.workload.seed);
    let stats = Arc::new(ReplayStats::default());
    let mut progress = Progress::new(total as u64, args.quiet);
    let timeout = Duration::from_secs_f64(args.timeout_s);
    let give_up = GiveUp::default();
    let mut timed_out = false;
    let results = rt.block_on(async {
        let requests = plan.requests.clone();
        let task = tokio::spawn(replay(finder.clone(), requests, clock, stats.clone(), wait, give_up.clone()));
        while !task.is_finished() {
            tokio::time::sleep(Duration::from_millis(100)).await;
            progress.update(&stats);
            if progress.elapsed() > timeout && !timed_out {
                // Every unfinished request ends with an error naming where it was.
                timed_out = true;
                give_up.give_up(format!("--timeout-s {:.0} passed", args.timeout_s));
            }
        }
        task.await.ok()
    });
    progress.finish();
    let Some(results) = results else { bail!("the replay's client task failed") };
    if timed_out {
        say!(
            "timed out after {:.0} s (--timeout-s) with {} of {total} requests finished",
            args.timeout_s,
            stats.finished.load(Ordering::Relaxed)
        );
    }
    let (ok, failed) = crate::up::replay::partition(results);
    // The leader's view after the run: live migrations and the instances it knows.
    let end = rt.block_on(finder.leader(Duration::from_secs(10))).map(|(_, s)| s).ok();
    let replayed = Replayed {
        ok,
        failed,
        live_log: end.as_ref().map(|s| s.migration_log.clone()).unwrap_or_default(),
        // In emulated time, as every time the records hold.
        span_s: clock.dilation.emulated(progress.elapsed()).as_secs_f64(),
        role_changes: end.as_ref().map(|s| s.role_changes.clone()).unwrap_or_default(),
        handoffs: end.as_ref().map_or(0, |s| s.handoffs),
        handoffs_released: end.as_ref().map_or(0, |s| s.handoffs_released),
        handoffs_overlapped: end.as_ref().map_or(0, |s| s.handoffs_overlapped),
        prefix_fetches: end.as_ref().map_or(0, |s| s.prefix_fetches),
        prefix_fetch_bytes: end.as_ref().map_or(0, |s| s.prefix_fetch_bytes),
    };
    let wall = replayed.span_s;
    let mut outcome = account(&plan.requests, &replayed.ok, replayed.failed.len());
    outcome.resumed = stats.resumed.load(Ordering::Relaxed);
    outcome.retries = stats.retries.load(Ordering::Relaxed);
    outcome.wall_s = wall;
    let run = replayed.run_result(&plan);
    say!("{}", report::summary_table(std::slice::from_ref(&run)));
    say!(
        "{} of {total} requests completed exactly once ({} failed, {} rejected, {} duplicated, {} stale) in {wall:.1} s; {} migrated (at </think> or handed off); {} resumed after a leader change; {} client retries",
        outcome.completed,
        outcome.failed,
        outcome.rejected,
        outcome.duplicates,
        outcome.stale,
        replayed.migrated(),
        outcome.resumed,
        outcome.retries,
    );
    if let Some(s) = &end {
        let ids = |alive: bool| -> Vec<String> {
            s.instances
                .iter()
                .filter(|i| i.alive == alive)
                .filter_map(|i| i.info.as_ref())
                .map(|w| w.instance.to_string())
                .collect()
        };
        say!(
            "leader      {} at the end; instances alive [{}], gone [{}]",
            s.leader,
            ids(true).join(","),
            ids(false).join(",")
        );
    }
    let written = replayed.report(&args.out, &run, !args.no_plots)?;
    let json = serde_json::to_string_pretty(&outcome).expect("plain data");
    std::fs::write(args.out.join("replay.json"), json + "\n").context("writing replay.json")?;
    say!("wrote {} files to {}", written.len() + 1, args.out.display());
    if outcome.stale > 0 {
        say!(
            "  {} records are an earlier run's (same request ids): replay again with another --id-base",
            outcome.stale
        );
    }
    if !outcome.exactly_once {
        bail!(
            "not every request completed exactly once: {} of {total} completed, {} failed, {} rejected, {} duplicated, {} unknown, {} stale",
            outcome.completed,
            outcome.failed,
            outcome.rejected,
            outcome.duplicates,
            outcome.unknown,
            outcome.stale
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(id: u64) -> RequestSpec {
        RequestSpec {
            content_ids: Vec::new(),
            id: RequestId(id),
            arrival: Timestamp(id * 10),
            prompt_tokens: 1,
            reasoning_tokens: 1,
            answer_tokens: 1,
        }
    }

    fn rec(id: u64, rejected: bool) -> RequestRecord {
        RequestRecord { id: RequestId(id), arrival: Timestamp(id * 10), rejected, ..RequestRecord::default() }
    }

    #[test]
    fn exactly_once_accounting_from_a_table() {
        let specs = [spec(1), spec(2), spec(3)];
        let stale = RequestRecord { arrival: Timestamp(7), ..rec(3, false) };
        // (records, failed, completed, rejected, duplicates, unknown, stale, exactly once)
        type Row = (Vec<RequestRecord>, usize, usize, usize, usize, usize, usize, bool);
        let table: Vec<Row> = vec![
            (vec![rec(1, false), rec(2, false), rec(3, false)], 0, 3, 0, 0, 0, 0, true),
            (vec![rec(1, false), rec(2, false)], 1, 2, 0, 0, 0, 0, false),
            (vec![rec(1, false), rec(2, false), rec(3, true)], 0, 2, 1, 0, 0, 0, false),
            (vec![rec(1, false), rec(2, false), rec(2, false), rec(3, false)], 0, 2, 0, 1, 0, 0, false),
            (vec![rec(1, false), rec(2, false), rec(3, false), rec(9, false)], 0, 3, 0, 0, 1, 0, false),
            (vec![rec(1, false), rec(2, false), stale], 0, 2, 0, 0, 0, 1, false),
        ];
        for (i, (records, failed, completed, rejected, duplicates, unknown, stale, once)) in
            table.into_iter().enumerate()
        {
            let o = account(&specs, &records, failed);
            assert_eq!(
                (o.completed, o.rejected, o.duplicates, o.unknown, o.stale, o.exactly_once),
                (completed, rejected, duplicates, unknown, stale, once),
                "row {i}"
            );
        }
    }
}
