//! `--timing`: the core's models by name (`auto`, `profile`, `analytic`) plus `cuda`, live kernels
//! on a local GPU (`kvfleet-cuda`), available when the worker is built with the `cuda` feature.
//!
//! `cuda` reads its capacity settings from `KVFLEET_CUDA_*` variables (`kvfleet_cuda::CudaTimingConfig`)
//! and takes a few seconds to start (kernel compile, buffer fill, copy-rate measurement).

use crate::options::OptionsError;
use kvfleet_core::spec::{GpuSpec, ModelSpec};
use kvfleet_core::timing::{build_timing, TimingError, TimingModel, TIMING_KINDS};
use std::path::Path;

/// What `--timing cuda` says when the feature is off.
pub const CUDA_FEATURE_MISSING: &str = "this worker was built without the `cuda` feature (cargo build --features cuda)";

/// The timing model named `kind` for this instance.
pub fn build(
    kind: &str,
    model: &ModelSpec,
    gpu: &GpuSpec,
    profile_dir: Option<&Path>,
    tp: u32,
) -> Result<Box<dyn TimingModel>, OptionsError> {
    if kind == "cuda" {
        if tp != 1 {
            let message = format!("cuda times the kernels of one GPU; --tensor-parallel-size {tp} needs analytic");
            return Err(OptionsError::Invalid { flag: "timing", message });
        }
        return build_cuda(model, gpu);
    }
    build_timing(kind, model, gpu, profile_dir, tp).map_err(|e| match e {
        TimingError::UnknownKind { kind, .. } => {
            OptionsError::Timing(TimingError::UnknownKind { kind, valid: format!("{}, cuda", TIMING_KINDS.join(", ")) })
        }
        e => OptionsError::Timing(e),
    })
}

#[cfg(feature = "cuda")]
fn build_cuda(model: &ModelSpec, gpu: &GpuSpec) -> Result<Box<dyn TimingModel>, OptionsError> {
    let invalid = |e: kvfleet_cuda::CudaError| OptionsError::Invalid { flag: "timing", message: format!("cuda: {e}") };
    let cfg = kvfleet_cuda::CudaTimingConfig::from_env().map_err(invalid)?;
    let t = kvfleet_cuda::CudaTiming::new(model, gpu, cfg).map_err(invalid)?;
    Ok(Box::new(t))
}

#[cfg(not(feature = "cuda"))]
fn build_cuda(_model: &ModelSpec, _gpu: &GpuSpec) -> Result<Box<dyn TimingModel>, OptionsError> {
    Err(OptionsError::Invalid { flag: "timing", message: CUDA_FEATURE_MISSING.into() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs() -> (ModelSpec, GpuSpec) {
        (ModelSpec::load("r1-distill-qwen-32b").unwrap(), GpuSpec::load("h100-80gb").unwrap())
    }

    #[test]
    fn core_kinds_still_build_and_unknown_kinds_list_cuda() {
        let (m, g) = specs();
        assert_eq!(build("auto", &m, &g, None, 1).unwrap().name(), "profile");
        assert_eq!(build("analytic", &m, &g, None, 1).unwrap().name(), "analytic");
        let e = build("gpu", &m, &g, None, 1).unwrap_err().to_string();
        assert!(e.contains("`--timing`") && e.contains("analytic, profile, auto, cuda"), "{e}");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_says_how_to_build_it() {
        let (m, g) = specs();
        let e = build("cuda", &m, &g, None, 1).unwrap_err().to_string();
        assert_eq!(e, format!("`--timing`: {CUDA_FEATURE_MISSING}"));
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_without_a_driver_names_libcuda() {
        if kvfleet_cuda::driver_library_present() {
            println!("skipped: a CUDA driver is present (the GPU tests in kvfleet-cuda cover this host)");
            return;
        }
        let (m, g) = specs();
        let e = build("cuda", &m, &g, None, 1).unwrap_err().to_string();
        assert!(e.contains("`--timing`: cuda: no CUDA driver (libcuda.so) found"), "{e}");
    }
}
