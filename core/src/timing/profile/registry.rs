//! Choosing a timing model by name: `analytic`, `profile`, or `auto` (profile where we have one).
//!
//! PASCAL §V simulates from profiles, so for its model (R1-Distill-Qwen-32B, matched by shape) on
//! an H100 the embedded H100-80GB table is the default. It is also used for the H100 96 GB that
//! PASCAL ran on: that part has more and faster HBM, so the 80 GB table is the conservative side.

use super::{ProfileTiming, TimingError};
use crate::spec::{GpuSpec, ModelSpec};
use crate::timing::analytic::{check_tp, AnalyticParams, AnalyticTiming};
use crate::timing::TimingModel;
use std::path::Path;

/// The names `build_timing` accepts.
pub const TIMING_KINDS: &[&str] = &["analytic", "profile", "auto"];

/// The embedded table applies to this GPU (any H100 variant; see the module doc).
fn builtin_gpu(gpu: &GpuSpec) -> bool {
    gpu.name.to_ascii_lowercase().starts_with("h100")
}

/// Builds the timing model named `kind` for `model` on `gpu`.
///
/// - `analytic`: the roofline ([`AnalyticTiming`]) with calibrated defaults; `profile_dir` unused.
/// - `profile`: the tables in `profile_dir`, else the embedded H100 table when `model` has the
///   Qwen2.5-32B shape and `gpu` is an H100; otherwise an error suggesting the alternatives.
/// - `auto`: `profile` where it applies, `analytic` elsewhere.
///
/// An instance spans `tp` GPUs (tensor parallelism): the analytic model splits its work
/// ([`AnalyticTiming::with_tp`]); a measured table is one GPU's, so `profile` refuses `tp` > 1 and
/// `auto` then takes the analytic model.
pub fn build_timing(
    kind: &str,
    model: &ModelSpec,
    gpu: &GpuSpec,
    profile_dir: Option<&Path>,
    tp: u32,
) -> Result<Box<dyn TimingModel>, TimingError> {
    let builtin = ProfileTiming::builtin_matches(model) && builtin_gpu(gpu);
    let analytic = || -> Result<Box<dyn TimingModel>, TimingError> {
        Ok(Box::new(AnalyticTiming::with_tp(model, gpu, AnalyticParams::default(), tp)?))
    };
    match kind {
        "analytic" => analytic(),
        "auto" if tp > 1 => analytic(),
        "profile" if tp > 1 => {
            check_tp(model, gpu, tp)?;
            Err(TimingError::InvalidParam {
                name: "tp",
                value: f64::from(tp),
                message: "a measured profile is one GPU's: more GPUs per instance need the analytic timing model \
                          (timing = \"analytic\" or \"auto\")"
                    .into(),
            })
        }
        "profile" | "auto" => {
            if let Some(dir) = profile_dir {
                return Ok(Box::new(ProfileTiming::from_dir(dir)?));
            }
            if builtin {
                return Ok(Box::new(ProfileTiming::builtin_h100_qwen32b()));
            }
            if kind == "auto" {
                return analytic();
            }
            Err(TimingError::NoProfile {
                what: format!(
                    "model `{}` on GPU `{}` (the built-in table is the Qwen2.5-32B shape on an H100)",
                    model.name, gpu.name
                ),
            })
        }
        _ => Err(TimingError::UnknownKind { kind: kind.into(), valid: TIMING_KINDS.join(", ") }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timing::BatchShape;

    /// (kind, model, gpu, profile dir?) → expected model name, or an error containing the text.
    type Case<'a> = (&'a str, &'a str, &'a str, Option<&'a Path>, Result<&'a str, &'a str>);

    #[test]
    fn kind_model_gpu_table() {
        let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/profiles/h100-qwen2.5-32b"));
        let cases: &[Case] = &[
            ("auto", "r1-distill-qwen-32b", "h100-80gb", None, Ok("profile")),
            ("auto", "r1-distill-qwen-32b", "h100-96gb", None, Ok("profile")),
            ("profile", "r1-distill-qwen-32b", "h100-80gb", None, Ok("profile")),
            ("analytic", "r1-distill-qwen-32b", "h100-80gb", None, Ok("analytic")),
            ("auto", "r1-distill-qwen-32b", "a100-80gb", None, Ok("analytic")),
            ("auto", "llama-3-8b", "h100-80gb", None, Ok("analytic")),
            ("profile", "llama-3-8b", "h100-80gb", Some(dir), Ok("profile")),
            ("profile", "llama-3-8b", "h100-80gb", None, Err("--timing analytic")),
            ("profile", "r1-distill-qwen-32b", "v100-32gb", None, Err("profile directory")),
            (
                "profile",
                "qwen-7b",
                "l40s",
                Some(Path::new("/nonexistent/kvfleet")),
                Err("/nonexistent/kvfleet/decode.csv"),
            ),
            ("cuda", "qwen-7b", "l40s", None, Err("analytic, profile, auto")),
        ];
        for (kind, model, gpu, dir, expect) in cases {
            let (m, g) = (ModelSpec::load(model).unwrap(), GpuSpec::load(gpu).unwrap());
            match (build_timing(kind, &m, &g, *dir, 1), expect) {
                (Ok(t), Ok(name)) => {
                    assert_eq!(t.name(), *name, "{kind} {model} {gpu}");
                    let mut s = BatchShape::default();
                    s.add_decode(1000);
                    assert!(t.iteration(&s).as_millis_f64() > 1.0);
                }
                (Err(e), Err(text)) => assert!(e.to_string().contains(text), "{kind} {model} {gpu}: {e}"),
                (Ok(t), Err(text)) => panic!("{kind} {model} {gpu}: expected error with `{text}`, got {}", t.name()),
                (Err(e), Ok(name)) => panic!("{kind} {model} {gpu}: expected {name}, got {e}"),
            }
        }
        // Two GPUs per instance: the analytic model (faster than one GPU), never a one-GPU table.
        let (m, g) = (ModelSpec::load("r1-distill-qwen-32b").unwrap(), GpuSpec::load("h100-80gb").unwrap());
        let mut s = BatchShape::default();
        s.add_decode(1000);
        let one = build_timing("auto", &m, &g, None, 1).unwrap();
        let two = build_timing("auto", &m, &g, None, 2).unwrap();
        assert_eq!((one.name(), two.name()), ("profile", "analytic"));
        assert!(two.iteration(&s) < one.iteration(&s));
        let refused = build_timing("profile", &m, &g, None, 2).map(|t| t.name().to_string()).unwrap_err();
        assert!(refused.to_string().contains("one GPU's"), "{refused}");
        let odd = build_timing("auto", &m, &g, None, 3).map(|t| t.name().to_string()).unwrap_err();
        assert!(odd.to_string().contains("attention heads"), "{odd}");
    }
}
