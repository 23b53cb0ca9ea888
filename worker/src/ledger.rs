//! The request ledger: where every request stands on this instance, as one pure state machine.
//!
//! The lifecycle of a request on a worker spans the engine thread (submits, attaches, finishes),
//! both halves of a live migration (source: copy, pause, commit; target: reserve, write, attach)
//! and the coordinator's settlement of a move whose COMMIT reply was lost. Each of those used to
//! keep its own set ("accepted", "migrated away", "fenced", "in doubt", ...) and each decision
//! read a different combination of them; the bugs were in the combinations (a re-placed request
//! answered "duplicate" and never ran; two inbound migrations shared a reservation). Here one
//! entry per request holds all of it, and every event is a method that checks the state,
//! moves it, and answers what to do (sans-IO: no clock, no lock, no I/O;
//! the driver executes the answers on the engine and the arena).
//!
//! A request's [`State`] on this instance, and the events that move it:
//!
//! | from | event | to | the driver then |
//! |---|---|---|---|
//! | `Unseen`, `Left` | submit (first placement, or re-placed after leaving) | `Running` | runs it (freeing a stale reservation) |
//! | `Running`, ..., `Finished` | submit again | unchanged | answers "already accepted" |
//! | not held, the move not fenced | PREPARE in | + reservation (that migration's) | reserves blocks |
//! | reserved by the migration | COMMIT in | `Running` | verifies and attaches on the reservation |
//! | reserved by the migration | its abort | reservation gone | frees the blocks |
//! | not held | coordinator asks "held?" | + fenced up to the moves started so far (unless `Finished`) | answers no (yes if finished) |
//! | not held | attach (re-materialised) | `Running` | attaches it |
//! | `Running` | move out begins | `MovingOut` | copies KV while it decodes |
//! | `MovingOut` | pause | `Paused` | freezes it for the final copy |
//! | `MovingOut`, `Paused` | abort | `Running` | resumes it |
//! | `Paused` | COMMIT confirmed | `Left` | frees the source copy |
//! | `Paused` | COMMIT reply lost | `InDoubt` | waits for the coordinator |
//! | orphaned `Paused` | COMMIT reply lost | `Unseen` | frees it (nobody would settle it) |
//! | adopted `Paused` | COMMIT reply lost | `Running` | resumes it (the move cannot have landed) |
//! | `InDoubt` | resolved held / not held | `Left` / `Running` | frees / resumes |
//! | `MovingOut`, `Paused` | resolved (a new leader settling a move still copying) | unchanged | answers "under way": told again once it ended |
//! | `Running`, `MovingOut` | finished | `Finished` | logs the record |
//! | orphaned `MovingOut` | finished | `Unseen` | logs the record (refused as a late copy's) |
//! | `Running` | registration expired | `Unseen` | cancels it (the coordinator re-placed it) |
//! | reserved by a migration | registration expired | + fenced up to that move | nothing (its COMMIT is refused) |
//! | `InDoubt` | registration expired | `Unseen` | frees it (the coordinator settled the move without it) |
//! | `Finished`, its record unacknowledged | registration expired | `Unseen` | nothing (placed here again, it runs afresh) |
//! | `Running`, `InDoubt` | the coordinator drops a copy it does not count | `Unseen` | cancels / frees it |
//! | `Finished` | the coordinator refused its record as a late copy's | `Unseen` | nothing (it may come back, by a move or placed again) |
//! | `MovingOut`, `Paused` | registration expired, or a copy dropped | unchanged, orphaned | nothing yet: the move ends by its protocol |
//! | orphaned `MovingOut`, `Paused` | abort | `Unseen` | drops it (the coordinator re-placed it) |
//! | orphaned `MovingOut`, `Paused` | submit again (re-placed here) | unchanged, adopted | answers "already accepted" |
//! | orphaned `MovingOut`, `Paused` | the coordinator asks whether a move landed here | unchanged | answers no: the copy goes if its move does not land (placed here, it is adopted) |
//! | adopted `MovingOut`, `Paused` | abort | `Running` | resumes it |
//!
//! Beside the state, each entry records an inbound reservation (which migration's PREPARE was
//! accepted: the blocks are that migration's alone), whether the coordinator settled the request
//! as "not here" (a fence: a late COMMIT of an old migration is refused), and whether its KV was
//! re-materialised. Two instance-wide conditions refuse arrivals by migration: draining, and a
//! lapsed registration (the coordinator has evicted this worker and re-placed its requests, and
//! a newcomer may already hold its instance number: a request committed here now would run where
//! nobody looks for it, and the source would have freed its copy).
//!
//! Invariants (checked by the cluster property test in `ledger/tests.rs`): a request is held
//! (`Running`, `MovingOut`, `Paused`, `InDoubt`) exactly when the engine holds it; a reservation
//! belongs to one migration and is freed once (by that migration's release, by its commit, or by a
//! fresh submit of the request); only the migration that began a move out can pause, commit or
//! resume it.

use kvfleet_core::idmap::IdMap;
use kvfleet_core::RequestId;
use kvfleet_netmodel::migration::{MigrationId, MoveOrder};
use std::fmt;

/// Where a request stands on this instance.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum State {
    /// Never accepted here: known only by an inbound reservation or a fence.
    #[default]
    Unseen,
    /// Accepted (submitted, re-placed, or attached by a migration); waiting, decoding or preempted.
    Running,
    /// Source of a live migration: still decoding while its KV is copied.
    MovingOut(MigrationId),
    /// Source: frozen for the final copy.
    Paused(MigrationId),
    /// Source: COMMIT sent and its reply lost; paused until the coordinator says which copy lives.
    InDoubt(MigrationId),
    /// Left by a committed migration. It may come back: migrated back, or re-placed from the start
    /// when the instance it moved to died.
    Left,
    /// Finished here; its record is in the event log (a later submit is answered "already accepted").
    Finished,
    /// Can never run here (too large); every later submit gets this reason.
    Rejected(String),
}

impl State {
    /// Whether the engine holds the request (it runs here or is paused here).
    pub fn is_held(&self) -> bool {
        matches!(self, State::Running | State::MovingOut(_) | State::Paused(_) | State::InDoubt(_))
    }

    fn name(&self) -> &'static str {
        match self {
            State::Unseen => "unseen",
            State::Running => "running",
            State::MovingOut(_) => "moving out",
            State::Paused(_) => "paused for the final copy",
            State::InDoubt(_) => "in doubt",
            State::Left => "left by a committed migration",
            State::Finished => "finished",
            State::Rejected(_) => "rejected",
        }
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            State::MovingOut(m) | State::Paused(m) | State::InDoubt(m) => write!(f, "{} ({m})", self.name()),
            _ => f.write_str(self.name()),
        }
    }
}

/// Why an arrival or a move is answered "no". The driver turns these into its errors, keeping the
/// texts peers and tests already know.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The instance is draining (stopping) and accepts nothing new.
    #[error("the instance is draining and accepts no requests")]
    Draining,
    /// A final rejection given earlier (too large for this instance).
    #[error("{0}")]
    Rejected(String),
    /// Not held here (or, for a COMMIT, not reserved by that migration).
    #[error("not on this instance")]
    NotHere,
    /// Already held here: a second copy may not arrive.
    #[error("already on this instance")]
    AlreadyHere,
    /// Finished here already (re-placed from the start): an old migration must not bring a second copy.
    #[error("already run on this instance")]
    AlreadyRun,
    /// Another inbound migration holds its reservation (two may never share one).
    #[error("another migration of it is already coming in")]
    AlreadyComingIn,
    /// A block write from a migration that does not hold the request's reservation.
    #[error("holds no reservation for this migration")]
    NotReserved,
    /// A move out of it (moving out, paused or in doubt) is already under way.
    #[error("a migration of it is already under way")]
    MoveUnderWay,
    /// The coordinator settled it as "not migrated here" (after a lost COMMIT reply).
    #[error("settled as not migrated by the coordinator")]
    Fenced,
    /// This worker's registration lease lapsed: no request may arrive by migration until it re-registers.
    #[error("this worker's registration lapsed: its instance number may be another worker's now")]
    Unregistered,
}

/// An event that makes no sense in the request's state: a bug in the caller, named precisely.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{request}: cannot {event} while it is {state}")]
pub struct LedgerError {
    /// The request the event was about.
    pub request: RequestId,
    /// The event that was refused, as a verb phrase (e.g. "finish", "abort a move out").
    pub event: &'static str,
    /// The state the request was in.
    pub state: State,
}

/// The answer to a submit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Hand it to the engine; first free the reservation of a stale inbound migration, if any
    /// (the migration, whose source was declared dead, aborts on its next frame or deadline).
    Run {
        /// The stale inbound migration whose reservation to free first.
        release: Option<MigrationId>,
    },
    /// Submits are idempotent by id: it is here, or finished here.
    AlreadyAccepted,
    /// Not accepted, for this reason.
    Refuse(Refusal),
}

/// The answer to an attach (re-materialised) or a live COMMIT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// Hand it to the engine.
    Attach,
    /// A retried attach or commit: it is already here.
    AlreadyHere,
}

/// What an aborted move out leaves to undo on the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resume {
    /// It was paused: resume it on the engine.
    Engine,
    /// It was still decoding (or had finished meanwhile): nothing to undo.
    Nothing,
    /// It was orphaned ([`Ledger::lapse`], [`Ledger::drop_copy`]): the cluster counts another
    /// copy, so this one is dropped rather than resumed ([`Dropped::Free`]: frozen for the final
    /// copy; [`Dropped::Cancel`]: still decoding).
    Drop(Dropped),
}

/// What dropping a copy the coordinator does not count leaves to do on the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dropped {
    /// Nothing held to drop now (a copy moving out is orphaned: dropped if its move does not land).
    Nothing,
    /// It ran here: cancel it.
    Cancel,
    /// It is frozen for a move out (paused for the final copy, or in doubt after a lost COMMIT
    /// reply): free it, as a committed move's source is.
    Free,
}

/// The coordinator's word on a move whose outcome was unknown, as the source acts on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settle {
    /// The target holds it: free the paused copy here.
    FreeSource,
    /// The target does not (and is fenced): resume it here.
    Resume,
    /// Not in doubt here (never was, or settled already): nothing to do.
    NotInDoubt,
    /// Its move out is still copying (or waiting for the COMMIT reply): nothing is done now. The
    /// move ends by itself (aborted: it resumes here; COMMIT reply lost: in doubt), and the
    /// coordinator tells it again then; acting now could leave it paused with nobody to tell.
    Underway,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Entry {
    state: State,
    /// The inbound migration whose PREPARE reserved blocks for it (not attached nor released yet).
    reserved_for: Option<MigrationId>,
    /// The reservation's move order (its PREPARE's).
    reserved_order: MoveOrder,
    /// Settled by the coordinator as "not here" up to this move order: a late PREPARE or COMMIT
    /// of a move started before is refused; a move started after may land.
    fence: Option<MoveOrder>,
    /// Attached with re-generated KV (reported in its finished record).
    rematerialized: bool,
    /// Whether the cluster counts this copy while it moves out (see [`Orphan`]).
    orphan: Orphan,
}

/// A copy moving out when the cluster stopped counting it ([`Ledger::lapse`]: the coordinator
/// evicted this worker; [`Ledger::drop_copy`]). The coordinator settled its move with the target
/// first: either the move had landed (the request lives there) or the target is fenced against
/// it, and the request was re-placed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Orphan {
    /// Counted as usual.
    #[default]
    No,
    /// Not counted: dropped unless its move lands.
    Orphaned,
    /// Re-placed here while orphaned: this placement's copy. Its move cannot land (the target is
    /// fenced against it), so it resumes here however the move ends, even with its COMMIT reply
    /// lost (nobody would settle that doubt).
    Adopted,
}

impl Entry {
    /// Nothing worth remembering (an unseen request whose reservation was freed).
    fn is_blank(&self) -> bool {
        self.state == State::Unseen && self.reserved_for.is_none() && self.fence.is_none()
    }
}

/// Every request this instance knows, and whether it accepts arrivals.
#[derive(Debug)]
pub struct Ledger {
    entries: IdMap<RequestId, Entry>,
    /// Requests held (the engine's count, without iterating the entries).
    held: usize,
    draining: bool,
    registered: bool,
}

impl Default for Ledger {
    fn default() -> Self {
        Ledger::new()
    }
}

impl Ledger {
    /// An empty ledger, accepting work, counted as registered (a worker outside any cluster, or
    /// one whose registration has not been reported lost).
    pub fn new() -> Self {
        Ledger { entries: IdMap::default(), held: 0, draining: false, registered: true }
    }

    // ------------------------------------------------------------------------- queries

    /// Where `request` stands (`Unseen` if unknown).
    pub fn state(&self, request: RequestId) -> State {
        self.entries.get(&request).map_or(State::Unseen, |e| e.state.clone())
    }

    /// Whether the engine holds `request` (running, waiting, preempted, or paused here).
    pub fn holds(&self, request: RequestId) -> bool {
        self.entries.get(&request).is_some_and(|e| e.state.is_held())
    }

    /// How many requests are held.
    pub fn held(&self) -> usize {
        self.held
    }

    /// The requests held, in id order (what a stopping worker leaves unfinished).
    pub fn unfinished(&self) -> Vec<RequestId> {
        let mut ids: Vec<RequestId> =
            self.entries.iter().filter(|(_, e)| e.state.is_held()).map(|(&id, _)| id).collect();
        ids.sort_unstable();
        ids
    }

    /// The inbound migration holding a reservation for `request`, if any.
    pub fn reserved_for(&self, request: RequestId) -> Option<MigrationId> {
        self.entries.get(&request).and_then(|e| e.reserved_for)
    }

    /// Whether the instance is draining (accepts no arrivals).
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// Whether the registration is in force (arrivals by migration accepted).
    pub fn is_registered(&self) -> bool {
        self.registered
    }

    // ------------------------------------------------------------------------- the instance

    /// Accept no more requests (submits, attaches, inbound migrations).
    pub fn drain(&mut self) {
        self.draining = true;
    }

    /// The registration lease was lost (`false`) or is held again (`true`). While it is lost the
    /// coordinator may have evicted this worker, re-placed its requests and given its number to
    /// a newcomer: no request may arrive here by a migration. Submits are still answered (the
    /// coordinator only submits to registered workers, and a refusal would end the request as
    /// rejected).
    pub fn set_registered(&mut self, registered: bool) {
        self.registered = registered;
    }

    /// The registration expired in etcd (the store said so, not a clock): the coordinator has
    /// evicted this worker and re-places every request it held. The ones running here are
    /// dropped, so that only the re-placed copy runs (a re-placement back here runs afresh);
    /// so is a copy paused in doubt (the coordinator settled its move without asking it, and no
    /// one will tell it); moves under way end by their own protocol (the coordinator settles
    /// them with the target), and are orphaned: a move that does not land drops its request
    /// rather than resuming it here, where nobody waits for it (a request held for a handoff
    /// would hold its KV for ever). The requests in `unheard` finished here but their records
    /// were not acknowledged: the coordinator re-placed them and refuses those records as late
    /// copies', so here they count as never run (placed here again, one runs afresh rather than
    /// be answered "already accepted" and never finish). Returns the dropped requests, in id
    /// order, each with what the engine must do.
    pub fn lapse(&mut self, unheard: &[RequestId]) -> Vec<(RequestId, Dropped)> {
        // Moves coming in were given up by the coordinator with this worker (their sources carry
        // on, or the requests were re-placed): fenced, so a late COMMIT is refused after this
        // worker registers again; each reservation is still freed by its migration's end.
        for e in self.entries.values_mut() {
            if e.reserved_for.is_some() {
                e.fence = e.fence.max(Some(e.reserved_order));
            }
        }
        for &id in unheard {
            if let Some(e) = self.entries.get_mut(&id).filter(|e| e.state == State::Finished) {
                e.state = State::Unseen;
                self.forget_if_blank(id);
            }
        }
        let ids: Vec<RequestId> = self.entries.iter().filter(|(_, e)| e.state.is_held()).map(|(&id, _)| id).collect();
        let mut dropped: Vec<(RequestId, Dropped)> =
            ids.into_iter().map(|id| (id, self.drop_copy(id))).filter(|&(_, d)| d != Dropped::Nothing).collect();
        dropped.sort_unstable_by_key(|&(id, _)| id);
        dropped
    }

    // ------------------------------------------------------------------------- arrivals

    /// A submit arrived (first placement, a new leader's re-submit, or a re-placement).
    pub fn submit(&mut self, request: RequestId) -> Admission {
        let draining = self.draining;
        let e = self.entries.entry(request).or_default();
        match &e.state {
            // Idempotent while it is here or once it finished here. A copy orphaned by a lapse
            // is this placement's copy again: kept if its move does not land.
            State::Running | State::MovingOut(_) | State::Paused(_) | State::InDoubt(_) | State::Finished => {
                if e.orphan == Orphan::Orphaned {
                    e.orphan = Orphan::Adopted;
                }
                Admission::AlreadyAccepted
            }
            State::Rejected(reason) => Admission::Refuse(Refusal::Rejected(reason.clone())),
            // Never here, or left by a committed migration: the leader re-placed it from the
            // start (the instance it moved to died), so it runs here afresh.
            State::Unseen | State::Left => {
                if draining {
                    return Admission::Refuse(Refusal::Draining);
                }
                let release = e.reserved_for.take();
                self.forget_if_blank(request);
                Admission::Run { release }
            }
        }
    }

    /// The engine took a submitted request.
    pub fn started(&mut self, request: RequestId) -> Result<(), LedgerError> {
        self.arrive(request, "start", false)
    }

    /// The engine can never run it (final): later submits get `reason`.
    pub fn rejected(&mut self, request: RequestId, reason: String) -> Result<(), LedgerError> {
        let e = self.entries.entry(request).or_default();
        match e.state {
            State::Unseen | State::Left => {
                e.state = State::Rejected(reason);
                Ok(())
            }
            _ => Err(LedgerError { request, event: "reject", state: e.state.clone() }),
        }
    }

    /// A request handed over whole with its state (the re-materialising path, no reservation).
    pub fn attach(&self, request: RequestId) -> Result<Arrival, Refusal> {
        if self.holds(request) {
            return Ok(Arrival::AlreadyHere);
        }
        self.accepts_migrations()?;
        Ok(Arrival::Attach)
    }

    /// The engine took an attached request.
    pub fn attached(&mut self, request: RequestId, rematerialized: bool) -> Result<(), LedgerError> {
        self.arrive(request, "attach", rematerialized)
    }

    // ------------------------------------------------------------------------- inbound live

    /// An inbound migration's PREPARE: reserve blocks for it, or say why not.
    pub fn prepare(&mut self, request: RequestId, migration: MigrationId, order: MoveOrder) -> Result<(), Refusal> {
        let e = self.entries.get(&request);
        if e.and_then(|e| e.fence).is_some_and(|fence| order <= fence) {
            return Err(Refusal::Fenced);
        }
        self.accepts_migrations()?;
        if let Some(e) = e {
            // Two migrations must not share one reservation: the first's abort would free the
            // blocks the second writes (a stale one whose source was declared dead, say).
            if e.reserved_for.is_some() {
                return Err(Refusal::AlreadyComingIn);
            }
            if e.state.is_held() {
                return Err(Refusal::AlreadyHere);
            }
        }
        let e = self.entries.entry(request).or_default();
        e.reserved_for = Some(migration);
        e.reserved_order = order;
        Ok(())
    }

    /// The engine could not reserve what a PREPARE asked for: nothing is reserved.
    pub fn reserve_failed(&mut self, request: RequestId, migration: MigrationId) {
        if let Some(e) = self.entries.get_mut(&request) {
            if e.reserved_for == Some(migration) {
                e.reserved_for = None;
            }
        }
        self.forget_if_blank(request);
    }

    /// May `migration` write a block of `request` (into its own reservation)?
    pub fn may_write(&self, request: RequestId, migration: MigrationId) -> Result<(), Refusal> {
        match self.reserved_for(request) {
            Some(m) if m == migration => Ok(()),
            _ => Err(Refusal::NotReserved),
        }
    }

    /// An inbound migration's COMMIT: attach the request on its reservation, or say why not.
    pub fn commit(&self, request: RequestId, migration: MigrationId) -> Result<Arrival, Refusal> {
        let unseen = Entry::default();
        let e = self.entries.get(&request).unwrap_or(&unseen);
        if let Some(fence) = e.fence {
            // A move with no reservation here counts as started before the fence.
            let order = if e.reserved_for == Some(migration) { e.reserved_order } else { MoveOrder::UNORDERED };
            if order <= fence {
                return Err(Refusal::Fenced);
            }
        }
        if e.state.is_held() {
            return Ok(Arrival::AlreadyHere);
        }
        if e.state == State::Finished {
            // It ran here already (re-placed from the start when its source was declared dead):
            // the old migration must not bring a second copy. One that left by a committed
            // migration may come back by another.
            return Err(Refusal::AlreadyRun);
        }
        self.accepts_migrations()?;
        if e.reserved_for != Some(migration) {
            return Err(Refusal::NotHere);
        }
        Ok(Arrival::Attach)
    }

    /// The engine attached a committed request on its reservation.
    pub fn committed_in(&mut self, request: RequestId, migration: MigrationId) -> Result<(), LedgerError> {
        match self.entries.get(&request) {
            Some(e) if e.reserved_for == Some(migration) => self.arrive(request, "attach on a reservation", false),
            _ => Err(LedgerError { request, event: "attach on a reservation", state: self.state(request) }),
        }
    }

    /// An inbound migration ended without attaching (aborted, refused, timed out). Returns whether
    /// its reservation is to be freed: only the migration's own, and only once.
    pub fn release(&mut self, request: RequestId, migration: MigrationId) -> bool {
        let Some(e) = self.entries.get_mut(&request) else { return false };
        if e.reserved_for != Some(migration) {
            return false;
        }
        e.reserved_for = None;
        self.forget_if_blank(request);
        true
    }

    /// The coordinator asks whether the move of `request` whose outcome was lost landed here.
    /// It did if the request is here, or finished here (it may finish before the coordinator
    /// asks: then the source must free its paused copy, not resume a request that is done). If
    /// not, it never will through a move the coordinator started up to `upto` (every move
    /// started so far, the one in question among them): fenced from now on for those; a move
    /// started later may still bring it here. A copy orphaned here (moving out when this worker's
    /// registration lapsed) is not the move's landing: it goes if its own move does not land, so
    /// the answer is no, and a re-placement here adopts it.
    pub fn resolve_target(&mut self, request: RequestId, upto: MoveOrder) -> bool {
        let e = self.entries.entry(request).or_default();
        if (e.state.is_held() && e.orphan != Orphan::Orphaned) || e.state == State::Finished {
            return true;
        }
        e.fence = e.fence.max(Some(upto));
        false
    }

    // ------------------------------------------------------------------------- outbound

    /// `migration` starts moving `request` out (live copy stages while it keeps decoding; the
    /// re-materialising path goes straight on to [`Ledger::pause`]).
    pub fn begin_out(&mut self, request: RequestId, migration: MigrationId) -> Result<(), Refusal> {
        let e = self.entries.get_mut(&request).ok_or(Refusal::NotHere)?;
        match e.state {
            State::Running => {
                e.state = State::MovingOut(migration);
                Ok(())
            }
            State::MovingOut(_) | State::Paused(_) | State::InDoubt(_) => Err(Refusal::MoveUnderWay),
            _ => Err(Refusal::NotHere),
        }
    }

    /// Freeze it for the final copy (the engine then stops scheduling it).
    pub fn pause(&mut self, request: RequestId, migration: MigrationId) -> Result<(), Refusal> {
        let e = self.entries.get_mut(&request).ok_or(Refusal::NotHere)?;
        match e.state {
            State::MovingOut(m) if m == migration => {
                e.state = State::Paused(migration);
                Ok(())
            }
            State::MovingOut(_) | State::Paused(_) | State::InDoubt(_) => Err(Refusal::MoveUnderWay),
            // Finished meanwhile (or never began): nothing to pause.
            _ => Err(Refusal::NotHere),
        }
    }

    /// The engine could not pause it after all: it keeps decoding, the move still open.
    pub fn pause_failed(&mut self, request: RequestId, migration: MigrationId) -> Result<(), LedgerError> {
        let e = self.entry_mut(request, "undo a pause")?;
        match e.state {
            State::Paused(m) if m == migration => {
                e.state = State::MovingOut(migration);
                Ok(())
            }
            _ => Err(LedgerError { request, event: "undo a pause", state: e.state.clone() }),
        }
    }

    /// The target confirmed `migration`'s COMMIT: free the copy here.
    pub fn commit_out(&mut self, request: RequestId, migration: MigrationId) -> Result<(), LedgerError> {
        let e = self.entry_mut(request, "free a committed move")?;
        match e.state {
            State::Paused(m) | State::InDoubt(m) if m == migration => {
                self.leave(request);
                Ok(())
            }
            _ => Err(LedgerError { request, event: "free a committed move", state: e.state.clone() }),
        }
    }

    /// `migration` aborted before COMMIT (or was refused): it carries on here.
    pub fn abort_out(&mut self, request: RequestId, migration: MigrationId) -> Result<Resume, LedgerError> {
        let Some(e) = self.entries.get_mut(&request) else { return Ok(Resume::Nothing) };
        match e.state {
            State::MovingOut(m) | State::Paused(m) if m == migration && e.orphan == Orphan::Orphaned => {
                let dropped = if matches!(e.state, State::Paused(_)) { Dropped::Free } else { Dropped::Cancel };
                self.drop_held(request);
                Ok(Resume::Drop(dropped))
            }
            State::MovingOut(m) if m == migration => {
                e.state = State::Running;
                e.orphan = Orphan::No;
                Ok(Resume::Nothing)
            }
            State::Paused(m) if m == migration => {
                e.state = State::Running;
                e.orphan = Orphan::No;
                Ok(Resume::Engine)
            }
            State::MovingOut(_) | State::Paused(_) | State::InDoubt(_) => {
                Err(LedgerError { request, event: "abort a move out", state: e.state.clone() })
            }
            // It finished while its KV was being copied (and may have been forgotten at a lapse
            // and placed here again since): nothing left to undo.
            _ => Ok(Resume::Nothing),
        }
    }

    /// `migration`'s COMMIT was sent and its reply lost: paused until the coordinator settles it
    /// (`None`). Nobody settles a move the cluster no longer counts ([`Orphan`]): an orphaned copy
    /// is freed at once (`Resume::Drop`: the target's copy lives, or a re-placement), an adopted
    /// one resumes (`Resume::Engine`: its move cannot have landed).
    pub fn unknown_out(&mut self, request: RequestId, migration: MigrationId) -> Result<Option<Resume>, LedgerError> {
        let e = self.entry_mut(request, "wait in doubt")?;
        match e.state {
            State::Paused(m) if m == migration && e.orphan == Orphan::Orphaned => {
                self.drop_held(request);
                Ok(Some(Resume::Drop(Dropped::Free)))
            }
            State::Paused(m) if m == migration && e.orphan == Orphan::Adopted => {
                e.state = State::Running;
                e.orphan = Orphan::No;
                Ok(Some(Resume::Engine))
            }
            State::Paused(m) if m == migration => {
                e.state = State::InDoubt(migration);
                Ok(None)
            }
            _ => Err(LedgerError { request, event: "wait in doubt", state: e.state.clone() }),
        }
    }

    /// The coordinator settled a move whose outcome was unknown (`committed`: the target holds
    /// it). Only a request in doubt is touched: a leader that took over settles every move its
    /// predecessor left open, and a move still copying (or long settled) must go on undisturbed
    /// (a move still copying answers [`Settle::Underway`], to be told again once it ended).
    pub fn resolve_source(&mut self, request: RequestId, committed: bool) -> Settle {
        let Some(e) = self.entries.get_mut(&request) else { return Settle::NotInDoubt };
        match e.state {
            State::InDoubt(_) => {}
            State::MovingOut(_) | State::Paused(_) => return Settle::Underway,
            _ => return Settle::NotInDoubt,
        }
        if committed {
            self.leave(request);
            Settle::FreeSource
        } else {
            e.state = State::Running;
            Settle::Resume
        }
    }

    /// The engine finished it. Returns whether its KV had been re-materialised.
    pub fn finished(&mut self, request: RequestId) -> Result<bool, LedgerError> {
        let e = self.entry_mut(request, "finish")?;
        match e.state {
            State::Running | State::MovingOut(_) => {
                // An orphan's record is refused as a late copy's: it counts as never run here
                // (placed here again, it runs afresh rather than be answered "already accepted").
                e.state = if e.orphan == Orphan::Orphaned { State::Unseen } else { State::Finished };
                e.orphan = Orphan::No;
                let rematerialized = std::mem::take(&mut e.rematerialized);
                self.held -= 1;
                self.forget_if_blank(request);
                Ok(rematerialized)
            }
            _ => Err(LedgerError { request, event: "finish", state: e.state.clone() }),
        }
    }

    /// The request's client left: stop it here. `Ok(true)`: it ran here and the engine must drop
    /// it (it counts as finished here: a late submit is answered "already accepted");
    /// `Ok(false)`: nothing runs here to stop (never here, left, finished, rejected); an error
    /// while it is moving out (the coordinator cancels it once the move ended).
    pub fn cancel(&mut self, request: RequestId) -> Result<bool, LedgerError> {
        let Some(e) = self.entries.get_mut(&request) else { return Ok(false) };
        match e.state {
            State::Running => {
                e.state = State::Finished;
                e.rematerialized = false;
                self.held -= 1;
                Ok(true)
            }
            State::MovingOut(_) | State::Paused(_) | State::InDoubt(_) => {
                Err(LedgerError { request, event: "cancel", state: e.state.clone() })
            }
            _ => Ok(false),
        }
    }

    /// The coordinator counts another copy of it (re-placed while this worker was cut off or
    /// stopped, this one announced afterwards): a copy held here is dropped, as if it never came
    /// (a later placement here runs it afresh), or, moving out, orphaned as by
    /// [`Ledger::lapse`] (dropped if its move does not land).
    pub fn drop_copy(&mut self, request: RequestId) -> Dropped {
        let Some(e) = self.entries.get_mut(&request) else { return Dropped::Nothing };
        let dropped = match e.state {
            State::Running => Dropped::Cancel,
            State::InDoubt(_) => Dropped::Free,
            State::MovingOut(_) | State::Paused(_) => {
                e.orphan = Orphan::Orphaned;
                return Dropped::Nothing;
            }
            _ => return Dropped::Nothing,
        };
        self.drop_held(request);
        dropped
    }

    /// The coordinator refused the final record of this copy as a late copy's (it had re-placed
    /// the request elsewhere): it is forgotten as finished here, so that the request, still
    /// running elsewhere, may come back (handed off or moved here, or placed here again) rather
    /// than be refused as "already run", or answered "already accepted" and never run. Nothing
    /// that runs here is touched. Returns whether it had finished here.
    pub fn forget_finished(&mut self, request: RequestId) -> bool {
        let Some(e) = self.entries.get_mut(&request).filter(|e| e.state == State::Finished) else { return false };
        e.state = State::Unseen;
        self.forget_if_blank(request);
        true
    }

    /// Whether a copy moving out here was orphaned ([`Ledger::lapse`], [`Ledger::drop_copy`]):
    /// the cluster counts another copy, and this one is dropped unless its move lands.
    pub fn is_orphaned(&self, request: RequestId) -> bool {
        self.entries.get(&request).is_some_and(|e| e.orphan == Orphan::Orphaned)
    }

    // ------------------------------------------------------------------------- helpers

    /// Whether requests may arrive by a migration now.
    fn accepts_migrations(&self) -> Result<(), Refusal> {
        if self.draining {
            Err(Refusal::Draining)
        } else if !self.registered {
            Err(Refusal::Unregistered)
        } else {
            Ok(())
        }
    }

    /// It runs here now (submitted, attached, or committed in).
    fn arrive(&mut self, request: RequestId, event: &'static str, rematerialized: bool) -> Result<(), LedgerError> {
        let e = self.entries.entry(request).or_default();
        if e.state.is_held() {
            return Err(LedgerError { request, event, state: e.state.clone() });
        }
        e.state = State::Running;
        // An attach lands on the request's reservation, if it had one; a submit freed it first.
        e.reserved_for = None;
        e.rematerialized = rematerialized;
        self.held += 1;
        Ok(())
    }

    /// It left by a committed migration.
    fn leave(&mut self, request: RequestId) {
        if let Some(e) = self.entries.get_mut(&request) {
            e.state = State::Left;
            e.rematerialized = false;
            e.orphan = Orphan::No;
            self.held -= 1;
        }
    }

    /// A held copy the cluster does not count is dropped: as if never here (a re-placement runs
    /// afresh).
    fn drop_held(&mut self, request: RequestId) {
        if let Some(e) = self.entries.get_mut(&request) {
            e.state = State::Unseen;
            e.rematerialized = false;
            e.orphan = Orphan::No;
            self.held -= 1;
        }
        self.forget_if_blank(request);
    }

    fn entry_mut(&mut self, request: RequestId, event: &'static str) -> Result<&mut Entry, LedgerError> {
        self.entries.get_mut(&request).ok_or(LedgerError { request, event, state: State::Unseen })
    }

    fn forget_if_blank(&mut self, request: RequestId) {
        if self.entries.get(&request).is_some_and(Entry::is_blank) {
            self.entries.remove(&request);
        }
    }
}

#[cfg(test)]
mod tests;
