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

/// Time dilation (DieCast's scale model): one emulated second lasts `factor` real seconds.
///
/// An emulated cluster whose every modelled duration — GPU iterations, link transfers, the
/// migration protocol's timers, the workload's arrivals — is stretched K× and whose every reported
/// figure is read back in emulated time lets a host whose transport carries 10 Gbit/s emulate a
/// 100 Gbit/s fabric with real bytes: the link is shaped to rate ÷ K, and what the host adds
/// (an RPC's milliseconds, a timer's lateness) shrinks K× in emulated time. `1` is real time.
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd, Serialize, Deserialize)]
#[serde(try_from = "f64", into = "f64")]
pub struct Dilation(f64);

/// Why a time-dilation factor is refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("time dilation {0} is not a number from 1 to {max} (emulated time runs that many times slower than real time)", max = Dilation::MAX)]
pub struct DilationError(pub f64);

impl Dilation {
    /// Real time.
    pub const NONE: Dilation = Dilation(1.0);
    /// The largest factor accepted: a 1 s emulated run then lasts about 17 minutes.
    pub const MAX: f64 = 1000.0;

    /// A dilation of `factor` (1 ≤ factor ≤ [`Dilation::MAX`]).
    pub fn new(factor: f64) -> Result<Dilation, DilationError> {
        if factor.is_finite() && (1.0..=Dilation::MAX).contains(&factor) {
            Ok(Dilation(factor))
        } else {
            Err(DilationError(factor))
        }
    }

    /// Real seconds per emulated second.
    pub fn factor(self) -> f64 {
        self.0
    }

    /// Whether emulated time is real time.
    pub fn is_none(&self) -> bool {
        self.0 == 1.0
    }

    /// The real nanoseconds that `emulated_ns` emulated nanoseconds last (saturating).
    pub fn real_ns(self, emulated_ns: u64) -> u64 {
        if self.is_none() {
            emulated_ns
        } else {
            scale(emulated_ns, self.0)
        }
    }

    /// The emulated nanoseconds that `real_ns` real nanoseconds stand for.
    pub fn emulated_ns(self, real_ns: u64) -> u64 {
        if self.is_none() {
            real_ns
        } else {
            scale(real_ns, 1.0 / self.0)
        }
    }

    /// The real duration of an emulated span.
    pub fn real(self, span: TimeSpan) -> std::time::Duration {
        std::time::Duration::from_nanos(self.real_ns(span.0))
    }

    /// The emulated span a real duration stands for.
    pub fn emulated(self, real: std::time::Duration) -> TimeSpan {
        TimeSpan(self.emulated_ns(u64::try_from(real.as_nanos()).unwrap_or(u64::MAX)))
    }

    /// A rate in emulated units per second (e.g. a link's Gbit/s) as the real rate that emulates it.
    pub fn real_rate(self, emulated_per_s: f64) -> f64 {
        emulated_per_s / self.0
    }
}

impl Default for Dilation {
    fn default() -> Self {
        Dilation::NONE
    }
}

impl std::str::FromStr for Dilation {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let factor: f64 = text.trim().parse().map_err(|_| format!("time dilation `{text}` is not a number"))?;
        Dilation::new(factor).map_err(|e| e.to_string())
    }
}

impl TryFrom<f64> for Dilation {
    type Error = DilationError;
    fn try_from(factor: f64) -> Result<Self, Self::Error> {
        Dilation::new(factor)
    }
}

impl From<Dilation> for f64 {
    fn from(d: Dilation) -> f64 {
        d.0
    }
}

impl fmt::Display for Dilation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// `ns × by` rounded to the nanosecond (exact below 2⁵³ ns, about 104 days), saturating at
/// `u64::MAX`.
fn scale(ns: u64, by: f64) -> u64 {
    let scaled = (ns as f64) * by;
    if scaled >= u64::MAX as f64 {
        u64::MAX
    } else {
        scaled.round() as u64
    }
}

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
    fn dilation_stretches_and_reads_back() {
        let k = Dilation::new(10.0).unwrap();
        assert_eq!(k.real_ns(1_500_000), 15_000_000);
        assert_eq!(k.emulated_ns(15_000_000), 1_500_000);
        assert_eq!(k.real(TimeSpan::from_millis_f64(2.0)), std::time::Duration::from_millis(20));
        assert_eq!(k.emulated(std::time::Duration::from_secs(1)), TimeSpan::from_millis_f64(100.0));
        assert_eq!(k.real_rate(100.0), 10.0);
        assert_eq!(k.real_ns(u64::MAX), u64::MAX);
        assert_eq!(Dilation::NONE.real_ns(123_456_789_012_345), 123_456_789_012_345);
        for bad in [0.5, 0.0, -3.0, f64::NAN, f64::INFINITY, 1000.5] {
            assert!(Dilation::new(bad).is_err(), "{bad}");
        }
        let parsed: Dilation = serde_json::from_str("4.0").unwrap();
        assert_eq!(parsed.factor(), 4.0);
        assert!(serde_json::from_str::<Dilation>("0.25").is_err());
        assert_eq!("2.5".parse::<Dilation>().unwrap().factor(), 2.5);
        assert!("fast".parse::<Dilation>().unwrap_err().contains("not a number"));
        assert!("0".parse::<Dilation>().unwrap_err().contains("from 1 to 1000"));
    }

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
