//! One live migration between two engines over a fabric, driven as `crate::cluster` drives it:
//! commit, refusal, timeouts, and the downtime and transfer times the protocol yields.

use super::pair::{EnginePair, SOURCE, TARGET};
use super::*;
use kvfleet_core::engine::EngineConfig;
use kvfleet_core::kv::Tier;
use kvfleet_core::metrics::RequestRecord;
use kvfleet_core::timing::FixedTiming;
use kvfleet_core::{RequestSpec, TimeSpan};
use kvfleet_netmodel::migration::MigrationPhase;
use kvfleet_netmodel::LinkParams;
use std::sync::Arc;

/// R1-Distill-Qwen-32B in bf16: 256 KiB of KV per token, 4 MiB per 16-token block.
const KV_BYTES_PER_TOKEN: u64 = 256 * 1024;
const BLOCK_SIZE: u32 = 16;
const BLOCK_BYTES: u64 = BLOCK_SIZE as u64 * KV_BYTES_PER_TOKEN;
const REQUEST: RequestId = RequestId(1);

fn ms(d: TimeSpan) -> f64 {
    d.as_secs_f64() * 1e3
}

/// An [`EnginePair`] with fixed iteration times.
struct Bench(EnginePair);

impl std::ops::Deref for Bench {
    type Target = EnginePair;
    fn deref(&self) -> &EnginePair {
        &self.0
    }
}

impl std::ops::DerefMut for Bench {
    fn deref_mut(&mut self) -> &mut EnginePair {
        &mut self.0
    }
}

fn engine_config(gpu_blocks: u32, cpu_blocks: u32) -> EngineConfig {
    EngineConfig {
        prefix_caching: false,
        block_size: BLOCK_SIZE,
        gpu_blocks,
        cpu_blocks,
        max_num_seqs: 256,
        max_batched_tokens: 8192,
        kv_bytes_per_token: KV_BYTES_PER_TOKEN,
        tpot: TimeSpan::from_millis_f64(100.0),
    }
}

fn fixed_timing(iteration_ms: f64) -> Arc<FixedTiming> {
    Arc::new(FixedTiming { iteration: TimeSpan::from_millis_f64(iteration_ms), transfer: TimeSpan::ZERO })
}

fn link(link_gbps: f64) -> LinkParams {
    LinkParams { bandwidth_gbps: link_gbps, latency_us: 10.0 }
}

impl Bench {
    /// Room for a 16k-token request on both sides, decode iterations of `iteration_ms`.
    fn new(link_gbps: f64, iteration_ms: f64) -> Bench {
        Bench::with_target(link_gbps, iteration_ms, 4096, 0)
    }

    fn with_target(link_gbps: f64, iteration_ms: f64, target_gpu_blocks: u32, target_cpu_blocks: u32) -> Bench {
        let (source, target) = (engine_config(4096, 0), engine_config(target_gpu_blocks, target_cpu_blocks));
        Bench(EnginePair::new(source, target, fixed_timing(iteration_ms), link(link_gbps)).unwrap())
    }

    /// Submit request `id` on instance `on` and run until it holds `kv_tokens` tokens of KV (its
    /// prefill produced the first token), stopping right after that iteration (not planned again).
    fn place(&mut self, on: InstanceId, id: RequestId, kv_tokens: u32, answer_tokens: u32) {
        let spec = RequestSpec {
            content_ids: Vec::new(),
            id,
            arrival: Timestamp::ZERO,
            prompt_tokens: kv_tokens - 1,
            reasoning_tokens: 1,
            answer_tokens,
        };
        assert_eq!(self.0.place(on, spec).unwrap(), kv_tokens);
    }

    fn migrate(&mut self, params: MigrationParams) -> MigrationRecord {
        self.0.migrate(REQUEST, params).unwrap()
    }

    /// Run both engines until every request finished (stale transfers are ignored).
    fn run_to_completion(&mut self) {
        self.0.run_to_completion().unwrap();
        assert!(self.engines.iter().all(Engine::is_empty), "every request finished");
    }

    fn finished(&self, id: RequestId) -> &RequestRecord {
        self.0.finished.iter().find(|r| r.id == id).expect("finished")
    }
}

/// The request, pipelined or blocking, holding `kv_tokens` tokens, over `link_gbps`.
fn migrate(kv_tokens: u32, params: MigrationParams, link_gbps: f64, iteration_ms: f64) -> MigrationRecord {
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
    assert_eq!(r.stages(), r.live_stages + 1, "the live stages, then the stop-and-copy");
    // Every block went exactly once: live stages only full blocks, the final stage the rest.
    let kv_final = r.kv_tokens_final.expect("paused");
    assert!(kv_final >= 1000);
    assert_eq!(r.bytes, u64::from(kv_final.div_ceil(BLOCK_SIZE)) * BLOCK_BYTES);
    assert_eq!(r.stage_bytes.iter().sum::<u64>(), r.bytes);
    assert_eq!(r.blocks, u64::from(kv_final.div_ceil(BLOCK_SIZE)));
    let downtime = r.downtime.expect("it paused and resumed");
    assert!(ms(downtime) < 2.0, "the final stage is a block or two: {downtime}");
    assert!(r.paused_at.unwrap() > r.start && r.resumed_at.unwrap() < r.end);

    let (source, target) = (&b.engines[0], &b.engines[1]);
    assert!(!source.contains(REQUEST) && source.kv().table(REQUEST).is_none(), "the source freed its copy");
    assert_eq!(source.kv().used(Tier::Gpu), 0);
    assert!(
        target.contains(REQUEST) && target.reserved_requests().next().is_none(),
        "the reservation became the request"
    );
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
    let reason = AbortReason::Refused(String::new()).to_string();
    assert!(r.refused() && r.abort_reason().is_some_and(|t| t.starts_with(&reason)), "{:?}", r.outcome);
    assert_eq!((r.bytes, r.live_stages, r.paused_at, r.downtime), (0, 0, None, None));
    let (source, target) = (&b.engines[0], &b.engines[1]);
    assert!(target.reserved_requests().next().is_none() && !target.contains(REQUEST));
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
        let timeout = TimeSpan::from_millis_f64(100.0);
        let mut b = Bench::new(100.0, 30.0);
        b.place(SOURCE, REQUEST, 16 * 1024, 200);
        let r = b.migrate(MigrationParams { timeout, ..params });

        assert_eq!(r.outcome, MigrationOutcome::Aborted(AbortReason::Timeout { phase }.to_string()), "{name}");
        assert_eq!((r.outcome_name(), r.in_doubt), ("aborted", false), "{name}");
        assert_eq!(r.total_time(), timeout, "{name}: aborted exactly at the deadline");
        assert_eq!(r.paused_at.is_some(), paused, "{name}");
        assert_eq!(r.resumed_at.is_some(), paused, "{name}: resumed at the source");
        let (source, target) = (&b.engines[0], &b.engines[1]);
        assert!(source.contains(REQUEST) && !source.is_migrating_out(REQUEST), "{name}: the request runs here");
        assert!(target.reserved_requests().next().is_none() && !target.contains(REQUEST), "{name}");
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
        assert!(p.committed() && s.committed(), "{tokens} tokens: {:?} / {:?}", p.outcome, s.outcome);
        assert_eq!(s.live_stages, 0);
        let (pd, sd) = (ms(p.downtime.unwrap()), ms(s.downtime.unwrap()));
        eprintln!(
            "{tokens:>6} tokens: pipelined downtime {pd:.3} ms ({} live stages, total {:.1} ms), blocking {sd:.3} ms (total {:.1} ms)",
            p.live_stages,
            ms(p.total_time()),
            ms(s.total_time())
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
        assert!(r.committed(), "{:?}", r.outcome);
        assert_eq!(r.bytes, 1024 * BLOCK_BYTES + BLOCK_BYTES, "1024 full blocks, and one token more");
        let wire_s = r.bytes as f64 * 8.0 / (link_gbps * 1e9);
        let total_s = r.transfer_s();
        assert!((total_s / wire_s - 1.0).abs() < 0.02, "{link_gbps} Gbit/s: total {total_s} s vs {wire_s} s of bytes");
    }
}

#[test]
fn frames_cost_their_encoded_length() {
    let abort = kvfleet_netmodel::migration::abort_frame(MigrationId(3), &AbortReason::Disconnected);
    assert_eq!(frame_len(&abort), FRAME_HEADER_BYTES + abort.encoded_len() as u64);
    assert!(frame_len(&abort) > FRAME_HEADER_BYTES + "connection to the peer lost".len() as u64);
}

#[test]
fn simulate_one_takes_a_blocking_copy_at_the_link_rate_and_pipelining_hides_it() {
    let (link_gbps, iteration_ms) = (2.0, 20.0);
    let engine = engine_config(4096, 0);
    let one = |params| simulate_one(4096, link(link_gbps), params, &engine, fixed_timing(iteration_ms)).unwrap();
    let (b, report) = one(blocking());
    let (p, _) = one(MigrationParams::default());
    // The source's report: the same stages and bytes; its downtime ends at the `CommitReply`,
    // after the request already runs on the target.
    assert_eq!((report.stages.len() as u32, report.bytes), (b.stages(), b.bytes));
    assert!(report.downtime.unwrap() > b.downtime.unwrap());
    assert!(b.committed() && p.committed(), "{:?} / {:?}", b.outcome, p.outcome);
    assert_eq!((b.kv_tokens_start, b.live_stages, b.stages()), (Some(4096), 0, 1));
    // The pause waits for the iteration in flight at the start, which adds a token: 257 blocks.
    assert_eq!((b.kv_tokens_final, b.bytes), (Some(4097), 257 * BLOCK_BYTES));
    // Blocking: the bytes over the link rate, plus at most one iteration before the pause.
    let wire_ms = b.bytes as f64 * 8.0 / (link_gbps * 1e9) * 1e3;
    let total_ms = ms(b.total_time());
    assert!(total_ms >= wire_ms && total_ms < wire_ms * 1.02 + iteration_ms, "total {total_ms} ms vs {wire_ms} ms");
    assert!(ms(b.downtime.unwrap()) > 0.99 * wire_ms);
    // Pipelined: the KV decoded during the live copy goes again; the request pauses only for
    // the last few blocks.
    assert!(p.live_stages >= 1 && p.bytes > b.bytes, "{} stages, {} bytes", p.live_stages, p.bytes);
    assert!(ms(p.total_time()) > wire_ms);
    assert!(ms(p.downtime.unwrap()) < 0.1 * wire_ms, "downtime {}", p.downtime.unwrap());
}

#[test]
fn outcomes_are_named_as_the_emulator_names_them() {
    let names = [
        (MigrationOutcome::Committed, kvfleet_wire::outcome_name(true, false)),
        (measured(Outcome::Aborted(AbortReason::Refused("no room".into()))), kvfleet_wire::outcome_name(false, true)),
        (measured(Outcome::Aborted(AbortReason::Disconnected)), kvfleet_wire::outcome_name(false, false)),
        (measured(Outcome::Unknown(AbortReason::Disconnected)), kvfleet_wire::outcome_name(false, false)),
    ];
    for (outcome, name) in names {
        assert_eq!(outcome.name(), name, "{outcome:?}");
    }
    // The reason is the protocol's own text, as the emulator's log carries it.
    let refused = measured(Outcome::Aborted(AbortReason::Refused("no room".into())));
    assert_eq!(refused.reason(), Some(format!("{}: no room", kvfleet_wire::REFUSED_PREFIX).as_str()));
}
