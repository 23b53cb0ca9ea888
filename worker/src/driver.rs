//! The real-time engine loop: the `core` [`Engine`] driven by this host's clock.
//!
//! A thin shell in the quinn / quinn-proto sense: every scheduling decision
//! is the engine's; this loop only turns time and commands into engine calls and engine output into
//! arena writes and log events. Per iteration:
//!
//! 1. sleep until the iteration's modelled end, `epoch + end`. Deadline-based: the next iteration
//!    is planned from the modelled end, never from the wake-up time, so timer lateness delays token
//!    delivery but never accumulates into the schedule (the simulator's schedule, in real time);
//! 2. complete it: write each emitted token's KV into the arena (filling any gap: a prefill writes
//!    the whole prompt, a recomputed or re-materialised request everything), append its events
//!    (tokens per request, `</think>` boundaries, finished records) to the log;
//! 3. apply queued migrations-out (the engine accepts them only between iterations), plan the next
//!    iteration, and mirror the plan's offloads/reloads (the KV move journal) on the arena.
//!
//! The loop runs on its own OS thread, not as a tokio task: tokio's timer has 1 ms granularity
//! (measured on the 2-core dev host: `sleep_until` p50 1.1 ms, p99 2.0 ms late), which alone would
//! miss the p99 < 1 ms lateness target (every token of a late iteration is delivered late;
//! `kvfleet bench workers` counts the workers a host sustains under that bound); a thread blocked in
//! `recv_timeout` wakes ~0.1 ms late and also wakes at once for commands. Submits and attaches apply
//! immediately (the engine accepts them mid-iteration; they join at the next plan, as in the
//! simulator), so their RPCs answer fast.

use crate::arena::{ArenaError, KvArena, TokenContent};
use crate::clock::ClusterClock;
use crate::events::{EventLog, LogEvent, LogStats};
use crate::lateness::{LatenessHistogram, LatenessSummary};
use crate::ledger::{Admission, Arrival, Dropped, Ledger, LedgerError, Refusal, Resume};
use kvfleet_core::engine::sched::Phase;
use kvfleet_core::engine::{Engine, EngineError, EngineEvent, EngineStats, MigratedRequest, TokenEmitted};
use kvfleet_core::idmap::IdMap;
use kvfleet_core::kv::{prompt_block_hashes, BlockHash, KvEvent, PrefixStats, Tier};
use kvfleet_core::metrics::RequestRecord;
use kvfleet_core::policy::LoadReport;
use kvfleet_core::{RequestId, RequestSpec, Timestamp};
use kvfleet_netmodel::migration::MigrationId;
use kvfleet_proto::kv_events_to_proto;
use kvfleet_proto::v1;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// How often the requests held for a handoff are announced again: a decision about one that was
/// lost on its way (a release or a role change whose RPC failed, a leader that died) is taken
/// again, never left waiting.
pub(crate) const ANNOUNCE_HELD_EVERY: Duration = Duration::from_secs(2);

/// Commands served per loop turn while the driver is behind schedule.
const MAX_COMMANDS_PER_CATCH_UP: usize = 64;

/// How long after its end (real time) an iteration is completed and the next one planned (as of
/// that end): a request the leader placed just before the end is still on its way here (a
/// millisecond or two), and the simulator, which places and submits at one instant, has it
/// join the next iteration. Every token and report is this much later in real time, never in
/// cluster time; any command other than a submit completes the iteration first, and none is
/// given while a command waits for the iteration's end (a move out then starts at that end, as
/// in the simulator).
pub(crate) const SUBMIT_GRACE: Duration = Duration::from_millis(3);

/// The longest a request can have been on its way from its arrival to this worker, cluster ns:
/// an idle engine plans a request that arrived at most this long ago (and after the engine's
/// last change) as of its arrival (250 ms: a first submit on a new channel took 90 ms here),
/// any other as of now.
const MAX_SUBMIT_DELAY_NS: u64 = 250_000_000;

/// Why the coordinator cancels a request on this instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CancelKind {
    /// Its client left ([`Ledger::cancel`]).
    ClientLeft,
    /// This copy is one the cluster does not count ([`Ledger::drop_copy`]).
    Superseded,
    /// This copy finished, and its record was refused as a late copy's: only that is forgotten
    /// ([`Ledger::forget_finished`]).
    LateRecord,
}

/// What the gRPC service asks of the driver.
#[derive(Debug)]
pub(crate) enum Command {
    Submit {
        spec: RequestSpec,
        reply: oneshot::Sender<SubmitOutcome>,
    },
    MigrateOut {
        request: RequestId,
        reply: oneshot::Sender<Result<MigratedOut, DriverError>>,
    },
    Attach {
        state: Box<MigratedRequest>,
        rematerialized: bool,
        reply: oneshot::Sender<Result<(), DriverError>>,
    },
    Drain {
        reply: oneshot::Sender<u32>,
    },
    /// Stop or forget a copy of the request, as [`CancelKind`] says; `Ok(true)` when there was
    /// one to stop (or forget).
    Cancel {
        request: RequestId,
        kind: CancelKind,
        reply: oneshot::Sender<Result<bool, String>>,
    },
    /// Prefill/decode disaggregation: hold every request after its prefill for a handoff
    /// (`hand_off`), announcing the ones held already again; or decode them here. Replies how many
    /// are held.
    SetRole {
        role: String,
        hand_off: bool,
        reply: oneshot::Sender<u32>,
    },
    /// Decode a request held after its prefill here after all.
    Release {
        request: RequestId,
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// Live migration (see [`live`]).
    Live(LiveCommand),
    /// The registration expired in etcd: drop what runs here ([`Ledger::lapse`]); replies how
    /// many requests were dropped.
    Expired {
        reply: oneshot::Sender<usize>,
    },
    /// The registration was lost (`false`) or is held again: see [`Ledger::set_registered`].
    Registration {
        registered: bool,
    },
    Load {
        reply: oneshot::Sender<LoadReport>,
    },
    Stats {
        reply: oneshot::Sender<DriverStats>,
    },
    /// Stop accepting work; stop once empty or after `grace`.
    Shutdown {
        grace: Duration,
    },
    /// Check every written token of every request against the engine's block tables.
    #[cfg(test)]
    VerifyAll {
        reply: oneshot::Sender<Result<u64, String>>,
    },
}

impl Command {
    /// Whether it may change the engine (anything but a submit, which may join an iteration
    /// that ended in the grace, and the questions).
    fn changes_engine(&self) -> bool {
        match self {
            Command::Load { .. } | Command::Stats { .. } | Command::Registration { .. } | Command::Submit { .. } => {
                false
            }
            #[cfg(test)]
            Command::VerifyAll { .. } => false,
            _ => true,
        }
    }

    /// Whether it moves a migration's bytes and nothing else: reading, waiting for or writing a
    /// request's KV blocks changes nothing an idle engine would plan (the blocks are held, lent
    /// or reserved already), so a request that arrived before it is still planned as of its
    /// arrival ([`Driver::quiet_since`]).
    fn moves_bytes_only(&self) -> bool {
        matches!(
            self,
            Command::Live(LiveCommand::ReadBlocks { .. } | LiveCommand::WaitKv { .. } | LiveCommand::WriteBlock { .. })
        )
    }
}

/// The answer to a submit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SubmitOutcome {
    /// Handed to the engine.
    Accepted,
    /// Already accepted earlier (submits are idempotent by id).
    Duplicate,
    /// Not accepted; a rejection that is final (too large) also put a rejected record in the log.
    Rejected(String),
}

/// Why the driver refused or failed a command.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// The request is not held on this instance.
    #[error("{0} is not on this instance")]
    Unknown(RequestId),
    /// The instance is draining (or its engine loop has stopped).
    #[error("the instance is draining and accepts no requests")]
    Draining,
    /// The engine refused the operation.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A request's KV failed verification against its deterministic content (before moving it
    /// out, or on arrival by a live migration).
    #[error("KV of {request} failed verification before migrating out: {cause}")]
    KvCorrupt {
        /// The request whose KV is wrong.
        request: RequestId,
        /// The first mismatch, or the arena error.
        cause: ArenaError,
    },
    /// The request's engine state could not be serialised for a migration.
    #[error("cannot serialize the state of {request}: {message}")]
    Serialize {
        /// The request.
        request: RequestId,
        /// The serde error.
        message: String,
    },
    /// The request's KV is not in a state the operation needs (not written yet, being rewritten,
    /// incomplete), or the ledger's `AlreadyComingIn` / `AlreadyRun` refusals.
    #[error("KV of {request}: {message}")]
    Kv {
        /// The request.
        request: RequestId,
        /// What is wrong with its KV.
        message: String,
    },
    /// The request ledger refused the arrival or move.
    #[error("{request}: {refusal}")]
    Refused {
        /// The request.
        request: RequestId,
        /// The ledger's reason.
        refusal: Refusal,
    },
    /// An event the ledger found impossible in the request's state (a bug).
    #[error("request ledger: {0}")]
    Ledger(#[from] LedgerError),
    /// A KV arena operation failed.
    #[error("arena: {0}")]
    Arena(#[from] ArenaError),
}

/// A request handed over by `MigrateOut`.
#[derive(Clone, Debug)]
pub struct MigratedOut {
    /// serde JSON of [`MigratedRequest`].
    pub state: Vec<u8>,
    /// Tokens of KV the request held on the source (re-materialised on the target).
    pub kv_tokens: u32,
    /// Bytes of that KV (`kv_tokens × kv_bytes_per_token`).
    pub kv_bytes: u64,
}

/// Arena activity counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvStats {
    /// Tokens whose KV was written into the arena.
    pub tokens_written: u64,
    /// Blocks copied between tiers (offloads, reloads) or written from an inbound live migration.
    pub blocks_copied: u64,
    /// Tokens checked against their deterministic content (moves with `--verify-kv`, migrations).
    pub tokens_verified: u64,
    /// Prompt tokens found already written in a shared block (a prefix-cache hit): not written.
    pub tokens_reused: u64,
    /// Verification failures and arena errors (each logged): must stay 0.
    pub errors: u64,
}

/// A snapshot of the driver.
#[derive(Clone, Debug, Default)]
pub struct DriverStats {
    /// Timer lateness of the engine loop's wake-ups.
    pub lateness: LatenessSummary,
    /// The engine's counters (iterations, tokens, preemptions, ...).
    pub engine: EngineStats,
    /// Requests on the instance (running, waiting, offloaded).
    pub requests: usize,
    /// Arena activity.
    pub kv: KvStats,
    /// Event log counters.
    pub log: LogStats,
    /// Whether the instance is draining.
    pub draining: bool,
    /// Latency histograms of finished requests (Prometheus).
    pub requests_metrics: crate::metrics::RequestMetrics,
    /// The prefix cache's counters (queries, hits, evictions).
    pub prefix: PrefixStats,
}

/// What the driver left behind when it stopped.
#[derive(Clone, Debug, Default)]
pub struct DriverReport {
    /// The last snapshot, at exit.
    pub stats: DriverStats,
    /// Requests still on the instance at exit (reported unfinished; the coordinator re-places them).
    pub unfinished: Vec<RequestId>,
}

/// The migration id of a request moved whole by `MigrateOut` (KV re-materialised on the target):
/// live migrations number theirs from 1.
const WHOLE_MOVE: MigrationId = MigrationId(0);

/// A ledger's "no" as the driver's error, with the texts peers already know.
pub(crate) fn refused(request: RequestId, refusal: Refusal) -> DriverError {
    match refusal {
        Refusal::NotHere => DriverError::Unknown(request),
        Refusal::Draining => DriverError::Draining,
        Refusal::AlreadyHere => DriverError::Engine(EngineError::Duplicate(request)),
        Refusal::AlreadyComingIn | Refusal::AlreadyRun => DriverError::Kv { request, message: refusal.to_string() },
        refusal => DriverError::Refused { request, refusal },
    }
}

/// How far a request's KV is written in the arena, and where.
#[derive(Debug, Default)]
struct Written {
    tier: Option<Tier>,
    /// The block table the content was written through (a prefix of the engine's).
    blocks: Vec<u32>,
    /// Context positions 0..tokens hold their content.
    tokens: u32,
    /// Content hashes of its full prompt blocks ([`TokenContent::shared`]): what the prefix
    /// cache shares between requests holds the same bytes whoever wrote it.
    shared: Box<[BlockHash]>,
}

impl Written {
    /// Nothing written yet for a request whose prompt blocks hash to `shared`.
    fn new(tier: Option<Tier>, shared: Box<[BlockHash]>) -> Written {
        Written { tier, blocks: Vec::new(), tokens: 0, shared }
    }
    fn content(&self, request: RequestId) -> TokenContent<'_> {
        TokenContent { request, shared: &self.shared }
    }
}

/// Content hashes of `spec`'s full prompt blocks of `block_size` tokens: whether or not this
/// instance caches prefixes, equal prompt blocks are equal bytes (a migration's two ends agree).
pub(crate) fn shared_blocks(spec: &RequestSpec, block_size: u32) -> Box<[BlockHash]> {
    prompt_block_hashes(&spec.content_ids, spec.prompt_tokens, block_size).into_boxed_slice()
}

pub(crate) struct DriverConfig {
    pub engine: Engine,
    pub arena: KvArena,
    pub clock: ClusterClock,
    pub log: Arc<EventLog>,
    pub load_interval: Duration,
    pub verify_kv: bool,
    /// How often held requests are announced again ([`ANNOUNCE_HELD_EVERY`]).
    pub announce_every: Duration,
    /// How long after its end an iteration is completed ([`SUBMIT_GRACE`]).
    pub submit_grace: Duration,
    /// A move following a prefill follows it layer by layer, in this many layer groups, and a
    /// prefill instance reports each prefill when its first iteration starts; 1: whole blocks,
    /// reported when its first chunk ends (`[pd] overlap = "layer"` vs `"chunk"`).
    pub layer_groups: u32,
}

pub(crate) struct Driver {
    engine: Engine,
    arena: KvArena,
    clock: ClusterClock,
    log: Arc<EventLog>,
    load_interval: Duration,
    submit_grace: Duration,
    verify_kv: bool,
    instance: u32,
    block_size: u32,
    /// [`DriverConfig::layer_groups`].
    layer_groups: u32,
    written: IdMap<RequestId, Written>,
    /// Where every request stands on this instance (the engine has no iterator over them).
    ledger: Ledger,
    /// Migrations-out waiting for the iteration in flight to end.
    pending: Vec<Command>,
    /// Live commands that wait for their request: a move following a prefill waits for it to
    /// write more KV or to end ([`Driver::waits_for_its_request`]); checked again after each
    /// iteration and command.
    waiting: Vec<LiveCommand>,
    stop_at: Option<Instant>,
    commands_closed: bool,
    next_load: Instant,
    /// The load last published: a changed one is published at once (the simulator's controller
    /// sees every change at once), an unchanged one every `load_interval` as a heartbeat.
    last_load: Option<LoadReport>,
    /// The `due_ns` last published: when the iteration in flight ends (0: idle). A new one is
    /// published even with an unchanged load, so a leader waiting for this instance's load as of
    /// a later instant hears that nothing changed.
    last_due_ns: u64,
    /// Cluster time since which nothing but submits changed the engine (the end of its last
    /// iteration, or the last other command): an idle engine given a request that arrived since
    /// plans it as of its arrival, as the simulator does (the request's way here, a millisecond
    /// or, on a new channel, a hundred, would otherwise delay its whole timeline).
    quiet_since: Timestamp,
    /// When the requests held for a handoff are next announced again ([`ANNOUNCE_HELD_EVERY`]).
    next_announce: Instant,
    announce_every: Duration,
    last_preemptions: u64,
    lateness: LatenessHistogram,
    kv_stats: KvStats,
    request_metrics: crate::metrics::RequestMetrics,
    tokens: Vec<TokenEmitted>,
    events: Vec<EngineEvent>,
    out: Vec<LogEvent>,
    kv_events: Vec<KvEvent>,
}

impl Driver {
    pub(crate) fn new(cfg: DriverConfig) -> Driver {
        let mut engine = cfg.engine;
        engine.enable_kv_journal();
        if engine.config().prefix_caching {
            // Whatever a leader knew of this instance's cache (a worker that restarted) is gone.
            let cleared = kv_events_to_proto(engine.instance(), &[KvEvent::AllCleared]);
            cfg.log.push(LogEvent::KvEvents(Box::new(cleared)));
        }
        Driver {
            instance: engine.instance().0,
            block_size: engine.config().block_size,
            engine,
            arena: cfg.arena,
            clock: cfg.clock,
            log: cfg.log,
            load_interval: cfg.load_interval.max(Duration::from_millis(1)),
            submit_grace: cfg.submit_grace,
            verify_kv: cfg.verify_kv,
            layer_groups: cfg.layer_groups.clamp(1, kvfleet_netmodel::migration::MAX_LAYER_GROUPS),
            written: IdMap::default(),
            ledger: Ledger::new(),
            pending: Vec::new(),
            waiting: Vec::new(),
            stop_at: None,
            commands_closed: false,
            next_load: Instant::now(),
            next_announce: Instant::now() + cfg.announce_every,
            announce_every: cfg.announce_every,
            last_load: None,
            last_due_ns: 0,
            quiet_since: Timestamp::ZERO,
            last_preemptions: 0,
            lateness: LatenessHistogram::new(),
            kv_stats: KvStats::default(),
            request_metrics: crate::metrics::RequestMetrics::default(),
            tokens: Vec::new(),
            events: Vec::new(),
            out: Vec::new(),
            kv_events: Vec::new(),
        }
    }

    /// Run until shut down (a `Shutdown` command, or every command sender dropped).
    pub(crate) fn run(mut self, rx: Receiver<Command>) -> DriverReport {
        loop {
            self.end_returned_leases();
            if let Some(stop) = self.stop_at {
                if self.ledger.held() == 0 || Instant::now() >= stop {
                    break;
                }
            }
            let mut until = self.next_load;
            if let Some(end) = self.engine.next_wake() {
                until = until.min(self.clock.instant(end) + self.grace());
            }
            // A move following a prefill layer by layer hears of each layer group as it is done.
            let layer_wake = self.next_layer_group();
            if let Some(at) = layer_wake {
                until = until.min(self.clock.instant(at));
            }
            if let Some(stop) = self.stop_at {
                until = until.min(stop);
            }
            let now = Instant::now();
            if until > now {
                if self.commands_closed {
                    std::thread::sleep(until - now);
                } else {
                    match rx.recv_timeout(until - now) {
                        Ok(cmd) => self.on_command(cmd),
                        Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => {
                            self.commands_closed = true;
                            self.begin_stop(Duration::ZERO);
                        }
                    }
                }
            } else if !self.commands_closed {
                // Behind schedule (catching up on overdue iterations): still serve what is queued,
                // so RPCs do not stall for as long as the host is overloaded.
                for _ in 0..MAX_COMMANDS_PER_CATCH_UP {
                    let Ok(cmd) = rx.try_recv() else { break };
                    self.on_command(cmd);
                }
            }
            if let Some(end) = self.engine.next_wake() {
                let deadline = self.clock.instant(end) + self.grace();
                let woke = Instant::now();
                if woke >= deadline {
                    self.lateness.record(woke - deadline);
                    self.complete(end);
                }
            }
            if layer_wake.is_some_and(|at| Instant::now() >= self.clock.instant(at)) {
                self.recheck_waiting();
            }
            self.publish_load();
        }
        let unfinished = self.ledger.unfinished();
        if !unfinished.is_empty() {
            tracing::warn!(count = unfinished.len(), requests = ?unfinished, "stopping with requests unfinished; the coordinator re-places them");
        }
        self.log.close();
        DriverReport { stats: self.stats(), unfinished }
    }

    /// Publish the load if it changed (an iteration ended, a request arrived, blocks were
    /// reserved) or the heartbeat is due.
    fn publish_load(&mut self) {
        self.flush_kv_events();
        let now = Instant::now();
        if now >= self.next_announce {
            self.next_announce = now + self.announce_every;
            self.announce_held();
        }
        let load = self.engine.load_report();
        let due_ns = self.engine.next_wake().map_or(0, |t| t.0);
        let heartbeat = now >= self.next_load;
        if !heartbeat && self.last_load.as_ref() == Some(&load) && self.last_due_ns == due_ns {
            return;
        }
        self.push_load(load, due_ns);
        self.next_load = now + self.load_interval;
    }

    /// Publish `load`, saying when this instance's next report is due (`due_ns`, cluster time;
    /// 0: none foreseen).
    fn push_load(&mut self, load: LoadReport, due_ns: u64) {
        let report = v1::LoadReport { due_ns, ..v1::LoadReport::from(&load) };
        self.log.push(LogEvent::Load(Box::new(report)));
        self.last_load = Some(load);
        self.last_due_ns = due_ns;
    }

    /// Append what the prefix cache stored and evicted since the last call to the log (the
    /// leader's prefix index follows it), ahead of the load report that reflects it.
    fn flush_kv_events(&mut self) {
        let mut events = std::mem::take(&mut self.kv_events);
        self.engine.drain_kv_events(&mut events);
        if !events.is_empty() {
            self.log.push(LogEvent::KvEvents(Box::new(kv_events_to_proto(self.engine.instance(), &events))));
            events.clear();
        }
        self.kv_events = events;
    }

    fn stats(&self) -> DriverStats {
        DriverStats {
            lateness: self.lateness.summary(),
            engine: self.engine.stats().clone(),
            requests: self.engine.len(),
            kv: self.kv_stats,
            log: self.log.stats(),
            draining: self.ledger.is_draining(),
            requests_metrics: self.request_metrics.clone(),
            prefix: self.engine.kv().prefix_stats(),
        }
    }

    fn begin_stop(&mut self, grace: Duration) {
        self.ledger.drain();
        let at = Instant::now() + grace;
        self.stop_at = Some(self.stop_at.map_or(at, |s| s.min(at)));
    }

    fn on_command(&mut self, cmd: Command) {
        self.end_returned_leases();
        if cmd.changes_engine() {
            // An iteration that ended (its grace for submits running) completes first.
            if let Some(end) = self.engine.next_wake().filter(|&end| end <= self.clock.now()) {
                self.complete(end);
            }
            if !cmd.moves_bytes_only() {
                self.quiet_since = self.clock.now();
            }
        }
        match cmd {
            Command::Load { reply } => {
                let _ = reply.send(self.engine.load_report());
            }
            Command::Stats { reply } => {
                let _ = reply.send(self.stats());
            }
            Command::Drain { reply } => {
                self.ledger.drain();
                let _ = reply.send(self.ledger.held() as u32);
            }
            Command::Cancel { request, kind: CancelKind::LateRecord, reply } => {
                let forgot = self.ledger.forget_finished(request);
                if forgot {
                    tracing::info!(
                        request = request.0,
                        "forgot a finished copy whose record was refused as a late copy's"
                    );
                }
                let _ = reply.send(Ok(forgot));
            }
            Command::Cancel { request, kind: CancelKind::Superseded, reply } => {
                let dropped = self.ledger.drop_copy(request);
                let _ = reply.send(self.drop_on_engine(request, dropped).map_err(|e| e.to_string()));
            }
            Command::Cancel { request, kind: CancelKind::ClientLeft, reply } => {
                let answer = match self.ledger.cancel(request) {
                    Ok(true) => match self.engine.cancel(request) {
                        Ok(()) => {
                            self.written.remove(&request);
                            tracing::info!(request = request.0, "cancelled: its client left");
                            Ok(true)
                        }
                        Err(e) => Err(e.to_string()),
                    },
                    Ok(false) => Ok(false),
                    Err(e) => Err(e.to_string()),
                };
                let _ = reply.send(answer);
            }
            Command::Registration { registered } => {
                if registered != self.ledger.is_registered() {
                    if registered {
                        tracing::info!("registered again: accepting requests by migration");
                    } else {
                        tracing::warn!("registration lapsed: refusing requests by migration until registered again");
                    }
                }
                self.ledger.set_registered(registered);
            }
            Command::Expired { reply } => {
                self.ledger.set_registered(false);
                // Finished here, its record not acknowledged: the coordinator re-placed it and
                // refuses that record as a late copy's.
                let unheard: Vec<RequestId> = self.log.unacked_finished().into_iter().map(RequestId).collect();
                let dropped: Vec<RequestId> = self
                    .ledger
                    .lapse(&unheard)
                    .into_iter()
                    .map(|(id, d)| {
                        if let Err(e) = self.drop_on_engine(id, d) {
                            tracing::error!(request = id.0, "dropping after the registration expired: {e}");
                        }
                        id
                    })
                    .collect();
                if !dropped.is_empty() {
                    tracing::warn!(
                        count = dropped.len(),
                        requests = ?dropped,
                        "registration expired: dropped the requests held here (the coordinator re-places them)"
                    );
                }
                let _ = reply.send(dropped.len());
            }
            Command::SetRole { role, hand_off, reply } => {
                if hand_off != self.engine.hands_off() {
                    tracing::info!(role, hand_off, "role set");
                }
                self.engine.set_hand_off(hand_off);
                // Announced again: a leader that took over since may have missed the first event.
                let held = self.announce_held();
                let _ = reply.send(held as u32);
                self.plan_if_idle();
            }
            Command::Release { request, reply } => {
                let _ = reply.send(self.engine.release_held(request).map_err(|e| e.to_string()));
                self.plan_if_idle();
            }
            Command::Shutdown { grace } => self.begin_stop(grace),
            #[cfg(test)]
            Command::VerifyAll { reply } => {
                let _ = reply.send(self.verify_all());
            }
            Command::Submit { spec, reply } => {
                let arrival = spec.arrival;
                let _ = reply.send(self.submit(spec));
                // Idle (a submit plans nothing, so no iteration was in flight before it either).
                if self.engine.needs_step() {
                    // As of its arrival if it is on its way from that arrival to an engine idle
                    // since before it; a request arriving long before (re-placed after its
                    // worker died, resubmitted by a new leader) or before the engine's last
                    // change starts now: nothing ran it meanwhile.
                    let now = self.clock.now();
                    let late_by = now.0.saturating_sub(arrival.0);
                    let on_its_way = late_by <= MAX_SUBMIT_DELAY_NS && self.quiet_since <= arrival;
                    tracing::debug!(
                        target: "kvfleet::iterations",
                        arrival_ns = arrival.0,
                        late_by_ns = late_by,
                        quiet_since_ns = self.quiet_since.0,
                        as_of_arrival = on_its_way,
                        "submit to an idle engine"
                    );
                    self.plan(if on_its_way { arrival.min(now) } else { now });
                } else {
                    tracing::debug!(
                        target: "kvfleet::iterations",
                        arrival_ns = arrival.0,
                        now_ns = self.clock.now().0,
                        in_flight_until_ns = self.engine.next_wake().map_or(0, |t| t.0),
                        "submit to a busy engine"
                    );
                }
            }
            Command::Attach { state, rematerialized, reply } => {
                let _ = reply.send(self.attach(*state, rematerialized));
                self.plan_if_idle();
            }
            Command::MigrateOut { request, reply } => {
                // A request held for its handoff is out of the iteration in flight: it leaves now.
                // So does one whose prefill runs: the move follows it, copying only what its
                // chunks wrote, and pauses it at its end.
                let at_once = self.engine.is_held(request) || self.engine.prompt_written(request).is_some();
                if self.engine.next_wake().is_some() && !at_once {
                    self.pending.push(Command::MigrateOut { request, reply });
                } else {
                    let _ = reply.send(self.migrate_out(request));
                    self.plan_if_idle();
                }
            }
            Command::Live(cmd @ LiveCommand::PauseOut { request, .. })
                if self.engine.next_wake().is_some() && !self.engine.is_held(request) =>
            {
                self.pending.push(Command::Live(cmd));
            }
            Command::Live(cmd) if self.waits_for_its_request(&cmd) => self.waiting.push(cmd),
            Command::Live(cmd) => {
                self.on_live(cmd);
                self.plan_if_idle();
            }
        }
        self.recheck_waiting();
    }

    /// After a command: carry out the waiting commands that need not wait any more.
    fn recheck_waiting(&mut self) {
        if !self.waiting.is_empty() {
            self.run_waiting();
            self.plan_if_idle();
        }
    }

    /// Carry out the waiting commands that need not wait any more (no planning).
    fn run_waiting(&mut self) {
        for cmd in std::mem::take(&mut self.waiting) {
            if self.waits_for_its_request(&cmd) {
                self.waiting.push(cmd);
            } else {
                self.on_live(cmd);
            }
        }
    }

    /// How long after its end the iteration in flight completes: the submit grace, none when a
    /// command waits for that end (a move out starts at the iteration's end, as in the simulator).
    fn grace(&self) -> Duration {
        if self.pending.is_empty() {
            self.submit_grace
        } else {
            Duration::ZERO
        }
    }

    fn plan_if_idle(&mut self) {
        if self.engine.needs_step() {
            let now = self.clock.now();
            self.plan(now);
        }
    }

    fn plan(&mut self, now: Timestamp) {
        let end = self.engine.plan_iteration(now);
        if let Some(end) = end {
            // Each iteration's timeline beside the host clock, to compare with the simulator's.
            tracing::debug!(
                target: "kvfleet::iterations",
                start_ns = now.0,
                end_ns = end.0,
                behind_ns = self.clock.now().0.saturating_sub(now.0),
                "iteration planned"
            );
        }
        if self.layer_groups > 1 {
            // A handoff following the prefill layer by layer may start with its first iteration.
            for (request, kv_blocks) in self.engine.prefills_starting() {
                let at_ns = self.engine.prefill_in_flight(request).map_or(now, |f| f.start).0;
                let instance = self.instance;
                let started = v1::PrefillStarted { request_id: request.0, instance, kv_blocks, at_ns };
                self.log.push(LogEvent::PrefillStarted(started));
            }
        }
        for m in self.engine.drain_kv_moves() {
            if let Err(e) = self.arena.copy_blocks(&m) {
                self.kv_error(m.request, &e);
                self.written.remove(&m.request);
                continue;
            }
            self.kv_stats.blocks_copied += m.from.len() as u64;
            let Some(w) = self.written.get_mut(&m.request) else { continue };
            if w.tier == Some(m.from_tier) && m.from.starts_with(&w.blocks) {
                w.tier = Some(m.to_tier);
                let n = w.blocks.len();
                w.blocks.clear();
                w.blocks.extend_from_slice(&m.to[..n]);
            } else {
                // Not the blocks we wrote through: rewrite from scratch on its next token.
                *w = Written::new(None, std::mem::take(&mut w.shared));
                continue;
            }
            if self.verify_kv {
                let checked =
                    verify_written(&self.arena, self.block_size, m.to_tier, &w.blocks, w.content(m.request), w.tokens);
                match checked {
                    Ok(n) => self.kv_stats.tokens_verified += n,
                    Err(e) => self.kv_error(m.request, &e),
                }
            }
        }
        // A request preempted without CPU room lost its KV (it recomputes when it runs again):
        // forget what was written for it, its next blocks may differ.
        let preemptions = self.engine.stats().preemptions;
        if preemptions != self.last_preemptions {
            self.last_preemptions = preemptions;
            let kv = self.engine.kv();
            self.written.retain(|id, _| kv.table(*id).is_some());
        }
    }

    /// Every request's written tokens sit where the engine's block table says, with the right bytes.
    #[cfg(test)]
    fn verify_all(&self) -> Result<u64, String> {
        // The ledger holds exactly what the engine holds.
        if self.ledger.held() != self.engine.len() {
            return Err(format!("the ledger holds {} requests, the engine {}", self.ledger.held(), self.engine.len()));
        }
        if let Some(id) = self.ledger.unfinished().into_iter().find(|&id| !self.engine.contains(id)) {
            return Err(format!("{id}: held by the ledger, unknown to the engine"));
        }
        let mut verified = 0;
        for (&id, w) in &self.written {
            let table = self.engine.kv().table(id).ok_or(format!("{id}: written but holds no KV"))?;
            if w.tier != Some(table.tier) || !table.blocks.starts_with(&w.blocks) {
                return Err(format!(
                    "{id}: written through {:?} {:?}, engine has {:?} {:?}",
                    w.tier, w.blocks, table.tier, table.blocks
                ));
            }
            verified +=
                verify_written(&self.arena, self.block_size, table.tier, &table.blocks, w.content(id), w.tokens)
                    .map_err(|e| e.to_string())?;
        }
        Ok(verified)
    }

    fn kv_error(&mut self, request: RequestId, e: &ArenaError) {
        self.kv_stats.errors += 1;
        tracing::error!(%request, error = %e, "KV arena out of step with the engine");
    }

    /// Write `content`'s tokens `tokens` into `block` of `tier` (counted as written); `false`
    /// after an arena error (counted and logged). An associated function, so that callers can
    /// hold other fields (the written-so-far table their content borrows).
    fn write_tokens(
        arena: &mut KvArena,
        stats: &mut KvStats,
        (tier, block): (Tier, u32),
        content: TokenContent<'_>,
        tokens: std::ops::Range<u32>,
    ) -> bool {
        let count = tokens.len() as u64;
        for p in tokens {
            if let Err(e) = arena.write_token(tier, block, content, p) {
                stats.errors += 1;
                tracing::error!(request = %content.request, error = %e, "KV arena out of step with the engine");
                return false;
            }
        }
        stats.tokens_written += count;
        true
    }

    /// Make context positions `0..upto` of `request` hold their content in the arena.
    fn write_kv(&mut self, request: RequestId, upto: u32) {
        let bs = self.block_size;
        let Some(table) = self.engine.kv().table(request) else {
            self.written.remove(&request);
            return;
        };
        let engine = &self.engine;
        let w = self.written.entry(request).or_insert_with(|| {
            Written::new(Some(table.tier), engine.spec(request).map(|s| shared_blocks(s, bs)).unwrap_or_default())
        });
        if w.tier != Some(table.tier) || !table.blocks.starts_with(&w.blocks) {
            *w = Written::new(Some(table.tier), std::mem::take(&mut w.shared));
        }
        if w.blocks.len() < table.blocks.len() {
            w.blocks.extend_from_slice(&table.blocks[w.blocks.len()..]);
        }
        let upto = upto.min((w.blocks.len() as u64 * bs as u64).min(u32::MAX as u64) as u32);
        let tier = table.tier;
        let content = TokenContent { request, shared: &w.shared };
        let mut pos = w.tokens;
        while pos < upto {
            let k = pos / bs;
            let end = (k as u64 * bs as u64 + bs as u64).min(upto as u64) as u32;
            let block = w.blocks[k as usize];
            // A whole shared prompt block that another request wrote (a prefix-cache hit) holds
            // its content already: checked by its stamps, never trusted.
            let whole_shared = pos.is_multiple_of(bs) && end - pos == bs && (k as usize) < w.shared.len();
            if whole_shared && self.arena.verify_stamps(tier, block, content, pos, bs).is_ok() {
                self.kv_stats.tokens_reused += bs as u64;
            } else if !Self::write_tokens(&mut self.arena, &mut self.kv_stats, (tier, block), content, pos..end) {
                return;
            }
            pos = end;
            w.tokens = pos;
        }
    }

    /// The iteration ending at `end` is due.
    fn complete(&mut self, end: Timestamp) {
        tracing::debug!(
            target: "kvfleet::iterations",
            end_ns = end.0,
            late_ns = self.clock.now().0.saturating_sub(end.0),
            "iteration completed"
        );
        let mut tokens = std::mem::take(&mut self.tokens);
        let mut events = std::mem::take(&mut self.events);
        let mut out = std::mem::take(&mut self.out);
        tokens.clear();
        events.clear();
        out.clear();
        self.engine.complete_iteration_tokens(end, &mut events, &mut tokens);
        self.quiet_since = self.quiet_since.max(end);
        for t in &tokens {
            out.push(LogEvent::Tokens(v1::Tokens {
                request_id: t.request.0,
                first_index: t.index,
                count: 1,
                phase: proto_phase(t.phase) as i32,
                at_ns: end.0,
                instance: self.instance,
            }));
        }
        let mut finished = Vec::new();
        for e in events.drain(..) {
            match e {
                EngineEvent::PhaseBoundary { request, kv_blocks } => out.push(LogEvent::Boundary(v1::PhaseBoundary {
                    request_id: request.0,
                    instance: self.instance,
                    kv_blocks,
                    at_ns: end.0,
                })),
                EngineEvent::Finished(record) => {
                    self.request_metrics.observe(&record);
                    let id = record.id;
                    finished.push(id);
                    let remat = self.ledger.finished(id).unwrap_or_else(|e| {
                        tracing::error!("{e}");
                        false
                    });
                    out.push(LogEvent::Finished(Box::new(proto_record(&record, remat))));
                }
                // A prefill instance (`Command::SetRole`) holds the request for its handoff.
                EngineEvent::PrefillDone { request, kv_blocks } => out.push(self.prefill_done(request, kv_blocks, end)),
                // Its handoff may start now and follow the prefill.
                EngineEvent::PrefillStarted { request, kv_blocks } => {
                    out.push(LogEvent::PrefillStarted(v1::PrefillStarted {
                        request_id: request.0,
                        instance: self.instance,
                        kv_blocks,
                        at_ns: end.0,
                    }))
                }
            }
        }
        if out.iter().any(|e| matches!(e, LogEvent::Boundary(_))) {
            self.flush_kv_events();
            // The leader decides a `</think>` move on the loads it holds when the boundary arrives:
            // this instance's must already include the iteration that produced it (the simulator
            // refreshes the same load, after the iteration and before the next plan). Published
            // after the boundary, the request still counted as reasoning here, so Alg. 2 saw one
            // reasoning request too many and moved requests the simulator kept.
            // Due at `end` itself: the report after the next plan follows at once.
            let load = self.engine.load_report();
            self.push_load(load, end.0);
        }
        self.log.extend(out.drain(..));
        // The iteration's KV bytes, written after its events are out: a whole prompt's KV takes
        // this host tens of milliseconds to write (150 MiB at a few GB/s), which a GPU spends inside
        // the iteration, and the leader's decisions on those events (a prefill's handoff, a
        // `</think>` move) waited for it. Nothing reads them before: every command that does (a
        // move's reads) runs on this thread, after this. A request that finished has no blocks
        // left to write.
        for t in &tokens {
            self.write_kv(t.request, t.context_tokens);
        }
        for id in finished {
            self.written.remove(&id);
        }
        for cmd in std::mem::take(&mut self.pending) {
            match cmd {
                Command::MigrateOut { request, reply } => {
                    let _ = reply.send(self.migrate_out(request));
                }
                Command::Live(cmd) if self.waits_for_its_request(&cmd) => self.waiting.push(cmd),
                Command::Live(cmd) => self.on_live(cmd),
                _ => {}
            }
        }
        self.run_waiting();
        if self.engine.needs_step() {
            self.plan(end);
        }
        self.tokens = tokens;
        self.events = events;
        self.out = out;
    }

    fn submit(&mut self, spec: RequestSpec) -> SubmitOutcome {
        let id = spec.id;
        match self.ledger.submit(id) {
            Admission::AlreadyAccepted => return SubmitOutcome::Duplicate,
            Admission::Refuse(refusal) => return SubmitOutcome::Rejected(refusal.to_string()),
            Admission::Run { release: None } => {}
            Admission::Run { release: Some(migration) } => {
                // A live migration of this request was coming in when its source died, and the
                // leader re-placed it here from the start: the stale reservation goes (the
                // migration, whose source is gone, aborts on its next frame or its deadline)
                // before the fresh copy runs.
                let freed = self.engine.release_reservation(id);
                tracing::warn!(request = %id, %migration, freed, "re-placed here while a migration of it was coming in; reservation released");
            }
        }
        let record = RequestRecord {
            id,
            arrival: spec.arrival,
            prompt_tokens: spec.prompt_tokens,
            reasoning_tokens: spec.reasoning_tokens,
            answer_tokens: spec.answer_tokens,
            placed_on: self.engine.instance(),
            rejected: true,
            ..RequestRecord::default()
        };
        let now = self.clock.now();
        // Two processes' cluster clocks agree only to within their anchoring error: a request
        // stamped in this worker's future arrived, for its engine, now (else its first token could
        // precede its arrival and its TTFT read 0).
        let spec = RequestSpec { arrival: spec.arrival.min(now), ..spec };
        match self.engine.submit(now, spec) {
            Ok(()) => {
                ledger_step(self.ledger.started(id));
                SubmitOutcome::Accepted
            }
            Err(e @ EngineError::TooLarge { .. }) => {
                // Final: it can never run here. The leader learns it from the log like a finish.
                let reason = e.to_string();
                self.request_metrics.observe(&record);
                ledger_step(self.ledger.rejected(id, reason.clone()));
                self.log.push(LogEvent::Finished(Box::new(proto_record(&record, false))));
                SubmitOutcome::Rejected(reason)
            }
            Err(e) => SubmitOutcome::Rejected(e.to_string()),
        }
    }

    fn attach(&mut self, m: MigratedRequest, rematerialized: bool) -> Result<(), DriverError> {
        let id = m.spec.id;
        match self.ledger.attach(id) {
            Ok(Arrival::AlreadyHere) => return Ok(()), // a retried attach
            Ok(Arrival::Attach) => {}
            Err(refusal) => return Err(refused(id, refusal)),
        }
        let kv_tokens = m.kv_tokens();
        self.engine.attach(self.clock.now(), m)?;
        ledger_step(self.ledger.attached(id, rematerialized));
        // Re-materialise: the KV is (re)generated here, not copied (the QUIC transfer replaces this).
        self.written.remove(&id);
        self.write_kv(id, kv_tokens);
        Ok(())
    }

    /// Move a request out whole (`MigrateOut`: the target re-materialises its KV).
    fn migrate_out(&mut self, request: RequestId) -> Result<MigratedOut, DriverError> {
        self.ledger.begin_out(request, WHOLE_MOVE).map_err(|r| refused(request, r))?;
        let out = match self.engine.begin_migration_out(request) {
            Ok(out) => out,
            Err(e) => {
                self.resume_out(request, WHOLE_MOVE)?;
                return Err(e.into());
            }
        };
        self.ledger.pause(request, WHOLE_MOVE).map_err(|r| refused(request, r))?;
        // The arena must hold exactly what the engine says it holds (cheap stamp check).
        if let Some(w) = self.written.get(&request) {
            if let Some(tier) = w.tier {
                match verify_written(&self.arena, self.block_size, tier, &w.blocks, w.content(request), w.tokens) {
                    Ok(n) => self.kv_stats.tokens_verified += n,
                    Err(cause) => {
                        self.kv_error(request, &cause);
                        self.resume_out(request, WHOLE_MOVE)?;
                        return Err(DriverError::KvCorrupt { request, cause });
                    }
                }
            }
        }
        self.ledger.commit_out(request, WHOLE_MOVE)?;
        let migrated = self.engine.finish_migration_out(request)?;
        self.written.remove(&request);
        let state =
            serde_json::to_vec(&migrated).map_err(|e| DriverError::Serialize { request, message: e.to_string() })?;
        Ok(MigratedOut { state, kv_tokens: out.kv_tokens, kv_bytes: out.kv_bytes })
    }

    /// Announce every request held for its handoff (again): a leader that took over, or whose
    /// release or role change did not reach this worker, learns what waits here. Returns how many.
    fn announce_held(&mut self) -> usize {
        let held = self.engine.held_requests();
        for &(request, kv_blocks) in &held {
            self.announce(request, kv_blocks);
        }
        held.len()
    }

    /// `request` is held here for its handoff, with `kv_blocks` of KV: said now.
    fn announce(&mut self, request: RequestId, kv_blocks: u32) {
        let event = self.prefill_done(request, kv_blocks, self.clock.now());
        self.log.push(event);
    }

    /// The event saying `request` is held here after its prefill, as of `at`.
    fn prefill_done(&self, request: RequestId, kv_blocks: u32, at: Timestamp) -> LogEvent {
        LogEvent::PrefillDone(v1::PrefillDone {
            request_id: request.0,
            instance: self.instance,
            kv_blocks,
            at_ns: at.0,
        })
    }

    /// An outbound move of `request` failed: it carries on here. One held for its handoff is held
    /// again, and announced again (the leader may have given up on the move meanwhile and must
    /// learn that it waits for a decoder once more).
    pub(super) fn abort_out(&mut self, request: RequestId) -> Result<(), EngineError> {
        self.engine.abort_migration_out(request)?;
        if let Some((_, kv_blocks)) = self.engine.held_requests().into_iter().find(|&(id, _)| id == request) {
            self.announce(request, kv_blocks);
        }
        Ok(())
    }

    /// A move out of `request` by `migration` ended before COMMIT: it carries on here.
    pub(super) fn resume_out(&mut self, request: RequestId, migration: MigrationId) -> Result<(), DriverError> {
        let resume = self.ledger.abort_out(request, migration)?;
        self.resume_on_engine(request, resume)
    }

    /// Carry out a ledger's [`Resume`] for a move out that ended without landing.
    pub(super) fn resume_on_engine(&mut self, request: RequestId, resume: Resume) -> Result<(), DriverError> {
        match resume {
            Resume::Engine => self.abort_out(request)?,
            Resume::Nothing => {}
            Resume::Drop(dropped) => {
                self.drop_on_engine(request, dropped)?;
            }
        }
        Ok(())
    }

    /// Carry out a ledger's [`Dropped`]: a copy the cluster does not count leaves the engine
    /// (it re-placed the request while this worker was cut off or stopped). Whether one left.
    pub(super) fn drop_on_engine(&mut self, request: RequestId, dropped: Dropped) -> Result<bool, EngineError> {
        match dropped {
            Dropped::Nothing => return Ok(false),
            Dropped::Cancel => self.engine.cancel(request)?,
            Dropped::Free => {
                self.engine.finish_migration_out(request)?;
            }
        }
        self.written.remove(&request);
        tracing::warn!(
            request = request.0,
            "dropped a copy the cluster re-placed elsewhere while this worker was cut off or stopped"
        );
        Ok(true)
    }
}

/// A ledger transition that follows an engine step that succeeded: it cannot fail unless the two
/// disagree, which is logged (the engine's word stands).
fn ledger_step(step: Result<(), LedgerError>) {
    if let Err(e) = step {
        tracing::error!("{e}");
    }
}

/// Check the stamps of tokens `0..tokens` written through `blocks` on `tier`; returns how many.
fn verify_written(
    arena: &KvArena,
    block_size: u32,
    tier: Tier,
    blocks: &[u32],
    content: TokenContent<'_>,
    tokens: u32,
) -> Result<u64, ArenaError> {
    let mut verified = 0u64;
    for (i, &b) in blocks.iter().enumerate() {
        let first = i as u32 * block_size;
        if first >= tokens {
            break;
        }
        let n = block_size.min(tokens - first);
        arena.verify_stamps(tier, b, content, first, n)?;
        verified += n as u64;
    }
    Ok(verified)
}

fn proto_phase(p: Phase) -> v1::Phase {
    match p {
        Phase::Reasoning => v1::Phase::Reasoning,
        Phase::Answering => v1::Phase::Answering,
    }
}

fn proto_record(r: &RequestRecord, rematerialized: bool) -> v1::RequestRecord {
    v1::RequestRecord { kv_rematerialized: rematerialized, ..v1::RequestRecord::from(r) }
}

mod live;
pub(crate) use live::{BeganOut, KvProgress, LiveCommand, PausedOut};

#[cfg(test)]
mod tests;
