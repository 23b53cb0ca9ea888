//! A scripted stand-in for a worker's gRPC service, for the leader's unit tests: it accepts every
//! submit, streams no events, answers `MigrateOut` and `ResolveMigration` as told, drops every
//! superseded copy it is told to (once a test opens the gate, if it set one), and records the
//! calls it got. Everything else is `Unimplemented`.

use kvfleet_proto::v1;
use kvfleet_proto::v1::worker_server::{Worker, WorkerServer};
use std::sync::{Arc, Mutex};
use tonic::{Request, Response, Status};

/// What the fake answers, and what it was asked.
#[derive(Default)]
pub(super) struct Script {
    /// The error `MigrateOut` fails with (`None`: [`Script::migrate_out_reply`]).
    pub migrate_out_error: Option<Status>,
    /// What `MigrateOut` answers (`None`: an aborted move, unmeasured).
    pub migrate_out_reply: Option<v1::MigrateOutReply>,
    /// `ResolveMigration` asked as the target: whether it holds the request.
    pub holds: bool,
    /// Every `ResolveMigration` call: (request, committed word, fence term, fence seq).
    pub resolved: Vec<(u64, Option<bool>, u64, u64)>,
    /// `Cancel` answers only once this is notified (`None`: at once).
    pub cancel_gate: Option<Arc<tokio::sync::Notify>>,
    /// Submits, cancels and moves out, in order: "submit N", "cancel N", "cancel N answered",
    /// "migrate-out N".
    pub calls: Vec<String>,
    /// `ResolveMigration` told as the source: its measurements of its last move out.
    pub last_move: Option<v1::MigrationStats>,
}

#[derive(Clone, Default)]
pub(super) struct FakeWorker(pub Arc<Mutex<Script>>, Arc<tokio::sync::Notify>);

impl FakeWorker {
    /// Serve on a loopback port; returns its `host:port`.
    pub async fn serve(&self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
        let addr = listener.local_addr().expect("bound");
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let service = WorkerServer::new(self.clone());
        tokio::spawn(tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming));
        addr.to_string()
    }

    pub fn resolved(&self) -> Vec<(u64, Option<bool>, u64, u64)> {
        self.0.lock().expect("script lock").resolved.clone()
    }

    pub fn calls(&self) -> Vec<String> {
        self.0.lock().expect("script lock").calls.clone()
    }

    /// Wait until `call` has been recorded.
    pub async fn wait_for_call(&self, call: &str) {
        loop {
            let called = self.1.notified();
            if self.calls().iter().any(|c| c == call) {
                return;
            }
            called.await;
        }
    }

    fn record(&self, call: String) {
        self.0.lock().expect("script lock").calls.push(call);
        self.1.notify_waiters();
    }
}

type Reply<T> = Result<Response<T>, Status>;

fn no<T>(what: &str) -> Reply<T> {
    Err(Status::unimplemented(format!("the fake worker does not answer {what}")))
}

#[tonic::async_trait]
impl Worker for FakeWorker {
    async fn info(&self, _: Request<v1::InfoRequest>) -> Reply<v1::WorkerInfo> {
        no("Info")
    }
    async fn submit(&self, r: Request<v1::SubmitRequest>) -> Reply<v1::SubmitReply> {
        self.record(format!("submit {}", r.into_inner().spec.map_or(0, |s| s.id)));
        Ok(Response::new(v1::SubmitReply { accepted: true, ..Default::default() }))
    }
    type EventsStream = tokio_stream::Pending<Result<v1::WorkerEvent, Status>>;
    async fn events(&self, _: Request<v1::EventsRequest>) -> Reply<Self::EventsStream> {
        Ok(Response::new(tokio_stream::pending()))
    }
    async fn ack(&self, _: Request<v1::AckRequest>) -> Reply<v1::AckReply> {
        no("Ack")
    }
    async fn load(&self, _: Request<v1::LoadRequest>) -> Reply<v1::LoadReport> {
        no("Load")
    }
    async fn migrate_out(&self, r: Request<v1::MigrateOutRequest>) -> Reply<v1::MigrateOutReply> {
        self.record(format!("migrate-out {}", r.into_inner().request_id));
        let script = self.0.lock().expect("script lock");
        match (script.migrate_out_error.clone(), script.migrate_out_reply.clone()) {
            (Some(e), _) => Err(e),
            (None, Some(reply)) => Ok(Response::new(reply)),
            (None, None) => Ok(Response::new(v1::MigrateOutReply {
                outcome: v1::MigrationOutcome::MigrationAborted as i32,
                ..Default::default()
            })),
        }
    }
    async fn attach(&self, _: Request<v1::AttachRequest>) -> Reply<v1::AttachReply> {
        no("Attach")
    }
    async fn resolve_migration(&self, r: Request<v1::ResolveMigrationRequest>) -> Reply<v1::ResolveMigrationReply> {
        let r = r.into_inner();
        let mut script = self.0.lock().expect("script lock");
        script.resolved.push((r.request_id, r.committed, r.fence_term, r.fence_seq));
        let stats = r.committed.and(script.last_move.clone());
        Ok(Response::new(v1::ResolveMigrationReply { held: script.holds, moving: false, stats }))
    }
    async fn drain(&self, _: Request<v1::DrainRequest>) -> Reply<v1::DrainReply> {
        no("Drain")
    }
    async fn shutdown(&self, _: Request<v1::ShutdownRequest>) -> Reply<v1::ShutdownReply> {
        no("Shutdown")
    }
    async fn cancel(&self, r: Request<v1::CancelRequest>) -> Reply<v1::CancelReply> {
        let id = r.into_inner().request_id;
        self.record(format!("cancel {id}"));
        let gate = self.0.lock().expect("script lock").cancel_gate.clone();
        if let Some(gate) = gate {
            gate.notified().await;
        }
        self.record(format!("cancel {id} answered"));
        Ok(Response::new(v1::CancelReply { cancelled: true, ..Default::default() }))
    }
    async fn set_role(&self, _: Request<v1::SetRoleRequest>) -> Reply<v1::SetRoleReply> {
        no("SetRole")
    }
    async fn release(&self, _: Request<v1::ReleaseRequest>) -> Reply<v1::ReleaseReply> {
        no("Release")
    }
    async fn fetch_prefix(&self, _: Request<v1::FetchPrefixRequest>) -> Reply<v1::FetchPrefixReply> {
        no("FetchPrefix")
    }
}
