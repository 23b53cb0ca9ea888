//! What a workload hands to the cluster: one request with its lengths known up front.
//!
//! The emulator does not run a real model, so the reasoning/answer split is part of the request:
//! it tells the engine when the `</think>` boundary is reached and when the request ends.

use crate::ids::RequestId;
use crate::time::Timestamp;
use serde::{Deserialize, Serialize};

/// One request as a workload generates it: arrival time and its prompt, reasoning and answer lengths
/// in tokens.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestSpec {
    /// Unique id within the run.
    pub id: RequestId,
    /// Submission time.
    pub arrival: Timestamp,
    /// Prompt length in tokens (prefilled before the first output token). At least one.
    pub prompt_tokens: u32,
    /// Tokens generated before `</think>` (the user never sees them). Zero for non-reasoning.
    pub reasoning_tokens: u32,
    /// Tokens generated after `</think>` (streamed to the user). At least one.
    pub answer_tokens: u32,
    /// What the prompt says, as content ids of [`crate::kv::TRACE_BLOCK_TOKENS`] tokens each
    /// (Mooncake's `hash_ids`): equal ids at equal positions are equal text, so prompts sharing
    /// leading ids share prefix-cached KV. Tokens past the ids are unique; none: nothing shared.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub content_ids: Vec<u64>,
}

/// Most tokens one request may hold, prompt and output together: 16 M, far beyond any model's
/// context window. Workloads refuse longer requests, so every token count of a request, and their
/// sums, stay far inside `u32` (a prompt + output reaching 2³² once wrapped and vanished from
/// every count).
pub const MAX_REQUEST_TOKENS: u32 = 1 << 24;

impl RequestSpec {
    /// Reasoning plus answer tokens.
    pub fn output_tokens(&self) -> u32 {
        self.reasoning_tokens.saturating_add(self.answer_tokens)
    }
    /// Largest KV context the request ever holds: the prompt plus every generated token.
    pub fn max_context_tokens(&self) -> u32 {
        self.prompt_tokens.saturating_add(self.output_tokens())
    }
    /// The lengths a request can run with: a prompt of at least one token, at least one answer
    /// token, at most [`MAX_REQUEST_TOKENS`] in all. The message names the bad length.
    pub fn check_lengths(&self) -> Result<(), String> {
        if self.prompt_tokens == 0 {
            return Err("prompt_tokens must be >= 1".into());
        }
        if self.answer_tokens == 0 {
            return Err("answer_tokens must be >= 1".into());
        }
        let total = self.prompt_tokens as u64 + self.reasoning_tokens as u64 + self.answer_tokens as u64;
        if total > MAX_REQUEST_TOKENS as u64 {
            return Err(format!(
                "prompt + output = {total} tokens, more than the {MAX_REQUEST_TOKENS} one request may hold"
            ));
        }
        Ok(())
    }
}
