//! The simulator's network: one full-duplex NIC per instance, shared by concurrent KV transfers.
//!
//! PASCAL §V-C observes that several instances migrating KV caches to the same target at once
//! contend for bandwidth (P99 transfer latency 0.14–0.25 s on 100 Gbps). [`Fabric`] models exactly
//! that contention, sans-IO: the caller passes `now`, asks [`Fabric::next_completion`] when to come
//! back, and collects finished transfers with [`Fabric::complete_due`].
//!
//! # Model
//!
//! - Each instance has an egress and an ingress port of `bandwidth_gbps` each (full duplex).
//! - A transfer src→dst is *sending* while it has bytes left; its rate is
//!   `bandwidth / max(sending transfers leaving src, sending transfers entering dst)`.
//!   This is an approximation of max-min fair sharing: it is exact when every contended port is
//!   the bottleneck of all its flows, and otherwise under-uses the bandwidth a flow leaves idle
//!   on its less-contended port (true max-min would hand that slack to the others).
//! - Rates are recomputed whenever a transfer starts or its last byte leaves.
//! - After its last byte leaves, a transfer *propagates* for the one-way latency, holding no
//!   bandwidth, and then completes. A lone transfer of B bytes therefore takes exactly
//!   `ceil(B·8 / bandwidth)` ns + latency (= [`Fabric::estimate`]).
//!
//! # Exactness
//!
//! Progress is integer arithmetic, never accumulated floating point: remaining work is kept in
//! units of bit·ns/s (bytes × 8 × 10⁹), a transfer at share k advances `bits_per_s / k` units per
//! nanosecond, and its drain time is `ceil(remaining · k / bits_per_s)` ns. Rounding loses at most
//! 10⁻⁹ bit per rate change, always on the slow side, and a transfer drains exactly at its
//! predicted nanosecond.

use kvfleet_core::{InstanceId, TimeSpan, Timestamp};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Work units per byte: 8 bits × 10⁹ ns/s, so that `bits_per_s / share` units pass per nanosecond.
const WORK_PER_BYTE: u128 = 8 * 1_000_000_000;

/// Invalid [`LinkParams`], naming the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LinkError {
    /// A parameter is out of range.
    #[error("invalid link parameter `{field}` = {value}: {reason}")]
    Invalid {
        /// The parameter.
        field: &'static str,
        /// Its value.
        value: f64,
        /// The accepted range.
        reason: &'static str,
    },
}

/// Per-NIC link parameters (TOML table `[link]`); defaults are PASCAL's testbed, 100 Gbps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LinkParams {
    /// Each direction of each instance's NIC, in Gbit/s (10⁹ bits per second).
    pub bandwidth_gbps: f64,
    /// One-way latency, added once per transfer, in microseconds.
    pub latency_us: f64,
}

impl Default for LinkParams {
    fn default() -> Self {
        LinkParams { bandwidth_gbps: 100.0, latency_us: 10.0 }
    }
}

impl LinkParams {
    /// Both fields must be finite and > 0; the bandwidth must be at least 1 bit/s and fit a u64.
    pub fn validate(&self) -> Result<(), LinkError> {
        let invalid = |field, value, reason| Err(LinkError::Invalid { field, value, reason });
        for (field, value) in [("bandwidth_gbps", self.bandwidth_gbps), ("latency_us", self.latency_us)] {
            if !value.is_finite() || value <= 0.0 {
                return invalid(field, value, "must be finite and > 0");
            }
        }
        let bits_per_s = self.bandwidth_gbps * 1e9;
        if bits_per_s.round() < 1.0 || bits_per_s >= u64::MAX as f64 {
            return invalid("bandwidth_gbps", self.bandwidth_gbps, "must be between 1e-9 and 1.8e10");
        }
        Ok(())
    }
    fn bits_per_s(&self) -> u64 {
        (self.bandwidth_gbps * 1e9).round() as u64
    }
    fn latency(&self) -> TimeSpan {
        TimeSpan::from_secs_f64(self.latency_us * 1e-6)
    }
}

/// A transfer started on a [`Fabric`], unique within it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TransferId(pub u64);

impl fmt::Display for TransferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "xfer-{}", self.0)
    }
}

#[derive(Clone, Debug)]
enum Phase {
    /// Bytes still leaving src; `remaining_work` in bit·ns/s, `share` = the current rate divisor.
    Sending { remaining_work: u128, share: u32 },
    /// The last byte has left; the transfer completes at `arrives`.
    Propagating { arrives: Timestamp },
}

#[derive(Clone, Debug)]
struct Transfer {
    id: TransferId,
    src: usize,
    dst: usize,
    started: Timestamp,
    phase: Phase,
}

/// All instances' NICs and the transfers in progress between them.
#[derive(Clone, Debug)]
pub struct Fabric {
    bits_per_s: u64,
    latency: TimeSpan,
    /// Sending transfers leaving / entering each instance.
    egress: Vec<u32>,
    ingress: Vec<u32>,
    transfers: Vec<Transfer>,
    /// The time up to which every sending transfer's `remaining_work` is accounted.
    progressed_to: Timestamp,
    next_id: u64,
}

impl Fabric {
    /// A fabric for instances `0..instances` (it grows if a larger id is used later).
    pub fn new(instances: u32, params: LinkParams) -> Result<Fabric, LinkError> {
        params.validate()?;
        Ok(Fabric {
            bits_per_s: params.bits_per_s(),
            latency: params.latency(),
            egress: vec![0; instances as usize],
            ingress: vec![0; instances as usize],
            transfers: Vec::new(),
            progressed_to: Timestamp::ZERO,
            next_id: 0,
        })
    }

    /// Start sending `bytes` from `src` to `dst` at `now` (`now` must not precede earlier calls).
    pub fn start(&mut self, now: Timestamp, src: InstanceId, dst: InstanceId, bytes: u64) -> TransferId {
        debug_assert!(now >= self.progressed_to, "Fabric::start at {now} after {}", self.progressed_to);
        let now = now.max(self.progressed_to);
        self.advance_to(now);
        let (src, dst) = (src.0 as usize, dst.0 as usize);
        let needed = src.max(dst) + 1;
        if needed > self.egress.len() {
            self.egress.resize(needed, 0);
            self.ingress.resize(needed, 0);
        }
        let id = TransferId(self.next_id);
        self.next_id += 1;
        let phase = if bytes == 0 {
            Phase::Propagating { arrives: now + self.latency }
        } else {
            self.egress[src] += 1;
            self.ingress[dst] += 1;
            Phase::Sending { remaining_work: bytes as u128 * WORK_PER_BYTE, share: 1 }
        };
        self.transfers.push(Transfer { id, src, dst, started: now, phase });
        if bytes > 0 {
            self.reshare();
        }
        id
    }

    /// When to call [`Fabric::complete_due`] next: the earliest completion, or an earlier instant
    /// at which a transfer's last byte leaves a shared port (the others then speed up, so their
    /// completions move earlier). In the second case `complete_due` returns nothing; always ask
    /// again after calling it. `None` when no transfer is active.
    pub fn next_completion(&self) -> Option<Timestamp> {
        self.transfers
            .iter()
            .map(|t| match t.phase {
                Phase::Propagating { arrives } => arrives,
                Phase::Sending { remaining_work, share } => {
                    let drained = self.progressed_to + self.drain_time(remaining_work, share);
                    // A drain that frees a port nobody else uses changes no rate: no need to wake.
                    if self.egress[t.src] > 1 || self.ingress[t.dst] > 1 {
                        drained
                    } else {
                        drained + self.latency
                    }
                }
            })
            .min()
    }

    /// Every transfer finished by `now`, as (id, start time), ordered by completion time then id.
    pub fn complete_due(&mut self, now: Timestamp) -> Vec<(TransferId, Timestamp)> {
        let mut out = Vec::new();
        self.complete_due_into(now, &mut out);
        out
    }

    /// [`Fabric::complete_due`] appending to a caller-owned buffer (no allocation once it is warm).
    pub fn complete_due_into(&mut self, now: Timestamp, out: &mut Vec<(TransferId, Timestamp)>) {
        let now = now.max(self.progressed_to);
        self.advance_to(now);
        let is_due = |t: &Transfer| matches!(t.phase, Phase::Propagating { arrives } if arrives <= now);
        // Move due transfers to the tail (order of the rest is irrelevant: all choices key on ids).
        let (mut i, mut end) = (0, self.transfers.len());
        while i < end {
            if is_due(&self.transfers[i]) {
                end -= 1;
                self.transfers.swap(i, end);
            } else {
                i += 1;
            }
        }
        let due = &mut self.transfers[end..];
        due.sort_unstable_by_key(|t| match t.phase {
            Phase::Propagating { arrives } => (arrives, t.id),
            Phase::Sending { .. } => (Timestamp::MAX, t.id),
        });
        out.extend(due.iter().map(|t| (t.id, t.started)));
        self.transfers.truncate(end);
    }

    /// Transfers started and not yet returned by `complete_due` (sending or propagating).
    pub fn active(&self) -> usize {
        self.transfers.len()
    }

    /// How long `bytes` take over an otherwise idle path: serialisation plus one-way latency.
    pub fn estimate(&self, bytes: u64) -> TimeSpan {
        self.drain_time(bytes as u128 * WORK_PER_BYTE, 1) + self.latency
    }

    /// Nanoseconds to send `remaining_work` at `bits_per_s / share`, rounded up.
    fn drain_time(&self, remaining_work: u128, share: u32) -> TimeSpan {
        let ns = remaining_work.saturating_mul(share as u128).div_ceil(self.bits_per_s as u128);
        TimeSpan(u64::try_from(ns).unwrap_or(u64::MAX))
    }

    /// Account progress up to `now`, handling every drain before it in time order (each one
    /// frees its ports and re-shares the bandwidth among the transfers still sending).
    fn advance_to(&mut self, now: Timestamp) {
        loop {
            let next_drain = self
                .transfers
                .iter()
                .filter_map(|t| match t.phase {
                    Phase::Sending { remaining_work, share } => {
                        Some(self.progressed_to + self.drain_time(remaining_work, share))
                    }
                    Phase::Propagating { .. } => None,
                })
                .min();
            match next_drain {
                Some(at) if at <= now => {
                    self.progress(at);
                    // Drain times round up, so the transfer that set `at` has no work left; the
                    // guard only keeps a broken invariant from looping forever in release builds.
                    let drained = self.finish_drained(at);
                    debug_assert!(drained > 0, "no transfer drained at its predicted time {at}");
                    if drained == 0 {
                        break;
                    }
                    self.reshare();
                }
                _ => break,
            }
        }
        self.progress(now);
    }

    fn progress(&mut self, to: Timestamp) {
        let dt_ns = to.saturating_since(self.progressed_to).as_nanos() as u128;
        if dt_ns == 0 {
            return;
        }
        let bits_per_s = self.bits_per_s as u128;
        for t in &mut self.transfers {
            if let Phase::Sending { remaining_work, share } = &mut t.phase {
                *remaining_work = remaining_work.saturating_sub(dt_ns * bits_per_s / *share as u128);
            }
        }
        self.progressed_to = to;
    }

    /// Moves every sending transfer with no work left to propagating; returns how many.
    fn finish_drained(&mut self, at: Timestamp) -> usize {
        let arrives = at + self.latency;
        let mut drained = 0;
        for t in &mut self.transfers {
            if matches!(t.phase, Phase::Sending { remaining_work: 0, .. }) {
                self.egress[t.src] -= 1;
                self.ingress[t.dst] -= 1;
                t.phase = Phase::Propagating { arrives };
                drained += 1;
            }
        }
        drained
    }

    fn reshare(&mut self) {
        for t in &mut self.transfers {
            if let Phase::Sending { share, .. } = &mut t.phase {
                *share = self.egress[t.src].max(self.ingress[t.dst]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// 8 Gbps = exactly one byte per nanosecond: hand-checkable timelines.
    fn byte_per_ns(latency_ns: u64) -> Fabric {
        let params = LinkParams { bandwidth_gbps: 8.0, latency_us: latency_ns as f64 / 1000.0 };
        Fabric::new(4, params).expect("valid params")
    }
    fn i(id: u32) -> InstanceId {
        InstanceId(id)
    }

    /// Drive the fabric like the simulator does; returns (id, started, completed) in order.
    fn drive(fabric: &mut Fabric, mut starts: Vec<(u64, u32, u32, u64)>) -> Vec<(TransferId, Timestamp, Timestamp)> {
        starts.sort_by_key(|s| s.0);
        let mut starts = starts.into_iter().peekable();
        let mut done = Vec::new();
        let mut now = Timestamp::ZERO;
        let mut wakeups = 0;
        loop {
            let next_start = starts.peek().map(|s| Timestamp(s.0));
            let next_done = fabric.next_completion();
            let Some(at) = next_start.into_iter().chain(next_done).min() else { break };
            assert!(at >= now, "fabric asked to go back in time: {at} < {now}");
            now = at;
            if next_done == Some(at) {
                wakeups += 1;
                done.extend(fabric.complete_due(now).into_iter().map(|(id, started)| (id, started, now)));
            }
            while starts.peek().is_some_and(|s| Timestamp(s.0) == now) {
                let (_, src, dst, bytes) = starts.next().expect("peeked");
                fabric.start(now, i(src), i(dst), bytes);
            }
            assert!(wakeups <= 2 * (done.len() + fabric.active()) + 1, "too many wake-ups");
        }
        assert_eq!(fabric.active(), 0);
        done
    }

    /// Transfer ids are issued in start order and `drive` starts them sorted (stably) by time, so
    /// this is the start list indexed by `TransferId`.
    fn sorted_by_start(starts: &[(u64, u32, u32, u64)]) -> Vec<(u64, u32, u32, u64)> {
        let mut by_id = starts.to_vec();
        by_id.sort_by_key(|s| s.0);
        by_id
    }

    #[test]
    fn link_params_validation_table() {
        let cases: Vec<(&str, f64, f64, Option<&str>)> = vec![
            ("defaults", 100.0, 10.0, None),
            ("400 Gbps, 1 us", 400.0, 1.0, None),
            ("zero bandwidth", 0.0, 10.0, Some("bandwidth_gbps")),
            ("negative bandwidth", -1.0, 10.0, Some("bandwidth_gbps")),
            ("NaN bandwidth", f64::NAN, 10.0, Some("bandwidth_gbps")),
            ("infinite bandwidth", f64::INFINITY, 10.0, Some("bandwidth_gbps")),
            ("below one bit per second", 1e-12, 10.0, Some("bandwidth_gbps")),
            ("zero latency", 100.0, 0.0, Some("latency_us")),
            ("infinite latency", 100.0, f64::INFINITY, Some("latency_us")),
        ];
        for (name, bandwidth_gbps, latency_us, bad_field) in cases {
            let result = LinkParams { bandwidth_gbps, latency_us }.validate();
            match (result, bad_field) {
                (Ok(()), None) => {}
                (Err(LinkError::Invalid { field, .. }), Some(want)) => assert_eq!(field, want, "{name}"),
                (got, want) => panic!("{name}: got {got:?}, want error on {want:?}"),
            }
        }
        assert_eq!(LinkParams::default(), LinkParams { bandwidth_gbps: 100.0, latency_us: 10.0 });
        assert!(Fabric::new(2, LinkParams { bandwidth_gbps: 0.0, latency_us: 1.0 }).is_err());
    }

    #[test]
    fn lone_transfer_is_serialisation_plus_latency() {
        let mut f = Fabric::new(2, LinkParams::default()).expect("defaults");
        // 1.25 MB at 100 Gbps = 100 us, + 10 us latency.
        assert_eq!(f.estimate(1_250_000), TimeSpan(110_000));
        let id = f.start(Timestamp(5), i(0), i(1), 1_250_000);
        assert_eq!(f.next_completion(), Some(Timestamp(110_005)), "no empty wake-up for an uncontended transfer");
        assert!(f.complete_due(Timestamp(110_004)).is_empty());
        assert_eq!(f.complete_due(Timestamp(110_005)), vec![(id, Timestamp(5))]);
        assert_eq!((f.active(), f.next_completion()), (0, None));
    }

    #[test]
    fn staggered_transfers_share_then_speed_up() {
        // A: 1000 B at t=0; B: 1000 B from the same source at t=500. A has 500 B left at half rate
        // -> drains at 1500; B sent 500 B by then, the rest at full rate -> drains at 2000.
        let mut f = byte_per_ns(1000);
        let a = f.start(Timestamp(0), i(0), i(1), 1000);
        let b = f.start(Timestamp(500), i(0), i(2), 1000);
        assert_eq!(f.next_completion(), Some(Timestamp(1500)), "A's drain re-shares src 0");
        assert!(f.complete_due(Timestamp(1500)).is_empty());
        assert_eq!(f.next_completion(), Some(Timestamp(2500)), "A arrives; B is now alone");
        assert_eq!(f.complete_due(Timestamp(2500)), vec![(a, Timestamp(0))]);
        assert_eq!(f.complete_due(Timestamp(3000)), vec![(b, Timestamp(500))]);
    }

    #[test]
    fn propagating_transfers_hold_no_bandwidth_and_late_calls_are_ordered() {
        let mut f = byte_per_ns(1000);
        let a = f.start(Timestamp(0), i(0), i(1), 1000); // drains 1000, arrives 2000
        let b = f.start(Timestamp(1000), i(0), i(1), 1000); // full rate: drains 2000, arrives 3000
        let c = f.start(Timestamp(1000), i(2), i(3), 0); // empty: arrives 2000
        assert_eq!(
            f.complete_due(Timestamp(5000)),
            vec![(a, Timestamp(0)), (c, Timestamp(1000)), (b, Timestamp(1000))]
        );
    }

    #[test]
    fn uneven_transfers_from_one_source() {
        // 1000 B and 2000 B from src 0 at t=0: both at half rate until the small one drains at
        // 2000; the big one then has 1000 B left at full rate -> drains 3000.
        let mut f = byte_per_ns(10);
        let small = f.start(Timestamp(0), i(0), i(1), 1000);
        let big = f.start(Timestamp(0), i(0), i(2), 2000);
        let done = drive(&mut f, vec![]);
        assert_eq!(done, vec![(small, Timestamp(0), Timestamp(2010)), (big, Timestamp(0), Timestamp(3010))]);
    }

    #[test]
    fn incast_is_limited_by_the_receiver() {
        // Three senders into one receiver: each at a third of the bandwidth.
        let mut f = byte_per_ns(10);
        let done = drive(&mut f, vec![(0, 0, 3, 900), (0, 1, 3, 900), (0, 2, 3, 900)]);
        assert!(done.iter().all(|&(_, _, end)| end == Timestamp(2710)), "{done:?}");
    }

    proptest! {
        #[test]
        fn lone_transfer_matches_formula(bytes in 1u64..10_000_000_000, gbps in 0.5f64..800.0, latency_us in 0.1f64..100.0) {
            let params = LinkParams { bandwidth_gbps: gbps, latency_us };
            let mut f = Fabric::new(2, params.clone()).expect("valid");
            f.start(Timestamp(7), i(1), i(0), bytes);
            let end = f.next_completion().expect("active");
            let want_s = bytes as f64 * 8.0 / (gbps * 1e9) + latency_us * 1e-6;
            let got_s = (end - Timestamp(7)).as_secs_f64();
            prop_assert!((got_s - want_s).abs() <= 2e-9 + want_s * 1e-9, "got {got_s} want {want_s}");
            prop_assert_eq!(end - Timestamp(7), f.estimate(bytes));
        }

        #[test]
        fn two_simultaneous_from_one_source_take_twice_as_long(bytes in 1_000u64..1_000_000_000, gbps in 1.0f64..400.0) {
            let mut f = Fabric::new(3, LinkParams { bandwidth_gbps: gbps, latency_us: 5.0 }).expect("valid");
            let alone_serial_ns = f.estimate(bytes).as_nanos() - 5_000;
            let done = drive(&mut f, vec![(0, 0, 1, bytes), (0, 0, 2, bytes)]);
            prop_assert_eq!(done.len(), 2);
            for (_, started, end) in done {
                let serial_ns = (end - started).as_nanos() - 5_000;
                prop_assert!(serial_ns.abs_diff(2 * alone_serial_ns) <= 1, "{} vs 2 x {}", serial_ns, alone_serial_ns);
            }
        }

        #[test]
        fn disjoint_pairs_do_not_slow_each_other(
            pairs in proptest::collection::vec((0u64..1_000_000, 0u64..50_000_000), 1..8),
        ) {
            let mut f = Fabric::new(16, LinkParams::default()).expect("defaults");
            let starts: Vec<_> = pairs.iter().enumerate().map(|(k, &(at, bytes))| (at, 2 * k as u32, 2 * k as u32 + 1, bytes)).collect();
            let done = drive(&mut f, starts.clone());
            prop_assert_eq!(done.len(), starts.len());
            let by_id = sorted_by_start(&starts);
            for (id, started, end) in done {
                prop_assert_eq!(end - started, f.estimate(by_id[id.0 as usize].3), "{}", id);
            }
        }

        #[test]
        fn every_byte_is_delivered_once_within_bounds(
            n_instances in 1u32..6,
            raw in proptest::collection::vec((0u64..2_000_000, 0u32..6, 0u32..6, 0u64..20_000_000), 1..24),
            gbps in 1.0f64..400.0,
        ) {
            let mut f = Fabric::new(n_instances, LinkParams { bandwidth_gbps: gbps, latency_us: 3.0 }).expect("valid");
            let starts: Vec<_> = raw.iter().map(|&(at, s, d, bytes)| (at, s % n_instances, d % n_instances, bytes)).collect();
            let done = drive(&mut f, starts.clone());
            let by_id = sorted_by_start(&starts);
            prop_assert_eq!(done.len(), starts.len());
            let mut seen = vec![false; starts.len()];
            let mut delivered_bytes = 0u64;
            let n = starts.len() as u64;
            for &(id, started, end) in &done {
                let (at, _, _, bytes) = by_id[id.0 as usize];
                prop_assert!(!seen[id.0 as usize], "{id} completed twice");
                seen[id.0 as usize] = true;
                prop_assert_eq!(started, Timestamp(at));
                delivered_bytes += bytes;
                let took = end - started;
                prop_assert!(took >= f.estimate(bytes), "{id} faster than an idle link");
                // Never slower than sharing the link with every other transfer the whole time.
                let worst = TimeSpan(f.estimate(bytes).as_nanos().saturating_mul(n));
                prop_assert!(took <= worst + TimeSpan(2 * n + 2), "{id} took {took}, bound {worst}");
            }
            prop_assert_eq!(delivered_bytes, starts.iter().map(|s| s.3).sum::<u64>());
            prop_assert!(done.windows(2).all(|w| w[0].2 <= w[1].2), "completions out of order");
        }
    }
}
