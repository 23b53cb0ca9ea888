//! Property tests: random interleavings commit and copy every byte; random faults never lose or
//! duplicate the request; random frames never panic either machine.

use super::harness::{Config, World};
use super::wire::{self, frame::Body, Frame};
use super::*;
use proptest::prelude::*;

/// Runs random enabled events (deliveries in any order across streams, decode steps, driver
/// completions in any order) for `steps`.
fn run_random(w: &mut World, steps: &[u32]) {
    for &c in steps {
        let evs = w.enabled();
        if evs.is_empty() {
            return;
        }
        let ev = evs[c as usize % evs.len()];
        w.apply(ev, c as usize / evs.len());
    }
}

fn config(initial_kv: u32, streams: usize, stop_copy_blocks: u32, max_stages: u32) -> Config {
    let mut cfg = Config::small(initial_kv, streams);
    cfg.params.stop_copy_blocks = stop_copy_blocks;
    cfg.params.max_stages = max_stages;
    cfg
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Without faults every interleaving commits, the target's KV equals the source's byte for
    /// byte, and the stage policy holds.
    #[test]
    fn random_interleavings_commit_and_copy_every_byte(
        initial_kv in 0u32..300,
        streams in 1usize..=4,
        stop_copy_blocks in 1u32..8,
        max_stages in 0u32..4,
        decode_while_pausing in 0u32..6,
        steps in prop::collection::vec(any::<u32>(), 0..600),
    ) {
        let mut w = World::new(config(initial_kv, streams, stop_copy_blocks, max_stages));
        w.decode_while_pausing = decode_while_pausing;
        w.start();
        run_random(&mut w, &steps);
        w.drain();
        prop_assert_eq!(w.src_outcome(), Some(&Outcome::Committed));
        prop_assert_eq!(w.tgt_outcome(), Some(&Outcome::Committed));
        w.check_safety(); // one Done each, KV byte-equal, state carried
        let r = w.src.report();
        let total = blocks_for_tokens(w.kv_tokens, 4);
        prop_assert_eq!(r.stages.iter().map(|s| s.blocks).sum::<u32>(), total, "every block sent exactly once");
        prop_assert_eq!(r.bytes, total as u64 * 256);
        prop_assert!(r.live_stages() <= max_stages);
        for (i, s) in r.stages.iter().enumerate() {
            prop_assert_eq!(s.stage, i as u32);
            if !s.final_stage {
                prop_assert!(s.blocks >= stop_copy_blocks, "live stage {} of {} blocks", i, s.blocks);
            }
        }
        prop_assert_eq!(w.tgt.as_ref().unwrap().report().blocks_written, total);
        prop_assert!(r.downtime.is_some() && r.downtime <= r.total_time);
    }

    /// Following a prefill (an overlapped handoff: the request writes KV until the freeze, which
    /// may come in any state once the pause is asked): every interleaving commits, every block
    /// crosses exactly once, every live stage carries at least one block, and the target's KV
    /// equals the source's byte for byte.
    #[test]
    fn random_interleavings_following_a_prefill_commit_and_copy_every_byte(
        initial_kv in 0u32..100,
        streams in 1usize..=4,
        expected in 0u32..300,
        steps in prop::collection::vec(any::<u32>(), 0..600),
    ) {
        let mut w = World::new(config(initial_kv, streams, 4, 3));
        w.src = w.src.clone().following_prefill(expected);
        w.start();
        run_random(&mut w, &steps);
        w.drain();
        check_followed(&w)?;
        let r = w.src.report();
        let total = blocks_for_tokens(w.kv_tokens, 4);
        prop_assert_eq!(r.stages.iter().map(|s| s.blocks).sum::<u32>(), total, "every block sent exactly once");
        prop_assert!(r.paused_at.is_some_and(|p| r.stages.last().is_some_and(|s| s.started >= p)));
    }

    /// Following a prefill in layer groups (each iteration's blocks may leave group by group
    /// while it computes): every interleaving commits, no group leaves before it is computed
    /// (the harness checks each slice), every byte crosses exactly once, and the target's KV
    /// equals the source's byte for byte.
    #[test]
    fn random_interleavings_following_a_prefill_in_layer_groups_copy_every_byte_once(
        initial_kv in 0u32..40,
        streams in 1usize..=4,
        chunk in 1u32..24,
        groups in 1u32..=6,
        steps in prop::collection::vec(any::<u32>(), 0..600),
    ) {
        let mut w = World::new(config(initial_kv, streams, 4, 3));
        w.src = w.src.clone().following_prefill(initial_kv + 60).in_layer_groups(groups);
        w.layers = Some((chunk, groups));
        w.start();
        run_random(&mut w, &steps);
        w.drain();
        check_followed(&w)?;
    }
}

/// A migration that followed a prefill committed on both sides, safely (one Done each, the
/// target's KV the source's byte for byte), every byte crossed exactly once, every block was
/// written, and its stages ran in order, each live one carrying something.
fn check_followed(w: &World) -> Result<(), TestCaseError> {
    prop_assert_eq!(w.src_outcome(), Some(&Outcome::Committed));
    prop_assert_eq!(w.tgt_outcome(), Some(&Outcome::Committed));
    w.check_safety();
    let r = w.src.report();
    let total = blocks_for_tokens(w.kv_tokens, 4);
    prop_assert_eq!(r.bytes, total as u64 * 256, "every byte sent exactly once");
    prop_assert_eq!(w.tgt.as_ref().unwrap().report().blocks_written, total);
    for (i, s) in r.stages.iter().enumerate() {
        prop_assert_eq!(s.stage, i as u32);
        prop_assert!(s.final_stage || s.blocks >= 1, "live stage {} is empty", i);
    }
    Ok(())
}

#[derive(Clone, Debug)]
enum Fault {
    Disconnect,
    Corrupt(u32),
    Drop(u32),
    Duplicate(u32),
    RefuseReserve,
    FailWrite,
    FailAttach,
    ReadFail,
    Cancel,
    Expire,
}

#[derive(Clone, Debug)]
enum Step {
    Go(u32),
    Fault(Fault),
}

fn fault() -> impl Strategy<Value = Fault> {
    prop_oneof![
        Just(Fault::Disconnect),
        any::<u32>().prop_map(Fault::Corrupt),
        any::<u32>().prop_map(Fault::Drop),
        any::<u32>().prop_map(Fault::Duplicate),
        Just(Fault::RefuseReserve),
        Just(Fault::FailWrite),
        Just(Fault::FailAttach),
        Just(Fault::ReadFail),
        Just(Fault::Cancel),
        Just(Fault::Expire),
    ]
}

/// All queued frames, control and data, as (queue, position).
fn queued(w: &World) -> Vec<(usize, usize)> {
    let mut all = Vec::new();
    let queues = std::iter::once(&w.to_target).chain(std::iter::once(&w.to_source)).chain(w.data.iter());
    for (q, frames) in queues.enumerate() {
        all.extend((0..frames.len()).map(|i| (q, i)));
    }
    all
}

fn queue_mut(w: &mut World, q: usize) -> &mut std::collections::VecDeque<Frame> {
    match q {
        0 => &mut w.to_target,
        1 => &mut w.to_source,
        k => &mut w.data[k - 2],
    }
}

fn inject(w: &mut World, f: &Fault) {
    let now = w.now;
    match f {
        Fault::Disconnect => {
            if w.connected {
                w.disconnect();
            }
        }
        Fault::Corrupt(k) => {
            let blocks: Vec<&mut Frame> = w.data.iter_mut().flatten().collect();
            let n = blocks.len();
            if n > 0 {
                if let Some(Body::BlockData(b)) = blocks.into_iter().nth(*k as usize % n).and_then(|f| f.body.as_mut())
                {
                    let mut data = b.data.to_vec();
                    if let Some(x) = data.get_mut(*k as usize % 256) {
                        *x ^= 1;
                    }
                    b.data = Bytes::from(data);
                }
            }
        }
        Fault::Drop(k) | Fault::Duplicate(k) => {
            let all = queued(w);
            if !all.is_empty() {
                let (q, i) = all[*k as usize % all.len()];
                let queue = queue_mut(w, q);
                if matches!(f, Fault::Drop(_)) {
                    queue.remove(i);
                } else if let Some(frame) = queue.get(i).cloned() {
                    queue.insert(i + 1, frame);
                }
            }
        }
        Fault::RefuseReserve => w.reserve_result = Err(AbortReason::TargetOutOfMemory("full".into())),
        Fault::FailWrite => w.fail_next_write = Some(AbortReason::WriteFailed("io error".into())),
        Fault::FailAttach => w.attach_result = Err(AbortReason::AttachFailed("no slot".into())),
        Fault::ReadFail => w.src.on_read_failed(now, "evicted"),
        Fault::Cancel => {
            w.src.cancel(now, "shutdown");
        }
        Fault::Expire => {
            w.fire_next_timeout();
        }
    }
    w.pump();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// With faults anywhere (disconnects, corruption, loss, duplication, refusals, failed writes
    /// and attaches, cancels, timeouts): exactly one Done per side, the request is never lost
    /// (source freed ⇒ target committed with identical KV) nor duplicated (target committed ⇒
    /// source committed or in doubt, never resumed), and an aborted target holds nothing.
    #[test]
    fn faults_never_lose_or_duplicate_the_request(
        initial_kv in 0u32..120,
        streams in 1usize..=4,
        follow in any::<bool>(),
        layers in any::<bool>(),
        steps in prop::collection::vec(
            prop_oneof![30 => any::<u32>().prop_map(Step::Go), 1 => fault().prop_map(Step::Fault)],
            0..400,
        ),
    ) {
        let mut w = World::new(config(initial_kv, streams, 2, 3));
        if follow {
            w.src = w.src.clone().following_prefill(initial_kv + 40);
        }
        if follow && layers {
            // Followed layer by layer: iterations of 7 tokens in 3 layer groups.
            w.src = w.src.clone().in_layer_groups(3);
            w.layers = Some((7, 3));
        }
        w.start();
        for step in &steps {
            match step {
                Step::Go(c) => run_random(&mut w, &[*c]),
                Step::Fault(f) => inject(&mut w, f),
            }
        }
        w.drain();
        prop_assert!(w.finished());
        w.check_safety();
        if steps.iter().all(|s| matches!(s, Step::Go(_))) {
            prop_assert_eq!(w.src_outcome(), Some(&Outcome::Committed));
        }
    }
}

// ---------------------------------------------------------------- random frames

fn arb_id() -> impl Strategy<Value = u64> {
    prop_oneof![4 => Just(1u64), 1 => 0u64..3]
}

fn arb_frame() -> impl Strategy<Value = Frame> {
    let body =
        prop_oneof![
            (
                arb_id(),
                0u32..30,
                prop_oneof![Just(4u32), 0u32..6],
                prop_oneof![Just(8u64), 0u64..10],
                prop_oneof![Just(0u32), 0u32..70]
            )
                .prop_map(
                    |(migration_id, kv_tokens, block_size, block_bytes, layer_groups)| Body::Prepare(wire::Prepare {
                        migration_id,
                        request_id: 1,
                        kv_tokens,
                        block_size,
                        block_bytes,
                        layer_groups,
                        ..Default::default()
                    })
                ),
            (arb_id(), any::<bool>(), 0u32..3).prop_map(|(migration_id, ok, cached_blocks)| Body::PrepareReply(
                wire::PrepareReply { migration_id, ok, reason: String::new(), cached_blocks }
            )),
            (
                arb_id(),
                0u32..4,
                0u32..10,
                0u32..6,
                prop::collection::vec(any::<u8>(), 0..10),
                any::<bool>(),
                prop_oneof![Just((0u32, 0u32)), (0u32..5, 0u32..5)]
            )
                .prop_map(|(migration_id, stage, index, tokens, data, good, (group_first, group_end))| {
                    let checksum = if good { checksum(&data) } else { 0 };
                    Body::BlockData(wire::BlockData {
                        migration_id,
                        stage,
                        index,
                        tokens,
                        checksum,
                        data: data.into(),
                        group_first,
                        group_end,
                    })
                }),
            (arb_id(), 0u32..4, 0u32..6, any::<bool>()).prop_map(|(migration_id, stage, blocks, final_stage)| {
                Body::StageEnd(wire::StageEnd { migration_id, stage, blocks, final_stage })
            }),
            (arb_id(), 0u32..4)
                .prop_map(|(migration_id, stage)| Body::StageAck(wire::StageAck { migration_id, stage })),
            (arb_id(), 0u32..30, 0u32..9).prop_map(|(migration_id, kv_tokens, blocks_total)| Body::Commit(
                wire::Commit { migration_id, kv_tokens, blocks_total, state: Bytes::from_static(b"s") }
            )),
            (arb_id(), any::<bool>()).prop_map(|(migration_id, ok)| Body::CommitReply(wire::CommitReply {
                migration_id,
                ok,
                reason: String::new()
            })),
            (arb_id(), -2i32..15).prop_map(|(migration_id, code)| Body::Abort(wire::Abort {
                migration_id,
                code,
                reason: "x".into()
            })),
        ];
    prop_oneof![20 => body.prop_map(|b| Frame { body: Some(b) }), 1 => Just(Frame { body: None })]
}

#[derive(Clone, Debug)]
enum Poke {
    Frame(Frame),
    Written(u32),
    Reserved(bool),
    Attached(bool),
    WriteFailed,
    Timeout(u64),
    Paused(u32),
    BlocksSent(u32),
    KvProgress(u32),
    LayerProgress(u32, u32),
    Disconnect,
    ReadFailed,
    Cancel,
}

fn arb_poke() -> impl Strategy<Value = Poke> {
    prop_oneof![
        12 => arb_frame().prop_map(Poke::Frame),
        3 => (0u32..10).prop_map(Poke::Written),
        1 => any::<bool>().prop_map(Poke::Reserved),
        1 => any::<bool>().prop_map(Poke::Attached),
        1 => Just(Poke::WriteFailed),
        1 => (0u64..20_000_000_000).prop_map(Poke::Timeout),
        1 => (0u32..40).prop_map(Poke::Paused),
        1 => (0u32..4).prop_map(Poke::BlocksSent),
        1 => (0u32..40).prop_map(Poke::KvProgress),
        1 => (0u32..40, 0u32..6).prop_map(|(t, g)| Poke::LayerProgress(t, g)),
        1 => Just(Poke::Disconnect),
        1 => Just(Poke::ReadFailed),
        1 => Just(Poke::Cancel),
    ]
}

/// Drains a machine's actions; fails on an action after `Done` or a second `Done`.
fn drain_checked<A: std::fmt::Debug>(done: &mut bool, mut next: impl FnMut() -> Option<A>, is_done: fn(&A) -> bool) {
    while let Some(a) = next() {
        assert!(!*done, "action {a:?} after Done");
        *done = is_done(&a);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// Any sequence of frames and driver events: no panic, at most one Done, nothing after it.
    #[test]
    fn random_frames_never_panic(
        pokes in prop::collection::vec(arb_poke(), 0..60),
        start in any::<bool>(),
        follow in any::<bool>(),
    ) {
        poke_both_machines(pokes, start, follow)?;
    }
}

fn poke_both_machines(pokes: Vec<Poke>, start: bool, follow: bool) -> Result<(), TestCaseError> {
    let params = MigrationParams { stop_copy_blocks: 1, ..MigrationParams::new(4, 8) };
    let mut src = SourceMachine::new(MigrationId(1), RequestId(1), params.clone(), Timestamp(0), 9).unwrap();
    if follow {
        src = src.following_prefill(30).in_layer_groups(3);
    }
    if start {
        src.start(Timestamp(0));
    }
    let mut tgt: Option<TargetMachine> = None;
    let (mut src_done, mut tgt_done) = (false, false);
    let mut now = Timestamp(0);
    for poke in pokes {
        now += TimeSpan::from_nanos(1_000);
        match poke {
            Poke::Frame(f) => {
                src.on_frame(now, f.clone());
                match tgt.as_mut() {
                    Some(t) => t.on_frame(now, f),
                    None => tgt = TargetMachine::accept(now, &params, f).ok(),
                }
            }
            Poke::Written(i) => {
                if let Some(t) = tgt.as_mut() {
                    t.on_written(now, i);
                }
            }
            Poke::Reserved(ok) => {
                let r = if ok { Ok(()) } else { Err(AbortReason::TargetOutOfMemory("full".into())) };
                if let Some(t) = tgt.as_mut() {
                    t.on_reserved(now, r);
                }
            }
            Poke::Attached(ok) => {
                let r = if ok { Ok(()) } else { Err(AbortReason::AttachFailed("no".into())) };
                if let Some(t) = tgt.as_mut() {
                    t.on_attached(now, r);
                }
            }
            Poke::WriteFailed => {
                if let Some(t) = tgt.as_mut() {
                    t.on_write_failed(now, AbortReason::WriteFailed("io".into()));
                }
            }
            Poke::Timeout(ns) => {
                now = now.max(Timestamp(ns));
                src.on_timeout(now);
                if let Some(t) = tgt.as_mut() {
                    t.on_timeout(now);
                }
            }
            Poke::Paused(kv) => src.on_paused(now, kv, Bytes::from_static(b"state")),
            Poke::BlocksSent(stage) => src.on_blocks_sent(now, stage),
            Poke::KvProgress(kv) => src.on_kv_progress(now, kv),
            Poke::LayerProgress(tokens, groups) => src.on_layer_progress(now, tokens, groups),
            Poke::Disconnect => {
                src.on_disconnect(now);
                if let Some(t) = tgt.as_mut() {
                    t.on_disconnect(now);
                }
            }
            Poke::ReadFailed => src.on_read_failed(now, "gone"),
            Poke::Cancel => {
                src.cancel(now, "stop");
            }
        }
        drain_checked(&mut src_done, || src.poll_action(), |a| matches!(a, SourceAction::Done(_)));
        if let Some(t) = tgt.as_mut() {
            drain_checked(&mut tgt_done, || t.poll_action(), |a| matches!(a, TargetAction::Done(_)));
        }
        prop_assert_eq!(src_done, src.is_done());
        prop_assert_eq!(src_done, src.outcome().is_some());
    }
    Ok(())
}
