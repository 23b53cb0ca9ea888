//! Intra-instance schedulers: who runs in the next iteration, in priority order.
//!
//! A scheduler never touches memory. It keeps a small [`SchedState`] per request and turns it
//! into a priority key; the engine walks requests in key order and gives each the GPU blocks it
//! needs while they last ("fit by priority"). Requests resident on the GPU that do not make the cut
//! are preempted (KV offloaded to CPU). So the three policies differ only in their keys and their
//! admission rule:
//!
//! - `fcfs` (vLLM's default): key = arrival order. Once a waiting request does not fit, later
//!   waiting requests are blocked too (head-of-line blocking), running ones keep running, and the
//!   most recently arrived running request is the first to be preempted.
//! - `rr`: token quantum (default 500). A request that used its quantum drops behind every request
//!   that has not (its round increments and it re-enters at the tail); under memory pressure the
//!   lowest-priority requests are offloaded. PASCAL Fig. 2(c).
//! - `pascal` (PASCAL §IV-C): a high queue for reasoning requests and a low queue for answering
//!   ones, each round-robin with the quantum; reasoning always preempts answering; a reasoning
//!   request whose KV exceeds `demotion_tokens` (default 5000) is demoted to the low queue.
//!
//! Adding a policy: implement [`IntraScheduler`] and add a line to [`build_scheduler`].

use serde::{Deserialize, Serialize};

/// A request's phase: before or after `</think>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Phase {
    Reasoning,
    Answering,
}

/// Queue class; lower runs first.
pub const CLASS_HIGH: u8 = 0;
pub const CLASS_LOW: u8 = 1;

/// Per-request scheduling state, owned by the engine and updated only through the scheduler.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedState {
    /// Queue (PASCAL high/low); 0 for single-queue policies.
    pub class: u8,
    /// Quanta used up in the current queue (RR rounds).
    pub round: u32,
    /// Tokens produced in the current quantum.
    pub quantum_used: u32,
    /// Position within the round: lower was enqueued earlier.
    pub seq: u64,
    /// PASCAL: a long reasoning request moved to the low queue.
    pub demoted: bool,
}

impl SchedState {
    /// Total order used to pick the batch: (queue, round, position).
    #[inline]
    pub fn key(&self) -> (u8, u32, u64) {
        (self.class, self.round, self.seq)
    }
    /// In the high (reasoning) queue: PASCAL's r_i counts these.
    pub fn in_reasoning_queue(&self) -> bool {
        self.class == CLASS_HIGH && !self.demoted
    }
}

/// What happens to waiting requests behind one that does not fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Head-of-line blocking: nothing new is admitted behind a blocked request (vLLM FCFS).
    BlockBehind,
    /// Lower-priority requests that fit may still run.
    SkipBlocked,
}

/// An intra-instance scheduling policy.
pub trait IntraScheduler: Send + std::fmt::Debug {
    fn name(&self) -> &'static str;
    fn admission(&self) -> Admission;
    /// A request joins this instance: on arrival (`Reasoning`, or `Answering` when it has no
    /// reasoning tokens) or on migration in.
    fn on_enqueue(&mut self, st: &mut SchedState, phase: Phase);
    /// The request produced one token and now holds `context_tokens` of KV. Returns whether its
    /// priority key changed.
    fn on_token(&mut self, st: &mut SchedState, phase: Phase, context_tokens: u32) -> bool;
    /// The request crossed `</think>`. Returns whether its priority key changed.
    fn on_phase_change(&mut self, st: &mut SchedState) -> bool;
}

/// Parameters shared by the built-in schedulers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulerParams {
    /// RR token quantum, per queue for `pascal` (PASCAL §V-A: 500).
    pub quantum_tokens: u32,
    /// `pascal`: a reasoning request whose KV exceeds this many tokens is demoted (PASCAL: 5000).
    pub demotion_tokens: u32,
}

impl Default for SchedulerParams {
    fn default() -> Self {
        SchedulerParams { quantum_tokens: 500, demotion_tokens: 5000 }
    }
}

pub const SCHEDULER_NAMES: &[&str] = &["fcfs", "rr", "pascal"];

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerError {
    #[error("unknown intra-instance scheduler `{0}` (valid: fcfs, rr, pascal)")]
    Unknown(String),
    #[error("scheduler parameter `{0}` must be > 0")]
    Zero(&'static str),
}

/// The registry: one line per policy.
pub fn build_scheduler(name: &str, params: &SchedulerParams) -> Result<Box<dyn IntraScheduler>, SchedulerError> {
    if params.quantum_tokens == 0 {
        return Err(SchedulerError::Zero("quantum_tokens"));
    }
    if params.demotion_tokens == 0 {
        return Err(SchedulerError::Zero("demotion_tokens"));
    }
    match name {
        "fcfs" => Ok(Box::new(Fcfs::default())),
        "rr" => Ok(Box::new(RoundRobin::new(params.quantum_tokens))),
        "pascal" => Ok(Box::new(Pascal::new(params.quantum_tokens, params.demotion_tokens))),
        other => Err(SchedulerError::Unknown(other.to_string())),
    }
}

/// First come, first served: one queue in arrival order; priorities never change.
#[derive(Debug, Default)]
pub struct Fcfs {
    next_seq: u64,
}

impl IntraScheduler for Fcfs {
    fn name(&self) -> &'static str {
        "fcfs"
    }
    fn admission(&self) -> Admission {
        Admission::BlockBehind
    }
    fn on_enqueue(&mut self, st: &mut SchedState, _phase: Phase) {
        *st = SchedState { seq: self.next_seq, ..SchedState::default() };
        self.next_seq += 1;
    }
    fn on_token(&mut self, _st: &mut SchedState, _phase: Phase, _context_tokens: u32) -> bool {
        false
    }
    fn on_phase_change(&mut self, _st: &mut SchedState) -> bool {
        false
    }
}

/// Round-robin bookkeeping shared by `rr` and both of `pascal`'s queues.
#[derive(Debug)]
struct Quantum {
    tokens: u32,
    next_seq: u64,
}

impl Quantum {
    fn enter(&mut self, st: &mut SchedState, class: u8) {
        st.class = class;
        st.round = 0;
        st.quantum_used = 0;
        st.seq = self.next_seq;
        self.next_seq += 1;
    }
    /// Count one token; at the end of a quantum the request drops to the tail of the next round.
    fn tick(&mut self, st: &mut SchedState) -> bool {
        st.quantum_used += 1;
        if st.quantum_used >= self.tokens {
            st.quantum_used = 0;
            st.round += 1;
            st.seq = self.next_seq;
            self.next_seq += 1;
            true
        } else {
            false
        }
    }
}

/// Round-robin with a token quantum, phase-blind (PASCAL's RR baseline).
#[derive(Debug)]
pub struct RoundRobin {
    q: Quantum,
}

impl RoundRobin {
    pub fn new(quantum_tokens: u32) -> Self {
        RoundRobin { q: Quantum { tokens: quantum_tokens, next_seq: 0 } }
    }
}

impl IntraScheduler for RoundRobin {
    fn name(&self) -> &'static str {
        "rr"
    }
    fn admission(&self) -> Admission {
        Admission::SkipBlocked
    }
    fn on_enqueue(&mut self, st: &mut SchedState, _phase: Phase) {
        self.q.enter(st, CLASS_HIGH);
    }
    fn on_token(&mut self, st: &mut SchedState, _phase: Phase, _context_tokens: u32) -> bool {
        self.q.tick(st)
    }
    fn on_phase_change(&mut self, _st: &mut SchedState) -> bool {
        false
    }
}

/// PASCAL's hierarchical queues (§IV-C).
#[derive(Debug)]
pub struct Pascal {
    q: Quantum,
    demotion_tokens: u32,
}

impl Pascal {
    pub fn new(quantum_tokens: u32, demotion_tokens: u32) -> Self {
        Pascal { q: Quantum { tokens: quantum_tokens, next_seq: 0 }, demotion_tokens }
    }
}

impl IntraScheduler for Pascal {
    fn name(&self) -> &'static str {
        "pascal"
    }
    fn admission(&self) -> Admission {
        Admission::SkipBlocked
    }
    fn on_enqueue(&mut self, st: &mut SchedState, phase: Phase) {
        let class = match phase {
            Phase::Reasoning if !st.demoted => CLASS_HIGH,
            _ => CLASS_LOW,
        };
        let demoted = st.demoted;
        self.q.enter(st, class);
        st.demoted = demoted;
    }
    fn on_token(&mut self, st: &mut SchedState, phase: Phase, context_tokens: u32) -> bool {
        if phase == Phase::Reasoning && st.class == CLASS_HIGH && context_tokens > self.demotion_tokens {
            // Demotion: treated as a low-priority answering request from now on.
            self.q.enter(st, CLASS_LOW);
            st.demoted = true;
            return true;
        }
        self.q.tick(st)
    }
    fn on_phase_change(&mut self, st: &mut SchedState) -> bool {
        if st.class == CLASS_LOW {
            // Already demoted: it keeps its place in the low queue.
            return false;
        }
        // Answering requests enter the low queue with a fresh quantum (they count in a_i).
        self.q.enter(st, CLASS_LOW);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rr_quantum_moves_request_to_next_round_tail() {
        let mut rr = RoundRobin::new(2);
        let (mut a, mut b) = (SchedState::default(), SchedState::default());
        rr.on_enqueue(&mut a, Phase::Reasoning);
        rr.on_enqueue(&mut b, Phase::Reasoning);
        assert!(a.key() < b.key());
        assert!(!rr.on_token(&mut a, Phase::Reasoning, 10));
        assert!(rr.on_token(&mut a, Phase::Reasoning, 11), "second token ends the quantum");
        assert!(b.key() < a.key(), "a used its quantum and drops behind b");
        assert_eq!(a.round, 1);
    }

    #[test]
    fn pascal_queues_demotion_and_phase_change() {
        let mut p = Pascal::new(500, 5000);
        let (mut reason, mut answer) = (SchedState::default(), SchedState::default());
        p.on_enqueue(&mut answer, Phase::Answering);
        p.on_enqueue(&mut reason, Phase::Reasoning);
        assert!(reason.key() < answer.key(), "reasoning always precedes answering");
        assert!(reason.in_reasoning_queue());
        // Crossing the demotion threshold moves it to the low queue.
        assert!(!p.on_token(&mut reason, Phase::Reasoning, 5000));
        assert!(p.on_token(&mut reason, Phase::Reasoning, 5001));
        assert!(reason.demoted && reason.class == CLASS_LOW && !reason.in_reasoning_queue());
        // A demoted request keeps its low-queue place at `</think>`.
        let before = reason;
        assert!(!p.on_phase_change(&mut reason));
        assert_eq!(before, reason);
        // A normal one moves to the low queue with a fresh quantum.
        let mut r2 = SchedState::default();
        p.on_enqueue(&mut r2, Phase::Reasoning);
        for _ in 0..3 {
            p.on_token(&mut r2, Phase::Reasoning, 100);
        }
        assert!(p.on_phase_change(&mut r2));
        assert_eq!((r2.class, r2.round, r2.quantum_used), (CLASS_LOW, 0, 0));
    }

    #[test]
    fn registry_rejects_unknown_and_zero() {
        assert!(build_scheduler("pascal", &SchedulerParams::default()).is_ok());
        assert_eq!(build_scheduler("sjf", &SchedulerParams::default()).unwrap_err(), SchedulerError::Unknown("sjf".into()));
        let p = SchedulerParams { quantum_tokens: 0, ..Default::default() };
        assert!(build_scheduler("rr", &p).is_err());
    }
}
