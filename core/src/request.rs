//! What a workload hands to the cluster: one request with its lengths known up front.
//!
//! The emulator does not run a real model, so the reasoning/answer split is part of the request:
//! it tells the engine when the `</think>` boundary is reached and when the request ends.

use crate::ids::RequestId;
use crate::time::SimTime;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestSpec {
    pub id: RequestId,
    /// Submission time.
    pub arrival: SimTime,
    pub prompt_tokens: u32,
    /// Tokens generated before `</think>` (the user never sees them). Zero for non-reasoning.
    pub reasoning_tokens: u32,
    /// Tokens generated after `</think>` (streamed to the user). At least one.
    pub answer_tokens: u32,
}

impl RequestSpec {
    pub fn output_tokens(&self) -> u32 {
        self.reasoning_tokens + self.answer_tokens
    }
    /// Largest KV context the request ever holds: the prompt plus every generated token.
    pub fn max_context_tokens(&self) -> u32 {
        self.prompt_tokens + self.output_tokens()
    }
}
