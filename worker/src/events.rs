//! The worker's event log: what happened on this instance, in order, until the leader has it.
//!
//! Every event (a request's tokens from one iteration, a `</think>` boundary, a finished record, a
//! periodic load report) gets the next sequence number (dense, from 1). The log keeps events until
//! the leader acknowledges them (`Ack(up_to_seq)`: it has handled them, and has stored every
//! finished record among them in the metadata store, fenced on its leadership, before acking), so a
//! new leader can replay from its last acknowledged number (`Events(after_seq)`) and then follow
//! live events. That is what makes "no request lost" possible across a failover.
//!
//! Memory is bounded: when more than `cap` token and load events are unacknowledged (a leader that
//! stopped acknowledging), the oldest of those are dropped — a gap in the replay — but boundaries
//! and finished records are never dropped: they are what the coordinator's decisions and the
//! metrics need, and there is one of each per request.

use kvfleet_proto::v1;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use tokio::sync::watch;

/// One entry, stored compactly (records and load reports boxed: tokens are the common case).
#[derive(Clone, Debug, PartialEq)]
pub enum LogEvent {
    /// Tokens a request produced in one iteration (droppable).
    Tokens(v1::Tokens),
    /// A request crossed a phase boundary (e.g. `</think>`); never dropped.
    Boundary(v1::PhaseBoundary),
    /// A request's final record; never dropped.
    Finished(Box<v1::RequestRecord>),
    /// A periodic load report of this instance (droppable).
    Load(Box<v1::LoadReport>),
    /// A request's prefill ended here and it is held for a handoff; never dropped.
    PrefillDone(v1::PrefillDone),
    /// The first chunk of a request's chunked prefill was written here (its handoff may start);
    /// never dropped.
    PrefillStarted(v1::PrefillStarted),
    /// What the prefix cache stored and evicted (droppable: a lost one costs only cache hits).
    KvEvents(Box<v1::KvCacheEvents>),
}

impl LogEvent {
    /// Token and load events may be dropped under memory pressure; the others never.
    fn droppable(&self) -> bool {
        matches!(self, LogEvent::Tokens(_) | LogEvent::Load(_) | LogEvent::KvEvents(_))
    }

    fn to_proto(&self, seq: u64) -> v1::WorkerEvent {
        use v1::worker_event::Event;
        let event = match self {
            LogEvent::Tokens(t) => Event::Tokens(*t),
            LogEvent::Boundary(b) => Event::Boundary(*b),
            LogEvent::Finished(r) => Event::Finished(**r),
            LogEvent::Load(l) => Event::Load(**l),
            LogEvent::PrefillDone(p) => Event::PrefillDone(*p),
            LogEvent::PrefillStarted(p) => Event::PrefillStarted(*p),
            LogEvent::KvEvents(k) => Event::KvEvents((**k).clone()),
        };
        v1::WorkerEvent { seq, event: Some(event) }
    }
}

/// Counters of the log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogStats {
    /// Sequence number of the last event appended (0: none yet).
    pub last_seq: u64,
    /// Highest acknowledged sequence number.
    pub acked: u64,
    /// Events held (unacknowledged).
    pub retained: usize,
    /// Token/load events dropped unacknowledged because the cap was reached.
    pub dropped: u64,
}

#[derive(Debug)]
struct Inner {
    events: BTreeMap<u64, LogEvent>,
    /// Sequence numbers of droppable events still held, oldest first (may hold acknowledged ones,
    /// skipped lazily).
    droppable: VecDeque<u64>,
    last_seq: u64,
    acked: u64,
    dropped: u64,
    cap: usize,
    closed: bool,
}

/// The log, shared by the driver (appends) and every `Events` stream (reads).
#[derive(Debug)]
pub struct EventLog {
    inner: Mutex<Inner>,
    /// Carries `last_seq`; readers wait on it for new events (and for `close`).
    notify: watch::Sender<u64>,
}

/// What a reader got from [`EventLog::read_after`].
#[derive(Debug, PartialEq, Eq)]
pub enum Read {
    /// Events were appended to the output (the last one's seq is the new cursor).
    Some,
    /// Nothing after the cursor yet; wait for a change.
    Empty,
    /// Nothing after the cursor and the log is closed: the stream ends.
    Closed,
}

impl EventLog {
    /// A log that holds at most `cap` droppable (token, load) events unacknowledged.
    pub fn new(cap: usize) -> Self {
        EventLog {
            inner: Mutex::new(Inner {
                events: BTreeMap::new(),
                droppable: VecDeque::new(),
                last_seq: 0,
                acked: 0,
                dropped: 0,
                cap: cap.max(1),
                closed: false,
            }),
            notify: watch::Sender::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain data behind; keep serving it.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Append events (one lock and one wake-up for a whole iteration's worth). Returns the last seq.
    pub fn extend(&self, events: impl IntoIterator<Item = LogEvent>) -> u64 {
        let last = {
            let mut g = self.lock();
            for ev in events {
                g.last_seq += 1;
                let seq = g.last_seq;
                if ev.droppable() {
                    g.droppable.push_back(seq);
                }
                g.events.insert(seq, ev);
            }
            while g.droppable.len() > g.cap {
                let Some(seq) = g.droppable.pop_front() else { break };
                if g.events.remove(&seq).is_some() {
                    g.dropped += 1;
                }
            }
            g.last_seq
        };
        self.notify.send_replace(last);
        last
    }

    /// Append one event. Returns its sequence number.
    pub fn push(&self, event: LogEvent) -> u64 {
        self.extend([event])
    }

    /// Forget everything up to and including `up_to_seq` (clamped to what exists).
    pub fn ack(&self, up_to_seq: u64) {
        let mut g = self.lock();
        let up_to = up_to_seq.min(g.last_seq);
        if up_to <= g.acked {
            return;
        }
        g.acked = up_to;
        g.events = g.events.split_off(&(up_to + 1));
        while g.droppable.front().is_some_and(|&s| s <= up_to) {
            g.droppable.pop_front();
        }
    }

    /// The requests whose final records are still held (not acknowledged), in log order.
    pub fn unacked_finished(&self) -> Vec<u64> {
        let g = self.lock();
        g.events
            .values()
            .filter_map(|ev| match ev {
                LogEvent::Finished(r) => Some(r.id),
                _ => None,
            })
            .collect()
    }

    /// Copy up to `max` events with seq > `after_seq` into `out`.
    pub fn read_after(&self, after_seq: u64, max: usize, out: &mut Vec<v1::WorkerEvent>) -> Read {
        let g = self.lock();
        let before = out.len();
        let start = after_seq.saturating_add(1);
        out.extend(g.events.range(start..).take(max).map(|(&seq, ev)| ev.to_proto(seq)));
        if out.len() > before {
            Read::Some
        } else if g.closed {
            Read::Closed
        } else {
            Read::Empty
        }
    }

    /// A receiver that changes whenever events are appended or the log closes. Mark it seen
    /// (`borrow_and_update`) *before* reading so that no append is missed.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.notify.subscribe()
    }

    /// No more events will come: readers drain what is left and end.
    pub fn close(&self) {
        let last = {
            let mut g = self.lock();
            g.closed = true;
            g.last_seq
        };
        self.notify.send_replace(last);
    }

    /// Current counters of the log.
    pub fn stats(&self) -> LogStats {
        let g = self.lock();
        LogStats { last_seq: g.last_seq, acked: g.acked, retained: g.events.len(), dropped: g.dropped }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok(request_id: u64, first_index: u32) -> LogEvent {
        LogEvent::Tokens(v1::Tokens { request_id, first_index, count: 1, ..Default::default() })
    }
    fn fin(id: u64) -> LogEvent {
        LogEvent::Finished(Box::new(v1::RequestRecord { id, ..Default::default() }))
    }
    fn seqs(log: &EventLog, after: u64) -> Vec<u64> {
        let mut out = Vec::new();
        log.read_after(after, usize::MAX, &mut out);
        out.iter().map(|e| e.seq).collect()
    }

    #[test]
    fn dense_sequence_replay_and_ack() {
        let log = EventLog::new(100);
        assert_eq!(log.extend([tok(1, 0), tok(2, 0), fin(1)]), 3);
        assert_eq!(log.push(tok(2, 1)), 4);
        assert_eq!(seqs(&log, 0), [1, 2, 3, 4]);
        assert_eq!(seqs(&log, 2), [3, 4]);
        log.ack(2);
        assert_eq!(seqs(&log, 0), [3, 4], "acknowledged events are forgotten");
        log.ack(1);
        assert_eq!(log.stats().acked, 2, "acks never go backwards");
        log.ack(99);
        assert_eq!(log.stats(), LogStats { last_seq: 4, acked: 4, retained: 0, dropped: 0 });
        assert_eq!(log.push(tok(3, 0)), 5, "numbering continues after a full ack");
        let mut out = Vec::new();
        assert_eq!(log.read_after(4, 10, &mut out), Read::Some);
        assert!(matches!(out[0].event, Some(v1::worker_event::Event::Tokens(t)) if t.request_id == 3));
    }

    #[test]
    fn over_the_cap_oldest_tokens_go_but_finished_records_stay() {
        let log = EventLog::new(3);
        log.extend([tok(1, 0), fin(7), tok(1, 1), tok(1, 2), tok(1, 3), tok(1, 4)]);
        assert_eq!(seqs(&log, 0), [2, 4, 5, 6], "tokens 1 and 3 dropped; the record at 2 kept");
        assert_eq!(log.stats().dropped, 2);
        // Acknowledged tokens no longer count against the cap.
        log.ack(5);
        log.extend([tok(2, 0), tok(2, 1)]);
        assert_eq!(seqs(&log, 0), [6, 7, 8]);
        assert_eq!(log.stats().dropped, 2);
    }

    #[test]
    fn readers_see_appends_and_close() {
        let log = EventLog::new(10);
        let mut rx = log.subscribe();
        rx.borrow_and_update();
        let mut out = Vec::new();
        assert_eq!(log.read_after(0, 10, &mut out), Read::Empty);
        log.push(tok(1, 0));
        assert!(rx.has_changed().unwrap());
        rx.borrow_and_update();
        log.close();
        assert!(rx.has_changed().unwrap(), "close wakes readers");
        assert_eq!(log.read_after(0, 10, &mut out), Read::Some, "what is left is still delivered");
        assert_eq!(log.read_after(1, 10, &mut out), Read::Closed);
    }
}
