//! The controller's decisions as tables of events → expected actions.

use super::*;
use crate::roles::Role;
use kvfleet_core::policy::registry::{build_policy, PolicyParams};
use kvfleet_core::policy::InstancePolicy;

const MODEL: &str = "r1-distill-qwen-32b";
const KV: u64 = 262_144;

fn ctl(policy: &str, instances: u32) -> Controller {
    let mut c = Controller::new(build_policy(policy, &PolicyParams::default()).unwrap(), SimRng::seed_from_u64(1))
        .expect_model(MODEL, KV)
        .retain_finished();
    for i in 0..instances {
        c.handle(Timestamp::ZERO, joined(i)).unwrap();
        c.handle(Timestamp::ZERO, Event::Load(load(i, 0, 0))).unwrap();
    }
    c
}

fn joined(i: u32) -> Event {
    Event::Joined { instance: InstanceId(i), address: format!("w{i}"), model: MODEL.into(), kv_bytes_per_token: KV }
}

fn spec(id: u64, prompt: u32) -> RequestSpec {
    RequestSpec {
        content_ids: Vec::new(),
        id: RequestId(id),
        arrival: Timestamp(0),
        prompt_tokens: prompt,
        reasoning_tokens: 5,
        answer_tokens: 5,
    }
}

fn load(i: u32, used: u32, reasoning: u32) -> LoadReport {
    LoadReport {
        instance: InstanceId(i),
        gpu_used_blocks: used,
        gpu_total_blocks: 100,
        block_bytes: 1,
        block_tokens: 16,
        reasoning_requests: reasoning,
        answering_slo_ok: true,
        ..LoadReport::default()
    }
}

fn place(c: &mut Controller, s: RequestSpec) -> InstanceId {
    match c.decide(Timestamp::ZERO, Event::Arrival(s)).unwrap().as_slice() {
        [Action::Place { on, replaced: 0, .. }] => *on,
        other => panic!("expected one placement, got {other:?}"),
    }
}

fn published(c: &Controller, i: u32) -> LoadReport {
    c.loads().iter().find(|l| l.instance == InstanceId(i)).cloned().unwrap()
}

#[test]
fn simultaneous_arrivals_spread_over_idle_instances() {
    for policy in ["pascal", "least-kv", "pascal-nomigration"] {
        let mut c = ctl(policy, 8);
        let mut on: Vec<u32> = (0..8).map(|id| place(&mut c, spec(id, 4000)).0).collect();
        on.sort_unstable();
        assert_eq!(on, (0..8).collect::<Vec<_>>(), "{policy}: each arrival charged at once");
    }
}

#[test]
fn a_charge_lasts_until_a_report_shows_it_or_it_expires() {
    let mut c = ctl("least-kv", 2);
    assert_eq!(place(&mut c, spec(1, 160)), InstanceId(0));
    let charged = published(&c, 0);
    assert_eq!((charged.waiting_blocks, charged.waiting_requests, charged.reasoning_requests), (10, 1, 1));
    // A report from before the submit arrived (admitted still 0) does not erase it.
    c.handle(Timestamp::ZERO, Event::Load(load(0, 0, 0))).unwrap();
    assert_eq!(published(&c, 0).waiting_blocks, 10, "a stale report keeps the charge");
    // The instance took it in: its own report now carries the load.
    c.handle(Timestamp::ZERO, Event::Load(LoadReport { admitted: 1, waiting_blocks: 10, ..load(0, 0, 1) })).unwrap();
    assert_eq!(published(&c, 0).waiting_blocks, 10, "counted once, by the report");
    assert_eq!(published(&c, 0).reasoning_requests, 1);
    // A decision no report ever shows stops counting after the TTL.
    assert_eq!(place(&mut c, spec(2, 160)), InstanceId(1));
    assert_eq!(published(&c, 1).waiting_blocks, 10);
    c.handle(Timestamp::ZERO + CHARGE_TTL, Event::Tick).unwrap();
    assert_eq!(published(&c, 1).waiting_blocks, 0, "expired");
}

#[test]
fn model_mismatch_is_refused_with_both_names() {
    let mut c = ctl("pascal", 0);
    let e = c
        .handle(
            Timestamp::ZERO,
            Event::Joined {
                instance: InstanceId(0),
                address: "a".into(),
                model: "llama-3-8b".into(),
                kv_bytes_per_token: 131_072,
            },
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("llama-3-8b") && e.contains(MODEL), "{e}");
    assert!(c.loads().is_empty());
}

#[test]
fn placement_follows_the_policy_and_skips_dead_instances() {
    let mut c = ctl("pascal", 3);
    for (i, used, r) in [(0, 50, 3), (1, 10, 1), (2, 5, 0)] {
        c.handle(Timestamp::ZERO, Event::Load(load(i, used, r))).unwrap();
    }
    assert_eq!(place(&mut c, spec(1, 10)), InstanceId(2), "Alg. 1: least KV footprint");
    assert_eq!(c.handle(Timestamp::ZERO, Event::Arrival(spec(1, 10))), Err(ControlError::Duplicate(RequestId(1))));
    let actions = c.decide(Timestamp::ZERO, Event::Left { instance: InstanceId(2) }).unwrap();
    assert_eq!(actions, vec![Action::Place { request: RequestId(1), on: InstanceId(1), replaced: 1, fetch: None }]);
    assert_eq!(c.ownership(RequestId(1)).unwrap().instance, InstanceId(1));
    assert!(c.loads().iter().all(|l| l.instance != InstanceId(2)), "a dead instance is not offered to policies");
}

#[test]
fn no_instances_rejects_and_records_nothing() {
    let mut c = ctl("least-kv", 0);
    let actions = c.decide(Timestamp::ZERO, Event::Arrival(spec(1, 10))).unwrap();
    assert_eq!(actions, vec![Action::Reject { request: RequestId(1), reason: RejectReason::NoInstance }]);
    assert!(c.ownership(RequestId(1)).is_none());
}

/// A policy that names instances that do not exist.
#[derive(Debug)]
struct Rogue;
impl InstancePolicy for Rogue {
    fn name(&self) -> &str {
        "rogue"
    }
    fn place(&mut self, _: &RequestSpec, _: &[LoadReport], _: &mut SimRng) -> InstanceId {
        InstanceId(99)
    }
    fn on_phase_change(&mut self, _: &PhaseChange, _: &[LoadReport], _: &mut SimRng) -> PhaseDecision {
        PhaseDecision::Migrate { to: InstanceId(77) }
    }
    fn migrates_at_phase_boundary(&self) -> bool {
        true
    }
}

#[test]
fn a_policy_naming_a_dead_instance_gets_the_fallback() {
    let mut c = Controller::new(Box::new(Rogue), SimRng::seed_from_u64(0));
    for i in 0..3 {
        c.handle(Timestamp::ZERO, joined(i)).unwrap();
        c.handle(Timestamp::ZERO, Event::Load(load(i, 30 - i * 10, 0))).unwrap();
    }
    assert_eq!(place(&mut c, spec(1, 10)), InstanceId(2), "least loaded live instance");
    let actions = c
        .decide(Timestamp::ZERO, Event::Boundary { request: RequestId(1), instance: InstanceId(2), kv_blocks: 1 })
        .unwrap();
    assert!(actions.is_empty(), "a move to a dead instance: the request stays");
    assert_eq!(c.ownership(RequestId(1)).unwrap().phase, OwnedPhase::Answering);
}

#[test]
fn boundary_migrates_to_fewest_reasoning_and_charges_the_target() {
    let mut c = ctl("pascal", 2);
    c.handle(Timestamp::ZERO, Event::Load(load(0, 10, 4))).unwrap();
    c.handle(Timestamp::ZERO, Event::Load(load(1, 10, 0))).unwrap();
    let at = place(&mut c, spec(7, 10));
    assert_eq!(at, InstanceId(0), "equal footprints: lowest id");
    let actions =
        c.decide(Timestamp::ZERO, Event::Boundary { request: RequestId(7), instance: at, kv_blocks: 1 }).unwrap();
    assert_eq!(actions, vec![Action::Migrate { request: RequestId(7), from: at, to: InstanceId(1), kv_blocks: 1 }]);
    let o = c.ownership(RequestId(7)).unwrap();
    assert_eq!((o.phase, o.migrating_to), (OwnedPhase::Migrating, Some(InstanceId(1))), "where to, for a successor");
    assert_eq!(published(&c, 1).gpu_used_blocks, 11, "the move is charged to its target at once");
    c.handle(
        Timestamp::ZERO,
        Event::MigrationEnded { request: RequestId(7), from: at, to: InstanceId(1), outcome: MoveOutcome::Committed },
    )
    .unwrap();
    assert_eq!(c.ownership(RequestId(7)).unwrap().instance, InstanceId(1));
    assert_eq!(c.ownership(RequestId(7)).unwrap().migrations, 1);
    c.handle(Timestamp::ZERO, Event::Finished { request: RequestId(7), from: Some(InstanceId(1)) }).unwrap();
    assert_eq!(
        c.handle(Timestamp::ZERO, Event::Finished { request: RequestId(7), from: Some(InstanceId(1)) }),
        Err(ControlError::NotInFlight(RequestId(7))),
        "a duplicate finish report is refused"
    );
    assert_eq!(c.in_flight(), 0);
}

#[test]
fn only_the_owner_s_final_record_counts() {
    let mut c = ctl("pascal", 3);
    for i in 0..3 {
        c.handle(Timestamp::ZERO, Event::Load(load(i, 10, if i == 1 { 0 } else { 4 }))).unwrap();
    }
    let at = place(&mut c, spec(7, 10));
    let late = |c: &mut Controller, from: u32| {
        c.handle(Timestamp::ZERO, Event::Finished { request: RequestId(7), from: Some(InstanceId(from)) })
    };
    let stranger = (0..3).find(|&i| i != at.0 && i != 1).unwrap();
    // Moving `at` → 1: the target's record may overtake the commit's reply; a third instance's
    // (a paused worker's copy of a request re-placed since) is refused and changes nothing.
    c.handle(Timestamp::ZERO, Event::Boundary { request: RequestId(7), instance: at, kv_blocks: 1 }).unwrap();
    assert!(matches!(c.poll_action(), Some(Action::Migrate { to: InstanceId(1), .. })));
    assert_eq!(
        late(&mut c, stranger),
        Err(ControlError::NotOwner { request: RequestId(7), from: InstanceId(stranger), owner: at })
    );
    assert_eq!(c.ownership(RequestId(7)).unwrap().phase, OwnedPhase::Migrating, "still in flight");
    late(&mut c, 1).unwrap();
    assert_eq!(c.ownership(RequestId(7)).unwrap().phase, OwnedPhase::Finished);
    assert_eq!(late(&mut c, at.0), Err(ControlError::NotInFlight(RequestId(7))), "and only once");
}

/// A silent instance (not heard from: paused, partitioned, unreachable) looks idle, so without
/// the rule it would draw every placement; silent, it draws none and is no move's target, keeps
/// what it holds, and is back in the choice once heard again (or with its next report). Unheard
/// past the second bound while still a member, it is given up: expelled (its registration
/// revoked), its requests re-placed; heard again (a driver that could not expel it), it rejoins.
#[test]
fn a_silent_instance_draws_no_placement_until_it_is_heard_again() {
    let rule = Silence { silent_after: TimeSpan::from_secs_f64(2.0), abandon_after: TimeSpan::from_secs_f64(10.0) };
    let mut c = ctl("least-kv", 2).watch_silence(rule);
    let at = |s: f64| Timestamp::ZERO + TimeSpan::from_secs_f64(s);
    let heard = |c: &mut Controller, now: f64, zero: f64, one: f64| {
        c.decide(at(now), Event::Heard { heard: vec![(InstanceId(0), at(zero)), (InstanceId(1), at(one))] }).unwrap()
    };
    c.handle(Timestamp::ZERO, Event::Load(load(1, 50, 0))).unwrap();
    let held = place(&mut c, spec(1, 10));
    assert_eq!(held, InstanceId(0), "idle instance 0 draws it");
    assert!(heard(&mut c, 1.9, 0.0, 1.9).is_empty());
    assert_eq!(c.loads().len(), 2, "quiet for less than the bound: still in the choice");
    assert!(heard(&mut c, 2.0, 0.0, 2.0).is_empty());
    for id in 2..6 {
        assert_eq!(place(&mut c, spec(id, 10)), InstanceId(1), "request {id}: not on the silent instance");
    }
    assert_eq!(c.ownership(RequestId(1)).unwrap().instance, InstanceId(0), "what it holds stays");
    assert!(c.loads().iter().all(|l| l.instance != InstanceId(0)), "out of the policies' view");
    // Heard again (its report, or any message) brings it back: it is idle, the next one is its.
    assert!(heard(&mut c, 3.0, 2.9, 3.0).is_empty());
    assert_eq!(place(&mut c, spec(6, 10)), InstanceId(0));
    // Unheard for the second bound: given up, its requests re-placed on the instance still heard.
    assert!(heard(&mut c, 5.0, 2.9, 5.0).is_empty(), "silent again");
    assert!(heard(&mut c, 12.8, 2.9, 12.8).is_empty(), "not yet given up");
    let moved = heard(&mut c, 12.9, 2.9, 12.9);
    // Its membership ends first (the driver revokes its registration: the process drops what was
    // re-placed before it comes back), then its requests start over elsewhere.
    assert_eq!(moved.first(), Some(&Action::Expel { instance: InstanceId(0) }), "{moved:?}");
    let again: Vec<u64> = moved[1..]
        .iter()
        .map(|a| match a {
            Action::Place { request, on: InstanceId(1), replaced: 1, .. } => request.0,
            other => panic!("expected re-placements on 1, got {other:?}"),
        })
        .collect();
    assert_eq!(again, vec![1, 6], "its requests, once each");
    assert!(!c.is_live(InstanceId(0)));
    assert!(heard(&mut c, 13.0, 2.9, 13.0).is_empty(), "given up once");
    assert!(heard(&mut c, 14.0, 13.9, 14.0).is_empty());
    assert!(c.is_live(InstanceId(0)), "heard again: it rejoins");
    assert_eq!(place(&mut c, spec(7, 10)), InstanceId(0), "empty: it draws the next");
    // Every instance silent: a re-placement waits (stranded) until one is heard again.
    assert!(heard(&mut c, 20.0, 14.0, 14.0).is_empty());
    let none = c.decide(at(20.0), Event::Lost { request: RequestId(6) }).unwrap();
    assert!(matches!(none.as_slice(), [Action::Reject { request: RequestId(6), .. }]), "{none:?}");
    let back = heard(&mut c, 20.5, 14.0, 20.4);
    assert!(
        matches!(back.as_slice(), [Action::Place { request: RequestId(6), on: InstanceId(1), .. }]),
        "the stranded request goes to the first instance heard again: {back:?}"
    );
    // Without a rule the times change nothing.
    let mut c = ctl("least-kv", 2);
    c.handle(at(100.0), Event::Heard { heard: vec![(InstanceId(0), Timestamp::ZERO)] }).unwrap();
    assert_eq!(c.loads().len(), 2);
}

#[test]
fn stale_boundaries_never_move_a_request() {
    let mut c = ctl("pascal", 2);
    c.handle(Timestamp::ZERO, Event::Load(load(0, 10, 4))).unwrap();
    c.handle(Timestamp::ZERO, Event::Load(load(1, 10, 0))).unwrap();
    let at = place(&mut c, spec(7, 10));
    let wrong = InstanceId(1 - at.0);
    let boundary = |instance| Event::Boundary { request: RequestId(7), instance, kv_blocks: 1 };
    assert!(c.decide(Timestamp::ZERO, boundary(wrong)).unwrap().is_empty(), "from an instance that does not own it");
    c.handle(Timestamp::ZERO, Event::Finished { request: RequestId(7), from: None }).unwrap();
    assert!(c.decide(Timestamp::ZERO, boundary(at)).unwrap().is_empty(), "for a finished request");
    assert_eq!(c.ownership(RequestId(7)).unwrap().phase, OwnedPhase::Finished, "stays finished");
    assert!(c.decide(Timestamp::ZERO, boundary(at)).is_ok(), "unknown requests are ignored, not errors");
}

#[test]
fn a_request_that_finishes_during_its_move_stays_finished() {
    let mut c = ctl("pascal", 2);
    c.handle(Timestamp::ZERO, Event::Load(load(0, 10, 4))).unwrap();
    c.handle(Timestamp::ZERO, Event::Load(load(1, 10, 0))).unwrap();
    let at = place(&mut c, spec(8, 10));
    c.handle(Timestamp::ZERO, Event::Boundary { request: RequestId(8), instance: at, kv_blocks: 1 }).unwrap();
    assert!(matches!(c.poll_action(), Some(Action::Migrate { .. })));
    c.handle(Timestamp::ZERO, Event::Finished { request: RequestId(8), from: None }).unwrap();
    c.handle(
        Timestamp::ZERO,
        Event::MigrationEnded {
            request: RequestId(8),
            from: at,
            to: InstanceId(1 - at.0),
            outcome: MoveOutcome::Aborted,
        },
    )
    .unwrap();
    assert_eq!(c.ownership(RequestId(8)).unwrap().phase, OwnedPhase::Finished);
    assert_eq!(c.in_flight(), 0);
    assert!(c.decide(Timestamp::ZERO, Event::Left { instance: at }).unwrap().is_empty(), "not re-placed");
}

#[test]
fn a_declined_move_goes_to_the_next_choice_then_stays() {
    let mut c = ctl("pascal", 4);
    for (i, r) in [(0, 4), (1, 0), (2, 1), (3, 2)] {
        c.handle(Timestamp::ZERO, Event::Load(load(i, 10, r))).unwrap();
    }
    let at = place(&mut c, spec(7, 10));
    assert_eq!(at, InstanceId(0));
    let mut targets = Vec::new();
    let mut actions =
        c.decide(Timestamp::ZERO, Event::Boundary { request: RequestId(7), instance: at, kv_blocks: 1 }).unwrap();
    while let [Action::Migrate { to, .. }] = actions.as_slice() {
        let to = *to;
        targets.push(to.0);
        assert_eq!(c.ownership(RequestId(7)).unwrap().migrating_to, Some(to));
        let refused = Event::MigrationEnded { request: RequestId(7), from: at, to, outcome: MoveOutcome::Refused };
        actions = c.decide(Timestamp::ZERO, refused).unwrap();
    }
    assert_eq!(targets, vec![1, 2, 3], "fewest reasoning first, then the next, at most 1 + MAX_RETARGETS tries");
    let o = c.ownership(RequestId(7)).unwrap();
    assert_eq!((o.instance, o.phase, o.migrating_to), (at, OwnedPhase::Answering, None), "stays on its source");
    assert_eq!(published(&c, 1).gpu_used_blocks, 10, "a refused move's charge is dropped");
}

#[test]
fn events_for_unknown_requests_are_errors_that_change_nothing() {
    let mut c = ctl("pascal", 1);
    for ev in [
        Event::MigrationEnded {
            request: RequestId(5),
            from: InstanceId(0),
            to: InstanceId(1),
            outcome: MoveOutcome::Committed,
        },
        Event::Lost { request: RequestId(5) },
        Event::Finished { request: RequestId(5), from: None },
    ] {
        assert_eq!(c.handle(Timestamp::ZERO, ev), Err(ControlError::NotInFlight(RequestId(5))));
    }
    assert!(c.poll_action().is_none());
    assert!(c.requests().is_empty());
}

#[test]
fn forgetting_finished_requests_keeps_only_those_in_flight() {
    let mut c = Controller::new(build_policy("least-kv", &PolicyParams::default()).unwrap(), SimRng::seed_from_u64(0));
    c.handle(Timestamp::ZERO, joined(0)).unwrap();
    place(&mut c, spec(1, 10));
    c.handle(Timestamp::ZERO, Event::Finished { request: RequestId(1), from: None }).unwrap();
    assert!(c.requests().is_empty());
}

/// `instances` live instances; request 7 placed on 0 and moving to 1 at its boundary.
fn moving_from_0_to_1(instances: u32) -> Controller {
    let mut c = ctl("pascal", instances);
    for i in 0..instances {
        c.handle(Timestamp::ZERO, Event::Load(load(i, 10, if i == 1 { 0 } else { 4 }))).unwrap();
    }
    assert_eq!(place(&mut c, spec(7, 10)), InstanceId(0));
    let actions = c
        .decide(Timestamp::ZERO, Event::Boundary { request: RequestId(7), instance: InstanceId(0), kv_blocks: 1 })
        .unwrap();
    assert_eq!(
        actions,
        vec![Action::Migrate { request: RequestId(7), from: InstanceId(0), to: InstanceId(1), kv_blocks: 1 }]
    );
    c
}

/// The end of request `id`'s move from instance 0 to 1.
fn ended_0_to_1(id: RequestId, outcome: MoveOutcome) -> Event {
    Event::MigrationEnded { request: id, from: InstanceId(0), to: InstanceId(1), outcome }
}

fn owner(c: &Controller, id: u64) -> (InstanceId, OwnedPhase, Option<InstanceId>) {
    let o = c.ownership(RequestId(id)).unwrap();
    (o.instance, o.phase, o.migrating_to)
}

#[test]
fn a_source_leaving_mid_move_is_settled_by_its_target_not_re_placed() {
    let id = RequestId(7);
    // (target's answer, actions it leads to, where the request runs then, in which phase, re-placements)
    let table = [
        (true, vec![], InstanceId(1), OwnedPhase::Answering, 0),
        (
            false,
            vec![Action::Place { request: id, on: InstanceId(1), replaced: 1, fetch: None }],
            InstanceId(1),
            OwnedPhase::Reasoning,
            1,
        ),
    ];
    for (held, then, runs_on, phase, replaced) in table {
        let mut c = moving_from_0_to_1(2);
        let actions = c.decide(Timestamp::ZERO, Event::Left { instance: InstanceId(0) }).unwrap();
        assert_eq!(
            actions,
            vec![Action::Settle { request: id, from: InstanceId(0), to: InstanceId(1) }],
            "held={held}"
        );
        assert_eq!(owner(&c, 7), (InstanceId(0), OwnedPhase::Migrating, Some(InstanceId(1))), "undecided until asked");
        // The source's side of the move fails with it: that proves nothing about the COMMIT.
        assert!(c.decide(Timestamp::ZERO, ended_0_to_1(id, MoveOutcome::Aborted)).unwrap().is_empty());
        assert_eq!(owner(&c, 7), (InstanceId(0), OwnedPhase::Migrating, Some(InstanceId(1))), "held={held}");
        assert_eq!(
            c.decide(Timestamp::ZERO, Event::Settled { request: id, from: InstanceId(0), to: InstanceId(1), held })
                .unwrap(),
            then,
            "held={held}"
        );
        let o = c.ownership(id).unwrap();
        assert_eq!((o.instance, o.phase, o.migrating_to, o.replaced), (runs_on, phase, None, replaced));
        assert!(
            c.decide(
                Timestamp::ZERO,
                Event::Settled { request: id, from: InstanceId(0), to: InstanceId(1), held: !held }
            )
            .unwrap()
            .is_empty(),
            "a late answer"
        );
        assert_eq!(c.ownership(id).unwrap().instance, runs_on, "held={held}: changes nothing");
    }
}

/// The chaos run's lost request: its source left mid-move, the target did not hold it, so it was
/// re-placed and moved on from there; the driver's late report of the first move (its source's
/// MigrateOut failing at last) then ended the second one, whose commit was lost, and the owner's
/// final record was refused as a late copy. A report names its move; a superseded one changes
/// nothing, whatever it says.
#[test]
fn a_late_report_of_a_superseded_move_changes_nothing() {
    let id = RequestId(7);
    for stale in [MoveOutcome::Aborted, MoveOutcome::Committed, MoveOutcome::Refused, MoveOutcome::Lost] {
        let mut c = moving_from_0_to_1(4);
        c.decide(Timestamp::ZERO, Event::Left { instance: InstanceId(0) }).unwrap();
        let settled = |held| Event::Settled { request: id, from: InstanceId(0), to: InstanceId(1), held };
        let [Action::Place { on: again, replaced: 1, .. }] = c.decide(Timestamp::ZERO, settled(false)).unwrap()[..]
        else {
            panic!("re-placed once")
        };
        let target = InstanceId((1..4).rev().find(|&i| i != again.0).unwrap());
        for i in 1..4 {
            let reasoning = if i == target.0 { 0 } else { 4 };
            c.handle(Timestamp::ZERO, Event::Load(load(i, 10, reasoning))).unwrap();
        }
        let boundary = Event::Boundary { request: id, instance: again, kv_blocks: 1 };
        let [Action::Migrate { from, to, .. }] = c.decide(Timestamp::ZERO, boundary).unwrap()[..] else {
            panic!("{stale:?}: the second move")
        };
        assert_eq!((from, to), (again, target), "{stale:?}");
        let moving = (again, OwnedPhase::Migrating, Some(target));
        assert!(c.decide(Timestamp::ZERO, ended_0_to_1(id, stale)).unwrap().is_empty(), "{stale:?}");
        assert_eq!(owner(&c, 7), moving, "{stale:?}: the first move's late end");
        assert!(c.decide(Timestamp::ZERO, settled(true)).unwrap().is_empty(), "{stale:?}");
        assert_eq!(owner(&c, 7), moving, "{stale:?}: the first move's late answer");
        let ended = Event::MigrationEnded { request: id, from: again, to, outcome: MoveOutcome::Committed };
        assert!(c.decide(Timestamp::ZERO, ended).unwrap().is_empty(), "{stale:?}");
        assert_eq!(owner(&c, 7), (target, OwnedPhase::Answering, None), "{stale:?}");
        c.handle(Timestamp::ZERO, Event::Finished { request: id, from: Some(target) })
            .unwrap_or_else(|e| panic!("{stale:?}: the owner's record refused: {e}"));
    }
}

#[test]
fn a_target_leaving_mid_move_leaves_the_request_on_its_source() {
    let id = RequestId(7);
    let mut c = moving_from_0_to_1(3);
    assert!(c.decide(Timestamp::ZERO, Event::Left { instance: InstanceId(1) }).unwrap().is_empty());
    assert_eq!(owner(&c, 7), (InstanceId(0), OwnedPhase::Migrating, Some(InstanceId(1))), "still its source's");
    c.handle(Timestamp::ZERO, ended_0_to_1(id, MoveOutcome::Aborted)).unwrap();
    assert_eq!(owner(&c, 7), (InstanceId(0), OwnedPhase::Answering, None), "the move aborted: runs on at its source");

    // Had the COMMIT gone through before the target left, the only copy left with it.
    let mut c = moving_from_0_to_1(3);
    c.handle(Timestamp::ZERO, Event::Left { instance: InstanceId(1) }).unwrap();
    let actions = c.decide(Timestamp::ZERO, ended_0_to_1(id, MoveOutcome::Committed)).unwrap();
    assert!(
        matches!(actions.as_slice(), [Action::Place { on, replaced: 1, .. }] if *on != InstanceId(1)),
        "{actions:?}"
    );

    // Both ends gone, in either order: nothing to ask, re-placed at once.
    for order in [[1, 0], [0, 1]] {
        let mut c = moving_from_0_to_1(3);
        let mut actions = Vec::new();
        for i in order {
            actions.extend(c.decide(Timestamp::ZERO, Event::Left { instance: InstanceId(i) }).unwrap());
        }
        let placed: Vec<_> = actions.iter().filter(|a| matches!(a, Action::Place { .. })).collect();
        assert_eq!(
            placed,
            vec![&Action::Place { request: id, on: InstanceId(2), replaced: 1, fetch: None }],
            "{order:?}: {actions:?}"
        );
        assert!(c
            .decide(Timestamp::ZERO, Event::Settled { request: id, from: InstanceId(0), to: InstanceId(1), held: true })
            .unwrap()
            .is_empty());
        assert_eq!(owner(&c, 7), (InstanceId(2), OwnedPhase::Reasoning, None), "{order:?}");
    }
}

#[test]
fn a_re_placement_without_a_live_instance_is_retried_when_one_joins() {
    let mut c = ctl("least-kv", 1);
    place(&mut c, spec(1, 10));
    let actions = c.decide(Timestamp::ZERO, Event::Left { instance: InstanceId(0) }).unwrap();
    assert_eq!(actions, vec![Action::Reject { request: RequestId(1), reason: RejectReason::NoInstance }]);
    // The same instance number back (a restarted process): it starts over there.
    let actions = c.decide(Timestamp::ZERO, joined(0)).unwrap();
    assert_eq!(actions, vec![Action::Place { request: RequestId(1), on: InstanceId(0), replaced: 1, fetch: None }]);
    assert!(c.decide(Timestamp::ZERO, joined(0)).unwrap().is_empty(), "a refreshed registration re-places nothing");
}

/// A client that leaves cancels its request where it runs; during a move, once the move ended,
/// at whichever end holds it; a copy lost meanwhile is just forgotten. Either way the request is
/// no longer in flight, its charges are gone, and a late record from its instance is refused.
#[test]
fn a_cancelled_request_is_stopped_where_it_runs_once() {
    let id = RequestId(7);
    let cancel = Event::Cancelled { request: id };
    let ended = |outcome| ended_0_to_1(id, outcome);
    // (events after the move to 1 started, then the cancel's actions, then those of `after`)
    type Case = (&'static str, Vec<Event>, Vec<Event>, Vec<Action>);
    let table: Vec<Case> = vec![
        (
            "committed",
            vec![],
            vec![ended(MoveOutcome::Committed)],
            vec![Action::Cancel { request: id, on: InstanceId(1) }],
        ),
        ("aborted", vec![], vec![ended(MoveOutcome::Aborted)], vec![Action::Cancel { request: id, on: InstanceId(0) }]),
        // Refused: no retry to another target for a cancelled request.
        ("refused", vec![], vec![ended(MoveOutcome::Refused)], vec![Action::Cancel { request: id, on: InstanceId(0) }]),
        // Both ends failed it: no copy left, nothing to stop (and no re-placement).
        ("lost", vec![], vec![Event::Lost { request: id }], vec![]),
        ("lost by both ends of the move", vec![], vec![ended(MoveOutcome::Lost)], vec![]),
        // The source left; the target does not hold it: the copy went with the source.
        (
            "settled, not held",
            vec![Event::Left { instance: InstanceId(0) }],
            vec![Event::Settled { request: id, from: InstanceId(0), to: InstanceId(1), held: false }],
            vec![],
        ),
        (
            "settled, held",
            vec![Event::Left { instance: InstanceId(0) }],
            vec![Event::Settled { request: id, from: InstanceId(0), to: InstanceId(1), held: true }],
            vec![Action::Cancel { request: id, on: InstanceId(1) }],
        ),
    ];
    for (name, before, after, then) in table {
        let mut c = moving_from_0_to_1(3);
        for e in before {
            c.decide(Timestamp::ZERO, e).unwrap();
        }
        assert!(c.decide(Timestamp::ZERO, cancel.clone()).unwrap().is_empty(), "{name}: waits for the move");
        let mut got = Vec::new();
        for e in after {
            got.extend(c.decide(Timestamp::ZERO, e).unwrap());
        }
        assert_eq!(got, then, "{name}");
        assert_eq!(c.in_flight(), 0, "{name}: still in flight");
        assert!(c.ownership(id).is_none_or(|o| !o.unfinished()), "{name}: still unfinished");
        assert_eq!(published(&c, 1).gpu_used_blocks, 10, "{name}: the move's charge is gone from its target");
        assert_eq!(c.decide(Timestamp::ZERO, cancel.clone()), Err(ControlError::NotInFlight(id)), "{name}: twice");
        assert_eq!(
            c.decide(Timestamp::ZERO, Event::Finished { request: id, from: Some(InstanceId(0)) }),
            Err(ControlError::NotInFlight(id)),
            "{name}: a record sent before the cancel arrived is not stored"
        );
    }
    // Not moving: cancelled at once where it runs.
    let mut c = ctl("pascal", 2);
    let at = place(&mut c, spec(8, 10));
    assert_eq!(
        c.decide(Timestamp::ZERO, Event::Cancelled { request: RequestId(8) }).unwrap(),
        vec![Action::Cancel { request: RequestId(8), on: at }]
    );
    assert_eq!(c.in_flight(), 0);
    assert_eq!(
        c.decide(Timestamp::ZERO, Event::Cancelled { request: RequestId(99) }),
        Err(ControlError::NotInFlight(RequestId(99)))
    );
}

/// Disaggregated (instances 0, 1 prefill; 2, 3 decode): new requests go to prefill instances only;
/// a prefill done hands the request to the decode instance with the least KV, a refusal to the
/// other, and after `MAX_HANDOFF_FAILURES` it decodes where it was prefilled. After the handoff it is in the phase
/// it was in (still reasoning), owned by its decode instance.
#[test]
fn handoffs_go_from_prefill_to_decode_instances() {
    let setup = || {
        let mut c = ctl("least-kv", 4);
        for (i, role) in [Role::Prefill, Role::Prefill, Role::Decode, Role::Decode].into_iter().enumerate() {
            c.set_role(InstanceId(i as u32), role);
            c.handle(Timestamp::ZERO, Event::Load(load(i as u32, [30, 0, 20, 10][i], 0))).unwrap();
        }
        let roles: Vec<Action> = std::iter::from_fn(|| c.poll_action()).collect();
        assert_eq!(roles.len(), 4, "one SetRole each: {roles:?}");
        assert_eq!(roles[0], Action::SetRole { instance: InstanceId(0), role: Role::Prefill });
        c
    };
    let mut c = setup();
    for id in 1..4 {
        assert!(place(&mut c, spec(id, 10)).0 < 2, "request {id}: a prefill instance");
    }
    let mut c = setup();
    let at = place(&mut c, spec(7, 10));
    assert_eq!(at, InstanceId(1), "the emptier prefill instance, not the idle-looking decoders");
    let done = |instance| Event::PrefillDone { request: RequestId(7), instance, kv_blocks: 1 };
    assert_eq!(
        c.decide(Timestamp::ZERO, done(InstanceId(0))).unwrap(),
        vec![Action::Drop { request: RequestId(7), on: InstanceId(0) }],
        "not from its instance: a stale copy there, dropped"
    );
    let done = done(at);
    let actions = c.decide(Timestamp::ZERO, done).unwrap();
    assert_eq!(actions, vec![Action::Migrate { request: RequestId(7), from: at, to: InstanceId(3), kv_blocks: 1 }]);
    // Refused (or aborted): the other decode instance, then back, until MAX_HANDOFF_FAILURES.
    let mut tried = vec![3];
    let mut to = InstanceId(3);
    loop {
        let refused = Event::MigrationEnded { request: RequestId(7), from: at, to, outcome: MoveOutcome::Refused };
        match c.decide(Timestamp::ZERO, refused).unwrap().as_slice() {
            [Action::Migrate { from, to: next, .. }] if *from == at => {
                to = *next;
                tried.push(next.0);
            }
            [Action::Release { request: RequestId(7), on }] if *on == at => break,
            other => panic!("after {tried:?}: {other:?}"),
        }
    }
    assert_eq!(tried, vec![3, 2, 3, 2, 3, 2, 3, 2], "never a prefill instance, at most {MAX_HANDOFF_FAILURES} tries");
    assert_eq!(owner(&c, 7), (at, OwnedPhase::Reasoning, None), "decodes where it was prefilled");

    let mut c = setup();
    let at = place(&mut c, spec(8, 10));
    c.decide(Timestamp::ZERO, Event::PrefillDone { request: RequestId(8), instance: at, kv_blocks: 1 }).unwrap();
    let committed =
        Event::MigrationEnded { request: RequestId(8), from: at, to: InstanceId(3), outcome: MoveOutcome::Committed };
    assert!(c.decide(Timestamp::ZERO, committed).unwrap().is_empty());
    assert_eq!(owner(&c, 8), (InstanceId(3), OwnedPhase::Reasoning, None), "owned by its decoder, still reasoning");
    assert_eq!(c.ownership(RequestId(8)).unwrap().migrations, 1);
}

/// A handoff whose bytes fail their checksum at the target: tried once more on the other
/// decoder; failing again, the held copy is dropped and the request starts over (its KV computed
/// again) on the other prefill instance, not the one whose bytes failed (on a decoder where no
/// other instance prefills); that is done once: a request whose handoffs fail their checksum twice
/// more decodes where it was prefilled again.
#[test]
fn a_handoff_failing_its_checksum_twice_is_prefilled_again_elsewhere_once() {
    let mut c = ctl("least-kv", 4);
    for (i, role) in [Role::Prefill, Role::Prefill, Role::Decode, Role::Decode].into_iter().enumerate() {
        c.set_role(InstanceId(i as u32), role);
        c.handle(Timestamp::ZERO, Event::Load(load(i as u32, [30, 0, 20, 10][i], 0))).unwrap();
    }
    while c.poll_action().is_some() {}
    let id = RequestId(7);
    let at = place(&mut c, spec(7, 10));
    assert_eq!(at, InstanceId(1));
    let ended = |from, to, outcome| Event::MigrationEnded { request: id, from, to, outcome };
    let actions = c.decide(Timestamp::ZERO, Event::PrefillDone { request: id, instance: at, kv_blocks: 1 }).unwrap();
    assert_eq!(actions, vec![Action::Migrate { request: id, from: at, to: InstanceId(3), kv_blocks: 1 }]);
    // First mismatch: the other decoder.
    let actions = c.decide(Timestamp::ZERO, ended(at, InstanceId(3), MoveOutcome::Corrupt)).unwrap();
    assert_eq!(actions, vec![Action::Migrate { request: id, from: at, to: InstanceId(2), kv_blocks: 1 }]);
    // An abort for another cause in between does not count as a mismatch.
    let actions = c.decide(Timestamp::ZERO, ended(at, InstanceId(2), MoveOutcome::Aborted)).unwrap();
    assert_eq!(actions, vec![Action::Migrate { request: id, from: at, to: InstanceId(3), kv_blocks: 1 }]);
    // Second mismatch: dropped here, prefilled again on the other prefill instance.
    let actions = c.decide(Timestamp::ZERO, ended(at, InstanceId(3), MoveOutcome::Corrupt)).unwrap();
    let again = InstanceId(0);
    assert_eq!(
        actions,
        vec![Action::Drop { request: id, on: at }, Action::Place { request: id, on: again, replaced: 1, fetch: None }]
    );
    let o = c.ownership(id).unwrap();
    assert_eq!((o.instance, o.replaced, o.reprefilled, o.migrating_to), (again, 1, 1, None));
    // A late event from the dropped copy changes nothing.
    let stale = c.decide(Timestamp::ZERO, Event::PrefillDone { request: id, instance: at, kv_blocks: 1 }).unwrap();
    assert_eq!(stale, vec![Action::Drop { request: id, on: at }]);
    // Prefilled again; its handoffs fail their checksum twice more: it decodes there.
    let actions = c.decide(Timestamp::ZERO, Event::PrefillDone { request: id, instance: again, kv_blocks: 1 }).unwrap();
    let [Action::Migrate { to, .. }] = actions.as_slice() else { panic!("{actions:?}") };
    let actions = c.decide(Timestamp::ZERO, ended(again, *to, MoveOutcome::Corrupt)).unwrap();
    let [Action::Migrate { to, .. }] = actions.as_slice() else { panic!("{actions:?}") };
    let actions = c.decide(Timestamp::ZERO, ended(again, *to, MoveOutcome::Corrupt)).unwrap();
    assert_eq!(actions, vec![Action::Release { request: id, on: again }], "computed again once only");
    assert_eq!(c.ownership(id).unwrap().reprefilled, 1);

    // With no other prefill instance, it is prefilled again on a decoder (and decodes there).
    let mut c = ctl("least-kv", 2);
    for (i, role) in [Role::Prefill, Role::Decode].into_iter().enumerate() {
        c.set_role(InstanceId(i as u32), role);
        c.handle(Timestamp::ZERO, Event::Load(load(i as u32, 0, 0))).unwrap();
    }
    while c.poll_action().is_some() {}
    let at = place(&mut c, spec(7, 10));
    c.decide(Timestamp::ZERO, Event::PrefillDone { request: id, instance: at, kv_blocks: 1 }).unwrap();
    let actions = c.decide(Timestamp::ZERO, ended(at, InstanceId(1), MoveOutcome::Corrupt)).unwrap();
    assert!(actions.is_empty(), "not the decoder that just failed it: it waits for its next report: {actions:?}");
    let actions = c.decide(Timestamp::ZERO, Event::Load(load(1, 0, 0))).unwrap();
    assert_eq!(actions, vec![Action::Migrate { request: id, from: at, to: InstanceId(1), kv_blocks: 1 }]);
    let actions = c.decide(Timestamp::ZERO, ended(at, InstanceId(1), MoveOutcome::Corrupt)).unwrap();
    assert_eq!(
        actions,
        vec![
            Action::Drop { request: id, on: at },
            Action::Place { request: id, on: InstanceId(1), replaced: 1, fetch: None }
        ]
    );
}

/// A leader that takes over mid-handoff counts on from the checksum mismatches its predecessor
/// saw (stored with the request's ownership): the next mismatch prefills it again.
#[test]
fn a_new_leader_counts_on_from_the_mismatches_stored_with_the_request() {
    let roles = [Role::Prefill, Role::Prefill, Role::Decode, Role::Decode];
    let cluster = || {
        let mut c = ctl("least-kv", 4);
        for (i, role) in roles.into_iter().enumerate() {
            c.set_role(InstanceId(i as u32), role);
            c.handle(Timestamp::ZERO, Event::Load(load(i as u32, [30, 0, 20, 10][i], 0))).unwrap();
        }
        while c.poll_action().is_some() {}
        c
    };
    let id = RequestId(7);
    let ended = |from, to, outcome| Event::MigrationEnded { request: id, from, to, outcome };
    let mut old = cluster();
    let at = place(&mut old, spec(7, 10));
    old.decide(Timestamp::ZERO, Event::PrefillDone { request: id, instance: at, kv_blocks: 1 }).unwrap();
    let retry = old.decide(Timestamp::ZERO, ended(at, InstanceId(3), MoveOutcome::Corrupt)).unwrap();
    assert_eq!(retry, vec![Action::Migrate { request: id, from: at, to: InstanceId(2), kv_blocks: 1 }]);
    // The retry is under way when the leader dies; its successor reads what was stored (the
    // record as it was once the mismatch was handled: moving to 2), settles that move (2 does not
    // hold it) and hears the held prefill announced again.
    let stored = serde_json::to_vec(old.ownership(id).unwrap()).unwrap();
    let mut new = cluster();
    new.restore([serde_json::from_slice(&stored).unwrap()]);
    let o = new.ownership(id).unwrap();
    assert_eq!((o.migrating_to, o.corrupt_handoffs), (Some(InstanceId(2)), 1));
    new.decide(Timestamp::ZERO, ended(at, InstanceId(2), MoveOutcome::Aborted)).unwrap();
    let actions = new.decide(Timestamp::ZERO, Event::PrefillDone { request: id, instance: at, kv_blocks: 1 }).unwrap();
    let [Action::Migrate { to, .. }] = actions.as_slice() else { panic!("{actions:?}") };
    let actions = new.decide(Timestamp::ZERO, ended(at, *to, MoveOutcome::Corrupt)).unwrap();
    assert_eq!(
        actions,
        vec![
            Action::Drop { request: id, on: at },
            Action::Place { request: id, on: InstanceId(0), replaced: 1, fetch: None }
        ],
        "the second mismatch, whichever leader saw the first"
    );
    let o = new.ownership(id).unwrap();
    assert_eq!((o.corrupt_handoffs, o.reprefilled), (0, 1), "a new copy counts from zero");
}

/// A handoff no decode instance has room for waits, held, and goes first come first served to the
/// first decode instance that reports room.
#[test]
fn a_handoff_waits_for_a_decode_instance_with_room() {
    let mut c = ctl("least-kv", 3);
    for (i, role) in [Role::Prefill, Role::Decode, Role::Decode].into_iter().enumerate() {
        c.set_role(InstanceId(i as u32), role);
    }
    // Decoders 1 and 2 full (100 blocks each, 16 kept as headroom).
    for i in 0..3 {
        c.handle(Timestamp::ZERO, Event::Load(load(i, [0, 90, 95][i as usize], 0))).unwrap();
    }
    while c.poll_action().is_some() {}
    for id in [7, 8] {
        assert_eq!(place(&mut c, spec(id, 10)), InstanceId(0));
        let done = Event::PrefillDone { request: RequestId(id), instance: InstanceId(0), kv_blocks: 2 };
        assert!(c.decide(Timestamp::ZERO, done).unwrap().is_empty(), "request {id}: no room, it waits");
    }
    assert_eq!(owner(&c, 7).2, None, "not moving yet");
    // Decoder 2 frees room for one: the first to wait goes.
    let actions = c.decide(Timestamp::ZERO, Event::Load(load(2, 81, 0))).unwrap();
    assert_eq!(
        actions,
        vec![Action::Migrate { request: RequestId(7), from: InstanceId(0), to: InstanceId(2), kv_blocks: 2 }]
    );
    // Decoder 1 frees room: the next.
    let actions = c.decide(Timestamp::ZERO, Event::Load(load(1, 10, 0))).unwrap();
    assert_eq!(
        actions,
        vec![Action::Migrate { request: RequestId(8), from: InstanceId(0), to: InstanceId(1), kv_blocks: 2 }]
    );
    assert!(c.decide(Timestamp::ZERO, Event::Load(load(1, 10, 0))).unwrap().is_empty(), "nothing left waiting");
}
