//! Link shaping: a token-bucket rate limit plus an added one-way latency, sans-IO.
//!
//! The emulator moves real KV bytes over whatever the host offers (loopback, a LAN); a run can
//! additionally *shape* a link to emulate the timing of a 100 Gbps or 400 Gbps fabric, so that
//! migration timings on one host resemble those of a real cluster. This module is the arithmetic only: [`ShapeParams`] says what the link looks
//! like, [`TokenBucket::reserve`] says when a number of bytes may leave. The async writer that
//! sleeps until then lives in `kvfleet-transport` (`shaped.rs`); the simulator can use the same
//! bucket in virtual time.
//!
//! # Model
//!
//! A token bucket of depth `burst_bytes`, refilled at `rate_bytes_per_s`, implemented as GCRA
//! (a *theoretical arrival time*, TAT, instead of a token count, so no refill ticks are needed):
//!
//! - a reservation of `b` bytes at `now` moves the TAT to `max(now, TAT) + b / rate`;
//! - the bytes may leave at `max(now, TAT − burst / rate)`, i.e. once the bucket holds enough
//!   tokens to cover them (a reservation larger than the burst waits for the difference even on an
//!   idle link; `burst_bytes = 0` is strict pacing);
//! - an idle link accumulates at most `burst_bytes` of credit (the `max(now, TAT)`).
//!
//! Over any interval starting at an idle link, the bytes released by time `t` are therefore at
//! most `burst_bytes + rate · t`: the rate is an upper bound that is honoured over many
//! reservations, never exceeded by rounding.
//!
//! # Exactness
//!
//! The rate is rounded to whole bytes per second (at least 1). Time is kept in units of
//! `1 / rate` nanoseconds (`ns × rate`), in which a byte costs exactly 10⁹ units, so the TAT never
//! accumulates rounding error; only the returned instant is rounded, up, to a nanosecond.

use kvfleet_core::{TimeSpan, Timestamp};
use serde::{Deserialize, Serialize};

/// Time units per byte: one byte at `rate` bytes/s takes 10⁹ / rate ns = 10⁹ units of 1/rate ns.
const UNITS_PER_BYTE: u128 = 1_000_000_000;

/// Why shaping parameters were rejected, naming the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ShapeError {
    /// A parameter is out of range.
    #[error("invalid shaping parameter `{field}` = {value}: {reason}")]
    Invalid {
        /// The parameter.
        field: &'static str,
        /// Its value, as given.
        value: String,
        /// The accepted range.
        reason: &'static str,
    },
}

/// How one link is shaped (per direction): rate, burst and added one-way latency.
///
/// In TOML/JSON `latency` is in nanoseconds (a [`TimeSpan`]); the default shapes nothing
/// (no rate limit, no latency).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShapeParams {
    /// Sustained rate in bytes per second (rounded to a whole number, at least 1); `None` leaves
    /// the rate alone and only adds latency.
    pub rate_bytes_per_s: Option<f64>,
    /// One-way latency added to every byte (a delay line: it does not reduce the rate).
    pub latency: TimeSpan,
    /// Bucket depth: how many bytes may leave back to back after the link was idle. A writer
    /// that sleeps on a coarse timer (tokio's is 1 ms) needs at least `rate × 1 ms` here to reach
    /// the rate; 0 is strict pacing.
    pub burst_bytes: u64,
}

impl Default for ShapeParams {
    fn default() -> Self {
        ShapeParams { rate_bytes_per_s: None, latency: TimeSpan::ZERO, burst_bytes: 0 }
    }
}

impl ShapeParams {
    /// A link of `gbit_per_s` (10⁹ bit/s) with one-way `latency` and a burst of 2 ms at that rate
    /// (enough for a millisecond timer), e.g. `ShapeParams::fabric_gbps(100.0, 10 µs)`.
    pub fn fabric_gbps(gbit_per_s: f64, latency: TimeSpan) -> ShapeParams {
        let rate = gbit_per_s * 1e9 / 8.0;
        let burst = if rate.is_finite() && rate > 0.0 { (rate * 2e-3).min(u64::MAX as f64) as u64 } else { 0 };
        ShapeParams { rate_bytes_per_s: Some(rate), latency, burst_bytes: burst }
    }

    /// The shaping that emulates the simulator's link model ([`crate::LinkParams`]).
    pub fn from_link(link: &crate::LinkParams) -> ShapeParams {
        ShapeParams::fabric_gbps(link.bandwidth_gbps, TimeSpan::from_secs_f64(link.latency_us * 1e-6))
    }

    /// Whether these parameters change anything (a rate limit or a latency).
    pub fn is_shaping(&self) -> bool {
        self.rate_bytes_per_s.is_some() || self.latency > TimeSpan::ZERO
    }

    /// The rate must be finite, at least 1 byte/s and below 2⁶⁴ bytes/s; a burst without a rate
    /// means nothing and is rejected as a likely mistake.
    pub fn validate(&self) -> Result<(), ShapeError> {
        match self.rate_bytes_per_s {
            Some(rate) if !rate.is_finite() || rate.round() < 1.0 => Err(ShapeError::Invalid {
                field: "rate_bytes_per_s",
                value: rate.to_string(),
                reason: "must be a finite number of at least 1 byte/s (leave it out for no rate limit)",
            }),
            Some(rate) if rate >= u64::MAX as f64 => Err(ShapeError::Invalid {
                field: "rate_bytes_per_s",
                value: rate.to_string(),
                reason: "must be below 1.8e19 bytes/s",
            }),
            None if self.burst_bytes > 0 => Err(ShapeError::Invalid {
                field: "burst_bytes",
                value: self.burst_bytes.to_string(),
                reason: "a burst needs a rate_bytes_per_s",
            }),
            _ => Ok(()),
        }
    }
}

/// A sans-IO token bucket (GCRA): [`reserve`](TokenBucket::reserve) says when bytes may leave.
///
/// Share one bucket between all streams of a link so that their sum is limited.
#[derive(Clone, Debug)]
pub struct TokenBucket {
    /// Bytes per second; `None` = unlimited.
    rate: Option<u64>,
    /// The burst, in time units (`burst_bytes × 10⁹`).
    tolerance: u128,
    /// Theoretical arrival time in units of 1/rate ns.
    tat: u128,
}

impl TokenBucket {
    /// A bucket for `params` (validated), starting full (a burst may leave at once).
    pub fn new(params: &ShapeParams) -> Result<TokenBucket, ShapeError> {
        params.validate()?;
        Ok(TokenBucket {
            rate: params.rate_bytes_per_s.map(|r| r.round() as u64),
            tolerance: u128::from(params.burst_bytes) * UNITS_PER_BYTE,
            tat: 0,
        })
    }

    /// The rate in bytes per second as used (rounded), or `None` when unlimited.
    pub fn rate_bytes_per_s(&self) -> Option<u64> {
        self.rate
    }

    /// Reserve `bytes` at `now`; returns when the last of them may leave (≥ `now`).
    ///
    /// Reservations are served in call order: a later one never leaves before an earlier one.
    /// `now` going backwards is treated as the latest `now` seen.
    pub fn reserve(&mut self, now: Timestamp, bytes: u64) -> Timestamp {
        let Some(rate) = self.rate else { return now };
        let rate = u128::from(rate);
        let now_units = u128::from(now.as_nanos()) * rate;
        self.tat = self.tat.max(now_units) + u128::from(bytes) * UNITS_PER_BYTE;
        let leave_units = self.tat.saturating_sub(self.tolerance).max(now_units);
        let leave_ns = leave_units.div_ceil(rate);
        Timestamp(u64::try_from(leave_ns).unwrap_or(u64::MAX))
    }

    /// When a reservation of `bytes` made at `now` would leave, without making it.
    pub fn peek(&self, now: Timestamp, bytes: u64) -> Timestamp {
        self.clone().reserve(now, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bucket(rate: f64, burst: u64) -> TokenBucket {
        TokenBucket::new(&ShapeParams { rate_bytes_per_s: Some(rate), latency: TimeSpan::ZERO, burst_bytes: burst })
            .expect("valid params")
    }

    #[test]
    fn strict_pacing_releases_at_the_rate() {
        // 1000 B/s, no burst: 100 B leave at 0.1 s, the next 100 B at 0.2 s.
        let mut b = bucket(1000.0, 0);
        assert_eq!(b.reserve(Timestamp::ZERO, 100), Timestamp(100_000_000));
        assert_eq!(b.reserve(Timestamp::ZERO, 100), Timestamp(200_000_000));
        // An idle link does not bank credit without a burst.
        assert_eq!(b.reserve(Timestamp(1_000_000_000), 100), Timestamp(1_100_000_000));
    }

    #[test]
    fn burst_leaves_at_once_then_the_rate_applies() {
        let mut b = bucket(1000.0, 500);
        for _ in 0..5 {
            assert_eq!(b.reserve(Timestamp::ZERO, 100), Timestamp::ZERO, "within the burst");
        }
        assert_eq!(b.reserve(Timestamp::ZERO, 100), Timestamp(100_000_000), "burst spent");
        // After idling long enough the bucket is full again, but never more than the burst.
        let later = Timestamp(10_000_000_000);
        assert_eq!(b.reserve(later, 500), later);
        assert_eq!(b.reserve(later, 1), Timestamp(10_001_000_000));
    }

    #[test]
    fn a_reservation_larger_than_the_burst_waits_for_the_difference() {
        let mut b = bucket(1000.0, 200);
        assert_eq!(b.reserve(Timestamp::ZERO, 1200), Timestamp(1_000_000_000));
    }

    #[test]
    fn fractional_costs_do_not_drift() {
        // 3 B/s: one byte costs 333 333 333.3 ns; 3000 one-byte reservations end at exactly 1000 s.
        let mut b = bucket(3.0, 0);
        let mut last = Timestamp::ZERO;
        for _ in 0..3000 {
            last = b.reserve(Timestamp::ZERO, 1);
        }
        assert_eq!(last, Timestamp(1_000_000_000_000));
    }

    #[test]
    fn unlimited_rate_releases_now() {
        let mut b = TokenBucket::new(&ShapeParams::default()).unwrap();
        assert_eq!(b.rate_bytes_per_s(), None);
        assert_eq!(b.reserve(Timestamp(42), u64::MAX), Timestamp(42));
    }

    #[test]
    fn huge_values_saturate_instead_of_overflowing() {
        let mut b = bucket(1.0, 0);
        assert_eq!(b.reserve(Timestamp(u64::MAX), u64::MAX), Timestamp::MAX);
        assert_eq!(b.reserve(Timestamp(u64::MAX), u64::MAX), Timestamp::MAX);
    }

    #[test]
    fn peek_does_not_consume() {
        let mut b = bucket(1000.0, 0);
        assert_eq!(b.peek(Timestamp::ZERO, 100), Timestamp(100_000_000));
        assert_eq!(b.reserve(Timestamp::ZERO, 100), Timestamp(100_000_000));
    }

    #[test]
    fn invalid_params_are_rejected_naming_the_field() {
        let bad = |rate: Option<f64>, burst: u64| ShapeParams {
            rate_bytes_per_s: rate,
            burst_bytes: burst,
            ..Default::default()
        };
        for (params, field) in [
            (bad(Some(0.0), 0), "rate_bytes_per_s"),
            (bad(Some(0.4), 0), "rate_bytes_per_s"),
            (bad(Some(-5.0), 0), "rate_bytes_per_s"),
            (bad(Some(f64::NAN), 0), "rate_bytes_per_s"),
            (bad(Some(f64::INFINITY), 0), "rate_bytes_per_s"),
            (bad(Some(1e20), 0), "rate_bytes_per_s"),
            (bad(None, 10), "burst_bytes"),
        ] {
            let err = TokenBucket::new(&params).expect_err("must be rejected");
            let ShapeError::Invalid { field: got, .. } = &err;
            assert_eq!(*got, field, "{err}");
            assert!(err.to_string().contains(field), "{err}");
        }
        assert!(bad(Some(1.0), 0).validate().is_ok());
        assert!(ShapeParams::default().validate().is_ok());
    }

    #[test]
    fn params_deserialize_with_defaults_and_reject_unknown_fields() {
        use serde::de::value::{Error, MapDeserializer};
        let de = |fields: Vec<(&'static str, u64)>| {
            ShapeParams::deserialize(MapDeserializer::<_, Error>::new(fields.into_iter()))
        };
        let partial = de(vec![("latency", 5), ("burst_bytes", 7)]).unwrap();
        assert_eq!(partial, ShapeParams { latency: TimeSpan(5), burst_bytes: 7, ..Default::default() });
        let err = de(vec![("rate", 5)]).expect_err("unknown field");
        assert!(err.to_string().contains("rate"), "{err}");
    }

    #[test]
    fn fabric_helper_sets_rate_and_a_timer_sized_burst() {
        let p = ShapeParams::fabric_gbps(100.0, TimeSpan::from_nanos(10_000));
        assert_eq!(p.rate_bytes_per_s, Some(12.5e9));
        assert_eq!(p.burst_bytes, 25_000_000);
        assert!(p.is_shaping());
        assert!(p.validate().is_ok());
        assert!(!ShapeParams::default().is_shaping());
        assert!(ShapeParams::fabric_gbps(0.0, TimeSpan::ZERO).validate().is_err());
    }

    #[test]
    fn from_link_matches_the_simulators_link() {
        let p = ShapeParams::from_link(&crate::LinkParams { bandwidth_gbps: 400.0, latency_us: 2.0 });
        assert_eq!(p.rate_bytes_per_s, Some(50e9));
        assert_eq!(p.latency, TimeSpan(2_000));
    }

    proptest! {
        /// Whatever the reservation sizes and arrival times, the bytes released by any instant
        /// never exceed burst + rate × elapsed (from the first reservation, link idle before),
        /// and releases are in order and never before `now`.
        #[test]
        fn rate_is_honoured_over_many_reservations(
            rate in 1u64..1_000_000_000,
            burst in 0u64..10_000_000,
            steps in proptest::collection::vec((0u64..5_000_000, 1u64..2_000_000), 1..200),
        ) {
            let mut b = bucket(rate as f64, burst);
            let start = Timestamp(1_000);
            let mut now = start;
            let mut sent: u128 = 0;
            let mut prev = Timestamp::ZERO;
            for (gap_ns, bytes) in steps {
                now += TimeSpan(gap_ns);
                let leave = b.reserve(now, bytes);
                prop_assert!(leave >= now);
                prop_assert!(leave >= prev);
                prev = leave;
                sent += u128::from(bytes);
                let elapsed_ns = u128::from((leave - start).as_nanos());
                // bytes ≤ burst + rate·t  ⇔  (bytes − burst)·10⁹ ≤ rate·t_ns
                prop_assert!(
                    sent.saturating_sub(u128::from(burst)) * UNITS_PER_BYTE <= u128::from(rate) * elapsed_ns,
                    "{sent} B released by {elapsed_ns} ns at {rate} B/s with burst {burst}"
                );
            }
        }

        /// Back-to-back reservations on a busy link keep it busy: the last byte of n bytes
        /// leaves no later than (n − burst) / rate + 1 ns after the start.
        #[test]
        fn a_saturated_link_runs_at_the_rate(
            rate in 1u64..1_000_000_000,
            burst in 0u64..1_000_000,
            sizes in proptest::collection::vec(1u64..1_000_000, 1..100),
        ) {
            let mut b = bucket(rate as f64, burst);
            let mut last = Timestamp::ZERO;
            let mut total: u128 = 0;
            for s in sizes {
                last = b.reserve(Timestamp::ZERO, s);
                total += u128::from(s);
            }
            let ideal = (total.saturating_sub(u128::from(burst)) * UNITS_PER_BYTE).div_ceil(u128::from(rate));
            prop_assert_eq!(u128::from(last.as_nanos()), ideal);
        }
    }
}
