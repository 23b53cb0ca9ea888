//! Worker registration: how a worker joins the cluster and stays in it.
//!
//! - With `--etcd`: the worker reads the cluster record (model must match, clock epoch), writes
//!   `/kvfleet/workers/<instance>` under its own lease and keeps the lease alive; when the lease is
//!   lost (etcd restarted, partition) it re-registers with a new one, retrying with backoff.
//! - With `--coordinator A,B,…` (embedded store): it registers through whichever coordinator is
//!   leader, refreshing before the registration's TTL lapses ([`coordinator_loop`]); a renewal
//!   the coordinator refuses because the registration is gone (it expired, or the leader expelled
//!   the worker) drops what the cluster re-placed before the worker registers anew, as with etcd.
//!
//! - With `--instance auto` (etcd only): [`claim_instance`] takes the lowest free instance number
//!   with a create-if-absent transaction on `/kvfleet/instances/<n>` under a lease, and
//!   [`registration_loop`] registers under that same lease, so the number becomes free exactly when
//!   the registration lapses (a killed replica's number is reused only after the coordinator has
//!   seen its registration disappear and re-placed its requests). After losing its lease the
//!   worker takes its own number back; if another worker claimed it meanwhile, it stops (its
//!   orchestrator restarts it and it claims a free number).
//! - [`route_ip`] works out `--advertise auto`: the local IP on the route to etcd or a coordinator.
//!
//! [`registration_loop`] publishes whether the registration is in force ([`Registered`]): from
//! the moment its lease is lost (the keep-alive reports it no later than etcd can expire it) the
//! coordinator may evict this worker, re-place its requests and give its number to a newcomer,
//! so the worker refuses requests arriving by migration until it is registered again (the
//! [`ledger`](crate::ledger)); a COMMIT accepted then would leave the request where nobody looks.
//! When etcd says the lease expired (not just this process's clock: a worker resumed after a
//! SIGSTOP asks etcd first), the coordinator has seen the registration go and re-places what ran
//! here, so the worker drops those copies ([`crate::Expiry`]) before it registers again. (The
//! coordinator refuses a late copy's results anyway: only the owner's record is stored.)
//!
//! A model mismatch is final: the worker exits with the message naming both models.

use kvfleet_meta::layout::{self, ClusterRecord, WorkerRecord};
use kvfleet_meta::{spawn_keep_alive, Condition, LeaseKeeper, MetaStore};
use kvfleet_proto::v1;
use kvfleet_proto::v1::coordinator_client::CoordinatorClient;
use std::sync::Arc;
use std::time::Duration;

/// Why registering with the cluster failed.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// Final: the cluster will not take this worker (model mismatch, unreadable cluster record,
    /// no free instance number, or the coordinator said no).
    #[error("refused by the cluster: {0}")]
    Refused(String),
    /// The metadata store (etcd) failed; transient, [`registration_loop`] retries with backoff.
    #[error("metadata store: {0}")]
    Store(#[from] kvfleet_meta::MetaError),
}

/// Whether this worker's registration is in force, as [`registration_loop`] sees it (see the
/// module docs; [`crate::WorkerHandle::follow_registration`] hands it to the engine).
pub type Registered = tokio::sync::watch::Sender<bool>;

/// How long a worker keeps retrying its first reads of etcd before it gives up and exits.
pub const FIRST_READ_PATIENCE: Duration = Duration::from_secs(60);

/// Read the cluster record (model check, epoch) from etcd before the engine starts: waits for a
/// coordinator to write it, and retries failed reads for up to [`FIRST_READ_PATIENCE`].
pub async fn cluster_record(
    store: &dyn MetaStore,
    model: &str,
    kv_bytes_per_token: u64,
) -> Result<ClusterRecord, RegisterError> {
    let mut backoff = Duration::from_millis(100);
    // etcd may blink (restart, leader election) just as a worker starts: retry reads for a while
    // rather than exit.
    let patience = tokio::time::Instant::now() + FIRST_READ_PATIENCE;
    loop {
        let read = match store.get(layout::CLUSTER).await {
            Ok(read) => read,
            Err(e) if tokio::time::Instant::now() < patience => {
                tracing::warn!("reading the cluster record failed ({e}); retrying in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        if let Some(kv) = read {
            let rec: ClusterRecord = serde_json::from_slice(&kv.value)
                .map_err(|e| RegisterError::Refused(format!("unreadable cluster record: {e}")))?;
            if rec.model.model != model || rec.model.kv_bytes_per_token != kv_bytes_per_token {
                return Err(RegisterError::Refused(format!(
                    "this worker serves model `{model}` ({kv_bytes_per_token} B/token) but the cluster runs `{}` ({} B/token)",
                    rec.model.model, rec.model.kv_bytes_per_token
                )));
            }
            return Ok(rec);
        }
        tracing::info!("no cluster record yet (no coordinator has started); waiting");
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// An instance number held in etcd by this process (`--instance auto`): the claim key lives on
/// `keeper`'s lease, which the registration then shares.
pub struct InstanceClaim {
    /// The instance number claimed.
    pub instance: u32,
    /// What the claim key holds: unique to this process, so it can recognise its own claim.
    pub owner: String,
    /// Keeps the claim's etcd lease alive; the registration is written under the same lease.
    pub keeper: LeaseKeeper,
}

/// Most instance numbers tried before giving up (a cluster this large is not emulated on one etcd).
const MAX_CLAIM_ATTEMPTS: u32 = 10_000;

/// Claim the lowest instance number that neither another claim nor a fixed-number registration
/// holds, atomically (create-if-absent on both keys), under a fresh lease kept alive from now on.
pub async fn claim_instance(
    store: Arc<dyn MetaStore>,
    owner: &str,
    ttl: Duration,
) -> Result<InstanceClaim, RegisterError> {
    let lease = store.grant_lease(ttl).await?;
    let keeper = spawn_keep_alive(store.clone(), lease, ttl);
    for _ in 0..MAX_CLAIM_ATTEMPTS {
        let claims = store.get_prefix(layout::INSTANCES).await?;
        let workers = store.get_prefix(layout::WORKERS).await?;
        let taken: std::collections::BTreeSet<u32> = claims
            .kvs
            .iter()
            .filter_map(|kv| kv.key.strip_prefix(layout::INSTANCES))
            .chain(workers.kvs.iter().filter_map(|kv| kv.key.strip_prefix(layout::WORKERS)))
            .filter_map(|n| n.parse().ok())
            .collect();
        let n =
            (0..crate::options::AUTO_INSTANCE).find(|n| !taken.contains(n)).unwrap_or(crate::options::AUTO_INSTANCE);
        if n == crate::options::AUTO_INSTANCE {
            break;
        }
        let (claim, worker) = (layout::instance_claim(n), layout::worker(n));
        let free = [Condition::absent(claim.clone()), Condition::absent(worker)];
        if store.put_if(&claim, owner.as_bytes(), Some(lease), &free).await?.is_some() {
            tracing::info!(instance = n, key = %claim, "claimed instance number");
            return Ok(InstanceClaim { instance: n, owner: owner.to_string(), keeper });
        }
        // Another worker took it between the listing and the transaction: list again.
    }
    Err(RegisterError::Refused(format!("no free instance number after {MAX_CLAIM_ATTEMPTS} attempts")))
}

/// Take `claim`'s number back under a new lease after the old one was lost. `Ok(false)`: someone
/// else holds it now (final); errors are transient.
async fn reclaim(
    store: &dyn MetaStore,
    instance: u32,
    owner: &str,
    lease: kvfleet_meta::LeaseId,
) -> Result<bool, RegisterError> {
    let key = layout::instance_claim(instance);
    loop {
        let cond = match store.get(&key).await? {
            Some(kv) if kv.value != owner.as_bytes() => return Ok(false),
            Some(kv) => Condition::mod_revision(key.clone(), kv.mod_revision),
            None => Condition::absent(key.clone()),
        };
        if store.put_if(&key, owner.as_bytes(), Some(lease), &[cond]).await?.is_some() {
            return Ok(true);
        }
    }
}

/// Keep `rec` registered in etcd until `stop` turns true, then revoke the registration so the
/// coordinator re-places this worker's requests at once rather than after the lease TTL.
///
/// With a `claim` (`--instance auto`) the registration shares the claim's lease, and a lost lease
/// is followed by re-claiming the same number; the loop ends with an error if another worker has
/// claimed it meanwhile. Without one (a fixed `--instance`) it registers under its own lease.
///
/// `registered` turns true once the registration is written and false as soon as its lease is
/// lost, when it is given up (`stop`), and when the loop ends.
pub async fn registration_loop(
    store: Arc<dyn MetaStore>,
    rec: WorkerRecord,
    ttl: Duration,
    claim: Option<InstanceClaim>,
    stop: tokio::sync::watch::Receiver<bool>,
    registered: Registered,
    expiry: Option<crate::Expiry>,
) -> Result<(), RegisterError> {
    let ended = keep_registered(store, rec, ttl, claim, stop, &registered, expiry).await;
    registered.send_replace(false);
    ended
}

async fn keep_registered(
    store: Arc<dyn MetaStore>,
    rec: WorkerRecord,
    ttl: Duration,
    claim: Option<InstanceClaim>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    registered: &Registered,
    expiry: Option<crate::Expiry>,
) -> Result<(), RegisterError> {
    let key = layout::worker(rec.instance);
    let value = serde_json::to_vec(&rec).expect("plain data");
    let owner = claim.as_ref().map(|c| c.owner.clone());
    let mut held = claim.map(|c| c.keeper);
    let mut backoff = Duration::from_millis(100);
    loop {
        let attempt = async {
            let keeper = match held.take() {
                Some(k) if !k.is_lost() => k,
                _ => {
                    let lease = store.grant_lease(ttl).await?;
                    if let Some(owner) = &owner {
                        if !reclaim(store.as_ref(), rec.instance, owner, lease).await? {
                            let _ = store.revoke(lease).await;
                            return Err(RegisterError::Refused(format!(
                                "instance {} was claimed by another worker while this one was cut off from etcd; restart this worker to claim a free number",
                                rec.instance
                            )));
                        }
                    }
                    spawn_keep_alive(store.clone(), lease, ttl)
                }
            };
            store.put_with_lease(&key, &value, keeper.lease()).await?;
            Ok::<_, RegisterError>(keeper)
        };
        let outcome = tokio::select! {
            r = attempt => r,
            _ = stop_requested(&mut stop) => return Ok(()),
        };
        match outcome {
            Ok(keeper) => {
                tracing::info!(key = %key, "registered in etcd");
                registered.send_replace(true);
                backoff = Duration::from_millis(100);
                tokio::select! {
                    reason = keeper.lost() => {
                        registered.send_replace(false);
                        // etcd says it expired: the coordinator saw the registration go and
                        // re-places what ran here. Drop those copies before registering again
                        // (a request re-placed back here afterwards runs afresh).
                        match (&expiry, keeper.expired()) {
                            (Some(expiry), true) => {
                                let dropped = expiry.drop_running().await;
                                tracing::warn!("registration expired ({reason}): dropped {dropped} requests; registering again");
                            }
                            _ => tracing::warn!("registration lease lost ({reason}); registering again"),
                        }
                    }
                    _ = stop_requested(&mut stop) => {
                        registered.send_replace(false);
                        let lease = keeper.lease();
                        drop(keeper);
                        match tokio::time::timeout(Duration::from_secs(2), store.revoke(lease)).await {
                            Ok(Ok(())) => tracing::info!(key = %key, "deregistered (lease revoked)"),
                            Ok(Err(e)) => tracing::warn!("deregistering: {e}; the registration lapses with its lease"),
                            Err(_) => tracing::warn!("deregistering timed out; the registration lapses with its lease"),
                        }
                        return Ok(());
                    }
                }
            }
            Err(e @ RegisterError::Refused(_)) => return Err(e),
            Err(e) => {
                tracing::warn!("registering in etcd failed ({e}); retrying in {backoff:?}");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = stop_requested(&mut stop) => return Ok(()),
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Resolves once `stop` is true; never if its sender is gone without asking.
async fn stop_requested(stop: &mut tokio::sync::watch::Receiver<bool>) {
    if stop.wait_for(|s| *s).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The local IP address on the route to the first of `targets` (`host:port`, or an etcd URL such
/// as `http://etcd:2379`) that resolves: what `--advertise auto` advertises. No packet is sent
/// (a UDP socket is only "connected", which makes the kernel pick the source address).
pub async fn route_ip(targets: &[String]) -> Result<std::net::IpAddr, String> {
    let mut last = "no etcd endpoint or coordinator to find the route to".to_string();
    for t in targets {
        let hostport = t.split_once("://").map_or(t.as_str(), |(_, rest)| rest);
        let hostport = hostport.split('/').next().unwrap_or(hostport);
        let addrs = match tokio::net::lookup_host(hostport).await {
            Ok(a) => a.collect::<Vec<_>>(),
            Err(e) => {
                last = format!("resolving {hostport}: {e}");
                continue;
            }
        };
        for a in addrs {
            let bind: std::net::SocketAddr =
                if a.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { (std::net::Ipv6Addr::UNSPECIFIED, 0).into() };
            let probe = std::net::UdpSocket::bind(bind).and_then(|s| s.connect(a).and_then(|_| s.local_addr()));
            match probe {
                Ok(local) if !local.ip().is_unspecified() => return Ok(local.ip()),
                Ok(_) => last = format!("no route to {a}"),
                Err(e) => last = format!("route to {a}: {e}"),
            }
        }
    }
    Err(last)
}

/// Keep `rec` registered in etcd (under its own lease) for as long as the future runs.
pub async fn etcd_loop(store: Arc<dyn MetaStore>, rec: WorkerRecord, ttl: Duration) {
    let (_never, stop) = tokio::sync::watch::channel(false);
    if let Err(e) = registration_loop(store, rec, ttl, None, stop, Registered::new(false), None).await {
        tracing::error!("registration ended: {e}");
    }
}

/// Keep registered through the leader among `coordinators` (embedded store), renewing the
/// registration before its TTL lapses, for as long as the future runs.
///
/// Each renewal names the lease the last reply gave. The coordinator refuses to renew one that is
/// gone (it expired while this process was stopped, or the leader expelled this worker for
/// silence): it has evicted the worker and re-placed its requests, so the worker drops those
/// copies (`expiry`) before it registers anew, as with etcd. `registered` is true from a
/// registration until the reply that says it is gone, or until the TTL passes without a renewal
/// (the coordinator may have evicted the worker meanwhile).
pub async fn coordinator_loop(
    coordinators: Vec<String>,
    mut info: v1::WorkerInfo,
    tls: Option<kvfleet_pki::NodeIdentity>,
    registered: Registered,
    expiry: Option<crate::Expiry>,
) -> Result<(), RegisterError> {
    let mut refresh = Duration::from_millis(500);
    // When the last renewal that was answered was sent, and its TTL (None: not registered).
    let mut in_force: Option<(tokio::time::Instant, Duration)> = None;
    loop {
        let mut done = false;
        for addr in &coordinators {
            let ep = match kvfleet_pki::endpoint(addr, tls.as_ref()) {
                Ok(ep) => ep,
                Err(e) => {
                    tracing::warn!("coordinator {addr}: {e}");
                    continue;
                }
            };
            let mut client = CoordinatorClient::new(ep.connect_timeout(Duration::from_secs(1)).connect_lazy());
            let sent = tokio::time::Instant::now();
            match client.register(info.clone()).await {
                Ok(reply) => {
                    let reply = reply.into_inner();
                    let ttl = Duration::from_millis(reply.ttl_ms.max(300) as u64);
                    if info.renews_lease == 0 {
                        tracing::info!(lease = reply.lease, "registered through coordinator {addr}");
                    }
                    info.renews_lease = reply.lease;
                    in_force = Some((sent, ttl));
                    registered.send_replace(true);
                    refresh = ttl / 3;
                    done = true;
                    break;
                }
                Err(s) if s.code() == tonic::Code::FailedPrecondition => {
                    registered.send_replace(false);
                    return Err(RegisterError::Refused(s.message().to_string()));
                }
                Err(s) if s.code() == tonic::Code::NotFound && info.renews_lease != 0 => {
                    tracing::warn!("registration gone: {}; registering again", s.message());
                    registered.send_replace(false);
                    if let Some(expiry) = &expiry {
                        expiry.drop_running().await;
                    }
                    info.renews_lease = 0;
                    in_force = None;
                    refresh = Duration::ZERO;
                    done = true;
                    break;
                }
                Err(s) => tracing::debug!(coordinator = %addr, "register: {}", s.message()),
            }
        }
        if !done {
            tracing::warn!("no leader accepted the registration; retrying");
            if in_force.is_some_and(|(sent, ttl)| sent.elapsed() >= ttl) && *registered.borrow() {
                tracing::warn!("registration lapsed: not renewed within its TTL");
                registered.send_replace(false);
            }
        }
        tokio::time::sleep(if done { refresh } else { Duration::from_millis(200) }).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_meta::MemStore;

    fn record(instance: u32) -> WorkerRecord {
        WorkerRecord {
            instance,
            address: format!("10.0.0.{instance}:7100"),
            model: "r1-distill-qwen-32b".into(),
            kv_bytes_per_token: 262_144,
            gpu_blocks: 64,
            block_size: 16,
            scheduler: "pascal".into(),
            kv_address: String::new(),
            incarnation: 1,
            arrow_profile: None,
        }
    }

    #[tokio::test]
    async fn the_first_read_outlasts_a_blink_of_etcd() {
        let mem = MemStore::new();
        let rec = ClusterRecord {
            model: kvfleet_meta::layout::ClusterModel { model: "m".into(), kv_bytes_per_token: 2 },
            epoch_unix_ns: 7,
            time_dilation: kvfleet_core::Dilation::new(2.5).unwrap(),
        };
        mem.put(layout::CLUSTER, &serde_json::to_vec(&rec).unwrap()).await.unwrap();
        // Three failed reads (an etcd restarting as the worker starts): it retries, then reads.
        mem.fail_next_reads(3);
        let got = cluster_record(&mem, "m", 2).await.expect("retried past the failures");
        assert_eq!((got.epoch_unix_ns, got.time_dilation.factor()), (7, 2.5));
        mem.fail_next_reads(1);
        assert!(mem.get(layout::CLUSTER).await.is_err(), "the fault is real");
        let e = cluster_record(&mem, "other", 2).await.unwrap_err().to_string();
        assert!(e.contains("serves model `other`"), "a wrong model is refused at once, not retried: {e}");
    }

    #[tokio::test]
    async fn auto_claims_take_the_lowest_free_number_and_skip_fixed_registrations() {
        let store: Arc<dyn MetaStore> = Arc::new(MemStore::new());
        let ttl = Duration::from_secs(5);
        // A worker started with a fixed `--instance 1` holds 1.
        store.put(&layout::worker(1), b"{}").await.unwrap();
        let claims = futures_join(store.clone(), ttl, &["a", "b", "c"])
            .await
            .into_iter()
            .map(|c| c.instance)
            .collect::<Vec<_>>();
        let mut sorted = claims.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, vec![0, 2, 3], "concurrent claims got distinct free numbers: {claims:?}");
        assert!(store.get(&layout::instance_claim(0)).await.unwrap().is_some());
    }

    async fn futures_join(store: Arc<dyn MetaStore>, ttl: Duration, owners: &[&str]) -> Vec<InstanceClaim> {
        let tasks: Vec<_> = owners
            .iter()
            .map(|o| {
                let (store, o) = (store.clone(), o.to_string());
                tokio::spawn(async move { claim_instance(store, &o, ttl).await })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap().unwrap());
        }
        out
    }

    #[tokio::test]
    async fn a_number_is_free_again_once_its_registration_is_revoked() {
        let store: Arc<dyn MetaStore> = Arc::new(MemStore::new());
        let ttl = Duration::from_secs(5);
        let first = claim_instance(store.clone(), "first", ttl).await.unwrap();
        assert_eq!(first.instance, 0);
        let (stop_tx, stop) = tokio::sync::watch::channel(false);
        let (registered, status) = tokio::sync::watch::channel(false);
        let reg = tokio::spawn(registration_loop(store.clone(), record(0), ttl, Some(first), stop, registered, None));
        // Registered under the claim's lease.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while store.get(&layout::worker(0)).await.unwrap().is_none() {
            assert!(tokio::time::Instant::now() < deadline, "never registered");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (w, c) = (
            store.get(&layout::worker(0)).await.unwrap().unwrap(),
            store.get(&layout::instance_claim(0)).await.unwrap().unwrap(),
        );
        assert_eq!(w.lease, c.lease, "registration and claim share one lease");
        assert!(*status.borrow(), "registered");
        assert_eq!(claim_instance(store.clone(), "second", ttl).await.unwrap().instance, 1, "0 is held");
        // SIGTERM: deregister. Both keys go at once, and 0 is free for the next replica.
        stop_tx.send(true).unwrap();
        reg.await.unwrap().unwrap();
        assert!(!*status.borrow(), "deregistered: no longer counted as registered");
        assert!(store.get(&layout::worker(0)).await.unwrap().is_none());
        assert!(store.get(&layout::instance_claim(0)).await.unwrap().is_none());
        assert_eq!(claim_instance(store.clone(), "third", ttl).await.unwrap().instance, 0);
    }

    #[tokio::test]
    async fn a_lost_lease_takes_the_number_back_unless_another_worker_claimed_it() {
        let store: Arc<dyn MetaStore> = Arc::new(MemStore::new());
        let ttl = Duration::from_millis(300);
        // Lease lost while nobody else wanted the number: registered again under the same number.
        let claim = claim_instance(store.clone(), "me", ttl).await.unwrap();
        let lease = claim.keeper.lease();
        let (_keep, stop) = tokio::sync::watch::channel(false);
        let (registered, status) = tokio::sync::watch::channel(false);
        let reg = tokio::spawn(registration_loop(store.clone(), record(0), ttl, Some(claim), stop, registered, None));
        tokio::time::sleep(Duration::from_millis(100)).await;
        store.revoke(lease).await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let kv = store.get(&layout::worker(0)).await.unwrap();
            if kv.as_ref().is_some_and(|kv| kv.lease != Some(lease)) {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "not registered again");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(store.get(&layout::instance_claim(0)).await.unwrap().unwrap().value, b"me");
        tokio::time::timeout(Duration::from_secs(5), status.clone().wait_for(|r| *r)).await.unwrap().unwrap();
        reg.abort();

        // Lease lost and the number claimed by a newcomer meanwhile: the loop stops with an error.
        let store: Arc<dyn MetaStore> = Arc::new(MemStore::new());
        let claim = claim_instance(store.clone(), "me", ttl).await.unwrap();
        let lease = claim.keeper.lease();
        store.revoke(lease).await.unwrap();
        let newcomer = claim_instance(store.clone(), "newcomer", Duration::from_secs(5)).await.unwrap();
        assert_eq!(newcomer.instance, 0);
        let (_keep, stop) = tokio::sync::watch::channel(false);
        let (registered, status) = tokio::sync::watch::channel(true);
        let e = tokio::time::timeout(
            Duration::from_secs(5),
            registration_loop(store.clone(), record(0), ttl, Some(claim), stop, registered, None),
        )
        .await
        .expect("the loop gives up")
        .unwrap_err()
        .to_string();
        assert!(e.contains("instance 0 was claimed by another worker"), "{e}");
        assert!(!*status.borrow(), "refused for a reclaimed number: not registered");
        assert_eq!(store.get(&layout::instance_claim(0)).await.unwrap().unwrap().value, b"newcomer");
    }

    /// A store that can be cut off from this worker (a partition from etcd): its lease calls fail.
    struct CutOff {
        inner: MemStore,
        cut: std::sync::atomic::AtomicBool,
    }

    impl CutOff {
        fn fail<'a, T: Send + 'a>(&self, op: &'static str) -> Option<kvfleet_meta::MetaFuture<'a, T>> {
            let cut = self.cut.load(std::sync::atomic::Ordering::SeqCst);
            cut.then(|| -> kvfleet_meta::MetaFuture<'a, T> {
                Box::pin(async move { Err(kvfleet_meta::MetaError::Timeout { op, timeout_ms: 0 }) })
            })
        }
    }

    impl MetaStore for CutOff {
        fn store_kind(&self) -> &'static str {
            "embedded, cut off"
        }
        fn put<'a>(&'a self, key: &'a str, value: &'a [u8]) -> kvfleet_meta::MetaFuture<'a, kvfleet_meta::Revision> {
            self.fail("put").unwrap_or_else(|| self.inner.put(key, value))
        }
        fn put_with_lease<'a>(
            &'a self,
            key: &'a str,
            value: &'a [u8],
            lease: kvfleet_meta::LeaseId,
        ) -> kvfleet_meta::MetaFuture<'a, kvfleet_meta::Revision> {
            self.fail("put").unwrap_or_else(|| self.inner.put_with_lease(key, value, lease))
        }
        fn get<'a>(&'a self, key: &'a str) -> kvfleet_meta::MetaFuture<'a, Option<kvfleet_meta::KeyValue>> {
            self.inner.get(key)
        }
        fn get_prefix<'a>(&'a self, prefix: &'a str) -> kvfleet_meta::MetaFuture<'a, kvfleet_meta::Listing> {
            self.inner.get_prefix(prefix)
        }
        fn delete<'a>(&'a self, key: &'a str) -> kvfleet_meta::MetaFuture<'a, bool> {
            self.inner.delete(key)
        }
        fn put_if<'a>(
            &'a self,
            key: &'a str,
            value: &'a [u8],
            lease: Option<kvfleet_meta::LeaseId>,
            conditions: &'a [Condition],
        ) -> kvfleet_meta::MetaFuture<'a, Option<kvfleet_meta::Revision>> {
            self.inner.put_if(key, value, lease, conditions)
        }
        fn delete_if<'a>(
            &'a self,
            key: &'a str,
            conditions: &'a [Condition],
        ) -> kvfleet_meta::MetaFuture<'a, Option<kvfleet_meta::Revision>> {
            self.inner.delete_if(key, conditions)
        }
        fn grant_lease(&self, ttl: Duration) -> kvfleet_meta::MetaFuture<'_, kvfleet_meta::LeaseId> {
            self.fail("grant").unwrap_or_else(|| self.inner.grant_lease(ttl))
        }
        fn keep_alive(&self, lease: kvfleet_meta::LeaseId) -> kvfleet_meta::MetaFuture<'_, Duration> {
            self.fail("keep_alive").unwrap_or_else(|| self.inner.keep_alive(lease))
        }
        fn revoke(&self, lease: kvfleet_meta::LeaseId) -> kvfleet_meta::MetaFuture<'_, ()> {
            self.inner.revoke(lease)
        }
        fn watch_prefix<'a>(
            &'a self,
            prefix: &'a str,
            from_revision: Option<kvfleet_meta::Revision>,
        ) -> kvfleet_meta::MetaFuture<'a, kvfleet_meta::MetaStream<kvfleet_meta::WatchEvent>> {
            self.inner.watch_prefix(prefix, from_revision)
        }
        fn campaign<'a>(
            &'a self,
            name: &'a str,
            value: &'a [u8],
            lease: kvfleet_meta::LeaseId,
        ) -> kvfleet_meta::MetaFuture<'a, kvfleet_meta::LeaderKey> {
            self.inner.campaign(name, value, lease)
        }
        fn observe<'a>(&'a self, name: &'a str) -> kvfleet_meta::MetaFuture<'a, kvfleet_meta::MetaStream<Vec<u8>>> {
            self.inner.observe(name)
        }
        fn resign<'a>(&'a self, leader: &'a kvfleet_meta::LeaderKey) -> kvfleet_meta::MetaFuture<'a, ()> {
            self.inner.resign(leader)
        }
        fn leader<'a>(&'a self, name: &'a str) -> kvfleet_meta::MetaFuture<'a, Option<Vec<u8>>> {
            self.inner.leader(name)
        }
    }

    /// Cut off from etcd, the worker counts itself unregistered within one TTL of its last
    /// refresh (the keep-alive's promise: no later than etcd can expire the lease, so before a
    /// coordinator can evict it and give its number away), and registered again once it is back.
    #[tokio::test]
    async fn a_worker_cut_off_from_etcd_counts_itself_unregistered_before_its_lease_can_expire() {
        let cut = Arc::new(CutOff { inner: MemStore::new(), cut: false.into() });
        let store: Arc<dyn MetaStore> = cut.clone();
        let ttl = Duration::from_millis(600);
        let (_keep, stop) = tokio::sync::watch::channel(false);
        let (registered, mut status) = tokio::sync::watch::channel(false);
        let reg = tokio::spawn(registration_loop(store.clone(), record(3), ttl, None, stop, registered, None));
        tokio::time::timeout(Duration::from_secs(5), status.wait_for(|r| *r)).await.unwrap().unwrap();
        cut.cut.store(true, std::sync::atomic::Ordering::SeqCst);
        let cut_at = tokio::time::Instant::now();
        tokio::time::timeout(Duration::from_secs(5), status.wait_for(|r| !*r)).await.unwrap().unwrap();
        // One TTL from the last refresh at most (which was before the cut), give or take a timer's wake-up.
        let slack = Duration::from_millis(100);
        assert!(
            cut_at.elapsed() <= ttl + slack,
            "reported unregistered {:?} after the cut (TTL {ttl:?})",
            cut_at.elapsed()
        );
        cut.cut.store(false, std::sync::atomic::Ordering::SeqCst);
        tokio::time::timeout(Duration::from_secs(5), status.wait_for(|r| *r)).await.unwrap().unwrap();
        reg.abort();
    }

    #[tokio::test]
    async fn route_ip_finds_the_source_address_or_says_why_not() {
        let ip = route_ip(&["http://127.0.0.1:2379".into()]).await.unwrap();
        assert!(ip.is_loopback(), "{ip}");
        let ip = route_ip(&["no-such-host.invalid:1".into(), "localhost:7000/x".into()]).await.unwrap();
        assert!(ip.is_loopback(), "{ip}");
        let e = route_ip(&[]).await.unwrap_err();
        assert!(e.contains("no etcd endpoint or coordinator"), "{e}");
        assert!(route_ip(&["no-such-host.invalid:1".into()]).await.unwrap_err().contains("no-such-host.invalid"));
    }
}
