//! The discrete-event loop: N engines, the cluster [`Controller`], one fabric, virtual time.
//!
//! Every cluster decision (placement, the move at `</think>`) is the controller's, the same
//! object the coordinator's leader drives: this loop only turns engine events into controller
//! events and executes the controller's actions on the engines and the fabric.
//!
//! Events are processed in time slices: every event at time `t` is handled (iteration ends,
//! arrivals, finished transfers), then every instance touched at `t` that has work and no
//! iteration in flight plans its next iteration. This lets a request that arrives exactly when
//! an iteration ends join the next one (PASCAL Fig. 2's timelines assume so). Ties within a
//! slice are broken by insertion order, so a seed gives byte-identical results.

use kvfleet_core::engine::sched::build_scheduler;
use kvfleet_core::engine::{Engine, EngineConfig, EngineEvent, EngineStats};
use kvfleet_core::metrics::{MigrationRecord, RequestRecord};
use kvfleet_control::{Action, Controller, Event as Control, MoveOutcome};
use kvfleet_core::policy::InstancePolicy;
use kvfleet_core::timing::TimingModel;
use kvfleet_core::{InstanceId, RequestId, RequestSpec, SimRng, SimTime};
use kvfleet_netmodel::{Fabric, LinkParams, TransferId};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// The iteration in flight on this instance ends.
    IterationEnd(u32),
    /// The `i`-th request of the workload arrives.
    Arrival(u32),
    /// The fabric's earliest transfer may have finished (stale if the generation moved on).
    FabricWake(u64),
}

/// Progress callback payload, every few thousand events.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    pub now: SimTime,
    pub arrived: usize,
    pub finished: usize,
    pub total: usize,
}

/// Everything a run produced.
#[derive(Debug)]
pub struct ClusterOutcome {
    /// One per workload request, sorted by id (rejected ones flagged).
    pub records: Vec<RequestRecord>,
    pub migrations: Vec<MigrationRecord>,
    pub instances: Vec<EngineStats>,
    pub events: u64,
    pub end: SimTime,
}

struct PendingMigration {
    request: RequestId,
    from: InstanceId,
    to: InstanceId,
    bytes: u64,
    start: SimTime,
}

/// A simulated cluster. Build it, then [`Cluster::run`] a workload.
pub struct Cluster {
    engines: Vec<Engine>,
    control: Controller,
    fabric: Fabric,
    queue: BinaryHeap<Reverse<(SimTime, u64, Event)>>,
    seq: u64,
    fabric_gen: u64,
    transfers: HashMap<TransferId, PendingMigration>,
    touched: Vec<u32>,
}

impl Cluster {
    pub fn new(
        instances: u32,
        engine: &EngineConfig,
        timing: Arc<dyn TimingModel>,
        intra: &str,
        intra_params: &kvfleet_core::engine::sched::SchedulerParams,
        policy: Box<dyn InstancePolicy>,
        link: LinkParams,
        seed: u64,
    ) -> Result<Cluster, String> {
        let mut engines = Vec::with_capacity(instances as usize);
        for i in 0..instances {
            let sched = build_scheduler(intra, intra_params).map_err(|e| e.to_string())?;
            engines.push(Engine::new(InstanceId(i), engine.clone(), timing.clone(), sched));
        }
        let fabric = Fabric::new(instances, link).map_err(|e| e.to_string())?;
        let mut control = Controller::new(policy, SimRng::seed_from_u64(seed).fork(0x5C4E_D01E));
        for e in &engines {
            let instance = e.instance();
            let joined = Control::Joined {
                instance,
                address: format!("sim-{}", instance.0),
                model: String::new(),
                kv_bytes_per_token: engine.kv_bytes_per_token,
            };
            control.handle(SimTime::ZERO, joined).map_err(|e| e.to_string())?;
            control.handle(SimTime::ZERO, Control::Load(e.load_report())).map_err(|e| e.to_string())?;
        }
        Ok(Cluster {
            engines,
            control,
            fabric,
            queue: BinaryHeap::new(),
            seq: 0,
            fabric_gen: 0,
            transfers: HashMap::new(),
            touched: Vec::new(),
        })
    }

    fn push(&mut self, at: SimTime, ev: Event) {
        self.seq += 1;
        self.queue.push(Reverse((at, self.seq, ev)));
    }

    fn touch(&mut self, i: u32) {
        self.touched.push(i);
    }

    /// Instance `i` publishes its load (the controller drops the charges it now shows).
    fn refresh_load(&mut self, now: SimTime, i: u32) {
        let load = self.engines[i as usize].load_report();
        // Only unknown requests can make an event fail; a load report never does.
        let _ = self.control.handle(now, Control::Load(load));
    }

    /// Every published load rests on the report its engine would give now (checked in debug
    /// builds): in virtual time every report is instant. (A published load may still carry
    /// charges: a move decided and not yet reserved on its target.)
    fn loads_are_fresh(&self) -> bool {
        self.engines.iter().zip(self.control.loads()).all(|(e, l)| e.load_report().admitted == l.admitted)
    }

    /// Instances changed earlier in this time slice publish their load before a policy reads it.
    fn refresh_touched_loads(&mut self, now: SimTime) {
        for k in 0..self.touched.len() {
            let i = self.touched[k];
            self.refresh_load(now, i);
        }
    }

    /// Run `requests` (sorted by arrival) to completion.
    pub fn run(mut self, requests: &[RequestSpec], mut progress: impl FnMut(Progress)) -> ClusterOutcome {
        let total = requests.len();
        let mut records: Vec<RequestRecord> = Vec::with_capacity(total);
        let mut migrations = Vec::new();
        let mut events_buf = Vec::new();
        let mut arrived = 0usize;
        let mut events: u64 = 0;
        let mut now = SimTime::ZERO;
        // Arrivals are fed lazily: only the next one is in the queue.
        if let Some(first) = requests.first() {
            self.push(first.arrival, Event::Arrival(0));
        }
        while let Some(Reverse((t, _, _))) = self.queue.peek().copied() {
            now = t;
            while let Some(&Reverse((t2, _, ev))) = self.queue.peek() {
                if t2 != now {
                    break;
                }
                self.queue.pop();
                events += 1;
                // The engine of the next event is cache-cold: start fetching its data now.
                if let Some(&Reverse((_, _, Event::IterationEnd(j)))) = self.queue.peek() {
                    self.engines[j as usize].prefetch();
                }
                match ev {
                    Event::Arrival(idx) => {
                        let spec = &requests[idx as usize];
                        arrived += 1;
                        if let Some(next) = requests.get(idx as usize + 1) {
                            self.push(next.arrival.max(now), Event::Arrival(idx + 1));
                        }
                        self.refresh_touched_loads(now);
                        debug_assert!(self.loads_are_fresh(), "policy would see a stale load report");
                        if let Err(e) = self.control.handle(now, Control::Arrival(spec.clone())) {
                            // A duplicate id in the workload: it ran once already.
                            records.push(rejected(spec, InstanceId(0)));
                            debug_assert!(false, "{e}");
                            continue;
                        }
                        self.execute(now, spec, &mut records);
                    }
                    Event::IterationEnd(i) => {
                        self.engines[i as usize].complete_iteration(now, &mut events_buf);
                        for ev in std::mem::take(&mut events_buf) {
                            match ev {
                                EngineEvent::Finished(r) => {
                                    let _ = self.control.handle(now, Control::Finished { request: r.id });
                                    records.push(*r);
                                }
                                EngineEvent::PhaseBoundary { request, kv_blocks } => {
                                    self.on_phase_boundary(now, i, request, kv_blocks, &mut records);
                                }
                            }
                        }
                        // Its load is refreshed when it is planned below, or before any policy
                        // decision in this slice (refresh_touched_loads).
                        self.touch(i);
                    }
                    Event::FabricWake(gen) => {
                        if gen != self.fabric_gen {
                            continue;
                        }
                        for (id, _started) in self.fabric.complete_due(now) {
                            let Some(m) = self.transfers.remove(&id) else { continue };
                            let moved = self.engines[m.from.0 as usize]
                                .finish_migration_out(m.request)
                                .expect("a request in transit is migrating out of its source");
                            self.engines[m.to.0 as usize].attach(now, moved).expect("target admits a migrated request");
                            migrations.push(MigrationRecord {
                                request: m.request,
                                from: m.from,
                                to: m.to,
                                bytes: m.bytes,
                                start: m.start,
                                end: now,
                                aborted: false,
                            });
                            let ended = Control::MigrationEnded { request: m.request, outcome: MoveOutcome::Committed };
                            let _ = self.control.handle(now, ended);
                            self.refresh_load(now, m.from.0);
                            self.refresh_load(now, m.to.0);
                            self.touch(m.from.0);
                            self.touch(m.to.0);
                        }
                        self.schedule_fabric_wake();
                    }
                }
            }
            // Plan every instance touched in this slice, in a deterministic order.
            let mut touched = std::mem::take(&mut self.touched);
            touched.sort_unstable();
            touched.dedup();
            for &i in &touched {
                if self.engines[i as usize].needs_step() {
                    if let Some(end) = self.engines[i as usize].plan_iteration(now) {
                        self.push(end, Event::IterationEnd(i));
                    }
                }
                self.refresh_load(now, i);
            }
            touched.clear();
            self.touched = touched;
            if events % 4096 < 8 {
                progress(Progress { now, arrived, finished: records.len(), total });
            }
        }
        progress(Progress { now, arrived, finished: records.len(), total });
        records.sort_by_key(|r| r.id);
        ClusterOutcome {
            records,
            migrations,
            instances: self.engines.iter().map(|e| e.stats().clone()).collect(),
            events,
            end: now,
        }
    }

    /// Execute the controller's decisions: placements on engines, moves on the fabric.
    fn execute(&mut self, now: SimTime, arrival: &RequestSpec, records: &mut Vec<RequestRecord>) {
        while let Some(action) = self.control.poll_action() {
            match action {
                Action::Place { request, on, .. } => {
                    debug_assert_eq!(request, arrival.id, "the simulator re-places nothing: no instance dies");
                    match self.engines[on.0 as usize].submit(now, arrival.clone()) {
                        Ok(()) => {
                            self.refresh_load(now, on.0);
                            self.touch(on.0);
                        }
                        Err(_) => {
                            // Can never fit that instance: finished as rejected (not lost).
                            let _ = self.control.handle(now, Control::Finished { request });
                            records.push(rejected(arrival, on));
                        }
                    }
                }
                Action::Reject { .. } => records.push(rejected(arrival, InstanceId(0))),
                Action::Migrate { request, from, to, .. } => self.start_migration(now, request, from, to),
                other => debug_assert!(false, "the simulator cannot execute {other:?}"),
            }
        }
    }

    fn on_phase_boundary(
        &mut self,
        now: SimTime,
        i: u32,
        request: RequestId,
        kv_blocks: u32,
        records: &mut Vec<RequestRecord>,
    ) {
        // Loads as of this instant: the source's view must include the iteration that just ended.
        self.refresh_load(now, i);
        self.refresh_touched_loads(now);
        debug_assert!(self.loads_are_fresh(), "policy would see a stale load report");
        let boundary = Control::Boundary { request, instance: InstanceId(i), kv_blocks };
        let _ = self.control.handle(now, boundary);
        while let Some(action) = self.control.poll_action() {
            match action {
                Action::Migrate { request, from, to, .. } => self.start_migration(now, request, from, to),
                other => {
                    debug_assert!(false, "unexpected decision at a phase boundary: {other:?}");
                    let _ = records;
                }
            }
        }
    }

    fn start_migration(&mut self, now: SimTime, request: RequestId, from: InstanceId, to: InstanceId) {
        let Ok(out) = self.engines[from.0 as usize].begin_migration_out(request) else {
            let _ = self.control.handle(now, Control::MigrationEnded { request, outcome: MoveOutcome::Aborted });
            return;
        };
        let id = self.fabric.start(now, from, to, out.kv_bytes);
        self.transfers.insert(id, PendingMigration { request, from, to, bytes: out.kv_bytes, start: now });
        self.schedule_fabric_wake();
    }

    fn schedule_fabric_wake(&mut self) {
        self.fabric_gen += 1;
        if let Some(t) = self.fabric.next_completion() {
            let gen = self.fabric_gen;
            self.push(t, Event::FabricWake(gen));
        }
    }
}

fn rejected(spec: &RequestSpec, on: InstanceId) -> RequestRecord {
    RequestRecord {
        id: spec.id,
        arrival: spec.arrival,
        prompt_tokens: spec.prompt_tokens,
        reasoning_tokens: spec.reasoning_tokens,
        answer_tokens: spec.answer_tokens,
        placed_on: on,
        rejected: true,
        ..RequestRecord::default()
    }
}

#[cfg(test)]
mod tests;
