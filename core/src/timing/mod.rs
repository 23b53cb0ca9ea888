//! Where iteration time comes from: one trait, several models.
//!
//! - [`analytic`]: a roofline over model FLOPs and bytes vs the GPU's peak compute and bandwidth;
//! - [`profile`]: interpolation over measured `decode(batch, context)` / `prefill(tokens)` tables;
//! - `cuda` (worker feature, later): live kernels on a local GPU.
//!
//! Preemption costs (offload/reload) are bytes over the host link, also owned by the model.

use crate::time::TimeSpan;

pub mod analytic;
pub mod profile;

pub use analytic::{AnalyticParams, AnalyticTiming};
pub use profile::{build_timing, holdout_report, HoldoutReport, ProfileTiming, TimingError, TIMING_KINDS};

/// The shape of one engine iteration: what the timing model needs, and nothing per-request.
///
/// Sums rather than vectors, so that building a shape is allocation-free on the hot path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchShape {
    /// Sequences that produce one token each in this iteration.
    pub decode_seqs: u32,
    /// Sum over decoding sequences of their context length, counting the token being produced.
    pub decode_context_tokens: u64,
    /// Prompts prefilled in this iteration (each produces its first output token).
    pub prefill_seqs: u32,
    /// Sum of the prefilled prompts' lengths.
    pub prefill_tokens: u64,
    /// Sum of squared prompt lengths (causal attention work is quadratic per prompt).
    pub prefill_tokens_sq: u64,
}

impl BatchShape {
    /// Whether the iteration runs no sequence.
    pub fn is_empty(&self) -> bool {
        self.decode_seqs == 0 && self.prefill_seqs == 0
    }
    /// Add one decoding sequence whose context (counting the token being produced) is `context_tokens`.
    pub fn add_decode(&mut self, context_tokens: u32) {
        self.decode_seqs += 1;
        self.decode_context_tokens += context_tokens as u64;
    }
    /// Add one prompt of `prompt_tokens` tokens to prefill.
    pub fn add_prefill(&mut self, prompt_tokens: u32) {
        self.add_prefill_chunk(prompt_tokens, 0);
    }
    /// Add a chunk of `tokens` prompt tokens after `before` tokens of the same prompt computed
    /// in earlier iterations (chunked prefill). Its causal attention is tokens² + 2·tokens·before
    /// in `prefill_tokens_sq` units, so a prompt's chunks add up to one whole prefill's T².
    pub fn add_prefill_chunk(&mut self, tokens: u32, before: u32) {
        let (n, c) = (u64::from(tokens), u64::from(before));
        self.prefill_seqs += 1;
        self.prefill_tokens += n;
        self.prefill_tokens_sq += n * n + 2 * n * c;
    }
}

/// Iteration and transfer costs of one instance. Implementations are pure and cheap: the
/// simulator calls `iteration` hundreds of millions of times.
pub trait TimingModel: Send + Sync + std::fmt::Debug {
    /// Name used in configs and reports (`analytic`, `profile`, ...).
    fn name(&self) -> &str;
    /// Duration of one iteration running `batch` (mixed prefill + decode costs by the model).
    fn iteration(&self, batch: &BatchShape) -> TimeSpan;
    /// GPU → CPU copy of `bytes` of KV (preemption).
    fn offload(&self, bytes: u64) -> TimeSpan;
    /// CPU → GPU copy of `bytes` of KV (resume).
    fn reload(&self, bytes: u64) -> TimeSpan;
}

/// A model with a fixed iteration time and free transfers: the paper's worked examples count
/// time in iterations. Useful for tests and for reasoning about schedules by hand.
#[derive(Clone, Debug)]
pub struct FixedTiming {
    /// Duration of every iteration, whatever the batch.
    pub iteration: TimeSpan,
    /// Duration of any non-empty offload or reload, whatever its size.
    pub transfer: TimeSpan,
}

impl TimingModel for FixedTiming {
    fn name(&self) -> &str {
        "fixed"
    }
    fn iteration(&self, _batch: &BatchShape) -> TimeSpan {
        self.iteration
    }
    fn offload(&self, bytes: u64) -> TimeSpan {
        if bytes == 0 {
            TimeSpan::ZERO
        } else {
            self.transfer
        }
    }
    fn reload(&self, bytes: u64) -> TimeSpan {
        if bytes == 0 {
            TimeSpan::ZERO
        } else {
            self.transfer
        }
    }
}
