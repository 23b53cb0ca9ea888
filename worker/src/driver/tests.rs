//! The driver in-process: a fast fixed-timing engine on a tiny arena, commands over the channel,
//! results read from the event log. Checks the arena stays in step with the engine through
//! offloads, reloads, recomputes and migrations (every move verified with `verify_kv`).

use super::*;
use crate::arena::{ArenaLayout, KvFill};
use crate::ledger::Refusal;
use kvfleet_core::engine::sched::{build_scheduler, SchedulerParams};
use kvfleet_core::engine::EngineConfig;
use kvfleet_core::kv::KvEvent;
use kvfleet_core::timing::FixedTiming;
use kvfleet_core::{InstanceId, TimeSpan};
use kvfleet_netmodel::migration::{MigrationId, MoveOrder};
use std::collections::BTreeMap;
use std::sync::mpsc::{channel, Sender};

struct Running {
    /// The driver's cluster clock.
    clock: ClusterClock,
    tx: Sender<Command>,
    log: Arc<EventLog>,
    thread: Option<std::thread::JoinHandle<DriverReport>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Shutdown { grace: Duration::ZERO });
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn start(instance: u32, scheduler: &str, gpu_blocks: u32, cpu_blocks: u32) -> Running {
    start_full(instance, scheduler, gpu_blocks, cpu_blocks, Duration::from_secs(3600), false, SUBMIT_GRACE)
}

fn start_with_announce(instance: u32, announce_every: Duration) -> Running {
    start_full(instance, "fcfs", 32, 8, announce_every, false, SUBMIT_GRACE)
}

fn start_caching(instance: u32) -> Running {
    start_full(instance, "fcfs", 48, 8, Duration::from_secs(3600), true, SUBMIT_GRACE)
}

fn start_full(
    instance: u32,
    scheduler: &str,
    gpu_blocks: u32,
    cpu_blocks: u32,
    announce_every: Duration,
    prefix_caching: bool,
    submit_grace: Duration,
) -> Running {
    let timing = (1.0, None, 1);
    start_timed(instance, scheduler, (gpu_blocks, cpu_blocks), announce_every, prefix_caching, submit_grace, timing)
}

/// [`start_full`] with every iteration taking `iteration_ms`, prompts prefilled in chunks of
/// `chunk` tokens (`None`: whole).
fn start_timed(
    instance: u32,
    scheduler: &str,
    (gpu_blocks, cpu_blocks): (u32, u32),
    announce_every: Duration,
    prefix_caching: bool,
    submit_grace: Duration,
    (iteration_ms, chunk, layer_groups): (f64, Option<u32>, u32),
) -> Running {
    let cfg = EngineConfig {
        prefix_caching,
        block_size: 4,
        gpu_blocks,
        cpu_blocks,
        max_num_seqs: 16,
        max_batched_tokens: 256,
        kv_bytes_per_token: 96,
        tpot: TimeSpan::from_millis_f64(5.0),
    };
    let timing = Arc::new(FixedTiming {
        iteration: TimeSpan::from_millis_f64(iteration_ms),
        transfer: TimeSpan::from_millis_f64(0.2),
    });
    let params = SchedulerParams { quantum_tokens: 3, chunked_prefill_tokens: chunk, ..SchedulerParams::default() };
    let engine = Engine::new(InstanceId(instance), cfg.clone(), timing, build_scheduler(scheduler, &params).unwrap());
    let layout = ArenaLayout { block_size: 4, kv_bytes_per_token: 96, gpu_blocks, cpu_blocks };
    let arena = KvArena::new(layout, KvFill::Full, false).unwrap();
    let log = Arc::new(EventLog::new(1 << 20));
    let clock = ClusterClock::new(None, kvfleet_core::Dilation::NONE).unwrap();
    let driver = Driver::new(DriverConfig {
        engine,
        arena,
        clock,
        log: log.clone(),
        load_interval: Duration::from_millis(20),
        verify_kv: true,
        // Periodic announcements as the test asks (an hour: only SetRole and aborted moves).
        announce_every,
        submit_grace,
        layer_groups,
    });
    let (tx, rx) = channel();
    let thread = std::thread::spawn(move || driver.run(rx));
    Running { clock, tx, log, thread: Some(thread) }
}

fn ask<T>(r: &Running, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> T {
    let (tx, rx) = oneshot::channel();
    r.tx.send(make(tx)).unwrap();
    rx.blocking_recv().unwrap()
}

fn spec(id: u64, prompt: u32, reasoning: u32, answer: u32) -> RequestSpec {
    RequestSpec {
        content_ids: Vec::new(),
        id: RequestId(id),
        arrival: Timestamp(0),
        prompt_tokens: prompt,
        reasoning_tokens: reasoning,
        answer_tokens: answer,
    }
}

/// Everything in the log so far, by kind.
#[derive(Default, Debug)]
struct Seen {
    tokens: BTreeMap<u64, Vec<(u32, i32, u64)>>,
    boundaries: BTreeMap<u64, u64>,
    finished: BTreeMap<u64, v1::RequestRecord>,
    loads: usize,
    prefill_done: Vec<u64>,
    prefill_started: Vec<u64>,
    kv_events: Vec<KvEvent>,
}

fn collect(log: &EventLog) -> Seen {
    let mut out = Vec::new();
    log.read_after(0, usize::MAX, &mut out);
    let mut s = Seen::default();
    for e in out {
        match e.event.unwrap() {
            v1::worker_event::Event::Tokens(t) => {
                s.tokens.entry(t.request_id).or_default().push((t.first_index, t.phase, t.at_ns))
            }
            v1::worker_event::Event::Boundary(b) => {
                s.boundaries.insert(b.request_id, b.at_ns);
            }
            v1::worker_event::Event::Finished(r) => {
                s.finished.insert(r.id, r);
            }
            v1::worker_event::Event::Load(_) => s.loads += 1,
            v1::worker_event::Event::PrefillDone(p) => s.prefill_done.push(p.request_id),
            v1::worker_event::Event::PrefillStarted(p) => s.prefill_started.push(p.request_id),
            v1::worker_event::Event::KvEvents(k) => s.kv_events.extend(kvfleet_proto::kv_events_from_proto(&k)),
        }
    }
    s
}

fn wait_for(log: &EventLog, what: &str, cond: impl Fn(&Seen) -> bool) -> Seen {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = collect(log);
        if cond(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}: {s:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn check_request(s: &Seen, id: u64, reasoning: u32, answer: u32) {
    let toks = &s.tokens[&id];
    let idx: Vec<u32> = toks.iter().map(|t| t.0).collect();
    assert_eq!(idx, (0..reasoning + answer).collect::<Vec<_>>(), "req {id}: every token once, in order");
    for &(i, phase, _) in toks {
        let want = if i < reasoning { v1::Phase::Reasoning } else { v1::Phase::Answering };
        assert_eq!(phase, want as i32, "req {id} token {i}");
    }
    assert!(toks.windows(2).all(|w| w[0].2 < w[1].2), "req {id}: token times increase");
    let r = &s.finished[&id];
    assert_eq!(r.finish_ns, Some(toks.last().unwrap().2));
    if reasoning > 0 {
        assert_eq!(s.boundaries[&id], toks[reasoning as usize - 1].2, "req {id}: boundary at the last reasoning token");
    }
}

/// (scheduler, GPU blocks, CPU blocks): memory pressure with offload, and with recompute.
#[test]
fn arena_follows_the_engine_under_memory_pressure() {
    for (scheduler, gpu, cpu) in [("rr", 14, 16), ("pascal", 14, 16), ("rr", 14, 0), ("fcfs", 10, 4)] {
        let r = start(0, scheduler, gpu, cpu);
        for id in 1..=6 {
            assert_eq!(ask(&r, |reply| Command::Submit { spec: spec(id, 5, 6, 4), reply }), SubmitOutcome::Accepted);
        }
        // Check the whole arena against the engine between iterations until everything is done.
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut checked = 0;
        while collect(&r.log).finished.len() < 6 {
            checked += ask(&r, |reply| Command::VerifyAll { reply })
                .unwrap_or_else(|e| panic!("{scheduler}/{gpu}/{cpu}: {e}"));
            assert!(Instant::now() < deadline, "timed out");
            std::thread::sleep(Duration::from_micros(300));
        }
        assert!(checked > 0);
        let s = collect(&r.log);
        for id in 1..=6 {
            check_request(&s, id, 6, 4);
        }
        let stats = ask(&r, |reply| Command::Stats { reply });
        assert_eq!(stats.kv.errors, 0, "{scheduler}/{gpu}/{cpu}: {stats:?}");
        assert!(stats.engine.preemptions > 0, "{scheduler}/{gpu}/{cpu}: the setup must preempt");
        if cpu > 0 {
            assert!(
                stats.kv.blocks_copied > 0 && stats.kv.tokens_verified > 0,
                "{scheduler}: offloads mirrored and verified: {stats:?}"
            );
        }
        assert!(stats.lateness.samples > 0);
        assert!(s.loads > 0, "load reports are logged");
    }
}

#[test]
fn submits_are_idempotent_and_oversized_requests_rejected_with_a_record() {
    let r = start(0, "fcfs", 8, 0);
    assert_eq!(ask(&r, |reply| Command::Submit { spec: spec(1, 4, 2, 2), reply }), SubmitOutcome::Accepted);
    assert_eq!(ask(&r, |reply| Command::Submit { spec: spec(1, 4, 2, 2), reply }), SubmitOutcome::Duplicate);
    // 8 blocks × 4 tokens = 32 < 40.
    let SubmitOutcome::Rejected(reason) = ask(&r, |reply| Command::Submit { spec: spec(2, 30, 5, 5), reply }) else {
        panic!()
    };
    assert!(reason.contains("KV blocks"), "{reason}");
    assert!(matches!(ask(&r, |reply| Command::Submit { spec: spec(2, 30, 5, 5), reply }), SubmitOutcome::Rejected(_)));
    let s = wait_for(&r.log, "both records", |s| s.finished.len() == 2);
    assert!(s.finished[&2].rejected && !s.finished[&1].rejected);
    assert!(!s.tokens.contains_key(&2));
    check_request(&s, 1, 2, 2);
    assert_eq!(ask(&r, |reply| Command::Drain { reply }), 0);
    assert!(
        matches!(ask(&r, |reply| Command::Submit { spec: spec(3, 4, 2, 2), reply }), SubmitOutcome::Rejected(m) if m.contains("draining"))
    );
}

#[test]
fn migrate_out_and_attach_move_a_request_between_drivers() {
    let a = start(0, "pascal", 32, 8);
    let b = start(1, "pascal", 32, 8);
    ask(&a, |reply| Command::Submit { spec: spec(7, 9, 40, 10), reply });
    wait_for(&a.log, "a few tokens on A", |s| s.tokens.get(&7).is_some_and(|t| t.len() >= 5));
    let out = ask(&a, |reply| Command::MigrateOut { request: RequestId(7), reply }).unwrap();
    let m: MigratedRequest = serde_json::from_slice(&out.state).unwrap();
    assert_eq!(out.kv_tokens, m.kv_tokens());
    assert_eq!(out.kv_bytes, out.kv_tokens as u64 * 96);
    let stats = ask(&a, |reply| Command::Stats { reply });
    assert!(stats.kv.tokens_verified >= out.kv_tokens as u64 - 1, "migrating out verifies the KV: {stats:?}");
    assert!(matches!(
        ask(&a, |reply| Command::MigrateOut { request: RequestId(7), reply }),
        Err(DriverError::Unknown(_))
    ));
    let generated = m.generated;
    ask(&b, |reply| Command::Attach { state: Box::new(m.clone()), rematerialized: true, reply }).unwrap();
    ask(&b, |reply| Command::Attach { state: Box::new(m), rematerialized: true, reply }).unwrap(); // retried: no-op
    let s = wait_for(&b.log, "the record on B", |s| s.finished.contains_key(&7));
    let r = &s.finished[&7];
    assert_eq!((r.migrations, r.kv_rematerialized, r.placed_on, r.finished_on), (1, true, 0, Some(1)));
    let on_b: Vec<u32> = s.tokens[&7].iter().map(|t| t.0).collect();
    assert_eq!(on_b, (generated..50).collect::<Vec<_>>(), "B continues where A stopped");
    let on_a = collect(&a.log).tokens[&7].len() as u32;
    assert_eq!(on_a, generated, "A emitted exactly the tokens before the move");
    assert_eq!(ask(&b, |reply| Command::Stats { reply }).kv.errors, 0);
}

#[test]
fn shutdown_reports_unfinished_requests_and_closes_the_log() {
    let mut r = start(0, "fcfs", 300, 0);
    // ~1 s of 1-ms iterations: still running when the shutdown arrives.
    assert_eq!(ask(&r, |reply| Command::Submit { spec: spec(1, 4, 1000, 10), reply }), SubmitOutcome::Accepted);
    wait_for(&r.log, "the first token", |s| s.tokens.contains_key(&1));
    r.tx.send(Command::Shutdown { grace: Duration::ZERO }).unwrap();
    let report = r.thread.take().unwrap().join().unwrap();
    assert_eq!(report.unfinished, vec![RequestId(1)]);
    let mut out = Vec::new();
    let last = r.log.stats().last_seq;
    assert_eq!(r.log.read_after(last, 10, &mut out), crate::events::Read::Closed);
}

/// Write `blocks` of `id` into `to`'s reservation (`migration`'s) as logical blocks `first`,
/// `first + 1`, …, each in the pieces a receiver may hold it in (cut at a different point per block).
fn write_blocks(to: &Running, id: RequestId, migration: MigrationId, first: u32, blocks: &[bytes::Bytes]) {
    for (i, data) in blocks.iter().enumerate() {
        let index = first + i as u32;
        let cut = (i * 997) % (data.len() + 1);
        // Verified as it lands, as a migration's target does.
        let checksum = Some(kvfleet_netmodel::migration::checksum(data));
        let data: kvfleet_netmodel::Payload = [data.slice(..cut), data.slice(cut..)].into_iter().collect();
        let write = |reply| {
            Command::Live(LiveCommand::WriteBlock { request: id, migration, index, offset: 0, data, checksum, reply })
        };
        ask(to, write).unwrap();
    }
}

/// Begin moving `id` out of `from` by `migration`, then pause it for the final copy.
/// Reserve room for an incoming move of `id` with no prompt content to pin.
fn reserve(to: &Running, id: RequestId, migration: MigrationId, kv_tokens: u32) -> Result<u32, DriverError> {
    ask(to, |reply| {
        let order = MoveOrder::UNORDERED;
        Command::Live(LiveCommand::Reserve { request: id, migration, order, kv_tokens, prefix: Vec::new(), reply })
    })
}

fn begin_and_pause(from: &Running, id: RequestId, migration: MigrationId) -> PausedOut {
    let live = |cmd| Command::Live(cmd);
    ask(from, |reply| live(LiveCommand::BeginOut { request: id, migration, reply })).unwrap();
    ask(from, |reply| live(LiveCommand::PauseOut { request: id, migration, reply })).unwrap()
}

/// The engine-thread half of a live migration, driven by hand: copy full blocks while the request
/// keeps decoding on A, pause, copy the rest, attach on B's reservation, release A. B verifies
/// every token's bytes; tokens continue on B exactly where A stopped; nothing is lost or doubled.
#[test]
fn live_commands_copy_a_running_request_block_by_block() {
    let a = start(0, "fcfs", 32, 8);
    let b = start(1, "fcfs", 32, 8);
    let id = RequestId(9);
    ask(&a, |reply| Command::Submit { spec: spec(9, 9, 60, 10), reply });
    wait_for(&a.log, "a few tokens on A", |s| s.tokens.get(&9).is_some_and(|t| t.len() >= 6));
    let live = |cmd| Command::Live(cmd);
    let mig = MigrationId(1);
    ask(&a, |reply| live(LiveCommand::BeginOut { request: id, migration: mig, reply })).unwrap();
    // Stage 0 while it runs: only full blocks are handed out.
    let first = ask(&a, |reply| live(LiveCommand::ReadBlocks { request: id, first: 0, count: 100, reply })).unwrap();
    assert_eq!(first.kv_tokens % 4, 0, "only whole blocks while running");
    assert_eq!(first.blocks.len() as u32, first.kv_tokens / 4);
    reserve(&b, id, mig, first.kv_tokens).unwrap();
    write_blocks(&b, id, mig, 0, &first.blocks);
    wait_for(&a.log, "more tokens on A during the copy", |s| s.tokens[&9].len() >= 14);
    // Stop-and-copy: pause, then everything from where stage 0 ended (incl. the partial block).
    let paused = ask(&a, |reply| live(LiveCommand::PauseOut { request: id, migration: mig, reply })).unwrap();
    let sent = first.blocks.len() as u32;
    let rest = ask(&a, |reply| live(LiveCommand::ReadBlocks { request: id, first: sent, count: 100, reply })).unwrap();
    assert_eq!(rest.kv_tokens, paused.kv_tokens, "everything is final once paused");
    assert_eq!(sent + rest.blocks.len() as u32, paused.kv_tokens.div_ceil(4));
    write_blocks(&b, id, mig, sent, &rest.blocks);
    let m: MigratedRequest = serde_json::from_slice(&paused.state).unwrap();
    assert_eq!(m.kv_tokens(), paused.kv_tokens);
    let generated = m.generated;
    ask(&b, |reply| live(LiveCommand::AttachReserved { migration: mig, state: Box::new(m), reply })).unwrap();
    ask(&a, |reply| live(LiveCommand::FinishOut { request: id, migration: mig, reply })).unwrap();
    let s = wait_for(&b.log, "the record on B", |s| s.finished.contains_key(&9));
    let r = &s.finished[&9];
    assert_eq!((r.migrations, r.kv_rematerialized, r.finished_on), (1, false, Some(1)));
    let on_b: Vec<u32> = s.tokens[&9].iter().map(|t| t.0).collect();
    assert_eq!(on_b, (generated..70).collect::<Vec<_>>(), "B continues where A stopped");
    assert_eq!(collect(&a.log).tokens[&9].len() as u32, generated, "A stopped at the pause");
    let stats_b = ask(&b, |reply| Command::Stats { reply });
    assert!(stats_b.kv.tokens_verified >= paused.kv_tokens as u64, "B checked every received token: {stats_b:?}");
    assert_eq!(stats_b.kv.errors + ask(&a, |reply| Command::Stats { reply }).kv.errors, 0);
}

/// A move out announces the request's KV as it is, its partial last block included (what the
/// target reserves for; the simulator announces the same): a 9-token prompt with one token out
/// holds 9 or 10 tokens of KV (4-token blocks), not the 8 of its full blocks.
#[test]
fn a_move_out_announces_the_kv_with_its_partial_block() {
    // Iterations of 300 ms: the KV does not change between the first token and the BeginOut.
    let a = start_timed(0, "fcfs", (32, 8), Duration::from_secs(3600), false, SUBMIT_GRACE, (300.0, None, 1));
    ask(&a, |reply| Command::Submit { spec: spec(9, 9, 60, 10), reply });
    wait_for(&a.log, "the first token", |s| s.tokens.get(&9).is_some_and(|t| !t.is_empty()));
    let live = |cmd| Command::Live(cmd);
    let began =
        ask(&a, |reply| live(LiveCommand::BeginOut { request: RequestId(9), migration: MigrationId(1), reply }));
    let kv = began.unwrap().kv_tokens;
    assert!((9..=10).contains(&kv), "announced {kv} KV tokens");
}

/// Request 5 (a 41-token KV written to `b` already) attaches on `b` with `state` and leaves `a`;
/// it finishes on `b`, which verified every token it received, and neither worker saw a KV error.
fn attach_and_finish(a: &Running, b: &Running, mig: MigrationId, state: &[u8]) {
    let (id, live) = (RequestId(5), Command::Live);
    let m: MigratedRequest = serde_json::from_slice(state).unwrap();
    ask(b, |reply| live(LiveCommand::AttachReserved { migration: mig, state: Box::new(m), reply })).unwrap();
    ask(a, |reply| live(LiveCommand::FinishOut { request: id, migration: mig, reply })).unwrap();
    let s = wait_for(&b.log, "the record on B", |s| s.finished.contains_key(&5));
    assert_eq!(s.finished[&5].finished_on, Some(1));
    let stats_b = ask(b, |reply| Command::Stats { reply });
    assert!(stats_b.kv.tokens_verified >= 41, "B checked every received token: {stats_b:?}");
    assert_eq!(stats_b.kv.errors + ask(a, |reply| Command::Stats { reply }).kv.errors, 0);
}

/// A move that follows a prefill (an overlapped handoff) on a prefill instance prefilling 40-token
/// prompts in chunks of 8 (4-token blocks, 40 ms iterations): the first chunk is announced; the
/// move begun then sees the first chunk's KV written and the whole prompt's KV to come; a wait for
/// more KV is answered once a later chunk is written; the pause is answered only at the prefill's
/// end, the request held with its first token; the blocks read along the way and after the pause
/// attach on another worker, which verifies every token and finishes the request.
#[test]
fn a_move_following_a_prefill_reads_each_chunk_and_pauses_at_its_end() {
    let a = start_timed(0, "fcfs", (32, 8), Duration::from_secs(3600), false, SUBMIT_GRACE, (40.0, Some(8), 1));
    let b = start(1, "fcfs", 32, 8);
    ask(&a, |reply| Command::SetRole { role: "prefill".into(), hand_off: true, reply });
    let (id, mig) = (RequestId(5), MigrationId(1));
    ask(&a, |reply| Command::Submit { spec: spec(5, 40, 0, 10), reply });
    wait_for(&a.log, "the first chunk announced", |s| s.prefill_started == [5]);
    let live = |cmd| Command::Live(cmd);
    let began = ask(&a, |reply| live(LiveCommand::BeginOut { request: id, migration: mig, reply })).unwrap();
    assert_eq!(began.following, Some(41), "the KV at the prefill's end (the prompt and its first token) is to come");
    assert!(began.kv_tokens >= 8 && began.kv_tokens < 40, "a chunk or more is written: {}", began.kv_tokens);
    let (tx, paused) = oneshot::channel();
    a.tx.send(live(LiveCommand::PauseOut { request: id, migration: mig, reply: tx })).unwrap();
    let more = ask(&a, |reply| live(LiveCommand::WaitKv { request: id, above: began.kv_tokens, layers: None, reply }));
    let more = more.unwrap().kv_tokens;
    assert!(more > began.kv_tokens && more % 4 == 0 && more <= 40, "a later chunk's full blocks: {more}");
    let read = ask(&a, |reply| live(LiveCommand::ReadBlocks { request: id, first: 0, count: 100, reply })).unwrap();
    assert_eq!(read.blocks.len() as u32 * 4, read.kv_tokens);
    // Asked mid-prefill, the pause waited for its end (else the engine refuses a prefilling
    // request: an error here).
    let paused = paused.blocking_recv().unwrap().unwrap();
    let s = collect(&a.log);
    assert_eq!((s.prefill_done.as_slice(), s.tokens[&5].len()), ([5].as_slice(), 1), "held after its first token");
    assert_eq!(paused.kv_tokens, 41, "the prompt's KV and its first token's");
    let sent = read.blocks.len() as u32;
    let rest = ask(&a, |reply| live(LiveCommand::ReadBlocks { request: id, first: sent, count: 100, reply })).unwrap();
    reserve(&b, id, mig, began.following.unwrap()).unwrap();
    write_blocks(&b, id, mig, 0, &read.blocks);
    write_blocks(&b, id, mig, sent, &rest.blocks);
    attach_and_finish(&a, &b, mig, &paused.state);
}

/// A move that follows a prefill layer by layer (`[pd] overlap = "layer"`: 4 layer groups) on a
/// prefill instance prefilling a 40-token prompt in one 400 ms iteration: the prefill is announced
/// when its iteration starts, before any KV is computed; a wait for KV is answered as the
/// iteration goes through its layer groups (not at its end), with nothing final yet; the blocks
/// the iteration fills can be read meanwhile; the pause comes at the prefill's end. The target
/// lands each block in slices (a group, two, the last one) at their offsets, and the attach
/// verifies every token.
#[test]
fn a_move_following_a_prefill_layer_by_layer_hears_of_each_layer_group() {
    let a = start_timed(0, "fcfs", (32, 8), Duration::from_secs(3600), false, SUBMIT_GRACE, (400.0, None, 4));
    let b = start(1, "fcfs", 32, 8);
    ask(&a, |reply| Command::SetRole { role: "prefill".into(), hand_off: true, reply });
    let (id, mig) = (RequestId(5), MigrationId(1));
    ask(&a, |reply| Command::Submit { spec: spec(5, 40, 0, 10), reply });
    wait_for(&a.log, "the prefill announced as it starts", |s| s.prefill_started == [5]);
    let live = |cmd| Command::Live(cmd);
    let began = ask(&a, |reply| live(LiveCommand::BeginOut { request: id, migration: mig, reply })).unwrap();
    assert_eq!((began.following, began.kv_tokens, began.layer_groups), (Some(41), 0, 4));
    let (tx, paused) = oneshot::channel();
    a.tx.send(live(LiveCommand::PauseOut { request: id, migration: mig, reply: tx })).unwrap();
    let wait = |layers| ask(&a, |reply| live(LiveCommand::WaitKv { request: id, above: 0, layers, reply })).unwrap();
    let first = wait(Some((0, 0)));
    let Some((40, k)) = first.layers else { panic!("the iteration's layer groups: {first:?}") };
    assert!((1..4).contains(&k) && first.kv_tokens == 0, "{first:?}");
    assert!(collect(&a.log).prefill_done.is_empty(), "heard of before the prefill's end");
    if k < 3 {
        let next = wait(Some((40, k)));
        assert!(next.layers.is_some_and(|(t, j)| t == 40 && j > k) || next.kv_tokens == 40, "{next:?}");
    }
    let read = ask(&a, |reply| live(LiveCommand::ReadBlocks { request: id, first: 0, count: 100, reply })).unwrap();
    assert_eq!(read.blocks.len(), 10, "the blocks the iteration fills are readable");
    let paused = paused.blocking_recv().unwrap().unwrap();
    assert_eq!(paused.kv_tokens, 41);
    let rest = ask(&a, |reply| live(LiveCommand::ReadBlocks { request: id, first: 10, count: 100, reply })).unwrap();
    reserve(&b, id, mig, 41).unwrap();
    let block_bytes = read.blocks[0].len() as u64;
    for (index, data) in (0..).zip(&read.blocks) {
        for groups in [0..1, 1..3, 3..4] {
            let r = kvfleet_netmodel::migration::slice_bytes(block_bytes, 4, groups);
            let part = data.slice(r.start as usize..r.end as usize);
            let checksum = Some(kvfleet_netmodel::migration::checksum(&part));
            let (offset, data) = (r.start, part.into());
            ask(&b, |reply| {
                live(LiveCommand::WriteBlock { request: id, migration: mig, index, offset, data, checksum, reply })
            })
            .unwrap();
        }
    }
    write_blocks(&b, id, mig, 10, &rest.blocks);
    attach_and_finish(&a, &b, mig, &paused.state);
}

/// A corrupted block is caught on the target before the request is attached; the reservation is
/// released; the source resumes the request and finishes it.
#[test]
fn live_commit_with_a_corrupt_block_is_refused_and_the_source_resumes() {
    let a = start(0, "fcfs", 32, 8);
    let b = start(1, "fcfs", 32, 8);
    let id = RequestId(5);
    let live = |cmd| Command::Live(cmd);
    ask(&a, |reply| Command::Submit { spec: spec(5, 9, 30, 5), reply });
    wait_for(&a.log, "tokens on A", |s| s.tokens.get(&5).is_some_and(|t| t.len() >= 3));
    let mig = MigrationId(1);
    let paused = begin_and_pause(&a, id, mig);
    let all = ask(&a, |reply| live(LiveCommand::ReadBlocks { request: id, first: 0, count: 100, reply })).unwrap();
    reserve(&b, id, mig, paused.kv_tokens).unwrap();
    for (i, data) in all.blocks.iter().enumerate() {
        let mut bytes = data.to_vec();
        if i == 1 {
            bytes[100] ^= 0x40;
        }
        let data = bytes::Bytes::from(bytes).into();
        let write = |reply| {
            let index = i as u32;
            live(LiveCommand::WriteBlock { request: id, migration: mig, index, offset: 0, data, checksum: None, reply })
        };
        ask(&b, write).unwrap();
    }
    let m: MigratedRequest = serde_json::from_slice(&paused.state).unwrap();
    let e =
        ask(&b, |reply| live(LiveCommand::AttachReserved { migration: mig, state: Box::new(m), reply })).unwrap_err();
    assert!(matches!(e, DriverError::KvCorrupt { .. }), "{e}");
    b.tx.send(live(LiveCommand::Release { request: id, migration: mig })).unwrap();
    assert_eq!(ask(&b, |reply| Command::Load { reply }).gpu_used_blocks, 0, "the reservation is released");
    ask(&a, |reply| live(LiveCommand::ResumeOut { request: id, migration: mig, reply })).unwrap();
    let s = wait_for(&a.log, "the record on A", |s| s.finished.contains_key(&5));
    assert_eq!(s.finished[&5].finished_on, Some(0));
    assert_eq!(s.tokens[&5].len(), 35, "every token exactly once, all on A");
}

/// The source of an incoming migration was declared dead and the leader re-placed the request
/// here from the start: the stale reservation is released, the fresh copy runs to the end (it
/// used to trip the planner: one request id owning blocks twice), and a late commit of the old
/// migration (a source that was only cut off) cannot attach a second copy.
#[test]
fn a_request_re_placed_while_its_migration_was_incoming_runs_fresh() {
    let a = start(0, "fcfs", 32, 8);
    let b = start(1, "fcfs", 32, 8);
    let id = RequestId(5);
    let live = |cmd| Command::Live(cmd);
    ask(&a, |reply| Command::Submit { spec: spec(5, 9, 40, 10), reply });
    wait_for(&a.log, "a few tokens on A", |s| s.tokens.get(&5).is_some_and(|t| t.len() >= 6));
    let mig = MigrationId(1);
    let paused = begin_and_pause(&a, id, mig);
    let blocks = ask(&a, |reply| live(LiveCommand::ReadBlocks { request: id, first: 0, count: 100, reply })).unwrap();
    reserve(&b, id, mig, paused.kv_tokens).unwrap();
    write_blocks(&b, id, mig, 0, &blocks.blocks);
    // (A is declared dead here; the leader re-places the request on B from the start)
    assert_eq!(ask(&b, |reply| Command::Submit { spec: spec(5, 9, 40, 10), reply }), SubmitOutcome::Accepted);
    let s = wait_for(&b.log, "the fresh copy's record", |s| s.finished.contains_key(&5));
    check_request(&s, 5, 40, 10);
    assert_eq!(ask(&b, |reply| Command::Stats { reply }).kv.errors, 0);
    // A was only cut off and commits its migration late: refused, no second copy.
    let m: MigratedRequest = serde_json::from_slice(&paused.state).unwrap();
    let late = ask(&b, |reply| live(LiveCommand::AttachReserved { migration: mig, state: Box::new(m), reply }));
    assert!(late.is_err(), "a late commit of a request already run here is refused: {late:?}");
    assert_eq!(collect(&b.log).finished.len(), 1);
}

/// A whole live move of `id` from `from` to `to` by `migration` through the engine threads' live
/// commands: pause, copy every block, attach on the reservation, release the source. The tokens
/// generated before the move.
fn live_move(from: &Running, to: &Running, id: RequestId, migration: MigrationId) -> u32 {
    live_move_pinning(from, to, id, migration).0
}

/// A whole live move; returns the tokens generated before it and the prompt blocks the target
/// found in its prefix cache (pinned, not sent).
fn live_move_pinning(from: &Running, to: &Running, id: RequestId, migration: MigrationId) -> (u32, u32) {
    let live = |cmd| Command::Live(cmd);
    let paused = begin_and_pause(from, id, migration);
    let all = ask(from, |reply| live(LiveCommand::ReadBlocks { request: id, first: 0, count: 1000, reply })).unwrap();
    let kv_tokens = paused.kv_tokens;
    let m: MigratedRequest = serde_json::from_slice(&paused.state).unwrap();
    let prefix = shared_blocks(&m.spec, 4).into_vec();
    let order = MoveOrder::UNORDERED;
    let pinned =
        ask(to, |reply| live(LiveCommand::Reserve { request: id, migration, order, kv_tokens, prefix, reply }))
            .unwrap();
    write_blocks(to, id, migration, pinned, &all.blocks[pinned as usize..]);
    let generated = m.generated;
    ask(to, |reply| live(LiveCommand::AttachReserved { migration, state: Box::new(m), reply })).unwrap();
    ask(from, |reply| live(LiveCommand::FinishOut { request: id, migration, reply })).unwrap();
    (generated, pinned)
}

/// The instance a request moved to died and the leader re-placed it from the start on the one it
/// had left: that submit runs it afresh (it once answered "duplicate" and the request never ran,
/// seen in the compose chaos run). A second migration of a request whose reservation is still
/// held here is refused: the two would share the blocks.
#[test]
fn a_request_that_left_runs_again_when_re_placed_and_reservations_are_not_shared() {
    let a = start(0, "fcfs", 32, 8);
    let b = start(1, "fcfs", 32, 8);
    let id = RequestId(4);
    assert_eq!(ask(&a, |reply| Command::Submit { spec: spec(4, 9, 80, 10), reply }), SubmitOutcome::Accepted);
    wait_for(&a.log, "tokens on A", |s| s.tokens.get(&4).is_some_and(|t| t.len() >= 5));
    live_move(&a, &b, id, MigrationId(1));
    // B is gone: re-placed on A from the start.
    assert_eq!(ask(&a, |reply| Command::Submit { spec: spec(4, 9, 80, 10), reply }), SubmitOutcome::Accepted);
    assert_eq!(ask(&a, |reply| Command::Submit { spec: spec(4, 9, 80, 10), reply }), SubmitOutcome::Duplicate);
    let s = wait_for(&a.log, "the re-placed request finished on A", |s| s.finished.contains_key(&4));
    assert_eq!(s.finished[&4].finished_on, Some(0));
    // Reservations: the first holds, a second for the same request is refused and changes nothing.
    let other = RequestId(5);
    reserve(&b, other, MigrationId(2), 40).unwrap();
    let used = ask(&b, |reply| Command::Load { reply }).gpu_used_blocks;
    let e = reserve(&b, other, MigrationId(3), 40).unwrap_err();
    assert!(e.to_string().contains("already coming in"), "{e}");
    assert_eq!(ask(&b, |reply| Command::Load { reply }).gpu_used_blocks, used);
}

/// PASCAL moves a request at phase boundaries, so it can come back to an instance it left: the
/// guard against a second copy of a re-placed request must not refuse that (seen in the compose
/// chaos run as "already run on this instance" aborts).
#[test]
fn a_request_migrated_away_can_migrate_back() {
    let a = start(0, "fcfs", 32, 8);
    let b = start(1, "fcfs", 32, 8);
    let id = RequestId(3);
    ask(&a, |reply| Command::Submit { spec: spec(3, 9, 80, 10), reply });
    wait_for(&a.log, "tokens on A", |s| s.tokens.get(&3).is_some_and(|t| t.len() >= 5));
    let before_b = live_move(&a, &b, id, MigrationId(1));
    wait_for(&b.log, "tokens on B", |s| s.tokens.get(&3).is_some_and(|t| t.len() >= 5));
    let before_back = live_move(&b, &a, id, MigrationId(2));
    let s = wait_for(&a.log, "the record, back on A", |s| s.finished.contains_key(&3));
    assert_eq!(s.finished[&3].finished_on, Some(0));
    assert_eq!(s.finished[&3].migrations, 2);
    let on_a: Vec<u32> = s.tokens[&3].iter().map(|t| t.0).collect();
    let mut expected: Vec<u32> = (0..before_b).collect();
    expected.extend(before_back..90);
    assert_eq!(on_a, expected, "A: the tokens before the first move and after the second");
    let on_b: Vec<u32> = collect(&b.log).tokens[&3].iter().map(|t| t.0).collect();
    assert_eq!(on_b, (before_b..before_back).collect::<Vec<_>>(), "B: the tokens in between");
    assert_eq!(
        ask(&a, |reply| Command::Stats { reply }).kv.errors + ask(&b, |reply| Command::Stats { reply }).kv.errors,
        0
    );
    consistent(&a);
    consistent(&b);
}

/// The ledger and the engine agree on which requests are here, and the arena on their KV.
fn consistent(r: &Running) {
    ask(r, |reply| Command::VerifyAll { reply }).unwrap_or_else(|e| panic!("{e}"));
}

/// A worker whose registration lapsed (its number may be a newcomer's, its requests re-placed)
/// refuses requests arriving by migration: a COMMIT prepared before the lapse is refused, the
/// reservation freed, the source resumes; new PREPAREs and attaches are refused until it is
/// registered again. Submits are still answered.
#[test]
fn a_worker_whose_registration_lapsed_refuses_migrations_in() {
    let a = start(0, "fcfs", 32, 8);
    let b = start(1, "fcfs", 32, 8);
    let live = |cmd| Command::Live(cmd);
    let (id, mig) = (RequestId(6), MigrationId(1));
    ask(&a, |reply| Command::Submit { spec: spec(6, 9, 40, 10), reply });
    wait_for(&a.log, "tokens on A", |s| s.tokens.get(&6).is_some_and(|t| t.len() >= 5));
    let paused = begin_and_pause(&a, id, mig);
    let all = ask(&a, |reply| live(LiveCommand::ReadBlocks { request: id, first: 0, count: 100, reply })).unwrap();
    let kv_tokens = paused.kv_tokens;
    reserve(&b, id, mig, kv_tokens).unwrap();
    write_blocks(&b, id, mig, 0, &all.blocks);
    // B's lease is lost before the COMMIT arrives.
    b.tx.send(Command::Registration { registered: false }).unwrap();
    let m: MigratedRequest = serde_json::from_slice(&paused.state).unwrap();
    let e = ask(&b, |reply| live(LiveCommand::AttachReserved { migration: mig, state: Box::new(m.clone()), reply }))
        .unwrap_err();
    assert!(matches!(e, DriverError::Refused { refusal: Refusal::Unregistered, .. }), "{e}");
    b.tx.send(live(LiveCommand::Release { request: id, migration: mig })).unwrap();
    assert_eq!(ask(&b, |reply| Command::Load { reply }).gpu_used_blocks, 0, "the reservation is released");
    ask(&a, |reply| live(LiveCommand::ResumeOut { request: id, migration: mig, reply })).unwrap();
    let s = wait_for(&a.log, "the record on A", |s| s.finished.contains_key(&6));
    check_request(&s, 6, 40, 10);
    // Nothing arrives by migration while lapsed; submits still run.
    let r = reserve(&b, RequestId(8), MigrationId(2), 8);
    assert!(matches!(r, Err(DriverError::Refused { refusal: Refusal::Unregistered, .. })));
    let attach = |reply| Command::Attach { state: Box::new(m.clone()), rematerialized: true, reply };
    assert!(matches!(ask(&b, attach), Err(DriverError::Refused { refusal: Refusal::Unregistered, .. })));
    assert_eq!(ask(&b, |reply| Command::Submit { spec: spec(9, 4, 2, 2), reply }), SubmitOutcome::Accepted);
    // Registered again: accepted.
    b.tx.send(Command::Registration { registered: true }).unwrap();
    reserve(&b, RequestId(8), MigrationId(2), 8).unwrap();
    b.tx.send(live(LiveCommand::Release { request: RequestId(8), migration: MigrationId(2) })).unwrap();
    assert!(!collect(&b.log).finished.contains_key(&6), "B never ran it");
    consistent(&a);
    consistent(&b);
}

/// One move out at a time: a second migration of a request being moved is refused, and cannot
/// resume, pause or free the first one's request (a new leader re-deciding a move while the first,
/// which outlives its coordinator, is still copying).
#[test]
fn a_second_move_out_of_a_request_under_way_is_refused_and_cannot_touch_the_first() {
    let a = start(0, "fcfs", 32, 8);
    let live = |cmd| Command::Live(cmd);
    let id = RequestId(2);
    ask(&a, |reply| Command::Submit { spec: spec(2, 9, 60, 10), reply });
    wait_for(&a.log, "tokens on A", |s| s.tokens.get(&2).is_some_and(|t| t.len() >= 5));
    let (first, second) = (MigrationId(1), MigrationId(2));
    begin_and_pause(&a, id, first);
    let e = ask(&a, |reply| live(LiveCommand::BeginOut { request: id, migration: second, reply })).unwrap_err();
    assert!(matches!(e, DriverError::Refused { refusal: Refusal::MoveUnderWay, .. }), "{e}");
    assert!(ask(&a, |reply| live(LiveCommand::ResumeOut { request: id, migration: second, reply })).is_err());
    assert!(ask(&a, |reply| live(LiveCommand::FinishOut { request: id, migration: second, reply })).is_err());
    assert!(matches!(
        ask(&a, |reply| Command::MigrateOut { request: id, reply }),
        Err(DriverError::Refused { refusal: Refusal::MoveUnderWay, .. })
    ));
    consistent(&a);
    let tokens = collect(&a.log).tokens[&2].len();
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(collect(&a.log).tokens[&2].len(), tokens, "still paused: the second move resumed nothing");
    // The first one's abort resumes it; it finishes here with every token once.
    ask(&a, |reply| live(LiveCommand::ResumeOut { request: id, migration: first, reply })).unwrap();
    let s = wait_for(&a.log, "the record on A", |s| s.finished.contains_key(&2));
    check_request(&s, 2, 60, 10);
    consistent(&a);
}

/// A `</think>` boundary reaches the leader after a load report that already counts the iteration
/// producing it (the simulator's order): the request no longer counts as reasoning there, so
/// PASCAL's Alg. 2 does not see one reasoning request too many on its current instance.
#[test]
fn a_boundary_follows_a_load_that_includes_its_iteration() {
    let r = start(0, "pascal", 64, 16);
    assert_eq!(ask(&r, |reply| Command::Submit { spec: spec(1, 8, 6, 4), reply }), SubmitOutcome::Accepted);
    wait_for(&r.log, "the boundary", |s| s.boundaries.contains_key(&1));
    let mut out = Vec::new();
    r.log.read_after(0, usize::MAX, &mut out);
    let boundary = out
        .iter()
        .position(|e| matches!(e.event, Some(v1::worker_event::Event::Boundary(_))))
        .expect("a boundary in the log");
    let load_before = out[..boundary]
        .iter()
        .rev()
        .find_map(|e| match &e.event {
            Some(v1::worker_event::Event::Load(l)) => Some(*l),
            _ => None,
        })
        .expect("a load report before the boundary");
    assert_eq!(load_before.reasoning_requests, 0, "the load before the boundary: {load_before:?}");
}

/// A request held after its prefill whose handoff fails (the move aborts after the pause) is
/// held again and announced again: the leader may have given up on that move and decided to let
/// it decode here meanwhile (a release the worker refused, the request being on its way out).
#[test]
fn a_held_request_whose_handoff_aborts_is_announced_again() {
    let a = start(0, "fcfs", 32, 8);
    let held = ask(&a, |reply| Command::SetRole { role: "prefill".into(), hand_off: true, reply });
    assert_eq!(held, 0);
    ask(&a, |reply| Command::Submit { spec: spec(5, 9, 0, 10), reply });
    wait_for(&a.log, "the prefill-done event", |s| s.prefill_done == [5]);
    let (id, mig) = (RequestId(5), MigrationId(1));
    begin_and_pause(&a, id, mig);
    let refused = ask(&a, |reply| Command::Release { request: id, reply });
    assert!(refused.is_err(), "moving out, it is not held: {refused:?}");
    ask(&a, |reply| Command::Live(LiveCommand::ResumeOut { request: id, migration: mig, reply })).unwrap();
    let s = wait_for(&a.log, "the request announced again", |s| s.prefill_done == [5, 5]);
    assert_eq!(s.tokens[&5].len(), 1, "held again after its first token");
    ask(&a, |reply| Command::Release { request: id, reply }).unwrap();
    let s = wait_for(&a.log, "its record", |s| s.finished.contains_key(&5));
    check_request(&s, 5, 0, 10);
}

/// Held requests are announced again every `announce_every`: a release or role change lost on
/// its way is decided again.
#[test]
fn held_requests_are_announced_again_periodically() {
    let cfg_every = Duration::from_millis(50);
    let a = start_with_announce(0, cfg_every);
    ask(&a, |reply| Command::SetRole { role: "prefill".into(), hand_off: true, reply });
    ask(&a, |reply| Command::Submit { spec: spec(6, 9, 0, 10), reply });
    let s = wait_for(&a.log, "three announcements", |s| s.prefill_done.len() >= 3);
    assert!(s.prefill_done.iter().all(|&id| id == 6), "{:?}", s.prefill_done);
    assert_eq!(s.tokens[&6].len(), 1, "still held");
}

/// Prefix caching on a worker: a prompt block another request wrote is shared, not written again
/// (its stamps are checked first), its content is the block's whoever wrote it, so the request
/// moves to another worker and verifies there; the cache's changes are logged, after a first
/// "all cleared".
#[test]
fn a_cached_prefix_is_written_once_shared_and_moves_with_its_content() {
    let a = start_caching(0);
    let b = start_caching(1);
    let with_ids =
        |id, prompt, reasoning, answer| RequestSpec { content_ids: vec![5], ..spec(id, prompt, reasoning, answer) };
    ask(&a, |reply| Command::Submit { spec: with_ids(1, 40, 6, 4), reply });
    wait_for(&a.log, "the first request finished", |s| s.finished.contains_key(&1));
    assert_eq!(ask(&a, |reply| Command::Stats { reply }).kv.tokens_reused, 0, "nothing cached yet");
    // 44 tokens over the same 512-token content unit: the first 40 are the first request's blocks.
    ask(&a, |reply| Command::Submit { spec: with_ids(2, 44, 60, 10), reply });
    wait_for(&a.log, "tokens of the second", |s| s.tokens.get(&2).is_some_and(|t| t.len() >= 5));
    let stats = ask(&a, |reply| Command::Stats { reply });
    assert_eq!(stats.kv.tokens_reused, 40, "ten shared blocks of four tokens: {stats:?}");
    consistent(&a);
    let s = collect(&a.log);
    assert_eq!(s.kv_events.first(), Some(&KvEvent::AllCleared), "a started worker clears first");
    let stored = s.kv_events.iter().filter(|e| matches!(e, KvEvent::Stored { tier: Tier::Gpu, .. })).count();
    assert_eq!(stored, 11, "the first prompt's ten full blocks, the second's eleventh: {:?}", s.kv_events);
    // The shared blocks' bytes are the first request's writes: the target checks them as the
    // second's content.
    assert_eq!(live_move_pinning(&a, &b, RequestId(2), MigrationId(1)).1, 0, "B caches nothing yet");
    let s = wait_for(&b.log, "the second finished on B", |s| s.finished.contains_key(&2));
    assert_eq!(s.finished[&2].cached_tokens, 40);
    assert_eq!(s.finished[&2].finished_on, Some(1));
    consistent(&a);
    // B cached the blocks that arrived: a third request over the same content moves there
    // sending only its last prompt block and what it generated.
    ask(&a, |reply| Command::Submit { spec: with_ids(3, 45, 60, 10), reply });
    wait_for(&a.log, "tokens of the third", |s| s.tokens.get(&3).is_some_and(|t| t.len() >= 5));
    assert_eq!(live_move_pinning(&a, &b, RequestId(3), MigrationId(2)).1, 11, "B holds the 11 full prompt blocks");
    let s = wait_for(&b.log, "the third finished on B", |s| s.finished.contains_key(&3));
    assert_eq!(s.finished[&3].finished_on, Some(1));
    consistent(&b);
    let errors =
        ask(&a, |reply| Command::Stats { reply }).kv.errors + ask(&b, |reply| Command::Stats { reply }).kv.errors;
    assert_eq!(errors, 0);
}

/// A block lent to a migration's transport (read in place) is never reused while the transport
/// holds it, even after its request finished: a request arriving meanwhile gets other blocks, and
/// the lent bytes keep their content. Once the transport lets go, the blocks are free again.
#[test]
fn a_block_lent_to_a_transfer_is_not_reused_until_it_comes_back() {
    // 8 blocks of 4 tokens: request 9's prompt takes 4, request 10's the other 4. Iterations of
    // 10 ms: request 9 must still run when its move begins (a loaded host once took longer than
    // its 12 tokens of 1 ms each to ask).
    let a = start_timed(0, "fcfs", (8, 0), Duration::from_secs(3600), false, SUBMIT_GRACE, (10.0, None, 1));
    let id = RequestId(9);
    ask(&a, |reply| Command::Submit { spec: spec(9, 16, 0, 12), reply });
    wait_for(&a.log, "its prefill", |s| s.tokens.contains_key(&9));
    let live = |cmd| Command::Live(cmd);
    let mig = MigrationId(1);
    ask(&a, |reply| live(LiveCommand::BeginOut { request: id, migration: mig, reply })).unwrap();
    let read = ask(&a, |reply| live(LiveCommand::ReadBlocks { request: id, first: 0, count: 4, reply })).unwrap();
    assert_eq!(read.blocks.len(), 4);
    // It finishes on A while its blocks are still out (the move then ends).
    wait_for(&a.log, "request 9 finished", |s| s.finished.contains_key(&9));
    ask(&a, |reply| live(LiveCommand::ResumeOut { request: id, migration: mig, reply })).ok();
    // A newcomer fits in the free half and runs; it never writes into a lent block.
    ask(&a, |reply| Command::Submit { spec: spec(10, 12, 0, 3), reply });
    wait_for(&a.log, "request 10 finished", |s| s.finished.contains_key(&10));
    for (k, block) in read.blocks.iter().enumerate() {
        for slot in 0..4u32 {
            let token = k as u32 * 4 + slot;
            let mut want = vec![0u8; 96];
            crate::arena::fill_token(&mut want, crate::arena::token_seed(id, token));
            assert_eq!(&block[slot as usize * 96..][..96], &want[..], "lent block {k}, token {token}");
        }
    }
    consistent(&a);
    // A request needing every block of the pool waits for them; back from the transport, they
    // let it run without any further command.
    ask(&a, |reply| Command::Submit { spec: spec(11, 30, 0, 2), reply });
    assert!(!collect(&a.log).tokens.contains_key(&11), "no room while the blocks are lent");
    drop(read);
    wait_for(&a.log, "request 11 finished", |s| s.finished.contains_key(&11));
    consistent(&a);
    assert_eq!(ask(&a, |reply| Command::Stats { reply }).kv.errors, 0);
}

/// A received block whose bytes do not hash to its sender's checksum is refused as it lands (the
/// copy and the hash are one pass); the same bytes with their own checksum are written.
#[test]
fn a_block_that_does_not_match_its_checksum_is_refused_as_it_lands() {
    let a = start(0, "fcfs", 32, 8);
    let b = start(1, "fcfs", 32, 8);
    let id = RequestId(9);
    ask(&a, |reply| Command::Submit { spec: spec(9, 9, 60, 10), reply });
    wait_for(&a.log, "a few tokens on A", |s| s.tokens.get(&9).is_some_and(|t| t.len() >= 2));
    let live = |cmd| Command::Live(cmd);
    let mig = MigrationId(1);
    ask(&a, |reply| live(LiveCommand::BeginOut { request: id, migration: mig, reply })).unwrap();
    let read = ask(&a, |reply| live(LiveCommand::ReadBlocks { request: id, first: 0, count: 1, reply })).unwrap();
    reserve(&b, id, mig, read.kv_tokens).unwrap();
    let data = read.blocks[0].clone();
    let sum = kvfleet_netmodel::migration::checksum(&data);
    let write = |checksum| {
        let data = kvfleet_netmodel::Payload::from(data.clone());
        ask(&b, |reply| {
            live(LiveCommand::WriteBlock { request: id, migration: mig, index: 0, offset: 0, data, checksum, reply })
        })
    };
    let e = write(Some(sum ^ 1)).unwrap_err();
    assert!(
        matches!(e, DriverError::Arena(ArenaError::Checksum { expected, found, .. }) if expected == sum ^ 1 && found == sum),
        "{e}"
    );
    write(Some(sum)).unwrap();
}

/// A request that reaches an idle engine late (its way from the leader took 100 ms) runs as of
/// its arrival, as the simulator runs it: its first token comes one iteration after the
/// arrival, not one iteration after it got here. A request arriving before the engine's last
/// change, or long ago (re-placed after its worker died), starts when it gets here.
#[test]
fn an_idle_engine_plans_a_late_request_as_of_its_arrival() {
    let r = start(0, "fcfs", 32, 8);
    std::thread::sleep(Duration::from_millis(200));
    let arrival = Timestamp(100_000_000);
    let outcome = ask(&r, |reply| Command::Submit { spec: RequestSpec { arrival, ..spec(1, 4, 0, 2) }, reply });
    assert!(matches!(outcome, SubmitOutcome::Accepted), "{outcome:?}");
    let s = wait_for(&r.log, "request 1 finished", |s| s.finished.contains_key(&1));
    let first = s.tokens[&1][0].2;
    assert_eq!(first, arrival.0 + 1_000_000, "first token one 1 ms iteration after the arrival");
    // A cancel (an engine change) now: a request stamped before it starts after it.
    let cancelled = ask(&r, |reply| Command::Cancel { request: RequestId(7), kind: CancelKind::ClientLeft, reply });
    assert!(cancelled.is_err() || cancelled == Ok(false), "{cancelled:?}");
    let s = collect(&r.log);
    let after = s.finished[&1].finish_ns.unwrap();
    let outcome =
        ask(&r, |reply| Command::Submit { spec: RequestSpec { arrival: Timestamp(after), ..spec(2, 4, 0, 2) }, reply });
    assert!(matches!(outcome, SubmitOutcome::Accepted), "{outcome:?}");
    let s = wait_for(&r.log, "request 2 finished", |s| s.finished.contains_key(&2));
    let first = s.tokens[&2][0].2;
    assert!(first > after + 50_000_000, "planned after the cancel ({first} vs arrival {after})");
    // An engine idle since its start given one that arrived 300 ms ago: it starts now, not back
    // then (it once ran its whole output at once, in the past).
    let fresh = start(1, "fcfs", 32, 8);
    std::thread::sleep(Duration::from_millis(300));
    let submitted = fresh.clock.now().0;
    let outcome =
        ask(&fresh, |reply| Command::Submit { spec: RequestSpec { arrival: Timestamp(1), ..spec(3, 4, 0, 2) }, reply });
    assert!(matches!(outcome, SubmitOutcome::Accepted), "{outcome:?}");
    let s = wait_for(&fresh.log, "request 3 finished", |s| s.finished.contains_key(&3));
    let first = s.tokens[&3][0].2;
    assert!(first >= submitted, "started when submitted ({first} vs {submitted})");
}

/// Reading a held request's blocks for its handoff, and the end of those loans, change nothing an
/// idle prefill engine would plan: a request that arrived before them but reached the engine
/// after them still runs as of its arrival (before, every block read or returned restarted the
/// engine's quiet time, and such a request started when it got here, up to a submit's latency
/// late: the emulator's prefill workers then ran behind the simulator's while handing off).
#[test]
fn an_idle_engine_moving_a_handoffs_bytes_plans_a_late_request_as_of_its_arrival() {
    let a = start(0, "fcfs", 32, 8);
    ask(&a, |reply| Command::SetRole { role: "prefill".into(), hand_off: true, reply });
    ask(&a, |reply| Command::Submit { spec: spec(5, 8, 0, 10), reply });
    wait_for(&a.log, "request 5 held after its first token", |s| s.prefill_done == [5]);
    let (id, mig, live) = (RequestId(5), MigrationId(1), Command::Live);
    ask(&a, |reply| live(LiveCommand::BeginOut { request: id, migration: mig, reply })).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let arrival = a.clock.now();
    std::thread::sleep(Duration::from_millis(20));
    let read = ask(&a, |reply| live(LiveCommand::ReadBlocks { request: id, first: 0, count: 100, reply })).unwrap();
    assert_eq!(read.blocks.len(), 2, "the prompt's two full blocks, lent");
    drop(read);
    // The driver takes the loans back before it answers any command.
    ask(&a, |reply| Command::Load { reply });
    std::thread::sleep(Duration::from_millis(20));
    let outcome = ask(&a, |reply| Command::Submit { spec: RequestSpec { arrival, ..spec(6, 4, 0, 2) }, reply });
    assert!(matches!(outcome, SubmitOutcome::Accepted), "{outcome:?}");
    let s = wait_for(&a.log, "request 6's first token", |s| s.tokens.get(&6).is_some_and(|t| !t.is_empty()));
    assert_eq!(s.tokens[&6][0].2, arrival.0 + 1_000_000, "first token one 1 ms iteration after the arrival");
}

/// A request the leader placed just before an iteration began, still on its way when the
/// iteration ended, joins the next iteration as in the simulator: iterations complete a grace
/// after their end (here 100 ms, so this host's scheduling cannot decide it), and a request
/// stamped 40 ms before it reaches the driver gets its first token one iteration after the
/// first iteration boundary at or after its arrival. Without the grace the engine, on time,
/// had started iterations after that boundary without it.
#[test]
fn a_request_on_its_way_joins_the_iteration_after_its_arrival() {
    let r = start_full(0, "fcfs", 256, 8, Duration::from_secs(3600), false, Duration::from_millis(100));
    let outcome = ask(&r, |reply| Command::Submit { spec: spec(1, 4, 400, 2), reply });
    assert!(matches!(outcome, SubmitOutcome::Accepted), "{outcome:?}");
    wait_for(&r.log, "request 1 decoding", |s| s.tokens.get(&1).is_some_and(|t| t.len() > 50));
    let arrival = r.clock.now().0 - 40_000_000;
    let outcome = ask(&r, |reply| Command::Submit {
        spec: RequestSpec { arrival: Timestamp(arrival), ..spec(2, 4, 0, 2) },
        reply,
    });
    assert!(matches!(outcome, SubmitOutcome::Accepted), "{outcome:?}");
    let s = wait_for(&r.log, "request 2 finished", |s| s.finished.contains_key(&2));
    let boundaries: Vec<u64> = s.tokens[&1].iter().map(|t| t.2).collect();
    let first_after = *boundaries.iter().find(|&&b| b >= arrival).expect("request 1 ran past the arrival");
    let first = s.tokens[&2][0].2;
    assert_eq!(first, first_after + 1_000_000, "joined the iteration starting at {first_after} (arrival {arrival})");
}

/// A copy that finished here, its record refused by the coordinator as a late copy's (the request
/// was re-placed elsewhere meanwhile), is forgotten on the coordinator's word: placed here again it
/// runs afresh, where it had been answered "already accepted" and never run.
#[test]
fn a_late_copys_finish_is_forgotten_and_the_request_may_run_here_again() {
    let b = start(1, "fcfs", 32, 8);
    let forget =
        |id: u64| ask(&b, |reply| Command::Cancel { request: RequestId(id), kind: CancelKind::LateRecord, reply });
    assert_eq!(ask(&b, |reply| Command::Submit { spec: spec(3, 9, 20, 5), reply }), SubmitOutcome::Accepted);
    wait_for(&b.log, "the late copy's record", |s| s.finished.contains_key(&3));
    assert_eq!(ask(&b, |reply| Command::Submit { spec: spec(3, 9, 20, 5), reply }), SubmitOutcome::Duplicate);
    assert_eq!(forget(4), Ok(false), "never here");
    assert_eq!(forget(3), Ok(true));
    assert_eq!(forget(3), Ok(false), "once");
    assert_eq!(ask(&b, |reply| Command::Submit { spec: spec(3, 9, 20, 5), reply }), SubmitOutcome::Accepted);
    wait_for(&b.log, "its second record", |s| s.tokens.get(&3).is_some_and(|t| t.len() == 2 * 25));
    consistent(&b);
}
