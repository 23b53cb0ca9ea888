//! Where a prompt's prefix is cached, as the controller predicts it from its own placements
//! (Dynamo's approximate KV router): a request placed on an instance leaves its prompt's blocks
//! cached there for [`APPROX_TTL`]. Decisions see the prediction at once, so simultaneous arrivals
//! sharing a prefix see where the first one went.
//!
//! The index is kept per content unit ([`TRACE_BLOCK_TOKENS`] tokens, one content id), not per
//! block: unit k of a prompt is keyed by the hash chain of its ids 0…k, and an instance's entry
//! says how many of the unit's blocks a placement there covered (a prompt that ends inside the
//! unit covers only part of it). A request's predicted hit on an instance is the blocks of its
//! leading units found there, stopping at the first unit missing or only partly covered, and
//! capped as the engine caps a hit (the last prompt token is always computed).

use kvfleet_core::kv::TRACE_BLOCK_TOKENS;
use kvfleet_core::{InstanceId, RequestSpec, TimeSpan, Timestamp};
use std::collections::HashMap;

/// How long a placement counts as cached on its instance (Dynamo's approximate mode: 120 s).
pub const APPROX_TTL: TimeSpan = TimeSpan(120_000_000_000);

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

/// Predicted prefix-cache contents of every instance.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    units: HashMap<u128, Vec<Entry>>,
    since_sweep: u32,
}

impl PrefixIndex {
    /// Whether `block_tokens` blocks can be indexed (they must tile a content unit).
    pub fn indexable(block_tokens: u32) -> bool {
        block_tokens > 0 && TRACE_BLOCK_TOKENS.is_multiple_of(block_tokens)
    }

    /// `spec` was placed on `instance` at `now`: its prompt's blocks count as cached there until
    /// `now + APPROX_TTL`.
    pub fn placed(&mut self, spec: &RequestSpec, instance: InstanceId, block_tokens: u32, now: Timestamp) {
        if spec.content_ids.is_empty() || !Self::indexable(block_tokens) {
            return;
        }
        let expires = now + APPROX_TTL;
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

    /// Leading prompt blocks of `spec` predicted cached on `instance` at `now`.
    pub fn overlap(&self, spec: &RequestSpec, instance: InstanceId, block_tokens: u32, now: Timestamp) -> u32 {
        if spec.content_ids.is_empty() || !Self::indexable(block_tokens) {
            return 0;
        }
        let per = TRACE_BLOCK_TOKENS / block_tokens;
        let mut hit = 0;
        for (key, want) in unit_keys(&spec.content_ids).zip(unit_blocks(spec, block_tokens)) {
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
        let mut ix = PrefixIndex::default();
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
        let mut ix = PrefixIndex::default();
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
