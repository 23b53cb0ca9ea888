//! Engine behaviour: PASCAL Fig. 2's worked example, phase handling, preemption, migration, and
//! accounting invariants under random workloads.

use super::sched::{build_scheduler, SchedulerParams, WaitingAdmission};
use super::*;
use crate::timing::FixedTiming;
use proptest::prelude::*;

const UNIT: u64 = 1_000_000_000; // one "time unit" of the paper's figures = 1 s

fn cfg(gpu_blocks: u32, cpu_blocks: u32) -> EngineConfig {
    EngineConfig {
        prefix_caching: false,
        block_size: 16,
        gpu_blocks,
        cpu_blocks,
        max_num_seqs: 256,
        max_batched_tokens: 8192,
        kv_bytes_per_token: 262_144,
        tpot: TimeSpan(UNIT),
    }
}

fn engine(sched: &str, gpu_blocks: u32, cpu_blocks: u32, quantum: u32) -> Engine {
    let timing = Arc::new(FixedTiming { iteration: TimeSpan(UNIT), transfer: TimeSpan::ZERO });
    let params = SchedulerParams { quantum_tokens: quantum, ..SchedulerParams::default() };
    Engine::new(InstanceId(0), cfg(gpu_blocks, cpu_blocks), timing, build_scheduler(sched, &params).unwrap())
}

fn spec(id: u64, arrival_units: u64, prompt: u32, reasoning: u32, answer: u32) -> RequestSpec {
    RequestSpec {
        content_ids: Vec::new(),
        id: RequestId(id),
        arrival: Timestamp(arrival_units * UNIT),
        prompt_tokens: prompt,
        reasoning_tokens: reasoning,
        answer_tokens: answer,
    }
}

/// Drive one engine on the integer time grid: at each tick finish the iteration, admit arrivals,
/// plan the next. Returns finished records by id.
fn run(engine: &mut Engine, mut requests: Vec<RequestSpec>) -> Vec<RequestRecord> {
    requests.sort_by_key(|r| r.arrival);
    let mut events = Vec::new();
    let mut done = Vec::new();
    let mut next = 0;
    for tick in 0..10_000u64 {
        let now = Timestamp(tick * UNIT);
        engine.complete_iteration(now, &mut events);
        while next < requests.len() && requests[next].arrival <= now {
            engine.submit(now, requests[next].clone()).unwrap();
            next += 1;
        }
        engine.plan_iteration(now);
        engine.check_invariants().unwrap();
        for e in events.drain(..) {
            if let EngineEvent::Finished(r) = e {
                done.push(*r);
            }
        }
        if next == requests.len() && engine.is_empty() {
            break;
        }
    }
    done.sort_by_key(|r| r.id);
    done
}

fn ttft_units(r: &RequestRecord) -> u64 {
    (r.first_answer_token.unwrap() - r.arrival).as_nanos() / UNIT
}

/// PASCAL Fig. 2: A, B, C arrive at 0, 1, 2; memory holds two requests; each produces 8 tokens.
fn fig2() -> Vec<RequestSpec> {
    vec![spec(0, 0, 1, 0, 8), spec(1, 1, 1, 0, 8), spec(2, 2, 1, 0, 8)]
}

#[test]
fn fig2_oracle_fcfs_rr_ttfts() {
    // (scheduler, GPU blocks, quantum) → TTFT of A, B, C in time units, as the paper states.
    let cases: &[(&str, u32, u32, [u64; 3])] = &[
        ("fcfs", 64, 500, [1, 1, 1]), // (a) oracle: unlimited memory, everything starts on arrival
        ("fcfs", 2, 500, [1, 1, 7]),  // (b) FCFS: C waits for A to finish, TTFT 7
        ("rr", 2, 4, [1, 1, 3]),      // (c) RR, quantum 4: C joins when A is preempted at 4
    ];
    for &(sched, gpu, quantum, want) in cases {
        let mut e = engine(sched, gpu, 64, quantum);
        let done = run(&mut e, fig2());
        let got: Vec<u64> = done.iter().map(ttft_units).collect();
        assert_eq!(got, want, "{sched} with {gpu} blocks");
    }
}

#[test]
fn fig2_rr_preempts_b_for_three_units_and_c_at_eight() {
    let mut e = engine("rr", 2, 64, 4);
    let done = run(&mut e, fig2());
    let (a, b, c) = (&done[0], &done[1], &done[2]);
    // A: preempted at 4 (after 4 tokens), resumes at 5, finishes at 9.
    assert_eq!(a.finish, Some(Timestamp(9 * UNIT)));
    // B: 4 tokens by 5, preempted 5..8 (3 units), 4 more tokens at 9..12.
    assert_eq!(b.preemptions, 1);
    assert_eq!(b.finish, Some(Timestamp(12 * UNIT)));
    // C: preempted at 8 after its 4-token quantum.
    assert_eq!(c.preemptions, 1);
    assert!(a.preemptions == 1);
}

#[test]
fn reasoning_boundary_and_answer_timestamps() {
    let mut e = engine("pascal", 64, 64, 500);
    let mut events = Vec::new();
    e.submit(Timestamp(0), spec(7, 0, 10, 3, 2)).unwrap();
    let mut t = e.step(Timestamp(0), &mut events).unwrap();
    let mut boundary_at = None;
    let mut record = None;
    while record.is_none() {
        t = match e.step(t, &mut events) {
            Some(next) => {
                for ev in events.drain(..) {
                    if let EngineEvent::PhaseBoundary { request, kv_blocks } = ev {
                        assert_eq!(request, RequestId(7));
                        assert_eq!(kv_blocks, 1, "13 tokens of context fit one block");
                        boundary_at = Some(t);
                    }
                }
                next
            }
            None => {
                for ev in events.drain(..) {
                    if let EngineEvent::Finished(r) = ev {
                        record = Some(*r);
                    }
                }
                t
            }
        };
    }
    let r = record.unwrap();
    // Tokens at 1 (prefill), 2, 3 = reasoning; 4, 5 = answer.
    assert_eq!(r.first_token, Some(Timestamp(UNIT)));
    assert_eq!(r.reasoning_end, Some(Timestamp(3 * UNIT)));
    assert_eq!(boundary_at, Some(Timestamp(3 * UNIT)));
    assert_eq!(r.first_scheduled_after_reasoning, Some(Timestamp(3 * UNIT)), "no blocking");
    assert_eq!(r.first_answer_token, Some(Timestamp(4 * UNIT)));
    assert_eq!(r.finish, Some(Timestamp(5 * UNIT)));
    assert_eq!(r.qoe, Some(1.0), "one token per TPOT is exactly on pace");
}

#[test]
fn pascal_reasoning_preempts_answering_and_fcfs_does_not() {
    // Instance holds 2 blocks. An answering request is running; a reasoning request arrives.
    // PASCAL offloads the answering one; FCFS blocks the newcomer.
    for (sched, newcomer_waits) in [("pascal", false), ("fcfs", true)] {
        let mut e = engine(sched, 2, 64, 500);
        let mut ev = Vec::new();
        e.submit(Timestamp(0), spec(1, 0, 17, 0, 10)).unwrap(); // 18 tokens → 2 blocks, answering
        e.step(Timestamp(0), &mut ev);
        e.complete_iteration(Timestamp(UNIT), &mut ev);
        e.submit(Timestamp(UNIT), spec(2, 1, 1, 5, 5)).unwrap(); // reasoning, 1 block
        e.plan_iteration(Timestamp(UNIT));
        let report = e.load_report();
        assert_eq!(report.reasoning_requests, 1);
        let newcomer_running = e.kv().tier_of(RequestId(2)) == Some(Tier::Gpu);
        assert_eq!(!newcomer_running, newcomer_waits, "{sched}");
        if sched == "pascal" {
            assert_eq!(e.kv().tier_of(RequestId(1)), Some(Tier::Cpu), "answering request offloaded");
            assert_eq!(e.stats().preemptions, 1);
        }
        e.check_invariants().unwrap();
    }
}

/// A PASCAL engine with fidelity switches set.
fn engine_with(gpu_blocks: u32, cpu_blocks: u32, params: SchedulerParams) -> Engine {
    let timing = Arc::new(FixedTiming { iteration: TimeSpan(UNIT), transfer: TimeSpan::ZERO });
    Engine::new(InstanceId(0), cfg(gpu_blocks, cpu_blocks), timing, build_scheduler("pascal", &params).unwrap())
}

/// B (20-token prompt, 2 reasoning tokens) crosses `</think>` at 2 holding 2 of 3 GPU blocks; W, a
/// reasoning request needing 2 blocks, arrives then (or one token later, after B's first answer
/// token at 3). Literal PASCAL offloads B for W; `boundary_hold` keeps B until its first answer
/// token (then W may take it); `admission = free-memory` admits W only into free memory.
#[test]
fn boundary_hold_and_free_memory_admission_keep_a_resident_request_from_waiting_ones() {
    use WaitingAdmission::*;
    // (name, boundary_hold, admission, W arrives after B's first answer token, B offloaded for W)
    let cases = [
        ("literal, at the boundary", false, Preempt, false, true),
        ("boundary_hold, at the boundary", true, Preempt, false, false),
        ("free-memory, at the boundary", false, FreeMemory, false, false),
        ("boundary_hold after the first answer token", true, Preempt, true, true),
        ("free-memory after the first answer token", false, FreeMemory, true, false),
    ];
    for (name, boundary_hold, admission, late, evicted) in cases {
        let params = SchedulerParams { boundary_hold, admission, ..SchedulerParams::default() };
        let mut e = engine_with(3, 64, params);
        let mut ev = Vec::new();
        e.submit(Timestamp(0), spec(1, 0, 20, 2, 5)).unwrap();
        let mut t = e.step(Timestamp(0), &mut ev).unwrap();
        t = e.step(t, &mut ev).unwrap();
        e.complete_iteration(t, &mut ev);
        assert!(matches!(ev.last(), Some(EngineEvent::PhaseBoundary { .. })), "{name}");
        if late {
            t = e.plan_iteration(t).unwrap();
            e.complete_iteration(t, &mut ev);
        }
        e.submit(t, spec(2, t.0 / UNIT, 20, 5, 5)).unwrap();
        e.plan_iteration(t);
        e.check_invariants().unwrap();
        let tiers = (e.kv().tier_of(RequestId(1)), e.kv().tier_of(RequestId(2)));
        let want = if evicted { (Some(Tier::Cpu), Some(Tier::Gpu)) } else { (Some(Tier::Gpu), None) };
        assert_eq!(tiers, want, "{name}: (B, W)");
        assert_eq!(e.stats().preemptions, evicted as u64, "{name}");
    }
}

/// B is blocked after `</think>` at 2: W, a reasoning request, evicts it (literal admission) and
/// keeps the GPU until its own `</think>` at 8, when B (ahead in the low queue) evicts W in turn
/// and produces its first answer token at 9. B has no pacer before then, so literal t_i never sees
/// it; with `ttfat_starvation_s` t_i fails once B has waited longer than that, and at 9 only if W
/// has now waited (1 s) longer than that. A request that waited during its move fails t_i on the
/// target at attach, and while it waits there.
#[test]
fn ttfat_starvation_fails_t_i_while_an_answer_waits_after_think() {
    // (threshold s, t_i after the iterations ending at 3, 4, 5, t_i at 9)
    let cases = [
        (None, [true, true, true], true),
        (Some(1.5), [true, false, false], true),
        (Some(0.5), [false, false, false], false),
    ];
    for (threshold, want, want_at_9) in cases {
        let params = SchedulerParams { ttfat_starvation_s: threshold, ..SchedulerParams::default() };
        let mut e = engine_with(3, 64, params);
        let mut ev = Vec::new();
        e.submit(Timestamp(0), spec(1, 0, 20, 2, 5)).unwrap();
        let mut t = e.step(Timestamp(0), &mut ev).unwrap();
        t = e.step(t, &mut ev).unwrap();
        e.complete_iteration(t, &mut ev);
        e.submit(t, spec(2, 2, 20, 6, 1)).unwrap();
        t = e.plan_iteration(t).unwrap();
        assert_eq!(e.kv().tier_of(RequestId(1)), Some(Tier::Cpu), "B blocked");
        let mut got = Vec::new();
        for _ in 0..3 {
            t = e.step(t, &mut ev).unwrap();
            got.push(e.load_report().answering_slo_ok);
        }
        assert_eq!(got, want, "threshold {threshold:?}");
        while t < Timestamp(9 * UNIT) {
            t = e.step(t, &mut ev).unwrap();
        }
        e.complete_iteration(t, &mut ev);
        let b = e.req(e.index[&RequestId(1)]);
        assert_eq!(b.record.first_answer_token, Some(Timestamp(9 * UNIT)), "threshold {threshold:?}");
        assert_eq!(e.load_report().answering_slo_ok, want_at_9, "threshold {threshold:?} at 9");
    }
    // Migrated: `</think>` at 2 on the source, attached at `attach_at` to a target whose GPU a
    // reasoning request fills (B waits in its CPU pool).
    // (attach at s, threshold s, t_i at attach, t_i after the target's next two iterations)
    for (attach_at, threshold, want_at_attach, want_after) in
        [(2.5, 1.5, true, false), (5.0, 1.5, false, false), (2.5, 9.0, true, true)]
    {
        let params = SchedulerParams { ttfat_starvation_s: Some(threshold), ..SchedulerParams::default() };
        let mut src = engine_with(64, 0, params.clone());
        let mut dst = engine_with(3, 64, params);
        let mut ev = Vec::new();
        src.submit(Timestamp(0), spec(1, 0, 20, 2, 5)).unwrap();
        let t = src.step(Timestamp(0), &mut ev).unwrap();
        let t = src.step(t, &mut ev).unwrap();
        src.complete_iteration(t, &mut ev);
        src.begin_migration_out(RequestId(1)).unwrap();
        let m = src.finish_migration_out(RequestId(1)).unwrap();
        dst.submit(Timestamp(0), spec(2, 0, 33, 10, 1)).unwrap(); // 3 blocks: the whole GPU
        let attach = Timestamp::from_secs_f64(attach_at);
        let mut t = dst.step(Timestamp(0), &mut ev).unwrap();
        while t < attach {
            t = dst.step(t, &mut ev).unwrap();
        }
        dst.attach(attach, m).unwrap();
        let case = (attach_at, threshold);
        assert_eq!(dst.load_report().answering_slo_ok, want_at_attach, "{case:?} at attach");
        for _ in 0..2 {
            t = dst.step(t, &mut ev).unwrap();
        }
        assert_eq!(dst.kv().tier_of(RequestId(1)), Some(Tier::Cpu), "{case:?}: B waits on the target");
        assert_eq!(dst.load_report().answering_slo_ok, want_after, "{case:?} after");
    }
}

#[test]
fn ttfat_starvation_threshold_is_validated() {
    for bad in [-1.0, f64::NAN, f64::INFINITY, 1e8] {
        let params = SchedulerParams { ttfat_starvation_s: Some(bad), ..SchedulerParams::default() };
        let err = build_scheduler("pascal", &params).unwrap_err();
        assert!(err.to_string().contains("ttfat_starvation_s"), "{bad}: {err}");
    }
    let params: SchedulerParams = toml::from_str(
        "boundary_hold = true\nadmission = \"free-memory\"\nttfat_starvation_s = 0.25\nchunked_prefill_tokens = 2048",
    )
    .unwrap();
    let switches = build_scheduler("fcfs", &params).unwrap().switches();
    assert_eq!(
        switches,
        sched::EngineSwitches {
            boundary_hold: true,
            admission: WaitingAdmission::FreeMemory,
            ttfat_starvation: Some(TimeSpan(250_000_000)),
            chunked_prefill_tokens: Some(2048),
        }
    );
    assert_eq!(toml::from_str::<SchedulerParams>("").unwrap(), SchedulerParams::default());
    assert_eq!(build_scheduler("rr", &SchedulerParams::default()).unwrap().switches(), Default::default());
}

/// `reasoning_demand_blocks` counts reasoning requests without GPU KV (waiting or offloaded) at
/// what their next iteration takes; `waiting_blocks` counts requests without any KV, either queue.
#[test]
fn load_report_publishes_unmet_reasoning_demand() {
    let params = SchedulerParams { quantum_tokens: 2, ..SchedulerParams::default() };
    let mut e = engine_with(3, 64, params);
    let mut ev = Vec::new();
    e.submit(Timestamp(0), spec(1, 0, 20, 10, 1)).unwrap(); // R1: runs, 2 blocks
    e.submit(Timestamp(0), spec(2, 0, 30, 10, 1)).unwrap(); // R2: waits, 2 blocks for 31 tokens
    e.submit(Timestamp(0), spec(3, 0, 16, 0, 5)).unwrap(); // A: answering, waits, 1 block held at 16
    let mut t = e.step(Timestamp(0), &mut ev).unwrap();
    let r = e.load_report();
    assert_eq!((r.reasoning_demand_blocks, r.waiting_blocks), (2, 3), "R2 waiting; R2 + A without KV");
    // R1's quantum ends at 2: R2 (round 0) takes the GPU, R1 (22 tokens) is offloaded.
    t = e.step(t, &mut ev).unwrap();
    e.step(t, &mut ev);
    assert_eq!(e.kv().tier_of(RequestId(1)), Some(Tier::Cpu));
    let r = e.load_report();
    assert_eq!((r.reasoning_demand_blocks, r.waiting_blocks), (2, 1), "R1 offloaded; A without KV");
    assert_eq!(r.gpu_free_blocks_after_demand(), r.gpu_free_blocks().saturating_sub(2));
}

#[test]
fn pascal_demotes_long_reasoning() {
    let mut e = Engine::new(
        InstanceId(0),
        cfg(1024, 0),
        Arc::new(FixedTiming { iteration: TimeSpan(UNIT), transfer: TimeSpan::ZERO }),
        build_scheduler("pascal", &SchedulerParams { demotion_tokens: 10, ..SchedulerParams::default() }).unwrap(),
    );
    let mut ev = Vec::new();
    e.submit(Timestamp(0), spec(1, 0, 90, 50, 5)).unwrap();
    let mut t = Timestamp(0);
    for _ in 0..12 {
        t = e.step(t, &mut ev).unwrap();
    }
    // After 11 reasoning tokens (> 10): demoted, no longer counted in r_i.
    let r = e.load_report();
    assert_eq!((r.reasoning_requests, r.answering_requests), (0, 1));
}

#[test]
fn too_large_and_duplicate_requests_are_refused() {
    let mut e = engine("fcfs", 2, 0, 500);
    assert_eq!(
        e.submit(Timestamp(0), spec(1, 0, 20, 10, 3)),
        Err(EngineError::TooLarge { request: RequestId(1), needed: 3, capacity: 2 })
    );
    e.submit(Timestamp(0), spec(2, 0, 1, 0, 1)).unwrap();
    assert_eq!(e.submit(Timestamp(0), spec(2, 0, 1, 0, 1)), Err(EngineError::Duplicate(RequestId(2))));
    assert_eq!(e.submit(Timestamp(0), spec(3, 0, 1, 1, 0)), Err(EngineError::NoAnswer { request: RequestId(3) }));
}

#[test]
fn migration_moves_state_and_abort_keeps_request() {
    let mut src = engine("pascal", 64, 64, 500);
    let mut dst = Engine::new(
        InstanceId(1),
        cfg(64, 64),
        Arc::new(FixedTiming { iteration: TimeSpan(UNIT), transfer: TimeSpan::ZERO }),
        build_scheduler("pascal", &SchedulerParams::default()).unwrap(),
    );
    let mut ev = Vec::new();
    src.submit(Timestamp(0), spec(1, 0, 30, 2, 3)).unwrap();
    src.step(Timestamp(0), &mut ev);
    src.complete_iteration(Timestamp(UNIT), &mut ev);
    src.plan_iteration(Timestamp(UNIT));
    src.complete_iteration(Timestamp(2 * UNIT), &mut ev);
    assert!(matches!(ev.last(), Some(EngineEvent::PhaseBoundary { .. })));
    // Abort: the request stays and runs on the source.
    let out = src.begin_migration_out(RequestId(1)).unwrap();
    assert_eq!(out, MigrationOut { kv_tokens: 32, kv_blocks: 2, kv_bytes: 32 * 262_144 });
    assert_eq!(src.plan_iteration(Timestamp(2 * UNIT)), None, "a migrating request is frozen");
    src.abort_migration_out(RequestId(1)).unwrap();
    src.check_invariants().unwrap();
    // Migrate for real.
    src.begin_migration_out(RequestId(1)).unwrap();
    let m = src.finish_migration_out(RequestId(1)).unwrap();
    assert!(src.is_empty() && src.kv().used(Tier::Gpu) == 0);
    dst.attach(Timestamp(3 * UNIT), m).unwrap();
    assert_eq!(dst.kv().tier_of(RequestId(1)), Some(Tier::Gpu));
    let mut t = dst.step(Timestamp(3 * UNIT), &mut ev).unwrap();
    ev.clear();
    while let Some(next) = dst.step(t, &mut ev) {
        t = next;
    }
    let Some(EngineEvent::Finished(r)) = ev.pop() else { panic!("finished on target") };
    assert_eq!((r.migrations, r.finished_on, r.placed_on), (1, Some(InstanceId(1)), InstanceId(0)));
    assert_eq!(r.first_scheduled_after_reasoning, Some(Timestamp(3 * UNIT)), "blocking latency spans the migration");
    assert_eq!(r.first_answer_token, Some(Timestamp(4 * UNIT)));
    assert_eq!(r.finish, Some(Timestamp(6 * UNIT)));
}

/// A prefill instance holds each request after its first token, KV in place and out of the
/// schedule (it would decode on forever otherwise), until a handoff takes it out; a failed handoff
/// holds it again; a release, or the instance turning to decode, lets it decode here.
#[test]
fn a_prefill_instance_holds_each_request_after_its_first_token() {
    let mut src = engine("fcfs", 64, 0, 500);
    src.set_hand_off(true);
    let mut ev = Vec::new();
    for id in 1..=3 {
        src.submit(Timestamp(0), spec(id, 0, 30, 2, 3)).unwrap();
    }
    src.step(Timestamp(0), &mut ev);
    assert_eq!(src.step(Timestamp(UNIT), &mut ev), None, "all three held after one prefill iteration: idle");
    let held: Vec<(u64, u32)> = ev
        .iter()
        .map(|e| match e {
            EngineEvent::PrefillDone { request, kv_blocks } => (request.0, *kv_blocks),
            other => panic!("only prefill-done events: {other:?}"),
        })
        .collect();
    assert_eq!(held, vec![(1, 2), (2, 2), (3, 2)], "31 tokens of KV each: 2 blocks");
    src.check_invariants().unwrap();
    assert_eq!(src.kv().used(Tier::Gpu), 6, "their KV stays");
    // Request 1 handed off; 2's handoff fails (held again); 3 is released and decodes here.
    src.begin_migration_out(RequestId(1)).unwrap();
    let m = src.finish_migration_out(RequestId(1)).unwrap();
    assert_eq!((m.generated, m.kv_tokens()), (1, 31));
    src.begin_migration_out(RequestId(2)).unwrap();
    src.abort_migration_out(RequestId(2)).unwrap();
    src.check_invariants().unwrap();
    assert_eq!(src.release_held(RequestId(1)), Err(EngineError::Unknown(RequestId(1))));
    src.release_held(RequestId(3)).unwrap();
    assert_eq!(src.release_held(RequestId(3)), Err(EngineError::NotHeld(RequestId(3))));
    ev.clear();
    let mut t = src.step(Timestamp(2 * UNIT), &mut ev).expect("3 decodes");
    while let Some(next) = src.step(t, &mut ev) {
        t = next;
    }
    let finished: Vec<u64> =
        ev.iter().filter_map(|e| if let EngineEvent::Finished(r) = e { Some(r.id.0) } else { None }).collect();
    assert_eq!(finished, vec![3], "2 still held");
    src.check_invariants().unwrap();
    // A decoding instance again: what it held runs here.
    src.set_hand_off(false);
    ev.clear();
    let mut t = src.step(t, &mut ev).expect("2 decodes");
    while let Some(next) = src.step(t, &mut ev) {
        t = next;
    }
    assert!(matches!(ev.last(), Some(EngineEvent::Finished(r)) if r.id == RequestId(2)), "{ev:?}");
    assert!(src.is_empty());
}

/// A held request's handoff may begin while the instance runs an iteration (it is in no batch, its
/// KV is final); a request in the batch may not.
#[test]
fn a_held_request_leaves_mid_iteration_a_running_one_does_not() {
    let mut src = engine("fcfs", 64, 0, 500);
    src.set_hand_off(true);
    let mut ev = Vec::new();
    src.submit(Timestamp(0), spec(1, 0, 30, 2, 3)).unwrap();
    src.step(Timestamp(0), &mut ev);
    src.step(Timestamp(UNIT), &mut ev);
    assert!(src.is_held(RequestId(1)));
    // Request 2's prefill runs now.
    src.submit(Timestamp(UNIT), spec(2, 0, 30, 2, 3)).unwrap();
    assert!(src.step(Timestamp(UNIT), &mut ev).is_some(), "an iteration in flight");
    assert_eq!(src.begin_migration_out(RequestId(2)), Err(EngineError::IterationInFlight));
    let out = src.begin_migration_out(RequestId(1)).expect("the held one leaves");
    assert_eq!(out.kv_tokens, 31);
    src.finish_migration_out(RequestId(1)).unwrap();
    src.check_invariants().unwrap();
}

/// q3, the wait in the decode queue after a handoff: from the attach (mid-iteration here, on a
/// decode instance that runs one sequence at a time) to the start of the first iteration that
/// runs the request, not the attach itself nor the next iteration's start. A request that never
/// moved has neither time.
#[test]
fn a_handed_off_request_records_the_first_iteration_that_runs_it_after_the_attach() {
    let mut src = engine("fcfs", 64, 0, 500);
    src.set_hand_off(true);
    let mut dst = Engine::new(
        InstanceId(1),
        EngineConfig { max_num_seqs: 1, ..cfg(64, 0) },
        Arc::new(FixedTiming { iteration: TimeSpan(UNIT), transfer: TimeSpan::ZERO }),
        build_scheduler("fcfs", &SchedulerParams::default()).unwrap(),
    );
    let mut ev = Vec::new();
    // The decode instance runs request 1 (arrived first) over 0..4: prefill, then three decodes.
    dst.submit(Timestamp(0), spec(1, 0, 10, 0, 4)).unwrap();
    dst.step(Timestamp(0), &mut ev);
    // Request 2 is prefilled on the prefill instance over 1..2 and handed off.
    src.submit(Timestamp(UNIT), spec(2, 1, 30, 0, 3)).unwrap();
    src.step(Timestamp(UNIT), &mut ev);
    dst.step(Timestamp(UNIT), &mut ev);
    src.step(Timestamp(2 * UNIT), &mut ev);
    dst.step(Timestamp(2 * UNIT), &mut ev);
    assert!(src.is_held(RequestId(2)));
    src.begin_migration_out(RequestId(2)).unwrap();
    let m = src.finish_migration_out(RequestId(2)).unwrap();
    assert_eq!(m.record.migrated_in, None);
    // Attached while the decode instance's iteration 2..3 runs; the one slot is 1's until it
    // finishes at 4.
    let attach = Timestamp(2 * UNIT + UNIT / 2);
    dst.attach(attach, m).unwrap();
    ev.clear();
    let mut t = dst.step(Timestamp(3 * UNIT), &mut ev).expect("1 decodes on");
    while let Some(next) = dst.step(t, &mut ev) {
        t = next;
    }
    let records: Vec<&RequestRecord> =
        ev.iter().filter_map(|e| if let EngineEvent::Finished(r) = e { Some(&**r) } else { None }).collect();
    let [one, two] = records[..] else { panic!("both finish: {ev:?}") };
    assert_eq!((one.id, two.id), (RequestId(1), RequestId(2)));
    assert_eq!((one.migrated_in, one.first_scheduled_after_migration), (None, None), "1 never moved");
    assert_eq!(two.migrated_in, Some(attach));
    assert_eq!(
        two.first_scheduled_after_migration,
        Some(Timestamp(4 * UNIT)),
        "the first iteration that ran 2 after its attach at 2.5 (not the one at 3, which ran only 1)"
    );
    assert_eq!(two.finish, Some(Timestamp(6 * UNIT)), "its two decodes over 4..6");
}

/// A cancelled request is gone at once, mid-iteration too: its KV freed, no token and no record
/// from it, the others unaffected; a request frozen for a migration is the migration's.
#[test]
fn a_cancelled_request_frees_its_kv_and_never_finishes() {
    let mut e = engine("fcfs", 64, 64, 500);
    let mut ev = Vec::new();
    e.submit(Timestamp(0), spec(1, 0, 40, 2, 3)).unwrap();
    e.submit(Timestamp(0), spec(2, 0, 20, 2, 3)).unwrap();
    e.step(Timestamp(0), &mut ev);
    let both = e.kv().used(Tier::Gpu);
    // An iteration is in flight: cancel anyway.
    e.cancel(RequestId(1)).unwrap();
    assert!(e.kv().used(Tier::Gpu) < both && e.kv().table(RequestId(1)).is_none(), "its blocks are free");
    assert!(!e.contains(RequestId(1)));
    e.check_invariants().unwrap();
    assert_eq!(e.cancel(RequestId(1)), Err(EngineError::Unknown(RequestId(1))));
    let mut t = Timestamp(UNIT);
    let mut finished = Vec::new();
    while !e.is_empty() {
        e.complete_iteration(t, &mut ev);
        e.plan_iteration(t);
        e.check_invariants().unwrap();
        t += TimeSpan(UNIT);
    }
    for x in ev.drain(..) {
        if let EngineEvent::Finished(r) = x {
            finished.push(r.id);
        }
    }
    assert_eq!(finished, vec![RequestId(2)], "only the other one finishes");
    assert_eq!(e.kv().used(Tier::Gpu), 0);
    e.submit(t, spec(3, 0, 20, 2, 3)).unwrap();
    e.step(t, &mut ev);
    e.complete_iteration(t + TimeSpan(UNIT), &mut ev);
    e.begin_migration_out(RequestId(3)).unwrap();
    assert_eq!(e.cancel(RequestId(3)), Err(EngineError::Migrating(RequestId(3))));
}

/// A target without GPU room receives into its CPU pool; the request attaches offloaded and is
/// reloaded when it runs, as a re-materialising attach would place it.
#[test]
fn a_reservation_without_gpu_room_lands_in_the_cpu_pool() {
    let mut src = engine("fcfs", 64, 0, 500);
    let mut dst = engine("fcfs", 8, 16, 500);
    let mut ev = Vec::new();
    src.submit(Timestamp(0), spec(1, 0, 80, 2, 3)).unwrap();
    src.step(Timestamp(0), &mut ev);
    dst.reserve_incoming(RequestId(2), 7 * 16).unwrap(); // another incoming request fills the GPU
    dst.reserve_incoming(RequestId(1), 80).unwrap();
    assert_eq!((dst.kv().tier_of(RequestId(1)), dst.kv().used(Tier::Cpu)), (Some(Tier::Cpu), 5));
    src.complete_iteration(Timestamp(UNIT), &mut ev);
    src.begin_migration_out(RequestId(1)).unwrap();
    let m = src.finish_migration_out(RequestId(1)).unwrap();
    dst.attach(Timestamp(UNIT), m).unwrap();
    dst.check_invariants().unwrap();
    dst.release_reservation(RequestId(2));
    let mut t = dst.step(Timestamp(UNIT), &mut ev).unwrap();
    while let Some(next) = dst.step(t, &mut ev) {
        t = next;
    }
    assert!(ev.iter().any(
        |x| matches!(x, EngineEvent::Finished(r) if r.id == RequestId(1) && r.finished_on == Some(InstanceId(0)))
    ));
}

/// Blocks reserved for an incoming migration are not the planner's to hand out: a request that
/// needs them waits (it was planned over them before: a panic in the worker) and carries on once
/// the reservation is released.
#[test]
fn reserved_blocks_are_never_planned_over() {
    let mut e = engine("fcfs", 8, 16, 500);
    let mut ev = Vec::new();
    e.submit(Timestamp(0), spec(1, 0, 40, 60, 4)).unwrap(); // 3 blocks now, 7 at the end
    let mut t = e.step(Timestamp(0), &mut ev).unwrap();
    e.reserve_incoming(RequestId(9), 64).unwrap(); // 4 blocks promised: 1 left for request 1
    for _ in 0..200 {
        let Some(next) = e.step(t, &mut ev) else { break };
        e.check_invariants().unwrap();
        assert!(e.kv().used(Tier::Gpu) <= 8);
        t = next;
    }
    assert!(!ev.iter().any(|x| matches!(x, EngineEvent::Finished(_))), "it cannot finish beside the reservation");
    assert_eq!(e.release_reservation(RequestId(9)), 4);
    let mut t = e.step(t, &mut ev).unwrap();
    while let Some(next) = e.step(t, &mut ev) {
        t = next;
    }
    assert!(ev.iter().any(|x| matches!(x, EngineEvent::Finished(r) if r.id == RequestId(1))));
    e.check_invariants().unwrap();
}

/// Headroom for the tokens a request decodes during its copy: taken where the tier has room, never
/// at the price of the tier (a GPU fit without headroom beats CPU with it), given back at attach.
#[test]
fn a_reservation_takes_headroom_where_there_is_room_and_attach_gives_it_back() {
    // Request 1 with 41 tokens of KV, paused for the move.
    let migrated = || {
        let mut src = engine("fcfs", 64, 0, 500);
        let mut ev = Vec::new();
        src.submit(Timestamp(0), spec(1, 0, 40, 2, 3)).unwrap();
        src.step(Timestamp(0), &mut ev);
        src.complete_iteration(Timestamp(UNIT), &mut ev);
        src.begin_migration_out(RequestId(1)).unwrap();
        src.finish_migration_out(RequestId(1)).unwrap()
    };
    // (GPU blocks, CPU blocks, blocks held elsewhere) → (tier, blocks reserved for 40 + 32 tokens)
    let cases = [(8, 0, 0, Tier::Gpu, 5), (8, 16, 4, Tier::Gpu, 3), (8, 16, 6, Tier::Cpu, 5), (8, 4, 6, Tier::Cpu, 3)];
    for (gpu, cpu, held, tier, blocks) in cases {
        let mut dst = engine("fcfs", gpu, cpu, 500);
        if held > 0 {
            dst.reserve_incoming(RequestId(9), held * 16).unwrap();
        }
        let got = dst.reserve_incoming_with_headroom(RequestId(1), 40, 32).unwrap().len() as u32;
        let case = (gpu, cpu, held);
        assert_eq!((dst.kv().tier_of(RequestId(1)), got), (Some(tier), blocks), "{case:?}");
        dst.check_invariants().unwrap();
        if tier == Tier::Gpu {
            dst.attach(Timestamp(UNIT), migrated()).unwrap();
            assert_eq!(dst.kv().table(RequestId(1)).unwrap().blocks.len(), 3, "{case:?}: 41 tokens");
            assert_eq!(dst.kv().free(Tier::Gpu), gpu - held - 3, "{case:?}: the headroom is free again");
        }
    }
    // No room at all: refused, naming the room.
    let mut full = engine("fcfs", 8, 0, 500);
    full.reserve_incoming(RequestId(9), 7 * 16).unwrap();
    let e = full.reserve_incoming_with_headroom(RequestId(1), 40, 32).unwrap_err();
    assert!(matches!(e, EngineError::NoRoom { needed: 3, free: 1, .. }), "{e}");
    full.check_invariants().unwrap();
}

#[test]
fn live_migration_target_reserves_grows_attaches_in_place_or_releases() {
    let mut src = engine("fcfs", 64, 0, 500);
    let mut dst = engine("fcfs", 8, 0, 500);
    let mut ev = Vec::new();
    src.submit(Timestamp(0), spec(1, 0, 40, 2, 3)).unwrap();
    src.step(Timestamp(0), &mut ev);
    // PREPARE: 40 tokens → 3 GPU blocks reserved on the target, counted as used there.
    let blocks = dst.reserve_incoming(RequestId(1), 40).unwrap().to_vec();
    assert_eq!(blocks.len(), 3);
    assert_eq!(dst.load_report().gpu_used_blocks, 3);
    // ... and its KV counted as decode load there: it decodes there once attached.
    assert_eq!(dst.load_report().decode_context_tokens, 40);
    dst.check_invariants().unwrap();
    // More tokens arrived while copying: the reservation grows, keeping its first blocks.
    let grown = dst.reserve_incoming(RequestId(1), 49).unwrap().to_vec();
    assert_eq!(&grown[..3], &blocks[..]);
    assert_eq!(grown.len(), 4);
    assert_eq!(dst.load_report().decode_context_tokens, 49);
    // Too much for the target: refused, naming the room; the reservation is unchanged.
    let e = dst.reserve_incoming(RequestId(1), 9 * 16).unwrap_err();
    assert!(matches!(e, EngineError::TooLarge { .. } | EngineError::NoRoom { .. }), "{e}");
    assert_eq!(dst.kv().table(RequestId(1)).unwrap().blocks, grown);
    // Commit: the request attaches onto exactly the reserved blocks (fitted to its 41 tokens).
    src.complete_iteration(Timestamp(UNIT), &mut ev);
    src.begin_migration_out(RequestId(1)).unwrap();
    let m = src.finish_migration_out(RequestId(1)).unwrap();
    assert_eq!(m.kv_tokens(), 41);
    dst.attach(Timestamp(UNIT), m).unwrap();
    let table = dst.kv().table(RequestId(1)).unwrap();
    assert_eq!((table.tier, table.tokens, &table.blocks[..]), (Tier::Gpu, 41, &grown[..3]));
    assert!(dst.reserved_requests().next().is_none());
    assert_eq!(dst.load_report().decode_context_tokens, 41, "counted once, as the request it became");
    dst.check_invariants().unwrap();
    // A second reservation for a request already here is a duplicate.
    assert!(matches!(dst.reserve_incoming(RequestId(1), 16), Err(EngineError::Duplicate(_))));
    // Abort path: an unrelated reservation is released and its blocks are free again.
    let before = dst.kv().free(Tier::Gpu);
    dst.reserve_incoming(RequestId(2), 32).unwrap();
    assert_eq!(dst.kv().free(Tier::Gpu), before - 2);
    assert_eq!(dst.load_report().decode_context_tokens, 41 + 32);
    assert_eq!(dst.release_reservation(RequestId(2)), 2);
    assert_eq!(dst.load_report().decode_context_tokens, 41);
    assert_eq!(dst.kv().free(Tier::Gpu), before);
    assert_eq!(dst.release_reservation(RequestId(2)), 0, "releasing twice is harmless");
    dst.check_invariants().unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// Random arrivals on a tight instance: every request finishes exactly once, timestamps are
    /// monotone, and KV accounting holds after every step, for every scheduler and every setting
    /// of the admission switches (a held or protected request never deadlocks the instance).
    #[test]
    fn every_request_finishes_once_with_monotone_timestamps(
        sched in prop_oneof![Just("fcfs"), Just("rr"), Just("pascal")],
        cpu in 0u32..8,
        reqs in proptest::collection::vec((0u64..20, 1u32..40, 0u32..40, 1u32..30), 1..20),
        (boundary_hold, free_memory) in (any::<bool>(), any::<bool>()),
        chunked_prefill_tokens in proptest::option::of(1u32..24),
    ) {
        let admission = if free_memory { WaitingAdmission::FreeMemory } else { WaitingAdmission::Preempt };
        let params = SchedulerParams {
            quantum_tokens: 5,
            boundary_hold,
            admission,
            chunked_prefill_tokens,
            ..SchedulerParams::default()
        };
        let timing = Arc::new(FixedTiming { iteration: TimeSpan(UNIT), transfer: TimeSpan::ZERO });
        let mut e = Engine::new(InstanceId(0), cfg(8, cpu), timing, build_scheduler(sched, &params).unwrap());
        let specs: Vec<RequestSpec> = reqs.iter().enumerate()
            .map(|(i, &(at, p, r, a))| spec(i as u64, at, p, r, a))
            .filter(|s| s.max_context_tokens() <= 8 * 16)
            .collect();
        let n = specs.len();
        let done = run(&mut e, specs);
        prop_assert_eq!(done.len(), n);
        for r in &done {
            let first = r.first_token.unwrap();
            prop_assert!(r.arrival <= r.first_scheduled.unwrap() && r.first_scheduled.unwrap() < first);
            if let Some(re) = r.reasoning_end {
                prop_assert!(first <= re && re < r.first_answer_token.unwrap());
                prop_assert!(r.first_scheduled_after_reasoning.unwrap() >= re);
            }
            prop_assert!(r.first_answer_token.unwrap() <= r.finish.unwrap());
            let q = r.qoe.unwrap();
            prop_assert!((0.0..=1.0).contains(&q));
        }
        prop_assert_eq!(e.kv().used(Tier::Gpu) + e.kv().used(Tier::Cpu), 0);
    }
}

/// Blocks lent out (a worker's transport sending them) stay taken when their holder is preempted:
/// a resident whose next block the plan counted on them sits the iteration out instead of failing,
/// and runs on once the loans end; every request still finishes, its tokens in order.
#[test]
fn a_preempted_request_s_lent_blocks_stay_taken_and_the_plan_copes() {
    // 4 GPU blocks of 16 tokens, no CPU pool (a preempted request recomputes). 1 and 2 hold two
    // blocks each; 1 needs a third at its 33rd token, so 2 (lower priority under FCFS) is preempted.
    let mut e = engine("fcfs", 4, 0, 500);
    let mut ev = Vec::new();
    e.submit(Timestamp(0), spec(1, 0, 31, 0, 10)).unwrap();
    e.submit(Timestamp(0), spec(2, 0, 31, 0, 10)).unwrap();
    let mut now = e.step(Timestamp(0), &mut ev).unwrap();
    let lent: Vec<u32> = e.kv().table(RequestId(2)).unwrap().blocks.clone();
    for &b in &lent {
        e.lend_kv_block(Tier::Gpu, b);
    }
    let mut stalled = 0;
    let mut finished = Vec::new();
    for _ in 0..200 {
        if stalled == 3 && e.kv().loans() > 0 {
            for &b in &lent {
                assert!(e.end_kv_loan(Tier::Gpu, b));
            }
        }
        e.complete_iteration(now, &mut ev);
        let next = e.plan_iteration(now);
        e.check_invariants().unwrap();
        // While lent, request 2's blocks are nobody's to take, even preempted.
        if e.kv().loans() > 0 && e.kv().table(RequestId(2)).is_none() {
            assert_eq!(e.kv().free(Tier::Gpu), 0, "lent blocks are not free");
            stalled += 1;
        }
        finished.extend(ev.drain(..).filter_map(|x| match x {
            EngineEvent::Finished(r) => Some(r.id),
            _ => None,
        }));
        now = next.unwrap_or(Timestamp(now.0 + UNIT));
    }
    assert!(stalled >= 3, "the setup must preempt request 2 while its blocks are lent");
    finished.sort();
    assert_eq!(finished, vec![RequestId(1), RequestId(2)]);
    assert_eq!(e.kv().used(Tier::Gpu), 0);
}

#[test]
fn kv_frozen_by_outgoing_migration_is_not_planned_over() {
    // 4 GPU blocks; A holds 2 and starts migrating out; B needs 3 blocks to start.
    let mut e = engine("pascal", 4, 64, 500);
    let mut ev = Vec::new();
    e.submit(Timestamp(0), spec(1, 0, 20, 1, 5)).unwrap();
    let t = e.step(Timestamp(0), &mut ev).unwrap();
    e.complete_iteration(t, &mut ev);
    e.begin_migration_out(RequestId(1)).unwrap();
    e.submit(t, spec(2, 1, 40, 0, 5)).unwrap();
    assert_eq!(e.plan_iteration(t), None, "B cannot start while A's blocks are frozen");
    e.check_invariants().unwrap();
    e.finish_migration_out(RequestId(1)).unwrap();
    assert!(e.needs_step());
    assert!(e.plan_iteration(t).is_some(), "B starts once the migration releases A's blocks");
    assert_eq!(e.kv().tier_of(RequestId(2)), Some(Tier::Gpu));
}

/// A migration target caching the first blocks of an arriving request's prompt pins them instead
/// of reserving them (the source then skips them): shared with their cached holder, not counted as
/// a prefix-cache query, back in the cache when the reservation is dropped. Without prefix caching
/// or for the CPU tier nothing is pinned.
#[test]
fn an_arriving_request_pins_the_prefix_blocks_cached_here() {
    let with_ids = |id, prompt| RequestSpec { content_ids: vec![7], ..spec(id, 0, prompt, 1, 1) };
    let prefix = crate::kv::prompt_block_hashes(&[7], 80, 16); // 5 full blocks
    for caching in [true, false] {
        let timing = Arc::new(FixedTiming { iteration: TimeSpan(UNIT), transfer: TimeSpan::ZERO });
        let c = EngineConfig { prefix_caching: caching, ..cfg(16, 4) };
        let mut e = Engine::new(InstanceId(0), c, timing, build_scheduler("fcfs", &Default::default()).unwrap());
        // A 64-token prompt over the same content ran here: its 4 blocks stay cached.
        run(&mut e, vec![with_ids(1, 64)]);
        let stats = e.kv().prefix_stats();
        let pinned = e.reserve_incoming_prefixed(RequestId(2), 80, 0, &prefix).unwrap();
        assert_eq!(pinned, if caching { 4 } else { 0 }, "caching {caching}");
        assert_eq!(e.kv().prefix_stats(), stats, "an arrival is no prefix-cache query");
        assert_eq!(e.kv().table(RequestId(2)).unwrap().blocks.len(), 5);
        assert_eq!(e.kv().used(Tier::Gpu), 5, "pinned blocks are held, the rest reserved");
        e.check_invariants().unwrap();
        // The fifth block, reserved, is now cached too: a third arrival pins all five.
        let again = e.reserve_incoming_prefixed(RequestId(3), 96, 0, &prefix).unwrap();
        assert_eq!(again, if caching { 5 } else { 0 });
        e.release_reservation(RequestId(2));
        e.release_reservation(RequestId(3));
        e.check_invariants().unwrap();
        assert_eq!(e.kv().used(Tier::Gpu), 0);
        assert_eq!(e.kv().cached_blocks(Tier::Gpu), if caching { 5 } else { 0 });
    }
    // No GPU room beside the four cached blocks: the reservation goes to the CPU tier, pinning
    // nothing (and taking nothing from the cache).
    let timing = Arc::new(FixedTiming { iteration: TimeSpan(UNIT), transfer: TimeSpan::ZERO });
    let c = EngineConfig { prefix_caching: true, ..cfg(6, 16) };
    let mut e = Engine::new(InstanceId(0), c, timing, build_scheduler("fcfs", &Default::default()).unwrap());
    run(&mut e, vec![with_ids(1, 64)]);
    e.reserve_incoming(RequestId(5), 32).unwrap();
    assert_eq!(e.reserve_incoming_prefixed(RequestId(4), 80, 0, &prefix).unwrap(), 0);
    assert_eq!(e.kv().tier_of(RequestId(4)), Some(Tier::Cpu));
    assert_eq!(e.kv().cached_blocks(Tier::Gpu), 4);
    e.check_invariants().unwrap();
}

/// Fixed one-unit iterations that record every batch shape they are asked to time.
#[derive(Debug, Default)]
struct ShapeLog(std::sync::Mutex<Vec<BatchShape>>);

impl TimingModel for ShapeLog {
    fn name(&self) -> &str {
        "shape-log"
    }
    fn iteration(&self, batch: &BatchShape) -> TimeSpan {
        self.0.lock().unwrap().push(*batch);
        TimeSpan(UNIT)
    }
    fn offload(&self, _bytes: u64) -> TimeSpan {
        TimeSpan::ZERO
    }
    fn reload(&self, _bytes: u64) -> TimeSpan {
        TimeSpan::ZERO
    }
}

fn chunked_engine(chunk: Option<u32>) -> (Engine, Arc<ShapeLog>) {
    let log = Arc::new(ShapeLog::default());
    let params = SchedulerParams { chunked_prefill_tokens: chunk, ..SchedulerParams::default() };
    let engine = Engine::new(InstanceId(0), cfg(2000, 0), log.clone(), build_scheduler("fcfs", &params).unwrap());
    (engine, log)
}

/// Three requests decoding, then a 5,000-token prompt: with chunks of 2,048 every iteration runs
/// the three decodes first and 2,045 prompt tokens (2,045, 2,045, 910), the prompt's first token
/// comes after the third chunk, and its chunks' attention adds up to one whole prefill's.
/// Without chunks the prompt is one iteration's, and the decoders wait through it.
#[test]
fn chunked_prefill_runs_decodes_first_and_a_long_prompt_over_several_iterations() {
    for chunk in [Some(2048), None] {
        let (mut e, log) = chunked_engine(chunk);
        let mut events = Vec::new();
        for id in 0..3 {
            e.submit(Timestamp::ZERO, spec(id, 0, 100, 0, 50)).unwrap();
        }
        // The short prompts' prefill (one iteration, either way).
        e.plan_iteration(Timestamp::ZERO);
        e.complete_iteration(Timestamp(UNIT), &mut events);
        let long = spec(9, 1, 5000, 0, 10);
        e.submit(Timestamp(UNIT), long).unwrap();
        let mut first_token = None;
        let mut queued = Vec::new();
        for tick in 1..12u64 {
            let now = Timestamp(tick * UNIT);
            e.complete_iteration(now, &mut events);
            queued.push(e.load_report().prefill_queue.tokens);
            if first_token.is_none() && e.load_report().prefill_queue.tokens == 0 {
                first_token = Some(tick);
            }
            e.plan_iteration(now);
            e.check_invariants().unwrap();
        }
        let shapes = log.0.lock().unwrap().clone();
        let prefills: Vec<(u64, u64)> = shapes[1..]
            .iter()
            .filter(|s| s.prefill_tokens > 0)
            .map(|s| (s.prefill_tokens, s.prefill_tokens_sq))
            .collect();
        match chunk {
            Some(_) => {
                assert_eq!(prefills.iter().map(|p| p.0).collect::<Vec<_>>(), vec![2045, 2045, 910]);
                assert_eq!(prefills.iter().map(|p| p.1).sum::<u64>(), 5000 * 5000);
                // Every chunk iteration decodes the three others too.
                assert!(shapes[1..4].iter().all(|s| s.decode_seqs == 3), "{shapes:?}");
                // What is left to prefill shrinks chunk by chunk.
                assert_eq!(&queued[..4], &[5000, 2955, 910, 0]);
                assert_eq!(first_token, Some(4));
            }
            None => {
                assert_eq!(prefills, vec![(5000, 5000 * 5000)]);
                assert_eq!(&queued[..2], &[5000, 0]);
                assert_eq!(first_token, Some(2));
            }
        }
    }
}

/// A prompt between chunks has no whole KV to send: a migration out is refused until its
/// prefill ends, and goes once it has.
#[test]
fn a_request_between_prefill_chunks_cannot_migrate_out() {
    let (mut e, _) = chunked_engine(Some(1024));
    let mut events = Vec::new();
    e.submit(Timestamp::ZERO, spec(1, 0, 3000, 0, 5)).unwrap();
    e.plan_iteration(Timestamp::ZERO);
    e.complete_iteration(Timestamp(UNIT), &mut events);
    assert_eq!(e.begin_migration_out(RequestId(1)), Err(EngineError::Prefilling(RequestId(1))));
    for tick in 1..3 {
        e.plan_iteration(Timestamp(tick * UNIT));
        e.complete_iteration(Timestamp((tick + 1) * UNIT), &mut events);
    }
    assert!(e.begin_migration_out(RequestId(1)).is_ok(), "after its third chunk it decodes");
}

#[test]
fn a_zero_chunk_is_refused() {
    let params = SchedulerParams { chunked_prefill_tokens: Some(0), ..SchedulerParams::default() };
    assert!(params.switches().unwrap_err().to_string().contains("chunked_prefill_tokens"));
}

/// A driver behind its schedule plans each iteration at the modelled end of the last, which can
/// lie before a request that arrived since: that request waits for an iteration starting at or
/// after its arrival, so no token of it predates it. With nothing else to run, the iteration
/// starts at its arrival.
#[test]
fn an_iteration_never_runs_a_request_before_its_arrival() {
    let mut e = engine("fcfs", 64, 0, 500);
    let mut events = Vec::new();
    e.submit(Timestamp::ZERO, spec(1, 0, 16, 0, 20)).unwrap();
    e.plan_iteration(Timestamp::ZERO);
    // Submitted (as a lagging worker would) while the engine's clock still reads 1 s: it arrived
    // at 3 s.
    e.submit(Timestamp(UNIT), spec(2, 3, 16, 0, 2)).unwrap();
    let mut t = Timestamp(UNIT);
    for _ in 0..30 {
        e.complete_iteration(t, &mut events);
        match e.plan_iteration(t) {
            Some(end) => t = end,
            None => break,
        }
    }
    let records: Vec<RequestRecord> = events
        .into_iter()
        .filter_map(|ev| match ev {
            EngineEvent::Finished(r) => Some(*r),
            _ => None,
        })
        .collect();
    let late = records.iter().find(|r| r.id == RequestId(2)).expect("finished");
    assert_eq!(late.first_scheduled, Some(Timestamp(3 * UNIT)), "{late:?}");
    assert!(late.first_token.unwrap() > late.arrival);

    // Alone: the iteration waits for it.
    let mut e = engine("fcfs", 64, 0, 500);
    e.submit(Timestamp::ZERO, spec(3, 5, 16, 0, 1)).unwrap();
    assert_eq!(e.plan_iteration(Timestamp::ZERO), Some(Timestamp(6 * UNIT)));
}
