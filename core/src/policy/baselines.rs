//! Baseline instance-level policies that never migrate.
//!
//! - [`LeastKv`]: smallest KV footprint (GPU + CPU). PASCAL §V-A pairs its FCFS and RR intra-instance
//!   baselines with this placement, so comparisons isolate the phase-aware parts of PASCAL.
//! - [`RoundRobin`]: cycles through instances in id order.
//! - [`Random`]: uniform over the reported instances, drawn from the rng the driver passes in.
//!
//! All three are allocation-free and ignore the SLO flag and queue lengths by design.

use super::{InstancePolicy, LoadReport};
use crate::ids::InstanceId;
use crate::request::RequestSpec;
use crate::rng::SimRng;

/// Place on the instance with the smallest KV footprint; ties to the lowest id; never migrate.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeastKv;

impl InstancePolicy for LeastKv {
    fn name(&self) -> &str {
        "least-kv"
    }
    fn place(&mut self, _request: &RequestSpec, loads: &[LoadReport], _rng: &mut SimRng) -> InstanceId {
        debug_assert!(!loads.is_empty(), "place() needs at least one instance");
        loads.iter().min_by_key(|l| (l.kv_footprint_bytes(), l.instance)).map(|l| l.instance).unwrap_or_default()
    }
}

/// Cycle over instances in increasing id order, whatever order `loads` lists them in.
///
/// The cursor is the last id chosen, not an index, so instances joining or leaving between calls
/// do not make the cycle skip or repeat the others.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RoundRobin {
    last: Option<InstanceId>,
}

impl InstancePolicy for RoundRobin {
    fn name(&self) -> &str {
        "round-robin"
    }
    fn place(&mut self, _request: &RequestSpec, loads: &[LoadReport], _rng: &mut SimRng) -> InstanceId {
        debug_assert!(!loads.is_empty(), "place() needs at least one instance");
        let ids = loads.iter().map(|l| l.instance);
        // The smallest id after the last one chosen, wrapping to the smallest id overall.
        let next = match self.last {
            Some(last) => ids.clone().filter(|&id| id > last).min().or_else(|| ids.min()),
            None => ids.min(),
        };
        let chosen = next.unwrap_or_default();
        self.last = Some(chosen);
        chosen
    }
}

/// Uniformly random placement (one `rng.below(n)` draw per request).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Random;

impl InstancePolicy for Random {
    fn name(&self) -> &str {
        "random"
    }
    fn place(&mut self, _request: &RequestSpec, loads: &[LoadReport], rng: &mut SimRng) -> InstanceId {
        debug_assert!(!loads.is_empty(), "place() needs at least one instance");
        if loads.is_empty() {
            return InstanceId::default();
        }
        loads[rng.below(loads.len() as u64) as usize].instance
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::RequestId;
    use crate::policy::pascal::tests::{load, request, With};
    use crate::policy::{PhaseChange, PhaseDecision};

    fn picks(policy: &mut dyn InstancePolicy, loads: &[LoadReport], n: usize, seed: u64) -> Vec<u32> {
        let mut rng = SimRng::seed_from_u64(seed);
        (0..n).map(|_| policy.place(&request(), loads, &mut rng).0).collect()
    }

    #[test]
    fn least_kv_table() {
        let cases: Vec<(&str, Vec<LoadReport>, u32)> = vec![
            ("min footprint, SLO flag ignored", vec![load(0, true).kv(10, 0), load(1, false).kv(2, 0)], 1),
            ("CPU blocks count", vec![load(0, true).kv(4, 6), load(1, true).kv(8, 0)], 1),
            ("tie to lowest id", vec![load(3, true).kv(5, 0), load(1, true).kv(5, 0), load(2, true).kv(6, 0)], 1),
        ];
        for (name, loads, want) in cases {
            assert_eq!(picks(&mut LeastKv, &loads, 1, 0), vec![want], "{name}");
        }
    }

    #[test]
    fn round_robin_cycles_in_id_order() {
        let cases: Vec<(&str, Vec<u32>, Vec<u32>)> = vec![
            ("in order", vec![0, 1, 2], vec![0, 1, 2, 0, 1, 2, 0]),
            ("listed out of order", vec![2, 0, 1], vec![0, 1, 2, 0, 1]),
            ("sparse ids", vec![5, 9, 1], vec![1, 5, 9, 1]),
            ("one instance", vec![4], vec![4, 4, 4]),
        ];
        for (name, ids, want) in cases {
            let loads: Vec<_> = ids.iter().map(|&i| load(i, true)).collect();
            assert_eq!(picks(&mut RoundRobin::default(), &loads, want.len(), 0), want, "{name}");
        }
        // Membership changes between calls: the cycle continues after the last chosen id.
        let mut rr = RoundRobin::default();
        let all: Vec<_> = (0..3).map(|i| load(i, true)).collect();
        assert_eq!(picks(&mut rr, &all, 2, 0), vec![0, 1]);
        let without_2 = vec![load(0, true), load(1, true)];
        assert_eq!(picks(&mut rr, &without_2, 1, 0), vec![0]);
        let with_3 = vec![load(0, true), load(1, true), load(3, true)];
        assert_eq!(picks(&mut rr, &with_3, 3, 0), vec![1, 3, 0]);
    }

    #[test]
    fn random_is_seeded_and_covers_all() {
        let loads: Vec<_> = (0..4).map(|i| load(i, true)).collect();
        let a = picks(&mut Random, &loads, 400, 11);
        assert_eq!(a, picks(&mut Random, &loads, 400, 11), "same seed, same picks");
        assert_ne!(a, picks(&mut Random, &loads, 400, 12), "different seeds differ");
        for id in 0..4 {
            let n = a.iter().filter(|&&x| x == id).count();
            assert!((60..=140).contains(&n), "instance {id} picked {n}/400 times");
        }
    }

    #[test]
    fn baselines_never_migrate() {
        let loads: Vec<_> = (0..3).map(|i| load(i, true).queues(0, 0)).collect();
        let change = PhaseChange { request: RequestId(1), current: InstanceId(2), kv_blocks: 10 };
        let mut rng = SimRng::seed_from_u64(0);
        let policies: [&mut dyn InstancePolicy; 3] = [&mut LeastKv, &mut RoundRobin::default(), &mut Random];
        for p in policies {
            assert!(!p.migrates_at_phase_boundary(), "{}", p.name());
            assert_eq!(p.on_phase_change(&change, &loads, &mut rng), PhaseDecision::Stay, "{}", p.name());
        }
    }
}
