// ep_gemm: the experts' GEMMs driven by the device's row counts (manifests/ep_moe.json, "experts_masked").
//
// One launch computes every local expert: C[e][r][n] = bf16( sum_k A[e][r][k] * B[e][n][k] ) for the
// rows r < rows[e] the layout put there (ep_layout_scan's expert_rows), every n < N. Tiles of rows at or
// beyond rows[e] exit before loading anything, so the capacity a graph must allow costs a block launch per
// unused tile, not its arithmetic. Row-major A [experts][cap][K], B [experts][N][K] (nn.Linear weights),
// C [experts][cap][N], bf16 in and out, float32 accumulation on the tensor cores (mma.sync m16n8k16),
// one round to nearest even at the end (the recipe of ep_math.cu). K % 32 == 0, N % 2 == 0 (the bench
// checks); partial tiles in M and N are masked.
//
// Block: 128 threads = 4 warps in a 2 x 2 grid over a 64 x 128 tile of C; each warp owns 32 x 64 (2 x 8
// mma tiles of 16 x 8). K advances 32 at a time through shared memory; the next tile's global loads are
// issued into registers before the current tile is multiplied. Shared rows are padded to 40 bf16 (80 B),
// so the fragment loads (8 rows x 4 words per warp) hit 32 distinct banks.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .bf16): lane = 4 g + t; A regs {row g, cols 2t..2t+1},
// {row g+8, same cols}, {row g, cols 2t+8..}, {row g+8, cols 2t+8..}; B regs {k 2t..2t+1, col g},
// {k 2t+8.., col g}, which is B[n = g][k ..] in nn.Linear layout; C regs {row g, cols 2t, 2t+1},
// {row g+8, cols 2t, 2t+1}.

#define GEMM_BM 64
#define GEMM_BN 128
#define GEMM_BK 32
#define GEMM_PAD 40
#define GEMM_THREADS 128

__device__ __forceinline__ unsigned int gemm_f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
        return 0x7FC0u;
    }
    u += 0x7FFFu + ((u >> 16) & 1u);
    return u >> 16;
}

#ifndef TRAY_EMULATED
// d += a * b for one warp's 16 x 8 x 16 tile (the CPU emulation supplies its own, lane by lane).
__device__ __forceinline__ void mma_bf16_m16n8k16(float* d, const unsigned int* a, const unsigned int* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// Rows [row0, row0 + rows) of a [.][K] bf16 matrix, columns k0 .. k0 + 31, as 16-byte vectors: vector v
// of this thread's `count` is row (tid + v * 128) / 4, columns k0 + 8 * ((tid + v * 128) % 4); rows at
// or beyond `limit` load zeros.
__device__ __forceinline__ void gemm_load(uint4* regs, int count, const uint4* src, long long row0, int limit,
                                          int K, int k0, int tid) {
#pragma unroll
    for (int v = 0; v < count; ++v) {
        const int i = tid + v * GEMM_THREADS;
        const int r = i >> 2;
        const int c = (i & 3) * 8;
        if (r < limit) {
            regs[v] = src[((row0 + r) * K + k0 + c) / 8];
        } else {
            regs[v].x = 0u;
            regs[v].y = 0u;
            regs[v].z = 0u;
            regs[v].w = 0u;
        }
    }
}

__device__ __forceinline__ void gemm_store(unsigned short* tile, const uint4* regs, int count, int tid) {
#pragma unroll
    for (int v = 0; v < count; ++v) {
        const int i = tid + v * GEMM_THREADS;
        *(uint4*)(tile + (i >> 2) * GEMM_PAD + (i & 3) * 8) = regs[v];
    }
}

// masked_gemm: see the top of this file.
//   A     [experts][cap][K] bf16       (the expert slab, or the activations)
//   B     [experts][N][K] bf16         (the experts' weights)
//   C     [experts][cap][N] bf16
//   rows  [experts] i32                rows present per expert (<= cap)
//   N = n * n_factor (a manifest passes vars, not expressions: w13 has 2 * ffn rows)
// grid (ceil(N / 128), ceil(cap / 64), experts), block 128.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS) ep_masked_gemm(const uint4* __restrict__ A,
                                                                         const uint4* __restrict__ B,
                                                                         unsigned int* __restrict__ C,
                                                                         const int* __restrict__ rows,
                                                                         int cap,
                                                                         int n,
                                                                         int n_factor,
                                                                         int K) {
    const int N = n * n_factor;
    const int e = blockIdx.z;
    const int m0 = blockIdx.y * GEMM_BM;
    const int n0 = blockIdx.x * GEMM_BN;
    const int present = rows[e] < cap ? rows[e] : cap;
    if (m0 >= present) {
        return;  // the whole block: no thread has reached a barrier
    }
    __shared__ __align__(16) unsigned short As[GEMM_BM * GEMM_PAD];  // 16 B: tiles are stored as uint4
    __shared__ __align__(16) unsigned short Bs[GEMM_BN * GEMM_PAD];
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int wm = (warp >> 1) * 32;
    const int wn = (warp & 1) * 64;
    const int g = lane >> 2;
    const int t = lane & 3;
    const long long a_row0 = (long long)e * cap + m0;
    const long long b_row0 = (long long)e * N + n0;
    const int a_limit = present - m0;
    const int b_limit = N - n0;

    float acc[2][8][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int ni = 0; ni < 8; ++ni) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                acc[mi][ni][j] = 0.0f;
            }
        }
    }
    uint4 a_regs[2];
    uint4 b_regs[4];
    gemm_load(a_regs, 2, A, a_row0, a_limit, K, 0, tid);
    gemm_load(b_regs, 4, B, b_row0, b_limit, K, 0, tid);
    gemm_store(As, a_regs, 2, tid);
    gemm_store(Bs, b_regs, 4, tid);
    __syncthreads();
    for (int k0 = 0; k0 < K; k0 += GEMM_BK) {
        const bool more = k0 + GEMM_BK < K;
        if (more) {  // the next tile's loads are in flight while this one is multiplied
            gemm_load(a_regs, 2, A, a_row0, a_limit, K, k0 + GEMM_BK, tid);
            gemm_load(b_regs, 4, B, b_row0, b_limit, K, k0 + GEMM_BK, tid);
        }
#pragma unroll
        for (int kk = 0; kk < GEMM_BK; kk += 16) {
            unsigned int af[2][4];
            unsigned int bf[8][2];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                const unsigned short* p = As + (wm + mi * 16 + g) * GEMM_PAD + kk + 2 * t;
                af[mi][0] = *(const unsigned int*)p;
                af[mi][1] = *(const unsigned int*)(p + 8 * GEMM_PAD);
                af[mi][2] = *(const unsigned int*)(p + 8);
                af[mi][3] = *(const unsigned int*)(p + 8 * GEMM_PAD + 8);
            }
#pragma unroll
            for (int ni = 0; ni < 8; ++ni) {
                const unsigned short* p = Bs + (wn + ni * 8 + g) * GEMM_PAD + kk + 2 * t;
                bf[ni][0] = *(const unsigned int*)p;
                bf[ni][1] = *(const unsigned int*)(p + 8);
            }
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
                for (int ni = 0; ni < 8; ++ni) {
                    mma_bf16_m16n8k16(acc[mi][ni], af[mi], bf[ni]);
                }
            }
        }
        __syncthreads();  // every warp is done reading this tile
        if (more) {
            gemm_store(As, a_regs, 2, tid);
            gemm_store(Bs, b_regs, 4, tid);
            __syncthreads();
        }
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int ni = 0; ni < 8; ++ni) {
            const int col = n0 + wn + ni * 8 + 2 * t;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = m0 + wm + mi * 16 + g + 8 * half;
                if (row < present && col < N) {
                    const unsigned int lo = gemm_f32_to_bf16(acc[mi][ni][2 * half]);
                    const unsigned int hi = gemm_f32_to_bf16(acc[mi][ni][2 * half + 1]);
                    C[(((long long)e * cap + row) * N + col) / 2] = lo | (hi << 16);
                }
            }
        }
    }
}
