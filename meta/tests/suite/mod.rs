//! The behavioural suite every `MetaStore` must pass, written once and run against `MemStore`
//! (`tests/mem.rs`) and a real etcd (`tests/etcd.rs`). Each case works under its own key
//! namespace so the cases can run concurrently against one store. Waits are polls with a
//! deadline, never fixed sleeps that hope something happened.

#![allow(dead_code)]

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use kvfleet_meta::{spawn_keep_alive, Condition, EventKind, LeaseId, MetaError, MetaStore, MetaStream, WatchEvent};
use tokio::time::Instant;
use tokio_stream::StreamExt;

pub struct SuiteOpts {
    /// A lease TTL short enough to wait out (etcd raises anything under ~2 s to its minimum).
    pub short_ttl: Duration,
    /// How long to wait for a lease expiry or an election hand-over before failing.
    pub patience: Duration,
}

/// Runs every case concurrently, each under `{ns}/{case}/`.
pub async fn run_all(store: Arc<dyn MetaStore>, ns: &str, opts: &SuiteOpts) {
    tokio::join!(
        kv_revisions(store.clone(), format!("{ns}/kv/")),
        conditional_writes(store.clone(), format!("{ns}/cas/")),
        fencing_by_leader_key(store.clone(), format!("{ns}/fence/")),
        lease_expiry_and_revoke(store.clone(), format!("{ns}/lease/"), opts),
        keep_alive_helper(store.clone(), format!("{ns}/keeper/"), opts),
        watch_in_order_from_revision(store.clone(), format!("{ns}/watch/")),
        election_hand_over(store.clone(), format!("{ns}/election"), opts),
    );
}

/// Awaits `fut` or fails the test naming `what`.
pub async fn within<T>(limit: Duration, what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, fut).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {limit:?} waiting for {what}"),
    }
}

async fn next_event(w: &mut MetaStream<WatchEvent>, what: &str) -> WatchEvent {
    match within(Duration::from_secs(5), what, w.next()).await {
        Some(Ok(ev)) => ev,
        Some(Err(e)) => panic!("{what}: watch error {e}"),
        None => panic!("{what}: watch ended"),
    }
}

async fn next_leader(o: &mut MetaStream<Vec<u8>>, limit: Duration, what: &str) -> Vec<u8> {
    match within(limit, what, o.next()).await {
        Some(Ok(v)) => v,
        Some(Err(e)) => panic!("{what}: observe error {e}"),
        None => panic!("{what}: observe ended"),
    }
}

pub async fn kv_revisions(store: Arc<dyn MetaStore>, ns: String) {
    let (a, b) = (format!("{ns}a"), format!("{ns}b"));
    let r1 = store.put(&a, b"1").await.unwrap();
    let r2 = store.put(&a, b"2").await.unwrap();
    assert!(r2 > r1, "revisions must grow: {r1:?} then {r2:?}");
    let kv = store.get(&a).await.unwrap().expect("a was just written");
    assert_eq!(kv.value, b"2");
    assert_eq!((kv.create_revision, kv.mod_revision), (r1, r2));
    assert_eq!(kv.lease, None);
    let rb = store.put(&b, b"x").await.unwrap();
    // A key outside the namespace that shares its text as a prefix must not leak in.
    store.put(&format!("{}x", ns.trim_end_matches('/')), b"outside").await.unwrap();

    let listing = store.get_prefix(&ns).await.unwrap();
    let keys: Vec<_> = listing.kvs.iter().map(|kv| kv.key.as_str()).collect();
    assert_eq!(keys, [a.as_str(), b.as_str()]);
    assert!(listing.revision >= rb, "listing revision {:?} before last write {rb:?}", listing.revision);

    assert!(store.delete(&a).await.unwrap());
    assert!(!store.delete(&a).await.unwrap(), "second delete must report absence");
    assert_eq!(store.get(&a).await.unwrap(), None);
    let r3 = store.put(&a, b"3").await.unwrap();
    assert_eq!(
        store.get(&a).await.unwrap().unwrap().create_revision,
        r3,
        "a re-created key must get a new create revision"
    );
    assert_eq!(store.get(&format!("{ns}missing")).await.unwrap(), None);
}

pub async fn conditional_writes(store: Arc<dyn MetaStore>, ns: String) {
    let k = format!("{ns}owner/17");
    let r1 = store.put_if(&k, b"inst-1", None, &[Condition::absent(&k)]).await.unwrap().expect("absent key");
    assert_eq!(store.put_if(&k, b"inst-2", None, &[Condition::absent(&k)]).await.unwrap(), None);
    assert_eq!(store.get(&k).await.unwrap().unwrap().value, b"inst-1", "refused write changed the value");

    let r2 = store
        .put_if(&k, b"inst-2", None, &[Condition::mod_revision(&k, r1)])
        .await
        .unwrap()
        .expect("CAS at current revision");
    assert!(r2 > r1);
    assert_eq!(store.put_if(&k, b"inst-3", None, &[Condition::mod_revision(&k, r1)]).await.unwrap(), None, "stale CAS");

    // All conditions must hold.
    let other = format!("{ns}other");
    let both = [Condition::mod_revision(&k, r2), Condition::absent(&other)];
    store.put(&other, b"x").await.unwrap();
    assert_eq!(store.put_if(&k, b"inst-4", None, &both).await.unwrap(), None);
    store.delete(&other).await.unwrap();
    assert!(store.put_if(&k, b"inst-4", None, &both).await.unwrap().is_some());

    let cur = store.get(&k).await.unwrap().unwrap().mod_revision;
    assert_eq!(store.delete_if(&k, &[Condition::mod_revision(&k, r1)]).await.unwrap(), None);
    assert!(store.get(&k).await.unwrap().is_some(), "refused delete removed the key");
    assert!(store.delete_if(&k, &[Condition::mod_revision(&k, cur)]).await.unwrap().is_some());
    assert_eq!(store.get(&k).await.unwrap(), None);

    // A lease on a conditional write: the key goes with the lease.
    let lease = store.grant_lease(Duration::from_secs(30)).await.unwrap();
    let w = format!("{ns}workers/1");
    store.put_if(&w, b"addr", Some(lease), &[Condition::absent(&w)]).await.unwrap().expect("absent");
    assert_eq!(store.get(&w).await.unwrap().unwrap().lease, Some(lease));
    store.revoke(lease).await.unwrap();
    assert_eq!(store.get(&w).await.unwrap(), None);
}

pub async fn fencing_by_leader_key(store: Arc<dyn MetaStore>, ns: String) {
    let election = format!("{ns}election");
    let owner = format!("{ns}owner/1");
    let lease = store.grant_lease(Duration::from_secs(30)).await.unwrap();
    let term1 = store.campaign(&election, b"coord-a", lease).await.unwrap();
    assert!(term1.key.starts_with(&format!("{election}/")), "{term1:?}");
    assert_eq!(term1.lease, lease);
    assert!(store.put_if(&owner, b"i0", None, &[Condition::leader(&term1)]).await.unwrap().is_some());

    store.resign(&term1).await.unwrap();
    assert_eq!(
        store.put_if(&owner, b"i1", None, &[Condition::leader(&term1)]).await.unwrap(),
        None,
        "resigned leader wrote"
    );
    assert_eq!(store.delete_if(&owner, &[Condition::leader(&term1)]).await.unwrap(), None);
    assert_eq!(store.get(&owner).await.unwrap().unwrap().value, b"i0");

    // Winning again (same lease, same key text) is a new term: the old proof stays invalid.
    let term2 = store.campaign(&election, b"coord-a", lease).await.unwrap();
    assert!(term2.create_revision > term1.create_revision);
    assert_eq!(store.put_if(&owner, b"i2", None, &[Condition::leader(&term1)]).await.unwrap(), None);
    assert!(store.put_if(&owner, b"i2", None, &[Condition::leader(&term2)]).await.unwrap().is_some());

    // Lease loss deletes the election key: fenced.
    store.revoke(lease).await.unwrap();
    assert_eq!(store.put_if(&owner, b"i3", None, &[Condition::leader(&term2)]).await.unwrap(), None);
    assert_eq!(store.get(&owner).await.unwrap().unwrap().value, b"i2");
    assert_eq!(store.leader(&election).await.unwrap(), None);
}

pub async fn lease_expiry_and_revoke(store: Arc<dyn MetaStore>, ns: String, opts: &SuiteOpts) {
    let lease = store.grant_lease(opts.short_ttl).await.unwrap();
    let ttl = store.keep_alive(lease).await.unwrap();
    assert!(ttl >= opts.short_ttl.min(Duration::from_secs(1)), "granted TTL {ttl:?}");
    let granted_at = Instant::now();
    for i in 0..2 {
        store.put_with_lease(&format!("{ns}short/{i}"), b"v", lease).await.unwrap();
    }
    store.put(&format!("{ns}short-unleased"), b"v").await.unwrap();
    let deadline = granted_at + opts.patience;
    loop {
        if store.get_prefix(&format!("{ns}short/")).await.unwrap().kvs.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "leased keys still present after {:?}", opts.patience);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(granted_at.elapsed() >= opts.short_ttl.mul_f32(0.9), "expired early: {:?}", granted_at.elapsed());
    assert!(store.get(&format!("{ns}short-unleased")).await.unwrap().is_some());
    assert!(matches!(store.keep_alive(lease).await, Err(MetaError::LeaseNotFound(l)) if l == lease));
    assert!(matches!(store.put_with_lease(&format!("{ns}late"), b"v", lease).await, Err(MetaError::LeaseNotFound(_))));

    let long = store.grant_lease(Duration::from_secs(30)).await.unwrap();
    store.put_with_lease(&format!("{ns}long/0"), b"v", long).await.unwrap();
    store.revoke(long).await.unwrap();
    assert_eq!(store.get(&format!("{ns}long/0")).await.unwrap(), None, "revoke must delete at once");
    assert!(matches!(store.revoke(long).await, Err(MetaError::LeaseNotFound(_))));
    assert!(matches!(store.revoke(LeaseId(0x7eed_beef)).await, Err(MetaError::LeaseNotFound(_))));
}

pub async fn keep_alive_helper(store: Arc<dyn MetaStore>, ns: String, opts: &SuiteOpts) {
    let lease = store.grant_lease(opts.short_ttl).await.unwrap();
    let key = format!("{ns}registered");
    store.put_with_lease(&key, b"w", lease).await.unwrap();
    let keeper = spawn_keep_alive(store.clone(), lease, opts.short_ttl);
    // Outlive the TTL a few times over (etcd: its minimum TTL, which may exceed short_ttl).
    let ttl = store.keep_alive(lease).await.unwrap().max(opts.short_ttl);
    tokio::time::sleep(ttl * 2).await;
    assert!(!keeper.is_lost(), "keeper reported loss of a live lease");
    assert!(store.get(&key).await.unwrap().is_some(), "kept-alive key expired");
    store.revoke(lease).await.unwrap();
    let reason = within(ttl * 2, "lease loss report", keeper.lost()).await;
    assert!(reason.contains("expired or was revoked"), "{reason}");
}

pub async fn watch_in_order_from_revision(store: Arc<dyn MetaStore>, ns: String) {
    let (a, b, c) = (format!("{ns}a"), format!("{ns}b"), format!("{ns}c"));
    let r1 = store.put(&a, b"1").await.unwrap();
    let r2 = store.put(&b, b"2").await.unwrap();
    assert!(store.delete(&a).await.unwrap());
    store.put(&format!("{}-elsewhere", ns.trim_end_matches('/')), b"x").await.unwrap();

    let mut from = store.watch_prefix(&ns, Some(r1)).await.unwrap();
    let mut live = store.watch_prefix(&ns, None).await.unwrap();
    let e1 = next_event(&mut from, "replayed put a").await;
    assert_eq!(
        (e1.kind, e1.key.as_str(), e1.value.as_slice(), e1.revision),
        (EventKind::Put, a.as_str(), &b"1"[..], r1)
    );
    let e2 = next_event(&mut from, "replayed put b").await;
    assert_eq!((e2.kind, e2.key.as_str(), e2.revision), (EventKind::Put, b.as_str(), r2));
    let e3 = next_event(&mut from, "replayed delete a").await;
    assert_eq!((e3.kind, e3.key.as_str()), (EventKind::Delete, a.as_str()));
    assert!(e3.revision > r2 && e3.value.is_empty(), "{e3:?}");

    let r4 = store.put(&c, b"4").await.unwrap();
    for (w, name) in [(&mut from, "replaying"), (&mut live, "live")] {
        let e = next_event(w, name).await;
        assert_eq!((e.kind, e.key.as_str(), e.revision), (EventKind::Put, c.as_str(), r4), "{name} watch");
    }
    // Nothing else is pending on the live watch (it started after the earlier writes).
    let extra = tokio::time::timeout(Duration::from_millis(100), live.next()).await;
    assert!(extra.is_err(), "unexpected event on live watch: {extra:?}");
}

pub async fn election_hand_over(store: Arc<dyn MetaStore>, election: String, opts: &SuiteOpts) {
    assert_eq!(store.leader(&election).await.unwrap(), None);
    let mut observe = store.observe(&election).await.unwrap();
    let la = store.grant_lease(Duration::from_secs(30)).await.unwrap();
    let lb = store.grant_lease(Duration::from_secs(30)).await.unwrap();

    let a = store.campaign(&election, b"A", la).await.unwrap();
    assert_eq!(store.leader(&election).await.unwrap().as_deref(), Some(&b"A"[..]));
    assert_eq!(next_leader(&mut observe, opts.patience, "A elected").await, b"A");

    let s = store.clone();
    let name = election.clone();
    let mut b_task = tokio::spawn(async move { s.campaign(&name, b"B", lb).await });
    // B must stay blocked while A leads.
    let early = tokio::time::timeout(Duration::from_millis(300), &mut b_task).await;
    assert!(early.is_err(), "second candidate won while the first still led: {early:?}");
    assert_eq!(store.leader(&election).await.unwrap().as_deref(), Some(&b"A"[..]));

    store.resign(&a).await.unwrap();
    let b = within(opts.patience, "B to win after A resigned", b_task).await.unwrap().unwrap();
    assert!(b.create_revision > a.create_revision);
    assert_eq!(store.leader(&election).await.unwrap().as_deref(), Some(&b"B"[..]));
    assert_eq!(next_leader(&mut observe, opts.patience, "B after resign").await, b"B");

    // A campaigns again under a fresh lease, then B's lease is revoked (as if it lapsed).
    let la2 = store.grant_lease(Duration::from_secs(30)).await.unwrap();
    let s = store.clone();
    let name = election.clone();
    let mut a_task = tokio::spawn(async move { s.campaign(&name, b"A2", la2).await });
    let early = tokio::time::timeout(Duration::from_millis(300), &mut a_task).await;
    assert!(early.is_err(), "A won while B still led: {early:?}");
    store.revoke(lb).await.unwrap();
    let a2 = within(opts.patience, "A to win after B's lease ended", a_task).await.unwrap().unwrap();
    assert!(a2.create_revision > b.create_revision);
    assert_eq!(next_leader(&mut observe, opts.patience, "A2 after B's lease").await, b"A2");
    assert_eq!(store.leader(&election).await.unwrap().as_deref(), Some(&b"A2"[..]));

    store.resign(&a2).await.unwrap();
    let _ = store.revoke(la).await;
    let _ = store.revoke(la2).await;
    assert_eq!(store.leader(&election).await.unwrap(), None);
}
