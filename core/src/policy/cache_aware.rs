//! Mooncake's cache-aware placement (Conductor, Alg. 1): the instance with the least predicted
//! time to first token, where an instance holding a much shorter prefix than the best holder
//! first fetches the missing blocks from it.
//!
//! For instance k with o_k leading prompt blocks cached (the driver's prefix index; a block only
//! in the CPU tier counts 0.75) and o* the longest run on any instance (its holder h, ties to the
//! lowest id):
//!
//! - T_queue(k) = Σ T(l) over the prompts that have not produced their first token on k (the load
//!   report's prefill-queue sums against the quadratic prefill curve T);
//! - when o* / o_k > θ (or o_k = 0 < o*), k fetches blocks ⌊o_k⌋…⌊o*⌋ from h first:
//!   TTFT_k = T_queue(k) + T_transfer(⌊o*⌋ − ⌊o_k⌋ blocks) + T(ISL − ⌊o*⌋·B);
//! - else TTFT_k = T_queue(k) + T(ISL − o_k·B),
//!
//! with B tokens per block and T_transfer = link latency + bytes / link rate. The least TTFT wins
//! (ties to the lowest id); [`InstancePolicy::prefix_fetch`] then names the fetch, which the
//! driver carries out before the request starts (the fetched blocks join the target's cache, so
//! hot prefixes replicate). θ = 2.0 (ours; the paper tunes it by hand).
//!
//! The curve and the link come from the driver ([`InstancePolicy::set_costs`]): a simulator
//! profiles its timing model and knows its fabric. Until it does, the policy places as
//! [`KvOverlap`] would.

use super::prefix::KvOverlap;
use super::{InstancePolicy, LoadReport, PrefillQueue, PrefixIndexMode};
use crate::ids::InstanceId;
use crate::request::RequestSpec;
use crate::rng::SimRng;
use serde::{Deserialize, Serialize};

/// The default fetch threshold θ.
pub const DEFAULT_FETCH_THRESHOLD: f64 = 2.0;

/// T(l) = a·l² + b·l + c seconds: an instance's prefill time for l tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PrefillCurve {
    /// Seconds per token².
    pub a: f64,
    /// Seconds per token.
    pub b: f64,
    /// Seconds.
    pub c: f64,
}

impl PrefillCurve {
    /// T(l), seconds (never negative).
    pub fn eval(&self, tokens: f64) -> f64 {
        ((self.a * tokens + self.b) * tokens + self.c).max(0.0)
    }
    /// Σ T(l) over a queue of prompts, from its sums.
    pub fn queue(&self, q: &PrefillQueue) -> f64 {
        (self.a * q.tokens_sq as f64 + self.b * q.tokens as f64 + self.c * q.requests as f64).max(0.0)
    }
}

/// What a cost-based placement needs beyond load reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlacementCosts {
    /// Prefill time of a prompt's uncached tokens.
    pub prefill: PrefillCurve,
    /// The link between two instances, bytes per second.
    pub link_bytes_per_s: f64,
    /// Its one-way latency, seconds.
    pub link_latency_s: f64,
}

impl PlacementCosts {
    /// Seconds to copy `blocks` blocks of `block_bytes` bytes over the link.
    pub fn transfer_s(&self, blocks: u32, block_bytes: u64) -> f64 {
        let bytes = blocks as f64 * block_bytes as f64;
        self.link_latency_s + if self.link_bytes_per_s > 0.0 { bytes / self.link_bytes_per_s } else { 0.0 }
    }
}

/// Prompt blocks `first..end` (leading blocks, by index) copied from `from`'s cache to the
/// request's instance before it starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixFetch {
    /// The instance holding the longest cached prefix.
    pub from: InstanceId,
    /// The first block the target lacks.
    pub first: u32,
    /// One past the last block the holder has.
    pub end: u32,
}

impl PrefixFetch {
    /// Blocks to copy.
    pub fn blocks(&self) -> u32 {
        self.end - self.first
    }
}

/// The fetch rule of the module doc for `loads[k]` (`overlap[k]` its leading cached blocks).
pub fn fetch_for(loads: &[LoadReport], overlap: &[f64], k: usize, theta: f64) -> Option<PrefixFetch> {
    let o = |j: usize| overlap.get(j).copied().unwrap_or(0.0).max(0.0);
    let (best, best_o) = (0..loads.len()).fold((k, o(k)), |(b, bo), j| {
        let oj = o(j);
        if oj > bo || (oj == bo && loads[j].instance < loads[b].instance) {
            (j, oj)
        } else {
            (b, bo)
        }
    });
    let (first, end) = (o(k).floor() as u32, best_o.floor() as u32);
    let far = o(k) == 0.0 || best_o / o(k) > theta;
    (best != k && end > first && far).then(|| PrefixFetch { from: loads[best].instance, first, end })
}

/// Least predicted TTFT, fetching a much longer prefix first; see the module doc.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheAware {
    theta: f64,
    costs: Option<PlacementCosts>,
    fallback: KvOverlap,
}

impl Default for CacheAware {
    fn default() -> Self {
        CacheAware::new(DEFAULT_FETCH_THRESHOLD)
    }
}

impl CacheAware {
    /// Fetching when the best holder has more than `theta` (> 1, checked by the config) times the
    /// blocks an instance holds.
    pub fn new(theta: f64) -> Self {
        CacheAware { theta, costs: None, fallback: KvOverlap::default() }
    }

    /// The predicted TTFT of `request` on `loads[k]`, seconds.
    fn ttft(
        &self,
        costs: &PlacementCosts,
        request: &RequestSpec,
        loads: &[LoadReport],
        overlap: &[f64],
        k: usize,
    ) -> f64 {
        let load = &loads[k];
        let block_tokens = f64::from(load.block_tokens.max(1));
        let prompt = f64::from(request.prompt_tokens);
        let (cached_blocks, transfer) = match fetch_for(loads, overlap, k, self.theta) {
            Some(f) => (f64::from(f.end), costs.transfer_s(f.blocks(), load.block_bytes)),
            None => (overlap.get(k).copied().unwrap_or(0.0).max(0.0), 0.0),
        };
        // As the engine does, at least the last token is computed.
        let uncached = (prompt - cached_blocks * block_tokens).max(1.0);
        costs.prefill.queue(&load.prefill_queue) + transfer + costs.prefill.eval(uncached)
    }
}

impl InstancePolicy for CacheAware {
    fn name(&self) -> &str {
        "cache-aware"
    }
    fn place(&mut self, request: &RequestSpec, loads: &[LoadReport], rng: &mut SimRng) -> InstanceId {
        self.place_with_overlap(request, loads, &[], rng)
    }
    fn prefix_index(&self) -> Option<PrefixIndexMode> {
        Some(PrefixIndexMode::Precise)
    }
    fn place_with_overlap(
        &mut self,
        request: &RequestSpec,
        loads: &[LoadReport],
        overlap: &[f64],
        rng: &mut SimRng,
    ) -> InstanceId {
        let Some(costs) = self.costs else { return self.fallback.place_with_overlap(request, loads, overlap, rng) };
        let mut best: Option<(f64, InstanceId)> = None;
        for k in 0..loads.len() {
            let t = self.ttft(&costs, request, loads, overlap, k);
            let id = loads[k].instance;
            if best.is_none_or(|(b, bid)| t < b || (t == b && id < bid)) {
                best = Some((t, id));
            }
        }
        best.map(|(_, id)| id).unwrap_or_default()
    }
    fn set_costs(&mut self, costs: &PlacementCosts) {
        self.costs = Some(*costs);
    }
    fn needs_costs(&self) -> bool {
        true
    }
    fn prefix_fetch(&self, loads: &[LoadReport], overlap: &[f64], chosen: InstanceId) -> Option<PrefixFetch> {
        self.costs?;
        let k = loads.iter().position(|l| l.instance == chosen)?;
        fetch_for(loads, overlap, k, self.theta)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::prefix::tests::request;

    fn load(id: u32, queued_tokens: u64) -> LoadReport {
        let prefill_queue = PrefillQueue {
            requests: u32::from(queued_tokens > 0),
            tokens: queued_tokens,
            tokens_sq: queued_tokens.pow(2),
        };
        LoadReport {
            instance: InstanceId(id),
            gpu_total_blocks: 10_000,
            block_tokens: 16,
            block_bytes: 1 << 20,
            prefill_queue,
            ..LoadReport::default()
        }
    }

    /// 10 k tokens/s, linear; 1 GiB/s link (a block of 1 MiB: ~1 ms), no latency.
    fn costs() -> PlacementCosts {
        PlacementCosts {
            prefill: PrefillCurve { a: 0.0, b: 1e-4, c: 0.0 },
            link_bytes_per_s: (1u64 << 30) as f64,
            link_latency_s: 0.0,
        }
    }

    #[test]
    fn fetches_only_past_the_threshold_and_from_the_longest_holder() {
        let loads = [load(0, 0), load(1, 0), load(2, 0)];
        // Nothing cached anywhere: nothing to fetch.
        assert_eq!(fetch_for(&loads, &[0.0, 0.0, 0.0], 0, 2.0), None);
        // Instance 0 holds nothing, 2 holds 100 blocks (1 holds 40): fetch 0..100 from 2.
        assert_eq!(
            fetch_for(&loads, &[0.0, 40.0, 100.0], 0, 2.0),
            Some(PrefixFetch { from: InstanceId(2), first: 0, end: 100 })
        );
        // 100 / 40 = 2.5 > 2: 1 fetches 40..100; at θ = 3 it computes them itself.
        assert_eq!(
            fetch_for(&loads, &[0.0, 40.0, 100.0], 1, 2.0),
            Some(PrefixFetch { from: InstanceId(2), first: 40, end: 100 })
        );
        assert_eq!(fetch_for(&loads, &[0.0, 40.0, 100.0], 1, 3.0), None);
        // The holder itself fetches nothing; equal runs tie to the lowest id.
        assert_eq!(fetch_for(&loads, &[0.0, 40.0, 100.0], 2, 2.0), None);
        assert_eq!(fetch_for(&loads, &[100.0, 0.0, 100.0], 1, 2.0).map(|f| f.from), Some(InstanceId(0)));
        // A CPU-weighted run (0.75 per block) fetches whole blocks only.
        assert_eq!(fetch_for(&loads, &[0.0, 0.75, 0.0], 0, 2.0), None);
    }

    #[test]
    fn places_by_predicted_ttft_with_queue_fetch_and_prefill() {
        let mut p = CacheAware::default();
        let mut rng = SimRng::seed_from_u64(1);
        let r = request(8192); // 512 blocks: 0.82 s uncached
        p.set_costs(&costs());
        // The holder of the whole prompt is idle: it wins.
        let idle = [load(0, 0), load(1, 0), load(2, 0)];
        assert_eq!(p.place_with_overlap(&r, &idle, &[0.0, 0.0, 511.0], &mut rng), InstanceId(2));
        assert_eq!(p.prefix_fetch(&idle, &[0.0, 0.0, 511.0], InstanceId(2)), None);
        // The holder has 2 s of prefill queued: an idle instance fetching 511 blocks (~0.5 s) is
        // faster than computing there after the queue.
        let busy = [load(0, 0), load(1, 0), load(2, 20_000)];
        let to = p.place_with_overlap(&r, &busy, &[0.0, 0.0, 511.0], &mut rng);
        assert_eq!(to, InstanceId(0));
        assert_eq!(
            p.prefix_fetch(&busy, &[0.0, 0.0, 511.0], to),
            Some(PrefixFetch { from: InstanceId(2), first: 0, end: 511 })
        );
        // A slow link (1 MiB/s: 511 s to fetch) makes the queue the cheaper wait.
        p.set_costs(&PlacementCosts { link_bytes_per_s: (1u64 << 20) as f64, ..costs() });
        assert_eq!(p.place_with_overlap(&r, &busy, &[0.0, 0.0, 511.0], &mut rng), InstanceId(2));
        // No prefix anywhere: the shortest queue.
        p.set_costs(&costs());
        let queued = [load(0, 9000), load(1, 3000), load(2, 6000)];
        assert_eq!(p.place_with_overlap(&r, &queued, &[0.0, 0.0, 0.0], &mut rng), InstanceId(1));
        assert_eq!(p.prefix_index(), Some(PrefixIndexMode::Precise));
    }

    #[test]
    fn without_costs_it_places_as_kv_overlap_and_fetches_nothing() {
        let mut p = CacheAware::default();
        let mut o = KvOverlap::default();
        let mut rng = SimRng::seed_from_u64(1);
        let r = request(4096);
        let loads = [load(0, 0), load(1, 0)];
        let overlap = [0.0, 200.0];
        assert_eq!(
            p.place_with_overlap(&r, &loads, &overlap, &mut rng),
            o.place_with_overlap(&r, &loads, &overlap, &mut rng)
        );
        assert_eq!(p.prefix_fetch(&loads, &overlap, InstanceId(0)), None);
        assert!(p.needs_costs());
    }

    #[test]
    fn a_prefill_curve_sums_a_queue_as_its_prompts() {
        let curve = PrefillCurve { a: 1e-8, b: 1e-4, c: 0.01 };
        let mut q = PrefillQueue::default();
        for l in [100, 2000, 30_000] {
            q.add(l);
        }
        let each: f64 = [100.0, 2000.0, 30_000.0].iter().map(|&l| curve.eval(l)).sum();
        assert!((curve.queue(&q) - each).abs() < 1e-9, "{} vs {each}", curve.queue(&q));
    }
}
