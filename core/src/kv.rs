//! The paged KV block manager: a GPU pool and a CPU (offload) pool of fixed-size blocks, and a
//! block table per request (vLLM's PagedAttention bookkeeping).
//!
//! Block ids are real indices (block `b` of a pool lives at offset `b × block_bytes` of that
//! pool's arena in the worker), so later layers can address, checksum and migrate them.
//!
//! **Prefix caching** (vLLM's automatic prefix caching): a full GPU block of a prompt whose content
//! is known ([`prompt_block_hashes`]) is registered under its hash chain when it is allocated; a
//! later prompt with the same leading hashes takes those blocks instead of new ones (a hit) and
//! prefills only the rest. A hashed block is reference-counted; when its last holder lets go it
//! stays cached in an LRU of free cached blocks, which allocations take from only after the
//! uncached free blocks (evicting the LRU head); a finished request's blocks join the LRU tail last
//! block first, so a prompt's head outlives its tail. Blocks without a known content (generated
//! tokens, the partial last prompt block, everything on the CPU tier) stay private, exactly as
//! without the cache: a workload without content ids runs byte-identically.
//!
//! Invariants (property-tested below and checked by [`KvBlockManager::check_invariants`]):
//! - every block of a pool is free, free-cached (in the LRU, hashed, no holder) or referenced: a
//!   private block by exactly one table, a hashed block by as many tables as its reference count;
//! - free + free-cached + referenced = capacity, per pool, after every operation;
//! - one cached block per hash;
//! - a request's blocks all live on one tier, and it holds exactly `ceil(tokens / block_size)`.

use crate::idmap::IdMap;
use crate::ids::RequestId;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};

/// Tokens one content id of a trace stands for (Mooncake's `hash_ids`: one id per 512 prompt
/// tokens). A block size must divide it for content to be hashed.
pub const TRACE_BLOCK_TOKENS: u32 = 512;

/// The content hash of one full KV block: chained over every block before it in the prompt.
pub type BlockHash = u128;

/// Whether blocks of `block_size` tokens tile a content id's [`TRACE_BLOCK_TOKENS`] (only then can
/// prompt blocks be hashed, cached and indexed).
pub fn tiles_content_unit(block_size: u32) -> bool {
    block_size > 0 && TRACE_BLOCK_TOKENS.is_multiple_of(block_size)
}

/// Hash chain of a prompt's full blocks: h_j = xxh3-128(h_{j−1} ‖ id ‖ slot), h_{−1} = 0, seed 0,
/// where block j (tokens `block_size·j …`) has the content key (`ids[⌊j / per⌋]`, `j mod per`)
/// with `per = TRACE_BLOCK_TOKENS / block_size`. Only full blocks that the ids cover hash (tokens
/// past the ids are unique to the request); empty when there are no ids or `block_size` does not
/// divide [`TRACE_BLOCK_TOKENS`].
pub fn prompt_block_hashes(ids: &[u64], prompt_tokens: u32, block_size: u32) -> Vec<BlockHash> {
    if ids.is_empty() || !tiles_content_unit(block_size) {
        return Vec::new();
    }
    let per = TRACE_BLOCK_TOKENS / block_size;
    let covered = (ids.len() as u64 * TRACE_BLOCK_TOKENS as u64).min(prompt_tokens as u64);
    let full = (covered / block_size as u64) as u32;
    let mut out = Vec::with_capacity(full as usize);
    let mut prev: BlockHash = 0;
    let mut buf = [0u8; 28];
    for j in 0..full {
        buf[..16].copy_from_slice(&prev.to_le_bytes());
        buf[16..24].copy_from_slice(&ids[(j / per) as usize].to_le_bytes());
        buf[24..].copy_from_slice(&(j % per).to_le_bytes());
        prev = xxhash_rust::xxh3::xxh3_128(&buf);
        out.push(prev);
    }
    out
}

/// Prefix-cache counters over an instance's lifetime (vLLM's `prefix_cache_queries` / `_hits`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixStats {
    /// Prompt tokens looked up (every prefill of a request with content ids).
    pub query_tokens: u64,
    /// Of those, tokens found cached (not prefilled).
    pub hit_tokens: u64,
    /// Of those, tokens found only in the CPU tier (reloaded to the GPU, not computed).
    #[serde(default)]
    pub cpu_hit_tokens: u64,
    /// Cached GPU blocks evicted to make room.
    pub evictions: u64,
    /// Evicted GPU blocks whose content was kept in the CPU tier.
    #[serde(default)]
    pub demotions: u64,
    /// Cached CPU blocks evicted to make room.
    #[serde(default)]
    pub cpu_evictions: u64,
}

/// A change to what an instance has cached (vLLM's KV events `BlockStored` / `BlockRemoved`):
/// what a controller's precise prefix index follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvEvent {
    /// A block with this content hash is now cached in `tier`.
    Stored {
        /// The tier.
        tier: Tier,
        /// The block's content hash.
        hash: BlockHash,
    },
    /// The block with this content hash left `tier`'s cache (evicted).
    Removed {
        /// The tier.
        tier: Tier,
        /// The block's content hash.
        hash: BlockHash,
    },
    /// Everything the instance had cached is gone (vLLM's `AllBlocksCleared`): a worker process
    /// that (re)started says so first. The block manager itself never emits it.
    AllCleared,
}

/// What a prefixed allocation found cached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixHit {
    /// Leading prompt blocks found cached, in either tier (not computed).
    pub blocks: u32,
    /// Of those, blocks found only in the CPU tier: copied to the GPU (a reload).
    pub from_cpu: u32,
}

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

/// The GPU pool's cached blocks (created on the first hashed allocation).
#[derive(Clone, Debug, Default)]
struct PrefixCache {
    by_hash: HashMap<BlockHash, u32>,
    hash_of: HashMap<u32, BlockHash>,
    /// Tables holding each hashed block (absent: none, the block is in the LRU).
    refs: HashMap<u32, u32>,
    /// Free cached blocks, oldest first (key: insertion sequence).
    lru: BTreeMap<u64, u32>,
    lru_key: HashMap<u32, u64>,
    seq: u64,
    /// Hashed blocks whose content is computed (a holder's prefill finished, or they were
    /// fetched): what a prefix fetch can copy. A block is registered at allocation, before that.
    computed: HashSet<u32>,
}

impl PrefixCache {
    fn push_lru(&mut self, block: u32) {
        self.seq += 1;
        self.lru.insert(self.seq, block);
        self.lru_key.insert(block, self.seq);
    }
    /// A free cached block was used: it becomes the youngest.
    fn touch(&mut self, block: u32) {
        if self.lru_key.contains_key(&block) {
            self.unlink(block);
            self.push_lru(block);
        }
    }
    fn unlink(&mut self, block: u32) {
        if let Some(k) = self.lru_key.remove(&block) {
            self.lru.remove(&k);
        }
    }
    /// Take the oldest free cached block, forgetting it: (block, its hash).
    fn evict(&mut self) -> Option<(u32, BlockHash)> {
        let (_, block) = self.lru.pop_first()?;
        self.lru_key.remove(&block);
        let hash = self.hash_of.remove(&block).expect("a block in the LRU is hashed");
        self.by_hash.remove(&hash);
        self.computed.remove(&block);
        Some((block, hash))
    }
    /// One holder of `block` let go: `true` when it was a hashed block (now counted down, and
    /// in the LRU when nobody holds it), `false` for a private block.
    fn release(&mut self, block: u32) -> bool {
        match self.refs.get_mut(&block) {
            Some(n) => {
                *n -= 1;
                if *n == 0 {
                    self.refs.remove(&block);
                    self.push_lru(block);
                }
                true
            }
            None => {
                debug_assert!(!self.hash_of.contains_key(&block), "cached block {block} released with no holder");
                false
            }
        }
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
    /// Prefix cache of the GPU pool; `None` until a prompt with content is allocated.
    cache: Option<Box<PrefixCache>>,
    /// Prefix cache of the CPU pool: evicted GPU blocks kept while it has room (never held by a
    /// table; a hit copies the block to the GPU).
    cpu_cache: Option<Box<PrefixCache>>,
    prefix_stats: PrefixStats,
    /// Cache changes since the last `drain_events`, when enabled.
    events: Option<Vec<KvEvent>>,
    /// Blocks lent out ([`KvBlockManager::lend`]), by tier and block.
    lent: HashMap<(Tier, u32), Loan>,
}

/// One lent block: how many loans are out, and what its holders did meanwhile.
#[derive(Clone, Copy, Debug)]
struct Loan {
    count: u32,
    /// A cached GPU block: each loan counts as one more holder of it.
    hashed: bool,
    /// A private block whose table let go of it while lent: it is free once the last loan returns.
    released: bool,
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
            cache: None,
            cpu_cache: None,
            events: None,
            prefix_stats: PrefixStats::default(),
            lent: HashMap::new(),
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
    /// Blocks of the `tier` pool held by requests (free cached blocks are not).
    pub fn used(&self, tier: Tier) -> u32 {
        self.pool(tier).used() - self.cached_free(tier)
    }
    /// Blocks of the `tier` pool an allocation can take: free ones and free cached ones.
    pub fn free(&self, tier: Tier) -> u32 {
        self.pool(tier).free.len() as u32 + self.cached_free(tier)
    }
    /// Free cached blocks of the `tier` pool (kept for a later hit until evicted).
    pub fn cached_free(&self, tier: Tier) -> u32 {
        self.cache_of(tier).map_or(0, |c| c.lru.len() as u32)
    }
    /// Blocks of the `tier` pool registered under a content hash (held or free).
    pub fn cached_blocks(&self, tier: Tier) -> u32 {
        self.cache_of(tier).map_or(0, |c| c.by_hash.len() as u32)
    }
    fn cache_of(&self, tier: Tier) -> Option<&PrefixCache> {
        match tier {
            Tier::Gpu => self.cache.as_deref(),
            Tier::Cpu => self.cpu_cache.as_deref(),
        }
    }
    fn cache_mut(&mut self, tier: Tier) -> Option<&mut PrefixCache> {
        match tier {
            Tier::Gpu => self.cache.as_deref_mut(),
            Tier::Cpu => self.cpu_cache.as_deref_mut(),
        }
    }
    /// Record every change to the prefix caches from now on ([`KvEvent`]).
    pub fn enable_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }
    /// Cache changes since the last call, appended to `out` (none when events are off).
    pub fn drain_events(&mut self, out: &mut Vec<KvEvent>) {
        if let Some(events) = self.events.as_mut() {
            out.append(events);
        }
    }
    fn event(&mut self, event: KvEvent) {
        if let Some(events) = self.events.as_mut() {
            events.push(event);
        }
    }
    /// Prefix-cache counters so far.
    pub fn prefix_stats(&self) -> PrefixStats {
        self.prefix_stats
    }
    /// The GPU blocks holding `hashes`' leading cached blocks, in order (a lookup; nothing taken).
    pub fn prefix_hit_blocks<'a>(&'a self, hashes: &'a [BlockHash]) -> impl Iterator<Item = u32> + 'a {
        let cache = self.cache.as_deref();
        hashes.iter().map_while(move |h| cache.and_then(|c| c.by_hash.get(h).copied()))
    }
    /// Whether GPU block `block` is cached under a content hash (shareable).
    pub fn is_cached_block(&self, block: u32) -> bool {
        self.cache.as_ref().is_some_and(|c| c.hash_of.contains_key(&block))
    }
    /// Whether cached GPU block `block` is held by a table (not in the LRU of free cached blocks).
    pub fn is_held(&self, block: u32) -> bool {
        self.cache.as_ref().is_some_and(|c| c.refs.contains_key(&block))
    }
    /// How many of `hashes`' leading blocks are cached now, on the GPU or in the CPU tier (a
    /// lookup; nothing taken).
    pub fn prefix_hits(&self, hashes: &[BlockHash]) -> u32 {
        let (gpu, cpu) = (self.cache.as_deref(), self.cpu_cache.as_deref());
        let cached = |c: Option<&PrefixCache>, h| c.is_some_and(|c| c.by_hash.contains_key(h));
        hashes.iter().take_while(|h| cached(gpu, h) || cached(cpu, h)).count() as u32
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

    /// Take `n` blocks of `tier` into `out`: free ones first (LIFO), then free cached ones, oldest
    /// first (their hashes forgotten). All-or-nothing.
    fn take(&mut self, tier: Tier, n: u32, out: &mut Vec<u32>) -> Result<(), KvError> {
        let plain = self.pool(tier).free.len() as u32;
        let cached = self.cached_free(tier);
        if n > plain + cached {
            return Err(KvError::OutOfBlocks { tier, needed: n, free: plain + cached });
        }
        self.pool_mut(tier).take(n.min(plain), tier, out)?;
        if n > plain {
            let cache = self.cache_mut(tier).expect("cached blocks counted above");
            let mut evicted = Vec::with_capacity((n - plain) as usize);
            for _ in plain..n {
                let (block, hash) = cache.evict().expect("cached blocks counted above");
                out.push(block);
                evicted.push(hash);
            }
            match tier {
                Tier::Gpu => self.prefix_stats.evictions += evicted.len() as u64,
                Tier::Cpu => self.prefix_stats.cpu_evictions += evicted.len() as u64,
            }
            for hash in evicted {
                self.event(KvEvent::Removed { tier, hash });
                if tier == Tier::Gpu {
                    self.demote(hash);
                }
            }
        }
        Ok(())
    }

    /// Keep the content of an evicted GPU block in the CPU tier while it has room (a free block,
    /// or its oldest free cached one).
    fn demote(&mut self, hash: BlockHash) {
        if self.cpu.capacity == 0 {
            return;
        }
        let cpu = self.cpu_cache.get_or_insert_with(Box::default);
        if let Some(&b) = cpu.by_hash.get(&hash) {
            cpu.touch(b);
            return;
        }
        let (block, pushed_out) = match self.cpu.free.pop() {
            Some(b) => (b, None),
            None => match cpu.evict() {
                Some((b, old)) => {
                    self.prefix_stats.cpu_evictions += 1;
                    (b, Some(old))
                }
                None => return,
            },
        };
        cpu.by_hash.insert(hash, block);
        cpu.hash_of.insert(block, hash);
        cpu.push_lru(block);
        self.prefix_stats.demotions += 1;
        if let Some(old) = pushed_out {
            self.event(KvEvent::Removed { tier: Tier::Cpu, hash: old });
        }
        self.event(KvEvent::Stored { tier: Tier::Cpu, hash });
    }

    /// Let go of `blocks` of `tier`: private blocks return to the free stack in order; hashed ones
    /// are counted down and, when no table holds them, join the LRU tail last block first.
    fn release(&mut self, tier: Tier, blocks: &[u32]) {
        match (tier, self.cache.as_mut()) {
            (Tier::Gpu, Some(cache)) => {
                let mut private = Vec::with_capacity(blocks.len());
                for &b in blocks.iter().rev() {
                    if !cache.release(b) {
                        private.push(b);
                    }
                }
                private.reverse();
                self.give_back_private(Tier::Gpu, &private);
            }
            // CPU tables are private (the CPU tier's cached blocks are never held).
            _ => self.give_back_private(tier, blocks),
        }
    }

    /// Private blocks a table let go of return to the free stack, except lent ones: those wait
    /// for their last loan ([`KvBlockManager::end_loan`]).
    fn give_back_private(&mut self, tier: Tier, blocks: &[u32]) {
        if self.lent.is_empty() {
            return self.pool_mut(tier).give_back(blocks);
        }
        let lent = &mut self.lent;
        let free: Vec<u32> = blocks
            .iter()
            .copied()
            .filter(|&b| match lent.get_mut(&(tier, b)) {
                Some(loan) => {
                    loan.released = true;
                    false
                }
                None => true,
            })
            .collect();
        self.pool_mut(tier).give_back(&free);
    }

    /// Lend `block` of `tier` out (a worker's transport sending its bytes in place): until the
    /// loan ends ([`KvBlockManager::end_loan`]) no allocation takes it, whatever its holders do.
    /// A cached GPU block counts the loan as one more holder (a free cached one leaves the LRU
    /// meanwhile); a private block must be held by a table when lent, and one let go of while
    /// lent is free only when its last loan ends. The simulator never lends.
    pub fn lend(&mut self, tier: Tier, block: u32) {
        let hashed = match (tier, self.cache.as_deref_mut()) {
            (Tier::Gpu, Some(cache)) if cache.hash_of.contains_key(&block) => {
                cache.unlink(block); // a free cached one leaves the LRU
                *cache.refs.entry(block).or_insert(0) += 1;
                true
            }
            _ => false,
        };
        self.lent.entry((tier, block)).or_insert(Loan { count: 0, hashed, released: false }).count += 1;
    }

    /// A loan of [`KvBlockManager::lend`] came back; `false` if `block` was not lent.
    pub fn end_loan(&mut self, tier: Tier, block: u32) -> bool {
        let Some(loan) = self.lent.get_mut(&(tier, block)) else { return false };
        loan.count -= 1;
        let loan = *loan;
        if loan.count == 0 {
            self.lent.remove(&(tier, block));
        }
        if loan.hashed {
            self.cache.as_mut().expect("a hashed loan is of a cached GPU block").release(block);
        } else if loan.count == 0 && loan.released {
            self.pool_mut(tier).give_back(&[block]);
        }
        true
    }

    /// Loans out now (each [`KvBlockManager::lend`] not yet ended).
    pub fn loans(&self) -> u32 {
        self.lent.values().map(|l| l.count).sum()
    }

    /// Give `request` blocks for `tokens` tokens on `tier`. All-or-nothing.
    pub fn allocate(&mut self, request: RequestId, tier: Tier, tokens: u32) -> Result<(), KvError> {
        if self.tables.contains_key(&request) {
            return Err(KvError::AlreadyAllocated(request));
        }
        let n = self.blocks_for(tokens);
        let mut blocks = Vec::with_capacity(n as usize);
        self.take(tier, n, &mut blocks)?;
        self.tables.insert(request, BlockTable { tier, blocks, tokens });
        Ok(())
    }

    /// Give `request` GPU blocks for `tokens` tokens whose prompt blocks hash to `hashes`: the
    /// leading cached ones (at most `max_hits`) are shared when on the GPU and copied from the CPU
    /// tier when only there, the rest taken fresh, and the blocks that `hashes` cover registered
    /// for later prompts. All-or-nothing. Without hashes it is [`KvBlockManager::allocate`] on the
    /// GPU.
    pub fn allocate_prefixed(
        &mut self,
        request: RequestId,
        tokens: u32,
        hashes: &[BlockHash],
        max_hits: u32,
    ) -> Result<PrefixHit, KvError> {
        self.allocate_prefixed_as(request, tokens, hashes, max_hits, true)
    }

    /// [`KvBlockManager::allocate_prefixed`] for KV that arrives from elsewhere (a migration
    /// target's reservation, its hits pinned rather than prefilled): not counted as a prefix-cache
    /// query.
    pub fn allocate_prefixed_arriving(
        &mut self,
        request: RequestId,
        tokens: u32,
        hashes: &[BlockHash],
        max_hits: u32,
    ) -> Result<PrefixHit, KvError> {
        self.allocate_prefixed_as(request, tokens, hashes, max_hits, false)
    }

    fn allocate_prefixed_as(
        &mut self,
        request: RequestId,
        tokens: u32,
        hashes: &[BlockHash],
        max_hits: u32,
        query: bool,
    ) -> Result<PrefixHit, KvError> {
        if hashes.is_empty() {
            return self.allocate(request, Tier::Gpu, tokens).map(|()| PrefixHit::default());
        }
        if self.tables.contains_key(&request) {
            return Err(KvError::AlreadyAllocated(request));
        }
        let n = self.blocks_for(tokens);
        let gpu = self.cache.get_or_insert_with(Box::default);
        // The leading run cached in either tier: Some(block) on the GPU, None only in the CPU tier.
        let mut run: Vec<Option<u32>> = Vec::new();
        for h in hashes.iter().take(max_hits.min(n) as usize) {
            match gpu.by_hash.get(h) {
                Some(&b) => run.push(Some(b)),
                None if self.cpu_cache.as_ref().is_some_and(|c| c.by_hash.contains_key(h)) => run.push(None),
                None => break,
            }
        }
        let on_gpu = run.iter().flatten().count() as u32;
        // GPU hits sitting in the LRU are not free for the fresh part.
        let hits_free = run.iter().flatten().filter(|b| gpu.lru_key.contains_key(b)).count() as u32;
        let available = self.free(Tier::Gpu) - hits_free;
        let fresh = n - on_gpu;
        if fresh > available {
            return Err(KvError::OutOfBlocks { tier: Tier::Gpu, needed: fresh, free: available });
        }
        let gpu = self.cache.as_mut().expect("created above");
        for &b in run.iter().flatten() {
            gpu.unlink(b);
            *gpu.refs.entry(b).or_insert(0) += 1;
        }
        if let Some(cpu) = self.cpu_cache.as_mut() {
            for (h, _) in hashes.iter().zip(&run).filter(|(_, b)| b.is_none()) {
                cpu.touch(cpu.by_hash[h]);
            }
        }
        let mut taken = Vec::with_capacity(fresh as usize);
        self.take(Tier::Gpu, fresh, &mut taken)?;
        let mut taken = taken.into_iter();
        let mut blocks: Vec<u32> =
            run.iter().map(|b| b.unwrap_or_else(|| taken.next().expect("one fresh block per CPU hit"))).collect();
        blocks.extend(taken);
        let gpu = self.cache.as_mut().expect("created above");
        let covered = hashes.len().min(blocks.len());
        let mut stored = Vec::new();
        for (j, (&h, &b)) in hashes[..covered].iter().zip(&blocks[..covered]).enumerate() {
            if matches!(run.get(j), Some(Some(_))) {
                continue;
            }
            // A later block can still be cached under another block after an earlier one was
            // evicted: that copy stays private.
            if let std::collections::hash_map::Entry::Vacant(e) = gpu.by_hash.entry(h) {
                e.insert(b);
                gpu.hash_of.insert(b, h);
                gpu.refs.insert(b, 1);
                stored.push(h);
            }
        }
        for hash in stored {
            self.event(KvEvent::Stored { tier: Tier::Gpu, hash });
        }
        let hit = PrefixHit { blocks: run.len() as u32, from_cpu: run.len() as u32 - on_gpu };
        let bs = self.block_size as u64;
        if query {
            self.prefix_stats.query_tokens += tokens as u64;
            self.prefix_stats.hit_tokens += hit.blocks as u64 * bs;
            self.prefix_stats.cpu_hit_tokens += hit.from_cpu as u64 * bs;
        }
        self.tables.insert(request, BlockTable { tier: Tier::Gpu, blocks, tokens });
        Ok(hit)
    }

    /// Register prompt blocks fetched from another instance (`hashes`, in prompt order) as free
    /// cached GPU blocks, the leading one youngest (evicted last); blocks already cached on the
    /// GPU are only refreshed. Takes free blocks first, then evicts the oldest free cached ones,
    /// never one of `hashes`, and stops when none is left: returns the blocks it registered, in
    /// prompt order, for their content to be written.
    pub fn install_cached(&mut self, hashes: &[BlockHash]) -> Vec<(BlockHash, u32)> {
        let cache = self.cache.get_or_insert_with(Box::default);
        let mut fresh = Vec::new();
        let mut refreshed = 0u32;
        for h in hashes.iter().rev() {
            match cache.by_hash.get(h) {
                Some(&b) if cache.lru_key.contains_key(&b) => {
                    cache.touch(b);
                    refreshed += 1;
                }
                Some(_) => {}
                None if !fresh.contains(h) => fresh.push(*h),
                None => {}
            }
        }
        // The refreshed ones are the youngest in the LRU: taking fewer than the rest evicts none.
        let n = (fresh.len() as u32).min(self.free(Tier::Gpu) - refreshed);
        // Short of room, the leading blocks (last in `fresh`) are the ones a prompt can hit.
        fresh.drain(..fresh.len() - n as usize);
        let mut blocks = Vec::with_capacity(n as usize);
        if self.take(Tier::Gpu, n, &mut blocks).is_err() {
            return Vec::new();
        }
        let cache = self.cache.as_mut().expect("created above");
        for (&h, &b) in fresh.iter().zip(&blocks) {
            cache.by_hash.insert(h, b);
            cache.hash_of.insert(b, h);
            cache.push_lru(b);
            cache.computed.insert(b);
        }
        for &h in &fresh {
            self.event(KvEvent::Stored { tier: Tier::Gpu, hash: h });
        }
        let mut installed: Vec<(BlockHash, u32)> = fresh.into_iter().zip(blocks).collect();
        installed.reverse();
        installed
    }

    /// `request`'s first `tokens` tokens are computed: its hashed GPU blocks among them hold their
    /// content from now on (a prefix fetch may copy them).
    pub fn mark_computed(&mut self, request: RequestId, tokens: u32) {
        let (Some(cache), Some(table)) = (self.cache.as_mut(), self.tables.get(&request)) else { return };
        if table.tier != Tier::Gpu {
            return;
        }
        let full = (tokens / self.block_size) as usize;
        for &b in table.blocks.iter().take(full) {
            if cache.hash_of.contains_key(&b) {
                cache.computed.insert(b);
            }
        }
    }

    /// How many of `hashes`' leading blocks are cached on the GPU with their content computed
    /// (what a prefix fetch from here can copy).
    pub fn computed_prefix_blocks(&self, hashes: &[BlockHash]) -> u32 {
        let Some(cache) = self.cache.as_deref() else { return 0 };
        hashes.iter().take_while(|h| cache.by_hash.get(h).is_some_and(|b| cache.computed.contains(b))).count() as u32
    }

    /// Drop the free cached GPU block holding `hash` (its content proved wrong): its block is
    /// free again and the hash forgotten. `false` when no table-free block holds it.
    pub fn forget_cached(&mut self, hash: BlockHash) -> bool {
        let Some(cache) = self.cache.as_mut() else { return false };
        let Some(&block) = cache.by_hash.get(&hash) else { return false };
        if !cache.lru_key.contains_key(&block) {
            return false;
        }
        cache.unlink(block);
        cache.by_hash.remove(&hash);
        cache.hash_of.remove(&block);
        cache.computed.remove(&block);
        self.gpu.give_back(&[block]);
        self.event(KvEvent::Removed { tier: Tier::Gpu, hash });
        true
    }

    /// Extend `request` to hold `tokens` tokens on its current tier; returns blocks added.
    pub fn grow(&mut self, request: RequestId, tokens: u32) -> Result<u32, KvError> {
        let block_size = self.block_size;
        let table = self.tables.get_mut(&request).ok_or(KvError::UnknownRequest(request))?;
        if tokens < table.tokens {
            return Err(KvError::Shrink { request, have: table.tokens, want: tokens });
        }
        let have = table.blocks.len() as u32;
        let tier = table.tier;
        let need = tokens.div_ceil(block_size).saturating_sub(have);
        if need == 0 {
            table.tokens = tokens;
            return Ok(0);
        }
        // New blocks go straight onto the table (`take` adds nothing when it fails).
        let mut blocks = std::mem::take(&mut table.blocks);
        let taken = self.take(tier, need, &mut blocks);
        let table = self.tables.get_mut(&request).expect("checked above");
        table.blocks = blocks;
        taken?;
        table.tokens = tokens;
        Ok(need)
    }

    /// Make `request` hold exactly `tokens` tokens on its tier, taking or giving back blocks (a
    /// migration target's reservation fitted to what finally arrived). All-or-nothing.
    pub fn resize(&mut self, request: RequestId, tokens: u32) -> Result<(), KvError> {
        let need = self.blocks_for(tokens) as usize;
        let table = self.tables.get(&request).ok_or(KvError::UnknownRequest(request))?;
        let (tier, have) = (table.tier, table.blocks.len());
        if need > have {
            let mut fresh = Vec::with_capacity(need - have);
            self.take(tier, (need - have) as u32, &mut fresh)?;
            self.tables.get_mut(&request).expect("checked above").blocks.extend_from_slice(&fresh);
        } else {
            let surplus = self.tables.get_mut(&request).expect("checked above").blocks.split_off(need);
            self.release(tier, &surplus);
        }
        self.tables.get_mut(&request).expect("checked above").tokens = tokens;
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
        self.take(to, n, &mut fresh)?;
        let table = self.tables.get_mut(&request).expect("checked above");
        let old = std::mem::replace(&mut table.blocks, fresh);
        table.tier = to;
        if let Some(journal) = self.journal.as_mut() {
            journal.push(KvMove { request, from_tier: from, to_tier: to, from: old.clone(), to: table.blocks.clone() });
        }
        // Shared blocks stay cached on the GPU; the copy on the other tier is private.
        self.release(from, &old);
        Ok(n)
    }

    /// Release all of `request`'s blocks; returns how many were freed (0 if it held none).
    pub fn free_request(&mut self, request: RequestId) -> u32 {
        match self.tables.remove(&request) {
            Some(t) => {
                let n = t.blocks.len() as u32;
                self.release(t.tier, &t.blocks);
                n
            }
            None => 0,
        }
    }

    /// Verify the accounting invariants; returns a description of the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        let empty = PrefixCache::default();
        for (tier, pool) in [(Tier::Gpu, &self.gpu), (Tier::Cpu, &self.cpu)] {
            let cache = self.cache_of(tier).unwrap_or(&empty);
            // Per block: Some(0) free or free-cached, Some(k) held by k tables.
            let mut state: Vec<Option<u32>> = vec![None; pool.capacity as usize];
            let free_blocks = pool.free.iter().map(|&b| (b, "free"));
            let lru_blocks = cache.lru.values().map(|&b| (b, "free-cached"));
            for (b, what) in free_blocks.chain(lru_blocks) {
                let slot = state.get_mut(b as usize).ok_or(format!("{tier:?} {what} block {b} out of range"))?;
                if slot.is_some() {
                    return Err(format!("{tier:?} block {b} is {what} and free again"));
                }
                *slot = Some(0);
            }
            for (id, t) in self.tables.iter().filter(|(_, t)| t.tier == tier) {
                if t.blocks.len() as u32 != self.blocks_for(t.tokens) {
                    return Err(format!("{id} holds {} blocks for {} tokens", t.blocks.len(), t.tokens));
                }
                for &b in &t.blocks {
                    let slot = state.get_mut(b as usize).ok_or(format!("{tier:?} block {b} out of range"))?;
                    match slot {
                        Some(0) => return Err(format!("{tier:?} block {b} held by {id} and free")),
                        Some(k) if !cache.hash_of.contains_key(&b) => {
                            return Err(format!("{tier:?} private block {b} held by {id} and {k} other tables"))
                        }
                        Some(k) => *k += 1,
                        None => *slot = Some(1),
                    }
                }
            }
            // A loan holds its block as a table would: a cached block counts it among its
            // holders, a private one is held by its table or, let go of, by the loan alone.
            for (&(_, b), loan) in self.lent.iter().filter(|((t, _), _)| *t == tier) {
                let slot = state.get_mut(b as usize).ok_or(format!("{tier:?} lent block {b} out of range"))?;
                match (loan.hashed, loan.released, *slot) {
                    (true, _, Some(0)) => return Err(format!("{tier:?} lent cached block {b} is free")),
                    (true, _, held) => *slot = Some(held.unwrap_or(0) + loan.count),
                    (false, false, Some(1)) | (false, true, None) => *slot = Some(1),
                    (false, released, held) => {
                        return Err(format!("{tier:?} lent private block {b} (let go of: {released}) is {held:?}"))
                    }
                }
            }
            for (b, s) in state.iter().enumerate() {
                let b = b as u32;
                let refs = cache.refs.get(&b).copied().unwrap_or(0);
                match *s {
                    None => return Err(format!("{tier:?} block {b} leaked (neither free nor held)")),
                    Some(held) if cache.hash_of.contains_key(&b) && held != refs => {
                        return Err(format!("{tier:?} cached block {b} counts {refs} holders, {held} tables hold it"))
                    }
                    Some(0) if cache.hash_of.contains_key(&b) != cache.lru_key.contains_key(&b) => {
                        return Err(format!("{tier:?} free block {b}: hashed and in the LRU must go together"))
                    }
                    _ => {}
                }
            }
            if cache.by_hash.len() != cache.hash_of.len()
                || cache.by_hash.iter().any(|(h, b)| cache.hash_of.get(b) != Some(h))
            {
                return Err(format!("{tier:?}: hash → block and block → hash disagree (one cached block per hash)"));
            }
            if cache.lru.len() != cache.lru_key.len() || cache.lru.iter().any(|(k, b)| cache.lru_key.get(b) != Some(k))
            {
                return Err(format!("{tier:?}: the LRU and its index disagree"));
            }
            if let Some(b) = cache.computed.iter().find(|b| !cache.hash_of.contains_key(b)) {
                return Err(format!("{tier:?}: block {b} is marked computed but holds no cached content"));
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

    fn common_prefix(a: &[BlockHash], b: &[BlockHash]) -> usize {
        a.iter().zip(b).take_while(|(x, y)| x == y).count()
    }

    #[test]
    fn hash_chains_share_exactly_the_common_content() {
        let h = |ids: &[u64], tokens| prompt_block_hashes(ids, tokens, 16);
        assert_eq!(common_prefix(&h(&[0, 1, 2], 1536), &h(&[0, 1, 3], 1536)), 64, "two ids of 32 blocks");
        assert_eq!(h(&[0, 1], 700).len(), 43, "700 tokens: 43 full blocks");
        assert_eq!(common_prefix(&h(&[0, 1], 700), &h(&[0, 1], 1024)), 43);
        assert_eq!(common_prefix(&h(&[5, 1], 1024), &h(&[0, 1], 1024)), 0, "a chain: a different head changes all");
        assert_eq!(h(&[0], 1024).len(), 32, "tokens past the ids are unique");
        assert!(h(&[], 1024).is_empty() && prompt_block_hashes(&[0], 1024, 48).is_empty());
        let ids: Vec<u64> = (0..40).collect();
        let all = h(&ids, 20_000);
        let distinct: std::collections::HashSet<_> = all.iter().collect();
        assert_eq!(distinct.len(), all.len(), "no two blocks of a prompt collide");
    }

    #[test]
    fn a_cached_prompt_hits_all_but_its_last_token_and_partial_blocks_never_hit() {
        let mut kv = KvBlockManager::new(16, 200, 0);
        let h = prompt_block_hashes(&[0, 1], 1024, 16);
        assert_eq!(kv.allocate_prefixed(RequestId(1), 1025, &h, 63).unwrap().blocks, 0, "cold");
        kv.free_request(RequestId(1));
        assert_eq!((kv.used(Tier::Gpu), kv.cached_free(Tier::Gpu)), (0, 64), "the prompt's blocks stay cached");
        // vLLM recomputes the last prompt token: at most ⌊(1024 − 1) / 16⌋ = 63 blocks hit.
        assert_eq!(kv.allocate_prefixed(RequestId(2), 1025, &h, 63).unwrap().blocks, 63);
        assert_eq!(kv.prefix_stats(), PrefixStats { query_tokens: 2050, hit_tokens: 1008, ..PrefixStats::default() });
        // 700 tokens over the same ids: 43 full blocks, all cached; the partial 44th is private.
        let short = prompt_block_hashes(&[0, 1], 700, 16);
        assert_eq!(kv.allocate_prefixed(RequestId(3), 700, &short, 699 / 16).unwrap().blocks, 43);
        assert_eq!(kv.table(RequestId(3)).unwrap().blocks[..43], kv.table(RequestId(2)).unwrap().blocks[..43]);
        let (t2, t3) = (kv.table(RequestId(2)).unwrap(), kv.table(RequestId(3)).unwrap());
        assert_ne!(t3.blocks[43], t2.blocks[43], "a partial block is never shared");
        kv.check_invariants().unwrap();
    }

    #[test]
    fn eviction_takes_uncached_blocks_first_then_the_oldest_cached_last_block_first() {
        // 8 GPU blocks; prompts of 3 full blocks (48 tokens + 1 answer slot = 4 blocks).
        let mut kv = KvBlockManager::new(16, 8, 0);
        let a = prompt_block_hashes(&[1], 48, 16);
        let b = prompt_block_hashes(&[2], 48, 16);
        let blocks = |kv: &KvBlockManager, r: u64| kv.table(RequestId(r)).unwrap().blocks.clone();
        kv.allocate_prefixed(RequestId(1), 49, &a, 2).unwrap();
        let a_blocks = blocks(&kv, 1);
        kv.free_request(RequestId(1)); // a's 3 hashed blocks join the LRU (last first); its 4th is free
        kv.allocate_prefixed(RequestId(2), 49, &b, 2).unwrap();
        kv.free_request(RequestId(2));
        assert_eq!((kv.free(Tier::Gpu), kv.cached_free(Tier::Gpu)), (8, 6));
        // Steps: (request, blocks asked, which of a's and b's hashes are still cached afterwards,
        // evictions so far).
        type Step = (u64, u32, [bool; 3], [bool; 3], u64);
        let steps: [Step; 4] = [
            // 2 plain free blocks exist: nothing evicted.
            (10, 2, [true, true, true], [true, true, true], 0),
            // 2 more: a's last block, then a's middle one.
            (11, 2, [true, false, false], [true, true, true], 2),
            // 1 more: a's head.
            (12, 1, [false, false, false], [true, true, true], 3),
            // 2 more: b's last block, then b's middle one.
            (13, 2, [false, false, false], [true, false, false], 5),
        ];
        for (req, n, a_left, b_left, evictions) in steps {
            kv.allocate(RequestId(req), Tier::Gpu, n * 16).unwrap();
            let cached = |hs: &[BlockHash]| -> [bool; 3] {
                std::array::from_fn(|i| kv.cache.as_ref().unwrap().by_hash.contains_key(&hs[i]))
            };
            assert_eq!(
                (cached(&a), cached(&b), kv.prefix_stats().evictions),
                (a_left, b_left, evictions),
                "step {req}"
            );
            kv.check_invariants().unwrap();
        }
        assert!(kv.table(RequestId(11)).unwrap().blocks.contains(&a_blocks[2]), "a's last block went first");
    }

    #[test]
    fn fetched_blocks_join_the_cache_leading_first_and_a_later_prompt_hits_them() {
        // 6 GPU blocks; a prompt of 8 full blocks fetched from elsewhere.
        let mut kv = KvBlockManager::new(16, 6, 0);
        kv.enable_events();
        let h = prompt_block_hashes(&[3], 128, 16);
        assert_eq!(h.len(), 8);
        let other = prompt_block_hashes(&[4], 32, 16);
        kv.allocate_prefixed(RequestId(1), 32, &other, 2).unwrap();
        kv.free_request(RequestId(1)); // 2 cached free blocks of another prompt
                                       // Room for 6: the leading 6 of the 8 are registered, evicting the other prompt's two.
        let installed = kv.install_cached(&h);
        assert_eq!(installed.iter().map(|(hash, _)| *hash).collect::<Vec<_>>(), h[..6].to_vec(), "prompt order");
        assert_eq!(kv.prefix_hits(&h), 6);
        assert_eq!((kv.used(Tier::Gpu), kv.cached_free(Tier::Gpu)), (0, 6));
        kv.check_invariants().unwrap();
        let mut events = Vec::new();
        kv.drain_events(&mut events);
        let stored = events.iter().filter(|e| matches!(e, KvEvent::Stored { tier: Tier::Gpu, .. })).count();
        assert_eq!(stored, 2 + 6, "{events:?}");
        // Installing again registers nothing new and evicts none of them.
        assert!(kv.install_cached(&h[..6]).is_empty());
        assert_eq!(kv.prefix_hits(&h), 6);
        // A prompt with that content hits the 6 (all but the partial rest).
        let hit = kv.allocate_prefixed(RequestId(2), 96, &h[..6], 5).unwrap();
        assert_eq!(hit.blocks, 5, "capped as the engine caps hits");
        kv.check_invariants().unwrap();
        // The leading block is the youngest: a 1-block allocation evicts the 6th, not the 1st.
        kv.free_request(RequestId(2));
        let mut kv2 = KvBlockManager::new(16, 3, 0);
        assert_eq!(kv2.install_cached(&h[..3]).len(), 3);
        kv2.allocate(RequestId(9), Tier::Gpu, 16).unwrap();
        assert_eq!(kv2.prefix_hits(&h), 2, "the last fetched block went first");
        // A block whose content proved wrong is forgotten and free again; a held one is not.
        assert!(kv2.forget_cached(h[1]));
        assert_eq!((kv2.prefix_hits(&h), kv2.free(Tier::Gpu)), (1, 2));
        kv2.check_invariants().unwrap();
        let _ = kv2.allocate_prefixed(RequestId(10), 32, &h[..1], 1).unwrap();
        assert!(!kv2.forget_cached(h[0]), "held by request 10");
        // Fetched blocks are computed; a prompt's own are once its prefill says so.
        assert_eq!(kv2.computed_prefix_blocks(&h), 1);
        let mut kv3 = KvBlockManager::new(16, 8, 0);
        kv3.allocate_prefixed(RequestId(1), 64, &h[..4], 3).unwrap();
        assert_eq!(kv3.computed_prefix_blocks(&h), 0, "registered, not computed");
        kv3.mark_computed(RequestId(1), 40); // 2 full blocks
        assert_eq!(kv3.computed_prefix_blocks(&h), 2);
        kv3.mark_computed(RequestId(1), 64);
        assert_eq!(kv3.computed_prefix_blocks(&h), 4);
        kv3.free_request(RequestId(1));
        kv3.allocate(RequestId(2), Tier::Gpu, 8 * 16).unwrap(); // evicts all four
        assert_eq!(kv3.computed_prefix_blocks(&h), 0);
        kv3.check_invariants().unwrap();
    }

    #[test]
    fn evicted_blocks_live_on_in_the_cpu_tier_and_come_back_as_a_reload() {
        let mut kv = KvBlockManager::new(16, 8, 3);
        let a = prompt_block_hashes(&[1], 64, 16); // 4 hashed blocks
        kv.allocate_prefixed(RequestId(1), 65, &a, 4).unwrap();
        kv.free_request(RequestId(1));
        // 8 fresh blocks: 3 plain free, then all 4 of a's cached blocks and one more evicted; the
        // CPU tier keeps 3 (its capacity): a's last block is evicted first and pushed out again.
        kv.allocate(RequestId(2), Tier::Gpu, 8 * 16).unwrap();
        let st = kv.prefix_stats();
        assert_eq!((st.evictions, st.demotions, st.cpu_evictions), (4, 4, 1), "{st:?}");
        assert_eq!((kv.cached_blocks(Tier::Gpu), kv.cached_blocks(Tier::Cpu)), (0, 3));
        assert_eq!(kv.prefix_hits(&a), 3, "blocks 0…2 in the CPU tier; block 3 is gone");
        kv.check_invariants().unwrap();
        kv.free_request(RequestId(2));
        let hit = kv.allocate_prefixed(RequestId(3), 65, &a, 4).unwrap();
        assert_eq!(hit, PrefixHit { blocks: 3, from_cpu: 3 });
        assert_eq!(kv.cached_blocks(Tier::Gpu), 4, "copied up and registered again, block 3 computed");
        // A preempted request's CPU copy takes a cached CPU block before failing.
        assert_eq!(kv.free(Tier::Cpu), 3);
        kv.move_to(RequestId(3), Tier::Cpu).unwrap_err();
        kv.allocate(RequestId(4), Tier::Cpu, 48).unwrap();
        assert_eq!(kv.cached_blocks(Tier::Cpu), 0, "the cache gives way to a preempted request");
        kv.check_invariants().unwrap();
    }

    #[test]
    fn a_hit_block_in_use_is_shared_and_survives_its_first_holder() {
        let mut kv = KvBlockManager::new(16, 10, 8);
        let h = prompt_block_hashes(&[7], 64, 16);
        kv.allocate_prefixed(RequestId(1), 65, &h, 3).unwrap();
        assert_eq!(kv.allocate_prefixed(RequestId(2), 65, &h, 3).unwrap().blocks, 3);
        assert_eq!(kv.used(Tier::Gpu), 5 + 2, "three blocks shared");
        kv.move_to(RequestId(1), Tier::Cpu).unwrap();
        assert_eq!(kv.used(Tier::Gpu), 5, "the shared blocks stay for their other holder");
        assert_eq!(kv.allocate_prefixed(RequestId(3), 65, &h, 3).unwrap().blocks, 3);
        kv.free_request(RequestId(2));
        kv.free_request(RequestId(3));
        assert_eq!((kv.used(Tier::Gpu), kv.cached_free(Tier::Gpu)), (0, 4), "4 hashed blocks cached, none held");
        kv.check_invariants().unwrap();
        let before = kv.free(Tier::Gpu);
        assert!(kv.allocate_prefixed(RequestId(4), 16 * 12, &h, 3).is_err(), "12 blocks, 3 hit: 9 fresh, 10 − 3 free");
        assert_eq!(kv.free(Tier::Gpu), before, "a refused allocation takes nothing");
        kv.check_invariants().unwrap();
    }

    #[derive(Clone, Debug)]
    enum Op {
        Alloc(u8, bool, u16),
        /// A prompt over content ids `[0, 1, 2][..k]` with a varying last id (shared prefixes).
        Prefixed(u8, u8, u8, u16),
        Grow(u8, u16),
        Move(u8),
        Free(u8),
        /// Lend logical block `k` (modulo its length) of a request's table.
        Lend(u8, u8),
        /// Lend free cached GPU block `k` (modulo their number; a prefix fetch's holder).
        LendCached(u8),
        /// End loan `i` (modulo the loans out).
        EndLoan(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..8, any::<bool>(), 0u16..120).prop_map(|(r, g, t)| Op::Alloc(r, g, t)),
            (0u8..8, 1u8..4, 0u8..3, 1u16..200).prop_map(|(r, k, last, t)| Op::Prefixed(r, k, last, t)),
            (0u8..8, 0u16..200).prop_map(|(r, t)| Op::Grow(r, t)),
            (0u8..8).prop_map(Op::Move),
            (0u8..8).prop_map(Op::Free),
            (0u8..8, any::<u8>()).prop_map(|(r, k)| Op::Lend(r, k)),
            any::<u8>().prop_map(Op::LendCached),
            any::<u8>().prop_map(Op::EndLoan),
        ]
    }

    proptest! {
        /// No leak, no double ownership, never over capacity, whatever the sequence of operations
        /// (including ones that must fail).
        #[test]
        fn accounting_invariants_hold(ops in proptest::collection::vec(op(), 1..200)) {
            let mut kv = KvBlockManager::new(16, 40, 12);
            kv.enable_events();
            // What the events say is cached, replayed as a precise index would.
            let mut seen: std::collections::HashSet<(Tier, BlockHash)> = Default::default();
            let mut events = Vec::new();
            // Loans out: (tier, block, the request that lent it, its content hash if cached).
            let mut loans: Vec<(Tier, u32, RequestId, Option<BlockHash>)> = Vec::new();
            for op in ops {
                let _ = match op {
                    Op::Lend(r, k) => {
                        let id = RequestId(r as u64);
                        if let Some(t) = kv.table(id).filter(|t| !t.blocks.is_empty()) {
                            let (tier, block) = (t.tier, t.blocks[k as usize % t.blocks.len()]);
                            let hash = kv.cache_of(tier).and_then(|c| c.hash_of.get(&block).copied()).filter(|_| tier == Tier::Gpu);
                            kv.lend(tier, block);
                            loans.push((tier, block, id, hash));
                        }
                        Ok(0)
                    }
                    Op::LendCached(k) => {
                        let free_cached: Vec<u32> = kv.cache_of(Tier::Gpu).map(|c| c.lru.values().copied().collect()).unwrap_or_default();
                        if !free_cached.is_empty() {
                            let block = free_cached[k as usize % free_cached.len()];
                            let hash = kv.cache_of(Tier::Gpu).and_then(|c| c.hash_of.get(&block).copied());
                            kv.lend(Tier::Gpu, block);
                            loans.push((Tier::Gpu, block, RequestId(u64::MAX), hash));
                        }
                        Ok(0)
                    }
                    Op::EndLoan(i) if !loans.is_empty() => {
                        let (tier, block, _, _) = loans.swap_remove(i as usize % loans.len());
                        prop_assert!(kv.end_loan(tier, block));
                        Ok(0)
                    }
                    Op::EndLoan(_) => Ok(0),
                    Op::Alloc(r, g, t) => kv.allocate(RequestId(r as u64), if g { Tier::Gpu } else { Tier::Cpu }, t as u32).map(|_| 0),
                    Op::Prefixed(r, k, last, t) => {
                        // Prompts under 512 tokens: their first content id decides what they share.
                        let mut ids = vec![0u64, 1, 2];
                        ids.truncate(k as usize);
                        *ids.last_mut().expect("k >= 1") += 10 * last as u64;
                        let hashes = prompt_block_hashes(&ids, t as u32, 16);
                        kv.allocate_prefixed(RequestId(r as u64), t as u32, &hashes, (t as u32 - 1) / 16).map(|h| h.blocks)
                    }
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
                prop_assert_eq!(kv.loans() as usize, loans.len());
                // A lent block is never taken by anyone else: a private one stays with the
                // request that lent it (or with nobody), a cached one keeps its content.
                for &(tier, block, lender, hash) in &loans {
                    match hash {
                        Some(h) => prop_assert_eq!(kv.cache_of(tier).and_then(|c| c.by_hash.get(&h)), Some(&block)),
                        None => {
                            let other = kv.tables.iter().find(|(id, t)| **id != lender && t.tier == tier && t.blocks.contains(&block));
                            prop_assert!(other.is_none(), "lent {:?} block {} taken by {:?}", tier, block, other.map(|o| *o.0));
                        }
                    }
                }
                kv.drain_events(&mut events);
                for e in events.drain(..) {
                    match e {
                        KvEvent::Stored { tier, hash } => prop_assert!(seen.insert((tier, hash)), "stored twice: {:?}", e),
                        KvEvent::Removed { tier, hash } => prop_assert!(seen.remove(&(tier, hash)), "removed unseen: {:?}", e),
                        KvEvent::AllCleared => prop_assert!(false, "the block manager never clears all"),
                    }
                }
                let actual: std::collections::HashSet<(Tier, BlockHash)> = [Tier::Gpu, Tier::Cpu]
                    .into_iter()
                    .flat_map(|t| kv.cache_of(t).into_iter().flat_map(move |c| c.by_hash.keys().map(move |&h| (t, h))))
                    .collect();
                prop_assert_eq!(&seen, &actual);
            }
            // Every loan ended: nothing held but by tables.
            for (tier, block, _, _) in loans.drain(..) {
                prop_assert!(kv.end_loan(tier, block));
            }
            if let Err(e) = kv.check_invariants() { prop_assert!(false, "{}", e); }
            prop_assert!(!kv.end_loan(Tier::Gpu, 0), "no loan is out");
            for tier in [Tier::Gpu, Tier::Cpu] {
                let held: std::collections::HashSet<u32> = kv.tables.values().filter(|t| t.tier == tier).flat_map(|t| t.blocks.iter().copied()).collect();
                prop_assert_eq!(kv.used(tier) as usize, held.len(), "{:?}", tier);
            }
        }
    }
}
