//! The discrete-event loop: N engines, the cluster [`Controller`], one fabric, virtual time.
//!
//! Every cluster decision (placement, the move at `</think>`) is the controller's, the same
//! object the coordinator's leader drives: this loop only turns engine events into controller
//! events and executes the controller's actions on the engines and the fabric.
//!
//! A move is a live migration ([`crate::migration`]), started when its source's iteration in
//! flight ends (a worker takes a move out only between iterations): the protocol's source and target machines
//! run against the two engines over the fabric, driven by three events — a fabric transfer
//! completed, the source's iteration ended (its KV grew, or the pause can happen), a deadline
//! passed. Its end goes back to the controller as `Committed`, `Refused` (the target had no
//! room at `Prepare`: the controller may pick another target, whose move starts at once) or
//! `Aborted` (the request carries on at its source).
//!
//! Events are processed in time slices: every event at time `t` is handled (iteration ends,
//! arrivals, finished transfers), then every instance touched at `t` that has work and no
//! iteration in flight plans its next iteration. This lets a request that arrives exactly when
//! an iteration ends join the next one (PASCAL Fig. 2's timelines assume so). Ties within a
//! slice are broken by insertion order, so a seed gives byte-identical results.
//!
//! An engine whose next iterations change nothing the controller acts on plans them as one
//! event (a leap, [`Engine::plan_leap`]). Its load is then published from what it foresaw
//! ([`Engine::load_report_at`]) before any decision that follows a change, and anything that
//! changes it first settles it ([`Engine::settle`]: the leap is cut after the iteration in
//! flight). `[simulator] leap_iterations = false` steps every iteration; the results are the same.

use crate::migration::{Engines, LiveMigration, LiveMigrationSpec};
use kvfleet_control::arrow::ArrowParams;
use kvfleet_control::roles::{Overlap, PdConfig};
use kvfleet_control::{Action, ArrowProfile, Controller, Event as Control, MoveOutcome};
use kvfleet_core::engine::sched::build_scheduler;
use kvfleet_core::engine::{Engine, EngineConfig, EngineEvent, EngineStats, Settled};
use kvfleet_core::kv::{prompt_block_hashes, BlockHash};
use kvfleet_core::metrics::{DecisionTimes, MigrationRecord, RequestRecord, RoleChange};
use kvfleet_core::policy::cache_aware::PrefixFetch;
use kvfleet_core::policy::InstancePolicy;
use kvfleet_core::time::RUN_LIMIT;
use kvfleet_core::timing::TimingModel;
use kvfleet_core::{InstanceId, RequestId, RequestSpec, SimRng, Timestamp};
use kvfleet_netmodel::migration::{MigrationId, MigrationParams, LAYER_GROUPS};
use kvfleet_netmodel::{Fabric, LinkParams, TransferId};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::sync::Arc;
use std::time::Instant;

/// Wall time since `started`, ns (saturating: a decision never takes 4 s).
fn elapsed_ns(started: Instant) -> u32 {
    u32::try_from(started.elapsed().as_nanos()).unwrap_or(u32::MAX)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// The iteration in flight on this instance ends (stale unless the generation is its
    /// current one: a leap cut short queued another).
    IterationEnd(u32, u32),
    /// The `i`-th request of the workload arrives.
    Arrival(u32),
    /// The fabric's earliest transfer may have finished (stale if the generation moved on).
    FabricWake(u64),
    /// A deadline of this live migration (stale if it ended or its deadline changed).
    MigrationTimeout(u64),
    /// The controller's periodic pass ([`Controller::next_tick`]; stale if re-armed since).
    Tick,
}

/// Progress callback payload, every few thousand events.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    /// The virtual clock.
    pub now: Timestamp,
    /// Requests arrived so far.
    pub arrived: usize,
    /// Requests finished so far.
    pub finished: usize,
    /// Requests in the workload.
    pub total: usize,
}

/// Everything a run produced.
#[derive(Debug)]
pub struct ClusterOutcome {
    /// One per workload request, sorted by id (rejected ones flagged).
    pub records: Vec<RequestRecord>,
    /// Every live migration (outcome, stages, bytes, downtime), in the order they ended.
    pub migrations: Vec<MigrationRecord>,
    /// Engine counters per instance, by instance number.
    pub instances: Vec<EngineStats>,
    /// Simulated events: every iteration end and every other event, as a run stepping one
    /// iteration at a time processes them.
    pub events: u64,
    /// Events taken off the queue and handled (fewer than `events` when engines leap).
    pub queue_events: u64,
    /// Virtual time of the last event.
    pub end: Timestamp,
    /// Roles given after the start (Arrow's flips), in order.
    pub role_changes: Vec<RoleChange>,
    /// Wall time of the controller's placements and handoff decisions.
    pub decisions: DecisionTimes,
    /// Prefix fetches of cache-aware placements.
    pub fetches: FetchStats,
}

/// A run whose virtual clock passed [`RUN_LIMIT`]: an iteration or a transfer lasting longer than
/// any real one (a GPU or link figure off by orders of magnitude).
#[derive(Clone, Debug, thiserror::Error)]
#[error(
    "simulated time passed {} s at t = {:.3e} s with {finished} of {total} requests finished: an iteration or \
     transfer takes far longer than real hardware would (check the GPU's figures, the timing profile and [link])",
    limit.as_secs_f64(),
    at.as_secs_f64()
)]
pub struct Overrun {
    /// The clock when the run stopped.
    pub at: Timestamp,
    /// The limit it passed.
    pub limit: Timestamp,
    /// Requests finished by then.
    pub finished: usize,
    /// Requests in the workload.
    pub total: usize,
}

/// A run whose events ran out with requests neither finished nor rejected: reported by name,
/// never dropped from the results (a simulator bug: the cluster lost track of them).
#[derive(Clone, Debug, thiserror::Error)]
#[error(
    "the run stopped at t = {:.3} s with nothing left to happen and {} of {total} requests neither finished nor \
     rejected ({held} held on a prefill instance for a handoff): {}",
    at.as_secs_f64(),
    stuck.len(),
    name_some(stuck)
)]
pub struct Stalled {
    /// The clock when the last event ran.
    pub at: Timestamp,
    /// The requests that never finished, in id order.
    pub stuck: Vec<RequestId>,
    /// Of them, those held after their prefill for a handoff.
    pub held: usize,
    /// Requests in the workload.
    pub total: usize,
}

/// The first few of `ids`, and how many more.
fn name_some(ids: &[RequestId]) -> String {
    const SHOWN: usize = 5;
    let names: Vec<String> = ids.iter().take(SHOWN).map(|id| format!("request {}", id.0)).collect();
    match ids.len().saturating_sub(SHOWN) {
        0 => names.join(", "),
        more => format!("{} and {more} more", names.join(", ")),
    }
}

/// Why a run did not finish.
#[derive(Clone, Debug, thiserror::Error)]
pub enum RunError {
    /// The clock passed its limit.
    #[error(transparent)]
    Overrun(#[from] Overrun),
    /// Events ran out first.
    #[error(transparent)]
    Stalled(#[from] Stalled),
}

/// A live migration in progress, and the deadline an event is queued for.
struct InFlight {
    m: LiveMigration,
    armed: Option<Timestamp>,
}

/// A request waiting for the prompt blocks its placement fetches from another instance.
struct Fetching {
    spec: RequestSpec,
    on: InstanceId,
    /// The blocks on the wire, in prompt order: they join `on`'s cache when the transfer ends.
    hashes: Vec<BlockHash>,
}

/// Prefix fetches of a run (cache-aware placement).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FetchStats {
    /// Placements that copied a prefix before starting.
    pub fetches: u64,
    /// Blocks copied.
    pub blocks: u64,
    /// Bytes copied.
    pub bytes: u64,
}

/// A simulated cluster. Build it, then [`Cluster::run`] a workload.
pub struct Cluster {
    engines: Vec<Engine>,
    control: Controller,
    fabric: Fabric,
    queue: BinaryHeap<Reverse<(Timestamp, u64, Event)>>,
    seq: u64,
    fabric_gen: u64,
    /// A transfer started since the fabric's wake-up was last scheduled.
    fabric_dirty: bool,
    migration: MigrationParams,
    /// Handoffs follow prefills layer by layer (`[pd] overlap = "layer"`): the layer groups a
    /// block leaves in; 1 otherwise.
    layer_groups: u32,
    /// Requests started over ([`Action::Place`] after a start) that no instance can ever hold:
    /// their records, for the run's.
    rejected: Vec<RequestRecord>,
    /// Instances whose migrations out deliver corrupt bytes (a fault; `[migration] corrupt_sends_from`).
    corrupt_sends_from: Vec<InstanceId>,
    /// Live migrations in progress, by key (the migration id), so iteration order is fixed.
    migrations: BTreeMap<u64, InFlight>,
    next_migration: u64,
    /// Which migration each transfer on the fabric belongs to (a finished one's stay until they
    /// complete, then mean nothing).
    transfer_owner: HashMap<TransferId, u64>,
    /// Migrations in progress out of each instance (most iteration ends then skip the scan).
    migrating_out_of: Vec<u32>,
    /// Moves decided while their source runs an iteration: they start when it ends.
    pending_moves: Vec<Vec<(RequestId, InstanceId)>>,
    /// Migrations that ended and that the controller has not heard of yet.
    ended: Vec<MigrationRecord>,
    live_migrations: Vec<MigrationRecord>,
    touched: Vec<u32>,
    /// When the controller's next periodic pass is queued for.
    tick_at: Option<Timestamp>,
    role_changes: Vec<RoleChange>,
    decisions: DecisionTimes,
    /// Prefix fetches on the fabric, by transfer.
    fetches: HashMap<TransferId, Fetching>,
    fetch_stats: FetchStats,
    /// Each engine's intra-instance scheduler and its knobs (to rebuild an engine).
    intra: (String, kvfleet_core::engine::sched::SchedulerParams),
    /// Most iterations an engine may plan in a row ([`Engine::plan_leap`]); 1 steps them one at
    /// a time.
    leap_max: u32,
    /// The generation of each instance's queued iteration end (older ones are stale).
    iteration_gen: Vec<u32>,
    /// When each leaping instance's load next changes beyond its decode progress (its last
    /// published one is stale from then: published before any decision after it).
    load_change_at: Vec<Timestamp>,
}

/// Most iterations one leap may hold: bounds its forecast (a leap ends sooner at a finish,
/// `</think>`, a priority change such as the end of a quantum, or a lack of free blocks).
pub const LEAP_MAX: u32 = 1 << 12;

impl Cluster {
    /// `instances` idle engines (each with its own `intra` scheduler) sharing `timing`, joined to
    /// a [`Controller`] running `policy`, linked by the fabric `link`; live migrations use
    /// `migration`, and `seed` drives the controller's random choices. Errors name a bad piece.
    #[allow(clippy::too_many_arguments)] // one run's setup, each piece from its own config section
    pub fn new(
        instances: u32,
        engine: &EngineConfig,
        timing: Arc<dyn TimingModel>,
        intra: &str,
        intra_params: &kvfleet_core::engine::sched::SchedulerParams,
        policy: Box<dyn InstancePolicy>,
        link: LinkParams,
        migration: MigrationParams,
        seed: u64,
    ) -> Result<Cluster, String> {
        let mut engines = Vec::with_capacity(instances as usize);
        for i in 0..instances {
            let sched = build_scheduler(intra, intra_params).map_err(|e| e.to_string())?;
            engines.push(Engine::new(InstanceId(i), engine.clone(), timing.clone(), sched));
        }
        let fabric = Fabric::new(instances, link).map_err(|e| e.to_string())?;
        migration.validate().map_err(|e| e.to_string())?;
        let mut control = Controller::new(policy, SimRng::seed_from_u64(seed).fork(0x5C4E_D01E));
        for e in &engines {
            let instance = e.instance();
            let joined = Control::Joined {
                instance,
                address: format!("sim-{}", instance.0),
                model: String::new(),
                kv_bytes_per_token: engine.kv_bytes_per_token,
            };
            control.handle(Timestamp::ZERO, joined).map_err(|e| e.to_string())?;
            control.handle(Timestamp::ZERO, Control::Load(e.load_report())).map_err(|e| e.to_string())?;
        }
        Ok(Cluster {
            engines,
            control,
            fabric,
            queue: BinaryHeap::new(),
            seq: 0,
            fabric_gen: 0,
            fabric_dirty: false,
            migration,
            migrations: BTreeMap::new(),
            next_migration: 0,
            layer_groups: 1,
            corrupt_sends_from: Vec::new(),
            rejected: Vec::new(),
            transfer_owner: HashMap::new(),
            migrating_out_of: vec![0; instances as usize],
            pending_moves: vec![Vec::new(); instances as usize],
            ended: Vec::new(),
            live_migrations: Vec::new(),
            touched: Vec::new(),
            tick_at: None,
            role_changes: Vec::new(),
            decisions: DecisionTimes::default(),
            fetches: HashMap::new(),
            fetch_stats: FetchStats::default(),
            intra: (intra.to_string(), intra_params.clone()),
            leap_max: LEAP_MAX,
            iteration_gen: vec![0; instances as usize],
            load_change_at: vec![Timestamp::MAX; instances as usize],
        })
    }

    /// Before the run: instance `i` gets other hardware (another tensor-parallel degree: its own
    /// KV pool and timing), as a fresh idle engine.
    pub fn set_instance_hardware(
        &mut self,
        i: u32,
        engine: &EngineConfig,
        timing: Arc<dyn TimingModel>,
    ) -> Result<(), String> {
        let slot = self.engines.get_mut(i as usize).ok_or_else(|| format!("no instance {i}"))?;
        if !slot.is_empty() {
            return Err(format!("instance {i} already runs requests"));
        }
        let sched = build_scheduler(&self.intra.0, &self.intra.1).map_err(|e| e.to_string())?;
        *slot = Engine::new(InstanceId(i), engine.clone(), timing, sched);
        self.refresh_load(Timestamp::ZERO, i);
        Ok(())
    }

    /// Step every engine one iteration at a time (`false`) or let engines leap over iterations
    /// that change nothing outside them (`true`, the default): the results are the same, byte
    /// for byte; leaping is faster.
    pub fn set_leaping(&mut self, on: bool) {
        self.leap_max = if on { LEAP_MAX } else { 1 };
    }

    /// Bring instance `i` to `now` before changing it: a leap is cut after the iteration in
    /// flight, whose end is queued afresh (or the instance is planned again when an iteration of
    /// the leap ended at `now`); a load change the leap made by then is published.
    fn settle(&mut self, now: Timestamp, i: u32) {
        match self.engines[i as usize].settle(now) {
            Settled::Unchanged => {}
            Settled::Requeue(end) => {
                self.iteration_gen[i as usize] += 1;
                let gen = self.iteration_gen[i as usize];
                self.push(end, Event::IterationEnd(i, gen));
            }
            Settled::Replan => {
                self.iteration_gen[i as usize] += 1;
                self.touch(i);
            }
        }
        if self.load_change_at[i as usize] <= now {
            self.publish_load(now, i);
        }
    }

    /// [`Cluster::settle`] both ends of live migration `key` before it acts on them; false when
    /// it is over.
    fn settle_ends(&mut self, now: Timestamp, key: u64) -> bool {
        let Some((from, to)) = self.migrations.get(&key).map(|f| (f.m.from(), f.m.to())) else { return false };
        self.settle(now, from.0);
        self.settle(now, to.0);
        true
    }

    /// Most iterations instance `i` may plan in a row now. A leaping instance publishes its load
    /// only before decisions (and when its load changed since): its decode progress goes
    /// unpublished in between, and a charge would clear later. So no leap while the controller
    /// reads decode progress, while a decision's charge on the instance waits for a report to
    /// clear it, or while a move out of it is decided or under way.
    fn leap_limit(&self, i: u32) -> u32 {
        let quiet = self.migrating_out_of[i as usize] == 0
            && self.pending_moves[i as usize].is_empty()
            && !self.control.reads_decode_progress()
            && !self.control.is_charged(InstanceId(i));
        if quiet {
            self.leap_max
        } else {
            1
        }
    }

    /// Arrow's profile of the initial decode pool measured on `timing` (its instances run other
    /// hardware than the one [`Cluster::use_arrow`] profiled); after the split.
    pub fn use_decode_pool_profile(&mut self, slo_tpot_s: f64, timing: &dyn TimingModel) -> Result<(), String> {
        let profile = ArrowProfile::measure(timing, slo_tpot_s).map_err(|e| format!("arrow profile: {e}"))?;
        self.control.set_decode_pool_profile(profile).map_err(|e| e.to_string())
    }

    /// Hand a cost-based policy (`cache-aware`) its prefill curve, profiled on `timing` as
    /// Arrow's profiler does, and the fabric's link.
    pub fn use_placement_costs(
        &mut self,
        timing: &dyn TimingModel,
        link: &LinkParams,
        slo_tpot_s: f64,
    ) -> Result<(), String> {
        let profile = ArrowProfile::measure(timing, slo_tpot_s).map_err(|e| format!("prefill profile: {e}"))?;
        self.control.set_placement_costs(&profile.placement_costs(link.bandwidth_gbps, link.latency_us));
        Ok(())
    }

    /// Disaggregate prefill and decode as `pd` splits the instances (the controller's rule:
    /// the first `pd.prefill_instances` prefill new requests and hand each off after its first
    /// token to one of the others, which decode). Off: every instance does both.
    pub fn split_prefill_decode(&mut self, pd: &PdConfig) {
        self.control.split_prefill_decode(pd);
        self.layer_groups = if pd.overlap == Overlap::Layer { LAYER_GROUPS } else { 1 };
        self.follow_decisions(Timestamp::ZERO);
        // The split is where the run starts, not a change: a flip at t = 0 is one.
        self.role_changes.clear();
    }

    /// A fault: every migration out of `instances` delivers bytes that fail their checksum at the
    /// target, as a worker started with `--corrupt-sent-blocks` does.
    pub fn corrupt_sends_from(&mut self, instances: &[u32]) {
        self.corrupt_sends_from = instances.iter().map(|&i| InstanceId(i)).collect();
    }

    /// Let Arrow place prefills and handoffs and flip roles (after
    /// [`Cluster::split_prefill_decode`] set its initial pools), profiling `timing` as its
    /// profiler would profile the instances.
    pub fn use_arrow(&mut self, params: ArrowParams, timing: &dyn TimingModel) -> Result<(), String> {
        let profile = ArrowProfile::measure(timing, params.slo_tpot_s).map_err(|e| format!("arrow profile: {e}"))?;
        self.control.use_arrow(params, profile).map_err(|e| e.to_string())
    }

    /// Queue the controller's next periodic pass, while the run has work left.
    fn arm_tick(&mut self, busy: bool) {
        let Some(at) = self.control.next_tick().filter(|_| busy) else { return };
        if self.tick_at != Some(at) {
            self.tick_at = Some(at);
            self.push(at, Event::Tick);
        }
    }

    /// Carry out what the controller decided after a move, a handoff or a role change: moves start
    /// (or wait for their source's iteration), held requests are released, roles applied.
    fn follow_decisions(&mut self, now: Timestamp) {
        while let Some(action) = self.control.poll_action() {
            self.follow(now, action);
        }
    }

    /// Carry out one decision other than a placement.
    fn follow(&mut self, now: Timestamp, action: Action) {
        match action {
            Action::Migrate { request, from, to, .. } => self.begin_move(now, request, from, to),
            Action::Release { request, on } => {
                self.settle(now, on.0);
                let _ = self.engines[on.0 as usize].release_held(request);
                self.touch(on.0);
            }
            Action::SetRole { instance, role } => {
                self.settle(now, instance.0);
                self.engines[instance.0 as usize].set_hand_off(role.hands_off());
                self.touch(instance.0);
                let change = RoleChange { at_s: now.as_secs_f64(), instance: instance.0, role: role.to_string() };
                self.role_changes.push(change);
            }
            Action::Drop { request, on } => {
                // A copy the cluster no longer counts (its KV is computed again elsewhere).
                self.settle(now, on.0);
                let _ = self.engines[on.0 as usize].cancel(request);
                self.touch(on.0);
            }
            Action::Place { request, on, fetch: None, .. } => {
                // Started over: its spec is the controller's.
                let Some(spec) = self.control.ownership(request).map(|o| o.spec.clone()) else { return };
                let mut rejected = Vec::new();
                self.start_on(now, &spec, on, &mut rejected);
                self.rejected.append(&mut rejected);
            }
            other => debug_assert!(false, "the simulator cannot execute {other:?}"),
        }
    }

    fn push(&mut self, at: Timestamp, ev: Event) {
        self.seq += 1;
        self.queue.push(Reverse((at, self.seq, ev)));
    }

    fn touch(&mut self, i: u32) {
        self.touched.push(i);
    }

    /// Instance `i` publishes its load (the controller drops the charges it now shows) and its
    /// prefix cache's changes, as of `now` (a leap goes on).
    fn refresh_load(&mut self, now: Timestamp, i: u32) {
        self.publish_load(now, i);
    }

    /// Before a decision: every leaping instance whose load changed since it last published
    /// publishes, so the controller sees what it would after every iteration.
    fn publish_load_changes(&mut self, now: Timestamp) {
        for i in 0..self.engines.len() as u32 {
            if self.load_change_at[i as usize] <= now {
                self.refresh_load(now, i);
            }
        }
    }

    fn publish_load(&mut self, now: Timestamp, i: u32) {
        let engine = &mut self.engines[i as usize];
        self.load_change_at[i as usize] = engine.next_load_change(now).unwrap_or(Timestamp::MAX);
        let load = engine.load_report_at(now);
        let mut events = Vec::new();
        engine.drain_kv_events(&mut events);
        if !events.is_empty() {
            // What its prefix cache stored and evicted, for a prefix-aware policy's index.
            let _ = self.control.handle(now, Control::KvEvents { instance: InstanceId(i), events });
        }
        // Only unknown requests can make an event fail; a load report never does.
        let _ = self.control.handle(now, Control::Load(load));
    }

    /// Every published load rests on the report its engine would give now (checked in debug
    /// builds): in virtual time every report is instant. (A published load may still carry
    /// charges: a move decided and not yet reserved on its target.)
    fn loads_are_fresh(&self) -> bool {
        self.engines.iter().zip(self.control.loads()).all(|(e, l)| e.load_report().admitted == l.admitted)
    }

    /// Instances changed earlier in this time slice, and leaping ones whose load changed,
    /// publish their load before a policy reads it.
    fn refresh_touched_loads(&mut self, now: Timestamp) {
        self.publish_load_changes(now);
        for k in 0..self.touched.len() {
            let i = self.touched[k];
            self.refresh_load(now, i);
        }
    }

    /// Run `requests` (sorted by arrival) to completion, or stop with [`Overrun`] once the clock
    /// passes [`RUN_LIMIT`] ([`Stalled`] if the events run out with requests unfinished).
    pub fn run(self, requests: &[RequestSpec], progress: impl FnMut(Progress)) -> Result<ClusterOutcome, RunError> {
        self.run_until(requests, RUN_LIMIT, progress)
    }

    /// [`Cluster::run`] with the clock stopped at `until` instead of [`RUN_LIMIT`].
    pub fn run_until(
        mut self,
        requests: &[RequestSpec],
        until: Timestamp,
        mut progress: impl FnMut(Progress),
    ) -> Result<ClusterOutcome, RunError> {
        let total = requests.len();
        let mut records: Vec<RequestRecord> = Vec::with_capacity(total);
        let mut events_buf = Vec::new();
        let mut arrived = 0usize;
        // Events other than iteration ends (those are counted by the engines), and all handled.
        let mut events: u64 = 0;
        let mut queue_events: u64 = 0;
        // The last instant something happened (a deadline of a migration long over is nothing).
        let mut last_event = Timestamp::ZERO;
        // Arrivals are fed lazily: only the next one is in the queue.
        if let Some(first) = requests.first() {
            self.push(first.arrival, Event::Arrival(0));
        }
        while let Some(Reverse((now, _, _))) = self.queue.peek().copied() {
            if now > until {
                return Err(Overrun { at: now, limit: until, finished: records.len(), total }.into());
            }
            while let Some(&Reverse((t2, _, ev))) = self.queue.peek() {
                if t2 != now {
                    break;
                }
                self.queue.pop();
                if let Event::MigrationTimeout(key) = ev {
                    if self.migrations.get(&key).is_none_or(|f| f.armed != Some(now)) {
                        continue;
                    }
                }
                if ev == Event::Tick && self.tick_at != Some(now) {
                    continue;
                }
                if let Event::IterationEnd(i, gen) = ev {
                    if self.iteration_gen[i as usize] != gen {
                        continue;
                    }
                } else {
                    events += 1;
                }
                queue_events += 1;
                last_event = now;
                // The engine of the next event is cache-cold: start fetching its data now.
                if let Some(&Reverse((_, _, Event::IterationEnd(j, _)))) = self.queue.peek() {
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
                        let started = Instant::now();
                        let placed = self.control.handle(now, Control::Arrival(spec.clone()));
                        self.decisions.arrival_ns.push(elapsed_ns(started));
                        if let Err(e) = placed {
                            // A duplicate id in the workload: it ran once already.
                            records.push(rejected(spec, InstanceId(0)));
                            debug_assert!(false, "{e}");
                            continue;
                        }
                        self.execute(now, spec, &mut records);
                    }
                    Event::IterationEnd(i, _) => {
                        let decided = std::mem::take(&mut self.pending_moves[i as usize]);
                        self.engines[i as usize].complete_iteration(now, &mut events_buf);
                        for ev in std::mem::take(&mut events_buf) {
                            match ev {
                                EngineEvent::Finished(mut r) => {
                                    // How often it started over is the controller's count.
                                    r.replaced = self.control.ownership(r.id).map_or(0, |o| o.replaced);
                                    let _ = self
                                        .control
                                        .handle(now, Control::Finished { request: r.id, from: Some(InstanceId(i)) });
                                    records.push(*r);
                                }
                                EngineEvent::PhaseBoundary { request, kv_blocks } => {
                                    self.on_phase_boundary(now, i, request, kv_blocks, &mut records);
                                }
                                EngineEvent::PrefillStarted { request, kv_blocks } => {
                                    let instance = InstanceId(i);
                                    let ev = Control::PrefillStarted { request, instance, kv_blocks };
                                    self.on_prefill_event(now, i, ev);
                                }
                                EngineEvent::PrefillDone { request, kv_blocks } => {
                                    let done = Control::PrefillDone { request, instance: InstanceId(i), kv_blocks };
                                    self.on_prefill_event(now, i, done);
                                }
                            }
                        }
                        for (request, to) in decided {
                            self.start_migration(now, request, InstanceId(i), to);
                        }
                        if self.migrating_out_of[i as usize] > 0 {
                            self.on_source_iteration_end(now, i);
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
                            if let Some(f) = self.fetches.remove(&id) {
                                self.settle(now, f.on.0);
                                self.engines[f.on.0 as usize].install_prefix(&f.hashes);
                                self.start_on(now, &f.spec, f.on, &mut records);
                                continue;
                            }
                            let Some(key) = self.transfer_owner.remove(&id) else { continue };
                            if !self.settle_ends(now, key) {
                                continue;
                            }
                            self.call_migration(key, |m, engines, fabric| {
                                m.on_transfer_complete(now, id, engines, fabric);
                            });
                        }
                        self.fabric_dirty = true;
                    }
                    Event::Tick => {
                        self.tick_at = None;
                        self.refresh_touched_loads(now);
                        let _ = self.control.handle(now, Control::Tick);
                        self.follow_decisions(now);
                    }
                    Event::MigrationTimeout(key) => {
                        if self.settle_ends(now, key) {
                            self.migrations.get_mut(&key).expect("settled above").armed = None;
                            self.call_migration(key, |m, engines, fabric| m.on_timeout(now, engines, fabric));
                        }
                    }
                }
                if !self.ended.is_empty() {
                    self.report_ended_migrations(now);
                }
            }
            if std::mem::take(&mut self.fabric_dirty) {
                self.schedule_fabric_wake();
            }
            // Plan every instance touched in this slice, in a deterministic order. Their reports
            // may let the controller hand off requests waiting for a decode instance: those moves
            // touch instances in turn.
            let mut touched = std::mem::take(&mut self.touched);
            loop {
                touched.sort_unstable();
                touched.dedup();
                for &i in &touched {
                    if self.engines[i as usize].needs_step() {
                        let max = self.leap_limit(i);
                        if let Some(end) = self.engines[i as usize].plan_leap(now, max) {
                            self.iteration_gen[i as usize] += 1;
                            let gen = self.iteration_gen[i as usize];
                            self.push(end, Event::IterationEnd(i, gen));
                            if self.layer_groups > 1 {
                                self.on_iteration_planned(now, i);
                            }
                        }
                    }
                    self.refresh_load(now, i);
                }
                touched.clear();
                self.follow_decisions(now);
                if self.touched.is_empty() {
                    break;
                }
                std::mem::swap(&mut touched, &mut self.touched);
            }
            self.touched = touched;
            records.append(&mut self.rejected);
            // Handoffs started above put transfers on the fabric.
            if std::mem::take(&mut self.fabric_dirty) {
                self.schedule_fabric_wake();
            }
            // Periodic passes while anything can still happen: an event is queued besides the
            // pass itself, or a held request waits for a decode instance (a flip may free one).
            let queued = self.queue.len() > usize::from(self.tick_at.is_some());
            self.arm_tick(arrived < total || queued || self.control.waiting_handoffs() > 0);
            if events % 4096 < 8 {
                progress(Progress { now, arrived, finished: records.len(), total });
            }
        }
        progress(Progress { now: last_event, arrived, finished: records.len(), total });
        debug_assert!(self.migrations.is_empty(), "every migration ends");
        debug_assert!(self.fetches.is_empty(), "every prefix fetch ends");
        debug_assert!(self.pending_moves.iter().all(Vec::is_empty), "every decided move starts");
        records.sort_by_key(|r| r.id);
        if records.len() < total {
            let done: std::collections::HashSet<RequestId> = records.iter().map(|r| r.id).collect();
            let mut stuck: Vec<RequestId> = requests.iter().map(|r| r.id).filter(|id| !done.contains(id)).collect();
            stuck.sort_unstable();
            let held = self.control.waiting_handoffs();
            return Err(Stalled { at: last_event, stuck, held, total }.into());
        }
        let iterations: u64 = self.engines.iter().map(|e| e.stats().iterations).sum();
        Ok(ClusterOutcome {
            records,
            migrations: self.live_migrations,
            instances: self.engines.iter().map(|e| e.stats().clone()).collect(),
            events: events + iterations,
            queue_events,
            end: last_event,
            role_changes: self.role_changes,
            decisions: self.decisions,
            fetches: self.fetch_stats,
        })
    }

    /// Execute the controller's decisions: placements on engines, moves on the fabric.
    fn execute(&mut self, now: Timestamp, arrival: &RequestSpec, records: &mut Vec<RequestRecord>) {
        while let Some(action) = self.control.poll_action() {
            match action {
                Action::Place { request, on, fetch, .. } => {
                    // Its charge must clear as it would after a step: no leap hides the report.
                    self.settle(now, on.0);
                    debug_assert_eq!(request, arrival.id, "the simulator re-places nothing: no instance dies");
                    if !fetch.is_some_and(|f| self.start_fetch(now, arrival, on, f)) {
                        self.start_on(now, arrival, on, records);
                    }
                }
                Action::Reject { .. } => records.push(rejected(arrival, InstanceId(0))),
                other => self.follow(now, other),
            }
        }
    }

    /// Submit `spec` to instance `on`.
    fn start_on(&mut self, now: Timestamp, spec: &RequestSpec, on: InstanceId, records: &mut Vec<RequestRecord>) {
        self.settle(now, on.0);
        let request = spec.id;
        match self.engines[on.0 as usize].submit(now, spec.clone()) {
            Ok(()) => {
                self.refresh_load(now, on.0);
                self.touch(on.0);
            }
            Err(_) => {
                // Can never fit that instance: finished as rejected (not lost).
                let _ = self.control.handle(now, Control::Finished { request, from: Some(on) });
                records.push(rejected(spec, on));
            }
        }
    }

    /// Put the prompt blocks `fetch` names that its holder still caches, computed, on the GPU on the fabric
    /// to `on`; the request starts there when they arrive. `false` (start it now) when the holder
    /// has none of them left or `on` caches no prefixes.
    fn start_fetch(&mut self, now: Timestamp, spec: &RequestSpec, on: InstanceId, fetch: PrefixFetch) -> bool {
        let target = self.engines[on.0 as usize].config();
        if !target.prefix_caching || fetch.from == on {
            return false;
        }
        // (What a leap changes on the holder is not its prefix cache.)
        let (block_bytes, block_size) = (target.block_bytes(), target.block_size);
        let hashes = prompt_block_hashes(&spec.content_ids, spec.prompt_tokens, block_size);
        let end = (fetch.end as usize).min(hashes.len());
        // Only blocks whose prefill finished hold content to copy (a worker checks their stamps).
        let held = self.engines[fetch.from.0 as usize].computed_prefix_blocks(&hashes[..end]) as usize;
        let first = fetch.first as usize;
        if held <= first {
            return false;
        }
        let blocks = (held - first) as u64;
        let id = self.fabric.start(now, fetch.from, on, blocks * block_bytes);
        self.fabric_dirty = true;
        self.fetch_stats.fetches += 1;
        self.fetch_stats.blocks += blocks;
        self.fetch_stats.bytes += blocks * block_bytes;
        self.fetches.insert(id, Fetching { spec: spec.clone(), on, hashes: hashes[first..held].to_vec() });
        true
    }

    fn on_phase_boundary(
        &mut self,
        now: Timestamp,
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
                Action::Migrate { request, from, to, .. } => self.begin_move(now, request, from, to),
                other => {
                    debug_assert!(false, "unexpected decision at a phase boundary: {other:?}");
                    let _ = records;
                }
            }
        }
    }

    /// A prefill on instance `i` started (with overlap, its handoff may be decided now) or ended
    /// (the request is held for its handoff): the controller decides on the loads as of now, as
    /// for a phase boundary.
    fn on_prefill_event(&mut self, now: Timestamp, i: u32, ev: Control) {
        self.refresh_load(now, i);
        self.refresh_touched_loads(now);
        let started = Instant::now();
        let _ = self.control.handle(now, ev);
        self.decisions.handoff_ns.push(elapsed_ns(started));
        self.follow_decisions(now);
    }

    /// Execute a move the controller decided as a worker does: its source takes a move out only
    /// between iterations, and by the time the decision reaches it (the boundary that prompted it
    /// travelled to the leader, the move back) it has planned its next one — so a source that
    /// runs, or is about to run, an iteration starts the move when that iteration ends (the
    /// request one token longer); an idle one starts it now. A handoff's request is held and does
    /// not grow: it starts unless an iteration is in flight.
    fn begin_move(&mut self, now: Timestamp, request: RequestId, from: InstanceId, to: InstanceId) {
        // The target carries the move's charge until it reserves: no leap may hide its reports.
        self.settle(now, from.0);
        self.settle(now, to.0);
        let source = &self.engines[from.0 as usize];
        // A request held after its prefill runs in no iteration and does not grow: its handoff
        // starts at once, whatever the source runs (an instance holding only handoffs may never
        // run another iteration). One whose prefill runs starts at once too: the move follows the
        // prefill, copying only the blocks its chunks wrote, and pauses at its end.
        let at_once = source.is_held(request) || source.prompt_written(request).is_some();
        if !at_once && (source.next_wake().is_some() || source.needs_step()) {
            self.pending_moves[from.0 as usize].push((request, to));
        } else {
            self.start_migration(now, request, from, to);
        }
    }

    /// Start the live migration the controller decided; one that cannot start (the request left
    /// its source, or holds no KV) is an abort.
    fn start_migration(&mut self, now: Timestamp, request: RequestId, from: InstanceId, to: InstanceId) {
        self.settle(now, from.0);
        self.settle(now, to.0);
        let key = self.next_migration;
        self.next_migration += 1;
        let spec = LiveMigrationSpec {
            layer_groups: self.layer_groups,
            corrupt: self.corrupt_sends_from.contains(&from),
            ..LiveMigrationSpec::new(MigrationId(key), request, from, to, self.migration.clone())
        };
        let started = match Engines::pick(&mut self.engines, from, to) {
            Some(engines) => LiveMigration::start(now, spec, engines, &mut self.fabric).map_err(|e| e.to_string()),
            None => Err(format!("no instance pair {from} → {to}")),
        };
        match started {
            Ok(m) => {
                self.migrating_out_of[from.0 as usize] += 1;
                self.migrations.insert(key, InFlight { m, armed: None });
                self.after_migration_call(key);
            }
            Err(_) => {
                self.publish_load_changes(now);
                let _ = self
                    .control
                    .handle(now, Control::MigrationEnded { request, from, to, outcome: MoveOutcome::Aborted });
                self.follow_decisions(now);
            }
        }
    }

    /// Handoffs following prefills layer by layer: instance `i` planned an iteration. A prefill
    /// whose first chunk it computes may be handed off now (the controller decides), and every
    /// migration out of it follows the layer groups of the chunk it computes.
    fn on_iteration_planned(&mut self, now: Timestamp, i: u32) {
        for (request, kv_blocks) in self.engines[i as usize].prefills_starting() {
            let instance = InstanceId(i);
            self.on_prefill_event(now, i, Control::PrefillStarted { request, instance, kv_blocks });
        }
        if self.migrating_out_of[i as usize] == 0 {
            return;
        }
        for key in self.migrations_out_of(i) {
            self.call_migration(key, |m, engines, fabric| m.on_source_iteration_planned(now, engines, fabric));
        }
    }

    /// The migrations out of instance `i`, in key order.
    fn migrations_out_of(&self, i: u32) -> Vec<u64> {
        self.migrations.iter().filter(|(_, f)| f.m.from().0 == i).map(|(&k, _)| k).collect()
    }

    /// Call into migration `key` with its two engines and the fabric, then
    /// [`Cluster::after_migration_call`].
    fn call_migration(&mut self, key: u64, call: impl FnOnce(&mut LiveMigration, Engines<'_>, &mut Fabric)) {
        let f = self.migrations.get_mut(&key).expect("a migration in progress");
        let engines = Engines::pick(&mut self.engines, f.m.from(), f.m.to()).expect("two instances");
        call(&mut f.m, engines, &mut self.fabric);
        self.after_migration_call(key);
    }

    /// Instance `i` completed an iteration: every migration out of it sees the request's KV grow,
    /// and may pause it now.
    fn on_source_iteration_end(&mut self, now: Timestamp, i: u32) {
        for key in self.migrations_out_of(i) {
            self.settle_ends(now, key);
            self.call_migration(key, |m, engines, fabric| m.on_source_iteration_end(now, engines, fabric));
        }
    }

    /// After any call into migration `key`: route its new transfers, re-arm its deadline, let
    /// both instances plan again if it changed them (a reservation, pause, attach or abort), and
    /// once it is over, queue its record for the controller.
    fn after_migration_call(&mut self, key: u64) {
        let Some(f) = self.migrations.get_mut(&key) else { return };
        let new = f.m.take_new_transfers();
        self.fabric_dirty |= !new.is_empty();
        for id in new {
            self.transfer_owner.insert(id, key);
        }
        let (from, to) = (f.m.from().0, f.m.to().0);
        let changed = f.m.take_engines_changed();
        let record = f.m.take_record();
        let deadline = f.m.next_timeout().filter(|_| record.is_none());
        let rearm = deadline.filter(|&t| f.armed != Some(t));
        f.armed = deadline;
        if let Some(t) = rearm {
            self.push(t, Event::MigrationTimeout(key));
        }
        if changed {
            self.touch(from);
            self.touch(to);
        }
        if let Some(record) = record {
            self.migrations.remove(&key);
            self.migrating_out_of[from as usize] -= 1;
            self.ended.push(record);
        }
    }

    /// Tell the controller how the migrations that ended went, and start the moves it decides
    /// next (a refused move goes to the policy's next choice).
    fn report_ended_migrations(&mut self, now: Timestamp) {
        while !self.ended.is_empty() {
            for record in std::mem::take(&mut self.ended) {
                let outcome = if record.committed() {
                    MoveOutcome::Committed
                } else if record.refused() {
                    MoveOutcome::Refused
                } else if record.checksum_mismatch {
                    MoveOutcome::Corrupt
                } else {
                    MoveOutcome::Aborted
                };
                // The policy may pick the next target: it must see every load as of now.
                self.refresh_touched_loads(now);
                let _ = self.control.handle(
                    now,
                    Control::MigrationEnded { request: record.request, from: record.from, to: record.to, outcome },
                );
                self.live_migrations.push(record);
                self.follow_decisions(now);
            }
        }
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
