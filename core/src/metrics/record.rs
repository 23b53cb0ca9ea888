//! The per-request record an engine fills in as a request runs; metrics aggregate these.

use crate::ids::{InstanceId, RequestId};
use crate::time::SimTime;
use serde::{Deserialize, Serialize};

/// Every timestamp of one request's life. Invariant (checked by tests): arrival ≤ first_token ≤
/// reasoning_end ≤ first_answer_token ≤ finish, wherever present.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    pub id: RequestId,
    pub arrival: SimTime,
    pub prompt_tokens: u32,
    pub reasoning_tokens: u32,
    pub answer_tokens: u32,
    /// Instance chosen at placement, and the one it finished on.
    pub placed_on: InstanceId,
    pub finished_on: Option<InstanceId>,
    /// First iteration that included the request (its prefill started).
    pub first_scheduled: Option<SimTime>,
    /// First output token of any phase.
    pub first_token: Option<SimTime>,
    /// The last reasoning token (`</think>`); `None` when the request has no reasoning phase.
    pub reasoning_end: Option<SimTime>,
    /// Start of the first iteration that ran the request after its reasoning ended (blocking latency).
    pub first_scheduled_after_reasoning: Option<SimTime>,
    /// First answer token: TTFT in PASCAL's sense is `first_answer_token - arrival`.
    pub first_answer_token: Option<SimTime>,
    pub finish: Option<SimTime>,
    /// Andes QoE over the answer phase (PASCAL §V-A: from TPOT only); `None` until finished.
    pub qoe: Option<f64>,
    pub preemptions: u32,
    pub migrations: u32,
    /// The request could never fit on the instance (prompt + output > GPU KV capacity).
    pub rejected: bool,
}
