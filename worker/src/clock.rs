//! The cluster clock: [`Timestamp`] as nanoseconds since the cluster epoch, on this host's monotonic
//! clock, running [`Dilation`] times slower than it in a time-dilated cluster.
//!
//! Every process of a cluster agrees on the epoch (`epoch_unix_ns`, chosen by `kvfleet up` or the
//! first leader; see kvfleet.proto), so "t = 3.2 s" means the same instant on every worker and
//! request timestamps from different workers compare. The wall clock is read once, at start, to
//! place the epoch on the monotonic clock; after that only `Instant` is used, so NTP steps cannot
//! move a schedule.

use kvfleet_core::{Dilation, Timestamp};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Why the cluster epoch cannot be placed on this host's monotonic clock.
#[derive(Debug, thiserror::Error)]
pub enum ClockError {
    /// The wall clock reads before the Unix epoch.
    #[error("the system clock is before 1970: {0}")]
    BeforeUnixEpoch(std::time::SystemTimeError),
    /// The epoch is further in the past than this host's `Instant` can represent (e.g. before boot).
    #[error("`--epoch-unix-ns` {epoch_unix_ns} is {ago_s:.0} s in the past, beyond this host's monotonic clock")]
    EpochTooOld {
        /// The requested epoch, ns since the Unix epoch.
        epoch_unix_ns: u64,
        /// How far in the past it lies, in seconds.
        ago_s: f64,
    },
}

/// Maps cluster time to `Instant`s and back.
#[derive(Clone, Copy, Debug)]
pub struct ClusterClock {
    epoch: Instant,
    epoch_unix_ns: u64,
    dilation: Dilation,
}

impl ClusterClock {
    /// The clock of a cluster whose epoch is `epoch_unix_ns` (None: now), one cluster second lasting
    /// `dilation` real seconds.
    pub fn new(epoch_unix_ns: Option<u64>, dilation: Dilation) -> Result<ClusterClock, ClockError> {
        let (now_instant, now_unix) = paired_now();
        let now_unix_ns =
            u64::try_from(now_unix.duration_since(UNIX_EPOCH).map_err(ClockError::BeforeUnixEpoch)?.as_nanos())
                .unwrap_or(u64::MAX);
        let epoch_unix_ns = epoch_unix_ns.unwrap_or(now_unix_ns);
        let epoch = if epoch_unix_ns >= now_unix_ns {
            now_instant + Duration::from_nanos(epoch_unix_ns - now_unix_ns)
        } else {
            let ago = Duration::from_nanos(now_unix_ns - epoch_unix_ns);
            now_instant.checked_sub(ago).ok_or(ClockError::EpochTooOld { epoch_unix_ns, ago_s: ago.as_secs_f64() })?
        };
        Ok(ClusterClock { epoch, epoch_unix_ns, dilation })
    }

    /// The cluster epoch, ns since the Unix epoch (wall clock).
    pub fn epoch_unix_ns(&self) -> u64 {
        self.epoch_unix_ns
    }

    /// Real seconds per cluster second.
    pub fn dilation(&self) -> Dilation {
        self.dilation
    }

    /// Cluster time now (0 before the epoch).
    pub fn now(&self) -> Timestamp {
        self.at(Instant::now())
    }

    /// Cluster time of an instant (0 before the epoch).
    pub fn at(&self, instant: Instant) -> Timestamp {
        let real = u64::try_from(instant.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX);
        Timestamp(self.dilation.emulated_ns(real))
    }

    /// The instant of a cluster time.
    pub fn instant(&self, t: Timestamp) -> Instant {
        self.epoch + Duration::from_nanos(self.dilation.real_ns(t.0))
    }
}

/// The monotonic and the wall clock read at one instant, as nearly as this host allows: a wall
/// clock read between two monotonic reads, taking the narrowest of a few tries and the midpoint.
/// (A process descheduled between two plain reads, as on a loaded 2-core host, anchored its epoch
/// milliseconds off, and other processes, which stamp with the wall clock, saw its first tokens
/// come before their requests arrived.)
fn paired_now() -> (Instant, SystemTime) {
    const TIGHT: Duration = Duration::from_micros(20);
    let mut best: Option<(Duration, Instant, SystemTime)> = None;
    for _ in 0..64 {
        let before = Instant::now();
        let wall = SystemTime::now();
        let width = before.elapsed();
        if best.is_none_or(|(w, ..)| width < w) {
            best = Some((width, before + width / 2, wall));
        }
        if width <= TIGHT {
            break;
        }
    }
    let (_, instant, wall) = best.expect("at least one try");
    (instant, wall)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epoch_maps_both_ways() {
        let unix_now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64;
        let c = ClusterClock::new(Some(unix_now - 2_000_000_000), Dilation::NONE).unwrap();
        let t = c.now();
        assert!(t.0 >= 2_000_000_000 && t.0 < 3_000_000_000, "{t:?}");
        assert_eq!(c.at(c.instant(Timestamp(5_000_000_123))), Timestamp(5_000_000_123));
        // An epoch in the future reads as 0 until it arrives.
        let future = ClusterClock::new(Some(unix_now + 60_000_000_000), Dilation::NONE).unwrap();
        assert_eq!(future.now(), Timestamp(0));
        assert!(ClusterClock::new(None, Dilation::NONE).unwrap().now().0 < 1_000_000_000);
    }

    #[test]
    fn a_dilated_clock_runs_slower() {
        let unix_now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64;
        // 20 real seconds since the epoch are 2 cluster seconds at K = 10.
        let c = ClusterClock::new(Some(unix_now - 20_000_000_000), Dilation::new(10.0).unwrap()).unwrap();
        let t = c.now();
        assert!(t.0 >= 2_000_000_000 && t.0 < 2_100_000_000, "{t:?}");
        // An emulated 5 ms iteration ends 50 real ms after it starts.
        let start = c.instant(Timestamp(3_000_000_000));
        assert_eq!(c.instant(Timestamp(3_005_000_000)) - start, Duration::from_millis(50));
        assert_eq!(c.at(c.instant(Timestamp(5_000_000_120))), Timestamp(5_000_000_120));
    }
}
