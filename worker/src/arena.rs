//! The real KV arena: host memory standing in for one GPU's KV cache and its CPU offload pool.
//!
//! A worker holds `blocks × block_bytes` of real memory per pool (two anonymous mmaps),
//! `block_bytes = block_size × kv_bytes_per_token` (16 × 256 KiB = 4 MiB for R1-Distill-Qwen-32B),
//! so KV writes, tier copies and migrations move as many bytes as on the real GPU. On a small host
//! the *number* of blocks is scaled down; the per-token size never is, since it sets the bytes per
//! token that offloads and migrations copy. Block `b` of a pool lives at offset `b × block_bytes`, exactly the ids the engine's
//! [`kvfleet_core::kv::KvBlockManager`] hands out, so the arena mirrors the engine's block tables.
//!
//! Every token slot is filled with bytes derived only from its content ([`TokenContent`]): (request
//! id, token index) for a request's own tokens, (block hash, slot) for a prompt block shared through
//! the prefix cache (one copy serves every request whose prompt starts the same way); four
//! xorshift64 lanes seeded (splitmix64) by a hash of the pair. A receiver of a migrated block (the
//! pipelined live migration: copy stages while the request decodes, then a short stop-and-copy,
//! after Llumnix and Phasor App. D; docs/architecture.md, "Live migration") can therefore
//! regenerate and verify every byte without having seen the sender. [`KvFill::Stamp`] writes only the first [`STAMP_BYTES`] of
//! each slot (the same bytes a full fill starts with), for hosts running many workers: it keeps
//! resident memory at 1/64 of the arena while still letting every token be identified.

use bytes::Bytes;
use kvfleet_core::kv::{BlockHash, KvMove, Tier};
use kvfleet_core::RequestId;
pub use kvfleet_kvbytes::fill_token;
use kvfleet_kvbytes::{first_difference, mix64, Digest, GOLDEN};
use kvfleet_netmodel::Payload;
use memmap2::{MmapMut, MmapOptions};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// Bytes of a token slot written in [`KvFill::Stamp`] mode (one cache line).
pub const STAMP_BYTES: usize = 64;

/// How much of each token's KV slot is written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum KvFill {
    /// Every byte of the token's `kv_bytes_per_token` slot (real memory traffic and footprint).
    #[default]
    Full,
    /// Only the first 64 bytes of each slot (many workers on one host).
    Stamp,
}

/// Shape of the two pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArenaLayout {
    /// Tokens per KV block (the engine's block size).
    pub block_size: u32,
    /// Bytes of KV cache one token occupies, across all layers (never scaled down).
    pub kv_bytes_per_token: u64,
    /// Blocks in the GPU pool.
    pub gpu_blocks: u32,
    /// Blocks in the CPU (offload) pool.
    pub cpu_blocks: u32,
}

impl ArenaLayout {
    /// Bytes of one block: `block_size × kv_bytes_per_token`.
    pub fn block_bytes(&self) -> u64 {
        self.block_size as u64 * self.kv_bytes_per_token
    }
    /// Number of blocks in `tier`'s pool.
    pub fn blocks(&self, tier: Tier) -> u32 {
        match tier {
            Tier::Gpu => self.gpu_blocks,
            Tier::Cpu => self.cpu_blocks,
        }
    }
    /// Bytes of `tier`'s whole pool.
    pub fn tier_bytes(&self, tier: Tier) -> u64 {
        self.blocks(tier) as u64 * self.block_bytes()
    }
}

/// Why an arena could not be mapped, or a block could not be written, copied or verified.
#[derive(Debug, thiserror::Error)]
pub enum ArenaError {
    /// The layout has a zero block size or a zero per-token size.
    #[error("block_size and kv_bytes_per_token must be > 0 (got {block_size} and {kv_bytes_per_token})")]
    EmptyLayout {
        /// Tokens per block asked for.
        block_size: u32,
        /// Bytes per token asked for.
        kv_bytes_per_token: u64,
    },
    /// A pool's size does not fit `usize` on this host.
    #[error("the {tier:?} KV pool ({bytes} bytes) does not fit this address space")]
    TooLarge {
        /// The pool.
        tier: Tier,
        /// Its size in bytes.
        bytes: u64,
    },
    /// The anonymous mmap of a pool failed.
    #[error("cannot map {bytes} bytes for the {tier:?} KV pool: {cause}")]
    Map {
        /// The pool.
        tier: Tier,
        /// Its size in bytes.
        bytes: u64,
        /// The OS error.
        cause: std::io::Error,
    },
    /// A block id past the end of its pool (or any id in an empty pool).
    #[error("block {block} is outside the {tier:?} pool ({blocks} blocks)")]
    BlockOutOfRange {
        /// The pool.
        tier: Tier,
        /// The block id asked for.
        block: u32,
        /// Blocks the pool holds.
        blocks: u32,
    },
    /// A token range to verify spans more than one block.
    #[error("tokens {first_token}..{end} do not fit one {block_size}-token block")]
    TokensOutOfBlock {
        /// First token of the range (absolute position in the request's context).
        first_token: u32,
        /// One past the last token of the range.
        end: u64,
        /// Tokens per block.
        block_size: u32,
    },
    /// A [`KvMove`] whose source and destination block lists differ in length.
    #[error("KV move of {request} lists {from} source blocks but {to} destination blocks")]
    MoveShape {
        /// The request whose blocks move.
        request: RequestId,
        /// Number of source blocks.
        from: usize,
        /// Number of destination blocks.
        to: usize,
    },
    /// Block data of the wrong length (e.g. a migration payload).
    #[error("a block is {want} bytes, got {got}")]
    BlockLength {
        /// Bytes received.
        got: u64,
        /// Bytes per block in this arena.
        want: u64,
    },
    /// A block lent to a reader outside the engine (a migration sending it) cannot be written
    /// until its lease ends.
    #[error("{tier:?} block {block} is leased to a transfer in flight")]
    Leased {
        /// The pool.
        tier: Tier,
        /// The block.
        block: u32,
    },
    /// A received block whose bytes do not hash to the checksum its sender computed.
    #[error("{tier:?} block {block}: received bytes hash to {found:#018x}, the sender's checksum is {expected:#018x}")]
    Checksum {
        /// The pool.
        tier: Tier,
        /// The block written.
        block: u32,
        /// The sender's checksum.
        expected: u64,
        /// What the written bytes hash to.
        found: u64,
    },
    /// Verification found a byte that is not the token's deterministic content.
    #[error(transparent)]
    Mismatch(#[from] Mismatch),
}

/// A byte that differs from the deterministic content of its token.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "KV mismatch in {tier:?} block {block}: token {token} of {request} (slot {slot}), byte {byte}: \
     expected {expected:#04x}, found {found:#04x}"
)]
pub struct Mismatch {
    /// Pool of the block.
    pub tier: Tier,
    /// Block id within the pool.
    pub block: u32,
    /// Request the token belongs to.
    pub request: RequestId,
    /// Token index (absolute position in the request's context).
    pub token: u32,
    /// Slot of the token within the block (`token % block_size`).
    pub slot: u32,
    /// Offset within the token's slot.
    pub byte: u64,
    /// The deterministic byte.
    pub expected: u8,
    /// The byte in memory.
    pub found: u8,
}

/// Seed of one token's byte stream: a hash of (request, token index).
#[inline]
pub fn token_seed(request: RequestId, token: u32) -> u64 {
    mix64(request.0.wrapping_mul(GOLDEN) ^ mix64(token as u64 ^ 0x6b76_666c_6565_7400))
}

/// Seed of slot `slot` of a shared prompt block with content hash `hash`.
#[inline]
pub fn shared_token_seed(hash: BlockHash, slot: u32) -> u64 {
    mix64((hash as u64) ^ mix64((hash >> 64) as u64 ^ GOLDEN) ^ mix64(slot as u64 ^ 0x7368_6172_6564_0000))
}

/// Whose content a request's token slots hold: its full prompt blocks hashed by the prefix cache
/// (`shared[j]` for block j) hold the block's shared content, every other token the request's own.
#[derive(Clone, Copy, Debug)]
pub struct TokenContent<'a> {
    /// The request.
    pub request: RequestId,
    /// Content hashes of its leading shared blocks (empty: nothing shared).
    pub shared: &'a [BlockHash],
}

impl TokenContent<'_> {
    /// A request none of whose blocks are shared.
    pub fn private(request: RequestId) -> TokenContent<'static> {
        TokenContent { request, shared: &[] }
    }
    /// Seed of token `token` in blocks of `block_size` tokens.
    #[inline]
    pub fn seed(&self, token: u32, block_size: u32) -> u64 {
        match self.shared.get((token / block_size) as usize) {
            Some(&hash) => shared_token_seed(hash, token % block_size),
            None => token_seed(self.request, token),
        }
    }
}

impl From<RequestId> for TokenContent<'static> {
    fn from(request: RequestId) -> Self {
        TokenContent::private(request)
    }
}

/// One pool's memory (`None` for an empty pool: mmap refuses zero lengths on some systems).
struct Pool {
    map: Option<Arc<Mapping>>,
    blocks: u32,
}

/// A pool's mapping, shared with the leases on its blocks ([`KvArena::lease`]).
///
/// Access goes through `base`, never through a reference to the whole map, so that the engine
/// thread's `&mut` to one block and a transport thread's `&` to another never overlap. A block is
/// written only through `&mut KvArena` and only while no lease on it is out (its count, read
/// with `Acquire`, is 0): leases are created only through the arena, so none can appear during
/// the write, and a lease's reads happen before its `Release` decrement.
struct Mapping {
    /// Keeps the memory mapped; read and written only through `base`.
    _map: MmapMut,
    base: *mut u8,
    block_bytes: usize,
    /// Leases out per block.
    leases: Box<[AtomicU32]>,
}

// SAFETY: `base` points into `_map`, which lives as long as the `Mapping`; the rules above keep
// every write exclusive of every other access to the same block.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Block `block`'s bytes as a pointer (in range: checked by the caller).
    fn block_ptr(&self, block: u32) -> *mut u8 {
        debug_assert!((block as usize) < self.leases.len());
        // SAFETY: block < blocks, so the offset is inside the mapping.
        unsafe { self.base.add(block as usize * self.block_bytes) }
    }
    fn is_leased(&self, block: u32) -> bool {
        self.leases[block as usize].load(Ordering::Acquire) != 0
    }
}

/// A block lent to a reader outside the engine thread (a migration's transport); handed out as
/// [`Bytes`] that read the arena in place. Dropping the last clone ends the lease: the block may
/// be written again, and the engine learns it through [`KvArena::returned_leases`].
struct BlockLease {
    map: Arc<Mapping>,
    tier: Tier,
    block: u32,
    returned: Arc<Mutex<Vec<(Tier, u32)>>>,
}

impl AsRef<[u8]> for BlockLease {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the block is in range (checked when leased) and is not written while leased.
        unsafe { std::slice::from_raw_parts(self.map.block_ptr(self.block), self.map.block_bytes) }
    }
}

impl Drop for BlockLease {
    fn drop(&mut self) {
        self.map.leases[self.block as usize].fetch_sub(1, Ordering::Release);
        self.returned.lock().unwrap_or_else(|e| e.into_inner()).push((self.tier, self.block));
    }
}

/// The two pools of one worker.
pub struct KvArena {
    layout: ArenaLayout,
    fill: KvFill,
    gpu: Pool,
    cpu: Pool,
    /// Bytes written per token slot (`kv_bytes_per_token`, or the stamp).
    written_per_token: usize,
    /// Blocks whose lease ended since [`KvArena::returned_leases`] last asked.
    returned: Arc<Mutex<Vec<(Tier, u32)>>>,
}

impl std::fmt::Debug for KvArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvArena").field("layout", &self.layout).field("fill", &self.fill).finish_non_exhaustive()
    }
}

impl KvArena {
    /// Map both pools (lazily faulted, or pre-faulted with `prefault`).
    pub fn new(layout: ArenaLayout, fill: KvFill, prefault: bool) -> Result<KvArena, ArenaError> {
        if layout.block_size == 0 || layout.kv_bytes_per_token == 0 {
            return Err(ArenaError::EmptyLayout {
                block_size: layout.block_size,
                kv_bytes_per_token: layout.kv_bytes_per_token,
            });
        }
        let map = |tier: Tier| -> Result<Pool, ArenaError> {
            let bytes = layout.tier_bytes(tier);
            let blocks = layout.blocks(tier);
            if bytes == 0 {
                return Ok(Pool { map: None, blocks });
            }
            let len = usize::try_from(bytes).map_err(|_| ArenaError::TooLarge { tier, bytes })?;
            let mut opts = MmapOptions::new();
            opts.len(len);
            if prefault {
                opts.populate();
            }
            let mut map = opts.map_anon().map_err(|cause| ArenaError::Map { tier, bytes, cause })?;
            let base = map.as_mut_ptr();
            let leases = (0..blocks).map(|_| AtomicU32::new(0)).collect();
            let block_bytes = layout.block_bytes() as usize;
            Ok(Pool { map: Some(Arc::new(Mapping { _map: map, base, block_bytes, leases })), blocks })
        };
        let gpu = map(Tier::Gpu)?;
        let cpu = map(Tier::Cpu)?;
        let written_per_token = match fill {
            KvFill::Full => layout.kv_bytes_per_token as usize,
            KvFill::Stamp => STAMP_BYTES.min(layout.kv_bytes_per_token as usize),
        };
        Ok(KvArena { layout, fill, gpu, cpu, written_per_token, returned: Arc::default() })
    }

    /// Shape of the two pools.
    pub fn layout(&self) -> &ArenaLayout {
        &self.layout
    }
    /// How much of each token slot this arena writes.
    pub fn fill(&self) -> KvFill {
        self.fill
    }
    /// Bytes mapped for both pools.
    pub fn mapped_bytes(&self) -> u64 {
        self.layout.tier_bytes(Tier::Gpu) + self.layout.tier_bytes(Tier::Cpu)
    }

    fn pool(&self, tier: Tier) -> &Pool {
        match tier {
            Tier::Gpu => &self.gpu,
            Tier::Cpu => &self.cpu,
        }
    }

    fn check_block(&self, tier: Tier, block: u32) -> Result<(), ArenaError> {
        let blocks = self.pool(tier).blocks;
        if block >= blocks {
            return Err(ArenaError::BlockOutOfRange { tier, block, blocks });
        }
        Ok(())
    }

    /// A block's mapping, checked in range.
    fn mapping(&self, tier: Tier, block: u32) -> Result<&Arc<Mapping>, ArenaError> {
        self.check_block(tier, block)?;
        self.pool(tier).map.as_ref().ok_or(ArenaError::BlockOutOfRange { tier, block, blocks: 0 })
    }

    fn block_bytes_of(&self, tier: Tier, block: u32) -> Result<&[u8], ArenaError> {
        let map = self.mapping(tier, block)?;
        // SAFETY: in range; no `&mut` to it can exist while `self` is borrowed shared.
        Ok(unsafe { std::slice::from_raw_parts(map.block_ptr(block), map.block_bytes) })
    }

    /// A block to write: refused while a lease on it is out.
    fn block_bytes_mut(&mut self, tier: Tier, block: u32) -> Result<&mut [u8], ArenaError> {
        let ptr = self.writable(tier, block)?;
        // SAFETY: in range, unleased (see `Mapping`), and `self` is borrowed exclusively.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, self.layout.block_bytes() as usize) })
    }

    /// A block's pointer for writing, once checked in range and unleased.
    fn writable(&self, tier: Tier, block: u32) -> Result<*mut u8, ArenaError> {
        let map = self.mapping(tier, block)?;
        if map.is_leased(block) {
            return Err(ArenaError::Leased { tier, block });
        }
        Ok(map.block_ptr(block))
    }

    /// Write the KV of token `token` (its absolute position in the request's context) into its
    /// slot `token % block_size` of `block`.
    pub fn write_token<'a>(
        &mut self,
        tier: Tier,
        block: u32,
        content: impl Into<TokenContent<'a>>,
        token: u32,
    ) -> Result<(), ArenaError> {
        let per_token = self.layout.kv_bytes_per_token as usize;
        let bs = self.layout.block_size;
        let slot = (token % bs) as usize;
        let n = self.written_per_token;
        let seed = content.into().seed(token, bs);
        let bytes = self.block_bytes_mut(tier, block)?;
        fill_token(&mut bytes[slot * per_token..slot * per_token + n], seed);
        Ok(())
    }

    /// Check tokens `first_token .. first_token + tokens` of `request` (all in `block`) against
    /// their deterministic content: every written byte ([`KvFill`]) of every slot.
    pub fn verify_block<'a>(
        &self,
        tier: Tier,
        block: u32,
        content: impl Into<TokenContent<'a>>,
        first_token: u32,
        tokens: u32,
    ) -> Result<(), ArenaError> {
        self.verify_prefix(tier, block, content.into(), first_token, tokens, self.written_per_token)
    }

    /// [`KvArena::verify_block`] over the first [`STAMP_BYTES`] of each slot only (cheap; valid in
    /// both fill modes since a full fill starts with the stamp).
    pub fn verify_stamps<'a>(
        &self,
        tier: Tier,
        block: u32,
        content: impl Into<TokenContent<'a>>,
        first_token: u32,
        tokens: u32,
    ) -> Result<(), ArenaError> {
        self.verify_prefix(tier, block, content.into(), first_token, tokens, self.written_per_token.min(STAMP_BYTES))
    }

    fn verify_prefix(
        &self,
        tier: Tier,
        block: u32,
        content: TokenContent<'_>,
        first_token: u32,
        tokens: u32,
        n: usize,
    ) -> Result<(), ArenaError> {
        let bs = self.layout.block_size;
        let end = first_token as u64 + tokens as u64;
        if tokens > 0 && (first_token % bs) as u64 + tokens as u64 > bs as u64 {
            return Err(ArenaError::TokensOutOfBlock { first_token, end, block_size: bs });
        }
        let per_token = self.layout.kv_bytes_per_token as usize;
        let bytes = self.block_bytes_of(tier, block)?;
        for token in first_token..first_token + tokens {
            let slot = token % bs;
            let at = slot as usize * per_token;
            if let Some((byte, expected, found)) = first_difference(&bytes[at..at + n], content.seed(token, bs)) {
                let request = content.request;
                return Err(Mismatch { tier, block, request, token, slot, byte, expected, found }.into());
            }
        }
        Ok(())
    }

    /// A 64-bit digest of the block's written bytes (whole block, or every slot's stamp), for a
    /// migration receiver to compare with the sender's.
    pub fn checksum(&self, tier: Tier, block: u32) -> Result<u64, ArenaError> {
        let bytes = self.block_bytes_of(tier, block)?;
        let per_token = self.layout.kv_bytes_per_token as usize;
        let mut h = Digest::new();
        match self.fill {
            KvFill::Full => h.update(bytes),
            KvFill::Stamp => {
                for slot in 0..self.layout.block_size as usize {
                    h.update(&bytes[slot * per_token..slot * per_token + self.written_per_token]);
                }
            }
        }
        Ok(h.finish())
    }

    /// The bytes of one block.
    pub fn block(&self, tier: Tier, block: u32) -> Result<&[u8], ArenaError> {
        self.block_bytes_of(tier, block)
    }

    /// Lend one block to a reader outside the engine thread (a live migration's transport): the
    /// [`Bytes`] read the arena in place, and until the last clone drops the block cannot be
    /// written ([`ArenaError::Leased`]). The engine must also keep the block from being reused
    /// meanwhile (`KvBlockManager::lend`); [`KvArena::returned_leases`] says when to stop.
    pub fn lease(&self, tier: Tier, block: u32) -> Result<Bytes, ArenaError> {
        let map = self.mapping(tier, block)?;
        map.leases[block as usize].fetch_add(1, Ordering::Relaxed);
        Ok(Bytes::from_owner(BlockLease { map: map.clone(), tier, block, returned: self.returned.clone() }))
    }

    /// Blocks whose leases ended since the last call (one entry per lease).
    pub fn returned_leases(&self) -> Vec<(Tier, u32)> {
        let mut returned = self.returned.lock().unwrap_or_else(|e| e.into_inner());
        if returned.is_empty() {
            return Vec::new();
        }
        std::mem::take(&mut *returned)
    }

    /// A copy of one block that outlives this borrow (a block still being written, e.g. the
    /// partial last block of a request that may resume here).
    pub fn copy_out(&self, tier: Tier, block: u32) -> Result<Bytes, ArenaError> {
        Ok(Bytes::copy_from_slice(self.block_bytes_of(tier, block)?))
    }

    /// Overwrite one block with `data` (a live migration's target landing a received block, from
    /// the buffers it arrived in: copied once, in order). With `checksum`, what landed must hash
    /// to it (the migration's xxh3-64, computed in the same pass as the copy): a mismatch is an
    /// error, and the block holds the bad bytes.
    pub fn write_block(
        &mut self,
        tier: Tier,
        block: u32,
        data: &Payload,
        checksum: Option<u64>,
    ) -> Result<(), ArenaError> {
        let want = self.layout.block_bytes();
        if data.len() as u64 != want {
            return Err(ArenaError::BlockLength { got: data.len() as u64, want });
        }
        self.write_block_at(tier, block, 0, data, checksum)
    }

    /// [`KvArena::write_block`] of a slice of a block: `data` lands at `offset` (a layer-group
    /// slice of a migration following a prefill layer by layer); it must fit in the block.
    pub fn write_block_at(
        &mut self,
        tier: Tier,
        block: u32,
        offset: u64,
        data: &Payload,
        checksum: Option<u64>,
    ) -> Result<(), ArenaError> {
        let size = self.layout.block_bytes();
        let end = offset.checked_add(data.len() as u64).filter(|&end| end <= size);
        let Some(end) = end else {
            return Err(ArenaError::BlockLength { got: offset.saturating_add(data.len() as u64), want: size });
        };
        let dst = &mut self.block_bytes_mut(tier, block)?[offset as usize..end as usize];
        match checksum {
            None => data.copy_to_slice(dst),
            Some(expected) => {
                let found = data.copy_checksummed(dst);
                if found != expected {
                    return Err(ArenaError::Checksum { tier, block, expected, found });
                }
            }
        }
        Ok(())
    }

    /// Mirror an engine tier move (offload or reload): copy block `from[i]` of `from_tier` to block
    /// `to[i]` of `to_tier`. All-or-nothing: every block id is checked before anything is copied.
    pub fn copy_blocks(&mut self, m: &KvMove) -> Result<(), ArenaError> {
        if m.from.len() != m.to.len() {
            return Err(ArenaError::MoveShape { request: m.request, from: m.from.len(), to: m.to.len() });
        }
        // Every source in range and every destination writable before anything is copied.
        let mut pairs = Vec::with_capacity(m.from.len());
        for (&f, &t) in m.from.iter().zip(&m.to) {
            let src = self.mapping(m.from_tier, f)?.block_ptr(f);
            pairs.push((src, self.writable(m.to_tier, t)?));
        }
        let per_token = self.layout.kv_bytes_per_token as usize;
        let n = self.written_per_token;
        let bs = self.layout.block_size as usize;
        let block_bytes = self.layout.block_bytes() as usize;
        for (src, dst) in pairs {
            if src == dst {
                continue;
            }
            // SAFETY: both blocks are in range and distinct (blocks never overlap); the
            // destination is unleased and `self` is borrowed exclusively, so nothing else reads
            // or writes it; the source is at most read by leases.
            let (src, dst) = unsafe {
                (std::slice::from_raw_parts(src, block_bytes), std::slice::from_raw_parts_mut(dst, block_bytes))
            };
            match (self.fill, m.from_tier == m.to_tier) {
                (KvFill::Full, _) | (KvFill::Stamp, true) => dst.copy_from_slice(src),
                // Copy only what was written: touching the rest would fault in pages the stamp
                // mode exists to leave untouched.
                (KvFill::Stamp, false) => {
                    for slot in 0..bs {
                        let at = slot * per_token;
                        dst[at..at + n].copy_from_slice(&src[at..at + n]);
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn small(fill: KvFill) -> KvArena {
        // 4 tokens per block, 72-byte tokens (not a multiple of 32: exercises the partial chunk).
        KvArena::new(ArenaLayout { block_size: 4, kv_bytes_per_token: 72, gpu_blocks: 6, cpu_blocks: 5 }, fill, false)
            .unwrap()
    }

    fn write_block(a: &mut KvArena, tier: Tier, block: u32, req: RequestId, first: u32, n: u32) {
        for t in first..first + n {
            a.write_token(tier, block, req, t).unwrap();
        }
    }

    #[test]
    fn written_content_verifies_and_differs_per_token() {
        for fill in [KvFill::Full, KvFill::Stamp] {
            let mut a = small(fill);
            write_block(&mut a, Tier::Gpu, 2, RequestId(7), 8, 4);
            a.verify_block(Tier::Gpu, 2, RequestId(7), 8, 4).unwrap();
            a.verify_stamps(Tier::Gpu, 2, RequestId(7), 8, 4).unwrap();
            // Another request, or the same tokens shifted, is not what is there.
            assert!(a.verify_block(Tier::Gpu, 2, RequestId(8), 8, 4).is_err(), "{fill:?}");
            assert!(a.verify_block(Tier::Gpu, 2, RequestId(7), 12, 4).is_err(), "{fill:?}");
            assert!(a.verify_block(Tier::Gpu, 3, RequestId(7), 8, 4).is_err(), "{fill:?}: block 3 was never written");
        }
        assert_ne!(token_seed(RequestId(1), 2), token_seed(RequestId(2), 1));
    }

    #[test]
    #[ignore = "timing probe: cargo test --release -p kvfleet-worker fill_rate -- --ignored --nocapture"]
    fn fill_rate() {
        let mut buf = vec![0u8; 256 << 10];
        let t = std::time::Instant::now();
        for i in 0..400 {
            fill_token(&mut buf, i);
        }
        let fill = 400.0 * buf.len() as f64 / t.elapsed().as_secs_f64() / 1e9;
        let t = std::time::Instant::now();
        for _ in 0..400 {
            assert!(first_difference(&buf, 399).is_none());
        }
        let verify = 400.0 * buf.len() as f64 / t.elapsed().as_secs_f64() / 1e9;
        eprintln!("fill {fill:.2} GB/s, verify {verify:.2} GB/s");
    }

    #[test]
    fn a_flipped_byte_is_named_by_block_token_and_offset() {
        let mut a = small(KvFill::Full);
        write_block(&mut a, Tier::Cpu, 1, RequestId(3), 4, 4);
        // Token 6 sits in slot 2; flip its byte 70 (inside the partial last chunk).
        a.block_bytes_mut(Tier::Cpu, 1).unwrap()[2 * 72 + 70] ^= 0x10;
        match a.verify_block(Tier::Cpu, 1, RequestId(3), 4, 4) {
            Err(ArenaError::Mismatch(m)) => {
                assert_eq!((m.tier, m.block, m.token, m.slot, m.byte), (Tier::Cpu, 1, 6, 2, 70));
                assert_eq!(m.expected ^ m.found, 0x10);
                assert!(m.to_string().contains("token 6"), "{m}");
            }
            other => panic!("expected a mismatch, got {other:?}"),
        }
        // The tokens before it still verify.
        a.verify_block(Tier::Cpu, 1, RequestId(3), 4, 2).unwrap();
    }

    #[test]
    fn stamp_mode_writes_only_the_stamp() {
        let mut a = KvArena::new(
            ArenaLayout { block_size: 2, kv_bytes_per_token: 256, gpu_blocks: 1, cpu_blocks: 0 },
            KvFill::Stamp,
            false,
        )
        .unwrap();
        write_block(&mut a, Tier::Gpu, 0, RequestId(1), 0, 2);
        let bytes = a.block_bytes_of(Tier::Gpu, 0).unwrap();
        assert!(bytes[STAMP_BYTES..256].iter().all(|&b| b == 0));
        assert!(bytes[..STAMP_BYTES].iter().any(|&b| b != 0));
        assert!(bytes[256 + STAMP_BYTES..].iter().all(|&b| b == 0));
        // A full arena's stamp equals the stamp arena's bytes.
        let mut f = KvArena::new(*a.layout(), KvFill::Full, false).unwrap();
        write_block(&mut f, Tier::Gpu, 0, RequestId(1), 0, 2);
        f.verify_stamps(Tier::Gpu, 0, RequestId(1), 0, 2).unwrap();
        assert_eq!(&f.block_bytes_of(Tier::Gpu, 0).unwrap()[..STAMP_BYTES], &bytes[..STAMP_BYTES]);
    }

    /// A leased block is read in place and cannot be written (a token, a received block, a tier
    /// move into it) until every clone of its lease is dropped; the engine then learns it.
    #[test]
    fn a_leased_block_is_read_in_place_and_never_written_until_returned() {
        let mut a = small(KvFill::Full);
        write_block(&mut a, Tier::Gpu, 2, RequestId(5), 0, 4);
        let lease = a.lease(Tier::Gpu, 2).unwrap();
        assert_eq!(lease.as_ptr(), a.block(Tier::Gpu, 2).unwrap().as_ptr(), "read in place");
        let clone = lease.slice(8..16);
        drop(lease);
        let leased = |r: Result<(), ArenaError>| matches!(r, Err(ArenaError::Leased { tier: Tier::Gpu, block: 2 }));
        assert!(leased(a.write_token(Tier::Gpu, 2, RequestId(9), 0)));
        let block = Payload::from(Bytes::from(vec![0u8; 4 * 72]));
        assert!(leased(a.write_block(Tier::Gpu, 2, &block, None)));
        let into = |to: Vec<u32>| KvMove {
            request: RequestId(9),
            from_tier: Tier::Cpu,
            to_tier: Tier::Gpu,
            from: vec![0, 1],
            to,
        };
        assert!(leased(a.copy_blocks(&into(vec![3, 2]))));
        // All or nothing: block 3 was not written either.
        assert_eq!(a.block(Tier::Gpu, 3).unwrap(), &vec![0u8; 4 * 72][..]);
        assert!(a.returned_leases().is_empty());
        a.verify_block(Tier::Gpu, 2, RequestId(5), 0, 4).unwrap();
        // Other blocks are writable meanwhile, and leases of the other pool are their own.
        a.write_token(Tier::Gpu, 1, RequestId(9), 0).unwrap();
        a.write_token(Tier::Cpu, 2, RequestId(9), 0).unwrap();
        drop(clone);
        assert_eq!(a.returned_leases(), vec![(Tier::Gpu, 2)]);
        assert!(a.returned_leases().is_empty());
        a.write_block(Tier::Gpu, 2, &block, None).unwrap();
        a.copy_blocks(&into(vec![3, 2])).unwrap();
        // Two leases of one block: written only after both end.
        let (l1, l2) = (a.lease(Tier::Cpu, 4).unwrap(), a.lease(Tier::Cpu, 4).unwrap());
        drop(l1);
        assert!(matches!(a.write_token(Tier::Cpu, 4, RequestId(9), 0), Err(ArenaError::Leased { .. })));
        drop(l2);
        a.write_token(Tier::Cpu, 4, RequestId(9), 0).unwrap();
        assert!(matches!(a.lease(Tier::Gpu, 6), Err(ArenaError::BlockOutOfRange { .. })));
    }

    /// A lease keeps its memory mapped after the arena is gone.
    #[test]
    fn a_lease_outlives_its_arena() {
        let mut a = small(KvFill::Full);
        write_block(&mut a, Tier::Gpu, 1, RequestId(5), 0, 4);
        let want = a.block(Tier::Gpu, 1).unwrap().to_vec();
        let lease = a.lease(Tier::Gpu, 1).unwrap();
        drop(a);
        assert_eq!(&lease[..], &want[..]);
    }

    #[test]
    fn copy_preserves_content_and_checksum() {
        for fill in [KvFill::Full, KvFill::Stamp] {
            let mut a = small(fill);
            write_block(&mut a, Tier::Gpu, 0, RequestId(5), 0, 4);
            write_block(&mut a, Tier::Gpu, 4, RequestId(5), 4, 3);
            let sums = [a.checksum(Tier::Gpu, 0).unwrap(), a.checksum(Tier::Gpu, 4).unwrap()];
            let m = KvMove {
                request: RequestId(5),
                from_tier: Tier::Gpu,
                to_tier: Tier::Cpu,
                from: vec![0, 4],
                to: vec![3, 1],
            };
            a.copy_blocks(&m).unwrap();
            a.verify_block(Tier::Cpu, 3, RequestId(5), 0, 4).unwrap();
            a.verify_block(Tier::Cpu, 1, RequestId(5), 4, 3).unwrap();
            assert_eq!([a.checksum(Tier::Cpu, 3).unwrap(), a.checksum(Tier::Cpu, 1).unwrap()], sums, "{fill:?}");
            assert_ne!(sums[0], sums[1]);
        }
    }

    #[test]
    fn bad_moves_and_blocks_are_refused_without_copying() {
        let mut a = small(KvFill::Full);
        write_block(&mut a, Tier::Gpu, 0, RequestId(1), 0, 4);
        let bad = KvMove {
            request: RequestId(1),
            from_tier: Tier::Gpu,
            to_tier: Tier::Cpu,
            from: vec![0, 1],
            to: vec![0, 5],
        };
        assert!(matches!(
            a.copy_blocks(&bad),
            Err(ArenaError::BlockOutOfRange { tier: Tier::Cpu, block: 5, blocks: 5 })
        ));
        assert!(a.verify_block(Tier::Cpu, 0, RequestId(1), 0, 4).is_err(), "nothing was copied");
        let shape =
            KvMove { request: RequestId(1), from_tier: Tier::Gpu, to_tier: Tier::Cpu, from: vec![0], to: vec![] };
        assert!(matches!(a.copy_blocks(&shape), Err(ArenaError::MoveShape { .. })));
        assert!(matches!(a.write_token(Tier::Gpu, 6, RequestId(1), 0), Err(ArenaError::BlockOutOfRange { .. })));
        assert!(matches!(a.verify_block(Tier::Gpu, 0, RequestId(1), 2, 4), Err(ArenaError::TokensOutOfBlock { .. })));
    }

    #[test]
    fn empty_cpu_pool_and_prefault_work() {
        let a = KvArena::new(
            ArenaLayout { block_size: 16, kv_bytes_per_token: 4096, gpu_blocks: 4, cpu_blocks: 0 },
            KvFill::Full,
            true,
        )
        .unwrap();
        assert_eq!(a.mapped_bytes(), 4 * 16 * 4096);
        assert!(matches!(a.checksum(Tier::Cpu, 0), Err(ArenaError::BlockOutOfRange { .. })));
        assert!(KvArena::new(
            ArenaLayout { block_size: 0, kv_bytes_per_token: 1, gpu_blocks: 1, cpu_blocks: 1 },
            KvFill::Full,
            false
        )
        .is_err());
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// (tier is GPU, block, request, block index within the request)
        Write(bool, u32, u8, u32),
        /// (from GPU?, source blocks, destination blocks)
        Copy(bool, Vec<u32>, Vec<u32>),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (any::<bool>(), 0u32..5, 0u8..4, 0u32..6).prop_map(|(g, b, r, i)| Op::Write(g, b, r, i)),
            (any::<bool>(), proptest::collection::vec(0u32..5, 0..4), proptest::collection::vec(0u32..5, 0..4))
                .prop_map(|(g, f, t)| Op::Copy(g, f, t)),
        ]
    }

    proptest! {
        /// Against a model of what each block holds: after any sequence of writes and moves, every
        /// block verifies as exactly the (request, tokens) the model says, in both fill modes.
        #[test]
        fn writes_and_copies_keep_every_block_verifiable(ops in proptest::collection::vec(op(), 1..60), stamp in any::<bool>()) {
            let fill = if stamp { KvFill::Stamp } else { KvFill::Full };
            let mut a = small(fill);
            let mut model: std::collections::HashMap<(Tier, u32), (RequestId, u32)> = Default::default();
            for op in ops {
                match op {
                    Op::Write(gpu, block, r, idx) => {
                        let tier = if gpu { Tier::Gpu } else { Tier::Cpu };
                        write_block(&mut a, tier, block, RequestId(r as u64), idx * 4, 4);
                        model.insert((tier, block), (RequestId(r as u64), idx * 4));
                    }
                    Op::Copy(gpu, mut from, mut to) => {
                        let (ft, tt) = if gpu { (Tier::Gpu, Tier::Cpu) } else { (Tier::Cpu, Tier::Gpu) };
                        let n = from.len().min(to.len());
                        from.truncate(n);
                        to.truncate(n);
                        to.sort_unstable();
                        to.dedup();
                        from.truncate(to.len());
                        let m = KvMove { request: RequestId(0), from_tier: ft, to_tier: tt, from: from.clone(), to: to.clone() };
                        a.copy_blocks(&m).unwrap();
                        for (&f, &t) in from.iter().zip(&to) {
                            match model.get(&(ft, f)).copied() {
                                Some(v) => { model.insert((tt, t), v); }
                                None => { model.remove(&(tt, t)); }
                            }
                        }
                    }
                }
                for (&(tier, block), &(req, first)) in &model {
                    if let Err(e) = a.verify_block(tier, block, req, first, 4) { prop_assert!(false, "{}", e); }
                }
            }
        }
    }
}
