//! The token pacer and QoE accumulator of Andes, as PASCAL uses it (§II-C, Fig. 3; §V-A "Metric").
//!
//! One [`TokenPacer`] follows one request through its answering phase. It models the user as a
//! reader in a fluid model:
//!
//! * the **expected** curve `E(t) = min(N, (t − t0) / tpot)`: from the first answer token at `t0`
//!   the user expects one token every `tpot` (PASCAL drops Andes' TTFT term from `E`, §V-A, and
//!   judges TTFT separately);
//! * the **generated** curve `G(t)`: answer tokens produced so far (a step function);
//! * the **digested** curve `D(t)`: rises at `1 / tpot` while the pacer's buffer `G − D` is
//!   non-empty and stays flat while it is empty (starvation, Fig. 3 (iii)); `D ≤ G` and `D ≤ E`.
//!
//! QoE = ∫D dt ÷ ∫E dt over `[t0, T]`, `T` the moment `D` reaches `N`. A request whose tokens
//! always arrive ahead of pace has `D = E` and QoE = 1; an SLO violation is QoE < 0.95 (§V-A).
//!
//! The engine calls [`TokenPacer::on_answer_tokens`] on every token of every answering request, so
//! the pacer is a small `Copy` struct with O(1) work per call: it keeps the digested level, the
//! lag `L = (t − t0)/tpot − D` behind the uncapped expected line and the area under `L`, and
//! closes the integrals in closed form. Tracking the lag rather than ∫D keeps a request that never
//! falls behind at exactly `L = 0`, QoE = 1.0, with no round-off from summing millions of small
//! areas. Internally time is measured in units of `tpot` (so the digest rate is 1 token per unit);
//! QoE is a ratio of two areas and so does not depend on that unit.

use crate::time::{TimeSpan, Timestamp};

/// Andes' token pacer for one answering request: buffer level, digested curve, running QoE.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenPacer {
    /// The target time per output token, in ns (at least 1).
    tpot_ns: u64,
    /// `t0`: when the first answer token arrived; `None` until then.
    first_token: Option<Timestamp>,
    /// Time up to which `digested`, `lag` and `area_lag` are valid.
    last_update: Timestamp,
    /// `G`: answer tokens generated so far.
    generated: u32,
    /// `D(last_update)`, in tokens.
    digested: f64,
    /// `L(last_update)`: how far D is behind the uncapped expected line `(t − t0)/tpot`, in tokens.
    lag: f64,
    /// ∫L over `[t0, last_update]`, in token·tpot.
    area_lag: f64,
}

impl TokenPacer {
    /// A pacer for a user who reads one token every `tpot`. A zero `tpot` is treated as 1 ns.
    pub fn new(tpot: TimeSpan) -> Self {
        TokenPacer {
            tpot_ns: tpot.as_nanos().max(1),
            first_token: None,
            last_update: Timestamp::ZERO,
            generated: 0,
            digested: 0.0,
            lag: 0.0,
            area_lag: 0.0,
        }
    }

    /// The reading pace this pacer was built with.
    pub fn tpot(&self) -> TimeSpan {
        TimeSpan::from_nanos(self.tpot_ns)
    }

    /// `t0`, the arrival of the first answer token, once there has been one.
    pub fn first_answer_token(&self) -> Option<Timestamp> {
        self.first_token
    }

    /// Answer tokens generated so far (`G`).
    pub fn generated(&self) -> u32 {
        self.generated
    }

    /// Records `n` answer tokens generated at `at`. The first call with `n > 0` sets `t0`; calls
    /// with `n == 0` before that are ignored. Times must not decrease; an earlier `at` is treated
    /// as the last update time.
    pub fn on_answer_tokens(&mut self, at: Timestamp, n: u32) {
        if self.first_token.is_none() {
            if n == 0 {
                return;
            }
            self.first_token = Some(at);
            self.last_update = at;
        } else {
            self.advance(at);
        }
        self.generated = self.generated.saturating_add(n);
    }

    /// Tokens generated but not yet digested by the user at `now` (the pacer's buffer, `G − D`).
    pub fn buffered(&self, now: Timestamp) -> f64 {
        if self.first_token.is_none() {
            return 0.0;
        }
        let mut s = *self;
        s.advance(now);
        (s.generated as f64 - s.digested).max(0.0)
    }

    /// How long the buffer at `now` lasts before the user starves if no token arrives
    /// (`buffered × tpot`): the slack a time-sharing scheduler has before preempting hurts QoE.
    pub fn slack(&self, now: Timestamp) -> TimeSpan {
        TimeSpan::from_nanos((self.buffered(now) * self.tpot_ns as f64).round() as u64)
    }

    /// QoE over `[t0, now]` while the request runs: 1.0 before or at `t0`.
    ///
    /// `N` is not known yet, so the expected curve is taken uncapped, `E(t) = (t − t0) / tpot`.
    /// That is never below the capped curve of [`Self::finish`], so the running ratio errs on the
    /// side of reporting a request as falling behind, which is what the scheduler's SLO check wants.
    pub fn qoe_so_far(&self, now: Timestamp) -> f64 {
        let Some(t0) = self.first_token else {
            return 1.0;
        };
        if now <= t0 {
            return 1.0;
        }
        let mut s = *self;
        s.advance(now);
        let x = self.units_between(t0, s.last_update);
        // ∫D / ∫E = (x²/2 − ∫L) / (x²/2).
        1.0 - lost_fraction(s.area_lag, 0.5 * x * x)
    }

    /// PASCAL's per-request term of `t_i` (Alg. 2): the running QoE is at least `threshold`.
    pub fn on_pace(&self, now: Timestamp, threshold: f64) -> bool {
        self.qoe_so_far(now) >= threshold
    }

    /// The final QoE once the request has produced `total_answer_tokens` (`N`) tokens.
    ///
    /// The user keeps reading after the last token until `D` reaches `N` at `T`; both integrals run
    /// to `T`. Tokens not yet reported (`N > G`) are taken as generated at the last update. A
    /// request with no answer tokens has QoE 1.
    pub fn finish(&self, total_answer_tokens: u32) -> f64 {
        let Some(t0) = self.first_token else {
            return 1.0;
        };
        let n = total_answer_tokens.max(self.generated);
        if n == 0 {
            return 1.0;
        }
        let n = n as f64;
        // Drain the rest of the buffer: D and the uncapped line both rise one token per unit, so
        // the lag holds still until D reaches N at T.
        let rest = (n - self.digested).max(0.0);
        let area_lag = self.area_lag + self.lag * rest;
        // x = T − t0.
        let x = self.units_between(t0, self.last_update) + rest;
        // E is capped at N: the uncapped line overshoots it by (x − N) past N, which is the final
        // lag (D(T) = N), so the overshoot area is lag²/2 (zero when E never reaches N before T).
        let overshoot = 0.5 * self.lag * self.lag;
        let area_uncapped = 0.5 * x * x;
        // ∫D / ∫E = (x²/2 − ∫L) / (x²/2 − overshoot) = 1 − (∫L − overshoot) / (x²/2 − overshoot).
        1.0 - lost_fraction(area_lag - overshoot, area_uncapped - overshoot)
    }

    /// `(to − from)` in units of tpot.
    fn units_between(&self, from: Timestamp, to: Timestamp) -> f64 {
        to.saturating_since(from).as_nanos() as f64 / self.tpot_ns as f64
    }

    /// Moves `last_update` to `now`, integrating D: it rises at one token per unit until it meets
    /// `G`, then stays flat. Requires `first_token` to be set.
    fn advance(&mut self, now: Timestamp) {
        if now <= self.last_update {
            return;
        }
        let dt = self.units_between(self.last_update, now);
        self.last_update = now;
        let g = self.generated as f64;
        let buffer = g - self.digested;
        if buffer <= 0.0 {
            // Starving: D is flat, the lag grows at one token per unit.
            self.area_lag += self.lag * dt + 0.5 * dt * dt;
            self.lag += dt;
        } else if dt < buffer {
            // Reading from the buffer: D keeps pace, the lag holds still.
            self.area_lag += self.lag * dt;
            self.digested += dt;
        } else {
            // Drains the buffer after `buffer` units, then starves at G for the rest.
            let starve = dt - buffer;
            self.area_lag += self.lag * dt + 0.5 * starve * starve;
            self.lag += starve;
            self.digested = g;
        }
    }
}

/// The lost share of the expected area, `lost / expected` clamped to `[0, 1]`; nothing is lost
/// while the expected area is still empty.
fn lost_fraction(lost: f64, expected: f64) -> f64 {
    if expected <= 0.0 || lost <= 0.0 {
        0.0
    } else {
        (lost / expected).clamp(0.0, 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    fn secs(s: f64) -> Timestamp {
        Timestamp::from_secs_f64(s)
    }

    fn pacer_1s() -> TokenPacer {
        TokenPacer::new(TimeSpan::from_secs_f64(1.0))
    }

    fn assert_close(got: f64, want: f64) {
        assert!((got - want).abs() < 1e-12, "got {got}, want {want}");
    }

    #[test]
    fn hand_example_two_tokens_second_late() {
        // N=2, tpot=1 s, tokens at 0 and 3 s. D: 0→1 over [0,1], flat 1 over [1,3], 1→2 over [3,4]:
        // ∫D = 0.5 + 2 + 1.5 = 4. E: 0→2 over [0,2], flat 2 over [2,4]: ∫E = 2 + 4 = 6. QoE = 2/3.
        let mut p = pacer_1s();
        p.on_answer_tokens(secs(0.0), 1);
        p.on_answer_tokens(secs(3.0), 1);
        assert_close(p.finish(2), 2.0 / 3.0);
    }

    #[test]
    fn always_ahead_of_pace_is_one() {
        let mut p = TokenPacer::new(TimeSpan::from_millis_f64(100.0));
        // 50 tokens, one every 20 ms, five times faster than the 100 ms reading pace.
        for i in 0..50u64 {
            p.on_answer_tokens(Timestamp(5 * SEC + i * 20_000_000), 1);
        }
        assert_eq!(p.finish(50), 1.0);
        for t in [5.0, 5.3, 6.0, 9.0] {
            assert_eq!(p.qoe_so_far(secs(t)), 1.0, "at {t}");
        }
        // Exactly on pace is on pace too.
        let mut q = pacer_1s();
        for i in 0..10u64 {
            q.on_answer_tokens(Timestamp(i * SEC), 1);
        }
        assert_eq!(q.finish(10), 1.0);
    }

    #[test]
    fn long_stall_closed_form() {
        // N=4, tpot=1 s: two tokens at 0, two at 10 s.
        // D: 0→2 over [0,2] (area 2), flat 2 over [2,10] (16), 2→4 over [10,12] (2·2 + 2 = 6): ∫D = 24.
        // E: 0→4 over [0,4] (8), flat 4 over [4,12] (32): ∫E = 40. QoE = 24/40 = 0.6.
        let mut p = pacer_1s();
        p.on_answer_tokens(secs(0.0), 2);
        // Before the stall ends: ∫D[0,10] = 18, uncapped ∫E[0,10] = 50 → 0.36; buffer empty.
        assert_close(p.qoe_so_far(secs(10.0)), 0.36);
        assert_eq!(p.buffered(secs(10.0)), 0.0);
        p.on_answer_tokens(secs(10.0), 2);
        assert_close(p.buffered(secs(10.0)), 2.0);
        assert_close(p.buffered(secs(11.5)), 0.5);
        assert_eq!(p.slack(secs(11.5)), TimeSpan::from_millis_f64(500.0));
        assert_close(p.finish(4), 0.6);
    }

    #[test]
    fn later_second_token_gives_lower_qoe() {
        let mut last = f64::INFINITY;
        for delay_ms in [0u64, 500, 1000, 1500, 2000, 3000, 5000, 10_000, 60_000] {
            let mut p = pacer_1s();
            p.on_answer_tokens(Timestamp(0), 1);
            p.on_answer_tokens(Timestamp(delay_ms * 1_000_000), 1);
            let q = p.finish(2);
            if delay_ms <= 1000 {
                assert_eq!(q, 1.0, "second token at {delay_ms} ms is on time");
            } else {
                assert!(q < last, "delay {delay_ms} ms: {q} !< {last}");
            }
            last = q;
        }
    }

    #[test]
    fn on_pace_threshold_edge() {
        // Hand example at t = 3 s, before the second token: ∫D = 0.5 + 2 = 2.5, ∫E = 4.5 → 5/9.
        let mut p = pacer_1s();
        p.on_answer_tokens(secs(0.0), 1);
        let q = p.qoe_so_far(secs(3.0));
        assert_close(q, 5.0 / 9.0);
        assert!(p.on_pace(secs(3.0), q), "equal to the threshold is on pace");
        assert!(!p.on_pace(secs(3.0), q + 1e-12));
        assert!(p.on_pace(secs(3.0), 0.55) && !p.on_pace(secs(3.0), 0.56));
        // At and before t0 everything is on pace, and before t0 nothing is buffered.
        assert!(p.on_pace(secs(0.0), 1.0));
        let fresh = pacer_1s();
        assert!(fresh.on_pace(secs(100.0), 1.0));
        assert_eq!(fresh.buffered(secs(100.0)), 0.0);
        assert_eq!(fresh.finish(0), 1.0);
    }

    #[test]
    fn queries_do_not_change_state_and_running_matches_incremental() {
        let mut a = pacer_1s();
        let mut b = pacer_1s();
        a.on_answer_tokens(secs(1.0), 3);
        b.on_answer_tokens(secs(1.0), 3);
        // Querying `a` at several times must not perturb it.
        for t in [2.0, 4.0, 7.5] {
            let _ = a.qoe_so_far(secs(t));
            let _ = a.buffered(secs(t));
        }
        assert_eq!(a, b);
        // A zero-token update at t is the same as a query at t.
        let before = b.qoe_so_far(secs(6.0));
        b.on_answer_tokens(secs(6.0), 0);
        assert_eq!(b.qoe_so_far(secs(6.0)), before);
        // ∫D[1,6] = 4.5 (0→3 over 3 s) + 3·2 = 10.5; ∫E = 12.5.
        assert_close(before, 10.5 / 12.5);
    }

    #[test]
    fn zero_tokens_before_first_do_not_set_t0_and_short_n_is_safe() {
        let mut p = pacer_1s();
        p.on_answer_tokens(secs(1.0), 0);
        assert_eq!(p.first_answer_token(), None);
        p.on_answer_tokens(secs(2.0), 1);
        assert_eq!(p.first_answer_token(), Some(secs(2.0)));
        // finish with N below G uses G; N above G assumes the rest arrived at the last update.
        assert_eq!(p.finish(0), 1.0);
        assert_eq!(p.finish(5), 1.0);
        assert!(std::mem::size_of::<TokenPacer>() <= 64);
    }

    /// An independent reference: token k is fully digested at r_k = max(r_{k−1}, a_k) + tpot
    /// (r_0 = t0), so each token adds (T − r_k) + tpot/2 to ∫D and (T − (t0 + k·tpot)) + tpot/2
    /// to ∫E, with T = r_N.
    fn reference_qoe(arrivals_s: &[f64], tpot_s: f64) -> f64 {
        let t0 = arrivals_s[0];
        let mut r = t0;
        let mut done = Vec::with_capacity(arrivals_s.len());
        for &a in arrivals_s {
            r = r.max(a) + tpot_s;
            done.push(r);
        }
        let t_end = r;
        let area_d: f64 = done.iter().map(|rk| t_end - rk + 0.5 * tpot_s).sum();
        let area_e: f64 = (1..=arrivals_s.len()).map(|k| t_end - (t0 + k as f64 * tpot_s) + 0.5 * tpot_s).sum();
        area_d / area_e
    }

    proptest::proptest! {
        #[test]
        fn finish_matches_reference(
            tpot_ms in 1u64..500,
            start_ms in 0u64..100_000,
            batches in proptest::collection::vec((0u64..3_000, 1u32..4), 1..60),
        ) {
            let mut p = TokenPacer::new(TimeSpan::from_millis_f64(tpot_ms as f64));
            let mut t_ms = start_ms;
            let mut arrivals_s = Vec::new();
            for (i, &(gap_ms, n)) in batches.iter().enumerate() {
                if i > 0 {
                    t_ms += gap_ms;
                }
                p.on_answer_tokens(Timestamp(t_ms * 1_000_000), n);
                let running = p.qoe_so_far(Timestamp(t_ms * 1_000_000));
                proptest::prop_assert!((0.0..=1.0).contains(&running));
                arrivals_s.extend(std::iter::repeat_n(t_ms as f64 / 1e3, n as usize));
            }
            let got = p.finish(arrivals_s.len() as u32);
            let want = reference_qoe(&arrivals_s, tpot_ms as f64 / 1e3);
            proptest::prop_assert!((got - want).abs() < 1e-9, "got {} want {}", got, want);
        }
    }
}
