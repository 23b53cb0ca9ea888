//! The paged KV block manager: a GPU pool and a CPU (offload) pool of fixed-size blocks, and a
//! block table per request (vLLM's PagedAttention bookkeeping).
//!
//! Block ids are real indices (block `b` of a pool lives at offset `b × block_bytes` of that
//! pool's arena in the worker), so later layers can address, checksum and migrate them.
//!
//! Invariants (property-tested below and checked by [`KvBlockManager::check_invariants`]):
//! - every block of a pool is either free or owned by exactly one request's table;
//! - free + used = capacity, per pool, after every operation;
//! - a request's blocks all live on one tier, and it holds exactly `ceil(tokens / block_size)`.

use crate::idmap::IdMap;
use crate::ids::RequestId;
use serde::{Deserialize, Serialize};

/// Where a request's KV lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Tier {
    /// GPU memory: where a request's KV must be for it to run.
    Gpu,
    /// The host-memory offload pool holding preempted requests' KV.
    Cpu,
}

/// Why a KV block operation was refused (nothing changed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// The pool has too few free blocks.
    #[error("{tier:?} pool exhausted: need {needed} blocks, {free} free")]
    OutOfBlocks {
        /// The pool asked.
        tier: Tier,
        /// Blocks the operation needed.
        needed: u32,
        /// Blocks free in that pool.
        free: u32,
    },
    /// The request holds no blocks here.
    #[error("{0} has no KV blocks")]
    UnknownRequest(RequestId),
    /// The request already has a block table; allocate once, then grow.
    #[error("{0} already holds KV blocks")]
    AlreadyAllocated(RequestId),
    /// A tier move found the request on the tier it was to be moved to.
    #[error("{request} is on {actual:?}, expected {expected:?}")]
    WrongTier {
        /// The request.
        request: RequestId,
        /// Tier the move starts from.
        expected: Tier,
        /// Tier its blocks are on.
        actual: Tier,
    },
    /// `grow` was asked for fewer tokens than the request holds.
    #[error("{request} cannot shrink from {have} to {want} tokens")]
    Shrink {
        /// The request.
        request: RequestId,
        /// Tokens it holds.
        have: u32,
        /// Tokens asked for.
        want: u32,
    },
}

/// One request's KV: its tier, its blocks in token order, and how many tokens they hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockTable {
    /// The pool all its blocks are in.
    pub tier: Tier,
    /// Block ids in that pool, in token order.
    pub blocks: Vec<u32>,
    /// Tokens of KV held (the last block may be partly filled).
    pub tokens: u32,
}

#[derive(Clone, Debug)]
struct Pool {
    capacity: u32,
    /// Free block ids, used as a stack (LIFO reuse keeps the working set small).
    free: Vec<u32>,
}

impl Pool {
    fn new(capacity: u32) -> Self {
        // Reverse so that the first allocations get blocks 0, 1, 2, ...
        Pool { capacity, free: (0..capacity).rev().collect() }
    }
    fn take(&mut self, n: u32, tier: Tier, out: &mut Vec<u32>) -> Result<(), KvError> {
        let free = self.free.len() as u32;
        if n > free {
            return Err(KvError::OutOfBlocks { tier, needed: n, free });
        }
        let at = self.free.len() - n as usize;
        out.extend(self.free.drain(at..).rev());
        Ok(())
    }
    fn give_back(&mut self, blocks: &[u32]) {
        self.free.extend_from_slice(blocks);
    }
    fn used(&self) -> u32 {
        self.capacity - self.free.len() as u32
    }
}

/// A whole-request move between tiers, recorded when journaling is on: the worker replays it on
/// its real arenas (copy block `from[i]` of the `from_tier` arena to block `to[i]` of `to_tier`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvMove {
    /// The request whose KV moved.
    pub request: RequestId,
    /// Tier the blocks were copied from.
    pub from_tier: Tier,
    /// Tier the blocks were copied to.
    pub to_tier: Tier,
    /// Source block ids, in token order.
    pub from: Vec<u32>,
    /// Destination block ids; `to[i]` receives `from[i]`.
    pub to: Vec<u32>,
}

/// Paged KV accounting for one instance.
#[derive(Clone, Debug)]
pub struct KvBlockManager {
    block_size: u32,
    gpu: Pool,
    cpu: Pool,
    tables: IdMap<RequestId, BlockTable>,
    /// Moves since the last `drain_moves`, when enabled (the simulator leaves it off).
    journal: Option<Vec<KvMove>>,
}

/// Blocks needed to hold `tokens` tokens in blocks of `block_size` tokens (0 when `block_size`
/// is 0: an instance that did not say its block size). The one place this arithmetic lives: the
/// engine allocates by it and the cluster controller charges placements by it.
pub fn blocks_for_tokens(tokens: u32, block_size: u32) -> u32 {
    if block_size == 0 {
        return 0;
    }
    tokens.div_ceil(block_size)
}

impl KvBlockManager {
    /// `block_size` tokens per block (vLLM default 16); pool capacities in blocks.
    pub fn new(block_size: u32, gpu_blocks: u32, cpu_blocks: u32) -> Self {
        assert!(block_size > 0, "block_size must be > 0");
        KvBlockManager {
            block_size,
            gpu: Pool::new(gpu_blocks),
            cpu: Pool::new(cpu_blocks),
            tables: IdMap::default(),
            journal: None,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }
    /// Record every tier move from now on (see [`KvMove`]).
    pub fn enable_journal(&mut self) {
        self.journal.get_or_insert_with(Vec::new);
    }
    /// Moves recorded since the last call (empty when journaling is off).
    pub fn drain_moves(&mut self) -> Vec<KvMove> {
        self.journal.as_mut().map(std::mem::take).unwrap_or_default()
    }
    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: u32) -> u32 {
        blocks_for_tokens(tokens, self.block_size)
    }
    /// Blocks in the `tier` pool.
    pub fn capacity(&self, tier: Tier) -> u32 {
        self.pool(tier).capacity
    }
    /// Blocks of the `tier` pool held by requests.
    pub fn used(&self, tier: Tier) -> u32 {
        self.pool(tier).used()
    }
    /// Free blocks in the `tier` pool.
    pub fn free(&self, tier: Tier) -> u32 {
        self.pool(tier).free.len() as u32
    }
    /// The request's block table; `None` when it holds no blocks.
    pub fn table(&self, request: RequestId) -> Option<&BlockTable> {
        self.tables.get(&request)
    }
    /// The tier the request's KV is on; `None` when it holds no blocks.
    pub fn tier_of(&self, request: RequestId) -> Option<Tier> {
        self.tables.get(&request).map(|t| t.tier)
    }
    /// Number of requests holding blocks.
    pub fn requests(&self) -> usize {
        self.tables.len()
    }

    fn pool(&self, tier: Tier) -> &Pool {
        match tier {
            Tier::Gpu => &self.gpu,
            Tier::Cpu => &self.cpu,
        }
    }
    fn pool_mut(&mut self, tier: Tier) -> &mut Pool {
        match tier {
            Tier::Gpu => &mut self.gpu,
            Tier::Cpu => &mut self.cpu,
        }
    }

    /// Give `request` blocks for `tokens` tokens on `tier`. All-or-nothing.
    pub fn allocate(&mut self, request: RequestId, tier: Tier, tokens: u32) -> Result<(), KvError> {
        if self.tables.contains_key(&request) {
            return Err(KvError::AlreadyAllocated(request));
        }
        let n = self.blocks_for(tokens);
        let mut blocks = Vec::with_capacity(n as usize);
        self.pool_mut(tier).take(n, tier, &mut blocks)?;
        self.tables.insert(request, BlockTable { tier, blocks, tokens });
        Ok(())
    }

    /// Extend `request` to hold `tokens` tokens on its current tier; returns blocks added.
    pub fn grow(&mut self, request: RequestId, tokens: u32) -> Result<u32, KvError> {
        let block_size = self.block_size;
        let table = self.tables.get_mut(&request).ok_or(KvError::UnknownRequest(request))?;
        if tokens < table.tokens {
            return Err(KvError::Shrink { request, have: table.tokens, want: tokens });
        }
        let have = table.blocks.len() as u32;
        let need = tokens.div_ceil(block_size).saturating_sub(have);
        if need > 0 {
            let pool = match table.tier {
                Tier::Gpu => &mut self.gpu,
                Tier::Cpu => &mut self.cpu,
            };
            pool.take(need, table.tier, &mut table.blocks)?;
        }
        table.tokens = tokens;
        Ok(need)
    }

    /// Make `request` hold exactly `tokens` tokens on its tier, taking or giving back blocks (a
    /// migration target's reservation fitted to what finally arrived). All-or-nothing.
    pub fn resize(&mut self, request: RequestId, tokens: u32) -> Result<(), KvError> {
        let need = self.blocks_for(tokens) as usize;
        let table = self.tables.get_mut(&request).ok_or(KvError::UnknownRequest(request))?;
        let tier = table.tier;
        let pool = match tier {
            Tier::Gpu => &mut self.gpu,
            Tier::Cpu => &mut self.cpu,
        };
        if need > table.blocks.len() {
            pool.take((need - table.blocks.len()) as u32, tier, &mut table.blocks)?;
        } else {
            let surplus = table.blocks.split_off(need);
            pool.give_back(&surplus);
        }
        table.tokens = tokens;
        Ok(())
    }

    /// Move all of `request`'s blocks to the other tier (offload GPU→CPU or reload CPU→GPU).
    /// All-or-nothing; returns the number of blocks moved.
    pub fn move_to(&mut self, request: RequestId, to: Tier) -> Result<u32, KvError> {
        let from = self.tier_of(request).ok_or(KvError::UnknownRequest(request))?;
        let expected = match to {
            Tier::Gpu => Tier::Cpu,
            Tier::Cpu => Tier::Gpu,
        };
        if from != expected {
            return Err(KvError::WrongTier { request, expected, actual: from });
        }
        let n = self.tables[&request].blocks.len() as u32;
        let mut fresh = Vec::with_capacity(n as usize);
        self.pool_mut(to).take(n, to, &mut fresh)?;
        let table = self.tables.get_mut(&request).expect("checked above");
        let old = std::mem::replace(&mut table.blocks, fresh);
        table.tier = to;
        if let Some(journal) = self.journal.as_mut() {
            journal.push(KvMove { request, from_tier: from, to_tier: to, from: old.clone(), to: table.blocks.clone() });
        }
        self.pool_mut(from).give_back(&old);
        Ok(n)
    }

    /// Release all of `request`'s blocks; returns how many were freed (0 if it held none).
    pub fn free_request(&mut self, request: RequestId) -> u32 {
        match self.tables.remove(&request) {
            Some(t) => {
                let n = t.blocks.len() as u32;
                self.pool_mut(t.tier).give_back(&t.blocks);
                n
            }
            None => 0,
        }
    }

    /// Verify the accounting invariants; returns a description of the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        for (tier, pool) in [(Tier::Gpu, &self.gpu), (Tier::Cpu, &self.cpu)] {
            let mut owner: Vec<Option<Option<RequestId>>> = vec![None; pool.capacity as usize];
            for &b in &pool.free {
                let slot = owner.get_mut(b as usize).ok_or(format!("{tier:?} free block {b} out of range"))?;
                if slot.is_some() {
                    return Err(format!("{tier:?} block {b} is free twice"));
                }
                *slot = Some(None);
            }
            for (id, t) in self.tables.iter().filter(|(_, t)| t.tier == tier) {
                if t.blocks.len() as u32 != self.blocks_for(t.tokens) {
                    return Err(format!("{id} holds {} blocks for {} tokens", t.blocks.len(), t.tokens));
                }
                for &b in &t.blocks {
                    let slot = owner.get_mut(b as usize).ok_or(format!("{tier:?} block {b} out of range"))?;
                    if let Some(prev) = slot {
                        return Err(format!("{tier:?} block {b} owned by {id} and {prev:?}"));
                    }
                    *slot = Some(Some(*id));
                }
            }
            if let Some(b) = owner.iter().position(|o| o.is_none()) {
                return Err(format!("{tier:?} block {b} leaked (neither free nor owned)"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn allocate_grow_move_free() {
        let mut kv = KvBlockManager::new(16, 4, 4);
        let a = RequestId(1);
        kv.allocate(a, Tier::Gpu, 17).unwrap();
        assert_eq!(kv.used(Tier::Gpu), 2);
        assert_eq!(kv.grow(a, 32).unwrap(), 0);
        assert_eq!(kv.grow(a, 33).unwrap(), 1);
        assert_eq!(kv.move_to(a, Tier::Cpu).unwrap(), 3);
        assert_eq!((kv.used(Tier::Gpu), kv.used(Tier::Cpu)), (0, 3));
        assert!(matches!(kv.move_to(a, Tier::Cpu), Err(KvError::WrongTier { .. })));
        assert_eq!(kv.free_request(a), 3);
        assert_eq!(kv.free(Tier::Cpu), 4);
        kv.check_invariants().unwrap();
    }

    #[test]
    fn over_capacity_is_refused_without_side_effects() {
        let mut kv = KvBlockManager::new(16, 2, 1);
        kv.allocate(RequestId(1), Tier::Gpu, 32).unwrap();
        assert_eq!(
            kv.allocate(RequestId(2), Tier::Gpu, 1),
            Err(KvError::OutOfBlocks { tier: Tier::Gpu, needed: 1, free: 0 })
        );
        assert!(kv.move_to(RequestId(1), Tier::Cpu).is_err(), "CPU pool has 1 block, request holds 2");
        assert_eq!(kv.tier_of(RequestId(1)), Some(Tier::Gpu));
        assert!(kv.grow(RequestId(1), 33).is_err());
        assert_eq!(kv.table(RequestId(1)).unwrap().tokens, 32, "failed grow leaves the table unchanged");
        kv.check_invariants().unwrap();
    }

    #[test]
    fn journal_records_moves_with_block_ids() {
        let mut kv = KvBlockManager::new(16, 4, 4);
        kv.allocate(RequestId(1), Tier::Gpu, 20).unwrap();
        kv.move_to(RequestId(1), Tier::Cpu).unwrap();
        assert!(kv.drain_moves().is_empty(), "journal off by default");
        kv.enable_journal();
        kv.move_to(RequestId(1), Tier::Gpu).unwrap();
        let moves = kv.drain_moves();
        assert_eq!(moves.len(), 1);
        assert_eq!((moves[0].from_tier, moves[0].to_tier), (Tier::Cpu, Tier::Gpu));
        assert_eq!(moves[0].to, kv.table(RequestId(1)).unwrap().blocks);
        assert_eq!(moves[0].from.len(), 2);
        assert!(kv.drain_moves().is_empty());
    }

    #[derive(Clone, Debug)]
    enum Op {
        Alloc(u8, bool, u16),
        Grow(u8, u16),
        Move(u8),
        Free(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..8, any::<bool>(), 0u16..120).prop_map(|(r, g, t)| Op::Alloc(r, g, t)),
            (0u8..8, 0u16..200).prop_map(|(r, t)| Op::Grow(r, t)),
            (0u8..8).prop_map(Op::Move),
            (0u8..8).prop_map(Op::Free),
        ]
    }

    proptest! {
        /// No leak, no double ownership, never over capacity, whatever the sequence of operations
        /// (including ones that must fail).
        #[test]
        fn accounting_invariants_hold(ops in proptest::collection::vec(op(), 1..200)) {
            let mut kv = KvBlockManager::new(16, 20, 12);
            for op in ops {
                let _ = match op {
                    Op::Alloc(r, g, t) => kv.allocate(RequestId(r as u64), if g { Tier::Gpu } else { Tier::Cpu }, t as u32).map(|_| 0),
                    Op::Grow(r, t) => kv.grow(RequestId(r as u64), t as u32),
                    Op::Move(r) => {
                        let to = match kv.tier_of(RequestId(r as u64)) { Some(Tier::Gpu) => Tier::Cpu, _ => Tier::Gpu };
                        kv.move_to(RequestId(r as u64), to)
                    }
                    Op::Free(r) => Ok(kv.free_request(RequestId(r as u64))),
                };
                prop_assert!(kv.used(Tier::Gpu) <= kv.capacity(Tier::Gpu));
                prop_assert!(kv.used(Tier::Cpu) <= kv.capacity(Tier::Cpu));
                if let Err(e) = kv.check_invariants() { prop_assert!(false, "{}", e); }
            }
        }
    }
}
