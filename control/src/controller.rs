//! The cluster controller: events in, actions out.
//!
//! ```text
//! driver (sim event loop | coordinator leader)          Controller
//!   instance registered ─────── Event::Joined ─────────▶ membership, published load
//!   load report ─────────────── Event::Load ───────────▶ published load (charges it covers dropped)
//!   client request ──────────── Event::Arrival ────────▶ policy.place ─▶ Action::Place | Reject
//!   `</think>` ─────────────── Event::Boundary ───────▶ policy.on_phase_change ─▶ Action::Migrate
//!   move settled ────────────── Event::MigrationEnded ─▶ ownership; a refused move: next target
//!   instance gone ───────────── Event::Left ───────────▶ Action::Place (re-placed) for its requests,
//!                                                         Action::Settle for those it was moving out
//!   target answered ─────────── Event::Settled ────────▶ ownership, or Action::Place (re-placed)
//!   final record ────────────── Event::Finished ───────▶ ownership
//! ```
//!
//! Three rules live here and nowhere else:
//! - **Charge on decide.** A placement or a move counts in the target's published load at once,
//!   as the blocks the engine will take for it ([`LoadReport::blocks_for`], the engine's own
//!   arithmetic), until a report from that instance shows it (its [`LoadReport::admitted`]
//!   counter reaches the decision's) or [`CHARGE_TTL`] passes. Without it a burst of
//!   simultaneous arrivals all see the same least-loaded instance.
//! - **Fallback.** A policy that names an instance that is not live gets the least-loaded live
//!   instance for a placement, and "stay" for a move, with a log line; never a panic.
//! - **Ownership.** One record per request says where it runs; a phase event from an instance
//!   that does not own the request, or for a finished request, never moves it. A request whose
//!   instance left is re-placed, unless it was being moved out to a live target: that move may have
//!   committed (a lost COMMIT reply), so its target is asked first ([`Action::Settle`]); re-placing
//!   it at once could run it twice. A re-placement that found no live instance is retried when an
//!   instance joins.

use crate::ownership::{initial_phase, OwnedPhase, Ownership};
use crate::prefix::PrefixIndex;
use crate::roles::{HandoffMode, Role, PUSH_RETRY};
use kvfleet_core::kv::KvEvent;
use kvfleet_core::policy::cache_aware::{PlacementCosts, PrefixFetch};
use kvfleet_core::policy::{InstancePolicy, LoadReport, PhaseChange, PhaseDecision};
use kvfleet_core::{InstanceId, RequestId, RequestSpec, SimRng, TimeSpan, Timestamp};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

mod pd;
pub use pd::{ArrowProfile, DECODE_PROFILE_CONTEXT};
use pd::{Decided, Handoff};

/// Other targets tried after a target declined a move for lack of room.
pub const MAX_RETARGETS: usize = 2;

/// Handoffs of one request that may end without committing (aborted, or refused by every decode
/// instance asked) before it decodes where it was prefilled instead.
pub const MAX_HANDOFF_FAILURES: u32 = 8;
/// Handoffs of a request whose bytes failed their checksum at the target ([`MoveOutcome::Corrupt`])
/// before its KV is computed again elsewhere: the first is retried on another decoder, the second
/// re-prefills it ([`Action::Drop`] of the held copy, [`Action::Place`] on another instance).
pub const MAX_CORRUPT_HANDOFFS: u32 = 2;

/// Free blocks a decode instance must have beyond a handoff's KV to be asked to take it.
pub const HANDOFF_HEADROOM_BLOCKS: u32 = 16;

/// How long a decision counts in its target's published load when no report shows it (a submit
/// that never arrived, a worker that restarted and counts from zero again).
pub const CHARGE_TTL: TimeSpan = TimeSpan(2_000_000_000);

/// What happened in the cluster.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Event {
    /// An instance (re)joined. `address` is a label for status displays.
    Joined {
        /// The instance.
        instance: InstanceId,
        /// Where it listens (shown in status; the controller never connects).
        address: String,
        /// The model it serves and its KV bytes per token (checked against the cluster's).
        model: String,
        /// KV bytes per token of `model` on that instance.
        kv_bytes_per_token: u64,
    },
    /// An instance is gone: its unfinished requests start over elsewhere.
    Left {
        /// The instance.
        instance: InstanceId,
    },
    /// An instance published its load (a silent instance, [`Event::Heard`], is heard again).
    Load(LoadReport),
    /// When the driver last heard from each instance (any message, not only load reports), for
    /// the [`Silence`] rule: an instance quiet for `silent_after` looked idle, so it would draw
    /// every placement; until it is heard again no request is placed on it and no move goes to
    /// it, and what it holds stays. Quiet for `abandon_after` (registered, but nobody can reach
    /// it), it is given up as if it left and expelled ([`Action::Expel`]): its requests are
    /// re-placed. Heard again all the same (a driver that could not expel it), it is back, as an
    /// empty instance. Without a rule ([`Controller::watch_silence`]) only
    /// the times are noted.
    Heard {
        /// (instance, last heard from) pairs; unknown instances are ignored.
        heard: Vec<(InstanceId, Timestamp)>,
    },
    /// A client submitted a request.
    Arrival(RequestSpec),
    /// A request produced its last reasoning token on `instance`.
    Boundary {
        /// The request.
        request: RequestId,
        /// Where it crossed the boundary.
        instance: InstanceId,
        /// KV it holds now, in blocks.
        kv_blocks: u32,
    },
    /// On a prefill instance ([`Role::Prefill`]) the request's prefill started: with
    /// [`Overlap::Chunk`](crate::roles::Overlap::Chunk) its first chunk was written and more
    /// follow, with [`Overlap::Layer`](crate::roles::Overlap::Layer) its first iteration began.
    /// Its handoff is decided now, and the move follows the prefill (ignored without overlap).
    PrefillStarted {
        /// The request.
        request: RequestId,
        /// Where it is prefilled.
        instance: InstanceId,
        /// KV it will hold at the prefill's end, in blocks (what the handoff moves).
        kv_blocks: u32,
    },
    /// On a prefill instance ([`Role::Prefill`]) the request's prefill produced its first token;
    /// it is held there, KV in place, for its handoff to a decode instance.
    PrefillDone {
        /// The request.
        request: RequestId,
        /// Where it was prefilled.
        instance: InstanceId,
        /// KV it holds, in blocks (what the handoff moves).
        kv_blocks: u32,
    },
    /// A move decided by [`Action::Migrate`] ended. The end of a move superseded meanwhile (its
    /// request re-placed, or the move settled otherwise, before its driver heard back from the
    /// source) is ignored: it says nothing about the request's copy now.
    MigrationEnded {
        /// The request.
        request: RequestId,
        /// The move's source, as in its [`Action::Migrate`].
        from: InstanceId,
        /// The move's target, as in its [`Action::Migrate`].
        to: InstanceId,
        /// How it ended.
        outcome: MoveOutcome,
    },
    /// The request's copy is lost (its instance failed it, or both ends of a move did): start it
    /// over on a live instance.
    Lost {
        /// The request.
        request: RequestId,
    },
    /// The target of a move whose source left ([`Action::Settle`]) answered whether it holds the
    /// request (from then on it refuses a late COMMIT). An answer for a move settled otherwise
    /// meanwhile is ignored.
    Settled {
        /// The request.
        request: RequestId,
        /// The move's source, as in its [`Action::Settle`].
        from: InstanceId,
        /// The move's target, as in its [`Action::Settle`].
        to: InstanceId,
        /// Whether the target holds it (the move committed).
        held: bool,
    },
    /// A final record for the request (finished or rejected by its instance), before it is
    /// stored: `Ok` means it is the one to store and deliver. A record from an instance that no
    /// longer owns the request (a paused worker's late copy of a request re-placed meanwhile, an
    /// old incarnation's) is [`ControlError::NotOwner`]: the stored result is always the owner's.
    Finished {
        /// The request.
        request: RequestId,
        /// The instance whose record it is; `None` for the driver's own (a placement it could not
        /// complete).
        from: Option<InstanceId>,
    },
    /// The client gave up on the request (it disconnected): stop it where it runs
    /// ([`Action::Cancel`]). During a move the cancel waits for the move to end, then goes to
    /// whichever end holds the request; a request whose only copy was lost is just forgotten.
    Cancelled {
        /// The request.
        request: RequestId,
    },
    /// What an instance's prefix cache stored and removed (for a prefix-aware policy's index;
    /// ignored otherwise).
    KvEvents {
        /// The instance.
        instance: InstanceId,
        /// Its cache changes, in order.
        events: Vec<KvEvent>,
    },
    /// Time passed: charges no report covered expire.
    Tick,
}

/// When a quiet instance stops drawing placements, and when it is given up ([`Event::Heard`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Silence {
    /// Quiet this long: no placement, no move goes to it.
    pub silent_after: TimeSpan,
    /// Quiet this long: its requests are re-placed.
    pub abandon_after: TimeSpan,
}

/// How a move ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoveOutcome {
    /// The request runs on the target.
    Committed,
    /// The request stays on its source.
    Aborted,
    /// The target declined before anything moved (no room): try the policy's next choice.
    Refused,
    /// Aborted because bytes the target received did not hash to the source's checksum: the
    /// request stays on its source. A handoff is tried once more, then its KV computed again
    /// elsewhere ([`MAX_CORRUPT_HANDOFFS`]).
    Corrupt,
    /// Neither end holds the request any more (the target refused it after the source had let it
    /// go, and handing it back failed): it starts over on a live instance.
    Lost,
}

/// What a driver must do.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// Run `request` on `on`; `replaced` > 0 when it starts over after losing its instance.
    Place {
        /// The request.
        request: RequestId,
        /// Where.
        on: InstanceId,
        /// Times it was re-placed so far (0 for a new request).
        replaced: u32,
        /// Prompt blocks to copy to `on` from another instance's prefix cache before the request
        /// starts there (a cache-aware placement; those the holder no longer has are computed).
        fetch: Option<PrefixFetch>,
    },
    /// The request cannot run.
    Reject {
        /// The request.
        request: RequestId,
        /// Why.
        reason: RejectReason,
    },
    /// Move `request` from `from` to `to` (its KV holds `kv_blocks` blocks); answer with
    /// [`Event::MigrationEnded`].
    Migrate {
        /// The request.
        request: RequestId,
        /// Its instance now.
        from: InstanceId,
        /// Where it goes.
        to: InstanceId,
        /// KV it holds, in blocks.
        kv_blocks: u32,
    },
    /// Stop `request` on `on` and free what it holds there: its client is gone
    /// ([`Event::Cancelled`]). The controller has forgotten the request; a record `on` sends
    /// anyway (it finished meanwhile) is [`ControlError::NotInFlight`].
    Cancel {
        /// The request.
        request: RequestId,
        /// Where it runs.
        on: InstanceId,
    },
    /// Free a copy of `request` that `on` holds but the cluster does not count: `on` lost it to a
    /// re-placement (evicted or given up while cut off or stopped) and announced it afterwards.
    /// Unlike [`Action::Cancel`] the request lives on elsewhere and may be placed on `on` again.
    Drop {
        /// The request.
        request: RequestId,
        /// The instance holding the stale copy.
        on: InstanceId,
    },
    /// Let `request`, held on prefill instance `on` after its prefill, decode there after all: no
    /// decode instance took it.
    Release {
        /// The request.
        request: RequestId,
        /// The prefill instance holding it.
        on: InstanceId,
    },
    /// Serve `role` on `instance` from now on (a prefill instance holds each request after its
    /// first token for a handoff; going back to decoding releases what it holds).
    SetRole {
        /// The instance.
        instance: InstanceId,
        /// Its role.
        role: Role,
    },
    /// `from` left while moving `request` out to `to`, which is live: the move may have committed.
    /// Ask `to` whether it holds the request (it refuses a late COMMIT from then on) and answer
    /// with [`Event::Settled`]: held, it runs there; not held, it is re-placed.
    Settle {
        /// The request.
        request: RequestId,
        /// The move's source, gone.
        from: InstanceId,
        /// The move's target, live.
        to: InstanceId,
    },
    /// `instance` was given up while still registered ([`Silence::abandon_after`]): its requests
    /// are re-placed, so its membership ends. The driver revokes its registration, so that the
    /// process, if it runs again, finds it lapsed and drops the copies the cluster re-placed
    /// before it registers again (it comes back through [`Event::Joined`]). A process that was
    /// only slow would otherwise go on running, moving and handing off requests the cluster
    /// placed elsewhere, or be given one of them again while it still held it.
    Expel {
        /// The instance.
        instance: InstanceId,
    },
}

/// Why a request cannot run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectReason {
    /// No live instance to place it on.
    NoInstance,
}

/// An event the controller cannot apply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    /// A joining instance serves another model than the cluster.
    #[error("worker {instance} serves model `{got}` ({got_bytes} KV bytes/token) but the cluster runs `{want}` ({want_bytes})")]
    ModelMismatch {
        /// The instance.
        instance: u32,
        /// Its model.
        got: String,
        /// Its KV bytes per token.
        got_bytes: u64,
        /// The cluster's model.
        want: String,
        /// The cluster's KV bytes per token.
        want_bytes: u64,
    },
    /// The request id is already known.
    #[error("request {0} is already known")]
    Duplicate(RequestId),
    /// The request is unknown or already finished.
    #[error("request {0} is not in flight")]
    NotInFlight(RequestId),
    /// A final record from an instance the request is not on (nor moving to).
    #[error("request {request} finished on instance {from}, but it belongs to instance {owner}: a late copy, refused")]
    NotOwner {
        /// The request.
        request: RequestId,
        /// The instance the record came from.
        from: InstanceId,
        /// The instance that owns the request.
        owner: InstanceId,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ChargeKind {
    /// A new (or re-placed) request in its reasoning phase.
    Reasoning,
    /// A new request without reasoning.
    Answering,
    /// An inbound move (the target reserves the KV at once).
    MoveIn,
}

#[derive(Clone, Debug)]
struct Charge {
    request: RequestId,
    kind: ChargeKind,
    blocks: u32,
    /// The tokens it brings: a prompt to prefill, or the KV of a move.
    tokens: u32,
    at: Timestamp,
    /// The instance's `admitted` counter once it has taken this one in.
    covered_at: u64,
}

#[derive(Debug)]
struct Instance {
    address: String,
    /// Its last report.
    base: LoadReport,
    charges: Vec<Charge>,
    alive: bool,
    role: Role,
    /// Not heard from lately ([`Event::Heard`]): out of `live` until it is heard again (or
    /// reports).
    silent: bool,
    /// Given up after a long silence ([`Event::Heard`]): not alive, its requests re-placed;
    /// heard again, it rejoins.
    abandoned: bool,
    /// Position in `Controller::live` while alive and not silent.
    live_slot: Option<usize>,
}

impl Instance {
    /// One not joined yet: no address, no report, no charges, [`Role::Mixed`].
    fn new(instance: InstanceId) -> Instance {
        Instance {
            address: String::new(),
            base: LoadReport { instance, answering_slo_ok: true, ..LoadReport::default() },
            charges: Vec::new(),
            alive: false,
            role: Role::Mixed,
            silent: false,
            abandoned: false,
            live_slot: None,
        }
    }

    /// The last report plus every decision it does not show yet.
    fn published(&self) -> LoadReport {
        let mut l = self.base.clone();
        for c in &self.charges {
            match c.kind {
                ChargeKind::Reasoning | ChargeKind::Answering => {
                    l.waiting_blocks = l.waiting_blocks.saturating_add(c.blocks);
                    l.waiting_requests += 1;
                    l.prefill_queue.add(c.tokens);
                }
                ChargeKind::MoveIn => {
                    l.gpu_used_blocks = l.gpu_used_blocks.saturating_add(c.blocks);
                    l.decode_context_tokens = l.decode_context_tokens.saturating_add(u64::from(c.tokens));
                }
            }
            if c.kind == ChargeKind::Reasoning {
                // PASCAL's high queue takes these blocks before any answering request.
                l.reasoning_demand_blocks = l.reasoning_demand_blocks.saturating_add(c.blocks);
                l.reasoning_requests += 1;
            } else {
                l.answering_requests += 1;
                l.fresh_answering_requests += 1;
            }
        }
        l
    }
}

/// A move in progress: what a retry after a refusal needs.
#[derive(Clone, Debug)]
struct Move {
    from: InstanceId,
    kv_blocks: u32,
    declined: Vec<InstanceId>,
    /// A prefill-to-decode handoff (else a move at `</think>`).
    handoff: bool,
    /// The request's phase once the move ends.
    after: OwnedPhase,
    /// Handoffs of this request that ended without committing since it was announced held.
    failed: u32,
}

/// Which end of a request's open move left the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Departed {
    /// Only its target knows whether the move committed: an abort reported from the source's
    /// side proves nothing, the target's answer ([`Event::Settled`]) decides.
    Source,
    /// The request stays on its source; had the move committed, the copy left with the target.
    Target,
}

/// The cluster controller. See the module documentation.
#[derive(Debug)]
pub struct Controller {
    policy: Box<dyn InstancePolicy>,
    rng: SimRng,
    model: Option<(String, u64)>,
    instances: BTreeMap<InstanceId, Instance>,
    /// Published loads of the live instances, in id order: what policies see.
    live: Vec<LoadReport>,
    requests: BTreeMap<RequestId, Ownership>,
    moves: HashMap<RequestId, Move>,
    /// Open moves one of whose ends left.
    departed: BTreeMap<RequestId, Departed>,
    /// Requests whose client left during a move: cancelled once the move ends.
    cancelling: BTreeSet<RequestId>,
    /// Requests whose re-placement found no live instance: retried when one joins.
    stranded: BTreeSet<RequestId>,
    /// Requests held after their prefill that no decode instance has room for yet, in the order
    /// they became ready: handed off as decode instances report room (first come, first served).
    waiting_handoffs: VecDeque<RequestId>,
    /// Pushed handoffs a decoder refused (`[pd] handoff = "push"`), each tried on the next
    /// decoder at its time ([`PUSH_RETRY`] after the refusal), in that order.
    push_retries: VecDeque<(Timestamp, RequestId)>,
    retain_finished: bool,
    now: Timestamp,
    actions: VecDeque<Action>,
    /// Where prompts' prefixes are predicted cached (kept only for a policy that reads it).
    prefix: Option<PrefixIndex>,
    silence: Option<Silence>,
    /// Some instance has a role other than [`Role::Mixed`]: placements and handoffs respect roles.
    disaggregated: bool,
    /// Arrow places requests and flips roles ([`Controller::use_arrow`]).
    arrow: Option<pd::ArrowDriver>,
    /// The initial prefill/decode split, for instances that join later
    /// ([`Controller::split_prefill_decode`]).
    split: Option<crate::roles::PdConfig>,
}

impl Controller {
    /// A controller deciding with `policy`, drawing from `rng`. Finished requests are forgotten
    /// unless [`Controller::retain_finished`] is set.
    pub fn new(policy: Box<dyn InstancePolicy>, rng: SimRng) -> Controller {
        let prefix = policy.prefix_index().map(PrefixIndex::new);
        Controller {
            prefix,
            policy,
            rng,
            model: None,
            instances: BTreeMap::new(),
            live: Vec::new(),
            requests: BTreeMap::new(),
            moves: HashMap::new(),
            departed: BTreeMap::new(),
            cancelling: BTreeSet::new(),
            stranded: BTreeSet::new(),
            waiting_handoffs: VecDeque::new(),
            push_retries: VecDeque::new(),
            retain_finished: false,
            now: Timestamp::ZERO,
            actions: VecDeque::new(),
            silence: None,
            disaggregated: false,
            arrow: None,
            split: None,
        }
    }

    /// Give `instance` (joined or not yet) the role `role`; an [`Action::SetRole`] tells the
    /// driver. New requests go only to instances that prefill ([`Role::prefills`]); a request
    /// prefilled on a [`Role::Prefill`] instance is handed off ([`Event::PrefillDone`]) to one
    /// that decodes.
    pub fn set_role(&mut self, instance: InstanceId, role: Role) {
        let inst = self.instances.entry(instance).or_insert_with(|| Instance::new(instance));
        inst.role = role;
        self.disaggregated = self.instances.values().any(|i| i.role != Role::Mixed);
        self.actions.push_back(Action::SetRole { instance, role });
        if !role.hands_off() {
            // The requests it held for a handoff decode here now (the driver's engine lets them
            // go with the new role): their handoffs are off.
            let moves = &mut self.moves;
            let mut held_here = |id: &RequestId| {
                let here = moves.get(id).is_some_and(|m| m.from == instance);
                if here {
                    moves.remove(id);
                }
                !here
            };
            self.waiting_handoffs.retain(|id| held_here(id));
            self.push_retries.retain(|(_, id)| held_here(id));
        }
    }

    /// Disaggregate prefill and decode as `pd` splits the instances ([`PdConfig::initial_role`]):
    /// the known ones now, each that joins later without a role of its own when it joins (a
    /// driver whose instances join over time, like the coordinator's, needs no list of them).
    /// Off: nothing changes.
    ///
    /// [`PdConfig::initial_role`]: crate::roles::PdConfig::initial_role
    pub fn split_prefill_decode(&mut self, pd: &crate::roles::PdConfig) {
        if pd.is_off() {
            return;
        }
        let known: Vec<InstanceId> = self.instances.keys().copied().collect();
        for id in known {
            self.set_role(id, pd.initial_role(id.0));
        }
        self.split = Some(pd.clone());
    }

    /// The role of `instance` ([`Role::Mixed`] when unknown).
    pub fn role(&self, instance: InstanceId) -> Role {
        self.instances.get(&instance).map_or(Role::Mixed, |i| i.role)
    }

    /// Apply `rule` to the times [`Event::Heard`] reports (a driver that cannot lose touch with
    /// its instances, like the simulator, sets none).
    pub fn watch_silence(mut self, rule: Silence) -> Controller {
        self.silence = Some(rule);
        self
    }

    /// Replace the silence rule (a driver's tests shorten it).
    pub fn set_silence(&mut self, rule: Silence) {
        self.silence = Some(rule);
    }

    /// The silence rule in force, if any.
    pub fn silence(&self) -> Option<Silence> {
        self.silence
    }

    /// Refuse instances that serve another model (name and KV bytes per token).
    pub fn expect_model(mut self, model: impl Into<String>, kv_bytes_per_token: u64) -> Controller {
        self.model = Some((model.into(), kv_bytes_per_token));
        self
    }

    /// Keep finished requests' records (a coordinator answers a resubmitted id as a duplicate).
    pub fn retain_finished(mut self) -> Controller {
        self.retain_finished = true;
        self
    }

    /// Hand a cost-based policy (`cache-aware`) the prefill curve and link it weighs
    /// ([`InstancePolicy::needs_costs`]); other policies ignore them.
    pub fn set_placement_costs(&mut self, costs: &PlacementCosts) {
        self.policy.set_costs(costs);
    }

    /// The instance-level policy's name.
    pub fn policy_name(&self) -> &str {
        self.policy.name()
    }

    /// Whether a decision reads the decode progress a load report carries
    /// ([`LoadReport::decode_context_tokens`], `decode_tokens_total`, `decode_latency_ns_total`):
    /// prefill/decode disaggregation does. Otherwise a driver may publish an instance's load less
    /// often while only those change (the simulator's leaps).
    pub fn reads_decode_progress(&self) -> bool {
        self.split.is_some() || self.arrow.is_some()
    }

    /// Whether a decision still counts in `instance`'s published load (a charge no report has
    /// cleared yet).
    pub fn is_charged(&self, instance: InstanceId) -> bool {
        self.instances.get(&instance).is_some_and(|i| !i.charges.is_empty())
    }

    /// Published loads of the live instances, in id order.
    pub fn loads(&self) -> &[LoadReport] {
        &self.live
    }

    /// Every instance ever joined: its address label, published load and whether it is live.
    pub fn members(&self) -> impl Iterator<Item = (InstanceId, &str, LoadReport, bool)> + '_ {
        self.instances.iter().map(|(&id, i)| (id, i.address.as_str(), i.published(), i.alive))
    }

    /// Whether `instance` is live.
    pub fn is_live(&self, instance: InstanceId) -> bool {
        self.instances.get(&instance).is_some_and(|i| i.alive)
    }

    /// Every known request.
    pub fn requests(&self) -> &BTreeMap<RequestId, Ownership> {
        &self.requests
    }

    /// One request's ownership.
    pub fn ownership(&self, id: RequestId) -> Option<&Ownership> {
        self.requests.get(&id)
    }

    /// Requests not finished.
    pub fn in_flight(&self) -> usize {
        self.requests.values().filter(|o| o.unfinished()).count()
    }

    /// Restore ownership records read from a store (a new leader resuming).
    pub fn restore(&mut self, records: impl IntoIterator<Item = Ownership>) {
        for o in records {
            self.requests.insert(o.spec.id, o);
        }
    }

    /// Requests held after their prefill that wait for a decode instance with room (pulled), or
    /// for their next try after a refusal (pushed).
    pub fn waiting_handoffs(&self) -> usize {
        self.waiting_handoffs.len() + self.push_retries.len()
    }

    /// The next action to execute, in the order decided.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Apply `event` at `now`; its decisions queue up for [`Controller::poll_action`]. An error
    /// names an event that could not be applied (nothing changed).
    pub fn handle(&mut self, now: Timestamp, event: Event) -> Result<(), ControlError> {
        self.now = self.now.max(now);
        match event {
            Event::Joined { instance, address, model, kv_bytes_per_token } => {
                self.join(instance, address, &model, kv_bytes_per_token)
            }
            Event::Left { instance } => {
                self.leave(instance);
                Ok(())
            }
            Event::Load(load) => {
                self.on_load(load);
                Ok(())
            }
            Event::Heard { heard } => {
                self.on_heard(&heard);
                Ok(())
            }
            Event::Arrival(spec) => self.on_arrival(spec),
            Event::Boundary { request, instance, kv_blocks } => {
                self.on_boundary(request, instance, kv_blocks);
                Ok(())
            }
            Event::PrefillStarted { request, instance, kv_blocks } => {
                self.on_prefill_started(request, instance, kv_blocks);
                Ok(())
            }
            Event::PrefillDone { request, instance, kv_blocks } => {
                self.on_prefill_done(request, instance, kv_blocks);
                Ok(())
            }
            Event::MigrationEnded { request, from, to, outcome } => {
                if self.superseded(request, from, to) {
                    return Ok(());
                }
                self.on_migration_ended(request, outcome)
            }
            Event::Lost { request } => self.on_lost(request),
            Event::Settled { request, from, to, held } => {
                if self.superseded(request, from, to) {
                    return Ok(());
                }
                self.on_settled(request, held)
            }
            Event::Finished { request, from } => self.on_finished(request, from),
            Event::Cancelled { request } => self.on_cancelled(request),
            Event::KvEvents { instance, events } => {
                if let Some(index) = self.prefix.as_mut() {
                    index.apply(instance, &events);
                }
                Ok(())
            }
            Event::Tick => {
                let ids: Vec<InstanceId> = self.instances.keys().copied().collect();
                for id in ids {
                    self.expire_charges(id);
                }
                self.arrow_tick();
                self.retry_pushes();
                Ok(())
            }
        }
    }

    /// [`Controller::handle`], then every action it queued.
    pub fn decide(&mut self, now: Timestamp, event: Event) -> Result<Vec<Action>, ControlError> {
        self.handle(now, event)?;
        Ok(self.actions.drain(..).collect())
    }

    fn join(&mut self, instance: InstanceId, address: String, model: &str, kv_bytes: u64) -> Result<(), ControlError> {
        if let Some((want, want_bytes)) = &self.model {
            if model != want || kv_bytes != *want_bytes {
                return Err(ControlError::ModelMismatch {
                    instance: instance.0,
                    got: model.into(),
                    got_bytes: kv_bytes,
                    want: want.clone(),
                    want_bytes: *want_bytes,
                });
            }
        }
        let inst = self.instances.entry(instance).or_insert_with(|| Instance::new(instance));
        inst.address = address;
        if !inst.alive {
            inst.alive = true;
            inst.silent = false;
            inst.abandoned = false;
            let role = match (inst.role, &self.split) {
                (Role::Mixed, Some(split)) => split.initial_role(instance.0),
                (role, _) => role,
            };
            if role != Role::Mixed {
                // Its process may be new (a restarted worker starts mixed): told its role again.
                self.set_role(instance, role);
            }
            self.rebuild_live();
            self.retry_stranded();
        }
        Ok(())
    }

    fn leave(&mut self, instance: InstanceId) {
        let Some(inst) = self.instances.get_mut(&instance) else {
            tracing::debug!(instance = instance.0, "an unknown instance left; ignored");
            return;
        };
        inst.charges.clear();
        if inst.alive {
            inst.alive = false;
            self.rebuild_live();
        }
        // Its caches are gone (a worker that comes back starts empty).
        if let Some(index) = self.prefix.as_mut() {
            index.forget(instance);
        }
        let touched: Vec<(RequestId, InstanceId, Option<InstanceId>)> = self
            .requests
            .values()
            .filter(|o| o.unfinished() && (o.instance == instance || o.migrating_to == Some(instance)))
            .map(|o| (o.spec.id, o.instance, o.migrating_to.filter(|_| o.phase == OwnedPhase::Migrating)))
            .collect();
        for (id, owner, moving_to) in touched {
            let departed = self.departed.get(&id).copied();
            if owner != instance {
                // The target of its move left: the request stays on its source and the move's end
                // (from the source's side) says whether it committed, with the target. If its
                // source left before, no copy is left to ask about.
                if departed == Some(Departed::Source) {
                    self.replace(id);
                } else {
                    self.departed.insert(id, Departed::Target);
                }
                continue;
            }
            match moving_to {
                Some(to) if to != instance && self.is_live(to) && departed != Some(Departed::Target) => {
                    // The move may have committed (a lost or late COMMIT reply): re-placed now, it
                    // could run twice. Its target's answer decides.
                    if departed != Some(Departed::Source) {
                        self.departed.insert(id, Departed::Source);
                        self.actions.push_back(Action::Settle { request: id, from: instance, to });
                    }
                }
                _ => self.replace(id),
            }
        }
    }

    fn rebuild_live(&mut self) {
        self.live.clear();
        for inst in self.instances.values_mut() {
            inst.live_slot = None;
            if inst.alive && !inst.silent {
                inst.live_slot = Some(self.live.len());
                self.live.push(inst.published());
            }
        }
    }

    /// Re-publish one instance's load after its base or charges changed.
    fn republish(&mut self, instance: InstanceId) {
        if let Some(inst) = self.instances.get(&instance) {
            if let Some(slot) = inst.live_slot {
                self.live[slot] = inst.published();
            }
        }
    }

    fn on_load(&mut self, load: LoadReport) {
        let id = load.instance;
        let now = self.now;
        let Some(inst) = self.instances.get_mut(&id) else {
            tracing::debug!(instance = id.0, "load report from an instance that never joined; ignored");
            return;
        };
        let admitted = load.admitted;
        inst.base = load;
        inst.charges.retain(|c| c.covered_at > admitted && now.saturating_since(c.at) < CHARGE_TTL);
        let decodes = inst.role.decodes();
        if std::mem::take(&mut inst.silent) {
            tracing::info!(instance = id.0, "instance heard again: placements resume");
            self.rebuild_live();
            self.retry_stranded();
        } else {
            self.republish(id);
        }
        if decodes && !self.waiting_handoffs.is_empty() {
            self.retry_handoffs();
        }
    }

    /// Hand off the waiting requests, first come first served, while a decode instance has room
    /// for the first.
    fn retry_handoffs(&mut self) {
        while let Some(&id) = self.waiting_handoffs.front() {
            // Gone, or moving already: never a second move of one request.
            let moving = self.requests.get(&id).is_none_or(|o| o.migrating_to.is_some());
            let Some(m) = self.moves.get(&id).cloned().filter(|_| !moving) else {
                self.waiting_handoffs.pop_front();
                continue;
            };
            // No decoder has room: it waits on. With Arrow too (a flip could make room, but its
            // monitoring pass does that: every decoder's report would otherwise rebuild its view).
            // None could ever take it (the large ones left): it decodes where it is, and the rest
            // go on.
            let Some(least_kv) = self.choose_decoder(&m) else {
                if self.decoder_could_take(&m) {
                    return;
                }
                self.waiting_handoffs.pop_front();
                self.decode_here(id, m.from);
                continue;
            };
            let target = if self.arrow.is_none() {
                Handoff::To(least_kv)
            } else {
                self.handoff_target(id, &m, Decided::AtThePrefillsEnd)
            };
            // An Arrow flip on the way may drop other waiting requests (their instance decodes
            // now): `id` is taken out by name, not as the front.
            match target {
                Handoff::To(to) => {
                    self.waiting_handoffs.retain(|&w| w != id);
                    self.start_move(id, &m, to);
                }
                Handoff::Here => {
                    self.waiting_handoffs.retain(|&w| w != id);
                    self.decode_here(id, m.from);
                }
                Handoff::Wait | Handoff::NoDecoder => return,
            }
        }
    }

    /// The silence rule ([`Event::Heard`]) over the driver's last-heard times.
    fn on_heard(&mut self, heard: &[(InstanceId, Timestamp)]) {
        let Some(rule) = self.silence else { return };
        let now = self.now;
        for &(id, at) in heard {
            let Some(inst) = self.instances.get_mut(&id) else { continue };
            let quiet = now.saturating_since(at);
            if quiet < rule.silent_after {
                if std::mem::take(&mut inst.abandoned) {
                    tracing::info!(instance = id.0, "instance heard again after it was given up: it rejoins, empty");
                    inst.alive = true;
                } else if inst.silent {
                    tracing::info!(instance = id.0, "instance heard again: placements resume");
                } else {
                    continue;
                }
                inst.silent = false;
                self.rebuild_live();
                self.retry_stranded();
                continue;
            }
            let alive = inst.alive;
            let newly_silent = alive && !inst.silent;
            if newly_silent {
                inst.silent = true;
                tracing::warn!(
                    instance = id.0,
                    quiet_ms = quiet.as_millis_f64(),
                    "instance silent: no placement or move goes to it until it is heard again"
                );
            }
            if quiet >= rule.abandon_after && alive {
                inst.abandoned = true;
                tracing::warn!(
                    instance = id.0,
                    quiet_ms = quiet.as_millis_f64(),
                    "instance unreachable while it is still a member: its requests are re-placed"
                );
                self.actions.push_back(Action::Expel { instance: id });
                self.leave(id);
            } else if newly_silent {
                self.rebuild_live();
            }
        }
    }

    /// Re-placements that found no instance to go to, tried again (one joined, or was heard again).
    fn retry_stranded(&mut self) {
        for id in std::mem::take(&mut self.stranded) {
            if self.requests.get(&id).is_some_and(Ownership::unfinished) {
                self.replace(id);
            }
        }
    }

    fn expire_charges(&mut self, id: InstanceId) {
        let now = self.now;
        if let Some(inst) = self.instances.get_mut(&id) {
            let before = inst.charges.len();
            inst.charges.retain(|c| now.saturating_since(c.at) < CHARGE_TTL);
            if inst.charges.len() != before {
                self.republish(id);
            }
        }
    }

    /// Count a decision in `on`'s published load until a report shows it.
    fn charge(&mut self, on: InstanceId, request: RequestId, kind: ChargeKind, tokens: u32) {
        let now = self.now;
        let Some(inst) = self.instances.get_mut(&on) else { return };
        let blocks = inst.base.blocks_for(tokens);
        let covered_at = inst.charges.last().map_or(inst.base.admitted, |c| c.covered_at.max(inst.base.admitted)) + 1;
        inst.charges.push(Charge { request, kind, blocks, tokens, at: now, covered_at });
        self.republish(on);
    }

    fn uncharge(&mut self, on: InstanceId, request: RequestId) {
        if let Some(inst) = self.instances.get_mut(&on) {
            let before = inst.charges.len();
            inst.charges.retain(|c| c.request != request);
            if inst.charges.len() != before {
                self.republish(on);
            }
        }
    }

    /// The policy's placement, or the least-loaded live instance when it names one that is not
    /// live. `None` only when no instance is live.
    fn choose(&mut self, spec: &RequestSpec) -> Option<(InstanceId, Option<PrefixFetch>)> {
        if let Some(to) = self.arrow_place_prefill(spec.id, spec.prompt_tokens) {
            self.note_prefix(spec, to);
            return Some((to, None));
        }
        // Disaggregated: only the instances that prefill take new requests.
        let pool: Option<Vec<LoadReport>> = self.disaggregated.then(|| {
            let instances = &self.instances;
            self.live
                .iter()
                .filter(|l| instances.get(&l.instance).is_some_and(|i| i.role.prefills()))
                .cloned()
                .collect()
        });
        let live = pool.as_deref().unwrap_or(&self.live);
        if live.is_empty() {
            return None;
        }
        let (to, fetch) = match &self.prefix {
            Some(index) => {
                let overlap = index.overlaps(spec, live, self.now);
                let to = self.policy.place_with_overlap(spec, live, &overlap, &mut self.rng);
                (to, self.policy.prefix_fetch(live, &overlap, to))
            }
            None => (self.policy.place(spec, live, &mut self.rng), None),
        };
        if live.iter().any(|l| l.instance == to) {
            trace_decision("place", self.now, spec.id, to, live);
            self.note_prefix(spec, to);
            return Some((to, fetch));
        }
        let fallback = live.iter().min_by_key(|l| (l.kv_footprint_bytes(), l.instance)).map(|l| l.instance);
        tracing::warn!(
            request = spec.id.0,
            picked = to.0,
            fallback = fallback.map_or(0, |i| i.0),
            policy = self.policy.name(),
            "the policy picked an instance that is not live; placing on the least loaded instead"
        );
        if let Some(to) = fallback {
            self.note_prefix(spec, to);
        }
        fallback.map(|to| (to, None))
    }

    /// The prompt of `spec`, placed on `on`, is predicted cached there from now on.
    fn note_prefix(&mut self, spec: &RequestSpec, on: InstanceId) {
        let Some(index) = self.prefix.as_mut() else { return };
        let block_tokens = self.instances.get(&on).map_or(0, |i| i.base.block_tokens);
        index.placed(spec, on, block_tokens, self.now);
    }

    fn on_arrival(&mut self, spec: RequestSpec) -> Result<(), ControlError> {
        if self.requests.contains_key(&spec.id) {
            return Err(ControlError::Duplicate(spec.id));
        }
        self.anchor_arrow_passes(spec.arrival);
        let Some((to, fetch)) = self.choose(&spec) else {
            self.actions.push_back(Action::Reject { request: spec.id, reason: RejectReason::NoInstance });
            return Ok(());
        };
        let id = spec.id;
        self.charge(to, id, charge_kind(&spec), spec.prompt_tokens);
        self.requests.insert(id, Ownership::placed(spec, to));
        self.actions.push_back(Action::Place { request: id, on: to, replaced: 0, fetch });
        Ok(())
    }

    /// Start a request over on a live instance.
    fn replace(&mut self, id: RequestId) {
        let Some(spec) = self.requests.get(&id).map(|o| o.spec.clone()) else { return };
        self.departed.remove(&id);
        let Some((to, fetch)) = self.choose(&spec) else {
            tracing::warn!(request = id.0, "no live instance to re-place the request on; retried when one joins");
            self.stranded.insert(id);
            self.actions.push_back(Action::Reject { request: id, reason: RejectReason::NoInstance });
            return;
        };
        self.stranded.remove(&id);
        self.restart_on(id, &spec, to, fetch);
    }

    /// Start request `id` (`spec`) over on `to`: its copy elsewhere is gone or dropped.
    fn restart_on(&mut self, id: RequestId, spec: &RequestSpec, to: InstanceId, fetch: Option<PrefixFetch>) {
        self.moves.remove(&id);
        let Some(o) = self.requests.get_mut(&id) else { return };
        o.instance = to;
        o.replaced += 1;
        o.phase = initial_phase(spec);
        o.migrating_to = None;
        // A new copy of its KV: its mismatches count from zero.
        o.corrupt_handoffs = 0;
        let replaced = o.replaced;
        self.charge(to, id, charge_kind(spec), spec.prompt_tokens);
        self.actions.push_back(Action::Place { request: id, on: to, replaced, fetch });
    }

    /// A handoff whose bytes failed their checksum [`MAX_CORRUPT_HANDOFFS`] times: the KV held on
    /// `from` is dropped and computed again on the live instance other than `from` with the least
    /// KV, one that prefills first (the same fabric or memory may corrupt it again, so not
    /// `from`). `false` when its KV was computed again once already, or no other instance is live.
    fn reprefill(&mut self, id: RequestId, from: InstanceId) -> bool {
        let Some(o) = self.requests.get(&id).filter(|o| o.reprefilled == 0) else { return false };
        let spec = o.spec.clone();
        let instances = &self.instances;
        let to = self
            .live
            .iter()
            .filter(|l| l.instance != from)
            .min_by_key(|l| {
                let prefills = instances.get(&l.instance).is_some_and(|i| i.role.prefills());
                (!prefills, l.kv_footprint_bytes(), l.instance)
            })
            .map(|l| l.instance);
        let Some(to) = to else { return false };
        tracing::warn!(
            request = id.0,
            from = from.0,
            to = to.0,
            "its handoffs' bytes failed their checksum twice: its KV is computed again"
        );
        self.uncharge(from, id);
        self.actions.push_back(Action::Drop { request: id, on: from });
        if let Some(o) = self.requests.get_mut(&id) {
            o.reprefilled += 1;
        }
        self.restart_on(id, &spec, to, None);
        true
    }

    fn on_lost(&mut self, id: RequestId) -> Result<(), ControlError> {
        match self.requests.get(&id) {
            Some(o) if o.unfinished() && self.cancelling.remove(&id) => {
                // Its client left and its copy is gone: nothing to run, nothing to stop.
                self.forget(id)
            }
            Some(o) if o.unfinished() => {
                self.replace(id);
                Ok(())
            }
            _ => Err(ControlError::NotInFlight(id)),
        }
    }

    fn on_settled(&mut self, id: RequestId, held: bool) -> Result<(), ControlError> {
        if self.departed.get(&id) != Some(&Departed::Source) {
            tracing::debug!(request = id.0, held, "answer for a move settled meanwhile; ignored");
            return Ok(());
        }
        if held {
            // Its target is live: had it left, the request would have been re-placed already.
            return self.on_migration_ended(id, MoveOutcome::Committed);
        }
        self.departed.remove(&id);
        match self.requests.get(&id) {
            Some(o) if o.unfinished() && self.cancelling.remove(&id) => {
                // Its client left, and the target does not hold it: the copy left with its source.
                self.forget(id)
            }
            Some(o) if o.unfinished() => {
                self.replace(id);
                Ok(())
            }
            // Finished on its source before it left: only the move's bookkeeping is left to end.
            Some(_) => self.on_migration_ended(id, MoveOutcome::Aborted),
            None => Err(ControlError::NotInFlight(id)),
        }
    }

    fn on_boundary(&mut self, id: RequestId, instance: InstanceId, kv_blocks: u32) {
        let Some(o) = self.requests.get_mut(&id) else {
            tracing::debug!(request = id.0, "phase boundary of an unknown request; ignored");
            return;
        };
        // A late event from an instance the request left (re-placed, or an old incarnation), or
        // for a finished request, must not move it back.
        if o.instance != instance || o.phase != OwnedPhase::Reasoning {
            tracing::debug!(request = id.0, instance = instance.0, owner = o.instance.0, phase = ?o.phase, "stale phase boundary; ignored");
            return;
        }
        o.phase = OwnedPhase::Answering;
        if self.policy.migrates_at_phase_boundary() {
            self.moves.insert(
                id,
                Move {
                    from: instance,
                    kv_blocks,
                    declined: Vec::new(),
                    handoff: false,
                    after: OwnedPhase::Answering,
                    failed: 0,
                },
            );
            self.decide_move(id);
        }
    }

    /// Ask the policy where `id` should answer, among the live instances not declined yet.
    fn decide_move(&mut self, id: RequestId) {
        let Some(m) = self.moves.get(&id).cloned() else { return };
        if m.handoff {
            match self.handoff_target(id, &m, Decided::AtThePrefillsEnd) {
                Handoff::To(to) => self.start_move(id, &m, to),
                Handoff::Here => self.decode_here(id, m.from),
                Handoff::Wait => {
                    // Every decode instance is full: held, it waits for one to report room.
                    if let Some(m) = self.moves.get_mut(&id) {
                        m.declined.clear();
                    }
                    if !self.waiting_handoffs.contains(&id) {
                        self.waiting_handoffs.push_back(id);
                    }
                }
                Handoff::NoDecoder => {
                    tracing::debug!(request = id.0, "no decode instance is live: it decodes where it was prefilled");
                    self.decode_here(id, m.from);
                }
            }
            return;
        }
        let change = PhaseChange { request: id, current: m.from, kv_blocks: m.kv_blocks };
        // Not the targets that declined it, and, disaggregated, only instances that decode.
        let narrowed: Option<Vec<LoadReport>> = (!m.declined.is_empty() || self.disaggregated).then(|| {
            let instances = &self.instances;
            self.live
                .iter()
                .filter(|l| !m.declined.contains(&l.instance))
                .filter(|l| !self.disaggregated || instances.get(&l.instance).is_some_and(|i| i.role.decodes()))
                .cloned()
                .collect()
        });
        let loads = narrowed.as_deref().unwrap_or(&self.live);
        let decision = self.policy.on_phase_change(&change, loads, &mut self.rng);
        let chosen = match decision {
            PhaseDecision::Migrate { to } => to,
            _ => m.from,
        };
        trace_decision("phase", self.now, id, chosen, loads);
        let PhaseDecision::Migrate { to } = decision else {
            self.moves.remove(&id);
            return;
        };
        if to == m.from {
            self.moves.remove(&id);
            return;
        }
        if !self.is_live(to) || m.declined.contains(&to) {
            tracing::warn!(
                request = id.0,
                picked = to.0,
                "the policy picked a move target that is not live; the request stays"
            );
            self.moves.remove(&id);
            return;
        }
        self.start_move(id, &m, to);
    }

    /// Move `id` as `m` says, to `to`: charged to `to` at once, recorded for a successor.
    fn start_move(&mut self, id: RequestId, m: &Move, to: InstanceId) {
        let o = self.requests.get_mut(&id).expect("a move exists only for a known request");
        o.phase = OwnedPhase::Migrating;
        o.migrating_to = Some(to);
        let tokens = m.kv_blocks.saturating_mul(self.instances.get(&to).map_or(0, |i| i.base.block_tokens));
        self.charge(to, id, ChargeKind::MoveIn, tokens);
        if let Some(mv) = self.moves.get_mut(&id) {
            mv.declined.push(to);
        }
        self.actions.push_back(Action::Migrate { request: id, from: m.from, to, kv_blocks: m.kv_blocks });
    }

    /// A held request's handoff is off: it decodes on `on`, where it was prefilled.
    fn decode_here(&mut self, id: RequestId, on: InstanceId) {
        self.moves.remove(&id);
        self.actions.push_back(Action::Release { request: id, on });
    }

    /// The decode instance a handoff goes to: among the live instances that decode, have not
    /// declined it and have room for it, the one with the least KV in use or promised (fewest
    /// requests, then lowest id, on a tie). Pushed, room now is the decoder's to judge (it
    /// refuses the PREPARE): room for it when empty is enough.
    fn choose_decoder(&self, m: &Move) -> Option<InstanceId> {
        let push = self.pushes();
        self.decoders_for(m)
            .filter(|l| !m.declined.contains(&l.instance))
            .filter(|l| if push { pd::could_hold(l, m.kv_blocks) } else { pd::has_room(l, m.kv_blocks) })
            .min_by_key(|l| {
                let blocks = u64::from(l.gpu_used_blocks) + u64::from(l.waiting_blocks);
                (blocks, l.answering_requests + l.reasoning_requests, l.instance)
            })
            .map(|l| l.instance)
    }

    /// The live instances that decode, other than `m`'s source: where its handoff may go.
    fn decoders_for<'a>(&'a self, m: &'a Move) -> impl Iterator<Item = &'a LoadReport> + 'a {
        self.live
            .iter()
            .filter(move |l| l.instance != m.from && self.instances.get(&l.instance).is_some_and(|i| i.role.decodes()))
    }

    /// Whether handoffs are pushed (`[pd] handoff = "push"`).
    fn pushes(&self) -> bool {
        self.split.as_ref().is_some_and(|pd| pd.handoff == HandoffMode::Push)
    }

    /// Pushed handoffs whose retry is due, each to its next decoder: not one that declined it
    /// yet, and once every live decoder has, any but the last to refuse.
    fn retry_pushes(&mut self) {
        while let Some(&(due, id)) = self.push_retries.front() {
            if due > self.now {
                return;
            }
            self.push_retries.pop_front();
            // Released, re-placed or finished meanwhile: nothing to hand off.
            let held = self.requests.get(&id).is_some_and(|o| {
                o.unfinished()
                    && o.migrating_to.is_none()
                    && self.moves.get(&id).is_some_and(|m| m.handoff && m.from == o.instance)
            });
            if !held {
                continue;
            }
            let m = self.moves.get(&id).expect("checked above");
            let decoders = |skip: &[InstanceId]| self.decoders_for(m).any(|l| !skip.contains(&l.instance));
            if !decoders(&m.declined) {
                // Round again, from the one after the last that refused (itself, if it is the
                // only decoder).
                let last: Vec<InstanceId> = m.declined.last().copied().into_iter().collect();
                let again = if decoders(&last) { last } else { Vec::new() };
                self.moves.get_mut(&id).expect("checked above").declined = again;
            }
            self.decide_move(id);
        }
    }

    /// When the next pushed handoff is due for another try.
    fn next_push_retry(&self) -> Option<Timestamp> {
        self.push_retries.front().map(|&(due, _)| due)
    }

    /// Whether a live decode instance other than its prefill instance could take `m`'s KV once
    /// it has room (else it can only decode where it is: none decodes, or none is large enough).
    fn decoder_could_take(&self, m: &Move) -> bool {
        self.decoders_for(m).any(|l| pd::could_hold(l, m.kv_blocks))
    }

    /// A request's prefill ended on a prefill instance, where it is held: hand it off.
    fn on_prefill_done(&mut self, id: RequestId, instance: InstanceId, kv_blocks: u32) {
        if let Some(m) = self.new_handoff(id, instance, kv_blocks, "prefill-done") {
            self.moves.insert(id, m);
            self.decide_move(id);
        }
    }

    /// A prefill started on a prefill instance (its first chunk written with
    /// [`Overlap::Chunk`](crate::roles::Overlap::Chunk), its first iteration planned with
    /// [`Overlap::Layer`](crate::roles::Overlap::Layer)): hand it off now if a decode instance
    /// takes it (the move follows the prefill); else, or without overlap, at the prefill's end.
    fn on_prefill_started(&mut self, id: RequestId, instance: InstanceId, kv_blocks: u32) {
        if self.split.as_ref().is_none_or(|s| !s.overlap.overlaps()) {
            return;
        }
        let Some(m) = self.new_handoff(id, instance, kv_blocks, "prefill-started") else { return };
        self.moves.insert(id, m.clone());
        match self.handoff_target(id, &m, Decided::AsThePrefillStarts) {
            Handoff::To(to) => self.start_move(id, &m, to),
            // No decoder with room now, or it decodes where it is prefilled: decided at the end.
            Handoff::Here | Handoff::Wait | Handoff::NoDecoder => {
                self.moves.remove(&id);
            }
        }
    }

    /// The handoff of `id`, prefilled on `instance` with `kv_blocks` of KV, unless the event
    /// (`what`) is stale: a driver may announce a held request again (a worker told its role
    /// once more, or whose move aborted), and a handoff already open or waiting its turn is not
    /// started a second time.
    ///
    /// A request held by an instance that neither owns it nor is its move's target is a copy
    /// the cluster lost track of on purpose (re-placed while that instance was cut off or
    /// stopped): held for a handoff nobody decides, it would keep its KV there for ever, so it
    /// is dropped ([`Action::Drop`]).
    fn new_handoff(&mut self, id: RequestId, instance: InstanceId, kv_blocks: u32, what: &str) -> Option<Move> {
        let Some(o) = self.requests.get(&id) else {
            tracing::debug!(request = id.0, what, "an event for an unknown request; ignored");
            return None;
        };
        if (o.instance != instance && o.migrating_to != Some(instance)) || !o.unfinished() {
            tracing::debug!(
                request = id.0,
                instance = instance.0,
                owner = o.instance.0,
                what,
                "a stale copy; dropped there"
            );
            self.actions.push_back(Action::Drop { request: id, on: instance });
            return None;
        }
        if o.instance != instance || o.migrating_to.is_some() || self.moves.contains_key(&id) {
            tracing::debug!(request = id.0, instance = instance.0, owner = o.instance.0, what, "stale event; ignored");
            return None;
        }
        Some(Move { from: instance, kv_blocks, declined: Vec::new(), handoff: true, after: o.phase, failed: 0 })
    }

    /// Whether a report of `id`'s move from `from` to `to` is about a move superseded meanwhile
    /// (logged): `id`'s open move is another one, or none. Ended, a move clears `migrating_to`,
    /// and a re-placement does too: a driver's late report of an older move must not end the
    /// current one. An unknown request is not superseded, so that its handler names it.
    fn superseded(&self, id: RequestId, from: InstanceId, to: InstanceId) -> bool {
        let current = self.requests.get(&id).is_none_or(|o| o.instance == from && o.migrating_to == Some(to));
        if !current {
            tracing::debug!(request = id.0, from = from.0, to = to.0, "a report of a superseded move; ignored");
        }
        !current
    }

    fn on_migration_ended(&mut self, id: RequestId, outcome: MoveOutcome) -> Result<(), ControlError> {
        let Some(o) = self.requests.get_mut(&id) else { return Err(ControlError::NotInFlight(id)) };
        let departed = self.departed.get(&id).copied();
        if departed == Some(Departed::Source) && outcome != MoveOutcome::Committed {
            // Reported from the side of a source that is gone (its MigrateOut failed): the COMMIT
            // may still have reached the target. Only the target's answer settles it.
            tracing::debug!(request = id.0, ?outcome, "the move's source left; waiting for its target's answer");
            return Ok(());
        }
        self.departed.remove(&id);
        let to = o.migrating_to.take();
        let moved_blocks = self.moves.get(&id).map_or(0, |m| m.kv_blocks);
        let (handoff, after, failed) =
            self.moves.get(&id).map_or((false, OwnedPhase::Answering, 0), |m| (m.handoff, m.after, m.failed));
        // The decoders that declined it so far (the move's target among them).
        let mut declined = self.moves.get(&id).map(|m| m.declined.clone()).unwrap_or_default();
        // A request can finish on its source while its move is still being settled: it stays
        // finished (else it would count as in flight and be re-placed if its instance died).
        if o.unfinished() {
            o.phase = after;
            if let (MoveOutcome::Committed, Some(to)) = (outcome, to) {
                o.instance = to;
                o.migrations += 1;
            }
        }
        let unfinished = o.unfinished();
        if let Some(to) = to {
            if outcome != MoveOutcome::Committed {
                self.uncharge(to, id);
            }
        }
        // Neither end holds it, or it committed to a target that has left since (the only copy
        // left with it): it starts over.
        let lost_with_target = unfinished
            && (outcome == MoveOutcome::Lost
                || (departed == Some(Departed::Target) && outcome == MoveOutcome::Committed));
        let cancelling = self.cancelling.remove(&id);
        // A handoff is retried its own way (below): it waits for a decode instance with room.
        let retry = outcome == MoveOutcome::Refused
            && !handoff
            && unfinished
            && !cancelling
            && self.moves.get(&id).is_some_and(|m| m.declined.len() <= MAX_RETARGETS);
        if retry {
            self.decide_move(id);
        } else {
            self.moves.remove(&id);
            if !unfinished && !self.retain_finished {
                self.requests.remove(&id);
            }
        }
        if cancelling && unfinished {
            // The client left during the move: stop the request where the move left it (its
            // only copy went with a departed target: nothing to stop).
            let on = self.requests.get(&id).map(|o| o.instance);
            self.on_finished(id, None)?;
            if let (Some(on), false) = (on, lost_with_target) {
                self.actions.push_back(Action::Cancel { request: id, on });
            }
            return Ok(());
        }
        let pushed_back = handoff && unfinished && outcome == MoveOutcome::Refused && self.pushes();
        if lost_with_target {
            self.replace(id);
        } else if pushed_back {
            // A pushed handoff its decoder refused (full): the prefill instance keeps the KV, and
            // the next decoder is tried after PUSH_RETRY. Not a failure: it waits its turn.
            let from = self.requests.get(&id).map_or(InstanceId(0), |o| o.instance);
            declined.extend(to.filter(|t| !declined.contains(t)));
            let m = Move { from, kv_blocks: moved_blocks, declined, handoff: true, after, failed };
            self.moves.insert(id, m);
            self.push_retries.push_back((self.now + PUSH_RETRY, id));
        } else if handoff && !retry && unfinished && outcome != MoveOutcome::Committed {
            // No decode instance took it: held, it waits for one with room (each may be asked
            // again), until its handoffs failed too often: then it decodes where it is.
            let failed = failed + 1;
            // Mismatches are counted with the request (stored), so that a leader taking over
            // counts on from them.
            let Some(o) = self.requests.get_mut(&id) else { return Ok(()) };
            o.corrupt_handoffs += u32::from(outcome == MoveOutcome::Corrupt);
            let (from, corrupt) = (o.instance, o.corrupt_handoffs);
            if corrupt >= MAX_CORRUPT_HANDOFFS {
                // Its bytes failed their checksum again: compute its KV again elsewhere, once;
                // after that (or with no other instance live) it decodes where it is.
                if !self.reprefill(id, from) {
                    tracing::warn!(
                        request = id.0,
                        corrupt,
                        "its handoffs' bytes keep failing their checksum: it decodes where it was prefilled"
                    );
                    self.decode_here(id, from);
                }
            } else if failed >= MAX_HANDOFF_FAILURES {
                tracing::warn!(request = id.0, failed, "handoffs keep failing: it decodes where it was prefilled");
                self.decode_here(id, from);
            } else {
                let kv_blocks = moved_blocks;
                // Not the one that just failed it, this time.
                let declined = to.into_iter().collect();
                let m = Move { from, kv_blocks, declined, handoff: true, after, failed };
                self.moves.insert(id, m);
                self.decide_move(id);
            }
        }
        Ok(())
    }

    /// A cancelled request with no copy left to stop: finished, and its move's bookkeeping gone.
    fn forget(&mut self, id: RequestId) -> Result<(), ControlError> {
        self.moves.remove(&id);
        self.departed.remove(&id);
        self.on_finished(id, None)?;
        if !self.retain_finished {
            self.requests.remove(&id);
        }
        Ok(())
    }

    fn on_cancelled(&mut self, id: RequestId) -> Result<(), ControlError> {
        let Some(o) = self.requests.get(&id).filter(|o| o.unfinished()) else {
            return Err(ControlError::NotInFlight(id));
        };
        if o.migrating_to.is_some() {
            self.cancelling.insert(id);
            return Ok(());
        }
        let on = o.instance;
        let stranded = self.stranded.contains(&id);
        self.on_finished(id, None)?;
        // A stranded request (its instance left, no live instance to re-place it on) runs nowhere.
        if !stranded {
            self.actions.push_back(Action::Cancel { request: id, on });
        }
        Ok(())
    }

    fn on_finished(&mut self, id: RequestId, from: Option<InstanceId>) -> Result<(), ControlError> {
        let Some(o) = self.requests.get_mut(&id).filter(|o| o.unfinished()) else {
            return Err(ControlError::NotInFlight(id));
        };
        if let Some(from) = from {
            // During a move both ends may hold it: the target once it committed (its record can
            // overtake the commit's reply), the source until then.
            if from != o.instance && o.migrating_to != Some(from) {
                return Err(ControlError::NotOwner { request: id, from, owner: o.instance });
            }
        }
        o.phase = OwnedPhase::Finished;
        self.stranded.remove(&id);
        let (on, moving_to) = (o.instance, o.migrating_to);
        self.uncharge(on, id);
        if let Some(to) = moving_to {
            self.uncharge(to, id);
        }
        if !self.retain_finished && moving_to.is_none() {
            self.requests.remove(&id);
            self.moves.remove(&id);
        }
        Ok(())
    }
}

fn charge_kind(spec: &RequestSpec) -> ChargeKind {
    if spec.reasoning_tokens > 0 {
        ChargeKind::Reasoning
    } else {
        ChargeKind::Answering
    }
}

/// The `tracing` target of [`trace_decision`]: `RUST_LOG=kvfleet::decisions=debug` logs every
/// placement and `</think>` decision with the loads it saw, in `kvfleet sim` and on the leader
/// alike (one line format, so two runs' decisions can be compared line by line).
pub const DECISIONS: &str = "kvfleet::decisions";

/// Logs a decision (`kind`: `place` or `phase`) for `request` at `now` (ns) that chose `to`, with
/// each instance's load as `instance:kv_blocks:reasoning:fresh_answering:slo_ok`.
fn trace_decision(kind: &str, now: Timestamp, request: RequestId, to: InstanceId, loads: &[LoadReport]) {
    if !tracing::enabled!(target: DECISIONS, tracing::Level::DEBUG) {
        return;
    }
    let loads: Vec<String> = loads
        .iter()
        .map(|l| {
            let blocks = l.gpu_used_blocks + l.cpu_used_blocks + l.waiting_blocks;
            let (r, a, ok) = (l.reasoning_requests, l.fresh_answering_requests, u8::from(l.answering_slo_ok));
            format!("{}:{blocks}:{r}:{a}:{ok}", l.instance.0)
        })
        .collect();
    emit_decision(kind, now, request, to, &loads.join(" "));
}

/// One line of the decision log: `kind` for `request` at `now` (ns), choosing `to`, on `loads`
/// (each instance's load in the decision's own format).
fn emit_decision(kind: &str, now: Timestamp, request: RequestId, to: InstanceId, loads: &str) {
    tracing::debug!(target: DECISIONS, kind, at_ns = now.as_nanos(), request = request.0, to = to.0, loads = %loads);
}

#[cfg(test)]
mod tests;
