//! The per-request record an engine fills in as a request runs; metrics aggregate these.

use crate::ids::{InstanceId, RequestId};
use crate::time::Timestamp;
use serde::{Deserialize, Serialize};

/// Every timestamp of one request's life. Invariant (checked by tests): arrival ≤ first_token ≤
/// reasoning_end ≤ first_answer_token ≤ finish, wherever present.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// The request.
    pub id: RequestId,
    /// When it arrived at the cluster.
    pub arrival: Timestamp,
    /// Prompt (prefill) length in tokens.
    pub prompt_tokens: u32,
    /// Reasoning tokens it generates, up to and including `</think>`.
    pub reasoning_tokens: u32,
    /// Answer tokens it generates after `</think>`.
    pub answer_tokens: u32,
    /// Instance chosen at placement.
    pub placed_on: InstanceId,
    /// Instance it finished on (differs from `placed_on` after a migration); `None` until finished.
    pub finished_on: Option<InstanceId>,
    /// First iteration that included the request (its prefill started).
    pub first_scheduled: Option<Timestamp>,
    /// First output token of any phase.
    pub first_token: Option<Timestamp>,
    /// The last reasoning token (`</think>`); `None` when the request has no reasoning phase.
    pub reasoning_end: Option<Timestamp>,
    /// Start of the first iteration that ran the request after its reasoning ended (blocking latency).
    pub first_scheduled_after_reasoning: Option<Timestamp>,
    /// First answer token: TTFT in PASCAL's sense is `first_answer_token - arrival`.
    pub first_answer_token: Option<Timestamp>,
    /// Last output token; `None` until finished.
    pub finish: Option<Timestamp>,
    /// Andes QoE over the answer phase (PASCAL §V-A: from TPOT only); `None` until finished.
    pub qoe: Option<f64>,
    /// Times it was preempted (KV offloaded to CPU or dropped for recompute).
    pub preemptions: u32,
    /// Completed KV-cache migrations between instances.
    pub migrations: u32,
    /// The request could never fit on the instance (prompt + output > GPU KV capacity).
    pub rejected: bool,
    /// Prompt tokens its first prefill found in the instance's prefix cache (not computed).
    #[serde(default)]
    pub cached_tokens: u32,
    /// When its most recent migration attached it to the instance it runs on: the migration's
    /// commit ([`crate::engine::Engine::attach`]; a live migration's `resumed_at`). `None` when
    /// it never migrated.
    #[serde(default)]
    pub migrated_in: Option<Timestamp>,
    /// Start of the first iteration that ran the request after `migrated_in`: the decode-queue
    /// wait after a prefill → decode handoff (Arrow's q3) is this minus `migrated_in`. `None`
    /// when it never migrated, or nothing ran it since its last attach.
    #[serde(default)]
    pub first_scheduled_after_migration: Option<Timestamp>,
    /// Times the cluster started it over on another instance (its instance died, or its
    /// handoff's bytes failed their checksum twice): the controller's count, set on its final
    /// record; 0 where it ran where it was placed.
    #[serde(default)]
    pub replaced: u32,
}
