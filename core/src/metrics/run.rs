//! One finished run, as both backends report it: the simulator (virtual time) and the emulator
//! (real processes, wall-clock time) build the same [`RunResult`] from their per-request and
//! per-migration records through [`RunResult::new`], so summaries, tail bins and migration
//! statistics are computed in one place.

use super::{
    summarize, tail_ttft_by_reasoning_bin, Distribution, MigrationRecord, RequestRecord, RunSummary, SloTargets,
    TailBin,
};
use crate::engine::EngineStats;
use crate::ids::RequestId;
use crate::time::TimeSpan;
use serde::Serialize;
use std::collections::HashMap;

/// The reasoning-length bin width of a run's tail-TTFT table (tokens; PASCAL Fig. 10).
pub const TAIL_BIN_TOKENS: u32 = 256;

/// What identifies a run: the policy asked for and what it resolved to, the rate, the timing.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RunIdentity {
    /// The policy as asked for: a preset name or `INTRA+INSTANCE`.
    pub policy: String,
    /// The intra-instance scheduler it resolved to.
    pub intra: String,
    /// The instance (placement and migration) policy it resolved to.
    pub instance_policy: String,
    /// The arrival rate this run used (req/s), when the workload has one.
    pub rate: Option<f64>,
    /// Name of the timing model used.
    pub timing: String,
    /// The workload seed.
    pub seed: u64,
}

/// One finished run: inputs that identify it, per-request data, and the summary.
#[derive(Debug, Serialize)]
pub struct RunResult {
    /// The policy as asked for: a preset name or `INTRA+INSTANCE`.
    pub policy: String,
    /// The intra-instance scheduler it resolved to.
    pub intra: String,
    /// The instance (placement and migration) policy it resolved to.
    pub instance_policy: String,
    /// The arrival rate this run used (req/s), when the workload has one.
    pub rate: Option<f64>,
    /// Name of the timing model used.
    pub timing: String,
    /// The workload seed.
    pub seed: u64,
    /// Latency, throughput, SLO and migration summary of the run.
    pub summary: RunSummary,
    /// Tail TTFT per reasoning-length bin of [`TAIL_BIN_TOKENS`] tokens.
    pub tail_ttft: Vec<TailBin>,
    /// One record per finished request.
    #[serde(skip)]
    pub records: Vec<RequestRecord>,
    /// One record per migration, in the order they ended.
    #[serde(skip)]
    pub migrations: Vec<MigrationRecord>,
    /// Counts and distributions of the same migrations.
    pub live_migrations: LiveMigrations,
    /// Engine counters per instance (the simulator's; empty where the backend does not collect
    /// them).
    #[serde(skip)]
    pub instances: Vec<EngineStats>,
    /// Simulated events (the simulator's, for the events/s benchmark; 0 otherwise): every
    /// iteration end and every other event, as a run stepping one iteration at a time handles.
    pub events: u64,
    /// Events the simulator took off its queue: fewer than `events` when engines leap over
    /// iterations.
    #[serde(skip)]
    pub queue_events: u64,
    /// How long the run lasted, seconds: virtual time of the last event in the simulator,
    /// wall-clock time from the first submit to the last answer in the emulator.
    pub span_s: f64,
    /// Every role an instance was given after the start (prefill/decode flips), in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub role_changes: Vec<RoleChange>,
    /// Wall time the cluster controller took per decision (the simulator's; for benchmarks).
    #[serde(skip)]
    pub decisions: DecisionTimes,
    /// A prefill/decode run's handoffs: the wait for a decoder, the copy, the decode queue.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handoffs: Option<HandoffTimes>,
}

/// Wall time of the cluster controller's decisions in one run, ns (the simulator measures them;
/// nothing in a result depends on them).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DecisionTimes {
    /// Placing each arrival.
    pub arrival_ns: Vec<u32>,
    /// Handing off each request whose prefill ended on a prefill instance.
    pub handoff_ns: Vec<u32>,
}

/// An instance given a new role during a run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RoleChange {
    /// When, seconds from the run's start.
    pub at_s: f64,
    /// The instance.
    pub instance: u32,
    /// Its new role (`prefill`, `decode`, …).
    pub role: String,
}

impl RunResult {
    /// Whether `other` computed the same run: equal serialized results (summary, …), records,
    /// migrations and engine counters. What the simulator does not compute (its wall-clock
    /// decision times, events taken off its queue) may differ.
    pub fn same_outcome(&self, other: &RunResult) -> bool {
        let json = |r: &RunResult| serde_json::to_string(r).ok();
        json(self).is_some()
            && json(self) == json(other)
            // Not serialized: compared apart (every per-request time, q3's included).
            && self.records == other.records
            && self.migrations == other.migrations
            && self.instances == other.instances
    }

    /// A run's result from its records: the summary against `slo`, the tail bins and the
    /// migration statistics are derived here, the same way for every backend.
    pub fn new(
        id: RunIdentity,
        records: Vec<RequestRecord>,
        migrations: Vec<MigrationRecord>,
        slo: &SloTargets,
        span_s: f64,
    ) -> RunResult {
        let RunIdentity { policy, intra, instance_policy, rate, timing, seed } = id;
        RunResult {
            policy,
            intra,
            instance_policy,
            rate,
            timing,
            seed,
            summary: summarize(&records, &migrations, slo),
            tail_ttft: tail_ttft_by_reasoning_bin(&records, TAIL_BIN_TOKENS),
            live_migrations: LiveMigrations::new(&migrations),
            records,
            migrations,
            instances: Vec::new(),
            events: 0,
            queue_events: 0,
            span_s,
            role_changes: Vec::new(),
            decisions: DecisionTimes::default(),
            handoffs: None,
        }
    }

    /// With the simulator's per-instance engine counters and event counts.
    pub fn with_engine_counters(mut self, instances: Vec<EngineStats>, events: u64, queue_events: u64) -> RunResult {
        self.instances = instances;
        self.events = events;
        self.queue_events = queue_events;
        self
    }

    /// Prefix copies its placements made before starting requests: how many, and their bytes.
    pub fn with_prefix_fetches(mut self, fetches: u64, bytes: u64) -> RunResult {
        self.summary.prefix_fetches = fetches;
        self.summary.prefix_fetch_bytes = bytes;
        self
    }

    /// Its handoffs' times ([`HandoffTimes`]), for a prefill/decode run.
    pub fn with_handoffs(mut self) -> RunResult {
        self.handoffs = Some(HandoffTimes::new(&self.records, &self.migrations));
        self
    }

    /// The run's role changes ([`RunResult::role_changes`]) and decision times.
    pub fn with_control(mut self, role_changes: Vec<RoleChange>, decisions: DecisionTimes) -> RunResult {
        self.role_changes = role_changes;
        self.decisions = decisions;
        self
    }
}

/// Where a prefill/decode run's requests waited around their handoff (Arrow's q2, c and q3),
/// P50 and P99 in seconds. A request's handoff is its first committed migration.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct HandoffTimes {
    /// Requests handed off (a committed migration).
    pub handoffs: u64,
    /// q2, the wait for a decoder: its first token → its handoff starts (0 for a handoff that
    /// started with its prefill, overlapping it).
    pub q2_p50_s: Option<f64>,
    /// P99 of q2.
    pub q2_p99_s: Option<f64>,
    /// c, the copy: the handoff's start → its commit.
    pub c_p50_s: Option<f64>,
    /// P99 of c.
    pub c_p99_s: Option<f64>,
    /// q3, the decode queue: attached to the decoder → the first iteration that ran it there
    /// (after the request's last migration).
    pub q3_p50_s: Option<f64>,
    /// P99 of q3.
    pub q3_p99_s: Option<f64>,
    /// Requests prefilled again on another instance after their handoffs' bytes failed their
    /// checksum: one with such a move out of an instance other than the one its finishing copy
    /// was placed on.
    pub prefilled_again: u64,
}

impl HandoffTimes {
    /// From a run's records and migrations.
    pub fn new(records: &[RequestRecord], migrations: &[MigrationRecord]) -> HandoffTimes {
        let mut first: HashMap<RequestId, &MigrationRecord> = HashMap::new();
        for m in migrations.iter().filter(|m| m.committed()) {
            first.entry(m.request).and_modify(|f| *f = if m.start < f.start { m } else { f }).or_insert(m);
        }
        let (mut q2, mut c, mut q3) = (Vec::new(), Vec::new(), Vec::new());
        for r in records {
            if let Some(m) = first.get(&r.id) {
                c.push(m.transfer_s());
                if let Some(t) = r.first_token {
                    q2.push(m.start.saturating_since(t).as_secs_f64());
                }
            }
            if let (Some(attached), Some(ran)) = (r.migrated_in, r.first_scheduled_after_migration) {
                q3.push(ran.saturating_since(attached).as_secs_f64());
            }
        }
        let p = |v: Vec<f64>| {
            let d = Distribution::new(v);
            (d.percentile(0.5), d.percentile(0.99))
        };
        let ((q2_p50_s, q2_p99_s), (c_p50_s, c_p99_s), (q3_p50_s, q3_p99_s)) = (p(q2), p(c), p(q3));
        let placed_on: HashMap<RequestId, crate::ids::InstanceId> =
            records.iter().map(|r| (r.id, r.placed_on)).collect();
        let again: std::collections::HashSet<RequestId> = migrations
            .iter()
            .filter(|m| m.checksum_mismatch && placed_on.get(&m.request).is_some_and(|&on| on != m.from))
            .map(|m| m.request)
            .collect();
        let prefilled_again = again.len() as u64;
        HandoffTimes {
            handoffs: first.len() as u64,
            q2_p50_s,
            q2_p99_s,
            c_p50_s,
            c_p99_s,
            q3_p50_s,
            q3_p99_s,
            prefilled_again,
        }
    }
}

impl std::fmt::Display for HandoffTimes {
    /// `q2 (wait for a decoder) ms p50 … p99 … | c (copy) … | q3 (decode queue) …`
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |v: Option<f64>| v.map_or("-".into(), |s| format!("{:.1}", s * 1e3));
        write!(
            f,
            "q2 (wait for a decoder) ms p50 {} p99 {} | c (copy) ms p50 {} p99 {} | q3 (decode queue) ms p50 {} p99 {}",
            ms(self.q2_p50_s),
            ms(self.q2_p99_s),
            ms(self.c_p50_s),
            ms(self.c_p99_s),
            ms(self.q3_p50_s),
            ms(self.q3_p99_s)
        )?;
        if self.prefilled_again > 0 {
            write!(f, " | {} prefilled again after checksum mismatches", self.prefilled_again)?;
        }
        Ok(())
    }
}

/// A run's live migrations: how they ended and what they cost (the records themselves are the
/// run's [`MigrationRecord`]s).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LiveMigrations {
    /// Migrations that committed.
    pub committed: u64,
    /// Ended without committing, the request staying at its source (refused ones not counted).
    pub aborted: u64,
    /// The target declined the `Prepare` (no room); the controller may have tried another.
    pub refused: u64,
    /// Of the aborted ones, those whose bytes failed their checksum at the target.
    pub checksum_mismatches: u64,
    /// The source's deadline passed between `Commit` and `CommitReply`; settled by the target.
    pub in_doubt: u64,
    /// Copy stages per committed migration, the stop-and-copy one included.
    pub stages_avg: Option<f64>,
    /// Committed migrations: pause → the request runs on the target.
    pub downtime_p50_s: Option<f64>,
    /// P99 of the same downtime, seconds.
    pub downtime_p99_s: Option<f64>,
    /// Committed migrations: start (`Prepare` sent) → the source learns of the commit.
    pub transfer_p50_s: Option<f64>,
    /// P99 of the same transfer time, seconds.
    pub transfer_p99_s: Option<f64>,
    /// Block bytes the committed migrations moved.
    pub bytes_committed: u64,
}

impl LiveMigrations {
    /// Counts and distributions over a run's migrations.
    pub fn new(records: &[MigrationRecord]) -> LiveMigrations {
        let ok: Vec<&MigrationRecord> = records.iter().filter(|r| r.committed()).collect();
        let downtime = Distribution::new(ok.iter().filter_map(|r| r.downtime.map(TimeSpan::as_secs_f64)).collect());
        let transfer = Distribution::new(ok.iter().map(|r| r.transfer_s()).collect());
        let refused = records.iter().filter(|r| r.refused()).count() as u64;
        LiveMigrations {
            committed: ok.len() as u64,
            aborted: records.len() as u64 - ok.len() as u64 - refused,
            refused,
            checksum_mismatches: records.iter().filter(|r| r.checksum_mismatch).count() as u64,
            in_doubt: records.iter().filter(|r| r.in_doubt).count() as u64,
            stages_avg: Distribution::new(ok.iter().map(|r| f64::from(r.stages())).collect()).mean(),
            downtime_p50_s: downtime.percentile(0.5),
            downtime_p99_s: downtime.percentile(0.99),
            transfer_p50_s: transfer.percentile(0.5),
            transfer_p99_s: transfer.percentile(0.99),
            bytes_committed: ok.iter().map(|r| r.bytes).sum(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::InstanceId;
    use crate::metrics::MigrationOutcome;
    use crate::time::Timestamp;

    fn t(s: f64) -> Timestamp {
        Timestamp::from_secs_f64(s)
    }

    /// q2 from the first token to the first committed migration (an aborted try before it and a
    /// later move after it are not the handoff), c its copy, q3 each request's decode queue.
    #[test]
    fn handoff_times_take_each_requests_first_committed_migration() {
        let rec = |id, first_token: f64, attached: Option<f64>, ran: Option<f64>| RequestRecord {
            id: RequestId(id),
            first_token: Some(t(first_token)),
            migrated_in: attached.map(t),
            first_scheduled_after_migration: ran.map(t),
            ..Default::default()
        };
        let records =
            vec![rec(0, 1.0, Some(1.6), Some(1.65)), rec(1, 2.0, Some(3.2), Some(3.5)), rec(2, 4.0, None, None)];
        let m = |id, start: f64, end: f64, outcome| MigrationRecord {
            request: RequestId(id),
            from: InstanceId(0),
            to: InstanceId(1),
            outcome,
            start: t(start),
            end: t(end),
            ..Default::default()
        };
        let ok = MigrationOutcome::Committed;
        let migrations = vec![
            m(0, 1.1, 1.6, ok.clone()),
            // request 1: refused at 2.0, handed off at 2.5, moved again at 9.0
            m(1, 9.0, 9.1, ok.clone()),
            m(1, 2.0, 2.0, MigrationOutcome::Refused("no room".into())),
            m(1, 2.5, 3.2, ok),
        ];
        let h = HandoffTimes::new(&records, &migrations);
        assert_eq!(h.handoffs, 2);
        let close = |v: Option<f64>, want: f64| (v.unwrap() - want).abs() < 1e-9;
        // q2: 0.1 and 0.5 s; c: 0.5 and 0.7 s; q3: 0.05 and 0.3 s (nearest rank: P50 the lower)
        assert!(close(h.q2_p50_s, 0.1) && close(h.q2_p99_s, 0.5), "{h:?}");
        assert!(close(h.c_p50_s, 0.5) && close(h.c_p99_s, 0.7), "{h:?}");
        assert!(close(h.q3_p50_s, 0.05) && close(h.q3_p99_s, 0.3), "{h:?}");
        let line = h.to_string();
        assert!(line.contains("q2 (wait for a decoder) ms p50 100.0 p99 500.0"), "{line}");
        // A handoff that started before the first token (overlapping the prefill) waited 0.
        let overlapped = HandoffTimes::new(&records[..1], &[m(0, 0.5, 1.6, MigrationOutcome::Committed)]);
        assert_eq!(overlapped.q2_p99_s, Some(0.0));
        assert_eq!(HandoffTimes::new(&records, &[]).handoffs, 0);
        assert_eq!(h.prefilled_again, 0);
        assert!(!line.contains("prefilled again"), "{line}");
    }

    /// A request counts as prefilled again when a move out of another instance than the one its
    /// finishing copy was placed on failed its checksum; a mismatch retried from the same
    /// instance, or an abort for another cause, does not count.
    #[test]
    fn requests_prefilled_again_after_checksum_mismatches_are_counted() {
        let rec =
            |id, placed_on| RequestRecord { id: RequestId(id), placed_on: InstanceId(placed_on), ..Default::default() };
        let m = |id, from, checksum_mismatch| MigrationRecord {
            request: RequestId(id),
            from: InstanceId(from),
            to: InstanceId(3),
            outcome: MigrationOutcome::Aborted("x".into()),
            checksum_mismatch,
            ..Default::default()
        };
        // 0: mismatches out of 0, finished as placed on 1 (prefilled again); 1: a mismatch out of
        // 1, retried from 1; 2: an abort for another cause out of 0; 3: mismatches out of 0 and 1,
        // placed on 1 last (prefilled again once).
        let records = vec![rec(0, 1), rec(1, 1), rec(2, 1), rec(3, 1)];
        let migrations =
            vec![m(0, 0, true), m(0, 0, true), m(1, 1, true), m(2, 0, false), m(3, 0, true), m(3, 1, true)];
        let h = HandoffTimes::new(&records, &migrations);
        assert_eq!(h.prefilled_again, 2);
        assert!(h.to_string().ends_with(" | 2 prefilled again after checksum mismatches"), "{h}");
    }
}
