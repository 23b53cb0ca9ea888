//! The CUDA C source of the layer's small kernels and attention (`kernels.cu`), and how NVRTC
//! compiles it for a model: head size and GQA group are compile-time constants so that the
//! per-thread query and accumulator arrays live in registers.

use crate::shapes::LayerShapes;
use crate::CudaError;
use cudarc::nvrtc::CompileOptions;

/// The kernels, compiled at run time (see the file's header for what each one stands for).
pub const KERNELS_CU: &str = include_str!("kernels.cu");

/// The names the device code loads from the compiled module.
pub const KERNEL_NAMES: [&str; 7] =
    ["fill_random", "add_rmsnorm", "rope_kv_write", "silu_mul", "decode_attention", "prefill_attention", "sample_rows"];

/// Shapes the kernels handle; anything else is refused with the field named.
pub fn check_supported(s: &LayerShapes) -> Result<(), CudaError> {
    let fail = |m: String| Err(CudaError::Unsupported(m));
    if s.dtype_bytes != 2 {
        return fail(format!(
            "live CUDA timing runs bf16 weights and KV; the model has dtype_bytes = {}",
            s.dtype_bytes
        ));
    }
    if !matches!(s.head_dim, 64 | 128 | 256) {
        return fail(format!("head_dim = {}: the attention kernels handle 64, 128 or 256", s.head_dim));
    }
    for (field, v) in [("hidden", s.hidden), ("intermediate", s.intermediate)] {
        if v % 8 != 0 {
            return fail(format!("{field} = {v}: the kernels need a multiple of 8 (16-byte vector loads)"));
        }
    }
    if s.kv_heads == 0 || !s.q_heads.is_multiple_of(s.kv_heads) || s.group() > 16 {
        return fail(format!(
            "q_heads = {} over kv_heads = {}: need a whole group of at most 16",
            s.q_heads, s.kv_heads
        ));
    }
    Ok(())
}

/// `-D` flags for one model: `HEAD_DIM`, `GROUP` and the prefill key-tile size `BLOCK_N` (64 keys,
/// 32 for head size 256, keeping the K and V tiles within 48 KiB of static shared memory).
pub fn kernel_defines(s: &LayerShapes) -> Vec<String> {
    let block_n = if s.head_dim <= 128 { 64 } else { 32 };
    vec![format!("-DHEAD_DIM={}", s.head_dim), format!("-DGROUP={}", s.group()), format!("-DBLOCK_N={block_n}")]
}

/// NVRTC options: PTX for the device's virtual architecture (the driver JIT-compiles it for the
/// exact chip at module load), fast math for the softmax exponentials.
pub fn compile_options(s: &LayerShapes, compute_capability: (i32, i32)) -> CompileOptions {
    let mut options = kernel_defines(s);
    options.push(format!("--gpu-architecture=compute_{}{}", compute_capability.0, compute_capability.1));
    CompileOptions { use_fast_math: Some(true), options, ..Default::default() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_core::spec::ModelSpec;

    fn shapes(name: &str) -> LayerShapes {
        LayerShapes::from_model(&ModelSpec::load(name).unwrap())
    }

    #[test]
    fn defines_follow_the_model() {
        assert_eq!(kernel_defines(&shapes("r1-distill-qwen-32b")), ["-DHEAD_DIM=128", "-DGROUP=5", "-DBLOCK_N=64"]);
        assert_eq!(kernel_defines(&shapes("qwen-7b")), ["-DHEAD_DIM=128", "-DGROUP=7", "-DBLOCK_N=64"]);
        let opts = compile_options(&shapes("llama-3-8b"), (9, 0));
        assert!(opts.options.contains(&"--gpu-architecture=compute_90".to_string()), "{:?}", opts.options);
    }

    #[test]
    fn every_kernel_is_in_the_source() {
        for name in KERNEL_NAMES {
            assert!(
                KERNELS_CU.contains(&format!("__global__ void {name}(")) || KERNELS_CU.contains(&format!(" {name}(")),
                "{name}"
            );
        }
    }

    #[test]
    fn unsupported_shapes_are_named() {
        let ok = shapes("r1-distill-qwen-32b");
        assert!(check_supported(&ok).is_ok());
        for (bad, field) in [
            (LayerShapes { head_dim: 80, ..ok }, "head_dim"),
            (LayerShapes { dtype_bytes: 1, ..ok }, "dtype_bytes"),
            (LayerShapes { hidden: 5121, ..ok }, "hidden"),
            (LayerShapes { q_heads: 64, kv_heads: 2, ..ok }, "kv_heads"),
        ] {
            let e = check_supported(&bad).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
    }

    /// Compiles the kernels for every built-in model when NVRTC can be loaded (a GPU host, or
    /// `LD_LIBRARY_PATH` holding `libnvrtc.so.13` from the `nvidia-cuda-nvrtc` wheel); needs no
    /// GPU. Catches syntax and register-array mistakes before a GPU run.
    #[test]
    fn kernels_compile_with_nvrtc_when_present() {
        if !crate::nvrtc_library_present() {
            println!("skipped: no NVRTC library (libnvrtc.so.13 / .12) on the library path");
            return;
        }
        for name in ModelSpec::builtin_names() {
            let s = shapes(&name);
            for cc in [(8, 0), (9, 0)] {
                let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNELS_CU, compile_options(&s, cc));
                let ptx = ptx.unwrap_or_else(|e| panic!("{name} compute_{}{}: {e}", cc.0, cc.1));
                let text = ptx.to_src();
                for k in KERNEL_NAMES {
                    assert!(text.contains(&format!(".entry {k}(")), "{name}: {k} missing from the PTX");
                }
                // Tensor-core MMAs in prefill attention.
                assert!(text.contains("mma.sync.aligned.m16n8k16"), "{name}: no mma in the PTX");
            }
        }
    }
}
