//! Nearest-rank percentiles, the definition `kvfleet_core::metrics::percentile` uses, so a P99
//! here is comparable with every other P99 kvfleet prints.
//!
//! For `n` values sorted ascending `x[0] ≤ … ≤ x[n−1]` and `q ∈ [0, 1]`,
//! `P_q = x[ceil(q·n) − 1]`, the index clamped to `[0, n − 1]`: always an observed value.

/// The nearest-rank `q` percentile of `sorted` (ascending); `None` when empty.
pub fn nearest_rank(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() || q.is_nan() {
        return None;
    }
    let n = sorted.len();
    let x = q.clamp(0.0, 1.0) * n as f64;
    // q·n carries the round-off of q's decimal form (0.9·10 may be a hair above 9): snap to the
    // nearest integer within that error so the rank is not pushed up by one.
    let nearest = x.round();
    let rank = if (x - nearest).abs() <= 4.0 * f64::EPSILON * x { nearest } else { x.ceil() };
    Some(sorted[(rank as usize).clamp(1, n) - 1])
}

/// Count, mean and P50/P90/P99/max of a sample (non-finite values dropped).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Percentiles {
    /// Finite values in the sample.
    pub n: usize,
    /// Arithmetic mean; `None` when empty.
    pub mean: Option<f64>,
    /// Nearest-rank median.
    pub p50: Option<f64>,
    /// Nearest-rank 90th percentile.
    pub p90: Option<f64>,
    /// Nearest-rank 99th percentile.
    pub p99: Option<f64>,
    /// Largest value.
    pub max: Option<f64>,
}

impl Percentiles {
    /// The statistics of `values`, non-finite ones dropped.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Percentiles {
        let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        let mean = (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
        Percentiles {
            n: v.len(),
            mean,
            p50: nearest_rank(&v, 0.5),
            p90: nearest_rank(&v, 0.9),
            p99: nearest_rank(&v, 0.99),
            max: v.last().copied(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_table() {
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        let cases: &[(&[f64], f64, Option<f64>)] = &[
            (&[], 0.5, None),
            (&[7.0], 0.0, Some(7.0)),
            (&[7.0], 0.99, Some(7.0)),
            (&ten, 0.5, Some(5.0)),
            // 0.9·10 = 9.000000000000002 in floating point: still rank 9, not 10.
            (&ten, 0.9, Some(9.0)),
            (&ten, 0.99, Some(10.0)),
            (&ten, 0.0, Some(1.0)),
            (&ten, 1.0, Some(10.0)),
            (&hundred, 0.99, Some(99.0)),
            (&hundred, 0.5, Some(50.0)),
            (&hundred, 0.901, Some(91.0)),
            (&[1.0, 2.0, 3.0], 0.5, Some(2.0)),
            (&[1.0, 2.0], 0.5, Some(1.0)),
        ];
        for (values, q, want) in cases {
            assert_eq!(nearest_rank(values, *q), *want, "P{q} of {values:?}");
        }
    }

    #[test]
    fn percentiles_sort_and_drop_non_finite_values() {
        let p = Percentiles::of([3.0, f64::NAN, 1.0, 2.0, f64::INFINITY, 4.0]);
        assert_eq!(p.n, 4);
        assert_eq!(p.mean, Some(2.5));
        assert_eq!((p.p50, p.p90, p.p99, p.max), (Some(2.0), Some(4.0), Some(4.0), Some(4.0)));
        assert_eq!(Percentiles::of([]), Percentiles::default());
    }
}
