//! Timer lateness: how long after an iteration's modelled end the driver actually woke up.
//!
//! The emulator is only as faithful as its timers: a worker that wakes late delivers every token of
//! the iteration late (the schedule itself does not drift, see `driver`). Worker density is judged
//! by p99 lateness < 1 ms (`kvfleet bench workers`: how many workers one host sustains under that
//! bound), so the histogram resolves 1 µs up to ~1 ms and keeps ~3 % relative precision beyond, in
//! constant memory (no per-sample storage).

use std::time::Duration;

/// 1-µs buckets below this many µs.
const LINEAR_US: u64 = 1024;
/// Sub-buckets per power of two above `LINEAR_US` (2^5: ≤ 3.2 % relative error).
const SUB_BITS: u32 = 5;
/// Powers of two covered above `LINEAR_US` (2^10 µs .. 2^42 µs ≈ 50 days).
const OCTAVES: u32 = 32;

/// Log-linear histogram of lateness samples.
#[derive(Clone, Debug)]
pub struct LatenessHistogram {
    buckets: Vec<u64>,
    samples: u64,
    sum_ns: u128,
    max_ns: u64,
}

/// Quantiles of the lateness so far, in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LatenessSummary {
    /// Wake-ups recorded.
    pub samples: u64,
    /// Median lateness, µs.
    pub p50_us: f64,
    /// 99th-percentile lateness, µs.
    pub p99_us: f64,
    /// Largest lateness seen, µs (exact).
    pub max_us: f64,
    /// Mean lateness, µs (exact).
    pub mean_us: f64,
}

impl std::fmt::Display for LatenessSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} wake-ups, lateness p50 {:.0} µs, p99 {:.0} µs, max {:.0} µs, mean {:.0} µs",
            self.samples, self.p50_us, self.p99_us, self.max_us, self.mean_us
        )
    }
}

impl Default for LatenessHistogram {
    fn default() -> Self {
        Self::new()
    }
}

impl LatenessHistogram {
    /// An empty histogram.
    pub fn new() -> Self {
        LatenessHistogram { buckets: vec![0; Self::bucket_count()], samples: 0, sum_ns: 0, max_ns: 0 }
    }

    fn bucket(us: u64) -> usize {
        if us < LINEAR_US {
            return us as usize;
        }
        let exp = 63 - us.leading_zeros(); // ≥ 10
        let octave = exp - LINEAR_US.trailing_zeros();
        if octave >= OCTAVES {
            return Self::bucket_count() - 1; // overflow: the last bucket holds everything above
        }
        let sub = (us >> (exp - SUB_BITS)) & ((1 << SUB_BITS) - 1);
        (LINEAR_US + octave as u64 * (1 << SUB_BITS) + sub) as usize
    }

    fn bucket_count() -> usize {
        (LINEAR_US + (OCTAVES as u64) * (1 << SUB_BITS)) as usize
    }

    /// The largest value (µs) that falls in bucket `b`.
    fn bucket_upper_us(b: usize) -> u64 {
        if b + 1 >= Self::bucket_count() {
            return u64::MAX;
        }
        let b = b as u64;
        if b < LINEAR_US {
            return b;
        }
        let octave = (b - LINEAR_US) >> SUB_BITS;
        let sub = (b - LINEAR_US) & ((1 << SUB_BITS) - 1);
        let exp = octave + LINEAR_US.trailing_zeros() as u64;
        let width = 1u64 << (exp - SUB_BITS as u64);
        (1u64 << exp) + (sub + 1) * width - 1
    }

    /// Add one wake-up's lateness (ns precision for max and mean, 1 µs buckets for quantiles).
    pub fn record(&mut self, lateness: Duration) {
        let ns = u64::try_from(lateness.as_nanos()).unwrap_or(u64::MAX);
        self.buckets[Self::bucket(ns / 1000)] += 1;
        self.samples += 1;
        self.sum_ns += ns as u128;
        self.max_ns = self.max_ns.max(ns);
    }

    /// Number of samples recorded.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// The `q`-quantile in µs (upper edge of its bucket, capped by the maximum seen).
    pub fn quantile_us(&self, q: f64) -> f64 {
        if self.samples == 0 {
            return 0.0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.samples as f64).ceil() as u64).max(1);
        let mut seen = 0u64;
        for (b, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return (Self::bucket_upper_us(b) as f64).min(self.max_ns as f64 / 1000.0);
            }
        }
        self.max_ns as f64 / 1000.0
    }

    /// p50, p99, max and mean so far.
    pub fn summary(&self) -> LatenessSummary {
        LatenessSummary {
            samples: self.samples,
            p50_us: self.quantile_us(0.50),
            p99_us: self.quantile_us(0.99),
            max_us: self.max_ns as f64 / 1000.0,
            mean_us: if self.samples == 0 { 0.0 } else { self.sum_ns as f64 / self.samples as f64 / 1000.0 },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_monotone_and_contain_their_values() {
        let mut prev = 0;
        for us in (0..5000u64).chain([65_535, 1 << 20, 123_456_789, u64::MAX / 1000]) {
            let b = LatenessHistogram::bucket(us);
            assert!(b >= prev, "bucket of {us} went backwards");
            prev = b;
            assert!(LatenessHistogram::bucket_upper_us(b) >= us, "{us} above its bucket's upper edge");
            if (LINEAR_US..1u64 << 40).contains(&us) {
                let up = LatenessHistogram::bucket_upper_us(b) as f64;
                assert!(up / (us as f64) < 1.0 + 1.0 / 32.0 + 1e-9, "{us}: edge {up} too coarse");
            }
        }
    }

    /// (samples in µs, q, expected quantile in µs)
    #[test]
    fn quantiles_from_a_table() {
        let cases: &[(&[u64], f64, f64)] = &[
            (&[], 0.5, 0.0),
            (&[7], 0.5, 7.0),
            (&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0.5, 5.0),
            (&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0.99, 10.0),
            (&[100; 99], 0.99, 100.0),
            (&[2000, 2000, 2000], 0.5, 2000.0), // capped by the max inside a coarse bucket
        ];
        for &(samples, q, want) in cases {
            let mut h = LatenessHistogram::new();
            for &us in samples {
                h.record(Duration::from_micros(us));
            }
            assert_eq!(h.quantile_us(q), want, "{samples:?} q={q}");
        }
        let mut h = LatenessHistogram::new();
        for us in 0..1000u64 {
            h.record(Duration::from_micros(us));
        }
        h.record(Duration::from_millis(50));
        let s = h.summary();
        assert_eq!((s.samples, s.p50_us, s.max_us), (1001, 500.0, 50_000.0));
        assert!(s.p99_us >= 989.0 && s.p99_us <= 991.0, "{s:?}");
    }
}
