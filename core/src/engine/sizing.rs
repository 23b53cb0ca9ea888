//! Sizing an instance's KV pools from byte budgets, with every count bounded before anything is
//! allocated.
//!
//! The simulator (`[cluster] kv_cache_gb`, `cpu_swap_gb`, the GPU's memory) and the worker
//! (`--kv-memory`, `--cpu-memory`) both turn bytes into blocks here, so an absurd number is the
//! same clear error in both instead of a wrapped product, a division by zero or an allocation of
//! billions of block-table entries.

/// Most KV blocks one pool (GPU or CPU) may hold: 64 M tokens at 16 tokens per block. The engine
/// keeps per-block state, so the bound keeps one instance's bookkeeping under a few hundred MB;
/// real instances hold 10⁴–10⁵ blocks.
pub const MAX_POOL_BLOCKS: u32 = 1 << 22;

/// Why a pool could not be sized.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SizingError {
    /// `block_size × kv_bytes_per_token` does not fit in 64 bits, or is zero.
    #[error("a block of {block_size} tokens × {kv_bytes_per_token} B per token has no valid size in bytes")]
    BlockBytes {
        /// Tokens per block.
        block_size: u32,
        /// KV bytes per token (from the model's shape).
        kv_bytes_per_token: u64,
    },
    /// The budget holds no whole block.
    #[error("{bytes} bytes hold no KV block of {block_bytes} bytes")]
    NoBlock {
        /// The budget in bytes.
        bytes: u64,
        /// One block's size in bytes.
        block_bytes: u64,
    },
    /// The budget holds more blocks than [`MAX_POOL_BLOCKS`].
    #[error(
        "{bytes} bytes are {blocks} KV blocks of {block_bytes} bytes, more than the {max} one pool may hold \
         (use less memory or a larger block size)"
    )]
    TooManyBlocks {
        /// The budget in bytes.
        bytes: u64,
        /// Whole blocks in the budget.
        blocks: u64,
        /// One block's size in bytes.
        block_bytes: u64,
        /// [`MAX_POOL_BLOCKS`].
        max: u32,
    },
}

/// Bytes of one KV block, checked: `block_size × kv_bytes_per_token`, non-zero and in 64 bits.
pub fn block_bytes(block_size: u32, kv_bytes_per_token: u64) -> Result<u64, SizingError> {
    (block_size as u64)
        .checked_mul(kv_bytes_per_token)
        .filter(|&b| b > 0)
        .ok_or(SizingError::BlockBytes { block_size, kv_bytes_per_token })
}

/// Whole blocks of `block_bytes` in `bytes`, at most [`MAX_POOL_BLOCKS`]. Zero blocks is allowed
/// (a CPU pool of 0 bytes turns offloading off); callers that need a block check for it or use
/// [`gpu_pool_blocks`].
pub fn pool_blocks(bytes: u64, block_bytes: u64) -> Result<u32, SizingError> {
    let blocks = bytes / block_bytes.max(1);
    if blocks > MAX_POOL_BLOCKS as u64 {
        return Err(SizingError::TooManyBlocks { bytes, blocks, block_bytes, max: MAX_POOL_BLOCKS });
    }
    Ok(blocks as u32)
}

/// [`pool_blocks`] for the GPU pool, which must hold at least one block.
pub fn gpu_pool_blocks(bytes: u64, block_bytes: u64) -> Result<u32, SizingError> {
    match pool_blocks(bytes, block_bytes)? {
        0 => Err(SizingError::NoBlock { bytes, block_bytes }),
        n => Ok(n),
    }
}

/// Bytes of a budget given in GB (10⁹ B) in a config: finite, ≥ 0 and below 2⁶⁴ (`None` if not).
pub fn gb_to_bytes(gb: f64) -> Option<u64> {
    let bytes = gb * 1e9;
    (bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64).then_some(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_become_bounded_block_counts() {
        assert_eq!(block_bytes(16, 262_144), Ok(4 << 20));
        assert!(matches!(block_bytes(16, u64::MAX), Err(SizingError::BlockBytes { .. })));
        assert!(matches!(block_bytes(16, 0), Err(SizingError::BlockBytes { .. })));
        assert_eq!(gpu_pool_blocks(20_900_000_000, 4 << 20), Ok(4_982));
        assert_eq!(pool_blocks(0, 4 << 20), Ok(0));
        assert!(matches!(gpu_pool_blocks(1 << 20, 4 << 20), Err(SizingError::NoBlock { .. })));
        // 1e9 GB of KV, or an all-ones toy model's 32-byte blocks in 20 GB: refused, not allocated.
        let e = gpu_pool_blocks(gb_to_bytes(1e9).unwrap(), 4 << 20).unwrap_err();
        assert!(e.to_string().contains("more than the 4194304 one pool may hold"), "{e}");
        assert!(pool_blocks(20_000_000_000, 32).is_err());
        assert_eq!(pool_blocks(MAX_POOL_BLOCKS as u64 * 32, 32), Ok(MAX_POOL_BLOCKS));
        assert!(pool_blocks(MAX_POOL_BLOCKS as u64 * 32 + 32, 32).is_err());
        assert_eq!(gb_to_bytes(1.5), Some(1_500_000_000));
        for bad in [f64::NAN, f64::INFINITY, -1.0, 1e12] {
            assert_eq!(gb_to_bytes(bad), None, "{bad}");
        }
    }
}
