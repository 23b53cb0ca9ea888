//! Prefix-aware placement: send a request where its prompt's prefix is cached, unless that
//! instance is loaded enough to lose more than the cache saves.
//!
//! [`KvOverlap`] is Dynamo's KV router cost with its defaults (overlap weight 1, temperature 0):
//! for instance i, cost_i = w · (P − o_i) + d_i, where P is the request's prompt in blocks, o_i
//! the leading blocks predicted cached on i (the driver's prefix index), and d_i the blocks i
//! holds or has promised (GPU blocks in use plus those of waiting requests) plus the P − o_i
//! blocks the request would add. The cheapest instance wins; ties go to the lowest id. The
//! first term is the prefill it must compute, the second the memory and decode work there.
//!
//! [`PrecisePrefix`] is llm-d's scorer with its default weights: the highest
//! 3 · S_prefix + 2 · S_queue + 2 · S_kv, where S_prefix is the leading cached blocks and S_queue
//! the waiting requests (fewer is better), each min-max normalised over the instances (1 when all
//! are equal), and S_kv = 1 − GPU KV usage.
//!
//! [`PascalKv`] is PASCAL with prefix-aware placement: Alg. 1's filter (instances meeting their
//! answering SLO, or all when none does), then the [`KvOverlap`] cost among them with PASCAL's
//! m_i (the KV footprint, GPU + CPU + waiting) as the load; at `</think>` it decides as PASCAL
//! does.

use super::pascal::PascalPolicy;
use super::{InstancePolicy, LoadReport, PhaseChange, PhaseDecision, PrefixIndexMode};
use crate::ids::InstanceId;
use crate::request::RequestSpec;
use crate::rng::SimRng;

/// Dynamo's default overlap weight.
pub const DEFAULT_OVERLAP_WEIGHT: f64 = 1.0;

/// Least (prefill to compute + blocks active) over instances; see the module doc.
#[derive(Clone, Debug, PartialEq)]
pub struct KvOverlap {
    weight: f64,
    index: PrefixIndexMode,
}

impl Default for KvOverlap {
    fn default() -> Self {
        KvOverlap { weight: DEFAULT_OVERLAP_WEIGHT, index: PrefixIndexMode::default() }
    }
}

impl KvOverlap {
    /// With overlap weight `weight` (≥ 0, finite; checked by the config).
    pub fn new(weight: f64) -> Self {
        KvOverlap { weight, ..KvOverlap::default() }
    }
    /// Asking the driver for its prefix index in `mode`.
    pub fn with_index(mut self, mode: PrefixIndexMode) -> Self {
        self.index = mode;
        self
    }

    /// Dynamo's cost on `load`, its load `active` blocks.
    fn cost_with(&self, request: &RequestSpec, load: &LoadReport, overlap: f64, active: f64) -> f64 {
        let prompt = load.blocks_for(request.prompt_tokens) as f64;
        let fresh = (prompt - overlap).max(0.0);
        self.weight * fresh + active + fresh
    }

    fn cost(&self, request: &RequestSpec, load: &LoadReport, overlap: f64) -> f64 {
        self.cost_with(request, load, overlap, load.gpu_used_blocks as f64 + load.waiting_blocks as f64)
    }
}

/// The cheapest of `loads` allowed by `keep`, `cost` given each one's overlap (ties to the
/// lowest id).
fn cheapest(
    loads: &[LoadReport],
    overlap: &[f64],
    keep: impl Fn(&LoadReport) -> bool,
    cost: impl Fn(&LoadReport, f64) -> f64,
) -> Option<InstanceId> {
    let mut best: Option<(f64, InstanceId)> = None;
    for (k, load) in loads.iter().enumerate().filter(|(_, l)| keep(l)) {
        let c = cost(load, overlap.get(k).copied().unwrap_or(0.0));
        if best.is_none_or(|(b, id)| c < b || (c == b && load.instance < id)) {
            best = Some((c, load.instance));
        }
    }
    best.map(|(_, id)| id)
}

/// llm-d's weighted scorer; see the module doc.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PrecisePrefix {
    index: PrefixIndexMode,
}

impl PrecisePrefix {
    /// Asking the driver for its prefix index in `mode`.
    pub fn with_index(mode: PrefixIndexMode) -> Self {
        PrecisePrefix { index: mode }
    }
}

/// `v` min-max normalised over `all` (1 when they are all equal).
fn normalised(v: f64, all: impl Iterator<Item = f64> + Clone) -> f64 {
    let (lo, hi) = all.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| (lo.min(x), hi.max(x)));
    if hi > lo {
        (v - lo) / (hi - lo)
    } else {
        1.0
    }
}

impl InstancePolicy for PrecisePrefix {
    fn name(&self) -> &str {
        "precise-prefix"
    }
    fn place(&mut self, request: &RequestSpec, loads: &[LoadReport], rng: &mut SimRng) -> InstanceId {
        self.place_with_overlap(request, loads, &[], rng)
    }
    fn prefix_index(&self) -> Option<PrefixIndexMode> {
        Some(self.index)
    }
    fn place_with_overlap(
        &mut self,
        _request: &RequestSpec,
        loads: &[LoadReport],
        overlap: &[f64],
        _rng: &mut SimRng,
    ) -> InstanceId {
        let hits = (0..loads.len()).map(|k| overlap.get(k).copied().unwrap_or(0.0));
        // Fewer waiting requests score higher: normalise the negated count.
        let queues = loads.iter().map(|l| -(l.waiting_requests as f64));
        let score = |l: &LoadReport, hit: f64| {
            let usage =
                if l.gpu_total_blocks == 0 { 1.0 } else { l.gpu_used_blocks as f64 / l.gpu_total_blocks as f64 };
            3.0 * normalised(hit, hits.clone())
                + 2.0 * normalised(-(l.waiting_requests as f64), queues.clone())
                + 2.0 * (1.0 - usage.min(1.0))
        };
        // The highest score is the lowest negated one.
        cheapest(loads, overlap, |_| true, |l, hit| -score(l, hit)).unwrap_or_default()
    }
}

/// PASCAL, placing by prefix overlap among the instances Alg. 1 allows; see the module doc.
#[derive(Debug)]
pub struct PascalKv {
    pascal: PascalPolicy,
    overlap: KvOverlap,
}

impl PascalKv {
    /// `pascal` deciding at `</think>`, `overlap` weighing placements.
    pub fn new(pascal: PascalPolicy, overlap: KvOverlap) -> Self {
        PascalKv { pascal, overlap }
    }
}

impl InstancePolicy for PascalKv {
    fn name(&self) -> &str {
        "pascal-kv"
    }
    fn place(&mut self, request: &RequestSpec, loads: &[LoadReport], rng: &mut SimRng) -> InstanceId {
        self.place_with_overlap(request, loads, &[], rng)
    }
    fn prefix_index(&self) -> Option<PrefixIndexMode> {
        self.overlap.prefix_index()
    }
    fn place_with_overlap(
        &mut self,
        request: &RequestSpec,
        loads: &[LoadReport],
        overlap: &[f64],
        _rng: &mut SimRng,
    ) -> InstanceId {
        let footprint = |l: &LoadReport, o: f64| {
            let m = (l.gpu_used_blocks + l.cpu_used_blocks + l.waiting_blocks) as f64;
            self.overlap.cost_with(request, l, o, m)
        };
        cheapest(loads, overlap, |l| l.answering_slo_ok, footprint)
            .or_else(|| cheapest(loads, overlap, |_| true, footprint))
            .unwrap_or_default()
    }
    fn on_phase_change(&mut self, change: &PhaseChange, loads: &[LoadReport], rng: &mut SimRng) -> PhaseDecision {
        self.pascal.on_phase_change(change, loads, rng)
    }
    fn migrates_at_phase_boundary(&self) -> bool {
        self.pascal.migrates_at_phase_boundary()
    }
}

impl InstancePolicy for KvOverlap {
    fn name(&self) -> &str {
        "kv-overlap"
    }
    fn place(&mut self, request: &RequestSpec, loads: &[LoadReport], rng: &mut SimRng) -> InstanceId {
        self.place_with_overlap(request, loads, &[], rng)
    }
    fn prefix_index(&self) -> Option<PrefixIndexMode> {
        Some(self.index)
    }
    fn place_with_overlap(
        &mut self,
        request: &RequestSpec,
        loads: &[LoadReport],
        overlap: &[f64],
        _rng: &mut SimRng,
    ) -> InstanceId {
        debug_assert!(!loads.is_empty(), "place() needs at least one instance");
        cheapest(loads, overlap, |_| true, |l, o| self.cost(request, l, o)).unwrap_or_default()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::ids::RequestId;
    use crate::time::Timestamp;

    fn load(id: u32, used: u32, waiting: u32) -> LoadReport {
        LoadReport {
            instance: InstanceId(id),
            gpu_used_blocks: used,
            waiting_blocks: waiting,
            gpu_total_blocks: 1000,
            block_tokens: 16,
            block_bytes: 1,
            answering_slo_ok: true,
            ..LoadReport::default()
        }
    }

    /// A request of `prompt` tokens with content (the prefix-aware policies' tests share it).
    pub(crate) fn request(prompt: u32) -> RequestSpec {
        RequestSpec {
            id: RequestId(1),
            arrival: Timestamp::ZERO,
            prompt_tokens: prompt,
            reasoning_tokens: 0,
            answer_tokens: 1,
            content_ids: vec![0],
        }
    }

    #[test]
    fn follows_the_prefix_until_the_load_outweighs_it() {
        let mut p = KvOverlap::default();
        let mut rng = SimRng::seed_from_u64(1);
        let r = request(4096); // 256 blocks
        let loads = [load(0, 100, 0), load(1, 100, 0), load(2, 0, 0)];
        // Without a prefix anywhere: the emptiest instance.
        assert_eq!(p.place_with_overlap(&r, &loads, &[0.0, 0.0, 0.0], &mut rng), InstanceId(2));
        // 200 cached blocks on 1 save 2 × 200 = 400 against its 100 blocks of load.
        assert_eq!(p.place_with_overlap(&r, &loads, &[0.0, 200.0, 0.0], &mut rng), InstanceId(1));
        // A prefix on a busy instance: 2 × 40 = 80 saved < 100 blocks of load more.
        assert_eq!(p.place_with_overlap(&r, &loads, &[0.0, 40.0, 0.0], &mut rng), InstanceId(2));
        // Waiting requests count as load; ties to the lowest id.
        let loads = [load(0, 0, 50), load(1, 50, 0), load(2, 25, 25)];
        assert_eq!(p.place_with_overlap(&r, &loads, &[0.0, 0.0, 0.0], &mut rng), InstanceId(0));
        // Weight 0: only load matters (the overlap still lowers the blocks it adds).
        let mut load_only = KvOverlap::new(0.0);
        assert_eq!(
            load_only.place_with_overlap(&r, &[load(0, 10, 0), load(1, 0, 0)], &[5.0, 0.0], &mut rng),
            InstanceId(1)
        );
        assert_eq!(p.prefix_index(), Some(PrefixIndexMode::Precise));
    }

    #[test]
    fn precise_prefix_weighs_prefix_queue_and_memory_three_two_two() {
        let mut p = PrecisePrefix::default();
        let mut rng = SimRng::seed_from_u64(1);
        let r = request(4096);
        let mut loads = [load(0, 500, 0), load(1, 500, 0), load(2, 0, 0)];
        // Equal prefixes and queues: the emptiest memory (2 · 1.0 against 2 · 0.5).
        assert_eq!(p.place_with_overlap(&r, &loads, &[10.0, 10.0, 10.0], &mut rng), InstanceId(2));
        // The longest prefix: 3 + 1 against 0 + 2.
        assert_eq!(p.place_with_overlap(&r, &loads, &[100.0, 0.0, 0.0], &mut rng), InstanceId(0));
        // ... unless its queue is the longest and its memory fuller: 3 + 0 + 0.8 vs 0 + 2 + 2.
        loads[0].waiting_requests = 4;
        loads[0].gpu_used_blocks = 600;
        assert_eq!(p.place_with_overlap(&r, &loads, &[100.0, 0.0, 0.0], &mut rng), InstanceId(2));
        // The prefix's weight 3 against the queue's 2: 3 + 0 + 1.5 beats 0 + 2 + 2.
        let two = [LoadReport { waiting_requests: 4, ..load(0, 250, 0) }, load(1, 0, 0)];
        assert_eq!(p.place_with_overlap(&r, &two, &[100.0, 0.0], &mut rng), InstanceId(0));
        assert_eq!(p.prefix_index(), Some(PrefixIndexMode::Precise));
    }

    #[test]
    fn pascal_kv_follows_the_prefix_among_the_instances_meeting_their_slo() {
        let pascal = PascalPolicy::new(crate::policy::MigrationMode::Adaptive, 16);
        let mut p = PascalKv::new(pascal, KvOverlap::default());
        let mut rng = SimRng::seed_from_u64(1);
        let r = request(4096); // 256 blocks
        let mut loads = [load(0, 0, 0), load(1, 100, 0), load(2, 100, 0)];
        // The prefix on 1 outweighs its load (CPU blocks count as load for PASCAL's m_i).
        assert_eq!(p.place_with_overlap(&r, &loads, &[0.0, 200.0, 0.0], &mut rng), InstanceId(1));
        loads[1].cpu_used_blocks = 400;
        assert_eq!(p.place_with_overlap(&r, &loads, &[0.0, 200.0, 0.0], &mut rng), InstanceId(0));
        // Alg. 1: an instance missing its SLO is out while another meets it.
        loads[1].cpu_used_blocks = 0;
        loads[1].answering_slo_ok = false;
        assert_eq!(p.place_with_overlap(&r, &loads, &[0.0, 200.0, 0.0], &mut rng), InstanceId(0));
        for l in &mut loads {
            l.answering_slo_ok = false;
        }
        assert_eq!(p.place_with_overlap(&r, &loads, &[0.0, 200.0, 0.0], &mut rng), InstanceId(1), "none meets it");
        assert!(p.migrates_at_phase_boundary() && p.prefix_index().is_some());
        assert_eq!(crate::policy::baselines::LeastKv.prefix_index(), None);
    }
}
