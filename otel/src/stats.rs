//! P50/P90/P99 of a sample with `kvfleet_core`'s nearest-rank percentiles
//! ([`kvfleet_core::metrics::percentile`]), so a P99 here is comparable with every other P99
//! kvfleet prints.

use kvfleet_core::metrics::Distribution;

pub use kvfleet_core::metrics::nearest_rank;

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
        let d: Distribution = values.into_iter().collect();
        Percentiles {
            n: d.len(),
            mean: d.mean(),
            p50: d.percentile(0.5),
            p90: d.percentile(0.9),
            p99: d.percentile(0.99),
            max: d.max(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_sort_and_drop_non_finite_values() {
        let p = Percentiles::of([3.0, f64::NAN, 1.0, 2.0, f64::INFINITY, 4.0]);
        assert_eq!(p.n, 4);
        assert_eq!(p.mean, Some(2.5));
        assert_eq!((p.p50, p.p90, p.p99, p.max), (Some(2.0), Some(4.0), Some(4.0), Some(4.0)));
        assert_eq!(Percentiles::of([]), Percentiles::default());
    }

    #[test]
    fn nearest_rank_not_interpolated() {
        // 0.9·10 = 9.000000000000002 in floating point: still rank 9, not 10.
        let ten = Percentiles::of((1..=10).map(f64::from));
        assert_eq!((ten.p50, ten.p90, ten.p99), (Some(5.0), Some(9.0), Some(10.0)));
        let hundred = Percentiles::of((1..=100).rev().map(f64::from));
        assert_eq!(
            (hundred.p50, hundred.p90, hundred.p99, hundred.max),
            (Some(50.0), Some(90.0), Some(99.0), Some(100.0))
        );
    }
}
