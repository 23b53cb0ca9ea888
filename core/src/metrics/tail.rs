//! TTFT distributions for plots: tail TTFT per reasoning-length bin (PASCAL Fig. 10, 13(a), 16)
//! and the TTFT CDF (Fig. 15(a)).
//!
//! Fig. 10 groups requests into 256-token bins of reasoning length and, because the bins hold very
//! different numbers of requests, picks the tail statistic by sample count: bins with fewer than
//! 5 samples are omitted, then the maximum below 10 samples, P90 below 20, P95 below 100, and P99
//! otherwise. Percentiles are nearest-rank ([`super::percentile`]).
//!
//! TTFT here is `first_answer_token − arrival` for every record that is not rejected and has a
//! first answer token, as in [`super::summary`].

use super::percentile::{nearest_rank, Distribution};
use super::record::RequestRecord;
use serde::{Deserialize, Serialize};

/// The tail statistic reported for one bin.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TailStatistic {
    /// The largest sample (5–9 samples).
    Max,
    /// Nearest-rank P90 (10–19 samples).
    P90,
    /// Nearest-rank P95 (20–99 samples).
    P95,
    /// Nearest-rank P99 (100 samples or more).
    P99,
}

impl TailStatistic {
    /// PASCAL Fig. 10's rule: `None` (omit the bin) below 5 samples, then max / P90 / P95 / P99.
    pub fn for_samples(samples: usize) -> Option<TailStatistic> {
        match samples {
            0..5 => None,
            5..10 => Some(TailStatistic::Max),
            10..20 => Some(TailStatistic::P90),
            20..100 => Some(TailStatistic::P95),
            _ => Some(TailStatistic::P99),
        }
    }

    /// The quantile this statistic is (the maximum is the nearest-rank P100).
    pub fn quantile(self) -> f64 {
        match self {
            TailStatistic::Max => 1.0,
            TailStatistic::P90 => 0.9,
            TailStatistic::P95 => 0.95,
            TailStatistic::P99 => 0.99,
        }
    }

    /// Lowercase label (`max`, `p90`, `p95`, `p99`), as serialized.
    pub fn as_str(self) -> &'static str {
        match self {
            TailStatistic::Max => "max",
            TailStatistic::P90 => "p90",
            TailStatistic::P95 => "p95",
            TailStatistic::P99 => "p99",
        }
    }
}

/// Tail TTFT of the requests whose reasoning length falls in `[lo, hi]` tokens.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TailBin {
    /// Smallest reasoning length in the bin, tokens (inclusive).
    pub lo: u32,
    /// Largest reasoning length in the bin, tokens (inclusive).
    pub hi: u32,
    /// Requests with a TTFT in the bin.
    pub samples: u64,
    /// Which tail statistic `ttft_s` is, chosen by sample count.
    pub statistic: TailStatistic,
    /// That statistic of the bin's TTFTs, in seconds.
    pub ttft_s: f64,
}

/// `first_answer_token − arrival` in seconds, for records that count towards TTFT.
pub fn ttft_s(record: &RequestRecord) -> Option<f64> {
    if record.rejected {
        return None;
    }
    record.first_answer_token.map(|fat| fat.saturating_since(record.arrival).as_secs_f64())
}

/// Tail TTFT per reasoning-length bin `[k·bin_tokens, (k+1)·bin_tokens − 1]`, ascending; bins with
/// fewer than 5 samples are left out (PASCAL uses `bin_tokens = 256`). A `bin_tokens` of 0 is
/// treated as 1.
pub fn tail_ttft_by_reasoning_bin(records: &[RequestRecord], bin_tokens: u32) -> Vec<TailBin> {
    let width = bin_tokens.max(1);
    let mut samples: Vec<(u32, f64)> = records
        .iter()
        .filter_map(|r| ttft_s(r).filter(|v| v.is_finite()).map(|v| (r.reasoning_tokens / width, v)))
        .collect();
    samples.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));

    let mut bins = Vec::new();
    let mut rest = samples.as_slice();
    let mut values = Vec::new();
    while let Some(&(bin, _)) = rest.first() {
        let len = rest.partition_point(|&(b, _)| b == bin);
        let (group, tail) = rest.split_at(len);
        rest = tail;
        let Some(statistic) = TailStatistic::for_samples(group.len()) else { continue };
        values.clear();
        values.extend(group.iter().map(|&(_, v)| v));
        let Some(ttft_s) = nearest_rank(&values, statistic.quantile()) else { continue };
        let lo = bin.saturating_mul(width);
        bins.push(TailBin { lo, hi: lo.saturating_add(width - 1), samples: group.len() as u64, statistic, ttft_s });
    }
    bins
}

/// The empirical TTFT CDF: `(ttft_s, fraction of requests with TTFT ≤ it)`, one point per request,
/// ascending.
pub fn ttft_cdf(records: &[RequestRecord]) -> Vec<(f64, f64)> {
    let d: Distribution = records.iter().filter_map(ttft_s).collect();
    let n = d.len() as f64;
    d.sorted().iter().enumerate().map(|(i, &v)| (v, (i + 1) as f64 / n)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::RequestId;
    use crate::time::Timestamp;

    /// A finished request with the given reasoning length and TTFT.
    fn rec(id: u64, reasoning_tokens: u32, ttft_s: f64) -> RequestRecord {
        RequestRecord {
            id: RequestId(id),
            arrival: Timestamp::from_secs_f64(10.0),
            reasoning_tokens,
            first_answer_token: Some(Timestamp::from_secs_f64(10.0 + ttft_s)),
            ..Default::default()
        }
    }

    #[test]
    fn tail_rule_at_the_boundaries() {
        // (samples, statistic, expected TTFT) for TTFTs 1, 2, …, n s in one bin (given shuffled):
        // max → n; P90 → x[ceil(0.9n) − 1] = ceil(0.9n); likewise P95, P99.
        let table: &[(usize, Option<TailStatistic>, f64)] = &[
            (0, None, 0.0),
            (4, None, 0.0),
            (5, Some(TailStatistic::Max), 5.0),
            (9, Some(TailStatistic::Max), 9.0),
            (10, Some(TailStatistic::P90), 9.0),
            (19, Some(TailStatistic::P90), 18.0),
            (20, Some(TailStatistic::P95), 19.0),
            (99, Some(TailStatistic::P95), 95.0),
            (100, Some(TailStatistic::P99), 99.0),
            (250, Some(TailStatistic::P99), 248.0),
        ];
        for &(n, statistic, want) in table {
            assert_eq!(TailStatistic::for_samples(n), statistic, "n={n}");
            // Reverse order and spread over the bin's token range to exercise sorting and binning.
            let records: Vec<_> = (0..n).map(|i| rec(i as u64, (i % 256) as u32, (n - i) as f64)).collect();
            let bins = tail_ttft_by_reasoning_bin(&records, 256);
            match statistic {
                None => assert!(bins.is_empty(), "n={n}: {bins:?}"),
                Some(stat) => {
                    assert_eq!(bins.len(), 1, "n={n}");
                    let b = &bins[0];
                    assert_eq!((b.lo, b.hi, b.samples, b.statistic), (0, 255, n as u64, stat), "n={n}");
                    assert!((b.ttft_s - want).abs() < 1e-9, "n={n}: got {} want {want}", b.ttft_s);
                }
            }
        }
    }

    #[test]
    fn bins_split_by_reasoning_length_and_skip_sparse_and_rejected() {
        let mut records = Vec::new();
        // [0, 255]: 6 samples, TTFT 1..6 → max 6.
        for i in 0..6 {
            records.push(rec(i, 255 - i as u32, 1.0 + i as f64));
        }
        // [256, 511]: 4 samples → omitted.
        for i in 0..4 {
            records.push(rec(100 + i, 256 + i as u32, 50.0));
        }
        // [768, 1023]: 5 samples of 2 s, plus a rejected one with a huge TTFT that must not count.
        for i in 0..5 {
            records.push(rec(200 + i, 1023, 2.0));
        }
        let mut rejected = rec(300, 800, 999.0);
        rejected.rejected = true;
        records.push(rejected);
        // A request that never produced an answer token is not a sample.
        records.push(RequestRecord { id: RequestId(400), reasoning_tokens: 300, ..Default::default() });

        let bins = tail_ttft_by_reasoning_bin(&records, 256);
        let got: Vec<_> = bins.iter().map(|b| (b.lo, b.hi, b.samples, b.statistic, b.ttft_s)).collect();
        assert_eq!(got, vec![(0, 255, 6, TailStatistic::Max, 6.0), (768, 1023, 5, TailStatistic::Max, 2.0)]);
        let json = serde_json::to_string(&bins[0]).unwrap();
        assert!(json.contains(r#""statistic":"max""#), "{json}");
        // Zero-width bins are treated as one token wide rather than dividing by zero.
        assert_eq!(tail_ttft_by_reasoning_bin(&records, 0).len(), 1);
    }

    #[test]
    fn cdf_is_sorted_and_ends_at_one() {
        let records = vec![rec(0, 0, 3.0), rec(1, 0, 1.0), rec(2, 0, 2.0), rec(3, 0, 2.0)];
        let cdf = ttft_cdf(&records);
        assert_eq!(cdf.len(), 4);
        let xs: Vec<f64> = cdf.iter().map(|p| p.0).collect();
        let ys: Vec<f64> = cdf.iter().map(|p| p.1).collect();
        for (x, want) in xs.iter().zip([1.0, 2.0, 2.0, 3.0]) {
            assert!((x - want).abs() < 1e-9);
        }
        assert_eq!(ys, vec![0.25, 0.5, 0.75, 1.0]);
        assert!(ttft_cdf(&[]).is_empty());
    }
}
