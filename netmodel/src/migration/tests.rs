//! Scenario tests: the happy path, the stage policy as a table, every failure path.

use super::harness::{request_state, Config, Ev, World, REQUEST};
use super::wire::{self, frame::Body, Frame};
use super::*;

fn body(f: &Frame) -> &Body {
    f.body.as_ref().expect("frame has a body")
}

fn is_abort(f: &Frame, kind: AbortKind) -> bool {
    matches!(body(f), Body::Abort(a) if AbortKind::from_wire(a.code) == kind)
}

/// Stage blocks of the source's report, in order.
fn stage_blocks(w: &World) -> Vec<u32> {
    w.src.report().stages.iter().map(|s| s.blocks).collect()
}

#[test]
fn params_defaults_and_validation() {
    let p = MigrationParams::default();
    assert_eq!((p.stop_copy_blocks, p.max_stages, p.block_size, p.block_bytes), (16, 3, 16, 4 << 20));
    assert_eq!(p.timeout, TimeSpan::from_secs_f64(10.0));
    assert!(p.validate().is_ok());
    let bad = |f: fn(&mut MigrationParams)| {
        let mut p = MigrationParams::default();
        f(&mut p);
        p.validate().unwrap_err().to_string()
    };
    assert!(bad(|p| p.block_size = 0).contains("`block_size`"));
    assert!(bad(|p| p.block_bytes = 0).contains("`block_bytes`"));
    assert!(bad(|p| p.block_bytes = MAX_BLOCK_BYTES + 1).contains("`block_bytes`"));
    assert!(bad(|p| p.timeout = TimeSpan::ZERO).contains("`timeout`"));
    let p = MigrationParams { block_size: 0, ..MigrationParams::default() };
    assert!(SourceMachine::new(MigrationId(1), RequestId(1), p, Timestamp(0), 10).is_err());
}

#[test]
fn block_geometry_helpers() {
    assert_eq!(blocks_for_tokens(0, 4), 0);
    assert_eq!(blocks_for_tokens(1, 4), 1);
    assert_eq!(blocks_for_tokens(8, 4), 2);
    assert_eq!(blocks_for_tokens(9, 4), 3);
    assert_eq!(blocks_for_tokens(u32::MAX, 1), u32::MAX);
    assert_eq!(block_tokens(2, 9, 4), 1);
    assert_eq!(block_tokens(1, 9, 4), 4);
    assert_eq!(block_tokens(3, 9, 4), 0);
    assert_eq!(block_tokens(u32::MAX, u32::MAX, u32::MAX), 0);
    let f = block_frame(MigrationId(3), 1, 2, 4, Bytes::from_static(b"abc"));
    let Body::BlockData(b) = body(&f) else { panic!() };
    assert_eq!((b.migration_id, b.stage, b.index, b.tokens), (3, 1, 2, 4));
    assert_eq!(b.checksum, xxhash_rust::xxh3::xxh3_64(b"abc"));
    assert_ne!(checksum(b"abc"), checksum(b"abd"));
}

/// A block sent as its head, then the data at `BLOCK_DATA_PAYLOAD_PATH` (what a zero-copy sender
/// writes: each enclosing field's key and length, the head's fields, the data field's key, length
/// and bytes), decodes as the whole `block_frame`.
#[test]
fn block_head_and_payload_at_its_path_decode_as_the_block_frame() {
    use prost::encoding::{encode_varint, encoded_len_varint};
    use prost::Message;
    for len in [0usize, 1, 127, 128, 4 << 20] {
        let data = Bytes::from((0..len).map(|i| (i % 253) as u8).collect::<Vec<_>>());
        let head = block_frame_head(MigrationId(7), 2, 9, 16, &data);
        let [outer, inner] = BLOCK_DATA_PAYLOAD_PATH.map(|tag| u64::from(tag) << 3 | 2);
        let inner_len = head.encoded_len() + encoded_len_varint(inner) + encoded_len_varint(len as u64) + len;
        let mut wire = Vec::new();
        encode_varint(outer, &mut wire);
        encode_varint(inner_len as u64, &mut wire);
        head.encode(&mut wire).unwrap();
        encode_varint(inner, &mut wire);
        encode_varint(len as u64, &mut wire);
        wire.extend_from_slice(&data);
        let decoded = Frame::decode(&wire[..]).unwrap();
        assert_eq!(decoded, block_frame(MigrationId(7), 2, 9, 16, data), "{len} bytes");
    }
}

#[test]
fn happy_path_frames_report_and_bytes() {
    // 50 tokens, 4 per block: 12 full blocks (≥ stop_copy_blocks = 4) go live, then the request
    // pauses and the partial 13th block goes in the final stage.
    let mut w = World::new(Config::small(50, 2));
    let mut ctx = std::collections::HashMap::new();
    ctx.insert("traceparent".to_string(), "00-abc-def-01".to_string());
    w.src = w.src.clone().with_trace_context(ctx.clone());
    w.start();
    let Body::Prepare(p) = body(&w.src_sent[0]) else { panic!("first frame must be Prepare") };
    assert_eq!((p.migration_id, p.request_id, p.kv_tokens, p.block_size, p.block_bytes), (1, REQUEST, 50, 4, 256));
    assert_eq!((p.model.as_str(), p.source_instance), ("test-model", 3));
    w.drain();
    assert_eq!(w.tgt.as_ref().unwrap().trace_context(), &ctx);
    assert_eq!(w.src_outcome(), Some(&Outcome::Committed));
    assert_eq!(w.tgt_outcome(), Some(&Outcome::Committed));
    w.check_safety();
    w.check_target_kv_equals_source();
    assert_eq!(stage_blocks(&w), vec![12, 1]);
    let kinds: Vec<&str> = w.src_sent.iter().map(|f| body_name(body(f))).collect();
    assert_eq!(kinds, ["Prepare", "StageEnd", "StageEnd", "Commit"]);
    let tkinds: Vec<&str> = w.tgt_sent.iter().map(|f| body_name(body(f))).collect();
    assert_eq!(tkinds, ["PrepareReply", "StageAck", "CommitReply"]);
    let r = w.src.report();
    assert_eq!(r.bytes, 13 * 256);
    assert_eq!(r.kv_tokens_start, 50);
    assert_eq!(r.kv_tokens_final, Some(50));
    assert_eq!(r.live_stages(), 1);
    assert!(r.stages.iter().all(|s| s.sent.is_some() && s.ended.is_some()));
    assert!(r.stages[1].final_stage && !r.stages[0].final_stage);
    let (started, finished) = (r.started.unwrap(), r.finished_at.unwrap());
    assert_eq!(r.total_time, Some(finished - started));
    assert_eq!(r.downtime, Some(finished - r.paused_at.unwrap()));
    let goodput = r.goodput_bytes_per_s.unwrap();
    assert!((goodput - 13.0 * 256.0 / (finished - started).as_secs_f64()).abs() < 1e-6);
    let t = w.tgt.as_ref().unwrap().report();
    assert_eq!((t.bytes_received, t.blocks_written, t.stages_acked), (13 * 256, 13, 1));
    assert_eq!(t.kv_tokens_final, Some(50));
    // The report serializes (JSON result files).
    let json = serde_json::to_string(r).unwrap();
    let back: MigrationReport = serde_json::from_str(&json).unwrap();
    assert_eq!(&back, r);
    serde_json::to_string(t).unwrap();
}

/// The time-based threshold: (budget ms, live stages done, remaining blocks, last stage MB/s)
/// → pause? 4 MiB blocks; `None` rate: before any live stage, the block count decides.
#[test]
fn time_based_stop_copy_pauses_when_the_rest_fits_the_budget() {
    #[rustfmt::skip]
    type Row = (Option<f64>, u32, u32, Option<f64>, bool);
    let table: &[Row] = &[
        // off: the default block threshold (16)
        (None, 1, 15, Some(400.0), true),
        (None, 1, 16, Some(400.0), false),
        // a 4 MiB block takes 8.4 ms at 500 MB/s; 10 ms at 12.5 GB/s (100 Gbit/s) is 29.8 blocks
        (Some(10.0), 1, 1, Some(500.0), true),
        (Some(10.0), 1, 2, Some(500.0), false),
        (Some(10.0), 1, 29, Some(12_500.0), true),
        (Some(10.0), 1, 30, Some(12_500.0), false),
        // not measured yet (before stage 0): the block count
        (Some(10.0), 0, 20, None, false),
        (Some(10.0), 0, 3, None, true),
        // max_stages and "nothing new" always stop
        (Some(10.0), 3, 1000, Some(1.0), true),
        (Some(10.0), 1, 0, Some(1.0), true),
    ];
    for &(budget, done, remaining, mb_per_s, pause) in table {
        let p =
            MigrationParams { stop_copy_after: budget.map(TimeSpan::from_millis_f64), ..MigrationParams::default() };
        let rate = mb_per_s.map(|m| m * 1e6);
        assert_eq!(p.stop_copy_now(done, remaining, rate), pause, "{budget:?} {done} {remaining} {mb_per_s:?}");
    }
}

#[test]
fn time_based_stop_copy_runs_through_the_machines() {
    // 400 tokens = 100 full blocks; 40 tokens decoded per live stage = 10 new blocks each time.
    let run = |budget_s: f64| {
        let mut cfg = Config::small(400, 3);
        cfg.decode_per_copy = 40;
        cfg.params.stop_copy_blocks = 1;
        cfg.params.stop_copy_after = Some(TimeSpan::from_secs_f64(budget_s));
        let mut w = World::new(cfg);
        w.start();
        w.drain();
        assert_eq!(w.src_outcome(), Some(&Outcome::Committed));
        w.check_safety();
        stage_blocks(&w)
    };
    // A generous budget: after stage 0 the 10 new blocks fit it, pause at once.
    assert_eq!(run(1.0), vec![100, 10]);
    // A budget no copy fits: live stages until max_stages.
    assert_eq!(run(1e-9), vec![100, 10, 10, 10]);
}

/// (initial KV tokens, tokens decoded while each live stage copies, stop_copy_blocks, max_stages)
/// → blocks of every stage (the last is the stop-and-copy stage). 4 tokens per block.
#[test]
fn stage_count_follows_threshold_and_max_stages() {
    #[rustfmt::skip]
    let table: &[(u32, u32, u32, u32, &[u32])] = &[
        // fewer full blocks than the threshold: straight to stop-and-copy
        (10, 0, 16, 3, &[3]),
        (63, 0, 16, 3, &[16]),
        (0, 0, 16, 3, &[0]),
        // exactly the threshold: one live stage; nothing new after it; KV ends on a boundary
        (64, 0, 16, 3, &[16, 0]),
        // decoding 16 blocks per stage keeps ≥ 16 new blocks: max_stages stops it
        (64, 64, 16, 3, &[16, 16, 16, 16]),
        // 15 new blocks per stage < 16: one live stage
        (64, 60, 16, 3, &[16, 15]),
        (64, 63, 16, 3, &[16, 16]),
        (64, 64, 16, 1, &[16, 16]),
        (64, 64, 16, 0, &[16]),
        (200, 100, 16, 3, &[50, 25, 25, 25]),
        (200, 40, 16, 3, &[50, 10]),
        (200, 100, 16, 5, &[50, 25, 25, 25, 25, 25]),
        (5, 0, 1, 3, &[1, 1]),
        (5, 4, 1, 3, &[1, 1, 1, 2]),
    ];
    for &(kv, decode, stop, max_stages, expected) in table {
        let mut cfg = Config::small(kv, 3);
        cfg.params.stop_copy_blocks = stop;
        cfg.params.max_stages = max_stages;
        cfg.decode_per_copy = decode;
        let mut w = World::new(cfg);
        w.start();
        w.drain();
        let case = format!("kv {kv}, decode {decode}, stop {stop}, max_stages {max_stages}");
        assert_eq!(stage_blocks(&w), expected, "{case}");
        let r = w.src.report();
        assert_eq!(r.live_stages() as usize, expected.len() - 1, "{case}");
        assert!(r.live_stages() <= max_stages, "{case}");
        assert_eq!(r.stages.iter().filter(|s| s.final_stage).count(), 1, "{case}");
        assert!(r.stages.last().unwrap().final_stage, "{case}");
        assert_eq!(w.src_outcome(), Some(&Outcome::Committed), "{case}");
        w.check_safety();
    }
}

#[test]
fn downtime_runs_from_pause_to_commit_reply() {
    let mut w = World::new(Config::small(40, 2));
    w.start();
    w.run_until(|w| w.pause_asked);
    assert_eq!(w.src.phase(), MigrationPhase::Pausing);
    w.now = Timestamp::from_secs_f64(2.0);
    w.apply(Ev::Freeze, 0);
    let paused = w.now;
    assert_eq!(w.src.report().paused_at, Some(paused));
    // Deliver everything except the CommitReply, then let 1.5 s pass before it arrives.
    w.run_until(|w| w.to_source.front().is_some_and(|f| matches!(body(f), Body::CommitReply(_))));
    assert!(w.src_done.is_empty());
    w.now = paused + TimeSpan::from_secs_f64(1.5);
    w.apply(Ev::ToSource, 0);
    assert_eq!(w.src_outcome(), Some(&Outcome::Committed));
    let r = w.src.report();
    assert_eq!(r.downtime, Some(TimeSpan::from_secs_f64(1.5) + TimeSpan::from_nanos(1_000)));
    assert_eq!(r.finished_at, Some(w.now));
    assert!(r.pause_requested_at.unwrap() < paused);
}

#[test]
fn disconnect_before_commit_aborts_and_source_keeps_the_request() {
    type Stop = fn(&World) -> bool;
    let cases: &[(&str, Stop, MigrationPhase)] = &[
        ("before the Prepare arrives", |w| w.src.phase() == MigrationPhase::Preparing, MigrationPhase::Preparing),
        ("while the target reserves", |w| w.reserve_pending, MigrationPhase::Preparing),
        ("during live stage 0", |w| w.blocks_sent_pending == Some(0), MigrationPhase::LiveCopy),
        ("waiting for StageAck 0", |w| w.src.phase() == MigrationPhase::StageAck, MigrationPhase::StageAck),
        ("during live stage 1", |w| w.blocks_sent_pending == Some(1), MigrationPhase::LiveCopy),
        ("while pausing", |w| w.pause_asked && !w.frozen, MigrationPhase::Pausing),
        ("during stop-and-copy", |w| w.src.phase() == MigrationPhase::StopAndCopy, MigrationPhase::StopAndCopy),
    ];
    for &(case, stop, phase) in cases {
        let mut cfg = Config::small(64, 2);
        cfg.decode_per_copy = 32; // 8 new blocks per stage: several live stages
        let mut w = World::new(cfg);
        w.start();
        w.run_until(stop);
        assert!(stop(&w), "{case}: never reached");
        assert_eq!(w.src.phase(), phase, "{case}");
        w.disconnect();
        assert_eq!(w.src_outcome(), Some(&Outcome::Aborted(AbortReason::Disconnected)), "{case}");
        if w.tgt.is_some() {
            assert_eq!(w.tgt_outcome(), Some(&Outcome::Aborted(AbortReason::Disconnected)), "{case}");
        }
        assert!(w.src.poll_timeout().is_none());
        w.check_safety();
        // A late answer from the driver changes nothing.
        w.src.on_paused(w.now, w.kv_tokens, request_state(w.kv_tokens));
        w.src.on_blocks_sent(w.now, 0);
        w.pump();
        assert_eq!(w.src_done.len(), 1, "{case}");
    }
}

#[test]
fn disconnect_after_commit_sent_but_not_delivered_is_unknown_and_target_releases() {
    let mut w = World::new(Config::small(30, 1));
    w.start();
    w.run_until(|w| w.src.phase() == MigrationPhase::Committing);
    assert!(w.to_target.iter().any(|f| matches!(body(f), Body::Commit(_))));
    w.disconnect();
    assert_eq!(w.src_outcome(), Some(&Outcome::Unknown(AbortReason::Disconnected)));
    assert_eq!(w.tgt_outcome(), Some(&Outcome::Aborted(AbortReason::Disconnected)));
    assert_eq!(w.releases, 1);
    assert!(w.attached.is_none());
    assert_eq!(w.src.report().downtime, None, "downtime of an in-doubt migration is not known");
    w.check_safety();
}

#[test]
fn lost_commit_reply_leaves_source_unknown_and_target_committed() {
    let mut w = World::new(Config::small(30, 1));
    w.start();
    w.run_until(|w| w.to_source.iter().any(|f| matches!(body(f), Body::CommitReply(r) if r.ok)));
    w.disconnect();
    assert_eq!(w.tgt_outcome(), Some(&Outcome::Committed));
    // The source must not free its copy (it did not see the reply) nor resume it: in doubt.
    assert_eq!(w.src_outcome(), Some(&Outcome::Unknown(AbortReason::Disconnected)));
    w.check_safety();
}

#[test]
fn disconnect_while_attaching_still_commits_on_the_target() {
    let mut w = World::new(Config::small(30, 1));
    w.start();
    w.run_until(|w| w.attach_pending.is_some());
    assert_eq!(w.tgt.as_ref().unwrap().phase(), MigrationPhase::Attaching);
    assert_eq!(w.tgt.as_ref().unwrap().poll_timeout(), None);
    w.disconnect();
    assert!(w.tgt_done.is_empty(), "the commit point has passed: the disconnect must not abort");
    w.apply(Ev::AttachDone, 0);
    assert_eq!(w.tgt_outcome(), Some(&Outcome::Committed));
    assert!(matches!(w.src_outcome(), Some(Outcome::Unknown(AbortReason::Disconnected))));
    w.check_safety();
}

#[test]
fn abort_received_while_attaching_is_ignored() {
    let mut w = World::new(Config::small(30, 1));
    w.start();
    w.run_until(|w| w.attach_pending.is_some());
    let abort = abort_frame(MigrationId(1), &AbortReason::Cancelled("late".into()));
    w.tgt.as_mut().unwrap().on_frame(w.now, abort);
    w.pump();
    assert!(w.tgt_done.is_empty());
    w.drain();
    assert_eq!(w.tgt_outcome(), Some(&Outcome::Committed));
    assert_eq!(w.src_outcome(), Some(&Outcome::Committed));
    w.check_safety();
}

/// Flips one byte of the first queued BlockData of `stage`; returns its index.
fn corrupt_queued_block(w: &mut World, stage: u32) -> u32 {
    for q in &mut w.data {
        for f in q.iter_mut() {
            if let Some(Body::BlockData(b)) = f.body.as_mut() {
                if b.stage == stage {
                    let mut data = b.data.to_vec();
                    data[17] ^= 0x40;
                    b.data = Bytes::from(data);
                    return b.index;
                }
            }
        }
    }
    panic!("no queued block of stage {stage}");
}

#[test]
fn corrupted_block_is_detected_and_aborts_both_sides() {
    // Verified by the machine, or by the target's writer as the block lands.
    for (stage, kv, verify_on_write) in [(0u32, 64u32, false), (1, 64, false), (0, 64, true), (1, 64, true)] {
        let mut cfg = Config::small(kv, 3);
        cfg.verify_on_write = verify_on_write;
        cfg.decode_per_copy = 1; // the final stage (stage 1) carries one partial block
        let mut w = World::new(cfg);
        w.start();
        w.run_until(|w| w.data.iter().flatten().any(|f| matches!(body(f), Body::BlockData(b) if b.stage == stage)));
        let block = corrupt_queued_block(&mut w, stage);
        w.drain();
        assert_eq!(w.tgt_outcome(), Some(&Outcome::Aborted(AbortReason::ChecksumMismatch { block })));
        let Some(Outcome::Aborted(AbortReason::PeerAborted { kind, message })) = w.src_outcome() else {
            panic!("source: {:?}", w.src_outcome())
        };
        assert_eq!(*kind, AbortKind::ChecksumMismatch);
        assert!(message.contains(&format!("block {block}")), "{message}");
        assert!(w.tgt_sent.iter().any(|f| is_abort(f, AbortKind::ChecksumMismatch)));
        assert_eq!(w.releases, 1);
        assert!(w.attached.is_none());
        w.check_safety();
    }
}

/// A block received apart from its frame, in pieces: verified over the pieces (a flipped byte in
/// any piece is a checksum mismatch), and a payload that comes twice or beside a frame without a
/// data field is a bad frame.
#[test]
fn a_block_received_in_pieces_is_verified_and_misuse_is_a_bad_frame() {
    #[derive(Clone, Copy, Debug)]
    enum Case {
        Flip(usize),
        Twice,
        BesideStageEnd,
    }
    for case in [Case::Flip(0), Case::Flip(100), Case::Flip(255), Case::Twice, Case::BesideStageEnd] {
        let mut w = World::new(Config::small(64, 1));
        w.start();
        w.run_until(|w| !w.data[0].is_empty());
        let mut f = w.data[0].pop_front().unwrap();
        let Some(Body::BlockData(b)) = &mut f.body else { panic!() };
        let index = b.index;
        let data = b.data.clone();
        let pieces = |flip: Option<usize>| -> crate::Payload {
            let mut bytes = data.to_vec();
            if let Some(at) = flip {
                bytes[at] ^= 1;
            }
            let bytes = Bytes::from(bytes);
            [bytes.slice(..7), bytes.slice(7..130), bytes.slice(130..)].into_iter().collect()
        };
        let (frame, payload) = match case {
            Case::Flip(at) => {
                b.data = Bytes::new();
                (f, pieces(Some(at)))
            }
            Case::Twice => (f, pieces(None)),
            Case::BesideStageEnd => {
                let end =
                    Frame { body: Some(Body::StageEnd(wire::StageEnd { migration_id: 1, ..Default::default() })) };
                (end, pieces(None))
            }
        };
        let now = w.now;
        w.tgt.as_mut().unwrap().on_frame_with_payload(now, frame, Some(payload));
        w.drain();
        match (case, w.tgt_outcome()) {
            (Case::Flip(_), Some(Outcome::Aborted(AbortReason::ChecksumMismatch { block }))) => {
                assert_eq!(*block, index)
            }
            (Case::Twice, Some(Outcome::Aborted(AbortReason::BadFrame(m)))) => assert!(m.contains("twice"), "{m}"),
            (Case::BesideStageEnd, Some(Outcome::Aborted(AbortReason::BadFrame(m)))) => {
                assert!(m.contains("beside StageEnd"), "{m}")
            }
            (case, other) => panic!("{case:?}: {other:?}"),
        }
        assert!(w.attached.is_none());
        w.check_safety();
    }
}

#[test]
fn wrong_length_block_is_a_bad_frame() {
    let mut w = World::new(Config::small(64, 1));
    w.start();
    w.run_until(|w| !w.data[0].is_empty());
    let f = w.data[0].pop_front().unwrap();
    let Some(Body::BlockData(b)) = f.body else { panic!() };
    let short = b.data.slice(..100);
    w.data[0].push_front(block_frame(MigrationId(1), b.stage, b.index, b.tokens, short));
    w.drain();
    assert!(matches!(w.tgt_outcome(), Some(Outcome::Aborted(AbortReason::BadFrame(m))) if m.contains("100 bytes")));
    assert!(matches!(
        w.src_outcome(),
        Some(Outcome::Aborted(AbortReason::PeerAborted { kind: AbortKind::BadFrame, .. }))
    ));
    w.check_safety();
}

#[test]
fn target_refuses_reservation() {
    let mut w = World::new(Config::small(64, 2));
    w.reserve_result = Err(AbortReason::TargetOutOfMemory("need 16 blocks, 3 free".into()));
    w.start();
    w.drain();
    assert_eq!(
        w.tgt_outcome(),
        Some(&Outcome::Aborted(AbortReason::TargetOutOfMemory("need 16 blocks, 3 free".into())))
    );
    let Some(Outcome::Aborted(AbortReason::Refused(reason))) = w.src_outcome() else {
        panic!("source: {:?}", w.src_outcome())
    };
    assert!(reason.contains("out of memory"), "{reason}");
    assert!(matches!(body(&w.tgt_sent[0]), Body::PrepareReply(r) if !r.ok));
    assert!(w.src.report().stages.is_empty(), "no block may be sent after a refusal");
    assert_eq!((w.reserves, w.releases), (1, 0), "nothing was reserved, so nothing to release");
    assert!(!w.src_sent.iter().any(|f| matches!(body(f), Body::Abort(_))));
    w.check_safety();
}

#[test]
fn target_refuses_a_different_block_geometry() {
    let src_params = MigrationParams::new(16, 4096);
    let mut src = SourceMachine::new(MigrationId(5), RequestId(1), src_params, Timestamp(0), 100).unwrap();
    src.start(Timestamp(0));
    let Some(SourceAction::Send(prepare)) = src.poll_action() else { panic!() };
    let mut tgt = TargetMachine::accept(Timestamp(1), &MigrationParams::new(32, 4096), prepare).unwrap();
    let Some(TargetAction::Send(reply)) = tgt.poll_action() else { panic!() };
    let Some(TargetAction::Done(Outcome::Aborted(AbortReason::Refused(m)))) = tgt.poll_action() else { panic!() };
    assert!(m.contains("block_size"), "{m}");
    assert_eq!(tgt.poll_action(), None);
    src.on_frame(Timestamp(2), reply);
    assert!(matches!(src.poll_action(), Some(SourceAction::Done(Outcome::Aborted(AbortReason::Refused(_))))));
}

#[test]
fn source_times_out_waiting_for_the_prepare_reply() {
    let mut w = World::new(Config::small(64, 1));
    w.start();
    let deadline = w.src.poll_timeout().expect("armed after start");
    assert_eq!(deadline, Timestamp(0) + w.cfg.params.timeout);
    w.to_target.clear(); // the Prepare is lost
    w.src.on_timeout(Timestamp(deadline.0 - 1));
    w.pump();
    assert!(w.src_done.is_empty(), "an early timeout call does nothing");
    w.src.on_timeout(deadline);
    w.pump();
    assert_eq!(w.src_outcome(), Some(&Outcome::Aborted(AbortReason::Timeout { phase: MigrationPhase::Preparing })));
    assert!(w.src_sent.last().is_some_and(|f| is_abort(f, AbortKind::Timeout)));
    w.check_safety();
}

#[test]
fn lost_block_times_out_the_stage_and_both_sides_abort() {
    let mut w = World::new(Config::small(64, 2));
    w.start();
    w.run_until(|w| w.data[1].len() >= 2);
    w.data[1].pop_front(); // the transport loses one block of stage 0
    w.drain();
    assert_eq!(w.src_outcome(), Some(&Outcome::Aborted(AbortReason::Timeout { phase: MigrationPhase::StageAck })));
    assert!(matches!(
        w.tgt_outcome(),
        Some(Outcome::Aborted(AbortReason::PeerAborted { kind: AbortKind::Timeout, .. }))
    ));
    assert!(!w.tgt_sent.iter().any(|f| matches!(body(f), Body::StageAck(_))), "stage 0 must not be acked");
    w.check_safety();
}

#[test]
fn source_timeout_after_commit_is_unknown() {
    let mut w = World::new(Config::small(30, 1));
    w.start();
    w.run_until(|w| w.src.phase() == MigrationPhase::Committing);
    // Hold the control stream: the Commit has not reached the target when the deadline passes.
    let held: Vec<Frame> = w.to_target.drain(..).collect();
    w.fire_next_timeout();
    assert_eq!(w.src_outcome(), Some(&Outcome::Unknown(AbortReason::Timeout { phase: MigrationPhase::Committing })));
    assert!(w.src_sent.last().is_some_and(|f| is_abort(f, AbortKind::Timeout)));
    let abort = w.to_target.pop_front().unwrap();
    w.to_target.extend(held);
    w.to_target.push_back(abort);
    w.drain();
    w.check_safety();
}

/// A target fed by hand: `Prepare` for `kv` tokens with 4-token, 8-byte blocks, reserved.
fn manual_target(kv: u32) -> (TargetMachine, MigrationParams) {
    let params = MigrationParams::new(4, 8);
    let prepare = wire::Prepare {
        migration_id: 9,
        request_id: 1,
        kv_tokens: kv,
        block_size: 4,
        block_bytes: 8,
        ..Default::default()
    };
    let mut t = TargetMachine::new(Timestamp(0), &params, prepare);
    assert!(
        matches!(t.poll_action(), Some(TargetAction::Reserve { blocks, .. }) if blocks == blocks_for_tokens(kv, 4))
    );
    t.on_reserved(Timestamp(1), Ok(()));
    assert!(
        matches!(t.poll_action(), Some(TargetAction::Send(f)) if matches!(body(&f), Body::PrepareReply(r) if r.ok))
    );
    (t, params)
}

fn ctrl(b: Body) -> Frame {
    Frame { body: Some(b) }
}

fn drain_target(t: &mut TargetMachine) -> Vec<TargetAction> {
    std::iter::from_fn(|| t.poll_action()).collect()
}

#[test]
fn target_acks_a_stage_only_when_every_block_is_written() {
    let (mut t, _) = manual_target(8);
    // StageEnd overtakes its blocks (other streams).
    t.on_frame(
        Timestamp(2),
        ctrl(Body::StageEnd(wire::StageEnd { migration_id: 9, stage: 0, blocks: 2, final_stage: false })),
    );
    assert!(drain_target(&mut t).is_empty());
    t.on_frame(Timestamp(3), block_frame(MigrationId(9), 0, 1, 4, Bytes::from_static(b"bbbbbbbb")));
    t.on_frame(Timestamp(3), block_frame(MigrationId(9), 0, 0, 4, Bytes::from_static(b"aaaaaaaa")));
    let writes = drain_target(&mut t);
    assert_eq!(writes.len(), 2);
    assert!(writes.iter().all(|a| matches!(a, TargetAction::WriteBlock { .. })));
    t.on_written(Timestamp(4), 0);
    assert!(drain_target(&mut t).is_empty(), "block 1 received but not written: no ack yet");
    t.on_written(Timestamp(5), 1);
    let acts = drain_target(&mut t);
    assert!(matches!(&acts[..], [TargetAction::Send(f)] if matches!(body(f), Body::StageAck(a) if a.stage == 0)));
}

#[test]
fn target_waits_for_final_blocks_after_commit_then_attaches() {
    let (mut t, _) = manual_target(6);
    let id = MigrationId(9);
    t.on_frame(Timestamp(2), block_frame(id, 0, 0, 4, Bytes::from_static(b"aaaaaaaa")));
    t.on_frame(
        Timestamp(2),
        ctrl(Body::StageEnd(wire::StageEnd { migration_id: 9, stage: 0, blocks: 2, final_stage: true })),
    );
    let commit = wire::Commit { migration_id: 9, kv_tokens: 6, blocks_total: 2, state: Bytes::from_static(b"st") };
    t.on_frame(Timestamp(3), ctrl(Body::Commit(commit)));
    t.on_written(Timestamp(4), 0);
    drain_target(&mut t);
    assert_eq!(t.phase(), MigrationPhase::Receiving, "block 1 has not arrived: wait");
    t.on_frame(Timestamp(5), block_frame(id, 0, 1, 2, Bytes::from_static(b"cc......")));
    drain_target(&mut t);
    t.on_written(Timestamp(6), 1);
    let acts = drain_target(&mut t);
    assert_eq!(acts, vec![TargetAction::Attach { state: Bytes::from_static(b"st"), kv_tokens: 6, blocks: 2 }]);
    t.on_attached(Timestamp(7), Ok(()));
    let acts = drain_target(&mut t);
    assert!(matches!(&acts[0], TargetAction::Send(f) if matches!(body(f), Body::CommitReply(r) if r.ok)));
    assert_eq!(acts[1], TargetAction::Done(Outcome::Committed));
    assert_eq!(acts.len(), 2, "no Release after a commit: the blocks now belong to the request");
}

#[test]
fn target_commit_with_a_missing_block_times_out_incomplete() {
    let (mut t, params) = manual_target(6);
    t.on_frame(Timestamp(2), block_frame(MigrationId(9), 0, 0, 4, Bytes::from_static(b"aaaaaaaa")));
    t.on_frame(
        Timestamp(2),
        ctrl(Body::StageEnd(wire::StageEnd { migration_id: 9, stage: 0, blocks: 2, final_stage: true })),
    );
    let commit = wire::Commit { migration_id: 9, kv_tokens: 6, blocks_total: 2, state: Bytes::new() };
    t.on_frame(Timestamp(3), ctrl(Body::Commit(commit)));
    t.on_written(Timestamp(4), 0);
    drain_target(&mut t);
    let deadline = t.poll_timeout().unwrap();
    assert_eq!(deadline, Timestamp(0) + params.timeout);
    t.on_timeout(deadline);
    let acts = drain_target(&mut t);
    assert!(matches!(&acts[0], TargetAction::Send(f) if is_abort(f, AbortKind::Incomplete)));
    assert_eq!(acts[1], TargetAction::Release);
    assert_eq!(acts[2], TargetAction::Done(Outcome::Aborted(AbortReason::Incomplete { missing: 1 })));
}

#[test]
fn target_commit_that_can_never_complete_aborts_at_once() {
    // The final stage is complete (1 block) but Commit claims 3 blocks: nothing else can come.
    let (mut t, _) = manual_target(4);
    t.on_frame(Timestamp(2), block_frame(MigrationId(9), 0, 0, 4, Bytes::from_static(b"aaaaaaaa")));
    t.on_frame(
        Timestamp(2),
        ctrl(Body::StageEnd(wire::StageEnd { migration_id: 9, stage: 0, blocks: 1, final_stage: true })),
    );
    t.on_written(Timestamp(3), 0);
    let commit = wire::Commit { migration_id: 9, kv_tokens: 12, blocks_total: 3, state: Bytes::new() };
    t.on_frame(Timestamp(4), ctrl(Body::Commit(commit)));
    let acts = drain_target(&mut t);
    assert_eq!(acts.last(), Some(&TargetAction::Done(Outcome::Aborted(AbortReason::Incomplete { missing: 2 }))));
    // A Commit whose token count contradicts the blocks' token counts is a bad frame.
    let (mut t, _) = manual_target(4);
    t.on_frame(Timestamp(2), block_frame(MigrationId(9), 0, 0, 4, Bytes::from_static(b"aaaaaaaa")));
    t.on_frame(
        Timestamp(2),
        ctrl(Body::StageEnd(wire::StageEnd { migration_id: 9, stage: 0, blocks: 1, final_stage: true })),
    );
    t.on_written(Timestamp(3), 0);
    let commit = wire::Commit { migration_id: 9, kv_tokens: 3, blocks_total: 1, state: Bytes::new() };
    t.on_frame(Timestamp(4), ctrl(Body::Commit(commit)));
    let acts = drain_target(&mut t);
    let Some(TargetAction::Done(Outcome::Aborted(AbortReason::BadFrame(m)))) = acts.last() else { panic!("{acts:?}") };
    assert!(m.contains("implies 3"), "{m}");
}

#[test]
fn nonsense_frames_abort_with_bad_frame() {
    type Mk = fn() -> Frame;
    let cases: &[(&str, Mk)] = &[
        ("wrong migration id", || block_frame(MigrationId(8), 0, 0, 4, Bytes::from_static(b"aaaaaaaa"))),
        ("wrong stage", || block_frame(MigrationId(9), 1, 0, 4, Bytes::from_static(b"aaaaaaaa"))),
        ("zero tokens", || block_frame(MigrationId(9), 0, 0, 0, Bytes::from_static(b"aaaaaaaa"))),
        ("too many tokens", || block_frame(MigrationId(9), 0, 0, 5, Bytes::from_static(b"aaaaaaaa"))),
        ("second Prepare", || ctrl(Body::Prepare(wire::Prepare { migration_id: 9, ..Default::default() }))),
        ("StageAck to target", || ctrl(Body::StageAck(wire::StageAck { migration_id: 9, stage: 0 }))),
        ("Commit before final StageEnd", || ctrl(Body::Commit(wire::Commit { migration_id: 9, ..Default::default() }))),
        ("StageEnd for a later stage", || {
            ctrl(Body::StageEnd(wire::StageEnd { migration_id: 9, stage: 2, blocks: 0, final_stage: false }))
        }),
        ("empty frame", || Frame { body: None }),
    ];
    for (case, mk) in cases {
        let (mut t, _) = manual_target(8);
        t.on_frame(Timestamp(2), mk());
        let acts = drain_target(&mut t);
        assert!(matches!(&acts[0], TargetAction::Send(f) if is_abort(f, AbortKind::BadFrame)), "{case}: {acts:?}");
        assert_eq!(acts[1], TargetAction::Release, "{case}");
        assert!(matches!(&acts[2], TargetAction::Done(Outcome::Aborted(AbortReason::BadFrame(_)))), "{case}");
        assert_eq!(acts.len(), 3, "{case}");
    }
    // A first frame that is not a Prepare gets an Abort back and no machine.
    let stray = ctrl(Body::StageAck(wire::StageAck { migration_id: 4, stage: 0 }));
    let reply = TargetMachine::accept(Timestamp(0), &MigrationParams::default(), stray).unwrap_err();
    assert!(is_abort(&reply, AbortKind::BadFrame));
    assert_eq!(frame_migration_id(&reply), Some(MigrationId(4)));
    // The source: a StageAck for a stage it is not waiting for.
    let mut w = World::new(Config::small(64, 1));
    w.start();
    w.run_until(|w| w.src.phase() == MigrationPhase::StageAck);
    w.src.on_frame(w.now, ctrl(Body::StageAck(wire::StageAck { migration_id: 1, stage: 5 })));
    w.pump();
    assert!(matches!(w.src_outcome(), Some(Outcome::Aborted(AbortReason::BadFrame(m))) if m.contains("stage 5")));
    w.drain();
    w.check_safety();
}

#[test]
fn cancel_before_commit_aborts_and_after_commit_is_refused() {
    let mut w = World::new(Config::small(64, 2));
    w.start();
    w.run_until(|w| w.src.phase() == MigrationPhase::StageAck);
    assert!(w.src.cancel(w.now, "request finished"));
    w.pump();
    assert_eq!(w.src_outcome(), Some(&Outcome::Aborted(AbortReason::Cancelled("request finished".into()))));
    assert!(!w.src.cancel(w.now, "again"), "cancel after Done");
    w.drain();
    assert!(matches!(
        w.tgt_outcome(),
        Some(Outcome::Aborted(AbortReason::PeerAborted { kind: AbortKind::Cancelled, .. }))
    ));
    w.check_safety();

    let mut w = World::new(Config::small(64, 2));
    w.start();
    w.run_until(|w| w.src.phase() == MigrationPhase::Committing);
    assert!(!w.src.cancel(w.now, "too late"));
    w.drain();
    assert_eq!(w.src_outcome(), Some(&Outcome::Committed));
    w.check_safety();
}

#[test]
fn source_read_failure_aborts() {
    let mut w = World::new(Config::small(64, 2));
    w.start();
    w.run_until(|w| w.blocks_sent_pending.is_some());
    w.src.on_read_failed(w.now, "block 3 evicted");
    w.pump();
    assert_eq!(w.src_outcome(), Some(&Outcome::Aborted(AbortReason::SourceKvUnavailable("block 3 evicted".into()))));
    w.drain();
    assert!(matches!(w.tgt_outcome(), Some(Outcome::Aborted(_))));
    w.check_safety();
}

#[test]
fn target_write_failure_aborts() {
    let mut w = World::new(Config::small(64, 2));
    w.fail_next_write = Some(AbortReason::TargetOutOfMemory("arena full".into()));
    w.start();
    w.drain();
    assert_eq!(w.tgt_outcome(), Some(&Outcome::Aborted(AbortReason::TargetOutOfMemory("arena full".into()))));
    assert!(matches!(
        w.src_outcome(),
        Some(Outcome::Aborted(AbortReason::PeerAborted { kind: AbortKind::TargetOutOfMemory, .. }))
    ));
    w.check_safety();
}

#[test]
fn failed_attach_is_a_clean_abort_not_unknown() {
    let mut w = World::new(Config::small(30, 2));
    w.attach_result = Err(AbortReason::AttachFailed("no sequence slot".into()));
    w.start();
    w.drain();
    assert_eq!(w.tgt_outcome(), Some(&Outcome::Aborted(AbortReason::AttachFailed("no sequence slot".into()))));
    let Some(Outcome::Aborted(AbortReason::AttachFailed(reason))) = w.src_outcome() else {
        panic!("source: {:?}", w.src_outcome())
    };
    assert_eq!(reason, "no sequence slot", "said once: {}", AbortReason::AttachFailed(reason.clone()));
    assert!(w.src.report().downtime.is_some(), "the request resumes on the source: downtime is known");
    w.check_safety();
}

#[test]
fn decode_between_pause_request_and_freeze_is_copied() {
    // The iteration in flight when Pause is asked adds tokens; the final stage must carry them.
    let mut w = World::new(Config::small(31, 2));
    w.decode_while_pausing = 6;
    w.start();
    w.drain();
    assert_eq!(w.src_outcome(), Some(&Outcome::Committed));
    assert_eq!(w.kv_tokens, 37);
    w.check_target_kv_equals_source();
    w.check_safety();
}

#[test]
fn display_names_the_reason() {
    let r = AbortReason::Timeout { phase: MigrationPhase::StageAck };
    assert_eq!(r.to_string(), "timed out while waiting for a stage ack");
    assert_eq!(AbortKind::ChecksumMismatch.to_string(), "ABORT_CODE_CHECKSUM_MISMATCH");
    assert_eq!(AbortKind::from_wire(999), AbortKind::Unspecified);
    for k in [AbortKind::Refused, AbortKind::Incomplete, AbortKind::AttachFailed] {
        assert_eq!(AbortKind::from_wire(k.to_wire() as i32), k);
    }
    let o = Outcome::Unknown(AbortReason::Disconnected);
    assert!(o.to_string().contains("commit sent"));
}

/// Destination-missing copies: the target pins the first k prefix blocks it caches and answers
/// `cached_blocks = k`; the source copies from block k and reports what it skipped; the target
/// counts 0..k as written at COMMIT and refuses any block below k (a pinned block is shared).
#[test]
fn a_target_caching_the_prefix_is_sent_only_what_it_lacks() {
    let params = MigrationParams::new(4, 8);
    let prefix: Vec<kvfleet_core::kv::BlockHash> = vec![11, 12 << 64 | 5, 13];
    let start = |cached: u32| {
        let mut src = SourceMachine::new(MigrationId(9), RequestId(1), params.clone(), Timestamp(0), 20)
            .unwrap()
            .with_prefix(prefix.clone());
        src.start(Timestamp(0));
        let Some(SourceAction::Send(prepare)) = src.poll_action() else { panic!() };
        let mut tgt = TargetMachine::accept(Timestamp(1), &params, prepare).unwrap();
        let Some(TargetAction::Reserve { prefix: asked, .. }) = tgt.poll_action() else { panic!() };
        assert_eq!(asked, prefix, "the hashes travel in Prepare");
        tgt.on_reserved_prefix(Timestamp(1), Ok(cached));
        let Some(TargetAction::Send(reply)) = tgt.poll_action() else { panic!() };
        src.on_frame(Timestamp(2), reply);
        (src, tgt)
    };
    let (mut src, mut tgt) = start(2);
    // Three blocks to go: below the stop-and-copy threshold, the source pauses at once.
    assert_eq!(src.poll_action(), Some(SourceAction::Pause));
    src.on_paused(Timestamp(2), 20, Bytes::from_static(b"st"));
    let Some(SourceAction::CopyBlocks { blocks, .. }) = src.poll_action() else { panic!() };
    assert_eq!(blocks, 2..5, "blocks 0 and 1 are the target's already");
    assert_eq!((src.report().skipped_blocks, src.report().bytes_skipped), (2, 16));
    assert_eq!(tgt.report().blocks_cached, 2);
    // Stage 0 carries blocks 2..5; the request pauses with 20 tokens: nothing left to copy.
    let id = MigrationId(9);
    for index in 2..5 {
        tgt.on_frame(Timestamp(3), block_frame(id, 0, index, 4, Bytes::from_static(b"abcdefgh")));
    }
    let end = wire::StageEnd { migration_id: 9, stage: 0, blocks: 3, final_stage: true };
    tgt.on_frame(Timestamp(3), ctrl(Body::StageEnd(end)));
    let commit = wire::Commit { migration_id: 9, kv_tokens: 20, blocks_total: 5, state: Bytes::from_static(b"st") };
    tgt.on_frame(Timestamp(3), ctrl(Body::Commit(commit)));
    for index in 2..5 {
        tgt.on_written(Timestamp(4), index);
    }
    let acts = drain_target(&mut tgt);
    assert!(
        acts.iter().any(|a| matches!(a, TargetAction::Attach { kv_tokens: 20, blocks: 5, .. })),
        "pinned and received blocks make the whole request: {acts:?}"
    );
    // A block the target pinned must never arrive.
    let (_, mut tgt) = start(2);
    tgt.on_frame(Timestamp(3), block_frame(id, 0, 1, 4, Bytes::from_static(b"abcdefgh")));
    let acts = drain_target(&mut tgt);
    assert!(
        acts.iter().any(
            |a| matches!(a, TargetAction::Done(Outcome::Aborted(AbortReason::BadFrame(m))) if m.contains("cached here"))
        ),
        "{acts:?}"
    );
    // A reply claiming more cached blocks than the prefix has is a bad frame.
    let (mut src, _) = start(4);
    let acts: Vec<_> = std::iter::from_fn(|| src.poll_action()).collect();
    assert!(
        acts.iter().any(|a| matches!(a, SourceAction::Done(Outcome::Aborted(AbortReason::BadFrame(_))))),
        "{acts:?}"
    );
}

/// Runs in order every enabled event but decoding, layer progress and the freeze (the prefill's end, which the
/// test chooses), until none is left.
fn advance_prefill(w: &mut World) {
    while let Some(ev) = w.enabled().into_iter().find(|e| !matches!(e, Ev::Decode | Ev::Freeze | Ev::Layer)) {
        w.apply(ev, 0);
    }
}

/// The prefill writes KV up to `kv` tokens (a chunk ended on the source).
fn prefill_writes(w: &mut World, kv: u32) {
    w.kv_tokens = kv;
    w.src.on_kv_progress(w.now, kv);
    w.pump();
}

/// A migration that follows a prefill (an overlapped handoff): the target reserves the KV the
/// prefill will end with at once; `Pause` is asked at the start and means the prefill's end;
/// each chunk's full blocks leave in a live stage of their own as the prefill writes them, with
/// the source waiting for KV in between; the prefill ending during a live stage starts the final
/// stage (the rest, partial block included) after that stage's ack; the target ends up with
/// exactly the source's KV.
#[test]
fn a_migration_following_a_prefill_copies_each_chunk_as_it_is_written() {
    let mut w = World::new(Config::small(8, 2));
    w.src = w.src.clone().following_prefill(30);
    w.start();
    let Body::Prepare(p) = body(&w.src_sent[0]) else { panic!("first frame must be Prepare") };
    assert_eq!((p.kv_tokens, p.expected_kv_tokens), (8, 30));
    advance_prefill(&mut w);
    assert!(w.pause_asked, "the pause is asked up front");
    assert_eq!(w.src.awaiting_kv(), Some(8), "both full blocks of the first chunk went");
    assert_eq!(w.src.phase(), MigrationPhase::FollowingPrefill);
    assert_eq!(stage_blocks(&w), [2]);
    prefill_writes(&mut w, 16);
    advance_prefill(&mut w);
    assert_eq!((stage_blocks(&w), w.src.awaiting_kv()), (vec![2, 2], Some(16)));
    // The third chunk's stage is on its way when the prefill ends (its last 6 tokens written).
    prefill_writes(&mut w, 24);
    assert!(w.blocks_sent_pending.is_some());
    w.kv_tokens = 30;
    w.apply(Ev::Freeze, 0);
    assert!(!w.finished());
    w.drain();
    assert_eq!(w.src_outcome(), Some(&Outcome::Committed));
    assert_eq!(w.tgt_outcome(), Some(&Outcome::Committed));
    w.check_safety();
    w.check_target_kv_equals_source();
    assert_eq!(stage_blocks(&w), [2, 2, 2, 2], "blocks 6..8 (one partial) in the final stage");
    let r = w.src.report();
    assert!(r.stages[3].final_stage && r.stages[..3].iter().all(|s| !s.final_stage));
    assert_eq!(r.kv_tokens_final, Some(30));
    assert!(r.paused_at.unwrap() < r.stages[3].started, "the final stage waited for the third's ack");
    assert_eq!(r.bytes, 8 * 256);
}

/// Following a prefill, its end while every full block has already left (the KV ends on a block
/// boundary) commits at once with an empty final stage; a target told the expected KV reserves
/// all of it.
#[test]
fn a_prefill_ending_with_every_block_sent_commits_at_once() {
    let mut w = World::new(Config::small(8, 1));
    w.src = w.src.clone().following_prefill(16);
    w.start();
    advance_prefill(&mut w);
    prefill_writes(&mut w, 16);
    advance_prefill(&mut w);
    assert_eq!(w.src.awaiting_kv(), Some(16));
    w.apply(Ev::Freeze, 0);
    w.drain();
    assert_eq!(w.src_outcome(), Some(&Outcome::Committed));
    w.check_target_kv_equals_source();
    assert_eq!(stage_blocks(&w), [2, 2, 0]);

    let params = MigrationParams::new(4, 8);
    let prepare = wire::Prepare {
        migration_id: 9,
        request_id: 1,
        kv_tokens: 8,
        block_size: 4,
        block_bytes: 8,
        expected_kv_tokens: 30,
        ..Default::default()
    };
    let mut t = TargetMachine::new(Timestamp(0), &params, prepare);
    assert!(matches!(t.poll_action(), Some(TargetAction::Reserve { kv_tokens: 30, blocks: 8, .. })));
}

/// Following a one-iteration prefill in 4 layer groups: each group of the blocks the iteration
/// fills leaves in a live stage of its own once computed (a quarter of each block), and the final
/// stage at the prefill's end carries only the last group of those blocks and the partial last
/// block whole; the target counts a block once all its groups are written and ends up with the
/// source's KV byte for byte.
#[test]
fn a_prefill_followed_in_layer_groups_leaves_its_last_group_for_the_end() {
    let mut w = World::new(Config::small(0, 2));
    w.src = w.src.clone().following_prefill(18).in_layer_groups(4);
    w.layers = Some((18, 4));
    w.start();
    let Body::Prepare(p) = body(&w.src_sent[0]) else { panic!("first frame must be Prepare") };
    assert_eq!((p.expected_kv_tokens, p.layer_groups), (18, 4));
    advance_prefill(&mut w);
    assert_eq!(w.src.awaiting_layers(), Some((0, 0)), "nothing computed yet");
    for done in 1..=3 {
        w.apply(Ev::Layer, 0);
        advance_prefill(&mut w);
        assert_eq!(w.src.awaiting_layers(), Some((18, done)), "group {done} of the 4 full blocks left");
        assert_eq!(w.tgt.as_ref().unwrap().report().blocks_written, 0, "no block whole yet");
    }
    assert_eq!(stage_blocks(&w), [4, 4, 4]);
    w.apply(Ev::Layer, 0); // the 4th group: its blocks leave whole now, or with the final stage
    w.apply(Ev::Layer, 0); // the iteration ends: 18 tokens
    assert_eq!(w.kv_tokens, 18);
    advance_prefill(&mut w);
    w.apply(Ev::Freeze, 0);
    w.drain();
    assert_eq!(w.src_outcome(), Some(&Outcome::Committed));
    w.check_safety();
    w.check_target_kv_equals_source();
    let r = w.src.report();
    assert_eq!(r.bytes, 5 * 256, "every byte once");
    let last: Vec<u64> = r.stages.iter().skip(3).map(|s| s.bytes).collect();
    assert_eq!(last.iter().sum::<u64>(), 4 * 64 + 256, "after the third group: a quarter of 4 blocks, 1 block");
    assert_eq!(w.tgt.as_ref().unwrap().report().blocks_written, 5);
}

/// Slices a target must refuse: groups out of range or empty, a length that is not the groups'
/// bytes, more than 64 groups; and a block missing a group at the commit is incomplete.
#[test]
fn a_target_refuses_bad_slices_and_counts_a_block_only_once_every_group_came() {
    let params = MigrationParams::new(4, 256);
    let prepare = |groups: u32| wire::Prepare {
        migration_id: 9,
        request_id: 1,
        kv_tokens: 8,
        block_size: 4,
        block_bytes: 256,
        layer_groups: groups,
        ..Default::default()
    };
    let accepted = || {
        let mut t = TargetMachine::new(Timestamp(0), &params, prepare(4));
        t.on_reserved(Timestamp(0), Ok(()));
        std::iter::from_fn(|| t.poll_action()).for_each(drop);
        t
    };
    let slice = |index: u32, groups: std::ops::Range<u32>, len: usize| {
        let data = Bytes::from(vec![1u8; len]);
        let head = slice_frame_head(MigrationId(9), 0, index, 4, groups, &data);
        Frame { body: Some(Body::BlockData(wire::BlockData { data, ..head })) }
    };
    for (groups, len, why) in
        [(2..5, 192, "layer groups 2..5 of 4"), (3..3, 0, "layer groups 3..3"), (0..2, 64, "64 bytes, expected 128")]
    {
        let mut t = accepted();
        t.on_frame(Timestamp(1), slice(0, groups, len));
        let acts: Vec<_> = std::iter::from_fn(|| t.poll_action()).collect();
        assert!(
            acts.iter().any(
                |a| matches!(a, TargetAction::Done(Outcome::Aborted(AbortReason::BadFrame(m))) if m.contains(why))
            ),
            "{why}: {acts:?}"
        );
    }
    let mut t = TargetMachine::new(Timestamp(0), &params, prepare(65));
    assert!(matches!(t.poll_action(), Some(TargetAction::Send(_))), "refused at once");
    assert!(matches!(t.outcome(), Some(Outcome::Aborted(AbortReason::Refused(m))) if m.contains("65 layer groups")));

    // Groups 0..3 of block 0 and block 1 whole: block 0 is not written, the commit incomplete.
    let mut t = accepted();
    let whole = |index: u32| {
        let data = Bytes::from(vec![2u8; 256]);
        block_frame(MigrationId(9), 0, index, 4, data)
    };
    for f in [slice(0, 0..1, 64), slice(0, 1..3, 128), whole(1)] {
        t.on_frame(Timestamp(1), f);
    }
    let writes: Vec<_> = std::iter::from_fn(|| t.poll_action()).collect();
    let offsets: Vec<u64> = writes
        .iter()
        .filter_map(|a| if let TargetAction::WriteBlock { offset, .. } = a { Some(*offset) } else { None })
        .collect();
    assert_eq!(offsets, [0, 64, 0]);
    for i in [0, 0, 1] {
        t.on_written(Timestamp(2), i);
    }
    assert_eq!(t.report().blocks_written, 1, "block 0 lacks its last group");
    t.on_frame(
        Timestamp(3),
        frame(Body::StageEnd(wire::StageEnd { migration_id: 9, stage: 0, blocks: 3, final_stage: true })),
    );
    t.on_frame(
        Timestamp(3),
        frame(Body::Commit(wire::Commit { migration_id: 9, kv_tokens: 8, blocks_total: 2, state: Bytes::new() })),
    );
    let acts: Vec<_> = std::iter::from_fn(|| t.poll_action()).collect();
    assert!(
        acts.iter().any(|a| matches!(a, TargetAction::Done(Outcome::Aborted(AbortReason::Incomplete { missing: 1 })))),
        "{acts:?}"
    );
}
