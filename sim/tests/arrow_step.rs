//! The shipped Arrow emulator example (`examples/arrow-up.toml`) in the simulator: its rate step
//! (1 → 5 → 1 req/s) is what makes Arrow flip prefill instances to decode, one per cooldown while
//! the high rate lasts; the same cluster at the low rate throughout flips nothing.

use kvfleet_core::workload::{ArrivalConfig, RatePhase};
use kvfleet_sim::config::SimConfig;
use kvfleet_sim::run_one;
use std::path::Path;

fn example() -> SimConfig {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/arrow-up.toml");
    SimConfig::load(&path).expect("examples/arrow-up.toml")
}

/// (role change times in seconds of the run, roles, requests arrived in each phase)
fn run(cfg: &SimConfig) -> (Vec<f64>, Vec<String>, [usize; 3]) {
    let r = run_one(cfg, &cfg.scheduler.policy, None, Path::new(env!("CARGO_MANIFEST_DIR")), |_| {}).expect("runs");
    assert_eq!(r.records.len(), r.summary.requests_finished as usize, "every request finished");
    let mut phases = [0; 3];
    for rec in &r.records {
        let t = rec.arrival.as_secs_f64();
        phases[usize::from(t >= 15.0) + usize::from(t >= 30.0)] += 1;
    }
    (r.role_changes.iter().map(|c| c.at_s).collect(), r.role_changes.iter().map(|c| c.role.clone()).collect(), phases)
}

#[test]
fn the_rate_step_makes_arrow_flip_prefill_instances_to_decode() {
    let cfg = example();
    let cooldown = cfg.pd.arrow.cooldown_s;
    let (at, roles, phases) = run(&cfg);
    // 15 s at 1 req/s, 15 s at 5, 20 s at 1
    assert!(
        (8..=25).contains(&phases[0]) && (55..=95).contains(&phases[1]) && (12..=30).contains(&phases[2]),
        "{phases:?}"
    );
    assert_eq!(roles, ["decode"; 3], "flips at {at:?}");
    assert!(at.iter().all(|&t| (15.0..30.0).contains(&t)), "while the rate is high: {at:?}");
    assert!(at.windows(2).all(|w| w[1] - w[0] >= cooldown - 1e-9), "one per cooldown: {at:?}");

    let mut flat = cfg.clone();
    flat.workload.arrivals = ArrivalConfig::Steps { cv: None, phases: vec![RatePhase { rate: 1.0, duration_s: 50.0 }] };
    let (at, _, phases) = run(&flat);
    assert!(at.is_empty(), "no step, no flip: {at:?} ({phases:?} arrivals)");
}
