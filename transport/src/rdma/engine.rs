//! One RDMA connection's protocol engine: many byte streams multiplexed over one reliable-connected
//! queue pair, moved as records by RDMA WRITE WITH IMMEDIATE into the peer's registered ring.
//!
//! No verbs and no threads here: the engine is a plain struct behind the connection's mutex. The
//! stream halves call `poll_read`/`poll_write`/...; the connection's I/O thread (real verbs, or
//! the emulated fabric) feeds it completions (`on_imm`, `on_send_done`, `shut`); it posts through
//! the [`Fabric`] trait. So the same code runs on an InfiniBand/RoCE NIC and in the tests.
//!
//! # Rings and credits
//!
//! Each side owns a receive ring registered for REMOTE_WRITE and a staging region of the same size
//! as the peer's ring, which mirrors it: a record for ring offset `o` is built at staging offset
//! `o` and written from there to the peer's ring offset `o`. The sender appends at `tx_tail`
//! and may use `ring - (tx_tail - tx_freed)` bytes; the receiver parses one record per
//! completion (RC delivers writes and their completions in order), copies stream data out, and
//! frees the ring bytes at once. Freed bytes go back as a credit immediate once a quarter of the
//! ring is free: records are at most a quarter of the ring (a wrap costs at most two), so a
//! blocked sender always has more than a quarter outstanding and the credit always comes. A
//! staging range is rewritten only after its credit came back, so it was delivered: no send
//! completion is needed to reuse it (completions only count send-queue slots).
//!
//! # Streams
//!
//! Like QUIC's: the connecting side opens even ids, the accepting side odd ones; `Open`, `Fin`
//! (also when a writer is dropped: quinn 0.11 and the in-memory transport finish a dropped writer
//! too) and `Stop` (reader dropped: the peer's writer fails) records, and per-stream
//! flow control (`Window` records, a window of `stream_window` bytes) so a stream whose reader
//! stalls cannot fill the receiver's memory: received data waits in the stream's queue, not in
//! the ring, so one stalled stream never blocks the others. Control records go through one FIFO
//! and a writer posts data only when that FIFO is empty, so `Open` precedes a stream's data and
//! `Fin` follows it.

use super::verbs::Region;
use super::wire::{
    record_ring_bytes, Imm, RecordHeader, RecordKind, WireError, MAX_CLOSE_REASON_BYTES, RECORD_ALIGN,
    RECORD_HEADER_BYTES, WINDOW_PAYLOAD_BYTES,
};
use bytes::Bytes;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use tokio::io::ReadBuf;

/// Posts work requests on the queue pair (or emulates them). Called with the engine locked, so
/// posts happen in ring order.
pub(crate) trait Fabric: Send {
    /// RDMA WRITE WITH IMMEDIATE, signaled: `len` bytes (maybe 0) from staging offset `offset` to
    /// the peer's ring at the same offset; the peer gets one receive completion carrying `imm`.
    fn write_imm(&mut self, offset: usize, len: usize, imm: u32) -> Result<(), String>;
    /// A signaled zero-length RDMA WRITE (no immediate, nothing consumed at the peer): its
    /// completion fails if the peer is gone, which is how an idle connection notices.
    fn probe(&mut self) -> Result<(), String>;
    /// The engine is closed: wake the I/O thread so it disconnects and frees the verbs resources.
    fn shutdown(&mut self);
}

/// The engine's knobs (from [`super::RdmaConfig`] and the peer's ring size).
#[derive(Clone, Copy, Debug)]
pub(crate) struct EngineConfig {
    /// The most stream bytes in one record.
    pub max_payload: usize,
    /// Per-stream flow-control window in bytes.
    pub stream_window: u64,
    /// Send queue slots (every work request is signaled and holds one until its completion).
    pub send_queue_depth: u32,
}

impl EngineConfig {
    /// The largest payload for a peer ring of `peer_ring` bytes: a record (header, payload,
    /// alignment) is at most a quarter of the ring, which the credit rule relies on.
    pub(crate) fn clamp_payload(max_write: usize, peer_ring: usize) -> usize {
        let max_record = peer_ring / 4 / RECORD_ALIGN * RECORD_ALIGN;
        max_write.min(max_record.saturating_sub(RECORD_HEADER_BYTES)).max(1)
    }
}

/// A control record waiting for ring space.
#[derive(Debug)]
enum Ctrl {
    Open(u32),
    Fin(u32),
    Stop(u32),
    Window(u32, u64),
}

#[derive(Debug)]
struct Stream {
    // Receive half (peer → us).
    rx_queue: VecDeque<Bytes>,
    rx_received: u64,
    rx_read: u64,
    /// What we allowed the peer to send (absolute stream offset).
    rx_limit: u64,
    rx_fin: bool,
    reader_alive: bool,
    reader_waker: Option<Waker>,
    // Send half (us → peer).
    tx_sent: u64,
    /// What the peer allowed us to send.
    tx_limit: u64,
    tx_done: bool,
    tx_stopped: bool,
    writer_alive: bool,
    writer_waker: Option<Waker>,
}

impl Stream {
    fn new(window: u64) -> Stream {
        Stream {
            rx_queue: VecDeque::new(),
            rx_received: 0,
            rx_read: 0,
            rx_limit: window,
            rx_fin: false,
            reader_alive: true,
            reader_waker: None,
            tx_sent: 0,
            tx_limit: window,
            tx_done: false,
            tx_stopped: false,
            writer_alive: true,
            writer_waker: None,
        }
    }

    fn wake_all(&mut self) {
        if let Some(w) = self.reader_waker.take() {
            w.wake();
        }
        if let Some(w) = self.writer_waker.take() {
            w.wake();
        }
    }
}

/// Counters for tests and diagnostics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RdmaStats {
    /// Records written to the peer's ring (`Pad` included).
    pub records_sent: u64,
    /// Records parsed from this side's ring.
    pub records_received: u64,
    /// Stream payload bytes written.
    pub data_bytes_sent: u64,
    /// Times the sender went past the end of the peer's ring.
    pub ring_wraps: u64,
    /// `Pad` records (a record did not fit before the ring's end).
    pub pad_records: u64,
    /// Credit immediates sent.
    pub credits_sent: u64,
}

/// One connection's protocol state (see the module docs).
pub(crate) struct Engine {
    initiator: bool,
    cfg: EngineConfig,
    fabric: Option<Box<dyn Fabric>>,
    tx: Arc<Region>,
    tx_tail: u64,
    tx_freed: u64,
    sq_free: u32,
    rx: Arc<Region>,
    rx_head: u64,
    rx_unreturned: u64,
    ctrl: VecDeque<Ctrl>,
    streams: HashMap<u32, Stream>,
    next_local: u32,
    next_peer: u32,
    accept_queue: VecDeque<u32>,
    accept_wakers: Vec<Waker>,
    space_wakers: Vec<Waker>,
    closed: Option<String>,
    stats: RdmaStats,
}

fn closed_io(reason: &str) -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, format!("connection lost: {reason}"))
}

fn push_waker(wakers: &mut Vec<Waker>, cx: &Context<'_>) {
    if !wakers.iter().any(|w| w.will_wake(cx.waker())) {
        wakers.push(cx.waker().clone());
    }
}

impl Engine {
    /// `tx` mirrors the peer's ring (same size); `rx` is this side's ring.
    pub(crate) fn new(
        initiator: bool,
        cfg: EngineConfig,
        fabric: Box<dyn Fabric>,
        tx: Arc<Region>,
        rx: Arc<Region>,
    ) -> Engine {
        Engine {
            initiator,
            cfg,
            fabric: Some(fabric),
            tx,
            tx_tail: 0,
            tx_freed: 0,
            sq_free: cfg.send_queue_depth,
            rx,
            rx_head: 0,
            rx_unreturned: 0,
            ctrl: VecDeque::new(),
            streams: HashMap::new(),
            next_local: if initiator { 0 } else { 1 },
            next_peer: if initiator { 1 } else { 0 },
            accept_queue: VecDeque::new(),
            accept_wakers: Vec::new(),
            space_wakers: Vec::new(),
            closed: None,
            stats: RdmaStats::default(),
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.is_some()
    }

    pub(crate) fn close_reason(&self) -> Option<&str> {
        self.closed.as_deref()
    }

    pub(crate) fn stats(&self) -> RdmaStats {
        self.stats
    }

    fn tx_free(&self) -> usize {
        self.tx.len() - (self.tx_tail - self.tx_freed) as usize
    }

    fn credit_threshold(&self) -> u64 {
        (self.rx.len() / 4) as u64
    }

    /// Write one record (payload `parts` concatenated) into the peer's ring, preceded by a `Pad`
    /// if it would cross the ring's end. `Ok(false)`: no room (ring or send queue) yet.
    /// `reserve` send-queue slots stay free (for credits, which unblock the peer).
    fn post_record(&mut self, kind: RecordKind, stream: u32, parts: &[&[u8]], reserve: u32) -> Result<bool, String> {
        let payload: usize = parts.iter().map(|p| p.len()).sum();
        let size = record_ring_bytes(payload);
        let ring = self.tx.len();
        let pos = (self.tx_tail % ring as u64) as usize;
        let to_end = ring - pos;
        let wrap = size > to_end;
        let (need, wrs) = if wrap { (to_end + size, 2) } else { (size, 1) };
        if self.tx_free() < need || self.sq_free < wrs + reserve {
            return Ok(false);
        }
        let Some(fabric) = self.fabric.as_mut() else { return Err("the connection is closed".into()) };
        let mut pos = pos;
        if wrap {
            let pad = RecordHeader { kind: RecordKind::Pad, stream: 0, len: 0, seq: self.tx_tail as u32 };
            // SAFETY: `[pos, ring)` of the staging region is ours: its previous contents were
            // delivered (their credit came back, `tx_free` counted them) and only this engine,
            // under its lock, writes staging.
            unsafe { self.tx.write(pos, &pad.encode()) };
            fabric.write_imm(pos, RECORD_HEADER_BYTES, Imm::Record { ring_bytes: to_end as u32 }.encode())?;
            self.tx_tail += to_end as u64;
            self.sq_free -= 1;
            self.stats.records_sent += 1;
            self.stats.ring_wraps += 1;
            self.stats.pad_records += 1;
            pos = 0;
        }
        let header = RecordHeader { kind, stream, len: payload as u32, seq: self.tx_tail as u32 };
        // SAFETY: as above, for `[pos, pos + size)`, which `tx_free` covers.
        unsafe {
            self.tx.write(pos, &header.encode());
            let mut at = pos + RECORD_HEADER_BYTES;
            for p in parts {
                self.tx.write(at, p);
                at += p.len();
            }
        }
        fabric.write_imm(pos, RECORD_HEADER_BYTES + payload, Imm::Record { ring_bytes: size as u32 }.encode())?;
        self.tx_tail += size as u64;
        self.sq_free -= 1;
        self.stats.records_sent += 1;
        if self.tx_tail.is_multiple_of(ring as u64) {
            self.stats.ring_wraps += 1;
        }
        Ok(true)
    }

    /// Post what waits: credits first (they unblock the peer), then control records in order.
    fn flush(&mut self) {
        if self.closed.is_some() {
            return;
        }
        if self.rx_unreturned >= self.credit_threshold() && self.sq_free >= 1 {
            let bytes = self.rx_unreturned as u32;
            let result = match self.fabric.as_mut() {
                Some(f) => f.write_imm(0, 0, Imm::Credit { bytes }.encode()),
                None => return,
            };
            if let Err(e) = result {
                return self.shut(format!("posting a credit failed: {e}"));
            }
            self.sq_free -= 1;
            self.rx_unreturned = 0;
            self.stats.credits_sent += 1;
        }
        let had_ctrl = !self.ctrl.is_empty();
        while let Some(c) = self.ctrl.front() {
            let window_bytes;
            let (kind, stream, payload): (RecordKind, u32, &[u8]) = match *c {
                Ctrl::Open(s) => (RecordKind::Open, s, &[]),
                Ctrl::Fin(s) => (RecordKind::Fin, s, &[]),
                Ctrl::Stop(s) => (RecordKind::Stop, s, &[]),
                Ctrl::Window(s, limit) => {
                    window_bytes = limit.to_be_bytes();
                    (RecordKind::Window, s, &window_bytes)
                }
            };
            match self.post_record(kind, stream, &[payload], 1) {
                Ok(true) => {
                    self.ctrl.pop_front();
                }
                Ok(false) => break,
                Err(e) => return self.shut(format!("posting a control record failed: {e}")),
            }
        }
        if had_ctrl && self.ctrl.is_empty() {
            self.space_wakers.drain(..).for_each(Waker::wake);
        }
    }

    /// Close for good with `reason` (what every later operation reports); tell the I/O thread.
    pub(crate) fn shut(&mut self, reason: String) {
        if self.closed.is_some() {
            return;
        }
        tracing::debug!(%reason, "RDMA connection closed");
        self.closed = Some(reason);
        self.ctrl.clear();
        for s in self.streams.values_mut() {
            s.rx_queue.clear();
            s.wake_all();
        }
        self.accept_wakers.drain(..).for_each(Waker::wake);
        self.space_wakers.drain(..).for_each(Waker::wake);
        if let Some(mut f) = self.fabric.take() {
            f.shutdown();
        }
    }

    /// Close from this side: tell the peer why (best effort, if the ring has room), then shut.
    pub(crate) fn close_local(&mut self, reason: &str) {
        if self.closed.is_some() {
            return;
        }
        let mut cut = reason.len().min(MAX_CLOSE_REASON_BYTES);
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        let _ = self.post_record(RecordKind::Close, 0, &[&reason.as_bytes()[..cut]], 0);
        self.shut(format!("closed: {reason}"));
    }

    // ---- The I/O thread's side -------------------------------------------------------------

    /// A receive completion with immediate `imm`.
    pub(crate) fn on_imm(&mut self, imm: u32) {
        if self.closed.is_some() {
            return;
        }
        match Imm::decode(imm) {
            Imm::Credit { bytes } => {
                let outstanding = self.tx_tail - self.tx_freed;
                if u64::from(bytes) > outstanding {
                    return self.shut(format!(
                        "protocol error: the peer credited {bytes} ring bytes, only {outstanding} are outstanding"
                    ));
                }
                self.tx_freed += u64::from(bytes);
                self.flush();
                self.space_wakers.drain(..).for_each(Waker::wake);
            }
            Imm::Record { ring_bytes } => {
                if let Err(e) = self.on_record(ring_bytes as usize) {
                    self.shut(format!("protocol error: {e}"));
                }
            }
        }
    }

    fn on_record(&mut self, announced: usize) -> Result<(), WireError> {
        let ring = self.rx.len();
        let pos = (self.rx_head % ring as u64) as usize;
        let mut hb = [0u8; RECORD_HEADER_BYTES];
        if announced > ring - pos || announced < RECORD_HEADER_BYTES {
            return Err(WireError::SizeMismatch { header_bytes: ring - pos, announced });
        }
        // SAFETY: the peer wrote `[pos, pos + announced)` and its completion arrived (RDMA
        // placement is complete before the completion); the peer writes it again only after we
        // credit it back, below.
        unsafe { self.rx.read(pos, &mut hb) };
        let h = RecordHeader::decode(&hb)?;
        if h.seq != self.rx_head as u32 {
            return Err(WireError::Seq { expected: self.rx_head as u32, got: h.seq });
        }
        let size = if h.kind == RecordKind::Pad { ring - pos } else { h.ring_bytes() };
        if size != announced {
            return Err(WireError::SizeMismatch { header_bytes: size, announced });
        }
        self.stats.records_received += 1;
        let rx = self.rx.clone();
        let payload = |len: usize| {
            let mut v = vec![0u8; len];
            // SAFETY: inside the record checked above (same contract as the header).
            unsafe { rx.read(pos + RECORD_HEADER_BYTES, &mut v) };
            v
        };
        match h.kind {
            RecordKind::Pad => {}
            RecordKind::Data => {
                let data = payload(h.len as usize);
                self.on_data(h.stream, data)?;
            }
            RecordKind::Window => {
                let p = payload(h.len as usize);
                let b: [u8; WINDOW_PAYLOAD_BYTES] = p
                    .as_slice()
                    .try_into()
                    .map_err(|_| WireError::Protocol(format!("window record with {} payload bytes", p.len())))?;
                if let Some(s) = self.streams.get_mut(&h.stream) {
                    s.tx_limit = s.tx_limit.max(u64::from_be_bytes(b));
                    if let Some(w) = s.writer_waker.take() {
                        w.wake();
                    }
                }
            }
            RecordKind::Close => {
                let reason = String::from_utf8_lossy(&payload(h.len as usize)).into_owned();
                self.release(size);
                self.shut(format!("closed by the peer: {reason}"));
                return Ok(());
            }
            RecordKind::Open => self.on_open(h.stream)?,
            RecordKind::Fin | RecordKind::Stop => {
                if let Some(s) = self.streams.get_mut(&h.stream) {
                    if h.kind == RecordKind::Fin {
                        s.rx_fin = true;
                    } else {
                        s.tx_stopped = true;
                    }
                    s.wake_all();
                } else if !self.is_past(h.stream) {
                    return Err(WireError::Protocol(format!("{:?} for stream {} never opened", h.kind, h.stream)));
                }
            }
        }
        self.release(size);
        Ok(())
    }

    fn release(&mut self, size: usize) {
        self.rx_head += size as u64;
        self.rx_unreturned += size as u64;
        self.flush();
    }

    /// Whether `id` was opened once and is gone now (late records for it are dropped).
    fn is_past(&self, id: u32) -> bool {
        let local_parity = if self.initiator { 0 } else { 1 };
        if id % 2 == local_parity {
            id < self.next_local
        } else {
            id < self.next_peer
        }
    }

    fn on_open(&mut self, id: u32) -> Result<(), WireError> {
        let peer_parity = if self.initiator { 1 } else { 0 };
        if id % 2 != peer_parity || id < self.next_peer {
            return Err(WireError::Protocol(format!("the peer opened stream {id} out of order")));
        }
        self.next_peer = id + 2;
        self.streams.insert(id, Stream::new(self.cfg.stream_window));
        self.accept_queue.push_back(id);
        self.accept_wakers.drain(..).for_each(Waker::wake);
        Ok(())
    }

    fn on_data(&mut self, id: u32, data: Vec<u8>) -> Result<(), WireError> {
        let past = self.is_past(id);
        let Some(s) = self.streams.get_mut(&id) else {
            return if past { Ok(()) } else { Err(WireError::Protocol(format!("data for stream {id} never opened"))) };
        };
        if !s.reader_alive {
            return Ok(());
        }
        if s.rx_fin {
            return Err(WireError::Protocol(format!("data on stream {id} after its end")));
        }
        s.rx_received += data.len() as u64;
        if s.rx_received > s.rx_limit {
            return Err(WireError::Protocol(format!(
                "stream {id} overran its flow-control window ({} > {})",
                s.rx_received, s.rx_limit
            )));
        }
        if !data.is_empty() {
            s.rx_queue.push_back(Bytes::from(data));
        }
        if let Some(w) = s.reader_waker.take() {
            w.wake();
        }
        Ok(())
    }

    /// A send completion (success); failures go to [`Engine::shut`].
    pub(crate) fn on_send_done(&mut self) {
        self.sq_free = (self.sq_free + 1).min(self.cfg.send_queue_depth);
        self.flush();
        self.space_wakers.drain(..).for_each(Waker::wake);
    }

    /// The connection was idle for a keep-alive period: probe the peer.
    pub(crate) fn probe(&mut self) {
        if self.closed.is_some() || self.sq_free < 2 {
            return;
        }
        if let Some(f) = self.fabric.as_mut() {
            match f.probe() {
                Ok(()) => self.sq_free -= 1,
                Err(e) => self.shut(format!("posting a keep-alive probe failed: {e}")),
            }
        }
    }

    /// Send-queue slots in use (the I/O thread waits for them before disconnecting).
    pub(crate) fn sends_in_flight(&self) -> u32 {
        self.cfg.send_queue_depth - self.sq_free
    }

    // ---- The streams' side -----------------------------------------------------------------

    pub(crate) fn open_stream(&mut self) -> Result<u32, String> {
        if let Some(r) = &self.closed {
            return Err(r.clone());
        }
        let id = self.next_local;
        self.next_local += 2;
        self.streams.insert(id, Stream::new(self.cfg.stream_window));
        self.ctrl.push_back(Ctrl::Open(id));
        self.flush();
        Ok(id)
    }

    pub(crate) fn poll_accept(&mut self, cx: &Context<'_>) -> Poll<Result<u32, String>> {
        if let Some(r) = &self.closed {
            return Poll::Ready(Err(r.clone()));
        }
        if let Some(id) = self.accept_queue.pop_front() {
            return Poll::Ready(Ok(id));
        }
        push_waker(&mut self.accept_wakers, cx);
        Poll::Pending
    }

    pub(crate) fn poll_read(&mut self, id: u32, cx: &Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if let Some(r) = &self.closed {
            return Poll::Ready(Err(closed_io(r)));
        }
        let window = self.cfg.stream_window;
        let Some(s) = self.streams.get_mut(&id) else {
            return Poll::Ready(Err(io::Error::other(format!("stream {id} is gone"))));
        };
        let mut n = 0;
        while buf.remaining() > 0 {
            let Some(front) = s.rx_queue.front_mut() else { break };
            let take = front.len().min(buf.remaining());
            buf.put_slice(&front.split_to(take));
            n += take;
            if front.is_empty() {
                s.rx_queue.pop_front();
            }
        }
        if n > 0 {
            s.rx_read += n as u64;
            if !s.rx_fin && s.rx_limit - s.rx_read <= window / 2 {
                s.rx_limit = s.rx_read + window;
                self.ctrl.push_back(Ctrl::Window(id, s.rx_limit));
                self.flush();
            }
            return Poll::Ready(Ok(()));
        }
        if s.rx_fin || buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        s.reader_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    pub(crate) fn poll_write(&mut self, id: u32, cx: &Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        if let Some(r) = &self.closed {
            return Poll::Ready(Err(closed_io(r)));
        }
        let Some(s) = self.streams.get_mut(&id) else {
            return Poll::Ready(Err(io::Error::other(format!("stream {id} is gone"))));
        };
        if s.tx_stopped {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                format!("the peer stopped reading stream {id}"),
            )));
        }
        if s.tx_done {
            return Poll::Ready(Err(io::Error::other(format!("write on stream {id} after its shutdown"))));
        }
        if data.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let window_left = s.tx_limit - s.tx_sent;
        if window_left == 0 {
            s.writer_waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let n = data.len().min(self.cfg.max_payload).min(window_left.try_into().unwrap_or(usize::MAX));
        self.flush();
        if !self.ctrl.is_empty() {
            push_waker(&mut self.space_wakers, cx);
            return Poll::Pending;
        }
        match self.post_record(RecordKind::Data, id, &[&data[..n]], 1) {
            Ok(true) => {
                let s = self.streams.get_mut(&id).expect("checked above");
                s.tx_sent += n as u64;
                self.stats.data_bytes_sent += n as u64;
                Poll::Ready(Ok(n))
            }
            Ok(false) => {
                push_waker(&mut self.space_wakers, cx);
                Poll::Pending
            }
            Err(e) => {
                self.shut(format!("posting an RDMA write failed: {e}"));
                Poll::Ready(Err(closed_io(self.closed.as_deref().unwrap_or_default())))
            }
        }
    }

    /// End the stream's send half cleanly (a `Fin` after its data).
    pub(crate) fn shutdown_write(&mut self, id: u32) -> io::Result<()> {
        if let Some(r) = &self.closed {
            return Err(closed_io(r));
        }
        let Some(s) = self.streams.get_mut(&id) else {
            return Err(io::Error::other(format!("stream {id} is gone")));
        };
        if !s.tx_done {
            s.tx_done = true;
            self.ctrl.push_back(Ctrl::Fin(id));
            self.flush();
        }
        Ok(())
    }

    pub(crate) fn check_open(&self) -> io::Result<()> {
        match &self.closed {
            Some(r) => Err(closed_io(r)),
            None => Ok(()),
        }
    }

    /// A dropped writer finishes its stream (a `Fin`), as quinn's and the in-memory ones do.
    pub(crate) fn drop_writer(&mut self, id: u32) {
        let closed = self.closed.is_some();
        let Some(s) = self.streams.get_mut(&id) else { return };
        s.writer_alive = false;
        if !s.tx_done && !closed {
            s.tx_done = true;
            if !s.tx_stopped {
                self.ctrl.push_back(Ctrl::Fin(id));
            }
        }
        self.forget_if_done(id);
        self.flush();
    }

    pub(crate) fn drop_reader(&mut self, id: u32) {
        let closed = self.closed.is_some();
        let Some(s) = self.streams.get_mut(&id) else { return };
        s.reader_alive = false;
        s.rx_queue.clear();
        if !s.rx_fin && !closed {
            self.ctrl.push_back(Ctrl::Stop(id));
        }
        self.forget_if_done(id);
        self.flush();
    }

    fn forget_if_done(&mut self, id: u32) {
        if self.streams.get(&id).is_some_and(|s| !s.reader_alive && !s.writer_alive) {
            self.streams.remove(&id);
        }
    }

    /// Streams still tracked (tests check that finished ones are forgotten).
    pub(crate) fn open_streams(&self) -> usize {
        self.streams.len()
    }
}

#[cfg(test)]
mod tests;
