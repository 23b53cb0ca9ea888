//! [`MemStore`]: the in-process metadata store — the embedded default used when no `--etcd`
//! endpoint is given (one coordinator) and the test double of [`crate::EtcdStore`].
//!
//! It copies etcd's semantics rather than approximating them, so code tested against it behaves
//! the same on etcd: one revision counter bumped by every change (the keys of an expiring lease
//! are deleted at one shared revision); create/mod revisions per key; leases whose expiry is
//! driven by tokio time (a timer task per lease, plus a check at the start of every operation so
//! nobody reads a key past its lease's deadline); watches that replay a bounded history from a
//! revision and then follow live changes; and etcd's election algorithm — candidates are keys
//! `{name}/{lease:x}` under their leases and the live candidate with the lowest create revision
//! leads, so the next one wins when the leader resigns or its lease lapses.
//!
//! All state sits behind one `std::sync::Mutex` held only for in-memory work, never across an
//! `.await`. Waiters (campaigns, observers) sleep on a `tokio::sync::watch` of the revision.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::{
    election_prefix, Condition, EventKind, KeyValue, LeaderKey, LeaseId, Listing, MetaError, MetaFuture, MetaStore,
    MetaStream, Revision, WatchEvent,
};

/// Watch events retained for replay by default (a watch from an older revision gets
/// [`MetaError::Compacted`], as on a compacted etcd).
pub const DEFAULT_HISTORY_LIMIT: usize = 100_000;

/// The in-process store. Cheap to clone: clones share one store (several emulated processes in
/// one test can talk to "the same etcd").
#[derive(Clone)]
pub struct MemStore {
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
    /// Reads still to fail ([`MemStore::fail_next_reads`]), as an etcd that dropped would.
    failing_reads: std::sync::atomic::AtomicU32,
    /// Milliseconds the next keep-alive stalls its caller's thread ([`MemStore::stall_next_keep_alive`]).
    stalled_keep_alive_ms: std::sync::atomic::AtomicU64,
    /// Writes to keys under this prefix never complete ([`MemStore::hang_writes_under`]).
    hung_prefix: Mutex<Option<String>>,
    /// Writes that hung so far.
    hung_writes: std::sync::atomic::AtomicU32,
    /// The next `get` of a key under this prefix answers only once the gate is opened
    /// ([`MemStore::hold_next_read_under`]).
    held_read: Mutex<Option<(String, Arc<tokio::sync::Notify>)>>,
    /// Reads held so far.
    held_reads: std::sync::atomic::AtomicU32,
    /// The current revision, published after every change; campaigners and observers wait on it.
    changed: watch::Sender<i64>,
}

struct MemLease {
    ttl: Duration,
    deadline: Instant,
    keys: BTreeSet<String>,
}

type EventSender = mpsc::UnboundedSender<Result<WatchEvent, MetaError>>;

struct Watcher {
    prefix: String,
    tx: EventSender,
}

struct State {
    revision: i64,
    kvs: BTreeMap<String, KeyValue>,
    leases: HashMap<i64, MemLease>,
    next_lease: i64,
    history: VecDeque<WatchEvent>,
    history_limit: usize,
    /// Highest revision whose events were dropped from `history` (0: none).
    compacted: i64,
    watchers: Vec<Watcher>,
}

impl Default for MemStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemStore {
    /// An empty store (revision 1) keeping up to [`DEFAULT_HISTORY_LIMIT`] watch events for replay.
    pub fn new() -> Self {
        Self::with_history_limit(DEFAULT_HISTORY_LIMIT)
    }

    /// A store that keeps at most `history_limit` watch events for replay.
    pub fn with_history_limit(history_limit: usize) -> Self {
        let state = State {
            revision: 1,
            kvs: BTreeMap::new(),
            leases: HashMap::new(),
            next_lease: 1,
            history: VecDeque::new(),
            history_limit: history_limit.max(1),
            compacted: 0,
            watchers: Vec::new(),
        };
        let (changed, _) = watch::channel(state.revision);
        MemStore {
            inner: Arc::new(Inner {
                state: Mutex::new(state),
                failing_reads: Default::default(),
                stalled_keep_alive_ms: Default::default(),
                hung_prefix: Mutex::new(None),
                hung_writes: Default::default(),
                held_read: Mutex::new(None),
                held_reads: Default::default(),
                changed,
            }),
        }
    }

    /// Make the next `n` reads (`get`, `get_prefix`) fail with a timeout, as an etcd that is
    /// restarting would answer: for tests of what retries a blink of the store.
    pub fn fail_next_reads(&self, n: u32) {
        self.inner.failing_reads.store(n, std::sync::atomic::Ordering::SeqCst);
    }

    /// Make the next keep-alive hold its caller's thread for `stall` and then fail with a
    /// timeout: what a process stopped by SIGSTOP sees once it resumes (its client's own timeout
    /// fired while it was stopped; the lease may have expired meanwhile).
    pub fn stall_next_keep_alive(&self, stall: Duration) {
        let ms = u64::try_from(stall.as_millis()).unwrap_or(u64::MAX);
        self.inner.stalled_keep_alive_ms.store(ms, std::sync::atomic::Ordering::SeqCst);
    }

    /// Make every write (`put`, `put_if`) to a key under `prefix` hang for ever, as a process
    /// killed while it waited for the write would leave it; `None` lets later writes through.
    /// For tests of what a crash between two writes leaves in the store.
    pub fn hang_writes_under(&self, prefix: Option<&str>) {
        *self.inner.hung_prefix.lock().expect("mem store lock") = prefix.map(str::to_string);
    }

    /// Writes that hung ([`MemStore::hang_writes_under`]) so far.
    pub fn hung_writes(&self) -> u32 {
        self.inner.hung_writes.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Hold the answer of the next `get` of a key under `prefix`: the value is read at once and
    /// answered once the returned gate is opened (`notify_one`), as a read whose reply is on its
    /// way while other writes land. For tests of what a process does with a stale answer.
    pub fn hold_next_read_under(&self, prefix: &str) -> Arc<tokio::sync::Notify> {
        let gate = Arc::new(tokio::sync::Notify::new());
        *self.inner.held_read.lock().expect("mem store lock") = Some((prefix.to_string(), gate.clone()));
        gate
    }

    /// Reads held ([`MemStore::hold_next_read_under`]) so far.
    pub fn held_reads(&self) -> u32 {
        self.inner.held_reads.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Never returns if a write to `key` is to hang.
    async fn write_fault(&self, key: &str) {
        let hangs =
            self.inner.hung_prefix.lock().expect("mem store lock").as_deref().is_some_and(|p| key.starts_with(p));
        if hangs {
            self.inner.hung_writes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            std::future::pending::<()>().await;
        }
    }

    fn read_fault(&self) -> Result<(), MetaError> {
        use std::sync::atomic::Ordering;
        let failing = self.inner.failing_reads.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        match failing {
            Ok(_) => Err(MetaError::Timeout { op: "get", timeout_ms: 0 }),
            Err(_) => Ok(()),
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave `State` half-updated in a way that matters
        // more than losing the store, so keep serving rather than poisoning every caller.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Runs `f` on the state after expiring due leases; publishes the revision if it moved.
    fn with_state<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let mut state = self.lock();
        let before = state.revision;
        state.expire_due(Instant::now());
        let out = f(&mut state);
        if state.revision != before {
            self.changed.send_replace(state.revision);
        }
        out
    }
}

impl State {
    fn expire_due(&mut self, now: Instant) {
        let due: Vec<i64> = self.leases.iter().filter(|(_, l)| l.deadline <= now).map(|(id, _)| *id).collect();
        for id in due {
            // Cannot fail: the id was just read from the map.
            let _ = self.revoke(LeaseId(id));
        }
    }

    fn record(&mut self, event: WatchEvent) {
        self.watchers.retain(|w| !event.key.starts_with(&w.prefix) || w.tx.send(Ok(event.clone())).is_ok());
        if self.history.len() == self.history_limit {
            if let Some(dropped) = self.history.pop_front() {
                self.compacted = dropped.revision.0;
            }
        }
        self.history.push_back(event);
    }

    fn put_kv(&mut self, key: &str, value: &[u8], lease: Option<LeaseId>) -> Result<Revision, MetaError> {
        if let Some(id) = lease {
            if !self.leases.contains_key(&id.0) {
                return Err(MetaError::LeaseNotFound(id));
            }
        }
        self.revision += 1;
        let revision = Revision(self.revision);
        let old = self.kvs.get(key).map(|old| (old.lease, old.create_revision));
        let create_revision = match old {
            Some((old_lease, old_create)) => {
                if old_lease != lease {
                    self.detach(key, old_lease);
                }
                old_create
            }
            None => revision,
        };
        if let Some(id) = lease {
            if let Some(l) = self.leases.get_mut(&id.0) {
                l.keys.insert(key.to_owned());
            }
        }
        self.kvs.insert(
            key.to_owned(),
            KeyValue { key: key.to_owned(), value: value.to_vec(), create_revision, mod_revision: revision, lease },
        );
        self.record(WatchEvent { kind: EventKind::Put, key: key.to_owned(), value: value.to_vec(), revision });
        Ok(revision)
    }

    fn detach(&mut self, key: &str, lease: Option<LeaseId>) {
        if let Some(l) = lease.and_then(|id| self.leases.get_mut(&id.0)) {
            l.keys.remove(key);
        }
    }

    /// Removes `key` as part of the change at the (already bumped) current revision.
    fn remove_at_current(&mut self, key: &str) {
        if let Some(old) = self.kvs.remove(key) {
            self.detach(key, old.lease);
            self.record(WatchEvent {
                kind: EventKind::Delete,
                key: key.to_owned(),
                value: Vec::new(),
                revision: Revision(self.revision),
            });
        }
    }

    fn delete(&mut self, key: &str) -> bool {
        if !self.kvs.contains_key(key) {
            return false;
        }
        self.revision += 1;
        self.remove_at_current(key);
        true
    }

    fn revoke(&mut self, lease: LeaseId) -> Result<(), MetaError> {
        let Some(l) = self.leases.remove(&lease.0) else {
            return Err(MetaError::LeaseNotFound(lease));
        };
        if !l.keys.is_empty() {
            // One revision for all the lease's keys, as etcd does.
            self.revision += 1;
            for key in &l.keys {
                self.remove_at_current(key);
            }
        }
        Ok(())
    }

    fn conditions_hold(&self, conditions: &[Condition]) -> bool {
        conditions.iter().all(|c| c.holds(self.kvs.get(c.key())))
    }

    fn prefix_iter<'s>(&'s self, prefix: &str) -> impl Iterator<Item = &'s KeyValue> + 's {
        let owned = prefix.to_owned();
        self.kvs
            .range::<str, _>((std::ops::Bound::Included(prefix), std::ops::Bound::Unbounded))
            .take_while(move |(k, _)| k.starts_with(owned.as_str()))
            .map(|(_, kv)| kv)
    }

    /// The election's leader: the candidate key with the lowest create revision.
    fn leader_kv(&self, name: &str) -> Option<&KeyValue> {
        let prefix = election_prefix(name);
        self.prefix_iter(&prefix).min_by_key(|kv| kv.create_revision)
    }
}

/// Deletes a candidate's key if its campaign future is dropped before winning (etcd's election
/// service does the same when the campaign RPC is cancelled).
struct CandidacyGuard {
    inner: Weak<Inner>,
    key: String,
    create_revision: Revision,
    armed: bool,
}

impl Drop for CandidacyGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Some(inner) = self.inner.upgrade() {
            inner.with_state(|s| {
                if s.kvs.get(&self.key).is_some_and(|kv| kv.create_revision == self.create_revision) {
                    s.delete(&self.key);
                }
            });
        }
    }
}

/// Expires `lease` at its deadline (re-reading the deadline, which keep-alives push back).
fn spawn_lease_timer(inner: Weak<Inner>, lease: LeaseId) {
    tokio::spawn(async move {
        loop {
            let deadline = {
                let Some(inner) = inner.upgrade() else { return };
                let state = inner.lock();
                match state.leases.get(&lease.0) {
                    Some(l) => l.deadline,
                    None => return,
                }
            };
            tokio::time::sleep_until(deadline).await;
            let Some(inner) = inner.upgrade() else { return };
            inner.with_state(|_| ());
        }
    });
}

impl MetaStore for MemStore {
    fn store_kind(&self) -> &'static str {
        "embedded"
    }

    fn put<'a>(&'a self, key: &'a str, value: &'a [u8]) -> MetaFuture<'a, Revision> {
        Box::pin(async move {
            self.write_fault(key).await;
            self.inner.with_state(|s| s.put_kv(key, value, None))
        })
    }

    fn put_with_lease<'a>(&'a self, key: &'a str, value: &'a [u8], lease: LeaseId) -> MetaFuture<'a, Revision> {
        Box::pin(async move { self.inner.with_state(|s| s.put_kv(key, value, Some(lease))) })
    }

    fn get<'a>(&'a self, key: &'a str) -> MetaFuture<'a, Option<KeyValue>> {
        Box::pin(async move {
            self.read_fault()?;
            let value = self.inner.with_state(|s| s.kvs.get(key).cloned());
            let gate = {
                let mut held = self.inner.held_read.lock().expect("mem store lock");
                if held.as_ref().is_some_and(|(p, _)| key.starts_with(p.as_str())) {
                    held.take().map(|(_, gate)| gate)
                } else {
                    None
                }
            };
            if let Some(gate) = gate {
                self.inner.held_reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                gate.notified().await;
            }
            Ok(value)
        })
    }

    fn get_prefix<'a>(&'a self, prefix: &'a str) -> MetaFuture<'a, Listing> {
        Box::pin(async move {
            self.read_fault()?;
            Ok(self.inner.with_state(|s| Listing {
                kvs: s.prefix_iter(prefix).cloned().collect(),
                revision: Revision(s.revision),
            }))
        })
    }

    fn delete<'a>(&'a self, key: &'a str) -> MetaFuture<'a, bool> {
        Box::pin(async move { Ok(self.inner.with_state(|s| s.delete(key))) })
    }

    fn put_if<'a>(
        &'a self,
        key: &'a str,
        value: &'a [u8],
        lease: Option<LeaseId>,
        conditions: &'a [Condition],
    ) -> MetaFuture<'a, Option<Revision>> {
        Box::pin(async move {
            self.write_fault(key).await;
            self.inner.with_state(|s| {
                if !s.conditions_hold(conditions) {
                    return Ok(None);
                }
                s.put_kv(key, value, lease).map(Some)
            })
        })
    }

    fn delete_if<'a>(&'a self, key: &'a str, conditions: &'a [Condition]) -> MetaFuture<'a, Option<Revision>> {
        Box::pin(async move {
            Ok(self.inner.with_state(|s| {
                if !s.conditions_hold(conditions) {
                    return None;
                }
                s.delete(key);
                Some(Revision(s.revision))
            }))
        })
    }

    fn grant_lease(&self, ttl: Duration) -> MetaFuture<'_, LeaseId> {
        Box::pin(async move {
            if ttl.is_zero() {
                return Err(MetaError::InvalidOption {
                    field: "lease ttl",
                    reason: "must be greater than zero".into(),
                });
            }
            let id = self.inner.with_state(|s| {
                let id = LeaseId(s.next_lease);
                s.next_lease += 1;
                let deadline = Instant::now() + ttl;
                s.leases.insert(id.0, MemLease { ttl, deadline, keys: BTreeSet::new() });
                id
            });
            spawn_lease_timer(Arc::downgrade(&self.inner), id);
            Ok(id)
        })
    }

    fn keep_alive(&self, lease: LeaseId) -> MetaFuture<'_, Duration> {
        Box::pin(async move {
            let stall = self.inner.stalled_keep_alive_ms.swap(0, std::sync::atomic::Ordering::SeqCst);
            if stall > 0 {
                std::thread::sleep(Duration::from_millis(stall));
                return Err(MetaError::Timeout { op: "lease keep-alive", timeout_ms: stall });
            }
            self.inner.with_state(|s| match s.leases.get_mut(&lease.0) {
                Some(l) => {
                    l.deadline = Instant::now() + l.ttl;
                    Ok(l.ttl)
                }
                None => Err(MetaError::LeaseNotFound(lease)),
            })
        })
    }

    fn revoke(&self, lease: LeaseId) -> MetaFuture<'_, ()> {
        Box::pin(async move { self.inner.with_state(|s| s.revoke(lease)) })
    }

    fn watch_prefix<'a>(
        &'a self,
        prefix: &'a str,
        from_revision: Option<Revision>,
    ) -> MetaFuture<'a, MetaStream<WatchEvent>> {
        Box::pin(async move {
            let (tx, rx) = mpsc::unbounded_channel();
            self.inner.with_state(|s| {
                if let Some(from) = from_revision {
                    if from.0 <= s.compacted {
                        return Err(MetaError::Compacted { requested: from, compacted: Revision(s.compacted) });
                    }
                    for ev in s.history.iter().filter(|e| e.revision >= from && e.key.starts_with(prefix)) {
                        // The receiver is still in hand, so this cannot fail.
                        let _ = tx.send(Ok(ev.clone()));
                    }
                }
                s.watchers.push(Watcher { prefix: prefix.to_owned(), tx });
                Ok(())
            })?;
            let stream: MetaStream<WatchEvent> = Box::pin(UnboundedReceiverStream::new(rx));
            Ok(stream)
        })
    }

    fn campaign<'a>(&'a self, name: &'a str, value: &'a [u8], lease: LeaseId) -> MetaFuture<'a, LeaderKey> {
        Box::pin(async move {
            let key = format!("{}{lease}", election_prefix(name));
            let mut changed = self.inner.changed.subscribe();
            let create_revision = self.inner.with_state(|s| {
                // Re-campaigning with the same lease resumes the existing candidacy (etcd).
                match s.kvs.get(&key) {
                    Some(kv) if kv.value == value => Ok(kv.create_revision),
                    _ => {
                        s.put_kv(&key, value, Some(lease))?;
                        Ok::<_, MetaError>(s.kvs.get(&key).map_or(Revision(s.revision), |kv| kv.create_revision))
                    }
                }
            })?;
            let mut guard =
                CandidacyGuard { inner: Arc::downgrade(&self.inner), key: key.clone(), create_revision, armed: true };
            loop {
                changed.borrow_and_update();
                let won = self.inner.with_state(|s| {
                    match s.kvs.get(&key) {
                        Some(kv) if kv.create_revision == create_revision => {}
                        _ => {
                            return Err(MetaError::Election {
                                election: name.to_owned(),
                                reason: format!("candidate key {key} vanished (lease {lease} expired or revoked)"),
                            })
                        }
                    }
                    Ok(s.leader_kv(name).is_some_and(|kv| kv.create_revision == create_revision))
                })?;
                if won {
                    guard.armed = false;
                    return Ok(LeaderKey { name: name.to_owned(), key, create_revision, lease });
                }
                // The sender lives as long as `self`, so this only fails if the store is gone.
                if changed.changed().await.is_err() {
                    return Err(MetaError::Election { election: name.to_owned(), reason: "store dropped".into() });
                }
            }
        })
    }

    fn observe<'a>(&'a self, name: &'a str) -> MetaFuture<'a, MetaStream<Vec<u8>>> {
        Box::pin(async move {
            let (tx, rx) = mpsc::unbounded_channel::<Result<Vec<u8>, MetaError>>();
            let mut changed = self.inner.changed.subscribe();
            let current = |inner: &Inner| {
                inner.with_state(|s| s.leader_kv(name).map(|kv| ((kv.key.clone(), kv.mod_revision), kv.value.clone())))
            };
            changed.borrow_and_update();
            let mut last = None;
            if let Some((id, value)) = current(&self.inner) {
                last = Some(id);
                let _ = tx.send(Ok(value));
            }
            let weak = Arc::downgrade(&self.inner);
            let name = name.to_owned();
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = tx.closed() => return,
                        r = changed.changed() => if r.is_err() { return },
                    }
                    changed.borrow_and_update();
                    let Some(inner) = weak.upgrade() else { return };
                    let now = inner.with_state(|s| {
                        s.leader_kv(&name).map(|kv| ((kv.key.clone(), kv.mod_revision), kv.value.clone()))
                    });
                    drop(inner);
                    if let Some((id, value)) = now {
                        if last.as_ref() != Some(&id) {
                            last = Some(id);
                            if tx.send(Ok(value)).is_err() {
                                return;
                            }
                        }
                    }
                }
            });
            let stream: MetaStream<Vec<u8>> = Box::pin(UnboundedReceiverStream::new(rx));
            Ok(stream)
        })
    }

    fn resign<'a>(&'a self, leader: &'a LeaderKey) -> MetaFuture<'a, ()> {
        Box::pin(async move {
            self.inner.with_state(|s| {
                if s.conditions_hold(&[Condition::leader(leader)]) {
                    s.delete(&leader.key);
                }
            });
            Ok(())
        })
    }

    fn leader<'a>(&'a self, name: &'a str) -> MetaFuture<'a, Option<Vec<u8>>> {
        Box::pin(async move { Ok(self.inner.with_state(|s| s.leader_kv(name).map(|kv| kv.value.clone()))) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::StreamExt;

    #[tokio::test]
    async fn revisions_follow_etcd_numbering() {
        let s = MemStore::new();
        assert_eq!(s.put("a", b"1").await.unwrap(), Revision(2));
        assert_eq!(s.put("a", b"2").await.unwrap(), Revision(3));
        let kv = s.get("a").await.unwrap().unwrap();
        assert_eq!((kv.create_revision, kv.mod_revision), (Revision(2), Revision(3)));
        assert!(s.delete("a").await.unwrap());
        assert!(!s.delete("a").await.unwrap());
        // A failed delete does not bump the revision.
        assert_eq!(s.get_prefix("").await.unwrap().revision, Revision(4));
        // Re-created key gets a new create revision.
        assert_eq!(s.put("a", b"3").await.unwrap(), Revision(5));
        assert_eq!(s.get("a").await.unwrap().unwrap().create_revision, Revision(5));
    }

    #[tokio::test]
    async fn lease_expiry_deletes_all_keys_at_one_revision() {
        let s = MemStore::new();
        let lease = s.grant_lease(Duration::from_millis(50)).await.unwrap();
        s.put_with_lease("w/1", b"x", lease).await.unwrap();
        s.put_with_lease("w/2", b"y", lease).await.unwrap();
        let mut watch = s.watch_prefix("w/", None).await.unwrap();
        let a = watch.next().await.unwrap().unwrap();
        let b = watch.next().await.unwrap().unwrap();
        assert_eq!((a.kind, b.kind), (EventKind::Delete, EventKind::Delete));
        assert_eq!(a.revision, b.revision);
        assert!(s.get_prefix("w/").await.unwrap().kvs.is_empty());
        assert!(matches!(s.keep_alive(lease).await, Err(MetaError::LeaseNotFound(_))));
        assert!(matches!(s.put_with_lease("w/3", b"z", lease).await, Err(MetaError::LeaseNotFound(_))));
    }

    #[tokio::test]
    async fn overwriting_without_lease_detaches_key() {
        let s = MemStore::new();
        let lease = s.grant_lease(Duration::from_secs(60)).await.unwrap();
        s.put_with_lease("k", b"x", lease).await.unwrap();
        s.put("k", b"y").await.unwrap();
        s.revoke(lease).await.unwrap();
        assert_eq!(s.get("k").await.unwrap().unwrap().value, b"y");
        assert!(matches!(s.revoke(lease).await, Err(MetaError::LeaseNotFound(_))));
    }

    #[tokio::test]
    async fn bounded_history_reports_compaction() {
        let s = MemStore::with_history_limit(2);
        for i in 0..4u8 {
            s.put("k", &[i]).await.unwrap(); // revisions 2..=5; history keeps 4 and 5
        }
        match s.watch_prefix("k", Some(Revision(3))).await {
            Err(MetaError::Compacted { requested, compacted }) => {
                assert_eq!((requested, compacted), (Revision(3), Revision(3)));
            }
            Err(e) => panic!("expected Compacted, got {e}"),
            Ok(_) => panic!("expected Compacted, got a stream"),
        }
        let mut w = s.watch_prefix("k", Some(Revision(4))).await.unwrap();
        assert_eq!(w.next().await.unwrap().unwrap().value, vec![2]);
    }

    #[tokio::test]
    async fn dropped_campaign_withdraws_candidacy() {
        let s = MemStore::new();
        let l1 = s.grant_lease(Duration::from_secs(60)).await.unwrap();
        let l2 = s.grant_lease(Duration::from_secs(60)).await.unwrap();
        let lead = s.campaign("e", b"a", l1).await.unwrap();
        {
            let pending = s.campaign("e", b"b", l2);
            // Polled once (registers the candidate), then dropped.
            let _ = tokio::time::timeout(Duration::from_millis(10), pending).await;
        }
        assert_eq!(s.get_prefix("e/").await.unwrap().kvs.len(), 1);
        s.resign(&lead).await.unwrap();
        assert_eq!(s.leader("e").await.unwrap(), None);
    }

    #[tokio::test]
    async fn campaign_fails_when_own_lease_lapses() {
        let s = MemStore::new();
        let l1 = s.grant_lease(Duration::from_secs(60)).await.unwrap();
        let l2 = s.grant_lease(Duration::from_millis(30)).await.unwrap();
        let _lead = s.campaign("e", b"a", l1).await.unwrap();
        let err = s.campaign("e", b"b", l2).await.unwrap_err();
        assert!(matches!(err, MetaError::Election { .. }), "{err}");
    }
}
