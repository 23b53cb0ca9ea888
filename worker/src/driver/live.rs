//! The engine thread's side of a live migration: the few arena and engine operations the
//! migration task (`crate::migrate`) asks for, each short (one block's memcpy and checksum at
//! most), so the engine loop keeps its deadlines while megabytes stream past. A source's full
//! blocks are not copied at all: they are lent to the transport in place (`KvArena::lease`),
//! and the engine reuses none of them until the lease comes back. Every command that moves a
//! request's lifecycle asks the [`Ledger`](crate::ledger::Ledger) first and carries its
//! migration's id: only the migration that began a move (or reserved blocks) can finish it.
//!
//! Source: [`LiveCommand::BeginOut`] marks the request as moving out, [`LiveCommand::ReadBlocks`]
//! copies logical blocks of a running request whose content is final (full blocks; every block
//! once paused), [`LiveCommand::PauseOut`] freezes it for the stop-and-copy and snapshots its
//! state, then [`LiveCommand::FinishOut`] (the target runs it), [`LiveCommand::ResumeOut`]
//! (aborted: it carries on here) or [`LiveCommand::InDoubt`] (COMMIT reply lost: paused until
//! [`LiveCommand::ResolveSource`]).
//!
//! Target: [`LiveCommand::Reserve`] reserves GPU blocks, [`LiveCommand::WriteBlock`] lands a
//! received block in them (growing the reservation as the request grew on the source),
//! [`LiveCommand::AttachReserved`] checks every token's content against its deterministic stamp
//! and makes the request runnable on exactly those blocks; [`LiveCommand::Release`] undoes it.
//! [`LiveCommand::ResolveTarget`] answers the coordinator after a lost COMMIT reply (and fences).

use super::{ledger_step, refused, shared_blocks, verify_written, Driver, DriverError, Written};
use crate::arena::TokenContent;
use crate::ledger::{Arrival, Settle};
use bytes::Bytes;
use kvfleet_core::engine::{Engine, MigratedRequest};
use kvfleet_core::kv::{BlockHash, BlockTable, Tier};
use kvfleet_core::{RequestId, Timestamp};
use kvfleet_netmodel::migration::{MigrationId, MoveOrder};
use kvfleet_netmodel::Payload;
use std::sync::Arc;
use tokio::sync::oneshot;

/// Blocks an incoming migration's reservation takes beyond its KV at PREPARE, where the target has
/// room: 4 blocks of 16 tokens cover a request decoding one token per 25 ms for a 1.6 s copy.
const RESERVE_HEADROOM_BLOCKS: u32 = 4;

type Reply<T> = oneshot::Sender<Result<T, DriverError>>;

#[derive(Debug)]
pub(crate) enum LiveCommand {
    /// Start moving a running request out; replies with its final KV tokens so far.
    BeginOut {
        request: RequestId,
        migration: MigrationId,
        reply: Reply<BeganOut>,
    },
    ReadBlocks {
        request: RequestId,
        first: u32,
        count: u32,
        reply: Reply<BlockRead>,
    },
    /// Freeze the request for the final copy; one whose prefill still runs (a move following
    /// it) is frozen at the prefill's end, when it is held.
    PauseOut {
        request: RequestId,
        migration: MigrationId,
        reply: Reply<PausedOut>,
    },
    /// A move following a prefill has copied every full block up to `above` tokens (and, layer
    /// by layer, `layers`: the layer groups known done of the iteration in flight, which ends
    /// with `.0` tokens): replies once the prefill has written more, computed another layer group,
    /// or ended.
    WaitKv {
        request: RequestId,
        above: u32,
        layers: Option<(u32, u32)>,
        reply: Reply<KvProgress>,
    },
    FinishOut {
        request: RequestId,
        migration: MigrationId,
        reply: Reply<()>,
    },
    ResumeOut {
        request: RequestId,
        migration: MigrationId,
        reply: Reply<()>,
    },
    /// The COMMIT's reply was lost: keep it paused until the coordinator settles it.
    InDoubt {
        request: RequestId,
        migration: MigrationId,
        reply: Reply<()>,
    },
    /// The coordinator settled a move in doubt; replies what the request's entry made of it.
    ResolveSource {
        request: RequestId,
        committed: bool,
        reply: Reply<Settle>,
    },
    /// Replies how many leading blocks of `prefix` were pinned from this instance's prefix cache.
    Reserve {
        request: RequestId,
        migration: MigrationId,
        order: MoveOrder,
        kv_tokens: u32,
        prefix: Vec<BlockHash>,
        reply: Reply<u32>,
    },
    /// With `checksum`, the written bytes must hash to it ([`crate::arena::ArenaError::Checksum`]).
    WriteBlock {
        request: RequestId,
        migration: MigrationId,
        index: u32,
        /// Where in the block `data` goes (a slice of its layer groups; 0 for the whole block).
        offset: u64,
        data: Payload,
        checksum: Option<u64>,
        reply: Reply<()>,
    },
    /// Replies with when the verification ended (the attach follows at once).
    AttachReserved {
        migration: MigrationId,
        state: Box<MigratedRequest>,
        reply: Reply<kvfleet_core::Timestamp>,
    },
    Release {
        request: RequestId,
        migration: MigrationId,
    },
    /// Whether the request is on this instance (running, waiting or paused).
    Holds {
        request: RequestId,
        reply: Reply<bool>,
    },
    /// Whether a move of the request whose outcome was lost landed here; fenced if not.
    ResolveTarget {
        request: RequestId,
        /// Fence the moves ordered up to this one.
        upto: MoveOrder,
        reply: Reply<bool>,
    },
    /// A prefix fetch's holder: blocks `first..first + count` of the prompt whose block hashes
    /// are `hashes`, from this instance's GPU prefix cache, in order, as far as the cached run
    /// goes (fewer, or none, where it ends or a block is not computed yet).
    ReadPrefix {
        hashes: Arc<[BlockHash]>,
        first: u32,
        count: u32,
        reply: Reply<Vec<Bytes>>,
    },
    /// A prefix fetch's target: `blocks[i]`, block `first + i` of the prompt whose block hashes
    /// are `hashes`, joins this instance's prefix cache; replies how many blocks were installed.
    InstallPrefix {
        hashes: Arc<[BlockHash]>,
        first: u32,
        blocks: Vec<Payload>,
        reply: Reply<u32>,
    },
}

/// A move out begun: the KV the request holds, and the content hashes of its full prompt
/// blocks (sent in `Prepare`, so a target caching them is sent only the rest).
#[derive(Debug)]
pub(crate) struct BeganOut {
    pub kv_tokens: u32,
    pub prefix: Vec<BlockHash>,
    /// Its prefill still runs: the KV it will hold at its end (the move follows the prefill).
    pub following: Option<u32>,
    /// Layer groups the move follows the prefill in (1: whole blocks).
    pub layer_groups: u32,
}

/// How far a followed prefill has gone.
#[derive(Debug)]
pub(crate) struct KvProgress {
    /// Tokens whose content is final.
    pub kv_tokens: u32,
    /// Following it layer by layer: the iteration in flight ends with `.0` tokens and has
    /// computed its first `.1` layer groups (never the last: that comes with its end).
    pub layers: Option<(u32, u32)>,
}

/// Blocks read for sending.
#[derive(Debug)]
pub(crate) struct BlockRead {
    /// Tokens whose content is final now (the machine's view of the request's progress).
    pub kv_tokens: u32,
    /// The blocks asked for (fewer when not all are final yet), in order from `first`.
    pub blocks: Vec<Bytes>,
}

/// A request frozen for the stop-and-copy.
#[derive(Debug)]
pub(crate) struct PausedOut {
    pub kv_tokens: u32,
    /// serde JSON of [`MigratedRequest`].
    pub state: Vec<u8>,
}

impl Driver {
    pub(super) fn on_live(&mut self, cmd: LiveCommand) {
        match cmd {
            LiveCommand::BeginOut { request, migration, reply } => {
                let _ = reply.send(self.begin_out(request, migration));
            }
            LiveCommand::ReadBlocks { request, first, count, reply } => {
                let _ = reply.send(self.read_blocks(request, first, count));
            }
            LiveCommand::PauseOut { request, migration, reply } => {
                let _ = reply.send(self.pause_out(request, migration));
            }
            LiveCommand::WaitKv { request, reply, .. } => {
                let layers = self.layer_progress(request);
                let _ =
                    reply.send(self.read_blocks(request, 0, 0).map(|r| KvProgress { kv_tokens: r.kv_tokens, layers }));
            }
            LiveCommand::FinishOut { request, migration, reply } => {
                let _ = reply.send(self.finish_out(request, migration));
            }
            LiveCommand::ResumeOut { request, migration, reply } => {
                let _ = reply.send(self.resume_out(request, migration));
            }
            LiveCommand::InDoubt { request, migration, reply } => {
                let in_doubt = match self.ledger.unknown_out(request, migration) {
                    Ok(None) => Ok(()),
                    Ok(Some(resume)) => self.resume_on_engine(request, resume),
                    Err(e) => Err(e.into()),
                };
                let _ = reply.send(in_doubt);
            }
            LiveCommand::ResolveSource { request, committed, reply } => {
                let _ = reply.send(self.resolve_source(request, committed));
            }
            LiveCommand::Reserve { request, migration, order, kv_tokens, prefix, reply } => {
                let _ = reply.send(self.reserve(request, (migration, order), kv_tokens, &prefix));
            }
            LiveCommand::WriteBlock { request, migration, index, offset, data, checksum, reply } => {
                let r = self.ledger.may_write(request, migration).map_err(|r| refused(request, r));
                let _ = reply.send(r.and_then(|()| self.write_block(request, index, offset, &data, checksum)));
            }
            LiveCommand::AttachReserved { migration, state, reply } => {
                let _ = reply.send(self.attach_reserved(migration, *state));
            }
            LiveCommand::Release { request, migration } => {
                if self.ledger.release(request, migration) {
                    self.engine.release_reservation(request);
                }
            }
            LiveCommand::Holds { request, reply } => {
                let _ = reply.send(Ok(self.ledger.holds(request)));
            }
            LiveCommand::ResolveTarget { request, upto, reply } => {
                let _ = reply.send(Ok(self.ledger.resolve_target(request, upto)));
            }
            LiveCommand::ReadPrefix { hashes, first, count, reply } => {
                let _ = reply.send(self.read_prefix(&hashes, first, count));
            }
            LiveCommand::InstallPrefix { hashes, first, blocks, reply } => {
                let _ = reply.send(Ok(self.install_prefix(&hashes, first, &blocks)));
            }
        }
    }

    /// See [`LiveCommand::ReadPrefix`]. Each block's stamps are checked before it leaves: a
    /// block cached for a prefill still running here holds no content yet.
    fn read_prefix(&mut self, hashes: &[BlockHash], first: u32, count: u32) -> Result<Vec<Bytes>, DriverError> {
        let bs = self.block_size;
        let end = (first as usize).saturating_add(count as usize).min(hashes.len());
        let run: Vec<u32> = self.engine.kv().prefix_hit_blocks(&hashes[..end]).collect();
        let content = TokenContent { request: RequestId(0), shared: hashes };
        let mut out = Vec::new();
        for (k, &block) in run.iter().enumerate().skip(first as usize) {
            if self.arena.verify_stamps(Tier::Gpu, block, content, k as u32 * bs, bs).is_err() {
                break;
            }
            out.push(self.lease(Tier::Gpu, block)?);
        }
        Ok(out)
    }

    /// Lend a block to the transport, read in place: the arena refuses to write it and the
    /// engine to reuse it until the lease ends ([`Driver::end_returned_leases`]).
    fn lease(&mut self, tier: Tier, block: u32) -> Result<Bytes, DriverError> {
        let bytes = self.arena.lease(tier, block)?;
        self.engine.lend_kv_block(tier, block);
        Ok(bytes)
    }

    /// Blocks whose leases ended (the transport is done with them) can be reused: a request
    /// waiting for room is planned now, not at the next command.
    pub(super) fn end_returned_leases(&mut self) {
        let returned = self.arena.returned_leases();
        if returned.is_empty() {
            return;
        }
        let free = |e: &Engine| e.kv().free(Tier::Gpu) + e.kv().free(Tier::Cpu);
        let before = free(&self.engine);
        for &(tier, block) in &returned {
            let ended = self.engine.end_kv_loan(tier, block);
            debug_assert!(ended, "a lease on {tier:?} block {block} ended that the engine never lent");
        }
        // Only a block freed by its loan's end (its request gone meanwhile) changes what an idle
        // engine would plan; a loan of a block its request still holds does not.
        if free(&self.engine) != before {
            self.quiet_since = self.clock.now();
        }
        self.plan_if_idle();
    }

    /// See [`LiveCommand::InstallPrefix`]. Each installed block's stamps are checked: one that
    /// fails is counted as a KV error and forgotten (a later prompt computes it), never served.
    fn install_prefix(&mut self, hashes: &[BlockHash], first: u32, blocks: &[Payload]) -> u32 {
        let bs = self.block_size;
        let first = first as usize;
        let end = first.saturating_add(blocks.len()).min(hashes.len());
        if first >= end {
            return 0;
        }
        let content = TokenContent { request: RequestId(0), shared: hashes };
        let mut installed = 0;
        for (hash, block) in self.engine.install_prefix(&hashes[first..end]) {
            let Some(k) = hashes[first..end].iter().position(|h| *h == hash).map(|i| first + i) else { continue };
            let written = self.arena.write_block(Tier::Gpu, block, &blocks[k - first], None);
            let checked = written.and_then(|()| self.arena.verify_stamps(Tier::Gpu, block, content, k as u32 * bs, bs));
            match checked {
                Ok(()) => {
                    self.kv_stats.blocks_copied += 1;
                    installed += 1;
                }
                Err(e) => {
                    self.kv_stats.errors += 1;
                    tracing::warn!(block = k, error = %e, "a fetched prefix block failed its check; dropped");
                    self.engine.forget_prefix_block(hash);
                }
            }
        }
        installed
    }

    fn begin_out(&mut self, request: RequestId, migration: MigrationId) -> Result<BeganOut, DriverError> {
        self.ledger.begin_out(request, migration).map_err(|r| refused(request, r))?;
        match self.read_blocks(request, 0, 0) {
            Ok(read) => {
                let prefix = self.engine.spec(request).map(|s| shared_blocks(s, self.block_size).into_vec());
                // The KV as it is, partial last block included (`read` counts only the full
                // blocks a live stage may copy): the target reserves for it, as in the simulator.
                let kv_tokens = self.written.get(&request).map_or(read.kv_tokens, |w| w.tokens);
                // Its prefill still runs: its table holds the whole prompt already.
                let following =
                    self.engine.prompt_written(request).and_then(|_| self.engine.kv().table(request).map(|t| t.tokens));
                let layer_groups = self.layer_groups;
                Ok(BeganOut { kv_tokens, prefix: prefix.unwrap_or_default(), following, layer_groups })
            }
            Err(e) => {
                // Nothing to move yet (no KV): it carries on here.
                self.resume_out(request, migration)?;
                Err(e)
            }
        }
    }

    fn reserve(
        &mut self,
        request: RequestId,
        (migration, order): (MigrationId, MoveOrder),
        kv_tokens: u32,
        prefix: &[BlockHash],
    ) -> Result<u32, DriverError> {
        self.ledger.prepare(request, migration, order).map_err(|r| refused(request, r))?;
        // Room for the tokens the request decodes on the source during the copy, where there is
        // some (a target filled meanwhile by its own requests would refuse the growth and abort
        // the migration); the attach gives back what is unused. Prompt blocks cached here are
        // pinned, not reserved: the source skips them.
        let headroom = RESERVE_HEADROOM_BLOCKS * self.block_size;
        match self.engine.reserve_incoming_prefixed(request, kv_tokens, headroom, prefix) {
            Ok(pinned) => Ok(pinned),
            Err(e) => {
                self.ledger.reserve_failed(request, migration);
                Err(e.into())
            }
        }
    }

    fn resolve_source(&mut self, request: RequestId, committed: bool) -> Result<Settle, DriverError> {
        let settle = self.ledger.resolve_source(request, committed);
        match settle {
            Settle::FreeSource => {
                self.engine.finish_migration_out(request)?;
                self.written.remove(&request);
            }
            Settle::Resume => self.abort_out(request)?,
            Settle::NotInDoubt | Settle::Underway => {}
        }
        Ok(settle)
    }

    /// Tokens of `request` whose content is written and final: whole blocks while it runs
    /// (the last, partial block still changes), everything once it is paused.
    fn final_tokens(&self, request: RequestId, paused: bool) -> Option<(&Written, u32)> {
        let w = self.written.get(&request)?;
        let bs = self.block_size;
        Some((w, if paused { w.tokens } else { w.tokens / bs * bs }))
    }

    fn read_blocks(&mut self, request: RequestId, first: u32, count: u32) -> Result<BlockRead, DriverError> {
        if !self.ledger.holds(request) {
            return Err(DriverError::Unknown(request));
        }
        // A prefill's KV is written chunk by chunk (its first token writes it all otherwise):
        // what its chunks so far computed is final, and a move following it copies that.
        let prompt = self.engine.prompt_written(request);
        if let Some(computed) = prompt {
            self.write_kv(request, computed);
        }
        let bs = self.block_size;
        // Layer by layer, the blocks the iteration in flight fills are read as it computes them
        // (each layer group leaves once done; the emulated arena writes a block whole).
        let in_flight = self.layer_progress(request).map(|(tokens, _)| tokens / bs * bs);
        if let Some(upto) = in_flight.filter(|_| count > 0) {
            self.write_kv(request, upto);
        }
        let paused = self.engine.is_migrating_out(request);
        let table = self.engine.kv().table(request).ok_or_else(|| DriverError::Kv {
            request,
            message: "holds no KV (preempted and dropped; it recomputes later)".into(),
        })?;
        let (w, final_tokens) = self
            .final_tokens(request, paused)
            .ok_or_else(|| DriverError::Kv { request, message: "no KV written yet".into() })?;
        if w.tier != Some(table.tier) || !table.blocks.starts_with(&w.blocks) {
            return Err(DriverError::Kv { request, message: "KV is being rewritten after a move".into() });
        }
        // Blocks of the iteration in flight may be written already: they are not final yet.
        let final_tokens = prompt.map_or(final_tokens, |computed| final_tokens.min(computed / bs * bs));
        let readable = in_flight.map_or(final_tokens, |upto| upto.min(w.tokens / bs * bs).max(final_tokens));
        let available = readable.div_ceil(bs);
        let (tier, written) = (table.tier, w.tokens);
        let end = first.saturating_add(count).min(available);
        if end > first && w.blocks.len() < end as usize {
            let i = first.max(w.blocks.len() as u32);
            return Err(DriverError::Kv { request, message: format!("logical block {i} is not written") });
        }
        // Owned: lending them below needs `self` mutably.
        let ids = w.blocks.get(first as usize..end as usize).unwrap_or_default().to_vec();
        let mut blocks = Vec::with_capacity(ids.len());
        for (i, b) in (first..).zip(ids) {
            // Full blocks never change again: lent in place. A partial last block (the request
            // is paused) is copied: if the move aborts, the request resumes writing it.
            let full = (i + 1) * bs <= written;
            blocks.push(if full { self.lease(tier, b)? } else { self.arena.copy_out(tier, b)? });
        }
        Ok(BlockRead { kv_tokens: final_tokens, blocks })
    }

    /// Whether `cmd` waits for the request it is about (checked again after each iteration and
    /// each command): a pause of a request whose prefill runs (frozen once it is held), or a
    /// wait for KV while the request runs here and has no full block beyond `above` yet (it is
    /// answered once one is written, or the request is held, paused or gone: then nothing more
    /// comes, and the pause's answer is on its way).
    pub(super) fn waits_for_its_request(&self, cmd: &LiveCommand) -> bool {
        match *cmd {
            LiveCommand::PauseOut { request, .. } => self.engine.prompt_written(request).is_some(),
            LiveCommand::WaitKv { request, above, layers, .. } => {
                let runs = self.engine.contains(request)
                    && !self.engine.is_held(request)
                    && !self.engine.is_migrating_out(request);
                let bs = self.block_size;
                let written = self.written.get(&request).map_or(0, |w| w.tokens);
                // During the prefill, what its chunks computed (blocks of the iteration in
                // flight may be written ahead for a move following it layer by layer).
                let computed = self.engine.prompt_written(request).unwrap_or(written);
                let more_layers = match (self.layer_progress(request), layers) {
                    (Some((tokens, done)), Some((known_tokens, known))) => {
                        done > 0 && (tokens != known_tokens || done > known)
                    }
                    (Some((_, done)), None) => done > 0,
                    (None, _) => false,
                };
                runs && computed / bs * bs <= above && !more_layers
            }
            _ => false,
        }
    }

    /// Following prefills layer by layer: the chunk of `request`'s prefill that the iteration in
    /// flight computes, as (tokens at its end, layer groups done now, at most all but the last).
    pub(super) fn layer_progress(&self, request: RequestId) -> Option<(u32, u32)> {
        if self.layer_groups <= 1 {
            return None;
        }
        let f = self.engine.prefill_in_flight(request)?;
        let g = self.layer_groups;
        Some((f.tokens, f.groups_done(self.clock.now(), g).min(g - 1)))
    }

    /// When the next layer group of a prefill a move waits on is done (the engine thread wakes
    /// then to answer the wait).
    pub(super) fn next_layer_group(&self) -> Option<Timestamp> {
        if self.layer_groups <= 1 {
            return None;
        }
        let g = self.layer_groups;
        self.waiting
            .iter()
            .filter_map(|cmd| match *cmd {
                LiveCommand::WaitKv { request, layers, .. } => {
                    let f = self.engine.prefill_in_flight(request)?;
                    let known = layers.filter(|&(tokens, _)| tokens == f.tokens).map_or(0, |(_, k)| k);
                    (known + 1 < g).then(|| f.group_done_at(known + 1, g))
                }
                _ => None,
            })
            .min()
    }

    fn pause_out(&mut self, request: RequestId, migration: MigrationId) -> Result<PausedOut, DriverError> {
        self.ledger.pause(request, migration).map_err(|r| refused(request, r))?;
        let paused = self.snapshot_paused(request);
        if paused.is_err() {
            self.ledger.pause_failed(request, migration)?;
        }
        paused
    }

    /// Freeze `request` on the engine and snapshot it; on failure it is left running.
    fn snapshot_paused(&mut self, request: RequestId) -> Result<PausedOut, DriverError> {
        let out = self.engine.begin_migration_out(request)?;
        // Everything it holds must be in the arena before the last copy (a request whose KV was
        // moved unexpectedly is rewritten lazily; finish that now).
        self.write_kv(request, out.kv_tokens);
        let have = self.written.get(&request).map_or(0, |w| w.tokens);
        if have != out.kv_tokens {
            self.abort_out(request)?;
            return Err(DriverError::Kv {
                request,
                message: format!("{have} of {} KV tokens are resident", out.kv_tokens),
            });
        }
        let state = self.engine.migration_state(request).map_err(DriverError::from).and_then(|s| {
            serde_json::to_vec(&s).map_err(|e| DriverError::Serialize { request, message: e.to_string() })
        });
        if state.is_err() {
            self.abort_out(request)?;
        }
        Ok(PausedOut { kv_tokens: out.kv_tokens, state: state? })
    }

    fn finish_out(&mut self, request: RequestId, migration: MigrationId) -> Result<(), DriverError> {
        self.ledger.commit_out(request, migration)?;
        self.engine.finish_migration_out(request)?;
        self.written.remove(&request);
        Ok(())
    }

    fn write_block(
        &mut self,
        request: RequestId,
        index: u32,
        offset: u64,
        data: &Payload,
        checksum: Option<u64>,
    ) -> Result<(), DriverError> {
        let bs = self.block_size;
        let blocks = self.engine.kv().table(request).map_or(0, |t| t.blocks.len() as u32);
        if index >= blocks {
            // The request grew on the source since PREPARE: grow the reservation.
            self.engine.reserve_incoming(request, (index + 1) * bs)?;
        }
        let table = self.engine.kv().table(request).ok_or(DriverError::Unknown(request))?;
        let block = table.blocks[index as usize];
        self.arena.write_block_at(table.tier, block, offset, data, checksum)?;
        self.kv_stats.blocks_copied += u64::from(offset + data.len() as u64 == self.arena.layout().block_bytes());
        Ok(())
    }

    /// Shared prompt blocks the reservation pinned from this instance's cache hold their content
    /// unless the request that cached them has not finished computing them yet (its prefill still
    /// running here): those are computed now, never served unwritten.
    fn fill_pinned(&mut self, table: &BlockTable, content: TokenContent<'_>, kv_tokens: u32) {
        let bs = self.block_size;
        let whole = (kv_tokens / bs) as usize;
        for (k, &block) in table.blocks.iter().enumerate().take(content.shared.len().min(whole)) {
            let first = k as u32 * bs;
            let cached = table.tier == Tier::Gpu && self.engine.kv().is_cached_block(block);
            if !cached || self.arena.verify_stamps(table.tier, block, content, first, bs).is_ok() {
                continue;
            }
            let tokens = first..first + bs;
            if !Self::write_tokens(&mut self.arena, &mut self.kv_stats, (table.tier, block), content, tokens) {
                return;
            }
        }
    }

    fn attach_reserved(
        &mut self,
        migration: MigrationId,
        m: MigratedRequest,
    ) -> Result<kvfleet_core::Timestamp, DriverError> {
        let id = m.spec.id;
        match self.ledger.commit(id, migration) {
            Ok(Arrival::AlreadyHere) => return Ok(self.clock.now()), // a retried commit
            Ok(Arrival::Attach) => {}
            Err(refusal) => return Err(refused(id, refusal)),
        }
        let kv_tokens = m.kv_tokens();
        let table = self.engine.kv().table(id).ok_or(DriverError::Unknown(id))?.clone();
        if table.blocks.len() < kv_tokens.div_ceil(self.block_size) as usize {
            return Err(DriverError::Kv {
                request: id,
                message: format!("{} blocks received for {kv_tokens} tokens", table.blocks.len()),
            });
        }
        // End to end: every token's content is the one (request, token) determines.
        let shared = shared_blocks(&m.spec, self.block_size);
        let content = TokenContent { request: id, shared: &shared };
        self.fill_pinned(&table, content, kv_tokens);
        let n = verify_written(&self.arena, self.block_size, table.tier, &table.blocks, content, kv_tokens)
            .map_err(|cause| DriverError::KvCorrupt { request: id, cause })?;
        self.kv_stats.tokens_verified += n;
        let verified = self.clock.now();
        self.engine.attach(verified, m)?;
        let blocks = self.engine.kv().table(id).map(|t| t.blocks.clone()).unwrap_or_default();
        self.written.insert(id, Written { tier: Some(table.tier), blocks, tokens: kv_tokens, shared });
        ledger_step(self.ledger.committed_in(id, migration));
        Ok(verified)
    }
}
