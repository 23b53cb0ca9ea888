//! Profile-table timing model: interpolation over measured per-iteration times.
//!
//! PASCAL §V ("Simulation framework") drives its single-instance simulator from vLLM profiling
//! data; this is ours: `decode.csv` (batch × context), `prefill.csv` (tokens) and `copy.csv`
//! (host↔device rates), as written by the profiler in `scripts/`. The H100-80GB table for the
//! Qwen2.5-32B shape (PASCAL's R1-Distill-Qwen-32B) is embedded, so the default needs no files.
//!
//! Each interpolation choice was measured on held-out table points ([`holdout`]):
//! - **decode**: piecewise linear in context within a batch row (KV bytes read are linear in
//!   context), then linear in batch between rows (GEMM work and KV bytes are linear in batch).
//!   Interpolating in log2(batch) instead had 2.2 % leave-one-out error against 0.4 % and is not
//!   used. The query context is the batch mean, `decode_context_tokens / decode_seqs`: exact for
//!   the KV term, which depends only on the sum.
//! - **missing cells** (memory-limited, absent from the grid): filled along their row by linear
//!   extrapolation of the row's last two measured contexts (held-out error < 1 %); a row with a
//!   single cell borrows the nearest row's context slope scaled by the batch ratio.
//! - **beyond the grid**: the edge segment extended linearly; a batch below the smallest row uses
//!   that row; no result is negative.
//! - **prefill**: piecewise linear in tokens after removing a fitted causal-attention term c·T²
//!   (least squares over the points ≥ [`QUADRATIC_FIT_MIN_TOKENS`]), added back as c·ΣTᵢ². A
//!   single prompt reproduces the table; several prompts in one iteration pay attention per prompt
//!   rather than on their sum — modelled, not measured (the table holds single prompts only).
//! - **mixed prefill + decode**: the linear layers run as one GEMM over every token, so the
//!   iteration costs a prefill of (prefill tokens + decode sequences) tokens plus the decode
//!   attention, `decode(b, c̄) − decode(b, 0)` (the row extended to zero context). Adding the two
//!   tables' times would count the weight stream (≈ 20 of the 24 ms at batch 1) twice, and
//!   subtracting only the shared head (`meta.json` head_ms ≈ 0.6 ms) would not remove it. The
//!   result is never below either part alone.
//! - **offload / reload**: bytes over the D2H / H2D rate measured at the largest copy size.

pub mod holdout;
pub mod registry;
pub mod table;

pub use holdout::{holdout_report, HoldoutReport};
pub use registry::{build_timing, TIMING_KINDS};
pub use table::{CopyDirection, CopyPoint, DecodePoint, PrefillPoint};

use super::{BatchShape, TimingModel};
use crate::spec::{ModelSpec, SpecError};
use crate::time::TimeSpan;
use std::path::Path;

/// Errors from building a timing model: bad tables, bad parameters, unknown kinds.
#[derive(Debug, thiserror::Error)]
pub enum TimingError {
    /// A value or column of a profile CSV could not be read.
    #[error("{file}:{line}: `{field}`: {message}")]
    Parse {
        /// The CSV file.
        file: String,
        /// 1-based line number.
        line: usize,
        /// The column.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// A profile table is unusable as a whole (empty, too few points, missing rates).
    #[error("{file}: {message}")]
    Table {
        /// The CSV file.
        file: String,
        /// What is wrong.
        message: String,
    },
    /// A profile file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A timing parameter or GPU figure is out of range.
    #[error("invalid timing parameter `{name}` = {value}: {message}")]
    InvalidParam {
        /// The parameter (e.g. `mfu`, `gpu.bf16_tflops`).
        name: &'static str,
        /// Its value.
        value: f64,
        /// The allowed range or why it is refused.
        message: String,
    },
    /// No timing model has this name.
    #[error("unknown timing model `{kind}` (valid: {valid})")]
    UnknownKind {
        /// The name asked for.
        kind: String,
        /// The accepted names, comma-separated.
        valid: String,
    },
    /// The profile model was asked for a (model, GPU) pair without a built-in measured profile.
    #[error("no built-in timing profile for {what}; use `--timing analytic` or give a profile directory holding decode.csv, prefill.csv and copy.csv")]
    NoProfile {
        /// The (model, GPU) pair asked for.
        what: String,
    },
    /// The model or GPU spec could not be loaded.
    #[error(transparent)]
    Spec(#[from] SpecError),
}

/// Prefill points at or above this many tokens fit the causal-attention coefficient: well past the
/// H100's bf16 ridge point (≈ 300 tokens, 989 TFLOP/s ÷ 3.35 TB/s), where time is compute-bound.
pub const QUADRATIC_FIT_MIN_TOKENS: u32 = 1024;

const BUILTIN_DECODE: &str = include_str!("../../profiles/h100-qwen2.5-32b/decode.csv");
const BUILTIN_PREFILL: &str = include_str!("../../profiles/h100-qwen2.5-32b/prefill.csv");
const BUILTIN_COPY: &str = include_str!("../../profiles/h100-qwen2.5-32b/copy.csv");
/// Where the embedded table came from (also shown in reports).
pub const BUILTIN_SOURCE: &str = "builtin:h100-qwen2.5-32b (NVIDIA H100 80GB HBM3, 2026-11-23)";

/// `w`-weighted blend written so that w = 0 and w = 1 return the end values exactly.
#[inline]
fn lerp(x: f64, x0: f64, y0: f64, x1: f64, y1: f64) -> f64 {
    let w = (x - x0) / (x1 - x0);
    y0 * (1.0 - w) + y1 * w
}

/// `(j, w)` with `1 <= j < xs.len()` such that `x ≈ xs[j-1]·(1-w) + xs[j]·w`: the segment holding
/// `x`, or the edge segment (w outside [0, 1]) beyond the ends. Exact at every `xs[k]` (w = 0, or
/// w = 1 at the last). Counts rather than branches: the tables are a handful of entries and the
/// queries arrive in no order, so a branch-free count beats a binary search here.
#[inline]
fn bracket(xs: &[f64], x: f64) -> (usize, f64) {
    let below = xs.iter().fold(0usize, |n, &v| n + (v <= x) as usize);
    let j = below.clamp(1, xs.len() - 1);
    (j, (x - xs[j - 1]) / (xs[j] - xs[j - 1]))
}

/// Decode times on a dense (batch × context) grid, missing cells filled at build time.
#[derive(Clone, Debug)]
struct DecodeGrid {
    batches: Vec<f64>,
    contexts: Vec<f64>,
    /// Row-major `[batch][context]`.
    values_ms: Vec<f64>,
    /// Each row's first segment extended to context 0: the decode cost without attention.
    zero_context_ms: Vec<f64>,
}

impl DecodeGrid {
    fn build(file: &str, points: &[DecodePoint]) -> Result<Self, TimingError> {
        let mut bs: Vec<u32> = points.iter().map(|p| p.batch).collect();
        let mut cs: Vec<u32> = points.iter().map(|p| p.context).collect();
        bs.sort_unstable();
        bs.dedup();
        cs.sort_unstable();
        cs.dedup();
        let (nb, nc) = (bs.len(), cs.len());
        if nb == 0 {
            return Err(TimingError::Table { file: file.into(), message: "no decode points".into() });
        }
        let mut measured = vec![None; nb * nc];
        for p in points {
            if let (Ok(i), Ok(j)) = (bs.binary_search(&p.batch), cs.binary_search(&p.context)) {
                measured[i * nc + j] = Some(p.iter_ms);
            }
        }
        let contexts: Vec<f64> = cs.iter().map(|&c| c as f64).collect();
        let batches: Vec<f64> = bs.iter().map(|&b| b as f64).collect();
        let mut values_ms = vec![f64::NAN; nb * nc];
        let mut filled = vec![false; nb];
        for i in 0..nb {
            let row = &measured[i * nc..(i + 1) * nc];
            let avail: Vec<usize> = (0..nc).filter(|&j| row[j].is_some()).collect();
            if nc == 1 {
                values_ms[i] = row[0].unwrap_or(f64::NAN);
                filled[i] = true;
            } else if avail.len() >= 2 {
                for j in 0..nc {
                    values_ms[i * nc + j] = match row[j] {
                        Some(v) => v,
                        None => {
                            let p = avail.partition_point(|&a| a < j).clamp(1, avail.len() - 1);
                            let (a, b) = (avail[p - 1], avail[p]);
                            lerp(contexts[j], contexts[a], row[a].unwrap_or(0.0), contexts[b], row[b].unwrap_or(0.0))
                        }
                    };
                }
                filled[i] = true;
            }
        }
        if !filled.iter().any(|&f| f) {
            return Err(TimingError::Table {
                file: file.into(),
                message: "needs at least one batch size measured at two or more contexts".into(),
            });
        }
        // Rows with a single measured cell: the nearest full row's context slope, scaled by batch.
        for i in 0..nb {
            if filled[i] {
                continue;
            }
            let Some(j0) = (0..nc).find(|&j| measured[i * nc + j].is_some()) else { continue };
            let v0 = measured[i * nc + j0].unwrap_or(0.0);
            let Some(k) = (0..nb).filter(|&k| filled[k]).min_by_key(|&k| (k.abs_diff(i), k)) else { continue };
            let scale = batches[i] / batches[k];
            for j in 0..nc {
                values_ms[i * nc + j] = v0 + (values_ms[k * nc + j] - values_ms[k * nc + j0]) * scale;
            }
        }
        // A single row or column means no slope in that direction: duplicate it (constant), so
        // that lookups always have a segment.
        let (mut batches, mut contexts, mut values_ms) = (batches, contexts, values_ms);
        if nc == 1 {
            contexts.push(contexts[0] + 1.0);
            values_ms = values_ms.iter().flat_map(|&v| [v, v]).collect();
        }
        if nb == 1 {
            batches.push(batches[0] + 1.0);
            values_ms.extend_from_within(..);
        }
        let nc = contexts.len();
        let zero_context_ms =
            values_ms.chunks_exact(nc).map(|row| lerp(0.0, contexts[0], row[0], contexts[1], row[1])).collect();
        Ok(DecodeGrid { batches, contexts, values_ms, zero_context_ms })
    }

    /// Unclamped: may extrapolate below zero far outside the grid.
    #[inline]
    fn raw_ms(&self, batch: f64, context: f64) -> f64 {
        self.raw_and_zero_context_ms(batch, context).0
    }

    /// `(time at context, time extended to context 0)`, sharing the batch lookup.
    #[inline]
    fn raw_and_zero_context_ms(&self, batch: f64, context: f64) -> (f64, f64) {
        let nc = self.contexts.len();
        // Below the smallest batch row: that row (no extrapolation towards zero sequences).
        let (i, wb) = bracket(&self.batches, batch.max(self.batches[0]));
        let (j, wc) = bracket(&self.contexts, context);
        let (lo, hi) = (&self.values_ms[(i - 1) * nc..i * nc], &self.values_ms[i * nc..(i + 1) * nc]);
        let at_lo = lo[j - 1] * (1.0 - wc) + lo[j] * wc;
        let at_hi = hi[j - 1] * (1.0 - wc) + hi[j] * wc;
        let zero = self.zero_context_ms[i - 1] * (1.0 - wb) + self.zero_context_ms[i] * wb;
        (at_lo * (1.0 - wb) + at_hi * wb, zero)
    }
}

/// Prefill time over tokens with the causal-attention term separated out.
#[derive(Clone, Debug)]
struct PrefillCurve {
    tokens: Vec<f64>,
    /// Measured time minus `attn_ms_per_token_sq · tokens²`.
    linear_ms: Vec<f64>,
    attn_ms_per_token_sq: f64,
    floor_ms: f64,
}

impl PrefillCurve {
    fn build(file: &str, points: &[PrefillPoint], floor_ms: f64) -> Result<Self, TimingError> {
        let mut pts: Vec<(f64, f64)> = points.iter().map(|p| (p.tokens as f64, p.iter_ms)).collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        if pts.len() < 2 {
            return Err(TimingError::Table { file: file.into(), message: "needs at least two prompt lengths".into() });
        }
        let c = fit_quadratic_coefficient(&pts);
        Ok(PrefillCurve {
            tokens: pts.iter().map(|p| p.0).collect(),
            linear_ms: pts.iter().map(|&(t, v)| v - c * t * t).collect(),
            attn_ms_per_token_sq: c,
            floor_ms,
        })
    }

    #[inline]
    fn ms(&self, tokens: f64, tokens_sq: f64) -> f64 {
        let (j, w) = bracket(&self.tokens, tokens);
        let lin = self.linear_ms[j - 1] * (1.0 - w) + self.linear_ms[j] * w;
        (lin + self.attn_ms_per_token_sq * tokens_sq).max(self.floor_ms)
    }
}

/// c of the least-squares fit `t = a + b·T + c·T²` over the compute-bound points; 0 when fewer
/// than three such points or when the fit is not convex.
fn fit_quadratic_coefficient(pts: &[(f64, f64)]) -> f64 {
    const SCALE: f64 = 1e4; // conditions the normal equations
    let fit: Vec<(f64, f64)> =
        pts.iter().filter(|p| p.0 >= QUADRATIC_FIT_MIN_TOKENS as f64).map(|&(t, v)| (t / SCALE, v)).collect();
    if fit.len() < 3 {
        return 0.0;
    }
    let mut m = [[0.0f64; 4]; 3]; // augmented normal equations
    for &(x, y) in &fit {
        let row = [1.0, x, x * x];
        for r in 0..3 {
            for k in 0..3 {
                m[r][k] += row[r] * row[k];
            }
            m[r][3] += row[r] * y;
        }
    }
    for col in 0..3 {
        let pivot = m[col][col];
        if pivot.abs() < 1e-12 {
            return 0.0;
        }
        let pivot_row = m[col];
        for (r, row) in m.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / pivot;
                for (x, p) in row.iter_mut().zip(pivot_row) {
                    *x -= f * p;
                }
            }
        }
    }
    let c = m[2][3] / m[2][2] / (SCALE * SCALE);
    if c.is_finite() && c > 0.0 {
        c
    } else {
        0.0
    }
}

/// Iteration times interpolated from measured tables; offload/reload from measured copy rates.
#[derive(Clone, Debug)]
pub struct ProfileTiming {
    source: String,
    decode_points: Vec<DecodePoint>,
    prefill_points: Vec<PrefillPoint>,
    copy_points: Vec<CopyPoint>,
    decode: DecodeGrid,
    prefill: PrefillCurve,
    offload_bytes_per_s: f64,
    reload_bytes_per_s: f64,
}

impl ProfileTiming {
    /// The embedded H100-80GB × Qwen2.5-32B-shape table (`core/profiles/h100-qwen2.5-32b/`).
    pub fn builtin_h100_qwen32b() -> ProfileTiming {
        // Compile-time data, parsed by a test on every build.
        Self::from_csv_strs(BUILTIN_DECODE, BUILTIN_PREFILL, BUILTIN_COPY)
            .map(|p| p.with_source(BUILTIN_SOURCE))
            .expect("embedded h100-qwen2.5-32b profile parses")
    }

    /// Whether the embedded table was measured for `model`'s shape (compared by shape, not name).
    pub fn builtin_matches(model: &ModelSpec) -> bool {
        (model.layers, model.hidden, model.q_heads, model.kv_heads, model.head_dim, model.intermediate, model.vocab)
            == (64, 5120, 40, 8, 128, 27648, 152064)
            && model.dtype_bytes == 2
    }

    /// Tables given as text; errors name `decode.csv`, `prefill.csv` or `copy.csv`.
    pub fn from_csv_strs(decode_csv: &str, prefill_csv: &str, copy_csv: &str) -> Result<ProfileTiming, TimingError> {
        Self::from_named_strs(("decode.csv", decode_csv), ("prefill.csv", prefill_csv), ("copy.csv", copy_csv))
    }

    /// `dir/decode.csv`, `dir/prefill.csv`, `dir/copy.csv`; errors name the full path.
    pub fn from_dir(dir: &Path) -> Result<ProfileTiming, TimingError> {
        let read = |name: &str| {
            let path = dir.join(name);
            let shown = path.display().to_string();
            std::fs::read_to_string(&path)
                .map(|t| (shown.clone(), t))
                .map_err(|source| TimingError::Io { path: shown, source })
        };
        let (d, p, c) = (read("decode.csv")?, read("prefill.csv")?, read("copy.csv")?);
        Ok(Self::from_named_strs((&d.0, &d.1), (&p.0, &p.1), (&c.0, &c.1))?.with_source(&dir.display().to_string()))
    }

    fn from_named_strs(d: (&str, &str), p: (&str, &str), c: (&str, &str)) -> Result<ProfileTiming, TimingError> {
        let decode = table::parse_decode(d.0, d.1)?;
        let prefill = table::parse_prefill(p.0, p.1)?;
        let copy = table::parse_copy(c.0, c.1)?;
        Self::from_points_named("tables", decode, prefill, copy, [d.0, p.0, c.0])
    }

    /// Builds from already-parsed points (used to rebuild without held-out points).
    pub fn from_points(
        source: &str,
        decode: Vec<DecodePoint>,
        prefill: Vec<PrefillPoint>,
        copy: Vec<CopyPoint>,
    ) -> Result<ProfileTiming, TimingError> {
        Self::from_points_named(source, decode, prefill, copy, ["decode.csv", "prefill.csv", "copy.csv"])
    }

    fn from_points_named(
        source: &str,
        decode_points: Vec<DecodePoint>,
        prefill_points: Vec<PrefillPoint>,
        copy_points: Vec<CopyPoint>,
        files: [&str; 3],
    ) -> Result<ProfileTiming, TimingError> {
        let decode = DecodeGrid::build(files[0], &decode_points)?;
        // One iteration streams the weights at least once: never cheaper than the cheapest decode.
        let floor_ms = decode_points.iter().map(|p| p.iter_ms).fold(f64::INFINITY, f64::min);
        let prefill = PrefillCurve::build(files[1], &prefill_points, floor_ms)?;
        let rate = |dir: CopyDirection, use_: &str| {
            copy_points.iter().filter(|p| p.direction == dir).max_by_key(|p| p.bytes).map(|p| p.gbps * 1e9).ok_or_else(
                || TimingError::Table {
                    file: files[2].into(),
                    message: format!("no `{dir:?}` row ({use_} rate unknown)").to_lowercase(),
                },
            )
        };
        let offload_bytes_per_s = rate(CopyDirection::D2h, "offload")?;
        let reload_bytes_per_s = rate(CopyDirection::H2d, "reload")?;
        Ok(ProfileTiming {
            source: source.into(),
            decode_points,
            prefill_points,
            copy_points,
            decode,
            prefill,
            offload_bytes_per_s,
            reload_bytes_per_s,
        })
    }

    fn with_source(mut self, source: &str) -> Self {
        self.source = source.into();
        self
    }

    /// Where the tables came from (`builtin:…` or a directory).
    pub fn source(&self) -> &str {
        &self.source
    }
    /// The measured decode iterations, as loaded.
    pub fn decode_points(&self) -> &[DecodePoint] {
        &self.decode_points
    }
    /// The measured single-prompt prefill iterations, as loaded.
    pub fn prefill_points(&self) -> &[PrefillPoint] {
        &self.prefill_points
    }
    /// The measured host↔device copy rates, as loaded.
    pub fn copy_points(&self) -> &[CopyPoint] {
        &self.copy_points
    }
    /// Device → host rate used for offload, GB/s.
    pub fn offload_gbytes_per_s(&self) -> f64 {
        self.offload_bytes_per_s * 1e-9
    }
    /// Host → device rate used for reload, GB/s.
    pub fn reload_gbytes_per_s(&self) -> f64 {
        self.reload_bytes_per_s * 1e-9
    }
    /// Fitted causal-attention coefficient c of the prefill curve, ms per token².
    pub fn prefill_attn_ms_per_token_sq(&self) -> f64 {
        self.prefill.attn_ms_per_token_sq
    }

    /// One decode iteration of `batch` sequences at mean context `mean_context` tokens.
    #[inline]
    pub fn decode_ms(&self, batch: f64, mean_context: f64) -> f64 {
        self.decode.raw_ms(batch, mean_context).max(0.0)
    }

    /// One prefill iteration over `tokens` prompt tokens whose squared lengths sum to `tokens_sq`
    /// (a single prompt: `tokens²`).
    #[inline]
    pub fn prefill_ms(&self, tokens: f64, tokens_sq: f64) -> f64 {
        self.prefill.ms(tokens, tokens_sq)
    }

    /// The iteration time in milliseconds (see the module doc for the mixed-batch rule).
    #[inline]
    pub fn iteration_ms(&self, shape: &BatchShape) -> f64 {
        let (ds, ps) = (shape.decode_seqs, shape.prefill_seqs);
        if ds == 0 && ps == 0 {
            return 0.0;
        }
        let b = ds as f64;
        let mean_ctx = if ds > 0 { shape.decode_context_tokens as f64 / b } else { 0.0 };
        let (pt, psq) = (shape.prefill_tokens as f64, shape.prefill_tokens_sq as f64);
        if ps == 0 {
            return self.decode_ms(b, mean_ctx);
        }
        let prefill_only = self.prefill_ms(pt, psq);
        if ds == 0 {
            return prefill_only;
        }
        let (decode_raw, no_attention) = self.decode.raw_and_zero_context_ms(b, mean_ctx);
        let decode_only = decode_raw.max(0.0);
        let decode_attn = (decode_raw - no_attention).max(0.0);
        // Each decode token joins the GEMMs as a one-token prompt; its attention is `decode_attn`.
        let mixed = self.prefill_ms(pt + b, psq + b) + decode_attn;
        mixed.max(decode_only).max(prefill_only)
    }
}

impl TimingModel for ProfileTiming {
    fn name(&self) -> &str {
        "profile"
    }
    fn iteration(&self, batch: &BatchShape) -> TimeSpan {
        TimeSpan::from_millis_f64(self.iteration_ms(batch))
    }
    fn offload(&self, bytes: u64) -> TimeSpan {
        TimeSpan::from_secs_f64(bytes as f64 / self.offload_bytes_per_s)
    }
    fn reload(&self, bytes: u64) -> TimeSpan {
        TimeSpan::from_secs_f64(bytes as f64 / self.reload_bytes_per_s)
    }
}

#[cfg(test)]
mod tests;
