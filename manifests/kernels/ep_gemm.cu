// ep_gemm: the experts' GEMMs driven by the device's row counts (manifests/ep_moe.json, "experts_masked").
// (On Hopper, large batches can take ep_gemm_wgmma.cu instead: the same contract on warpgroup MMA.)
//
// One launch computes every local expert: C[e][r][n] = bf16( sum_k A_e[r][k] * B[e][n][k] ) for the
// rows r < rows[e] the layout counted (ep_layout_place's expert_rows), every n < N. Tiles of rows at or
// beyond rows[e] exit before loading anything, so the capacity a graph must allow costs a block launch per
// unused tile, not its arithmetic. B [experts][N][K] (nn.Linear weights), C [experts][cap][N], bf16 in and
// out, float32 accumulation on the tensor cores (mma.sync m16n8k16), one round to nearest even at the end
// (the recipe of ep_math.cu). K % 8 == 0, N % 2 == 0 (the bench checks); partial tiles in M, N and K are
// masked (columns of a K tile past K hold zeros, whose products add exactly nothing). Where A_e's rows come
// from is the only difference between the two entries:
//   ep_masked_gemm         A_e[r] = A[e * cap + r]: a dense [experts][cap][K] operand (the activations)
//   ep_masked_gemm_gather  A_e[r] = A[a_index[e * cap + r]]: the received rows read in place, through the
//                          index the layout wrote per expert slot, so no copy into a per-expert slab
// Every output element is the same sequence of mma over the same K values in both, so the gather's bytes
// equal the dense kernel's over the slab the index describes.
//
// Block: 128 threads = 4 warps over a GEMM_BM x GEMM_BN tile of C (default 128 x 128). K advances GEMM_BK
// at a time through a ring of GEMM_STAGES shared-memory stages filled by cp.async (global -> shared without
// registers): while one stage is multiplied, the next GEMM_STAGES - 1 are in flight.
// - Decode sizes (a few rows per expert) stream weights: the speed is the bytes in flight per SM and how long
//   a run of each weight row one copy reads (GEMM_BK * 2 bytes per row and stage), not the tensor cores. A
//   block of at most 32 rows asks L2 to fetch GEMM_PREFETCH bytes (0, 64, 128 or 256) around each weight
//   copy, so the next stages of a row come from DRAM in longer bursts, and lays its shared memory out as a
//   deeper ring of 32-row A tiles (GEMM_SKINNY_STAGES: 4 for the default shape, against 3 of 128 rows).
// - Blocks with more rows are bound by the tensor cores (there the prefetch hint measured slower).
//   GEMM_LDMATRIX 1 loads the mma fragments from shared memory with ldmatrix instead of 32-bit loads;
//   GEMM_PIPE 1 loads a K step's fragments while the previous step's mma run (measured no faster on H200,
//   bench/results/h200/expert_gemm_variants.json, so off).
// Shared rows are padded to GEMM_BK + 8 bf16, so the fragment loads (8 rows x 4 words per warp) hit 32
// distinct banks. The tile shape is fixed when the source is compiled (manifest "options", e.g.
// -DGEMM_BK=64); a ring over 48 KiB lives in dynamic shared memory, whose size the launch passes
// (GEMM_SMEM_BYTES; a launch with less traps, see masked_gemm). Every configuration sums each output element
// in the same order (mma over K in steps of 16, from k = 0 up), so the bytes do not depend on the tile shape
// (bench/expert_gemm.py checks every shape it times against the default, byte for byte).
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .bf16): lane = 4 g + t; A regs {row g, cols 2t..2t+1},
// {row g+8, same cols}, {row g, cols 2t+8..}, {row g+8, cols 2t+8..}; B regs {k 2t..2t+1, col g},
// {k 2t+8.., col g}, which is B[n = g][k ..] in nn.Linear layout; C regs {row g, cols 2t, 2t+1},
// {row g+8, cols 2t, 2t+1}.

#ifndef GEMM_BM
#define GEMM_BM 128
#endif
#ifndef GEMM_BN
#define GEMM_BN 128
#endif
#ifndef GEMM_BK
#define GEMM_BK 64
#endif
#ifndef GEMM_STAGES
#define GEMM_STAGES 3
#endif
#ifndef GEMM_PREFETCH
#define GEMM_PREFETCH 256
#endif
#ifndef GEMM_LDMATRIX
#define GEMM_LDMATRIX 1
#endif
#ifndef GEMM_PIPE
#define GEMM_PIPE 0
#endif
#define GEMM_PAD (GEMM_BK + 8)
#define GEMM_THREADS 128
#define GEMM_VPR (GEMM_BK / 8)                             // 16-byte vectors per tile row and stage
#define GEMM_A_VECS (GEMM_BM * GEMM_VPR / GEMM_THREADS)    // A vectors per thread and stage
#define GEMM_B_VECS (GEMM_BN * GEMM_VPR / GEMM_THREADS)    // B vectors per thread and stage
#define GEMM_SMEM_BYTES (GEMM_STAGES * (GEMM_BM + GEMM_BN) * GEMM_PAD * 2)
#define GEMM_STATIC_SMEM_MAX 49152                         // the static shared-memory limit per block
// Blocks of at most 32 rows use the same shared memory as a deeper ring of 32-row A tiles (see masked_gemm)
#define GEMM_SKINNY_ROWS 32
#define GEMM_SKINNY_STAGES (GEMM_SMEM_BYTES / ((GEMM_SKINNY_ROWS + GEMM_BN) * GEMM_PAD * 2))
#define GEMM_MI_MAX (GEMM_BM == 128 ? 4 : 2)                // mma tiles of 16 rows per warp, at most
#if GEMM_BM != 32 && GEMM_BM != 64 && GEMM_BM != 128
#error "GEMM_BM must be 32, 64 or 128 (the warp shapes below)"
#endif
#if GEMM_BN != 32 && GEMM_BN != 64 && GEMM_BN != 128
#error "GEMM_BN must be 32, 64 or 128"
#endif
#if GEMM_BK % 16 != 0 || GEMM_A_VECS < 1 || GEMM_A_VECS * GEMM_THREADS != GEMM_BM * GEMM_VPR || \
    GEMM_B_VECS < 1 || GEMM_B_VECS * GEMM_THREADS != GEMM_BN * GEMM_VPR
#error "GEMM_BK must be a multiple of 16 with whole 16-byte vectors per thread for A and B tiles"
#endif
#if GEMM_STAGES < 2
#error "GEMM_STAGES must be at least 2"
#endif
#if GEMM_BM > 32 && GEMM_BK < 32
#error "GEMM_BK must be at least 32 when GEMM_BM is over 32 (whole vectors per thread in 32-row A tiles)"
#endif
#if GEMM_PREFETCH != 0 && GEMM_PREFETCH != 64 && GEMM_PREFETCH != 128 && GEMM_PREFETCH != 256
#error "GEMM_PREFETCH must be 0, 64, 128 or 256"
#endif

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
// `prefetch`: the weight copies carry the L2 prefetch hint GEMM_PREFETCH (see the top of this file).
__device__ __forceinline__ void gemm_cp16(unsigned short* dst, const uint4* src, bool valid, bool prefetch) {
#ifdef TRAY_EMULATED
    (void)prefetch;
    emu_cp_async(dst, src, valid ? 16 : 0);
#else
    const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
#if GEMM_PREFETCH != 0
    if (prefetch) {
#if GEMM_PREFETCH == 64
        asm volatile("cp.async.cg.shared.global.L2::64B [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
                     "r"(valid ? 16 : 0) : "memory");
#elif GEMM_PREFETCH == 128
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
                     "r"(valid ? 16 : 0) : "memory");
#else
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
                     "r"(valid ? 16 : 0) : "memory");
#endif
        return;
    }
#else
    (void)prefetch;
#endif
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

// Wait until at most ST - 2 of this thread's committed groups are still in flight (a ring of ST stages).
template <int ST>
__device__ __forceinline__ void gemm_cp_wait() {
#ifdef TRAY_EMULATED
    emu_cp_wait(ST - 2);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(ST - 2) : "memory");
#endif
}

// B's tile: rows [row0, row0 + limit) of the [.][K] bf16 weights, columns k0 .. k0 + GEMM_BK - 1, into a
// padded shared tile of GEMM_BN rows: vector v of this thread is tile row (tid + v * 128) / GEMM_VPR,
// columns 8 * ((tid + v * 128) % GEMM_VPR); rows at or beyond `limit` are zero-filled (their source address
// stays row0's, which is in bounds).
__device__ __forceinline__ void gemm_issue(unsigned short* tile, const uint4* src, long long row0, int limit,
                                           int K, int k0, int tid, bool prefetch) {
#pragma unroll
    for (int v = 0; v < GEMM_B_VECS; ++v) {
        const int i = tid + v * GEMM_THREADS;
        const int r = i / GEMM_VPR;
        const int c = (i % GEMM_VPR) * 8;
        const bool valid = r < limit && k0 + c < K;
        gemm_cp16(tile + r * GEMM_PAD + c, src + ((row0 + (valid ? r : 0)) * K + (valid ? k0 + c : 0)) / 8, valid,
                  prefetch);
    }
}

// A's tile: this thread's AV vectors, tile rows tid / GEMM_VPR + v * (128 / GEMM_VPR), columns
// 8 * (tid % GEMM_VPR), from row pointers fixed for the whole K loop (src[v]: the row's first vector of this
// thread's columns; valid[v] false, or columns past K: zero-filled, the address still in bounds).
template <int AV>
__device__ __forceinline__ void gemm_issue_rows(unsigned short* tile, const uint4* const* src, const bool* valid,
                                                int K, int k0, int tid) {
    const int c = (tid % GEMM_VPR) * 8;
    const bool in_k = k0 + c < K;
#pragma unroll
    for (int v = 0; v < AV; ++v) {
        const int r = tid / GEMM_VPR + v * (GEMM_THREADS / GEMM_VPR);
        gemm_cp16(tile + r * GEMM_PAD + c, src[v] + (in_k ? k0 / 8 : 0), valid[v] && in_k, false);
    }
}

// ldmatrix: 4 (x4) or 2 (x2) 8 x 8 bf16 matrices from shared memory in one warp-wide load; lane l gives
// the address of row l % 8 of matrix l / 8, and receives in r[m] the word (row l / 4, columns 2 (l % 4) ..)
// of matrix m: the fragment layout of mma.m16n8k16, so each matrix is one fragment register.
__device__ __forceinline__ void gemm_ldsm_x4(unsigned int* r, const unsigned short* p) {
#ifdef TRAY_EMULATED
    emu_ldmatrix(r, p, 4);
#else
    const unsigned int a = (unsigned int)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
#endif
}

__device__ __forceinline__ void gemm_ldsm_x2(unsigned int* r, const unsigned short* p) {
#ifdef TRAY_EMULATED
    emu_ldmatrix(r, p, 2);
#else
    const unsigned int a = (unsigned int)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
#endif
}

// One warp's fragments of the 16-wide K step at kk: A rows row0 .. row0 + 16 * MI, B columns col0 ..
// col0 + 8 * NI of the shared stage (as, bs). By ldmatrix (GEMM_LDMATRIX 1: one shared load per two fragments
// of B, one per fragment of A) or by 32-bit shared loads; the registers hold the same values either way.
template <int MI, int NI>
__device__ __forceinline__ void gemm_frags(unsigned int (*af)[4], unsigned int (*bf)[2], const unsigned short* as,
                                           const unsigned short* bs, int row0, int col0, int kk, int g, int t) {
#if GEMM_LDMATRIX
    const int m = (4 * g + t) >> 3;  // the matrix this lane addresses a row of
    const int r = (4 * g + t) & 7;
    // A: matrices (rows +0, k +0), (rows +8, k +0), (rows +0, k +8), (rows +8, k +8) = a0..a3
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
        gemm_ldsm_x4(af[mi], as + (row0 + mi * 16 + r + (m & 1) * 8) * GEMM_PAD + kk + (m >> 1) * 8);
    }
    // B ([n][k] rows): matrices (n +0, k +0), (n +0, k +8), (n +8, k +0), (n +8, k +8) = b[ni], b[ni + 1]
#pragma unroll
    for (int ni = 0; ni < NI; ni += 2) {
        if (ni + 1 < NI) {
            unsigned int q[4];
            gemm_ldsm_x4(q, bs + (col0 + ni * 8 + r + (m >> 1) * 8) * GEMM_PAD + kk + (m & 1) * 8);
            bf[ni][0] = q[0];
            bf[ni][1] = q[1];
            bf[ni + 1][0] = q[2];
            bf[ni + 1][1] = q[3];
        } else {
            gemm_ldsm_x2(bf[ni], bs + (col0 + ni * 8 + r) * GEMM_PAD + kk + (m & 1) * 8);
        }
    }
#else
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
#endif
}

// One warp's share of a K tile: rows row0 .. row0 + 16 * MI, columns col0 .. col0 + 8 * NI of the block's
// tile, accumulated into acc[mi][ni] (mma m16n8k16 tiles), K steps of 16 in order. GEMM_PIPE 1 loads the
// next step's fragments before the current step's mma are issued (two fragment sets), so the shared loads
// overlap the tensor-core work instead of waiting for it (both are issued in program order).
template <int MI, int NI>
__device__ __forceinline__ void gemm_warp_tile(float (*acc)[GEMM_BN / 16][4], const unsigned short* as,
                                               const unsigned short* bs, int row0, int col0, int g, int t) {
#if GEMM_PIPE
    unsigned int af[2][MI][4];
    unsigned int bf[2][NI][2];
    gemm_frags<MI, NI>(af[0], bf[0], as, bs, row0, col0, 0, g, t);
#pragma unroll
    for (int step = 0; step < GEMM_BK / 16; ++step) {
        if (step + 1 < GEMM_BK / 16) {
            gemm_frags<MI, NI>(af[(step + 1) & 1], bf[(step + 1) & 1], as, bs, row0, col0, (step + 1) * 16, g, t);
        }
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
                mma_bf16_m16n8k16(acc[mi][ni], af[step & 1][mi], bf[step & 1][ni]);
            }
        }
    }
#else
#pragma unroll
    for (int kk = 0; kk < GEMM_BK; kk += 16) {
        unsigned int af[MI][4];
        unsigned int bf[NI][2];
        gemm_frags<MI, NI>(af, bf, as, bs, row0, col0, kk, g, t);
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
                mma_bf16_m16n8k16(acc[mi][ni], af[mi], bf[ni]);
            }
        }
    }
#endif
}

// The K loop of one block over a ring of ST stages in `smem`: ST A tiles of AR rows (the block's first AR
// rows; AR * GEMM_VPR / 128 vectors per thread), then ST B tiles of GEMM_BN rows. K tile kt is multiplied
// while tiles kt + 1 .. kt + ST - 1 are in flight.
template <int ST, int AR>
__device__ __forceinline__ void gemm_mainloop(float (*acc)[GEMM_BN / 16][4], unsigned short* smem,
                                              const uint4* const* a_src, const bool* a_valid, const uint4* B,
                                              long long b_row0, int b_limit, int K, int k_tiles, int shape, int wm,
                                              int wn, int tid, int g, int t) {
    constexpr int AV = AR * GEMM_VPR / GEMM_THREADS;
    constexpr int NQ = GEMM_BN / 32;  // mma tiles of 8 columns per warp in the first two shapes
    static_assert(ST * (AR + GEMM_BN) * GEMM_PAD * 2 <= GEMM_SMEM_BYTES, "the ring must fit the block's memory");
    static_assert(AV >= 1, "whole A vectors per thread");
    unsigned short* const As = smem;
    unsigned short* const Bs = smem + ST * AR * GEMM_PAD;
    const bool prefetch = shape <= 2;
    // Prologue: K tiles 0 .. ST - 2 in flight. Every step commits one group, empty or not, so that "at most
    // ST - 2 groups pending" always means "K tile kt has landed" below.
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) {
        if (s < k_tiles) {
            gemm_issue_rows<AV>(As + s * AR * GEMM_PAD, a_src, a_valid, K, s * GEMM_BK, tid);
            gemm_issue(Bs + s * GEMM_BN * GEMM_PAD, B, b_row0, b_limit, K, s * GEMM_BK, tid, prefetch);
        }
        gemm_cp_commit();
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
        gemm_cp_wait<ST>();  // this thread's copies of K tile kt have landed
        __syncthreads();     // everyone's have; and every warp is done with K tile kt - 1, whose stage is refilled next
        const int next = kt + ST - 1;
        if (next < k_tiles) {
            const int s = next % ST;
            gemm_issue_rows<AV>(As + s * AR * GEMM_PAD, a_src, a_valid, K, next * GEMM_BK, tid);
            gemm_issue(Bs + s * GEMM_BN * GEMM_PAD, B, b_row0, b_limit, K, next * GEMM_BK, tid, prefetch);
        }
        gemm_cp_commit();
        const unsigned short* as = As + (kt % ST) * AR * GEMM_PAD;
        const unsigned short* bs = Bs + (kt % ST) * GEMM_BN * GEMM_PAD;
        if (shape == 1) {
            gemm_warp_tile<1, NQ>(acc, as, bs, wm, wn, g, t);
        } else if (shape == 2) {
            gemm_warp_tile<2, NQ>(acc, as, bs, wm, wn, g, t);
        } else if (AR >= 64 && shape == 3) {
            gemm_warp_tile<2, 2 * NQ>(acc, as, bs, wm, wn, g, t);
        }
#if GEMM_BM == 128
        else if (AR == 128) {
            gemm_warp_tile<4, 2 * NQ>(acc, as, bs, wm, wn, g, t);
        }
#endif
    }
}

#if GEMM_SMEM_BYTES > GEMM_STATIC_SMEM_MAX && !defined(TRAY_EMULATED)
// The ring in dynamic shared memory: the launch must pass GEMM_SMEM_BYTES (manifest "shmem").
__device__ __forceinline__ unsigned int gemm_dynamic_smem_bytes() {
    unsigned int n;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}
#endif

// masked_gemm: see the top of this file.
//   A        [.][K] bf16          the received rows (a_index given) or [experts][cap][K] (a_index null)
//   a_index  [experts][cap] i32   row of A for each slot r < rows[e] (ep_layout_place's slot_src), or null;
//                                 slots at or beyond rows[e] are never read
//   B        [experts][N][K] bf16 (the experts' weights)
//   C        [experts][cap][N] bf16
//   rows     [experts] i32        rows present per expert (<= cap)
//   N = n * n_factor (a manifest passes vars, not expressions: w13 has 2 * ffn rows); K % 8 == 0
// grid (ceil(N / GEMM_BN), ceil(cap / GEMM_BM), experts), block 128, dynamic shared memory GEMM_SMEM_BYTES
// when that is over 48 KiB (a launch with less traps: the tile shape and the manifest disagree).
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
#if GEMM_SMEM_BYTES > GEMM_STATIC_SMEM_MAX && !defined(TRAY_EMULATED)
    if (gemm_dynamic_smem_bytes() < GEMM_SMEM_BYTES) {
        __trap();  // the ring would overrun the block's shared memory
    }
    extern __shared__ __align__(16) unsigned short gemm_smem[];
#else
    // static (or, in the CPU build, standing for the launch's dynamic memory); 16 B: cp.async targets
    __shared__ __align__(16) unsigned short gemm_smem[GEMM_SMEM_BYTES / 2];
#endif
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
    const uint4* a_src[GEMM_A_VECS];
    bool a_valid[GEMM_A_VECS];
#pragma unroll
    for (int v = 0; v < GEMM_A_VECS; ++v) {
        const int r = tid / GEMM_VPR + v * (GEMM_THREADS / GEMM_VPR);
        a_valid[v] = r < a_limit;
        const long long row = a_index ? (a_valid[v] ? (long long)a_index[a_slot0 + r] : 0)
                                      : a_slot0 + (a_valid[v] ? r : 0);
        a_src[v] = A + (row * K + (tid % GEMM_VPR) * 8) / 8;
    }
    const int b_limit = N - n0;
    const int k_tiles = (K + GEMM_BK - 1) / GEMM_BK;  // the last may be partial: its columns past K are zeros
    // The warps' share of the tile follows the rows present (block-uniform), so an expert with a few rows
    // costs the tensor cores a quarter or half of a full tile, not all of it: 1..16 rows: 4 warps side by
    // side, each 16 rows x GEMM_BN / 4 columns; 17..32: 32 x GEMM_BN / 4; 33..64 (GEMM_BM 64, 128): 2 x 2
    // warps of 32 x GEMM_BN / 2; more (GEMM_BM 128): 2 x 2 warps of 64 x GEMM_BN / 2. Every output element
    // is the same sequence of mma over K in every shape, so the bytes do not depend on the shape. Only the
    // first two shapes ask L2 to prefetch (GEMM_PREFETCH): they stream weights, the others reuse them.
    const int shape = a_limit <= 16 ? 1 : (a_limit <= 32 || GEMM_BM == 32) ? 2 : (a_limit <= 64 || GEMM_BM == 64) ? 3 : 4;
    const int wm = shape == 4 ? (warp >> 1) * 64 : shape == 3 ? (warp >> 1) * 32 : 0;
    const int wn = shape >= 3 ? (warp & 1) * (GEMM_BN / 2) : warp * (GEMM_BN / 4);
    const int m_tiles = shape == 1 ? 1 : shape == 4 ? 4 : 2;
    const int n_tiles = shape >= 3 ? 2 * GEMM_BN / 32 : GEMM_BN / 32;

    float acc[GEMM_MI_MAX][GEMM_BN / 16][4];
#pragma unroll
    for (int mi = 0; mi < GEMM_MI_MAX; ++mi) {
#pragma unroll
        for (int ni = 0; ni < GEMM_BN / 16; ++ni) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                acc[mi][ni][j] = 0.0f;
            }
        }
    }
#if GEMM_BM > GEMM_SKINNY_ROWS
    // A block of at most 32 rows streams weights: its bytes in flight are what count, so it lays the same
    // shared memory out as a deeper ring (GEMM_SKINNY_STAGES of 32-row A tiles and B tiles) instead of
    // GEMM_STAGES of GEMM_BM-row A tiles whose rows past 32 would only hold zeros.
    if (a_limit <= GEMM_SKINNY_ROWS) {
        gemm_mainloop<GEMM_SKINNY_STAGES, GEMM_SKINNY_ROWS>(acc, gemm_smem, a_src, a_valid, B, b_row0, b_limit, K,
                                                           k_tiles, shape, wm, wn, tid, g, t);
    } else
#endif
    {
        gemm_mainloop<GEMM_STAGES, GEMM_BM>(acc, gemm_smem, a_src, a_valid, B, b_row0, b_limit, K, k_tiles, shape,
                                           wm, wn, tid, g, t);
    }
#pragma unroll
    for (int mi = 0; mi < GEMM_MI_MAX; ++mi) {
#pragma unroll
        for (int ni = 0; ni < GEMM_BN / 16; ++ni) {
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
