//! Nearest-rank percentiles and a sorted sample set, the building blocks of every latency
//! statistic in [`super::summary`] and the tail bins of [`super::tail`] (PASCAL Fig. 10).
//!
//! Definition (nearest rank): for `n` values sorted ascending `x[0] ≤ … ≤ x[n−1]` and
//! `q ∈ [0, 1]`, `P_q = x[ceil(q·n) − 1]`, with the index clamped to `[0, n − 1]` (so `P_0` is
//! the minimum and `P_1` the maximum). Every percentile is therefore an observed value, never an
//! interpolation, which is what a "P99 of 100 samples" means in the paper's tail plots.

/// The 0-based index of the nearest-rank `q` percentile among `n` sorted values; `None` when
/// `n == 0` or `q` is NaN. `q` outside `[0, 1]` is clamped.
pub fn nearest_rank_index(n: usize, q: f64) -> Option<usize> {
    if n == 0 || q.is_nan() {
        return None;
    }
    let x = q.clamp(0.0, 1.0) * n as f64;
    // q·n carries round-off from q's decimal representation (0.95·20 may land a hair above 19):
    // snap to the nearest integer when within that error so the rank is not pushed up by one.
    let nearest = x.round();
    let rank = if (x - nearest).abs() <= 4.0 * f64::EPSILON * x { nearest } else { x.ceil() };
    Some((rank as usize).clamp(1, n) - 1)
}

/// The nearest-rank `q` percentile of values already sorted ascending; `None` when empty.
pub fn nearest_rank(sorted: &[f64], q: f64) -> Option<f64> {
    nearest_rank_index(sorted.len(), q).map(|i| sorted[i])
}

/// A set of finite samples, sorted once, answering mean, percentiles and extremes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Distribution {
    sorted: Vec<f64>,
}

impl Distribution {
    /// Sorts `values`; NaN and infinite values are dropped (they cannot come from time spans).
    pub fn new(mut values: Vec<f64>) -> Self {
        values.retain(|v| v.is_finite());
        values.sort_by(f64::total_cmp);
        Distribution { sorted: values }
    }

    /// Number of (finite) samples.
    pub fn len(&self) -> usize {
        self.sorted.len()
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.sorted.is_empty()
    }

    /// The samples, ascending.
    pub fn sorted(&self) -> &[f64] {
        &self.sorted
    }

    /// Arithmetic mean; `None` when empty.
    pub fn mean(&self) -> Option<f64> {
        if self.sorted.is_empty() {
            None
        } else {
            Some(self.sorted.iter().sum::<f64>() / self.sorted.len() as f64)
        }
    }

    /// Nearest-rank percentile, `q ∈ [0, 1]` (see the module doc).
    pub fn percentile(&self, q: f64) -> Option<f64> {
        nearest_rank(&self.sorted, q)
    }

    /// Smallest sample; `None` when empty.
    pub fn min(&self) -> Option<f64> {
        self.sorted.first().copied()
    }

    /// Largest sample; `None` when empty.
    pub fn max(&self) -> Option<f64> {
        self.sorted.last().copied()
    }

    /// Fraction of samples `≤ limit`; `None` when empty.
    pub fn fraction_at_most(&self, limit: f64) -> Option<f64> {
        if self.sorted.is_empty() {
            return None;
        }
        let within = self.sorted.partition_point(|&v| v <= limit);
        Some(within as f64 / self.sorted.len() as f64)
    }
}

impl FromIterator<f64> for Distribution {
    fn from_iter<I: IntoIterator<Item = f64>>(iter: I) -> Self {
        Distribution::new(iter.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn nearest_rank_table() {
        // (n, q, expected 0-based index), with x[i] = i + 1 so the value is the 1-based rank.
        let cases: &[(usize, f64, usize)] = &[
            (1, 0.0, 0),
            (1, 0.5, 0),
            (1, 1.0, 0),
            (2, 0.5, 0),
            (2, 0.51, 1),
            (4, 0.5, 1),
            (10, 0.9, 8),
            (19, 0.9, 17),
            (20, 0.95, 18),
            (99, 0.95, 94),
            (100, 0.99, 98),
            (100, 0.5, 49),
            (101, 0.5, 50),
            (1000, 0.999, 998),
            (1000, 1.0, 999),
            (3, 0.0, 0),
            (3, -1.0, 0),
            (3, 2.0, 2),
        ];
        for &(n, q, want) in cases {
            assert_eq!(nearest_rank_index(n, q), Some(want), "n={n} q={q}");
            let values: Vec<f64> = (1..=n).map(|i| i as f64).collect();
            assert_eq!(nearest_rank(&values, q), Some((want + 1) as f64), "n={n} q={q}");
        }
    }

    #[test]
    fn empty_and_nan() {
        assert_eq!(nearest_rank(&[], 0.5), None);
        assert_eq!(nearest_rank_index(5, f64::NAN), None);
        let d = Distribution::new(vec![]);
        assert_eq!((d.mean(), d.max(), d.percentile(0.99)), (None, None, None));
        assert_eq!(d.fraction_at_most(1.0), None);
        let d = Distribution::new(vec![f64::NAN, 3.0, f64::INFINITY, 1.0]);
        assert_eq!(d.sorted(), &[1.0, 3.0]);
        assert_eq!(d.mean(), Some(2.0));
    }

    #[test]
    fn distribution_stats() {
        let d: Distribution = [5.0, 1.0, 4.0, 2.0, 3.0].into_iter().collect();
        assert_eq!(d.sorted(), &[1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(d.mean(), Some(3.0));
        assert_eq!(d.percentile(0.5), Some(3.0));
        assert_eq!(d.percentile(0.9), Some(5.0));
        assert_eq!((d.min(), d.max()), (Some(1.0), Some(5.0)));
        assert_eq!(d.fraction_at_most(2.0), Some(0.4));
        assert_eq!(d.fraction_at_most(0.5), Some(0.0));
        // Ties: the boundary value counts as within.
        let d = Distribution::new(vec![0.25, 0.25, 0.3]);
        assert_eq!(d.fraction_at_most(0.25), Some(2.0 / 3.0));
    }

    proptest! {
        #[test]
        fn percentiles_are_ordered_members(values in proptest::collection::vec(-1e6f64..1e6, 1..300)) {
            let d = Distribution::new(values.clone());
            let p50 = d.percentile(0.5).unwrap();
            let p90 = d.percentile(0.9).unwrap();
            let p99 = d.percentile(0.99).unwrap();
            let max = d.max().unwrap();
            prop_assert!(p50 <= p90 && p90 <= p99 && p99 <= max);
            prop_assert_eq!(d.percentile(1.0), Some(max));
            for p in [p50, p90, p99] {
                prop_assert!(values.contains(&p));
            }
            // P_q is the rank-th smallest: at least `rank` samples are ≤ it, fewer are below it.
            let rank = nearest_rank_index(values.len(), 0.9).unwrap() + 1;
            prop_assert_eq!(rank, ((0.9 * values.len() as f64) - 1e-9).ceil() as usize);
            let at_or_below = values.iter().filter(|&&v| v <= p90).count();
            let below = values.iter().filter(|&&v| v < p90).count();
            prop_assert!(at_or_below >= rank && below < rank);
        }
    }
}
