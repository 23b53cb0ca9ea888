//! One KV-cache migration as the simulator or the emulator measured it (PASCAL §IV-B, §V-D: P99
//! KV transfer latency); runs report migration count, bytes, P50/P99 transfer time and aborts
//! from these, and the live-migration tables and `live-migrations*.csv` of both backends.
//!
//! Both backends fill the same [`MigrationRecord`]: the simulator from its live-migration driver
//! (`kvfleet_sim::migration`), the emulator from the source workers' logs the leader collects
//! (`kvfleet up` / `kvfleet replay`, `cli/src/up/live.rs`). Where a backend does not log a
//! measurement, the field says so (`None`, or as documented on it).

use crate::ids::{InstanceId, RequestId};
use crate::time::{TimeSpan, Timestamp};
use serde::{Deserialize, Serialize};

/// How a migration ended.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MigrationOutcome {
    /// The request runs on the target.
    #[default]
    Committed,
    /// The target declined the `Prepare` (no room, ...): nothing was copied and the request never
    /// paused; the controller may try another target. The text says why.
    Refused(String),
    /// The migration was abandoned and the request stayed on (or went back to) its source. The
    /// text says why.
    Aborted(String),
}

impl MigrationOutcome {
    /// `committed`, `refused` or `aborted`: how every report names it (the same names as
    /// `kvfleet_wire::outcome_name`).
    pub fn name(&self) -> &'static str {
        match self {
            MigrationOutcome::Committed => "committed",
            MigrationOutcome::Refused(_) => "refused",
            MigrationOutcome::Aborted(_) => "aborted",
        }
    }

    /// Why it did not commit (`None` if it did).
    pub fn reason(&self) -> Option<&str> {
        match self {
            MigrationOutcome::Committed => None,
            MigrationOutcome::Refused(r) | MigrationOutcome::Aborted(r) => Some(r),
        }
    }
}

/// A request's KV cache moving between instances at its `</think>` boundary, as measured by the
/// source side of the live-migration protocol (pipelined live stages, then a stop-and-copy).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationRecord {
    /// The migrated request.
    pub request: RequestId,
    /// Source instance (where the request reasoned).
    pub from: InstanceId,
    /// Target instance chosen for the answering phase.
    pub to: InstanceId,
    /// How it ended.
    pub outcome: MigrationOutcome,
    /// Aborted because bytes the target received did not hash to the source's checksum.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub checksum_mismatch: bool,
    /// The source's deadline passed between `Commit` and `CommitReply`, so the outcome was
    /// settled from the target's side. The emulator's log does not say (always `false` there).
    pub in_doubt: bool,
    /// Block bytes put on the wire, all stages (for an aborted migration, what was sent before
    /// the abort).
    pub bytes: u64,
    /// Block bytes not sent: the target's prefix cache held them (destination-missing copy).
    #[serde(default)]
    pub bytes_skipped: u64,
    /// When the transfer started (the `Prepare` was sent).
    pub start: Timestamp,
    /// When the transfer completed or was abandoned (the source was done).
    pub end: Timestamp,
    /// Live copy stages run before the stop-and-copy.
    pub live_stages: u32,
    /// Bytes of each copy stage put on the wire, in order: the live stages, then the
    /// stop-and-copy. Its length is the stage count the reports show.
    pub stage_bytes: Vec<u64>,
    /// Each of those stages' time, in their order: its blocks handed to the transport → the
    /// target acknowledged them (`StageAck`; `CommitReply` for the stop-and-copy). Empty where a
    /// log predates it.
    #[serde(default)]
    pub stage_times: Vec<TimeSpan>,
    /// KV blocks those stages carried.
    pub blocks: u64,
    /// The request's KV tokens when the migration started; `None` where the backend did not log
    /// it (the emulator logs only the latest count, `kv_tokens_final` once paused).
    pub kv_tokens_start: Option<u32>,
    /// Its KV tokens once paused (what the stop-and-copy completes); `None` if never paused.
    pub kv_tokens_final: Option<u32>,
    /// When the request froze on the source; `None` if it never did.
    pub paused_at: Option<Timestamp>,
    /// When it ran again: attached on the target (committed) or resumed on the source (aborted).
    /// `None` if it never froze, or where the backend logs only the `downtime`.
    pub resumed_at: Option<Timestamp>,
    /// What the request itself lost: `paused_at → resumed_at` in the simulator; in the emulator,
    /// the source's pause → the target confirmed it runs the request (`CommitReply`). `None` if
    /// it never froze.
    pub downtime: Option<TimeSpan>,
}

impl MigrationRecord {
    /// `start → end` (zero if the record is inverted).
    pub fn total_time(&self) -> TimeSpan {
        self.end.saturating_since(self.start)
    }
    /// `end − start` in seconds (zero if the record is inverted).
    pub fn transfer_s(&self) -> f64 {
        self.total_time().as_secs_f64()
    }
    /// Whether it committed (the request runs on `to`).
    pub fn committed(&self) -> bool {
        self.outcome == MigrationOutcome::Committed
    }
    /// The target declined the `Prepare`: nothing was copied and the request never paused. Not
    /// an abort of a running migration, though the run summary counts it among the aborted ones.
    pub fn refused(&self) -> bool {
        matches!(self.outcome, MigrationOutcome::Refused(_))
    }
    /// `committed`, `refused` or `aborted` (see [`MigrationOutcome::name`]).
    pub fn outcome_name(&self) -> &'static str {
        self.outcome.name()
    }
    /// Why it did not commit (`None` if it did).
    pub fn abort_reason(&self) -> Option<&str> {
        self.outcome.reason()
    }
    /// Copy stages whose blocks went on the wire, the stop-and-copy included.
    pub fn stages(&self) -> u32 {
        self.stage_bytes.len() as u32
    }
    /// The request's KV tokens: once paused if it paused, else at the start (0 if unknown).
    pub fn kv_tokens(&self) -> u32 {
        self.kv_tokens_final.or(self.kv_tokens_start).unwrap_or(0)
    }
    /// Committed migrations: `bytes ÷ total_time`, bits per second ÷ 10⁹; `0` otherwise.
    pub fn goodput_gbps(&self) -> f64 {
        let s = self.transfer_s();
        if self.committed() && s > 0.0 {
            self.bytes as f64 * 8.0 / s / 1e9
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_are_named_and_explained() {
        let m = |outcome| MigrationRecord { outcome, ..Default::default() };
        let ok = m(MigrationOutcome::Committed);
        let refused = m(MigrationOutcome::Refused("refused by the target: no room".into()));
        let aborted = m(MigrationOutcome::Aborted("timed out while copying".into()));
        assert_eq!(
            [ok.outcome_name(), refused.outcome_name(), aborted.outcome_name()],
            ["committed", "refused", "aborted"]
        );
        assert_eq!((ok.committed(), ok.refused(), ok.abort_reason()), (true, false, None));
        assert_eq!((refused.committed(), refused.refused()), (false, true));
        assert_eq!(aborted.abort_reason(), Some("timed out while copying"));
    }

    #[test]
    fn times_stages_and_goodput() {
        let m = MigrationRecord {
            bytes: 1_000_000_000,
            start: Timestamp::from_secs_f64(1.0),
            end: Timestamp::from_secs_f64(3.0),
            stage_bytes: vec![900_000_000, 100_000_000],
            kv_tokens_start: Some(100),
            ..Default::default()
        };
        assert_eq!((m.total_time(), m.transfer_s()), (TimeSpan::from_secs_f64(2.0), 2.0));
        assert_eq!((m.stages(), m.kv_tokens()), (2, 100));
        assert_eq!(m.goodput_gbps(), 4.0);
        let inverted = MigrationRecord { start: m.end, end: m.start, ..m.clone() };
        assert_eq!((inverted.transfer_s(), inverted.goodput_gbps()), (0.0, 0.0));
        let aborted = MigrationRecord { outcome: MigrationOutcome::Aborted("x".into()), kv_tokens_final: Some(7), ..m };
        assert_eq!((aborted.goodput_gbps(), aborted.kv_tokens()), (0.0, 7));
    }
}
