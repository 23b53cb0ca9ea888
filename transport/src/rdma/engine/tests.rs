//! The engine driven by hand: two engines joined by a recording fabric whose posts the test
//! delivers (copy into the peer's ring, receive completion there, send completion here), one step
//! at a time, so ring wraps, credits and flow control are checked deterministically.

use super::*;
use std::sync::Mutex;
use std::task::Waker;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Post {
    Write { offset: usize, len: usize, imm: u32 },
    Probe,
}

#[derive(Default)]
struct Log {
    posts: VecDeque<Post>,
    shutdown: bool,
}

struct Recorder(Arc<Mutex<Log>>);

impl Fabric for Recorder {
    fn write_imm(&mut self, offset: usize, len: usize, imm: u32) -> Result<(), String> {
        self.0.lock().unwrap().posts.push_back(Post::Write { offset, len, imm });
        Ok(())
    }
    fn probe(&mut self) -> Result<(), String> {
        self.0.lock().unwrap().posts.push_back(Post::Probe);
        Ok(())
    }
    fn shutdown(&mut self) {
        self.0.lock().unwrap().shutdown = true;
    }
}

struct Side {
    engine: Engine,
    log: Arc<Mutex<Log>>,
    staging: Arc<Region>,
    ring: Arc<Region>,
}

struct Pair {
    a: Side,
    b: Side,
}

fn cfg(max_payload: usize, window: u64) -> EngineConfig {
    EngineConfig { max_payload, stream_window: window, send_queue_depth: 16 }
}

fn pair(ring: usize, c: EngineConfig) -> Pair {
    let a_ring = Arc::new(Region::new(ring).unwrap());
    let b_ring = Arc::new(Region::new(ring).unwrap());
    let side = |initiator: bool, own_ring: Arc<Region>, peer_ring_len: usize| {
        let log = Arc::new(Mutex::new(Log::default()));
        let staging = Arc::new(Region::new(peer_ring_len).unwrap());
        let engine = Engine::new(initiator, c, Box::new(Recorder(log.clone())), staging.clone(), own_ring.clone());
        Side { engine, log, staging, ring: own_ring }
    };
    Pair { a: side(true, a_ring, ring), b: side(false, b_ring, ring) }
}

fn noop_cx() -> Context<'static> {
    Context::from_waker(Waker::noop())
}

impl Pair {
    /// Deliver one post of `from` to the other side; false when `from` posted nothing.
    fn step(&mut self, a_to_b: bool) -> bool {
        let (from, to) = if a_to_b { (&mut self.a, &mut self.b) } else { (&mut self.b, &mut self.a) };
        let Some(post) = from.log.lock().unwrap().posts.pop_front() else { return false };
        match post {
            Post::Write { offset, len, imm } => {
                // SAFETY: single-threaded test; the engines' ranges are as in the real protocol.
                unsafe { from.staging.copy_to(&to.ring, offset, len) };
                to.engine.on_imm(imm);
            }
            Post::Probe => {}
        }
        from.engine.on_send_done();
        true
    }

    /// Deliver everything, both ways, until nothing moves.
    fn settle(&mut self) {
        while self.step(true) | self.step(false) {}
    }

    fn write_all(&mut self, a_side: bool, id: u32, mut data: &[u8]) {
        let mut stuck = 0;
        while !data.is_empty() {
            let side = if a_side { &mut self.a } else { &mut self.b };
            match side.engine.poll_write(id, &noop_cx(), data) {
                Poll::Ready(Ok(n)) => {
                    data = &data[n..];
                    stuck = 0;
                }
                Poll::Ready(Err(e)) => panic!("write failed: {e}"),
                Poll::Pending => {
                    stuck += 1;
                    assert!(stuck < 3, "writer stuck with {} bytes left", data.len());
                    self.settle();
                }
            }
        }
    }

    fn read_available(&mut self, a_side: bool, id: u32) -> (Vec<u8>, bool) {
        let side = if a_side { &mut self.a } else { &mut self.b };
        let mut out = Vec::new();
        let mut buf = vec![0u8; 4096];
        loop {
            let mut rb = ReadBuf::new(&mut buf);
            match side.engine.poll_read(id, &noop_cx(), &mut rb) {
                Poll::Ready(Ok(())) if rb.filled().is_empty() => return (out, true),
                Poll::Ready(Ok(())) => out.extend_from_slice(rb.filled()),
                Poll::Ready(Err(e)) => panic!("read failed: {e}"),
                Poll::Pending => return (out, false),
            }
        }
    }
}

fn accept(e: &mut Engine) -> u32 {
    match e.poll_accept(&noop_cx()) {
        Poll::Ready(Ok(id)) => id,
        other => panic!("expected a stream to accept, got {other:?}"),
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| ((seed.wrapping_mul(31).wrapping_add(i as u64 * 7)) >> 1) as u8).collect()
}

#[test]
fn streams_cross_a_small_ring_many_times_intact() {
    // A 4 KiB ring: records of at most 1008 payload bytes, 1 MiB per stream wraps it hundreds of times.
    assert_eq!(EngineConfig::clamp_payload(1 << 20, 4096), 1008);
    assert_eq!(EngineConfig::clamp_payload(1 << 20, 16 << 20), 1 << 20);
    for ring in (256..20_000).step_by(64) {
        let p = EngineConfig::clamp_payload(1 << 20, ring);
        assert!(super::record_ring_bytes(p) <= ring / 4, "ring {ring}: payload {p}");
    }
    let mut p = pair(4096, cfg(EngineConfig::clamp_payload(1 << 20, 4096), 1 << 30));
    let s0 = p.a.engine.open_stream().unwrap();
    let s2 = p.a.engine.open_stream().unwrap();
    assert_eq!((s0, s2), (0, 2));
    p.settle();
    assert_eq!(accept(&mut p.b.engine), 0);
    assert_eq!(accept(&mut p.b.engine), 2);
    let (d0, d2) = (pattern(1, 1 << 20), pattern(2, (1 << 20) + 77));
    let (mut got0, mut got2) = (Vec::new(), Vec::new());
    for (c0, c2) in d0.chunks(10_000).zip(d2.chunks(10_000)) {
        p.write_all(true, s0, c0);
        p.write_all(true, s2, c2);
        p.settle();
        got0.extend(p.read_available(false, s0).0);
        got2.extend(p.read_available(false, s2).0);
    }
    p.a.engine.shutdown_write(s0).unwrap();
    p.a.engine.shutdown_write(s2).unwrap();
    p.settle();
    let (rest0, eof0) = p.read_available(false, s0);
    let (rest2, eof2) = p.read_available(false, s2);
    got0.extend(rest0);
    got2.extend(rest2);
    assert!(eof0 && eof2, "both streams end with EOF");
    assert!(got0 == d0 && got2 == d2, "stream contents differ");
    let st = p.a.engine.stats();
    assert!(st.ring_wraps > 100, "{st:?}");
    assert_eq!(st.data_bytes_sent, (d0.len() + d2.len()) as u64);
    assert!(p.b.engine.stats().credits_sent > 100, "credits flow back");
    assert!(p.a.engine.closed.is_none() && p.b.engine.closed.is_none());
}

#[test]
fn flow_control_holds_a_writer_until_its_reader_reads() {
    let window = 8192u64;
    let mut p = pair(1 << 16, cfg(1024, window));
    let s = p.a.engine.open_stream().unwrap();
    p.settle();
    accept(&mut p.b.engine);
    let data = pattern(3, 20_000);
    let mut sent = 0;
    while let Poll::Ready(Ok(n)) = p.a.engine.poll_write(s, &noop_cx(), &data[sent..]) {
        sent += n;
        p.settle();
    }
    assert_eq!(sent as u64, window, "the writer stops exactly at the window");
    assert!(matches!(p.a.engine.poll_write(s, &noop_cx(), &data[sent..]), Poll::Pending));
    // The reader reads: window updates let the writer go on, a window at a time.
    let mut got = Vec::new();
    while sent < data.len() {
        let (chunk, _) = p.read_available(false, s);
        assert!(!chunk.is_empty(), "the reader has data while the writer waits");
        got.extend(chunk);
        p.settle();
        while sent < data.len() {
            let Poll::Ready(Ok(n)) = p.a.engine.poll_write(s, &noop_cx(), &data[sent..]) else { break };
            sent += n;
            assert!(sent as u64 <= got.len() as u64 + window, "the writer ran past the window");
            p.settle();
        }
    }
    got.extend(p.read_available(false, s).0);
    assert!(got == data);
}

#[test]
fn a_window_overrun_is_a_protocol_error() {
    let mut p = pair(1 << 16, cfg(4096, 4096));
    let s = p.a.engine.open_stream().unwrap();
    p.settle();
    accept(&mut p.b.engine);
    // A misbehaving sender ignores the window (forge its limit).
    p.a.engine.streams.get_mut(&s).unwrap().tx_limit = 1 << 20;
    p.write_all(true, s, &pattern(4, 4096 + 64));
    p.settle();
    let reason = p.b.engine.close_reason().expect("the receiver closes the connection");
    assert!(reason.contains("overran its flow-control window"), "{reason}");
    assert!(p.b.log.lock().unwrap().shutdown, "the I/O thread is told");
}

#[test]
fn a_corrupted_ring_is_detected() {
    let mut p = pair(4096, cfg(512, 1 << 20));
    let s = p.a.engine.open_stream().unwrap();
    p.settle();
    accept(&mut p.b.engine);
    p.write_all(true, s, b"hello");
    // Corrupt the record's position stamp in flight.
    let Some(Post::Write { offset, .. }) = p.a.log.lock().unwrap().posts.front().copied() else { panic!() };
    // SAFETY: single-threaded test.
    unsafe { p.a.staging.write(offset + 12, &[0xff; 4]) };
    p.settle();
    let reason = p.b.engine.close_reason().expect("closed");
    assert!(reason.contains("ring out of sync"), "{reason}");
    // And a record whose immediate disagrees with its header.
    let mut p = pair(4096, cfg(512, 1 << 20));
    p.a.engine.open_stream().unwrap();
    p.a.log.lock().unwrap().posts.clear();
    p.b.engine.on_imm(Imm::Record { ring_bytes: 128 }.encode());
    assert!(p.b.engine.close_reason().unwrap().contains("protocol error"));
}

#[test]
fn a_credit_beyond_what_is_outstanding_is_refused() {
    let mut p = pair(4096, cfg(512, 1 << 20));
    p.a.engine.on_imm(Imm::Credit { bytes: 64 }.encode());
    assert!(p.a.engine.close_reason().unwrap().contains("credited 64 ring bytes, only 0"));
}

#[test]
fn records_for_streams_never_opened_or_out_of_order_close_the_connection() {
    let mut p = pair(4096, cfg(512, 1 << 20));
    // The acceptor may not open even ids.
    p.b.engine.next_local = 4;
    p.b.engine.open_stream().unwrap();
    p.settle();
    assert!(p.a.engine.close_reason().unwrap().contains("out of order"));
}

#[test]
fn a_dropped_reader_stops_the_writer_and_finished_streams_are_forgotten() {
    let mut p = pair(1 << 16, cfg(1024, 1 << 20));
    let s = p.a.engine.open_stream().unwrap();
    p.settle();
    let r = accept(&mut p.b.engine);
    p.write_all(true, s, b"some bytes");
    p.settle();
    p.b.engine.drop_reader(r);
    p.settle();
    match p.a.engine.poll_write(s, &noop_cx(), b"more") {
        Poll::Ready(Err(e)) => assert_eq!(e.kind(), io::ErrorKind::BrokenPipe, "{e}"),
        other => panic!("expected the writer to fail, got {other:?}"),
    }
    // Late data for the stopped stream is dropped quietly, not a protocol error.
    p.b.engine.drop_writer(r);
    assert_eq!(p.b.engine.open_streams(), 0);
    p.a.engine.streams.get_mut(&s).unwrap().tx_stopped = false;
    p.write_all(true, s, b"late");
    p.settle();
    assert!(p.b.engine.closed.is_none());
    // A dropped writer finishes its stream: the peer reads EOF.
    let s2 = p.a.engine.open_stream().unwrap();
    p.settle();
    let r2 = accept(&mut p.b.engine);
    p.write_all(true, s2, b"last words");
    p.a.engine.drop_writer(s2);
    p.settle();
    assert_eq!(p.read_available(false, r2), (b"last words".to_vec(), true));
}

#[test]
fn closing_tells_the_peer_why_and_fails_everything() {
    let mut p = pair(4096, cfg(512, 1 << 20));
    let s = p.a.engine.open_stream().unwrap();
    p.settle();
    let r = accept(&mut p.b.engine);
    p.b.engine.close_local("migration aborted");
    assert!(p.b.log.lock().unwrap().shutdown);
    p.settle();
    assert_eq!(p.a.engine.close_reason(), Some("closed by the peer: migration aborted"));
    let mut buf = [0u8; 8];
    match p.a.engine.poll_read(s, &noop_cx(), &mut ReadBuf::new(&mut buf)) {
        Poll::Ready(Err(e)) => assert_eq!(e.kind(), io::ErrorKind::NotConnected),
        other => panic!("expected NotConnected, got {other:?}"),
    }
    match p.b.engine.poll_write(r, &noop_cx(), b"x") {
        Poll::Ready(Err(e)) => assert_eq!(e.kind(), io::ErrorKind::NotConnected),
        other => panic!("expected NotConnected, got {other:?}"),
    }
    assert!(p.a.engine.open_stream().is_err());
    assert!(matches!(p.a.engine.poll_accept(&noop_cx()), Poll::Ready(Err(_))));
}

#[test]
fn idle_probes_use_a_send_slot_and_nothing_at_the_peer() {
    let mut p = pair(4096, cfg(512, 1 << 20));
    p.a.engine.probe();
    assert_eq!(p.a.log.lock().unwrap().posts.front(), Some(&Post::Probe));
    assert_eq!(p.a.engine.sends_in_flight(), 1);
    p.settle();
    assert_eq!(p.a.engine.sends_in_flight(), 0);
    assert_eq!(p.b.engine.stats().records_received, 0);
}

mod props {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        /// Write `len` bytes on local stream `stream` of side A (or B).
        Write { a: bool, stream: usize, len: usize },
        /// Deliver up to `n` posts from A to B (or B to A).
        Deliver { a: bool, n: usize },
        /// Read what is there on side A's (or B's) stream `stream`.
        Read { a: bool, stream: usize },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (any::<bool>(), 0..3usize, 0..3000usize).prop_map(|(a, stream, len)| Op::Write { a, stream, len }),
            (any::<bool>(), 1..20usize).prop_map(|(a, n)| Op::Deliver { a, n }),
            (any::<bool>(), 0..3usize).prop_map(|(a, stream)| Op::Read { a, stream }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Any interleaving of writes, deliveries and reads, both ways, on any ring size: every
        /// byte arrives once, in order, on its stream, and neither side sees a protocol error.
        #[test]
        fn every_byte_arrives_in_order(
            ring_units in 4usize..64,
            window in 1024u64..20_000,
            ops in proptest::collection::vec(op(), 1..200),
        ) {
            let ring = ring_units * 256;
            let mut p = pair(ring, cfg(EngineConfig::clamp_payload(1 << 20, ring), window));
            // Three streams each way: A opens 0, 2, 4; B opens 1, 3, 5.
            let a_ids: Vec<u32> = (0..3).map(|_| p.a.engine.open_stream().unwrap()).collect();
            let b_ids: Vec<u32> = (0..3).map(|_| p.b.engine.open_stream().unwrap()).collect();
            p.settle();
            for _ in 0..3 {
                accept(&mut p.a.engine);
                accept(&mut p.b.engine);
            }
            // sent[a][s]: bytes written by side a on its stream s; got[a][s]: read by the other side.
            let mut sent = vec![vec![Vec::new(); 3]; 2];
            let mut got = vec![vec![Vec::new(); 3]; 2];
            let mut seed = 0u64;
            for op in ops {
                match op {
                    Op::Write { a, stream, len } => {
                        seed += 1;
                        let data = pattern(seed, len);
                        let (side, id) = if a { (&mut p.a, a_ids[stream]) } else { (&mut p.b, b_ids[stream]) };
                        if let Poll::Ready(r) = side.engine.poll_write(id, &noop_cx(), &data) {
                            let n = r.expect("write");
                            sent[usize::from(!a)][stream].extend_from_slice(&data[..n]);
                        }
                    }
                    Op::Deliver { a, n } => {
                        for _ in 0..n {
                            p.step(a);
                        }
                    }
                    Op::Read { a, stream } => {
                        // Side `a` reads the stream the other side opened.
                        let id = if a { b_ids[stream] } else { a_ids[stream] };
                        let (data, _) = p.read_available(a, id);
                        got[usize::from(a)][stream].extend(data);
                    }
                }
                prop_assert!(p.a.engine.closed.is_none(), "A closed: {:?}", p.a.engine.closed);
                prop_assert!(p.b.engine.closed.is_none(), "B closed: {:?}", p.b.engine.closed);
            }
            // Liveness: with readers reading, every stream takes more data (no lost credit or
            // window update leaves a writer stuck), then everything drains.
            let drain = |p: &mut Pair, got: &mut Vec<Vec<Vec<u8>>>| {
                let mut moved = false;
                p.settle();
                for s in 0..3 {
                    let (d, _) = p.read_available(true, b_ids[s]);
                    moved |= !d.is_empty();
                    got[1][s].extend(d);
                    let (d, _) = p.read_available(false, a_ids[s]);
                    moved |= !d.is_empty();
                    got[0][s].extend(d);
                }
                moved
            };
            for (a, s) in [(true, 0), (true, 1), (true, 2), (false, 0), (false, 1), (false, 2)] {
                seed += 1;
                let data = pattern(seed, 4 * window as usize + 100);
                let mut off = 0;
                let mut stuck = 0;
                while off < data.len() {
                    let (side, id) = if a { (&mut p.a, a_ids[s]) } else { (&mut p.b, b_ids[s]) };
                    match side.engine.poll_write(id, &noop_cx(), &data[off..]) {
                        Poll::Ready(r) => {
                            let n = r.expect("write");
                            sent[usize::from(!a)][s].extend_from_slice(&data[off..off + n]);
                            off += n;
                            stuck = 0;
                        }
                        Poll::Pending => {
                            stuck += 1;
                            prop_assert!(stuck < 50, "writer {} stream {s} stuck at {off} of {}", if a { "A" } else { "B" }, data.len());
                            drain(&mut p, &mut got);
                        }
                    }
                }
            }
            while drain(&mut p, &mut got) {}
            // sent[0] = A's writes (read by B into got[0]); sent[1] = B's (read by A into got[1]).
            for s in 0..3 {
                prop_assert!(got[0][s] == sent[0][s], "A->B stream {s}: {} of {} bytes", got[0][s].len(), sent[0][s].len());
                prop_assert!(got[1][s] == sent[1][s], "B->A stream {s}: {} of {} bytes", got[1][s].len(), sent[1][s].len());
            }
        }
    }
}
