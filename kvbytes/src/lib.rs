//! The byte loops under every KV write, check and migration: a token slot's deterministic
//! content ([`fill_token`]), the search for the first byte that differs from it
//! ([`first_difference`]) and a block's 64-bit [`Digest`].
//!
//! They live in their own crate so that the workspace's `Cargo.toml` can compile this one crate
//! optimised in debug builds too: unoptimised, these loops move ~0.1 GB/s instead of 5–15 GB/s,
//! and a debug worker filling and checksumming real-sized KV (256 KiB per token) falls tens of
//! seconds behind its modelled iterations, so the real-process tests would measure the build, not
//! the emulator. The entry points are plain (not `#[inline]`) functions, so they are compiled here,
//! at this crate's optimisation level, rather than in their callers.

/// The golden-ratio constant of splitmix64.
pub const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// splitmix64's output function (Steele et al., "Fast splittable pseudorandom number generators").
#[inline(always)]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A token's byte stream: four xorshift64 lanes seeded by splitmix64, emitted 32 bytes at a time
/// (lane 0's word, lane 1's, ...). Independent lanes let the compiler vectorise the fill: ~15 GB/s
/// on one core in optimised builds, so writing a 256 KiB token costs ~20 µs.
#[derive(Clone, Copy)]
struct TokenStream {
    lanes: [u64; 4],
}

impl TokenStream {
    #[inline]
    fn new(seed: u64) -> Self {
        // `| 1`: an xorshift state must never be zero.
        TokenStream { lanes: [mix64(seed ^ 1) | 1, mix64(seed ^ 2) | 1, mix64(seed ^ 3) | 1, mix64(seed ^ 4) | 1] }
    }
    /// The next 32 bytes, as four little-endian words.
    #[inline(always)]
    fn next_words(&mut self) -> [u64; 4] {
        for s in &mut self.lanes {
            *s ^= *s << 13;
            *s ^= *s >> 7;
            *s ^= *s << 17;
        }
        self.lanes
    }
}

const CHUNK: usize = 32;

/// Fill `dst` with the content of the token seeded `seed` (any length; a partial last chunk is cut).
pub fn fill_token(dst: &mut [u8], seed: u64) {
    let mut stream = TokenStream::new(seed);
    let mut chunks = dst.chunks_exact_mut(CHUNK);
    for c in &mut chunks {
        let w = stream.next_words();
        for k in 0..4 {
            c[k * 8..k * 8 + 8].copy_from_slice(&w[k].to_le_bytes());
        }
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let bytes = words_bytes(stream.next_words());
        rest.copy_from_slice(&bytes[..rest.len()]);
    }
}

#[inline]
fn words_bytes(w: [u64; 4]) -> [u8; CHUNK] {
    let mut out = [0u8; CHUNK];
    for k in 0..4 {
        out[k * 8..k * 8 + 8].copy_from_slice(&w[k].to_le_bytes());
    }
    out
}

/// The first byte of `src` that is not the content of the token seeded `seed`, as
/// (offset, expected, found); `None` when every byte matches.
pub fn first_difference(src: &[u8], seed: u64) -> Option<(u64, u8, u8)> {
    let mut stream = TokenStream::new(seed);
    let mut chunks = src.chunks_exact(CHUNK);
    let mut at = 0usize;
    for c in &mut chunks {
        let w = stream.next_words();
        // Word compares (vectorisable, no early exit per byte); locate the byte only on a miss.
        let mut diff = 0u64;
        for k in 0..4 {
            diff |= u64::from_le_bytes(c[k * 8..k * 8 + 8].try_into().expect("8-byte word")) ^ w[k];
        }
        if diff != 0 {
            return byte_difference(c, &words_bytes(w), at);
        }
        at += CHUNK;
    }
    let rest = chunks.remainder();
    byte_difference(rest, &words_bytes(stream.next_words())[..rest.len()], at)
}

fn byte_difference(have: &[u8], want: &[u8], at: usize) -> Option<(u64, u8, u8)> {
    (0..have.len()).find(|&k| have[k] != want[k]).map(|k| ((at + k) as u64, want[k], have[k]))
}

/// A 64-bit digest over bytes fed in pieces: four independent multiply-rotate lanes over 8-byte
/// words (fast enough for 4 MiB blocks), then splitmix64 over the lanes and the length.
#[derive(Clone, Debug)]
pub struct Digest {
    lanes: [u64; 4],
    len: u64,
}

impl Default for Digest {
    fn default() -> Self {
        Digest { lanes: [GOLDEN, GOLDEN ^ 1, GOLDEN ^ 2, GOLDEN ^ 3], len: 0 }
    }
}

impl Digest {
    /// An empty digest.
    pub fn new() -> Self {
        Self::default()
    }
    #[inline(always)]
    fn lane(h: u64, w: u64) -> u64 {
        (h ^ w).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(29)
    }
    /// Feed `bytes`. Pieces are not concatenated: a piece's trailing bytes (its length mod 32)
    /// go into the lanes one by one, so the digest depends on how the input is cut.
    pub fn update(&mut self, bytes: &[u8]) {
        self.len += bytes.len() as u64;
        let mut chunks = bytes.chunks_exact(32);
        for c in &mut chunks {
            for (k, lane) in self.lanes.iter_mut().enumerate() {
                let w = u64::from_le_bytes(c[k * 8..k * 8 + 8].try_into().expect("8-byte chunk"));
                *lane = Self::lane(*lane, w);
            }
        }
        for (k, &b) in chunks.remainder().iter().enumerate() {
            self.lanes[k % 4] = Self::lane(self.lanes[k % 4], b as u64);
        }
    }
    /// The digest of everything fed so far.
    pub fn finish(&self) -> u64 {
        let mut h = self.len;
        for &l in &self.lanes {
            h = mix64(h ^ l);
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filled_token_verifies_and_a_flipped_byte_is_found_where_it_is() {
        for len in [0usize, 1, 31, 32, 33, 100, 4096 + 7] {
            let mut buf = vec![0u8; len];
            fill_token(&mut buf, 42);
            assert_eq!(first_difference(&buf, 42), None, "len {len}");
            if len > 0 {
                let at = len * 2 / 3;
                buf[at] ^= 0x40;
                let (off, want, have) = first_difference(&buf, 42).expect("a flipped byte");
                assert_eq!((off, want ^ have), (at as u64, 0x40), "len {len}");
                assert!(first_difference(&buf[..at], 42).is_none(), "the bytes before it still match");
            }
        }
        // Another seed, another content.
        let mut a = vec![0u8; 64];
        fill_token(&mut a, 1);
        assert!(first_difference(&a, 2).is_some());
    }

    #[test]
    fn the_fill_is_a_prefix_of_a_longer_fill() {
        // A stamp (the first bytes of a slot) is the start of the full fill.
        let mut full = vec![0u8; 256];
        let mut stamp = vec![0u8; 64];
        fill_token(&mut full, 9);
        fill_token(&mut stamp, 9);
        assert_eq!(&full[..64], &stamp[..]);
    }

    #[test]
    fn the_digest_sees_every_byte_and_the_length() {
        let mut bytes = vec![0u8; 1000];
        fill_token(&mut bytes, 5);
        let digest = |b: &[u8]| {
            let mut d = Digest::new();
            d.update(b);
            d.finish()
        };
        let base = digest(&bytes);
        assert_eq!(base, digest(&bytes), "deterministic");
        for at in [0, 31, 32, 999] {
            let mut b = bytes.clone();
            b[at] ^= 1;
            assert_ne!(digest(&b), base, "byte {at}");
        }
        assert_ne!(digest(&bytes[..999]), base, "length");
        assert_ne!(Digest::new().finish(), digest(&[0]), "one zero byte is not nothing");
    }
}
