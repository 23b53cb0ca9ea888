//! Leaping over quiet iterations (`[simulator] leap_iterations`, on by default) changes nothing a
//! run computes: every shipped example, each of its policies at its highest rate and two seeds,
//! gives the same records, migrations, engine counters and event count leaping and stepping.

use kvfleet_sim::config::SimConfig;
use kvfleet_sim::{run_one, RunResult};
use std::path::{Path, PathBuf};

/// The repository root (examples name their traces relative to it).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("sim/ sits in the repository").to_path_buf()
}

/// Requests per run: enough for queues, preemptions and migrations on every example, small
/// enough for a debug build.
const REQUESTS: u64 = 200;

fn run(cfg: &SimConfig, base: &Path, policy: &str, rate: Option<f64>, leap: bool) -> RunResult {
    let mut cfg = cfg.clone();
    cfg.simulator.leap_iterations = leap;
    run_one(&cfg, policy, rate, base, |_| {}).unwrap_or_else(|e| panic!("{policy} at {rate:?}: {e}"))
}

/// Runs each example leaping and stepping; returns how many events the leaping runs skipped.
fn compare(examples: &[&str]) -> u64 {
    examples.iter().map(|e| compare_one(e)).sum()
}

fn compare_one(example: &str) -> u64 {
    let path = root().join("examples").join(example);
    let base = path.parent().expect("in examples/").to_path_buf();
    let mut cfg = SimConfig::load(&path).unwrap_or_else(|e| panic!("{example}: {e}"));
    cfg.workload.num_requests = Some(REQUESTS);
    cfg.workload.duration_s = None;
    let (policies, rate) = match &cfg.sweep {
        Some(s) => (s.policies.clone(), s.rates.iter().copied().reduce(f64::max)),
        None => (vec![cfg.scheduler.policy.clone()], None),
    };
    let mut skipped = 0;
    for seed in [cfg.workload.seed, cfg.workload.seed + 1] {
        let cfg = cfg.with_seed(seed);
        for policy in &policies {
            let (leaping, stepping) = (run(&cfg, &base, policy, rate, true), run(&cfg, &base, policy, rate, false));
            assert_eq!(stepping.queue_events, stepping.events, "{example} {policy}: stepping handles every event");
            assert!(leaping.same_outcome(&stepping), "{example}, {policy}, seed {seed}: leaping changed the results");
            skipped += stepping.queue_events - leaping.queue_events;
        }
    }
    skipped
}

#[test]
fn pascal_examples_leap_to_the_same_results() {
    let skipped =
        compare(&["pascal-8xh100.toml", "servegen-8xh100.toml", "pascal-edge-4x.toml", "parity-migration.toml"]);
    // The comparison means something only if leaps happened.
    assert!(skipped > 10_000, "only {skipped} events leapt over");
}

#[test]
fn prefix_and_trace_examples_leap_to_the_same_results() {
    let skipped =
        compare(&["prefix-synthetic.toml", "prefix-cache-aware.toml", "prefix-multi-turn.toml", "parity-trace.toml"]);
    assert!(skipped > 1_000, "only {skipped} events leapt over");
}

#[test]
fn disaggregated_examples_run_the_same() {
    // The controller reads decode progress under prefill/decode disaggregation: no leaps, and
    // the switch changes nothing.
    compare(&["pd-static.toml", "pd-arrow.toml"]);
}
