//! The target side: the worker that receives a request's KV cache, created on a `Prepare` frame.

use super::wire::{self, frame::Body, Frame};
use super::{
    abort_frame, block_tokens, blocks_for_tokens, body_migration_id, body_name, checksum_payload, frame, AbortKind,
    AbortReason, MigrationId, MigrationParams, MigrationPhase, MoveOrder, Outcome,
};
use crate::Payload;
use bytes::Bytes;
use kvfleet_core::kv::BlockHash;
use kvfleet_core::{RequestId, Timestamp};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, VecDeque};

/// What the target driver must do next.
#[derive(Clone, Debug, PartialEq)]
pub enum TargetAction {
    /// Send this frame on the control stream.
    Send(Frame),
    /// Reserve room for `blocks` blocks (`kv_tokens` tokens) of `request`, whose KV belongs to
    /// `model`; answer with [`TargetMachine::on_reserved`] (an error refuses the `Prepare`, e.g.
    /// [`AbortReason::TargetOutOfMemory`] or [`AbortReason::Refused`] for a model not served here).
    /// The request keeps decoding on the source, so later writes may need more blocks.
    Reserve {
        /// The request being migrated.
        request: RequestId,
        /// Its KV length announced by `Prepare`, tokens.
        kv_tokens: u32,
        /// Blocks holding those tokens.
        blocks: u32,
        /// The model the KV belongs to.
        model: String,
        /// Content hashes of its leading full prompt blocks (`Prepare.prefix`): the ones cached
        /// here may be pinned instead of reserved, answered with
        /// [`TargetMachine::on_reserved_prefix`].
        prefix: Vec<BlockHash>,
        /// The move's order (`Prepare.leader_term`, `move_seq`): refuse it if the request was
        /// settled as "not here" after the move started.
        order: MoveOrder,
    },
    /// Write this block (logical `index`, `tokens` valid tokens, exactly `block_bytes` long), or
    /// a slice of it (`data` at `offset`: some of its layer groups), into the reservation,
    /// growing it if needed; a later write of the same bytes replaces them.
    /// Answer with [`TargetMachine::on_written`] or [`TargetMachine::on_write_failed`].
    /// The data is in the buffers it arrived in (see [`TargetMachine::on_frame_with_payload`]).
    WriteBlock {
        /// Logical block index.
        index: u32,
        /// Valid tokens in the block.
        tokens: u32,
        /// Where in the block `data` goes (0 for a whole block).
        offset: u64,
        /// The block's bytes (or the slice's).
        data: Payload,
        /// `None`: the machine verified the block's checksum. `Some(sum)`: the writer verifies
        /// that what it wrote hashes to `sum` ([`crate::Payload::copy_checksummed`]) and
        /// answers a mismatch with `on_write_failed(AbortReason::ChecksumMismatch)`
        /// ([`TargetMachine::verify_on_write`]).
        checksum: Option<u64>,
    },
    /// Commit: attach the request with `state`, `kv_tokens` tokens in logical blocks `0..blocks`
    /// (all written), and answer with [`TargetMachine::on_attached`]. This is the commit point:
    /// from here on only a failed attach aborts.
    Attach {
        /// The request's serialized state, from `Commit`.
        state: Bytes,
        /// Its final KV length, tokens.
        kv_tokens: u32,
        /// Logical blocks holding it.
        blocks: u32,
    },
    /// Free the reservation and every block written for this migration.
    Release,
    /// The migration is over (always the last action). `Committed`: resume the request here.
    /// `Aborted`: nothing of it is left here.
    Done(Outcome),
}

/// Measurements of one migration as the target saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetReport {
    /// The migration.
    pub migration: MigrationId,
    /// The request being migrated.
    pub request: RequestId,
    /// The instance it comes from (from `Prepare`).
    pub source_instance: u32,
    /// When the `Prepare` arrived.
    pub started: Timestamp,
    /// When `Done` was emitted.
    pub finished_at: Option<Timestamp>,
    /// KV tokens announced by `Prepare`.
    pub kv_tokens_prepare: u32,
    /// KV tokens committed by `Commit`.
    pub kv_tokens_final: Option<u32>,
    /// Block bytes received and verified.
    pub bytes_received: u64,
    /// Blocks written (`on_written`).
    pub blocks_written: u32,
    /// Leading blocks found in this instance's prefix cache (`on_reserved_prefix`): not sent.
    #[serde(default)]
    pub blocks_cached: u32,
    /// Live stages acknowledged.
    pub stages_acked: u32,
    /// How it ended; `None` until `Done`.
    pub outcome: Option<Outcome>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Reserving,
    Receiving,
    Attaching,
    Done,
}

/// Progress of the stage being received (stages are strictly sequential: the source starts stage
/// `s + 1` only after `StageAck(s)`).
#[derive(Clone, Debug, Default)]
struct StageProgress {
    /// From `StageEnd`.
    expected: Option<u32>,
    final_stage: bool,
    received: u32,
    written: u32,
}

/// The target side of one migration. See the module documentation for the protocol.
#[derive(Clone, Debug)]
pub struct TargetMachine {
    id: MigrationId,
    request: RequestId,
    params: MigrationParams,
    trace_context: HashMap<String, String>,
    state: State,
    deadline: Option<Timestamp>,
    /// A `Reserve` was emitted and not released (answer `Release` on abort).
    reserved: bool,
    stage: u32,
    progress: StageProgress,
    /// Writes handed to the driver and not yet confirmed: index → `tokens` of each and the
    /// layer groups it holds (a mask; all of them for a whole block), in order.
    pending: BTreeMap<u32, VecDeque<(u32, u64)>>,
    pending_writes: u32,
    /// Confirmed blocks, every layer group of them: index → valid tokens.
    written: BTreeMap<u32, u32>,
    /// Blocks of which some layer groups are confirmed, not all: index → their mask.
    partly_written: BTreeMap<u32, u64>,
    /// Layer groups a block may come in (`Prepare.layer_groups`; 1: whole blocks only).
    layer_groups: u32,
    commit: Option<wire::Commit>,
    actions: VecDeque<TargetAction>,
    report: TargetReport,
    /// Blocks' checksums are left to the writer ([`TargetMachine::verify_on_write`]).
    verify_on_write: bool,
}

impl TargetMachine {
    /// A machine for the migration `frame` opens, if it is a `Prepare`; otherwise the `Abort` frame
    /// to send back. `params` are this worker's: a `Prepare` whose block geometry differs, or
    /// invalid `params`, is refused (the machine then starts with `PrepareReply { ok: false }`).
    pub fn accept(now: Timestamp, params: &MigrationParams, frame: Frame) -> Result<TargetMachine, Box<Frame>> {
        match frame.body {
            Some(Body::Prepare(p)) => Ok(TargetMachine::new(now, params, p)),
            Some(other) => {
                let id = MigrationId(body_migration_id(&other).unwrap_or(0));
                let msg = format!("{} for unknown migration {}, expected Prepare", body_name(&other), id.0);
                Err(Box::new(abort_frame(id, &AbortReason::BadFrame(msg))))
            }
            None => Err(Box::new(abort_frame(MigrationId(0), &AbortReason::BadFrame("empty frame".into())))),
        }
    }

    /// Leave each block's checksum to the writer of [`TargetAction::WriteBlock`], which verifies
    /// the bytes as they land (one pass over them instead of two: a hash, then a copy).
    pub fn verify_on_write(mut self) -> TargetMachine {
        self.verify_on_write = true;
        self
    }

    /// A machine for this `Prepare` (see [`TargetMachine::accept`]).
    pub fn new(now: Timestamp, params: &MigrationParams, prepare: wire::Prepare) -> TargetMachine {
        let id = MigrationId(prepare.migration_id);
        let request = RequestId(prepare.request_id);
        let mut m = TargetMachine {
            id,
            request,
            params: params.clone(),
            trace_context: prepare.trace_context,
            state: State::Reserving,
            deadline: Some(now + params.timeout),
            reserved: false,
            stage: 0,
            progress: StageProgress::default(),
            pending: BTreeMap::new(),
            pending_writes: 0,
            written: BTreeMap::new(),
            partly_written: BTreeMap::new(),
            layer_groups: prepare.layer_groups.clamp(1, super::MAX_LAYER_GROUPS),
            commit: None,
            actions: VecDeque::new(),
            verify_on_write: false,
            report: TargetReport {
                migration: id,
                request,
                source_instance: prepare.source_instance,
                started: now,
                finished_at: None,
                kv_tokens_prepare: prepare.kv_tokens,
                kv_tokens_final: None,
                bytes_received: 0,
                blocks_written: 0,
                blocks_cached: 0,
                stages_acked: 0,
                outcome: None,
            },
        };
        let mismatch = if let Err(e) = params.validate() {
            Some(format!("target misconfigured: {e}"))
        } else if prepare.block_size != params.block_size {
            Some(format!("block_size {} differs from the target's {}", prepare.block_size, params.block_size))
        } else if prepare.block_bytes != params.block_bytes {
            Some(format!("block_bytes {} differs from the target's {}", prepare.block_bytes, params.block_bytes))
        } else if prepare.layer_groups > super::MAX_LAYER_GROUPS {
            Some(format!("{} layer groups, at most {}", prepare.layer_groups, super::MAX_LAYER_GROUPS))
        } else {
            None
        };
        match mismatch {
            Some(reason) => m.refuse(now, AbortReason::Refused(reason)),
            None => {
                m.reserved = true;
                // A migration that follows a prefill announces the KV it will end with.
                let kv_tokens = prepare.kv_tokens.max(prepare.expected_kv_tokens);
                m.actions.push_back(TargetAction::Reserve {
                    request,
                    kv_tokens,
                    blocks: blocks_for_tokens(kv_tokens, params.block_size),
                    model: prepare.model,
                    prefix: prepare.prefix.iter().map(|h| (h.hi as BlockHash) << 64 | h.lo as BlockHash).collect(),
                    order: MoveOrder { term: prepare.leader_term, seq: prepare.move_seq },
                });
            }
        }
        m
    }

    /// The migration's id.
    pub fn id(&self) -> MigrationId {
        self.id
    }
    /// The request being migrated.
    pub fn request(&self) -> RequestId {
        self.request
    }
    /// The trace context the source sent in `Prepare`.
    pub fn trace_context(&self) -> &HashMap<String, String> {
        &self.trace_context
    }
    /// Measurements so far (complete once `Done` was emitted).
    pub fn report(&self) -> &TargetReport {
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
            State::Reserving => MigrationPhase::Reserving,
            State::Receiving => MigrationPhase::Receiving,
            State::Attaching => MigrationPhase::Attaching,
            State::Done => MigrationPhase::Finished,
        }
    }

    /// The next action for the driver, in order.
    pub fn poll_action(&mut self) -> Option<TargetAction> {
        self.actions.pop_front()
    }

    /// When to call [`TargetMachine::on_timeout`] (`None` once attaching or done).
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        match self.state {
            State::Reserving | State::Receiving => self.deadline,
            State::Attaching | State::Done => None,
        }
    }

    /// The driver's answer to [`TargetAction::Reserve`], nothing of its prefix cached here.
    pub fn on_reserved(&mut self, now: Timestamp, result: Result<(), AbortReason>) {
        self.on_reserved_prefix(now, result.map(|()| 0))
    }

    /// The driver's answer to [`TargetAction::Reserve`]: the reservation holds the first
    /// `cached` blocks of the prefix already (pinned from this instance's prefix cache, valid
    /// content): the source does not send them.
    pub fn on_reserved_prefix(&mut self, now: Timestamp, result: Result<u32, AbortReason>) {
        if self.state != State::Reserving {
            return;
        }
        match result {
            Ok(cached) => {
                self.state = State::Receiving;
                let bs = self.params.block_size;
                for index in 0..cached {
                    self.written.insert(index, bs);
                }
                self.report.blocks_cached = cached;
                self.send(Body::PrepareReply(wire::PrepareReply {
                    migration_id: self.id.0,
                    ok: true,
                    reason: String::new(),
                    cached_blocks: cached,
                }));
            }
            Err(reason) => {
                self.reserved = false;
                self.refuse(now, reason);
            }
        }
    }

    /// A frame from the source (control or data stream). Once attaching, frames are ignored: the
    /// commit point has passed.
    pub fn on_frame(&mut self, now: Timestamp, frame: Frame) {
        self.on_frame_with_payload(now, frame, None)
    }

    /// [`TargetMachine::on_frame`] for a `BlockData` frame whose data was received apart from
    /// it, as a list of buffers (`payload`; the frame's own `data` is then empty): the bytes are
    /// verified and written from those buffers, never joined.
    pub fn on_frame_with_payload(&mut self, now: Timestamp, frame: Frame, payload: Option<Payload>) {
        if matches!(self.state, State::Attaching | State::Done) {
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
            (_, Body::Abort(a)) => {
                let reason = AbortReason::PeerAborted { kind: AbortKind::from_wire(a.code), message: a.reason };
                self.fail(now, reason, false);
            }
            (State::Receiving, Body::BlockData(mut b)) => match payload {
                None => {
                    let data = Payload::from(std::mem::take(&mut b.data));
                    self.on_block(now, b, data)
                }
                Some(data) if b.data.is_empty() => self.on_block(now, b, data),
                Some(_) => {
                    let msg = format!("BlockData {} carries its data twice (inline and apart)", b.index);
                    self.fail(now, AbortReason::BadFrame(msg), true)
                }
            },
            (_, body) if payload.is_some() => {
                let msg = format!("a payload beside {}, which has no data field", body_name(&body));
                self.fail(now, AbortReason::BadFrame(msg), true);
            }
            (State::Receiving, Body::StageEnd(e)) => self.on_stage_end(now, e),
            (State::Receiving, Body::Commit(c)) => self.on_commit(now, c),
            (_, body) => {
                let msg = format!("unexpected {} while {}", body_name(&body), self.phase());
                self.fail(now, AbortReason::BadFrame(msg), true);
            }
        }
    }

    /// The driver wrote block `index` (answer to [`TargetAction::WriteBlock`]).
    pub fn on_written(&mut self, now: Timestamp, index: u32) {
        if self.state != State::Receiving {
            return;
        }
        let Some(queue) = self.pending.get_mut(&index) else { return };
        let Some((tokens, groups)) = queue.pop_front() else { return };
        if queue.is_empty() {
            self.pending.remove(&index);
        }
        self.pending_writes = self.pending_writes.saturating_sub(1);
        self.progress.written += 1;
        let all = self.all_groups();
        let have = match self.partly_written.remove(&index) {
            Some(mask) => mask | groups,
            None if self.written.contains_key(&index) => all,
            None => groups,
        };
        if have == all {
            if self.written.insert(index, tokens).is_none() {
                self.report.blocks_written += 1;
            }
        } else {
            self.partly_written.insert(index, have);
        }
        self.advance(now);
    }

    /// The driver could not write a block (e.g. [`AbortReason::TargetOutOfMemory`] when growing
    /// the reservation): abort.
    pub fn on_write_failed(&mut self, now: Timestamp, reason: AbortReason) {
        if self.state == State::Receiving {
            self.fail(now, reason, true);
        }
    }

    /// The driver's answer to [`TargetAction::Attach`].
    pub fn on_attached(&mut self, now: Timestamp, result: Result<(), AbortReason>) {
        if self.state != State::Attaching {
            return;
        }
        match result {
            Ok(()) => {
                self.reserved = false;
                self.send(Body::CommitReply(wire::CommitReply {
                    migration_id: self.id.0,
                    ok: true,
                    reason: String::new(),
                }));
                self.finish(now, Outcome::Committed);
            }
            Err(reason) => {
                // The source names a refused COMMIT as an attach that failed itself: the reply
                // carries what failed, not that phrase again.
                let why = match &reason {
                    AbortReason::AttachFailed(why) => why.clone(),
                    other => other.to_string(),
                };
                self.send(Body::CommitReply(wire::CommitReply { migration_id: self.id.0, ok: false, reason: why }));
                self.release();
                self.finish(now, Outcome::Aborted(reason));
            }
        }
    }

    /// The connection to the source broke: abort, unless already attaching (then the attach
    /// decides; the source, missing the `CommitReply`, ends `Unknown`).
    pub fn on_disconnect(&mut self, now: Timestamp) {
        if matches!(self.state, State::Reserving | State::Receiving) {
            self.fail(now, AbortReason::Disconnected, false);
        }
    }

    /// The deadline from [`TargetMachine::poll_timeout`] may have passed.
    pub fn on_timeout(&mut self, now: Timestamp) {
        let Some(deadline) = self.poll_timeout() else { return };
        if now < deadline {
            return;
        }
        let reason = match &self.commit {
            Some(c) => {
                let have = self.written.range(..c.blocks_total).count() as u32;
                AbortReason::Incomplete { missing: c.blocks_total.saturating_sub(have) }
            }
            None => AbortReason::Timeout { phase: self.phase() },
        };
        self.fail(now, reason, true);
    }

    /// The mask of every layer group of a block.
    fn all_groups(&self) -> u64 {
        u64::MAX >> (64 - self.layer_groups)
    }

    fn on_block(&mut self, now: Timestamp, b: wire::BlockData, data: Payload) {
        let bad = |msg: String| AbortReason::BadFrame(format!("BlockData {} of stage {}: {msg}", b.index, b.stage));
        if b.stage != self.stage {
            return self.fail(now, bad(format!("expected stage {}", self.stage)), true);
        }
        if let Some(expected) = self.progress.expected {
            if self.progress.received >= expected {
                return self.fail(now, bad(format!("the stage has only {expected} blocks")), true);
            }
        }
        if b.index < self.report.blocks_cached {
            // A pinned block of this instance's cache is shared: never overwritten.
            return self.fail(
                now,
                bad(format!("the first {} blocks are cached here", self.report.blocks_cached)),
                true,
            );
        }
        if b.tokens == 0 || b.tokens > self.params.block_size {
            let msg = format!("{} tokens, expected 1..={}", b.tokens, self.params.block_size);
            return self.fail(now, bad(msg), true);
        }
        let g = self.layer_groups;
        let (range, groups) = match (b.group_first, b.group_end) {
            (0, 0) => (0..self.params.block_bytes, self.all_groups()),
            (first, end) if first < end && end <= g => {
                let mask = (u64::MAX >> (64 - (end - first))) << first;
                (super::slice_bytes(self.params.block_bytes, g, first..end), mask)
            }
            (first, end) => return self.fail(now, bad(format!("layer groups {first}..{end} of {g}")), true),
        };
        if data.len() as u64 != range.end - range.start {
            let msg = format!("{} bytes, expected {}", data.len(), range.end - range.start);
            return self.fail(now, bad(msg), true);
        }
        if !self.verify_on_write && checksum_payload(&data) != b.checksum {
            return self.fail(now, AbortReason::ChecksumMismatch { block: b.index }, true);
        }
        self.progress.received += 1;
        self.report.bytes_received += data.len() as u64;
        self.pending.entry(b.index).or_default().push_back((b.tokens, groups));
        self.pending_writes += 1;
        let checksum = self.verify_on_write.then_some(b.checksum);
        let (index, tokens, offset) = (b.index, b.tokens, range.start);
        self.actions.push_back(TargetAction::WriteBlock { index, tokens, offset, data, checksum });
    }

    fn on_stage_end(&mut self, now: Timestamp, e: wire::StageEnd) {
        if e.stage != self.stage || self.progress.expected.is_some() {
            let msg = format!("StageEnd for stage {}, expected the end of stage {}", e.stage, self.stage);
            return self.fail(now, AbortReason::BadFrame(msg), true);
        }
        if self.progress.received > e.blocks {
            let msg = format!("StageEnd says {} blocks, {} arrived", e.blocks, self.progress.received);
            return self.fail(now, AbortReason::BadFrame(msg), true);
        }
        self.progress.expected = Some(e.blocks);
        self.progress.final_stage = e.final_stage;
        self.advance(now);
    }

    fn on_commit(&mut self, now: Timestamp, c: wire::Commit) {
        if !self.progress.final_stage || self.commit.is_some() {
            let msg = "Commit without a preceding final StageEnd (or twice)".to_string();
            return self.fail(now, AbortReason::BadFrame(msg), true);
        }
        let needed = blocks_for_tokens(c.kv_tokens, self.params.block_size);
        if c.blocks_total != needed {
            let msg = format!("Commit of {} tokens says {} blocks, not {needed}", c.kv_tokens, c.blocks_total);
            return self.fail(now, AbortReason::BadFrame(msg), true);
        }
        self.report.kv_tokens_final = Some(c.kv_tokens);
        self.commit = Some(c);
        self.advance(now);
    }

    /// Acknowledge a complete live stage; attach once a committed transfer is complete.
    fn advance(&mut self, now: Timestamp) {
        let Some(expected) = self.progress.expected else { return };
        if self.progress.written < expected {
            return;
        }
        if !self.progress.final_stage {
            let stage = self.stage;
            self.send(Body::StageAck(wire::StageAck { migration_id: self.id.0, stage }));
            self.report.stages_acked += 1;
            self.stage = self.stage.saturating_add(1);
            self.progress = StageProgress::default();
            return;
        }
        let Some(commit) = &self.commit else { return };
        // Implied by the count today (every stage before was complete); kept as a guard.
        if self.pending_writes > 0 {
            return;
        }
        // Everything the source sent has been written: check it covers exactly the committed KV.
        let (kv_tokens, total) = (commit.kv_tokens, commit.blocks_total);
        if let Some((&last, _)) = self.written.last_key_value() {
            if last >= total {
                let msg = format!("block {last} was sent, but Commit has only {total} blocks");
                return self.fail(now, AbortReason::BadFrame(msg), true);
            }
        }
        let missing = total.saturating_sub(self.written.len() as u32);
        if missing > 0 {
            // The final stage is complete, so nothing else can come.
            return self.fail(now, AbortReason::Incomplete { missing }, true);
        }
        let bs = self.params.block_size;
        if let Some((&index, &tokens)) = self.written.iter().find(|(&i, &t)| t != block_tokens(i, kv_tokens, bs)) {
            let expected = block_tokens(index, kv_tokens, bs);
            let msg = format!("block {index} holds {tokens} tokens, Commit of {kv_tokens} tokens implies {expected}");
            return self.fail(now, AbortReason::BadFrame(msg), true);
        }
        let state = commit.state.clone();
        self.state = State::Attaching;
        self.deadline = None;
        self.actions.push_back(TargetAction::Attach { state, kv_tokens, blocks: total });
    }

    /// Answers the `Prepare` with a refusal and ends.
    fn refuse(&mut self, now: Timestamp, reason: AbortReason) {
        // The source names a refusal as one ("refused by the target: <why>"): the why alone.
        let why = match &reason {
            AbortReason::Refused(why) => why.clone(),
            other => other.to_string(),
        };
        self.send(Body::PrepareReply(wire::PrepareReply {
            migration_id: self.id.0,
            ok: false,
            reason: why,
            cached_blocks: 0,
        }));
        self.finish(now, Outcome::Aborted(reason));
    }

    /// Aborts before the commit point: tells the source if `notify_peer`, frees the reservation.
    fn fail(&mut self, now: Timestamp, reason: AbortReason, notify_peer: bool) {
        if !matches!(self.state, State::Reserving | State::Receiving) {
            return;
        }
        if notify_peer {
            self.actions.push_back(TargetAction::Send(abort_frame(self.id, &reason)));
        }
        self.release();
        self.finish(now, Outcome::Aborted(reason));
    }

    fn release(&mut self) {
        if self.reserved {
            self.reserved = false;
            self.actions.push_back(TargetAction::Release);
        }
    }

    fn finish(&mut self, now: Timestamp, outcome: Outcome) {
        if self.state == State::Done {
            return;
        }
        self.state = State::Done;
        self.report.finished_at = Some(now);
        self.report.outcome = Some(outcome.clone());
        self.actions.push_back(TargetAction::Done(outcome));
    }

    fn send(&mut self, body: Body) {
        self.actions.push_back(TargetAction::Send(frame(body)));
    }
}
