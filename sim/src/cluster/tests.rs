//! The event loop with the cluster controller: decisions the simulator must make like the
//! coordinator does.

use super::*;
use crate::config::{resolve_policy, SimConfig};
use kvfleet_core::policy::registry::build_policy;
use std::path::Path;

fn run(policy: &str, instances: u32, requests: &[RequestSpec]) -> ClusterOutcome {
    let mut cfg = SimConfig::default();
    cfg.cluster.instances = instances;
    let (intra, inst) = resolve_policy(policy).unwrap();
    let (model, gpu) = cfg.specs().unwrap();
    let engine = cfg.engine_config(&model, &gpu).unwrap();
    let timing = crate::timing_model(&cfg, Path::new(".")).unwrap();
    let policy = build_policy(&inst, &cfg.scheduler.instance).unwrap();
    let cluster =
        Cluster::new(instances, &engine, timing, &intra, &cfg.scheduler.intra, policy, cfg.link.clone(), 0).unwrap();
    cluster.run(requests, |_| {})
}

fn burst(n: u64, prompt: u32) -> Vec<RequestSpec> {
    (0..n)
        .map(|id| RequestSpec {
            id: RequestId(id),
            arrival: SimTime::ZERO,
            prompt_tokens: prompt,
            reasoning_tokens: 100,
            answer_tokens: 50,
        })
        .collect()
}

#[test]
fn simultaneous_arrivals_land_on_distinct_idle_instances() {
    for policy in ["pascal", "pascal+least-kv", "fcfs"] {
        let out = run(policy, 8, &burst(8, 4000));
        let mut on: Vec<u32> = out.records.iter().map(|r| r.placed_on.0).collect();
        on.sort_unstable();
        assert_eq!(on, (0..8).collect::<Vec<_>>(), "{policy}");
        assert!(out.records.iter().all(|r| !r.rejected && r.finish.is_some()), "{policy}: all finished");
    }
}
