//! Keeping a lease alive in the background and noticing promptly when it is lost.
//!
//! Workers register under a lease (so a dead worker's registration disappears by itself) and
//! coordinators campaign under one (so a dead leader's election key does). [`spawn_keep_alive`]
//! refreshes the lease every ttl/3 and publishes [`LeaseStatus::Lost`] through a `watch` channel
//! as soon as the lease is known gone (the store says so) or can no longer be assumed alive (no
//! successful refresh sent within one TTL, e.g. etcd unreachable). A leader stops scheduling on
//! that signal; fencing by revision (see the crate docs) covers the window before it sees it.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::{LeaseId, MetaError, MetaStore};

/// Shortest pause between refreshes, so a tiny TTL cannot turn into a busy loop.
const MIN_REFRESH_INTERVAL: Duration = Duration::from_millis(10);
/// Pause before retrying a refresh that failed for a transient reason.
const RETRY_INTERVAL: Duration = Duration::from_millis(200);

/// What a keep-alive task knows about its lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseStatus {
    /// Refreshed within its TTL.
    Alive,
    /// The lease expired, was revoked, or could not be refreshed within its TTL.
    Lost {
        /// Why it is considered lost.
        reason: String,
        /// The store said the lease no longer exists (expired or revoked): everything held under
        /// it is gone, and whoever watches those keys has seen them go. `false`: no refresh got
        /// through within the TTL, so it may or may not have expired.
        expired: bool,
    },
}

/// Handle on a keep-alive task; dropping it stops refreshing (the lease then lapses by itself).
pub struct LeaseKeeper {
    lease: LeaseId,
    status: watch::Receiver<LeaseStatus>,
    task: JoinHandle<()>,
}

impl LeaseKeeper {
    /// The lease being refreshed.
    pub fn lease(&self) -> LeaseId {
        self.lease
    }

    /// A receiver to `select!` on (`changed()`), e.g. in a leader's scheduling loop.
    pub fn status(&self) -> watch::Receiver<LeaseStatus> {
        self.status.clone()
    }

    /// Whether the lease has been reported lost.
    pub fn is_lost(&self) -> bool {
        matches!(*self.status.borrow(), LeaseStatus::Lost { .. })
    }

    /// Whether the lease was reported lost because the store said it no longer exists (see
    /// [`LeaseStatus::Lost`]).
    pub fn expired(&self) -> bool {
        matches!(*self.status.borrow(), LeaseStatus::Lost { expired: true, .. })
    }

    /// Resolves when the lease is lost, with the reason.
    pub async fn lost(&self) -> String {
        let mut rx = self.status.clone();
        loop {
            if let LeaseStatus::Lost { reason, .. } = &*rx.borrow_and_update() {
                return reason.clone();
            }
            if rx.changed().await.is_err() {
                // The task ended without reporting (cannot happen: it reports before returning).
                return "keep-alive task ended".to_owned();
            }
        }
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Spawns a tokio task refreshing `lease` (granted with `ttl`) every ttl/3 — or a third of the
/// TTL the store reports, if shorter. Must be called inside a tokio runtime.
///
/// Transient errors are retried; the lease is reported lost when the store answers that it no
/// longer exists, or when no refresh has succeeded for one TTL (measured from when the last
/// successful refresh was *sent*) and one more bounded attempt fails.
pub fn spawn_keep_alive(store: Arc<dyn MetaStore>, lease: LeaseId, ttl: Duration) -> LeaseKeeper {
    let (tx, status) = watch::channel(LeaseStatus::Alive);
    let task = tokio::spawn(async move {
        let (reason, expired) = keep_alive_loop(store.as_ref(), lease, ttl).await;
        tracing::warn!(lease = %lease, store = store.store_kind(), %reason, expired, "lease lost");
        let _ = tx.send(LeaseStatus::Lost { reason, expired });
    });
    LeaseKeeper { lease, status, task }
}

/// Refreshes until the lease is lost; returns why, and whether the store said it expired.
///
/// A TTL that passed on this process's clock (a process stopped by SIGSTOP, a host that
/// froze) is checked with the store once before it counts: a lease the store still holds is
/// kept, one it no longer knows is reported expired. That holds however the TTL was seen to
/// pass: the wait for a refresh running out, or a refresh failing after it (a process resumed
/// from SIGSTOP finds its store client's own timeout fired as well, and that error comes first).
async fn keep_alive_loop(store: &dyn MetaStore, lease: LeaseId, ttl: Duration) -> (String, bool) {
    let mut last_ok_sent = Instant::now();
    let mut effective_ttl = ttl;
    loop {
        let sent = Instant::now();
        let expires = last_ok_sent + effective_ttl;
        let refresh = match tokio::time::timeout_at(expires, store.keep_alive(lease)).await {
            Ok(r) => Refresh::from(r),
            Err(_) => Refresh::Failed("timed out".to_owned()),
        };
        let refresh = match refresh {
            Refresh::Failed(why) if Instant::now() >= expires => {
                // Bounded by a quarter TTL: a holder that must stop acting once the store may
                // have expired its lease (a leader) learns it at most that much later, and its
                // writes are fenced by revision meanwhile.
                match tokio::time::timeout(effective_ttl / 4, store.keep_alive(lease)).await {
                    Ok(r) => match Refresh::from(r) {
                        Refresh::Failed(then) => Refresh::Lost(format!("{why}; then {then}")),
                        settled => settled,
                    },
                    Err(_) => Refresh::Lost(format!("{why}; then timed out")),
                }
            }
            other => other,
        };
        match refresh {
            Refresh::Kept(granted) => {
                last_ok_sent = sent;
                effective_ttl = if granted.is_zero() { ttl } else { ttl.min(granted) };
                tokio::time::sleep((effective_ttl / 3).max(MIN_REFRESH_INTERVAL)).await;
            }
            Refresh::Expired => return (format!("lease {lease} expired or was revoked"), true),
            Refresh::Lost(why) => {
                return (format!("no successful refresh within the {effective_ttl:?} TTL: {why}"), false)
            }
            Refresh::Failed(why) => {
                tracing::warn!(lease = %lease, error = %why, "lease refresh failed; retrying");
                let left = expires.saturating_duration_since(Instant::now());
                tokio::time::sleep(RETRY_INTERVAL.min(left)).await;
            }
        }
    }
}

/// How one refresh went.
enum Refresh {
    /// The store kept the lease, for this TTL.
    Kept(Duration),
    /// The store no longer knows the lease.
    Expired,
    /// It failed (`why`); worth another try while the TTL lasts.
    Failed(String),
    /// The TTL passed and the try after it failed too: lost, not known expired.
    Lost(String),
}

impl From<Result<Duration, MetaError>> for Refresh {
    fn from(r: Result<Duration, MetaError>) -> Self {
        match r {
            Ok(granted) => Refresh::Kept(granted),
            Err(MetaError::LeaseNotFound(_)) => Refresh::Expired,
            Err(e) => Refresh::Failed(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemStore;

    #[tokio::test]
    async fn keeps_lease_alive_past_its_ttl_and_reports_revocation() {
        let store: Arc<dyn MetaStore> = Arc::new(MemStore::new());
        let ttl = Duration::from_millis(60);
        let lease = store.grant_lease(ttl).await.unwrap();
        store.put_with_lease("k", b"v", lease).await.unwrap();
        let keeper = spawn_keep_alive(store.clone(), lease, ttl);
        tokio::time::sleep(ttl * 4).await;
        assert!(!keeper.is_lost());
        assert!(store.get("k").await.unwrap().is_some(), "kept-alive key expired");
        store.revoke(lease).await.unwrap();
        let reason = tokio::time::timeout(ttl * 4, keeper.lost()).await.expect("loss not reported");
        assert!(reason.contains("expired or was revoked"), "{reason}");
        assert!(keeper.expired(), "the store said so: an expiry, not a guess");
    }

    /// A process stopped past its TTL resumes to find its refresh failed (its store client's own
    /// timeout fired while it was stopped) after the TTL: it asks the store once, which says the
    /// lease expired, so the holder knows its registration is gone (not merely unrenewed).
    #[tokio::test]
    async fn a_refresh_failing_after_a_stop_past_the_ttl_asks_the_store_once() {
        let mem = MemStore::new();
        let store: Arc<dyn MetaStore> = Arc::new(mem.clone());
        let ttl = Duration::from_millis(60);
        let lease = store.grant_lease(ttl).await.unwrap();
        let keeper = spawn_keep_alive(store.clone(), lease, ttl);
        tokio::time::sleep(ttl / 2).await;
        mem.stall_next_keep_alive(ttl * 3);
        let reason = tokio::time::timeout(ttl * 8, keeper.lost()).await.expect("loss not reported");
        assert!(keeper.expired(), "the store said the lease expired: {reason}");
        assert!(reason.contains("expired or was revoked"), "{reason}");
    }

    #[tokio::test]
    async fn dropping_keeper_lets_lease_lapse() {
        let store: Arc<dyn MetaStore> = Arc::new(MemStore::new());
        let ttl = Duration::from_millis(40);
        let lease = store.grant_lease(ttl).await.unwrap();
        store.put_with_lease("k", b"v", lease).await.unwrap();
        drop(spawn_keep_alive(store.clone(), lease, ttl));
        tokio::time::sleep(ttl * 3).await;
        assert!(store.get("k").await.unwrap().is_none());
    }
}
