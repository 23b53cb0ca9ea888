//! One live KV migration in virtual time: the real [`SourceMachine`] / [`TargetMachine`] of
//! `kvfleet_netmodel::migration`, executed against two [`Engine`]s over the simulator's [`Fabric`].
//!
//! The emulator's worker (`worker/src/migrate.rs`) runs the same machines over QUIC; this driver
//! is its virtual-time twin, so `kvfleet sim` gets pipelined live stages, stop-and-copy downtime,
//! the `MigrationParams` knobs (`stop_copy_blocks`, `max_stages`, `stop_copy_after`, `timeout`) and
//! aborts, with the protocol's own decisions rather than a model of them.
//!
//! [`LiveMigration`] is sans-IO like the machines: it owns neither the engines nor the fabric. Each
//! method takes `now`, the two engines ([`Engines`]) and `&mut Fabric`, and the caller's event loop
//! feeds it what happened (a transfer completed, the source's iteration ended, a deadline passed).
//!
//! # What maps to what
//!
//! | protocol | simulator | why |
//! |---|---|---|
//! | control frame (Prepare, PrepareReply, StageEnd, StageAck, Commit, CommitReply, Abort) | one fabric transfer of [`frame_len`] bytes (protobuf + the transport's 4-byte header), delivered to the peer machine when it completes | pays the one-way latency and shares the NICs like any transfer |
//! | the ordered control stream of each direction | frames are delivered in send order (one that completes early waits for those before it) | transfers of different sizes may finish out of order; a stream may not |
//! | `CopyBlocks { blocks }` (the `BlockData` frames of one stage) | **one** fabric transfer of `blocks × block_bytes` (the engine's real block size; whole blocks, the partial last one too, as the emulator sends); when it completes every `BlockData` of the stage reaches the target, then `on_blocks_sent` | the worker's data streams share one QUIC connection (one congestion-controlled flow), so one flow per stage contends fairly with other migrations; the target acks only a whole stage and writes are instant here, so per-block delivery would change no time. Frame headers (~30 B per MiB-sized block) are ignored |
//! | `on_blocks_sent` | when the stage's transfer completes | StageEnd/Commit follow the data; the source stays in StopAndCopy (not Committing) while the final blocks are on the wire, so a timeout then aborts cleanly as in the worker. Costs one extra latency per stage |
//! | `BlockData.data` / checksum | a few bytes per block ([`STAND_IN_BLOCK_BYTES`]: the machines' `block_bytes`; a layer-group slice carries its share), checksummed like any block | the target machine checks the length and xxh3 of every block, so that path runs; hashing the real 4 MiB per block would cost more CPU than the rest of a run. The fabric carries the real bytes; the record's byte counts are converted back |
//! | source `Pause` | [`Engine::begin_migration_out`] at the end of the source's iteration in flight ([`LiveMigration::on_source_iteration_end`]), at once if none is | the engine refuses to freeze a request mid-iteration, as the worker's engine thread does |
//! | `on_paused(kv_final, state)` | `kv_final` from `begin_migration_out`; `state` empty: the [`MigratedRequest`] travels out of band (kept by the driver) | the engines share a process; nothing needs serialising |
//! | KV progress (`on_kv_progress`) | the token count of the request's KV table at each source iteration end (it trails the request by at most a block) | while live, only full blocks are copied; they never change again |
//! | target `Reserve` | [`Engine::reserve_incoming_with_headroom`] (+[`RESERVE_HEADROOM_BLOCKS`]); no room → the `Prepare` is refused | as the worker's engine thread |
//! | target `WriteBlock` | written at once (`on_written`), growing the reservation first when the request grew on the source | as the worker; an engine out of room → `on_write_failed(TargetOutOfMemory)` |
//! | target `Attach` (the commit point) | [`Engine::attach`] of the out-of-band [`MigratedRequest`]; the source stays frozen | the request runs on the target from here |
//! | target `Release` | [`Engine::release_reservation`] | |
//! | source `Done(Committed)` | [`Engine::finish_migration_out`]: the source frees its copy only now | as the real protocol |
//! | source `Done(Aborted)` | [`Engine::abort_migration_out`] if it was paused | the request carries on at the source |
//! | source `Done(Unknown)` | resolved at once, the sim being its own coordinator: the target is fenced (disconnected: one that has not attached aborts), then the source frees its copy if the target attached, else resumes | the emulator's coordinator does the same with a compare-and-set |
//! | deadlines | [`LiveMigration::next_timeout`] / [`LiveMigration::on_timeout`] | |
//!
//! Both engines must have the same KV geometry (block size and bytes per token), as every instance
//! of a simulated cluster does; a differing block size is refused by the target machine.
//!
//! # How a cluster loop drives this
//!
//! `crate::cluster` is the driver; in short:
//!
//! - start it between the source's `complete_iteration` and its next `plan_iteration` (at a phase
//!   boundary), then map [`LiveMigration::take_new_transfers`] to it;
//! - when the fabric completes a transfer, hand it to its migration
//!   ([`LiveMigration::on_transfer_complete`]); a transfer of a finished migration means nothing;
//! - after each `complete_iteration` of a source, before planning it again, call
//!   [`LiveMigration::on_source_iteration_end`] on the migrations out of it;
//! - at [`LiveMigration::next_timeout`], call [`LiveMigration::on_timeout`];
//! - after every call: map new transfers, re-arm the fabric and the timeout, let both instances plan
//!   again when [`LiveMigration::take_engines_changed`] says a reservation, freeze, attach or abort
//!   changed them, and once [`LiveMigration::take_record`] returns the record, both sides are
//!   done: drop the driver.
//!
//! [`pair`] is the smallest such loop: two engines and a fabric. Its [`simulate_one`] migrates one
//! decoding request between two idle instances, what `kvfleet bench migration` measures for real.

use kvfleet_core::engine::{Engine, EngineError, MigratedRequest, PrefillInFlight};
use kvfleet_core::kv::prompt_block_hashes;
use kvfleet_core::metrics::{MigrationOutcome, MigrationRecord};
use kvfleet_core::{InstanceId, RequestId, Timestamp};
use kvfleet_netmodel::migration::wire::{frame::Body, BlockData, Frame};
use kvfleet_netmodel::migration::{
    block_tokens, checksum, slice_bytes, slice_frame_head, AbortReason, MigrationId, MigrationParams, MigrationReport,
    Outcome, ParamsError, Slices, SourceAction, SourceMachine, TargetAction, TargetMachine, LAYER_GROUPS,
};
use kvfleet_netmodel::{Fabric, Payload, TransferId};
use prost::Message as _;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

/// Blocks a reservation takes beyond the KV announced by `Prepare`, where the target has room:
/// the request keeps decoding on the source during the copy. The worker's value (its engine
/// thread's `RESERVE_HEADROOM_BLOCKS`), so both grow reservations alike.
pub const RESERVE_HEADROOM_BLOCKS: u32 = 4;

/// The transport's length prefix in front of every frame (`kvfleet-transport`: `u32` big-endian).
pub const FRAME_HEADER_BYTES: u64 = 4;

/// The machines' `block_bytes`: each block's `BlockData` carries this many bytes standing for the
/// block (module doc), one per layer group so that a slice of a block has its share. Their byte
/// counts are converted back to real bytes in the record.
pub const STAND_IN_BLOCK_BYTES: u64 = LAYER_GROUPS as u64;

/// The two engines of one migration, borrowed for one call.
pub struct Engines<'a> {
    /// The instance the request migrates from.
    pub source: &'a mut Engine,
    /// The instance it migrates to.
    pub target: &'a mut Engine,
}

impl<'a> Engines<'a> {
    /// `engines[from]` and `engines[to]` of a cluster; `None` if they are the same or out of range.
    pub fn pick(engines: &'a mut [Engine], from: InstanceId, to: InstanceId) -> Option<Engines<'a>> {
        let (f, t) = (from.0 as usize, to.0 as usize);
        if f == t || f >= engines.len() || t >= engines.len() {
            return None;
        }
        let (source, target) = if f < t {
            let (a, b) = engines.split_at_mut(t);
            (&mut a[f], &mut b[0])
        } else {
            let (a, b) = engines.split_at_mut(f);
            (&mut b[0], &mut a[t])
        };
        Some(Engines { source, target })
    }
}

/// What to migrate, where, and how.
#[derive(Clone, Debug)]
pub struct LiveMigrationSpec {
    /// The migration's id (carried by every frame).
    pub id: MigrationId,
    /// The request to migrate.
    pub request: RequestId,
    /// Its source instance.
    pub from: InstanceId,
    /// Its target instance.
    pub to: InstanceId,
    /// The protocol's knobs. `block_size` / `block_bytes` are ignored: the engines' geometry
    /// decides them (module doc).
    pub params: MigrationParams,
    /// Blocks the target reserves beyond the KV announced by `Prepare`, where it has room.
    pub reserve_headroom_blocks: u32,
    /// A migration following a prefill sends each block in this many layer groups as the
    /// iteration computing it goes (`[pd] overlap = "layer"`); 1: whole blocks.
    pub layer_groups: u32,
    /// A fault: every block arrives with bytes that do not hash to the source's checksum (the
    /// target aborts at the first; `[migration] corrupt_sends_from`).
    pub corrupt: bool,
}

impl LiveMigrationSpec {
    /// A spec with the worker's reservation headroom ([`RESERVE_HEADROOM_BLOCKS`]).
    pub fn new(id: MigrationId, request: RequestId, from: InstanceId, to: InstanceId, params: MigrationParams) -> Self {
        LiveMigrationSpec {
            id,
            request,
            from,
            to,
            params,
            reserve_headroom_blocks: RESERVE_HEADROOM_BLOCKS,
            layer_groups: 1,
            corrupt: false,
        }
    }
}

/// Why a migration could not start (nothing was changed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StartError {
    /// The migration parameters are invalid.
    #[error(transparent)]
    Params(#[from] ParamsError),
    /// The engines passed are not the spec's source and target.
    #[error("the engines are instances {source_instance} → {target_instance}, the spec says {from} → {to}")]
    WrongEngines {
        /// The spec's source.
        from: InstanceId,
        /// The spec's target.
        to: InstanceId,
        /// The source engine passed.
        source_instance: InstanceId,
        /// The target engine passed.
        target_instance: InstanceId,
    },
    /// The request is not on the source instance.
    #[error("{0} is not on the source instance")]
    NotOnSource(RequestId),
    /// The request already has a migration in progress.
    #[error("{0} is already migrating out")]
    AlreadyMigrating(RequestId),
    /// The request holds no KV on the source (not prefilled yet, or preempted and dropped).
    #[error("{0} holds no KV on the source (not prefilled yet, or preempted and dropped)")]
    NoKv(RequestId),
}

/// What a transfer in flight carries.
#[derive(Debug)]
enum Carried {
    Control { to_target: bool, seq: u64, frame: Frame },
    Blocks { stage: u32, blocks: Range<u32>, slices: Option<Slices>, kv_tokens: u32 },
}

/// One direction's ordered control stream.
#[derive(Debug, Default)]
struct ControlStream {
    next_seq: u64,
    next_delivery: u64,
    /// Frames whose transfer completed, waiting for an earlier one.
    arrived: BTreeMap<u64, Frame>,
}

impl ControlStream {
    fn next_ready(&mut self) -> Option<Frame> {
        let f = self.arrived.remove(&self.next_delivery)?;
        self.next_delivery += 1;
        Some(f)
    }
}

/// The driver of one live migration (see the module documentation).
#[derive(Debug)]
pub struct LiveMigration {
    spec: LiveMigrationSpec,
    /// The engines' real bytes per block (the machines count [`STAND_IN_BLOCK_BYTES`]).
    block_bytes: u64,
    source: SourceMachine,
    /// Created when the `Prepare` reaches the target.
    target: Option<TargetMachine>,
    inflight: HashMap<TransferId, Carried>,
    new_transfers: Vec<TransferId>,
    to_target: ControlStream,
    to_source: ControlStream,
    /// `Pause` was asked while the source's iteration was in flight.
    pause_pending: bool,
    /// The frozen request's state, handed to the target at `Attach` (the Commit's `state`).
    snapshot: Option<MigratedRequest>,
    /// The target engine holds our reservation (`Reserve` succeeded, no `Release`/attach since).
    reserved: bool,
    /// An engine call changed what an instance holds or runs since the last
    /// [`LiveMigration::take_engines_changed`].
    engines_changed: bool,
    paused_at: Option<Timestamp>,
    resumed_at: Option<Timestamp>,
    in_doubt: bool,
    /// The source's settled outcome (engine calls done).
    outcome: Option<Outcome>,
    record: Option<MigrationRecord>,
    stand_in: Payload,
    stand_in_checksum: u64,
    /// Following a prefill in layer groups: the source's iteration computing a chunk of it, and
    /// the groups of that iteration reported to the source machine so far.
    layers: Option<(PrefillInFlight, u32)>,
}

impl LiveMigration {
    /// Start migrating `spec.request` from `engines.source` to `engines.target`: the `Prepare`
    /// goes on the fabric. Call it between the source's `complete_iteration` and its next
    /// `plan_iteration` (its KV table then holds exactly its final tokens; mid-iteration it holds
    /// one more, the token being computed, which only sizes the reservation).
    pub fn start(
        now: Timestamp,
        spec: LiveMigrationSpec,
        mut engines: Engines<'_>,
        fabric: &mut Fabric,
    ) -> Result<LiveMigration, StartError> {
        let (src, dst) = (engines.source.instance(), engines.target.instance());
        if (src, dst) != (spec.from, spec.to) {
            let (from, to) = (spec.from, spec.to);
            return Err(StartError::WrongEngines { from, to, source_instance: src, target_instance: dst });
        }
        let request = spec.request;
        if !engines.source.contains(request) {
            return Err(StartError::NotOnSource(request));
        }
        if engines.source.is_migrating_out(request) {
            return Err(StartError::AlreadyMigrating(request));
        }
        let table_tokens = engines.source.kv().table(request).map_or(0, |t| t.tokens);
        // A request whose prefill still runs (a handoff overlapped with it): the migration
        // follows the prefill, copying what it has written; its table holds the whole prompt.
        let written = engines.source.prompt_written(request);
        let kv_tokens = written.unwrap_or(table_tokens);
        if table_tokens == 0 {
            return Err(StartError::NoKv(request));
        }
        let geometry = |params: &MigrationParams, e: &Engine| MigrationParams {
            block_size: e.config().block_size,
            block_bytes: STAND_IN_BLOCK_BYTES,
            ..params.clone()
        };
        let source_params = geometry(&spec.params, engines.source);
        // The content hashes of its full prompt blocks: a target caching some is not sent those.
        let bs = engines.source.config().block_size;
        let prefix = engines
            .source
            .spec(request)
            .map_or_else(Vec::new, |s| prompt_block_hashes(&s.content_ids, s.prompt_tokens, bs));
        let mut source = SourceMachine::new(spec.id, request, source_params, now, kv_tokens)?
            .with_source_instance(spec.from.0)
            .with_prefix(prefix);
        if written.is_some() {
            source = source.following_prefill(table_tokens).in_layer_groups(spec.layer_groups);
        }
        let stand_in = Payload::from(vec![0u8; STAND_IN_BLOCK_BYTES as usize]);
        let mut m = LiveMigration {
            block_bytes: engines.source.config().block_bytes(),
            source,
            target: None,
            inflight: HashMap::new(),
            new_transfers: Vec::new(),
            to_target: ControlStream::default(),
            to_source: ControlStream::default(),
            pause_pending: false,
            snapshot: None,
            reserved: false,
            engines_changed: false,
            paused_at: None,
            resumed_at: None,
            in_doubt: false,
            outcome: None,
            record: None,
            stand_in_checksum: checksum(&stand_in.to_bytes()),
            stand_in,
            layers: None,
            spec: LiveMigrationSpec { params: geometry(&spec.params, engines.target), ..spec },
        };
        m.source.start(now);
        m.pump(now, &mut engines, fabric);
        m.on_source_iteration_planned(now, engines, fabric);
        Ok(m)
    }

    /// The source planned an iteration (or the migration started during one): following a
    /// prefill in layer groups, the layer groups of a chunk of it that iteration computes are
    /// reported to the source machine as the iteration reaches them ([`LiveMigration::next_timeout`]).
    pub fn on_source_iteration_planned(&mut self, now: Timestamp, mut engines: Engines<'_>, fabric: &mut Fabric) {
        if self.spec.layer_groups <= 1 || self.source.is_done() {
            return;
        }
        self.layers = engines.source.prefill_in_flight(self.spec.request).map(|f| (f, 0));
        self.report_layers(now, &mut engines, fabric);
    }

    /// Reports the layer groups the source's iteration in flight has computed by `now` (its last
    /// group comes with the iteration's end, [`LiveMigration::on_source_iteration_end`]).
    fn report_layers(&mut self, now: Timestamp, e: &mut Engines<'_>, fabric: &mut Fabric) {
        let g = self.spec.layer_groups;
        let Some((f, reported)) = self.layers.as_mut() else { return };
        let done = f.groups_done(now, g).min(g - 1);
        if done > *reported {
            *reported = done;
            let tokens = f.tokens;
            self.source.on_layer_progress(now, tokens, done);
            self.pump(now, e, fabric);
        }
    }

    /// The migration's id.
    pub fn id(&self) -> MigrationId {
        self.spec.id
    }
    /// The request being migrated.
    pub fn request(&self) -> RequestId {
        self.spec.request
    }
    /// The source instance.
    pub fn from(&self) -> InstanceId {
        self.spec.from
    }
    /// The target instance.
    pub fn to(&self) -> InstanceId {
        self.spec.to
    }
    /// The record once both sides are done, once (the caller then drops the driver).
    pub fn take_record(&mut self) -> Option<MigrationRecord> {
        self.record.take()
    }
    /// The source machine's own report so far, its byte counts in real bytes: its stages with
    /// their timestamps, and its `downtime`, which ends at the `CommitReply` as the emulator's
    /// does (the record's ends when the request runs again, one latency earlier).
    pub fn source_report(&self) -> MigrationReport {
        in_real_bytes(self.source.report().clone(), self.block_bytes)
    }

    /// Fabric transfers started since the last call: map them to this migration, and re-arm the
    /// fabric's wake-up (`Fabric::next_completion`).
    pub fn take_new_transfers(&mut self) -> Vec<TransferId> {
        std::mem::take(&mut self.new_transfers)
    }

    /// Whether either engine changed (reservation, pause, attach, resume, release) since the last
    /// call: the driver then lets both plan again and republishes their loads.
    pub fn take_engines_changed(&mut self) -> bool {
        std::mem::take(&mut self.engines_changed)
    }

    /// When to call [`LiveMigration::on_timeout`] (`None` when neither side waits on a deadline).
    pub fn next_timeout(&self) -> Option<Timestamp> {
        let target = self.target.as_ref().and_then(|t| t.poll_timeout());
        let g = self.spec.layer_groups;
        // The next layer group the source's iteration in flight computes.
        let layer = self.layers.filter(|&(_, reported)| reported + 1 < g).map(|(f, r)| f.group_done_at(r + 1, g));
        [self.source.poll_timeout(), target, layer].into_iter().flatten().min()
    }

    /// A fabric transfer completed. Returns false if it is not this migration's (nothing done).
    pub fn on_transfer_complete(
        &mut self,
        now: Timestamp,
        id: TransferId,
        mut engines: Engines<'_>,
        fabric: &mut Fabric,
    ) -> bool {
        let Some(carried) = self.inflight.remove(&id) else { return false };
        let e = &mut engines;
        match carried {
            Carried::Control { to_target: true, seq, frame } => {
                self.to_target.arrived.insert(seq, frame);
                while let Some(f) = self.to_target.next_ready() {
                    match self.target.as_mut() {
                        Some(t) => t.on_frame(now, f),
                        None => match TargetMachine::accept(now, &self.spec.params, f) {
                            Ok(t) => self.target = Some(t),
                            // Not a Prepare: the answer a real target gives to an unknown migration.
                            Err(abort) => self.send(now, false, *abort, fabric),
                        },
                    }
                    self.pump(now, e, fabric);
                }
            }
            Carried::Control { to_target: false, seq, frame } => {
                self.to_source.arrived.insert(seq, frame);
                while let Some(f) = self.to_source.next_ready() {
                    self.source.on_frame(now, f);
                    self.pump(now, e, fabric);
                }
            }
            Carried::Blocks { stage, blocks, slices, kv_tokens } => {
                let bs = self.spec.params.block_size;
                let g = self.spec.layer_groups;
                let sliced = slices.iter().flat_map(|s| s.blocks.clone().map(|i| (i, Some(s.groups.clone()))));
                for (index, groups) in sliced.chain(blocks.map(|i| (i, None))) {
                    let Some(t) = self.target.as_mut() else { break };
                    let (data, head) = match groups {
                        Some(groups) => {
                            let r = slice_bytes(STAND_IN_BLOCK_BYTES, g, groups.clone());
                            let data = self.stand_in.to_bytes().slice(r.start as usize..r.end as usize);
                            let head = slice_frame_head(self.spec.id, stage, index, bs, groups, &data);
                            (Payload::from(data), head)
                        }
                        None => {
                            let head = BlockData {
                                migration_id: self.spec.id.0,
                                stage,
                                index,
                                tokens: block_tokens(index, kv_tokens, bs),
                                checksum: self.stand_in_checksum,
                                ..Default::default()
                            };
                            (self.stand_in.clone(), head)
                        }
                    };
                    t.on_frame_with_payload(now, Frame { body: Some(Body::BlockData(head)) }, Some(data));
                    self.pump(now, e, fabric);
                }
                self.source.on_blocks_sent(now, stage);
                self.pump(now, e, fabric);
            }
        }
        true
    }

    /// The source engine completed an iteration at `now`. Call it right after its
    /// `complete_iteration` and before its next `plan_iteration`, for every migration out of it
    /// (cheap when nothing is due): it reports the request's KV progress, performs a pending
    /// pause, and cancels the migration if the request finished meanwhile.
    pub fn on_source_iteration_end(&mut self, now: Timestamp, mut engines: Engines<'_>, fabric: &mut Fabric) {
        let request = self.spec.request;
        if self.pause_pending && engines.source.is_held(request) {
            // A followed prefill ended: its pause first, so that the blocks its last iteration
            // filled go in the final stage (as the worker's engine thread answers the pause it
            // holds before the wait for more KV).
            self.pause(now, &mut engines);
        }
        if !self.source.is_done() {
            if !engines.source.contains(request) {
                self.source.cancel(now, format!("{request} left the source (finished) during the copy"));
            } else if let Some(t) = engines.source.kv().table(request) {
                // The table's token count trails the request by up to a block (the engine grows
                // it only when a block fills): its full blocks are at most one short, which then
                // go in the next stage. During its prefill, what the chunks so far computed.
                let written = engines.source.prompt_written(request);
                self.source.on_kv_progress(now, written.unwrap_or(t.tokens));
            }
        }
        // The iteration's last layer group came with its end.
        self.layers = None;
        if self.pause_pending {
            self.pause(now, &mut engines);
        }
        self.pump(now, &mut engines, fabric);
    }

    /// Deadlines from [`LiveMigration::next_timeout`] may have passed (early calls do nothing).
    pub fn on_timeout(&mut self, now: Timestamp, mut engines: Engines<'_>, fabric: &mut Fabric) {
        self.report_layers(now, &mut engines, fabric);
        self.source.on_timeout(now);
        if let Some(t) = self.target.as_mut() {
            t.on_timeout(now);
        }
        self.pump(now, &mut engines, fabric);
    }

    // ------------------------------------------------------------------ internals

    /// Execute every action both machines want, until neither wants any; then write the record
    /// if both are done.
    fn pump(&mut self, now: Timestamp, e: &mut Engines<'_>, fabric: &mut Fabric) {
        loop {
            let mut acted = false;
            while let Some(a) = self.source.poll_action() {
                acted = true;
                self.exec_source(now, a, e, fabric);
            }
            while let Some(a) = self.target.as_mut().and_then(|t| t.poll_action()) {
                acted = true;
                self.exec_target(now, a, e, fabric);
            }
            if !acted {
                break;
            }
        }
        self.maybe_finish();
    }

    fn send(&mut self, now: Timestamp, to_target: bool, frame: Frame, fabric: &mut Fabric) {
        let (src, dst) = if to_target { (self.spec.from, self.spec.to) } else { (self.spec.to, self.spec.from) };
        let stream = if to_target { &mut self.to_target } else { &mut self.to_source };
        let seq = stream.next_seq;
        stream.next_seq += 1;
        let id = fabric.start(now, src, dst, frame_len(&frame));
        self.inflight.insert(id, Carried::Control { to_target, seq, frame });
        self.new_transfers.push(id);
    }

    fn exec_source(&mut self, now: Timestamp, action: SourceAction, e: &mut Engines<'_>, fabric: &mut Fabric) {
        let request = self.spec.request;
        match action {
            SourceAction::Send(frame) => self.send(now, true, frame, fabric),
            SourceAction::CopyBlocks { stage, blocks, slices, kv_tokens, .. } => {
                // The worker reads each block from the arena; here, the blocks must exist: a
                // request preempted and dropped since holds no KV to read.
                let have = e.source.kv().table(request).map_or(0, |t| t.blocks.len() as u32);
                let upto = slices.as_ref().map_or(blocks.end, |s| s.blocks.end.max(blocks.end));
                if have < upto {
                    let msg = format!("{request} holds {have} KV blocks, stage {stage} copies up to {upto}");
                    self.source.on_read_failed(now, msg);
                    return;
                }
                let mut bytes = u64::from(blocks.end - blocks.start) * self.block_bytes;
                if let Some(s) = &slices {
                    let r = slice_bytes(self.block_bytes, self.spec.layer_groups, s.groups.clone());
                    bytes += u64::from(s.blocks.end - s.blocks.start) * (r.end - r.start);
                }
                let id = fabric.start(now, self.spec.from, self.spec.to, bytes);
                self.inflight.insert(id, Carried::Blocks { stage, blocks, slices, kv_tokens });
                self.new_transfers.push(id);
            }
            SourceAction::Pause => {
                self.pause_pending = true;
                self.pause(now, e);
            }
            SourceAction::Done(outcome) => self.settle_source(now, outcome, e),
        }
    }

    /// Freeze the request if the pause is still wanted and no iteration is in flight (else
    /// [`LiveMigration::on_source_iteration_end`] comes back here).
    fn pause(&mut self, now: Timestamp, e: &mut Engines<'_>) {
        if !self.source.pause_wanted() {
            self.pause_pending = false;
            return;
        }
        let request = self.spec.request;
        // A request held after its prefill runs in no iteration: it pauses at once. One whose
        // prefill still runs (a migration following it) pauses at its end, when it is held.
        if (e.source.next_wake().is_some() && !e.source.is_held(request)) || e.source.prompt_written(request).is_some()
        {
            return;
        }
        self.pause_pending = false;
        if !e.source.contains(request) {
            self.source.cancel(now, format!("{request} left the source before the pause"));
            return;
        }
        if e.source.kv().table(request).is_none() {
            self.source.on_read_failed(now, format!("{request} holds no KV (preempted and dropped)"));
            return;
        }
        self.engines_changed = true;
        let out = match e.source.begin_migration_out(request) {
            Ok(out) => out,
            Err(err) => return self.source.on_read_failed(now, err.to_string()),
        };
        match e.source.migration_state(request) {
            Ok(state) => {
                self.snapshot = Some(state);
                self.paused_at = Some(now);
                // The state travels out of band (`snapshot`): the Commit carries no bytes of it.
                self.source.on_paused(now, out.kv_tokens, Vec::new());
            }
            Err(err) => {
                let _ = e.source.abort_migration_out(request);
                self.source.on_read_failed(now, err.to_string());
            }
        }
    }

    /// The source machine is done: apply its outcome to the source engine.
    fn settle_source(&mut self, now: Timestamp, outcome: Outcome, e: &mut Engines<'_>) {
        let request = self.spec.request;
        self.pause_pending = false;
        self.engines_changed = true;
        let settled = match outcome {
            Outcome::Unknown(r) => {
                // The sim is its own coordinator: fence the target (one that has not attached
                // aborts and releases), then follow whatever it did.
                self.in_doubt = true;
                if let Some(t) = self.target.as_mut() {
                    t.on_disconnect(now);
                }
                match self.target.as_ref().and_then(|t| t.outcome()) {
                    Some(Outcome::Committed) => Outcome::Committed,
                    _ => Outcome::Aborted(r),
                }
            }
            settled => settled,
        };
        if settled == Outcome::Committed {
            // The target runs it: free the source's frozen copy (its state went out of band).
            let _ = e.source.finish_migration_out(request);
        } else if e.source.is_migrating_out(request) && e.source.abort_migration_out(request).is_ok() {
            self.resumed_at = Some(now);
        }
        self.outcome = Some(settled);
    }

    fn exec_target(&mut self, now: Timestamp, action: TargetAction, e: &mut Engines<'_>, fabric: &mut Fabric) {
        let request = self.spec.request;
        let no_room = |err: EngineError| match err {
            EngineError::NoRoom { .. } | EngineError::TooLarge { .. } => {
                AbortReason::TargetOutOfMemory(err.to_string())
            }
            other => AbortReason::Refused(other.to_string()),
        };
        self.engines_changed |= matches!(action, TargetAction::Reserve { .. } | TargetAction::Attach { .. });
        match action {
            TargetAction::Send(frame) => self.send(now, false, frame, fabric),
            TargetAction::Reserve { request: r, kv_tokens, prefix, .. } => {
                let result = if e.target.reserved_requests().any(|x| x == r) {
                    // Two migrations must not share a reservation: the first's abort would free
                    // the blocks the second writes.
                    Err(AbortReason::Refused(format!("another migration of {r} is already coming in")))
                } else {
                    let headroom = self.spec.reserve_headroom_blocks.saturating_mul(self.spec.params.block_size);
                    e.target.reserve_incoming_prefixed(r, kv_tokens, headroom, &prefix).map_err(no_room)
                };
                self.reserved = result.is_ok();
                if let Some(t) = self.target.as_mut() {
                    t.on_reserved_prefix(now, result);
                }
            }
            TargetAction::WriteBlock { index, .. } => {
                let bs = self.spec.params.block_size;
                let blocks = e.target.kv().table(request).map_or(0, |t| t.blocks.len() as u32);
                // The request grew on the source since the Prepare: grow the reservation first.
                let grown = if index >= blocks {
                    self.engines_changed = true;
                    e.target.reserve_incoming(request, index.saturating_add(1).saturating_mul(bs)).map(|_| ())
                } else {
                    Ok(())
                };
                if let Some(t) = self.target.as_mut() {
                    match grown {
                        Ok(()) if self.spec.corrupt => {
                            t.on_write_failed(now, AbortReason::ChecksumMismatch { block: index })
                        }
                        Ok(()) => t.on_written(now, index),
                        Err(err) => t.on_write_failed(now, AbortReason::TargetOutOfMemory(err.to_string())),
                    }
                }
            }
            TargetAction::Attach { kv_tokens, .. } => {
                let result = match self.snapshot.take() {
                    Some(state) if state.kv_tokens() == kv_tokens => {
                        e.target.attach(now, state).map_err(|err| AbortReason::AttachFailed(err.to_string()))
                    }
                    Some(state) => Err(AbortReason::AttachFailed(format!(
                        "Commit says {kv_tokens} KV tokens, the request holds {}",
                        state.kv_tokens()
                    ))),
                    None => Err(AbortReason::AttachFailed("no request state was handed over".into())),
                };
                if result.is_ok() {
                    // The reservation became the request's KV; the request runs here from now.
                    self.reserved = false;
                    self.resumed_at = Some(now);
                }
                if let Some(t) = self.target.as_mut() {
                    t.on_attached(now, result);
                }
            }
            TargetAction::Release => {
                if std::mem::take(&mut self.reserved) {
                    self.engines_changed = true;
                    e.target.release_reservation(request);
                }
            }
            TargetAction::Done(_) => {}
        }
    }

    /// Write the record once both sides are done (a target that never got the `Prepare` counts
    /// as done once nothing more is on its way to it).
    fn maybe_finish(&mut self) {
        if self.record.is_some() {
            return;
        }
        let Some(outcome) = self.outcome.clone() else { return };
        let target_done = match &self.target {
            Some(t) => t.is_done(),
            None => !self.inflight.values().any(|c| matches!(c, Carried::Control { to_target: true, .. })),
        };
        if !target_done {
            return;
        }
        let report = self.source.report();
        // The machines count stand-in bytes (module doc): back to real bytes.
        let real = |b: u64| real_bytes(b, self.block_bytes);
        // Stages whose blocks went on the wire (one can be begun, then fail reading its blocks).
        let sent: Vec<_> = report.stages.iter().filter(|s| s.sent.is_some()).collect();
        let start = report.started.unwrap_or(report.created);
        let end = report.finished_at.unwrap_or(start);
        self.record = Some(MigrationRecord {
            request: self.spec.request,
            from: self.spec.from,
            to: self.spec.to,
            checksum_mismatch: outcome.checksum_mismatch(),
            outcome: measured(outcome),
            in_doubt: self.in_doubt,
            bytes: real(report.bytes),
            bytes_skipped: real(report.bytes_skipped),
            start,
            end,
            live_stages: report.live_stages(),
            stage_bytes: sent.iter().map(|s| real(s.bytes)).collect(),
            stage_times: sent.iter().map(|s| s.ended.unwrap_or(s.started).saturating_since(s.started)).collect(),
            // Blocks' worth (a block sent in layer-group slices counts once).
            blocks: sent.iter().map(|s| s.bytes).sum::<u64>().div_ceil(STAND_IN_BLOCK_BYTES),
            kv_tokens_start: Some(report.kv_tokens_start),
            kv_tokens_final: report.kv_tokens_final,
            paused_at: self.paused_at,
            resumed_at: self.resumed_at,
            downtime: self.paused_at.zip(self.resumed_at).map(|(p, r)| r.saturating_since(p)),
        });
    }
}

/// A settled outcome as the metrics name it: a refused `Prepare` is `Refused`, any other abort
/// `Aborted` (never `Unknown`: the driver resolves an in-doubt source first).
fn measured(outcome: Outcome) -> MigrationOutcome {
    match outcome {
        Outcome::Committed => MigrationOutcome::Committed,
        Outcome::Aborted(r @ AbortReason::Refused(_)) => MigrationOutcome::Refused(r.to_string()),
        Outcome::Aborted(r) | Outcome::Unknown(r) => MigrationOutcome::Aborted(r.to_string()),
    }
}

/// `report` with its byte counts (kept in [`STAND_IN_BLOCK_BYTES`] per block) in real bytes.
fn in_real_bytes(mut report: MigrationReport, block_bytes: u64) -> MigrationReport {
    report.bytes = real_bytes(report.bytes, block_bytes);
    for s in &mut report.stages {
        s.bytes = real_bytes(s.bytes, block_bytes);
    }
    let scale = block_bytes as f64 / STAND_IN_BLOCK_BYTES as f64;
    report.goodput_bytes_per_s = report.goodput_bytes_per_s.map(|g| g * scale);
    report
}

/// `stand_in` bytes of the machines' blocks ([`STAND_IN_BLOCK_BYTES`] each) in real bytes, for
/// blocks of `block_bytes`.
fn real_bytes(stand_in: u64, block_bytes: u64) -> u64 {
    (u128::from(stand_in) * u128::from(block_bytes) / u128::from(STAND_IN_BLOCK_BYTES)) as u64
}

/// Bytes `frame` takes on a stream: its protobuf encoding plus the transport's
/// [`FRAME_HEADER_BYTES`].
pub fn frame_len(frame: &Frame) -> u64 {
    FRAME_HEADER_BYTES + frame.encoded_len() as u64
}

pub mod pair;
pub use pair::simulate_one;

#[cfg(test)]
mod tests;
