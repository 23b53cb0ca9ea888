//! `kvfleet bench timing`: how far each timing model is from measured iteration times.
//!
//! 1. The profile model against points held out of its own table (leave-one-out, whole batch
//!    rows, edge extrapolation) and the analytic roofline against every table point
//!    (`kvfleet_core::timing::holdout_report`).
//! 2. With `--held-out DIR`: measured points that were never in the profile (the off-grid split
//!    `scripts/profile-gpu --holdout` writes: `decode.csv`, `prefill.csv`, optional `mixed.csv`),
//!    scored for `profile`, `analytic` and, with `--cuda`, live CUDA timing, MAPE per regime.
//! 3. With `--cuda` and no held-out set: live CUDA timing against every point of the profile table.

use crate::InputError;
use clap::Args;
use kvfleet_core::spec::{GpuSpec, ModelSpec};
use kvfleet_core::timing::profile::table::{parse_decode, parse_prefill};
use kvfleet_core::timing::{holdout_report, AnalyticTiming, BatchShape, ProfileTiming, TimingModel};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct TimingBench {
    /// Profile tables to evaluate (a folder with decode.csv, prefill.csv, copy.csv; default: the
    /// embedded H100 × Qwen2.5-32B table).
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Measured points not in the profile: a folder with decode.csv and prefill.csv (and
    /// optionally mixed.csv: decode_batch,decode_context,prefill_tokens,iter_ms).
    #[arg(long)]
    held_out: Option<PathBuf>,
    /// Model shape for the analytic and live CUDA models.
    #[arg(long, default_value = "r1-distill-qwen-32b")]
    model: String,
    /// GPU figures for the analytic model.
    #[arg(long, default_value = "h100-80gb")]
    gpu: String,
    /// Also time the points with live CUDA kernels on this host's GPU (needs a build with
    /// `--features cuda`; settings from KVFLEET_CUDA_* variables).
    #[arg(long)]
    cuda: bool,
    /// Write every scored point here (model,regime,point,measured_ms,predicted_ms,error_pct).
    #[arg(long)]
    csv: Option<PathBuf>,
}

/// One measured iteration and its shape.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredPoint {
    pub label: String,
    pub regime: Regime,
    pub shape: BatchShape,
    pub measured_ms: f64,
}

/// Regimes of the fidelity table (decode thresholds: batch 8, context 2048).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Regime {
    DecodeSmallBatchShort,
    DecodeSmallBatchLong,
    DecodeLargeBatchShort,
    DecodeLargeBatchLong,
    Prefill,
    Mixed,
}

impl Regime {
    const ALL: [Regime; 6] = [
        Regime::DecodeSmallBatchShort,
        Regime::DecodeSmallBatchLong,
        Regime::DecodeLargeBatchShort,
        Regime::DecodeLargeBatchLong,
        Regime::Prefill,
        Regime::Mixed,
    ];
    fn label(self) -> &'static str {
        match self {
            Regime::DecodeSmallBatchShort => "decode b<=8 ctx<=2048",
            Regime::DecodeSmallBatchLong => "decode b<=8 ctx>2048",
            Regime::DecodeLargeBatchShort => "decode b>8 ctx<=2048",
            Regime::DecodeLargeBatchLong => "decode b>8 ctx>2048",
            Regime::Prefill => "prefill",
            Regime::Mixed => "mixed prefill+decode",
        }
    }
    fn decode(batch: u32, context: u32) -> Regime {
        match (batch <= 8, context <= 2048) {
            (true, true) => Regime::DecodeSmallBatchShort,
            (true, false) => Regime::DecodeSmallBatchLong,
            (false, true) => Regime::DecodeLargeBatchShort,
            (false, false) => Regime::DecodeLargeBatchLong,
        }
    }
}

fn decode_point(batch: u32, context: u32, ms: f64) -> MeasuredPoint {
    let shape =
        BatchShape { decode_seqs: batch, decode_context_tokens: batch as u64 * context as u64, ..Default::default() };
    MeasuredPoint {
        label: format!("decode b={batch} ctx={context}"),
        regime: Regime::decode(batch, context),
        shape,
        measured_ms: ms,
    }
}

fn prefill_point(tokens: u32, ms: f64) -> MeasuredPoint {
    let mut shape = BatchShape::default();
    shape.add_prefill(tokens);
    MeasuredPoint { label: format!("prefill {tokens} tok"), regime: Regime::Prefill, shape, measured_ms: ms }
}

/// Parses `mixed.csv`: one prompt of `prefill_tokens` plus `decode_batch` sequences at
/// `decode_context`, measured as one iteration. Errors name the file, line and field.
pub fn parse_mixed(file: &str, text: &str) -> Result<Vec<MeasuredPoint>, String> {
    let cols = ["decode_batch", "decode_context", "prefill_tokens", "iter_ms"];
    let mut lines =
        text.lines().enumerate().map(|(i, l)| (i + 1, l.trim())).filter(|(_, l)| !l.is_empty() && !l.starts_with('#'));
    let (hl, header) = lines.next().ok_or_else(|| format!("{file}: empty; expected a header `{}`", cols.join(",")))?;
    let names: Vec<&str> = header.split(',').map(str::trim).collect();
    let idx: Vec<usize> = cols
        .iter()
        .map(|c| {
            names
                .iter()
                .position(|n| n == c)
                .ok_or_else(|| format!("{file}:{hl}: `{c}`: missing column (header is `{header}`)"))
        })
        .collect::<Result<_, _>>()?;
    let mut out = Vec::new();
    for (line, l) in lines {
        let f: Vec<&str> = l.split(',').map(str::trim).collect();
        if f.len() != names.len() {
            return Err(format!(
                "{file}:{line}: `row`: expected {} fields like the header, found {}",
                names.len(),
                f.len()
            ));
        }
        let int =
            |k: usize| -> Result<u32, String> {
                f[idx[k]].parse::<u32>().ok().filter(|&v| v > 0).ok_or_else(|| {
                    format!("{file}:{line}: `{}`: `{}` is not a positive whole number", cols[k], f[idx[k]])
                })
            };
        let (b, c, t) = (int(0)?, int(1)?, int(2)?);
        let ms: f64 = f[idx[3]]
            .parse()
            .ok()
            .filter(|v: &f64| v.is_finite() && *v > 0.0)
            .ok_or_else(|| format!("{file}:{line}: `iter_ms`: `{}` is not a positive number", f[idx[3]]))?;
        let mut shape = BatchShape { decode_seqs: b, decode_context_tokens: b as u64 * c as u64, ..Default::default() };
        shape.add_prefill(t);
        out.push(MeasuredPoint {
            label: format!("mixed b={b} ctx={c} + {t} tok"),
            regime: Regime::Mixed,
            shape,
            measured_ms: ms,
        });
    }
    Ok(out)
}

/// The measured points in a held-out folder (decode.csv and prefill.csv required, mixed.csv optional).
pub fn load_held_out(dir: &Path) -> Result<Vec<MeasuredPoint>, String> {
    let read = |name: &str| {
        let p = dir.join(name);
        std::fs::read_to_string(&p)
            .map(|t| (p.display().to_string(), t))
            .map_err(|e| format!("cannot read {}: {e}", p.display()))
    };
    let (df, dt) = read("decode.csv")?;
    let (pf, pt) = read("prefill.csv")?;
    let mut pts: Vec<MeasuredPoint> = parse_decode(&df, &dt)
        .map_err(|e| e.to_string())?
        .iter()
        .map(|p| decode_point(p.batch, p.context, p.iter_ms))
        .collect();
    pts.extend(parse_prefill(&pf, &pt).map_err(|e| e.to_string())?.iter().map(|p| prefill_point(p.tokens, p.iter_ms)));
    if dir.join("mixed.csv").exists() {
        let (mf, mt) = read("mixed.csv")?;
        pts.extend(parse_mixed(&mf, &mt)?);
    }
    Ok(pts)
}

/// One model's prediction of one point.
struct Scored {
    model: String,
    point: MeasuredPoint,
    predicted_ms: f64,
}

impl Scored {
    fn error_pct(&self) -> f64 {
        100.0 * (self.predicted_ms - self.point.measured_ms) / self.point.measured_ms
    }
}

/// The MAPE table: model × regime (n, MAPE %, max |%|), then an `all` row per model.
fn table(title: &str, scored: &[Scored]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{title}");
    let _ = writeln!(s, "{:<9} {:<22} {:>4} {:>7} {:>8}", "model", "regime", "n", "MAPE %", "max |%|");
    let mut models: Vec<&str> = Vec::new();
    for x in scored {
        if !models.contains(&x.model.as_str()) {
            models.push(&x.model);
        }
    }
    let stat = |errs: Vec<f64>| -> Option<(usize, f64, f64)> {
        (!errs.is_empty()).then(|| {
            (errs.len(), errs.iter().sum::<f64>() / errs.len() as f64, errs.iter().copied().fold(0.0, f64::max))
        })
    };
    for m in &models {
        for r in Regime::ALL {
            let errs =
                scored.iter().filter(|x| x.model == *m && x.point.regime == r).map(|x| x.error_pct().abs()).collect();
            if let Some((n, mape, max)) = stat(errs) {
                let _ = writeln!(s, "{m:<9} {:<22} {n:>4} {mape:>7.2} {max:>8.2}", r.label());
            }
        }
        let errs = scored.iter().filter(|x| x.model == *m).map(|x| x.error_pct().abs()).collect();
        if let Some((n, mape, max)) = stat(errs) {
            let _ = writeln!(s, "{m:<9} {:<22} {n:>4} {mape:>7.2} {max:>8.2}", "all");
        }
    }
    for m in &models {
        let mut worst: Vec<&Scored> = scored.iter().filter(|x| x.model == *m).collect();
        worst.sort_by(|a, b| b.error_pct().abs().total_cmp(&a.error_pct().abs()));
        let _ = write!(s, "worst {m}:");
        for w in worst.iter().take(3) {
            let _ = write!(s, "  {} {:+.1}%", w.point.label, w.error_pct());
        }
        let _ = writeln!(s);
    }
    s
}

#[cfg(feature = "cuda")]
fn live_cuda(model: &ModelSpec, gpu: &GpuSpec) -> anyhow::Result<Box<dyn TimingModel>> {
    let cfg = kvfleet_cuda::CudaTimingConfig::from_env()?;
    let t = kvfleet_cuda::CudaTiming::new(model, gpu, cfg)?;
    crate::say!(
        "live CUDA timing on {} ({} SMs), pinned copies h2d {:.1} GB/s, d2h {:.1} GB/s",
        t.device().name,
        t.device().sm_count,
        t.h2d_gbytes_per_s(),
        t.d2h_gbytes_per_s()
    );
    Ok(Box::new(t))
}

#[cfg(not(feature = "cuda"))]
fn live_cuda(_model: &ModelSpec, _gpu: &GpuSpec) -> anyhow::Result<Box<dyn TimingModel>> {
    Err(InputError(
        "`--cuda`: this kvfleet was built without the `cuda` feature (cargo build -p kvfleet --features cuda)".into(),
    )
    .into())
}

pub fn run(b: TimingBench) -> anyhow::Result<()> {
    let input = |e: String| anyhow::Error::from(InputError(e));
    let model = ModelSpec::load(&b.model).map_err(|e| input(format!("`--model`: {e}")))?;
    let gpu = GpuSpec::load(&b.gpu).map_err(|e| input(format!("`--gpu`: {e}")))?;
    let profile = match &b.profile {
        Some(dir) => ProfileTiming::from_dir(dir).map_err(|e| input(format!("`--profile`: {e}")))?,
        None => ProfileTiming::builtin_h100_qwen32b(),
    };
    let analytic = AnalyticTiming::new(&model, &gpu).map_err(|e| input(format!("analytic model: {e}")))?;
    let held_out = match &b.held_out {
        Some(dir) => Some(load_held_out(dir).map_err(|e| input(format!("`--held-out`: {e}")))?),
        None => None,
    };
    // Start the GPU before printing anything long: a missing driver fails fast.
    let cuda = if b.cuda { Some(live_cuda(&model, &gpu)?) } else { None };

    crate::say!("{}", holdout_report(&profile, Some(&analytic)));

    let (title, points) = match held_out {
        Some(p) => (
            format!(
                "error on {} measured points held out of the profile ({})",
                p.len(),
                b.held_out.as_ref().map_or(String::new(), |d| d.display().to_string())
            ),
            p,
        ),
        None if cuda.is_some() => {
            let mut p: Vec<MeasuredPoint> =
                profile.decode_points().iter().map(|d| decode_point(d.batch, d.context, d.iter_ms)).collect();
            p.extend(profile.prefill_points().iter().map(|q| prefill_point(q.tokens, q.iter_ms)));
            (format!("live CUDA timing against every measured point of {}", profile.source()), p)
        }
        None => return Ok(()),
    };
    let mut models: Vec<(&str, &dyn TimingModel)> = Vec::new();
    if b.held_out.is_some() {
        models.push(("profile", &profile));
        models.push(("analytic", &analytic));
    }
    if let Some(c) = &cuda {
        models.push(("cuda", c.as_ref()));
    }
    let mut scored = Vec::new();
    for (name, m) in &models {
        for p in &points {
            scored.push(Scored {
                model: name.to_string(),
                point: p.clone(),
                predicted_ms: m.iteration(&p.shape).as_millis_f64(),
            });
        }
    }
    crate::say!("{}", table(&title, &scored));
    if let Some(path) = &b.csv {
        let mut out = String::from("model,regime,point,measured_ms,predicted_ms,error_pct\n");
        for x in &scored {
            let _ = writeln!(
                out,
                "{},{},{},{:.4},{:.4},{:.2}",
                x.model,
                x.point.regime.label(),
                x.point.label,
                x.point.measured_ms,
                x.predicted_ms,
                x.error_pct()
            );
        }
        std::fs::write(path, out).map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
        crate::say!("wrote {} scored points to {}", scored.len(), path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixed_csv_parses_and_errors_name_line_and_field() {
        let pts = parse_mixed("m.csv", "# x\ndecode_batch,decode_context,prefill_tokens,iter_ms\n16,2048,512,61.5\n")
            .unwrap();
        assert_eq!(pts.len(), 1);
        assert_eq!(
            (pts[0].shape.decode_seqs, pts[0].shape.decode_context_tokens, pts[0].shape.prefill_tokens),
            (16, 32768, 512)
        );
        assert_eq!(pts[0].regime, Regime::Mixed);
        for (text, want) in [
            ("decode_batch,decode_context,prefill_tokens,iter_ms\n16,x,512,61\n", "m.csv:2: `decode_context`"),
            ("decode_batch,decode_context,prefill_tokens,iter_ms\n16,2048,512,-1\n", "m.csv:2: `iter_ms`"),
            ("decode_batch,decode_context,iter_ms\n16,2048,61\n", "`prefill_tokens`: missing column"),
            ("decode_batch,decode_context,prefill_tokens,iter_ms\n16,2048,512\n", "m.csv:2: `row`"),
        ] {
            let e = parse_mixed("m.csv", text).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn regimes_split_at_batch_8_and_context_2048() {
        assert_eq!(decode_point(8, 2048, 1.0).regime, Regime::DecodeSmallBatchShort);
        assert_eq!(decode_point(8, 2049, 1.0).regime, Regime::DecodeSmallBatchLong);
        assert_eq!(decode_point(9, 128, 1.0).regime, Regime::DecodeLargeBatchShort);
        assert_eq!(decode_point(64, 4096, 1.0).regime, Regime::DecodeLargeBatchLong);
    }

    /// The profile scored on its own table points reproduces them, so the table shows 0 % for it,
    /// and a model off by +10 % everywhere shows 10 %.
    #[test]
    fn table_reports_mape_per_regime() {
        let p = ProfileTiming::builtin_h100_qwen32b();
        let pts: Vec<MeasuredPoint> =
            p.decode_points().iter().map(|d| decode_point(d.batch, d.context, d.iter_ms)).collect();
        let mut scored: Vec<Scored> = pts
            .iter()
            .map(|x| Scored {
                model: "profile".into(),
                point: x.clone(),
                predicted_ms: p.iteration(&x.shape).as_millis_f64(),
            })
            .collect();
        scored.extend(pts.iter().map(|x| Scored {
            model: "plus10".into(),
            point: x.clone(),
            predicted_ms: 1.1 * x.measured_ms,
        }));
        let t = table("t", &scored);
        let row = |m: &str, r: &str| {
            t.lines()
                .find(|l| l.starts_with(m) && l.contains(r))
                .unwrap_or_else(|| panic!("{m} {r} in\n{t}"))
                .to_string()
        };
        assert!(row("profile", " all ").contains("0.00"), "{t}");
        assert!(row("plus10", "decode b>8 ctx<=2048").contains("10.00"), "{t}");
        assert!(!t.contains("prefill"), "no prefill points were given:\n{t}");
    }

    #[test]
    fn held_out_folder_needs_decode_and_prefill() {
        let dir = std::env::temp_dir().join(format!("kvfleet-bench-timing-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("decode.csv"), "batch,context,iter_ms\n3,384,24.6\n").unwrap();
        let e = load_held_out(&dir).unwrap_err();
        assert!(e.contains("prefill.csv"), "{e}");
        std::fs::write(dir.join("prefill.csv"), "tokens,iter_ms\n384,40.0\n").unwrap();
        std::fs::write(dir.join("mixed.csv"), "decode_batch,decode_context,prefill_tokens,iter_ms\n4,1024,256,35\n")
            .unwrap();
        let pts = load_held_out(&dir).unwrap();
        assert_eq!(
            pts.iter().map(|p| p.regime).collect::<Vec<_>>(),
            [Regime::DecodeSmallBatchShort, Regime::Prefill, Regime::Mixed]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
