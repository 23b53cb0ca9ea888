//! Live migration between workers: the thin async shell around the sans-IO machines of
//! `kvfleet_netmodel::migration`, moving real KV bytes over a [`KvTransport`] (QUIC in the
//! binary, in-memory in tests).
//!
//! One migration holds one pooled connection to the target (concurrent migrations to one target
//! each hold their own, see `kvfleet_transport`'s "Connections"): a control stream (Prepare,
//! StageEnd, Commit one way; PrepareReply, StageAck, CommitReply the other) and `streams` data
//! streams that carry `BlockData` frames in parallel. The engine thread does the arena work one
//! block at a time (`LiveCommand`), so its deadlines hold while gigabytes stream past; tokens
//! decoded during the live copy stages stream from the source as usual, and the request is paused
//! only for the final stop-and-copy. The source hands the transport its full blocks in place, under
//! a lease (no copy); the target copies each block from the buffers it arrived in into its arena
//! and checks its checksum in the same pass.
//!
//! Target side: every inbound stream's first frame says what it is: a `Prepare` opens a control
//! stream (one migration, one [`TargetMachine`]); a `BlockData` opens a data stream whose frames
//! are routed to their migration by id.
//!
//! An [`Outcome::Unknown`] (the connection broke after COMMIT) leaves the request paused on the
//! source; the coordinator settles it with `ResolveMigration`: the target answers whether it
//! holds the request and, if not, refuses any late COMMIT from then on ([`Migrator::resolve_target`]);
//! the source then frees or resumes its copy ([`Migrator::resolve_source`]).
//!
//! Which request is where (moving out, paused, in doubt, reserved for an inbound migration,
//! fenced) is the engine thread's [`Ledger`](crate::ledger::Ledger), asked through
//! `LiveCommand`s that carry the migration's id; this task keeps only the connections and the
//! routes of data streams to their migrations. Spans are built in [`trace`].

use crate::arena::ArenaError;
use crate::clock::ClusterClock;
use crate::driver::{BeganOut, Command, DriverError, KvProgress, LiveCommand, PausedOut};
use crate::ledger::{Refusal, Settle};
use bytes::Bytes;
use kvfleet_core::kv::BlockHash;
use kvfleet_core::{RequestId, Timestamp};
use kvfleet_netmodel::migration::wire::{
    frame::Body, BlockData, BlockHash as WireHash, Frame, PrefixBlock, PrefixPull,
};
use kvfleet_netmodel::migration::{
    block_frame_head, block_tokens, checksum, slice_bytes, slice_frame_head, AbortReason, MigrationId, MigrationParams,
    MigrationReport, MoveOrder, Outcome, SourceAction, SourceMachine, TargetAction, TargetMachine,
    BLOCK_DATA_PAYLOAD_PATH,
};
use kvfleet_proto::v1;
use kvfleet_transport::{FrameReader, FrameWriter, KvConnection, KvTransport, Payload, StreamReader, StreamWriter};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, oneshot};
use trace::{SourceTrace, TargetTrace};

pub mod trace;

type Writer = FrameWriter<StreamWriter>;

/// Blocks a prefix fetch reads from, or installs into, the engine per command.
const PREFIX_CHUNK_BLOCKS: u32 = 8;
type Reader = FrameReader<StreamReader>;
/// One stage's copy in flight: its writers back, and the stage or why it failed.
type CopyTask = tokio::task::JoinHandle<(Vec<Writer>, Result<u32, String>)>;

/// One frame of a copy stage: a block, whole or (with its layer groups and how many groups a
/// block has) a slice of it.
type Item = (u32, Option<(std::ops::Range<u32>, u32)>);
/// Blocks a data stream's reader keeps ready ahead of its writer.
const READ_AHEAD_BLOCKS: usize = 2;
/// A target's inbound data-stream frames, each with its block's data if it arrived apart.
type DataRoute = mpsc::UnboundedSender<(Frame, Option<Payload>)>;

/// How long a source whose data stream broke waits for the target's `Abort` on the control
/// stream (which says why) before it counts the connection lost.
const ABORT_GRACE: std::time::Duration = std::time::Duration::from_millis(200);

/// How this worker migrates.
#[derive(Clone, Debug)]
pub struct MigrateConfig {
    /// Stage thresholds, block geometry and deadline of every migration (both roles).
    pub params: MigrationParams,
    /// Parallel data streams per migration.
    pub streams: usize,
    /// The shaping of this worker's outbound link (span attributes).
    pub link: trace::LinkShape,
    /// A fault: every block sent carries a checksum its bytes do not match (`--corrupt-sent-blocks`).
    pub corrupt_sent_blocks: bool,
}

/// The worker's live-migration endpoint (both roles).
pub struct Migrator {
    transport: Arc<dyn KvTransport>,
    commands: Sender<Command>,
    clock: ClusterClock,
    cfg: MigrateConfig,
    instance: u32,
    next_id: AtomicU64,
    /// Target: data-stream frames by migration.
    routes: Mutex<HashMap<u64, DataRoute>>,
    metrics: Mutex<crate::metrics::MigrationMetrics>,
}

impl std::fmt::Debug for Migrator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Migrator").field("local", &self.transport.local_addr()).finish_non_exhaustive()
    }
}

/// What the engine thread said no to.
fn driver_reason(e: DriverError) -> String {
    e.to_string()
}

impl Migrator {
    pub(crate) fn new(
        transport: Arc<dyn KvTransport>,
        commands: Sender<Command>,
        clock: ClusterClock,
        cfg: MigrateConfig,
        instance: u32,
    ) -> Arc<Migrator> {
        Arc::new(Migrator {
            transport,
            commands,
            clock,
            cfg,
            instance,
            next_id: AtomicU64::new(1),
            routes: Mutex::new(HashMap::new()),
            metrics: Mutex::new(crate::metrics::MigrationMetrics::default()),
        })
    }

    /// Counters and histograms of the migrations this worker sent.
    pub fn metrics(&self) -> crate::metrics::MigrationMetrics {
        self.metrics.lock().expect("metrics lock").clone()
    }

    /// The address peers send migrations to.
    pub fn local_addr(&self) -> SocketAddr {
        self.transport.local_addr()
    }

    /// Stop accepting migrations and close every connection.
    pub fn close(&self) {
        self.transport.close();
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, DriverError>>) -> LiveCommand,
    ) -> Result<T, String> {
        self.ask_raw(make).await.map_err(driver_reason)
    }

    async fn ask_raw<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, DriverError>>) -> LiveCommand,
    ) -> Result<T, DriverError> {
        self.ask_later(make).await.map_err(|_| DriverError::Draining)?
    }

    /// Send a command to the engine thread without waiting for its answer (one that may take
    /// a prefill's time: the migration keeps copying meanwhile).
    fn ask_later<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, DriverError>>) -> LiveCommand,
    ) -> oneshot::Receiver<Result<T, DriverError>> {
        let (tx, rx) = oneshot::channel();
        // Closed (the engine thread is gone): the receiver then reads a dropped sender, which
        // its reader takes for draining.
        let _ = self.commands.send(Command::Live(make(tx)));
        rx
    }

    fn now(&self) -> Timestamp {
        self.clock.now()
    }

    // ---------------------------------------------------------------- source

    /// Move `request` to the worker whose migration endpoint is `target`. Returns once it is
    /// settled: committed (it runs there), aborted (it runs here), or unknown (paused here; see
    /// the module docs).
    ///
    /// `Err` when there is nothing to migrate: the request is not here (finished meanwhile) or
    /// has no KV yet.
    ///
    /// `to` names the target's instance (span attributes; `None` if unknown); `parent` is the
    /// request's trace context, which the target's spans join through `Prepare.trace_context`.
    pub async fn migrate_out(
        self: &Arc<Self>,
        request: RequestId,
        target: SocketAddr,
        to: Option<u32>,
        order: MoveOrder,
        parent: &kvfleet_telemetry::Context,
    ) -> Result<MigrationReport, DriverError> {
        let id = MigrationId(((self.instance as u64) << 40) | self.next_id.fetch_add(1, Ordering::Relaxed));
        let began = self.ask_raw(|reply| LiveCommand::BeginOut { request, migration: id, reply }).await?;
        let trace =
            SourceTrace::start(parent, &self.clock, self.now(), id, request, (self.instance, to), self.cfg.link);
        let (outcome, report, connected) = self.run_source(id, request, began, (target, order), trace.carrier()).await;
        if matches!(outcome, Outcome::Aborted(AbortReason::SourceKvUnavailable(_)))
            && !self.ask(|reply| LiveCommand::Holds { request, reply }).await.unwrap_or(true)
        {
            // It finished here while its KV was being copied: nothing is left to move.
            trace.finish_vanished(self.now());
            return Err(DriverError::Unknown(request));
        }
        trace.finish(&report, self.now());
        // Whatever happened, the move ends here in the ledger (only this migration's move).
        let settled = match &outcome {
            Outcome::Committed => self.ask(|reply| LiveCommand::FinishOut { request, migration: id, reply }).await,
            // It carries on here (resumed if it was paused).
            Outcome::Aborted(_) => self.ask(|reply| LiveCommand::ResumeOut { request, migration: id, reply }).await,
            Outcome::Unknown(_) => self.ask(|reply| LiveCommand::InDoubt { request, migration: id, reply }).await,
        };
        if let Err(e) = settled {
            tracing::error!(%request, migration = %id, outcome = %outcome, "settling the move on the engine failed: {e}");
        }
        if !connected {
            return Ok(report); // never started: not counted as a migration
        }
        {
            let mut mm = self.metrics.lock().expect("metrics lock");
            mm.bytes += report.bytes;
            mm.bytes_skipped += report.bytes_skipped;
            match &outcome {
                Outcome::Committed => {
                    mm.committed += 1;
                    if let Some(t) = report.total_time {
                        mm.total.observe(t.as_secs_f64());
                    }
                    if let Some(d) = report.downtime {
                        mm.downtime.observe(d.as_secs_f64());
                    }
                }
                Outcome::Aborted(AbortReason::Refused(_)) => mm.refused += 1,
                Outcome::Aborted(_) => mm.aborted += 1,
                Outcome::Unknown(_) => mm.unknown += 1,
            }
        }
        tracing::info!(%request, migration = %id, %target, outcome = %outcome, bytes = report.bytes, stages = report.stages.len(),
            downtime_ms = report.downtime.map(|d| d.as_secs_f64() * 1e3), "live migration settled");
        Ok(report)
    }

    /// Run the source's machine to its outcome (a failure to start or to connect is an abort);
    /// and whether it connected to the target.
    async fn run_source(
        self: &Arc<Self>,
        id: MigrationId,
        request: RequestId,
        began: BeganOut,
        (target, order): (SocketAddr, MoveOrder),
        trace_context: kvfleet_telemetry::Carrier,
    ) -> (Outcome, MigrationReport, bool) {
        let mut m = match SourceMachine::new(id, request, self.cfg.params.clone(), self.now(), began.kv_tokens) {
            Ok(m) => {
                let m = m
                    .with_source_instance(self.instance)
                    .with_trace_context(trace_context)
                    .with_prefix(began.prefix)
                    .with_order(order);
                match began.following {
                    Some(expected) => m.following_prefill(expected).in_layer_groups(began.layer_groups),
                    None => m,
                }
            }
            Err(e) => {
                let report = self.failed_before_start(id, request, e.to_string());
                let outcome = report.outcome.clone().unwrap_or(Outcome::Aborted(AbortReason::Disconnected));
                return (outcome, report, false);
            }
        };
        let connect_timeout = self.clock.dilation().real(self.cfg.params.timeout);
        let conn = tokio::time::timeout(connect_timeout, self.transport.connect(target)).await;
        let connected = matches!(conn, Ok(Ok(_)));
        let outcome = match conn {
            Ok(Ok(conn)) => {
                m.start(self.now());
                let span = tracing::info_span!("live_migration", %request, migration = %id, %target, role = "source");
                tracing::Instrument::instrument(self.drive_source(&mut m, conn), span).await
            }
            Ok(Err(e)) => {
                m.cancel(self.now(), format!("cannot reach the target: {e}"));
                m.outcome().cloned().unwrap_or(Outcome::Aborted(AbortReason::Disconnected))
            }
            Err(_) => {
                m.cancel(self.now(), format!("cannot reach the target {target} within {connect_timeout:?}"));
                m.outcome().cloned().unwrap_or(Outcome::Aborted(AbortReason::Disconnected))
            }
        };
        (outcome, m.report().clone(), connected)
    }

    fn failed_before_start(&self, id: MigrationId, request: RequestId, reason: String) -> MigrationReport {
        let mut m = SourceMachine::new(id, request, self.cfg.params.clone(), self.now(), 0)
            .expect("migration parameters are validated at start-up");
        m.cancel(self.now(), reason);
        m.report().clone()
    }

    async fn drive_source(self: &Arc<Self>, m: &mut SourceMachine, conn: Arc<dyn KvConnection>) -> Outcome {
        let (request, migration) = (m.request(), m.id());
        let (ctl_w, ctl_r) = match conn.open_stream().await {
            Ok(s) => s,
            Err(e) => {
                m.cancel(self.now(), format!("opening a stream: {e}"));
                return m.outcome().cloned().unwrap_or(Outcome::Aborted(AbortReason::Disconnected));
            }
        };
        let mut ctl = FrameWriter::new(ctl_w);
        // Control frames from the target, read by their own task so a slow copy never stalls them.
        let (reader, mut frames) = spawn_control_reader(FrameReader::new(ctl_r));
        let mut data: Vec<Writer> = Vec::new();
        let mut copy: Option<CopyTask> = None;
        // Answers the engine thread gives when it can: the pause (a request whose prefill runs
        // is frozen at its end), and, following a prefill, KV beyond what was copied.
        let mut pausing: Option<oneshot::Receiver<Result<PausedOut, DriverError>>> = None;
        let mut watching: Option<oneshot::Receiver<Result<KvProgress, DriverError>>> = None;
        let outcome = loop {
            // Act on everything the machine wants.
            while let Some(action) = m.poll_action() {
                match action {
                    SourceAction::Send(f) => {
                        if ctl.send(&f).await.is_err() {
                            m.on_disconnect(self.now());
                        }
                    }
                    SourceAction::CopyBlocks { stage, blocks, slices, kv_tokens, .. } => {
                        if data.is_empty() {
                            match self.open_data_streams(&conn).await {
                                Ok(d) => data = d,
                                Err(e) => {
                                    tracing::debug!(%request, "data streams: {e}");
                                    m.on_disconnect(self.now());
                                    continue;
                                }
                            }
                        }
                        let writers = std::mem::take(&mut data);
                        let layer_groups = m.layer_groups();
                        let sliced = slices
                            .into_iter()
                            .flat_map(move |s| s.blocks.map(move |i| (i, Some((s.groups.clone(), layer_groups)))));
                        let items: Vec<Item> = sliced.chain(blocks.map(|i| (i, None))).collect();
                        copy = Some(tokio::spawn(self.clone().copy_stage(
                            m.id(),
                            request,
                            stage,
                            items,
                            kv_tokens,
                            writers,
                        )));
                    }
                    SourceAction::Pause => {
                        pausing = Some(self.ask_later(|reply| LiveCommand::PauseOut { request, migration, reply }));
                    }
                    SourceAction::Done(_) => {}
                }
            }
            if let (Some(above), None) = (m.awaiting_kv(), &watching) {
                let layers = m.awaiting_layers();
                watching = Some(self.ask_later(|reply| LiveCommand::WaitKv { request, above, layers, reply }));
            }
            if let Some(o) = m.outcome().cloned() {
                if m.is_done() {
                    break o;
                }
            }
            let deadline = m.poll_timeout().map(|t| tokio::time::Instant::from_std(self.clock.instant(t)));
            tokio::select! {
                f = frames.recv() => match f.flatten() {
                    Some(frame) => {
                        if matches!(frame.body, Some(Body::StageAck(_))) {
                            // The next stage's size depends on how far the request has decoded.
                            if let Ok(r) = self.ask(|reply| LiveCommand::ReadBlocks { request, first: 0, count: 0, reply }).await {
                                m.on_kv_progress(self.now(), r.kv_tokens);
                            }
                        }
                        m.on_frame(self.now(), frame);
                    }
                    None => m.on_disconnect(self.now()),
                },
                done = async { copy.as_mut().expect("guarded").await }, if copy.is_some() => {
                    copy = None;
                    match done {
                        Ok((writers, Ok(stage))) => {
                            data = writers;
                            m.on_blocks_sent(self.now(), stage);
                        }
                        Ok((_, Err(e))) if e.starts_with("read:") => m.on_read_failed(self.now(), e),
                        _ => {
                            // A data stream broke. A target that aborted (a block failed its
                            // checksum, it ran out of room) resets them as its Abort leaves on the
                            // control stream: that says why, if it comes at once.
                            if let Ok(Some(Some(frame))) = tokio::time::timeout(ABORT_GRACE, frames.recv()).await {
                                m.on_frame(self.now(), frame);
                            }
                            if m.outcome().is_none() {
                                m.on_disconnect(self.now());
                            }
                        }
                    }
                }
                paused = async { pausing.as_mut().expect("guarded").await }, if pausing.is_some() => {
                    pausing = None;
                    match paused.unwrap_or(Err(DriverError::Draining)) {
                        Ok(PausedOut { kv_tokens, state }) => m.on_paused(self.now(), kv_tokens, state),
                        Err(e) => m.on_read_failed(self.now(), driver_reason(e)),
                    }
                }
                kv = async { watching.as_mut().expect("guarded").await }, if watching.is_some() => {
                    watching = None;
                    match kv.unwrap_or(Err(DriverError::Draining)) {
                        Ok(KvProgress { kv_tokens, layers }) => {
                            m.on_kv_progress(self.now(), kv_tokens);
                            if let Some((tokens, done)) = layers {
                                m.on_layer_progress(self.now(), tokens, done);
                            }
                        }
                        Err(e) => m.on_read_failed(self.now(), driver_reason(e)),
                    }
                }
                _ = async { tokio::time::sleep_until(deadline.expect("guarded")).await }, if deadline.is_some() => {
                    m.on_timeout(self.now());
                }
            }
        };
        if let Some(c) = copy {
            c.abort();
        }
        if matches!(outcome, Outcome::Aborted(_)) {
            // Dropped unfinished, the data streams are reset: KV still queued for an aborted
            // migration is discarded rather than sent over the target's link.
            drop(data);
        } else {
            for mut w in data {
                let _ = w.finish().await;
            }
        }
        let _ = ctl.finish().await;
        reader.abort();
        outcome
    }

    async fn open_data_streams(&self, conn: &Arc<dyn KvConnection>) -> Result<Vec<Writer>, String> {
        let mut out = Vec::with_capacity(self.cfg.streams);
        for _ in 0..self.cfg.streams.max(1) {
            let (w, r) = conn.open_stream().await.map_err(|e| e.to_string())?;
            drop(r);
            out.push(FrameWriter::new(w));
        }
        Ok(out)
    }

    /// Send the `items` of one stage (blocks, or slices of blocks), item `j` on stream `j % streams`. Each stream's blocks
    /// are read from the engine by a task of their own, [`READ_AHEAD_BLOCKS`] ahead of the writer,
    /// so the link never waits for a read (a shaped link would lose the time for good: its bucket
    /// keeps only a burst's worth of idle credit). Returns the writers and the stage (or why it
    /// failed: `read: …` when the engine could not hand out a block, anything else for the
    /// transport).
    async fn copy_stage(
        self: Arc<Self>,
        id: MigrationId,
        request: RequestId,
        stage: u32,
        items: Vec<Item>,
        kv_tokens: u32,
        writers: Vec<Writer>,
    ) -> (Vec<Writer>, Result<u32, String>) {
        let n = writers.len().max(1);
        let bs = self.cfg.params.block_size;
        let block_bytes = self.cfg.params.block_bytes;
        let corrupt = self.cfg.corrupt_sent_blocks;
        // Scoped: a copy aborted mid-stage (the migration timed out or its target refused)
        // takes its per-stream tasks, and with them their read-ahead, down with it.
        let mut tasks = Vec::new();
        for (k, mut w) in writers.into_iter().enumerate() {
            let mine: Vec<Item> = items.iter().skip(k).step_by(n).cloned().collect();
            let mut read = self.clone().read_ahead(request, mine.into_iter());
            tasks.push(Scoped(tokio::spawn(async move {
                while let Some(next) = read.recv().await {
                    let ((i, slice), data) = match next {
                        Ok(block) => block,
                        Err(e) => return (w, Err(e)),
                    };
                    // The block's bytes (or its layer groups' range of them) go to the stream
                    // as they are in the arena (no copy into the frame buffer, none into QUIC's
                    // send buffer).
                    let tokens = block_tokens(i, kv_tokens, bs);
                    let (head, data) = match slice {
                        Some((groups, g)) => {
                            let r = slice_bytes(block_bytes, g, groups.clone());
                            let data = data.slice(r.start as usize..r.end as usize);
                            (slice_frame_head(id, stage, i, tokens, groups, &data), data)
                        }
                        None => (block_frame_head(id, stage, i, tokens, &data), data),
                    };
                    let head = if corrupt { BlockData { checksum: !head.checksum, ..head } } else { head };
                    if let Err(e) = w.send_with_payload(&head, &BLOCK_DATA_PAYLOAD_PATH, data).await {
                        return (w, Err(format!("send: {e}")));
                    }
                }
                if let Err(e) = w.flush().await {
                    return (w, Err(format!("send: {e}")));
                }
                (w, Ok(()))
            })));
        }
        let mut writers = Vec::new();
        let mut result = Ok(stage);
        for mut t in tasks {
            match (&mut t.0).await {
                Ok((w, r)) => {
                    writers.push(w);
                    if let Err(e) = r {
                        result = Err(e);
                    }
                }
                Err(e) => result = Err(format!("copy task: {e}")),
            }
        }
        (writers, result)
    }

    /// Read `indices` of `request` from the engine in a task of their own (it ends when the
    /// receiver is dropped), at most
    /// [`READ_AHEAD_BLOCKS`] ahead of the receiver; the first failure (`read: …`) ends the
    /// sequence, and so does dropping the receiver.
    fn read_ahead(
        self: Arc<Self>,
        request: RequestId,
        items: impl Iterator<Item = Item> + Send + 'static,
    ) -> mpsc::Receiver<Result<(Item, Bytes), String>> {
        let (tx, rx) = mpsc::channel(READ_AHEAD_BLOCKS);
        tokio::spawn(async move {
            for item in items {
                let i = item.0;
                let read = self.ask(|reply| LiveCommand::ReadBlocks { request, first: i, count: 1, reply }).await;
                let next = match read {
                    Ok(mut r) if !r.blocks.is_empty() => Ok((item, r.blocks.swap_remove(0))),
                    Ok(_) => Err(format!("read: block {i} is not final yet")),
                    Err(e) => Err(format!("read: {e}")),
                };
                let failed = next.is_err();
                if tx.send(next).await.is_err() || failed {
                    return;
                }
            }
        });
        rx
    }

    /// The coordinator settled an unknown outcome: free the paused copy (the target runs it) or
    /// resume it here. Only a request paused in doubt is touched: a leader that took over settles
    /// every move its predecessor left open, and a move still copying (or long settled) must go
    /// on undisturbed (its target, fenced by that leader, refuses the COMMIT if it comes; the
    /// answer [`Settle::Underway`] asks the coordinator to tell it again once the move ended).
    pub async fn resolve_source(&self, request: RequestId, committed: bool) -> Result<Settle, String> {
        self.ask(|reply| LiveCommand::ResolveSource { request, committed, reply }).await
    }

    // ---------------------------------------------------------------- target

    /// Did a move of `request` land here (it is here, or finished here)? If not, it never will
    /// through a migration in flight: a late COMMIT is refused from now on.
    pub async fn resolve_target(&self, request: RequestId, upto: MoveOrder) -> Result<bool, String> {
        self.ask(|reply| LiveCommand::ResolveTarget { request, upto, reply }).await
    }

    /// Accept inbound migrations until the transport closes.
    pub async fn serve(self: Arc<Self>) {
        loop {
            let conn = match self.transport.accept().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::debug!("migration endpoint closed: {e}");
                    return;
                }
            };
            let me = self.clone();
            tokio::spawn(async move {
                while let Ok((w, r)) = conn.accept_stream().await {
                    tokio::spawn(me.clone().serve_stream(w, r));
                }
            });
        }
    }

    async fn serve_stream(self: Arc<Self>, w: StreamWriter, r: StreamReader) {
        let mut reader: Reader = FrameReader::new(r);
        // A data stream's blocks stay in the buffers they arrived in, down to the arena.
        let (first, first_payload) = match reader.recv_with_payload::<Frame>(&BLOCK_DATA_PAYLOAD_PATH).await {
            Ok(Some(f)) => f,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("inbound migration stream: {e}");
                return;
            }
        };
        match &first.body {
            Some(Body::Prepare(p)) => {
                let span = tracing::info_span!(
                    "live_migration",
                    request = p.request_id,
                    migration = p.migration_id,
                    role = "target"
                );
                tracing::Instrument::instrument(self.run_target(first, reader, FrameWriter::new(w)), span).await
            }
            Some(Body::BlockData(b)) => {
                let id = b.migration_id;
                let Some(route) = self.routes.lock().expect("routes lock").get(&id).cloned() else {
                    tracing::warn!(migration = id, "data stream for an unknown migration; dropped");
                    return;
                };
                if route.send((first, first_payload)).is_err() {
                    return;
                }
                // Frames until EOF; an error (corrupt or oversized frame) ends the stream and
                // the migration times out or aborts on the control stream.
                loop {
                    match reader.recv_with_payload::<Frame>(&BLOCK_DATA_PAYLOAD_PATH).await {
                        Ok(Some(f)) => {
                            if route.send(f).is_err() {
                                return;
                            }
                        }
                        Ok(None) => return,
                        Err(e) => {
                            tracing::warn!(migration = id, "data stream: {e}");
                            let _ = route.send((Frame { body: None }, None));
                            return;
                        }
                    }
                }
            }
            Some(Body::PrefixPull(_)) => {
                let Some(Body::PrefixPull(pull)) = first.body else { unreachable!("matched above") };
                self.serve_prefix(pull, FrameWriter::new(w)).await
            }
            _ => tracing::warn!("inbound stream opened with an unexpected frame; dropped"),
        }
    }

    // ---------------------------------------------------------------- prefix fetches

    /// The holder of a prefix: send the blocks of `pull` this instance's GPU cache holds, in
    /// order, then end the stream (where the run ends).
    async fn serve_prefix(self: &Arc<Self>, pull: PrefixPull, mut w: Writer) {
        let hashes: Arc<[BlockHash]> =
            pull.hashes.iter().map(|h| (h.hi as BlockHash) << 64 | h.lo as BlockHash).collect();
        let mut index = pull.first;
        let mut sent = 0u64;
        while (index as usize) < hashes.len() {
            let count = PREFIX_CHUNK_BLOCKS.min(hashes.len() as u32 - index);
            let blocks = match self
                .ask(|reply| LiveCommand::ReadPrefix { hashes: hashes.clone(), first: index, count, reply })
                .await
            {
                Ok(b) => b,
                Err(e) => {
                    tracing::debug!("prefix fetch: reading blocks: {e}");
                    break;
                }
            };
            let short = (blocks.len() as u32) < count;
            for data in blocks {
                sent += data.len() as u64;
                let block = PrefixBlock { index, checksum: checksum(&data), data };
                if let Err(e) = w.send(&Frame { body: Some(Body::PrefixBlock(block)) }).await {
                    tracing::debug!("prefix fetch: sending: {e}");
                    return;
                }
                index += 1;
            }
            if short {
                break;
            }
        }
        tracing::debug!(blocks = index - pull.first, bytes = sent, "served a prefix fetch");
        let _ = w.finish().await;
    }

    /// Copy blocks `first..end` of `spec`'s prompt (by its content hashes) from the prefix
    /// cache of the worker whose migration endpoint is `holder` into this one's: as many as the
    /// holder still caches, each checksummed and its stamps checked. Returns the blocks installed
    /// and the bytes received; `Err` only when the holder cannot be reached or the stream breaks
    /// before any block (what arrived by then is kept either way).
    pub async fn fetch_prefix(
        self: &Arc<Self>,
        holder: SocketAddr,
        spec: &kvfleet_core::RequestSpec,
        first: u32,
        end: u32,
    ) -> Result<(u32, u64), String> {
        let hashes: Arc<[BlockHash]> =
            kvfleet_core::kv::prompt_block_hashes(&spec.content_ids, spec.prompt_tokens, self.cfg.params.block_size)
                .into();
        let end = end.min(hashes.len() as u32);
        if first >= end {
            return Ok((0, 0));
        }
        let deadline = self.clock.dilation().real(self.cfg.params.timeout);
        let fetch = async {
            let conn = self.transport.connect(holder).await.map_err(|e| format!("cannot reach {holder}: {e}"))?;
            let (w, r) = conn.open_stream().await.map_err(|e| e.to_string())?;
            let (mut w, mut r): (Writer, Reader) = (FrameWriter::new(w), FrameReader::new(r));
            let wire =
                hashes[..end as usize].iter().map(|&h| WireHash { hi: (h >> 64) as u64, lo: h as u64 }).collect();
            w.send(&Frame { body: Some(Body::PrefixPull(PrefixPull { hashes: wire, first })) })
                .await
                .map_err(|e| e.to_string())?;
            let _ = w.finish().await;
            let (mut installed, mut bytes, mut next) = (0u32, 0u64, first);
            let mut batch: Vec<Payload> = Vec::new();
            loop {
                let block = match r.recv::<Frame>().await {
                    Ok(Some(Frame { body: Some(Body::PrefixBlock(b)) })) => b,
                    Ok(None) => break,
                    Ok(Some(other)) => {
                        tracing::warn!(?other, "prefix fetch: unexpected frame; stopped");
                        break;
                    }
                    Err(e) => {
                        tracing::warn!("prefix fetch: {e}");
                        break;
                    }
                };
                if block.index != next || block.index >= end || checksum(&block.data) != block.checksum {
                    tracing::warn!(
                        index = block.index,
                        expected = next,
                        "prefix fetch: a block out of order or corrupt; stopped"
                    );
                    self.metrics.lock().expect("metrics lock").prefix_fetch_errors += 1;
                    break;
                }
                bytes += block.data.len() as u64;
                batch.push(Payload::from(block.data));
                next += 1;
                if batch.len() as u32 >= PREFIX_CHUNK_BLOCKS {
                    installed +=
                        self.install_batch(&hashes, next - batch.len() as u32, std::mem::take(&mut batch)).await?;
                }
            }
            if !batch.is_empty() {
                installed += self.install_batch(&hashes, next - batch.len() as u32, batch).await?;
            }
            Ok::<_, String>((installed, bytes))
        };
        let (installed, bytes) = tokio::time::timeout(deadline, fetch)
            .await
            .map_err(|_| format!("prefix fetch from {holder}: no answer within {deadline:?}"))??;
        if bytes > 0 {
            let mut mm = self.metrics.lock().expect("metrics lock");
            mm.prefix_fetches += 1;
            mm.prefix_fetch_bytes += bytes;
        }
        Ok((installed, bytes))
    }

    async fn install_batch(&self, hashes: &Arc<[BlockHash]>, first: u32, blocks: Vec<Payload>) -> Result<u32, String> {
        self.ask(|reply| LiveCommand::InstallPrefix { hashes: hashes.clone(), first, blocks, reply }).await
    }

    async fn run_target(self: &Arc<Self>, prepare: Frame, ctl_r: Reader, mut ctl: Writer) {
        // Each block's checksum is verified as it lands in the arena (one pass over its bytes).
        let mut m = match TargetMachine::accept(self.now(), &self.cfg.params, prepare) {
            Ok(m) => m.verify_on_write(),
            Err(refusal) => {
                let _ = ctl.send(&refusal).await;
                let _ = ctl.finish().await;
                return;
            }
        };
        let id = m.id();
        let request = m.request();
        let trace = TargetTrace::start(m.trace_context(), &self.clock, self.now(), id, request, self.instance);
        let (data_tx, mut data) = mpsc::unbounded_channel();
        self.routes.lock().expect("routes lock").insert(id.0, data_tx);
        let (reader, mut frames) = spawn_control_reader(ctl_r);
        loop {
            while let Some(action) = m.poll_action() {
                match action {
                    TargetAction::Send(f) => {
                        let _ = ctl.send(&f).await;
                    }
                    TargetAction::Reserve { request, kv_tokens, prefix, order, .. } => {
                        let asked = self.now();
                        let reserve =
                            |reply| LiveCommand::Reserve { request, migration: id, order, kv_tokens, prefix, reply };
                        let r = match self.ask_raw(reserve).await {
                            Ok(pinned) => Ok(pinned),
                            Err(DriverError::Refused { refusal: Refusal::Fenced, .. }) => {
                                Err(AbortReason::Refused(format!("{request} was settled elsewhere")))
                            }
                            // Try another target: this one's number may be another worker's now.
                            Err(e @ DriverError::Refused { refusal: Refusal::Unregistered, .. }) => {
                                Err(AbortReason::Refused(e.to_string()))
                            }
                            Err(e) => Err(AbortReason::TargetOutOfMemory(driver_reason(e))),
                        };
                        let blocks = u64::from(kv_tokens.div_ceil(self.cfg.params.block_size));
                        trace.phase("migration.reserve", asked, self.now(), Some(blocks));
                        m.on_reserved_prefix(self.now(), r);
                    }
                    TargetAction::WriteBlock { index, offset, data, checksum, .. } => {
                        use kvfleet_core::engine::EngineError as E;
                        let write = |reply| LiveCommand::WriteBlock {
                            request,
                            migration: id,
                            index,
                            offset,
                            data,
                            checksum,
                            reply,
                        };
                        match self.ask_raw(write).await {
                            Ok(()) => m.on_written(self.now(), index),
                            Err(DriverError::Arena(ArenaError::Checksum { .. })) => {
                                m.on_write_failed(self.now(), AbortReason::ChecksumMismatch { block: index })
                            }
                            Err(e @ DriverError::Engine(E::NoRoom { .. } | E::TooLarge { .. })) => {
                                m.on_write_failed(self.now(), AbortReason::TargetOutOfMemory(e.to_string()))
                            }
                            Err(e) => m.on_write_failed(self.now(), AbortReason::WriteFailed(e.to_string())),
                        }
                    }
                    TargetAction::Attach { state, .. } => {
                        let commit_at = self.now();
                        // The ledger refuses it if the coordinator settled the request as "not
                        // here" (checked on the engine thread with the attach: no resolve can
                        // slip in between), or if this worker's registration lapsed.
                        let r = match serde_json::from_slice(&state) {
                            Ok(st) => match self
                                .ask_raw(|reply| LiveCommand::AttachReserved {
                                    migration: id,
                                    state: Box::new(st),
                                    reply,
                                })
                                .await
                            {
                                Ok(verified) => Ok(verified),
                                Err(DriverError::Refused { refusal: refusal @ Refusal::Fenced, .. }) => {
                                    Err(AbortReason::AttachFailed(refusal.to_string()))
                                }
                                Err(e) => Err(AbortReason::AttachFailed(driver_reason(e))),
                            },
                            Err(e) => Err(AbortReason::AttachFailed(format!("state: {e}"))),
                        };
                        let now = self.now();
                        // Verification (every token's stamp) happens in the engine thread just
                        // before the attach: it reports where one ended and the other began.
                        let verified = r.as_ref().map_or(now, |&v| v);
                        let blocks = Some(u64::from(m.report().blocks_written));
                        trace.phase("migration.verify", commit_at, verified, blocks);
                        if r.is_ok() {
                            trace.phase("migration.attach", verified, now, None);
                        }
                        m.on_attached(now, r.map(|_| ()));
                    }
                    TargetAction::Release => {
                        // The ledger frees the reservation only if it is still this migration's.
                        let _ = self.commands.send(Command::Live(LiveCommand::Release { request, migration: id }));
                    }
                    TargetAction::Done(_) => {}
                }
            }
            if m.is_done() {
                break;
            }
            let deadline = m.poll_timeout().map(|t| tokio::time::Instant::from_std(self.clock.instant(t)));
            tokio::select! {
                f = frames.recv() => match f.flatten() {
                    Some(frame) => m.on_frame(self.now(), frame),
                    None => m.on_disconnect(self.now()),
                },
                f = data.recv() => match f {
                    Some((Frame { body: None }, _)) | None => m.on_disconnect(self.now()),
                    Some((frame, payload)) => m.on_frame_with_payload(self.now(), frame, payload),
                },
                _ = async { tokio::time::sleep_until(deadline.expect("guarded")).await }, if deadline.is_some() => {
                    m.on_timeout(self.now());
                }
            }
        }
        self.routes.lock().expect("routes lock").remove(&id.0);
        trace.finish(m.report(), self.now());
        let _ = ctl.finish().await;
        reader.abort();
        tracing::info!(%request, migration = %id, outcome = ?m.outcome(), "inbound live migration settled");
    }
}

/// Read a control stream in its own task (so a slow copy never stalls it): `Some(frame)` per
/// frame, then one `None` when the stream ends or fails.
fn spawn_control_reader(mut r: Reader) -> (tokio::task::JoinHandle<()>, mpsc::UnboundedReceiver<Option<Frame>>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        loop {
            match r.recv::<Frame>().await {
                Ok(Some(f)) => {
                    if tx.send(Some(f)).is_err() {
                        return;
                    }
                }
                _ => {
                    let _ = tx.send(None);
                    return;
                }
            }
        }
    });
    (task, rx)
}

/// A source's report as the coordinator's [`v1::MigrationStats`].
pub fn stats_proto(r: &MigrationReport, source: u32, target: u32) -> v1::MigrationStats {
    v1::MigrationStats {
        source,
        target,
        request_id: r.request.0,
        stages: r.stages.len() as u32,
        blocks: r.stages.iter().map(|s| s.blocks as u64).sum(),
        bytes: r.bytes,
        started_ns: r.started.unwrap_or(r.created).0,
        paused_ns: r.paused_at.map_or(0, |t| t.0),
        ended_ns: r.finished_at.map_or(0, |t| t.0),
        downtime_ns: r.downtime.map_or(0, |d| d.0),
        kv_tokens: r.kv_tokens_final.unwrap_or(r.kv_tokens_start),
        stage_bytes: r.stages.iter().map(|s| s.bytes).collect(),
        stage_ns: r.stages.iter().map(|s| s.ended.unwrap_or(s.started).0.saturating_sub(s.started.0)).collect(),
        abort_reason: match &r.outcome {
            Some(Outcome::Aborted(e)) | Some(Outcome::Unknown(e)) => e.to_string(),
            _ => String::new(),
        },
        in_doubt: matches!(r.outcome, Some(Outcome::Unknown(_))),
        checksum_mismatch: r.outcome.as_ref().is_some_and(Outcome::checksum_mismatch),
        bytes_skipped: r.bytes_skipped,
    }
}

/// A spawned task aborted when this handle is dropped (a plain `JoinHandle` detaches it).
struct Scoped<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for Scoped<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::Scoped;
    use std::time::Duration;

    /// A stage's per-stream tasks die with the copy that spawned them; a finished one still
    /// hands its result back.
    #[tokio::test]
    async fn a_dropped_scoped_task_is_aborted_and_an_awaited_one_returns() {
        // The task holds `alive` and never ends by itself: only an abort drops it.
        let (alive, gone) = tokio::sync::oneshot::channel::<()>();
        let task = Scoped(tokio::spawn(async move {
            let _alive = alive;
            std::future::pending::<()>().await;
        }));
        drop(task);
        let ended = tokio::time::timeout(Duration::from_secs(10), gone).await;
        assert!(matches!(ended, Ok(Err(_))), "still running after its handle was dropped");
        let mut done = Scoped(tokio::spawn(async { 7 }));
        assert_eq!((&mut done.0).await.unwrap(), 7);
    }
}
