//! Prefix-aware placement: send a request where its prompt's prefix is cached, unless that
//! instance is loaded enough to lose more than the cache saves.
//!
//! [`KvOverlap`] is Dynamo's KV router cost with its defaults (overlap weight 1, temperature 0):
//! for instance i, cost_i = w · (P − o_i) + d_i, where P is the request's prompt in blocks, o_i
//! the leading blocks predicted cached on i (the driver's prefix index), and d_i the blocks i
//! holds or has promised (GPU blocks in use plus those of waiting requests) plus the P − o_i
//! blocks the request would add. The cheapest instance wins; ties go to the lowest id. The
//! first term is the prefill it must compute, the second the memory and decode work there.

use super::{InstancePolicy, LoadReport, PrefixIndexMode};
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

    fn cost(&self, request: &RequestSpec, load: &LoadReport, overlap: f64) -> f64 {
        let prompt = load.blocks_for(request.prompt_tokens) as f64;
        let fresh = (prompt - overlap).max(0.0);
        let active = load.gpu_used_blocks as f64 + load.waiting_blocks as f64;
        self.weight * fresh + active + fresh
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
        let mut best: Option<(f64, InstanceId)> = None;
        for (k, load) in loads.iter().enumerate() {
            let cost = self.cost(request, load, overlap.get(k).copied().unwrap_or(0.0));
            let better = match best {
                None => true,
                Some((c, id)) => cost < c || (cost == c && load.instance < id),
            };
            if better {
                best = Some((cost, load.instance));
            }
        }
        best.map(|(_, id)| id).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
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
            ..LoadReport::default()
        }
    }

    fn request(prompt: u32) -> RequestSpec {
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
        assert_eq!(crate::policy::baselines::LeastKv.prefix_index(), None);
    }
}
