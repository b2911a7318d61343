// ep_gemm: the experts' GEMMs driven by the device's row counts (manifests/ep_moe.json, "experts_masked").
//
// One launch computes every local expert: C[e][r][n] = bf16( sum_k A_e[r][k] * B[e][n][k] ) for the
// rows r < rows[e] the layout counted (ep_layout_place's expert_rows), every n < N. Tiles of rows at or
// beyond rows[e] exit before loading anything, so the capacity a graph must allow costs a block launch per
// unused tile, not its arithmetic. B [experts][N][K] (nn.Linear weights), C [experts][cap][N], bf16 in and
// out, float32 accumulation on the tensor cores (mma.sync m16n8k16), one round to nearest even at the end
// (the recipe of ep_math.cu). K % 32 == 0, N % 2 == 0 (the bench checks); partial tiles in M and N are
// masked. Where A_e's rows come from is the only difference between the two entries:
//   ep_masked_gemm         A_e[r] = A[e * cap + r]: a dense [experts][cap][K] operand (the activations)
//   ep_masked_gemm_gather  A_e[r] = A[a_index[e * cap + r]]: the received rows read in place, through the
//                          index the layout wrote per expert slot, so no copy into a per-expert slab
// Every output element is the same sequence of mma over the same K values in both, so the gather's bytes
// equal the dense kernel's over the slab the index describes.
//
// Block: 128 threads = 4 warps in a 2 x 2 grid over a 64 x 128 tile of C; each warp owns 32 x 64 (2 x 8
// mma tiles of 16 x 8). K advances 32 at a time through a ring of GEMM_STAGES shared-memory stages filled
// by cp.async (global -> shared without registers): while one stage is multiplied, the next
// GEMM_STAGES - 1 are in flight. At decode sizes an expert has a few rows, so the kernel streams weights:
// its speed is the bytes in flight per SM (3 stages x 12 KiB per block, up to 4 blocks per SM), not the
// tensor cores. Shared rows are padded to 40 bf16 (80 B), so the fragment loads (8 rows x 4 words per
// warp) hit 32 distinct banks; 3 stages x (64 + 128) rows x 80 B = 45 KiB, under the 48 KiB static limit.
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
#define GEMM_STAGES 3

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

// One 16-byte global -> shared copy in flight (cp.async.cg: cached in L2 only, the weights are read once);
// `valid` false writes 16 zero bytes and reads nothing (src-size 0), so masked rows need no branch later.
__device__ __forceinline__ void gemm_cp16(unsigned short* dst, const uint4* src, bool valid) {
#ifdef TRAY_EMULATED
    emu_cp_async(dst, src, valid ? 16 : 0);
#else
    const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
#endif
}

__device__ __forceinline__ void gemm_cp_commit() {
#ifdef TRAY_EMULATED
    emu_cp_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until at most GEMM_STAGES - 2 of this thread's committed groups are still in flight.
__device__ __forceinline__ void gemm_cp_wait() {
#ifdef TRAY_EMULATED
    emu_cp_wait(GEMM_STAGES - 2);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(GEMM_STAGES - 2) : "memory");
#endif
}

// Rows [row0, row0 + limit) of a [.][K] bf16 matrix, columns k0 .. k0 + 31, into a padded shared tile of
// `count` * 32 rows: vector v of this thread is tile row (tid + v * 128) / 4, columns 8 * ((tid + v * 128) % 4);
// rows at or beyond `limit` are zero-filled (their source address stays row0's, which is in bounds).
// (B's tiles; A's go through gemm_issue_rows, whose rows may come from anywhere.)
__device__ __forceinline__ void gemm_issue(unsigned short* tile, int count, const uint4* src, long long row0,
                                           int limit, int K, int k0, int tid) {
#pragma unroll
    for (int v = 0; v < count; ++v) {
        const int i = tid + v * GEMM_THREADS;
        const int r = i >> 2;
        const int c = (i & 3) * 8;
        const bool valid = r < limit;
        gemm_cp16(tile + r * GEMM_PAD + c, src + ((row0 + (valid ? r : 0)) * K + k0 + c) / 8, valid);
    }
}

// A's tile: this thread's GEMM_BM * 4 / GEMM_THREADS = 2 vectors, tile rows (tid / 4) and (tid / 4) + 32,
// columns 8 * (tid % 4), from row pointers fixed for the whole K loop (src[v]: the row's first vector of
// this thread's columns; valid[v] false: zero-filled, src[v] still in bounds).
__device__ __forceinline__ void gemm_issue_rows(unsigned short* tile, const uint4* const* src, const bool* valid,
                                                int k0, int tid) {
#pragma unroll
    for (int v = 0; v < 2; ++v) {
        const int r = (tid >> 2) + v * (GEMM_THREADS / 4);
        gemm_cp16(tile + r * GEMM_PAD + (tid & 3) * 8, src[v] + k0 / 8, valid[v]);
    }
}

// One warp's share of a K tile: rows row0 .. row0 + 16 * MI, columns col0 .. col0 + 8 * NI of the block's
// tile, from the shared stage (as, bs), accumulated into acc[mi][ni] (mma m16n8k16 tiles).
template <int MI, int NI>
__device__ __forceinline__ void gemm_warp_tile(float (*acc)[8][4], const unsigned short* as,
                                               const unsigned short* bs, int row0, int col0, int g, int t) {
#pragma unroll
    for (int kk = 0; kk < GEMM_BK; kk += 16) {
        unsigned int af[MI][4];
        unsigned int bf[NI][2];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
            const unsigned short* p = as + (row0 + mi * 16 + g) * GEMM_PAD + kk + 2 * t;
            af[mi][0] = *(const unsigned int*)p;
            af[mi][1] = *(const unsigned int*)(p + 8 * GEMM_PAD);
            af[mi][2] = *(const unsigned int*)(p + 8);
            af[mi][3] = *(const unsigned int*)(p + 8 * GEMM_PAD + 8);
        }
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
            const unsigned short* p = bs + (col0 + ni * 8 + g) * GEMM_PAD + kk + 2 * t;
            bf[ni][0] = *(const unsigned int*)p;
            bf[ni][1] = *(const unsigned int*)(p + 8);
        }
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
                mma_bf16_m16n8k16(acc[mi][ni], af[mi], bf[ni]);
            }
        }
    }
}

// masked_gemm: see the top of this file.
//   A        [.][K] bf16          the received rows (a_index given) or [experts][cap][K] (a_index null)
//   a_index  [experts][cap] i32   row of A for each slot r < rows[e] (ep_layout_place's slot_src), or null;
//                                 slots at or beyond rows[e] are never read
//   B        [experts][N][K] bf16 (the experts' weights)
//   C        [experts][cap][N] bf16
//   rows     [experts] i32        rows present per expert (<= cap)
//   N = n * n_factor (a manifest passes vars, not expressions: w13 has 2 * ffn rows)
// grid (ceil(N / 128), ceil(cap / 64), experts), block 128.
__device__ __forceinline__ void masked_gemm(const uint4* __restrict__ A,
                                            const int* __restrict__ a_index,
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
    __shared__ __align__(16) unsigned short As[GEMM_STAGES][GEMM_BM * GEMM_PAD];  // 16 B: cp.async targets
    __shared__ __align__(16) unsigned short Bs[GEMM_STAGES][GEMM_BN * GEMM_PAD];
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const long long a_slot0 = (long long)e * cap + m0;
    const long long b_row0 = (long long)e * N + n0;
    const int a_limit = present - m0;
    // This thread's A rows, once: a slot past the rows present keeps an in-bounds address (A's row 0 when
    // gathering, the tile's first row otherwise) and copies nothing.
    const uint4* a_src[2];
    bool a_valid[2];
#pragma unroll
    for (int v = 0; v < 2; ++v) {
        const int r = (tid >> 2) + v * (GEMM_THREADS / 4);
        a_valid[v] = r < a_limit;
        const long long row = a_index ? (a_valid[v] ? (long long)a_index[a_slot0 + r] : 0)
                                      : a_slot0 + (a_valid[v] ? r : 0);
        a_src[v] = A + (row * K + (tid & 3) * 8) / 8;
    }
    const int b_limit = N - n0;
    const int k_tiles = K / GEMM_BK;
    // The warps' share of the 64 x 128 tile follows the rows present (block-uniform), so an expert with a
    // few rows costs the tensor cores a quarter or half of a full tile, not all of it: 1..16 rows: each warp
    // 16 rows x 32 columns; 17..32: 32 x 32; more: 2 x 2 warps of 32 x 64. Every output element is the same
    // sequence of mma over K in every shape, so the bytes do not depend on the shape.
    const int shape = a_limit <= 16 ? 1 : a_limit <= 32 ? 2 : 3;
    const int wm = shape == 3 ? (warp >> 1) * 32 : 0;
    const int wn = shape == 3 ? (warp & 1) * 64 : warp * 32;
    const int m_tiles = shape == 1 ? 1 : 2;
    const int n_tiles = shape == 3 ? 8 : 4;

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
    // Prologue: K tiles 0 .. GEMM_STAGES - 2 in flight. Every step commits one group, empty or not, so
    // that "at most GEMM_STAGES - 2 groups pending" always means "K tile kt has landed" below.
#pragma unroll
    for (int s = 0; s < GEMM_STAGES - 1; ++s) {
        if (s < k_tiles) {
            gemm_issue_rows(As[s], a_src, a_valid, s * GEMM_BK, tid);
            gemm_issue(Bs[s], 4, B, b_row0, b_limit, K, s * GEMM_BK, tid);
        }
        gemm_cp_commit();
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
        gemm_cp_wait();    // this thread's copies of K tile kt have landed
        __syncthreads();   // everyone's have; and every warp is done with K tile kt - 1, whose stage is refilled next
        const int next = kt + GEMM_STAGES - 1;
        if (next < k_tiles) {
            const int s = next % GEMM_STAGES;
            gemm_issue_rows(As[s], a_src, a_valid, next * GEMM_BK, tid);
            gemm_issue(Bs[s], 4, B, b_row0, b_limit, K, next * GEMM_BK, tid);
        }
        gemm_cp_commit();
        const unsigned short* as = As[kt % GEMM_STAGES];
        const unsigned short* bs = Bs[kt % GEMM_STAGES];
        if (shape == 1) {
            gemm_warp_tile<1, 4>(acc, as, bs, wm, wn, g, t);
        } else if (shape == 2) {
            gemm_warp_tile<2, 4>(acc, as, bs, wm, wn, g, t);
        } else {
            gemm_warp_tile<2, 8>(acc, as, bs, wm, wn, g, t);
        }
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int ni = 0; ni < 8; ++ni) {
            if (mi >= m_tiles || ni >= n_tiles) {
                continue;
            }
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

extern "C" __global__ void __launch_bounds__(GEMM_THREADS) ep_masked_gemm(const uint4* __restrict__ A,
                                                                         const uint4* __restrict__ B,
                                                                         unsigned int* __restrict__ C,
                                                                         const int* __restrict__ rows,
                                                                         int cap,
                                                                         int n,
                                                                         int n_factor,
                                                                         int K) {
    masked_gemm(A, 0, B, C, rows, cap, n, n_factor, K);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS) ep_masked_gemm_gather(const uint4* __restrict__ A,
                                                                                const int* __restrict__ a_index,
                                                                                const uint4* __restrict__ B,
                                                                                unsigned int* __restrict__ C,
                                                                                const int* __restrict__ rows,
                                                                                int cap,
                                                                                int n,
                                                                                int n_factor,
                                                                                int K) {
    masked_gemm(A, a_index, B, C, rows, cap, n, n_factor, K);
}
