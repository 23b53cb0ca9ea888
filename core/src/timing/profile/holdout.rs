//! Held-out error of the timing models against the measured table (`kvfleet bench timing`).
//!
//! The data set withholds some measured points, and PASCAL §V reports its simulator's MAPE against
//! a real system (1.62 % E2E, 6.49 % TPOT); we hold out our own points so the profile model's
//! interpolation error is measured rather than assumed:
//! - `leave-one-out`: every decode cell with measured neighbours on both sides of its row (context
//!   interpolation), and every interior prefill length, removed in turn; the interpolator is
//!   rebuilt without it and predicts it. Removing a point doubles the local spacing, so this
//!   overstates the error between the points we keep.
//! - `leave-one-batch-out`: every interior batch row removed whole (batch interpolation, as for
//!   the batch sizes between powers of two that the simulator mostly asks for).
//! - `edge-extrapolation`: the longest context of each row with three or more cells (the
//!   extrapolation used for memory-limited cells).
//! - `analytic` `all-points`: the roofline, which is never fitted per point, against every point.

use super::table::{DecodePoint, PrefillPoint};
use super::{ProfileTiming, TimingError};
use crate::spec::{GpuSpec, ModelSpec};
use crate::timing::analytic::AnalyticTiming;
use crate::timing::BatchShape;
use std::fmt;

/// Method name: each interior point removed in turn and predicted by interpolation.
pub const METHOD_LOO: &str = "leave-one-out";
/// Method name: each interior decode batch row removed whole and predicted.
pub const METHOD_BATCH_OUT: &str = "leave-one-batch-out";
/// Method name: the longest context of each decode row predicted by extrapolation.
pub const METHOD_EDGE: &str = "edge-extrapolation";
/// Method name: every point predicted by a model never fitted per point (the analytic roofline).
pub const METHOD_ALL: &str = "all-points";

/// Which table point was predicted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TablePoint {
    /// A decode cell of the table.
    Decode {
        /// Decoding sequences.
        batch: u32,
        /// Context tokens of each.
        context: u32,
    },
    /// A prefill length of the table.
    Prefill {
        /// Prompt length, tokens.
        tokens: u32,
    },
}

impl fmt::Display for TablePoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TablePoint::Decode { batch, context } => write!(f, "decode b={batch} ctx={context}"),
            TablePoint::Prefill { tokens } => write!(f, "prefill {tokens} tok"),
        }
    }
}

/// One prediction of a point the predicting model did not see.
#[derive(Clone, Debug, PartialEq)]
pub struct HeldOutPoint {
    /// `profile` or `analytic`.
    pub model: &'static str,
    /// How it was held out (one of the `METHOD_*` names).
    pub method: &'static str,
    /// The table point predicted.
    pub point: TablePoint,
    /// Measured iteration time, ms.
    pub measured_ms: f64,
    /// The model's prediction, ms.
    pub predicted_ms: f64,
}

impl HeldOutPoint {
    /// Signed error, % of the measured time.
    pub fn error_pct(&self) -> f64 {
        100.0 * (self.predicted_ms - self.measured_ms) / self.measured_ms
    }
}

/// Slices of the points the report summarises (decode thresholds: batch 8, context 2048).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Regime {
    /// Every point.
    All,
    /// Decode points.
    Decode,
    /// Decode points with batch ≤ 8.
    DecodeSmallBatch,
    /// Decode points with batch > 8.
    DecodeLargeBatch,
    /// Decode points with context ≤ 2048 tokens.
    DecodeShortContext,
    /// Decode points with context > 2048 tokens.
    DecodeLongContext,
    /// Prefill points.
    Prefill,
}

impl Regime {
    /// Every regime, in report order.
    pub const ALL: [Regime; 7] = [
        Regime::All,
        Regime::Decode,
        Regime::DecodeSmallBatch,
        Regime::DecodeLargeBatch,
        Regime::DecodeShortContext,
        Regime::DecodeLongContext,
        Regime::Prefill,
    ];

    /// Short label for report tables.
    pub fn label(self) -> &'static str {
        match self {
            Regime::All => "all",
            Regime::Decode => "decode",
            Regime::DecodeSmallBatch => "decode batch<=8",
            Regime::DecodeLargeBatch => "decode batch>8",
            Regime::DecodeShortContext => "decode ctx<=2048",
            Regime::DecodeLongContext => "decode ctx>2048",
            Regime::Prefill => "prefill",
        }
    }

    /// Whether point `p` falls in this regime.
    pub fn contains(self, p: TablePoint) -> bool {
        match (self, p) {
            (Regime::All, _) => true,
            (Regime::Decode, TablePoint::Decode { .. }) => true,
            (Regime::DecodeSmallBatch, TablePoint::Decode { batch, .. }) => batch <= 8,
            (Regime::DecodeLargeBatch, TablePoint::Decode { batch, .. }) => batch > 8,
            (Regime::DecodeShortContext, TablePoint::Decode { context, .. }) => context <= 2048,
            (Regime::DecodeLongContext, TablePoint::Decode { context, .. }) => context > 2048,
            (Regime::Prefill, TablePoint::Prefill { .. }) => true,
            _ => false,
        }
    }
}

/// Mean and worst absolute error over a set of points.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ErrorStats {
    /// Points summarised.
    pub n: usize,
    /// Mean absolute percentage error, %.
    pub mape_pct: f64,
    /// Largest absolute percentage error, %.
    pub max_abs_pct: f64,
}

/// Every held-out prediction, with summaries by (model, method, regime).
#[derive(Clone, Debug)]
pub struct HoldoutReport {
    /// Heading naming the profile the points come from.
    pub title: String,
    /// Every held-out prediction.
    pub points: Vec<HeldOutPoint>,
}

impl HoldoutReport {
    /// Summary of one (model, method, regime); `n == 0` when nothing matches.
    pub fn stats(&self, model: &str, method: &str, regime: Regime) -> ErrorStats {
        let errs: Vec<f64> = self
            .points
            .iter()
            .filter(|p| p.model == model && p.method == method && regime.contains(p.point))
            .map(|p| p.error_pct().abs())
            .collect();
        if errs.is_empty() {
            return ErrorStats::default();
        }
        ErrorStats {
            n: errs.len(),
            mape_pct: errs.iter().sum::<f64>() / errs.len() as f64,
            max_abs_pct: errs.iter().copied().fold(0.0, f64::max),
        }
    }

    /// The embedded H100 table, against itself held out and against the calibrated roofline.
    pub fn builtin_h100_qwen32b() -> Result<HoldoutReport, TimingError> {
        let analytic = AnalyticTiming::new(&ModelSpec::load("r1-distill-qwen-32b")?, &GpuSpec::load("h100-80gb")?)?;
        Ok(holdout_report(&ProfileTiming::builtin_h100_qwen32b(), Some(&analytic)))
    }
}

fn decode_shape(p: &DecodePoint) -> BatchShape {
    BatchShape { decode_seqs: p.batch, decode_context_tokens: p.batch as u64 * p.context as u64, ..Default::default() }
}

fn prefill_shape(p: &PrefillPoint) -> BatchShape {
    let mut s = BatchShape::default();
    s.add_prefill(p.tokens);
    s
}

/// Holds out points of `profile`'s own tables (see the module doc) and, when given, scores
/// `analytic` on every point.
pub fn holdout_report(profile: &ProfileTiming, analytic: Option<&AnalyticTiming>) -> HoldoutReport {
    let dec = profile.decode_points();
    let pre = profile.prefill_points();
    let mut points = Vec::new();
    let rebuild = |d: Vec<DecodePoint>, p: Vec<PrefillPoint>| {
        ProfileTiming::from_points(profile.source(), d, p, profile.copy_points().to_vec()).ok()
    };
    let mut push = |method, point, measured_ms, predicted_ms| {
        points.push(HeldOutPoint { model: "profile", method, point, measured_ms, predicted_ms })
    };
    let row_contexts = |b: u32| -> Vec<u32> {
        let mut cs: Vec<u32> = dec.iter().filter(|p| p.batch == b).map(|p| p.context).collect();
        cs.sort_unstable();
        cs
    };
    let mut batches: Vec<u32> = dec.iter().map(|p| p.batch).collect();
    batches.sort_unstable();
    batches.dedup();

    for (k, p) in dec.iter().enumerate() {
        let cs = row_contexts(p.batch);
        let interior = cs.first().is_some_and(|&c| c < p.context) && cs.last().is_some_and(|&c| c > p.context);
        if !interior {
            continue;
        }
        let rest: Vec<DecodePoint> = dec.iter().enumerate().filter(|&(i, _)| i != k).map(|(_, q)| *q).collect();
        if let Some(m) = rebuild(rest, pre.to_vec()) {
            let point = TablePoint::Decode { batch: p.batch, context: p.context };
            push(METHOD_LOO, point, p.iter_ms, m.decode_ms(p.batch as f64, p.context as f64));
        }
    }
    for w in batches.windows(3) {
        let b = w[1];
        let rest: Vec<DecodePoint> = dec.iter().filter(|q| q.batch != b).copied().collect();
        if let Some(m) = rebuild(rest, pre.to_vec()) {
            for p in dec.iter().filter(|q| q.batch == b) {
                let point = TablePoint::Decode { batch: p.batch, context: p.context };
                push(METHOD_BATCH_OUT, point, p.iter_ms, m.decode_ms(p.batch as f64, p.context as f64));
            }
        }
    }
    for &b in &batches {
        let cs = row_contexts(b);
        if cs.len() < 3 {
            continue;
        }
        let last = cs[cs.len() - 1];
        let rest: Vec<DecodePoint> = dec.iter().filter(|q| !(q.batch == b && q.context == last)).copied().collect();
        let held = dec.iter().find(|q| q.batch == b && q.context == last);
        if let (Some(m), Some(p)) = (rebuild(rest, pre.to_vec()), held) {
            let point = TablePoint::Decode { batch: b, context: last };
            push(METHOD_EDGE, point, p.iter_ms, m.decode_ms(b as f64, last as f64));
        }
    }
    let (min_t, max_t) = pre.iter().fold((u32::MAX, 0), |(lo, hi), p| (lo.min(p.tokens), hi.max(p.tokens)));
    for p in pre.iter().filter(|p| p.tokens > min_t && p.tokens < max_t) {
        let rest: Vec<PrefillPoint> = pre.iter().filter(|q| q.tokens != p.tokens).copied().collect();
        if let Some(m) = rebuild(dec.to_vec(), rest) {
            let t = p.tokens as f64;
            push(METHOD_LOO, TablePoint::Prefill { tokens: p.tokens }, p.iter_ms, m.prefill_ms(t, t * t));
        }
    }
    if let Some(a) = analytic {
        for p in dec {
            let point = TablePoint::Decode { batch: p.batch, context: p.context };
            points.push(HeldOutPoint {
                model: "analytic",
                method: METHOD_ALL,
                point,
                measured_ms: p.iter_ms,
                predicted_ms: a.iteration_ms(&decode_shape(p)),
            });
        }
        for p in pre {
            points.push(HeldOutPoint {
                model: "analytic",
                method: METHOD_ALL,
                point: TablePoint::Prefill { tokens: p.tokens },
                measured_ms: p.iter_ms,
                predicted_ms: a.iteration_ms(&prefill_shape(p)),
            });
        }
    }
    HoldoutReport { title: format!("timing-model error on held-out points of {}", profile.source()), points }
}

impl fmt::Display for HoldoutReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.title)?;
        writeln!(
            f,
            "{:<9} {:<20} {:<17} {:>3} {:>7} {:>8}",
            "model", "held out by", "regime", "n", "MAPE %", "max |%|"
        )?;
        let mut groups: Vec<(&str, &str)> = Vec::new();
        for p in &self.points {
            if !groups.contains(&(p.model, p.method)) {
                groups.push((p.model, p.method));
            }
        }
        for (model, method) in &groups {
            for regime in Regime::ALL {
                let s = self.stats(model, method, regime);
                // `all` repeats `decode` or `prefill` when a method covers only one of them.
                let redundant = regime == Regime::All
                    && (s.n == self.stats(model, method, Regime::Decode).n
                        || s.n == self.stats(model, method, Regime::Prefill).n);
                if s.n > 0 && !redundant {
                    writeln!(
                        f,
                        "{model:<9} {method:<20} {:<17} {:>3} {:>7.2} {:>8.2}",
                        regime.label(),
                        s.n,
                        s.mape_pct,
                        s.max_abs_pct
                    )?;
                }
            }
        }
        for model in ["profile", "analytic"] {
            let mut worst: Vec<&HeldOutPoint> = self.points.iter().filter(|p| p.model == model).collect();
            if worst.is_empty() {
                continue;
            }
            worst.sort_by(|a, b| b.error_pct().abs().total_cmp(&a.error_pct().abs()));
            write!(f, "worst {model}:")?;
            for p in worst.iter().take(3) {
                write!(f, "  {} ({}) {:+.1}%", p.point, p.method, p.error_pct())?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}
