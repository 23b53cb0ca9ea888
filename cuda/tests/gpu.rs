//! Live CUDA timing on a real GPU. Without one (CI) each test prints `skipped: no CUDA device`
//! and returns. On a GPU host: `cargo test -p kvfleet-cuda --release -- --nocapture`.

use kvfleet_core::spec::{GpuSpec, ModelSpec};
use kvfleet_core::timing::{BatchShape, ProfileTiming, TimingModel};
use kvfleet_cuda::{probe, CudaTiming, CudaTimingConfig};

fn gpu_or_skip() -> bool {
    match probe(0) {
        Ok(()) => true,
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            false
        }
    }
}

fn decode(b: u32, ctx: u32) -> BatchShape {
    let mut s = BatchShape::default();
    for _ in 0..b {
        s.add_decode(ctx);
    }
    s
}

fn prefill(t: u32) -> BatchShape {
    let mut s = BatchShape::default();
    s.add_prefill(t);
    s
}

/// Measures a few shapes of the 32B model and checks what must hold on any bf16 GPU: times are
/// positive and finite, grow with batch, context and prompt length, the cache answers repeats,
/// and copy rates are plausible. On an H100 it also prints the ratio to the shipped profile.
#[test]
fn live_timing_behaves_like_a_gpu() {
    if !gpu_or_skip() {
        return;
    }
    let (m, g) = (ModelSpec::load("r1-distill-qwen-32b").unwrap(), GpuSpec::load("h100-80gb").unwrap());
    let cfg = CudaTimingConfig { max_tokens: 8192, kv_tokens: 262_144, ..Default::default() };
    let t = match CudaTiming::new(&m, &g, cfg) {
        Ok(t) => t,
        Err(e) => panic!("a CUDA device is present but live timing could not start: {e}"),
    };
    println!("device: {:?}", t.device());
    println!("copy: h2d {:.1} GB/s, d2h {:.1} GB/s", t.h2d_gbytes_per_s(), t.d2h_gbytes_per_s());
    assert!(t.h2d_gbytes_per_s() > 1.0 && t.d2h_gbytes_per_s() > 1.0);

    let ms = |s: &BatchShape| {
        let m = t.measure(s).unwrap();
        assert!(!m.fallback && m.iter_ms.is_finite() && m.iter_ms > 0.0, "{s:?}: {m:?}");
        m.iter_ms
    };
    let d1 = ms(&decode(1, 128));
    let d64 = ms(&decode(64, 2048));
    let d1_long = ms(&decode(1, 16384));
    let p512 = ms(&prefill(512));
    let p4096 = ms(&prefill(4096));
    assert!(d64 > d1, "batch 64 ({d64}) not slower than batch 1 ({d1})");
    assert!(d1_long > d1, "context 16384 ({d1_long}) not slower than 128 ({d1})");
    assert!(p4096 > 4.0 * p512, "prefill 4096 ({p4096}) vs 512 ({p512})");
    let before = t.stats();
    let again = ms(&decode(64, 2048));
    assert_eq!(again, d64);
    assert_eq!(t.stats().cache_hits, before.cache_hits + 1);

    let profile = ProfileTiming::builtin_h100_qwen32b();
    for (name, s) in [
        ("decode b=1 c=128", decode(1, 128)),
        ("decode b=64 c=2048", decode(64, 2048)),
        ("decode b=1 c=16384", decode(1, 16384)),
        ("prefill 512", prefill(512)),
        ("prefill 4096", prefill(4096)),
    ] {
        let (c, p) = (t.iteration(&s).as_millis_f64(), profile.iteration(&s).as_millis_f64());
        println!("{name:<20} cuda {c:>9.3} ms  profile(H100) {p:>9.3} ms  ratio {:.3}", c / p);
    }
    println!("stats: {:?}", t.stats());
}

/// Shapes beyond the buffers fall back to the analytic model instead of failing.
#[test]
fn oversized_shapes_fall_back() {
    if !gpu_or_skip() {
        return;
    }
    let (m, g) = (ModelSpec::load("llama-3-8b").unwrap(), GpuSpec::load("h100-80gb").unwrap());
    let cfg = CudaTimingConfig { max_tokens: 1024, kv_tokens: 65_536, logit_rows: 64, ..Default::default() };
    let t = CudaTiming::new(&m, &g, cfg).expect("live timing starts");
    let m = t.measure(&prefill(4096)).unwrap();
    assert!(m.fallback && m.iter_ms > 0.0, "{m:?}");
    assert_eq!(t.stats().fallbacks, 1);
}
