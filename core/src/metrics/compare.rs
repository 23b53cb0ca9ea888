//! Tail TTFT of one policy against a baseline, scored as PASCAL §V scores Fig. 10: per
//! reasoning-length bin both runs report, the change `policy / baseline − 1`; the headline is the
//! largest reduction (with the two tails in seconds) and the worst increase, the means secondary.
//!
//! Increases are also taken over the bins a comparison trusts: bins below the demotion threshold
//! (demoted requests follow a different path) holding at least [`MIN_TRUSTED_SAMPLES`] samples in
//! both runs. [`SeedRange`] folds the same figure over several seeds into mean, min and max.

use super::tail::TailBin;
use serde::Serialize;

/// Fewest samples a bin needs, in both runs, for its increase to count as a trusted worst case.
pub const MIN_TRUSTED_SAMPLES: u64 = 10;

/// One bin's tails in the two runs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct BinChange {
    /// The bin's smallest reasoning length, tokens.
    pub lo: u32,
    /// The policy's tail TTFT in the bin, seconds.
    pub policy_s: f64,
    /// The baseline's tail TTFT in the bin, seconds.
    pub baseline_s: f64,
    /// `policy_s / baseline_s − 1` (negative: the policy is faster).
    pub change: f64,
}

/// How a policy's binned tail TTFT compares with a baseline's in one run pair.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TailComparison {
    /// Bins both runs report (with a baseline tail above zero).
    pub bins: usize,
    /// Bins where the policy's tail is lower.
    pub bins_improved: usize,
    /// The bin with the largest reduction (the most negative change).
    pub max_reduction: BinChange,
    /// The bin with the largest increase over all shared bins (the least negative change when
    /// the policy is faster everywhere).
    pub worst_increase: BinChange,
    /// The same over trusted bins (below the demotion threshold, ≥ [`MIN_TRUSTED_SAMPLES`] samples
    /// in both runs); `None` when no bin qualifies.
    pub worst_trusted_increase: Option<BinChange>,
    /// The worst change over the bins at or above the demotion threshold, reported apart.
    pub worst_demoted_increase: Option<BinChange>,
    /// Mean of the per-bin changes.
    pub mean_change: f64,
    /// `Σ policy tails / Σ baseline tails − 1` over the shared bins.
    pub sum_of_tails_change: f64,
}

/// Compares `policy`'s tail bins with `baseline`'s; `None` when they share no bin.
/// `demotion_tokens`: bins starting at or above it are left out of the trusted worst case.
pub fn compare_tails(policy: &[TailBin], baseline: &[TailBin], demotion_tokens: u32) -> Option<TailComparison> {
    let mut shared: Vec<(BinChange, bool, bool)> = Vec::new();
    for p in policy {
        let Some(b) = baseline.iter().find(|b| b.lo == p.lo) else { continue };
        if !(b.ttft_s > 0.0 && p.ttft_s.is_finite() && b.ttft_s.is_finite()) {
            continue;
        }
        let change =
            BinChange { lo: p.lo, policy_s: p.ttft_s, baseline_s: b.ttft_s, change: p.ttft_s / b.ttft_s - 1.0 };
        let demoted = p.lo >= demotion_tokens;
        let trusted = !demoted && p.samples.min(b.samples) >= MIN_TRUSTED_SAMPLES;
        shared.push((change, trusted, demoted));
    }
    let by_change = |a: &&BinChange, b: &&BinChange| a.change.total_cmp(&b.change);
    let all = || shared.iter().map(|(c, _, _)| c);
    let max_reduction = *all().min_by(by_change)?;
    let worst_increase = *all().max_by(by_change)?;
    let worst_trusted_increase = shared.iter().filter(|s| s.1).map(|(c, _, _)| c).max_by(by_change).copied();
    let worst_demoted_increase = shared.iter().filter(|s| s.2).map(|(c, _, _)| c).max_by(by_change).copied();
    let n = shared.len();
    let sum = |f: fn(&BinChange) -> f64| all().map(f).sum::<f64>();
    Some(TailComparison {
        bins: n,
        bins_improved: all().filter(|c| c.change < 0.0).count(),
        max_reduction,
        worst_increase,
        worst_trusted_increase,
        worst_demoted_increase,
        mean_change: sum(|c| c.change) / n as f64,
        sum_of_tails_change: sum(|c| c.policy_s) / sum(|c| c.baseline_s) - 1.0,
    })
}

/// One figure over several seeds: the mean and the range.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct SeedRange {
    /// Mean over the seeds that have the figure.
    pub mean: f64,
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
    /// Seeds that have the figure.
    pub n: usize,
}

impl SeedRange {
    /// Folds the finite values; `None` when there are none.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Option<SeedRange> {
        let v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
        let first = *v.first()?;
        let (min, max) = v.iter().fold((first, first), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        Some(SeedRange { mean: v.iter().sum::<f64>() / v.len() as f64, min, max, n: v.len() })
    }

    /// `mean [min … max]`, each through `fmt` (a single value when all seeds agree or n = 1).
    pub fn show(&self, fmt: impl Fn(f64) -> String) -> String {
        if self.n == 1 || self.min == self.max {
            fmt(self.mean)
        } else {
            format!("{} [{} … {}]", fmt(self.mean), fmt(self.min), fmt(self.max))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::tail::TailStatistic;

    fn bins(rows: &[(u32, u64, f64)]) -> Vec<TailBin> {
        rows.iter()
            .map(|&(lo, samples, ttft_s)| TailBin { lo, hi: lo + 255, samples, statistic: TailStatistic::P95, ttft_s })
            .collect()
    }

    #[test]
    fn headline_figures_come_from_the_extreme_bins() {
        // (lo, samples, tail s). Bin 512 only in the policy run, bin 1024 a baseline of 0: ignored.
        let policy =
            bins(&[(0, 50, 4.0), (256, 40, 6.0), (512, 30, 1.0), (768, 5, 13.0), (1024, 20, 1.0), (5120, 12, 30.0)]);
        let baseline = bins(&[(0, 50, 10.0), (256, 40, 5.0), (768, 5, 10.0), (1024, 20, 0.0), (5120, 12, 20.0)]);
        let c = compare_tails(&policy, &baseline, 5000).unwrap();
        assert_eq!(c.bins, 4);
        assert_eq!(c.bins_improved, 1);
        assert_eq!((c.max_reduction.lo, c.max_reduction.policy_s, c.max_reduction.baseline_s), (0, 4.0, 10.0));
        assert!((c.max_reduction.change + 0.6).abs() < 1e-12);
        // The worst bin overall is the demoted one (+50 %); among trusted bins (≥ 10 samples,
        // below 5000) it is bin 256 (+20 %): bin 768 (+30 %) has too few samples.
        assert_eq!(c.worst_increase.lo, 5120);
        assert_eq!(c.worst_trusted_increase.map(|b| b.lo), Some(256));
        assert!((c.worst_trusted_increase.unwrap().change - 0.2).abs() < 1e-12);
        assert_eq!(c.worst_demoted_increase.map(|b| b.lo), Some(5120));
        let mean = (-0.6 + 0.2 + 0.3 + 0.5) / 4.0;
        assert!((c.mean_change - mean).abs() < 1e-12, "{}", c.mean_change);
        assert!((c.sum_of_tails_change - (53.0 / 45.0 - 1.0)).abs() < 1e-12);
    }

    #[test]
    fn no_shared_bin_no_comparison() {
        assert_eq!(compare_tails(&bins(&[(0, 9, 1.0)]), &bins(&[(256, 9, 1.0)]), 5000), None);
        assert_eq!(compare_tails(&[], &[], 5000), None);
        let only_low = compare_tails(&bins(&[(0, 9, 1.0)]), &bins(&[(0, 9, 2.0)]), 5000).unwrap();
        assert_eq!(only_low.worst_trusted_increase, None, "9 samples is below the trusted minimum");
    }

    #[test]
    fn seed_ranges() {
        let r = SeedRange::of([-0.5, f64::NAN, -0.3, -0.4]).unwrap();
        assert_eq!((r.n, r.min, r.max), (3, -0.5, -0.3));
        assert!((r.mean + 0.4).abs() < 1e-12);
        assert_eq!(r.show(|x| format!("{:.0}%", 100.0 * x)), "-40% [-50% … -30%]");
        assert_eq!(SeedRange::of([2.0]).unwrap().show(|x| format!("{x}")), "2");
        assert_eq!(SeedRange::of([f64::INFINITY]), None);
    }
}
