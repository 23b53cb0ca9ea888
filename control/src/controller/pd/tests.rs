//! Arrow driving the controller: placements, handoffs and flips as events → actions.

use super::*;
use crate::controller::{Event, HANDOFF_HEADROOM_BLOCKS};
use crate::roles::{Overlap, PdConfig};
use crate::Action;
use kvfleet_core::policy::registry::{build_policy, PolicyParams};
use kvfleet_core::policy::PrefillQueue;
use kvfleet_core::{RequestSpec, SimRng};

const KV: u64 = 147_456;
/// KV blocks per instance in these tests.
const TOTAL: u32 = 1000;

/// T(l) = 1 s for any prompt; MT = 16,000 tokens (the KV holds 16,000 too).
fn profile() -> ArrowProfile {
    ArrowProfile { prefill: Quadratic { a: 0.0, b: 0.0, c: 1.0 }, decode_max_tokens: 16_000 }
}

fn report(i: u32) -> LoadReport {
    LoadReport {
        instance: InstanceId(i),
        gpu_total_blocks: TOTAL,
        block_bytes: 1,
        block_tokens: 16,
        answering_slo_ok: true,
        ..LoadReport::default()
    }
}

/// Instances `0..prefill` prefill, the rest up to `instances` decode; Arrow with its defaults
/// (SLO_TTFT 3 s, SLO_TPOT 0.15 s, interval 1 s, cooldown 5 s).
fn arrow(prefill: u32, instances: u32) -> Controller {
    let policy = build_policy("least-kv", &PolicyParams::default()).unwrap();
    let mut c = Controller::new(policy, SimRng::seed_from_u64(1)).retain_finished();
    for i in 0..instances {
        let joined = Event::Joined {
            instance: InstanceId(i),
            address: format!("w{i}"),
            model: String::new(),
            kv_bytes_per_token: KV,
        };
        c.handle(Timestamp::ZERO, joined).unwrap();
        c.handle(Timestamp::ZERO, Event::Load(report(i))).unwrap();
        c.set_role(InstanceId(i), if i < prefill { Role::Prefill } else { Role::Decode });
    }
    c.use_arrow(ArrowParams::default(), profile()).unwrap();
    while c.poll_action().is_some() {}
    c
}

fn at(s: f64) -> Timestamp {
    Timestamp::from_secs_f64(s)
}

fn spec(id: u64, prompt: u32) -> RequestSpec {
    RequestSpec {
        content_ids: Vec::new(),
        id: RequestId(id),
        arrival: Timestamp::ZERO,
        prompt_tokens: prompt,
        reasoning_tokens: 0,
        answer_tokens: 10,
    }
}

/// `n` one-second prompts queued on instance `i`.
fn queued(i: u32, n: u32) -> LoadReport {
    let mut r = report(i);
    for _ in 0..n {
        r.prefill_queue.add(100);
    }
    r
}

#[test]
fn a_prompt_goes_where_its_predicted_ttft_meets_the_slo() {
    let mut c = arrow(2, 4);
    // Instance 0 holds the least KV (least-kv's pick) but 3 s of prefill: a new prompt would wait
    // past SLO_TTFT there. Instance 1 holds more KV and no queue.
    c.handle(at(0.0), Event::Load(queued(0, 3))).unwrap();
    c.handle(at(0.0), Event::Load(LoadReport { gpu_used_blocks: 500, ..report(1) })).unwrap();
    let actions = c.decide(at(0.0), Event::Arrival(spec(1, 100))).unwrap();
    assert_eq!(actions, vec![Action::Place { request: RequestId(1), on: InstanceId(1), replaced: 0, fetch: None }]);
    // Charged at once: the next prompt sees 1 s queued on instance 1 (2 s in all: still in SLO).
    assert_eq!(c.loads()[1].prefill_queue, PrefillQueue { requests: 1, tokens: 100, tokens_sq: 10_000 });
}

#[test]
fn no_prefill_instance_in_slo_flips_a_decode_instance_to_prefill() {
    let mut c = arrow(2, 4);
    c.handle(at(0.0), Event::Load(queued(0, 3))).unwrap();
    c.handle(at(0.0), Event::Load(queued(1, 4))).unwrap();
    // Instance 3 decodes less than instance 2: it flips (Alg. 3's argmin).
    c.handle(at(0.0), Event::Load(LoadReport { decode_context_tokens: 4000, ..report(2) })).unwrap();
    c.handle(at(0.0), Event::Load(LoadReport { decode_context_tokens: 1000, ..report(3) })).unwrap();
    let actions = c.decide(at(0.0), Event::Arrival(spec(1, 100))).unwrap();
    assert_eq!(
        actions,
        vec![
            Action::SetRole { instance: InstanceId(3), role: Role::Prefill },
            Action::Place { request: RequestId(1), on: InstanceId(3), replaced: 0, fetch: None },
        ]
    );
    // Decode load high (instance 2 near its 16,000-token MT): the next such prompt flips nothing
    // and waits on the instance with the least work.
    c.handle(at(0.0), Event::Load(LoadReport { decode_context_tokens: 15_500, ..report(2) })).unwrap();
    c.handle(at(0.0), Event::Load(queued(3, 4))).unwrap();
    let actions = c.decide(at(0.0), Event::Arrival(spec(2, 100))).unwrap();
    assert_eq!(actions, vec![Action::Place { request: RequestId(2), on: InstanceId(0), replaced: 0, fetch: None }]);
}

/// Instance `i`'s decode counters: `tokens` produced so far, their latencies summing to `s`.
fn decoded(i: u32, tokens: u64, s: f64) -> LoadReport {
    LoadReport { decode_tokens_total: tokens, decode_latency_ns_total: (s * 1e9) as u64, ..report(i) }
}

#[test]
fn the_monitor_flips_a_prefill_instance_when_decoding_slows_past_l_expand() {
    let mut c = arrow(3, 4);
    assert_eq!(c.next_tick(), Some(at(1.0)), "one pass per interval");
    // 1000 tokens 0.03 s apart: L_D = 0.2, below L_SHRINK and L_EXPAND.
    c.handle(at(0.5), Event::Load(decoded(3, 1000, 30.0))).unwrap();
    assert_eq!(c.decide(at(1.0), Event::Tick).unwrap(), vec![], "fast tokens: no flip");
    // The next 100 tokens came 0.14 s apart: L_D = 0.93 ≥ L_EXPAND.
    c.handle(at(1.5), Event::Load(decoded(3, 1100, 44.0))).unwrap();
    assert_eq!(c.decide(at(1.5), Event::Tick).unwrap(), vec![], "not a pass before the interval ends");
    c.handle(at(1.8), Event::Load(queued(0, 1))).unwrap();
    let actions = c.decide(at(2.0), Event::Tick).unwrap();
    // Instances 1 and 2 have no prefill work, instance 0 has 1 s: the lowest id of the two flips.
    assert_eq!(actions, vec![Action::SetRole { instance: InstanceId(1), role: Role::Decode }]);
    assert_eq!(c.next_tick(), Some(at(3.0)));
    // Both decoders slow at the next pass: within COOLDOWN of the flip, nothing flips ...
    c.handle(at(2.5), Event::Load(decoded(3, 1200, 58.0))).unwrap();
    c.handle(at(2.5), Event::Load(decoded(1, 100, 14.0))).unwrap();
    assert_eq!(c.decide(at(3.0), Event::Tick).unwrap(), vec![], "cooldown");
    // ... after it, instance 2 flips too.
    c.handle(at(7.5), Event::Load(decoded(3, 1300, 72.0))).unwrap();
    c.handle(at(7.5), Event::Load(decoded(1, 200, 28.0))).unwrap();
    let actions = c.decide(at(8.0), Event::Tick).unwrap();
    assert_eq!(actions, vec![Action::SetRole { instance: InstanceId(2), role: Role::Decode }]);
}

/// A pass decides as of its grid instant, however late its timer ran: with a cooldown of exactly
/// two intervals, a flip made by the pass due at 2 s (run 15 ms late) leaves the pass due at 4 s
/// (run 5 ms late) free to flip again, as the simulator's on-time passes are.
#[test]
fn a_late_pass_decides_as_of_its_grid_instant() {
    let mut c = arrow(3, 4);
    let mut a = c.arrow.take().unwrap();
    a.params.cooldown_s = 2.0;
    c.arrow = Some(a);
    c.handle(at(0.5), Event::Load(decoded(3, 1000, 30.0))).unwrap();
    assert_eq!(c.decide(at(1.0), Event::Tick).unwrap(), vec![]);
    // L_D = 0.93 over the next interval: instance 1 flips at the pass due at 2 s.
    c.handle(at(1.5), Event::Load(decoded(3, 1100, 44.0))).unwrap();
    c.handle(at(1.8), Event::Load(queued(0, 1))).unwrap();
    let actions = c.decide(at(2.015), Event::Tick).unwrap();
    assert_eq!(actions, vec![Action::SetRole { instance: InstanceId(1), role: Role::Decode }]);
    c.handle(at(2.5), Event::Load(decoded(3, 1200, 58.0))).unwrap();
    c.handle(at(2.5), Event::Load(decoded(1, 100, 14.0))).unwrap();
    assert_eq!(c.decide(at(3.0), Event::Tick).unwrap(), vec![], "1 s after the flip: cooldown");
    c.handle(at(3.5), Event::Load(decoded(3, 1300, 72.0))).unwrap();
    c.handle(at(3.5), Event::Load(decoded(1, 200, 28.0))).unwrap();
    // Due at 4 s, run at 4.005 s: 1.99 s after the late flip's run, 2 s after its instant.
    let actions = c.decide(at(4.005), Event::Tick).unwrap();
    assert_eq!(actions, vec![Action::SetRole { instance: InstanceId(2), role: Role::Decode }]);
}

/// The passes fall every interval from the first arrival, wherever the controller's clock started
/// (an emulator's leader starts seconds before its workload), and keep that grid when a pass runs
/// late (a timer's lateness does not add up).
#[test]
fn monitoring_passes_count_from_the_first_arrival_on_a_fixed_grid() {
    let mut c = arrow(3, 4);
    c.handle(at(3.0), Event::Tick).unwrap();
    assert_eq!(c.next_tick(), Some(at(4.0)), "before any arrival: every interval from the start");
    let first = RequestSpec { arrival: at(3.3), ..spec(1, 100) };
    c.handle(at(3.301), Event::Arrival(first)).unwrap();
    assert_eq!(c.next_tick(), Some(at(4.3)), "an interval after the first arrival's time");
    let second = RequestSpec { arrival: at(3.6), ..spec(2, 100) };
    c.handle(at(3.6), Event::Arrival(second)).unwrap();
    assert_eq!(c.next_tick(), Some(at(4.3)), "later arrivals move nothing");
    c.handle(at(4.312), Event::Tick).unwrap();
    assert_eq!(c.next_tick(), Some(at(5.3)), "a late pass keeps the grid");
    c.handle(at(7.9), Event::Tick).unwrap();
    assert_eq!(c.next_tick(), Some(at(8.3)), "passes missed are not run twice");
}

/// Request `id` (prompt 100) arrives; returns where it was placed.
fn arrive(c: &mut Controller, now: Timestamp, id: u64) -> InstanceId {
    c.handle(now, Event::Arrival(spec(id, 100))).unwrap();
    let actions = std::iter::from_fn(|| c.poll_action()).collect::<Vec<_>>();
    match actions.last() {
        Some(Action::Place { on, .. }) => *on,
        _ => panic!("not placed: {actions:?}"),
    }
}

/// Request `id`, placed on `on`, produced its first token there and is held (7 KV blocks).
fn prefilled(c: &mut Controller, now: Timestamp, id: u64, on: InstanceId) -> Vec<Action> {
    c.decide(now, Event::PrefillDone { request: RequestId(id), instance: on, kv_blocks: 7 }).unwrap()
}

#[test]
fn a_handoff_goes_to_a_decoder_with_room_under_the_tpot_slo() {
    let mut c = arrow(1, 3);
    // Instance 1 is over its MT; instance 2 is not.
    c.handle(at(0.0), Event::Load(LoadReport { decode_context_tokens: 16_500, ..report(1) })).unwrap();
    c.handle(at(0.0), Event::Load(LoadReport { decode_context_tokens: 9_000, gpu_used_blocks: 600, ..report(2) }))
        .unwrap();
    let on = arrive(&mut c, at(0.0), 1);
    let actions = prefilled(&mut c, at(0.0), 1, on);
    assert_eq!(
        actions,
        vec![Action::Migrate { request: RequestId(1), from: InstanceId(0), to: InstanceId(2), kv_blocks: 7 }]
    );
}

#[test]
fn a_flip_to_decode_keeps_every_other_waiting_handoff() {
    let mut c = arrow(2, 5);
    // Decoders 2 and 3 are full (over MT, no free block); decoder 4 is idle.
    let full =
        LoadReport { decode_context_tokens: 20_000, gpu_used_blocks: TOTAL - HANDOFF_HEADROOM_BLOCKS, ..report(2) };
    for i in [2, 3] {
        c.handle(at(0.0), Event::Load(LoadReport { instance: InstanceId(i), ..full.clone() })).unwrap();
    }
    // Both prefill instances are past SLO_TTFT: the first prompt flips decoder 4 to prefill (at
    // t = 0, starting the cooldown) ...
    c.handle(at(0.0), Event::Load(queued(0, 3))).unwrap();
    c.handle(at(0.0), Event::Load(queued(1, 4))).unwrap();
    assert_eq!(arrive(&mut c, at(0.0), 1), InstanceId(4));
    // ... and once 4 is past it too, the next waits on the one with the least work (decode load is
    // high now: no flip).
    c.handle(at(0.0), Event::Load(queued(4, 3))).unwrap();
    assert_eq!(arrive(&mut c, at(0.0), 2), InstanceId(0));
    // Both prefilled; the decoders are full and a P→D flip is in cooldown: both wait.
    assert_eq!(prefilled(&mut c, at(0.0), 1, InstanceId(4)), vec![]);
    assert_eq!(prefilled(&mut c, at(0.0), 2, InstanceId(0)), vec![]);
    assert_eq!(c.waiting_handoffs(), 2);
    // Past the cooldown decoder 3 reports room, though its decoding is over MT: request 1's
    // handoff (Alg. 1: no decoder within SLO_TPOT) flips its own prefill instance 4 (no prefill
    // work left) to decode, and it decodes there; then request 2, next in line, goes to instance
    // 4, the one decoder within SLO_TPOT now.
    c.handle(at(10.0), Event::Load(report(4))).unwrap();
    let over = LoadReport { decode_context_tokens: 20_000, ..report(3) };
    let actions = c.decide(at(10.0), Event::Load(over)).unwrap();
    assert_eq!(
        actions,
        vec![
            Action::SetRole { instance: InstanceId(4), role: Role::Decode },
            Action::Release { request: RequestId(1), on: InstanceId(4) },
            Action::Migrate { request: RequestId(2), from: InstanceId(0), to: InstanceId(4), kv_blocks: 7 },
        ]
    );
    assert_eq!(c.waiting_handoffs(), 0);
}

#[test]
fn a_handoff_waits_while_every_decoder_is_full_then_takes_one_with_room() {
    // Both decoders full: a report from one (still full) leaves the waiting handoff waiting and
    // flips nothing (the monitoring pass decides flips then).
    let mut c = arrow(1, 3);
    let full =
        LoadReport { decode_context_tokens: 20_000, gpu_used_blocks: TOTAL - HANDOFF_HEADROOM_BLOCKS, ..report(1) };
    for i in [1, 2] {
        c.handle(at(0.0), Event::Load(LoadReport { instance: InstanceId(i), ..full.clone() })).unwrap();
    }
    let on = arrive(&mut c, at(0.0), 1);
    assert_eq!(prefilled(&mut c, at(0.0), 1, on), vec![], "pool of one prefill instance: no flip");
    assert_eq!(c.decide(at(9.0), Event::Load(full.clone())).unwrap(), vec![]);
    assert_eq!(c.waiting_handoffs(), 1);
    // Room on decoder 2: it goes there.
    let actions = c.decide(at(9.5), Event::Load(report(2))).unwrap();
    assert_eq!(
        actions,
        vec![Action::Migrate { request: RequestId(1), from: InstanceId(0), to: InstanceId(2), kv_blocks: 7 }]
    );
}

#[test]
fn the_baselines_place_by_load_or_in_turn_and_never_flip() {
    use crate::arrow::Placement;
    for placement in [Placement::MinimalLoad, Placement::RoundRobin] {
        let policy = build_policy("least-kv", &PolicyParams::default()).unwrap();
        let mut c = Controller::new(policy, SimRng::seed_from_u64(1)).retain_finished();
        for i in 0..4 {
            let joined = Event::Joined {
                instance: InstanceId(i),
                address: String::new(),
                model: String::new(),
                kv_bytes_per_token: KV,
            };
            c.handle(Timestamp::ZERO, joined).unwrap();
            c.set_role(InstanceId(i), if i < 2 { Role::Prefill } else { Role::Decode });
        }
        c.use_arrow(ArrowParams { placement, ..ArrowParams::default() }, profile()).unwrap();
        // Both prefill instances past SLO_TTFT (Arrow would flip a decoder); instance 1 less so.
        c.handle(at(0.0), Event::Load(queued(0, 5))).unwrap();
        c.handle(at(0.0), Event::Load(queued(1, 4))).unwrap();
        for i in [2, 3] {
            c.handle(at(0.0), Event::Load(report(i))).unwrap();
        }
        while c.poll_action().is_some() {}
        let on: Vec<u32> = (1..=4).map(|id| arrive(&mut c, at(0.0), id).0).collect();
        let want = match placement {
            // 1 s each: 4 s, then 5 s on both (tie: lowest id), then 6 s on 0 ...
            Placement::MinimalLoad => vec![1, 0, 1, 0],
            _ => vec![0, 1, 0, 1],
        };
        assert_eq!(on, want, "{placement:?}");
        // Decode instances slow (L_D ≥ L_EXPAND): still no flip.
        c.handle(at(0.5), Event::Load(decoded(2, 100, 14.0))).unwrap();
        c.handle(at(0.5), Event::Load(decoded(3, 100, 14.0))).unwrap();
        assert_eq!(c.decide(at(1.0), Event::Tick).unwrap(), vec![], "{placement:?}");
        assert_eq!(c.decide(at(2.0), Event::Tick).unwrap(), vec![], "{placement:?}");
    }
}

fn join(c: &mut Controller, i: u32) -> Vec<Action> {
    let joined = Event::Joined {
        instance: InstanceId(i),
        address: format!("w{i}"),
        model: String::new(),
        kv_bytes_per_token: KV,
    };
    let mut actions = c.decide(Timestamp::ZERO, joined).unwrap();
    actions.extend(c.decide(Timestamp::ZERO, Event::Load(report(i))).unwrap());
    actions
}

fn roles_set(actions: &[Action]) -> Vec<(u32, Role)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::SetRole { instance, role } => Some((instance.0, *role)),
            _ => None,
        })
        .collect()
}

#[test]
fn instances_that_join_after_the_split_get_its_roles_and_a_returning_one_is_told_again() {
    let policy = build_policy("least-kv", &PolicyParams::default()).unwrap();
    let mut c = Controller::new(policy, SimRng::seed_from_u64(1));
    // The coordinator knows no instance when it splits: each gets its role as it joins.
    c.split_prefill_decode(&PdConfig { prefill_instances: 2, ..PdConfig::default() });
    assert!(c.poll_action().is_none(), "no instance known yet");
    let told: Vec<_> = (0..4).flat_map(|i| roles_set(&join(&mut c, i))).collect();
    assert_eq!(told, [(0, Role::Prefill), (1, Role::Prefill), (2, Role::Decode), (3, Role::Decode)]);
    // A flip sticks: the instance leaves (its process restarted) and joins again with the role it
    // had, told again (a new process starts mixed), not the split's.
    c.set_role(InstanceId(2), Role::Prefill);
    while c.poll_action().is_some() {}
    c.handle(at(1.0), Event::Left { instance: InstanceId(2) }).unwrap();
    while c.poll_action().is_some() {}
    assert_eq!(roles_set(&join(&mut c, 2)), [(2, Role::Prefill)]);
    assert_eq!(c.role(InstanceId(2)), Role::Prefill);
    let roles: Vec<_> = (0..4).map(|i| (i, c.role(InstanceId(i)))).collect();
    assert_eq!(roles, [(0, Role::Prefill), (1, Role::Prefill), (2, Role::Prefill), (3, Role::Decode)]);
    // Off, nothing is split.
    let policy = build_policy("least-kv", &PolicyParams::default()).unwrap();
    let mut off = Controller::new(policy, SimRng::seed_from_u64(1));
    off.split_prefill_decode(&PdConfig::default());
    assert!(roles_set(&join(&mut off, 0)).is_empty());
}

#[test]
fn a_prefill_done_announced_again_starts_no_second_handoff() {
    let mut c = arrow(1, 2);
    let placed = c.decide(at(0.0), Event::Arrival(spec(1, 100))).unwrap();
    assert!(matches!(placed[..], [Action::Place { on: InstanceId(0), .. }]), "{placed:?}");
    // Decoder 1 is full: the handoff waits.
    let mut full = report(1);
    full.gpu_used_blocks = TOTAL;
    c.handle(at(0.1), Event::Load(full)).unwrap();
    let done = || Event::PrefillDone { request: RequestId(1), instance: InstanceId(0), kv_blocks: 7 };
    let first = c.decide(at(0.5), done()).unwrap();
    assert!(first.iter().all(|a| !matches!(a, Action::Migrate { .. })), "{first:?}");
    assert_eq!(c.waiting_handoffs(), 1);
    // Announced again (the worker was told its role once more): still one waiting handoff.
    let again = c.decide(at(0.6), done()).unwrap();
    assert!(again.is_empty(), "{again:?}");
    assert_eq!(c.waiting_handoffs(), 1);
    // Room on the decoder: exactly one move.
    let moves = c.decide(at(0.7), Event::Load(report(1))).unwrap();
    let n = moves.iter().filter(|a| matches!(a, Action::Migrate { request: RequestId(1), .. })).count();
    assert_eq!(n, 1, "{moves:?}");
}

/// A request waiting its turn behind a larger one, announced again when a decoder has room for
/// it alone, keeps its place: one move for it, in FCFS order (a second, concurrent move of the
/// same request would strand its first copy).
#[test]
fn a_waiting_handoff_announced_again_keeps_its_place_and_moves_once() {
    let policy = build_policy("least-kv", &PolicyParams::default()).unwrap();
    let mut c = Controller::new(policy, SimRng::seed_from_u64(1)).retain_finished();
    c.split_prefill_decode(&PdConfig { prefill_instances: 1, ..PdConfig::default() });
    join(&mut c, 0);
    join(&mut c, 1);
    let decoder = |used: u32| Event::Load(LoadReport { gpu_used_blocks: used, ..report(1) });
    c.handle(at(0.0), decoder(TOTAL)).unwrap();
    for id in [1, 2] {
        let placed = c.decide(at(0.0), Event::Arrival(spec(id, 100))).unwrap();
        assert!(matches!(placed[..], [Action::Place { on: InstanceId(0), .. }]), "{placed:?}");
    }
    let done = |id, kv_blocks| Event::PrefillDone { request: RequestId(id), instance: InstanceId(0), kv_blocks };
    let mut moves = Vec::new();
    let follow = |moves: &mut Vec<u64>, actions: Vec<Action>| {
        moves.extend(actions.into_iter().filter_map(|a| match a {
            Action::Migrate { request, .. } => Some(request.0),
            _ => None,
        }))
    };
    follow(&mut moves, c.decide(at(0.1), done(1, 400)).unwrap());
    follow(&mut moves, c.decide(at(0.2), done(2, 10)).unwrap());
    assert_eq!(c.waiting_handoffs(), 2, "the decoder is full");
    // Room for 2, not for 1 ahead of it: both wait.
    follow(&mut moves, c.decide(at(0.3), decoder(TOTAL - 100)).unwrap());
    assert_eq!(c.waiting_handoffs(), 2);
    // 2 announced again: no move out of turn.
    follow(&mut moves, c.decide(at(0.4), done(2, 10)).unwrap());
    assert!(moves.is_empty(), "{moves:?}");
    // Room for both: each moves once, in order.
    follow(&mut moves, c.decide(at(0.5), decoder(0)).unwrap());
    assert_eq!(moves, [1, 2]);
    assert_eq!(c.waiting_handoffs(), 0);
}

/// A decode pool of another tensor-parallel degree: Arrow weighs the instances numbered from the
/// split's `prefill_instances` on (also one that joins later) with their own profile, the rest
/// with the one given to `use_arrow`; without a split the pool profile is refused.
#[test]
fn the_decode_pool_is_weighed_with_its_own_profile() {
    let policy = build_policy("least-kv", &PolicyParams::default()).unwrap();
    let mut c = Controller::new(policy, SimRng::seed_from_u64(1));
    c.use_arrow(ArrowParams::default(), profile()).unwrap();
    let pool = ArrowProfile { prefill: Quadratic { a: 0.0, b: 0.0, c: 0.5 }, decode_max_tokens: 4_000 };
    assert!(c.set_decode_pool_profile(pool).is_err(), "no split yet");
    c.split_prefill_decode(&PdConfig { prefill_instances: 2, ..PdConfig::default() });
    c.set_decode_pool_profile(pool).unwrap();
    for i in 0..5 {
        join(&mut c, i);
    }
    let snapshot = c.arrow_snapshot(&[]).unwrap();
    let seen: Vec<(u32, u64, f64)> =
        snapshot.loads().iter().map(|l| (l.instance.0, l.max_tokens, l.profile.c)).collect();
    assert_eq!(seen, [(0, 16_000, 1.0), (1, 16_000, 1.0), (2, 4_000, 0.5), (3, 4_000, 0.5), (4, 4_000, 0.5)]);
}

/// An overlapped handoff is decided as its prefill starts only where a decoder meets SLO_TPOT as
/// it is; where Alg. 1 would flip an instance (or fall back on a decoder past the SLO), it is
/// decided at the prefill's end instead, as one-shot: a decision taken a whole prefill early
/// must not flip on loads the reservations of moves under way inflate.
#[test]
fn an_early_handoff_takes_a_decoder_within_the_slo_and_never_flips() {
    let mut c = arrow(2, 3);
    c.split_prefill_decode(&PdConfig { prefill_instances: 2, overlap: Overlap::Layer, ..PdConfig::default() });
    while c.poll_action().is_some() {}
    let started = |id, on| Event::PrefillStarted { request: RequestId(id), instance: on, kv_blocks: 7 };
    // Decoder 2 is within SLO_TPOT: the move starts with the prefill.
    let on = arrive(&mut c, at(0.0), 1);
    assert_eq!(
        c.decide(at(0.0), started(1, on)).unwrap(),
        vec![Action::Migrate { request: RequestId(1), from: on, to: InstanceId(2), kv_blocks: 7 }]
    );
    // Past its MT now (room left): no early decision, and no flip.
    c.handle(at(0.5), Event::Load(LoadReport { decode_context_tokens: 16_500, ..report(2) })).unwrap();
    let on = arrive(&mut c, at(0.5), 2);
    assert_eq!(c.decide(at(0.5), started(2, on)).unwrap(), vec![]);
    assert_eq!(c.role(InstanceId(0)), Role::Prefill);
    assert_eq!(c.role(InstanceId(1)), Role::Prefill);
    // At the prefill's end Alg. 1 runs whole: no decoder within the SLO, so it flips one.
    let actions = prefilled(&mut c, at(1.5), 2, on);
    assert!(
        actions.iter().any(|a| matches!(a, Action::SetRole { role: Role::Decode, .. })),
        "the one-shot decision flips: {actions:?}"
    );
}

/// A profile an instance measured of itself (its worker on its own timing) replaces the
/// estimate for that instance alone, the decode pool's too; without Arrow, not a profile, or
/// measured for another SLO_TPOT, it is refused.
#[test]
fn an_instance_s_own_profile_replaces_the_estimate() {
    let policy = build_policy("least-kv", &PolicyParams::default()).unwrap();
    let mut c = Controller::new(policy, SimRng::seed_from_u64(1));
    let own = ArrowProfile { prefill: Quadratic { a: 0.0, b: 0.0, c: 0.25 }, decode_max_tokens: 2_000 };
    let slo = ArrowParams::default().slo_tpot_s;
    assert!(c.set_instance_profile(InstanceId(2), own, slo).is_err(), "no Arrow yet");
    c.use_arrow(ArrowParams::default(), profile()).unwrap();
    c.split_prefill_decode(&PdConfig { prefill_instances: 1, ..PdConfig::default() });
    let pool = ArrowProfile { prefill: Quadratic { a: 0.0, b: 0.0, c: 0.5 }, decode_max_tokens: 4_000 };
    c.set_decode_pool_profile(pool).unwrap();
    c.set_instance_profile(InstanceId(2), own, slo).unwrap();
    let nan = ArrowProfile { prefill: Quadratic { a: 0.0, b: f64::NAN, c: 0.5 }, decode_max_tokens: 4_000 };
    assert!(c.set_instance_profile(InstanceId(1), nan, slo).is_err());
    assert!(c.set_instance_profile(InstanceId(3), own, 2.0 * slo).is_err(), "another SLO_TPOT's MT");
    for i in 0..4 {
        join(&mut c, i);
    }
    let snapshot = c.arrow_snapshot(&[]).unwrap();
    let seen: Vec<(u32, u64, f64)> =
        snapshot.loads().iter().map(|l| (l.instance.0, l.max_tokens, l.profile.c)).collect();
    assert_eq!(seen, [(0, 16_000, 1.0), (1, 4_000, 0.5), (2, 2_000, 0.25), (3, 4_000, 0.5)]);
}

#[test]
fn a_held_copy_the_cluster_re_placed_elsewhere_is_dropped_where_it_is_held() {
    let mut c = arrow(2, 4);
    let first = arrive(&mut c, at(0.0), 1);
    // Its instance is evicted (its lease lapsed while it was stopped): re-placed on the other.
    let actions = c.decide(at(1.0), Event::Left { instance: first }).unwrap();
    let Some(Action::Place { on: again, .. }) = actions.iter().find(|a| matches!(a, Action::Place { .. })) else {
        panic!("not re-placed: {actions:?}")
    };
    let again = *again;
    assert_ne!(again, first);
    let joined = Event::Joined { instance: first, address: "w".into(), model: String::new(), kv_bytes_per_token: KV };
    c.decide(at(2.0), joined).unwrap();
    // The stopped instance resumes and announces its copy, held after its prefill: dropped there.
    assert_eq!(prefilled(&mut c, at(2.5), 1, first), vec![Action::Drop { request: RequestId(1), on: first }]);
    // The copy the cluster counts is handed off as usual.
    let actions = prefilled(&mut c, at(3.0), 1, again);
    assert!(matches!(actions[..], [Action::Migrate { request: RequestId(1), .. }]), "{actions:?}");
    // A repeated announcement of a handoff under way is not a stale copy.
    assert_eq!(prefilled(&mut c, at(3.1), 1, again), vec![]);
}

/// `[pd] disaggregate = "prefix-threshold"` on a static split: a short prompt decodes where it was
/// prefilled, a long one is handed off; `never` hands none off, whatever the prompt.
#[test]
fn short_prompts_decode_where_they_were_prefilled_under_a_prefix_threshold() {
    use crate::roles::Disaggregate;
    let run = |disaggregate: Disaggregate| {
        let policy = build_policy("least-kv", &PolicyParams::default()).unwrap();
        let mut c = Controller::new(policy, SimRng::seed_from_u64(1)).retain_finished();
        let pd = PdConfig { prefill_instances: 1, disaggregate: Some(disaggregate), ..PdConfig::default() };
        c.split_prefill_decode(&pd);
        join(&mut c, 0);
        join(&mut c, 1);
        let mut out = Vec::new();
        for (id, prompt) in [(1, 100), (2, 600)] {
            let placed = c.decide(at(0.0), Event::Arrival(spec(id, prompt))).unwrap();
            assert!(matches!(placed[..], [Action::Place { on: InstanceId(0), .. }]), "{placed:?}");
            out.extend(prefilled(&mut c, at(0.1), id, InstanceId(0)));
        }
        out
    };
    assert_eq!(
        run(Disaggregate::PrefixThreshold),
        vec![
            Action::Release { request: RequestId(1), on: InstanceId(0) },
            Action::Migrate { request: RequestId(2), from: InstanceId(0), to: InstanceId(1), kv_blocks: 7 },
        ]
    );
    assert_eq!(
        run(Disaggregate::Never),
        vec![
            Action::Release { request: RequestId(1), on: InstanceId(0) },
            Action::Release { request: RequestId(2), on: InstanceId(0) },
        ]
    );
    let always = run(Disaggregate::Always);
    assert!(always.iter().all(|a| matches!(a, Action::Migrate { to: InstanceId(1), .. })), "{always:?}");
}

/// A static split of one prefill and two decode instances whose handoffs are `handoff`.
fn split_with(handoff: crate::roles::HandoffMode) -> Controller {
    let policy = build_policy("least-kv", &PolicyParams::default()).unwrap();
    let mut c = Controller::new(policy, SimRng::seed_from_u64(1)).retain_finished();
    c.split_prefill_decode(&PdConfig { prefill_instances: 1, handoff, ..PdConfig::default() });
    for i in 0..3 {
        join(&mut c, i);
    }
    c
}

fn full(i: u32, used: u32) -> Event {
    Event::Load(LoadReport { gpu_used_blocks: used, ..report(i) })
}

fn refused(c: &mut Controller, now: Timestamp, id: u64, to: u32) -> Vec<Action> {
    let ended = Event::MigrationEnded {
        request: RequestId(id),
        from: InstanceId(0),
        to: InstanceId(to),
        outcome: crate::controller::MoveOutcome::Refused,
    };
    c.decide(now, ended).unwrap()
}

fn migrate(id: u64, to: u32) -> Action {
    Action::Migrate { request: RequestId(id), from: InstanceId(0), to: InstanceId(to), kv_blocks: 7 }
}

/// `[pd] handoff = "push"`: with both decoders full the handoff is sent all the same, to the one
/// with the least KV; each refusal leaves it held on its prefill instance and the next decoder
/// is tried 50 ms later, round the pool for as long as it takes (refusals are not failures:
/// more of them than MAX_HANDOFF_FAILURES never release it), until one takes it. Pulled, the
/// same handoff waits for a report of room and asks nobody.
#[test]
fn a_pushed_handoff_refused_by_full_decoders_tries_the_next_every_50_ms() {
    use crate::controller::{MoveOutcome, MAX_HANDOFF_FAILURES};
    use crate::roles::HandoffMode;
    let mut c = split_with(HandoffMode::Push);
    c.handle(at(0.0), full(1, TOTAL - 5)).unwrap();
    c.handle(at(0.0), full(2, TOTAL - 10)).unwrap();
    assert_eq!(arrive(&mut c, at(0.0), 1), InstanceId(0));
    assert_eq!(c.next_tick(), None, "nothing periodic before a refusal");
    assert_eq!(prefilled(&mut c, at(1.0), 1, InstanceId(0)), vec![migrate(1, 2)], "the least KV, full or not");
    // Refused: nothing at once; the next try is due 50 ms later, on the other decoder.
    assert_eq!(refused(&mut c, at(1.0), 1, 2), vec![]);
    assert_eq!(c.waiting_handoffs(), 1);
    assert_eq!(c.next_tick(), Some(at(1.05)));
    assert_eq!(c.decide(at(1.04), Event::Tick).unwrap(), vec![], "not due yet");
    assert_eq!(c.decide(at(1.05), Event::Tick).unwrap(), vec![migrate(1, 1)]);
    // Round the pool, over and over: never the decoder that just refused, though it reports the
    // least KV now.
    let mut t = 1.05;
    let mut asked = vec![1];
    for _ in 0..MAX_HANDOFF_FAILURES + 2 {
        let last = *asked.last().unwrap();
        assert_eq!(refused(&mut c, at(t), 1, last), vec![]);
        c.handle(at(t), full(last, TOTAL - 20)).unwrap();
        c.handle(at(t), full(3 - last, TOTAL - 5)).unwrap();
        t += 0.05;
        let actions = c.decide(at(t), Event::Tick).unwrap();
        let [Action::Migrate { to, .. }] = actions[..] else { panic!("at {t}: {actions:?}") };
        asked.push(to.0);
    }
    assert!(asked.windows(2).all(|w| w[0] != w[1]), "each try the next decoder: {asked:?}");
    // Decoder 1 took it: no retry left.
    let last = *asked.last().unwrap();
    let ended = Event::MigrationEnded {
        request: RequestId(1),
        from: InstanceId(0),
        to: InstanceId(last),
        outcome: MoveOutcome::Committed,
    };
    assert_eq!(c.decide(at(t), ended).unwrap(), vec![]);
    assert_eq!((c.waiting_handoffs(), c.next_tick()), (0, None));
    assert_eq!(c.ownership(RequestId(1)).unwrap().instance, InstanceId(last));

    // Pulled, the same handoff asks no full decoder: it waits for a report of room.
    let mut c = split_with(HandoffMode::Pull);
    c.handle(at(0.0), full(1, TOTAL - 5)).unwrap();
    c.handle(at(0.0), full(2, TOTAL - 10)).unwrap();
    arrive(&mut c, at(0.0), 1);
    assert_eq!(prefilled(&mut c, at(1.0), 1, InstanceId(0)), vec![]);
    assert_eq!((c.waiting_handoffs(), c.next_tick()), (1, None));
    assert_eq!(c.decide(at(2.0), full(1, 0)).unwrap(), vec![migrate(1, 1)]);
}

/// A pushed handoff waiting for its next try whose prefill instance starts decoding decodes there
/// (no move at the retry); one no decoder could ever hold decodes where it was prefilled at once
/// (it had waited for ever when pulled, its KV and the headroom larger than any decoder).
#[test]
fn a_handoff_ends_with_its_instances_flip_or_where_no_decoder_could_ever_hold_it() {
    use crate::roles::HandoffMode;
    let mut c = split_with(HandoffMode::Push);
    arrive(&mut c, at(0.0), 1);
    assert_eq!(prefilled(&mut c, at(1.0), 1, InstanceId(0)), vec![migrate(1, 1)]);
    assert_eq!(refused(&mut c, at(1.0), 1, 1), vec![]);
    c.set_role(InstanceId(0), Role::Decode);
    assert_eq!(c.poll_action(), Some(Action::SetRole { instance: InstanceId(0), role: Role::Decode }));
    assert_eq!(c.decide(at(1.05), Event::Tick).unwrap(), vec![]);
    assert_eq!((c.waiting_handoffs(), c.next_tick()), (0, None));

    // A KV larger than every decoder decodes where it was prefilled, pushed or pulled; one that
    // leaves a decoder less than the headroom is handed off (pulled: once one is empty).
    for mode in [HandoffMode::Push, HandoffMode::Pull] {
        let mut c = split_with(mode);
        arrive(&mut c, at(0.0), 2);
        arrive(&mut c, at(0.0), 3);
        let held = |id, kv_blocks| Event::PrefillDone { request: RequestId(id), instance: InstanceId(0), kv_blocks };
        let release = Action::Release { request: RequestId(2), on: InstanceId(0) };
        assert_eq!(c.decide(at(1.0), held(2, TOTAL + 1)).unwrap(), vec![release], "{mode:?}");
        c.handle(at(1.0), full(1, 10)).unwrap();
        c.handle(at(1.0), full(2, 10)).unwrap();
        let nearly = held(3, TOTAL - HANDOFF_HEADROOM_BLOCKS / 2);
        let pushed =
            Action::Migrate { request: RequestId(3), from: InstanceId(0), to: InstanceId(1), kv_blocks: TOTAL - 8 };
        match mode {
            HandoffMode::Push => assert_eq!(c.decide(at(1.1), nearly).unwrap(), vec![pushed]),
            HandoffMode::Pull => {
                assert_eq!(c.decide(at(1.1), nearly).unwrap(), vec![], "no decoder is empty yet");
                assert_eq!(c.decide(at(1.2), full(1, 0)).unwrap(), vec![pushed]);
            }
        }
    }
}
