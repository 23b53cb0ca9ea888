// kvfleet-cuda kernels, compiled at run time by NVRTC (no headers: bf16 is handled as raw bits).
//
// What matters here is that each kernel moves the bytes and does the FLOPs of its counterpart in
// a serving engine (vLLM's layer: fused add+RMSNorm, RoPE + KV-cache write, attention, SiLU x mul,
// sampling). The values are random and the results are never read: the math only has to be of
// the right kind (tensor-core MMAs for prefill attention, HBM-bound streaming for decode).
//
// Compile-time constants (-D): HEAD_DIM (multiple of 32, <= 256), GROUP (query heads per KV head,
// <= 16: the rows of one decode MMA tile), BLOCK_N (keys per prefill tile: 64 for HEAD_DIM <= 128,
// else 32; the K and V tiles stay within 48 KiB of static shared memory).

typedef unsigned short bf16;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float bf2f(bf16 b) { return __uint_as_float(((unsigned int)b) << 16); }
__device__ __forceinline__ bf16 f2bf(float f) { return (bf16)(__float_as_uint(f) >> 16); }
__device__ __forceinline__ unsigned int pack_bf16x2(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float lo_f(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_f(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }

// D = A (16x16, row) * B (16x8, col) + D, bf16 inputs, f32 accumulators (sm_80+).
__device__ __forceinline__ void mma_bf16(float* d, const unsigned int* a, unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Uniform values in [-scale, scale] from a counter hash: random weights without a host copy.
extern "C" __global__ void fill_random(bf16* p, u64 n, unsigned int seed, float scale) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        unsigned int h = (unsigned int)i * 0x9E3779B1u ^ (unsigned int)(i >> 32) ^ seed;
        h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; h ^= h >> 16;
        p[i] = f2bf(((float)(h >> 8) * (1.0f / 8388608.0f) - 1.0f) * scale);
    }
}

__device__ __forceinline__ float block_sum(float v, float* shared32) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    float t = 0.0f;
    int warps = (blockDim.x + 31) >> 5;
    for (int w = 0; w < warps; w++) t += shared32[w];
    __syncthreads();
    return t;
}

// residual += x; out = rmsnorm(residual) * w. One block per row; hidden % 8 == 0.
extern "C" __global__ void add_rmsnorm(const bf16* x, bf16* residual, const bf16* w, bf16* out, int hidden) {
    __shared__ float red[32];
    u64 row = blockIdx.x;
    const uint4* xv = (const uint4*)(x + row * hidden);
    uint4* rv = (uint4*)(residual + row * hidden);
    uint4* ov = (uint4*)(out + row * hidden);
    const uint4* wv = (const uint4*)w;
    int chunks = hidden / 8;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        uint4 a = xv[c], r = rv[c];
        unsigned int* ap = (unsigned int*)&a;
        unsigned int* rp = (unsigned int*)&r;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float lo = lo_f(ap[k]) + lo_f(rp[k]), hi = hi_f(ap[k]) + hi_f(rp[k]);
            ss += lo * lo + hi * hi;
            rp[k] = pack_bf16x2(lo, hi);
        }
        rv[c] = r;
    }
    float inv = rsqrtf(block_sum(ss, red) / (float)hidden + 1e-6f);
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        uint4 r = rv[c], g = wv[c];
        unsigned int* rp = (unsigned int*)&r;
        unsigned int* gp = (unsigned int*)&g;
#pragma unroll
        for (int k = 0; k < 4; k++) rp[k] = pack_bf16x2(lo_f(rp[k]) * inv * lo_f(gp[k]), hi_f(rp[k]) * inv * hi_f(gp[k]));
        ov[c] = r;
    }
}

// Rotary embedding of q and k in place (rotate-half pairs), then K and V of each token written to
// the cache at slot (slot0 + row) % cap. One block per token row.
extern "C" __global__ void rope_kv_write(bf16* qkv, bf16* kcache, bf16* vcache, int q_width, int kv_width,
                                         u64 slot0, u64 cap, int pos0) {
    u64 row = blockIdx.x;
    bf16* r = qkv + row * (u64)(q_width + 2 * kv_width);
    u64 slot = (slot0 + row) % cap;
    float pos = (float)(pos0 + (int)row);
    const int half = HEAD_DIM / 2;
    int pairs = (q_width + kv_width) / 2;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        int head = (2 * p) / HEAD_DIM, j = p % half;
        int base = head * HEAD_DIM + j;
        float inv_freq = exp2f(-13.2877f * (float)j / (float)half);  // theta = 1e4: log2(1e4) = 13.29
        float s, c;
        __sincosf(pos * inv_freq, &s, &c);
        float x1 = bf2f(r[base]), x2 = bf2f(r[base + half]);
        bf16 y1 = f2bf(x1 * c - x2 * s), y2 = f2bf(x2 * c + x1 * s);
        if (base < q_width) {
            r[base] = y1;
            r[base + half] = y2;
        } else {
            int kb = base - q_width;
            kcache[slot * kv_width + kb] = y1;
            kcache[slot * kv_width + kb + half] = y2;
        }
    }
    const bf16* v = r + q_width + kv_width;
    for (int c = threadIdx.x; c < kv_width / 8; c += blockDim.x)
        ((uint4*)(vcache + slot * kv_width))[c] = ((const uint4*)v)[c];
}

// out[r][j] = silu(gate[r][j]) * up[r][j] with gate_up rows laid out [gate | up]; inter % 8 == 0.
extern "C" __global__ void silu_mul(const bf16* gate_up, bf16* out, u64 rows, int inter) {
    u64 chunks = rows * (u64)(inter / 8);
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < chunks; i += (u64)gridDim.x * blockDim.x) {
        u64 row = i / (inter / 8), c = i % (inter / 8);
        uint4 g = ((const uint4*)(gate_up + row * 2 * inter))[c];
        uint4 u = ((const uint4*)(gate_up + row * 2 * inter + inter))[c];
        unsigned int* gp = (unsigned int*)&g;
        unsigned int* up = (unsigned int*)&u;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float a = lo_f(gp[k]), b = hi_f(gp[k]);
            gp[k] = pack_bf16x2(a / (1.0f + __expf(-a)) * lo_f(up[k]), b / (1.0f + __expf(-b)) * hi_f(up[k]));
        }
        ((uint4*)(out + row * inter))[c] = g;
    }
}

// Decode attention, split-K ("flash decoding") on tensor cores: grid (splits, kv_heads, seqs),
// 128 threads = 4 warps. Sequence s holds `ctx` tokens at cache slots (s * ctx + t) % cap; the
// GROUP query heads of one KV head are the rows of a 16-row MMA tile (padded with zero rows), as
// FlashAttention / FlashInfer pack GQA decode, so the math per byte is a few MMAs and the kernel
// stays HBM-bound: K and V are read exactly once. Each warp takes 16-token tiles in turn and loads
// a tile's K and V rows (16-byte loads, 16 per lane for HEAD_DIM 128) before any math on them, so
// several KiB per warp are in flight. K rows go straight from registers into the B operand of
// S = Q K^T (the head dimension is permuted the same way in Q and K, which leaves the dot products
// unchanged); V rows are transposed in registers (movmatrix) into the B operand of O += P V.
#define DEC_WARPS 4
#define DEC_TILE 16
#if HEAD_DIM % 32 != 0
#error "decode_attention needs HEAD_DIM to be a multiple of 32"
#endif
__device__ __forceinline__ unsigned int movmatrix_trans(unsigned int x) {
    unsigned int r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
    return r;
}
// Three blocks per SM for head size <= 128 (at most 168 registers), so twelve warps keep loads in flight.
#define DEC_MIN_BLOCKS (HEAD_DIM <= 128 ? 3 : 1)
extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32, DEC_MIN_BLOCKS) decode_attention(const bf16* qkv, int qkv_stride,
    const bf16* kcache, const bf16* vcache, float* partial, int ctx, u64 cap, int kv_heads) {
    const int SLABS = HEAD_DIM / 32;         // 32-dim slabs: lane quad tq holds dims tq*8 .. tq*8+7 of each
    __shared__ float red[GROUP * HEAD_DIM];
    int split = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z, splits = gridDim.x;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, tq = lane & 3;        // MMA fragment coordinates: rows g, g + 8; column pair tq
    int kv_width = kv_heads * HEAD_DIM;

    // Q as the A operand, rows = query heads of this KV head (rows >= GROUP are zero). Within a slab,
    // k-step 2*s+hh takes words 2hh, 2hh+1 of each lane's 8 dims, matching the K words below.
    unsigned int qf[SLABS][2][4];
    const bf16* qrow = qkv + (u64)seq * qkv_stride + (u64)kvh * GROUP * HEAD_DIM + tq * 8;
#pragma unroll
    for (int s = 0; s < SLABS; s++) {
        uint4 a = make_uint4(0, 0, 0, 0), b = make_uint4(0, 0, 0, 0);
        if (g < GROUP) a = *(const uint4*)(qrow + g * HEAD_DIM + s * 32);
        if (GROUP > 8 && g + 8 < GROUP) b = *(const uint4*)(qrow + (g + 8) * HEAD_DIM + s * 32);
        qf[s][0][0] = a.x; qf[s][0][1] = b.x; qf[s][0][2] = a.y; qf[s][0][3] = b.y;
        qf[s][1][0] = a.z; qf[s][1][1] = b.z; qf[s][1][2] = a.w; qf[s][1][3] = b.w;
    }
    float o[SLABS][4][4];
#pragma unroll
    for (int s = 0; s < SLABS; s++)
#pragma unroll
        for (int j = 0; j < 4; j++) o[s][j][0] = o[s][j][1] = o[s][j][2] = o[s][j][3] = 0.0f;
    float ma = -1e30f, mb = -1e30f, la = 0.0f, lb = 0.0f;
    const float scale_log2 = 1.44269504f * rsqrtf((float)HEAD_DIM);

    int per_split = (ctx + splits - 1) / splits;
    int t0 = split * per_split, t1 = min(ctx, t0 + per_split);
    u64 base = ((u64)seq * (u64)ctx) % cap;
    for (int tb = t0 + warp * DEC_TILE; tb < t1; tb += DEC_WARPS * DEC_TILE) {
        // Load first: lane (g, tq) reads dims s*32 + tq*8 .. +7 of tokens tb + g and tb + 8 + g
        // (clamped to the split's last token; the clamped ones are masked below).
        uint4 kr[2][SLABS], vr[2][SLABS];
#pragma unroll
        for (int n = 0; n < 2; n++) {
            int t = min(tb + n * 8 + g, t1 - 1);
            u64 slot = base + (u64)t;
            if (slot >= cap) slot %= cap;
            u64 off = slot * kv_width + (u64)kvh * HEAD_DIM + tq * 8;
#pragma unroll
            for (int s = 0; s < SLABS; s++) {
                kr[n][s] = *(const uint4*)(kcache + off + s * 32);
                vr[n][s] = *(const uint4*)(vcache + off + s * 32);
            }
        }
        // S = Q K^T: 16 heads x 16 tokens; column pair tq of n-tile n = tokens tb + n*8 + 2tq, +1.
        float sc[2][4];
#pragma unroll
        for (int n = 0; n < 2; n++) {
            sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
            for (int s = 0; s < SLABS; s++) {
                mma_bf16(sc[n], qf[s][0], kr[n][s].x, kr[n][s].y);
                mma_bf16(sc[n], qf[s][1], kr[n][s].z, kr[n][s].w);
            }
        }
        // Mask the tokens past the split, online softmax per head row (a row spans a lane quad).
        float mxa = ma, mxb = mb;
#pragma unroll
        for (int n = 0; n < 2; n++) {
            int t = tb + n * 8 + 2 * tq;
            sc[n][0] = t < t1 ? sc[n][0] * scale_log2 : -1e30f;
            sc[n][1] = t + 1 < t1 ? sc[n][1] * scale_log2 : -1e30f;
            sc[n][2] = t < t1 ? sc[n][2] * scale_log2 : -1e30f;
            sc[n][3] = t + 1 < t1 ? sc[n][3] * scale_log2 : -1e30f;
            mxa = fmaxf(mxa, fmaxf(sc[n][0], sc[n][1]));
            mxb = fmaxf(mxb, fmaxf(sc[n][2], sc[n][3]));
        }
        for (int off = 1; off < 4; off <<= 1) {
            mxa = fmaxf(mxa, __shfl_xor_sync(FULL_MASK, mxa, off));
            mxb = fmaxf(mxb, __shfl_xor_sync(FULL_MASK, mxb, off));
        }
        float ca = exp2f(ma - mxa), cb = exp2f(mb - mxb);
        ma = mxa; mb = mxb;
        la *= ca; lb *= cb;
#pragma unroll
        for (int s = 0; s < SLABS; s++)
#pragma unroll
            for (int j = 0; j < 4; j++) { o[s][j][0] *= ca; o[s][j][1] *= ca; o[s][j][2] *= cb; o[s][j][3] *= cb; }
#pragma unroll
        for (int n = 0; n < 2; n++) {
            sc[n][0] = exp2f(sc[n][0] - ma); sc[n][1] = exp2f(sc[n][1] - ma);
            sc[n][2] = exp2f(sc[n][2] - mb); sc[n][3] = exp2f(sc[n][3] - mb);
            la += sc[n][0] + sc[n][1];
            lb += sc[n][2] + sc[n][3];
        }
        // O += P V. P's accumulators are already the A operand (k = token). Word j of a lane's V
        // chunk, over the warp, is an 8x8 matrix (tokens x dims s*32 + (c/2)*8 + 2j + c%2);
        // transposed, lane (g, tq) holds tokens 2tq, 2tq+1 of dim column g: the B operand.
        unsigned int pa[4];
        pa[0] = pack_bf16x2(sc[0][0], sc[0][1]);
        pa[1] = pack_bf16x2(sc[0][2], sc[0][3]);
        pa[2] = pack_bf16x2(sc[1][0], sc[1][1]);
        pa[3] = pack_bf16x2(sc[1][2], sc[1][3]);
#pragma unroll
        for (int s = 0; s < SLABS; s++) {
            mma_bf16(o[s][0], pa, movmatrix_trans(vr[0][s].x), movmatrix_trans(vr[1][s].x));
            mma_bf16(o[s][1], pa, movmatrix_trans(vr[0][s].y), movmatrix_trans(vr[1][s].y));
            mma_bf16(o[s][2], pa, movmatrix_trans(vr[0][s].z), movmatrix_trans(vr[1][s].z));
            mma_bf16(o[s][3], pa, movmatrix_trans(vr[0][s].w), movmatrix_trans(vr[1][s].w));
        }
    }
    // Combine: normalise each warp's rows and sum the warps in shared memory, one warp at a time;
    // one GROUP x HEAD_DIM row per block (the split-K partial a final reduction would merge; its
    // bytes are tiny). Accumulator o[s][j][e] is head g (e < 2) or g + 8, dim s*32 + tq*8 + 2j + e%2.
    for (int off = 1; off < 4; off <<= 1) {
        la += __shfl_xor_sync(FULL_MASK, la, off);
        lb += __shfl_xor_sync(FULL_MASK, lb, off);
    }
    float ia = 1.0f / fmaxf(la, 1e-20f), ib = 1.0f / fmaxf(lb, 1e-20f);
    for (int w = 0; w < DEC_WARPS; w++) {
        if (warp == w) {
#pragma unroll
            for (int s = 0; s < SLABS; s++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    int d = s * 32 + tq * 8 + 2 * j;
                    if (g < GROUP) {
                        float* r = &red[g * HEAD_DIM + d];
                        r[0] = (w ? r[0] : 0.0f) + o[s][j][0] * ia;
                        r[1] = (w ? r[1] : 0.0f) + o[s][j][1] * ia;
                    }
                    if (g + 8 < GROUP) {
                        float* r = &red[(g + 8) * HEAD_DIM + d];
                        r[0] = (w ? r[0] : 0.0f) + o[s][j][2] * ib;
                        r[1] = (w ? r[1] : 0.0f) + o[s][j][3] * ib;
                    }
                }
        }
        __syncthreads();
    }
    float* out = partial + (((u64)seq * kv_heads + kvh) * splits + split) * (GROUP * HEAD_DIM);
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) out[i] = red[i];
}

// Causal prefill attention with tensor cores (FlashAttention-2 forward structure): grid
// (ceil(len / 128), q_heads, prompts), 256 threads = 8 warps x 16 query rows. Prompt p's queries
// are qkv rows row0 + p * len + t, its keys and values cache slots slot0 + p * len + t (no wrap:
// the caller keeps them inside the cache). Scores never leave registers. K and V tiles are copied
// into shared memory with cp.async (rows padded by 8 elements against bank conflicts), V of a
// tile while Q K^T runs on it and K of the next tile while P V runs, as FlashAttention-2 does;
// MMA operands are read with ldmatrix (V transposed by ldmatrix.trans). Query blocks run from the
// last (longest causal row range) to the first, so the short ones fill the tail of the grid.
#define PF_ROWS 128
#define PF_WARPS 8
#define KPAD (HEAD_DIM + 8)
__device__ __forceinline__ unsigned int smem_addr(const void* p) {
    unsigned int r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ void cp_async16(unsigned int dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ void ldmatrix_x4(unsigned int addr, unsigned int* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int addr, unsigned int* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// One BLOCK_N x HEAD_DIM tile of keys k0.. (clamped to the prompt's last key) into `tile`, 16 bytes
// per cp.async, as one commit group.
__device__ __forceinline__ void prefill_load_tile(bf16* tile, const bf16* cache, u64 kbase, int k0, int len,
                                                  int kv_width, int kvh) {
    for (int i = threadIdx.x; i < BLOCK_N * (HEAD_DIM / 8); i += PF_WARPS * 32) {
        int key = i / (HEAD_DIM / 8), c = (i % (HEAD_DIM / 8)) * 8;
        u64 slot = kbase + (u64)min(k0 + key, len - 1);
        cp_async16(smem_addr(&tile[key * KPAD + c]), cache + slot * kv_width + (u64)kvh * HEAD_DIM + c);
    }
    asm volatile("cp.async.commit_group;\n" ::);
}
extern "C" __global__ void __launch_bounds__(PF_WARPS * 32) prefill_attention(const bf16* qkv, int qkv_stride,
    const bf16* kcache, const bf16* vcache, bf16* out, int out_stride, int len, u64 row0, u64 slot0,
    int kv_heads) {
    __shared__ __align__(16) bf16 ks[BLOCK_N * KPAD];
    __shared__ __align__(16) bf16 vs[BLOCK_N * KPAD];
    int qblock = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, p = blockIdx.z;
    int kvh = h / GROUP;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, tq = lane & 3;
    int kv_width = kv_heads * HEAD_DIM;
    u64 qbase = row0 + (u64)p * len;
    u64 kbase = slot0 + (u64)p * len;
    int wrow = qblock * PF_ROWS + warp * 16;     // this warp's first query row
    int r0 = wrow + g;                           // this thread's two query rows: r0, r0 + 8
    int r1 = r0 + 8;
    int ra = min(r0, len - 1), rb = min(r1, len - 1);
    // ldmatrix row addresses: lanes 8i..8i+7 address the rows of matrix i.
    int kl_row = (lane & 7) + ((lane >> 4) << 3), kl_col = ((lane >> 3) & 1) * 8;  // K: n-tile += i/2, dims += (i%2)*8
    int vl_row = (lane & 7) + (((lane >> 3) & 1) << 3), vl_col = (lane >> 4) * 8;  // V: keys += (i%2)*8, n-tile += i/2
    unsigned int ks_lane = smem_addr(&ks[kl_row * KPAD + kl_col]);
    unsigned int vs_lane = smem_addr(&vs[vl_row * KPAD + vl_col]);

    int last_row = min(len, (qblock + 1) * PF_ROWS) - 1;
    prefill_load_tile(ks, kcache, kbase, 0, len, kv_width, kvh);   // K of the first tile in flight

    unsigned int qf[HEAD_DIM / 16][4];
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; kk++) {
        int c = kk * 16 + tq * 2;
        const bf16* qa = qkv + (qbase + ra) * qkv_stride + (u64)h * HEAD_DIM + c;
        const bf16* qb = qkv + (qbase + rb) * qkv_stride + (u64)h * HEAD_DIM + c;
        qf[kk][0] = *(const unsigned int*)qa;
        qf[kk][1] = *(const unsigned int*)qb;
        qf[kk][2] = *(const unsigned int*)(qa + 8);
        qf[kk][3] = *(const unsigned int*)(qb + 8);
    }
    float o[HEAD_DIM / 8][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float ma = -1e30f, mb = -1e30f, la = 0.0f, lb = 0.0f;
    const float scale_log2 = 1.44269504f * rsqrtf((float)HEAD_DIM);

    for (int k0 = 0; k0 <= last_row; k0 += BLOCK_N) {
        cp_async_wait_all();
        __syncthreads();   // K(k0) is in shared memory; every warp is done with the previous V tile
        prefill_load_tile(vs, vcache, kbase, k0, len, kv_width, kvh);
        // A warp whose rows all precede the tile (or lie past the prompt) skips its math; the
        // tile at k0 = 0 is never skipped, so each row's running max is finite from then on.
        bool active = wrow < len && k0 <= wrow + 15;
        float s[BLOCK_N / 8][4];
        if (active) {
            // S = Q K^T for this warp's 16 rows x BLOCK_N keys; one ldmatrix.x4 = B of two n-tiles.
#pragma unroll
            for (int n = 0; n < BLOCK_N / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; kk++) {
#pragma unroll
                for (int n = 0; n < BLOCK_N / 8; n += 2) {
                    unsigned int b[4];
                    ldmatrix_x4(ks_lane + (unsigned int)((n * 8 * KPAD + kk * 16) * 2), b);
                    mma_bf16(s[n], qf[kk], b[0], b[1]);
                    mma_bf16(s[n + 1], qf[kk], b[2], b[3]);
                }
            }
            // Causal mask, online softmax (each row spread over the 4 threads of a quad).
            float mxa = ma, mxb = mb;
#pragma unroll
            for (int n = 0; n < BLOCK_N / 8; n++) {
                int key = k0 + n * 8 + tq * 2;
                s[n][0] = key <= r0 ? s[n][0] * scale_log2 : -1e30f;
                s[n][1] = key + 1 <= r0 ? s[n][1] * scale_log2 : -1e30f;
                s[n][2] = key <= r1 ? s[n][2] * scale_log2 : -1e30f;
                s[n][3] = key + 1 <= r1 ? s[n][3] * scale_log2 : -1e30f;
                mxa = fmaxf(mxa, fmaxf(s[n][0], s[n][1]));
                mxb = fmaxf(mxb, fmaxf(s[n][2], s[n][3]));
            }
            for (int off = 1; off < 4; off <<= 1) {
                mxa = fmaxf(mxa, __shfl_xor_sync(FULL_MASK, mxa, off));
                mxb = fmaxf(mxb, __shfl_xor_sync(FULL_MASK, mxb, off));
            }
            float ca = exp2f(ma - mxa), cb = exp2f(mb - mxb);
            ma = mxa; mb = mxb;
            la *= ca; lb *= cb;
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; n++) { o[n][0] *= ca; o[n][1] *= ca; o[n][2] *= cb; o[n][3] *= cb; }
#pragma unroll
            for (int n = 0; n < BLOCK_N / 8; n++) {
                s[n][0] = exp2f(s[n][0] - ma); s[n][1] = exp2f(s[n][1] - ma);
                s[n][2] = exp2f(s[n][2] - mb); s[n][3] = exp2f(s[n][3] - mb);
                la += s[n][0] + s[n][1];
                lb += s[n][2] + s[n][3];
            }
        }
        cp_async_wait_all();
        __syncthreads();   // V(k0) is in shared memory; every warp is done with K(k0)
        if (k0 + BLOCK_N <= last_row) prefill_load_tile(ks, kcache, kbase, k0 + BLOCK_N, len, kv_width, kvh);
        if (active) {
            // O += P V: the score accumulators are already laid out as the A operand; one
            // ldmatrix.x4.trans = B of two 8-dim n-tiles over 16 keys.
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; kk++) {
                unsigned int a[4];
                a[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
                a[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
                a[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                a[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
                for (int n = 0; n < HEAD_DIM / 8; n += 2) {
                    unsigned int b[4];
                    ldmatrix_x4_trans(vs_lane + (unsigned int)((kk * 16 * KPAD + n * 8) * 2), b);
                    mma_bf16(o[n], a, b[0], b[1]);
                    mma_bf16(o[n + 1], a, b[2], b[3]);
                }
            }
        }
    }
    for (int off = 1; off < 4; off <<= 1) {
        la += __shfl_xor_sync(FULL_MASK, la, off);
        lb += __shfl_xor_sync(FULL_MASK, lb, off);
    }
    float ia = 1.0f / fmaxf(la, 1e-20f), ib = 1.0f / fmaxf(lb, 1e-20f);
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; n++) {
        int c = h * HEAD_DIM + n * 8 + tq * 2;
        if (r0 < len) *(unsigned int*)(out + (qbase + r0) * out_stride + c) = pack_bf16x2(o[n][0] * ia, o[n][1] * ia);
        if (r1 < len) *(unsigned int*)(out + (qbase + r1) * out_stride + c) = pack_bf16x2(o[n][2] * ib, o[n][3] * ib);
    }
}

// Sampling stand-in: each row's argmax over the vocabulary (reads every logit once).
extern "C" __global__ void sample_rows(const bf16* logits, int vocab, int* token) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    u64 row = blockIdx.x;
    const bf16* r = logits + row * vocab;
    float bv = -1e30f;
    int bi = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = bf2f(r[i]);
        if (v > bv) { bv = v; bi = i; }
    }
    for (int off = 16; off > 0; off >>= 1) {
        float ov = __shfl_xor_sync(FULL_MASK, bv, off);
        int oi = __shfl_xor_sync(FULL_MASK, bi, off);
        if (ov > bv) { bv = ov; bi = oi; }
    }
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { best_v[warp] = bv; best_i[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)((blockDim.x + 31) >> 5); w++)
            if (best_v[w] > bv) { bv = best_v[w]; bi = best_i[w]; }
        token[row] = bi;
    }
}
