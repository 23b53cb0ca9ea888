//! Instance-level scheduling: where a request runs, and whether it moves at `</think>`.
//!
//! Policies see only [`LoadReport`]s (what instances publish to the coordinator) so the same code
//! runs in the simulator and in the coordinator process.

pub mod baselines;
pub mod cache_aware;
pub mod pascal;
pub mod prefix;
pub mod registry;

pub use pascal::{MigrationMode, PascalPolicy, TieBreak};
pub use registry::{build_policy, policy_names, PolicyError, PolicyParams};

use crate::ids::{InstanceId, RequestId};
use crate::request::RequestSpec;
use crate::rng::SimRng;
use serde::{Deserialize, Serialize};

/// What an instance publishes about itself (PASCAL's "instance monitor").
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    /// The reporting instance.
    pub instance: InstanceId,
    /// KV blocks held on the GPU (PASCAL's m_i is GPU + CPU blocks, in bytes).
    pub gpu_used_blocks: u32,
    /// KV blocks held in the CPU offload pool (preempted requests).
    pub cpu_used_blocks: u32,
    /// KV blocks of GPU memory in all.
    pub gpu_total_blocks: u32,
    /// Bytes per KV block.
    pub block_bytes: u64,
    /// r_i: requests in the reasoning phase (high-priority queue, not demoted).
    pub reasoning_requests: u32,
    /// a_i: answering requests that have not used up their first quantum.
    pub fresh_answering_requests: u32,
    /// All answering requests (including demoted reasoning ones).
    pub answering_requests: u32,
    /// Requests that have not started yet (no KV allocated).
    pub waiting_requests: u32,
    /// t_i: every answering request's token pacer is on pace (QoE so far ≥ the SLO threshold).
    pub answering_slo_ok: bool,
    /// Tokens per KV block (0 in reports from builds that did not send it).
    #[serde(default)]
    pub block_tokens: u32,
    /// Blocks the requests holding no KV yet (new, or preempted for recomputation) take when
    /// admitted: placed load that the block counts above do not show yet.
    #[serde(default)]
    pub waiting_blocks: u32,
    /// Requests this instance has taken in so far (submits accepted, inbound migrations
    /// reserved or attached): lets a controller tell which of its recent decisions a report
    /// already reflects.
    #[serde(default)]
    pub admitted: u64,
    /// Unmet high-queue demand: GPU blocks the reasoning requests here that hold no GPU KV
    /// (waiting to start, dropped for recompute, or offloaded to the CPU pool) take when they next
    /// run. PASCAL's high queue goes first, so these free blocks are not an answering request's
    /// (`[scheduler.instance] demand_aware_memory`). `waiting_blocks` counts only the first two,
    /// of either queue. 0 in reports from builds that did not send it.
    #[serde(default)]
    pub reasoning_demand_blocks: u32,
    /// The requests here that have not produced their first token (waiting or prefilling): a
    /// prefill queue's sums, from which any quadratic prefill-time profile's total follows.
    #[serde(default)]
    pub prefill_queue: PrefillQueue,
    /// Σ context tokens (prompt + output so far) of the requests here past their first token
    /// (decoding, or waiting to resume; not those held for a handoff or migrating out), and the
    /// KV tokens incoming moves reserved blocks for (they decode here once attached).
    #[serde(default)]
    pub decode_context_tokens: u64,
    /// Decode tokens (after each request's first) this instance has produced so far.
    #[serde(default)]
    pub decode_tokens_total: u64,
    /// Σ over those tokens of the duration of the iteration that produced each, in ns: the
    /// difference of two reports over the difference of `decode_tokens_total` is the mean
    /// latency between a running request's tokens in between.
    #[serde(default)]
    pub decode_latency_ns_total: u64,
}

/// Sums over a queue of prompts: count, Σ tokens and Σ tokens², so that Σ T(l) of a quadratic
/// T(l) = a·l² + b·l + c is a·Σl² + b·Σl + c·n without listing the prompts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillQueue {
    /// Prompts in the queue.
    pub requests: u32,
    /// Σ prompt tokens.
    pub tokens: u64,
    /// Σ prompt tokens².
    pub tokens_sq: u64,
}

impl PrefillQueue {
    /// One more prompt of `tokens` tokens.
    pub fn add(&mut self, tokens: u32) {
        let t = u64::from(tokens);
        self.requests = self.requests.saturating_add(1);
        self.tokens = self.tokens.saturating_add(t);
        self.tokens_sq = self.tokens_sq.saturating_add(t * t);
    }
}

impl LoadReport {
    /// m_i of Alg. 1: total KV footprint, GPU + CPU, in bytes, counting the requests placed here
    /// that hold no KV yet at what their admission will take (a burst of simultaneous arrivals
    /// must not all see the same empty instance).
    pub fn kv_footprint_bytes(&self) -> u64 {
        (self.gpu_used_blocks as u64 + self.cpu_used_blocks as u64 + self.waiting_blocks as u64) * self.block_bytes
    }
    /// Blocks `tokens` tokens take on this instance: the engine's own arithmetic
    /// ([`crate::kv::blocks_for_tokens`]).
    pub fn blocks_for(&self, tokens: u32) -> u32 {
        crate::kv::blocks_for_tokens(tokens, self.block_tokens)
    }
    /// GPU KV blocks not held by any request.
    pub fn gpu_free_blocks(&self) -> u32 {
        self.gpu_total_blocks.saturating_sub(self.gpu_used_blocks)
    }
    /// Free GPU blocks left for an answering request: [`LoadReport::gpu_free_blocks`] less the
    /// high-queue demand that takes them first ([`LoadReport::reasoning_demand_blocks`]).
    pub fn gpu_free_blocks_after_demand(&self) -> u32 {
        self.gpu_free_blocks().saturating_sub(self.reasoning_demand_blocks)
    }
}

/// A request that just produced its last reasoning token.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhaseChange {
    /// The request at its `</think>` boundary.
    pub request: RequestId,
    /// The instance it reasoned on (where its KV is).
    pub current: InstanceId,
    /// KV the request holds now (prompt + reasoning tokens), in blocks.
    pub kv_blocks: u32,
}

/// What to do with a request at its phase boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PhaseDecision {
    /// Keep the request on its current instance for the answering phase.
    Stay,
    /// Move its KV cache to another instance and answer there.
    Migrate {
        /// The instance that serves the answering phase.
        to: InstanceId,
    },
}

/// Where a driver learns which prefixes each instance has cached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PrefixIndexMode {
    /// From the instances' KV events (blocks stored and removed, per tier), plus each placement
    /// for 2 s until its events arrive (llm-d's speculative entries).
    #[default]
    Precise,
    /// From placements alone: a placement counts as cached on its instance for 120 s (Dynamo's
    /// approximate router; no events needed).
    Approx,
}

impl PrefixIndexMode {
    /// Name as in configs (`precise`, `approx`).
    pub fn name(self) -> &'static str {
        match self {
            PrefixIndexMode::Precise => "precise",
            PrefixIndexMode::Approx => "approx",
        }
    }
}

/// A placement policy. Implementations are deterministic given the `rng` they are handed.
pub trait InstancePolicy: Send + std::fmt::Debug {
    /// Registry name (`pascal`, `least-kv`, ...; see [`policy_names`]).
    fn name(&self) -> &str;
    /// Pick an instance for a new request. `loads` is non-empty, one per live instance.
    fn place(&mut self, request: &RequestSpec, loads: &[LoadReport], rng: &mut SimRng) -> InstanceId;
    /// How the driver should know where prompts' prefixes are cached for
    /// [`InstancePolicy::place_with_overlap`]; `None` (the default): the policy does not ask.
    fn prefix_index(&self) -> Option<PrefixIndexMode> {
        None
    }
    /// [`InstancePolicy::place`] knowing `overlap[k]`: the leading prompt blocks of `request`
    /// cached on `loads[k].instance` (a block only in its CPU tier counts 0.75). The default
    /// ignores it.
    fn place_with_overlap(
        &mut self,
        request: &RequestSpec,
        loads: &[LoadReport],
        overlap: &[f64],
        rng: &mut SimRng,
    ) -> InstanceId {
        let _ = overlap;
        self.place(request, loads, rng)
    }
    /// Decide at the `</think>` boundary. The default keeps the request where it is.
    fn on_phase_change(&mut self, _change: &PhaseChange, _loads: &[LoadReport], _rng: &mut SimRng) -> PhaseDecision {
        PhaseDecision::Stay
    }
    /// Whether `on_phase_change` can ever migrate (lets drivers skip the call).
    fn migrates_at_phase_boundary(&self) -> bool {
        false
    }
    /// Whether the policy weighs time against [`cache_aware::PlacementCosts`] that its driver
    /// must hand it ([`InstancePolicy::set_costs`]); a driver that cannot refuses the policy.
    fn needs_costs(&self) -> bool {
        false
    }
    /// The prefill curve and link a cost-based policy weighs. The default ignores them.
    fn set_costs(&mut self, costs: &cache_aware::PlacementCosts) {
        let _ = costs;
    }
    /// After placing on `chosen` (given the same `loads` and `overlap`): prompt blocks to copy
    /// there from another instance's cache before the request starts. The default fetches none.
    fn prefix_fetch(
        &self,
        loads: &[LoadReport],
        overlap: &[f64],
        chosen: InstanceId,
    ) -> Option<cache_aware::PrefixFetch> {
        let _ = (loads, overlap, chosen);
        None
    }
}
