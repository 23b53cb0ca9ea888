//! kvfleet-cuda: live CUDA timing (`--timing cuda`). Each iteration shape the engine asks about is
//! run on a local GPU as one decoder layer of the model's shape with random bf16 weights, timed
//! with CUDA events, and charged `layers × layer + head`, the method of the shipped profile
//! (`core/profiles/h100-qwen2.5-32b/README.md`), measured live instead of read from a table.
//!
//! | module | what lives there |
//! |---|---|
//! | [`shapes`] | the layer's GEMM shapes, FLOPs and bytes (pure; tested without a GPU) |
//! | [`signature`] | quantized batch signatures: the cache key and the shape actually timed |
//! | [`kernels`] | the NVRTC-compiled kernels (`kernels.cu`) and their compile options |
//! | `gpu` | buffers, the kernel sequence, CUDA-event timing, pinned copy rates |
//!
//! One layer is: add+RMSNorm, QKV GEMM (cuBLAS), RoPE + KV-cache write, attention (decode:
//! split-K over each sequence's cached tokens, HBM-bound; prefill: causal, tensor-core MMAs with
//! the scores kept in registers), O GEMM, add+RMSNorm, gate/up GEMM, SiLU×mul, down GEMM. The head
//! is the final norm, the LM head GEMM over one row per sequence, and an argmax. A [`BatchShape`]
//! carries sums, so decode sequences are timed at their mean context (the KV bytes read, which is
//! what attention costs at decode, depend on the sum only) and prompts as equal prompts of length
//! Σt²/Σt ([`signature`]).
//!
//! The CUDA libraries are loaded at run time (cudarc `dynamic-loading`): building needs no CUDA
//! toolkit; running needs `libcuda.so` (the driver), `libcublas.so.13`/`.12` and
//! `libnvrtc.so.13`/`.12` on the library path. Results are cached per signature, so the GPU work
//! is bounded by the number of distinct signatures, not iterations; a shape beyond the allocated
//! capacity, or a failed measurement, falls back to the analytic roofline (logged once).
//! Several workers may share one GPU; they then time each other's interference too.

#![warn(missing_docs)]

pub mod kernels;
pub mod shapes;
pub mod signature;

mod gpu;

pub use gpu::{DeviceInfo, Timed};
pub use shapes::LayerShapes;
pub use signature::{quantize, BatchSignature};

use kvfleet_core::spec::{GpuSpec, ModelSpec};
use kvfleet_core::timing::{AnalyticTiming, BatchShape, TimingModel};
use kvfleet_core::TimeSpan;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

/// Why live CUDA timing is unavailable or failed.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The CUDA driver library is not installed on this host.
    #[error(
        "no CUDA driver (libcuda.so) found: live CUDA timing needs an NVIDIA GPU and its driver on this host \
         (looked for libcuda.so and libcuda.so.1 on the library path)"
    )]
    NoDriver,
    /// The driver did not initialise, or the requested device does not exist.
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// cuBLAS or NVRTC cannot be loaded.
    #[error(
        "no {library} found (looked for {names}); put the folder holding it on LD_LIBRARY_PATH (a CUDA toolkit's \
         lib64, or a PyTorch install's site-packages/nvidia/*/lib)"
    )]
    MissingLibrary {
        /// The library (`cuBLAS`, `NVRTC`).
        library: &'static str,
        /// The file names looked for.
        names: &'static str,
    },
    /// The model's shape or the device's compute capability is outside what the kernels support.
    #[error("model shape not supported by the live CUDA kernels: {0}")]
    Unsupported(String),
    /// NVRTC failed to compile `kernels.cu`.
    #[error("compiling the kernels with NVRTC failed: {0}")]
    Compile(String),
    /// The device has too little free memory for the buffers (more than 95 % of it needed).
    #[error(
        "not enough GPU memory on `{name}`: one layer, the LM head, activations and KV buffers need {need} bytes, \
         {free} are free (lower KVFLEET_CUDA_MAX_TOKENS or KVFLEET_CUDA_KV_TOKENS)"
    )]
    Memory {
        /// Bytes needed.
        need: u64,
        /// Bytes free on the device.
        free: u64,
        /// The device's name.
        name: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver call failed {what}: {detail}")]
    Driver {
        /// The step that failed.
        what: &'static str,
        /// The driver's error.
        detail: String,
    },
    /// A cuBLAS call failed.
    #[error("cuBLAS call failed {what}: {detail}")]
    Cublas {
        /// The step that failed.
        what: &'static str,
        /// cuBLAS's error.
        detail: String,
    },
    /// A `KVFLEET_CUDA_*` variable has a bad value.
    #[error("invalid {name} = `{value}`: {message}")]
    Config {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it.
        message: String,
    },
    /// The analytic fallback model could not be built.
    #[error(transparent)]
    Timing(#[from] kvfleet_core::timing::TimingError),
}

/// Capacity and measurement settings. Defaults suit an 80 GB GPU running one worker; each can be
/// set from the environment ([`CudaTimingConfig::from_env`]).
#[derive(Clone, Debug, PartialEq)]
pub struct CudaTimingConfig {
    /// CUDA device ordinal (`KVFLEET_CUDA_DEVICE`, default 0).
    pub device: usize,
    /// Most tokens (GEMM rows) in one iteration (`KVFLEET_CUDA_MAX_TOKENS`, default 32768).
    pub max_tokens: u32,
    /// Tokens of one layer's KV cache; decode reads wrap around it (`KVFLEET_CUDA_KV_TOKENS`,
    /// default 262144 = 1 GiB for the 32B shape, far above the L2 cache, so every read is from HBM).
    pub kv_tokens: u32,
    /// Most sequences through the LM head in one iteration (`KVFLEET_CUDA_LOGIT_ROWS`, default 1024).
    pub logit_rows: u32,
    /// Signature resolution (`KVFLEET_CUDA_SIGNATURE_BITS`, default 5: ≤ 1.6 % rounding).
    pub signature_bits: u32,
    /// Untimed runs before each measurement.
    pub warmup: u32,
    /// Timed runs per measurement; the median is used (`KVFLEET_CUDA_REPS`, default 5).
    pub reps: u32,
    /// Bytes per pinned copy when measuring host↔device rates at start (256 MiB).
    pub copy_bytes: u64,
}

impl Default for CudaTimingConfig {
    fn default() -> Self {
        CudaTimingConfig {
            device: 0,
            max_tokens: 32_768,
            kv_tokens: 262_144,
            logit_rows: 1024,
            signature_bits: 5,
            warmup: 2,
            reps: 5,
            copy_bytes: 256 << 20,
        }
    }
}

impl CudaTimingConfig {
    /// Defaults overridden by `KVFLEET_CUDA_*` variables; a bad value is an error naming it.
    pub fn from_env() -> Result<CudaTimingConfig, CudaError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<CudaTimingConfig, CudaError> {
        let mut c = CudaTimingConfig::default();
        let read = |name: &'static str, min: u64, max: u64, slot: &mut u64| -> Result<(), CudaError> {
            if let Some(v) = get(name) {
                let parsed: u64 = v.trim().parse().map_err(|_| CudaError::Config {
                    name,
                    value: v.clone(),
                    message: "not a whole number".into(),
                })?;
                if !(min..=max).contains(&parsed) {
                    return Err(CudaError::Config { name, value: v, message: format!("must be in {min}..={max}") });
                }
                *slot = parsed;
            }
            Ok(())
        };
        let mut v = [
            c.device as u64,
            c.max_tokens as u64,
            c.kv_tokens as u64,
            c.logit_rows as u64,
            c.signature_bits as u64,
            c.reps as u64,
        ];
        read("KVFLEET_CUDA_DEVICE", 0, 1023, &mut v[0])?;
        read("KVFLEET_CUDA_MAX_TOKENS", 256, 1 << 20, &mut v[1])?;
        read("KVFLEET_CUDA_KV_TOKENS", 4096, 1 << 26, &mut v[2])?;
        read("KVFLEET_CUDA_LOGIT_ROWS", 1, 1 << 16, &mut v[3])?;
        read("KVFLEET_CUDA_SIGNATURE_BITS", 2, 16, &mut v[4])?;
        read("KVFLEET_CUDA_REPS", 1, 64, &mut v[5])?;
        c.device = v[0] as usize;
        c.max_tokens = v[1] as u32;
        c.kv_tokens = (v[2] as u32).max(c.max_tokens);
        c.logit_rows = v[3] as u32;
        c.signature_bits = v[4] as u32;
        c.reps = v[5] as u32;
        Ok(c)
    }
}

/// Whether the CUDA driver library can be loaded (says nothing about devices).
pub fn driver_library_present() -> bool {
    // SAFETY: only tries to dlopen the candidate names and closes what it opened.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether NVRTC can be loaded (the kernels compile without a GPU).
pub fn nvrtc_library_present() -> bool {
    // SAFETY: as above.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Whether cuBLAS can be loaded.
pub fn cublas_library_present() -> bool {
    // SAFETY: as above.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

/// Checks, without allocating anything, that device `ordinal` can be used: the driver and the
/// two libraries load, the driver initialises, and the device exists. Errors say what is missing.
pub fn probe(ordinal: usize) -> Result<(), CudaError> {
    if !driver_library_present() {
        return Err(CudaError::NoDriver);
    }
    cudarc::driver::result::init()
        .map_err(|e| CudaError::NoDevice(format!("the driver did not initialise ({e:?})")))?;
    let count = cudarc::driver::result::device::get_count()
        .map_err(|e| CudaError::NoDevice(format!("counting devices failed ({e:?})")))?;
    if count <= 0 {
        return Err(CudaError::NoDevice("the driver reports 0 devices".into()));
    }
    if ordinal >= count as usize {
        return Err(CudaError::NoDevice(format!("device {ordinal} requested, {count} present")));
    }
    if !cublas_library_present() {
        return Err(CudaError::MissingLibrary {
            library: "cuBLAS",
            names: "libcublas.so, libcublas.so.13, libcublas.so.12",
        });
    }
    if !nvrtc_library_present() {
        return Err(CudaError::MissingLibrary {
            library: "NVRTC",
            names: "libnvrtc.so, libnvrtc.so.13, libnvrtc.so.12",
        });
    }
    Ok(())
}

/// One measured (or fallen-back) iteration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measurement {
    /// The signature that was timed.
    pub signature: BatchSignature,
    /// One decoder layer, median of the repetitions (0 when `fallback`).
    pub layer_ms: f64,
    /// Final norm + LM head + sampling, median.
    pub head_ms: f64,
    /// `layers × layer_ms + head_ms`, or the analytic model's time when `fallback`.
    pub iter_ms: f64,
    /// The shape did not fit the buffers or the GPU run failed: analytic time instead.
    pub fallback: bool,
}

/// Counters for reports and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CudaStats {
    /// Signatures timed on the GPU.
    pub measured: u64,
    /// Signatures answered by the analytic fallback.
    pub fallbacks: u64,
    /// Iterations answered from the cache.
    pub cache_hits: u64,
    /// Wall time spent measuring, seconds.
    pub measuring_s: f64,
}

struct State {
    gpu: gpu::Gpu,
    cache: HashMap<BatchSignature, Measurement>,
    stats: CudaStats,
    warned: bool,
}

/// Live CUDA timing ([`TimingModel`] `cuda`).
pub struct CudaTiming {
    shapes: LayerShapes,
    cfg: CudaTimingConfig,
    info: DeviceInfo,
    fallback: AnalyticTiming,
    h2d_bytes_per_s: f64,
    d2h_bytes_per_s: f64,
    state: Mutex<State>,
}

impl std::fmt::Debug for CudaTiming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTiming")
            .field("device", &self.info.name)
            .field("shapes", &self.shapes)
            .field("h2d_gbps", &(self.h2d_bytes_per_s * 1e-9))
            .field("d2h_gbps", &(self.d2h_bytes_per_s * 1e-9))
            .finish()
    }
}

impl CudaTiming {
    /// Opens device `cfg.device`, compiles the kernels for `model`, allocates one layer and the
    /// head, fills them with random values and measures the pinned copy rates. `gpu` only feeds
    /// the analytic fallback. Seconds on a GPU host; an error naming what is missing elsewhere.
    pub fn new(model: &ModelSpec, gpu: &GpuSpec, cfg: CudaTimingConfig) -> Result<CudaTiming, CudaError> {
        let shapes = LayerShapes::from_model(model);
        kernels::check_supported(&shapes)?;
        let fallback = AnalyticTiming::new(model, gpu)?;
        probe(cfg.device)?;
        let g = gpu::Gpu::open(shapes, cfg.clone())?;
        let (h2d, d2h) = g.copy_rates()?;
        let info = g.info.clone();
        tracing::info!(
            device = %info.name,
            sm = info.sm_count,
            allocated_gib = info.allocated_bytes as f64 / (1u64 << 30) as f64,
            h2d_gbps = h2d,
            d2h_gbps = d2h,
            "live CUDA timing ready"
        );
        Ok(CudaTiming {
            shapes,
            cfg,
            info,
            fallback,
            h2d_bytes_per_s: h2d * 1e9,
            d2h_bytes_per_s: d2h * 1e9,
            state: Mutex::new(State { gpu: g, cache: HashMap::new(), stats: CudaStats::default(), warned: false }),
        })
    }

    /// What was found on the device.
    pub fn device(&self) -> &DeviceInfo {
        &self.info
    }
    /// The settings in use (after clamping).
    pub fn config(&self) -> &CudaTimingConfig {
        &self.cfg
    }
    /// Measured pinned host → device rate, GB/s.
    pub fn h2d_gbytes_per_s(&self) -> f64 {
        self.h2d_bytes_per_s * 1e-9
    }
    /// Measured pinned device → host rate, GB/s.
    pub fn d2h_gbytes_per_s(&self) -> f64 {
        self.d2h_bytes_per_s * 1e-9
    }
    /// Counters so far.
    pub fn stats(&self) -> CudaStats {
        self.state.lock().map(|s| s.stats).unwrap_or_default()
    }

    /// The measurement for `shape`'s signature: from the cache, or timed now. Errors only for a
    /// GPU failure on a shape that fits (the [`TimingModel`] impl falls back instead).
    pub fn measure(&self, shape: &BatchShape) -> Result<Measurement, CudaError> {
        let sig = BatchSignature::of(shape, self.cfg.signature_bits);
        if sig.is_empty() {
            return Ok(Measurement { signature: sig, layer_ms: 0.0, head_ms: 0.0, iter_ms: 0.0, fallback: false });
        }
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = st.cache.get(&sig) {
            let m = *m;
            st.stats.cache_hits += 1;
            return Ok(m);
        }
        let analytic = |sig: BatchSignature| Measurement {
            signature: sig,
            layer_ms: 0.0,
            head_ms: 0.0,
            iter_ms: self.fallback.iteration_ms(&sig.representative()),
            fallback: true,
        };
        let m = if st.gpu.fits(&sig) {
            let t0 = Instant::now();
            let timed = st.gpu.measure(&sig);
            st.stats.measuring_s += t0.elapsed().as_secs_f64();
            let t = timed?;
            st.stats.measured += 1;
            Measurement {
                signature: sig,
                layer_ms: t.layer_ms,
                head_ms: t.head_ms,
                iter_ms: self.shapes.layers as f64 * t.layer_ms + t.head_ms,
                fallback: false,
            }
        } else {
            if !st.warned {
                st.warned = true;
                tracing::warn!(
                    ?sig,
                    max_tokens = self.cfg.max_tokens,
                    logit_rows = self.cfg.logit_rows,
                    "iteration shape exceeds the live CUDA buffers; using the analytic model for such shapes"
                );
            }
            st.stats.fallbacks += 1;
            analytic(sig)
        };
        st.cache.insert(sig, m);
        Ok(m)
    }

    /// Iteration time in ms: measured, or the analytic model's after a GPU failure (logged once).
    pub fn iteration_ms(&self, shape: &BatchShape) -> f64 {
        match self.measure(shape) {
            Ok(m) => m.iter_ms,
            Err(e) => {
                let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                if !st.warned {
                    st.warned = true;
                    tracing::warn!(error = %e, "live CUDA timing failed; using the analytic model for this shape");
                }
                st.stats.fallbacks += 1;
                let sig = BatchSignature::of(shape, self.cfg.signature_bits);
                let iter_ms = self.fallback.iteration_ms(shape);
                st.cache
                    .insert(sig, Measurement { signature: sig, layer_ms: 0.0, head_ms: 0.0, iter_ms, fallback: true });
                iter_ms
            }
        }
    }
}

impl TimingModel for CudaTiming {
    fn name(&self) -> &str {
        "cuda"
    }
    fn iteration(&self, batch: &BatchShape) -> TimeSpan {
        TimeSpan::from_millis_f64(self.iteration_ms(batch))
    }
    fn offload(&self, bytes: u64) -> TimeSpan {
        TimeSpan::from_secs_f64(bytes as f64 / self.d2h_bytes_per_s)
    }
    fn reload(&self, bytes: u64) -> TimeSpan {
        TimeSpan::from_secs_f64(bytes as f64 / self.h2d_bytes_per_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen32b() -> (ModelSpec, GpuSpec) {
        (ModelSpec::load("r1-distill-qwen-32b").unwrap(), GpuSpec::load("h100-80gb").unwrap())
    }

    /// Without libcuda (this crate's CI machines), construction fails with an error naming it.
    #[test]
    fn constructor_names_the_missing_driver() {
        let (m, g) = qwen32b();
        match CudaTiming::new(&m, &g, CudaTimingConfig::default()) {
            Err(e) if !driver_library_present() => {
                let text = e.to_string();
                assert!(matches!(e, CudaError::NoDriver), "{e:?}");
                assert!(text.contains("no CUDA driver (libcuda.so) found"), "{text}");
            }
            Err(e) => println!("skipped: a CUDA driver is present here; construction said: {e}"),
            Ok(t) => println!("skipped: a CUDA driver and device are present ({})", t.device().name),
        }
    }

    #[test]
    fn probe_reports_the_first_missing_piece() {
        match probe(0) {
            Err(CudaError::NoDriver) => assert!(!driver_library_present()),
            Err(e) => println!("skipped: driver present; probe said: {e}"),
            Ok(()) => println!("skipped: a usable CUDA device is present"),
        }
    }

    #[test]
    fn unsupported_models_fail_before_touching_the_driver() {
        let (mut m, g) = qwen32b();
        m.head_dim = 96;
        let e = CudaTiming::new(&m, &g, CudaTimingConfig::default()).unwrap_err();
        assert!(matches!(e, CudaError::Unsupported(_)) && e.to_string().contains("head_dim"), "{e}");
    }

    #[test]
    fn config_from_environment_values() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        assert_eq!(CudaTimingConfig::from_lookup(env(&[])).unwrap(), CudaTimingConfig::default());
        let c =
            CudaTimingConfig::from_lookup(env(&[("KVFLEET_CUDA_MAX_TOKENS", "8192"), ("KVFLEET_CUDA_DEVICE", "1")]))
                .unwrap();
        assert_eq!((c.max_tokens, c.device), (8192, 1));
        // The KV cache always holds a full iteration's tokens (prefill K/V are not wrapped).
        let c = CudaTimingConfig::from_lookup(env(&[
            ("KVFLEET_CUDA_MAX_TOKENS", "65536"),
            ("KVFLEET_CUDA_KV_TOKENS", "4096"),
        ]))
        .unwrap();
        assert_eq!(c.kv_tokens, 65536);
        for (bad, name) in [
            (&[("KVFLEET_CUDA_MAX_TOKENS", "lots")][..], "KVFLEET_CUDA_MAX_TOKENS"),
            (&[("KVFLEET_CUDA_REPS", "0")][..], "KVFLEET_CUDA_REPS"),
        ] {
            let e = CudaTimingConfig::from_lookup(env(bad)).unwrap_err().to_string();
            assert!(e.contains(name), "{e}");
        }
    }

    #[test]
    fn decode_splits_fill_the_gpu_without_tiny_splits() {
        // H100: 132 SMs → ~528 blocks wanted.
        assert_eq!(gpu::Gpu::decode_splits(132, 1, 8, 16384), 64); // 528 / 8 = 66, ≤ 16384 / 256 = 64
        assert_eq!(gpu::Gpu::decode_splits(132, 1, 8, 1024), 4); // at least 256 tokens per split
        assert_eq!(gpu::Gpu::decode_splits(132, 64, 8, 4096), 2);
        assert_eq!(gpu::Gpu::decode_splits(132, 256, 8, 128), 1);
    }
}
