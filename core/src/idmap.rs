//! Hash maps keyed by our integer ids, with a cheap, deterministic hasher.
//!
//! SipHash (std's default) showed up as ~12 % of simulator time on block-table lookups; ids are
//! dense integers chosen by us, not by an adversary, so a multiplicative hash is enough.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// One integer key through murmur3's 64-bit finalizer: every input bit reaches the low bits, which
/// hashbrown uses for the bucket (ids placed on one of 1000 instances are ~1000 apart, so a plain
/// multiply left their low bits equal and probe chains long).
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        let mut x = self.0 ^ n;
        x ^= x >> 33;
        x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
        x ^= x >> 33;
        x = x.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
        x ^= x >> 33;
        self.0 = x;
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(n as u64);
    }
}

/// A `HashMap` for id keys (`RequestId`, `InstanceId`, transfer ids).
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn strided_keys_spread_over_low_bits() {
        // Keys 1000 apart (one instance's share of round-robin ids) must not share low bits.
        let b = BuildHasherDefault::<IdHasher>::default();
        let mut buckets = [0u32; 64];
        for k in 0..6400u64 {
            buckets[(b.hash_one(k * 1000) & 63) as usize] += 1;
        }
        assert!(buckets.iter().all(|&n| (50..150).contains(&n)), "{buckets:?}");
    }
}
