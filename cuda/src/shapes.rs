//! What one decoder layer and the LM head do for a given batch: the GEMM shapes the GPU runs and
//! their FLOPs and bytes. Pure arithmetic, so it is tested without a GPU and shared by the device
//! code (which launches exactly these GEMMs) and by the reports (achieved TFLOP/s and TB/s).
//!
//! The layer is the one the shipped profile timed (`core/profiles/h100-qwen2.5-32b/README.md`):
//! QKV projection, attention over the KV cache, O projection, a fused gate/up projection, SiLU×mul
//! and the down projection, as four GEMMs `[tokens × k] · [k × n]` with weights `[n × k]` (PyTorch
//! `Linear` layout). Norms, RoPE, the QKV bias and SiLU are small kernels counted as bytes only.

use kvfleet_core::spec::ModelSpec;

/// One GEMM `[m × k] · [k × n]`: `m` tokens through a weight of `n` outputs × `k` inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gemm {
    /// Which projection (`qkv`, `o`, `gate_up`, `down`, `lm_head`).
    pub name: &'static str,
    /// Rows: tokens (or sequences, for the LM head).
    pub m: u64,
    /// Output features.
    pub n: u64,
    /// Input features.
    pub k: u64,
}

impl Gemm {
    /// Multiply-adds counted as two FLOPs.
    pub fn flops(&self) -> u64 {
        2 * self.m * self.n * self.k
    }
    /// Weight elements, `n · k`.
    pub fn weight_params(&self) -> u64 {
        self.n * self.k
    }
    /// Weights read once, activations read and written once, `dtype_bytes` each.
    pub fn bytes(&self, dtype_bytes: u64) -> u64 {
        (self.n * self.k + self.m * self.k + self.m * self.n) * dtype_bytes
    }
}

/// The per-layer widths of a model, in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerShapes {
    /// Decoder layers.
    pub layers: u64,
    /// Hidden size.
    pub hidden: u64,
    /// Query heads.
    pub q_heads: u64,
    /// Key/value heads (grouped-query attention).
    pub kv_heads: u64,
    /// Width of one head.
    pub head_dim: u64,
    /// MLP intermediate size.
    pub intermediate: u64,
    /// Vocabulary size (LM head outputs).
    pub vocab: u64,
    /// Bytes per weight and activation element (2 for bf16).
    pub dtype_bytes: u64,
    /// Whether the QKV projection has a bias.
    pub qkv_bias: bool,
}

/// FLOPs and bytes of one layer (or of the head) for one batch.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Work {
    /// FLOPs of the GEMMs.
    pub gemm_flops: f64,
    /// FLOPs of attention (scores and weighted sum).
    pub attention_flops: f64,
    /// Weights streamed by the GEMMs.
    pub weight_bytes: f64,
    /// KV cache read by attention plus the new tokens' K and V written.
    pub kv_bytes: f64,
}

impl LayerShapes {
    /// The widths of `m`.
    pub fn from_model(m: &ModelSpec) -> LayerShapes {
        LayerShapes {
            layers: m.layers as u64,
            hidden: m.hidden as u64,
            q_heads: m.q_heads as u64,
            kv_heads: m.kv_heads as u64,
            head_dim: m.head_dim as u64,
            intermediate: m.intermediate as u64,
            vocab: m.vocab as u64,
            dtype_bytes: m.dtype_bytes as u64,
            qkv_bias: m.qkv_bias,
        }
    }

    /// Query width `q_heads · head_dim`.
    pub fn q_width(&self) -> u64 {
        self.q_heads * self.head_dim
    }
    /// Key (= value) width `kv_heads · head_dim`.
    pub fn kv_width(&self) -> u64 {
        self.kv_heads * self.head_dim
    }
    /// Query heads sharing one KV head (grouped-query attention).
    pub fn group(&self) -> u64 {
        self.q_heads / self.kv_heads.max(1)
    }
    /// Width of the fused QKV projection's output.
    pub fn qkv_width(&self) -> u64 {
        self.q_width() + 2 * self.kv_width()
    }

    /// The layer's four GEMMs for `tokens` rows, in launch order.
    pub fn layer_gemms(&self, tokens: u64) -> [Gemm; 4] {
        [
            Gemm { name: "qkv", m: tokens, n: self.qkv_width(), k: self.hidden },
            Gemm { name: "o", m: tokens, n: self.hidden, k: self.q_width() },
            Gemm { name: "gate_up", m: tokens, n: 2 * self.intermediate, k: self.hidden },
            Gemm { name: "down", m: tokens, n: self.hidden, k: self.intermediate },
        ]
    }

    /// The LM head over `logits` rows (one per sequence: the last token only).
    pub fn head_gemm(&self, logits: u64) -> Gemm {
        Gemm { name: "lm_head", m: logits, n: self.vocab, k: self.hidden }
    }

    /// GEMM weights of one layer (what [`ModelSpec::layer_params`] adds to these: the QKV bias and
    /// the two norms' scales).
    pub fn layer_gemm_params(&self) -> u64 {
        self.layer_gemms(1).iter().map(Gemm::weight_params).sum()
    }

    /// K and V of one token in one layer.
    pub fn kv_bytes_per_token_per_layer(&self) -> u64 {
        2 * self.kv_width() * self.dtype_bytes
    }

    /// Decode attention of `seqs` sequences holding `context_tokens` tokens in all: every query
    /// head scores every cached token (2·d FLOPs) and sums its value (2·d FLOPs).
    pub fn decode_attention_flops(&self, context_tokens: u64) -> u64 {
        4 * self.q_width() * context_tokens
    }

    /// Causal prefill attention over prompts whose squared lengths sum to `tokens_sq`: half of
    /// the full `4·Hq·d·T²` per prompt.
    pub fn prefill_attention_flops(&self, tokens_sq: u64) -> u64 {
        2 * self.q_width() * tokens_sq
    }

    /// One layer's work for a batch of `decode_seqs` sequences at `decode_context_tokens` cached
    /// tokens in all, plus prompts of `prefill_tokens` tokens (squares summing to `prefill_sq`).
    pub fn layer_work(
        &self,
        decode_seqs: u64,
        decode_context_tokens: u64,
        prefill_tokens: u64,
        prefill_sq: u64,
    ) -> Work {
        let tokens = decode_seqs + prefill_tokens;
        let gemms = self.layer_gemms(tokens);
        Work {
            gemm_flops: gemms.iter().map(|g| g.flops() as f64).sum(),
            attention_flops: (self.decode_attention_flops(decode_context_tokens)
                + self.prefill_attention_flops(prefill_sq)) as f64,
            weight_bytes: (self.layer_gemm_params() * self.dtype_bytes) as f64,
            kv_bytes: (self.kv_bytes_per_token_per_layer() * (decode_context_tokens + tokens)) as f64,
        }
    }

    /// Device memory the live timing allocates for one layer, the head and activations for up to
    /// `max_tokens` rows, a KV cache of `kv_tokens` tokens and `logit_rows` rows of logits.
    pub fn device_bytes(&self, max_tokens: u64, kv_tokens: u64, logit_rows: u64) -> u64 {
        let e = self.dtype_bytes;
        let weights = self.layer_gemm_params() + self.vocab * self.hidden + 3 * self.hidden;
        // x, residual, normed x, qkv, attention out, gate/up, SiLU out.
        let act = max_tokens * (3 * self.hidden + self.qkv_width() + self.q_width() + 3 * self.intermediate);
        (weights + act + kv_tokens * 2 * self.kv_width() + logit_rows * self.vocab) * e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen32b() -> LayerShapes {
        LayerShapes::from_model(&ModelSpec::load("r1-distill-qwen-32b").unwrap())
    }

    /// The 32B shape worked by hand: hidden 5120, 40 × 128 query, 8 × 128 KV, SwiGLU 27648.
    #[test]
    fn qwen32b_gemms_match_hand_numbers() {
        let s = qwen32b();
        let [qkv, o, gate_up, down] = s.layer_gemms(1);
        assert_eq!((qkv.n, qkv.k), (5120 + 2 * 1024, 5120));
        assert_eq!(qkv.weight_params(), 36_700_160);
        assert_eq!(o.weight_params(), 26_214_400);
        assert_eq!(gate_up.weight_params(), 283_115_520);
        assert_eq!(down.weight_params(), 141_557_760);
        assert_eq!(s.layer_gemm_params(), 487_587_840);
        // One layer's weights in bf16: 975 MB, streamed once per iteration at any batch.
        assert_eq!(s.layer_gemm_params() * s.dtype_bytes, 975_175_680);
        // LM head: 152064 × 5120.
        assert_eq!(s.head_gemm(1).weight_params(), 778_567_680);
        assert_eq!(s.head_gemm(4).flops(), 4 * 2 * 778_567_680);
        // KV: 2 × 8 × 128 × 2 B per token per layer; × 64 layers is the spec's 262,144 B.
        assert_eq!(s.kv_bytes_per_token_per_layer(), 4096);
        assert_eq!(s.kv_bytes_per_token_per_layer() * s.layers, 262_144);
        assert_eq!(s.group(), 5);
    }

    #[test]
    fn layer_work_for_decode_and_prefill() {
        let s = qwen32b();
        // Decode: 16 sequences at 2048 tokens each.
        let w = s.layer_work(16, 16 * 2048, 0, 0);
        assert_eq!(w.gemm_flops, 16.0 * 2.0 * 487_587_840.0);
        assert_eq!(w.attention_flops, 4.0 * 5120.0 * 32768.0);
        assert_eq!(w.weight_bytes, 975_175_680.0);
        assert_eq!(w.kv_bytes, 4096.0 * (32768.0 + 16.0));
        // Prefill of one 4096-token prompt: causal attention 2·Hq·d·T².
        let p = s.layer_work(0, 0, 4096, 4096 * 4096);
        assert_eq!(p.attention_flops, 2.0 * 5120.0 * 4096.0 * 4096.0);
        assert_eq!(p.gemm_flops, 4096.0 * 2.0 * 487_587_840.0);
        // Roofline sanity on an H100 (989 TFLOP/s, 3.35 TB/s): batch-1 decode is memory-bound
        // (~0.29 ms per layer, the table reads 0.37 with the small kernels), a 4096 prefill
        // compute-bound (~4.1 ms; the table's layer time is 6.4 ms at ~65 % of peak).
        let mem_ms = w.weight_bytes / 3.35e12 * 1e3;
        assert!((0.28..0.30).contains(&mem_ms), "{mem_ms}");
        let compute_ms = (p.gemm_flops + p.attention_flops) / 989e12 * 1e3;
        assert!((4.0..4.3).contains(&compute_ms), "{compute_ms}");
    }

    /// The GEMM weights plus bias and norms are exactly the spec's per-layer parameter count.
    #[test]
    fn gemm_params_agree_with_the_model_spec() {
        for name in ModelSpec::builtin_names() {
            let m = ModelSpec::load(&name).unwrap();
            let s = LayerShapes::from_model(&m);
            let bias = if m.qkv_bias { s.qkv_width() } else { 0 };
            assert_eq!(s.layer_gemm_params() + bias + 2 * s.hidden, m.layer_params(), "{name}");
            assert_eq!(s.kv_bytes_per_token_per_layer() * s.layers, m.kv_bytes_per_token(), "{name}");
        }
    }

    #[test]
    fn device_bytes_for_the_default_capacity() {
        let s = qwen32b();
        let gib = (1u64 << 30) as f64;
        // 32k activation rows, 256k KV tokens, 1024 logit rows: about 11 GiB on the device.
        let b = s.device_bytes(32_768, 262_144, 1024) as f64 / gib;
        assert!((9.0..13.0).contains(&b), "{b:.2} GiB");
    }
}
