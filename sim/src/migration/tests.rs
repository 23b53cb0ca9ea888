//! One live migration between two engines over a fabric, driven as `crate::cluster` drives it:
//! commit, refusal, timeouts, and the downtime and transfer times the protocol yields.

use super::*;
use kvfleet_core::engine::sched::{build_scheduler, SchedulerParams};
use kvfleet_core::engine::{EngineConfig, EngineEvent};
use kvfleet_core::kv::Tier;
use kvfleet_core::metrics::RequestRecord;
use kvfleet_core::timing::FixedTiming;
use kvfleet_core::RequestSpec;
use kvfleet_netmodel::LinkParams;
use std::sync::Arc;

/// R1-Distill-Qwen-32B in bf16: 256 KiB of KV per token, 4 MiB per 16-token block.
const KV_BYTES_PER_TOKEN: u64 = 256 * 1024;
const BLOCK_SIZE: u32 = 16;
const BLOCK_BYTES: u64 = BLOCK_SIZE as u64 * KV_BYTES_PER_TOKEN;
const SOURCE: InstanceId = InstanceId(0);
const TARGET: InstanceId = InstanceId(1);
const REQUEST: RequestId = RequestId(1);

fn ms(d: SimDuration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Two engines (0: source, 1: target) with fixed iteration times, and the fabric between them.
struct Bench {
    engines: Vec<Engine>,
    fabric: Fabric,
    now: SimTime,
    finished: Vec<RequestRecord>,
}

impl Bench {
    /// Room for a 16k-token request on both sides, decode iterations of `iteration_ms`.
    fn new(link_gbps: f64, iteration_ms: f64) -> Bench {
        Bench::with_target(link_gbps, iteration_ms, 4096, 0)
    }

    fn with_target(link_gbps: f64, iteration_ms: f64, target_gpu_blocks: u32, target_cpu_blocks: u32) -> Bench {
        let timing = Arc::new(FixedTiming {
            iteration: SimDuration::from_millis_f64(iteration_ms),
            transfer: SimDuration::ZERO,
        });
        let engine = |i, gpu_blocks, cpu_blocks| {
            let cfg = EngineConfig {
                block_size: BLOCK_SIZE,
                gpu_blocks,
                cpu_blocks,
                max_num_seqs: 256,
                max_batched_tokens: 8192,
                kv_bytes_per_token: KV_BYTES_PER_TOKEN,
                tpot: SimDuration::from_millis_f64(100.0),
            };
            let sched = build_scheduler("fcfs", &SchedulerParams::default()).unwrap();
            Engine::new(InstanceId(i), cfg, timing.clone(), sched)
        };
        let engines = vec![engine(0, 4096, 0), engine(1, target_gpu_blocks, target_cpu_blocks)];
        let link = LinkParams { bandwidth_gbps: link_gbps, latency_us: 10.0 };
        Bench { engines, fabric: Fabric::new(2, link).unwrap(), now: SimTime::ZERO, finished: Vec::new() }
    }

    /// Submit request `id` on instance `on` and run until it holds `kv_tokens` tokens of KV (its
    /// prefill produced the first token), stopping right after that iteration (not planned again).
    fn place(&mut self, on: InstanceId, id: RequestId, kv_tokens: u32, answer_tokens: u32) {
        let spec =
            RequestSpec { id, arrival: self.now, prompt_tokens: kv_tokens - 1, reasoning_tokens: 1, answer_tokens };
        self.engines[on.0 as usize].submit(self.now, spec).unwrap();
        let e = &mut self.engines[on.0 as usize];
        self.now = e.plan_iteration(self.now).expect("the prefill is planned");
        let mut events = Vec::new();
        e.complete_iteration(self.now, &mut events);
        assert_eq!(e.kv().table(id).map(|t| t.tokens), Some(kv_tokens));
    }

    fn complete_due_iterations(&mut self, m: Option<&mut LiveMigration>) {
        let mut events = Vec::new();
        for e in &mut self.engines {
            e.complete_iteration(self.now, &mut events);
        }
        if let Some(m) = m {
            let engines = Engines::pick(&mut self.engines, SOURCE, TARGET).unwrap();
            m.on_source_iteration_end(self.now, engines, &mut self.fabric);
        }
        for ev in events {
            if let EngineEvent::Finished(r) = ev {
                self.finished.push(*r);
            }
        }
    }

    fn plan_and_check(&mut self) {
        for e in &mut self.engines {
            if e.needs_step() {
                e.plan_iteration(self.now);
            }
            e.check_invariants().unwrap();
        }
    }

    /// Migrate `REQUEST` from the source to the target with `params`, started now (between two
    /// iterations of the source), as the cluster's event loop does; returns its record.
    fn migrate(&mut self, params: MigrationParams) -> LiveMigrationRecord {
        let spec = LiveMigrationSpec::new(MigrationId(1), REQUEST, SOURCE, TARGET, params);
        let engines = Engines::pick(&mut self.engines, SOURCE, TARGET).unwrap();
        let mut m = LiveMigration::start(self.now, spec, engines, &mut self.fabric).unwrap();
        self.plan_and_check();
        loop {
            m.take_new_transfers();
            if let Some(record) = m.take_record() {
                return record;
            }
            let wakes = [self.engines[0].next_wake(), self.engines[1].next_wake()];
            let next = wakes.into_iter().chain([self.fabric.next_completion(), m.next_timeout()]).flatten().min();
            self.now = next.expect("a migration in progress waits for something");
            self.complete_due_iterations(Some(&mut m));
            for (id, _) in self.fabric.complete_due(self.now) {
                let engines = Engines::pick(&mut self.engines, SOURCE, TARGET).unwrap();
                m.on_transfer_complete(self.now, id, engines, &mut self.fabric);
            }
            if m.next_timeout().is_some_and(|t| t <= self.now) {
                let engines = Engines::pick(&mut self.engines, SOURCE, TARGET).unwrap();
                m.on_timeout(self.now, engines, &mut self.fabric);
            }
            self.plan_and_check();
        }
    }

    /// Run both engines until every request finished (stale transfers are ignored).
    fn run_to_completion(&mut self) {
        self.plan_and_check();
        while let Some(t) = self.engines.iter().filter_map(Engine::next_wake).min() {
            self.now = t;
            self.complete_due_iterations(None);
            self.plan_and_check();
        }
        assert!(self.engines.iter().all(Engine::is_empty), "every request finished");
    }

    fn finished(&self, id: RequestId) -> &RequestRecord {
        self.finished.iter().find(|r| r.id == id).expect("finished")
    }
}

/// The request, pipelined or blocking, holding `kv_tokens` tokens, over `link_gbps`.
fn migrate(kv_tokens: u32, params: MigrationParams, link_gbps: f64, iteration_ms: f64) -> LiveMigrationRecord {
    let mut b = Bench::new(link_gbps, iteration_ms);
    b.place(SOURCE, REQUEST, kv_tokens, 500);
    b.migrate(params)
}

fn blocking() -> MigrationParams {
    MigrationParams { max_stages: 0, ..MigrationParams::default() }
}

#[test]
fn a_committed_migration_moves_the_request_and_frees_the_source() {
    let mut b = Bench::new(100.0, 30.0);
    b.place(SOURCE, REQUEST, 1000, 200);
    let r = b.migrate(MigrationParams::default());

    assert_eq!((r.outcome_name(), r.in_doubt, r.abort_reason()), ("committed", false, None));
    assert!(r.live_stages >= 1, "{} full blocks go live first", 1000 / BLOCK_SIZE);
    assert_eq!(r.report.stages.len() as u32, r.live_stages + 1);
    assert!(r.report.stages.last().unwrap().final_stage);
    // Every block went exactly once: live stages only full blocks, the final stage the rest.
    let kv_final = r.kv_tokens_final.expect("paused");
    assert!(kv_final >= 1000);
    assert_eq!(r.bytes, u64::from(kv_final.div_ceil(BLOCK_SIZE)) * BLOCK_BYTES);
    assert_eq!(r.report.stages.iter().map(|s| s.bytes).sum::<u64>(), r.bytes);
    let downtime = r.downtime.expect("it paused and resumed");
    assert!(ms(downtime) < 2.0, "the final stage is a block or two: {downtime}");
    assert!(r.paused_at.unwrap() > r.start && r.resumed_at.unwrap() < r.end);
    assert!(!r.to_metrics().aborted);

    let (source, target) = (&b.engines[0], &b.engines[1]);
    assert!(!source.contains(REQUEST) && source.kv().table(REQUEST).is_none(), "the source freed its copy");
    assert_eq!(source.kv().used(Tier::Gpu), 0);
    assert!(target.contains(REQUEST) && target.reserved_requests().is_empty(), "the reservation became the request");
    let held = target.kv().table(REQUEST).unwrap();
    assert!(held.tokens >= kv_final, "it ran on: {} < {kv_final}", held.tokens);

    b.run_to_completion();
    let done = b.finished(REQUEST);
    assert_eq!((done.finished_on, done.migrations), (Some(TARGET), 1));
    assert_eq!(b.engines[1].kv().used(Tier::Gpu), 0);
}

#[test]
fn a_full_target_refuses_and_nothing_leaks() {
    // 80 GPU blocks, no CPU pool; a request of its own holds 70 of them.
    let mut b = Bench::with_target(100.0, 30.0, 80, 0);
    b.place(TARGET, RequestId(2), 70 * BLOCK_SIZE - 1, 10);
    b.place(SOURCE, REQUEST, 1000, 200);
    let target_used = b.engines[1].kv().used(Tier::Gpu);
    let r = b.migrate(MigrationParams::default());

    assert_eq!(r.outcome_name(), "refused");
    assert!(matches!(r.outcome, Outcome::Aborted(AbortReason::Refused(_))), "{:?}", r.outcome);
    assert!(r.to_metrics().aborted);
    assert_eq!((r.bytes, r.live_stages, r.paused_at, r.downtime), (0, 0, None, None));
    let (source, target) = (&b.engines[0], &b.engines[1]);
    assert!(target.reserved_requests().is_empty() && !target.contains(REQUEST));
    assert_eq!(target.kv().used(Tier::Gpu), target_used, "no block of the refused reservation is left");
    assert!(source.contains(REQUEST) && !source.is_migrating_out(REQUEST), "the request never froze");

    b.run_to_completion();
    assert_eq!((b.finished(REQUEST).finished_on, b.finished(REQUEST).migrations), (Some(SOURCE), 0));
}

#[test]
fn a_timeout_aborts_and_the_request_carries_on_at_the_source() {
    // 16k tokens are 4 GiB: 344 ms at 100 Gbit/s, far beyond these deadlines.
    let cases = [
        ("pipelined: times out copying live", MigrationParams::default(), MigrationPhase::LiveCopy, false),
        ("blocking: times out paused", blocking(), MigrationPhase::StopAndCopy, true),
    ];
    for (name, params, phase, paused) in cases {
        let timeout = SimDuration::from_millis_f64(100.0);
        let mut b = Bench::new(100.0, 30.0);
        b.place(SOURCE, REQUEST, 16 * 1024, 200);
        let r = b.migrate(MigrationParams { timeout, ..params });

        assert_eq!(r.outcome, Outcome::Aborted(AbortReason::Timeout { phase }), "{name}");
        assert_eq!((r.outcome_name(), r.in_doubt), ("aborted", false), "{name}");
        assert_eq!(r.total_time, timeout, "{name}: aborted exactly at the deadline");
        assert_eq!(r.paused_at.is_some(), paused, "{name}");
        assert_eq!(r.resumed_at.is_some(), paused, "{name}: resumed at the source");
        let (source, target) = (&b.engines[0], &b.engines[1]);
        assert!(source.contains(REQUEST) && !source.is_migrating_out(REQUEST), "{name}: the request runs here");
        assert!(target.reserved_requests().is_empty() && !target.contains(REQUEST), "{name}");
        assert_eq!(target.kv().used(Tier::Gpu), 0, "{name}: the reservation was released");

        b.run_to_completion();
        assert_eq!(b.finished(REQUEST).finished_on, Some(SOURCE), "{name}");
    }
}

#[test]
fn pipelined_downtime_is_flat_while_a_blocking_copy_grows() {
    let link_gbps = 100.0;
    let mut pipelined = Vec::new();
    let mut blocked = Vec::new();
    for tokens in [256, 1024, 4096, 16 * 1024] {
        let p = migrate(tokens, MigrationParams::default(), link_gbps, 30.0);
        let s = migrate(tokens, blocking(), link_gbps, 30.0);
        assert!(p.committed() && s.committed(), "{tokens} tokens: {} / {}", p.outcome, s.outcome);
        assert_eq!(s.live_stages, 0);
        let (pd, sd) = (ms(p.downtime.unwrap()), ms(s.downtime.unwrap()));
        eprintln!(
            "{tokens:>6} tokens: pipelined downtime {pd:.3} ms ({} live stages, total {:.1} ms), blocking {sd:.3} ms (total {:.1} ms)",
            p.live_stages,
            ms(p.total_time),
            ms(s.total_time)
        );
        // Blocking: the request waits for all of its KV at the link rate.
        let wire_ms = s.bytes as f64 * 8.0 / (link_gbps * 1e9) * 1e3;
        assert!(
            (sd / wire_ms - 1.0).abs() < 0.05,
            "{tokens} tokens: blocking downtime {sd} ms vs {wire_ms} ms on the wire"
        );
        pipelined.push(pd);
        blocked.push(sd);
    }
    let (lo, hi) = pipelined.iter().fold((f64::MAX, 0.0_f64), |(lo, hi), &d| (lo.min(d), hi.max(d)));
    assert!(hi < 2.0 && hi - lo < 1.0, "pipelined downtime is flat and small: {pipelined:?} ms");
    assert!(blocked[3] > 50.0 * blocked[0], "blocking downtime grows with the sequence: {blocked:?} ms");
    assert!(blocked[0] > pipelined[0] && blocked[3] > 100.0 * pipelined[3]);
}

#[test]
fn a_large_blocking_copy_takes_its_bytes_over_the_link_rate() {
    for link_gbps in [100.0, 25.0] {
        // Short iterations: the wait for the source's iteration to end before the pause is small.
        let r = migrate(16 * 1024, blocking(), link_gbps, 1.0);
        assert!(r.committed(), "{}", r.outcome);
        assert_eq!(r.bytes, 1024 * BLOCK_BYTES + BLOCK_BYTES, "1024 full blocks, and one token more");
        let wire_s = r.bytes as f64 * 8.0 / (link_gbps * 1e9);
        let total_s = r.total_time.as_secs_f64();
        assert!((total_s / wire_s - 1.0).abs() < 0.02, "{link_gbps} Gbit/s: total {total_s} s vs {wire_s} s of bytes");
    }
}

#[test]
fn frames_cost_their_encoded_length() {
    let abort = kvfleet_netmodel::migration::abort_frame(MigrationId(3), &AbortReason::Disconnected);
    assert_eq!(frame_len(&abort), FRAME_HEADER_BYTES + abort.encoded_len() as u64);
    assert!(frame_len(&abort) > FRAME_HEADER_BYTES + "connection to the peer lost".len() as u64);
}
