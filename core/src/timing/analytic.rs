//! Analytic roofline timing model: iteration time from model FLOPs and bytes vs GPU peaks.
//!
//! The fallback for any (model, GPU) pair without a measured profile (PASCAL §V uses measured
//! profiles, which [`super::profile`] provides where we have one). One iteration is two
//! kernel families run back to back, each bound by compute or memory, plus a fixed cost:
//!
//! ```text
//! gemm_ms = max(2·P_layers·tokens + 2·vocab·hidden·logits  /  (peak·mfu),
//!               streamed weight bytes                      /  (hbm·mbu))
//! attn_ms = max(4·L·Hq·d·Σcontext + 2·L·Hq·d·ΣT²            /  (peak·mfu),
//!               KV bytes read (Σcontext) + written (new)    /  (hbm·mbu))
//! iter_ms = gemm_ms + attn_ms + layers · overhead_ms_per_layer
//! ```
//!
//! where tokens = decode sequences + prefill tokens (a mixed batch shares one GEMM pass and one
//! weight stream), logits = one per sequence (the LM head runs on the last token only), Σcontext
//! counts the decode sequences' KV and ΣT² the prefill prompts' causal attention (half of 4·T²).
//!
//! **Calibration** (done once; not refitted at run time): grid search of (mfu, mbu, overhead)
//! minimising MAPE over every point of `core/profiles/h100-qwen2.5-32b/` (48 decode + 8 prefill)
//! gave mfu 0.66, mbu 0.95, 4.5 ms per iteration = 0.07 ms × 64 layers (the small kernels —
//! norms, RoPE, SiLU, sampling — that neither bound models). Fitting on every other context column
//! and prompt length and testing on the rest returns the same values with 1.75 % held-out MAPE.
//! Error on the whole table: MAPE 1.9 %, max 10.5 %, worst at batch 128 with short contexts and at
//! 128–256-token prefills, where the GEMMs are neither purely memory- nor compute-bound and a
//! max() underestimates. Charging the overhead per layer rather than per iteration is a choice
//! (kernel count scales with depth); using the same factors on other GPUs is an assumption.
//!
//! Offload and reload: bytes over the GPU spec's `host_link_gbytes_per_s`.
//!
//! **Tensor parallelism** (t GPUs per instance, Megatron-style): every GEMM, attention head and
//! weight byte is split t ways, so the FLOPs, weight bytes and KV bytes above are divided by t
//! per GPU (KV by min(t, KV heads): a KV head is replicated when t exceeds them); the per-layer
//! overhead is not (each GPU runs every kernel). Each layer adds two all-reduces (after attention
//! and after the MLP) of the batch's activations, ring-style: each GPU sends
//! 2(t−1)/t · tokens · hidden · dtype bytes over NVLink (`nvlink_gbytes_per_s`), plus a fixed
//! 10 µs per all-reduce (launch and synchronisation). t = 1 is the single-GPU model unchanged.

use super::profile::TimingError;
use super::{BatchShape, TimingModel};
use crate::spec::{GpuSpec, ModelSpec};
use crate::time::TimeSpan;
use serde::{Deserialize, Serialize};

/// Efficiency factors of the roofline; defaults calibrated on the H100 × Qwen2.5-32B table.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AnalyticParams {
    /// Fraction of peak bf16 tensor throughput reached by GEMMs and attention (0, 1].
    pub mfu: f64,
    /// Fraction of peak HBM bandwidth reached streaming weights and KV (0, 1].
    pub mbu: f64,
    /// Fixed cost per decoder layer per iteration, ms (small kernels outside both bounds).
    pub overhead_ms_per_layer: f64,
}

impl AnalyticParams {
    /// The fit on the H100 × Qwen2.5-32B profile (see the module doc): mfu 0.66, mbu 0.95, 0.07 ms per layer.
    pub const H100_CALIBRATED: AnalyticParams = AnalyticParams { mfu: 0.66, mbu: 0.95, overhead_ms_per_layer: 0.07 };

    fn validate(&self) -> Result<(), TimingError> {
        for (name, value) in [("mfu", self.mfu), ("mbu", self.mbu)] {
            if !(value.is_finite() && value > 0.0 && value <= 1.0) {
                return Err(TimingError::InvalidParam { name, value, message: "must be in (0, 1]".into() });
            }
        }
        let v = self.overhead_ms_per_layer;
        if !(v.is_finite() && v >= 0.0) {
            return Err(TimingError::InvalidParam {
                name: "overhead_ms_per_layer",
                value: v,
                message: "must be a finite number >= 0".into(),
            });
        }
        Ok(())
    }
}

impl Default for AnalyticParams {
    fn default() -> Self {
        Self::H100_CALIBRATED
    }
}

/// Most GPUs one instance may span (tensor parallelism).
pub const MAX_TP: u32 = 64;

/// Fixed cost of one all-reduce, ms (kernel launch and synchronisation; see the module doc).
const ALL_REDUCE_FIXED_MS: f64 = 0.010;

/// The roofline model with every per-shape constant folded at construction.
#[derive(Clone, Debug)]
pub struct AnalyticTiming {
    params: AnalyticParams,
    tp: u32,
    /// NVLink ms per token of activations, summed over a layer's two all-reduces and all layers
    /// (0 at t = 1).
    all_reduce_ms_per_token: f64,
    /// Fixed all-reduce cost per iteration, ms (0 at t = 1).
    all_reduce_fixed_ms: f64,
    gemm_flops_per_token: f64,
    head_flops_per_logit: f64,
    decode_attn_flops_per_context_token: f64,
    prefill_attn_flops_per_token_sq: f64,
    weight_bytes: f64,
    kv_bytes_per_token: f64,
    /// Effective (peak · mfu) FLOPs per millisecond.
    flops_per_ms: f64,
    /// Effective (hbm · mbu) bytes per millisecond.
    bytes_per_ms: f64,
    overhead_ms: f64,
    host_link_bytes_per_s: f64,
}

impl AnalyticTiming {
    /// With the calibrated default parameters.
    pub fn new(model: &ModelSpec, gpu: &GpuSpec) -> Result<AnalyticTiming, TimingError> {
        Self::with_params(model, gpu, AnalyticParams::default())
    }

    /// With explicit efficiency factors; fails on factors out of range or a GPU spec without a
    /// positive compute, HBM or host-link figure.
    pub fn with_params(
        model: &ModelSpec,
        gpu: &GpuSpec,
        params: AnalyticParams,
    ) -> Result<AnalyticTiming, TimingError> {
        Self::with_tp(model, gpu, params, 1)
    }

    /// An instance of `tp` GPUs (tensor parallelism; see the module doc). Fails on `tp` out of
    /// 1..=[`MAX_TP`], one that does not divide the query heads (each GPU holds whole heads), or
    /// `tp` > 1 on a GPU without NVLink.
    pub fn with_tp(
        model: &ModelSpec,
        gpu: &GpuSpec,
        params: AnalyticParams,
        tp: u32,
    ) -> Result<AnalyticTiming, TimingError> {
        params.validate()?;
        check_tp(model, gpu, tp)?;
        for (name, value) in [
            ("gpu.bf16_tflops", gpu.bf16_tflops),
            ("gpu.hbm_tbytes_per_s", gpu.hbm_tbytes_per_s),
            ("gpu.host_link_gbytes_per_s", gpu.host_link_gbytes_per_s),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(TimingError::InvalidParam {
                    name,
                    value,
                    message: format!("GPU `{}` needs a positive figure", gpu.name),
                });
            }
        }
        let (layers, hidden, vocab) = (model.layers as f64, model.hidden as f64, model.vocab as f64);
        let attn_width = layers * model.q_heads as f64 * model.head_dim as f64;
        // Streamed every iteration: all layers, final norm, LM head (the embedding is a gather).
        let streamed_params = layers * model.layer_params() as f64 + vocab * hidden + hidden;
        let t = f64::from(tp);
        // KV heads split t ways, replicated once t exceeds them.
        let kv_split = f64::from(tp.min(model.kv_heads.max(1)));
        let (all_reduce_ms_per_token, all_reduce_fixed_ms) = if tp > 1 {
            let bytes_per_token = 2.0 * (t - 1.0) / t * hidden * model.dtype_bytes as f64;
            let nvlink_bytes_per_ms = gpu.nvlink_gbytes_per_s * 1e9 * 1e-3;
            (2.0 * layers * bytes_per_token / nvlink_bytes_per_ms, 2.0 * layers * ALL_REDUCE_FIXED_MS)
        } else {
            (0.0, 0.0)
        };
        Ok(AnalyticTiming {
            params,
            tp,
            all_reduce_ms_per_token,
            all_reduce_fixed_ms,
            gemm_flops_per_token: 2.0 * layers * model.layer_params() as f64 / t,
            head_flops_per_logit: 2.0 * vocab * hidden / t,
            decode_attn_flops_per_context_token: 4.0 * attn_width / t,
            prefill_attn_flops_per_token_sq: 2.0 * attn_width / t,
            weight_bytes: streamed_params * model.dtype_bytes as f64 / t,
            kv_bytes_per_token: model.kv_bytes_per_token() as f64 / kv_split,
            flops_per_ms: gpu.bf16_tflops * 1e12 * params.mfu * 1e-3,
            bytes_per_ms: gpu.hbm_tbytes_per_s * 1e12 * params.mbu * 1e-3,
            overhead_ms: layers * params.overhead_ms_per_layer,
            host_link_bytes_per_s: gpu.host_link_gbytes_per_s * 1e9,
        })
    }

    /// The efficiency factors in use.
    pub fn params(&self) -> AnalyticParams {
        self.params
    }

    /// GPUs per instance (tensor parallelism).
    pub fn tp(&self) -> u32 {
        self.tp
    }

    /// The fixed per-iteration cost, ms (layers × `overhead_ms_per_layer`).
    pub fn overhead_ms(&self) -> f64 {
        self.overhead_ms
    }

    /// The iteration time in milliseconds (0 for an empty batch).
    #[inline]
    pub fn iteration_ms(&self, s: &BatchShape) -> f64 {
        if s.is_empty() {
            return 0.0;
        }
        let tokens = s.decode_seqs as f64 + s.prefill_tokens as f64;
        let logits = s.decode_seqs as f64 + s.prefill_seqs as f64;
        let gemm_flops = self.gemm_flops_per_token * tokens + self.head_flops_per_logit * logits;
        let gemm_ms = (gemm_flops / self.flops_per_ms).max(self.weight_bytes / self.bytes_per_ms);
        let ctx = s.decode_context_tokens as f64;
        let attn_flops = self.decode_attn_flops_per_context_token * ctx
            + self.prefill_attn_flops_per_token_sq * s.prefill_tokens_sq as f64;
        let kv_bytes = self.kv_bytes_per_token * (ctx + s.decode_seqs as f64 + s.prefill_tokens as f64);
        let attn_ms = (attn_flops / self.flops_per_ms).max(kv_bytes / self.bytes_per_ms);
        let all_reduce_ms = self.all_reduce_ms_per_token * tokens + self.all_reduce_fixed_ms;
        gemm_ms + attn_ms + all_reduce_ms + self.overhead_ms
    }
}

/// `tp` GPUs can serve `model` on `gpu` (see [`AnalyticTiming::with_tp`]).
pub fn check_tp(model: &ModelSpec, gpu: &GpuSpec, tp: u32) -> Result<(), TimingError> {
    let invalid = |message: String| TimingError::InvalidParam { name: "tp", value: f64::from(tp), message };
    if !(1..=MAX_TP).contains(&tp) {
        return Err(invalid(format!("GPUs per instance must be in 1..={MAX_TP}")));
    }
    if !model.q_heads.is_multiple_of(tp) {
        return Err(invalid(format!("must divide model `{}`'s {} attention heads", model.name, model.q_heads)));
    }
    if tp > 1 && gpu.nvlink_gbytes_per_s <= 0.0 {
        return Err(invalid(format!(
            "GPU `{}` has no NVLink (`nvlink_gbytes_per_s` = 0): tensor parallelism needs one",
            gpu.name
        )));
    }
    Ok(())
}

impl TimingModel for AnalyticTiming {
    fn name(&self) -> &str {
        "analytic"
    }
    fn iteration(&self, batch: &BatchShape) -> TimeSpan {
        TimeSpan::from_millis_f64(self.iteration_ms(batch))
    }
    fn offload(&self, bytes: u64) -> TimeSpan {
        TimeSpan::from_secs_f64(bytes as f64 / self.host_link_bytes_per_s)
    }
    fn reload(&self, bytes: u64) -> TimeSpan {
        TimeSpan::from_secs_f64(bytes as f64 / self.host_link_bytes_per_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timing::profile::ProfileTiming;

    fn qwen32b_h100() -> AnalyticTiming {
        AnalyticTiming::new(&ModelSpec::load("r1-distill-qwen-32b").unwrap(), &GpuSpec::load("h100-80gb").unwrap())
            .unwrap()
    }

    fn decode(b: u32, ctx: u32) -> BatchShape {
        BatchShape { decode_seqs: b, decode_context_tokens: b as u64 * ctx as u64, ..Default::default() }
    }

    fn prefill(tokens: u32) -> BatchShape {
        let mut s = BatchShape::default();
        s.add_prefill(tokens);
        s
    }

    /// The calibration claim in the module doc, against every point of the embedded table.
    #[test]
    fn within_measured_error_of_the_h100_table() {
        let a = qwen32b_h100();
        let p = ProfileTiming::builtin_h100_qwen32b();
        let mut errs: Vec<f64> = p
            .decode_points()
            .iter()
            .map(|d| (a.iteration_ms(&decode(d.batch, d.context)) / d.iter_ms - 1.0).abs())
            .collect();
        errs.extend(p.prefill_points().iter().map(|q| (a.iteration_ms(&prefill(q.tokens)) / q.iter_ms - 1.0).abs()));
        let mape = 100.0 * errs.iter().sum::<f64>() / errs.len() as f64;
        let max = 100.0 * errs.iter().copied().fold(0.0, f64::max);
        // Measured: MAPE 1.90 %, max 10.5 %.
        assert!(mape < 2.5, "MAPE {mape:.2} %");
        assert!(max < 12.0, "max {max:.1} %");
    }

    #[test]
    fn decode_is_memory_bound_and_long_prefill_compute_bound() {
        let a = qwen32b_h100();
        // Batch 1: weights (64 GB) over 0.95 · 3.35 TB/s plus the overhead.
        let expect = 63.97e9 / (3.35e12 * 0.95) * 1e3 + 64.0 * 0.07;
        assert!((a.iteration_ms(&decode(1, 1)) - expect).abs() < 0.1, "{}", a.iteration_ms(&decode(1, 1)));
        // Long prompts: time grows faster than linearly (causal attention is quadratic).
        let (t8, t16) = (a.iteration_ms(&prefill(8192)), a.iteration_ms(&prefill(16384)));
        assert!(t16 > 2.0 * t8, "{t8} {t16}");
        // Two prompts of 8192 cost less than one of 16384 (attention is per prompt).
        let mut two = prefill(8192);
        two.add_prefill(8192);
        assert!(a.iteration_ms(&two) < t16);
    }

    #[test]
    fn mixed_batch_costs_at_least_each_part_and_less_than_both() {
        let a = qwen32b_h100();
        let (d, p) = (decode(32, 1024), prefill(512));
        let mixed = BatchShape { prefill_seqs: 1, prefill_tokens: 512, prefill_tokens_sq: 512 * 512, ..d };
        let (td, tp, tm) = (a.iteration_ms(&d), a.iteration_ms(&p), a.iteration_ms(&mixed));
        assert!(tm >= td.max(tp) && tm < td + tp, "decode {td} prefill {tp} mixed {tm}");
        assert_eq!(a.iteration(&BatchShape::default()), TimeSpan::ZERO);
    }

    /// TP t divides every roofline term by t (the per-layer overhead excepted) and adds two
    /// ring all-reduces per layer over NVLink, computed here by hand.
    #[test]
    fn tensor_parallel_splits_the_roofline_and_adds_two_all_reduces_per_layer() {
        let (model, gpu) = (ModelSpec::load("llama-3.1-70b").unwrap(), GpuSpec::load("h20-141gb").unwrap());
        let one = AnalyticTiming::new(&model, &gpu).unwrap();
        let same = AnalyticTiming::with_tp(&model, &gpu, AnalyticParams::default(), 1).unwrap();
        for tp in [2u32, 4, 8] {
            let split = AnalyticTiming::with_tp(&model, &gpu, AnalyticParams::default(), tp).unwrap();
            assert_eq!(split.tp(), tp);
            for shape in [prefill(4096), decode(64, 3000), decode(1, 100)] {
                let tokens = f64::from(shape.decode_seqs) + shape.prefill_tokens as f64;
                let t = f64::from(tp);
                // Each GPU sends 2(t-1)/t of a layer's activations twice per layer, + 10 µs each.
                let ring_bytes = 2.0 * (t - 1.0) / t * tokens * model.hidden as f64 * 2.0;
                let all_reduce = 2.0 * model.layers as f64 * (ring_bytes / (900e9 * 1e-3) + 0.010);
                let overhead = one.overhead_ms();
                let expect = (one.iteration_ms(&shape) - overhead) / t + overhead + all_reduce;
                let got = split.iteration_ms(&shape);
                assert!((got - expect).abs() < 1e-9 * expect, "tp {tp} {shape:?}: {got} vs {expect}");
                assert_eq!(same.iteration_ms(&shape), one.iteration_ms(&shape));
            }
        }
        // A batch-1 decode streams the weights: TP 2 is faster, not twice as fast.
        let two = AnalyticTiming::with_tp(&model, &gpu, AnalyticParams::default(), 2).unwrap();
        let (t1, t2) = (one.iteration_ms(&decode(1, 100)), two.iteration_ms(&decode(1, 100)));
        assert!(t2 < t1 && t2 > 0.5 * t1, "{t1} -> {t2}");
    }

    #[test]
    fn tensor_parallel_degrees_that_cannot_run_are_refused_by_name() {
        let (model, gpu) = (ModelSpec::load("qwen3-32b").unwrap(), GpuSpec::load("h20-141gb").unwrap());
        let err = |m: &ModelSpec, g: &GpuSpec, tp| {
            AnalyticTiming::with_tp(m, g, AnalyticParams::default(), tp).unwrap_err().to_string()
        };
        assert!(err(&model, &gpu, 0).contains("1..=64"), "{}", err(&model, &gpu, 0));
        assert!(err(&model, &gpu, 128).contains("1..=64"));
        assert!(err(&model, &gpu, 3).contains("64 attention heads"), "{}", err(&model, &gpu, 3));
        let l40s = GpuSpec::load("l40s").unwrap();
        assert!(err(&model, &l40s, 2).contains("no NVLink"), "{}", err(&model, &l40s, 2));
        assert!(AnalyticTiming::with_tp(&model, &l40s, AnalyticParams::default(), 1).is_ok());
    }

    #[test]
    fn smaller_model_and_faster_gpu_are_faster() {
        let gpu = GpuSpec::load("h100-80gb").unwrap();
        let big = qwen32b_h100().iteration_ms(&decode(16, 2048));
        let small =
            AnalyticTiming::new(&ModelSpec::load("llama-3-8b").unwrap(), &gpu).unwrap().iteration_ms(&decode(16, 2048));
        let fast =
            AnalyticTiming::new(&ModelSpec::load("r1-distill-qwen-32b").unwrap(), &GpuSpec::load("h100-96gb").unwrap())
                .unwrap()
                .iteration_ms(&decode(16, 2048));
        assert!(small < 0.5 * big, "{small} vs {big}");
        assert!(fast < big && fast > 0.8 * big, "{fast} vs {big}");
    }

    #[test]
    fn transfers_are_bytes_over_the_host_link() {
        let a = qwen32b_h100();
        let gib = 1u64 << 30;
        assert_eq!(a.offload(gib), TimeSpan::from_secs_f64(gib as f64 / 53e9));
        assert_eq!(a.reload(gib), a.offload(gib));
        assert_eq!(a.offload(0), TimeSpan::ZERO);
    }

    #[test]
    fn invalid_parameters_are_named() {
        let (m, g) = (ModelSpec::load("qwen-7b").unwrap(), GpuSpec::load("l40s").unwrap());
        for (params, name) in [
            (AnalyticParams { mfu: 0.0, ..Default::default() }, "mfu"),
            (AnalyticParams { mbu: 1.5, ..Default::default() }, "mbu"),
            (AnalyticParams { overhead_ms_per_layer: f64::NAN, ..Default::default() }, "overhead_ms_per_layer"),
        ] {
            let e = AnalyticTiming::with_params(&m, &g, params).unwrap_err().to_string();
            assert!(e.contains(name), "{e}");
        }
        let bad_gpu = GpuSpec { hbm_tbytes_per_s: 0.0, ..g };
        assert!(AnalyticTiming::new(&m, &bad_gpu).unwrap_err().to_string().contains("hbm_tbytes_per_s"));
        let p: AnalyticParams = toml::from_str("mfu = 0.5").unwrap();
        assert_eq!(p, AnalyticParams { mfu: 0.5, ..AnalyticParams::H100_CALIBRATED });
    }
}
