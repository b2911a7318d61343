// ep_math: the elementwise kernels of the MoE and TP layers (manifests/ep_moe.json, tp_mlp.json).
//
// Every result is reproducible bit for bit: the numpy twins in tray/programs/ep_moe/twins.py do the
// same float32 operations in the same order. So every float operation here is an explicit IEEE
// round-to-nearest intrinsic (__fmul_rn, __fadd_rn, __fdiv_rn: no FMA contraction), exp is a fixed
// polynomial built from them (the library expf is not correctly rounded, and numpy's differs), every
// constant is written as its float32 bit pattern, and bf16 rounding is the bit recipe below
// (round to nearest even, every NaN -> 0x7FC0; equal to __float2bfloat16_rn on non-NaN values).
// No header is included: NVRTC needs no include path.

typedef unsigned long long u64;

__device__ __forceinline__ float bf16_to_f32(unsigned int bits16) {
    return __uint_as_float(bits16 << 16);
}

__device__ __forceinline__ unsigned int f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
        return 0x7FC0u;
    }
    u += 0x7FFFu + ((u >> 16) & 1u);
    return u >> 16;
}

// The 8 bf16 values of a 16-byte vector, element j in word j / 2 (low half first: little endian).
__device__ __forceinline__ void unpack8(uint4 v, float* out) {
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        out[2 * j] = bf16_to_f32(w[j] & 0xFFFFu);
        out[2 * j + 1] = bf16_to_f32(w[j] >> 16);
    }
}

__device__ __forceinline__ uint4 pack8(const float* in) {
    uint4 v;
    v.x = f32_to_bf16(in[0]) | (f32_to_bf16(in[1]) << 16);
    v.y = f32_to_bf16(in[2]) | (f32_to_bf16(in[3]) << 16);
    v.z = f32_to_bf16(in[4]) | (f32_to_bf16(in[5]) << 16);
    v.w = f32_to_bf16(in[6]) | (f32_to_bf16(in[7]) << 16);
    return v;
}

// exp(x) for the SiLU: x clamped to [-87, 88] (so 2^n below stays a normal number and nothing
// overflows), n = rint(x * log2 e), r = x - n ln2 (Cody-Waite, ln2 split so n * ln2_hi is exact),
// exp(r) by its Taylor polynomial to degree 7 (|r| <= 0.35: truncation below float32 rounding),
// times 2^n built from the exponent bits (an exact product).
__device__ __forceinline__ float ep_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const int n = __float2int_rn(__fmul_rn(x, __uint_as_float(0x3FB8AA3Bu)));  // log2(e)
    const float fn = (float)n;
    float r = __fsub_rn(x, __fmul_rn(fn, __uint_as_float(0x3F317200u)));       // ln2 hi
    r = __fsub_rn(r, __fmul_rn(fn, __uint_as_float(0x35BFBE8Eu)));             // ln2 lo
    float p = __uint_as_float(0x39500D01u);                                     // 1/5040
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3AB60B61u));               // 1/720
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3C088889u));               // 1/120
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3D2AAAABu));               // 1/24
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3E2AAAABu));               // 1/6
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    return __fmul_rn(p, __uint_as_float((unsigned int)(n + 127) << 23));
}

// silu(g) * u = g / (1 + exp(-g)) * u, in float32, rounded once to bf16.
__device__ __forceinline__ float silu_mul(float g, float u) {
    const float s = __fdiv_rn(g, __fadd_rn(1.0f, ep_exp(-g)));
    return __fmul_rn(s, u);
}

// silu_mul: act[r][c] = bf16(silu(h[r][c]) * h[r][ffn + c]) for r < rows, c < ffn (ffn % 8 == 0).
//   h13  [rows][2 * ffn] bf16: gate columns, then up columns (the GEMM with w13 = [w1; w3])
//   act  [rows][ffn] bf16
extern "C" __global__ void ep_silu_mul(const uint4* __restrict__ h13, uint4* __restrict__ act, int rows,
                                       int ffn) {
    const long long nvec = ffn / 8;
    const long long total = (long long)rows * nvec;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const long long r = i / nvec;
        const long long c = i - r * nvec;
        float g[8], u[8], out[8];
        unpack8(h13[r * 2 * nvec + c], g);
        unpack8(h13[r * 2 * nvec + nvec + c], u);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            out[j] = silu_mul(g[j], u[j]);
        }
        act[i] = pack8(out);
    }
}

// silu_mul_rows: ep_silu_mul over the rows the layout put in each expert's block of cap rows:
//   act[e * cap + r][c] = bf16(silu(h13[e * cap + r][c]) * h13[e * cap + r][ffn + c])
// for e < experts / G (this rank's experts), r < min(rows[e], cap), c < ffn; other rows are left as
// they are. Blocks y = e, e + gridDim.y, .. walk expert e's rows present only (so a launch costs the rows
// present, not the capacity: grid (32, experts / G) in the manifest), blocks x stride over them.
//   h13  [experts / G * cap][2 * ffn] bf16;  act  [experts / G * cap][ffn] bf16;  rows  [experts / G] i32
extern "C" __global__ void ep_silu_mul_rows(const uint4* __restrict__ h13, uint4* __restrict__ act,
                                            const int* __restrict__ rows, int all_experts, int G, int cap,
                                            int ffn) {
    const int experts = all_experts / G;
    const long long nvec = ffn / 8;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (int e = blockIdx.y; e < experts; e += gridDim.y) {
        const int present = rows[e] < cap ? (rows[e] > 0 ? rows[e] : 0) : cap;
        const long long total = (long long)present * nvec;
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
            const long long r = (long long)e * cap + i / nvec;
            const long long c = i % nvec;
            float g[8], u[8], out[8];
            unpack8(h13[r * 2 * nvec + c], g);
            unpack8(h13[r * 2 * nvec + nvec + c], u);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                out[j] = silu_mul(g[j], u[j]);
            }
            act[r * nvec + c] = pack8(out);
        }
    }
}

// reduce: the origin's sum over reduction groups (see ep_moe.cu, combine):
//   out[t][h] = bf16( sum over groups q = 0..groups-1 in that order, for the groups token t uses,
//                     of comb[q][t][h] )     (float32 accumulator from 0)
// Token t uses group q when one of its valid experts e (0 <= e < experts) has e / (experts / groups) == q.
// Groups it does not use are never read (their rows were not written). groups <= 64.
//   comb      [groups][tokens][hidden] bf16   one row per (group, token), from the combine
//   topk_idx  [tokens][topk] i32              the router's expert ids
//   out       [tokens][hidden] bf16
extern "C" __global__ void ep_reduce(const uint4* __restrict__ comb, const int* __restrict__ topk_idx,
                                     uint4* __restrict__ out, int tokens, int topk, int hidden, int experts,
                                     int groups) {
    const long long nvec = hidden / 8;
    const long long total = (long long)tokens * nvec;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const int per_group = experts / groups;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const long long t = i / nvec;
        const long long c = i - t * nvec;
        u64 used = 0;
        for (int kk = 0; kk < topk; ++kk) {
            const int e = topk_idx[t * topk + kk];
            if (e >= 0 && e < experts) {
                used |= 1ull << (e / per_group);
            }
        }
        float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (int q = 0; q < groups; ++q) {
            if ((used >> q) & 1ull) {
                float v[8];
                unpack8(comb[((long long)q * tokens + t) * nvec + c], v);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    acc[j] = __fadd_rn(acc[j], v[j]);
                }
            }
        }
        out[i] = pack8(acc);
    }
}

__device__ __forceinline__ u64 splitmix64(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// fill: deterministic pseudo-random bf16 values, so every layout of the same logical tensor (EP1 or
// one shard per rank) holds the same value for the same element. Element (i, j) of dst[rows][cols]
// is the value of global index  idx = index_base + rank * rank_stride + i * row_stride + j:
//   z = splitmix64(idx + seed * 0xD1B54A32D192ED03);  m = (z >> 40) - 2^23  (exact in float32)
//   dst[i][j] = bf16(m * scale)
extern "C" __global__ void ep_fill(unsigned short* dst, long long rows, long long cols, long long row_stride,
                                   long long index_base, int rank, long long rank_stride, unsigned int seed,
                                   float scale) {
    const long long total = rows * cols;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const u64 base = (u64)index_base + (u64)rank * (u64)rank_stride;
    const u64 mix = (u64)seed * 0xD1B54A32D192ED03ull;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const long long r = i / cols;
        const long long c = i - r * cols;
        const u64 z = splitmix64(base + (u64)r * (u64)row_stride + (u64)c + mix);
        const float m = (float)((int)(z >> 40) - 8388608);
        dst[i] = (unsigned short)f32_to_bf16(__fmul_rn(m, scale));
    }
}

// zero32: dst[i] = value for i < words (u32 words).
extern "C" __global__ void ep_zero32(unsigned int* dst, long long words, unsigned int value) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += stride) {
        dst[i] = value;
    }
}
