//! Live migration between two real `kvfleet-worker` processes over QUIC with mutual TLS: the KV
//! moves as real bytes in pipelined stages while the request keeps decoding on the source, the
//! target verifies every token, and the token stream continues on the target exactly where the
//! source stopped. Failures (nobody listening, a target without room) abort cleanly: the request
//! finishes on the source with every token exactly once.

mod common;

use common::*;
use kvfleet_proto::v1;
use kvfleet_proto::v1::worker_client::WorkerClient;
use std::time::Duration;
use tonic::transport::Channel;

const EVENTS_TIMEOUT: Duration = Duration::from_secs(120);
const KV_TOKEN_BYTES: u64 = 256 << 10;

/// Submit to a worker, which must accept.
async fn submit(c: &mut WorkerClient<Channel>, spec: v1::RequestSpec) {
    let reply = c.submit(v1::SubmitRequest { spec: Some(spec), incarnation: 0 }).await.expect("Submit").into_inner();
    assert!(reply.accepted, "refused: {reply:?}");
}

/// Token indices of `id` in `c`, in stream order.
fn indices(c: &Collected, id: u64) -> Vec<u32> {
    c.tokens.get(&id).map_or(Vec::new(), |t| t.iter().flat_map(|t| t.first_index..t.first_index + t.count).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_request_moves_with_its_kv_bytes_and_continues_on_the_target() {
    let pki = TestPki::new("live");
    let args = ["--kv-fill", "full", "--kv-memory", "512MiB", "--cpu-memory", "64MiB"];
    let a = WorkerProc::start_tls(&[&args[..], &["--instance", "0"]].concat(), &pki, "worker-0");
    let b = WorkerProc::start_tls(&[&args[..], &["--instance", "1"]].concat(), &pki, "worker-1");
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    let target_kv = cb.info(v1::InfoRequest {}).await.unwrap().into_inner().kv_address;
    assert!(!target_kv.is_empty(), "a TLS worker advertises a migration endpoint");
    // 600 prompt tokens = 38 blocks of 4 MiB (150 MiB of KV) that stage 0 copies while it decodes.
    let (prompt, reasoning, answer) = (600, 400, 40);
    submit(&mut ca, spec(7, a.cluster_now_ns(), prompt, reasoning, answer)).await;
    collect_until(&mut ca, 0, EVENTS_TIMEOUT, |c| indices(c, 7).len() >= 5).await;

    let req = v1::MigrateOutRequest { request_id: 7, target: 1, target_kv_address: target_kv, ..Default::default() };
    let out = ca.migrate_out(req).await.unwrap().into_inner();
    assert_eq!(out.outcome(), v1::MigrationOutcome::MigrationCommitted, "{out:?}");
    let st = out.stats.expect("live migrations report their measurements");
    assert!(st.stages >= 2, "at least one live stage before the stop-and-copy: {st:?}");
    assert_eq!(st.stage_bytes.len() as u32, st.stages);
    let blocks_total = st.kv_tokens.div_ceil(16) as u64;
    assert_eq!(st.blocks, blocks_total, "every block sent exactly once: {st:?}");
    assert_eq!(st.bytes, blocks_total * 16 * KV_TOKEN_BYTES);
    assert!(st.kv_tokens > prompt, "it decoded before and during the copy: {st:?}");
    assert!(st.downtime_ns > 0 && st.downtime_ns < st.ended_ns - st.started_ns, "{st:?}");
    let last = *st.stage_bytes.last().unwrap();
    assert!(last < st.stage_bytes[0], "the stop-and-copy moves less than stage 0: {st:?}");

    // The stream continues on B exactly where A stopped; every token exactly once.
    let on_b = collect_until(&mut cb, 0, EVENTS_TIMEOUT, |c| c.finished.contains_key(&7)).await;
    let generated = st.kv_tokens - prompt;
    let on_a = collect_until(&mut ca, 0, EVENTS_TIMEOUT, |c| indices(c, 7).len() as u32 >= generated).await;
    let (ia, ib) = (indices(&on_a, 7), indices(&on_b, 7));
    assert_eq!(ia, (0..generated).collect::<Vec<_>>(), "A emitted up to the pause");
    assert_eq!(ib, (generated..reasoning + answer).collect::<Vec<_>>(), "B continues at the next token");
    let r = &on_b.finished[&7];
    assert_eq!((r.migrations, r.kv_rematerialized, r.placed_on, r.finished_on), (1, false, 0, Some(1)));
    assert!(!on_a.finished.contains_key(&7));
    // The source no longer knows it.
    let gone = ca.migrate_out(v1::MigrateOutRequest { request_id: 7, target: 1, ..Default::default() }).await;
    assert_eq!(gone.unwrap_err().code(), tonic::Code::NotFound);
}

/// A source started with `--corrupt-sent-blocks` (its blocks' checksums do not match their
/// bytes): the target aborts at the first block, the source's reply says it was a checksum
/// mismatch (not a lost connection: the target resets the data streams as its Abort leaves), and
/// the request carries on at the source, finishing there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_failing_their_checksum_abort_the_move_and_the_reply_says_so() {
    let pki = TestPki::new("corrupt");
    let args = ["--kv-fill", "stamp", "--kv-memory", "256MiB"];
    let a = WorkerProc::start_tls(&[&args[..], &["--instance", "0", "--corrupt-sent-blocks"]].concat(), &pki, "w0");
    let b = WorkerProc::start_tls(&[&args[..], &["--instance", "1"]].concat(), &pki, "w1");
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    let target_kv = cb.info(v1::InfoRequest {}).await.unwrap().into_inner().kv_address;
    submit(&mut ca, spec(3, a.cluster_now_ns(), 300, 100, 20)).await;
    collect_until(&mut ca, 0, EVENTS_TIMEOUT, |c| indices(c, 3).len() >= 3).await;
    for _ in 0..3 {
        let req = v1::MigrateOutRequest {
            request_id: 3,
            target: 1,
            target_kv_address: target_kv.clone(),
            ..Default::default()
        };
        let out = ca.migrate_out(req).await.unwrap().into_inner();
        assert_eq!(out.outcome(), v1::MigrationOutcome::MigrationAborted, "{out:?}");
        let st = out.stats.expect("stats");
        assert!(st.checksum_mismatch, "the reply names the cause: {st:?}");
        assert!(st.abort_reason.contains("CHECKSUM_MISMATCH"), "{}", st.abort_reason);
        assert!(st.stage_bytes.iter().sum::<u64>() > 0, "blocks were sent: {st:?}");
    }
    let on_a = collect_until(&mut ca, 0, EVENTS_TIMEOUT, |c| c.finished.contains_key(&3)).await;
    assert_eq!(indices(&on_a, 3), (0..120).collect::<Vec<_>>(), "every token once, at the source");
    assert_eq!(on_a.finished[&3].migrations, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_migrations_abort_and_the_request_finishes_on_the_source() {
    let pki = TestPki::new("abort");
    let args = ["--kv-fill", "stamp", "--migration-timeout-ms", "3000"];
    let a = WorkerProc::start_tls(&[&args[..], &["--instance", "0", "--kv-memory", "256MiB"]].concat(), &pki, "w0");
    // B has room for 4 blocks: a 200-token request (13 blocks) cannot be reserved there.
    let b = WorkerProc::start_tls(
        &[&args[..], &["--instance", "1", "--kv-memory", "16MiB", "--cpu-memory", "16MiB"]].concat(),
        &pki,
        "w1",
    );
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    let target_kv = cb.info(v1::InfoRequest {}).await.unwrap().into_inner().kv_address;
    submit(&mut ca, spec(3, a.cluster_now_ns(), 200, 200, 20)).await;
    collect_until(&mut ca, 0, EVENTS_TIMEOUT, |c| indices(c, 3).len() >= 3).await;

    // Target full: PREPARE refused.
    let full = v1::MigrateOutRequest { request_id: 3, target: 1, target_kv_address: target_kv, ..Default::default() };
    let out = ca.migrate_out(full).await.unwrap().into_inner();
    assert_eq!(out.outcome(), v1::MigrationOutcome::MigrationAborted, "{out:?}");
    let reason = out.stats.unwrap().abort_reason;
    assert!(reason.contains("refused") || reason.contains("room"), "{reason}");

    // Nobody listening at the target address: aborted, not hung, not lost.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let nowhere = silent.local_addr().unwrap().to_string();
    let out = ca
        .migrate_out(v1::MigrateOutRequest {
            request_id: 3,
            target: 1,
            target_kv_address: nowhere,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(out.outcome(), v1::MigrationOutcome::MigrationAborted, "{out:?}");
    drop(silent);

    // Malformed address: InvalidArgument naming the field.
    let bad = v1::MigrateOutRequest {
        request_id: 3,
        target: 1,
        target_kv_address: "not an address".into(),
        ..Default::default()
    };
    let e = ca.migrate_out(bad).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("target_kv_address"), "{e}");

    let c = collect_until(&mut ca, 0, EVENTS_TIMEOUT, |c| c.finished.contains_key(&3)).await;
    assert_eq!(indices(&c, 3), (0..220).collect::<Vec<_>>(), "every token once, all on A");
    assert_eq!(c.finished[&3].finished_on, Some(0));
    assert_eq!(
        cb.load(v1::LoadRequest {}).await.unwrap().into_inner().gpu_used_blocks,
        0,
        "nothing left reserved on B"
    );
}

/// The coordinator that asked for a migration dies (its call is cancelled) in the middle of the
/// copy: the migration still runs to its end, so the request is neither left paused on its
/// source nor lost; here, with no fault, it commits and finishes on the target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_outlives_the_cancelled_call_that_started_it() {
    let pki = TestPki::new("cancel");
    let args = ["--kv-fill", "stamp", "--kv-memory", "512MiB", "--cpu-memory", "64MiB"];
    let a = WorkerProc::start_tls(&[&args[..], &["--instance", "0"]].concat(), &pki, "w0");
    let b = WorkerProc::start_tls(&[&args[..], &["--instance", "1"]].concat(), &pki, "w1");
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    let target_kv = cb.info(v1::InfoRequest {}).await.unwrap().into_inner().kv_address;
    // 1200 prompt tokens: 75 blocks (300 MiB) to copy, long enough to cancel the call mid-copy.
    let (prompt, reasoning, answer) = (1200, 300, 20);
    submit(&mut ca, spec(11, a.cluster_now_ns(), prompt, reasoning, answer)).await;
    collect_until(&mut ca, 0, EVENTS_TIMEOUT, |c| indices(c, 11).len() >= 3).await;

    // Start the migration on a connection of its own, and close that connection (as a dying
    // coordinator's would close) once the target has reserved room (PREPARE done).
    let mut caller = a.client().await;
    let mut call = Box::pin(async move {
        caller
            .migrate_out(v1::MigrateOutRequest {
                request_id: 11,
                target: 1,
                target_kv_address: target_kv,
                ..Default::default()
            })
            .await
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        tokio::select! {
            r = &mut call => panic!("the migration ended before the call could be cancelled: {r:?}"),
            _ = tokio::time::sleep(Duration::from_millis(2)) => {}
        }
        if cb.load(v1::LoadRequest {}).await.unwrap().into_inner().gpu_used_blocks > 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the target never reserved room");
    }
    drop(call); // and with it the caller's only connection

    // It commits anyway and finishes on B; every token exactly once across A and B.
    let on_b = collect_until(&mut cb, 0, EVENTS_TIMEOUT, |c| c.finished.contains_key(&11)).await;
    let r = &on_b.finished[&11];
    assert_eq!((r.migrations, r.finished_on), (1, Some(1)), "{r:?}");
    let ib = indices(&on_b, 11);
    let first_on_b = *ib.first().expect("tokens on B");
    let on_a = collect_until(&mut ca, 0, EVENTS_TIMEOUT, |c| indices(c, 11).len() as u32 >= first_on_b).await;
    let ia = indices(&on_a, 11);
    assert_eq!(ia, (0..first_on_b).collect::<Vec<_>>(), "A emitted up to the pause");
    assert_eq!(ib, (first_on_b..reasoning + answer).collect::<Vec<_>>(), "B continues at the next token");
    assert!(!on_a.finished.contains_key(&11), "A does not finish it too");
}

/// What a leader that took over does with a move its predecessor recorded as started: it asks
/// the target (which from then on refuses every move started up to then) and tells the source
/// which copy lives. A source that is not in doubt (the move never started, is still copying, or
/// settled long ago) goes on undisturbed, and the fenced target refuses the move if it comes; a
/// move the leader starts after the fence lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_successor_settling_a_move_that_is_not_in_doubt_leaves_the_request_running() {
    let pki = TestPki::new("settle");
    let args = ["--kv-fill", "stamp", "--kv-memory", "256MiB", "--cpu-memory", "64MiB"];
    let a = WorkerProc::start_tls(&[&args[..], &["--instance", "0"]].concat(), &pki, "w0");
    let b = WorkerProc::start_tls(&[&args[..], &["--instance", "1"]].concat(), &pki, "w1");
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    let target_kv = cb.info(v1::InfoRequest {}).await.unwrap().into_inner().kv_address;
    submit(&mut ca, spec(9, a.cluster_now_ns(), 100, 150, 20)).await;
    collect_until(&mut ca, 0, EVENTS_TIMEOUT, |c| indices(c, 9).len() >= 3).await;

    // The leader of term 5 has started 3 moves.
    let ask = v1::ResolveMigrationRequest { request_id: 9, committed: None, fence_term: 5, fence_seq: 3 };
    let held = cb.resolve_migration(ask).await.unwrap().into_inner().held;
    assert!(!held, "B never received it");
    let tell = v1::ResolveMigrationRequest { request_id: 9, committed: Some(false), ..Default::default() };
    let told = ca.resolve_migration(tell).await.expect("telling a source that is not in doubt is not an error");
    assert!(!told.into_inner().moving, "no move under way");

    // The fenced target refuses the move (its third); the request stays where it runs.
    let move_of = |seq| v1::MigrateOutRequest {
        request_id: 9,
        target: 1,
        target_kv_address: target_kv.clone(),
        leader_term: 5,
        move_seq: seq,
    };
    let out = ca.migrate_out(move_of(3)).await.unwrap().into_inner();
    assert_eq!(out.outcome(), v1::MigrationOutcome::MigrationAborted, "{out:?}");
    let reason = out.stats.unwrap().abort_reason;
    assert!(reason.contains("settled elsewhere"), "{reason}");
    assert_eq!(cb.load(v1::LoadRequest {}).await.unwrap().into_inner().gpu_used_blocks, 0, "nothing reserved on B");

    // The leader's next move of it lands; every token once, A's then B's.
    let out = ca.migrate_out(move_of(4)).await.unwrap().into_inner();
    assert_eq!(out.outcome(), v1::MigrationOutcome::MigrationCommitted, "{out:?}");
    let generated = out.kv_tokens - 100;
    let on_b = collect_until(&mut cb, 0, EVENTS_TIMEOUT, |c| c.finished.contains_key(&9)).await;
    let on_a = collect_until(&mut ca, 0, EVENTS_TIMEOUT, |c| indices(c, 9).len() as u32 >= generated).await;
    assert_eq!(indices(&on_a, 9), (0..generated).collect::<Vec<_>>());
    assert_eq!(indices(&on_b, 9), (generated..170).collect::<Vec<_>>());
    assert_eq!((on_b.finished[&9].finished_on, on_b.finished[&9].migrations), (Some(1), 1));
}

/// Wait until `cond` holds on the worker's load report (polled; fails after 60 s).
async fn wait_load(
    c: &mut kvfleet_proto::v1::worker_client::WorkerClient<tonic::transport::Channel>,
    what: &str,
    cond: impl Fn(&v1::LoadReport) -> bool,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let l = c.load(v1::LoadRequest {}).await.expect("load").into_inner();
        if cond(&l) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what}: last load {l:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// kill -9 of either side in the middle of a copy (the source's link is shaped to 0.4 Gbit/s, so
/// the 150 MiB stage 0 takes ≥ 3 s and the kill, sent once the target holds a reservation, lands
/// mid-copy): a dead target → the migration aborts and the request finishes on the source with
/// every token once; a dead source → the target releases its reservation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_killed_mid_copy_aborts_without_losing_the_request() {
    let pki = TestPki::new("kill");
    let common = ["--kv-fill", "stamp", "--kv-memory", "512MiB", "--migration-timeout-ms", "4000"];
    let shaped = ["--link-gbps", "0.4"];
    let a = WorkerProc::start_tls(&[&common[..], &shaped[..], &["--instance", "0"]].concat(), &pki, "k0");
    let mut b = WorkerProc::start_tls(&[&common[..], &["--instance", "1"]].concat(), &pki, "k1");
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    let target_kv = cb.info(v1::InfoRequest {}).await.unwrap().into_inner().kv_address;
    let (prompt, reasoning, answer) = (600, 400, 10);
    let s = spec(11, a.cluster_now_ns(), prompt, reasoning, answer);
    assert!(ca.submit(v1::SubmitRequest { spec: Some(s), incarnation: 0 }).await.unwrap().into_inner().accepted);
    collect_until(&mut ca, 0, EVENTS_TIMEOUT, |c| !indices(c, 11).is_empty()).await;
    let mut mover = a.client().await;
    let req = v1::MigrateOutRequest { request_id: 11, target: 1, target_kv_address: target_kv, ..Default::default() };
    let migration = tokio::spawn(async move { mover.migrate_out(req).await });
    wait_load(&mut cb, "the target reserves blocks", |l| l.gpu_used_blocks > 0).await;
    b.signal("KILL");
    b.wait_exit(Duration::from_secs(10));
    let out = migration.await.unwrap().expect("the source answers").into_inner();
    assert_eq!(out.outcome(), v1::MigrationOutcome::MigrationAborted, "{out:?}");
    let c = collect_until(&mut ca, 0, EVENTS_TIMEOUT, |c| c.finished.contains_key(&11)).await;
    assert_eq!(indices(&c, 11), (0..reasoning + answer).collect::<Vec<_>>(), "every token once, on A");
    assert_eq!(c.finished[&11].finished_on, Some(0));

    // The other way round: the source dies mid-copy; the target frees what it reserved.
    let c2 = WorkerProc::start_tls(&[&common[..], &["--instance", "2"]].concat(), &pki, "k2");
    let mut cc = c2.client().await;
    let target_kv = cc.info(v1::InfoRequest {}).await.unwrap().into_inner().kv_address;
    let mut a = a;
    let s = spec(12, a.cluster_now_ns(), prompt, reasoning, answer);
    assert!(ca.submit(v1::SubmitRequest { spec: Some(s), incarnation: 0 }).await.unwrap().into_inner().accepted);
    collect_until(&mut ca, 0, EVENTS_TIMEOUT, |c| !indices(c, 12).is_empty()).await;
    let mut mover = a.client().await;
    let req = v1::MigrateOutRequest { request_id: 12, target: 2, target_kv_address: target_kv, ..Default::default() };
    let _migration = tokio::spawn(async move { mover.migrate_out(req).await });
    wait_load(&mut cc, "the target reserves blocks", |l| l.gpu_used_blocks > 0).await;
    a.signal("KILL");
    a.wait_exit(Duration::from_secs(10));
    wait_load(&mut cc, "the target releases its reservation", |l| l.gpu_used_blocks == 0).await;
}

/// Cache-aware placement's prefix fetch between two worker processes over QUIC: B copies the
/// prompt blocks A caches (each checksummed on the wire and its stamps checked at B), a request
/// with that prompt then hits them at B; a prompt A does not cache, or a holder nobody listens
/// at, copies nothing and the request still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_fetches_a_cached_prefix_from_its_holder_and_a_prompt_hits_it() {
    let pki = TestPki::new("fetch");
    let args = ["--kv-fill", "full", "--kv-memory", "512MiB", "--cpu-memory", "64MiB", "--prefix-caching"];
    let a = WorkerProc::start_tls(&[&args[..], &["--instance", "0"]].concat(), &pki, "worker-0");
    let b = WorkerProc::start_tls(&[&args[..], &["--instance", "1"]].concat(), &pki, "worker-1");
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    let holder = ca.info(v1::InfoRequest {}).await.unwrap().into_inner().kv_address;
    // 600 prompt tokens with content: 37 full blocks hash, all a later prompt can hit.
    let with_content =
        |id, ids: &[u64]| v1::RequestSpec { content_ids: ids.to_vec(), ..spec(id, a.cluster_now_ns(), 600, 4, 4) };
    submit(&mut ca, with_content(1, &[42, 43])).await;
    collect_until(&mut ca, 0, EVENTS_TIMEOUT, |c| c.finished.contains_key(&1)).await;

    let fetch = |spec: v1::RequestSpec, holder: &str| v1::FetchPrefixRequest {
        spec: Some(spec),
        holder_kv_address: holder.to_string(),
        first: 0,
        end: 37,
    };
    let got = cb.fetch_prefix(fetch(with_content(2, &[42, 43]), &holder)).await.expect("fetch").into_inner();
    assert_eq!((got.blocks, got.bytes), (37, 37 * 16 * KV_TOKEN_BYTES), "every cached block, once");
    // Other content: A caches none of it.
    let none = cb.fetch_prefix(fetch(with_content(3, &[7, 8]), &holder)).await.expect("fetch").into_inner();
    assert_eq!((none.blocks, none.bytes), (0, 0));
    // Nobody listens there: the fetch fails, saying so.
    let dead = std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let err = cb.fetch_prefix(fetch(with_content(4, &[42, 43]), &dead)).await.expect_err("nobody there");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");

    // Request 2 finds the fetched blocks at B; request 3's prompt is computed in full.
    submit(&mut cb, with_content(2, &[42, 43])).await;
    submit(&mut cb, with_content(3, &[7, 8])).await;
    let on_b =
        collect_until(&mut cb, 0, EVENTS_TIMEOUT, |c| c.finished.contains_key(&2) && c.finished.contains_key(&3)).await;
    assert_eq!(on_b.finished[&2].cached_tokens, 37 * 16, "{:?}", on_b.finished[&2]);
    assert_eq!(on_b.finished[&3].cached_tokens, 0);
    drop((ca, cb));
    for (w, name) in [(a, "A"), (b, "B")] {
        w.signal("TERM");
        let line = w.stopped_line(Duration::from_secs(30));
        assert_eq!(field(&line, "kv_errors"), 0.0, "{name}: {line}");
    }
}
