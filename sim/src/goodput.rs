//! The goodput search (`[sweep.goodput]`): the highest arrival-rate scale at which a setup's SLO
//! attainment is still at least a target.
//!
//! Arrivals are scaled by `workload.rate_scale` (a trace's timestamps compressed or stretched, a
//! synthetic process's rate multiplied). The search runs a coarse log grid of scales 2^k,
//! k = −`octaves`…`octaves`, takes the highest bracket [2^k, 2^(k+1)] whose lower end meets the
//! target and upper end does not (attainment need not be monotone in the rate: the highest
//! crossing counts), then bisects it geometrically until its ends are within `rel_tol` of each
//! other. The goodput is the bracket's lower end: the highest scale measured to meet the target.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `[sweep.goodput]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GoodputConfig {
    /// Attainment a rate must reach (share of requests within the TTFT and TPOT SLOs), (0, 1].
    pub target: f64,
    /// Relative width at which the bisection stops, (0, 1).
    pub rel_tol: f64,
    /// Grid half-width in octaves: scales 2^−octaves … 2^octaves of the workload's rate.
    pub octaves: u32,
    /// The setups compared, by name: each a list of `--set` overrides (e.g. `arrow =
    /// ["pd.policy=arrow"]`). Empty: one setup per `[sweep] policies` entry.
    pub setups: BTreeMap<String, Vec<String>>,
    /// The setup the others' goodputs are divided by (default: the first by name, or the first
    /// policy).
    pub baseline: Option<String>,
}

impl Default for GoodputConfig {
    fn default() -> Self {
        GoodputConfig { target: 0.9, rel_tol: 0.02, octaves: 6, setups: BTreeMap::new(), baseline: None }
    }
}

/// Most octaves either side of the workload's rate.
pub const MAX_OCTAVES: u32 = 20;

impl GoodputConfig {
    /// Every field in range; `policies` are `[sweep] policies` (the setups when none are named).
    pub fn validate(&self, policies: &[String]) -> Result<(), String> {
        if !(self.target > 0.0 && self.target <= 1.0) {
            return Err(format!("`sweep.goodput.target` must be in (0, 1], got {}", self.target));
        }
        if !(self.rel_tol > 0.0 && self.rel_tol < 1.0) {
            return Err(format!("`sweep.goodput.rel_tol` must be in (0, 1), got {}", self.rel_tol));
        }
        if self.octaves > MAX_OCTAVES {
            return Err(format!("`sweep.goodput.octaves` must be at most {MAX_OCTAVES}, got {}", self.octaves));
        }
        if let Some(b) = &self.baseline {
            let known = if self.setups.is_empty() { policies.contains(b) } else { self.setups.contains_key(b) };
            if !known {
                return Err(format!("`sweep.goodput.baseline` = `{b}` is not one of the setups compared"));
            }
        }
        Ok(())
    }

    /// The setups by name with their overrides, in order (named setups, else one per policy,
    /// which sets `scheduler.policy`).
    pub fn setup_list(&self, policies: &[String]) -> Vec<(String, Vec<String>)> {
        if self.setups.is_empty() {
            policies.iter().map(|p| (p.clone(), vec![format!("scheduler.policy=\"{p}\"")])).collect()
        } else {
            self.setups.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        }
    }
}

/// One run of the search.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Probe {
    /// The rate scale run.
    pub scale: f64,
    /// Its SLO attainment.
    pub attainment: f64,
}

/// What the search found.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Goodput {
    /// The highest scale measured to meet the target; `None` when even the grid's lowest does
    /// not.
    pub scale: Option<f64>,
    /// The grid's highest scale met the target: the goodput is at least `scale`, not bracketed.
    pub at_least: bool,
    /// Every run, in the order run.
    pub probes: Vec<Probe>,
}

/// Search as the module doc says; `attainment(scale)` runs the setup at that rate scale.
pub fn search<E>(cfg: &GoodputConfig, mut attainment: impl FnMut(f64) -> Result<f64, E>) -> Result<Goodput, E> {
    let mut probes = Vec::new();
    let mut run = |scale: f64, probes: &mut Vec<Probe>| -> Result<bool, E> {
        let a = attainment(scale)?;
        probes.push(Probe { scale, attainment: a });
        Ok(a >= cfg.target)
    };
    let n = cfg.octaves as i32;
    let grid: Vec<f64> = (-n..=n).map(|k| 2f64.powi(k)).collect();
    let mut passes = Vec::with_capacity(grid.len());
    for &s in &grid {
        passes.push(run(s, &mut probes)?);
    }
    if passes.last() == Some(&true) {
        return Ok(Goodput { scale: grid.last().copied(), at_least: true, probes });
    }
    // The highest k that meets the target with k + 1 failing.
    let Some(k) = (0..grid.len() - 1).rev().find(|&k| passes[k] && !passes[k + 1]) else {
        return Ok(Goodput { scale: None, at_least: false, probes });
    };
    let (mut lo, mut hi) = (grid[k], grid[k + 1]);
    while hi / lo - 1.0 > cfg.rel_tol {
        let mid = (lo * hi).sqrt();
        if run(mid, &mut probes)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(Goodput { scale: Some(lo), at_least: false, probes })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn find(cfg: &GoodputConfig, f: impl Fn(f64) -> f64) -> Goodput {
        search::<()>(cfg, |s| Ok(f(s))).unwrap()
    }

    #[test]
    fn a_falling_attainment_is_bracketed_to_the_tolerance() {
        let cfg = GoodputConfig::default();
        // Attainment 1 − s/10: 90 % at s = 1.
        let g = find(&cfg, |s| 1.0 - s / 10.0);
        let s = g.scale.unwrap();
        assert!((1.0 / 1.02..=1.0).contains(&s), "{s}");
        assert!(!g.at_least);
        // 13 grid points, then ln(2)/ln(1.02) → 6 halvings of the bracket in log space.
        assert_eq!(g.probes.len(), 13 + 6);
        // The answer met the target where it was measured.
        assert!(g.probes.iter().any(|p| p.scale == s && p.attainment >= 0.9));
    }

    #[test]
    fn the_highest_crossing_counts_and_the_ends_are_reported() {
        let cfg = GoodputConfig { rel_tol: 0.01, ..GoodputConfig::default() };
        // Fails around 0.25, recovers, and fails for good past 4 (a dip, as Arrow's flips make).
        let dip = |s: f64| if (0.2..0.3).contains(&s) || s > 4.0 { 0.5 } else { 0.95 };
        let s = find(&cfg, dip).scale.unwrap();
        assert!((4.0 / 1.01..=4.0).contains(&s), "{s}");
        assert_eq!(find(&cfg, |_| 0.1).scale, None);
        let all = find(&cfg, |_| 1.0);
        assert_eq!((all.scale, all.at_least), (Some(64.0), true));
    }

    #[test]
    fn bad_settings_name_the_field() {
        let p = vec!["fcfs".to_string()];
        for (cfg, field) in [
            (GoodputConfig { target: 0.0, ..Default::default() }, "target"),
            (GoodputConfig { target: 1.5, ..Default::default() }, "target"),
            (GoodputConfig { rel_tol: 0.0, ..Default::default() }, "rel_tol"),
            (GoodputConfig { rel_tol: f64::NAN, ..Default::default() }, "rel_tol"),
            (GoodputConfig { octaves: 99, ..Default::default() }, "octaves"),
            (GoodputConfig { baseline: Some("pascal".into()), ..Default::default() }, "baseline"),
        ] {
            let e = cfg.validate(&p).unwrap_err();
            assert!(e.contains(field), "{e}");
        }
        assert!(GoodputConfig { baseline: Some("fcfs".into()), ..Default::default() }.validate(&p).is_ok());
    }
}
