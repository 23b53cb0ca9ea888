//! The source side: the worker that holds the request and pushes its KV cache.

use super::wire::{self, frame::Body, Frame};
use super::{
    abort_frame, blocks_for_tokens, body_migration_id, body_name, frame, AbortKind, AbortReason, MigrationId,
    MigrationParams, MigrationPhase, MigrationReport, MoveOrder, Outcome, ParamsError, StageReport,
};
use bytes::Bytes;
use kvfleet_core::kv::BlockHash;
use kvfleet_core::{RequestId, Timestamp};
use std::collections::{HashMap, VecDeque};
use std::ops::Range;

/// What the source driver must do next.
#[derive(Clone, Debug, PartialEq)]
pub enum SourceAction {
    /// Send this frame on the control stream.
    Send(Frame),
    /// Read logical blocks `blocks` of the request and send one `BlockData` frame per block
    /// ([`super::block_frame`]) on the data streams, and first, with `slices`, one frame per
    /// block of its range carrying only its layer groups ([`super::slice_frame_head`]); then call
    /// [`SourceMachine::on_blocks_sent`] with `stage`. Block `i` holds
    /// [`super::block_tokens`]`(i, kv_tokens, block_size)` valid tokens; in a live stage every block of the
    /// ranges is full. Never emitted with nothing to send.
    CopyBlocks {
        /// The copy stage (0, 1, ...).
        stage: u32,
        /// Logical block indices to send whole.
        blocks: Range<u32>,
        /// Blocks of which only some layer groups go (a migration following a prefill iteration
        /// layer by layer), before `blocks`.
        slices: Option<Slices>,
        /// The request's KV length (tokens) this stage copies up to.
        kv_tokens: u32,
        /// True for the stop-and-copy stage (request paused).
        final_stage: bool,
    },
    /// Freeze the request (finish the current iteration, decode no more), then call
    /// [`SourceMachine::on_paused`] with its final KV length and serialized state.
    Pause,
    /// The migration is over (always the last action). `Committed`: free the source copy.
    /// `Aborted`: resume (or keep running) the request here. `Unknown`: keep it paused and ask
    /// the coordinator (module doc, "The commit point").
    Done(Outcome),
}

/// Layer groups `groups` (of the migration's [`SourceMachine::in_layer_groups`]) of each block of
/// `blocks`: a [`SourceAction::CopyBlocks`]'s slices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slices {
    /// Logical block indices.
    pub blocks: Range<u32>,
    /// The layer groups of each that go, `first..end` of the migration's groups.
    pub groups: Range<u32>,
}

/// The iteration computing part of a followed prefill, as far as it has gone: it will leave the
/// request with `tokens` of KV, and its first `groups_done` layer groups are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct InFlight {
    tokens: u32,
    groups_done: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Idle,
    Preparing,
    Copying {
        stage: u32,
    },
    AwaitingAck {
        stage: u32,
    },
    /// Following a prefill: every full block so far has been copied; waiting for the prefill
    /// to write more (`on_kv_progress`) or to end (`on_paused`).
    AwaitingKv,
    Pausing,
    FinalCopy {
        stage: u32,
        kv_final: u32,
        blocks_total: u32,
    },
    Committing,
    Done,
}

/// The source side of one migration. See the module documentation for the protocol.
#[derive(Clone, Debug)]
pub struct SourceMachine {
    id: MigrationId,
    request: RequestId,
    params: MigrationParams,
    model: String,
    source_instance: u32,
    trace_context: HashMap<String, String>,
    order: MoveOrder,
    state: State,
    /// KV length the driver last reported (append-only: only grows).
    kv_tokens: u32,
    /// Blocks `0..sent_blocks` have been handed to `CopyBlocks`.
    sent_blocks: u32,
    live_stages_done: u32,
    deadline: Option<Timestamp>,
    /// The request state from `on_paused`, sent in `Commit`.
    request_state: Bytes,
    /// Content hashes of its leading full prompt blocks, sent in `Prepare`.
    prefix: Vec<BlockHash>,
    /// Following a prefill still running on the source: the KV it will hold at its end.
    follow: Option<u32>,
    /// Following a prefill, the pause (its end) came during a live stage: the final length and
    /// state, for the final stage once that stage is acknowledged.
    paused_early: Option<(u32, Bytes)>,
    /// Layer groups a block may be sent in (1: whole blocks only).
    layer_groups: u32,
    /// The followed prefill's iteration in flight ([`SourceMachine::on_layer_progress`]).
    in_flight: Option<InFlight>,
    /// Blocks `sent_blocks..end` have had their first `groups` layer groups sent, not the rest
    /// (they fill in the iteration in flight).
    frontier: Option<(u32, u32)>,
    actions: VecDeque<SourceAction>,
    report: MigrationReport,
}

impl SourceMachine {
    /// A migration of `request`, which holds `kv_tokens` tokens of KV now. Nothing happens until
    /// [`SourceMachine::start`].
    pub fn new(
        id: MigrationId,
        request: RequestId,
        params: MigrationParams,
        now: Timestamp,
        kv_tokens: u32,
    ) -> Result<SourceMachine, ParamsError> {
        params.validate()?;
        Ok(SourceMachine {
            id,
            request,
            params,
            model: String::new(),
            source_instance: 0,
            trace_context: HashMap::new(),
            order: MoveOrder::UNORDERED,
            state: State::Idle,
            kv_tokens,
            sent_blocks: 0,
            live_stages_done: 0,
            deadline: None,
            request_state: Bytes::new(),
            prefix: Vec::new(),
            follow: None,
            paused_early: None,
            layer_groups: 1,
            in_flight: None,
            frontier: None,
            actions: VecDeque::new(),
            report: MigrationReport {
                migration: id,
                request,
                created: now,
                started: None,
                kv_tokens_start: kv_tokens,
                kv_tokens_final: None,
                stages: Vec::new(),
                bytes: 0,
                skipped_blocks: 0,
                bytes_skipped: 0,
                pause_requested_at: None,
                paused_at: None,
                commit_sent_at: None,
                finished_at: None,
                downtime: None,
                total_time: None,
                goodput_bytes_per_s: None,
                outcome: None,
            },
        })
    }

    /// The content hashes of the request's leading full prompt blocks, sent in `Prepare`: a
    /// target caching the first k of them is not sent those k blocks.
    pub fn with_prefix(mut self, prefix: Vec<BlockHash>) -> Self {
        self.prefix = prefix;
        self
    }

    /// The move's order among the moves the cluster's leaders started, sent in `Prepare` (a
    /// target fenced for the request refuses moves started before its fence).
    pub fn with_order(mut self, order: MoveOrder) -> Self {
        self.order = order;
        self
    }

    /// Follow a prefill still running on the source (an overlapped prefill/decode handoff): the
    /// request will hold `expected_kv_tokens` of KV at its end, which the target reserves at once.
    /// `Pause` is asked as soon as the target accepts and means "at the prefill's end"; meanwhile
    /// live stages copy each full block the prefill writes, as many stages as it takes (neither
    /// `max_stages` nor the stop-copy rule applies), waiting for more
    /// ([`SourceMachine::awaiting_kv`]) when every full block has left. [`SourceMachine::on_paused`]
    /// may then come in any live state: the final stage (the blocks written since, and the partial
    /// last one) follows the stage in flight.
    pub fn following_prefill(mut self, expected_kv_tokens: u32) -> Self {
        self.follow = Some(expected_kv_tokens);
        self
    }

    /// Following a prefill, send blocks in `groups` layer groups (at most 64; 1: whole): as the
    /// iteration computing a chunk of it goes through the model's layers
    /// ([`SourceMachine::on_layer_progress`]), each group of the blocks that chunk fills leaves as
    /// soon as it is computed, so what is left at the prefill's end is its last group.
    pub fn in_layer_groups(mut self, groups: u32) -> Self {
        self.layer_groups = groups.clamp(1, super::MAX_LAYER_GROUPS);
        self
    }

    /// Layer groups a block may be sent in ([`SourceMachine::in_layer_groups`]; 1: whole).
    pub fn layer_groups(&self) -> u32 {
        self.layer_groups
    }

    /// Following a prefill, every full block so far has left: the KV length (tokens) the driver
    /// should report growth beyond ([`SourceMachine::on_kv_progress`]), or the prefill's end.
    pub fn awaiting_kv(&self) -> Option<u32> {
        (self.state == State::AwaitingKv).then_some(self.kv_tokens)
    }

    /// Following a prefill in layer groups and waiting for more KV: the layer progress already
    /// known (the iteration in flight's KV length and groups computed; `(0, 0)` for none), which
    /// the driver should report progress beyond.
    pub fn awaiting_layers(&self) -> Option<(u32, u32)> {
        if self.state != State::AwaitingKv || self.layer_groups <= 1 {
            return None;
        }
        Some(self.in_flight.map_or((0, 0), |f| (f.tokens, f.groups_done)))
    }

    /// Whether `Pause` was asked and [`SourceMachine::on_paused`] is still awaited (following a
    /// prefill, from the target's acceptance to the prefill's end).
    pub fn pause_wanted(&self) -> bool {
        match self.state {
            State::Pausing => true,
            State::Copying { .. } | State::AwaitingAck { .. } | State::AwaitingKv => {
                self.follow.is_some() && self.report.pause_requested_at.is_some() && self.report.paused_at.is_none()
            }
            _ => false,
        }
    }

    /// The model name sent in `Prepare` (the target refuses a model it does not serve).
    pub fn with_model(mut self, model: impl Into<String>) -> Self {
        self.model = model.into();
        self
    }

    /// The source instance id sent in `Prepare`.
    pub fn with_source_instance(mut self, instance: u32) -> Self {
        self.source_instance = instance;
        self
    }

    /// W3C trace context (`traceparent`, ...) sent in `Prepare`.
    pub fn with_trace_context(mut self, trace_context: HashMap<String, String>) -> Self {
        self.trace_context = trace_context;
        self
    }

    /// The migration's id.
    pub fn id(&self) -> MigrationId {
        self.id
    }
    /// The request being migrated.
    pub fn request(&self) -> RequestId {
        self.request
    }
    /// The migration's tuning.
    pub fn params(&self) -> &MigrationParams {
        &self.params
    }
    /// Measurements so far (complete once `Done` was emitted).
    pub fn report(&self) -> &MigrationReport {
        &self.report
    }
    /// The outcome, once `Done` was emitted.
    pub fn outcome(&self) -> Option<&Outcome> {
        self.report.outcome.as_ref()
    }
    /// Whether `Done` was emitted.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// What the machine is doing or waiting for.
    pub fn phase(&self) -> MigrationPhase {
        match self.state {
            State::Idle => MigrationPhase::NotStarted,
            State::Preparing => MigrationPhase::Preparing,
            State::Copying { .. } => MigrationPhase::LiveCopy,
            State::AwaitingAck { .. } => MigrationPhase::StageAck,
            State::AwaitingKv => MigrationPhase::FollowingPrefill,
            State::Pausing => MigrationPhase::Pausing,
            State::FinalCopy { .. } => MigrationPhase::StopAndCopy,
            State::Committing => MigrationPhase::Committing,
            State::Done => MigrationPhase::Finished,
        }
    }

    /// The next action for the driver, in order.
    pub fn poll_action(&mut self) -> Option<SourceAction> {
        self.actions.pop_front()
    }

    /// When to call [`SourceMachine::on_timeout`] (`None` before `start` and after `Done`).
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        match self.state {
            State::Idle | State::Done => None,
            _ => self.deadline,
        }
    }

    /// Send `Prepare`. Only the first call does anything.
    pub fn start(&mut self, now: Timestamp) {
        if self.state != State::Idle {
            return;
        }
        self.report.started = Some(now);
        self.deadline = Some(now + self.params.timeout);
        self.state = State::Preparing;
        self.send(Body::Prepare(wire::Prepare {
            migration_id: self.id.0,
            request_id: self.request.0,
            kv_tokens: self.kv_tokens,
            block_size: self.params.block_size,
            block_bytes: self.params.block_bytes,
            model: self.model.clone(),
            source_instance: self.source_instance,
            trace_context: self.trace_context.clone(),
            prefix: self.prefix.iter().map(|&h| wire::BlockHash { hi: (h >> 64) as u64, lo: h as u64 }).collect(),
            expected_kv_tokens: self.follow.unwrap_or(0),
            layer_groups: if self.follow.is_some() && self.layer_groups > 1 { self.layer_groups } else { 0 },
            leader_term: self.order.term,
            move_seq: self.order.seq,
        }));
    }

    /// A frame from the target (control stream).
    pub fn on_frame(&mut self, now: Timestamp, frame: Frame) {
        if matches!(self.state, State::Done) {
            return;
        }
        let Some(body) = frame.body else {
            return self.fail(now, AbortReason::BadFrame("empty frame".into()), true);
        };
        let id = body_migration_id(&body);
        if id != Some(self.id.0) {
            let id = id.map_or_else(|| "none".to_string(), |i| i.to_string());
            let msg = format!("{} for migration {id}, expected {}", body_name(&body), self.id.0);
            return self.fail(now, AbortReason::BadFrame(msg), true);
        }
        match (self.state, body) {
            // The target sends Abort only before it attaches, so even after Commit this is final.
            (_, Body::Abort(a)) => {
                let reason = AbortReason::PeerAborted { kind: AbortKind::from_wire(a.code), message: a.reason };
                self.finish(now, Outcome::Aborted(reason));
            }
            (State::Preparing, Body::PrepareReply(r)) => {
                if r.ok && r.cached_blocks as usize > self.prefix.len() {
                    let msg = format!("{} blocks cached of a {}-block prefix", r.cached_blocks, self.prefix.len());
                    self.fail(now, AbortReason::BadFrame(msg), true);
                } else if r.ok {
                    // What the target holds already is never sent.
                    self.sent_blocks = r.cached_blocks;
                    self.report.skipped_blocks = r.cached_blocks;
                    self.report.bytes_skipped = r.cached_blocks as u64 * self.params.block_bytes;
                    if self.follow.is_some() {
                        // Held at the prefill's end: the driver answers when it comes.
                        self.report.pause_requested_at = Some(now);
                        self.actions.push_back(SourceAction::Pause);
                    }
                    self.next_stage(now);
                } else {
                    self.finish(now, Outcome::Aborted(AbortReason::Refused(r.reason)));
                }
            }
            (State::AwaitingAck { stage }, Body::StageAck(a)) if a.stage == stage => {
                if let Some(s) = self.report.stages.last_mut() {
                    s.ended = Some(now);
                }
                self.live_stages_done += 1;
                self.next_stage(now);
            }
            (State::Committing, Body::CommitReply(r)) => {
                if r.ok {
                    if let Some(s) = self.report.stages.last_mut() {
                        s.ended = Some(now);
                    }
                    self.finish(now, Outcome::Committed);
                } else {
                    // A target that refuses the commit has not attached: the request stays here.
                    self.finish(now, Outcome::Aborted(AbortReason::AttachFailed(r.reason)));
                }
            }
            (_, body) => {
                let msg = match &body {
                    Body::StageAck(a) => format!("StageAck for stage {} while {}", a.stage, self.phase()),
                    other => format!("unexpected {} while {}", body_name(other), self.phase()),
                };
                self.fail(now, AbortReason::BadFrame(msg), true);
            }
        }
    }

    /// The request decoded more tokens; it now holds `kv_tokens` tokens of KV. Smaller values than
    /// before are ignored (KV is append-only), and so are reports once the pause was asked for.
    pub fn on_kv_progress(&mut self, now: Timestamp, kv_tokens: u32) {
        if self.paused_early.is_some() {
            return;
        }
        match self.state {
            State::Idle | State::Preparing | State::Copying { .. } | State::AwaitingAck { .. } => {
                self.kv_tokens = self.kv_tokens.max(kv_tokens);
            }
            State::AwaitingKv => {
                self.kv_tokens = self.kv_tokens.max(kv_tokens);
                self.next_stage(now);
            }
            _ => {}
        }
    }

    /// Following a prefill in layer groups: the iteration in flight will leave the request with
    /// `tokens` of KV and has computed its first `groups_done` layer groups (of
    /// [`SourceMachine::in_layer_groups`]). Blocks it fills may leave group by group.
    pub fn on_layer_progress(&mut self, now: Timestamp, tokens: u32, groups_done: u32) {
        if self.follow.is_none() || self.layer_groups <= 1 || self.paused_early.is_some() {
            return;
        }
        let groups_done = groups_done.min(self.layer_groups);
        let next = InFlight { tokens, groups_done };
        match self.in_flight {
            // Progress only goes forward within one iteration.
            Some(f) if f.tokens == tokens && f.groups_done >= groups_done => return,
            _ => self.in_flight = Some(next),
        }
        if self.state == State::AwaitingKv {
            self.next_stage(now);
        }
    }

    /// The driver has written every block of the `CopyBlocks` of `stage` to the transport.
    pub fn on_blocks_sent(&mut self, now: Timestamp, stage: u32) {
        match self.state {
            State::Copying { stage: s } if s == stage => {
                let blocks = self.mark_stage_sent(now);
                self.send(Body::StageEnd(wire::StageEnd {
                    migration_id: self.id.0,
                    stage,
                    blocks,
                    final_stage: false,
                }));
                self.state = State::AwaitingAck { stage };
            }
            State::FinalCopy { stage: s, kv_final, blocks_total } if s == stage => {
                self.mark_stage_sent(now);
                self.end_final_stage(now, stage, kv_final, blocks_total);
            }
            _ => {}
        }
    }

    /// The driver froze the request after [`SourceAction::Pause`]: it holds `kv_tokens_final`
    /// tokens and `state` is its serialized state for the target.
    pub fn on_paused(&mut self, now: Timestamp, kv_tokens_final: u32, state: impl Into<Bytes>) {
        let following = self.follow.is_some() && self.paused_early.is_none() && self.report.paused_at.is_none();
        match self.state {
            State::Pausing => {}
            State::AwaitingKv if following => {}
            State::Copying { .. } | State::AwaitingAck { .. } if following => {
                // The prefill ended during a live stage: the final stage follows its ack.
                self.report.paused_at = Some(now);
                self.report.kv_tokens_final = Some(kv_tokens_final);
                self.paused_early = Some((kv_tokens_final, state.into()));
                return;
            }
            _ => return,
        }
        self.report.paused_at = Some(now);
        self.final_stage(now, kv_tokens_final, state.into());
    }

    /// The request is paused with `kv_tokens_final` tokens: copy what is left and commit.
    fn final_stage(&mut self, now: Timestamp, kv_tokens_final: u32, state: Bytes) {
        self.report.kv_tokens_final = Some(kv_tokens_final);
        let already_sent_tokens = self.sent_blocks as u64 * self.params.block_size as u64;
        if (kv_tokens_final as u64) < already_sent_tokens {
            let msg =
                format!("paused with {kv_tokens_final} tokens, fewer than the {already_sent_tokens} already copied");
            return self.fail(now, AbortReason::SourceKvUnavailable(msg), true);
        }
        self.kv_tokens = kv_tokens_final;
        self.request_state = state;
        let stage = self.live_stages_done;
        let blocks_total = blocks_for_tokens(kv_tokens_final, self.params.block_size);
        // The rest of the blocks whose first layer groups left during the last iteration.
        let slices = self.frontier.take().map(|(end, groups)| Slices {
            blocks: self.sent_blocks..end.min(blocks_total),
            groups: groups..self.layer_groups,
        });
        let slices = slices.filter(|s| !s.blocks.is_empty());
        let first_whole = slices.as_ref().map_or(self.sent_blocks, |s| s.blocks.end);
        let blocks = first_whole..blocks_total;
        self.begin_stage(now, stage, slices.as_ref(), blocks.clone(), true);
        self.sent_blocks = blocks_total;
        self.in_flight = None;
        self.state = State::FinalCopy { stage, kv_final: kv_tokens_final, blocks_total };
        if blocks.is_empty() && slices.is_none() {
            // Every block went in live stages (the KV ends on a block boundary): nothing to copy.
            self.mark_stage_sent(now);
            self.end_final_stage(now, stage, kv_tokens_final, blocks_total);
        } else {
            self.actions.push_back(SourceAction::CopyBlocks {
                stage,
                blocks,
                slices,
                kv_tokens: kv_tokens_final,
                final_stage: true,
            });
        }
    }

    /// The driver could not read the request's KV blocks. Aborts unless `Commit` was already sent
    /// (then every block has been read and the failure is irrelevant).
    pub fn on_read_failed(&mut self, now: Timestamp, reason: impl Into<String>) {
        match self.state {
            State::Done | State::Committing => {}
            _ => self.fail(now, AbortReason::SourceKvUnavailable(reason.into()), true),
        }
    }

    /// The connection to the target broke: `Aborted(Disconnected)`, or `Unknown(Disconnected)` if
    /// `Commit` was sent.
    pub fn on_disconnect(&mut self, now: Timestamp) {
        if self.state != State::Done {
            self.fail(now, AbortReason::Disconnected, false);
        }
    }

    /// The deadline from [`SourceMachine::poll_timeout`] may have passed.
    pub fn on_timeout(&mut self, now: Timestamp) {
        if let Some(deadline) = self.poll_timeout() {
            if now >= deadline {
                let phase = self.phase();
                self.fail(now, AbortReason::Timeout { phase }, true);
            }
        }
    }

    /// Abort the migration: the request stays here. Returns false, and does nothing, once `Commit`
    /// was sent (the target may already run the request; the migration completes on its own) or
    /// after `Done`.
    pub fn cancel(&mut self, now: Timestamp, reason: impl Into<String>) -> bool {
        match self.state {
            State::Done | State::Committing => false,
            _ => {
                self.fail(now, AbortReason::Cancelled(reason.into()), true);
                true
            }
        }
    }

    /// After `PrepareReply { ok }` or a `StageAck`: copy the full blocks added since the last
    /// stage, or pause if few remain (fewer than `stop_copy_blocks`) or enough live stages ran.
    fn next_stage(&mut self, now: Timestamp) {
        if let Some((kv_final, state)) = self.paused_early.take() {
            return self.final_stage(now, kv_final, state);
        }
        let full_blocks = self.kv_tokens / self.params.block_size;
        let remaining = full_blocks.saturating_sub(self.sent_blocks);
        if self.follow.is_some() {
            // Following a prefill: copy what it wrote, or wait for more (the pause is its end).
            return self.follow_stage(now, full_blocks);
        }
        // The link as the last live stage measured it: its bytes over Copy → StageAck.
        let rate = self.report.stages.iter().rev().find(|s| !s.final_stage).and_then(|s| {
            let took = s.ended?.saturating_since(s.started).as_secs_f64();
            (took > 0.0).then(|| s.bytes as f64 / took)
        });
        if self.params.stop_copy_now(self.live_stages_done, remaining, rate) {
            self.report.pause_requested_at = Some(now);
            self.state = State::Pausing;
            self.actions.push_back(SourceAction::Pause);
            return;
        }
        self.live_stage_whole(now, full_blocks);
    }

    /// Following a prefill, the next live stage: the rest of the blocks whose first groups left
    /// once the iteration that fills them ended, then the full blocks not sent yet, then the
    /// layer groups the iteration in flight computed of the blocks it fills; or wait for more.
    fn follow_stage(&mut self, now: Timestamp, full_blocks: u32) {
        let bs = self.params.block_size;
        let g = self.layer_groups;
        let (start, sent_groups) = match self.frontier {
            // Their iteration ended: their other groups, and any full block after them.
            Some((end, groups)) if end <= full_blocks => {
                self.frontier = None;
                let slices = Slices { blocks: self.sent_blocks..end, groups: groups..g };
                return self.live_stage(now, Some(slices), end..full_blocks);
            }
            Some((end, groups)) => (end, groups),
            None if full_blocks > self.sent_blocks => {
                return self.live_stage(now, None, self.sent_blocks..full_blocks);
            }
            None => (self.sent_blocks, 0),
        };
        // The groups the iteration in flight computed since, of the blocks it fills.
        match self.in_flight {
            Some(f) if g > 1 && f.groups_done > sent_groups && f.tokens / bs > self.sent_blocks => {
                let end = f.tokens / bs;
                if self.frontier.is_some() && end != start {
                    // Another iteration than the frontier's: its end is reported first.
                    self.state = State::AwaitingKv;
                    return;
                }
                let slices = Slices { blocks: self.sent_blocks..end, groups: sent_groups..f.groups_done };
                self.frontier = Some((end, f.groups_done));
                if f.groups_done >= g {
                    self.frontier = None;
                }
                self.live_stage(now, Some(slices), end..end)
            }
            _ => self.state = State::AwaitingKv,
        }
    }

    /// A live stage copying the full blocks not sent yet, up to `full_blocks`.
    fn live_stage_whole(&mut self, now: Timestamp, full_blocks: u32) {
        self.live_stage(now, None, self.sent_blocks..full_blocks)
    }

    /// A live stage sending `slices`, then `blocks` whole (all full). Every block of both counts
    /// as sent afterwards, except a frontier's (their last groups go later).
    fn live_stage(&mut self, now: Timestamp, slices: Option<Slices>, blocks: Range<u32>) {
        let stage = self.live_stages_done;
        self.begin_stage(now, stage, slices.as_ref(), blocks.clone(), false);
        let end = slices.as_ref().map_or(blocks.end, |s| s.blocks.end.max(blocks.end));
        if self.frontier.is_none() {
            self.sent_blocks = self.sent_blocks.max(end);
        }
        self.state = State::Copying { stage };
        let kv_tokens = end * self.params.block_size;
        self.actions.push_back(SourceAction::CopyBlocks { stage, blocks, slices, kv_tokens, final_stage: false });
    }

    fn begin_stage(
        &mut self,
        now: Timestamp,
        stage: u32,
        slices: Option<&Slices>,
        blocks: Range<u32>,
        final_stage: bool,
    ) {
        let n = blocks.end.saturating_sub(blocks.start);
        let (frames, bytes) = match slices {
            Some(s) => {
                let k = s.blocks.end.saturating_sub(s.blocks.start);
                let r = super::slice_bytes(self.params.block_bytes, self.layer_groups, s.groups.clone());
                (k, k as u64 * (r.end - r.start))
            }
            None => (0, 0),
        };
        self.report.stages.push(StageReport {
            stage,
            final_stage,
            blocks: n + frames,
            bytes: n as u64 * self.params.block_bytes + bytes,
            started: now,
            sent: None,
            ended: None,
        });
    }

    /// Records that the current stage's blocks left; returns how many there were.
    fn mark_stage_sent(&mut self, now: Timestamp) -> u32 {
        let Some(s) = self.report.stages.last_mut() else { return 0 };
        s.sent = Some(now);
        self.report.bytes += s.bytes;
        s.blocks
    }

    fn end_final_stage(&mut self, now: Timestamp, stage: u32, kv_final: u32, blocks_total: u32) {
        let blocks = self.report.stages.last().map_or(0, |s| s.blocks);
        self.send(Body::StageEnd(wire::StageEnd { migration_id: self.id.0, stage, blocks, final_stage: true }));
        self.send(Body::Commit(wire::Commit {
            migration_id: self.id.0,
            kv_tokens: kv_final,
            blocks_total,
            state: self.request_state.clone(),
        }));
        self.report.commit_sent_at = Some(now);
        self.state = State::Committing;
    }

    /// Ends the migration because of `reason`, telling the target if `notify_peer` (the connection
    /// stands) and it has heard of the migration. After `Commit` the outcome is `Unknown`: the
    /// target may have attached.
    fn fail(&mut self, now: Timestamp, reason: AbortReason, notify_peer: bool) {
        if self.state == State::Done {
            return;
        }
        if notify_peer && self.state != State::Idle {
            self.actions.push_back(SourceAction::Send(abort_frame(self.id, &reason)));
        }
        let outcome = if self.state == State::Committing { Outcome::Unknown(reason) } else { Outcome::Aborted(reason) };
        self.finish(now, outcome);
    }

    fn finish(&mut self, now: Timestamp, outcome: Outcome) {
        if self.state == State::Done {
            return;
        }
        self.state = State::Done;
        let r = &mut self.report;
        r.finished_at = Some(now);
        let started = r.started.unwrap_or(r.created);
        let total = now.saturating_since(started);
        r.total_time = Some(total);
        r.downtime = match (&outcome, r.paused_at) {
            (Outcome::Unknown(_), _) | (_, None) => None,
            (_, Some(paused)) => Some(now.saturating_since(paused)),
        };
        r.goodput_bytes_per_s = match outcome {
            Outcome::Committed if total.as_nanos() > 0 => Some(r.bytes as f64 / total.as_secs_f64()),
            _ => None,
        };
        r.outcome = Some(outcome.clone());
        self.actions.push_back(SourceAction::Done(outcome));
    }

    fn send(&mut self, body: Body) {
        self.actions.push_back(SourceAction::Send(frame(body)));
    }
}
