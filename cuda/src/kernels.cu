// kvfleet-cuda kernels, compiled at run time by NVRTC (no headers: bf16 is handled as raw bits).
//
// What matters here is that each kernel moves the bytes and does the FLOPs of its counterpart in
// a serving engine (vLLM's layer: fused add+RMSNorm, RoPE + KV-cache write, attention, SiLU x mul,
// sampling). The values are random and the results are never read: the math only has to be of
// the right kind (tensor-core MMAs for prefill attention, HBM-bound streaming for decode).
//
// Compile-time constants (-D): HEAD_DIM (multiple of 16, <= 256), GROUP (query heads per KV head),
// BLOCK_N (keys per prefill tile: 64 for HEAD_DIM <= 128, else 32).

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

// Decode attention, split-K ("flash decoding"): grid (splits, kv_heads, seqs), 128 threads.
// Sequence s holds `ctx` tokens at cache slots (s * ctx + t) % cap; each of its GROUP query heads
// of this KV head scores and sums every token once. HBM-bound: K and V are read exactly once.
#define DEC_WARPS 4
extern "C" __global__ void __launch_bounds__(128) decode_attention(const bf16* qkv, int qkv_stride,
    const bf16* kcache, const bf16* vcache, float* partial, int ctx, u64 cap, int kv_heads) {
    const int LANES = HEAD_DIM / 8;          // 16-byte chunks per head row
    const int ROWS = 32 / LANES;             // tokens a warp reads per step
    __shared__ float red[DEC_WARPS][GROUP][HEAD_DIM];
    int split = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z, splits = gridDim.x;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int sub = lane / LANES, chunk = lane % LANES;
    int kv_width = kv_heads * HEAD_DIM;

    float q[GROUP][8];
    const bf16* qrow = qkv + (u64)seq * qkv_stride + (u64)kvh * GROUP * HEAD_DIM + chunk * 8;
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        uint4 v = *(const uint4*)(qrow + g * HEAD_DIM);
        unsigned int* vp = (unsigned int*)&v;
#pragma unroll
        for (int k = 0; k < 4; k++) { q[g][2 * k] = lo_f(vp[k]); q[g][2 * k + 1] = hi_f(vp[k]); }
    }
    float m[GROUP], l[GROUP], acc[GROUP][8];
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        m[g] = -1e30f; l[g] = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; k++) acc[g][k] = 0.0f;
    }
    int per_split = (ctx + splits - 1) / splits;
    int t0 = split * per_split, t1 = min(ctx, t0 + per_split);
    u64 base = ((u64)seq * (u64)ctx) % cap;
    // Every lane runs the same number of steps (the shuffles below need the whole warp).
    for (int tb = t0 + warp * ROWS; tb < t1; tb += DEC_WARPS * ROWS) {
        int t = tb + sub;
        bool valid = sub < ROWS && t < t1;
        uint4 kr = make_uint4(0, 0, 0, 0), vr = make_uint4(0, 0, 0, 0);
        if (valid) {
            u64 slot = base + (u64)t;
            if (slot >= cap) slot %= cap;
            u64 off = slot * kv_width + (u64)kvh * HEAD_DIM + chunk * 8;
            kr = *(const uint4*)(kcache + off);
            vr = *(const uint4*)(vcache + off);
        }
        unsigned int* kp = (unsigned int*)&kr;
        unsigned int* vp = (unsigned int*)&vr;
#pragma unroll
        for (int g = 0; g < GROUP; g++) {
            float s = 0.0f;
#pragma unroll
            for (int k = 0; k < 4; k++) s += q[g][2 * k] * lo_f(kp[k]) + q[g][2 * k + 1] * hi_f(kp[k]);
            for (int off = 1; off < LANES; off <<= 1) s += __shfl_xor_sync(FULL_MASK, s, off);
            s = valid ? s * 0.08838834764f : -1e30f;
            float mn = fmaxf(m[g], s);
            float sc = __expf(m[g] - mn), p = __expf(s - mn);
            l[g] = l[g] * sc + p;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                acc[g][2 * k] = acc[g][2 * k] * sc + p * lo_f(vp[k]);
                acc[g][2 * k + 1] = acc[g][2 * k + 1] * sc + p * hi_f(vp[k]);
            }
            m[g] = mn;
        }
    }
    // Combine: the warp's row groups by shuffles, the warps in shared memory; one GROUP x HEAD_DIM
    // row per block (the split-K partial a final reduction would merge; its bytes are tiny).
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        float inv = 1.0f / fmaxf(l[g], 1e-20f);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            float v = acc[g][k] * inv + m[g] * 1e-30f;
            for (int off = LANES; off < 32; off <<= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
            acc[g][k] = v;
        }
    }
    if (sub == 0) {
#pragma unroll
        for (int g = 0; g < GROUP; g++)
#pragma unroll
            for (int k = 0; k < 8; k++) red[warp][g][chunk * 8 + k] = acc[g][k];
    }
    __syncthreads();
    float* out = partial + (((u64)seq * kv_heads + kvh) * splits + split) * (GROUP * HEAD_DIM);
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
        int g = i / HEAD_DIM, d = i % HEAD_DIM;
        float s = 0.0f;
        for (int w = 0; w < DEC_WARPS; w++) s += red[w][g][d];
        out[i] = s;
    }
}

// Causal prefill attention with tensor cores (FlashAttention-2 forward structure): grid
// (ceil(len / 64), q_heads, prompts), 128 threads = 4 warps x 16 query rows. Prompt p's queries
// are qkv rows row0 + p * len + t, its keys and values cache slots slot0 + p * len + t (no wrap:
// the caller keeps them inside the cache). Scores never leave registers; K and V tiles are staged
// in shared memory, rows padded by 8 elements against bank conflicts.
#define PF_ROWS 64
#define KPAD (HEAD_DIM + 8)
extern "C" __global__ void __launch_bounds__(128) prefill_attention(const bf16* qkv, int qkv_stride,
    const bf16* kcache, const bf16* vcache, bf16* out, int out_stride, int len, u64 row0, u64 slot0,
    int kv_heads) {
    __shared__ __align__(16) bf16 ks[BLOCK_N * KPAD];
    __shared__ __align__(16) bf16 vs[BLOCK_N * KPAD];
    int qblock = blockIdx.x, h = blockIdx.y, p = blockIdx.z;
    int kvh = h / GROUP;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, tq = lane & 3;
    int kv_width = kv_heads * HEAD_DIM;
    u64 qbase = row0 + (u64)p * len;
    u64 kbase = slot0 + (u64)p * len;
    int r0 = qblock * PF_ROWS + warp * 16 + g;   // this thread's two query rows: r0, r0 + 8
    int r1 = r0 + 8;
    int ra = min(r0, len - 1), rb = min(r1, len - 1);

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

    int last_row = min(len, (qblock + 1) * PF_ROWS) - 1;
    for (int k0 = 0; k0 <= last_row; k0 += BLOCK_N) {
        __syncthreads();
        for (int i = threadIdx.x; i < BLOCK_N * (HEAD_DIM / 8); i += blockDim.x) {
            int key = i / (HEAD_DIM / 8), c = (i % (HEAD_DIM / 8)) * 8;
            u64 slot = kbase + (u64)min(k0 + key, len - 1);
            u64 off = slot * kv_width + (u64)kvh * HEAD_DIM + c;
            *(uint4*)&ks[key * KPAD + c] = *(const uint4*)(kcache + off);
            *(uint4*)&vs[key * KPAD + c] = *(const uint4*)(vcache + off);
        }
        __syncthreads();
        // S = Q K^T for this warp's 16 rows x BLOCK_N keys.
        float s[BLOCK_N / 8][4];
#pragma unroll
        for (int n = 0; n < BLOCK_N / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; kk++) {
#pragma unroll
            for (int n = 0; n < BLOCK_N / 8; n++) {
                const bf16* kr = &ks[(n * 8 + g) * KPAD + kk * 16 + tq * 2];
                mma_bf16(s[n], qf[kk], *(const unsigned int*)kr, *(const unsigned int*)(kr + 8));
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
        // O += P V: the score accumulators are already laid out as the A operand.
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; kk++) {
            unsigned int a[4];
            a[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
            a[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
            a[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            int key = kk * 16 + tq * 2;
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; n++) {
                int d = n * 8 + g;
                unsigned int b0 = (unsigned int)vs[key * KPAD + d] | ((unsigned int)vs[(key + 1) * KPAD + d] << 16);
                unsigned int b1 = (unsigned int)vs[(key + 8) * KPAD + d] | ((unsigned int)vs[(key + 9) * KPAD + d] << 16);
                mma_bf16(o[n], a, b0, b1);
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
