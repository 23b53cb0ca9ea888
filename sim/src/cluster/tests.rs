//! The event loop with the cluster controller: decisions the simulator must make like the
//! coordinator does, and moves run as live migrations.

use super::*;
use crate::config::{resolve_policy, SimConfig};
use kvfleet_control::Role;
use kvfleet_core::metrics::LiveMigrations;
use kvfleet_core::policy::registry::build_policy;
use kvfleet_core::policy::{LoadReport, PhaseChange, PhaseDecision};
use kvfleet_core::TimeSpan;
use std::path::Path;

/// `cfg`'s cluster (its intra-instance scheduler: that of `scheduler.policy`) under `policy`.
fn run_with(cfg: &SimConfig, policy: Box<dyn InstancePolicy>, requests: &[RequestSpec]) -> ClusterOutcome {
    run_split(cfg, policy, 0, requests)
}

/// [`run_with`], instances `0..prefill` prefilling and the others decoding.
fn run_split(
    cfg: &SimConfig,
    policy: Box<dyn InstancePolicy>,
    prefill: u32,
    requests: &[RequestSpec],
) -> ClusterOutcome {
    run_pd(cfg, policy, &PdConfig { prefill_instances: prefill, ..PdConfig::default() }, requests)
}

fn run_pd(cfg: &SimConfig, policy: Box<dyn InstancePolicy>, pd: &PdConfig, requests: &[RequestSpec]) -> ClusterOutcome {
    let (intra, _) = resolve_policy(&cfg.scheduler.policy).unwrap();
    let (model, gpu) = cfg.specs().unwrap();
    let engine = cfg.engine_config(&model, &gpu).unwrap();
    let timing = crate::timing_model(cfg, Path::new(".")).unwrap();
    let link = cfg.link.clone();
    let intra_params = &cfg.scheduler.intra;
    let mut cluster = Cluster::new(
        cfg.cluster.instances,
        &engine,
        timing,
        &intra,
        intra_params,
        policy,
        link,
        cfg.migration.params(),
        0,
    )
    .unwrap();
    cluster.split_prefill_decode(pd);
    cluster.corrupt_sends_from(&cfg.migration.corrupt_sends_from);
    cluster.run(requests, |_| {}).expect("the run ends within RUN_LIMIT")
}

fn run(policy: &str, instances: u32, requests: &[RequestSpec]) -> ClusterOutcome {
    let mut cfg = SimConfig::default();
    cfg.cluster.instances = instances;
    cfg.scheduler.policy = policy.to_string();
    let (_, inst) = resolve_policy(policy).unwrap();
    let policy = build_policy(&inst, &cfg.scheduler.instance).unwrap();
    run_with(&cfg, policy, requests)
}

fn burst(n: u64, prompt: u32) -> Vec<RequestSpec> {
    (0..n)
        .map(|id| RequestSpec {
            content_ids: Vec::new(),
            id: RequestId(id),
            arrival: Timestamp::ZERO,
            prompt_tokens: prompt,
            reasoning_tokens: 100,
            answer_tokens: 50,
        })
        .collect()
}

#[test]
fn simultaneous_arrivals_land_on_distinct_idle_instances() {
    for policy in ["pascal", "rr+least-kv", "fcfs"] {
        let out = run(policy, 8, &burst(8, 4000));
        let mut on: Vec<u32> = out.records.iter().map(|r| r.placed_on.0).collect();
        on.sort_unstable();
        assert_eq!(on, (0..8).collect::<Vec<_>>(), "{policy}");
        assert!(out.records.iter().all(|r| !r.rejected && r.finished_on.is_some()), "{policy}: all finished");
    }
}

/// Places request `id` on `place[id]` and moves every request at `</think>` to the first instance
/// of `prefer` that the controller still offers (it withholds targets that refused).
#[derive(Debug)]
struct Scripted {
    place: Vec<u32>,
    prefer: Vec<u32>,
}

impl InstancePolicy for Scripted {
    fn name(&self) -> &str {
        "scripted"
    }
    fn place(&mut self, request: &RequestSpec, _loads: &[LoadReport], _rng: &mut SimRng) -> InstanceId {
        InstanceId(self.place[request.id.0 as usize])
    }
    fn on_phase_change(&mut self, change: &PhaseChange, loads: &[LoadReport], _rng: &mut SimRng) -> PhaseDecision {
        let offered = |i: u32| i != change.current.0 && loads.iter().any(|l| l.instance.0 == i);
        match self.prefer.iter().find(|&&i| offered(i)) {
            Some(&i) => PhaseDecision::Migrate { to: InstanceId(i) },
            None => PhaseDecision::Stay,
        }
    }
    fn migrates_at_phase_boundary(&self) -> bool {
        true
    }
}

fn request(id: u64, arrival_s: f64, prompt: u32, reasoning: u32, answer: u32) -> RequestSpec {
    RequestSpec {
        content_ids: Vec::new(),
        id: RequestId(id),
        arrival: Timestamp::from_secs_f64(arrival_s),
        prompt_tokens: prompt,
        reasoning_tokens: reasoning,
        answer_tokens: answer,
    }
}

fn last_finish(out: &ClusterOutcome) -> Timestamp {
    out.records.iter().filter_map(|r| r.finish).max().unwrap()
}

#[test]
fn boundary_moves_are_live_migrations_that_commit() {
    let mut cfg = SimConfig::default();
    cfg.cluster.instances = 2;
    let requests: Vec<RequestSpec> = (0..4).map(|i| request(i, 0.5 * i as f64, 1000, 40, 30)).collect();
    let out = run_with(&cfg, Box::new(Scripted { place: vec![0; 4], prefer: vec![1] }), &requests);

    assert_eq!(out.migrations.len(), 4);
    for m in &out.migrations {
        assert_eq!((m.outcome_name(), m.from, m.to), ("committed", InstanceId(0), InstanceId(1)), "{m:?}");
        assert!(m.live_stages >= 1, "1000 tokens are 62 full blocks: they go live first");
        let downtime = m.downtime.expect("paused");
        assert!(downtime < TimeSpan::from_millis_f64(2.0), "{}: downtime {downtime}", m.request);
    }
    for r in &out.records {
        assert_eq!((r.placed_on, r.finished_on, r.migrations), (InstanceId(0), Some(InstanceId(1)), 1), "{}", r.id);
    }
    // A migration's 10 s deadline, long gone by then, does not stretch the run.
    assert_eq!(out.end, last_finish(&out));
    let s = LiveMigrations::new(&out.migrations);
    assert_eq!((s.committed, s.aborted, s.refused, s.stages_avg), (4, 0, 0, Some(2.0)));
}

#[test]
fn a_refused_move_goes_to_the_next_target_and_commits_there() {
    // ~100 blocks of 4 MiB per instance and no CPU pool: a target that is full must refuse.
    let mut cfg = SimConfig::default();
    cfg.cluster.instances = 3;
    cfg.cluster.kv_cache_gb = Some(100.5 * 16.0 * 262_144.0 / 1e9);
    cfg.cluster.cpu_swap_gb = 0.0;
    let requests = [
        // Instance 1 is full of request 0 (94 of 100 blocks, answering for a while).
        request(0, 0.0, 1500, 0, 100),
        // Request 1 reaches `</think>` on instance 0 with ~33 blocks; the policy prefers 1, then 2.
        request(1, 0.0, 500, 20, 50),
    ];
    let policy = Scripted { place: vec![1, 0], prefer: vec![1, 2] };
    let out = run_with(&cfg, Box::new(policy), &requests);

    let moves: Vec<(&str, u32)> = out.migrations.iter().map(|m| (m.outcome_name(), m.to.0)).collect();
    assert_eq!(moves, [("refused", 1), ("committed", 2)]);
    let refused = &out.migrations[0];
    assert_eq!((refused.bytes, refused.paused_at), (0, None), "a refusal copies nothing and never pauses");
    assert!(out.migrations[1].start >= refused.end, "the next target is tried once the refusal is in");
    let moved = &out.records[1];
    assert_eq!((moved.finished_on, moved.migrations), (Some(InstanceId(2)), 1));
    assert_eq!(out.records[0].finished_on, Some(InstanceId(1)));
    // The run summary counts the refusal among the aborted migrations.
    let summary = kvfleet_core::metrics::summarize(&out.records, &out.migrations, &Default::default());
    assert_eq!((summary.migrations_total, summary.migrations_aborted), (2, 1));
    let s = LiveMigrations::new(&out.migrations);
    assert_eq!((s.committed, s.aborted, s.refused), (1, 0, 1));
}

#[test]
fn an_aborted_move_leaves_the_request_running_at_its_source() {
    let mut cfg = SimConfig::default();
    cfg.cluster.instances = 2;
    // Shorter than the `Prepare`'s round trip (2 × 10 µs): every move times out preparing.
    cfg.migration.timeout_ms = 0.015;
    let requests: Vec<RequestSpec> = (0..3).map(|i| request(i, 0.3 * i as f64, 800, 30, 20)).collect();
    let out = run_with(&cfg, Box::new(Scripted { place: vec![0; 3], prefer: vec![1] }), &requests);

    assert_eq!(out.migrations.len(), 3);
    for m in &out.migrations {
        assert_eq!(m.outcome_name(), "aborted", "{m:?}");
        // `AbortReason::Timeout`, in whichever phase.
        assert!(m.abort_reason().is_some_and(|r| r.starts_with("timed out while")), "{:?}", m.outcome);
    }
    for r in &out.records {
        assert_eq!((r.finished_on, r.migrations), (Some(InstanceId(0)), 0), "{}", r.id);
    }
    assert_eq!(out.end, last_finish(&out));
}

#[test]
fn the_same_input_gives_the_same_migrations() {
    let mut cfg = SimConfig::default();
    cfg.cluster.instances = 4;
    let requests: Vec<RequestSpec> =
        (0..40).map(|i| request(i, 0.05 * i as f64, 200 + 37 * i as u32, 50 + 13 * i as u32, 40)).collect();
    let go = || {
        let policy = build_policy("pascal-nonadaptive", &cfg.scheduler.instance).unwrap();
        run_with(&cfg, policy, &requests)
    };
    let (a, b) = (go(), go());
    assert!(!a.migrations.is_empty());
    assert_eq!((a.records, a.migrations, a.events, a.end), (b.records, b.migrations, b.events, b.end));
}

/// Disaggregated: every request is prefilled on a prefill instance (0 or 1), handed off after its
/// first token by a live migration of exactly its prompt's KV plus that token, and decoded and
/// finished on a decode instance (2 or 3), which takes no new request.
#[test]
fn prefill_instances_hand_every_request_to_a_decode_instance() {
    let mut cfg = SimConfig::default();
    cfg.cluster.instances = 4;
    let (model, gpu) = cfg.specs().unwrap();
    let engine = cfg.engine_config(&model, &gpu).unwrap();
    let requests: Vec<RequestSpec> =
        (0..12).map(|i| request(i, 0.2 * i as f64, 500 + 100 * i as u32, 30, 20)).collect();
    let policy = build_policy("least-kv", &cfg.scheduler.instance).unwrap();
    let out = run_split(&cfg, policy, 2, &requests);

    assert_eq!(out.records.len(), 12);
    for r in &out.records {
        assert!(r.placed_on.0 < 2, "{}: placed on {}", r.id, r.placed_on);
        assert!(r.finished_on.is_some_and(|i| i.0 >= 2), "{}: finished on {:?}", r.id, r.finished_on);
        assert_eq!(r.migrations, 1, "{}", r.id);
        assert!(r.first_token.is_some_and(|t| r.finish.is_some_and(|f| t < f)));
    }
    assert_eq!(out.migrations.len(), 12);
    for m in &out.migrations {
        let prompt = requests[m.request.0 as usize].prompt_tokens;
        let blocks = (prompt + 1).div_ceil(engine.block_size);
        assert_eq!(m.outcome_name(), "committed", "{m:?}");
        assert!(m.from.0 < 2 && m.to.0 >= 2, "{m:?}");
        assert_eq!(m.bytes, u64::from(blocks) * engine.block_bytes(), "{}: the prompt's KV and one token", m.request);
    }
    let to: std::collections::BTreeSet<u32> = out.migrations.iter().map(|m| m.to.0).collect();
    assert_eq!(to.len(), 2, "handoffs spread over both decode instances: {to:?}");
    // q3: each handoff's commit (the target resumed it) to its first iteration on the decode
    // instance, which follows the commit.
    for m in &out.migrations {
        let r = out.records.iter().find(|r| r.id == m.request).expect("a record per request");
        assert_eq!(r.migrated_in, m.resumed_at, "{}: attached at the commit", r.id);
        let (Some(attached), Some(ran)) = (r.migrated_in, r.first_scheduled_after_migration) else {
            panic!("{}: a handoff records its attach and the first iteration after it: {r:?}", r.id)
        };
        assert!(ran >= attached, "{}: q3 < 0 ({ran:?} before {attached:?})", r.id);
        assert!(r.first_scheduled.is_some_and(|first| first < attached), "{}", r.id);
    }
    // Without the split the same run moves nothing and finishes where it was placed.
    let out = run_split(&cfg, build_policy("least-kv", &cfg.scheduler.instance).unwrap(), 0, &requests);
    assert!(out.migrations.is_empty());
    assert!(out.records.iter().all(|r| r.finished_on == Some(r.placed_on)));
    assert!(
        out.records.iter().all(|r| r.migrated_in.is_none() && r.first_scheduled_after_migration.is_none()),
        "no q3 without a migration"
    );
}

/// Overlapped handoffs (`[pd] overlap = "chunk"`, prompts of 4,096 tokens prefilled in chunks of
/// 512): each handoff starts once the first chunk is written, copies every chunk's full blocks
/// while the next computes and pauses at the prefill's end. The same KV moves as one-shot
/// (the prompt's and the first token's), every request finishes once on the decode instance, its
/// first token comes no later, and what is exposed after it (first token → attached on the
/// decoder) is under a fifth of one-shot's, which copies everything after the first token.
#[test]
fn an_overlapped_handoff_follows_the_prefill_and_exposes_only_its_last_chunk() {
    use kvfleet_control::roles::Overlap;
    let mut cfg = SimConfig::default();
    cfg.cluster.instances = 2;
    cfg.scheduler.intra.chunked_prefill_tokens = Some(512);
    let (model, gpu) = cfg.specs().unwrap();
    let engine = cfg.engine_config(&model, &gpu).unwrap();
    let requests: Vec<RequestSpec> = (0..4).map(|i| request(i, 5.0 * i as f64, 4096, 0, 20)).collect();
    let go = |overlap| {
        let pd = PdConfig { prefill_instances: 1, overlap, ..PdConfig::default() };
        run_pd(&cfg, build_policy("least-kv", &cfg.scheduler.instance).unwrap(), &pd, &requests)
    };
    let (one_shot, overlapped) = (go(Overlap::None), go(Overlap::Chunk));
    let exposed = |out: &ClusterOutcome, id: u64| {
        let r = out.records.iter().find(|r| r.id.0 == id).expect("a record per request");
        assert_eq!((r.placed_on.0, r.finished_on, r.migrations), (0, Some(InstanceId(1)), 1), "{}", r.id);
        let m = out.migrations.iter().find(|m| m.request.0 == id).expect("one handoff each");
        assert_eq!(m.outcome_name(), "committed", "{m:?}");
        assert_eq!(m.bytes, u64::from(4097u32.div_ceil(engine.block_size)) * engine.block_bytes(), "{m:?}");
        (r.first_token.unwrap(), r.migrated_in.unwrap().saturating_since(r.first_token.unwrap()), m.live_stages)
    };
    for out in [&one_shot, &overlapped] {
        assert_eq!((out.records.len(), out.migrations.len()), (4, 4));
    }
    for id in 0..4 {
        let (first_one, exposed_one, stages_one) = exposed(&one_shot, id);
        let (first_ov, exposed_ov, stages_ov) = exposed(&overlapped, id);
        assert!(first_ov <= first_one, "{id}: the copy does not slow the prefill");
        assert!(stages_ov >= 7 && stages_one <= 1, "{id}: a live stage per chunk: {stages_ov} vs {stages_one}");
        assert!(
            exposed_ov.as_secs_f64() < 0.2 * exposed_one.as_secs_f64(),
            "{id}: exposed {exposed_ov:?} overlapped vs {exposed_one:?} one-shot"
        );
    }
}

/// Handoffs following the prefill layer by layer (`[pd] overlap = "layer"`): each starts when the
/// prefill's first iteration is planned, and as the iteration computes each quarter of the
/// model's layers that quarter of the blocks it fills leaves. Unchunked 4,096-token prompts: the
/// same KV moves as one-shot, its first token comes no later, and what is exposed after it is
/// under 0.35 of one-shot's (the last layer group: a quarter, and the latency). Chunked in 512s,
/// the layer slices cut what chunk-level overlap exposes (the last chunk's KV) by more than half.
#[test]
fn a_handoff_following_the_prefill_layer_by_layer_exposes_only_its_last_layer_group() {
    use kvfleet_control::roles::Overlap;
    let requests: Vec<RequestSpec> = (0..4).map(|i| request(i, 5.0 * i as f64, 4096, 0, 20)).collect();
    let go = |chunks: Option<u32>, overlap| {
        let mut cfg = SimConfig::default();
        cfg.cluster.instances = 2;
        cfg.scheduler.intra.chunked_prefill_tokens = chunks;
        let (model, gpu) = cfg.specs().unwrap();
        let engine = cfg.engine_config(&model, &gpu).unwrap();
        let pd = PdConfig { prefill_instances: 1, overlap, ..PdConfig::default() };
        let out = run_pd(&cfg, build_policy("least-kv", &cfg.scheduler.instance).unwrap(), &pd, &requests);
        assert_eq!((out.records.len(), out.migrations.len()), (4, 4));
        (0..4u64)
            .map(|id| {
                let r = out.records.iter().find(|r| r.id.0 == id).expect("a record per request");
                assert_eq!((r.placed_on.0, r.finished_on, r.migrations), (0, Some(InstanceId(1)), 1), "{}", r.id);
                let m = out.migrations.iter().find(|m| m.request.0 == id).expect("one handoff each");
                assert_eq!(m.outcome_name(), "committed", "{m:?}");
                assert_eq!(m.bytes, u64::from(4097u32.div_ceil(engine.block_size)) * engine.block_bytes(), "{m:?}");
                let first = r.first_token.unwrap();
                (first, r.migrated_in.unwrap().saturating_since(first).as_secs_f64(), m.live_stages)
            })
            .collect::<Vec<_>>()
    };
    let (one_shot, layered) = (go(None, Overlap::None), go(None, Overlap::Layer));
    for id in 0..4 {
        let ((first_one, exposed_one, _), (first_ly, exposed_ly, stages)) = (one_shot[id], layered[id]);
        assert!(first_ly <= first_one, "{id}: the copy does not slow the prefill");
        assert!(stages >= 3, "{id}: a live stage per layer group but the last: {stages}");
        assert!(exposed_ly < 0.35 * exposed_one, "{id}: exposed {exposed_ly} layered vs {exposed_one} one-shot");
    }
    let (chunked, both) = (go(Some(512), Overlap::Chunk), go(Some(512), Overlap::Layer));
    for id in 0..4 {
        let ((_, exposed_chunk, _), (_, exposed_both, _)) = (chunked[id], both[id]);
        assert!(
            exposed_both < 0.5 * exposed_chunk,
            "{id}: exposed {exposed_both} layer+chunk vs {exposed_chunk} chunk"
        );
    }
}

/// A handoff that cannot complete (every one times out here) leaves the request where it was
/// prefilled, released to decode there: every request still finishes, once.
#[test]
fn a_failed_handoff_decodes_where_it_was_prefilled() {
    let mut cfg = SimConfig::default();
    cfg.cluster.instances = 3;
    cfg.migration.timeout_ms = 0.015;
    let requests: Vec<RequestSpec> = (0..6).map(|i| request(i, 0.3 * i as f64, 800, 30, 20)).collect();
    let out = run_split(&cfg, build_policy("least-kv", &cfg.scheduler.instance).unwrap(), 1, &requests);

    assert_eq!(out.records.len(), 6);
    let mut ids: Vec<u64> = out.records.iter().map(|r| r.id.0).collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..6).collect::<Vec<_>>(), "each once");
    for r in &out.records {
        assert_eq!((r.placed_on, r.finished_on, r.migrations), (InstanceId(0), Some(InstanceId(0)), 0), "{}", r.id);
        assert_eq!((r.migrated_in, r.first_scheduled_after_migration), (None, None), "{}: never moved", r.id);
    }
    assert!(out.migrations.iter().all(|m| m.outcome_name() == "aborted"), "{:?}", out.migrations);
    assert!(!out.migrations.is_empty());
}

/// Decode instances too small for the burst handed to them (KV for about three requests each):
/// pushed handoffs (`[pd] handoff = "push"`) are sent to full decoders, refused (nothing copied)
/// and tried on the next decoder 50 ms later, until one has room; pulled ones wait and are never
/// refused. Either way every request is prefilled on the prefill instance, handed off once and
/// finishes once on a decode instance.
#[test]
fn pushed_handoffs_to_full_decoders_are_refused_and_retried_never_dropped() {
    use kvfleet_control::roles::HandoffMode;
    let mut cfg = SimConfig::default();
    cfg.cluster.instances = 3;
    cfg.cluster.kv_cache_gb = Some(2.0);
    // No CPU pool: a decoder out of GPU blocks cannot take a handoff there either.
    cfg.cluster.cpu_swap_gb = 0.0;
    let requests: Vec<RequestSpec> = (0..12).map(|i| request(i, 0.1 * i as f64, 2000, 0, 400)).collect();
    let mut refusals = Vec::new();
    for handoff in [HandoffMode::Push, HandoffMode::Pull] {
        let policy = build_policy("least-kv", &cfg.scheduler.instance).unwrap();
        let out = run_pd(&cfg, policy, &PdConfig { prefill_instances: 1, handoff, ..PdConfig::default() }, &requests);
        let mut ids: Vec<u64> = out.records.iter().map(|r| r.id.0).collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..12).collect::<Vec<_>>(), "{handoff:?}: each once");
        for r in &out.records {
            assert!(!r.rejected, "{handoff:?} {}", r.id);
            assert_eq!(r.placed_on, InstanceId(0), "{handoff:?} {}", r.id);
            assert!(r.finished_on.is_some_and(|i| i.0 >= 1), "{handoff:?} {}: {:?}", r.id, r.finished_on);
            assert_eq!(r.migrations, 1, "{handoff:?} {}", r.id);
        }
        let refused: Vec<_> = out.migrations.iter().filter(|m| m.refused()).collect();
        assert!(out.migrations.iter().all(|m| m.committed() || m.refused()), "{handoff:?}: {:?}", out.migrations);
        // A refusal copies nothing; the next try comes 50 ms after it at the earliest.
        assert!(refused.iter().all(|m| m.bytes == 0), "{handoff:?}");
        for m in &refused {
            let next = out.migrations.iter().filter(|n| n.request == m.request && n.start > m.start);
            let next = next.min_by_key(|n| n.start).expect("a refused handoff is tried again");
            assert!(next.start.saturating_since(m.end) >= kvfleet_control::roles::PUSH_RETRY, "{m:?} then {next:?}");
            assert_ne!(next.to, m.to, "the next try goes to the other decoder: {m:?} then {next:?}");
        }
        refusals.push(refused.len());
    }
    assert!(refusals[0] > 0, "pushed into full decoders: refused {refusals:?}");
    assert_eq!(refusals[1], 0, "pulled: each waits for room");
}

/// Prefill instance 0 corrupts every block it sends (`[migration] corrupt_sends_from = [0]`):
/// each handoff out of it aborts at its target on a checksum mismatch, is tried once more on the
/// other decoder, then the request is prefilled again on instance 1, whose handoff commits. Every
/// request finishes once, on a decoder; nothing from instance 0 ever commits.
#[test]
fn handoffs_failing_their_checksum_are_retried_once_then_prefilled_again() {
    let mut cfg = SimConfig::default();
    cfg.cluster.instances = 4;
    cfg.migration.corrupt_sends_from = vec![0];
    let requests: Vec<RequestSpec> = (0..8).map(|i| request(i, 0.2 * i as f64, 1000, 0, 50)).collect();
    let policy = build_policy("least-kv", &cfg.scheduler.instance).unwrap();
    let out = run_split(&cfg, policy, 2, &requests);
    let mut ids: Vec<u64> = out.records.iter().map(|r| r.id.0).collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..8).collect::<Vec<_>>(), "each once");
    let mut again = 0;
    for r in &out.records {
        assert!(!r.rejected, "{}", r.id);
        assert!(r.finished_on.is_some_and(|i| i.0 >= 2), "{} finished on a decoder: {:?}", r.id, r.finished_on);
        let moves: Vec<_> = out.migrations.iter().filter(|m| m.request == r.id).collect();
        let corrupt: Vec<_> = moves.iter().filter(|m| m.checksum_mismatch).collect();
        if corrupt.is_empty() {
            assert_eq!((r.placed_on, r.replaced), (InstanceId(1), 0), "{}: only instance 0 corrupts", r.id);
            continue;
        }
        again += 1;
        assert_eq!(r.replaced, 1, "{}: its record counts the start over", r.id);
        assert_eq!(corrupt.len(), 2, "{}: one try, one retry: {moves:?}", r.id);
        assert!(corrupt.iter().all(|m| m.from == InstanceId(0) && !m.committed() && m.bytes > 0), "{moves:?}");
        assert_ne!(corrupt[0].to, corrupt[1].to, "{}: the retry goes to the other decoder", r.id);
        assert_eq!(r.placed_on, InstanceId(1), "{}: prefilled again on the other prefill instance", r.id);
        let handed = moves.iter().filter(|m| m.committed()).collect::<Vec<_>>();
        assert!(handed.len() == 1 && handed[0].from == InstanceId(1), "{}: {moves:?}", r.id);
        assert!(handed[0].start > corrupt[1].end, "{}", r.id);
    }
    assert!(again >= 2, "requests prefilled on instance 0 were prefilled again: {again}");
    assert!(out.migrations.iter().all(|m| m.from != InstanceId(0) || m.checksum_mismatch), "nothing from 0 commits");
}

/// Prompts whose KV leaves a decoder less than the handoff headroom (3,950 of its 4,096 tokens):
/// each is handed off once a decoder is empty (before, the controller waited for room it could
/// never see, and the run ended with those requests neither finished nor rejected; a run that
/// ends so now fails naming them, [`Stalled`]).
#[test]
fn a_handoff_nearly_as_large_as_every_decoder_is_handed_off_not_lost() {
    let mut cfg = SimConfig::default();
    cfg.cluster.instances = 2;
    cfg.cluster.kv_cache_gb = Some(1.073741824);
    cfg.cluster.cpu_swap_gb = 0.0;
    let requests: Vec<RequestSpec> = (0..3).map(|i| request(i, i as f64, 3950, 20, 20)).collect();
    let policy = build_policy("least-kv", &cfg.scheduler.instance).unwrap();
    let out = run_split(&cfg, policy, 1, &requests);
    assert_eq!(out.records.len(), 3);
    for r in &out.records {
        assert_eq!((r.finished_on, r.migrations), (Some(InstanceId(1)), 1), "{}", r.id);
    }
    let stalled = Stalled { at: Timestamp::ZERO, stuck: (0..7).map(RequestId).collect(), held: 7, total: 9 };
    assert_eq!(
        stalled.to_string(),
        "the run stopped at t = 0.000 s with nothing left to happen and 7 of 9 requests neither finished nor \
         rejected (7 held on a prefill instance for a handoff): request 0, request 1, request 2, request 3, \
         request 4 and 2 more"
    );
}

/// Arrow on 2 prefill + 2 decode instances, over bursts that flip roles both ways (seeded random
/// workloads): every request finishes exactly once, every committed handoff moves exactly its KV,
/// and neither pool is ever empty.
#[test]
fn arrow_flips_roles_and_every_request_finishes_once() {
    use kvfleet_control::arrow::ArrowParams;
    let mut cfg = SimConfig::default();
    cfg.cluster.instances = 4;
    let (intra, _) = resolve_policy(&cfg.scheduler.policy).unwrap();
    let (model, gpu) = cfg.specs().unwrap();
    let engine = cfg.engine_config(&model, &gpu).unwrap();
    let timing = crate::timing_model(&cfg, Path::new(".")).unwrap();
    let params =
        ArrowParams { interval_s: 0.25, cooldown_s: 1.0, slo_ttft_s: 1.0, slo_tpot_s: 0.05, ..Default::default() };
    let mut flips = 0;
    for seed in 0..6u64 {
        let mut rng = SimRng::seed_from_u64(seed);
        // A burst of long prompts (prefill-heavy), a lull, then a stream of long answers.
        let mut requests = Vec::new();
        for i in 0..60u64 {
            let (at, prompt, answer) = if i < 30 {
                (0.05 * i as f64, 2000 + rng.below(6000) as u32, 20)
            } else {
                (8.0 + 0.3 * (i - 30) as f64, 200 + rng.below(300) as u32, 200 + rng.below(300) as u32)
            };
            requests.push(request(i, at, prompt, 0, answer));
        }
        let policy = build_policy("least-kv", &cfg.scheduler.instance).unwrap();
        let link = cfg.link.clone();
        let mut cluster = Cluster::new(
            4,
            &engine,
            timing.clone(),
            &intra,
            &cfg.scheduler.intra,
            policy,
            link,
            cfg.migration.params(),
            seed,
        )
        .unwrap();
        cluster.split_prefill_decode(&PdConfig { prefill_instances: 2, ..PdConfig::default() });
        cluster.use_arrow(params, timing.as_ref()).unwrap();
        let out = cluster.run(&requests, |_| {}).expect("the run ends");

        let ids: Vec<u64> = out.records.iter().map(|r| r.id.0).collect();
        assert_eq!(ids, (0..60).collect::<Vec<_>>(), "seed {seed}: each request once");
        assert!(out.records.iter().all(|r| r.finish.is_some() && !r.rejected), "seed {seed}: all finished");
        for r in &out.records {
            // Every request that moved ran again after its last move, no sooner than its commit.
            match (r.migrations, r.migrated_in, r.first_scheduled_after_migration) {
                (0, None, None) => {}
                (1.., Some(attached), Some(ran)) => assert!(ran >= attached, "seed {seed}: q3 < 0: {r:?}"),
                _ => panic!("seed {seed}: q3's times do not match the migrations: {r:?}"),
            }
        }
        for m in out.migrations.iter().filter(|m| m.outcome_name() == "committed") {
            // Its prompt and first token; more when its instance flipped to decode and it ran on
            // until its move began.
            let r = &out.records[m.request.0 as usize];
            let tokens = m.kv_tokens_final.expect("a committed move knows its KV");
            assert!(tokens > r.prompt_tokens, "seed {seed}: {m:?}");
            assert_eq!(
                m.bytes,
                u64::from(tokens.div_ceil(engine.block_size)) * engine.block_bytes(),
                "seed {seed}: {m:?}"
            );
        }
        let mut roles = [Role::Prefill, Role::Prefill, Role::Decode, Role::Decode];
        for c in &out.role_changes {
            roles[c.instance as usize] = if c.role == "prefill" { Role::Prefill } else { Role::Decode };
            assert!(
                roles.contains(&Role::Prefill) && roles.contains(&Role::Decode),
                "seed {seed}: a pool emptied at {c:?}"
            );
        }
        flips += out.role_changes.len();
    }
    assert!(flips >= 6, "the bursts flip roles ({flips} flips in 6 runs)");
}
