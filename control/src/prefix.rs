//! Where prompts' prefixes are cached, for prefix-aware placement ([`PrefixIndexMode`]):
//! - **precise**: the instances' [`KvEvent`]s (a block stored in or removed from a tier's cache),
//!   one set of (instance, tier) per block hash; a block only in an instance's CPU tier counts
//!   [`CPU_HIT_WEIGHT`] of one on its GPU (it must be copied up). Each placement also counts as
//!   cached on its instance for [`SPECULATIVE_TTL`] (llm-d), so simultaneous arrivals sharing a
//!   prefix see where the first one went before its events arrive.
//! - **approx** (Dynamo's approximate router): placements alone; a placement counts as cached on
//!   its instance for [`APPROX_TTL`].
//!
//! Placements are kept per content unit ([`TRACE_BLOCK_TOKENS`] tokens, one content id), not per
//! block: unit k of a prompt is keyed by the hash chain of its ids 0…k, and an instance's entry
//! says how many of the unit's blocks a placement there covered (a prompt that ends inside the
//! unit covers only part of it). A request's predicted hit on an instance is the blocks of its
//! leading units found there, stopping at the first unit missing or only partly covered, and
//! capped as the engine caps a hit (the last prompt token is always computed).

use kvfleet_core::kv::{prompt_block_hashes, tiles_content_unit, BlockHash, KvEvent, Tier, TRACE_BLOCK_TOKENS};
use kvfleet_core::policy::{LoadReport, PrefixIndexMode};
use kvfleet_core::{InstanceId, RequestSpec, TimeSpan, Timestamp};
use std::collections::HashMap;

/// How long a placement counts as cached on its instance (Dynamo's approximate mode: 120 s).
pub const APPROX_TTL: TimeSpan = TimeSpan(120_000_000_000);
/// How long a placement counts as cached before its KV events arrive (llm-d: 2 s).
pub const SPECULATIVE_TTL: TimeSpan = TimeSpan(2_000_000_000);
/// What a block found only in an instance's CPU tier is worth against one on its GPU.
pub const CPU_HIT_WEIGHT: f64 = 0.75;

/// Placements between two sweeps of expired entries.
const SWEEP_EVERY: u32 = 4096;

/// Hash chains of a prompt's content units: key k covers ids 0…k.
fn unit_keys(ids: &[u64]) -> impl Iterator<Item = u128> + '_ {
    ids.iter().scan(0u128, |prev, id| {
        let mut buf = [0u8; 24];
        buf[..16].copy_from_slice(&prev.to_le_bytes());
        buf[16..].copy_from_slice(&id.to_le_bytes());
        *prev = xxhash_rust::xxh3::xxh3_128(&buf);
        Some(*prev)
    })
}

/// Full blocks of `spec`'s prompt in each of its content units, in unit order.
fn unit_blocks(spec: &RequestSpec, block_tokens: u32) -> impl Iterator<Item = u32> + '_ {
    let per = TRACE_BLOCK_TOKENS / block_tokens.max(1);
    let covered = (spec.content_ids.len() as u64 * TRACE_BLOCK_TOKENS as u64).min(spec.prompt_tokens as u64);
    let full = (covered / block_tokens.max(1) as u64) as u32;
    (0..spec.content_ids.len() as u32).map(move |k| full.saturating_sub(k * per).min(per))
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    instance: InstanceId,
    /// Blocks of the unit a placement there covered (the most of any placement).
    blocks: u32,
    expires: Timestamp,
}

/// Placements as cached for a while, per content unit.
#[derive(Debug)]
struct Placements {
    ttl: TimeSpan,
    units: HashMap<u128, Vec<Entry>>,
    since_sweep: u32,
}

/// Where every instance has which prompt blocks cached; see the module doc.
#[derive(Debug)]
pub struct PrefixIndex {
    mode: PrefixIndexMode,
    placements: Placements,
    /// Precise mode: the (instance, tier) pairs caching each block hash.
    blocks: HashMap<BlockHash, Vec<(InstanceId, Tier)>>,
}

impl PrefixIndex {
    /// An empty index fed as `mode` says.
    pub fn new(mode: PrefixIndexMode) -> PrefixIndex {
        let ttl = match mode {
            PrefixIndexMode::Precise => SPECULATIVE_TTL,
            PrefixIndexMode::Approx => APPROX_TTL,
        };
        PrefixIndex {
            mode,
            placements: Placements { ttl, units: HashMap::new(), since_sweep: 0 },
            blocks: HashMap::new(),
        }
    }

    /// `spec` was placed on `instance` at `now`.
    pub fn placed(&mut self, spec: &RequestSpec, instance: InstanceId, block_tokens: u32, now: Timestamp) {
        self.placements.placed(spec, instance, block_tokens, now);
    }

    /// What `instance` reports its cache stored and removed (ignored in approx mode).
    pub fn apply(&mut self, instance: InstanceId, events: &[KvEvent]) {
        if self.mode != PrefixIndexMode::Precise {
            return;
        }
        for e in events {
            match *e {
                KvEvent::Stored { tier, hash } => {
                    let at = self.blocks.entry(hash).or_default();
                    if !at.contains(&(instance, tier)) {
                        at.push((instance, tier));
                    }
                }
                KvEvent::Removed { tier, hash } => {
                    if let Some(at) = self.blocks.get_mut(&hash) {
                        at.retain(|&x| x != (instance, tier));
                        if at.is_empty() {
                            self.blocks.remove(&hash);
                        }
                    }
                }
                KvEvent::AllCleared => self.apply_cleared(instance),
            }
        }
    }

    /// `instance` holds no cached block any more.
    fn apply_cleared(&mut self, instance: InstanceId) {
        self.blocks.retain(|_, at| {
            at.retain(|&(i, _)| i != instance);
            !at.is_empty()
        });
    }

    /// `instance` left or restarted: nothing is cached there any more.
    pub fn forget(&mut self, instance: InstanceId) {
        self.apply_cleared(instance);
        for entries in self.placements.units.values_mut() {
            entries.retain(|e| e.instance != instance);
        }
    }

    /// For each of `loads`' instances, the leading prompt blocks of `spec` cached there, a block
    /// only in the CPU tier weighted [`CPU_HIT_WEIGHT`], capped as the engine caps a hit.
    pub fn overlaps(&self, spec: &RequestSpec, loads: &[LoadReport], now: Timestamp) -> Vec<f64> {
        if spec.content_ids.is_empty() {
            return vec![0.0; loads.len()];
        }
        let keys: Vec<u128> = unit_keys(&spec.content_ids).collect();
        // Instances of one cluster share a block size; hash once per distinct one.
        let mut hashes: Option<(u32, Vec<BlockHash>)> = None;
        loads
            .iter()
            .map(|l| {
                let bt = l.block_tokens;
                if !tiles_content_unit(bt) {
                    return 0.0;
                }
                let cap = spec.prompt_tokens.saturating_sub(1) / bt;
                let placed = self.placements.overlap_keyed(spec, &keys, l.instance, bt, now) as f64;
                if self.mode != PrefixIndexMode::Precise {
                    return placed;
                }
                if hashes.as_ref().is_none_or(|(b, _)| *b != bt) {
                    hashes = Some((bt, prompt_block_hashes(&spec.content_ids, spec.prompt_tokens, bt)));
                }
                let hs = &hashes.as_ref().expect("set above").1;
                let mut held = 0.0;
                for h in hs.iter().take(cap as usize) {
                    let Some(at) = self.blocks.get(h) else { break };
                    if at.contains(&(l.instance, Tier::Gpu)) {
                        held += 1.0;
                    } else if at.contains(&(l.instance, Tier::Cpu)) {
                        held += CPU_HIT_WEIGHT;
                    } else {
                        break;
                    }
                }
                placed.max(held)
            })
            .collect()
    }
}

impl Placements {
    /// `spec`'s prompt blocks count as cached on `instance` until `now + ttl`.
    fn placed(&mut self, spec: &RequestSpec, instance: InstanceId, block_tokens: u32, now: Timestamp) {
        if spec.content_ids.is_empty() || !tiles_content_unit(block_tokens) {
            return;
        }
        let expires = now + self.ttl;
        for (key, blocks) in unit_keys(&spec.content_ids).zip(unit_blocks(spec, block_tokens)) {
            if blocks == 0 {
                break;
            }
            let entries = self.units.entry(key).or_default();
            match entries.iter_mut().find(|e| e.instance == instance) {
                Some(e) => {
                    // An expired entry says nothing about what is cached now.
                    e.blocks = if e.expires > now { e.blocks.max(blocks) } else { blocks };
                    e.expires = expires;
                }
                None => entries.push(Entry { instance, blocks, expires }),
            }
        }
        self.since_sweep += 1;
        if self.since_sweep >= SWEEP_EVERY {
            self.since_sweep = 0;
            self.units.retain(|_, entries| {
                entries.retain(|e| e.expires > now);
                !entries.is_empty()
            });
        }
    }

    /// Leading prompt blocks of `spec` placed on `instance` and not expired at `now`.
    #[cfg(test)]
    fn overlap(&self, spec: &RequestSpec, instance: InstanceId, block_tokens: u32, now: Timestamp) -> u32 {
        let keys: Vec<u128> = unit_keys(&spec.content_ids).collect();
        self.overlap_keyed(spec, &keys, instance, block_tokens, now)
    }

    /// Leading prompt blocks of `spec` (its unit keys `keys`, computed once for every instance
    /// asked) placed on `instance` and not expired at `now`.
    fn overlap_keyed(
        &self,
        spec: &RequestSpec,
        keys: &[u128],
        instance: InstanceId,
        block_tokens: u32,
        now: Timestamp,
    ) -> u32 {
        if spec.content_ids.is_empty() || !tiles_content_unit(block_tokens) {
            return 0;
        }
        let per = TRACE_BLOCK_TOKENS / block_tokens;
        let mut hit = 0;
        for (&key, want) in keys.iter().zip(unit_blocks(spec, block_tokens)) {
            let have = self
                .units
                .get(&key)
                .and_then(|entries| entries.iter().find(|e| e.instance == instance && e.expires > now))
                .map_or(0, |e| e.blocks);
            hit += have.min(want);
            if have < per || want < per {
                break;
            }
        }
        hit.min(spec.prompt_tokens.saturating_sub(1) / block_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_core::RequestId;

    fn approx() -> Placements {
        PrefixIndex::new(PrefixIndexMode::Approx).placements
    }

    fn load(instance: u32) -> LoadReport {
        LoadReport { instance: InstanceId(instance), block_tokens: 16, ..LoadReport::default() }
    }

    #[test]
    fn precise_mode_follows_kv_events_per_tier_and_forgets_a_departed_instance() {
        let mut ix = PrefixIndex::new(PrefixIndexMode::Precise);
        let r = spec(&[0, 1], 1024);
        let hs = prompt_block_hashes(&r.content_ids, 1024, 16);
        let stored = |tier, range: std::ops::Range<usize>| -> Vec<KvEvent> {
            hs[range].iter().map(|&hash| KvEvent::Stored { tier, hash }).collect()
        };
        ix.apply(InstanceId(0), &stored(Tier::Gpu, 0..40));
        ix.apply(InstanceId(1), &stored(Tier::Gpu, 0..10));
        ix.apply(InstanceId(1), &stored(Tier::Cpu, 10..64));
        let loads = [load(0), load(1), load(2)];
        let t = Timestamp::ZERO;
        // Instance 1: 10 on the GPU, then 53 in the CPU tier (capped at 63) at 0.75 each.
        assert_eq!(ix.overlaps(&r, &loads, t), vec![40.0, 10.0 + 53.0 * CPU_HIT_WEIGHT, 0.0]);
        // A gap ends the run: block 5 evicted from instance 0's GPU.
        ix.apply(InstanceId(0), &[KvEvent::Removed { tier: Tier::Gpu, hash: hs[5] }]);
        assert_eq!(ix.overlaps(&r, &loads, t)[0], 5.0);
        // A placement counts at once, for SPECULATIVE_TTL.
        ix.placed(&r, InstanceId(2), 16, t);
        assert_eq!(ix.overlaps(&r, &loads, t)[2], 63.0);
        assert_eq!(ix.overlaps(&r, &loads, t + SPECULATIVE_TTL)[2], 0.0);
        ix.forget(InstanceId(1));
        assert_eq!(ix.overlaps(&r, &loads, t), vec![5.0, 0.0, 63.0]);
        // A worker that (re)started says its cache is empty: its blocks go, its placement stays
        // (made after the restart), the others' blocks stay; its later events count again.
        ix.apply(InstanceId(2), &stored(Tier::Gpu, 0..3));
        ix.apply(InstanceId(0), &[KvEvent::AllCleared]);
        assert_eq!(ix.overlaps(&r, &loads, t), vec![0.0, 0.0, 63.0]);
        ix.apply(InstanceId(0), &stored(Tier::Gpu, 0..2));
        assert_eq!(ix.overlaps(&r, &loads, t + SPECULATIVE_TTL), vec![2.0, 0.0, 3.0]);
        // Approx mode ignores events.
        let mut approx = PrefixIndex::new(PrefixIndexMode::Approx);
        approx.apply(InstanceId(0), &stored(Tier::Gpu, 0..40));
        assert_eq!(approx.overlaps(&r, &loads, t), vec![0.0; 3]);
    }

    fn spec(ids: &[u64], prompt: u32) -> RequestSpec {
        RequestSpec {
            id: RequestId(1),
            arrival: Timestamp::ZERO,
            prompt_tokens: prompt,
            reasoning_tokens: 0,
            answer_tokens: 1,
            content_ids: ids.to_vec(),
        }
    }

    #[test]
    fn a_placement_predicts_the_shared_leading_blocks_on_its_instance_only() {
        let mut ix = approx();
        let (a, b) = (InstanceId(0), InstanceId(1));
        let t = Timestamp::ZERO;
        ix.placed(&spec(&[0, 1, 2], 1536), a, 16, t);
        assert_eq!(ix.overlap(&spec(&[0, 1, 3], 1536), a, 16, t), 64, "two shared units");
        assert_eq!(ix.overlap(&spec(&[0, 1, 3], 1536), b, 16, t), 0, "nothing placed there");
        assert_eq!(ix.overlap(&spec(&[0, 1, 2], 1536), a, 16, t), 95, "the last token is computed");
        assert_eq!(ix.overlap(&spec(&[9, 1, 2], 1536), a, 16, t), 0, "a chain: a different head shares nothing");
        // A short placement covers only part of its last unit: 700 tokens = 43 full blocks.
        ix.placed(&spec(&[5, 6], 700), b, 16, t);
        assert_eq!(ix.overlap(&spec(&[5, 6], 1024), b, 16, t), 43);
        assert_eq!(ix.overlap(&spec(&[5], 300), b, 16, t), 18, "bounded by the new prompt: ⌊299 / 16⌋");
        // Entries expire.
        let later = t + APPROX_TTL;
        assert_eq!(ix.overlap(&spec(&[0, 1, 3], 1536), a, 16, later), 0);
        assert_eq!(ix.overlap(&spec(&[], 1536), a, 16, t), 0);
        assert_eq!(ix.overlap(&spec(&[0, 1, 3], 1536), a, 48, t), 0, "48-token blocks do not tile a unit");
    }

    #[test]
    fn expired_entries_are_swept_and_do_not_count_after_a_new_placement() {
        let mut ix = approx();
        let a = InstanceId(0);
        ix.placed(&spec(&[0, 1], 1024), a, 16, Timestamp::ZERO);
        let later = Timestamp::ZERO + APPROX_TTL + TimeSpan(1);
        ix.placed(&spec(&[0], 100), a, 16, later);
        assert_eq!(ix.overlap(&spec(&[0, 1], 1024), a, 16, later), 6, "only the new, short placement: 100 tokens");
        for k in 0..SWEEP_EVERY {
            ix.placed(&spec(&[1_000 + k as u64], 600), a, 16, later + APPROX_TTL + TimeSpan(1));
        }
        assert!(ix.units.len() <= SWEEP_EVERY as usize + 1, "old entries swept: {}", ix.units.len());
    }
}
