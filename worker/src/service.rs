//! The `kvfleet.v1.Worker` gRPC service: network requests in, driver commands out.
//!
//! Validation happens here (malformed input → `InvalidArgument` naming the field, before anything
//! reaches the engine); decisions happen in the driver's engine. Every call is a command to the
//! driver thread answered over a oneshot channel, except `Events`/`Ack`, which read the shared
//! event log directly so that a slow reader never stalls the engine loop.

use crate::driver::{CancelKind, Command, DriverError, DriverStats, SubmitOutcome};
use crate::events::{EventLog, Read};
use crate::ledger::Settle;
use crate::migrate::{stats_proto, Migrator};
use kvfleet_core::engine::MigratedRequest;
use kvfleet_core::RequestId;
use kvfleet_netmodel::migration::{MoveOrder, Outcome};
use kvfleet_pki::Role;
use kvfleet_proto::v1::worker_server::Worker;
use kvfleet_proto::{require_spec, v1, MAX_TOKENS_PER_REQUEST};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

/// Events sent per read of the log (and the depth of each stream's send queue).
const EVENTS_BATCH: usize = 256;

/// Starts a graceful stop once: drain, let running requests finish for the grace period, stop.
#[derive(Clone, Debug)]
pub struct ShutdownTrigger {
    inner: Arc<TriggerInner>,
}

#[derive(Debug)]
struct TriggerInner {
    fired: AtomicBool,
    commands: Mutex<Sender<Command>>,
    grace: Duration,
}

impl ShutdownTrigger {
    pub(crate) fn new(commands: Sender<Command>, grace: Duration) -> Self {
        ShutdownTrigger {
            inner: Arc::new(TriggerInner { fired: AtomicBool::new(false), commands: Mutex::new(commands), grace }),
        }
    }

    /// Begin the graceful stop (idempotent).
    pub fn trigger(&self) {
        if self.inner.fired.swap(true, Ordering::SeqCst) {
            return;
        }
        let tx = self.inner.commands.lock().unwrap_or_else(|p| p.into_inner());
        // An error means the driver already stopped: nothing left to stop.
        let _ = tx.send(Command::Shutdown { grace: self.inner.grace });
    }

    /// Whether the graceful stop has begun (from any source).
    pub fn is_triggered(&self) -> bool {
        self.inner.fired.load(Ordering::SeqCst)
    }
}

/// The tonic service of one worker.
#[derive(Debug)]
pub struct WorkerService {
    info: v1::WorkerInfo,
    commands: Sender<Command>,
    log: Arc<EventLog>,
    shutdown: ShutdownTrigger,
    /// Live migration endpoint (`None`: this worker cannot migrate live, e.g. `--plaintext`).
    migrator: Option<Arc<Migrator>>,
    /// The measurements of the last [`RECENT_MOVES`] live moves out, newest last: a leader that
    /// died before it got a move's reply leaves them to the next, which asks when it settles it.
    recent_moves: Arc<std::sync::Mutex<std::collections::VecDeque<v1::MigrationStats>>>,
}

/// Live moves out whose measurements a worker keeps for a new leader.
const RECENT_MOVES: usize = 1024;

fn stopped() -> Status {
    Status::unavailable("the worker is shutting down")
}

impl WorkerService {
    pub(crate) fn new(
        info: v1::WorkerInfo,
        commands: Sender<Command>,
        log: Arc<EventLog>,
        shutdown: ShutdownTrigger,
        migrator: Option<Arc<Migrator>>,
    ) -> Self {
        WorkerService { info, commands, log, shutdown, migrator, recent_moves: Default::default() }
    }

    fn migrator(&self) -> Result<&Arc<Migrator>, Status> {
        self.migrator
            .as_ref()
            .ok_or_else(|| Status::failed_precondition("this worker has no live-migration endpoint (--plaintext)"))
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Result<T, Status> {
        let (tx, rx) = oneshot::channel();
        self.commands.send(make(tx)).map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())
    }

    /// The driver's counters (lateness, engine, arena, log).
    pub(crate) async fn stats(&self) -> Result<DriverStats, Status> {
        self.ask(|reply| Command::Stats { reply }).await
    }
}

/// Check a migrated request's state before it reaches the engine.
fn parse_state(state: &[u8]) -> Result<MigratedRequest, Status> {
    let m: MigratedRequest = serde_json::from_slice(state)
        .map_err(|e| Status::invalid_argument(format!("`state`: not a serialized migrated request: {e}")))?;
    if m.spec.answer_tokens == 0 {
        return Err(Status::invalid_argument("`state.spec.answer_tokens`: must be at least 1"));
    }
    let total = m.spec.prompt_tokens as u64 + m.spec.output_tokens() as u64;
    if total > MAX_TOKENS_PER_REQUEST as u64 || m.spec.prompt_tokens.checked_add(m.spec.output_tokens()).is_none() {
        return Err(Status::invalid_argument(format!("`state.spec`: {total} tokens exceeds {MAX_TOKENS_PER_REQUEST}")));
    }
    if m.generated >= m.spec.output_tokens() {
        return Err(Status::invalid_argument(format!(
            "`state.generated`: {} of {} output tokens already generated: the request is finished",
            m.generated,
            m.spec.output_tokens()
        )));
    }
    if m.record.id != m.spec.id {
        return Err(Status::invalid_argument(format!(
            "`state.record.id` {} differs from `state.spec.id` {}",
            m.record.id, m.spec.id
        )));
    }
    Ok(m)
}

fn driver_status(e: DriverError) -> Status {
    use kvfleet_core::engine::EngineError as E;
    match e {
        DriverError::Unknown(_) | DriverError::Engine(E::Unknown(_)) => Status::not_found(e.to_string()),
        DriverError::Draining => Status::failed_precondition(e.to_string()),
        DriverError::Engine(E::TooLarge { .. } | E::NoRoom { .. }) => Status::resource_exhausted(e.to_string()),
        DriverError::Engine(E::NoAnswer { .. }) => Status::invalid_argument(e.to_string()),
        DriverError::Engine(E::IterationInFlight) => Status::unavailable(e.to_string()),
        DriverError::Engine(
            E::Duplicate(_) | E::NotMigrating(_) | E::Migrating(_) | E::NotHeld(_) | E::Prefilling(_),
        ) => Status::failed_precondition(e.to_string()),
        DriverError::KvCorrupt { .. } | DriverError::Serialize { .. } | DriverError::Arena(_) => {
            Status::internal(e.to_string())
        }
        DriverError::Kv { .. } | DriverError::Refused { .. } => Status::failed_precondition(e.to_string()),
        DriverError::Ledger(_) => Status::internal(e.to_string()),
    }
}

/// Feed one `Events` stream: the log after `cursor`, then live events, until the log closes or
/// the client goes away.
async fn stream_events(log: Arc<EventLog>, mut cursor: u64, tx: mpsc::Sender<Result<v1::WorkerEvent, Status>>) {
    let mut changes = log.subscribe();
    let mut buf = Vec::with_capacity(EVENTS_BATCH);
    loop {
        changes.borrow_and_update();
        buf.clear();
        match log.read_after(cursor, EVENTS_BATCH, &mut buf) {
            Read::Some => {
                for ev in buf.drain(..) {
                    cursor = ev.seq;
                    if let Some(v1::worker_event::Event::PrefillDone(p)) = &ev.event {
                        tracing::debug!(target: "kvfleet::moves", request = p.request_id, at_ns = p.at_ns, "prefill done streamed");
                    }
                    if tx.send(Ok(ev)).await.is_err() {
                        return;
                    }
                }
            }
            Read::Closed => return,
            Read::Empty => {
                tokio::select! {
                    changed = changes.changed() => if changed.is_err() { return },
                    _ = tx.closed() => return,
                }
            }
        }
    }
}

#[tonic::async_trait]
impl Worker for WorkerService {
    async fn info(&self, _: Request<v1::InfoRequest>) -> Result<Response<v1::WorkerInfo>, Status> {
        if let Ok(s) = self.stats().await {
            tracing::info!(iterations = s.engine.iterations, requests = s.requests, "timer {}", s.lateness);
        }
        Ok(Response::new(self.info.clone()))
    }

    async fn submit(&self, request: Request<v1::SubmitRequest>) -> Result<Response<v1::SubmitReply>, Status> {
        kvfleet_pki::authorize(&request, &[Role::Coordinator], "Worker/Submit")?;
        let spec = require_spec(request.get_ref().spec.as_ref())?;
        let (meant, this) = (request.get_ref().incarnation, self.info.incarnation);
        if meant != 0 && meant != this {
            return Err(Status::failed_precondition(format!(
                "request {} was submitted to incarnation {meant} of instance {}; this process is incarnation {this} \
                 (the one it was meant for is gone)",
                spec.id.0, self.info.instance
            )));
        }
        let outcome = self.ask(|reply| Command::Submit { spec, reply }).await?;
        let reply = match outcome {
            SubmitOutcome::Accepted => v1::SubmitReply { accepted: true, reason: String::new() },
            SubmitOutcome::Duplicate => {
                v1::SubmitReply { accepted: true, reason: "already accepted (duplicate submit)".into() }
            }
            SubmitOutcome::Rejected(reason) => v1::SubmitReply { accepted: false, reason },
        };
        Ok(Response::new(reply))
    }

    type EventsStream = ReceiverStream<Result<v1::WorkerEvent, Status>>;

    async fn events(&self, request: Request<v1::EventsRequest>) -> Result<Response<Self::EventsStream>, Status> {
        kvfleet_pki::authorize(&request, &[Role::Coordinator], "Worker/Events")?;
        let (tx, rx) = mpsc::channel(EVENTS_BATCH);
        tokio::spawn(stream_events(self.log.clone(), request.get_ref().after_seq, tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn ack(&self, request: Request<v1::AckRequest>) -> Result<Response<v1::AckReply>, Status> {
        kvfleet_pki::authorize(&request, &[Role::Coordinator], "Worker/Ack")?;
        self.log.ack(request.get_ref().up_to_seq);
        Ok(Response::new(v1::AckReply {}))
    }

    async fn load(&self, _: Request<v1::LoadRequest>) -> Result<Response<v1::LoadReport>, Status> {
        let load = self.ask(|reply| Command::Load { reply }).await?;
        if tracing::enabled!(tracing::Level::DEBUG) {
            if let Ok(s) = self.stats().await {
                tracing::debug!(iterations = s.engine.iterations, "timer {}", s.lateness);
            }
        }
        Ok(Response::new(v1::LoadReport::from(&load)))
    }

    async fn migrate_out(
        &self,
        request: Request<v1::MigrateOutRequest>,
    ) -> Result<Response<v1::MigrateOutReply>, Status> {
        kvfleet_pki::authorize(&request, &[Role::Coordinator], "Worker/MigrateOut")?;
        let (id, target) = (RequestId(request.get_ref().request_id), request.get_ref().target);
        let kv_address = &request.get_ref().target_kv_address;
        if !kv_address.is_empty() {
            let addr: std::net::SocketAddr = kv_address.parse().map_err(|e| {
                Status::invalid_argument(format!("`target_kv_address`: {kv_address:?} is not host:port ({e})"))
            })?;
            // The request's trace (W3C `traceparent` in the metadata): the migration joins it.
            let parent = kvfleet_telemetry::extract_metadata(request.metadata());
            // In its own task: a coordinator that dies (or gives up on the call) mid-migration
            // cancels this handler, and a migration dropped half-way would leave its request
            // paused here with nobody to resume it. Run to its end, it settles itself (committed,
            // resumed here, or in doubt for the next leader to settle).
            // Its measurements are kept in that task too, for a next leader to ask for.
            let migrator = self.migrator()?.clone();
            let order = MoveOrder { term: request.get_ref().leader_term, seq: request.get_ref().move_seq };
            let (recent, source) = (Arc::clone(&self.recent_moves), self.info.instance);
            let (report, stats) = tokio::spawn(async move {
                let report = migrator.migrate_out(id, addr, Some(target), order, &parent).await?;
                let stats = stats_proto(&report, source, target);
                let mut recent = recent.lock().expect("recent moves lock");
                if recent.len() == RECENT_MOVES {
                    recent.pop_front();
                }
                recent.push_back(stats.clone());
                Ok((report, stats))
            })
            .await
            .map_err(|e| Status::internal(format!("the migration task failed: {e}")))?
            .map_err(driver_status)?;
            let outcome = match &report.outcome {
                Some(Outcome::Committed) => v1::MigrationOutcome::MigrationCommitted,
                Some(Outcome::Unknown(_)) => v1::MigrationOutcome::MigrationUnknown,
                _ => v1::MigrationOutcome::MigrationAborted,
            };
            let kv_tokens = report.kv_tokens_final.unwrap_or(report.kv_tokens_start);
            return Ok(Response::new(v1::MigrateOutReply {
                state: Vec::new(),
                kv_tokens,
                kv_bytes: report.bytes,
                outcome: outcome as i32,
                stats: Some(stats),
            }));
        }
        let out = self.ask(|reply| Command::MigrateOut { request: id, reply }).await?.map_err(driver_status)?;
        tracing::info!(request = %id, target, kv_tokens = out.kv_tokens, "migrated out");
        Ok(Response::new(v1::MigrateOutReply {
            state: out.state,
            kv_tokens: out.kv_tokens,
            kv_bytes: out.kv_bytes,
            ..Default::default()
        }))
    }

    async fn resolve_migration(
        &self,
        request: Request<v1::ResolveMigrationRequest>,
    ) -> Result<Response<v1::ResolveMigrationReply>, Status> {
        kvfleet_pki::authorize(&request, &[Role::Coordinator], "Worker/ResolveMigration")?;
        let id = RequestId(request.get_ref().request_id);
        let m = self.migrator()?;
        let (held, moving) = match request.get_ref().committed {
            None => {
                let upto = MoveOrder { term: request.get_ref().fence_term, seq: request.get_ref().fence_seq };
                (m.resolve_target(id, upto).await.map_err(Status::unavailable)?, false)
            }
            Some(committed) => match m.resolve_source(id, committed).await.map_err(Status::failed_precondition)? {
                Settle::NotInDoubt => {
                    tracing::debug!(request = %id, committed, "resolution for a request not in doubt here: nothing to do");
                    (!committed, false)
                }
                Settle::Underway => {
                    tracing::info!(request = %id, committed, "resolution for a move still under way: told again once it ends");
                    (true, true)
                }
                Settle::FreeSource | Settle::Resume => (!committed, false),
            },
        };
        if !moving {
            tracing::info!(request = %id, held, "migration resolved");
        }
        // Told as its source, once the move has ended: what it measured of it.
        let stats = (request.get_ref().committed.is_some() && !moving)
            .then(|| {
                let recent = self.recent_moves.lock().expect("recent moves lock");
                recent.iter().rev().find(|s| s.request_id == id.0).cloned()
            })
            .flatten();
        Ok(Response::new(v1::ResolveMigrationReply { held, moving, stats }))
    }

    async fn attach(&self, request: Request<v1::AttachRequest>) -> Result<Response<v1::AttachReply>, Status> {
        kvfleet_pki::authorize(&request, &[Role::Coordinator], "Worker/Attach")?;
        let m = parse_state(&request.get_ref().state)?;
        let rematerialized = request.get_ref().kv_rematerialized;
        let id = m.spec.id;
        self.ask(|reply| Command::Attach { state: Box::new(m), rematerialized, reply })
            .await?
            .map_err(driver_status)?;
        tracing::info!(request = %id, rematerialized, "attached");
        Ok(Response::new(v1::AttachReply {}))
    }

    async fn drain(&self, request: Request<v1::DrainRequest>) -> Result<Response<v1::DrainReply>, Status> {
        kvfleet_pki::authorize(&request, &[Role::Coordinator, Role::Operator], "Worker/Drain")?;
        let remaining = self.ask(|reply| Command::Drain { reply }).await?;
        Ok(Response::new(v1::DrainReply { remaining }))
    }

    async fn cancel(&self, request: Request<v1::CancelRequest>) -> Result<Response<v1::CancelReply>, Status> {
        kvfleet_pki::authorize(&request, &[Role::Coordinator], "Worker/Cancel")?;
        let id = RequestId(request.get_ref().request_id);
        let kind = match (request.get_ref().late_record, request.get_ref().superseded) {
            (true, _) => CancelKind::LateRecord,
            (false, true) => CancelKind::Superseded,
            (false, false) => CancelKind::ClientLeft,
        };
        let reply = match self.ask(|reply| Command::Cancel { request: id, kind, reply }).await? {
            Ok(cancelled) => v1::CancelReply { cancelled, reason: String::new() },
            Err(reason) => v1::CancelReply { cancelled: false, reason },
        };
        Ok(Response::new(reply))
    }

    async fn set_role(&self, request: Request<v1::SetRoleRequest>) -> Result<Response<v1::SetRoleReply>, Status> {
        kvfleet_pki::authorize(&request, &[Role::Coordinator], "Worker/SetRole")?;
        let v1::SetRoleRequest { role, hand_off } = request.into_inner();
        let held = self.ask(|reply| Command::SetRole { role, hand_off, reply }).await?;
        Ok(Response::new(v1::SetRoleReply { held }))
    }

    async fn release(&self, request: Request<v1::ReleaseRequest>) -> Result<Response<v1::ReleaseReply>, Status> {
        kvfleet_pki::authorize(&request, &[Role::Coordinator], "Worker/Release")?;
        let id = RequestId(request.get_ref().request_id);
        let reply = match self.ask(|reply| Command::Release { request: id, reply }).await? {
            Ok(()) => v1::ReleaseReply { released: true, reason: String::new() },
            Err(reason) => v1::ReleaseReply { released: false, reason },
        };
        Ok(Response::new(reply))
    }

    async fn fetch_prefix(
        &self,
        request: Request<v1::FetchPrefixRequest>,
    ) -> Result<Response<v1::FetchPrefixReply>, Status> {
        kvfleet_pki::authorize(&request, &[Role::Coordinator], "Worker/FetchPrefix")?;
        let r = request.get_ref();
        let spec = require_spec(r.spec.as_ref())?;
        let holder: std::net::SocketAddr = r.holder_kv_address.parse().map_err(|e| {
            Status::invalid_argument(format!("`holder_kv_address`: {:?} is not host:port ({e})", r.holder_kv_address))
        })?;
        let (first, end) = (r.first, r.end);
        let migrator = self.migrator()?.clone();
        // In its own task, as a migration: what arrives is installed even if the caller gives up.
        let fetched = tokio::spawn(async move { migrator.fetch_prefix(holder, &spec, first, end).await })
            .await
            .map_err(|e| Status::internal(format!("the prefix fetch task failed: {e}")))?;
        match fetched {
            Ok((blocks, bytes)) => Ok(Response::new(v1::FetchPrefixReply { blocks, bytes })),
            Err(e) => Err(Status::unavailable(e)),
        }
    }

    async fn shutdown(&self, request: Request<v1::ShutdownRequest>) -> Result<Response<v1::ShutdownReply>, Status> {
        kvfleet_pki::authorize(&request, &[Role::Coordinator, Role::Operator], "Worker/Shutdown")?;
        tracing::info!("shutdown requested over gRPC");
        self.shutdown.trigger();
        Ok(Response::new(v1::ShutdownReply {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_core::engine::{Engine, EngineConfig};
    use kvfleet_core::timing::FixedTiming;
    use kvfleet_core::{InstanceId, RequestSpec, TimeSpan, Timestamp};

    /// A real migrated request, taken out of a real engine.
    fn migrated(generated_steps: u32) -> Vec<u8> {
        let cfg = EngineConfig {
            prefix_caching: false,
            block_size: 16,
            gpu_blocks: 64,
            cpu_blocks: 0,
            max_num_seqs: 8,
            max_batched_tokens: 1024,
            kv_bytes_per_token: 8,
            tpot: TimeSpan::from_millis_f64(100.0),
        };
        let timing = Arc::new(FixedTiming { iteration: TimeSpan::from_millis_f64(10.0), transfer: TimeSpan::ZERO });
        let sched = kvfleet_core::engine::sched::build_scheduler("fcfs", &Default::default()).unwrap();
        let mut e = Engine::new(InstanceId(0), cfg, timing, sched);
        let spec = RequestSpec {
            content_ids: Vec::new(),
            id: RequestId(4),
            arrival: Timestamp(0),
            prompt_tokens: 10,
            reasoning_tokens: 3,
            answer_tokens: 2,
        };
        e.submit(Timestamp(0), spec).unwrap();
        let mut now = Timestamp(0);
        let mut events = Vec::new();
        for _ in 0..generated_steps {
            now = e.step(now, &mut events).unwrap();
        }
        e.complete_iteration(now, &mut events);
        e.begin_migration_out(RequestId(4)).unwrap();
        serde_json::to_vec(&e.finish_migration_out(RequestId(4)).unwrap()).unwrap()
    }

    #[test]
    fn migrated_state_is_validated_naming_the_field() {
        let good = migrated(2);
        let m = parse_state(&good).unwrap();
        assert_eq!((m.spec.id, m.generated, m.kv_tokens()), (RequestId(4), 2, 12));
        let mut v: serde_json::Value = serde_json::from_slice(&good).unwrap();
        // (field path to overwrite, new value, the field the error must name)
        let cases: [(&[&str], serde_json::Value, &str); 5] = [
            (&["spec", "answer_tokens"], 0.into(), "state.spec.answer_tokens"),
            (&["generated"], 5.into(), "state.generated"),
            (&["record", "id"], 9.into(), "state.record.id"),
            (&["spec", "prompt_tokens"], u32::MAX.into(), "state.spec"),
            (&["spec"], "nonsense".into(), "`state`"),
        ];
        for (path, value, want) in cases {
            let mut bad = v.clone();
            let slot = path.iter().fold(&mut bad, |node, key| &mut node[*key]);
            *slot = value;
            let e = parse_state(&serde_json::to_vec(&bad).unwrap()).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().contains(want), "{want}: {}", e.message());
        }
        v["generated"] = 4.into();
        assert!(parse_state(&serde_json::to_vec(&v).unwrap()).is_ok(), "one token left is still a live request");
        assert_eq!(parse_state(b"{not json").unwrap_err().code(), tonic::Code::InvalidArgument);
    }
}
