//! Live KV-cache migration as a sans-IO state machine (Llumnix §4.2 and Phasor
//! App. D's pipelined stop-and-copy), in the style of quinn-proto: events in, actions out, time
//! passed in. No clock, no sockets, no tasks: the worker's async driver and the simulator feed the
//! same [`SourceMachine`] and [`TargetMachine`].
//!
//! | item | role |
//! |---|---|
//! | [`SourceMachine`] / [`SourceAction`] | the worker that holds the request and pushes its KV |
//! | [`TargetMachine`] / [`TargetAction`] | the worker that receives it, created on a `Prepare` frame |
//! | [`wire`] | the frames (`kvfleet.migration.v1`, `wire/proto/migration.proto`) |
//! | [`MigrationReport`] / [`TargetReport`] | per-migration measurements (bytes, stages, downtime) |
//!
//! # Protocol
//!
//! ```text
//! source                                             target
//! start ── Prepare ──────────────────────────────────▶ Reserve ─▶ on_reserved
//!       ◀───────────────────────────────── PrepareReply(ok | refused → both Done(Aborted))
//! live stage s (s < max_stages, ≥ stop_copy_blocks new full blocks):
//!   CopyBlocks(sent..full) ─ BlockData×n (data streams) ─▶ verify, WriteBlock ─▶ on_written
//!   on_blocks_sent ─ StageEnd(s, n) (control stream) ──▶ all n written?
//!       ◀──────────────────────────────────────────────── StageAck(s)
//! Pause ─▶ on_paused(kv_final, state)
//! final stage: CopyBlocks(sent..ceil(kv_final/bs)) ─ BlockData×m ─▶ ...
//!   on_blocks_sent ─ StageEnd(final, m), Commit(kv_final, state) ─▶ every block 0..total written?
//!                                                                  ─▶ Attach ─▶ on_attached
//!       ◀──────────────────────────────────────────────── CommitReply(ok)   [commit point]
//! Done(Committed): free the source copy                Done(Committed): the request runs here
//! ```
//!
//! Source states: `Idle → Preparing → (LiveCopy → StageAck)* → Pausing → StopAndCopy →
//! Committing → Done`. Target states: `Reserving → Receiving → Attaching → Done`. Any failure
//! before the commit point ends both in `Done(Aborted)`: the source keeps (resumes) the request,
//! the target releases its reservation; the side that detects it sends `Abort` if the connection
//! still stands. Each machine emits exactly one `Done`, always as its last action.
//!
//! Destination-missing copies: `Prepare` lists the content hashes of the request's leading full
//! prompt blocks; a target whose prefix cache holds the first k of them pins those, reserves the
//! rest and answers `cached_blocks = k`; the source then copies from block k (stage 0 starts at
//! k, and the final stage's range never reaches below it). The target counts 0..k as written and
//! verifies them with the rest at COMMIT.
//!
//! Live stages send only *full* blocks (index < kv_tokens / block_size): KV is append-only, so a
//! full block never changes again and no block is sent twice. The final stage runs while the
//! request is paused and sends the rest, including the partial last block.
//!
//! Following a prefill ([`SourceMachine::following_prefill`], an overlapped prefill/decode
//! handoff), a block may also leave in *layer-group slices* ([`SourceMachine::in_layer_groups`]):
//! `Prepare.layer_groups = G`, and a `BlockData` with `group_first..group_end` carries only those
//! groups' bytes of the block ([`slice_bytes`]: a block's bytes hold its layers in order). As the
//! iteration computing a chunk of the prefill reaches layer group k
//! ([`SourceMachine::on_layer_progress`]), groups up to k of the blocks it fills leave in a live
//! stage; the rest of them once the iteration ends (or in the final stage). Each slice is
//! checksummed alone; the target counts a block written once every group of it is
//! (`TargetAction::WriteBlock::offset` says where a slice lands) and verifies every token at the
//! commit as always. No byte crosses twice.
//!
//! Frame order: `BlockData` frames travel on several parallel data streams, so they may arrive in
//! any order relative to each other and to the control stream. Every other frame travels on the
//! one ordered control stream of its direction. The target therefore acknowledges a stage only
//! once every block the `StageEnd` counts has arrived *and* been written, and acts on `Commit` only
//! once every block `0..blocks_total` has been written. The source starts stage `s + 1` only after
//! `StageAck(s)`, so the target receives blocks of exactly one stage at a time and rejects others.
//!
//! # The commit point and a lost `CommitReply`
//!
//! Two parties over a connection that can break cannot agree on an outcome by themselves (the
//! two generals). The *commit point* is the target's `Attach`: once the target machine emits it,
//! nothing aborts the target any more (frames, timeouts and disconnects are ignored; only a failed
//! attach ends in `Aborted`). Before `Commit` is sent the source alone decides and every failure is
//! a clean `Aborted`. After `Commit` is sent and before `CommitReply` arrives, a failure (disconnect,
//! timeout, a nonsensical frame) leaves the source not knowing whether the target attached: it
//! reports [`Outcome::Unknown`]. The source driver must then keep the request *paused* — neither
//! resume it nor free it — and ask the coordinator, whose request record arbitrates: the target
//! driver records itself as the owner (compare-and-set on the record, from the source) before it
//! resumes an attached request, and a source in doubt resumes only if its own compare-and-set
//! (owner stays the source) wins; a target driver whose compare-and-set loses must drop the
//! attached copy. An `Abort` or `CommitReply { ok: false }` received after `Commit` is still a
//! clean `Aborted`, because a target never sends either once it has attached.
//!
//! # Driver contract
//!
//! Execute actions in the order [`SourceMachine::poll_action`] / [`TargetMachine::poll_action`]
//! return them (a `Release` after a `Reserve` or `WriteBlock` refers to what those did). Events
//! that do not fit the current state (a late `on_written`, `on_paused` after `Done`) are ignored.
//! Call `on_timeout` when `poll_timeout` is reached; early calls do nothing.

mod source;
mod target;

#[cfg(test)]
mod harness;
#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;

pub use kvfleet_wire::migration as wire;
pub use source::{Slices, SourceAction, SourceMachine};
pub use target::{TargetAction, TargetMachine, TargetReport};

use bytes::Bytes;
use kvfleet_core::{RequestId, TimeSpan, Timestamp};
use serde::{Deserialize, Serialize};
use std::fmt;
use wire::frame::Body;
use wire::Frame;

/// Largest block the protocol accepts (a guard against absurd configurations and frames).
pub const MAX_BLOCK_BYTES: u64 = 1 << 30;

/// Most layer groups a block may be sent in (`Prepare.layer_groups`).
pub const MAX_LAYER_GROUPS: u32 = 64;

/// Layer groups a handoff that follows a prefill layer by layer sends each block in
/// (`[pd] overlap = "layer"`; ours): a quarter of the model's layers at a time.
pub const LAYER_GROUPS: u32 = 4;

/// The bytes of a block of `block_bytes` that layer groups `groups` (of `layer_groups`) occupy:
/// `[block_bytes × first / G, block_bytes × end / G)`. A block's bytes hold its layers in order, so
/// a group's are one range; the ranges of all groups tile the block.
pub fn slice_bytes(block_bytes: u64, layer_groups: u32, groups: std::ops::Range<u32>) -> std::ops::Range<u64> {
    let g = u128::from(layer_groups.max(1));
    let at = |k: u32| (u128::from(block_bytes) * u128::from(k.min(layer_groups.max(1))) / g) as u64;
    at(groups.start)..at(groups.end)
}

/// Tuning of one migration; the same on both sides (the target checks `block_size` and
/// `block_bytes` against the source's `Prepare`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MigrationParams {
    /// Stop live copying and pause once fewer than this many new full blocks remain (default 16:
    /// ~5 ms of copying at 100 Gbit/s with 4 MiB blocks).
    pub stop_copy_blocks: u32,
    /// Most live copy stages before the stop-and-copy stage (default 3, so a request that decodes
    /// faster than the link copies still pauses). 0 = pure stop-and-copy.
    pub max_stages: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Bytes per KV block (`block_size` × KV bytes per token).
    pub block_bytes: u64,
    /// Deadline of the whole migration, counted from `start` (source) or the `Prepare` (target);
    /// it bounds every wait, and a timeout names the phase that was waiting.
    pub timeout: TimeSpan,
    /// Time-based stop-and-copy: once a live stage has measured the link, pause as soon as the
    /// new blocks would take at most this long to copy at that stage's goodput, and keep copying
    /// live while they would take longer (still at most `max_stages`). `stop_copy_blocks` then
    /// only decides before the first stage. The block count's right value depends on the link
    /// (16 blocks are ~5 ms at 100 Gbit/s, ~150 ms at 3.5); a downtime budget does not.
    pub stop_copy_after: Option<TimeSpan>,
}

impl Default for MigrationParams {
    /// 16-token blocks of 4 MiB (256 KiB of KV per token: R1-Distill-Qwen-32B in bf16).
    fn default() -> Self {
        MigrationParams::new(16, 16 * 256 * 1024)
    }
}

impl MigrationParams {
    /// The default tuning (stop below 16 blocks, at most 3 live stages, a 10 s deadline) for the
    /// given geometry.
    pub fn new(block_size: u32, block_bytes: u64) -> Self {
        MigrationParams {
            stop_copy_blocks: 16,
            max_stages: 3,
            block_size,
            block_bytes,
            timeout: TimeSpan::from_secs_f64(10.0),
            stop_copy_after: None,
        }
    }

    /// Whether to pause for the stop-and-copy after `live_stages_done` live stages with
    /// `remaining` new full blocks, the last live stage having moved `last_stage_bytes_per_s`.
    pub fn stop_copy_now(&self, live_stages_done: u32, remaining: u32, last_stage_bytes_per_s: Option<f64>) -> bool {
        if live_stages_done >= self.max_stages || remaining == 0 {
            return true;
        }
        match (self.stop_copy_after, last_stage_bytes_per_s) {
            (Some(budget), Some(rate)) if rate > 0.0 => {
                remaining as f64 * self.block_bytes as f64 / rate <= budget.as_secs_f64()
            }
            _ => remaining < self.stop_copy_blocks,
        }
    }

    /// `block_size` ≥ 1, `block_bytes` in 1..=[`MAX_BLOCK_BYTES`], `timeout` > 0.
    pub fn validate(&self) -> Result<(), ParamsError> {
        let invalid = |field, value, reason| Err(ParamsError::Invalid { field, value, reason });
        if self.block_size == 0 {
            return invalid("block_size", 0, "must be at least 1");
        }
        if self.block_bytes == 0 || self.block_bytes > MAX_BLOCK_BYTES {
            return invalid("block_bytes", self.block_bytes, "must be between 1 and 2^30");
        }
        if self.timeout == TimeSpan::ZERO {
            return invalid("timeout", 0, "must be > 0 ns");
        }
        Ok(())
    }
}

/// Invalid [`MigrationParams`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParamsError {
    /// A parameter is out of range.
    #[error("invalid migration parameter `{field}` = {value}: {reason}")]
    Invalid {
        /// The parameter.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The accepted range.
        reason: &'static str,
    },
}

/// A migration, chosen by the source (unique per source instance) and carried by every frame.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MigrationId(pub u64);

impl fmt::Display for MigrationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Workers number their migrations `instance << 40 | sequence`: show both parts.
        match (self.0 >> 40, self.0 & ((1 << 40) - 1)) {
            (0, seq) => write!(f, "mig-{seq}"),
            (instance, seq) => write!(f, "mig-{instance}.{seq}"),
        }
    }
}

/// Where a move stands among every move a cluster's leaders started: the term of the leader that
/// started it (its election key's create revision, which grows from leader to leader), then that
/// leader's count of moves. A target fences a request up to an order when its coordinator
/// settles the request as "not here": moves started before are refused, later ones land.
/// [`MoveOrder::UNORDERED`] (a move no leader started) comes before every fence.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct MoveOrder {
    /// The starting leader's term.
    pub term: u64,
    /// The move's number among that leader's moves (from 1).
    pub seq: u64,
}

impl MoveOrder {
    /// Before every move a leader starts.
    pub const UNORDERED: MoveOrder = MoveOrder { term: 0, seq: 0 };
}

impl fmt::Display for MoveOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.term, self.seq)
    }
}

/// Where a migration stands; named in [`AbortReason::Timeout`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MigrationPhase {
    /// Source: constructed, `start` not called yet.
    NotStarted,
    /// Source: `Prepare` sent, waiting for `PrepareReply`.
    Preparing,
    /// Source: a live stage's blocks are being written (waiting for `on_blocks_sent`).
    LiveCopy,
    /// Source: `StageEnd` sent, waiting for `StageAck`.
    StageAck,
    /// Source: following a prefill, every full block copied, waiting for it to write more or
    /// to end.
    FollowingPrefill,
    /// Source: `Pause` asked, waiting for `on_paused`.
    Pausing,
    /// Source: the final stage's blocks are being written (request paused).
    StopAndCopy,
    /// Source: `Commit` sent, waiting for `CommitReply`.
    Committing,
    /// Target: `Reserve` asked, waiting for `on_reserved`.
    Reserving,
    /// Target: receiving and writing blocks (also while a `Commit` waits for missing blocks).
    Receiving,
    /// Target: `Attach` asked, waiting for `on_attached` (past the commit point).
    Attaching,
    /// Either side: `Done` emitted.
    Finished,
}

impl fmt::Display for MigrationPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MigrationPhase::NotStarted => "not started",
            MigrationPhase::Preparing => "waiting for the prepare reply",
            MigrationPhase::LiveCopy => "sending a live stage",
            MigrationPhase::StageAck => "waiting for a stage ack",
            MigrationPhase::FollowingPrefill => "waiting for the prefill to write more KV",
            MigrationPhase::Pausing => "pausing the request",
            MigrationPhase::StopAndCopy => "sending the stop-and-copy stage",
            MigrationPhase::Committing => "waiting for the commit reply",
            MigrationPhase::Reserving => "reserving blocks",
            MigrationPhase::Receiving => "receiving blocks",
            MigrationPhase::Attaching => "attaching the request",
            MigrationPhase::Finished => "finished",
        })
    }
}

/// Coarse class of an [`AbortReason`], as carried by the wire's `Abort.code`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AbortKind {
    /// A peer sent a code this build does not know.
    Unspecified,
    /// [`AbortReason::Refused`].
    Refused,
    /// [`AbortReason::Timeout`].
    Timeout,
    /// [`AbortReason::Disconnected`].
    Disconnected,
    /// [`AbortReason::ChecksumMismatch`].
    ChecksumMismatch,
    /// [`AbortReason::BadFrame`].
    BadFrame,
    /// [`AbortReason::TargetOutOfMemory`].
    TargetOutOfMemory,
    /// [`AbortReason::SourceKvUnavailable`].
    SourceKvUnavailable,
    /// [`AbortReason::Incomplete`].
    Incomplete,
    /// [`AbortReason::Cancelled`].
    Cancelled,
    /// [`AbortReason::WriteFailed`].
    WriteFailed,
    /// [`AbortReason::AttachFailed`].
    AttachFailed,
}

impl AbortKind {
    /// The kind of a wire `Abort.code` (unknown values → [`AbortKind::Unspecified`]).
    pub fn from_wire(code: i32) -> AbortKind {
        use wire::AbortCode as C;
        match C::try_from(code).unwrap_or(C::Unspecified) {
            C::Unspecified => AbortKind::Unspecified,
            C::Refused => AbortKind::Refused,
            C::Timeout => AbortKind::Timeout,
            C::Disconnected => AbortKind::Disconnected,
            C::ChecksumMismatch => AbortKind::ChecksumMismatch,
            C::BadFrame => AbortKind::BadFrame,
            C::TargetOutOfMemory => AbortKind::TargetOutOfMemory,
            C::SourceKvUnavailable => AbortKind::SourceKvUnavailable,
            C::Incomplete => AbortKind::Incomplete,
            C::Cancelled => AbortKind::Cancelled,
            C::WriteFailed => AbortKind::WriteFailed,
            C::AttachFailed => AbortKind::AttachFailed,
        }
    }

    /// The wire code of this kind.
    pub fn to_wire(self) -> wire::AbortCode {
        use wire::AbortCode as C;
        match self {
            AbortKind::Unspecified => C::Unspecified,
            AbortKind::Refused => C::Refused,
            AbortKind::Timeout => C::Timeout,
            AbortKind::Disconnected => C::Disconnected,
            AbortKind::ChecksumMismatch => C::ChecksumMismatch,
            AbortKind::BadFrame => C::BadFrame,
            AbortKind::TargetOutOfMemory => C::TargetOutOfMemory,
            AbortKind::SourceKvUnavailable => C::SourceKvUnavailable,
            AbortKind::Incomplete => C::Incomplete,
            AbortKind::Cancelled => C::Cancelled,
            AbortKind::WriteFailed => C::WriteFailed,
            AbortKind::AttachFailed => C::AttachFailed,
        }
    }
}

impl fmt::Display for AbortKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The wire names are stable and greppable: "ABORT_CODE_CHECKSUM_MISMATCH".
        f.write_str(self.to_wire().as_str_name())
    }
}

/// Why a migration did not commit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(rename_all = "snake_case")]
pub enum AbortReason {
    /// The target refused the `Prepare` (no room, wrong model, geometry mismatch, ...).
    #[error("refused by the target: {0}")]
    Refused(String),
    /// The migration's deadline passed while it was in `phase`.
    #[error("timed out while {phase}")]
    Timeout {
        /// The phase that was waiting.
        phase: MigrationPhase,
    },
    /// The connection to the peer broke.
    #[error("connection to the peer lost")]
    Disconnected,
    /// A block's data did not match its xxh3 checksum.
    #[error("checksum mismatch in block {block}")]
    ChecksumMismatch {
        /// Index of the block.
        block: u32,
    },
    /// A frame that is malformed, for another migration, or makes no sense in the current state.
    #[error("bad frame: {0}")]
    BadFrame(String),
    /// The target could not reserve or extend room for the blocks.
    #[error("target out of memory: {0}")]
    TargetOutOfMemory(String),
    /// The source driver could not read the request's KV blocks.
    #[error("source KV unavailable: {0}")]
    SourceKvUnavailable(String),
    /// `Commit` came but blocks below `blocks_total` never did.
    #[error("{missing} blocks missing at commit")]
    Incomplete {
        /// Blocks not written when `Commit` came.
        missing: u32,
    },
    /// The driver cancelled the migration (e.g. the request finished or the worker shuts down).
    #[error("cancelled: {0}")]
    Cancelled(String),
    /// The target driver failed to write a block (other than running out of memory).
    #[error("target failed to write a block: {0}")]
    WriteFailed(String),
    /// The target could not attach the request at commit.
    #[error("target failed to attach the request: {0}")]
    AttachFailed(String),
    /// The peer sent `Abort`.
    #[error("peer aborted ({kind}): {message}")]
    PeerAborted {
        /// The peer's `Abort.code`.
        kind: AbortKind,
        /// The peer's `Abort.message`.
        message: String,
    },
}

impl AbortReason {
    /// The coarse class sent as `Abort.code`.
    pub fn kind(&self) -> AbortKind {
        match self {
            AbortReason::Refused(_) => AbortKind::Refused,
            AbortReason::Timeout { .. } => AbortKind::Timeout,
            AbortReason::Disconnected => AbortKind::Disconnected,
            AbortReason::ChecksumMismatch { .. } => AbortKind::ChecksumMismatch,
            AbortReason::BadFrame(_) => AbortKind::BadFrame,
            AbortReason::TargetOutOfMemory(_) => AbortKind::TargetOutOfMemory,
            AbortReason::SourceKvUnavailable(_) => AbortKind::SourceKvUnavailable,
            AbortReason::Incomplete { .. } => AbortKind::Incomplete,
            AbortReason::Cancelled(_) => AbortKind::Cancelled,
            AbortReason::WriteFailed(_) => AbortKind::WriteFailed,
            AbortReason::AttachFailed(_) => AbortKind::AttachFailed,
            AbortReason::PeerAborted { kind, .. } => *kind,
        }
    }
}

/// How a migration ended, as one side saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The request runs on the target. Source: free the copy. Target: resume the request.
    Committed,
    /// The request stays on the source. Source: resume/keep it. Target: nothing is left.
    Aborted(AbortReason),
    /// Source only: `Commit` was sent but no answer came (the reason says what broke). The target
    /// may or may not have attached: keep the request paused and ask the coordinator (module doc).
    Unknown(AbortReason),
}

impl Outcome {
    /// Aborted because a block's bytes did not hash to the sender's checksum (found by this side,
    /// or by the peer, whose `Abort` said so).
    pub fn checksum_mismatch(&self) -> bool {
        matches!(self, Outcome::Aborted(r) if r.kind() == AbortKind::ChecksumMismatch)
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Committed => f.write_str("committed"),
            Outcome::Aborted(r) => write!(f, "aborted: {r}"),
            Outcome::Unknown(r) => write!(f, "unknown (commit sent, then {r})"),
        }
    }
}

/// One copy stage, as the source saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageReport {
    /// Stage index (0, 1, ...); the final stage is the last one.
    pub stage: u32,
    /// True for the stop-and-copy stage (request paused).
    pub final_stage: bool,
    /// `BlockData` frames sent.
    pub blocks: u32,
    /// Bytes of block data sent (`blocks × block_bytes`, a layer-group slice counting its share).
    pub bytes: u64,
    /// When the stage's `CopyBlocks` was emitted.
    pub started: Timestamp,
    /// When the driver reported every block written to the transport (`on_blocks_sent`).
    pub sent: Option<Timestamp>,
    /// When the target confirmed it: `StageAck` for a live stage, `CommitReply { ok }` for the final.
    pub ended: Option<Timestamp>,
}

/// Measurements of one migration, kept by the [`SourceMachine`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MigrationReport {
    /// The migration.
    pub migration: MigrationId,
    /// The request being migrated.
    pub request: RequestId,
    /// When the machine was constructed.
    pub created: Timestamp,
    /// When `start` sent the `Prepare`.
    pub started: Option<Timestamp>,
    /// KV tokens when the migration started.
    pub kv_tokens_start: u32,
    /// KV tokens once the request was paused (what the stop-and-copy completes).
    pub kv_tokens_final: Option<u32>,
    /// Every copy stage, live ones first, the stop-and-copy stage last.
    pub stages: Vec<StageReport>,
    /// Block bytes written to the transport, all stages.
    pub bytes: u64,
    /// Leading blocks the target held already (its prefix cache, `PrepareReply.cached_blocks`):
    /// never sent.
    #[serde(default)]
    pub skipped_blocks: u32,
    /// Their bytes (`skipped_blocks` × block bytes).
    #[serde(default)]
    pub bytes_skipped: u64,
    /// When `Pause` was emitted.
    pub pause_requested_at: Option<Timestamp>,
    /// When the driver reported the request frozen (`on_paused`).
    pub paused_at: Option<Timestamp>,
    /// When `Commit` was sent.
    pub commit_sent_at: Option<Timestamp>,
    /// When `Done` was emitted (= `CommitReply { ok }` for a committed migration).
    pub finished_at: Option<Timestamp>,
    /// Pause → the request runs again: on the target (`CommitReply { ok }`) or, after an abort, on
    /// the source (`Done`). `None` if never paused, or for [`Outcome::Unknown`].
    pub downtime: Option<TimeSpan>,
    /// `start` → `Done`.
    pub total_time: Option<TimeSpan>,
    /// Committed migrations: `bytes` ÷ `total_time`, bytes per second.
    pub goodput_bytes_per_s: Option<f64>,
    /// How it ended; `None` until `Done`.
    pub outcome: Option<Outcome>,
}

impl MigrationReport {
    /// Live copy stages run (the stop-and-copy stage not counted).
    pub fn live_stages(&self) -> u32 {
        self.stages.iter().filter(|s| !s.final_stage).count() as u32
    }
}

/// xxh3-64 of a block, as carried in `BlockData.checksum`.
pub fn checksum(data: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(data)
}

/// [`checksum`] of a payload held in pieces (the same value as over the joined bytes).
pub fn checksum_payload(data: &crate::Payload) -> u64 {
    match data.chunks() {
        [] => checksum(&[]),
        [one] => checksum(one),
        many => {
            let mut h = xxhash_rust::xxh3::Xxh3::new();
            for c in many {
                h.update(c);
            }
            h.digest()
        }
    }
}

/// A `BlockData` frame for logical block `index` holding `tokens` valid tokens, with its checksum.
pub fn block_frame(id: MigrationId, stage: u32, index: u32, tokens: u32, data: Bytes) -> Frame {
    let mut head = block_frame_head(id, stage, index, tokens, &data);
    head.data = data;
    Frame { body: Some(Body::BlockData(head)) }
}

/// Field numbers from `Frame` down to `BlockData.data`: where a sender that writes a block's
/// bytes without copying them into the frame puts them (`FrameWriter::send_with_payload` with
/// [`block_frame_head`]); the receiver decodes the same [`block_frame`].
pub const BLOCK_DATA_PAYLOAD_PATH: [u32; 2] = [3, 6];

/// [`block_frame`]'s `BlockData` without the data (checksum included), for sending the data
/// separately at [`BLOCK_DATA_PAYLOAD_PATH`].
pub fn block_frame_head(id: MigrationId, stage: u32, index: u32, tokens: u32, data: &[u8]) -> wire::BlockData {
    wire::BlockData {
        migration_id: id.0,
        stage,
        index,
        tokens,
        checksum: checksum(data),
        data: Bytes::new(),
        group_first: 0,
        group_end: 0,
    }
}

/// [`block_frame_head`] for a slice of a block: layer groups `groups` of it, whose bytes
/// ([`slice_bytes`]) are `data`.
pub fn slice_frame_head(
    id: MigrationId,
    stage: u32,
    index: u32,
    tokens: u32,
    groups: std::ops::Range<u32>,
    data: &[u8],
) -> wire::BlockData {
    wire::BlockData {
        group_first: groups.start,
        group_end: groups.end,
        ..block_frame_head(id, stage, index, tokens, data)
    }
}

/// Blocks that `kv_tokens` tokens occupy: `ceil(kv_tokens / block_size)` (0 if `block_size` is 0).
pub fn blocks_for_tokens(kv_tokens: u32, block_size: u32) -> u32 {
    if block_size == 0 {
        return 0;
    }
    kv_tokens.div_ceil(block_size)
}

/// Valid tokens in logical block `index` of a request holding `kv_tokens` tokens.
pub fn block_tokens(index: u32, kv_tokens: u32, block_size: u32) -> u32 {
    let first = index as u64 * block_size as u64;
    (kv_tokens as u64).saturating_sub(first).min(block_size as u64) as u32
}

/// An `Abort` frame carrying `reason`.
pub fn abort_frame(id: MigrationId, reason: &AbortReason) -> Frame {
    Frame {
        body: Some(Body::Abort(wire::Abort {
            migration_id: id.0,
            code: reason.kind().to_wire() as i32,
            reason: reason.to_string(),
        })),
    }
}

/// The migration a frame belongs to (`None` for an empty frame or a prefix fetch's).
pub fn frame_migration_id(frame: &Frame) -> Option<MigrationId> {
    frame.body.as_ref().and_then(body_migration_id).map(MigrationId)
}

/// `None` for the frames of a prefix fetch, which belong to no migration.
fn body_migration_id(body: &Body) -> Option<u64> {
    Some(match body {
        Body::Prepare(m) => m.migration_id,
        Body::PrepareReply(m) => m.migration_id,
        Body::BlockData(m) => m.migration_id,
        Body::StageEnd(m) => m.migration_id,
        Body::StageAck(m) => m.migration_id,
        Body::Commit(m) => m.migration_id,
        Body::CommitReply(m) => m.migration_id,
        Body::Abort(m) => m.migration_id,
        Body::PrefixPull(_) | Body::PrefixBlock(_) => return None,
    })
}

fn body_name(body: &Body) -> &'static str {
    match body {
        Body::Prepare(_) => "Prepare",
        Body::PrepareReply(_) => "PrepareReply",
        Body::BlockData(_) => "BlockData",
        Body::StageEnd(_) => "StageEnd",
        Body::StageAck(_) => "StageAck",
        Body::Commit(_) => "Commit",
        Body::CommitReply(_) => "CommitReply",
        Body::Abort(_) => "Abort",
        Body::PrefixPull(_) => "PrefixPull",
        Body::PrefixBlock(_) => "PrefixBlock",
    }
}

fn frame(body: Body) -> Frame {
    Frame { body: Some(body) }
}
