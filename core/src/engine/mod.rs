//! One serving instance's continuous-batching engine, sans-IO.
//!
//! The driver (simulator event loop or the worker's real-time loop) owns the clock and calls:
//! - [`Engine::submit`] / [`Engine::attach`] when a request arrives (new or migrated in);
//! - [`Engine::step`]`(now)` once per iteration: it completes the iteration that ends at `now`
//!   (tokens, phase boundaries, finishes) and plans the next one, returning when it will end.
//!   Drivers that must act between the two halves — the instance-level policy decides at
//!   `</think>` before the next iteration is planned — call [`Engine::complete_iteration`] and
//!   [`Engine::plan_iteration`] instead.
//!
//! Planning is "fit by priority": the [`sched::IntraScheduler`] orders requests, the engine walks
//! them giving each the GPU blocks it needs for this iteration, and preempts (offloads to the CPU
//! pool, or drops for recompute when that is full) resident requests that did not make the cut,
//! lowest priority first and only as far as needed. Offload/reload time comes from the timing
//! model and is added to the iteration. When nothing changed since the last plan and the batch
//! can grow in free memory, the previous batch is reused (the common case; keeps the simulator fast).

pub mod sched;
pub mod sizing;

use crate::idmap::IdMap;
use crate::ids::{InstanceId, RequestId};
use crate::kv::{prompt_block_hashes, BlockHash, KvBlockManager, KvError, Tier};
use crate::metrics::RequestRecord;
use crate::pacer::TokenPacer;
use crate::policy::LoadReport;
use crate::request::RequestSpec;
use crate::time::{TimeSpan, Timestamp};
use crate::timing::{BatchShape, TimingModel};
use sched::{Admission, EngineSwitches, IntraScheduler, Phase, SchedState, TokenProgress, WaitingAdmission};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::sync::Arc;

/// Static configuration of one instance.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EngineConfig {
    /// Tokens per KV block (vLLM: 16).
    pub block_size: u32,
    /// KV blocks that fit in GPU memory.
    pub gpu_blocks: u32,
    /// KV blocks in the CPU offload pool (0: preemption drops KV and recomputes).
    pub cpu_blocks: u32,
    /// Most sequences in one iteration (vLLM `max_num_seqs`).
    pub max_num_seqs: u32,
    /// Most prompt tokens prefilled in one iteration (one prompt is always allowed).
    pub max_batched_tokens: u32,
    /// Derived from the model spec.
    pub kv_bytes_per_token: u64,
    /// Token pacer pace: the user's expected time per output token.
    pub tpot: TimeSpan,
    /// Share prompt KV blocks of equal content between requests (vLLM's automatic prefix
    /// caching; only requests with [`RequestSpec::content_ids`] have content to share).
    pub prefix_caching: bool,
}

impl EngineConfig {
    /// Bytes of KV one block holds (`block_size` × `kv_bytes_per_token`).
    pub fn block_bytes(&self) -> u64 {
        self.block_size as u64 * self.kv_bytes_per_token
    }
}

/// A chunk of a request's prefill in the iteration in flight ([`Engine::prefill_in_flight`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillInFlight {
    /// When the iteration started.
    pub start: Timestamp,
    /// When it ends.
    pub end: Timestamp,
    /// Prompt tokens whose KV is computed at its end.
    pub tokens: u32,
}

impl PrefillInFlight {
    /// Layer groups (of `groups`) the iteration has computed at `now`: its layers run in order
    /// through its time, so group k is done at `start + (k + 1)/groups` of it. `groups` at its end.
    pub fn groups_done(&self, now: Timestamp, groups: u32) -> u32 {
        let span = self.end.saturating_since(self.start).as_nanos();
        if now >= self.end || span == 0 {
            return groups;
        }
        let gone = now.saturating_since(self.start).as_nanos();
        (u128::from(gone) * u128::from(groups) / u128::from(span)) as u32
    }

    /// When layer group `k` (counted from 1; `groups` in all) is computed.
    pub fn group_done_at(&self, k: u32, groups: u32) -> Timestamp {
        let span = self.end.saturating_since(self.start).as_nanos();
        let at = u128::from(span) * u128::from(k.min(groups)) / u128::from(groups.max(1));
        // Rounded up, so that `groups_done` at this instant counts group k.
        let exact = u128::from(span) * u128::from(k.min(groups)) % u128::from(groups.max(1)) == 0;
        self.start + TimeSpan::from_nanos((at + u128::from(!exact)) as u64)
    }
}

/// What the engine reports to its driver.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// The request produced its last reasoning token (`</think>`): time for PASCAL Alg. 2.
    PhaseBoundary {
        /// The request that finished reasoning.
        request: RequestId,
        /// KV blocks it holds at the boundary (what a migration would move).
        kv_blocks: u32,
    },
    /// The request produced its last token; its KV is freed.
    Finished(Box<RequestRecord>),
    /// On a prefill instance ([`Engine::set_hand_off`]): the first chunk of a request's prefill
    /// ended and more follow (chunked prefill), so its handoff may start now and copy each chunk's
    /// KV as it is written ([`Engine::prompt_written`]) while the rest computes.
    PrefillStarted {
        /// The request.
        request: RequestId,
        /// KV blocks it will hold at the prefill's end (what the handoff moves).
        kv_blocks: u32,
    },
    /// On a prefill instance ([`Engine::set_hand_off`]): the request's prefill produced its first
    /// token and it is held, KV in place, until it is migrated out to a decode instance
    /// ([`Engine::begin_migration_out`]) or released to decode here ([`Engine::release_held`]).
    PrefillDone {
        /// The held request.
        request: RequestId,
        /// KV blocks it holds (what the handoff moves).
        kv_blocks: u32,
    },
}

/// Why the engine refused a request or a migration step.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// The request could never fit in this instance's GPU KV memory, even alone.
    #[error("{request} needs {needed} KV blocks at its longest, but the instance has {capacity}")]
    TooLarge {
        /// The refused request.
        request: RequestId,
        /// KV blocks at its largest context (prompt + all output tokens).
        needed: u32,
        /// KV blocks of GPU memory on this instance.
        capacity: u32,
    },
    /// The request is already here (or already migrating out).
    #[error("{0} is already on this instance")]
    Duplicate(RequestId),
    /// No request with this id is on this instance.
    #[error("{0} is not on this instance")]
    Unknown(RequestId),
    /// The call needs a request frozen by [`Engine::begin_migration_out`], and this one is not.
    #[error("{0} is not migrating out")]
    NotMigrating(RequestId),
    /// The request is frozen for a migration out; only the migration may end it.
    #[error("{0} is frozen for a migration out")]
    Migrating(RequestId),
    /// The request is not held after its prefill (nothing to release).
    #[error("{0} is not held for a handoff")]
    NotHeld(RequestId),
    /// The request is between chunks of its prefill: its KV is not whole yet.
    #[error("{0} is still prefilling")]
    Prefilling(RequestId),
    /// The call is only allowed between iterations, and one is in flight.
    #[error("an iteration is in flight; call between iterations")]
    IterationInFlight,
    /// Not enough free KV blocks to receive a migrating request.
    #[error("no room to receive {request}: needs {needed} KV blocks, {free} free")]
    NoRoom {
        /// The incoming request.
        request: RequestId,
        /// KV blocks it needs.
        needed: u32,
        /// KV blocks free in the tier it would go to.
        free: u32,
    },
    /// The request asks for no answer tokens; every request must produce at least one.
    #[error("request {request} has answer_tokens = 0; every request produces at least one answer token")]
    NoAnswer {
        /// The refused request.
        request: RequestId,
    },
}

/// Where a request's KV is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Residence {
    /// No KV: not started, or dropped on preemption (prefill recomputes prompt + generated).
    Waiting,
    Gpu,
    Cpu,
    /// Frozen while its KV is copied to another instance; still holds its blocks.
    MigratingOut,
}

/// One request on this instance. `repr(C)` with the per-token fields first: the simulator touches
/// thousands of instances in turn, so every iteration starts cache-cold, and keeping a token's work
/// within the first cache lines (the record is touched only at milestones) is most of its speed.
#[derive(Debug)]
#[repr(C)]
struct Req {
    generated: u32,
    residence: Residence,
    /// Reasoning ended and it has not been scheduled since (blocking latency).
    awaiting_after_reasoning: bool,
    /// A migration attached it here and no iteration has run it since (the decode-queue wait).
    awaiting_after_migration: bool,
    sched: SchedState,
    spec: RequestSpec,
    pacer: Option<TokenPacer>,
    /// Plan epoch in which it was selected (avoids a set per plan).
    selected_epoch: u64,
    record: RequestRecord,
    /// Hash chain of its prompt's full blocks (empty without content ids): prefix-cache keys.
    hashes: Box<[BlockHash]>,
    /// Prompt tokens its prefill planned last found cached (not computed in that iteration).
    prefill_cached: u32,
    /// Tokens of its current prefill not computed yet (set at admission; more than one
    /// iteration's worth only with chunked prefill); 0 once it decodes or while it waits.
    prefill_left: u32,
}

impl Req {
    fn phase(&self) -> Phase {
        if self.generated >= self.spec.reasoning_tokens {
            Phase::Answering
        } else {
            Phase::Reasoning
        }
    }
    /// Tokens whose KV the request holds (prompt + generated).
    fn context(&self) -> u32 {
        self.spec.prompt_tokens + self.generated
    }
    fn done(&self) -> bool {
        self.generated >= self.spec.output_tokens()
    }
    /// Past `</think>` without its first answer token: between PASCAL's queues.
    fn at_boundary(&self) -> bool {
        self.spec.reasoning_tokens > 0 && self.generated == self.spec.reasoning_tokens
    }
    /// Most prompt blocks a prefill of its context may take from the prefix cache: vLLM always
    /// computes the last token, so ⌊(context − 1) / block size⌋.
    fn cache_cap(&self, block_size: u32) -> u32 {
        (self.context().saturating_sub(1) / block_size).min(self.hashes.len() as u32)
    }
}

/// A request in transit between instances: everything the target needs to resume it.
/// Serializable so that worker processes can hand it over the network.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MigratedRequest {
    /// The request as submitted (id, arrival, prompt/reasoning/answer token counts).
    pub spec: RequestSpec,
    /// Output tokens already generated on the source instance.
    pub generated: u32,
    /// Its metrics record so far (timestamps, preemptions, migrations), carried on.
    pub record: RequestRecord,
    pacer: Option<TokenPacer>,
    awaiting_after_reasoning: bool,
    demoted: bool,
}

impl MigratedRequest {
    /// KV tokens that travel with it.
    pub fn kv_tokens(&self) -> u32 {
        self.spec.prompt_tokens + self.generated
    }
}

/// Returned when a migration starts: what will be copied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MigrationOut {
    /// Tokens of KV to copy (prompt + generated).
    pub kv_tokens: u32,
    /// KV blocks the request holds on the source.
    pub kv_blocks: u32,
    /// Bytes to copy (`kv_tokens` × KV bytes per token).
    pub kv_bytes: u64,
}

/// One token produced by a completed iteration (for drivers that stream tokens or write KV).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenEmitted {
    /// The request that produced the token.
    pub request: RequestId,
    /// 0-based output token index.
    pub index: u32,
    /// Whether it is a reasoning token or an answer token (after `</think>`).
    pub phase: Phase,
    /// KV tokens the request holds after this token (its position in the KV is `context - 1`).
    pub context_tokens: u32,
}

/// Counters over the engine's lifetime.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineStats {
    /// Iterations completed.
    pub iterations: u64,
    /// Iterations planned from scratch (sort + fit); the rest reused the previous batch.
    pub full_plans: u64,
    /// Time spent running iterations, in ns.
    pub busy_ns: u64,
    /// Output tokens produced (one per batched request per iteration).
    pub tokens: u64,
    /// Requests preempted (offloaded to the CPU pool or dropped for recompute).
    pub preemptions: u64,
    /// KV bytes offloaded GPU → CPU on preemption.
    pub offloaded_bytes: u64,
    /// KV bytes reloaded CPU → GPU when offloaded requests ran again.
    pub reloaded_bytes: u64,
    /// Tokens of KV recomputed by prefill after preemption dropped it.
    pub recomputed_tokens: u64,
}

#[derive(Clone, Copy, Debug)]
struct BatchEntry {
    slot: u32,
    /// It computes (part of) a prefill in this iteration.
    prefill: bool,
    /// Prefill tokens it computes in this iteration (set when the iteration is planned).
    chunk: u32,
}

/// Blocks `req`'s next iteration needs that no request selected before it in this plan holds
/// (the shared cached blocks it holds or would hit are counted once, by the first such request;
/// `newly` receives those it counts). Without content it is all of `blocks_for(context + 1)`.
fn plan_need(kv: &KvBlockManager, req: &Req, counted: &HashSet<u32>, newly: &mut Vec<u32>) -> u32 {
    newly.clear();
    let total = kv.blocks_for(req.context() + 1);
    if req.hashes.is_empty() {
        return total;
    }
    match req.residence {
        Residence::Gpu => {
            let table = kv.table(req.spec.id).map_or(&[][..], |t| &t.blocks[..]);
            newly.extend(table.iter().copied().filter(|&b| kv.is_cached_block(b)));
        }
        Residence::Waiting => {
            let cap = req.cache_cap(kv.block_size()) as usize;
            newly.extend(kv.prefix_hit_blocks(&req.hashes[..cap]));
        }
        // A reload lands in fresh private blocks.
        Residence::Cpu | Residence::MigratingOut => return total,
    }
    let before = newly.len();
    newly.retain(|b| !counted.contains(b));
    total - (before - newly.len()) as u32
}

/// An iteration of a leap after its first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct LeapStep {
    end: Timestamp,
    /// Its plan takes KV blocks (some request's context sits on a block boundary).
    grows: bool,
    /// What the engine reports once it is planned (the iteration before it completed).
    load: LeapLoad,
}

/// The fields of a [`LoadReport`] that change inside a leap.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct LeapLoad {
    gpu_used_blocks: u32,
    answering_slo_ok: bool,
    decode_context_tokens: u64,
    decode_tokens_total: u64,
    decode_latency_ns_total: u64,
}

impl LeapLoad {
    fn of(r: &LoadReport) -> LeapLoad {
        LeapLoad {
            gpu_used_blocks: r.gpu_used_blocks,
            answering_slo_ok: r.answering_slo_ok,
            decode_context_tokens: r.decode_context_tokens,
            decode_tokens_total: r.decode_tokens_total,
            decode_latency_ns_total: r.decode_latency_ns_total,
        }
    }
    fn apply(&self, r: &mut LoadReport) {
        r.gpu_used_blocks = self.gpu_used_blocks;
        r.answering_slo_ok = self.answering_slo_ok;
        r.decode_context_tokens = self.decode_context_tokens;
        r.decode_tokens_total = self.decode_tokens_total;
        r.decode_latency_ns_total = self.decode_latency_ns_total;
    }
}

/// What a driver must do after [`Engine::settle`] about the iteration end it queued for a leap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settled {
    /// Nothing: no leap, or its last iteration is in flight and ends when queued.
    Unchanged,
    /// The leap was cut: the iteration in flight, its last now, ends at this time (the queued
    /// end is stale).
    Requeue(Timestamp),
    /// An iteration of the leap ended at this very time and nothing is in flight: plan the
    /// engine as after any iteration end (the queued end is stale).
    Replan,
}

/// One instance.
#[derive(Debug)]
pub struct Engine {
    instance: InstanceId,
    cfg: EngineConfig,
    timing: Arc<dyn TimingModel>,
    sched: Box<dyn IntraScheduler>,
    /// Fidelity switches configured with the scheduler (read once: they never change).
    switches: EngineSwitches,
    kv: KvBlockManager,
    slots: Vec<Option<Req>>,
    free_slots: Vec<u32>,
    index: IdMap<RequestId, u32>,
    /// Schedulable requests (everything here except those migrating out).
    active: Vec<u32>,
    batch: Vec<BatchEntry>,
    inflight: Option<(Timestamp, Timestamp)>,
    /// A leap ([`Engine::plan_leap`]): the iterations planned after the one in flight, in
    /// order; `leap[leap_next..]` are still to come.
    leap: Vec<LeapStep>,
    leap_next: usize,
    /// When, inside the leap, the load this engine reports changes beyond its decode progress
    /// (a KV block taken, t_i flipped): the ends of those iterations, in order.
    leap_changes: Vec<Timestamp>,
    /// What the engine reported when the leap was planned.
    leap_base: LoadReport,
    /// Iterations of the leap [`Engine::load_report_at`] last found completed (0: none asked).
    leap_seen: usize,
    /// Scratch for [`Engine::plan_leap`]: the answering requests' pacers, run ahead, and the
    /// batch's requests by the iteration (mod the block size) after which each takes a block.
    leap_pacers: Vec<TokenPacer>,
    leap_growth: Vec<u32>,
    /// Requests frozen while their KV is copied out (they hold blocks but do not run).
    migrating_out: Vec<u32>,
    /// A prefill instance: requests stop after their first token ([`Engine::set_hand_off`]).
    hand_off: bool,
    /// Requests held after their prefill for a handoff (they hold blocks but do not run).
    held: Vec<u32>,
    /// Incoming live migrations holding reserved GPU blocks (not yet requests here), with the KV
    /// tokens each reserved for (its headroom aside).
    reserved: Vec<(RequestId, u32)>,
    /// Something changed that can alter the batch: the next plan must be a full one.
    dirty: bool,
    epoch: u64,
    /// PASCAL's t_i as of the end of the last iteration.
    slo_ok: bool,
    /// Requests taken in so far ([`LoadReport::admitted`]).
    admitted: u64,
    /// Decode tokens produced so far, and the sum of their iterations' durations in ns
    /// ([`LoadReport::decode_tokens_total`]).
    decode_tokens_total: u64,
    decode_latency_ns_total: u64,
    stats: EngineStats,
}

impl Engine {
    /// An idle instance with empty KV pools sized by `cfg`.
    pub fn new(
        instance: InstanceId,
        cfg: EngineConfig,
        timing: Arc<dyn TimingModel>,
        sched: Box<dyn IntraScheduler>,
    ) -> Self {
        let mut kv = KvBlockManager::new(cfg.block_size, cfg.gpu_blocks, cfg.cpu_blocks);
        if cfg.prefix_caching {
            kv.enable_events();
        }
        let switches = sched.switches();
        Engine {
            instance,
            cfg,
            timing,
            sched,
            switches,
            kv,
            slots: Vec::new(),
            free_slots: Vec::new(),
            index: IdMap::default(),
            active: Vec::new(),
            batch: Vec::new(),
            inflight: None,
            leap: Vec::new(),
            leap_next: 0,
            leap_changes: Vec::new(),
            leap_base: LoadReport::default(),
            leap_seen: 0,
            leap_pacers: Vec::new(),
            leap_growth: Vec::new(),
            migrating_out: Vec::new(),
            hand_off: false,
            held: Vec::new(),
            reserved: Vec::new(),
            dirty: false,
            epoch: 0,
            slo_ok: true,
            admitted: 0,
            decode_tokens_total: 0,
            decode_latency_ns_total: 0,
            stats: EngineStats::default(),
        }
    }

    /// This instance's id.
    pub fn instance(&self) -> InstanceId {
        self.instance
    }
    /// The static configuration it was built with.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }
    /// The KV block manager (GPU and CPU pools, per-request block tables).
    pub fn kv(&self) -> &KvBlockManager {
        &self.kv
    }
    /// Lend KV block `block` of `tier` to a reader outside the engine (a worker's transport
    /// sending it in place): no allocation takes it until the loan ends
    /// ([`KvBlockManager::lend`]).
    pub fn lend_kv_block(&mut self, tier: crate::kv::Tier, block: u32) {
        self.kv.lend(tier, block)
    }
    /// One loan of [`Engine::lend_kv_block`] ended; `false` if none was out.
    /// The next plan counts the block again if it was freed meanwhile.
    pub fn end_kv_loan(&mut self, tier: crate::kv::Tier, block: u32) -> bool {
        self.dirty = true;
        self.kv.end_loan(tier, block)
    }
    /// What the prefix cache stored and evicted since the last call, appended to `out` (always
    /// empty with prefix caching off). A driver hands them to the controller's prefix index.
    pub fn drain_kv_events(&mut self, out: &mut Vec<crate::kv::KvEvent>) {
        self.kv.drain_events(out);
    }
    /// Prompt blocks fetched from another instance's cache (`hashes`, in prompt order) join this
    /// one's GPU prefix cache as free cached blocks ([`KvBlockManager::install_cached`]); returns
    /// the blocks registered, in prompt order (none with prefix caching off).
    pub fn install_prefix(&mut self, hashes: &[crate::kv::BlockHash]) -> Vec<(crate::kv::BlockHash, u32)> {
        if !self.cfg.prefix_caching {
            return Vec::new();
        }
        self.kv.install_cached(hashes)
    }
    /// How many of `hashes`' leading prompt blocks this instance caches on the GPU with their
    /// content computed ([`KvBlockManager::computed_prefix_blocks`]): what a fetch can copy.
    pub fn computed_prefix_blocks(&self, hashes: &[crate::kv::BlockHash]) -> u32 {
        self.kv.computed_prefix_blocks(hashes)
    }
    /// Forget an installed prefix block whose content proved wrong
    /// ([`KvBlockManager::forget_cached`]).
    pub fn forget_prefix_block(&mut self, hash: crate::kv::BlockHash) -> bool {
        self.kv.forget_cached(hash)
    }
    /// Turn on the KV move journal (workers mirror moves on their real arenas).
    pub fn enable_kv_journal(&mut self) {
        self.kv.enable_journal();
    }
    /// Tier moves (offloads, reloads) made by planning since the last call.
    pub fn drain_kv_moves(&mut self) -> Vec<crate::kv::KvMove> {
        self.kv.drain_moves()
    }
    /// The request with this id as submitted, while it is here.
    pub fn spec(&self, request: RequestId) -> Option<&RequestSpec> {
        self.index.get(&request).map(|&slot| &self.req(slot).spec)
    }
    /// Whether the request with this id is here (running, waiting or migrating out).
    pub fn contains(&self, request: RequestId) -> bool {
        self.index.contains_key(&request)
    }
    /// Lifetime counters.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }
    /// Name of the intra-instance scheduler (`fcfs`, `rr`, `pascal`, ...).
    pub fn scheduler_name(&self) -> &'static str {
        self.sched.name()
    }
    /// End of the iteration in flight, if any.
    pub fn next_wake(&self) -> Option<Timestamp> {
        self.inflight.map(|(_, end)| end)
    }
    /// Requests on this instance, including ones migrating out.
    pub fn len(&self) -> usize {
        self.index.len()
    }
    /// Whether no request is on this instance (including migrating out).
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }
    /// Whether the engine has work but no iteration planned (the driver should call `step`).
    pub fn needs_step(&self) -> bool {
        self.inflight.is_none() && !self.active.is_empty()
    }

    fn req(&self, slot: u32) -> &Req {
        self.slots[slot as usize].as_ref().expect("live slot")
    }
    fn req_mut(&mut self, slot: u32) -> &mut Req {
        self.slots[slot as usize].as_mut().expect("live slot")
    }

    fn insert(&mut self, req: Req) -> u32 {
        let id = req.spec.id;
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.slots[s as usize] = Some(req);
                s
            }
            None => {
                self.slots.push(Some(req));
                (self.slots.len() - 1) as u32
            }
        };
        self.index.insert(id, slot);
        slot
    }

    fn remove(&mut self, slot: u32) -> Req {
        let req = self.slots[slot as usize].take().expect("live slot");
        self.index.remove(&req.spec.id);
        self.free_slots.push(slot);
        req
    }

    /// Hand a request to the scheduler and make it schedulable (new or migrated in).
    fn enqueue(&mut self, mut req: Req) {
        let phase = req.phase();
        self.sched.on_enqueue(&mut req.sched, phase);
        let slot = self.insert(req);
        self.active.push(slot);
        self.dirty = true;
    }

    /// The prefix-cache keys of `spec`'s prompt (none when prefix caching is off).
    fn prompt_hashes(&self, spec: &RequestSpec) -> Box<[BlockHash]> {
        if !self.cfg.prefix_caching || spec.content_ids.is_empty() {
            return Box::default();
        }
        prompt_block_hashes(&spec.content_ids, spec.prompt_tokens, self.cfg.block_size).into_boxed_slice()
    }

    /// Accept a new request. Fails if it could never fit in GPU memory (it would block forever).
    pub fn submit(&mut self, now: Timestamp, spec: RequestSpec) -> Result<(), EngineError> {
        let _ = now;
        if spec.answer_tokens == 0 {
            return Err(EngineError::NoAnswer { request: spec.id });
        }
        if self.index.contains_key(&spec.id) {
            return Err(EngineError::Duplicate(spec.id));
        }
        let needed = self.kv.blocks_for(spec.max_context_tokens());
        if needed > self.cfg.gpu_blocks {
            return Err(EngineError::TooLarge { request: spec.id, needed, capacity: self.cfg.gpu_blocks });
        }
        let record = RequestRecord {
            id: spec.id,
            arrival: spec.arrival,
            prompt_tokens: spec.prompt_tokens,
            reasoning_tokens: spec.reasoning_tokens,
            answer_tokens: spec.answer_tokens,
            placed_on: self.instance,
            ..RequestRecord::default()
        };
        let hashes = self.prompt_hashes(&spec);
        let req = Req {
            spec,
            generated: 0,
            residence: Residence::Waiting,
            sched: SchedState::default(),
            pacer: None,
            record,
            awaiting_after_reasoning: false,
            awaiting_after_migration: false,
            selected_epoch: 0,
            hashes,
            prefill_cached: 0,
            prefill_left: 0,
        };
        self.enqueue(req);
        self.admitted += 1;
        Ok(())
    }

    /// Complete (if due) the iteration in flight and plan the next one. Returns the events of the
    /// completed iteration and the end of the next one (None: idle).
    pub fn step(&mut self, now: Timestamp, events: &mut Vec<EngineEvent>) -> Option<Timestamp> {
        self.complete_iteration(now, events);
        self.plan_iteration(now)
    }

    /// Finish the iteration in flight if it ends at or before `now`: every request in it gets its
    /// token (timestamped at the iteration's end).
    pub fn complete_iteration(&mut self, now: Timestamp, events: &mut Vec<EngineEvent>) {
        self.complete_inner(now, events, None);
    }

    /// [`Engine::complete_iteration`], also listing every token produced (the worker streams
    /// them and writes their KV).
    pub fn complete_iteration_tokens(
        &mut self,
        now: Timestamp,
        events: &mut Vec<EngineEvent>,
        tokens: &mut Vec<TokenEmitted>,
    ) {
        self.complete_inner(now, events, Some(tokens));
    }

    fn complete_inner(
        &mut self,
        now: Timestamp,
        events: &mut Vec<EngineEvent>,
        mut tokens: Option<&mut Vec<TokenEmitted>>,
    ) {
        while self.inflight.is_some_and(|(_, end)| end <= now) {
            self.complete_and_continue(now, events, tokens.as_deref_mut());
        }
    }

    /// Complete the iteration in flight (it ended by `now`); inside a leap, plan the next one,
    /// unless this one ended at `now`: then the driver plans at `now`, after whatever else
    /// happens at that instant (the leap is over).
    fn complete_and_continue(
        &mut self,
        now: Timestamp,
        events: &mut Vec<EngineEvent>,
        tokens: Option<&mut Vec<TokenEmitted>>,
    ) {
        let Some((_, end)) = self.inflight else { return };
        let before = events.len();
        self.complete_one(events, tokens);
        if self.leap.is_empty() {
            return;
        }
        debug_assert!(events.len() == before && !self.dirty, "a leap's iteration before its last changed something");
        if end == now {
            self.end_leap();
            return;
        }
        // The same batch again, with the blocks foreseen: the plan is the one `plan_leap`
        // foresaw (debug builds plan it in full to check).
        let foreseen = self.leap[self.leap_next];
        if cfg!(debug_assertions) {
            let planned = self.plan_iteration(end);
            assert_eq!(planned, Some(foreseen.end), "a leap's iteration ends where it was foreseen");
            assert_eq!(LeapLoad::of(&self.load_report()), foreseen.load, "a leap's load is what was foreseen");
        } else {
            let grown = !foreseen.grows || self.grow_batch_in_place();
            assert!(grown, "a leap's blocks were counted against the free ones");
            self.inflight = Some((end, foreseen.end));
        }
        self.leap_next += 1;
        if self.leap_next == self.leap.len() {
            self.end_leap();
        }
    }

    /// Bring a leaping engine ([`Engine::plan_leap`]) to `now` before a driver changes it: the
    /// leap's iterations that ended by then are completed (they change nothing a driver acts
    /// on), and the leap is cut after the iteration in flight. What the driver must do about the
    /// iteration end it queued for the leap is the answer. (To read its load,
    /// [`Engine::load_report_at`] needs no settling.)
    pub fn settle(&mut self, now: Timestamp) -> Settled {
        if self.leap.is_empty() {
            return Settled::Unchanged;
        }
        let mut events = Vec::new();
        while !self.leap.is_empty() && self.inflight.is_some_and(|(_, end)| end <= now) {
            self.complete_and_continue(now, &mut events, None);
        }
        debug_assert!(events.is_empty(), "a leap's iteration before its last produced {events:?}");
        match self.inflight {
            None => Settled::Replan,
            Some(_) if self.leap.is_empty() => Settled::Unchanged,
            Some((_, end)) => {
                self.end_leap();
                Settled::Requeue(end)
            }
        }
    }

    /// What [`Engine::load_report`] gives at `now` once every iteration that ended by then is
    /// completed: inside a leap, without completing them (the engine stays as planned).
    pub fn load_report_at(&mut self, now: Timestamp) -> LoadReport {
        if self.leap.is_empty() {
            return self.load_report();
        }
        debug_assert_eq!(self.leap_next, 0, "a leap completes nothing until it ends or is cut");
        debug_assert_eq!(self.leap_base, self.load_report(), "a leaping engine is as it was planned");
        let mut r = self.leap_base.clone();
        if self.inflight.is_some_and(|(_, end)| end <= now) {
            // Iterations completed by `now` (the leap's last one's end is an event of its own),
            // counted on from the last call (time only moves on).
            let last = self.leap.len() - 1;
            let mut completed = self.leap_seen.max(1);
            while completed <= last && self.leap[completed - 1].end <= now {
                completed += 1;
            }
            self.leap_seen = completed;
            self.leap[completed - 1].load.apply(&mut r);
        }
        r
    }

    /// The first time after `after` at which, inside the leap under way, the load the engine
    /// reports changes beyond its decode progress counters (a driver publishing loads lazily
    /// must publish [`Engine::load_report_at`] by then).
    pub fn next_load_change(&self, after: Timestamp) -> Option<Timestamp> {
        let i = self.leap_changes.partition_point(|&t| t <= after);
        self.leap_changes.get(i).copied()
    }

    fn end_leap(&mut self) {
        self.leap.clear();
        self.leap_changes.clear();
        self.leap_next = 0;
        self.leap_seen = 0;
    }

    /// Complete the iteration in flight (it has ended).
    fn complete_one(&mut self, events: &mut Vec<EngineEvent>, mut tokens: Option<&mut Vec<TokenEmitted>>) {
        let Some((start, end)) = self.inflight else { return };
        self.inflight = None;
        self.stats.iterations += 1;
        self.stats.busy_ns += (end - start).as_nanos();
        let mut finished_any = false;
        // Requests held in this iteration (earlier ones left the batch when they were held).
        let held_before = self.held.len();
        let mut decoded = 0u64;
        for i in 0..self.batch.len() {
            let BatchEntry { slot, prefill, chunk } = self.batch[i];
            if prefill {
                let req = self.slots[slot as usize].as_mut().expect("batched request is live");
                let first_chunk = req.prefill_left == req.context() - req.prefill_cached && req.generated == 0;
                req.prefill_left -= chunk;
                if req.prefill_left > 0 {
                    // A chunk of a longer prefill: no token yet, the rest comes next iteration.
                    if first_chunk && self.hand_off {
                        let request = req.spec.id;
                        let kv_blocks = self.kv.table(request).map_or(0, |t| t.blocks.len() as u32);
                        events.push(EngineEvent::PrefillStarted { request, kv_blocks });
                    }
                    continue;
                }
            }
            self.batch[i].prefill = false;
            self.stats.tokens += 1;
            decoded += u64::from(!prefill);
            if let Some(out) = tokens.as_deref_mut() {
                let r = self.req(slot);
                let phase = if r.generated >= r.spec.reasoning_tokens { Phase::Answering } else { Phase::Reasoning };
                out.push(TokenEmitted {
                    request: r.spec.id,
                    index: r.generated,
                    phase,
                    context_tokens: r.context() + 1,
                });
            }
            let (changed, finished) = self.emit_token(slot, end, prefill, events);
            self.dirty |= changed;
            finished_any |= finished;
        }
        self.decode_tokens_total += decoded;
        self.decode_latency_ns_total += decoded * (end - start).as_nanos();
        if finished_any {
            let slots = &self.slots;
            self.active.retain(|&s| slots[s as usize].is_some());
            self.batch.retain(|e| slots[e.slot as usize].is_some());
            self.dirty = true;
        }
        if self.held.len() > held_before {
            let held = &self.held[held_before..];
            self.batch.retain(|e| !held.contains(&e.slot));
        }
        let overdue = self.switches.ttfat_starvation;
        self.slo_ok = !self.active.iter().any(|&s| {
            let req = self.req(s);
            Self::pacer_starving(req, end) || overdue.is_some_and(|limit| Self::first_answer_overdue(req, end, limit))
        });
    }

    /// One token for the request in `slot` at time `t`. Returns (priority changed, finished).
    fn emit_token(&mut self, slot: u32, t: Timestamp, _prefill: bool, events: &mut Vec<EngineEvent>) -> (bool, bool) {
        let instance = self.instance;
        let tpot = self.cfg.tpot;
        let req = self.slots[slot as usize].as_mut().expect("batched request is live");
        req.generated += 1;
        if req.generated == 1 {
            req.record.first_token = Some(t);
            // Its prompt's KV is computed: a prefix fetch may copy its cached blocks from here.
            self.kv.mark_computed(req.spec.id, req.spec.prompt_tokens);
        }
        let reasoning = req.spec.reasoning_tokens;
        let mut changed = false;
        if req.generated > reasoning {
            if req.generated == reasoning + 1 {
                req.record.first_answer_token = Some(t);
            }
            req.pacer.get_or_insert_with(|| TokenPacer::new(tpot)).on_answer_tokens(t, 1);
        }
        // The token was produced in the phase before this increment.
        let phase_of_token = if req.generated > reasoning { Phase::Answering } else { Phase::Reasoning };
        if req.done() {
            let answer = req.spec.answer_tokens;
            let mut req = self.remove(slot);
            self.kv.free_request(req.spec.id);
            req.record.finish = Some(t);
            req.record.finished_on = Some(instance);
            req.record.qoe = req.pacer.as_ref().map(|p| p.finish(answer));
            events.push(EngineEvent::Finished(Box::new(req.record)));
            return (true, true);
        }
        let progress = TokenProgress { context_tokens: req.context(), generated_tokens: req.generated };
        changed |= self.sched.on_token(&mut req.sched, phase_of_token, progress);
        if reasoning > 0 && req.generated == reasoning {
            req.record.reasoning_end = Some(t);
            req.awaiting_after_reasoning = true;
            changed |= self.sched.on_phase_change(&mut req.sched);
            let kv_blocks = self.kv.table(req.spec.id).map_or(0, |t| t.blocks.len() as u32);
            events.push(EngineEvent::PhaseBoundary { request: req.spec.id, kv_blocks });
        }
        if self.hand_off && req.generated == 1 {
            // Prefill done on a prefill instance: held for its handoff, out of the schedule.
            let kv_blocks = self.kv.table(req.spec.id).map_or(0, |t| t.blocks.len() as u32);
            events.push(EngineEvent::PrefillDone { request: req.spec.id, kv_blocks });
            self.active.retain(|&s| s != slot);
            self.held.push(slot);
            changed = true;
        }
        (changed, false)
    }

    /// PASCAL's t_i (Alg. 1/2) is false when some answering request's token pacer has nothing
    /// left for the user to read: generation fell behind the reading pace right now ("insufficient
    /// remaining tokens", §IV-B). Cumulative QoE would be the wrong signal: once a user falls
    /// behind, the fluid reader never catches up, so the instance could never clear.
    fn pacer_starving(req: &Req, now: Timestamp) -> bool {
        req.pacer.as_ref().is_some_and(|p| p.buffered(now) < 1.0)
    }

    /// The `ttfat_starvation_s` switch: an answering request that has no pacer yet (no answer
    /// token) is invisible to [`Engine::pacer_starving`], yet its user has waited since
    /// `</think>` — blocked here, or queued here after a migration (its record carries the
    /// source's `</think>` time).
    fn first_answer_overdue(req: &Req, now: Timestamp, limit: TimeSpan) -> bool {
        req.pacer.is_none()
            && req.at_boundary()
            && req.record.reasoning_end.is_some_and(|end| now.saturating_since(end) > limit)
    }

    /// Plan the next iteration starting at `now` (no-op if one is in flight). Returns its end.
    ///
    /// An iteration runs only requests that have arrived by its start. A driver behind its
    /// schedule (a worker whose host cannot keep up plans each iteration at the modelled end of
    /// the last, which may lie before requests that arrived since) thus keeps its timeline
    /// causal; when every waiting request is yet to arrive, the iteration starts at the first
    /// arrival. (The simulator submits each request at its arrival: no effect there.)
    pub fn plan_iteration(&mut self, now: Timestamp) -> Option<Timestamp> {
        if let Some((_, end)) = self.inflight {
            return Some(end);
        }
        if self.active.is_empty() {
            self.batch.clear();
            return None;
        }
        // Requests join only at a full plan (new ones mark the engine dirty): only then can an
        // arrival lie ahead.
        let now = if self.dirty {
            now.max(self.active.iter().map(|&s| self.req(s).spec.arrival).min().unwrap_or(now))
        } else {
            now
        };
        let mut costs = TimeSpan::ZERO;
        let replanned = self.dirty || !self.grow_batch_in_place();
        if replanned {
            costs = self.full_plan(now);
        }
        let mut shape = BatchShape::default();
        // Chunked prefill: decodes first (one token each), then prefill chunks in batch order
        // up to the iteration's token budget.
        let mut chunk_budget = self.switches.chunked_prefill_tokens.map(|c| {
            let decodes = self.batch.iter().filter(|e| !e.prefill).count() as u32;
            c.saturating_sub(decodes)
        });
        for e in self.batch.iter_mut() {
            let req = self.slots[e.slot as usize].as_mut().expect("batched request is live");
            if e.prefill {
                // Cached prompt blocks are not computed (their KV is already there).
                let left = req.prefill_left;
                let chunk = chunk_budget.as_mut().map_or(left, |b| {
                    let n = left.min(*b);
                    *b -= n;
                    n
                });
                e.chunk = chunk;
                if chunk > 0 {
                    let computed = req.context() - req.prefill_cached - left;
                    shape.add_prefill_chunk(chunk, computed);
                }
            } else {
                shape.add_decode(req.context() + 1);
            }
            // Only a full plan adds members; the reused batch ran last time already.
            if replanned && req.record.first_scheduled.is_none() {
                req.record.first_scheduled = Some(now);
            }
            if req.awaiting_after_reasoning {
                req.awaiting_after_reasoning = false;
                req.record.first_scheduled_after_reasoning = Some(now);
            }
            // A prefill entry left without a chunk (chunked prefill's budget spent on decodes)
            // computes nothing in this iteration: its wait after the attach goes on.
            if req.awaiting_after_migration && (!e.prefill || e.chunk > 0) {
                req.awaiting_after_migration = false;
                req.record.first_scheduled_after_migration = Some(now);
            }
        }
        if shape.is_empty() {
            // Everything runnable is blocked behind KV frozen by outgoing migrations: idle until
            // one finishes or aborts (both mark the engine dirty and the driver steps it again).
            self.dirty = true;
            return None;
        }
        let end = now + costs + self.timing.iteration(&shape);
        self.inflight = Some((now, end));
        Some(end)
    }

    /// [`Engine::plan_iteration`], then, when the iterations after it can change nothing a
    /// driver must act on, up to `max` of them in all planned in a row (a leap): returns the
    /// end of the last, and [`Engine::complete_iteration`] at that time completes them all,
    /// exactly as one call per iteration would. An iteration is followed within a leap when
    /// every request on the instance decodes in it and completing it neither finishes a
    /// request, reaches or follows `</think>`, nor changes a priority (the scheduler's
    /// [`IntraScheduler::quiet_tokens`]), and the blocks the next plans take are free. What the
    /// engine reports still changes inside a leap: its decode progress after every iteration,
    /// its blocks and t_i at the times [`Engine::next_load_change`] names, and
    /// [`Engine::load_report_at`] tells it at any time. A driver that changes the engine before
    /// the leap's end calls [`Engine::settle`] first.
    pub fn plan_leap(&mut self, now: Timestamp, max: u32) -> Option<Timestamp> {
        if self.inflight.is_some() {
            return self.leap.last().map(|l| l.end).or(self.next_wake());
        }
        let end = self.plan_iteration(now)?;
        let k = self.quiet_run(max);
        if k <= 1 {
            return Some(end);
        }
        let n = self.batch.len() as u32;
        let bs = self.cfg.block_size;
        let mut shape = BatchShape::default();
        let mut pacers = std::mem::take(&mut self.leap_pacers);
        pacers.clear();
        // growth[j mod bs]: requests whose context sits on a block boundary after j more tokens.
        let mut growth = std::mem::take(&mut self.leap_growth);
        growth.clear();
        growth.resize(bs as usize, 0);
        for e in &self.batch {
            let r = self.req(e.slot);
            shape.add_decode(r.context() + 1);
            pacers.extend(r.pacer);
            growth[((bs - r.context() % bs) % bs) as usize] += 1;
        }
        // Blocks only from the free pool: evicting a cached block would change the prefix index.
        let mut free = self.kv.free(Tier::Gpu) - self.kv.cached_free(Tier::Gpu);
        let mut steps = std::mem::take(&mut self.leap);
        let mut changes = std::mem::take(&mut self.leap_changes);
        let mut slo_ok = self.slo_ok;
        self.leap_base = self.load_report();
        let mut load = LeapLoad::of(&self.leap_base);
        let mut start = self.inflight.map_or(now, |(s, _)| s);
        let mut t = end;
        for j in 1..k {
            // Iteration j completes at `t`: its answer tokens reach the pacers (t_i may flip),
            // then the next plan takes a block for each context on a boundary.
            let mut starving = false;
            for p in &mut pacers {
                p.on_answer_tokens(t, 1);
                starving |= p.buffered(t) < 1.0;
            }
            let blocks = growth[(j % bs) as usize];
            if blocks > free {
                break;
            }
            shape.decode_context_tokens += u64::from(n);
            let d = self.timing.iteration(&shape);
            if d == TimeSpan::ZERO {
                break;
            }
            free -= blocks;
            if blocks > 0 || starving == slo_ok {
                changes.push(t);
            }
            slo_ok = !starving;
            // What completing iteration j and planning the next do to the report.
            load.gpu_used_blocks += blocks;
            load.answering_slo_ok = slo_ok;
            load.decode_context_tokens += u64::from(n);
            load.decode_tokens_total += u64::from(n);
            load.decode_latency_ns_total += u64::from(n) * (t - start).as_nanos();
            start = t;
            t += d;
            steps.push(LeapStep { end: t, grows: blocks > 0, load });
        }
        self.leap_pacers = pacers;
        self.leap_growth = growth;
        self.leap = steps;
        self.leap_changes = changes;
        self.leap_next = 0;
        self.leap_seen = 0;
        Some(t)
    }

    /// How many iterations, the one just planned first, a leap may hold (at most `max`): 1 when
    /// the next completion may already change something.
    fn quiet_run(&self, max: u32) -> u32 {
        let steady = self.batch.len() == self.active.len()
            && self.migrating_out.is_empty()
            && self.batch.iter().all(|e| !e.prefill);
        if max <= 1 || !steady {
            return 1;
        }
        let mut k = max;
        for e in &self.batch {
            let r = self.req(e.slot);
            let (g, c, reasoning) = (r.generated, r.context(), r.spec.reasoning_tokens);
            // Completions j = 1..=quiet give tokens g + j: none the last, `</think>` or the first
            // answer token.
            let mut quiet = r.spec.output_tokens().saturating_sub(g + 1);
            if reasoning > 0 && g <= reasoning {
                quiet = quiet.min((reasoning - g).saturating_sub(1));
            }
            // The next token is produced in the phase the request is in.
            let phase = r.phase();
            let progress = TokenProgress { context_tokens: c + 1, generated_tokens: g + 1 };
            quiet = quiet.min(self.sched.quiet_tokens(&r.sched, phase, progress));
            k = k.min(quiet.saturating_add(1));
            if k == 1 {
                break;
            }
        }
        k
    }

    /// Fast path: same batch as last time, each member growing by its next token's block if needed.
    ///
    /// After an iteration every member's table holds blocks for `context` tokens (it was grown to
    /// the previous context + 1), so it needs one more block exactly when `context` sits on a block
    /// boundary: no table lookup for the other 15 tokens of every 16.
    fn grow_batch_in_place(&mut self) -> bool {
        if self.batch.is_empty() {
            return false;
        }
        let bs = self.cfg.block_size;
        // A request between prefill chunks holds its prompt's blocks already.
        let grows = |e: &BatchEntry, r: &Req| !e.prefill && r.context().is_multiple_of(bs);
        let extra = self.batch.iter().filter(|e| grows(e, self.req(e.slot))).count() as u32;
        if extra > self.kv.free(Tier::Gpu) {
            return false;
        }
        if extra > 0 {
            for i in 0..self.batch.len() {
                let r = self.req(self.batch[i].slot);
                if grows(&self.batch[i], r) {
                    let (id, tokens) = (r.spec.id, r.context() + 1);
                    self.kv.grow(id, tokens).expect("growth checked against free blocks");
                }
            }
        }
        true
    }

    /// Order by priority, fit by priority, preempt what must go. Returns offload + reload time.
    fn full_plan(&mut self, now: Timestamp) -> TimeSpan {
        self.dirty = false;
        self.stats.full_plans += 1;
        self.epoch += 1;
        let epoch = self.epoch;
        let mut active = std::mem::take(&mut self.active);
        {
            let slots = &self.slots;
            active.sort_unstable_by_key(|&s| slots[s as usize].as_ref().expect("active is live").sched.key());
        }
        let admission = self.sched.admission();
        // Requests migrating out are frozen, and blocks reserved for incoming migrations are
        // promised: preemption cannot reclaim either.
        let gpu_blocks_of = |id: RequestId| match self.kv.table(id) {
            Some(t) if t.tier == Tier::Gpu => t.blocks.len() as u32,
            _ => 0,
        };
        let frozen: u32 =
            self.migrating_out.iter().chain(&self.held).map(|&s| gpu_blocks_of(self.req(s).spec.id)).sum::<u32>()
                + self.reserved.iter().map(|&(id, _)| gpu_blocks_of(id)).sum::<u32>();
        let mut budget = self.cfg.gpu_blocks.saturating_sub(frozen);
        // Protected residents (every one with `admission = free-memory`, a request at its
        // boundary with `boundary_hold`) keep what they need for this iteration against waiting
        // requests: those fit only into `budget` minus the needs of protected residents not yet
        // walked. Residents still compete among themselves by priority (growth).
        let protect_all = self.switches.admission == WaitingAdmission::FreeMemory;
        let hold = self.switches.boundary_hold;
        let protected = |r: &Req| r.residence == Residence::Gpu && (protect_all || (hold && r.at_boundary()));
        let mut protected_pending: u32 = if protect_all || hold {
            active
                .iter()
                .map(|&s| self.req(s))
                .filter(|r| protected(r))
                .map(|r| self.kv.blocks_for(r.context() + 1))
                .sum()
        } else {
            0
        };
        let mut seqs = 0u32;
        let mut prefill_tokens = 0u32;
        let mut blocked = false;
        // Cached blocks counted once in this plan, however many selected requests share them.
        let mut counted: HashSet<u32> = HashSet::new();
        let mut newly: Vec<u32> = Vec::new();
        self.batch.clear();
        for &slot in &active {
            if seqs == self.cfg.max_num_seqs {
                self.dirty = true; // others are waiting only for a batch slot: re-plan next time
                break;
            }
            let req = self.slots[slot as usize].as_mut().expect("active is live");
            if req.spec.arrival > now {
                // Not arrived yet at this iteration's start (a driver behind its schedule).
                self.dirty = true;
                continue;
            }
            let resident = req.residence == Residence::Gpu;
            let need = plan_need(&self.kv, req, &counted, &mut newly);
            if protected_pending > 0 && protected(req) {
                protected_pending = protected_pending.saturating_sub(need);
            }
            if blocked && !resident && admission == Admission::BlockBehind {
                continue;
            }
            // Waiting to start, or (chunked prefill) between chunks of its prefill.
            let prefill = req.residence == Residence::Waiting || req.prefill_left > 0;
            // The prefill budget counts the tokens to compute: cached prompt blocks are not.
            let compute = if req.residence != Residence::Waiting && prefill {
                req.prefill_left
            } else if prefill && !req.hashes.is_empty() {
                let cap = req.cache_cap(self.cfg.block_size) as usize;
                req.context() - self.kv.prefix_hits(&req.hashes[..cap]) * self.cfg.block_size
            } else {
                req.context()
            };
            // With chunks, a prompt takes what is left of the iteration's budget and goes on in
            // the next; without, whole prompts up to the budget (the first always fits).
            let over_budget = match self.switches.chunked_prefill_tokens {
                Some(c) => prefill_tokens >= c,
                None => prefill_tokens > 0 && prefill_tokens + compute > self.cfg.max_batched_tokens,
            };
            if prefill && over_budget {
                self.dirty = true; // waiting for prefill budget, not memory
                if admission == Admission::BlockBehind {
                    blocked = true;
                }
                continue;
            }
            let room = if resident { budget } else { budget.saturating_sub(protected_pending) };
            if need <= room {
                budget -= need;
                counted.extend(newly.drain(..));
                seqs += 1;
                if prefill {
                    prefill_tokens += match self.switches.chunked_prefill_tokens {
                        Some(c) => compute.min(c - prefill_tokens),
                        None => compute,
                    };
                }
                req.selected_epoch = epoch;
                self.batch.push(BatchEntry { slot, prefill, chunk: 0 });
            } else if !resident {
                blocked = true;
            }
        }

        // Preempt: free GPU blocks for the selected requests, lowest priority first, only as needed.
        let need_free: u32 = self
            .batch
            .iter()
            .map(|e| {
                let r = self.req(e.slot);
                let held_on_gpu = match r.residence {
                    Residence::Gpu => self.kv.table(r.spec.id).map_or(0, |t| t.blocks.len() as u32),
                    // Cached blocks other requests hold take no free block.
                    Residence::Waiting if !r.hashes.is_empty() => {
                        let cap = r.cache_cap(self.cfg.block_size) as usize;
                        self.kv.prefix_hit_blocks(&r.hashes[..cap]).filter(|&b| self.kv.is_held(b)).count() as u32
                    }
                    _ => 0,
                };
                self.kv.blocks_for(r.context() + 1).saturating_sub(held_on_gpu)
            })
            .sum();
        let mut costs = TimeSpan::ZERO;
        let mut offload_bytes = 0u64;
        for &slot in active.iter().rev() {
            if need_free <= self.kv.free(Tier::Gpu) {
                break;
            }
            let req = self.slots[slot as usize].as_ref().expect("active is live");
            if req.residence != Residence::Gpu || req.selected_epoch == epoch {
                continue;
            }
            let id = req.spec.id;
            let blocks = self.kv.table(id).map_or(0, |t| t.blocks.len() as u32);
            let new_residence = if self.kv.move_to(id, Tier::Cpu).is_ok() {
                offload_bytes += blocks as u64 * self.cfg.block_bytes();
                Residence::Cpu
            } else {
                // CPU pool full: drop the KV; the request recomputes it when it runs again.
                self.kv.free_request(id);
                Residence::Waiting
            };
            let req = self.slots[slot as usize].as_mut().expect("active is live");
            if new_residence == Residence::Waiting {
                req.prefill_left = 0;
            }
            req.residence = new_residence;
            req.record.preemptions += 1;
            self.stats.preemptions += 1;
        }

        // Give the selected requests their blocks: residents grow first (their blocks were
        // planned exactly); then reloads and admissions in priority order. Those count on cached
        // blocks that an eviction meanwhile may have taken: one that no longer fits waits for the
        // next plan.
        let mut reload_bytes = 0u64;
        let mut unfit = false;
        for i in 0..self.batch.len() {
            let req = self.slots[self.batch[i].slot as usize].as_ref().expect("batched request is live");
            if req.residence == Residence::Gpu {
                let (id, tokens) = (req.spec.id, req.context() + 1);
                // Planned within GPU capacity; only blocks lent out (a worker's transport reading
                // them) can stay taken when their holder is preempted: then it sits this one out.
                if self.kv.grow(id, tokens).is_err() {
                    debug_assert!(self.kv.loans() > 0, "a resident's growth was planned within GPU capacity");
                    self.batch[i].slot = u32::MAX;
                    unfit = true;
                }
            }
        }
        for i in 0..self.batch.len() {
            let slot = self.batch[i].slot;
            if slot == u32::MAX {
                continue;
            }
            let req = self.slots[slot as usize].as_mut().expect("batched request is live");
            let (id, tokens) = (req.spec.id, req.context() + 1);
            let placed = match req.residence {
                Residence::Gpu => continue,
                Residence::Cpu => match self.kv.move_to(id, Tier::Gpu) {
                    Ok(moved) => {
                        reload_bytes += moved as u64 * self.cfg.block_bytes();
                        true
                    }
                    Err(_) => false,
                },
                Residence::Waiting => {
                    let cap = req.cache_cap(self.cfg.block_size);
                    match self.kv.allocate_prefixed(id, req.context(), &req.hashes, cap) {
                        Ok(hit) => {
                            // Blocks only in the CPU tier are copied up, not computed.
                            req.prefill_cached = hit.blocks * self.cfg.block_size;
                            req.prefill_left = req.context() - req.prefill_cached;
                            reload_bytes += hit.from_cpu as u64 * self.cfg.block_bytes();
                            if req.generated > 0 {
                                self.stats.recomputed_tokens += (req.context() - req.prefill_cached) as u64;
                            } else if req.record.first_scheduled.is_none() {
                                req.record.cached_tokens = req.prefill_cached;
                            }
                            true
                        }
                        Err(_) => false,
                    }
                }
                Residence::MigratingOut => unreachable!("migrating requests are not active"),
            };
            if !placed || self.kv.grow(id, tokens).is_err() {
                if placed {
                    // In, but no room to grow: back where it was (a reload to the CPU pool it
                    // just left, an admission to waiting).
                    let back = req.residence == Residence::Cpu && self.kv.move_to(id, Tier::Cpu).is_ok();
                    if !back {
                        self.kv.free_request(id);
                        req.residence = Residence::Waiting;
                        req.prefill_left = 0;
                    }
                }
                self.batch[i].slot = u32::MAX;
                unfit = true;
                continue;
            }
            req.residence = Residence::Gpu;
        }
        if unfit {
            self.batch.retain(|e| e.slot != u32::MAX);
            self.dirty = true;
        }
        self.active = active;
        if offload_bytes > 0 {
            self.stats.offloaded_bytes += offload_bytes;
            costs += self.timing.offload(offload_bytes);
        }
        if reload_bytes > 0 {
            self.stats.reloaded_bytes += reload_bytes;
            costs += self.timing.reload(reload_bytes);
        }
        costs
    }

    /// Freeze a request for migration; its KV stays put until [`Engine::finish_migration_out`].
    pub fn begin_migration_out(&mut self, request: RequestId) -> Result<MigrationOut, EngineError> {
        let slot = *self.index.get(&request).ok_or(EngineError::Unknown(request))?;
        // A request held after its prefill is in no batch: its KV is final whatever runs.
        if self.inflight.is_some() && !self.held.contains(&slot) {
            return Err(EngineError::IterationInFlight);
        }
        if self.req(slot).residence == Residence::MigratingOut {
            return Err(EngineError::Duplicate(request));
        }
        if self.req(slot).prefill_left > 0 && self.req(slot).residence != Residence::Waiting {
            return Err(EngineError::Prefilling(request));
        }
        let kv_blocks = self.kv.table(request).map_or(0, |t| t.blocks.len() as u32);
        let req = self.req_mut(slot);
        req.residence = Residence::MigratingOut;
        let kv_tokens = req.context();
        self.active.retain(|&s| s != slot);
        self.held.retain(|&s| s != slot);
        self.batch.retain(|e| e.slot != slot);
        self.migrating_out.push(slot);
        self.dirty = true;
        Ok(MigrationOut { kv_tokens, kv_blocks, kv_bytes: kv_tokens as u64 * self.cfg.kv_bytes_per_token })
    }

    /// The copy is done: release the source's blocks and hand the request over.
    pub fn finish_migration_out(&mut self, request: RequestId) -> Result<MigratedRequest, EngineError> {
        let slot = *self.index.get(&request).ok_or(EngineError::Unknown(request))?;
        if self.req(slot).residence != Residence::MigratingOut {
            return Err(EngineError::NotMigrating(request));
        }
        let req = self.remove(slot);
        self.kv.free_request(request);
        self.migrating_out.retain(|&s| s != slot);
        self.dirty = true;
        Ok(MigratedRequest {
            spec: req.spec,
            generated: req.generated,
            record: req.record,
            pacer: req.pacer,
            awaiting_after_reasoning: req.awaiting_after_reasoning,
            demoted: req.sched.demoted,
        })
    }

    /// Drop a request that is not to run here after all: its instance lost it to a re-placement
    /// (a registration that expired) or its client went away. Its KV is freed at once and it
    /// produces nothing more, not even a final record. Allowed while an iteration is in flight
    /// (the iteration simply ends without its token); a request frozen for a migration is the
    /// migration's to end ([`EngineError::Migrating`]).
    pub fn cancel(&mut self, request: RequestId) -> Result<(), EngineError> {
        let slot = *self.index.get(&request).ok_or(EngineError::Unknown(request))?;
        if self.req(slot).residence == Residence::MigratingOut {
            return Err(EngineError::Migrating(request));
        }
        self.active.retain(|&s| s != slot);
        self.held.retain(|&s| s != slot);
        self.batch.retain(|e| e.slot != slot);
        self.remove(slot);
        self.kv.free_request(request);
        self.dirty = true;
        Ok(())
    }

    /// Whether the request is frozen by [`Engine::begin_migration_out`].
    pub fn is_migrating_out(&self, request: RequestId) -> bool {
        self.index.get(&request).is_some_and(|&slot| self.req(slot).residence == Residence::MigratingOut)
    }

    /// The state a request frozen by [`Engine::begin_migration_out`] would hand over, without
    /// releasing it (a live migration sends it with COMMIT and frees the source only once the
    /// target confirms; on abort the request carries on here).
    pub fn migration_state(&self, request: RequestId) -> Result<MigratedRequest, EngineError> {
        let slot = *self.index.get(&request).ok_or(EngineError::Unknown(request))?;
        let req = self.req(slot);
        if req.residence != Residence::MigratingOut {
            return Err(EngineError::NotMigrating(request));
        }
        Ok(MigratedRequest {
            spec: req.spec.clone(),
            generated: req.generated,
            record: req.record.clone(),
            pacer: req.pacer,
            awaiting_after_reasoning: req.awaiting_after_reasoning,
            demoted: req.sched.demoted,
        })
    }

    /// The copy failed: the request carries on here as if nothing happened.
    pub fn abort_migration_out(&mut self, request: RequestId) -> Result<(), EngineError> {
        let slot = *self.index.get(&request).ok_or(EngineError::Unknown(request))?;
        if self.req(slot).residence != Residence::MigratingOut {
            return Err(EngineError::NotMigrating(request));
        }
        let residence = match self.kv.tier_of(request) {
            Some(Tier::Gpu) => Residence::Gpu,
            Some(Tier::Cpu) => Residence::Cpu,
            None => Residence::Waiting,
        };
        self.req_mut(slot).residence = residence;
        self.migrating_out.retain(|&s| s != slot);
        if self.hand_off && self.req(slot).generated == 1 {
            // A handoff that failed: held again, for the next decode instance or a release.
            self.held.push(slot);
        } else {
            self.active.push(slot);
        }
        self.dirty = true;
        Ok(())
    }

    /// Make this a prefill instance (`true`): every request stops after its first token and is
    /// held for a handoff ([`EngineEvent::PrefillDone`]); or a decoding one again (`false`: the
    /// requests held now are released to run here).
    pub fn set_hand_off(&mut self, on: bool) {
        self.hand_off = on;
        if !on {
            for slot in std::mem::take(&mut self.held) {
                self.active.push(slot);
            }
            self.dirty = true;
        }
    }

    /// While `request`'s prefill runs before its first token: the prompt tokens whose KV is
    /// computed so far (cached ones included; 0 while it waits to be admitted). `None` once it
    /// has a token, or for a request not here.
    pub fn prompt_written(&self, request: RequestId) -> Option<u32> {
        let req = self.req(*self.index.get(&request)?);
        match (req.generated, req.residence) {
            (0, Residence::Waiting) => Some(0),
            (0, _) => Some(req.context() - req.prefill_left),
            _ => None,
        }
    }

    /// While `request`'s prefill computes a chunk in the iteration in flight: when that iteration
    /// started and ends, and the prompt tokens whose KV is computed at its end (a handoff
    /// following the prefill layer by layer sends each layer group of them as the iteration
    /// reaches it). `None` when no chunk of its prefill is in flight.
    pub fn prefill_in_flight(&self, request: RequestId) -> Option<PrefillInFlight> {
        let (start, end) = self.inflight?;
        let slot = *self.index.get(&request)?;
        let e = self.batch.iter().find(|e| e.slot == slot && e.prefill && e.chunk > 0)?;
        let req = self.req(slot);
        (req.generated == 0).then(|| PrefillInFlight { start, end, tokens: req.context() - req.prefill_left + e.chunk })
    }

    /// On a prefill instance, the requests whose prefill's first chunk the iteration in flight
    /// computes, with the KV blocks each will hold at its prefill's end: a handoff following the
    /// prefill layer by layer may start now. Empty elsewhere, and when no iteration is in flight.
    pub fn prefills_starting(&self) -> Vec<(RequestId, u32)> {
        if !self.hand_off || self.inflight.is_none() {
            return Vec::new();
        }
        self.batch
            .iter()
            .filter(|e| e.prefill && e.chunk > 0)
            .map(|e| self.req(e.slot))
            .filter(|r| r.generated == 0 && r.prefill_left == r.context() - r.prefill_cached)
            .map(|r| (r.spec.id, self.kv.table(r.spec.id).map_or(0, |t| t.blocks.len() as u32)))
            .collect()
    }

    /// Whether `request` is held here after its prefill, waiting for its handoff.
    pub fn is_held(&self, request: RequestId) -> bool {
        self.index.get(&request).is_some_and(|slot| self.held.contains(slot))
    }

    /// The requests held after their prefill for a handoff, in the order they were held, with
    /// the KV blocks each holds (as its [`EngineEvent::PrefillDone`] said).
    pub fn held_requests(&self) -> Vec<(RequestId, u32)> {
        self.held
            .iter()
            .map(|&slot| {
                let id = self.req(slot).spec.id;
                (id, self.kv.table(id).map_or(0, |t| t.blocks.len() as u32))
            })
            .collect()
    }

    /// Whether this is a prefill instance ([`Engine::set_hand_off`]).
    pub fn hands_off(&self) -> bool {
        self.hand_off
    }

    /// Let a request held after its prefill decode here after all (no decode instance took it).
    pub fn release_held(&mut self, request: RequestId) -> Result<(), EngineError> {
        let slot = *self.index.get(&request).ok_or(EngineError::Unknown(request))?;
        if !self.held.contains(&slot) {
            return Err(EngineError::NotHeld(request));
        }
        self.held.retain(|&s| s != slot);
        self.active.push(slot);
        self.dirty = true;
        Ok(())
    }

    /// Reserve blocks for an incoming live migration holding `tokens` KV tokens (or extend an
    /// existing reservation to that many), so its KV can be copied in place while it still runs
    /// on the source: GPU blocks when there is room, else CPU (offload) blocks. Returns the
    /// reserved block ids, in token order, on the tier of [`KvBlockManager::tier_of`].
    pub fn reserve_incoming(&mut self, request: RequestId, tokens: u32) -> Result<&[u32], EngineError> {
        self.reserve_incoming_with_headroom(request, tokens, 0)
    }

    /// [`Engine::reserve_incoming`], a new reservation taking up to `headroom` more tokens where
    /// its tier has room for them: the request keeps decoding on the source while its KV is
    /// copied, and a target that meanwhile filled up with its own requests could not grow the
    /// reservation. The tier is chosen as for `tokens` alone (GPU whenever `tokens` fit there);
    /// [`Engine::attach`] gives back what is left unused.
    pub fn reserve_incoming_with_headroom(
        &mut self,
        request: RequestId,
        tokens: u32,
        headroom: u32,
    ) -> Result<&[u32], EngineError> {
        if self.index.contains_key(&request) {
            return Err(EngineError::Duplicate(request));
        }
        let room = |e: KvError| match e {
            KvError::OutOfBlocks { needed, free, .. } => EngineError::NoRoom { request, needed, free },
            _ => EngineError::NoRoom { request, needed: 0, free: 0 },
        };
        if let Some(at) = self.reserved.iter().position(|&(r, _)| r == request) {
            let have = self.kv.table(request).map_or(0, |t| t.tokens);
            if tokens > have {
                self.kv.grow(request, tokens).map_err(room)?;
            }
            let kv_tokens = &mut self.reserved[at].1;
            *kv_tokens = (*kv_tokens).max(tokens);
        } else {
            let needed = self.kv.blocks_for(tokens.max(1));
            if needed > self.cfg.gpu_blocks {
                return Err(EngineError::TooLarge { request, needed, capacity: self.cfg.gpu_blocks });
            }
            // GPU memory if there is room, else the CPU pool (it is then reloaded when scheduled,
            // like an offloaded request), as a re-materialising attach would place it.
            // Headroom only where the tier has room for it: `tokens` alone decide the tier.
            let with_headroom = tokens.saturating_add(headroom);
            let kv = &mut self.kv;
            let mut place =
                |tier| kv.allocate(request, tier, with_headroom).or_else(|_| kv.allocate(request, tier, tokens));
            if let Err(e) = place(Tier::Gpu) {
                place(Tier::Cpu).map_err(|_| room(e))?;
            }
            self.reserved.push((request, tokens));
            self.admitted += 1;
        }
        self.dirty = true;
        Ok(&self.kv.table(request).expect("just reserved").blocks)
    }

    /// [`Engine::reserve_incoming_with_headroom`] for a new reservation of a request whose leading
    /// full prompt blocks hash to `prefix` (a migration's `Prepare`): the leading ones this
    /// instance's prefix cache holds on the GPU are pinned — shared, their content already here —
    /// instead of reserved, and the reserved blocks `prefix` covers are registered for later
    /// prompts. Returns how many blocks were pinned: 0 with prefix caching off, without a prefix,
    /// when the reservation exists already or goes to the CPU tier.
    pub fn reserve_incoming_prefixed(
        &mut self,
        request: RequestId,
        tokens: u32,
        headroom: u32,
        prefix: &[BlockHash],
    ) -> Result<u32, EngineError> {
        let fresh = !self.is_reserved(request) && !self.index.contains_key(&request);
        if self.cfg.prefix_caching
            && !prefix.is_empty()
            && fresh
            && self.kv.blocks_for(tokens.max(1)) <= self.cfg.gpu_blocks
        {
            // Only whole blocks of the KV announced, only GPU hits (a CPU copy would be a reload).
            let pinned = (self.kv.prefix_hit_blocks(prefix).count() as u32).min(tokens / self.cfg.block_size);
            let kv = &mut self.kv;
            let with_headroom = tokens.saturating_add(headroom);
            let placed = kv
                .allocate_prefixed_arriving(request, with_headroom, prefix, pinned)
                .or_else(|_| kv.allocate_prefixed_arriving(request, tokens, prefix, pinned));
            if let Ok(hit) = placed {
                self.reserved.push((request, tokens));
                self.admitted += 1;
                self.dirty = true;
                return Ok(hit.blocks);
            }
        }
        self.reserve_incoming_with_headroom(request, tokens, headroom).map(|_| 0)
    }

    /// Drop an incoming reservation (the migration aborted); returns the blocks freed.
    pub fn release_reservation(&mut self, request: RequestId) -> u32 {
        if !self.is_reserved(request) {
            return 0;
        }
        self.reserved.retain(|&(r, _)| r != request);
        self.dirty = true;
        self.kv.free_request(request)
    }

    /// The requests holding blocks reserved for incoming migrations.
    pub fn reserved_requests(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.reserved.iter().map(|&(r, _)| r)
    }

    fn is_reserved(&self, request: RequestId) -> bool {
        self.reserved.iter().any(|&(r, _)| r == request)
    }

    /// Receive a migrated request. With a reservation ([`Engine::reserve_incoming`]) its KV is
    /// already in those GPU blocks; otherwise it lands in GPU memory if there is room, else in
    /// the CPU pool (reloaded when it is scheduled), else it is recomputed.
    pub fn attach(&mut self, now: Timestamp, m: MigratedRequest) -> Result<(), EngineError> {
        let id = m.spec.id;
        if self.index.contains_key(&id) {
            return Err(EngineError::Duplicate(id));
        }
        let needed = self.kv.blocks_for(m.spec.max_context_tokens());
        if needed > self.cfg.gpu_blocks {
            return Err(EngineError::TooLarge { request: id, needed, capacity: self.cfg.gpu_blocks });
        }
        let tokens = m.kv_tokens();
        let reserved = self.is_reserved(id);
        if !reserved {
            // A reserved one was counted when its reservation was made.
            self.admitted += 1;
        }
        if reserved {
            let tier = self.kv.tier_of(id).unwrap_or(Tier::Gpu);
            self.kv.resize(id, tokens).map_err(|_| EngineError::NoRoom {
                request: id,
                needed: self.kv.blocks_for(tokens),
                free: self.kv.free(tier),
            })?;
            self.reserved.retain(|&(r, _)| r != id);
        }
        let residence = if reserved {
            match self.kv.tier_of(id) {
                Some(Tier::Cpu) => Residence::Cpu,
                _ => Residence::Gpu,
            }
        } else if self.kv.allocate(id, Tier::Gpu, tokens).is_ok() {
            Residence::Gpu
        } else if self.kv.allocate(id, Tier::Cpu, tokens).is_ok() {
            Residence::Cpu
        } else {
            Residence::Waiting
        };
        let mut record = m.record;
        record.migrations += 1;
        // q3 is measured from the latest attach: an earlier move's wait is not this one's.
        record.migrated_in = Some(now);
        record.first_scheduled_after_migration = None;
        let hashes = self.prompt_hashes(&m.spec);
        let req = Req {
            spec: m.spec,
            generated: m.generated,
            residence,
            sched: SchedState { demoted: m.demoted, ..SchedState::default() },
            pacer: m.pacer,
            record,
            awaiting_after_reasoning: m.awaiting_after_reasoning,
            awaiting_after_migration: true,
            selected_epoch: 0,
            hashes,
            prefill_cached: 0,
            prefill_left: 0,
        };
        // A request that waited past the threshold during its move fails t_i at once, not only
        // at the end of this instance's next iteration.
        if self.switches.ttfat_starvation.is_some_and(|limit| Self::first_answer_overdue(&req, now, limit)) {
            self.slo_ok = false;
        }
        self.enqueue(req);
        Ok(())
    }

    /// What this instance publishes to the instance-level scheduler.
    pub fn load_report(&self) -> LoadReport {
        let mut r = LoadReport {
            instance: self.instance,
            gpu_used_blocks: self.kv.used(Tier::Gpu),
            cpu_used_blocks: self.kv.used(Tier::Cpu),
            gpu_total_blocks: self.kv.capacity(Tier::Gpu),
            block_bytes: self.cfg.block_bytes(),
            answering_slo_ok: self.slo_ok,
            block_tokens: self.cfg.block_size,
            admitted: self.admitted,
            decode_tokens_total: self.decode_tokens_total,
            decode_latency_ns_total: self.decode_latency_ns_total,
            // An incoming move with blocks reserved will decode here: its context counts from the
            // reservation on (a move that follows a prefill holds one for the whole prefill, and a
            // decoder looking idle meanwhile would be taken for one).
            decode_context_tokens: self.reserved.iter().map(|&(_, tokens)| u64::from(tokens)).sum(),
            ..LoadReport::default()
        };
        for &s in &self.active {
            let req = self.req(s);
            if req.generated == 0 {
                // What is left to compute: an admitted prompt's cached blocks (and chunks
                // already computed) are not.
                let left = if req.prefill_left > 0 {
                    req.prefill_left
                } else {
                    req.spec.prompt_tokens.saturating_sub(req.prefill_cached)
                };
                r.prefill_queue.add(left);
            } else {
                r.decode_context_tokens += u64::from(req.context());
            }
            if req.residence == Residence::Waiting {
                if req.generated == 0 {
                    r.waiting_requests += 1;
                }
                r.waiting_blocks += self.kv.blocks_for(req.context());
            }
            if req.sched.in_reasoning_queue() && req.phase() == Phase::Reasoning {
                r.reasoning_requests += 1;
                if matches!(req.residence, Residence::Waiting | Residence::Cpu) {
                    r.reasoning_demand_blocks += self.kv.blocks_for(req.context() + 1);
                }
            } else {
                r.answering_requests += 1;
                if req.sched.round == 0 {
                    r.fresh_answering_requests += 1;
                }
            }
        }
        r
    }

    /// Hint the CPU to fetch what the next `complete_iteration` will touch first (the batch and
    /// the start of the request slab). A simulator with thousands of instances handles each one
    /// cache-cold; calling this one event ahead hides most of that latency. No effect on results.
    #[inline]
    pub fn prefetch(&self) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let lines: [*const i8; 4] = [
                self.batch.as_ptr() as *const i8,
                self.slots.as_ptr() as *const i8,
                (self.slots.as_ptr() as *const i8).wrapping_add(64),
                (self.slots.as_ptr() as *const i8).wrapping_add(std::mem::size_of::<Option<Req>>()),
            ];
            for p in lines {
                // SAFETY: prefetch is a hint; it never faults, even on an invalid address.
                unsafe { _mm_prefetch(p, _MM_HINT_T0) };
            }
        }
    }

    /// Verify KV accounting and that every request is where the engine thinks it is.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.kv.check_invariants()?;
        for (id, &slot) in &self.index {
            let req = self.req(slot);
            let tier = self.kv.tier_of(*id);
            let ok = match req.residence {
                Residence::Waiting => tier.is_none(),
                Residence::Gpu => tier == Some(Tier::Gpu),
                Residence::Cpu => tier == Some(Tier::Cpu),
                Residence::MigratingOut => true,
            };
            if !ok {
                return Err(format!("{id} is {:?} but its KV is on {tier:?}", req.residence));
            }
            let in_active = self.active.contains(&slot);
            let held = self.held.contains(&slot);
            if in_active == (req.residence == Residence::MigratingOut || held) {
                return Err(format!("{id} active={in_active} held={held} while {:?}", req.residence));
            }
            if held && (req.residence != Residence::Gpu || req.generated != 1) {
                return Err(format!("{id} is held after {} tokens while {:?}", req.generated, req.residence));
            }
        }
        if self.kv.requests() > self.index.len() + self.reserved.len() {
            return Err("KV held by requests that are not on this instance".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
