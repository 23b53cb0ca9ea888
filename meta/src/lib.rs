//! kvfleet's metadata store: the one place where cluster state that must survive a coordinator
//! lives, so a newly elected leader can take over where the old one stopped (docs/architecture.md,
//! "The emulator").
//!
//! What is stored here: the worker registry (each worker's key is attached to a lease it keeps
//! alive, so a dead worker disappears by itself), published load, request ownership
//! (request → instance, phase; written *before* a request is acknowledged so a new leader can
//! resume it) and the coordinator election.
//!
//! Layout of the crate:
//! - this file: the object-safe [`MetaStore`] trait and the plain data types it speaks
//!   ([`Revision`], [`LeaseId`], [`KeyValue`], [`Listing`], [`Condition`], [`WatchEvent`],
//!   [`LeaderKey`]);
//! - [`error`] holds [`MetaError`];
//! - [`mem`]: [`MemStore`], the in-process store used when no `--etcd` endpoint is given
//!   ("embedded default") and as the test double. It follows etcd's semantics (revisions,
//!   leases, watches, election by lowest create revision) so tests against it mean something;
//! - [`etcd`]: [`EtcdStore`] over `etcd-client` (KV, Lease, Watch and Election services);
//! - [`keepalive`]: [`spawn_keep_alive`], a task that refreshes a lease every ttl/3 and reports
//!   its loss through a `tokio::sync::watch` channel.
//!
//! # Fencing by revision
//!
//! A leader that loses its lease must step down, and fencing by revision makes sure that an
//! ex-leader which has not noticed yet cannot write. Winning an election creates the leader's
//! election key under its lease; the key's *create revision* is unique for this term of office
//! and is returned in [`LeaderKey::create_revision`]. Every write a leader makes that decides
//! something (request ownership, placement) goes through [`MetaStore::put_if`] with
//! [`Condition::leader`], i.e. "only if my election key still exists with the create revision I
//! won with". The check and the write are one atomic transaction in the store, so once the
//! leader's lease lapses (its key is deleted) or it resigns, every later write from that
//! ex-leader is refused — even if the process has not yet noticed (a GC pause, a partition) —
//! and `put_if` returns `None`, which is the leader's signal to stop scheduling at once. A new
//! leader's key has a larger create revision, so an old leader can never pass the check again.
//! [`spawn_keep_alive`] gives the prompt signal; the revision check gives the guarantee.

#![warn(missing_docs)]

pub mod error;
pub mod etcd;
pub mod keepalive;
pub mod mem;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

pub mod args;
pub mod layout;

pub use args::EtcdArgs;

pub use error::MetaError;
pub use etcd::{EtcdOptions, EtcdStore, EtcdTls};
pub use keepalive::{spawn_keep_alive, LeaseKeeper, LeaseStatus};
pub use mem::MemStore;

/// A store revision: a logical clock bumped by every change (etcd semantics: a store starts at
/// revision 1, the first write gets 2; all keys deleted by one lease expiry share a revision).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Revision(pub i64);

/// A lease: keys attached to it are deleted when it expires or is revoked.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct LeaseId(pub i64);

impl std::fmt::Display for LeaseId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

/// One stored key with its value and revisions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    /// The key.
    pub key: String,
    /// The value (opaque bytes).
    pub value: Vec<u8>,
    /// Revision of the write that created the key (since it last did not exist).
    pub create_revision: Revision,
    /// Revision of the last write to the key; what [`Condition::ModRevision`] compares.
    pub mod_revision: Revision,
    /// The lease the key is attached to, if any.
    pub lease: Option<LeaseId>,
}

/// The result of [`MetaStore::get_prefix`]: the keys, sorted, and the store revision they were
/// read at. Watching from `revision.0 + 1` afterwards misses no change ("list, then watch").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listing {
    /// The keys under the prefix, sorted by key.
    pub kvs: Vec<KeyValue>,
    /// The store revision they were read at.
    pub revision: Revision,
}

/// One precondition of a conditional write ([`MetaStore::put_if`], [`MetaStore::delete_if`]).
/// Each names its key, so a write can be fenced on another key (the leader's election key).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Condition {
    /// `key` does not exist.
    Absent {
        /// The key.
        key: String,
    },
    /// `key` exists and was last modified at `revision` (compare-and-swap).
    ModRevision {
        /// The key.
        key: String,
        /// Its expected [`KeyValue::mod_revision`].
        revision: Revision,
    },
    /// `key` exists with this create revision. With a [`LeaderKey`] this is the fencing check:
    /// it fails as soon as the leader resigned or its lease lapsed.
    CreateRevision {
        /// The key.
        key: String,
        /// Its expected [`KeyValue::create_revision`].
        revision: Revision,
    },
}

impl Condition {
    /// [`Condition::Absent`]: create-if-absent.
    pub fn absent(key: impl Into<String>) -> Self {
        Condition::Absent { key: key.into() }
    }

    /// [`Condition::ModRevision`]: compare-and-swap against the revision last read.
    pub fn mod_revision(key: impl Into<String>, revision: Revision) -> Self {
        Condition::ModRevision { key: key.into(), revision }
    }

    /// Fencing: holds only while `leader` is still the key it won the election with.
    pub fn leader(leader: &LeaderKey) -> Self {
        Condition::CreateRevision { key: leader.key.clone(), revision: leader.create_revision }
    }

    /// Whether the condition holds for a key currently stored as `current` (`None`: absent).
    /// Shared by [`MemStore`] and the tests so both stores agree on what a condition means.
    pub fn holds(&self, current: Option<&KeyValue>) -> bool {
        match self {
            Condition::Absent { .. } => current.is_none(),
            Condition::ModRevision { revision, .. } => current.is_some_and(|kv| kv.mod_revision == *revision),
            Condition::CreateRevision { revision, .. } => current.is_some_and(|kv| kv.create_revision == *revision),
        }
    }

    /// The key the condition is about.
    pub fn key(&self) -> &str {
        match self {
            Condition::Absent { key } | Condition::ModRevision { key, .. } | Condition::CreateRevision { key, .. } => {
                key
            }
        }
    }
}

/// What a [`WatchEvent`] did to its key.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// The key was created or overwritten.
    Put,
    /// The key was deleted (explicitly or by its lease ending).
    Delete,
}

/// One change seen by [`MetaStore::watch_prefix`]. For a delete, `value` is empty and
/// `revision` is the revision of the delete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchEvent {
    /// Put or delete.
    pub kind: EventKind,
    /// The key changed.
    pub key: String,
    /// The new value (empty for a delete).
    pub value: Vec<u8>,
    /// The revision of the change.
    pub revision: Revision,
}

/// Proof of leadership returned by [`MetaStore::campaign`]: the election key (`{name}/{lease:x}`,
/// etcd's layout) and the create revision it won with. Pass it to [`Condition::leader`] to fence
/// writes and to [`MetaStore::resign`] to step down.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaderKey {
    /// The election's name (key prefix).
    pub name: String,
    /// This candidate's election key, `{name}/{lease:x}`.
    pub key: String,
    /// The create revision of that key: lowest among candidates when elected.
    pub create_revision: Revision,
    /// The lease the key is attached to; leadership ends with it.
    pub lease: LeaseId,
}

/// The future every [`MetaStore`] method returns (boxed so the trait is object-safe and a
/// coordinator can hold an `Arc<dyn MetaStore>`).
pub type MetaFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, MetaError>> + Send + 'a>>;

/// A stream of results (watch events, leader values). It ends after yielding an error; the
/// caller re-opens it (for a watch: from the last revision seen + 1).
pub type MetaStream<T> = Pin<Box<dyn tokio_stream::Stream<Item = Result<T, MetaError>> + Send>>;

/// The metadata store shared by coordinators and workers. Two implementations: [`EtcdStore`]
/// and [`MemStore`]; both pass the same behavioural suite (`meta/tests/suite`).
///
/// Keys are UTF-8 strings (`/kvfleet/workers/3`), values opaque bytes.
pub trait MetaStore: Send + Sync + 'static {
    /// `"etcd"` or `"embedded"`, for log lines.
    fn store_kind(&self) -> &'static str;

    /// Writes `key`, returning the revision of the write.
    fn put<'a>(&'a self, key: &'a str, value: &'a [u8]) -> MetaFuture<'a, Revision>;

    /// Writes `key` attached to `lease` (deleted when the lease ends).
    /// Fails with [`MetaError::LeaseNotFound`] if the lease has expired or was revoked.
    fn put_with_lease<'a>(&'a self, key: &'a str, value: &'a [u8], lease: LeaseId) -> MetaFuture<'a, Revision>;

    /// Reads `key`; `None` if absent.
    fn get<'a>(&'a self, key: &'a str) -> MetaFuture<'a, Option<KeyValue>>;

    /// All keys starting with `prefix`, sorted by key, and the revision they were read at.
    fn get_prefix<'a>(&'a self, prefix: &'a str) -> MetaFuture<'a, Listing>;

    /// Deletes `key`; `true` if it existed.
    fn delete<'a>(&'a self, key: &'a str) -> MetaFuture<'a, bool>;

    /// Writes `key` (attached to `lease` if given) only if every condition holds, atomically.
    /// `Some(revision)` when written, `None` when a condition failed (for a leader fenced with
    /// [`Condition::leader`]: it is no longer leader and must step down).
    fn put_if<'a>(
        &'a self,
        key: &'a str,
        value: &'a [u8],
        lease: Option<LeaseId>,
        conditions: &'a [Condition],
    ) -> MetaFuture<'a, Option<Revision>>;

    /// Deletes `key` only if every condition holds. `Some(revision)` (the store revision after
    /// the operation) when the conditions held, whether or not the key existed; `None` if refused.
    fn delete_if<'a>(&'a self, key: &'a str, conditions: &'a [Condition]) -> MetaFuture<'a, Option<Revision>>;

    /// Grants a lease. etcd counts TTLs in whole seconds (rounded up here) and raises very
    /// short ones to its minimum (about 2 s on etcd 3.4); [`MemStore`] honours any TTL.
    fn grant_lease(&self, ttl: Duration) -> MetaFuture<'_, LeaseId>;

    /// Refreshes `lease` once; returns the TTL it now has.
    /// [`MetaError::LeaseNotFound`] if it already expired or was revoked.
    fn keep_alive(&self, lease: LeaseId) -> MetaFuture<'_, Duration>;

    /// Ends `lease` now, deleting its keys. [`MetaError::LeaseNotFound`] if it had already ended.
    fn revoke(&self, lease: LeaseId) -> MetaFuture<'_, ()>;

    /// Changes under `prefix`, in revision order. `from_revision: None` streams changes made
    /// after this call returns; `Some(r)` first replays the retained history from revision `r`
    /// ([`MetaError::Compacted`] if that history is gone).
    fn watch_prefix<'a>(
        &'a self,
        prefix: &'a str,
        from_revision: Option<Revision>,
    ) -> MetaFuture<'a, MetaStream<WatchEvent>>;

    /// Campaigns in election `name` with `value`, the candidate's key attached to `lease`;
    /// resolves once this candidate is leader (the live candidate with the lowest create
    /// revision). Dropping the future withdraws the candidacy.
    fn campaign<'a>(&'a self, name: &'a str, value: &'a [u8], lease: LeaseId) -> MetaFuture<'a, LeaderKey>;

    /// The current leader's value, then each new leader's value (or new value) as it changes.
    /// Nothing is emitted while there is no leader.
    fn observe<'a>(&'a self, name: &'a str) -> MetaFuture<'a, MetaStream<Vec<u8>>>;

    /// Gives up leadership (deletes the election key if it is still the one won with).
    fn resign<'a>(&'a self, leader: &'a LeaderKey) -> MetaFuture<'a, ()>;

    /// The current leader's value, `None` if nobody is leader.
    fn leader<'a>(&'a self, name: &'a str) -> MetaFuture<'a, Option<Vec<u8>>>;
}

/// The prefix under which election `name` keeps its candidates' keys (etcd's layout).
pub(crate) fn election_prefix(name: &str) -> String {
    format!("{name}/")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(create: i64, modr: i64) -> KeyValue {
        KeyValue {
            key: "k".into(),
            value: vec![],
            create_revision: Revision(create),
            mod_revision: Revision(modr),
            lease: None,
        }
    }

    #[test]
    fn condition_table() {
        let leader = LeaderKey { name: "e".into(), key: "e/1".into(), create_revision: Revision(5), lease: LeaseId(1) };
        // (condition, stored key, expected)
        let table: Vec<(Condition, Option<KeyValue>, bool)> = vec![
            (Condition::absent("k"), None, true),
            (Condition::absent("k"), Some(kv(2, 2)), false),
            (Condition::mod_revision("k", Revision(3)), Some(kv(2, 3)), true),
            (Condition::mod_revision("k", Revision(3)), Some(kv(2, 4)), false),
            (Condition::mod_revision("k", Revision(3)), None, false),
            (Condition::leader(&leader), Some(kv(5, 9)), true),
            // Re-created key (a new term) has another create revision: fenced.
            (Condition::leader(&leader), Some(kv(7, 7)), false),
            (Condition::leader(&leader), None, false),
        ];
        for (i, (cond, stored, expected)) in table.iter().enumerate() {
            assert_eq!(cond.holds(stored.as_ref()), *expected, "row {i}: {cond:?}");
        }
        assert_eq!(Condition::leader(&leader).key(), "e/1");
    }
}
