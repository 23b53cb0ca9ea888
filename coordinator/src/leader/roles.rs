//! Prefill/decode disaggregation in the leader: the roles the controller gives instances
//! ([`Action::SetRole`]) are written fenced to the store (`/kvfleet/roles/<instance>`) before the
//! worker is told, in the order they were decided; a new leader reads them back. A worker's
//! `PrefillDone` becomes the controller's [`Event::PrefillDone`]; its `Release` and handoff moves
//! are carried out like any other decision. The decisions themselves are the controller's.

use super::{json, Leader, LeaderError, SETTLE_CALL_TIMEOUT};
use kvfleet_control::roles::{PdConfig, PdPolicy};
use kvfleet_control::{ArrowProfile, Controller, Event, Role};
use kvfleet_core::{InstanceId, RequestId};
use kvfleet_meta::layout as keys;
use kvfleet_proto::v1;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// How a leader disaggregates prefill and decode: the split, and for Arrow its profile of the
/// instances (measured from the timing model the workers run).
#[derive(Clone, Debug, Default)]
pub struct PdSetup {
    /// `[pd]`: the initial split and the policy (off: every instance does both).
    pub config: PdConfig,
    /// Arrow's profile (`config.policy = "arrow"`).
    pub arrow_profile: Option<ArrowProfile>,
    /// Arrow's profile of the initial decode pool, where its instances span another
    /// tensor-parallel degree ([`Controller::set_decode_pool_profile`]).
    pub decode_profile: Option<ArrowProfile>,
}

impl PdSetup {
    /// Let `control` disaggregate as this says; an Arrow setup without a profile is refused.
    pub fn apply(&self, control: &mut Controller) -> Result<(), String> {
        control.split_prefill_decode(&self.config);
        if self.config.policy == PdPolicy::Arrow {
            let profile = self.arrow_profile.ok_or("[pd] policy = \"arrow\" needs Arrow's profile")?;
            control.use_arrow(self.config.arrow, profile).map_err(|e| e.to_string())?;
            if let Some(p) = self.decode_profile {
                control.set_decode_pool_profile(p).map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    }
}

/// What the leader keeps of roles: the last one each instance was given, the changes since the
/// first, and the requests whose handoff is open (announced, not yet moved or released).
#[derive(Default)]
pub(super) struct RoleBook {
    given: Mutex<BTreeMap<InstanceId, Role>>,
    changes: Mutex<Vec<v1::RoleChange>>,
    /// Open handoffs, each with whether its move was decided while the prefill ran.
    handoffs: Mutex<HashMap<RequestId, bool>>,
    /// Role decisions in the order made, for the task that stores and sends them.
    queue: Mutex<Option<mpsc::UnboundedSender<(InstanceId, Role)>>>,
}

/// How a handoff ended, as stored for the next leader (`/kvfleet/handoffs/<id>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HandoffEnd {
    /// Moved to a decoder after its prefill.
    Moved,
    /// Moved to a decoder, the move decided while the prefill ran.
    Overlapped,
    /// Decoded where it was prefilled.
    Released,
}

impl HandoffEnd {
    fn as_str(self) -> &'static str {
        match self {
            HandoffEnd::Moved => "moved",
            HandoffEnd::Overlapped => "overlapped",
            HandoffEnd::Released => "released",
        }
    }

    fn parse(s: &str) -> Option<HandoffEnd> {
        [HandoffEnd::Moved, HandoffEnd::Overlapped, HandoffEnd::Released].into_iter().find(|h| h.as_str() == s)
    }
}

/// A role change as stored for the next leader.
#[derive(serde::Serialize, serde::Deserialize)]
struct StoredChange {
    at_ns: u64,
    instance: u32,
    role: Role,
}

impl From<StoredChange> for v1::RoleChange {
    fn from(c: StoredChange) -> v1::RoleChange {
        v1::RoleChange { at_ns: c.at_ns, instance: c.instance, role: c.role.to_string() }
    }
}

impl RoleBook {
    pub(super) fn changes(&self) -> Vec<v1::RoleChange> {
        self.changes.lock().expect("role changes lock").clone()
    }
}

impl Leader {
    /// Carry out [`Action::SetRole`](kvfleet_control::Action::SetRole): queued for
    /// [`Leader::apply_roles`], so that roles reach the store and the workers in the order they
    /// were decided.
    pub(super) fn set_role(self: &Arc<Self>, instance: InstanceId, role: Role) {
        let mut queue = self.roles.queue.lock().expect("role queue lock");
        let tx = queue.get_or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(self.clone().apply_roles(rx));
            tx
        });
        let _ = tx.send((instance, role));
    }

    /// Store each role fenced, then tell its worker (a worker not linked yet is told when it
    /// joins: the controller gives a joining instance its role again). Ends when deposed.
    async fn apply_roles(self: Arc<Self>, mut rx: mpsc::UnboundedReceiver<(InstanceId, Role)>) {
        let mut deposed = self.deposed.clone();
        loop {
            let (instance, role) = tokio::select! {
                next = rx.recv() => match next {
                    Some(next) => next,
                    None => return,
                },
                _ = deposed.changed() => return,
            };
            if let Err(e) = self.persist(&keys::role(instance.0), &json(&role)).await {
                tracing::error!(instance = instance.0, %role, "role not stored, so not applied: {e}");
                if self.is_deposed() {
                    return;
                }
                continue;
            }
            let before = self.roles.given.lock().expect("roles lock").insert(instance, role);
            if let Some(before) = before.filter(|&b| b != role) {
                let at_ns = self.cluster_now().0;
                let change = StoredChange { at_ns, instance: instance.0, role };
                // Kept for the next leader's report of the run's flips.
                if let Err(e) = self.persist(&keys::role_change(at_ns, instance.0), &json(&change)).await {
                    tracing::warn!(instance = instance.0, "role change not recorded: {e}");
                }
                self.roles.changes.lock().expect("role changes lock").push(change.into());
                tracing::info!(instance = instance.0, from = %before, to = %role, "role flipped");
            }
            let Some(mut client) = self.client(instance) else { continue };
            let req = v1::SetRoleRequest { role: role.to_string(), hand_off: role.hands_off() };
            match tokio::time::timeout(SETTLE_CALL_TIMEOUT, client.set_role(req)).await {
                Ok(Ok(r)) => tracing::debug!(instance = instance.0, %role, held = r.get_ref().held, "role set"),
                Ok(Err(e)) => tracing::warn!(instance = instance.0, %role, "setting the role failed: {e}"),
                Err(_) => tracing::warn!(instance = instance.0, %role, "setting the role timed out"),
            }
        }
    }

    /// Read back the roles a previous leader stored (before any worker joins this one): the
    /// controller keeps them, and tells each worker its role again as it joins.
    pub(super) async fn restore_roles(&self) -> Result<usize, LeaderError> {
        let stored = self.store.get_prefix(keys::ROLES).await?;
        let changes = self.store.get_prefix(keys::ROLE_CHANGES).await?;
        let mut n = 0;
        let mut control = self.control();
        for kv in stored.kvs {
            let instance = kv.key.trim_start_matches(keys::ROLES).parse::<u32>();
            let role = serde_json::from_slice::<Role>(&kv.value);
            let (Ok(instance), Ok(role)) = (instance, role) else {
                tracing::error!(key = %kv.key, "unreadable role record; skipped");
                continue;
            };
            control.set_role(InstanceId(instance), role);
            self.roles.given.lock().expect("roles lock").insert(InstanceId(instance), role);
            n += 1;
        }
        let mut book = self.roles.changes.lock().expect("role changes lock");
        for kv in changes.kvs {
            match serde_json::from_slice::<StoredChange>(&kv.value) {
                Ok(c) => book.push(c.into()),
                Err(e) => tracing::error!(key = %kv.key, "unreadable role change; skipped: {e}"),
            }
        }
        Ok(n)
    }

    /// A worker's request finished its prefill and is held there: the controller hands it off.
    pub(super) fn on_prefill_done(self: &Arc<Self>, p: v1::PrefillDone) {
        let request = RequestId(p.request_id);
        tracing::debug!(target: "kvfleet::moves", request = request.0, at_ns = p.at_ns, heard_ns = self.cluster_now().0, "prefill done heard");
        let event = Event::PrefillDone { request, instance: InstanceId(p.instance), kv_blocks: p.kv_blocks };
        let Ok(actions) = self.decide(event) else { return };
        self.roles.handoffs.lock().expect("handoffs lock").entry(request).or_insert(false);
        self.act(actions);
    }

    /// A worker's request wrote the first chunk of its prefill: with overlap on, the controller
    /// may hand it off now (the move follows the prefill).
    pub(super) fn on_prefill_started(self: &Arc<Self>, p: v1::PrefillStarted) {
        let request = RequestId(p.request_id);
        let event = Event::PrefillStarted { request, instance: InstanceId(p.instance), kv_blocks: p.kv_blocks };
        let Ok(actions) = self.decide(event) else { return };
        if actions.iter().any(|a| matches!(a, kvfleet_control::Action::Migrate { request: r, .. } if *r == request)) {
            self.roles.handoffs.lock().expect("handoffs lock").insert(request, true);
        }
        self.act(actions);
    }

    /// A move of `request` committed: counted as a handoff when it was one (and stored, for the
    /// next leader's count).
    pub(super) fn handed_off(self: &Arc<Self>, request: RequestId) {
        let Some(overlapped) = self.roles.handoffs.lock().expect("handoffs lock").remove(&request) else { return };
        self.stats.handoffs.fetch_add(1, Ordering::Relaxed);
        if overlapped {
            self.stats.handoffs_overlapped.fetch_add(1, Ordering::Relaxed);
        }
        let how = if overlapped { HandoffEnd::Overlapped } else { HandoffEnd::Moved };
        let me = Arc::clone(self);
        tokio::spawn(async move { me.record_handoff(request, how).await });
    }

    /// A handoff a previous leader started landed (its move settled by this one): counted and
    /// stored as moved.
    pub(super) fn inherited_handoff(self: &Arc<Self>, request: RequestId) {
        self.roles.handoffs.lock().expect("handoffs lock").insert(request, false);
        self.handed_off(request);
    }

    /// Store how `request`'s handoff ended for the next leader.
    async fn record_handoff(&self, request: RequestId, how: HandoffEnd) {
        if let Err(e) = self.persist(&keys::handoff(request.0), how.as_str().as_bytes()).await {
            tracing::warn!(request = request.0, "handoff not recorded for the next leader: {e}");
        }
    }

    /// Count the handoffs the previous leaders settled (restoring a run's report).
    pub(super) async fn restore_handoffs(&self) -> Result<(), LeaderError> {
        let stored = self.store.get_prefix(keys::HANDOFFS).await?;
        let (mut moved, mut overlapped, mut released) = (0, 0, 0);
        for kv in stored.kvs {
            match std::str::from_utf8(&kv.value).ok().and_then(HandoffEnd::parse) {
                Some(HandoffEnd::Moved) => moved += 1,
                Some(HandoffEnd::Overlapped) => {
                    moved += 1;
                    overlapped += 1;
                }
                Some(HandoffEnd::Released) => released += 1,
                None => tracing::error!(key = %kv.key, "unreadable handoff record; skipped"),
            }
        }
        self.stats.handoffs.store(moved, Ordering::Relaxed);
        self.stats.handoffs_overlapped.store(overlapped, Ordering::Relaxed);
        self.stats.handoffs_released.store(released, Ordering::Relaxed);
        Ok(())
    }

    /// Carry out [`Action::Release`](kvfleet_control::Action::Release): the request decodes where
    /// it was prefilled.
    pub(super) async fn release(self: Arc<Self>, request: RequestId, on: InstanceId) {
        let Some(mut client) = self.client(on) else { return };
        let req = v1::ReleaseRequest { request_id: request.0 };
        match tokio::time::timeout(SETTLE_CALL_TIMEOUT, client.release(req)).await {
            Ok(Ok(r)) if r.get_ref().released => {
                self.roles.handoffs.lock().expect("handoffs lock").remove(&request);
                self.stats.handoffs_released.fetch_add(1, Ordering::Relaxed);
                self.record_handoff(request, HandoffEnd::Released).await;
            }
            Ok(Ok(r)) => tracing::debug!(request = request.0, reason = %r.get_ref().reason, "not released"),
            Ok(Err(e)) => tracing::warn!(request = request.0, instance = on.0, "release failed: {e}"),
            Err(_) => tracing::warn!(request = request.0, instance = on.0, "release timed out"),
        }
    }

    /// Run the controller's timed passes (Arrow's monitoring, Alg. 2; a refused push's next try)
    /// when it asks for them, until deposed. With none due it waits for a decision that makes one
    /// due, and a decision that brings one forward wakes it early.
    pub async fn run_ticks(self: Arc<Self>) {
        let mut deposed = self.deposed.clone();
        loop {
            let next = self.control().next_tick();
            let wait = next.map(|at| {
                let wait_ns = at.0.saturating_sub(self.cluster_now().0);
                Duration::from_nanos(self.clock.dilation.real_ns(wait_ns)).max(Duration::from_millis(1))
            });
            let due = async move {
                match wait {
                    Some(real) => tokio::time::sleep(real).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = due => {}
                () = self.tick_due.notified() => continue,
                _ = deposed.wait_for(|d| *d) => return,
            }
            if self.is_deposed() {
                return;
            }
            let Some(at) = next else { continue };
            // On the loads as of the pass's instant, as the simulator runs it: an iteration that
            // ended just before (a prefill, say) is reported a moment later.
            self.await_reports(at, None, None).await;
            let actions = self.decide(Event::Tick).unwrap_or_default();
            self.act(actions);
        }
    }
}
