//! Arrow driving the prefill and decode pools: the controller's glue between its instances'
//! published loads and the pure decisions of [`crate::arrow`] (Alg. 1 for each new request and
//! each handoff, Alg. 2 on every [`Event::Tick`](super::Event::Tick) once an interval has passed,
//! Alg. 3 for which instance flips). A flip is an [`Action::SetRole`](super::Action::SetRole).

use super::{Controller, Move};
use crate::arrow::{
    self, ArrowError, ArrowParams, Choice, DecodeRequest, InstanceLoad, Placement, Quadratic, Snapshot,
};
use crate::roles::Role;
use kvfleet_core::policy::cache_aware::PlacementCosts;
use kvfleet_core::policy::LoadReport;
use kvfleet_core::timing::{BatchShape, TimingModel};
use kvfleet_core::{InstanceId, RequestId, TimeSpan, Timestamp};
use std::collections::BTreeMap;

/// Context tokens per sequence of the decode batches MT(i, SLO_TPOT) is measured on (ours: the
/// paper profiles TPOT against batch tokens and does not say how they split into sequences).
pub const DECODE_PROFILE_CONTEXT: u32 = 2048;

/// The most decode-batch tokens [`ArrowProfile::measure`] searches (the instance's KV capacity
/// caps MT further when its load is read).
const DECODE_PROFILE_CAP: u64 = 1 << 24;

/// What Arrow knows of an instance's speed: T(l), its prefill time for an l-token prompt, and
/// the most decode-batch tokens whose iteration meets SLO_TPOT (before the KV cap).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ArrowProfile {
    /// T(l), seconds.
    pub prefill: Quadratic,
    /// MT(SLO_TPOT) before the instance's KV capacity caps it.
    pub decode_max_tokens: u64,
}

impl ArrowProfile {
    /// What `cache-aware` weighs: this profile's prefill curve and a link of `link_gbps` Gbit/s
    /// with `link_latency_us` µs of one-way latency.
    pub fn placement_costs(&self, link_gbps: f64, link_latency_us: f64) -> PlacementCosts {
        PlacementCosts {
            prefill: self.prefill.as_curve(),
            link_bytes_per_s: link_gbps * 1e9 / 8.0,
            link_latency_s: link_latency_us * 1e-6,
        }
    }

    /// The profiler (§5.2) run against a timing model instead of start-up requests: one prefill
    /// iteration per length in [`arrow::PROFILE_PROMPT_TOKENS`] fitted by least squares, and MT
    /// by binary search over decode batches of [`DECODE_PROFILE_CONTEXT`]-token sequences.
    pub fn measure(timing: &dyn TimingModel, slo_tpot_s: f64) -> Result<ArrowProfile, ArrowError> {
        let points: Vec<(f64, f64)> = arrow::PROFILE_PROMPT_TOKENS
            .iter()
            .map(|&l| {
                let mut shape = BatchShape::default();
                shape.add_prefill(l);
                (f64::from(l), timing.iteration(&shape).as_secs_f64())
            })
            .collect();
        let prefill = Quadratic::fit(&points)?;
        let decode_s = |tokens: u64| {
            let per = u64::from(DECODE_PROFILE_CONTEXT);
            let shape = BatchShape {
                decode_seqs: u32::try_from(tokens.div_ceil(per)).unwrap_or(u32::MAX),
                decode_context_tokens: tokens,
                ..BatchShape::default()
            };
            timing.iteration(&shape).as_secs_f64()
        };
        let decode_max_tokens = arrow::max_tokens(decode_s, slo_tpot_s, DECODE_PROFILE_CAP);
        Ok(ArrowProfile { prefill, decode_max_tokens })
    }
}

/// Decode-token counters of one instance at the last monitoring pass, and the mean inter-token
/// latency over the interval that ended there.
#[derive(Clone, Copy, Debug, Default)]
struct ItlMark {
    tokens: u64,
    latency_ns: u64,
    mean_s: Option<f64>,
}

/// Arrow's state in the controller.
#[derive(Debug)]
pub(super) struct ArrowDriver {
    params: ArrowParams,
    profile: ArrowProfile,
    /// The initial decode pool's profile, where its instances span another tensor-parallel
    /// degree than `profile` was measured on: instances numbered from this id on.
    decode_pool: Option<(InstanceId, ArrowProfile)>,
    /// Profiles instances measured of themselves (a worker profiling its own timing at start-up):
    /// these come first.
    measured: BTreeMap<InstanceId, ArrowProfile>,
    /// When any instance last flipped, seconds (the P→D cooldown counts from it).
    last_flip_s: Option<f64>,
    /// Flips so far (each flip's number in the decision log).
    flips: u64,
    /// The next monitoring pass. Passes fall every interval from the first arrival this
    /// controller saw (`anchored` once it did), whenever the controller itself started.
    next_pass: Timestamp,
    anchored: bool,
    marks: BTreeMap<InstanceId, ItlMark>,
    /// Placements so far into each pool ([`Placement::RoundRobin`]'s turn).
    turns: [usize; 2],
}

impl ArrowDriver {
    /// What Arrow knows of `instance`'s speed.
    fn profile_of(&self, instance: InstanceId) -> &ArrowProfile {
        if let Some(p) = self.measured.get(&instance) {
            return p;
        }
        match &self.decode_pool {
            Some((first, p)) if instance >= *first => p,
            _ => &self.profile,
        }
    }
}

/// Where a held request's handoff goes.
pub(super) enum Handoff {
    /// Migrate it to this decode instance.
    To(InstanceId),
    /// Its prefill instance decodes now: it decodes there.
    Here,
    /// Every decode instance is full: it waits for one to report room.
    Wait,
    /// No instance decodes: it decodes where it was prefilled.
    NoDecoder,
}

/// When a handoff's target is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Decided {
    /// As its prefill starts, for a move that follows the prefill (overlap on).
    AsThePrefillStarts,
    /// Once the request is held after its first token (one-shot, or an early decision deferred).
    AtThePrefillsEnd,
}

fn secs(t: Timestamp) -> f64 {
    t.as_secs_f64()
}

impl Controller {
    /// Drive the prefill and decode pools with Arrow: new requests and handoffs are placed by its
    /// Alg. 1 (which may flip an instance's role), and every `params.interval_s` an
    /// [`Event::Tick`](super::Event::Tick) runs its monitoring pass (Alg. 2), which may flip a
    /// prefill instance to decode. Roles are set with [`Controller::set_role`] first; Arrow only
    /// flips instances between [`Role::Prefill`] and [`Role::Decode`].
    pub fn use_arrow(&mut self, params: ArrowParams, profile: ArrowProfile) -> Result<(), ArrowError> {
        params.validate()?;
        check_profile(&profile)?;
        let next_pass = self.now + TimeSpan::from_secs_f64(params.interval_s);
        self.arrow = Some(ArrowDriver {
            params,
            profile,
            decode_pool: None,
            measured: BTreeMap::new(),
            last_flip_s: None,
            flips: 0,
            next_pass,
            anchored: false,
            marks: BTreeMap::new(),
            turns: [0, 0],
        });
        Ok(())
    }

    /// Give the initial decode pool ([`Controller::split_prefill_decode`]'s instances numbered
    /// from `prefill_instances` on, also those that join later) a profile of its own: its
    /// instances span another tensor-parallel degree, and keep their GPUs when they flip. After
    /// [`Controller::use_arrow`] and the split.
    pub fn set_decode_pool_profile(&mut self, profile: ArrowProfile) -> Result<(), ArrowError> {
        check_profile(&profile)?;
        let first = self.split.as_ref().map(|s| InstanceId(s.prefill_instances));
        let (Some(a), Some(first)) = (self.arrow.as_mut(), first) else {
            let problem = "Arrow and a prefill/decode split must be in use".into();
            return Err(ArrowError::InvalidParam { field: "profile", problem });
        };
        a.decode_pool = Some((first, profile));
        Ok(())
    }

    /// The profile `instance` measured of itself (its worker, on its own timing model, e.g. live
    /// GPU kernels) for SLO_TPOT `slo_tpot_s`: it replaces the one given to
    /// [`Controller::use_arrow`] or [`Controller::set_decode_pool_profile`] for that instance,
    /// also after it restarts. Refused without Arrow, or measured for another SLO_TPOT than
    /// Arrow's (its MT would be another's).
    pub fn set_instance_profile(
        &mut self,
        instance: InstanceId,
        profile: ArrowProfile,
        slo_tpot_s: f64,
    ) -> Result<(), ArrowError> {
        check_profile(&profile)?;
        let Some(a) = self.arrow.as_mut() else {
            let problem = "Arrow must be in use".into();
            return Err(ArrowError::InvalidParam { field: "profile", problem });
        };
        if (slo_tpot_s - a.params.slo_tpot_s).abs() > 1e-9 * a.params.slo_tpot_s {
            let problem = format!("measured for SLO_TPOT {slo_tpot_s} s, Arrow runs with {} s", a.params.slo_tpot_s);
            return Err(ArrowError::InvalidParam { field: "profile", problem });
        }
        a.measured.insert(instance, profile);
        Ok(())
    }

    /// When the controller next needs an [`Event::Tick`](super::Event::Tick): Arrow's monitoring
    /// pass, or a pushed handoff's next try; `None` when nothing is due (a driver asks again
    /// after each event: a refused push makes one due).
    pub fn next_tick(&self) -> Option<Timestamp> {
        let pass = self.arrow.as_ref().map(|a| a.next_pass);
        match (pass, self.next_push_retry()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Arrow's view of the live instances now: their published loads (charges included).
    fn arrow_snapshot(&self, skip: &[InstanceId]) -> Option<Snapshot> {
        let a = self.arrow.as_ref()?;
        let loads = self
            .live
            .iter()
            .filter(|l| !skip.contains(&l.instance))
            .filter_map(|l| {
                let role = self.instances.get(&l.instance)?.role;
                let itl = a.marks.get(&l.instance).and_then(|m| m.mean_s);
                Some(instance_load(l, role, a.profile_of(l.instance), itl))
            })
            .collect();
        match Snapshot::new(loads) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "arrow: a load is not a number; deciding without arrow");
                None
            }
        }
    }

    /// Record a flip Arrow decided as of `at` (the cooldown counts from it), and apply it.
    fn arrow_flip(&mut self, instance: InstanceId, to_role: Role, at: Timestamp) {
        self.trace_flip(instance, to_role);
        if let Some(a) = self.arrow.as_mut() {
            a.last_flip_s = Some(secs(at));
            a.flips += 1;
        }
        tracing::info!(instance = instance.0, role = %to_role, "arrow flips an instance");
        self.set_role(instance, to_role);
    }

    /// Logs a flip in the decision log ([`DECISIONS`](super::DECISIONS), as placements and
    /// `</think>` decisions are): kind `flip`, the flip's number in the run as its `request`, and
    /// the Arrow loads it saw ([`Controller::arrow_loads_line`]), so two runs' flips compare line
    /// by line.
    fn trace_flip(&self, instance: InstanceId, to_role: Role) {
        let (Some(a), Some(loads)) = (self.arrow.as_ref(), self.arrow_loads_line()) else { return };
        tracing::debug!(
            target: super::DECISIONS,
            kind = "flip",
            at_ns = self.now.as_nanos(),
            request = a.flips + 1,
            to = instance.0,
            role = %to_role,
            loads = %loads
        );
    }

    /// Logs Arrow's placement of `request`'s prefill on `to` with the loads it saw (kind `place`).
    fn trace_arrow_place(&self, request: RequestId, to: InstanceId) {
        if let Some(loads) = self.arrow_loads_line() {
            super::emit_decision("place", self.now, request, to, &loads);
        }
    }

    /// Each instance's Arrow load, `instance:role:queued_prefill_ms:decode_tokens:itl_ms` (`-`
    /// for no tokens last interval), when the decision log is on.
    fn arrow_loads_line(&self) -> Option<String> {
        if !tracing::enabled!(target: super::DECISIONS, tracing::Level::DEBUG) {
            return None;
        }
        let snapshot = self.arrow_snapshot(&[])?;
        let loads: Vec<String> = snapshot
            .loads()
            .iter()
            .map(|l| {
                let itl = l.itl_mean_s.map_or_else(|| "-".to_string(), |s| format!("{:.1}", s * 1e3));
                format!("{}:{}:{:.1}:{}:{itl}", l.instance.0, l.role, l.prefill_s * 1e3, l.decode_tokens)
            })
            .collect();
        Some(loads.join(" "))
    }

    /// Alg. 1 for a new request: the prefill instance it queues on (flipping a decode instance if
    /// none meets SLO_TTFT). `None` without Arrow, or when it finds no instance (the caller falls
    /// back).
    pub(super) fn arrow_place_prefill(&mut self, request: RequestId, prompt_tokens: u32) -> Option<InstanceId> {
        let snapshot = self.arrow_snapshot(&[])?;
        let a = self.arrow.as_mut()?;
        if a.params.placement != Placement::SloAware {
            return static_pick(&snapshot, Role::Prefill, a, |l| l.prefill_s);
        }
        let choice =
            arrow::place_prefill(&snapshot, u64::from(prompt_tokens), secs(self.now), a.last_flip_s, &a.params)?;
        let to = match choice {
            Choice::Instance(id) => id,
            Choice::Flip { instance, to_role } => {
                self.trace_arrow_place(request, instance);
                self.arrow_flip(instance, to_role, self.now);
                return Some(instance);
            }
        };
        self.trace_arrow_place(request, to);
        Some(to)
    }

    /// Where held request `id`'s handoff goes: Arrow's Alg. 1 for a decode request when Arrow
    /// runs, else the decode instance with the least KV and room for it. `when`
    /// [`Decided::AsThePrefillStarts`], SLO-aware Arrow takes only a decoder that meets the SLO
    /// as it is ([`arrow::place_decode_within_slo`]): no flip, no fallback ([`Handoff::Wait`],
    /// decided again at the prefill's end).
    pub(super) fn handoff_target(&mut self, id: RequestId, m: &Move, when: Decided) -> Handoff {
        // `[pd] disaggregate`: a request not split decodes where it was prefilled.
        let prompt = self.requests.get(&id).map_or(0, |o| o.spec.prompt_tokens);
        if self.split.as_ref().is_some_and(|pd| !pd.hands_off(prompt)) {
            return Handoff::Here;
        }
        // Pushed, no decoder to try is no decoder at all: none could ever hold it.
        let least_kv = |c: &Controller| match c.choose_decoder(m) {
            Some(to) => Handoff::To(to),
            None if c.decoder_could_take(m) && !c.pushes() => Handoff::Wait,
            None => Handoff::NoDecoder,
        };
        let Some(snapshot) = self.arrow_snapshot(&m.declined) else { return least_kv(self) };
        let tokens = self.requests.get(&id).map_or(0, |o| u64::from(o.spec.prompt_tokens) + 1);
        let request = DecodeRequest { tokens, prefill_instance: Some(m.from) };
        let a = self.arrow.as_mut().expect("checked above");
        let choice = if a.params.placement == Placement::SloAware {
            match when {
                Decided::AsThePrefillStarts => arrow::place_decode_within_slo(&snapshot, request).map(Choice::Instance),
                Decided::AtThePrefillsEnd => {
                    arrow::place_decode(&snapshot, request, secs(self.now), a.last_flip_s, &a.params)
                }
            }
        } else {
            static_pick(&snapshot, Role::Decode, a, |l| l.decode_tokens as f64).map(Choice::Instance)
        };
        let to = match choice {
            None => return if self.decoder_could_take(m) { Handoff::Wait } else { Handoff::NoDecoder },
            Some(Choice::Instance(to)) => to,
            Some(Choice::Flip { instance, to_role }) => {
                self.arrow_flip(instance, to_role, self.now);
                instance
            }
        };
        if to == m.from {
            return Handoff::Here;
        }
        // Alg. 1's pick may be full (no instance met SLO_TPOT): it would refuse the KV. Pushed, it
        // is asked all the same. Pulled (ours): then the decoder with the least KV that has room,
        // else wait for one.
        if self.pushes() {
            return Handoff::To(to);
        }
        let room = self.live.iter().find(|l| l.instance == to).is_some_and(|l| has_room(l, m.kv_blocks));
        match (room, self.choose_decoder(m)) {
            (true, _) => Handoff::To(to),
            (false, Some(other)) => Handoff::To(other),
            (false, None) if self.decoder_could_take(m) => Handoff::Wait,
            (false, None) => Handoff::NoDecoder,
        }
    }

    /// Arrow's monitoring passes count their intervals from the first arrival, `first` (the
    /// request's arrival time): the simulator starts its controller as the workload starts, an
    /// emulator's leader seconds before it (or, after a failover, during it), and the passes
    /// must fall at the same points of the workload in both.
    pub(super) fn anchor_arrow_passes(&mut self, first: Timestamp) {
        let Some(a) = self.arrow.as_mut().filter(|a| !a.anchored) else { return };
        a.anchored = true;
        a.next_pass = first + TimeSpan::from_secs_f64(a.params.interval_s);
    }

    /// Alg. 2, when its interval has passed: each instance's mean inter-token latency over the
    /// interval, the pool loads, and maybe a P→D flip.
    pub(super) fn arrow_tick(&mut self) {
        let now = self.now;
        let Some(a) = self.arrow.as_mut() else { return };
        if now < a.next_pass {
            return;
        }
        // The pass stands for the last grid instant it is due at, and decides as of it: an
        // emulator's timer runs a pass a few ms late, and its flips and cooldowns must come out
        // as the simulator's, whose passes run on time (a flip at 15 s and the pass at 17 s are
        // 2 s apart, whichever ran how late). The next pass is the grid's next instant.
        let step = TimeSpan::from_secs_f64(a.params.interval_s).as_nanos().max(1);
        let behind = now.saturating_since(a.next_pass).as_nanos();
        let due = a.next_pass + TimeSpan::from_nanos(behind / step * step);
        a.next_pass = due + TimeSpan::from_nanos(step);
        for l in &self.live {
            let mark = a.marks.entry(l.instance).or_default();
            // A restarted worker counts from zero again: no interval to measure.
            let tokens = l.decode_tokens_total.checked_sub(mark.tokens);
            let latency = l.decode_latency_ns_total.checked_sub(mark.latency_ns);
            mark.mean_s = match (tokens, latency) {
                (Some(t), Some(ns)) if t > 0 => Some(ns as f64 / t as f64 / 1e9),
                _ => None,
            };
            mark.tokens = l.decode_tokens_total;
            mark.latency_ns = l.decode_latency_ns_total;
        }
        if self.arrow.as_ref().is_some_and(|a| a.params.placement != Placement::SloAware) {
            return;
        }
        let Some(snapshot) = self.arrow_snapshot(&[]) else { return };
        let a = self.arrow.as_ref().expect("checked above");
        if let Some(instance) = arrow::monitor(&snapshot, secs(due), a.last_flip_s, &a.params) {
            self.arrow_flip(instance, Role::Decode, due);
            self.retry_handoffs();
        }
    }
}

/// §6.3's baselines: the `role` pool's least-loaded instance by `load` (lowest id on a tie), or
/// its instances in turn.
fn static_pick(
    snapshot: &Snapshot,
    role: Role,
    a: &mut ArrowDriver,
    load: impl Fn(&InstanceLoad) -> f64,
) -> Option<InstanceId> {
    let pool: Vec<&InstanceLoad> = snapshot.pool(role).collect();
    if pool.is_empty() {
        return None;
    }
    match a.params.placement {
        Placement::RoundRobin => {
            let turn = &mut a.turns[usize::from(role == Role::Decode)];
            let pick = pool[*turn % pool.len()].instance;
            *turn += 1;
            Some(pick)
        }
        _ => {
            pool.iter().min_by(|x, y| load(x).total_cmp(&load(y)).then(x.instance.cmp(&y.instance))).map(|l| l.instance)
        }
    }
}

/// Whether `load`'s instance has room for a handoff of `kv_blocks` blocks and some growth,
/// counting what was promised to it already.
pub(super) fn has_room(load: &LoadReport, kv_blocks: u32) -> bool {
    let used = u64::from(load.gpu_used_blocks) + u64::from(load.waiting_blocks);
    used + u64::from(kv_blocks) + headroom(load, kv_blocks) <= u64::from(load.gpu_total_blocks)
}

/// The growth a handoff of `kv_blocks` blocks asks room for beyond its KV:
/// [`HANDOFF_HEADROOM_BLOCKS`](super::HANDOFF_HEADROOM_BLOCKS), or none where its KV alone nearly
/// fills the instance (its engine then reserves the KV without headroom).
fn headroom(load: &LoadReport, kv_blocks: u32) -> u64 {
    let h = u64::from(super::HANDOFF_HEADROOM_BLOCKS);
    if u64::from(kv_blocks) + h <= u64::from(load.gpu_total_blocks) {
        h
    } else {
        0
    }
}

/// Whether `load`'s instance could take a handoff of `kv_blocks` blocks were it empty.
pub(super) fn could_hold(load: &LoadReport, kv_blocks: u32) -> bool {
    u64::from(kv_blocks) <= u64::from(load.gpu_total_blocks)
}

/// Arrow's [`InstanceLoad`] of one published load.
fn instance_load(l: &LoadReport, role: Role, profile: &ArrowProfile, itl_mean_s: Option<f64>) -> InstanceLoad {
    let q = l.prefill_queue;
    // Σ T(l_j) = a·Σl² + b·Σl + c·n; the running prefill counts whole (an iteration prefills a
    // prompt at once).
    let prefill_s = profile.prefill.as_curve().queue(&q);
    let kv_cap = u64::from(l.gpu_total_blocks) * u64::from(l.block_tokens);
    InstanceLoad {
        instance: l.instance,
        role,
        prefill_s,
        prefill_tokens: q.tokens,
        decode_tokens: l.decode_context_tokens,
        max_tokens: profile.decode_max_tokens.min(kv_cap),
        itl_mean_s,
        profile: profile.prefill,
    }
}

/// A profile Arrow can decide with: finite prefill-time coefficients.
fn check_profile(profile: &ArrowProfile) -> Result<(), ArrowError> {
    if profile.prefill.is_finite() {
        Ok(())
    } else {
        Err(ArrowError::InvalidParam { field: "profile", problem: "not finite".into() })
    }
}

#[cfg(test)]
mod tests;
