//! One coordinator process: serves the `Coordinator` gRPC API, campaigns for leadership, and
//! while leader runs a [`Leader`]; standbys answer `Status` and point clients at the leader.

use crate::leader::{worker_connector, ClientTx, Leader, PdSetup};
use kvfleet_control::Controller;
use kvfleet_core::policy::cache_aware::PlacementCosts;
use kvfleet_core::policy::registry::{build_policy, PolicyParams};
use kvfleet_core::SimRng;
use kvfleet_core::{Dilation, InstanceId, RequestId};
pub use kvfleet_meta::layout::ClusterModel;
use kvfleet_meta::layout::{self as keys, unix_now_ns, ClusterRecord, ClusterTime, WorkerRecord};
use kvfleet_meta::{spawn_keep_alive, EventKind, LeaseId, MetaStore};
use kvfleet_pki::Role;
use kvfleet_proto::v1;
use kvfleet_proto::v1::coordinator_server::{Coordinator, CoordinatorServer};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, RwLock};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status};

/// How a coordinator runs.
#[derive(Clone, Debug)]
pub struct NodeOptions {
    /// Address clients and workers use to reach this coordinator.
    pub advertise: String,
    /// Instance-level placement/migration policy by name (e.g. `pascal`, `least-kv`, `round-robin`).
    pub policy: String,
    /// The policy's tuning (e.g. headroom blocks).
    pub policy_params: PolicyParams,
    /// The model this coordinator serves; it must match the cluster record in the store.
    pub model: ClusterModel,
    /// Leadership lease: a dead leader is replaced within about this long.
    pub lease_ttl: Duration,
    /// Embedded mode: how long a worker registration lives without a refresh.
    pub worker_ttl: Duration,
    /// Seed of the policy's random choices (each leader term starts from it).
    pub seed: u64,
    /// Clock origin to record if this coordinator founds the cluster (default: now).
    pub epoch_unix_ns: Option<u64>,
    /// Time dilation to record if this coordinator founds the cluster; one that joins must agree
    /// with the record.
    pub time_dilation: Dilation,
    /// Prefill/decode disaggregation (default: off, every instance does both).
    pub pd: PdSetup,
    /// The cluster identity: the API is served, and workers are called, over mutual TLS with it
    /// (`None`: plain text, for local debugging).
    pub tls: Option<kvfleet_pki::NodeIdentity>,
    /// The prefill curve and link a cost-based policy (`cache-aware`) weighs; required by such a
    /// policy, ignored by the others.
    pub placement_costs: Option<PlacementCosts>,
}

/// Shared between the gRPC service and the campaign loop.
pub struct Node {
    /// How this coordinator runs.
    pub opts: NodeOptions,
    /// The metadata store (etcd, or the embedded one): election, cluster record, registrations.
    pub store: Arc<dyn MetaStore>,
    leader: RwLock<Option<Arc<Leader>>>,
    cluster: ClusterRecord,
    /// Embedded-mode worker leases (the leader keeps them alive on each Register).
    worker_leases: Mutex<HashMap<u32, LeaseId>>,
}

/// Why a coordinator could not join the cluster or lead it.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The metadata store failed.
    #[error("metadata store: {0}")]
    Store(#[from] kvfleet_meta::MetaError),
    /// The cluster record is missing or not valid JSON, or a new leader could not restore the
    /// stored requests.
    #[error("cluster record at {key} is unreadable: {0}", key = keys::CLUSTER)]
    BadCluster(String),
    /// The cluster in the store serves another model (or KV size) than this coordinator.
    #[error("this coordinator runs model `{ours}` ({ours_bytes} B/token) but the cluster in the store runs `{theirs}` ({theirs_bytes} B/token)")]
    ModelMismatch {
        /// This coordinator's model.
        ours: String,
        /// Its KV bytes per token.
        ours_bytes: u64,
        /// The cluster record's model.
        theirs: String,
        /// Its KV bytes per token.
        theirs_bytes: u64,
    },
    /// The policy name or its parameters are invalid.
    #[error("policy: {0}")]
    Policy(String),
    /// The prefill/decode setup could not be applied.
    #[error("[pd]: {0}")]
    Pd(String),
    /// This coordinator was started with another time dilation than the cluster's.
    #[error("this coordinator runs at time dilation {ours} but the cluster record says {theirs}")]
    DilationMismatch {
        /// `--time-dilation` of this process.
        ours: Dilation,
        /// The cluster's.
        theirs: Dilation,
    },
}

impl Node {
    /// Join (or found) the cluster: the first coordinator writes the cluster record.
    pub async fn new(opts: NodeOptions, store: Arc<dyn MetaStore>) -> Result<Arc<Node>, NodeError> {
        let policy = build_policy(&opts.policy, &opts.policy_params).map_err(|e| NodeError::Policy(e.to_string()))?;
        if policy.needs_costs() && opts.placement_costs.is_none() {
            let name = &opts.policy;
            return Err(NodeError::Policy(format!(
                "`{name}` needs a prefill curve and a link model (placement costs)"
            )));
        }
        let proposed = ClusterRecord {
            model: opts.model.clone(),
            epoch_unix_ns: opts.epoch_unix_ns.unwrap_or_else(unix_now_ns),
            time_dilation: opts.time_dilation,
        };
        let bytes = serde_json::to_vec(&proposed).expect("plain data");
        store.put_if(keys::CLUSTER, &bytes, None, &[kvfleet_meta::Condition::absent(keys::CLUSTER)]).await?;
        let kv = store.get(keys::CLUSTER).await?.ok_or_else(|| NodeError::BadCluster("vanished".into()))?;
        let cluster: ClusterRecord =
            serde_json::from_slice(&kv.value).map_err(|e| NodeError::BadCluster(e.to_string()))?;
        if cluster.model != opts.model {
            return Err(NodeError::ModelMismatch {
                ours: opts.model.model.clone(),
                ours_bytes: opts.model.kv_bytes_per_token,
                theirs: cluster.model.model,
                theirs_bytes: cluster.model.kv_bytes_per_token,
            });
        }
        if cluster.time_dilation != opts.time_dilation {
            return Err(NodeError::DilationMismatch { ours: opts.time_dilation, theirs: cluster.time_dilation });
        }
        Ok(Arc::new(Node {
            opts,
            store,
            leader: RwLock::new(None),
            cluster,
            worker_leases: Mutex::new(HashMap::new()),
        }))
    }

    /// The cluster epoch (ns since the Unix epoch) from the cluster record.
    pub fn epoch_unix_ns(&self) -> u64 {
        self.cluster.epoch_unix_ns
    }

    /// The cluster clock (epoch and time dilation) from the cluster record.
    pub fn clock(&self) -> ClusterTime {
        self.cluster.clock()
    }

    /// The [`Leader`] this process runs while it leads (`None` on a standby).
    pub async fn current_leader(&self) -> Option<Arc<Leader>> {
        self.leader.read().await.clone()
    }

    /// Campaign forever: lead until deposed or the lease is lost, then stand by and campaign again.
    pub async fn campaign_loop(self: Arc<Self>) {
        let mut backoff = Duration::from_millis(200);
        loop {
            match self.clone().lead_once().await {
                Ok(()) => backoff = Duration::from_millis(200),
                Err(e) => {
                    tracing::warn!("leadership attempt ended: {e}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    async fn lead_once(self: Arc<Self>) -> Result<(), NodeError> {
        let lease = self.store.grant_lease(self.opts.lease_ttl).await?;
        let keeper = spawn_keep_alive(self.store.clone(), lease, self.opts.lease_ttl);
        let fence = self.store.campaign(keys::ELECTION, self.opts.advertise.as_bytes(), lease).await?;
        let started = std::time::Instant::now();
        let policy =
            build_policy(&self.opts.policy, &self.opts.policy_params).map_err(|e| NodeError::Policy(e.to_string()))?;
        let mut control = Controller::new(policy, SimRng::seed_from_u64(self.opts.seed))
            .expect_model(self.opts.model.model.clone(), self.opts.model.kv_bytes_per_token)
            .retain_finished();
        if let Some(costs) = &self.opts.placement_costs {
            control.set_placement_costs(costs);
        }
        self.opts.pd.apply(&mut control).map_err(NodeError::Pd)?;
        let leader = Leader::new(
            self.store.clone(),
            fence.clone(),
            control,
            worker_connector(self.opts.tls.clone()),
            self.clock(),
        );
        let restored = leader.restore().await.map_err(|e| NodeError::BadCluster(e.to_string()))?;
        // Workers already registered, then every change after that listing.
        let listing = self.store.get_prefix(keys::WORKERS).await?;
        for kv in &listing.kvs {
            admit(&leader, &kv.value).await;
        }
        *self.leader.write().await = Some(leader.clone());
        let silence = tokio::spawn(leader.clone().watch_silence());
        let ticks = tokio::spawn(leader.clone().run_ticks());
        // Where a move was left open, first learn which copy lives, then re-submit to the owner.
        let inherited_moves = leader.settle_inherited_moves().await;
        leader.resubmit_unfinished().await;
        tracing::info!(
            advertise = %self.opts.advertise,
            store = self.store.store_kind(),
            restored,
            inherited_moves,
            workers = listing.kvs.len(),
            took_ms = started.elapsed().as_millis() as u64,
            "became leader"
        );
        let mut watch =
            self.store.watch_prefix(keys::WORKERS, Some(kvfleet_meta::Revision(listing.revision.0 + 1))).await?;
        let mut deposed = leader.deposed.clone();
        let outcome = loop {
            tokio::select! {
                ev = watch.next() => match ev {
                    Some(Ok(ev)) => match ev.kind {
                        EventKind::Put => admit(&leader, &ev.value).await,
                        EventKind::Delete => {
                            if let Some(i) = ev.key.strip_prefix(keys::WORKERS).and_then(|s| s.parse::<u32>().ok()) {
                                leader.evict(InstanceId(i)).await;
                            }
                        }
                    },
                    Some(Err(e)) => break Err(NodeError::Store(e)),
                    None => break Ok(()),
                },
                reason = keeper.lost() => {
                    tracing::error!("leadership lease lost ({reason}); stepping down");
                    break Ok(());
                }
                _ = deposed.changed() => {
                    tracing::error!("deposed: a fenced write was refused; stepping down");
                    break Ok(());
                }
            }
        };
        silence.abort();
        ticks.abort();
        leader.stop();
        *self.leader.write().await = None;
        let _ = self.store.resign(&fence).await;
        drop(keeper);
        outcome
    }

    /// Embedded mode: a worker registers through the leader, which stores it under a lease.
    async fn register(&self, info: v1::WorkerInfo) -> Result<v1::RegisterReply, Status> {
        if info.model != self.opts.model.model || info.kv_bytes_per_token != self.opts.model.kv_bytes_per_token {
            return Err(Status::failed_precondition(format!(
                "worker {} serves model `{}` ({} B/token) but the cluster runs `{}` ({} B/token)",
                info.instance,
                info.model,
                info.kv_bytes_per_token,
                self.opts.model.model,
                self.opts.model.kv_bytes_per_token
            )));
        }
        if info.advertise.is_empty() {
            return Err(Status::invalid_argument("`advertise` must name the worker's address"));
        }
        let existing = self.worker_leases.lock().expect("lease map").get(&info.instance).copied();
        // A renewal (`renews_lease` set) only of the registration still in force: one that expired
        // or was revoked (the leader expelled the worker) is gone with the requests the cluster
        // re-placed, and renewing it under a new lease would let the worker keep running those
        // copies. A new registration takes over a lease still alive, else a fresh one.
        let renews = (info.renews_lease != 0).then_some(LeaseId(info.renews_lease as i64));
        let lease = match (existing, renews) {
            (Some(l), r) if r.is_none_or(|r| r == l) && self.store.keep_alive(l).await.is_ok() => l,
            (_, Some(r)) => {
                return Err(Status::not_found(format!(
                    "the registration of instance {} (lease {r}) has expired: the cluster re-placed its requests",
                    info.instance
                )));
            }
            (_, None) => {
                let l = self
                    .store
                    .grant_lease(self.opts.worker_ttl)
                    .await
                    .map_err(|e| Status::unavailable(e.to_string()))?;
                self.worker_leases.lock().expect("lease map").insert(info.instance, l);
                l
            }
        };
        let rec = WorkerRecord::from(&info);
        let bytes = serde_json::to_vec(&rec).expect("plain data");
        let key = keys::worker(info.instance);
        let current = self.store.get(&key).await.map_err(|e| Status::unavailable(e.to_string()))?;
        if current.as_ref().map(|kv| kv.value.as_slice()) != Some(bytes.as_slice()) {
            self.store.put_with_lease(&key, &bytes, lease).await.map_err(|e| Status::unavailable(e.to_string()))?;
        }
        Ok(v1::RegisterReply {
            ttl_ms: self.opts.worker_ttl.as_millis() as u32,
            epoch_unix_ns: self.cluster.epoch_unix_ns,
            lease: lease.0 as u64,
        })
    }

    /// The tonic server of the `kvfleet.v1.Coordinator` API over this node.
    pub fn service(self: &Arc<Self>) -> CoordinatorServer<CoordinatorService> {
        CoordinatorServer::new(CoordinatorService { node: self.clone() })
    }
}

async fn admit(leader: &Arc<Leader>, value: &[u8]) {
    match serde_json::from_slice::<WorkerRecord>(value) {
        Ok(rec) => {
            if let Err(e) = leader.admit(&rec).await {
                tracing::error!(instance = rec.instance, "worker refused: {e}");
            }
        }
        Err(e) => tracing::error!("unreadable worker registration: {e}"),
    }
}

/// The `Coordinator` gRPC service: the leader serves it; standbys answer `Status` and point
/// clients at the leader.
pub struct CoordinatorService {
    node: Arc<Node>,
}

type EventStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<v1::ClientEvent, Status>> + Send>>;

impl CoordinatorService {
    /// The advertised address of the current leader, per the election key.
    async fn leader_address(&self) -> Option<String> {
        let v = self.node.store.leader(keys::ELECTION).await.ok().flatten()?;
        Some(String::from_utf8_lossy(&v).into_owned())
    }

    async fn leader_or_redirect(&self) -> Result<Arc<Leader>, Status> {
        if let Some(l) = self.node.current_leader().await {
            if !l.is_deposed() {
                return Ok(l);
            }
        }
        Err(Status::unavailable(match self.leader_address().await {
            Some(addr) => format!("not the leader; the leader is at {addr}"),
            None => "no leader elected yet; retry".to_string(),
        }))
    }
}

/// Who may submit requests and follow them: clients, operators' tools, and coordinators (a
/// standby forwarding). Workers may not (a worker certificate is for the KV port and `Register`).
const SUBMITTERS: &[Role] = &[Role::Client, Role::Operator, Role::Coordinator];

#[tonic::async_trait]
impl Coordinator for CoordinatorService {
    type SubmitStream = EventStream;
    type ResumeStream = EventStream;

    async fn submit(&self, req: Request<v1::ClientSubmit>) -> Result<Response<EventStream>, Status> {
        kvfleet_pki::authorize(&req, SUBMITTERS, "Coordinator/Submit")?;
        let spec = kvfleet_proto::require_spec(req.get_ref().spec.as_ref())?;
        let leader = self.leader_or_redirect().await?;
        let (tx, rx): (ClientTx, _) = mpsc::channel(1024);
        leader.submit(spec, tx).await?;
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn resume(&self, req: Request<v1::ResumeRequest>) -> Result<Response<EventStream>, Status> {
        kvfleet_pki::authorize(&req, SUBMITTERS, "Coordinator/Resume")?;
        let leader = self.leader_or_redirect().await?;
        let (tx, rx): (ClientTx, _) = mpsc::channel(1024);
        leader.resume(RequestId(req.get_ref().request_id), tx).await?;
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn status(&self, _req: Request<v1::StatusRequest>) -> Result<Response<v1::ClusterStatus>, Status> {
        let leader_addr = self.leader_address().await.unwrap_or_default();
        let status = match self.node.current_leader().await {
            Some(l) => l.status(&leader_addr, self.node.clock()),
            None => v1::ClusterStatus {
                leader: leader_addr,
                epoch_unix_ns: self.node.epoch_unix_ns(),
                time_dilation: self.node.clock().dilation.factor(),
                store: self.node.store.store_kind().into(),
                ..Default::default()
            },
        };
        Ok(Response::new(status))
    }

    async fn register(&self, req: Request<v1::WorkerInfo>) -> Result<Response<v1::RegisterReply>, Status> {
        kvfleet_pki::authorize(&req, &[Role::Worker], "Coordinator/Register")?;
        self.leader_or_redirect().await?;
        Ok(Response::new(self.node.register(req.into_inner()).await?))
    }
}

/// Serve the coordinator API on `listener` until `shutdown` resolves.
/// With a cluster identity the API runs over mutual TLS: only holders of a cluster certificate
/// can register, submit or read.
pub async fn serve(
    node: Arc<Node>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let incoming = incoming(listener);
    let mut server = tonic::transport::Server::builder();
    if let Some(id) = &node.opts.tls {
        server = server.tls_config(id.tonic_server())?;
    }
    server.add_service(node.service()).serve_with_incoming_shutdown(incoming, shutdown).await
}

/// The connections `listener` accepts, with Nagle's algorithm off: a placement's `AcceptedOn` and
/// a stream's tokens are small writes, and with it on one written while an earlier one was
/// unacknowledged waited for the client's delayed ACK (40 ms on Linux): a replay's third request
/// of a burst reached the leader ~45 ms after its arrival.
fn incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// For logs: the socket address a listener got.
pub fn bound(listener: &tokio::net::TcpListener) -> Option<SocketAddr> {
    listener.local_addr().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn accepted_connections_send_small_writes_at_once() {
        use tokio_stream::StreamExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut accepted = incoming(listener);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let stream = accepted.next().await.expect("a connection").expect("accepted");
        assert!(stream.nodelay().unwrap(), "Nagle's algorithm is off on the leader's connections");
    }

    fn opts(time_dilation: f64) -> NodeOptions {
        NodeOptions {
            advertise: "127.0.0.1:1".into(),
            policy: "least-kv".into(),
            policy_params: PolicyParams::default(),
            model: ClusterModel { model: "m".into(), kv_bytes_per_token: 2 },
            lease_ttl: Duration::from_secs(2),
            worker_ttl: Duration::from_secs(2),
            seed: 0,
            epoch_unix_ns: Some(5),
            time_dilation: Dilation::new(time_dilation).unwrap(),
            tls: None,
            pd: PdSetup::default(),
            placement_costs: None,
        }
    }

    #[tokio::test]
    async fn the_first_coordinator_records_the_clock_and_the_next_must_agree() {
        let store: Arc<dyn MetaStore> = Arc::new(kvfleet_meta::MemStore::new());
        let first = Node::new(opts(4.0), store.clone()).await.expect("founds the cluster");
        assert_eq!(first.clock(), ClusterTime { epoch_unix_ns: 5, dilation: Dilation::new(4.0).unwrap() });
        // Another at the same dilation joins (and adopts the recorded epoch).
        let mut same = opts(4.0);
        same.epoch_unix_ns = None;
        assert_eq!(Node::new(same, store.clone()).await.expect("joins").clock().epoch_unix_ns, 5);
        // One at another dilation would run the cluster's clock at another speed: refused.
        let e = Node::new(opts(1.0), store).await.err().expect("refused").to_string();
        assert!(e.contains("time dilation 1") && e.contains("says 4"), "{e}");
    }

    fn info(renews_lease: u64) -> v1::WorkerInfo {
        v1::WorkerInfo {
            instance: 3,
            model: "m".into(),
            kv_bytes_per_token: 2,
            advertise: "127.0.0.1:7100".into(),
            incarnation: 9,
            renews_lease,
            ..Default::default()
        }
    }

    /// Embedded store: a worker renews the registration it holds; once that registration is gone
    /// (revoked, as the leader's expel does, or expired) a renewal is refused with NOT_FOUND, so
    /// the worker drops what the cluster re-placed before it registers anew.
    #[tokio::test]
    async fn a_renewal_of_a_registration_that_is_gone_is_refused() {
        let store: Arc<dyn MetaStore> = Arc::new(kvfleet_meta::MemStore::new());
        let node = Node::new(opts(1.0), store.clone()).await.expect("founds the cluster");
        let first = node.register(info(0)).await.expect("registers").lease;
        assert_ne!(first, 0);
        assert_eq!(node.register(info(first)).await.expect("renews").lease, first, "same lease while in force");
        assert!(store.get(&keys::worker(3)).await.unwrap().is_some());

        store.revoke(LeaseId(first as i64)).await.unwrap();
        assert!(store.get(&keys::worker(3)).await.unwrap().is_none(), "revoking ends the registration");
        let refused = node.register(info(first)).await.expect_err("the registration is gone");
        assert_eq!(refused.code(), tonic::Code::NotFound, "{refused:?}");
        assert!(refused.message().contains("instance 3"), "{}", refused.message());
        assert!(store.get(&keys::worker(3)).await.unwrap().is_none(), "a refused renewal registers nothing");

        let again = node.register(info(0)).await.expect("registers anew").lease;
        assert_ne!(again, first);
        assert!(store.get(&keys::worker(3)).await.unwrap().is_some());
        // A lease this node never gave (another store's, or a mistaken number) renews nothing.
        let unknown = node.register(info(again + 100)).await.expect_err("not this registration's lease");
        assert_eq!(unknown.code(), tonic::Code::NotFound);
    }
}
