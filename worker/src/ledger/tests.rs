//! The ledger alone (event tables), then in a modelled cluster: three instances, each with its own
//! ledger, and a coordinator that places, moves, settles and re-places requests as the real one
//! does (except where `Cluster::evict` and `Cluster::resolve` say what it must do and does not
//! yet), driven through random sequences of submits, moves, lost replies, kills, restarts,
//! lapsed registrations and cancellations. After every step: every unfinished request is held
//! where the coordinator believes it is, no request runs in two places or after it finished, and
//! every reservation is one migration's and is freed exactly once.

use super::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const R: RequestId = RequestId(7);
const M1: MigrationId = MigrationId(1);
const M2: MigrationId = MigrationId(2);

/// Migration `m`'s order: the `m`-th move of the leader of term 1.
fn order(m: MigrationId) -> MoveOrder {
    MoveOrder { term: 1, seq: m.0 }
}

fn running() -> Ledger {
    let mut l = Ledger::new();
    assert_eq!(l.submit(R), Admission::Run { release: None });
    l.started(R).unwrap();
    l
}

#[test]
fn submits_are_idempotent_while_here_and_run_afresh_after_leaving() {
    let mut l = running();
    assert_eq!(l.submit(R), Admission::AlreadyAccepted);
    l.begin_out(R, M1).unwrap();
    assert_eq!(l.submit(R), Admission::AlreadyAccepted, "moving out is still here");
    l.pause(R, M1).unwrap();
    l.commit_out(R, M1).unwrap();
    assert_eq!((l.state(R), l.held()), (State::Left, 0));
    // The instance it moved to died: re-placed here from the start, it runs (commit 813e12a).
    assert_eq!(l.submit(R), Admission::Run { release: None });
    l.started(R).unwrap();
    assert_eq!(l.finished(R), Ok(false));
    assert_eq!(l.submit(R), Admission::AlreadyAccepted, "finished here: a duplicate");
    assert_eq!(l.held(), 0);

    let mut l = Ledger::new();
    assert_eq!(l.submit(R), Admission::Run { release: None });
    l.rejected(R, "too large".into()).unwrap();
    assert_eq!(l.submit(R), Admission::Refuse(Refusal::Rejected("too large".into())));
    l.drain();
    assert_eq!(l.submit(RequestId(8)), Admission::Refuse(Refusal::Draining));
}

#[test]
fn a_reservation_is_one_migrations_and_is_freed_once() {
    let mut l = Ledger::new();
    l.prepare(R, M1, order(M1)).unwrap();
    assert_eq!(l.prepare(R, M2, order(M2)), Err(Refusal::AlreadyComingIn), "a second inbound migration");
    assert_eq!(l.may_write(R, M2), Err(Refusal::NotReserved));
    assert_eq!(l.commit(R, M2), Err(Refusal::NotHere));
    assert!(!l.release(R, M2), "not the refused one's to free");
    assert!(l.release(R, M1));
    assert!(!l.release(R, M1), "freed once");
    assert_eq!(l.state(R), State::Unseen);
    // A fresh submit takes over from a stale inbound migration: its reservation goes.
    l.prepare(R, M2, order(M2)).unwrap();
    assert_eq!(l.submit(R), Admission::Run { release: Some(M2) });
    l.started(R).unwrap();
    assert!(!l.release(R, M2), "already freed by the submit");
    assert_eq!(l.commit(R, M2), Ok(Arrival::AlreadyHere), "a late commit finds it here");
    assert_eq!(l.prepare(R, M1, order(M1)), Err(Refusal::AlreadyHere));
}

#[test]
fn a_commit_attaches_on_its_reservation_unless_run_here_or_fenced() {
    let mut l = Ledger::new();
    l.prepare(R, M1, order(M1)).unwrap();
    l.may_write(R, M1).unwrap();
    assert_eq!(l.commit(R, M1), Ok(Arrival::Attach));
    l.committed_in(R, M1).unwrap();
    assert_eq!((l.state(R), l.reserved_for(R), l.held()), (State::Running, None, 1));
    assert_eq!(l.commit(R, M1), Ok(Arrival::AlreadyHere), "a retried commit");
    l.finished(R).unwrap();
    assert_eq!(l.prepare(R, M2, order(M2)), Ok(()), "reserving is allowed...");
    assert_eq!(l.commit(R, M2), Err(Refusal::AlreadyRun), "...but it ran here: no second copy");
    assert!(l.release(R, M2));

    // Settled as "not here" by the coordinator up to the moves started so far (M1 the last): M1's
    // late commit is refused, and so is any move started before the fence; one started after
    // it may land.
    let mut l = Ledger::new();
    l.prepare(R, M1, order(M1)).unwrap();
    assert!(!l.resolve_target(R, order(M1)));
    assert_eq!(l.commit(R, M1), Err(Refusal::Fenced));
    assert!(l.release(R, M1));
    assert_eq!(l.prepare(R, M1, order(M1)), Err(Refusal::Fenced), "a stale PREPARE");
    assert_eq!(l.prepare(R, M2, MoveOrder::UNORDERED), Err(Refusal::Fenced), "a move no leader ordered");
    l.prepare(R, M2, order(M2)).unwrap();
    assert_eq!(l.commit(R, M2), Ok(Arrival::Attach), "a move started after the fence lands");
    // A later leader's moves all order after every move of the one before; a fence never recedes.
    let mut l = Ledger::new();
    assert!(!l.resolve_target(R, MoveOrder { term: 2, seq: 0 }));
    assert!(!l.resolve_target(R, order(M1)));
    assert_eq!(l.prepare(R, M2, order(M2)), Err(Refusal::Fenced), "the earlier leader's move");
    assert_eq!(l.prepare(R, M2, MoveOrder { term: 2, seq: 1 }), Ok(()));
}

#[test]
fn a_target_that_finished_the_request_answers_held() {
    let mut l = Ledger::new();
    l.prepare(R, M1, order(M1)).unwrap();
    l.committed_in(R, M1).unwrap();
    l.finished(R).unwrap();
    assert!(l.resolve_target(R, order(M1)), "it landed here and is done: the source must not resume it");
}

#[test]
fn a_cancel_stops_what_runs_here_once_and_waits_out_a_move() {
    let mut l = running();
    assert_eq!((l.cancel(R), l.held()), (Ok(true), 0), "running: stopped, no longer held");
    assert_eq!(l.cancel(R), Ok(false), "twice: nothing left to stop");
    assert_eq!(l.submit(R), Admission::AlreadyAccepted, "a late submit does not run it again");
    assert_eq!(l.cancel(RequestId(99)), Ok(false), "never here");
    // Moving out: the coordinator cancels once the move ended, wherever the request is then.
    let mut l = running();
    l.begin_out(R, M1).unwrap();
    assert!(l.cancel(R).is_err());
    l.pause(R, M1).unwrap();
    assert!(l.cancel(R).is_err());
    l.commit_out(R, M1).unwrap();
    assert_eq!((l.cancel(R), l.held()), (Ok(false), 0), "left by the move: the target stops it");
}

#[test]
fn an_expired_registration_drops_what_runs_here_and_a_re_placement_runs_afresh() {
    let mut l = running();
    let other = RequestId(8);
    assert_eq!(l.submit(other), Admission::Run { release: None });
    l.started(other).unwrap();
    l.begin_out(other, M1).unwrap();
    let done = RequestId(9);
    assert_eq!(l.submit(done), Admission::Run { release: None });
    l.started(done).unwrap();
    l.finished(done).unwrap();
    assert_eq!(l.held(), 2);
    assert_eq!(l.lapse(&[]), vec![(R, Dropped::Cancel)], "only what runs: a move under way ends by its protocol");
    assert_eq!((l.state(R), l.held()), (State::Unseen, 1));
    assert_eq!(l.state(done), State::Finished, "a finished request stays answered");
    assert_eq!(l.submit(R), Admission::Run { release: None }, "re-placed back here: runs afresh");
    assert!(l.lapse(&[]).iter().all(|&(id, _)| id == R));
    // One whose record the coordinator never acknowledged was re-placed: it counts as never run.
    assert!(l.lapse(&[done]).is_empty());
    assert_eq!(l.state(done), State::Unseen);
    assert_eq!(l.submit(done), Admission::Run { release: None }, "placed here again: runs afresh");
}

#[test]
fn a_move_out_orphaned_by_a_lapse_is_dropped_unless_it_lands_or_is_placed_here_again() {
    // Three moves out when the registration expires: copying, paused, and in doubt.
    let (copying, paused, doubt) = (RequestId(1), RequestId(2), RequestId(3));
    let mut l = Ledger::new();
    for (r, m) in [(copying, M1), (paused, M2), (doubt, MigrationId(3))] {
        assert_eq!(l.submit(r), Admission::Run { release: None });
        l.started(r).unwrap();
        l.begin_out(r, m).unwrap();
    }
    l.pause(paused, M2).unwrap();
    l.pause(doubt, MigrationId(3)).unwrap();
    assert_eq!(l.unknown_out(doubt, MigrationId(3)), Ok(None));
    assert_eq!(l.lapse(&[]), vec![(doubt, Dropped::Free)], "in doubt: nobody will settle it here");
    assert_eq!((l.held(), l.state(doubt)), (2, State::Unseen));
    assert!(l.is_orphaned(copying) && l.is_orphaned(paused));
    // The moves do not land: dropped, not resumed (the coordinator re-placed them).
    assert_eq!(l.abort_out(copying, M1), Ok(Resume::Drop(Dropped::Cancel)));
    assert_eq!(l.abort_out(paused, M2), Ok(Resume::Drop(Dropped::Free)));
    assert_eq!((l.held(), l.state(copying), l.state(paused)), (0, State::Unseen, State::Unseen));
    assert_eq!(l.submit(copying), Admission::Run { release: None }, "placed here again: runs afresh");
    l.started(copying).unwrap();

    // An orphan that lands is simply gone; one placed here again first is this placement's copy.
    let mut l = running();
    l.begin_out(R, M1).unwrap();
    l.pause(R, M1).unwrap();
    assert!(l.lapse(&[]).is_empty());
    l.commit_out(R, M1).unwrap();
    assert_eq!((l.state(R), l.held(), l.is_orphaned(R)), (State::Left, 0, false));
    let mut l = running();
    l.begin_out(R, M1).unwrap();
    assert!(l.lapse(&[]).is_empty());
    assert_eq!(l.submit(R), Admission::AlreadyAccepted, "re-placed back here while moving out");
    assert_eq!(l.abort_out(R, M1), Ok(Resume::Nothing));
    assert_eq!(l.state(R), State::Running, "adopted: it carries on here");
    l.begin_out(R, M2).unwrap();
    l.pause(R, M2).unwrap();
    let _ = l.lapse(&[]);
    assert_eq!(l.submit(R), Admission::AlreadyAccepted);
    assert_eq!(l.unknown_out(R, M2), Ok(Some(Resume::Engine)), "adopted: its move cannot have landed");
    assert_eq!((l.state(R), l.held()), (State::Running, 1));
    // An orphan whose COMMIT reply is lost is freed at once; one resolved "not held" is dropped.
    let mut l = running();
    l.begin_out(R, M1).unwrap();
    l.pause(R, M1).unwrap();
    let _ = l.lapse(&[]);
    assert_eq!(l.unknown_out(R, M1), Ok(Some(Resume::Drop(Dropped::Free))));
    assert_eq!((l.state(R), l.held()), (State::Unseen, 0));
    assert_eq!(l.resolve_source(R, false), Settle::NotInDoubt);
}

#[test]
fn a_copy_the_coordinator_does_not_count_is_dropped_and_may_be_placed_again() {
    let mut l = running();
    assert_eq!(l.drop_copy(R), Dropped::Cancel);
    assert_eq!((l.state(R), l.held()), (State::Unseen, 0));
    assert_eq!(l.drop_copy(R), Dropped::Nothing, "once");
    assert_eq!(l.submit(R), Admission::Run { release: None }, "not 'already accepted': a cancel would lose it");
    l.started(R).unwrap();
    l.begin_out(R, M1).unwrap();
    assert_eq!(l.drop_copy(R), Dropped::Nothing, "moving out: orphaned");
    assert!(l.is_orphaned(R));
    assert_eq!(l.abort_out(R, M1), Ok(Resume::Drop(Dropped::Cancel)));
    let done = RequestId(9);
    assert_eq!(l.submit(done), Admission::Run { release: None });
    l.started(done).unwrap();
    l.finished(done).unwrap();
    assert_eq!(l.submit(done), Admission::AlreadyAccepted);
    assert_eq!(l.drop_copy(done), Dropped::Nothing);
    assert_eq!(l.state(done), State::Finished);
    // Its record refused as a late copy's: forgotten, so it may come back by a move or a placement.
    let live = RequestId(10);
    assert_eq!(l.submit(live), Admission::Run { release: None });
    l.started(live).unwrap();
    assert!(!l.forget_finished(live), "running here: untouched");
    assert_eq!(l.state(live), State::Running);
    assert!(l.forget_finished(done));
    assert_eq!(l.state(done), State::Unseen);
    l.prepare(done, M2, order(M2)).unwrap();
    assert_eq!(l.commit(done, M2), Ok(Arrival::Attach), "not 'already run'");
    l.release(done, M2);
    assert_eq!(l.submit(done), Admission::Run { release: None }, "not 'already accepted'");
}

#[test]
fn a_lapsed_registration_refuses_arrivals_by_migration_but_not_submits() {
    let mut l = Ledger::new();
    l.prepare(R, M1, order(M1)).unwrap();
    l.set_registered(false);
    assert_eq!(l.commit(R, M1), Err(Refusal::Unregistered));
    assert_eq!(l.prepare(RequestId(8), M2, order(M2)), Err(Refusal::Unregistered));
    assert_eq!(l.attach(RequestId(8)), Err(Refusal::Unregistered));
    assert_eq!(l.submit(RequestId(9)), Admission::Run { release: None });
    assert!(l.release(R, M1));
    l.set_registered(true);
    assert_eq!(l.prepare(RequestId(8), M2, order(M2)), Ok(()));
}

#[test]
fn only_the_migration_that_began_a_move_pauses_commits_or_resumes_it() {
    let mut l = running();
    l.begin_out(R, M1).unwrap();
    assert_eq!(l.begin_out(R, M2), Err(Refusal::MoveUnderWay));
    assert_eq!(l.pause(R, M2), Err(Refusal::MoveUnderWay));
    assert!(l.abort_out(R, M2).is_err(), "another migration's abort must not resume this one");
    l.pause(R, M1).unwrap();
    let e = l.commit_out(R, M2).unwrap_err();
    assert_eq!(e.to_string(), "req-7: cannot free a committed move while it is paused for the final copy (mig-1)");
    assert_eq!(l.abort_out(R, M1), Ok(Resume::Engine));
    assert_eq!(l.state(R), State::Running);
    // Lost COMMIT reply: in doubt until the coordinator says.
    l.begin_out(R, M2).unwrap();
    assert_eq!(l.abort_out(R, M2), Ok(Resume::Nothing), "not paused yet: nothing to resume");
    l.begin_out(R, M2).unwrap();
    l.pause(R, M2).unwrap();
    l.unknown_out(R, M2).unwrap();
    assert_eq!(l.resolve_source(RequestId(8), true), Settle::NotInDoubt);
    assert_eq!(l.resolve_source(R, false), Settle::Resume);
    assert_eq!(l.resolve_source(R, false), Settle::NotInDoubt, "settled once");
    l.begin_out(R, M1).unwrap();
    l.pause(R, M1).unwrap();
    l.unknown_out(R, M1).unwrap();
    assert_eq!(l.resolve_source(R, true), Settle::FreeSource);
    assert_eq!((l.state(R), l.held()), (State::Left, 0));
    // Finished while its KV was being copied: the move's pause finds nothing, its abort undoes nothing.
    let mut l = running();
    l.begin_out(R, M1).unwrap();
    l.finished(R).unwrap();
    assert_eq!(l.pause(R, M1), Err(Refusal::NotHere));
    assert_eq!(l.abort_out(R, M1), Ok(Resume::Nothing));
    assert_eq!(l.begin_out(RequestId(8), M1), Err(Refusal::NotHere));
}

// ----------------------------------------------------------------------------- cluster model

const INSTANCES: usize = 3;

/// One worker process. A restarted worker, or a newcomer that claimed a lapsed instance number,
/// is a new process with a fresh ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Proc {
    instance: usize,
    generation: u32,
}

#[derive(Debug)]
struct Process {
    id: Proc,
    ledger: Ledger,
}

/// The source's half of a move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    Copying,
    Paused,
    InDoubt,
}

#[derive(Debug)]
struct Move {
    id: MigrationId,
    request: RequestId,
    from: Proc,
    to: Proc,
    /// The source's half, while its migration task runs.
    source: Option<Source>,
    /// Whether the target's machine still runs (it holds its reservation until it ends).
    target: bool,
    /// Whether the coordinator waits for this move's outcome (not once it settled the request
    /// otherwise: the request finished, or the source was evicted).
    tracked: bool,
}

#[derive(Clone, Debug)]
enum Op {
    /// A client's request, placed on instance `to` (or the next registered one).
    Submit {
        to: u8,
    },
    /// A new leader re-submits an unfinished request to its owner.
    Resubmit {
        pick: u8,
    },
    /// ... or a finished one whose record it has not stored yet, to where it finished.
    ResubmitFinished {
        pick: u8,
    },
    /// A request finishes; `recorded`: the coordinator stores its record at once (else it sits
    /// in the worker's log until [`Op::Deliver`], and is lost if the worker dies first).
    Finish {
        pick: u8,
        recorded: bool,
    },
    Deliver {
        pick: u8,
    },
    /// Its client left: the coordinator forgets a request that is not moving and cancels it on
    /// its owner (during a move the real one waits for the move to end).
    Cancel {
        pick: u8,
    },
    /// The coordinator moves a request (PASCAL at its phase boundary): source begins, target reserves.
    StartMove {
        pick: u8,
        to: u8,
    },
    Pause {
        pick: u8,
    },
    /// COMMIT: the target attaches or refuses; `reply_lost`: the source never hears which.
    Commit {
        pick: u8,
        reply_lost: bool,
    },
    /// The source gives up (its deadline, a broken connection) before the target notices.
    SourceAbort {
        pick: u8,
    },
    /// The target's machine ends (its deadline): reservation released; the source aborts too.
    TargetAbort {
        pick: u8,
    },
    /// The coordinator settles a move whose outcome is unknown.
    Resolve {
        pick: u8,
    },
    /// A leader that took over settles a move its predecessor left open while the move is still
    /// copying or paused: the target is asked (and fenced unless it holds the request), and the
    /// source, told which copy lives, leaves the move undisturbed and says so; it is told again
    /// once the move has ended ([`Op::Resolve`], or nothing when the move aborted).
    SettleEarly {
        pick: u8,
    },
    /// kill -9: the coordinator evicts the instance and re-places its requests (on `to`...).
    Kill {
        instance: u8,
        to: u8,
    },
    Restart {
        instance: u8,
    },
    /// The registration lease lapses (a partition from etcd): the coordinator evicts the
    /// instance and re-places its requests, but the process lives on and its migrations go on;
    /// `reclaimed`: a newcomer claims the number at once.
    LeaseLost {
        instance: u8,
        to: u8,
        reclaimed: bool,
    },
    /// A process whose lease lapsed (stopped, cut off) comes back under its free number: it
    /// learns of the lapse first (drops what it held; its moves out are orphaned), then registers
    /// again, and the coordinator reads its log from then on.
    Rejoin {
        pick: u8,
    },
    /// A process announces a request it holds (a prefill held for its handoff) that the
    /// coordinator counts elsewhere: the coordinator has it dropped there.
    Announce {
        pick: u8,
    },
    /// A submit the coordinator sent to instance `to` just before it re-placed the request
    /// elsewhere arrives after all: a copy the cluster does not count runs there until it is
    /// dropped ([`Op::Announce`]) or finishes (its record refused, [`Op::ForgetLate`]).
    StaleSubmit {
        pick: u8,
        to: u8,
    },
    /// The coordinator, having refused a finished record as a late copy's, has that copy
    /// forgotten where it finished (the drop arrives after whatever happened meanwhile), then
    /// submits the request there again if it was placed there since.
    ForgetLate {
        pick: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let b = any::<u8>;
    prop_oneof![
        4 => b().prop_map(|to| Op::Submit { to }),
        1 => b().prop_map(|pick| Op::Resubmit { pick }),
        1 => b().prop_map(|pick| Op::ResubmitFinished { pick }),
        2 => (b(), any::<bool>()).prop_map(|(pick, recorded)| Op::Finish { pick, recorded }),
        1 => b().prop_map(|pick| Op::Deliver { pick }),
        1 => b().prop_map(|pick| Op::Cancel { pick }),
        4 => (b(), b()).prop_map(|(pick, to)| Op::StartMove { pick, to }),
        3 => b().prop_map(|pick| Op::Pause { pick }),
        3 => (b(), any::<bool>()).prop_map(|(pick, reply_lost)| Op::Commit { pick, reply_lost }),
        2 => b().prop_map(|pick| Op::SourceAbort { pick }),
        2 => b().prop_map(|pick| Op::TargetAbort { pick }),
        2 => b().prop_map(|pick| Op::Resolve { pick }),
        1 => b().prop_map(|pick| Op::SettleEarly { pick }),
        1 => (b(), b()).prop_map(|(instance, to)| Op::Kill { instance, to }),
        1 => b().prop_map(|instance| Op::Restart { instance }),
        1 => (b(), b(), any::<bool>()).prop_map(|(instance, to, reclaimed)| Op::LeaseLost { instance, to, reclaimed }),
        1 => b().prop_map(|pick| Op::Rejoin { pick }),
        1 => b().prop_map(|pick| Op::Announce { pick }),
        1 => b().prop_map(|pick| Op::ForgetLate { pick }),
        1 => (b(), b()).prop_map(|(pick, to)| Op::StaleSubmit { pick, to }),
    ]
}

fn nth<T: Copy>(items: &[T], pick: u8) -> Option<T> {
    (!items.is_empty()).then(|| items[pick as usize % items.len()])
}

/// The cluster: its processes, the coordinator's view, and the engines' reservations.
struct Cluster {
    /// The registered process of each instance number (`None`: down, or not claimed yet).
    current: Vec<Option<Process>>,
    generations: Vec<u32>,
    /// Evicted after their registration lapsed, still running (until they notice and stop).
    zombies: Vec<Process>,
    /// Coordinator: where each unfinished request lives.
    owner: BTreeMap<RequestId, usize>,
    /// Coordinator: the open move of a request.
    moving: BTreeMap<RequestId, MigrationId>,
    /// Coordinator: finished requests, and the process whose record reported each.
    finished: BTreeMap<RequestId, Proc>,
    /// Finished records still in a worker's log, not yet stored by the coordinator.
    unrecorded: BTreeMap<RequestId, Proc>,
    /// Finished records in the log of a process whose registration lapsed (nobody reads it
    /// until it rejoins).
    late: BTreeSet<(Proc, RequestId)>,
    /// Finished records the coordinator refused as late copies', their copies not yet forgotten.
    refused: Vec<(Proc, RequestId)>,
    /// Forgets the coordinator could not send (the process was a zombie): sent when it rejoins.
    pending_forgets: Vec<(Proc, RequestId)>,
    /// Copies started by a submit that arrived after the request was placed elsewhere.
    stale: BTreeSet<(Proc, RequestId)>,
    moves: Vec<Move>,
    /// What the engines have reserved, and for which migration.
    reservations: BTreeMap<(Proc, RequestId), MigrationId>,
    next_request: u64,
    next_move: u64,
}

impl Cluster {
    /// What the coordinator fences a target up to: every move started so far (move `k` is the
    /// `k`-th of one leader's).
    fn fence_upto(&self) -> MoveOrder {
        order(MigrationId(self.next_move - 1))
    }

    /// The coordinator asks the process registered under `instance` now whether it holds
    /// `request` (fencing it there up to every move started so far if not); nobody there: no.
    fn ask_target(&mut self, instance: usize, request: RequestId) -> bool {
        let upto = self.fence_upto();
        self.current[instance].as_mut().is_some_and(|p| p.ledger.resolve_target(request, upto))
    }

    fn new() -> Self {
        Cluster {
            current: (0..INSTANCES)
                .map(|i| Some(Process { id: Proc { instance: i, generation: 0 }, ledger: Ledger::new() }))
                .collect(),
            generations: vec![0; INSTANCES],
            zombies: Vec::new(),
            owner: BTreeMap::new(),
            moving: BTreeMap::new(),
            finished: BTreeMap::new(),
            unrecorded: BTreeMap::new(),
            late: BTreeSet::new(),
            refused: Vec::new(),
            pending_forgets: Vec::new(),
            stale: BTreeSet::new(),
            moves: Vec::new(),
            reservations: BTreeMap::new(),
            next_request: 1,
            next_move: 1,
        }
    }

    fn up(&self) -> Vec<usize> {
        (0..INSTANCES).filter(|&i| self.current[i].is_some()).collect()
    }

    /// A process still running (registered, or a zombie).
    fn process(&mut self, p: Proc) -> Option<&mut Process> {
        match &mut self.current[p.instance] {
            Some(c) if c.id == p => Some(c),
            _ => self.zombies.iter_mut().find(|z| z.id == p),
        }
    }

    fn ledger(&mut self, p: Proc) -> &mut Ledger {
        &mut self.process(p).unwrap_or_else(|| panic!("{p:?} is not running")).ledger
    }

    fn reserve(&mut self, at: Proc, request: RequestId, m: MigrationId) {
        if let Some(held) = self.reservations.insert((at, request), m) {
            panic!(
                "{request} at {at:?}: {m} reserved blocks that {held} still holds (one reservation, two migrations)"
            );
        }
    }

    fn free(&mut self, at: Proc, request: RequestId, m: MigrationId, why: &str) {
        match self.reservations.remove(&(at, request)) {
            Some(held) if held == m => {}
            other => panic!("{request} at {at:?}: {why} freed {m}'s reservation, but the engine holds {other:?}"),
        }
    }

    /// A submit to `to`, executed as the driver does.
    fn submit(&mut self, to: Proc, request: RequestId) {
        match self.ledger(to).submit(request) {
            Admission::Run { release } => {
                if let Some(m) = release {
                    self.free(to, request, m, "a fresh submit");
                }
                self.ledger(to).started(request).unwrap();
            }
            Admission::AlreadyAccepted => {}
            Admission::Refuse(_) => {
                // The coordinator ends a refused request as rejected.
                self.owner.remove(&request);
                self.moving.remove(&request);
                self.finished.insert(request, to);
            }
        }
    }

    /// The source's half ends by an abort (its migration task resumes the request).
    fn source_aborts(&mut self, k: usize) {
        let (from, request, id) = (self.moves[k].from, self.moves[k].request, self.moves[k].id);
        if self.moves[k].source.take().is_some() && self.process(from).is_some() {
            let before = self.ledger(from).state(request);
            match before {
                State::MovingOut(m) | State::Paused(m) if m == id => {
                    self.ledger(from).abort_out(request, id).unwrap();
                }
                // Finished meanwhile (perhaps forgotten at a lapse, placed there again and moving
                // out by another migration since): this abort changes nothing.
                _ => {
                    let _ = self.ledger(from).abort_out(request, id);
                    assert_eq!(self.ledger(from).state(request), before, "{id}'s late abort of {request}");
                }
            }
        }
        self.settled(k, None);
    }

    /// The target's machine ends without attaching: it releases its reservation, if it is its.
    fn target_ends(&mut self, k: usize) {
        let (to, request, id) = (self.moves[k].to, self.moves[k].request, self.moves[k].id);
        if std::mem::take(&mut self.moves[k].target) && self.process(to).is_some() {
            if self.ledger(to).release(request, id) {
                self.free(to, request, id, "the target's abort");
            } else {
                assert_ne!(self.reservations.get(&(to, request)), Some(&id), "{id}'s reservation of {request} leaked");
            }
        }
    }

    /// The coordinator learns how move `k` ended (`Some(instance)`: the request lives there now).
    fn settled(&mut self, k: usize, on: Option<usize>) {
        let m = &mut self.moves[k];
        if !std::mem::take(&mut m.tracked) {
            return;
        }
        let request = m.request;
        self.moving.remove(&request);
        if let (Some(i), Some(o)) = (on, self.owner.get_mut(&request)) {
            *o = i;
        }
    }

    /// The coordinator saw `instance`'s registration go: its requests start over elsewhere, except
    /// one whose open move may have landed on its target (asked first, which fences it there if
    /// not). The real controller re-places those too without asking: a move that committed with
    /// its reply lost, or a partitioned source's late COMMIT, then leaves a second copy.
    fn evict(&mut self, instance: usize, to: u8) {
        // Its moves of requests that finished meanwhile: nothing left to settle.
        for k in 0..self.moves.len() {
            let m = &self.moves[k];
            if m.tracked && m.from.instance == instance && !self.owner.contains_key(&m.request) {
                self.settled(k, None);
            }
        }
        let orphans: Vec<RequestId> = self.owner.iter().filter(|(_, &i)| i == instance).map(|(&r, _)| r).collect();
        for (n, request) in orphans.into_iter().enumerate() {
            if let Some(k) = self.moves.iter().position(|m| m.tracked && m.request == request) {
                self.moves[k].tracked = false;
                self.moving.remove(&request);
                let target = self.moves[k].to;
                let held = self.ask_target(target.instance, request);
                if held {
                    self.owner.insert(request, target.instance);
                    continue;
                }
            }
            let up = self.up();
            let j = nth(&up, to.wrapping_add(n as u8)).expect("evictions leave an instance up");
            self.owner.insert(request, j);
            let p = self.current[j].as_ref().unwrap().id;
            self.submit(p, request);
        }
    }

    /// The coordinator has `p` forget its refused late copy of `request`, and submits the request
    /// there again if it was placed there meanwhile.
    fn forget_late(&mut self, p: Proc, request: RequestId) {
        self.ledger(p).forget_finished(request);
        if self.owner.get(&request) == Some(&p.instance) {
            self.submit(p, request);
        }
    }

    /// A process stops for good (killed, or a zombie at the end): its engine's memory goes.
    fn process_gone(&mut self, p: Proc) {
        self.reservations.retain(|(at, _), _| *at != p);
        self.unrecorded.retain(|_, at| *at != p); // its log is gone with it
        self.pending_forgets.retain(|(at, _)| *at != p);
        self.late.retain(|(at, _)| *at != p);
        for m in &mut self.moves {
            if m.from == p {
                m.source = None;
            }
            if m.to == p {
                m.target = false;
            }
        }
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Submit { to } => {
                let Some(i) = nth(&self.up(), to) else { return };
                let request = RequestId(self.next_request);
                self.next_request += 1;
                self.owner.insert(request, i);
                let p = self.current[i].as_ref().unwrap().id;
                assert_eq!(self.ledger(p).submit(request), Admission::Run { release: None }, "a new request");
                self.ledger(p).started(request).unwrap();
            }
            Op::Resubmit { pick } => {
                let settled: Vec<RequestId> =
                    self.owner.keys().filter(|r| !self.moving.contains_key(r)).copied().collect();
                let Some(request) = nth(&settled, pick) else { return };
                let Some(p) = self.current[self.owner[&request]].as_ref().map(|p| p.id) else { return };
                self.submit(p, request);
            }
            Op::ResubmitFinished { pick } => {
                let done: Vec<(RequestId, Proc)> = self.finished.iter().map(|(&r, &p)| (r, p)).collect();
                let Some((request, p)) = nth(&done, pick) else { return };
                if self.current[p.instance].as_ref().is_some_and(|c| c.id == p) {
                    self.submit(p, request);
                }
            }
            Op::Finish { pick, recorded } => {
                let mut running = Vec::new();
                let procs: Vec<Proc> = self.current.iter().flatten().chain(&self.zombies).map(|p| p.id).collect();
                for p in procs {
                    for r in 1..self.next_request {
                        if matches!(self.ledger(p).state(RequestId(r)), State::Running | State::MovingOut(_)) {
                            running.push((p, RequestId(r)));
                        }
                    }
                }
                let Some((p, request)) = nth(&running, pick) else { return };
                self.ledger(p).finished(request).unwrap();
                if self.zombies.iter().any(|z| z.id == p) {
                    self.late.insert((p, request)); // nobody reads a zombie's log
                    return;
                }
                if !self.counts(p, request) {
                    // A late copy (a rejoined process, or a late submit's): its record is
                    // refused, and the copy forgotten there in turn.
                    self.refused.push((p, request));
                    return;
                }
                self.unrecorded.insert(request, p);
                if recorded {
                    self.record(request);
                }
            }
            Op::Deliver { pick } => {
                let pending: Vec<RequestId> = self.unrecorded.keys().copied().collect();
                if let Some(request) = nth(&pending, pick) {
                    self.record(request);
                }
            }
            Op::Cancel { pick } => {
                let idle: Vec<(RequestId, usize)> =
                    self.owner.iter().filter(|(r, _)| !self.moving.contains_key(r)).map(|(&r, &i)| (r, i)).collect();
                let Some((request, i)) = nth(&idle, pick) else { return };
                let Some(p) = self.current[i].as_ref().map(|p| p.id) else { return };
                // A stale move out the coordinator stopped tracking: the real leader's cancel is
                // answered "moving out" and the copy runs to its end unheard; not modelled.
                if self.ledger(p).cancel(request).is_err() {
                    return;
                }
                // Forgotten: never re-placed, resubmitted or recorded again.
                self.owner.remove(&request);
                self.unrecorded.remove(&request);
                self.finished.insert(request, p);
            }
            Op::StartMove { pick, to } => {
                let idle: Vec<RequestId> =
                    self.owner.keys().filter(|r| !self.moving.contains_key(r)).copied().collect();
                let Some(request) = nth(&idle, pick) else { return };
                let from_instance = self.owner[&request];
                let targets: Vec<usize> = self.up().into_iter().filter(|&i| i != from_instance).collect();
                let Some(target) = nth(&targets, to) else { return };
                let from = self.current[from_instance].as_ref().expect("owners are up").id;
                let to = self.current[target].as_ref().unwrap().id;
                let id = MigrationId(self.next_move);
                self.next_move += 1;
                if self.ledger(from).begin_out(request, id).is_err() {
                    return;
                }
                self.moving.insert(request, id);
                let k = self.moves.len();
                self.moves.push(Move {
                    id,
                    request,
                    from,
                    to,
                    source: Some(Source::Copying),
                    target: false,
                    tracked: true,
                });
                match self.ledger(to).prepare(request, id, order(id)) {
                    Ok(()) => {
                        self.reserve(to, request, id);
                        self.moves[k].target = true;
                    }
                    Err(_) => self.source_aborts(k),
                }
            }
            Op::Pause { pick } => {
                let copying: Vec<usize> =
                    (0..self.moves.len()).filter(|&k| self.moves[k].source == Some(Source::Copying)).collect();
                let Some(k) = nth(&copying, pick) else { return };
                let (from, request, id) = (self.moves[k].from, self.moves[k].request, self.moves[k].id);
                match self.ledger(from).pause(request, id) {
                    Ok(()) => self.moves[k].source = Some(Source::Paused),
                    Err(_) => {
                        // Finished meanwhile: the source aborts and tells the target.
                        self.source_aborts(k);
                        self.target_ends(k);
                    }
                }
            }
            Op::Commit { pick, reply_lost } => {
                let paused: Vec<usize> =
                    (0..self.moves.len()).filter(|&k| self.moves[k].source == Some(Source::Paused)).collect();
                let Some(k) = nth(&paused, pick) else { return };
                let (from, to, request, id) =
                    (self.moves[k].from, self.moves[k].to, self.moves[k].request, self.moves[k].id);
                let landed = if self.moves[k].target {
                    self.moves[k].target = false;
                    match self.ledger(to).commit(request, id) {
                        Ok(Arrival::Attach) => {
                            self.free(to, request, id, "the attach");
                            self.ledger(to).committed_in(request, id).unwrap();
                            true
                        }
                        Ok(Arrival::AlreadyHere) => true,
                        Err(_) => {
                            if self.ledger(to).release(request, id) {
                                self.free(to, request, id, "a refused commit");
                            }
                            false
                        }
                    }
                } else {
                    false
                };
                if reply_lost {
                    self.moves[k].source = match self.ledger(from).unknown_out(request, id).unwrap() {
                        None => Some(Source::InDoubt),
                        // Orphaned: freed at once; adopted: resumed (nobody settles either).
                        Some(_) => None,
                    };
                } else if landed {
                    self.ledger(from).commit_out(request, id).unwrap();
                    self.moves[k].source = None;
                    self.settled(k, Some(to.instance));
                } else {
                    self.source_aborts(k);
                }
            }
            Op::SourceAbort { pick } => {
                let open: Vec<usize> = (0..self.moves.len())
                    .filter(|&k| matches!(self.moves[k].source, Some(Source::Copying | Source::Paused)))
                    .collect();
                if let Some(k) = nth(&open, pick) {
                    self.source_aborts(k);
                }
            }
            Op::TargetAbort { pick } => {
                let open: Vec<usize> = (0..self.moves.len()).filter(|&k| self.moves[k].target).collect();
                let Some(k) = nth(&open, pick) else { return };
                self.target_ends(k);
                if matches!(self.moves[k].source, Some(Source::Copying | Source::Paused)) {
                    self.source_aborts(k);
                }
            }
            Op::Resolve { pick } => {
                let doubtful: Vec<usize> = (0..self.moves.len())
                    .filter(|&k| self.moves[k].tracked && self.moves[k].source == Some(Source::InDoubt))
                    .collect();
                let Some(k) = nth(&doubtful, pick) else { return };
                self.resolve(k);
            }
            Op::SettleEarly { pick } => {
                let open: Vec<usize> = (0..self.moves.len())
                    .filter(|&k| self.moves[k].tracked)
                    .filter(|&k| matches!(self.moves[k].source, Some(Source::Copying | Source::Paused)))
                    .collect();
                let Some(k) = nth(&open, pick) else { return };
                let (from, to, request) = (self.moves[k].from, self.moves[k].to, self.moves[k].request);
                let held = self.ask_target(to.instance, request);
                let before = self.ledger(from).state(request);
                // Finished while its KV was being copied: the move ends at its pause.
                let want = match before {
                    State::MovingOut(_) | State::Paused(_) => Settle::Underway,
                    _ => Settle::NotInDoubt,
                };
                assert_eq!(self.ledger(from).resolve_source(request, held), want, "{request} {before:?}");
                assert_eq!(self.ledger(from).state(request), before, "a move under way goes on undisturbed");
            }
            Op::Kill { instance, to } => {
                let i = instance as usize % INSTANCES;
                if self.current[i].is_none() || self.up().len() < 2 {
                    return;
                }
                let p = self.current[i].take().unwrap().id;
                self.process_gone(p);
                self.evict(i, to);
            }
            Op::Restart { instance } => {
                let i = instance as usize % INSTANCES;
                if self.current[i].is_none() {
                    self.generations[i] += 1;
                    let id = Proc { instance: i, generation: self.generations[i] };
                    self.current[i] = Some(Process { id, ledger: Ledger::new() });
                }
            }
            Op::LeaseLost { instance, to, reclaimed } => {
                let i = instance as usize % INSTANCES;
                if self.current[i].is_none() || self.up().len() < 2 {
                    return;
                }
                let mut zombie = self.current[i].take().unwrap();
                // The keep-alive reports the loss no later than etcd can expire the lease, so
                // before the coordinator sees the registration go.
                zombie.ledger.set_registered(false);
                // The coordinator stops reading its log with the eviction.
                let unread: Vec<RequestId> =
                    self.unrecorded.iter().filter(|(_, at)| **at == zombie.id).map(|(&r, _)| r).collect();
                for r in unread {
                    self.unrecorded.remove(&r);
                    self.late.insert((zombie.id, r));
                }
                self.zombies.push(zombie);
                self.evict(i, to);
                if reclaimed {
                    self.apply(&Op::Restart { instance });
                }
            }
            Op::Rejoin { pick } => {
                let free: Vec<usize> =
                    (0..self.zombies.len()).filter(|&z| self.current[self.zombies[z].id.instance].is_none()).collect();
                let Some(z) = nth(&free, pick) else { return };
                let mut p = self.zombies.remove(z);
                // Its log still holds the records the coordinator never read: after it rejoins
                // they are read and refused as late copies' (nothing is placed on a lapsed
                // process, and a newcomer holding its number is another process).
                let id = p.id;
                let unheard: Vec<RequestId> = self.late.iter().filter(|(at, _)| *at == id).map(|&(_, r)| r).collect();
                self.late.retain(|(at, _)| *at != id);
                for (request, dropped) in p.ledger.lapse(&unheard) {
                    assert_ne!(dropped, Dropped::Nothing, "{request}");
                }
                p.ledger.set_registered(true);
                self.current[id.instance] = Some(p);
                let due: Vec<RequestId> =
                    self.pending_forgets.iter().filter(|(at, _)| *at == id).map(|&(_, r)| r).collect();
                self.pending_forgets.retain(|(at, _)| *at != id);
                for request in due {
                    self.forget_late(id, request);
                }
            }
            Op::Announce { pick } => {
                let mut stale = Vec::new();
                for p in self.current.iter().flatten().map(|p| p.id).collect::<Vec<_>>() {
                    for r in (1..self.next_request).map(RequestId) {
                        // Announced: held after its prefill, so running (not moving out).
                        if self.ledger(p).state(r) == State::Running && !self.counts(p, r) {
                            stale.push((p, r));
                        }
                    }
                }
                let Some((p, request)) = nth(&stale, pick) else { return };
                let _ = self.ledger(p).drop_copy(request);
            }
            Op::StaleSubmit { pick, to } => {
                let unfinished: Vec<RequestId> = self.owner.keys().copied().collect();
                let Some(request) = nth(&unfinished, pick) else { return };
                let elsewhere: Vec<usize> = self.up().into_iter().filter(|&i| i != self.owner[&request]).collect();
                let Some(i) = nth(&elsewhere, to) else { return };
                let p = self.current[i].as_ref().unwrap().id;
                let idle = matches!(self.ledger(p).state(request), State::Unseen | State::Left);
                if idle && !self.counts(p, request) && self.ledger(p).reserved_for(request).is_none() {
                    self.submit(p, request);
                    self.stale.insert((p, request));
                }
            }
            Op::ForgetLate { pick } => {
                let Some(k) = (!self.refused.is_empty()).then(|| pick as usize % self.refused.len()) else { return };
                let (p, request) = self.refused.remove(k);
                if self.current[p.instance].as_ref().is_none_or(|c| c.id != p) {
                    // Not registered: the coordinator tells it if that process registers again.
                    if self.zombies.iter().any(|z| z.id == p) {
                        self.pending_forgets.push((p, request));
                    }
                    return;
                }
                self.forget_late(p, request);
            }
        }
    }

    /// Whether `p`'s copy of `request` is a late submit's the coordinator does not count.
    fn is_stale(&self, p: Proc, request: RequestId) -> bool {
        self.stale.contains(&(p, request)) && !self.counts(p, request)
    }

    /// Whether the coordinator counts `p`'s copy of `request`: `p` is registered under the
    /// request's owner's number, or is the target of its open move.
    fn counts(&self, p: Proc, request: RequestId) -> bool {
        let registered = |i: usize| self.current[i].as_ref().is_some_and(|c| c.id == p);
        self.owner.get(&request).is_some_and(|&i| registered(i))
            || self.moves.iter().any(|m| m.tracked && m.request == request && m.to == p)
    }

    /// The coordinator stores a finished record from a worker's log.
    fn record(&mut self, request: RequestId) {
        let p = self.unrecorded.remove(&request).expect("a record in a log");
        self.owner.remove(&request);
        self.finished.insert(request, p);
        if let Some(k) = self.moves.iter().position(|m| m.tracked && m.request == request) {
            // A move still copying it ends on its own; one in doubt is still settled.
            if self.moves[k].source != Some(Source::InDoubt) {
                self.settled(k, None);
            }
        }
    }

    /// The coordinator asks the target (the process registered under its number now) whether it
    /// holds the request, then tells the source. A request whose finished record it has stored
    /// counts as landed whatever the target says (it may have died since): the source frees its
    /// paused copy rather than run the request again (the real coordinator asks regardless).
    fn resolve(&mut self, k: usize) {
        let (from, to, request) = (self.moves[k].from, self.moves[k].to, self.moves[k].request);
        let held = self.finished.contains_key(&request) || self.ask_target(to.instance, request);
        let settle = self.ledger(from).resolve_source(request, held);
        assert_eq!(settle, if held { Settle::FreeSource } else { Settle::Resume });
        self.moves[k].source = None;
        self.settled(k, held.then_some(to.instance));
    }

    /// End everything in flight: targets time out, sources abort, doubts are settled.
    fn quiesce(&mut self) {
        for k in 0..self.moves.len() {
            if matches!(self.moves[k].source, Some(Source::Copying | Source::Paused)) {
                self.source_aborts(k);
            }
        }
        while let Some((&request, _)) = self.unrecorded.first_key_value() {
            self.record(request);
        }
        for k in 0..self.moves.len() {
            if matches!(self.moves[k].source, Some(Source::Copying | Source::Paused)) {
                self.source_aborts(k);
            }
            self.target_ends(k);
            if self.moves[k].tracked && self.moves[k].source == Some(Source::InDoubt) {
                self.resolve(k);
            }
        }
        while !self.refused.is_empty() {
            self.apply(&Op::ForgetLate { pick: 0 });
        }
        for z in std::mem::take(&mut self.zombies) {
            self.process_gone(z.id);
        }
        assert!(self.reservations.is_empty(), "reservations never freed: {:?}", self.reservations);
        assert!(self.moving.is_empty(), "moves never settled: {:?}", self.moving);
    }

    /// The properties, after every step.
    fn check(&mut self) {
        let procs: Vec<Proc> = self.current.iter().flatten().chain(&self.zombies).map(|p| p.id).collect();
        for &p in &procs {
            let mut held = 0;
            for r in (1..self.next_request).map(RequestId) {
                let l = self.ledger(p);
                held += usize::from(l.holds(r));
                let (ledger, engine) = (l.reserved_for(r), self.reservations.get(&(p, r)).copied());
                assert_eq!(ledger, engine, "{r} at {p:?}: the ledger's reservation differs from the engine's");
            }
            assert_eq!(self.ledger(p).held(), held, "{p:?}: held count");
        }
        for r in (1..self.next_request).map(RequestId) {
            let (mut live, mut in_doubt) = (0, 0);
            // A copy orphaned by a lapse decodes on until its move ends, but the cluster no
            // longer counts it (its record is refused): dropped unless the move lands.
            let counted = |p: &&Process| !p.ledger.is_orphaned(r) && !self.is_stale(p.id, r);
            for p in self.current.iter().flatten().filter(counted) {
                match p.ledger.state(r) {
                    State::Running | State::MovingOut(_) | State::Paused(_) => live += 1,
                    State::InDoubt(_) => in_doubt += 1,
                    _ => {}
                }
            }
            if let Some(&i) = self.owner.get(&r) {
                let held = self.current[i].as_ref().is_some_and(|p| {
                    p.ledger.holds(r)
                        || (p.ledger.state(r) == State::Finished
                            && (self.unrecorded.get(&r) == Some(&p.id) || self.refused.contains(&(p.id, r))))
                });
                assert!(held, "{r} lost: the coordinator has it on instance {i}, which does not hold it");
                assert!(live <= 1 && in_doubt <= 1, "{r} runs twice: {live} live copies, {in_doubt} in doubt");
            }
            if self.finished.contains_key(&r) || self.unrecorded.contains_key(&r) {
                assert_eq!(live, 0, "{r} runs again after it finished");
            }
        }
    }
}

fn run(ops: &[Op]) {
    let mut c = Cluster::new();
    for op in ops {
        c.apply(op);
        c.check();
    }
    c.quiesce();
    c.check();
    for (r, &i) in &c.owner {
        let p = c.current[i].as_ref().expect("owners are up");
        assert_eq!(p.ledger.state(*r), State::Running, "{r}: once everything settled, it runs on its owner");
    }
}

proptest! {
    // Failures shrink to a few steps; the ones found so far are `known_races_stay_fixed`.
    #![proptest_config(ProptestConfig { cases: 1024, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn every_request_lives_exactly_once_and_every_reservation_is_freed_once(
        ops in proptest::collection::vec(op(), 1..80)
    ) {
        run(&ops);
    }
}

/// The sequences the mutation checks found, kept as plain tests.
#[test]
fn known_races_stay_fixed() {
    use Op::*;
    let cases: &[(&str, &[Op])] = &[
        (
            "a late copy refused while its process was cut off, forgotten when it rejoins, before \
             the request is re-placed there",
            &[
                Submit { to: 2 },
                StartMove { pick: 0, to: 8 },
                StaleSubmit { pick: 0, to: 1 },
                Kill { instance: 198, to: 0 },
                Finish { pick: 44, recorded: false },
                LeaseLost { instance: 184, to: 0, reclaimed: false },
                ForgetLate { pick: 0 },
                Rejoin { pick: 0 },
                LeaseLost { instance: 95, to: 0, reclaimed: false },
            ],
        ),
        (
            "a copy orphaned by a lapse answers for another move's target: asked about a move into \
             the killed newcomer that held its number, the rejoined old process must not say it holds it",
            &[
                Kill { instance: 29, to: 0 },
                Submit { to: 29 },
                StartMove { pick: 0, to: 0 },
                Submit { to: 0 },
                LeaseLost { instance: 43, to: 0, reclaimed: true },
                StartMove { pick: 0, to: 0 },
                Submit { to: 0 },
                Kill { instance: 100, to: 0 },
                Rejoin { pick: 0 },
                LeaseLost { instance: 45, to: 0, reclaimed: false },
            ],
        ),
        (
            "a late submit's copy finished where the request is then moved, the commit's reply lost",
            &[
                Submit { to: 29 },
                StaleSubmit { pick: 0, to: 47 },
                Finish { pick: 2, recorded: false },
                StartMove { pick: 0, to: 187 },
                Pause { pick: 0 },
                Commit { pick: 0, reply_lost: true },
                Resolve { pick: 0 },
            ],
        ),
        (
            "re-placed on the instance it had left by a committed move",
            &[
                Submit { to: 0 },
                StartMove { pick: 0, to: 0 },
                Pause { pick: 0 },
                Commit { pick: 0, reply_lost: false },
                Kill { instance: 1, to: 0 },
            ],
        ),
        (
            "a second move reserves while the first one's target half still holds the blocks",
            &[Submit { to: 0 }, StartMove { pick: 0, to: 0 }, SourceAbort { pick: 0 }, StartMove { pick: 0, to: 0 }],
        ),
        (
            "a COMMIT lands on a worker whose number a newcomer reclaimed",
            &[
                Submit { to: 0 },
                StartMove { pick: 0, to: 0 },
                LeaseLost { instance: 1, to: 0, reclaimed: true },
                Pause { pick: 0 },
                Commit { pick: 0, reply_lost: false },
            ],
        ),
        (
            "the target finished the request before the coordinator settled the lost reply",
            &[
                Submit { to: 0 },
                StartMove { pick: 0, to: 0 },
                Pause { pick: 0 },
                Commit { pick: 0, reply_lost: true },
                Finish { pick: 0, recorded: false },
                Resolve { pick: 0 },
            ],
        ),
        (
            "a move out orphaned by a lapse aborts after the worker registered again",
            &[
                Submit { to: 0 },
                StartMove { pick: 0, to: 0 },
                LeaseLost { instance: 0, to: 0, reclaimed: false },
                Rejoin { pick: 0 },
                SourceAbort { pick: 0 },
            ],
        ),
        (
            "finished unheard before a lapse, then placed there again",
            &[
                Submit { to: 0 },
                LeaseLost { instance: 0, to: 0, reclaimed: false },
                Finish { pick: 1, recorded: false },
                Rejoin { pick: 0 },
                Kill { instance: 1, to: 0 },
            ],
        ),
        (
            "a move into a worker whose lease lapsed commits after it registered again",
            &[
                Submit { to: 0 },
                StartMove { pick: 0, to: 0 },
                LeaseLost { instance: 1, to: 0, reclaimed: false },
                LeaseLost { instance: 0, to: 0, reclaimed: false },
                Rejoin { pick: 0 },
                Pause { pick: 0 },
                Commit { pick: 0, reply_lost: false },
            ],
        ),
    ];
    for (what, ops) in cases {
        let ok = std::panic::catch_unwind(|| run(ops));
        assert!(ok.is_ok(), "{what}");
    }
}
