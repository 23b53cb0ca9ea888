//! Two engines and the fabric between them, driven as `crate::cluster` drives a live migration:
//! the smallest world one [`LiveMigration`] runs in. [`simulate_one`] migrates one decoding request
//! between two otherwise idle instances, the simulator's side of `kvfleet bench migration`; the
//! unit tests build their scenarios (a full target, timeouts, running on afterwards) on [`EnginePair`].

use super::{Engines, LiveMigration, LiveMigrationSpec, StartError};
use kvfleet_core::engine::sched::{build_scheduler, SchedulerParams};
use kvfleet_core::engine::{Engine, EngineConfig, EngineError, EngineEvent};
use kvfleet_core::metrics::{MigrationRecord, RequestRecord};
use kvfleet_core::timing::TimingModel;
use kvfleet_core::{InstanceId, RequestId, RequestSpec, Timestamp};
use kvfleet_netmodel::migration::{MigrationId, MigrationParams, MigrationReport};
use kvfleet_netmodel::{Fabric, LinkError, LinkParams};
use std::sync::Arc;

/// The migrating instance of an [`EnginePair`].
pub const SOURCE: InstanceId = InstanceId(0);
/// The receiving instance of an [`EnginePair`].
pub const TARGET: InstanceId = InstanceId(1);

/// Tokens the request of [`simulate_one`] goes on decoding (reasoning) after its prefill, as the
/// request `kvfleet bench migration` submits: enough to outlast a 16k-token copy at 2 Gbit/s.
pub const SIMULATED_DECODE_TOKENS: u32 = 1000;

/// Why an [`EnginePair`] could not be built or run.
#[derive(Debug, thiserror::Error)]
pub enum PairError {
    /// The link parameters are invalid.
    #[error("link: {0}")]
    Link(#[from] LinkError),
    /// The intra-instance scheduler could not be built.
    #[error("scheduler: {0}")]
    Scheduler(String),
    /// An engine refused the request.
    #[error("submitting {request} on {on}: {source}")]
    Submit {
        /// The request.
        request: RequestId,
        /// The instance.
        on: InstanceId,
        /// The engine's error.
        source: EngineError,
    },
    /// The request was submitted but no iteration was planned for it.
    #[error("{0} has nothing to plan (its prefill does not fit one iteration?)")]
    NotPlanned(RequestId),
    /// The live migration could not be started.
    #[error("starting the migration: {0}")]
    Start(#[from] StartError),
    /// An engine's consistency check failed.
    #[error("instance {instance} broke an invariant: {message}")]
    Invariant {
        /// The instance.
        instance: InstanceId,
        /// What is inconsistent.
        message: String,
    },
    /// Nothing is due (no iteration, transfer or deadline) while the migration is unfinished.
    #[error("the migration waits for nothing: no iteration, transfer or deadline is due")]
    Stalled,
}

/// Two engines (`engines[0]`: [`SOURCE`], `engines[1]`: [`TARGET`]), the fabric between them,
/// and the virtual clock.
pub struct EnginePair {
    /// The two engines.
    pub engines: Vec<Engine>,
    /// The network between them.
    pub fabric: Fabric,
    /// The virtual clock.
    pub now: Timestamp,
    /// Requests that finished on either side, in order.
    pub finished: Vec<RequestRecord>,
}

impl EnginePair {
    /// Idle `source` and `target` engines (`fcfs`) sharing `timing`, linked by `link`.
    pub fn new(
        source: EngineConfig,
        target: EngineConfig,
        timing: Arc<dyn TimingModel>,
        link: LinkParams,
    ) -> Result<EnginePair, PairError> {
        let engine = |i: InstanceId, cfg| -> Result<Engine, PairError> {
            let sched = build_scheduler("fcfs", &SchedulerParams::default())
                .map_err(|e| PairError::Scheduler(e.to_string()))?;
            Ok(Engine::new(i, cfg, timing.clone(), sched))
        };
        Ok(EnginePair {
            engines: vec![engine(SOURCE, source)?, engine(TARGET, target)?],
            fabric: Fabric::new(2, link)?,
            now: Timestamp::ZERO,
            finished: Vec::new(),
        })
    }

    /// Submit `spec` (arriving now) on instance `on` and run its prefill, stopping right after
    /// that iteration (not planned again). Returns the tokens of KV it then holds.
    pub fn place(&mut self, on: InstanceId, spec: RequestSpec) -> Result<u32, PairError> {
        let request = spec.id;
        let e = &mut self.engines[on.0 as usize];
        e.submit(self.now, RequestSpec { arrival: self.now, ..spec }).map_err(|source| PairError::Submit {
            request,
            on,
            source,
        })?;
        self.now = e.plan_iteration(self.now).ok_or(PairError::NotPlanned(request))?;
        let mut events = Vec::new();
        e.complete_iteration(self.now, &mut events);
        let kv_tokens = e.kv().table(request).map_or(0, |t| t.tokens);
        self.collect(events);
        Ok(kv_tokens)
    }

    /// Migrate `request` from [`SOURCE`] to [`TARGET`] with `params`, started now (between two
    /// iterations of the source), as the cluster's event loop does; returns its record.
    pub fn migrate(&mut self, request: RequestId, params: MigrationParams) -> Result<MigrationRecord, PairError> {
        self.migrate_reported(request, params).map(|(record, _)| record)
    }

    /// [`EnginePair::migrate`], returning the source machine's own report beside the record
    /// ([`LiveMigration::source_report`]).
    pub fn migrate_reported(
        &mut self,
        request: RequestId,
        params: MigrationParams,
    ) -> Result<(MigrationRecord, MigrationReport), PairError> {
        let spec = LiveMigrationSpec::new(MigrationId(1), request, SOURCE, TARGET, params);
        let mut m = LiveMigration::start(self.now, spec, both(&mut self.engines), &mut self.fabric)?;
        self.plan_and_check()?;
        loop {
            // One migration: every transfer on the fabric is its own, nothing to map.
            m.take_new_transfers();
            if let Some(record) = m.take_record() {
                return Ok((record, m.source_report()));
            }
            let wakes = self.engines.iter().map(Engine::next_wake);
            let next = wakes.chain([self.fabric.next_completion(), m.next_timeout()]).flatten().min();
            self.now = next.ok_or(PairError::Stalled)?;
            self.complete_due_iterations(Some(&mut m));
            for (id, _) in self.fabric.complete_due(self.now) {
                let engines = both(&mut self.engines);
                m.on_transfer_complete(self.now, id, engines, &mut self.fabric);
            }
            if m.next_timeout().is_some_and(|t| t <= self.now) {
                let engines = both(&mut self.engines);
                m.on_timeout(self.now, engines, &mut self.fabric);
            }
            self.plan_and_check()?;
        }
    }

    /// Run both engines until neither has an iteration to run (every request finished, unless
    /// one cannot be scheduled).
    pub fn run_to_completion(&mut self) -> Result<(), PairError> {
        self.plan_and_check()?;
        while let Some(t) = self.engines.iter().filter_map(Engine::next_wake).min() {
            self.now = t;
            self.complete_due_iterations(None);
            self.plan_and_check()?;
        }
        Ok(())
    }

    fn collect(&mut self, events: Vec<EngineEvent>) {
        for ev in events {
            if let EngineEvent::Finished(r) = ev {
                self.finished.push(*r);
            }
        }
    }

    fn complete_due_iterations(&mut self, m: Option<&mut LiveMigration>) {
        let mut events = Vec::new();
        for e in &mut self.engines {
            e.complete_iteration(self.now, &mut events);
        }
        if let Some(m) = m {
            let now = self.now;
            m.on_source_iteration_end(now, both(&mut self.engines), &mut self.fabric);
        }
        self.collect(events);
    }

    fn plan_and_check(&mut self) -> Result<(), PairError> {
        for e in &mut self.engines {
            if e.needs_step() {
                e.plan_iteration(self.now);
            }
            e.check_invariants().map_err(|message| PairError::Invariant { instance: e.instance(), message })?;
        }
        Ok(())
    }
}

/// [`SOURCE`] and [`TARGET`] of a pair's engines.
fn both(engines: &mut [Engine]) -> Engines<'_> {
    Engines::pick(engines, SOURCE, TARGET).expect("an engine pair has two engines")
}

/// Migrate one request holding `kv_tokens` tokens of KV, decoding meanwhile, between two
/// otherwise idle `engine`s over a fabric of `link`, and return its record (total time, downtime,
/// stages, bytes) and the source machine's own report (stage times, and the downtime as the
/// emulator's source measures it). The request is a prompt of `kv_tokens - 1` tokens whose prefill produced the
/// first of [`SIMULATED_DECODE_TOKENS`] reasoning tokens; the migration starts right after that
/// iteration. `max_batched_tokens` is raised to fit the prompt in one iteration (as
/// `kvfleet bench migration` sizes its workers); `gpu_blocks` must hold the request on both sides.
pub fn simulate_one(
    kv_tokens: u32,
    link: LinkParams,
    params: MigrationParams,
    engine: &EngineConfig,
    timing: Arc<dyn TimingModel>,
) -> Result<(MigrationRecord, MigrationReport), PairError> {
    let request = RequestId(1);
    let cfg = EngineConfig { max_batched_tokens: engine.max_batched_tokens.max(kv_tokens), ..engine.clone() };
    let mut pair = EnginePair::new(cfg.clone(), cfg, timing, link)?;
    let spec = RequestSpec {
        content_ids: Vec::new(),
        id: request,
        arrival: Timestamp::ZERO,
        prompt_tokens: kv_tokens.saturating_sub(1).max(1),
        reasoning_tokens: SIMULATED_DECODE_TOKENS,
        answer_tokens: 1,
    };
    pair.place(SOURCE, spec)?;
    pair.migrate_reported(request, params)
}
