//! The device side: one decoder layer's buffers on the GPU, its kernel sequence, and timing it
//! with CUDA events.
//!
//! Raw driver calls (`cudarc::driver::result`) rather than cudarc's tracked slices: everything
//! runs on one stream in order, so there is nothing for per-buffer events to synchronise, and a
//! timed layer is exactly the launches below. Every buffer is filled with random bf16 values once
//! (tensor-core throughput and power depend on the data; zeros run faster than real weights).

use crate::kernels::{compile_options, KERNELS_CU};
use crate::shapes::LayerShapes;
use crate::signature::BatchSignature;
use crate::{CudaError, CudaTimingConfig};
use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{result as drv, sys, CudaContext, CudaEvent, CudaFunction, CudaStream};
use std::ffi::c_void;
use std::sync::Arc;

fn driver(what: &'static str) -> impl Fn(drv::DriverError) -> CudaError {
    move |e| CudaError::Driver { what, detail: format!("{e:?}") }
}

fn cublas(what: &'static str) -> impl Fn(blas::CublasError) -> CudaError {
    move |e| CudaError::Cublas { what, detail: format!("{e:?}") }
}

/// A device allocation freed on drop.
struct DeviceBuf {
    ptr: sys::CUdeviceptr,
    ctx: Arc<CudaContext>,
}

impl DeviceBuf {
    fn new(ctx: &Arc<CudaContext>, bytes: u64, what: &'static str) -> Result<DeviceBuf, CudaError> {
        let ptr = unsafe { drv::malloc_sync(bytes.max(16) as usize) }
            .map_err(|e| CudaError::Driver { what, detail: format!("allocating {bytes} bytes: {e:?}") })?;
        Ok(DeviceBuf { ptr, ctx: ctx.clone() })
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let _ = unsafe { drv::free_sync(self.ptr) };
    }
}

/// A kernel argument, by value, as the kernel's parameter list declares it.
enum Arg {
    Ptr(u64),
    U64(u64),
    I32(i32),
    U32(u32),
    F32(f32),
}

struct Kernels {
    fill_random: CudaFunction,
    add_rmsnorm: CudaFunction,
    rope_kv_write: CudaFunction,
    silu_mul: CudaFunction,
    decode_attention: CudaFunction,
    prefill_attention: CudaFunction,
    sample_rows: CudaFunction,
}

struct Buffers {
    w_qkv: DeviceBuf,
    w_o: DeviceBuf,
    w_gate_up: DeviceBuf,
    w_down: DeviceBuf,
    norm: DeviceBuf,
    lm_head: DeviceBuf,
    x: DeviceBuf,
    residual: DeviceBuf,
    xn: DeviceBuf,
    qkv: DeviceBuf,
    attn: DeviceBuf,
    gate_up: DeviceBuf,
    act: DeviceBuf,
    kcache: DeviceBuf,
    vcache: DeviceBuf,
    partial: DeviceBuf,
    logits: DeviceBuf,
    tokens: DeviceBuf,
}

/// What was found on the device at construction.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    /// The device's name (e.g. `NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// Compute capability (major, minor); 8.0 or newer is required.
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// Device memory, bytes.
    pub total_bytes: u64,
    /// Free device memory before this process allocated anything, bytes.
    pub free_bytes_at_start: u64,
    /// Device memory allocated for the layer, head, activations and KV buffers, bytes.
    pub allocated_bytes: u64,
}

pub(crate) struct Gpu {
    pub info: DeviceInfo,
    shapes: LayerShapes,
    cfg: CudaTimingConfig,
    /// Decode-attention blocks the partial-sum buffer holds.
    partial_blocks: u64,
    kernels: Kernels,
    bufs: Buffers,
    events: Vec<CudaEvent>,
    blas: CudaBlas,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
}

/// Per-layer and head medians of one timed shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timed {
    /// One decoder layer, median, milliseconds.
    pub layer_ms: f64,
    /// Final norm + LM head + sampling, median, milliseconds.
    pub head_ms: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

impl Gpu {
    /// Opens the device, compiles the kernels, allocates and fills one layer's buffers.
    pub fn open(shapes: LayerShapes, mut cfg: CudaTimingConfig) -> Result<Gpu, CudaError> {
        // Prefill K/V are written and read without wrapping: the cache holds a full iteration.
        cfg.kv_tokens = cfg.kv_tokens.max(cfg.max_tokens);
        let ctx = CudaContext::new(cfg.device)
            .map_err(|e| CudaError::NoDevice(format!("opening device {}: {e:?}", cfg.device)))?;
        let name = ctx.name().map_err(driver("reading the device name"))?;
        let cc = ctx.compute_capability().map_err(driver("reading the compute capability"))?;
        if cc.0 < 8 {
            return Err(CudaError::Unsupported(format!(
                "device {} `{name}` has compute capability {}.{}; live timing needs 8.0 or newer (bf16 tensor cores)",
                cfg.device, cc.0, cc.1
            )));
        }
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver("reading the multiprocessor count"))? as u32;
        let (free, total) = ctx.mem_get_info().map_err(driver("reading free memory"))?;
        let (max_tokens, kv_tokens, logit_rows) = (cfg.max_tokens as u64, cfg.kv_tokens as u64, cfg.logit_rows as u64);
        let partial_blocks = (8 * sm_count as u64).max(max_tokens.min(4096) * shapes.kv_heads);
        let partial_bytes = partial_blocks * shapes.group() * shapes.head_dim * 4;
        let need = shapes.device_bytes(max_tokens, kv_tokens, logit_rows) + partial_bytes + cfg.copy_bytes;
        if need as f64 > 0.95 * free as f64 {
            return Err(CudaError::Memory { need, free: free as u64, name });
        }

        let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNELS_CU, compile_options(&shapes, cc))
            .map_err(|e| CudaError::Compile(format!("{e}")))?;
        let module = ctx.load_module(ptx).map_err(driver("loading the compiled kernels"))?;
        let load = |n: &str| module.load_function(n).map_err(driver("finding a kernel in the module"));
        let kernels = Kernels {
            fill_random: load("fill_random")?,
            add_rmsnorm: load("add_rmsnorm")?,
            rope_kv_write: load("rope_kv_write")?,
            silu_mul: load("silu_mul")?,
            decode_attention: load("decode_attention")?,
            prefill_attention: load("prefill_attention")?,
            sample_rows: load("sample_rows")?,
        };
        let stream = ctx.new_stream().map_err(driver("creating a stream"))?;
        let blas = CudaBlas::new(stream.clone()).map_err(cublas("creating the cuBLAS handle"))?;

        let s = &shapes;
        let e = s.dtype_bytes;
        let alloc = |elems: u64, what| DeviceBuf::new(&ctx, elems * e, what);
        let bufs = Buffers {
            w_qkv: alloc(s.qkv_width() * s.hidden, "allocating the QKV weight")?,
            w_o: alloc(s.hidden * s.q_width(), "allocating the O weight")?,
            w_gate_up: alloc(2 * s.intermediate * s.hidden, "allocating the gate/up weight")?,
            w_down: alloc(s.hidden * s.intermediate, "allocating the down weight")?,
            norm: alloc(3 * s.hidden, "allocating the norm scales")?,
            lm_head: alloc(s.vocab * s.hidden, "allocating the LM head")?,
            x: alloc(max_tokens * s.hidden, "allocating activations")?,
            residual: alloc(max_tokens * s.hidden, "allocating activations")?,
            xn: alloc(max_tokens * s.hidden, "allocating activations")?,
            qkv: alloc(max_tokens * s.qkv_width(), "allocating activations")?,
            attn: alloc(max_tokens * s.q_width(), "allocating activations")?,
            gate_up: alloc(max_tokens * 2 * s.intermediate, "allocating activations")?,
            act: alloc(max_tokens * s.intermediate, "allocating activations")?,
            kcache: alloc(kv_tokens * s.kv_width(), "allocating the KV cache")?,
            vcache: alloc(kv_tokens * s.kv_width(), "allocating the KV cache")?,
            partial: DeviceBuf::new(&ctx, partial_bytes, "allocating attention partials")?,
            logits: alloc(logit_rows * s.vocab, "allocating logits")?,
            tokens: DeviceBuf::new(&ctx, logit_rows * 4, "allocating sampled tokens")?,
        };
        let events = (0..=cfg.reps.max(1))
            .map(|_| ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(driver("creating timing events"))?;
        let allocated_bytes = need - cfg.copy_bytes;
        let gpu = Gpu {
            info: DeviceInfo {
                name,
                compute_capability: cc,
                sm_count,
                total_bytes: total as u64,
                free_bytes_at_start: free as u64,
                allocated_bytes,
            },
            shapes,
            cfg,
            partial_blocks,
            kernels,
            bufs,
            events,
            blas,
            stream,
            ctx,
        };
        gpu.fill_all()?;
        Ok(gpu)
    }

    fn launch(&self, f: &CudaFunction, grid: (u32, u32, u32), block: u32, mut args: Vec<Arg>) -> Result<(), CudaError> {
        let mut ptrs: Vec<*mut c_void> = args
            .iter_mut()
            .map(|a| match a {
                Arg::Ptr(v) | Arg::U64(v) => v as *mut u64 as *mut c_void,
                Arg::I32(v) => v as *mut i32 as *mut c_void,
                Arg::U32(v) => v as *mut u32 as *mut c_void,
                Arg::F32(v) => v as *mut f32 as *mut c_void,
            })
            .collect();
        // SAFETY: each pointer addresses a value of the type the kernel declares at that position
        // (see kernels.cu), alive until the call returns (the driver copies parameters at launch).
        unsafe { drv::launch_kernel(f.cu_function(), grid, (block, 1, 1), 0, self.stream.cu_stream(), &mut ptrs) }
            .map_err(driver("launching a kernel"))
    }

    fn fill(&self, buf: &DeviceBuf, elems: u64, seed: u32) -> Result<(), CudaError> {
        let blocks = (elems.div_ceil(256)).clamp(1, 65_535) as u32;
        self.launch(
            &self.kernels.fill_random,
            (blocks, 1, 1),
            256,
            vec![Arg::Ptr(buf.ptr), Arg::U64(elems), Arg::U32(seed), Arg::F32(0.05)],
        )
    }

    fn fill_all(&self) -> Result<(), CudaError> {
        let s = &self.shapes;
        let (t, kv) = (self.cfg.max_tokens as u64, self.cfg.kv_tokens as u64);
        let b = &self.bufs;
        let list: [(&DeviceBuf, u64); 16] = [
            (&b.w_qkv, s.qkv_width() * s.hidden),
            (&b.w_o, s.hidden * s.q_width()),
            (&b.w_gate_up, 2 * s.intermediate * s.hidden),
            (&b.w_down, s.hidden * s.intermediate),
            (&b.norm, 3 * s.hidden),
            (&b.lm_head, s.vocab * s.hidden),
            (&b.x, t * s.hidden),
            (&b.residual, t * s.hidden),
            (&b.xn, t * s.hidden),
            (&b.qkv, t * s.qkv_width()),
            (&b.attn, t * s.q_width()),
            (&b.gate_up, t * 2 * s.intermediate),
            (&b.act, t * s.intermediate),
            (&b.kcache, kv * s.kv_width()),
            (&b.vcache, kv * s.kv_width()),
            (&b.logits, self.cfg.logit_rows as u64 * s.vocab),
        ];
        self.ctx.bind_to_thread().map_err(driver("binding the context"))?;
        for (i, (buf, n)) in list.iter().enumerate() {
            self.fill(buf, *n, 0x5EED_0000 + i as u32)?;
        }
        self.stream.synchronize().map_err(driver("filling buffers with random values"))
    }

    /// `y[m × n] = x[m × k] · w[n × k]ᵀ` in bf16 with f32 accumulation (cuBLAS is column-major:
    /// this is `yᵀ = w · xᵀ`, the "TN" GEMM PyTorch issues for `Linear`).
    fn gemm(&self, w: &DeviceBuf, x: &DeviceBuf, y: &DeviceBuf, m: u64, n: u64, k: u64) -> Result<(), CudaError> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let bf16 = blas_sys::cudaDataType::CUDA_R_16BF;
        // SAFETY: w holds n·k, x at least m·k and y at least m·n elements (sized from the same
        // shapes with m ≤ max_tokens or logit_rows); alpha and beta are host f32 (pointer mode host).
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                m as i32,
                k as i32,
                &alpha as *const f32 as *const c_void,
                w.ptr as *const c_void,
                bf16,
                k as i32,
                x.ptr as *const c_void,
                bf16,
                k as i32,
                &beta as *const f32 as *const c_void,
                y.ptr as *mut c_void,
                bf16,
                n as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(cublas("running a GEMM"))
    }

    /// Blocks of the split-K decode attention: enough to fill the GPU about four times over, at
    /// least 256 tokens per split.
    pub fn decode_splits(sm_count: u64, seqs: u64, kv_heads: u64, context: u64) -> u64 {
        let want = (4 * sm_count).div_ceil((seqs * kv_heads).max(1));
        want.clamp(1, (context / 256).max(1))
    }

    /// Whether `sig` fits the allocated buffers.
    pub fn fits(&self, sig: &BatchSignature) -> bool {
        let s = &self.shapes;
        let blocks = sig.decode_seqs as u64 * s.kv_heads;
        // Grid y/z dimensions (sequences, prompts) are limited to 65535 blocks.
        sig.tokens() <= self.cfg.max_tokens as u64
            && sig.logit_rows() <= self.cfg.logit_rows as u64
            && (sig.decode_seqs == 0 || blocks <= self.partial_blocks)
            && sig.decode_seqs <= 65_535
            && sig.prompts <= 65_535
    }

    /// One decoder layer for `sig` (see the crate doc for the kernel sequence).
    fn layer(&self, sig: &BatchSignature) -> Result<(), CudaError> {
        let s = &self.shapes;
        let b = &self.bufs;
        let t = sig.tokens();
        let (hidden, qkv_w, q_w, kv_w, inter) =
            (s.hidden as i32, s.qkv_width() as i32, s.q_width() as i32, s.kv_width() as i32, s.intermediate as i32);
        let cap = self.cfg.kv_tokens as u64;
        self.launch(
            &self.kernels.add_rmsnorm,
            (t as u32, 1, 1),
            256,
            vec![
                Arg::Ptr(b.x.ptr),
                Arg::Ptr(b.residual.ptr),
                Arg::Ptr(b.norm.ptr),
                Arg::Ptr(b.xn.ptr),
                Arg::I32(hidden),
            ],
        )?;
        self.gemm(&b.w_qkv, &b.xn, &b.qkv, t, s.qkv_width(), s.hidden)?;
        self.launch(
            &self.kernels.rope_kv_write,
            (t as u32, 1, 1),
            256,
            vec![
                Arg::Ptr(b.qkv.ptr),
                Arg::Ptr(b.kcache.ptr),
                Arg::Ptr(b.vcache.ptr),
                Arg::I32(q_w),
                Arg::I32(kv_w),
                Arg::U64(0),
                Arg::U64(cap),
                Arg::I32(sig.decode_context as i32),
            ],
        )?;
        if sig.decode_seqs > 0 {
            // Four times the blocks `decode_splits` aims at per SM (16 per SM): the kernel holds
            // three blocks per SM and a block's split is short, so the grid runs in ~5 waves and the
            // last one's tail is a small part of the time.
            let splits = Self::decode_splits(
                4 * self.info.sm_count as u64,
                sig.decode_seqs as u64,
                s.kv_heads,
                sig.decode_context as u64,
            )
            .min(self.partial_blocks / (sig.decode_seqs as u64 * s.kv_heads))
            .max(1);
            self.launch(
                &self.kernels.decode_attention,
                (splits as u32, s.kv_heads as u32, sig.decode_seqs),
                128,
                vec![
                    Arg::Ptr(b.qkv.ptr),
                    Arg::I32(qkv_w),
                    Arg::Ptr(b.kcache.ptr),
                    Arg::Ptr(b.vcache.ptr),
                    Arg::Ptr(b.partial.ptr),
                    Arg::I32(sig.decode_context as i32),
                    Arg::U64(cap),
                    Arg::I32(s.kv_heads as i32),
                ],
            )?;
        }
        if sig.prompts > 0 {
            let row0 = sig.decode_seqs as u64;
            self.launch(
                &self.kernels.prefill_attention,
                // 128 query rows per block, 8 warps (PF_ROWS, PF_WARPS in kernels.cu).
                (sig.prompt_len.div_ceil(128), s.q_heads as u32, sig.prompts),
                256,
                vec![
                    Arg::Ptr(b.qkv.ptr),
                    Arg::I32(qkv_w),
                    Arg::Ptr(b.kcache.ptr),
                    Arg::Ptr(b.vcache.ptr),
                    Arg::Ptr(b.attn.ptr),
                    Arg::I32(q_w),
                    Arg::I32(sig.prompt_len as i32),
                    Arg::U64(row0),
                    Arg::U64(row0),
                    Arg::I32(s.kv_heads as i32),
                ],
            )?;
        }
        self.gemm(&b.w_o, &b.attn, &b.x, t, s.hidden, s.q_width())?;
        self.launch(
            &self.kernels.add_rmsnorm,
            (t as u32, 1, 1),
            256,
            vec![
                Arg::Ptr(b.x.ptr),
                Arg::Ptr(b.residual.ptr),
                Arg::Ptr(b.norm.ptr),
                Arg::Ptr(b.xn.ptr),
                Arg::I32(hidden),
            ],
        )?;
        self.gemm(&b.w_gate_up, &b.xn, &b.gate_up, t, 2 * s.intermediate, s.hidden)?;
        let chunks = t * s.intermediate / 8;
        self.launch(
            &self.kernels.silu_mul,
            (chunks.div_ceil(256).clamp(1, 65_535) as u32, 1, 1),
            256,
            vec![Arg::Ptr(b.gate_up.ptr), Arg::Ptr(b.act.ptr), Arg::U64(t), Arg::I32(inter)],
        )?;
        self.gemm(&b.w_down, &b.act, &b.x, t, s.hidden, s.intermediate)
    }

    /// Final norm, LM head on one row per sequence, sampling.
    fn head(&self, sig: &BatchSignature) -> Result<(), CudaError> {
        let s = &self.shapes;
        let b = &self.bufs;
        let rows = sig.logit_rows();
        self.launch(
            &self.kernels.add_rmsnorm,
            (rows as u32, 1, 1),
            256,
            vec![
                Arg::Ptr(b.x.ptr),
                Arg::Ptr(b.residual.ptr),
                Arg::Ptr(b.norm.ptr),
                Arg::Ptr(b.xn.ptr),
                Arg::I32(s.hidden as i32),
            ],
        )?;
        self.gemm(&b.lm_head, &b.xn, &b.logits, rows, s.vocab, s.hidden)?;
        self.launch(
            &self.kernels.sample_rows,
            (rows as u32, 1, 1),
            256,
            vec![Arg::Ptr(b.logits.ptr), Arg::I32(s.vocab as i32), Arg::Ptr(b.tokens.ptr)],
        )
    }

    /// Median over `reps` back-to-back runs of `f`, after `warmup` untimed runs.
    fn time(&self, warmup: u32, reps: u32, f: impl Fn() -> Result<(), CudaError>) -> Result<f64, CudaError> {
        let reps = (reps as usize).clamp(1, self.events.len() - 1);
        for _ in 0..warmup {
            f()?;
        }
        self.events[0].record(&self.stream).map_err(driver("recording an event"))?;
        for r in 0..reps {
            f()?;
            self.events[r + 1].record(&self.stream).map_err(driver("recording an event"))?;
        }
        let mut ms = Vec::with_capacity(reps);
        for r in 0..reps {
            ms.push(self.events[r].elapsed_ms(&self.events[r + 1]).map_err(driver("reading event times"))? as f64);
        }
        Ok(median(ms))
    }

    /// Times one layer and the head for `sig`. Long shapes get fewer repetitions: a 16k-token
    /// prefill layer takes ~30 ms on an H100, and the engine thread waits for the answer.
    pub fn measure(&self, sig: &BatchSignature) -> Result<Timed, CudaError> {
        self.ctx.bind_to_thread().map_err(driver("binding the context to this thread"))?;
        let probe = self.time(1, 1, || self.layer(sig))?;
        let (warmup, reps) = if probe > 5.0 { (0, 3.min(self.cfg.reps)) } else { (self.cfg.warmup, self.cfg.reps) };
        let layer_ms = self.time(warmup, reps, || self.layer(sig))?;
        let head_ms = self.time(self.cfg.warmup, self.cfg.reps, || self.head(sig))?;
        Ok(Timed { layer_ms, head_ms })
    }

    /// Pinned host ↔ device copy rates (GB/s = 1e9 B/s), the medians of `reps` copies of
    /// `cfg.copy_bytes` each way.
    pub fn copy_rates(&self) -> Result<(f64, f64), CudaError> {
        let bytes = self.cfg.copy_bytes.max(1 << 20) as usize;
        self.ctx.bind_to_thread().map_err(driver("binding the context to this thread"))?;
        let dev = DeviceBuf::new(&self.ctx, bytes as u64, "allocating the copy buffer")?;
        // SAFETY: `host` is a pinned allocation of `bytes` bytes, freed below on every path.
        let host = unsafe { drv::malloc_host(bytes, 0) }.map_err(driver("allocating pinned host memory"))?;
        let stream = self.stream.cu_stream();
        let run = || -> Result<(f64, f64), CudaError> {
            // SAFETY: `host` and `dev` are live allocations of `bytes` bytes each; the copies are
            // ordered on our stream and finished (synchronised) before either is freed.
            let h2d = self.time(1, self.cfg.reps, || {
                unsafe { sys::cuMemcpyHtoDAsync_v2(dev.ptr, host as *const c_void, bytes, stream) }
                    .result()
                    .map_err(driver("copying host to device"))
            })?;
            let d2h = self.time(1, self.cfg.reps, || {
                unsafe { sys::cuMemcpyDtoHAsync_v2(host, dev.ptr, bytes, stream) }
                    .result()
                    .map_err(driver("copying device to host"))
            })?;
            Ok((bytes as f64 / (h2d * 1e-3) / 1e9, bytes as f64 / (d2h * 1e-3) / 1e9))
        };
        let rates = run();
        let _ = self.stream.synchronize();
        let _ = unsafe { drv::free_host(host) };
        rates
    }
}
