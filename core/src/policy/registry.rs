//! Instance policies by name, for configs and the CLI (`--policy pascal`).
//!
//! Names follow PASCAL's evaluation: `pascal` (§IV-B), its §V-D ablations `pascal-nonadaptive` and
//! `pascal-nomigration`, and the baselines of [`super::baselines`].

use super::baselines::{LeastKv, Random, RoundRobin};
use super::cache_aware::{CacheAware, DEFAULT_FETCH_THRESHOLD};
use super::pascal::{MigrationMode, PascalPolicy, TieBreak, DEFAULT_HEADROOM_BLOCKS};
use super::prefix::{KvOverlap, PascalKv, PrecisePrefix};
use super::{InstancePolicy, PrefixIndexMode};
use serde::{Deserialize, Serialize};

const POLICY_NAMES: &[&str] = &[
    "pascal",
    "pascal-nonadaptive",
    "pascal-nomigration",
    "least-kv",
    "round-robin",
    "random",
    "kv-overlap",
    "precise-prefix",
    "pascal-kv",
    "cache-aware",
];

/// Why [`build_policy`] failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// No instance policy has this name.
    #[error("unknown instance policy `{name}` (valid: {valid})")]
    Unknown {
        /// The name asked for.
        name: String,
        /// The accepted names, comma-separated.
        valid: String,
    },
}

/// Tunables shared by the policies (TOML table `[policy]` or CLI flags); each has a default.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyParams {
    /// PASCAL adaptive migration: free GPU blocks, beyond the request's own KV, that make an
    /// instance's memory "sufficient" for the answering phase.
    pub headroom_blocks: u32,
    /// Fidelity switch (default off, the literal reading): adaptive migration's "sufficient GPU
    /// memory" counts free GPU blocks less the reasoning requests already waiting for them here
    /// ([`super::LoadReport::reasoning_demand_blocks`]), on the current instance and the target.
    #[serde(default)]
    pub demand_aware_memory: bool,
    /// Extension, not in the paper (default `lowest-id`): how Alg. 2 breaks ties on r_i;
    /// `most-free-gpu` prefers the instance with the most free GPU blocks.
    #[serde(default)]
    pub alg2_tie_break: TieBreak,
    /// How prefix-aware policies (`kv-overlap`) learn where prefixes are cached: `precise`
    /// (instances' KV events) or `approx` (from placements alone).
    #[serde(default)]
    pub prefix_index: PrefixIndexMode,
    /// `cache-aware`'s θ: an instance fetches the missing prefix from the best holder when that
    /// holder has more than θ times its cached blocks (> 1; default 2.0).
    #[serde(default = "default_fetch_threshold")]
    pub fetch_threshold: f64,
}

fn default_fetch_threshold() -> f64 {
    DEFAULT_FETCH_THRESHOLD
}

impl Default for PolicyParams {
    fn default() -> Self {
        PolicyParams {
            headroom_blocks: DEFAULT_HEADROOM_BLOCKS,
            demand_aware_memory: false,
            alg2_tie_break: TieBreak::LowestId,
            prefix_index: PrefixIndexMode::default(),
            fetch_threshold: DEFAULT_FETCH_THRESHOLD,
        }
    }
}

impl PolicyParams {
    /// The ranges each tunable must lie in; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        let theta = self.fetch_threshold;
        if !(theta.is_finite() && theta > 1.0) {
            return Err(format!("`fetch_threshold` must be a number > 1, got {theta}"));
        }
        Ok(())
    }
}

/// Every name [`build_policy`] accepts.
pub fn policy_names() -> &'static [&'static str] {
    POLICY_NAMES
}

/// Build the policy called `name`.
pub fn build_policy(name: &str, params: &PolicyParams) -> Result<Box<dyn InstancePolicy>, PolicyError> {
    let pascal = |mode| {
        Box::new(
            PascalPolicy::new(mode, params.headroom_blocks)
                .with_demand_aware_memory(params.demand_aware_memory)
                .with_tie_break(params.alg2_tie_break),
        ) as Box<dyn InstancePolicy>
    };
    Ok(match name {
        "pascal" => pascal(MigrationMode::Adaptive),
        "pascal-nonadaptive" => pascal(MigrationMode::NonAdaptive),
        "pascal-nomigration" => pascal(MigrationMode::NoMigration),
        "least-kv" => Box::new(LeastKv),
        "round-robin" => Box::new(RoundRobin::default()),
        "random" => Box::new(Random),
        "kv-overlap" => Box::new(KvOverlap::default().with_index(params.prefix_index)),
        "precise-prefix" => Box::new(PrecisePrefix::with_index(params.prefix_index)),
        "pascal-kv" => Box::new(PascalKv::new(
            PascalPolicy::new(MigrationMode::Adaptive, params.headroom_blocks)
                .with_demand_aware_memory(params.demand_aware_memory)
                .with_tie_break(params.alg2_tie_break),
            KvOverlap::default().with_index(params.prefix_index),
        )),
        "cache-aware" => Box::new(CacheAware::new(params.fetch_threshold)),
        _ => return Err(PolicyError::Unknown { name: name.into(), valid: POLICY_NAMES.join(", ") }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{InstanceId, RequestId};
    use crate::policy::pascal::tests::{load, With};
    use crate::policy::{PhaseChange, PhaseDecision};
    use crate::rng::SimRng;

    #[test]
    fn every_name_builds_and_reports_its_name() {
        for &name in policy_names() {
            let policy = build_policy(name, &PolicyParams::default()).expect(name);
            assert_eq!(policy.name(), name);
        }
    }

    #[test]
    fn unknown_name_lists_valid_names() {
        let err = build_policy("pascl", &PolicyParams::default()).expect_err("must fail");
        let msg = err.to_string();
        assert!(msg.contains("`pascl`"), "{msg}");
        for name in policy_names() {
            assert!(msg.contains(name), "{msg} lacks {name}");
        }
    }

    #[test]
    fn params_parse_with_defaults_and_reject_unknown_fields() {
        let empty: PolicyParams = toml::from_str("").expect("empty table");
        assert_eq!(empty, PolicyParams::default());
        let set: PolicyParams = toml::from_str("headroom_blocks = 4").expect("valid");
        assert_eq!(set.headroom_blocks, 4);
        let err = toml::from_str::<PolicyParams>("headroom = 4").expect_err("unknown field");
        assert!(err.to_string().contains("headroom"), "{err}");
        assert!(toml::from_str::<PolicyParams>("headroom_blocks = -1").is_err());
        let set: PolicyParams =
            toml::from_str("demand_aware_memory = true\nalg2_tie_break = \"most-free-gpu\"").expect("valid");
        assert!(set.demand_aware_memory && set.alg2_tie_break == TieBreak::MostFreeGpu);
        assert!(toml::from_str::<PolicyParams>("alg2_tie_break = \"random\"").is_err());
    }

    #[test]
    fn demand_aware_memory_reaches_the_policy() {
        // Current 0 has 100 free blocks, 90 of them wanted by its waiting reasoning requests;
        // target 1 is full. The request holds 40.
        let mut current = load(0, true).queues(2, 0).gpu_free(100);
        current.reasoning_demand_blocks = 90;
        let loads = vec![current, load(1, true).queues(0, 0).gpu_free(0)];
        let change = PhaseChange { request: RequestId(1), current: InstanceId(0), kv_blocks: 40 };
        let decide = |demand_aware_memory| {
            let params = PolicyParams { demand_aware_memory, ..PolicyParams::default() };
            build_policy("pascal", &params).expect("pascal").on_phase_change(
                &change,
                &loads,
                &mut SimRng::seed_from_u64(0),
            )
        };
        assert_eq!(decide(false), PhaseDecision::Stay);
        assert_eq!(decide(true), PhaseDecision::Migrate { to: InstanceId(1) });
    }

    #[test]
    fn headroom_reaches_the_policy() {
        // Current instance has 0 free blocks; target has 5 but the request needs 10.
        let loads = vec![load(0, true).queues(2, 0).gpu_free(0), load(1, true).queues(0, 0).gpu_free(5)];
        let change = PhaseChange { request: RequestId(1), current: InstanceId(0), kv_blocks: 10 };
        let decide = |headroom_blocks| {
            let mut p =
                build_policy("pascal", &PolicyParams { headroom_blocks, ..PolicyParams::default() }).expect("pascal");
            p.on_phase_change(&change, &loads, &mut SimRng::seed_from_u64(0))
        };
        // headroom 0: current (0 free) suffices, target (5 < 10) does not -> stay.
        assert_eq!(decide(0), PhaseDecision::Stay);
        // default 16: current is short too -> follow Alg. 2.
        assert_eq!(decide(16), PhaseDecision::Migrate { to: InstanceId(1) });
    }
}
