//! Quantized batch signatures: which measurement an iteration shape reuses.
//!
//! Timing a shape on the GPU costs a few layer runs (milliseconds for decode, up to a second for a
//! long prefill), so results are cached by a signature that rounds each dimension to a geometric
//! grid: values up to `2^bits` are exact, larger ones keep their `bits + 1` leading binary
//! digits (relative step 2^-bits, rounding error at most half that: 1.6 % at the default 5 bits).
//! The number of distinct signatures then grows with the logarithm of each range, not the range:
//! a worker sees at most a few thousand over a whole run.
//!
//! A [`BatchShape`] holds sums, not per-sequence lengths, so the signature keeps what the cost
//! depends on: decode sequences and their mean context (the KV read is linear in the sum), and
//! the prompts as `count` prompts of one length `tokens_sq / tokens` (which preserves both the
//! prompt tokens, for the GEMMs, and the sum of squares, for causal attention, when the prompts
//! are equal). [`BatchSignature::representative`] is the shape actually timed.

use kvfleet_core::timing::BatchShape;

/// Rounds `x` to the nearest value with at most `bits + 1` significant binary digits (exact up to
/// `2^(bits+1)`); ties round up. Monotone, idempotent, and never 0 for `x > 0`.
pub fn quantize(x: u64, bits: u32) -> u64 {
    let bits = bits.clamp(1, 62);
    if x < (1u64 << (bits + 1)) {
        return x;
    }
    let shift = 64 - x.leading_zeros() - (bits + 1);
    let half = 1u64 << (shift - 1);
    // Round half up; the carry can add one digit (e.g. 0b11111 → 0b100000), still on the grid.
    ((x >> shift) + ((x & ((1u64 << shift) - 1)) >= half) as u64) << shift
}

/// A cache key: the representative batch of every shape that rounds to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BatchSignature {
    /// Decoding sequences (one new token each).
    pub decode_seqs: u32,
    /// Mean context per decoding sequence (counting the new token).
    pub decode_context: u32,
    /// Prompts in the representative batch, each `prompt_len` tokens.
    pub prompts: u32,
    /// Tokens per prompt.
    pub prompt_len: u32,
}

impl BatchSignature {
    /// The signature of `shape`: decode count and mean context, prompt count and length, each
    /// rounded with [`quantize`] at `bits`.
    pub fn of(shape: &BatchShape, bits: u32) -> BatchSignature {
        let q = |x: u64| quantize(x, bits).min(u32::MAX as u64) as u32;
        let (decode_seqs, decode_context) = if shape.decode_seqs == 0 {
            (0, 0)
        } else {
            let mean = (shape.decode_context_tokens as f64 / shape.decode_seqs as f64).round() as u64;
            (q(shape.decode_seqs as u64), q(mean.max(1)))
        };
        let (prompts, prompt_len) = if shape.prefill_seqs == 0 || shape.prefill_tokens == 0 {
            (0, 0)
        } else {
            let t = shape.prefill_tokens as f64;
            // Equal prompts of length L = Σt²/Σt keep both Σt (with count Σt/L) and Σt².
            let sq = (shape.prefill_tokens_sq as f64).max(t);
            let len = (sq / t).round().max(1.0) as u64;
            let count = (t / len as f64).round().max(1.0) as u64;
            (q(count), q(len))
        };
        BatchSignature { decode_seqs, decode_context, prompts, prompt_len }
    }

    /// Whether the batch does nothing (no decoding sequence, no prompt).
    pub fn is_empty(&self) -> bool {
        self.decode_seqs == 0 && self.prompts == 0
    }

    /// Rows through the GEMMs: one per decoding sequence plus every prompt token.
    pub fn tokens(&self) -> u64 {
        self.decode_seqs as u64 + self.prompts as u64 * self.prompt_len as u64
    }

    /// Rows through the LM head: one per sequence.
    pub fn logit_rows(&self) -> u64 {
        self.decode_seqs as u64 + self.prompts as u64
    }

    /// The shape that is timed for this signature.
    pub fn representative(&self) -> BatchShape {
        let mut s = BatchShape {
            decode_seqs: self.decode_seqs,
            decode_context_tokens: self.decode_seqs as u64 * self.decode_context as u64,
            ..Default::default()
        };
        for _ in 0..self.prompts {
            s.add_prefill(self.prompt_len);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantize_is_exact_when_small_and_bounded_when_large() {
        for x in 0..64 {
            assert_eq!(quantize(x, 5), x);
        }
        assert_eq!(quantize(64, 5), 64);
        assert_eq!(quantize(65, 5), 66); // grid step 2 in [64, 128): ties round up
        assert_eq!(quantize(1000, 5), 1008); // step 16 in [512, 1024)
        assert_eq!(quantize(1023, 5), 1024);
        assert_eq!(quantize(16384, 5), 16384);
        let mut prev = 0;
        for x in 1..200_000u64 {
            let q = quantize(x, 5);
            let rel = (q as f64 - x as f64).abs() / x as f64;
            assert!(rel <= 1.0 / 64.0 + 1e-12, "{x} -> {q} ({rel})");
            assert_eq!(quantize(q, 5), q, "not idempotent at {x}");
            assert!(q >= prev, "not monotone at {x}");
            prev = q;
        }
    }

    #[test]
    fn distinct_values_grow_logarithmically() {
        let mut seen: Vec<u64> = (1..=1_000_000u64).map(|x| quantize(x, 5)).collect();
        seen.dedup();
        // 64 exact values, then 32 per octave from 64 to 2^20: 64 + 14·32 (+1 for the top carry).
        assert!(seen.len() <= 64 + 14 * 32 + 1, "{}", seen.len());
        assert!(seen.len() >= 64 + 13 * 32, "{}", seen.len());
    }

    #[test]
    fn decode_signature_uses_the_mean_context() {
        let mut a = BatchShape::default();
        for c in [1000, 3000] {
            a.add_decode(c);
        }
        let sig = BatchSignature::of(&a, 5);
        assert_eq!((sig.decode_seqs, sig.decode_context), (2, quantize(2000, 5) as u32));
        assert_eq!(sig.representative().decode_context_tokens, 2 * quantize(2000, 5));
        // Shapes within the rounding share a signature; far-apart ones do not.
        let mut b = BatchShape::default();
        b.add_decode(2001);
        b.add_decode(2003);
        assert_eq!(BatchSignature::of(&b, 5), sig);
        let mut c = BatchShape::default();
        c.add_decode(4000);
        c.add_decode(4000);
        assert_ne!(BatchSignature::of(&c, 5), sig);
    }

    #[test]
    fn prefill_signature_keeps_tokens_and_squares_for_equal_prompts() {
        let mut s = BatchShape::default();
        for _ in 0..3 {
            s.add_prefill(512);
        }
        s.add_decode(100);
        let sig = BatchSignature::of(&s, 5);
        assert_eq!((sig.prompts, sig.prompt_len, sig.decode_seqs, sig.decode_context), (3, 512, 1, 100));
        let r = sig.representative();
        assert_eq!((r.prefill_tokens, r.prefill_tokens_sq), (s.prefill_tokens, s.prefill_tokens_sq));
        assert_eq!(sig.tokens(), 3 * 512 + 1);
        assert_eq!(sig.logit_rows(), 4);
        // Unequal prompts: one of 3000 and one of 1000 → Σt²/Σt = 2500, count round(4000/2500) = 2.
        let mut u = BatchShape::default();
        u.add_prefill(3000);
        u.add_prefill(1000);
        let sig = BatchSignature::of(&u, 5);
        assert_eq!((sig.prompts, sig.prompt_len), (2, quantize(2500, 5) as u32));
        assert!(BatchSignature::of(&BatchShape::default(), 5).is_empty());
    }

    #[test]
    fn rounding_error_of_the_representative_is_bounded() {
        for (b, ctx, prompt) in [(1, 128, 0), (7, 3001, 0), (100, 777, 0), (0, 0, 5000), (33, 1500, 1234)] {
            let mut s = BatchShape::default();
            for _ in 0..b {
                s.add_decode(ctx);
            }
            if prompt > 0 {
                s.add_prefill(prompt);
            }
            let r = BatchSignature::of(&s, 5).representative();
            let rel = |a: u64, b: u64| if b == 0 { (a as f64).abs() } else { (a as f64 / b as f64 - 1.0).abs() };
            assert!(rel(r.decode_context_tokens, s.decode_context_tokens) < 0.035, "{s:?} -> {r:?}");
            assert!(rel(r.prefill_tokens, s.prefill_tokens) < 0.02, "{s:?} -> {r:?}");
            assert!(rel(r.prefill_tokens_sq, s.prefill_tokens_sq) < 0.04, "{s:?} -> {r:?}");
        }
    }
}
