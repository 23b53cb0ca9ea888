//! Worker registration: how a worker joins the cluster and stays in it.
//!
//! - With `--etcd`: the worker reads the cluster record (model must match, clock epoch), writes
//!   `/kvfleet/workers/<instance>` under its own lease and keeps the lease alive; when the lease is
//!   lost (etcd restarted, partition) it re-registers with a new one, retrying with backoff.
//! - With `--coordinator A,B,…` (embedded store): it registers through whichever coordinator is
//!   leader, refreshing before the registration's TTL lapses.
//!
//! A model mismatch is final: the worker exits with the message naming both models.

use kvfleet_meta::layout::{self, ClusterRecord, WorkerRecord};
use kvfleet_meta::{spawn_keep_alive, MetaStore};
use kvfleet_proto::v1;
use kvfleet_proto::v1::coordinator_client::CoordinatorClient;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error("refused by the cluster: {0}")]
    Refused(String),
    #[error("metadata store: {0}")]
    Store(#[from] kvfleet_meta::MetaError),
}

/// Read the cluster record (model check, epoch) from etcd before the engine starts.
pub async fn cluster_record(
    store: &dyn MetaStore,
    model: &str,
    kv_bytes_per_token: u64,
) -> Result<ClusterRecord, RegisterError> {
    let mut backoff = Duration::from_millis(100);
    loop {
        if let Some(kv) = store.get(layout::CLUSTER).await? {
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

/// Keep `rec` registered in etcd for as long as the future runs.
pub async fn etcd_loop(store: Arc<dyn MetaStore>, rec: WorkerRecord, ttl: Duration) {
    let key = layout::worker(rec.instance);
    let value = serde_json::to_vec(&rec).expect("plain data");
    let mut backoff = Duration::from_millis(100);
    loop {
        let attempt = async {
            let lease = store.grant_lease(ttl).await?;
            store.put_with_lease(&key, &value, lease).await?;
            Ok::<_, kvfleet_meta::MetaError>(spawn_keep_alive(store.clone(), lease, ttl))
        };
        match attempt.await {
            Ok(keeper) => {
                tracing::info!(key = %key, "registered in etcd");
                backoff = Duration::from_millis(100);
                let reason = keeper.lost().await;
                tracing::warn!("registration lease lost ({reason}); registering again");
            }
            Err(e) => {
                tracing::warn!("registering in etcd failed ({e}); retrying in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Keep registered through the leader among `coordinators` (embedded store).
pub async fn coordinator_loop(
    coordinators: Vec<String>,
    info: v1::WorkerInfo,
    tls: Option<kvfleet_pki::NodeIdentity>,
) -> Result<(), RegisterError> {
    let mut refresh = Duration::from_millis(500);
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
            match client.register(info.clone()).await {
                Ok(reply) => {
                    let ttl = Duration::from_millis(reply.into_inner().ttl_ms.max(300) as u64);
                    refresh = ttl / 3;
                    done = true;
                    break;
                }
                Err(s) if s.code() == tonic::Code::FailedPrecondition => {
                    return Err(RegisterError::Refused(s.message().to_string()))
                }
                Err(s) => tracing::debug!(coordinator = %addr, "register: {}", s.message()),
            }
        }
        if !done {
            tracing::warn!("no leader accepted the registration; retrying");
        }
        tokio::time::sleep(if done { refresh } else { Duration::from_millis(200) }).await;
    }
}
