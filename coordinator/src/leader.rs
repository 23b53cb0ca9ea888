//! The leader: turns worker events into [`Controller`] events and executes the actions it decides.
//! Every scheduling decision (placement, re-placement, migration targets and retries, ownership)
//! is the controller's, shared with the simulator; this module holds only I/O: fenced writes to
//! the metadata store, worker RPCs, client streams.
//!
//! Invariants it keeps, so that across worker deaths and leader failovers no accepted request is
//! lost and none runs twice:
//! - a request's ownership is written to the store, fenced on the leader key, *before* the
//!   client is told it was accepted; a new leader reloads every unfinished one;
//! - a worker forgets an event only after the leader acknowledged it, and the leader acknowledges
//!   a finished record only after storing it; results are keyed by request id, so a replayed
//!   record is stored twice at most, never counted twice;
//! - a refused fenced write means another coordinator leads: this one stops at once (`deposed`).

use crate::trace::{PlacementNote, RequestTraces};
use kvfleet_control::arrow::Quadratic;
use kvfleet_control::{
    Action, ArrowProfile, ControlError, Controller, Event, MoveOutcome, OwnedPhase, Ownership, Silence,
};
use kvfleet_core::metrics::RequestRecord;
use kvfleet_core::policy::cache_aware::PrefixFetch;
use kvfleet_core::policy::LoadReport;
use kvfleet_core::{InstanceId, RequestId, RequestSpec, TimeSpan, Timestamp};
use kvfleet_meta::layout::{self as keys, ClusterTime, ProfileRecord, WorkerRecord};
use kvfleet_meta::{Condition, LeaderKey, MetaStore};
use kvfleet_proto::v1;
use kvfleet_proto::v1::worker_client::WorkerClient;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use tonic::Status;

#[cfg(test)]
mod fake_worker;
mod reports;
mod roles;
pub use roles::PdSetup;

/// Where a client's stream of events goes.
pub type ClientTx = mpsc::Sender<Result<v1::ClientEvent, Status>>;

/// Counters shown by `Status` and `kvfleet up`.
#[derive(Debug, Default)]
pub struct LeaderStats {
    /// Client requests accepted (placed and persisted).
    pub accepted: AtomicU64,
    /// Finished records stored.
    pub finished: AtomicU64,
    /// Migrations that committed (live or re-materialised).
    pub migrations: AtomicU64,
    /// Migrations that did not commit (refused, aborted, or the attach failed).
    pub migration_failures: AtomicU64,
    /// Re-placements: requests started over on another worker after theirs left.
    pub replaced: AtomicU64,
    /// Token notifications a slow or gone client missed (its final record is never dropped).
    pub dropped_token_events: AtomicU64,
    /// Final records refused because their instance no longer owned the request (a paused or
    /// cut-off worker's late copy of a request re-placed meanwhile).
    pub late_results: AtomicU64,
    /// Requests cancelled because their client left.
    pub cancelled: AtomicU64,
    /// Copies a worker held of requests re-placed elsewhere (cut off or stopped meanwhile),
    /// freed there at this leader's word ([`Action::Drop`]).
    pub stale_copies_dropped: AtomicU64,
    /// Workers given up for silence while registered whose registration this leader revoked
    /// ([`Action::Expel`]).
    pub expelled: AtomicU64,
    /// Handoffs committed: a request moved from the prefill instance that held it to a decoder.
    pub handoffs: AtomicU64,
    /// Held requests released to decode where they were prefilled.
    pub handoffs_released: AtomicU64,
    /// Of `handoffs`, those whose move was decided while the prefill ran (`[pd] overlap`).
    pub handoffs_overlapped: AtomicU64,
    /// Cache-aware placements whose target copied a cached prefix from another worker first.
    pub prefix_fetches: AtomicU64,
    /// The bytes those copies moved.
    pub prefix_fetch_bytes: AtomicU64,
}

struct WorkerLink {
    client: WorkerClient<Channel>,
    pump: JoinHandle<()>,
    /// Where it receives live KV migrations (empty: it cannot; re-materialise instead).
    kv_address: String,
    /// The process this link follows: another under the same number means this one is gone.
    incarnation: u64,
    address: String,
    /// When the pump last heard from it, ms on the leader's clock ([`Leader::ms_now`]).
    heard_ms: Arc<AtomicU64>,
}

/// How long a worker may go unheard (no event, not even a load heartbeat) before no placement
/// goes to it: its reports come every load interval (100 ms by default) while it runs.
pub const SILENT_AFTER: Duration = Duration::from_secs(2);
/// How long a worker may stay unheard while its registration holds (alive to etcd, unreachable
/// from here) before its requests are re-placed elsewhere. A worker that is merely stopped loses
/// its registration first (2 s lease) and is evicted then.
pub const ABANDON_AFTER: Duration = Duration::from_secs(10);

/// The controller's silence rule for these bounds.
fn silence_rule(silent_after: Duration, abandon_after: Duration) -> Silence {
    let span = |d: Duration| TimeSpan::from_nanos(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    Silence { silent_after: span(silent_after), abandon_after: span(abandon_after) }
}

/// The elected coordinator's side of the cluster: drives the [`Controller`], holds a link (RPC
/// client and event pump) per registered worker, and persists ownership fenced on its leader key.
pub struct Leader {
    store: Arc<dyn MetaStore>,
    fence: LeaderKey,
    control: Mutex<Controller>,
    links: Mutex<BTreeMap<InstanceId, WorkerLink>>,
    subscribers: Mutex<HashMap<RequestId, ClientTx>>,
    /// Counters for `Status` and `kvfleet up`.
    pub stats: LeaderStats,
    deposed_tx: watch::Sender<bool>,
    /// Turns `true` once a fenced write is refused (another coordinator leads); never back.
    pub deposed: watch::Receiver<bool>,
    connector: Connector,
    /// Settled live migrations, as the sources measured them.
    migration_log: Mutex<Vec<v1::MigrationStats>>,
    /// Late copies to forget on a process the leader could not reach when their record was
    /// refused (its registration lapsed): (instance, that process's incarnation, request), sent
    /// when that same process registers again ([`Leader::forget_late_copy`]).
    pending_forgets: Mutex<Vec<(InstanceId, u64, RequestId)>>,
    /// Open `request` spans; their contexts travel with `Submit` and `MigrateOut`.
    traces: RequestTraces,
    clock: ClusterTime,
    /// Origin of [`Leader::ms_now`].
    started: std::time::Instant,
    /// Prefill/decode roles: what each instance was given, the changes, the handoffs open.
    roles: roles::RoleBook,
    /// When each worker's next load report is due: a placement waits for those due by its
    /// arrival ([`reports`]).
    due_reports: reports::DueReports,
    /// The longest a placement waits for those ([`reports::REPORT_WAIT`]).
    report_wait: Mutex<Duration>,
    /// Wakes [`Leader::run_ticks`] when a decision brought the controller's next pass forward
    /// (a refused push's retry, due before Arrow's next monitoring pass or with none).
    tick_due: tokio::sync::Notify,
}

/// Why the leader could not carry out a client's or a worker's request.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    /// A fenced write was refused: another coordinator leads now.
    #[error("no longer the leader (a fenced write was refused)")]
    Deposed,
    /// The metadata store (etcd or the embedded store) failed.
    #[error("metadata store: {0}")]
    Store(#[from] kvfleet_meta::MetaError),
    /// The cluster controller refused the event (e.g. a duplicate request id).
    #[error("{0}")]
    Control(#[from] ControlError),
    /// No live worker to place the request on.
    #[error("no live worker to place request {0} on")]
    NoWorkers(RequestId),
}

impl From<LeaderError> for Status {
    fn from(e: LeaderError) -> Status {
        match e {
            LeaderError::Control(ControlError::Duplicate(id)) => {
                Status::already_exists(format!("request {id} was already submitted; use Resume"))
            }
            other => Status::unavailable(other.to_string()),
        }
    }
}

/// Opens a (lazy) channel to a worker's address.
pub type Connector = Arc<dyn Fn(&str) -> Result<Channel, String> + Send + Sync>;

/// The channel factory for workers: mutual TLS with the cluster identity, or plain text.
pub fn worker_connector(tls: Option<kvfleet_pki::NodeIdentity>) -> Connector {
    Arc::new(move |addr: &str| {
        kvfleet_pki::endpoint(addr, tls.as_ref())
            .map_err(|e| format!("worker {addr}: {e}"))
            .map(|e| e.connect_timeout(Duration::from_secs(2)).tcp_nodelay(true).connect_lazy())
    })
}

fn json<T: serde::Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("plain data serializes")
}

impl Leader {
    /// A leader over `store`, fencing its writes on `fence`, driving `control`; `connector` opens
    /// worker channels; `clock` is the cluster's (decision times, span times).
    pub fn new(
        store: Arc<dyn MetaStore>,
        fence: LeaderKey,
        control: Controller,
        connector: Connector,
        clock: ClusterTime,
    ) -> Arc<Leader> {
        let (deposed_tx, deposed) = watch::channel(false);
        let traces = RequestTraces::new(clock.epoch_unix_ns, control.policy_name());
        Arc::new(Leader {
            store,
            fence,
            control: Mutex::new(control.watch_silence(silence_rule(SILENT_AFTER, ABANDON_AFTER))),
            links: Mutex::new(BTreeMap::new()),
            subscribers: Mutex::new(HashMap::new()),
            stats: LeaderStats::default(),
            deposed_tx,
            deposed,
            connector,
            migration_log: Mutex::new(Vec::new()),
            pending_forgets: Mutex::new(Vec::new()),
            traces,
            clock,
            started: std::time::Instant::now(),
            roles: roles::RoleBook::default(),
            due_reports: reports::DueReports::default(),
            report_wait: Mutex::new(reports::REPORT_WAIT),
            tick_due: tokio::sync::Notify::new(),
        })
    }

    /// Other silence bounds than [`SILENT_AFTER`] / [`ABANDON_AFTER`] (tests), before
    /// [`Leader::watch_silence`] starts.
    pub fn set_silence(&self, silent_after: Duration, abandon_after: Duration) {
        self.control().set_silence(silence_rule(silent_after, abandon_after));
    }

    /// Milliseconds since this leader started (when a worker was last heard).
    fn ms_now(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// [`Leader::execute`] and the moves it starts, in a task of their own (a submit to an
    /// unreachable worker retries for seconds; the caller must not wait on it).
    fn execute_in_background(self: &Arc<Self>, actions: Vec<Action>) {
        if actions.is_empty() {
            return;
        }
        let leader = self.clone();
        tokio::spawn(async move {
            let moves = leader.execute(actions).await;
            leader.spawn_moves(moves);
        });
    }

    /// [`Leader::execute_in_background`]: every decision the controller returns is carried out.
    fn act(self: &Arc<Self>, actions: Vec<Action>) {
        self.execute_in_background(actions);
    }

    /// Tells the controller when each worker was last heard from ([`Event::Heard`]): its silence
    /// rule ([`SILENT_AFTER`], [`ABANDON_AFTER`]) keeps placements off a worker that looks idle
    /// only because it cannot answer, and re-places the requests of one unheard for long while
    /// its registration holds (registered, but unreachable from here); heard again, it is back.
    /// Runs until the leader is deposed or stopped. A leader that did not run for a while itself
    /// (stopped, or starved of CPU) heard nobody meanwhile through no fault of theirs: the
    /// silence of every worker counts afresh from its return.
    pub async fn watch_silence(self: Arc<Self>) {
        let quiet_bound = self.control().silence().map_or(SILENT_AFTER, |r| Duration::from_nanos(r.silent_after.0));
        let period = (quiet_bound / 8).max(Duration::from_millis(10));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = self.ms_now();
        loop {
            tick.tick().await;
            if self.is_deposed() {
                return;
            }
            let (now_ms, now) = (self.ms_now(), self.cluster_now());
            let away_ms = now_ms.saturating_sub(last);
            last = now_ms;
            // Away for less than the bound, it misjudges nobody for long: the next event is heard.
            if away_ms > quiet_bound.as_millis() as u64 {
                tracing::warn!(away_ms, "this coordinator did not run for a while: workers' silence counts afresh");
                for l in self.links.lock().expect("links lock").values() {
                    l.heard_ms.fetch_max(now_ms, Ordering::Relaxed);
                }
            }
            let heard: Vec<(InstanceId, Timestamp)> = self
                .links
                .lock()
                .expect("links lock")
                .iter()
                .map(|(&id, l)| {
                    let quiet_ms = now_ms.saturating_sub(l.heard_ms.load(Ordering::Relaxed));
                    (id, Timestamp(now.as_nanos().saturating_sub(quiet_ms.saturating_mul(1_000_000))))
                })
                .collect();
            let actions = self.decide(Event::Heard { heard }).unwrap_or_default();
            self.execute_in_background(actions);
        }
    }

    /// Now on the cluster clock (for span times of decisions made here).
    fn cluster_now(&self) -> kvfleet_core::Timestamp {
        self.clock.now()
    }

    fn control(&self) -> std::sync::MutexGuard<'_, Controller> {
        self.control.lock().expect("controller lock not poisoned")
    }

    /// Apply `event` now; the actions it decided, to execute.
    fn decide(&self, event: Event) -> Result<Vec<Action>, ControlError> {
        let now = self.cluster_now();
        let mut control = self.control();
        let before = control.next_tick();
        let decided = control.decide(now, event);
        if control.next_tick().is_some_and(|t| before.is_none_or(|b| t < b)) {
            self.tick_due.notify_one();
        }
        decided
    }

    /// Whether a refused fenced write has deposed this leader.
    pub fn is_deposed(&self) -> bool {
        *self.deposed.borrow()
    }

    /// Write fenced on our leadership; a refusal deposes this leader.
    async fn persist(&self, key: &str, value: &[u8]) -> Result<(), LeaderError> {
        if self.is_deposed() {
            return Err(LeaderError::Deposed);
        }
        match self.store.put_if(key, value, None, &[Condition::leader(&self.fence)]).await? {
            Some(_) => Ok(()),
            None => {
                let _ = self.deposed_tx.send(true);
                Err(LeaderError::Deposed)
            }
        }
    }

    /// Read back the migrations and handoffs the previous leaders settled, so this leader's
    /// status reports the whole run's.
    async fn restore_run_log(&self) -> Result<(), LeaderError> {
        let migrations = self.store.get_prefix(keys::MIGRATION_LOG).await?;
        let mut log = Vec::with_capacity(migrations.kvs.len());
        for kv in migrations.kvs {
            match <v1::MigrationStats as prost::Message>::decode(kv.value.as_slice()) {
                Ok(m) => log.push(m),
                Err(e) => tracing::error!(key = %kv.key, "unreadable migration record; skipped: {e}"),
            }
        }
        if !log.is_empty() {
            tracing::info!(migrations = log.len(), "restored the run's migration log");
        }
        *self.migration_log.lock().expect("migration log lock") = log;
        self.restore_handoffs().await
    }

    async fn persist_ownership(&self, id: RequestId) -> Result<(), LeaderError> {
        let o = self.control().ownership(id).cloned();
        match o {
            Some(o) => self.persist(&keys::request(id.0), &json(&o)).await,
            None => Ok(()),
        }
    }

    /// Reload what a previous leader left: unfinished ownership records.
    pub async fn restore(self: &Arc<Self>) -> Result<usize, LeaderError> {
        let owned = self.store.get_prefix(keys::REQUESTS).await?;
        let done = self.store.get_prefix(keys::RESULTS).await?;
        let finished: std::collections::HashSet<String> =
            done.kvs.iter().map(|kv| kv.key.trim_start_matches(keys::RESULTS).to_string()).collect();
        let mut restored = Vec::new();
        for kv in owned.kvs {
            let Ok(mut o) = serde_json::from_slice::<Ownership>(&kv.value) else {
                tracing::error!(key = %kv.key, "unreadable ownership record; skipped");
                continue;
            };
            if finished.contains(kv.key.trim_start_matches(keys::REQUESTS)) {
                o.phase = OwnedPhase::Finished;
            }
            restored.push(o);
        }
        let n = restored.iter().filter(|o| o.phase != OwnedPhase::Finished).count();
        for o in restored.iter().filter(|o| o.phase != OwnedPhase::Finished) {
            self.traces.open(&o.spec, true);
        }
        self.control().restore(restored);
        let roles = self.restore_roles().await?;
        if roles > 0 {
            tracing::info!(roles, "restored the instances' roles");
        }
        self.restore_run_log().await?;
        Ok(n)
    }

    /// A worker registered (or re-registered). Refuses a model mismatch.
    ///
    /// A registration of a known instance by another process (another incarnation, or another
    /// address) means the process that held its requests is gone even though its registration
    /// never lapsed (a worker restarted at once with the same `--instance` overwrites it): the
    /// old one is evicted first, as if its registration had lapsed, then the new one joins with
    /// a fresh link. A refreshed registration of the same process changes nothing.
    pub async fn admit(self: &Arc<Self>, rec: &WorkerRecord) -> Result<(), String> {
        let id = InstanceId(rec.instance);
        let replaced = self
            .links
            .lock()
            .expect("links lock")
            .get(&id)
            .filter(|l| l.incarnation != rec.incarnation || l.address != rec.address)
            .map(|l| (l.incarnation, l.address.clone()));
        if let Some((incarnation, address)) = replaced {
            tracing::warn!(
                instance = id.0,
                old_incarnation = incarnation,
                old_address = %address,
                incarnation = rec.incarnation,
                address = %rec.address,
                "another process registered as this instance; the old one is gone"
            );
            self.evict(id).await;
        }
        let joined = Event::Joined {
            instance: id,
            address: rec.address.clone(),
            model: rec.model.clone(),
            kv_bytes_per_token: rec.kv_bytes_per_token,
        };
        // Re-placements that found no live worker before may start over on this one.
        let actions = self.decide(joined).map_err(|e| e.to_string())?;
        if let Some(p) = rec.arrow_profile {
            self.take_profile(id, p);
        }
        self.link(rec)?;
        let moves = self.execute(actions).await;
        self.spawn_moves(moves);
        Ok(())
    }

    /// Arrow's profile a worker measured of its instance: used for it from now on where Arrow
    /// runs (logged either way).
    fn take_profile(&self, id: InstanceId, p: ProfileRecord) {
        let profile = ArrowProfile {
            prefill: Quadratic { a: p.prefill_a, b: p.prefill_b, c: p.prefill_c },
            decode_max_tokens: p.decode_max_tokens,
        };
        match self.control().set_instance_profile(id, profile, p.slo_tpot_s) {
            Ok(()) => tracing::info!(instance = id.0, ?profile, "Arrow weighs the instance with its own profile"),
            Err(e) => tracing::debug!(instance = id.0, error = %e, "the instance's Arrow profile is not used"),
        }
    }

    /// A link to a registered worker, and the pump following its event log (kept if it runs).
    fn link(self: &Arc<Self>, rec: &WorkerRecord) -> Result<(), String> {
        let id = InstanceId(rec.instance);
        let mut links = self.links.lock().expect("links lock");
        if let Some(l) = links.get_mut(&id).filter(|l| !l.pump.is_finished()) {
            l.kv_address.clone_from(&rec.kv_address);
            return Ok(());
        }
        // Until its first load report, the instance is as big as it registered, and empty: a
        // burst of arrivals right after it joins is charged in its real block geometry.
        let first_load = self.decide(Event::Load(LoadReport {
            instance: id,
            gpu_total_blocks: rec.gpu_blocks,
            block_tokens: rec.block_size,
            block_bytes: u64::from(rec.block_size) * rec.kv_bytes_per_token,
            answering_slo_ok: true,
            ..LoadReport::default()
        }));
        self.act(first_load.unwrap_or_default());
        let channel = (self.connector)(&rec.address)?;
        let client = WorkerClient::new(channel).max_decoding_message_size(64 << 20);
        let heard_ms = Arc::new(AtomicU64::new(self.ms_now()));
        let pump = tokio::spawn(self.clone().pump(id, client.clone(), heard_ms.clone()));
        let link = WorkerLink {
            client,
            pump,
            kv_address: rec.kv_address.clone(),
            incarnation: rec.incarnation,
            address: rec.address.clone(),
            heard_ms,
        };
        links.insert(id, link);
        drop(links);
        // A new process: what its predecessor said was due no longer is.
        self.due_reports.forget(id);
        tracing::info!(instance = id.0, address = %rec.address, incarnation = rec.incarnation, "worker joined");
        // Back after a lapse: the late copies it finished meanwhile are forgotten now (another
        // process under its number never held them).
        let due: Vec<RequestId> = {
            let mut pending = self.pending_forgets.lock().expect("pending forgets lock");
            let due = pending.iter().filter(|p| p.0 == id && p.1 == rec.incarnation).map(|p| p.2).collect();
            pending.retain(|p| p.0 != id);
            due
        };
        for request in due {
            tokio::spawn(self.clone().forget_late_copy(request, id, rec.incarnation));
        }
        Ok(())
    }

    /// A worker's registration lapsed (or another process took its number): it is dead. Its
    /// unfinished requests start over elsewhere; those it was moving out are first settled with
    /// their targets.
    pub async fn evict(self: &Arc<Self>, instance: InstanceId) {
        if let Some(l) = self.links.lock().expect("links lock").remove(&instance) {
            l.pump.abort();
        }
        self.due_reports.forget(instance);
        let actions = self.decide(Event::Left { instance }).unwrap_or_default();
        tracing::warn!(instance = instance.0, orphans = actions.len(), "worker left; re-placing its requests");
        let moves = self.execute(actions).await;
        self.spawn_moves(moves);
    }

    /// The request's copy is lost: start it over on a live worker.
    async fn replace(self: &Arc<Self>, id: RequestId) {
        match self.decide(Event::Lost { request: id }) {
            Ok(actions) => {
                let moves = self.execute(actions).await;
                self.spawn_moves(moves);
            }
            Err(e) => tracing::debug!(request = id.0, "not re-placed: {e}"),
        }
    }

    /// Carry out the controller's placements; the moves it decided are returned, for
    /// [`Leader::spawn_moves`] (a move waits on the copy, so it runs in its own task).
    async fn execute(self: &Arc<Self>, actions: Vec<Action>) -> Vec<(RequestId, InstanceId, InstanceId)> {
        let mut moves = Vec::new();
        for action in actions {
            match action {
                Action::Migrate { request, from, to, .. } => moves.push((request, from, to)),
                Action::Settle { request, from, to } => {
                    // Asking may wait on a hung target: not in the caller's way (the registry watch).
                    tokio::spawn(self.clone().settle_departed_source(request, from, to));
                }
                Action::Cancel { request, on } => {
                    tokio::spawn(self.clone().cancel_on(request, on));
                }
                Action::Drop { request, on } => {
                    tokio::spawn(self.clone().drop_copy(request, on));
                }
                Action::Expel { instance } => {
                    tokio::spawn(self.clone().expel(instance));
                }
                Action::SetRole { instance, role } => self.set_role(instance, role),
                Action::Release { request, on } => {
                    tokio::spawn(self.clone().release(request, on));
                }
                other => self.place_again(other).await,
            }
        }
        moves
    }

    /// Carry out a re-placement (or its failure for want of a live worker).
    async fn place_again(self: &Arc<Self>, action: Action) {
        match action {
            Action::Place { request, on, replaced, fetch } => {
                debug_assert!(replaced > 0, "new requests are placed by `submit`");
                // The coordinator refuses policies that fetch prefixes (`Node::new`).
                debug_assert!(fetch.is_none(), "a prefix fetch in the emulator");
                self.stats.replaced.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = self.persist_ownership(request).await {
                    tracing::error!(request = request.0, "re-placing failed: {e}");
                    return;
                }
                // The ownership is stored; the submit (retried for seconds when the worker is slow
                // or gone) runs aside, so a worker leaving with hundreds of requests does not hold
                // up the registry watch that re-places them.
                let spec = self.control().ownership(request).map(|o| o.spec.clone());
                if let Some(spec) = spec {
                    let leader = self.clone();
                    tokio::spawn(async move { leader.submit_to_worker(on, &spec).await });
                }
            }
            Action::Reject { request, reason } => {
                // It stays owned by its dead worker; the controller re-places it when a worker
                // joins, and a new leader's `resubmit_unfinished` retries it.
                tracing::error!(request = request.0, ?reason, "no live worker to re-place the request on");
            }
            other => tracing::error!(?other, "an action this coordinator does not execute here; ignored"),
        }
    }

    fn spawn_moves(self: &Arc<Self>, moves: Vec<(RequestId, InstanceId, InstanceId)>) {
        for (request, from, to) in moves {
            tokio::spawn(self.clone().run_move(request, from, to));
        }
    }

    /// `from` left while moving `id` out to `to` ([`Action::Settle`]): ask the target, as
    /// [`Leader::settle_inherited_moves`] does, whether the move committed (it refuses a late
    /// COMMIT from then on); there is no source left to tell. The controller then keeps the
    /// request there or re-places it.
    async fn settle_departed_source(self: Arc<Self>, id: RequestId, from: InstanceId, to: InstanceId) {
        let held = ask_target(id, self.client(to), self.moves_so_far()).await;
        tracing::warn!(request = id.0, from = from.0, to = to.0, held, "settled the move of a worker that left");
        let actions = match self.decide(Event::Settled { request: id, from, to, held }) {
            Ok(actions) => actions,
            Err(e) => {
                tracing::debug!(request = id.0, "settled a move for a request no longer in flight: {e}");
                return;
            }
        };
        if actions.is_empty() {
            if held {
                self.stats.migrations.fetch_add(1, Ordering::Relaxed);
            }
            let _ = self.persist_ownership(id).await;
        }
        self.act(actions);
    }

    /// The order of the next move this leader starts (`Prepare.leader_term`, `move_seq`): its
    /// term, its election key's create revision (each leader's is above every earlier leader's),
    /// then the moves this process started so far. A target fenced up to
    /// [`Leader::moves_so_far`] refuses every move ordered before and accepts the ones after.
    fn next_move_order(&self) -> (u64, u64) {
        (self.term(), MOVES_STARTED.fetch_add(1, Ordering::SeqCst) + 1)
    }

    /// The order of the last move started so far (see [`Leader::next_move_order`]).
    fn moves_so_far(&self) -> (u64, u64) {
        (self.term(), MOVES_STARTED.load(Ordering::SeqCst))
    }

    fn term(&self) -> u64 {
        u64::try_from(self.fence.create_revision.0).unwrap_or(0)
    }

    fn client(&self, instance: InstanceId) -> Option<WorkerClient<Channel>> {
        self.links.lock().expect("links lock").get(&instance).map(|l| l.client.clone())
    }

    /// The process the link of `instance` follows.
    fn incarnation(&self, instance: InstanceId) -> Option<u64> {
        self.links.lock().expect("links lock").get(&instance).map(|l| l.incarnation)
    }

    /// Accept a client's request: place, persist, tell the client, then hand it to the worker
    /// (in a task of its own).
    pub async fn submit(self: &Arc<Self>, spec: RequestSpec, tx: ClientTx) -> Result<InstanceId, LeaderError> {
        // On every worker's load as of the arrival, as the simulator places it.
        let received = self.cluster_now();
        self.await_reports(spec.arrival, None, Some(spec.id)).await;
        let now = self.cluster_now();
        tracing::debug!(
            target: "kvfleet::moves",
            request = spec.id.0,
            arrival_ns = spec.arrival.0,
            received_ns = received.0,
            decided_ns = now.0,
            "submit heard"
        );
        let (to, fetch, note) = {
            let mut control = self.control();
            let loads = control.loads().to_vec();
            let mut placed = control.decide(now, Event::Arrival(spec.clone()))?;
            // Beside the placement, decisions it led to (Arrow flips a decoder to prefill).
            let at = placed.iter().position(|a| matches!(a, Action::Place { request, .. } if *request == spec.id));
            let Some(Action::Place { on: to, fetch, .. }) = at.map(|i| placed.remove(i)) else {
                drop(control);
                self.act(placed);
                return Err(LeaderError::NoWorkers(spec.id));
            };
            drop(control);
            self.act(placed);
            let control = self.control();
            (to, fetch, PlacementNote::new(control.policy_name(), &loads, to))
        };
        if let Err(e) = self.persist_ownership(spec.id).await {
            let _ = self.decide(Event::Finished { request: spec.id, from: None });
            return Err(e);
        }
        self.traces.open(&spec, false);
        self.traces.placement(spec.id, self.cluster_now(), &note);
        self.stats.accepted.fetch_add(1, Ordering::Relaxed);
        self.subscribers.lock().expect("subscribers lock").insert(spec.id, tx.clone());
        let _ = tx.send(Ok(v1::ClientEvent { event: Some(v1::client_event::Event::AcceptedOn(to.0)) })).await;
        // The client learns of the placement now, not after the worker answered: a replay that
        // submits in arrival order waits for this (the next arrival must see this decision).
        let leader = self.clone();
        tokio::spawn(async move {
            if let Some(f) = fetch {
                leader.fetch_prefix(to, &spec, f).await;
            }
            leader.submit_to_worker(to, &spec).await
        });
        Ok(to)
    }

    /// A cache-aware placement's prefix copy, before the request is submitted to `to`: the
    /// worker pulls the blocks from the holder itself. A failure costs only cache hits (the
    /// request computes what did not arrive), so it is logged, not retried.
    async fn fetch_prefix(self: &Arc<Self>, to: InstanceId, spec: &RequestSpec, fetch: PrefixFetch) {
        let holder_kv_address = self.kv_address(fetch.from);
        let Some(mut client) = self.client(to) else { return };
        if holder_kv_address.is_empty() {
            return;
        }
        let msg =
            v1::FetchPrefixRequest { spec: Some(spec.into()), holder_kv_address, first: fetch.first, end: fetch.end };
        match client.fetch_prefix(msg).await {
            Ok(reply) => {
                let r = reply.into_inner();
                // As the simulator counts: a fetch that found nothing computed copied nothing.
                if r.bytes > 0 {
                    self.stats.prefix_fetches.fetch_add(1, Ordering::Relaxed);
                    self.stats.prefix_fetch_bytes.fetch_add(r.bytes, Ordering::Relaxed);
                }
                tracing::debug!(
                    request = spec.id.0,
                    from = fetch.from.0,
                    to = to.0,
                    blocks = r.blocks,
                    bytes = r.bytes,
                    "prefix fetched"
                );
            }
            Err(e) => tracing::warn!(request = spec.id.0, from = fetch.from.0, to = to.0, "prefix fetch failed: {e}"),
        }
    }

    /// The client of `id` left (an HTTP client disconnected): stop the request where it runs and
    /// forget it, so that no successor resumes it. During a move the controller cancels it once
    /// the move ended ([`Event::Cancelled`]). A request that finished meanwhile keeps its result.
    pub async fn cancel(self: &Arc<Self>, id: RequestId) {
        let actions = match self.decide(Event::Cancelled { request: id }) {
            Ok(actions) => actions,
            Err(e) => {
                tracing::debug!(request = id.0, "nothing to cancel: {e}");
                return;
            }
        };
        self.subscribers.lock().expect("subscribers lock").remove(&id);
        if actions.is_empty() {
            tracing::info!(request = id.0, "client left during a move: cancelled once the move ends");
        }
        for action in actions {
            if let Action::Cancel { request, on } = action {
                self.clone().cancel_on(request, on).await;
            }
        }
    }

    /// Carry out [`Action::Cancel`]: forget the request durably (a new leader must not resume
    /// it), then ask its worker to stop it.
    async fn cancel_on(self: Arc<Self>, id: RequestId, on: InstanceId) {
        self.subscribers.lock().expect("subscribers lock").remove(&id);
        self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.forget_ownership(id).await {
            tracing::warn!(request = id.0, "cancelled, but its ownership record stays: {e}");
        }
        let Some(mut client) = self.client(on) else { return };
        match client.cancel(v1::CancelRequest { request_id: id.0, superseded: false, late_record: false }).await {
            Ok(r) if r.get_ref().cancelled => {
                tracing::info!(request = id.0, instance = on.0, "cancelled: its client left")
            }
            Ok(r) => tracing::info!(request = id.0, instance = on.0, reason = %r.get_ref().reason, "nothing to cancel"),
            Err(e) => tracing::warn!(request = id.0, instance = on.0, "cancel failed: {e}"),
        }
    }

    /// Carry out [`Action::Expel`]: revoke the lease of `instance`'s registration (the process
    /// this leader linked, not one registered since), which deletes it: the registry watch evicts
    /// the instance (its link closes; it is heard from no more), and the worker, once it runs
    /// again, finds its registration expired, drops what the cluster re-placed and registers
    /// anew. Unless its registration changed meanwhile (a new process, or already lapsed).
    async fn expel(self: Arc<Self>, instance: InstanceId) {
        let Some(incarnation) = self.incarnation(instance) else {
            return;
        };
        let registered = match self.store.get(&keys::worker(instance.0)).await {
            Ok(kv) => kv,
            Err(e) => {
                tracing::warn!(instance = instance.0, "not expelled: reading its registration failed ({e})");
                return;
            }
        };
        let lease = registered.and_then(|kv| {
            let rec: WorkerRecord = serde_json::from_slice(&kv.value).ok()?;
            (rec.incarnation == incarnation).then_some(kv.lease).flatten()
        });
        let Some(lease) = lease else {
            tracing::debug!(instance = instance.0, "not expelled: its registration lapsed or changed meanwhile");
            return;
        };
        match self.store.revoke(lease).await {
            Ok(()) => {
                self.stats.expelled.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(instance = instance.0, %lease, "expelled: its registration revoked")
            }
            Err(e) => tracing::warn!(instance = instance.0, "not expelled: revoking its registration failed ({e})"),
        }
    }

    /// Carry out [`Action::Drop`]: `on` holds a copy of `id` the cluster does not count; it frees
    /// it. Not if `id` was placed on `on` again meanwhile (that copy is the one counted now). If
    /// `id` is placed on `on` while the drop is on its way, that placement's submit may reach `on`
    /// first (answered "already accepted" by the stale copy, which the drop then frees, or
    /// orphans if it is moving out): so once the drop is answered (or its outcome unknown), a
    /// request placed on `on` by then is submitted again, to run afresh there or adopt the orphan
    /// (a repeat of a submit that came after the drop is answered "already accepted").
    async fn drop_copy(self: Arc<Self>, id: RequestId, on: InstanceId) {
        if self.owns(id, on) {
            return;
        }
        let Some(mut client) = self.client(on) else { return };
        match client.cancel(v1::CancelRequest { request_id: id.0, superseded: true, late_record: false }).await {
            Ok(r) if r.get_ref().cancelled => {
                self.stats.stale_copies_dropped.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(request = id.0, instance = on.0, "dropped a copy the cluster re-placed elsewhere");
            }
            Ok(r) => {
                tracing::debug!(request = id.0, instance = on.0, reason = %r.get_ref().reason, "no stale copy to drop")
            }
            Err(e) => tracing::warn!(request = id.0, instance = on.0, "dropping a stale copy failed: {e}"),
        }
        self.submit_if_placed_since(id, on, "its stale copy was dropped").await;
    }

    /// `on` finished a copy of `id` whose record was refused as a late copy's: it forgets that
    /// the request finished there (touching nothing that runs), so that the request, living
    /// elsewhere, may come back: handed off or moved there (refused as "already run" before), or
    /// placed there again. A placement there while this is on its way may have been answered
    /// "already accepted" by the finished copy, so a request placed on `on` by then is submitted
    /// again, as after [`Leader::drop_copy`].
    ///
    /// Boxed: it submits, a submit's rejection finishes the request, and a refused final record
    /// starts this again, a cycle of futures whose `Send` only a named type can show.
    fn forget_late_copy(
        self: Arc<Self>,
        id: RequestId,
        on: InstanceId,
        incarnation: u64,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        Box::pin(async move {
            // Not registered now (its lease lapsed): told when it registers again.
            let Some(mut client) = self.client(on).filter(|_| self.incarnation(on) == Some(incarnation)) else {
                self.pending_forgets.lock().expect("pending forgets lock").push((on, incarnation, id));
                return;
            };
            match client.cancel(v1::CancelRequest { request_id: id.0, superseded: true, late_record: true }).await {
                Ok(r) if r.get_ref().cancelled => {
                    tracing::info!(request = id.0, instance = on.0, "a late copy forgotten where it finished")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(request = id.0, instance = on.0, "forgetting a late copy failed: {e}"),
            }
            self.submit_if_placed_since(id, on, "a late copy of it was forgotten").await;
        })
    }

    /// After a copy of `id` on `on` was dropped or forgotten (`what`): placed on `on` since, it is
    /// submitted again.
    async fn submit_if_placed_since(self: &Arc<Self>, id: RequestId, on: InstanceId, what: &str) {
        let placed_here_since =
            self.control().ownership(id).filter(|o| o.instance == on && o.unfinished()).map(|o| o.spec.clone());
        if let Some(spec) = placed_here_since {
            tracing::warn!(request = id.0, instance = on.0, "placed there while {what}: submitted again");
            self.submit_to_worker(on, &spec).await;
        }
    }

    /// Delete a request's ownership record, fenced on leadership.
    async fn forget_ownership(&self, id: RequestId) -> Result<(), LeaderError> {
        if self.is_deposed() {
            return Err(LeaderError::Deposed);
        }
        match self.store.delete_if(&keys::request(id.0), &[Condition::leader(&self.fence)]).await? {
            Some(_) => Ok(()),
            None => {
                let _ = self.deposed_tx.send(true);
                Err(LeaderError::Deposed)
            }
        }
    }

    /// Re-attach a client to a request (after a leader change). Finished: the record at once.
    pub async fn resume(self: &Arc<Self>, id: RequestId, tx: ClientTx) -> Result<(), Status> {
        if let Some(rec) = self.stored_result(id).await? {
            let _ = tx.send(Ok(finished_event(&rec))).await;
            return Ok(());
        }
        let Some(o) = self.control().ownership(id).cloned() else {
            return Err(Status::not_found(format!("request {id} is unknown to the cluster")));
        };
        let _ = tx.send(Ok(v1::ClientEvent { event: Some(v1::client_event::Event::AcceptedOn(o.instance.0)) })).await;
        self.subscribers.lock().expect("subscribers lock").insert(id, tx.clone());
        // Its final record may have been stored between the first look and the subscription
        // (`finish` found no one to tell then; a worker re-sends its unacknowledged records to a
        // new leader as its clients come back): looked up again. Whoever takes the subscription,
        // this or `finish`, sends the record, once.
        if let Some(rec) = self.stored_result(id).await? {
            let ours = self.subscribers.lock().expect("subscribers lock").remove(&id);
            if ours.is_some() {
                let _ = tx.send(Ok(finished_event(&rec))).await;
            }
        }
        Ok(())
    }

    async fn stored_result(&self, id: RequestId) -> Result<Option<RequestRecord>, Status> {
        let kv = self.store.get(&keys::result(id.0)).await.map_err(|e| Status::unavailable(e.to_string()))?;
        kv.map(|kv| serde_json::from_slice(&kv.value).map_err(|e| Status::internal(format!("stored result: {e}"))))
            .transpose()
    }

    /// Hand a placed request to its worker; retried, then re-placed if the worker is unreachable.
    /// Only while it is placed there: a worker evicted meanwhile (its requests re-placed) may
    /// be back under its number before a retry, and a copy submitted to it then would be one
    /// the cluster does not count, holding its memory (a prefill instance would hold it for a
    /// handoff nobody decides).
    async fn submit_to_worker(self: &Arc<Self>, to: InstanceId, spec: &RequestSpec) {
        // For the process placed on: a retry that reaches another one, restarted at once under the
        // same number and address before the registry noticed, is refused (that process did not
        // inherit the request; the registry re-places what the old one held).
        let Some(incarnation) = self.incarnation(to) else { return };
        let msg = v1::SubmitRequest { spec: Some(spec.into()), incarnation };
        for attempt in 0..3u32 {
            if !self.placed_on(spec.id, to) {
                tracing::debug!(request = spec.id.0, instance = to.0, attempt, "not submitted: placed elsewhere since");
                return;
            }
            let Some(mut client) = self.client(to) else { break };
            match client.submit(kvfleet_telemetry::request_with(&self.traces.context(spec.id), msg.clone())).await {
                Ok(reply) => {
                    let reply = reply.into_inner();
                    if !reply.accepted {
                        // Can never fit that instance: finished as rejected (not lost).
                        let rec = RequestRecord {
                            id: spec.id,
                            arrival: spec.arrival,
                            prompt_tokens: spec.prompt_tokens,
                            reasoning_tokens: spec.reasoning_tokens,
                            answer_tokens: spec.answer_tokens,
                            placed_on: to,
                            rejected: true,
                            ..RequestRecord::default()
                        };
                        tracing::warn!(request = spec.id.0, reason = %reply.reason, "request rejected by its worker");
                        let _ = self.finish(rec, to).await;
                    }
                    return;
                }
                Err(e) => {
                    tracing::warn!(request = spec.id.0, instance = to.0, attempt, "submit failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
                }
            }
        }
        // The registry will evict a dead worker and re-place; nothing else to do here.
    }

    /// A worker's final record: stored, then told to the client, if it is the owner's first one.
    /// A late copy (an instance that lost the request to a re-placement while it was paused or
    /// cut off, an old incarnation) and a repeat are acknowledged and dropped, so the stored
    /// result is always the one the client got.
    ///
    /// The instance of a late copy is told to forget it ([`Leader::forget_late_copy`]): it
    /// remembers the request as finished, and would refuse it as "already run" when it is handed
    /// off or moved there, or answer "already accepted" and never run it when placed there again.
    async fn finish(self: &Arc<Self>, mut rec: RequestRecord, from: InstanceId) -> Result<(), LeaderError> {
        // Its worker counts nothing of the cluster's: how often it started over is the owner's.
        rec.replaced = self.control().ownership(rec.id).filter(|o| o.instance == from).map_or(0, |o| o.replaced);
        match self.decide(Event::Finished { request: rec.id, from: Some(from) }) {
            Ok(actions) => {
                if !actions.is_empty() {
                    tracing::debug!(request = rec.id.0, ?actions, "decisions at a final record");
                }
            }
            Err(e @ ControlError::NotOwner { .. }) => {
                tracing::warn!(request = rec.id.0, instance = from.0, "{e}");
                self.stats.late_results.fetch_add(1, Ordering::Relaxed);
                if let Some(incarnation) = self.incarnation(from) {
                    tokio::spawn(self.clone().forget_late_copy(rec.id, from, incarnation));
                }
                return Ok(());
            }
            // Stored already (a worker re-sends what a leader did not acknowledge)...
            Err(_) if !self.finished_unstored(rec.id, from).await => return Ok(()),
            // ... or not: the leader that took it for finished died before storing it.
            Err(_) => tracing::warn!(request = rec.id.0, "a final record the last leader did not store; stored now"),
        }
        self.persist(&keys::result(rec.id.0), &json(&rec)).await?;
        self.stats.finished.fetch_add(1, Ordering::Relaxed);
        self.traces.close(&rec);
        let tx = self.subscribers.lock().expect("subscribers lock").remove(&rec.id);
        if let Some(tx) = tx {
            let _ = tx.send(Ok(finished_event(&rec))).await;
        }
        Ok(())
    }

    /// Whether `id` is finished as far as the cluster knows, on `from`, but its result is not
    /// stored: a leader marks a request finished (and may store its ownership so, at a move's
    /// end) before the result's own write lands; killed in between, it leaves the next leader a
    /// request it takes for done, whose final record the worker sends again.
    /// A store that does not answer leaves it as it was before this check: taken for a repeat.
    async fn finished_unstored(&self, id: RequestId, from: InstanceId) -> bool {
        let owned_there = self.control().ownership(id).is_some_and(|o| !o.unfinished() && o.instance == from);
        if !owned_there {
            return false;
        }
        match self.store.get(&keys::result(id.0)).await {
            Ok(stored) => stored.is_none(),
            Err(e) => {
                tracing::warn!(
                    request = id.0,
                    "a repeated final record, taken as stored: the store did not answer ({e})"
                );
                false
            }
        }
    }

    /// Follow one worker's event log for as long as it is registered.
    async fn pump(self: Arc<Self>, instance: InstanceId, mut client: WorkerClient<Channel>, heard_ms: Arc<AtomicU64>) {
        let mut after_seq = 0u64;
        let mut backoff = Duration::from_millis(50);
        loop {
            if self.is_deposed() {
                return;
            }
            let stream = client.events(v1::EventsRequest { after_seq }).await;
            let mut stream = match stream {
                Ok(s) => {
                    backoff = Duration::from_millis(50);
                    s.into_inner()
                }
                Err(e) => {
                    tracing::debug!(instance = instance.0, "events stream: {e}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
            };
            let mut unacked = 0u32;
            loop {
                let ev = match stream.message().await {
                    Ok(Some(ev)) => ev,
                    Ok(None) | Err(_) => break,
                };
                heard_ms.store(self.ms_now(), Ordering::Relaxed);
                after_seq = ev.seq;
                let must_ack = match ev.event {
                    Some(v1::worker_event::Event::Tokens(t)) => {
                        if self.owns(RequestId(t.request_id), instance) {
                            self.forward_tokens(t);
                        }
                        false
                    }
                    Some(v1::worker_event::Event::Boundary(b)) => {
                        self.on_boundary(instance, b).await;
                        false
                    }
                    Some(v1::worker_event::Event::Finished(r)) => {
                        let mut rec = RequestRecord::from(&r);
                        if r.kv_rematerialized {
                            tracing::debug!(request = r.id, "finished after a re-materialised migration");
                        }
                        rec.finished_on = rec.finished_on.or(Some(instance));
                        if self.finish(rec, instance).await.is_err() {
                            return;
                        }
                        true
                    }
                    Some(v1::worker_event::Event::Load(l)) => {
                        self.on_load(instance, &l);
                        false
                    }
                    Some(v1::worker_event::Event::PrefillDone(p)) => {
                        self.on_prefill_done(p);
                        false
                    }
                    Some(v1::worker_event::Event::PrefillStarted(p)) => {
                        self.on_prefill_started(p);
                        false
                    }
                    Some(v1::worker_event::Event::KvEvents(k)) => {
                        // The prefix index follows the instance's cache (it said its own number).
                        let events = kvfleet_proto::kv_events_from_proto(&k);
                        let _ = self.decide(Event::KvEvents { instance, events });
                        false
                    }
                    None => false,
                };
                unacked += 1;
                if must_ack || unacked >= 256 {
                    unacked = 0;
                    let _ = client.ack(v1::AckRequest { up_to_seq: after_seq }).await;
                }
            }
            tokio::time::sleep(backoff).await;
        }
    }

    /// Whether `request` is placed on `instance` and unfinished (not re-placed elsewhere since).
    fn placed_on(&self, request: RequestId, instance: InstanceId) -> bool {
        self.control().ownership(request).is_some_and(|o| o.instance == instance && o.unfinished())
    }

    /// Whether `instance` holds `request` as far as the cluster knows (its owner, or the target
    /// of its move): another instance's tokens are a late copy's, never shown to the client.
    fn owns(&self, request: RequestId, instance: InstanceId) -> bool {
        self.control().ownership(request).is_some_and(|o| o.instance == instance || o.migrating_to == Some(instance))
    }

    fn forward_tokens(&self, t: v1::Tokens) {
        let tx = self.subscribers.lock().expect("subscribers lock").get(&RequestId(t.request_id)).cloned();
        if let Some(tx) = tx {
            let ev = v1::ClientEvent { event: Some(v1::client_event::Event::Tokens(t)) };
            if tx.try_send(Ok(ev)).is_err() {
                // A slow or gone client loses token notifications, never its final record.
                self.stats.dropped_token_events.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Before deciding about `request` as of `at` (no later than now): wait for the load reports
    /// due by then, but `except`'s ([`reports::DueReports::wait_through`]); log any given up on.
    /// `request`: `None` for a periodic pass.
    async fn await_reports(&self, at: Timestamp, except: Option<InstanceId>, request: Option<RequestId>) {
        let bound = *self.report_wait.lock().expect("report_wait lock");
        let late = self.due_reports.wait_through(at.min(self.cluster_now()), bound, except).await;
        if !late.is_empty() {
            let request = request.map(|r| r.0);
            tracing::debug!(request, ?late, "decided without the load reports due by its instant");
        }
    }

    /// `instance`'s load report: the controller's view, and placements waiting for it.
    fn on_load(self: &Arc<Self>, instance: InstanceId, l: &v1::LoadReport) {
        tracing::trace!(
            target: "kvfleet::reports",
            instance = instance.0,
            received_ns = self.cluster_now().0,
            next_due_ns = l.due_ns,
            "load report"
        );
        // A decoder with room again takes the handoffs waiting for one.
        let actions = self.decide(Event::Load(LoadReport::from(l))).unwrap_or_default();
        self.due_reports.reported(instance, l.due_ns);
        self.act(actions);
    }

    /// A `</think>` on `from`: decided (PASCAL's Alg. 2) on every other instance's load as of
    /// its instant, as the simulator decides it; `from`'s own came before it on its stream.
    async fn on_boundary(self: &Arc<Self>, from: InstanceId, b: v1::PhaseBoundary) {
        self.await_reports(Timestamp(b.at_ns), Some(from), Some(RequestId(b.request_id))).await;
        let event = Event::Boundary {
            request: RequestId(b.request_id),
            instance: InstanceId(b.instance),
            kv_blocks: b.kv_blocks,
        };
        if let Ok(actions) = self.decide(event) {
            self.act(actions);
        }
    }

    fn kv_address(&self, instance: InstanceId) -> String {
        self.links.lock().expect("links lock").get(&instance).map(|l| l.kv_address.clone()).unwrap_or_default()
    }

    /// One move the controller decided, and the ones it decides next when a target declines (no
    /// room: nothing was copied, the request never paused).
    async fn run_move(self: Arc<Self>, id: RequestId, from: InstanceId, to: InstanceId) {
        let mut next = Some((from, to));
        while let Some((from, to)) = next.take() {
            let moved = self.clone().migrate(id, from, to).await;
            let outcome = match moved {
                Moved::Yes => MoveOutcome::Committed,
                Moved::Refused => MoveOutcome::Refused,
                Moved::Corrupt => MoveOutcome::Corrupt,
                Moved::No => MoveOutcome::Aborted,
                Moved::Lost => MoveOutcome::Lost,
            };
            let actions = match self.decide(Event::MigrationEnded { request: id, from, to, outcome }) {
                Ok(actions) => actions,
                Err(e) => {
                    tracing::debug!(request = id.0, "move ended for a request no longer in flight: {e}");
                    Vec::new()
                }
            };
            if moved == Moved::Yes {
                self.stats.migrations.fetch_add(1, Ordering::Relaxed);
                self.handed_off(id);
            }
            if moved != Moved::Refused {
                let _ = self.persist_ownership(id).await;
            }
            let mut others = Vec::new();
            for action in actions {
                match action {
                    Action::Migrate { request, from, to: next_to, .. } if request == id => {
                        tracing::info!(
                            request = id.0,
                            from = from.0,
                            declined = to.0,
                            to = next_to.0,
                            "target full; trying another"
                        );
                        next = Some((from, next_to));
                    }
                    // Lost by both ends, or committed to a target that left meanwhile: re-placed.
                    other => others.push(other),
                }
            }
            // Moves of other requests: a decoder freed by this one takes a waiting handoff.
            let moves = self.execute(others).await;
            self.spawn_moves(moves);
        }
    }

    async fn migrate(self: Arc<Self>, id: RequestId, from: InstanceId, to: InstanceId) -> Moved {
        let (Some(mut src), Some(mut dst)) = (self.client(from), self.client(to)) else {
            return Moved::No;
        };
        let target_kv_address = self.kv_address(to);
        let live = !target_kv_address.is_empty();
        if live {
            // Where it is going, durably, before anything moves: a leader that takes over while
            // the move is open settles it (`settle_inherited_moves`) instead of leaving the
            // request paused in doubt on its source.
            if let Err(e) = self.persist_ownership(id).await {
                tracing::warn!(request = id.0, "not migrating: recording the move failed ({e})");
                return Moved::No;
            }
        }
        let order = self.next_move_order();
        tracing::debug!(target: "kvfleet::moves", request = id.0, from = from.0, to = to.0, at_ns = self.cluster_now().0, "calling MigrateOut");
        let req = v1::MigrateOutRequest {
            request_id: id.0,
            target: to.0,
            target_kv_address,
            leader_term: order.0,
            move_seq: order.1,
        };
        let out = match src.migrate_out(kvfleet_telemetry::request_with(&self.traces.context(id), req)).await {
            Ok(r) => r.into_inner(),
            Err(e) if call_broke(&e) => {
                // The call broke, not necessarily the move: a source that took it runs it to its
                // end whether or not anyone waits for the reply (a slow or paused worker, an HTTP/2
                // keep-alive that timed out mid-copy). Its outcome is unknown, as after a lost
                // COMMIT reply.
                self.stats.migration_failures.fetch_add(1, Ordering::Relaxed);
                if !live {
                    // The request's state travels in the reply: a broken call may have taken it
                    // with it. Counted lost (re-placed; a copy still running on the source is
                    // refused as a late one).
                    tracing::warn!(
                        request = id.0,
                        from = from.0,
                        to = to.0,
                        "migrate-out call broke ({e}); re-placing"
                    );
                    return Moved::Lost;
                }
                let why = format!("migrate-out call broke ({e})");
                return if self.settle_in_doubt(id, from, to, &src, &dst, &why).await { Moved::Yes } else { Moved::No };
            }
            Err(e) => {
                // The source answered: nothing moved (finished meanwhile, or an iteration boundary
                // refused it).
                tracing::debug!(request = id.0, "migrate-out refused: {e}");
                self.stats.migration_failures.fetch_add(1, Ordering::Relaxed);
                return Moved::No;
            }
        };
        if live {
            return self.settle_live(id, from, to, out, &src, &dst).await;
        }
        let attach = v1::AttachRequest { state: out.state.clone(), kv_rematerialized: true };
        match dst.attach(attach.clone()).await {
            Ok(_) => Moved::Yes,
            Err(e) => {
                tracing::warn!(
                    request = id.0,
                    from = from.0,
                    to = to.0,
                    "attach failed ({e}); returning the request to its source"
                );
                self.stats.migration_failures.fetch_add(1, Ordering::Relaxed);
                if src.attach(attach).await.is_err() {
                    return Moved::Lost;
                }
                Moved::No
            }
        }
    }

    /// A move whose outcome is unknown (`why`): ask the target whether it holds `id` (from then on
    /// it refuses a late COMMIT of this move), tell the source which copy lives; whether the
    /// target holds it.
    async fn settle_in_doubt(
        &self,
        id: RequestId,
        from: InstanceId,
        to: InstanceId,
        src: &WorkerClient<Channel>,
        dst: &WorkerClient<Channel>,
        why: &str,
    ) -> bool {
        let held = ask_target(id, Some(dst.clone()), self.moves_so_far()).await;
        let (told, _) = tell_source(id, src.clone(), held).await;
        tracing::warn!(request = id.0, from = from.0, to = to.0, held, ?told, "{why}; settled by asking the target");
        held
    }

    /// A live migration's reply: record where the request lives now. An unknown outcome (the
    /// connection broke after COMMIT) is settled by asking the target, which from then on refuses
    /// a late COMMIT, and telling the source which copy lives: never two copies, never none.
    async fn settle_live(
        self: &Arc<Self>,
        id: RequestId,
        from: InstanceId,
        to: InstanceId,
        out: v1::MigrateOutReply,
        src: &WorkerClient<Channel>,
        dst: &WorkerClient<Channel>,
    ) -> Moved {
        let mut outcome = out.outcome();
        let in_doubt = outcome == v1::MigrationOutcome::MigrationUnknown;
        if in_doubt {
            let held = self.settle_in_doubt(id, from, to, src, dst, "live migration outcome unknown").await;
            outcome =
                if held { v1::MigrationOutcome::MigrationCommitted } else { v1::MigrationOutcome::MigrationAborted };
        }
        let refused = out.stats.as_ref().is_some_and(v1::MigrationStats::refused);
        let corrupt = out.stats.as_ref().is_some_and(|s| s.checksum_mismatch);
        if let Some(mut stats) = out.stats {
            if in_doubt {
                // The source logged "unknown"; the log says what the target answered.
                stats.settle_in_doubt(outcome == v1::MigrationOutcome::MigrationCommitted);
            }
            self.log_migration(stats).await;
        }
        if outcome == v1::MigrationOutcome::MigrationCommitted {
            Moved::Yes
        } else {
            self.stats.migration_failures.fetch_add(1, Ordering::Relaxed);
            if refused {
                Moved::Refused
            } else if corrupt {
                Moved::Corrupt
            } else {
                Moved::No
            }
        }
    }

    /// The cluster as this leader sees it (members, loads, counters, migration log), for `Status`.
    pub fn status(&self, leader: &str, clock: ClusterTime) -> v1::ClusterStatus {
        let control = self.control();
        let instances = control
            .members()
            .map(|(id, address, load, alive)| v1::InstanceStatus {
                info: Some(v1::WorkerInfo { instance: id.0, advertise: address.to_string(), ..Default::default() }),
                load: Some((&load).into()),
                alive,
                role: control.role(id).to_string(),
            })
            .collect();
        v1::ClusterStatus {
            leader: leader.to_string(),
            epoch_unix_ns: clock.epoch_unix_ns,
            time_dilation: clock.dilation.factor(),
            instances,
            requests_in_flight: control.in_flight() as u64,
            requests_finished: self.stats.finished.load(Ordering::Relaxed),
            migrations: self.stats.migrations.load(Ordering::Relaxed),
            migrations_failed: self.stats.migration_failures.load(Ordering::Relaxed),
            late_results: self.stats.late_results.load(Ordering::Relaxed),
            cancelled: self.stats.cancelled.load(Ordering::Relaxed),
            stale_copies_dropped: self.stats.stale_copies_dropped.load(Ordering::Relaxed),
            workers_expelled: self.stats.expelled.load(Ordering::Relaxed),
            store: self.store.store_kind().to_string(),
            migration_log: self.migration_log.lock().expect("migration log lock").clone(),
            role_changes: self.roles.changes(),
            handoffs: self.stats.handoffs.load(Ordering::Relaxed),
            handoffs_released: self.stats.handoffs_released.load(Ordering::Relaxed),
            handoffs_overlapped: self.stats.handoffs_overlapped.load(Ordering::Relaxed),
            prefix_fetches: self.stats.prefix_fetches.load(Ordering::Relaxed),
            prefix_fetch_bytes: self.stats.prefix_fetch_bytes.load(Ordering::Relaxed),
        }
    }

    /// Moves a previous leader recorded as started but not as settled: it may have died (or lost
    /// its lease) with the source paused in doubt after a lost COMMIT reply, or in the middle of
    /// the copy. Settled as [`Leader::settle_live`] settles an unknown outcome: the target is
    /// asked whether it holds the request (from then on it refuses a late COMMIT), and the source
    /// is told which copy lives. A source whose move is still copying answers so and is told
    /// again once the move has ended (aborted at the target's refusal: it goes on there; its
    /// COMMIT reply lost: it waits in doubt for this word). Returns once every target has
    /// answered and every move that landed is recorded, so that re-submitting the unfinished
    /// requests next cannot reach a source that let its request go; a move that did not land is
    /// recorded once its source has been told (it holds the request until then).
    pub async fn settle_inherited_moves(self: &Arc<Self>) -> usize {
        let open: Vec<(RequestId, InstanceId, InstanceId)> = self
            .control()
            .requests()
            .values()
            .filter(|o| o.phase == OwnedPhase::Migrating)
            .filter_map(|o| o.migrating_to.map(|to| (o.spec.id, o.instance, to)))
            .collect();
        // Concurrently: one hung worker must not hold up the others.
        let asked: Vec<_> = open
            .iter()
            .map(|&(id, from, to)| {
                let leader = self.clone();
                let (answered, asked) = tokio::sync::oneshot::channel::<()>();
                tokio::spawn(async move {
                    let held = ask_target(id, leader.client(to), leader.moves_so_far()).await;
                    tracing::warn!(
                        request = id.0,
                        from = from.0,
                        to = to.0,
                        held,
                        "settled a move the previous leader left open"
                    );
                    if held {
                        leader.inherited_move_ended(id, from, to, true).await;
                    }
                    drop(answered);
                    if let Some(src) = leader.client(from) {
                        if let (_, Some(stats)) = tell_source(id, src, held).await {
                            leader.log_inherited_move(stats, to, held).await;
                        }
                    }
                    if !held {
                        leader.inherited_move_ended(id, from, to, false).await;
                    }
                });
                asked
            })
            .collect();
        for a in asked {
            let _ = a.await;
        }
        open.len()
    }

    /// Add a settled migration to the run's log: this leader's, and stored for the next leader's
    /// report of the run (a leader's log lives in its memory). Awaited before the move's end is
    /// stored (its request's ownership without `migrating_to`): a leader that dies between the
    /// reply and this write leaves the move open in the store, and its successor logs it from the
    /// source's measurements ([`Leader::settle_inherited_moves`]).
    async fn log_migration(&self, stats: v1::MigrationStats) {
        let key = keys::migration_log_entry(stats.started_ns, stats.request_id, stats.source);
        let value = prost::Message::encode_to_vec(&stats);
        let id = stats.request_id;
        self.migration_log.lock().expect("migration log lock").push(stats);
        if let Err(e) = self.persist(&key, &value).await {
            tracing::warn!(request = id, "migration not recorded for the next leader: {e}");
        }
    }

    /// Log a move a previous leader left open, from its source's own measurements (`stats`, the
    /// source's last move of the request), as its target's answer settled it (`held`): in doubt,
    /// as the source never heard its end from the leader. Not if it is another move than the one
    /// settled, or one the log holds already (that leader stored it before it died).
    async fn log_inherited_move(&self, mut stats: v1::MigrationStats, to: InstanceId, held: bool) {
        if stats.target != to.0 {
            return;
        }
        let same = |s: &v1::MigrationStats| {
            (s.started_ns, s.request_id, s.source) == (stats.started_ns, stats.request_id, stats.source)
        };
        if self.migration_log.lock().expect("migration log lock").iter().any(same) {
            return;
        }
        stats.settle_in_doubt(held);
        self.log_migration(stats).await;
    }

    /// Record how a move a previous leader left open ended, and carry out what follows.
    async fn inherited_move_ended(self: &Arc<Self>, id: RequestId, from: InstanceId, to: InstanceId, held: bool) {
        let outcome = if held { MoveOutcome::Committed } else { MoveOutcome::Aborted };
        // A move out of a prefill instance is its request's handoff (this leader did not start it,
        // so its book of open handoffs does not hold it).
        let handoff = held && self.control().role(from).hands_off();
        let actions = self.decide(Event::MigrationEnded { request: id, from, to, outcome }).unwrap_or_default();
        if held {
            self.stats.migrations.fetch_add(1, Ordering::Relaxed);
        }
        if handoff {
            self.inherited_handoff(id);
        }
        let _ = self.persist_ownership(id).await;
        let moves = self.execute(actions).await;
        self.spawn_moves(moves);
    }

    /// Unfinished requests and where they are owned (a new leader re-submits them: workers treat
    /// a known request id as already accepted, so nothing runs twice).
    pub async fn resubmit_unfinished(self: &Arc<Self>) {
        let todo: Vec<(InstanceId, RequestSpec)> = self
            .control()
            .requests()
            .values()
            .filter(|o| o.unfinished())
            .map(|o| (o.instance, o.spec.clone()))
            .collect();
        for (to, spec) in todo {
            if self.client(to).is_none() {
                // Its worker's registration lapsed while no leader was watching (it died during
                // the failover): no delete event will come, so start it over elsewhere now.
                tracing::warn!(request = spec.id.0, instance = to.0, "owner not registered; re-placing");
                self.replace(spec.id).await;
                continue;
            }
            // Concurrently: an owner that died but is not evicted yet (its submits time out) must
            // hold up neither the others nor the registry watch that will evict it.
            let leader = self.clone();
            tokio::spawn(async move { leader.submit_to_worker(to, &spec).await });
        }
    }

    /// Stop: abort every worker pump (a deposed leader must stop scheduling at once) and end every
    /// client's stream with `UNAVAILABLE`, so each client resumes through the next leader. (Tasks
    /// still finishing an RPC may hold this leader for a while; its client streams must not wait
    /// for them: a client left on a silent stream would never learn how its request ended.)
    pub fn stop(&self) {
        let _ = self.deposed_tx.send(true);
        for (_, l) in std::mem::take(&mut *self.links.lock().expect("links lock")) {
            l.pump.abort();
        }
        for (_, tx) in std::mem::take(&mut *self.subscribers.lock().expect("subscribers lock")) {
            // A full channel: the stream ends anyway when `tx` drops.
            let _ = tx.try_send(Err(Status::unavailable("this coordinator stepped down; resume with the new leader")));
        }
    }
}

/// Which copy of `id` lives after a move whose outcome is unknown, first half: ask the target
/// (`dst`) whether it holds the request. If not, it never will through a move ordered up to
/// `upto` (every move started so far, that one among them: [`Leader::moves_so_far`]): it refuses
/// their late PREPARE or COMMIT from then on. An unreachable, hung or unregistered target holds
/// nothing that will live (its registration lapses and its requests are re-placed): no. The
/// source is told next ([`tell_source`]).
/// Whether a failed call broke on the way (its connection, a deadline), rather than being
/// answered by the worker with a refusal: then whatever it asked may still happen.
fn call_broke(e: &tonic::Status) -> bool {
    std::error::Error::source(e).is_some()
        || matches!(e.code(), tonic::Code::Cancelled | tonic::Code::DeadlineExceeded | tonic::Code::Unknown)
}

async fn ask_target(id: RequestId, dst: Option<WorkerClient<Channel>>, upto: (u64, u64)) -> bool {
    let (term, seq) = upto;
    let Some(mut dst) = dst else { return false };
    let ask = dst.resolve_migration(v1::ResolveMigrationRequest {
        request_id: id.0,
        committed: None,
        fence_term: term,
        fence_seq: seq,
    });
    // A hung target answers nothing: as if unreachable.
    matches!(tokio::time::timeout(SETTLE_CALL_TIMEOUT, ask).await, Ok(Ok(r)) if r.get_ref().held)
}

/// Tell the source of `id`'s move which copy lives (`held`: the target's). A source left
/// uninformed stays paused in doubt: a failed call is worth a few tries, and a source answering
/// that its move is still copying is told again until the move has ended.
async fn tell_source(id: RequestId, src: WorkerClient<Channel>, held: bool) -> (Told, Option<v1::MigrationStats>) {
    let tell = v1::ResolveMigrationRequest { request_id: id.0, committed: Some(held), ..Default::default() };
    keep_telling(id, || {
        let mut src = src.clone();
        async move { src.resolve_migration(tell).await.map(tonic::Response::into_inner) }
    })
    .await
}

/// How telling a source ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Told {
    /// It answered (it acted if it was in doubt).
    Answered,
    /// Every try failed: it may stay paused in doubt.
    Unreachable,
    /// Its move was still under way after [`MOVE_END_PATIENCE`].
    StillMoving,
}

/// [`tell_source`]'s tries: `call` tells the source once.
async fn keep_telling<F, Fut>(id: RequestId, mut call: F) -> (Told, Option<v1::MigrationStats>)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<v1::ResolveMigrationReply, tonic::Status>>,
{
    let (mut failures, mut waited) = (0, Duration::ZERO);
    loop {
        let why = match tokio::time::timeout(SETTLE_CALL_TIMEOUT, call()).await {
            Ok(Ok(r)) if r.moving => {
                if waited >= MOVE_END_PATIENCE {
                    tracing::error!(
                        request = id.0,
                        "the source's move has not ended in {waited:?}; not telling it again"
                    );
                    return (Told::StillMoving, None);
                }
                tokio::time::sleep(MOVE_END_POLL).await;
                waited += MOVE_END_POLL;
                continue;
            }
            Ok(Ok(r)) => return (Told::Answered, r.stats),
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {SETTLE_CALL_TIMEOUT:?}"),
        };
        failures += 1;
        tracing::warn!(request = id.0, attempt = failures, "telling the source which copy lives failed: {why}");
        if failures == SETTLE_TELL_ATTEMPTS {
            return (Told::Unreachable, None);
        }
        tokio::time::sleep(Duration::from_millis(500) * failures).await;
    }
}

/// Moves this process has started, as leader of any term (counted across terms, so a leader
/// re-elected with its own key keeps ordering its moves after the earlier ones).
static MOVES_STARTED: AtomicU64 = AtomicU64::new(0);

/// How often a source whose move is still copying is told again, and for how long at most (its
/// move ends within its own migration deadline, which a worker sets; this bounds a worker that
/// never ends one).
const MOVE_END_POLL: Duration = Duration::from_millis(200);
const MOVE_END_PATIENCE: Duration = Duration::from_secs(600);

/// Bound on each call that settles a move: a leader taking over must not wait on a hung worker.
const SETTLE_CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Tries at telling a source which copy of its request lives.
const SETTLE_TELL_ATTEMPTS: u32 = 3;

/// Where a migration left the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Moved {
    Yes,
    /// It stays on its source.
    No,
    /// It stays on its source: the target had no room and nothing was copied.
    Refused,
    /// It stays on its source: bytes the target received failed their checksum.
    Corrupt,
    /// Neither the target nor the source holds it any more.
    Lost,
}

fn finished_event(rec: &RequestRecord) -> v1::ClientEvent {
    v1::ClientEvent { event: Some(v1::client_event::Event::Finished(rec.into())) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_core::policy::registry::{build_policy, PolicyParams};
    use kvfleet_core::{SimRng, Timestamp};
    use kvfleet_meta::MemStore;

    const MODEL: &str = "r1-distill-qwen-32b";
    const KV_BYTES: u64 = 262_144;

    /// A leader of `workers` registered workers nobody serves (a closed port): requests are
    /// placed and recorded, never run.
    async fn leader_with_unserved_workers(policy: &str, workers: u32) -> Arc<Leader> {
        let store: Arc<dyn MetaStore> = Arc::new(MemStore::new());
        leader_on(store, policy, &PdSetup::default(), workers).await
    }

    /// [`leader_with_unserved_workers`] on `store`, disaggregated as `pd` says, after restoring
    /// what the store holds.
    async fn leader_on(store: Arc<dyn MetaStore>, policy: &str, pd: &PdSetup, workers: u32) -> Arc<Leader> {
        let lease = store.grant_lease(Duration::from_secs(60)).await.unwrap();
        let fence = store.campaign(keys::ELECTION, b"here", lease).await.unwrap();
        let mut control =
            Controller::new(build_policy(policy, &PolicyParams::default()).unwrap(), SimRng::seed_from_u64(1))
                .expect_model(MODEL, KV_BYTES)
                .retain_finished();
        pd.apply(&mut control).unwrap();
        let leader = Leader::new(
            store,
            fence,
            control,
            worker_connector(None),
            ClusterTime { epoch_unix_ns: 0, dilation: kvfleet_core::Dilation::NONE },
        );
        leader.restore().await.unwrap();
        let closed = closed_address();
        for instance in 0..workers {
            leader.admit(&registration(instance, &closed, 1)).await.unwrap();
        }
        leader
    }

    /// An address nobody serves (the port was bound and released).
    fn closed_address() -> String {
        format!("http://{}", std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap())
    }

    fn registration(instance: u32, address: &str, incarnation: u64) -> WorkerRecord {
        WorkerRecord {
            instance,
            address: address.into(),
            model: MODEL.into(),
            kv_bytes_per_token: KV_BYTES,
            gpu_blocks: 1000,
            block_size: 16,
            scheduler: "pascal".into(),
            kv_address: String::new(),
            incarnation,
            arrow_profile: None,
        }
    }

    fn spec(id: u64, prompt_tokens: u32) -> RequestSpec {
        RequestSpec {
            content_ids: Vec::new(),
            id: RequestId(id),
            arrival: Timestamp(0),
            prompt_tokens,
            reasoning_tokens: 4,
            answer_tokens: 4,
        }
    }

    #[tokio::test]
    async fn simultaneous_arrivals_land_on_distinct_idle_workers() {
        for policy in ["pascal", "least-kv"] {
            let leader = leader_with_unserved_workers(policy, 8).await;
            let mut streams = Vec::new();
            // Submitted together, before any worker reports a load.
            for id in 0..8 {
                let (tx, rx) = mpsc::channel(16);
                let leader = leader.clone();
                tokio::spawn(async move { leader.submit(spec(id, 4000), tx).await });
                streams.push(rx);
            }
            let mut on = Vec::new();
            for rx in &mut streams {
                match rx.recv().await.expect("an event").expect("not an error").event {
                    Some(v1::client_event::Event::AcceptedOn(i)) => on.push(i),
                    other => panic!("{policy}: expected the placement first, got {other:?}"),
                }
            }
            on.sort_unstable();
            assert_eq!(on, (0..8).collect::<Vec<_>>(), "{policy}: one request per idle worker");
            leader.stop();
        }
    }

    /// A placement sees every load report due by its arrival: instance 0 reports itself fuller
    /// than instance 1 with an iteration ending before the arrival; its next report (empty)
    /// comes 50 ms after the request was submitted, and the request goes to 0 (without waiting
    /// it went to 1: the simulator, deciding at the arrival, would have seen 0 empty).
    #[tokio::test]
    async fn a_placement_waits_for_the_load_reports_due_by_its_arrival() {
        let leader = leader_with_unserved_workers("least-kv", 2).await;
        *leader.report_wait.lock().unwrap() = Duration::from_secs(10);
        let load = |instance: u32, gpu_used_blocks: u32, due_ns: u64| v1::LoadReport {
            due_ns,
            ..v1::LoadReport::from(&LoadReport {
                instance: InstanceId(instance),
                gpu_used_blocks,
                gpu_total_blocks: 1000,
                block_bytes: KV_BYTES * 16,
                block_tokens: 16,
                ..LoadReport::default()
            })
        };
        let now = leader.cluster_now();
        leader.on_load(InstanceId(0), &load(0, 300, now.0 - 1_000_000));
        leader.on_load(InstanceId(1), &load(1, 100, 0));
        let report = {
            let leader = leader.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                leader.on_load(InstanceId(0), &load(0, 0, 0));
            })
        };
        let (tx, mut rx) = mpsc::channel(16);
        let started = std::time::Instant::now();
        let on = leader.submit(RequestSpec { arrival: now, ..spec(1, 100) }, tx).await.expect("placed");
        assert_eq!(on, InstanceId(0), "placed on the load as of its arrival");
        assert!(started.elapsed() >= Duration::from_millis(40), "{:?}", started.elapsed());
        assert!(matches!(
            rx.recv().await,
            Some(Ok(v1::ClientEvent { event: Some(v1::client_event::Event::AcceptedOn(0)) }))
        ));
        report.await.unwrap();
        leader.stop();
    }

    /// A leader that did not run for longer than its bounds (stopped, starved of CPU) heard nobody
    /// meanwhile: back, it gives up no worker for its own absence, and their silence counts from
    /// its return.
    #[tokio::test]
    async fn a_leader_back_from_a_pause_gives_up_nobody_for_it() {
        let leader = leader_with_unserved_workers("least-kv", 2).await;
        leader.set_silence(Duration::from_millis(200), Duration::from_millis(800));
        let (tx, _rx) = mpsc::channel(16);
        leader.submit(spec(1, 100), tx).await.expect("placed");
        let watch = tokio::spawn(leader.clone().watch_silence());
        tokio::time::sleep(Duration::from_millis(50)).await;
        // The whole runtime stops, as the process does under SIGSTOP (no pump, no watch).
        std::thread::sleep(Duration::from_millis(1200));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let live = |i| leader.control().is_live(InstanceId(i));
        assert!(live(0) && live(1), "nobody given up for the leader's own pause");
        assert_eq!(leader.control().ownership(RequestId(1)).unwrap().replaced, 0, "its request stays");
        // Unheard for the bound after its return, they are given up as ever.
        tokio::time::sleep(Duration::from_millis(900)).await;
        assert!(!live(0) && !live(1), "silence still counts");
        watch.abort();
        leader.stop();
    }

    /// Two registered workers nobody can reach; instance 1 is kept "heard" (as its event pump
    /// would be), instance 0 goes quiet. Silent, 0 draws no placement; given up, its request
    /// moves to 1; heard again, it rejoins.
    #[tokio::test]
    async fn a_silent_worker_draws_no_placement_and_its_requests_move_after_the_bound() {
        let leader = leader_with_unserved_workers("least-kv", 2).await;
        leader.set_silence(Duration::from_millis(200), Duration::from_millis(800));
        let heard = |i: u32| leader.links.lock().unwrap().get(&InstanceId(i)).unwrap().heard_ms.clone();
        let (h0, h1) = (heard(0), heard(1));
        let keep = {
            let (leader, h1) = (leader.clone(), h1.clone());
            tokio::spawn(async move {
                loop {
                    h1.store(leader.ms_now(), Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
        };
        let placed = |leader: Arc<Leader>, id: u64| async move {
            let (tx, mut rx) = mpsc::channel(16);
            leader.submit(spec(id, 100), tx).await.expect("placed");
            match rx.recv().await.expect("an event").expect("not an error").event {
                Some(v1::client_event::Event::AcceptedOn(i)) => i,
                other => panic!("expected the placement, got {other:?}"),
            }
        };
        assert_eq!(placed(leader.clone(), 1).await, 0, "both idle: the lowest id");
        // Worker 0's registration, as the worker keeps it: under a lease of its own.
        let address = leader.links.lock().unwrap()[&InstanceId(0)].address.clone();
        let lease = leader.store.grant_lease(Duration::from_secs(60)).await.unwrap();
        leader.store.put_with_lease(&keys::worker(0), &json(&registration(0, &address, 1)), lease).await.unwrap();
        let watch = tokio::spawn(leader.clone().watch_silence());
        tokio::time::sleep(Duration::from_millis(400)).await;
        for id in 2..5 {
            assert_eq!(placed(leader.clone(), id).await, 1, "request {id}: not on the silent worker");
        }
        assert_eq!(leader.control().ownership(RequestId(1)).unwrap().instance, InstanceId(0), "not moved yet");
        tokio::time::sleep(Duration::from_millis(700)).await;
        let o = leader.control().ownership(RequestId(1)).cloned().unwrap();
        assert_eq!((o.instance, o.replaced), (InstanceId(1), 1), "given up: its request moved on");
        assert!(!leader.control().is_live(InstanceId(0)));
        // Expelled: its registration revoked (the worker, running again, finds it lapsed).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while leader.store.get(&keys::worker(0)).await.unwrap().is_some() {
            assert!(tokio::time::Instant::now() < deadline, "worker 0's registration is still there");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(leader.store.keep_alive(lease).await.is_err(), "its lease is gone");
        assert_eq!(leader.stats.expelled.load(Ordering::Relaxed), 1);
        h0.store(leader.ms_now(), Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert!(leader.control().is_live(InstanceId(0)), "heard again: it rejoined");
        keep.abort();
        watch.abort();
        leader.stop();
    }

    #[tokio::test]
    async fn a_stopped_leader_ends_its_client_streams() {
        let leader = leader_with_unserved_workers("pascal", 1).await;
        let (tx, mut rx) = mpsc::channel(16);
        leader.submit(spec(7, 8), tx).await.unwrap();
        let accepted = rx.recv().await.expect("accepted").unwrap();
        assert!(matches!(accepted.event, Some(v1::client_event::Event::AcceptedOn(0))), "{accepted:?}");
        // Something else (a task finishing an RPC) still holds the leader when it stops.
        let held = leader.clone();
        leader.stop();
        let end = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await.expect("the stream ends, not hangs");
        let status = end.expect("an explicit error first").expect_err("not an event");
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status}");
        assert!(rx.recv().await.is_none(), "then the stream is closed");
        drop(held);
    }

    /// Requests owned by `instance`, with their re-placement counts, as the leader recorded them
    /// in the store.
    async fn stored_on(leader: &Leader, instance: u32) -> BTreeMap<RequestId, u32> {
        let mut on = BTreeMap::new();
        for kv in leader.store.get_prefix(keys::REQUESTS).await.unwrap().kvs {
            let o: Ownership = serde_json::from_slice(&kv.value).unwrap();
            if o.instance == InstanceId(instance) {
                on.insert(o.spec.id, o.replaced);
            }
        }
        on
    }

    #[tokio::test]
    async fn a_worker_restarted_under_its_number_gives_up_what_the_old_process_held() {
        let leader = leader_with_unserved_workers("least-kv", 2).await;
        let mut streams = Vec::new();
        for id in 0..4 {
            let (tx, rx) = mpsc::channel(64);
            let leader = leader.clone();
            tokio::spawn(async move { leader.submit(spec(id, 4000), tx).await });
            streams.push(rx);
        }
        for rx in &mut streams {
            rx.recv().await.expect("accepted").unwrap();
        }
        let address = leader.links.lock().unwrap()[&InstanceId(1)].address.clone();
        let before = stored_on(&leader, 1).await;
        assert!(!before.is_empty() && before.values().all(|&r| r == 0), "{before:?}");

        // Its registration re-put (a refreshed lease, a re-registration after a lapse): nothing moves.
        leader.admit(&registration(1, &address, 1)).await.unwrap();
        assert_eq!(stored_on(&leader, 1).await, before, "the same process keeps its requests");
        assert_eq!(leader.stats.replaced.load(Ordering::Relaxed), 0);

        // A new process under the same number and address, before the old registration lapsed.
        leader.admit(&registration(1, &address, 2)).await.unwrap();
        let mut replaced = 0;
        for &id in before.keys() {
            let o = leader.control().ownership(id).cloned().unwrap();
            assert_eq!(o.replaced, 1, "request {id} re-placed once");
            assert!(leader.control().is_live(o.instance), "request {id} owned by a live instance");
            assert_eq!(o.phase, OwnedPhase::Reasoning);
            replaced += 1;
        }
        assert_eq!(leader.stats.replaced.load(Ordering::Relaxed), replaced);
        let stored = [stored_on(&leader, 0).await, stored_on(&leader, 1).await];
        for id in before.keys() {
            assert!(stored.iter().any(|on| on.get(id) == Some(&1)), "request {id}: the re-placement is recorded");
        }
        assert_eq!(leader.links.lock().unwrap()[&InstanceId(1)].incarnation, 2, "a fresh link");

        // The same again at another address (a worker that moved without its registration lapsing).
        let still = stored_on(&leader, 1).await;
        leader.admit(&registration(1, &closed_address(), 2)).await.unwrap();
        for (id, replaced) in still {
            assert_eq!(leader.control().ownership(id).unwrap().replaced, replaced + 1, "request {id}");
        }
        leader.stop();
    }

    /// A source whose move is still copying when a new leader settles it answers so, and is told
    /// again until the move has ended (then it acts: resumes the request or frees its copy); a
    /// source that cannot be reached is tried a few times, not forever.
    #[tokio::test(start_paused = true)]
    async fn a_source_still_moving_is_told_again_until_its_move_ended() {
        let calls = std::sync::atomic::AtomicU32::new(0);
        let told = keep_telling(RequestId(3), || {
            let n = calls.fetch_add(1, Ordering::Relaxed);
            async move { Ok(v1::ResolveMigrationReply { held: true, moving: n < 5, stats: None }) }
        })
        .await;
        assert_eq!((told.0, calls.load(Ordering::Relaxed)), (Told::Answered, 6), "told until the move ended");

        let calls = std::sync::atomic::AtomicU32::new(0);
        let told = keep_telling(RequestId(3), || {
            calls.fetch_add(1, Ordering::Relaxed);
            async { Err(tonic::Status::unavailable("gone")) }
        })
        .await;
        assert_eq!((told.0, calls.load(Ordering::Relaxed)), (Told::Unreachable, SETTLE_TELL_ATTEMPTS));

        let started = tokio::time::Instant::now();
        let told = keep_telling(RequestId(3), || async {
            Ok(v1::ResolveMigrationReply { held: true, moving: true, stats: None })
        })
        .await;
        assert_eq!(told.0, Told::StillMoving);
        assert!(started.elapsed() >= MOVE_END_PATIENCE, "patient for as long as a move may last");
    }

    /// The role stored for `instance`, once it is `want` (the leader stores roles in a task of
    /// its own); panics after 10 s.
    async fn stored_role(store: &Arc<dyn MetaStore>, instance: u32, want: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let got = store.get(&keys::role(instance)).await.unwrap().map(|kv| kv.value);
            if got.as_deref() == Some(format!("\"{want}\"").as_bytes()) {
                return;
            }
            assert!(tokio::time::Instant::now() < deadline, "instance {instance}: stored {got:?}, not {want}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn roles_are_stored_fenced_and_a_new_leader_takes_them_over() {
        use kvfleet_control::roles::PdConfig;
        use kvfleet_control::Role;
        let store: Arc<dyn MetaStore> = Arc::new(MemStore::new());
        let pd = PdSetup {
            config: PdConfig { prefill_instances: 1, ..PdConfig::default() },
            arrow_profile: None,
            decode_profile: None,
        };
        let a = leader_on(store.clone(), "least-kv", &pd, 3).await;
        // The split, as the workers joined; then a flip decided by the controller.
        stored_role(&store, 0, "prefill").await;
        stored_role(&store, 1, "decode").await;
        stored_role(&store, 2, "decode").await;
        a.control().set_role(InstanceId(1), Role::Prefill);
        let flip = a.decide(Event::Tick).unwrap();
        assert!(matches!(flip[..], [Action::SetRole { instance: InstanceId(1), role: Role::Prefill }]), "{flip:?}");
        a.act(flip);
        stored_role(&store, 1, "prefill").await;
        let changes = a.status("a", a.clock).role_changes;
        assert_eq!(changes.iter().map(|c| (c.instance, c.role.as_str())).collect::<Vec<_>>(), [(1, "prefill")]);

        // A takes no more decisions; B leads (A's lease is gone) and reads the roles back: the
        // flip, not the split, for instance 1.
        a.stop();
        store.resign(&a.fence).await.unwrap();
        let b = leader_on(store.clone(), "least-kv", &pd, 3).await;
        for (i, role) in [(0, Role::Prefill), (1, Role::Prefill), (2, Role::Decode)] {
            assert_eq!(b.control().role(InstanceId(i)), role, "instance {i}");
        }
        let taken_over = b.status("b", b.clock).role_changes;
        assert_eq!(taken_over, changes, "the run's flips so far, read back, not flips of B's");
        stored_role(&store, 1, "prefill").await;

        // A role A decides now is refused by the fence: stored nowhere, told to no worker.
        let (store_a, fence_a) = (a.store.clone(), a.fence.clone());
        drop(a);
        let late = Leader::new(
            store_a,
            fence_a,
            Controller::new(build_policy("least-kv", &PolicyParams::default()).unwrap(), SimRng::seed_from_u64(1)),
            worker_connector(None),
            ClusterTime { epoch_unix_ns: 0, dilation: kvfleet_core::Dilation::NONE },
        );
        late.set_role(InstanceId(2), Role::Prefill);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !late.is_deposed() {
            assert!(tokio::time::Instant::now() < deadline, "the refused write deposes the old leader");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        stored_role(&store, 2, "decode").await;
        b.stop();
    }

    /// A `MigrateOut` call that breaks (a worker too slow to answer before the HTTP/2 keep-alive
    /// gives up) says nothing about the move, which the source runs to its end: the leader asks
    /// the target (fencing it) and tells the source which copy lives, and records the request
    /// where it lives. Before, a broken call counted as "nothing moved": the request stayed owned
    /// by a source that had handed it off, and the target's final record was refused as a late
    /// copy (the request never finished).
    #[tokio::test]
    async fn a_broken_migrate_out_call_is_settled_by_asking_the_target() {
        for (error, target_holds) in [
            (Status::unknown("h2 protocol error: keep-alive timed out"), true),
            (Status::cancelled("the call was cancelled"), false),
        ] {
            let (leader, src, dst) = moving_between_fakes(error.clone(), target_holds).await;
            let moved = leader.clone().migrate(RequestId(5), InstanceId(0), InstanceId(1)).await;
            assert_eq!(moved, if target_holds { Moved::Yes } else { Moved::No }, "{error}");
            let (term, seq) = leader.moves_so_far();
            assert_eq!(dst.resolved(), vec![(5, None, term, seq)], "the target asked, fenced up to this move");
            assert_eq!(src.resolved(), vec![(5, Some(target_holds), 0, 0)], "the source told which copy lives");
            leader.stop();
        }
        // A refusal the source answered is not in doubt: nobody is asked.
        let (leader, src, dst) = moving_between_fakes(Status::failed_precondition("req-5 is not running"), true).await;
        assert_eq!(leader.clone().migrate(RequestId(5), InstanceId(0), InstanceId(1)).await, Moved::No);
        assert!(dst.resolved().is_empty() && src.resolved().is_empty());
        leader.stop();
    }

    /// [`Leader::drop_copy`] racing a re-placement onto the same instance: request 5 is placed
    /// there while the drop is in flight, so the placement's submit reaches the worker before the
    /// drop frees the stale copy. The leader then submits it again, so it runs there afresh.
    #[tokio::test]
    async fn a_request_placed_where_its_stale_copy_is_being_dropped_is_submitted_again() {
        let stale = fake_worker::FakeWorker::default();
        let gate = Arc::new(tokio::sync::Notify::new());
        stale.0.lock().unwrap().cancel_gate = Some(gate.clone());
        let leader = request_5_on_fake_0(&fake_worker::FakeWorker::default(), &stale, false).await;
        let dropping = tokio::spawn(leader.clone().drop_copy(RequestId(5), InstanceId(1)));
        stale.wait_for_call("cancel 5").await;
        // Instance 0 leaves: request 5 is re-placed on 1, the only one left, and submitted there
        // while the drop is still on its way.
        leader.evict(InstanceId(0)).await;
        stale.wait_for_call("submit 5").await;
        gate.notify_one();
        dropping.await.unwrap();
        let calls = stale.calls();
        assert_eq!(
            calls,
            ["cancel 5", "submit 5", "cancel 5 answered", "submit 5"],
            "submitted again after the drop freed the copy that placement found"
        );
        leader.stop();

        // Not placed there: the drop is the end of it.
        let stale = fake_worker::FakeWorker::default();
        let leader = request_5_on_fake_0(&fake_worker::FakeWorker::default(), &stale, false).await;
        leader.clone().drop_copy(RequestId(5), InstanceId(1)).await;
        assert_eq!(stale.calls(), ["cancel 5", "cancel 5 answered"]);
        leader.stop();
    }

    /// A leader whose request 5 runs on fake worker 0, whose `MigrateOut` fails with `error`;
    /// fake worker 1 answers that it holds the request when asked if `target_holds`.
    async fn moving_between_fakes(
        error: Status,
        target_holds: bool,
    ) -> (Arc<Leader>, fake_worker::FakeWorker, fake_worker::FakeWorker) {
        let (src, dst) = (fake_worker::FakeWorker::default(), fake_worker::FakeWorker::default());
        src.0.lock().unwrap().migrate_out_error = Some(error);
        dst.0.lock().unwrap().holds = target_holds;
        let leader = request_5_on_fake_0(&src, &dst, true).await;
        (leader, src, dst)
    }

    /// A move the previous leader left open (request 5 from worker 0 to 1; the source's reply died
    /// with that leader): the new leader settles it by asking the target, tells the source, and
    /// logs the move from the measurements the source kept, in doubt, as the target's answer
    /// settled it. A source whose last move of the request went elsewhere adds nothing.
    #[tokio::test]
    async fn a_move_the_last_leader_left_open_is_logged_from_its_sources_measurements() {
        for (target_holds, measured_to) in [(true, 1), (false, 1), (true, 2)] {
            let (src, dst) = (fake_worker::FakeWorker::default(), fake_worker::FakeWorker::default());
            dst.0.lock().unwrap().holds = target_holds;
            src.0.lock().unwrap().last_move = Some(v1::MigrationStats {
                source: 0,
                target: measured_to,
                request_id: 5,
                bytes: 4 << 20,
                started_ns: 1_000,
                ended_ns: 9_000,
                abort_reason: if target_holds { String::new() } else { "connection to the peer lost".into() },
                ..Default::default()
            });
            let leader = request_5_on_fake_0(&src, &dst, true).await;
            // Worker 0 prefills: the move is request 5's handoff.
            leader.control().set_role(InstanceId(0), kvfleet_control::Role::Prefill);
            let mut open = leader.control().ownership(RequestId(5)).unwrap().clone();
            open.phase = OwnedPhase::Migrating;
            open.migrating_to = Some(InstanceId(1));
            leader.control().restore([open]);
            assert_eq!(leader.settle_inherited_moves().await, 1);
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while src.resolved().is_empty() {
                assert!(tokio::time::Instant::now() < deadline, "the source is told");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let log = || leader.status("b", leader.clock).migration_log;
            if measured_to != 1 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                assert!(log().is_empty(), "another move's measurements: {:?}", log());
                leader.stop();
                continue;
            }
            while log().is_empty() {
                assert!(tokio::time::Instant::now() < deadline, "the move is logged");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let logged = log();
            assert_eq!(logged.len(), 1, "{logged:?}");
            let m = &logged[0];
            assert_eq!((m.request_id, m.source, m.target, m.bytes, m.in_doubt), (5, 0, 1, 4 << 20, true));
            assert_eq!(m.committed(), target_holds, "as the target's answer settled it: {m:?}");
            assert_eq!(
                leader.stats.handoffs.load(Ordering::Relaxed),
                u64::from(target_holds),
                "a handoff if it landed"
            );
            leader.stop();
        }
    }

    /// A leader killed after a move's reply but before its log entry is stored leaves the move
    /// open in the store (its ownership still says where the request was going): the next leader
    /// settles it and logs it from its source's measurements. Before, the move's end was stored
    /// first and its log entry after, aside: a leader killed between the two left it unlogged.
    #[tokio::test]
    async fn a_leader_killed_before_logging_a_move_leaves_it_for_the_next_to_log() {
        let mem = MemStore::new();
        let store: Arc<dyn MetaStore> = Arc::new(mem.clone());
        let (src, dst) = (fake_worker::FakeWorker::default(), fake_worker::FakeWorker::default());
        let measured = v1::MigrationStats {
            source: 0,
            target: 1,
            request_id: 5,
            bytes: 4 << 20,
            started_ns: 1_000,
            ended_ns: 9_000,
            ..Default::default()
        };
        src.0.lock().unwrap().migrate_out_reply = Some(v1::MigrateOutReply {
            outcome: v1::MigrationOutcome::MigrationCommitted as i32,
            stats: Some(measured.clone()),
            ..Default::default()
        });
        src.0.lock().unwrap().last_move = Some(measured);
        dst.0.lock().unwrap().holds = true;
        let a = leader_on(store.clone(), "least-kv", &PdSetup::default(), 0).await;
        serve_on_fakes(&a, &src, &dst, true).await;
        let (tx, mut rx) = mpsc::channel(16);
        a.submit(spec(5, 100), tx).await.unwrap();
        assert!(matches!(rx.recv().await.unwrap().unwrap().event, Some(v1::client_event::Event::AcceptedOn(0))));
        // Worker 0 prefills, 1 decodes: the request's handoff. A's write of its log entry never
        // lands: A is killed while it waits.
        a.control().set_role(InstanceId(0), kvfleet_control::Role::Prefill);
        a.control().set_role(InstanceId(1), kvfleet_control::Role::Decode);
        mem.hang_writes_under(Some(keys::MIGRATION_LOG));
        let handoff = a.decide(Event::PrefillDone { request: RequestId(5), instance: InstanceId(0), kv_blocks: 1 });
        // (The role changes queued first are not what this test is about.)
        let handoff: Vec<_> = handoff.unwrap().into_iter().filter(|a| matches!(a, Action::Migrate { .. })).collect();
        assert!(matches!(handoff[..], [Action::Migrate { to: InstanceId(1), .. }]), "{handoff:?}");
        a.act(handoff);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while mem.hung_writes() == 0 {
            assert!(tokio::time::Instant::now() < deadline, "the move's log entry is written");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        a.stop();
        store.resign(&a.fence).await.unwrap();
        mem.hang_writes_under(None);
        let stored: Ownership =
            serde_json::from_slice(&store.get(&keys::request(5)).await.unwrap().unwrap().value).unwrap();
        assert_eq!(stored.migrating_to, Some(InstanceId(1)), "the move's end is not stored before its log entry");

        let b = leader_on(store.clone(), "least-kv", &PdSetup::default(), 0).await;
        serve_on_fakes(&b, &src, &dst, true).await;
        assert_eq!(b.settle_inherited_moves().await, 1);
        let log = || b.status("b", b.clock).migration_log;
        while log().is_empty() {
            assert!(tokio::time::Instant::now() < deadline, "the move is logged");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let m = &log()[0];
        assert_eq!((m.request_id, m.source, m.target, m.bytes, m.committed()), (5, 0, 1, 4 << 20, true));
        assert_eq!(b.control().ownership(RequestId(5)).unwrap().instance, InstanceId(1), "it lives on the target");
        while store.get_prefix(keys::MIGRATION_LOG).await.unwrap().kvs.is_empty() {
            assert!(tokio::time::Instant::now() < deadline, "and stored for the leader after");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        b.stop();
    }

    /// A request that finished while its move was being settled: the move's end stores its
    /// ownership as finished. A leader killed after that write but before the result's leaves a
    /// record the next leader takes for done; the worker's final record, sent again to it, is
    /// stored then (before, it was dropped as a repeat, and the request never completed). A
    /// repeat of a stored one is not stored again.
    #[tokio::test]
    async fn a_final_record_the_last_leader_did_not_store_is_stored() {
        let store: Arc<dyn MetaStore> = Arc::new(MemStore::new());
        let a = leader_on(store.clone(), "least-kv", &PdSetup::default(), 1).await;
        let (tx, mut rx) = mpsc::channel(16);
        a.submit(spec(5, 100), tx).await.unwrap();
        assert!(matches!(rx.recv().await.unwrap().unwrap().event, Some(v1::client_event::Event::AcceptedOn(0))));
        // Finished in A's controller; A is killed before the result is stored, after a move's end
        // stored the request's ownership.
        a.decide(Event::Finished { request: RequestId(5), from: Some(InstanceId(0)) }).unwrap();
        a.persist_ownership(RequestId(5)).await.unwrap();
        a.stop();
        store.resign(&a.fence).await.unwrap();
        let b = leader_on(store.clone(), "least-kv", &PdSetup::default(), 1).await;
        assert_eq!(b.control().in_flight(), 0, "B takes it for finished");
        let (tx, mut rx) = mpsc::channel(16);
        b.resume(RequestId(5), tx).await.unwrap();
        // A copy elsewhere is no owner's: not stored.
        let stale = RequestRecord { id: RequestId(5), answer_tokens: 9, ..Default::default() };
        b.finish(stale, InstanceId(1)).await.unwrap();
        assert!(store.get(&keys::result(5)).await.unwrap().is_none());
        let rec = RequestRecord { id: RequestId(5), answer_tokens: 4, ..Default::default() };
        b.finish(rec.clone(), InstanceId(0)).await.unwrap();
        let stored: RequestRecord =
            serde_json::from_slice(&store.get(&keys::result(5)).await.unwrap().unwrap().value).unwrap();
        assert_eq!(stored.answer_tokens, 4, "its result is stored");
        let mut finished = None;
        while let Ok(Some(Ok(ev))) = rx.try_recv().map(Some) {
            if let Some(v1::client_event::Event::Finished(f)) = ev.event {
                finished = Some(f);
            }
        }
        assert!(finished.is_some(), "and its client gets it");
        // The worker sends it once more: a repeat now.
        b.finish(RequestRecord { answer_tokens: 7, ..rec }, InstanceId(0)).await.unwrap();
        let stored: RequestRecord =
            serde_json::from_slice(&store.get(&keys::result(5)).await.unwrap().unwrap().value).unwrap();
        assert_eq!(stored.answer_tokens, 4, "stored once");
        b.stop();
    }

    /// A client resuming with a new leader while its request's final record is being stored: the
    /// leader looked for the result (none yet), the worker's record was stored (nobody subscribed
    /// to be told), then the client subscribed. It still gets the record. Before, it waited for
    /// ever (seen under load in the Arrow failover run: 59 of 60 requests finished).
    #[tokio::test]
    async fn a_client_resuming_as_its_result_is_stored_gets_it() {
        let mem = MemStore::new();
        let store: Arc<dyn MetaStore> = Arc::new(mem.clone());
        let a = leader_on(store.clone(), "least-kv", &PdSetup::default(), 1).await;
        let (tx, _gone) = mpsc::channel(16);
        a.submit(spec(5, 100), tx).await.unwrap();
        a.stop();
        store.resign(&a.fence).await.unwrap();
        let b = leader_on(store.clone(), "least-kv", &PdSetup::default(), 1).await;
        let gate = mem.hold_next_read_under(keys::RESULTS);
        let (tx, mut rx) = mpsc::channel(16);
        let resuming = tokio::spawn({
            let b = b.clone();
            async move { b.resume(RequestId(5), tx).await }
        });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while mem.held_reads() == 0 {
            assert!(tokio::time::Instant::now() < deadline, "the resume looks for the result");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        b.finish(RequestRecord { id: RequestId(5), answer_tokens: 4, ..Default::default() }, InstanceId(0))
            .await
            .unwrap();
        gate.notify_one();
        resuming.await.unwrap().unwrap();
        let mut events = Vec::new();
        while let Ok(Ok(ev)) = rx.try_recv() {
            events.push(ev.event);
        }
        let finished = events.iter().filter(|e| matches!(e, Some(v1::client_event::Event::Finished(_)))).count();
        assert_eq!(finished, 1, "told once: {events:?}");
        b.stop();
    }

    /// A leader with fake workers 0 and 1 registered (`live`: with a QUIC address each, where
    /// nothing listens and nothing is sent) and request 5 placed on 0.
    async fn request_5_on_fake_0(
        first: &fake_worker::FakeWorker,
        second: &fake_worker::FakeWorker,
        live: bool,
    ) -> Arc<Leader> {
        let leader = leader_with_unserved_workers("least-kv", 0).await;
        serve_on_fakes(&leader, first, second, live).await;
        let (tx, mut rx) = mpsc::channel(16);
        leader.submit(spec(5, 100), tx).await.unwrap();
        let placed = rx.recv().await.unwrap().unwrap().event;
        assert!(matches!(placed, Some(v1::client_event::Event::AcceptedOn(0))), "{placed:?}");
        leader
    }

    /// Register fake workers 0 and 1 with `leader` (`live`: with a QUIC address each).
    async fn serve_on_fakes(
        leader: &Arc<Leader>,
        first: &fake_worker::FakeWorker,
        second: &fake_worker::FakeWorker,
        live: bool,
    ) {
        for (instance, worker) in [(0, first), (1, second)] {
            let mut rec = registration(instance, &worker.serve().await, 1);
            if live {
                rec.kv_address = format!("127.0.0.1:{}", 40_000 + instance);
            }
            leader.admit(&rec).await.unwrap();
        }
    }
}
