//! A run's time as integer nanoseconds: virtual time in the simulator, the cluster clock in the
//! emulator.
//!
//! The core never reads a clock: every entry point takes `now: Timestamp`. The simulator advances
//! it from its event queue; a worker reads the cluster clock (nanoseconds since the run's epoch,
//! anchored at start-up) through `tokio::time::Instant`.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::{Add, AddAssign, Sub};

/// A point in a run's time: nanoseconds since the run's epoch (virtual or cluster time).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Timestamp(pub u64);

/// The latest instant a run may reach: 10⁷ s, about 116 days. Workloads refuse arrivals later
/// than this and the simulator stops with an error when its clock passes it, so a typo (a GPU
/// of 10⁻⁹ TFLOP/s, a timestamp of 10³⁰⁰ ms) is reported instead of running for ever at a
/// saturated clock.
pub const RUN_LIMIT: Timestamp = Timestamp(10_000_000 * 1_000_000_000);

/// A span of time in nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TimeSpan(pub u64);

impl Timestamp {
    /// The run's epoch.
    pub const ZERO: Timestamp = Timestamp(0);
    /// The largest representable instant (a "never" sentinel; far past [`RUN_LIMIT`]).
    pub const MAX: Timestamp = Timestamp(u64::MAX);

    /// Seconds since the epoch, rounded to the nearest ns; negative and NaN clamp to zero.
    pub fn from_secs_f64(secs: f64) -> Self {
        Timestamp(secs_to_nanos(secs))
    }
    /// Seconds since the epoch.
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 * 1e-9
    }
    /// Nanoseconds since the epoch.
    pub fn as_nanos(self) -> u64 {
        self.0
    }
    /// `self - earlier`, or zero when `earlier` is later.
    pub fn saturating_since(self, earlier: Timestamp) -> TimeSpan {
        TimeSpan(self.0.saturating_sub(earlier.0))
    }
}

impl TimeSpan {
    /// No time.
    pub const ZERO: TimeSpan = TimeSpan(0);

    /// A span of `secs` seconds, rounded to the nearest ns; negative and NaN clamp to zero.
    pub fn from_secs_f64(secs: f64) -> Self {
        TimeSpan(secs_to_nanos(secs))
    }
    /// A span of `ms` milliseconds, rounded to the nearest ns; negative and NaN clamp to zero.
    pub fn from_millis_f64(ms: f64) -> Self {
        TimeSpan(secs_to_nanos(ms * 1e-3))
    }
    /// A span of `ns` nanoseconds.
    pub fn from_nanos(ns: u64) -> Self {
        TimeSpan(ns)
    }
    /// The span in seconds.
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 * 1e-9
    }
    /// The span in milliseconds.
    pub fn as_millis_f64(self) -> f64 {
        self.0 as f64 * 1e-6
    }
    /// The span in nanoseconds.
    pub fn as_nanos(self) -> u64 {
        self.0
    }
}

/// Rounds to the nearest nanosecond; negative and NaN inputs clamp to zero.
fn secs_to_nanos(secs: f64) -> u64 {
    if secs.is_nan() || secs <= 0.0 {
        0
    } else if secs >= u64::MAX as f64 * 1e-9 {
        u64::MAX
    } else {
        (secs * 1e9).round() as u64
    }
}

impl Add<TimeSpan> for Timestamp {
    type Output = Timestamp;
    fn add(self, d: TimeSpan) -> Timestamp {
        Timestamp(self.0.saturating_add(d.0))
    }
}
impl AddAssign<TimeSpan> for Timestamp {
    fn add_assign(&mut self, d: TimeSpan) {
        self.0 = self.0.saturating_add(d.0);
    }
}
impl Sub<Timestamp> for Timestamp {
    type Output = TimeSpan;
    /// Panics in debug builds when `rhs` is later; use `saturating_since` where that can happen.
    fn sub(self, rhs: Timestamp) -> TimeSpan {
        debug_assert!(self.0 >= rhs.0, "time went backwards: {} < {}", self.0, rhs.0);
        TimeSpan(self.0.saturating_sub(rhs.0))
    }
}
impl Add for TimeSpan {
    type Output = TimeSpan;
    fn add(self, d: TimeSpan) -> TimeSpan {
        TimeSpan(self.0.saturating_add(d.0))
    }
}
impl AddAssign for TimeSpan {
    fn add_assign(&mut self, d: TimeSpan) {
        self.0 = self.0.saturating_add(d.0);
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.6}s", self.as_secs_f64())
    }
}
impl fmt::Display for TimeSpan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.3}ms", self.as_millis_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_round_trip_and_clamp() {
        assert_eq!(Timestamp::from_secs_f64(1.5).as_nanos(), 1_500_000_000);
        assert_eq!(TimeSpan::from_millis_f64(2.5).as_nanos(), 2_500_000);
        assert_eq!(TimeSpan::from_secs_f64(-1.0), TimeSpan::ZERO);
        assert_eq!(TimeSpan::from_secs_f64(f64::NAN), TimeSpan::ZERO);
        let t = Timestamp(10) + TimeSpan(5);
        assert_eq!(t - Timestamp(10), TimeSpan(5));
        assert_eq!(Timestamp(3).saturating_since(Timestamp(9)), TimeSpan::ZERO);
    }
}
